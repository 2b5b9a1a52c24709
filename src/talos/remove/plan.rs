//! The removal plan, decided without touching anything from what the
//! cluster showed ([`ClusterView`]): per node its role, where it is, its
//! etcd member and the steps it takes; the refusals (the last control
//! plane, etcd quorum) and the 2-member warning.
//!
//! # etcd's rule for removing a member
//! etcd (`server/etcdserver/server.go` `mayRemoveMember`, with
//! `--strict-reconfig-check`, the default Talos keeps;
//! `server/etcdserver/api/membership/cluster.go`
//! `IsReadyToRemoveVotingMember`) removes voting member X only when the
//! members other than X that are started number at least a quorum of the
//! others, `others / 2 + 1`; else "re-configuration failed due to not
//! enough started members". Its second check (the active peers after the
//! removal against `(members - 1) / 2 + 1`) asks the same of the same
//! numbers. Removing a learner needs no quorum. So the only member can
//! never go (others 0, quorum 1), and of 3 members with one down, the down
//! one may go (2 started of 2) but a healthy one may not (1 of 2). Here a
//! member counts as started only when its node answers and reports etcd
//! healthy: never more lenient than etcd. Removals are checked one after
//! the other, in the order the run does them.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use super::identity;
use crate::inventory::{Inventory, Role};

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
    #[error(
        "node {node} was recorded at {at}, which is now where inventory node {other} is reached: not removed (a Reset there would wipe {other}); if {node}'s machine is gone, drop its entry from the state dir's nodes.json"
    )]
    AddressReused {
        node: String,
        other: String,
        at: String,
    },
    /// Which machine answers where the node was is not the node of
    /// record's (issue 39).
    #[error(transparent)]
    Identity(#[from] IdentityRefusal),
    #[error("cannot start the async runtime: {0}")]
    Runtime(String),
}

/// Why a node to remove is not acted on: the machine that answers where
/// it was is not provably the machine of record. Names the node, the
/// address, and both IDs (their first [`identity::SHOWN`] characters).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, serde::Serialize)]
pub enum IdentityRefusal {
    #[error(
        "node {node}: the machine answering at {at} has node ID {answering}…, not {expected}: not removed, nothing reset or deleted (the address now belongs to another machine, or {node}'s machine was wiped and reinstalled); if {node}'s machine is gone, drop its entry from the state dir's nodes.json"
    )]
    Mismatch {
        node: String,
        at: String,
        /// What was expected, in words ("node ID abcd1234… (recorded)").
        expected: String,
        answering: String,
    },
    #[error(
        "node {node}: the machine answering at {at} is inventory node {other} (node ID {answering}…): not removed, nothing reset or deleted (a Reset there would wipe {other}); if {node}'s machine is gone, drop its entry from the state dir's nodes.json"
    )]
    InventoryNode {
        node: String,
        at: String,
        other: String,
        answering: String,
    },
    #[error(
        "node {node}: its recorded machine (node ID {id}…) is inventory node {other} now: not removed, nothing reset or deleted (the record is stale); drop {node}'s entry from the state dir's nodes.json"
    )]
    RecordedIsInventoryNode {
        node: String,
        other: String,
        id: String,
    },
    #[error(
        "node {node}: a machine answers at {at} (node ID {answering}…), but nothing says which machine {node} was (no node ID in nodes.json, which older imgbuild did not record, and no Kubernetes Node {node} with a machineID): not removed, nothing reset or deleted; stop or reset that machine by hand if it is {node}'s, then run again"
    )]
    Unknown {
        node: String,
        at: String,
        answering: String,
    },
    #[error(
        "node {node}: the machine answering at {at} shows no Talos node ID (Identities.cluster.talos.dev), so which machine it is cannot be proven: not removed, nothing reset or deleted"
    )]
    Unreadable { node: String, at: String },
}

impl IdentityRefusal {
    /// The message without its leading "node NAME: ", for a caller that
    /// names the node already.
    pub fn detail(&self) -> String {
        let node = match self {
            IdentityRefusal::Mismatch { node, .. }
            | IdentityRefusal::InventoryNode { node, .. }
            | IdentityRefusal::RecordedIsInventoryNode { node, .. }
            | IdentityRefusal::Unknown { node, .. }
            | IdentityRefusal::Unreadable { node, .. } => node,
        };
        let text = self.to_string();
        match text.strip_prefix(&format!("node {node}: ")) {
            Some(rest) => rest.to_owned(),
            None => text,
        }
    }
}

/// What says which machine a node to remove is.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "by", content = "id", rename_all = "kebab-case")]
pub enum Expected {
    /// The node ID recorded when imgbuild last brought the node up.
    NodeId(String),
    /// No ID recorded (an older record, or found in the cluster only): its
    /// Kubernetes Node's `status.nodeInfo.machineID`.
    MachineId(String),
    /// Nothing: it is acted on only while nothing answers where it was.
    Unknown,
}

