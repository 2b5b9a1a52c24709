//! A raw image as a qcow2 stream holding only its non-zero clusters, for
//! the upload: a Talos disk image is mostly empty partitions, so its qcow2
//! is a small fraction of the raw bytes, and Proxmox's import
//! (`import-from`, `qemu-img convert`) reads qcow2 as well as raw
//! (pve-storage `src/PVE/Storage/Plugin.pm`: import volumes may be `raw`,
//! `qcow2` or `vmdk`). Layout per the qcow2 specification (QEMU
//! `docs/interop/qcow2.txt`, version 3, 64 KiB clusters, 16-bit refcounts).
//!
//! Nothing is written to disk: the file is generated as it is sent. The
//! server wants its sha256 before the file's first byte (pve-http-server
//! `src/PVE/APIServer/AnyEvent.pm` `file_upload_multipart` takes `content`,
//! `checksum-algorithm` and `checksum` only before the file part and dumps
//! everything after the file part's headers into the file), and the
//! tables, which come first, depend on which clusters are all zeros; so
//! [`Qcow2::scan`] finds the non-zero clusters (holes are never read:
//! SEEK_DATA/SEEK_HOLE give the data extents; a cluster whose first 4 KiB
//! hold a non-zero byte is not read further), [`Qcow2::sha256`] hashes the
//! generated stream without keeping it, and the upload sends
//! [`Qcow2::chunks`] again (the data read a second time, from the page
//! cache). Memory stays bounded: a byte per 64 KiB cluster, a few numbers
//! per 512 MiB of disk, and 1 MiB buffers.

use std::fs::File;
use std::io;
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
/// Clusters read at a time (1 MiB): the largest piece [`Chunks`] yields.
const RUN: u64 = crate::io::BUF_SIZE as u64 / CLUSTER;
/// What the scan reads of a cluster first: real data shows a non-zero
/// byte here, so the rest of the cluster is read only when this is zeros.
const PROBE: usize = 4096;

/// The qcow2 form of a raw image: which of its clusters hold data, and
/// where each table and cluster goes in the file (in clusters).
#[derive(Debug)]
pub(super) struct Qcow2 {
    src: File,
    /// The raw image's size in bytes.
    size: u64,
    /// Per raw cluster: whether it holds a non-zero byte.
    used: Vec<bool>,
    /// Per L1 entry: where its L2 table is (0: no table, no data).
    l2_at: Vec<u64>,
    /// Per L1 entry: the data clusters of the ranges before it.
    data_before: Vec<u64>,
    rt_clusters: u64,
    refcount_blocks: u64,
    l1_clusters: u64,
    data_at: u64,
    total: u64,
}

/// Where the refcount table starts (right after the header).
const RT_AT: u64 = 1;

impl Qcow2 {
    /// Reads which clusters of the raw image at `raw` hold data and lays
    /// the qcow2 out (the first of the passes over the data).
    pub(super) fn scan(raw: &Path) -> io::Result<Qcow2> {
        let src = crate::io::open_regular(raw, false)?;
        let size = src.metadata()?.len();
        let used = nonzero_clusters(&src, size)?;
        let clusters = used.len() as u64;
        let l1_entries = clusters.div_ceil(ENTRIES).max(1);
        let mut data_before = Vec::with_capacity(l1_entries as usize);
        let mut in_range = Vec::with_capacity(l1_entries as usize);
        let mut data = 0u64;
        for t in 0..l1_entries {
            let first = (t * ENTRIES).min(clusters) as usize;
            let end = ((t + 1) * ENTRIES).min(clusters) as usize;
            let n = used[first..end].iter().filter(|&&u| u).count() as u64;
            data_before.push(data);
            in_range.push(n);
            data += n;
        }
        let l2_count = in_range.iter().filter(|&&n| n > 0).count() as u64;
        let l1_clusters = (l1_entries * 8).div_ceil(CLUSTER);
        // Refcount blocks cover every cluster, themselves included.
        let fixed = 1 + l1_clusters + l2_count + data;
        let (mut rt_clusters, mut refcount_blocks) = (1u64, 1u64);
        loop {
            let total = fixed + rt_clusters + refcount_blocks;
            let need_rb = total.div_ceil(REFCOUNTS);
            let need_rt = need_rb.div_ceil(ENTRIES);
            if (need_rb, need_rt) == (refcount_blocks, rt_clusters) {
                break;
            }
            (refcount_blocks, rt_clusters) = (need_rb, need_rt);
        }
        let total = fixed + rt_clusters + refcount_blocks;
        let l1_at = RT_AT + rt_clusters + refcount_blocks;
        let mut next_l2 = l1_at + l1_clusters;
        let l2_at = in_range
            .iter()
            .map(|&n| {
                if n == 0 {
                    return 0;
                }
                next_l2 += 1;
                next_l2 - 1
            })
            .collect();
        Ok(Qcow2 {
            src,
            size,
            used,
            l2_at,
            data_before,
            rt_clusters,
            refcount_blocks,
            l1_clusters,
            data_at: next_l2,
            total,
        })
    }

