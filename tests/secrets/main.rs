//! Secrets: SOPS (modelled and the real `sops`), redaction, read-only secrets, configs and imports.
//!
//! One test binary per feature (issue 40): each file here is a module, the
//! helpers in `tests/common/` are shared by every binary.
// A test's stderr is libtest's to capture, not the CLI's one writer.
#![allow(clippy::disallowed_macros)]

#[path = "../common/mod.rs"]
mod common;

mod config;
mod fresh_runner;
mod import;
mod readonly;
mod redaction;
mod sops;
mod sops_real;
