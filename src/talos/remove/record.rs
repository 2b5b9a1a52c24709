//! The nodes of record: `<state dir>/nodes.json`, each node's name, role
//! and where its Talos API was reached, as the last successful bootstrap
//! (or `up`) left them. A node in the record but not in the inventory is a
//! node to remove; it leaves the record only once its removal is done, so
//! a bootstrap in between does not forget it. Holds no secret; written
//! atomically, 0600 as every file of the state dir.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

use std::collections::BTreeMap;

use crate::inventory::Role;
use crate::talos::bootstrap::{Options, Plan};

/// The file's name in the state dir.
pub const NODES_FILE: &str = "nodes.json";

/// A record this large is not one imgbuild wrote (a few hundred bytes a
/// node).
const RECORD_LIMIT: u64 = 4 << 20;

/// One node as it was last brought up.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordedNode {
    pub name: String,
    pub role: Role,
    /// Its own address (the name its Talos certificate carries).
    pub address: IpAddr,
    /// Where its Talos API answered (`address:50000`, or its talosEndpoint).
    pub endpoint: SocketAddr,
    /// The machine's Talos node ID ([`super::identity`]) as read when it
    /// was last brought up; absent in records older than issue 39, or when
    /// it could not be read. A removal acts only on the machine that
    /// answers with it.
    #[serde(default, rename = "nodeId", skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
}

/// `nodes.json`: every node of record, in the order they were first seen.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodesRecord {
    pub nodes: Vec<RecordedNode>,
}

impl NodesRecord {
    /// `<state_dir>/nodes.json`.
    pub fn path(state_dir: &Path) -> PathBuf {
        state_dir.join(NODES_FILE)
    }

    /// The record in `state_dir`; empty when there is none yet. A file that
    /// is not a record is an error (InvalidData), never taken for empty.
    pub fn load(state_dir: &Path) -> io::Result<NodesRecord> {
        let path = Self::path(state_dir);
        let text = match crate::input::read_text(&path, RECORD_LIMIT) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(NodesRecord::default()),
            Err(e) => return Err(e),
        };
        let record: NodesRecord = serde_json::from_str(&text)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        // Only IDs Talos could have written: they reach messages and plans.
        if let Some(bad) = record.nodes.iter().find(|n| {
            n.node_id
                .as_deref()
                .is_some_and(|id| !super::identity::valid_node_id(id))
        }) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "node {}: nodeId is not a Talos node ID (1 to {} ASCII letters and digits)",
                    super::plan::shown(&bad.name),
                    super::identity::NODE_ID_LIMIT
                ),
            ));
        }
        Ok(record)
    }

    /// Writes the record atomically (nothing when it did not change).
    pub fn save(&self, state_dir: &Path) -> io::Result<()> {
        let mut text = serde_json::to_string_pretty(self).map_err(io::Error::other)?;
        text.push('\n');
        crate::atomic::write_if_changed(&Self::path(state_dir), text.as_bytes(), true)?;
        Ok(())
    }

    /// Takes in every node of `plan` (replacing what was recorded under its
    /// name) with the node ID its machine answered with (`ids`, by name; a
    /// node missing there is recorded without one: what answered now is
    /// not known to be the machine recorded before); nodes the plan does
    /// not have stay, with their IDs, still to be removed.
    pub fn note(&mut self, plan: &Plan, ids: &BTreeMap<String, String>) {
        for n in &plan.nodes {
            let node = RecordedNode {
                name: n.name.clone(),
                role: n.role,
                address: n.address,
                endpoint: n.endpoint.addr,
                node_id: ids
                    .get(&n.name)
                    .filter(|id| super::identity::valid_node_id(id))
                    .cloned(),
            };
            match self.nodes.iter_mut().find(|r| r.name == n.name) {
                Some(r) => *r = node,
                None => self.nodes.push(node),
            }
        }
    }

    /// Drops `name` (its removal is done).
    pub fn forget(&mut self, name: &str) {
        self.nodes.retain(|n| n.name != name);
    }
}

/// Records the nodes `plan` brought up, each with the node ID its machine
/// answers with now (read within `limits`' call timeout): what
/// `stage::bootstrap` calls once a bootstrap succeeded. Blocking.
pub fn record_nodes(state_dir: &Path, plan: &Plan, limits: &Options) -> io::Result<()> {
    let ids = super::identity::of_plan(plan, limits);
    let mut record = NodesRecord::load(state_dir)?;
    record.note(plan, &ids);
    record.save(state_dir)
}

/// Drops `name` from the record in `state_dir`.
pub fn forget_node(state_dir: &Path, name: &str) -> io::Result<()> {
    let mut record = NodesRecord::load(state_dir)?;
    record.forget(name);
    record.save(state_dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, role: Role, last: u8) -> RecordedNode {
        let address: IpAddr = format!("10.0.0.{last}").parse().unwrap();
        RecordedNode {
            name: name.into(),
            role,
            address,
            endpoint: SocketAddr::new(address, 50000),
            node_id: None,
        }
    }

    #[test]
    fn a_missing_record_is_empty_and_a_broken_one_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            NodesRecord::load(dir.path()).unwrap(),
            NodesRecord::default()
        );
        std::fs::write(NodesRecord::path(dir.path()), "{\"nodes\": 3}").unwrap();
        let e = NodesRecord::load(dir.path()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn saved_records_read_back_and_forget_drops_one() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = NodesRecord {
            nodes: vec![
                node("cp-01", Role::Controlplane, 11),
                node("w-01", Role::Worker, 21),
            ],
        };
        r.save(dir.path()).unwrap();
        assert_eq!(NodesRecord::load(dir.path()).unwrap(), r);
        forget_node(dir.path(), "w-01").unwrap();
        r.forget("w-01");
        assert_eq!(NodesRecord::load(dir.path()).unwrap(), r);
        assert_eq!(r.nodes.len(), 1);
    }

    #[test]
    fn node_ids_are_kept_validated_and_older_records_still_read() {
        let dir = tempfile::tempdir().unwrap();
        // A record from before issue 39: no nodeId.
        std::fs::write(
            NodesRecord::path(dir.path()),
            r#"{"nodes": [{"name": "w-01", "role": "worker", "address": "10.0.0.21", "endpoint": "10.0.0.21:50000"}]}"#,
        )
        .unwrap();
        assert_eq!(
            NodesRecord::load(dir.path()).unwrap().nodes[0].node_id,
            None
        );
        let mut r = NodesRecord {
            nodes: vec![node("w-01", Role::Worker, 21)],
        };
        r.nodes[0].node_id = Some("GGGPXIfmRdQvyhi3VuUA3ymIYfxi2HWz4Q6EfT9qCmFA".into());
        r.save(dir.path()).unwrap();
        let text = std::fs::read_to_string(NodesRecord::path(dir.path())).unwrap();
        assert!(text.contains("\"nodeId\": \"GGGPXIfm"), "{text}");
        assert_eq!(NodesRecord::load(dir.path()).unwrap(), r);
        // Anything Talos would not write is refused, never shown or used.
        for bad in ["a/b", "", "x\u{1b}[31m", &"a".repeat(65)] {
            r.nodes[0].node_id = Some(bad.into());
            r.save(dir.path()).unwrap();
            let e = NodesRecord::load(dir.path()).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{bad:?}");
            assert!(
                e.to_string()
                    .contains("node w-01: nodeId is not a Talos node ID"),
                "{e}"
            );
        }
    }
}
