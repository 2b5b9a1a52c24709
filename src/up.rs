//! `imgbuild up`: the whole line as library calls: build → publish → start →
//! bootstrap → health. Each stage is the call its own command makes
//! ([`build::build`], the target's publish, [`stage::bootstrap`]), and each
//! is idempotent, so a rerun after any failure (or SIGKILL) continues from
//! what is done and reports every finished stage as unchanged. [`plan`] is
//! the dry run: it reads (manifest, GETs, TLS probes) and changes nothing.
//! Every decision is the stage's own (the target's per node, the
//! bootstrap's reach); `up` records them in a [`Report`], whose table and
//! JSON [`report`] shapes.

pub mod actions;
pub mod converge;
mod error;
pub mod plan;
mod report;

pub use error::{MachineError, Stage, Stopped, UpError};
pub use report::{Change, Line, NodeReport, Report, Stages, TalosState, chain};

/// The plan file of a dry run's report: its actions in order and what
/// they rest on; `salt` (kept in the file) and the cluster's `secret`
/// (never kept) key the `${NAME}` fingerprints (a saved plan's own salt,
/// to compare with it).
pub fn saved_plan(
    report: &Report,
    inv: &Inventory,
    inventory_file: &[u8],
    vars: &crate::talos::config::PatchVars,
    salt: &str,
    secret: Option<&str>,
) -> plan::Plan {
    let nodes = report
        .nodes
        .iter()
        .map(|n| plan::NodeSeen {
            node: n.node.clone(),
            talos: n.talos,
            talos_version: n.talos_version.clone(),
            machine: n
                .vmid
                .map(plan::Machine::Vm)
                .or(n.server.map(plan::Machine::Server)),
            volume: n.volume.clone(),
        })
        .collect();
    plan::Plan {
        format: plan::FORMAT,
        cluster: report.cluster.clone(),
        target: report.target.to_owned(),
        salt: salt.to_owned(),
        observed: plan::Observed::of(
            inv,
            inventory_file,
            vars,
            &plan::fingerprint_key(salt, secret),
            nodes,
        ),
        actions: report
            .plan()
            .into_iter()
            .map(|a| plan::Planned {
                step: a.step,
                node: a.node,
                kind: a.kind,
                destructive: a.destructive,
            })
            .collect(),
    }
}

use std::collections::BTreeMap;
use std::time::Instant;

use crate::build::{self, BuildError, BuildOptions};
use crate::factory::Factory;
use crate::fetch::Progress;
use crate::inventory::Inventory;
use crate::publish::PublishImage;
use crate::publish::hcloud::{self, HcloudError, SnapshotImage, servers};
use crate::publish::proxmox::{self, ProxmoxError, VmChange};
use crate::publish::prune;
use crate::publish::target::{
    ClusterMachine, HcloudTarget, ProxmoxTarget, Target, TargetError, Visitor,
};
use crate::talos::bootstrap;
use crate::talos::client::NodeEndpoint;
use crate::talos::kubernetes::run as kube_run;
use crate::talos::stage::{self, BootstrapOptions, Reach, StageError};
use crate::talos::upgrade::{self, plan::Action as UpAction, report::Ending};
use crate::talos::{apply, etcd, remove};
use actions::{Action, State};
use converge::{ApplySettings, UpgradeSettings};
use plan::{Kind, Step};
use report::changed;

/// What one `up` does besides the target.
#[derive(Clone)]
pub struct UpOptions {
    /// Nodes to build and publish (all when empty). The bootstrap always
    /// covers the whole cluster: health is a cluster-wide fact.
    pub nodes: Vec<String>,
    pub build: BuildOptions,
    pub bootstrap: BootstrapOptions,
    /// How the upgrade step runs (as `imgbuild upgrade` with its defaults).
    pub upgrade: UpgradeSettings,
    /// How the config step runs (as `imgbuild apply`).
    pub apply: ApplySettings,
    /// Carry out destructive actions (remove a node, delete a machine,
    /// prune); without it they are planned and left.
    pub allow_destroy: bool,
    /// Nodes a dry run plans as if their machine were deleted and their
    /// Talos reset first: `replace`'s, whose removal runs before `up`.
    pub recreate: Vec<String>,
}

/// Where each stage reports its progress; the CLI renders it.
#[derive(Clone, Copy)]
pub struct Observers<'a> {
    pub download: &'a dyn Progress,
    pub publish: &'a dyn proxmox::Observer,
    pub hcloud: &'a dyn hcloud::Observer,
    pub bootstrap: &'a dyn bootstrap::Observer,
    /// The steps after the bootstrap: (node or `kubernetes`, what happens).
    pub steps: &'a (dyn Fn(&str, &str) + Sync),
}

/// Runs every stage. Never fails outright: the report says how far it got
/// and, in [`Report::stopped`], which stage stopped it and why.
pub fn up(inv: &Inventory, target: &Target, opts: &UpOptions, obs: Observers<'_>) -> Report {
    let started = Instant::now();
    let mut report = begin(inv, target, opts, false, started);
    if report.stopped.is_some() {
        return report;
    }
    let secrets_file = new_secrets_path(inv, &opts.bootstrap);
    let had_secrets = secrets_file.exists() || stage::sealed_path(inv).exists();
    let mut bootstrap = opts.bootstrap.clone();
    if let Some(cancel) = target.cancel() {
        // The signal handler that lets a snapshot run clean up keeps
        // Ctrl-C from ending the process: the lock wait and the bootstrap
        // must stop on it too.
        bootstrap.cancel = cancel;
    }
    // One run at a time changes this cluster's nodes; taken after the
    // pre-flight check, so an inventory that fails it leaves nothing behind.
    let _lock = match stage::lock_state_dir(inv, &bootstrap, "up") {
        Ok(lock) => lock,
        Err(e) => {
            report.stop(Stage::Bootstrap, UpError::Bootstrap(e));
            return report;
        }
    };
    let mode = Mode::Run(obs);
    let published = build(inv, target, opts, mode, &mut report)
        .and_then(|built| publish(inv, target, opts, built, mode, &mut report));
    bootstrap.limits.leaving = leaving(inv, &bootstrap);
    let done = match published {
        Err((stage, e)) => {
            report.stop(stage, e);
            None
        }
        Ok(reached) => {
            // Apply, bootstrap once, health: each node's readiness as the
            // last health round saw it.
            bootstrap.targets.extend(reached);
            match stage::bootstrap(inv, &bootstrap, obs.bootstrap) {
                Ok(done) => {
                    report.bootstrapped(&done);
                    Some(done)
                }
                Err(e) => {
                    report.stop(Stage::Bootstrap, e.into());
                    None
                }
            }
        }
    };
    // A healthy cluster is converged to the inventory: upgrades,
    // Kubernetes and configs as `upgrade` and `apply` do them; what still
    // differs afterwards is reported as `imgbuild status` flags it.
    if let Some(done) = done
        && report.healthy
    {
        let day2 = DayTwo {
            inv,
            target,
            opts,
            bootstrap: &bootstrap,
            prepared: &done.prepared,
            select: Vec::new(),
            dry_run: false,
            upgrade: snapshotting(&opts.upgrade, inv, &done.prepared),
        };
        match day2.converge(&mut report, obs.steps) {
            Ok(()) => report.drifted(stage::drift(inv, &done.prepared, &bootstrap)),
            Err((stage, e)) => report.stop(stage, e),
        }
    }
    if !had_secrets && secrets_file.exists() {
        report.warnings.push(format!(
            "made the cluster's secrets (--new-secrets): {}; keep them in Git with `imgbuild secrets encrypt --age …`",
            secrets_file.display()
        ));
    }
    report.elapsed_ms = started.elapsed().as_millis();
    report
}