impl Expected {
    /// The words for a plan or a message.
    pub fn describe(&self) -> String {
        match self {
            Expected::NodeId(id) => format!("node ID {}… (recorded)", identity::short(id)),
            Expected::MachineId(m) => {
                format!("machine ID {}… (its Kubernetes Node's)", identity::short(m))
            }
            Expected::Unknown => "unknown (acted on only while nothing answers)".to_owned(),
        }
    }

    /// The machine ID this machine has (`/etc/machine-id`), where known.
    pub fn machine_id(&self) -> Option<String> {
        match self {
            Expected::NodeId(id) => identity::machine_id(id),
            Expected::MachineId(m) => Some(m.clone()),
            Expected::Unknown => None,
        }
    }

    /// Whether a machine answering with node ID `id` is this one.
    fn matches(&self, id: &str) -> bool {
        match self {
            Expected::NodeId(r) => r == id,
            Expected::MachineId(m) => identity::machine_id(id).as_deref() == Some(m.as_str()),
            Expected::Unknown => false,
        }
    }
}

/// What is expected of node `r`: its recorded node ID, else its
/// Kubernetes Node's machine ID.
pub fn expected_of(r: &RemovedNode, kube: &[SeenKubeNode]) -> Expected {
    if let Some(id) = r.node_id.as_ref().filter(|i| identity::valid_node_id(i)) {
        return Expected::NodeId(id.clone());
    }
    kube.iter()
        .find(|k| k.name == r.name)
        .and_then(|k| k.machine_id.clone())
        .map_or(Expected::Unknown, Expected::MachineId)
}

/// The check before anything is done to node `node`: the machine that
/// answers at `at` with node ID `answering` (None: it answers without
/// one) must be the one `expected` says, and no inventory node (`ids`,
/// node ID by name).
pub fn check_identity(
    node: &str,
    at: &str,
    expected: &Expected,
    answering: Option<&str>,
    ids: &BTreeMap<String, String>,
) -> Result<(), IdentityRefusal> {
    let (node, at) = (node.to_owned(), at.to_owned());
    let Some(id) = answering.filter(|i| identity::valid_node_id(i)) else {
        return Err(IdentityRefusal::Unreadable { node, at });
    };
    if let Some((other, _)) = ids.iter().find(|(_, v)| v.as_str() == id) {
        return Err(IdentityRefusal::InventoryNode {
            node,
            at,
            other: other.clone(),
            answering: identity::short(id),
        });
    }
    match expected {
        Expected::Unknown => Err(IdentityRefusal::Unknown {
            node,
            at,
            answering: identity::short(id),
        }),
        e if e.matches(id) => Ok(()),
        e => Err(IdentityRefusal::Mismatch {
            node,
            at,
            expected: e.describe(),
            answering: identity::short(id),
        }),
    }
}

/// The inventory node now reached where `r` was: removal acts on an
/// address, and every node shares the cluster's CA, so a Reset sent there
/// would wipe that node. Matched by the node's own address and by where
/// its Talos API answers.
fn reused_by<'a>(inv: &'a Inventory, r: &RemovedNode) -> Option<(&'a str, String)> {
    inv.nodes.iter().find_map(|n| {
        let reached = n
            .talos_endpoint
            .as_deref()
            .and_then(crate::inventory::talos_endpoint)
            .or_else(|| {
                n.address
                    .map(|a| SocketAddr::new(a, crate::inventory::TALOS_API_PORT))
            });
        // `::ffff:10.0.0.22` is 10.0.0.22: compared in canonical form.
        let same =
            |a: IpAddr, b: Option<IpAddr>| b.is_some_and(|b| a.to_canonical() == b.to_canonical());
        if let Some(a) = r.address.filter(|a| same(*a, n.address)) {
            return Some((n.name.as_str(), a.to_string()));
        }
        r.endpoint
            .filter(|e| reached.is_some_and(|t| t.port() == e.port() && same(e.ip(), Some(t.ip()))))
            .map(|e| (n.name.as_str(), e.to_string()))
    })
}

/// Where a removed node was found.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FoundBy {
    /// The state dir's record of the cluster's nodes.
    Record,
    /// The platform (a VM or server carrying imgbuild's marker).
    Platform,
    /// The cluster itself: a Kubernetes Node or an etcd member by that
    /// name (what a fresh runner, without the record, still sees).
    Cluster,
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
    /// Its machine's node ID as recorded ([`identity`]).
    pub node_id: Option<String>,
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
            node_id: None,
            found_by: FoundBy::Platform,
        }
    }
}

/// A node's text for a message: escaped, one line, bounded.
pub(crate) fn shown(s: &str) -> String {
    crate::input::one_line(s, 200)
}

