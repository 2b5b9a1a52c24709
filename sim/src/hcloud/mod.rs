//! The Hetzner Cloud double: the API of the OpenAPI document
//! (`sim/api-schemas/hetzner-cloud.openapi.json`) on plain HTTP on loopback,
//! as far as making snapshots through a rescue system needs it (the flow of
//! apricote/hcloud-upload-image `hcloudimages/client.go`),
//! with a rescue system that is a real OpenSSH sshd ([`self::rescue`]).
//!
//! # Contract (tests and the imgbuild client depend on it)
//! ```text
//! imgbuild-sim hcloud --state-dir DIR [--listen 127.0.0.1:0] [--token TOKEN]
//!     [--action-seconds 0.5] [--ssh-refuse-seconds N] [--ssh-never] [--dd-fails]
//!     [--action-error TYPE] [--rate-limit-every N] [--unavailable TYPE[@LOCATION]]
//!     [--slow-create-image F] [--nodes-control http://127.0.0.1:PORT]
//!     [--network NAME=CIDR]... [--rescue-ssh-port PORT]
//! ```
//! Prints one JSON line once it listens:
//! `{"url":"http://127.0.0.1:PORT/v1","token":"…"}` (the one valid bearer token).
//! Under `/v1` (`Authorization: Bearer TOKEN`, else 401 `unauthorized`):
//! `GET /server_types`, `/locations`, `/images` (filters `type`, `status`,
//! `name`, `architecture`, `label_selector`; `sort`; pagination),
//! `GET|DELETE /images/{id}`, `GET|POST /ssh_keys`, `GET|DELETE /ssh_keys/{id}`,
//! `GET|POST /servers`, `GET|DELETE /servers/{id}`,
//! `POST /servers/{id}/actions/{enable_rescue,poweron,poweroff,shutdown,create_image,
//! attach_to_network}`, `GET /networks` (filters `name`, `label_selector`;
//! `sort`; pagination), `GET /networks/{id}`, `GET /actions/{id}`. Lists paginate (`page`, `per_page` ≤ 50, `meta.pagination`).
//! Every request body is checked against the vendored OpenAPI document
//! ([`self::schema`]): 422 `invalid_input` with `details.fields`.
//! Errors are `{"error": {code, message, details}}`.
//!
//! Actions run `--action-seconds` (create_image: `--slow-create-image` if
//! given), then end in `success`, or `error` when `--action-error` names
//! their endpoint or command. While one runs its server is locked (423
//! `locked`). Server status: `initializing` → `off`; `starting` → `running`
//! (poweron); `stopping` → `off` (poweroff, shutdown).
//!
//! Each server has a disk file `DIR/servers/<id>/sda` (made holding a
//! system-image marker) and a loopback address 127.4.P.x (P: the
//! simulator's pid mod 250, so simulators running side by side never share
//! an address), shown as
//! `public_net.ipv4.ip`. A poweron with rescue enabled starts sshd there
//! (after `--ssh-refuse-seconds`; never with `--ssh-never`) on
//! `--rescue-ssh-port` if given, else on port 22 when running as root and
//! free, else on a free port; a port other than 22 is shown as the
//! server's simulator-only `sim_ssh_port`. Login: `root`, only the keys given to
//! `enable_rescue`; `hostname` prints `rescue`, `blkdiscard --force
//! /dev/sda` empties the disk file, `dd of=/dev/sda …` writes it (fails with
//! `--dd-fails`, before reading any input). sshd stops on poweroff, shutdown, delete and exit; a
//! rescue boot is for the next boot only (poweroff clears `rescue_enabled`).
//! (Logging in as root needs the simulator to run as root; otherwise sshd
//! lets in only the user running it, which is how the tests run without
//! root: imgbuild's hidden `--rescue-ssh-user` and `--rescue-ssh-port`.)
//! `create_image` copies the disk to `DIR/images/<id>.raw` when asked; the
//! snapshot is `creating` until the action succeeds, then `available`.
//!
//! Networks: `talos` (10.0.0.0/16, one cloud subnet 10.0.1.0/24 in
//! eu-central, gateway 10.0.0.1) is always there, with the first id; each
//! `--network NAME=CIDR` adds one whose single eu-central subnet is the
//! whole range. `POST /servers` with `networks: [id]` attaches at create
//! (first free address from .2 in the zone's subnets; unknown id → 422
//! `invalid_input` on `networks`); `attach_to_network {network, ip?}` is an
//! action (`attach_to_network`; 404 for an unknown network, 422
//! `server_already_attached`, `ip_not_available` for a taken address or one
//! outside the zone's subnets, `no_subnet_available`). Servers show
//! `private_net: [{network, ip, alias_ips, mac_address}]`; networks list
//! their attached `servers`. Addresses are bookkeeping only, never bound.
//!
//! The chain (with `--nodes-control`, the node simulator's `control` URL):
//! a server created from an image of type `snapshot` that starts (poweron,
//! or `start_after_create`, true by default) without rescue enabled POSTs
//! `/_sim/boot {"name": <server name>, "ip": <public_net.ipv4.ip>,
//! "config": <the config Talos reads from user_data, or null>}` once it is
//! `running` (user_data decoded as Talos does: base64 if it is base64, then
//! gunzipped if gzip; unreadable → no boot); the node simulator validates
//! the config itself. poweroff, shutdown and delete
//! POST `/_sim/halt {"ip"}`. `user_data` over 32768 bytes → 422
//! `invalid_input` (field `user_data`; the OpenAPI document: "limited to
//! 32KiB").
//!
//! Server types carry their `disk` (GB; cx23, cpx12, cax11: 40; cx33,
//! cpx22, cax21: 80), images their `disk_size` (a snapshot: the disk of the
//! server it was taken of). `POST /servers` answers 422
//! `invalid_server_type` for a deprecated type and for a type whose disk
//! is smaller than the image's `disk_size`,
//! 412 `resource_unavailable` where the type is not offered (and for
//! `--unavailable`), 422 `placement_error` for an architecture the image
//! lacks. Switch `--rate-limit-every N`: every Nth request is answered 429
//! `rate_limit_exceeded` with `RateLimit-Reset` (unix time, 1 s ahead).
//!
//! Outside the API, no auth: `GET /_sim/stats` → `{"requests", "servers",
//! "sshKeys", "serversCreated", "serversFromSnapshots", "imagesCreated",
//! "rateLimited", "rejected"}` (servers and sshKeys: existing now; rejected:
//! 400/422 answers), `GET /_sim/servers/{id}/disk` → the disk file's path
//! as a JSON string, `GET /_sim/servers/{id}/user_data` → the user_data as
//! a JSON string, or null (404 for no such server).

mod labels;
mod networks;
mod rescue;
mod schema;

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};

use self::labels::Term;
use self::networks::{Network, network_json};
use self::schema::{FieldError, Schemas, invalid_input};
use crate::chain::Nodes;

#[derive(clap::Args)]
pub struct Args {
    /// Where server disks, snapshots and rescue systems live.
    #[arg(long)]
    state_dir: PathBuf,
    /// Loopback address to listen on.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// The one valid API token.
    #[arg(
        long,
        default_value = "simtoken0000000000000000000000000000000000000000000000000000000"
    )]
    token: String,
    /// Seconds each action runs before it ends.
    #[arg(long, default_value_t = 0.5)]
    action_seconds: f64,
    /// The rescue sshd refuses connections for this many seconds after poweron.
    #[arg(long, default_value_t = 0.0)]
    ssh_refuse_seconds: f64,
    /// The rescue sshd never accepts connections.
    #[arg(long)]
    ssh_never: bool,
    /// The rescue system's `dd` exits non-zero before reading its input.
    #[arg(long)]
    dd_fails: bool,
    /// Actions of this endpoint or command (e.g. create_image, enable_rescue,
    /// start_server) end in `error`.
    #[arg(long)]
    action_error: Vec<String>,
    /// Every Nth request is answered 429 rate_limit_exceeded.
    #[arg(long)]
    rate_limit_every: Option<u64>,
    /// POST /servers with this server type (in this location) answers 412.
    #[arg(long)]
    unavailable: Vec<String>,
    /// Seconds create_image runs (default: --action-seconds).
    #[arg(long)]
    slow_create_image: Option<f64>,
    /// The node simulator's control URL: a server created from a snapshot
    /// boots a Talos node configured from its user_data when it starts.
    #[arg(long)]
    nodes_control: Option<String>,
    /// NAME=CIDR: a network besides the seeded `talos` (10.0.0.0/16).
    #[arg(long)]
    network: Vec<String>,
    /// The rescue sshd's port on every server's address (default: 22 as
    /// root, else a free one): a high port lets a non-root simulator serve
    /// a fixed port the client can be told.
    #[arg(long)]
    rescue_ssh_port: Option<u16>,
}

