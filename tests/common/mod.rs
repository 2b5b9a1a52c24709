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

/// The simulator binary, built next to imgbuild.
pub fn sim_bin() -> PathBuf {
    let imgbuild = PathBuf::from(env!("CARGO_BIN_EXE_imgbuild"));
    let sim = imgbuild.with_file_name("imgbuild-sim");
    if !sim.exists() {
        let st = Command::new(env!("CARGO"))
            .args(["build", "-p", "imgbuild-sim"])
            .current_dir(root())
            .status()
            .unwrap();
        assert!(st.success());
    }
    sim
}
