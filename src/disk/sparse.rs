//! Sparse-aware copying: only the data extents of the source are copied
//! (in-kernel, which may share blocks on filesystems that can), holes stay
//! holes, and the result has the source's exact length.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// Copies `src` into the empty file `dst`, preserving holes.
pub fn copy_sparse(src: &File, dst: &File) -> io::Result<u64> {
    let len = src.metadata()?.len();
    let (sfd, dfd) = (src.as_raw_fd(), dst.as_raw_fd());
    let mut pos: i64 = 0;
    let end = len as i64;
    while pos < end {
        // SAFETY: lseek on a valid descriptor has no memory effects.
        let data = unsafe { libc::lseek(sfd, pos, libc::SEEK_DATA) };
        if data < 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::ENXIO) {
                break; // only a hole remains
            }
            return Err(err);
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(sfd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(io::Error::last_os_error());
        }
        let (mut off_in, mut off_out) = (data, data);
        while off_in < hole {
            let want = (hole - off_in) as usize;
            // SAFETY: the offsets point at live i64s; descriptors are valid.
            let n = unsafe { libc::copy_file_range(sfd, &mut off_in, dfd, &mut off_out, want, 0) };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "source shrank while copying",
                ));
            }
        }
        pos = hole;
    }
    dst.set_len(len)?;
    Ok(len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, SeekFrom, Write};
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn holes_stay_holes_and_data_is_identical() {
        let dir = tempfile::tempdir().unwrap();
        let mut src = File::create_new(dir.path().join("src")).unwrap();
        src.set_len(64 << 20).unwrap();
        src.seek(SeekFrom::Start(10 << 20)).unwrap();
        src.write_all(&[7u8; 4096]).unwrap();
        src.seek(SeekFrom::Start((64 << 20) - 5)).unwrap();
        src.write_all(b"tail!").unwrap();
        let src = File::open(dir.path().join("src")).unwrap();
        let dst = File::create_new(dir.path().join("dst")).unwrap();
        assert_eq!(copy_sparse(&src, &dst).unwrap(), 64 << 20);
        let mut a = Vec::new();
        let mut b = Vec::new();
        File::open(dir.path().join("src"))
            .unwrap()
            .read_to_end(&mut a)
            .unwrap();
        File::open(dir.path().join("dst"))
            .unwrap()
            .read_to_end(&mut b)
            .unwrap();
        assert!(a == b);
        // Allocated blocks stay far below the apparent 64 MiB.
        assert!(dst.metadata().unwrap().blocks() * 512 < 8 << 20);
    }
}
