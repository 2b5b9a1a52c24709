//! The Talos node double (siderolabs/talos `api/machine/machine.proto`,
//! `internal/app/apid/pkg/director/director.go`): one process simulates a
//! cluster, each node on its own loopback address and port 50000.
//!
//! A node starts in maintenance mode (TLS with a self-signed certificate, no
//! client certificate, only ApplyConfiguration and Disks), validates an
//! applied config against the Talos 1.11 schema, then serves mTLS only with a
//! certificate from the config's `machine.ca`. etcd, kubelet and the
//! Kubernetes API (with node readiness) come up after simulated delays.
//! Switches reproduce the field failures: a node that never leaves
//! maintenance, a reboot after apply, a node configured with a foreign CA,
//! slow time sync, an mTLS certificate naming another address. Nodes stay
//! NotReady (the kubelet's "cni plugin not initialized") while no control
//! plane config brings a CNI (`cluster.network.cni.name: none` and no
//! inline or extra manifests). Calls through one node's API are routed as apid does
//! (`node`: one-to-one, replies untouched; `nodes`: one-to-many, replies
//! stamped with the target as sent, failures in `metadata.error`).
//!
//! # Contract (tests, `make demo` and the machine simulators depend on it)
//! ```text
//! imgbuild-sim nodes [--node NAME=IP:ROLE]... [--vip IP] [--talos-port 50000]
//!     [--k8s-port 6443] [--*-delay MS] [--disks sda] [--misbehave MODE[@NODE]]...
//! ```
//! Prints `{"control":"http://127.0.0.1:PORT","nodes":{NAME:"IP:PORT",…},
//! "forwards":{"kube":{NAME:"IP:PORT"},"talos":{NAME:"IP:PORT"}}}`.
//! - `--kube-forward NAME=IP:PORT`, `--talos-forward NAME=IP:PORT` (port 0:
//!   a free one): control plane NAME's Kubernetes API, node NAME's Talos API
//!   also served there, as a published port of a Talos container is (same
//!   certificates; see `node/k8s/forward.rs`). `GET /_sim/stats` has
//!   `"connections":{"k8s":{"IP:PORT":n},"talos":{…}}`: every connection
//!   accepted, by the address it came in on.
//! - `--vip-held`: the VIP stays unbound, even after the election, until
//!   `POST /_sim/vip` → 200 `{"released":true}` (a VIP that comes late).
//!
//! Zero `--node`s is fine: machines then boot nodes through the control server.
//! - `POST /_sim/boot` `{"name":"vm-300","ip":"127.x.y.z","hostname":"cp-01"?,
//!   "config":"<machine config YAML>"?}` → 200 `{"booted":true,"name","ip",
//!   "configured":bool,"config_error":null|"…"}`; a node listens on
//!   ip:talos-port (and ip:k8s-port once its config makes it a control plane:
//!   the role of a booted node is its config's `machine.type`). Without
//!   `config` it is in maintenance mode; with one (hcloud `user_data`) it is
//!   validated by this node's own schema check: valid → configured at boot
//!   (no apply counted, mTLS from `machine.ca`), invalid → maintenance, and
//!   the error in stats. An ip that is up already → 200 `{"booted":false,…}`,
//!   nothing changes. After a halt, the same `name` comes back with the
//!   config it had (a restarted VM); another name gets a fresh node.
//!   `MODE@NODE` misbehaviour matches the boot `name` or `hostname`.
//!   400/422 for a bad body or a non-loopback ip.
//! - `POST /_sim/halt` `{"ip"}` → 200 `{"halted":bool,"ip","configured":bool}`
//!   (halted false: was halted already; configured: it held an applied
//!   config, which a node booted from an ISO installed to its disk), 404
//!   for an unknown ip: its ports close, connections end.
//! - `GET /_sim/stats` → `{"nodes":{NAME:{applies,bootstraps,
//!   bootstrap_refusals,maintenance_version_calls,kubeconfigs,phase
//!   (down|maintenance|configured),ip,booted_by(null|boot name),
//!   config_error(null|string),halted,documents(null|["Kind/name",…]: the
//!   applied config's documents besides v1alpha1)}},"bootstrapped":bool,"totals":{applies,
//!   bootstraps,bootstrap_refusals,maintenance_version_calls,kubeconfigs,
//!   nodes,up,configured,config_errors}}`. NAME: a `--node` name; for a
//!   booted node its config's hostname, else the boot `hostname`, else `name`
//!   (also its Kubernetes node name).
//!
//! ## Talos versions and day two (issue 26; `node/` modules, each naming its upstream file)
//! Every node runs its own Talos version and behaves as that version's
//! source says; the version (and schematic) change with a successful upgrade.
//! ```text
//!     [--talos-version v1.11.2]        every node's version unless set otherwise
//!     [--node-version NAME=TAG]...     one node's version at start (NAME as for MODE@NODE)
//!     [--pull-delay MS]                the first pull of an installer reference (the
//!                                      factory builds it; the build goes on when a pull is
//!                                      cancelled, later pulls wait for what is left of it)
//!     [--pull-cached-delay MS]         every later pull of the same reference (a node
//!                                      that pulled it since its last boot: none)
//!     [--drain-delay MS]               cordon + drain after an Upgrade's ack: the node
//!                                      answers on the OLD version meanwhile
//!     [--upgrade-delay MS]             from the end of the drain (or a Reboot, or the
//!                                      reboot AUTO/REBOOT asks for) until it goes down
//!     [--reboot-delay MS]              how long a reboot keeps port 50000 closed
//!     [--stall-delay MS]               with `stall-connects`: how long each new
//!                                      connection waits before its TLS handshake while
//!                                      the node drains (the "port closed" trap)
//!     [--apply-time MS]                how long an apply on a configured node holds the
//!                                      apply lock (and its reply waits)
//!     [--misbehave MODE[@NODE]]        besides the above: stall-connects, stock (no
//!                                      `schematic` extension: a node without the factory),
//!                                      schematic-read-fails, leave-cordoned (still
//!                                      unschedulable after a drain), installer-fails
//! ```
//! - `POST /_sim/boot` also takes `"talos_version": TAG` (else `--node-version`, else
//!   `--talos-version`) and `"secure_boot": bool` (else `--secure-boot`: the
//!   SecurityState it reports, `node/security.rs`); a restarted machine gets a new boot ID.
//! - `POST /_sim/node` `{"node": NAME, "version"?: TAG, "installer_fails"?: bool,
//!   "schematic_read_fails"?: bool, "stock"?: bool, "stall_connects"?: bool,
//!   "leave_cordoned"?: bool, "cordoned"?: bool, "pull_ms"?: MS, "drain_ms"?: MS}`
//!   → 200 with the node's switches; 404 for an unknown NAME, 400 for a bad body.
//!   `pull_ms`/`drain_ms` override the flags for that node. (`POST /_sim/installer`
//!   `{"node","fail"}` stays, the same as `installer_fails`.) A failing schematic
//!   read is Unavailable from the COSI State List/Get of ExtensionStatuses.
//! - `POST /_sim/k8s` `{"kube_proxy_ready"?: bool, "coredns_ready"?: bool,
//!   "stale_etcd_member"?: bool}`: the health facts `talosctl health` checks
//!   (`pkg/cluster/check/default.go`) beyond node readiness; true/true/false by
//!   default. A stale member is one more etcd member (`cp-gone`, id 0x1fff) with
//!   no control plane: EtcdMemberList shows it and the Upgrade checks fail on it.
//! - Kubernetes API: `GET /api/v1/nodes` items carry `spec.unschedulable` (true
//!   while cordoned); `GET /api/v1/namespaces/kube-system/pods?labelSelector=k8s-app%3D
//!   {kube-proxy|kube-dns}` lists one kube-proxy pod per node and two CoreDNS pods,
//!   each with a `Ready` condition; `GET /apis/apps/v1/namespaces/kube-system/
//!   {daemonsets|deployments}?labelSelector=…` list the kube-proxy DaemonSet
//!   (`status.desiredNumberScheduled`) and the CoreDNS Deployment (`spec.replicas`),
//!   absent when a control plane's config sets `cluster.proxy.disabled` /
//!   `cluster.coreDNS.disabled`.
//! - Talos API, per the node's version: `MachineService.Upgrade` (all; deprecated
//!   from v1.13) in the order pull (timed, under the caller's gRPC deadline: past
//!   it DeadlineExceeded and no upgrade) → etcd checks on control planes (unless
//!   `force`, or `preserve` on v1.12.9+, v1.13.4+, v1.14: 2 members refuse
//!   "…insufficient to maintain quorum…", then every member started and
//!   healthy) → ack → drain → installer (host floor: v1.N refuses hosts below
//!   v1.(N-2).0 (v1.9/v1.10: v1.8.0); a refusal reverts: reboot on the old
//!   version) → reboot; an Upgrade while a sequence runs is acked and does
//!   nothing. From v1.13: `ImageService.Pull` (the same timed pull) and
//!   `LifecycleService.Upgrade` (the pulled installer, its pre-flight failure
//!   a non-zero `exit_code`; success boots at the next reboot; no etcd check,
//!   no drain, no reboot); Unimplemented below v1.13. `MachineService.Read` of
//!   `/proc/sys/kernel/random/boot_id` (a new UUID every boot),
//!   `MachineService.Reboot` (DEFAULT, POWERCYCLE, FORCE: no drain, down, new boot
//!   ID, up). ApplyConfiguration per v1alpha1_server.go (v1.9–v1.13: CanApplyImmediate,
//!   AUTO → REBOOT for other changes, NO_REBOOT/TRY refused with InvalidArgument
//!   even in a dry run; v1.14: REBOOT Unimplemented, AUTO → NO_REBOOT; the apply
//!   lock's FailedPrecondition on v1.12.9+, v1.13.3+, v1.14; every non-TRY request
//!   cancels a pending TRY rollback).
//! - `GET /_sim/stats`: each node's `day2` adds `boot_id`, `boot_ids` (every
//!   boot, oldest first), `reboots`, `cordoned`, `staged` (bool), `try_pending`,
//!   `upgrade_calls` (every MachineService or LifecycleService Upgrade received,
//!   refused or not), `upgrades` (acked, or a LifecycleService install that
//!   succeeded), `upgrade_refusals` (before the ack), `sequences_locked`, `pulls`,
//!   `pulls_cancelled`, `pulled`, `installer_refusals` (after the ack: the floor or
//!   `installer-fails`), `last_error` (the last refusal's text), `next_boot`,
//!   `requests_by_mode` (every ApplyConfiguration on a configured node, dry runs
//!   and refusals included) and `applies_by_mode` (taken, by the mode it became),
//!   both `{"reboot"|"auto"|"no_reboot"|"staged"|"try": N}`, `apply_refusals`,
//!   `dry_runs`, `try_cancellations` (pending TRY rollbacks a later request
//!   cancelled), `try_rollbacks`, `read_calls`, `reboot_calls`, `reboot_modes`
//!   (each Upgrade's or Reboot's mode name), `lifecycle_upgrades`, `timeline`
//!   (`[{"down_ms":N,"up_ms":N|null,"why":"upgrade|revert|apply|reboot"}]`, ms since
//!   start). Top level adds `timeline` (every node's outages with `"node"` and
//!   `"control_plane"`, by `down_ms`), `now_ms` and `facts`.
//!
//! ## Kubernetes components and objects (issue 31)
//! Static pods, kubelet versions, bootstrap manifests, server-side apply and
//! the deprecated-API metric: the flags, endpoints and stats are listed in
//! `node/k8s/pods.rs` and `node/k8s/objects.rs`.
//!
//! ## etcd snapshots and recovery (issue 30)
//! `EtcdSnapshot`, `EtcdRecover`, `Bootstrap{recover_etcd}`, `/_sim/etcd` and
//! the `etcd-snapshot-*` misbehaviours: see `node/etcd.rs`.
//!
//! What it shares with imgbuild, and why that is sound: the generated
//! protobuf types (`imgbuild::talos::api`, built from `proto/`, whose names
//! and numbers are upstream's `api/machine/machine.proto`) and the certificate helpers
//! (`imgbuild::talos::pki`) to mint its own TLS certificates. Everything the
//! bootstrap is tested on — config validation (its own jsonschema against
//! the vendored schema), routing, disks, states — is written here.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::routing::{get, post};
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use futures_util::Stream;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use imgbuild::talos::pki::{self, CertAndKey, KeyKind, LeafSpec};
use rustls::ServerConfig;
use rustls::server::WebPkiClientVerifier;
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tonic::{Request, Response, Status};

