//! End to end: `imgbuild publish` against the factory and Proxmox VE
//! simulators on loopback: build → upload → VMs, idempotent reruns, and
//! every way the Proxmox side goes wrong.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;
use common::sims::{Pve, Sim};
use common::{json, root, text};

/// The loopback example with a Proxmox target (and `format`).
fn inventory(dir: &Path, format: &str, vm: bool) -> PathBuf {
    let base = std::fs::read_to_string(root().join("examples/loopback/cluster.yaml")).unwrap();
    let mut inv = base.replace("format: raw", &format!("format: {format}"));
    inv.push_str("\npublish:\n  proxmox:\n    node: pve\n    storage: local\n");
    if vm {
        inv.push_str("    vm: {storage: local-lvm, firstId: 300, diskSize: 10, memory: 2048}\n");
    }
    let path = dir.join("cluster.yaml");
    std::fs::write(&path, inv).unwrap();
    path
}

struct Run {
    dir: tempfile::TempDir,
    config: PathBuf,
}

impl Run {
    fn new(format: &str, vm: bool) -> Run {
        let dir = tempfile::tempdir().unwrap();
        let config = inventory(dir.path(), format, vm);
        Run { dir, config }
    }

    fn out(&self) -> PathBuf {
        self.dir.path().join("out")
    }

    /// `imgbuild publish` with the simulator's endpoint, token and pin in
    /// the environment (`env` overrides them).
    fn publish(&self, sim: &Sim, pve: &Pve, args: &[&str], env: &[(&str, &str)]) -> Output {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_imgbuild"));
        cmd.arg("--config")
            .arg(&self.config)
            .arg("publish")
            .args(args)
            .args([
                "--factory",
                &sim.url,
                "--retry-delay-ms",
                "10",
                "--poll-ms",
                "50",
                "--quiet",
            ])
            .arg("--out-dir")
            .arg(self.out())
            .arg("--cache-dir")
            .arg(self.dir.path().join("cache"))
            .env_remove("IMGBUILD_CONFIG")
            .env("PROXMOX_VE_ENDPOINT", &pve.url)
            .env("PROXMOX_VE_API_TOKEN", &pve.token)
            .env("PROXMOX_VE_FINGERPRINT", &pve.fingerprint)
            .env_remove("PROXMOX_VE_INSECURE");
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.output().unwrap()
    }

    fn manifest(&self) -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(self.out().join("manifest.json")).unwrap()).unwrap()
    }
}

