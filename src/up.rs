//! `imgbuild up`: the whole line as library calls: build → publish → start →
//! bootstrap → health. Each stage is the call its own command makes
//! ([`build::build`], the target's publish, [`stage::bootstrap`]), and each
//! is idempotent, so a rerun after any failure (or SIGKILL) continues from
//! what is done and reports every finished stage as unchanged. [`plan`] is
//! the dry run: it reads (manifest, GETs, TLS probes) and changes nothing.
//! Every decision is the stage's own (the target's per node, the
//! bootstrap's reach); `up` records them in a [`Report`], whose table and
//! JSON [`report`] shapes.

mod error;
mod report;

pub use error::{Stage, UpError};
pub use report::{Change, Line, NodeReport, Report, Stages, TalosState, chain};

use std::collections::BTreeMap;
use std::time::Instant;

use crate::build::{self, BuildError, BuildOptions};
use crate::fetch::Progress;
use crate::inventory::Inventory;
use crate::publish::PublishImage;
use crate::publish::hcloud::{self, HcloudError, SnapshotImage, servers};
use crate::publish::proxmox::{self, ProxmoxError, VmChange};
use crate::publish::target::{HcloudTarget, ProxmoxTarget, Target};
use crate::talos::bootstrap;
use crate::talos::client::NodeEndpoint;
use crate::talos::stage::{self, BootstrapOptions, Reach};
use report::changed;

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

/// Runs every stage. Never fails outright: the report says how far it got
/// and, in [`Report::stopped`], which stage stopped it and why.
pub fn up(inv: &Inventory, target: &Target, opts: &UpOptions, obs: Observers<'_>) -> Report {
    let started = Instant::now();
    let mut report = begin(inv, target, opts, false, started);
    if report.stopped.is_some() {
        return report;
    }
    // One run at a time changes this cluster's nodes; taken after the
    // pre-flight check, so an inventory that fails it leaves nothing behind.
    let _lock = match stage::lock_state_dir(inv, &opts.bootstrap, "up") {
        Ok(lock) => lock,
        Err(e) => {
            report.stop(Stage::Bootstrap, UpError::Bootstrap(e));
            return report;
        }
    };
    let mode = Mode::Run(obs);
    let published = build(inv, target, opts, mode, &mut report)
        .and_then(|built| publish(inv, target, opts, built, mode, &mut report));
    let mut bootstrap = opts.bootstrap.clone();
    if let Target::Hcloud(hc) = target {
        // The signal handler that lets a snapshot run clean up keeps
        // Ctrl-C from ending the process: the bootstrap must stop on it too.
        bootstrap.cancel = hc.cancel;
    }
    let done = match published {
        Err((stage, e)) => {
            report.stop(stage, e);
            None
        }
        Ok(reached) => {
            // Apply, bootstrap once, health: each node's readiness as the
            // last health round saw it.
            bootstrap.targets.extend(reached);
            match stage::bootstrap(inv, &bootstrap, obs.bootstrap) {
                Ok(done) => {
                    report.bootstrapped(&done);
                    Some(done)
                }
                Err(e) => {
                    report.stop(Stage::Bootstrap, e.into());
                    None
                }
            }
        }
    };
    report.elapsed_ms = started.elapsed().as_millis();
    // A healthy cluster may still run other versions, schematics or
    // configs than the inventory asks for: what `imgbuild status` flags.
    if let Some(done) = done
        && report.healthy
    {
        report.drifted(stage::drift(inv, &done.prepared, &bootstrap));
    }
    report
}

/// The dry run: what `up` would build, upload, create, start, apply and
/// bootstrap. Reads the manifest, sends GETs to the target and probes each
/// node's TLS; builds nothing, writes nothing, changes nothing anywhere.
pub fn plan(inv: &Inventory, target: &Target, opts: &UpOptions) -> Report {
    let started = Instant::now();
    let mut report = begin(inv, target, opts, true, started);
    if report.stopped.is_some() {
        return report;
    }
    let planned = build(inv, target, opts, Mode::Plan, &mut report)
        .and_then(|built| publish(inv, target, opts, built, Mode::Plan, &mut report));
    let mut bootstrap = opts.bootstrap.clone();
    match planned {
        Ok(reached) => bootstrap.targets.extend(reached),
        Err((stage, e)) => report.stop(stage, e),
    }
    // Without a runtime to probe on, the nodes' Talos state stays unknown.
    if let Ok(survey) = stage::survey(inv, &bootstrap) {
        report.surveyed(&survey);
    }
    report.elapsed_ms = started.elapsed().as_millis();
    report
}

