//! `imgbuild down`: deletes what imgbuild made to run the cluster, found by
//! imgbuild's own markers, after a confirmation: the Hetzner servers (by
//! label), or the Proxmox VMs (by their description's record) with their
//! disks and the volumes imgbuild uploaded for the cluster.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use anyhow::Result;
use clap::Args;
use imgbuild::input::escape;
use imgbuild::inventory::{Inventory, ProxmoxSettings, PublishSettings};
use imgbuild::publish::hcloud::servers;
use imgbuild::publish::proxmox::Credentials;
use imgbuild::publish::proxmox::destroy::{
    DeleteOptions, UnprovenVm, cluster_machines, cluster_volumes, delete_vm, delete_volume,
};
use serde_json::json;

use super::flags::parse_duration;
use super::inventory::load_inventory;
use super::output::{Output, Reported, Usage};
use super::talos::StateArgs;

/// `--yes` (global) deletes without asking; it is required when stdin is
/// not a terminal.
#[derive(Args)]
pub struct DownArgs {
    /// How long a running Proxmox VM gets to shut down before it is
    /// stopped hard.
    #[arg(long, default_value = "2m", value_parser = parse_duration)]
    shutdown_timeout: Duration,
    /// How often Proxmox tasks are polled, in milliseconds.
    #[arg(long, default_value_t = 500)]
    poll_ms: u64,
    /// List what would be deleted, found exactly as the deletion finds it,
    /// and delete nothing (no confirmation needed).
    #[arg(long)]
    dry_run: bool,
    /// How long to wait while another run (`up`, `upgrade`) holds the
    /// cluster's state-dir lock.
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    lock_timeout: Duration,
    #[command(flatten)]
    state: StateArgs,
}

pub fn run(args: DownArgs, config: &Path, output: Output, yes: bool) -> Result<()> {
    let inv = load_inventory(config, output).map_err(|e| Usage(format!("{e:#}")))?;
    // Not while `up` is making machines: they would be missed or half-made.
    let _lock = match args.dry_run {
        true => None,
        false => args.state.lock_waiting(
            &inv,
            "down",
            args.lock_timeout,
            &imgbuild::publish::Cancel::never(),
        )?,
    };
    match inv.publish.target() {
        PublishSettings::Proxmox(settings) => proxmox(&args, &inv, settings, output, yes),
        PublishSettings::Hcloud(_) => hcloud(&inv, config, output, yes, args.dry_run),
        PublishSettings::None => Err(Usage(format!(
            "{}: no publish.proxmox or publish.hcloud section: `down` deletes the machines imgbuild made there",
            config.display()
        ))
        .into()),
    }
}

/// `down --dry-run`: what the deletion would take (the list `confirm`
/// shows), as text or `doc`; nothing is deleted.
fn dry_run(output: Output, cluster: &str, what: &[String], doc: serde_json::Value) -> Result<()> {
    match output {
        Output::Json => outln!("{doc}"),
        Output::Text if what.is_empty() => {
            outln!("cluster {cluster}: nothing imgbuild made would be deleted")
        }
        Output::Text => {
            outln!("would delete (dry run, nothing deleted):");
            for line in what {
                outln!("  {line}");
            }
        }
    }
    Ok(())
}

/// Goes on only with `--yes` or a "y" typed at the terminal; `what` is
/// listed on stderr first either way. Without a terminal and without
/// `--yes` it is a usage error (exit 2) that names `summary`.
pub(super) fn confirm(summary: &str, what: &[String], yes: bool) -> Result<()> {
    use std::io::{BufRead, IsTerminal};
    if yes || what.is_empty() {
        return Ok(());
    }
    errln!("These will be deleted:");
    for line in what {
        errln!("  {line}");
    }
    if !std::io::stdin().is_terminal() {
        return Err(Usage(format!(
            "would delete {summary}: pass --yes to confirm (stdin is not a terminal)"
        ))
        .into());
    }
    err!("Delete them? [y/N] ");
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer)?;
    if matches!(answer.trim(), "y" | "Y" | "yes") {
        Ok(())
    } else {
        Err(Reported("nothing deleted".into()).into())
    }
}