/// The dry run: what `up` would build, upload, create, start, apply and
/// bootstrap. Reads the manifest, sends GETs to the target and probes each
/// node's TLS; builds nothing, writes nothing, changes nothing anywhere.
pub fn plan(inv: &Inventory, target: &Target, opts: &UpOptions) -> Report {
    let started = Instant::now();
    let mut report = begin(inv, target, opts, true, started);
    if report.stopped.is_some() {
        return report;
    }
    let planned = build(inv, target, opts, Mode::Plan, &mut report)
        .and_then(|built| publish(inv, target, opts, built, Mode::Plan, &mut report));
    let mut bootstrap = opts.bootstrap.clone();
    bootstrap.limits.leaving = leaving(inv, &bootstrap);
    match planned {
        Ok(reached) => bootstrap.targets.extend(reached),
        Err((stage, e)) => report.stop(stage, e),
    }
    // Without a runtime to probe on, the nodes' Talos state stays unknown.
    if let Ok(survey) = stage::survey(inv, &bootstrap) {
        report.surveyed(&survey);
    }
    // A node `replace` resets comes back in maintenance mode, on a new
    // machine: it gets its first config.
    for name in &opts.recreate {
        if let Some(n) = report.node(name) {
            n.talos = Some(TalosState::Maintenance);
            n.stages.apply = Some(Change::Applied);
        }
    }
    // The day-two steps over the nodes that run Talos configured already
    // (the others get the inventory's version and config when they come
    // up), when the cluster has a state dir: a dry run creates none.
    let configured: Vec<String> = report
        .nodes
        .iter()
        .filter(|n| n.talos == Some(TalosState::Configured))
        .map(|n| n.node.clone())
        .collect();
    let existing = (report.stopped.is_none() && !configured.is_empty())
        .then(|| stage::StateDir::existing(inv, bootstrap.state_dir.as_deref()).ok())
        .flatten();
    if let Some(state_dir) = existing {
        // A dry run sends no config: unset `${NAME}`s need not be given.
        bootstrap.patch_vars = bootstrap.patch_vars.clone().comparing_unset();
        let select = if configured.len() + opts.recreate.len() >= inv.nodes.len() {
            Vec::new()
        } else {
            configured
        };
        let planned = stage::prepare_in(inv, &bootstrap, state_dir)
            .map_err(|e| (Stage::Upgrade, UpError::Bootstrap(e)))
            .and_then(|prepared| {
                let day2 = DayTwo {
                    inv,
                    target,
                    opts,
                    bootstrap: &bootstrap,
                    prepared: &prepared,
                    select,
                    dry_run: true,
                    upgrade: snapshotting(&opts.upgrade, inv, &prepared),
                };
                day2.converge(&mut report, &|_: &str, _: &str| {})
            });
        if let Err((stage, e)) = planned {
            report.stop(stage, e);
        }
    }
    report.elapsed_ms = started.elapsed().as_millis();
    report
}

/// The steps after the bootstrap, over a cluster that exists: the upgrade
/// (Talos, then Kubernetes), then configs, each the library call its own
/// command makes ([`converge`]); in a dry run only their plans.
struct DayTwo<'a> {
    inv: &'a Inventory,
    target: &'a Target,
    opts: &'a UpOptions,
    bootstrap: &'a BootstrapOptions,
    prepared: &'a stage::Prepared,
    /// The nodes to converge (all when empty; Kubernetes, removal and
    /// prune only then), or for [`replace`] the nodes to remove.
    select: Vec<String>,
    dry_run: bool,
    /// As `opts.upgrade`, with the run's etcd snapshot in the state dir.
    upgrade: UpgradeSettings,
}

