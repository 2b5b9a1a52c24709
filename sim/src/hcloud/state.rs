//! The Hetzner Cloud double's state: its flags, the world of servers, SSH
//! keys, images and actions it keeps, and the API's error shape
//! (hetznercloud/hcloud-go `hcloud/schema/error.go`, docs.hetzner.cloud).

use super::catalog::*;
use super::networks::Network;
use super::schema::{FieldError, Schemas, invalid_input};
use crate::chain::Nodes;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

#[derive(clap::Args)]
pub struct Args {
    /// Where server disks, snapshots and rescue systems live.
    #[arg(long)]
    pub(crate) state_dir: PathBuf,
    /// Loopback address to listen on.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub(crate) listen: SocketAddr,
    /// The one valid API token.
    #[arg(
        long,
        default_value = "simtoken0000000000000000000000000000000000000000000000000000000"
    )]
    pub(crate) token: String,
    /// Seconds each action runs before it ends.
    #[arg(long, default_value_t = 0.5)]
    pub(crate) action_seconds: f64,
    /// The rescue sshd refuses connections for this many seconds after poweron.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) ssh_refuse_seconds: f64,
    /// The rescue sshd never accepts connections.
    #[arg(long)]
    pub(crate) ssh_never: bool,
    /// The rescue system's `dd` exits non-zero before reading its input.
    #[arg(long)]
    pub(crate) dd_fails: bool,
    /// Actions of this endpoint or command (e.g. create_image, enable_rescue,
    /// start_server) end in `error`.
    #[arg(long)]
    pub(crate) action_error: Vec<String>,
    /// Every Nth request is answered 429 rate_limit_exceeded.
    #[arg(long)]
    pub(crate) rate_limit_every: Option<u64>,
    /// POST /servers with this server type (in this location) answers 412.
    #[arg(long)]
    pub(crate) unavailable: Vec<String>,
    /// Seconds create_image runs (default: --action-seconds).
    #[arg(long)]
    pub(crate) slow_create_image: Option<f64>,
    /// The node simulator's control URL: a server created from a snapshot
    /// boots a Talos node configured from its user_data when it starts.
    #[arg(long)]
    pub(crate) nodes_control: Option<String>,
    /// NAME=CIDR: a network besides the seeded `talos` (10.0.0.0/16).
    #[arg(long)]
    pub(crate) network: Vec<String>,
    /// The rescue sshd's port on every server's address (default: 22 as
    /// root, else a free one): a high port lets a non-root simulator serve
    /// a fixed port the client can be told.
    #[arg(long)]
    pub(crate) rescue_ssh_port: Option<u16>,
}

pub(crate) type Labels = BTreeMap<String, String>;

pub(crate) struct SshKey {
    pub(crate) id: u64,
    pub(crate) name: String,
    pub(crate) public_key: String,
    pub(crate) fingerprint: String,
    pub(crate) labels: Labels,
    pub(crate) created: u64,
}

pub(crate) struct Server {
    pub(crate) id: u64,
    pub(crate) name: String,
    pub(crate) status: &'static str,
    pub(crate) created: u64,
    pub(crate) server_type: &'static ServerType,
    pub(crate) location: &'static str,
    pub(crate) image: u64,
    pub(crate) labels: Labels,
    pub(crate) rescue_enabled: bool,
    pub(crate) rescue_keys: Vec<String>,
    pub(crate) ip: Ipv4Addr,
    /// The rescue sshd's port, once a rescue boot chose one.
    pub(crate) ssh_port: Option<u16>,
    /// The running action that locks the server.
    pub(crate) busy: Option<u64>,
    /// Bumped at every power change, so a late sshd start for an earlier
    /// boot is discarded.
    pub(crate) boot: u64,
    pub(crate) sshd: Option<tokio::process::Child>,
    pub(crate) user_data: Option<String>,
    /// Created from a snapshot (not a system image): boots Talos.
    pub(crate) from_snapshot: bool,
    /// A Talos node was booted for it (and is to be halted).
    pub(crate) node_booted: bool,
    /// Attached networks and the server's address on each.
    pub(crate) private_net: Vec<(u64, Ipv4Addr)>,
}