/// A location: name, city, country, network zone.
const LOCATIONS: [(&str, &str, &str, &str); 6] = [
    ("fsn1", "Falkenstein", "DE", "eu-central"),
    ("nbg1", "Nuremberg", "DE", "eu-central"),
    ("hel1", "Helsinki", "FI", "eu-central"),
    ("ash", "Ashburn, VA", "US", "us-east"),
    ("hil", "Hillsboro, OR", "US", "us-west"),
    ("sin", "Singapore", "SG", "ap-southeast"),
];

/// A server type as the simulator offers it.
struct ServerType {
    id: u64,
    name: &'static str,
    cores: u32,
    memory: f64,
    disk: u64,
    arch: &'static str,
    /// Locations where it can be ordered.
    offered: &'static [&'static str],
    /// Removed: (announced, unavailable_after).
    deprecation: Option<(&'static str, &'static str)>,
}

const EU: &[&str] = &["fsn1", "nbg1", "hel1"];
const ALL: &[&str] = &["fsn1", "nbg1", "hel1", "ash", "hil", "sin"];

/// In the API's order (by id there; here so that equal disks tie in a
/// known order: cx23 before cpx12).
const SERVER_TYPES: [ServerType; 7] = [
    ServerType {
        id: 22,
        name: "cx22",
        cores: 2,
        memory: 4.0,
        disk: 40,
        arch: "x86",
        offered: &[],
        deprecation: Some(("2025-10-16T06:00:00+00:00", "2026-01-01T00:00:00+00:00")),
    },
    ServerType {
        id: 108,
        name: "cx23",
        cores: 2,
        memory: 4.0,
        disk: 40,
        arch: "x86",
        offered: EU,
        deprecation: None,
    },
    ServerType {
        id: 109,
        name: "cx33",
        cores: 4,
        memory: 8.0,
        disk: 80,
        arch: "x86",
        offered: EU,
        deprecation: None,
    },
    ServerType {
        id: 112,
        name: "cpx22",
        cores: 2,
        memory: 4.0,
        disk: 80,
        arch: "x86",
        offered: ALL,
        deprecation: None,
    },
    ServerType {
        id: 114,
        name: "cpx12",
        cores: 1,
        memory: 2.0,
        disk: 40,
        arch: "x86",
        offered: ALL,
        deprecation: None,
    },
    ServerType {
        id: 45,
        name: "cax11",
        cores: 2,
        memory: 4.0,
        disk: 40,
        arch: "arm",
        offered: EU,
        deprecation: None,
    },
    ServerType {
        id: 93,
        name: "cax21",
        cores: 4,
        memory: 8.0,
        disk: 80,
        arch: "arm",
        offered: EU,
        deprecation: None,
    },
];

/// System images: (id, name, architecture).
const SYSTEM_IMAGES: [(u64, &str, &str); 6] = [
    (161547269, "debian-13", "x86"),
    (161547270, "debian-13", "arm"),
    (114690387, "debian-12", "x86"),
    (114690389, "debian-12", "arm"),
    (161547271, "ubuntu-24.04", "x86"),
    (161547272, "ubuntu-24.04", "arm"),
];

type Labels = BTreeMap<String, String>;

struct SshKey {
    id: u64,
    name: String,
    public_key: String,
    fingerprint: String,
    labels: Labels,
    created: u64,
}

struct Server {
    id: u64,
    name: String,
    status: &'static str,
    created: u64,
    server_type: &'static ServerType,
    location: &'static str,
    image: u64,
    labels: Labels,
    rescue_enabled: bool,
    rescue_keys: Vec<String>,
    ip: Ipv4Addr,
    /// The rescue sshd's port, once a rescue boot chose one.
    ssh_port: Option<u16>,
    /// The running action that locks the server.
    busy: Option<u64>,
    /// Bumped at every power change, so a late sshd start for an earlier
    /// boot is discarded.
    boot: u64,
    sshd: Option<tokio::process::Child>,
    user_data: Option<String>,
    /// Created from a snapshot (not a system image): boots Talos.
    from_snapshot: bool,
    /// A Talos node was booted for it (and is to be halted).
    node_booted: bool,
    /// Attached networks and the server's address on each.
    private_net: Vec<(u64, Ipv4Addr)>,
}

struct Image {
    id: u64,
    snapshot: bool,
    name: Option<String>,
    description: String,
    status: &'static str,
    labels: Labels,
    created: u64,
    image_size: Option<f64>,
    disk_size: u64,
    created_from: Option<(u64, String)>,
    arch: &'static str,
}

struct Action {
    id: u64,
    command: String,
    started: u64,
    started_at: Instant,
    duration: Duration,
    finished: Option<u64>,
    error: bool,
    resources: Vec<(u64, &'static str)>,
}

#[derive(Default)]
struct World {
    ssh_keys: BTreeMap<u64, SshKey>,
    servers: BTreeMap<u64, Server>,
    images: BTreeMap<u64, Image>,
    actions: BTreeMap<u64, Action>,
    networks: BTreeMap<u64, Network>,
    next_id: u64,
    addresses: u32,
}

impl World {
    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }
}

#[derive(Default)]
struct Stats {
    requests: AtomicU64,
    servers_created: AtomicU64,
    servers_from_snapshots: AtomicU64,
    images_created: AtomicU64,
    rate_limited: AtomicU64,
    rejected: AtomicU64,
}

struct Sim {
    args: Args,
    schemas: Schemas,
    world: Mutex<World>,
    stats: Stats,
    /// The third octet of this process's server addresses (127.4.P.x), so
    /// simulators running side by side never pick the same address.
    address_base: u32,
    nodes: Option<Nodes>,
}

type ApiError = (u16, Value);
type Answer = Result<(u16, Value), ApiError>;

fn err(status: u16, code: &str, message: impl Into<String>) -> ApiError {
    (
        status,
        json!({"code": code, "message": message.into(), "details": {}}),
    )
}

fn field_error(name: &str, message: impl Into<String>) -> ApiError {
    (
        422,
        invalid_input(vec![FieldError {
            name: name.into(),
            message: message.into(),
            unknown: false,
        }]),
    )
}

fn not_found(what: &str) -> ApiError {
    err(404, "not_found", format!("{what} not found"))
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// RFC 3339 UTC time of a unix timestamp (the API's `created` format).
fn iso(secs: u64) -> String {
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

/// Serves the API until SIGINT or SIGTERM, then stops every rescue sshd.
pub async fn run(mut args: Args) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.listen.ip().is_loopback(),
        "{} is not a loopback address",
        args.listen
    );
    std::fs::create_dir_all(args.state_dir.join("servers"))?;
    std::fs::create_dir_all(args.state_dir.join("images"))?;
    // sshd re-executes itself from `/` for every connection: the paths in
    // the rescue systems' configs must be absolute.
    args.state_dir = std::fs::canonicalize(&args.state_dir)?;
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    let url = format!("http://{}/v1", listener.local_addr()?);
    let token = args.token.clone();
    let mut world = World {
        next_id: 4_200_000,
        ..World::default()
    };
    for (id, name, arch) in SYSTEM_IMAGES {
        world.images.insert(
            id,
            Image {
                id,
                snapshot: false,
                name: Some(name.into()),
                description: name.replace('-', " "),
                status: "available",
                labels: Labels::new(),
                created: 1_754_000_000,
                image_size: None,
                disk_size: 5,
                created_from: None,
                arch,
            },
        );
    }
    let id = world.id();
    world
        .networks
        .insert(id, Network::seeded(id, 1_754_000_000));
    for spec in &args.network {
        let id = world.id();
        world
            .networks
            .insert(id, Network::from_arg(id, 1_754_000_000, spec)?);
    }
    let nodes = args
        .nodes_control
        .as_deref()
        .map(Nodes::parse)
        .transpose()?;
    let sim = Arc::new(Sim {
        nodes,
        args,
        schemas: Schemas::load()?,
        world: Mutex::new(world),
        stats: Stats::default(),
        address_base: std::process::id() % 250,
    });
    let app = Router::new()
        .route("/_sim/stats", get(stats))
        .route("/_sim/servers/{id}/disk", get(disk_path))
        .route("/_sim/servers/{id}/user_data", get(user_data))
        .fallback(api)
        .with_state(sim.clone());
    println!("{}", json!({"url": url, "token": token}));
    let shutdown = async {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).unwrap();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    };
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await?;
    // Dropping the servers kills their sshd (kill_on_drop).
    sim.world.lock().unwrap().servers.clear();
    Ok(())
}

