//! What one `up` did, node by node and stage by stage, and the two ways it
//! is shown: the summary table (with the lines around it) and the JSON
//! document. The stages record into [`Report`]; the CLI only prints what
//! [`Report::text`] and [`Report::json`] give.

use std::net::IpAddr;
use std::path::PathBuf;

use super::actions::{Action, State};
use super::error::{Stage, Stopped, UpError};
pub use super::plan::TalosState;
use super::plan::{Kind, Known, Machine};
use crate::build::{self, NodeImage};
use crate::digest::Sha256;
use crate::inventory::Inventory;
use crate::publish::proxmox::VmChange;
use crate::talos::bootstrap::{self, BootstrapError};
use crate::talos::client::Probe;
use crate::talos::stage::{Bootstrapped, Reach, StageError, Survey};
use crate::talos::status::{Differences, Drift};

/// What a stage did to one node (or, in a dry run, would do).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Change {
    Built,
    Uploaded,
    /// A new image its storage held already (same bytes, same name): the
    /// upload a plan could not rule out before the build, found done.
    Stored,
    Created,
    Updated,
    Started,
    Applied,
    Bootstrapped,
    Unchanged,
    /// Left booting an older image (`--replace-disk` swaps it).
    Outdated,
    Failed,
}

impl Change {
    /// The word a summary shows.
    pub fn as_str(self) -> &'static str {
        match self {
            Change::Built => "built",
            Change::Uploaded => "uploaded",
            Change::Stored => "already stored",
            Change::Created => "created",
            Change::Updated => "updated",
            Change::Started => "started",
            Change::Applied => "applied",
            Change::Bootstrapped => "bootstrapped",
            Change::Unchanged => "unchanged",
            Change::Outdated => "outdated",
            Change::Failed => "failed",
        }
    }

    /// The word for a change; a dry run says what would happen.
    fn word(self, dry_run: bool) -> &'static str {
        if !dry_run {
            return self.as_str();
        }
        match self {
            Change::Built => "to build",
            Change::Uploaded => "to upload",
            Change::Created => "to create",
            Change::Updated => "to replace",
            Change::Started => "to start",
            Change::Applied => "to apply",
            Change::Bootstrapped => "to bootstrap",
            other => other.as_str(),
        }
    }
}

impl From<VmChange> for Change {
    fn from(v: VmChange) -> Change {
        match v {
            VmChange::Created => Change::Created,
            VmChange::Updated => Change::Updated,
            VmChange::Unchanged => Change::Unchanged,
            VmChange::Changed => Change::Updated,
        }
    }
}

/// `then` when `yes`, else unchanged.
pub(super) fn changed(yes: bool, then: Change) -> Change {
    if yes { then } else { Change::Unchanged }
}

/// Per node, what each stage did; absent: the stage did not run for it.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Stages {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub build: Option<Change>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upload: Option<Change>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vm: Option<Change>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub start: Option<Change>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub apply: Option<Change>,
}

impl Stages {
    /// Each stage by name, in the order they run.
    pub fn named(&self) -> [(&'static str, Option<Change>); 5] {
        [
            ("build", self.build),
            ("upload", self.upload),
            ("vm", self.vm),
            ("start", self.start),
            ("apply", self.apply),
        ]
    }
}

impl From<Option<&Probe>> for TalosState {
    /// How a TLS handshake without a certificate went (None: it did not).
    fn from(probe: Option<&Probe>) -> TalosState {
        match probe {
            Some(Probe::Maintenance { .. }) => TalosState::Maintenance,
            Some(Probe::Configured) => TalosState::Configured,
            None => TalosState::Unreachable,
        }
    }
}

/// One row of the summary.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeReport {
    pub node: String,
    /// Where imgbuild reaches its Talos API.
    pub address: Option<IpAddr>,
    /// The image's sha256 (as the manifest records it).
    pub sha256: Option<Sha256>,
    pub image: Option<PathBuf>,
    /// Where the image was published (a Proxmox volume, a Hetzner snapshot).
    pub volume: Option<String>,
    pub vmid: Option<u32>,
    /// The Hetzner server.
    pub server: Option<u64>,
    pub talos: Option<TalosState>,
    pub talos_version: Option<String>,
    /// Whether Kubernetes reports the node Ready.
    pub kubernetes_ready: Option<bool>,
    pub stages: Stages,
    /// Why a stage failed for this node.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// What its image is shared as (a Hetzner snapshot): rows with the
    /// same key count once in the build and upload summary.
    #[serde(skip)]
    pub(super) shared: Option<String>,
}

