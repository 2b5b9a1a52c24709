//! `imgbuild up`: the whole line as library calls: build → publish → start →
//! bootstrap → health. Each stage is the call its own command makes
//! ([`build::build`], [`proxmox::publish`], [`stage::bootstrap`]), and each is
//! idempotent, so a rerun after any failure (or SIGKILL) continues from what
//! is done and reports every finished stage as unchanged. [`plan`] is the dry
//! run: it reads (manifest, GETs, TLS probes) and changes nothing. What each
//! stage did goes into a [`Report`] ([`report`] shapes its table and JSON).

mod error;
mod report;

pub use error::{Stage, UpError};
pub use report::{Change, Line, NodeReport, Report, Stages, TalosState, chain};

use std::collections::BTreeMap;
use std::time::Instant;

use crate::build::{self, BuildError, BuildOptions};
use crate::fetch::Progress;
use crate::inventory::{HcloudSettings, Inventory, ProxmoxSettings};
use crate::publish::hcloud::{self, HcloudError, SnapshotImage, SnapshotOptions, servers};
use crate::publish::proxmox::{self, Credentials, ProxmoxError, PublishOptions};
use crate::publish::{Cancel, PublishImage};
use crate::talos::bootstrap;
use crate::talos::client::NodeEndpoint;
use crate::talos::stage::{self, BootstrapOptions, Reach};
use report::changed;

/// Where the machines come from. Each target publishes the images and starts
/// one machine per node; then every target is bootstrapped the same way.
#[derive(Debug, Clone)]
pub enum Target {
    /// Machines booted by other means: only the bootstrap runs.
    None,
    /// Images uploaded to Proxmox VE, one started VM per node.
    Proxmox(Box<ProxmoxTarget>),
    /// Snapshots in Hetzner Cloud, one server per node created from them
    /// with its machine config as `user_data`.
    Hcloud(Box<HcloudTarget>),
}

/// A Hetzner Cloud target: where, as whom, and how patiently.
#[derive(Debug, Clone)]
pub struct HcloudTarget {
    pub settings: HcloudSettings,
    pub credentials: hcloud::Credentials,
    pub options: SnapshotOptions,
    /// Stops the snapshot runs (which then delete their temporary server).
    pub cancel: Cancel,
}

impl HcloudTarget {
    fn api(&self) -> Result<hcloud::Api, (Stage, UpError)> {
        hcloud::Api::new(
            &self.credentials.endpoint,
            self.credentials.token.clone(),
            self.options.retry,
        )
        .map_err(|e| (Stage::Publish, UpError::Hcloud(e)))
    }
}

/// How each kind of target publishes.
#[derive(Debug, Clone)]
pub struct TargetOptions {
    pub proxmox: PublishOptions,
    pub hcloud: SnapshotOptions,
    pub cancel: Cancel,
}

/// A Proxmox VE target: where, as whom, and how to publish.
#[derive(Debug, Clone)]
pub struct ProxmoxTarget {
    pub settings: ProxmoxSettings,
    pub credentials: Credentials,
    pub options: PublishOptions,
}

impl Target {
    /// The inventory's `publish` section as a target, credentials read through
    /// `env`. `up` starts the VMs it publishes, whatever `vm.start` says:
    /// bootstrapping needs them running.
    pub fn from_inventory(
        inv: &Inventory,
        env: &dyn Fn(&str) -> Option<String>,
        options: TargetOptions,
    ) -> Result<Target, UpError> {
        match (&inv.publish.proxmox, &inv.publish.hcloud) {
            (None, None) => Ok(Target::None),
            (Some(_), Some(_)) => Err(UpError::Setup(
                "publish has both proxmox and hcloud: `up` brings a cluster up on one target; keep one"
                    .into(),
            )),
            (None, Some(settings)) => {
                if settings.servers.is_none() {
                    return Err(UpError::Setup(
                        "publish.hcloud has no servers section (`servers: {type: cpx22}`): `up` needs servers to bootstrap (`imgbuild publish` only makes snapshots)".into(),
                    ));
                }
                Ok(Target::Hcloud(Box::new(HcloudTarget {
                    settings: settings.clone(),
                    credentials: hcloud::Credentials::from_env(env)?,
                    options: options.hcloud,
                    cancel: options.cancel,
                })))
            }
            (Some(settings), None) => {
                let mut settings = settings.clone();
                let Some(vm) = settings.vm.as_mut() else {
                    return Err(UpError::Setup(
                        "publish.proxmox has no vm section: `up` needs VMs to bootstrap (`imgbuild publish` only uploads)".into(),
                    ));
                };
                vm.start = true;
                let credentials = Credentials::from_env(&settings, env)?;
                Ok(Target::Proxmox(Box::new(ProxmoxTarget {
                    settings,
                    credentials,
                    options: options.proxmox,
                })))
            }
        }
    }

