//! The simulated cluster's shared state, in one place: the flags, each
//! node's state (phase, applied config, boot, day-two facts) and the
//! cluster that holds them with the per-system parts (etcd, Kubernetes,
//! health, removals, upgrades); the simulated clock helpers.

use super::k8s::ssa::Manager;
use super::k8s::versions::Component;
use super::{k8s, version};
use imgbuild::talos::pki::{self, CertAndKey, KeyKind};
use rustls::ServerConfig;
use rustls::server::WebPkiClientVerifier;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::PathBuf;
use std::process::Child;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use tokio::sync::watch;

#[derive(clap::Args)]
pub struct Args {
    /// NAME=IP:ROLE (role controlplane or worker), one per node; IPs
    /// loopback. None at all is fine: nodes then come with `POST /_sim/boot`.
    #[arg(long = "node")]
    pub(crate) nodes: Vec<String>,
    /// Every node booted with Secure Boot on (its SecurityState, see
    /// `node/security.rs`) unless its boot request says otherwise.
    #[arg(long)]
    pub(crate) secure_boot: bool,
    /// The shared control-plane address, bound once etcd elects a leader.
    #[arg(long)]
    pub(crate) vip: Option<IpAddr>,
    #[arg(long, default_value_t = 50000)]
    pub(crate) talos_port: u16,
    #[arg(long, default_value_t = 6443)]
    pub(crate) k8s_port: u16,
    /// Every node's Talos version unless `--node-version` or the boot
    /// request names another.
    #[arg(long, default_value = "v1.11.2")]
    pub(crate) talos_version: String,
    /// NAME=TAG: one node's Talos version at start (NAME as in MODE@NODE).
    #[arg(long = "node-version")]
    pub(crate) node_versions: Vec<String>,
    /// Milliseconds the first pull of an installer reference takes (the
    /// factory builds it); later pulls wait for what is left of it.
    #[arg(long, default_value_t = 0)]
    pub(crate) pull_delay: u64,
    /// Milliseconds every later pull of a reference takes at least.
    #[arg(long, default_value_t = 0)]
    pub(crate) pull_cached_delay: u64,
    /// Milliseconds an upgrade cordons and drains after the ack, the node
    /// answering on its old version meanwhile.
    #[arg(long, default_value_t = 0)]
    pub(crate) drain_delay: u64,
    /// Milliseconds a new connection waits before its TLS handshake while
    /// a node with `stall-connects` drains.
    #[arg(long, default_value_t = 1500)]
    pub(crate) stall_delay: u64,
    /// Milliseconds an apply on a configured node holds the apply lock.
    #[arg(long, default_value_t = 0)]
    pub(crate) apply_time: u64,
    /// Milliseconds from apply until mTLS takes over port 50000.
    #[arg(long, default_value_t = 300)]
    pub(crate) apply_delay: u64,
    /// Milliseconds etcd needs from start to healthy (and a joiner waits).
    #[arg(long, default_value_t = 1000)]
    pub(crate) etcd_delay: u64,
    /// Milliseconds etcd stays "Preparing" on the bootstrapped node after
    /// Bootstrap (a window in which a second Bootstrap meets AlreadyExists).
    #[arg(long, default_value_t = 0)]
    pub(crate) etcd_start_delay: u64,
    /// A real etcd member (Debian etcd-server) behind each control plane
    /// instead of the modelled one (`node/etcd_real.rs`). Off by default.
    #[arg(long)]
    pub(crate) real_etcd: bool,
    /// Milliseconds Talos's LeaveCluster retries etcd's "unhealthy
    /// cluster" before giving up (Talos: 5 minutes).
    #[arg(long, default_value_t = 300_000)]
    pub(crate) etcd_unhealthy_retry: u64,
    /// Milliseconds from configuration until kubelet is healthy.
    #[arg(long, default_value_t = 800)]
    pub(crate) kubelet_delay: u64,
    /// Milliseconds from registration until a Kubernetes node is Ready.
    #[arg(long, default_value_t = 800)]
    pub(crate) ready_delay: u64,
    /// Milliseconds port 50000 stays closed with `reboot-after-apply`.
    #[arg(long, default_value_t = 2000)]
    pub(crate) reboot_delay: u64,
    /// Milliseconds from the end of an upgrade's drain (or a reboot's
    /// start) until the node goes down; it then stays down `--reboot-delay`.
    #[arg(long, default_value_t = 100)]
    pub(crate) upgrade_delay: u64,
    /// Milliseconds the clock stays unsynchronised with `slow-time-sync`.
    #[arg(long, default_value_t = 2000)]
    pub(crate) time_sync_delay: u64,
    /// Disk ids every node has (`sda`); Disks reports each as `/dev/<id>`.
    #[arg(long, value_delimiter = ',', default_value = "sda")]
    pub(crate) disks: Vec<String>,
    /// MODE or MODE@NODE: never-leave-maintenance, reboot-after-apply,
    /// foreign-ca, slow-time-sync, wrong-cert-name (the mTLS certificate
    /// names x.y.z.254, not the node's address), endless-kubeconfig (the
    /// Kubeconfig stream never ends), kubeconfig-bomb (its archive unpacks
    /// to 128 MiB of zeros); the day-two switches stall-connects, stock,
    /// schematic-read-fails, leave-cordoned, installer-fails (as
    /// `POST /_sim/node` sets them).
    #[arg(long)]
    pub(crate) misbehave: Vec<String>,
    /// Text every etcd member hostname and service message ends with
    /// (hostile-output tests; see node/hostile.rs).
    #[arg(long)]
    pub(crate) hostile_text: Option<String>,
    #[command(flatten)]
    pub(crate) k8s: Delays,
    #[command(flatten)]
    pub(crate) forwards: k8s::forward::Forwards,
}

