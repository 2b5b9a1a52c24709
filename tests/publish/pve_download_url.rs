//! `publish.proxmox.upload: download-url` against the Proxmox VE simulator
//! (Proxmox VE 9.1 as it models it: pve-storage `download_url` takes
//! `import` content for qcow2/raw images since libpve-storage-perl 8.3.6)
//! and the factory simulator, Talos v1.11.2 qcow2 images from the factory
//! route: Proxmox fetches each image itself, so the runner sends no image
//! bytes; a factory serving other bytes fails the node's task and leaves
//! no volume; a patched image cannot be fetched (exit 2).

use std::process::Output;

use crate::common;
use common::inventory::Inventory;
use common::run::{Run, Work};
use common::sims::{Nodes, Pve, Sim};
use common::{json, text};

/// This file's loopback /24 (tests/common/net.rs).
fn net() -> String {
    common::net::block(module_path!())
}

/// Five metal nodes on `net`, qcow2 images, VMs, and Proxmox fetching
/// the images from the factory.
fn cluster(net: &str) -> Work {
    let inv = Inventory::five_nodes("dl", net)
        .metal("qcow2")
        .proxmox(true)
        .replace("    upload: raw\n", "    upload: download-url\n");
    Work::new(&inv)
}

fn publish(work: &Work, sim: &Sim, pve: &Pve, args: &[&str]) -> Output {
    Run::with_config(&work.config, &["publish"])
        .args(args)
        .factory(sim)
        .args(["--poll-ms", "50", "--quiet"])
        .folders(work.dir.path())
        .proxmox(pve)
        .output()
}

fn sha256(path: &std::path::Path) -> String {
    let o = std::process::Command::new("sha256sum")
        .arg(path)
        .output()
        .unwrap();
    text(&o.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned()
}

fn vm(pve: &Pve, vmid: u32) -> serde_json::Value {
    let o = std::process::Command::new("curl")
        .args(["-sk", &format!("{}_sim/vms/{vmid}", pve.url)])
        .output()
        .unwrap();
    serde_json::from_slice(&o.stdout).unwrap()
}

/// Every file under `dir` whose name ends with `suffix`.
fn files(dir: &std::path::Path, suffix: &str) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(files(&p, suffix));
        } else if p.to_string_lossy().ends_with(suffix) {
            out.push(p);
        }
    }
    out
}

#[test]
fn proxmox_fetches_each_image_and_the_runner_sends_none() {
    let net = net();
    let sim = Sim::start(&[]);
    let nodes = Nodes::start(&[]);
    let pve = Pve::start(&["--nodes-control", &nodes.control]);
    let work = cluster(&net);
    let o = publish(
        &work,
        &sim,
        &pve,
        &["cp-01", "--route", "factory", "--output", "json"],
    );
    assert!(
        o.status.success(),
        "{}\n{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    let stats = pve.idle_stats();
    assert_eq!(stats["uploadBytes"], 0, "{stats}");
    assert_eq!(stats["uploadAttempts"], 0, "{stats}");
    assert!(stats["downloadBytes"].as_u64().unwrap() > 0, "{stats}");
    let v = json(&o);
    let node = &v["nodes"][0];
    let volid = node["volid"].as_str().unwrap();
    let file = volid.strip_prefix("local:import/").unwrap();
    assert!(file.ends_with(".qcow2"), "{volid}");
    // Proxmox holds the very bytes imgbuild verified, and the VM boots them.
    let image = &work.manifest()["images"]["cp-01"];
    assert_eq!(image["route"], "factory");
    let local = work.out().join(image["path"].as_str().unwrap());
    assert_eq!(sha256(&pve.stored(file)), sha256(&local));
    assert_eq!(sha256(&local), image["sha256"].as_str().unwrap());
    assert_eq!(
        stats["downloadBytes"].as_u64().unwrap(),
        std::fs::metadata(&local).unwrap().len()
    );
    let vmid = node["vmid"].as_u64().unwrap() as u32;
    let booted = vm(&pve, vmid);
    assert_eq!(booted["running"], true, "{booted}");
    assert_eq!(booted["bootedIp"], format!("{net}.11"), "{booted}");
}

#[test]
fn other_bytes_from_the_factory_fail_the_task_and_leave_no_volume() {
    let sim = Sim::start(&[]);
    let pve = Pve::start(&[]);
    let work = cluster(&net());
    let built = work
        .imgbuild(&sim, &["build", "cp-01", "--route", "factory", "--quiet"])
        .output();
    assert!(built.status.success(), "{}", text(&built.stderr));
    // The factory now serves altered bytes for the image imgbuild verified.
    let served = files(&sim.state_dir(), "metal-amd64.qcow2");
    assert!(!served.is_empty());
    for f in served {
        let mut bytes = std::fs::read(&f).unwrap();
        bytes.extend_from_slice(b"ALTERED!");
        std::fs::write(&f, bytes).unwrap();
    }
    let o = publish(&work, &sim, &pve, &["cp-01", "--route", "factory"]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{}\n{err}", text(&o.stdout));
    assert!(err.contains("cp-01"), "{err}");
    assert!(err.contains("checksum mismatch"), "{err}");
    assert_eq!(pve.idle_stats()["uploadBytes"], 0);
    let import = pve.stored("");
    let left: Vec<_> = std::fs::read_dir(&import)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn a_patched_image_cannot_be_fetched_exit_2() {
    let sim = Sim::start(&[]);
    let pve = Pve::start(&[]);
    let work = cluster(&net());
    let o = publish(&work, &sim, &pve, &["cp-01", "--route", "patch"]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("node cp-01") && err.contains("download-url"),
        "{err}"
    );
    let stats = pve.idle_stats();
    assert_eq!(stats["uploadBytes"], 0, "{stats}");
    assert_eq!(stats["downloadBytes"], 0, "{stats}");
}

#[test]
fn download_url_with_raw_images_is_an_invalid_inventory() {
    let inv = Inventory::five_nodes("dl", &net())
        .proxmox(true)
        .replace("    upload: raw\n", "    upload: download-url\n");
    let work = Work::new(&inv);
    let o = Run::with_config(&work.config, &["validate"]).output();
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("publish.proxmox.upload") && err.contains("image.format qcow2"),
        "{err}"
    );
}
