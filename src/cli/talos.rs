//! `imgbuild secrets`, `config`, `talosconfig` and `bootstrap`: the cluster's
//! state directory and the way from booted images to a healthy cluster.

use super::board::Board;
use super::flags::parse_duration;
use super::inventory::load_inventory;
use super::output::{Output, Partial};
use super::progress::Show;
use anyhow::Result;
use clap::{Args, Subcommand};
use imgbuild::digest::Sha256;
use imgbuild::inventory::Inventory;
use imgbuild::talos::bootstrap;
use imgbuild::talos::config;
use imgbuild::talos::stage::{self, BootstrapOptions, StateDir};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Where the cluster's secrets and client files live.
#[derive(Args)]
pub struct StateArgs {
    /// Secrets, talosconfig, kubeconfig, etcd snapshots (0700; files 0600);
    /// rendered machine configs are never kept [default: .talos/<cluster
    /// name>/ beside the inventory]
    #[arg(long, env = "IMGBUILD_STATE_DIR")]
    pub(super) state_dir: Option<PathBuf>,
}

impl StateArgs {
    fn open(&self, inv: &Inventory) -> Result<StateDir> {
        let dir = StateDir::open(inv, self.state_dir.as_deref())?;
        super::guard::state_dir(&dir.path);
        Ok(dir)
    }

    /// The cluster's state-dir lock for `command`, waiting up to `timeout`
    /// while another run (`up`, `upgrade`) holds it, so that what it is
    /// making is not deleted under it. None when no cluster was
    /// bootstrapped here (a publish-only inventory has no state dir).
    pub(super) fn lock_waiting(
        &self,
        inv: &Inventory,
        command: &str,
        timeout: Duration,
        cancel: &imgbuild::publish::Cancel,
    ) -> Result<Option<imgbuild::talos::lock::StateLock>> {
        let Ok(dir) = StateDir::existing(inv, self.state_dir.as_deref()) else {
            return Ok(None);
        };
        let lock = imgbuild::talos::lock::acquire(&dir.path, command, &lock_wait(timeout), cancel)?;
        Ok(Some(lock))
    }
}

/// Says once that a run waits for the lock, and who holds it.
fn say_waiting(held: &imgbuild::talos::lock::LockError, timeout: Duration) {
    if let imgbuild::talos::lock::LockError::Held { holder, .. } = held {
        let by = holder
            .as_ref()
            .map_or_else(|| "holder unknown".to_owned(), ToString::to_string);
        errln!(
            "waiting up to {} for the state dir lock: another imgbuild is changing this cluster ({by})",
            humantime_short(timeout)
        );
    }
}

/// `--lock-timeout` of the commands whose stages take the state-dir lock
/// (`up`, `replace`, `apply`, `upgrade`, `bootstrap`): a lock another run
/// holds is waited for as `prune` and `down` wait, saying who holds it.
/// Ctrl-C while waiting ends the run (nothing was done yet).
pub(super) fn lock_wait(timeout: Duration) -> imgbuild::talos::lock::LockWait {
    imgbuild::talos::lock::LockWait {
        timeout,
        waiting: Some(std::sync::Arc::new(move |held| say_waiting(held, timeout))),
    }
}

/// `10m`, `90s`: a timeout as the flag took it.
fn humantime_short(d: Duration) -> String {
    match d.as_secs() {
        s if s % 60 == 0 && s > 0 => format!("{}m", s / 60),
        s => format!("{s}s"),
    }
}

#[derive(Args)]
pub struct SecretsArgs {
    #[command(subcommand)]
    command: SecretsCommand,
}

#[derive(Subcommand)]
enum SecretsCommand {
    /// Create the cluster's secrets.yaml (talosctl gen secrets layout), or
    /// import one made by `talosctl gen secrets` with --secrets.
    Gen(SecretsGenArgs),
    /// Write the secrets bundle as a SOPS file for age recipients (for Git).
    Encrypt(super::secrets::EncryptArgs),
}

#[derive(Args)]
pub struct SecretsGenArgs {
    #[command(flatten)]
    state: StateArgs,
    /// Import this secrets.yaml instead of generating one.
    #[arg(long)]
    secrets: Option<PathBuf>,
    /// Replace an existing secrets.yaml (nodes configured from it become foreign).
    #[arg(long)]
    force: bool,
}

