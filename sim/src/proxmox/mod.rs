//! The Proxmox VE double: pveproxy's HTTPS API on loopback, as far as
//! publishing images and running VMs from them needs it (proxmox/pve-storage
//! `src/PVE/API2/Storage/Status.pm`, proxmox/qemu-server `src/PVE/API2/Qemu.pm`,
//! proxmox/pve-http-server `src/PVE/APIServer/AnyEvent.pm`; the API schema in
//! `sim/api-schemas/proxmox-ve.apidata.json`).
//!
//! # Contract (tests and the imgbuild client depend on it)
//! ```text
//! imgbuild-sim proxmox --state-dir DIR [--listen 127.0.0.1:0] [--node pve]
//!     [--token 'root@pam!imgbuild=SECRET'] [--auth-delay-ms 3000] [--task-delay-ms 200]
//!     [--fail-task imgcopy|qmcreate|qmresize|qmstart|qmconfig]
//!     [--drop-upload-after BYTES] [--drop-uploads N] [--no-import-storage]
//!     [--nodes-control http://127.0.0.1:PORT]
//! ```
//! Prints one JSON line once it listens:
//! `{"url":"https://127.0.0.1:PORT/","fingerprint":"AB:CD:…","node":"pve","token":"…"}`
//! (fingerprint: SHA-256 of the leaf certificate's DER, uppercase, colons).
//! Storages: `local` (dir; iso,vztmpl,import — no import with
//! `--no-import-storage`), `local-lvm` (lvmthin; images,rootdir), `backup`
//! (dir; backup,iso). Volumes are files: `DIR/storage/local/import/<file>`,
//! `DIR/storage/local-lvm/vm-<vmid>-disk-<n>.raw` (imports converted to raw,
//! as lvmthin holds raw). Under `/api2/json`: version, nodes, storage list
//! and content (list, delete), upload, task status and log, qemu list,
//! create, config (GET/POST/PUT), resize, status/start|stop|current; delete,
//! shutdown and the cluster-wide listing are in `proxmox/destroy.rs`.
//! Config changes follow qemu-server (src/PVE/API2/Qemu.pm `update_vm_api`):
//! a replaced or detached drive the VM owns (`vm-<vmid>-…`) is parked as the
//! first free `unusedN`; `delete=unusedN` frees its volume only when the VM
//! owns it, and fails the task with "unable to delete '…' - volume is still
//! in use (snapshot?)" while a drive still uses it (`try_deallocate_drive`).
//! `DELETE …/content/{volume}` frees any volume, referenced or not, as
//! pve-storage's `vdisk_free` does.
//! Every request is checked against the vendored API schema
//! ([`self::schema`]). `GET /_sim/stats` (no auth) gives counts
//! taken in the handlers: requests, uploads (completed upload tasks),
//! uploadAttempts, uploadBytes, vmCreates, vmConfigChanges, resizes, starts
//! (start requests, also of a running VM), startsChanged (starts that took a
//! stopped VM to running), bootFailures, stops, rejected (400 answers), and
//! tasksRunning (tasks not ended yet: an upload whose client went away still
//! finishes its import, as a pveproxy worker does).
//!
//! The chain (with `--nodes-control`, the node simulator's `control` URL):
//! every VM start (create with `start=1`, `status/start`) boots as the
//! firmware does, by the VM's boot order (qemu-server `boot: order=…`, else
//! scsi0, else virtio0): a blank disk (its first MiB all zeros: no MBR, no
//! GPT) is skipped, as SeaBIOS and OVMF skip a disk with nothing to boot;
//! the first drive with something on it boots. A disk is read raw
//! directly, qcow2 through `qemu-img convert`: the GPT partition named
//! META, its ADV read with this crate's own reader ([`crate::disk`]), key
//! 10; a cdrom (a Talos ISO) by the META on the first kernel line of its
//! `grub.cfg`. The node then comes up: POST `/_sim/boot {"name":"vm-<vmid>","ip":<first address of
//! `addresses[]` in 127.0.0.0/8, prefix stripped>,"hostname":<first
//! `hostnames[].hostname`>|null}`. Installing: a node booted from an ISO
//! whose config was applied installed Talos to the VM's first blank disk
//! in the boot order (its installDisk), with the ISO's META; the node
//! simulator says so when the VM stops (`/_sim/halt` answers
//! `configured`). From then on that disk boots the installed node, and an
//! ISO whose kernel line carries `talos.halt_if_installed=1` (Talos ISOs
//! from v1.8, siderolabs/talos `pkg/imager/imager.go`) halts instead:
//! "Talos is already installed to disk but booted from another media …
//! Please reboot from the disk." (`v1alpha1_sequencer_tasks.go`
//! `haltIfInstalled`): the VM runs, no node comes up. No GPT, no META, no valid ADV, no key 10,
//! no loopback address (or the node simulator refusing) → the VM runs but no
//! node boots: the start task's log says why (`no Talos node boots: …`),
//! bootFailures counts it. Stop and destroy POST `/_sim/halt {"ip"}`.
//! `GET /_sim/vms/<vmid>` (no auth) → `{"running":bool,"bootedIp":
//! "127.…"|null,"bootError":"…"|null}` (404 for no such VM). A VM's own disks
//! are the files `DIR/storage/local-lvm/vm-<vmid>-disk-<n>.raw`, copied from
//! the import volume at create: to give a VM a disk without META, change the
//! import volume file before the create (or its own disk before a start).
//!
//! The HTTP layer is HTTP/1.1 written here (pveproxy is an HTTP/1.1 server of
//! its own, pve-http-server src/PVE/APIServer/AnyEvent.pm): chunked bodies are
//! refused with 501, auth failures answered after a delay, an idle
//! connection dropped after 5 s, keep-alive ended after an upload. Errors
//! raised with `die` in the real handlers are 500, parameter errors 400.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};
use sha2::{Digest, Sha224, Sha256, Sha384, Sha512};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;

use self::schema::{Errors, Schema};
use self::upload::{Multipart, normalize_filename, parse_content_type};
use crate::chain::Nodes;

/// Deleting VMs and listing them cluster-wide (its own contract).
mod destroy;
mod download;
mod schema;
mod secureboot;
mod upload;

/// pveproxy drops a connection idle for this long.
const IDLE: Duration = Duration::from_secs(5);
/// pveproxy's `$limit_max_post`: larger non-upload bodies are refused.
const MAX_POST: u64 = 64 * 1024;
/// Read size for upload bodies: few syscalls, few large writes.
const UPLOAD_CHUNK: usize = 4 << 20;

#[derive(clap::Args)]
pub struct Args {
    /// Where storages (and the upload staging area) live.
    #[arg(long)]
    state_dir: PathBuf,
    /// Loopback address to listen on.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// The node's name.
    #[arg(long, default_value = "pve")]
    node: String,
    /// The one valid API token, USER@REALM!TOKENID=SECRET.
    #[arg(
        long,
        default_value = "root@pam!imgbuild=5ec7e7a0-0000-4000-8000-00000000cafe"
    )]
    token: String,
    /// Milliseconds before an authentication failure is answered (pveproxy: 3 s).
    #[arg(long, default_value_t = 3000)]
    auth_delay_ms: u64,
    /// Milliseconds each task runs before it stops.
    #[arg(long, default_value_t = 200)]
    task_delay_ms: u64,
    /// Task type that ends with an error exit status.
    #[arg(long)]
    fail_task: Option<String>,
    /// Close the connection after this many body bytes of an upload.
    #[arg(long)]
    drop_upload_after: Option<u64>,
    /// How many uploads to cut (default 1 when --drop-upload-after is given).
    #[arg(long)]
    drop_uploads: Option<u32>,
    /// `local` lacks the import content type.
    #[arg(long)]
    no_import_storage: bool,
    /// More cluster nodes (hosts) beside `--node`, comma-separated. The
    /// storages are then the cluster's shared ones (`shared: 1`, as an NFS
    /// or Ceph storage is listed on every node, pve-storage
    /// `PVE/API2/Storage/Config.pm`), and each VM lives on one node.
    #[arg(long, value_delimiter = ',')]
    other_nodes: Vec<String>,
    /// The node simulator's control URL: a started VM boots a Talos node at
    /// the address in its boot disk's META key 10.
    #[arg(long)]
    nodes_control: Option<String>,
}

/// A storage of the simulated node.
struct Storage {
    id: &'static str,
    kind: &'static str,
    content: Vec<&'static str>,
    /// Whether it is file-based (has a path; uploads need one).
    has_path: bool,
}

/// Counts reported at `/_sim/stats`, each bumped where the thing happens.
#[derive(Default)]
struct Stats {
    requests: AtomicU64,
    uploads: AtomicU64,
    upload_attempts: AtomicU64,
    upload_bytes: AtomicU64,
    /// Bytes download-url fetched (not sent by the client).
    download_bytes: AtomicU64,
    vm_creates: AtomicU64,
    vm_config_changes: AtomicU64,
    reboots: AtomicU64,
    resizes: AtomicU64,
    starts: AtomicU64,
    /// Starts that took a stopped VM to running.
    starts_changed: AtomicU64,
    /// Starts after which no Talos node booted (no valid key 10).
    boot_failures: AtomicU64,
    stops: AtomicU64,
    rejected: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// A worker task (`fork_worker`): UPID, log, and the exit status once stopped.
struct Task {
    upid: String,
    kind: String,
    id: String,
    pid: u32,
    pstart: u32,
    start: u64,
    log: Vec<String>,
    exit: Option<String>,
}

/// A VM: its configuration as `GET …/config` shows it, and whether it runs.
#[derive(Clone, Default)]
struct Vm {
    config: BTreeMap<String, String>,
    /// Changes made while it ran that qemu-server could not hot-plug: they
    /// apply at its next start (`vmconfig_apply_pending`).
    pending: BTreeMap<String, String>,
    /// The cluster node it lives on.
    host: String,
    running: bool,
    /// The address its Talos node booted at on the last start.
    booted_ip: Option<String>,
    /// Why no node booted on the last start.
    boot_error: Option<String>,
    /// The hostname the ISO's META gave, when the last start booted an ISO.
    booted_iso: Option<Option<String>>,
    /// The disk Talos was installed to from an ISO, and the address and
    /// hostname its META gives the installed node.
    installed: Option<Installed>,
}

/// A disk Talos installed itself to from an ISO.
#[derive(Clone)]
struct Installed {
    volid: String,
    ip: String,
    hostname: Option<String>,
}

struct Pve {
    args: Args,
    storages: Vec<Storage>,
    started: u64,
    tasks: Mutex<BTreeMap<String, Task>>,
    vms: Mutex<BTreeMap<u32, Vm>>,
    stats: Stats,
    drops_left: AtomicU32,
    seq: AtomicU32,
    nodes: Option<Nodes>,
}

/// An error answer: HTTP status, message, per-parameter errors.
#[derive(Debug)]
struct ApiError {
    status: u16,
    message: String,
    errors: Errors,
}

/// A `die` in a real handler: 500 with the message.
fn die(msg: impl Into<String>) -> ApiError {
    ApiError {
        status: 500,
        message: msg.into(),
        errors: Errors::new(),
    }
}

/// `raise_param_exc`: 400 with per-parameter errors.
fn param_exc(errors: Errors) -> ApiError {
    ApiError {
        status: 400,
        message: "Parameter verification failed.".into(),
        errors,
    }
}

type ApiResult = Result<Value, ApiError>;

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.listen.ip().is_loopback(),
        "{} is not a loopback address",
        args.listen
    );
    anyhow::ensure!(
        args.token.contains('!') && args.token.contains('='),
        "--token must look like USER@REALM!TOKENID=SECRET"
    );
    let (tls, fingerprint) = tls_config(args.listen)?;
    let listener = TcpListener::bind(args.listen).await?;
    let addr = listener.local_addr()?;
    let pve = Arc::new(Pve::new(args)?);
    println!(
        "{}",
        json!({
            "url": format!("https://{addr}/"),
            "fingerprint": fingerprint,
            "node": pve.args.node,
            "token": pve.args.token,
        })
    );
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            continue;
        };
        let (pve, acceptor) = (pve.clone(), acceptor.clone());
        tokio::spawn(async move {
            let _ = tcp.set_nodelay(true);
            if let Ok(Ok(stream)) = tokio::time::timeout(IDLE, acceptor.accept(tcp)).await {
                serve_connection(pve, stream).await;
            }
        });
    }
}

