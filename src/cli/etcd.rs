//! `imgbuild etcd snapshot`: etcd's snapshot from a healthy control plane,
//! into the state dir (the newest N kept) or a file, verified, 0600.

use super::flags::parse_duration;
use super::inventory::load_inventory;
use super::output::Output;
use super::talos::BootstrapRunArgs;
use anyhow::Result;
use clap::{Args, Subcommand};
use imgbuild::talos::etcd::{self, SnapshotOptions, SnapshotTarget};
use imgbuild::talos::stage;
use serde_json::json;
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct EtcdArgs {
    #[command(subcommand)]
    command: EtcdCommand,
}

#[derive(Subcommand)]
enum EtcdCommand {
    /// Save etcd's snapshot (restore it with `bootstrap --recover-from`).
    Snapshot(SnapshotArgs),
}

#[derive(Args)]
struct SnapshotArgs {
    /// Write exactly this file (0600, with FILE.sha256 beside it) [default:
    /// <state-dir>/etcd/<cluster>-<UTC time>-<node>.snapshot, the newest --keep kept].
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Replace an existing --out file (and its .sha256).
    #[arg(long, requires = "out")]
    force: bool,
    /// Snapshots kept in the state dir (older ones imgbuild wrote are deleted).
    #[arg(long, default_value_t = etcd::DEFAULT_KEEP as u16, value_parser = clap::value_parser!(u16).range(1..))]
    keep: u16,
    /// Stop (keeping nothing) past this size: bytes, or with K, M, G (powers of 1024).
    #[arg(long, default_value = "8G", value_parser = parse_size)]
    max_size: u64,
    /// Give up (keeping nothing) when the whole snapshot has not arrived
    /// within this time, however steadily it trickles.
    #[arg(long, default_value = "30m", value_parser = parse_duration)]
    timeout: std::time::Duration,
    #[command(flatten)]
    run: BootstrapRunArgs,
}

/// `512`, `64K`, `8M`, `8G`: powers of 1024.
fn parse_size(s: &str) -> Result<u64, String> {
    let (digits, shift) = match s.trim().to_ascii_uppercase() {
        t if t.ends_with('K') => (t[..t.len() - 1].to_owned(), 10),
        t if t.ends_with('M') => (t[..t.len() - 1].to_owned(), 20),
        t if t.ends_with('G') => (t[..t.len() - 1].to_owned(), 30),
        t => (t, 0),
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1 << shift))
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("{s:?} is not a size (e.g. 512, 64K, 8M, 8G)"))
}

pub fn run(args: EtcdArgs, config: &Path, output: Output) -> Result<()> {
    let EtcdCommand::Snapshot(args) = args.command;
    let inv = load_inventory(config, output)?;
    let opts = args.run.options_for(&inv)?;
    // A snapshot needs a cluster: a missing state dir is never made here.
    let state_dir = stage::StateDir::existing(&inv, opts.state_dir.as_deref())?;
    let prepared = stage::prepare_in(&inv, &opts, state_dir)?;
    let mut snap = SnapshotOptions::in_state_dir(&prepared.state_dir.path, &inv.cluster.name);
    snap.max_size = args.max_size;
    snap.total_timeout = args.timeout;
    snap.cancel = super::signals::cancel_on_signals();
    snap.target = match args.out {
        Some(file) => {
            imgbuild::atomic::check_out_target(&file)
                .map_err(|e| super::output::Usage(format!("--out {}: {e}", file.display())))?;
            let record = etcd::record_path(&file);
            imgbuild::atomic::check_out_target(&record)
                .map_err(|e| super::output::Usage(format!("--out {}: {e}", record.display())))?;
            if !args.force
                && let Some(there) = [&file, &record]
                    .into_iter()
                    .find(|f| std::fs::symlink_metadata(f).is_ok())
            {
                return Err(super::output::Usage(format!(
                    "--out {}: {} exists: --force replaces it",
                    file.display(),
                    there.display()
                ))
                .into());
            }
            // Never over the cluster's own files (secrets, configs, records).
            let folder = |p: &Path| {
                p.parent()
                    .filter(|d| !d.as_os_str().is_empty())
                    .unwrap_or(Path::new("."))
                    .canonicalize()
                    .ok()
            };
            if let (Some(out), Ok(state)) = (folder(&file), prepared.state_dir.path.canonicalize())
                && out.starts_with(&state)
            {
                return Err(super::output::Usage(format!(
                    "--out {}: inside the cluster's state dir {}, which holds its secrets: without --out the snapshot goes to its etcd folder (the newest --keep kept)",
                    file.display(),
                    prepared.state_dir.path.display()
                ))
                .into());
            }
            SnapshotTarget::File(file)
        }
        None => SnapshotTarget::Dir {
            dir: prepared.state_dir.path.join(etcd::SNAPSHOT_DIR),
            cluster: inv.cluster.name.clone(),
            keep: usize::from(args.keep),
        },
    };
    let file = etcd::snapshot_blocking(&prepared.plan, &snap, &opts.limits)?;
    match output {
        Output::Json => outln!("{}", json!({ "snapshot": file })),
        Output::Text => {
            outln!(
                "etcd snapshot saved to {} ({} bytes, from {}; 0600)",
                file.path.display(),
                file.info.size,
                file.node
            );
            outln!(
                "  sha256 {} (in {})",
                file.info.sha256,
                etcd::record_path(&file.path).display()
            );
            for old in &file.pruned {
                outln!("  deleted the older {}", old.display());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_are_powers_of_1024_and_never_zero() {
        assert_eq!(parse_size("512"), Ok(512));
        assert_eq!(parse_size("64k"), Ok(64 << 10));
        assert_eq!(parse_size("8G"), Ok(8 << 30));
        assert!(parse_size("0").is_err());
        assert!(parse_size("1T").is_err());
        assert!(parse_size("99999999999G").is_err());
    }
}
