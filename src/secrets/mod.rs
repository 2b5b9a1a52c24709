//! Secrets as imgbuild keeps them out of sight: the one redaction set every
//! printed line passes ([`redact`]), the state dir that guards itself
//! against a commit and against other users ([`protect`]), and SOPS/age
//! files ([`sops`] over [`age`]), so encrypted secrets can live in Git.

pub mod age;
pub mod protect;
pub mod redact;
pub mod sops;