/// What a node got from its machine config.
pub(crate) struct Applied {
    pub(crate) hostname: String,
    /// `machine.type` is `controlplane` (a booted node's role comes from here).
    pub(crate) control_plane: bool,
    pub(crate) os_ca: CertAndKey,
    pub(crate) k8s_ca: Option<CertAndKey>,
    pub(crate) endpoint: String,
    pub(crate) cluster_name: String,
    pub(crate) api_sans: Vec<IpAddr>,
    /// The documents besides v1alpha1, as `Kind/name`.
    pub(crate) documents: Vec<String>,
    /// The config as applied (dry runs diff against it).
    pub(crate) raw: String,
    /// Its v1alpha1 document (what `CanApplyImmediate` compares).
    pub(crate) v1alpha1: Value,
    /// `machine.install.image`: names the schematic it was installed from.
    pub(crate) install_image: String,
    /// The config brings a pod network: the default flannel, a custom CNI's
    /// URLs, or manifests (taken to carry one, as for Cilium).
    pub(crate) cni: bool,
}

#[derive(Default, Clone, serde::Serialize)]
pub(crate) struct Stats {
    pub(crate) applies: u32,
    pub(crate) bootstraps: u32,
    pub(crate) bootstrap_refusals: u32,
    pub(crate) maintenance_version_calls: u32,
    pub(crate) kubeconfigs: u32,
}

#[derive(Default)]
pub(crate) struct NodeState {
    pub(crate) applied: Option<Arc<Applied>>,
    /// When mTLS takes over (None: not configured, or never).
    pub(crate) configured_at: Option<Instant>,
    /// Port 50000 closed until then (rebooting).
    pub(crate) down_until: Option<Instant>,
    pub(crate) mtls: Option<Arc<ServerConfig>>,
    pub(crate) stats: Stats,
    /// Stopped by `POST /_sim/halt` (VM stopped, server deleted): port
    /// 50000 closed for good; a later boot makes a new node.
    pub(crate) halted: bool,
    /// A Reset wiped STATE and EPHEMERAL: the machine config Talos keeps
    /// on STATE (`constants.ConfigPath`, /system/state/config.yaml) and the
    /// etcd data are gone, so the machine boots again in maintenance mode.
    pub(crate) wiped: bool,
    /// A Reset wiped etcd's data (EPHEMERAL, or v1.14's own ETCD partition:
    /// `volumes.rs`): the machine joins etcd as a new member when it boots
    /// again; else its old member's data stays and it does not.
    pub(crate) etcd_wiped: bool,
    /// Why the config it booted with (hcloud `user_data`) was refused.
    pub(crate) config_error: Option<String>,
    pub(crate) day2: Day2,
    /// Booted with Secure Boot on (the SecurityState it reports).
    pub(crate) secure_boot: bool,
    /// The node identity its STATE holds (`identity.rs`): made with the
    /// machine (a new `Node`), kept by every reboot and upgrade, carried to
    /// the next boot of the same machine unless a Reset wiped STATE.
    pub(crate) node_id: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    Down,
    Maintenance,
    Configured,
}

pub(crate) struct Node {
    /// `--node` name, or the `name` of the boot request (`vm-300`, a server).
    pub(crate) name: String,
    pub(crate) ip: IpAddr,
    /// The role from `--node`; None for a booted node (role from its config).
    pub(crate) role: Option<bool>,
    /// How a booted node came: the key-10 hostname from the boot request.
    pub(crate) boot: Option<BootInfo>,
    pub(crate) modes: Vec<String>,
    pub(crate) maintenance_tls: Arc<ServerConfig>,
    pub(crate) st: Mutex<NodeState>,
    /// Bumped on every phase change: closes maintenance connections and
    /// takes the listener down for a reboot.
    pub(crate) changed: watch::Sender<u64>,
}