use api::common::{Data, Metadata};
use api::machine::apply_configuration_request::Mode as ApplyMode;
use api::machine::machine_service_server::{MachineService, MachineServiceServer};
use api::machine::*;
use api::storage::storage_service_server::{StorageService, StorageServiceServer};
use api::storage::{Disk, Disks, DisksResponse};
use imgbuild::talos::api;

mod apply;
mod boot;
mod day2;
mod etcd;
mod etcd_real;
mod health;
mod hostile;
mod immediate;
mod k8s;
mod lifecycle;
mod remove;
mod security;
mod switches;
mod upgrade;
mod version;

#[derive(clap::Args)]
pub struct Args {
    /// NAME=IP:ROLE (role controlplane or worker), one per node; IPs
    /// loopback. None at all is fine: nodes then come with `POST /_sim/boot`.
    #[arg(long = "node")]
    nodes: Vec<String>,
    /// Every node booted with Secure Boot on (its SecurityState, see
    /// `node/security.rs`) unless its boot request says otherwise.
    #[arg(long)]
    secure_boot: bool,
    /// The shared control-plane address, bound once etcd elects a leader.
    #[arg(long)]
    vip: Option<IpAddr>,
    #[arg(long, default_value_t = 50000)]
    talos_port: u16,
    #[arg(long, default_value_t = 6443)]
    k8s_port: u16,
    /// Every node's Talos version unless `--node-version` or the boot
    /// request names another.
    #[arg(long, default_value = "v1.11.2")]
    talos_version: String,
    /// NAME=TAG: one node's Talos version at start (NAME as in MODE@NODE).
    #[arg(long = "node-version")]
    node_versions: Vec<String>,
    /// Milliseconds the first pull of an installer reference takes (the
    /// factory builds it); later pulls wait for what is left of it.
    #[arg(long, default_value_t = 0)]
    pull_delay: u64,
    /// Milliseconds every later pull of a reference takes at least.
    #[arg(long, default_value_t = 0)]
    pull_cached_delay: u64,
    /// Milliseconds an upgrade cordons and drains after the ack, the node
    /// answering on its old version meanwhile.
    #[arg(long, default_value_t = 0)]
    drain_delay: u64,
    /// Milliseconds a new connection waits before its TLS handshake while
    /// a node with `stall-connects` drains.
    #[arg(long, default_value_t = 1500)]
    stall_delay: u64,
    /// Milliseconds an apply on a configured node holds the apply lock.
    #[arg(long, default_value_t = 0)]
    apply_time: u64,
    /// Milliseconds from apply until mTLS takes over port 50000.
    #[arg(long, default_value_t = 300)]
    apply_delay: u64,
    /// Milliseconds etcd needs from start to healthy (and a joiner waits).
    #[arg(long, default_value_t = 1000)]
    etcd_delay: u64,
    /// Milliseconds etcd stays "Preparing" on the bootstrapped node after
    /// Bootstrap (a window in which a second Bootstrap meets AlreadyExists).
    #[arg(long, default_value_t = 0)]
    etcd_start_delay: u64,
    /// A real etcd member (Debian etcd-server) behind each control plane
    /// instead of the modelled one (`node/etcd_real.rs`). Off by default.
    #[arg(long)]
    real_etcd: bool,
    /// Milliseconds Talos's LeaveCluster retries etcd's "unhealthy
    /// cluster" before giving up (Talos: 5 minutes).
    #[arg(long, default_value_t = 300_000)]
    etcd_unhealthy_retry: u64,
    /// Milliseconds from configuration until kubelet is healthy.
    #[arg(long, default_value_t = 800)]
    kubelet_delay: u64,
    /// Milliseconds from registration until a Kubernetes node is Ready.
    #[arg(long, default_value_t = 800)]
    ready_delay: u64,
    /// Milliseconds port 50000 stays closed with `reboot-after-apply`.
    #[arg(long, default_value_t = 2000)]
    reboot_delay: u64,
    /// Milliseconds from the end of an upgrade's drain (or a reboot's
    /// start) until the node goes down; it then stays down `--reboot-delay`.
    #[arg(long, default_value_t = 100)]
    upgrade_delay: u64,
    /// Milliseconds the clock stays unsynchronised with `slow-time-sync`.
    #[arg(long, default_value_t = 2000)]
    time_sync_delay: u64,
    /// Disk ids every node has (`sda`); Disks reports each as `/dev/<id>`.
    #[arg(long, value_delimiter = ',', default_value = "sda")]
    disks: Vec<String>,
    /// MODE or MODE@NODE: never-leave-maintenance, reboot-after-apply,
    /// foreign-ca, slow-time-sync, wrong-cert-name (the mTLS certificate
    /// names x.y.z.254, not the node's address), endless-kubeconfig (the
    /// Kubeconfig stream never ends), kubeconfig-bomb (its archive unpacks
    /// to 128 MiB of zeros); the day-two switches stall-connects, stock,
    /// schematic-read-fails, leave-cordoned, installer-fails (as
    /// `POST /_sim/node` sets them).
    #[arg(long)]
    misbehave: Vec<String>,
    /// Text every etcd member hostname and service message ends with
    /// (hostile-output tests; see node/hostile.rs).
    #[arg(long)]
    hostile_text: Option<String>,
    #[command(flatten)]
    k8s: k8s::pods::Delays,
    #[command(flatten)]
    forwards: k8s::forward::Forwards,
}

/// What a node got from its machine config.
struct Applied {
    hostname: String,
    /// `machine.type` is `controlplane` (a booted node's role comes from here).
    control_plane: bool,
    os_ca: CertAndKey,
    k8s_ca: Option<CertAndKey>,
    endpoint: String,
    cluster_name: String,
    api_sans: Vec<IpAddr>,
    /// The documents besides v1alpha1, as `Kind/name`.
    documents: Vec<String>,
    /// The config as applied (dry runs diff against it).
    raw: String,
    /// Its v1alpha1 document (what `CanApplyImmediate` compares).
    v1alpha1: Value,
    /// `machine.install.image`: names the schematic it was installed from.
    install_image: String,
    /// The config brings a pod network: the default flannel, a custom CNI's
    /// URLs, or manifests (taken to carry one, as for Cilium).
    cni: bool,
}

#[derive(Default, Clone, serde::Serialize)]
struct Stats {
    applies: u32,
    bootstraps: u32,
    bootstrap_refusals: u32,
    maintenance_version_calls: u32,
    kubeconfigs: u32,
}

#[derive(Default)]
struct NodeState {
    applied: Option<Arc<Applied>>,
    /// When mTLS takes over (None: not configured, or never).
    configured_at: Option<Instant>,
    /// Port 50000 closed until then (rebooting).
    down_until: Option<Instant>,
    mtls: Option<Arc<ServerConfig>>,
    stats: Stats,
    /// Stopped by `POST /_sim/halt` (VM stopped, server deleted): port
    /// 50000 closed for good; a later boot makes a new node.
    halted: bool,
    /// A Reset wiped STATE and EPHEMERAL: the machine config Talos keeps
    /// on STATE (`constants.ConfigPath`, /system/state/config.yaml) and the
    /// etcd data are gone, so the machine boots again in maintenance mode.
    wiped: bool,
    /// Why the config it booted with (hcloud `user_data`) was refused.
    config_error: Option<String>,
    day2: day2::Day2,
    /// Booted with Secure Boot on (the SecurityState it reports).
    secure_boot: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Down,
    Maintenance,
    Configured,
}

struct Node {
    /// `--node` name, or the `name` of the boot request (`vm-300`, a server).
    name: String,
    ip: IpAddr,
    /// The role from `--node`; None for a booted node (role from its config).
    role: Option<bool>,
    /// How a booted node came: the key-10 hostname from the boot request.
    boot: Option<BootInfo>,
    modes: Vec<String>,
    maintenance_tls: Arc<ServerConfig>,
    st: Mutex<NodeState>,
    /// Bumped on every phase change: closes maintenance connections and
    /// takes the listener down for a reboot.
    changed: watch::Sender<u64>,
}

/// What `POST /_sim/boot` said about a dynamically booted node.
struct BootInfo {
    hostname: Option<String>,
}

