//! One imgbuild at a time changes a cluster's nodes: two concurrent
//! `upgrade` runs would reboot two control planes at once and lose etcd's
//! quorum, and `up` during an `upgrade` would bootstrap a rebooting node.
//! The lock is an `flock(2)` on a file in the state dir, so the kernel
//! releases it when its holder dies (even by SIGKILL); the file says who
//! holds it, for the message the next run shows.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

/// The lock file's name in the state dir (a dot file, so
/// [`super::config::ensure_private_dir`] counts it as imgbuild's).
pub const LOCK_FILE: &str = ".imgbuild.lock";

/// The most of the lock file read back: it holds one short JSON line.
const MAX_HOLDER_BYTES: u64 = 4096;

/// Who holds a state dir's lock, as the holder wrote it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Holder {
    pub pid: u32,
    /// The imgbuild command, e.g. `upgrade`.
    pub command: String,
    /// Seconds since the Unix epoch when it took the lock.
    pub since: i64,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The file may have been edited by anyone: bounded and escaped.
        let command = crate::input::excerpt(&self.command, 40);
        write!(f, "pid {} (imgbuild {command}) since ", self.pid)?;
        match time::OffsetDateTime::from_unix_timestamp(self.since) {
            Ok(t) => write!(
                f,
                "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
                t.year(),
                u8::from(t.month()),
                t.day(),
                t.hour(),
                t.minute(),
                t.second()
            ),
            Err(_) => write!(f, "an unknown time"),
        }
    }
}

/// Why the lock was not taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error(
        "state dir {} is in use: another imgbuild is changing this cluster's nodes ({}); wait until it ends, then run again",
        dir.display(),
        holder.as_ref().map_or_else(|| "holder unknown".to_owned(), ToString::to_string)
    )]
    Held {
        dir: PathBuf,
        holder: Option<Holder>,
    },
    #[error("{}: cannot take the state dir lock", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The held lock; dropping it (or the process ending) releases it.
#[derive(Debug)]
pub struct StateLock {
    _file: File,
}

/// How [`acquire`] waits for a lock another run holds (`--lock-timeout`),
/// so `up`, `apply`, `upgrade` and `bootstrap` wait as `prune` and `down`
/// do. The default does not wait: a held lock fails at once.
#[derive(Clone, Default)]
pub struct LockWait {
    pub timeout: std::time::Duration,
    /// Told once who holds it, when a run starts waiting.
    pub waiting: Option<Waiting>,
}

/// Hears who holds the lock a run waits for.
pub type Waiting = std::sync::Arc<dyn Fn(&LockError) + Send + Sync>;

impl std::fmt::Debug for LockWait {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockWait")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// Takes `dir`'s lock for `command`: a lock another run holds is waited
/// for as `wait` says (until `cancel`), then an error naming its holder.
/// `dir` must exist.
pub fn acquire(
    dir: &Path,
    command: &str,
    wait: &LockWait,
    cancel: &crate::publish::Cancel,
) -> Result<StateLock, LockError> {
    let say = |held: &LockError| {
        if let Some(waiting) = &wait.waiting {
            waiting(held);
        }
    };
    acquire_waiting(dir, command, wait.timeout, cancel, &mut { say })
}

/// Takes `dir`'s lock for `command` without waiting.
fn try_acquire(dir: &Path, command: &str) -> Result<StateLock, LockError> {
    let path = dir.join(LOCK_FILE);
    let io = |source: std::io::Error| LockError::Io {
        path: path.clone(),
        source,
    };
    let mut file = open(&path).map_err(io)?;
    // Released when the file closes (flock(2) on Linux).
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            return Err(LockError::Held {
                dir: dir.to_owned(),
                holder: read_holder(&mut file),
            });
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(io(e)),
    }
    let holder = Holder {
        pid: std::process::id(),
        command: command.to_owned(),
        since: time::OffsetDateTime::now_utc().unix_timestamp(),
    };
    let mut line = serde_json::to_vec(&holder).expect("a holder serialises");
    line.push(b'\n');
    file.set_len(0).map_err(io)?;
    file.rewind().map_err(io)?;
    file.write_all(&line).map_err(io)?;
    Ok(StateLock { _file: file })
}

