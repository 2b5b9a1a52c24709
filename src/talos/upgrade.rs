//! `imgbuild upgrade`: moves nodes to the inventory's Talos version and
//! schematic, control planes one at a time first, then the workers, with
//! the cluster healthy between nodes ([`super::health`]). A node is done
//! when it runs the target version and its running schematic is the target
//! (or cannot be told: unknown is not different); a rerun continues where
//! a stopped run left off, mid-path too. The plan is decided up front
//! ([`plan`]), what happened is the [`report`].

pub mod drain;
pub mod pace;
pub mod plan;
pub mod report;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use futures_util::StreamExt;

use super::bootstrap::{Options, Plan, PlannedNode};
pub use super::client::RebootMode;
use super::client::{ApiError, ApplyMode, Mode, NodeClient, UpgradeFlags};
use super::health::{HealthError, wait_healthy};
use crate::factory::{Factory, FactoryError};
use crate::inventory::{Inventory, Role};
use pace::Pace;
use plan::{Action, Hop, NodePlan, Observed, UpgradePlan};
pub use plan::{Installed, Record, RecordError, Running, Wanted};
use report::{Failure, UpgradeReport};

/// Every node's target, computed here without asking anyone: the
/// inventory's version and the node's base schematic (without META) with
/// its installer ([`crate::schematic::installer::installer_for`]).
pub fn wanted(
    inv: &crate::inventory::Inventory,
) -> Result<BTreeMap<String, Wanted>, crate::schematic::EmitError> {
    let version = format!("v{}", inv.cluster.talos_version.trim_start_matches('v'));
    inv.nodes
        .iter()
        .map(|node| {
            let canonical = crate::schematic::node::base_for_node(inv, node).canonical()?;
            let id = crate::schematic::id_of(&canonical);
            let own =
                crate::schematic::id_of(&crate::schematic::node::for_node(inv, node).canonical()?);
            Ok((
                node.name.clone(),
                Wanted {
                    version: version.clone(),
                    installer: crate::schematic::installer::installer_for(inv, node)?,
                    schematic: id.to_string(),
                    own_schematic: own.to_string(),
                    secure_boot: inv.secure_boot(node),
                },
            ))
        })
        .collect()
}

/// What the run may do beyond the plan.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// The deadline of the call that makes a node pull the installer
    /// (MachineService.Upgrade acks only after the pull; ImageService.Pull).
    pub pull_timeout: Duration,
    /// Per node and hop: from the request until the node runs its new boot.
    pub node_timeout: Duration,
    /// Workers upgraded at once (control planes always one at a time).
    pub parallel: usize,
    /// The client's cordon and drain before a LifecycleService reboot.
    pub drain_timeout: Duration,
    /// The etcd snapshot taken before the first control-plane upgrade
    /// (skipped unless the caller says where it goes).
    pub etcd: std::sync::Arc<super::etcd::BeforeChange>,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            pull_timeout: Duration::from_secs(600),
            node_timeout: Duration::from_secs(1800),
            parallel: 1,
            drain_timeout: drain::DRAIN_TIMEOUT,
            etcd: Default::default(),
        }
    }
}

/// Why `upgrade` could not plan or start.
#[derive(Debug, thiserror::Error)]
pub enum UpgradeError {
    #[error("the factory cannot provide the upgrade: {0}")]
    Factory(#[from] FactoryError),
    #[error("node {node}: registering its schematic: {source}")]
    Register { node: String, source: FactoryError },
    #[error("the hop to {version} on the way: {source}")]
    Hop {
        version: String,
        source: FactoryError,
    },
    #[error(transparent)]
    Emit(#[from] crate::schematic::EmitError),
    #[error("cannot start the async runtime: {0}")]
    Runtime(String),
    #[error(transparent)]
    Record(#[from] RecordError),
    #[error(
        "the etcd snapshot before the first control-plane upgrade failed, so nothing was upgraded: {0}\n  (--skip-etcd-snapshot goes on without one)"
    )]
    EtcdSnapshot(#[from] super::etcd::EtcdError),
    #[error(
        "node {node}: it runs with Secure Boot {}, the inventory asks for it {}; an upgrade cannot move a node between Secure Boot and not (the installer keeps the boot layout the disk was made with, siderolabs/talos#9245). Set secureBoot on the node to match, or rebuild its disk from the other image and reinstall it",
        on_off(*running),
        on_off(*wanted)
    )]
    SecureBootSwitch {
        node: String,
        running: bool,
        wanted: bool,
    },
}

