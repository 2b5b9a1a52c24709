//! Disk images: format sniffing, GPT lookup, and META read-merge-write.
//! Only the 512 KiB of ADV at the start of META is ever read or written;
//! every other byte of the image is left alone, and nothing holds a whole
//! image in memory.
//!
//! This file only names the parts; they import each other one way:
//! `layout` (GPT rules, no I/O) ← `image` (open, read, write, compare) ←
//! `edit` (META edits in place and into copies), with `error` and `qcow2`
//! below them all.

pub mod edit;
mod error;
#[cfg(test)]
pub(crate) mod fuzz;
mod image;
mod layout;
pub mod qcow2;

pub use edit::{apply, write_patched_copy};
pub use error::DiskError;
pub use image::{Format, Image, ImageDiff, diff, sniff};
pub use layout::{
    GptHeader, META_SIZE, MetaLookup, Partition, check_partition_layout, find_meta,
    precheck_gpt_header,
};
