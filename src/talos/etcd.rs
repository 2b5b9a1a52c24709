//! etcd snapshots and recovery. Before a run first changes a control plane
//! (an upgrade, a reboot-needing apply, a removal) it saves etcd's snapshot
//! into the state dir ([`snapshot_before_change`]); `imgbuild etcd snapshot`
//! takes one on demand ([`snapshot`]); `bootstrap --recover-from` brings a
//! wiped cluster back from one ([`recover`]).
//!
//! A snapshot is what etcd's maintenance `Snapshot` streams through Talos
//! (siderolabs/talos `v1alpha1_server.go` EtcdSnapshot): the bolt database
//! with its SHA-256 appended, so its size modulo 512 is 32. talosctl checks
//! that size after saving (`cmd/talosctl/cmd/talos/etcd.go`), then opens the
//! database; etcd's restore checks the hash (`etcdutl/snapshot/v3_snapshot.go`,
//! `hasHash := (off % 512) == sha256.Size`). imgbuild checks all three as the
//! bytes arrive — the size, the hash, and the bolt meta page at its start
//! (go.etcd.io/bbolt `page.go`, `db.go`: magic 0xED0CDAED, version 2,
//! FNV-64a checksum) — so a file it keeps is one etcd restores.

use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sha2::Digest;

use super::api::common::Data;
use super::bootstrap::{Options, Plan, PlannedNode};
use super::client::{ApiError, Mode, NodeClient};
use crate::atomic::AtomicFile;
use crate::inventory::Role;

/// Snapshots kept in the state dir unless told otherwise.
pub const DEFAULT_KEEP: usize = 5;

/// The largest snapshot taken unless told otherwise: etcd's largest
/// recommended backend quota (`--quota-backend-bytes`, 8 GiB).
pub const DEFAULT_MAX_SIZE: u64 = 8 << 30;

/// The state dir's directory of snapshots.
pub const SNAPSHOT_DIR: &str = "etcd";

/// What a snapshot file is named with, and its record beside it.
const SUFFIX: &str = ".snapshot";
const RECORD_SUFFIX: &str = ".sha256";

/// How much of a snapshot one upload message carries.
const UPLOAD_CHUNK: usize = 64 << 10;

/// The bolt meta page: a 16-byte page header (id u64, flags u16, count u16,
/// overflow u32), then magic u32, version u32, page size u32, flags u32,
/// root bucket (u64, u64), freelist u64, pgid u64, txid u64 and the FNV-64a
/// of the 56 meta bytes before it.
const BOLT_MAGIC: u32 = 0xED0C_DAED;
const BOLT_VERSION: u32 = 2;
const BOLT_META_FLAG: u16 = 0x04;
const META_AT: usize = 16;
const META_SUMMED: usize = 56;
const HEAD: usize = META_AT + META_SUMMED + 8;

/// Why a byte stream is not a whole etcd snapshot.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    #[error("it is empty")]
    Empty,
    #[error(
        "sha256 checksum not found (size {size}: a snapshot is a bolt database of whole 512-byte blocks with its 32-byte SHA-256 appended)"
    )]
    NoChecksum { size: u64 },
    #[error("its database hashes to {found}, but the snapshot carries {expected}")]
    ChecksumMismatch { expected: String, found: String },
    #[error("it does not start with a bolt meta page: {0}")]
    NotBolt(String),
}

/// Why a snapshot or a recovery did not happen.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    #[error("no control plane to take the etcd snapshot from: {}", .0.join("; "))]
    NoHealthyControlPlane(Vec<String>),
    #[error("node {node}: etcd snapshot: {source}")]
    Api { node: String, source: ApiError },
    #[error(
        "node {node}: the etcd snapshot stream sent nothing for {timeout:?} after {received} bytes: gave up (nothing kept)"
    )]
    Stalled {
        node: String,
        timeout: Duration,
        received: u64,
    },
    #[error(
        "node {node}: the etcd snapshot is larger than {limit} bytes: stopped (nothing kept; a larger database needs a larger --max-size)"
    )]
    TooLarge { node: String, limit: u64 },
    #[error("node {node}: the etcd snapshot did not finish within {timeout:?} (nothing kept)")]
    TimedOut { node: String, timeout: Duration },
    #[error("{}: not a whole etcd snapshot: {problem}", path.display())]
    Invalid { path: PathBuf, problem: FormatError },
    #[error("node {node}: the etcd snapshot it sent is not whole: {problem} (nothing kept)")]
    Incomplete { node: String, problem: FormatError },
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
    #[error("cannot start the async runtime: {0}")]
    Runtime(String),
}

