//! The simulated chain, verified: a VM the Proxmox simulator starts boots a
//! Talos node (node simulator) at the address its disk's META key 10 names,
//! and a disk without one never comes up. Key 10 is written by the real
//! `imgbuild publish`, read back by the simulator's own reader; failures use
//! the fixtures' disks (no key 10, an all-zero META, no META at all).
//! Likewise a Hetzner server made from a snapshot boots a node configured
//! from its user_data (a config the real `imgbuild config` renders) on the
//! public address the API reports.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::common;
use common::inventory::{Inventory, NODES};
use common::run::Run;
use common::sims::{Hc, Nodes, Pve, Sim};
use common::{root, text};

/// A node simulator with no fixed nodes (machines boot them), quicker
/// than [`Nodes::FAST`].
fn machine_nodes(extra: &[&str]) -> Nodes {
    let delays = ["--apply-delay", "50", "--etcd-delay", "100"];
    let nodes = Nodes::start_with(
        &[
            &delays[..],
            &["--kubelet-delay", "100", "--ready-delay", "100"],
        ]
        .concat(),
        extra,
    );
    assert_eq!(nodes.stats()["totals"]["nodes"], 0);
    nodes
}

/// This file's loopback /24 (tests/common/net.rs).
fn net() -> String {
    common::net::block(module_path!())
}

/// Publishes the loopback example, on this process's addresses, to
/// Proxmox with VMs from id 300.
fn publish(dir: &Path, sim: &Sim, pve: &Pve) {
    let config = Inventory::loopback()
        .replace("address: 127.0.0.", &format!("address: {}.", net()))
        .replace("127.0.0.20", &format!("{}.20", net()))
        .proxmox(true)
        .write(dir);
    let o = Run::with_config(&config, &["publish", "--poll-ms", "50", "--quiet"])
        .factory(sim)
        .folders(dir)
        .proxmox(pve)
        .output();
    assert!(
        o.status.success(),
        "{}\n{}",
        text(&o.stdout),
        text(&o.stderr)
    );
}

fn stat(pve: &Pve, key: &str) -> u64 {
    pve.stats()[key]
        .as_u64()
        .unwrap_or_else(|| panic!("no {key} in stats"))
}

/// `GET /_sim/vms/<vmid>`.
fn vm_state(pve: &Pve, vmid: u32) -> serde_json::Value {
    let o = Command::new("curl")
        .args(["-sk", &format!("{}_sim/vms/{vmid}", pve.url)])
        .output()
        .unwrap();
    serde_json::from_slice(&o.stdout).unwrap()
}

/// `POST …/status/<what>` and waits for the task; its exit status.
fn power(pve: &Pve, vmid: u32, what: &str) -> serde_json::Value {
    let (code, v) = pve.curl(
        &format!("/nodes/pve/qemu/{vmid}/status/{what}"),
        &["-X", "POST"],
    );
    assert_eq!(code, 200, "{v}");
    pve.wait(&v["data"])["exitstatus"].clone()
}

/// The TLS server certificate on `addr`, as openssl sees it (None: no TLS there).
fn server_cert(addr: &str) -> Option<String> {
    let o = Command::new("openssl")
        .args(["s_client", "-connect", addr])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let out = text(&o.stdout);
    out.contains("BEGIN CERTIFICATE").then_some(out)
}

/// Byte offset of the partition named `name`, from `sgdisk -p` (not from
/// imgbuild or the simulator).
fn partition_offset(image: &Path, name: &str) -> u64 {
    let o = Command::new("sgdisk")
        .arg("-p")
        .arg(image)
        .output()
        .unwrap();
    assert!(o.status.success(), "sgdisk -p {}", image.display());
    let out = text(&o.stdout);
    let sector: u64 = out
        .lines()
        .find_map(|l| l.strip_prefix("Sector size (logical/physical): "))
        .and_then(|l| l.split('/').next())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(512);
    let start: u64 = out
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.len() >= 7 && f.last() == Some(&name))
        .map(|f| f[1].parse().unwrap())
        .unwrap_or_else(|| panic!("no {name} partition in {out}"));
    start * sector
}

