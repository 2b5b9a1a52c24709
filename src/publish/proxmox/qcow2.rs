//! A raw image as a qcow2 file holding only its non-zero clusters, for the
//! upload: a Talos disk image is mostly empty partitions, so its qcow2 is a
//! small fraction of the raw bytes, and Proxmox's import (`import-from`,
//! `qemu-img convert`) reads qcow2 as well as raw (pve-storage
//! `src/PVE/Storage/Plugin.pm`: import volumes may be `raw`, `qcow2` or
//! `vmdk`). Layout per the qcow2 specification (QEMU
//! `docs/interop/qcow2.txt`, version 3, 64 KiB clusters, 16-bit refcounts).
//!
//! Holes are never read: SEEK_DATA/SEEK_HOLE give the data extents, and
//! only their clusters are looked at. The tables come first in the file
//! and their entries depend on which clusters are all zeros, while the
//! sha256 the server checks must be known before the upload and covers the
//! file in order; so a first pass reads the extents to find the non-zero
//! clusters (a byte each), and the second writes tables and those clusters
//! (read again, from the page cache). Memory stays bounded: one 1 MiB
//! buffer and a byte per 64 KiB cluster.

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;

use sha2::Digest;

use crate::digest::Sha256;

const CLUSTER_BITS: u32 = 16;
const CLUSTER: u64 = 1 << CLUSTER_BITS;
/// Eight-byte entries per L1/L2/refcount-table cluster.
const ENTRIES: u64 = CLUSTER / 8;
/// Two-byte refcounts per refcount block.
const REFCOUNTS: u64 = CLUSTER / 2;
/// QCOW_OFLAG_COPIED: the cluster's refcount is exactly one.
const COPIED: u64 = 1 << 63;
/// Clusters read at a time (1 MiB).
const RUN: u64 = crate::io::BUF_SIZE as u64 / CLUSTER;

/// `out` made anew (0600): what a killed run left there, or a symlink
/// planted there, is removed (the link, never its target) and the file is
/// created exclusively, so the image is never written through a link.
fn create_fresh(out: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::remove_file(out) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(out)
}

