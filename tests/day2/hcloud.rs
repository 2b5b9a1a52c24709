//! End to end: day two on Hetzner Cloud with no node addresses in the
//! inventory, against the factory, Hetzner and Talos node simulators on
//! loopback (Talos v1.11.2, upgraded to v1.11.5). `status`, `apply`,
//! `upgrade` and `bootstrap` find the servers by label as `up` does, and
//! with the API down use the state dir's record of the last `up`, saying
//! it may be stale. Needs OpenSSH (the snapshot's rescue system).

use std::path::{Path, PathBuf};
use std::process::Output;

use crate::common;
use common::run::Run;
use common::sims::{Hc, Nodes, Sim};
use common::{json, text};

const INVENTORY: &str = "\
cluster:
  name: hd2
  talosVersion: v1.11.2
  kubernetesVersion: v1.32.1
  endpoint: https://127.0.9.250:6443
image:
  platform: hcloud
  factory: FACTORY
publish:
  hcloud:
    location: fsn1
    servers: {type: cpx22}
nodes:
  - {name: cp-01, role: controlplane}
  - {name: worker-01, role: worker}
";

struct Chain {
    factory: Sim,
    hc: Hc,
    nodes: Nodes,
    dir: tempfile::TempDir,
}

impl Chain {
    fn start(inventory: &str) -> Chain {
        let factory = Sim::start_with(&[], 0, &["--versions", "v1.11.2,v1.11.5"]);
        let nodes = Nodes::start(&["--reboot-delay", "200", "--upgrade-delay", "50"]);
        let hc = Hc::start(&["--nodes-control", nodes.control.as_str()]);
        let dir = tempfile::tempdir().unwrap();
        let c = Chain {
            factory,
            hc,
            nodes,
            dir,
        };
        c.write(inventory);
        c
    }

    fn write(&self, inventory: &str) {
        let text = inventory.replace("FACTORY", &self.factory.url);
        std::fs::write(self.config(), text).unwrap();
    }