fn wait_for(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn each_published_vm_boots_the_node_its_meta_names_and_only_that() {
    let sim = Sim::start(&[]);
    let nodes = machine_nodes(&["--vip", &format!("{}.20", net())]);
    let pve = Pve::start(&["--nodes-control", &nodes.control]);
    let dir = tempfile::tempdir().unwrap();
    publish(dir.path(), &sim, &pve);
    let stats = nodes.stats();
    assert_eq!(stats["totals"]["nodes"], 5, "{stats}");
    for (i, (name, host, _)) in NODES.iter().enumerate() {
        let n = &stats["nodes"][name];
        assert_eq!(n["ip"], format!("{}.{host}", net()), "{name}: {stats}");
        assert_eq!(n["booted_by"], format!("vm-{}", 300 + i), "{name}");
        assert_eq!(n["phase"], "maintenance", "{name}");
        assert_eq!(n["config_error"], serde_json::Value::Null);
        assert_eq!(
            vm_state(&pve, 300 + i as u32)["bootedIp"],
            format!("{}.{host}", net())
        );
        assert!(
            server_cert(&format!("{}.{host}:50000", net())).is_some(),
            "{name} does not answer TLS on port 50000"
        );
    }
    assert_eq!(
        (stat(&pve, "startsChanged"), stat(&pve, "bootFailures")),
        (5, 0)
    );

    // A rerun starts nothing and boots nothing twice.
    publish(dir.path(), &sim, &pve);
    assert_eq!(stat(&pve, "startsChanged"), 5);
    assert_eq!(nodes.stats()["totals"]["nodes"], 5);

    // The booted nodes are a cluster the real bootstrap brings up: each
    // takes its role from the config applied to it.
    let o = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
        .arg("--config")
        .arg(dir.path().join("cluster.yaml"))
        .args([
            "--output",
            "json",
            "bootstrap",
            "--new-secrets",
            "--poll",
            "100ms",
        ])
        .args(["--node-timeout", "20s", "--bootstrap-timeout", "20s"])
        .args([
            "--health-timeout",
            "30s",
            "--call-timeout",
            "5s",
            "--state-dir",
        ])
        .arg(dir.path().join("state"))
        .env_remove("IMGBUILD_CONFIG")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["healthy"], true, "{v}");
    let stats = nodes.stats();
    assert_eq!(
        (&stats["totals"]["applies"], &stats["totals"]["bootstraps"]),
        (&json!(5), &json!(1)),
        "{stats}"
    );
    assert_eq!(stats["totals"]["configured"], 5);

    // A stopped VM's node is gone.
    let cp01 = format!("{}.11:50000", net());
    assert_eq!(power(&pve, 300, "stop"), "OK");
    assert_eq!(nodes.stats()["nodes"]["cp-01"]["phase"], "down");
    assert_eq!(vm_state(&pve, 300)["bootedIp"], serde_json::Value::Null);
    wait_for("cp-01's port to close", || server_cert(&cp01).is_none());

    // Its disk loses META's ADV: the VM starts, no node comes up, and why
    // is on record.
    let (_, cfg) = pve.curl("/nodes/pve/qemu/300/config", &[]);
    let scsi0 = cfg["data"]["scsi0"].as_str().unwrap();
    let volume = scsi0.split(',').next().unwrap();
    let disk = pve.dir.path().join(format!(
        "state/storage/local-lvm/{}.raw",
        volume.strip_prefix("local-lvm:").unwrap()
    ));
    let meta = partition_offset(&disk, "META");
    {
        use std::io::{Seek, SeekFrom, Write};
        let mut f = std::fs::OpenOptions::new().write(true).open(&disk).unwrap();
        f.seek(SeekFrom::Start(meta)).unwrap();
        f.write_all(&vec![0u8; 512 * 1024]).unwrap();
    }
    assert_eq!(power(&pve, 300, "start"), "OK");
    let vm = vm_state(&pve, 300);
    assert_eq!(vm["running"], true, "{vm}");
    assert_eq!(vm["bootedIp"], serde_json::Value::Null);
    let why = vm["bootError"].as_str().unwrap();
    assert!(why.contains("META holds no valid ADV"), "{why}");
    assert_eq!(stat(&pve, "bootFailures"), 1);
    assert_eq!(nodes.stats()["nodes"]["cp-01"]["phase"], "down");
    assert!(server_cert(&cp01).is_none());
}