/// What `POST /_sim/boot` said about a dynamically booted node.
pub(crate) struct BootInfo {
    pub(crate) hostname: Option<String>,
    /// The boot request's `machine` (None: the boot `name` tells).
    pub(crate) machine: Option<String>,
}

impl Node {
    /// A node in maintenance mode (or configured by a foreign CA where asked),
    /// nothing listening yet. `names` are what `MODE@NODE` may name.
    pub(crate) fn new(
        args: &Args,
        name: String,
        ip: IpAddr,
        role: Option<bool>,
        boot: Option<BootInfo>,
    ) -> anyhow::Result<Node> {
        let hostname = boot.as_ref().and_then(|b| b.hostname.clone());
        let modes: Vec<String> = args
            .misbehave
            .iter()
            .filter_map(|m| match m.split_once('@') {
                Some((mode, n)) if n == name || hostname.as_deref() == Some(n) => {
                    Some(mode.to_owned())
                }
                Some(_) => None,
                None => Some(m.clone()),
            })
            .collect();
        let cert = pki::self_signed_server(&[ip])?;
        let mut st = NodeState {
            secure_boot: args.secure_boot,
            node_id: super::identity::new_node_id(),
            ..NodeState::default()
        };
        let named = |n: &str| n == name || hostname.as_deref() == Some(n);
        st.day2.version = args
            .node_versions
            .iter()
            .filter_map(|s| s.split_once('='))
            .filter(|(n, _)| named(n))
            .map(|(_, tag)| tag.to_owned())
            .next_back();
        let has = |m: &str| modes.iter().any(|x| x == m);
        st.day2.stall_connects = has("stall-connects");
        st.day2.stock = has("stock");
        st.day2.schematic_read_fails = has("schematic-read-fails");
        st.day2.leave_cordoned = has("leave-cordoned");
        st.day2.installer_fails = has("installer-fails");
        st.day2.life.boot_ids.push(new_boot_id(&name, 0));
        // A node "configured by someone else": another cluster's CA.
        if modes.iter().any(|m| m == "foreign-ca") {
            st.applied = Some(Arc::new(Applied {
                hostname: name.clone(),
                control_plane: role.unwrap_or(false),
                os_ca: pki::new_ca(KeyKind::Ed25519, "talos", None, 10)?,
                k8s_ca: None,
                endpoint: String::new(),
                cluster_name: "foreign".into(),
                api_sans: Vec::new(),
                documents: Vec::new(),
                raw: String::new(),
                v1alpha1: Value::Null,
                install_image: String::new(),
                cni: true,
            }));
            st.configured_at = Some(Instant::now());
        }
        Ok(Node {
            name,
            ip,
            role,
            boot,
            modes,
            maintenance_tls: server_config(&cert, None)?,
            st: Mutex::new(st),
            changed: watch::channel(0).0,
        })
    }

    pub(crate) fn has(&self, mode: &str) -> bool {
        self.modes.iter().any(|m| m == mode)
    }

    /// The `--node` role, else the applied config's `machine.type`.
    pub(crate) fn control_plane(&self) -> bool {
        self.role.unwrap_or_else(|| {
            let st = self.st.lock().unwrap();
            st.applied.as_ref().is_some_and(|a| a.control_plane)
        })
    }

    /// The name stats and Kubernetes show: a `--node` name as given; a booted
    /// node's config hostname, else its key-10 hostname, else the boot name.
    pub(crate) fn display_name(&self) -> String {
        let Some(boot) = &self.boot else {
            return self.name.clone();
        };
        let st = self.st.lock().unwrap();
        st.applied
            .as_ref()
            .map(|a| a.hostname.clone())
            .filter(|h| !h.is_empty())
            .or_else(|| boot.hostname.clone())
            .unwrap_or_else(|| self.name.clone())
    }

    pub(crate) fn halted(&self) -> bool {
        self.st.lock().unwrap().halted
    }

    pub(crate) fn phase(&self, now: Instant) -> Phase {
        let st = self.st.lock().unwrap();
        if st.halted || st.down_until.is_some_and(|t| now < t) {
            Phase::Down
        } else if reached(st.configured_at, now) {
            Phase::Configured
        } else {
            Phase::Maintenance
        }
    }

