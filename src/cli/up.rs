//! `imgbuild up`: flags → [`UpOptions`], then one summary table (or JSON
//! document) for the whole run.

use super::board::Board;
use super::progress::Show;
use super::publish::PublishArgs;
use super::talos::BootstrapRunArgs;
use super::{Output, Partial, Reported, Usage, load_inventory};
use anyhow::Result;
use clap::Args;
use imgbuild::publish::Cancel;
use imgbuild::publish::target::{Target, TargetOptions};
use imgbuild::up::{self, Change, NodeReport, Observers, Report, UpOptions};
use std::path::Path;

#[derive(Args)]
pub struct UpArgs {
    /// Print what would be built, uploaded, created and applied; change nothing.
    #[arg(long)]
    dry_run: bool,
    #[command(flatten)]
    publish: PublishArgs,
    #[command(flatten)]
    bootstrap: BootstrapRunArgs,
}

pub fn run(args: UpArgs, config: &Path, output: Output) -> Result<()> {
    let inv = load_inventory(config, output).map_err(|e| Usage(format!("{e:#}")))?;
    for node in args.publish.nodes() {
        inv.node(node).map_err(|e| Usage(e.to_string()))?;
    }
    let options = TargetOptions {
        proxmox: args.publish.options(),
        hcloud: args.publish.hcloud_options(),
        cancel: Cancel::never(),
        machines: true,
    };
    let mut target = Target::from_inventory(&inv, &|k| std::env::var(k).ok(), options)
        .map_err(|e| Usage(format!("{}: {e}", config.display())))?;
    if let Target::Hcloud(hc) = &mut target
        && !args.dry_run
    {
        // Snapshot runs create servers: Ctrl-C must let them clean up.
        hc.cancel = super::signals::cancel_on_signals();
    }
    if let Target::Proxmox(pve) = &target
        && pve.credentials.insecure()
        && output == Output::Text
    {
        eprintln!("warning: PROXMOX_VE_INSECURE is set: the server's certificate is not checked");
    }
    let build = args.publish.build();
    let quiet = build.download.quiet;
    let opts = UpOptions {
        nodes: args.publish.nodes().to_vec(),
        build: build.options(),
        bootstrap: args.bootstrap.options(),
    };
    let report = if args.dry_run {
        up::plan(&inv, &target, &opts)
    } else {
        let download = super::build::progress_for(quiet, output);
        let nodes: Vec<String> = inv.nodes.iter().map(|n| n.name.clone()).collect();
        let board = Board::new(
            &nodes,
            Show::log_for(quiet, output),
            Show::for_output(quiet, output),
        );
        let report = up::up(
            &inv,
            &target,
            &opts,
            Observers {
                download: download.as_ref(),
                publish: &board,
                hcloud: &board,
                bootstrap: &board,
            },
        );
        board.finish();
        report
    };
    if let Some((_, e)) = &report.stopped
        && e.is_setup()
    {
        return Err(Usage(format!("{}: {e:#}", config.display())).into());
    }
    // A healthy cluster may still run other versions, schematics or configs
    // than the inventory asks for: the same rows as `imgbuild status`.
    let drift = if report.stopped.is_none() && report.healthy && !args.dry_run {
        // Hetzner servers answer at the public IPs the run reached them at,
        // not at their inventory (private network) addresses.
        let mut reach = opts.bootstrap.clone();
        if matches!(target, Target::Hcloud(_)) {
            reach.targets.extend(report.nodes.iter().filter_map(|n| {
                imgbuild::talos::client::Target::new(n.address, None).map(|t| (n.node.clone(), t))
            }));
        }
        match super::day2::drift(&inv, &reach) {
            Ok(d) => d,
            Err(e) => {
                if output == Output::Text {
                    eprintln!("warning: drift not checked: {e:#}");
                }
                Vec::new()
            }
        }
    } else {
        Vec::new()
    };
    match output {
        Output::Json => {
            let mut doc = serde_json::to_value(&report)?;
            if let Some((stage, e)) = &report.stopped {
                doc["failedStage"] = serde_json::json!(stage);
                doc["error"] = serde_json::json!(up::chain(e));
            }
            doc["drift"] = serde_json::json!(drift);
            outln!("{doc}");
        }
        Output::Text => {
            print_report(&report);
            super::day2::print_drift(&drift);
        }
    }
    match &report.stopped {
        None if report.partial() => Err(Partial(format!(
            "cluster {} is not healthy: {}",
            report.cluster,
            report
                .health
                .as_ref()
                .map(ToString::to_string)
                .unwrap_or_default()
        ))
        .into()),
        None if !drift.is_empty() => Err(Partial(super::day2::drift_summary(&drift)).into()),
        None => Ok(()),
        Some((_, e)) if report.partial() => Err(Partial(e.to_string()).into()),
        Some((_, e)) => Err(Reported(up::chain(e)).into()),
    }
}

