//! etcd snapshots and recovery against the node simulator, whose nodes run
//! Talos v1.11.2 (upgraded to v1.11.5), serving EtcdSnapshot, EtcdRecover and
//! Bootstrap{recover_etcd} as siderolabs/talos `v1alpha1_server.go` and
//! `services/etcd.go` do (sim/src/node/etcd.rs). Each test checks the
//! snapshot bytes itself: size 32 past a multiple of 512, the database's
//! SHA-256 appended (etcd `etcdutl/snapshot/v3_snapshot.go`).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use sha2::Digest;

use crate::common;
use common::inventory::{Inventory, NODES, Node};
use common::run::Run;
use common::sims::{Nodes, Sim};
use common::{json, text};

/// The loopback /24 of scenario `block` (tests/common/net.rs).
fn net(block: u32) -> String {
    common::net::scenario(module_path!(), block)
}

fn imgbuild(config: &Path, args: &[&str], given: &[&str]) -> Output {
    let mut r = Run::with_config(config, args);
    r.timeouts(given)
        .env_remove("IMGBUILD_STATE_DIR")
        .env_remove("IMGBUILD_FACTORY")
        .env_remove("TALOSCONFIG");
    r.output()
}

fn curl(args: &[&str]) -> serde_json::Value {
    let o = Command::new("curl").arg("-sf").args(args).output().unwrap();
    assert!(o.status.success(), "{args:?}: {}", text(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// The five nodes (three control planes) bootstrapped at v1.11.2.
struct Cluster {
    nodes: Nodes,
    factory: Sim,
    dir: tempfile::TempDir,
    config: PathBuf,
    net: String,
}

impl Cluster {
    fn start(block: u32, extra: &[&str]) -> Cluster {
        let net = net(block);
        let nodes = Nodes::cluster(&net, true, extra);
        let factory = Sim::start_with(&[], 0, &["--versions", "v1.11.2,v1.11.5"]);
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("cluster.yaml");
        let c = Cluster {
            nodes,
            factory,
            dir,
            config,
            net,
        };
        c.want("v1.11.2", &NODES.map(|(n, _, _)| n));
        let o = imgbuild(&c.config, &["bootstrap", "--new-secrets"], &[]);
        assert!(o.status.success(), "bootstrap: {}", text(&o.stderr));
        c
    }

    /// The inventory at `version`, its nodes in `order`.
    fn want(&self, version: &str, order: &[&str]) {
        let mut inv = Inventory::new("sim")
            .vip(&format!("{}.10", self.net))
            .talos(version)
            .factory(&self.factory.url);
        for name in order {
            let (_, host, role) = NODES.iter().find(|(n, _, _)| n == name).unwrap();
            inv = inv.node(Node::new(name, role).address(&format!("{}.{host}", self.net)));
        }
        inv.write(self.dir.path());
    }

    fn etcd(&self) -> serde_json::Value {
        self.nodes.etcd()
    }

    fn etcd_post(&self, body: &str) {
        self.nodes.etcd_post(body)
    }

    fn snapshots_dir(&self) -> PathBuf {
        self.dir.path().join(".talos/sim/etcd")
    }

    fn upgrade_calls(&self) -> Vec<u64> {
        let stats = self.nodes.stats();
        NODES
            .iter()
            .map(|(n, _, _)| stats["nodes"][n]["day2"]["upgrade_calls"].as_u64().unwrap())
            .collect()
    }
}

/// Checks a snapshot the way etcd's restore does, independently of
/// imgbuild: 32 bytes past whole 512-byte blocks, the SHA-256 of the rest.
/// Also its mode (0600) and the `.sha256` record beside it.
fn assert_whole_snapshot(path: &Path) {
    let bytes = std::fs::read(path).unwrap();
    assert_eq!(bytes.len() % 512, 32, "{}: {}", path.display(), bytes.len());
    let (db, hash) = bytes.split_at(bytes.len() - 32);
    assert_eq!(sha2::Sha256::digest(db).as_slice(), hash);
    let mode = std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "{}", path.display());
    let record = std::fs::read_to_string(format!("{}.sha256", path.display())).unwrap();
    let name = path.file_name().unwrap().to_string_lossy();
    assert_eq!(
        record,
        format!("{}  {name}\n", hex::encode(sha2::Sha256::digest(&bytes)))
    );
}

/// Every file in `dir` (none when it does not exist), sorted.
fn files_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

#[test]
fn v1_11_upgrade_snapshots_etcd_once_before_the_first_control_plane_upgrade() {
    let c = Cluster::start(0, &["--reboot-delay", "300", "--upgrade-delay", "50"]);
    c.want("v1.11.5", &NODES.map(|(n, _, _)| n));
    let o = imgbuild(&c.config, &["--output", "json", "upgrade"], &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let report = json(&o);
    for (n, _, _) in NODES {
        assert_eq!(report["versions"][n], "v1.11.5", "{report}");
    }
    // One snapshot for the run (three control planes upgraded), asked for
    // before any node received an Upgrade call, and kept in the state dir.
    let etcd = c.etcd();
    let taken = etcd["snapshots"].as_array().unwrap();
    assert_eq!(taken.len(), 1, "{etcd}");
    assert_eq!(taken[0]["upgrade_calls_before"], 0, "{etcd}");
    assert_eq!(taken[0]["node"], "cp-01");
    assert!(c.upgrade_calls().iter().all(|n| *n >= 1));
    let files: Vec<String> = files_in(&c.snapshots_dir())
        .into_iter()
        .filter(|n| n.ends_with(".snapshot"))
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    assert!(
        files[0].starts_with("sim-") && files[0].ends_with("-cp-01.snapshot"),
        "{files:?}"
    );
    let path = c.snapshots_dir().join(&files[0]);
    assert_whole_snapshot(&path);
    let mode = std::fs::metadata(c.snapshots_dir())
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o700, "made by imgbuild, private");
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        taken[0]["size"].as_u64().unwrap()
    );
    let notes = report["notes"].to_string();
    assert!(notes.contains(&files[0]), "{report}");

    // Nothing left to upgrade: no control-plane change, no snapshot.
    let o = imgbuild(&c.config, &["upgrade"], &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(c.etcd()["snapshots"].as_array().unwrap().len(), 1);
}

#[test]
fn v1_11_a_failed_snapshot_stops_the_upgrade_before_any_node_unless_skipped() {
    let c = Cluster::start(
        1,
        &[
            "--reboot-delay",
            "300",
            "--upgrade-delay",
            "50",
            "--misbehave",
            "etcd-snapshot-truncated",
        ],
    );
    c.want("v1.11.5", &NODES.map(|(n, _, _)| n));
    let o = imgbuild(&c.config, &["upgrade"], &[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    assert!(
        err.contains("etcd snapshot") && err.contains("--skip-etcd-snapshot"),
        "{err}"
    );
    assert!(err.contains("sha256 checksum not found"), "{err}");
    assert_eq!(c.upgrade_calls(), [0; 5], "no node was asked to upgrade");
    assert!(
        files_in(&c.snapshots_dir()).is_empty(),
        "nothing half-written: {:?}",
        files_in(&c.snapshots_dir())
    );

    let o = imgbuild(
        &c.config,
        &["--output", "json", "upgrade", "--skip-etcd-snapshot"],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(json(&o)["versions"]["cp-01"], "v1.11.5");
    assert!(files_in(&c.snapshots_dir()).is_empty());
}

#[test]
fn v1_11_etcd_snapshot_writes_a_verified_file_and_keeps_the_newest_n() {
    let c = Cluster::start(2, &[]);
    let out = c.dir.path().join("backup/db.snapshot");
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    let o = imgbuild(
        &c.config,
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
    let snap = &json(&o)["snapshot"];
    assert_eq!(snap["node"], "cp-01");
    assert_eq!(snap["path"], out.to_str().unwrap());
    assert_eq!(snap["size"], std::fs::metadata(&out).unwrap().len());
    assert_whole_snapshot(&out);
    assert_eq!(
        files_in(out.parent().unwrap()),
        ["db.snapshot", "db.snapshot.sha256"]
    );
    // An existing file is replaced only with --force.
    let before = std::fs::read(&out).unwrap();
    let again = |extra: &[&str]| {
        let mut args = vec!["etcd", "snapshot", "--out", out.to_str().unwrap()];
        args.extend(extra);
        imgbuild(&c.config, &args, &[])
    };
    let o = again(&[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("db.snapshot exists: --force replaces it"));
    assert_eq!(std::fs::read(&out).unwrap(), before);
    let o = again(&["--force"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_whole_snapshot(&out);
    // Its record alone is reason enough; and never into the state dir.
    let other = c.dir.path().join("backup/other.snapshot");
    std::fs::write(c.dir.path().join("backup/other.snapshot.sha256"), "mine\n").unwrap();
    let o = imgbuild(
        &c.config,
        &["etcd", "snapshot", "--out", other.to_str().unwrap()],
        &[],
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("other.snapshot.sha256 exists"));
    let secrets = c.dir.path().join(".talos/sim/secrets.yaml");
    let kept = std::fs::read(&secrets).unwrap();
    let o = imgbuild(
        &c.config,
        &[
            "etcd",
            "snapshot",
            "--force",
            "--out",
            secrets.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("inside the cluster's state dir"));
    assert_eq!(std::fs::read(&secrets).unwrap(), kept);

    // Into the state dir, the newest two kept; a file imgbuild did not
    // write (no record, or not its name) is never deleted.
    let dir = c.snapshots_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let foreign = ["sim-20200101T000000.000Z-cp-01.snapshot", "mine.snapshot"];
    for f in foreign {
        std::fs::write(dir.join(f), b"not ours").unwrap();
    }
    let mut paths = Vec::new();
    for _ in 0..3 {
        let o = imgbuild(
            &c.config,
            &["--output", "json", "etcd", "snapshot", "--keep", "2"],
            &[],
        );
        assert!(o.status.success(), "{}", text(&o.stderr));
        paths.push(json(&o)["snapshot"]["path"].as_str().unwrap().to_owned());
    }
    let left = files_in(&dir);
    let mut want: Vec<String> = paths[1..]
        .iter()
        .flat_map(|p| {
            let n = Path::new(p)
                .file_name()
                .unwrap()
                .to_string_lossy()
                .into_owned();
            [n.clone(), format!("{n}.sha256")]
        })
        .chain(foreign.map(String::from))
        .collect();
    want.sort();
    assert_eq!(left, want);
    for p in &paths[1..] {
        assert_whole_snapshot(Path::new(p));
    }
}

#[test]
fn v1_11_a_truncated_endless_or_stalled_snapshot_stream_keeps_nothing() {
    let c = Cluster::start(
        3,
        &[
            "--misbehave",
            "etcd-snapshot-truncated@cp-01",
            "--misbehave",
            "etcd-snapshot-endless@cp-02",
            "--misbehave",
            "etcd-snapshot-stall@cp-03",
        ],
    );
    let out = c.dir.path().join("backup/db.snapshot");
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    // The snapshot comes from the first control plane in inventory order.
    for (first, flags, expected) in [
        ("cp-01", &[][..], "sha256 checksum not found"),
        (
            "cp-02",
            &["--max-size", "1M"][..],
            "larger than 1048576 bytes",
        ),
        (
            "cp-03",
            &["--call-timeout", "2s"][..],
            "sent nothing for 2s",
        ),
    ] {
        let mut order = vec![first];
        order.extend(NODES.iter().map(|(n, _, _)| *n).filter(|n| *n != first));
        c.want("v1.11.2", &order);
        let mut args = vec!["etcd", "snapshot", "--out", out.to_str().unwrap()];
        args.extend(flags);
        let started = std::time::Instant::now();
        let o = imgbuild(&c.config, &args, flags);
        let err = text(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{first}: {err}");
        assert!(
            err.contains(expected) && err.contains(first),
            "{first}: {err}"
        );
        assert!(err.contains("nothing kept"), "{first}: {err}");
        assert!(started.elapsed().as_secs() < 20, "{first}: bounded");
        assert!(
            files_in(out.parent().unwrap()).is_empty(),
            "{first}: {:?}",
            files_in(out.parent().unwrap())
        );
    }
}

/// A stream whose every message comes well inside the call timeout but
/// that never ends is stopped by the whole snapshot's deadline
/// (`--timeout`), and its temp file is gone: the state dir keeps nothing.
#[test]
fn v1_11_a_snapshot_trickling_inside_the_call_timeout_ends_at_its_deadline() {
    let c = Cluster::start(6, &["--misbehave", "etcd-snapshot-trickle@cp-01"]);
    let started = std::time::Instant::now();
    let o = imgbuild(
        &c.config,
        &[
            "etcd",
            "snapshot",
            "--timeout",
            "3s",
            "--call-timeout",
            "2s",
        ],
        &["--call-timeout"],
    );
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("cp-01")
            && err.contains("did not finish within 3s")
            && err.contains("nothing kept"),
        "{err}"
    );
    assert!(started.elapsed().as_secs() < 20, "bounded");
    assert_eq!(files_in(&c.snapshots_dir()), Vec::<String>::new());
}

/// Ctrl-C mid-stream: the run says what it left (nothing: its temp file
/// is removed) and how to resume.
#[test]
fn v1_11_ctrl_c_during_a_snapshot_keeps_nothing_and_says_so() {
    let c = Cluster::start(7, &["--misbehave", "etcd-snapshot-trickle@cp-01"]);
    let mut run = Run::with_config(&c.config, &["etcd", "snapshot"]);
    run.timeouts(&[]).env_remove("IMGBUILD_STATE_DIR");
    let child = run
        .into_command()
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Streaming: the temp file is there.
    let dir = c.snapshots_dir();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while files_in(&dir).is_empty() {
        assert!(std::time::Instant::now() < deadline, "no snapshot started");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    std::thread::sleep(std::time::Duration::from_millis(500));
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
    let o = child.wait_with_output().unwrap();
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("node cp-01: interrupted after") && err.contains("nothing kept"),
        "{err}"
    );
    assert!(err.contains("run the command again"), "{err}");
    assert_eq!(files_in(&dir), Vec::<String>::new());
}

#[test]
fn v1_11_bootstrap_recover_from_brings_a_wiped_cluster_back_with_its_data() {
    let c = Cluster::start(4, &[]);
    c.etcd_post(r#"{"put": {"/registry/configmaps/default/marker": "before-the-disaster"}}"#);
    let snap = c.dir.path().join("db.snapshot");
    let o = imgbuild(
        &c.config,
        &["etcd", "snapshot", "--out", snap.to_str().unwrap()],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));

    // `bootstrap --recover-from file` fails, saying `why`.
    let refused = |file: &Path, why: &str| {
        let o = imgbuild(
            &c.config,
            &[
                "bootstrap",
                "--new-secrets",
                "--recover-from",
                file.to_str().unwrap(),
            ],
            &[],
        );
        assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
        assert!(text(&o.stderr).contains(why), "{}", text(&o.stderr));
    };
    // A cluster whose etcd runs is not recovered over: every control plane
    // must be Preparing (Talos disaster recovery), each one that is not is
    // named, and nothing is uploaded.
    refused(
        &snap,
        "these are not: cp-01 (etcd Running), cp-02 (etcd Running), cp-03 (etcd Running)",
    );
    assert_eq!(c.etcd()["uploads"], serde_json::json!({}));

    // A file that is not a whole snapshot is refused before any node.
    let bad = c.dir.path().join("bad.snapshot");
    let mut bytes = std::fs::read(&snap).unwrap();
    bytes[5000] ^= 1;
    std::fs::write(&bad, &bytes).unwrap();
    refused(&bad, "not a whole etcd snapshot");
    // A 1 TiB file (sparse) is refused by its size, before it is read or
    // sent, with the hash check skipped too.
    let huge = c.dir.path().join("huge.snapshot");
    std::fs::File::create(&huge)
        .unwrap()
        .set_len(1 << 40)
        .unwrap();
    refused(&huge, "larger than an etcd snapshot can be");
    let o = imgbuild(
        &c.config,
        &[
            "bootstrap",
            "--new-secrets",
            "--recover-from",
            huge.to_str().unwrap(),
            "--recover-skip-hash-check",
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("larger than an etcd snapshot can be"));
    assert_eq!(c.etcd()["uploads"], serde_json::json!({}));

    // The disaster: every control plane's etcd data is gone (EPHEMERAL
    // wiped), the nodes keep their configs; etcd waits for bootstrap.
    c.etcd_post(r#"{"wipe": true}"#);
    assert_eq!(c.etcd()["keys"], serde_json::json!({}));
    let o = imgbuild(
        &c.config,
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
    let done = json(&o);
    assert_eq!(done["healthy"], true, "{done}");
    assert_eq!(done["recoveredFrom"], snap.to_str().unwrap());
    assert_eq!(done["bootstrapNode"], "cp-01");
    let etcd = c.etcd();
    assert_eq!(
        etcd["keys"]["/registry/configmaps/default/marker"], "before-the-disaster",
        "{etcd}"
    );
    let recoveries = etcd["recoveries"].as_array().unwrap();
    assert_eq!(recoveries.len(), 1, "{etcd}");
    assert_eq!(recoveries[0]["node"], "cp-01");
    assert_eq!(etcd["failures"], serde_json::json!([]), "{etcd}");
    // Health compared the members with the three control planes: the
    // others joined the recovered one.
    let o = imgbuild(&c.config, &["--output", "json", "status"], &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
}

#[test]
fn v1_11_bootstrap_recover_from_configures_replaced_machines_and_restores_the_data() {
    let c = Cluster::start(5, &[]);
    c.etcd_post(r#"{"put": {"/registry/secrets/default/marker": "kept"}}"#);
    let snap = c.dir.path().join("db.snapshot");
    let o = imgbuild(
        &c.config,
        &["etcd", "snapshot", "--out", snap.to_str().unwrap()],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    // Every machine is lost and replaced by a fresh one on its address, in
    // maintenance mode; the state dir (secrets.yaml) is what is left.
    let control = &c.nodes.control;
    for (name, host, _) in NODES {
        let ip = format!("{}.{host}", c.net);
        curl(&[
            "-X",
            "POST",
            "-H",
            "content-type: application/json",
            "-d",
            &format!(r#"{{"ip": "{ip}"}}"#),
            &format!("{control}/_sim/halt"),
        ]);
        c.etcd_post(r#"{"wipe": true}"#);
        curl(&[
            "-X",
            "POST",
            "-H",
            "content-type: application/json",
            "-d",
            &format!(r#"{{"name": "new-{name}", "ip": "{ip}", "hostname": "{name}"}}"#),
            &format!("{control}/_sim/boot"),
        ]);
    }
    let o = imgbuild(
        &c.config,
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
    let done = json(&o);
    assert_eq!(done["healthy"], true, "{done}");
    assert_eq!(done["applied"].as_array().unwrap().len(), 5, "{done}");
    let etcd = c.etcd();
    assert_eq!(
        etcd["keys"]["/registry/secrets/default/marker"], "kept",
        "{etcd}"
    );
    assert_eq!(etcd["recoveries"][0]["node"], "cp-01", "{etcd}");
}

#[test]
fn recover_skip_hash_check_needs_a_file_to_recover_from() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("cluster.yaml");
    let o = imgbuild(
        &config,
        &["bootstrap", "--new-secrets", "--recover-skip-hash-check"],
        &[],
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    assert!(
        text(&o.stderr).contains("--recover-from"),
        "{}",
        text(&o.stderr)
    );
}