    pub(crate) fn bump(&self) {
        self.changed.send_modify(|g| *g += 1);
    }
}

pub(crate) struct Boot {
    pub(crate) at: Instant,
    pub(crate) node: usize,
}

pub(crate) struct Cluster {
    pub(crate) args: Args,
    /// Append-only (a node's index is its identity); a node booted again
    /// after a halt replaces the halted one in its slot.
    pub(crate) nodes: RwLock<Vec<Arc<Node>>>,
    pub(crate) boot: Mutex<Option<Boot>>,
    /// OS CA keys seen in control-plane configs, by certificate: a worker's
    /// config has no key, so (like trustd) its certificate comes from here.
    pub(crate) ca_keys: Mutex<HashMap<String, String>>,
    pub(crate) started: Instant,
    /// Every acked Upgrade: node, image, when it went down and came back.
    pub(crate) events: Mutex<Vec<Value>>,
    /// Each control plane's API server certificate, by node and Kubernetes
    /// CA certificate: made once, as a kube-apiserver keeps its own (an RSA
    /// CA's leaf takes seconds to make).
    pub(crate) apiserver_tls: Mutex<HashMap<(usize, String), Arc<ServerConfig>>>,
    /// Health facts beyond node readiness (`POST /_sim/k8s`).
    pub(crate) facts: Mutex<Facts>,
    /// When the factory has built each installer reference.
    pub(crate) builds: Mutex<Builds>,
    /// Kubernetes components, objects and restarts.
    pub(crate) k8s: Mutex<K8s>,
    /// Members removed from etcd, Nodes deleted, the calls.
    pub(crate) removals: Mutex<Removals>,
    /// etcd's keyspace, snapshots and recoveries (`node/etcd.rs`).
    pub(crate) etcd: Mutex<Etcd>,
    /// The real etcd members with `--real-etcd` (`node/etcd_real.rs`).
    pub(crate) real_etcd: Option<RealEtcd>,
    /// Every connection accepted, by the address it came in on.
    pub(crate) connections: k8s::forward::ConnLog,
    /// Holds the VIP back (`--vip-held`) until `POST /_sim/vip`.
    pub(crate) vip_gate: k8s::forward::VipGate,
}

/// Whether the moment `t` (if any) has come.
pub(crate) fn reached(t: Option<Instant>, now: Instant) -> bool {
    t.is_some_and(|t| now >= t)
}

pub(crate) fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

impl Cluster {
    pub(crate) fn node(&self, i: usize) -> Arc<Node> {
        self.nodes.read().unwrap()[i].clone()
    }

    pub(crate) fn count(&self) -> usize {
        self.nodes.read().unwrap().len()
    }

    pub(crate) fn all(&self) -> Vec<Arc<Node>> {
        self.nodes.read().unwrap().clone()
    }

    pub(crate) fn configured_at(&self, i: usize) -> Option<Instant> {
        self.node(i).st.lock().unwrap().configured_at
    }

    pub(crate) fn etcd_start(&self, i: usize) -> Option<Instant> {
        if !self.node(i).control_plane() || self.left_etcd(i) {
            return None;
        }
        let conf = self.configured_at(i)?;
        let boot = self.boot.lock().unwrap();
        let boot = boot.as_ref()?;
        let started = boot.at + ms(self.args.etcd_start_delay);
        let joinable = if boot.node == i {
            started
        } else {
            started + ms(self.args.etcd_delay)
        };
        Some(conf.max(joinable))
    }

    pub(crate) fn etcd_healthy_at(&self, i: usize) -> Option<Instant> {
        if let Some(real) = &self.real_etcd {
            // etcd's own /health, as the reconciler last saw it.
            return self.etcd_start(i).and(real.healthy_since(i));
        }
        self.etcd_start(i).map(|t| t + ms(self.args.etcd_delay))
    }

    pub(crate) fn kubelet_healthy_at(&self, i: usize) -> Option<Instant> {
        self.configured_at(i)
            .map(|t| t + ms(self.args.kubelet_delay))
    }

    pub(crate) fn api_up_at(&self) -> Option<Instant> {
        (0..self.count())
            .filter_map(|i| self.etcd_healthy_at(i))
            .min()
    }

    pub(crate) fn index_of(&self, ip: IpAddr) -> Option<usize> {
        self.nodes.read().unwrap().iter().position(|n| n.ip == ip)
    }
}