impl DayTwo<'_> {
    /// Runs (or plans) every step in order, recording each action; stops
    /// at the first step that fails.
    fn converge(
        &self,
        report: &mut Report,
        progress: &(dyn Fn(&str, &str) + Sync),
    ) -> Result<(), Stopped> {
        let at = |stage: Stage| move |e: StageError| (stage, UpError::Bootstrap(e));
        let differences =
            stage::drift(self.inv, self.prepared, self.bootstrap).map_err(at(Stage::Upgrade))?;
        let chosen = |node: &str| self.select.is_empty() || self.select.iter().any(|s| s == node);
        let differs = |what: &[&str]| {
            differences
                .drift
                .iter()
                .any(|d| chosen(&d.node) && what.contains(&d.what))
        };
        let upgraded = if differs(&["version", "schematic"]) {
            self.snapshotted(report, Step::Upgrade, |r| self.upgrade(r, progress))?
        } else {
            self.kubernetes(report, progress)?;
            Vec::new()
        };
        if differs(&["config"]) || !upgraded.is_empty() {
            self.snapshotted(report, Step::Configs, |r| self.configs(r, &upgraded))?;
        }
        self.settings(report, progress)?;
        // Destructive steps go over the whole cluster only.
        if self.select.is_empty() {
            let removed = self.snapshotted(report, Step::Remove, |r| self.remove(r, progress))?;
            self.prune(report, removed)?;
        }
        Ok(())
    }

    /// Each VM's settings (cores, memory, disks, network) as the
    /// inventory has them, read again now and changed where they differ,
    /// a VM that needs it rebooted, one at a time: after the configs, as
    /// the plan puts it.
    fn settings(
        &self,
        report: &mut Report,
        progress: &(dyn Fn(&str, &str) + Sync),
    ) -> Result<(), Stopped> {
        let chosen: Vec<usize> = (0..self.inv.nodes.len())
            .filter(|&i| self.select.is_empty() || self.select.contains(&self.inv.nodes[i].name))
            .collect();
        let observer = SettingsProgress(progress);
        let found = self
            .target
            .change_settings(self.inv, &chosen, &observer, self.dry_run)
            .map_err(|e| (Stage::Settings, UpError::Proxmox(e)))?;
        let mut failed = Vec::new();
        let mut done_any = false;
        for r in found {
            match r {
                Ok(ns) => {
                    let kind = Kind::ChangeSettings {
                        settings: ns
                            .changes
                            .iter()
                            .map(|c| plan::Setting {
                                field: c.field.clone(),
                                from: c.from.clone(),
                                to: c.to.clone(),
                            })
                            .collect(),
                    };
                    let outcome = if self.dry_run {
                        State::Planned
                    } else {
                        done_any = true;
                        State::Done
                    };
                    let mut a =
                        Action::new(kind, Some(&ns.node), "change VM settings").outcome(outcome);
                    for c in &ns.changes {
                        a = a.change(&c.field, Some(&c.from), Some(&c.to));
                    }
                    let how: Vec<String> = ns.changes.iter().map(ToString::to_string).collect();
                    report.act(a.detail(how.join("; ")));
                }
                Err(e) => {
                    let node = match &e {
                        ProxmoxError::Node { node, .. } => node.clone(),
                        _ => String::new(),
                    };
                    let kind = Kind::ChangeSettings {
                        settings: Vec::new(),
                    };
                    report.act(
                        Action::new(kind, Some(&node), "change VM settings")
                            .detail(e.to_string())
                            .outcome(State::Failed),
                    );
                    failed.push(e.to_string());
                }
            }
        }
        match failed.first() {
            None => Ok(()),
            Some(why) => Err(step_failed(Stage::Settings, why.clone(), done_any)),
        }
    }

    /// Whether the destructive actions planned are carried out now.
    fn destroying(&self) -> bool {
        self.opts.allow_destroy && !self.dry_run
    }

    /// A destructive action as this run leaves it: planned in a dry run,
    /// left without `--allow-destroy`.
    fn held(&self, action: Action) -> Action {
        let outcome = if self.dry_run {
            State::Planned
        } else {
            State::Left
        };
        action.destructive().outcome(outcome)
    }

    /// The etcd snapshot taken before this run's first control-plane
    /// change (one per run, however many steps ask).
    fn etcd(&self) -> &etcd::BeforeChange {
        &self.upgrade.run.etcd
    }

    /// In a dry run, the etcd snapshot the run takes before step `before`
    /// when that step `changes_control_plane` (once per run, and never
    /// when the run goes without).
    fn snapshot_ahead(&self, report: &mut Report, before: Step, changes_control_plane: bool) {
        let planned = report
            .actions
            .iter()
            .any(|a| matches!(a.kind, Kind::SnapshotEtcd { .. }));
        if self.dry_run && changes_control_plane && !planned && !self.etcd().skipped() {
            report.act(snapshot_action(before, self.etcd().dir()));
        }
    }

    /// Runs `step`; when it took the run's etcd snapshot, records that
    /// before the step's own actions, where the dry run plans it.
    fn snapshotted<T>(
        &self,
        report: &mut Report,
        before: Step,
        step: impl FnOnce(&mut Report) -> Result<T, Stopped>,
    ) -> Result<T, Stopped> {
        let mark = report.actions.len();
        let had = self.dry_run || self.etcd().taken().is_some();
        let result = step(report);
        if !had && let Some(file) = self.etcd().taken() {
            report.actions.insert(
                mark,
                snapshot_action(before, Some(&file.path)).outcome(State::Done),
            );
        }
        result
    }

    /// Takes the run's etcd snapshot unless it was taken: before the
    /// first control-plane change.
    fn snapshot_etcd(&self, stage: Stage, change: &str) -> Result<(), Stopped> {
        let taken = converge::runtime()
            .map_err(|e| (stage, UpError::Converge(Box::new(e))))?
            .block_on(etcd::snapshot_before_change(
                self.etcd(),
                &self.prepared.plan,
                self.limits(),
            ));
        taken.map(|_| ()).map_err(|e| {
            step_failed(
                stage,
                format!("the etcd snapshot before the first control-plane {change} failed, so nothing was changed: {e}"),
                false,
            )
        })
    }

    /// Nodes gone from the inventory, found in the state dir's record of
    /// the cluster's nodes or by imgbuild's marker on their machine (a
    /// Proxmox VM's description, a Hetzner server's labels): drained,
    /// reset and deleted from Kubernetes (and etcd), then their machine
    /// and its volumes deleted. Returns the names removed (or planned).
    fn remove(
        &self,
        report: &mut Report,
        progress: &(dyn Fn(&str, &str) + Sync),
    ) -> Result<Vec<String>, Stopped> {
        let at = |e: remove::RemoveError| (Stage::Remove, UpError::Remove(Box::new(e)));
        let chosen = |node: &str| self.select.is_empty() || self.select.iter().any(|s| s == node);
        let mut removed =
            remove::removed_nodes(self.inv, &self.prepared.state_dir.path).map_err(at)?;
        removed.retain(|r| chosen(&r.name));
        let mut machines = self.machines_gone()?;
        machines.retain(|m| chosen(&m.node));
        for m in &machines {
            remove::add_found(
                &mut removed,
                remove::RemovedNode::on_platform(&m.node, None),
            );
        }
        let limits = self.limits();
        // The record is a cache: the cluster's own nodes name the rest.
        let view = remove::survey_with_cluster(self.inv, self.prepared, &mut removed, limits)
            .map_err(at)?;
        removed.retain(|r| chosen(&r.name));
        if removed.is_empty() {
            return Ok(Vec::new());
        }
        let plan = remove::plan(self.inv, &removed, &view).map_err(at)?;
        report.warnings.extend(plan.warnings.iter().cloned());
        let mut actions: Vec<(Action, Option<String>)> = Vec::new();
        for n in &plan.nodes {
            let steps: Vec<String> = n.steps.iter().map(ToString::to_string).collect();
            let role = match n.role {
                crate::inventory::Role::Controlplane => "controlplane",
                _ => "worker",
            };
            let mut a = Action::new(
                Kind::RemoveNode { role: n.role },
                Some(&n.node),
                "remove from the cluster",
            )
            .change("role", Some(role), None)
            .detail(format!("{}; {}", steps.join(", "), n.identity_check()));
            if let Some(addr) = n.address {
                a = a.change("address", Some(&addr.to_string()), None);
            }
            actions.push((self.held(a), None));
        }
        let names: Vec<String> = removed.iter().map(|r| r.name.clone()).collect();
        for m in &machines {
            let detail = if m.volumes.is_empty() {
                String::new()
            } else {
                format!("volumes {}", m.volumes.join(", "))
            };
            let kind = Kind::DeleteMachine {
                machine: m.what.clone(),
                volumes: m.volumes.clone(),
            };
            let mut a = Action::new(kind, Some(&m.node), &format!("delete {}", m.what)).change(
                "machine",
                Some(&m.what),
                None,
            );
            if !detail.is_empty() {
                a = a.detail(detail);
            }
            actions.push((self.held(a), Some(m.node.clone())));
        }
        let removes_a_control_plane = plan
            .nodes
            .iter()
            .any(|n| n.role == crate::inventory::Role::Controlplane);
        if !self.destroying() {
            self.snapshot_ahead(
                report,
                Step::Remove,
                self.opts.allow_destroy && removes_a_control_plane,
            );
            report.actions.extend(actions.into_iter().map(|(a, _)| a));
            return Ok(names);
        }
        if removes_a_control_plane {
            self.snapshot_etcd(Stage::Remove, "removal")?;
        }
        let options = remove::RemoveOptions {
            limits: limits.clone(),
            ..remove::RemoveOptions::default()
        };
        let observer = |node: &str, event: &remove::Event| {
            if let remove::Event::Started(step) = event {
                progress(node, &step.to_string());
            }
        };
        let done = remove::remove(self.prepared, &plan, &options, &observer).map_err(at)?;
        let removed_now: Vec<&str> = done
            .nodes
            .iter()
            .filter(|n| n.removed)
            .map(|n| n.node.as_str())
            .collect();
        // A machine goes once its node left the cluster (or was never in it).
        let talos_done =
            |node: &str| removed_now.contains(&node) || !plan.nodes.iter().any(|n| n.node == node);
        let mut failure = done.failed.as_ref().map(|f| f.to_string());
        for (mut a, machine) in actions {
            let node = a.node.clone().unwrap_or_default();
            a.outcome = match &machine {
                None if removed_now.contains(&node.as_str()) => State::Done,
                // Only the node the removal stopped at failed; the ones
                // after it were never tried.
                None if done.failed.as_ref().is_some_and(|f| f.node == node) => State::Failed,
                None => State::NotReached,
                Some(_)
                    if !talos_done(&node)
                        || failure.is_some() && !removed_now.contains(&node.as_str()) =>
                {
                    State::NotReached
                }
                Some(node) => match self.delete_machine(node, &machines, progress) {
                    Ok(()) => State::Done,
                    Err(e) => {
                        let e = e.to_string();
                        a.detail = Some(e.clone());
                        failure.get_or_insert(e);
                        State::Failed
                    }
                },
            };
            report.act(a);
        }
        match failure {
            None => Ok(names),
            Some(message) => Err(step_failed(Stage::Remove, message, !removed_now.is_empty())),
        }
    }

    /// The machines imgbuild made for this cluster whose node the
    /// inventory no longer has (never one without imgbuild's marker).
    fn machines_gone(&self) -> Result<Vec<ClusterMachine>, Stopped> {
        let known = |node: &str| self.inv.nodes.iter().any(|n| n.name == node);
        let mut machines = self
            .target
            .machines(&self.inv.cluster.name)
            .map_err(|e| (Stage::Remove, target_error(e)))?;
        machines.retain(|m| !known(&m.node));
        Ok(machines)
    }

    /// Deletes the machine of removed `node` with its volumes, as `imgbuild
    /// down` deletes each.
    fn delete_machine(
        &self,
        node: &str,
        machines: &[ClusterMachine],
        progress: &(dyn Fn(&str, &str) + Sync),
    ) -> Result<(), MachineError> {
        for m in machines.iter().filter(|m| m.node == node) {
            progress(node, &format!("deleting {}", m.what));
            self.target.delete_machine(&self.inv.cluster.name, m)?;
        }
        Ok(())
    }

    /// What imgbuild made for the cluster and nothing uses any more (as
    /// `imgbuild prune`): each volume or snapshot to delete, by name.
    fn prune(&self, report: &mut Report, former_nodes: Vec<String>) -> Result<(), Stopped> {
        let at = |e: prune::PruneError| (Stage::Prune, UpError::Prune(Box::new(e)));
        let delete = self.target.delete_options();
        let scope = prune::PruneScope {
            inv: self.inv,
            target: self.target,
            keep: PRUNE_KEEP,
            cache: None,
            former_nodes,
            delete,
        };
        let plan = prune::plan(&scope).map_err(at)?;
        let action = |p: &prune::Pruned| {
            let size = p.item.size().map(|s| format!("{s} bytes"));
            let kind = Kind::Prune {
                item: p.item.name().to_string(),
            };
            let mut a = Action::new(kind, None, &format!("delete {}", p.item.name())).change(
                "exists",
                Some("yes"),
                None,
            );
            if let Some(size) = size {
                a = a.detail(size);
            }
            a
        };
        if !self.destroying() {
            for p in &plan.delete {
                report.act(self.held(action(p)));
            }
            // What the removal's deletions free is pruned in the same run:
            // planned here, not found only afterwards.
            for name in self.freed_by_removal(&scope.former_nodes)? {
                let kind = Kind::Prune { item: name.clone() };
                let a = Action::new(kind, None, &format!("delete {name}"))
                    .change("exists", Some("yes"), None)
                    .detail("once the removal deleted its VM");
                report.act(self.held(a));
            }
            return Ok(());
        }
        let done = prune::prune(&scope, &plan);
        for p in &done.deleted {
            report.act(action(p).destructive().outcome(State::Done));
        }
        for (p, why) in &done.failed {
            report.act(
                action(p)
                    .destructive()
                    .outcome(State::Failed)
                    .detail(why.clone()),
            );
        }
        match done.failed.first() {
            None => Ok(()),
            Some((p, why)) => Err(step_failed(
                Stage::Prune,
                format!("{}: {why}", p.item.name()),
                !done.deleted.is_empty(),
            )),
        }
    }

    /// The uploads of removed nodes that only the VMs the removal
    /// deletes use, named as the prune names them: unused once it ran.
    fn freed_by_removal(&self, former: &[String]) -> Result<Vec<String>, Stopped> {
        if former.is_empty() {
            return Ok(Vec::new());
        }
        let deleted: Vec<u32> = self
            .machines_gone()?
            .iter()
            .filter_map(ClusterMachine::vmid)
            .collect();
        let nodes: std::collections::BTreeSet<String> = former.iter().cloned().collect();
        self.target
            .freed_by(&self.inv.cluster.name, &nodes, &deleted)
            .map_err(|e| (Stage::Prune, target_error(e)))
    }

    fn limits(&self) -> &bootstrap::Options {
        &self.bootstrap.limits
    }

    /// Talos version and schematic, node by node, then Kubernetes: as
    /// `imgbuild upgrade`. Returns the nodes planned for an upgrade (whose
    /// config the upgrade applies).
    fn upgrade(
        &self,
        report: &mut Report,
        progress: &(dyn Fn(&str, &str) + Sync),
    ) -> Result<Vec<String>, Stopped> {
        let at = |e: converge::ConvergeError| (Stage::Upgrade, UpError::Converge(Box::new(e)));
        let fetch = &self.opts.build.fetch;
        let client = crate::fetch::client(fetch);
        let factory =
            Factory::new(&self.inv.image.factory, &client).with_retry(fetch.retry_policy());
        let targets = upgrade::targets(self.inv, &factory)
            .map_err(|e| at(converge::ConvergeError::from(e)))?;
        let planned = converge::upgrade_plan(
            self.inv,
            &factory,
            &targets,
            self.prepared,
            &self.select,
            &self.upgrade,
            self.limits(),
        )
        .map_err(at)?;
        let actions = actions::talos_actions(&planned.talos);
        let carried = self.carried_configs(&planned)?;
        let actions = with_configs(actions, &carried, &self.prepared.plan);
        let kube_action = planned
            .kube
            .as_ref()
            .and_then(|(_, k)| actions::kube_action(k));
        let sync = planned
            .kube
            .as_ref()
            .and_then(|(_, k)| actions::sync_action(k));
        let mut nodes: Vec<String> = actions.iter().filter_map(|a| a.node.clone()).collect();
        nodes.dedup();
        if let Some(r) = planned.refusal() {
            report.actions.extend(actions);
            report.actions.extend(kube_action);
            return Err((
                Stage::Upgrade,
                UpError::Refused {
                    stage: Stage::Upgrade,
                    why: r,
                },
            ));
        }
        if self.dry_run {
            let touches_control_plane = planned
                .talos
                .nodes
                .iter()
                .any(|n| n.control_plane && n.action == UpAction::Upgrade);
            self.snapshot_ahead(report, Step::Upgrade, touches_control_plane);
            report.actions.extend(actions);
            report.actions.extend(kube_action);
            report.actions.extend(sync);
            return Ok(nodes);
        }
        // A change Talos takes only with a reboot is staged first: the
        // upgrade's reboot boots it, and its last step (the rendered config
        // without a reboot) then finds it there.
        self.stage_rebooting(&carried, progress)?;
        let say = |what: &str| progress("kubernetes", what);
        let done = converge::run_upgrade(
            self.inv,
            &factory,
            self.prepared,
            planned,
            &self.upgrade,
            self.limits(),
            progress,
            &say,
        )
        .map_err(at)?;
        for mut a in actions {
            let node = a.node.clone().unwrap_or_default();
            let config = matches!(a.kind, Kind::ApplyConfig { .. });
            a.outcome = match &done.talos.failed {
                // The config is the node's last step: failed only when
                // that step failed, else never reached.
                Some(f) if f.node == node && config && !f.error.starts_with(CONFIG_STEP) => {
                    State::NotReached
                }
                Some(f) if f.node == node => {
                    a.detail = Some(f.error.clone());
                    State::Failed
                }
                _ if done.talos.untouched.contains(&node) => State::NotReached,
                _ => State::Done,
            };
            report.act(a);
        }
        if let Some(mut a) = kube_action {
            a.outcome = match done.kube.as_ref().map(|k| k.ending()) {
                Some(Ending::Ok) => State::Done,
                Some(_) => State::Failed,
                None => State::NotReached,
            };
            report.act(a);
        }
        if let Some(mut a) = sync {
            synced(&mut a, done.kube.as_ref());
            report.act(a);
        }
        match done.ending() {
            Ending::Ok => Ok(nodes),
            Ending::Failed(message) => Err(step_failed(Stage::Upgrade, message, false)),
            Ending::Partial(message) => Err(step_failed(Stage::Upgrade, message, true)),
        }
    }

    /// The config change each node planned for an upgrade carries: its
    /// upgrade's last step applies the rendered config (which names the new
    /// installer, and any patch edit). Talos does not rewrite a node's config
    /// when it upgrades, so what the node reports now is what it reports
    /// after its upgrade: the node's own dry run says whether (and how) the
    /// config changes. Compared the same way in a dry run and a run.
    fn carried_configs(
        &self,
        planned: &converge::UpgradePlanned,
    ) -> Result<apply::ApplyOutcome, Stopped> {
        let upgrading: Vec<String> = planned
            .talos
            .nodes
            .iter()
            .filter(|n| n.action == UpAction::Upgrade)
            .map(|n| n.node.clone())
            .collect();
        if upgrading.is_empty() || planned.refusal().is_some() {
            return Ok(apply::ApplyOutcome::default());
        }
        let compare = converge::ApplySettings {
            mode: crate::talos::client::ApplyMode::Auto,
            ..self.opts.apply.clone()
        };
        let carried = converge::apply_configs(
            self.inv,
            self.prepared,
            &upgrading,
            &compare,
            true,
            &self.bootstrap.patch_vars,
            self.limits(),
        )
        .map_err(|e| (Stage::Upgrade, UpError::Converge(Box::new(e))))?;
        match carried.failed.first() {
            None => Ok(carried),
            Some(f) => Err(step_failed(
                Stage::Upgrade,
                format!(
                    "node {}: comparing its config before its upgrade: {}",
                    f.node, f.error
                ),
                false,
            )),
        }
    }

    /// Stages the carried configs that take a reboot (see
    /// [`Self::carried_configs`]), before any node upgrades.
    fn stage_rebooting(
        &self,
        carried: &apply::ApplyOutcome,
        progress: &(dyn Fn(&str, &str) + Sync),
    ) -> Result<(), Stopped> {
        let rebooting: Vec<String> = carried
            .nodes
            .iter()
            .filter(|n| n.changed && n.needs_reboot)
            .map(|n| n.node.clone())
            .collect();
        if rebooting.is_empty() {
            return Ok(());
        }
        for node in &rebooting {
            progress(node, "staging its new config for the upgrade's reboot");
        }
        let staged = converge::ApplySettings {
            mode: crate::talos::client::ApplyMode::Staged,
            ..self.opts.apply.clone()
        };
        let outcome = converge::apply_configs(
            self.inv,
            self.prepared,
            &rebooting,
            &staged,
            false,
            &self.bootstrap.patch_vars,
            self.limits(),
        )
        .map_err(|e| (Stage::Upgrade, UpError::Converge(Box::new(e))))?;
        match outcome.failed.first() {
            None => Ok(()),
            Some(f) => Err(step_failed(
                Stage::Upgrade,
                format!(
                    "node {}: staging its config before its upgrade: {}",
                    f.node, f.error
                ),
                false,
            )),
        }
    }

    /// The cluster's Kubernetes version when no Talos node moves: as the
    /// Kubernetes part of `imgbuild upgrade`.
    fn kubernetes(
        &self,
        report: &mut Report,
        progress: &(dyn Fn(&str, &str) + Sync),
    ) -> Result<(), Stopped> {
        if !self.select.is_empty() {
            return Ok(());
        }
        let (seen, k) = converge::kubernetes_plan(
            self.inv,
            &self.prepared.plan,
            &BTreeMap::new(),
            &self.upgrade,
            self.limits(),
        );
        let Some(mut action) = actions::kube_action(&k) else {
            return Ok(());
        };
        let sync = actions::sync_action(&k);
        if let Some(r) = &k.refusal {
            report.act(action);
            let why = format!("kubernetes {}: {r}", k.to);
            return Err((
                Stage::Kubernetes,
                UpError::Refused {
                    stage: Stage::Kubernetes,
                    why,
                },
            ));
        }
        if self.dry_run {
            report.act(action);
            report.actions.extend(sync);
            return Ok(());
        }
        let say = |what: &str| progress("kubernetes", what);
        let done = kube_run::execute(
            &self.prepared.plan,
            &k,
            &seen,
            self.limits(),
            &self.upgrade.kube,
            &say,
        );
        let ending = done.ending();
        action.outcome = if ending == Ending::Ok {
            State::Done
        } else {
            State::Failed
        };
        report.act(action);
        if let Some(mut a) = sync {
            synced(&mut a, Some(&done));
            report.act(a);
        }
        match ending {
            Ending::Ok => Ok(()),
            Ending::Failed(m) => Err(step_failed(Stage::Kubernetes, m, false)),
            Ending::Partial(m) => Err(step_failed(Stage::Kubernetes, m, true)),
        }
    }

    /// Whether a control plane's config change takes a reboot (asked with
    /// the apply's own dry run).
    fn reboots_a_control_plane(&self) -> Result<bool, Stopped> {
        let cps: Vec<String> = self
            .prepared
            .plan
            .nodes
            .iter()
            .filter(|n| n.role == crate::inventory::Role::Controlplane)
            .filter(|n| self.select.is_empty() || self.select.contains(&n.name))
            .map(|n| n.name.clone())
            .collect();
        if cps.is_empty() {
            return Ok(false);
        }
        let compared = converge::apply_configs(
            self.inv,
            self.prepared,
            &cps,
            &self.opts.apply,
            true,
            &self.bootstrap.patch_vars,
            self.limits(),
        )
        .map_err(|e| (Stage::Configs, UpError::Converge(Box::new(e))))?;
        Ok(compared.nodes.iter().any(|n| n.changed && n.needs_reboot))
    }

    /// Each node's machine config: as `imgbuild apply` (live where Talos
    /// can, else a reboot one node at a time). Nodes `upgraded` had theirs
    /// applied by the upgrade; a dry run does not list them twice.
    fn configs(&self, report: &mut Report, upgraded: &[String]) -> Result<(), Stopped> {
        if !self.dry_run && self.reboots_a_control_plane()? {
            self.snapshot_etcd(Stage::Configs, "config change")?;
        }
        let outcome = converge::apply_configs(
            self.inv,
            self.prepared,
            &self.select,
            &self.opts.apply,
            self.dry_run,
            &self.bootstrap.patch_vars,
            self.limits(),
        )
        .map_err(|e| (Stage::Configs, UpError::Converge(Box::new(e))))?;
        let control_plane = |node: &str| {
            self.prepared
                .plan
                .nodes
                .iter()
                .any(|p| p.name == node && p.role == crate::inventory::Role::Controlplane)
        };
        let reboots_a_control_plane = outcome.nodes.iter().any(|n| {
            n.changed && n.needs_reboot && control_plane(&n.node) && !upgraded.contains(&n.node)
        });
        self.snapshot_ahead(report, Step::Configs, reboots_a_control_plane);
        for n in outcome.nodes.iter().filter(|n| n.changed) {
            if self.dry_run && upgraded.contains(&n.node) {
                continue;
            }
            let rendered = self
                .prepared
                .plan
                .nodes
                .iter()
                .find(|p| p.name == n.node)
                .map_or(&[][..], |p| p.config.as_slice());
            let fields = apply::changed_fields(&n.diff, rendered);
            let what = match (n.needs_reboot, n.staged) {
                (_, true) => "config staged, applies at the next reboot",
                (true, _) => "apply config (with a reboot)",
                (false, _) => "apply config",
            };
            let outcome = if self.dry_run || n.staged {
                State::Planned
            } else if n.applied {
                State::Done
            } else {
                State::NotReached
            };
            let kind = Kind::ApplyConfig {
                reboot: n.needs_reboot,
                staged: n.staged,
            };
            report.act(
                Action::new(kind, Some(&n.node), what)
                    .detail(actions::diff_summary(&n.diff, &fields))
                    .outcome(outcome),
            );
        }
        for f in &outcome.failed {
            report.act(
                Action::new(
                    Kind::ApplyConfig {
                        reboot: false,
                        staged: false,
                    },
                    Some(&f.node),
                    "apply config",
                )
                .detail(f.error.clone())
                .outcome(State::Failed),
            );
        }
        if let Some(r) = outcome.refused {
            return Err((
                Stage::Configs,
                UpError::Refused {
                    stage: Stage::Configs,
                    why: r,
                },
            ));
        }
        if outcome.failed.is_empty() {
            return Ok(());
        }
        let names: Vec<&str> = outcome.failed.iter().map(|f| f.node.as_str()).collect();
        let partial = outcome.nodes.iter().any(|n| n.applied);
        Err(step_failed(
            Stage::Configs,
            format!("apply failed on {}", names.join(", ")),
            partial,
        ))
    }
}

