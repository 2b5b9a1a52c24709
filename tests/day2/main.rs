//! Bootstrap and day two on the simulated nodes: upgrades per Talos version, Kubernetes, etcd, removal.
//!
//! One test binary per feature (issue 40): each file here is a module, the
//! helpers in `tests/common/` are shared by every binary.
// A test's stderr is libtest's to capture, not the CLI's one writer.
#![allow(clippy::disallowed_macros)]

#[path = "../common/mod.rs"]
mod common;

mod bootstrap;
mod commands;
mod docker_lab;
mod etcd_real;
mod etcd_snapshot;
mod fresh_runner;
mod hcloud;
mod identity;
mod kubernetes_manifests;
mod kubernetes_upgrade;
mod proxy;
mod remove;
mod sealed_kube;
mod stalled;
mod versions;
