//! Secrets as imgbuild keeps them out of sight: the one redaction set every
//! printed line passes ([`redact`]), and the state dir that guards itself
//! against a commit and against other users ([`protect`]).

pub mod protect;
pub mod redact;
