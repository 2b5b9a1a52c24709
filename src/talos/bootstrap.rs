//! The bootstrap state machine: every node from "port closed" through
//! maintenance mode and apply to mTLS, etcd bootstrapped once on the first
//! control plane's own address, then health as talosctl judges it.
//!
//! Each wait knows the state it is in, so a timeout says where the node got
//! stuck and what that usually means.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::client::{self, ApiError, Mode, NodeClient, NodeEndpoint, Probe};
use super::etcd::recover;
use super::kube::{self, Kubeconfig};
use super::talosconfig::Identity;
use crate::inventory::Role;

/// One node as the bootstrap needs it.
#[derive(Clone)]
pub struct PlannedNode {
    pub name: String,
    pub role: Role,
    pub address: IpAddr,
    pub endpoint: NodeEndpoint,
    pub install_disk: String,
    /// The rendered machine config (contains secrets; never logged).
    pub config: Vec<u8>,
}

impl fmt::Debug for PlannedNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PlannedNode")
            .field("name", &self.name)
            .field("target", &self.endpoint)
            .finish_non_exhaustive()
    }
}

/// Everything one run needs, prepared from the inventory and state dir.
#[derive(Debug, Clone)]
pub struct Plan {
    /// In inventory order.
    pub nodes: Vec<PlannedNode>,
    /// The node etcd is bootstrapped on, as the stage decided (the first
    /// control plane).
    pub bootstrap_node: Option<String>,
    /// `https://host:port`, possibly on the VIP.
    pub endpoint: String,
    /// `cluster.vip`: names the setting when the endpoint on it does not answer.
    pub vip: Option<IpAddr>,
    /// `cluster.kubernetesEndpoint`: where this host reaches the API
    /// (a port forward), used instead of `endpoint` and the VIP.
    pub kubernetes_endpoint: Option<String>,
    pub identity: Arc<Identity>,
    /// The state dir's admin kubeconfig: written by the bootstrap, read
    /// while it is one for these secrets (same Kubernetes CA).
    pub kubeconfig_path: PathBuf,
    /// False for a sealed cluster (secrets from SOPS): a kubeconfig holds
    /// a key, so the bootstrap writes none and every read uses the one
    /// minted from the secrets, in memory.
    pub write_kubeconfig: bool,
    /// The admin kubeconfig minted from the secrets when the state dir has
    /// none for them (a fresh CI runner), held in memory for the run.
    pub admin_kube: kube::AdminKube,
}

/// Limits and knobs; defaults suit real hardware.
#[derive(Debug, Clone)]
pub struct Options {
    /// Per node: from "port closed" to "answers over mTLS".
    pub node_timeout: Duration,
    /// Bootstrap retries (time sync, etcd not ready yet).
    pub bootstrap_timeout: Duration,
    /// From bootstrap to every health check passing.
    pub health_timeout: Duration,
    /// One API call.
    pub call_timeout: Duration,
    /// Pause between polls.
    pub poll: Duration,
    /// SHA-256 of the maintenance certificate to accept (all nodes).
    pub pin: Option<String>,
    /// Bootstrap etcd from this snapshot instead of empty
    /// (`bootstrap --recover-from`, see [`recover::recover`]).
    pub recover_from: Option<PathBuf>,
    /// The recovery file is a copy of an etcd data directory's database,
    /// not a snapshot: Talos skips its hash check (`recover_skip_hash_check`).
    pub recover_skip_hash_check: bool,
    /// Control planes on their way out: of record but gone from the
    /// inventory (`up` removes them after the health check), so etcd may
    /// still list them as members.
    pub leaving: Vec<String>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            node_timeout: Duration::from_secs(600),
            bootstrap_timeout: Duration::from_secs(300),
            health_timeout: Duration::from_secs(900),
            call_timeout: Duration::from_secs(15),
            poll: Duration::from_secs(2),
            pin: None,
            recover_from: None,
            recover_skip_hash_check: false,
            leaving: Vec::new(),
        }
    }
}

/// What happened, for the progress display.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    WaitingForPort,
    PortOpen,
    Maintenance {
        fingerprint: String,
    },
    Applying,
    Applied {
        details: String,
    },
    PortClosed,
    StillInMaintenance,
    Configured {
        version: String,
    },
    Bootstrapping,
    BootstrapRetry {
        reason: String,
    },
    Bootstrapped,
    AlreadyBootstrapped,
    Waiting {
        pending: Vec<String>,
    },
    Kubeconfig {
        server: String,
        /// The server the kubeconfig on disk pointed at before (the first
        /// control plane, until the endpoint answered).
        moved_from: Option<String>,
    },
    Healthy,
    /// Talos healthy, Kubernetes nodes NotReady for want of a CNI.
    NoCni,
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Event::WaitingForPort => write!(f, "waiting for port {} to open", client::PORT),
            Event::PortOpen => write!(f, "port open, probing TLS"),
            Event::Maintenance { fingerprint } => write!(
                f,
                "maintenance mode (certificate sha256 {})",
                &fingerprint[..fingerprint.len().min(16)]
            ),
            Event::Applying => write!(f, "applying machine config (insecure, maintenance API)"),
            Event::Applied { details } if details.is_empty() => write!(f, "config applied"),
            Event::Applied { details } => write!(f, "config applied: {details}"),
            Event::PortClosed => write!(f, "port closed (rebooting?), waiting"),
            Event::StillInMaintenance => write!(f, "still in maintenance mode, waiting"),
            Event::Configured { version } => write!(f, "configured, mTLS ok, Talos {version}"),
            Event::Bootstrapping => write!(f, "bootstrapping etcd"),
            Event::BootstrapRetry { reason } => write!(f, "bootstrap not possible yet: {reason}"),
            Event::Bootstrapped => write!(f, "etcd bootstrapped"),
            Event::AlreadyBootstrapped => write!(f, "etcd already bootstrapped, nothing to do"),
            Event::Waiting { pending } => {
                write!(f, "waiting for {} check(s):", pending.len())?;
                pending.iter().try_for_each(|p| write!(f, "\n    - {p}"))
            }
            Event::Kubeconfig {
                server,
                moved_from: None,
            } => write!(f, "kubeconfig written (server {server})"),
            Event::Kubeconfig {
                server,
                moved_from: Some(from),
            } => write!(
                f,
                "kubeconfig moved from {from} to {server}: the endpoint answers now"
            ),
            Event::Healthy => write!(f, "cluster healthy"),
            Event::NoCni => write!(
                f,
                "Talos healthy, Kubernetes nodes NotReady: no CNI (cluster.network.cni.name: none)"
            ),
        }
    }
}