fn io_at(path: &Path) -> impl FnOnce(io::Error) -> EtcdError + '_ {
    move |source| EtcdError::Io {
        path: path.to_owned(),
        source,
    }
}

/// What a whole snapshot holds, read from its bytes.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotInfo {
    /// Bytes, the appended hash included.
    pub size: u64,
    /// SHA-256 of the whole file (what the `.sha256` record holds).
    pub sha256: String,
    /// The bolt database's page size and last transaction.
    pub page_size: u32,
    pub txid: u64,
}

/// Checks a snapshot as its bytes go by, holding only its first page's
/// meta and its last 32 bytes.
pub struct Verifier {
    head: Vec<u8>,
    tail: Vec<u8>,
    db: sha2::Sha256,
    file: sha2::Sha256,
    size: u64,
}

impl Default for Verifier {
    fn default() -> Self {
        Verifier {
            head: Vec::with_capacity(HEAD),
            tail: Vec::with_capacity(2 * sha2::Sha256::output_size()),
            db: sha2::Sha256::new(),
            file: sha2::Sha256::new(),
            size: 0,
        }
    }
}

impl Verifier {
    /// Bytes so far.
    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn update(&mut self, bytes: &[u8]) {
        const HASH: usize = 32;
        self.size += bytes.len() as u64;
        self.file.update(bytes);
        let room = HEAD.saturating_sub(self.head.len()).min(bytes.len());
        self.head.extend_from_slice(&bytes[..room]);
        // Everything but the last 32 bytes seen is database.
        if bytes.len() >= HASH {
            self.db.update(&self.tail);
            self.db.update(&bytes[..bytes.len() - HASH]);
            self.tail.clear();
            self.tail.extend_from_slice(&bytes[bytes.len() - HASH..]);
        } else {
            self.tail.extend_from_slice(bytes);
            let extra = self.tail.len().saturating_sub(HASH);
            self.db.update(&self.tail[..extra]);
            self.tail.drain(..extra);
        }
    }

    /// The verdict on everything seen.
    pub fn finish(self) -> Result<SnapshotInfo, FormatError> {
        if self.size == 0 {
            return Err(FormatError::Empty);
        }
        if self.size % 512 != 32 {
            return Err(FormatError::NoChecksum { size: self.size });
        }
        let found = hex::encode(self.db.finalize());
        let expected = hex::encode(&self.tail);
        if found != expected {
            return Err(FormatError::ChecksumMismatch { expected, found });
        }
        let (page_size, txid) = bolt_meta(&self.head)?;
        Ok(SnapshotInfo {
            size: self.size,
            sha256: hex::encode(self.file.finalize()),
            page_size,
            txid,
        })
    }
}

/// The page size and txid of the bolt meta page `head` starts with. Bolt
/// writes two meta pages and a snapshot writes both fresh, so the first
/// must be valid.
fn bolt_meta(head: &[u8]) -> Result<(u32, u64), FormatError> {
    let bad = |why: &str| Err(FormatError::NotBolt(why.to_owned()));
    if head.len() < HEAD {
        return bad("shorter than a meta page");
    }
    let u16_at = |at: usize| u16::from_le_bytes([head[at], head[at + 1]]);
    let u32_at = |at: usize| u32::from_le_bytes(head[at..at + 4].try_into().expect("4 bytes"));
    let u64_at = |at: usize| u64::from_le_bytes(head[at..at + 8].try_into().expect("8 bytes"));
    if u16_at(8) & BOLT_META_FLAG == 0 {
        return bad("page 0 is not flagged as meta");
    }
    if u32_at(META_AT) != BOLT_MAGIC {
        return bad("no bolt magic");
    }
    if u32_at(META_AT + 4) != BOLT_VERSION {
        return bad("not bolt format version 2");
    }
    if fnv64a(&head[META_AT..META_AT + META_SUMMED]) != u64_at(META_AT + META_SUMMED) {
        return bad("its meta checksum does not match");
    }
    Ok((u32_at(META_AT + 8), u64_at(META_AT + 48)))
}

