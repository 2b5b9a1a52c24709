//! `imgbuild publish`: build what is missing, then put each node's image
//! where the inventory's `publish` section says.

use super::build::{BuildArgs, build_nodes};
use super::hcloud::{self as hc, HcloudArgs};
use super::inventory::load_inventory;
use super::output::{Output, Partial, Reported, Usage, failed_json, print_failures};
use super::progress::{PublishView, Screen, Show};
use anyhow::{Context, Result, bail};
use clap::Args;
use imgbuild::publish::hcloud::SnapshotOptions;
use imgbuild::publish::proxmox::{self, NodePublished, PublishOptions, VmChange};
use imgbuild::publish::target::{Target, TargetOptions};
use imgbuild::publish::{Cancel, PublishImage};
use serde_json::json;
use std::path::Path;
use std::time::Duration;

#[derive(Args)]
pub struct PublishArgs {
    /// Nodes to publish (all when none are given).
    nodes: Vec<String>,
    /// Give each existing VM a new boot disk from this image (stop, import
    /// it as scsi0, boot it, delete the old disk): the node is installed
    /// afresh and loses its state. Without it an existing VM's disk is its
    /// image of record and nothing is uploaded for it; a running node moves
    /// to a new version or schematic with `imgbuild upgrade`.
    #[arg(long)]
    replace_disk: bool,
    /// How often server-side tasks are polled, in milliseconds.
    #[arg(long, default_value_t = 500)]
    poll_ms: u64,
    #[command(flatten)]
    hcloud: HcloudArgs,
    #[command(flatten)]
    build: BuildArgs,
}

/// `imgbuild publish`: the flags `up` shares, and its own dry run.
#[derive(Args)]
pub struct PublishCommand {
    #[command(flatten)]
    args: PublishArgs,
    /// Show what would be uploaded, created and changed (VM settings from →
    /// to) without building or changing anything.
    #[arg(long)]
    dry_run: bool,
}

impl PublishArgs {
    /// The nodes named on the command line (all when empty).
    pub(super) fn nodes(&self) -> &[String] {
        &self.nodes
    }

    pub(super) fn build(&self) -> &BuildArgs {
        &self.build
    }

    pub(super) fn options(&self) -> PublishOptions {
        PublishOptions {
            replace_disk: self.replace_disk,
            poll: self.poll(),
            ..PublishOptions::default()
        }
    }

    pub(super) fn hcloud_options(&self) -> SnapshotOptions {
        self.hcloud.options(self.poll())
    }

    fn poll(&self) -> Duration {
        Duration::from_millis(self.poll_ms.max(10))
    }
}