async fn stats(State(sim): State<Arc<Sim>>) -> axum::Json<Value> {
    let w = sim.world.lock().unwrap();
    let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
    axum::Json(json!({
        "requests": n(&sim.stats.requests),
        "servers": w.servers.len(),
        "sshKeys": w.ssh_keys.len(),
        "serversCreated": n(&sim.stats.servers_created),
        "serversFromSnapshots": n(&sim.stats.servers_from_snapshots),
        "imagesCreated": n(&sim.stats.images_created),
        "rateLimited": n(&sim.stats.rate_limited),
        "rejected": n(&sim.stats.rejected),
    }))
}

async fn disk_path(State(sim): State<Arc<Sim>>, Path(id): Path<u64>) -> Response {
    if !sim.world.lock().unwrap().servers.contains_key(&id) {
        return (StatusCode::NOT_FOUND, "no such server").into_response();
    }
    axum::Json(json!(sim.disk(id))).into_response()
}

async fn user_data(State(sim): State<Arc<Sim>>, Path(id): Path<u64>) -> Response {
    match sim.world.lock().unwrap().servers.get(&id) {
        Some(s) => axum::Json(json!(s.user_data)).into_response(),
        None => (StatusCode::NOT_FOUND, "no such server").into_response(),
    }
}

impl Sim {
    fn server_dir(&self, id: u64) -> PathBuf {
        self.args.state_dir.join("servers").join(id.to_string())
    }

    fn disk(&self, id: u64) -> PathBuf {
        self.server_dir(id).join("sda")
    }

    /// Whether `--action-error` names this endpoint or command.
    fn fails(&self, endpoint: &str, command: &str) -> bool {
        self.args
            .action_error
            .iter()
            .any(|t| t == endpoint || t == command)
    }

    fn unavailable(&self, server_type: &str, location: &str) -> bool {
        self.args
            .unavailable
            .iter()
            .any(|u| match u.split_once('@') {
                Some((t, l)) => t == server_type && l == location,
                None => u == server_type,
            })
    }
}

