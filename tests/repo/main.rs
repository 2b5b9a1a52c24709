//! The repository itself: the module graph against docs/architecture.md, and the docs against the code.
//!
//! One test binary per feature (issue 40): each file here is a module, the
//! helpers in `tests/common/` are shared by every binary.
// A test's stderr is libtest's to capture, not the CLI's one writer.
#![allow(clippy::disallowed_macros)]

#[path = "../common/mod.rs"]
mod common;

mod architecture;
mod docs;
mod errors;