#[test]
fn disks_without_a_loopback_key_10_run_but_boot_no_node() {
    let nodes = machine_nodes(&[]);
    let pve = Pve::start(&["--nodes-control", &nodes.control]);
    let fx = pve.dir.path().join("fx");
    let ok = Command::new(root().join("fixtures/make-images.sh"))
        .arg(&fx)
        .output()
        .unwrap();
    assert!(ok.status.success(), "{}", text(&ok.stderr));
    // A qcow2 disk is read through qemu-img: attached as it is, not imported.
    let ok = Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "qcow2"])
        .arg(fx.join("dual-boot.raw"))
        .arg(fx.join("dual-boot.qcow2"))
        .status()
        .unwrap();
    assert!(ok.success());
    let cases = [
        ("dual-boot.raw", "META has no key 10"),
        ("grub.raw", "META holds no valid ADV"),
        ("no-meta.raw", "no partition named META"),
        ("dual-boot.qcow2", "META has no key 10"),
    ];
    for (i, (fixture, reason)) in cases.iter().enumerate() {
        let image = fx.join(fixture);
        let sum = hex::encode(Sha256::digest(std::fs::read(&image).unwrap()));
        let (code, v) = pve.upload(&image, &sum);
        assert_eq!(code, 200, "{v}");
        assert_eq!(pve.wait(&v["data"])["exitstatus"], "OK");
        let vmid = 400 + i as u32;
        let (code, v) = pve.curl(
            "/nodes/pve/qemu",
            &[
                "-X",
                "POST",
                "-d",
                &format!("vmid={vmid}"),
                "-d",
                &if fixture.ends_with(".qcow2") {
                    format!("scsi0=local:import/{fixture}")
                } else {
                    format!("scsi0=local-lvm:0,import-from=local:import/{fixture}")
                },
                "-d",
                "boot=order=scsi0",
                "-d",
                "start=1",
            ],
        );
        assert_eq!(code, 200, "{v}");
        let upid = v["data"].clone();
        assert_eq!(pve.wait(&upid)["exitstatus"], "OK");
        let vm = vm_state(&pve, vmid);
        assert_eq!(vm["running"], true, "{vm}");
        let why = vm["bootError"].as_str().unwrap_or_default();
        assert!(why.contains(reason), "{fixture}: {why}");
        let (_, log) = pve.curl(
            &format!("/nodes/pve/tasks/{}/log", upid.as_str().unwrap()),
            &["-G"],
        );
        assert!(
            log["data"]
                .as_array()
                .unwrap()
                .iter()
                .any(|l| l["t"].as_str().unwrap().contains(reason)),
            "{fixture}: {log}"
        );
        assert_eq!(stat(&pve, "bootFailures"), i as u64 + 1);
    }
    let stats = nodes.stats();
    assert_eq!(stats["totals"]["nodes"], 0, "{stats}");
}

/// A machine config for `node` of the loopback example, rendered by the
/// real binary.
fn machine_config(dir: &Path, node: &str) -> String {
    // The cluster's secrets, made once (`config` never makes them).
    if !dir.join("state/secrets.yaml").exists() {
        let o = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
            .arg("--config")
            .arg(root().join("examples/loopback/cluster.yaml"))
            .args(["secrets", "gen", "--state-dir"])
            .arg(dir.join("state"))
            .env_remove("IMGBUILD_CONFIG")
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", text(&o.stderr));
    }
    let o = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
        .arg("--config")
        .arg(root().join("examples/loopback/cluster.yaml"))
        // Secrets included: the simulators boot from it.
        .args(["--show-secrets", "--yes", "config", node, "--state-dir"])
        .arg(dir.join("state"))
        .env_remove("IMGBUILD_CONFIG")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    text(&o.stdout)
}

/// A snapshot made from a stopped build server; its image id.
fn snapshot(hc: &Hc) -> u64 {
    let v = hc.ok(
        "POST",
        "/servers",
        Some(
            json!({"name": "imgbuild-build", "server_type": "cpx22", "image": "debian-13",
            "location": "fsn1", "start_after_create": false}),
        ),
    );
    hc.wait_ok(&v["action"]);
    let id = v["server"]["id"].as_u64().unwrap();
    let img = hc.ok(
        "POST",
        &format!("/servers/{id}/actions/create_image"),
        Some(json!({"type": "snapshot", "description": "talos", "labels": {"os": "talos"}})),
    );
    hc.wait_ok(&img["action"]);
    hc.ok("DELETE", &format!("/servers/{id}"), None);
    img["image"]["id"].as_u64().unwrap()
}

/// Creates a server from `image` (integer id, as the official clients send
/// it) and waits until its actions end; the server.
fn server_from(hc: &Hc, name: &str, image: u64, extra: Value) -> Value {
    let mut body = json!({"name": name, "server_type": "cpx22", "image": image,
        "location": "fsn1", "labels": {"cluster": "loopback"}});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    let v = hc.ok("POST", "/servers", Some(body));
    hc.wait_ok(&v["action"]);
    for a in v["next_actions"].as_array().unwrap() {
        hc.wait_ok(a);
    }
    v["server"].clone()
}