    /// The name reports carry.
    pub fn name(&self) -> &'static str {
        match self {
            Target::None => "none",
            Target::Proxmox(_) => "proxmox",
            Target::Hcloud(_) => "hcloud",
        }
    }
}

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
    let reach = Reach::of(inv, &opts.bootstrap);
    let mut report = Report::new(inv, target.name(), false, &reach);
    // A bad patch or an unreachable node stops the run before any machine
    // exists, not after the VMs were created and started.
    if let Err(e) = stage::check(inv, &opts.bootstrap) {
        report.stop(Stage::Bootstrap, UpError::Bootstrap(e));
        report.elapsed_ms = started.elapsed().as_millis();
        return report;
    }
    let published = match target {
        Target::Hcloud(hc) => hcloud_stage(inv, hc, opts, obs, &mut report),
        _ => publish_stage(inv, target, opts, obs, &mut report).map(|()| BTreeMap::new()),
    };
    let mut bootstrap = opts.bootstrap.clone();
    let done = match published {
        Err((stage, e)) => {
            report.stop(stage, e);
            None
        }
        Ok(targets) => {
            // Apply, bootstrap once, health: each node's readiness as the
            // last health round saw it.
            bootstrap.targets.extend(targets);
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

/// Build and publish (nothing for [`Target::None`]); stops when any node
/// failed, since a cluster missing a node cannot become healthy.
fn publish_stage(
    inv: &Inventory,
    target: &Target,
    opts: &UpOptions,
    obs: Observers<'_>,
    report: &mut Report,
) -> Result<(), (Stage, UpError)> {
    let Target::Proxmox(pve) = target else {
        return Ok(());
    };
    let ProxmoxTarget {
        settings,
        credentials,
        options,
    } = pve.as_ref();
    let (built, mut failed_nodes) = build_stage(inv, opts, obs, report)?;
    let build_failed = !failed_nodes.is_empty();
    let images: Vec<PublishImage> = built.iter().map(PublishImage::from).collect();
    let results = proxmox::publish(inv, settings, credentials, &images, options, obs.publish)
        .map_err(|e| (Stage::Publish, e.into()))?;
    for (img, r) in images.iter().zip(results) {
        match r {
            Ok(p) => {
                let Some(n) = report.node(&p.node) else {
                    continue;
                };
                n.volume = Some(p.volid);
                n.vmid = p.vmid;
                n.stages.upload = Some(changed(p.uploaded, Change::Uploaded));
                n.stages.vm = p.vm.map(Change::from);
                n.stages.start = Some(changed(p.started, Change::Started));
            }
            Err(e) => {
                let message = match e {
                    ProxmoxError::Node { message, .. } => message,
                    e => e.to_string(),
                };
                report.fail(&img.node, |s| s.upload = Some(Change::Failed), message);
                failed_nodes.push(img.node.clone());
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

/// Snapshots of the built images, then one server per node from them with
/// its machine config as `user_data`; where the bootstrap reaches each
/// node (the public IP the API reports).
fn hcloud_stage(
    inv: &Inventory,
    hc: &HcloudTarget,
    opts: &UpOptions,
    obs: Observers<'_>,
    report: &mut Report,
) -> Result<BTreeMap<String, NodeEndpoint>, (Stage, UpError)> {
    let publish = |e: HcloudError| (Stage::Publish, UpError::Hcloud(e));
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
    let api = hc.api()?;
    let mut snapshot_of: BTreeMap<String, u64> = BTreeMap::new();
    let mut failed = Vec::new();
    for image in SnapshotImage::distinct(built.iter().map(|o| (&o.image, o.file.clone()))) {
        let run = hcloud::publish_snapshot(
            &api,
            &hc.settings,
            &image,
            &hc.options,
            &hc.cancel,
            obs.hcloud,
        );
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
        n.stages.vm = Some(vm);
        n.stages.start = Some(start);
    }
    if let Some(ip) = s.public_ip {
        n.address = Some(ip);
        targets.extend(NodeEndpoint::new(Some(ip), None).map(|t| (s.node.clone(), t)));
    }
}

/// The dry run of [`hcloud_stage`]: which snapshots exist for the images
/// already built, which servers exist; GETs only.
fn plan_hcloud(
    inv: &Inventory,
    hc: &HcloudTarget,
    opts: &UpOptions,
    report: &mut Report,
) -> Result<BTreeMap<String, NodeEndpoint>, (Stage, UpError)> {
    let publish = |e: HcloudError| (Stage::Publish, UpError::Hcloud(e));
    let current = build::current_images(inv, &opts.nodes, &opts.build)
        .map_err(|e| (Stage::Build, e.into()))?;
    let mut built = Vec::new();
    for (node, image) in &current {
        if let Some(n) = report.node(node) {
            n.stages.build = Some(if image.is_some() {
                Change::Unchanged
            } else {
                Change::Built
            });
            n.stages.upload = Some(Change::Uploaded);
            n.stages.vm = Some(Change::Created);
            n.stages.start = Some(Change::Started);
            if let Some(img) = image {
                n.show_image(img, img.file(&opts.build.out_dir));
                built.push((img, img.file(&opts.build.out_dir)));
            }
        }
    }
    let api = hc.api()?;
    for image in SnapshotImage::distinct(built) {
        let found = hcloud::find_snapshot(&api, &hc.settings, &image).map_err(publish)?;
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
    Ok(targets)
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
    let failed_nodes = report.built(&built, &failed);
    Ok((built, failed_nodes))
}

/// The dry run: what `up` would build, upload, create, start, apply and
/// bootstrap. Reads the manifest, sends GETs to the target and probes each
/// node's TLS; builds nothing, writes nothing, changes nothing anywhere.
pub fn plan(inv: &Inventory, target: &Target, opts: &UpOptions) -> Report {
    let started = Instant::now();
    let reach = Reach::of(inv, &opts.bootstrap);
    let mut report = Report::new(inv, target.name(), true, &reach);
    if let Err(e) = stage::check(inv, &opts.bootstrap) {
        report.stop(Stage::Bootstrap, UpError::Bootstrap(e));
        report.elapsed_ms = started.elapsed().as_millis();
        return report;
    }
    let planned = match target {
        Target::Hcloud(hc) => plan_hcloud(inv, hc, opts, &mut report),
        _ => plan_publish(inv, target, opts, &mut report).map(|()| BTreeMap::new()),
    };
    let mut bootstrap = opts.bootstrap.clone();
    match planned {
        Ok(targets) => bootstrap.targets.extend(targets),
        Err((stage, e)) => report.stop(stage, e),
    }
    // Without a runtime to probe on, the nodes' Talos state stays unknown.
    if let Ok(survey) = stage::survey(inv, &bootstrap) {
        report.surveyed(&survey);
    }
    report.elapsed_ms = started.elapsed().as_millis();
    report
}

fn plan_publish(
    inv: &Inventory,
    target: &Target,
    opts: &UpOptions,
    report: &mut Report,
) -> Result<(), (Stage, UpError)> {
    let Target::Proxmox(pve) = target else {
        return Ok(());
    };
    let ProxmoxTarget {
        settings,
        credentials,
        options,
    } = pve.as_ref();
    let current = build::current_images(inv, &opts.nodes, &opts.build)
        .map_err(|e| (Stage::Build, e.into()))?;
    let mut images = Vec::new();
    for (node, image) in current {
        if let Some(n) = report.node(&node) {
            n.stages.build = Some(match &image {
                Some(_) => Change::Unchanged,
                None => Change::Built,
            });
            if let Some(img) = &image {
                n.show_image(img, img.file(&opts.build.out_dir));
            }
        }
        let image = image.map(|img| PublishImage {
            node: img.node.clone(),
            path: img.file(&opts.build.out_dir),
            sha256: img.sha256,
            size: img.size,
            format: img.format,
        });
        images.push((node, image));
    }
    let planned = proxmox::plan(inv, settings, credentials, &images, options)
        .map_err(|e| (Stage::Publish, e.into()))?;
    let mut failed = Vec::new();
    for ((node, _), r) in images.iter().zip(planned) {
        match r {
            Ok(p) => {
                let Some(n) = report.node(node) else { continue };
                n.volume = p.volid;
                n.vmid = p.vmid;
                // An image not built yet is uploaded unless the storage
                // happens to hold its exact bytes already.
                n.stages.upload = Some(if p.upload == Some(false) {
                    Change::Unchanged
                } else {
                    Change::Uploaded
                });
                n.stages.vm = p.vm.map(Change::from);
                n.stages.start = Some(changed(p.start, Change::Started));
            }
            Err(e) => {
                let message = match e {
                    ProxmoxError::Node { message, .. } => message,
                    e => e.to_string(),
                };
                report.fail(node, |s| s.upload = Some(Change::Failed), message);
                failed.push(node.clone());
            }
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err((
            Stage::Publish,
            UpError::Nodes {
                stage: Stage::Publish,
                failed,
            },
        ))
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

    const ENV: [(&str, &str); 2] = [
        ("PROXMOX_VE_ENDPOINT", "https://127.0.0.1:8006/"),
        ("PROXMOX_VE_API_TOKEN", "root@pam!up=secret"),
    ];

    fn target(publish: &str, env: &[(&str, &str)]) -> Result<Target, UpError> {
        let lookup = |k: &str| {
            env.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        };
        let options = TargetOptions {
            proxmox: PublishOptions::default(),
            hcloud: SnapshotOptions::default(),
            cancel: Cancel::never(),
        };
        Target::from_inventory(&inv(publish), &lookup, options)
    }

    #[test]
    fn no_publish_section_means_bootstrap_only() {
        assert!(matches!(target("", &[]).unwrap(), Target::None));
    }

    #[test]
    fn proxmox_vms_are_started_whatever_the_inventory_says() {
        let t = target(
            "publish:\n  proxmox:\n    node: pve\n    storage: local\n    vm: {storage: local-lvm, firstId: 300, start: false}",
            &ENV,
        )
        .unwrap();
        let Target::Proxmox(pve) = t else {
            panic!("not proxmox: {t:?}")
        };
        assert!(pve.settings.vm.unwrap().start);
    }

    #[test]
    fn targets_up_cannot_use_are_setup_errors() {
        let no_vm = target(
            "publish:\n  proxmox:\n    node: pve\n    storage: local",
            &ENV,
        )
        .unwrap_err();
        assert!(no_vm.is_setup());
        assert!(no_vm.to_string().contains("no vm section"), "{no_vm}");
        let no_env = target(
            "publish:\n  proxmox:\n    node: pve\n    storage: local\n    vm: {storage: local-lvm, firstId: 300}",
            &[],
        )
        .unwrap_err();
        assert!(no_env.is_setup());
        assert!(
            no_env.to_string().contains("PROXMOX_VE_ENDPOINT"),
            "{no_env}"
        );
        let hcloud = target(
            "image: {platform: hcloud}\npublish:\n  hcloud: {location: fsn1}",
            &ENV,
        )
        .unwrap_err();
        assert!(hcloud.is_setup());
        assert!(
            hcloud.to_string().contains("no servers section"),
            "{hcloud}"
        );
        let servers = "image: {platform: hcloud}\npublish:\n  hcloud: {location: fsn1, servers: {type: cpx22}}";
        let no_token = target(servers, &ENV).unwrap_err();
        assert!(no_token.is_setup());
        assert!(no_token.to_string().contains("HCLOUD_TOKEN"), "{no_token}");
        let t = target(servers, &[("HCLOUD_TOKEN", "t0ken")]).unwrap();
        assert_eq!(t.name(), "hcloud");
        assert!(!format!("{t:?}").contains("t0ken"));
    }
}