#[derive(Args)]
pub struct ConfigArgs {
    /// The node whose machine config to print.
    node: String,
    #[command(flatten)]
    state: StateArgs,
    /// Write the config into this file (0600), secrets included; printed,
    /// its secrets are redacted unless --show-secrets.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Replace an --out file that holds something else (one that already
    /// holds this config is left as it is).
    #[arg(long, requires = "out")]
    force: bool,
}

#[derive(Args)]
pub struct TalosconfigArgs {
    #[command(flatten)]
    state: StateArgs,
    /// Write a new admin certificate even if the current one is still good;
    /// with --merge, also replace a context of the same name.
    #[arg(long)]
    force: bool,
    /// Then add the cluster's context to a talosconfig and make it the
    /// current one, as `talosctl config merge` does: FILE, else
    /// $TALOSCONFIG, else ~/.talos/config (created 0600 when missing).
    #[arg(long)]
    merge: bool,
    /// The talosconfig to merge into (with --merge).
    #[arg(requires = "merge")]
    file: Option<PathBuf>,
}

/// `--new-secrets`, for the commands that may start a cluster (`up`,
/// `bootstrap`).
#[derive(Args)]
pub struct NewSecretsArg {
    /// Make the cluster's secrets if it has none yet: a new cluster
    /// (nothing happens when they exist). Without it, a cluster without
    /// secrets (no SOPS file beside the inventory, no secrets.yaml in the
    /// state dir) stops before any change.
    #[arg(long)]
    pub(super) new_secrets: bool,
}

#[derive(Args)]
pub struct BootstrapArgs {
    #[command(flatten)]
    run: BootstrapRunArgs,
    #[command(flatten)]
    new: NewSecretsArg,
    /// Only errors and the result: no board, no progress lines.
    #[arg(long)]
    quiet: bool,
    /// Recover etcd from this snapshot (`imgbuild etcd snapshot`, `talosctl
    /// etcd snapshot`) on control planes whose etcd has no data.
    #[arg(long, value_name = "FILE")]
    recover_from: Option<PathBuf>,
    /// The --recover-from file is a copy of a member's data directory
    /// database (`member/snap/db`), not a snapshot: Talos skips the hash
    /// check (talosctl `--recover-skip-hash-check`).
    #[arg(long, requires = "recover_from")]
    recover_skip_hash_check: bool,
    /// How long to wait while another run (`up`, `upgrade`) holds the
    /// cluster's state-dir lock.
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    lock_timeout: Duration,
}

/// The bootstrap's state dir, identity, timeouts and pin: shared by
/// `bootstrap` and `up`.
#[derive(Args)]
pub struct BootstrapRunArgs {
    #[command(flatten)]
    state: StateArgs,
    /// Client identity to use [default: <state-dir>/talosconfig, made from the secrets].
    #[arg(long, env = "TALOSCONFIG")]
    talosconfig: Option<PathBuf>,
    /// Per node: from "port closed" to "answers over mTLS" (e.g. 10m, 90s).
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    node_timeout: Duration,
    /// Retrying Bootstrap while etcd or time sync is not ready.
    #[arg(long, default_value = "5m", value_parser = parse_duration)]
    bootstrap_timeout: Duration,
    /// From bootstrap until every health check passes.
    #[arg(long, default_value = "15m", value_parser = parse_duration)]
    health_timeout: Duration,
    /// One API call.
    #[arg(long, default_value = "15s", value_parser = parse_duration)]
    call_timeout: Duration,
    /// Pause between polls.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    poll: Duration,
    /// Accept only a maintenance-mode certificate with this SHA-256 (hex,
    /// with or without colons).
    #[arg(long)]
    cert_fingerprint: Option<Sha256>,
}

