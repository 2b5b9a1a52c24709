//! Disk images: format sniffing, GPT lookup, and META read-merge-write.
//! Only the 512 KiB of ADV at the start of META is ever read or written;
//! every other byte of the image is left alone, and nothing holds a whole
//! image in memory.

pub mod edit;
#[cfg(test)]
mod fuzz;
pub mod qcow2;
mod sparse;

pub use sparse::copy_sparse;
pub(crate) use sparse::write_data_blocks;

use crate::io::{BUF_SIZE, Magic};
use crate::meta::{Adv, Decoded, adv::ADV_SIZE};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// META is exactly this large in every Talos image.
pub const META_SIZE: u64 = 1024 * 1024;
const SECTOR: u64 = 512;

/// The container format of an image file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    Raw,
    Qcow2,
}

/// One GPT partition, with its byte range in the image.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Partition {
    pub number: u32,
    pub name: String,
    pub type_guid: String,
    pub offset: u64,
    pub size: u64,
}

/// Why an image could not be read or patched.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("{}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: not a disk image ({size} bytes, no GPT signature at LBA 1)", path.display())]
    NotAnImage { path: PathBuf, size: u64 },
    #[error("{}: {reason}", path.display())]
    Qcow2 {
        path: PathBuf,
        reason: qcow2::HeaderError,
    },
    #[error("{}: no valid GPT: {reason}", path.display())]
    NoGpt { path: PathBuf, reason: String },
    #[error("{}: unsafe GPT layout: {reason}", path.display())]
    Layout { path: PathBuf, reason: String },
    #[error("{}: the GPT has no partition named META (partitions: {})", path.display(), names.join(", "))]
    NoMeta { path: PathBuf, names: Vec<String> },
    #[error(
        "{}: {} partitions are named META ({}); refusing to guess which one Talos reads",
        path.display(),
        numbers.len(),
        numbers.iter().map(|n| format!("#{n}")).collect::<Vec<_>>().join(", ")
    )]
    MetaAmbiguous { path: PathBuf, numbers: Vec<u32> },
    #[error("{}: META partition is {size} bytes; Talos' META is exactly 1 MiB", path.display())]
    MetaWrongSize { path: PathBuf, size: u64 },
    #[error("{}", path.display())]
    MetaFull {
        path: PathBuf,
        source: crate::meta::AdvError,
    },
    #[error("{}: truncated: {what} ends at byte {end} but the image has {len}", path.display())]
    Truncated {
        path: PathBuf,
        what: String,
        end: u64,
        len: u64,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DiskError + '_ {
    move |source| DiskError::Io {
        path: path.to_owned(),
        source,
    }
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

/// A `Read + Seek` view of an image's blocks, for the GPT reader.
#[derive(Debug)]
struct BlockCursor<'a> {
    backend: &'a Backend,
    pos: u64,
    len: u64,
}

impl Read for BlockCursor<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = (buf.len() as u64).min(self.len.saturating_sub(self.pos)) as usize;
        self.backend.read_at(&mut buf[..n], self.pos)?;
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

/// The fields of a GPT header imgbuild checks (UEFI 2.10, 5.3.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptHeader {
    pub current_lba: u64,
    pub backup_lba: u64,
    pub first_usable: u64,
    pub last_usable: u64,
    pub entries_lba: u64,
    pub entries: u32,
    pub entry_size: u32,
}

fn gpt_crc32(b: &[u8]) -> u32 {
    let mut c = flate2::Crc::new();
    c.update(b);
    c.sum()
}

/// Whether the gpt crate takes `sector` as a header: the signature, and a
/// CRC32 over its first 92 bytes (gpt 4.1 `header::file_read_header`).
fn gpt_header_valid(sector: &[u8]) -> bool {
    if sector.len() < 92 || &sector[..8] != b"EFI PART" {
        return false;
    }
    let mut h = sector[..92].to_vec();
    let stored = u32::from_le_bytes(h[16..20].try_into().expect("4 bytes"));
    h[16..20].fill(0);
    gpt_crc32(&h) == stored
}

