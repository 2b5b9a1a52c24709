//! A real etcd member behind each simulated control plane, with
//! `--real-etcd`: Debian's `etcd-server`/`etcd-client` (etcd 3.4; the same
//! membership, quorum and snapshot semantics as the etcd 3.5/3.6 Talos
//! v1.9–v1.14 ship for what imgbuild uses). Membership, quorum refusals,
//! snapshot bytes (a real bolt database, its SHA-256 appended) and restore
//! (`etcdctl snapshot restore`) are then etcd's own; the simulator only maps
//! them onto Talos's API as `v1alpha1_server.go` does.
//!
//! - Each member listens on its node's loopback address (never outside
//!   127.0.0.0/8: refused at start) on free ports, plain HTTP, its data dir
//!   under `$TMPDIR/imgbuild-sim-etcd-<pid>-…`.
//! - One thread (the reconciler) starts and stops the processes so the
//!   members follow the modelled nodes: a control plane whose etcd may run
//!   (configured, bootstrapped, up, not removed) runs one; a node that goes
//!   down has its process killed (data kept) and restarted when it comes
//!   back. The first member starts a new cluster on the bootstrap node; a
//!   member with no data joins a running one (`member add`, then start
//!   with `--initial-cluster-state existing`, waiting until it is healthy
//!   before any other join, so etcd's strict reconfiguration check holds).
//!   Talos adds joiners as learners and promotes them; here they join as
//!   voters directly (same end state, one step less).
//! - The processes are spawned from that thread only, with
//!   `PR_SET_PDEATHSIG` = SIGKILL: they die with the simulator, even when it
//!   is SIGKILLed (the signal follows the thread that spawned them, which
//!   lives as long as the process).
//! - What stays modelled: when etcd may start (bootstrap, joins, the node's
//!   phases — the simulator's clock), the stale member of
//!   `POST /_sim/k8s {"stale_etcd_member"}` (no process can stand for a
//!   member that never starts), TLS (etcd's peer and client TLS are
//!   Talos's, not under test), and the misbehaving snapshot streams.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::state::{Cluster, Phase, reached};
use super::state::{Member, RealEtcd};

/// The cluster token every member shares.
const TOKEN: &str = "imgbuild-sim";

impl Member {
    fn client_url(&self) -> String {
        format!("http://{}:{}", self.ip, self.client)
    }
    fn peer_url(&self) -> String {
        format!("http://{}:{}", self.ip, self.peer)
    }
}

/// A free port on `ip` (bound and released: etcd binds it next).
fn free_port(ip: IpAddr) -> std::io::Result<u16> {
    Ok(TcpListener::bind(SocketAddr::new(ip, 0))?
        .local_addr()?
        .port())
}

/// What etcdctl said on failure: its `Error: …` line, else all of stderr.
fn etcdctl_error(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    text.lines()
        .rev()
        .find_map(|l| l.strip_prefix("Error: "))
        .map(str::to_owned)
        .unwrap_or_else(|| text.trim().to_owned())
}