/// Receives events as they happen (the CLI prints them).
pub trait Observer: Send + Sync {
    fn event(&self, node: &str, event: &Event);
}

/// What one run did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BootstrapOutcome {
    /// Nodes that got a config in this run.
    pub applied: Vec<String>,
    /// Nodes that were already configured.
    pub already_configured: Vec<String>,
    /// Whether this run bootstrapped etcd (false: it already was).
    pub bootstrapped: bool,
    pub bootstrap_node: String,
    pub kubeconfig_server: String,
    /// The server the kubeconfig pointed at before this run moved it to
    /// the endpoint (the VIP once it answers).
    pub kubeconfig_moved_from: Option<String>,
    /// Talos version per node.
    pub versions: BTreeMap<String, String>,
    /// Per node, whether Kubernetes called it Ready in the last health round.
    pub ready: BTreeMap<String, bool>,
    /// Healthy, or healthy as far as Talos goes but without a CNI.
    pub health: Health,
    /// Settings that did not work as given, and what was used instead.
    pub fallbacks: Vec<Fallback>,
    pub elapsed_ms: u128,
}

/// How far the cluster got when the run ended without an error.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(
    rename_all = "camelCase",
    rename_all_fields = "camelCase",
    tag = "state"
)]
pub enum Health {
    /// Every check passed: Talos services, etcd, every Kubernetes node Ready.
    Healthy,
    /// Talos and etcd are healthy and every node registered, but the config
    /// sets `cluster.network.cni.name: none` and brings no manifest, so no
    /// pod network comes up and the kubelets stay NotReady for good.
    NoCni {
        /// The nodes Kubernetes reports NotReady.
        not_ready: Vec<String>,
        /// The Ready condition's message, as the kubelet put it.
        message: String,
    },
}

impl Health {
    pub fn is_healthy(&self) -> bool {
        *self == Health::Healthy
    }
}

impl fmt::Display for Health {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Health::Healthy => f.write_str("healthy"),
            Health::NoCni { not_ready, message } => {
                write!(
                    f,
                    "Talos and etcd are healthy, but Kubernetes reports {} NotReady",
                    not_ready.join(", ")
                )?;
                if !message.is_empty() {
                    write!(f, " ({message})")?;
                }
                write!(f, ":\n  {HINT_NO_CNI}")
            }
        }
    }
}

/// A setting that did not work as given, and what was used instead.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Fallback {
    /// The inventory field: `cluster.vip` or `cluster.endpoint`.
    pub setting: String,
    /// What it asked for.
    pub wanted: String,
    /// What was used: the first control plane's own address.
    pub used: String,
    /// The node `used` belongs to.
    pub node: String,
    /// What was seen when `wanted` was tried.
    pub reason: String,
}

impl fmt::Display for Fallback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} did not answer ({}), so the kubeconfig points at {} ({})",
            self.setting, self.wanted, self.reason, self.node, self.used
        )
    }
}

/// Why the bootstrap stopped. Messages say the state and what it means.
#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    #[error("node {node}: {state}: {detail}\n  {hint}")]
    Stuck {
        node: String,
        state: String,
        detail: String,
        hint: String,
    },
    #[error("node {node}: {message}")]
    Rejected { node: String, message: String },
    /// Some nodes did not settle. The others were still brought to mTLS,
    /// and etcd bootstrapped when the first control plane was among them.
    #[error("{}\n{}", failed.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"), etcd_note(.etcd.as_ref(), failed))]
    Nodes {
        failed: Vec<BootstrapError>,
        /// (first control plane, bootstrapped now) when etcd runs.
        etcd: Option<(String, bool)>,
        /// The nodes that did settle, each with whether its config was
        /// applied now: what a summary shows beside the failures.
        settled: Vec<(String, bool)>,
    },
    #[error("health checks still failing after {timeout:?}:\n  {}", pending.join("\n  "))]
    Unhealthy {
        timeout: Duration,
        pending: Vec<String>,
    },
    #[error("{0}")]
    Local(String),
}

impl BootstrapError {
    /// The node a failure is about, if it is about one.
    pub fn node(&self) -> Option<&str> {
        match self {
            BootstrapError::Stuck { node, .. } | BootstrapError::Rejected { node, .. } => {
                Some(node)
            }
            _ => None,
        }
    }
}

/// What happened to etcd while some nodes failed.
fn etcd_note(etcd: Option<&(String, bool)>, failed: &[BootstrapError]) -> String {
    let names: Vec<&str> = failed.iter().filter_map(BootstrapError::node).collect();
    match etcd {
        Some((node, now)) => format!(
            "etcd {} on {node}; the nodes that settled are configured. Fix {} and run again.",
            if *now {
                "was bootstrapped"
            } else {
                "was already bootstrapped"
            },
            names.join(", ")
        ),
        None => "etcd was not bootstrapped: the first control plane did not settle.".into(),
    }
}

fn stuck(node: &str, state: &str, detail: impl fmt::Display, hint: &str) -> BootstrapError {
    BootstrapError::Stuck {
        node: node.to_owned(),
        state: state.to_owned(),
        detail: detail.to_string(),
        hint: hint.to_owned(),
    }
}

const HINT_PORT: &str = "The machine is not up, not reachable from here, or has another address: check that it booted this cluster's image, and nodes[].address / talosEndpoint.";
const HINT_MAINTENANCE: &str = "The node accepted the config but never left maintenance mode. This usually means it cannot act on it: the install disk is missing (check nodes[].installDisk against the disks it reports), the install image cannot be pulled, or the config failed on the node; its console tells which.";
const HINT_APPLY_TIMEOUT: &str = "The node answered in maintenance mode, but the call that sends its config timed out, every time: whether the node received it is not known. The node or the network to it is slow or stalling: check its console, or give it more time (--call-timeout).";
const HINT_REBOOT: &str = "The node went away after the config was applied and did not come back: it is rebooting into an install that fails, or booted from media without the installed system.";
const HINT_NAME: &str = "Talos names the node's own addresses (and machine.certSANs) in its API certificate, and imgbuild checks it against nodes[].address: the node has another address than the inventory says (DHCP?), or is reached through NAT or a port forward (talosEndpoint). Fix nodes[].address, or add the address to machine.certSANs with a patch.";
const HINT_NO_CNI: &str = "cluster.network.cni.name is none and no CNI manifest is given (cluster.inlineManifests, cluster.extraManifests), so no pod network comes up and the nodes stay NotReady. Add the CNI's manifest to cluster.inlineManifests or cluster.extraManifests with a patch and run again, or install one now with the kubeconfig (e.g. helm install cilium).";
const HINT_FOREIGN: &str = "The node is configured with a different CA than the cluster secrets in use ({secrets}): it was set up from other secrets (made on another machine or CI runner, or a talosconfig generated elsewhere). Use that cluster's secrets: its SOPS file beside the inventory (secrets.sops.yaml, or cluster.secretsFile) with the age key in SOPS_AGE_KEY_FILE, or import its secrets.yaml (`imgbuild secrets gen --secrets FILE --force`, which refuses while a SOPS file holds this inventory's secrets); or reset the node to maintenance mode.";