impl Pve {
    /// The node's fixed storages (directories made under the state dir).
    fn new(args: Args) -> anyhow::Result<Pve> {
        let import = !args.no_import_storage;
        let storages = vec![
            Storage {
                id: "local",
                kind: "dir",
                content: if import {
                    vec!["iso", "vztmpl", "import"]
                } else {
                    vec!["iso", "vztmpl"]
                },
                has_path: true,
            },
            Storage {
                id: "local-lvm",
                kind: "lvmthin",
                content: vec!["images", "rootdir"],
                has_path: false,
            },
            Storage {
                id: "backup",
                kind: "dir",
                content: vec!["backup", "iso"],
                has_path: true,
            },
        ];
        for s in &storages {
            std::fs::create_dir_all(args.state_dir.join("storage").join(s.id))?;
        }
        std::fs::create_dir_all(args.state_dir.join("tmp"))?;
        let drops = match (args.drop_upload_after, args.drop_uploads) {
            (Some(_), n) => n.unwrap_or(1),
            (None, _) => 0,
        };
        let nodes = args
            .nodes_control
            .as_deref()
            .map(Nodes::parse)
            .transpose()?;
        Ok(Pve {
            nodes,
            args,
            storages,
            started: now(),
            tasks: Mutex::new(BTreeMap::new()),
            vms: Mutex::new(BTreeMap::new()),
            stats: Stats::default(),
            drops_left: AtomicU32::new(drops),
            seq: AtomicU32::new(0),
        })
    }
}

/// A self-signed certificate made at start (as pve-ssl.pem is made at
/// install), and its SHA-256 fingerprint as `pvenode cert info` prints it.
fn tls_config(listen: SocketAddr) -> anyhow::Result<(Arc<rustls::ServerConfig>, String)> {
    let mut names = vec!["localhost".to_owned(), "127.0.0.1".to_owned()];
    if listen.ip().to_string() != "127.0.0.1" {
        names.push(listen.ip().to_string());
    }
    let certified = rcgen::generate_simple_self_signed(names)?;
    let der = certified.cert.der().clone();
    let fingerprint = Sha256::digest(der.as_ref())
        .iter()
        .map(|b| format!("{b:02X}"))
        .collect::<Vec<_>>()
        .join(":");
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(certified.signing_key.serialize_der().into());
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(vec![der], key)?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok((Arc::new(cfg), fingerprint))
}

/// A request line and its headers (names lowercased).
struct Head {
    method: String,
    path: String,
    query: String,
    headers: BTreeMap<String, String>,
}

impl Head {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }
}

/// Reads one request head; None when the peer closed or sent garbage.
async fn read_head(r: &mut (impl AsyncBufReadExt + Unpin)) -> Option<Head> {
    let mut line = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line).await.ok()? == 0 {
            return None;
        }
        if !line.trim().is_empty() {
            break;
        }
    }
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next()?.to_owned(), parts.next()?.to_owned());
    let mut headers = BTreeMap::new();
    for _ in 0..64 {
        let mut h = String::new();
        if r.read_line(&mut h).await.ok()? == 0 {
            return None;
        }
        let h = h.trim_end();
        if h.is_empty() {
            let (path, query) = match target.split_once('?') {
                Some((p, q)) => (p.to_owned(), q.to_owned()),
                None => (target, String::new()),
            };
            return Some(Head {
                method,
                path,
                query,
                headers,
            });
        }
        let (k, v) = h.split_once(':')?;
        headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_owned());
    }
    None
}

async fn respond(
    w: &mut (impl AsyncWrite + Unpin),
    status: u16,
    reason: &str,
    body: &Value,
    keep_alive: bool,
) -> std::io::Result<()> {
    let body = body.to_string();
    let reason: String = reason
        .lines()
        .next()
        .unwrap_or("")
        .chars()
        .take(200)
        .collect();
    let head = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json;charset=UTF-8\r\n\
         Content-Length: {}\r\nConnection: {}\r\nCache-Control: max-age=0\r\n\
         Server: pve-api-daemon/3.0\r\n\r\n",
        body.len(),
        if keep_alive { "Keep-Alive" } else { "close" }
    );
    w.write_all(head.as_bytes()).await?;
    w.write_all(body.as_bytes()).await?;
    w.flush().await
}

/// The body of an answer: `{"data": …}`, or for an error `{"data": null,
/// "message": …, "errors": …}` (errors only when there are any).
fn answer(res: &ApiResult) -> (u16, String, Value) {
    match res {
        Ok(data) => (200, "OK".into(), json!({ "data": data })),
        Err(e) => {
            let mut body = json!({"data": null, "message": format!("{}\n", e.message.trim_end())});
            if !e.errors.is_empty() {
                body["errors"] = json!(e.errors);
            }
            (e.status, e.message.clone(), body)
        }
    }
}

async fn serve_connection<S: AsyncRead + AsyncWrite + Unpin>(pve: Arc<Pve>, stream: S) {
    let (r, mut w) = tokio::io::split(stream);
    let mut r = BufReader::with_capacity(256 * 1024, r);
    loop {
        let Ok(Some(head)) = tokio::time::timeout(IDLE, read_head(&mut r)).await else {
            return;
        };
        if head.path.starts_with("/_sim/") && head.method == "GET" {
            // The simulator's own counts and VM states, unwrapped and
            // unauthenticated.
            let keep = head.header("content-length").is_none_or(|l| l == "0");
            let (code, reason, body) = pve.sim_view(&head.path);
            if respond(&mut w, code, reason, &body, keep).await.is_err() || !keep {
                return;
            }
            continue;
        }
        let wants_close = head
            .header("connection")
            .is_some_and(|c| c.to_ascii_lowercase().contains("close"));
        match handle(&pve, &head, &mut r).await {
            Some((res, keep_alive)) => {
                let keep_alive = keep_alive && !wants_close;
                let (status, reason, body) = answer(&res);
                if status == 400 {
                    bump(&pve.stats.rejected);
                }
                if respond(&mut w, status, &reason, &body, keep_alive)
                    .await
                    .is_err()
                    || !keep_alive
                {
                    let _ = w.shutdown().await;
                    // A lingering close: read what the client is still
                    // sending, so the kernel does not answer unread data
                    // with a reset that destroys the answer in flight.
                    let mut sink = tokio::io::sink();
                    let drain = tokio::io::copy(&mut r, &mut sink);
                    let _ = tokio::time::timeout(Duration::from_secs(2), drain).await;
                    return;
                }
            }
            // Dropped without an answer (a cut or idle upload).
            None => return,
        }
    }
}

/// One request: its result and whether the connection may be kept; None
/// drops the connection without an answer.
async fn handle(
    pve: &Arc<Pve>,
    head: &Head,
    r: &mut (impl AsyncRead + Unpin),
) -> Option<(ApiResult, bool)> {
    let length: Option<u64> = head.header("content-length").and_then(|v| v.parse().ok());
    let has_body = length.is_some_and(|l| l > 0);
    bump(&pve.stats.requests);
    // process_header: chunked or other transfer encodings are refused.
    if let Some(te) = head.header("transfer-encoding") {
        let msg = if te.eq_ignore_ascii_case("chunked") {
            "chunked transfer encoding not supported".to_owned()
        } else {
            format!("Unknown transfer encoding '{te}'")
        };
        return Some((Err(status(501, msg)), false));
    }
    let Some(rel) = head.path.strip_prefix("/api2/json") else {
        return Some((Err(status(501, "no such uri")), !has_body));
    };
    if !pve.authorized(head) {
        tokio::time::sleep(Duration::from_millis(pve.args.auth_delay_ms)).await;
        let msg = if head.header("authorization").is_none() {
            "No ticket"
        } else {
            "authentication failure"
        };
        return Some((Err(status(401, msg)), !has_body));
    }
    let not_implemented = || {
        status(
            501,
            format!("Method '{} {rel}' not implemented", head.method),
        )
    };
    let route = match Schema::get().route(&head.method, rel) {
        Some(Ok(route)) => route,
        _ => return Some((Err(not_implemented()), !has_body)),
    };
    let mut params: BTreeMap<String, String> = route.params.iter().cloned().collect();
    if route.path == "/nodes/{node}/storage/{storage}/upload" {
        return upload(pve, head, r, length, params, route.method).await;
    }
    if has_body && !matches!(head.method.as_str(), "POST" | "PUT") {
        return Some((
            Err(status(
                501,
                format!("Unexpected content for method '{}'", head.method),
            )),
            false,
        ));
    }
    let len = length.unwrap_or(0);
    if len > MAX_POST {
        return Some((Err(status(501, "for data too large")), false));
    }
    let mut body = vec![0u8; len as usize];
    if len > 0 {
        tokio::time::timeout(IDLE, r.read_exact(&mut body))
            .await
            .ok()?
            .ok()?;
    }
    for (k, v) in form_pairs(&head.query) {
        params.insert(k, v);
    }
    let ctype = head.header("content-type").unwrap_or_default();
    if ctype.starts_with("application/json") && !body.is_empty() {
        match serde_json::from_slice::<Value>(&body) {
            Ok(Value::Object(map)) => {
                for (k, v) in map {
                    let v = match v {
                        Value::String(s) => s,
                        Value::Bool(b) => if b { "1" } else { "0" }.to_owned(),
                        Value::Null => continue,
                        other => other.to_string(),
                    };
                    params.insert(k, v);
                }
            }
            _ => return Some((Err(status(400, "malformed JSON body")), true)),
        }
    } else {
        for (k, v) in form_pairs(&String::from_utf8_lossy(&body)) {
            params.insert(k, v);
        }
    }
    if let Err(errors) = schema::check(route.method, &params) {
        return Some((Err(param_exc(errors)), true));
    }
    if let Some(node) = params.get("node")
        && !pve.hosts().any(|h| h == node)
    {
        return Some((
            Err(die(format!(
                "hostname lookup '{node}' failed - failed to get address info for: {node}: Name or service not known"
            ))),
            true,
        ));
    }
    let res = pve.dispatch(&head.method, route.path, &params);
    Some((res.unwrap_or_else(|| Err(not_implemented())), true))
}

fn status(code: u16, msg: impl Into<String>) -> ApiError {
    ApiError {
        status: code,
        message: msg.into(),
        errors: Errors::new(),
    }
}

