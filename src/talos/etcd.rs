//! etcd snapshots and recovery. Before a run first changes a control plane
//! (an upgrade, a reboot-needing apply, a removal) it saves etcd's snapshot
//! into the state dir ([`snapshot_before_change`]); `imgbuild etcd snapshot`
//! takes one on demand ([`snapshot`]); `bootstrap --recover-from` brings a
//! wiped cluster back from one ([`recover::recover`]). A snapshot is
//! streamed from the first control plane whose etcd is healthy (siderolabs/
//! talos `v1alpha1_server.go` EtcdSnapshot), checked as it arrives
//! ([`format`]), and kept only whole.

pub mod format;
pub mod recover;

use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::bootstrap::{Options, Plan, PlannedNode};
use super::client::{ApiError, Mode, NodeClient};
use crate::atomic::AtomicFile;
use crate::inventory::Role;
use crate::publish::Cancel;
use format::{FormatError, SnapshotInfo, Verifier};

/// Snapshots kept in the state dir unless told otherwise.
pub const DEFAULT_KEEP: usize = 5;

/// The largest snapshot taken unless told otherwise ([`format::LARGEST`]).
pub const DEFAULT_MAX_SIZE: u64 = format::LARGEST;

/// The state dir's directory of snapshots.
pub const SNAPSHOT_DIR: &str = "etcd";

/// What a snapshot file is named with, and its record beside it.
const SUFFIX: &str = ".snapshot";
const RECORD_SUFFIX: &str = ".sha256";

/// Why a snapshot was not taken.
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
    #[error(
        "node {node}: interrupted after {received} bytes of the etcd snapshot: nothing kept (its temporary file removed); run the command again to take one"
    )]
    Interrupted { node: String, received: u64 },
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

/// Where a snapshot goes.
#[derive(Debug, Clone)]
pub enum SnapshotTarget {
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
    pub target: SnapshotTarget,
    /// The stream is stopped (and nothing kept) past this many bytes.
    pub max_size: u64,
    /// The whole stream; each message also waits at most the call timeout.
    pub total_timeout: Duration,
    /// Ctrl-C or SIGTERM: the stream stops, the temp file goes.
    pub cancel: Cancel,
}

impl SnapshotOptions {
    /// Into `<state_dir>/etcd/`, the newest [`DEFAULT_KEEP`] kept.
    pub fn in_state_dir(state_dir: &Path, cluster: &str) -> SnapshotOptions {
        SnapshotOptions {
            target: SnapshotTarget::Dir {
                dir: state_dir.join(SNAPSHOT_DIR),
                cluster: cluster.to_owned(),
                keep: DEFAULT_KEEP,
            },
            max_size: DEFAULT_MAX_SIZE,
            total_timeout: Duration::from_secs(1800),
            cancel: Cancel::never(),
        }
    }
}

/// Where the snapshot before a run's first control-plane change goes:
/// `flag` (`--etcd-snapshot-dir`), else the inventory's
/// `cluster.etcdSnapshotDir` (relative to the inventory's folder), else
/// the state dir's `etcd/`.
pub fn before_change_dir(
    state_dir: &Path,
    inv: &crate::inventory::Inventory,
    flag: Option<&Path>,
) -> PathBuf {
    match (flag, &inv.cluster.etcd_snapshot_dir) {
        (Some(dir), _) => dir.to_owned(),
        (None, Some(dir)) => inv.base_dir.join(dir),
        (None, None) => state_dir.join(SNAPSHOT_DIR),
    }
}

