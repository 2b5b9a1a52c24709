//! Helpers every end-to-end test file shares: where the repository is, how to
//! run the real binary, how to read its output.
#![allow(dead_code)] // each test file uses its own subset

pub mod checkout;
pub mod demo;
pub mod hostile;
pub mod inventory;
pub mod net;
pub mod otherfs;
pub mod plan;
pub mod realboot;
pub mod run;
pub mod sims;
pub mod talos;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Runs imgbuild from the repository root, ignoring any $IMGBUILD_CONFIG.
pub fn imgbuild(args: &[&str]) -> Output {
    run::Run::new(args).output()
}

/// The command [`imgbuild`] runs, for a test that wires it otherwise.
pub fn imgbuild_command(args: &[&str]) -> Command {
    run::Run::new(args).into_command()
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A command's stdout, after asserting it succeeded (else its exit code
/// and both outputs).
pub fn stdout_ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "exit {:?}\n{}\n{}",
        o.status.code(),
        text(&o.stdout),
        text(&o.stderr)
    );
    text(&o.stdout)
}

/// A command's stdout as its one JSON document; the output when it is not.
pub fn json(o: &std::process::Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}\n{}", text(&o.stdout), text(&o.stderr)))
}

/// The simulator binary, built next to imgbuild. `cargo test` builds only
/// the binaries of the packages whose tests run, so the simulator is
/// brought up to date once per test process (a no-op when it is: a stale
/// one would ignore new switches) as the build of its own test
/// (sim/tests/loopback.rs) does, with the test build's features: under
/// `make test` that build made it already.
pub fn sim_bin() -> PathBuf {
    static BUILT: std::sync::Once = std::sync::Once::new();
    let imgbuild = PathBuf::from(env!("CARGO_BIN_EXE_imgbuild"));
    let sim = imgbuild.with_file_name("imgbuild-sim");
    BUILT.call_once(|| {
        let st = Command::new(env!("CARGO"))
            .args([
                "test",
                "--workspace",
                "--no-run",
                "--quiet",
                "--test",
                "loopback",
            ])
            .current_dir(root())
            .status()
            .unwrap();
        assert!(st.success(), "building imgbuild-sim failed");
    });
    sim
}

/// The atlas example copied into `dir` (with its patch files) after
/// replacing `from` by `to`; returns the new inventory's path.
pub fn atlas_copy(dir: &Path, from: &str, to: &str) -> PathBuf {
    let atlas = root().join("examples/atlas");
    let text = std::fs::read_to_string(atlas.join("cluster.yaml")).unwrap();
    assert!(text.contains(from), "atlas lacks {from:?}");
    let path = dir.join("cluster.yaml");
    std::fs::write(&path, text.replacen(from, to, 1)).unwrap();
    std::fs::create_dir_all(dir.join("patches")).unwrap();
    for entry in std::fs::read_dir(atlas.join("patches")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.join("patches").join(entry.file_name())).unwrap();
    }
    path
}

/// `imgbuild --config CONFIG ARGS` against the factory simulator `sim`, with
/// its download cache in `dir` and short retry pauses.
pub fn with_factory(config: &Path, dir: &Path, sim: &sims::Sim, args: &[&str]) -> Output {
    run::Run::with_config(config, args)
        .factory(sim)
        .arg("--cache-dir")
        .arg(dir.join("cache"))
        .output()
}

/// The META text an `INSTALLER_META_BASE64` kernel argument carries, decoded
/// here (base64, then gunzip when it is gzip), as Talos' `Values.Decode` does.
pub fn decode_meta(arg: &str) -> Vec<u8> {
    use base64::Engine;
    let v = arg
        .strip_prefix("talos.environment=INSTALLER_META_BASE64=")
        .unwrap_or_else(|| panic!("not a META argument: {arg}"));
    let raw = base64::engine::general_purpose::STANDARD.decode(v).unwrap();
    if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&raw[..]), &mut out).unwrap();
        out
    } else {
        raw
    }
}

/// A fresh age key pair from `age-keygen` (Debian `age`) written to
/// `file`: its recipient (`age1…`).
#[allow(dead_code)]
pub fn age_keygen(file: &std::path::Path) -> String {
    let o = std::process::Command::new("age-keygen")
        .arg("-o")
        .arg(file)
        .output()
        .expect("age-keygen (Debian package age; make deps installs it)");
    assert!(o.status.success(), "{}", text(&o.stderr));
    std::fs::read_to_string(file)
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("# public key: "))
        .expect("age-keygen names the public key")
        .to_owned()
}