impl Node {
    /// A node in maintenance mode (or configured by a foreign CA where asked),
    /// nothing listening yet. `names` are what `MODE@NODE` may name.
    fn new(
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
        st.day2.life.boot_ids.push(boot::new_boot_id(&name, 0));
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

    fn has(&self, mode: &str) -> bool {
        self.modes.iter().any(|m| m == mode)
    }

    /// The `--node` role, else the applied config's `machine.type`.
    fn control_plane(&self) -> bool {
        self.role.unwrap_or_else(|| {
            let st = self.st.lock().unwrap();
            st.applied.as_ref().is_some_and(|a| a.control_plane)
        })
    }

    /// The name stats and Kubernetes show: a `--node` name as given; a booted
    /// node's config hostname, else its key-10 hostname, else the boot name.
    fn display_name(&self) -> String {
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

    fn halted(&self) -> bool {
        self.st.lock().unwrap().halted
    }

    fn phase(&self, now: Instant) -> Phase {
        let st = self.st.lock().unwrap();
        if st.halted || st.down_until.is_some_and(|t| now < t) {
            Phase::Down
        } else if reached(st.configured_at, now) {
            Phase::Configured
        } else {
            Phase::Maintenance
        }
    }

    fn bump(&self) {
        self.changed.send_modify(|g| *g += 1);
    }
}

struct Boot {
    at: Instant,
    node: usize,
}

struct Cluster {
    args: Args,
    /// Append-only (a node's index is its identity); a node booted again
    /// after a halt replaces the halted one in its slot.
    nodes: RwLock<Vec<Arc<Node>>>,
    boot: Mutex<Option<Boot>>,
    /// OS CA keys seen in control-plane configs, by certificate: a worker's
    /// config has no key, so (like trustd) its certificate comes from here.
    ca_keys: Mutex<HashMap<String, String>>,
    started: Instant,
    /// Every acked Upgrade: node, image, when it went down and came back.
    events: Mutex<Vec<Value>>,
    /// Each control plane's API server certificate, by node and Kubernetes
    /// CA certificate: made once, as a kube-apiserver keeps its own (an RSA
    /// CA's leaf takes seconds to make).
    apiserver_tls: Mutex<HashMap<(usize, String), Arc<ServerConfig>>>,
    /// Health facts beyond node readiness (`POST /_sim/k8s`).
    facts: Mutex<health::Facts>,
    /// When the factory has built each installer reference.
    builds: Mutex<upgrade::Builds>,
    /// Kubernetes components, objects and restarts (issue 31).
    k8s: Mutex<k8s::pods::K8s>,
    /// Members removed from etcd, Nodes deleted, the calls (issue 30).
    removals: Mutex<remove::Removals>,
    /// etcd's keyspace, snapshots and recoveries (`node/etcd.rs`).
    etcd: Mutex<etcd::Etcd>,
    /// The real etcd members with `--real-etcd` (`node/etcd_real.rs`).
    real_etcd: Option<etcd_real::RealEtcd>,
    /// Every connection accepted, by the address it came in on.
    connections: k8s::forward::ConnLog,
    /// Holds the VIP back (`--vip-held`) until `POST /_sim/vip`.
    vip_gate: k8s::forward::VipGate,
}

/// Whether the moment `t` (if any) has come.
fn reached(t: Option<Instant>, now: Instant) -> bool {
    t.is_some_and(|t| now >= t)
}

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

impl Cluster {
    fn node(&self, i: usize) -> Arc<Node> {
        self.nodes.read().unwrap()[i].clone()
    }

    fn count(&self) -> usize {
        self.nodes.read().unwrap().len()
    }

    fn all(&self) -> Vec<Arc<Node>> {
        self.nodes.read().unwrap().clone()
    }

    fn configured_at(&self, i: usize) -> Option<Instant> {
        self.node(i).st.lock().unwrap().configured_at
    }

    fn etcd_start(&self, i: usize) -> Option<Instant> {
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

    fn etcd_healthy_at(&self, i: usize) -> Option<Instant> {
        if let Some(real) = &self.real_etcd {
            // etcd's own /health, as the reconciler last saw it.
            return self.etcd_start(i).and(real.healthy_since(i));
        }
        self.etcd_start(i).map(|t| t + ms(self.args.etcd_delay))
    }

    fn kubelet_healthy_at(&self, i: usize) -> Option<Instant> {
        self.configured_at(i)
            .map(|t| t + ms(self.args.kubelet_delay))
    }

    fn api_up_at(&self) -> Option<Instant> {
        (0..self.count())
            .filter_map(|i| self.etcd_healthy_at(i))
            .min()
    }

    fn index_of(&self, ip: IpAddr) -> Option<usize> {
        self.nodes.read().unwrap().iter().position(|n| n.ip == ip)
    }
}

fn parse_node(spec: &str) -> anyhow::Result<(String, IpAddr, bool)> {
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

fn server_config(cert: &CertAndKey, client_ca: Option<&str>) -> anyhow::Result<Arc<ServerConfig>> {
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

fn b64_pem(v: &Value, what: &str) -> Result<String, String> {
    let s = v.as_str().ok_or_else(|| format!("{what} is missing"))?;
    let bytes = STANDARD
        .decode(s.trim())
        .map_err(|_| format!("{what} is not base64"))?;
    String::from_utf8(bytes).map_err(|_| format!("{what} is not PEM"))
}

/// The official Talos 1.11 config schema, vendored in the repository.
const SCHEMA: &str = include_str!("../../../schemas/talos-v1.11-config.schema.json");

/// Talos' registry of document kinds as the vendored schema lists them (its
/// `oneOf`), each with a validator for its definition, keyed by
/// (apiVersion, kind); the v1alpha1 document under ("v1alpha1", "").
fn registry() -> &'static HashMap<(String, String), jsonschema::Validator> {
    static REGISTRY: std::sync::OnceLock<HashMap<(String, String), jsonschema::Validator>> =
        std::sync::OnceLock::new();
    REGISTRY.get_or_init(|| {
        let official: Value = serde_json::from_str(SCHEMA).expect("vendored schema is JSON");
        let mut kinds = HashMap::new();
        for branch in official["oneOf"].as_array().expect("schema has oneOf") {
            let reference = branch["$ref"].as_str().expect("oneOf holds $refs");
            let def = &official["$defs"][reference.trim_start_matches("#/$defs/")];
            let only = |key: &str| {
                def["properties"][key]["enum"][0]
                    .as_str()
                    .map(str::to_owned)
            };
            let key = match (only("apiVersion"), only("kind")) {
                (Some(version), Some(kind)) => (version, kind),
                _ => ("v1alpha1".to_owned(), String::new()),
            };
            let schema = json!({
                "$schema": official["$schema"],
                "$ref": reference,
                "$defs": official["$defs"],
            });
            kinds.insert(
                key,
                jsonschema::validator_for(&schema).expect("vendored schema compiles"),
            );
        }
        kinds
    })
}

/// Schema violations of a document, checked here with this crate's own
/// validator rather than imgbuild's. Like Talos, which picks a document's
/// type by its `version`/`kind` before decoding, each document is held
/// against its kind's definition. Messages name paths and unknown keys,
/// never values.
fn problems_of(validator: &jsonschema::Validator, doc: &Value) -> Vec<String> {
    validator
        .iter_errors(doc)
        .map(|e| {
            let at = e.instance_path().to_string();
            match e.kind() {
                jsonschema::error::ValidationErrorKind::AdditionalProperties { unexpected } => {
                    format!(
                        "unknown keys found during decoding: {at}: {}",
                        unexpected.join(", ")
                    )
                }
                kind => format!("{at}: does not satisfy the schema's {:?}", kind.keyword()),
            }
        })
        .collect()
}

/// The documents of a machine config, as talos
/// `pkg/machinery/config/configloader/internal/decoder/decoder.go` decodes
/// them: null documents skipped; a mapping with `machine`, `cluster`,
/// `debug` or `persist` (or `apiVersion: v1alpha1` without a kind) is the
/// v1alpha1 document; any other needs `kind` and `apiVersion` of a
/// registered kind; no (apiVersion, kind, name) twice. Each is checked
/// against its kind's schema. The v1alpha1 document, and the others as
/// `Kind/name`.
fn read_documents(data: &[u8]) -> Result<(Value, Vec<String>), Status> {
    use serde::Deserialize;
    let invalid = |m: String| Status::invalid_argument(format!("config validation failed: {m}"));
    let mut v1alpha1 = None;
    let mut others = Vec::new();
    let mut seen = Vec::new();
    for de in serde_yaml_ng::Deserializer::from_slice(data) {
        let doc = Value::deserialize(de)
            .map_err(|e| Status::invalid_argument(format!("failed to parse config: {e}")))?;
        let map = match &doc {
            Value::Null => continue,
            Value::Object(map) => map,
            _ => return Err(invalid("expected a YAML document".into())),
        };
        let field = |k: &str| map.get(k).and_then(Value::as_str).unwrap_or_default();
        let legacy = ["machine", "cluster", "debug", "persist"]
            .iter()
            .any(|k| map.contains_key(*k));
        let version = if legacy {
            "v1alpha1"
        } else {
            field("apiVersion")
        };
        let kind = field("kind");
        let id = (
            version.to_owned(),
            kind.to_owned(),
            field("name").to_owned(),
        );
        let validator = match (version, kind) {
            ("v1alpha1", "") => &registry()[&("v1alpha1".to_owned(), String::new())],
            (_, "") => return Err(invalid("missing kind".into())),
            ("", _) => return Err(invalid("missing apiVersion".into())),
            (version, kind) => registry()
                .get(&(version.to_owned(), kind.to_owned()))
                .ok_or_else(|| invalid(format!("{kind:?} {version:?}: not registered")))?,
        };
        if seen.contains(&id) {
            return Err(invalid(format!(
                "duplicate document {}/{}/{} is not allowed",
                id.0, id.1, id.2
            )));
        }
        seen.push(id);
        let problems = problems_of(validator, &doc);
        if !problems.is_empty() {
            return Err(invalid(problems.join("; ")));
        }
        if kind.is_empty() {
            v1alpha1 = Some(doc);
        } else {
            others.push(format!("{kind}/{}", field("name")));
        }
    }
    let doc = v1alpha1.ok_or_else(|| invalid("no v1alpha1 document".into()))?;
    Ok((doc, others))
}

/// Validates a machine config as a node does and extracts what it uses.
fn read_config(data: &[u8]) -> Result<Applied, Status> {
    let (doc, documents) = read_documents(data)?;
    let invalid = |m: String| Status::invalid_argument(format!("config validation failed: {m}"));
    let crt = b64_pem(&doc["machine"]["ca"]["crt"], "machine.ca.crt").map_err(invalid)?;
    pki::cert_info(&crt).map_err(|e| invalid(format!("machine.ca.crt: {e}")))?;
    let key = match doc["machine"]["ca"]["key"].as_str() {
        Some(k) if !k.is_empty() => {
            b64_pem(&doc["machine"]["ca"]["key"], "machine.ca.key").map_err(invalid)?
        }
        _ => String::new(),
    };
    let endpoint = doc["cluster"]["controlPlane"]["endpoint"]
        .as_str()
        .ok_or_else(|| invalid("cluster.controlPlane.endpoint is missing".into()))?
        .to_owned();
    let k8s_ca = match doc["cluster"]["ca"]["key"].as_str() {
        Some(k) if !k.is_empty() => Some(CertAndKey {
            crt: b64_pem(&doc["cluster"]["ca"]["crt"], "cluster.ca.crt").map_err(invalid)?,
            key: b64_pem(&doc["cluster"]["ca"]["key"], "cluster.ca.key").map_err(invalid)?,
        }),
        _ => None,
    };
    // Talos deploys flannel only for `cni.name: flannel`, the default
    // (siderolabs/talos internal/app/machined/pkg/controllers/k8s/
    // control_plane.go, FlannelEnabled); `custom` installs cni.urls.
    let cluster = &doc["cluster"];
    let listed = |v: &Value| v.as_array().is_some_and(|a| !a.is_empty());
    let cni = match cluster["network"]["cni"]["name"]
        .as_str()
        .unwrap_or("flannel")
    {
        "flannel" => true,
        "custom" => listed(&cluster["network"]["cni"]["urls"]),
        _ => false,
    } || listed(&cluster["inlineManifests"])
        || listed(&cluster["extraManifests"]);
    let api_sans = doc["cluster"]["apiServer"]["certSANs"]
        .as_array()
        .map(|a| a.iter().filter_map(|s| s.as_str()?.parse().ok()).collect())
        .unwrap_or_default();
    Ok(Applied {
        control_plane: doc["machine"]["type"].as_str() == Some("controlplane"),
        hostname: doc["machine"]["network"]["hostname"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        os_ca: CertAndKey { crt, key },
        k8s_ca,
        endpoint,
        cluster_name: doc["cluster"]["clusterName"]
            .as_str()
            .unwrap_or("cluster")
            .to_owned(),
        api_sans,
        documents,
        raw: String::from_utf8_lossy(data).into_owned(),
        v1alpha1: doc.clone(),
        install_image: doc["machine"]["install"]["image"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        cni,
    })
}

/// The simulated cluster of `args`, every node in maintenance mode (or
/// configured by a foreign CA where asked), nothing listening yet.
fn new_cluster(args: Args) -> anyhow::Result<Arc<Cluster>> {
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
        Some(etcd_real::RealEtcd::new()?)
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
        facts: Mutex::new(health::Facts::default()),
        builds: Mutex::new(upgrade::Builds::new()),
        k8s: Mutex::default(),
        removals: Mutex::default(),
        etcd: Mutex::default(),
        connections: k8s::forward::ConnLog::default(),
        vip_gate: k8s::forward::VipGate::new(args.forwards.vip_held),
        args,
    }))
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let cluster = new_cluster(args)?;
    let control = TcpListener::bind("127.0.0.1:0").await?;
    let control_url = format!("http://{}", control.local_addr()?);
    let mut listeners = Vec::new();
    for (i, node) in cluster.all().iter().enumerate() {
        let talos = TcpListener::bind(SocketAddr::new(node.ip, cluster.args.talos_port)).await?;
        let k8s = if node.control_plane() {
            Some(TcpListener::bind(SocketAddr::new(node.ip, cluster.args.k8s_port)).await?)
        } else {
            None
        };
        listeners.push((i, talos, k8s));
    }
    let mut forwards = Vec::new();
    let mut forwarded = json!({"kube": {}, "talos": {}});
    for (flag, key, specs) in [
        ("--kube-forward", "kube", &cluster.args.forwards.kube),
        ("--talos-forward", "talos", &cluster.args.forwards.talos),
    ] {
        for spec in specs {
            let (name, addr) = k8s::forward::parse(flag, spec)?;
            let i = cluster
                .all()
                .iter()
                .position(|n| n.name == name && (key == "talos" || n.control_plane()))
                .ok_or_else(|| anyhow::anyhow!("{flag} {spec}: no such control plane or node"))?;
            let l = TcpListener::bind(addr).await?;
            forwarded[key][&name] = json!(l.local_addr()?.to_string());
            forwards.push((key == "kube", i, l));
        }
    }
    println!(
        "{}",
        json!({
            "control": control_url,
            "nodes": cluster.all().iter().map(|n| (n.name.clone(), format!("{}:{}", n.ip, cluster.args.talos_port))).collect::<HashMap<_, _>>(),
            "forwards": forwarded,
        })
    );
    for (i, talos, k8s) in listeners {
        tokio::spawn(serve_talos(cluster.clone(), i, talos));
        if let Some(k8s) = k8s {
            tokio::spawn(serve_k8s(cluster.clone(), Some(i), k8s));
        }
    }
    for (kube, i, l) in forwards {
        if kube {
            tokio::spawn(serve_k8s(cluster.clone(), Some(i), l));
        } else {
            tokio::spawn(serve_talos(cluster.clone(), i, l));
        }
    }
    if let Some(vip) = cluster.args.vip {
        tokio::spawn(serve_vip(cluster.clone(), vip));
    }
    tokio::spawn(k8s::pods::watch(cluster.clone()));
    if cluster.real_etcd.is_some() {
        etcd_real::reconcile_forever(cluster.clone());
    }
    let app = Router::new()
        .route("/_sim/stats", get(stats))
        .route("/_sim/boot", post(boot))
        .route("/_sim/halt", post(halt))
        .route("/_sim/installer", post(switches::installer_switch))
        .route("/_sim/node", post(switches::node_switch))
        .route("/_sim/k8s", post(health::facts_switch))
        .route("/_sim/k8s-apis", post(k8s::deprecated::apis_switch))
        .route("/_sim/etcd", get(etcd::show).post(etcd::control))
        .route("/_sim/vip", post(release_vip))
        .with_state(cluster);
    axum::serve(control, app).await?;
    Ok(())
}

async fn stats(State(cluster): State<Arc<Cluster>>) -> axum::Json<Value> {
    let now = Instant::now();
    let mut totals = Stats::default();
    let (mut up, mut configured, mut config_errors) = (0, 0, 0);
    let nodes: serde_json::Map<String, Value> = cluster
        .all()
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let api = Api {
                cluster: cluster.clone(),
                me: i,
                secure: true,
            };
            let (version, schematic) = (api.version_tag(i), api.schematic_on(i));
            let phase = n.phase(now);
            let name = n.display_name();
            let st = n.st.lock().unwrap();
            totals.applies += st.stats.applies;
            totals.bootstraps += st.stats.bootstraps;
            totals.bootstrap_refusals += st.stats.bootstrap_refusals;
            totals.maintenance_version_calls += st.stats.maintenance_version_calls;
            totals.kubeconfigs += st.stats.kubeconfigs;
            up += u32::from(!st.halted);
            configured += u32::from(phase == Phase::Configured);
            config_errors += u32::from(st.config_error.is_some());
            let mut v = serde_json::to_value(&st.stats).unwrap();
            v["phase"] = json!(format!("{phase:?}").to_lowercase());
            v["ip"] = json!(n.ip);
            v["booted_by"] = json!(n.boot.as_ref().map(|_| &n.name));
            v["config_error"] = json!(st.config_error);
            v["halted"] = json!(st.halted);
            v["documents"] = json!(st.applied.as_ref().map(|a| &a.documents));
            v["install_image"] = json!(st.applied.as_ref().map(|a| &a.install_image));
            v["day2"] = day2::stats_of(&cluster, &st.day2, version, schematic, now);
            (name, v)
        })
        .collect();
    let mut totals = serde_json::to_value(totals).unwrap();
    totals["nodes"] = json!(nodes.len());
    totals["up"] = json!(up);
    totals["configured"] = json!(configured);
    totals["config_errors"] = json!(config_errors);
    axum::Json(json!({
        "nodes": nodes,
        "bootstrapped": cluster.boot.lock().unwrap().is_some(),
        "upgrades": *cluster.events.lock().unwrap(),
        "timeline": cluster.timeline_json(now),
        "now_ms": cluster.now_ms(),
        "facts": *cluster.facts.lock().unwrap(),
        "k8s": cluster.k8s_stats(now),
        "removals": cluster.removal_stats(),
        "connections": cluster.connections.json(),
        "totals": totals,
    }))
}

/// `POST /_sim/boot`: a machine (VM, server) came up with this address.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct BootRequest {
    name: String,
    ip: IpAddr,
    hostname: Option<String>,
    /// A machine config the platform hands over (hcloud `user_data`).
    config: Option<String>,
    /// The Talos version it boots (else `--node-version`, `--talos-version`).
    talos_version: Option<String>,
    /// Whether the firmware booted it with Secure Boot on (else `--secure-boot`).
    secure_boot: Option<bool>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct HaltRequest {
    ip: IpAddr,
}

type ControlReply = (axum::http::StatusCode, axum::Json<Value>);

fn control_error(code: axum::http::StatusCode, msg: String) -> ControlReply {
    (code, axum::Json(json!({"error": msg})))
}

/// Boots a node for a machine: it listens on `ip` in maintenance mode, or
/// configured from `config` if that passes the node's validation (else it
/// stays in maintenance and stats show why). Booting a running address
/// again changes nothing; after a halt the machine's node comes back with
/// what its disk held (same `name`), or fresh (another machine).
async fn boot(
    State(cluster): State<Arc<Cluster>>,
    axum::Json(req): axum::Json<BootRequest>,
) -> ControlReply {
    use axum::http::StatusCode;
    if !req.ip.is_loopback() {
        return control_error(
            StatusCode::BAD_REQUEST,
            format!("ip {} is not a loopback address", req.ip),
        );
    }
    if let Some(v) = req.talos_version.as_deref()
        && version::Talos::parse(v).is_none()
    {
        return control_error(
            StatusCode::BAD_REQUEST,
            format!("talos_version {v:?} is not a Talos version (vX.Y.Z)"),
        );
    }
    let slot = cluster.index_of(req.ip);
    let previous = slot.map(|i| cluster.node(i));
    if let Some(p) = &previous
        && !p.halted()
    {
        return (
            StatusCode::OK,
            axum::Json(json!({"booted": false, "name": p.display_name(), "ip": p.ip})),
        );
    }
    let info = BootInfo {
        hostname: req.hostname.clone(),
    };
    let node = match Node::new(&cluster.args, req.name.clone(), req.ip, None, Some(info)) {
        Ok(n) => n,
        Err(e) => return control_error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    };
    let wiped = previous
        .as_ref()
        .is_some_and(|p| p.name != req.name || p.st.lock().unwrap().wiped);
    {
        let mut st = node.st.lock().unwrap();
        if let Some(p) = previous.as_ref().filter(|_| !wiped) {
            // The same machine restarted: its disk kept the config.
            let old = p.st.lock().unwrap();
            st.applied = old.applied.clone();
            st.configured_at = old.configured_at;
            st.stats = old.stats.clone();
            st.day2 = old.day2.clone();
            let id = boot::new_boot_id(&req.name, st.day2.life.boot_ids.len());
            st.day2.life.boot_ids.push(id);
        }
        if req.talos_version.is_some() {
            st.day2.version = req.talos_version.clone();
        }
        if let Some(sb) = req.secure_boot {
            st.secure_boot = sb;
        }
        if let Some(config) = &req.config {
            match read_config(config.as_bytes()) {
                Ok(applied) => {
                    if !applied.os_ca.key.is_empty() {
                        cluster
                            .ca_keys
                            .lock()
                            .unwrap()
                            .insert(applied.os_ca.crt.clone(), applied.os_ca.key.clone());
                    }
                    st.applied = Some(Arc::new(applied));
                    st.configured_at = Some(Instant::now());
                }
                Err(status) => st.config_error = Some(status.message().to_owned()),
            }
        }
    }
    let talos = match bind_retrying(SocketAddr::new(req.ip, cluster.args.talos_port)).await {
        Ok(l) => l,
        Err(e) => {
            return control_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("{}:{}: {e}", req.ip, cluster.args.talos_port),
            );
        }
    };
    let node = Arc::new(node);
    let i = {
        let mut nodes = cluster.nodes.write().unwrap();
        match slot {
            Some(i) => {
                nodes[i] = node.clone();
                i
            }
            None => {
                nodes.push(node.clone());
                nodes.len() - 1
            }
        }
    };
    if wiped {
        cluster.rejoin_etcd(i);
    }
    tokio::spawn(serve_talos(cluster.clone(), i, talos));
    tokio::spawn(serve_k8s_once_control_plane(
        cluster.clone(),
        node.clone(),
        i,
    ));
    let st = node.st.lock().unwrap();
    (
        StatusCode::OK,
        axum::Json(json!({
            "booted": true,
            "name": node.name,
            "ip": node.ip,
            "configured": st.configured_at.is_some(),
            "config_error": st.config_error,
        })),
    )
}

