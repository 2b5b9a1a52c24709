//! Kubernetes upgrades as `talosctl upgrade-k8s` makes them, and the
//! components' versions for `status`: the compatibility table and the minor
//! rule ([`compat`]), the APIs each minor removes ([`removed`]), the
//! component flags, feature gates and admission plugins it removes
//! ([`flags`]), how the bootstrap manifests are synced per Talos version
//! ([`manifests`]), the typed
//! plan ([`plan`]), what the live cluster shows ([`observe`]) and the run
//! ([`run`]).

pub mod api;
pub mod compat;
pub mod flags;
pub mod manifests;
pub mod observe;
pub mod plan;
pub mod removed;
pub mod run;
pub mod status;