impl NodeReport {
    /// Notes the node's image, built now or already current.
    fn show_image(&mut self, image: &NodeImage, file: PathBuf) {
        self.sha256 = Some(image.sha256);
        self.image = Some(file);
    }

    /// The table's columns, `-` where unknown.
    fn row(&self) -> [String; 7] {
        let talos = self.talos.map(|t| {
            let word = serde_json::to_value(t)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default();
            match &self.talos_version {
                Some(v) => format!("{word} {v}"),
                None => word,
            }
        });
        [
            self.node.clone(),
            // The first 12 hex digits: enough to tell images apart.
            cell(self.sha256.map(|s| s.hex()[..12].to_owned())),
            cell(self.volume.clone()),
            cell(
                self.vmid
                    .map(|v| v.to_string())
                    .or(self.server.map(|s| s.to_string())),
            ),
            cell(self.address.map(|a| a.to_string())),
            cell(talos),
            cell(
                self.kubernetes_ready
                    .map(|r| if r { "Ready" } else { "NotReady" }.to_owned()),
            ),
        ]
    }
}

fn cell(v: Option<String>) -> String {
    // A node's version tag may carry a newline: it must not forge a row.
    v.map_or_else(|| "-".into(), |v| crate::input::one_line(&v, 64))
}

/// What one `up` (or its dry run) did, stage by stage and node by node.
#[derive(Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    pub cluster: String,
    pub target: &'static str,
    pub dry_run: bool,
    /// Every inventory node, in inventory order.
    pub nodes: Vec<NodeReport>,
    /// Bootstrapped now, or unchanged (etcd was running); in a dry run
    /// unknown when the first control plane is already configured.
    pub bootstrap: Option<Change>,
    pub bootstrap_node: Option<String>,
    /// True only when every node is configured and Kubernetes calls every
    /// node Ready: the table has no row that is not healthy.
    pub healthy: bool,
    /// How the health checks ended (absent: they did not run to the end).
    pub health: Option<bootstrap::Health>,
    /// Settings that did not work as given, and what was used instead
    /// (the kubeconfig pointing at a control plane, not the VIP).
    pub fallbacks: Vec<bootstrap::Fallback>,
    /// The state dir's kubeconfig; absent when none was written (a sealed
    /// cluster's is minted from the secrets when needed).
    pub kubeconfig: Option<PathBuf>,
    pub talosconfig: Option<PathBuf>,
    pub elapsed_ms: u128,
    /// The stage that stopped the run, and why.
    #[serde(skip)]
    pub stopped: Option<Stopped>,
    /// How a healthy cluster differs from the inventory (version,
    /// schematic, config), as `imgbuild status` would flag it.
    #[serde(skip)]
    pub drift: Vec<Drift>,
    /// Why the drift could not be checked.
    #[serde(skip)]
    pub drift_unchecked: Option<String>,
    /// Nodes whose config is staged for their next reboot (not drift).
    #[serde(skip)]
    pub staged: Vec<String>,
    /// The steps after the bootstrap (upgrade, Kubernetes, configs,
    /// settings, removal, prune) as actions; the table's stages are in
    /// [`Report::plan`] too.
    #[serde(skip)]
    pub actions: Vec<Action>,
    /// Actions that run before the build (`replace`'s removal), in order.
    #[serde(skip)]
    pub first: Vec<Action>,
    /// What the user should know (an etcd left with 2 members).
    pub warnings: Vec<String>,
}

/// One line of the text report, and where it goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Line {
    /// The result: standard output.
    Out(String),
    /// An error beside it: standard error.
    Err(String),
}

