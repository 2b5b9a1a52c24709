//! The one plan of `up`: every difference between the inventory and what
//! exists, as actions in the fixed order the steps run, each at field level
//! (from → to). The dry run shows the actions as planned; the run marks
//! each one done, failed, or left (a destructive action without
//! `--allow-destroy`). Each step's own plan (the upgrade's, the apply's,
//! the removal's, the prune's) is made by its library call; this module
//! only puts them in one list.

use super::converge::UpgradePlanned;
pub use super::plan::Step;
use super::plan::{FromTo, Kind};
use crate::input::one_line;
use crate::talos::kubernetes::plan::{KubePlan, Step as KubeStep};
use crate::talos::upgrade::plan::{Action as UpAction, UpgradePlan};

/// One field an action changes.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct FieldChange {
    pub field: String,
    /// None: not there yet, or unknown.
    pub from: Option<String>,
    /// None: gone afterwards.
    pub to: Option<String>,
}

impl FieldChange {
    pub fn new(field: &str, from: Option<&str>, to: Option<&str>) -> FieldChange {
        FieldChange {
            field: field.to_owned(),
            from: from.map(str::to_owned),
            to: to.map(str::to_owned),
        }
    }
}

/// Where an action stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    /// A dry run's: would be done.
    Planned,
    Done,
    Failed,
    /// Destructive, and `--allow-destroy` was not given: not done.
    Left,
    /// An earlier step stopped the run before this one.
    NotReached,
}

/// One thing `up` changes.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Action {
    pub step: Step,
    /// What it does, typed (the plan file's form).
    pub kind: Kind,
    /// The node it is about; None for the cluster (Kubernetes, prune).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// What it does, in a few words ("upgrade", "apply config", "remove").
    pub what: String,
    pub changes: Vec<FieldChange>,
    /// Deletes something: done only with `--allow-destroy`.
    pub destructive: bool,
    pub outcome: State,
    /// A summary beside it (a config diff's size and fields), or why it failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

impl Action {
    pub fn new(kind: Kind, node: Option<&str>, what: &str) -> Action {
        Action {
            step: kind.step(),
            kind,
            node: node.map(str::to_owned),
            what: what.to_owned(),
            changes: Vec::new(),
            destructive: false,
            outcome: State::Planned,
            detail: None,
        }
    }

    pub fn change(mut self, field: &str, from: Option<&str>, to: Option<&str>) -> Action {
        self.changes.push(FieldChange::new(field, from, to));
        self
    }

    pub fn destructive(mut self) -> Action {
        self.destructive = true;
        self
    }

    pub fn detail(mut self, detail: impl Into<String>) -> Action {
        self.detail = Some(detail.into());
        self
    }

    pub fn outcome(mut self, outcome: State) -> Action {
        self.outcome = outcome;
        self
    }

    /// The line with how it stands in front (`plan: upgrade worker-01:
    /// …`): how `up`, `replace` and `upgrade --dry-run` print an action.
    pub fn marked(&self) -> String {
        let mark = match self.outcome {
            State::Planned if self.destructive => "plan (with --allow-destroy):",
            State::Planned => "plan:",
            State::Done => "done:",
            State::Failed => "FAILED:",
            State::Left => "left:",
            State::NotReached => "not reached:",
        };
        format!("{mark} {}", self.line())
    }

    /// One line: `upgrade worker-01: talos v1.11.2 → v1.11.3; schematic
    /// 376567… → 376567…`; every value from outside escaped and bounded.
    pub fn line(&self) -> String {
        let mut out = format!("{} ", self.step);
        if let Some(node) = &self.node {
            out.push_str(&one_line(node, 64));
            out.push_str(": ");
        }
        out.push_str(&self.what);
        let shown = |v: &Option<String>| v.as_deref().map_or("-".to_owned(), |v| one_line(v, 80));
        let fields: Vec<String> = self
            .changes
            .iter()
            .map(|c| format!("{} {} → {}", c.field, shown(&c.from), shown(&c.to)))
            .collect();
        if !fields.is_empty() {
            out.push_str(": ");
            out.push_str(&fields.join("; "));
        }
        if let Some(d) = &self.detail {
            out.push_str(" (");
            out.push_str(&one_line(d, 400));
            out.push(')');
        }
        out
    }
}

