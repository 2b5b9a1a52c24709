//! Day two: `imgbuild upgrade` moves running nodes to the inventory's Talos
//! version and schematics, `apply` pushes config changes, `status` shows
//! drift. Each parses its flags, calls the library and prints what it says.

use super::flags::parse_duration;
use super::inventory::load_inventory;
use super::output::{Output, Partial, Reported, outside};
use super::talos::BootstrapRunArgs;
use anyhow::Result;
use clap::Args;
use imgbuild::factory::Factory;
use imgbuild::input::excerpt;
use imgbuild::talos::client::ApplyMode;
use imgbuild::talos::etcd;
use imgbuild::talos::kubernetes::plan::KubePlan;
use imgbuild::talos::kubernetes::{observe, run as kube_run, status as kstatus};
use imgbuild::talos::stage;
use imgbuild::talos::status;
use imgbuild::talos::upgrade::plan::Action;
use imgbuild::talos::upgrade::report::Ending;
use imgbuild::talos::upgrade::{self, RebootMode, RunOptions};
use imgbuild::up;
use imgbuild::up::converge::{self, ApplySettings, UpgradeSettings};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

#[derive(Clone, Copy, clap::ValueEnum)]
enum RebootArg {
    /// kexec where the node can.
    Default,
    /// A full power cycle through the firmware.
    Powercycle,
}

#[derive(Args)]
pub struct UpgradeArgs {
    /// Nodes to upgrade [default: all], still control planes first.
    nodes: Vec<String>,
    /// List every node with its version and schematic from → to, and the
    /// hops on the way; send nothing.
    #[arg(long)]
    dry_run: bool,
    /// Workers upgraded at once (control planes always one at a time).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    parallel: u16,
    /// Upgrade what Talos refuses by default: a 2-member etcd, which loses
    /// quorum while a control plane reboots.
    #[arg(long)]
    force: bool,
    /// How the node reboots into the new version.
    #[arg(long, value_enum, default_value = "default")]
    reboot_mode: RebootArg,
    /// Upgrade control planes without first saving an etcd snapshot into
    /// the state dir (taken by default; its failure stops the upgrade).
    #[arg(long)]
    skip_etcd_snapshot: bool,
    /// The folder the etcd snapshot before the first control-plane upgrade
    /// goes into (made 0700 if absent; a link is refused; the newest 5 kept)
    /// [default: the inventory's cluster.etcdSnapshotDir, else the state
    /// dir's etcd folder].
    #[arg(long, value_name = "DIR", conflicts_with = "skip_etcd_snapshot")]
    etcd_snapshot_dir: Option<std::path::PathBuf>,
    /// The call that makes a node pull the installer (Talos pulls before it
    /// answers; a new installer is built by the factory first).
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    pull_timeout: Duration,
    /// Per node and hop: from the request until the node runs its new boot
    /// (drain, install, reboot).
    #[arg(long, default_value = "30m", value_parser = parse_duration)]
    upgrade_timeout: Duration,
    /// Per node: cordon and evict its pods before its reboot (talosctl's
    /// `--drain-timeout`, 5 minutes by default); a node whose pods are not
    /// gone by then is not rebooted and the run stops.
    #[arg(long, default_value = "5m", value_parser = parse_duration)]
    drain_timeout: Duration,
    /// Upgrade Kubernetes although the cluster still uses an API the new
    /// version removes (stated in the output).
    #[arg(long)]
    skip_api_check: bool,
    /// Per Kubernetes component: from its new image until it runs and is
    /// Ready (also a rollout of kube-proxy or CoreDNS).
    #[arg(long, default_value = "5m", value_parser = parse_duration)]
    component_timeout: Duration,
    #[command(flatten)]
    run: BootstrapRunArgs,
    #[command(flatten)]
    download: super::build::DownloadArgs,
    /// How long to wait while another run (`up`, `upgrade`) holds the
    /// cluster's state-dir lock.
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    lock_timeout: Duration,
}

