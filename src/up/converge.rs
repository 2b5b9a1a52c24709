//! Day two as library calls, one per kind of change: the upgrade (Talos
//! nodes, then Kubernetes) and the config apply. `imgbuild upgrade` and
//! `imgbuild apply` are each one of them; `up` runs them in its fixed order
//! after the bootstrap. Each is a plan (read only) and a run of that plan.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use crate::factory::Factory;
use crate::inventory::Inventory;
use crate::talos::apply::{self, ApplyOutcome};
use crate::talos::bootstrap::{Options, Plan};
use crate::talos::client::ApplyMode;
use crate::talos::config::{Fingerprints, PatchVars};
use crate::talos::kubernetes::plan::{self as kplan, ClusterSeen, KubePlan};
use crate::talos::kubernetes::{observe, run as kube_run};
use crate::talos::stage::Prepared;
use crate::talos::upgrade::plan::{Action, UpgradePlan};
use crate::talos::upgrade::report::{Ending, UpgradeReport};
use crate::talos::upgrade::{self, RebootMode, Record, RunOptions, Targets, UpgradeError};

/// Why a day-two step could not plan or start.
#[derive(Debug, thiserror::Error)]
pub enum ConvergeError {
    #[error(transparent)]
    Upgrade(Box<UpgradeError>),
    /// A node's config could not be pinned to the Kubernetes it runs.
    #[error(transparent)]
    Kubernetes(#[from] crate::talos::kubernetes::run::PinError),
    #[error("cannot start the async runtime: {0}")]
    Runtime(String),
    #[error("recording fingerprints in {}: {source}", path.display())]
    Fingerprints {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl From<UpgradeError> for ConvergeError {
    fn from(e: UpgradeError) -> Self {
        ConvergeError::Upgrade(Box::new(e))
    }
}

/// How an upgrade may run (the `upgrade` flags; `up` takes the defaults).
#[derive(Debug, Clone)]
pub struct UpgradeSettings {
    /// Upgrade a 2-member etcd, which loses quorum while a control plane reboots.
    pub force: bool,
    pub reboot_mode: RebootMode,
    /// Upgrade Kubernetes although something still uses a removed API.
    pub skip_api_check: bool,
    pub run: RunOptions,
    pub kube: kube_run::RunOptions,
    /// `--etcd-snapshot-dir`: where the snapshot before the first
    /// control-plane change goes (else the inventory's setting, else the
    /// state dir).
    pub etcd_snapshot_dir: Option<PathBuf>,
}

impl Default for UpgradeSettings {
    fn default() -> Self {
        UpgradeSettings {
            force: false,
            reboot_mode: RebootMode::Default,
            skip_api_check: false,
            run: RunOptions::default(),
            kube: kube_run::RunOptions {
                pull_timeout: Duration::from_secs(600),
                component_timeout: Duration::from_secs(300),
            },
            etcd_snapshot_dir: None,
        }
    }
}

/// The upgrade, decided up front: each node's Talos version and schematic
/// from → to, then Kubernetes (whole cluster only).
#[derive(Debug, Clone)]
pub struct UpgradePlanned {
    pub talos: UpgradePlan,
    /// What the cluster shows of Kubernetes, and its plan; None when only
    /// some nodes were selected.
    pub kube: Option<(ClusterSeen, KubePlan)>,
}

impl UpgradePlanned {
    /// Why Kubernetes may not move, naming its target.
    pub fn kube_refusal(&self) -> Option<String> {
        self.kube.as_ref().and_then(|(_, k)| {
            k.refusal
                .as_ref()
                .map(|r| format!("kubernetes {}: {r}", k.to))
        })
    }

    /// Why nothing may run: the Talos refusal first.
    pub fn refusal(&self) -> Option<String> {
        self.talos.refusal.clone().or_else(|| self.kube_refusal())
    }

    /// Nodes that could not say what they run (or be planned).
    pub fn blocked(&self) -> Vec<&str> {
        self.talos
            .nodes
            .iter()
            .filter(|n| n.action == Action::Blocked)
            .map(|n| n.node.as_str())
            .collect()
    }

    /// Whether a Talos node or a Kubernetes step is left to do.
    pub fn has_work(&self) -> bool {
        self.talos.has_work() || self.kube.as_ref().is_some_and(|(_, k)| k.has_work())
    }
}

/// Reads the selected nodes (all when `select` is empty) and the cluster's
/// Kubernetes, and decides the upgrade. Changes nothing. Blocking.
pub fn upgrade_plan(
    inv: &Inventory,
    factory: &Factory,
    targets: &Targets,
    prepared: &Prepared,
    select: &[String],
    settings: &UpgradeSettings,
    limits: &Options,
) -> Result<UpgradePlanned, ConvergeError> {
    let record = Record::load(&prepared.state_dir.upgrades_path()).map_err(UpgradeError::from)?;
    let talos = upgrade::decide_upgrade(
        inv,
        factory,
        targets,
        &prepared.plan,
        select,
        &record,
        settings.force,
        settings.reboot_mode,
        limits,
    )?;
    // Kubernetes moves with the whole cluster only, after Talos: its
    // checks run against the Talos version each node will run then.
    let kube = select.is_empty().then(|| {
        let talos_after: BTreeMap<String, String> = talos
            .nodes
            .iter()
            .filter(|n| n.action == Action::Upgrade)
            .map(|n| (n.node.clone(), n.to.version.clone()))
            .collect();
        kubernetes_plan(inv, &prepared.plan, &talos_after, settings, limits)
    });
    Ok(UpgradePlanned { talos, kube })
}

/// Reads the cluster's Kubernetes (as it will be with each node at the
/// Talos version `talos_after` gives) and decides its upgrade. Changes
/// nothing. Blocking.
pub fn kubernetes_plan(
    inv: &Inventory,
    plan: &Plan,
    talos_after: &BTreeMap<String, String>,
    settings: &UpgradeSettings,
    limits: &Options,
) -> (ClusterSeen, KubePlan) {
    let seen = observe::observe(plan, talos_after, limits).cluster;
    let k = kplan::decide(
        &seen,
        &inv.cluster.kubernetes_version,
        settings.skip_api_check,
    );
    (seen, k)
}

/// What an upgrade did: the Talos part, then Kubernetes (when Talos ended
/// well and the whole cluster was planned).
#[derive(Debug, Clone)]
pub struct Upgraded {
    pub talos: UpgradeReport,
    pub kube: Option<kube_run::KubeReport>,
}

impl Upgraded {
    /// How the whole upgrade ended: a Kubernetes failure after Talos
    /// upgraded nodes is partial.
    pub fn ending(&self) -> Ending {
        let kube = self.kube.as_ref().map_or(Ending::Ok, |k| k.ending());
        match (self.talos.ending(), kube) {
            (Ending::Ok, Ending::Ok) => Ending::Ok,
            (Ending::Ok, Ending::Failed(m)) if self.talos.upgraded.is_empty() => {
                Ending::Failed(format!("kubernetes: {m}"))
            }
            (Ending::Ok, Ending::Failed(m) | Ending::Partial(m)) => {
                Ending::Partial(format!("kubernetes: {m}"))
            }
            (talos, _) => talos,
        }
    }
}

/// Runs a plan from [`upgrade_plan`] (refused plans must not get here):
/// the Talos nodes in order, each node's config applied after its upgrade
/// pinned to the Kubernetes it runs, then every Kubernetes step not done.
/// `progress` hears each node's steps, `say` each Kubernetes step. Blocking.
#[allow(clippy::too_many_arguments)]
pub fn run_upgrade(
    inv: &Inventory,
    factory: &Factory,
    prepared: &Prepared,
    planned: UpgradePlanned,
    settings: &UpgradeSettings,
    limits: &Options,
    progress: &(dyn Fn(&str, &str) + Sync),
    say: &dyn Fn(&str),
) -> Result<Upgraded, ConvergeError> {
    let UpgradePlanned { talos: up, kube } = planned;
    let mut talos_plan = prepared.plan.clone();
    if let Some((seen, k)) = &kube {
        kube_run::pin_running(&mut talos_plan, seen, &k.to).map_err(ConvergeError::Kubernetes)?;
    }
    let report = upgrade::execute(
        factory,
        &talos_plan,
        &up,
        &prepared.state_dir.upgrades_path(),
        &settings.run,
        limits,
        progress,
    )?;
    let kube_report = match kube {
        Some((seen, k)) if report.ending() == Ending::Ok => {
            // What the Talos part changed is read again.
            let (seen, k) = if up.has_work() {
                kubernetes_plan(inv, &prepared.plan, &BTreeMap::new(), settings, limits)
            } else {
                (seen, k)
            };
            Some(kube_run::execute(
                &prepared.plan,
                &k,
                &seen,
                limits,
                &settings.kube,
                say,
            ))
        }
        _ => None,
    };
    Ok(Upgraded {
        talos: report,
        kube: kube_report,
    })
}

/// Pins each node's rendered config to the Kubernetes versions it runs
/// (read from the cluster): configs move Kubernetes only through the
/// upgrade, in order. Returns what was read.
pub fn pin_kubernetes(
    inv: &Inventory,
    plan: &mut Plan,
    limits: &Options,
) -> Result<observe::Observed, ConvergeError> {
    let observed = observe::observe(plan, &BTreeMap::new(), limits);
    kube_run::pin_running(plan, &observed.cluster, &inv.cluster.kubernetes_version)
        .map_err(ConvergeError::Kubernetes)?;
    Ok(observed)
}

/// How a config apply runs.
#[derive(Debug, Clone)]
pub struct ApplySettings {
    pub mode: ApplyMode,
    /// Per node that reboots for its change: until its new boot answers.
    pub reboot_timeout: Duration,
}

impl Default for ApplySettings {
    fn default() -> Self {
        ApplySettings {
            mode: ApplyMode::Auto,
            reboot_timeout: Duration::from_secs(1800),
        }
    }
}

/// Compares the selected nodes' configs with the rendered ones (pinned to
/// the Kubernetes they run) and, unless `dry_run`, applies what differs;
/// records what is on the nodes now when anything was applied. Blocking.
#[allow(clippy::too_many_arguments)]
pub fn apply_configs(
    inv: &Inventory,
    prepared: &Prepared,
    select: &[String],
    settings: &ApplySettings,
    dry_run: bool,
    patch_vars: &PatchVars,
    limits: &Options,
) -> Result<ApplyOutcome, ConvergeError> {
    let mut plan = prepared.plan.clone();
    pin_kubernetes(inv, &mut plan, limits)?;
    let outcome = runtime()?.block_on(apply::run(
        &plan,
        select,
        settings.mode,
        dry_run,
        settings.reboot_timeout,
        limits,
    ));
    if !dry_run && outcome.nodes.iter().any(|n| n.applied) {
        // What is on the nodes now, for read-only commands run without it.
        let dir = &prepared.state_dir.path;
        Fingerprints::record(dir, inv, patch_vars).map_err(|source| {
            ConvergeError::Fingerprints {
                path: dir.clone(),
                source,
            }
        })?;
    }
    Ok(outcome)
}

/// The runtime the node calls run on.
pub fn runtime() -> Result<tokio::runtime::Runtime, ConvergeError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| ConvergeError::Runtime(e.to_string()))
}
