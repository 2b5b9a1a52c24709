//! action.yml's install path for a release tag: the shell of its steps run
//! as the runner would run them, against a file server on loopback
//! (Python's http.server) holding a release as `make release` lays it out
//! (imgbuild-x86_64-linux and SHA256SUMS, made here by sha256sum). A good
//! checksum installs the binary and puts it on PATH; a bad or missing one
//! installs nothing and fails the step.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use crate::common;
use common::{root, text};

/// action.yml's step named `name` (its `run` script and `env`).
fn step(name: &str) -> serde_yaml_ng::Value {
    let yaml = std::fs::read_to_string(root().join("action.yml")).unwrap();
    let action: serde_yaml_ng::Value = serde_yaml_ng::from_str(&yaml).unwrap();
    action["runs"]["steps"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|s| s["name"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("no step {name:?} in action.yml"))
        .clone()
}

/// A runner's temp folder and the files GitHub gives a step.
struct Runner {
    dir: tempfile::TempDir,
}

impl Runner {
    fn new() -> Runner {
        let r = Runner {
            dir: tempfile::tempdir().unwrap(),
        };
        std::fs::create_dir(r.temp()).unwrap();
        for f in ["path", "output"] {
            std::fs::write(r.dir.path().join(f), "").unwrap();
        }
        r
    }

    fn temp(&self) -> PathBuf {
        self.dir.path().join("runner-temp")
    }

    fn read(&self, file: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(file)).unwrap()
    }

    /// Runs `step`'s shell as a runner does (`bash -e {0}`, here with its
    /// `env` given as `env`), on x86_64 Linux.
    fn run(&self, step: &serde_yaml_ng::Value, env: &[(&str, &str)]) -> Output {
        assert_eq!(step["shell"].as_str(), Some("bash"));
        let script = step["run"].as_str().unwrap();
        let mut cmd = Command::new("bash");
        cmd.args(["-e", "-c", script])
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap())
            .env("HOME", self.dir.path())
            .env("RUNNER_TEMP", self.temp())
            .env("RUNNER_OS", "Linux")
            .env("RUNNER_ARCH", "X64")
            .env("GITHUB_PATH", self.dir.path().join("path"))
            .env("GITHUB_OUTPUT", self.dir.path().join("output"))
            .env("GITHUB_REPOSITORY", "someone/workflow-repo")
            .env("NO_PROXY", "127.0.0.1");
        cmd.envs(env.iter().copied());
        cmd.output().unwrap()
    }
}

/// `python3 -m http.server` on loopback, serving `dir`; killed on drop.
struct FileServer {
    child: Child,
    url: String,
}

impl FileServer {
    fn start(dir: &Path) -> FileServer {
        let mut child = Command::new("python3")
            .args(["-u", "-m", "http.server", "--bind", "127.0.0.1", "0"])
            .current_dir(dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("python3");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        // "Serving HTTP on 127.0.0.1 port 41234 (http://127.0.0.1:41234/) ..."
        let port = line
            .split_whitespace()
            .skip_while(|w| *w != "port")
            .nth(1)
            .unwrap_or_else(|| panic!("http.server said {line:?}"));
        FileServer {
            child,
            url: format!("http://127.0.0.1:{port}"),
        }
    }
}

impl Drop for FileServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const ASSET: &str = "imgbuild-x86_64-linux";

/// A release `tag` under `dir/releases/`: the binary under test as the
/// asset, and SHA256SUMS as sha256sum writes it, then `edit`ed.
fn release(dir: &Path, tag: &str, edit: impl Fn(String) -> String) -> PathBuf {
    let at = dir.join("releases").join(tag);
    std::fs::create_dir_all(&at).unwrap();
    std::fs::copy(env!("CARGO_BIN_EXE_imgbuild"), at.join(ASSET)).unwrap();
    let o = Command::new("sha256sum")
        .arg(ASSET)
        .current_dir(&at)
        .output()
        .unwrap();
    assert!(o.status.success());
    std::fs::write(at.join("SHA256SUMS"), edit(text(&o.stdout))).unwrap();
    at.join(ASSET)
}

/// The download step for `tag`, from `server`'s releases.
fn download(runner: &Runner, server: &FileServer, tag: &str) -> Output {
    let step = step("Download the imgbuild release and check its SHA-256");
    assert_eq!(
        step["if"].as_str(),
        Some("steps.how.outputs.mode == 'download'")
    );
    assert_eq!(
        step["env"]["TAG"].as_str(),
        Some("${{ steps.how.outputs.ref }}")
    );
    let base = format!("{}/releases", server.url);
    runner.run(
        &step,
        &[
            ("TAG", tag),
            ("ACTION_REPOSITORY", "owner/imgbuild"),
            ("IMGBUILD_RELEASE_BASE", &base),
        ],
    )
}

#[test]
fn a_release_whose_checksum_matches_is_installed_on_path() {
    let files = tempfile::tempdir().unwrap();
    let asset = release(files.path(), "v0.1.0", |sums| sums);
    let server = FileServer::start(files.path());
    let runner = Runner::new();
    let o = download(&runner, &server, "v0.1.0");
    assert!(
        o.status.success(),
        "{}\n{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    let bin = runner.temp().join("imgbuild/bin");
    assert_eq!(runner.read("path").trim(), bin.to_str().unwrap());
    let installed = bin.join("imgbuild");
    assert_eq!(
        std::fs::read(&installed).unwrap(),
        std::fs::read(&asset).unwrap()
    );
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&installed).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o755);
    // The step ends by running it.
    assert!(
        text(&o.stdout).starts_with(&format!("imgbuild {} (commit ", env!("CARGO_PKG_VERSION"))),
        "{}",
        text(&o.stdout)
    );
}