/// Runs `etcdctl` (API v3) against `endpoint`: stdout, or etcd's error.
fn etcdctl(endpoint: &str, args: &[&str]) -> Result<Vec<u8>, String> {
    let out = Command::new("etcdctl")
        .env_clear()
        .env("ETCDCTL_API", "3")
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .args(["--endpoints", endpoint, "--dial-timeout", "2s"])
        .args(["--command-timeout", "5s"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("etcdctl: {e}"))?;
    if out.status.success() {
        Ok(out.stdout)
    } else {
        Err(etcdctl_error(&out.stderr))
    }
}

/// Whether the member at `ip:port` answers `/health` with true (a leader,
/// no alarm: etcd's own check).
fn healthy(ip: IpAddr, port: u16) -> bool {
    let ask = || -> std::io::Result<bool> {
        let t = Duration::from_millis(400);
        let mut s = TcpStream::connect_timeout(&SocketAddr::new(ip, port), t)?;
        s.set_read_timeout(Some(t))?;
        s.set_write_timeout(Some(t))?;
        write!(
            s,
            "GET /health HTTP/1.0\r\nHost: {ip}:{port}\r\nConnection: close\r\n\r\n"
        )?;
        let mut body = String::new();
        s.take(4096).read_to_string(&mut body)?;
        Ok(body.contains("\"health\":\"true\""))
    };
    ask().unwrap_or(false)
}

/// A member as `etcdctl member list -w json` shows it.
pub(crate) struct Listed {
    pub id: u64,
    pub name: String,
    pub peer_urls: Vec<String>,
    pub client_urls: Vec<String>,
    pub is_learner: bool,
}

impl RealEtcd {
    /// Checks that `etcd` and `etcdctl` are there, clears data dirs left by
    /// simulators that are gone, and makes this one's.
    pub(crate) fn new() -> anyhow::Result<RealEtcd> {
        for (bin, arg) in [("etcd", "--version"), ("etcdctl", "version")] {
            let ok = Command::new(bin)
                .arg(arg)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            anyhow::ensure!(
                ok,
                "--real-etcd: `{bin}` not found (Debian packages etcd-server and etcd-client)"
            );
        }
        let tmp = std::env::temp_dir();
        if let Ok(dir) = std::fs::read_dir(&tmp) {
            for e in dir.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let pid = name
                    .strip_prefix("imgbuild-sim-etcd-")
                    .and_then(|r| r.split('-').next())
                    .and_then(|p| p.parse::<u32>().ok());
                if pid.is_some_and(|p| !Path::new(&format!("/proc/{p}")).exists()) {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .subsec_nanos();
        let root = tmp.join(format!("imgbuild-sim-etcd-{}-{nanos}", std::process::id()));
        catch_signals();
        std::fs::create_dir_all(&root)?;
        Ok(RealEtcd {
            root,
            members: Mutex::new(HashMap::new()),
        })
    }

    fn data_dir(&self, i: usize) -> PathBuf {
        self.root.join(format!("node-{i}"))
    }

    fn has_data(&self, i: usize) -> bool {
        self.data_dir(i).join("member").exists()
    }

    /// Node `i`'s member entry, made (ports chosen) on first use.
    fn ensure(&self, cluster: &Cluster, i: usize) -> anyhow::Result<()> {
        let mut m = self.members.lock().unwrap();
        if m.contains_key(&i) {
            return Ok(());
        }
        let node = cluster.node(i);
        anyhow::ensure!(
            node.ip.is_loopback(),
            "{}: etcd listens on loopback only",
            node.ip
        );
        let name = node
            .st
            .lock()
            .unwrap()
            .applied
            .as_ref()
            .map(|a| a.hostname.clone())
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| node.display_name());
        let (client, peer) = (free_port(node.ip)?, free_port(node.ip)?);
        m.insert(
            i,
            Member {
                name,
                ip: node.ip,
                client,
                peer,
                child: None,
                healthy_since: None,
                spawned_at: None,
                startup_ms: Vec::new(),
            },
        );
        Ok(())
    }

    /// Node `i`'s client URL (its entry made if need be).
    pub(crate) fn endpoint(&self, cluster: &Cluster, i: usize) -> Result<String, String> {
        self.ensure(cluster, i).map_err(|e| e.to_string())?;
        Ok(self.members.lock().unwrap()[&i].client_url())
    }

    /// Since when node `i`'s member is healthy (None: not now).
    pub(crate) fn healthy_since(&self, i: usize) -> Option<Instant> {
        self.members
            .lock()
            .unwrap()
            .get(&i)
            .and_then(|m| m.healthy_since)
    }

    /// The client URL of a running, healthy member (the lowest node
    /// index first).
    fn healthy_endpoint(&self) -> Option<String> {
        let m = self.members.lock().unwrap();
        let mut up: Vec<(&usize, &Member)> = m
            .iter()
            .filter(|(_, m)| m.healthy_since.is_some())
            .collect();
        up.sort_by_key(|(i, _)| **i);
        up.first().map(|(_, m)| m.client_url())
    }

    /// A node other than `i` whose member is healthy.
    pub(crate) fn healthy_index_except(&self, i: usize) -> Option<usize> {
        let m = self.members.lock().unwrap();
        let mut up: Vec<usize> = m
            .iter()
            .filter(|(j, m)| **j != i && m.healthy_since.is_some())
            .map(|(j, _)| *j)
            .collect();
        up.sort();
        up.first().copied()
    }

    /// Node index of the member named `name`.
    pub(crate) fn index_of(&self, name: &str) -> Option<usize> {
        self.members
            .lock()
            .unwrap()
            .iter()
            .find(|(_, m)| m.name == name)
            .map(|(i, _)| *i)
    }

    /// `member list` as node `i`'s member answers it.
    pub(crate) fn list(&self, cluster: &Cluster, i: usize) -> Result<Vec<Listed>, String> {
        let out = etcdctl(
            &self.endpoint(cluster, i)?,
            &["member", "list", "-w", "json"],
        )?;
        let v: Value = serde_json::from_slice(&out).map_err(|e| e.to_string())?;
        let strings = |v: &Value| -> Vec<String> {
            v.as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|s| s.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default()
        };
        Ok(v["members"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default()
            .iter()
            .map(|m| Listed {
                id: m["ID"].as_u64().unwrap_or_default(),
                name: m["name"].as_str().unwrap_or_default().to_owned(),
                peer_urls: strings(&m["peerURLs"]),
                client_urls: strings(&m["clientURLs"]),
                is_learner: m["isLearner"].as_bool().unwrap_or(false),
            })
            .collect())
    }

    /// Node `i`'s own member ID, as its member reports it.
    pub(crate) fn own_id(&self, cluster: &Cluster, i: usize) -> Result<u64, String> {
        let out = etcdctl(
            &self.endpoint(cluster, i)?,
            &["member", "list", "-w", "json"],
        )?;
        let v: Value = serde_json::from_slice(&out).map_err(|e| e.to_string())?;
        v["header"]["member_id"]
            .as_u64()
            .ok_or_else(|| "no member id".to_owned())
    }

    /// `EtcdForfeitLeadership` on node `i`: when its member leads,
    /// `move-leader` to another started member and that member's name;
    /// else "".
    pub(crate) fn forfeit(&self, cluster: &Cluster, i: usize) -> Result<String, String> {
        let endpoint = self.endpoint(cluster, i)?;
        let out = etcdctl(&endpoint, &["endpoint", "status", "-w", "json"])?;
        let v: Value = serde_json::from_slice(&out).map_err(|e| e.to_string())?;
        let status = &v[0]["Status"];
        let (own, leader) = (
            status["header"]["member_id"].as_u64(),
            status["leader"].as_u64(),
        );
        let members = self.list(cluster, i)?;
        if members.len() == 1 {
            return Err("cannot forfeit leadership, only one member".to_owned());
        }
        if own.is_none() || own != leader {
            return Ok(String::new());
        }
        let Some(to) = members
            .into_iter()
            .find(|m| Some(m.id) != own && !m.is_learner)
        else {
            return Ok(String::new());
        };
        etcdctl(&endpoint, &["move-leader", &format!("{:x}", to.id)])?;
        Ok(to.name)
    }

    /// `member remove ID` through node `i`'s member: etcd's own refusal
    /// (not enough started members, member not found) as its text.
    pub(crate) fn remove(&self, cluster: &Cluster, i: usize, id: u64) -> Result<(), String> {
        etcdctl(
            &self.endpoint(cluster, i)?,
            &["member", "remove", &format!("{id:x}")],
        )
        .map(drop)
    }

    /// A file name under the root no other call gets: parallel snapshots
    /// (or restores) of one node within one millisecond must not share
    /// `etcdctl`'s output (it writes `<path>.part`, then renames it).
    fn unique(&self, what: &str, i: usize, now_ms: u64) -> PathBuf {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        self.root.join(format!("{what}-{i}-{now_ms}-{n}.db"))
    }

    /// `snapshot save` from node `i`'s member: the bytes etcd streamed.
    pub(crate) fn snapshot(&self, cluster: &Cluster, i: usize) -> Result<Vec<u8>, String> {
        let path = self.unique("snapshot", i, cluster.now_ms());
        let saved = etcdctl(
            &self.endpoint(cluster, i)?,
            &["snapshot", "save", &path.to_string_lossy()],
        );
        let bytes = saved.and_then(|_| std::fs::read(&path).map_err(|e| e.to_string()));
        let _ = std::fs::remove_file(&path);
        bytes
    }

    /// Stops node `i`'s process (if any) and empties its data dir.
    pub(crate) fn wipe(&self, i: usize) {
        self.stop(i);
        let _ = std::fs::remove_dir_all(self.data_dir(i));
    }

    /// Stops node `i`'s process, keeping its data.
    fn stop(&self, i: usize) {
        let mut m = self.members.lock().unwrap();
        if let Some(m) = m.get_mut(&i) {
            if let Some(mut c) = m.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
            m.healthy_since = None;
            m.spawned_at = None;
        }
    }

    /// etcd's restore of `upload` into node `i`'s (emptied) data dir as
    /// the only member (`etcdctl snapshot restore`, the hash checked):
    /// the number of keys, or etcd's error.
    pub(crate) fn restore(
        &self,
        cluster: &Cluster,
        i: usize,
        upload: &[u8],
    ) -> Result<u64, String> {
        self.ensure(cluster, i).map_err(|e| e.to_string())?;
        self.wipe(i);
        let file = self.unique("restore", i, cluster.now_ms());
        std::fs::write(&file, upload).map_err(|e| e.to_string())?;
        let (name, peer) = {
            let m = self.members.lock().unwrap();
            (m[&i].name.clone(), m[&i].peer_url())
        };
        let file_s = file.to_string_lossy().into_owned();
        let status = etcdctl(
            "http://127.0.0.1:1",
            &["snapshot", "status", &file_s, "-w", "json"],
        );
        let keys = status
            .ok()
            .and_then(|s| serde_json::from_slice::<Value>(&s).ok())
            .and_then(|v| v["totalKey"].as_u64())
            .unwrap_or(0);
        let restored = etcdctl(
            "http://127.0.0.1:1",
            &[
                "snapshot",
                "restore",
                &file_s,
                "--name",
                &name,
                "--data-dir",
                &self.data_dir(i).to_string_lossy(),
                "--initial-cluster",
                &format!("{name}={peer}"),
                "--initial-advertise-peer-urls",
                &peer,
                "--initial-cluster-token",
                TOKEN,
            ],
        );
        let _ = std::fs::remove_file(&file);
        match restored {
            Ok(_) => Ok(keys),
            Err(e) => {
                let _ = std::fs::remove_dir_all(self.data_dir(i));
                Err(format!("error recovering from the snapshot: {e}"))
            }
        }
    }

    /// Writes `key` = `value` through a healthy member.
    pub(crate) fn put(&self, key: &str, value: &str) -> Result<(), String> {
        let at = self
            .healthy_endpoint()
            .ok_or_else(|| "no healthy etcd member".to_owned())?;
        etcdctl(&at, &["put", "--", key, value]).map(drop)
    }

    /// Every key and its value, and the revision, from a healthy member.
    pub(crate) fn keys(&self) -> Option<(std::collections::BTreeMap<String, String>, u64)> {
        use base64::Engine;
        let at = self.healthy_endpoint()?;
        let out = etcdctl(&at, &["get", "--prefix", "", "-w", "json"]).ok()?;
        let v: Value = serde_json::from_slice(&out).ok()?;
        let b64 = |v: &Value| {
            v.as_str()
                .and_then(|s| base64::engine::general_purpose::STANDARD.decode(s).ok())
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                .unwrap_or_default()
        };
        let keys = v["kvs"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default()
            .iter()
            .map(|kv| (b64(&kv["key"]), b64(&kv["value"])))
            .collect();
        Some((keys, v["header"]["revision"].as_u64().unwrap_or(0)))
    }

    /// Each member's client URL, whether it runs, and its startup cost per
    /// start (ms from spawn to healthy), by member name.
    pub(crate) fn members_json(&self) -> Value {
        let m = self.members.lock().unwrap();
        m.values()
            .map(|m| {
                let v = serde_json::json!({
                    "client": m.client_url(),
                    "running": m.child.is_some(),
                    "healthy": m.healthy_since.is_some(),
                    "startup_ms": m.startup_ms,
                });
                (m.name.clone(), v)
            })
            .collect::<serde_json::Map<_, _>>()
            .into()
    }

    /// Spawns node `i`'s etcd with `cluster_flags` (empty: its data
    /// decides). Called from the reconciler thread only (PDEATHSIG).
    fn spawn(&self, i: usize, cluster_flags: &[String]) -> Result<(), String> {
        let mut m = self.members.lock().unwrap();
        let m = m.get_mut(&i).ok_or("no member")?;
        let dir = self.data_dir(i);
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let log = std::fs::File::create(self.root.join(format!("node-{i}.log")))
            .map_err(|e| e.to_string())?;
        let mut cmd = Command::new("etcd");
        cmd.env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .args(["--name", &m.name])
            .args(["--data-dir", &dir.to_string_lossy()])
            .args(["--listen-client-urls", &m.client_url()])
            .args(["--advertise-client-urls", &m.client_url()])
            .args(["--listen-peer-urls", &m.peer_url()])
            .args(["--initial-advertise-peer-urls", &m.peer_url()])
            .args(["--initial-cluster-token", TOKEN])
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
            .args(["--logger", "zap", "--log-level", "warn"])
            .args(cluster_flags)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        let parent = std::process::id();
        // SAFETY: prctl and getppid are async-signal-safe.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() as u32 != parent {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
        m.child = Some(cmd.spawn().map_err(|e| format!("etcd: {e}"))?);
        m.spawned_at = Some(Instant::now());
        m.healthy_since = None;
        Ok(())
    }

    /// Whether node `i`'s etcd may run now, as the model says.
    fn wanted(cluster: &Cluster, i: usize, now: Instant) -> bool {
        let node = cluster.node(i);
        if !node.control_plane() || cluster.etcd_failed(i).is_some() {
            return false;
        }
        let stopped = node.st.lock().unwrap().day2.life.services_stopped(now);
        node.phase(now) == Phase::Configured && !stopped && reached(cluster.etcd_start(i), now)
    }

    /// Starts node `i`'s member: on its data, as the new cluster's first
    /// member, or joining a running one. Waits (bounded) until healthy.
    fn start(&self, cluster: &Cluster, i: usize) -> Result<(), String> {
        self.ensure(cluster, i).map_err(|e| e.to_string())?;
        let (name, peer) = {
            let m = self.members.lock().unwrap();
            (m[&i].name.clone(), m[&i].peer_url())
        };
        let boot_node = cluster.boot.lock().unwrap().as_ref().map(|b| b.node);
        let others_have_data = (0..cluster.count()).any(|j| j != i && self.has_data(j));
        let flags: Vec<String> = if self.has_data(i) {
            Vec::new()
        } else if boot_node == Some(i) && !others_have_data {
            vec![
                "--initial-cluster".into(),
                format!("{name}={peer}"),
                "--initial-cluster-state".into(),
                "new".into(),
            ]
        } else {
            let at = self
                .healthy_endpoint()
                .ok_or_else(|| "no healthy member to join".to_owned())?;
            let out = etcdctl(&at, &["member", "add", &name, "--peer-urls", &peer])?;
            let text = String::from_utf8_lossy(&out);
            let initial = text
                .lines()
                .find_map(|l| l.strip_prefix("ETCD_INITIAL_CLUSTER="))
                .map(|v| v.trim_matches('"').to_owned())
                .ok_or_else(|| format!("member add said: {text}"))?;
            vec![
                "--initial-cluster".into(),
                initial,
                "--initial-cluster-state".into(),
                "existing".into(),
            ]
        };
        self.spawn(i, &flags)?;
        let (ip, port) = {
            let m = self.members.lock().unwrap();
            (m[&i].ip, m[&i].client)
        };
        let until = Instant::now() + Duration::from_secs(10);
        while Instant::now() < until {
            if healthy(ip, port) {
                self.mark_healthy(i);
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    fn mark_healthy(&self, i: usize) {
        let mut m = self.members.lock().unwrap();
        if let Some(m) = m.get_mut(&i)
            && m.healthy_since.is_none()
        {
            let now = Instant::now();
            m.healthy_since = Some(now);
            if let Some(t) = m.spawned_at.take() {
                m.startup_ms.push(now.duration_since(t).as_millis() as u64);
            }
        }
    }

    /// One pass of the reconciler.
    fn reconcile(&self, cluster: &Cluster) {
        let now = Instant::now();
        for i in 0..cluster.count() {
            let want = Self::wanted(cluster, i, now);
            let running = {
                let mut m = self.members.lock().unwrap();
                match m.get_mut(&i).and_then(|m| m.child.as_mut()) {
                    Some(c) => matches!(c.try_wait(), Ok(None)),
                    None => false,
                }
            };
            if want && !running {
                self.stop(i); // reap an exited process
                if let Err(e) = self.start(cluster, i) {
                    let log = self.root.join(format!("node-{i}.reconcile.log"));
                    let _ = std::fs::write(log, e);
                }
            } else if !want && running {
                self.stop(i);
            } else if running {
                let (ip, port) = {
                    let m = self.members.lock().unwrap();
                    (m[&i].ip, m[&i].client)
                };
                if healthy(ip, port) {
                    self.mark_healthy(i);
                } else if let Some(m) = self.members.lock().unwrap().get_mut(&i) {
                    m.healthy_since = None;
                }
            } else {
                self.stop(i);
            }
        }
    }
}

/// SIGTERM's and SIGINT's streams, taken over from the default action as
/// the folder is made (a signal from then on waits for
/// [`clean_up_on_signal`], however soon it comes).
static SIGNALS: Mutex<Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>> =
    Mutex::new(None);

/// Catches SIGTERM and SIGINT for [`clean_up_on_signal`] (needs the Tokio
/// runtime; without one the default action stays).
fn catch_signals() {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let _in = handle.enter();
    if let (Ok(term), Ok(int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        *SIGNALS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some((term, int));
    }
}

/// On SIGTERM or SIGINT: the etcd processes killed and the simulator's
/// folder under `$TMPDIR` removed, then the signal's default action (so
/// whoever stopped it sees it die of that signal). Without it the folder
/// outlived every stopped simulator (only the next `--real-etcd` start
/// swept it). Needs the Tokio runtime the simulator serves from.
fn clean_up_on_signal(cluster: Arc<Cluster>) {
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let Some((mut term, mut int)) = SIGNALS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take()
    else {
        return;
    };
    handle.spawn(async move {
        let sig = tokio::select! {
            _ = term.recv() => libc::SIGTERM,
            _ = int.recv() => libc::SIGINT,
        };
        if let Some(real) = &cluster.real_etcd {
            real.remove_all();
        }
        // SAFETY: restoring the default action and raising the signal on
        // this process; no handler of ours runs.
        unsafe {
            libc::signal(sig, libc::SIG_DFL);
            libc::raise(sig);
        }
    });
}

impl RealEtcd {
    /// Kills every member's process and removes the simulator's folder.
    fn remove_all(&self) {
        let mut members = self
            .members
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for m in members.values_mut() {
            if let Some(mut c) = m.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// Runs the reconciler for the simulator's life on a thread of its own
/// (the parent thread of every etcd process).
pub(crate) fn reconcile_forever(cluster: Arc<Cluster>) {
    clean_up_on_signal(cluster.clone());
    std::thread::Builder::new()
        .name("etcd-reconciler".into())
        .spawn(move || {
            loop {
                if let Some(real) = &cluster.real_etcd {
                    real.reconcile(&cluster);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
        .expect("a thread");
}

impl super::service::Api {
    /// `EtcdMemberList` on node `i` with `--real-etcd`: `member list` as
    /// its member answers (Talos's local client), the modelled stale
    /// member added where set.
    pub(crate) fn real_members_on(
        &self,
        i: usize,
    ) -> Result<imgbuild::talos::api::machine::EtcdMembers, tonic::Status> {
        use imgbuild::talos::api::machine::{EtcdMember, EtcdMembers};
        let real = self.cluster.real_etcd.as_ref().expect("--real-etcd");
        let listed = real
            .list(&self.cluster, i)
            .map_err(|e| tonic::Status::unknown(format!("failed to list etcd members: {e}")))?;
        let hostile = self.cluster.args.hostile_text.as_deref();
        let stale = self.cluster.facts.lock().unwrap().stale_etcd_member;
        let members = listed
            .into_iter()
            .map(|m| EtcdMember {
                id: m.id,
                hostname: super::hostile::said(hostile, &m.name),
                peer_urls: m.peer_urls,
                client_urls: m.client_urls,
                is_learner: m.is_learner,
            })
            .chain(stale.then(|| EtcdMember {
                id: super::health::STALE_MEMBER_ID,
                hostname: "cp-gone".into(),
                peer_urls: vec!["https://127.0.0.254:2380".into()],
                client_urls: vec!["https://127.0.0.254:2379".into()],
                is_learner: false,
            }))
            .collect();
        Ok(EtcdMembers {
            metadata: None,
            legacy_members: Vec::new(),
            members,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_files_of_one_node_in_one_millisecond_are_distinct() {
        let dir = tempfile::tempdir().unwrap();
        let real = RealEtcd {
            root: dir.path().to_owned(),
            members: Mutex::new(HashMap::new()),
        };
        let a = real.unique("snapshot", 0, 42);
        let b = real.unique("snapshot", 0, 42);
        assert_ne!(a, b);
        assert!(a.starts_with(dir.path()) && b.starts_with(dir.path()));
        // What a restore stages never shares a snapshot's name either.
        assert_ne!(
            real.unique("restore", 0, 42),
            real.unique("snapshot", 0, 42)
        );
    }
}