/// A node's string on one line, escaped and bounded.
fn shown(s: Option<&str>) -> String {
    s.map_or_else(|| "?".to_owned(), outside)
}

/// The Kubernetes part of the dry run, as lines.
fn print_kube_plan(k: &KubePlan) {
    outln!(
        "kubernetes: {} → {}",
        k.from.as_deref().map_or("?".to_owned(), |v| shown(Some(v))),
        k.to
    );
    for s in &k.steps {
        let mark = if s.done { " (done)" } else { "" };
        outln!("    {}{mark}", outside(&s.step.describe()));
    }
    for f in &k.removed_apis {
        outln!(
            "    removed API: {} ({}, removed in {})",
            outside(&f.resource),
            outside(&f.detail),
            f.removed_in
        );
    }
    for note in &k.notes {
        outln!("note: {}", outside(note));
    }
    if let Some(r) = &k.refusal {
        outln!("refused: kubernetes: {}", outside(r));
    }
}

/// The dry run's document and lines. Its actions (`plan` in JSON, the
/// `plan:` lines) come from the renderer `up --dry-run` uses for its
/// upgrade step ([`up::actions::upgrade_actions`]).
fn print_plan(planned: &converge::UpgradePlanned, output: Output) {
    let (up, kube) = (&planned.talos, planned.kube.as_ref().map(|(_, k)| k));
    let actions = up::actions::upgrade_actions(planned);
    let rows: Vec<serde_json::Value> = up
        .nodes
        .iter()
        .map(|n| {
            json!({
                "node": n.node,
                "from": {"version": n.from.version, "schematic": n.from.schematic},
                "to": {"version": n.to.version, "schematic": n.to.schematic, "installer": n.to.installer},
                "upgrade": n.action == Action::Upgrade,
                "action": n.action,
                "hops": n.hops,
                "api": n.api,
                "error": n.from.error.clone().or(n.problem.clone()),
            })
        })
        .collect();
    match output {
        Output::Json => outln!(
            "{}",
            json!({"dryRun": true, "nodes": rows, "force": up.force,
                   "rebootMode": up.reboot_mode, "etcdMembers": up.etcd_members,
                   "notes": up.notes, "refusal": up.refusal, "kubernetes": kube,
                   "plan": actions})
        ),
        Output::Text => {
            for n in &up.nodes {
                let path: Vec<&str> = n.hops.iter().map(|h| h.version.as_str()).collect();
                let what = match n.action {
                    Action::Done => " (done)".to_owned(),
                    Action::SchematicUnknown => " (on the target; schematic: unknown)".to_owned(),
                    Action::Config => {
                        " (on the target; its config names another installer: the config is applied)"
                            .to_owned()
                    }
                    Action::Blocked => " (blocked)".to_owned(),
                    Action::Upgrade if path.len() > 1 => format!(" via {}", path.join(" → ")),
                    Action::Upgrade => String::new(),
                };
                outln!(
                    "{}: {} → {}, schematic {} → {}{what}",
                    n.node,
                    shown(n.from.version.as_deref()),
                    n.to.version,
                    n.from
                        .schematic
                        .as_deref()
                        .map_or("unknown".into(), |s| shown(Some(s))),
                    n.to.schematic,
                );
                if let Some(e) = n.problem.as_deref().or(n.from.error.as_deref()) {
                    outln!("    not read from the node: {}", shown(Some(e)));
                }
            }
            for note in &up.notes {
                outln!("note: {note}");
            }
            if let Some(r) = &up.refusal {
                outln!("refused: {r}");
            }
            if let Some(k) = kube {
                print_kube_plan(k);
            }
            for a in &actions {
                outln!("{}", a.marked());
            }
        }
    }
}

