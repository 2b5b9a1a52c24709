//! `imgbuild up`: the whole line as library calls: build → publish → start →
//! bootstrap → health. Each stage is the call its own command makes
//! ([`build::build`], [`proxmox::publish`], [`stage::bootstrap`]), and each is
//! idempotent, so a rerun after any failure (or SIGKILL) continues from what
//! is done and reports every finished stage as unchanged. [`plan`] is the dry
//! run: it reads (manifest, GETs, TLS probes) and changes nothing.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::build::{self, BuildError, BuildOptions};
use crate::fetch::Progress;
use crate::inventory::Inventory;
use crate::publish::PublishImage;
use crate::publish::hcloud::{self, HcloudError, SnapshotImage, servers};
use crate::publish::proxmox::{self, ProxmoxError, VmChange};
use crate::publish::target::{HcloudTarget, ProxmoxTarget, Target};
use crate::talos::bootstrap;
use crate::talos::client::{self, Probe, Target as NodeTarget};
use crate::talos::stage::{self, BootstrapOptions, StageError};

/// What one `up` does besides the target.
#[derive(Clone)]
pub struct UpOptions {
    /// Nodes to build and publish (all when empty). The bootstrap always
    /// covers the whole cluster: health is a cluster-wide fact.
    pub nodes: Vec<String>,
    pub build: BuildOptions,
    pub bootstrap: BootstrapOptions,
}

/// Where each stage reports its progress; the CLI renders it.
#[derive(Clone, Copy)]
pub struct Observers<'a> {
    pub download: &'a dyn Progress,
    pub publish: &'a dyn proxmox::Observer,
    pub hcloud: &'a dyn hcloud::Observer,
    pub bootstrap: &'a dyn bootstrap::Observer,
}

/// Why `up` could not start or a stage stopped it. Never carries a secret.
#[derive(Debug, thiserror::Error)]
pub enum UpError {
    /// The inventory or environment lacks what `up` needs.
    #[error("{0}")]
    Setup(String),
    #[error(transparent)]
    Build(#[from] BuildError),
    #[error(transparent)]
    Proxmox(#[from] ProxmoxError),
    #[error(transparent)]
    Hcloud(#[from] HcloudError),
    #[error(transparent)]
    Bootstrap(#[from] StageError),
    /// Some nodes failed a stage (each named in its report); the others
    /// finished it. Bootstrapping waits until every node is published.
    #[error("{stage}: {} failed ({}); the cluster was not bootstrapped", failed.len(), failed.join(", "))]
    Nodes { stage: Stage, failed: Vec<String> },
}

impl UpError {
    /// Whether the inventory or environment is at fault (not a server or node).
    pub fn is_setup(&self) -> bool {
        match self {
            UpError::Setup(_)
            | UpError::Proxmox(ProxmoxError::Setup(_))
            | UpError::Hcloud(HcloudError::Setup(_)) => true,
            UpError::Build(BuildError::UnknownNode(_)) => true,
            UpError::Bootstrap(e) => matches!(
                e,
                StageError::UnknownTarget(_)
                    | StageError::BadEndpoint { .. }
                    | StageError::NoAddress { .. }
                    | StageError::Config(_)
            ),
            _ => false,
        }
    }
}

/// The stages, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Stage {
    Build,
    Publish,
    Bootstrap,
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Stage::Build => "build",
            Stage::Publish => "publish",
            Stage::Bootstrap => "bootstrap",
        })
    }
}

/// What a stage did to one node (or, in a dry run, would do).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Change {
    Built,
    Uploaded,
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
}

impl From<VmChange> for Change {
    fn from(v: VmChange) -> Change {
        match v {
            VmChange::Created => Change::Created,
            VmChange::Updated => Change::Updated,
            VmChange::Unchanged => Change::Unchanged,
            VmChange::Outdated => Change::Outdated,
        }
    }
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

/// A node's Talos API as last seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TalosState {
    /// Answers without a client certificate: waiting for its config.
    Maintenance,
    /// Answers over mTLS only: configured.
    Configured,
    /// Port closed or no TLS answer.
    Unreachable,
}

/// One row of the summary.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeReport {
    pub node: String,
    /// Where imgbuild reaches its Talos API.
    pub address: Option<IpAddr>,
    /// The image's sha256 (as the manifest records it).
    pub sha256: Option<String>,
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
    pub kubeconfig: Option<PathBuf>,
    pub talosconfig: Option<PathBuf>,
    pub elapsed_ms: u128,
    /// The stage that stopped the run, and why.
    #[serde(skip)]
    pub stopped: Option<(Stage, UpError)>,
}