pub(crate) fn parse_node(spec: &str) -> anyhow::Result<(String, IpAddr, bool)> {
    let (name, rest) = spec
        .split_once('=')
        .ok_or_else(|| anyhow::anyhow!("--node {spec}: want NAME=IP:ROLE"))?;
    let (ip, role) = rest
        .rsplit_once(':')
        .ok_or_else(|| anyhow::anyhow!("--node {spec}: want NAME=IP:ROLE"))?;
    let ip: IpAddr = ip.parse()?;
    anyhow::ensure!(
        ip.is_loopback(),
        "--node {spec}: {ip} is not a loopback address"
    );
    let cp = match role {
        "controlplane" => true,
        "worker" => false,
        other => anyhow::bail!("--node {spec}: unknown role {other}"),
    };
    Ok((name.to_owned(), ip, cp))
}

pub(crate) fn server_config(
    cert: &CertAndKey,
    client_ca: Option<&str>,
) -> anyhow::Result<Arc<ServerConfig>> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for der in pki::certs_der(ca)? {
                roots.add(der)?;
            }
            builder.with_client_cert_verifier(
                WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider).build()?,
            )
        }
    };
    let mut cfg =
        builder.with_single_cert(pki::certs_der(&cert.crt)?, pki::private_key_der(&cert.key)?)?;
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// The simulated cluster of `args`, every node in maintenance mode (or
/// configured by a foreign CA where asked), nothing listening yet.
pub(crate) fn new_cluster(args: Args) -> anyhow::Result<Arc<Cluster>> {
    let mut nodes = Vec::new();
    for spec in &args.nodes {
        let (name, ip, control_plane) = parse_node(spec)?;
        nodes.push(Arc::new(Node::new(
            &args,
            name,
            ip,
            Some(control_plane),
            None,
        )?));
    }
    if let Some(vip) = args.vip {
        anyhow::ensure!(vip.is_loopback(), "--vip {vip} is not a loopback address");
    }
    anyhow::ensure!(
        version::Talos::parse(&args.talos_version).is_some(),
        "--talos-version {}: not a Talos version (vX.Y.Z)",
        args.talos_version
    );
    for spec in &args.node_versions {
        let ok = spec
            .split_once('=')
            .is_some_and(|(_, tag)| version::Talos::parse(tag).is_some());
        anyhow::ensure!(ok, "--node-version {spec}: want NAME=vX.Y.Z");
    }
    let real_etcd = if args.real_etcd {
        Some(RealEtcd::new()?)
    } else {
        None
    };
    Ok(Arc::new(Cluster {
        real_etcd,
        nodes: RwLock::new(nodes),
        boot: Mutex::new(None),
        ca_keys: Mutex::new(HashMap::new()),
        started: Instant::now(),
        events: Mutex::new(Vec::new()),
        apiserver_tls: Mutex::new(HashMap::new()),
        facts: Mutex::new(Facts::default()),
        builds: Mutex::new(Builds::new()),
        k8s: Mutex::default(),
        removals: Mutex::default(),
        etcd: Mutex::default(),
        connections: k8s::forward::ConnLog::default(),
        vip_gate: k8s::forward::VipGate::new(args.forwards.vip_held),
        args,
    }))
}

pub(crate) type ControlReply = (axum::http::StatusCode, axum::Json<Value>);

pub(crate) fn control_error(code: axum::http::StatusCode, msg: String) -> ControlReply {
    (code, axum::Json(json!({"error": msg})))
}

// ------------------------------------------------- day two and boots
// (their behaviour: `day2.rs`, `apply.rs`, `boot.rs`, `upgrade.rs`)

