//! A real etcd behind the node simulator (issue 37): with `--real-etcd`
//! each simulated control plane runs a real etcd 3.4 member on loopback
//! (Debian `etcd-server`, `etcd-client`; sim/src/node/etcd_real.rs), so
//! membership, quorum, snapshots and restore are etcd's own. The nodes run
//! Talos v1.11.5 (`v1alpha1_server.go` EtcdSnapshot, EtcdRecover,
//! EtcdLeaveCluster, EtcdRemoveMemberByID, Bootstrap{recover_etcd}).
//! Snapshots are checked with etcd's own `etcdctl snapshot status`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use crate::common;
use common::inventory::{Inventory, NODES, Node};
use common::run::Run;
use common::sims::Nodes;
use common::{json, text};
use imgbuild::talos::bootstrap::Options;
use imgbuild::talos::remove::{self, Event, RemoveOptions, Step};
use imgbuild::talos::stage::{self, BootstrapOptions, Prepared};
use serde_json::Value;

const TALOS: &str = "v1.11.5";

/// The loopback /24 of scenario `block` (tests/common/net.rs).
fn net(block: u32) -> String {
    common::net::scenario(module_path!(), block)
}

fn limits() -> Options {
    Options {
        call_timeout: Duration::from_secs(5),
        poll: Duration::from_millis(100),
        ..Options::default()
    }
}