/// Stops the node on `ip` (its machine stopped or was deleted).
async fn halt(
    State(cluster): State<Arc<Cluster>>,
    axum::Json(req): axum::Json<HaltRequest>,
) -> ControlReply {
    let Some(i) = cluster.index_of(req.ip) else {
        return control_error(
            axum::http::StatusCode::NOT_FOUND,
            format!("no node on {}", req.ip),
        );
    };
    let node = cluster.node(i);
    let (was_up, configured) = {
        let mut st = node.st.lock().unwrap();
        (
            !std::mem::replace(&mut st.halted, true),
            st.applied.is_some(),
        )
    };
    node.bump();
    (
        axum::http::StatusCode::OK,
        axum::Json(json!({"halted": was_up, "ip": req.ip, "configured": configured})),
    )
}

/// Binds `addr`, waiting briefly for a halted node's listener to go.
async fn bind_retrying(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let mut tries = 0;
    loop {
        match TcpListener::bind(addr).await {
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && tries < 50 => {
                tries += 1;
                tokio::time::sleep(ms(20)).await;
            }
            other => return other,
        }
    }
}

/// A booted node's Kubernetes API port opens once its config makes it a
/// control plane, and closes when it halts.
async fn serve_k8s_once_control_plane(cluster: Arc<Cluster>, node: Arc<Node>, i: usize) {
    let addr = SocketAddr::new(node.ip, cluster.args.k8s_port);
    loop {
        if node.halted() {
            return;
        }
        if node.control_plane() && node.phase(Instant::now()) == Phase::Configured {
            if let Ok(l) = bind_retrying(addr).await {
                serve_k8s(cluster, Some(i), l).await;
            }
            return;
        }
        tokio::time::sleep(ms(50)).await;
    }
}