/// `application/x-www-form-urlencoded` pairs (also query strings).
fn form_pairs(s: &str) -> Vec<(String, String)> {
    s.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            let dec = |x: &str| schema::percent_decode(&x.replace('+', " "));
            (dec(k), dec(v))
        })
        .collect()
}

/// The upload branch of pveproxy: multipart only, streamed to a staging
/// file under `DIR/tmp` (pveproxy: /var/tmp/pveupload-…), then the API call
/// with the fields as parameters. Keep-alive ends after an upload.
async fn upload(
    pve: &Arc<Pve>,
    head: &Head,
    r: &mut (impl AsyncRead + Unpin),
    length: Option<u64>,
    mut params: BTreeMap<String, String>,
    method: &Value,
) -> Option<(ApiResult, bool)> {
    let Some(size) = length.filter(|&l| l > 0) else {
        // No body: pveproxy runs the API call without one.
        for (k, v) in form_pairs(&head.query) {
            params.insert(k, v);
        }
        let res = schema::check(method, &params).map_err(param_exc);
        return Some((res.and(Err(die("missing temporary file name"))), true));
    };
    let ctype = head.header("content-type").unwrap_or_default();
    let (ct, boundary) = parse_content_type(ctype);
    let Some(boundary) = boundary.filter(|_| ct == "multipart/form-data") else {
        // pveproxy dies inside its header reader here and never answers.
        return None;
    };
    let query: BTreeMap<String, String> = form_pairs(&head.query).into_iter().collect();
    if query.contains_key("tmpfilename") {
        return Some((
            Err(die(
                "'tmpfilename' query parameter is not allowed for file uploads",
            )),
            false,
        ));
    }
    bump(&pve.stats.upload_attempts);
    let seq = pve.seq.fetch_add(1, Ordering::Relaxed);
    let staged = format!(
        "pveupload-{:032x}",
        u128::from(seq) ^ (u128::from(now()) << 64)
    );
    let tmp = pve.args.state_dir.join("tmp").join(&staged);
    let mut parser = Multipart::new(&boundary, size, query);
    let received = stream_upload(pve, r, &mut parser, &tmp).await;
    match received {
        Ok(()) => {}
        Err(None) => {
            let _ = std::fs::remove_file(&tmp);
            return None;
        }
        Err(Some(msg)) => {
            let _ = std::fs::remove_file(&tmp);
            return Some((Err(die(msg)), false));
        }
    }
    params.extend(parser.params);
    // The name pveproxy gives the staged file (the schema checks its pattern);
    // the simulator keeps it under DIR/tmp.
    params.insert("tmpfilename".into(), format!("/var/tmp/{staged}"));
    let res = match schema::check(method, &params) {
        Err(errors) => Err(param_exc(errors)),
        Ok(()) => pve.upload_call(&params, &tmp),
    };
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    Some((res, false))
}

/// Streams an upload body through the parser into `tmp`. Err(None): the
/// connection is to be dropped (idle, cut by a switch, closed by the peer);
/// Err(Some): pveproxy's 500 message.
async fn stream_upload(
    pve: &Pve,
    r: &mut (impl AsyncRead + Unpin),
    parser: &mut Multipart,
    tmp: &Path,
) -> Result<(), Option<String>> {
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(tmp)
        .map_err(|e| {
            Some(format!(
                "unable to create temporary upload file '{}' - {e}",
                tmp.display()
            ))
        })?;
    let mut out = std::io::BufWriter::with_capacity(UPLOAD_CHUNK, file);
    let cut_at = pve.args.drop_upload_after.filter(|_| {
        pve.drops_left
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok()
    });
    let mut buf = vec![0u8; UPLOAD_CHUNK];
    let mut total = 0u64;
    while !parser.done() {
        let room = match cut_at {
            Some(c) if total >= c => return Err(None),
            Some(c) => buf.len().min((c - total) as usize),
            None => buf.len(),
        };
        let n = match tokio::time::timeout(IDLE, r.read(&mut buf[..room])).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return Err(None),
            Ok(Ok(n)) => n,
        };
        total += n as u64;
        pve.stats
            .upload_bytes
            .fetch_add(n as u64, Ordering::Relaxed);
        // Large writes on the runtime thread: the disk is faster than TLS.
        parser.feed(&buf[..n], &mut out).map_err(Some)?;
    }
    // Flushed, not synced: pveproxy does not fsync its staging file either.
    out.into_inner().map_err(|e| Some(e.to_string()))?;
    Ok(())
}

/// `PVE::Storage::get_file_hash`'s algorithms that the simulator has.
fn file_hash(algorithm: &str, path: &Path) -> Result<String, String> {
    fn run<D: Digest>(path: &Path) -> std::io::Result<Vec<u8>> {
        use std::io::Read;
        let mut f = std::fs::File::open(path)?;
        let mut d = D::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            match f.read(&mut buf)? {
                0 => return Ok(d.finalize().to_vec()),
                n => d.update(&buf[..n]),
            }
        }
    }
    let sum = match algorithm {
        "sha224" => run::<Sha224>(path),
        "sha256" => run::<Sha256>(path),
        "sha384" => run::<Sha384>(path),
        "sha512" => run::<Sha512>(path),
        other => {
            return Err(format!(
                "simulator: checksum algorithm '{other}' not implemented"
            ));
        }
    };
    let sum = sum.map_err(|e| e.to_string())?;
    Ok(sum.iter().map(|b| format!("{b:02x}")).collect())
}

/// `qemu-img info` on an untrusted image, as `file_size_info(…, 1)` does:
/// the virtual size; refuses backing and data files and a wrong format.
fn qemu_img_info(path: &Path, format: &str) -> Result<u64, String> {
    let out = std::process::Command::new("qemu-img")
        .args(["info", "--output=json", "-f", format])
        .arg(path)
        .output()
        .map_err(|e| format!("qemu-img: {e}"))?;
    if !out.status.success() {
        return Err("failed to query file information with qemu-img".into());
    }
    let info: Value = serde_json::from_slice(&out.stdout).map_err(|e| {
        format!(
            "could not parse qemu-img info command output for '{}' - {e}",
            path.display()
        )
    })?;
    if info["format-specific"]["data"]["data-file"].is_string() {
        return Err(format!(
            "{}: 'data-file' references are not allowed!",
            path.display()
        ));
    }
    if info["backing-filename"].is_string() {
        return Err(format!(
            "backing file not allowed for untrusted image '{}'!",
            path.display()
        ));
    }
    if info["format"].as_str() != Some(format) {
        return Err(format!(
            "qemu-img bug: queried format does not match format in result '{format} ne {}'",
            info["format"]
        ));
    }
    info["virtual-size"]
        .as_u64()
        .ok_or_else(|| "size not an integer".into())
}

