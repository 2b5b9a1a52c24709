//! The Proxmox VE simulator driven the way a user's tools drive pveproxy:
//! `curl -F` uploads (parts in the order given, with a Content-Length),
//! task polling, and the certificate checked with openssl. The simulator
//! shares no code with imgbuild, so these test it against the upstream
//! facts alone.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use crate::common;
use common::sims::Pve;
use common::{root, text};

/// A Talos-shaped raw image from the fixtures, renamed as imgbuild names
/// uploads; returns its path and sha256.
fn fixture(dir: &Path) -> (PathBuf, String) {
    let fx = dir.join("fx");
    let ok = Command::new(root().join("fixtures/make-images.sh"))
        .arg(&fx)
        .output()
        .unwrap();
    assert!(ok.status.success(), "{}", text(&ok.stderr));
    let image = dir.join("sim-cp-01-v1.11.2-0123456789ab.raw");
    std::fs::rename(fx.join("dual-boot.raw"), &image).unwrap();
    let sum = Sha256::digest(std::fs::read(&image).unwrap());
    (image, hex::encode(sum))
}

#[test]
fn an_upload_with_the_right_checksum_is_stored_byte_for_byte() {
    let pve = Pve::start(&[]);
    let (image, sum) = fixture(pve.dir.path());
    // Upper case: the server compares checksums case-insensitively.
    let (code, v) = pve.upload(&image, &sum.to_uppercase());
    assert_eq!(code, 200, "{v}");
    let task = pve.wait(&v["data"]);
    assert_eq!(task["exitstatus"], "OK", "{task}");
    assert_eq!(task["type"], "imgcopy");
    let name = image.file_name().unwrap().to_str().unwrap();
    assert_eq!(
        std::fs::read(pve.stored(name)).unwrap(),
        std::fs::read(&image).unwrap()
    );
    let (_, list) = pve.curl("/nodes/pve/storage/local/content?content=import", &["-G"]);
    let item = &list["data"][0];
    assert_eq!(item["volid"], format!("local:import/{name}"));
    assert_eq!(item["format"], "raw");
    assert_eq!(item["size"], std::fs::metadata(&image).unwrap().len());
    let stats = pve.stats();
    assert_eq!(
        (stats["uploads"].as_u64(), stats["uploadAttempts"].as_u64()),
        (Some(1), Some(1))
    );
}

#[test]
fn a_wrong_checksum_ends_the_task_with_the_mismatch_and_stores_nothing() {
    let pve = Pve::start(&[]);
    let (image, sum) = fixture(pve.dir.path());
    let wrong = "0".repeat(64);
    let (code, v) = pve.upload(&image, &wrong);
    assert_eq!(code, 200, "{v}");
    let task = pve.wait(&v["data"]);
    assert_eq!(
        task["exitstatus"],
        format!("checksum mismatch: got '{sum}' != expect '{wrong}'")
    );
    assert!(
        !pve.stored(image.file_name().unwrap().to_str().unwrap())
            .exists()
    );
    let upid = v["data"].as_str().unwrap();
    let (_, log) = pve.curl(
        &format!("/nodes/pve/tasks/{upid}/log?start=0&limit=50"),
        &["-G"],
    );
    let last = log["data"].as_array().unwrap().last().unwrap()["t"].clone();
    assert_eq!(
        last,
        format!("TASK ERROR: checksum mismatch: got '{sum}' != expect '{wrong}'")
    );
    assert_eq!(pve.stats()["uploads"], 0);
}

#[test]
fn a_file_part_named_file_and_a_storage_without_import_are_refused() {
    let pve = Pve::start(&["--no-import-storage"]);
    let (image, sum) = fixture(pve.dir.path());
    let (code, v) = pve.upload(&image, &sum);
    assert_eq!(code, 500);
    assert_eq!(
        v["message"],
        "storage 'local' does not support 'import' content\n"
    );
    let (code, _) = pve.curl(
        "/nodes/pve/storage/local/upload",
        &[
            "-F",
            "content=import",
            "-F",
            &format!("file=@{}", image.display()),
        ],
    );
    assert_eq!(code, 500);
    let (code, v) = pve.curl("/nodes/pve/storage?content=import&enabled=1", &["-G"]);
    assert_eq!(
        (code, v["data"].as_array().map(Vec::len)),
        (200, Some(0)),
        "{v}"
    );
}