/// FNV-1a, 64 bits (Go's `hash/fnv` New64a, which bolt sums its meta with).
fn fnv64a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Checks a snapshot file, reading it once (streamed).
pub fn verify_file(path: &Path) -> Result<SnapshotInfo, EtcdError> {
    let mut file = crate::io::open_regular(path, false).map_err(io_at(path))?;
    let mut v = Verifier::default();
    let mut buf = vec![0; crate::io::BUF_SIZE];
    loop {
        let n = io::Read::read(&mut file, &mut buf).map_err(io_at(path))?;
        if n == 0 {
            break;
        }
        v.update(&buf[..n]);
    }
    v.finish().map_err(|problem| EtcdError::Invalid {
        path: path.to_owned(),
        problem,
    })
}

/// Where a snapshot goes.
#[derive(Debug, Clone)]
pub enum Target {
    /// Into a directory (the state dir's `etcd/`), named
    /// `<cluster>-<UTC time>-<node>.snapshot`, the newest `keep` of them
    /// kept.
    Dir {
        dir: PathBuf,
        cluster: String,
        keep: usize,
    },
    /// Exactly this file (`--out`); nothing else is touched.
    File(PathBuf),
}

/// How a snapshot is taken.
#[derive(Debug, Clone)]
pub struct SnapshotOptions {
    pub target: Target,
    /// The stream is stopped (and nothing kept) past this many bytes.
    pub max_size: u64,
    /// The whole stream; each message also waits at most the call timeout.
    pub total_timeout: Duration,
}

impl SnapshotOptions {
    /// Into `<state_dir>/etcd/`, the newest [`DEFAULT_KEEP`] kept.
    pub fn in_state_dir(state_dir: &Path, cluster: &str) -> SnapshotOptions {
        SnapshotOptions {
            target: Target::Dir {
                dir: state_dir.join(SNAPSHOT_DIR),
                cluster: cluster.to_owned(),
                keep: DEFAULT_KEEP,
            },
            max_size: DEFAULT_MAX_SIZE,
            total_timeout: Duration::from_secs(1800),
        }
    }
}

/// A snapshot saved and verified.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotFile {
    pub path: PathBuf,
    /// The control plane it was taken from.
    pub node: String,
    #[serde(flatten)]
    pub info: SnapshotInfo,
    /// Older snapshots imgbuild made that were deleted to keep the newest N.
    pub pruned: Vec<PathBuf>,
}

/// The first control plane, in inventory order, whose etcd is running and
/// healthy, connected; else what each one showed.
async fn healthy_control_plane<'a>(
    plan: &'a Plan,
    limits: &Options,
) -> Result<(&'a PlannedNode, NodeClient), EtcdError> {
    let mode = Mode::Mtls(plan.identity.clone());
    let mut seen = Vec::new();
    for node in plan.nodes.iter().filter(|n| n.role == Role::Controlplane) {
        let conn = match NodeClient::connect(&node.endpoint, &mode, limits.call_timeout).await {
            Ok(c) => c,
            Err(e) => {
                seen.push(format!("{}: {e}", node.name));
                continue;
            }
        };
        match conn.services().await {
            Ok(services) => match services.iter().find(|s| s.id == "etcd") {
                Some(s) if s.state == "Running" && s.health.as_ref().is_some_and(|h| h.healthy) => {
                    return Ok((node, conn));
                }
                Some(s) => seen.push(format!(
                    "{}: etcd is {}{}",
                    node.name,
                    bounded(&s.state),
                    if s.state == "Running" {
                        " but not healthy"
                    } else {
                        ""
                    }
                )),
                None => seen.push(format!("{}: runs no etcd", node.name)),
            },
            Err(e) => seen.push(format!("{}: {e}", node.name)),
        }
    }
    Err(EtcdError::NoHealthyControlPlane(seen))
}

/// A service state from a node, kept short.
fn bounded(s: &str) -> String {
    s.chars().take(40).collect()
}