impl BootstrapRunArgs {
    pub(super) fn options(self) -> BootstrapOptions {
        if let Some(dir) = &self.state.state_dir {
            super::guard::state_dir(dir);
        }
        BootstrapOptions {
            state_dir: self.state.state_dir,
            talosconfig: self.talosconfig,
            targets: Default::default(),
            patch_vars: patch_vars(),
            cancel: Default::default(),
            new_secrets: false,
            lock_wait: Default::default(),
            limits: bootstrap::Options {
                node_timeout: self.node_timeout,
                bootstrap_timeout: self.bootstrap_timeout,
                health_timeout: self.health_timeout,
                call_timeout: self.call_timeout,
                poll: self.poll,
                pin: self.cert_fingerprint.map(|f| f.hex()),
                recover_from: None,
                recover_skip_hash_check: false,
                leaving: Vec::new(),
            },
        }
    }
}

impl BootstrapRunArgs {
    /// [`Self::options`] for a cluster that exists: on a Hetzner target the
    /// servers are found where the platform says (by label, else the last
    /// `up`'s record, with a warning), so the inventory needs no addresses.
    /// Every command after `up` goes through here.
    pub(super) fn options_for(self, inv: &Inventory) -> Result<BootstrapOptions> {
        let mut opts = self.options();
        if inv.publish.hcloud().is_some_and(|h| h.servers.is_some()) {
            let dir = (opts.state_dir.clone()).unwrap_or_else(|| config::default_state_dir(inv));
            let found = imgbuild::publish::hcloud::servers::addresses(inv, &dir, &|k| {
                std::env::var(k).ok()
            })?;
            if let Some(warning) = found.stale() {
                errln!("warning: {warning}");
            }
            // Reached at the public IP, as `up` reaches them.
            let reached = found.reached.into_iter().filter_map(|(node, ip)| {
                Some((
                    node,
                    imgbuild::talos::client::NodeEndpoint::new(Some(ip), None)?,
                ))
            });
            opts.targets.extend(reached);
        }
        Ok(opts)
    }
}

pub(super) use super::guard::patch_vars;

pub fn secrets(args: SecretsArgs, config: &Path, output: Output) -> Result<()> {
    let args = match args.command {
        SecretsCommand::Gen(args) => args,
        SecretsCommand::Encrypt(args) => return super::secrets::encrypt(args, config, output),
    };
    let inv = load_inventory(config, output)?;
    // New secrets beside the cluster's SOPS file would be another
    // cluster's: every later command refuses the two as different.
    let sealed = stage::sealed_path(&inv);
    if std::fs::symlink_metadata(&sealed).is_ok() {
        return Err(super::output::Usage(format!(
            "{} holds the cluster's secrets: `secrets gen` would make another cluster's (nothing was changed). To add a recipient: `imgbuild secrets encrypt --force --age …` (reads that file); to start a new cluster on purpose, move it away first",
            sealed.display()
        ))
        .into());
    }
    let saved = args
        .state
        .open(&inv)?
        .save_secrets(args.secrets.as_deref(), args.force)?;
    let path = &saved.path;
    if output == Output::Text && !saved.ignored_fields.is_empty() {
        errln!(
            "warning: {}: ignored fields imgbuild does not know (as talosctl ignores them; not kept): {}",
            args.secrets.as_deref().unwrap_or(path).display(),
            saved.ignored_fields.join(", ")
        );
    }
    match output {
        Output::Json => outln!(
            "{}",
            json!({
                "secrets": path,
                "imported": args.secrets,
                "replaced": args.force,
                "ignoredFields": saved.ignored_fields,
            })
        ),
        Output::Text => outln!(
            "{}: {} (0600)",
            path.display(),
            if args.secrets.is_some() {
                "imported"
            } else {
                "generated"
            }
        ),
    }
    Ok(())
}

pub fn machine_config(args: ConfigArgs, config: &Path, output: Output) -> Result<()> {
    let inv = load_inventory(config, output)?;
    let node = inv.node(&args.node)?;
    if let Some(path) = &args.out {
        imgbuild::atomic::check_out_target(path)
            .map_err(|e| super::output::Usage(format!("--out {}: {e}", path.display())))?;
    }
    let state = StateDir::existing(&inv, args.state.state_dir.as_deref())?;
    super::guard::state_dir(&state.path);
    let bundle = state.secrets(&inv, false)?.bundle;
    let text = config::machine_config(&inv, node, &bundle, &patch_vars())?;
    if let Some(path) = &args.out {
        if !args.force && path.exists() && !imgbuild::atomic::holds(path, text.as_bytes()) {
            return Err(super::output::Usage(format!(
                "--out {}: the file exists and holds something else: --force replaces it",
                path.display()
            ))
            .into());
        }
        imgbuild::atomic::write_if_changed(path, text.as_bytes(), true)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        match output {
            Output::Json => outln!("{}", json!({"node": node.name, "out": path})),
            Output::Text => outln!("{}: {} (0600)", node.name, path.display()),
        }
        return Ok(());
    }
    let text = redacted_yaml(&text);
    match output {
        Output::Json => outln!("{}", json!({"node": node.name, "config": text})),
        Output::Text => out!("{text}"),
    }
    Ok(())
}