fn rate_headers(reset: u64, remaining: u64) -> [(&'static str, String); 3] {
    [
        ("RateLimit-Limit", "3600".into()),
        ("RateLimit-Remaining", remaining.to_string()),
        ("RateLimit-Reset", reset.to_string()),
    ]
}

/// Every `/v1` request: rate limit, auth, body check, then the route.
async fn api(
    State(sim): State<Arc<Sim>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let n = sim.stats.requests.fetch_add(1, Ordering::Relaxed) + 1;
    let reset = now() + 1;
    let reply = |status: u16, v: Value, remaining: u64| {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        if status == StatusCode::NO_CONTENT {
            return (status, rate_headers(reset, remaining)).into_response();
        }
        (status, rate_headers(reset, remaining), axum::Json(v)).into_response()
    };
    if sim
        .args
        .rate_limit_every
        .is_some_and(|every| every > 0 && n % every == 0)
    {
        bump(&sim.stats.rate_limited);
        return reply(
            429,
            json!({"error": {"code": "rate_limit_exceeded",
                "message": "limit of 3600 requests per hour reached", "details": {}}}),
            0,
        );
    }
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|h| h.to_str().ok())
        .and_then(|h| h.strip_prefix("Bearer "));
    if bearer != Some(sim.args.token.as_str()) {
        let (s, e) = err(401, "unauthorized", "unable to authenticate");
        return reply(s, json!({ "error": e }), 3599);
    }
    let Some(path) = uri.path().strip_prefix("/v1") else {
        let (s, e) = not_found("endpoint");
        return reply(s, json!({ "error": e }), 3599);
    };
    let answer = match sim.schemas.check(method.as_str(), path, &body) {
        Ok(body) => route(&sim, &method, path, uri.query().unwrap_or(""), body),
        Err(e) => Err(e),
    };
    match answer {
        Ok((s, v)) => reply(s, v, 3599),
        Err((s, e)) => {
            if s == 400 || s == 422 && e["code"] == "invalid_input" {
                bump(&sim.stats.rejected);
            }
            reply(s, json!({ "error": e }), 3599)
        }
    }
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

fn route(sim: &Arc<Sim>, method: &Method, path: &str, query: &str, body: Value) -> Answer {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let q = Query::parse(query);
    let id = |s: &str| s.parse::<u64>().map_err(|_| not_found("resource"));
    let get = method == Method::GET;
    let post = method == Method::POST;
    let delete = method == Method::DELETE;
    match segs.as_slice() {
        ["server_types"] if get => list(&q, "server_types", server_types(&q)),
        ["locations"] if get => list(&q, "locations", locations(&q)),
        ["images"] if get => list_images(sim, &q),
        ["images", i] if get => get_image(sim, id(i)?),
        ["images", i] if delete => delete_image(sim, id(i)?),
        ["ssh_keys"] if get => list_ssh_keys(sim, &q),
        ["ssh_keys"] if post => create_ssh_key(sim, body),
        ["ssh_keys", i] if get => {
            let w = sim.world.lock().unwrap();
            let k = w
                .ssh_keys
                .get(&id(i)?)
                .ok_or_else(|| not_found("SSH key"))?;
            Ok((200, json!({"ssh_key": ssh_key_json(k)})))
        }
        ["ssh_keys", i] if delete => {
            let mut w = sim.world.lock().unwrap();
            w.ssh_keys
                .remove(&id(i)?)
                .ok_or_else(|| not_found("SSH key"))?;
            Ok((204, Value::Null))
        }
        ["servers"] if get => list_servers(sim, &q),
        ["servers"] if post => create_server(sim, body),
        ["servers", i] if get => {
            let w = sim.world.lock().unwrap();
            let s = w.servers.get(&id(i)?).ok_or_else(|| not_found("server"))?;
            Ok((200, json!({"server": server_json(s, &w)})))
        }
        ["servers", i] if delete => delete_server(sim, id(i)?),
        ["servers", i, "actions", a] if post => server_action(sim, id(i)?, a, body),
        ["networks"] if get => list_networks(sim, &q),
        ["networks", i] if get => {
            let w = sim.world.lock().unwrap();
            let n = w
                .networks
                .get(&id(i)?)
                .ok_or_else(|| not_found("network"))?;
            Ok((200, json!({"network": network_json(n, iso)})))
        }
        ["actions", i] if get => {
            let w = sim.world.lock().unwrap();
            let a = w.actions.get(&id(i)?).ok_or_else(|| not_found("action"))?;
            Ok((200, json!({"action": action_json(a)})))
        }
        _ => Err(not_found("endpoint")),
    }
}

/// A request's query: repeated keys kept in order.
struct Query(Vec<(String, String)>);

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = s
            .get(i + 1..i + 3)
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (b[i], hex) {
            (b'+', _) => out.push(b' '),
            (b'%', Some(v)) => {
                out.push(v);
                i += 2;
            }
            (c, _) => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl Query {
    fn parse(q: &str) -> Query {
        Query(
            q.split('&')
                .filter(|p| !p.is_empty())
                .map(|p| {
                    let (k, v) = p.split_once('=').unwrap_or((p, ""));
                    (percent_decode(k), percent_decode(v))
                })
                .collect(),
        )
    }

    fn all(&self, key: &str) -> Vec<&str> {
        self.0
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .collect()
    }

    fn one(&self, key: &str) -> Option<&str> {
        self.all(key).first().copied()
    }

    fn selector(&self) -> Result<Option<Vec<Term>>, ApiError> {
        self.one("label_selector")
            .map(|s| labels::parse_selector(s).map_err(|m| field_error("label_selector", m)))
            .transpose()
    }

    fn number(&self, key: &str, default: u64) -> Result<u64, ApiError> {
        match self.one(key) {
            None => Ok(default),
            Some(v) => v
                .parse()
                .map_err(|_| field_error(key, "is not a valid integer")),
        }
    }
}

/// One page of `items` under `key`, with `meta.pagination`.
fn list(q: &Query, key: &str, items: Vec<Value>) -> Answer {
    let (items, meta) = paginate(q, items)?;
    Ok((200, json!({ key: items, "meta": {"pagination": meta} })))
}

/// A list endpoint's answer, the way every Hetzner `GET /<resources>`
/// treats its query: `label_selector` parsed first (a bad one is 422
/// `invalid_input` before anything else), then the resources whose name
/// equals `name` (when given), whose labels match the selector, and which
/// `keep` accepts (the endpoint's own filters), as JSON, sorted by the
/// `sort` parameters (each one of `sortable`), one page of them. `named`
/// reads a resource's name and labels.
fn list_matching<'r, R: 'r>(
    q: &Query,
    key: &str,
    sortable: &[&str],
    resources: impl Iterator<Item = &'r R>,
    named: fn(&R) -> (Option<&str>, &Labels),
    keep: impl Fn(&R) -> bool,
    to_json: impl Fn(&R) -> Value,
) -> Answer {
    let selector = q.selector()?;
    let mut items: Vec<Value> = resources
        .filter(|r| {
            let (name, labels) = named(r);
            q.one("name").is_none_or(|n| name == Some(n))
                && selector.as_ref().is_none_or(|s| labels::matches(s, labels))
                && keep(r)
        })
        .map(to_json)
        .collect();
    sort(q, &mut items, sortable)?;
    list(q, key, items)
}

fn paginate(q: &Query, items: Vec<Value>) -> Result<(Vec<Value>, Value), ApiError> {
    let page = q.number("page", 1)?;
    let per_page = q.number("per_page", 25)?;
    if page < 1 {
        return Err(field_error("page", "must be at least 1"));
    }
    if !(1..=50).contains(&per_page) {
        return Err(field_error("per_page", "must be between 1 and 50"));
    }
    let total = items.len() as u64;
    let last = total.div_ceil(per_page).max(1);
    let start = ((page - 1) * per_page).min(total) as usize;
    let end = (page * per_page).min(total) as usize;
    let opt = |p: u64, ok: bool| if ok { json!(p) } else { Value::Null };
    let meta = json!({
        "page": page,
        "per_page": per_page,
        "previous_page": opt(page.saturating_sub(1), page > 1),
        "next_page": opt(page + 1, page < last),
        "last_page": last,
        "total_entries": total,
    });
    Ok((items[start..end].to_vec(), meta))
}

/// Sorts by the `sort` parameters (`field`, `field:asc`, `field:desc`).
fn sort(q: &Query, items: &mut [Value], allowed: &[&str]) -> Result<(), ApiError> {
    let mut keys = Vec::new();
    for s in q.all("sort") {
        let (field, desc) = match s.split_once(':') {
            Some((f, "asc")) => (f, false),
            Some((f, "desc")) => (f, true),
            None => (s, false),
            Some(_) => return Err(field_error("sort", format!("invalid sort {s:?}"))),
        };
        if !allowed.contains(&field) {
            return Err(field_error("sort", format!("cannot sort by {field:?}")));
        }
        keys.push((field.to_owned(), desc));
    }
    items.sort_by(|a, b| {
        for (field, desc) in &keys {
            let (x, y) = (&a[field.as_str()], &b[field.as_str()]);
            let o = match (x.as_u64(), y.as_u64()) {
                (Some(x), Some(y)) => x.cmp(&y),
                _ => x.as_str().unwrap_or("").cmp(y.as_str().unwrap_or("")),
            };
            let o = if *desc { o.reverse() } else { o };
            if o.is_ne() {
                return o;
            }
        }
        std::cmp::Ordering::Equal
    });
    Ok(())
}

fn location_json(name: &str) -> Value {
    let (i, (name, city, country, zone)) = LOCATIONS
        .iter()
        .enumerate()
        .find(|(_, l)| l.0 == name)
        .expect("known location");
    json!({"id": i + 1, "name": name, "description": format!("{city} DC Park 1"),
        "country": country, "city": city, "network_zone": zone,
        "latitude": 0.0, "longitude": 0.0})
}

fn locations(q: &Query) -> Vec<Value> {
    LOCATIONS
        .iter()
        .filter(|l| q.one("name").is_none_or(|n| n == l.0))
        .map(|l| location_json(l.0))
        .collect()
}

fn deprecation_json(t: &ServerType) -> Value {
    match t.deprecation {
        Some((announced, after)) => json!({"announced": announced, "unavailable_after": after}),
        None => Value::Null,
    }
}

fn server_type_json(t: &ServerType) -> Value {
    let locations: Vec<Value> = LOCATIONS
        .iter()
        .enumerate()
        .map(|(i, l)| {
            json!({"id": i + 1, "name": l.0, "available": t.offered.contains(&l.0),
                "recommended": t.offered.contains(&l.0), "deprecation": deprecation_json(t)})
        })
        .collect();
    json!({
        "id": t.id, "name": t.name, "description": t.name.to_uppercase(),
        "cores": t.cores, "memory": t.memory, "disk": t.disk,
        "deprecated": t.deprecation.is_some(), "deprecation": deprecation_json(t),
        "prices": [], "storage_type": "local", "cpu_type": "shared",
        "architecture": t.arch, "category": if t.arch == "arm" { "cost_optimized" } else { "regular_purpose" },
        "locations": locations,
    })
}

fn server_types(q: &Query) -> Vec<Value> {
    SERVER_TYPES
        .iter()
        .filter(|t| q.one("name").is_none_or(|n| n == t.name))
        .map(server_type_json)
        .collect()
}

fn image_json(i: &Image) -> Value {
    json!({
        "id": i.id,
        "type": if i.snapshot { "snapshot" } else { "system" },
        "status": i.status,
        "name": i.name,
        "description": i.description,
        "image_size": i.image_size,
        "disk_size": i.disk_size,
        "created": iso(i.created),
        "created_from": i.created_from.as_ref().map(|(id, name)| json!({"id": id, "name": name})),
        "bound_to": null,
        "os_flavor": if i.snapshot { "unknown" } else { "debian" },
        "os_version": i.name.as_ref().map(|n| n.rsplit('-').next().unwrap_or("").to_owned()),
        "rapid_deploy": !i.snapshot,
        "protection": {"delete": false},
        "deprecated": null,
        "deleted": null,
        "labels": i.labels,
        "architecture": i.arch,
    })
}

fn list_images(sim: &Sim, q: &Query) -> Answer {
    let (types, statuses, archs) = (q.all("type"), q.all("status"), q.all("architecture"));
    let w = sim.world.lock().unwrap();
    list_matching(
        q,
        "images",
        &["id", "name", "created", "description"],
        w.images.values(),
        |i| (i.name.as_deref(), &i.labels),
        |i| {
            let kind = if i.snapshot { "snapshot" } else { "system" };
            (types.is_empty() || types.contains(&kind))
                && (statuses.is_empty() || statuses.contains(&i.status))
                && (archs.is_empty() || archs.contains(&i.arch))
        },
        image_json,
    )
}

fn get_image(sim: &Sim, id: u64) -> Answer {
    let w = sim.world.lock().unwrap();
    let i = w.images.get(&id).ok_or_else(|| not_found("image"))?;
    Ok((200, json!({"image": image_json(i)})))
}

fn delete_image(sim: &Sim, id: u64) -> Answer {
    let mut w = sim.world.lock().unwrap();
    match w.images.get(&id) {
        None => Err(not_found("image")),
        Some(i) if !i.snapshot => Err(err(
            422,
            "unsupported_error",
            "system images cannot be deleted",
        )),
        Some(_) => {
            w.images.remove(&id);
            let _ = std::fs::remove_file(image_file(sim, id));
            Ok((204, Value::Null))
        }
    }
}

fn image_file(sim: &Sim, id: u64) -> PathBuf {
    sim.args.state_dir.join("images").join(format!("{id}.raw"))
}

fn ssh_key_json(k: &SshKey) -> Value {
    json!({"id": k.id, "name": k.name, "fingerprint": k.fingerprint,
        "public_key": k.public_key, "labels": k.labels, "created": iso(k.created)})
}

fn list_ssh_keys(sim: &Sim, q: &Query) -> Answer {
    let w = sim.world.lock().unwrap();
    list_matching(
        q,
        "ssh_keys",
        &["id", "name"],
        w.ssh_keys.values(),
        |k| (Some(&k.name), &k.labels),
        |k| q.one("fingerprint").is_none_or(|f| f == k.fingerprint),
        ssh_key_json,
    )
}

fn body_labels(body: &Value) -> Result<Labels, ApiError> {
    let labels: Labels = serde_json::from_value(body["labels"].clone()).unwrap_or_default();
    labels::check_labels(&labels).map_err(|m| field_error("labels", m))?;
    Ok(labels)
}

/// The MD5 fingerprint the API shows, from `ssh-keygen` (which also
/// refuses what is not a public key, as the API does).
fn fingerprint(public_key: &str) -> Option<String> {
    use std::io::Write;
    let mut child = std::process::Command::new("ssh-keygen")
        .args(["-l", "-E", "md5", "-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    child.stdin.take()?.write_all(public_key.as_bytes()).ok()?;
    let out = child.wait_with_output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let fp = text.split_whitespace().nth(1)?.strip_prefix("MD5:")?;
    out.status.success().then(|| fp.to_owned())
}

fn create_ssh_key(sim: &Sim, body: Value) -> Answer {
    let name = body["name"].as_str().unwrap_or_default().to_owned();
    let public_key = body["public_key"]
        .as_str()
        .unwrap_or_default()
        .trim()
        .to_owned();
    let labels = body_labels(&body)?;
    let fingerprint =
        fingerprint(&public_key).ok_or_else(|| field_error("public_key", "invalid public key"))?;
    let mut w = sim.world.lock().unwrap();
    for k in w.ssh_keys.values() {
        if k.name == name {
            return Err(err(409, "uniqueness_error", "name is already used"));
        }
        if k.fingerprint == fingerprint {
            return Err(err(
                409,
                "uniqueness_error",
                "SSH key with the same fingerprint already exists",
            ));
        }
    }
    let id = w.id();
    let key = SshKey {
        id,
        name,
        public_key,
        fingerprint,
        labels,
        created: now(),
    };
    let v = ssh_key_json(&key);
    w.ssh_keys.insert(id, key);
    Ok((201, json!({ "ssh_key": v })))
}

fn server_json(s: &Server, w: &World) -> Value {
    let image = w.images.get(&s.image).map(image_json);
    let mut v = json!({
        "id": s.id,
        "name": s.name,
        "status": s.status,
        "created": iso(s.created),
        "public_net": {
            "ipv4": {"id": s.id, "ip": s.ip.to_string(), "blocked": false,
                "dns_ptr": format!("static.{}.clients.your-server.de", s.ip)},
            "ipv6": null, "floating_ips": [], "firewalls": [],
        },
        "private_net": s.private_net.iter().map(|(network, ip)| json!({
            "network": network, "ip": ip.to_string(), "alias_ips": [],
            "mac_address": format!("86:00:00:{:02x}:{:02x}:{:02x}", (s.id >> 16) as u8, (s.id >> 8) as u8, s.id as u8),
        })).collect::<Vec<_>>(),
        "server_type": server_type_json(s.server_type),
        "location": location_json(s.location),
        "image": image,
        "iso": null,
        "rescue_enabled": s.rescue_enabled,
        "locked": s.busy.is_some(),
        "backup_window": null,
        "outgoing_traffic": 0, "ingoing_traffic": 0,
        "included_traffic": 21990232555520u64,
        "protection": {"delete": false, "rebuild": false},
        "labels": s.labels,
        "volumes": [], "load_balancers": [],
        "primary_disk_size": s.server_type.disk,
        "placement_group": null,
    });
    if let Some(p) = s.ssh_port.filter(|p| *p != 22) {
        v["sim_ssh_port"] = json!(p);
    }
    v
}

fn list_networks(sim: &Sim, q: &Query) -> Answer {
    let w = sim.world.lock().unwrap();
    list_matching(
        q,
        "networks",
        &["id", "name", "created"],
        w.networks.values(),
        |n| (Some(&n.name), &n.labels),
        |_| true,
        |n| network_json(n, iso),
    )
}

/// The network zone of a location.
fn zone_of(location: &str) -> &'static str {
    LOCATIONS
        .iter()
        .find(|l| l.0 == location)
        .map_or("eu-central", |l| l.3)
}

fn list_servers(sim: &Sim, q: &Query) -> Answer {
    let statuses = q.all("status");
    let w = sim.world.lock().unwrap();
    list_matching(
        q,
        "servers",
        &["id", "name", "created"],
        w.servers.values(),
        |s| (Some(&s.name), &s.labels),
        |s| statuses.is_empty() || statuses.contains(&s.status),
        |s| server_json(s, &w),
    )
}

/// An "ID (integer) or name (string)" field's two forms.
enum Ref<'a> {
    Id(u64),
    Name(&'a str),
}

fn id_or_name(v: &Value) -> Option<Ref<'_>> {
    match v {
        Value::Number(n) => n.as_u64().map(Ref::Id),
        Value::String(s) => Some(match s.parse() {
            Ok(id) => Ref::Id(id),
            Err(_) => Ref::Name(s),
        }),
        _ => None,
    }
}

fn create_server(sim: &Arc<Sim>, body: Value) -> Answer {
    let name = body["name"].as_str().unwrap_or_default().to_owned();
    let labels = body_labels(&body)?;
    let valid_name = !name.is_empty()
        && name.len() <= 63
        && name.split('.').all(|l| {
            !l.is_empty()
                && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        });
    if !valid_name {
        return Err(field_error("name", "is not a valid hostname"));
    }
    let server_type = match id_or_name(&body["server_type"]) {
        Some(Ref::Id(id)) => SERVER_TYPES.iter().find(|t| t.id == id),
        Some(Ref::Name(n)) => SERVER_TYPES.iter().find(|t| t.name == n),
        None => None,
    }
    .ok_or_else(|| field_error("server_type", "server type not found"))?;
    let location = match id_or_name(&body["location"]) {
        Some(Ref::Id(id)) => LOCATIONS.get((id as usize).wrapping_sub(1)).map(|l| l.0),
        Some(Ref::Name(n)) => LOCATIONS.iter().find(|l| l.0 == n).map(|l| l.0),
        None if body.get("location").is_none() => Some("fsn1"),
        None => None,
    }
    .ok_or_else(|| field_error("location", "location not found"))?;
    if let Some(data) = body["user_data"].as_str()
        && data.len() > 32 * 1024
    {
        return Err(field_error("user_data", "must be at most 32768 bytes"));
    }
    if server_type.deprecation.is_some() {
        return Err(err(
            422,
            "invalid_server_type",
            format!("server type {} is deprecated", server_type.name),
        ));
    }
    if !server_type.offered.contains(&location) || sim.unavailable(server_type.name, location) {
        return Err(err(
            412,
            "resource_unavailable",
            format!(
                "server type {} is unavailable in {location}",
                server_type.name
            ),
        ));
    }
    let start = body["start_after_create"].as_bool().unwrap_or(true);
    let mut w = sim.world.lock().unwrap();
    let image = {
        let found: Vec<&Image> = w
            .images
            .values()
            .filter(|i| match id_or_name(&body["image"]) {
                Some(Ref::Id(id)) => i.id == id,
                Some(Ref::Name(n)) => i.name.as_deref() == Some(n),
                None => false,
            })
            .filter(|i| i.status == "available")
            .collect();
        if found.is_empty() {
            return Err(field_error("image", "image not found"));
        }
        let image = found
            .iter()
            .find(|i| i.arch == server_type.arch)
            .ok_or_else(|| {
                err(
                    422,
                    "placement_error",
                    format!("image does not support architecture {}", server_type.arch),
                )
            })?;
        // A snapshot holds the whole disk it was taken of: the API makes
        // servers from it only on types with at least that disk
        // (`disk_size`, GB).
        if server_type.disk < image.disk_size {
            return Err(err(
                422,
                "invalid_server_type",
                format!(
                    "server type {} has a {} GB disk, too small for image {} ({} GB)",
                    server_type.name, server_type.disk, image.id, image.disk_size
                ),
            ));
        }
        image.id
    };
    let mut keys = Vec::new();
    for k in body["ssh_keys"].as_array().into_iter().flatten() {
        let key = w.ssh_keys.values().find(|s| match id_or_name(k) {
            Some(Ref::Id(id)) => s.id == id,
            Some(Ref::Name(n)) => s.name == n,
            None => false,
        });
        keys.push(
            key.ok_or_else(|| field_error("ssh_keys", "SSH key not found"))?
                .id,
        );
    }
    if w.servers.values().any(|s| s.name == name) {
        return Err(err(409, "uniqueness_error", "server name is already used"));
    }
    let mut networks = Vec::new();
    for n in body["networks"].as_array().into_iter().flatten() {
        let network = n
            .as_u64()
            .and_then(|id| w.networks.get(&id))
            .ok_or_else(|| field_error("networks", "network not found"))?;
        let ip = network
            .assign(zone_of(location), None)
            .map_err(|(code, msg)| err(422, code, msg))?;
        networks.push((network.id, ip));
    }
    let from_snapshot = w.images.get(&image).is_some_and(|i| i.snapshot);
    let id = w.id();
    for (network, ip) in &networks {
        if let Some(n) = w.networks.get_mut(network) {
            n.servers.insert(id, *ip);
        }
    }
    std::fs::create_dir_all(sim.server_dir(id))
        .map_err(|e| err(500, "server_error", e.to_string()))?;
    let marker = format!("system image {image} of server {id}\n").repeat(4096);
    std::fs::write(sim.disk(id), marker).map_err(|e| err(500, "server_error", e.to_string()))?;
    let x = 2 + w.addresses % 250;
    w.addresses += 1;
    let server = Server {
        id,
        name,
        status: "initializing",
        created: now(),
        server_type,
        location,
        image,
        labels,
        rescue_enabled: false,
        rescue_keys: Vec::new(),
        ip: Ipv4Addr::new(127, 4, sim.address_base as u8, x as u8),
        ssh_port: None,
        busy: None,
        boot: 0,
        sshd: None,
        user_data: body["user_data"].as_str().map(str::to_owned),
        from_snapshot,
        node_booted: false,
        private_net: networks,
    };
    w.servers.insert(id, server);
    bump(&sim.stats.servers_created);
    if from_snapshot {
        bump(&sim.stats.servers_from_snapshots);
    }
    let action = start_action(
        sim,
        &mut w,
        id,
        "create_server",
        "create_server",
        None,
        move |_, w, _| {
            if let Some(s) = w.servers.get_mut(&id) {
                s.status = if start { "starting" } else { "off" };
            }
        },
    );
    // start_after_create: a start_server action that ends after the
    // creation (and holds the lock until then).
    let next: Vec<Value> = if start {
        let twice = 2.0 * sim.args.action_seconds;
        vec![start_action(
            sim,
            &mut w,
            id,
            "poweron",
            "start_server",
            Some(twice),
            move |sim, w, ok| {
                if let Some(s) = w.servers.get_mut(&id) {
                    if ok {
                        power_on(sim, s);
                    } else {
                        s.status = "off";
                    }
                }
            },
        )]
    } else {
        Vec::new()
    };
    let server = server_json(&w.servers[&id], &w);
    Ok((
        201,
        json!({"server": server, "action": action, "root_password": null, "next_actions": next}),
    ))
}

fn action_json(a: &Action) -> Value {
    let (status, progress) = match (a.finished, a.error) {
        (Some(_), false) => ("success", 100),
        (Some(_), true) => ("error", 100),
        (None, _) => {
            let done = a.started_at.elapsed().as_secs_f64() / a.duration.as_secs_f64().max(1e-3);
            ("running", ((done * 100.0) as u64).min(99))
        }
    };
    let error = a.error.then(|| {
        json!({"code": "action_failed",
            "message": format!("{} failed (simulated by --action-error)", a.command)})
    });
    json!({
        "id": a.id, "command": a.command, "status": status, "progress": progress,
        "started": iso(a.started), "finished": a.finished.map(iso),
        "resources": a.resources.iter().map(|(id, t)| json!({"id": id, "type": t})).collect::<Vec<_>>(),
        "error": error,
    })
}

/// `action` (as answered) with one more resource it acts on, besides its server.
fn with_resource(w: &mut World, action: Value, resource: (u64, &'static str)) -> Value {
    match w.actions.get_mut(&action["id"].as_u64().unwrap_or(0)) {
        Some(a) => {
            a.resources.push(resource);
            action_json(a)
        }
        None => action,
    }
}

/// Starts an action on server `server` (locking it) that ends after its
/// duration; `done` then runs under the world lock with whether it
/// succeeded. Returns the action as first shown.
fn start_action(
    sim: &Arc<Sim>,
    w: &mut World,
    server: u64,
    endpoint: &str,
    command: &str,
    duration: Option<f64>,
    done: impl FnOnce(&Arc<Sim>, &mut World, bool) + Send + 'static,
) -> Value {
    let id = w.id();
    let duration = Duration::from_secs_f64(duration.unwrap_or(sim.args.action_seconds).max(0.0));
    let error = sim.fails(endpoint, command);
    let action = Action {
        id,
        command: command.into(),
        started: now(),
        started_at: Instant::now(),
        duration,
        finished: None,
        error: false,
        resources: vec![(server, "server")],
    };
    let v = action_json(&action);
    w.actions.insert(id, action);
    if let Some(s) = w.servers.get_mut(&server) {
        s.busy = Some(id);
    }
    let sim = sim.clone();
    tokio::spawn(async move {
        tokio::time::sleep(duration).await;
        let mut w = sim.world.lock().unwrap();
        if let Some(a) = w.actions.get_mut(&id) {
            a.finished = Some(now());
            a.error = error;
        }
        if let Some(s) = w.servers.get_mut(&server)
            && s.busy == Some(id)
        {
            s.busy = None;
        }
        done(&sim, &mut w, !error);
    });
    v
}

/// The server is now running; with rescue enabled its sshd comes up after
/// `--ssh-refuse-seconds` (never with `--ssh-never`). A server made from a
/// snapshot boots Talos instead: with `--nodes-control`, a node configured
/// from its user_data comes up on its public address.
fn power_on(sim: &Arc<Sim>, s: &mut Server) {
    s.status = "running";
    s.boot += 1;
    if !s.rescue_enabled
        && s.from_snapshot
        && let Some(nodes) = sim.nodes.clone()
    {
        let id = s.id;
        let config = match s.user_data.as_deref().map(talos_config).transpose() {
            Ok(c) => c,
            Err(e) => {
                // Talos stops acquiring: no config, no node.
                eprintln!("hcloud sim: server {id}: Talos cannot read its user_data: {e}");
                return;
            }
        };
        s.node_booted = true;
        let body = json!({"name": s.name, "ip": s.ip.to_string(), "config": config});
        tokio::spawn(async move {
            if let Err(e) = nodes.boot(&body).await {
                eprintln!("hcloud sim: booting Talos for server {id}: {e}");
            }
        });
    }
    if !s.rescue_enabled || sim.args.ssh_never {
        return;
    }
    let port = match s.ssh_port.or(sim.args.rescue_ssh_port) {
        Some(p) => p,
        None => match rescue::choose_port(s.ip, true) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("hcloud sim: no port for server {} on {}: {e}", s.id, s.ip);
                return;
            }
        },
    };
    s.ssh_port = Some(port);
    let spec = rescue::Spec {
        dir: sim.server_dir(s.id).join("rescue"),
        disk: sim.disk(s.id),
        ip: s.ip,
        port,
        keys: s.rescue_keys.clone(),
        dd_fails: sim.args.dd_fails,
    };
    let (sim, id, boot) = (sim.clone(), s.id, s.boot);
    let refuse = Duration::from_secs_f64(sim.args.ssh_refuse_seconds.max(0.0));
    tokio::spawn(async move {
        tokio::time::sleep(refuse).await;
        let mut spec = spec;
        let mut started = rescue::start(&spec).await;
        if started.is_err() && spec.port == 22 {
            // Port 22 was taken meanwhile (another simulator, a host sshd).
            started = match rescue::choose_port(spec.ip, false) {
                Ok(port) => {
                    spec.port = port;
                    rescue::start(&spec).await
                }
                Err(e) => Err(e),
            };
        }
        let child = match started {
            Ok(c) => c,
            Err(e) => {
                eprintln!("hcloud sim: rescue system of server {id}: {e:#}");
                return;
            }
        };
        let mut w = sim.world.lock().unwrap();
        if let Some(s) = w.servers.get_mut(&id)
            && s.boot == boot
            && s.status == "running"
        {
            s.ssh_port = Some(spec.port);
            s.sshd = Some(child); // otherwise dropped: killed
        }
    });
}

/// The machine config Talos makes of a server's `user_data`. Its hcloud
/// platform decodes standard base64 when the text is base64, else keeps it
/// as it is (siderolabs/talos
/// internal/app/machined/pkg/runtime/v1alpha1/platform/hcloud/hcloud.go,
/// `maybeBase64Decode`, Talos v1.9.0 on; Go's decoder skips `\r` and
/// `\n`); then the config acquirer gunzips what Go's
/// `http.DetectContentType` calls `application/x-gzip` (bytes 1f 8b 08;
/// internal/app/machined/pkg/controllers/config/acquire.go,
/// `loadFromPlatform`).
fn talos_config(user_data: &str) -> Result<String, String> {
    use base64::Engine;
    use std::io::Read;
    let go_std = base64::engine::GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        base64::engine::GeneralPurposeConfig::new()
            .with_decode_allow_trailing_bits(true)
            .with_decode_padding_mode(base64::engine::DecodePaddingMode::RequireCanonical),
    );
    let text: String = user_data
        .chars()
        .filter(|c| !matches!(c, '\r' | '\n'))
        .collect();
    let bytes = go_std
        .decode(&text)
        .unwrap_or_else(|_| user_data.as_bytes().to_vec());
    let bytes = if bytes.starts_with(&[0x1f, 0x8b, 0x08]) {
        let mut out = Vec::new();
        flate2::read::MultiGzDecoder::new(&bytes[..])
            .read_to_end(&mut out)
            .map_err(|e| format!("error unzipping machine config: {e}"))?;
        out
    } else {
        bytes
    };
    String::from_utf8(bytes).map_err(|_| "the machine config is not UTF-8 text".to_owned())
}