fn ip_of(server: &Value) -> String {
    server["public_net"]["ipv4"]["ip"]
        .as_str()
        .unwrap()
        .to_owned()
}

#[test]
fn servers_from_a_snapshot_boot_talos_configured_from_their_user_data() {
    let nodes = machine_nodes(&[]);
    let hc = Hc::start(&["--nodes-control", &nodes.control]);
    let image = snapshot(&hc);
    let dir = tempfile::tempdir().unwrap();
    let config = machine_config(dir.path(), "cp-01");
    assert!(config.len() <= 32 * 1024);
    assert_eq!(stats_nodes(&nodes), 0, "a build server boots no Talos");

    // Valid user_data: configured at boot, no apply, on the public address.
    let cp = server_from(&hc, "cp-01", image, json!({"user_data": config}));
    let ip = ip_of(&cp);
    let stats = wait_node(&nodes, "cp-01", |n| n["phase"] == "configured");
    let n = &stats["nodes"]["cp-01"];
    assert_eq!(n["ip"], ip, "{stats}");
    assert_eq!(n["booted_by"], "cp-01");
    assert_eq!(n["config_error"], Value::Null);
    assert_eq!(n["applies"], 0);
    let user_data = Command::new("curl")
        .args([
            "-s",
            &hc.url
                .replace("/v1", &format!("/_sim/servers/{}/user_data", cp["id"])),
        ])
        .output()
        .unwrap();
    assert_eq!(
        serde_json::from_slice::<Value>(&user_data.stdout).unwrap(),
        json!(config)
    );

    // Invalid user_data: the node stays in maintenance and says why.
    let bad = config.replacen("machine:\n", "machine:\n  typo: 1\n", 1);
    assert_ne!(bad, config);
    let w = server_from(&hc, "worker-01", image, json!({"user_data": bad}));
    let stats = wait_node(&nodes, "worker-01", |n| n["config_error"].is_string());
    let n = &stats["nodes"]["worker-01"];
    assert_eq!(n["phase"], "maintenance", "{stats}");
    assert_eq!(n["ip"], ip_of(&w));
    let why = n["config_error"].as_str().unwrap();
    assert!(why.contains("typo"), "{why}");

    // Over 32 KiB: refused as the API does; nothing is created.
    let huge = format!("{config}#{}\n", "x".repeat(32 * 1024));
    let (code, _, v) = hc.call(
        "POST",
        "/servers",
        Some(
            json!({"name": "cp-02", "server_type": "cpx22", "image": image,
            "location": "fsn1", "user_data": huge}),
        ),
    );
    assert_eq!(code, 422, "{v}");
    assert_eq!(v["error"]["code"], "invalid_input");
    assert_eq!(v["error"]["details"]["fields"][0]["name"], "user_data");

    // A rescue boot of a snapshot server is not Talos; a normal one is.
    let r = server_from(&hc, "cp-03", image, json!({"start_after_create": false}));
    let id = r["id"].as_u64().unwrap();
    let a = hc.ok(
        "POST",
        &format!("/servers/{id}/actions/enable_rescue"),
        Some(json!({"type": "linux64"})),
    );
    hc.wait_ok(&a["action"]);
    let on = hc.ok("POST", &format!("/servers/{id}/actions/poweron"), None);
    hc.wait_ok(&on["action"]);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(stats_nodes(&nodes), 2, "a rescue boot booted Talos");
    let off = hc.ok("POST", &format!("/servers/{id}/actions/poweroff"), None);
    hc.wait_ok(&off["action"]);
    let on = hc.ok("POST", &format!("/servers/{id}/actions/poweron"), None);
    hc.wait_ok(&on["action"]);
    let stats = wait_node(&nodes, "cp-03", |n| n["phase"] == "maintenance");
    assert_eq!(stats["nodes"]["cp-03"]["ip"], ip_of(&r));
    assert_eq!(hc.stats()["serversFromSnapshots"], 3);

    // Deleting a server halts its node.
    hc.ok("DELETE", &format!("/servers/{}", cp["id"]), None);
    wait_node(&nodes, "cp-01", |n| n["phase"] == "down");
}

fn stats_nodes(nodes: &Nodes) -> u64 {
    nodes.stats()["totals"]["nodes"].as_u64().unwrap()
}

/// Waits until node `name` is in the node simulator's stats and `ok` holds
/// for it; the stats then.
fn wait_node(nodes: &Nodes, name: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let mut last = Value::Null;
    wait_for(&format!("node {name}"), || {
        last = nodes.stats();
        ok(&last["nodes"][name])
    });
    last
}