/// What a node keeps across day-two operations.
#[derive(Default, Clone)]
pub(crate) struct Day2 {
    /// The running Talos tag (None: `--talos-version`).
    pub(crate) version: Option<String>,
    /// The running schematic ID (None: read from the config's installer).
    pub(crate) schematic: Option<String>,
    pub(crate) meta: BTreeMap<u32, Vec<u8>>,
    /// Switch: the installer fails after the ack; the node reboots into
    /// the version it ran.
    pub(crate) installer_fails: bool,
    /// Switch: stock Talos, no `schematic` extension (until an upgrade
    /// installs a factory installer).
    pub(crate) stock: bool,
    /// Switch: reading the extension statuses fails.
    pub(crate) schematic_read_fails: bool,
    /// Switch: new connections stall while the node drains.
    pub(crate) stall_connects: bool,
    /// Switch: the boot after a drain does not uncordon the node.
    pub(crate) leave_cordoned: bool,
    /// Switch: a PodDisruptionBudget that allows no disruption covers the
    /// pods on this node: their evictions are refused (429).
    pub(crate) disruption_budget: bool,
    /// This node's pull and drain times (else the flags).
    pub(crate) pull_ms: Option<u64>,
    pub(crate) drain_ms: Option<u64>,
    /// The persisted config the next boot runs (STAGED, or REBOOT/AUTO
    /// before its reboot).
    pub(crate) staged: Option<Arc<Applied>>,
    /// A TRY apply not yet rolled back, and how many TRYs there were.
    pub(crate) try_rollback: Option<TryRollback>,
    pub(crate) tries: u64,
    /// The apply lock is held until then.
    pub(crate) applying_until: Option<Instant>,
    pub(crate) life: Life,
    /// Installer images containerd holds since the last boot.
    pub(crate) pulled: BTreeSet<String>,
    /// Every image this node holds, by where (`k8s::pods::CRI_K8S`,
    /// `CRI_SYSTEM`, `SYSTEM_SYSTEM`), as (place, image). The system
    /// containerd's are gone with a boot; the CRI one keeps its images on
    /// the EPHEMERAL partition.
    pub(crate) images: BTreeSet<(&'static str, String)>,
    /// What LifecycleService.Upgrade installed: the tag and schematic the
    /// next boot runs.
    pub(crate) next_boot: Option<(String, Option<String>)>,
    pub(crate) lifecycle_upgrades: u32,
    /// Upgrades acked with `stage: true`.
    pub(crate) staged_upgrades: u32,
    pub(crate) upgrade_calls: u32,
    pub(crate) upgrades: u32,
    pub(crate) upgrade_refusals: u32,
    pub(crate) sequences_locked: u32,
    pub(crate) pulls: u32,
    pub(crate) pulls_cancelled: u32,
    pub(crate) installer_refusals: u32,
    pub(crate) last_error: Option<String>,
    pub(crate) requests_by_mode: BTreeMap<&'static str, u32>,
    pub(crate) applies_by_mode: BTreeMap<&'static str, u32>,
    pub(crate) apply_refusals: u32,
    pub(crate) dry_runs: u32,
    pub(crate) try_cancellations: u32,
    pub(crate) try_rollbacks: u32,
    pub(crate) read_calls: u32,
    pub(crate) reboot_calls: u32,
    pub(crate) meta_writes: u32,
    /// Every installer image an acked Upgrade named, in order, and the
    /// reboot mode each asked for.
    pub(crate) installers: Vec<String>,
    pub(crate) reboot_modes: Vec<String>,
}

/// A TRY apply waiting to be rolled back.
#[derive(Clone)]
pub(crate) struct TryRollback {
    /// Which TRY this is (a later one replaces it).
    pub(crate) id: u64,
    pub(crate) previous: Arc<super::state::Applied>,
}

/// What a node keeps about its boots.
#[derive(Default, Clone)]
pub(crate) struct Life {
    /// Every boot's ID, the running one last.
    pub(crate) boot_ids: Vec<String>,
    pub(crate) outages: Vec<Outage>,
    pub(crate) reboots: u32,
    /// `spec.unschedulable` of its Kubernetes node.
    pub(crate) cordoned: bool,
    /// Cordoned through the Kubernetes API (talosctl's drain on the
    /// LifecycleService path), not by Talos: Talos uncordons only nodes it
    /// cordoned (`controllers/k8s/node_apply.go` `ApplyCordoned`, by its
    /// annotation), so the boot leaves this one cordoned.
    pub(crate) cordoned_by_client: bool,
    /// Its Kubernetes node's `metadata.annotations` as clients set them
    /// (Talos's own `talos.dev/cordoned` is shown from `cordoned`).
    pub(crate) annotations: std::collections::BTreeMap<String, String>,
    /// Its evictable pods left (evicted, or stopped by a reboot) since it
    /// was cordoned: nothing is scheduled back while it stays cordoned.
    pub(crate) pods_gone: bool,
    /// Pods evicted from it through the Kubernetes API.
    pub(crate) evictions: u32,
    /// `Reboot` calls that found its Kubernetes node schedulable (nobody
    /// drained it first).
    pub(crate) reboots_undrained: u32,
    /// A sequence (upgrade, reboot) runs until the node is back up.
    pub(crate) busy_until: Option<Instant>,
    /// Cordoned and draining until then (the node answers meanwhile).
    pub(crate) draining_until: Option<Instant>,
    /// When the running sequence stops the node's services, etcd among
    /// them (`stopAllPhaselist` after the drain): apid still answers, but
    /// its etcd member is down from then until it is healthy again.
    pub(crate) services_stop_at: Option<Instant>,
}

/// One time a node was down.
#[derive(Clone)]
pub(crate) struct Outage {
    pub(crate) down: Instant,
    pub(crate) up: Instant,
    pub(crate) why: &'static str,
}

/// A random-looking UUID, distinct per node and boot: the kernel makes a
/// random one every boot.
pub(crate) fn new_boot_id(name: &str, boots: usize) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let h = Sha256::digest(format!("{name}/{boots}/{nanos}"));
    let hex: String = h.iter().take(16).map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-4{}-a{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[13..16],
        &hex[17..20],
        &hex[20..32]
    )
}