impl Report {
    /// A row per inventory node at the address the bootstrap reaches it
    /// at (as the stage decided); nothing done yet.
    pub(super) fn new(
        inv: &Inventory,
        target: &'static str,
        dry_run: bool,
        reach: &Reach,
    ) -> Report {
        let nodes = reach
            .nodes
            .iter()
            .map(|n| NodeReport {
                node: n.node.clone(),
                address: n.address,
                sha256: None,
                image: None,
                volume: None,
                vmid: None,
                server: None,
                talos: None,
                talos_version: None,
                kubernetes_ready: None,
                stages: Stages::default(),
                error: None,
                shared: None,
            })
            .collect();
        Report {
            cluster: inv.cluster.name.clone(),
            target,
            dry_run,
            nodes,
            bootstrap: None,
            bootstrap_node: None,
            healthy: false,
            health: None,
            fallbacks: Vec::new(),
            kubeconfig: None,
            talosconfig: None,
            elapsed_ms: 0,
            stopped: None,
            drift: Vec::new(),
            drift_unchecked: None,
            staged: Vec::new(),
            actions: Vec::new(),
            first: Vec::new(),
            warnings: Vec::new(),
        }
    }

    /// Records an action of a step after the bootstrap.
    pub(super) fn act(&mut self, action: Action) {
        self.actions.push(action);
    }

    /// The whole plan, in the order the steps run: each node's build,
    /// upload, machine and config from the table (what is not unchanged),
    /// then the recorded actions. A dry run's are planned; a run's done or
    /// failed.
    pub fn plan(&self) -> Vec<Action> {
        let mut out = self.first.clone();
        let outcome = |c: Change| match c {
            Change::Failed => State::Failed,
            _ if self.dry_run => State::Planned,
            _ => State::Done,
        };
        let worth =
            |c: &Option<Change>| c.filter(|c| !matches!(c, Change::Unchanged | Change::Outdated));
        for n in &self.nodes {
            let node = Some(n.node.as_str());
            let sha = n.sha256.map(|s| s.hex()[..12].to_owned());
            if let Some(c) = worth(&n.stages.build) {
                out.push(
                    Action::new(
                        Kind::BuildImage {
                            image: Known::of(sha.clone()),
                        },
                        node,
                        c.word(self.dry_run),
                    )
                    .change("image", None, sha.as_deref())
                    .outcome(outcome(c)),
                );
            }
            if let Some(c) = worth(&n.stages.upload) {
                out.push(
                    Action::new(
                        Kind::UploadImage {
                            volume: Known::of(n.volume.clone()),
                        },
                        node,
                        c.word(self.dry_run),
                    )
                    .change("volume", None, n.volume.as_deref())
                    .outcome(outcome(c)),
                );
            }
            let machine = n
                .vmid
                .map(|v| format!("VM {v}"))
                .or(n.server.map(|s| format!("server {s}")));
            let typed = n.vmid.map(Machine::Vm).or(n.server.map(Machine::Server));
            for c in [worth(&n.stages.vm), worth(&n.stages.start)]
                .into_iter()
                .flatten()
            {
                let machine_now = Known::of(typed.clone());
                let kind = match c {
                    Change::Created => Kind::CreateMachine {
                        machine: machine_now,
                    },
                    Change::Started => Kind::StartMachine {
                        machine: machine_now,
                    },
                    _ => Kind::UpdateMachine {
                        machine: machine_now,
                    },
                };
                out.push(
                    Action::new(kind, node, c.word(self.dry_run))
                        .change("machine", None, machine.as_deref())
                        .outcome(outcome(c)),
                );
            }
            if let Some(c) = worth(&n.stages.apply) {
                out.push(
                    Action::new(Kind::ApplyFirstConfig, node, "apply its first config")
                        .change("talos", Some("maintenance"), Some("configured"))
                        .outcome(outcome(c)),
                );
            }
        }
        if let (Some(c @ Change::Bootstrapped), Some(node)) = (self.bootstrap, &self.bootstrap_node)
        {
            out.push(
                Action::new(Kind::BootstrapEtcd, Some(node), "bootstrap etcd").outcome(outcome(c)),
            );
        }
        // In the order they ran (or, in a dry run, will run): never
        // sorted, so an action run out of the plan's order shows.
        out.extend(self.actions.iter().cloned());
        out
    }

    /// The destructive actions not done for want of `--allow-destroy`.
    pub fn left(&self) -> Vec<&Action> {
        self.first
            .iter()
            .chain(&self.actions)
            .filter(|a| a.outcome == State::Left)
            .collect()
    }

    pub(super) fn node(&mut self, name: &str) -> Option<&mut NodeReport> {
        self.nodes.iter_mut().find(|n| n.node == name)
    }

    pub(super) fn fail(&mut self, node: &str, stage: impl FnOnce(&mut Stages), error: String) {
        if let Some(n) = self.node(node) {
            stage(&mut n.stages);
            n.error = Some(error);
        }
    }