/// PVE's `format_size`: the largest unit that divides the size.
fn format_size(bytes: u64) -> String {
    for (unit, shift) in [("T", 40), ("G", 30), ("M", 20), ("K", 10)] {
        if bytes.is_multiple_of(1u64 << shift) && bytes >= 1u64 << shift {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

/// A size like `20G`, `+1G`, `512M` or bytes: (relative, bytes).
fn parse_size(s: &str) -> Option<(bool, u64)> {
    let (plus, s) = match s.strip_prefix('+') {
        Some(rest) => (true, rest),
        None => (false, s),
    };
    let (num, mult) = match s.chars().last()? {
        'K' => (&s[..s.len() - 1], 1u64 << 10),
        'M' => (&s[..s.len() - 1], 1 << 20),
        'G' => (&s[..s.len() - 1], 1 << 30),
        'T' => (&s[..s.len() - 1], 1 << 40),
        _ => (s, 1),
    };
    let n: f64 = num.parse().ok()?;
    (n >= 0.0).then_some((plus, (n * mult as f64) as u64))
}

/// Drive keys: the config entries that hold volumes.
fn is_drive(key: &str) -> bool {
    let stem = key.trim_end_matches(|c: char| c.is_ascii_digit());
    stem.len() < key.len()
        && matches!(
            stem,
            "scsi" | "virtio" | "sata" | "ide" | "efidisk" | "tpmstate"
        )
}

/// Splits a drive string into its volume and its options, in order.
fn split_drive(value: &str) -> (String, Vec<(String, String)>) {
    let mut parts = value.split(',');
    let mut file = parts.next().unwrap_or_default().to_owned();
    let mut opts = Vec::new();
    for p in parts {
        match p.split_once('=') {
            Some(("file", v)) => file = v.to_owned(),
            Some((k, v)) => opts.push((k.to_owned(), v.to_owned())),
            None => {}
        }
    }
    if let Some(v) = file.strip_prefix("file=") {
        file = v.to_owned();
    }
    (file, opts)
}

/// A drive string as PVE prints it: the volume, then options sorted.
fn print_drive(file: &str, mut opts: Vec<(String, String)>) -> String {
    opts.sort();
    let mut s = file.to_owned();
    for (k, v) in opts {
        s.push_str(&format!(",{k}={v}"));
    }
    s
}

impl Pve {
    fn authorized(&self, head: &Head) -> bool {
        head.header("authorization")
            .and_then(|a| a.strip_prefix("PVEAPIToken="))
            .is_some_and(|t| t == self.args.token)
    }

    fn token_user(&self) -> &str {
        self.args.token.split('=').next().unwrap_or_default()
    }

    fn stats_json(&self) -> Value {
        let s = &self.stats;
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        json!({
            "requests": g(&s.requests),
            "uploads": g(&s.uploads),
            "uploadAttempts": g(&s.upload_attempts),
            "uploadBytes": g(&s.upload_bytes),
            "downloadBytes": g(&s.download_bytes),
            "vmCreates": g(&s.vm_creates),
            "vmConfigChanges": g(&s.vm_config_changes),
            "reboots": g(&s.reboots),
            "resizes": g(&s.resizes),
            "starts": g(&s.starts),
            "startsChanged": g(&s.starts_changed),
            "bootFailures": g(&s.boot_failures),
            "stops": g(&s.stops),
            "rejected": g(&s.rejected),
            "tasksRunning": self.tasks.lock().unwrap().values().filter(|t| t.exit.is_none()).count(),
        })
    }

    /// `GET /_sim/stats` and `GET /_sim/vms/<vmid>`.
    fn sim_view(&self, path: &str) -> (u16, &'static str, Value) {
        if path == "/_sim/stats" {
            return (200, "OK", self.stats_json());
        }
        let vm = path
            .strip_prefix("/_sim/vms/")
            .and_then(|id| id.parse::<u32>().ok())
            .and_then(|id| self.vms.lock().unwrap().get(&id).cloned());
        match vm {
            Some(vm) => (
                200,
                "OK",
                json!({"running": vm.running, "bootedIp": vm.booted_ip, "bootError": vm.boot_error,
                       "host": vm.host, "config": vm.config, "pending": vm.pending}),
            ),
            None => (
                404,
                "Not Found",
                json!({"error": format!("no such VM: {path}")}),
            ),
        }
    }

    fn storage(&self, id: &str) -> Result<&Storage, ApiError> {
        self.storages
            .iter()
            .find(|s| s.id == id)
            .ok_or_else(|| die(format!("storage '{id}' does not exist")))
    }

    fn storage_dir(&self, id: &str) -> PathBuf {
        self.args.state_dir.join("storage").join(id)
    }

    /// The file behind a volume ID (`local:import/x.raw`, `local-lvm:vm-1-disk-0`).
    fn volume_path(&self, volid: &str) -> Result<PathBuf, String> {
        let (sid, name) = volid
            .split_once(':')
            .ok_or_else(|| format!("unable to parse volume ID '{volid}'"))?;
        let s = self.storage(sid).map_err(|e| e.message)?;
        let dir = self.storage_dir(s.id);
        if !s.has_path {
            return Ok(dir.join(format!("{name}.raw")));
        }
        let (kind, file) = name
            .split_once('/')
            .ok_or_else(|| format!("unable to parse directory volume name '{name}'"))?;
        Ok(match kind {
            "iso" => dir.join("template/iso").join(file),
            "vztmpl" => dir.join("template/cache").join(file),
            "import" => dir.join("import").join(file),
            "backup" => dir.join("dump").join(file),
            other => {
                return Err(format!(
                    "unable to parse directory volume name '{other}/{file}'"
                ));
            }
        })
    }

    /// Request routing by the schema's path template.
    fn dispatch(
        self: &Arc<Self>,
        method: &str,
        path: &str,
        p: &BTreeMap<String, String>,
    ) -> Option<ApiResult> {
        let vmid = || {
            p.get("vmid")
                .and_then(|v| v.parse::<u32>().ok())
                .unwrap_or(0)
        };
        // A VM is reached through its own node only (its config file is in
        // that node's directory of the cluster filesystem).
        if path.starts_with("/nodes/{node}/qemu/{vmid}")
            && let Some(vm) = self.vms.lock().unwrap().get(&vmid())
            && vm.host != p["node"]
        {
            return Some(Err(die(format!(
                "Configuration file 'nodes/{}/qemu-server/{}.conf' does not exist",
                p["node"],
                vmid()
            ))));
        }
        if let Some(answer) = self.destroy_routes(method, path, p) {
            return Some(answer);
        }
        Some(match (method, path) {
            ("GET", "/version") => Ok(json!({"version": "9.1.1", "release": "9.1", "repoid": "42ab1fbe"})),
            ("GET", "/nodes") => Ok(json!(self.hosts().map(|node| json!({
                "node": node, "status": "online", "type": "node",
                "id": format!("node/{node}"), "maxcpu": 8, "cpu": 0.01,
                "maxmem": 34359738368u64, "mem": 4294967296u64, "uptime": now() - self.started + 1,
            })).collect::<Vec<_>>())),
            ("GET", "/nodes/{node}/storage") => Ok(self.list_storages(p)),
            ("GET", "/nodes/{node}/storage/{storage}/content") => self.list_content(p),
            ("DELETE", "/nodes/{node}/storage/{storage}/content/{volume}") => self.delete_volume(p),
            ("POST", "/nodes/{node}/storage/{storage}/download-url") => self.download_url(p),
            ("GET", "/nodes/{node}/tasks/{upid}/status") => self.task_status(&p["upid"]),
            ("GET", "/nodes/{node}/tasks/{upid}/log") => self.task_log(p),
            ("GET", "/nodes/{node}/qemu") => Ok(self.list_vms(&p["node"])),
            ("POST", "/nodes/{node}/qemu") => self.create_vm(p),
            ("GET", "/nodes/{node}/qemu/{vmid}/config") => self.vm(vmid()).map(|vm| {
                // qemu-server `vm_config`: pending values unless `current`.
                vm_config_json(&vm, p.get("current").is_none_or(|c| c != "1"))
            }),
            ("GET", "/nodes/{node}/qemu/{vmid}/pending") => self.vm(vmid()).map(|vm| vm_pending_json(&vm)),
            ("POST", "/nodes/{node}/qemu/{vmid}/status/reboot") => self.reboot(vmid()),
            ("POST", "/nodes/{node}/qemu/{vmid}/config") => self.update_config(vmid(), p, true),
            ("PUT", "/nodes/{node}/qemu/{vmid}/config") => self.update_config(vmid(), p, false),
            ("PUT", "/nodes/{node}/qemu/{vmid}/resize") => self.resize(vmid(), p),
            ("POST", "/nodes/{node}/qemu/{vmid}/status/start") => self.power(vmid(), true),
            ("POST", "/nodes/{node}/qemu/{vmid}/status/stop") => self.power(vmid(), false),
            ("GET", "/nodes/{node}/qemu/{vmid}/status/current") => self.vm(vmid()).map(|vm| {
                let st = if vm.running { "running" } else { "stopped" };
                json!({"vmid": vmid(), "name": vm.config.get("name"), "status": st, "qmpstatus": st})
            }),
            _ => return None,
        })
    }

    fn list_storages(&self, p: &BTreeMap<String, String>) -> Value {
        let list: Vec<Value> = self
            .storages
            .iter()
            .filter(|s| p.get("storage").is_none_or(|id| id == s.id))
            .filter(|s| {
                p.get("content")
                    .is_none_or(|c| c.split(',').all(|c| s.content.contains(&c)))
            })
            .map(|s| {
                json!({
                    "storage": s.id, "type": s.kind, "content": s.content.join(","),
                    "active": 1, "enabled": 1, "shared": u8::from(!self.args.other_nodes.is_empty()),
                    "total": 1u64 << 40, "used": 1u64 << 30, "avail": (1u64 << 40) - (1u64 << 30),
                })
            })
            .collect();
        json!(list)
    }

    fn list_content(&self, p: &BTreeMap<String, String>) -> ApiResult {
        let s = self.storage(&p["storage"])?;
        let kinds: Vec<&str> = match p.get("content") {
            Some(c) => c.split(',').collect(),
            None => s.content.clone(),
        };
        let mut list = Vec::new();
        for kind in kinds.into_iter().filter(|k| s.content.contains(k)) {
            let sub = match kind {
                "import" => "import",
                "iso" => "template/iso",
                "vztmpl" => "template/cache",
                _ => continue,
            };
            let Ok(dir) = std::fs::read_dir(self.storage_dir(s.id).join(sub)) else {
                continue;
            };
            for e in dir.flatten() {
                let Ok(meta) = e.metadata() else { continue };
                let name = e.file_name().to_string_lossy().into_owned();
                let format = match kind {
                    "import" => {
                        match name
                            .rsplit_once('.')
                            .map(|(_, ext)| ext.to_ascii_lowercase())
                        {
                            Some(ext)
                                if ["ova", "ovf", "qcow2", "raw", "vmdk"]
                                    .contains(&ext.as_str()) =>
                            {
                                ext
                            }
                            _ => continue,
                        }
                    }
                    "iso" => "iso".into(),
                    _ => "tgz".into(),
                };
                let ctime = meta
                    .modified()
                    .ok()
                    .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                    .map_or(0, |d| d.as_secs());
                list.push(json!({
                    "volid": format!("{}:{kind}/{name}", s.id), "format": format,
                    "size": meta.len(), "ctime": ctime, "content": kind,
                }));
            }
        }
        Ok(json!(list))
    }

    fn delete_volume(self: &Arc<Self>, p: &BTreeMap<String, String>) -> ApiResult {
        let volume = &p["volume"];
        let volid = if volume.contains(':') {
            volume.clone()
        } else {
            format!("{}:{volume}", p["storage"])
        };
        let path = self.volume_path(&volid).map_err(die)?;
        if !path.exists() {
            return Err(die(format!("volume '{volid}' does not exist")));
        }
        let id = volid.clone();
        Ok(self.spawn_task("imgdel", &id, move |_, log| {
            std::fs::remove_file(&path).map_err(|e| e.to_string())?;
            log.push(format!("Removed volume '{volid}'"));
            Ok(())
        }))
    }

    /// `PVE::API2::Storage::Status` upload, after pveproxy has staged the
    /// file (pve-storage src/PVE/API2/Storage/Status.pm).
    fn upload_call(self: &Arc<Self>, p: &BTreeMap<String, String>, tmp: &Path) -> ApiResult {
        let node = &p["node"];
        if !self.hosts().any(|h| h == node) {
            return Err(die(format!(
                "hostname lookup '{node}' failed - failed to get address info for: {node}: Name or service not known"
            )));
        }
        let content = p["content"].clone();
        let filename = normalize_filename(&p["filename"]);
        let (dest_dir, image_format) = self.content_dir(&p["storage"], &content, &filename)?;
        let dest = dest_dir.join(&filename);
        let (tmp, sum, algo) = (
            tmp.to_owned(),
            p.get("checksum").cloned(),
            p.get("checksum-algorithm").cloned(),
        );
        let node = self.args.node.clone();
        if self.args.fail_task.as_deref() == Some("imgcopy") {
            // The failing worker never runs; like a real failure it leaves no staged file.
            let _ = std::fs::remove_file(&tmp);
        }
        Ok(self.spawn_task("imgcopy", "", move |pve, log| {
            log.push(format!("starting file import from: {}", tmp.display()));
            let checked = (|| {
                if let Some(algo) = &algo {
                    let got = file_hash(algo, &tmp)?;
                    let want = sum.clone().unwrap_or_default();
                    if !got.eq_ignore_ascii_case(&want) {
                        log.push("calculating checksum...".into());
                        return Err(format!("checksum mismatch: got '{got}' != expect '{want}'"));
                    }
                    log.push("calculating checksum...OK, checksum verified".into());
                }
                if let Some(fmt) = &image_format {
                    qemu_img_info(&tmp, fmt)?;
                }
                Ok(())
            })();
            if let Err(e) = checked {
                let _ = std::fs::remove_file(&tmp);
                return Err(e);
            }
            let size = std::fs::metadata(&tmp).map(|m| m.len()).unwrap_or(0);
            log.push(format!("target node: {node}"));
            log.push(format!("target file: {}", dest.display()));
            log.push(format!("file size is: {size}"));
            log.push(format!(
                "command: cp -- {} {}",
                tmp.display(),
                dest.display()
            ));
            std::fs::create_dir_all(&dest_dir).map_err(|e| e.to_string())?;
            // Same filesystem here: a rename is the copy (and silently overwrites).
            if let Err(e) = std::fs::rename(&tmp, &dest) {
                let _ = std::fs::remove_file(&tmp);
                return Err(format!("import failed: {e}"));
            }
            log.push("finished file import successfully".into());
            bump(&pve.stats.uploads);
            Ok(())
        }))
    }

    /// Where a file of `content` named `filename` goes in storage `sid`,
    /// and the image format `qemu-img info` must find in it: the checks
    /// upload and download-url share (pve-storage Status.pm).
    fn content_dir(
        &self,
        sid: &str,
        content: &str,
        filename: &str,
    ) -> Result<(PathBuf, Option<String>), ApiError> {
        let s = self.storage(sid)?;
        if !s.has_path {
            return Err(die(format!("can't upload to storage type '{}'", s.kind)));
        }
        let bad =
            |key: &str, msg: &str| param_exc(Errors::from([(key.to_owned(), msg.to_owned())]));
        let dir = self.storage_dir(s.id);
        let lower_ext = |exts: &[&str]| {
            filename
                .rsplit_once('.')
                .filter(|(stem, _)| !stem.is_empty())
                .map(|(_, e)| e.to_ascii_lowercase())
                .filter(|e| exts.contains(&e.as_str()))
        };
        let (dest_dir, image_format) = match content {
            "iso" => {
                lower_ext(&["iso", "img"])
                    .ok_or_else(|| bad("filename", "wrong file extension"))?;
                (dir.join("template/iso"), None)
            }
            "vztmpl" => {
                let ok = [".tar.gz", ".tar.xz", ".tar.zst", ".tar.bz2"]
                    .iter()
                    .any(|e| filename.ends_with(e));
                if !ok || filename.len() < 8 {
                    return Err(bad("filename", "wrong file extension"));
                }
                (dir.join("template/cache"), None)
            }
            "import" => {
                let ext = filename
                    .rsplit_once('.')
                    .filter(|(stem, _)| !stem.is_empty())
                    .map(|(_, e)| e)
                    .filter(|e| ["ova", "qcow2", "raw", "vmdk"].contains(e))
                    .ok_or_else(|| bad("filename", "invalid filename or wrong extension"))?;
                (dir.join("import"), (ext != "ova").then(|| ext.to_owned()))
            }
            other => {
                return Err(bad(
                    "content",
                    &format!("upload content type '{other}' not allowed"),
                ));
            }
        };
        if !s.content.contains(&content) {
            return Err(die(format!(
                "storage '{sid}' does not support '{content}' content"
            )));
        }
        Ok((dest_dir, image_format))
    }

    /// `fork_worker`: a UPID now, the work after `--task-delay-ms`; a task
    /// of the `--fail-task` type ends with an error and does nothing.
    fn spawn_task(
        self: &Arc<Self>,
        kind: &str,
        id: &str,
        work: impl FnOnce(&Pve, &mut Vec<String>) -> Result<(), String> + Send + 'static,
    ) -> Value {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let (pid, pstart, start) = (std::process::id() * 16 + seq, 1000 + seq, now());
        let upid = format!(
            "UPID:{}:{pid:08X}:{pstart:08X}:{start:08X}:{kind}:{id}:{}:",
            self.args.node,
            self.token_user()
        );
        self.tasks.lock().unwrap().insert(
            upid.clone(),
            Task {
                upid: upid.clone(),
                kind: kind.to_owned(),
                id: id.to_owned(),
                pid,
                pstart,
                start,
                log: Vec::new(),
                exit: None,
            },
        );
        let fail = self.args.fail_task.as_deref() == Some(kind);
        let pve = self.clone();
        let key = upid.clone();
        let kind = kind.to_owned();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(pve.args.task_delay_ms)).await;
            let worker = pve.clone();
            let done = tokio::task::spawn_blocking(move || {
                let mut log = Vec::new();
                let res = if fail {
                    Err(format!("{kind} failed (simulated by --fail-task)"))
                } else {
                    work(&worker, &mut log)
                };
                (log, res)
            })
            .await;
            let (mut log, res) =
                done.unwrap_or_else(|e| (Vec::new(), Err(format!("worker panicked: {e}"))));
            let exit = match res {
                Ok(()) => {
                    log.push("TASK OK".into());
                    "OK".to_owned()
                }
                Err(e) => {
                    log.push(format!("TASK ERROR: {e}"));
                    e
                }
            };
            if let Some(t) = pve.tasks.lock().unwrap().get_mut(&key) {
                t.log = log;
                t.exit = Some(exit);
            }
        });
        json!(upid)
    }

    fn task_status(&self, upid: &str) -> ApiResult {
        let tasks = self.tasks.lock().unwrap();
        let t = tasks
            .get(upid)
            .ok_or_else(|| die(format!("no such task: '{upid}'")))?;
        let mut v = json!({
            "upid": t.upid, "node": self.args.node, "pid": t.pid, "pstart": t.pstart,
            "starttime": t.start, "type": t.kind, "id": t.id, "user": self.token_user(),
            "status": if t.exit.is_some() { "stopped" } else { "running" },
        });
        if let Some(e) = &t.exit {
            v["exitstatus"] = json!(e);
        }
        Ok(v)
    }

    fn task_log(&self, p: &BTreeMap<String, String>) -> ApiResult {
        let tasks = self.tasks.lock().unwrap();
        let t = tasks
            .get(&p["upid"])
            .ok_or_else(|| die(format!("no such task: '{}'", p["upid"])))?;
        let start: usize = p.get("start").and_then(|v| v.parse().ok()).unwrap_or(0);
        let limit: usize = p.get("limit").and_then(|v| v.parse().ok()).unwrap_or(50);
        let lines: Vec<Value> = t
            .log
            .iter()
            .enumerate()
            .skip(start)
            .take(limit)
            .map(|(i, l)| json!({"n": i + 1, "t": l}))
            .collect();
        Ok(json!(lines))
    }

    fn vm(&self, vmid: u32) -> Result<Vm, ApiError> {
        self.vms.lock().unwrap().get(&vmid).cloned().ok_or_else(|| {
            die(format!(
                "Configuration file 'nodes/{}/qemu-server/{vmid}.conf' does not exist",
                self.args.node
            ))
        })
    }

    /// The cluster's nodes: `--node` first.
    fn hosts(&self) -> impl Iterator<Item = &String> {
        std::iter::once(&self.args.node).chain(&self.args.other_nodes)
    }

    fn list_vms(&self, node: &str) -> Value {
        let vms = self.vms.lock().unwrap();
        let list: Vec<Value> = vms
            .iter()
            .filter(|(_, vm)| vm.host == node)
            .map(|(id, vm)| {
                let mem: u64 = vm
                    .config
                    .get("memory")
                    .and_then(|m| m.trim_start_matches("current=").parse().ok())
                    .unwrap_or(512);
                json!({
                    "vmid": id, "name": vm.config.get("name"),
                    "status": if vm.running { "running" } else { "stopped" },
                    "maxmem": mem << 20, "cpus": vm.config.get("cores").and_then(|c| c.parse::<u64>().ok()).unwrap_or(1),
                })
            })
            .collect();
        json!(list)
    }

    fn create_vm(self: &Arc<Self>, p: &BTreeMap<String, String>) -> ApiResult {
        let vmid: u32 = p["vmid"].parse().unwrap_or(0);
        let mut config = BTreeMap::new();
        for (k, v) in p {
            if !matches!(
                k.as_str(),
                "node"
                    | "vmid"
                    | "start"
                    | "storage"
                    | "pool"
                    | "force"
                    | "unique"
                    | "archive"
                    | "bwlimit"
                    | "live-restore"
                    | "import-working-storage"
            ) {
                config.insert(k.clone(), v.clone());
            }
        }
        for (k, v) in &config {
            if is_drive(k) {
                self::secureboot::check_drive_param(k, v)
                    .and_then(|()| self.check_drive(v))
                    .map_err(|e| param_exc(Errors::from([(k.clone(), e)])))?;
            }
        }
        // The real server reserves the vmid here (create_and_lock_config); the
        // simulator enters the VM when the worker succeeds, so a failed
        // create leaves nothing behind.
        if self.vms.lock().unwrap().contains_key(&vmid) {
            return Err(die(format!(
                "unable to create VM {vmid} - VM {vmid} already exists on node '{}'",
                self.args.node
            )));
        }
        bump(&self.stats.vm_creates);
        let start = p.get("start").is_some_and(|s| s == "1");
        if start {
            bump(&self.stats.starts);
        }
        let host = p["node"].clone();
        let upid = self.spawn_task("qmcreate", &vmid.to_string(), move |pve, log| {
            let res = (|| {
                let mut built = BTreeMap::new();
                let mut taken = Vec::new();
                // The EFI disk is allocated first (disk-0), then the others in order.
                let mut keys: Vec<&String> = config.keys().collect();
                keys.sort_by_key(|k| !k.starts_with("efidisk"));
                for k in keys {
                    let v = &config[k];
                    let v = if is_drive(k) {
                        pve.create_drive(vmid, v, &mut taken, log)?
                    } else if k.starts_with("net") {
                        with_mac(v, vmid)
                    } else {
                        v.clone()
                    };
                    built.insert(k.clone(), v);
                }
                built.insert("smbios1".into(), format!("uuid={}", uuid_for(vmid, 1)));
                built.insert("vmgenid".into(), uuid_for(vmid, 2));
                built.insert(
                    "meta".into(),
                    format!("creation-qemu=10.0.2,ctime={}", now()),
                );
                Ok::<_, String>(built)
            })();
            let mut vm = Vm {
                config: res?,
                host,
                ..Vm::default()
            };
            if start {
                power_on(pve, vmid, &mut vm, log);
            }
            pve.vms.lock().unwrap().insert(vmid, vm);
            Ok(())
        });
        Ok(upid)
    }

    /// `$check_drive_param`: a new disk needs a storage with `images`, an
    /// import a source volume of `import` or `images` content.
    fn check_drive(&self, value: &str) -> Result<(), String> {
        let (file, opts) = split_drive(value);
        let Some((sid, size)) = file.split_once(':') else {
            return Ok(());
        };
        if size.parse::<f64>().is_err() {
            return Ok(());
        }
        let s = self.storage(sid).map_err(|e| e.message)?;
        if !s.content.contains(&"images") {
            return Err(format!(
                "storage '{sid}' does not support content-type 'images'"
            ));
        }
        if let Some((_, src)) = opts.iter().find(|(k, _)| k == "import-from") {
            let (_, name) = src.split_once(':').unwrap_or(("", src));
            if name.starts_with("iso/")
                || name.starts_with("vztmpl/")
                || name.starts_with("backup/")
            {
                return Err(format!(
                    "'import-from': wrong content type for volume '{src}'"
                ));
            }
        }
        Ok(())
    }

    /// Allocates a new disk (`STORAGE:SIZE[,import-from=…]`) as
    /// `vm-<vmid>-disk-<n>`; any other drive string is kept as given.
    fn create_drive(
        &self,
        vmid: u32,
        value: &str,
        taken: &mut Vec<u32>,
        log: &mut Vec<String>,
    ) -> Result<String, String> {
        let (file, opts) = split_drive(value);
        let Some((sid, size)) = file.split_once(':') else {
            return Ok(value.to_owned());
        };
        let Ok(gib) = size.parse::<f64>() else {
            return Ok(value.to_owned());
        };
        let dir = self.storage_dir(sid);
        let n = (0..)
            .find(|n| !taken.contains(n) && !dir.join(format!("vm-{vmid}-disk-{n}.raw")).exists())
            .expect("a free disk number");
        taken.push(n);
        let name = format!("vm-{vmid}-disk-{n}");
        let path = dir.join(format!("{name}.raw"));
        let import = opts
            .iter()
            .find(|(k, _)| k == "import-from")
            .map(|(_, v)| v.clone());
        // EFI vars and TPM state are small fixed-size volumes (Drive.pm:
        // "SIZE_IN_GiB is ignored here and 4 MiB will be used instead").
        let is_efi = opts.iter().any(|(k, _)| k == "efitype" || k == "version");
        let bytes = if let Some(src) = &import {
            let from = self.volume_path(src)?;
            if !from.exists() {
                return Err(format!("volume '{src}' does not exist"));
            }
            let format = from
                .extension()
                .and_then(|e| e.to_str())
                .unwrap_or("raw")
                .to_owned();
            log.push(format!("importing disk '{src}' to VM {vmid} ..."));
            let size = qemu_img_info(&from, &format)?;
            // qemu-img writes a sparse raw file, as lvmthin holds raw.
            let ok = std::process::Command::new("qemu-img")
                .args(["convert", "-f", &format, "-O", "raw"])
                .arg(&from)
                .arg(&path)
                .status()
                .is_ok_and(|s| s.success());
            if !ok {
                let _ = std::fs::remove_file(&path);
                return Err(format!(
                    "import failed - qemu-img convert of '{src}' failed"
                ));
            }
            log.push(format!("Successfully imported disk as '{sid}:{name}'"));
            size
        } else {
            // EFI vars are copied at their fixed size; lvmthin rounds to 4 MiB.
            let bytes = if is_efi {
                4 << 20
            } else {
                (gib * (1u64 << 30) as f64) as u64
            };
            let f = std::fs::File::create(&path).map_err(|e| e.to_string())?;
            f.set_len(bytes).map_err(|e| e.to_string())?;
            log.push(format!("  Logical volume \"{name}\" created."));
            bytes
        };
        let mut opts: Vec<(String, String)> = opts
            .into_iter()
            .filter(|(k, _)| k != "import-from" && k != "size")
            .collect();
        opts.push(("size".into(), format_size(bytes)));
        Ok(print_drive(&format!("{sid}:{name}"), opts))
    }

    fn update_config(
        self: &Arc<Self>,
        vmid: u32,
        p: &BTreeMap<String, String>,
        asynchronous: bool,
    ) -> ApiResult {
        self.vm(vmid)?;
        let mut changes = BTreeMap::new();
        for (k, v) in p {
            if !matches!(
                k.as_str(),
                "node"
                    | "vmid"
                    | "delete"
                    | "digest"
                    | "force"
                    | "skiplock"
                    | "revert"
                    | "background_delay"
            ) {
                changes.insert(k.clone(), v.clone());
            }
        }
        let current = self.vm(vmid)?.config;
        for (k, v) in &changes {
            if is_drive(k) {
                self::secureboot::check_drive_param(k, v)
                    .and_then(|()| self.check_drive(v))
                    .map_err(|e| param_exc(Errors::from([(k.clone(), e)])))?;
            }
            if k == "tpmstate0" {
                self::secureboot::check_tpm_change(current.get(k).map(String::as_str), v)
                    .map_err(die)?;
            }
        }
        let deletes: Vec<String> = p
            .get("delete")
            .map(|d| {
                d.split([',', ';', ' '])
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        bump(&self.stats.vm_config_changes);
        let apply = move |pve: &Pve, log: &mut Vec<String>| -> Result<(), String> {
            let mut vm = pve.vm(vmid).map_err(|e| e.message)?;
            for d in &deletes {
                let Some(old) = vm.config.remove(d) else {
                    continue;
                };
                if d.starts_with("unused") {
                    pve.deallocate_unused(vmid, &vm.config, &old, log)?;
                } else if is_drive(d) {
                    move_to_unused(&mut vm.config, &old, vmid);
                }
            }
            let mut taken = Vec::new();
            for (k, v) in &changes {
                let v = if is_drive(k) {
                    let new = pve.create_drive(vmid, v, &mut taken, log)?;
                    if let Some(old) = vm.config.get(k).cloned()
                        && split_drive(&old).0 != split_drive(&new).0
                    {
                        move_to_unused(&mut vm.config, &old, vmid);
                    }
                    new
                } else if k.starts_with("net") {
                    with_mac(v, vmid)
                } else {
                    v.clone()
                };
                log.push(format!("update VM {vmid}: -{k} {v}"));
                if vm.running && !hot_pluggable(&vm.config, k) {
                    vm.pending.insert(k.clone(), v);
                } else {
                    vm.pending.remove(k);
                    vm.config.insert(k.clone(), v);
                }
            }
            pve.vms.lock().unwrap().insert(vmid, vm);
            Ok(())
        };
        if asynchronous {
            Ok(self.spawn_task("qmconfig", &vmid.to_string(), apply))
        } else {
            apply(self, &mut Vec::new()).map_err(die)?;
            Ok(Value::Null)
        }
    }

    /// `delete=unusedN` (qemu-server src/PVE/QemuServer.pm
    /// `try_deallocate_drive`): a volume the VM owns is freed, unless a
    /// drive of the config (`config`, the entry already taken out) still
    /// uses it; a volume of another VM only leaves the config.
    fn deallocate_unused(
        &self,
        vmid: u32,
        config: &BTreeMap<String, String>,
        entry: &str,
        log: &mut Vec<String>,
    ) -> Result<(), String> {
        let (file, _) = split_drive(entry);
        if volume_owner(&file) != Some(vmid) {
            return Ok(());
        }
        let in_use = config
            .iter()
            .any(|(k, v)| is_drive(k) && split_drive(v).0 == file);
        if in_use {
            return Err(format!(
                "unable to delete '{file}' - volume is still in use (snapshot?)"
            ));
        }
        let path = self.volume_path(&file)?;
        let _ = std::fs::remove_file(&path);
        log.push(format!("delete unused disk '{file}'"));
        Ok(())
    }

    fn resize(self: &Arc<Self>, vmid: u32, p: &BTreeMap<String, String>) -> ApiResult {
        let vm = self.vm(vmid)?;
        let disk = p["disk"].clone();
        let Some(current) = vm.config.get(&disk).cloned() else {
            return Err(die(format!("disk '{disk}' does not exist")));
        };
        let Some((relative, amount)) = parse_size(&p["size"]) else {
            return Err(param_exc(Errors::from([(
                "size".to_owned(),
                "unable to parse size".to_owned(),
            )])));
        };
        bump(&self.stats.resizes);
        Ok(
            self.spawn_task("qmresize", &vmid.to_string(), move |pve, log| {
                let (file, opts) = split_drive(&current);
                let path = pve.volume_path(&file)?;
                let size = std::fs::metadata(&path).map_err(|e| e.to_string())?.len();
                let new = if relative { size + amount } else { amount };
                if new < size {
                    return Err("shrinking disks is not supported".into());
                }
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .and_then(|f| f.set_len(new))
                    .map_err(|e| e.to_string())?;
                log.push(format!(
                    "  Size of logical volume changed from {size} to {new} bytes."
                ));
                let mut opts: Vec<(String, String)> =
                    opts.into_iter().filter(|(k, _)| k != "size").collect();
                opts.push(("size".into(), format_size(new)));
                if let Some(vm) = pve.vms.lock().unwrap().get_mut(&vmid) {
                    vm.config.insert(disk.clone(), print_drive(&file, opts));
                }
                Ok(())
            }),
        )
    }

    fn power(self: &Arc<Self>, vmid: u32, on: bool) -> ApiResult {
        self.vm(vmid)?;
        let kind = if on { "qmstart" } else { "qmstop" };
        bump(if on {
            &self.stats.starts
        } else {
            &self.stats.stops
        });
        Ok(self.spawn_task(kind, &vmid.to_string(), move |pve, log| {
            // The disk is read and the node booted without holding the lock.
            let mut vm = pve.vm(vmid).map_err(|e| e.message)?;
            if on {
                if vm.running {
                    return Err(format!("VM {vmid} already running"));
                }
                apply_pending(&mut vm);
                power_on(pve, vmid, &mut vm, log);
            } else {
                power_off(pve, &mut vm, log);
            }
            let mut vms = pve.vms.lock().unwrap();
            let current = vms
                .get_mut(&vmid)
                .ok_or_else(|| format!("VM {vmid} does not exist"))?;
            current.running = vm.running;
            current.config = vm.config;
            current.pending = vm.pending;
            current.booted_ip = vm.booted_ip;
            current.boot_error = vm.boot_error;
            current.booted_iso = vm.booted_iso;
            current.installed = vm.installed;
            Ok(())
        }))
    }

    /// `status/reboot` (qemu-server `vm_reboot`): a running VM is shut
    /// down and started again, its pending changes applied.
    fn reboot(self: &Arc<Self>, vmid: u32) -> ApiResult {
        if !self.vm(vmid)?.running {
            return Err(die(format!("VM {vmid} not running")));
        }
        bump(&self.stats.reboots);
        Ok(
            self.spawn_task("qmreboot", &vmid.to_string(), move |pve, log| {
                let mut vm = pve.vm(vmid).map_err(|e| e.message)?;
                power_off(pve, &mut vm, log);
                apply_pending(&mut vm);
                power_on(pve, vmid, &mut vm, log);
                pve.vms.lock().unwrap().insert(vmid, vm);
                Ok(())
            }),
        )
    }
}

/// A start applies what waited (qemu-server `vmconfig_apply_pending`).
fn apply_pending(vm: &mut Vm) {
    let pending = std::mem::take(&mut vm.pending);
    vm.config.extend(pending);
}

/// Where a VM comes to life: with `--nodes-control`, a Talos node boots for
/// it at the loopback address its boot disk's META key 10 names. A disk
/// without one leaves a running VM with no node, as a real one would never
/// answer; why is logged and kept for `/_sim/vms/<vmid>`.
fn power_on(pve: &Pve, vmid: u32, vm: &mut Vm, log: &mut Vec<String>) {
    log.push(format!("starting VM {vmid}"));
    vm.running = true;
    vm.booted_ip = None;
    vm.boot_error = None;
    vm.booted_iso = None;
    bump(&pve.stats.starts_changed);
    let Some(nodes) = &pve.nodes else {
        return;
    };
    let booted = boot_target(pve, vmid, vm).and_then(|(ip, hostname, iso)| {
        vm.booted_iso = iso.then(|| hostname.clone());
        // A Secure Boot disk that boots at all boots with Secure Boot on
        // (systemd-boot enrolled the keys in setup mode).
        let secure_boot = !iso
            && boot_drives(&vm.config).into_iter().any(|(volid, cdrom)| {
                !cdrom
                    && pve
                        .volume_path(&volid)
                        .is_ok_and(|p| self::secureboot::is_secure_boot_disk(&p))
            });
        let body = json!({"name": format!("vm-{vmid}"), "ip": ip, "hostname": hostname, "secure_boot": secure_boot});
        tokio::runtime::Handle::current().block_on(nodes.boot(&body))?;
        Ok(ip)
    });
    match booted {
        Ok(ip) => {
            log.push(format!("Talos node up at {ip}"));
            vm.booted_ip = Some(ip);
        }
        Err(e) => {
            log.push(format!("no Talos node boots: {e}"));
            bump(&pve.stats.boot_failures);
            vm.boot_error = Some(e);
        }
    }
}

/// What a start boots, as the firmware walks the boot order: the address
/// and hostname of the node that comes up, and whether it came from an ISO.
fn boot_target(pve: &Pve, vmid: u32, vm: &Vm) -> Result<(String, Option<String>, bool), String> {
    let scratch = pve.args.state_dir.join("tmp");
    for (volid, cdrom) in boot_drives(&vm.config) {
        let path = pve.volume_path(&volid)?;
        if cdrom {
            let cfg = scratch.join(format!("grub-{vmid}.cfg"));
            let (ip, hostname, halts) =
                iso_key10_address(&path, &cfg).map_err(|e| format!("{volid}: {e}"))?;
            if halts && vm.installed.is_some() {
                return Err(format!(
                    "{volid}: Talos is already installed to disk but booted from another media and talos.halt_if_installed kernel parameter is set. Please reboot from the disk."
                ));
            }
            return Ok((ip, hostname, true));
        }
        if let Some(i) = vm.installed.as_ref().filter(|i| i.volid == volid) {
            return Ok((i.ip.clone(), i.hostname.clone(), false));
        }
        if is_blank(&path) {
            continue;
        }
        if self::secureboot::is_secure_boot_disk(&path)
            && let Some(why) = self::secureboot::firmware_refusal(&vm.config)
        {
            return Err(format!("{volid}: {why}"));
        }
        let raw = scratch.join(format!("meta-{vmid}.raw"));
        let (ip, hostname) = key10_address(&path, &raw).map_err(|e| format!("{volid}: {e}"))?;
        return Ok((ip, hostname, false));
    }
    Err("no boot disk".to_owned())
}

/// Whether a disk holds nothing a firmware would boot: its first MiB is
/// zeros (no MBR boot signature, no GPT).
fn is_blank(path: &Path) -> bool {
    let Ok(f) = std::fs::File::open(path) else {
        return false;
    };
    let mut head = Vec::new();
    std::io::Read::read_to_end(&mut std::io::Read::take(f, 1 << 20), &mut head).is_ok()
        && head.iter().all(|b| *b == 0)
}

/// A VM stops (or is destroyed): its node halts. A node booted from an ISO
/// whose config was applied has installed Talos to the VM's first blank
/// disk in the boot order, with the META the ISO gave it.
fn power_off(pve: &Pve, vm: &mut Vm, log: &mut Vec<String>) {
    vm.running = false;
    let Some(ip) = vm.booted_ip.take() else {
        return;
    };
    let Some(nodes) = &pve.nodes else {
        return;
    };
    match tokio::runtime::Handle::current().block_on(nodes.halt(&ip)) {
        Err(e) => log.push(format!("halting the Talos node at {ip}: {e}")),
        Ok(reply) => {
            let configured = reply.get("configured") == Some(&Value::Bool(true));
            if let (true, Some(hostname), None) = (configured, vm.booted_iso.clone(), &vm.installed)
            {
                let disk = boot_drives(&vm.config)
                    .into_iter()
                    .filter(|(_, cdrom)| !cdrom)
                    .find(|(volid, _)| pve.volume_path(volid).is_ok_and(|p| is_blank(&p)));
                if let Some((volid, _)) = disk {
                    log.push(format!("Talos installed to {volid}"));
                    vm.installed = Some(Installed {
                        volid,
                        ip,
                        hostname,
                    });
                }
            }
        }
    }
}

/// The volumes a VM may boot from, in its boot order, and whether each is a
/// cdrom: the drives of `boot: order=…` that hold a volume, else scsi0,
/// else virtio0.
fn boot_drives(config: &BTreeMap<String, String>) -> Vec<(String, bool)> {
    let order = config
        .get("boot")
        .and_then(|b| b.split(',').find_map(|p| p.strip_prefix("order=")))
        .map(|o| o.split(';').map(str::to_owned).collect::<Vec<_>>())
        .unwrap_or_else(|| vec!["scsi0".to_owned(), "virtio0".to_owned()]);
    order
        .iter()
        .map(String::as_str)
        .filter(|k| is_drive(k))
        .filter_map(|k| {
            let (file, opts) = split_drive(config.get(k)?);
            let cdrom = opts.iter().any(|(o, v)| o == "media" && v == "cdrom");
            // `none` is an empty drive, `cdrom` the host's physical drive.
            (file != "none" && file != "cdrom").then_some((file, cdrom))
        })
        .collect()
}

/// The first loopback address (prefix stripped) and the hostname in META
/// key 10 of the disk image at `path` (raw, or qcow2 read through a raw
/// copy qemu-img makes at `scratch`).
fn key10_address(path: &Path, scratch: &Path) -> Result<(String, Option<String>), String> {
    let qcow2 = path.extension().is_some_and(|e| e == "qcow2");
    let tags = if qcow2 {
        let raw = scratch;
        let ok = std::process::Command::new("qemu-img")
            .args(["convert", "-f", "qcow2", "-O", "raw"])
            .arg(path)
            .arg(raw)
            .status()
            .is_ok_and(|s| s.success());
        let tags = if ok {
            crate::disk::read_meta(raw)
        } else {
            Err("qemu-img could not read the disk".to_owned())
        };
        let _ = std::fs::remove_file(raw);
        tags?
    } else {
        crate::disk::read_meta(path)?
    };
    key10_target(tags.get(&10).ok_or("META has no key 10")?)
}

/// The address a node booted from a Talos ISO comes up at: the META that
/// the kernel line of the first GRUB menu entry carries
/// (`talos.environment=INSTALLER_META_BASE64=<v>`, siderolabs/talos
/// `pkg/imager/imager.go` `buildCmdline`), decoded as `Values.Decode` in
/// `pkg/machinery/meta/meta.go` does: base64, gunzip when gzip, `0x<key>=<value>`
/// split on `;`; and whether that line sets `talos.halt_if_installed=1`.
/// `grub.cfg` is extracted with xorriso to `scratch`.
fn iso_key10_address(iso: &Path, scratch: &Path) -> Result<(String, Option<String>, bool), String> {
    let _ = std::fs::create_dir_all(scratch.parent().unwrap_or(Path::new(".")));
    let _ = std::fs::remove_file(scratch);
    let o = std::process::Command::new("xorriso")
        .args(["-osirrox", "on", "-indev"])
        .arg(iso)
        .args(["-extract", "/boot/grub/grub.cfg"])
        .arg(scratch)
        .output()
        .map_err(|e| format!("xorriso: {e}"))?;
    let cfg = std::fs::read_to_string(scratch);
    let _ = std::fs::remove_file(scratch);
    if !o.status.success() {
        return Err("no /boot/grub/grub.cfg on the ISO".into());
    }
    let cfg = cfg.map_err(|e| e.to_string())?;
    let kernel = cfg
        .lines()
        .map(str::trim_start)
        .find(|l| l.starts_with("linux "))
        .ok_or("grub.cfg has no linux line")?;
    // Talos reads the parameter with strconv.ParseBool.
    let halts = kernel.split_whitespace().any(|w| {
        matches!(
            w.strip_prefix("talos.halt_if_installed="),
            Some("1" | "t" | "T" | "true" | "TRUE" | "True")
        )
    });
    let v = kernel
        .split_whitespace()
        .find_map(|w| w.strip_prefix("talos.environment=INSTALLER_META_BASE64="))
        .ok_or("the kernel line carries no META")?;
    let value = installer_meta_key(v, 10)?.ok_or("META has no key 10")?;
    let (ip, hostname) = key10_target(value.as_bytes())?;
    Ok((ip, hostname, halts))
}

/// One key's value in an `INSTALLER_META_BASE64` value.
fn installer_meta_key(v: &str, key: u8) -> Result<Option<String>, String> {
    use base64::Engine;
    let raw = base64::engine::general_purpose::STANDARD
        .decode(v)
        .map_err(|e| format!("META is not base64: {e}"))?;
    let text = if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = String::new();
        std::io::Read::read_to_string(&mut flate2::read::GzDecoder::new(&raw[..]), &mut out)
            .map_err(|e| format!("META is not gzip text: {e}"))?;
        out
    } else {
        String::from_utf8(raw).map_err(|_| "META is not text".to_owned())?
    };
    let want = format!("0x{key:x}");
    Ok(text
        .split(';')
        .find_map(|kv| kv.split_once('=').filter(|(k, _)| *k == want))
        .map(|(_, v)| v.to_owned()))
}

/// The first loopback address and the hostname in a key-10 value
/// (PlatformNetworkConfig as YAML or JSON).
fn key10_target(value: &[u8]) -> Result<(String, Option<String>), String> {
    let doc: Value = serde_yaml_ng::from_slice(value)
        .map_err(|e| format!("META key 10 is not YAML or JSON: {e}"))?;
    let ip = doc["addresses"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| a["address"].as_str())
        .filter_map(|a| a.split('/').next()?.parse::<std::net::IpAddr>().ok())
        .find(|ip| ip.is_loopback())
        .ok_or("META key 10 has no address in 127.0.0.0/8")?;
    let hostname = doc["hostnames"]
        .as_array()
        .into_iter()
        .flatten()
        .find_map(|h| h["hostname"].as_str())
        .map(str::to_owned);
    Ok((ip.to_string(), hostname))
}

/// Replacing or deleting a disk keeps its volume as the first free
/// `unusedN`, once, and only when the VM owns it (qemu-server
/// src/PVE/QemuServer.pm `vmconfig_register_unused_drive`, pve-guest-common
/// `add_unused_volume`): another VM's volume just leaves the config.
fn move_to_unused(config: &mut BTreeMap<String, String>, old: &str, vmid: u32) {
    let (file, _) = split_drive(old);
    if volume_owner(&file) != Some(vmid)
        || config
            .iter()
            .any(|(k, v)| k.starts_with("unused") && *v == file)
    {
        return;
    }
    let n = (0..)
        .find(|n| !config.contains_key(&format!("unused{n}")))
        .expect("a free unused slot");
    config.insert(format!("unused{n}"), file);
}

/// The VM a volume belongs to by its name (`vm-<vmid>-…`, `base-<vmid>-…`),
/// as pve-storage's `parse_volname` gives it; None for ISO, import and
/// other volumes no VM owns.
fn volume_owner(volid: &str) -> Option<u32> {
    let name = volid.split_once(':')?.1;
    let rest = name
        .strip_prefix("vm-")
        .or_else(|| name.strip_prefix("base-"))?;
    let (id, disk) = rest.split_once('-')?;
    (!disk.is_empty()).then_some(())?;
    id.parse().ok()
}

/// `add_random_macs`: a NIC without a MAC gets one (Proxmox's BC:24:11 prefix).
fn with_mac(net: &str, vmid: u32) -> String {
    let mut parts: Vec<String> = net.split(',').map(str::to_owned).collect();
    let models = ["virtio", "e1000", "rtl8139", "vmxnet3", "e1000e"];
    if let Some(first) = parts.first_mut()
        && models.contains(&first.as_str())
    {
        *first = format!(
            "{first}=BC:24:11:{:02X}:{:02X}:{:02X}",
            (vmid >> 16) as u8,
            (vmid >> 8) as u8,
            vmid as u8
        );
    }
    if let Some(i) = parts.iter().position(|p| p.starts_with("model=")) {
        let model = parts.remove(i)[6..].to_owned();
        let mac = parts
            .iter()
            .position(|p| p.starts_with("macaddr="))
            .map(|j| parts.remove(j)[8..].to_owned())
            .unwrap_or_else(|| {
                format!(
                    "BC:24:11:{:02X}:{:02X}:{:02X}",
                    (vmid >> 16) as u8,
                    (vmid >> 8) as u8,
                    vmid as u8
                )
            });
        parts.insert(0, format!("{model}={mac}"));
    }
    parts.join(",")
}

/// A stable UUID-shaped string for a VM's generated ids.
fn uuid_for(vmid: u32, salt: u8) -> String {
    let h = Sha256::digest([&vmid.to_be_bytes()[..], &[salt]].concat());
    let x: String = h.iter().take(16).map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &x[..8],
        &x[8..12],
        &x[12..16],
        &x[16..20],
        &x[20..32]
    )
}

