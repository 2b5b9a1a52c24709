//! The one way the end-to-end tests run imgbuild: a [`Run`] (arguments,
//! environment, working folder, simulators' endpoints), and a [`Work`]
//! folder holding a test's inventory, `out/` and `cache/`.

use std::ffi::OsStr;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

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

    pub fn current_dir(&mut self, dir: &Path) -> &mut Run {
        self.0.current_dir(dir);
        self
    }

    /// Test-sized poll interval and timeouts for `bootstrap`, `up` and the
    /// day-two commands, each unless `given` names its flag.
    pub fn timeouts(&mut self, given: &[&str]) -> &mut Run {
        for (flag, value) in [
            ("--poll", "100ms"),
            ("--node-timeout", "20s"),
            ("--bootstrap-timeout", "20s"),
            ("--health-timeout", "30s"),
            ("--call-timeout", "5s"),
        ] {
            if !given.contains(&flag) {
                self.args([flag, value]);
            }
        }
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

    /// Runs it until a line of its stderr contains `marker`, then SIGKILLs
    /// it: a run stopped at a known point. Returns the lines seen; fails
    /// the test when the run ended without printing the marker.
    #[allow(dead_code)]
    pub fn kill_at(self, marker: &str) -> Vec<String> {
        self.signal_at(marker, libc::SIGKILL).before
    }

    /// Runs it until a line of its stderr contains `marker`, then sends it
    /// `signal` (SIGINT: Ctrl-C) and reads its stderr to the end; a run
    /// still going 60 s after the signal is SIGKILLed (`status` says so).
    /// Fails the test when the run ended without printing the marker.
    pub fn signal_at(self, marker: &str, signal: i32) -> Signalled {
        use std::io::{BufRead, BufReader};
        let mut child = self
            .into_command()
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let pid = child.id() as libc::pid_t;
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let mut before = Vec::new();
        for line in lines.by_ref() {
            let line = line.unwrap();
            let found = line.contains(marker);
            before.push(line);
            if found {
                break;
            }
        }
        assert!(
            before.last().is_some_and(|l| l.contains(marker)),
            "never printed {marker:?}: {before:#?}"
        );
        // SAFETY: kill(2) on the child's pid, which is not reaped yet.
        unsafe { libc::kill(pid, signal) };
        let reader = std::thread::spawn(move || lines.map_while(Result::ok).collect());
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > deadline {
                child.kill().unwrap();
                break child.wait().unwrap();
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let after = reader.join().unwrap();
        Signalled {
            before,
            after,
            status,
        }
    }
}

/// How a [`Run::signal_at`] went.
pub struct Signalled {
    /// Its stderr up to the marker's line (the last).
    pub before: Vec<String>,
    /// Its stderr after the signal.
    pub after: Vec<String>,
    pub status: ExitStatus,
}

/// How a [`Run::measured`] ended.
pub struct Measured {
    /// GNU time's status: imgbuild's exit code, or 128 + signal.
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
    /// The signal that ended imgbuild, if one did.
    pub signal: Option<i32>,
    /// imgbuild's peak resident set size.
    pub rss_kib: i64,
    pub took: Duration,
    /// Killed at the deadline.
    pub killed: bool,
    /// GNU time's report, for messages.
    pub report: String,
}

impl Run {
    /// Runs it under GNU time, which reports imgbuild's own peak RSS
    /// (wait4 in the test process would count the test's size too: Linux
    /// carries the hiwater mark across fork and exec), stdin closed, in its
    /// own process group, which is killed once `deadline` has passed (so a
    /// hang fails the test instead of stalling it).
    pub fn measured(&mut self, deadline: Duration) -> Measured {
        let time = Path::new("/usr/bin/time");
        assert!(time.exists(), "GNU time is missing: run `make deps`");
        let report = tempfile::NamedTempFile::new().unwrap();
        let mut cmd = Command::new(time);
        cmd.args(["-f", "maxrss %M", "-o"])
            .arg(report.path())
            .arg(self.0.get_program())
            .args(self.0.get_args());
        if let Some(dir) = self.0.get_current_dir() {
            cmd.current_dir(dir);
        }
        for (k, v) in self.0.get_envs() {
            match v {
                Some(v) => cmd.env(k, v),
                None => cmd.env_remove(k),
            };
        }
        let started = Instant::now();
        let mut child = cmd
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let drain = |mut r: Box<dyn Read + Send>| {
            std::thread::spawn(move || {
                let mut s = Vec::new();
                let _ = r.read_to_end(&mut s);
                String::from_utf8_lossy(&s).into_owned()
            })
        };
        let out = drain(Box::new(child.stdout.take().unwrap()));
        let err = drain(Box::new(child.stderr.take().unwrap()));
        let mut killed = false;
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if !killed && started.elapsed() > deadline {
                // SAFETY: signalling the process group of our own child.
                unsafe { libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL) };
                killed = true;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let took = started.elapsed();
        let report = std::fs::read_to_string(report.path()).unwrap();
        // GNU time says "Command terminated by signal N" before the
        // numbers when imgbuild died of a signal.
        let signal = report
            .lines()
            .find_map(|l| l.strip_prefix("Command terminated by signal "))
            .map(|n| n.trim().parse().unwrap());
        let rss_kib = report
            .lines()
            .find_map(|l| l.strip_prefix("maxrss "))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or_else(|| panic!("no RSS in GNU time's report: {report}"));
        Measured {
            status,
            stdout: out.join().unwrap(),
            stderr: err.join().unwrap(),
            signal,
            rss_kib,
            took,
            killed,
            report,
        }
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
