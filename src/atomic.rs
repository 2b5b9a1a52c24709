//! Atomic file writes: a reader never sees a half-written file, and a crash
//! leaves either the old file or the new one, never a mix.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Numbers the writers of this process, so two threads writing the same
/// target never pick the same temporary name.
static WRITERS: AtomicU64 = AtomicU64::new(0);

/// A file being written under a temporary name in its final directory;
/// dropped without [`AtomicFile::commit`], it is removed.
pub struct AtomicFile {
    file: Option<File>,
    temp: PathBuf,
    target: PathBuf,
}

impl AtomicFile {
    /// Starts writing `target`; `private` makes the file 0600 from the start
    /// (secrets must never exist with wider permissions, even briefly).
    pub fn create(target: &Path, private: bool) -> io::Result<AtomicFile> {
        let dir = target.parent().filter(|p| !p.as_os_str().is_empty());
        let name = target
            .file_name()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?;
        let dir = dir.unwrap_or(Path::new("."));
        let prefix = format!(".{}.tmp-", name.to_string_lossy());
        sweep_stale(dir, |n| n.strip_prefix(prefix.as_str()));
        let writer = WRITERS.fetch_add(1, Ordering::Relaxed);
        let temp = dir.join(format!("{prefix}{}.{writer}", std::process::id()));
        let mut opts = OpenOptions::new();
        opts.read(true).write(true).create_new(true);
        if private {
            use std::os::unix::fs::OpenOptionsExt;
            opts.mode(0o600);
        }
        let file = opts.open(&temp)?;
        Ok(AtomicFile {
            file: Some(file),
            temp,
            target: target.to_owned(),
        })
    }

    /// Where the data is until [`AtomicFile::commit`].
    pub fn temp_path(&self) -> &Path {
        &self.temp
    }

    /// The open temporary file.
    pub fn file(&mut self) -> &mut File {
        self.file.as_mut().expect("file is open until commit")
    }

    /// fsyncs the data, renames it into place and fsyncs the directory.
    pub fn commit(mut self) -> io::Result<()> {
        let file = self.file.take().expect("file is open until commit");
        file.sync_all()?;
        drop(file);
        fs::rename(&self.temp, &self.target)?;
        if let Some(dir) = self.target.parent().filter(|p| !p.as_os_str().is_empty()) {
            File::open(dir)?.sync_all()?;
        }
        Ok(())
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if self.file.take().is_some() {
            let _ = fs::remove_file(&self.temp);
        }
    }
}

/// Removes `<prefix><pid>.<writer>` (or, from older versions,
/// `<prefix><pid>`) files left by writers that were killed (no destructor
/// runs on SIGKILL or an unhandled SIGINT) and are gone now.
/// `after_prefix` gives what follows the temporary-name prefix of a file
/// name this sweep may take (None: not one of ours).
fn sweep_stale(dir: &Path, after_prefix: impl Fn(&str) -> Option<&str>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(&after_prefix).and_then(|p| {
            p.split_once('.')
                .map_or(p, |(pid, _)| pid)
                .parse::<i32>()
                .ok()
        }) else {
            continue;
        };
        // SAFETY: signal 0 only asks whether the process exists.
        let gone = unsafe { libc::kill(pid, 0) } != 0
            && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone {
            let _ = fs::remove_file(entry.path());
        }
    }
}

/// Removes what killed writers left in `dir` of any target whose name ends
/// in `suffix` (`.snapshot`): files whose names change every time (a
/// timestamp) never meet their own writer's sweep.
pub fn sweep_dead_writers(dir: &Path, suffix: &str) {
    sweep_stale(dir, |n| {
        let (target, rest) = n.strip_prefix('.')?.rsplit_once(".tmp-")?;
        target.ends_with(suffix).then_some(rest)
    });
}

/// Writes `data` to `target` atomically. Returns false (and writes nothing)
/// when the file already holds exactly `data`.
pub fn write_if_changed(target: &Path, data: &[u8], private: bool) -> io::Result<bool> {
    if holds(target, data) {
        return Ok(false);
    }
    let mut f = AtomicFile::create(target, private)?;
    f.file().write_all(data)?;
    f.commit()?;
    Ok(true)
}

/// Whether `target` is a regular file holding exactly `data`. Never
/// blocking on a FIFO nor reading a device: what was planted there is
/// replaced, not read.
pub fn holds(target: &Path, data: &[u8]) -> bool {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let Ok(file) = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(target)
    else {
        return false;
    };
    if !file
        .metadata()
        .is_ok_and(|m| m.is_file() && m.len() == data.len() as u64)
    {
        return false;
    }
    let mut old = Vec::with_capacity(data.len());
    file.take(data.len() as u64 + 1)
        .read_to_end(&mut old)
        .is_ok()
        && old == data
}

/// Refuses an `--out` target that is there and is not a regular file (a
/// device, a FIFO, a symlink, a directory): a file is written under a
/// temporary name and renamed into place, which would replace `/dev/null`
/// or the `/dev/stdout` link itself, and leave the data (secrets, maybe)
/// in a file of that name.
pub fn check_out_target(target: &Path) -> io::Result<()> {
    match fs::symlink_metadata(target) {
        Ok(m) if m.file_type().is_file() => Ok(()),
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "there is something other than a regular file there (a device, a pipe, a link or a folder), which a new file would replace: name a file",
        )),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// An exclusive lock (`File::lock`, flock(2) on Linux) on `path` (created
