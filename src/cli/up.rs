//! `imgbuild up`: flags → [`UpOptions`], then one summary table (or JSON
//! document) for the whole run.

use super::board::Board;
use super::inventory::load_inventory;
use super::output::{Changes, Output, Partial, Reported, Usage, md_code, md_word, outside};
use super::progress::Show;
use super::publish::PublishArgs;
use super::talos::BootstrapRunArgs;
use anyhow::Result;
use clap::Args;
use imgbuild::publish::Cancel;
use imgbuild::publish::target::{Target, TargetOptions};
use imgbuild::up::converge::{ApplySettings, UpgradeSettings};
use imgbuild::up::plan::Plan;
use imgbuild::up::{self, Line, Observers, UpOptions};
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct UpArgs {
    /// Carry out the destructive actions: remove nodes gone from the
    /// inventory (drain, reset, delete the VM or server and its volumes)
    /// and prune. Without it they are shown and left.
    #[arg(long)]
    allow_destroy: bool,
    /// Print every action (build, publish, machines, bootstrap, upgrade,
    /// Kubernetes, configs, settings, removal, prune) at field level;
    /// change nothing.
    #[arg(long)]
    dry_run: bool,
    /// With --dry-run: exit 0 when nothing is to do, 4 when actions are
    /// planned, 1 when the plan could not be made (Terraform's
    /// -detailed-exitcode).
    #[arg(long, requires = "dry_run")]
    detailed_exitcode: bool,
    /// With --dry-run: write the plan to FILE (JSON, format-versioned, no
    /// secret: `${NAME}` values as keyed fingerprints) for `up --plan FILE`.
    #[arg(long, value_name = "FILE", requires = "dry_run")]
    out: Option<PathBuf>,
    /// Carry out the plan FILE written by `up --dry-run --out`: refused
    /// before any change, naming what moved, when a fresh plan differs
    /// (the inventory, a patch, a `${NAME}`, a node's version, a VM, what
    /// a prune would delete).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["dry_run", "out"])]
    plan: Option<PathBuf>,
    /// The folder the etcd snapshot before the first control-plane change
    /// goes into (made 0700 if absent; a link is refused; the newest 5
    /// kept): a CI job keeps it as an artifact [default: the inventory's
    /// cluster.etcdSnapshotDir, else the state dir's etcd folder].
    #[arg(long, value_name = "DIR")]
    etcd_snapshot_dir: Option<PathBuf>,
    #[command(flatten)]
    publish: PublishArgs,
    #[command(flatten)]
    bootstrap: BootstrapRunArgs,
    #[command(flatten)]
    new: super::talos::NewSecretsArg,
    /// How long to wait while another run (`up`, `upgrade`) holds the
    /// cluster's state-dir lock.
    #[arg(long, default_value = "10m", value_parser = super::flags::parse_duration)]
    lock_timeout: std::time::Duration,
}

pub fn run(args: UpArgs, config: &Path, output: Output) -> Result<()> {
    converge(args, config, output, false)
}

/// `imgbuild replace NODE…`: the nodes removed (drained, out of etcd,
/// reset, machine and volumes deleted), then `up` with their new settings.
pub fn replace(args: UpArgs, config: &Path, output: Output) -> Result<()> {
    if args.publish.nodes().is_empty() {
        return Err(Usage("replace: name the node(s) to replace".into()).into());
    }
    converge(args, config, output, true)
}

