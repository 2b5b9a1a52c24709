//! Disk images as the simulators see them: the GPT and Talos META (after
//! siderolabs/talos internal/pkg/meta/internal/adv/talos/talos.go), read and written
//! with this crate's own code, never imgbuild's. The factory bakes META with it;
//! the Proxmox simulator reads key 10 from a VM's disk with it.
//!
//! Find the partition named META in the GPT, read the ADV (copy 1, else
//! copy 2), merge keys, write both copies back. The partition's last 1024
//! bytes (legacy syslinux ADV) and everything outside the first 512 KiB of
//! META are left alone.

use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

const COPY: usize = 256 * 1024;
const MAGIC1: u32 = 0x5a4b_3c2d;
const MAGIC2: u32 = 0xa5b4_c3d2;
const SUM_AT: usize = 0x3FFDC;
const MAGIC2_AT: usize = 0x3FFFC;
/// Bytes the entries may take, 8 of header each included (Talos's limit).
const CAPACITY: usize = 262_104 - 20;
const BLOCK: usize = 1 << 20;

/// Copies `from` to `to` writing no all-zero block, so a sparse base
/// stays sparse.
pub fn sparse_copy(from: &Path, to: &Path) -> anyhow::Result<()> {
    let mut src = File::open(from)?;
    let len = src.metadata()?.len();
    let mut dst = File::create(to)?;
    let mut buf = vec![0u8; BLOCK];
    loop {
        let n = read_full(&mut src, &mut buf)?;
        if n == 0 {
            break;
        }
        if buf[..n].iter().all(|&b| b == 0) {
            dst.seek(SeekFrom::Current(n as i64))?;
        } else {
            dst.write_all(&buf[..n])?;
        }
    }
    dst.set_len(len)?;
    dst.sync_all()?;
    Ok(())
}

