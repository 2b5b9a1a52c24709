//! Helpers every end-to-end test file shares: where the repository is, how to
//! run the real binary, how to read its output.
#![allow(dead_code)] // each test file uses its own subset

use std::path::PathBuf;
use std::process::{Command, Output};

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Runs imgbuild from the repository root, ignoring any $IMGBUILD_CONFIG.
pub fn imgbuild(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_imgbuild"))
        .args(args)
        .current_dir(root())
        .env_remove("IMGBUILD_CONFIG")
        .output()
        .unwrap()
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}