/// The checks the gpt crate asserts (panics) on instead of returning an
/// error, and the bounds of what it allocates, made on the header it will
/// use before it sees the disk.
pub fn precheck_gpt_header(sector: &[u8]) -> Result<GptHeader, String> {
    if sector.len() < 92 || &sector[..8] != b"EFI PART" {
        return Err("no GPT signature".into());
    }
    let le32 = |at: usize| u32::from_le_bytes(sector[at..at + 4].try_into().expect("4 bytes"));
    let le64 = |at: usize| u64::from_le_bytes(sector[at..at + 8].try_into().expect("8 bytes"));
    let (header_size, entries, entry_size) = (le32(12), le32(80), le32(84));
    if !(92..=512).contains(&header_size) {
        return Err(format!("header size {header_size} is outside 92..=512"));
    }
    if entry_size != 128 {
        return Err(format!(
            "partition entry size {entry_size} (only 128 is supported)"
        ));
    }
    if entries > 1024 {
        return Err(format!(
            "{entries} partition entries (at most 1024 are supported)"
        ));
    }
    Ok(GptHeader {
        current_lba: le64(24),
        backup_lba: le64(32),
        first_usable: le64(40),
        last_usable: le64(48),
        entries_lba: le64(72),
        entries,
        entry_size,
    })
}

impl GptHeader {
    /// Where the disk this header describes ends: just past the later of
    /// its two headers. An image shorter than that lost its tail.
    pub fn disk_end(&self) -> Option<u64> {
        self.current_lba
            .max(self.backup_lba)
            .checked_add(1)?
            .checked_mul(SECTOR)
    }

    /// Checks that partitions can only live where no GPT structure does:
    /// the usable LBAs lie past the protective MBR, the first header and
    /// its entry array, and before the second entry array and header.
    pub fn check_usable_area(&self) -> Result<(), String> {
        let table = (u64::from(self.entries) * u64::from(self.entry_size)).div_ceil(SECTOR);
        let (lo, hi) = (
            self.current_lba.min(self.backup_lba),
            self.current_lba.max(self.backup_lba),
        );
        let (first, last) = (self.first_usable, self.last_usable);
        let own_table = self.entries_lba..self.entries_lba.saturating_add(table);
        let ok = first <= last
            && lo >= 1
            && first >= lo.saturating_add(1).saturating_add(table)
            && last.saturating_add(table) < hi
            && (own_table.end <= first || own_table.start > last);
        if ok {
            Ok(())
        } else {
            Err(format!(
                "usable LBAs {first}..={last} overlap the GPT's own structures \
                 (headers at LBA {lo} and {hi}, {table}-sector entry arrays, entries at LBA {})",
                self.entries_lba
            ))
        }
    }
}

/// Partitions that lie outside the usable LBAs (on the MBR or the GPT) or
/// on each other: writing META into one would destroy another structure.
pub fn check_partition_layout(header: &GptHeader, parts: &[Partition]) -> Result<(), String> {
    let lba = |p: &Partition| (p.offset / SECTOR, (p.offset + p.size) / SECTOR - 1);
    for p in parts {
        let (first, last) = lba(p);
        if first < header.first_usable || last > header.last_usable {
            return Err(format!(
                "partition {} ({:?}) spans LBA {first}..={last}, outside the usable LBAs {}..={} \
                 (it lies on the partition table)",
                p.number, p.name, header.first_usable, header.last_usable
            ));
        }
    }
    let mut sorted: Vec<&Partition> = parts.iter().collect();
    sorted.sort_by_key(|p| p.offset);
    for pair in sorted.windows(2) {
        if pair[0].offset + pair[0].size > pair[1].offset {
            return Err(format!(
                "partitions {} ({:?}) and {} ({:?}) overlap",
                pair[0].number, pair[0].name, pair[1].number, pair[1].name
            ));
        }
    }
    Ok(())
}