/// One etcd member as a remaining control plane lists it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Member {
    pub id: u64,
    /// Its name: the node's hostname; empty until it first started.
    pub hostname: String,
    pub learner: bool,
    /// Started, and its node answers with etcd healthy.
    pub healthy: bool,
    /// The hosts of its peer URLs.
    pub peer_hosts: Vec<IpAddr>,
}

/// One Kubernetes Node object.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SeenKubeNode {
    pub name: String,
    /// `status.addresses` of type InternalIP.
    pub internal_ip: Option<IpAddr>,
    /// Labelled `node-role.kubernetes.io/control-plane`.
    pub control_plane: bool,
    /// `status.nodeInfo.machineID`, when it is one (hex, bounded).
    pub machine_id: Option<String>,
}

/// What the cluster showed before the plan ([`super::survey`]).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ClusterView {
    /// The etcd members; None when no remaining control plane listed them.
    pub members: Option<Vec<Member>>,
    /// The control plane that listed them.
    pub members_from: Option<String>,
    /// The Kubernetes nodes; None when the API did not answer.
    pub kube_nodes: Option<Vec<SeenKubeNode>>,
    /// The removed nodes whose Talos API answered.
    pub answering: BTreeSet<String>,
    /// Of those, the node ID each answered with (None: none shown).
    pub identities: BTreeMap<String, Option<String>>,
    /// The inventory's nodes' node IDs, by name: as they answered, else as
    /// recorded. A node to remove is never one of these machines.
    pub inventory_ids: BTreeMap<String, String>,
}

/// One thing done to a node being removed, in this order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Step {
    /// Cordon and drain its Kubernetes node.
    Drain,
    /// Leave etcd: EtcdLeaveCluster on the node, or EtcdRemoveMemberByID
    /// from a remaining control plane when it does not answer.
    LeaveEtcd,
    /// MachineService.Reset: graceful, no reboot, STATE and EPHEMERAL wiped
    /// (Talos v1.14+: and ETCD, CRI, KUBELET, LOG).
    Reset,
    /// Delete its Kubernetes Node object.
    DeleteNode,
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Step::Drain => "cordon and drain",
            Step::LeaveEtcd => "leave etcd",
            Step::Reset => "reset",
            Step::DeleteNode => "delete the Kubernetes node",
        })
    }
}

/// One node's removal.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct NodeRemoval {
    pub node: String,
    pub role: Role,
    /// Its own address, where known.
    pub address: Option<IpAddr>,
    /// Where its Talos API is, where known (else no Reset: nothing to reach).
    pub endpoint: Option<SocketAddr>,
    /// Its etcd member (control planes that still are one).
    pub member: Option<u64>,
    /// Its Talos API answered when the cluster was read.
    pub answering: bool,
    /// Which machine it is: checked before every step while something
    /// answers where it was.
    pub expected: Expected,
    /// What the run does, in order.
    pub steps: Vec<Step>,
}

impl NodeRemoval {
    /// The identity check, in words, for the plan: by machine ID, which a
    /// recorded node ID and a Kubernetes Node both give, so a runner with
    /// the record and a fresh one plan the same words.
    pub fn identity_check(&self) -> String {
        match self.expected.machine_id() {
            Some(m) => format!(
                "identity checked before each step: whatever answers at its address must be machine {}…",
                identity::short(&m)
            ),
            None => "identity unknown (no node ID recorded, no Kubernetes Node): acted on only while nothing answers at its address".to_owned(),
        }
    }
}

/// Every removal, in the order the run takes them: workers, then control
/// planes one at a time.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct RemovalPlan {
    pub nodes: Vec<NodeRemoval>,
    /// etcd members left after the last removal (None: not known).
    pub members_after: Option<usize>,
    /// Things the user should know (a 2-member etcd).
    pub warnings: Vec<String>,
    /// The inventory nodes' node IDs (as surveyed): no step acts on a
    /// machine answering with one of them.
    pub inventory_ids: BTreeMap<String, String>,
}

impl RemovalPlan {
    /// Nothing to remove.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }
}

/// The warning for an etcd left with two members.
pub const TWO_MEMBERS: &str = "etcd is left with 2 members: a 2-member etcd cannot be upgraded without --force (Talos refuses: \"insufficient to maintain quorum\"), and losing either member loses quorum; add a control plane";

/// The warning for an etcd left with one member.
pub const ONE_MEMBER: &str = "etcd is left with a single member: the cluster has no fault tolerance, and losing that node loses the cluster; add control planes";

/// Why etcd would refuse to remove a member ([`may_remove`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuorumRefusal {
    /// Members other than the one removed.
    pub others: usize,
    /// Of those, started and healthy.
    pub healthy: usize,
    /// What etcd requires: `others / 2 + 1`.
    pub needed: usize,
}