/// The Proxmox side: every VM whose record says imgbuild made it for this
/// cluster (on any Proxmox node), then every volume imgbuild uploaded for
/// it that no other VM references. A VM of a node's name without the
/// record is not the cluster's and stays.
fn proxmox(
    args: &DownArgs,
    inv: &Inventory,
    settings: &ProxmoxSettings,
    output: Output,
    yes: bool,
) -> Result<()> {
    let creds = Credentials::from_env(settings, &|k| std::env::var(k).ok())
        .map_err(|e| Usage(e.to_string()))?;
    let opts = DeleteOptions {
        shutdown_timeout: args.shutdown_timeout,
        poll: Duration::from_millis(args.poll_ms.max(10)),
        ..DeleteOptions::default()
    };
    let cluster = &inv.cluster.name;
    let found = cluster_machines(&creds, cluster, opts.retry)?;
    let (vms, unproven) = (found.ours, found.unproven);
    let mut nodes: BTreeSet<String> = inv.nodes.iter().map(|n| n.name.clone()).collect();
    nodes.extend(vms.iter().map(|vm| vm.node.clone()));
    let ours: BTreeSet<u32> = vms.iter().map(|vm| vm.vmid).collect();
    let (volumes, kept): (Vec<_>, Vec<_>) =
        cluster_volumes(&creds, &settings.storage, cluster, &nodes, opts.retry)?
            .into_iter()
            .partition(|v| v.used_by.iter().all(|id| ours.contains(id)));
    let mut what: Vec<String> = vms
        .iter()
        .map(|vm| {
            format!(
                "VM {} {} on {} (node {}; disks: {})",
                vm.vmid,
                escape(&vm.name),
                escape(&vm.pve_node),
                escape(&vm.node),
                escape(&vm.disks.join(", "))
            )
        })
        .collect();
    what.extend(
        volumes
            .iter()
            .map(|v| format!("volume {} on {}", v.volid, v.pve_node)),
    );
    if args.dry_run {
        let kept = kept
            .iter()
            .map(|v| json!({"volid": v.volid, "usedBy": v.used_by}))
            .collect::<Vec<_>>();
        let doc = json!({
            "cluster": cluster,
            "target": "proxmox",
            "dryRun": true,
            "wouldDelete": {
                "vms": vms.iter().map(|vm| json!({"vmid": vm.vmid, "node": vm.node, "pveNode": vm.pve_node, "disks": vm.disks})).collect::<Vec<_>>(),
                "volumes": volumes.iter().map(|v| v.volid.clone()).collect::<Vec<_>>(),
            },
            "kept": kept,
            "unowned": unproven,
        });
        if output == Output::Text {
            left_unproven(&unproven);
        }
        return dry_run(output, cluster, &what, doc);
    }
    confirm(
        &format!(
            "{} VM(s) and {} volume(s) of cluster {cluster}",
            vms.len(),
            volumes.len()
        ),
        &what,
        yes,
    )?;
    let mut deleted_vms = Vec::new();
    let mut left: Vec<(String, String)> = Vec::new();
    for vm in &vms {
        match delete_vm(&creds, cluster, vm, &opts) {
            Ok(d) => deleted_vms.push(d),
            Err(e) => left.push((format!("VM {}", vm.vmid), e.to_string())),
        }
    }
    let mut deleted_volumes = Vec::new();
    for v in &volumes {
        match delete_volume(&creds, v, &opts) {
            Ok(()) => deleted_volumes.push(v.volid.clone()),
            Err(e) => left.push((format!("volume {}", v.volid), e.to_string())),
        }
    }
    match output {
        Output::Json => outln!(
            "{}",
            json!({
                "cluster": cluster,
                "target": "proxmox",
                "deleted": {"vms": deleted_vms, "volumes": deleted_volumes},
                "kept": kept.iter().map(|v| json!({"volid": v.volid, "usedBy": v.used_by})).collect::<Vec<_>>(),
                "leftovers": left.iter().map(|(what, error)| json!({"what": what, "error": error})).collect::<Vec<_>>(),
                "unowned": unproven,
            })
        ),
        Output::Text => {
            left_unproven(&unproven);
            if vms.is_empty() && volumes.is_empty() {
                outln!("cluster {cluster} has no VMs or volumes imgbuild made on Proxmox");
            }
            for d in &deleted_vms {
                let how = if d.already_gone {
                    "was gone already"
                } else {
                    "deleted"
                };
                outln!("VM {} (node {}) {how}", d.vmid, d.node);
            }
            for v in &deleted_volumes {
                outln!("volume {v} deleted");
            }
            for v in &kept {
                let ids: Vec<String> = v.used_by.iter().map(u32::to_string).collect();
                errln!(
                    "volume {} kept: VM {} uses it, which is not this cluster's",
                    v.volid,
                    ids.join(", ")
                );
            }
            for (what, error) in &left {
                errln!("could not delete {what}: {}", escape(error));
            }
        }
    }
    if left.is_empty() {
        Ok(())
    } else {
        Err(Reported(format!("{} item(s) could not be deleted", left.len())).into())
    }
}

