//! Disk images: format sniffing, GPT lookup, and META read-merge-write.
//! Only the 512 KiB of ADV at the start of META is ever read or written;
//! every other byte of the image is left alone, and nothing holds a whole
//! image in memory.

mod sparse;

pub use sparse::copy_sparse;

use crate::meta::{Adv, Decoded, adv::ADV_SIZE};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
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
    #[error("{}: qcow2 images are not supported yet; convert with `qemu-img convert -O raw`", path.display())]
    Qcow2Unsupported { path: PathBuf },
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

/// An image opened for META access, its layout checked.
#[derive(Debug)]
pub struct Image {
    path: PathBuf,
    file: File,
    pub format: Format,
    pub size: u64,
    pub partitions: Vec<Partition>,
}

impl Image {
    /// Opens `path`, sniffs its format and reads its GPT.
    pub fn open(path: &Path, writable: bool) -> Result<Image, DiskError> {
        let file = File::options()
            .read(true)
            .write(writable)
            .open(path)
            .map_err(io(path))?;
        Self::from_file(file, path)
    }

    /// Like [`Image::open`] for a file already open (e.g. a temporary copy).
    pub fn from_file(mut file: File, path: &Path) -> Result<Image, DiskError> {
        file.seek(SeekFrom::Start(0)).map_err(io(path))?;
        let size = file.metadata().map_err(io(path))?.len();
        let mut head = [0u8; 1024];
        let n = read_up_to(&mut file, &mut head).map_err(io(path))?;
        let format = sniff(&head[..n]).ok_or_else(|| DiskError::NotAnImage {
            path: path.to_owned(),
            size,
        })?;
        if format == Format::Qcow2 {
            return Err(DiskError::Qcow2Unsupported {
                path: path.to_owned(),
            });
        }
        let partitions = read_gpt(&mut file, path)?;
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
            file,
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
        self.file
            .seek(SeekFrom::Start(offset))
            .and_then(|_| self.file.read_exact(&mut buf))
            .map_err(io(&self.path))?;
        Ok(Adv::decode(&buf))
    }

    /// Writes both ADV copies into META and syncs. The rest of the
    /// partition (the legacy ADV in its last 1024 bytes among it) is untouched.
    pub fn write_meta(&mut self, adv: &Adv) -> Result<(), DiskError> {
        let bytes = adv.encode()?;
        let offset = self.meta_partition()?.offset;
        self.file
            .seek(SeekFrom::Start(offset))
            .and_then(|_| self.file.write_all(&bytes))
            .and_then(|_| self.file.sync_all())
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

fn read_gpt(file: &mut File, path: &Path) -> Result<Vec<Partition>, DiskError> {
    let clone = file.try_clone().map_err(io(path))?;
    let disk = gpt::GptConfig::new()
        .writable(false)
        .logical_block_size(gpt::disk::LogicalBlockSize::Lb512)
        .open_from_device(clone)
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
    let mut src = Image::open(base, false)?;
    let before = src.read_meta()?;
    let mut adv = before.adv.clone();
    apply(&mut adv, edits)?;
    let mut tmp = crate::atomic::AtomicFile::create(out, false).map_err(io(out))?;
    copy_sparse(&src.file, tmp.file()).map_err(io(out))?;
    let copy = tmp.file().try_clone().map_err(io(out))?;
    let mut dst = Image::from_file(copy, out)?;
    dst.write_meta(&adv)?;
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