fn read_full(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Byte offset and size of the partition named `name` in a GPT disk
/// (512- or 4096-byte sectors, as the header's location tells).
pub fn find_partition(disk: &mut File, name: &str) -> anyhow::Result<(u64, u64)> {
    let mut header = [0u8; 92];
    let mut sector = 0;
    for s in [512u64, 4096] {
        disk.seek(SeekFrom::Start(s))?;
        if read_full(disk, &mut header)? == 92 && &header[..8] == b"EFI PART" {
            sector = s;
            break;
        }
    }
    anyhow::ensure!(sector != 0, "no GPT header");
    let entries_at = le64(&header, 72) * sector;
    let count = le32(&header, 80) as usize;
    let size = le32(&header, 84) as usize;
    anyhow::ensure!((128..=4096).contains(&size), "GPT entry size {size}");
    let mut table = vec![0u8; count.min(1024) * size];
    disk.seek(SeekFrom::Start(entries_at))?;
    disk.read_exact(&mut table)?;
    for e in table.chunks(size) {
        let units: Vec<u16> = e[56..128]
            .chunks(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .take_while(|&u| u != 0)
            .collect();
        if e[..16].iter().any(|&b| b != 0) && String::from_utf16_lossy(&units) == name {
            let (first, last) = (le64(e, 32), le64(e, 40));
            return Ok((first * sector, (last + 1 - first) * sector));
        }
    }
    anyhow::bail!("no partition named {name}")
}

/// The tags of one ADV copy, or why it is not valid.
pub fn read_copy(copy: &[u8]) -> Result<BTreeMap<u32, Vec<u8>>, String> {
    if be32(copy, 0) != MAGIC1 || be32(copy, MAGIC2_AT) != MAGIC2 {
        return Err("bad magic".into());
    }
    let mut zeroed = copy.to_vec();
    zeroed[SUM_AT..SUM_AT + 32].fill(0);
    if Sha256::digest(&zeroed)[..] != copy[SUM_AT..SUM_AT + 32] {
        return Err("bad checksum".into());
    }
    let mut tags = BTreeMap::new();
    let mut at = 4;
    while at + 8 <= SUM_AT {
        let (tag, size) = (be32(copy, at), be32(copy, at + 4) as usize);
        if tag == 0 {
            break;
        }
        let end = at + 8 + size;
        if end > SUM_AT {
            return Err(format!("tag {tag} runs past the data"));
        }
        tags.insert(tag, copy[at + 8..end].to_vec());
        at = end;
    }
    Ok(tags)
}

/// The tags of META's ADV (both copies in `both`): copy 1 if valid, else
/// copy 2, else why neither is.
pub fn read_adv(both: &[u8]) -> Result<BTreeMap<u32, Vec<u8>>, String> {
    read_copy(&both[..COPY]).or_else(|first| {
        read_copy(&both[COPY..2 * COPY])
            .map_err(|second| format!("copy 1: {first}, copy 2: {second}"))
    })
}

/// The tags in the META partition of the raw disk image at `path`.
pub fn read_meta(path: &Path) -> Result<BTreeMap<u32, Vec<u8>>, String> {
    let mut disk = File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let (at, size) = find_partition(&mut disk, "META").map_err(|e| e.to_string())?;
    if size < 2 * COPY as u64 {
        return Err(format!("META is only {size} bytes"));
    }
    let mut both = vec![0u8; 2 * COPY];
    disk.seek(SeekFrom::Start(at))
        .and_then(|_| disk.read_exact(&mut both))
        .map_err(|e| format!("reading META: {e}"))?;
    read_adv(&both).map_err(|e| format!("META holds no valid ADV ({e})"))
}

/// One ADV copy holding `tags` in ascending order.
pub fn write_copy(tags: &BTreeMap<u32, Vec<u8>>) -> anyhow::Result<Vec<u8>> {
    let used: usize = tags.values().map(|v| 8 + v.len()).sum();
    anyhow::ensure!(used <= CAPACITY, "META is full: {used} > {CAPACITY} bytes");
    let mut copy = vec![0u8; COPY];
    copy[..4].copy_from_slice(&MAGIC1.to_be_bytes());
    let mut at = 4;
    for (tag, value) in tags {
        copy[at..at + 4].copy_from_slice(&tag.to_be_bytes());
        copy[at + 4..at + 8].copy_from_slice(&(value.len() as u32).to_be_bytes());
        copy[at + 8..at + 8 + value.len()].copy_from_slice(value);
        at += 8 + value.len();
    }
    copy[MAGIC2_AT..].copy_from_slice(&MAGIC2.to_be_bytes());
    let sum = Sha256::digest(&copy);
    copy[SUM_AT..SUM_AT + 32].copy_from_slice(&sum);
    Ok(copy)
}

/// Sets `tags` in the META of the disk image at `path`, in place; the
/// keys already there survive unless overwritten.
pub fn merge_meta(path: &Path, tags: &[(u32, Vec<u8>)]) -> anyhow::Result<()> {
    let mut disk = OpenOptions::new().read(true).write(true).open(path)?;
    let (at, size) = find_partition(&mut disk, "META")?;
    anyhow::ensure!(size >= 2 * COPY as u64 + 1024, "META is only {size} bytes");
    let mut both = vec![0u8; 2 * COPY];
    disk.seek(SeekFrom::Start(at))?;
    disk.read_exact(&mut both)?;
    let mut current = read_copy(&both[..COPY])
        .or_else(|_| read_copy(&both[COPY..]))
        .unwrap_or_default();
    current.extend(tags.iter().cloned());
    let copy = write_copy(&current)?;
    disk.seek(SeekFrom::Start(at))?;
    disk.write_all(&copy)?;
    disk.write_all(&copy)?;
    disk.sync_all()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Public vectors (derived from talos.go's layout; the repository's
    /// meta ADV vectors): one copy holding only tag 10 = "foo".
    const FOO_FIRST_16: &str = "5a4b3c2d0000000a00000003666f6f00";
    const FOO_CHECKSUM: &str = "0974af06e9457710d1abb21c12a59893c13f6918b114be059da051b0f40ffd6b";
    const EMPTY_CHECKSUM: &str = "e7a327df2cfb2c3010ac1a387e9573d46ea52cac7f25db80ad8fbb41aceabf70";

    fn hex(b: &[u8]) -> String {
        crate::factory::state::hex_lower(b)
    }

    #[test]
    fn adv_copy_matches_the_published_vectors() {
        let copy = write_copy(&BTreeMap::from([(10, b"foo".to_vec())])).unwrap();
        assert_eq!(copy.len(), COPY);
        assert_eq!(hex(&copy[..16]), FOO_FIRST_16);
        assert_eq!(hex(&copy[SUM_AT..SUM_AT + 32]), FOO_CHECKSUM);
        assert_eq!(hex(&copy[MAGIC2_AT..]), "a5b4c3d2");
        let empty = write_copy(&BTreeMap::new()).unwrap();
        assert_eq!(hex(&empty[SUM_AT..SUM_AT + 32]), EMPTY_CHECKSUM);
    }

    #[test]
    fn a_copy_reads_back_and_a_flipped_byte_is_refused() {
        let tags = BTreeMap::from([(10, b"addresses: []".to_vec()), (17, b"dual-boot".to_vec())]);
        let mut copy = write_copy(&tags).unwrap();
        assert_eq!(read_copy(&copy).unwrap(), tags);
        copy[20] ^= 1;
        assert_eq!(read_copy(&copy).unwrap_err(), "bad checksum");
    }

    #[test]
    fn the_second_copy_stands_in_for_a_broken_first() {
        let tags = BTreeMap::from([(10, b"hostnames: []".to_vec())]);
        let copy = write_copy(&tags).unwrap();
        let mut both = [copy.clone(), copy].concat();
        both[0] ^= 1;
        assert_eq!(read_adv(&both).unwrap(), tags);
        both[COPY + 8] ^= 1;
        assert_eq!(
            read_adv(&both).unwrap_err(),
            "copy 1: bad magic, copy 2: bad checksum"
        );
    }

    #[test]
    fn an_over_full_adv_is_refused() {
        let tags = BTreeMap::from([(10, vec![b'x'; CAPACITY - 7])]);
        assert!(
            write_copy(&tags)
                .unwrap_err()
                .to_string()
                .contains("META is full")
        );
        let tags = BTreeMap::from([(10, vec![b'x'; CAPACITY - 8])]);
        assert!(write_copy(&tags).is_ok());
    }
}