/// `hint` with the secrets file in use named, when it is [`HINT_FOREIGN`]
/// (the stage knows the file, this module does not).
pub(crate) fn foreign_hint(hint: &str, secrets: &str) -> String {
    if hint == HINT_FOREIGN {
        hint.replace("{secrets}", secrets)
    } else {
        hint.to_owned()
    }
}

struct Ctx<'a> {
    opts: &'a Options,
    identity: Arc<Identity>,
    observer: &'a dyn Observer,
    /// Every control plane: a recovery checks each one's etcd first.
    control_planes: Vec<(String, NodeEndpoint)>,
}

/// How a node reached mTLS.
struct NodeDone {
    applied: bool,
    version: String,
}

/// The last thing seen of a node that has not settled yet: what a timeout
/// reports, and what progress shows once per change.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    Nothing,
    ConfiguredSilent(String),
    ApplyFailed(String),
    /// The apply call got no answer in time: whether the node received
    /// the config is not known.
    ApplyTimedOut(String),
    StillInMaintenance,
    PortClosed(String),
    ProbeFailed(String),
}

impl Seen {
    /// (state, detail, hint) for the timeout message.
    fn verdict(&self, applied: bool) -> (&'static str, String, &'static str) {
        match self {
            Seen::StillInMaintenance => (
                "stuck in maintenance mode",
                "still in maintenance mode after its config was applied".into(),
                HINT_MAINTENANCE,
            ),
            Seen::PortClosed(d) if applied => (
                "did not come back after apply",
                format!("port closed ({d})"),
                HINT_REBOOT,
            ),
            Seen::ConfiguredSilent(d) => (
                "configured, but its API does not answer over mTLS",
                d.clone(),
                HINT_REBOOT,
            ),
            Seen::ApplyFailed(d) => (
                "maintenance mode, apply failing",
                d.clone(),
                HINT_MAINTENANCE,
            ),
            Seen::ApplyTimedOut(d) => (
                "maintenance mode, apply timed out",
                d.clone(),
                HINT_APPLY_TIMEOUT,
            ),
            Seen::PortClosed(d) | Seen::ProbeFailed(d) => {
                ("not reachable in maintenance mode", d.clone(), HINT_PORT)
            }
            Seen::Nothing => ("no answer", String::new(), HINT_PORT),
        }
    }
}

/// Brings one node to "answers Version over mTLS", applying its config when
/// it is in maintenance mode. Never calls Version on a maintenance node.
async fn settle(node: &PlannedNode, cx: &Ctx<'_>) -> Result<NodeDone, BootstrapError> {
    let opts = cx.opts;
    let name = node.name.as_str();
    let deadline = Instant::now() + opts.node_timeout;
    cx.observer.event(name, &Event::WaitingForPort);
    client::wait_for_port(node.endpoint.addr, opts.node_timeout)
        .await
        .map_err(|e| stuck(name, "port 50000 never opened", e, HINT_PORT))?;
    cx.observer.event(name, &Event::PortOpen);
    let mtls = Mode::Mtls(cx.identity.clone());
    let mut applied = false;
    let mut seen = Seen::Nothing;
    loop {
        let now_seen = match client::probe(&node.endpoint, opts.call_timeout).await {
            Ok(Probe::Configured) => {
                match connect_version(&node.endpoint, &mtls, opts.call_timeout).await {
                    Ok(version) => {
                        cx.observer.event(
                            name,
                            &Event::Configured {
                                version: version.clone(),
                            },
                        );
                        return Ok(NodeDone { applied, version });
                    }
                    Err(ApiError::UnknownAuthority(detail)) => {
                        return Err(stuck(
                            name,
                            "configured by someone else (certificate signed by unknown authority)",
                            detail,
                            HINT_FOREIGN,
                        ));
                    }
                    Err(ApiError::WrongName { presented, .. }) => {
                        return Err(stuck(
                            name,
                            "configured, but its certificate names other addresses",
                            ApiError::WrongName {
                                expected: node.endpoint.server_name.to_string(),
                                presented,
                            },
                            HINT_NAME,
                        ));
                    }
                    Err(e) => Seen::ConfiguredSilent(e.to_string()),
                }
            }
            Ok(Probe::Maintenance { fingerprint }) if !applied => {
                cx.observer.event(name, &Event::Maintenance { fingerprint });
                match apply(node, cx).await {
                    Ok(details) => {
                        applied = true;
                        cx.observer.event(name, &Event::Applied { details });
                        Seen::Nothing
                    }
                    // Configured by someone else between probe and apply:
                    // the next probe tells.
                    Err(ApiError::CertificateRequired) => Seen::Nothing,
                    Err(ApiError::Status {
                        code: tonic::Code::InvalidArgument,
                        message,
                    }) => {
                        return Err(BootstrapError::Rejected {
                            node: name.to_owned(),
                            message: format!("the node rejected its machine config: {message}"),
                        });
                    }
                    Err(e @ ApiError::PinMismatch { .. }) => {
                        return Err(BootstrapError::Rejected {
                            node: name.to_owned(),
                            message: format!("{e}; refusing to send it the config"),
                        });
                    }
                    Err(e @ ApiError::Timeout(_)) => Seen::ApplyTimedOut(e.to_string()),
                    Err(e) => Seen::ApplyFailed(e.to_string()),
                }
            }
            Ok(Probe::Maintenance { .. }) => Seen::StillInMaintenance,
            Err(ApiError::Unreachable(detail)) => Seen::PortClosed(detail),
            Err(e) => Seen::ProbeFailed(e.to_string()),
        };
        let changed = std::mem::discriminant(&now_seen) != std::mem::discriminant(&seen);
        seen = now_seen;
        if changed {
            match &seen {
                Seen::StillInMaintenance => cx.observer.event(name, &Event::StillInMaintenance),
                Seen::PortClosed(_) if applied => cx.observer.event(name, &Event::PortClosed),
                _ => {}
            }
        }
        if Instant::now() + opts.poll > deadline {
            let (state, detail, hint) = seen.verdict(applied);
            return Err(stuck(
                name,
                state,
                format!("{detail}; gave up after {:?}", opts.node_timeout),
                hint,
            ));
        }
        tokio::time::sleep(opts.poll).await;
    }
}