// ------------------------------------------ health, removals and etcd
// (their behaviour: `health.rs`, `remove.rs`, `etcd.rs`, `etcd_real.rs`)

/// Cluster-wide health facts a test may break.
#[derive(Clone, serde::Serialize)]
pub(crate) struct Facts {
    pub(crate) kube_proxy_ready: bool,
    pub(crate) coredns_ready: bool,
    /// etcd lists one more member than there are control planes.
    pub(crate) stale_etcd_member: bool,
    /// Replaces `--node-monitor-grace-period` (milliseconds) from now on.
    pub(crate) node_monitor_grace_period: Option<u64>,
}

/// The status a node's kubelet last posted, which the API server keeps
/// serving once the kubelet stops (its Node object stays).
#[derive(Clone)]
pub(crate) struct Heartbeat {
    pub(crate) name: String,
    pub(crate) at: Instant,
    pub(crate) ready: bool,
    /// The `status.nodeInfo.machineID` and `bootID` it posted: the machine
    /// and boot that kubelet ran on (`identity.rs`).
    pub(crate) machine_id: Option<String>,
    pub(crate) boot_id: String,
}

/// What removal did to the simulated cluster.
#[derive(Default)]
pub(crate) struct Removals {
    /// Nodes (by index) whose etcd member was removed.
    pub(crate) left_etcd: BTreeSet<usize>,
    /// Nodes whose Kubernetes Node was deleted.
    pub(crate) deleted: BTreeSet<usize>,
    /// Every call, in order.
    pub(crate) calls: Vec<Value>,
    /// The modelled etcd's leader after an `EtcdForfeitLeadership` moved it
    /// (None, or no longer a member: the lowest-numbered member leads).
    pub(crate) leader: Option<usize>,
}

/// The cluster's etcd: its keyspace and what was done with it.
#[derive(Default)]
pub(crate) struct Etcd {
    pub(crate) keys: BTreeMap<String, String>,
    pub(crate) revision: u64,
    pub(crate) snapshots: Vec<Value>,
    /// `/var/lib/etcd.snapshot` per node index.
    pub(crate) uploads: HashMap<usize, Vec<u8>>,
    pub(crate) recoveries: Vec<Value>,
    pub(crate) failures: Vec<Value>,
    /// Nodes whose etcd failed to start (a restore that failed), and why:
    /// the service shows Failed until the next wipe or bootstrap.
    pub(crate) failed: HashMap<usize, String>,
}

/// One control plane's member.
pub(crate) struct Member {
    /// etcd's member name: the node's hostname when it first started.
    pub(crate) name: String,
    pub(crate) ip: IpAddr,
    pub(crate) client: u16,
    pub(crate) peer: u16,
    pub(crate) child: Option<Child>,
    /// Since when `/health` has answered true (None: not healthy now).
    pub(crate) healthy_since: Option<Instant>,
    /// When the running process was spawned, and how long it took to be
    /// healthy (startup cost, reported in `/_sim/etcd`).
    pub(crate) spawned_at: Option<Instant>,
    pub(crate) startup_ms: Vec<u64>,
}

/// The real members of a simulated cluster.
pub(crate) struct RealEtcd {
    pub(crate) root: PathBuf,
    pub(crate) members: Mutex<HashMap<usize, Member>>,
}

/// When each installer reference is built at the factory (its first pull
/// started the build, which goes on when that pull is cancelled).
pub(crate) type Builds = HashMap<String, Instant>;

// ----------------------------------------------------------- Kubernetes
// (their behaviour: `k8s/pods.rs`, `k8s/objects.rs`, `k8s/deprecated.rs`)

#[derive(clap::Args)]
pub(crate) struct Delays {
    /// Milliseconds a control-plane static pod takes to restart after its
    /// image changes (not Ready meanwhile).
    #[arg(long, default_value_t = 300)]
    pub(crate) static_pod_delay: u64,
    /// Milliseconds a kubelet takes to restart after its image changes
    /// (its Node NotReady meanwhile).
    #[arg(long, default_value_t = 300)]
    pub(crate) kubelet_restart_delay: u64,
    /// Milliseconds a DaemonSet or Deployment takes to roll out a changed
    /// pod template.
    #[arg(long, default_value_t = 300)]
    pub(crate) rollout_delay: u64,
    /// Milliseconds after a node's kubelet last posted its status before
    /// the node lifecycle controller marks it Ready Unknown
    /// (kube-controller-manager `--node-monitor-grace-period`, 40 s).
    #[arg(long, default_value_t = 40_000)]
    pub(crate) node_monitor_grace_period: u64,
}

