//! Secrets kept secret: SOPS/age files, so encrypted secrets can live in Git.

pub mod age;
pub mod sops;