async fn connect_version(
    target: &NodeEndpoint,
    mode: &Mode,
    timeout: Duration,
) -> Result<String, ApiError> {
    let conn = NodeClient::connect(target, mode, timeout).await?;
    Ok(conn.version().await?.tag)
}

/// Checks the install disk exists, then applies the config insecurely.
async fn apply(node: &PlannedNode, cx: &Ctx<'_>) -> Result<String, ApiError> {
    let mode = Mode::Maintenance {
        pin: cx.opts.pin.clone(),
    };
    let conn = NodeClient::connect(&node.endpoint, &mode, cx.opts.call_timeout).await?;
    let disks = conn.disks().await?;
    if !install_disk_listed(&node.install_disk, &disks) {
        return Err(ApiError::Status {
            code: tonic::Code::InvalidArgument,
            message: format!(
                "install disk {} does not exist on this machine (it has: {}); set nodes[].installDisk",
                node.install_disk,
                disks.join(", ")
            ),
        });
    }
    cx.observer.event(&node.name, &Event::Applying);
    conn.apply(node.config.clone()).await
}

/// Whether `install_disk` is among the `Disks` a node reported. Talos gives
/// each `device_name` as a full path (storaged: `/dev/` joined with the
/// disk's id), so the inventory's path is compared as given. A stable link
/// (`/dev/disk/by-id/…`) is not listed there and cannot be checked; an
/// empty list (nothing to compare with) passes too.
fn install_disk_listed(install_disk: &str, disks: &[String]) -> bool {
    install_disk.starts_with("/dev/disk/")
        || disks.is_empty()
        || disks.iter().any(|d| d == install_disk)
}

/// Recovers etcd from `snapshot` on the bootstrap node: the upload gets
/// a client whose deadline covers it; a refusal that waiting cannot change
/// comes back as InvalidArgument, which is not retried.
async fn recover_once(
    target: &NodeEndpoint,
    mode: &Mode,
    snapshot: &std::path::Path,
    cx: &Ctx<'_>,
) -> Result<bool, ApiError> {
    let opts = cx.opts;
    let states = recover::etcd_states(&cx.control_planes, mode, opts.call_timeout).await;
    let ready = recover::all_preparing(&states);
    let upload_timeout = opts.call_timeout.max(opts.bootstrap_timeout);
    let recovered = match ready {
        Ok(()) => {
            let conn = NodeClient::connect(target, mode, upload_timeout).await?;
            recover::recover(&conn, snapshot, opts.recover_skip_hash_check).await
        }
        Err(e) => Err(e),
    };
    match recovered {
        Ok(_) => Ok(true),
        Err(recover::RecoverError::Api(e)) => Err(e),
        Err(recover::RecoverError::Local(message)) => Err(ApiError::Status {
            code: tonic::Code::InvalidArgument,
            message,
        }),
    }
}

/// Bootstrap once on `node`'s own address. `Ok(false)`: it already was.
async fn bootstrap_once(node: &PlannedNode, cx: &Ctx<'_>) -> Result<bool, BootstrapError> {
    let name = node.name.as_str();
    let mode = Mode::Mtls(cx.identity.clone());
    let deadline = Instant::now() + cx.opts.bootstrap_timeout;
    let mut last = String::new();
    loop {
        let attempt = async {
            // A recovery refuses a running etcd instead (no "done").
            if let Some(snapshot) = &cx.opts.recover_from {
                cx.observer.event(name, &Event::Bootstrapping);
                return recover_once(&node.endpoint, &mode, snapshot, cx).await;
            }
            let conn = NodeClient::connect(&node.endpoint, &mode, cx.opts.call_timeout).await?;
            // A running etcd means bootstrap happened: do not even ask.
            let services = conn.services().await?;
            if services
                .iter()
                .any(|s| s.id == "etcd" && s.state == "Running")
            {
                return Ok(false);
            }
            cx.observer.event(name, &Event::Bootstrapping);
            match conn.bootstrap().await {
                Ok(()) => Ok(true),
                Err(ApiError::Status {
                    code: tonic::Code::AlreadyExists,
                    ..
                }) => Ok(false),
                Err(e) => Err(e),
            }
        };
        match attempt.await {
            Ok(done) => {
                cx.observer.event(
                    name,
                    if done {
                        &Event::Bootstrapped
                    } else {
                        &Event::AlreadyBootstrapped
                    },
                );
                return Ok(done);
            }
            Err(e) => {
                let retry = matches!(
                    e.code(),
                    Some(
                        tonic::Code::FailedPrecondition
                            | tonic::Code::Unavailable
                            | tonic::Code::DeadlineExceeded
                    )
                ) || matches!(e, ApiError::Unreachable(_) | ApiError::Timeout(_));
                if !retry {
                    return Err(BootstrapError::Rejected {
                        node: name.to_owned(),
                        message: format!("bootstrap failed: {e}"),
                    });
                }
                let reason = e.to_string();
                if reason != last {
                    cx.observer.event(
                        name,
                        &Event::BootstrapRetry {
                            reason: reason.clone(),
                        },
                    );
                    last = reason;
                }
            }
        }
        if Instant::now() + cx.opts.poll > deadline {
            let hint = if last.contains("time is not in sync") {
                "The node's clock is not synchronised: check machine.time servers (network.timeServers) are reachable from the node."
            } else {
                "etcd could not start: check the node's console and `talosctl logs etcd`."
            };
            return Err(stuck(
                name,
                "bootstrap not accepted",
                format!("{last}; gave up after {:?}", cx.opts.bootstrap_timeout),
                hint,
            ));
        }
        tokio::time::sleep(cx.opts.poll).await;
    }
}

/// Why the API server did not answer a probe: what the server (or the
/// connection to it) said.
#[derive(Debug, thiserror::Error)]
enum ProbeError {
    #[error("{}", match .0 { kube::KubeError::Api { message, .. } => message.clone(), other => other.to_string() })]
    Kube(kube::KubeError),
    /// The blocking probe panicked or was cancelled.
    #[error("{0}")]
    Join(#[from] tokio::task::JoinError),
}

/// The kubeconfig could not be written into the state dir.
#[derive(Debug, thiserror::Error)]
#[error("{}: {source}", path.display())]
struct WriteError {
    path: std::path::PathBuf,
    #[source]
    source: std::io::Error,
}

/// Whether the API server answers at `server` right now (for the VIP): a
/// TLS handshake verifying the cluster CA and the name in the URL, then
/// `GET /version`, off the runtime's thread; what was seen when not. An
/// open port alone is not an answer: the VIP may belong to something else.
async fn answers(kc: &Kubeconfig, server: &str) -> Result<(), ProbeError> {
    let probe = kc.with_server(server).with_tls_server_name(None);
    let wait = Duration::from_secs(2);
    tokio::task::spawn_blocking(move || probe.get_json("/version", wait))
        .await?
        .map(drop)
        .map_err(ProbeError::Kube)
}

fn endpoint_addr(endpoint: &str) -> Option<(String, SocketAddr)> {
    let host = crate::inventory::endpoint_host(endpoint)?;
    let ip: IpAddr = host.parse().ok()?;
    let rest = endpoint.trim_end_matches('/');
    let port = rest
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse::<u16>().ok())
        .filter(|_| !rest.ends_with(']'))
        .unwrap_or(443);
    Some((host.to_owned(), SocketAddr::new(ip, port)))
}

