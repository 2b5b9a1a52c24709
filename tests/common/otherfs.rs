//! A folder on another filesystem than a given one, for the tests that copy
//! across filesystems (where `copy_file_range` answers EXDEV). As root a
//! tmpfs is mounted for the test; else /dev/shm serves when it is a
//! filesystem of its own; else the test says it is skipped. Either way the
//! two folders' st_dev differ, checked. Shared by the unit tests
//! (`src/io.rs`, through `#[path]`) and the end-to-end tests.

use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;

/// A folder on another filesystem; a tmpfs mounted for it goes on drop.
pub struct OtherFs {
    dir: tempfile::TempDir,
    mounted: bool,
}

impl OtherFs {
    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for OtherFs {
    fn drop(&mut self) {
        if self.mounted {
            let out = Command::new("umount").arg(self.dir.path()).output();
            if !out.as_ref().is_ok_and(|o| o.status.success()) {
                skipped(&format!(
                    "could not unmount the test tmpfs on {}: {out:?}",
                    self.dir.path().display()
                ));
            }
        }
    }
}

/// Says so on the terminal: libtest captures `eprintln!` of a passing
/// test, not writes to stderr itself.
pub fn skipped(why: &str) {
    let _ = writeln!(std::io::stderr(), "SKIPPED: {why}");
}

fn dev(path: &Path) -> Option<u64> {
    std::fs::metadata(path).ok().map(|m| m.dev())
}

/// A folder on a filesystem other than `other`'s, or None (said) when
/// there is none to be had.
pub fn other_fs(other: &Path) -> Option<OtherFs> {
    let here = dev(other).expect("the folder to compare with exists");
    let cross = |fs: OtherFs| {
        assert_ne!(
            dev(fs.path()),
            Some(here),
            "{} is on the same filesystem",
            fs.path().display()
        );
        Some(fs)
    };
    let mount_failed = match mount_tmpfs("512m") {
        Ok(fs) => return cross(fs),
        Err(why) => why,
    };
    let shm = Path::new("/dev/shm");
    if dev(shm).is_some_and(|d| d != here) {
        let dir = tempfile::tempdir_in(shm).unwrap();
        return cross(OtherFs {
            dir,
            mounted: false,
        });
    }
    skipped(&format!(
        "nothing crosses filesystems here: {mount_failed}, and /dev/shm is not a filesystem of its own"
    ));
    None
}

/// A tmpfs of `size` (`mount -o size=`), for the tests of a full disk, or
/// None (said) when none can be mounted.
#[allow(dead_code)] // src/io.rs's unit tests include this file too
pub fn tmpfs(size: &str) -> Option<OtherFs> {
    mount_tmpfs(size)
        .map_err(|why| skipped(&format!("no small filesystem to fill: {why}")))
        .ok()
}

/// Mounts a tmpfs of `size` on a new temporary folder (root only), or
/// says why not.
fn mount_tmpfs(size: &str) -> Result<OtherFs, String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Err("not root, so no tmpfs can be mounted".into());
    }
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new("mount")
        .args([
            "-t",
            "tmpfs",
            "-o",
            &format!("size={size}"),
            "imgbuild-test",
        ])
        .arg(dir.path())
        .output();
    match out {
        Ok(o) if o.status.success() => Ok(OtherFs { dir, mounted: true }),
        Ok(o) => Err(format!(
            "mounting a tmpfs failed: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Err(format!("mounting a tmpfs failed: {e}")),
    }
}