    /// The row of the node at inventory position `index`.
    pub(super) fn row(&mut self, index: usize) -> Option<&mut NodeReport> {
        self.nodes.get_mut(index)
    }

    /// Marks the node at inventory position `index` failed at `stage`.
    pub(super) fn fail_row(
        &mut self,
        index: usize,
        stage: impl FnOnce(&mut Stages),
        error: String,
    ) {
        if let Some(n) = self.row(index) {
            stage(&mut n.stages);
            n.error = Some(error);
        }
    }

    /// Records the build, by inventory position: each image built now or
    /// already current (None: in a dry run, one still to build), and each
    /// node that failed.
    pub(super) fn built(
        &mut self,
        images: &[(usize, Option<build::BuildOutcome>)],
        failed: &[build::NodeFailure],
    ) {
        for (index, outcome) in images {
            let Some(n) = self.row(*index) else { continue };
            n.stages.build = Some(match outcome {
                Some(o) => {
                    n.show_image(&o.image, o.file.clone());
                    changed(o.built, Change::Built)
                }
                None => Change::Built,
            });
        }
        for f in failed {
            self.fail(&f.node, |s| s.build = Some(Change::Failed), chain(&f.error));
        }
    }

    /// Records what the bootstrap stage did: apply, etcd, health, each
    /// node's address, version and readiness as its last health round saw it.
    pub(super) fn bootstrapped(&mut self, done: &Bootstrapped) {
        let outcome = &done.outcome;
        self.bootstrap = Some(changed(outcome.bootstrapped, Change::Bootstrapped));
        self.bootstrap_node = Some(outcome.bootstrap_node.clone());
        // A sealed cluster's kubeconfig was minted in memory, not written.
        let plan = &done.prepared.plan;
        self.kubeconfig = plan.write_kubeconfig.then(|| plan.kubeconfig_path.clone());
        self.talosconfig = done.prepared.talosconfig.clone();
        self.fallbacks = outcome.fallbacks.clone();
        for planned in &done.prepared.plan.nodes {
            if let Some(n) = self.node(&planned.name) {
                n.address = Some(planned.address);
                n.talos = Some(TalosState::Configured);
                n.talos_version = outcome.versions.get(&planned.name).cloned();
                n.stages.apply = Some(if outcome.applied.contains(&planned.name) {
                    Change::Applied
                } else {
                    Change::Unchanged
                });
            }
        }
        for n in &mut self.nodes {
            n.kubernetes_ready = Some(outcome.ready.get(&n.node).copied().unwrap_or(false));
        }
        self.healthy = outcome.health.is_healthy()
            && self.nodes.iter().all(|n| {
                n.kubernetes_ready == Some(true) && n.talos == Some(TalosState::Configured)
            });
        self.health = Some(outcome.health.clone());
    }

    /// Records how the cluster differs from the inventory, or why that
    /// could not be read.
    pub(super) fn drifted(&mut self, drift: Result<Differences, StageError>) {
        match drift {
            Ok(d) => {
                self.drift = d.drift;
                self.staged = d.staged;
            }
            Err(e) => self.drift_unchecked = Some(chain(&e)),
        }
    }

    /// Records what the bootstrap would do, from how each node answered:
    /// a node in maintenance mode gets its config, a configured one nothing.
    /// A Hetzner server yet to be made boots with its config in its
    /// `user_data` (Talos's hcloud platform reads it), so nothing is applied.
    pub(super) fn surveyed(&mut self, survey: &Survey) {
        let hcloud = self.target == "hcloud";
        for (reach, answer) in survey.reach.nodes.iter().zip(&survey.answers) {
            if let Some(n) = self.node(&reach.node) {
                let state = TalosState::from(answer.as_ref());
                let configured_at_boot = hcloud && n.stages.vm == Some(Change::Created);
                n.address = reach.address;
                n.talos = Some(state);
                n.stages.apply = Some(if state == TalosState::Configured || configured_at_boot {
                    Change::Unchanged
                } else {
                    Change::Applied
                });
            }
        }
        if let Some(first) = &survey.reach.bootstrap_node {
            self.bootstrap_node = Some(first.clone());
            let configured = self
                .nodes
                .iter()
                .any(|n| &n.node == first && n.talos == Some(TalosState::Configured));
            // A configured control plane may or may not run etcd yet: the run
            // asks it (over mTLS) and bootstraps only when etcd is not running.
            self.bootstrap = (!configured).then_some(Change::Bootstrapped);
        }
    }

