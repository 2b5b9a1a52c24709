//! `imgbuild prune`: the library's plan of what imgbuild made and nothing
//! uses (see `imgbuild::publish::prune`), printed with why and how large;
//! then, unless `--dry-run`, deleted.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Result;
use clap::Args;
use imgbuild::fetch::FetchOptions;
use imgbuild::input::escape;
use imgbuild::publish::Cancel;
use imgbuild::publish::hcloud::SnapshotOptions;
use imgbuild::publish::proxmox::PublishOptions;
use imgbuild::publish::proxmox::destroy::DeleteOptions;
use imgbuild::publish::prune::{self, CacheScope, PruneScope, Pruned, Why};
use imgbuild::publish::target::{Target, TargetOptions};
use indicatif::HumanBytes;
use serde_json::json;

use super::flags::parse_duration;
use super::inventory::load_inventory;
use super::output::{Output, Partial, Reported, Usage};
use super::talos::StateArgs;

#[derive(Args)]
pub struct PruneArgs {
    /// How many of the newest volumes or snapshots to keep per node and
    /// base, beside those in use.
    #[arg(long, default_value_t = 1)]
    keep: usize,
    /// List what would be deleted, why, and its size; delete nothing.
    #[arg(long)]
    dry_run: bool,
    /// The out dir whose manifest.json names the cache entries in use.
    #[arg(long, default_value = "out")]
    out_dir: PathBuf,
    /// Download cache [default: $XDG_CACHE_HOME/imgbuild].
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// Leave the download cache alone.
    #[arg(long)]
    no_cache: bool,
    /// How often Proxmox tasks are polled, in milliseconds.
    #[arg(long, default_value_t = 500)]
    poll_ms: u64,
    /// How long to wait while another run (`up`, `upgrade`) holds the
    /// cluster's state-dir lock.
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    lock_timeout: Duration,
    #[command(flatten)]
    state: StateArgs,
}

pub fn run(args: PruneArgs, config: &Path, output: Output) -> Result<()> {
    let inv = load_inventory(config, output).map_err(|e| Usage(format!("{e:#}")))?;
    let poll = Duration::from_millis(args.poll_ms.max(10));
    let options = TargetOptions {
        proxmox: PublishOptions {
            poll,
            ..PublishOptions::default()
        },
        hcloud: SnapshotOptions::default(),
        cancel: Cancel::never(),
        machines: false,
    };
    let target = Target::from_inventory(&inv, &|k| std::env::var(k).ok(), options)
        .map_err(|e| Usage(format!("{}: {e}", config.display())))?;
    let cache = (!args.no_cache).then(|| CacheScope {
        cache_dir: args
            .cache_dir
            .clone()
            .unwrap_or_else(FetchOptions::default_cache_dir),
        out_dir: args.out_dir.clone(),
    });
    let scope = PruneScope {
        inv: &inv,
        target: &target,
        keep: args.keep,
        cache,
        former_nodes: Vec::new(),
        delete: DeleteOptions {
            poll,
            ..DeleteOptions::default()
        },
    };
    let cancel = (!args.dry_run).then(|| {
        super::signals::stop_on_signals(
            b"\nimgbuild: stopping after the item being deleted (again to exit now)\n",
        )
    });
    // Planned under the lock: a volume `up` is uploading is not yet in use.
    let _lock = match &cancel {
        Some(cancel) => args
            .state
            .lock_waiting(&inv, "prune", args.lock_timeout, cancel)?,
        None => None,
    };
    let cancel = cancel.unwrap_or_else(Cancel::never);
    let plan = prune::plan(&scope)?;
    if args.dry_run {
        match output {
            Output::Json => outln!("{}", json!({"dryRun": true, "plan": plan})),
            Output::Text => {
                for p in &plan.delete {
                    outln!("would delete {}", line(p));
                }
                outln!(
                    "{} to delete ({}), {} kept",
                    plan.delete.len(),
                    HumanBytes(total(&plan.delete)),
                    plan.kept
                );
                for item in &plan.unowned {
                    outln!(
                        "left (not provably this cluster's): {}",
                        escape(&item.name())
                    );
                }
            }
        }
        return Ok(());
    }
    let report = prune::prune_until(&scope, &plan, &cancel);
    match output {
        Output::Json => outln!(
            "{}",
            json!({
                "kept": plan.kept,
                "deleted": report.deleted,
                "failed": report.failed.iter().map(|(p, e)| json!({"item": p.item, "why": p.why, "error": e})).collect::<Vec<_>>(),
                "left": report.left,
                "unowned": plan.unowned,
            })
        ),
        Output::Text => {
            for p in &report.deleted {
                outln!("deleted {}", line(p));
            }
            for (p, e) in &report.failed {
                errln!("could not delete {}: {}", p.item.name(), escape(e));
            }
            outln!(
                "{} deleted ({}), {} kept",
                report.deleted.len(),
                HumanBytes(total(&report.deleted)),
                plan.kept
            );
            for p in &report.left {
                errln!("left {}", line(p));
            }
            for item in &plan.unowned {
                outln!(
                    "left (not provably this cluster's): {}",
                    escape(&item.name())
                );
            }
        }
    }
    if !report.left.is_empty() {
        let why = format!(
            "interrupted: {} deleted, {} left untouched; run `imgbuild prune` again to delete them",
            report.deleted.len(),
            report.left.len()
        );
        return Err(if report.deleted.is_empty() {
            Reported(why).into()
        } else {
            Partial(why).into()
        });
    }
    match (report.failed.len(), report.deleted.len()) {
        (0, _) => Ok(()),
        (n, 0) => Err(Reported(format!("{n} item(s) could not be deleted")).into()),
        (n, ok) => Err(Partial(format!("{n} item(s) could not be deleted, {ok} deleted")).into()),
    }
}

/// One item, its size and why it goes.
fn line(p: &Pruned) -> String {
    let size = p
        .item
        .size()
        .map_or("size unknown".to_owned(), |s| HumanBytes(s).to_string());
    let why = match p.why {
        Why::Unreferenced => "no manifest references it".to_owned(),
        Why::NodeGone => "unused, and its node is no longer in the inventory".to_owned(),
        Why::OlderThanNewest { keep } => {
            format!("unused, and older than the newest {keep} of its node/base")
        }
    };
    format!("{} ({size}): {why}", escape(&p.item.name()))
}

fn total(items: &[Pruned]) -> u64 {
    items.iter().filter_map(|p| p.item.size()).sum()
}