pub fn upgrade(args: UpgradeArgs, config: &Path, output: Output) -> Result<()> {
    let inv = load_inventory(config, output)?;
    for name in &args.nodes {
        inv.node(name)?;
    }
    let mut opts = args.run.options_for(&inv)?;
    opts.lock_wait = super::talos::lock_wait(args.lock_timeout);
    // Day two needs a cluster: a missing state dir is never made here, and
    // missing secrets (or their age key) stop before the factory is asked.
    let state_dir = stage::StateDir::existing(&inv, opts.state_dir.as_deref())?;
    let fetch = args.download.options();
    let client = imgbuild::fetch::client(&fetch);
    let factory = Factory::new(&inv.image.factory, &client).with_retry(fetch.retry_policy());
    let targets = upgrade::targets(&inv, &factory)?;
    if args.dry_run {
        // A dry run sends no config: unset `${NAME}`s need not be given.
        opts.patch_vars = opts.patch_vars.comparing_unset();
    }
    let _lock = (!args.dry_run)
        .then(|| stage::lock_state_dir(&inv, &opts, "upgrade"))
        .transpose()?;
    let limits = opts.limits.clone();
    let prepared = stage::prepare_in(&inv, &opts, state_dir)?;
    let settings = UpgradeSettings {
        force: args.force,
        reboot_mode: match args.reboot_mode {
            RebootArg::Default => RebootMode::Default,
            RebootArg::Powercycle => RebootMode::Powercycle,
        },
        skip_api_check: args.skip_api_check,
        run: RunOptions {
            pull_timeout: args.pull_timeout,
            node_timeout: args.upgrade_timeout,
            drain_timeout: args.drain_timeout,
            parallel: usize::from(args.parallel),
            etcd: std::sync::Arc::new(if args.skip_etcd_snapshot {
                etcd::BeforeChange::skip()
            } else {
                etcd::BeforeChange::new(etcd::SnapshotOptions::before_change(
                    &prepared.state_dir.path,
                    &inv,
                    args.etcd_snapshot_dir.as_deref(),
                ))
            }),
        },
        kube: kube_run::RunOptions {
            pull_timeout: args.pull_timeout,
            component_timeout: args.component_timeout,
        },
        etcd_snapshot_dir: args.etcd_snapshot_dir.clone(),
    };
    let planned = converge::upgrade_plan(
        &inv,
        &factory,
        &targets,
        &prepared,
        &args.nodes,
        &settings,
        &limits,
    )?;
    if args.dry_run {
        print_plan(&planned, output);
        if let Some(r) = planned.refusal() {
            return Err(Reported(r).into());
        }
        // A node that could not say what it runs is not known to be fine.
        let unread = planned.blocked();
        if unread.is_empty() {
            return Ok(());
        }
        let message = format!("could not read or plan {}", unread.join(", "));
        return Err(if unread.len() < planned.talos.nodes.len() {
            Partial(message).into()
        } else {
            Reported(message).into()
        });
    }
    if let Some(r) = planned.kube_refusal() {
        // Refused before any change: Talos is not touched either. JSON
        // readers get the plan that carries the refusal, as a dry run.
        if output == Output::Text {
            outln!("refused: {}", outside(&r));
        } else {
            print_plan(&planned, output);
        }
        return Err(Reported(r).into());
    }
    let progress = |node: &str, what: &str| {
        if output == Output::Text {
            errln!("{node}: {}", outside(what));
        }
    };
    let say = |what: &str| {
        if output == Output::Text {
            errln!("kubernetes: {}", outside(what));
        }
    };
    let upgraded = converge::run_upgrade(
        &inv, &factory, &prepared, planned, &settings, &limits, &progress, &say,
    )?;
    let ending = upgraded.ending();
    let (report, kube_report) = (upgraded.talos, upgraded.kube);
    if output == Output::Text {
        if let Some(e) = &report.record_error {
            errln!("warning: the upgrade record was not written: {e}");
        }
        for note in report
            .notes
            .iter()
            .chain(kube_report.iter().flat_map(|k| &k.notes))
        {
            errln!("note: {}", outside(note));
        }
    }
    match output {
        Output::Json => {
            let mut doc = json!(report);
            doc["kubernetes"] = json!(kube_report);
            outln!("{doc}");
        }
        Output::Text => {
            for (node, v) in &report.versions {
                let unknown = if report.schematic_unknown.contains(node) {
                    " (schematic: unknown)"
                } else {
                    ""
                };
                outln!(
                    "{node}: {}{unknown}",
                    outside(v.as_deref().unwrap_or("unreachable"))
                );
            }
            if let Some(k) = &kube_report {
                outln!(
                    "kubernetes: {} ({} step(s) done now, {} done before)",
                    k.to,
                    k.done.len(),
                    k.already_done
                );
                for o in &k.applied {
                    outln!("    applied {}", outside(o));
                }
                if let Some(f) = &k.failed {
                    outln!(
                        "kubernetes: FAILED at {}: {}",
                        outside(&f.step),
                        outside(&f.error)
                    );
                }
            }
        }
    }
    match ending {
        Ending::Ok => Ok(()),
        Ending::Failed(m) => Err(Reported(m).into()),
        Ending::Partial(m) => Err(Partial(m).into()),
    }
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum ModeArg {
    /// Talos decides: live where it can, else (v1.9–v1.13) with a reboot,
    /// one node at a time.
    Auto,
    /// Refuse up front any change that needs a reboot.
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
    /// Per node that reboots for its change: until its new boot answers.
    #[arg(long, default_value = "30m", value_parser = parse_duration)]
    reboot_timeout: Duration,
    #[command(flatten)]
    run: BootstrapRunArgs,
    /// How long to wait while another run (`up`, `upgrade`) holds the
    /// cluster's state-dir lock.
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    lock_timeout: Duration,
}

#[derive(Args)]
pub struct StatusArgs {
    /// Exit 1 when anything differs from the inventory (CI drift gate).
    #[arg(long)]
    check: bool,
    /// With --check: exit 4 (not 1) when something differs, 1 only when
    /// it could not be checked (Terraform's -detailed-exitcode).
    #[arg(long, requires = "check")]
    detailed_exitcode: bool,
    #[command(flatten)]
    run: BootstrapRunArgs,
}

/// Where `upgrade` keeps what it installed on each node.
fn record_path(state_dir: &stage::StateDir) -> std::path::PathBuf {
    state_dir.upgrades_path()
}

pub fn apply(args: ApplyArgs, config: &Path, output: Output) -> Result<()> {
    let inv = load_inventory(config, output)?;
    for name in &args.nodes {
        inv.node(name)?;
    }
    let mut opts = args.run.options_for(&inv)?;
    opts.lock_wait = super::talos::lock_wait(args.lock_timeout);
    let state_dir = stage::StateDir::existing(&inv, opts.state_dir.as_deref())?;
    let _lock = (!args.dry_run)
        .then(|| stage::lock_state_dir(&inv, &opts, "apply"))
        .transpose()?;
    let prepared = stage::prepare_in(&inv, &opts, state_dir)?;
    let settings = ApplySettings {
        mode: match args.mode {
            ModeArg::Auto => ApplyMode::Auto,
            ModeArg::NoReboot => ApplyMode::NoReboot,
            ModeArg::Staged => ApplyMode::Staged,
        },
        reboot_timeout: args.reboot_timeout,
    };
    // Kubernetes versions move only through `upgrade`, in order.
    let mut outcome = converge::apply_configs(
        &inv,
        &prepared,
        &args.nodes,
        &settings,
        args.dry_run,
        &opts.patch_vars,
        &opts.limits,
    )?;
    for n in &mut outcome.nodes {
        n.diff = super::output::diff(&n.diff);
    }
    match output {
        Output::Json => outln!("{}", json!(outcome)),
        Output::Text => {
            for n in &outcome.nodes {
                let state = match (n.changed, n.applied, n.needs_reboot) {
                    (false, _, _) => "no change",
                    (true, false, _) if n.staged => "staged, applies at the next reboot",
                    (true, true, true) => "applied, rebooted",
                    (true, true, false) => "applied",
                    (true, false, true) => "would change, needs a reboot",
                    (true, false, false) => "would change",
                };
                outln!("{}: {state}", n.node);
                for line in n.diff.lines() {
                    outln!("    {}", excerpt(line, 400));
                }
            }
            for f in &outcome.failed {
                outln!("{}: FAILED: {}", f.node, outside(&f.error));
            }
            if let Some(r) = &outcome.refused {
                outln!("refused: {}", outside(r));
            }
        }
    }
    if let Some(r) = outcome.refused {
        return Err(Reported(r).into());
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

/// Every node's status row, read from the nodes (nothing is changed), and
/// what the cluster shows of Kubernetes.
/// Every node's status row, what Kubernetes said of its components, and
/// why Kubernetes could not be asked at all (when it could not).
type Rows = (
    Vec<status::NodeStatus>,
    observe::Observed,
    Option<status::KubeUnasked>,
);

pub(super) fn rows(
    inv: &imgbuild::inventory::Inventory,
    opts: &stage::BootstrapOptions,
) -> Result<Rows> {
    let wanted = upgrade::wanted(inv)?;
    let state_dir = stage::StateDir::existing(inv, opts.state_dir.as_deref())?;
    let mut prepared = stage::prepare_in(inv, opts, state_dir)?;
    let rt = converge::runtime()?;
    // Nodes that do not answer are found once (one deadline each, all at
    // once) and asked nothing more: a stalled node costs one call timeout.
    let silent = rt.block_on(status::silent(&prepared.plan, &opts.limits));
    let mut answering = prepared.plan.clone();
    answering.nodes.retain(|n| !silent.contains_key(&n.name));
    let observed = converge::pin_kubernetes(inv, &mut answering, &opts.limits)?;
    for node in &mut prepared.plan.nodes {
        if let Some(pinned) = answering.nodes.iter().find(|a| a.name == node.name) {
            node.config = pinned.config.clone();
        }
    }
    let record = upgrade::Record::load(&record_path(&prepared.state_dir))?;
    let fingerprints = imgbuild::talos::config::Fingerprints::load(&prepared.state_dir.path);
    let (rows, unasked) = rt.block_on(status::collect(
        &prepared.plan,
        &wanted,
        &record,
        &fingerprints,
        &opts.limits,
        &silent,
    ));
    Ok((rows, observed, unasked))
}

pub fn status(args: StatusArgs, config: &Path, output: Output) -> Result<()> {
    let inv = load_inventory(config, output)?;
    let mut opts = args.run.options_for(&inv)?;
    // Status changes nothing: an unset `${NAME}` is compared by fingerprint.
    opts.patch_vars = opts.patch_vars.comparing_unset();
    let (rows, observed, unasked) = rows(&inv, &opts)?;
    let kube = kstatus::rows(&observed, &inv.cluster.kubernetes_version);
    let drift: Vec<status::Drift> = rows
        .iter()
        .flat_map(status::NodeStatus::drift)
        .chain(rows.iter().filter_map(status::NodeStatus::etcd_drift))
        .chain(kube.iter().filter_map(kstatus::ComponentStatus::drift))
        .collect();
    match output {
        Output::Json => outln!(
            "{}",
            json!({"nodes": rows, "kubernetes": kube, "kubernetesUnasked": unasked, "drift": drift})
        ),
        Output::Text => {
            let short = |s: &Option<String>| {
                s.as_deref().map_or("unknown".to_owned(), |s| {
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
                let version = r
                    .version
                    .as_deref()
                    .map_or("-".to_owned(), |v| shown(Some(v)));
                outln!(
                    "{:<12} {:<9} {:<20} {:<27} {:<7} {:<5} {}",
                    r.node,
                    if r.reachable { "yes" } else { "NO" },
                    format!("{version} ({})", r.wanted_version),
                    format!(
                        "{} ({})",
                        short(&r.schematic),
                        short(&Some(r.wanted_schematic.clone()))
                    ),
                    if r.config_staged {
                        "STAGED"
                    } else if r.config_needs_reboot {
                        "REBOOT"
                    } else {
                        yes(r.config_in_sync)
                    },
                    yes(r.etcd_member),
                    match (yes(r.ready), r.cordoned) {
                        (ready, Some(true)) => format!("{ready} (cordoned)"),
                        (ready, _) => ready.to_owned(),
                    }
                );
            }
            for r in &rows {
                if let Some(e) = &r.error {
                    let what = if r.reachable { "" } else { "not reachable: " };
                    outln!("{}: {what}{}", r.node, shown(Some(e)));
                }
                if r.cordoned == Some(true) {
                    outln!(
                        "{}: cordoned (unschedulable): a drain did not finish or someone \
                         cordoned it; rerun the upgrade that drained it, or kubectl uncordon {}",
                        r.node,
                        r.node
                    );
                }
                if r.reachable && r.schematic.is_none() {
                    outln!(
                        "{}: schematic: unknown (the node does not report one)",
                        r.node
                    );
                }
                if r.config_staged {
                    print_staged(std::slice::from_ref(&r.node));
                } else if r.config_needs_reboot {
                    outln!(
                        "{}: the config change needs a reboot (imgbuild apply reboots it)",
                        r.node
                    );
                }
                if let Some(sec) = r
                    .security
                    .as_ref()
                    .filter(|s| s.secure_boot || r.wanted_secure_boot)
                {
                    let on = |b: bool| if b { "on" } else { "off" };
                    let key = |k: &Option<String>| k.clone().unwrap_or_else(|| "-".into());
                    outln!(
                        "{}: Secure Boot {} (wanted {}), UKI signing key {}, PCR signing key {}",
                        r.node,
                        on(sec.secure_boot),
                        on(r.wanted_secure_boot),
                        key(&sec.uki_signing_key_fingerprint),
                        key(&sec.pcr_signing_key_fingerprint)
                    );
                }
            }
            print_kube_rows(&kube);
            if let Some(u) = &unasked {
                outln!("{u}");
            }
            print_drift(&drift);
            print_fingerprinted(&rows);
        }
    }
    // Not checked is not "no difference": exit 1, even beside drift.
    if args.check && unasked.is_some() {
        return Err(
            Reported("not checked: Kubernetes could not be asked (see above)".into()).into(),
        );
    }
    if args.check && !drift.is_empty() {
        let message = format!("{} difference(s) from the inventory", drift.len());
        if args.detailed_exitcode {
            return Err(super::output::Changes(message).into());
        }
        return Err(Reported(message).into());
    }
    Ok(())
}

fn print_kube_rows(rows: &[kstatus::ComponentStatus]) {
    // By component first: a node's rows above start with its name.
    outln!("{:<24} {:<12} {}", "COMPONENT", "NODE", "RUNNING (WANTED)");
    for r in rows {
        let shown = |v: &Option<String>| v.as_deref().map_or("unknown".to_owned(), outside);
        outln!(
            "{:<24} {:<12} {} ({}){}",
            r.component,
            r.node,
            shown(&r.running),
            shown(&r.wanted),
            if r.in_sync { "" } else { "  DRIFT" }
        );
    }
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

/// One line per node whose config is staged for its next reboot.
pub(super) fn print_staged(nodes: &[String]) {
    for node in nodes {
        outln!("{node}: config staged, reboot pending (it applies at the next reboot)");
    }
}

pub(super) fn print_drift(drift: &[status::Drift]) {
    for d in drift {
        outln!("drift: {d}");
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