/// `up`, or with `replace` the named nodes replaced first.
fn converge(args: UpArgs, config: &Path, output: Output, replace: bool) -> Result<()> {
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
        errln!("warning: PROXMOX_VE_INSECURE is set: the server's certificate is not checked");
    }
    let build = args.publish.build();
    let quiet = build.download.quiet;
    let mut bootstrap = args.bootstrap.options();
    bootstrap.lock_wait = super::talos::lock_wait(args.lock_timeout);
    bootstrap.new_secrets = args.new.new_secrets;
    let opts = UpOptions {
        nodes: args.publish.nodes().to_vec(),
        build: build.options(),
        bootstrap,
        upgrade: UpgradeSettings {
            etcd_snapshot_dir: args.etcd_snapshot_dir.clone(),
            ..UpgradeSettings::default()
        },
        apply: ApplySettings::default(),
        allow_destroy: args.allow_destroy,
        recreate: Vec::new(),
    };
    let replaced = replace.then(|| opts.nodes.clone());
    let inventory_file = std::fs::read(config).unwrap_or_default();
    let vars = &opts.bootstrap.patch_vars;
    // Read once the plan is made: a first dry run may create the bundle.
    let secret = || fingerprint_secret(&inv, opts.bootstrap.state_dir.as_deref());
    let saved = match &args.plan {
        None => None,
        Some(path) => {
            let saved = Plan::read(path).map_err(|e| Usage(e.to_string()))?;
            // The plan as it would be made now, under the saved salt: any
            // difference refuses before anything changes.
            let fresh = match &replaced {
                Some(nodes) => up::replace(&inv, &target, &opts, nodes, None),
                None => up::plan(&inv, &target, &opts),
            };
            if let Some((_, e)) = &fresh.stopped {
                return Err(Reported(format!(
                    "{}: could not check the plan: {}",
                    path.display(),
                    up::chain(e)
                ))
                .into());
            }
            let now = up::saved_plan(
                &fresh,
                &inv,
                &inventory_file,
                vars,
                &saved.salt,
                secret().as_deref(),
            );
            let moved = saved.differences(&now);
            if !moved.is_empty() {
                // A stale plan is the caller's to make again: exit 2, as a
                // plan file imgbuild cannot read.
                let why = Usage(format!(
                    "{} no longer holds, nothing was changed (plan again): {}",
                    path.display(),
                    moved.join("; ")
                ));
                if output == Output::Json {
                    outln!(
                        "{}",
                        serde_json::json!({"planFile": path.display().to_string(), "refused": moved})
                    );
                    // Printed: the JSON above says it.
                    return Err(anyhow::Error::new(why).context(Reported(String::new())));
                }
                return Err(why.into());
            }
            Some(saved)
        }
    };
    let report = if args.dry_run {
        match &replaced {
            Some(nodes) => up::replace(&inv, &target, &opts, nodes, None),
            None => up::plan(&inv, &target, &opts),
        }
    } else {
        let download = super::build::progress_for(quiet, output);
        let nodes: Vec<String> = inv.nodes.iter().map(|n| n.name.clone()).collect();
        let board = Board::new(
            &nodes,
            Show::log_for(quiet, output),
            Show::for_output(quiet, output),
        );
        let steps = |node: &str, what: &str| {
            if output == Output::Text && !quiet {
                errln!("{node}: {}", outside(what));
            }
        };
        let obs = Observers {
            download: download.as_ref(),
            publish: &board,
            hcloud: &board,
            bootstrap: &board,
            steps: &steps,
        };
        let report = match &replaced {
            Some(nodes) => up::replace(&inv, &target, &opts, nodes, Some(obs)),
            None => up::up(&inv, &target, &opts, obs),
        };
        board.finish();
        report
    };
    if let Some((_, e)) = &report.stopped
        && e.is_setup()
    {
        // The secrets' errors with their cause (the SOPS file's recipients).
        let why = match e {
            up::UpError::Bootstrap(s) if s.is_usage() => up::chain(e),
            _ => format!("{e:#}"),
        };
        return Err(Usage(format!("{}: {why}", config.display())).into());
    }
    // The plan file written, and its sha256 (the Markdown names both).
    let mut written: Option<(PathBuf, String)> = None;
    if let Some(path) = &args.out
        && report.stopped.is_none()
    {
        imgbuild::atomic::check_out_target(path)
            .map_err(|e| Usage(format!("--out {}: {e}", path.display())))?;
        let salt = Plan::new_salt(&inventory_file);
        let plan = up::saved_plan(
            &report,
            &inv,
            &inventory_file,
            vars,
            &salt,
            secret().as_deref(),
        );
        let text = serde_json::to_string_pretty(&plan)?;
        imgbuild::atomic::write_if_changed(path, text.as_bytes(), false)
            .map_err(|e| anyhow::anyhow!("writing the plan to {}: {e}", path.display()))?;
        written = Some((
            path.clone(),
            imgbuild::digest::Sha256::of(text.as_bytes()).hex(),
        ));
        if output == Output::Text {
            errln!(
                "plan written to {} ({} action(s)); carry it out with: imgbuild up --plan {}",
                path.display(),
                plan.actions.len(),
                path.display()
            );
        }
    }
    // What the run did that the plan file did not hold (never expected:
    // the plan was checked just before; told, not hidden).
    let unplanned: Vec<String> = saved
        .as_ref()
        .map(|saved| {
            report
                .plan()
                .iter()
                .filter(|a| {
                    matches!(
                        a.outcome,
                        up::actions::State::Done | up::actions::State::Failed
                    )
                })
                .filter(|a| {
                    !saved
                        .actions
                        .iter()
                        .any(|p| p.node == a.node && p.kind.name() == a.kind.name())
                })
                .map(|a| a.line())
                .collect()
        })
        .unwrap_or_default();
    if let Some(why) = &report.drift_unchecked
        && output == Output::Text
    {
        errln!("warning: drift not checked: {why}");
    }
    match output {
        Output::Json => outln!("{}", report.json()?),
        Output::Text if super::output::markdown() => {
            out!("{}", markdown(&report.json()?, written.as_ref()));
        }
        Output::Text => {
            for line in report.text() {
                match line {
                    Line::Out(text) => outln!("{text}"),
                    Line::Err(text) => errln!("{text}"),
                }
            }
            super::day2::print_drift(&report.drift);
            super::day2::print_staged(&report.staged);
        }
    }
    if !unplanned.is_empty() {
        return Err(Reported(format!(
            "the run did what the plan file did not hold: {}",
            unplanned.join("; ")
        ))
        .into());
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
        None if !report.drift.is_empty() => {
            Err(Partial(super::day2::drift_summary(&report.drift)).into())
        }
        None if args.detailed_exitcode && !report.plan().is_empty() => {
            Err(Changes(format!("{} action(s) planned", report.plan().len())).into())
        }
        None => Ok(()),
        Some((_, e)) if report.partial() => Err(Partial(e.to_string()).into()),
        Some((_, e)) => Err(Reported(up::chain(e)).into()),
    }
}

