//! etcd's data, snapshots and disaster recovery, as Talos v1.9–v1.14 serve
//! them (siderolabs/talos `internal/app/machined/internal/server/v1alpha1/
//! v1alpha1_server.go` EtcdSnapshot, EtcdRecover and Bootstrap;
//! `internal/app/machined/pkg/system/services/etcd.go` recoverFromSnapshot;
//! the behaviour is the same in every version modelled, v1.12 and v1.13 only
//! moved the control-plane check into `machinehelper.CheckControlplane`).
//!
//! - `EtcdSnapshot` (control planes only, else Unimplemented "etcd snapshot is
//!   only available on control plane nodes"; etcd must run, else the local
//!   client fails) streams what etcd's maintenance Snapshot sends: a bolt
//!   database (go.etcd.io/bbolt `page.go`, `db.go`: two meta pages with magic
//!   0xED0CDAED, version 2 and their FNV-64a checksum, a freelist page, leaf
//!   pages) holding the keyspace, with its SHA-256 appended (etcd
//!   `server/etcdserver/api/v3rpc/maintenance.go`), in 4 KiB messages.
//!   Built here from the keyspace: the same data gives the same bytes.
//! - `EtcdRecover` (control planes only) stores the upload as
//!   `/var/lib/etcd.snapshot`, whatever etcd is doing: Talos checks nothing
//!   else; a failed upload leaves nothing.
//! - `Bootstrap{recover_etcd}` passes the checks every Bootstrap does (an
//!   etcd with data answers AlreadyExists "etcd data directory is not
//!   empty"), then etcd's pre-start restores the upload: a missing upload or
//!   a hash that does not match (etcdutl `v3_snapshot.go`) leaves etcd failed
//!   and never healthy — the call itself has answered already. Restored,
//!   the keyspace is the snapshot's and this node the only member; the
//!   other control planes join it as after any bootstrap.
//!
//! Control server:
//! - `POST /_sim/etcd` `{"put"?: {KEY: VALUE}, "wipe"?: true}`: writes keys
//!   (409 while etcd is not bootstrapped), or wipes every control plane's etcd
//!   (as `talosctl reset --system-labels-to-wipe EPHEMERAL` on each, nodes
//!   staying configured: etcd Preparing, no data, no member).
//! - `GET /_sim/etcd` → `{"bootstrapped","keys":{…},"revision","snapshots":[{"seq",
//!   "node","ms","size","upgrade_calls_before"}],"uploads":{NODE:size},
//!   "recoveries":[{"node","ms","keys"}],"failures":[{"node","ms","error"}]}`;
//!   `upgrade_calls_before` counts the Upgrade calls every node had received
//!   when the snapshot was asked for. Also `"failed": {NODE: error}` (etcd
//!   Failed after a restore that failed: the service shows state Failed,
//!   as Talos's does when etcd's pre-start fails, never Preparing), and
//!   `"real"`; with `--real-etcd` (`node/etcd_real.rs`) the keys, revision,
//!   snapshots and restores are the real members' and `"members": {NAME:
//!   {"client","running","healthy","startup_ms":[…]}}` lists them.
//! - `--misbehave` modes on a node's EtcdSnapshot: `etcd-snapshot-truncated`
//!   (half the bytes, then a clean end), `etcd-snapshot-endless` (never
//!   ends), `etcd-snapshot-trickle` (16 bytes every 200 ms, for ever),
//!   `etcd-snapshot-stall` (one message, then nothing).

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use futures_util::StreamExt;
use serde_json::{Value, json};
use sha2::Digest;
use tonic::{Request, Response, Status, Streaming};

use super::service::{Api, DataStream};
use super::state::{Cluster, ControlReply, control_error};
use imgbuild::talos::api::common::Data;
use imgbuild::talos::api::machine::{EtcdRecover, EtcdRecoverResponse, EtcdSnapshotRequest};

/// Talos's chunker sends what it reads in pieces of this size.
const MESSAGE: usize = 4096;
const PAGE: usize = 4096;
/// A real database is never tiny: Kubernetes' objects fill megabytes.
const MIN_PAGES: usize = 16;
/// What etcd refuses to restore past (and a bound on this simulator's memory).
const UPLOAD_LIMIT: usize = 64 << 20;