/// Takes a snapshot from the first healthy control plane into `opts`'
/// target: streamed into a 0600 temporary file, each message within the
/// call timeout, verified, then fsynced and renamed with its `.sha256`
/// record beside it. In a directory the newest `keep` snapshots stay.
/// Nothing is left behind when it fails.
pub async fn snapshot(
    plan: &Plan,
    opts: &SnapshotOptions,
    limits: &Options,
) -> Result<SnapshotFile, EtcdError> {
    let (node, conn) = healthy_control_plane(plan, limits).await?;
    let path = match &opts.target {
        Target::File(path) => path.clone(),
        Target::Dir { dir, cluster, .. } => {
            create_private_dir(dir)?;
            dir.join(snapshot_name(
                cluster,
                &node.name,
                time::OffsetDateTime::now_utc(),
            ))
        }
    };
    let info = stream_into(&conn, &node.name, &path, opts, limits).await?;
    let record = record_path(&path);
    let line = format!("{}  {}\n", info.sha256, file_name(&path));
    crate::atomic::write_if_changed(&record, line.as_bytes(), true).map_err(io_at(&record))?;
    let pruned = match &opts.target {
        Target::Dir {
            dir, cluster, keep, ..
        } => prune(dir, cluster, *keep).map_err(io_at(dir))?,
        Target::File(_) => Vec::new(),
    };
    Ok(SnapshotFile {
        path,
        node: node.name.clone(),
        info,
        pruned,
    })
}

/// [`snapshot`] on its own runtime, for callers without one.
pub fn snapshot_blocking(
    plan: &Plan,
    opts: &SnapshotOptions,
    limits: &Options,
) -> Result<SnapshotFile, EtcdError> {
    runtime()?.block_on(snapshot(plan, opts, limits))
}

fn runtime() -> Result<tokio::runtime::Runtime, EtcdError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| EtcdError::Runtime(e.to_string()))
}

fn create_private_dir(dir: &Path) -> Result<(), EtcdError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io_at(dir))
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// `<path>.sha256`.
pub fn record_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(RECORD_SUFFIX);
    PathBuf::from(name)
}

/// Streams the node's snapshot into `path`, bounded and verified.
async fn stream_into(
    conn: &NodeClient,
    node: &str,
    path: &Path,
    opts: &SnapshotOptions,
    limits: &Options,
) -> Result<SnapshotInfo, EtcdError> {
    let api = |source| EtcdError::Api {
        node: node.to_owned(),
        source,
    };
    let mut out = AtomicFile::create(path, true).map_err(io_at(path))?;
    let mut stream = conn.etcd_snapshot().await.map_err(api)?;
    let mut v = Verifier::default();
    let deadline = Instant::now() + opts.total_timeout;
    loop {
        let wait = limits
            .call_timeout
            .min(deadline.saturating_duration_since(Instant::now()));
        let next = match tokio::time::timeout(wait, stream.message()).await {
            Ok(next) => next,
            Err(_) if Instant::now() >= deadline => {
                return Err(EtcdError::TimedOut {
                    node: node.to_owned(),
                    timeout: opts.total_timeout,
                });
            }
            Err(_) => {
                return Err(EtcdError::Stalled {
                    node: node.to_owned(),
                    timeout: limits.call_timeout,
                    received: v.size(),
                });
            }
        };
        let chunk = match next {
            Ok(Some(chunk)) => chunk,
            Ok(None) => break,
            Err(s) => {
                return Err(api(ApiError::Status {
                    code: s.code(),
                    message: s.message().to_owned(),
                }));
            }
        };
        if v.size() + chunk.bytes.len() as u64 > opts.max_size {
            return Err(EtcdError::TooLarge {
                node: node.to_owned(),
                limit: opts.max_size,
            });
        }
        v.update(&chunk.bytes);
        out.file()
            .write_all(&chunk.bytes)
            .map_err(io_at(out.temp_path()))?;
    }
    let info = v.finish().map_err(|problem| EtcdError::Incomplete {
        node: node.to_owned(),
        problem,
    })?;
    out.commit().map_err(io_at(path))?;
    Ok(info)
}