    /// Records why `stage` stopped the run; a failed bootstrap also marks
    /// each node that failed, and etcd when it was bootstrapped before.
    pub(super) fn stop(&mut self, stage: Stage, e: UpError) {
        if let UpError::Bootstrap(StageError::Bootstrap(b)) = &e {
            let failed = match b {
                BootstrapError::Nodes { failed, .. } => failed.iter().collect(),
                other => vec![other],
            };
            for f in failed {
                if let Some(node) = f.node() {
                    self.fail(node, |s| s.apply = Some(Change::Failed), f.to_string());
                }
            }
            if let BootstrapError::Nodes { etcd, settled, .. } = b {
                if let Some((node, now)) = etcd {
                    self.bootstrap = Some(changed(*now, Change::Bootstrapped));
                    self.bootstrap_node = Some(node.clone());
                }
                for (node, applied) in settled {
                    if let Some(n) = self.node(node) {
                        n.talos = Some(TalosState::Configured);
                        n.stages.apply = Some(changed(*applied, Change::Applied));
                    }
                }
            }
        }
        self.stopped = Some((stage, e));
    }

    /// Whether some nodes finished every stage that ran for them while
    /// others failed (nodes not selected do not count as finished), or the
    /// cluster came up healthy as far as Talos goes but has no CNI.
    pub fn partial(&self) -> bool {
        let some_failed = matches!(self.stopped, Some((_, UpError::Nodes { .. })))
            && self
                .nodes
                .iter()
                .any(|n| n.error.is_none() && n.stages.build.is_some());
        some_failed
            || matches!(self.health, Some(bootstrap::Health::NoCni { .. }))
            || matches!(self.stopped, Some((_, UpError::Step { partial: true, .. })))
    }

    /// The JSON document: the report, the stage that stopped it and why,
    /// and the drift. A dry run's stage outcomes are planned ones (`to
    /// build`, `to bootstrap`…, as its text says), so no consumer takes a
    /// plan for a finished run.
    pub fn json(&self) -> serde_json::Result<serde_json::Value> {
        let mut doc = serde_json::to_value(self)?;
        if self.dry_run {
            for (n, row) in self
                .nodes
                .iter()
                .zip(doc["nodes"].as_array_mut().into_iter().flatten())
            {
                for (stage, change) in n.stages.named() {
                    if let Some(c) = change {
                        row["stages"][stage] = c.word(true).into();
                    }
                }
            }
            if let Some(c) = self.bootstrap {
                doc["bootstrap"] = c.word(true).into();
            }
        }
        if let Some((stage, e)) = &self.stopped {
            doc["failedStage"] = serde_json::json!(stage);
            doc["error"] = serde_json::json!(chain(e));
        }
        doc["drift"] = serde_json::to_value(&self.drift)?;
        doc["staged"] = serde_json::json!(self.staged);
        doc["plan"] = serde_json::to_value(self.plan())?;
        doc["left"] = serde_json::to_value(self.left())?;
        Ok(doc)
    }

