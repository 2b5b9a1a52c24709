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

mod actions;
mod catalog;
mod images;
mod labels;
mod locations;
mod networks;
mod power;
mod query;
mod rescue;
mod schema;
mod server_actions;
mod servers;
mod ssh_keys;
mod state;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};

use self::networks::{Network, network_json};
use self::schema::Schemas;
use crate::chain::Nodes;

use self::actions::*;
use self::catalog::*;
use self::images::*;
use self::locations::*;
use self::query::*;
use self::server_actions::*;
use self::servers::*;
use self::ssh_keys::*;
pub use self::state::Args;
use self::state::*;

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
    let (address_base, _address_lock) = reserve_address_base()?;
    let sim = Arc::new(Sim {
        nodes,
        args,
        schemas: Schemas::load()?,
        world: Mutex::new(world),
        stats: Stats::default(),
        address_base,
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

/// The third octet of this simulator's server addresses (127.4.P.x): one no
/// other live simulator holds, reserved by an advisory lock on a file in
/// the temp dir kept for the process's life (a pid alone collided for pids
/// equal mod 250, and one run's rescue logins reached another's sshd).
fn reserve_address_base() -> anyhow::Result<(u32, std::fs::File)> {
    let start = std::process::id() % 250;
    for k in 0..250 {
        let p = (start + k) % 250;
        let path = std::env::temp_dir().join(format!("imgbuild-sim-hcloud-127.4.{p}.lock"));
        let Ok(file) = std::fs::File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
        else {
            continue;
        };
        if file.try_lock().is_ok() {
            return Ok((p, file));
        }
    }
    anyhow::bail!("every 127.4.P.0/24 is held by another Hetzner simulator")
}

#[cfg(test)]
mod tests;