/// Port 50000 of one node (or a forward to it): closed while it reboots,
/// maintenance TLS or mTLS depending on its phase at accept time.
async fn serve_talos(cluster: Arc<Cluster>, i: usize, first: TcpListener) {
    let node = cluster.node(i).clone();
    let addr = first
        .local_addr()
        .unwrap_or(SocketAddr::new(node.ip, cluster.args.talos_port));
    let mut listener = Some(first);
    let mut changes = node.changed.subscribe();
    loop {
        if node.halted() {
            return;
        }
        let down = node.st.lock().unwrap().down_until;
        if let Some(until) = down.filter(|t| Instant::now() < *t) {
            listener = None;
            tokio::time::sleep_until(until.into()).await;
            continue;
        }
        let l = match listener.take() {
            Some(l) => l,
            None => match TcpListener::bind(addr).await {
                Ok(l) => l,
                Err(_) => {
                    tokio::time::sleep(ms(50)).await;
                    continue;
                }
            },
        };
        tokio::select! {
            accepted = l.accept() => {
                if let Ok((tcp, _)) = accepted {
                    cluster.connections.record(k8s::forward::Api::Talos, addr);
                    tokio::spawn(handle_talos(cluster.clone(), i, tcp));
                }
                listener = Some(l);
            }
            _ = changes.changed() => {
                listener = Some(l);
            }
        }
    }
}

/// The mTLS server config of a configured node: a certificate for its
/// address from the config's OS CA, client certificates from that CA only.
fn mtls_config(cluster: &Cluster, node: &Node) -> Option<Arc<ServerConfig>> {
    let mut st = node.st.lock().unwrap();
    if let Some(cfg) = &st.mtls {
        return Some(cfg.clone());
    }
    let applied = st.applied.clone()?;
    let key = if applied.os_ca.key.is_empty() {
        cluster
            .ca_keys
            .lock()
            .unwrap()
            .get(&applied.os_ca.crt)
            .cloned()?
    } else {
        applied.os_ca.key.clone()
    };
    let ca = CertAndKey {
        crt: applied.os_ca.crt.clone(),
        key,
    };
    // Talos names the node's addresses in its API certificate; with
    // `wrong-cert-name` the node has another one than it is reached at
    // (a DHCP lease, a NAT address).
    let ip = match node.ip {
        IpAddr::V4(v4) if node.has("wrong-cert-name") => {
            let [a, b, c, _] = v4.octets();
            IpAddr::from([a, b, c, 254])
        }
        ip => ip,
    };
    let leaf = pki::issue(
        &ca,
        &LeafSpec {
            common_name: node.name.clone(),
            ips: vec![ip],
            server: true,
            client: true,
            days: 365,
            ..LeafSpec::default()
        },
    )
    .ok()?;
    let cfg = server_config(&leaf, Some(&ca.crt)).ok()?;
    st.mtls = Some(cfg.clone());
    Some(cfg)
}

async fn handle_talos(cluster: Arc<Cluster>, i: usize, tcp: TcpStream) {
    let node = cluster.node(i).clone();
    let phase = node.phase(Instant::now());
    let (config, secure) = match phase {
        Phase::Down => return,
        Phase::Maintenance => (node.maintenance_tls.clone(), false),
        Phase::Configured => match mtls_config(&cluster, &node) {
            Some(c) => (c, true),
            // A worker waiting for a control plane's CA (trustd): no API yet.
            None => return,
        },
    };
    let stalls = {
        let st = node.st.lock().unwrap();
        st.day2.stall_connects && st.day2.life.draining(Instant::now())
    };
    if stalls {
        tokio::time::sleep(ms(cluster.args.stall_delay)).await;
    }
    let Ok(tls) = tokio_rustls::TlsAcceptor::from(config).accept(tcp).await else {
        return;
    };
    if secure {
        let admin = tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .and_then(|der| {
                let text = pem::encode(&pem::Pem::new("CERTIFICATE", der.to_vec()));
                pki::cert_info(&text).ok()
            })
            .is_some_and(|info| info.organizations.iter().any(|o| o == "os:admin"));
        if !admin {
            return;
        }
    }
    let api = Api {
        cluster: cluster.clone(),
        me: i,
        secure,
    };
    // A reboot ends every connection (the kernel goes with it): a call that
    // reaches this connection after the node went down, before the close
    // below runs, must not be answered from the new boot's state.
    let up = {
        let node = node.clone();
        move |req: tonic::Request<()>| {
            if node.phase(Instant::now()) == Phase::Down {
                Err(Status::unavailable("error reading from server: EOF"))
            } else {
                Ok(req)
            }
        }
    };
    let routes = tonic::service::Routes::new(MachineServiceServer::with_interceptor(
        api.clone(),
        up.clone(),
    ))
    .add_service(StorageServiceServer::with_interceptor(
        api.clone(),
        up.clone(),
    ))
    .add_service(
        api::machine::lifecycle_service_server::LifecycleServiceServer::with_interceptor(
            api.clone(),
            up.clone(),
        ),
    )
    .add_service(
        api::machine::image_service_server::ImageServiceServer::with_interceptor(
            api.clone(),
            up.clone(),
        ),
    )
    .add_service(api::cosi::resource::state_server::StateServer::with_interceptor(api, up))
    .prepare();
    let conn = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
        .http2_only()
        .serve_connection(TokioIo::new(tls), TowerToHyperService::new(routes))
        .into_owned();
    // The maintenance server stops when the node leaves maintenance mode:
    // a client that keeps this channel loses it. Any connection ends when
    // the node halts.
    let mut changes = node.changed.subscribe();
    let leaves = async {
        loop {
            if changes.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
            let phase = node.phase(Instant::now());
            if node.halted() || phase == Phase::Down || (!secure && phase != Phase::Maintenance) {
                return;
            }
        }
    };
    tokio::select! {
        _ = conn => {}
        _ = leaves => {}
    }
}

#[derive(Clone)]
struct Api {
    cluster: Arc<Cluster>,
    me: usize,
    secure: bool,
}

const NOT_IN_MAINTENANCE: &str = "API is not implemented in maintenance mode";

/// Where apid's director sends a call (siderolabs/talos
/// `internal/app/apid/pkg/director/director.go`).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Route {
    /// No routing metadata: this node's own machined.
    Local,
    /// `node: <target>`: proxied one-to-one, the reply passed on untouched.
    One2One(String),
    /// `nodes: <target>…`: proxied one-to-many, every reply stamped.
    One2Many(Vec<String>),
}

/// A per-node reply message, which apid stamps with `common.Metadata`.
trait Envelope: Default {
    fn set_metadata(&mut self, md: Metadata);
}

macro_rules! envelopes {
    ($($t:ty),*) => {$(
        impl Envelope for $t {
            fn set_metadata(&mut self, md: Metadata) {
                self.metadata = Some(md);
            }
        }
    )*};
}

envelopes!(
    Version,
    ServiceList,
    EtcdMembers,
    Bootstrap,
    ApplyConfiguration,
    Disks,
    Data,
    Upgrade,
    MetaWrite,
    Reboot,
    EtcdLeaveCluster,
    EtcdRemoveMemberById,
    Reset
);

impl Api {
    /// The routing metadata of a call. Maintenance mode has no apid: its
    /// server implements only ApplyConfiguration and Disks.
    fn route<T>(&self, req: &Request<T>) -> Result<Route, Status> {
        if !self.secure {
            return Err(Status::unimplemented(NOT_IN_MAINTENANCE));
        }
        let values = |key: &str| -> Vec<String> {
            req.metadata()
                .get_all(key)
                .iter()
                .filter_map(|v| v.to_str().ok().map(str::to_owned))
                .collect()
        };
        let nodes = values("nodes");
        if !nodes.is_empty() {
            return Ok(Route::One2Many(nodes));
        }
        Ok(match <[String; 1]>::try_from(values("node")) {
            Ok([target]) => Route::One2One(target),
            Err(_) => Route::Local,
        })
    }