/// `<cluster>-<YYYYMMDDTHHMMSS.mmmZ>-<node>.snapshot`: sorts by time
/// within a cluster.
fn snapshot_name(cluster: &str, node: &str, at: time::OffsetDateTime) -> String {
    format!(
        "{cluster}-{:04}{:02}{:02}T{:02}{:02}{:02}.{:03}Z-{node}{SUFFIX}",
        at.year(),
        u8::from(at.month()),
        at.day(),
        at.hour(),
        at.minute(),
        at.second(),
        at.millisecond()
    )
}

/// The time part of a name [`snapshot_name`] made for `cluster`.
fn stamp_of<'a>(name: &'a str, cluster: &str) -> Option<&'a str> {
    const STAMP: usize = "YYYYMMDDTHHMMSS.mmmZ".len();
    let rest = name.strip_prefix(cluster)?.strip_prefix('-')?;
    let stamp = rest.get(..STAMP)?;
    let node = rest[STAMP..].strip_prefix('-')?.strip_suffix(SUFFIX)?;
    let shape = stamp.bytes().enumerate().all(|(i, b)| match i {
        8 => b == b'T',
        15 => b == b'.',
        19 => b == b'Z',
        _ => b.is_ascii_digit(),
    });
    (shape && !node.is_empty()).then_some(stamp)
}

/// Deletes all but the newest `keep` snapshots of `cluster` in `dir`, and
/// only those imgbuild wrote: named as it names them, with its `.sha256`
/// record beside them naming the file. Returns what it deleted.
pub fn prune(dir: &Path, cluster: &str, keep: usize) -> io::Result<Vec<PathBuf>> {
    let mut ours: Vec<(String, PathBuf)> = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(stamp) = stamp_of(name, cluster) else {
            continue;
        };
        let path = entry.path();
        let recorded = crate::io::open_regular(&record_path(&path), false)
            .and_then(|f| crate::io::read_bounded(f, 4096))
            .is_ok_and(|r| {
                String::from_utf8_lossy(&r)
                    .trim_end()
                    .ends_with(&format!("  {name}"))
            });
        if recorded && entry.file_type()?.is_file() {
            ours.push((stamp.to_owned(), path));
        }
    }
    ours.sort();
    let excess = ours.len().saturating_sub(keep);
    let mut deleted = Vec::new();
    for (_, path) in ours.into_iter().take(excess) {
        std::fs::remove_file(&path)?;
        let _ = std::fs::remove_file(record_path(&path));
        deleted.push(path);
    }
    Ok(deleted)
}

/// The snapshot a run takes before it first changes a control plane: at
/// most one per run, however many steps ask ([`snapshot_before_change`]).
#[derive(Debug, Default)]
pub struct BeforeChange {
    /// None: the run was told to go without (`--skip-etcd-snapshot`).
    options: Option<SnapshotOptions>,
    taken: tokio::sync::Mutex<Option<SnapshotFile>>,
}

impl BeforeChange {
    /// Snapshots into `options`' target before the first change.
    pub fn new(options: SnapshotOptions) -> BeforeChange {
        BeforeChange {
            options: Some(options),
            taken: Default::default(),
        }
    }

    /// No snapshot (`--skip-etcd-snapshot`); also the default, as only the
    /// caller knows the state dir.
    pub fn skip() -> BeforeChange {
        BeforeChange::default()
    }

    /// Whether this run goes without a snapshot.
    pub fn skipped(&self) -> bool {
        self.options.is_none()
    }

    /// The snapshot this run took, if it took one.
    pub fn taken(&self) -> Option<SnapshotFile> {
        self.taken.try_lock().ok().and_then(|t| t.clone())
    }
}

/// Call before a run's first control-plane change (upgrade, reboot-needing
/// apply, removal), in no dry run: the first call takes the snapshot, later
/// calls return the same file. `Ok(None)` when the run skips snapshots. An
/// error means the change must not go ahead.
pub async fn snapshot_before_change(
    before: &BeforeChange,
    plan: &Plan,
    limits: &Options,
) -> Result<Option<SnapshotFile>, EtcdError> {
    let Some(opts) = &before.options else {
        return Ok(None);
    };
    let mut taken = before.taken.lock().await;
    if let Some(file) = taken.as_ref() {
        return Ok(Some(file.clone()));
    }
    let file = snapshot(plan, opts, limits).await?;
    *taken = Some(file.clone());
    Ok(Some(file))
}

