//! Node removal on the Talos side: a node gone from the inventory (but in
//! the state dir's record of the cluster's nodes, [`record`], found on the
//! platform by the caller, or shown by the cluster itself: a Kubernetes
//! Node or etcd member, [`found_in_cluster`]; the record is a cache) is cordoned and drained, leaves etcd if it
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
//! let view = remove::survey_with_cluster(&inv, &prepared, &mut removed, &limits)?; // reads (and adds what the cluster shows), changes nothing
//! let plan = remove::plan(&inv, &removed, &view)?;              // pure; refusals are errors
//! let report = remove::remove(&prepared, &plan, &RemoveOptions::default(), &observer)?;
//! ```

pub mod identity;
pub mod plan;
pub mod record;
mod run;

use std::path::Path;

use crate::inventory::Inventory;
pub use plan::{
    ClusterView, Expected, FoundBy, IdentityRefusal, Member, NodeRemoval, RemovalPlan, RemoveError,
    RemovedNode, SeenKubeNode, Step, plan,
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
            node_id: r.node_id,
            found_by: FoundBy::Record,
        })
        .collect())
}

/// The nodes the cluster shows that the inventory no longer has: its
/// Kubernetes Nodes (with their InternalIP) and its etcd members (by
/// hostname, with their peer address), so a runner without the state
/// dir's record plans the removal the record would. Names no Kubernetes
/// node could have are not taken (nothing is sent to them), nor a node at
/// one of the `known` addresses (where the inventory's nodes are reached):
/// that is an inventory node whose hostname is not its inventory name (a
/// `HostnameConfig` patch), never one to remove.
pub fn found_in_cluster(
    inv: &Inventory,
    view: &ClusterView,
    known: &[std::net::IpAddr],
) -> Vec<RemovedNode> {
    let mut out: Vec<RemovedNode> = Vec::new();
    let known: Vec<std::net::IpAddr> = known
        .iter()
        .copied()
        .chain(cluster_addresses(inv))
        .collect();
    let ours = |a: Option<std::net::IpAddr>| {
        a.is_some_and(|a| known.iter().any(|k| k.to_canonical() == a.to_canonical()))
    };
    let gone =
        |name: &str| plan::valid_node_name(name) && !inv.nodes.iter().any(|n| n.name == name);
    for k in view.kube_nodes.iter().flatten() {
        if !gone(&k.name) || ours(k.internal_ip) {
            continue;
        }
        add_found(
            &mut out,
            RemovedNode {
                name: k.name.clone(),
                role: None,
                address: k.internal_ip,
                endpoint: None,
                node_id: None,
                found_by: FoundBy::Cluster,
            },
        );
    }
    for m in view.members.iter().flatten() {
        if !gone(&m.hostname) || m.peer_hosts.iter().any(|h| ours(Some(*h))) {
            continue;
        }
        add_found(
            &mut out,
            RemovedNode {
                name: m.hostname.clone(),
                role: None,
                address: m.peer_hosts.first().copied(),
                endpoint: None,
                node_id: None,
                found_by: FoundBy::Cluster,
            },
        );
    }
    out
}

/// Reads the cluster ([`survey`]) for `removed` and adds to it the nodes
/// the cluster shows that the inventory lacks ([`found_in_cluster`]);
/// read again when it found any, so that their answering is known.
/// Changes nothing. Blocking.
pub fn survey_with_cluster(
    inv: &Inventory,
    prepared: &crate::talos::stage::Prepared,
    removed: &mut Vec<RemovedNode>,
    limits: &crate::talos::bootstrap::Options,
) -> Result<ClusterView, RemoveError> {
    let view = survey(prepared, removed, limits)?;
    let before = removed.len();
    let known: Vec<std::net::IpAddr> = prepared
        .plan
        .nodes
        .iter()
        .flat_map(|n| [n.address, n.endpoint.addr.ip()])
        .chain(inv.nodes.iter().filter_map(|n| n.address))
        .collect();
    for found in found_in_cluster(inv, &view, &known) {
        add_found(removed, found);
    }
    if removed.len() == before {
        return Ok(view);
    }
    survey(prepared, removed, limits)
}

