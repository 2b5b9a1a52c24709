//! An image opened for META access: raw or qcow2 behind one block
//! interface, its GPT read through the gpt crate only after the layout
//! checks passed; META read and written in place; two images compared.

use super::error::{DiskError, io};
use super::layout::{
    GptHeader, MetaLookup, Partition, SECTOR, check_partition_layout, find_meta, gpt_header_valid,
    precheck_gpt_header,
};
use super::qcow2;
use crate::io::{BUF_SIZE, Magic};
use crate::meta::{Adv, Decoded, adv::ADV_SIZE};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The container format of an image file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    Raw,
    Qcow2,
}

/// Where an image's blocks come from.
#[derive(Debug)]
enum Backend {
    Raw(File),
    /// The image, and the guest ranges its tables map to data.
    Qcow2(Box<qcow2::Qcow2>, qcow2::Allocated),
}

impl Backend {
    /// Reads `buf.len()` bytes at `offset` (any alignment).
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        match self {
            Backend::Raw(f) => f.read_exact_at(buf, offset),
            Backend::Qcow2(q, _) => {
                let start = offset - offset % qcow2::ALIGN;
                let end = (offset + buf.len() as u64).div_ceil(qcow2::ALIGN) * qcow2::ALIGN;
                let mut sectors = vec![0u8; (end - start) as usize];
                q.read_at(&mut sectors, start)?;
                let skip = (offset - start) as usize;
                buf.copy_from_slice(&sectors[skip..skip + buf.len()]);
                Ok(())
            }
        }
    }

    /// Writes sector-aligned data and makes it durable.
    fn write_durably(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        match self {
            Backend::Raw(f) => {
                f.write_all_at(buf, offset)?;
                f.sync_all()
            }
            Backend::Qcow2(q, _) => {
                q.write_at(buf, offset)?;
                q.flush()
            }
        }
    }
}

/// A `Read + Seek` view of an image's blocks, for the GPT reader. With
/// `hide_primary`, LBA 1 reads as zeros, so the reader takes the backup
/// GPT (as sgdisk does when the primary's entry array is unusable).
#[derive(Debug)]
struct BlockCursor<'a> {
    backend: &'a Backend,
    pos: u64,
    len: u64,
    hide_primary: bool,
}

impl Read for BlockCursor<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = (buf.len() as u64).min(self.len.saturating_sub(self.pos)) as usize;
        self.backend.read_at(&mut buf[..n], self.pos)?;
        if self.hide_primary {
            let (from, to) = (self.pos, self.pos + n as u64);
            let (lo, hi) = (from.max(SECTOR), to.min(2 * SECTOR));
            if lo < hi {
                buf[(lo - from) as usize..(hi - from) as usize].fill(0);
            }
        }
        self.pos += n as u64;
        Ok(n)
    }
}

impl Seek for BlockCursor<'_> {
    fn seek(&mut self, to: SeekFrom) -> std::io::Result<u64> {
        let pos = match to {
            SeekFrom::Start(p) => Some(p),
            SeekFrom::End(d) => self.len.checked_add_signed(d),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        self.pos = pos.ok_or_else(|| std::io::Error::other("seek before the start"))?;
        Ok(self.pos)
    }
}

impl Write for BlockCursor<'_> {
    fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
        Err(std::io::Error::other("the GPT is read-only here"))
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// An image opened for META access, its layout checked.
#[derive(Debug)]
pub struct Image {
    path: PathBuf,
    backend: Backend,
    pub format: Format,
    /// The disk size the image presents (a qcow2's virtual size).
    pub size: u64,
    pub partitions: Vec<Partition>,
}

