//! End to end: `imgbuild up` against the factory, Proxmox VE and Talos node
//! simulators on loopback. The Proxmox simulator boots a node for each VM it
//! starts at the address in that VM disk's META key 10, so a node answers
//! only if the image published for it carries its own network: the chain is
//! checked, not assumed.
// A test's stderr is libtest's to capture, not the CLI's one writer.
#![allow(clippy::disallowed_macros)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common;
use common::inventory::{Inventory, NODES};
use common::run::Run;
use common::sims::{Nodes, Pve, Sim};
use common::{json, stdout_ok, text};

/// The loopback /24 of scenario `k` (tests/common/net.rs).
fn net(k: u8) -> String {
    common::net::scenario(module_path!(), k)
}

/// The three simulators wired as a chain, and a working folder.
struct Chain {
    factory: Sim,
    pve: Pve,
    nodes: Nodes,
    dir: tempfile::TempDir,
    net: String,
}

impl Chain {
    fn start(k: u8) -> Chain {
        Self::start_with(k, &[])
    }

    /// With more switches for the Proxmox simulator.
    fn start_with(k: u8, pve_extra: &[&str]) -> Chain {
        let net = net(k);
        let nodes = Nodes::start(&["--vip", &format!("{net}.10")]);
        let mut extra = vec!["--nodes-control", nodes.control.as_str()];
        extra.extend_from_slice(pve_extra);
        let pve = Pve::start(&extra);
        let dir = tempfile::tempdir().unwrap();
        Inventory::five_nodes("up", &net)
            .metal("raw")
            .proxmox(true)
            .write(dir.path());
        Chain {
            factory: Sim::start(&[]),
            pve,
            nodes,
            dir,
            net,
        }
    }

    fn config(&self) -> PathBuf {
        self.dir.path().join("cluster.yaml")
    }