/// Why what a node runs could not be read: kept in [`Running::error`].
#[derive(Debug, thiserror::Error)]
pub enum RunningUnread {
    /// Neither the connect nor the first call finished in time.
    #[error("{}", no_answer(*.0))]
    NoAnswer(Duration),
    #[error(transparent)]
    Connect(ApiError),
    #[error("Version: {0}")]
    Version(#[source] ApiError),
}

/// Why a node did not come back from its reboot.
#[derive(Debug, thiserror::Error)]
pub enum RebootError {
    #[error("{0} (a certificate error does not go away by waiting)")]
    Certificate(#[source] ApiError),
    /// `last` is what the node said last, on one line.
    #[error("did not reboot into a new boot within {timeout:?} ({last})")]
    NotRebooted { timeout: Duration, last: String },
}

/// Why one node's upgrade (or its config step) stopped. Node replies are
/// shown on one line and bounded ([`one_line`]).
#[derive(Debug, thiserror::Error)]
pub enum NodeUpgradeError {
    /// The plan's reason the node cannot be upgraded.
    #[error("{0}")]
    Blocked(String),
    #[error("not in the plan")]
    NotInPlan,
    #[error("connect timed out after {0:?}")]
    ConnectTimeout(Duration),
    /// Connecting, or reading its version.
    #[error("{}", one_line(&.0.to_string()))]
    Api(#[source] ApiError),
    #[error("reading the boot ID: {}", one_line(&.0.to_string()))]
    BootId(#[source] ApiError),
    #[error("the node did not pull the installer within {0:?} (--pull-timeout)")]
    PullTimeout(Duration),
    #[error("Upgrade refused: {}", one_line(&.0.to_string()))]
    Refused(#[source] ApiError),
    #[error(
        "the installer exited with {code}; the node keeps running {}",
        one_line(running)
    )]
    InstallerExit { code: i32, running: String },
    #[error(transparent)]
    Drain(#[from] drain::DrainError),
    /// The Reboot call failed; `uncordon` is why the node could not be
    /// uncordoned afterwards, if it could not.
    #[error("Reboot: {}{}", one_line(&source.to_string()),
        uncordon.as_ref().map_or(String::new(), |u| format!("; {u}")))]
    Reboot {
        #[source]
        source: ApiError,
        uncordon: Option<drain::DrainError>,
    },
    #[error(transparent)]
    Rebooted(#[from] RebootError),
    #[error(
        "rebooted on {}, not {wanted}: the installer failed and Talos kept the old version",
        one_line(now)
    )]
    KeptOld { now: String, wanted: String },
    #[error("runs schematic {}, not {wanted}", one_line(runs))]
    WrongSchematic { runs: String, wanted: String },
    #[error("upgraded to {version}, but its schematic could not be read: {}", one_line(&source.to_string()))]
    SchematicUnread {
        version: String,
        #[source]
        source: ApiError,
    },
    #[error("applying the rendered config after the upgrade: {}", one_line(&.0.to_string()))]
    Configure(#[source] ApiError),
    #[error(transparent)]
    Health(#[from] HealthError),
}

fn on_off(b: bool) -> &'static str {
    if b { "on" } else { "off" }
}

/// What the factory says, for planning: each node's target and the
/// versions it offers (for hops).
#[derive(Debug, Clone)]
pub struct Targets {
    pub wanted: BTreeMap<String, Wanted>,
    pub offered: Vec<String>,
}

/// Every extension any node of `inv` asks for.
fn extensions(inv: &Inventory) -> Vec<String> {
    let mut out: Vec<String> = inv.image.extensions.clone();
    for n in &inv.nodes {
        out.extend(n.extensions.iter().cloned());
    }
    out.sort();
    out.dedup();
    out
}

/// Each node's target: the inventory's version and the installer of its
/// base schematic (without META), registered at the factory, which must
/// offer the version and every extension. Contacts no node. Blocking.
pub fn targets(inv: &Inventory, factory: &Factory) -> Result<Targets, UpgradeError> {
    factory.check_available(&inv.cluster.talos_version, &extensions(inv))?;
    for node in &inv.nodes {
        // The factory serves installers only for schematics posted to it;
        // `register` also checks that its ID is ours.
        factory
            .register(&crate::schematic::node::base_for_node(inv, node))
            .map_err(|source| UpgradeError::Register {
                node: node.name.clone(),
                source,
            })?;
    }
    Ok(Targets {
        wanted: wanted(inv)?,
        offered: factory.versions()?,
    })
}

/// Reads what `node` runs, straight from its API over mTLS (the schematic
/// from `record` where the node cannot tell).
pub async fn running(plan: &Plan, node: &PlannedNode, record: &Record, opts: &Options) -> Running {
    let mode = Mode::Mtls(plan.identity.clone());
    // One deadline for the connect and the first call together: a node
    // that accepts TCP and never answers costs one call timeout, not two.
    let started = Instant::now();
    let first = tokio::time::timeout(opts.call_timeout, async {
        // The client's own connect deadline is the same one: a connect
        // that ran out of it is reported as the deadline.
        let conn = NodeClient::connect(&node.endpoint, &mode, opts.call_timeout)
            .await
            .map_err(|e| {
                if started.elapsed() >= opts.call_timeout {
                    RunningUnread::NoAnswer(opts.call_timeout)
                } else {
                    RunningUnread::Connect(e)
                }
            })?;
        let version = conn.version().await.map_err(RunningUnread::Version);
        Ok::<_, RunningUnread>((conn, version))
    })
    .await
    .unwrap_or(Err(RunningUnread::NoAnswer(opts.call_timeout)));
    let (conn, version) = match first {
        Ok(c) => c,
        Err(e) => {
            return Running {
                error: Some(e.to_string()),
                ..Running::default()
            };
        }
    };
    let mut out = Running::default();
    match version {
        Ok(v) => out.version = Some(v.tag),
        Err(e) => out.error = Some(e.to_string()),
    }
    match conn.running_schematic().await {
        Ok(s) => out.schematic = s,
        Err(e) => out.error = Some(format!("extension status: {e}")),
    }
    // Unread is not different: a failed read plans nothing extra.
    if let Ok(Some(config)) = conn.machine_config("v1alpha1").await {
        out.install_image = plan::install_image_of(&String::from_utf8_lossy(&config));
    }
    // Unknown (None) when the node cannot tell: not a difference.
    out.security = conn.security_state().await.ok().flatten();
    record.fill(&node.name, &mut out);
    out
}

/// Why a node is unreachable when neither its connect nor its first call
/// finished within the call timeout.
pub fn no_answer(timeout: std::time::Duration) -> String {
    format!(
        "no answer within the call timeout ({}s, connect and Version together)",
        timeout.as_secs_f64()
    )
}

/// How many nodes day two reads at once: all of a cluster of up to 64
/// nodes (so 50 stalled nodes cost one call timeout, not four), a bounded
/// number of a larger one. A read is a connection and a few small calls.
pub const READ_CONCURRENCY: usize = 64;

/// [`running`] for every node of `nodes` at once (bounded), in order.
pub async fn running_all(
    plan: &Plan,
    nodes: &[&PlannedNode],
    record: &Record,
    opts: &Options,
) -> Vec<Running> {
    futures_util::stream::iter(nodes.iter().map(|n| running(plan, n, record, opts)))
        .buffered(READ_CONCURRENCY)
        .collect()
        .await
}

/// Control planes in inventory order, then workers: the order upgrades go in.
pub fn ordered<'a>(plan: &'a Plan, select: &[String]) -> Vec<&'a PlannedNode> {
    let chosen = |n: &&PlannedNode| select.is_empty() || select.contains(&n.name);
    let cps = plan
        .nodes
        .iter()
        .filter(chosen)
        .filter(|n| n.role == Role::Controlplane);
    let workers = plan
        .nodes
        .iter()
        .filter(chosen)
        .filter(|n| n.role != Role::Controlplane);
    cps.chain(workers).collect()
}