    /// The qcow2 file's length in bytes.
    pub(super) fn len(&self) -> u64 {
        self.total * CLUSTER
    }

    /// How many of the raw image's clusters are sent (hold data).
    #[cfg(test)]
    fn data_clusters(&self) -> u64 {
        self.total - self.data_at
    }

    /// The file from its first byte, a piece at a time.
    pub(super) fn chunks(&self) -> Chunks<'_> {
        Chunks {
            q: self,
            meta: 0,
            raw: 0,
        }
    }

    /// The sha256 of the file [`Qcow2::chunks`] yields, for the server's
    /// check: generated and hashed, not kept.
    pub(super) fn sha256(&self) -> io::Result<Sha256> {
        let mut hash = sha2::Sha256::new();
        let mut buf = vec![0u8; crate::io::BUF_SIZE];
        let mut chunks = self.chunks();
        let mut len = 0u64;
        while let Some(n) = chunks.next_into(&mut buf)? {
            hash.update(&buf[..n]);
            len += n as u64;
        }
        debug_assert_eq!(len, self.len());
        Ok(Sha256::from(hash))
    }

    /// Metadata cluster `k` (header, refcount table and blocks, L1, L2
    /// tables) into `out`, which is one cluster of zeros.
    fn metadata(&self, k: u64, out: &mut [u8]) {
        let l1_at = RT_AT + self.rt_clusters + self.refcount_blocks;
        let l2_first = l1_at + self.l1_clusters;
        let mut put = |i: u64, v: &[u8]| {
            let at = i as usize * v.len();
            out[at..at + v.len()].copy_from_slice(v);
        };
        if k == 0 {
            // QEMU sizes images in 512-byte sectors (a raw file's tail is
            // read as a zero-padded sector).
            let h = header(
                self.size.next_multiple_of(512),
                self.l2_at.len() as u64,
                l1_at,
                RT_AT,
                self.rt_clusters,
            );
            out[..h.len()].copy_from_slice(&h);
        } else if k < RT_AT + self.rt_clusters {
            let first = (k - RT_AT) * ENTRIES;
            let end = (first + ENTRIES).min(self.refcount_blocks);
            for b in first..end {
                let at = (RT_AT + self.rt_clusters + b) * CLUSTER;
                put(b - first, &at.to_be_bytes());
            }
        } else if k < l1_at {
            let first = (k - RT_AT - self.rt_clusters) * REFCOUNTS;
            for c in first..(first + REFCOUNTS).min(self.total) {
                put(c - first, &1u16.to_be_bytes());
            }
        } else if k < l2_first {
            let first = (k - l1_at) * ENTRIES;
            let end = (first + ENTRIES).min(self.l2_at.len() as u64);
            for t in first..end {
                let l2 = self.l2_at[t as usize];
                if l2 != 0 {
                    put(t - first, &((l2 * CLUSTER) | COPIED).to_be_bytes());
                }
            }
        } else {
            let t = self
                .l2_at
                .iter()
                .position(|&at| at == k)
                .expect("a cluster between L1 and the data is an L2 table");
            let mut next = self.data_at + self.data_before[t];
            let first = t as u64 * ENTRIES;
            let end = (first + ENTRIES).min(self.used.len() as u64);
            for c in first..end {
                if self.used[c as usize] {
                    put(c - first, &((next * CLUSTER) | COPIED).to_be_bytes());
                    next += 1;
                }
            }
        }
    }
}