pub(crate) struct Image {
    pub(crate) id: u64,
    pub(crate) snapshot: bool,
    pub(crate) name: Option<String>,
    pub(crate) description: String,
    pub(crate) status: &'static str,
    pub(crate) labels: Labels,
    pub(crate) created: u64,
    pub(crate) image_size: Option<f64>,
    pub(crate) disk_size: u64,
    pub(crate) created_from: Option<(u64, String)>,
    pub(crate) arch: &'static str,
}

pub(crate) struct Action {
    pub(crate) id: u64,
    pub(crate) command: String,
    pub(crate) started: u64,
    pub(crate) started_at: Instant,
    pub(crate) duration: Duration,
    pub(crate) finished: Option<u64>,
    pub(crate) error: bool,
    pub(crate) resources: Vec<(u64, &'static str)>,
}

#[derive(Default)]
pub(crate) struct World {
    pub(crate) ssh_keys: BTreeMap<u64, SshKey>,
    pub(crate) servers: BTreeMap<u64, Server>,
    pub(crate) images: BTreeMap<u64, Image>,
    pub(crate) actions: BTreeMap<u64, Action>,
    pub(crate) networks: BTreeMap<u64, Network>,
    pub(crate) next_id: u64,
    pub(crate) addresses: u32,
}

impl World {
    pub(crate) fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }
}

#[derive(Default)]
pub(crate) struct Stats {
    pub(crate) requests: AtomicU64,
    pub(crate) servers_created: AtomicU64,
    pub(crate) servers_from_snapshots: AtomicU64,
    pub(crate) images_created: AtomicU64,
    pub(crate) rate_limited: AtomicU64,
    pub(crate) rejected: AtomicU64,
}

pub(crate) struct Sim {
    pub(crate) args: Args,
    pub(crate) schemas: Schemas,
    pub(crate) world: Mutex<World>,
    pub(crate) stats: Stats,
    /// The third octet of this process's server addresses (127.4.P.x), so
    /// simulators running side by side never pick the same address.
    pub(crate) address_base: u32,
    pub(crate) nodes: Option<Nodes>,
}

pub(crate) type ApiError = (u16, Value);
pub(crate) type Answer = Result<(u16, Value), ApiError>;

pub(crate) fn err(status: u16, code: &str, message: impl Into<String>) -> ApiError {
    (
        status,
        json!({"code": code, "message": message.into(), "details": {}}),
    )
}

pub(crate) fn field_error(name: &str, message: impl Into<String>) -> ApiError {
    (
        422,
        invalid_input(vec![FieldError {
            name: name.into(),
            message: message.into(),
            unknown: false,
        }]),
    )
}

pub(crate) fn not_found(what: &str) -> ApiError {
    err(404, "not_found", format!("{what} not found"))
}

pub(crate) fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// RFC 3339 UTC time of a unix timestamp (the API's `created` format).
pub(crate) fn iso(secs: u64) -> String {
    let days = (secs / 86400) as i64;
    let rem = secs % 86400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}+00:00",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

impl Sim {
    pub(crate) fn server_dir(&self, id: u64) -> PathBuf {
        self.args.state_dir.join("servers").join(id.to_string())
    }

    pub(crate) fn disk(&self, id: u64) -> PathBuf {
        self.server_dir(id).join("sda")
    }

    /// Whether `--action-error` names this endpoint or command.
    pub(crate) fn fails(&self, endpoint: &str, command: &str) -> bool {
        self.args
            .action_error
            .iter()
            .any(|t| t == endpoint || t == command)
    }

    pub(crate) fn unavailable(&self, server_type: &str, location: &str) -> bool {
        self.args
            .unavailable
            .iter()
            .any(|u| match u.split_once('@') {
                Some((t, l)) => t == server_type && l == location,
                None => u == server_type,
            })
    }
}

pub(crate) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}