/// [`acquire`], waiting while another run holds the lock (`prune` or `down`
/// beside `up`: they must not delete what `up` is making). `waiting` hears
/// once who holds it; after `timeout`, or once `cancel` says so, the
/// holder's [`LockError::Held`] is returned.
fn acquire_waiting(
    dir: &Path,
    command: &str,
    timeout: std::time::Duration,
    cancel: &crate::publish::Cancel,
    waiting: &mut dyn FnMut(&LockError),
) -> Result<StateLock, LockError> {
    let deadline = std::time::Instant::now() + timeout;
    let mut told = false;
    loop {
        match try_acquire(dir, command) {
            Err(held @ LockError::Held { .. }) => {
                if !told {
                    waiting(&held);
                    told = true;
                }
                if std::time::Instant::now() >= deadline
                    || cancel.sleep(std::time::Duration::from_millis(200)).is_err()
                {
                    return Err(held);
                }
            }
            other => return other,
        }
    }
}

/// Opens the lock file: never through a symlink, never blocking on a FIFO,
/// a regular file only, 0600.
fn open(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "is not a regular file (a FIFO, socket or device)",
        ));
    }
    Ok(file)
}

/// What the holder wrote, if it is readable: it may be midway through
/// writing it.
fn read_holder(file: &mut File) -> Option<Holder> {
    let mut text = Vec::new();
    file.rewind().ok()?;
    file.take(MAX_HOLDER_BYTES).read_to_end(&mut text).ok()?;
    serde_json::from_slice(&text).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Takes the lock as a run without `--lock-timeout` would.
    fn take(dir: &Path, command: &str) -> Result<StateLock, LockError> {
        acquire(
            dir,
            command,
            &LockWait::default(),
            &crate::publish::Cancel::never(),
        )
    }

    #[test]
    fn a_second_taker_is_told_who_holds_the_lock() {
        let dir = tempfile::tempdir().unwrap();
        let held = take(dir.path(), "upgrade").unwrap();
        let e = take(dir.path(), "up").unwrap_err();
        let LockError::Held {
            holder: Some(h), ..
        } = &e
        else {
            panic!("{e:?}");
        };
        assert_eq!((h.pid, h.command.as_str()), (std::process::id(), "upgrade"));
        let shown = e.to_string();
        assert!(
            shown.contains(&format!(
                "pid {} (imgbuild upgrade) since 20",
                std::process::id()
            )),
            "{shown}"
        );
        drop(held);
        let again = take(dir.path(), "up").unwrap();
        drop(again);
    }

    #[test]
    fn a_waiting_taker_says_who_holds_it_and_gives_up_at_its_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let held = take(dir.path(), "up").unwrap();
        let told = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let heard = told.clone();
        let wait = LockWait {
            timeout: std::time::Duration::from_millis(300),
            waiting: Some(std::sync::Arc::new(move |held: &LockError| {
                heard.lock().unwrap().push(held.to_string());
            })),
        };
        let e = acquire(dir.path(), "apply", &wait, &crate::publish::Cancel::never()).unwrap_err();
        assert!(matches!(e, LockError::Held { .. }), "{e:?}");
        let told = told.lock().unwrap();
        assert_eq!(told.len(), 1, "{told:?}");
        assert!(told[0].contains("(imgbuild up)"), "{told:?}");
        drop(held);
    }

    #[test]
    fn a_tampered_lock_file_is_neither_followed_nor_shown_raw() {
        let dir = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("/dev/zero", dir.path().join(LOCK_FILE)).unwrap();
        assert!(matches!(take(dir.path(), "up"), Err(LockError::Io { .. })));
        std::fs::remove_file(dir.path().join(LOCK_FILE)).unwrap();
        let h = Holder {
            pid: 7,
            command: "x\x1b[2J".repeat(30),
            since: i64::MAX,
        };
        let shown = h.to_string();
        assert!(
            !shown.contains('\x1b') && shown.ends_with("an unknown time"),
            "{shown}"
        );
    }
}