/// sha256sum's verdict, so the check does not trust imgbuild's own hashing.
fn sha256_file(p: &Path) -> String {
    let o = Command::new("sha256sum").arg(p).output().unwrap();
    assert!(o.status.success(), "sha256sum {}", p.display());
    text(&o.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned()
}

fn stat(pve: &Pve, key: &str) -> u64 {
    pve.stats()[key]
        .as_u64()
        .unwrap_or_else(|| panic!("no {key} in stats"))
}

/// build → publish → every volume is the image byte for byte; VMs created
/// as Talos needs them and started; a second run changes nothing.
fn publishes_and_reruns_change_nothing(format: &str) {
    let sim = Sim::start(&[]);
    let pve = Pve::start(&[]);
    let run = Run::new(format, true);
    let o = run.publish(&sim, &pve, &["--output", "json"], &[]);
    assert!(
        o.status.success(),
        "{}\n{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    let v = json(&o);
    let nodes = v["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 5, "{v}");
    let manifest = run.manifest();
    for (i, n) in nodes.iter().enumerate() {
        let name = n["node"].as_str().unwrap();
        let entry = &manifest["images"][name];
        let local = run.out().join(entry["path"].as_str().unwrap());
        let volid = n["volid"].as_str().unwrap();
        let file = volid.strip_prefix("local:import/").unwrap();
        assert!(file.ends_with(&format!(".{format}")), "{volid}");
        assert!(
            file.starts_with(&format!("loopback-{name}-v1.11.2-")),
            "{volid}"
        );
        let stored = pve.stored(file);
        assert_eq!(sha256_file(&stored), sha256_file(&local), "{name}");
        assert_eq!(n["sha256"], entry["sha256"]);
        assert_eq!(sha256_file(&stored), entry["sha256"].as_str().unwrap());
        assert_eq!(n["uploaded"], true);
        assert_eq!(n["vm"], "created");
        assert_eq!(n["started"], true);
        let vmid = 300 + i as u64;
        assert_eq!(n["vmid"], vmid);
        let (code, cfg) = pve.curl(&format!("/nodes/pve/qemu/{vmid}/config"), &[]);
        assert_eq!(code, 200, "{cfg}");
        let cfg = &cfg["data"];
        for (k, want) in [
            ("machine", "q35"),
            ("bios", "ovmf"),
            ("cpu", "host"),
            ("scsihw", "virtio-scsi-pci"),
            ("boot", "order=scsi0"),
            ("serial0", "socket"),
            ("agent", "enabled=1"),
            ("name", name),
        ] {
            assert_eq!(cfg[k].as_str(), Some(want), "{name} {k}: {cfg}");
        }
        assert_eq!(cfg["onboot"].to_string().trim_matches('"'), "1", "{cfg}");
        assert_eq!(cfg["balloon"].to_string().trim_matches('"'), "0", "{cfg}");
        let scsi0 = cfg["scsi0"].as_str().unwrap();
        assert!(
            scsi0.starts_with(&format!("local-lvm:vm-{vmid}-disk-1")),
            "{scsi0}"
        );
        assert!(scsi0.contains("size=10G"), "{scsi0}");
        assert!(
            cfg["efidisk0"].as_str().unwrap().contains("efitype=4m"),
            "{cfg}"
        );
        assert!(
            cfg["net0"].as_str().unwrap().contains("bridge=vmbr0"),
            "{cfg}"
        );
        let (_, st) = pve.curl(&format!("/nodes/pve/qemu/{vmid}/status/current"), &[]);
        assert_eq!(st["data"]["status"], "running", "{st}");
    }
    assert_eq!(stat(&pve, "uploads"), 5);
    assert_eq!(stat(&pve, "vmCreates"), 5);
    assert_eq!(stat(&pve, "rejected"), 0);

    let before = pve.stats();
    let again = run.publish(&sim, &pve, &["--output", "json"], &[]);
    assert!(again.status.success(), "{}", text(&again.stderr));
    let v = json(&again);
    for n in v["nodes"].as_array().unwrap() {
        assert_eq!(n["uploaded"], false, "{n}");
        assert_eq!(n["vm"], "unchanged", "{n}");
        assert_eq!(n["started"], false, "{n}");
    }
    let after = pve.stats();
    for key in [
        "uploads",
        "uploadAttempts",
        "vmCreates",
        "vmConfigChanges",
        "resizes",
        "starts",
        "stops",
    ] {
        assert_eq!(after[key], before[key], "{key} changed on a rerun");
    }
}

#[test]
fn raw_images_publish_and_reruns_change_nothing() {
    publishes_and_reruns_change_nothing("raw");
}

#[test]
fn qcow2_images_publish_and_reruns_change_nothing() {
    publishes_and_reruns_change_nothing("qcow2");
}

#[test]
fn a_refused_token_is_named_and_never_shown() {
    let sim = Sim::start(&[]);
    let pve = Pve::start(&[]);
    let run = Run::new("raw", false);
    let bad = "root@pam!imgbuild=0000-not-the-secret";
    for output in ["text", "json"] {
        let o = run.publish(
            &sim,
            &pve,
            &["--output", output, "cp-01"],
            &[("PROXMOX_VE_API_TOKEN", bad)],
        );
        assert_eq!(o.status.code(), Some(1));
        let all = format!("{}{}", text(&o.stdout), text(&o.stderr));
        assert!(
            all.contains("refused the token in PROXMOX_VE_API_TOKEN (HTTP 401)"),
            "{all}"
        );
        assert!(
            !all.contains("0000-not-the-secret") && !all.contains(&pve.token),
            "{all}"
        );
    }
    assert_eq!(stat(&pve, "uploadAttempts"), 0);
}

#[test]
fn a_wrong_fingerprint_sends_no_byte_of_the_image() {
    let sim = Sim::start(&[]);
    let pve = Pve::start(&[]);
    let run = Run::new("raw", false);
    let wrong = "AB:".repeat(31) + "CD";
    let o = run.publish(
        &sim,
        &pve,
        &["cp-01"],
        &[("PROXMOX_VE_FINGERPRINT", &wrong)],
    );
    assert_eq!(o.status.code(), Some(1));
    let err = text(&o.stderr);
    assert!(
        err.contains(&wrong) && err.contains(&pve.fingerprint),
        "{err}"
    );
    let stats = pve.stats();
    assert_eq!(stats["requests"], 0, "{stats}");
    assert_eq!(stats["uploadBytes"], 0, "{stats}");
}

#[test]
fn a_storage_without_import_is_explained_before_any_upload() {
    let sim = Sim::start(&[]);
    let pve = Pve::start(&["--no-import-storage"]);
    let run = Run::new("raw", false);
    let o = run.publish(&sim, &pve, &[], &[]);
    assert_eq!(o.status.code(), Some(1));
    let err = text(&o.stderr);
    assert!(
        err.contains("not enabled for the `import` content type"),
        "{err}"
    );
    assert!(err.contains("Datacenter → Storage"), "{err}");
    assert_eq!(stat(&pve, "uploadAttempts"), 0);
}

#[test]
fn a_failed_task_is_shown_with_its_log_and_stores_nothing() {
    let sim = Sim::start(&[]);
    let pve = Pve::start(&["--fail-task", "imgcopy"]);
    let run = Run::new("raw", false);
    let o = run.publish(&sim, &pve, &["cp-01"], &[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    assert!(
        err.contains("node cp-01") && err.contains("task UPID:pve:"),
        "{err}"
    );
    let stored: Vec<_> = std::fs::read_dir(pve.dir.path().join("state/storage/local/import"))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(stored.is_empty(), "{stored:?}");
}

#[test]
fn a_dropped_upload_is_retried_then_reported() {
    let sim = Sim::start(&[]);
    // One drop: the second attempt succeeds.
    let pve = Pve::start(&["--drop-upload-after", "1000000", "--drop-uploads", "1"]);
    let run = Run::new("raw", false);
    let o = run.publish(&sim, &pve, &["cp-01", "--output", "json"], &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(json(&o)["nodes"][0]["uploaded"], true);
    assert_eq!(stat(&pve, "uploadAttempts"), 2);
    assert_eq!(stat(&pve, "uploads"), 1);

    // Every attempt dropped: bounded, then a clear error.
    let pve = Pve::start(&["--drop-upload-after", "1000000", "--drop-uploads", "100"]);
    let o = run.publish(&sim, &pve, &["cp-01"], &[]);
    assert_eq!(o.status.code(), Some(1));
    let err = text(&o.stderr);
    assert!(
        err.contains("node cp-01") && err.contains("uploading loopback-cp-01"),
        "{err}"
    );
    assert_eq!(stat(&pve, "uploadAttempts"), 3);
    assert_eq!(stat(&pve, "uploads"), 0);
}

#[test]
fn a_vmid_held_by_another_vm_is_never_touched() {
    let sim = Sim::start(&[]);
    let pve = Pve::start(&[]);
    let (code, v) = pve.curl(
        "/nodes/pve/qemu",
        &["-d", "vmid=300", "-d", "name=database", "-d", "memory=2048"],
    );
    assert_eq!(code, 200, "{v}");
    pve.wait(&v["data"]);
    let run = Run::new("raw", true);
    let o = run.publish(&sim, &pve, &["--output", "json"], &[]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o.stderr));
    let v = json(&o);
    assert_eq!(v["nodes"].as_array().unwrap().len(), 4, "{v}");
    let failed = &v["failed"][0];
    assert_eq!(failed["node"], "cp-01");
    let msg = failed["error"].as_str().unwrap();
    assert!(
        msg.contains("vmid 300") && msg.contains("\"database\""),
        "{msg}"
    );
    let (_, cfg) = pve.curl("/nodes/pve/qemu/300/config", &[]);
    assert_eq!(cfg["data"]["name"], "database");
    assert!(cfg["data"].get("scsi0").is_none(), "{cfg}");
}