    /// The summary as text: the table, one line of stage counts, the nodes'
    /// errors, fallbacks, health and where the client files are.
    pub fn text(&self) -> Vec<Line> {
        let mut lines = Vec::new();
        if self.dry_run {
            lines.push(Line::Out(format!(
                "dry run: cluster {} (target {}); nothing was changed",
                self.cluster, self.target
            )));
        }
        let rows: Vec<[String; 7]> = self.nodes.iter().map(NodeReport::row).collect();
        let head = [
            "NODE",
            "IMAGE",
            "VOLUME",
            "VM/SERVER",
            "ADDRESS",
            "TALOS",
            "K8S READY",
        ];
        let mut widths = head.map(str::len);
        for row in &rows {
            for (w, c) in widths.iter_mut().zip(row) {
                *w = (*w).max(c.chars().count());
            }
        }
        let line = |cells: &[String]| {
            let text: Vec<String> = cells
                .iter()
                .zip(widths)
                .map(|(c, w)| format!("{c:<w$}"))
                .collect();
            Line::Out(text.join("  ").trim_end().to_owned())
        };
        lines.push(line(&head.map(String::from)));
        lines.extend(rows.iter().map(|row| line(row)));
        lines.push(Line::Out(self.stage_summary()));
        for a in self.first.iter().chain(&self.actions) {
            lines.push(Line::Out(a.marked()));
        }
        for w in &self.warnings {
            lines.push(Line::Err(format!("warning: {w}")));
        }
        let left = self.left();
        if !left.is_empty() {
            lines.push(Line::Err(format!(
                "note: {} destructive action(s) left undone; rerun with --allow-destroy to carry them out",
                left.len()
            )));
        }
        // A stop for some nodes sums them up in one line: their errors first.
        if let Some((_, UpError::Nodes { .. })) = &self.stopped {
            for n in &self.nodes {
                if let Some(e) = &n.error {
                    lines.push(Line::Err(format!("error: node {}: {e}", n.node)));
                }
            }
        }
        for f in &self.fallbacks {
            lines.push(Line::Out(format!("note: {f}")));
        }
        if self.healthy {
            lines.push(Line::Out(format!(
                "cluster {} is healthy ({:.1}s)",
                self.cluster,
                self.elapsed_ms as f64 / 1000.0
            )));
        }
        if self.health.is_some() {
            // Beneath "is healthy" when it was said, else on their own.
            let indent = if self.healthy { "  " } else { "" };
            if let Some(k) = &self.kubeconfig {
                lines.push(Line::Out(format!("{indent}kubeconfig: {}", k.display())));
            }
            if let Some(t) = &self.talosconfig {
                lines.push(Line::Out(format!("{indent}talosconfig: {}", t.display())));
            }
        }
        lines
    }

    /// One line: each stage with how many nodes it left in each state, e.g.
    /// `build: 5 unchanged; upload: 5 unchanged; …; etcd: unchanged (cp-01)`.
    fn stage_summary(&self) -> String {
        let mut parts = Vec::new();
        for (i, (name, _)) in Stages::default().named().iter().enumerate() {
            let mut counts: Vec<(Change, usize)> = Vec::new();
            let mut seen: Vec<(Change, &str)> = Vec::new();
            for n in &self.nodes {
                let Some(c) = n.stages.named()[i].1 else {
                    continue;
                };
                // One image shared by several rows is built and uploaded once.
                if let (Some(key), "build" | "upload") = (&n.shared, *name) {
                    if seen.contains(&(c, key.as_str())) {
                        continue;
                    }
                    seen.push((c, key));
                }
                match counts.iter_mut().find(|(k, _)| *k == c) {
                    Some((_, n)) => *n += 1,
                    None => counts.push((c, 1)),
                }
            }
            if counts.is_empty() {
                continue;
            }
            let text: Vec<String> = counts
                .iter()
                .map(|(c, n)| format!("{n} {}", c.word(self.dry_run)))
                .collect();
            parts.push(format!("{name}: {}", text.join(", ")));
        }
        let etcd = match (self.bootstrap, &self.bootstrap_node) {
            (Some(c), Some(node)) => Some(format!("etcd: {} ({node})", c.word(self.dry_run))),
            (None, Some(node)) if self.dry_run => Some(format!(
                "etcd: bootstrapped on {node} unless it already runs"
            )),
            _ => None,
        };
        parts.extend(etcd);
        parts.join("; ")
    }
}

