//! Day two: `imgbuild upgrade` moves running nodes to the inventory's Talos
//! version and schematics.

use super::talos::BootstrapRunArgs;
use super::{Output, Partial, load_inventory};
use anyhow::{Context, Result};
use clap::Args;
use imgbuild::factory::{Factory, installer_of};
use imgbuild::talos::stage;
use imgbuild::talos::upgrade::{self, Wanted};
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
    let version = format!("v{}", inv.cluster.talos_version.trim_start_matches('v'));
    let mut extensions: Vec<String> = inv.image.extensions.clone();
    for n in &inv.nodes {
        extensions.extend(n.extensions.iter().cloned());
    }
    extensions.sort();
    extensions.dedup();
    factory
        .check_available(&inv.cluster.talos_version, &extensions)
        .context("the factory cannot provide the upgrade")?;
    let mut out = BTreeMap::new();
    for node in &inv.nodes {
        let schematic = imgbuild::schematic::base_for_node(inv, node);
        let id = factory
            .register(&schematic)
            .with_context(|| format!("node {}: registering its schematic", node.name))?;
        out.insert(
            node.name.clone(),
            Wanted {
                version: version.clone(),
                installer: installer_of(inv, &id),
                schematic: id.to_string(),
            },
        );
    }
    Ok(out)
}

pub fn upgrade(args: UpgradeArgs, config: &Path, output: Output) -> Result<()> {
    let inv = load_inventory(config, output)?;
    for name in &args.nodes {
        inv.node(name)?;
    }
    let wanted = targets(&inv, &args.download.options())?;
    let opts = args.run.options();
    let limits = opts.limits.clone();
    let prepared = stage::prepare(&inv, &opts)?;
    let plan = &prepared.plan;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    if args.dry_run {
        let order = upgrade::ordered(plan, &args.nodes);
        let mut rows = Vec::new();
        for node in order {
            let now = runtime.block_on(upgrade::running(plan, node, &limits));
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
                    let show = |v: &serde_json::Value| v.as_str().unwrap_or("?").to_owned();
                    outln!(
                        "{}: {} → {}, schematic {} → {}{}",
                        show(&r["node"]),
                        show(&r["from"]["version"]),
                        show(&r["to"]["version"]),
                        show(&r["from"]["schematic"]),
                        show(&r["to"]["schematic"]),
                        if r["upgrade"] == true { "" } else { " (done)" }
                    );
                }
            }
        }
        return Ok(());
    }
    let progress = |node: &str, what: &str| {
        if output == Output::Text {
            eprintln!("{node}: {what}");
        }
    };
    let outcome = runtime.block_on(upgrade::run(
        plan,
        &wanted,
        &args.nodes,
        usize::from(args.parallel),
        &limits,
        &progress,
    ));
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
                outln!("{node}: {}", v.as_deref().unwrap_or("unreachable"));
            }
        }
    }
    match outcome.failed {
        None => Ok(()),
        Some((node, why)) if outcome.upgraded.is_empty() => {
            Err(super::Reported(format!("node {node}: {why}")).into())
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