/// Writes the raw image at `raw` as a qcow2 file at `out`; returns the
/// file's size and sha256 (counted as written, for the server's check).
/// The file is a temporary one read back at once for the upload and
/// removed after it, so it is not synced: a crash leaves a file the next
/// run overwrites, and syncing would write every data byte to the disk
/// before the first one is sent.
pub(super) fn raw_to_qcow2(raw: &Path, out: &Path) -> io::Result<(u64, Sha256)> {
    let src = crate::io::open_regular(raw, false)?;
    let size = src.metadata()?.len();
    let clusters = size.div_ceil(CLUSTER);
    let mut buf = vec![0u8; crate::io::BUF_SIZE];
    let used = nonzero_clusters(&src, size, &mut buf)?;
    let data = used.iter().filter(|&&u| u).count() as u64;
    let l1_entries = clusters.div_ceil(ENTRIES).max(1);
    let l2_used: Vec<bool> = (0..l1_entries)
        .map(|t| {
            let first = (t * ENTRIES) as usize;
            used[first.min(used.len())..used.len().min(first + ENTRIES as usize)]
                .iter()
                .any(|&u| u)
        })
        .collect();
    let l2_count = l2_used.iter().filter(|&&u| u).count() as u64;
    let l1_clusters = (l1_entries * 8).div_ceil(CLUSTER);
    // Refcount blocks cover every cluster, themselves included.
    let fixed = 1 + l1_clusters + l2_count + data;
    let (mut rt_clusters, mut rb) = (1u64, 1u64);
    loop {
        let total = fixed + rt_clusters + rb;
        let (need_rb, need_rt) = (
            total.div_ceil(REFCOUNTS),
            total.div_ceil(REFCOUNTS).div_ceil(ENTRIES),
        );
        if (need_rb, need_rt) == (rb, rt_clusters) {
            break;
        }
        (rb, rt_clusters) = (need_rb, need_rt);
    }
    let total = fixed + rt_clusters + rb;
    let rt_at = 1;
    let rb_at = rt_at + rt_clusters;
    let l1_at = rb_at + rb;
    let l2_at = l1_at + l1_clusters;
    let data_at = l2_at + l2_count;

    let mut w = Hashing {
        inner: BufWriter::with_capacity(crate::io::BUF_SIZE, create_fresh(out)?),
        hash: sha2::Sha256::new(),
        written: 0,
    };
    // QEMU sizes images in 512-byte sectors (a raw file's tail is read
    // as a zero-padded sector).
    let virtual_size = size.next_multiple_of(512);
    w.write_all(&header(virtual_size, l1_entries, l1_at, rt_at, rt_clusters))?;
    w.pad()?;
    let mut table = Vec::with_capacity(CLUSTER as usize);
    for b in 0..rb {
        table.extend_from_slice(&((rb_at + b) * CLUSTER).to_be_bytes());
    }
    w.write_all(&table)?;
    w.pad()?;
    table.clear();
    for _ in 0..total {
        table.extend_from_slice(&1u16.to_be_bytes());
    }
    w.write_all(&table)?;
    w.pad()?;
    table.clear();
    let mut next_l2 = l2_at;
    for &has in &l2_used {
        let entry = if has {
            next_l2 += 1;
            ((next_l2 - 1) * CLUSTER) | COPIED
        } else {
            0
        };
        table.extend_from_slice(&entry.to_be_bytes());
    }
    w.write_all(&table)?;
    w.pad()?;
    let mut next_data = data_at;
    for (t, _) in l2_used.iter().enumerate().filter(|(_, u)| **u) {
        table.clear();
        for i in 0..ENTRIES {
            let c = (t as u64 * ENTRIES + i) as usize;
            let entry = if used.get(c).copied().unwrap_or(false) {
                next_data += 1;
                ((next_data - 1) * CLUSTER) | COPIED
            } else {
                0
            };
            table.extend_from_slice(&entry.to_be_bytes());
        }
        w.write_all(&table)?;
    }
    // The non-zero clusters in order, read in runs of neighbours.
    let mut c = 0u64;
    while c < clusters {
        if !used[c as usize] {
            c += 1;
            continue;
        }
        let mut end = c + 1;
        while end < clusters && end - c < RUN && used[end as usize] {
            end += 1;
        }
        let len = ((end - c) * CLUSTER) as usize;
        let have = (size - c * CLUSTER).min(len as u64) as usize;
        buf[have..len].fill(0);
        src.read_exact_at(&mut buf[..have], c * CLUSTER)?;
        w.write_all(&buf[..len])?;
        c = end;
    }
    let Hashing {
        inner,
        hash,
        written,
    } = w;
    inner.into_inner().map_err(|e| e.into_error())?;
    debug_assert_eq!(written, total * CLUSTER);
    Ok((written, Sha256::from(hash)))
}

/// Which clusters hold a non-zero byte (a byte per cluster), reading only
/// the clusters the data extents touch: holes are zeros without a read.
fn nonzero_clusters(src: &File, size: u64, buf: &mut [u8]) -> io::Result<Vec<bool>> {
    let clusters = size.div_ceil(CLUSTER);
    let mut used = vec![false; clusters as usize];
    // The first cluster not yet looked at: neighbouring extents may share
    // a cluster.
    let mut seen = 0u64;
    for extent in crate::io::data_extents(src, size) {
        let (start, end) = extent?;
        let mut c = (start / CLUSTER).max(seen);
        let last = end.div_ceil(CLUSTER).min(clusters);
        while c < last {
            let n = (last - c).min(RUN);
            let at = c * CLUSTER;
            let have = (size - at).min(n * CLUSTER) as usize;
            src.read_exact_at(&mut buf[..have], at)?;
            for (i, chunk) in buf[..have].chunks(CLUSTER as usize).enumerate() {
                used[(c + i as u64) as usize] = !is_zero(chunk);
            }
            c += n;
        }
        seen = seen.max(last);
    }
    Ok(used)
}

