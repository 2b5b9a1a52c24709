//! `imgbuild upgrade`: moves nodes to the inventory's Talos version and
//! schematic, control planes one at a time first, then the workers, with
//! the cluster healthy between nodes. A node is done when it runs the
//! target version and its running schematic is the target; a rerun
//! continues where a stopped run left off.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
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
    /// The node's own schematic (with META): a factory-route node reports
    /// it until its first upgrade on the base installer, and runs what the
    /// inventory asks for all the same.
    pub own_schematic: String,
}

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
                    installer: crate::schematic::installer::installer_of(inv, &id),
                    schematic: id.to_string(),
                    own_schematic: own.to_string(),
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
        self.version.as_deref() == Some(wanted.version.as_str()) && self.schematic_is(wanted)
    }

    /// Whether the node runs the wanted schematic (the base one, or its
    /// own with META, as a factory-route node does before any upgrade).
    pub fn schematic_is(&self, wanted: &Wanted) -> bool {
        self.schematic
            .as_deref()
            .is_some_and(|s| s == wanted.schematic || s == wanted.own_schematic)
    }
}

/// What `upgrade` installed on each node, kept in the state dir
/// (`upgrades.json`, by node): the running schematic for nodes that cannot
/// report theirs (an image without the factory's `schematic` extension).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Record {
    pub nodes: BTreeMap<String, Installed>,
}

/// One node's entry in the [`Record`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Installed {
    pub version: String,
    pub schematic: String,
    pub installer: String,
}

impl Record {
    /// The record at `path`; an absent or unreadable one is empty (it is a
    /// fallback, never the only source).
    pub fn load(path: &Path) -> Record {
        crate::input::read_text(path, crate::input::MAX_TEXT_FILE)
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or_default()
    }

    /// Writes the record atomically (0600, beside the secrets).
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        let text = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        crate::atomic::write_if_changed(path, &text, true).map(|_| ())
    }

    /// Fills in `running`'s schematic from the record when the node did not
    /// report one and runs the version the record says it installed.
    pub fn fill(&self, node: &str, running: &mut Running) {
        if running.schematic.is_none()
            && let Some(i) = self.nodes.get(node)
            && running.version.as_deref() == Some(i.version.as_str())
        {
            running.schematic = Some(i.schematic.clone());
        }
    }
}

/// What a run did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct UpgradeOutcome {
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
    /// The state dir's record could not be written.
    pub record_error: Option<String>,
}

/// Reads what `node` runs, straight from its API over mTLS (the schematic
/// from `record` where the node cannot tell).
pub async fn running(plan: &Plan, node: &PlannedNode, record: &Record, opts: &Options) -> Running {
    let mode = Mode::Mtls(plan.identity.clone());
    let conn = match NodeClient::connect(&node.endpoint, &mode, opts.call_timeout).await {
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
    record.fill(&node.name, &mut out);
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
        let services = match NodeClient::connect(&n.endpoint, &mode, opts.call_timeout).await {
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
    let text = crate::input::read_text(&plan.kubeconfig_path, crate::input::MAX_TEXT_FILE)
        .map_err(|e| format!("{}: {e}", plan.kubeconfig_path.display()))?;
    let kc = super::kube::Kubeconfig::parse(&text).map_err(|e| e.to_string())?;
    let timeout = opts.call_timeout;
    let nodes = tokio::task::spawn_blocking(move || kc.node_readiness(timeout))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    Ok(nodes.into_iter().map(|n| (n.name, n.ready)).collect())
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
    let conn = NodeClient::connect(&node.endpoint, &mode, opts.call_timeout)
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
        if port_closed(node.endpoint.addr).await {
            went_down = true;
        } else if went_down
            && let Ok(c) = NodeClient::connect(&node.endpoint, &mode, opts.call_timeout).await
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
    // A node without the factory's `schematic` extension cannot say; the
    // installer it booted is then the record's word.
    let schematic = conn.running_schematic().await.map_err(|e| e.to_string())?;
    if let Some(s) = schematic.filter(|s| *s != wanted.schematic) {
        return Err(format!("runs schematic {s}, not {}", wanted.schematic));
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
    record_path: &Path,
    opts: &Options,
    progress: &(dyn Fn(&str, &str) + Sync),
) -> UpgradeOutcome {
    let mut record = Record::load(record_path);
    let mut outcome = UpgradeOutcome::default();
    let order = ordered(plan, select);
    let mut todo = Vec::new();
    for node in &order {
        let now = running(plan, node, &record, opts).await;
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
                Ok(()) => {
                    let w = &wanted[&n.name];
                    record.nodes.insert(
                        n.name.clone(),
                        Installed {
                            version: w.version.clone(),
                            schematic: w.schematic.clone(),
                            installer: w.installer.clone(),
                        },
                    );
                    if let Err(e) = record.save(record_path) {
                        outcome.record_error = Some(format!("{}: {e}", record_path.display()));
                    }
                    outcome.upgraded.push(n.name.clone());
                }
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
        outcome.versions.insert(
            node.name.clone(),
            running(plan, node, &record, opts).await.version,
        );
    }
    outcome
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
        }
    }

    #[test]
    fn a_node_is_done_on_the_target_version_and_either_schematic() {
        let run = |v: &str, s: Option<&str>| Running {
            version: Some(v.into()),
            schematic: s.map(str::to_owned),
            error: None,
        };
        assert!(run("v1.11.5", Some("b")).is(&wanted()));
        assert!(run("v1.11.5", Some("o")).is(&wanted()));
        assert!(!run("v1.11.2", Some("b")).is(&wanted()));
        assert!(!run("v1.11.5", Some("x")).is(&wanted()));
        assert!(!run("v1.11.5", None).is(&wanted()));
    }

    #[test]
    fn the_record_answers_only_for_nodes_that_cannot_and_run_its_version() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("upgrades.json");
        assert_eq!(Record::load(&path), Record::default());
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
        let record = Record::load(&path);
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
            error: None,
        };
        record.fill("w1", &mut speaks);
        assert_eq!(
            speaks.schematic.as_deref(),
            Some("x"),
            "the node's own word wins"
        );
    }
}