/// `GET …/config`: each value typed as the config schema says, plus `digest`.
fn vm_config_json(vm: &Vm, with_pending: bool) -> Value {
    let mut config = vm.config.clone();
    if with_pending {
        config.extend(vm.pending.clone());
    }
    let Some(Ok(route)) = Schema::get().route("PUT", "/nodes/n/qemu/100/config") else {
        return json!(config);
    };
    let mut c = serde_json::Map::new();
    for (k, v) in &config {
        c.insert(k.clone(), schema::typed(route.method, k, v));
    }
    c.insert("digest".into(), json!(config_digest(&vm.config)));
    Value::Object(c)
}

/// `GET …/pending` (qemu-server `vm_pending`): every key with its current
/// value, and `pending` where a change waits for the next start.
fn vm_pending_json(vm: &Vm) -> Value {
    let keys: std::collections::BTreeSet<&String> =
        vm.config.keys().chain(vm.pending.keys()).collect();
    let list: Vec<Value> = keys
        .into_iter()
        .map(|k| {
            let mut e = json!({"key": k});
            if let Some(v) = vm.config.get(k) {
                e["value"] = json!(v);
            }
            if let Some(v) = vm.pending.get(k) {
                e["pending"] = json!(v);
            }
            e
        })
        .collect();
    json!(list)
}