/// The etcd member count from the first control plane that answers, else
/// the inventory's control planes.
async fn etcd_members(plan: &Plan, opts: &Options) -> usize {
    let mode = Mode::Mtls(plan.identity.clone());
    let cps: Vec<&PlannedNode> = plan
        .nodes
        .iter()
        .filter(|n| n.role == Role::Controlplane)
        .collect();
    for cp in &cps {
        if let Ok(c) = NodeClient::connect(&cp.endpoint, &mode, opts.call_timeout).await
            && let Ok(m) = c.etcd_members().await
        {
            return m.len();
        }
    }
    cps.len()
}

fn runtime() -> Result<tokio::runtime::Runtime, UpgradeError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| UpgradeError::Runtime(e.to_string()))
}

/// Reads the selected nodes (all at once) and decides the plan; checks
/// that the factory offers every hop's version with the extensions.
/// Touches no node. Blocking.
#[allow(clippy::too_many_arguments)]
pub fn decide_upgrade(
    inv: &Inventory,
    factory: &Factory,
    targets: &Targets,
    plan: &Plan,
    select: &[String],
    record: &Record,
    force: bool,
    reboot_mode: RebootMode,
    opts: &Options,
) -> Result<UpgradePlan, UpgradeError> {
    let order = ordered(plan, select);
    let (now, members, kube) = runtime()?.block_on(async {
        (
            running_all(plan, &order, record, opts).await,
            etcd_members(plan, opts).await,
            // Unread is no cordon: the run reads them again before it starts.
            super::health::kube_nodes(plan, opts)
                .await
                .unwrap_or_default(),
        )
    });
    let observed: Vec<Observed> = order
        .iter()
        .zip(now)
        .map(|(n, running)| Observed {
            node: n.name.clone(),
            control_plane: n.role == Role::Controlplane,
            running,
        })
        .collect();
    // The node's SecurityState against the inventory, before anything is
    // planned: an installer of the other kind would not switch it.
    for o in &observed {
        if let (Some(sec), Some(want)) = (&o.running.security, targets.wanted.get(&o.node))
            && sec.secure_boot != want.secure_boot
        {
            return Err(UpgradeError::SecureBootSwitch {
                node: o.node.clone(),
                running: sec.secure_boot,
                wanted: want.secure_boot,
            });
        }
    }
    let installer_at = |node: &str, version: &str| {
        inv.nodes
            .iter()
            .find(|n| n.name == node)
            .and_then(|n| {
                let base = crate::schematic::node::base_for_node(inv, n)
                    .canonical()
                    .ok()?;
                let id = crate::schematic::id_of(&base);
                Some(crate::schematic::installer::installer_at(
                    inv,
                    &id,
                    version,
                    inv.secure_boot(n),
                ))
            })
            .unwrap_or_default()
    };
    let decided = plan::decide(
        &observed,
        &targets.wanted,
        &targets.offered,
        record,
        members,
        force,
        reboot_mode,
        &installer_at,
    );
    let mut decided = decided;
    let names: Vec<&str> = plan.nodes.iter().map(|n| n.name.as_str()).collect();
    for name in cordons_left(&Default::default(), &kube, &names) {
        decided.notes.push(format!(
            "{name}: left cordoned by a stopped run (its {} mark): uncordoned once Ready, before any node is upgraded",
            crate::talos::health::CORDONED_BY
        ));
    }
    let mut hop_versions: Vec<&str> = decided
        .nodes
        .iter()
        .flat_map(|n| &n.hops)
        .map(|h| h.version.as_str())
        .filter(|v| *v != inv.cluster.talos_version.as_str())
        .collect();
    hop_versions.sort_unstable();
    hop_versions.dedup();
    for v in hop_versions {
        factory
            .check_available(v, &extensions(inv))
            .map_err(|source| UpgradeError::Hop {
                version: v.to_owned(),
                source,
            })?;
    }
    Ok(decided)
}