impl Cluster {
    /// Why node `i`'s etcd failed, if it did.
    pub(crate) fn etcd_failed(&self, i: usize) -> Option<String> {
        self.etcd.lock().unwrap().failed.get(&i).cloned()
    }
}

/// bbolt's meta checksum: Go's `hash/fnv` New64a.
fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 14695981039346656037;
    for b in bytes {
        h ^= *b as u64;
        h = h.wrapping_mul(1099511628211);
    }
    h
}

fn meta_page(id: u64, txid: u64, pages: u64) -> Vec<u8> {
    let mut p = vec![0u8; PAGE];
    p[0..8].copy_from_slice(&id.to_le_bytes());
    p[8..10].copy_from_slice(&0x04u16.to_le_bytes()); // metaPageFlag
    let mut meta = Vec::with_capacity(64);
    meta.extend(0xED0C_DAEDu32.to_le_bytes()); // magic
    meta.extend(2u32.to_le_bytes()); // version
    meta.extend((PAGE as u32).to_le_bytes());
    meta.extend(0u32.to_le_bytes()); // flags
    meta.extend(3u64.to_le_bytes()); // root bucket page
    meta.extend(0u64.to_le_bytes()); // root sequence
    meta.extend(2u64.to_le_bytes()); // freelist page
    meta.extend(pages.to_le_bytes()); // high water mark
    meta.extend(txid.to_le_bytes());
    let sum = fnv1a64(&meta);
    meta.extend(sum.to_le_bytes());
    p[16..16 + meta.len()].copy_from_slice(&meta);
    p
}

/// The snapshot of `keys` at `revision`: the database, then its SHA-256.
fn snapshot_of(keys: &BTreeMap<String, String>, revision: u64) -> Vec<u8> {
    let mut records = Vec::new();
    for (k, v) in keys {
        records.extend((k.len() as u32).to_le_bytes());
        records.extend((v.len() as u32).to_le_bytes());
        records.extend(k.as_bytes());
        records.extend(v.as_bytes());
    }
    let leaf_room = PAGE - 16;
    let leaves = records.len().div_ceil(leaf_room).max(1);
    let pages = (3 + leaves).max(MIN_PAGES);
    let txid = revision.max(1);
    let mut db = meta_page(0, txid, pages as u64);
    db.extend(meta_page(1, txid - 1, pages as u64));
    let mut freelist = vec![0u8; PAGE];
    freelist[0..8].copy_from_slice(&2u64.to_le_bytes());
    freelist[8..10].copy_from_slice(&0x10u16.to_le_bytes());
    db.extend(freelist);
    // Leaf pages: header (id, leafPageFlag, count of keys, overflow), then
    // the records; the first leaf's count is the number of keys.
    let parts: Vec<&[u8]> = if records.is_empty() {
        // An empty keyspace still has its root leaf.
        vec![&[]]
    } else {
        records.chunks(leaf_room).collect()
    };
    for part in parts {
        let mut page = vec![0u8; PAGE];
        page[0..8].copy_from_slice(&((db.len() / PAGE) as u64).to_le_bytes());
        page[8..10].copy_from_slice(&0x02u16.to_le_bytes());
        page[10..12].copy_from_slice(&(keys.len() as u16).to_le_bytes());
        page[12..16].copy_from_slice(&(part.len() as u32).to_le_bytes());
        page[16..16 + part.len()].copy_from_slice(part);
        db.extend(page);
    }
    db.resize(pages * PAGE, 0);
    let hash = sha2::Sha256::digest(&db);
    db.extend_from_slice(&hash);
    db
}