pub fn run(cmd: PublishCommand, config: &Path, output: Output) -> Result<()> {
    let PublishCommand {
        args,
        dry_run: plan_only,
    } = cmd;
    let inv = load_inventory(config, output)?;
    let options = TargetOptions {
        proxmox: args.options(),
        hcloud: args.hcloud_options(),
        cancel: Cancel::never(),
        machines: false,
    };
    // Credentials first: a missing token must not wait for a build. Like
    // `up`, a missing or malformed setting is a usage error (exit 2).
    let target = Target::from_inventory(&inv, &|k| std::env::var(k).ok(), options)
        .map_err(|e| Usage(format!("{}: {e}", config.display())))?;
    let pve = match target {
        Target::None => bail!(
            "{}: no publish target: add a publish.proxmox or publish.hcloud section",
            config.display()
        ),
        Target::Hcloud(mut target) => {
            let (built, build_failures, _) = build_nodes(&inv, &args.nodes, &args.build, output)?;
            // Snapshot runs create servers: Ctrl-C must let them clean up.
            target.cancel = super::signals::cancel_on_signals();
            return hc::publish(
                &target,
                &built,
                build_failures,
                output,
                Show::for_output(args.build.download.quiet, output),
            );
        }
        Target::Proxmox(pve) => pve,
    };
    if plan_only {
        return dry_run(&inv, &pve, &args.nodes, output);
    }
    let mut warnings = Vec::new();
    if pve.credentials.insecure() {
        warnings
            .push("PROXMOX_VE_INSECURE is set: the server's certificate is not checked".to_owned());
    }
    if output == Output::Text {
        for w in &warnings {
            errln!("warning: {w}");
        }
    }
    let (built, build_failures, _) = build_nodes(&inv, &args.nodes, &args.build, output)?;
    let images = PublishImage::built(&inv, &built)?;
    if pve.settings.upload == imgbuild::inventory::UploadFormat::DownloadUrl
        && let Some(why) = images.iter().find_map(proxmox::download_problem)
    {
        return Err(Usage(format!("{}: {why}", config.display())).into());
    }
    let show = Show::for_output(args.build.download.quiet, output);
    let view = PublishView::new(Screen::new(show), show);
    let results = pve
        .publish(&inv, &images, &view)
        .context("publishing to Proxmox VE")?;
    view.clear();
    let mut published: Vec<NodePublished> = Vec::new();
    let mut failures = build_failures;
    for r in results {
        match r {
            Ok(p) => published.push(p),
            Err(proxmox::ProxmoxError::Node { node, message, .. }) => {
                failures.push((node, message));
            }
            Err(e) => failures.push((String::new(), e.to_string())),
        }
    }
    match output {
        Output::Json => {
            outln!(
                "{}",
                json!({"target": "proxmox", "nodes": published, "failed": failed_json(&failures), "warnings": warnings})
            );
        }
        Output::Text => {
            for p in &published {
                let vm = match (p.vmid, p.vm) {
                    (Some(id), Some(change)) => {
                        let change = match change {
                            VmChange::Created => "created",
                            VmChange::Updated => "updated",
                            VmChange::Unchanged => "unchanged",
                            VmChange::Changed => "changed",
                        };
                        let started = if p.started { ", started" } else { "" };
                        let moved = p
                            .inventory_vmid
                            .map(|i| format!(" (not {i}: pin vmid {id})"))
                            .unwrap_or_default();
                        format!("  VM {id}{moved} {change}{started}")
                    }
                    _ => String::new(),
                };
                let stored = match (p.uploaded, p.vm) {
                    (true, _) => "uploaded",
                    (false, Some(VmChange::Unchanged | VmChange::Changed)) => {
                        "not uploaded: the VM keeps its disk"
                    }
                    _ => "already stored",
                };
                outln!(
                    "{:<12} {}  sha256 {}  ({stored}){vm}",
                    p.node,
                    p.volid,
                    &p.sha256.hex()[..16]
                );
                for c in &p.settings {
                    outln!("{:<12}   {c}", "");
                }
            }
            print_failures(&failures);
        }
    }
    match (failures.len(), published.len()) {
        (0, _) => Ok(()),
        (n, 0) => Err(Reported(format!("{n} node(s) failed to publish")).into()),
        (n, ok) => Err(Partial(format!("{n} node(s) failed to publish, {ok} published")).into()),
    }
}

/// `publish --dry-run` on Proxmox: each selected node's decision, with an
/// existing VM's settings from → to. GETs only; nothing is built, so the
/// upload of a new VM's image shows as unknown.
fn dry_run(
    inv: &imgbuild::inventory::Inventory,
    pve: &imgbuild::publish::target::ProxmoxTarget,
    names: &[String],
    output: Output,
) -> Result<()> {
    let nodes: Vec<(usize, Option<PublishImage>)> = inv
        .nodes
        .iter()
        .enumerate()
        .filter(|(_, n)| names.is_empty() || names.contains(&n.name))
        .map(|(i, _)| (i, None))
        .collect();
    let decisions = pve.plan(inv, &nodes).context("planning the publish")?;
    let mut planned = Vec::new();
    let mut failures = Vec::new();
    for d in decisions {
        match d {
            Ok(d) => planned.push(d),
            Err(proxmox::ProxmoxError::Node { node, message, .. }) => {
                failures.push((node, message));
            }
            Err(e) => failures.push((String::new(), e.to_string())),
        }
    }
    match output {
        Output::Json => outln!(
            "{}",
            json!({"target": "proxmox", "dryRun": true, "nodes": planned, "failed": failed_json(&failures)})
        ),
        Output::Text => {
            for d in &planned {
                let upload = match d.upload {
                    Some(true) => "upload",
                    Some(false) => "no upload",
                    None => "upload once built",
                };
                let vm = match (d.vmid, d.vm) {
                    (Some(id), Some(change)) => {
                        let change = match change {
                            VmChange::Created => "to create",
                            VmChange::Updated => "to get a new disk",
                            VmChange::Changed => "to change",
                            VmChange::Unchanged => "unchanged",
                        };
                        format!("  VM {id} {change}")
                    }
                    _ => String::new(),
                };
                outln!("{:<12} {upload}{vm}", d.node);
                for c in &d.settings {
                    outln!("{:<12}   {c}", "");
                }
            }
            print_failures(&failures);
        }
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(Reported(format!("{} node(s) cannot be published", failures.len())).into())
    }
}