/// The settings step's Proxmox events as the run's progress lines.
struct SettingsProgress<'a>(&'a (dyn Fn(&str, &str) + Sync));

impl proxmox::Observer for SettingsProgress<'_> {
    fn event(&self, node: &str, event: &proxmox::Event) {
        match event {
            proxmox::Event::VmSetting { vmid, change } => {
                (self.0)(node, &format!("VM {vmid}: {change}"));
            }
            proxmox::Event::VmRebooted { vmid } => {
                (self.0)(node, &format!("VM {vmid} rebooted for its new settings"));
            }
            _ => {}
        }
    }
}

/// The control planes of record the inventory no longer has: etcd lists
/// them until the removal step, so the health check lets them be.
fn leaving(inv: &Inventory, opts: &BootstrapOptions) -> Vec<String> {
    let dir = stage::state_path(inv, opts.state_dir.as_deref());
    remove::removed_nodes(inv, &dir)
        .map(|removed| {
            removed
                .into_iter()
                .filter(|r| r.role == Some(crate::inventory::Role::Controlplane))
                .map(|r| r.name)
                .collect()
        })
        .unwrap_or_default()
}

/// The upgrade settings of a run over `prepared`'s cluster: the etcd
/// snapshot before its first control-plane change goes where the user said
/// (`--etcd-snapshot-dir`, `cluster.etcdSnapshotDir`), else into the state
/// dir.
fn snapshotting(
    settings: &UpgradeSettings,
    inv: &Inventory,
    prepared: &stage::Prepared,
) -> UpgradeSettings {
    let mut out = settings.clone();
    out.run.etcd = std::sync::Arc::new(etcd::BeforeChange::new(
        etcd::SnapshotOptions::before_change(
            &prepared.state_dir.path,
            inv,
            settings.etcd_snapshot_dir.as_deref(),
        ),
    ));
    out
}