#[test]
fn a_bad_or_missing_checksum_installs_nothing_and_fails_the_step() {
    let files = tempfile::tempdir().unwrap();
    // One hex digit changed.
    release(files.path(), "v0.1.1", |sums| {
        let flipped = if sums.starts_with('0') { "1" } else { "0" };
        format!("{flipped}{}", &sums[1..])
    });
    // No entry for the asset.
    release(files.path(), "v0.1.2", |sums| {
        sums.replace(ASSET, "imgbuild-aarch64-linux")
    });
    let server = FileServer::start(files.path());
    for (tag, says) in [
        ("v0.1.1", "does not match SHA256SUMS (expected "),
        ("v0.1.2", "(expected no entry for it, got "),
        // A tag without a release: the download itself fails.
        ("v9.9.9", "404"),
    ] {
        let runner = Runner::new();
        let o = download(&runner, &server, tag);
        let err = text(&o.stderr);
        assert!(!o.status.success(), "{tag}: installed anyway\n{err}");
        assert!(err.contains(says), "{tag}: {err}");
        assert!(
            !runner.temp().join("imgbuild/bin/imgbuild").exists(),
            "{tag}"
        );
        assert_eq!(runner.read("path"), "", "{tag}: PATH changed");
    }
}

/// Which way a ref installs: a release tag on x86_64 Linux is downloaded;
/// a commit, a branch, `uses: ./` or another runner builds from source.
#[test]
fn only_a_release_tag_on_x86_64_linux_is_downloaded() {
    let step = step("Choose how to install imgbuild");
    assert_eq!(step["id"].as_str(), Some("how"));
    let sha = "0123456789abcdef0123456789abcdef01234567";
    for (version, action_ref, arch, mode, reference) in [
        ("v0.1.0", "", "X64", "download", "v0.1.0"),
        ("v1.2.3-rc.1", "main", "X64", "download", "v1.2.3-rc.1"),
        ("", "v0.2.0", "X64", "download", "v0.2.0"),
        (sha, "v0.2.0", "X64", "source", sha),
        ("main", "", "X64", "source", "main"),
        ("", "", "X64", "source", ""),
        ("v0.1.0", "", "ARM64", "source", "v0.1.0"),
    ] {
        let runner = Runner::new();
        let o = runner.run(
            &step,
            &[
                ("VERSION", version),
                ("ACTION_REF", action_ref),
                ("RUNNER_ARCH", arch),
            ],
        );
        assert!(o.status.success(), "{}", text(&o.stderr));
        assert_eq!(
            runner.read("output"),
            format!("mode={mode}\nref={reference}\n"),
            "version {version:?}, action ref {action_ref:?}, {arch}"
        );
    }
}