/// One restart of one component.
pub(crate) struct Restart {
    pub(crate) node: String,
    pub(crate) control_plane: bool,
    pub(crate) component: Component,
    pub(crate) from_image: String,
    pub(crate) image: String,
    pub(crate) start: Instant,
    pub(crate) ready: Instant,
    pub(crate) superseded: bool,
}

/// One component as a node runs it.
#[derive(Clone)]
pub(crate) struct Running {
    pub(crate) image: String,
    /// Its config resource's spec ([`spec_of`]).
    pub(crate) spec: String,
    /// What ran before the last change (the same as `image` at first).
    pub(crate) previous: String,
    /// Ready (running `image`) from then on.
    pub(crate) ready_at: Instant,
    /// The Talos config resource's version (`talos.dev/config-version`).
    pub(crate) config_version: u64,
    /// Its entry in the timeline, if it restarted.
    pub(crate) restart: Option<usize>,
}

/// A node's components, and which node object they belong to (a slot
/// reused by another machine starts afresh).
pub(crate) struct NodeComponents {
    pub(crate) node: usize,
    pub(crate) running: BTreeMap<Component, Running>,
}

/// What the simulated cluster's Kubernetes side keeps.
#[derive(Default)]
pub(crate) struct K8s {
    pub(crate) nodes: HashMap<usize, NodeComponents>,
    pub(crate) timeline: Vec<Restart>,
    pub(crate) objects: Store,
    /// Kubernetes images each node pulled through ImageService or
    /// MachineService.ImagePull.
    pub(crate) pulled: BTreeMap<String, Vec<String>>,
    /// Every image pull asked of a node, in order (see [`PullCall`]).
    pub(crate) pull_calls: Vec<Value>,
    /// The last status each node's kubelet posted (`health.rs`).
    pub(crate) heartbeats: HashMap<usize, Heartbeat>,
    /// Nodes left by machines that are gone from their slot (another
    /// machine, or a wiped one, booted there): the Node object stays, as
    /// its kubelet last posted it, until deleted or taken over by a kubelet
    /// registering the same name (`health.rs`).
    pub(crate) orphans: Vec<(Value, Heartbeat)>,
    /// (node, Manifests ID) → (node identity, rendered YAML, version).
    pub(crate) manifest_versions: HashMap<(usize, &'static str), (usize, String, u64)>,
}

/// (apiVersion, resource, namespace, name).
pub(crate) type Key = (String, String, String, String);

#[derive(Clone)]
pub(crate) struct Stored {
    pub(crate) object: Value,
    pub(crate) managers: Vec<Manager>,
    pub(crate) generation: u64,
    pub(crate) resource_version: u64,
    /// When the pod template last changed (a rollout starts), and the
    /// template the pods ran before.
    pub(crate) template_at: Instant,
    pub(crate) previous_template: Option<Value>,
    /// The Kubernetes minor that removed this object's API version.
    pub(crate) removed_release: Option<(u64, u64)>,
    /// The revision that created it: its `metadata.uid`, which no update
    /// changes.
    pub(crate) created: u64,
}

/// The API server's objects.
#[derive(Default)]
pub(crate) struct Store {
    pub(crate) objects: BTreeMap<Key, Stored>,
    pub(crate) revision: u64,
    pub(crate) applies: Vec<Value>,
    /// Every PUT, POST and DELETE that was not a dry run: {verb, object, code}.
    pub(crate) writes: Vec<Value>,
    pub(crate) requested: Vec<Requested>,
    pub(crate) removed: Vec<RemovedObject>,
}

/// A resource of a removed API version the switch registered.
#[derive(Clone, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RemovedObject {
    pub(crate) group: String,
    pub(crate) version: String,
    pub(crate) resource: String,
    pub(crate) kind: String,
    #[serde(default)]
    pub(crate) namespace: Option<String>,
    pub(crate) name: String,
    pub(crate) removed_release: String,
}

/// A deprecated API some client still requests.
#[derive(Clone, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Requested {
    pub(crate) group: String,
    pub(crate) version: String,
    pub(crate) resource: String,
    #[serde(default)]
    pub(crate) subresource: String,
    pub(crate) removed_release: String,
    /// The API servers that served the requests (None: every one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) nodes: Option<Vec<String>>,
    /// When the switch registered them.
    #[serde(skip)]
    pub(crate) at: Option<Instant>,
}