/// Power is cut: the rescue sshd (or the Talos node) goes with it, and the
/// next boot is a normal one.
fn power_off(sim: &Sim, s: &mut Server) {
    s.boot += 1;
    s.sshd = None;
    s.rescue_enabled = false;
    if let (Some(nodes), true) = (sim.nodes.clone(), std::mem::take(&mut s.node_booted)) {
        let (id, ip) = (s.id, s.ip.to_string());
        tokio::spawn(async move {
            if let Err(e) = nodes.halt(&ip).await {
                eprintln!("hcloud sim: halting Talos of server {id}: {e}");
            }
        });
    }
}

fn server_action(sim: &Arc<Sim>, id: u64, endpoint: &str, body: Value) -> Answer {
    let mut w = sim.world.lock().unwrap();
    let s = w.servers.get(&id).ok_or_else(|| not_found("server"))?;
    if s.busy.is_some() {
        return Err(err(423, "locked", "server is locked: an action is running"));
    }
    let status = s.status;
    match endpoint {
        "enable_rescue" => {
            let mut keys = Vec::new();
            for k in body["ssh_keys"].as_array().into_iter().flatten() {
                let key = k.as_u64().and_then(|k| w.ssh_keys.get(&k));
                keys.push(
                    key.ok_or_else(|| field_error("ssh_keys", "SSH key not found"))?
                        .public_key
                        .clone(),
                );
            }
            let a = start_action(
                sim,
                &mut w,
                id,
                endpoint,
                "enable_rescue",
                None,
                move |_, w, ok| {
                    if let Some(s) = w.servers.get_mut(&id)
                        && ok
                    {
                        s.rescue_enabled = true;
                        s.rescue_keys = keys;
                    }
                },
            );
            Ok((201, json!({"root_password": null, "action": a})))
        }
        "poweron" => {
            if status == "running" {
                return Ok((
                    201,
                    json!({"action": finished_action(&mut w, id, "start_server")}),
                ));
            }
            w.servers.get_mut(&id).unwrap().status = "starting";
            let a = start_action(
                sim,
                &mut w,
                id,
                endpoint,
                "start_server",
                None,
                move |sim, w, ok| {
                    if let Some(s) = w.servers.get_mut(&id) {
                        if ok {
                            power_on(sim, s);
                        } else {
                            s.status = "off";
                        }
                    }
                },
            );
            Ok((201, json!({ "action": a })))
        }
        "poweroff" | "shutdown" => {
            let command = if endpoint == "poweroff" {
                "stop_server"
            } else {
                "shutdown_server"
            };
            if status == "off" {
                return Ok((201, json!({"action": finished_action(&mut w, id, command)})));
            }
            let s = w.servers.get_mut(&id).unwrap();
            s.status = "stopping";
            power_off(sim, s);
            let a = start_action(sim, &mut w, id, endpoint, command, None, move |_, w, _| {
                if let Some(s) = w.servers.get_mut(&id) {
                    s.status = "off";
                }
            });
            Ok((201, json!({ "action": a })))
        }
        "create_image" => create_image(sim, &mut w, id, body),
        "attach_to_network" => attach_to_network(sim, &mut w, id, body),
        _ => Err(not_found("action endpoint")),
    }
}