/// How a node's upgrade names a failure of its last step, the config
/// (`NodeUpgradeError::Configure`).
const CONFIG_STEP: &str = "applying the rendered config after the upgrade";

/// The upgrade's actions with each node's carried config change right
/// after its upgrade, where the run applies it (in the upgrade step).
fn with_configs(
    actions: Vec<Action>,
    carried: &apply::ApplyOutcome,
    plan: &bootstrap::Plan,
) -> Vec<Action> {
    let mut out = Vec::with_capacity(actions.len() + carried.nodes.len());
    for a in actions {
        let config = a
            .node
            .as_ref()
            .and_then(|node| carried.nodes.iter().find(|n| n.changed && &n.node == node));
        let node = a.node.clone();
        out.push(a);
        if let Some(n) = config {
            let what = if n.needs_reboot {
                "config staged before the upgrade, booted by its reboot"
            } else {
                "config applied after the upgrade"
            };
            let c = Action::new(
                Kind::ApplyConfig {
                    reboot: n.needs_reboot,
                    staged: false,
                },
                node.as_deref(),
                what,
            );
            let rendered = plan
                .nodes
                .iter()
                .find(|p| p.name == n.node)
                .map_or(&[][..], |p| p.config.as_slice());
            let fields = apply::changed_fields(&n.diff, rendered);
            let mut c = c.detail(actions::diff_summary(&n.diff, &fields));
            c.step = Step::Upgrade;
            out.push(c);
        }
    }
    out
}

