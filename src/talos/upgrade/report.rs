//! What one `upgrade` run did, node by node, as the JSON document and the
//! facts the CLI prints.

use std::collections::BTreeMap;

/// The node that failed and why; nodes after it were not touched.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Failure {
    pub node: String,
    pub error: String,
}

/// What a run did.
#[derive(Debug, Clone, Default, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct UpgradeReport {
    /// Why nothing was touched (the plan refused).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
    /// Upgraded by this run, in order.
    pub upgraded: Vec<String>,
    /// Already at the target.
    pub unchanged: Vec<String>,
    /// On the target already; this run applied the config naming the new
    /// installer (a stopped run had left the old one).
    pub configured: Vec<String>,
    /// On the target version, schematic unknown: left alone.
    pub schematic_unknown: Vec<String>,
    pub failed: Option<Failure>,
    /// Not reached because of the failure.
    pub untouched: Vec<String>,
    /// Planned as done, but running another version at the end.
    pub changed_during_run: Vec<String>,
    /// What each selected node runs at the end, by node.
    pub versions: BTreeMap<String, Option<String>>,
    /// Seconds each node this run worked on took, from its turn until it
    /// was healthy on its target (or failed): the rolling upgrade's pace.
    pub node_seconds: BTreeMap<String, f64>,
    /// What the plan states (`--force`) and what warming the factory said.
    pub notes: Vec<String>,
    /// The state dir's record could not be written.
    pub record_error: Option<String>,
}

/// How a run ended, for the exit code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    Ok,
    /// Nothing was upgraded and something failed (or was refused).
    Failed(String),
    /// Some nodes were upgraded, then something failed.
    Partial(String),
}

impl UpgradeReport {
    pub fn ending(&self) -> Ending {
        if let Some(why) = &self.refused {
            return Ending::Failed(why.clone());
        }
        let changed = (!self.changed_during_run.is_empty()).then(|| {
            format!(
                "changed during the run: {}",
                self.changed_during_run.join("; ")
            )
        });
        match (&self.failed, changed) {
            (None, None) => Ending::Ok,
            (None, Some(c)) => Ending::Partial(c),
            (Some(f), _) if self.upgraded.is_empty() => {
                Ending::Failed(format!("node {}: {}", f.node, f.error))
            }
            (Some(f), _) => Ending::Partial(format!(
                "node {}: {}; upgraded: {}; not touched: {}",
                f.node,
                f.error,
                self.upgraded.join(", "),
                if self.untouched.is_empty() {
                    "none".to_owned()
                } else {
                    self.untouched.join(", ")
                }
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ending_follows_what_happened() {
        let mut r = UpgradeReport::default();
        assert_eq!(r.ending(), Ending::Ok);
        r.changed_during_run
            .push("w1 ran v1.11.5 when planned, v1.11.2 now".into());
        assert!(matches!(r.ending(), Ending::Partial(m) if m.contains("w1")));
        r.failed = Some(Failure {
            node: "cp-01".into(),
            error: "boom".into(),
        });
        assert!(matches!(r.ending(), Ending::Failed(m) if m.contains("cp-01")));
        r.upgraded.push("cp-02".into());
        assert!(matches!(r.ending(), Ending::Partial(m) if m.contains("upgraded: cp-02")));
        r.refused = Some("etcd has 2 members".into());
        assert!(matches!(r.ending(), Ending::Failed(m) if m.contains("2 members")));
    }
}
