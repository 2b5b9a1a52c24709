//! The Kubernetes side of a simulated cluster: the API server's objects and
//! server-side apply, the control-plane static pods and their versions,
//! Talos' bootstrap manifests, removed APIs, and forwarded ports.

pub(crate) mod deprecated;
pub(crate) mod discovery;
pub(crate) mod forward;
pub(crate) mod manifests;
pub(crate) mod objects;
pub(crate) mod pods;
pub(crate) mod selector;
pub(crate) mod ssa;
pub(crate) mod versions;
pub(crate) mod writes;
