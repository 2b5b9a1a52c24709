//! Sparse-aware copying: only the data extents of the source are copied,
//! holes stay holes, and the result has the source's exact length.
//!
//! The copy is done in-kernel (`copy_file_range`, which may share blocks on
//! filesystems that can) when the kernel can copy between the two files.
//! Across filesystems (a cache on tmpfs, `out/` on disk) it cannot, and the
//! extents are read and written instead, skipping all-zero blocks.

use crate::io::BUF_SIZE;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

/// The unit of holes: a block of zeros this large is left unwritten. A
/// filesystem block is 4 KiB on every filesystem images are kept on; a
/// smaller hole could not be represented anyway.
const BLOCK: usize = 4096;

/// Copies `src` into the empty file `dst`, preserving holes: in-kernel when
/// possible, else by reading and writing the data extents.
pub fn copy_sparse(src: &File, dst: &File) -> io::Result<u64> {
    if copy_in_kernel(src, dst)? {
        Ok(src.metadata()?.len())
    } else {
        // Whatever the kernel did copy is the source's own bytes at the
        // same offsets, so copying every extent again is still exact.
        copy_by_reading(src, dst)
    }
}

/// Whether a `copy_file_range` error means the kernel cannot copy between
/// these two files (other filesystem, unsupported file type or flags, old
/// kernel), so reading and writing will do, rather than a real I/O error.
fn kernel_cannot_copy(err: &io::Error) -> bool {
    matches!(
        err.raw_os_error(),
        Some(libc::EXDEV | libc::EOPNOTSUPP | libc::ENOSYS | libc::EINVAL)
    )
}

/// Copies every data extent with `copy_file_range`. Ok(false) when the
/// kernel refused or stopped short: nothing is wrong with the files, it
/// just cannot copy them itself.
fn copy_in_kernel(src: &File, dst: &File) -> io::Result<bool> {
    let len = src.metadata()?.len();
    let (sfd, dfd) = (src.as_raw_fd(), dst.as_raw_fd());
    for extent in data_extents(src, len) {
        let (start, end) = extent?;
        let (mut off_in, mut off_out) = (start as i64, start as i64);
        while (off_in as u64) < end {
            let want = (end - off_in as u64) as usize;
            // SAFETY: the offsets point at live i64s; descriptors are valid.
            let n = unsafe { libc::copy_file_range(sfd, &mut off_in, dfd, &mut off_out, want, 0) };
            if n < 0 {
                let err = io::Error::last_os_error();
                return if kernel_cannot_copy(&err) {
                    Ok(false)
                } else {
                    Err(err)
                };
            }
            if n == 0 {
                return Ok(false);
            }
        }
    }
    dst.set_len(len)?;
    Ok(true)
}

/// Copies every data extent by reading it in [`BUF_SIZE`] pieces and
/// writing only the blocks that are not all zeros, so the output is sparse
/// even where the source stored zeros. Works between any two filesystems.
fn copy_by_reading(src: &File, dst: &File) -> io::Result<u64> {
    let len = src.metadata()?.len();
    let mut buf = vec![0u8; BUF_SIZE];
    for extent in data_extents(src, len) {
        let (start, end) = extent?;
        let mut pos = start;
        while pos < end {
            let n = (end - pos).min(BUF_SIZE as u64) as usize;
            // A source that shrank while copying ends here as UnexpectedEof.
            src.read_exact_at(&mut buf[..n], pos)?;
            write_data_blocks(dst, &buf[..n], pos)?;
            pos += n as u64;
        }
    }
    dst.set_len(len)?;
    Ok(len)
}

/// Writes `data` at `offset` in `dst`, skipping every all-zero block (a
/// new file reads zeros there anyway).
pub(crate) fn write_data_blocks(dst: &File, data: &[u8], offset: u64) -> io::Result<()> {
    let mut at = offset;
    for chunk in data.chunks(BLOCK) {
        if chunk.iter().any(|&b| b != 0) {
            dst.write_all_at(chunk, at)?;
        }
        at += chunk.len() as u64;
    }
    Ok(())
}

/// The `(start, end)` byte ranges of `file` that hold data, found with
/// SEEK_DATA/SEEK_HOLE (a filesystem that cannot tell reports one extent
/// covering the whole file).
pub(super) fn data_extents(
    file: &File,
    len: u64,
) -> impl Iterator<Item = io::Result<(u64, u64)>> + '_ {
    let fd = file.as_raw_fd();
    let mut pos: i64 = 0;
    let end = len as i64;
    std::iter::from_fn(move || {
        if pos >= end {
            return None;
        }
        // SAFETY: lseek on a valid descriptor has no memory effects.
        let data = unsafe { libc::lseek(fd, pos, libc::SEEK_DATA) };
        if data < 0 {
            let err = io::Error::last_os_error();
            pos = end;
            return if err.raw_os_error() == Some(libc::ENXIO) {
                None // only a hole remains
            } else {
                Some(Err(err))
            };
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            pos = end;
            return Some(Err(io::Error::last_os_error()));
        }
        let hole = hole.min(end);
        pos = hole;
        Some(Ok((data as u64, hole as u64)))
    })
}

