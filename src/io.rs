//! Small composable readers and writers, one concern each: a download is a
//! stack of them (body → length check → hash → magic check → decompress →
//! hash → sparse temp file); builds, disks and publishers reuse them.
//!
//! The sparse copies live here too: a stream or a file is written with its
//! all-zero blocks left as holes, so a 4 GB image holding 300 MB of data
//! takes 300 MB of disk. Between two files the copy is done in-kernel
//! (`copy_file_range`, which may share blocks on filesystems that can) when
//! the kernel can copy between them; across filesystems (a cache on tmpfs,
//! `out/` on disk) it cannot, and the data extents are read and written
//! instead.

use crate::digest::Sha256;
use sha2::{Digest, Sha512};
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

/// Buffer size for every copy loop, comparison and upload chunk. 1 MiB:
/// large enough that what each read costs (a system call, a TLS record, a
/// hasher call) vanishes next to the bytes it moves, a whole number of
/// [`BLOCK`]s so sparse writes stay aligned, and small enough that every
/// concurrent build job, comparison and upload holds one or two without
/// the process growing by more than a few MiB each.
pub const BUF_SIZE: usize = 1 << 20;

/// The unit of holes: a block of zeros this large is left unwritten. A
/// filesystem block is 4 KiB on every filesystem images are kept on; a
/// smaller hole could not be represented anyway.
const BLOCK: usize = 4096;

/// Hashes everything read through it (SHA-256 always, SHA-512 on request).
pub struct HashingReader<R> {
    inner: R,
    sha256: sha2::Sha256,
    sha512: Option<Sha512>,
    count: u64,
}

impl<R: Read> HashingReader<R> {
    pub fn new(inner: R, with_sha512: bool) -> Self {
        HashingReader {
            inner,
            sha256: sha2::Sha256::new(),
            sha512: with_sha512.then(Sha512::new),
            count: 0,
        }
    }

    /// Bytes read so far.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Digests of everything read: (sha256, sha512 in hex if requested).
    pub fn finish(self) -> (Sha256, Option<String>) {
        (
            Sha256::from(self.sha256),
            self.sha512.map(|h| hex::encode(h.finalize())),
        )
    }

    pub fn get_mut(&mut self) -> &mut R {
        &mut self.inner
    }
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.sha256.update(&buf[..n]);
        if let Some(h) = &mut self.sha512 {
            h.update(&buf[..n]);
        }
        self.count += n as u64;
        Ok(n)
    }
}

/// SHA-256 and length of everything `r` yields: the one hash loop.
pub fn sha256_of(r: impl Read) -> io::Result<(Sha256, u64)> {
    let mut h = HashingReader::new(r, false);
    io::copy(&mut h, &mut io::sink())?;
    let n = h.count();
    Ok((h.finish().0, n))
}

/// Refuses to yield more than `expected` bytes and reports an early end:
/// the two ways a body can disagree with its Content-Length.
pub struct ExactLengthReader<R> {
    inner: R,
    expected: u64,
    seen: u64,
}

impl<R: Read> ExactLengthReader<R> {
    pub fn new(inner: R, expected: u64) -> Self {
        ExactLengthReader {
            inner,
            expected,
            seen: 0,
        }
    }
}

/// The error kinds [`ExactLengthReader`] raises, so callers can tell them apart.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LengthError {
    #[error("truncated: the body ended after {got} of {expected} bytes")]
    Truncated { got: u64, expected: u64 },
    #[error("the body is longer than its Content-Length of {expected} bytes")]
    TooLong { expected: u64 },
}

impl<R: Read> Read for ExactLengthReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            // Read's contract: an empty buffer reads 0 bytes, which says
            // nothing about where the body ends.
            return Ok(0);
        }
        let left = self.expected - self.seen;
        if left == 0 {
            // One more byte would mean the body is longer than announced.
            let mut probe = [0u8; 1];
            return match self.inner.read(&mut probe)? {
                0 => Ok(0),
                _ => Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    LengthError::TooLong {
                        expected: self.expected,
                    },
                )),
            };
        }
        let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..want])?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                LengthError::Truncated {
                    got: self.seen,
                    expected: self.expected,
                },
            ));
        }
        self.seen += n as u64;
        Ok(n)
    }
}