/// The API server URL to write: the endpoint once it answers, else the first
/// control plane's own address (the VIP appears only after etcd elects it),
/// with the fallback named.
async fn reachable_server(
    kc: &Kubeconfig,
    endpoint: &str,
    vip: Option<IpAddr>,
    first_cp: (&str, IpAddr),
) -> (String, Option<Fallback>) {
    let Some((_, addr)) = endpoint_addr(endpoint) else {
        return (endpoint.to_owned(), None);
    };
    let Err(reason) = answers(kc, endpoint).await else {
        return (endpoint.to_owned(), None);
    };
    let host = match first_cp.1 {
        IpAddr::V6(v6) => format!("[{v6}]"),
        v4 => v4.to_string(),
    };
    let used = format!("https://{host}:{}", addr.port());
    let (setting, wanted) = match vip {
        Some(vip) if vip == addr.ip() => ("cluster.vip", format!("{vip} (in {endpoint})")),
        _ => ("cluster.endpoint", endpoint.to_owned()),
    };
    let fallback = Fallback {
        setting: setting.into(),
        wanted,
        used: used.clone(),
        node: first_cp.0.to_owned(),
        reason: reason.to_string(),
    };
    (used, Some(fallback))
}

/// The kubeconfig in use: one already on disk is reused while it works, so a
/// re-run on a healthy cluster rewrites nothing.
struct KubeState {
    config: Option<Kubeconfig>,
    from_disk: bool,
    /// The server of the kubeconfig on disk (loaded, or written this run).
    on_disk: Option<String>,
    /// The server the kubeconfig on disk pointed at before it moved.
    moved_from: Option<String>,
}

impl KubeState {
    /// Through the bounded reader: a FIFO or `/dev/zero` there is no
    /// kubeconfig (the bootstrap fetches a new one and replaces it). A
    /// sealed cluster's state dir is not read: its kubeconfig is minted.
    fn load(plan: &Plan) -> KubeState {
        let config = plan
            .write_kubeconfig
            .then(|| crate::input::read_text(&plan.kubeconfig_path, crate::input::MAX_TEXT_FILE))
            .and_then(Result::ok)
            .and_then(|t| Kubeconfig::parse(&t).ok())
            .filter(|kc| plan.admin_kube.issued_for(kc));
        KubeState {
            from_disk: config.is_some(),
            on_disk: config.as_ref().map(|k| k.server.clone()),
            moved_from: None,
            config,
        }
    }
}

/// What one round of health checks saw.
#[derive(Default)]
struct Round {
    /// Every check not yet true, in words.
    pending: Vec<String>,
    /// The registered nodes Kubernetes does not call Ready (each is also in
    /// `pending`), with the message of their Ready condition.
    not_ready: Vec<(String, String)>,
    /// Per node, whether Kubernetes called it Ready.
    ready: BTreeMap<String, bool>,
    /// Why the kubeconfig does not point at the endpoint.
    fallback: Option<Fallback>,
}

impl Round {
    fn failed(pending: Vec<String>) -> Round {
        Round {
            pending,
            ..Round::default()
        }
    }

    /// Talos is healthy and every node registered, only Ready is missing:
    /// with no CNI in the config, that stays so.
    fn only_not_ready(&self) -> bool {
        !self.not_ready.is_empty() && self.pending.len() == self.not_ready.len()
    }
}

