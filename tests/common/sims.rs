//! Handles on the simulators the end-to-end tests start: each is a child
//! process on loopback that prints one JSON line once it listens, and is
//! killed when its handle drops.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::inventory::NODES;
use super::{root, sim_bin, text};

/// Starts `imgbuild-sim <args>` and reads the JSON line it prints.
fn spawn(args: &mut Command) -> (Child, serde_json::Value) {
    let mut child = args.stdout(Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let v = serde_json::from_str(&line)
        .unwrap_or_else(|e| panic!("simulator did not start ({e}): {line:?}"));
    (child, v)
}

/// A factory simulator on loopback; killed on drop.
pub struct Sim {
    child: Child,
    pub url: String,
    _dir: tempfile::TempDir,
}

impl Sim {
    pub fn start(misbehave: &[&str]) -> Sim {
        Self::start_with(misbehave, 0, &[])
    }

    pub fn start_with(misbehave: &[&str], random_mib: u32, extra: &[&str]) -> Sim {
        Self::launch("dual-boot.raw", misbehave, random_mib, extra)
    }

    /// A factory that serves the fixture `base` (fixtures/make-images.sh)
    /// as its base image.
    pub fn start_on(base: &str) -> Sim {
        Self::launch(base, &[], 0, &[])
    }

    fn launch(base: &str, misbehave: &[&str], random_mib: u32, extra: &[&str]) -> Sim {
        let dir = tempfile::tempdir().unwrap();
        let fx = dir.path().join("fx");
        let ok = Command::new(root().join("fixtures/make-images.sh"))
            .arg(&fx)
            .env("RANDOM_MIB", random_mib.to_string())
            .output()
            .unwrap();
        assert!(
            ok.status.success(),
            "{}",
            String::from_utf8_lossy(&ok.stderr)
        );
        let mut cmd = Command::new(sim_bin());
        cmd.args(["factory", "--alt-listen", "127.0.0.2:0", "--base-image"])
            .arg(fx.join(base))
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .args(extra);
        for m in misbehave {
            cmd.args(["--misbehave", m]);
        }
        let (child, v) = spawn(&mut cmd);
        Sim {
            child,
            url: v["url"].as_str().unwrap().to_owned(),
            _dir: dir,
        }
    }

    /// Where the simulator keeps the images it has built and serves
    /// (`<schematic>/<version>/<file>`), for tests that alter them.
    pub fn state_dir(&self) -> PathBuf {
        self._dir.path().join("state")
    }

    /// One of the simulator's own `/_sim/…` reports, as JSON.
    fn report(&self, name: &str) -> serde_json::Value {
        let out = Command::new("curl")
            .args(["-sf", &format!("{}/_sim/{name}", self.url)])
            .output()
            .unwrap();
        assert!(out.status.success(), "/_sim/{name}");
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// Every schematic posted so far: ID → the body the factory was sent.
    pub fn posted_schematics(&self) -> serde_json::Value {
        self.report("schematics")
    }

    pub fn image_gets(&self) -> u64 {
        self.report("stats")
            .as_object()
            .unwrap()
            .values()
            .map(|n| n.as_u64().unwrap())
            .sum()
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A Proxmox VE simulator on loopback; killed on drop.
pub struct Pve {
    child: Child,
    pub url: String,
    pub fingerprint: String,
    pub token: String,
    pub dir: tempfile::TempDir,
}

impl Pve {
    pub fn start(extra: &[&str]) -> Pve {
        Self::start_with("0", extra)
    }

    pub fn start_with(auth_delay_ms: &str, extra: &[&str]) -> Pve {
        let dir = tempfile::tempdir().unwrap();
        // Tasks take 50 ms unless `extra` says otherwise.
        let delay: &[&str] = if extra.contains(&"--task-delay-ms") {
            &[]
        } else {
            &["--task-delay-ms", "50"]
        };
        let (child, v) = spawn(
            Command::new(sim_bin())
                .arg("proxmox")
                .args(delay)
                .args(["--auth-delay-ms", auth_delay_ms])
                .arg("--state-dir")
                .arg(dir.path().join("state"))
                .args(extra),
        );
        assert_eq!(v["node"], "pve");
        Pve {
            child,
            url: v["url"].as_str().unwrap().to_owned(),
            fingerprint: v["fingerprint"].as_str().unwrap().to_owned(),
            token: v["token"].as_str().unwrap().to_owned(),
            dir,
        }
    }

    pub fn api(&self, path: &str) -> String {
        format!("{}api2/json{path}", self.url)
    }

    /// curl with the token; returns (HTTP status, body as JSON).
    pub fn curl(&self, path: &str, args: &[&str]) -> (u16, serde_json::Value) {
        let o = Command::new("curl")
            .args(["-sk", "-w", "\n%{http_code}", "-H"])
            .arg(format!("Authorization: PVEAPIToken={}", self.token))
            .args(args)
            .arg(self.api(path))
            .output()
            .unwrap();
        let out = text(&o.stdout);
        let (body, code) = out.rsplit_once('\n').unwrap();
        let json = serde_json::from_str(body).unwrap_or(serde_json::Value::Null);
        (code.parse().unwrap(), json)
    }

    /// Uploads `file` into `local` as pveproxy expects (`-F` parts in order).
    pub fn upload(&self, file: &Path, checksum: &str) -> (u16, serde_json::Value) {
        self.curl(
            "/nodes/pve/storage/local/upload",
            &[
                "-F",
                "content=import",
                "-F",
                "checksum-algorithm=sha256",
                "-F",
                &format!("checksum={checksum}"),
                "-F",
                &format!("filename=@{}", file.display()),
            ],
        )
    }

    /// Polls a task until it stops; its status.
    pub fn wait(&self, upid: &serde_json::Value) -> serde_json::Value {
        let upid = upid
            .as_str()
            .unwrap_or_else(|| panic!("not a UPID: {upid}"));
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let (code, v) = self.curl(&format!("/nodes/pve/tasks/{upid}/status"), &[]);
            assert_eq!(code, 200, "{v}");
            if v["data"]["status"] == "stopped" {
                return v["data"].clone();
            }
            assert!(Instant::now() < deadline, "task {upid} never stopped");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Where the simulator keeps an import volume's file.
    pub fn stored(&self, name: &str) -> PathBuf {
        self.dir
            .path()
            .join("state/storage/local/import")
            .join(name)
    }

    pub fn stats(&self) -> serde_json::Value {
        let o = Command::new("curl")
            .args(["-sk", &format!("{}_sim/stats", self.url)])
            .output()
            .unwrap();
        serde_json::from_slice(&o.stdout).unwrap()
    }

    /// [`Pve::stats`] once no task runs: a task outlives its client (an
    /// upload whose sender was killed still imports), so counts read
    /// earlier may still grow.
    pub fn idle_stats(&self) -> serde_json::Value {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let stats = self.stats();
            if stats["tasksRunning"] == 0 {
                return stats;
            }
            assert!(Instant::now() < deadline, "tasks never ended: {stats}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Pve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The rescue sshd's port in tests: high, so a simulator run without root
/// can listen on it (each server has its own loopback address).
pub const RESCUE_SSH_PORT: u16 = 10022;

/// Who may log in to the rescue system: root when the simulator runs as
/// root (as on Hetzner), else only the user running it (an sshd without
/// root cannot switch users).
pub fn rescue_user() -> String {
    let o = Command::new("id").arg("-un").output().unwrap();
    assert!(o.status.success(), "id -un failed");
    text(&o.stdout).trim().to_owned()
}

/// A Hetzner Cloud simulator on loopback; killed on drop.
pub struct Hc {
    pub child: Child,
    pub url: String,
    pub token: String,
    pub dir: tempfile::TempDir,
}

impl Hc {
    pub fn start(extra: &[&str]) -> Hc {
        for tool in ["/usr/sbin/sshd", "ssh", "ssh-keygen", "zstd", "curl"] {
            let found = Command::new("sh")
                .args(["-c", &format!("command -v {tool}")])
                .output()
                .unwrap();
            assert!(found.status.success(), "{tool} is missing: run `make deps`");
        }
        let dir = tempfile::tempdir().unwrap();
        let (child, v) = spawn(
            Command::new(sim_bin())
                .args(["hcloud", "--action-seconds", "0.2", "--rescue-ssh-port"])
                .arg(RESCUE_SSH_PORT.to_string())
                .arg("--state-dir")
                .arg(dir.path().join("state"))
                .args(extra),
        );
        let url = v["url"].as_str().unwrap().to_owned();
        assert!(
            url.starts_with("http://127.0.0.1:") && url.ends_with("/v1"),
            "{url}"
        );
        Hc {
            child,
            url,
            token: v["token"].as_str().unwrap().to_owned(),
            dir,
        }
    }

    /// The environment that points imgbuild at this simulator's rescue
    /// systems (its hidden `--rescue-ssh-port` and `--rescue-ssh-user`).
    pub fn rescue_env(&self) -> [(&'static str, String); 2] {
        [
            ("IMGBUILD_RESCUE_SSH_PORT", RESCUE_SSH_PORT.to_string()),
            ("IMGBUILD_RESCUE_SSH_USER", rescue_user()),
        ]
    }

    /// curl with the token; (HTTP status, headers, body as JSON).
    pub fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> (u16, String, serde_json::Value) {
        let mut cmd = Command::new("curl");
        cmd.args(["-s", "-D", "-", "-X", method, "-H"])
            .arg(format!("Authorization: Bearer {}", self.token))
            .arg(format!("{}{path}", self.url));
        if let Some(b) = body {
            cmd.args(["-H", "Content-Type: application/json", "--data-binary"])
                .arg(b.to_string());
        }
        let out = text(&cmd.output().unwrap().stdout);
        let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
        let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
        (
            status,
            head.to_owned(),
            serde_json::from_str(body).unwrap_or(serde_json::Value::Null),
        )
    }

    pub fn ok(
        &self,
        method: &str,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> serde_json::Value {
        let (status, _, v) = self.call(method, path, body);
        assert!(
            (200..300).contains(&status),
            "{method} {path}: {status} {v}"
        );
        v
    }

    /// Polls an action until it ends; its final state.
    pub fn wait(&self, action: &serde_json::Value) -> serde_json::Value {
        let id = action["id"]
            .as_u64()
            .unwrap_or_else(|| panic!("no action: {action}"));
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let a = self.ok("GET", &format!("/actions/{id}"), None)["action"].clone();
            if a["status"] != "running" {
                return a;
            }
            assert!(Instant::now() < deadline, "action {id} never ended");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn wait_ok(&self, action: &serde_json::Value) {
        let a = self.wait(action);
        assert_eq!(a["status"], "success", "{a}");
    }

    pub fn stats(&self) -> serde_json::Value {
        let o = Command::new("curl")
            .arg("-s")
            .arg(self.url.replace("/v1", "/_sim/stats"))
            .output()
            .unwrap();
        serde_json::from_slice(&o.stdout).unwrap()
    }

    /// One count of [`Hc::stats`].
    pub fn stat(&self, key: &str) -> u64 {
        let stats = self.stats();
        stats[key]
            .as_u64()
            .unwrap_or_else(|| panic!("no {key} in {stats}"))
    }

    pub fn disk(&self, server: u64) -> PathBuf {
        let o = Command::new("curl")
            .arg("-s")
            .arg(
                self.url
                    .replace("/v1", &format!("/_sim/servers/{server}/disk")),
            )
            .output()
            .unwrap();
        PathBuf::from(serde_json::from_slice::<String>(&o.stdout).unwrap())
    }
}

impl Drop for Hc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A Talos node simulator on loopback (`imgbuild-sim nodes`); killed on drop.
pub struct Nodes {
    child: Child,
    /// Its control server: `/_sim/stats`, and `/_sim/boot` for the
    /// simulators that boot nodes.
    pub control: String,
    /// `{"kube":{NAME:"IP:PORT"},"talos":{…}}`: the `--kube-forward` and
    /// `--talos-forward` addresses as bound.
    pub forwards: serde_json::Value,
}

impl Nodes {
    /// Delays small enough for tests, large enough to be states.
    pub const FAST: [&str; 8] = [
        "--apply-delay",
        "200",
        "--etcd-delay",
        "400",
        "--kubelet-delay",
        "300",
        "--ready-delay",
        "300",
    ];

    pub fn start(extra: &[&str]) -> Nodes {
        Self::start_with(&Self::FAST, extra)
    }

    /// With other `delays` (flags and values) than [`Nodes::FAST`].
    pub fn start_with(delays: &[&str], extra: &[&str]) -> Nodes {
        let (child, v) = spawn(
            Command::new(sim_bin())
                .arg("nodes")
                .args(delays)
                .args(extra),
        );
        Nodes {
            child,
            control: v["control"].as_str().unwrap().to_owned(),
            forwards: v["forwards"].clone(),
        }
    }

    /// The [`NODES`] on the /24 `net` (`--node NAME=ADDRESS:ROLE` each),
    /// with the VIP `net.10` when `vip`, and `extra`.
    pub fn cluster(net: &str, vip: bool, extra: &[&str]) -> Nodes {
        Self::machines(net, &NODES, vip, extra)
    }

    /// [`Nodes::cluster`] of `machines` (name, last octet, role).
    pub fn machines(net: &str, machines: &[(&str, u8, &str)], vip: bool, extra: &[&str]) -> Nodes {
        let mut args: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        for (name, host, role) in machines {
            args.extend(["--node".to_owned(), format!("{name}={net}.{host}:{role}")]);
        }
        if vip {
            args.extend(["--vip".to_owned(), format!("{net}.10")]);
        }
        Self::start(&args.iter().map(String::as_str).collect::<Vec<_>>())
    }

    /// Waits until `node` runs Talos `version` and is configured again
    /// (the simulator's own word).
    pub fn wait_for_version(&self, node: &str, version: &str) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while std::time::Instant::now() < deadline {
            let stats = self.stats();
            if stats["nodes"][node]["day2"]["version"] == version
                && stats["nodes"][node]["phase"] == "configured"
            {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        panic!("{node} never came up on {version}");
    }

    pub fn stats(&self) -> serde_json::Value {
        let o = Command::new("curl")
            .args(["-sf", &format!("{}/_sim/stats", self.control)])
            .output()
            .unwrap();
        serde_json::from_slice(&o.stdout)
            .unwrap_or_else(|e| panic!("node simulator stats ({e}): {}", text(&o.stdout)))
    }

    /// The simulated cluster's etcd (`GET /_sim/etcd`: members, keys, state).
    pub fn etcd(&self) -> serde_json::Value {
        Self::curl_json(&[&format!("{}/_sim/etcd", self.control)])
    }

    /// A change to the simulated etcd (`POST /_sim/etcd` with `body`).
    pub fn etcd_post(&self, body: &str) {
        Self::curl_json(&[
            "-X",
            "POST",
            "-H",
            "content-type: application/json",
            "-d",
            body,
            &format!("{}/_sim/etcd", self.control),
        ]);
    }

    fn curl_json(args: &[&str]) -> serde_json::Value {
        let o = Command::new("curl").arg("-sf").args(args).output().unwrap();
        assert!(o.status.success(), "{args:?}: {}", text(&o.stderr));
        serde_json::from_slice(&o.stdout).unwrap()
    }
}

impl Drop for Nodes {
    /// SIGTERM first: a `--real-etcd` simulator then stops its etcd members
    /// and removes its folder under TMPDIR (hundreds of MB each); SIGKILL
    /// after 5 s.
    fn drop(&mut self) {
        let pid = libc::pid_t::try_from(self.child.id()).expect("a pid");
        // SAFETY: kill(2) on our own child, which wait() below reaps.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while std::time::Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