/// The cluster secret that keys a plan's `${NAME}` fingerprints: the
/// bundle's bootstrap token, when the cluster has a bundle (the SOPS file
/// or the state dir's, as every run finds it), so that a fresh checkout
/// and the laptop fingerprint alike.
fn fingerprint_secret(inv: &imgbuild::inventory::Inventory, dir: Option<&Path>) -> Option<String> {
    let dir = dir.map_or_else(
        || imgbuild::talos::config::default_state_dir(inv),
        Path::to_owned,
    );
    imgbuild::talos::stage::find_secrets(inv, &dir)
        .ok()
        .flatten()
        .map(|(b, _)| b.secrets.bootstraptoken)
}

/// How much of one string from outside a Markdown cell shows.
const MD_CHARS: usize = 120;

/// `up`'s summary as Markdown for a pull-request comment (`--output
/// markdown`), made from its JSON document so the two cannot disagree: a
/// heading with the cluster and the counts per step, the plan's actions as
/// a table in the order they run (step, action, node, from → to; a run's
/// also with each result), why the run stopped, the warnings, and the plan
/// file written with its sha256. Every string from the document is one
/// [`md_word`] or [`md_code`]: escaped, bounded, redacted.
fn markdown(doc: &serde_json::Value, written: Option<&(PathBuf, String)>) -> String {
    use std::fmt::Write as _;
    let text = |v: &serde_json::Value| v.as_str().unwrap_or("").to_owned();
    let dry_run = doc["dryRun"].as_bool() == Some(true);
    let plan: &[serde_json::Value] = doc["plan"].as_array().map_or(&[], Vec::as_slice);
    let mut md = String::new();
    let _ = writeln!(
        md,
        "### imgbuild {} cluster {} ({})\n",
        if dry_run { "plan for" } else { "run on" },
        md_word(&text(&doc["cluster"]), 64, false),
        md_word(&text(&doc["target"]), 32, false),
    );
    // Counts per step, in the order the steps run.
    let mut steps: Vec<(String, usize)> = Vec::new();
    for a in plan {
        let step = text(&a["step"]);
        match steps.iter_mut().find(|(s, _)| *s == step) {
            Some((_, n)) => *n += 1,
            None => steps.push((step, 1)),
        }
    }
    let per_step: Vec<String> = steps
        .iter()
        .map(|(s, n)| format!("{} {n}", md_word(s, 32, false)))
        .collect();
    let count = |outcome: &str| plan.iter().filter(|a| a["outcome"] == outcome).count();
    if plan.is_empty() {
        let _ = writeln!(
            md,
            "**No changes.** {}\n",
            if dry_run {
                "The cluster is as the inventory says; nothing was changed."
            } else {
                "The run changed nothing."
            }
        );
    } else if dry_run {
        let destructive = plan
            .iter()
            .filter(|a| a["destructive"].as_bool() == Some(true))
            .count();
        let _ = write!(
            md,
            "**{} action(s) planned** ({}); nothing was changed.",
            plan.len(),
            per_step.join(", ")
        );
        if destructive > 0 {
            let _ = write!(
                md,
                " {destructive} of them destructive, carried out only with `--allow-destroy`."
            );
        }
        md.push_str("\n\n");
    } else {
        let _ = writeln!(
            md,
            "**{} done, {} failed, {} left, {} not reached** ({}).\n",
            count("done"),
            count("failed"),
            count("left"),
            count("notreached"),
            per_step.join(", ")
        );
    }
    if let Some(error) = doc["error"].as_str() {
        let _ = writeln!(
            md,
            "**Stopped at {}:** {}\n",
            md_word(&text(&doc["failedStage"]), 32, false),
            md_code(error, 400, false)
        );
    }
    if !plan.is_empty() {
        md.push_str(if dry_run {
            "| # | step | action | node | from → to |\n|--:|---|---|---|---|\n"
        } else {
            "| # | step | action | node | from → to | result |\n|--:|---|---|---|---|---|\n"
        });
        for (i, a) in plan.iter().enumerate() {
            let node = a["node"]
                .as_str()
                .map_or_else(|| "(cluster)".to_owned(), |n| md_word(n, 64, true));
            let value = |v: &serde_json::Value| {
                v.as_str()
                    .map_or("-".to_owned(), |v| md_code(v, MD_CHARS, true))
            };
            let changes: Vec<String> = a["changes"]
                .as_array()
                .map_or(&[][..], Vec::as_slice)
                .iter()
                .map(|c| {
                    format!(
                        "{} {} → {}",
                        md_word(&text(&c["field"]), 64, true),
                        value(&c["from"]),
                        value(&c["to"])
                    )
                })
                .collect();
            let mut action = md_word(&text(&a["what"]), MD_CHARS, true);
            if a["destructive"].as_bool() == Some(true) && dry_run {
                action.push_str(" (with `--allow-destroy`)");
            }
            if let Some(detail) = a["detail"].as_str() {
                let _ = write!(action, " ({})", md_code(detail, 200, true));
            }
            let _ = write!(
                md,
                "| {} | {} | {action} | {node} | {} |",
                i + 1,
                md_word(&text(&a["step"]), 32, true),
                if changes.is_empty() {
                    "-".to_owned()
                } else {
                    changes.join("; ")
                },
            );
            if !dry_run {
                let _ = write!(md, " {} |", md_word(&text(&a["outcome"]), 32, true));
            }
            md.push('\n');
        }
        md.push('\n');
    }
    let warnings: &[serde_json::Value] = doc["warnings"].as_array().map_or(&[], Vec::as_slice);
    for w in warnings {
        let _ = writeln!(md, "- warning: {}", md_code(&text(w), 400, false));
    }
    let drift = doc["drift"].as_array().map_or(0, Vec::len);
    if drift > 0 {
        let _ = writeln!(
            md,
            "- {drift} difference(s) from the inventory remain: see `imgbuild status`"
        );
    }
    if !warnings.is_empty() || drift > 0 {
        md.push('\n');
    }
    if let Some((path, sha)) = written {
        let file = path.display().to_string();
        let _ = writeln!(
            md,
            "Plan file {} (sha256 `{sha}`): carried out by {}.",
            md_code(&file, 200, false),
            md_code(&format!("imgbuild up --plan {file}"), 240, false)
        );
    }
    md
}