/// Lets the first bytes be looked at before anything is consumed.
pub struct PeekReader<R> {
    inner: R,
    head: Vec<u8>,
    pos: usize,
}

impl<R: Read> PeekReader<R> {
    /// Reads up to `n` bytes ahead (fewer only at the end of the stream).
    pub fn new(mut inner: R, n: usize) -> io::Result<Self> {
        let mut head = vec![0u8; n];
        let mut got = 0;
        while got < n {
            match inner.read(&mut head[got..]) {
                Ok(0) => break,
                Ok(k) => got += k,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        head.truncate(got);
        Ok(PeekReader {
            inner,
            head,
            pos: 0,
        })
    }

    pub fn peek(&self) -> &[u8] {
        &self.head
    }
}

impl<R: Read> Read for PeekReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.pos < self.head.len() {
            let n = buf.len().min(self.head.len() - self.pos);
            buf[..n].copy_from_slice(&self.head[self.pos..self.pos + n]);
            self.pos += n;
            return Ok(n);
        }
        self.inner.read(buf)
    }
}

/// What the first bytes of a stream say it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Magic {
    Xz,
    Zstd,
    Gzip,
    Qcow2,
    /// A disk with a GPT (signature at LBA 1, 512-byte sectors).
    Gpt,
    Iso,
    /// A Linux kernel as a boot loader loads it: an x86 bzImage (`HdrS` at
    /// 0x202) or an arm64 EFI-stub `Image` (`MZ`, and `ARM\x64` at 0x38).
    Kernel,
    /// An initramfs as served and booted, never unpacked here: xz, zstd or
    /// gzip-compressed, or a plain `newc` cpio archive.
    Initramfs,
}

impl Magic {
    /// How many bytes [`Magic::detect`] needs to see.
    pub const PEEK: usize = 0x8006;

    pub fn detect(head: &[u8]) -> Option<Magic> {
        if head.starts_with(&[0xFD, b'7', b'z', b'X', b'Z', 0x00]) {
            Some(Magic::Xz)
        } else if head.starts_with(&[0x28, 0xB5, 0x2F, 0xFD]) {
            Some(Magic::Zstd)
        } else if head.starts_with(&[0x1F, 0x8B]) {
            Some(Magic::Gzip)
        } else if head.starts_with(b"QFI\xfb") {
            Some(Magic::Qcow2)
        } else if head.get(512..520) == Some(b"EFI PART") {
            Some(Magic::Gpt)
        } else if head.get(0x8001..0x8006) == Some(b"CD001") {
            Some(Magic::Iso)
        } else {
            None
        }
    }

    /// Whether `head` is this kind of data. The two boot kinds are checked
    /// as such; [`Magic::detect`] names the others.
    pub fn matches(self, head: &[u8]) -> bool {
        match self {
            Magic::Kernel => {
                head.get(0x202..0x206) == Some(b"HdrS")
                    || (head.starts_with(b"MZ") && head.get(0x38..0x3c) == Some(b"ARM\x64"))
            }
            Magic::Initramfs => {
                matches!(
                    Magic::detect(head),
                    Some(Magic::Xz | Magic::Zstd | Magic::Gzip)
                ) || head.starts_with(b"070701")
            }
            // A hybrid ISO (grub-mkrescue's) also has an MBR or GPT in
            // front, which `detect` would name first.
            Magic::Iso => head.get(0x8001..0x8006) == Some(b"CD001"),
            kind => Magic::detect(head) == Some(kind),
        }
    }
}

/// A short description of unexpected content for error messages: the
/// classic failure is a 9-byte "Not Found" saved as an image.
pub fn describe(head: &[u8]) -> String {
    let text = head.len() <= 4096
        && !head.is_empty()
        && head
            .iter()
            .all(|&b| b == b'\n' || b == b'\r' || b == b'\t' || (0x20..0x7f).contains(&b));
    let lower = String::from_utf8_lossy(&head[..head.len().min(512)]).to_ascii_lowercase();
    if lower.trim_start().starts_with("<!doctype html") || lower.trim_start().starts_with("<html") {
        format!("an HTML page ({} bytes seen)", head.len())
    } else if text {
        let s = String::from_utf8_lossy(head);
        let s: String = s.chars().take(80).collect();
        format!("{} bytes of text: {:?}", head.len(), s.trim())
    } else if head.is_empty() {
        "an empty body".into()
    } else {
        format!(
            "unrecognised data starting {}",
            hex::encode(&head[..head.len().min(8)])
        )
    }
}