/// The end-to-end tests' helper for a second filesystem, shared as source.
#[cfg(test)]
#[path = "../../tests/common/otherfs.rs"]
mod otherfs;

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Seek, SeekFrom, Write};
    use std::os::unix::fs::MetadataExt;
    use std::path::Path;

    const MIB: u64 = 1 << 20;

    /// A 64 MiB file with 4 KiB of data at 10 MiB, 2 MiB of written zeros
    /// (allocated, but no data) at 20 MiB, 1 MiB of data at 40 MiB and a
    /// 5-byte tail.
    fn sparse_source(path: &Path) -> File {
        let mut f = File::create_new(path).unwrap();
        f.set_len(64 * MIB).unwrap();
        f.seek(SeekFrom::Start(10 * MIB)).unwrap();
        f.write_all(&[7u8; 4096]).unwrap();
        f.seek(SeekFrom::Start(20 * MIB)).unwrap();
        f.write_all(&vec![0u8; 2 * MIB as usize]).unwrap();
        f.seek(SeekFrom::Start(40 * MIB)).unwrap();
        f.write_all(&vec![0x5a; MIB as usize]).unwrap();
        f.seek(SeekFrom::Start(64 * MIB - 5)).unwrap();
        f.write_all(b"tail!").unwrap();
        f.sync_all().unwrap();
        File::open(path).unwrap()
    }

    fn allocated(f: &File) -> u64 {
        f.metadata().unwrap().blocks() * 512
    }

    fn same_bytes(a: &Path, b: &Path) -> bool {
        let (fa, fb) = (File::open(a).unwrap(), File::open(b).unwrap());
        let len = fa.metadata().unwrap().len();
        if fb.metadata().unwrap().len() != len {
            return false;
        }
        let (mut ba, mut bb) = (vec![0u8; MIB as usize], vec![0u8; MIB as usize]);
        (0..len.div_ceil(MIB)).all(|i| {
            let n = (len - i * MIB).min(MIB) as usize;
            fa.read_exact_at(&mut ba[..n], i * MIB).unwrap();
            fb.read_exact_at(&mut bb[..n], i * MIB).unwrap();
            ba[..n] == bb[..n]
        })
    }

    #[test]
    fn holes_stay_holes_and_data_is_identical() {
        let dir = tempfile::tempdir().unwrap();
        let src = sparse_source(&dir.path().join("src"));
        let dst = File::create_new(dir.path().join("dst")).unwrap();
        assert_eq!(copy_sparse(&src, &dst).unwrap(), 64 * MIB);
        assert!(same_bytes(&dir.path().join("src"), &dir.path().join("dst")));
        // Allocated blocks stay far below the apparent 64 MiB.
        assert!(allocated(&dst) < 8 * MIB);
    }

    #[test]
    fn the_reading_fallback_copies_exactly_and_writes_no_zero_block() {
        let dir = tempfile::tempdir().unwrap();
        let src = sparse_source(&dir.path().join("src"));
        let dst = File::create_new(dir.path().join("dst")).unwrap();
        assert_eq!(copy_by_reading(&src, &dst).unwrap(), 64 * MIB);
        assert!(same_bytes(&dir.path().join("src"), &dir.path().join("dst")));
        // 4 KiB + 1 MiB + one block for the tail hold data; the 2 MiB of
        // written zeros the source allocated are holes in the copy.
        assert!(allocated(&src) >= 3 * MIB, "source {}", allocated(&src));
        assert!(
            allocated(&dst) < MIB + 64 * 1024,
            "copy {}",
            allocated(&dst)
        );
    }

    #[test]
    fn the_reading_fallback_keeps_an_odd_length_and_a_trailing_hole() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = File::create_new(dir.path().join("src")).unwrap();
        f.write_all(b"head").unwrap();
        f.set_len(3 * MIB + 7).unwrap();
        let src = File::open(dir.path().join("src")).unwrap();
        let dst = File::create_new(dir.path().join("dst")).unwrap();
        assert_eq!(copy_by_reading(&src, &dst).unwrap(), 3 * MIB + 7);
        assert!(same_bytes(&dir.path().join("src"), &dir.path().join("dst")));
    }

    #[test]
    fn only_errors_that_mean_the_kernel_cannot_copy_fall_back() {
        for errno in [libc::EXDEV, libc::EOPNOTSUPP, libc::ENOSYS, libc::EINVAL] {
            let err = io::Error::from_raw_os_error(errno);
            assert!(kernel_cannot_copy(&err), "{err}");
        }
        for errno in [
            libc::EIO,
            libc::ENOSPC,
            libc::EBADF,
            libc::EFBIG,
            libc::EPERM,
        ] {
            let err = io::Error::from_raw_os_error(errno);
            assert!(!kernel_cannot_copy(&err), "{err}");
        }
        assert!(!kernel_cannot_copy(&io::Error::other("not an errno")));
    }

    /// A tmpfs and the disk are different filesystems, where the kernel
    /// answers EXDEV: the copy still works and stays sparse, both ways.
    #[test]
    fn copies_across_filesystems_stay_sparse() {
        let disk = tempfile::tempdir().unwrap();
        let Some(mem) = otherfs::other_fs(disk.path()) else {
            return;
        };
        for (from, to) in [(mem.path(), disk.path()), (disk.path(), mem.path())] {
            let src = sparse_source(&from.join("src"));
            let dst = File::create_new(to.join("dst")).unwrap();
            assert_eq!(copy_sparse(&src, &dst).unwrap(), 64 * MIB);
            assert!(same_bytes(&from.join("src"), &to.join("dst")));
            assert!(allocated(&dst) < 8 * MIB, "copy {}", allocated(&dst));
            std::fs::remove_file(from.join("src")).unwrap();
            std::fs::remove_file(to.join("dst")).unwrap();
        }
    }
}