/// etcd's rule (see the module doc): whether member `id` of `members` may
/// be removed. A learner always may; an unknown ID is not checked here.
pub fn may_remove(members: &[Member], id: u64) -> Result<(), QuorumRefusal> {
    if members.iter().any(|m| m.id == id && m.learner) {
        return Ok(());
    }
    let others: Vec<&Member> = members
        .iter()
        .filter(|m| m.id != id && !m.learner)
        .collect();
    let healthy = others.iter().filter(|m| m.healthy).count();
    let needed = others.len() / 2 + 1;
    if healthy < needed {
        return Err(QuorumRefusal {
            others: others.len(),
            healthy,
            needed,
        });
    }
    Ok(())
}

/// Kubernetes node names are DNS subdomains (RFC 1123): anything else is
/// not one, and would not be safe in an API path or a field selector.
pub fn valid_node_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

/// A removed node's own address: as given, else its Kubernetes Node's
/// InternalIP, else its etcd member's peer URL host.
pub fn address_of(r: &RemovedNode, kube: &[SeenKubeNode], members: &[Member]) -> Option<IpAddr> {
    r.address
        .or_else(|| {
            kube.iter()
                .find(|k| k.name == r.name)
                .and_then(|k| k.internal_ip)
        })
        .or_else(|| {
            let m = members.iter().find(|m| m.hostname == r.name)?;
            m.peer_hosts.first().copied()
        })
}

/// The member that is node `name` (its hostname), else the one whose peer
/// URL is at `address`.
fn member_of<'a>(members: &'a [Member], name: &str, address: Option<IpAddr>) -> Option<&'a Member> {
    members
        .iter()
        .find(|m| m.hostname == name)
        .or_else(|| address.and_then(|a| members.iter().find(|m| m.peer_hosts.contains(&a))))
}