/// The header the gpt crate will use (the primary at LBA 1 when its CRC
/// holds, else the backup in the disk's last sector: gpt 4.1
/// `GptConfig::open_from_device`), checked.
fn gpt_header_in_use(backend: &Backend, len: u64, path: &Path) -> Result<GptHeader, DiskError> {
    let no_gpt = |reason: String| DiskError::NoGpt {
        path: path.to_owned(),
        reason,
    };
    let mut primary = [0u8; 512];
    backend.read_at(&mut primary, SECTOR).map_err(io(path))?;
    let sector = if gpt_header_valid(&primary) {
        primary
    } else {
        let mut backup = [0u8; 512];
        let last = (len / SECTOR).checked_sub(1).filter(|&l| l >= 2);
        if let Some(last) = last {
            backend
                .read_at(&mut backup, last * SECTOR)
                .map_err(io(path))?;
        }
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
    Ok(header)
}

fn read_gpt(backend: &Backend, len: u64, path: &Path) -> Result<Vec<Partition>, DiskError> {
    let header = gpt_header_in_use(backend, len, path)?;
    let cursor = BlockCursor {
        backend,
        pos: 0,
        len,
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
            Backend::Raw(f) => sparse::data_extents(f, self.size)
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

/// Writes `out` as a copy of `base` (holes kept) with `edits` applied to
/// META: `Some(value)` sets a key, `None` deletes it; other keys survive in
/// their order. When the edits change no tag, META is not rewritten and
/// `out` is `base` byte for byte (blocks shared where the filesystem can).
/// `base` is checked before anything is written, and `out` appears only
/// complete (temp name, fsync, rename).
pub fn write_patched_copy(
    base: &Path,
    out: &Path,
    edits: &[(u32, Option<Vec<u8>>)],
) -> Result<Decoded, DiskError> {
    let before = Image::open(base, false)?.read_meta()?;
    let mut adv = before.adv.clone();
    apply(out, &mut adv, edits)?;
    let mut tmp = crate::atomic::AtomicFile::create(out, false).map_err(io(out))?;
    let src = crate::io::open_regular(base, false).map_err(io(base))?;
    copy_sparse(&src, tmp.file()).map_err(io(out))?;
    if adv != before.adv {
        Image::open(tmp.temp_path(), true)?.write_meta(&adv)?;
    }
    tmp.commit().map_err(io(out))?;
    Ok(before)
}

/// Applies META edits to the ADV of `image` (named when it would overflow).
pub fn apply(
    image: &Path,
    adv: &mut Adv,
    edits: &[(u32, Option<Vec<u8>>)],
) -> Result<(), DiskError> {
    for (key, value) in edits {
        match value {
            Some(v) => adv
                .set(*key, v.clone())
                .map_err(|source| DiskError::MetaFull {
                    path: image.to_owned(),
                    source,
                })?,
            None => {
                adv.delete(*key);
            }
        }
    }
    Ok(())
}

/// Why [`find_meta`] found no usable META.
#[derive(Debug, PartialEq, Eq)]
pub enum MetaLookup {
    Missing,
    WrongSize(u64),
    /// Several partitions are named META (their numbers).
    Duplicate(Vec<u32>),
}

/// The one partition named META (by name: its type GUID is shared),
/// exactly 1 MiB. Two named META are refused: editing the first while Talos
/// reads the other would lose the update silently.
pub fn find_meta(parts: &[Partition]) -> Result<&Partition, MetaLookup> {
    let named: Vec<&Partition> = parts.iter().filter(|p| p.name == "META").collect();
    if named.len() > 1 {
        return Err(MetaLookup::Duplicate(
            named.iter().map(|p| p.number).collect(),
        ));
    }
    let meta = named.first().ok_or(MetaLookup::Missing)?;
    if meta.size != META_SIZE {
        return Err(MetaLookup::WrongSize(meta.size));
    }
    Ok(meta)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(name: &str, size: u64) -> Partition {
        Partition {
            number: 1,
            name: name.into(),
            type_guid: "0FC63DAF-8483-4772-8E79-3D69D8477DE4".into(),
            offset: 1 << 20,
            size,
        }
    }

    #[test]
    fn meta_full_names_the_image() {
        let mut adv = Adv::default();
        let big = vec![b'x'; 300 * 1024];
        let err = apply(Path::new("out/cp-01.raw"), &mut adv, &[(10, Some(big))]).unwrap_err();
        assert_eq!(err.to_string(), "out/cp-01.raw");
        let why = std::error::Error::source(&err).unwrap().to_string();
        assert!(why.starts_with("META is full"), "{why}");
        assert_eq!(adv, Adv::default(), "nothing was set");
    }

    #[test]
    fn meta_is_found_by_name_not_by_type() {
        let parts = [part("STATE", META_SIZE), part("META", META_SIZE)];
        assert_eq!(find_meta(&parts).unwrap().name, "META");
        assert_eq!(find_meta(&parts[..1]), Err(MetaLookup::Missing));
        let mut twice = [part("META", META_SIZE), part("META", META_SIZE)];
        twice[1].number = 4;
        assert_eq!(find_meta(&twice), Err(MetaLookup::Duplicate(vec![1, 4])));
        assert_eq!(
            find_meta(&[part("META", 2 * META_SIZE)]),
            Err(MetaLookup::WrongSize(2 * META_SIZE))
        );
    }

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

    /// A real qcow2 (made by qemu-img from a GPT disk with META) to corrupt.
    fn qcow2_fixture() -> Vec<u8> {
        std::fs::read(fuzz::fixtures().join("dual-boot.qcow2")).unwrap()
    }

    proptest::proptest! {
        #![proptest_config(crate::fuzz_config())]
        /// A valid header over corrupted tables (L1, refcounts, L2): opening
        /// and reading META give an error or data, never a panic or a hang.
        #[test]
        fn fuzz_qcow2_tables_never_panic(
            edits in proptest::collection::vec((0usize..0x60000, proptest::num::u8::ANY), 1..64),
        ) {
            if !crate::fuzz_time_left() {
                return Ok(());
            }
            let mut img = qcow2_fixture();
            for (at, byte) in edits {
                // Keep the first 112 header bytes, so our check passes and
                // the corruption reaches qcow2-rs.
                let at = 112 + at % (img.len() - 112);
                img[at] = byte;
            }
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("f.qcow2");
            std::fs::write(&path, &img).unwrap();
            let _ = Image::open(&path, false).map(|mut i| i.read_meta());
        }
    }

    #[test]
    fn gpt_headers_the_crate_would_panic_on_are_refused() {
        let mut h = vec![0u8; 512];
        h[..8].copy_from_slice(b"EFI PART");
        h[12..16].copy_from_slice(&92u32.to_le_bytes());
        h[80..84].copy_from_slice(&128u32.to_le_bytes());
        h[84..88].copy_from_slice(&128u32.to_le_bytes());
        assert!(precheck_gpt_header(&h).is_ok());
        h[84..88].copy_from_slice(&256u32.to_le_bytes());
        assert!(
            precheck_gpt_header(&h)
                .unwrap_err()
                .contains("entry size 256")
        );
        h[84..88].copy_from_slice(&128u32.to_le_bytes());
        h[80..84].copy_from_slice(&100_000u32.to_le_bytes());
        assert!(
            precheck_gpt_header(&h)
                .unwrap_err()
                .contains("100000 partition entries")
        );
        h[12..16].copy_from_slice(&8u32.to_le_bytes());
        assert!(
            precheck_gpt_header(&h)
                .unwrap_err()
                .contains("header size 8")
        );
        assert!(precheck_gpt_header(&[0u8; 512]).is_err());
    }

    /// sgdisk's layout of a 32 MiB disk: headers at LBA 1 and 65535, 128
    /// entries (32 sectors) at LBA 2 and before the backup.
    fn standard_header() -> GptHeader {
        GptHeader {
            current_lba: 1,
            backup_lba: 65535,
            first_usable: 34,
            last_usable: 65502,
            entries_lba: 2,
            entries: 128,
            entry_size: 128,
        }
    }

    #[test]
    fn usable_areas_that_overlap_the_gpt_are_refused() {
        let h = standard_header();
        assert_eq!(h.check_usable_area(), Ok(()));
        assert_eq!(h.disk_end(), Some(32 << 20));
        let backup = GptHeader {
            current_lba: 65535,
            backup_lba: 1,
            entries_lba: 65503,
            ..h
        };
        assert_eq!(backup.check_usable_area(), Ok(()));
        for bad in [
            GptHeader {
                first_usable: 0,
                ..h
            },
            GptHeader {
                first_usable: 33,
                ..h
            },
            GptHeader {
                last_usable: 65503,
                ..h
            },
            GptHeader {
                entries_lba: 40,
                ..h
            },
            GptHeader {
                first_usable: 70000,
                ..h
            },
        ] {
            let err = bad.check_usable_area().unwrap_err();
            assert!(err.contains("overlap the GPT's own structures"), "{err}");
        }
    }

    #[test]
    fn partitions_on_the_gpt_or_on_each_other_are_refused() {
        let h = standard_header();
        let at = |number, name: &str, first: u64, last: u64| Partition {
            number,
            name: name.into(),
            type_guid: String::new(),
            offset: first * SECTOR,
            size: (last - first + 1) * SECTOR,
        };
        let good = [at(1, "EFI", 2048, 4095), at(2, "META", 4096, 6143)];
        assert_eq!(check_partition_layout(&h, &good), Ok(()));
        let err = check_partition_layout(&h, &[at(4, "META", 0, 2047)]).unwrap_err();
        assert!(
            err.contains("partition 4 (\"META\") spans LBA 0..=2047"),
            "{err}"
        );
        let err = check_partition_layout(&h, &[at(1, "X", 65000, 65535)]).unwrap_err();
        assert!(err.contains("outside the usable LBAs 34..=65502"), "{err}");
        let err =
            check_partition_layout(&h, &[good[1].clone(), at(3, "BOOT", 6000, 7000)]).unwrap_err();
        assert_eq!(err, "partitions 2 (\"META\") and 3 (\"BOOT\") overlap");
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