impl Image {
    /// Opens `path`, sniffs its format, checks a qcow2 header ourselves, and
    /// reads the GPT. Nothing is written.
    pub fn open(path: &Path, writable: bool) -> Result<Image, DiskError> {
        let mut file = crate::io::open_regular(path, writable).map_err(io(path))?;
        let file_len = file.metadata().map_err(io(path))?.len();
        let mut head = vec![0u8; 64 * 1024];
        let n = read_up_to(&mut file, &mut head).map_err(io(path))?;
        head.truncate(n);
        let not_image = || DiskError::NotAnImage {
            path: path.to_owned(),
            size: file_len,
        };
        let format = sniff(&head).ok_or_else(not_image)?;
        let (backend, size) = match format {
            Format::Raw => (Backend::Raw(file), file_len),
            Format::Qcow2 => {
                let bad = |reason| DiskError::Qcow2 {
                    path: path.to_owned(),
                    reason,
                };
                let header = qcow2::parse_header(&head).map_err(bad)?;
                let allocated = qcow2::check_tables(&file, &header).map_err(|e| match e {
                    qcow2::TableError::Io(e) => io(path)(e),
                    qcow2::TableError::Bad(reason) => bad(reason),
                    qcow2::TableError::PastEnd { what, end } => DiskError::Truncated {
                        path: path.to_owned(),
                        what,
                        end,
                        len: file_len,
                    },
                })?;
                let size = header.virtual_size;
                drop(file);
                let q = qcow2::Qcow2::open(path, header, writable).map_err(io(path))?;
                (Backend::Qcow2(Box::new(q), allocated), size)
            }
        };
        let partitions = read_gpt(&backend, size, path)?;
        Ok(Image {
            path: path.to_owned(),
            backend,
            format,
            size,
            partitions,
        })
    }

    /// The META partition, checked to be exactly 1 MiB.
    pub fn meta_partition(&self) -> Result<&Partition, DiskError> {
        find_meta(&self.partitions).map_err(|e| match e {
            MetaLookup::Missing => DiskError::NoMeta {
                path: self.path.clone(),
                names: self.partitions.iter().map(|p| p.name.clone()).collect(),
            },
            MetaLookup::WrongSize(size) => DiskError::MetaWrongSize {
                path: self.path.clone(),
                size,
            },
            MetaLookup::Duplicate(numbers) => DiskError::MetaAmbiguous {
                path: self.path.clone(),
                numbers,
            },
        })
    }

    /// Reads and decodes the ADV in META.
    pub fn read_meta(&mut self) -> Result<Decoded, DiskError> {
        let offset = self.meta_partition()?.offset;
        let mut buf = vec![0u8; ADV_SIZE];
        self.backend
            .read_at(&mut buf, offset)
            .map_err(io(&self.path))?;
        Ok(Adv::decode(&buf))
    }

    /// Writes both ADV copies into META and makes them durable. The rest of
    /// the partition (the legacy ADV in its last 1024 bytes among it) is untouched.
    pub fn write_meta(&mut self, adv: &Adv) -> Result<(), DiskError> {
        let bytes = adv.encode().map_err(|source| DiskError::MetaFull {
            path: self.path.clone(),
            source,
        })?;
        let offset = self.meta_partition()?.offset;
        self.backend
            .write_durably(&bytes, offset)
            .map_err(io(&self.path))
    }
}