#[test]
fn a_wrong_token_is_refused_after_the_delay_without_echoing_it() {
    let pve = Pve::start_with("400", &[]);
    let started = Instant::now();
    let o = Command::new("curl")
        .args([
            "-sk",
            "-i",
            "-H",
            "Authorization: PVEAPIToken=root@pam!x=s3cr3t-guess",
        ])
        .arg(pve.api("/version"))
        .output()
        .unwrap();
    assert!(started.elapsed() >= Duration::from_millis(400));
    let out = text(&o.stdout);
    assert!(out.starts_with("HTTP/1.1 401 "), "{out}");
    assert!(!out.contains("s3cr3t"), "{out}");
}

#[test]
fn the_printed_fingerprint_is_the_served_certificate() {
    let pve = Pve::start(&[]);
    let hostport = pve.url.trim_start_matches("https://").trim_end_matches('/');
    let o = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "openssl s_client -connect {hostport} </dev/null 2>/dev/null | openssl x509 -noout -fingerprint -sha256"
        ))
        .output()
        .unwrap();
    let out = text(&o.stdout);
    let served = out.trim().rsplit('=').next().unwrap();
    assert_eq!(served, pve.fingerprint, "{out}");
    assert_eq!(pve.fingerprint.len(), 32 * 3 - 1);
}

#[test]
fn a_cut_upload_gets_no_answer_and_the_next_attempt_succeeds() {
    let pve = Pve::start(&["--drop-upload-after", "100000"]);
    let (image, sum) = fixture(pve.dir.path());
    // curl reports an empty reply; nothing is answered, nothing stored.
    let (code, _) = pve.upload(&image, &sum);
    assert_eq!(code, 0);
    let name = image.file_name().unwrap().to_str().unwrap();
    assert!(!pve.stored(name).exists());
    let (code, v) = pve.upload(&image, &sum);
    assert_eq!(code, 200, "{v}");
    assert_eq!(pve.wait(&v["data"])["exitstatus"], "OK");
    let stats = pve.stats();
    assert_eq!(stats["uploadAttempts"], 2);
    assert_eq!(stats["uploads"], 1);
    let staged = std::fs::read_dir(pve.dir.path().join("state/tmp"))
        .unwrap()
        .count();
    assert_eq!(staged, 0, "staging files left behind");
}

#[test]
fn a_vm_is_created_from_an_import_resized_started_and_its_disk_replaced() {
    let pve = Pve::start(&[]);
    let (image, sum) = fixture(pve.dir.path());
    let (_, v) = pve.upload(&image, &sum);
    assert_eq!(pve.wait(&v["data"])["exitstatus"], "OK");
    let volid = format!(
        "local:import/{}",
        image.file_name().unwrap().to_str().unwrap()
    );
    let scsi0 = format!("scsi0=local-lvm:0,import-from={volid},discard=on,ssd=1");
    let create = [
        "vmid=301",
        "name=cp-01",
        "machine=q35",
        "bios=ovmf",
        "cpu=host",
        "cores=2",
        "memory=4096",
        "balloon=0",
        "onboot=1",
        "scsihw=virtio-scsi-pci",
        &scsi0,
        "efidisk0=local-lvm:1,efitype=4m,pre-enrolled-keys=0",
        "net0=virtio=BC:24:11:00:00:11,bridge=vmbr0",
        "serial0=socket",
        "boot=order=scsi0",
    ];
    let form: Vec<&str> = create
        .iter()
        .flat_map(|kv| ["--data-urlencode", kv])
        .collect();
    let (code, v) = pve.curl("/nodes/pve/qemu", &form);
    assert_eq!(code, 200, "{v}");
    assert_eq!(pve.wait(&v["data"])["exitstatus"], "OK");
    let (_, cfg) = pve.curl("/nodes/pve/qemu/301/config", &[]);
    let size = std::fs::metadata(&image).unwrap().len() >> 20;
    assert_eq!(
        cfg["data"]["scsi0"],
        format!("local-lvm:vm-301-disk-1,discard=on,size={size}M,ssd=1")
    );
    assert_eq!(cfg["data"]["cores"], 2);
    let disk = pve
        .dir
        .path()
        .join("state/storage/local-lvm/vm-301-disk-1.raw");
    assert_eq!(
        std::fs::read(&disk).unwrap(),
        std::fs::read(&image).unwrap()
    );
    // The same vmid again: PVE's refusal.
    let (code, v) = pve.curl("/nodes/pve/qemu", &form);
    assert_eq!(code, 500);
    assert_eq!(
        v["message"],
        "unable to create VM 301 - VM 301 already exists on node 'pve'\n"
    );
    // A bad key inside a property string is named.
    let (code, v) = pve.curl(
        "/nodes/pve/qemu",
        &[
            "-d",
            "vmid=302",
            "--data-urlencode",
            "net0=virtio,colour=red",
        ],
    );
    assert_eq!(code, 400);
    assert_eq!(
        v["errors"]["net0"],
        "invalid format - invalid key in comma-separated list property: colour\n"
    );

    let (_, v) = pve.curl(
        "/nodes/pve/qemu/301/resize",
        &["-X", "PUT", "-d", "disk=scsi0", "-d", "size=1G"],
    );
    assert_eq!(pve.wait(&v["data"])["exitstatus"], "OK");
    assert_eq!(std::fs::metadata(&disk).unwrap().len(), 1 << 30);
    let (_, v) = pve.curl("/nodes/pve/qemu/301/status/start", &["-X", "POST"]);
    assert_eq!(pve.wait(&v["data"])["exitstatus"], "OK");
    let (_, st) = pve.curl("/nodes/pve/qemu/301/status/current", &[]);
    assert_eq!(st["data"]["status"], "running");

    let (_, v) = pve.curl("/nodes/pve/qemu/301/config", &["--data-urlencode", &scsi0]);
    assert_eq!(pve.wait(&v["data"])["exitstatus"], "OK");
    let (_, cfg) = pve.curl("/nodes/pve/qemu/301/config", &[]);
    assert_eq!(cfg["data"]["unused0"], "local-lvm:vm-301-disk-1");
    assert!(
        cfg["data"]["scsi0"]
            .as_str()
            .unwrap()
            .starts_with("local-lvm:vm-301-disk-2,")
    );
    let (_, v) = pve.curl("/nodes/pve/qemu/301/config", &["-d", "delete=unused0"]);
    assert_eq!(pve.wait(&v["data"])["exitstatus"], "OK");
    assert!(!disk.exists());
    let stats = pve.stats();
    assert_eq!(
        [
            &stats["vmCreates"],
            &stats["resizes"],
            &stats["starts"],
            &stats["vmConfigChanges"]
        ],
        [1, 1, 1, 2]
    );
}

