//! `imgbuild upgrade`: moves nodes to the inventory's Talos version and
//! schematic, control planes one at a time first, then the workers, with
//! the cluster healthy between nodes. A node is done when it runs the
//! target version and its running schematic is the target; a rerun
//! continues where a stopped run left off.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::bootstrap::{Options, Plan, PlannedNode};
use super::client::{ApplyMode, Mode, NodeClient};
use crate::inventory::Role;

/// What a node should run after the upgrade.
#[derive(Debug, Clone)]
pub struct Wanted {
    /// `v1.11.5`.
    pub version: String,
    /// The installer image (factory host + `<platform>-installer/<base ID>:<version>`).
    pub installer: String,
    /// The base schematic ID (without META) the installer installs.
    pub schematic: String,
}

/// Every node's target, computed here without asking anyone: the
/// inventory's version and the node's base schematic (without META) with
/// its installer ([`crate::factory::installer_for`]).
pub fn wanted(
    inv: &crate::inventory::Inventory,
) -> Result<BTreeMap<String, Wanted>, crate::schematic::EmitError> {
    let version = format!("v{}", inv.cluster.talos_version.trim_start_matches('v'));
    inv.nodes
        .iter()
        .map(|node| {
            let canonical = crate::schematic::base_for_node(inv, node).canonical()?;
            let id = crate::schematic::id_of(&canonical);
            Ok((
                node.name.clone(),
                Wanted {
                    version: version.clone(),
                    installer: crate::factory::installer_of(inv, &id),
                    schematic: id.to_string(),
                },
            ))
        })
        .collect()
}

/// What a node runs now.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Running {
    pub version: Option<String>,
    pub schematic: Option<String>,
    /// Why the node could not tell (unreachable, call failed).
    pub error: Option<String>,
}

impl Running {
    /// Whether the node runs `wanted` already.
    pub fn is(&self, wanted: &Wanted) -> bool {
        self.version.as_deref() == Some(wanted.version.as_str())
            && self.schematic.as_deref() == Some(wanted.schematic.as_str())
    }
}

/// What a run did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Outcome {
    /// Upgraded by this run, in order.
    pub upgraded: Vec<String>,
    /// Already at the target.
    pub unchanged: Vec<String>,
    /// The node that failed and why; nodes after it were not touched.
    pub failed: Option<(String, String)>,
    /// Not reached because of the failure.
    pub untouched: Vec<String>,
    /// What each selected node runs at the end, by node.
    pub versions: BTreeMap<String, Option<String>>,
}

/// Reads what `node` runs, straight from its API over mTLS.
pub async fn running(plan: &Plan, node: &PlannedNode, opts: &Options) -> Running {
    let mode = Mode::Mtls(plan.identity.clone());
    let conn = match NodeClient::connect(&node.target, &mode, opts.call_timeout).await {
        Ok(c) => c,
        Err(e) => {
            return Running {
                error: Some(e.to_string()),
                ..Running::default()
            };
        }
    };
    let mut out = Running::default();
    match conn.version().await {
        Ok(v) => out.version = Some(v.tag),
        Err(e) => out.error = Some(format!("Version: {e}")),
    }
    match conn.running_schematic().await {
        Ok(s) => out.schematic = s,
        Err(e) => out.error = Some(format!("extension status: {e}")),
    }
    out
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

/// Whether a TCP connection to `addr` is refused or times out (the node is
/// rebooting).
async fn port_closed(addr: SocketAddr) -> bool {
    !matches!(
        tokio::time::timeout(
            Duration::from_millis(500),
            tokio::net::TcpStream::connect(addr)
        )
        .await,
        Ok(Ok(_))
    )
}

/// What still keeps the cluster from being healthy around `node`: every
/// control plane answers with etcd healthy, `node` has kubelet healthy
/// and `node` is Ready in Kubernetes.
async fn unhealthy(plan: &Plan, node: &PlannedNode, opts: &Options) -> Vec<String> {
    let mode = Mode::Mtls(plan.identity.clone());
    let mut pending = Vec::new();
    for n in plan
        .nodes
        .iter()
        .filter(|n| n.role == Role::Controlplane || n.name == node.name)
    {
        let services = match NodeClient::connect(&n.target, &mode, opts.call_timeout).await {
            Ok(c) => c.services().await,
            Err(e) => Err(e),
        };
        let services = match services {
            Ok(s) => s,
            Err(e) => {
                pending.push(format!("{}: {e}", n.name));
                continue;
            }
        };
        let mut wanted = Vec::new();
        if n.role == Role::Controlplane {
            wanted.push("etcd");
        }
        if n.name == node.name {
            wanted.push("kubelet");
        }
        for id in wanted {
            let ok = services.iter().any(|s| {
                s.id == id && s.state == "Running" && s.health.as_ref().is_some_and(|h| h.healthy)
            });
            if !ok {
                pending.push(format!("{}: {id} not healthy", n.name));
            }
        }
    }
    match kube_ready(plan, opts).await {
        Ok(list) if list.iter().any(|(n, ready)| *n == node.name && *ready) => {}
        Ok(_) => pending.push(format!("{}: Kubernetes node not Ready", node.name)),
        Err(e) => pending.push(format!("Kubernetes: {e}")),
    }
    pending
}

/// Every Kubernetes node and whether it is Ready, through the kubeconfig
/// the bootstrap wrote into the state dir.
pub(crate) async fn kube_ready(plan: &Plan, opts: &Options) -> Result<Vec<(String, bool)>, String> {
    let text = std::fs::read_to_string(&plan.kubeconfig_path)
        .map_err(|e| format!("{}: {e}", plan.kubeconfig_path.display()))?;
    let kc = super::kube::Kubeconfig::parse(&text).map_err(|e| e.to_string())?;
    let timeout = opts.call_timeout;
    tokio::task::spawn_blocking(move || kc.node_readiness(timeout))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())
}