/// Whether qemu-server changes `key` of a running VM now or leaves it
/// pending until the next start (src/PVE/QemuServer.pm
/// `vmconfig_hotplug_pending`, `$fast_plug_option`): the `hotplug`
/// features decide for NICs (`network`), disks (`disk`) and vCPUs
/// (`cpu`); memory needs `memory` there AND NUMA on
/// (`PVE::QemuServer::Memory::qemu_memory_hotplug` dies "NUMA needs to be
/// enabled for memory hotplug", the change stays pending); cores, sockets,
/// CPU type, NUMA, machine and firmware are never hot-plugged.
fn hot_pluggable(config: &BTreeMap<String, String>, key: &str) -> bool {
    let features = hotplug_features(config.get("hotplug").map_or("1", String::as_str));
    let has = |what: &str| features.contains(&what);
    match key {
        "memory" => has("memory") && config.get("numa").is_some_and(|n| n == "1"),
        "vcpus" => has("cpu"),
        "cores" | "sockets" | "cpu" | "numa" | "machine" | "bios" | "balloon" | "hotplug" => false,
        k if k.starts_with("net") => has("network"),
        k if is_drive(k) && !k.starts_with("ide") => has("disk"),
        _ => true,
    }
}

/// qemu-server `parse_hotplug_features` (PVE 8/9, src/PVE/QemuServer.pm):
/// `0` is none, `1` the schema default `network,disk,usb` (not every
/// feature), else the comma list as written. Unset is the default too.
fn hotplug_features(value: &str) -> Vec<&str> {
    match value {
        "0" => Vec::new(),
        "1" => vec!["network", "disk", "usb"],
        list => list
            .split([',', ';', ' '])
            .filter(|f| !f.is_empty())
            .collect(),
    }
}