/// How many of the newest unused volumes or snapshots per node and base a
/// prune keeps (as `imgbuild prune` by default): one to go back to.
const PRUNE_KEEP: usize = 1;

/// The run's etcd snapshot, before the first control-plane change of
/// step `before`.
fn snapshot_action(before: Step, into: Option<&std::path::Path>) -> Action {
    let into = into.map_or_else(|| "the state dir".to_owned(), |d| d.display().to_string());
    Action::new(Kind::SnapshotEtcd { before }, None, "etcd snapshot").detail(format!(
        "into {into}, before the first control-plane change"
    ))
}

/// How a run's Kubernetes report left the manifest sync `a` (its detail
/// is the step as the run names it).
fn synced(a: &mut Action, done: Option<&kube_run::KubeReport>) {
    let step = a.detail.clone().unwrap_or_default();
    a.outcome = match done {
        Some(k) if k.done.contains(&step) => State::Done,
        Some(k) if k.failed.as_ref().is_some_and(|f| f.step == step) => State::Failed,
        _ => State::NotReached,
    };
}

/// A target's error as `up`'s.
fn target_error(e: TargetError) -> UpError {
    match e {
        TargetError::Setup(why) => UpError::Setup(why),
        TargetError::Proxmox(e) => UpError::Proxmox(e),
        TargetError::Hcloud(e) => UpError::Hcloud(e),
    }
}

fn step_failed(stage: Stage, message: String, partial: bool) -> Stopped {
    (
        stage,
        UpError::Step {
            stage,
            message,
            partial,
        },
    )
}

/// `imgbuild replace NODE…`: each node is removed as a node gone from the
/// inventory is (drained, out of etcd, reset, its Kubernetes Node, machine
/// and volumes deleted), then `up` creates it again under the same name:
/// for a changed address or a broken disk. The removal is the destructive
/// step the command asks for, so it needs no `--allow-destroy`; the rest
/// of the run is `up`'s. A dry run shows the removal, then what `up` plans.
pub fn replace(
    inv: &Inventory,
    target: &Target,
    opts: &UpOptions,
    nodes: &[String],
    obs: Option<Observers<'_>>,
) -> Report {
    let started = Instant::now();
    let dry_run = obs.is_none();
    let mut report = begin(inv, target, opts, dry_run, started);
    if report.stopped.is_some() {
        return report;
    }
    // The cluster as it is without them: what the removal compares with.
    let mut without = inv.clone();
    without.nodes.retain(|n| !nodes.contains(&n.name));
    let removal = {
        let _lock = match (!dry_run).then(|| stage::lock_state_dir(inv, &opts.bootstrap, "replace"))
        {
            Some(Err(e)) => {
                report.stop(Stage::Remove, UpError::Bootstrap(e));
                return report;
            }
            lock => lock,
        };
        let mut bootstrap = opts.bootstrap.clone();
        bootstrap.limits.leaving = nodes.to_vec();
        if let Some(cancel) = target.cancel() {
            bootstrap.cancel = cancel;
        }
        let opts = UpOptions {
            allow_destroy: true,
            ..opts.clone()
        };
        stage::StateDir::existing(inv, bootstrap.state_dir.as_deref())
            .and_then(|state_dir| stage::prepare_in(&without, &bootstrap, state_dir))
            .map_err(|e| (Stage::Remove, UpError::Bootstrap(e)))
            .and_then(|prepared| {
                let upgrade = if dry_run {
                    opts.upgrade.clone()
                } else {
                    snapshotting(&opts.upgrade, inv, &prepared)
                };
                let day2 = DayTwo {
                    inv: &without,
                    target,
                    opts: &opts,
                    bootstrap: &bootstrap,
                    prepared: &prepared,
                    select: nodes.to_vec(),
                    dry_run,
                    upgrade,
                };
                let quiet = |_: &str, _: &str| {};
                day2.remove(&mut report, obs.map_or(&quiet, |o| o.steps))
            })
    };
    let removal_actions = std::mem::take(&mut report.actions);
    if let Err((stage, e)) = removal {
        report.actions = removal_actions;
        report.stop(stage, e);
        return report;
    }
    let mut done = match obs {
        Some(obs) => up(inv, target, opts, obs),
        None => {
            let opts = UpOptions {
                recreate: nodes.to_vec(),
                ..opts.clone()
            };
            plan(inv, target, &opts)
        }
    };
    // The removal ran (or runs) before everything `up` does.
    done.first = removal_actions;
    done.warnings.splice(0..0, report.warnings);
    done.elapsed_ms = started.elapsed().as_millis();
    done
}

/// The report of a run (or dry run) about to start, every row placed
/// where the bootstrap will reach its node; already stopped when a bad
/// patch or an unreachable node stops it before any machine exists (not
/// after the VMs were created and started).
fn begin(
    inv: &Inventory,
    target: &Target,
    opts: &UpOptions,
    dry_run: bool,
    started: Instant,
) -> Report {
    let reach = Reach::of(inv, &opts.bootstrap);
    let mut report = Report::new(inv, target.name(), dry_run, &reach);
    // The cluster's secrets first: without them (or their age key) nothing
    // is built, published or created.
    let checked = stage::secrets_ready(inv, &opts.bootstrap).and_then(|found| {
        if found.is_none() && dry_run {
            report.warnings.push(format!(
                "the cluster has no secrets yet: `up --new-secrets` makes them into {} (this dry run rendered the configs with throwaway ones and wrote none)",
                new_secrets_path(inv, &opts.bootstrap).display()
            ));
        }
        stage::check(inv, &opts.bootstrap)
    });
    if let Err(e) = checked {
        report.stop(Stage::Bootstrap, UpError::Bootstrap(e));
        report.elapsed_ms = started.elapsed().as_millis();
    }
    report
}

/// Where `--new-secrets` writes a new cluster's bundle.
fn new_secrets_path(inv: &Inventory, opts: &BootstrapOptions) -> std::path::PathBuf {
    stage::state_path(inv, opts.state_dir.as_deref()).join("secrets.yaml")
}