    fn config(&self) -> PathBuf {
        self.dir.path().join("cluster.yaml")
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    /// imgbuild with the Hetzner simulator's token, test-sized timeouts and
    /// the state dir.
    fn imgbuild(&self, args: &[&str]) -> Run {
        let mut run = Run::with_config(&self.config(), args);
        run.hcloud(&self.hc)
            .env_remove("IMGBUILD_STATE_DIR")
            .env_remove("TALOSCONFIG")
            .arg("--state-dir")
            .arg(self.state());
        run
    }

    fn up(&self) -> Output {
        self.imgbuild(&[
            "up",
            "--new-secrets",
            "--output",
            "json",
            "--quiet",
            "--poll-ms",
            "100",
        ])
        .factory(&self.factory)
        .envs(self.hc.rescue_env())
        .folders(self.dir.path())
        .args(["--node-timeout", "60s", "--health-timeout", "90s"])
        .output()
    }

    /// A day-two command, JSON out.
    fn day2(&self, args: &[&str]) -> Output {
        let mut all = vec!["--output", "json"];
        all.extend_from_slice(args);
        self.imgbuild(&all).timeouts(&[]).output()
    }

    /// The same with the Hetzner API unreachable (a closed port).
    fn day2_api_down(&self, args: &[&str]) -> Output {
        let mut all = vec!["--output", "json"];
        all.extend_from_slice(args);
        self.imgbuild(&all)
            .timeouts(&[])
            .env("HCLOUD_ENDPOINT", "http://127.0.0.1:9/v1")
            .output()
    }
}

fn ok(o: &Output) -> serde_json::Value {
    assert!(
        o.status.success(),
        "exit {:?}\n{}\n{}",
        o.status.code(),
        text(&o.stdout),
        text(&o.stderr)
    );
    json(o)
}

/// The public IP each node's server has, by the API.
fn server_ips(hc: &Hc) -> Vec<(String, String)> {
    let (_, _, v) = hc.call("GET", "/servers?label_selector=imgbuild-cluster=hd2", None);
    let mut out: Vec<(String, String)> = v["servers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["labels"]["imgbuild-node"].as_str().unwrap().to_owned(),
                s["public_net"]["ipv4"]["ip"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    out.sort();
    out
}

fn versions(status: &serde_json::Value) -> Vec<(String, String)> {
    status["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            assert_eq!(n["reachable"], true, "{n}");
            (
                n["node"].as_str().unwrap().to_owned(),
                n["version"].as_str().unwrap_or("-").to_owned(),
            )
        })
        .collect()
}

fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

#[test]
fn day_two_on_hetzner_needs_no_addresses_in_the_inventory() {
    let c = Chain::start(INVENTORY);
    ok(&c.up());

    // `up` recorded where the servers are: no secrets, 0600.
    let record = c.state().join("hcloud-servers.json");
    let saved = std::fs::read_to_string(&record).unwrap();
    assert_eq!(mode(&record), 0o600);
    assert!(!saved.contains(&c.hc.token), "the token leaked: {saved}");
    let ips = server_ips(&c.hc);
    assert_eq!(ips.len(), 2);
    for (node, ip) in &ips {
        assert!(saved.contains(node) && saved.contains(ip), "{saved}");
    }

    // status: every node reached at its server's public IP.
    let o = c.day2(&["status"]);
    let v = ok(&o);
    assert_eq!(
        versions(&v),
        [
            ("cp-01".into(), "v1.11.2".into()),
            ("worker-01".into(), "v1.11.2".into())
        ]
    );
    assert!(!text(&o.stderr).contains("stale"), "{}", text(&o.stderr));

    // apply: a patch edit reaches the nodes.
    let patched = INVENTORY.replace("nodes:\n", "patches:\n  all: [ntp.yaml]\nnodes:\n");
    std::fs::write(
        c.dir.path().join("ntp.yaml"),
        "machine:\n  time:\n    servers: [127.0.0.123]\n",
    )
    .unwrap();
    c.write(&patched);
    let v = ok(&c.day2(&["apply"]));
    let changed: Vec<bool> = v["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["applied"] == true)
        .collect();
    assert_eq!(changed, [true, true], "{v}");
    let stats = c.nodes.stats();
    for (node, _) in &ips {
        assert_eq!(stats["nodes"][node]["applies"], 1, "{node}: {stats}");
    }
    let v = ok(&c.day2(&["status"]));
    for n in v["nodes"].as_array().unwrap() {
        assert_eq!(n["config_in_sync"], true, "{n}");
    }

    // upgrade: a version bump, every node moved.
    c.write(&patched.replace("v1.11.2", "v1.11.5"));
    let v = ok(&c.day2(&["upgrade"]));
    assert_eq!(
        v["upgraded"],
        serde_json::json!(["cp-01", "worker-01"]),
        "{v}"
    );
    let v = ok(&c.day2(&["status"]));
    assert_eq!(
        versions(&v),
        [
            ("cp-01".into(), "v1.11.5".into()),
            ("worker-01".into(), "v1.11.5".into())
        ]
    );

    // bootstrap: etcd already runs, the cluster is healthy.
    let v = ok(&c.day2(&["bootstrap", "--new-secrets"]));
    assert_eq!(v["healthy"], true, "{v}");
    assert_eq!(v["bootstrapped"], false, "{v}");

    // `up` after the upgrade: each server's image is history, so nothing
    // is built, downloaded or uploaded, and nothing is outdated.
    let (images, downloads) = (c.hc.stat("imagesCreated"), c.factory.image_gets());
    let v = ok(&c.up());
    assert_eq!(v["healthy"], true, "{v}");
    for n in v["nodes"].as_array().unwrap() {
        assert!(n["stages"].get("build").is_none(), "{n}");
        assert_eq!(n["stages"]["upload"], "unchanged", "{n}");
        assert_eq!(n["stages"]["vm"], "unchanged", "{n}");
    }
    assert!(!v.to_string().contains("outdated"), "{v}");
    assert_eq!(c.hc.stat("imagesCreated"), images);
    assert_eq!(c.factory.image_gets(), downloads);

    // The API down: the record stands in, and says it may be stale.
    let o = c.day2_api_down(&["status"]);
    let v = ok(&o);
    assert_eq!(versions(&v).len(), 2);
    let err = text(&o.stderr);
    assert!(
        err.contains("warning: the Hetzner API could not be asked") && err.contains("stale"),
        "{err}"
    );

    // Neither the API nor a record: a clear error, nothing reached.
    std::fs::remove_file(&record).unwrap();
    let o = c.day2_api_down(&["status"]);
    // JSON output carries the error on stdout.
    let err = format!("{}{}", text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("no record of the last `up`") && err.contains("hcloud-servers.json"),
        "{err}"
    );
    assert!(!err.contains(&c.hc.token), "{err}");
}

/// `up` in text, with its summary line on stdout.
fn up_text(c: &Chain, extra: &[&str]) -> String {
    let o = c
        .imgbuild(&["up", "--new-secrets", "--quiet", "--poll-ms", "100"])
        .args(extra)
        .factory(&c.factory)
        .envs(c.hc.rescue_env())
        .folders(c.dir.path())
        .args(["--node-timeout", "60s", "--health-timeout", "90s"])
        .output();
    assert!(
        o.status.success(),
        "exit {:?}\n{}\n{}",
        o.status.code(),
        text(&o.stdout),
        text(&o.stderr)
    );
    text(&o.stdout)
}

/// The summary's stage counts line.
fn counts(out: &str) -> &str {
    out.lines()
        .find(|l| l.contains("vm: "))
        .unwrap_or_else(|| panic!("no counts in {out}"))
}

/// One snapshot for four nodes is one build and one upload in the dry run
/// and in the summary; servers are counted per node.
#[test]
fn reports_count_one_snapshot_once() {
    let four = INVENTORY.replace(
        "  - {name: worker-01, role: worker}\n",
        "  - {name: worker-01, role: worker}\n  - {name: worker-02, role: worker}\n  - {name: worker-03, role: worker}\n",
    );
    let c = Chain::start(&four);
    let out = up_text(&c, &["--dry-run"]);
    assert!(
        counts(&out).starts_with("build: 1 to build; upload: 1 to upload; vm: 4 to create"),
        "{out}"
    );
    let out = up_text(&c, &[]);
    assert!(
        counts(&out).starts_with("build: 1 built; upload: 1 uploaded; vm: 4 created"),
        "{out}"
    );
    assert_eq!(c.hc.stat("imagesCreated"), 1);
    // A rerun: the servers exist, nothing is built or uploaded for them.
    let out = up_text(&c, &[]);
    assert!(
        counts(&out).starts_with("upload: 4 unchanged; vm: 4 unchanged"),
        "{out}"
    );
}

/// A mixed cluster: an amd64 control plane on cpx22 in fsn1 and an arm64
/// worker on cax21 in nbg1 (their own `serverType`, `location`, `arch`).
/// One snapshot per architecture, each server made from its own arch's,
/// in its own location; the cluster comes up healthy.
#[test]
fn a_mixed_arm64_amd64_cluster_gets_one_snapshot_per_arch() {
    let mixed = INVENTORY.replace(
        "  - {name: worker-01, role: worker}\n",
        "  - {name: worker-01, role: worker, arch: arm64, serverType: cax21, location: nbg1}\n  - {name: worker-02, role: worker, arch: arm64, serverType: cax21, location: nbg1}\n",
    );
    let c = Chain::start(&mixed);
    let out = up_text(&c, &[]);
    assert!(
        counts(&out).starts_with("build: 2 built; upload: 2 uploaded; vm: 3 created"),
        "{out}"
    );
    assert_eq!(c.hc.stat("imagesCreated"), 2);
    let (_, _, v) =
        c.hc.call("GET", "/servers?label_selector=imgbuild-cluster=hd2", None);
    let mut seen: Vec<(String, String, String, String, String)> = v["servers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let image = s["image"]["id"].as_u64().unwrap();
            let (_, _, i) = c.hc.call("GET", &format!("/images/{image}"), None);
            (
                s["labels"]["imgbuild-node"].as_str().unwrap().to_owned(),
                s["server_type"]["name"].as_str().unwrap().to_owned(),
                s["location"]["name"].as_str().unwrap().to_owned(),
                i["image"]["architecture"].as_str().unwrap().to_owned(),
                i["image"]["labels"]["arch"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    seen.sort();
    let row = |n: &str, t: &str, l: &str, a: &str, label: &str| {
        (n.into(), t.into(), l.into(), a.into(), label.into())
    };
    assert_eq!(
        seen,
        [
            row("cp-01", "cpx22", "fsn1", "x86", "amd64"),
            row("worker-01", "cax21", "nbg1", "arm", "arm64"),
            row("worker-02", "cax21", "nbg1", "arm", "arm64"),
        ]
    );
    assert!(out.contains("is healthy"), "{out}");

    // A server type without the node's architecture: refused, naming the
    // node, before anything is built.
    let wrong = mixed.replace(
        "  - {name: worker-02, role: worker, arch: arm64, serverType: cax21, location: nbg1}\n",
        "  - {name: worker-02, role: worker, arch: arm64, serverType: cax21, location: nbg1}\n  - {name: worker-03, role: worker, arch: arm64, serverType: cpx22}\n",
    );
    c.write(&wrong);
    let o = c
        .imgbuild(&["up", "--dry-run"])
        .factory(&c.factory)
        .folders(c.dir.path())
        .output();
    let all = format!("{}{}", text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(2), "{all}");
    assert!(
        all.contains("node worker-03: server type cpx22 cannot run it in fsn1: its architecture is x86, the image's arm64"),
        "{all}"
    );
}