    fn out(&self) -> PathBuf {
        self.dir.path().join("out")
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    /// `imgbuild <args>` on `config` with the simulators' URLs, token and
    /// pin, test-sized timeouts and the working folder's out, cache and
    /// state dirs.
    fn command(&self, config: &Path, args: &[&str]) -> Command {
        let mut run = Run::with_config(config, args);
        if args.contains(&"up") {
            // A new cluster: its secrets are made on the first run.
            run.timeouts(args)
                .arg("--state-dir")
                .arg(self.state())
                .arg("--new-secrets");
        }
        run.factory(&self.factory)
            .args(["--poll-ms", "50", "--quiet"])
            .folders(self.dir.path())
            .env_remove("IMGBUILD_STATE_DIR")
            .env_remove("TALOSCONFIG")
            .proxmox(&self.pve);
        run.into_command()
    }

    /// `imgbuild --output json up <extra>`: its output and JSON document.
    fn up(&self, extra: &[&str]) -> (Output, serde_json::Value) {
        let mut args = vec!["--output", "json", "up"];
        args.extend_from_slice(extra);
        let out = self.command(&self.config(), &args).output().unwrap();
        let v = json(&out);
        (out, v)
    }

    fn address(&self, host: u8) -> String {
        format!("{}.{host}", self.net)
    }
}

/// A node's counter as the node simulator keeps it (by node name).
fn node_stat(stats: &serde_json::Value, node: &str, key: &str) -> u64 {
    stats["nodes"][node][key]
        .as_u64()
        .unwrap_or_else(|| panic!("no {key} for {node} in {stats}"))
}

/// Bootstraps the node simulator served, over every node.
fn bootstraps(stats: &serde_json::Value) -> u64 {
    stats["nodes"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(_, n)| n["bootstraps"].as_u64().unwrap_or(0))
        .sum()
}

/// The Proxmox simulator's counters of things that change state.
const PVE_CHANGES: [&str; 7] = [
    "uploads",
    "uploadAttempts",
    "vmCreates",
    "vmConfigChanges",
    "resizes",
    "starts",
    "stops",
];

#[test]
fn five_nodes_come_up_healthy_and_a_second_up_changes_nothing() {
    let c = Chain::start(1);
    let started = Instant::now();
    let (out, v) = c.up(&[]);
    stdout_ok(&out);
    eprintln!("first up: {:?}", started.elapsed());
    assert_eq!(v["healthy"], true, "{v}");
    assert_eq!(v["target"], "proxmox");
    assert_eq!(v["bootstrap"], "bootstrapped");
    assert_eq!(v["bootstrapNode"], "cp-01");
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(c.out().join("manifest.json")).unwrap()).unwrap();
    let nodes = v["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 5, "{v}");
    for (i, ((name, host, _), n)) in NODES.iter().zip(nodes).enumerate() {
        assert_eq!(n["node"], *name);
        assert_eq!(n["address"], c.address(*host));
        assert_eq!(n["sha256"], manifest["images"][name]["sha256"], "{n}");
        let volume = n["volume"].as_str().unwrap();
        assert!(
            volume.starts_with(&format!("local:import/up_{name}-v1.11.2-")),
            "{volume}"
        );
        assert_eq!(n["vmid"], 300 + i as u64);
        assert_eq!(n["talos"], "configured", "{n}");
        assert_eq!(n["talosVersion"], "v1.11.2", "{n}");
        assert_eq!(n["kubernetesReady"], true, "{n}");
        let want = serde_json::json!({"build": "built", "upload": "uploaded", "vm": "created", "start": "started", "apply": "applied"});
        assert_eq!(n["stages"], want, "{n}");
    }
    // The kubeconfig up wrote lists the five nodes, all Ready.
    let kc = std::fs::read_to_string(c.state().join("kubeconfig")).unwrap();
    let kc = imgbuild::talos::kube::Kubeconfig::parse(&kc).unwrap();
    let mut ready: Vec<(String, bool)> = kc
        .node_readiness(Duration::from_secs(5))
        .unwrap()
        .into_iter()
        .map(|n| (n.name, n.ready))
        .collect();
    ready.sort();
    let want: Vec<(String, bool)> = NODES.iter().map(|(n, ..)| (n.to_string(), true)).collect();
    assert_eq!(ready, want);
    // Each node simulator was booted by its VM from the key-10 address.
    let stats = c.nodes.stats();
    for (name, host, _) in NODES {
        assert_eq!(stats["nodes"][name]["ip"], c.address(host), "{stats}");
        assert_eq!(node_stat(&stats, name, "applies"), 1);
    }
    assert_eq!(bootstraps(&stats), 1);
    let pve = c.pve.stats();
    assert_eq!(pve["uploads"], 5);
    assert_eq!(pve["vmCreates"], 5);
    assert_eq!(pve["starts"], 5);

    // Again: every stage is unchanged, and the simulators count nothing new.
    let (out, v) = c.up(&[]);
    stdout_ok(&out);
    assert_eq!(v["healthy"], true);
    assert_eq!(v["bootstrap"], "unchanged");
    for n in v["nodes"].as_array().unwrap() {
        let want = serde_json::json!({"build": "unchanged", "upload": "unchanged", "vm": "unchanged", "start": "unchanged", "apply": "unchanged"});
        assert_eq!(n["stages"], want, "{n}");
        assert_eq!(n["kubernetesReady"], true, "{n}");
    }
    let again = c.pve.stats();
    for key in PVE_CHANGES {
        assert_eq!(again[key], pve[key], "{key} changed on a second up");
    }
    let stats = c.nodes.stats();
    for (name, ..) in NODES {
        assert_eq!(node_stat(&stats, name, "applies"), 1, "{name}");
    }
    assert_eq!(bootstraps(&stats), 1);

    // The text summary: one row per node, every stage unchanged.
    let out = c.command(&c.config(), &["up"]).output().unwrap();
    stdout_ok(&out);
    let table = text(&out.stdout);
    for (name, host, _) in NODES {
        let row = table
            .lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no row for {name}:\n{table}"));
        for want in [
            &c.address(host),
            "configured v1.11.2",
            "Ready",
            "local:import/up_",
        ] {
            assert!(row.contains(want), "{want:?} not in {row:?}");
        }
    }
    assert!(
        table.contains("build: 5 unchanged; upload: 5 unchanged; vm: 5 unchanged; start: 5 unchanged; apply: 5 unchanged; etcd: unchanged (cp-01)"),
        "{table}"
    );
    // A dry run on the healthy cluster plans nothing and sends nothing.
    let before = (c.pve.stats(), c.nodes.stats());
    let (out, v) = c.up(&["--dry-run"]);
    stdout_ok(&out);
    assert_eq!(v["dryRun"], true);
    for n in v["nodes"].as_array().unwrap() {
        let want = serde_json::json!({"build": "unchanged", "upload": "unchanged", "vm": "unchanged", "start": "unchanged", "apply": "unchanged"});
        assert_eq!(n["stages"], want, "{n}");
        assert_eq!(n["talos"], "configured", "{n}");
    }
    let after = c.pve.stats();
    for key in PVE_CHANGES {
        assert_eq!(after[key], before.0[key], "{key} changed on a dry run");
    }
    assert_eq!(bootstraps(&c.nodes.stats()), 1);
    // Terraform's -detailed-exitcode: nothing to do is 0.
    let (out, v) = c.up(&["--dry-run", "--detailed-exitcode"]);
    assert_eq!(out.status.code(), Some(0), "{v}");
    assert_eq!(v["plan"], serde_json::json!([]), "{v}");
}

#[test]
fn a_dry_run_plans_everything_and_changes_nothing() {
    let c = Chain::start(2);
    let (out, v) = c.up(&["--dry-run"]);
    stdout_ok(&out);
    assert_eq!(v["dryRun"], true);
    // Planned values: a consumer never takes a plan for a finished run.
    assert_eq!(v["bootstrap"], "to bootstrap", "{v}");
    for (i, n) in v["nodes"].as_array().unwrap().iter().enumerate() {
        let want = serde_json::json!({"build": "to build", "upload": "to upload", "vm": "to create", "start": "to start", "apply": "to apply"});
        assert_eq!(n["stages"], want, "{n}");
        assert_eq!(n["vmid"], 300 + i as u64);
        assert_eq!(n["talos"], "unreachable", "{n}");
    }
    let pve = c.pve.stats();
    for key in PVE_CHANGES {
        assert_eq!(pve[key], 0, "{key}: a dry run changed something");
    }
    assert!(
        pve["requests"].as_u64().unwrap() > 0,
        "the plan read nothing"
    );
    assert!(!c.out().exists(), "a dry run built images");
    assert!(!c.state().exists(), "a dry run wrote the state dir");
    let stats = c.nodes.stats();
    assert_eq!(bootstraps(&stats), 0);
    // The text plan says what would happen.
    let out = c
        .command(&c.config(), &["up", "--dry-run"])
        .output()
        .unwrap();
    stdout_ok(&out);
    let plan = text(&out.stdout);
    assert!(plan.contains("nothing was changed"), "{plan}");
    assert!(
        plan.contains("build: 5 to build; upload: 5 to upload; vm: 5 to create; start: 5 to start; apply: 5 to apply; etcd: to bootstrap (cp-01)"),
        "{plan}"
    );
    // With --detailed-exitcode, changes planned are 4 (not 0, not 1), and
    // the plan is printed in full all the same.
    let (out, v) = c.up(&["--dry-run", "--detailed-exitcode"]);
    assert_eq!(out.status.code(), Some(4), "{}", text(&out.stderr));
    assert!(!v["plan"].as_array().unwrap().is_empty(), "{v}");
    let out = c
        .command(&c.config(), &["up", "--dry-run", "--detailed-exitcode"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(4));
    assert!(
        text(&out.stderr).contains("action(s) planned"),
        "{}",
        text(&out.stderr)
    );
    assert!(
        !text(&out.stderr).contains("error:"),
        "{}",
        text(&out.stderr)
    );
    // Without a dry run the flag is a usage error.
    let out = c
        .command(&c.config(), &["up", "--detailed-exitcode"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

/// Zeroes the partition named META in a raw GPT image, as `sgdisk` lists it.
fn wipe_meta(image: &Path) {
    let o = Command::new("sgdisk")
        .arg("-p")
        .arg(image)
        .output()
        .unwrap();
    assert!(o.status.success(), "sgdisk -p: {}", text(&o.stderr));
    let listing = text(&o.stdout);
    let line = listing
        .lines()
        .find(|l| l.split_whitespace().last() == Some("META"))
        .unwrap_or_else(|| panic!("no META partition:\n{listing}"));
    let f: Vec<u64> = line
        .split_whitespace()
        .take(3)
        .map(|x| x.parse().unwrap())
        .collect();
    let (start, end) = (f[1], f[2]);
    use std::io::{Seek, SeekFrom, Write};
    let mut file = std::fs::OpenOptions::new().write(true).open(image).unwrap();
    file.seek(SeekFrom::Start(start * 512)).unwrap();
    file.write_all(&vec![0u8; ((end - start + 1) * 512) as usize])
        .unwrap();
    file.sync_all().unwrap();
}

#[test]
fn an_image_without_meta_fails_naming_the_node_and_its_address() {
    let c = Chain::start(3);
    // Upload only (no VMs yet), then remove worker-02's META in the storage.
    let uploads = c.dir.path().join("uploads.yaml");
    Inventory::five_nodes("up", &c.net)
        .metal("raw")
        .proxmox(false)
        .write_to(&uploads);
    let out = c
        .command(&uploads, &["--output", "json", "publish"])
        .output()
        .unwrap();
    stdout_ok(&out);
    let published = json(&out);
    let volid = published["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node"] == "worker-02")
        .unwrap()["volid"]
        .as_str()
        .unwrap()
        .to_owned();
    wipe_meta(&c.pve.stored(volid.strip_prefix("local:import/").unwrap()));

    let (out, v) = c.up(&["--node-timeout", "3s"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert_eq!(v["failedStage"], "bootstrap", "{v}");
    let err = v["error"].as_str().unwrap();
    let addr = format!("{}:50000", c.address(22));
    assert!(err.contains("node worker-02"), "{err}");
    assert!(err.contains(&addr), "{addr} not in {err}");
    assert_eq!(v["healthy"], false);
    // The image itself went up unchanged: the VM was made from it.
    let worker = &v["nodes"][4];
    assert_eq!(worker["stages"]["upload"], "unchanged", "{worker}");
    assert_eq!(worker["stages"]["vm"], "created", "{worker}");
    assert_eq!(worker["stages"]["apply"], "failed", "{worker}");
    assert!(
        worker["error"].as_str().unwrap().contains(&addr),
        "{worker}"
    );
    let pve = c.pve.stats();
    assert_eq!(pve["bootFailures"], 1, "{pve}");
    // Text mode names them too.
    let out = c
        .command(&c.config(), &["up", "--node-timeout", "2s"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains("node worker-02") && err.contains(&addr),
        "{err}"
    );
}

#[test]
fn up_killed_during_publish_resumes_without_uploading_twice() {
    let c = Chain::start(4);
    let mut child = c
        .command(&c.config(), &["--output", "json", "up"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Only a guard against a hang (the loop ends when up does): on a loaded
    // machine building five images may take minutes.
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let uploads = c.pve.stats()["uploads"].as_u64().unwrap();
        if uploads >= 2 {
            break;
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "up ended before it was killed"
        );
        assert!(Instant::now() < deadline, "publishing never got going");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    // The killed run's tasks outlive it, as pveproxy's workers do: an upload
    // it had finished sending still imports, a create still creates. Counts
    // read before they end would still grow, and a rerun racing them would
    // find a volume or VM appear under it.
    let killed = c.pve.idle_stats();
    assert!(
        killed["uploads"].as_u64().unwrap() < 5,
        "killed too late: {killed}"
    );

    let (out, v) = c.up(&[]);
    stdout_ok(&out);
    assert_eq!(v["healthy"], true);
    let pve = c.pve.stats();
    assert_eq!(pve["uploads"], 5, "an image was uploaded twice: {pve}");
    let reuploaded: Vec<&serde_json::Value> = v["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|n| n["stages"]["upload"] == "uploaded")
        .collect();
    assert_eq!(
        reuploaded.len() as u64,
        5 - killed["uploads"].as_u64().unwrap(),
        "{v}"
    );
    assert_eq!(pve["vmCreates"], 5, "{pve}");
    assert_eq!(bootstraps(&c.nodes.stats()), 1);
    for n in v["nodes"].as_array().unwrap() {
        assert_eq!(n["kubernetesReady"], true, "{n}");
    }
}

#[test]
fn a_node_that_fails_to_publish_stops_up_before_bootstrap_with_exit_3() {
    // The first upload is cut three times: more than the client retries.
    let c = Chain::start_with(
        7,
        &["--drop-upload-after", "1000000", "--drop-uploads", "3"],
    );
    let (out, v) = c.up(&[]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    assert_eq!(v["failedStage"], "publish", "{v}");
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .starts_with("publish: 1 failed (cp-01)"),
        "{v}"
    );
    assert_eq!(v["healthy"], false);
    assert_eq!(v["bootstrap"], serde_json::Value::Null);
    let nodes = v["nodes"].as_array().unwrap();
    assert_eq!(nodes[0]["stages"]["upload"], "failed", "{}", nodes[0]);
    assert!(
        nodes[0]["error"].as_str().unwrap().contains("upload"),
        "{}",
        nodes[0]
    );
    for n in &nodes[1..] {
        assert_eq!(n["stages"]["upload"], "uploaded", "{n}");
        assert_eq!(n["error"], serde_json::Value::Null, "{n}");
    }
    assert_eq!(
        bootstraps(&c.nodes.stats()),
        0,
        "bootstrapped a cluster missing a node"
    );

    // Rerun: only cp-01 goes up now, and the cluster comes up.
    let (out, v) = c.up(&[]);
    stdout_ok(&out);
    assert_eq!(v["healthy"], true);
    assert_eq!(v["nodes"][0]["stages"]["upload"], "uploaded");
    for n in &v["nodes"].as_array().unwrap()[1..] {
        assert_eq!(n["stages"]["upload"], "unchanged", "{n}");
    }
    assert_eq!(c.pve.stats()["uploads"], 5);
}

#[test]
fn without_a_target_up_bootstraps_machines_booted_otherwise() {
    let net = net(5);
    let nodes = Nodes::cluster(&net, true, &[]);
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("cluster.yaml");
    Inventory::five_nodes("up", &net)
        .metal("raw")
        .write_to(&config);
    let out = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
        .arg("--config")
        .arg(&config)
        .args([
            "--output",
            "json",
            "up",
            "--new-secrets",
            "--quiet",
            "--poll",
            "100ms",
        ])
        .args(["--node-timeout", "20s", "--health-timeout", "30s"])
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .arg("--out-dir")
        .arg(dir.path().join("out"))
        .env_remove("IMGBUILD_CONFIG")
        .env_remove("TALOSCONFIG")
        .output()
        .unwrap();
    stdout_ok(&out);
    let v = json(&out);
    assert_eq!(v["target"], "none");
    assert_eq!(v["healthy"], true);
    for n in v["nodes"].as_array().unwrap() {
        assert_eq!(n["stages"], serde_json::json!({"apply": "applied"}), "{n}");
        assert_eq!(n["volume"], serde_json::Value::Null);
        assert_eq!(n["kubernetesReady"], true, "{n}");
    }
    assert!(
        !dir.path().join("out").exists(),
        "built images for no target"
    );
    assert_eq!(bootstraps(&nodes.stats()), 1);
}

#[test]
fn an_inventory_up_cannot_use_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let run = |yaml: &str| {
        let config = dir.path().join("cluster.yaml");
        std::fs::write(&config, yaml).unwrap();
        Command::new(env!("CARGO_BIN_EXE_imgbuild"))
            .arg("--config")
            .arg(&config)
            .args(["up", "--dry-run"])
            .env_remove("IMGBUILD_CONFIG")
            .env_remove("PROXMOX_VE_ENDPOINT")
            .env_remove("PROXMOX_VE_API_TOKEN")
            .output()
            .unwrap()
    };
    let net = net(6);
    let out = run(&Inventory::five_nodes("up", &net)
        .metal("raw")
        .proxmox(false)
        .text());
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("publish.proxmox has no vm section"),
        "{}",
        text(&out.stderr)
    );
    let out = run(&Inventory::five_nodes("up", &net)
        .metal("raw")
        .proxmox(true)
        .text());
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("PROXMOX_VE_ENDPOINT is not set"));
    let out = run(&Inventory::five_nodes("up", &net)
        .metal("raw")
        .text()
        .replace("role: worker", "role: boss"));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let config = dir.path().join("cluster.yaml");
    Inventory::five_nodes("up", &net)
        .metal("raw")
        .write_to(&config);
    let out = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
        .arg("--config")
        .arg(&config)
        .args(["up", "--dry-run", "cp-09"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("cp-09"), "{}", text(&out.stderr));
}

#[test]
fn a_cluster_without_a_cni_is_never_called_healthy() {
    let net = net(8);
    let nodes = Nodes::cluster(&net, true, &[]);
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("cluster.yaml");
    std::fs::write(
        dir.path().join("no-cni.yaml"),
        "cluster:\n  network:\n    cni:\n      name: none\n",
    )
    .unwrap();
    let yaml = Inventory::five_nodes("up", &net)
        .metal("raw")
        .append("patches:\n  all: [no-cni.yaml]\n")
        .text();
    std::fs::write(&config, yaml).unwrap();
    let up = |json: bool| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_imgbuild"));
        cmd.arg("--config").arg(&config);
        if json {
            cmd.args(["--output", "json"]);
        }
        cmd.args(["up", "--new-secrets", "--quiet", "--poll", "100ms"])
            .args(["--node-timeout", "20s", "--health-timeout", "60s"])
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .arg("--out-dir")
            .arg(dir.path().join("out"))
            .env_remove("IMGBUILD_CONFIG")
            .env_remove("TALOSCONFIG")
            .output()
            .unwrap()
    };
    let out = up(true);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    let v = json(&out);
    assert_eq!(v["healthy"], false, "{v}");
    assert_eq!(v["health"]["state"], "noCni", "{v}");
    assert_eq!(v["bootstrap"], "bootstrapped", "{v}");
    assert_eq!(
        v["fallbacks"],
        serde_json::json!([]),
        "the VIP answered: {v}"
    );
    for n in v["nodes"].as_array().unwrap() {
        assert_eq!(n["talos"], "configured", "{n}");
        assert_eq!(n["kubernetesReady"], false, "{n}");
    }
    assert_eq!(bootstraps(&nodes.stats()), 1);
    // The table shows NotReady rows, so it must not say healthy.
    let out = up(false);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    let table = text(&out.stdout);
    assert_eq!(
        table.lines().filter(|l| l.ends_with("NotReady")).count(),
        5,
        "{table}"
    );
    assert!(!table.contains("is healthy"), "{table}");
    let err = text(&out.stderr);
    assert!(
        err.contains("cluster.network.cni.name is none") && err.contains("cluster.inlineManifests"),
        "{err}"
    );
}

#[test]
fn a_proxmox_failure_is_recorded_where_it_happened() {
    // Every start task fails: the images are stored and the VMs made.
    let c = Chain::start_with(10, &["--fail-task", "qmstart"]);
    let (out, v) = c.up(&[]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert_eq!(v["failedStage"], "publish", "{v}");
    for n in v["nodes"].as_array().unwrap() {
        let want = serde_json::json!({"build": "built", "upload": "uploaded", "vm": "created", "start": "failed"});
        assert_eq!(n["stages"], want, "{n}");
        assert!(n["vmid"].as_u64().is_some(), "{n}");
        assert!(n["error"].as_str().unwrap().contains("starting VM"), "{n}");
    }
}

#[test]
fn up_of_one_node_shows_its_apply_beside_the_absent_others() {
    let c = Chain::start(11);
    let (out, v) = c.up(&["cp-01", "--node-timeout", "5s"]);
    assert_ne!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(v["failedStage"], "bootstrap", "{v}");
    let nodes = v["nodes"].as_array().unwrap();
    assert_eq!(nodes[0]["node"], "cp-01");
    assert_eq!(nodes[0]["stages"]["apply"], "applied", "{}", nodes[0]);
    assert_eq!(nodes[0]["talos"], "configured", "{}", nodes[0]);
    for n in &nodes[1..] {
        assert_eq!(n["stages"]["apply"], "failed", "{n}");
    }
    assert_eq!(v["bootstrap"], "bootstrapped", "{v}");
}