/// Whether the publish part runs or is planned.
#[derive(Clone, Copy)]
enum Mode<'a> {
    /// Build, then publish, reporting to the observers.
    Run(Observers<'a>),
    /// Read the manifest and the target (GETs only); change nothing.
    Plan,
}

/// What the build leaves for the publish part.
#[derive(Default)]
struct Built {
    /// Each selected node's inventory position and its image: in a dry run
    /// the current one (as the build would leave it), None where none is.
    images: Vec<(usize, Option<build::BuildOutcome>)>,
    /// Nodes whose build failed (the others were built).
    failed: Vec<String>,
}

/// Builds the images of the selected nodes whose machine needs one
/// ([`Target`]'s `needing_images`), or in a dry run reads which ones the
/// manifest holds current; records each.
fn build(
    inv: &Inventory,
    target: &Target,
    opts: &UpOptions,
    mode: Mode<'_>,
    report: &mut Report,
) -> Result<Built, Stopped> {
    let nodes = target
        .needing_images(inv, &opts.nodes, &recreated(inv, opts))
        .map_err(|e| (Stage::Publish, target_error(e)))?;
    if nodes.is_empty() {
        return Ok(Built::default());
    }
    let (outcomes, failed) = match mode {
        Mode::Run(obs) => {
            let (built, failed) = match build::build(inv, &nodes, &opts.build, obs.download) {
                Ok(built) => (built, Vec::new()),
                Err(BuildError::Incomplete { built, failed }) => (built, failed),
                Err(e) => return Err((Stage::Build, e.into())),
            };
            let outcomes = built.into_iter().map(|o| (o.image.node.clone(), Some(o)));
            (outcomes.collect::<Vec<_>>(), failed)
        }
        Mode::Plan => {
            let current = build::current_images(inv, &nodes, &opts.build)
                .map_err(|e| (Stage::Build, e.into()))?;
            let out_dir = &opts.build.out_dir;
            let outcomes = current.into_iter().map(|(node, image)| {
                let current = image.map(|image| build::BuildOutcome {
                    file: image.file(out_dir),
                    image,
                    built: false,
                });
                (node, current)
            });
            (outcomes.collect(), Vec::new())
        }
    };
    let images: Vec<(usize, Option<build::BuildOutcome>)> = outcomes
        .into_iter()
        .filter_map(|(node, o)| Some((inv.nodes.iter().position(|n| n.name == node)?, o)))
        .collect();
    report.built(&images, &failed);
    Ok(Built {
        images,
        failed: failed.into_iter().map(|f| f.node).collect(),
    })
}

/// Publishes the built images on `target` (nothing without a target),
/// or in a dry run says what that would do; where the bootstrap reaches
/// each node (a Hetzner server's public IP). Stops when any node failed,
/// since a cluster missing a node cannot become healthy.
fn publish(
    inv: &Inventory,
    target: &Target,
    opts: &UpOptions,
    built: Built,
    mode: Mode<'_>,
    report: &mut Report,
) -> Result<BTreeMap<String, NodeEndpoint>, Stopped> {
    target.visit(Publishing {
        inv,
        opts,
        built,
        mode,
        report,
    })
}

/// The publish step on whichever target the inventory names.
struct Publishing<'a, 'r> {
    inv: &'a Inventory,
    opts: &'a UpOptions,
    built: Built,
    mode: Mode<'a>,
    report: &'r mut Report,
}

impl Visitor for Publishing<'_, '_> {
    type Out = Result<BTreeMap<String, NodeEndpoint>, Stopped>;

    fn none(self) -> Self::Out {
        Ok(BTreeMap::new())
    }

    fn proxmox(self, pve: &ProxmoxTarget) -> Self::Out {
        proxmox(self.inv, pve, self.opts, self.built, self.mode, self.report)
            .map(|()| BTreeMap::new())
    }

    fn hcloud(self, hc: &HcloudTarget) -> Self::Out {
        hcloud(self.inv, hc, self.opts, self.built, self.mode, self.report)
    }
}

/// The selected nodes by inventory position (all when none is named).
fn selected(inv: &Inventory, opts: &UpOptions) -> Vec<usize> {
    (0..inv.nodes.len())
        .filter(|&i| opts.nodes.is_empty() || opts.nodes.contains(&inv.nodes[i].name))
        .collect()
}

/// The nodes a dry run plans as made anew, by inventory position.
fn recreated(inv: &Inventory, opts: &UpOptions) -> Vec<usize> {
    (0..inv.nodes.len())
        .filter(|&i| opts.recreate.contains(&inv.nodes[i].name))
        .collect()
}

/// What `up`'s publish did (or would do) to one node's machine.
struct MachineDone {
    /// The volume it boots (a kept VM's, as its description records it).
    volume: Option<String>,
    vmid: Option<u32>,
    uploaded: bool,
    vm: Option<VmChange>,
    started: bool,
}

/// Proxmox: upload the images of VMs to be made and make, start (or keep)
/// each selected node's VM (or plan it). The real run and the dry run
/// report the same decision. VM settings are the settings step's.
fn proxmox(
    inv: &Inventory,
    pve: &ProxmoxTarget,
    opts: &UpOptions,
    built: Built,
    mode: Mode<'_>,
    report: &mut Report,
) -> Result<(), Stopped> {
    let bad_image = |e: crate::publish::ImageError| (Stage::Build, UpError::Setup(e.to_string()));
    let mut images = BTreeMap::new();
    // The nodes whose image this run built (a dry run: none): a plan
    // made before the build could not know whether the storage holds it.
    let built_now: std::collections::BTreeSet<usize> = built
        .images
        .iter()
        .filter(|(_, o)| o.as_ref().is_some_and(|o| o.built))
        .map(|(i, _)| *i)
        .collect();
    for (index, outcome) in built.images {
        let image = outcome
            .map(|o| PublishImage::new(inv, &o.image, o.file))
            .transpose()
            .map_err(bad_image)?;
        images.insert(index, image);
    }
    let mut failed_nodes = built.failed;
    let build_failed = !failed_nodes.is_empty();
    // Every selected node but those whose build failed: with its image
    // where its VM needs one.
    let nodes: Vec<(usize, Option<PublishImage>)> = selected(inv, opts)
        .into_iter()
        .filter(|&i| !failed_nodes.contains(&inv.nodes[i].name))
        .map(|i| (i, images.remove(&i).flatten()))
        .collect();
    let to_publish = |e: ProxmoxError| (Stage::Publish, UpError::from(e));
    let done: Vec<Result<MachineDone, ProxmoxError>> = match mode {
        Mode::Run(obs) => pve
            .publish_machines(inv, &nodes, obs.publish)
            .map_err(to_publish)?
            .into_iter()
            .map(|r| {
                r.map(|p| MachineDone {
                    volume: p.volid,
                    vmid: p.vmid,
                    uploaded: p.uploaded,
                    vm: p.vm,
                    started: p.started,
                })
            })
            .collect(),
        // An image not built yet is uploaded unless the storage happens
        // to hold its exact bytes already.
        Mode::Plan => pve
            .dry_run_without(inv, &nodes, &recreated(inv, opts))
            .map_err(to_publish)?
            .into_iter()
            .map(|r| {
                r.map(|d| MachineDone {
                    uploaded: d.upload != Some(false),
                    volume: d.volid.or(d.kept),
                    vmid: d.vmid,
                    // Settings are the settings step's, not the machine's.
                    vm: d.vm.map(|v| match v {
                        VmChange::Changed => VmChange::Unchanged,
                        v => v,
                    }),
                    started: d.start,
                })
            })
            .collect(),
    };
    for ((index, _), r) in nodes.iter().zip(done) {
        match r {
            Ok(m) => {
                let Some(n) = report.row(*index) else {
                    continue;
                };
                n.volume = m.volume;
                n.vmid = m.vmid;
                // A VM that keeps its disk needs no image: nothing built.
                n.stages.build.get_or_insert(Change::Unchanged);
                n.stages.upload = Some(match (m.uploaded, built_now.contains(index)) {
                    (true, _) => Change::Uploaded,
                    // Built now, so planned as an upload: found stored.
                    (false, true) => Change::Stored,
                    (false, false) => Change::Unchanged,
                });
                n.stages.vm = m.vm.map(Change::from);
                n.stages.start = Some(changed(m.started, Change::Started));
            }
            Err(e) => {
                // Marked where it happened (upload, VM or start), after
                // what finished before.
                let (step, message, done) = match e {
                    ProxmoxError::Node {
                        step,
                        message,
                        done,
                        ..
                    } => (step, message, done),
                    e => (proxmox::Step::Upload, e.to_string(), None),
                };
                if let (Some(p), Some(n)) = (done, report.row(*index)) {
                    n.volume = Some(p.volid);
                    n.vmid = p.vmid;
                    n.stages.upload = Some(changed(p.uploaded, Change::Uploaded));
                    n.stages.vm = p.vm.map(Change::from);
                }
                let failed = |s: &mut Stages| {
                    let column = match step {
                        proxmox::Step::Upload => &mut s.upload,
                        proxmox::Step::Vm => &mut s.vm,
                        proxmox::Step::Start => &mut s.start,
                    };
                    *column = Some(Change::Failed);
                };
                report.fail_row(*index, failed, message);
                failed_nodes.push(inv.nodes[*index].name.clone());
            }
        }
    }
    if failed_nodes.is_empty() {
        return Ok(());
    }
    let stage = if build_failed {
        Stage::Build
    } else {
        Stage::Publish
    };
    Err((
        stage,
        UpError::Nodes {
            stage,
            failed: failed_nodes,
        },
    ))
}