/// Writes a stream into an empty file from its start, leaving all-zero
/// blocks as holes.
pub fn copy_sparse_from<R: Read>(mut src: R, dst: &mut File) -> io::Result<u64> {
    let mut buf = vec![0u8; BUF_SIZE];
    let mut total = 0u64;
    loop {
        let mut filled = 0;
        while filled < buf.len() {
            match src.read(&mut buf[filled..]) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if filled == 0 {
            break;
        }
        write_data_blocks(dst, &buf[..filled], total)?;
        total += filled as u64;
        if filled < buf.len() {
            break;
        }
    }
    dst.set_len(total)?;
    Ok(total)
}

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
fn write_data_blocks(dst: &File, data: &[u8], offset: u64) -> io::Result<()> {
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
/// covering the whole file): everything else reads as zeros.
pub fn data_extents(file: &File, len: u64) -> impl Iterator<Item = io::Result<(u64, u64)>> + '_ {
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

/// Opens `path` only if it is a regular file. A FIFO or a device would
/// block the open or the reads forever (a FIFO without a writer, `/dev/zero`
/// never ends), so it is refused; the open itself cannot block
/// (`O_NONBLOCK`, which regular files ignore).
pub fn open_regular(path: &std::path::Path, writable: bool) -> io::Result<std::fs::File> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let file = std::fs::File::options()
        .read(true)
        .write(writable)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let kind = file.metadata()?.file_type();
    if kind.is_file() {
        return Ok(file);
    }
    let what = if kind.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_block_device() {
        "a block device"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_socket() {
        "a socket"
    } else {
        "not a file"
    };
    Err(io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("not a regular file ({what})"),
    ))
}

/// Reads `r` to its end, refusing more than `limit` bytes: a value, a
/// schematic or a patch from a file that may be `/dev/zero` or a pipe
/// that never ends. Reads at most `limit + 1` bytes.
pub fn read_bounded(r: impl Read, limit: u64) -> io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    r.take(limit + 1).read_to_end(&mut buf)?;
    if buf.len() as u64 > limit {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("longer than the {limit} bytes allowed"),
        ));
    }
    Ok(buf)
}