/// A config's YAML with its secrets redacted value by value, so each
/// placeholder is a (quoted) YAML string and `imgbuild config NODE | yq`
/// still reads it; the stdout writer's own pass then finds nothing left.
fn redacted_yaml(text: &str) -> String {
    use serde::Deserialize;
    use serde_yaml_ng::Value;
    fn walk(v: &mut Value) {
        match v {
            Value::String(s) => *s = super::output::shown(s, false),
            Value::Sequence(items) => items.iter_mut().for_each(walk),
            // Keys too: a `${NAME}` can name a label.
            Value::Mapping(m) => {
                for (mut k, mut v) in std::mem::take(m) {
                    walk(&mut k);
                    walk(&mut v);
                    m.insert(k, v);
                }
            }
            Value::Tagged(t) => walk(&mut t.value),
            _ => {}
        }
    }
    let mut docs = Vec::new();
    for de in serde_yaml_ng::Deserializer::from_str(text) {
        let Ok(mut doc) = Value::deserialize(de) else {
            // Rendered by imgbuild, so YAML; if not, the writer redacts it.
            return text.to_owned();
        };
        walk(&mut doc);
        docs.push(serde_yaml_ng::to_string(&doc).expect("YAML values serialise"));
    }
    docs.join("---\n")
}

pub fn talosconfig(args: TalosconfigArgs, config: &Path, output: Output) -> Result<()> {
    let inv = load_inventory(config, output)?;
    let state = StateDir::existing(&inv, args.state.state_dir.as_deref())?;
    super::guard::state_dir(&state.path);
    let bundle = state.secrets(&inv, false)?.bundle;
    let stage::TalosconfigFile {
        path,
        config: cfg,
        written,
    } = state.talosconfig(&inv, &bundle, args.force)?;
    if args.merge {
        return super::merge::talosconfig(&path, args.file, args.force, output);
    }
    let endpoints = cfg.current()?.endpoints.clone();
    match output {
        Output::Json => outln!(
            "{}",
            json!({"talosconfig": path, "written": written, "context": cfg.context, "endpoints": endpoints})
        ),
        Output::Text => outln!(
            "{}: {} (context {}, endpoints {})",
            path.display(),
            if written { "written" } else { "unchanged" },
            cfg.context,
            endpoints.join(", ")
        ),
    }
    Ok(())
}

#[derive(Args)]
pub struct KubeconfigArgs {
    #[command(flatten)]
    state: StateArgs,
    /// Add the cluster's cluster, user and context to a kubeconfig and make
    /// it the current context: FILE, else the first file in $KUBECONFIG,
    /// else ~/.kube/config (created 0600 when missing).
    #[arg(long)]
    merge: bool,
    /// The kubeconfig to merge into (with --merge).
    #[arg(requires = "merge")]
    file: Option<PathBuf>,
    /// Replace an entry of the same name with other content (another
    /// cluster's of that name, or this one's before its secrets changed).
    #[arg(long, requires = "merge")]
    force: bool,
}