/// The addresses the cluster itself answers at (the VIP, the hosts of
/// `endpoint` and `kubernetesEndpoint`): a Node reporting one of them is
/// never taken for a machine to Reset, for whatever answers there is a
/// live control plane (or a load balancer in front of them).
fn cluster_addresses(inv: &Inventory) -> Vec<std::net::IpAddr> {
    let hosts = [
        Some(inv.cluster.endpoint.as_str()),
        inv.cluster.kubernetes_endpoint.as_deref(),
    ];
    hosts
        .into_iter()
        .flatten()
        .filter_map(crate::inventory::endpoint_host)
        .filter_map(|h| h.parse().ok())
        .chain(inv.cluster.vip)
        .collect()
}

/// Adds a node found on the platform to `removed`, unless it is there
/// already (then only an address the record lacked is filled in).
pub fn add_found(removed: &mut Vec<RemovedNode>, found: RemovedNode) {
    match removed.iter_mut().find(|r| r.name == found.name) {
        Some(r) => r.address = r.address.or(found.address),
        None => removed.push(found),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::Role;

    fn inventory() -> Inventory {
        let mut inv: Inventory = serde_yaml_ng::from_str(
            "cluster: {name: c, talosVersion: v1.11.5, kubernetesVersion: v1.32.1, endpoint: \"https://10.0.0.10:6443\"}\nnodes:\n  - {name: cp-01, role: controlplane, address: 10.0.0.11}\n  - {name: w-01, role: worker, address: 10.0.0.21}\n",
        )
        .unwrap();
        inv.base_dir = std::path::PathBuf::from("/");
        inv
    }

    fn kube(name: &str, ip: &str) -> SeenKubeNode {
        SeenKubeNode {
            name: name.into(),
            internal_ip: Some(ip.parse().unwrap()),
            control_plane: false,
            machine_id: None,
        }
    }

    #[test]
    fn the_cluster_names_the_nodes_the_inventory_lost() {
        // A fresh runner has no nodes.json: what Kubernetes and etcd show
        // that the inventory lacks is to remove, with the address they
        // give; a name no Kubernetes node could have is not taken, nor a
        // node at an inventory node's address (that node, renamed).
        let view = ClusterView {
            members: Some(vec![
                Member {
                    id: 1,
                    hostname: "cp-01".into(),
                    learner: false,
                    healthy: true,
                    peer_hosts: vec!["10.0.0.11".parse().unwrap()],
                },
                Member {
                    id: 2,
                    hostname: "cp-02".into(),
                    learner: false,
                    healthy: false,
                    peer_hosts: vec!["10.0.0.12".parse().unwrap()],
                },
                Member {
                    id: 3,
                    hostname: String::new(),
                    learner: true,
                    healthy: false,
                    peer_hosts: vec![],
                },
            ]),
            kube_nodes: Some(vec![
                kube("cp-01", "10.0.0.11"),
                kube("w-01", "10.0.0.21"),
                kube("w-02", "10.0.0.22"),
                kube("Bad_Name", "10.0.0.99"),
                // w-01 under the hostname a patch gave it.
                kube("worker-one", "10.0.0.21"),
                // A Node claiming the cluster endpoint's address (the VIP
                // a live control plane holds), as IPv4 and IPv4-mapped.
                kube("evil", "10.0.0.10"),
                kube("evil-6", "::ffff:10.0.0.10"),
            ]),
            ..ClusterView::default()
        };
        let known: Vec<std::net::IpAddr> =
            vec!["10.0.0.11".parse().unwrap(), "10.0.0.21".parse().unwrap()];
        let found = found_in_cluster(&inventory(), &view, &known);
        let rows: Vec<(&str, Option<String>, &FoundBy)> = found
            .iter()
            .map(|r| {
                (
                    r.name.as_str(),
                    r.address.map(|a| a.to_string()),
                    &r.found_by,
                )
            })
            .collect();
        assert_eq!(
            rows,
            [
                ("w-02", Some("10.0.0.22".into()), &FoundBy::Cluster),
                ("cp-02", Some("10.0.0.12".into()), &FoundBy::Cluster),
            ]
        );
        // The record's entry keeps its role and endpoint; the cluster only
        // fills in what it lacked.
        let mut removed = vec![RemovedNode {
            name: "w-02".into(),
            role: Some(Role::Worker),
            address: None,
            endpoint: Some("10.0.0.22:50000".parse().unwrap()),
            node_id: None,
            found_by: FoundBy::Record,
        }];
        for f in found {
            add_found(&mut removed, f);
        }
        assert_eq!(removed.len(), 2);
        assert_eq!(removed[0].found_by, FoundBy::Record);
        assert_eq!(removed[0].role, Some(Role::Worker));
        assert_eq!(removed[0].address, Some("10.0.0.22".parse().unwrap()));
    }
}