/// Whether every byte is zero, a 64-byte block at a time (vectorised, and
/// quick to say no for real data).
fn is_zero(bytes: &[u8]) -> bool {
    let mut blocks = bytes.chunks_exact(64);
    blocks.all(|b| b.iter().fold(0u8, |a, &x| a | x) == 0)
        && blocks.remainder().iter().all(|&x| x == 0)
}

/// The version 3 header: no backing file, no encryption, no snapshots,
/// 16-bit refcounts, then the end of the header extensions.
fn header(size: u64, l1_entries: u64, l1_at: u64, rt_at: u64, rt_clusters: u64) -> Vec<u8> {
    let mut h = Vec::with_capacity(112);
    h.extend_from_slice(b"QFI\xfb");
    h.extend_from_slice(&3u32.to_be_bytes());
    h.extend_from_slice(&0u64.to_be_bytes()); // backing file offset
    h.extend_from_slice(&0u32.to_be_bytes()); // backing file size
    h.extend_from_slice(&CLUSTER_BITS.to_be_bytes());
    h.extend_from_slice(&size.to_be_bytes());
    h.extend_from_slice(&0u32.to_be_bytes()); // crypt method
    h.extend_from_slice(&(l1_entries as u32).to_be_bytes());
    h.extend_from_slice(&(l1_at * CLUSTER).to_be_bytes());
    h.extend_from_slice(&(rt_at * CLUSTER).to_be_bytes());
    h.extend_from_slice(&(rt_clusters as u32).to_be_bytes());
    h.extend_from_slice(&0u32.to_be_bytes()); // snapshots
    h.extend_from_slice(&0u64.to_be_bytes()); // snapshots offset
    h.extend_from_slice(&0u64.to_be_bytes()); // incompatible features
    h.extend_from_slice(&0u64.to_be_bytes()); // compatible features
    h.extend_from_slice(&0u64.to_be_bytes()); // autoclear features
    h.extend_from_slice(&4u32.to_be_bytes()); // refcount order: 16 bits
    h.extend_from_slice(&104u32.to_be_bytes()); // header length
    h.extend_from_slice(&[0; 8]); // end of header extensions
    h
}

/// A writer that hashes and counts what passes, and pads to clusters.
struct Hashing<W: Write> {
    inner: W,
    hash: sha2::Sha256,
    written: u64,
}