impl Report {
    fn new(inv: &Inventory, target: &Target, dry_run: bool, opts: &BootstrapOptions) -> Report {
        let nodes = inv
            .nodes
            .iter()
            .map(|n| NodeReport {
                node: n.name.clone(),
                address: opts
                    .targets
                    .get(&n.name)
                    .map(|t| t.server_name)
                    .or(n.address)
                    .or_else(|| node_target(n, opts).map(|t| t.server_name)),
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
            })
            .collect();
        Report {
            cluster: inv.cluster.name.clone(),
            target: target.name(),
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
        }
    }

    fn node(&mut self, name: &str) -> Option<&mut NodeReport> {
        self.nodes.iter_mut().find(|n| n.node == name)
    }

    fn fail(&mut self, node: &str, stage: impl FnOnce(&mut Stages), error: String) {
        if let Some(n) = self.node(node) {
            stage(&mut n.stages);
            n.error = Some(error);
        }
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
        some_failed || matches!(self.health, Some(bootstrap::Health::NoCni { .. }))
    }
}

/// Where the bootstrap reaches `node`: the override, else its talosEndpoint
/// or address (as [`stage::prepare`] decides).
fn node_target(node: &crate::inventory::NodeSpec, opts: &BootstrapOptions) -> Option<NodeTarget> {
    opts.targets
        .get(&node.name)
        .cloned()
        .or_else(|| NodeTarget::new(node.address, node.talos_endpoint.as_deref()))
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

/// Runs every stage. Never fails outright: the report says how far it got
/// and, in [`Report::stopped`], which stage stopped it and why.
pub fn up(inv: &Inventory, target: &Target, opts: &UpOptions, obs: Observers<'_>) -> Report {
    let started = Instant::now();
    let mut report = Report::new(inv, target, false, &opts.bootstrap);
    // A bad patch or an unreachable node stops the run before any machine
    // exists, not after the VMs were created and started.
    if let Err(e) = stage::check(inv, &opts.bootstrap) {
        report.stopped = Some((Stage::Bootstrap, UpError::Bootstrap(e)));
        report.elapsed_ms = started.elapsed().as_millis();
        return report;
    }
    let published = publish(inv, target, opts, Mode::Run(obs), &mut report);
    let mut opts = opts.clone();
    let bootstrapped = match published {
        Err(stop) => Err(stop),
        Ok(targets) => {
            opts.bootstrap.targets.extend(targets);
            bootstrap_stage(inv, &opts, obs, &mut report).map_err(|e| (Stage::Bootstrap, e))
        }
    };
    if let Err((stage, e)) = bootstrapped {
        if let UpError::Bootstrap(StageError::Bootstrap(b)) = &e {
            let failed = match b {
                bootstrap::BootstrapError::Nodes { failed, .. } => failed.iter().collect(),
                other => vec![other],
            };
            for f in failed {
                if let Some(node) = f.node() {
                    report.fail(node, |s| s.apply = Some(Change::Failed), f.to_string());
                }
            }
            if let bootstrap::BootstrapError::Nodes {
                etcd: Some((node, now)),
                ..
            } = b
            {
                report.bootstrap = Some(changed(*now, Change::Bootstrapped));
                report.bootstrap_node = Some(node.clone());
            }
        }
        report.stopped = Some((stage, e));
    }
    report.elapsed_ms = started.elapsed().as_millis();
    report
}

/// Whether the publish part runs or is planned.
#[derive(Clone, Copy)]
enum Mode<'a> {
    /// Build, then publish, reporting to the observers.
    Run(Observers<'a>),
    /// Read the manifest and the target (GETs only); change nothing.
    Plan,
}

/// Build and publish on `target` (nothing for [`Target::None`]), or in a
/// dry run what that would do; where the bootstrap reaches each node (a
/// Hetzner server's public IP). Stops when any node failed, since a cluster
/// missing a node cannot become healthy.
fn publish(
    inv: &Inventory,
    target: &Target,
    opts: &UpOptions,
    mode: Mode<'_>,
    report: &mut Report,
) -> Result<BTreeMap<String, NodeTarget>, (Stage, UpError)> {
    match target {
        Target::None => Ok(BTreeMap::new()),
        Target::Proxmox(pve) => proxmox(inv, pve, opts, mode, report).map(|()| BTreeMap::new()),
        Target::Hcloud(hc) => hcloud(inv, hc, opts, mode, report),
    }
}

/// The row of the node at inventory position `index`.
fn row(report: &mut Report, index: usize) -> Option<&mut NodeReport> {
    report.nodes.get_mut(index)
}

/// Marks the node at `index` failed at `stage`.
fn fail_row(report: &mut Report, index: usize, stage: impl FnOnce(&mut Stages), error: String) {
    if let Some(n) = row(report, index) {
        stage(&mut n.stages);
        n.error = Some(error);
    }
}

/// A node's inventory position and its image, when current.
type Current = (usize, Option<build::NodeImage>);

/// The selected nodes' images as the manifest has them (a dry run: what
/// the build would skip), recorded as the build would leave them.
fn current(
    inv: &Inventory,
    opts: &UpOptions,
    report: &mut Report,
) -> Result<Vec<Current>, (Stage, UpError)> {
    let current = build::current_images(inv, &opts.nodes, &opts.build)
        .map_err(|e| (Stage::Build, e.into()))?;
    let mut out = Vec::new();
    for (node, image) in current {
        let Some(index) = inv.nodes.iter().position(|n| n.name == node) else {
            continue;
        };
        if let Some(n) = row(report, index) {
            n.stages.build = Some(if image.is_some() {
                Change::Unchanged
            } else {
                Change::Built
            });
            if let Some(img) = &image {
                n.sha256 = Some(img.sha256.clone());
                n.image = Some(img.file(&opts.build.out_dir));
            }
        }
        out.push((index, image));
    }
    Ok(out)
}

/// Proxmox: upload each image and make, update and start each node's VM
/// (or plan it). The real run and the dry run report the same decision.
fn proxmox(
    inv: &Inventory,
    pve: &ProxmoxTarget,
    opts: &UpOptions,
    mode: Mode<'_>,
    report: &mut Report,
) -> Result<(), (Stage, UpError)> {
    let bad_image = |e: crate::publish::ImageError| (Stage::Build, UpError::Setup(e.to_string()));
    let (images, mut failed_nodes) = match mode {
        Mode::Run(obs) => {
            let (built, failed) = build_stage(inv, opts, obs, report)?;
            let images = PublishImage::built(inv, &built).map_err(bad_image)?;
            (
                images.into_iter().map(|i| (i.index, Some(i))).collect(),
                failed,
            )
        }
        Mode::Plan => {
            let mut images = Vec::new();
            for (index, image) in current(inv, opts, report)? {
                let image = image
                    .map(|img| PublishImage::new(inv, &img, img.file(&opts.build.out_dir)))
                    .transpose()
                    .map_err(bad_image)?;
                images.push((index, image));
            }
            (images, Vec::new())
        }
    };
    let build_failed = !failed_nodes.is_empty();
    let to_publish = |e: ProxmoxError| (Stage::Publish, UpError::from(e));
    // Per node: (volume, vmid, uploaded, vm, started), or why it failed.
    type Done = Result<(Option<String>, Option<u32>, bool, Option<VmChange>, bool), ProxmoxError>;
    let done: Vec<Done> = match mode {
        Mode::Run(obs) => {
            let images: Vec<PublishImage> = images.iter().filter_map(|(_, i)| i.clone()).collect();
            pve.publish(inv, &images, obs.publish)
                .map_err(to_publish)?
                .into_iter()
                .map(|r| r.map(|p| (Some(p.volid), p.vmid, p.uploaded, p.vm, p.started)))
                .collect()
        }
        // An image not built yet is uploaded unless the storage happens
        // to hold its exact bytes already.
        Mode::Plan => pve
            .plan(inv, &images)
            .map_err(to_publish)?
            .into_iter()
            .map(|r| r.map(|d| (d.volid, d.vmid, d.upload != Some(false), d.vm, d.start)))
            .collect(),
    };
    // The real run publishes every entry: only built images are listed.
    for ((index, _), r) in images.iter().zip(done) {
        match r {
            Ok((volume, vmid, uploaded, vm, started)) => {
                let Some(n) = row(report, *index) else {
                    continue;
                };
                n.volume = volume;
                n.vmid = vmid;
                n.stages.upload = Some(changed(uploaded, Change::Uploaded));
                n.stages.vm = vm.map(Change::from);
                n.stages.start = Some(changed(started, Change::Started));
            }
            Err(e) => {
                let message = match e {
                    ProxmoxError::Node { message, .. } => message,
                    e => e.to_string(),
                };
                fail_row(report, *index, |s| s.upload = Some(Change::Failed), message);
                failed_nodes.push(inv.nodes[*index].name.clone());
            }
        }
    }
    if failed_nodes.is_empty() {
        return Ok(());
    }
    let stage = if build_failed {
        Stage::Build
    } else {
        Stage::Publish
    };
    Err((
        stage,
        UpError::Nodes {
            stage,
            failed: failed_nodes,
        },
    ))
}

/// Hetzner Cloud: snapshots of the built images, then one server per node
/// from them with its machine config as `user_data` (or, in a dry run,
/// which snapshots and servers exist); where the bootstrap reaches each
/// node (the public IP the API reports).
fn hcloud(
    inv: &Inventory,
    hc: &HcloudTarget,
    opts: &UpOptions,
    mode: Mode<'_>,
    report: &mut Report,
) -> Result<BTreeMap<String, NodeTarget>, (Stage, UpError)> {
    let publish = |e: HcloudError| (Stage::Publish, UpError::Hcloud(e));
    let images = match mode {
        Mode::Run(obs) => {
            let (built, failed) = build_stage(inv, opts, obs, report)?;
            if !failed.is_empty() {
                return Err((
                    Stage::Build,
                    UpError::Nodes {
                        stage: Stage::Build,
                        failed,
                    },
                ));
            }
            SnapshotImage::distinct(built.iter().map(|o| (&o.image, o.file.clone())))
        }
        Mode::Plan => {
            let current = current(inv, opts, report)?;
            for (index, _) in &current {
                if let Some(n) = row(report, *index) {
                    n.stages.upload = Some(Change::Uploaded);
                    n.stages.vm = Some(Change::Created);
                    n.stages.start = Some(Change::Started);
                }
            }
            let out_dir = &opts.build.out_dir;
            SnapshotImage::distinct(
                current
                    .iter()
                    .filter_map(|(_, img)| img.as_ref())
                    .map(|img| (img, img.file(out_dir))),
            )
        }
    };
    let api = hc.api().map_err(publish)?;
    let Mode::Run(obs) = mode else {
        let planned = hc.plan(&api, &images).map_err(publish)?;
        for (image, found) in images.iter().zip(planned) {
            for node in &image.nodes {
                if let (Some(id), Some(n)) = (found, report.node(node)) {
                    n.volume = Some(format!("snapshot {id}"));
                    n.stages.upload = Some(Change::Unchanged);
                }
            }
        }
        let mut targets = BTreeMap::new();
        for s in servers::existing(&api, &inv.cluster.name).map_err(publish)? {
            let stages = (
                Change::Unchanged,
                changed(s.status == "off", Change::Started),
            );
            record_server(report, &mut targets, &s, Some(stages));
        }
        return Ok(targets);
    };
    let mut snapshot_of: BTreeMap<String, u64> = BTreeMap::new();
    let mut failed = Vec::new();
    let runs = hc.publish(&api, &images, obs.hcloud);
    for (image, run) in images.iter().zip(runs) {
        let leftovers: Vec<String> = run
            .leftovers
            .iter()
            .map(|l| {
                format!(
                    "{} {} not deleted ({}): run `imgbuild cleanup`",
                    l.kind, l.id, l.error
                )
            })
            .collect();
        match run.result {
            Ok(snap) if leftovers.is_empty() => {
                for node in &snap.nodes {
                    snapshot_of.insert(node.clone(), snap.id);
                    if let Some(n) = report.node(node) {
                        n.volume = Some(format!("snapshot {}", snap.id));
                        n.stages.upload = Some(changed(snap.created, Change::Uploaded));
                    }
                }
            }
            result => {
                let mut why: Vec<String> =
                    result.err().map(|e| e.to_string()).into_iter().collect();
                why.extend(leftovers);
                for node in &image.nodes {
                    report.fail(node, |s| s.upload = Some(Change::Failed), why.join("; "));
                    failed.push(node.clone());
                }
            }
        }
    }
    if !failed.is_empty() {
        return Err((
            Stage::Publish,
            UpError::Nodes {
                stage: Stage::Publish,
                failed,
            },
        ));
    }
    let configs = stage::machine_configs(inv, &opts.bootstrap)
        .map_err(|e| (Stage::Publish, UpError::Bootstrap(e)))?;
    let specs: Vec<servers::ServerSpec> = configs
        .into_iter()
        .filter_map(|(node, user_data)| {
            let snapshot = *snapshot_of.get(&node)?;
            let private_ip = inv.node(&node).ok()?.address;
            Some(servers::ServerSpec {
                node,
                snapshot,
                user_data,
                talos_version: inv.cluster.talos_version.clone(),
                private_ip,
            })
        })
        .collect();
    let made = servers::ensure(
        &api,
        &hc.settings,
        &inv.cluster.name,
        &specs,
        &hc.options,
        &hc.cancel,
    )
    .map_err(publish)?;
    // Nodes not selected this run keep the servers they have.
    let mut all = servers::existing(&api, &inv.cluster.name).map_err(publish)?;
    all.retain(|s| !made.iter().any(|m| m.node == s.node));
    let mut targets = BTreeMap::new();
    for s in &made {
        let stages = (
            changed(s.created, Change::Created),
            changed(s.started, Change::Started),
        );
        record_server(report, &mut targets, s, Some(stages));
    }
    for s in &all {
        record_server(report, &mut targets, s, None);
    }
    Ok(targets)
}

/// `then` when `yes`, else unchanged.
fn changed(yes: bool, then: Change) -> Change {
    if yes { then } else { Change::Unchanged }
}

/// Puts server `s` in its node's row (with its vm and start outcomes, if
/// this run dealt with it) and notes where the bootstrap reaches it.
fn record_server(
    report: &mut Report,
    targets: &mut BTreeMap<String, NodeTarget>,
    s: &servers::ClusterServer,
    stages: Option<(Change, Change)>,
) {
    let Some(n) = report.node(&s.node) else {
        return;
    };
    n.server = Some(s.id);
    if let Some((vm, start)) = stages {
        n.stages.vm = Some(vm);
        n.stages.start = Some(start);
    }
    if let Some(ip) = s.public_ip {
        n.address = Some(ip);
        targets.extend(NodeTarget::new(Some(ip), None).map(|t| (s.node.clone(), t)));
    }
}

/// Builds the selected nodes' images and records them; the built ones and
/// the names of those that failed.
fn build_stage(
    inv: &Inventory,
    opts: &UpOptions,
    obs: Observers<'_>,
    report: &mut Report,
) -> Result<(Vec<build::Outcome>, Vec<String>), (Stage, UpError)> {
    let (built, failed) = match build::build(inv, &opts.nodes, &opts.build, obs.download) {
        Ok(built) => (built, Vec::new()),
        Err(BuildError::Incomplete { built, failed }) => (built, failed),
        Err(e) => return Err((Stage::Build, e.into())),
    };
    for o in &built {
        if let Some(n) = report.node(&o.image.node) {
            n.sha256 = Some(o.image.sha256.clone());
            n.image = Some(o.file.clone());
            n.stages.build = Some(changed(o.built, Change::Built));
        }
    }
    let mut failed_nodes: Vec<String> = Vec::new();
    for f in &failed {
        report.fail(&f.node, |s| s.build = Some(Change::Failed), chain(&f.error));
        failed_nodes.push(f.node.clone());
    }
    Ok((built, failed_nodes))
}

/// Apply, bootstrap once, health; then each node's readiness as the
/// Kubernetes API reports it.
fn bootstrap_stage(
    inv: &Inventory,
    opts: &UpOptions,
    obs: Observers<'_>,
    report: &mut Report,
) -> Result<(), UpError> {
    let done = stage::bootstrap(inv, &opts.bootstrap, obs.bootstrap)?;
    let outcome = &done.outcome;
    report.bootstrap = Some(changed(outcome.bootstrapped, Change::Bootstrapped));
    report.bootstrap_node = Some(outcome.bootstrap_node.clone());
    report.kubeconfig = Some(done.prepared.plan.kubeconfig_path.clone());
    report.talosconfig = Some(done.prepared.talosconfig.clone());
    report.fallbacks = outcome.fallbacks.clone();
    for planned in &done.prepared.plan.nodes {
        if let Some(n) = report.node(&planned.name) {
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
    // What Kubernetes said in the health round that ended the run.
    for n in &mut report.nodes {
        n.kubernetes_ready = Some(outcome.ready.get(&n.node).copied().unwrap_or(false));
    }
    report.healthy = outcome.health.is_healthy()
        && report
            .nodes
            .iter()
            .all(|n| n.kubernetes_ready == Some(true) && n.talos == Some(TalosState::Configured));
    report.health = Some(outcome.health.clone());
    Ok(())
}

/// The dry run: what `up` would build, upload, create, start, apply and
/// bootstrap. Reads the manifest, sends GETs to the target and probes each
/// node's TLS; builds nothing, writes nothing, changes nothing anywhere.
pub fn plan(inv: &Inventory, target: &Target, opts: &UpOptions) -> Report {
    let started = Instant::now();
    let mut report = Report::new(inv, target, true, &opts.bootstrap);
    if let Err(e) = stage::check(inv, &opts.bootstrap) {
        report.stopped = Some((Stage::Bootstrap, UpError::Bootstrap(e)));
        report.elapsed_ms = started.elapsed().as_millis();
        return report;
    }
    let planned = publish(inv, target, opts, Mode::Plan, &mut report);
    let mut opts = opts.clone();
    match planned {
        Ok(targets) => opts.bootstrap.targets.extend(targets),
        Err(stop) => report.stopped = Some(stop),
    }
    plan_bootstrap(inv, &opts, &mut report);
    report.elapsed_ms = started.elapsed().as_millis();
    report
}

/// Probes each node's TLS (no API call, no certificate): a node in
/// maintenance mode would get its config, a configured one nothing.
fn plan_bootstrap(inv: &Inventory, opts: &UpOptions, report: &mut Report) {
    let timeout = opts
        .bootstrap
        .limits
        .call_timeout
        .min(Duration::from_secs(3));
    let targets: Vec<(String, Option<NodeTarget>)> = inv
        .nodes
        .iter()
        .map(|n| (n.name.clone(), node_target(n, &opts.bootstrap)))
        .collect();
    let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        return;
    };
    let states: Vec<TalosState> = runtime.block_on(async {
        let probes = targets.iter().map(|(_, t)| async move {
            let Some(t) = t else {
                return TalosState::Unreachable;
            };
            match client::probe(t, timeout).await {
                Ok(Probe::Maintenance { .. }) => TalosState::Maintenance,
                Ok(Probe::Configured) => TalosState::Configured,
                Err(_) => TalosState::Unreachable,
            }
        });
        futures_util::future::join_all(probes).await
    });
    for ((name, _), state) in targets.iter().zip(states) {
        if let Some(n) = report.node(name) {
            n.talos = Some(state);
            n.stages.apply = Some(if state == TalosState::Configured {
                Change::Unchanged
            } else {
                Change::Applied
            });
        }
    }
    let first_cp = inv
        .nodes
        .iter()
        .find(|n| n.role == crate::inventory::Role::Controlplane);
    if let Some(cp) = first_cp {
        report.bootstrap_node = Some(cp.name.clone());
        let configured = report
            .nodes
            .iter()
            .any(|n| n.node == cp.name && n.talos == Some(TalosState::Configured));
        // A configured control plane may or may not run etcd yet: the run
        // asks it (over mTLS) and bootstraps only when etcd is not running.
        report.bootstrap = (!configured).then_some(Change::Bootstrapped);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn inv(publish: &str) -> Inventory {
        let text = format!(
            r#"
cluster: {{name: lab, talosVersion: v1.11.2, kubernetesVersion: v1.34.1, endpoint: "https://10.0.0.10:6443"}}
network: {{cidr: 10.0.0.0/24, gateway: 10.0.0.1, interface: ens18}}
{publish}
nodes:
  - {{name: cp-01, role: controlplane, address: 10.0.0.11}}
  - {{name: w-01, role: worker, address: 10.0.0.21}}
"#
        );
        Inventory::parse(&text, Path::new("cluster.yaml")).unwrap()
    }

    #[test]
    fn a_run_stopped_for_some_nodes_is_partial_only_if_others_finished() {
        let inv = inv("");
        let mut r = Report::new(&inv, &Target::None, false, &BootstrapOptions::default());
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
    fn reports_carry_the_stage_words_and_every_node() {
        let inv = inv("");
        let mut r = Report::new(&inv, &Target::None, true, &BootstrapOptions::default());
        r.node("cp-01").unwrap().stages.apply = Some(Change::Unchanged);
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["dryRun"], true);
        assert_eq!(v["target"], "none");
        assert_eq!(v["nodes"][0]["address"], "10.0.0.11");
        assert_eq!(
            v["nodes"][0]["stages"],
            serde_json::json!({"apply": "unchanged"})
        );
        assert_eq!(v["nodes"][1]["stages"], serde_json::json!({}));
        for c in [Change::Built, Change::Outdated, Change::Failed] {
            assert_eq!(serde_json::to_value(c).unwrap(), c.as_str());
        }
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