/// The first 12 hex digits: enough to tell images apart in a table.
fn short(sha: &str) -> &str {
    &sha[..sha.len().min(12)]
}

fn cell(v: Option<String>) -> String {
    v.unwrap_or_else(|| "-".into())
}

fn print_report(r: &Report) {
    if r.dry_run {
        outln!(
            "dry run: cluster {} (target {}); nothing was changed",
            r.cluster,
            r.target
        );
    }
    let rows: Vec<[String; 7]> = r.nodes.iter().map(row).collect();
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
        outln!("{}", text.join("  ").trim_end());
    };
    line(&head.map(String::from));
    for row in &rows {
        line(row);
    }
    outln!("{}", stage_summary(r));
    // A stop for some nodes sums them up in one line: their errors first.
    if let Some((_, up::UpError::Nodes { .. })) = &r.stopped {
        for n in &r.nodes {
            if let Some(e) = &n.error {
                eprintln!("error: node {}: {e}", n.node);
            }
        }
    }
    for f in &r.fallbacks {
        outln!("note: {f}");
    }
    if r.healthy {
        outln!(
            "cluster {} is healthy ({:.1}s)",
            r.cluster,
            r.elapsed_ms as f64 / 1000.0
        );
    }
    if r.health.is_some() {
        // Beneath "is healthy" when it was said, else on their own.
        let indent = if r.healthy { "  " } else { "" };
        if let Some(k) = &r.kubeconfig {
            outln!("{indent}kubeconfig: {}", k.display());
        }
        if let Some(t) = &r.talosconfig {
            outln!("{indent}talosconfig: {}", t.display());
        }
    }
}

fn row(n: &NodeReport) -> [String; 7] {
    let talos = n.talos.map(|t| {
        let word = serde_json::to_value(t)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        match &n.talos_version {
            Some(v) => format!("{word} {v}"),
            None => word,
        }
    });
    [
        n.node.clone(),
        cell(n.sha256.as_deref().map(|s| short(s).to_owned())),
        cell(n.volume.clone()),
        cell(
            n.vmid
                .map(|v| v.to_string())
                .or(n.server.map(|s| s.to_string())),
        ),
        cell(n.address.map(|a| a.to_string())),
        cell(talos),
        cell(
            n.kubernetes_ready
                .map(|r| if r { "Ready" } else { "NotReady" }.to_owned()),
        ),
    ]
}

/// The word for a change; a dry run says what would happen.
fn word(c: Change, dry_run: bool) -> &'static str {
    if !dry_run {
        return c.as_str();
    }
    match c {
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

/// One line: each stage with how many nodes it left in each state, e.g.
/// `build: 5 unchanged; upload: 5 unchanged; …; etcd: unchanged (cp-01)`.
fn stage_summary(r: &Report) -> String {
    let mut parts = Vec::new();
    for (i, (name, _)) in up::Stages::default().named().iter().enumerate() {
        let mut counts: Vec<(Change, usize)> = Vec::new();
        for c in r.nodes.iter().filter_map(|n| n.stages.named()[i].1) {
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
            .map(|(c, n)| format!("{n} {}", word(*c, r.dry_run)))
            .collect();
        parts.push(format!("{name}: {}", text.join(", ")));
    }
    let etcd = match (r.bootstrap, &r.bootstrap_node) {
        (Some(c), Some(node)) => Some(format!("etcd: {} ({node})", word(c, r.dry_run))),
        (None, Some(node)) if r.dry_run => Some(format!(
            "etcd: bootstrapped on {node} unless it already runs"
        )),
        _ => None,
    };
    parts.extend(etcd);
    parts.join("; ")
}