/// The error chain of `e` on one line, as the reports carry it.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::talos::stage::BootstrapOptions;
    use std::path::Path;

    fn report(dry_run: bool) -> Report {
        let text = r#"
cluster: {name: lab, talosVersion: v1.11.2, kubernetesVersion: v1.34.1, endpoint: "https://10.0.0.10:6443"}
network: {cidr: 10.0.0.0/24, gateway: 10.0.0.1, interface: ens18}
nodes:
  - {name: cp-01, role: controlplane, address: 10.0.0.11}
  - {name: w-01, role: worker, address: 10.0.0.21}
"#;
        let inv = Inventory::parse(text, Path::new("cluster.yaml")).unwrap();
        let reach = Reach::of(&inv, &BootstrapOptions::default());
        Report::new(&inv, "none", dry_run, &reach)
    }

    #[test]
    fn a_run_stopped_for_some_nodes_is_partial_only_if_others_finished() {
        let mut r = report(false);
        r.fail("w-01", |s| s.build = Some(Change::Failed), "boom".into());
        r.stopped = Some((
            Stage::Build,
            UpError::Nodes {
                stage: Stage::Build,
                failed: vec!["w-01".into()],
            },
        ));
        assert!(!r.partial(), "cp-01 was not selected: nothing finished");
        r.node("cp-01").unwrap().stages.build = Some(Change::Built);
        r.stopped = Some((
            Stage::Build,
            UpError::Nodes {
                stage: Stage::Build,
                failed: vec!["w-01".into()],
            },
        ));
        assert!(r.partial());
        r.fail("cp-01", |s| s.build = Some(Change::Failed), "boom".into());
        assert!(!r.partial());
        r.stopped = Some((Stage::Bootstrap, UpError::Setup("x".into())));
        assert!(!r.partial());
        let err = UpError::Nodes {
            stage: Stage::Publish,
            failed: vec!["a".into(), "b".into()],
        };
        assert_eq!(
            err.to_string(),
            "publish: 2 failed (a, b); the cluster was not bootstrapped"
        );
    }

    #[test]
    fn reports_carry_the_change_words_and_every_node() {
        let mut r = report(true);
        r.node("cp-01").unwrap().stages.apply = Some(Change::Unchanged);
        let v = r.json().unwrap();
        assert_eq!(v["dryRun"], true);
        assert_eq!(v["target"], "none");
        assert_eq!(v["nodes"][0]["address"], "10.0.0.11");
        assert_eq!(
            v["nodes"][0]["stages"],
            serde_json::json!({"apply": "unchanged"})
        );
        assert_eq!(v["nodes"][1]["stages"], serde_json::json!({}));
        assert!(v.get("failedStage").is_none());
        for c in [Change::Built, Change::Outdated, Change::Failed] {
            assert_eq!(serde_json::to_value(c).unwrap(), c.as_str());
        }
        r.stop(Stage::Publish, UpError::Setup("no vm section".into()));
        let v = r.json().unwrap();
        assert_eq!(v["failedStage"], "publish");
        assert_eq!(v["error"], "no vm section");
    }

    #[test]
    fn the_table_lines_up_and_a_dry_run_says_what_would_happen() {
        let mut r = report(true);
        let sha = "ab".repeat(32);
        let n = r.node("cp-01").unwrap();
        n.sha256 = Some(sha.parse().unwrap());
        n.stages.build = Some(Change::Built);
        n.talos = Some(TalosState::Maintenance);
        r.node("w-01").unwrap().stages.build = Some(Change::Unchanged);
        r.bootstrap_node = Some("cp-01".into());
        let v = r.json().unwrap();
        assert_eq!(v["nodes"][0]["sha256"], sha, "lowercase hex in JSON");
        let lines = r.text();
        let out: Vec<&str> = lines
            .iter()
            .map(|l| match l {
                Line::Out(s) => s.as_str(),
                Line::Err(s) => panic!("no error expected: {s}"),
            })
            .collect();
        assert_eq!(
            out[0],
            "dry run: cluster lab (target none); nothing was changed"
        );
        assert_eq!(
            out[1],
            "NODE   IMAGE         VOLUME  VM/SERVER  ADDRESS    TALOS        K8S READY"
        );
        assert_eq!(
            out[2],
            "cp-01  abababababab  -       -          10.0.0.11  maintenance  -"
        );
        assert_eq!(
            out[3],
            "w-01   -             -       -          10.0.0.21  -            -"
        );
        assert_eq!(
            out[4],
            "build: 1 to build, 1 unchanged; etcd: bootstrapped on cp-01 unless it already runs"
        );
        assert_eq!(out.len(), 5);
    }

    #[test]
    fn failed_nodes_go_to_standard_error() {
        let mut r = report(false);
        r.fail(
            "w-01",
            |s| s.upload = Some(Change::Failed),
            "disk full".into(),
        );
        r.stop(
            Stage::Publish,
            UpError::Nodes {
                stage: Stage::Publish,
                failed: vec!["w-01".into()],
            },
        );
        let errors: Vec<Line> = r
            .text()
            .into_iter()
            .filter(|l| matches!(l, Line::Err(_)))
            .collect();
        assert_eq!(errors, [Line::Err("error: node w-01: disk full".into())]);
    }

    #[test]
    fn error_chains_read_on_one_line() {
        let e = StageError::Io {
            path: "/x/kubeconfig".into(),
            source: std::io::Error::other("disk full"),
        };
        assert_eq!(chain(&e), "/x/kubeconfig: disk full");
    }
}
