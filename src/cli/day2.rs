//! Day two: `imgbuild upgrade` moves running nodes to the inventory's Talos
//! version and schematics, `apply` pushes config changes, `status` shows
//! drift.

use super::inventory::load_inventory;
use super::output::{Output, Partial, Reported, outside};
use super::talos::BootstrapRunArgs;
use anyhow::{Context, Result};
use clap::Args;
use imgbuild::factory::Factory;
use imgbuild::talos::client::ApplyMode;
use imgbuild::talos::stage;
use imgbuild::talos::upgrade::{self, Wanted};
use imgbuild::talos::{apply, status};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::Path;

#[derive(Args)]
pub struct UpgradeArgs {
    /// Nodes to upgrade [default: all], still control planes first.
    nodes: Vec<String>,
    /// List every node with its version and schematic from → to; send nothing.
    #[arg(long)]
    dry_run: bool,
    /// Workers upgraded at once (control planes always one at a time).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    parallel: u16,
    #[command(flatten)]
    run: BootstrapRunArgs,
    #[command(flatten)]
    download: super::build::DownloadArgs,
}

/// Each node's target: the inventory's version and the installer of its
/// base schematic (without META), registered at the factory, which must
/// offer the version and every extension. Contacts no node.
fn targets(
    inv: &imgbuild::inventory::Inventory,
    fetch: &imgbuild::fetch::FetchOptions,
) -> Result<BTreeMap<String, Wanted>> {
    let client = imgbuild::fetch::client(fetch);
    let factory = Factory::new(&inv.image.factory, &client).with_retry(fetch.retry_policy());
    let mut extensions: Vec<String> = inv.image.extensions.clone();
    for n in &inv.nodes {
        extensions.extend(n.extensions.iter().cloned());
    }
    extensions.sort();
    extensions.dedup();
    factory
        .check_available(&inv.cluster.talos_version, &extensions)
        .context("the factory cannot provide the upgrade")?;
    for node in &inv.nodes {
        // The factory serves installers only for schematics posted to it;
        // `register` also checks that its ID is ours.
        factory
            .register(&imgbuild::schematic::node::base_for_node(inv, node))
            .with_context(|| format!("node {}: registering its schematic", node.name))?;
    }
    Ok(upgrade::wanted(inv)?)
}