/// The report of a run (or dry run) about to start, every row placed
/// where the bootstrap will reach its node; already stopped when a bad
/// patch or an unreachable node stops it before any machine exists (not
/// after the VMs were created and started).
fn begin(
    inv: &Inventory,
    target: &Target,
    opts: &UpOptions,
    dry_run: bool,
    started: Instant,
) -> Report {
    let reach = Reach::of(inv, &opts.bootstrap);
    let mut report = Report::new(inv, target.name(), dry_run, &reach);
    if let Err(e) = stage::check(inv, &opts.bootstrap) {
        report.stop(Stage::Bootstrap, UpError::Bootstrap(e));
        report.elapsed_ms = started.elapsed().as_millis();
    }
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

/// What the build leaves for the publish part.
#[derive(Default)]
struct Built {
    /// Each selected node's inventory position and its image: in a dry run
    /// the current one (as the build would leave it), None where none is.
    images: Vec<(usize, Option<build::BuildOutcome>)>,
    /// Nodes whose build failed (the others were built).
    failed: Vec<String>,
}

/// Builds the selected nodes' images, or in a dry run reads which ones the
/// manifest holds current; records each. Nothing for [`Target::None`]:
/// machines booted by other means need no image.
fn build(
    inv: &Inventory,
    target: &Target,
    opts: &UpOptions,
    mode: Mode<'_>,
    report: &mut Report,
) -> Result<Built, (Stage, UpError)> {
    let nodes = match target {
        Target::None => return Ok(Built::default()),
        // Only nodes without a server need an image (their image of record).
        Target::Hcloud(hc) => {
            let to_publish = |e| (Stage::Publish, UpError::Hcloud(e));
            let api = hc.api().map_err(to_publish)?;
            let nodes = servers::without_server(&api, inv, &opts.nodes).map_err(to_publish)?;
            if nodes.is_empty() {
                return Ok(Built::default());
            }
            nodes
        }
        Target::Proxmox(_) => opts.nodes.clone(),
    };
    let (outcomes, failed) = match mode {
        Mode::Run(obs) => {
            let (built, failed) = match build::build(inv, &nodes, &opts.build, obs.download) {
                Ok(built) => (built, Vec::new()),
                Err(BuildError::Incomplete { built, failed }) => (built, failed),
                Err(e) => return Err((Stage::Build, e.into())),
            };
            let outcomes = built.into_iter().map(|o| (o.image.node.clone(), Some(o)));
            (outcomes.collect::<Vec<_>>(), failed)
        }
        Mode::Plan => {
            let current = build::current_images(inv, &nodes, &opts.build)
                .map_err(|e| (Stage::Build, e.into()))?;
            let out_dir = &opts.build.out_dir;
            let outcomes = current.into_iter().map(|(node, image)| {
                let current = image.map(|image| build::BuildOutcome {
                    file: image.file(out_dir),
                    image,
                    built: false,
                });
                (node, current)
            });
            (outcomes.collect(), Vec::new())
        }
    };
    let images: Vec<(usize, Option<build::BuildOutcome>)> = outcomes
        .into_iter()
        .filter_map(|(node, o)| Some((inv.nodes.iter().position(|n| n.name == node)?, o)))
        .collect();
    report.built(&images, &failed);
    Ok(Built {
        images,
        failed: failed.into_iter().map(|f| f.node).collect(),
    })
}

/// Publishes the built images on `target` (nothing for [`Target::None`]),
/// or in a dry run says what that would do; where the bootstrap reaches
/// each node (a Hetzner server's public IP). Stops when any node failed,
/// since a cluster missing a node cannot become healthy.
fn publish(
    inv: &Inventory,
    target: &Target,
    opts: &UpOptions,
    built: Built,
    mode: Mode<'_>,
    report: &mut Report,
) -> Result<BTreeMap<String, NodeEndpoint>, (Stage, UpError)> {
    match target {
        Target::None => Ok(BTreeMap::new()),
        Target::Proxmox(pve) => proxmox(inv, pve, built, mode, report).map(|()| BTreeMap::new()),
        Target::Hcloud(hc) => hcloud(inv, hc, opts, built, mode, report),
    }
}

/// Proxmox: upload each image and make, update and start each node's VM
/// (or plan it). The real run and the dry run report the same decision.
fn proxmox(
    inv: &Inventory,
    pve: &ProxmoxTarget,
    built: Built,
    mode: Mode<'_>,
    report: &mut Report,
) -> Result<(), (Stage, UpError)> {
    let bad_image = |e: crate::publish::ImageError| (Stage::Build, UpError::Setup(e.to_string()));
    let mut images = Vec::new();
    for (index, outcome) in built.images {
        let image = outcome
            .map(|o| PublishImage::new(inv, &o.image, o.file))
            .transpose()
            .map_err(bad_image)?;
        images.push((index, image));
    }
    let mut failed_nodes = built.failed;
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
                let Some(n) = report.row(*index) else {
                    continue;
                };
                n.volume = volume;
                n.vmid = vmid;
                n.stages.upload = Some(changed(uploaded, Change::Uploaded));
                n.stages.vm = vm.map(Change::from);
                n.stages.start = Some(changed(started, Change::Started));
            }
            Err(e) => {
                // Marked where it happened (upload, VM or start), after
                // what finished before.
                let (step, message, done) = match e {
                    ProxmoxError::Node {
                        step,
                        message,
                        done,
                        ..
                    } => (step, message, done),
                    e => (proxmox::Step::Upload, e.to_string(), None),
                };
                if let (Some(p), Some(n)) = (done, report.row(*index)) {
                    n.volume = Some(p.volid);
                    n.vmid = p.vmid;
                    n.stages.upload = Some(changed(p.uploaded, Change::Uploaded));
                    n.stages.vm = p.vm.map(Change::from);
                }
                let failed = |s: &mut Stages| {
                    let column = match step {
                        proxmox::Step::Upload => &mut s.upload,
                        proxmox::Step::Vm => &mut s.vm,
                        proxmox::Step::Start => &mut s.start,
                    };
                    *column = Some(Change::Failed);
                };
                report.fail_row(*index, failed, message);
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
    built: Built,
    mode: Mode<'_>,
    report: &mut Report,
) -> Result<BTreeMap<String, NodeEndpoint>, (Stage, UpError)> {
    let publish = |e: HcloudError| (Stage::Publish, UpError::Hcloud(e));
    if !built.failed.is_empty() {
        return Err((
            Stage::Build,
            UpError::Nodes {
                stage: Stage::Build,
                failed: built.failed,
            },
        ));
    }
    for (index, _) in &built.images {
        if let Some(n) = report.row(*index) {
            n.shared = Some(hcloud::snapshot_key(inv, &inv.nodes[*index]));
        }
    }
    if let Mode::Plan = mode {
        for (index, _) in &built.images {
            if let Some(n) = report.row(*index) {
                n.stages.upload = Some(Change::Uploaded);
                n.stages.vm = Some(Change::Created);
                n.stages.start = Some(Change::Started);
            }
        }
    }
    let images = SnapshotImage::distinct(
        built
            .images
            .iter()
            .filter_map(|(_, o)| o.as_ref())
            .map(|o| (&o.image, o.file.clone())),
    );
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
        .filter(|(node, _)| opts.nodes.is_empty() || opts.nodes.contains(node))
        .filter_map(|(node, user_data)| {
            let snapshot = snapshot_of.get(&node).copied();
            let spec = inv.node(&node).ok()?;
            let server_type = spec.hcloud_server_type(&hc.settings)?.to_owned();
            let location = spec.hcloud_location(&hc.settings).to_owned();
            let private_ip = spec.address;
            Some(servers::ServerSpec {
                node,
                snapshot,
                server_type,
                location,
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
    // For the commands after it, when the API cannot be asked.
    let dir = stage::StateDir::open(inv, opts.bootstrap.state_dir.as_deref())
        .map_err(|e| (Stage::Publish, UpError::Bootstrap(e)))?;
    servers::record(inv, &dir.path, made.iter().chain(&all)).map_err(publish)?;
    Ok(targets)
}

/// Puts server `s` in its node's row (with its vm and start outcomes, if
/// this run dealt with it) and notes where the bootstrap reaches it.
fn record_server(
    report: &mut Report,
    targets: &mut BTreeMap<String, NodeEndpoint>,
    s: &servers::ClusterServer,
    stages: Option<(Change, Change)>,
) {
    let Some(n) = report.node(&s.node) else {
        return;
    };
    n.server = Some(s.id);
    if let Some((vm, start)) = stages {
        // A server's image is history: nothing to upload for it.
        n.stages.upload.get_or_insert(Change::Unchanged);
        n.stages.vm = Some(vm);
        n.stages.start = Some(start);
    }
    if let Some(ip) = s.public_ip {
        n.address = Some(ip);
        targets.extend(NodeEndpoint::new(Some(ip), None).map(|t| (s.node.clone(), t)));
    }
}