impl SnapshotOptions {
    /// The snapshot before a run's first control-plane change, into
    /// [`before_change_dir`], the newest [`DEFAULT_KEEP`] kept there.
    pub fn before_change(
        state_dir: &Path,
        inv: &crate::inventory::Inventory,
        flag: Option<&Path>,
    ) -> SnapshotOptions {
        let mut out = SnapshotOptions::in_state_dir(state_dir, &inv.cluster.name);
        out.target = SnapshotTarget::Dir {
            dir: before_change_dir(state_dir, inv, flag),
            cluster: inv.cluster.name.clone(),
            keep: DEFAULT_KEEP,
        };
        out
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
        SnapshotTarget::File(path) => path.clone(),
        SnapshotTarget::Dir { dir, cluster, .. } => {
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
        SnapshotTarget::Dir {
            dir, cluster, keep, ..
        } => prune(dir, cluster, *keep).map_err(io_at(dir))?,
        SnapshotTarget::File(_) => Vec::new(),
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

/// Creates `dir` (0700) or takes the folder that is there; never a
/// symlink to somewhere else, where snapshots (the cluster's whole state)
/// would land and the pruning delete.
fn create_private_dir(dir: &Path) -> Result<(), EtcdError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io_at(dir))?;
    match std::fs::symlink_metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(io_at(dir)(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "a link or something else than a folder is there: imgbuild keeps snapshots only in a folder of its own",
        ))),
        Err(e) => Err(io_at(dir)(e)),
    }
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
    // A snapshot killed mid-stream left its temp under a name no later
    // snapshot shares (they are timestamped): swept here, by the next one.
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        crate::atomic::sweep_dead_writers(dir, ".snapshot");
    }
    let mut out = AtomicFile::create(path, true).map_err(io_at(path))?;
    let mut stream = conn.etcd_snapshot().await.map_err(api)?;
    let mut v = Verifier::default();
    let deadline = Instant::now() + opts.total_timeout;
    loop {
        let wait = limits
            .call_timeout
            .min(deadline.saturating_duration_since(Instant::now()));
        let message = tokio::select! {
            next = tokio::time::timeout(wait, stream.message()) => next,
            () = opts.cancel.cancelled() => {
                return Err(EtcdError::Interrupted {
                    node: node.to_owned(),
                    received: v.size(),
                });
            }
        };
        let next = match message {
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
fn prune(dir: &Path, cluster: &str, keep: usize) -> io::Result<Vec<PathBuf>> {
    let mut ours: Vec<(String, PathBuf, String)> = Vec::new();
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
            .ok()
            .and_then(|r| {
                let line = String::from_utf8_lossy(&r).trim_end().to_owned();
                let hash = line.strip_suffix(&format!("  {name}"))?.to_owned();
                (hash.len() == 64 && hash.bytes().all(|b| b.is_ascii_hexdigit())).then_some(hash)
            });
        if let Some(hash) = recorded
            && entry.file_type()?.is_file()
        {
            ours.push((stamp.to_owned(), path, hash));
        }
    }
    ours.sort();
    let mut counted = ours.len();
    let mut deleted = Vec::new();
    for (_, path, hash) in ours {
        if counted <= keep {
            break;
        }
        counted -= 1;
        // Only the file its record describes (hashed only when it would
        // go): one swapped in under the name since, or a record planted
        // for another file, is not imgbuild's and stays.
        let same = crate::io::open_regular(&path, false)
            .and_then(crate::io::sha256_of)
            .is_ok_and(|(sha, _)| sha.hex() == hash.to_ascii_lowercase());
        if !same {
            continue;
        }
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

    /// The folder the snapshot goes into (None: skipped, or a file).
    pub fn dir(&self) -> Option<&Path> {
        match &self.options.as_ref()?.target {
            SnapshotTarget::Dir { dir, .. } => Some(dir),
            SnapshotTarget::File(_) => None,
        }
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

#[cfg(test)]
mod tests {
    use super::*;

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
        let hash_of_x = crate::digest::Sha256::of(b"x").hex();
        let write = |name: &str, record: Option<&str>| {
            let path = dir.path().join(name);
            std::fs::write(&path, b"x").unwrap();
            if let Some(hash) = record {
                std::fs::write(record_path(&path), format!("{hash}  {name}\n")).unwrap();
            }
        };
        for s in 1..=4 {
            write(
                &format!("c-20260101T00000{s}.000Z-cp-01.snapshot"),
                Some(&hash_of_x),
            );
        }
        // Named like ours but without our record; with a record that is
        // not its hash (planted, or the file swapped since); another
        // cluster's; a user's.
        write("c-20250101T000000.000Z-cp-01.snapshot", None);
        write(
            "c-20250101T000001.000Z-cp-01.snapshot",
            Some(&"0".repeat(64)),
        );
        write("d-20250101T000000.000Z-cp-01.snapshot", Some(&hash_of_x));
        write("mine.snapshot", None);
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
                "c-20250101T000001.000Z-cp-01.snapshot",
                "c-20260101T000003.000Z-cp-01.snapshot",
                "c-20260101T000004.000Z-cp-01.snapshot",
                "d-20250101T000000.000Z-cp-01.snapshot",
                "mine.snapshot"
            ]
        );
        assert!(!record_path(&deleted[0]).exists());
    }

    #[test]
    fn a_snapshot_folder_that_is_a_link_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let elsewhere = dir.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        let link = dir.path().join("etcd");
        std::os::unix::fs::symlink(&elsewhere, &link).unwrap();
        let e = create_private_dir(&link).unwrap_err().to_string();
        assert!(e.contains("a link or something else than a folder"), "{e}");
        create_private_dir(&dir.path().join("real")).unwrap();
        create_private_dir(&dir.path().join("real")).unwrap();
    }
}