/// qemu-server's `try_deallocate_drive`: deleting `unusedN` frees the volume
/// only when the VM owns it and no drive of the VM still uses it.
#[test]
fn deleting_an_unused_entry_frees_only_an_owned_volume_no_drive_uses() {
    let pve = Pve::start(&[]);
    let config = |vmid: u32, args: &[&str]| {
        let form: Vec<&str> = args
            .iter()
            .flat_map(|kv| ["--data-urlencode", *kv])
            .collect();
        let (code, v) = pve.curl(&format!("/nodes/pve/qemu/{vmid}/config"), &form);
        assert_eq!(code, 200, "{v}");
        pve.wait(&v["data"])
    };
    for (vmid, name) in [("401", "name=a"), ("402", "name=b")] {
        let (code, v) = pve.curl(
            "/nodes/pve/qemu",
            &[
                "-d",
                &format!("vmid={vmid}"),
                "-d",
                name,
                "-d",
                "scsi0=local-lvm:1",
            ],
        );
        assert_eq!(code, 200, "{v}");
        assert_eq!(pve.wait(&v["data"])["exitstatus"], "OK");
    }
    let lvm = pve.dir.path().join("state/storage/local-lvm");
    let own = lvm.join("vm-401-disk-0.raw");
    let other = lvm.join("vm-402-disk-0.raw");
    // An unused entry naming the volume scsi0 still uses: refused, kept.
    config(401, &["unused0=local-lvm:vm-401-disk-0"]);
    let t = config(401, &["delete=unused0"]);
    assert_eq!(
        t["exitstatus"],
        "unable to delete 'local-lvm:vm-401-disk-0' - volume is still in use (snapshot?)"
    );
    assert!(own.exists());
    // Another VM's volume only leaves the config.
    config(401, &["unused1=local-lvm:vm-402-disk-0"]);
    assert_eq!(config(401, &["delete=unused1"])["exitstatus"], "OK");
    let (_, cfg) = pve.curl("/nodes/pve/qemu/401/config", &[]);
    assert!(cfg["data"].get("unused1").is_none(), "{cfg}");
    assert!(other.exists());
    // Detaching its own disk parks it as unused; deleting that frees it.
    assert_eq!(config(402, &["delete=scsi0"])["exitstatus"], "OK");
    let (_, cfg) = pve.curl("/nodes/pve/qemu/402/config", &[]);
    assert_eq!(cfg["data"]["unused0"], "local-lvm:vm-402-disk-0", "{cfg}");
    assert_eq!(config(402, &["delete=unused0"])["exitstatus"], "OK");
    assert!(!other.exists());
}