/// Uploads the snapshot at `path` to `conn`'s node (`EtcdRecover`) in
/// chunks read from disk, checking it again on the way (the file may have
/// changed since it was checked): a file that fails is reported before
/// the node is asked to bootstrap from it.
pub async fn upload(conn: &NodeClient, path: &Path) -> Result<SnapshotInfo, RecoverError> {
    let file = tokio::fs::File::open(path)
        .await
        .map_err(|e| RecoverError::Local(format!("{}: {e}", path.display())))?;
    let verdict = Arc::new(Mutex::new((Verifier::default(), None::<io::Error>)));
    let seen = verdict.clone();
    let chunks = futures_util::stream::unfold(Some(file), move |file| {
        let seen = seen.clone();
        async move {
            use tokio::io::AsyncReadExt;
            let mut file = file?;
            let mut buf = vec![0; UPLOAD_CHUNK];
            match file.read(&mut buf).await {
                Ok(0) => None,
                Ok(n) => {
                    buf.truncate(n);
                    seen.lock().expect("not poisoned").0.update(&buf);
                    Some((
                        Data {
                            metadata: None,
                            bytes: buf,
                        },
                        Some(file),
                    ))
                }
                Err(e) => {
                    seen.lock().expect("not poisoned").1 = Some(e);
                    None
                }
            }
        }
    });
    conn.etcd_recover(chunks).await.map_err(RecoverError::Api)?;
    let (v, failed) = std::mem::take(&mut *verdict.lock().expect("not poisoned"));
    if let Some(e) = failed {
        return Err(RecoverError::Local(format!("{}: {e}", path.display())));
    }
    v.finish().map_err(|problem| {
        RecoverError::Local(format!(
            "{}: changed while it was uploaded, and is not a whole etcd snapshot now: {problem}",
            path.display()
        ))
    })
}

/// Why a recovery step on the bootstrap node failed.
#[derive(Debug, thiserror::Error)]
pub enum RecoverError {
    /// From the node: retried where it means "not yet".
    #[error(transparent)]
    Api(ApiError),
    /// The file on this machine.
    #[error("{0}")]
    Local(String),
}

/// What a recovery needs of the bootstrap node, said when its etcd runs
/// (Talos answers its `Bootstrap` with "etcd data directory is not empty").
pub const RECOVER_NEEDS_WIPED: &str = "etcd already has data on this node: recovery needs control planes whose etcd waits for bootstrap (service etcd Preparing), as after `talosctl reset --system-labels-to-wipe EPHEMERAL` or on fresh machines; nothing was uploaded";