    /// The node apid's remote backend reaches for `target` (dialled as
    /// `target:50000`): failures read like a failed dial.
    fn backend(&self, target: &str) -> Result<usize, Status> {
        let dial_failed = |why: &str| {
            Status::unavailable(format!(
                "connection error: desc = \"transport: Error while dialing: dial tcp {target}:50000: {why}\""
            ))
        };
        let i = target
            .parse::<IpAddr>()
            .ok()
            .and_then(|ip| self.cluster.index_of(ip))
            .ok_or_else(|| dial_failed("connect: no route to host"))?;
        if self.cluster.node(i).phase(Instant::now()) != Phase::Configured {
            return Err(dial_failed("connect: connection refused"));
        }
        Ok(i)
    }

    /// Answers a call as apid does, `machined(i)` being node `i`'s own
    /// answer: locally and one-to-one it passes untouched (no metadata,
    /// errors as gRPC statuses); one-to-many each target's messages get
    /// `metadata.hostname` = the target as sent, and a target that fails
    /// yields one message carrying `metadata.error` and `status` instead.
    fn answer<T, M: Envelope>(
        &self,
        req: &Request<T>,
        machined: impl Fn(usize) -> Result<Vec<M>, Status>,
    ) -> Result<Vec<M>, Status> {
        match self.route(req)? {
            Route::Local => machined(self.me),
            Route::One2One(target) => machined(self.backend(&target)?),
            Route::One2Many(targets) => Ok(targets
                .iter()
                .flat_map(|target| {
                    let stamp = Metadata {
                        hostname: target.clone(),
                        ..Metadata::default()
                    };
                    match self.backend(target).and_then(&machined) {
                        Ok(mut messages) => {
                            for m in &mut messages {
                                m.set_metadata(stamp.clone());
                            }
                            messages
                        }
                        Err(s) => {
                            let mut m = M::default();
                            m.set_metadata(Metadata {
                                error: format!(
                                    "rpc error: code = {:?} desc = {}",
                                    s.code(),
                                    s.message()
                                ),
                                status: Some(api::google::rpc::Status {
                                    code: s.code() as i32,
                                    message: s.message().to_owned(),
                                    details: Vec::new(),
                                }),
                                ..stamp
                            });
                            vec![m]
                        }
                    }
                })
                .collect()),
        }
    }

    /// Node `i` takes a config: in maintenance mode it comes up on mTLS
    /// later (or misbehaves), configured it applies without a reboot.
    fn apply_on(&self, i: usize, data: &[u8]) -> Result<ApplyConfiguration, Status> {
        let applied = read_config(data)?;
        k8s::versions::runtime_validate(&self.talos(i), &applied.v1alpha1)?;
        let node = &self.cluster.node(i);
        let now = Instant::now();
        if !applied.os_ca.key.is_empty() {
            self.cluster
                .ca_keys
                .lock()
                .unwrap()
                .insert(applied.os_ca.crt.clone(), applied.os_ca.key.clone());
        }
        let details;
        {
            let mut st = node.st.lock().unwrap();
            st.stats.applies += 1;
            st.applied = Some(Arc::new(applied));
            st.mtls = None;
            if node.has("never-leave-maintenance") {
                details = "Applied configuration".to_owned();
            } else if node.has("reboot-after-apply") {
                let down = now + ms(100);
                st.down_until = Some(down + ms(self.cluster.args.reboot_delay));
                st.configured_at = st.down_until;
                details = "Applied configuration, the node will reboot".to_owned();
            } else {
                st.configured_at = Some(now + ms(self.cluster.args.apply_delay));
                details = "Applied configuration without a reboot".to_owned();
            }
        }
        // Phase changes happen later; wake the listener and connections then.
        let cluster = self.cluster.clone();
        let wake_at: Vec<Instant> = {
            let st = node.st.lock().unwrap();
            [
                st.down_until
                    .map(|t| t - ms(self.cluster.args.reboot_delay)),
                st.down_until,
                st.configured_at,
            ]
            .into_iter()
            .flatten()
            .collect()
        };
        tokio::spawn(async move {
            for t in wake_at {
                tokio::time::sleep_until(t.into()).await;
                cluster.node(i).bump();
            }
        });
        Ok(ApplyConfiguration {
            metadata: None,
            warnings: Vec::new(),
            mode: ApplyMode::Auto as i32,
            mode_details: details,
        })
    }

    fn bootstrap_on(&self, i: usize, recover: bool) -> Result<Bootstrap, Status> {
        let node = &self.cluster.node(i);
        if !node.control_plane() {
            return Err(Status::failed_precondition(
                "bootstrap is not available on worker nodes",
            ));
        }
        let conf = self.cluster.configured_at(i).unwrap_or_else(Instant::now);
        if node.has("slow-time-sync")
            && Instant::now() < conf + ms(self.cluster.args.time_sync_delay)
        {
            node.st.lock().unwrap().stats.bootstrap_refusals += 1;
            return Err(Status::failed_precondition("time is not in sync yet"));
        }
        let mut boot = self.cluster.boot.lock().unwrap();
        if boot.is_some() {
            node.st.lock().unwrap().stats.bootstrap_refusals += 1;
            return Err(Status::already_exists("etcd data directory is not empty"));
        }
        node.st.lock().unwrap().stats.bootstraps += 1;
        // A recovery that cannot restore leaves etcd failed, not started.
        if recover && self.restore_on(i).is_err() {
            return Ok(Bootstrap { metadata: None });
        }
        *boot = Some(Boot {
            at: Instant::now(),
            node: i,
        });
        Ok(Bootstrap { metadata: None })
    }

    fn etcd_members_on(&self, i: usize) -> Result<EtcdMembers, Status> {
        let now = Instant::now();
        if !reached(self.cluster.etcd_start(i), now) {
            return Err(Status::failed_precondition(
                "etcd is not running on this node",
            ));
        }
        if self.cluster.real_etcd.is_some() {
            return self.real_members_on(i);
        }
        let members = (0..self.cluster.count())
            .filter(|&j| reached(self.cluster.etcd_start(j), now))
            .map(|j| {
                let n = &self.cluster.node(j);
                let hostname =
                    n.st.lock()
                        .unwrap()
                        .applied
                        .as_ref()
                        .map(|a| a.hostname.clone())
                        .unwrap_or_default();
                EtcdMember {
                    id: 0x1000 + j as u64,
                    hostname: hostile::said(self.cluster.args.hostile_text.as_deref(), &hostname),
                    peer_urls: vec![format!("https://{}:2380", n.ip)],
                    client_urls: vec![format!("https://{}:2379", n.ip)],
                    is_learner: false,
                }
            })
            .chain(
                self.cluster
                    .facts
                    .lock()
                    .unwrap()
                    .stale_etcd_member
                    .then(|| EtcdMember {
                        id: health::STALE_MEMBER_ID,
                        hostname: "cp-gone".into(),
                        peer_urls: vec!["https://127.0.0.254:2380".into()],
                        client_urls: vec!["https://127.0.0.254:2379".into()],
                        is_learner: false,
                    }),
            )
            .collect();
        Ok(EtcdMembers {
            metadata: None,
            legacy_members: Vec::new(),
            members,
        })
    }

    /// The admin kubeconfig of node `i` as the chunks machined streams.
    fn kubeconfig_on(&self, i: usize) -> Result<Vec<Data>, Status> {
        let now = Instant::now();
        if !reached(self.cluster.etcd_healthy_at(i), now) {
            return Err(Status::failed_precondition(
                "kubeconfig is not available yet: the API server is not running",
            ));
        }
        let node = &self.cluster.node(i);
        let applied = node.st.lock().unwrap().applied.clone().expect("configured");
        let ca = applied
            .k8s_ca
            .clone()
            .ok_or_else(|| Status::failed_precondition("no Kubernetes CA key on this node"))?;
        let admin = pki::issue(
            &ca,
            &LeafSpec {
                organization: Some("system:masters".into()),
                common_name: "admin".into(),
                client: true,
                days: 365,
                ..LeafSpec::default()
            },
        )
        .map_err(|e| Status::internal(e.to_string()))?;
        let name = &applied.cluster_name;
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n    - name: {name}\n      cluster:\n        server: {}\n        certificate-authority-data: {}\nusers:\n    - name: admin@{name}\n      user:\n        client-certificate-data: {}\n        client-key-data: {}\ncontexts:\n    - context:\n        cluster: {name}\n        namespace: default\n        user: admin@{name}\n      name: admin@{name}\ncurrent-context: admin@{name}\n",
            applied.endpoint,
            STANDARD.encode(&ca.crt),
            STANDARD.encode(&admin.crt),
            STANDARD.encode(&admin.key),
        );
        // A tar with one entry and no end-of-archive blocks, gzipped.
        let mut tar = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(text.len() as u64);
        h.set_mode(0o600);
        h.set_cksum();
        tar.append_data(&mut h, "kubeconfig", text.as_bytes())
            .map_err(|e| Status::internal(e.to_string()))?;
        let mut raw = tar
            .into_inner()
            .map_err(|e| Status::internal(e.to_string()))?;
        raw.truncate(raw.len() - 1024);
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        std::io::Write::write_all(&mut gz, &raw).map_err(|e| Status::internal(e.to_string()))?;
        let archive = gz.finish().map_err(|e| Status::internal(e.to_string()))?;
        node.st.lock().unwrap().stats.kubeconfigs += 1;
        let (first, second) = archive.split_at(archive.len() / 2);
        Ok([first, second]
            .map(|bytes| Data {
                metadata: None,
                bytes: bytes.to_vec(),
            })
            .into())
    }

    fn services_on(&self, i: usize) -> ServiceList {
        let now = Instant::now();
        let service = |id: &str, state: &str, healthy: Option<bool>, msg: &str| ServiceInfo {
            id: id.into(),
            state: state.into(),
            events: None,
            health: Some(ServiceHealth {
                unknown: healthy.is_none(),
                healthy: healthy.unwrap_or(false),
                last_message: hostile::said(self.cluster.args.hostile_text.as_deref(), msg),
                last_change: None,
            }),
        };
        let mut services = vec![
            service("apid", "Running", Some(true), ""),
            service("machined", "Running", Some(true), ""),
        ];
        let kubelet = self.cluster.kubelet_healthy_at(i);
        let restarting = self
            .cluster
            .k8s_restarting(i, k8s::versions::Component::Kubelet, now);
        services.push(match kubelet {
            Some(t) if now >= t && !restarting => service("kubelet", "Running", Some(true), ""),
            _ => service(
                "kubelet",
                "Running",
                Some(false),
                "waiting for kubelet to become healthy",
            ),
        });
        if self.cluster.node(i).control_plane() {
            let start = self.cluster.etcd_start(i);
            let healthy = self.cluster.etcd_healthy_at(i);
            let failed = self.cluster.etcd_failed(i);
            services.push(match (start, healthy) {
                _ if failed.is_some() => {
                    service("etcd", "Failed", None, failed.as_deref().unwrap_or(""))
                }
                (Some(_), Some(h)) if now >= h => service("etcd", "Running", Some(true), ""),
                (Some(s), _) if now >= s => {
                    service("etcd", "Running", Some(false), "etcd is starting")
                }
                _ => service(
                    "etcd",
                    "Preparing",
                    None,
                    "Waiting for etcd bootstrap or join",
                ),
            });
        }
        ServiceList {
            metadata: None,
            services,
        }
    }

    fn version_on(&self, i: usize) -> Version {
        Version {
            metadata: None,
            version: Some(VersionInfo {
                tag: self.version_tag(i),
                sha: "imgbuild-sim".into(),
                built: String::new(),
                go_version: String::new(),
                os: "linux".into(),
                arch: "amd64".into(),
            }),
            platform: Some(PlatformInfo {
                name: "metal".into(),
                mode: "metal".into(),
            }),
        }
    }

    /// storaged's disks: `device_name` is `/dev/` joined with the disk's id.
    fn disks_on(&self) -> Disks {
        Disks {
            metadata: None,
            disks: self
                .cluster
                .args
                .disks
                .iter()
                .map(|id| Disk {
                    size: 20 << 30,
                    model: "QEMU HARDDISK".into(),
                    device_name: format!("/dev/{id}"),
                })
                .collect(),
        }
    }
}