/// qemu-server (PVE 9) `parse_hotplug_features`: `hotplug: 1` means the
/// schema default `network,disk,usb` (no memory, no CPU), `0` none; a
/// running VM's memory changes now only with `memory` listed AND `numa: 1`
/// (`vmconfig_hotplug_pending`, `Memory.pm` `qemu_memory_hotplug`), else it
/// stays pending until the next start.
#[test]
fn hotplug_1_is_network_disk_usb_and_memory_needs_the_memory_feature_and_numa() {
    let pve = Pve::start(&[]);
    // (vmid, hotplug, numa): whether a memory and a NIC change apply now.
    let cases = [
        ("501", "1", "1", false, true),
        ("502", "0", "1", false, false),
        ("503", "network,disk,memory", "1", true, true),
        ("504", "memory", "0", false, false),
        ("505", "disk,usb", "1", false, false),
    ];
    for (vmid, hotplug, numa, memory_now, nic_now) in cases {
        let (code, v) = pve.curl(
            "/nodes/pve/qemu",
            &[
                "-d",
                &format!("vmid={vmid}"),
                "--data-urlencode",
                &format!("hotplug={hotplug}"),
                "-d",
                &format!("numa={numa}"),
                "-d",
                "memory=4096",
                "--data-urlencode",
                "net0=virtio=BC:24:11:00:00:11,bridge=vmbr0",
            ],
        );
        assert_eq!(code, 200, "{v}");
        assert_eq!(pve.wait(&v["data"])["exitstatus"], "OK");
        let (_, v) = pve.curl(
            &format!("/nodes/pve/qemu/{vmid}/status/start"),
            &["-X", "POST"],
        );
        assert_eq!(pve.wait(&v["data"])["exitstatus"], "OK");
        let (code, v) = pve.curl(
            &format!("/nodes/pve/qemu/{vmid}/config"),
            &[
                "-d",
                "memory=8192",
                "--data-urlencode",
                "net0=virtio=BC:24:11:00:00:11,bridge=vmbr1",
            ],
        );
        assert_eq!(code, 200, "{v}");
        pve.wait(&v["data"]);
        // GET …/config shows pending values; …/pending tells them apart.
        let (_, pending) = pve.curl(&format!("/nodes/pve/qemu/{vmid}/pending"), &[]);
        let is_pending = |key: &str| {
            pending["data"]
                .as_array()
                .unwrap()
                .iter()
                .any(|e| e["key"] == key && e.get("pending").is_some())
        };
        assert_eq!(
            (!is_pending("memory"), !is_pending("net0")),
            (memory_now, nic_now),
            "hotplug {hotplug}, numa {numa}: {pending}"
        );
    }
}

/// qemu-server (PVE 9) `vm_reboot` (`PVE/QemuServer.pm`: a reboot request,
/// the stop, qmeventd's start) and `vm_start` → `vmconfig_apply_pending`:
/// with `hotplug: 1` and `numa: 1` a memory change on a running VM waits,
/// and `status/reboot` is what applies it; nothing is pending after.
#[test]
fn a_memory_change_pending_under_hotplug_1_and_numa_is_applied_by_a_reboot() {
    let pve = Pve::start(&[]);
    let (code, v) = pve.curl(
        "/nodes/pve/qemu",
        &[
            "-d",
            "vmid=511",
            "-d",
            "hotplug=1",
            "-d",
            "numa=1",
            "-d",
            "memory=4096",
        ],
    );
    assert_eq!(code, 200, "{v}");
    assert_eq!(pve.wait(&v["data"])["exitstatus"], "OK");
    let post = |path: &str| {
        let (code, v) = pve.curl(&format!("/nodes/pve/qemu/511/{path}"), &["-X", "POST"]);
        assert_eq!(code, 200, "{path}: {v}");
        assert_eq!(pve.wait(&v["data"])["exitstatus"], "OK", "{path}");
    };
    post("status/start");
    let (_, v) = pve.curl("/nodes/pve/qemu/511/config", &["-d", "memory=8192"]);
    pve.wait(&v["data"]);
    let memory = || {
        let (_, pending) = pve.curl("/nodes/pve/qemu/511/pending", &[]);
        let entry = pending["data"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["key"] == "memory")
            .cloned()
            .unwrap();
        (entry["value"].to_string(), entry.get("pending").cloned())
    };
    assert_eq!(
        memory(),
        ("\"4096\"".to_owned(), Some(serde_json::json!("8192"))),
        "pending while it runs"
    );
    post("status/reboot");
    assert_eq!(
        memory(),
        ("\"8192\"".to_owned(), None),
        "applied by the reboot"
    );
    let (_, current) = pve.curl("/nodes/pve/qemu/511/status/current", &[]);
    assert_eq!(current["data"]["status"], "running", "{current}");
}