/// The qcow2 file in order: each metadata cluster, then the non-zero
/// clusters, neighbours read together (at most 1 MiB at a time).
pub(super) struct Chunks<'a> {
    q: &'a Qcow2,
    /// The next metadata cluster.
    meta: u64,
    /// The next raw cluster to look at once the metadata is out.
    raw: u64,
}

impl Chunks<'_> {
    /// The next piece into the front of `buf` (at least 1 MiB); its
    /// length, or `None` at the end.
    pub(super) fn next_into(&mut self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        let q = self.q;
        if self.meta < q.data_at {
            let out = &mut buf[..CLUSTER as usize];
            out.fill(0);
            q.metadata(self.meta, out);
            self.meta += 1;
            return Ok(Some(CLUSTER as usize));
        }
        let clusters = q.used.len() as u64;
        let mut c = self.raw;
        while c < clusters && !q.used[c as usize] {
            c += 1;
        }
        if c == clusters {
            self.raw = c;
            return Ok(None);
        }
        let mut end = c + 1;
        while end < clusters && end - c < RUN && q.used[end as usize] {
            end += 1;
        }
        let len = ((end - c) * CLUSTER) as usize;
        let have = (q.size - c * CLUSTER).min(len as u64) as usize;
        q.src.read_exact_at(&mut buf[..have], c * CLUSTER)?;
        buf[have..len].fill(0);
        self.raw = end;
        Ok(Some(len))
    }
}

/// Which clusters hold a non-zero byte (a byte per cluster), reading only
/// the clusters the data extents touch: holes are zeros without a read.
fn nonzero_clusters(src: &File, size: u64) -> io::Result<Vec<bool>> {
    let clusters = size.div_ceil(CLUSTER);
    let mut used = vec![false; clusters as usize];
    let mut buf = vec![0u8; CLUSTER as usize];
    // The first cluster not yet looked at: neighbouring extents may share
    // a cluster.
    let mut seen = 0u64;
    for extent in crate::io::data_extents(src, size) {
        let (start, end) = extent?;
        let first = (start / CLUSTER).max(seen);
        let last = end.div_ceil(CLUSTER).min(clusters);
        for c in first..last {
            let at = c * CLUSTER;
            let have = (size - at).min(CLUSTER) as usize;
            let probe = have.min(PROBE);
            src.read_exact_at(&mut buf[..probe], at)?;
            used[c as usize] = !is_zero(&buf[..probe]) || {
                src.read_exact_at(&mut buf[probe..have], at + probe as u64)?;
                !is_zero(&buf[probe..have])
            };
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Seek, SeekFrom, Write};
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

    /// Generates the qcow2 of `raw` into a file, has qemu-img check it and
    /// compare it with the raw image byte for byte; checks the length and
    /// sha256 the upload announces against the bytes; the qcow2's size in
    /// clusters.
    fn convert_and_verify(raw: &Path) -> u64 {
        let out = raw.with_extension("qcow2");
        let q = Qcow2::scan(raw).unwrap();
        let mut file = File::create(&out).unwrap();
        let mut buf = vec![0u8; crate::io::BUF_SIZE];
        let mut chunks = q.chunks();
        while let Some(n) = chunks.next_into(&mut buf).unwrap() {
            assert!(n > 0 && n <= buf.len());
            file.write_all(&buf[..n]).unwrap();
        }
        drop(file);
        assert_eq!(q.len(), std::fs::metadata(&out).unwrap().len());
        assert_eq!(
            q.sha256().unwrap(),
            Sha256::of(&std::fs::read(&out).unwrap())
        );
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
        assert_eq!(
            q.len() % CLUSTER,
            0,
            "{} bytes: not whole clusters",
            q.len()
        );
        q.len() / CLUSTER
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

    /// A cluster whose first 4 KiB are zeros and whose last byte is not
    /// (the scan reads past its probe): sent, and the zero clusters around
    /// it inside the same extent are not.
    #[test]
    fn data_past_the_probe_is_found() {
        let dir = tempfile::tempdir().unwrap();
        let mut extent = vec![0u8; 3 * CLUSTER as usize];
        extent[2 * CLUSTER as usize - 1] = 9;
        let raw = raw_image(dir.path(), 8 << 20, &[(CLUSTER, &extent)]);
        assert_eq!(Qcow2::scan(&raw).unwrap().data_clusters(), 1);
        assert_eq!(convert_and_verify(&raw), FIXED + 1 + 1);
    }
}
