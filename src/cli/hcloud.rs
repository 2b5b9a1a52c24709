//! The Hetzner Cloud side of `imgbuild publish`, and `imgbuild cleanup`.

use std::time::Duration;

use anyhow::Result;
use clap::Args;
use imgbuild::build::BuildOutcome;
use imgbuild::input::escape;
use imgbuild::publish::hcloud::{
    self, Credentials, Leftover, Snapshot, SnapshotImage, SnapshotOptions,
};
use imgbuild::publish::target::HcloudTarget;
use serde_json::json;

use super::flags::parse_duration;
use super::output::{Output, Partial, Reported, failed_json, print_failures};
use super::progress::{PublishView, Screen, Show};

/// Flags only the Hetzner target reads.
#[derive(Args)]
pub struct HcloudArgs {
    /// How long to keep trying to log in to the rescue system.
    #[arg(long, default_value = "5m", value_parser = parse_duration)]
    ssh_timeout: Duration,
    /// The rescue system's SSH port (22 on Hetzner; for test doubles, whose
    /// scripts may set it in the environment).
    #[arg(
        long,
        env = "IMGBUILD_RESCUE_SSH_PORT",
        default_value_t = 22,
        hide = true
    )]
    rescue_ssh_port: u16,
    /// Who logs in to the rescue system (root on Hetzner; a test double
    /// run without root lets in only its own user).
    #[arg(
        long,
        env = "IMGBUILD_RESCUE_SSH_USER",
        default_value = "root",
        hide = true
    )]
    rescue_ssh_user: String,
}

impl HcloudArgs {
    /// The snapshot runs' settings, polling every `poll`.
    pub fn options(&self, poll: Duration) -> SnapshotOptions {
        SnapshotOptions {
            poll,
            ssh_timeout: self.ssh_timeout,
            ssh_port: self.rescue_ssh_port,
            ssh_user: self.rescue_ssh_user.clone(),
            ..SnapshotOptions::default()
        }
    }
}

#[derive(Args)]
pub struct CleanupArgs {
    /// Only resources created at least this long ago (0: all), so a
    /// cleanup job does not delete the servers of builds still running.
    #[arg(long, default_value = "0s", value_parser = parse_duration)]
    older_than: Duration,
    /// List what would be deleted (found as cleanup finds it); delete nothing.
    #[arg(long)]
    dry_run: bool,
}

/// The API client of a command that only needs the token (`cleanup`,
/// `down`).
pub(super) fn api() -> Result<(hcloud::Api, SnapshotOptions)> {
    let creds = Credentials::from_env(&|k| std::env::var(k).ok())?;
    let opts = SnapshotOptions::default();
    Ok((creds.api(opts.retry)?, opts))
}

/// Publishes every distinct image of `built` as a snapshot; `target.cancel`
/// stops the runs.
pub fn publish(
    target: &HcloudTarget,
    built: &[BuildOutcome],
    build_failures: Vec<(String, String)>,
    output: Output,
    show: Show,
) -> Result<()> {
    let view = PublishView::new(Screen::new(show), show);
    let api = target.api()?;
    let images = SnapshotImage::distinct(built.iter().map(|o| (&o.image, o.file.clone())));
    let runs = target.publish(&api, &images, &view);
    let mut snapshots: Vec<Snapshot> = Vec::new();
    let mut failures = build_failures;
    let mut leftovers: Vec<Leftover> = Vec::new();
    for (image, run) in images.iter().zip(runs) {
        leftovers.extend(run.leftovers);
        match run.result {
            Ok(s) => snapshots.push(s),
            Err(e) => failures.push((image.nodes.join(","), e.to_string())),
        }
    }
    view.clear();
    let requests = api.requests();
    match output {
        Output::Json => outln!(
            "{}",
            json!({
                "target": "hcloud",
                "snapshots": snapshots,
                "requests": requests,
                "failed": failed_json(&failures),
                "leftovers": leftovers,
            })
        ),
        Output::Text => {
            for s in &snapshots {
                let labels = hcloud::selector(&s.labels);
                let how = if s.created {
                    "created"
                } else {
                    "already existed"
                };
                outln!(
                    "snapshot {} {how} for {}  labels {labels}",
                    s.id,
                    s.nodes.join(", ")
                );
            }
            errln!("hcloud: {requests} API requests");
            print_failures(&failures);
        }
    }
    if !leftovers.is_empty() {
        let list: Vec<String> = leftovers
            .iter()
            .map(|l| {
                format!(
                    "{} {}: {}",
                    l.kind.replace('_', " "),
                    l.id,
                    escape(&l.error)
                )
            })
            .collect();
        if output == Output::Text {
            errln!(
                "error: could not delete temporary resources (they cost money until deleted):\n  {}\n  run `imgbuild cleanup` (HCLOUD_TOKEN set) to delete them",
                list.join("\n  ")
            );
        }
        return Err(Reported(format!("{} temporary resource(s) left", leftovers.len())).into());
    }
    match (failures.len(), snapshots.len()) {
        (0, _) => Ok(()),
        (n, 0) => Err(Reported(format!("{n} snapshot(s) failed")).into()),
        (n, ok) => Err(Partial(format!("{n} snapshot(s) failed, {ok} published")).into()),
    }
}

/// `imgbuild cleanup`: deletes what killed runs left behind.
pub fn cleanup(args: CleanupArgs, output: Output) -> Result<()> {
    let (api, opts) = api()?;
    if args.dry_run {
        return cleanup_dry_run(&api, args.older_than, output);
    }
    let show = Show::for_output(false, output);
    let view = PublishView::new(Screen::new(show), show);
    let (deleted, left) = hcloud::cleanup(&api, args.older_than, &opts, &view);
    match output {
        Output::Json => outln!(
            "{}",
            json!({"deleted": deleted, "leftovers": left, "requests": api.requests()})
        ),
        Output::Text => {
            if deleted.is_empty() && left.is_empty() {
                outln!("nothing to delete: no temporary servers or SSH keys of imgbuild runs");
            }
            for d in &deleted {
                outln!(
                    "deleted {} {} ({})",
                    d.kind.replace('_', " "),
                    d.id,
                    escape(&d.name)
                );
            }
            for l in &left {
                errln!(
                    "could not delete {} {}: {}",
                    l.kind.replace('_', " "),
                    l.id,
                    escape(&l.error)
                );
            }
        }
    }
    if left.is_empty() {
        Ok(())
    } else {
        Err(Reported(format!("{} resource(s) could not be deleted", left.len())).into())
    }
}

/// `imgbuild cleanup --dry-run`: what `cleanup` would delete, nothing deleted.
fn cleanup_dry_run(api: &hcloud::Api, older_than: Duration, output: Output) -> Result<()> {
    let (found, left) = hcloud::cleanup_candidates(api, older_than);
    match output {
        Output::Json => outln!(
            "{}",
            json!({"dryRun": true, "wouldDelete": found, "leftovers": left, "requests": api.requests()})
        ),
        Output::Text => {
            if found.is_empty() && left.is_empty() {
                outln!("nothing to delete: no temporary servers or SSH keys of imgbuild runs");
            }
            for d in &found {
                outln!(
                    "would delete {} {} ({})",
                    d.kind.replace('_', " "),
                    d.id,
                    escape(&d.name)
                );
            }
            for l in &left {
                errln!(
                    "could not list {}s: {}",
                    l.kind.replace('_', " "),
                    escape(&l.error)
                );
            }
        }
    }
    if left.is_empty() {
        Ok(())
    } else {
        Err(Reported(format!("{} listing(s) failed", left.len())).into())
    }
}