/// Waits until [`unhealthy`] has nothing to say, at most `opts.health_timeout`.
pub(crate) async fn wait_healthy(
    plan: &Plan,
    node: &PlannedNode,
    opts: &Options,
) -> Result<(), String> {
    let deadline = Instant::now() + opts.health_timeout;
    loop {
        let pending = unhealthy(plan, node, opts).await;
        if pending.is_empty() {
            return Ok(());
        }
        if Instant::now() + opts.poll > deadline {
            return Err(format!(
                "the cluster did not become healthy within {:?}: {}",
                opts.health_timeout,
                pending.join("; ")
            ));
        }
        tokio::time::sleep(opts.poll).await;
    }
}

/// Upgrades one node: waits for a healthy cluster, sends the Upgrade, sees
/// the port close and mTLS come back, checks the new version and
/// schematic (the same old version means the installer failed and Talos
/// kept running), brings its config to the rendered one, waits for health.
async fn upgrade_one(
    plan: &Plan,
    node: &PlannedNode,
    wanted: &Wanted,
    opts: &Options,
    progress: &(dyn Fn(&str, &str) + Sync),
) -> Result<(), String> {
    let mode = Mode::Mtls(plan.identity.clone());
    wait_healthy(plan, node, opts).await?;
    let conn = NodeClient::connect(&node.target, &mode, opts.call_timeout)
        .await
        .map_err(|e| e.to_string())?;
    let before = conn.version().await.map_err(|e| e.to_string())?.tag;
    progress(
        &node.name,
        &format!(
            "upgrading {before} → {} ({})",
            wanted.version, wanted.installer
        ),
    );
    conn.upgrade(&wanted.installer)
        .await
        .map_err(|e| format!("Upgrade refused: {e}"))?;
    drop(conn);
    let deadline = Instant::now() + opts.node_timeout;
    let mut went_down = false;
    let back = loop {
        if Instant::now() > deadline {
            return Err(if went_down {
                format!("did not come back within {:?}", opts.node_timeout)
            } else {
                format!("did not reboot within {:?}", opts.node_timeout)
            });
        }
        if port_closed(node.target.addr).await {
            went_down = true;
        } else if went_down
            && let Ok(c) = NodeClient::connect(&node.target, &mode, opts.call_timeout).await
            && let Ok(v) = c.version().await
        {
            break (c, v.tag);
        }
        tokio::time::sleep(opts.poll.min(Duration::from_millis(200))).await;
    };
    let (conn, tag) = back;
    if tag != wanted.version {
        return Err(format!(
            "came back on {tag}, not {}: the installer failed and Talos kept running the old version",
            wanted.version
        ));
    }
    let schematic = conn.running_schematic().await.map_err(|e| e.to_string())?;
    if schematic.as_deref() != Some(wanted.schematic.as_str()) {
        return Err(format!(
            "runs schematic {}, not {}",
            schematic.as_deref().unwrap_or("(none)"),
            wanted.schematic
        ));
    }
    conn.apply_mode(node.config.clone(), ApplyMode::NoReboot, false)
        .await
        .map_err(|e| format!("applying the rendered config after the upgrade: {e}"))?;
    wait_healthy(plan, node, opts).await?;
    progress(&node.name, &format!("runs {tag}"));
    Ok(())
}

/// Upgrades the selected nodes (all when `select` is empty) that do not
/// run their target yet: control planes one at a time, then workers,
/// `parallel` at a time; stops at the first failure.
pub async fn run(
    plan: &Plan,
    wanted: &BTreeMap<String, Wanted>,
    select: &[String],
    parallel: usize,
    opts: &Options,
    progress: &(dyn Fn(&str, &str) + Sync),
) -> Outcome {
    let mut outcome = Outcome::default();
    let order = ordered(plan, select);
    let mut todo = Vec::new();
    for node in &order {
        let now = running(plan, node, opts).await;
        if now.is(&wanted[&node.name]) {
            outcome.unchanged.push(node.name.clone());
        } else {
            todo.push(*node);
        }
    }
    let (cps, workers): (Vec<_>, Vec<_>) =
        todo.into_iter().partition(|n| n.role == Role::Controlplane);
    let mut batches: Vec<Vec<&PlannedNode>> = cps.into_iter().map(|n| vec![n]).collect();
    batches.extend(workers.chunks(parallel.max(1)).map(<[_]>::to_vec));
    let mut rest = batches.into_iter();
    for batch in rest.by_ref() {
        let results = futures_util::future::join_all(
            batch
                .iter()
                .map(|n| upgrade_one(plan, n, &wanted[&n.name], opts, progress)),
        )
        .await;
        for (n, r) in batch.iter().zip(results) {
            match r {
                Ok(()) => outcome.upgraded.push(n.name.clone()),
                Err(e) if outcome.failed.is_none() => {
                    outcome.failed = Some((n.name.clone(), e));
                }
                Err(e) => outcome.untouched.push(format!("{} ({e})", n.name)),
            }
        }
        if outcome.failed.is_some() {
            break;
        }
    }
    outcome
        .untouched
        .extend(rest.flatten().map(|n| n.name.clone()));
    for node in &order {
        outcome
            .versions
            .insert(node.name.clone(), running(plan, node, opts).await.version);
    }
    outcome
}