fn config_digest(config: &BTreeMap<String, String>) -> String {
    let text: String = config.iter().map(|(k, v)| format!("{k}: {v}\n")).collect();
    Sha256::digest(text.as_bytes())
        .iter()
        .take(20)
        .map(|b| format!("{b:02x}"))
        .collect()
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

    const TOKEN: &str = "root@pam!t=secret";

    /// One request over an in-memory connection; the raw answer.
    async fn exchange(dir: &Path, request: String) -> String {
        let cli = Cli::parse_from([
            "sim",
            "--state-dir",
            dir.to_str().unwrap(),
            "--auth-delay-ms",
            "0",
            "--token",
            TOKEN,
        ]);
        let pve = Arc::new(Pve::new(cli.args).unwrap());
        let (mut client, server) = tokio::io::duplex(1 << 20);
        tokio::spawn(serve_connection(pve, server));
        client.write_all(request.as_bytes()).await.unwrap();
        let mut out = String::new();
        client.read_to_string(&mut out).await.unwrap();
        out
    }

    fn upload_request(extra_headers: &str, body: &str) -> String {
        format!(
            "POST /api2/json/nodes/pve/storage/local/upload HTTP/1.1\r\nHost: x\r\n\
             Authorization: PVEAPIToken={TOKEN}\r\nConnection: close\r\n\
             Content-Type: multipart/form-data; boundary=XyZ\r\n{extra_headers}\r\n{body}"
        )
    }

    #[tokio::test]
    async fn a_chunked_upload_is_refused_as_pveproxy_does() {
        let dir = tempfile::tempdir().unwrap();
        let body = "--XyZ\r\nContent-Disposition: form-data; name=\"content\"\r\n\r\nimport\r\n--XyZ--\r\n";
        let req = upload_request(
            "Transfer-Encoding: chunked\r\n",
            &format!("{:x}\r\n{body}\r\n0\r\n\r\n", body.len()),
        );
        let out = exchange(dir.path(), req).await;
        assert!(
            out.starts_with("HTTP/1.1 501 chunked transfer encoding not supported\r\n"),
            "{out}"
        );
    }

    #[tokio::test]
    async fn an_upload_without_content_length_misses_its_parameters() {
        let dir = tempfile::tempdir().unwrap();
        let out = exchange(dir.path(), upload_request("", "")).await;
        assert!(
            out.starts_with("HTTP/1.1 400 Parameter verification failed."),
            "{out}"
        );
        let body: Value = serde_json::from_str(out.split("\r\n\r\n").nth(1).unwrap()).unwrap();
        let missing = "property is missing and it is not optional";
        assert_eq!(body["errors"]["content"], missing);
        assert_eq!(body["errors"]["filename"], missing);
    }

    #[tokio::test]
    async fn another_token_is_refused_without_echoing_it() {
        let dir = tempfile::tempdir().unwrap();
        let req = "GET /api2/json/version HTTP/1.1\r\nAuthorization: PVEAPIToken=root@pam!t=guess\r\n\
                   Connection: close\r\n\r\n";
        let out = exchange(dir.path(), req.into()).await;
        assert!(
            out.starts_with("HTTP/1.1 401 authentication failure\r\n"),
            "{out}"
        );
        assert!(!out.contains("guess"));
    }

    #[test]
    fn sizes_print_and_parse_as_pve_does() {
        assert_eq!(format_size(20 << 30), "20G");
        assert_eq!(format_size(32 << 20), "32M");
        assert_eq!(format_size(4453302272), "4247M");
        assert_eq!(format_size(1000), "1000");
        assert_eq!(parse_size("+1G"), Some((true, 1 << 30)));
        assert_eq!(parse_size("20G"), Some((false, 20 << 30)));
        assert_eq!(parse_size("G"), None);
    }

    #[test]
    fn drives_print_with_sorted_options() {
        let (file, opts) =
            split_drive("local-lvm:0,ssd=1,import-from=local:import/a.raw,discard=on");
        assert_eq!(file, "local-lvm:0");
        let opts: Vec<_> = opts
            .into_iter()
            .filter(|(k, _)| k != "import-from")
            .collect();
        assert_eq!(
            print_drive("local-lvm:vm-301-disk-1", opts),
            "local-lvm:vm-301-disk-1,discard=on,ssd=1"
        );
        assert!(
            is_drive("scsi0") && is_drive("efidisk0") && !is_drive("scsihw") && !is_drive("net0")
        );
    }

    #[test]
    fn volumes_belong_to_the_vm_their_name_gives() {
        assert_eq!(volume_owner("local-lvm:vm-301-disk-1"), Some(301));
        assert_eq!(volume_owner("local-lvm:base-9000-disk-0"), Some(9000));
        assert_eq!(volume_owner("local:import/lab-cp-01.raw"), None);
        assert_eq!(volume_owner("local-lvm:vm-301-"), None);
        assert_eq!(volume_owner("vm-301-disk-1"), None);
    }

    #[test]
    fn a_nic_without_a_mac_gets_one() {
        assert_eq!(
            with_mac("virtio,bridge=vmbr0", 301),
            "virtio=BC:24:11:00:01:2D,bridge=vmbr0"
        );
        assert_eq!(
            with_mac("virtio=BC:24:11:00:00:11,bridge=vmbr0", 301),
            "virtio=BC:24:11:00:00:11,bridge=vmbr0"
        );
    }

    #[test]
    fn the_boot_disk_follows_the_boot_order() {
        let config = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let c = config(&[
            ("boot", "order=ide2;virtio1;net0"),
            ("ide2", "local:iso/x.iso,media=cdrom"),
            ("scsi0", "local-lvm:vm-1-disk-0,size=1G"),
            ("virtio1", "local-lvm:vm-1-disk-1,size=1G"),
        ]);
        assert_eq!(
            boot_drives(&c),
            [
                ("local:iso/x.iso".to_owned(), true),
                ("local-lvm:vm-1-disk-1".to_owned(), false)
            ]
        );
        let c = config(&[
            ("boot", "order=scsi0;ide2"),
            ("ide2", "none,media=cdrom"),
            ("scsi0", "local-lvm:vm-1-disk-1,size=1G"),
        ]);
        assert_eq!(
            boot_drives(&c),
            [("local-lvm:vm-1-disk-1".to_owned(), false)]
        );
        let c = config(&[("virtio0", "local-lvm:vm-1-disk-2,size=1G")]);
        assert_eq!(
            boot_drives(&c),
            [("local-lvm:vm-1-disk-2".to_owned(), false)]
        );
        assert!(boot_drives(&config(&[])).is_empty());
    }

    #[test]
    fn a_blank_disk_is_skipped_and_one_with_a_boot_sector_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("d.raw");
        let f = std::fs::File::create(&p).unwrap();
        f.set_len(4 << 20).unwrap();
        assert!(is_blank(&p));
        let mut b = vec![0u8; 512];
        b[510] = 0x55;
        b[511] = 0xaa;
        std::os::unix::fs::FileExt::write_all_at(&f, &b, 0).unwrap();
        assert!(!is_blank(&p));
    }

    #[test]
    fn installer_meta_is_read_plain_and_gzipped() {
        use base64::Engine;
        let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
        // Talos' own vector (pkg/machinery/meta): 0xa=foo.
        assert_eq!(
            installer_meta_key("MHhhPWZvbw==", 10).unwrap().as_deref(),
            Some("foo")
        );
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        std::io::Write::write_all(&mut gz, b"0xc=x;0xa=bar").unwrap();
        let v = b64(&gz.finish().unwrap());
        assert_eq!(installer_meta_key(&v, 10).unwrap().as_deref(), Some("bar"));
        assert_eq!(installer_meta_key(&v, 11).unwrap(), None);
        assert!(installer_meta_key("%%", 10).is_err());
    }

    #[test]
    fn key_10_gives_its_first_loopback_address_and_hostname() {
        let yaml = b"addresses:\n  - address: 10.0.0.11/16\n    linkName: eth0\n  - address: 127.0.0.11/8\n    linkName: lo\nhostnames:\n  - hostname: cp-01\n    layer: platform\n";
        assert_eq!(
            key10_target(yaml).unwrap(),
            ("127.0.0.11".to_owned(), Some("cp-01".to_owned()))
        );
        let json = br#"{"addresses": [{"address": "127.0.0.12/8"}]}"#;
        assert_eq!(key10_target(json).unwrap(), ("127.0.0.12".to_owned(), None));
        let outside = b"addresses:\n  - address: 10.0.0.11/16\n";
        assert_eq!(
            key10_target(outside).unwrap_err(),
            "META key 10 has no address in 127.0.0.0/8"
        );
        assert!(key10_target(b"addresses: [").is_err());
    }
}