/// Decides the removal of `removed` from what `view` showed: each node's
/// role and address (given, else from its etcd member and its Kubernetes
/// Node), its steps, and the order. Refuses a node still in the inventory,
/// a name that is not a node name, a node whose role nobody can tell, the
/// last control plane, and any removal etcd would refuse.
pub fn plan(
    inv: &Inventory,
    removed: &[RemovedNode],
    view: &ClusterView,
) -> Result<RemovalPlan, RemoveError> {
    let no_members: Vec<Member> = Vec::new();
    let members = view.members.as_deref().unwrap_or(&no_members);
    let kube = view.kube_nodes.as_deref().unwrap_or(&[]);
    let mut out: Vec<NodeRemoval> = Vec::new();
    for r in removed {
        if !valid_node_name(&r.name) {
            return Err(RemoveError::InvalidName {
                node: shown(&r.name),
            });
        }
        if inv.nodes.iter().any(|n| n.name == r.name) {
            return Err(RemoveError::InInventory {
                node: r.name.clone(),
            });
        }
        if out.iter().any(|n| n.node == r.name) {
            continue;
        }
        if let Some((other, at)) = reused_by(inv, r) {
            return Err(RemoveError::AddressReused {
                node: r.name.clone(),
                other: other.to_owned(),
                at,
            });
        }
        let expected = expected_of(r, kube);
        if let Some(id) = r.node_id.as_deref()
            && let Some((other, _)) = view.inventory_ids.iter().find(|(_, v)| v.as_str() == id)
        {
            return Err(IdentityRefusal::RecordedIsInventoryNode {
                node: r.name.clone(),
                other: other.clone(),
                id: identity::short(id),
            }
            .into());
        }
        let k8s = kube.iter().find(|k| k.name == r.name);
        let address = address_of(r, kube, members);
        let member = member_of(members, &r.name, address);
        let role = match r.role {
            Some(role) => role,
            None if member.is_some() || k8s.is_some_and(|k| k.control_plane) => Role::Controlplane,
            // Known to Kubernetes as a worker, or known to neither while
            // both answered: nothing of etcd to undo.
            None if k8s.is_some() || (view.members.is_some() && view.kube_nodes.is_some()) => {
                Role::Worker
            }
            None => {
                return Err(RemoveError::UnknownRole {
                    node: r.name.clone(),
                });
            }
        };
        let endpoint = r
            .endpoint
            .or_else(|| address.map(|a| SocketAddr::new(a, crate::inventory::TALOS_API_PORT)));
        // What answers where it was must be its machine, now as before
        // every step of the run.
        if let Some(answered) = view.identities.get(&r.name) {
            let at = endpoint.map(|e| e.to_string()).unwrap_or_default();
            check_identity(
                &r.name,
                &at,
                &expected,
                answered.as_deref(),
                &view.inventory_ids,
            )?;
        }
        let in_kubernetes = view.kube_nodes.is_none() || k8s.is_some();
        let member = if role == Role::Controlplane {
            member.map(|m| m.id)
        } else {
            None
        };
        let mut steps = Vec::new();
        if in_kubernetes {
            steps.push(Step::Drain);
        }
        if member.is_some() {
            steps.push(Step::LeaveEtcd);
        }
        if endpoint.is_some() {
            steps.push(Step::Reset);
        }
        if in_kubernetes {
            steps.push(Step::DeleteNode);
        }
        out.push(NodeRemoval {
            node: r.name.clone(),
            role,
            address,
            endpoint,
            member,
            answering: view.answering.contains(&r.name),
            expected,
            steps,
        });
    }
    // Workers first (they never touch etcd), then control planes whose
    // member is down or gone (removing those never costs quorum), then the
    // healthy ones.
    let healthy =
        |id: Option<u64>| id.is_some_and(|id| members.iter().any(|m| m.id == id && m.healthy));
    out.sort_by_key(|n| (n.role == Role::Controlplane, healthy(n.member)));
    if out.iter().any(|n| n.role == Role::Controlplane) && inv.control_planes().next().is_none() {
        let last = out.iter().rev().find(|n| n.role == Role::Controlplane);
        return Err(RemoveError::LastControlPlane {
            node: last.map(|n| n.node.clone()).unwrap_or_default(),
        });
    }
    if let Some(n) = out.iter().find(|n| n.role == Role::Controlplane)
        && view.members.is_none()
    {
        return Err(RemoveError::NoEtcdView {
            node: n.node.clone(),
        });
    }
    let mut left: Vec<Member> = members.to_vec();
    for n in out.iter().filter(|n| n.role == Role::Controlplane) {
        let Some(id) = n.member else { continue };
        if left.iter().filter(|m| m.id != id && !m.learner).count() == 0 {
            return Err(RemoveError::LastControlPlane {
                node: n.node.clone(),
            });
        }
        may_remove(&left, id).map_err(|q| RemoveError::Quorum {
            node: n.node.clone(),
            others: q.others,
            healthy: q.healthy,
            needed: q.needed,
        })?;
        left.retain(|m| m.id != id);
    }
    let members_after = view
        .members
        .as_ref()
        .map(|_| left.iter().filter(|m| !m.learner).count());
    let mut warnings = Vec::new();
    if out.iter().any(|n| n.member.is_some()) {
        match members_after {
            Some(2) => warnings.push(TWO_MEMBERS.to_owned()),
            Some(1) => warnings.push(ONE_MEMBER.to_owned()),
            _ => {}
        }
    }
    Ok(RemovalPlan {
        nodes: out,
        members_after,
        warnings,
        inventory_ids: view.inventory_ids.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(id: u64, name: &str, healthy: bool) -> Member {
        Member {
            id,
            hostname: name.into(),
            learner: false,
            healthy,
            peer_hosts: vec![format!("10.0.0.{id}").parse().unwrap()],
        }
    }

    fn three(down: &[u64]) -> Vec<Member> {
        (1..=3)
            .map(|i| member(i, &format!("cp-0{i}"), !down.contains(&i)))
            .collect()
    }

    #[test]
    fn etcd_rule_the_only_member_never_goes() {
        let one = vec![member(1, "cp-01", true)];
        assert_eq!(
            may_remove(&one, 1),
            Err(QuorumRefusal {
                others: 0,
                healthy: 0,
                needed: 1
            })
        );
    }

    #[test]
    fn etcd_rule_one_of_three_healthy_goes_leaving_two() {
        assert_eq!(may_remove(&three(&[]), 3), Ok(()));
    }

    #[test]
    fn etcd_rule_a_down_member_may_go_a_healthy_one_may_not_while_another_is_down() {
        assert_eq!(may_remove(&three(&[3]), 3), Ok(()));
        assert_eq!(
            may_remove(&three(&[3]), 2),
            Err(QuorumRefusal {
                others: 2,
                healthy: 1,
                needed: 2
            })
        );
    }

    #[test]
    fn etcd_rule_of_two_either_may_go_only_if_the_other_is_healthy() {
        let two = vec![member(1, "cp-01", true), member(2, "cp-02", false)];
        assert_eq!(may_remove(&two, 2), Ok(()));
        assert!(may_remove(&two, 1).is_err());
    }

    #[test]
    fn etcd_rule_learners_need_no_quorum_and_do_not_count() {
        let mut m = three(&[2, 3]);
        m[2].learner = true;
        assert_eq!(may_remove(&m, 3), Ok(()));
        m.push(Member {
            learner: true,
            ..member(4, "cp-04", true)
        });
        assert!(may_remove(&m, 1).is_err());
    }

    /// examples/atlas without `gone` (cp-01..03, worker-01..02).
    fn atlas_without(gone: &[&str]) -> Inventory {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/atlas/cluster.yaml");
        let mut inv = Inventory::load(&path).unwrap();
        inv.nodes.retain(|n| !gone.contains(&n.name.as_str()));
        inv
    }

    fn recorded(name: &str, role: Role, last: u8) -> RemovedNode {
        let address: IpAddr = format!("10.0.0.{last}").parse().unwrap();
        RemovedNode {
            name: name.into(),
            role: Some(role),
            address: Some(address),
            endpoint: Some(SocketAddr::new(address, 50000)),
            node_id: None,
            found_by: FoundBy::Record,
        }
    }

    fn kube(names: &[(&str, u8, bool)]) -> Vec<SeenKubeNode> {
        names
            .iter()
            .map(|(n, last, cp)| SeenKubeNode {
                name: (*n).into(),
                internal_ip: Some(format!("10.0.0.{last}").parse().unwrap()),
                control_plane: *cp,
                machine_id: None,
            })
            .collect()
    }

    /// A healthy 3+2 cluster as the survey would see it.
    fn healthy_view() -> ClusterView {
        let mut members = three(&[]);
        for (m, last) in members.iter_mut().zip([11, 12, 13]) {
            m.peer_hosts = vec![format!("10.0.0.{last}").parse().unwrap()];
        }
        ClusterView {
            members: Some(members),
            members_from: Some("cp-01".into()),
            kube_nodes: Some(kube(&[
                ("cp-01", 11, true),
                ("cp-02", 12, true),
                ("cp-03", 13, true),
                ("worker-01", 21, false),
                ("worker-02", 22, false),
            ])),
            answering: ["cp-03", "worker-02"].map(String::from).into(),
            ..ClusterView::default()
        }
    }

    #[test]
    fn a_worker_is_drained_reset_and_its_node_deleted_without_etcd() {
        let p = plan(
            &atlas_without(&["worker-02"]),
            &[recorded("worker-02", Role::Worker, 22)],
            &healthy_view(),
        )
        .unwrap();
        assert_eq!(
            p.nodes[0].steps,
            [Step::Drain, Step::Reset, Step::DeleteNode]
        );
        assert_eq!(p.nodes[0].member, None);
        assert_eq!(p.members_after, Some(3));
        assert!(p.warnings.is_empty());
    }

    #[test]
    fn a_recorded_address_now_an_inventory_nodes_is_never_removed() {
        // worker-02 was at 10.0.0.22; the inventory's worker-01 is there
        // now (the address was handed on): nothing is planned, both named.
        let mut inv = atlas_without(&["worker-02"]);
        let w1 = inv
            .nodes
            .iter_mut()
            .find(|n| n.name == "worker-01")
            .unwrap();
        w1.address = Some("10.0.0.22".parse().unwrap());
        w1.talos_endpoint = None;
        let e = plan(
            &inv,
            &[recorded("worker-02", Role::Worker, 22)],
            &healthy_view(),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("node worker-02 was recorded at 10.0.0.22")
                && e.contains("inventory node worker-01 is reached")
                && e.contains("would wipe worker-01"),
            "{e}"
        );
        // The same by the Talos endpoint alone (a NATed node).
        let mut gone = recorded("worker-02", Role::Worker, 22);
        gone.address = Some("192.168.9.9".parse().unwrap());
        let w1 = inv
            .nodes
            .iter_mut()
            .find(|n| n.name == "worker-01")
            .unwrap();
        w1.address = Some("10.0.0.21".parse().unwrap());
        w1.talos_endpoint = Some("10.0.0.22:50000".into());
        assert!(matches!(
            plan(&inv, &[gone.clone()], &healthy_view()),
            Err(RemoveError::AddressReused { .. })
        ));
        // Or written as an IPv4-mapped IPv6 address.
        gone.endpoint = Some("[::ffff:10.0.0.22]:50000".parse().unwrap());
        assert!(matches!(
            plan(&inv, &[gone], &healthy_view()),
            Err(RemoveError::AddressReused { .. })
        ));
    }

    /// Node IDs made with jxskiss/base62 (see `identity`'s tests) and the
    /// machine ID of the first.
    const ID_A: &str = "GGGPXIfmRdQvyhi3VuUA3ymIYfxi2HWz4Q6EfT9qCmFA";
    const MACHINE_A: &str = "0b30557a9fc4e90e33587da2c7ec1136";
    const ID_B: &str = "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA";
    const ID_C: &str = "fffffffffffffffffffffffffffffffffffffffffffffffffffB";

    /// worker-02 (recorded with `recorded_id`) answering with `answers`;
    /// the inventory's worker-01 is ID_C.
    fn answering_as(
        recorded_id: Option<&str>,
        answers: Option<&str>,
    ) -> Result<RemovalPlan, RemoveError> {
        let mut gone = recorded("worker-02", Role::Worker, 22);
        gone.node_id = recorded_id.map(str::to_owned);
        let mut view = healthy_view();
        view.identities
            .insert("worker-02".into(), answers.map(str::to_owned));
        view.inventory_ids.insert("worker-01".into(), ID_C.into());
        plan(&atlas_without(&["worker-02"]), &[gone], &view)
    }

    #[test]
    fn the_machine_answering_must_be_the_recorded_one() {
        let p = answering_as(Some(ID_A), Some(ID_A)).unwrap();
        assert_eq!(p.nodes[0].expected, Expected::NodeId(ID_A.into()));
        assert!(
            p.nodes[0]
                .identity_check()
                .contains("must be machine 0b30557a…")
        );
        assert_eq!(p.inventory_ids["worker-01"], ID_C);

        // Another machine at the address (or this one wiped and reinstalled).
        let e = answering_as(Some(ID_A), Some(ID_B)).unwrap_err();
        assert!(
            matches!(e, RemoveError::Identity(IdentityRefusal::Mismatch { .. })),
            "{e}"
        );
        let e = e.to_string();
        assert!(
            e.contains("node worker-02: the machine answering at 10.0.0.22:50000 has node ID AAAAAAAA…, not node ID GGGPXIfm… (recorded)"),
            "{e}"
        );

        // An inventory node's machine answers there.
        let e = answering_as(Some(ID_A), Some(ID_C))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("at 10.0.0.22:50000 is inventory node worker-01 (node ID ffffffff…)")
                && e.contains("would wipe worker-01"),
            "{e}"
        );

        // Answering without an ID proves nothing.
        let e = answering_as(Some(ID_A), None).unwrap_err();
        assert!(
            matches!(e, RemoveError::Identity(IdentityRefusal::Unreadable { .. })),
            "{e}"
        );

        // Named once where the caller names the node.
        let e = answering_as(Some(ID_A), Some(ID_B)).unwrap_err();
        let RemoveError::Identity(refusal) = e else {
            panic!("{e}")
        };
        assert!(
            refusal
                .detail()
                .starts_with("the machine answering at 10.0.0.22:50000"),
            "{}",
            refusal.detail()
        );

        // Not answering: nothing to prove now (the run checks again).
        let mut gone = recorded("worker-02", Role::Worker, 22);
        gone.node_id = Some(ID_A.into());
        assert!(plan(&atlas_without(&["worker-02"]), &[gone], &healthy_view()).is_ok());
    }

    #[test]
    fn a_record_naming_an_inventory_nodes_machine_is_stale() {
        // Whatever answers (or nothing): the recorded machine is worker-01.
        let e = answering_as(Some(ID_C), None).unwrap_err();
        assert!(
            matches!(&e, RemoveError::Identity(IdentityRefusal::RecordedIsInventoryNode { other, .. }) if other == "worker-01"),
            "{e}"
        );
    }

    #[test]
    fn without_a_recorded_id_the_kubernetes_nodes_machine_id_decides() {
        let mut view = healthy_view();
        for k in view.kube_nodes.as_mut().unwrap() {
            if k.name == "worker-02" {
                k.machine_id = Some(MACHINE_A.into());
            }
        }
        let gone = recorded("worker-02", Role::Worker, 22);
        let inv = atlas_without(&["worker-02"]);
        view.identities
            .insert("worker-02".into(), Some(ID_A.into()));
        let p = plan(&inv, std::slice::from_ref(&gone), &view).unwrap();
        assert_eq!(p.nodes[0].expected, Expected::MachineId(MACHINE_A.into()));
        view.identities
            .insert("worker-02".into(), Some(ID_B.into()));
        let e = plan(&inv, std::slice::from_ref(&gone), &view)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("not machine ID 0b30557a… (its Kubernetes Node's)"),
            "{e}"
        );
        // Neither: an answering machine is never acted on.
        let e = answering_as(None, Some(ID_A)).unwrap_err();
        assert!(
            matches!(e, RemoveError::Identity(IdentityRefusal::Unknown { .. })),
            "{e}"
        );
        assert!(
            e.to_string()
                .contains("nothing says which machine worker-02 was"),
            "{e}"
        );
    }

    #[test]
    fn a_control_plane_leaves_etcd_and_two_members_left_warn() {
        let p = plan(
            &atlas_without(&["cp-03"]),
            &[recorded("cp-03", Role::Controlplane, 13)],
            &healthy_view(),
        )
        .unwrap();
        assert_eq!(
            p.nodes[0].steps,
            [Step::Drain, Step::LeaveEtcd, Step::Reset, Step::DeleteNode]
        );
        assert_eq!(p.nodes[0].member, Some(3));
        assert_eq!(p.members_after, Some(2));
        assert_eq!(p.warnings, [TWO_MEMBERS]);
    }

    #[test]
    fn workers_go_first_and_a_platform_node_gets_role_and_address_from_the_cluster() {
        let found = RemovedNode {
            name: "cp-03".into(),
            role: None,
            address: None,
            endpoint: None,
            node_id: None,
            found_by: FoundBy::Platform,
        };
        let p = plan(
            &atlas_without(&["cp-03", "worker-02"]),
            &[found, recorded("worker-02", Role::Worker, 22)],
            &healthy_view(),
        )
        .unwrap();
        assert_eq!(p.nodes[0].node, "worker-02");
        assert_eq!(p.nodes[1].role, Role::Controlplane);
        assert_eq!(p.nodes[1].address, Some("10.0.0.13".parse().unwrap()));
        assert_eq!(
            p.nodes[1].endpoint,
            Some("10.0.0.13:50000".parse().unwrap())
        );
    }

    #[test]
    fn two_of_three_may_go_one_after_the_other_leaving_one_member_with_a_warning() {
        let p = plan(
            &atlas_without(&["cp-02", "cp-03"]),
            &[
                recorded("cp-02", Role::Controlplane, 12),
                recorded("cp-03", Role::Controlplane, 13),
            ],
            &healthy_view(),
        )
        .unwrap();
        assert_eq!(p.members_after, Some(1));
        assert_eq!(p.warnings, [ONE_MEMBER]);
    }

    #[test]
    fn a_down_member_goes_before_a_healthy_one_so_quorum_holds() {
        let mut view = healthy_view();
        view.members.as_mut().unwrap()[2].healthy = false; // cp-03 down
        let removed = [
            recorded("cp-02", Role::Controlplane, 12),
            recorded("cp-03", Role::Controlplane, 13),
        ];
        let p = plan(&atlas_without(&["cp-02", "cp-03"]), &removed, &view).unwrap();
        let order: Vec<&str> = p.nodes.iter().map(|n| n.node.as_str()).collect();
        assert_eq!(order, ["cp-03", "cp-02"]);
    }

    #[test]
    fn a_healthy_member_is_refused_while_another_is_down() {
        let mut view = healthy_view();
        view.members.as_mut().unwrap()[1].healthy = false; // cp-02 down
        let e = plan(
            &atlas_without(&["cp-03"]),
            &[recorded("cp-03", Role::Controlplane, 13)],
            &view,
        )
        .unwrap_err();
        assert!(
            matches!(e, RemoveError::Quorum { ref node, others: 2, healthy: 1, needed: 2 } if node == "cp-03"),
            "{e}"
        );
    }

    #[test]
    fn the_last_control_plane_is_refused() {
        let view = ClusterView {
            members: Some(vec![member(1, "cp-01", true)]),
            ..healthy_view()
        };
        let mut inv = atlas_without(&["cp-01", "cp-02", "cp-03"]);
        let e = plan(&inv, &[recorded("cp-01", Role::Controlplane, 11)], &view).unwrap_err();
        assert!(
            matches!(e, RemoveError::LastControlPlane { ref node } if node == "cp-01"),
            "{e}"
        );
        // Even with another control plane in the inventory that never joined.
        inv = atlas_without(&["cp-01"]);
        let e = plan(&inv, &[recorded("cp-01", Role::Controlplane, 11)], &view).unwrap_err();
        assert!(matches!(e, RemoveError::LastControlPlane { .. }), "{e}");
    }

    #[test]
    fn unknown_roles_nodes_still_listed_and_bad_names_are_refused() {
        let found = RemovedNode::on_platform("worker-09", None);
        let blind = ClusterView::default();
        let e = plan(&atlas_without(&[]), std::slice::from_ref(&found), &blind).unwrap_err();
        assert!(matches!(e, RemoveError::UnknownRole { .. }), "{e}");
        let e = plan(
            &atlas_without(&[]),
            &[recorded("worker-02", Role::Worker, 22)],
            &healthy_view(),
        )
        .unwrap_err();
        assert!(matches!(e, RemoveError::InInventory { .. }), "{e}");
        let e = plan(
            &atlas_without(&[]),
            &[RemovedNode::on_platform("vm/../x\n", None)],
            &healthy_view(),
        )
        .unwrap_err();
        assert!(matches!(e, RemoveError::InvalidName { .. }), "{e}");
    }

    #[test]
    fn node_names_are_dns_subdomains() {
        for ok in ["worker-02", "cp-01.lab", "a"] {
            assert!(valid_node_name(ok), "{ok}");
        }
        for bad in ["", "Worker", "a/b", "-a", "a-", "a..b", "x?y=1", "a b"] {
            assert!(!valid_node_name(bad), "{bad}");
        }
    }
}
