//! Why an image could not be read or patched: the one error every disk
//! operation returns, naming the image.

use super::qcow2;
use std::path::{Path, PathBuf};

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

/// Wraps an I/O error with the image it happened on.
pub(super) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DiskError + '_ {
    move |source| DiskError::Io {
        path: path.to_owned(),
        source,
    }
}