/// One round of every health check.
async fn health_round(
    plan: &Plan,
    first_cp: &PlannedNode,
    cx: &Ctx<'_>,
    kube_state: &mut KubeState,
) -> Round {
    let mode = Mode::Mtls(cx.identity.clone());
    let mut pending = Vec::new();
    let control_planes: Vec<&PlannedNode> = plan
        .nodes
        .iter()
        .filter(|n| n.role == Role::Controlplane)
        .collect();
    // Like talosctl, through one endpoint (the first control plane) with
    // `nodes` routing to each member; the client checks each reply came
    // back stamped with the member's address.
    let endpoint = match NodeClient::connect(&first_cp.endpoint, &mode, cx.opts.call_timeout).await
    {
        Ok(c) => c,
        Err(e) => {
            return Round::failed(vec![format!("{}: API not answering ({e})", first_cp.name)]);
        }
    };
    let checks = plan.nodes.iter().map(|node| {
        let conn = endpoint.clone().via(node.address);
        async move {
            let mut out = Vec::new();
            if let Err(e) = conn.version().await {
                out.push(format!("{}: Version fails ({e})", node.name));
            }
            match conn.services().await {
                Ok(services) => {
                    let mut wanted = vec!["kubelet"];
                    if node.role == Role::Controlplane {
                        wanted.insert(0, "etcd");
                    }
                    for id in wanted {
                        match services.iter().find(|s| s.id == id) {
                            None => out.push(format!("{}: service {id} not present", node.name)),
                            Some(s) => {
                                let healthy = s.health.as_ref().is_some_and(|h| h.healthy);
                                if s.state != "Running" || !healthy {
                                    let msg = s
                                        .health
                                        .as_ref()
                                        // The node's words, one line: they
                                        // become a row of the wait's list.
                                        .map(|h| crate::input::one_line(&h.last_message, 200))
                                        .filter(|m| !m.is_empty())
                                        .map(|m| format!(", {m}"))
                                        .unwrap_or_default();
                                    out.push(format!(
                                        "{}: {id} {}{}{msg}",
                                        node.name,
                                        s.state,
                                        if healthy { "" } else { " (not healthy)" }
                                    ));
                                }
                            }
                        }
                    }
                }
                Err(e) => out.push(format!("{}: ServiceList fails ({e})", node.name)),
            }
            out
        }
    });
    for problems in futures_util::future::join_all(checks).await {
        pending.extend(problems);
    }

    // etcd membership, as the first control plane sees it.
    match endpoint.etcd_members().await {
        Ok(members) => {
            let mut names: Vec<String> = members
                .iter()
                .map(|m| crate::input::one_line(&m.hostname, 64))
                .filter(|name| !cx.opts.leaving.contains(name))
                .collect();
            names.sort_unstable();
            let mut want: Vec<String> = control_planes.iter().map(|n| n.name.clone()).collect();
            want.sort_unstable();
            if names != want {
                pending.push(format!(
                    "etcd members are [{}], control planes are [{}]",
                    names.join(", "),
                    want.join(", ")
                ));
            }
        }
        Err(e) => pending.push(format!("etcd member list: {e}")),
    }

    // Kubeconfig, then Kubernetes node readiness through it. A sealed
    // cluster's is minted from the secrets (the node's would be the same
    // identity, and neither is written).
    if kube_state.config.is_none() && !plan.write_kubeconfig {
        match plan.admin_kube.get() {
            Ok(kc) => kube_state.config = Some(kc),
            Err(e) => pending.push(e.to_string()),
        }
    }
    if kube_state.config.is_none() {
        match endpoint.kubeconfig().await {
            Ok(archive) => match kube::from_archive(&archive).and_then(|t| Kubeconfig::parse(&t)) {
                Ok(kc) => {
                    kube_state.config = Some(kc);
                    kube_state.from_disk = false;
                }
                Err(e) => pending.push(e.to_string()),
            },
            Err(e) => pending.push(format!("kubeconfig: {e}")),
        }
    }
    let Some(kc) = kube_state.config.as_mut() else {
        pending.push("Kubernetes: no kubeconfig yet".into());
        return Round::failed(pending);
    };
    // Through the host-side address when there is one, checking the
    // certificate against the in-cluster endpoint's name it carries.
    let (server, tls_name, fallback) = match &plan.kubernetes_endpoint {
        Some(outside) => {
            let view = kc.through(outside, crate::inventory::endpoint_host(&plan.endpoint));
            (view.server, view.tls_server_name, None)
        }
        None => {
            let (server, fallback) = reachable_server(
                kc,
                &plan.endpoint,
                plan.vip,
                (&first_cp.name, first_cp.address),
            )
            .await;
            (server, None, fallback)
        }
    };
    if kc.server != server || kc.tls_server_name != tls_name {
        *kc = kc
            .with_server(&server)
            .with_tls_server_name(tls_name.as_deref());
    }
    let probe = kc.clone();
    let timeout = cx.opts.call_timeout;
    let readiness = tokio::task::spawn_blocking(move || probe.node_readiness(timeout))
        .await
        .map_err(|e| e.to_string())
        .and_then(|r| r.map_err(|e| e.to_string()));
    let mut round = Round {
        fallback,
        ..Round::default()
    };
    match readiness {
        Ok(list) => {
            for node in &plan.nodes {
                match list.iter().find(|n| n.name == node.name) {
                    None => pending.push(format!("{}: not registered in Kubernetes", node.name)),
                    Some(n) => {
                        round.ready.insert(node.name.clone(), n.ready);
                        if !n.ready {
                            pending.push(format!("{}: Kubernetes node not Ready", node.name));
                            round.not_ready.push((node.name.clone(), n.message.clone()));
                        }
                    }
                }
            }
        }
        Err(e) if kube_state.from_disk => {
            // The kubeconfig already on disk does not work (expired, other
            // cluster): fetch a fresh one next round.
            kube_state.config = None;
            pending.push(format!("existing kubeconfig does not work ({e})"));
            return Round::failed(pending);
        }
        Err(e) => pending.push(e),
    }
    if !plan.write_kubeconfig {
        // Sealed: the rest of the run reads this one, where the API
        // answered (the VIP fallback), from memory.
        plan.admin_kube.hold(kc.clone());
        round.pending = pending;
        return round;
    }
    let written = write_kubeconfig(kc, &plan.kubeconfig_path);
    let server = kc.server.clone();
    match written {
        Ok(true) => {
            let before = kube_state.on_disk.replace(server.clone());
            let moved_from = before.filter(|b| *b != server && server == plan.endpoint);
            if moved_from.is_some() {
                kube_state.moved_from.clone_from(&moved_from);
            }
            cx.observer
                .event(&first_cp.name, &Event::Kubeconfig { server, moved_from })
        }
        Ok(false) => {}
        Err(e) => pending.push(e.to_string()),
    }
    round.pending = pending;
    round
}

/// Whether the config turns the cluster's CNI off and brings no manifest
/// that could carry one: then no node ever becomes Ready. Talos deploys
/// its default CNI only when `cni.name` is flannel (siderolabs/talos
/// internal/app/machined/pkg/controllers/k8s/control_plane.go,
/// `FlannelEnabled`); without one the kubelet's Ready condition stays
/// False ("cni plugin not initialized"). Manifests come from control
/// plane configs.
fn cni_missing(nodes: &[PlannedNode]) -> bool {
    let configs: Vec<serde_yaml_ng::Value> = nodes
        .iter()
        .filter(|n| n.role == Role::Controlplane)
        .filter_map(|n| v1alpha1(&n.config))
        .collect();
    let none = configs
        .iter()
        .any(|c| c["cluster"]["network"]["cni"]["name"].as_str() == Some("none"));
    let manifests = configs.iter().any(|c| {
        ["inlineManifests", "extraManifests"].iter().any(|k| {
            c["cluster"][*k]
                .as_sequence()
                .is_some_and(|list| !list.is_empty())
        })
    });
    none && !manifests
}

/// The v1alpha1 document of a rendered machine config (the one with
/// `machine` or `cluster`; other documents may follow it).
fn v1alpha1(config: &[u8]) -> Option<serde_yaml_ng::Value> {
    use serde::Deserialize;
    serde_yaml_ng::Deserializer::from_slice(config)
        .filter_map(|doc| serde_yaml_ng::Value::deserialize(doc).ok())
        .find(|d| d.get("machine").is_some() || d.get("cluster").is_some())
}

/// Writes `kc` 0600 when its text changed; `Ok(true)` when it wrote.
fn write_kubeconfig(kc: &Kubeconfig, path: &std::path::Path) -> Result<bool, WriteError> {
    crate::atomic::write_if_changed(path, kc.to_yaml().as_bytes(), true).map_err(|source| {
        WriteError {
            path: path.to_owned(),
            source,
        }
    })
}