/// `imgbuild kubeconfig`: where the admin kubeconfig is, or (--merge) the
/// cluster added to the user's own. With no kubeconfig in the state dir
/// (a fresh checkout, a CI runner), one is minted from the secrets as
/// `talosctl kubeconfig` would fetch it: written into the state dir, or
/// with --merge only into the user's file. One that is there is used as
/// it is, as before.
pub fn kubeconfig(args: KubeconfigArgs, config: &Path, output: Output) -> Result<()> {
    use imgbuild::talos::kube::{AdminKube, Kubeconfig, REQUESTED_LIFETIME_DAYS};
    let inv = load_inventory(config, output)?;
    let state = StateDir::existing(&inv, args.state.state_dir.as_deref())?;
    let ours = state.kubeconfig_path();
    let imgbuild::talos::stage::Secrets { bundle, source, .. } = state.secrets(&inv, false)?;
    let sealed = matches!(source, imgbuild::talos::stage::SecretsSource::Sealed(_));
    if sealed && !args.merge {
        return Err(super::output::Usage(format!(
            "the secrets of {} are sealed, so no kubeconfig (it holds a key) is written into the state dir: `imgbuild kubeconfig --merge [FILE]` mints one into yours",
            inv.cluster.name
        ))
        .into());
    }
    let there = !sealed
        && imgbuild::input::read_text(&ours, imgbuild::input::MAX_TEXT_FILE)
            .ok()
            .is_some_and(|t| Kubeconfig::parse(&t).is_ok());
    let minted = if there {
        None
    } else {
        let admin = AdminKube::of(&inv.cluster.name, &inv.cluster.endpoint, &bundle);
        let kc = admin.mint(REQUESTED_LIFETIME_DAYS)?;
        // Where this host reaches the API, as the bootstrap writes it.
        Some(match &inv.cluster.kubernetes_endpoint {
            Some(outside) => kc.through(
                outside,
                imgbuild::inventory::endpoint_host(&inv.cluster.endpoint),
            ),
            None => kc,
        })
    };
    if args.merge {
        return match &minted {
            Some(kc) => super::merge::kubeconfig_text(&kc.to_yaml(), args.file, args.force, output),
            None => super::merge::kubeconfig(&ours, args.file, args.force, output),
        };
    }
    if let Some(kc) = &minted {
        imgbuild::atomic::write_if_changed(&ours, kc.to_yaml().as_bytes(), true)
            .map_err(|e| anyhow::anyhow!("{}: {e}", ours.display()))?;
    }
    match output {
        Output::Json => outln!(
            "{}",
            json!({"kubeconfig": ours, "minted": minted.is_some()})
        ),
        Output::Text => {
            outln!("{}", ours.display());
            if minted.is_some() {
                outln!(
                    "minted from {} (the state dir had none): admin, valid {REQUESTED_LIFETIME_DAYS} days",
                    state.secrets_path().display()
                );
            }
            outln!(
                "use it: export KUBECONFIG={} (or: imgbuild kubeconfig --merge)",
                ours.display()
            );
        }
    }
    Ok(())
}