/// What etcd's restore does with an upload: checks the appended hash
/// (etcdutl `v3_snapshot.go`), then opens the database. The keyspace and
/// revision, or the error etcd's service fails with.
fn restore(upload: &[u8]) -> Result<(BTreeMap<String, String>, u64), String> {
    let size = upload.len();
    if size % 512 != 32 {
        return Err(
            "error recovering from the snapshot: snapshot missing hash but --skip-hash-check=false"
                .into(),
        );
    }
    let (db, hash) = upload.split_at(size - 32);
    if sha2::Sha256::digest(db).as_slice() != hash {
        return Err(
            "error recovering from the snapshot: expected sha256 does not match the database"
                .into(),
        );
    }
    let bad = || "error verifying snapshot: invalid database".to_owned();
    let meta = db.get(16..80).ok_or_else(bad)?;
    let u64_at = |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
    if meta[0..4] != 0xED0C_DAEDu32.to_le_bytes() || fnv1a64(&meta[..56]) != u64_at(meta, 56) {
        return Err(bad());
    }
    let revision = u64_at(meta, 48);
    let mut records = Vec::new();
    let mut count = None;
    for page in db.chunks(PAGE).skip(3) {
        if page.len() < 16 || page[8..10] != 0x02u16.to_le_bytes() {
            break;
        }
        count.get_or_insert(u16::from_le_bytes([page[10], page[11]]) as usize);
        let len = u32::from_le_bytes(page[12..16].try_into().unwrap()) as usize;
        records.extend_from_slice(page.get(16..16 + len).ok_or_else(bad)?);
    }
    let mut keys = BTreeMap::new();
    let mut at = 0;
    while at < records.len() {
        let field = |from: usize| -> Result<usize, String> {
            Ok(u32::from_le_bytes(
                records
                    .get(from..from + 4)
                    .ok_or_else(bad)?
                    .try_into()
                    .unwrap(),
            ) as usize)
        };
        let (kl, vl) = (field(at)?, field(at + 4)?);
        let k = records.get(at + 8..at + 8 + kl).ok_or_else(bad)?;
        let v = records.get(at + 8 + kl..at + 8 + kl + vl).ok_or_else(bad)?;
        keys.insert(
            String::from_utf8_lossy(k).into_owned(),
            String::from_utf8_lossy(v).into_owned(),
        );
        at += 8 + kl + vl;
    }
    if count != Some(keys.len()) {
        return Err(bad());
    }
    Ok((keys, revision))
}

impl Api {
    /// The node a streaming etcd call is for: its own, or one proxied
    /// one-to-one (talosctl sends these to one node only).
    fn etcd_target<T>(&self, req: &Request<T>) -> Result<usize, Status> {
        match self.route(req)? {
            super::service::Route::Local => Ok(self.me),
            super::service::Route::One2One(target) => self.backend(&target),
            super::service::Route::One2Many(_) => Err(Status::invalid_argument(
                "this call is proxied to one node only",
            )),
        }
    }

    pub(crate) fn etcd_snapshot_call(
        &self,
        req: Request<EtcdSnapshotRequest>,
    ) -> Result<Response<DataStream>, Status> {
        let i = self.etcd_target(&req)?;
        self.control_plane_only(i, "etcd snapshot")?;
        if !super::state::reached(self.cluster.etcd_start(i), std::time::Instant::now()) {
            return Err(Status::unknown(
                "failed reading etcd snapshot: etcd is not running on this node",
            ));
        }
        let upgrade_calls: u32 = self
            .cluster
            .all()
            .iter()
            .map(|n| n.st.lock().unwrap().day2.upgrade_calls)
            .sum();
        let real = match &self.cluster.real_etcd {
            Some(r) => Some(
                r.snapshot(&self.cluster, i)
                    .map_err(|e| Status::unknown(format!("failed reading etcd snapshot: {e}")))?,
            ),
            None => None,
        };
        let bytes = {
            let mut etcd = self.cluster.etcd.lock().unwrap();
            let bytes = real.unwrap_or_else(|| snapshot_of(&etcd.keys, etcd.revision));
            let seq = etcd.snapshots.len() + 1;
            etcd.snapshots.push(json!({
                "seq": seq,
                "node": self.cluster.node(i).display_name(),
                "ms": self.cluster.now_ms(),
                "size": bytes.len(),
                "upgrade_calls_before": upgrade_calls,
            }));
            bytes
        };
        let node = self.cluster.node(i);
        let chunks: Vec<Data> = bytes
            .chunks(MESSAGE)
            .map(|c| Data {
                metadata: None,
                bytes: c.to_vec(),
            })
            .collect();
        let stream: DataStream = if node.has("etcd-snapshot-truncated") {
            let half = chunks.len() / 2;
            Box::pin(futures_util::stream::iter(
                chunks.into_iter().take(half).map(Ok),
            ))
        } else if node.has("etcd-snapshot-endless") {
            let junk = Data {
                metadata: None,
                bytes: vec![0x5a; 1 << 16],
            };
            Box::pin(futures_util::stream::repeat_with(move || Ok(junk.clone())))
        } else if node.has("etcd-snapshot-trickle") {
            // A message well inside any call timeout, for ever.
            let junk = Data {
                metadata: None,
                bytes: vec![0x5a; 16],
            };
            Box::pin(futures_util::stream::unfold(junk, |junk| async move {
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                Some((Ok(junk.clone()), junk))
            }))
        } else if node.has("etcd-snapshot-stall") {
            let first = chunks.into_iter().take(1).map(Ok);
            Box::pin(futures_util::stream::iter(first).chain(futures_util::stream::pending()))
        } else {
            Box::pin(futures_util::stream::iter(chunks.into_iter().map(Ok)))
        };
        Ok(Response::new(stream))
    }