/// Asks the factory for every installer of the plan once, before the first
/// node: the factory builds an installer on its first request, and the
/// nodes then pull what is ready. Blocking. Failures are returned as
/// notes: the nodes' own pulls still wait for the build.
pub fn warm(factory: &Factory, plan: &UpgradePlan) -> Vec<String> {
    plan.installers()
        .into_iter()
        .filter_map(|i| {
            factory
                .warm_installer(i)
                .err()
                .map(|e| format!("warming {i} at the factory: {e}"))
        })
        .collect()
}

/// Whether an error says the node is not who we think (our CA, its name,
/// its certificate): waiting does not fix it.
fn is_certificate_error(e: &ApiError) -> bool {
    matches!(
        e,
        ApiError::UnknownAuthority(_)
            | ApiError::WrongName { .. }
            | ApiError::PinMismatch { .. }
            | ApiError::CertificateRequired
    )
}

/// A node string safe for one line of output.
fn one_line(s: &str) -> String {
    crate::input::excerpt(&s.replace(['\n', '\r'], " "), 200)
}

/// The boot ID, or None where the node cannot tell (no Read).
async fn boot_id(conn: &NodeClient) -> Result<Option<String>, ApiError> {
    match conn.boot_id().await {
        Ok(id) if !id.is_empty() => Ok(Some(id)),
        Ok(_) => Ok(None),
        Err(e) if e.code() == Some(tonic::Code::Unimplemented) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Waits until `node` runs a boot other than `old_boot` and answers its
/// version, at most `timeout`: talosctl's `BootIDChangedPostCheckFn`. A
/// closed port, a stalled connect or an old-boot answer is "not yet"; a
/// certificate error is not. Where the boot ID cannot be read, a version
/// other than `before` stands in for it. Returns the version it runs.
pub async fn wait_rebooted(
    plan: &Plan,
    node: &PlannedNode,
    old_boot: Option<&str>,
    before: &str,
    timeout: Duration,
    opts: &Options,
) -> Result<String, RebootError> {
    let mode = Mode::Mtls(plan.identity.clone());
    let mut pace = Pace::new(opts.poll, timeout);
    loop {
        let attempt = async {
            let conn = NodeClient::connect(&node.endpoint, &mode, opts.call_timeout).await?;
            let boot = boot_id(&conn).await?;
            let version = conn.version().await?.tag;
            Ok::<_, ApiError>((boot, version))
        };
        let last = match tokio::time::timeout(opts.call_timeout * 2, attempt).await {
            Ok(Ok((boot, version))) => {
                let rebooted = match (old_boot, boot.as_deref()) {
                    (Some(old), Some(new)) => old != new,
                    _ => version != before,
                };
                if rebooted {
                    return Ok(version);
                }
                format!("still on its old boot ({})", one_line(&version))
            }
            Ok(Err(e)) if is_certificate_error(&e) => {
                return Err(RebootError::Certificate(e));
            }
            Ok(Err(e)) => one_line(&e.to_string()),
            Err(_) => "a call stalled".into(),
        };
        if !pace.wait().await {
            return Err(RebootError::NotRebooted { timeout, last });
        }
    }
}

/// Why the node refused or failed the Upgrade request, in words.
fn refused(e: ApiError, run: &RunOptions) -> NodeUpgradeError {
    match e {
        ApiError::Timeout(_) => NodeUpgradeError::PullTimeout(run.pull_timeout),
        ApiError::Status { code, ref message }
            if code == tonic::Code::DeadlineExceeded || message.contains("Timeout expired") =>
        {
            NodeUpgradeError::PullTimeout(run.pull_timeout)
        }
        other => NodeUpgradeError::Refused(other),
    }
}

/// Sends one hop's request the way the node's version takes it. Returns
/// once the node has taken it (MachineService: acked; LifecycleService:
/// installed, the Kubernetes node cordoned and drained, Reboot sent), and
/// whether the client cordoned it (then the client uncordons it).
#[allow(clippy::too_many_arguments)]
async fn request_hop(
    plan: &Plan,
    node: &PlannedNode,
    host: &str,
    hop: &Hop,
    up: &UpgradePlan,
    run: &RunOptions,
    opts: &Options,
    progress: &(dyn Fn(&str, &str) + Sync),
) -> Result<bool, NodeUpgradeError> {
    let mode = Mode::Mtls(plan.identity.clone());
    // The pull happens inside the call: it gets its own deadline; the
    // connection itself still gets the call timeout.
    let puller = tokio::time::timeout(
        opts.call_timeout,
        NodeClient::connect(&node.endpoint, &mode, run.pull_timeout),
    )
    .await
    .map_err(|_| NodeUpgradeError::ConnectTimeout(opts.call_timeout))?
    .map_err(NodeUpgradeError::Api)?;
    progress(
        &node.name,
        &format!("pulling the installer {}", hop.installer),
    );
    if plan::uses_lifecycle(host) {
        match puller.pull(&hop.installer).await {
            Ok(_) => {
                progress(&node.name, "installing");
                let code = puller
                    .lifecycle_upgrade(&hop.installer, &|m| {
                        progress(&node.name, &one_line(m));
                    })
                    .await
                    .map_err(|e| refused(e, run))?;
                if code != 0 {
                    return Err(NodeUpgradeError::InstallerExit {
                        code,
                        running: host.to_owned(),
                    });
                }
                // Reboot does not drain (talosctl drains first). A SIGINT
                // meanwhile stops the run saying what the drain left.
                let sigint = drain::InterruptibleDrain::new();
                let tell = |m: &str| progress(&node.name, m);
                let ours = tokio::select! {
                    drained = drain::cordon_and_drain(plan, &node.name, run.drain_timeout, opts, &tell) => drained?,
                    () = sigint.interrupted() => return Err(drain::interrupted_drain(&node.name).into()),
                };
                drop(sigint);
                let rebooted = async {
                    NodeClient::connect(&node.endpoint, &mode, opts.call_timeout)
                        .await?
                        .reboot(up.reboot_mode)
                        .await
                };
                return match rebooted.await {
                    Ok(()) => Ok(ours),
                    Err(e) => {
                        // As talosctl's deferred uncordon: not left cordoned
                        // (by imgbuild; an admin's cordon stays).
                        let uncordon = match ours {
                            true => drain::uncordon_when_ready(
                                plan,
                                &node.name,
                                opts.call_timeout,
                                opts,
                            )
                            .await
                            .err(),
                            false => None,
                        };
                        Err(NodeUpgradeError::Reboot {
                            source: e,
                            uncordon,
                        })
                    }
                };
            }
            // A node that does not offer the newer API takes the old one.
            Err(e) if e.code() == Some(tonic::Code::Unimplemented) => {}
            Err(e) => return Err(refused(e, run)),
        }
    }
    let flags = UpgradeFlags {
        preserve: plan::sends_preserve(host),
        force: up.force,
        reboot_mode: up.reboot_mode,
    };
    puller
        .upgrade(&hop.installer, flags)
        .await
        .map(|_| false)
        .map_err(|e| refused(e, run))
}

/// Moves one node through its hops, recording each in `record`.
#[allow(clippy::too_many_arguments)]
async fn upgrade_node(
    plan: &Plan,
    node: &PlannedNode,
    np: &NodePlan,
    up: &UpgradePlan,
    record: &std::sync::Mutex<(Record, Option<String>)>,
    record_path: &Path,
    run: &RunOptions,
    opts: &Options,
    progress: &(dyn Fn(&str, &str) + Sync),
) -> Result<(), NodeUpgradeError> {
    let mode = Mode::Mtls(plan.identity.clone());
    let save = |f: &dyn Fn(&mut Record)| {
        let mut guard = record.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut guard.0);
        if let Err(e) = guard.0.save(record_path) {
            guard.1 = Some(format!("{}: {e}", record_path.display()));
        }
    };
    if np.hops.len() > 1 {
        let path: Vec<String> = std::iter::once(np.from.version.clone().unwrap_or_default())
            .chain(np.hops.iter().map(|h| h.version.clone()))
            .collect();
        save(&|r: &mut Record| {
            r.paths.insert(node.name.clone(), path.clone());
        });
    }
    for hop in &np.hops {
        wait_healthy(plan, node, opts).await?;
        let conn = NodeClient::connect(&node.endpoint, &mode, opts.call_timeout)
            .await
            .map_err(NodeUpgradeError::Api)?;
        let before = conn.version().await.map_err(NodeUpgradeError::Api)?.tag;
        let old_boot = boot_id(&conn).await.map_err(NodeUpgradeError::BootId)?;
        drop(conn);
        progress(
            &node.name,
            &format!("upgrading {} → {}", one_line(&before), hop.version),
        );
        if plan::uses_lifecycle(&before) {
            // Before the cordon: a run killed while the node is cordoned
            // leaves the uncordon to the next run.
            save(&|r: &mut Record| {
                r.cordoned.insert(node.name.clone());
            });
        }
        let cordoned = request_hop(plan, node, &before, hop, up, run, opts, progress).await?;
        progress(&node.name, "waiting for the node to reboot");
        let now = wait_rebooted(
            plan,
            node,
            old_boot.as_deref(),
            &before,
            run.node_timeout,
            opts,
        )
        .await?;
        if cordoned {
            progress(&node.name, "waiting for Ready to uncordon it");
            drain::uncordon_when_ready(plan, &node.name, run.node_timeout, opts).await?;
        }
        save(&|r: &mut Record| {
            r.cordoned.remove(&node.name);
        });
        if now != hop.version {
            return Err(NodeUpgradeError::KeptOld {
                now,
                wanted: hop.version.clone(),
            });
        }
        save(&|r: &mut Record| {
            r.nodes.insert(
                node.name.clone(),
                Installed {
                    version: hop.version.clone(),
                    schematic: np.to.schematic.clone(),
                    installer: hop.installer.clone(),
                },
            );
        });
        progress(&node.name, &format!("runs {}", hop.version));
    }
    save(&|r: &mut Record| {
        r.paths.remove(&node.name);
    });
    let conn = NodeClient::connect(&node.endpoint, &mode, opts.call_timeout)
        .await
        .map_err(NodeUpgradeError::Api)?;
    // A node without the factory's `schematic` extension cannot say; the
    // installer it booted is then the record's word.
    match conn.running_schematic().await {
        Ok(Some(s)) if s != np.to.schematic && s != np.to.own_schematic => {
            return Err(NodeUpgradeError::WrongSchematic {
                runs: s,
                wanted: np.to.schematic.clone(),
            });
        }
        Ok(_) => {}
        Err(e) => {
            return Err(NodeUpgradeError::SchematicUnread {
                version: np.to.version.clone(),
                source: e,
            });
        }
    }
    drop(conn);
    configure_node(plan, node, opts).await
}

/// Applies the rendered config (which names the new installer) without a
/// reboot, then waits for the cluster to be healthy: the last step of a
/// node's upgrade, and all of it for a node a stopped run left on the
/// target with its old config ([`Action::Config`]).
async fn configure_node(
    plan: &Plan,
    node: &PlannedNode,
    opts: &Options,
) -> Result<(), NodeUpgradeError> {
    let mode = Mode::Mtls(plan.identity.clone());
    let conn = NodeClient::connect(&node.endpoint, &mode, opts.call_timeout)
        .await
        .map_err(NodeUpgradeError::Api)?;
    conn.apply_mode(node.config.clone(), ApplyMode::NoReboot, false)
        .await
        .map_err(NodeUpgradeError::Configure)?;
    Ok(wait_healthy(plan, node, opts).await?)
}

/// Executes `up`: warms the factory, then control planes one at a time,
/// then workers `run.parallel` at a time; stops at the first failure.
/// Nothing runs when the plan refuses. Blocking.
pub fn execute(
    factory: &Factory,
    plan: &Plan,
    up: &UpgradePlan,
    record_path: &Path,
    run: &RunOptions,
    opts: &Options,
    progress: &(dyn Fn(&str, &str) + Sync),
) -> Result<UpgradeReport, UpgradeError> {
    let mut report = UpgradeReport::default();
    if let Some(why) = &up.refusal {
        report.refused = Some(why.clone());
        return Ok(report);
    }
    report.notes = up.notes.clone();
    if up.has_work() {
        report.notes.extend(warm(factory, up));
    }
    let record = Record::load(record_path)?;
    let rt = runtime()?;
    let touches_control_plane = up
        .nodes
        .iter()
        .any(|np| np.control_plane && np.action == Action::Upgrade);
    if touches_control_plane
        && let Some(file) =
            rt.block_on(super::etcd::snapshot_before_change(&run.etcd, plan, opts))?
    {
        report.notes.push(format!(
            "etcd snapshot: {} ({} bytes, from {})",
            file.path.display(),
            file.info.size,
            file.node
        ));
    }
    rt.block_on(run_plan(
        plan,
        up,
        record,
        record_path,
        run,
        opts,
        progress,
        &mut report,
    ));
    Ok(report)
}

/// The nodes a stopped run left cordoned: those the cluster shows with
/// imgbuild's mark ([`crate::talos::health::CORDONED_BY`]), the nodes
/// being the truth (a run killed on another runner left no record here),
/// and those the record names. Only nodes of the inventory count from the
/// cluster; the record's other names are dropped with a note below.
pub fn cordons_left(
    record: &std::collections::BTreeSet<String>,
    cluster: &[super::health::KubeNode],
    inventory: &[&str],
) -> Vec<String> {
    let mut out: std::collections::BTreeSet<String> = record.clone();
    out.extend(
        cluster
            .iter()
            .filter(|n| n.cordoned_by_imgbuild && inventory.contains(&n.name.as_str()))
            .map(|n| n.name.clone()),
    );
    out.into_iter().collect()
}

/// Uncordons the nodes a stopped run left cordoned ([`cordons_left`]),
/// once each is Ready (waiting one call timeout); a node not Ready yet
/// stays in the record for the next run, and the report says so.
async fn uncordon_left(
    plan: &Plan,
    mut record: Record,
    record_path: &Path,
    opts: &Options,
    report: &mut UpgradeReport,
) -> Record {
    // Unread is no cordon: the health gate before each node still stops
    // the run on a node left unschedulable.
    let cluster = super::health::kube_nodes(plan, opts)
        .await
        .unwrap_or_default();
    let names: Vec<&str> = plan.nodes.iter().map(|n| n.name.as_str()).collect();
    let left = cordons_left(&record.cordoned, &cluster, &names);
    if left.is_empty() {
        return record;
    }
    for name in left {
        // A name that is no node of this cluster costs no call: a record
        // is a hint, checked against the cluster.
        if !plan.nodes.iter().any(|n| n.name == name) {
            record.cordoned.remove(&name);
            report.notes.push(format!(
                "{}: in the upgrade record as cordoned, but no node of the inventory: dropped",
                crate::input::excerpt(&name, 64)
            ));
            continue;
        }
        match drain::uncordon_when_ready(plan, &name, opts.call_timeout, opts).await {
            Ok(drain::Uncordon::Done) => {
                record.cordoned.remove(&name);
                report.notes.push(format!(
                    "{name}: uncordoned (a stopped run had cordoned it for its reboot)"
                ));
            }
            Ok(drain::Uncordon::NotOurs) => {
                record.cordoned.remove(&name);
                report.notes.push(format!(
                    "{name}: cordoned, but not by imgbuild (no {} mark): left cordoned",
                    crate::talos::health::CORDONED_BY
                ));
            }
            Err(e) => {
                // Kept for the next run, also where only the mark said so.
                record.cordoned.insert(name.clone());
                report.notes.push(format!(
                    "{name}: a stopped run cordoned it and it is still cordoned: {e}"
                ));
            }
        }
    }
    if let Err(e) = record.save(record_path) {
        report.record_error = Some(format!("{}: {e}", record_path.display()));
    }
    record
}

#[allow(clippy::too_many_arguments)]
async fn run_plan(
    plan: &Plan,
    up: &UpgradePlan,
    record: Record,
    record_path: &Path,
    run: &RunOptions,
    opts: &Options,
    progress: &(dyn Fn(&str, &str) + Sync),
    report: &mut UpgradeReport,
) {
    let record = std::sync::Mutex::new((
        uncordon_left(plan, record, record_path, opts, report).await,
        None,
    ));
    let node_of = |name: &str| plan.nodes.iter().find(|n| n.name == name);
    let mut batches: Vec<Vec<&NodePlan>> = Vec::new();
    let mut workers = Vec::new();
    for np in &up.nodes {
        match np.action {
            Action::Done => report.unchanged.push(np.node.clone()),
            Action::SchematicUnknown => report.schematic_unknown.push(np.node.clone()),
            Action::Upgrade | Action::Config | Action::Blocked if np.control_plane => {
                batches.push(vec![np])
            }
            Action::Upgrade | Action::Config | Action::Blocked => workers.push(np),
        }
    }
    batches.extend(workers.chunks(run.parallel.max(1)).map(<[_]>::to_vec));
    let run_node = |np: &NodePlan| {
        let np = np.clone();
        let record = &record;
        async move {
            let np = &np;
            if np.action == Action::Blocked {
                return Err(NodeUpgradeError::Blocked(
                    np.problem.clone().unwrap_or_default(),
                ));
            }
            let Some(node) = node_of(&np.node) else {
                return Err(NodeUpgradeError::NotInPlan);
            };
            if np.action == Action::Config {
                if node.role == Role::Controlplane {
                    wait_healthy(plan, node, opts).await?;
                }
                progress(
                    &node.name,
                    "applying the config that names the new installer",
                );
                return configure_node(plan, node, opts).await;
            }
            upgrade_node(plan, node, np, up, record, record_path, run, opts, progress).await
        }
    };
    let mut rest = batches.into_iter();
    for batch in rest.by_ref() {
        let results = futures_util::future::join_all(batch.iter().map(|np| async {
            let started = Instant::now();
            let result = run_node(np).await;
            (result, started.elapsed())
        }))
        .await;
        for (np, (r, took)) in batch.iter().zip(results) {
            report.node_seconds.insert(
                np.node.clone(),
                (took.as_secs_f64() * 1000.0).round() / 1000.0,
            );
            match r {
                Ok(()) if np.action == Action::Config => report.configured.push(np.node.clone()),
                Ok(()) => report.upgraded.push(np.node.clone()),
                Err(error) if report.failed.is_none() => {
                    report.failed = Some(Failure {
                        node: np.node.clone(),
                        error: error.to_string(),
                    })
                }
                Err(e) => report.untouched.push(format!("{} ({e})", np.node)),
            }
        }
        if report.failed.is_some() {
            break;
        }
    }
    report
        .untouched
        .extend(rest.flatten().map(|np| np.node.clone()));
    let record = record.into_inner().unwrap_or_else(|e| e.into_inner());
    report.record_error = record.1;
    let order: Vec<&PlannedNode> = up.nodes.iter().filter_map(|np| node_of(&np.node)).collect();
    let now = running_all(plan, &order, &record.0, opts).await;
    for (np, r) in up.nodes.iter().zip(now) {
        // A node planned as done that no longer runs its target changed
        // under the run: it is not "unchanged".
        if np.action == Action::Done && r.version.as_deref() != Some(np.to.version.as_str()) {
            report.unchanged.retain(|n| *n != np.node);
            report.changed_during_run.push(format!(
                "{} ran {} when planned, {} now",
                np.node,
                np.to.version,
                r.version
                    .as_deref()
                    .map_or("nothing readable".into(), one_line)
            ));
        }
        report
            .versions
            .insert(np.node.clone(), r.version.map(|v| one_line(&v)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wanted() -> Wanted {
        Wanted {
            version: "v1.11.5".into(),
            installer: "f/metal-installer/b:v1.11.5".into(),
            schematic: "b".into(),
            own_schematic: "o".into(),
            secure_boot: false,
        }
    }

    #[test]
    fn a_node_is_done_on_the_target_version_and_either_schematic() {
        let run = |v: &str, s: Option<&str>| Running {
            version: Some(v.into()),
            schematic: s.map(str::to_owned),
            ..Running::default()
        };
        assert!(run("v1.11.5", Some("b")).is(&wanted()));
        assert!(run("v1.11.5", Some("o")).is(&wanted()));
        assert!(!run("v1.11.2", Some("b")).is(&wanted()));
        assert!(!run("v1.11.5", Some("x")).is(&wanted()));
        assert!(!run("v1.11.5", None).is(&wanted()));
    }

    fn kube(name: &str, cordoned: bool, ours: bool) -> crate::talos::health::KubeNode {
        crate::talos::health::KubeNode {
            name: name.into(),
            ready: true,
            cordoned,
            cordoned_by_imgbuild: ours,
        }
    }

    #[test]
    fn cordons_left_come_from_the_nodes_marks_as_well_as_the_record() {
        // A fresh runner has no record: the marks on the nodes name the
        // cordons a killed run left. An admin's cordon (no mark) and a
        // marked node the inventory no longer has are not ours to undo.
        let cluster = [
            kube("cp-01", true, true),
            kube("cp-02", false, false),
            kube("w-01", true, false),
            kube("old-w", true, true),
        ];
        let inventory = ["cp-01", "cp-02", "w-01"];
        let none = std::collections::BTreeSet::new();
        assert_eq!(cordons_left(&none, &cluster, &inventory), ["cp-01"]);
        let recorded: std::collections::BTreeSet<String> =
            ["w-01".to_owned(), "ghost".to_owned()].into();
        assert_eq!(
            cordons_left(&recorded, &cluster, &inventory),
            ["cp-01", "ghost", "w-01"],
            "the record's names are checked by the caller"
        );
        assert!(cordons_left(&none, &[], &inventory).is_empty());
    }

    #[test]
    fn an_unreadable_record_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("upgrades.json");
        std::fs::write(&path, "{\"nodes\": 7}").unwrap();
        let e = Record::load(&path).unwrap_err().to_string();
        assert!(e.contains(&path.display().to_string()), "{e}");
        assert!(e.contains("not an upgrade record"), "{e}");
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        let e = Record::load(&path).unwrap_err().to_string();
        assert!(e.contains("directory"), "{e}");
    }

    #[test]
    fn a_recorded_path_that_is_not_one_hop_a_minor_upwards_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("upgrades.json");
        let with = |p: &str| {
            std::fs::write(
                &path,
                format!("{{\"nodes\": {{}}, \"paths\": {{\"w\\u001b1\": {p}}}}}"),
            )
            .unwrap();
            Record::load(&path)
        };
        with(r#"["v1.10.9", "v1.11.5"]"#).unwrap();
        with(r#"["v1.11.2"]"#).unwrap();
        for (p, why) in [
            (
                r#"["v1.11.5", "v1.10.9"]"#,
                "does not ascend at \"v1.10.9\"",
            ),
            (r#"["v1.11.5", "v1.11.5"]"#, "does not ascend"),
            (
                r#"["latest"]"#,
                "\"latest\" in its path is not a Talos version",
            ),
            ("[]", "a path of 0 versions"),
        ] {
            let e = with(p).unwrap_err().to_string();
            assert!(e.contains(why), "{p}: {e}");
            assert!(e.contains("node \"w\\u{1b}1\""), "the name is escaped: {e}");
        }
        let long: Vec<String> = (0..40).map(|i| format!("\"v1.{i}.0\"")).collect();
        let e = with(&format!("[{}]", long.join(",")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("a path of 40 versions (1 to 32)"), "{e}");
    }

    #[test]
    fn a_record_of_more_cordoned_nodes_than_a_run_leaves_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("upgrades.json");
        let with = |names: Vec<String>| {
            std::fs::write(
                &path,
                serde_json::json!({"nodes": {}, "cordoned": names}).to_string(),
            )
            .unwrap();
            Record::load(&path)
        };
        with((0..1000).map(|i| format!("n{i}")).collect()).unwrap();
        let e = with((0..1001).map(|i| format!("n{i}")).collect())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("1001 cordoned nodes recorded (at most 1000)"),
            "{e}"
        );
        let e = with(vec!["x".repeat(254)]).unwrap_err().to_string();
        assert!(e.contains("is no node name"), "{e}");
    }

    #[test]
    fn the_record_answers_only_for_nodes_that_cannot_and_run_its_version() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("upgrades.json");
        assert_eq!(Record::load(&path).unwrap(), Record::default());
        let mut record = Record::default();
        record.nodes.insert(
            "w1".into(),
            Installed {
                version: "v1.11.5".into(),
                schematic: "b".into(),
                installer: "f/metal-installer/b:v1.11.5".into(),
            },
        );
        record.save(&path).unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        let record = Record::load(&path).unwrap();
        let mut silent = Running {
            version: Some("v1.11.5".into()),
            ..Running::default()
        };
        record.fill("w1", &mut silent);
        assert_eq!(silent.schematic.as_deref(), Some("b"));
        let mut older = Running {
            version: Some("v1.11.2".into()),
            ..Running::default()
        };
        record.fill("w1", &mut older);
        assert_eq!(older.schematic, None, "the record is about another version");
        let mut speaks = Running {
            version: Some("v1.11.5".into()),
            schematic: Some("x".into()),
            ..Running::default()
        };
        record.fill("w1", &mut speaks);
        assert_eq!(
            speaks.schematic.as_deref(),
            Some("x"),
            "the node's own word wins"
        );
    }
}
