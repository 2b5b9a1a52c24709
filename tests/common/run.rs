//! The one way the end-to-end tests run imgbuild: a [`Run`] (arguments,
//! environment, working folder, simulators' endpoints), and a [`Work`]
//! folder holding a test's inventory, `out/` and `cache/`.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use super::inventory::Inventory;
use super::root;
use super::sims::{Hc, Pve, Sim};

/// One run of the imgbuild binary, from the repository root with
/// `$IMGBUILD_CONFIG` unset unless told otherwise.
pub struct Run(Command);

impl Run {
    pub fn new(args: &[&str]) -> Run {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_imgbuild"));
        cmd.args(args)
            .current_dir(root())
            .env_remove("IMGBUILD_CONFIG");
        Run(cmd)
    }

    /// `imgbuild --config CONFIG ARGS`.
    pub fn with_config(config: &Path, args: &[&str]) -> Run {
        let mut run = Run::new(&["--config"]);
        run.arg(config).args(args);
        run
    }

    pub fn arg(&mut self, arg: impl AsRef<OsStr>) -> &mut Run {
        self.0.arg(arg);
        self
    }

    pub fn args<S: AsRef<OsStr>>(&mut self, args: impl IntoIterator<Item = S>) -> &mut Run {
        self.0.args(args);
        self
    }

    pub fn env(&mut self, key: &str, value: impl AsRef<OsStr>) -> &mut Run {
        self.0.env(key, value);
        self
    }

    pub fn envs<K: AsRef<OsStr>, V: AsRef<OsStr>>(
        &mut self,
        vars: impl IntoIterator<Item = (K, V)>,
    ) -> &mut Run {
        self.0.envs(vars);
        self
    }

    pub fn env_remove(&mut self, key: &str) -> &mut Run {
        self.0.env_remove(key);
        self
    }

    /// `--factory` the simulator, with short retry pauses.
    pub fn factory(&mut self, sim: &Sim) -> &mut Run {
        self.args(["--factory", &sim.url, "--retry-delay-ms", "10"])
    }

    /// `--out-dir DIR/out --cache-dir DIR/cache`.
    pub fn folders(&mut self, dir: &Path) -> &mut Run {
        self.arg("--out-dir")
            .arg(dir.join("out"))
            .arg("--cache-dir")
            .arg(dir.join("cache"))
    }

    /// The Proxmox simulator's endpoint, token and pin in the environment.
    pub fn proxmox(&mut self, pve: &Pve) -> &mut Run {
        self.env("PROXMOX_VE_ENDPOINT", &pve.url)
            .env("PROXMOX_VE_API_TOKEN", &pve.token)
            .env("PROXMOX_VE_FINGERPRINT", &pve.fingerprint)
            .env_remove("PROXMOX_VE_INSECURE")
    }

    /// The Hetzner simulator's endpoint and token in the environment.
    pub fn hcloud(&mut self, hc: &Hc) -> &mut Run {
        self.env("HCLOUD_ENDPOINT", &hc.url)
            .env("HCLOUD_TOKEN", &hc.token)
    }

    /// The command, for a test that spawns it (to signal it, say).
    pub fn into_command(self) -> Command {
        self.0
    }

    /// Runs it to the end: exit status, stdout and stderr.
    pub fn output(&mut self) -> Output {
        self.0.output().unwrap()
    }
}

/// A test's working folder: its inventory, `out/` and `cache/`.
pub struct Work {
    pub dir: tempfile::TempDir,
    pub config: PathBuf,
}

impl Work {
    /// A fresh folder with `inventory` as its `cluster.yaml`.
    pub fn new(inventory: &Inventory) -> Work {
        let dir = tempfile::tempdir().unwrap();
        let config = inventory.write(dir.path());
        Work { dir, config }
    }

    /// A fresh folder for runs on the inventory at `config` (relative to
    /// the repository root).
    pub fn on(config: &str) -> Work {
        Work {
            dir: tempfile::tempdir().unwrap(),
            config: PathBuf::from(config),
        }
    }

    pub fn out(&self) -> PathBuf {
        self.dir.path().join("out")
    }

    pub fn cache(&self) -> PathBuf {
        self.dir.path().join("cache")
    }

    /// Replaces `from` (which must be there) by `to` in the inventory.
    pub fn edit(&self, from: &str, to: &str) {
        let text = std::fs::read_to_string(&self.config).unwrap();
        assert!(text.contains(from), "the inventory lacks {from:?}");
        std::fs::write(&self.config, text.replacen(from, to, 1)).unwrap();
    }

    /// `out/manifest.json`.
    pub fn manifest(&self) -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(self.out().join("manifest.json")).unwrap()).unwrap()
    }

    /// `imgbuild --config CONFIG ARGS` against the factory simulator,
    /// writing into this folder.
    pub fn imgbuild(&self, sim: &Sim, args: &[&str]) -> Run {
        let mut run = Run::with_config(&self.config, args);
        run.factory(sim).folders(self.dir.path());
        run
    }
}