type DataStream = Pin<Box<dyn Stream<Item = Result<Data, Status>> + Send>>;

/// A Kubeconfig archive (gzip'd tar, one entry) whose entry is 128 MiB of
/// zeros: about 128 KiB on the wire. Made once.
fn zeros_archive() -> &'static [u8] {
    static ARCHIVE: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    ARCHIVE.get_or_init(|| {
        let size = 128u64 << 20;
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        let mut h = tar::Header::new_gnu();
        h.set_path("kubeconfig").expect("a short name");
        h.set_size(size);
        h.set_mode(0o600);
        h.set_cksum();
        std::io::Write::write_all(&mut gz, h.as_bytes()).expect("in memory");
        std::io::copy(&mut std::io::Read::take(std::io::repeat(0), size), &mut gz)
            .expect("in memory");
        gz.finish().expect("in memory")
    })
}

#[tonic::async_trait]
impl MachineService for Api {
    async fn apply_configuration(
        &self,
        req: Request<ApplyConfigurationRequest>,
    ) -> Result<Response<ApplyConfigurationResponse>, Status> {
        let mode = ApplyMode::try_from(req.get_ref().mode).unwrap_or(ApplyMode::Reboot);
        let messages = if self.secure {
            let messages =
                self.answer(&req, |i| Ok(vec![self.apply_configured(i, req.get_ref())?]))?;
            // Persisting takes a while, the apply lock held meanwhile.
            if !req.get_ref().dry_run {
                tokio::time::sleep(ms(self.cluster.args.apply_time)).await;
            }
            messages
        } else if matches!(mode, ApplyMode::Auto | ApplyMode::Reboot | ApplyMode::Try) {
            vec![self.apply_on(self.me, &req.get_ref().data)?]
        } else {
            return Err(Status::invalid_argument(format!(
                "apply mode {mode:?} is not supported in maintenance mode"
            )));
        };
        Ok(Response::new(ApplyConfigurationResponse { messages }))
    }

    async fn bootstrap(
        &self,
        req: Request<BootstrapRequest>,
    ) -> Result<Response<BootstrapResponse>, Status> {
        if !self.secure {
            return Err(Status::unimplemented("method Bootstrap not implemented"));
        }
        let recover = req.get_ref().recover_etcd;
        let messages = self.answer(&req, |i| Ok(vec![self.bootstrap_on(i, recover)?]))?;
        Ok(Response::new(BootstrapResponse { messages }))
    }

    async fn etcd_member_list(
        &self,
        req: Request<EtcdMemberListRequest>,
    ) -> Result<Response<EtcdMemberListResponse>, Status> {
        let messages = self.answer(&req, |i| Ok(vec![self.etcd_members_on(i)?]))?;
        Ok(Response::new(EtcdMemberListResponse { messages }))
    }

    async fn etcd_recover(
        &self,
        req: Request<tonic::Streaming<Data>>,
    ) -> Result<Response<EtcdRecoverResponse>, Status> {
        self.etcd_recover_call(req).await
    }

    type EtcdSnapshotStream = DataStream;

    async fn etcd_snapshot(
        &self,
        req: Request<EtcdSnapshotRequest>,
    ) -> Result<Response<Self::EtcdSnapshotStream>, Status> {
        self.etcd_snapshot_call(req)
    }

    type KubeconfigStream = DataStream;

    async fn kubeconfig(
        &self,
        req: Request<()>,
    ) -> Result<Response<Self::KubeconfigStream>, Status> {
        let chunks = self.answer(&req, |i| self.kubeconfig_on(i))?;
        // Hostile nodes (the tests of imgbuild's bounds): a stream that
        // never ends, or an archive whose one entry unpacks to 128 MiB.
        let me = self.cluster.node(self.me);
        let metadata = chunks.first().and_then(|c| c.metadata.clone());
        if me.has("endless-kubeconfig") {
            let chunk = Data {
                metadata,
                bytes: vec![0x1f; 1 << 20],
            };
            return Ok(Response::new(Box::pin(futures_util::stream::repeat_with(
                move || Ok(chunk.clone()),
            ))));
        }
        if me.has("kubeconfig-bomb") {
            let chunks: Vec<Data> = zeros_archive()
                .chunks(1 << 20)
                .map(|bytes| Data {
                    metadata: metadata.clone(),
                    bytes: bytes.to_vec(),
                })
                .collect();
            return Ok(Response::new(Box::pin(futures_util::stream::iter(
                chunks.into_iter().map(Ok),
            ))));
        }
        Ok(Response::new(Box::pin(futures_util::stream::iter(
            chunks.into_iter().map(Ok),
        ))))
    }

    async fn service_list(
        &self,
        req: Request<()>,
    ) -> Result<Response<ServiceListResponse>, Status> {
        let messages = self.answer(&req, |i| Ok(vec![self.services_on(i)]))?;
        Ok(Response::new(ServiceListResponse { messages }))
    }

    async fn version(&self, req: Request<()>) -> Result<Response<VersionResponse>, Status> {
        if !self.secure {
            self.cluster
                .node(self.me)
                .st
                .lock()
                .unwrap()
                .stats
                .maintenance_version_calls += 1;
        }
        let messages = self.answer(&req, |i| Ok(vec![self.version_on(i)]))?;
        Ok(Response::new(VersionResponse { messages }))
    }

    async fn upgrade(
        &self,
        req: Request<UpgradeRequest>,
    ) -> Result<Response<UpgradeResponse>, Status> {
        self.upgrade_call(req).await
    }

    async fn meta_write(
        &self,
        req: Request<MetaWriteRequest>,
    ) -> Result<Response<MetaWriteResponse>, Status> {
        self.meta_write_call(req)
    }

    type ReadStream = DataStream;

    async fn read(&self, req: Request<ReadRequest>) -> Result<Response<Self::ReadStream>, Status> {
        let chunks = self.answer(&req, |i| self.read_on(i, &req.get_ref().path))?;
        Ok(Response::new(Box::pin(futures_util::stream::iter(
            chunks.into_iter().map(Ok),
        ))))
    }

    async fn reboot(
        &self,
        req: Request<RebootRequest>,
    ) -> Result<Response<RebootResponse>, Status> {
        let messages = self.answer(&req, |i| {
            self.reboot_on(i, req.get_ref())?;
            Ok(vec![Reboot {
                metadata: None,
                actor_id: format!("sim-reboot-{i}-{}", self.cluster.now_ms()),
            }])
        })?;
        Ok(Response::new(RebootResponse { messages }))
    }

    async fn etcd_leave_cluster(
        &self,
        req: Request<EtcdLeaveClusterRequest>,
    ) -> Result<Response<EtcdLeaveClusterResponse>, Status> {
        self.etcd_leave_cluster_call(req)
    }

    async fn etcd_remove_member_by_id(
        &self,
        req: Request<EtcdRemoveMemberByIdRequest>,
    ) -> Result<Response<EtcdRemoveMemberByIdResponse>, Status> {
        self.etcd_remove_member_by_id_call(req)
    }

    async fn reset(&self, req: Request<ResetRequest>) -> Result<Response<ResetResponse>, Status> {
        self.reset_call(req)
    }

    async fn image_pull(
        &self,
        req: Request<ImagePullRequest>,
    ) -> Result<Response<ImagePullResponse>, Status> {
        self.image_pull_call(req).await
    }
}

#[tonic::async_trait]
impl StorageService for Api {
    async fn disks(&self, req: Request<()>) -> Result<Response<DisksResponse>, Status> {
        let messages = if self.secure {
            self.answer(&req, |_| Ok(vec![self.disks_on()]))?
        } else {
            vec![self.disks_on()]
        };
        Ok(Response::new(DisksResponse { messages }))
    }
}

/// The API server's TLS config once one is up: a certificate from the
/// cluster CA naming every address it may be reached on.
fn k8s_tls(cluster: &Cluster, serving: Option<usize>) -> Option<Arc<ServerConfig>> {
    let now = Instant::now();
    let up = reached(cluster.api_up_at(), now);
    if !up {
        return None;
    }
    if let Some(i) = serving
        && (!reached(cluster.etcd_healthy_at(i), now)
            || cluster.k8s_restarting(i, k8s::versions::Component::ApiServer, now))
    {
        return None;
    }
    let from = serving
        .or_else(|| (0..cluster.count()).find(|&i| reached(cluster.etcd_healthy_at(i), now)))?;
    let applied = cluster.node(from).st.lock().unwrap().applied.clone()?;
    let ca = applied.k8s_ca.clone()?;
    let key = (from, ca.crt.clone());
    if let Some(tls) = cluster.apiserver_tls.lock().unwrap().get(&key) {
        return Some(tls.clone());
    }
    let mut ips = applied.api_sans.clone();
    ips.push(cluster.node(from).ip);
    ips.extend(cluster.args.vip);
    let leaf = pki::issue(
        &ca,
        &LeafSpec {
            common_name: "kube-apiserver".into(),
            ips,
            server: true,
            days: 365,
            ..LeafSpec::default()
        },
    )
    .ok()?;
    let tls = server_config(&leaf, Some(&ca.crt)).ok()?;
    cluster
        .apiserver_tls
        .lock()
        .unwrap()
        .insert(key, tls.clone());
    Some(tls)
}