/// Runs the whole state machine. Idempotent: configured nodes get nothing
/// applied and a bootstrapped cluster is not bootstrapped again. A node
/// that does not settle does not hold back the others, nor etcd's
/// bootstrap on a first control plane that did.
pub async fn run(
    plan: &Plan,
    opts: &Options,
    observer: &dyn Observer,
) -> Result<BootstrapOutcome, BootstrapError> {
    let started = Instant::now();
    let cx = Ctx {
        opts,
        identity: plan.identity.clone(),
        observer,
        control_planes: plan
            .nodes
            .iter()
            .filter(|n| n.role == Role::Controlplane)
            .map(|n| (n.name.clone(), n.endpoint.clone()))
            .collect(),
    };
    let first_cp = plan
        .nodes
        .iter()
        .find(|n| plan.bootstrap_node.as_ref() == Some(&n.name))
        .ok_or_else(|| BootstrapError::Local("the inventory has no control plane".into()))?;
    // A snapshot etcd would not restore is refused before any node is
    // touched; one larger than any snapshot imgbuild takes before it is read
    // (a hash check of a huge file, or its upload, would run for hours).
    if let Some(snapshot) = &opts.recover_from {
        let size = std::fs::metadata(snapshot)
            .map_err(|e| BootstrapError::Local(format!("{}: {e}", snapshot.display())))?
            .len();
        if size > super::etcd::format::LARGEST {
            return Err(BootstrapError::Local(format!(
                "{}: {size} bytes is larger than an etcd snapshot can be ({} bytes, etcd's largest recommended backend quota): refused before reading it",
                snapshot.display(),
                super::etcd::format::LARGEST
            )));
        }
    }
    if let Some(snapshot) = &opts.recover_from
        && !opts.recover_skip_hash_check
    {
        super::etcd::format::verify_file(snapshot)
            .map_err(|e| BootstrapError::Local(e.to_string()))?;
    }

    // Every node settles concurrently; bootstrap starts as soon as the first
    // control plane is ready, while the others are still coming up.
    let settling = plan.nodes.iter().map(|n| settle(n, &cx));
    let first_index = plan
        .nodes
        .iter()
        .position(|n| n.name == first_cp.name)
        .expect("first control plane is a node");
    let mut settled: Vec<Option<NodeDone>> = plan.nodes.iter().map(|_| None).collect();
    let mut failed = Vec::new();
    let mut bootstrapped = None;
    {
        use futures_util::stream::{FuturesUnordered, StreamExt};
        let mut pending: FuturesUnordered<_> = settling
            .enumerate()
            .map(|(i, f)| async move { (i, f.await) })
            .collect();
        let mut boot: Option<std::pin::Pin<Box<dyn std::future::Future<Output = _> + Send + '_>>> =
            None;
        loop {
            tokio::select! {
                Some((i, r)) = pending.next(), if !pending.is_empty() => match r {
                    Ok(done) => {
                        if i == first_index {
                            boot = Some(Box::pin(bootstrap_once(first_cp, &cx)));
                        }
                        settled[i] = Some(done);
                    }
                    Err(e) => failed.push(e),
                },
                b = async { boot.as_mut().expect("guarded").await }, if boot.is_some() => {
                    boot = None;
                    bootstrapped = Some(b?);
                }
                else => break,
            }
            if pending.is_empty() && boot.is_none() {
                break;
            }
        }
    }
    if !failed.is_empty() {
        let settled = plan
            .nodes
            .iter()
            .zip(&settled)
            .filter_map(|(n, done)| Some((n.name.clone(), done.as_ref()?.applied)))
            .collect();
        return Err(BootstrapError::Nodes {
            failed,
            etcd: bootstrapped.map(|now| (first_cp.name.clone(), now)),
            settled,
        });
    }
    let bootstrapped = bootstrapped.expect("bootstrap ran once the first control plane settled");

    let health_deadline = Instant::now() + opts.health_timeout;
    let mut kube_state = KubeState::load(plan);
    let mut last_pending: Vec<String> = Vec::new();
    let no_cni = cni_missing(&plan.nodes);
    let (health, last) = loop {
        let round = health_round(plan, first_cp, &cx, &mut kube_state).await;
        if round.pending.is_empty() {
            break (Health::Healthy, round);
        }
        if no_cni && round.only_not_ready() {
            let not_ready = round.not_ready.iter().map(|(n, _)| n.clone()).collect();
            let message = round
                .not_ready
                .iter()
                .map(|(_, m)| m.clone())
                .find(|m| !m.is_empty())
                .unwrap_or_default();
            break (Health::NoCni { not_ready, message }, round);
        }
        if round.pending != last_pending {
            observer.event(
                "cluster",
                &Event::Waiting {
                    pending: round.pending.clone(),
                },
            );
        }
        if Instant::now() + opts.poll > health_deadline {
            return Err(BootstrapError::Unhealthy {
                timeout: opts.health_timeout,
                pending: round.pending,
            });
        }
        last_pending = round.pending;
        tokio::time::sleep(opts.poll).await;
    };
    match &health {
        Health::Healthy => observer.event("cluster", &Event::Healthy),
        Health::NoCni { .. } => observer.event("cluster", &Event::NoCni),
    }

    let mut outcome = BootstrapOutcome {
        applied: Vec::new(),
        already_configured: Vec::new(),
        bootstrapped,
        bootstrap_node: first_cp.name.clone(),
        kubeconfig_moved_from: kube_state.moved_from,
        kubeconfig_server: kube_state.config.map(|k| k.server).unwrap_or_default(),
        versions: BTreeMap::new(),
        ready: last.ready,
        health,
        fallbacks: last.fallback.into_iter().collect(),
        elapsed_ms: started.elapsed().as_millis(),
    };
    for (node, done) in plan.nodes.iter().zip(settled) {
        let done = done.expect("every node settled");
        if done.applied {
            outcome.applied.push(node.name.clone());
        } else {
            outcome.already_configured.push(node.name.clone());
        }
        outcome.versions.insert(node.name.clone(), done.version);
    }
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kubeconfig_that_is_a_fifo_or_endless_is_no_kubeconfig() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("kubeconfig");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid C string; mkfifo only creates the node.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let zero = dir.path().join("zero");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        for path in [&fifo, &zero] {
            let state = KubeState::load(&kube_plan(path));
            assert!(state.config.is_none() && !state.from_disk);
        }
    }

    /// A plan of no nodes for the atlas endpoint whose state-dir
    /// kubeconfig is `path`, with the test bundle's CA.
    fn kube_plan(path: &std::path::Path) -> Plan {
        Plan {
            nodes: Vec::new(),
            bootstrap_node: None,
            endpoint: "https://10.0.0.10:6443".into(),
            vip: None,
            kubernetes_endpoint: None,
            identity: Arc::new(Identity {
                ca: String::new(),
                client: super::super::pki::CertAndKey {
                    crt: String::new(),
                    key: String::new(),
                },
            }),
            kubeconfig_path: path.to_owned(),
            write_kubeconfig: true,
            admin_kube: kube::AdminKube::of(
                "atlas",
                "https://10.0.0.10:6443",
                super::super::secrets::tests::bundle(),
            ),
        }
    }

    /// The state dir's kubeconfig is used while it is one for these
    /// secrets and the cluster is not sealed; else the run's is minted.
    #[test]
    fn only_a_kubeconfig_for_these_secrets_is_taken_from_the_state_dir() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubeconfig");
        let mut plan = kube_plan(&path);
        let ours = plan.admin_kube.mint(1).unwrap();
        std::fs::write(&path, ours.to_yaml()).unwrap();
        let state = KubeState::load(&plan);
        assert!(state.from_disk);
        assert_eq!(state.config.unwrap().to_yaml(), ours.to_yaml());
        // Another cluster's (another CA): not ours, replaced by the bootstrap.
        std::fs::write(&path, kube::tests::sample()).unwrap();
        assert!(KubeState::load(&plan).config.is_none());
        // Sealed: the state dir is not read, even when its file fits.
        std::fs::write(&path, ours.to_yaml()).unwrap();
        plan.write_kubeconfig = false;
        assert!(KubeState::load(&plan).config.is_none());
    }

    #[test]
    fn endpoints_split_into_host_and_port() {
        assert_eq!(
            endpoint_addr("https://10.0.0.10:6443"),
            Some(("10.0.0.10".into(), "10.0.0.10:6443".parse().unwrap()))
        );
        assert_eq!(
            endpoint_addr("https://10.0.0.10"),
            Some(("10.0.0.10".into(), "10.0.0.10:443".parse().unwrap()))
        );
        assert_eq!(endpoint_addr("https://k8s.example:6443"), None);
    }

    #[tokio::test]
    async fn an_unanswering_vip_is_replaced_by_the_first_control_plane_and_named() {
        let kc = Kubeconfig::parse(&kube::tests::sample()).unwrap();
        // An open port that speaks no TLS is not the API server.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let endpoint = format!("https://127.0.0.1:{port}");
        let cp = ("cp-01", "127.0.0.2".parse().unwrap());
        let vip = Some("127.0.0.1".parse().unwrap());
        let open = tokio::spawn(async move {
            loop {
                let (mut tcp, _) = listener.accept().await.unwrap();
                let _ =
                    tokio::io::AsyncWriteExt::write_all(&mut tcp, b"HTTP/1.1 400 no\r\n\r\n").await;
            }
        });
        let (server, fallback) = reachable_server(&kc, &endpoint, vip, cp).await;
        assert_eq!(server, format!("https://127.0.0.2:{port}"), "{fallback:?}");
        open.abort();
        let _ = open.await;
        // Nothing listens on this loopback port any more.
        let (server, fallback) = reachable_server(&kc, &endpoint, vip, cp).await;
        assert_eq!(server, format!("https://127.0.0.2:{port}"));
        let f = fallback.unwrap();
        assert_eq!(
            (f.setting.as_str(), f.node.as_str(), f.used.as_str()),
            ("cluster.vip", "cp-01", server.as_str())
        );
        assert!(f.reason.contains("onnect"), "{f:?}");
        assert_eq!(
            f.to_string(),
            format!(
                "cluster.vip 127.0.0.1 (in {endpoint}) did not answer ({}), so the kubeconfig points at cp-01 ({server})",
                f.reason
            )
        );
        // An endpoint that is not the VIP is named as cluster.endpoint.
        let (_, f) = reachable_server(&kc, &endpoint, None, cp).await;
        assert_eq!(f.unwrap().setting, "cluster.endpoint");
    }

    #[test]
    fn only_none_without_manifests_means_no_cni() {
        let doc = |cluster: &str| {
            format!(
                "version: v1alpha1\nmachine:\n  type: controlplane\ncluster:\n{cluster}---\napiVersion: v1alpha1\nkind: HostnameConfig\n"
            )
        };
        let none = "  network:\n    cni:\n      name: none\n";
        let v = v1alpha1(doc(none).as_bytes()).unwrap();
        assert_eq!(
            v["cluster"]["network"]["cni"]["name"].as_str(),
            Some("none")
        );
        let missing = |cluster: &str| {
            let node = |role, config: String| PlannedNode {
                name: "n".into(),
                role,
                address: "127.0.0.1".parse().unwrap(),
                endpoint: NodeEndpoint::new(Some("127.0.0.1".parse().unwrap()), None).unwrap(),
                install_disk: "/dev/sda".into(),
                config: config.into_bytes(),
            };
            cni_missing(&[
                node(Role::Controlplane, doc(cluster)),
                node(
                    Role::Worker,
                    doc("  inlineManifests: [{name: x, contents: y}]\n"),
                ),
            ])
        };
        assert!(missing(none), "a worker's manifests are not applied");
        assert!(!missing("  network: {}\n"), "flannel by default");
        assert!(!missing(&format!(
            "{none}  extraManifests: [https://x/cni.yaml]\n"
        )));
        assert!(!missing(&format!(
            "{none}  inlineManifests: [{{name: cilium, contents: x}}]\n"
        )));
    }

    #[test]
    fn install_disks_compare_with_the_full_paths_talos_reports() {
        let disks = ["/dev/sda".to_owned(), "/dev/nvme0n1".to_owned()];
        assert!(install_disk_listed("/dev/sda", &disks));
        assert!(install_disk_listed("/dev/nvme0n1", &disks));
        assert!(!install_disk_listed("/dev/vda", &disks));
        assert!(!install_disk_listed("sda", &disks));
        assert!(install_disk_listed("/dev/disk/by-id/wwn-0x5000", &disks));
    }

    #[test]
    fn timeouts_name_the_state_the_node_was_in() {
        let closed = Seen::PortClosed("refused".into());
        assert_eq!(closed.verdict(true).0, "did not come back after apply");
        assert_eq!(closed.verdict(false).0, "not reachable in maintenance mode");
        let (state, _, hint) = Seen::StillInMaintenance.verdict(true);
        assert_eq!(state, "stuck in maintenance mode");
        assert!(hint.contains("install disk"));
        assert!(
            Seen::ConfiguredSilent("x".into())
                .verdict(true)
                .0
                .contains("mTLS")
        );
    }

    #[test]
    fn events_read_as_states() {
        assert_eq!(
            Event::Maintenance {
                fingerprint: "ab".repeat(32)
            }
            .to_string(),
            "maintenance mode (certificate sha256 abababababababab)"
        );
        let e = stuck("cp-01", "stuck in maintenance mode", "x", HINT_MAINTENANCE).to_string();
        assert!(
            e.starts_with("node cp-01: stuck in maintenance mode: x\n"),
            "{e}"
        );
    }
}
