//! A raw image as a qcow2 file holding only its non-zero clusters, for the
//! upload: a Talos disk image is mostly empty partitions, so its qcow2 is a
//! small fraction of the raw bytes, and Proxmox's import (`import-from`,
//! `qemu-img convert`) reads qcow2 as well as raw (pve-storage
//! `src/PVE/Storage/Plugin.pm`: import volumes may be `raw`, `qcow2` or
//! `vmdk`). Streamed: one pass finds the non-zero clusters (a bit each),
//! the second writes tables and clusters in order; nothing holds the image.
//! Layout per the qcow2 specification (QEMU `docs/interop/qcow2.txt`,
//! version 3, 64 KiB clusters, 16-bit refcounts).

use std::fs::File;
use std::io::{self, BufWriter, Read, Seek, SeekFrom, Write};
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

/// Writes the raw image at `raw` as a qcow2 file at `out`; returns the
/// file's size and sha256 (counted as written, for the server's check).
pub(super) fn raw_to_qcow2(raw: &Path, out: &Path) -> io::Result<(u64, Sha256)> {
    let mut src = crate::io::open_regular(raw, false)?;
    let size = src.metadata()?.len();
    let clusters = size.div_ceil(CLUSTER);
    let used = nonzero_clusters(&mut src, clusters)?;
    let data = used.iter().filter(|&&u| u).count() as u64;
    let l1_entries = clusters.div_ceil(ENTRIES).max(1);
    let l2_tables: Vec<u64> = (0..l1_entries)
        .filter(|&t| {
            let first = (t * ENTRIES) as usize;
            used[first..used.len().min(first + ENTRIES as usize)]
                .iter()
                .any(|&u| u)
        })
        .collect();
    let l1_clusters = (l1_entries * 8).div_ceil(CLUSTER);
    // Refcount blocks cover every cluster, themselves included.
    let fixed = 1 + l1_clusters + l2_tables.len() as u64 + data;
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
    let data_at = l2_at + l2_tables.len() as u64;

    let mut w = Hashing {
        inner: BufWriter::with_capacity(crate::io::BUF_SIZE, File::create(out)?),
        hash: sha2::Sha256::new(),
        written: 0,
    };
    // QEMU sizes images in 512-byte sectors (a raw file's tail is read
    // as a zero-padded sector).
    let virtual_size = size.next_multiple_of(512);
    w.write_all(&header(virtual_size, l1_entries, l1_at, rt_at, rt_clusters))?;
    w.pad()?;
    for b in 0..rb {
        w.write_all(&((rb_at + b) * CLUSTER).to_be_bytes())?;
    }
    w.pad()?;
    for _ in 0..total {
        w.write_all(&1u16.to_be_bytes())?;
    }
    w.pad()?;
    let mut next_l2 = l2_at;
    for t in 0..l1_entries {
        let entry = if l2_tables.contains(&t) {
            next_l2 += 1;
            ((next_l2 - 1) * CLUSTER) | COPIED
        } else {
            0
        };
        w.write_all(&entry.to_be_bytes())?;
    }
    w.pad()?;
    let mut next_data = data_at;
    for &t in &l2_tables {
        for i in 0..ENTRIES {
            let c = (t * ENTRIES + i) as usize;
            let entry = if used.get(c).copied().unwrap_or(false) {
                next_data += 1;
                ((next_data - 1) * CLUSTER) | COPIED
            } else {
                0
            };
            w.write_all(&entry.to_be_bytes())?;
        }
    }
    let mut buf = vec![0u8; CLUSTER as usize];
    for (c, _) in used.iter().enumerate().filter(|(_, u)| **u) {
        let at = c as u64 * CLUSTER;
        let len = CLUSTER.min(size - at) as usize;
        buf.fill(0);
        src.seek(SeekFrom::Start(at))?;
        src.read_exact(&mut buf[..len])?;
        w.write_all(&buf)?;
    }
    let Hashing {
        inner,
        hash,
        written,
    } = w;
    let file = inner.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    debug_assert_eq!(written, total * CLUSTER);
    Ok((written, Sha256::from(hash)))
}

/// Which clusters hold a non-zero byte: one streamed read of the image.
fn nonzero_clusters(src: &mut File, clusters: u64) -> io::Result<Vec<bool>> {
    let mut used = Vec::with_capacity(clusters as usize);
    let mut buf = vec![0u8; CLUSTER as usize];
    src.seek(SeekFrom::Start(0))?;
    for _ in 0..clusters {
        let mut got = 0;
        while got < buf.len() {
            match src.read(&mut buf[got..])? {
                0 => break,
                n => got += n,
            }
        }
        used.push(buf[..got].iter().any(|&b| b != 0));
    }
    Ok(used)
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
    use std::process::Command;

    /// qemu-img agrees: the file checks clean, holds the raw bytes, and is
    /// small where the raw image is empty.
    #[test]
    fn qemu_img_reads_back_the_raw_image() {
        let dir = tempfile::tempdir().unwrap();
        let raw = dir.path().join("x.raw");
        let f = File::create(&raw).unwrap();
        let size = (600 << 20) + 12345;
        f.set_len(size).unwrap();
        let mut f = std::fs::OpenOptions::new().write(true).open(&raw).unwrap();
        for at in [0u64, 70_000, 300 << 20, size - 10] {
            f.seek(SeekFrom::Start(at)).unwrap();
            f.write_all(b"talos!!!!!").unwrap();
        }
        drop(f);
        let out = dir.path().join("x.qcow2");
        let (len, sha) = raw_to_qcow2(&raw, &out).unwrap();
        assert_eq!(len, std::fs::metadata(&out).unwrap().len());
        assert_eq!(sha, Sha256::of(&std::fs::read(&out).unwrap()));
        assert!(len < 2 << 20, "{len} bytes for 4 written clusters");
        let check = Command::new("qemu-img")
            .args(["check", "-f", "qcow2"])
            .arg(&out)
            .output()
            .unwrap();
        assert!(
            check.status.success(),
            "{}",
            String::from_utf8_lossy(&check.stdout)
        );
        let cmp = Command::new("qemu-img")
            .args(["compare", "-f", "raw", "-F", "qcow2"])
            .arg(&raw)
            .arg(&out)
            .output()
            .unwrap();
        assert!(
            cmp.status.success(),
            "{}",
            String::from_utf8_lossy(&cmp.stdout)
        );
    }
}