/// An action that has nothing to do (e.g. poweron of a running server).
fn finished_action(w: &mut World, server: u64, command: &str) -> Value {
    let id = w.id();
    let a = Action {
        id,
        command: command.into(),
        started: now(),
        started_at: Instant::now(),
        duration: Duration::ZERO,
        finished: Some(now()),
        error: false,
        resources: vec![(server, "server")],
    };
    let v = action_json(&a);
    w.actions.insert(id, a);
    v
}

fn create_image(sim: &Arc<Sim>, w: &mut World, server: u64, body: Value) -> Answer {
    let labels = body_labels(&body)?;
    if body["type"].as_str() == Some("backup") {
        return Err(err(
            422,
            "unsupported_error",
            "backups are not enabled for this server",
        ));
    }
    let s = &w.servers[&server];
    let (disk_size, arch, from_name) = (s.server_type.disk, s.server_type.arch, s.name.clone());
    let image_id = w.id();
    let description = body["description"]
        .as_str()
        .map(String::from)
        .unwrap_or_else(|| format!("{from_name}-{}", now()));
    let tmp = image_file(sim, image_id).with_extension("part");
    // The snapshot holds the disk as it is now.
    std::fs::copy(sim.disk(server), &tmp).map_err(|e| err(500, "server_error", e.to_string()))?;
    w.images.insert(
        image_id,
        Image {
            id: image_id,
            snapshot: true,
            name: None,
            description,
            status: "creating",
            labels,
            created: now(),
            image_size: None,
            disk_size,
            created_from: Some((server, from_name)),
            arch,
        },
    );
    bump(&sim.stats.images_created);
    let sim2 = sim.clone();
    let action = start_action(
        sim,
        w,
        server,
        "create_image",
        "create_image",
        sim.args.slow_create_image,
        move |_, w, ok| {
            let done = image_file(&sim2, image_id);
            if ok && std::fs::rename(&tmp, &done).is_ok() {
                let size = std::fs::metadata(&done).map(|m| m.len()).unwrap_or(0);
                if let Some(i) = w.images.get_mut(&image_id) {
                    i.status = "available";
                    i.image_size = Some(size as f64 / 1e9);
                }
            } else {
                let _ = std::fs::remove_file(&tmp);
                w.images.remove(&image_id);
            }
        },
    );
    let action = with_resource(w, action, (image_id, "image"));
    let image = image_json(&w.images[&image_id]);
    Ok((201, json!({"image": image, "action": action})))
}

