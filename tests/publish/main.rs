//! Publishing to Proxmox VE and Hetzner Cloud (against their simulators), machines, removal and prune.
//!
//! One test binary per feature (issue 40): each file here is a module, the
//! helpers in `tests/common/` are shared by every binary.
// A test's stderr is libtest's to capture, not the CLI's one writer.
#![allow(clippy::disallowed_macros)]

#[path = "../common/mod.rs"]
mod common;

mod down_proxmox;
mod hcloud;
mod prune;
mod publish;
mod pve_download_url;
mod pve_machines;
mod up_hcloud;
