//! `imgbuild status`: each node against the inventory, read from the
//! nodes themselves: reachable, Talos version, schematic, config in sync
//! (the node's dry-run diff is empty), etcd member, Kubernetes Ready.
//! `up` reports drift from the same rows.

use std::collections::BTreeMap;

use super::bootstrap::{Options, Plan};
use super::client::{ApplyMode, Mode, NodeClient};
use super::config::Fingerprints;
use super::upgrade::{Record, Wanted, kube_ready, running};
use crate::inventory::Role;

/// One node's row.
#[derive(Debug, Clone, serde::Serialize)]
pub struct NodeStatus {
    pub node: String,
    pub role: String,
    pub reachable: bool,
    pub version: Option<String>,
    pub wanted_version: String,
    pub schematic: Option<String>,
    pub wanted_schematic: String,
    /// Whether the running schematic is the wanted one (base, or the node's
    /// own with META before its first upgrade).
    pub schematic_in_sync: bool,
    /// None when the node could not be asked.
    pub config_in_sync: Option<bool>,
    /// Control planes only: whether etcd lists it as a member.
    pub etcd_member: Option<bool>,
    /// None when Kubernetes could not be asked.
    pub ready: Option<bool>,
    /// What went wrong asking the node.
    pub error: Option<String>,
    /// `${NAME}`s not set here whose values were compared by the
    /// fingerprint recorded when they were last applied.
    pub compared_by_fingerprint: Vec<String>,
}

/// What differs from the inventory, and the command that fixes it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Drift {
    pub node: String,
    /// `version`, `schematic`, `config` or `unreachable`.
    pub what: &'static str,
    pub fix: &'static str,
}

impl NodeStatus {
    /// The ways this node drifted from the inventory.
    pub fn drift(&self) -> Vec<Drift> {
        let d = |what, fix| Drift {
            node: self.node.clone(),
            what,
            fix,
        };
        if !self.reachable {
            return vec![d("unreachable", "imgbuild bootstrap")];
        }
        let mut out = Vec::new();
        if self.version.as_deref() != Some(self.wanted_version.as_str()) {
            out.push(d("version", "imgbuild upgrade"));
        }
        if !self.schematic_in_sync {
            out.push(d("schematic", "imgbuild upgrade"));
        }
        if self.config_in_sync == Some(false) {
            out.push(d("config", "imgbuild apply"));
        }
        out
    }
}

/// Every node's row, in inventory order.
pub async fn collect(
    plan: &Plan,
    wanted: &BTreeMap<String, Wanted>,
    record: &Record,
    fingerprints: &Fingerprints,
    opts: &Options,
) -> Vec<NodeStatus> {
    let ready = kube_ready(plan, opts).await.ok();
    let mut rows = read_nodes(plan, wanted, record, fingerprints, opts).await;
    for row in &mut rows {
        row.ready = ready
            .as_ref()
            .map(|list| list.iter().any(|(n, r)| *n == row.node && *r));
    }
    rows
}

/// How the nodes differ from the inventory, from the same rows without
/// asking Kubernetes: `up` knows who is Ready from its last health round.
pub async fn drift(
    plan: &Plan,
    wanted: &BTreeMap<String, Wanted>,
    record: &Record,
    fingerprints: &Fingerprints,
    opts: &Options,
) -> Vec<Drift> {
    read_nodes(plan, wanted, record, fingerprints, opts)
        .await
        .iter()
        .flat_map(NodeStatus::drift)
        .collect()
}

/// Every node's row as the nodes tell it (Ready left unknown).
async fn read_nodes(
    plan: &Plan,
    wanted: &BTreeMap<String, Wanted>,
    record: &Record,
    fingerprints: &Fingerprints,
    opts: &Options,
) -> Vec<NodeStatus> {
    let mode = Mode::Mtls(plan.identity.clone());
    let mut members: Option<Vec<String>> = None;
    let mut rows = Vec::new();
    for node in &plan.nodes {
        let want = &wanted[&node.name];
        let now = running(plan, node, record, opts).await;
        let schematic_ok = now.schematic_is(want);
        let mut row = NodeStatus {
            node: node.name.clone(),
            role: if node.role == Role::Controlplane {
                "controlplane"
            } else {
                "worker"
            }
            .into(),
            reachable: now.version.is_some(),
            version: now.version,
            wanted_version: want.version.clone(),
            schematic: now.schematic,
            wanted_schematic: want.schematic.clone(),
            schematic_in_sync: schematic_ok,
            config_in_sync: None,
            etcd_member: None,
            ready: None,
            error: now.error,
            compared_by_fingerprint: Vec::new(),
        };
        if row.reachable
            && let Ok(conn) = NodeClient::connect(&node.endpoint, &mode, opts.call_timeout).await
        {
            match conn
                .apply_mode(node.config.clone(), ApplyMode::NoReboot, true)
                .await
            {
                Ok(details) => {
                    let diff = super::apply::diff_of(&details);
                    let compared = fingerprints.compare(&diff);
                    row.config_in_sync = Some(compared.in_sync);
                    row.compared_by_fingerprint = compared.by_fingerprint;
                }
                Err(e) => row.error = Some(format!("config diff: {e}")),
            }
            if node.role == Role::Controlplane && members.is_none() {
                members = conn
                    .etcd_members()
                    .await
                    .ok()
                    .map(|m| m.into_iter().map(|m| m.hostname).collect());
            }
        }
        rows.push(row);
    }
    for (row, node) in rows.iter_mut().zip(&plan.nodes) {
        if node.role == Role::Controlplane {
            row.etcd_member = members.as_ref().map(|m| m.contains(&node.name));
        }
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row() -> NodeStatus {
        NodeStatus {
            node: "cp-01".into(),
            role: "controlplane".into(),
            reachable: true,
            version: Some("v1.11.2".into()),
            wanted_version: "v1.11.2".into(),
            schematic: Some("a".into()),
            wanted_schematic: "a".into(),
            schematic_in_sync: true,
            config_in_sync: Some(true),
            etcd_member: Some(true),
            ready: Some(true),
            error: None,
            compared_by_fingerprint: Vec::new(),
        }
    }

    #[test]
    fn drift_names_what_differs_and_the_fixing_command() {
        assert!(row().drift().is_empty());
        let mut r = row();
        r.wanted_version = "v1.11.5".into();
        r.config_in_sync = Some(false);
        let d = r.drift();
        assert_eq!(
            d.iter().map(|d| (d.what, d.fix)).collect::<Vec<_>>(),
            [
                ("version", "imgbuild upgrade"),
                ("config", "imgbuild apply")
            ]
        );
        let mut r = row();
        r.schematic_in_sync = false;
        assert_eq!(r.drift()[0].what, "schematic");
        r.reachable = false;
        assert_eq!(r.drift()[0].what, "unreachable");
    }
}