/// The end-to-end tests' helper for a second filesystem, shared as source.
#[cfg(test)]
#[path = "../tests/common/otherfs.rs"]
mod otherfs;

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Seek, SeekFrom, Write};
    use std::os::unix::fs::MetadataExt;
    use std::path::Path;

    #[test]
    fn hashing_reader_hashes_what_passes() {
        let mut r = HashingReader::new(&b"abc"[..], true);
        let mut out = Vec::new();
        r.read_to_end(&mut out).unwrap();
        assert_eq!(r.count(), 3);
        let (s256, s512) = r.finish();
        assert_eq!(
            s256.to_string(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert!(s512.unwrap().starts_with("ddaf35a193617aba"));
    }

    #[test]
    fn exact_length_reader_names_both_disagreements() {
        let mut short = ExactLengthReader::new(&b"abc"[..], 5);
        let err = short.read_to_end(&mut Vec::new()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "truncated: the body ended after 3 of 5 bytes"
        );
        let mut long = ExactLengthReader::new(&b"abcdef"[..], 5);
        let err = long.read_to_end(&mut Vec::new()).unwrap_err();
        assert!(
            err.to_string()
                .contains("longer than its Content-Length of 5")
        );
        let mut exact = ExactLengthReader::new(&b"abcde"[..], 5);
        let mut out = Vec::new();
        exact.read_to_end(&mut out).unwrap();
        assert_eq!(out, b"abcde");
    }

    #[test]
    fn exact_length_reader_answers_an_empty_buffer_with_zero() {
        let mut r = ExactLengthReader::new(&b"abcde"[..], 5);
        assert_eq!(r.read(&mut []).unwrap(), 0);
        let mut two = [0u8; 2];
        assert_eq!(r.read(&mut two).unwrap(), 2);
        assert_eq!(r.read(&mut []).unwrap(), 0);
        let mut rest = Vec::new();
        r.read_to_end(&mut rest).unwrap();
        assert_eq!(rest, b"cde");
        // At the end, too.
        assert_eq!(r.read(&mut []).unwrap(), 0);
    }

    #[test]
    fn peek_reader_gives_back_what_it_peeked() {
        let mut r = PeekReader::new(&b"hello world"[..], 5).unwrap();
        assert_eq!(r.peek(), b"hello");
        let mut out = String::new();
        r.read_to_string(&mut out).unwrap();
        assert_eq!(out, "hello world");
        assert_eq!(PeekReader::new(&b"hi"[..], 5).unwrap().peek(), b"hi");
    }

    #[test]
    fn magic_bytes_of_every_format() {
        assert_eq!(
            Magic::detect(&[0xFD, b'7', b'z', b'X', b'Z', 0]),
            Some(Magic::Xz)
        );
        assert_eq!(
            Magic::detect(&[0x28, 0xB5, 0x2F, 0xFD, 1]),
            Some(Magic::Zstd)
        );
        assert_eq!(Magic::detect(&[0x1F, 0x8B, 8]), Some(Magic::Gzip));
        assert_eq!(Magic::detect(b"QFI\xfb\0\0\0\x03"), Some(Magic::Qcow2));
        let mut gpt = vec![0u8; 1024];
        gpt[512..520].copy_from_slice(b"EFI PART");
        assert_eq!(Magic::detect(&gpt), Some(Magic::Gpt));
        let mut iso = vec![0u8; 0x8006];
        iso[0x8001..0x8006].copy_from_slice(b"CD001");
        assert_eq!(Magic::detect(&iso), Some(Magic::Iso));
        // A hybrid ISO, with a GPT in front, is still an ISO.
        iso[512..520].copy_from_slice(b"EFI PART");
        assert!(Magic::Iso.matches(&iso));
        assert!(!Magic::Iso.matches(&gpt));
        assert_eq!(Magic::detect(b"Not Found"), None);
    }

    #[test]
    fn unexpected_content_is_described() {
        assert_eq!(describe(b"Not Found"), "9 bytes of text: \"Not Found\"");
        assert!(describe(b"<!DOCTYPE html><html>502</html>").starts_with("an HTML page"));
        assert_eq!(describe(b""), "an empty body");
        assert!(describe(&[0, 1, 2, 3]).starts_with("unrecognised data starting 00010203"));
    }

    #[test]
    fn only_regular_files_are_opened() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        assert!(open_regular(&file, false).is_ok());
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let err = open_regular(&fifo, false).unwrap_err();
        assert_eq!(err.to_string(), "not a regular file (a FIFO)");
        let err = open_regular(std::path::Path::new("/dev/zero"), false).unwrap_err();
        assert_eq!(err.to_string(), "not a regular file (a character device)");
        let err = open_regular(dir.path(), false).unwrap_err();
        assert_eq!(err.to_string(), "not a regular file (a directory)");
    }

    #[test]
    fn bounded_reads_stop_at_the_limit() {
        assert_eq!(read_bounded(&b"abc"[..], 3).unwrap(), b"abc");
        let endless = std::fs::File::open("/dev/zero").unwrap();
        let err = read_bounded(endless, 1000).unwrap_err();
        assert_eq!(err.to_string(), "longer than the 1000 bytes allowed");
    }

    #[test]
    fn sparse_writer_leaves_zero_blocks_as_holes() {
        let mut data = vec![0u8; 32 << 20];
        data[5 << 20..(5 << 20) + 10].copy_from_slice(b"0123456789");
        let last = data.len() - 1;
        data[last] = 1;
        let dir = tempfile::tempdir().unwrap();
        let mut f = std::fs::File::create(dir.path().join("s")).unwrap();
        assert_eq!(
            copy_sparse_from(&data[..], &mut f).unwrap(),
            data.len() as u64
        );
        assert_eq!(std::fs::read(dir.path().join("s")).unwrap(), data);
        assert!(f.metadata().unwrap().blocks() * 512 < 1 << 20);
    }

    // The sparse copies.

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
