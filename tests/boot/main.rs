//! Real boots in QEMU (SeaBIOS, OVMF, iPXE, GRUB) of the media imgbuild writes, and hostile boot inputs.
//!
//! One test binary per feature (issue 40): each file here is a module, the
//! helpers in `tests/common/` are shared by every binary.
// A test's stderr is libtest's to capture, not the CLI's one writer.
#![allow(clippy::disallowed_macros)]

#[path = "../common/mod.rs"]
mod common;

mod hostile;
mod iso;
mod pxe;
mod secureboot;