impl<W: Write> Hashing<W> {
    /// Zeros up to the next cluster boundary.
    fn pad(&mut self) -> io::Result<()> {
        let rest = (CLUSTER - self.written % CLUSTER) % CLUSTER;
        self.write_all(&vec![0u8; rest as usize])
    }
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Seek, SeekFrom};
    use std::process::Command;

    /// A sparse raw image of `size` bytes with `bytes` written at each
    /// offset (explicit zeros make allocated extents that read as zeros).
    fn raw_image(dir: &Path, size: u64, writes: &[(u64, &[u8])]) -> std::path::PathBuf {
        let raw = dir.join("x.raw");
        let mut f = File::create(&raw).unwrap();
        f.set_len(size).unwrap();
        for (at, bytes) in writes {
            f.seek(SeekFrom::Start(*at)).unwrap();
            f.write_all(bytes).unwrap();
        }
        raw
    }

    /// Converts `raw`, has qemu-img check the qcow2 and compare it with
    /// the raw image byte for byte; the qcow2's size in clusters.
    fn convert_and_verify(raw: &Path) -> u64 {
        let out = raw.with_extension("qcow2");
        let (len, sha) = raw_to_qcow2(raw, &out).unwrap();
        assert_eq!(len, std::fs::metadata(&out).unwrap().len());
        assert_eq!(sha, Sha256::of(&std::fs::read(&out).unwrap()));
        let check = Command::new("qemu-img")
            .args(["check", "-f", "qcow2"])
            .arg(&out)
            .output()
            .unwrap();
        assert!(
            check.status.success(),
            "qemu-img check: {}",
            String::from_utf8_lossy(&check.stdout)
        );
        let cmp = Command::new("qemu-img")
            .args(["compare", "-f", "raw", "-F", "qcow2"])
            .arg(raw)
            .arg(&out)
            .output()
            .unwrap();
        assert!(
            cmp.status.success(),
            "qemu-img compare: {}",
            String::from_utf8_lossy(&cmp.stdout)
        );
        assert_eq!(len % CLUSTER, 0, "{len} bytes: not whole clusters");
        len / CLUSTER
    }

    /// Header, refcount table, one refcount block and the L1 table: the
    /// clusters every small image has besides its L2 tables and data.
    const FIXED: u64 = 4;

    /// qemu-img agrees: the file checks clean, holds the raw bytes, and
    /// holds exactly the written clusters plus tables (a sparse image whose
    /// size is no multiple of the cluster, data in its very last bytes).
    #[test]
    fn qemu_img_reads_back_the_raw_image() {
        let dir = tempfile::tempdir().unwrap();
        let size = (600 << 20) + 12345;
        let raw = raw_image(
            dir.path(),
            size,
            &[
                (0, b"talos!!!!!"),
                (70_000, b"talos!!!!!"),
                (300 << 20, b"talos!!!!!"),
                (size - 10, b"talos!!!!!"),
            ],
        );
        // Clusters 0, 1, 4800 (L2 table 0) and 9600 (L2 table 1).
        assert_eq!(convert_and_verify(&raw), FIXED + 2 + 4);
    }

    /// All-zero clusters inside a data extent are not sent: a 4 MiB extent
    /// of written zeros with one non-zero byte in its middle is one cluster.
    #[test]
    fn zero_clusters_inside_extents_are_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let mut extent = vec![0u8; 4 << 20];
        extent[(2 << 20) + 7] = 1;
        let raw = raw_image(dir.path(), 64 << 20, &[(1 << 20, &extent)]);
        assert_eq!(convert_and_verify(&raw), FIXED + 1 + 1);
    }

    /// A byte in the last, partial cluster of an image whose size is no
    /// multiple of 512 either: the tail cluster is sent zero-padded.
    #[test]
    fn data_at_the_very_end_of_an_odd_sized_image() {
        let dir = tempfile::tempdir().unwrap();
        let size = (3 * CLUSTER) + 1001;
        let raw = raw_image(dir.path(), size, &[(size - 1, b"!")]);
        assert_eq!(convert_and_verify(&raw), FIXED + 1 + 1);
    }

    /// A fully written image crossing several 1 MiB read runs and an L2
    /// table boundary (8192 clusters) holds every cluster.
    #[test]
    fn dense_data_across_runs_and_l2_tables() {
        let dir = tempfile::tempdir().unwrap();
        let start = (512 << 20) - (3 << 20) + 4096;
        let data: Vec<u8> = (0..(6u32 << 20)).map(|i| (i % 251) as u8 | 1).collect();
        let raw = raw_image(dir.path(), 1 << 30, &[(start, &data)]);
        let first = start / CLUSTER;
        let last = (start + data.len() as u64 - 1) / CLUSTER;
        assert_eq!(convert_and_verify(&raw), FIXED + 2 + (last - first + 1));
    }

    /// An image without data: tables only, and it still reads as zeros.
    #[test]
    fn an_empty_sparse_image_is_tables_only() {
        let dir = tempfile::tempdir().unwrap();
        let raw = raw_image(dir.path(), 100 << 20, &[]);
        assert_eq!(convert_and_verify(&raw), FIXED);
    }

    #[test]
    fn a_link_planted_at_the_output_is_replaced_not_written_through() {
        let dir = tempfile::tempdir().unwrap();
        let raw = dir.path().join("n.raw");
        std::fs::write(&raw, vec![7u8; 70_000]).unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"keep me").unwrap();
        let out = dir.path().join("n.raw.upload.qcow2");
        std::os::unix::fs::symlink(&victim, &out).unwrap();
        raw_to_qcow2(&raw, &out).unwrap();
        assert!(
            std::fs::read(&victim).unwrap() == b"keep me",
            "written through the link"
        );
        let m = std::fs::symlink_metadata(&out).unwrap();
        assert!(m.is_file(), "{m:?}");
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o777,
            0o600
        );
    }
}