async fn serve_k8s(cluster: Arc<Cluster>, serving: Option<usize>, listener: TcpListener) {
    let node = serving.map(|i| cluster.node(i));
    let Ok(on) = listener.local_addr() else {
        return;
    };
    let mut changes = node.as_ref().map(|n| n.changed.subscribe());
    loop {
        let halted = async {
            match changes.as_mut() {
                Some(c) => {
                    let _ = c.changed().await;
                }
                None => std::future::pending().await,
            }
        };
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = halted => {
                if node.as_ref().is_some_and(|n| n.halted()) {
                    return;
                }
                continue;
            }
        };
        let Ok((tcp, _)) = accepted else {
            continue;
        };
        cluster
            .connections
            .record(k8s::forward::Api::Kubernetes, on);
        let cluster = cluster.clone();
        tokio::spawn(async move {
            let Some(cfg) = k8s_tls(&cluster, serving) else {
                return;
            };
            let Ok(tls) = tokio_rustls::TlsAcceptor::from(cfg).accept(tcp).await else {
                return;
            };
            let app = Router::new()
                .route("/api/v1/nodes", get(health::nodes))
                .route(
                    "/api/v1/nodes/{name}",
                    axum::routing::patch(health::patch_node).delete(remove::delete_node),
                )
                .route("/api/v1/pods", get(health::all_pods))
                .route(
                    "/api/v1/namespaces/{ns}/pods/{name}/eviction",
                    post(health::evict),
                )
                .route("/api/v1/namespaces/kube-system/pods", get(health::pods))
                .route(
                    "/apis/apps/v1/namespaces/kube-system/daemonsets",
                    get(health::daemonsets),
                )
                .route(
                    "/apis/apps/v1/namespaces/kube-system/deployments",
                    get(health::deployments),
                )
                .route("/metrics", get(k8s::deprecated::metrics))
                .merge(k8s::objects::routes())
                .with_state(cluster);
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(tls), TowerToHyperService::new(app))
                .await;
        });
    }
}

/// `POST /_sim/vip`: the held VIP may appear now.
async fn release_vip(State(cluster): State<Arc<Cluster>>) -> axum::Json<Value> {
    cluster.vip_gate.release();
    axum::Json(json!({"released": true}))
}

/// The VIP appears once etcd elects a leader (after bootstrap), never before,
/// and not while `--vip-held` holds it.
async fn serve_vip(cluster: Arc<Cluster>, vip: IpAddr) {
    cluster.vip_gate.open().await;
    loop {
        if reached(cluster.api_up_at(), Instant::now()) {
            break;
        }
        tokio::time::sleep(ms(50)).await;
    }
    if let Ok(l) = TcpListener::bind(SocketAddr::new(vip, cluster.args.k8s_port)).await {
        serve_k8s(cluster, None, l).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    /// A control plane and a worker, both configured; the API of the first.
    fn configured() -> Api {
        let cli = Cli::parse_from([
            "sim",
            "--node",
            "cp-01=127.0.0.11:controlplane",
            "--node",
            "worker-01=127.0.0.21:worker",
        ]);
        let cluster = new_cluster(cli.args).unwrap();
        for n in cluster.all() {
            n.st.lock().unwrap().configured_at = Some(Instant::now());
        }
        Api {
            cluster,
            me: 0,
            secure: true,
        }
    }

    fn routed(key: &'static str, value: &str) -> Request<()> {
        let mut req = Request::new(());
        req.metadata_mut().insert(key, value.parse().unwrap());
        req
    }

    fn services(api: &Api, req: Request<()>) -> Result<Vec<ServiceList>, Status> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(api.service_list(req))
            .map(|r| r.into_inner().messages)
    }

    fn has_etcd(list: &ServiceList) -> bool {
        list.services.iter().any(|s| s.id == "etcd")
    }

    #[test]
    fn direct_and_one_to_one_replies_carry_no_metadata() {
        let api = configured();
        let local = services(&api, Request::new(())).unwrap();
        assert!(local[0].metadata.is_none() && has_etcd(&local[0]));
        let one = services(&api, routed("node", "127.0.0.21")).unwrap();
        assert_eq!(one.len(), 1);
        assert!(one[0].metadata.is_none(), "{:?}", one[0].metadata);
        assert!(!has_etcd(&one[0]), "answered by the worker");
        // A target that cannot be reached is a gRPC error one-to-one.
        let err = services(&api, routed("node", "127.0.0.99")).unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unavailable);
    }

    #[test]
    fn one_to_many_stamps_the_target_as_sent_and_reports_failures_inside() {
        let api = configured();
        let many = services(&api, routed("nodes", "127.0.0.21")).unwrap();
        assert_eq!(many.len(), 1);
        let md = many[0].metadata.as_ref().unwrap();
        assert_eq!(md.hostname, "127.0.0.21", "the target, not worker-01");
        assert!(md.error.is_empty() && !has_etcd(&many[0]));
        // A failed target: a reply, not a gRPC error.
        let failed = services(&api, routed("nodes", "127.0.0.99")).unwrap();
        let md = failed[0].metadata.as_ref().unwrap();
        assert_eq!(md.hostname, "127.0.0.99");
        assert!(
            md.error.starts_with("rpc error: code = Unavailable"),
            "{}",
            md.error
        );
        assert_eq!(
            md.status.as_ref().unwrap().code,
            tonic::Code::Unavailable as i32
        );
        assert!(failed[0].services.is_empty());
    }

    #[test]
    fn booting_is_idempotent_per_address_and_a_restart_keeps_the_config() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let cli = Cli::parse_from(["sim", "--talos-port", "0", "--k8s-port", "0"]);
            let cluster = new_cluster(cli.args).unwrap();
            let body = |name: &str, ip: &str, config: Option<&str>| {
                axum::Json(BootRequest {
                    name: name.into(),
                    ip: ip.parse().unwrap(),
                    hostname: Some("cp-01".into()),
                    config: config.map(str::to_owned),
                    talos_version: None,
                    secure_boot: None,
                })
            };
            let st = State(cluster.clone());
            let (code, v) = boot(st.clone(), body("vm-300", "127.77.0.11", None)).await;
            assert_eq!((code.as_u16(), &v["booted"]), (200, &json!(true)), "{v:?}");
            let (_, v) = boot(st.clone(), body("vm-301", "127.77.0.11", None)).await;
            assert_eq!(v["booted"], false, "the address is up already");
            assert_eq!(cluster.count(), 1);
            let node = cluster.node(0);
            assert_eq!(node.display_name(), "cp-01");
            node.st.lock().unwrap().configured_at = Some(Instant::now());

            let halt_body = || {
                axum::Json(HaltRequest {
                    ip: "127.77.0.11".parse().unwrap(),
                })
            };
            let (_, v) = halt(st.clone(), halt_body()).await;
            assert_eq!(v["halted"], true);
            assert_eq!(cluster.node(0).phase(Instant::now()), Phase::Down);
            let (_, v) = halt(st.clone(), halt_body()).await;
            assert_eq!(v["halted"], false);
            // The same VM again: its disk kept the config.
            let (_, v) = boot(st.clone(), body("vm-300", "127.77.0.11", None)).await;
            assert_eq!(v["booted"], true);
            assert_eq!(cluster.node(0).phase(Instant::now()), Phase::Configured);
            // Another machine on that address after a halt: a fresh node.
            let (code, _) = halt(st.clone(), halt_body()).await;
            assert_eq!(code.as_u16(), 200);
            let (_, v) = boot(st.clone(), body("vm-302", "127.77.0.11", None)).await;
            assert_eq!(v["booted"], true);
            assert_eq!(cluster.node(0).phase(Instant::now()), Phase::Maintenance);
            assert_eq!(cluster.count(), 1);

            let (_, v) = boot(st.clone(), body("srv", "127.77.0.12", Some("machine: [1]"))).await;
            let why = v["config_error"].as_str().unwrap();
            assert!(why.starts_with("config validation failed"), "{why}");
            let (code, _) = boot(st, body("x", "10.0.0.1", None)).await;
            assert_eq!(code.as_u16(), 400);
        });
    }

    #[test]
    fn disks_are_full_device_paths() {
        let api = configured();
        assert_eq!(api.disks_on().disks[0].device_name, "/dev/sda");
    }

    #[test]
    fn multi_document_configs_are_read_as_talos_reads_them() {
        let v1 = "version: v1alpha1\nmachine:\n  type: worker\n";
        let ts = "apiVersion: v1alpha1\nkind: ExtensionServiceConfig\nname: tailscale\nenvironment: [TS_AUTHKEY=x]\n";
        let read =
            |text: String| read_documents(text.as_bytes()).map_err(|s| s.message().to_owned());
        let (doc, others) = read(format!("---\n{v1}---\n{ts}---\n")).unwrap();
        assert_eq!(doc["machine"]["type"], "worker");
        assert_eq!(others, ["ExtensionServiceConfig/tailscale"]);
        for (text, want) in [
            (
                format!("{v1}---\n{ts}---\n{ts}"),
                "duplicate document v1alpha1/ExtensionServiceConfig/tailscale",
            ),
            (format!("{v1}---\n{v1}"), "duplicate document v1alpha1//"),
            (
                format!("{v1}---\nkind: ExtensionServiceConfig\nname: a\n"),
                "missing apiVersion",
            ),
            (
                format!("{v1}---\napiVersion: v1alpha1\nname: a\n"),
                "unknown keys found during decoding: : apiVersion, name",
            ),
            (
                format!("{v1}---\napiVersion: v1alpha2\nname: a\n"),
                "missing kind",
            ),
            (
                format!("{v1}---\napiVersion: v1alpha1\nkind: HostnameConfig\n"),
                "\"HostnameConfig\" \"v1alpha1\": not registered",
            ),
            (
                format!("{v1}---\n{ts}environ: []\n"),
                "unknown keys found during decoding: : environ",
            ),
            (ts.to_owned(), "no v1alpha1 document"),
            (format!("{v1}---\n- 1\n"), "expected a YAML document"),
        ] {
            let err = read(text).unwrap_err();
            assert!(err.contains(want), "{want}: {err}");
        }
    }

    fn schema_problems(doc: &Value) -> Vec<String> {
        problems_of(&registry()[&("v1alpha1".to_owned(), String::new())], doc)
    }

    #[test]
    fn configs_are_held_against_the_vendored_schema() {
        assert!(
            schema_problems(&json!({"version": "v1alpha1", "machine": {"type": "worker"}}))
                .is_empty()
        );
        let problems =
            schema_problems(&json!({"version": "v1alpha1", "machine": {"typo": "s3cret"}}));
        assert_eq!(
            problems,
            ["unknown keys found during decoding: /machine: typo"]
        );
        let problems =
            schema_problems(&json!({"version": "v1alpha1", "machine": {"certSANs": "s3cret"}}));
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].starts_with("/machine/certSANs:") && !problems[0].contains("s3cret"));
    }
}