    pub(crate) async fn etcd_recover_call(
        &self,
        req: Request<Streaming<Data>>,
    ) -> Result<Response<EtcdRecoverResponse>, Status> {
        let i = self.etcd_target(&req)?;
        self.control_plane_only(i, "etcd recover")?;
        let mut stream = req.into_inner();
        let mut upload = Vec::new();
        while let Some(chunk) = stream.message().await? {
            if upload.len() + chunk.bytes.len() > UPLOAD_LIMIT {
                return Err(Status::resource_exhausted(
                    "error writing snapshot: too large",
                ));
            }
            upload.extend_from_slice(&chunk.bytes);
        }
        self.cluster.etcd.lock().unwrap().uploads.insert(i, upload);
        Ok(Response::new(EtcdRecoverResponse {
            messages: vec![EtcdRecover { metadata: None }],
        }))
    }

    /// etcd's pre-start on a recovery bootstrap of node `i`: restores the
    /// upload. Err: etcd fails to start (recorded; the Bootstrap call has
    /// answered already).
    pub(crate) fn restore_on(&self, i: usize) -> Result<(), String> {
        let name = self.cluster.node(i).display_name();
        let ms = self.cluster.now_ms();
        let upload = self.cluster.etcd.lock().unwrap().uploads.remove(&i);
        let missing =
            "error verifying snapshot: open /var/lib/etcd.snapshot: no such file or directory";
        let restored = match (upload, &self.cluster.real_etcd) {
            (None, _) => Err(missing.to_owned()),
            // etcd's own restore into the node's data dir; the keyspace
            // stays etcd's.
            (Some(upload), Some(real)) => real
                .restore(&self.cluster, i, &upload)
                .map(|n| (None, n as usize)),
            (Some(upload), None) => restore(&upload).map(|(k, r)| {
                let n = k.len();
                (Some((k, r)), n)
            }),
        };
        let mut etcd = self.cluster.etcd.lock().unwrap();
        match restored {
            Ok((model, keys)) => {
                etcd.recoveries
                    .push(json!({"node": name, "ms": ms, "keys": keys}));
                if let Some((keys, revision)) = model {
                    etcd.keys = keys;
                    etcd.revision = revision;
                }
                etcd.failed.remove(&i);
                Ok(())
            }
            Err(error) => {
                etcd.failures
                    .push(json!({"node": name, "ms": ms, "error": error}));
                etcd.failed.insert(i, error.clone());
                Err(error)
            }
        }
    }
}

/// `POST /_sim/etcd`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct EtcdControl {
    #[serde(default)]
    put: BTreeMap<String, String>,
    #[serde(default)]
    wipe: bool,
}

pub(crate) async fn control(
    State(cluster): State<Arc<Cluster>>,
    axum::Json(req): axum::Json<EtcdControl>,
) -> ControlReply {
    if req.wipe {
        *cluster.boot.lock().unwrap() = None;
        if let Some(real) = &cluster.real_etcd {
            for i in 0..cluster.count() {
                real.wipe(i);
            }
        }
        let mut etcd = cluster.etcd.lock().unwrap();
        etcd.keys.clear();
        etcd.revision = 0;
        etcd.failed.clear();
        return (StatusCode::OK, axum::Json(json!({"wiped": true})));
    }
    if cluster.boot.lock().unwrap().is_none() {
        return control_error(
            StatusCode::CONFLICT,
            "etcd is not bootstrapped: nothing to write to".into(),
        );
    }
    if let Some(real) = &cluster.real_etcd {
        for (k, v) in &req.put {
            if let Err(e) = real.put(k, v) {
                return control_error(StatusCode::CONFLICT, e);
            }
        }
        let revision = real.keys().map(|(_, r)| r).unwrap_or(0);
        return (StatusCode::OK, axum::Json(json!({"revision": revision})));
    }
    let mut etcd = cluster.etcd.lock().unwrap();
    for (k, v) in req.put {
        etcd.keys.insert(k, v);
        etcd.revision += 1;
    }
    (
        StatusCode::OK,
        axum::Json(json!({"revision": etcd.revision})),
    )
}

