//! Disk images: format sniffing, GPT lookup, and META read-merge-write.
//! Only the 512 KiB of ADV at the start of META is ever read or written;
//! every other byte of the image is left alone, and nothing holds a whole
//! image in memory.

pub mod qcow2;
mod sparse;

pub use sparse::copy_sparse;

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
    #[error("{}: the GPT has no partition named META (partitions: {})", path.display(), names.join(", "))]
    NoMeta { path: PathBuf, names: Vec<String> },
    #[error("{}: META partition is {size} bytes; Talos' META is exactly 1 MiB", path.display())]
    MetaWrongSize { path: PathBuf, size: u64 },
    #[error(transparent)]
    MetaFull(#[from] crate::meta::AdvError),
    #[error("{}: truncated: partition {name} ends at byte {end} but the file has {len}", path.display())]
    Truncated {
        path: PathBuf,
        name: String,
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
    Qcow2(Box<qcow2::Qcow2>),
}

impl Backend {
    /// Reads `buf.len()` bytes at `offset` (any alignment).
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        match self {
            Backend::Raw(f) => f.read_exact_at(buf, offset),
            Backend::Qcow2(q) => {
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
            Backend::Qcow2(q) => {
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
        let mut file = File::options()
            .read(true)
            .write(writable)
            .open(path)
            .map_err(io(path))?;
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
                let header = qcow2::parse_header(&head).map_err(|reason| DiskError::Qcow2 {
                    path: path.to_owned(),
                    reason,
                })?;
                let size = header.virtual_size;
                drop(file);
                let q = qcow2::Qcow2::open(path, header, writable).map_err(io(path))?;
                (Backend::Qcow2(Box::new(q)), size)
            }
        };
        let partitions = read_gpt(&backend, size, path)?;
        if let Some(p) = partitions.iter().find(|p| p.offset + p.size > size) {
            return Err(DiskError::Truncated {
                path: path.to_owned(),
                name: p.name.clone(),
                end: p.offset + p.size,
                len: size,
            });
        }
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
        let bytes = adv.encode()?;
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
    if head.starts_with(b"QFI\xfb") {
        Some(Format::Qcow2)
    } else if head.len() >= 520 && &head[512..520] == b"EFI PART" {
        Some(Format::Raw)
    } else {
        None
    }
}

fn read_gpt(backend: &Backend, len: u64, path: &Path) -> Result<Vec<Partition>, DiskError> {
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
    Ok(disk
        .partitions()
        .iter()
        .filter(|(_, p)| p.is_used())
        .map(|(&number, p)| Partition {
            number,
            name: p.name.clone(),
            type_guid: p.part_type_guid.guid.to_string().to_uppercase(),
            offset: p.first_lba * SECTOR,
            size: (p.last_lba + 1 - p.first_lba) * SECTOR,
        })
        .collect())
}

/// Writes `out` as a copy of `base` (holes kept) with `edits` applied to
/// META: `Some(value)` sets a key, `None` deletes it; other keys survive.
/// `base` is checked before anything is written, and `out` appears only
/// complete (temp name, fsync, rename).
pub fn write_patched_copy(
    base: &Path,
    out: &Path,
    edits: &[(u32, Option<Vec<u8>>)],
) -> Result<Decoded, DiskError> {
    let before = Image::open(base, false)?.read_meta()?;
    let mut adv = before.adv.clone();
    apply(&mut adv, edits)?;
    let mut tmp = crate::atomic::AtomicFile::create(out, false).map_err(io(out))?;
    let src = File::open(base).map_err(io(base))?;
    copy_sparse(&src, tmp.file()).map_err(io(out))?;
    Image::open(tmp.temp_path(), true)?.write_meta(&adv)?;
    tmp.commit().map_err(io(out))?;
    Ok(before)
}

/// Applies META edits to an ADV.
pub fn apply(adv: &mut Adv, edits: &[(u32, Option<Vec<u8>>)]) -> Result<(), DiskError> {
    for (key, value) in edits {
        match value {
            Some(v) => adv.set(*key, v.clone())?,
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
}

/// The partition named META (by name: its type GUID is shared), exactly 1 MiB.
pub fn find_meta(parts: &[Partition]) -> Result<&Partition, MetaLookup> {
    let meta = parts
        .iter()
        .find(|p| p.name == "META")
        .ok_or(MetaLookup::Missing)?;
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
    fn meta_is_found_by_name_not_by_type() {
        let parts = [part("STATE", META_SIZE), part("META", META_SIZE)];
        assert_eq!(find_meta(&parts).unwrap().name, "META");
        assert_eq!(find_meta(&parts[..1]), Err(MetaLookup::Missing));
        assert_eq!(
            find_meta(&[part("META", 2 * META_SIZE)]),
            Err(MetaLookup::WrongSize(2 * META_SIZE))
        );
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