pub fn bootstrap(args: BootstrapArgs, config: &Path, output: Output) -> Result<()> {
    let inv = load_inventory(config, output)?;
    let mut opts = args.run.options_for(&inv)?;
    opts.lock_wait = lock_wait(args.lock_timeout);
    opts.limits.recover_from = args.recover_from.clone();
    opts.limits.recover_skip_hash_check = args.recover_skip_hash_check;
    opts.new_secrets = args.new.new_secrets;
    // Before the lock is made: without secrets nothing is written.
    stage::secrets_ready(&inv, &opts)?;
    let _lock = stage::lock_state_dir(&inv, &opts, "bootstrap")?;
    let nodes: Vec<String> = inv.nodes.iter().map(|n| n.name.clone()).collect();
    let board = Board::new(&nodes, Show::log_for(args.quiet, output), Show::Nothing);
    let done = stage::bootstrap(&inv, &opts, &board);
    board.finish();
    let stage::Bootstrapped { prepared, outcome } = done?;
    let tc_path = prepared.talosconfig.as_ref();
    let plan = &prepared.plan;
    // Healthy only when every node is Ready, whatever the checks ended on.
    let healthy = outcome.health.is_healthy()
        && plan
            .nodes
            .iter()
            .all(|n| outcome.ready.get(&n.name) == Some(&true));
    match output {
        Output::Json => outln!(
            "{}",
            json!({
                "cluster": inv.cluster.name,
                "healthy": healthy,
                "health": outcome.health,
                "ready": outcome.ready,
                "fallbacks": outcome.fallbacks,
                "applied": outcome.applied,
                "alreadyConfigured": outcome.already_configured,
                "bootstrapped": outcome.bootstrapped,
                "bootstrapNode": outcome.bootstrap_node,
                "recoveredFrom": args.recover_from,
                "versions": outcome.versions,
                "kubeconfig": plan.write_kubeconfig.then_some(&plan.kubeconfig_path),
                "kubeconfigServer": outcome.kubeconfig_server,
                "kubeconfigMovedFrom": outcome.kubeconfig_moved_from,
                "talosconfig": tc_path,
                "secrets": prepared.secrets_source.path(),
                "secretsCreated": prepared.secrets_created,
                "elapsedMs": outcome.elapsed_ms,
            })
        ),
        Output::Text => {
            if healthy {
                outln!(
                    "cluster {} is healthy ({:.1}s)",
                    inv.cluster.name,
                    outcome.elapsed_ms as f64 / 1000.0
                );
            }
            outln!(
                "  applied: {}",
                if outcome.applied.is_empty() {
                    "nothing (all nodes were configured)".to_owned()
                } else {
                    outcome.applied.join(", ")
                }
            );
            outln!(
                "  etcd: {} on {}",
                match &args.recover_from {
                    Some(file) => format!("recovered from {}", file.display()),
                    None if outcome.bootstrapped => "bootstrapped".to_owned(),
                    None => "already bootstrapped".to_owned(),
                },
                outcome.bootstrap_node
            );
            if plan.write_kubeconfig {
                outln!(
                    "  kubeconfig: {} (server {})",
                    plan.kubeconfig_path.display(),
                    outcome.kubeconfig_server
                );
            } else {
                outln!(
                    "  kubeconfig: not written, the secrets are in {} (server {}); imgbuild kubeconfig --merge mints one into yours",
                    prepared.secrets_source.path().display(),
                    outcome.kubeconfig_server
                );
            }
            if prepared.secrets_created {
                outln!(
                    "  secrets: {} made now (a new cluster): keep them in Git with imgbuild secrets encrypt --age …",
                    prepared.secrets_source.path().display()
                );
            }
            match tc_path {
                Some(tc_path) => {
                    outln!("  talosconfig: {}", tc_path.display());
                    if plan.write_kubeconfig {
                        outln!(
                            "  use them: imgbuild kubeconfig --merge and imgbuild talosconfig --merge \
                             (into ~/.kube/config and ~/.talos/config), or export KUBECONFIG={} TALOSCONFIG={}",
                            plan.kubeconfig_path.display(),
                            tc_path.display()
                        );
                    }
                }
                None => outln!(
                    "  talosconfig: not written (the secrets are in {}): imgbuild talosconfig writes one",
                    prepared.secrets_source.path().display()
                ),
            }
            for f in &outcome.fallbacks {
                outln!("note: {f}");
            }
            if let Some(from) = &outcome.kubeconfig_moved_from {
                outln!(
                    "note: the kubeconfig moved from {from} to {}: the endpoint answers now",
                    outcome.kubeconfig_server
                );
            }
        }
    }
    if healthy {
        Ok(())
    } else {
        Err(Partial(format!(
            "cluster {} is not healthy: {}",
            inv.cluster.name, outcome.health
        ))
        .into())
    }
}

#[cfg(test)]
mod tests {
    use super::BootstrapRunArgs;
    use clap::Parser;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        run: BootstrapRunArgs,
    }

    fn pin_of(args: &[&str]) -> Option<String> {
        let argv = std::iter::once("test").chain(args.iter().copied());
        let flags = Flags::try_parse_from(argv).unwrap();
        flags.run.options().limits.pin
    }

    /// The pin reaches the client as one spelling, whichever the user pasted.
    #[test]
    fn the_pin_is_lowercase_hex_in_either_spelling() {
        let hex = "ab".repeat(31) + "0f";
        let colons = hex.parse::<imgbuild::digest::Sha256>().unwrap().colons();
        assert_eq!(pin_of(&["--cert-fingerprint", &colons]), Some(hex.clone()));
        let upper = hex.to_uppercase();
        assert_eq!(pin_of(&["--cert-fingerprint", &upper]), Some(hex));
        assert_eq!(pin_of(&[]), None);
    }
}
