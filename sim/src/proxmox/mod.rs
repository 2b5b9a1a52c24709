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
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;

use self::schema::Schema;

mod config;
/// Deleting VMs and listing them cluster-wide (its own contract).
mod destroy;
mod dispatch;
mod download;
mod http;
mod power;
mod schema;
mod secureboot;
mod state;
mod storage;
mod tasks;
mod upload;
mod vms;

use self::http::*;
pub use self::state::Args;
use self::state::*;
use self::storage::*;

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

#[cfg(test)]
mod tests;