fn read_up_to(file: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// The format from the first bytes: qcow2 magic, or a GPT header at LBA 1.
pub fn sniff(head: &[u8]) -> Option<Format> {
    match Magic::detect(head) {
        Some(Magic::Qcow2) => Some(Format::Qcow2),
        Some(Magic::Gpt) => Some(Format::Raw),
        _ => None,
    }
}

/// Whether `header`'s entry array lies within the disk and matches its
/// CRC: sgdisk loads the backup table otherwise (gptfdisk `gpt.cc`,
/// `GPTData::LoadMainTable` and the "Main partition table CRC mismatch"
/// recovery).
fn table_intact(backend: &Backend, len: u64, header: &GptHeader) -> bool {
    let Some(range) = header.table_range().filter(|r| r.end <= len) else {
        return false;
    };
    // At most 1024 entries of 128 bytes (checked by the precheck).
    let mut table = vec![0u8; (range.end - range.start) as usize];
    backend.read_at(&mut table, range.start).is_ok() && header.table_matches(&table)
}

/// The header the gpt crate will use, checked, and whether it is the
/// backup: the primary at LBA 1 when its CRC holds and its entry array is
/// intact, else the backup in the disk's last sector (gpt 4.1
/// `GptConfig::open_from_device` falls back on a bad header only; for a
/// bad entry array [`BlockCursor`] hides the primary from it).
fn gpt_header_in_use(
    backend: &Backend,
    len: u64,
    path: &Path,
) -> Result<(GptHeader, bool), DiskError> {
    let no_gpt = |reason: String| DiskError::NoGpt {
        path: path.to_owned(),
        reason,
    };
    let mut primary = [0u8; 512];
    backend.read_at(&mut primary, SECTOR).map_err(io(path))?;
    let usable_primary = gpt_header_valid(&primary)
        && precheck_gpt_header(&primary).is_ok_and(|h| table_intact(backend, len, &h));
    let mut backup = [0u8; 512];
    let last = (len / SECTOR).checked_sub(1).filter(|&l| l >= 2);
    if let Some(last) = last {
        backend
            .read_at(&mut backup, last * SECTOR)
            .map_err(io(path))?;
    }
    // A primary header whose table is gone is used only when there is no
    // backup to take instead (its own error then says what is wrong).
    let use_backup = !usable_primary && gpt_header_valid(&backup);
    let sector = if gpt_header_valid(&primary) && !use_backup {
        primary
    } else {
        if !gpt_header_valid(&backup) {
            return Err(no_gpt(
                "neither the primary GPT header (LBA 1) nor the backup (last LBA) is valid".into(),
            ));
        }
        backup
    };
    let header = precheck_gpt_header(&sector).map_err(no_gpt)?;
    match header.disk_end() {
        Some(end) if end <= len => {}
        end => {
            return Err(DiskError::Truncated {
                path: path.to_owned(),
                what: "the disk its GPT describes (up to the backup header)".into(),
                end: end.unwrap_or(u64::MAX),
                len,
            });
        }
    }
    header
        .check_usable_area()
        .map_err(|reason| DiskError::Layout {
            path: path.to_owned(),
            reason,
        })?;
    Ok((header, use_backup))
}

fn read_gpt(backend: &Backend, len: u64, path: &Path) -> Result<Vec<Partition>, DiskError> {
    let (header, use_backup) = gpt_header_in_use(backend, len, path)?;
    let cursor = BlockCursor {
        backend,
        pos: 0,
        len,
        hide_primary: use_backup,
    };
    let disk = gpt::GptConfig::new()
        .writable(false)
        .logical_block_size(gpt::disk::LogicalBlockSize::Lb512)
        .open_from_device(cursor)
        .map_err(|e| DiskError::NoGpt {
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
    let partitions = disk
        .partitions()
        .iter()
        .filter(|(_, p)| p.is_used())
        .map(|(&number, p)| {
            let bytes = p
                .last_lba
                .checked_add(1)
                .and_then(|end| end.checked_sub(p.first_lba))
                .and_then(|lbas| lbas.checked_mul(SECTOR))
                .zip(p.first_lba.checked_mul(SECTOR));
            let (size, offset) = bytes
                .filter(|(size, offset)| *size > 0 && offset.checked_add(*size).is_some())
                .ok_or_else(|| DiskError::NoGpt {
                    path: path.to_owned(),
                    reason: format!(
                        "partition {number} ({:?}) spans LBA {}..{}, which is not a range",
                        p.name, p.first_lba, p.last_lba
                    ),
                })?;
            Ok(Partition {
                number,
                name: p.name.clone(),
                type_guid: p.part_type_guid.guid.to_string().to_uppercase(),
                offset,
                size,
            })
        })
        .collect::<Result<Vec<_>, DiskError>>()?;
    if let Some(p) = partitions.iter().find(|p| p.offset + p.size > len) {
        return Err(DiskError::Truncated {
            path: path.to_owned(),
            what: format!("partition {:?}", p.name),
            end: p.offset + p.size,
            len,
        });
    }
    check_partition_layout(&header, &partitions).map_err(|reason| DiskError::Layout {
        path: path.to_owned(),
        reason,
    })?;
    Ok(partitions)
}

impl Image {
    /// The byte ranges within `start..end` that may hold data; the rest
    /// reads as zeros (raw: the file's holes, qcow2: unmapped clusters).
    fn data_ranges(&self, start: u64, end: u64) -> std::io::Result<Vec<(u64, u64)>> {
        let clip = |(s, e): (u64, u64)| (s.max(start), e.min(end));
        let ranges: Vec<(u64, u64)> = match &self.backend {
            Backend::Raw(f) => crate::io::data_extents(f, self.size)
                .map(|r| r.map(clip))
                .collect::<std::io::Result<_>>()?,
            Backend::Qcow2(_, allocated) => allocated.iter().copied().map(clip).collect(),
        };
        Ok(ranges.into_iter().filter(|(s, e)| s < e).collect())
    }

    /// Whether both images present the same disk, byte for byte, read
    /// piece by piece through their backends.
    pub fn same_bytes(&self, other: &Image) -> Result<bool, DiskError> {
        Ok(self.size == other.size && same_range(self, 0, other, 0, self.size)?)
    }
}

/// Whether partition `pa` of `a` and `pb` of `b` (of one size) hold the same
/// bytes.
fn same_contents(a: &Image, pa: &Partition, b: &Image, pb: &Partition) -> Result<bool, DiskError> {
    same_range(a, pa.offset, b, pb.offset, pa.size)
}

/// Whether `len` bytes of `a` from `at_a` equal those of `b` from `at_b`.
/// Only ranges where either side has data are read: where both have holes,
/// both read as zeros, so a 1 PiB empty disk compares in no time.
fn same_range(a: &Image, at_a: u64, b: &Image, at_b: u64, len: u64) -> Result<bool, DiskError> {
    let rel = |img: &Image, at: u64| -> Result<Vec<(u64, u64)>, DiskError> {
        Ok(img
            .data_ranges(at, at + len)
            .map_err(io(&img.path))?
            .into_iter()
            .map(|(s, e)| (s - at, e - at))
            .collect())
    };
    let mut ranges = rel(a, at_a)?;
    ranges.extend(rel(b, at_b)?);
    ranges.sort_unstable();
    let (mut ba, mut bb) = (vec![0u8; BUF_SIZE], vec![0u8; BUF_SIZE]);
    let mut done = 0u64;
    for (start, end) in ranges {
        let mut pos = start.max(done);
        while pos < end {
            let n = (end - pos).min(ba.len() as u64) as usize;
            a.backend
                .read_at(&mut ba[..n], at_a + pos)
                .map_err(io(&a.path))?;
            b.backend
                .read_at(&mut bb[..n], at_b + pos)
                .map_err(io(&b.path))?;
            if ba[..n] != bb[..n] {
                return Ok(false);
            }
            pos += n as u64;
        }
        done = done.max(end);
    }
    Ok(true)
}

/// How two images differ, partition by partition and tag by tag.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ImageDiff {
    /// Partitions whose name, offset or size differ, or that only one has.
    pub layout: Vec<String>,
    /// Partitions (by name) present in both with different contents.
    pub contents: Vec<String>,
    /// META keys only in A, only in B, or with different values.
    pub meta: Vec<String>,
    /// Whether the disks hold the same bytes, a qcow2 by the disk it holds.
    #[serde(rename = "sameBytes")]
    pub same_bytes: bool,
}

impl ImageDiff {
    /// The same disk, byte for byte: nothing can tell the images apart.
    pub fn identical(&self) -> bool {
        self.same_bytes
    }

    /// Same layout, partition contents and META tags; the bytes may still
    /// differ (ADV tags in another order, bytes outside the partitions).
    pub fn equivalent(&self) -> bool {
        self.layout.is_empty() && self.contents.is_empty() && self.meta.is_empty()
    }
}

/// Compares two images (raw or qcow2, in any mix). META is compared by
/// decoded tags, since equal tags can sit in differently ordered ADVs; the
/// bytes of equivalent images are compared last.
pub fn diff(a: &Path, b: &Path) -> Result<ImageDiff, DiskError> {
    let (mut ia, mut ib) = (Image::open(a, false)?, Image::open(b, false)?);
    let mut d = ImageDiff::default();
    for pa in &ia.partitions {
        match ib.partitions.iter().find(|pb| pb.name == pa.name) {
            None => d.layout.push(format!("{} only in A", pa.name)),
            Some(pb) if (pa.offset, pa.size) != (pb.offset, pb.size) => d.layout.push(format!(
                "{}: A at {}+{}, B at {}+{}",
                pa.name, pa.offset, pa.size, pb.offset, pb.size
            )),
            Some(pb) if pa.name != "META" => {
                if !same_contents(&ia, pa, &ib, pb)? {
                    d.contents.push(pa.name.clone());
                }
            }
            Some(_) => {}
        }
    }
    for pb in &ib.partitions {
        if !ia.partitions.iter().any(|pa| pa.name == pb.name) {
            d.layout.push(format!("{} only in B", pb.name));
        }
    }
    if ia.meta_partition().is_ok() && ib.meta_partition().is_ok() {
        let (ma, mb) = (ia.read_meta()?.adv, ib.read_meta()?.adv);
        for (k, va) in ma.iter() {
            match mb.get(k) {
                None => d.meta.push(format!("key {k} only in A")),
                Some(vb) if vb != va => d.meta.push(format!("key {k} differs")),
                Some(_) => {}
            }
        }
        for (k, _) in mb.iter() {
            if ma.get(k).is_none() {
                d.meta.push(format!("key {k} only in B"));
            }
        }
    }
    d.same_bytes = d.equivalent() && ia.same_bytes(&ib)?;
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        #![proptest_config(crate::fuzz_config())]
        /// A GPT signature followed by arbitrary header and entry bytes must
        /// give an error or a layout, never a panic.
        #[test]
        fn fuzz_gpt_reader_never_panics(
            header in proptest::collection::vec(proptest::num::u8::ANY, 84),
            entries in proptest::collection::vec(proptest::num::u8::ANY, 0..4096),
            len in 1024u64..(2 << 20),
        ) {
            if !crate::fuzz_time_left() {
                return Ok(());
            }
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("img");
            let mut img = vec![0u8; 1024 + entries.len()];
            img[512..520].copy_from_slice(b"EFI PART");
            img[520..604].copy_from_slice(&header);
            img[1024..].copy_from_slice(&entries);
            std::fs::write(&path, &img).unwrap();
            let f = File::options().write(true).open(&path).unwrap();
            f.set_len(len.max(img.len() as u64)).unwrap();
            let _ = Image::open(&path, false).map(|mut i| i.read_meta());
        }
    }

    fn crc32(b: &[u8]) -> u32 {
        let mut c = flate2::Crc::new();
        c.update(b);
        c.sum()
    }

    proptest::proptest! {
        #![proptest_config(crate::fuzz_config())]
        /// Well-formed CRCs over hostile fields: LBAs out of order or past
        /// the end, odd entry counts and sizes, names without terminators.
        #[test]
        fn fuzz_gpt_with_valid_checksums_never_panics(
            lbas in proptest::collection::vec(proptest::num::u64::ANY, 3),
            num_entries in 0u32..200,
            entry_size in proptest::sample::select(vec![0u32, 64, 128, 256, 129, 4096]),
            entries in proptest::collection::vec(proptest::num::u8::ANY, 0..8192),
            small in proptest::bool::ANY,
        ) {
            if !crate::fuzz_time_left() {
                return Ok(());
            }
            let mut img = vec![0u8; 1024 + 16384];
            let h = &mut img[512..604];
            h[..8].copy_from_slice(b"EFI PART");
            h[8..12].copy_from_slice(&0x0001_0000u32.to_le_bytes());
            h[12..16].copy_from_slice(&92u32.to_le_bytes());
            h[24..32].copy_from_slice(&1u64.to_le_bytes());
            let pick = |v: u64| if small { v % 8192 } else { v };
            h[32..40].copy_from_slice(&pick(lbas[0]).to_le_bytes());
            h[40..48].copy_from_slice(&pick(lbas[1]).to_le_bytes());
            h[48..56].copy_from_slice(&pick(lbas[2]).to_le_bytes());
            h[72..80].copy_from_slice(&2u64.to_le_bytes());
            h[80..84].copy_from_slice(&num_entries.to_le_bytes());
            h[84..88].copy_from_slice(&entry_size.to_le_bytes());
            img[1024..1024 + entries.len()].copy_from_slice(&entries);
            let table = (num_entries as usize * entry_size as usize).min(16384);
            let ecrc = crc32(&img[1024..1024 + table]);
            img[512 + 88..512 + 92].copy_from_slice(&ecrc.to_le_bytes());
            let hcrc = crc32(&img[512..604]);
            img[512 + 16..512 + 20].copy_from_slice(&hcrc.to_le_bytes());
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("img");
            std::fs::write(&path, &img).unwrap();
            let _ = Image::open(&path, false).map(|mut i| i.read_meta());
        }
    }

    /// A 4 MiB disk partitioned by sgdisk: one partition named META.
    fn sgdisk_image(dir: &Path) -> PathBuf {
        let path = dir.join("disk.raw");
        std::fs::File::create(&path)
            .unwrap()
            .set_len(4 << 20)
            .unwrap();
        let out = std::process::Command::new("sgdisk")
            .args(["-n", "1:2048:4095", "-c", "1:META"])
            .arg(&path)
            .output()
            .expect("sgdisk (package gdisk)");
        assert!(out.status.success(), "{out:?}");
        path
    }

    #[test]
    fn a_primary_table_past_the_end_is_read_from_the_backup_as_sgdisk_does() {
        let dir = tempfile::tempdir().unwrap();
        let path = sgdisk_image(dir.path());
        // The primary header says its entries lie far past the disk's end;
        // its own CRC is made right, so only the table is wrong.
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let mut h = [0u8; 92];
        f.read_exact_at(&mut h, SECTOR).unwrap();
        h[72..80].copy_from_slice(&(1u64 << 40).to_le_bytes());
        h[16..20].fill(0);
        let mut c = flate2::Crc::new();
        c.update(&h);
        h[16..20].copy_from_slice(&c.sum().to_le_bytes());
        f.write_all_at(&h, SECTOR).unwrap();
        drop(f);
        // What sgdisk does with it: the backup table instead.
        let out = std::process::Command::new("sgdisk")
            .arg("-p")
            .arg(&path)
            .output()
            .unwrap();
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("Loaded backup partition table"),
            "{out:?}"
        );
        let image = Image::open(&path, false).unwrap();
        let meta = image.meta_partition().unwrap();
        assert_eq!((meta.offset, meta.size), (2048 * 512, 1 << 20));
        // A table whose CRC does not match goes the same way.
        let path = sgdisk_image(dir.path());
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.write_all_at(b"garbage", 2 * SECTOR + 56).unwrap();
        drop(f);
        let image = Image::open(&path, false).unwrap();
        assert_eq!(image.partitions[0].name, "META");
    }

    #[test]
    fn sniffing_knows_qcow2_gpt_and_garbage() {
        let mut raw = vec![0u8; 1024];
        raw[512..520].copy_from_slice(b"EFI PART");
        assert_eq!(sniff(&raw), Some(Format::Raw));
        assert_eq!(sniff(b"QFI\xfb\0\0\0\x03"), Some(Format::Qcow2));
        assert_eq!(sniff(b"Not Found"), None);
        assert_eq!(sniff(&[0u8; 1024]), None);
    }
}