pub fn upgrade(args: UpgradeArgs, config: &Path, output: Output) -> Result<()> {
    let inv = load_inventory(config, output)?;
    for name in &args.nodes {
        inv.node(name)?;
    }
    let wanted = targets(&inv, &args.download.options())?;
    let mut opts = args.run.options();
    if args.dry_run {
        // A dry run sends no config: unset `${NAME}`s need not be given.
        opts.patch_vars = opts.patch_vars.comparing_unset();
    }
    let _lock = (!args.dry_run)
        .then(|| stage::lock_state_dir(&inv, &opts, "upgrade"))
        .transpose()?;
    let limits = opts.limits.clone();
    let prepared = stage::prepare(&inv, &opts)?;
    let plan = &prepared.plan;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    if args.dry_run {
        let order = upgrade::ordered(plan, &args.nodes);
        let record = upgrade::Record::load(&record_path(&prepared.state_dir));
        let mut rows = Vec::new();
        for node in order {
            let now = runtime.block_on(upgrade::running(plan, node, &record, &limits));
            let to = &wanted[&node.name];
            rows.push(json!({
                "node": node.name,
                "from": {"version": now.version, "schematic": now.schematic},
                "to": {"version": to.version, "schematic": to.schematic, "installer": to.installer},
                "upgrade": !now.is(to),
                "error": now.error,
            }));
        }
        match output {
            Output::Json => outln!("{}", json!({"dryRun": true, "nodes": rows})),
            Output::Text => {
                for r in &rows {
                    let show = |v: &serde_json::Value| outside(v.as_str().unwrap_or("?"));
                    outln!(
                        "{}: {} → {}, schematic {} → {}{}",
                        show(&r["node"]),
                        show(&r["from"]["version"]),
                        show(&r["to"]["version"]),
                        show(&r["from"]["schematic"]),
                        show(&r["to"]["schematic"]),
                        if r["upgrade"] == true { "" } else { " (done)" }
                    );
                    if let Some(e) = r["error"].as_str() {
                        outln!("    not read from the node: {}", outside(e));
                    }
                }
            }
        }
        // A node that could not say what it runs is not known to be fine.
        let unread: Vec<&str> = rows
            .iter()
            .filter(|r| !r["error"].is_null())
            .filter_map(|r| r["node"].as_str())
            .collect();
        if unread.is_empty() {
            return Ok(());
        }
        let message = format!("could not read what {} run(s)", unread.join(", "));
        return Err(if unread.len() < rows.len() {
            Partial(message).into()
        } else {
            Reported(message).into()
        });
    }
    let progress = |node: &str, what: &str| {
        if output == Output::Text {
            errln!("{node}: {}", outside(what));
        }
    };
    let outcome = runtime.block_on(upgrade::run(
        plan,
        &wanted,
        &args.nodes,
        usize::from(args.parallel),
        &record_path(&prepared.state_dir),
        &limits,
        &progress,
    ));
    if let Some(e) = &outcome.record_error
        && output == Output::Text
    {
        errln!("warning: the upgrade record was not written: {e}");
    }
    let failed = outcome
        .failed
        .as_ref()
        .map(|(node, why)| json!({"node": node, "error": why}));
    match output {
        Output::Json => outln!(
            "{}",
            json!({
                "upgraded": outcome.upgraded,
                "unchanged": outcome.unchanged,
                "untouched": outcome.untouched,
                "failed": failed,
                "versions": outcome.versions,
            })
        ),
        Output::Text => {
            for (node, v) in &outcome.versions {
                outln!("{node}: {}", outside(v.as_deref().unwrap_or("unreachable")));
            }
        }
    }
    match outcome.failed {
        None => Ok(()),
        Some((node, why)) if outcome.upgraded.is_empty() => {
            Err(Reported(format!("node {node}: {why}")).into())
        }
        Some((node, why)) => Err(Partial(format!(
            "node {node}: {why}; upgraded: {}; not touched: {}",
            outcome.upgraded.join(", "),
            if outcome.untouched.is_empty() {
                "none".to_owned()
            } else {
                outcome.untouched.join(", ")
            }
        ))
        .into()),
    }
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum ModeArg {
    /// Talos decides; a configured node applies without a reboot.
    Auto,
    NoReboot,
    /// Kept for the next reboot.
    Staged,
}

#[derive(Args)]
pub struct ApplyArgs {
    /// Nodes to compare and apply [default: all].
    nodes: Vec<String>,
    /// Show each node's config diff; apply nothing.
    #[arg(long)]
    dry_run: bool,
    #[arg(long, value_enum, default_value = "auto")]
    mode: ModeArg,
    #[command(flatten)]
    run: BootstrapRunArgs,
}

#[derive(Args)]
pub struct StatusArgs {
    /// Exit 1 when anything differs from the inventory (CI drift gate).
    #[arg(long)]
    check: bool,
    #[command(flatten)]
    run: BootstrapRunArgs,
}

/// Where `upgrade` keeps what it installed on each node.
fn record_path(state_dir: &stage::StateDir) -> std::path::PathBuf {
    state_dir.upgrades_path()
}

/// The async runtime the day-two commands run their node calls on.
fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

pub fn apply(args: ApplyArgs, config: &Path, output: Output) -> Result<()> {
    let inv = load_inventory(config, output)?;
    for name in &args.nodes {
        inv.node(name)?;
    }
    let opts = args.run.options();
    let _lock = (!args.dry_run)
        .then(|| stage::lock_state_dir(&inv, &opts, "apply"))
        .transpose()?;
    let prepared = stage::prepare(&inv, &opts)?;
    let mode = match args.mode {
        ModeArg::Auto => ApplyMode::Auto,
        ModeArg::NoReboot => ApplyMode::NoReboot,
        ModeArg::Staged => ApplyMode::Staged,
    };
    let mut outcome = runtime()?.block_on(apply::run(
        &prepared.plan,
        &args.nodes,
        mode,
        args.dry_run,
        &opts.limits,
    ));
    if !args.dry_run && outcome.nodes.iter().any(|n| n.applied) {
        // What is on the nodes now, for read-only commands run without it.
        let dir = &prepared.state_dir.path;
        imgbuild::talos::config::Fingerprints::record(dir, &inv, &opts.patch_vars)
            .with_context(|| format!("recording fingerprints in {}", dir.display()))?;
    }
    for n in &mut outcome.nodes {
        n.diff = super::output::diff(&n.diff);
    }
    match output {
        Output::Json => outln!("{}", json!(outcome)),
        Output::Text => {
            for n in &outcome.nodes {
                let state = match (n.changed, n.applied) {
                    (false, _) => "no change",
                    (true, true) => "applied",
                    (true, false) => "would change",
                };
                outln!("{}: {state}", n.node);
                for line in n.diff.lines() {
                    outln!("    {line}");
                }
            }
            for f in &outcome.failed {
                outln!("{}: FAILED: {}", f.node, outside(&f.error));
            }
        }
    }
    if outcome.failed.is_empty() {
        return Ok(());
    }
    let names: Vec<&str> = outcome.failed.iter().map(|f| f.node.as_str()).collect();
    let verb = if args.dry_run { "dry run" } else { "apply" };
    let message = format!("{verb} failed on {}", names.join(", "));
    // Partial when other nodes were handled: applied, or diffed in a dry run.
    if outcome.nodes.iter().any(|n| n.applied || args.dry_run) {
        Err(Partial(message).into())
    } else {
        Err(Reported(message).into())
    }
}

/// Every node's status row, read from the nodes (nothing is changed).
pub(super) fn rows(
    inv: &imgbuild::inventory::Inventory,
    opts: &stage::BootstrapOptions,
) -> Result<Vec<status::NodeStatus>> {
    let wanted = upgrade::wanted(inv)?;
    let prepared = stage::prepare(inv, opts)?;
    let record = upgrade::Record::load(&record_path(&prepared.state_dir));
    let fingerprints = imgbuild::talos::config::Fingerprints::load(&prepared.state_dir.path);
    Ok(runtime()?.block_on(status::collect(
        &prepared.plan,
        &wanted,
        &record,
        &fingerprints,
        &opts.limits,
    )))
}

pub fn status(args: StatusArgs, config: &Path, output: Output) -> Result<()> {
    let inv = load_inventory(config, output)?;
    let mut opts = args.run.options();
    // Status changes nothing: an unset `${NAME}` is compared by fingerprint.
    opts.patch_vars = opts.patch_vars.comparing_unset();
    let rows = rows(&inv, &opts)?;
    let drift: Vec<status::Drift> = rows.iter().flat_map(status::NodeStatus::drift).collect();
    match output {
        Output::Json => outln!("{}", json!({"nodes": rows, "drift": drift})),
        Output::Text => {
            let short = |s: &Option<String>| {
                s.as_deref().map_or("-".to_owned(), |s| {
                    outside(&s.chars().take(12).collect::<String>())
                })
            };
            let yes = |b: Option<bool>| match b {
                Some(true) => "yes",
                Some(false) => "NO",
                None => "-",
            };
            outln!(
                "{:<12} {:<9} {:<20} {:<27} {:<7} {:<5} {}",
                "NODE",
                "REACHABLE",
                "VERSION (WANTED)",
                "SCHEMATIC (WANTED)",
                "CONFIG",
                "ETCD",
                "READY"
            );
            for r in &rows {
                outln!(
                    "{:<12} {:<9} {:<20} {:<27} {:<7} {:<5} {}",
                    r.node,
                    if r.reachable { "yes" } else { "NO" },
                    format!("{} ({})", short(&r.version), r.wanted_version),
                    format!(
                        "{} ({})",
                        short(&r.schematic),
                        short(&Some(r.wanted_schematic.clone()))
                    ),
                    yes(r.config_in_sync),
                    yes(r.etcd_member),
                    yes(r.ready)
                );
            }
            print_drift(&drift);
            print_fingerprinted(&rows);
        }
    }
    if args.check && !drift.is_empty() {
        return Err(Reported(format!("{} difference(s) from the inventory", drift.len())).into());
    }
    Ok(())
}

/// Which unset `${NAME}`s could only be compared by fingerprint, and where.
fn print_fingerprinted(rows: &[status::NodeStatus]) {
    let mut names: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for r in rows {
        for n in &r.compared_by_fingerprint {
            names.entry(n).or_default().push(&r.node);
        }
    }
    for (name, nodes) in names {
        outln!(
            "note: {name} is not set: compared by the fingerprint recorded when it was last applied ({})",
            nodes.join(", ")
        );
    }
}

pub(super) fn print_drift(drift: &[status::Drift]) {
    for d in drift {
        outln!(
            "drift: {}: {} differs from the inventory (fix: {})",
            d.node,
            d.what,
            d.fix
        );
    }
}

/// One line: how many differences, and the commands that fix them.
pub(super) fn drift_summary(drift: &[status::Drift]) -> String {
    let mut fixes: Vec<&str> = drift.iter().map(|d| d.fix).collect();
    fixes.sort_unstable();
    fixes.dedup();
    format!(
        "the cluster differs from the inventory in {} place(s); run {}",
        drift.len(),
        fixes.join(" and ")
    )
}
