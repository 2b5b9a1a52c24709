//! Node removal on the Talos side: a node gone from the inventory (but in
//! the state dir's record of the cluster's nodes, [`record`], or found on
//! the platform by the caller) is cordoned and drained, leaves etcd if it
//! is a control plane, is reset (graceful, STATE and EPHEMERAL wiped, as
//! `talosctl reset` does; on Talos v1.14+ also the ETCD, CRI, KUBELET and
//! LOG volumes, which may be partitions of their own there) and its Kubernetes Node is deleted. Plan, then
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

use std::path::Path;

use crate::inventory::Inventory;
pub use plan::{
    ClusterView, FoundBy, Member, NodeRemoval, RemovalPlan, RemoveError, RemovedNode, SeenKubeNode,
    Step, plan,
};
pub use record::{NodesRecord, RecordedNode};
pub use run::{
    Event, NodeReport, Observer, Outcome, RemovalReport, RemoveOptions, StepFailed, remove, survey,
};

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
