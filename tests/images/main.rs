//! Images and boot media, per node: schematics, raw/qcow2/ISO/PXE builds, Secure Boot, crafted images, the Go oracles.
//!
//! One test binary per feature (issue 40): each file here is a module, the
//! helpers in `tests/common/` are shared by every binary.
// A test's stderr is libtest's to capture, not the CLI's one writer.
#![allow(clippy::disallowed_macros)]

#[path = "../common/mod.rs"]
mod common;

mod build;
mod go_oracle;
mod hostile;
mod image;
mod iso;
mod pxe;
mod schematic;
mod secureboot;