/// Names the VMs whose record names the cluster but proves no node of it:
/// left as they are, for the user to look at.
fn left_unproven(vms: &[UnprovenVm]) {
    for vm in vms {
        outln!("left (not provably this cluster's): {}", escape(&vm.what()));
    }
}

/// The Hetzner side: the cluster's servers (found by label). Snapshots
/// stay: the next `up` boots from them again (`imgbuild prune` deletes
/// unused ones).
fn hcloud(inv: &Inventory, config: &Path, output: Output, yes: bool, dry: bool) -> Result<()> {
    if inv
        .publish
        .hcloud()
        .and_then(|h| h.servers.as_ref())
        .is_none()
    {
        return Err(Usage(format!(
            "{}: no publish.hcloud.servers section: `down` deletes the Hetzner servers `up` made",
            config.display()
        ))
        .into());
    }
    let (api, opts) = super::hcloud::api()?;
    let cluster = &inv.cluster.name;
    let found = servers::existing(&api, cluster)?;
    let what: Vec<String> = found
        .iter()
        .map(|s| {
            format!(
                "{} (server {}, node {})",
                escape(&s.name),
                s.id,
                escape(&s.node)
            )
        })
        .collect();
    if dry {
        let doc = json!({
            "cluster": cluster,
            "target": "hcloud",
            "dryRun": true,
            "wouldDelete": {
                "servers": found.iter().map(|s| json!({"id": s.id, "name": s.name, "node": s.node})).collect::<Vec<_>>(),
            },
        });
        return dry_run(output, cluster, &what, doc);
    }
    confirm(
        &format!("{} server(s) of cluster {cluster}", found.len()),
        &what,
        yes,
    )?;
    let (deleted, left) = servers::delete_cluster(&api, cluster, &opts);
    match output {
        Output::Json => outln!(
            "{}",
            json!({"cluster": cluster, "deleted": deleted, "leftovers": left, "requests": api.requests()})
        ),
        Output::Text => {
            if deleted.is_empty() && left.is_empty() {
                outln!("cluster {cluster} has no servers");
            }
            for d in &deleted {
                outln!("deleted server {} ({})", d.id, escape(&d.name));
            }
            for l in &left {
                errln!("could not delete server {}: {}", l.id, escape(&l.error));
            }
        }
    }
    if left.is_empty() {
        Ok(())
    } else {
        Err(Reported(format!("{} server(s) could not be deleted", left.len())).into())
    }
}