/// The Talos part of an upgrade plan as actions, one per node with work
/// (an upgrade, a config naming another installer, or blocked): what
/// `upgrade --dry-run` and the upgrade step of `up` both show.
pub fn talos_actions(plan: &UpgradePlan) -> Vec<Action> {
    let mut actions: Vec<Action> = Vec::new();
    for n in &plan.nodes {
        if n.action == UpAction::Done || n.action == UpAction::SchematicUnknown {
            continue;
        }
        let hops: Vec<&str> = n.hops.iter().map(|h| h.version.as_str()).collect();
        let moves = n.from.schematic.as_deref() != Some(n.to.schematic.as_str());
        let kind = Kind::UpgradeTalos {
            version: FromTo {
                from: n.from.version.clone(),
                to: n.to.version.clone(),
            },
            schematic: moves.then(|| FromTo {
                from: n.from.schematic.clone(),
                to: n.to.schematic.clone(),
            }),
        };
        let mut a = Action::new(kind, Some(&n.node), "upgrade").change(
            "talos",
            n.from.version.as_deref(),
            Some(&n.to.version),
        );
        // Shown when it moves (unknown is not different).
        if n.from.schematic.as_deref() != Some(n.to.schematic.as_str()) {
            a = a.change(
                "schematic",
                n.from.schematic.as_deref(),
                Some(&n.to.schematic),
            );
        }
        a = match n.action {
            UpAction::Config => {
                a.detail("on the target; its config names another installer: the config is applied")
            }
            UpAction::Blocked => a.detail(format!(
                "blocked: {}",
                n.problem
                    .as_deref()
                    .or(n.from.error.as_deref())
                    .unwrap_or("not read")
            )),
            _ if hops.len() > 1 => a.detail(format!("via {}", hops.join(" → "))),
            _ => a,
        };
        actions.push(a);
    }
    actions
}

/// The whole upgrade plan as actions, in the order the run goes: Talos
/// node by node, then Kubernetes and its manifest sync. The one renderer
/// of an upgrade plan (`upgrade --dry-run`; `up` adds the configs each
/// node's upgrade carries, which it compares on the nodes).
pub fn upgrade_actions(planned: &UpgradePlanned) -> Vec<Action> {
    let mut out = talos_actions(&planned.talos);
    if let Some((_, k)) = &planned.kube {
        out.extend(kube_action(k));
        out.extend(sync_action(k));
    }
    out
}

/// The Kubernetes action of a plan with work left (or a refusal).
pub fn kube_action(k: &KubePlan) -> Option<Action> {
    let left = k.steps.iter().filter(|s| !s.done).count();
    if left == 0 && k.refusal.is_none() {
        return None;
    }
    let kind = Kind::UpgradeKubernetes {
        version: FromTo {
            from: k.from.clone(),
            to: k.to.clone(),
        },
    };
    let mut a = Action::new(kind, None, "upgrade Kubernetes")
        .change("kubernetes", k.from.as_deref(), Some(&k.to))
        .detail(format!("{left} step(s)"));
    if let Some(r) = &k.refusal {
        a = a.detail(format!("refused: {r}"));
    }
    Some(a)
}

/// The bootstrap manifest sync a Kubernetes plan with work left ends
/// with, as its own action (listed once the components are planned).
pub fn sync_action(k: &KubePlan) -> Option<Action> {
    if k.refusal.is_some() {
        return None;
    }
    k.steps.iter().find_map(|s| match &s.step {
        KubeStep::SyncManifests { objects, prune, .. } if !s.done => {
            let a = Action::new(
                Kind::SyncManifests {
                    objects: objects.clone(),
                },
                None,
                "sync bootstrap manifests",
            );
            // Talos v1.13+: each object pruned, as a change to nothing.
            let a = prune
                .iter()
                .fold(a, |a, o| a.change(o, Some("present"), None));
            Some(a.detail(s.step.describe()))
        }
        _ => None,
    })
}

/// `+a −r lines` and the fields a config diff changes, as its summary: the
/// diff itself may hold secrets, its shape does not.
pub fn diff_summary(diff: &str, fields: &[String]) -> String {
    let body = diff
        .lines()
        .filter(|l| !l.starts_with("+++") && !l.starts_with("---"));
    let (mut added, mut removed) = (0, 0);
    for l in body {
        if l.starts_with('+') {
            added += 1;
        } else if l.starts_with('-') {
            removed += 1;
        }
    }
    let mut out = format!("+{added} −{removed} lines");
    if !fields.is_empty() {
        out.push_str(": ");
        out.push_str(&fields.join(", "));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_action_reads_on_one_line_with_every_field_from_to() {
        let up = Kind::UpgradeTalos {
            version: super::super::plan::FromTo {
                from: Some("v1.11.2".into()),
                to: "v1.11.3".into(),
            },
            schematic: None,
        };
        let a = Action::new(up, Some("worker-01"), "upgrade")
            .change("talos", Some("v1.11.2"), Some("v1.11.3"))
            .change("schematic", None, Some("abc"));
        assert_eq!(
            a.line(),
            "upgrade worker-01: upgrade: talos v1.11.2 → v1.11.3; schematic - → abc"
        );
        let gone = Kind::RemoveNode {
            role: crate::inventory::Role::Worker,
        };
        let a = Action::new(gone, Some("w\n2"), "remove")
            .destructive()
            .detail("VM 304");
        assert_eq!(a.line(), "remove w\\n2: remove (VM 304)");
        assert!(Step::Build < Step::Prune && Step::Configs < Step::Remove);
    }

    #[test]
    fn a_diff_summary_counts_lines_and_names_fields_only() {
        let diff = "--- a\n+++ b\n@@ -1 +1 @@\n-  hostname: a\n+  hostname: b\n+  extra: c\n";
        assert_eq!(
            diff_summary(diff, &["machine.network".into()]),
            "+2 −1 lines: machine.network"
        );
    }
}
