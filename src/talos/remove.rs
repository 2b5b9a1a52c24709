//! Node removal on the Talos side: a node gone from the inventory (but in
//! the state dir's record of the cluster's nodes, [`record`], or found on
//! the platform by the caller) is cordoned and drained, leaves etcd if it
//! is a control plane, is reset (graceful, STATE and EPHEMERAL wiped, as
//! `talosctl reset` does) and its Kubernetes Node is deleted. Plan, then
//! converge: [`survey`] reads the cluster, [`plan`] decides (refusing the
//! last control plane and anything etcd's quorum rule refuses), [`remove`]
//! carries the plan out one node at a time, each step finding what a
//! stopped run already did. Deleting the machine itself is the platform's
//! business (`publish`), not this module's.
//!
//! Calling it (what `up` does):
//! ```text
//! let mut removed = remove::removed_nodes(&inv, &prepared.state_dir.path)?;
//! remove::add_found(&mut removed, RemovedNode::on_platform("worker-02", None)); // by a platform marker
//! let view = remove::survey(&prepared, &removed, &limits)?;     // reads, changes nothing
//! let plan = remove::plan(&inv, &removed, &view)?;              // pure; refusals are errors
//! let report = remove::remove(&prepared, &plan, &RemoveOptions::default(), &observer)?;
//! ```

pub mod plan;
pub mod record;
mod run;

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::inventory::{Inventory, Role};
use crate::talos::bootstrap::Options;
use crate::talos::stage::Prepared;
pub use plan::{ClusterView, Member, NodeRemoval, RemovalPlan, SeenKubeNode, Step, plan};
pub use record::{NodesRecord, RecordedNode};
pub use run::{Event, NodeReport, Observer, Outcome, RemovalReport, StepFailed, remove, survey};

/// Why nodes cannot be removed (or the removal cannot start). Names the
/// node; text from outside is escaped and bounded.
#[derive(Debug, thiserror::Error)]
pub enum RemoveError {
    #[error("{}: {source}", path.display())]
    Record {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{node} is not a Kubernetes node name (an RFC 1123 subdomain: lowercase letters, digits, '-' and '.'): not removed"
    )]
    InvalidName { node: String },
    #[error("node {node} is in the inventory: only nodes gone from it are removed")]
    InInventory { node: String },
    #[error(
        "node {node}: neither etcd nor Kubernetes could be read to tell whether it is a control plane; not removed (is a control plane up? is the kubeconfig in the state dir?)"
    )]
    UnknownRole { node: String },
    #[error(
        "node {node} is a control plane, but no remaining control plane listed the etcd members, so quorum cannot be checked; not removed"
    )]
    NoEtcdView { node: String },
    #[error(
        "node {node}: refusing to remove the last control plane (etcd would have no member left)"
    )]
    LastControlPlane { node: String },
    #[error(
        "node {node}: etcd would refuse to remove its member: of the {others} other members {healthy} are started and healthy, and etcd needs {needed} (a quorum of the others); bring the unhealthy members back first"
    )]
    Quorum {
        node: String,
        others: usize,
        healthy: usize,
        needed: usize,
    },
    #[error("cannot start the async runtime: {0}")]
    Runtime(String),
}

/// Where a removed node was found.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FoundBy {
    /// The state dir's record of the cluster's nodes.
    Record,
    /// The platform (a VM or server carrying imgbuild's marker).
    Platform,
}

/// A node to remove: in the record (or on the platform) but not in the
/// inventory. Role and address may be unknown for one found on the
/// platform: [`survey`] and [`plan`] then take them from etcd and
/// Kubernetes.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RemovedNode {
    pub name: String,
    pub role: Option<Role>,
    /// Its own address (the name its Talos certificate carries).
    pub address: Option<IpAddr>,
    /// Where its Talos API is (else `address:50000`).
    pub endpoint: Option<SocketAddr>,
    pub found_by: FoundBy,
}

impl RemovedNode {
    /// A node found on the platform by name, its address if the platform
    /// knows it.
    pub fn on_platform(name: &str, address: Option<IpAddr>) -> RemovedNode {
        RemovedNode {
            name: name.to_owned(),
            role: None,
            address,
            endpoint: None,
            found_by: FoundBy::Platform,
        }
    }
}

/// The nodes of record ([`record::NodesRecord`] in `state_dir`) that the
/// inventory no longer has, in the record's order.
pub fn removed_nodes(inv: &Inventory, state_dir: &Path) -> Result<Vec<RemovedNode>, RemoveError> {
    let record = NodesRecord::load(state_dir).map_err(|source| RemoveError::Record {
        path: NodesRecord::path(state_dir),
        source,
    })?;
    Ok(record
        .nodes
        .into_iter()
        .filter(|r| !inv.nodes.iter().any(|n| n.name == r.name))
        .map(|r| RemovedNode {
            name: r.name,
            role: Some(r.role),
            address: Some(r.address),
            endpoint: Some(r.endpoint),
            found_by: FoundBy::Record,
        })
        .collect())
}

/// Adds a node found on the platform to `removed`, unless it is there
/// already (then only an address the record lacked is filled in).
pub fn add_found(removed: &mut Vec<RemovedNode>, found: RemovedNode) {
    match removed.iter_mut().find(|r| r.name == found.name) {
        Some(r) => r.address = r.address.or(found.address),
        None => removed.push(found),
    }
}

/// What the run may take beyond the plan.
#[derive(Debug, Clone)]
pub struct RemoveOptions {
    /// Call timeout and polling (as the bootstrap's).
    pub limits: Options,
    /// Cordon and drain, per node (talosctl's default, 5 minutes).
    pub drain_timeout: Duration,
    /// From Reset until the node stops answering.
    pub reset_timeout: Duration,
}

impl Default for RemoveOptions {
    fn default() -> Self {
        RemoveOptions {
            limits: Options::default(),
            drain_timeout: crate::talos::upgrade::drain::DRAIN_TIMEOUT,
            reset_timeout: Duration::from_secs(600),
        }
    }
}

/// A node's text for a message: escaped, one line, bounded.
pub(crate) fn shown(s: &str) -> String {
    crate::input::one_line(s, 200)
}

/// For [`survey`] and the run: the state dir holding the record.
fn state_dir(prepared: &Prepared) -> &Path {
    &prepared.state_dir.path
}