/// `attach_to_network {network, ip?}`: the address is reserved now and
/// shown in `private_net` once the action succeeds.
fn attach_to_network(sim: &Arc<Sim>, w: &mut World, id: u64, body: Value) -> Answer {
    let network_id = body["network"].as_u64().unwrap_or(0);
    let zone = zone_of(w.servers[&id].location);
    let network = w
        .networks
        .get(&network_id)
        .ok_or_else(|| not_found("network"))?;
    if network.servers.contains_key(&id) {
        return Err(err(
            422,
            "server_already_attached",
            "server is already attached to the network",
        ));
    }
    let want = match body["ip"].as_str() {
        Some(ip) => Some(
            ip.parse::<Ipv4Addr>()
                .map_err(|_| field_error("ip", "is not a valid IPv4 address"))?,
        ),
        None => None,
    };
    let ip = network
        .assign(zone, want)
        .map_err(|(code, msg)| err(422, code, msg))?;
    w.networks
        .get_mut(&network_id)
        .expect("found above")
        .servers
        .insert(id, ip);
    let a = start_action(
        sim,
        w,
        id,
        "attach_to_network",
        "attach_to_network",
        None,
        move |_, w, ok| {
            if ok {
                if let Some(s) = w.servers.get_mut(&id) {
                    s.private_net.push((network_id, ip));
                }
            } else if let Some(n) = w.networks.get_mut(&network_id) {
                n.servers.remove(&id);
            }
        },
    );
    let a = with_resource(w, a, (network_id, "network"));
    Ok((201, json!({ "action": a })))
}