/// Recovers etcd on `conn`'s node from the snapshot at `path`, as
/// `talosctl bootstrap --recover-from` does: refuses a node whose etcd
/// runs, uploads (`EtcdRecover`), then `Bootstrap{recover_etcd}`. Talos
/// restores the database on that node with itself as the only member;
/// the other control planes join it as after any bootstrap.
pub async fn recover(conn: &NodeClient, path: &Path) -> Result<SnapshotInfo, RecoverError> {
    let services = conn.services().await.map_err(RecoverError::Api)?;
    if services
        .iter()
        .any(|s| s.id == "etcd" && s.state == "Running")
    {
        return Err(RecoverError::Local(RECOVER_NEEDS_WIPED.to_owned()));
    }
    let info = upload(conn, path).await?;
    conn.bootstrap_recover().await.map_err(|e| match e {
        ApiError::Status {
            code: tonic::Code::AlreadyExists,
            message,
        } => RecoverError::Local(format!("{message}: {RECOVER_NEEDS_WIPED}")),
        e => RecoverError::Api(e),
    })?;
    Ok(info)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bolt-shaped database of `pages` 4 KiB pages with its hash appended,
    /// built here by hand from the layout in bbolt's `page.go`/`db.go`.
    fn snapshot_bytes(pages: usize) -> Vec<u8> {
        let mut db = vec![0u8; pages * 4096];
        db[8..10].copy_from_slice(&BOLT_META_FLAG.to_le_bytes());
        db[16..20].copy_from_slice(&BOLT_MAGIC.to_le_bytes());
        db[20..24].copy_from_slice(&2u32.to_le_bytes());
        db[24..28].copy_from_slice(&4096u32.to_le_bytes());
        db[64..72].copy_from_slice(&7u64.to_le_bytes());
        let sum = fnv64a(&db[16..72]);
        db[72..80].copy_from_slice(&sum.to_le_bytes());
        let hash = sha2::Sha256::digest(&db);
        db.extend_from_slice(&hash);
        db
    }

    fn verdict(bytes: &[u8], chunk: usize) -> Result<SnapshotInfo, FormatError> {
        let mut v = Verifier::default();
        for c in bytes.chunks(chunk) {
            v.update(c);
        }
        v.finish()
    }

    #[test]
    fn a_whole_snapshot_passes_in_any_chunking() {
        let bytes = snapshot_bytes(4);
        for chunk in [1, 7, 31, 32, 33, 4096, 1 << 20] {
            let info = verdict(&bytes, chunk).unwrap();
            assert_eq!((info.size, info.page_size, info.txid), (16416, 4096, 7));
            assert_eq!(info.sha256, hex::encode(sha2::Sha256::digest(&bytes)));
        }
    }

    #[test]
    fn fnv64a_matches_go_hash_fnv() {
        // Go: fnv.New64a().Sum64() of "" and of "a".
        assert_eq!(fnv64a(b""), 0xcbf29ce484222325);
        assert_eq!(fnv64a(b"a"), 0xaf63dc4c8601ec8c);
    }

    #[test]
    fn truncated_flipped_or_foreign_bytes_fail() {
        let bytes = snapshot_bytes(2);
        assert_eq!(
            verdict(&bytes[..bytes.len() - 1], 100),
            Err(FormatError::NoChecksum { size: 8223 })
        );
        assert_eq!(verdict(&[], 1), Err(FormatError::Empty));
        let mut flipped = bytes.clone();
        flipped[5000] ^= 1;
        assert!(matches!(
            verdict(&flipped, 1000),
            Err(FormatError::ChecksumMismatch { .. })
        ));
        let mut foreign = vec![0u8; 4096];
        foreign.extend_from_slice(&sha2::Sha256::digest(&foreign));
        assert!(matches!(
            verdict(&foreign, 4096),
            Err(FormatError::NotBolt(_))
        ));
    }

    #[test]
    fn names_sort_by_time_and_parse_back() {
        let at = time::macros::datetime!(2026-11-27 08:05:09.042 UTC);
        let name = snapshot_name("lab-a", "cp-01", at);
        assert_eq!(name, "lab-a-20261127T080509.042Z-cp-01.snapshot");
        assert_eq!(stamp_of(&name, "lab-a"), Some("20261127T080509.042Z"));
        assert_eq!(stamp_of(&name, "lab"), None);
        assert_eq!(stamp_of("lab-a-mine.snapshot", "lab-a"), None);
    }

    #[test]
    fn prune_keeps_the_newest_and_leaves_what_imgbuild_did_not_write() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, record: bool| {
            let path = dir.path().join(name);
            std::fs::write(&path, b"x").unwrap();
            if record {
                std::fs::write(record_path(&path), format!("{}  {name}\n", "0".repeat(64)))
                    .unwrap();
            }
        };
        for s in 1..=4 {
            write(&format!("c-20260101T00000{s}.000Z-cp-01.snapshot"), true);
        }
        // Named like ours but without our record; another cluster's; a user's.
        write("c-20250101T000000.000Z-cp-01.snapshot", false);
        write("d-20250101T000000.000Z-cp-01.snapshot", true);
        write("mine.snapshot", false);
        let deleted = prune(dir.path(), "c", 2).unwrap();
        let names: Vec<String> = deleted.iter().map(|p| file_name(p)).collect();
        assert_eq!(
            names,
            [
                "c-20260101T000001.000Z-cp-01.snapshot",
                "c-20260101T000002.000Z-cp-01.snapshot"
            ]
        );
        let mut left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(SUFFIX))
            .collect();
        left.sort();
        assert_eq!(
            left,
            [
                "c-20250101T000000.000Z-cp-01.snapshot",
                "c-20260101T000003.000Z-cp-01.snapshot",
                "c-20260101T000004.000Z-cp-01.snapshot",
                "d-20250101T000000.000Z-cp-01.snapshot",
                "mine.snapshot"
            ]
        );
        assert!(!record_path(&deleted[0]).exists());
    }
}