fn curl(args: &[&str]) -> Value {
    let o = Command::new("curl").arg("-sf").args(args).output().unwrap();
    assert!(o.status.success(), "{args:?}: {}", text(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

fn etcdctl(args: &[&str]) -> Output {
    Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .args(args)
        .output()
        .expect("etcdctl (Debian etcd-client)")
}

/// The five nodes (three control planes, each a real etcd member),
/// bootstrapped by `imgbuild bootstrap`.
struct Cluster {
    sim: Nodes,
    dir: tempfile::TempDir,
    config: PathBuf,
    net: String,
}

impl Cluster {
    fn start(block: u32, nodes: &[&str]) -> Cluster {
        Self::start_with(block, nodes, &[])
    }

    fn start_with(block: u32, nodes: &[&str], extra: &[&str]) -> Cluster {
        let net = net(block);
        let machines: Vec<_> = NODES.into_iter().filter(|n| nodes.contains(&n.0)).collect();
        let flags = [
            "--real-etcd",
            "--talos-version",
            TALOS,
            "--upgrade-delay",
            "50",
        ];
        let sim = Nodes::machines(&net, &machines, true, &[&flags[..], extra].concat());
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("cluster.yaml");
        let c = Cluster {
            sim,
            dir,
            config,
            net,
        };
        c.keep(nodes);
        let o = c.imgbuild(&["bootstrap", "--new-secrets"], &[]);
        assert!(o.status.success(), "bootstrap: {}", text(&o.stderr));
        c
    }

    /// The inventory now holds only `nodes`.
    fn keep(&self, nodes: &[&str]) {
        let mut inv = Inventory::new("real")
            .vip(&format!("{}.10", self.net))
            .talos(TALOS);
        for (name, host, role) in NODES.iter().filter(|n| nodes.contains(&n.0)) {
            inv = inv.node(Node::new(name, role).address(&format!("{}.{host}", self.net)));
        }
        std::fs::write(&self.config, inv.text()).unwrap();
    }

    fn imgbuild(&self, args: &[&str], given: &[&str]) -> Output {
        let mut r = Run::with_config(&self.config, args);
        r.timeouts(given)
            .env_remove("IMGBUILD_STATE_DIR")
            .env_remove("IMGBUILD_FACTORY")
            .env_remove("TALOSCONFIG");
        r.output()
    }

    fn etcd(&self) -> serde_json::Value {
        self.sim.etcd()
    }

    fn etcd_post(&self, body: &str) {
        self.sim.etcd_post(body)
    }

    /// The client URL of `member`'s real etcd.
    fn endpoint(&self, member: &str) -> String {
        let etcd = self.etcd();
        etcd["members"][member]["client"]
            .as_str()
            .unwrap_or_else(|| panic!("no member {member}: {etcd}"))
            .to_owned()
    }

    /// The member names etcd lists, asked directly through `member`.
    fn etcd_members(&self, member: &str) -> Vec<String> {
        let o = etcdctl(&[
            "--endpoints",
            &self.endpoint(member),
            "member",
            "list",
            "-w",
            "json",
        ]);
        assert!(o.status.success(), "{}", text(&o.stderr));
        let mut names: Vec<String> = json(&o)["members"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["name"].as_str().unwrap().to_owned())
            .collect();
        names.sort();
        names
    }

    fn halt(&self, host: u8) {
        curl(&[
            "-X",
            "POST",
            "-H",
            "content-type: application/json",
            "-d",
            &format!("{{\"ip\":\"{}.{host}\"}}", self.net),
            &format!("{}/_sim/halt", self.sim.control),
        ]);
    }

    fn prepared(&self) -> Prepared {
        let opts = BootstrapOptions {
            limits: limits(),
            ..BootstrapOptions::default()
        };
        let inv = imgbuild::inventory::Inventory::load(&self.config).unwrap();
        stage::prepare(&inv, &opts).unwrap()
    }
}

fn snapshot_status(path: &Path) -> Value {
    let o = etcdctl(&["snapshot", "status", path.to_str().unwrap(), "-w", "json"]);
    assert!(
        o.status.success(),
        "etcdctl snapshot status: {}",
        text(&o.stderr)
    );
    json(&o)
}

const ALL: [&str; 5] = ["cp-01", "cp-02", "cp-03", "worker-01", "worker-02"];

fn quiet(_: &str, _: &Event) {}

#[test]
fn v1_11_every_control_plane_is_a_real_etcd_member() {
    let c = Cluster::start(0, &ALL);
    let etcd = c.etcd();
    assert_eq!(etcd["real"], true, "{etcd}");
    assert_eq!(c.etcd_members("cp-02"), ["cp-01", "cp-02", "cp-03"]);
    for name in ["cp-01", "cp-02", "cp-03"] {
        let url = c.endpoint(name);
        assert!(url.starts_with(&format!("http://{}.", c.net)), "{url}");
        let starts = etcd["members"][name]["startup_ms"].as_array().unwrap();
        assert!(!starts.is_empty(), "{etcd}");
    }
    // `imgbuild status` reads the members through EtcdMemberList.
    let o = c.imgbuild(&["--output", "json", "status"], &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
}

#[test]
fn v1_11_an_imgbuild_snapshot_passes_etcdctl_snapshot_status() {
    let c = Cluster::start(1, &ALL);
    c.etcd_post(r#"{"put": {"/registry/configmaps/default/marker": "real"}}"#);
    let out = c.dir.path().join("db.snapshot");
    let o = c.imgbuild(
        &[
            "--output",
            "json",
            "etcd",
            "snapshot",
            "--out",
            out.to_str().unwrap(),
        ],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(json(&o)["snapshot"]["node"], "cp-01");
    let status = snapshot_status(&out);
    assert!(status["totalKey"].as_u64().unwrap() >= 1, "{status}");
    assert!(status["revision"].as_u64().unwrap() >= 2, "{status}");
    // etcd's restore reads the marker back.
    let restored = c.dir.path().join("restored");
    let o = etcdctl(&[
        "snapshot",
        "restore",
        out.to_str().unwrap(),
        "--data-dir",
        restored.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
}

#[test]
fn v1_11_an_etcdctl_snapshot_restores_through_recover_from() {
    let c = Cluster::start(2, &ALL);
    c.etcd_post(r#"{"put": {"/registry/secrets/default/marker": "before-the-disaster"}}"#);
    let snap = c.dir.path().join("etcdctl.snapshot");
    let o = etcdctl(&[
        "--endpoints",
        &c.endpoint("cp-02"),
        "snapshot",
        "save",
        snap.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));

    // Every control plane's etcd data is gone; etcd waits for bootstrap.
    c.etcd_post(r#"{"wipe": true}"#);
    let o = c.imgbuild(
        &[
            "--output",
            "json",
            "bootstrap",
            "--new-secrets",
            "--recover-from",
            snap.to_str().unwrap(),
        ],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(json(&o)["healthy"], true);
    let etcd = c.etcd();
    assert_eq!(
        etcd["keys"]["/registry/secrets/default/marker"], "before-the-disaster",
        "{etcd}"
    );
    assert_eq!(etcd["recoveries"][0]["node"], "cp-01", "{etcd}");
    assert_eq!(etcd["failures"], serde_json::json!([]), "{etcd}");
    // The others joined the restored member: three again, as etcd lists them.
    assert_eq!(c.etcd_members("cp-01"), ["cp-01", "cp-02", "cp-03"]);
}

#[test]
fn v1_11_a_snapshot_etcd_cannot_restore_leaves_etcd_failed() {
    let c = Cluster::start(3, &["cp-01", "worker-01"]);
    let good = c.dir.path().join("good.snapshot");
    let o = c.imgbuild(&["etcd", "snapshot", "--out", good.to_str().unwrap()], &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    // Its meta pages kept, every page after them garbage, the SHA-256
    // recomputed: a whole snapshot as imgbuild checks one, and no database
    // etcd's restore can open.
    use sha2::Digest;
    let bytes = std::fs::read(&good).unwrap();
    let mut db = bytes[..bytes.len() - 32].to_vec();
    db[2 * 4096..].fill(0xff);
    let hash = sha2::Sha256::digest(&db);
    db.extend_from_slice(&hash);
    let bad = c.dir.path().join("bad.snapshot");
    std::fs::write(&bad, &db).unwrap();
    c.etcd_post(r#"{"wipe": true}"#);
    let o = c.imgbuild(
        &[
            "bootstrap",
            "--new-secrets",
            "--bootstrap-timeout",
            "10s",
            "--health-timeout",
            "5s",
            "--recover-from",
            bad.to_str().unwrap(),
        ],
        &["--bootstrap-timeout", "--health-timeout"],
    );
    let err = text(&o.stderr);
    assert_ne!(o.status.code(), Some(0), "{err}");
    let etcd = c.etcd();
    let failures = etcd["failures"].as_array().unwrap();
    assert_eq!(failures.len(), 1, "{etcd}\n{err}");
    assert!(
        failures[0]["error"]
            .as_str()
            .unwrap()
            .starts_with("error recovering from the snapshot"),
        "{etcd}"
    );
    // The etcd service says Failed, not Preparing.
    use imgbuild::talos::client::{Mode, NodeClient, NodeEndpoint};
    let prepared = c.prepared();
    let admin = Mode::Mtls(prepared.plan.identity.clone());
    let ip = format!("{}.11", c.net).parse().unwrap();
    let target = NodeEndpoint::new(Some(ip), None).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let services = rt.block_on(async {
        let conn = NodeClient::connect(&target, &admin, Duration::from_secs(5))
            .await
            .unwrap();
        conn.services().await.unwrap()
    });
    let etcd_service = services.iter().find(|s| s.id == "etcd").unwrap();
    assert_eq!(etcd_service.state, "Failed", "{etcd_service:?}");
    assert_eq!(c.etcd()["members"]["cp-01"]["running"], false);
}

#[test]
fn v1_11_control_plane_removal_leaves_two_real_members() {
    let c = Cluster::start(4, &ALL);
    c.keep(&["cp-01", "cp-03", "worker-01", "worker-02"]);
    let prepared = c.prepared();
    let inv = imgbuild::inventory::Inventory::load(&c.config).unwrap();
    let removed = remove::removed_nodes(&inv, &prepared.state_dir.path).unwrap();
    let view = remove::survey(&prepared, &removed, &limits()).unwrap();
    let plan = remove::plan(&inv, &removed, &view).unwrap();
    assert_eq!(
        plan.nodes[0].steps,
        [Step::Drain, Step::LeaveEtcd, Step::Reset, Step::DeleteNode]
    );
    let opts = RemoveOptions {
        limits: limits(),
        drain_timeout: Duration::from_secs(15),
        reset_timeout: Duration::from_secs(15),
    };
    let report = remove::remove(&prepared, &plan, &opts, &quiet).unwrap();
    assert!(report.complete(), "{:?}", report.failed);
    // etcd itself lists two members now.
    assert_eq!(c.etcd_members("cp-01"), ["cp-01", "cp-03"]);
    assert_eq!(c.etcd()["members"]["cp-02"]["running"], false);
}

/// EtcdLeaveCluster on the control plane at `host`, straight from the
/// client (no plan in front of it): Talos's answer.
fn leave(c: &Cluster, host: u8) -> Result<(), String> {
    use imgbuild::talos::client::{Mode, NodeClient, NodeEndpoint};
    let prepared = c.prepared();
    let admin = Mode::Mtls(prepared.plan.identity.clone());
    let ip = format!("{}.{host}", c.net).parse().unwrap();
    let target = NodeEndpoint::new(Some(ip), None).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let conn = NodeClient::connect(&target, &admin, Duration::from_secs(10))
            .await
            .map_err(|e| e.to_string())?;
        conn.etcd_leave_cluster().await.map_err(|e| e.to_string())
    })
}

#[test]
fn v1_11_etcd_refuses_to_remove_its_only_member() {
    let c = Cluster::start(6, &["cp-01", "worker-01"]);
    let e = leave(&c, 11).expect_err("etcd refuses");
    assert!(
        e.contains("failed to leave cluster: failed to remove member ")
            && e.contains("etcdserver: re-configuration failed due to not enough started members"),
        "{e}"
    );
    assert_eq!(c.etcd_members("cp-01"), ["cp-01"]);
    assert_eq!(c.etcd()["members"]["cp-01"]["healthy"], true);
}

#[test]
fn v1_11_etcd_refuses_a_removal_that_loses_quorum_and_the_error_reaches_the_client() {
    let c = Cluster::start_with(5, &ALL, &["--etcd-unhealthy-retry", "2000"]);
    c.halt(12); // cp-02 is down: its etcd stops
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while c.etcd()["members"]["cp-02"]["running"] != false {
        assert!(std::time::Instant::now() < until, "{}", c.etcd());
        std::thread::sleep(Duration::from_millis(100));
    }
    // cp-03 asks to leave (as a client whose view is stale would): etcd
    // itself refuses, cp-01 alone being no quorum of cp-01 and cp-02; Talos
    // retries "unhealthy" until its deadline, then answers with it.
    let e = leave(&c, 13).expect_err("etcd refuses");
    assert!(
        e.contains("failed to leave cluster: failed to remove member ")
            && e.contains("etcdserver: unhealthy cluster"),
        "{e}"
    );
    // Still three members in etcd, and cp-03's still runs.
    assert_eq!(c.etcd_members("cp-01"), ["cp-01", "cp-02", "cp-03"]);
    assert_eq!(c.etcd()["members"]["cp-03"]["healthy"], true);
}

#[test]
fn v1_11_upgrade_restarts_each_real_member_and_checks_etcd_health_between() {
    use common::sims::Sim;
    let net = net(7);
    let sim = Nodes::cluster(
        &net,
        true,
        &[
            "--real-etcd",
            "--talos-version",
            "v1.11.2",
            "--reboot-delay",
            "300",
            "--upgrade-delay",
            "50",
        ],
    );
    let factory = Sim::start_with(&[], 0, &["--versions", "v1.11.2,v1.11.5"]);
    let dir = tempfile::tempdir().unwrap();
    let c = Cluster {
        sim,
        config: dir.path().join("cluster.yaml"),
        dir,
        net,
    };
    let want = |version: &str| {
        let mut inv = Inventory::new("real")
            .vip(&format!("{}.10", c.net))
            .talos(version)
            .factory(&factory.url);
        for (name, host, role) in NODES {
            inv = inv.node(Node::new(name, role).address(&format!("{}.{host}", c.net)));
        }
        inv.write(c.dir.path());
    };
    want("v1.11.2");
    let o = c.imgbuild(&["bootstrap", "--new-secrets"], &[]);
    assert!(o.status.success(), "bootstrap: {}", text(&o.stderr));
    c.etcd_post(r#"{"put": {"/registry/marker": "survives"}}"#);
    want("v1.11.5");
    let o = c.imgbuild(&["--output", "json", "upgrade"], &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(json(&o)["versions"]["cp-03"], "v1.11.5");
    // Each control plane's etcd went down with its node and came back on
    // its data: two starts each, the members and the keyspace unchanged.
    let etcd = c.etcd();
    for name in ["cp-01", "cp-02", "cp-03"] {
        let starts = etcd["members"][name]["startup_ms"].as_array().unwrap();
        assert!(starts.len() >= 2, "{name}: {etcd}");
    }
    assert_eq!(etcd["keys"]["/registry/marker"], "survives", "{etcd}");
    assert_eq!(c.etcd_members("cp-01"), ["cp-01", "cp-02", "cp-03"]);
}

/// SIGTERM or SIGINT stops a `--real-etcd` simulator and leaves nothing of
/// it in `$TMPDIR` (its members' data dirs and snapshot files); before, the
/// folder outlived it until the next `--real-etcd` start.
#[test]
fn a_stopped_simulator_leaves_no_etcd_folder() {
    use std::io::{BufRead, BufReader};
    use std::os::unix::process::ExitStatusExt;
    for (sig, k) in [(libc::SIGTERM, 90), (libc::SIGINT, 91)] {
        let tmp = tempfile::tempdir().unwrap();
        let mut child = Command::new(common::sim_bin())
            .args(["nodes", "--real-etcd", "--talos-version", TALOS, "--node"])
            .arg(format!("cp-01={}.11:controlplane", net(k)))
            .env("TMPDIR", tmp.path())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(line.contains("control"), "did not start: {line:?}");
        let folders = || -> Vec<String> {
            std::fs::read_dir(tmp.path())
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("imgbuild-sim-etcd-"))
                .collect()
        };
        assert_eq!(folders().len(), 1, "{:?}", folders());
        // SAFETY: signalling our own child.
        unsafe { libc::kill(child.id() as libc::pid_t, sig) };
        let status = child.wait().unwrap();
        assert_eq!(status.signal(), Some(sig), "{status}");
        assert_eq!(folders(), Vec::<String>::new(), "left after signal {sig}");
    }
}