pub(crate) async fn show(State(cluster): State<Arc<Cluster>>) -> axum::Json<Value> {
    let bootstrapped = cluster.boot.lock().unwrap().is_some();
    // With real members, the keyspace is what a healthy one answers.
    let real = cluster
        .real_etcd
        .as_ref()
        .map(|r| (r.keys().unwrap_or_default(), r.members_json()));
    let etcd = cluster.etcd.lock().unwrap();
    let failed: serde_json::Map<String, Value> = etcd
        .failed
        .iter()
        .map(|(i, e)| (cluster.node(*i).display_name(), json!(e)))
        .collect();
    let uploads: serde_json::Map<String, Value> = etcd
        .uploads
        .iter()
        .map(|(i, u)| (cluster.node(*i).display_name(), json!(u.len())))
        .collect();
    let (keys, revision, startup) = match real {
        Some(((keys, revision), startup)) => (json!(keys), revision, startup),
        None => (json!(etcd.keys), etcd.revision, Value::Null),
    };
    axum::Json(json!({
        "bootstrapped": bootstrapped,
        "real": cluster.real_etcd.is_some(),
        "members": startup,
        "failed": failed,
        "keys": keys,
        "revision": revision,
        "snapshots": etcd.snapshots,
        "uploads": uploads,
        "recoveries": etcd.recoveries,
        "failures": etcd.failures,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: super::super::state::Args,
    }

    #[test]
    fn v1_11_a_restore_that_fails_shows_etcd_failed_not_preparing() {
        use clap::Parser;
        let argv = [
            "sim",
            "--talos-version",
            "v1.11.5",
            "--node",
            "cp-01=127.0.0.11:controlplane",
        ];
        let cluster = super::super::state::new_cluster(Cli::parse_from(argv).args).unwrap();
        let then = std::time::Instant::now() - std::time::Duration::from_secs(10);
        cluster.node(0).st.lock().unwrap().configured_at = Some(then);
        let api = Api {
            cluster,
            me: 0,
            secure: true,
        };
        let etcd_state = |api: &Api| {
            let list = api.services_on(0);
            let s = list.services.iter().find(|s| s.id == "etcd").unwrap();
            (s.state.clone(), s.health.clone().unwrap().last_message)
        };
        assert_eq!(etcd_state(&api).0, "Preparing");
        // An upload with no hash: etcd's pre-start fails, Bootstrap has
        // answered already.
        api.cluster
            .etcd
            .lock()
            .unwrap()
            .uploads
            .insert(0, b"not a snapshot".to_vec());
        api.bootstrap_on(0, true).unwrap();
        let (state, message) = etcd_state(&api);
        assert_eq!(state, "Failed");
        assert!(message.contains("missing hash"), "{message}");
    }

    #[test]
    fn a_snapshot_restores_to_its_keys_and_a_flipped_byte_does_not() {
        let mut keys = BTreeMap::new();
        keys.insert("/registry/marker".to_owned(), "x".repeat(5000));
        keys.insert("/a".to_owned(), "b".to_owned());
        let snap = snapshot_of(&keys, 9);
        assert_eq!(snap.len() % 512, 32);
        assert_eq!(snap, snapshot_of(&keys, 9), "deterministic");
        assert_eq!(restore(&snap), Ok((keys, 9)));
        let mut bad = snap.clone();
        bad[3 * PAGE + 20] ^= 1;
        assert!(restore(&bad).unwrap_err().contains("sha256"));
        assert!(
            restore(&snap[..snap.len() - 1])
                .unwrap_err()
                .contains("missing hash")
        );
    }
}