fn delete_server(sim: &Arc<Sim>, id: u64) -> Answer {
    let mut w = sim.world.lock().unwrap();
    let s = w.servers.get(&id).ok_or_else(|| not_found("server"))?;
    if s.busy.is_some() {
        return Err(err(423, "locked", "server is locked: an action is running"));
    }
    if let Some(mut s) = w.servers.remove(&id) {
        power_off(sim, &mut s); // kills its sshd, halts its node
    }
    for n in w.networks.values_mut() {
        n.servers.remove(&id);
    }
    let _ = std::fs::remove_dir_all(sim.server_dir(id));
    let a = finished_action(&mut w, id, "delete_server");
    Ok((200, json!({ "action": a })))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(query: &str, n: usize) -> Result<(Vec<Value>, Value), ApiError> {
        let items = (1..=n).map(|i| json!(i)).collect();
        paginate(&Query::parse(query), items)
    }

    #[test]
    fn pagination_pages_and_meta() {
        let (items, meta) = page("", 60).unwrap();
        assert_eq!(items.len(), 25);
        assert_eq!(meta["last_page"], 3);
        assert_eq!(meta["next_page"], 2);
        assert_eq!(meta["previous_page"], Value::Null);
        let (items, meta) = page("page=2&per_page=50", 60).unwrap();
        assert_eq!(items, (51..=60).map(|i| json!(i)).collect::<Vec<_>>());
        assert_eq!(meta["next_page"], Value::Null);
        assert_eq!(meta["previous_page"], 1);
        assert_eq!(meta["total_entries"], 60);
        let (items, meta) = page("page=9", 60).unwrap();
        assert!(items.is_empty());
        assert_eq!(meta["last_page"], 3);
        let (items, meta) = page("", 0).unwrap();
        assert!(items.is_empty());
        assert_eq!(meta["last_page"], 1);
    }

    #[test]
    fn pagination_refuses_out_of_range() {
        for q in ["per_page=51", "per_page=0", "page=0", "page=x"] {
            let (status, e) = page(q, 5).unwrap_err();
            assert_eq!(
                (status, e["code"].as_str()),
                (422, Some("invalid_input")),
                "{q}"
            );
        }
    }

    #[test]
    fn query_decoding_and_sort() {
        let q = Query::parse("label_selector=k+in+%28a%2Cb%29&sort=id:desc&type=a&type=b");
        assert_eq!(q.one("label_selector"), Some("k in (a,b)"));
        assert_eq!(q.all("type"), ["a", "b"]);
        let mut items = vec![json!({"id": 1}), json!({"id": 3}), json!({"id": 2})];
        sort(&q, &mut items, &["id"]).unwrap();
        assert_eq!(
            items,
            [json!({"id": 3}), json!({"id": 2}), json!({"id": 1})]
        );
        assert!(sort(&Query::parse("sort=size"), &mut items, &["id"]).is_err());
    }

    /// The 200 response schema of `GET path` in the vendored document.
    fn response_schema(path: &str) -> jsonschema::Validator {
        let doc: Value = serde_json::from_str(self::schema::DOCUMENT).unwrap();
        let schema =
            &doc["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]["schema"];
        jsonschema::draft202012::new(schema).unwrap()
    }

    fn assert_valid(path: &str, v: &Value) {
        let errors: Vec<String> = response_schema(path)
            .iter_errors(v)
            .map(|e| format!("{}: {e}", e.instance_path()))
            .collect();
        assert!(errors.is_empty(), "GET {path}: {errors:?}");
    }

    #[test]
    fn answers_match_the_documented_responses() {
        let mut labels = Labels::new();
        labels.insert("os".into(), "talos".into());
        let mut w = World::default();
        w.images.insert(
            7,
            Image {
                id: 7,
                snapshot: true,
                name: None,
                description: "talos".into(),
                status: "creating",
                labels: labels.clone(),
                created: 1_767_225_600,
                image_size: None,
                disk_size: 40,
                created_from: Some((9, "build".into())),
                arch: "x86",
            },
        );
        let server = Server {
            id: 9,
            name: "build".into(),
            status: "running",
            created: 1_767_225_600,
            server_type: &SERVER_TYPES[1],
            location: "fsn1",
            image: 7,
            labels: labels.clone(),
            rescue_enabled: true,
            rescue_keys: Vec::new(),
            ip: Ipv4Addr::new(127, 4, 0, 2),
            ssh_port: Some(2222),
            busy: None,
            boot: 1,
            sshd: None,
            user_data: None,
            from_snapshot: false,
            node_booted: false,
            private_net: vec![(4, Ipv4Addr::new(10, 0, 1, 2))],
        };
        let key = SshKey {
            id: 3,
            name: "k".into(),
            public_key: "ssh-ed25519 AAAA".into(),
            fingerprint: "00:11".into(),
            labels,
            created: 0,
        };
        let action = Action {
            id: 5,
            command: "create_image".into(),
            started: 0,
            started_at: Instant::now(),
            duration: Duration::from_secs(1),
            finished: None,
            error: false,
            resources: vec![(9, "server"), (7, "image")],
        };
        assert_valid(
            "/servers/{id}",
            &json!({"server": server_json(&server, &w)}),
        );
        assert_valid("/images/{id}", &json!({"image": image_json(&w.images[&7])}));
        assert_valid("/ssh_keys/{id}", &json!({"ssh_key": ssh_key_json(&key)}));
        let mut net = Network::seeded(4, 1_767_225_600);
        net.servers.insert(9, Ipv4Addr::new(10, 0, 1, 2));
        assert_valid(
            "/networks/{id}",
            &json!({"network": network_json(&net, iso)}),
        );
        assert_valid("/actions/{id}", &json!({"action": action_json(&action)}));
        let types: Vec<Value> = SERVER_TYPES.iter().map(server_type_json).collect();
        assert_valid(
            "/server_types",
            &json!({"server_types": types, "meta": {"pagination": paginate(&Query::parse(""), vec![]).unwrap().1}}),
        );
        let (locations, meta) = paginate(&Query::parse(""), locations(&Query::parse(""))).unwrap();
        assert_valid(
            "/locations",
            &json!({"locations": locations, "meta": {"pagination": meta}}),
        );
    }

    #[test]
    fn user_data_is_read_as_talos_reads_it() {
        use base64::Engine;
        use std::io::Write;
        let config = "version: v1alpha1\nmachine:\n  type: worker\n#\n";
        assert_eq!(talos_config(config).unwrap(), config);
        let b64 = base64::engine::general_purpose::STANDARD.encode(config);
        assert_eq!(talos_config(&b64).unwrap(), config);
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        gz.write_all(config.as_bytes()).unwrap();
        let gz = base64::engine::general_purpose::STANDARD.encode(gz.finish().unwrap());
        // Line breaks inside the base64 are skipped, as Go's decoder does.
        let wrapped: String = gz
            .as_bytes()
            .chunks(20)
            .map(|c| String::from_utf8_lossy(c) + "\r\n")
            .collect();
        assert_eq!(talos_config(&wrapped).unwrap(), config);
        // Unpadded base64 is not base64 to Go's StdEncoding: kept as text.
        let unpadded = b64.trim_end_matches('=');
        assert_ne!(unpadded, b64);
        assert_eq!(talos_config(unpadded).unwrap(), unpadded);
        // gzip magic with a broken stream is an error, as in Talos.
        let broken = base64::engine::general_purpose::STANDARD.encode([0x1f, 0x8b, 0x08, 0, 1]);
        assert!(talos_config(&broken).is_err());
    }

    #[test]
    fn iso_dates() {
        assert_eq!(iso(0), "1970-01-01T00:00:00+00:00");
        assert_eq!(iso(1_767_225_600), "2026-01-01T00:00:00+00:00");
        assert_eq!(iso(951_782_400 + 3661), "2000-02-29T01:01:01+00:00");
    }
}