/// Hetzner Cloud: snapshots of the built images, then one server per node
/// from them with its machine config as `user_data` (or, in a dry run,
/// which snapshots and servers exist); where the bootstrap reaches each
/// node (the public IP the API reports).
fn hcloud(
    inv: &Inventory,
    hc: &HcloudTarget,
    opts: &UpOptions,
    built: Built,
    mode: Mode<'_>,
    report: &mut Report,
) -> Result<BTreeMap<String, NodeEndpoint>, Stopped> {
    let publish = |e: HcloudError| (Stage::Publish, UpError::Hcloud(e));
    if !built.failed.is_empty() {
        return Err((
            Stage::Build,
            UpError::Nodes {
                stage: Stage::Build,
                failed: built.failed,
            },
        ));
    }
    for (index, _) in &built.images {
        if let Some(n) = report.row(*index) {
            n.shared = Some(hcloud::snapshot_key(inv, &inv.nodes[*index]));
        }
    }
    if let Mode::Plan = mode {
        for (index, _) in &built.images {
            if let Some(n) = report.row(*index) {
                n.stages.upload = Some(Change::Uploaded);
                n.stages.vm = Some(Change::Created);
                n.stages.start = Some(Change::Started);
            }
        }
    }
    let images = SnapshotImage::distinct(
        built
            .images
            .iter()
            .filter_map(|(_, o)| o.as_ref())
            .map(|o| (&o.image, o.file.clone())),
    );
    let api = hc.api().map_err(publish)?;
    let Mode::Run(obs) = mode else {
        let planned = hc.plan(&api, &images).map_err(publish)?;
        for (image, found) in images.iter().zip(planned) {
            for node in &image.nodes {
                if let (Some(id), Some(n)) = (found, report.node(node)) {
                    n.volume = Some(format!("snapshot {id}"));
                    n.stages.upload = Some(Change::Unchanged);
                }
            }
        }
        let mut targets = BTreeMap::new();
        for s in servers::existing(&api, &inv.cluster.name).map_err(publish)? {
            let stages = ServerStages {
                vm: Change::Unchanged,
                start: changed(s.status == "off", Change::Started),
            };
            record_server(report, &mut targets, &s, Some(stages));
        }
        return Ok(targets);
    };
    let mut snapshot_of: BTreeMap<String, u64> = BTreeMap::new();
    let mut failed = Vec::new();
    let runs = hc.publish(&api, &images, obs.hcloud);
    for (image, run) in images.iter().zip(runs) {
        let leftovers: Vec<String> = run
            .leftovers
            .iter()
            .map(|l| {
                format!(
                    "{} {} not deleted ({}): run `imgbuild cleanup`",
                    l.kind, l.id, l.error
                )
            })
            .collect();
        match run.result {
            Ok(snap) if leftovers.is_empty() => {
                for node in &snap.nodes {
                    snapshot_of.insert(node.clone(), snap.id);
                    if let Some(n) = report.node(node) {
                        n.volume = Some(format!("snapshot {}", snap.id));
                        n.stages.upload = Some(changed(snap.created, Change::Uploaded));
                    }
                }
            }
            result => {
                let mut why: Vec<String> =
                    result.err().map(|e| e.to_string()).into_iter().collect();
                why.extend(leftovers);
                for node in &image.nodes {
                    report.fail(node, |s| s.upload = Some(Change::Failed), why.join("; "));
                    failed.push(node.clone());
                }
            }
        }
    }
    if !failed.is_empty() {
        return Err((
            Stage::Publish,
            UpError::Nodes {
                stage: Stage::Publish,
                failed,
            },
        ));
    }
    let configs = stage::machine_configs(inv, &opts.bootstrap)
        .map_err(|e| (Stage::Publish, UpError::Bootstrap(e)))?;
    let specs: Vec<servers::ServerSpec> = configs
        .into_iter()
        .filter(|(node, _)| opts.nodes.is_empty() || opts.nodes.contains(node))
        .filter_map(|(node, user_data)| {
            let snapshot = snapshot_of.get(&node).copied();
            let spec = inv.node(&node).ok()?;
            let server_type = spec.hcloud_server_type(&hc.settings)?.to_owned();
            let location = spec.hcloud_location(&hc.settings).to_owned();
            let private_ip = spec.address;
            Some(servers::ServerSpec {
                node,
                snapshot,
                server_type,
                location,
                user_data,
                talos_version: inv.cluster.talos_version.clone(),
                private_ip,
            })
        })
        .collect();
    let made = servers::ensure(
        &api,
        &hc.settings,
        &inv.cluster.name,
        &specs,
        &hc.options,
        &hc.cancel,
    )
    .map_err(publish)?;
    // Nodes not selected this run keep the servers they have.
    let mut all = servers::existing(&api, &inv.cluster.name).map_err(publish)?;
    all.retain(|s| !made.iter().any(|m| m.node == s.node));
    let mut targets = BTreeMap::new();
    for s in &made {
        let stages = ServerStages {
            vm: changed(s.created, Change::Created),
            start: changed(s.started, Change::Started),
        };
        record_server(report, &mut targets, s, Some(stages));
    }
    for s in &all {
        record_server(report, &mut targets, s, None);
    }
    // For the commands after it, when the API cannot be asked.
    let dir = stage::StateDir::open(inv, opts.bootstrap.state_dir.as_deref())
        .map_err(|e| (Stage::Publish, UpError::Bootstrap(e)))?;
    servers::record(inv, &dir.path, made.iter().chain(&all)).map_err(publish)?;
    Ok(targets)
}

/// What this run did (or would do) to a server: its vm column (created
/// or kept) and its start column.
struct ServerStages {
    vm: Change,
    start: Change,
}

/// Puts server `s` in its node's row (with its vm and start outcomes, if
/// this run dealt with it) and notes where the bootstrap reaches it.
fn record_server(
    report: &mut Report,
    targets: &mut BTreeMap<String, NodeEndpoint>,
    s: &servers::ClusterServer,
    stages: Option<ServerStages>,
) {
    let Some(n) = report.node(&s.node) else {
        return;
    };
    n.server = Some(s.id);
    if let Some(ServerStages { vm, start }) = stages {
        // A server's image is history: nothing to upload for it.
        n.stages.upload.get_or_insert(Change::Unchanged);
        n.stages.vm = Some(vm);
        n.stages.start = Some(start);
    }
    if let Some(ip) = s.public_ip {
        n.address = Some(ip);
        targets.extend(NodeEndpoint::new(Some(ip), None).map(|t| (s.node.clone(), t)));
    }
}