/// if missing), held until the returned file is dropped: read-modify-write
/// of a shared file (cache entries, the manifest, the secrets bundle) by
/// concurrent processes.
pub fn lock(path: &Path) -> io::Result<File> {
    let f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)?;
    f.lock()?;
    Ok(f)
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_out_target_is_a_regular_file_or_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let file = d.join("plan.json");
        check_out_target(&file).unwrap();
        fs::write(&file, "old").unwrap();
        check_out_target(&file).unwrap();
        std::os::unix::fs::symlink("/dev/null", d.join("null")).unwrap();
        let fifo = d.join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid path; mkfifo creates the node or fails.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        for refused in [
            d.join("null"),
            fifo,
            d.to_owned(),
            Path::new("/dev/null").to_owned(),
        ] {
            let e = check_out_target(&refused).unwrap_err();
            assert!(
                e.to_string().contains("other than a regular file"),
                "{refused:?}: {e}"
            );
        }
    }

    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// The lock excludes every other taker of the same file, whether it
    /// waits (another `lock`) or only tries (prune's cache-entry check, the
    /// state-dir lock): a second try while it is held is refused, and the
    /// file is free again once the holder is dropped.
    #[test]
    fn a_held_lock_refuses_other_takers_until_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(".lock");
        let held = lock(&path).unwrap();
        let other = File::open(&path).unwrap();
        assert!(matches!(
            other.try_lock(),
            Err(std::fs::TryLockError::WouldBlock)
        ));
        drop(held);
        // Free again; a process another test forks meanwhile holds a copy
        // of the descriptor (and so the lock) until its exec closes it.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while let Err(e) = other.try_lock() {
            assert!(std::time::Instant::now() < deadline, "still locked: {e:?}");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        other.unlock().unwrap();
        drop(lock(&path).unwrap());
    }

    #[test]
    fn a_fifo_or_device_in_the_way_is_replaced_unread() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo.yaml");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid C string; mkfifo only creates the node.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let zero = dir.path().join("zero.yaml");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        for target in [&fifo, &zero] {
            assert!(write_if_changed(target, b"new", true).unwrap());
            assert_eq!(fs::read(target).unwrap(), b"new");
            assert!(!write_if_changed(target, b"new", true).unwrap());
        }
    }

    #[test]
    fn dropped_writes_leave_nothing_behind() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("x");
        {
            let mut f = AtomicFile::create(&target, false).unwrap();
            f.file().write_all(b"partial").unwrap();
        }
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn temps_of_dead_writers_are_swept_and_live_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("img");
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let stale = dir.path().join(format!(".img.tmp-{dead}.3"));
        let stale_old = dir.path().join(format!(".img.tmp-{dead}"));
        let live = dir.path().join(".img.tmp-1.0"); // init never dies
        for f in [&stale, &stale_old, &live] {
            fs::write(f, b"half").unwrap();
        }
        write_if_changed(&target, b"new", false).unwrap();
        assert!(!stale.exists());
        assert!(!stale_old.exists());
        assert!(live.exists());
    }

    #[test]
    fn a_killed_writers_temp_of_another_name_is_swept_by_suffix() {
        let dir = tempfile::tempdir().unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let stale = dir.path().join(format!(
            ".c-20260101T000000.000Z-cp-01.snapshot.tmp-{dead}.0"
        ));
        let other = dir.path().join(format!(".img.raw.tmp-{dead}.0"));
        let live = dir.path().join(".c-x.snapshot.tmp-1.0"); // init never dies
        let mine = dir.path().join("c-x.snapshot");
        for f in [&stale, &other, &live, &mine] {
            fs::write(f, b"half").unwrap();
        }
        sweep_dead_writers(dir.path(), ".snapshot");
        assert!(!stale.exists());
        assert!(other.exists() && live.exists() && mine.exists());
    }

    #[test]
    fn threads_writing_one_target_never_share_a_temp_file() {
        const THREADS: usize = 8;
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("manifest.json");
        let all_open = std::sync::Barrier::new(THREADS);
        let temps: Vec<PathBuf> = std::thread::scope(|s| {
            let writers: Vec<_> = (0..THREADS)
                .map(|i| {
                    let (target, all_open) = (&target, &all_open);
                    s.spawn(move || {
                        let mut f = AtomicFile::create(target, false).unwrap();
                        f.file()
                            .write_all(format!("writer {i}").as_bytes())
                            .unwrap();
                        // Every writer holds its temp file open at once.
                        all_open.wait();
                        let temp = f.temp_path().to_owned();
                        f.commit().unwrap();
                        temp
                    })
                })
                .collect();
            writers.into_iter().map(|w| w.join().unwrap()).collect()
        });
        let mut distinct = temps.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), THREADS, "{temps:?}");
        let content = fs::read_to_string(&target).unwrap();
        assert!(content.starts_with("writer "), "{content}");
        // Nothing but the target is left.
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn unchanged_content_is_not_rewritten_and_private_files_are_0600() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("secret");
        assert!(write_if_changed(&target, b"a", true).unwrap());
        assert!(!write_if_changed(&target, b"a", true).unwrap());
        assert!(write_if_changed(&target, b"b", true).unwrap());
        assert_eq!(fs::read(&target).unwrap(), b"b");
        let mode = fs::metadata(&target).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }
}
