//! End to end: `imgbuild publish` against the factory and Proxmox VE
//! simulators on loopback: build → upload → VMs, idempotent reruns, and
//! every way the Proxmox side goes wrong.

use std::path::Path;
use std::process::{Command, Output};

use crate::common;
use common::inventory::Inventory;
use common::run::{Run, Work};
use common::sims::{Pve, Sim};
use common::{json, text};

/// A folder with the loopback example as a Proxmox inventory (and
/// `format`), with VMs when `vm`.
fn proxmox(format: &str, vm: bool) -> Work {
    Work::new(
        &Inventory::loopback()
            .replace("format: raw", &format!("format: {format}"))
            .proxmox(vm),
    )
}

/// `imgbuild publish` with the simulator's endpoint, token and pin in
/// the environment (`env` overrides them).
fn publish(work: &Work, sim: &Sim, pve: &Pve, args: &[&str], env: &[(&str, &str)]) -> Output {
    Run::with_config(&work.config, &["publish"])
        .args(args)
        .factory(sim)
        .args(["--poll-ms", "50", "--quiet"])
        .folders(work.dir.path())
        .proxmox(pve)
        .envs(env.iter().copied())
        .output()
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

/// The MAC the tests give cp-01 (lower case, as a user writes it).
const MAC: &str = "bc:24:11:0a:00:11";

/// A drive or NIC string as a map: its first part (`volume` or
/// `model=MAC`) under "", then its options.
fn options(value: &str) -> std::collections::BTreeMap<String, String> {
    let mut parts = value.split(',');
    let mut map = std::collections::BTreeMap::new();
    map.insert(String::new(), parts.next().unwrap_or_default().to_owned());
    for p in parts {
        let (k, v) = p.split_once('=').unwrap_or((p, ""));
        map.insert(k.to_owned(), v.to_owned());
    }
    map
}

/// Every VM setting the README's "Publishing to Proxmox VE" promises, read
/// back from the simulator's config of VM `vmid`: a change to any of them in
/// the publisher (say Microsoft keys enrolled in the EFI disk, which makes
/// OVMF refuse Talos' unsigned boot) fails here.
fn assert_vm_as_the_readme_promises(
    pve: &Pve,
    vmid: u64,
    name: &str,
    volid: &str,
    mac: Option<&str>,
) {
    let (code, cfg) = pve.curl(&format!("/nodes/pve/qemu/{vmid}/config"), &[]);
    assert_eq!(code, 200, "{cfg}");
    let cfg = &cfg["data"];
    let scalar = |k: &str| match &cfg[k] {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Null => panic!("VM {vmid} has no {k}: {cfg}"),
        other => other.to_string(),
    };
    for (k, want) in [
        ("name", name),
        ("machine", "q35"),
        ("bios", "ovmf"),
        ("cpu", "host"),
        ("scsihw", "virtio-scsi-pci"),
        ("boot", "order=scsi0"),
        ("serial0", "socket"),
        ("agent", "enabled=1"),
        ("ostype", "l26"),
        ("onboot", "1"),
        ("balloon", "0"),
        ("cores", "2"),
        ("memory", "2048"),
    ] {
        assert_eq!(scalar(k), want, "VM {vmid} {k}: {cfg}");
    }
    let drive = |k: &str, want: &[(&str, &str)]| {
        let mut got = options(&scalar(k));
        let volume = got.remove("").unwrap();
        let want: std::collections::BTreeMap<String, String> = want
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert_eq!(got, want, "VM {vmid} {k}: {cfg}");
        volume
    };
    // OVMF's 4m vars without pre-enrolled (Microsoft) keys: Secure Boot off.
    let efi = drive(
        "efidisk0",
        &[
            ("efitype", "4m"),
            ("pre-enrolled-keys", "0"),
            ("size", "4M"),
        ],
    );
    let disk = drive("scsi0", &[("discard", "on"), ("ssd", "1"), ("size", "10G")]);
    assert!(efi.starts_with(&format!("local-lvm:vm-{vmid}-")), "{efi}");
    assert!(disk.starts_with(&format!("local-lvm:vm-{vmid}-")), "{disk}");
    assert_ne!(efi, disk);
    // Imported from the node's volume, as its description records.
    let description = scalar("description");
    assert!(
        description
            .lines()
            .any(|l| l == format!("imgbuild-volume: {volid}")),
        "{description}"
    );
    let net = options(&scalar("net0"));
    let nic = net[""].split_once('=').map_or(net[""].as_str(), |(m, _)| m);
    assert_eq!(nic, "virtio", "{net:?}");
    assert_eq!(
        net.get("bridge").map(String::as_str),
        Some("vmbr0"),
        "{net:?}"
    );
    assert_eq!(net.len(), 2, "{net:?}");
    if let Some(mac) = mac {
        assert_eq!(net[""], format!("virtio={}", mac.to_uppercase()), "{net:?}");
    }
    let (_, st) = pve.curl(&format!("/nodes/pve/qemu/{vmid}/status/current"), &[]);
    assert_eq!(st["data"]["status"], "running", "{st}");
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
    let work = proxmox(format, true);
    work.edit(
        "    address: 127.0.0.11\n",
        &format!("    address: 127.0.0.11\n    mac: {MAC}\n"),
    );
    let o = publish(&work, &sim, &pve, &["--output", "json"], &[]);
    assert!(
        o.status.success(),
        "{}\n{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    let v = json(&o);
    let nodes = v["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 5, "{v}");
    let manifest = work.manifest();
    for (i, n) in nodes.iter().enumerate() {
        let name = n["node"].as_str().unwrap();
        let entry = &manifest["images"][name];
        let local = work.out().join(entry["path"].as_str().unwrap());
        let volid = n["volid"].as_str().unwrap();
        let file = volid.strip_prefix("local:import/").unwrap();
        assert!(file.ends_with(&format!(".{format}")), "{volid}");
        assert!(
            file.starts_with(&format!("loopback_{name}-v1.11.2-")),
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
        let mac = (name == "cp-01").then_some(MAC);
        assert_vm_as_the_readme_promises(&pve, vmid, name, volid, mac);
    }
    assert_eq!(stat(&pve, "uploads"), 5);
    assert_eq!(stat(&pve, "vmCreates"), 5);
    assert_eq!(stat(&pve, "rejected"), 0);

    let before = pve.stats();
    let again = publish(&work, &sim, &pve, &["--output", "json"], &[]);
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
    let work = proxmox("raw", false);
    let bad = "root@pam!imgbuild=0000-not-the-secret";
    for output in ["text", "json"] {
        let o = publish(
            &work,
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
    let work = proxmox("raw", false);
    let wrong = "AB:".repeat(31) + "CD";
    let o = publish(
        &work,
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
    let work = proxmox("raw", false);
    let o = publish(&work, &sim, &pve, &[], &[]);
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
    let work = proxmox("raw", false);
    let o = publish(&work, &sim, &pve, &["cp-01"], &[]);
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
    let work = proxmox("raw", false);
    let o = publish(&work, &sim, &pve, &["cp-01", "--output", "json"], &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(json(&o)["nodes"][0]["uploaded"], true);
    assert_eq!(stat(&pve, "uploadAttempts"), 2);
    assert_eq!(stat(&pve, "uploads"), 1);

    // Every attempt dropped: bounded, then a clear error.
    let pve = Pve::start(&["--drop-upload-after", "1000000", "--drop-uploads", "100"]);
    let o = publish(&work, &sim, &pve, &["cp-01"], &[]);
    assert_eq!(o.status.code(), Some(1));
    let err = text(&o.stderr);
    assert!(
        err.contains("node cp-01") && err.contains("uploading loopback_cp-01"),
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
    let work = proxmox("raw", true);
    let o = publish(&work, &sim, &pve, &["--output", "json"], &[]);
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

/// POSTs `args` (url-encoded) to VM `vmid`'s config and waits for the task.
fn configure(pve: &Pve, vmid: u32, args: &[&str]) {
    let form: Vec<&str> = args
        .iter()
        .flat_map(|kv| ["--data-urlencode", *kv])
        .collect();
    let (code, v) = pve.curl(&format!("/nodes/pve/qemu/{vmid}/config"), &form);
    assert_eq!(code, 200, "{v}");
    assert_eq!(pve.wait(&v["data"])["exitstatus"], "OK", "{args:?}");
}

fn vm_config(pve: &Pve, vmid: u32) -> serde_json::Value {
    let (code, cfg) = pve.curl(&format!("/nodes/pve/qemu/{vmid}/config"), &[]);
    assert_eq!(code, 200, "{cfg}");
    cfg["data"].clone()
}

/// `--replace-disk` deletes the old `scsi0` and nothing else: qemu-server
/// frees the volume of every `unusedN` deleted, so a disk the user parked
/// on the VM must survive.
#[test]
fn replace_disk_keeps_a_disk_the_user_parked_on_the_vm() {
    let sim = Sim::start(&[]);
    let pve = Pve::start(&[]);
    let work = proxmox("raw", true);
    let o = publish(&work, &sim, &pve, &["cp-01"], &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let before = vm_config(&pve, 300);
    let old = options(before["scsi0"].as_str().unwrap())[""].clone();
    // The user adds a data disk, then detaches it: Proxmox parks it as unused0.
    configure(&pve, 300, &["scsi1=local-lvm:1"]);
    let parked = options(vm_config(&pve, 300)["scsi1"].as_str().unwrap())[""].clone();
    configure(&pve, 300, &["delete=scsi1"]);
    assert_eq!(vm_config(&pve, 300)["unused0"], parked.as_str());
    // The VM now boots an older image, as its description records.
    let description = before["description"].as_str().unwrap();
    let volume_line = description
        .lines()
        .find(|l| l.starts_with("imgbuild-volume: "))
        .unwrap();
    let older = description.replace(
        volume_line,
        "imgbuild-volume: local:import/loopback-cp-01-v1.11.2-000000000000.raw",
    );
    configure(&pve, 300, &[&format!("description={older}")]);

    let o = publish(
        &work,
        &sim,
        &pve,
        &["cp-01", "--replace-disk", "--output", "json"],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let v = json(&o);
    assert_eq!(v["nodes"][0]["vm"], "updated", "{v}");
    assert_eq!(v["nodes"][0]["started"], true, "{v}");
    let after = vm_config(&pve, 300);
    let lvm = pve.dir.path().join("state/storage/local-lvm");
    let file = |volume: &str| {
        lvm.join(format!(
            "{}.raw",
            volume.strip_prefix("local-lvm:").unwrap()
        ))
    };
    assert_eq!(after["unused0"], parked.as_str(), "{after}");
    assert!(file(&parked).exists(), "the parked disk {parked} was freed");
    assert!(!file(&old).exists(), "the old disk {old} is still there");
    let unused: Vec<&String> = after
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| k.starts_with("unused"))
        .collect();
    assert_eq!(unused, ["unused0"], "{after}");
    let new = options(after["scsi0"].as_str().unwrap())[""].clone();
    assert_ne!(new, old);
    assert!(file(&new).exists());
    let volid = v["nodes"][0]["volid"].as_str().unwrap();
    assert_vm_as_the_readme_promises(&pve, 300, "cp-01", volid, None);
}

/// VMs are matched to nodes by name and imgbuild's description, not by
/// list position: a node inserted mid-list shifts `firstId` + position, yet
/// every node keeps its VM and none gets a second one.
#[test]
fn an_inserted_node_shifts_no_vm_and_makes_no_second_one() {
    let sim = Sim::start(&[]);
    let pve = Pve::start(&[]);
    let work = proxmox("raw", true);
    let o = publish(&work, &sim, &pve, &[], &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(stat(&pve, "vmCreates"), 5);
    work.edit(
        "  - name: worker-01\n",
        "  - name: worker-00\n    role: worker\n    address: 127.0.0.23\n  - name: worker-01\n",
    );
    let o = publish(&work, &sim, &pve, &["--output", "json"], &[]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o.stderr));
    let v = json(&o);
    let node = |name: &str| {
        v["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["node"] == name)
            .unwrap_or_else(|| panic!("no {name}: {v}"))
            .clone()
    };
    for (name, vmid, computed) in [("worker-01", 303, 304), ("worker-02", 304, 305)] {
        let n = node(name);
        assert_eq!(n["vmid"], vmid, "{n}");
        assert_eq!(n["inventoryVmid"], computed, "{n}");
        assert_eq!(n["vm"], "unchanged", "{n}");
    }
    assert!(node("cp-01").get("inventoryVmid").is_none());
    let failed = &v["failed"];
    assert_eq!(failed.as_array().unwrap().len(), 1, "{v}");
    assert_eq!(failed[0]["node"], "worker-00");
    let msg = failed[0]["error"].as_str().unwrap();
    assert!(
        msg.contains("vmid 303") && msg.contains("\"worker-01\""),
        "{msg}"
    );
    assert_eq!(stat(&pve, "vmCreates"), 5);
    let (code, _) = pve.curl("/nodes/pve/qemu/305/config", &[]);
    assert_eq!(code, 500, "a second VM was made");

    // The text result names both IDs (even under --quiet, which keeps only
    // errors and the result).
    let o = publish(&work, &sim, &pve, &["worker-02"], &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let out = text(&o.stdout);
    assert!(out.contains("VM 304 (not 305: pin vmid 304)"), "{out}");

    // Pinned, the new node gets its own VM.
    work.edit(
        "    address: 127.0.0.23\n",
        "    address: 127.0.0.23\n    vmid: 310\n",
    );
    let o = publish(&work, &sim, &pve, &["worker-00", "--output", "json"], &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(json(&o)["nodes"][0]["vmid"], 310);
    assert_eq!(json(&o)["nodes"][0]["vm"], "created");
    assert_eq!(stat(&pve, "vmCreates"), 6);
}

/// A VM named as a node that imgbuild did not make (Terraform, by hand) is
/// never started or changed, and the node gets no second VM beside it.
#[test]
fn a_vm_imgbuild_did_not_make_is_never_started_or_duplicated() {
    let sim = Sim::start(&[]);
    let pve = Pve::start(&[]);
    for (vmid, name) in [("300", "cp-01"), ("500", "cp-02")] {
        let (code, v) = pve.curl(
            "/nodes/pve/qemu",
            &[
                "-d",
                &format!("vmid={vmid}"),
                "-d",
                &format!("name={name}"),
                "-d",
                "memory=2048",
                "--data-urlencode",
                "description=Managed by Terraform",
            ],
        );
        assert_eq!(code, 200, "{v}");
        pve.wait(&v["data"]);
    }
    let before = vm_config(&pve, 300);
    let counts = pve.stats();
    let work = proxmox("raw", true);
    let o = publish(
        &work,
        &sim,
        &pve,
        &["cp-01", "cp-02", "--output", "json"],
        &[],
    );
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    let v = json(&o);
    let failed = v["failed"].as_array().unwrap();
    assert_eq!(failed.len(), 2, "{v}");
    for (f, vmid) in failed.iter().zip(["VM 300", "VM 500"]) {
        let msg = f["error"].as_str().unwrap();
        assert!(
            msg.contains(vmid) && msg.contains("imgbuild did not make it"),
            "{msg}"
        );
    }
    let (_, st) = pve.curl("/nodes/pve/qemu/300/status/current", &[]);
    assert_eq!(st["data"]["status"], "stopped", "{st}");
    let after = vm_config(&pve, 300);
    assert_eq!(after, before);
    let stats = pve.stats();
    for key in ["vmCreates", "vmConfigChanges", "starts", "stops"] {
        assert_eq!(stats[key], counts[key], "{key}: {stats}");
    }
}

/// `validate` suggests pinning the vmids `firstId` + position gives; other
/// commands do not repeat it.
#[test]
fn validate_suggests_pinning_vmids_from_first_id() {
    let work = proxmox("raw", true);
    work.edit(
        "    address: 127.0.0.11\n",
        "    address: 127.0.0.11\n    vmid: 300\n",
    );
    let config = work.config.to_str().unwrap();
    let o = common::imgbuild(&["--config", config, "--output", "json", "validate"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let warnings = json(&o)["warnings"].clone();
    let advice = warnings
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|w| w.as_str())
        .find(|w| w.contains("firstId"))
        .unwrap_or_else(|| panic!("{warnings}"));
    assert!(advice.contains("worker-02 (304)"), "{advice}");
    assert!(!advice.contains("cp-01"), "{advice}");
    let o = common::imgbuild(&["--config", config, "validate"]);
    assert!(
        text(&o.stderr).contains("pin `vmid:` on cp-02 (301)"),
        "{}",
        text(&o.stderr)
    );
    let o = common::imgbuild(&["--config", config, "schematic", "--all"]);
    assert!(!text(&o.stderr).contains("firstId"), "{}", text(&o.stderr));
}

/// A run killed after "VM 300 created" may leave a start task running:
/// the rerun lists the VM stopped, starts it, and qemu-server answers
/// "VM 300 already running" (src/PVE/QemuServer.pm `vm_start`). The VM
/// runs, as asked: no failure.
#[test]
fn a_start_still_in_flight_from_a_killed_run_is_no_failure() {
    let sim = Sim::start(&[]);
    let pve = Pve::start(&["--task-delay-ms", "1500"]);
    let work = Work::new(
        &Inventory::loopback()
            .proxmox(true)
            .replace("memory: 2048}", "memory: 2048, start: true}"),
    );
    let o = publish(&work, &sim, &pve, &["cp-01", "--output", "json"], &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let (_, v) = pve.curl("/nodes/pve/qemu/300/status/stop", &["-X", "POST"]);
    pve.wait(&v["data"]);
    let (code, v) = pve.curl("/nodes/pve/qemu/300/status/start", &["-X", "POST"]);
    assert_eq!(code, 200, "{v}");
    let o = publish(&work, &sim, &pve, &["cp-01", "--output", "json"], &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let v = json(&o);
    assert_eq!(v["nodes"][0]["started"], true, "{v}");
    let (_, st) = pve.curl("/nodes/pve/qemu/300/status/current", &[]);
    assert_eq!(st["data"]["status"], "running", "{st}");
    // Two starts were asked for after the stop: the test's and the rerun's.
    assert!(pve.stats()["starts"].as_u64().unwrap() >= 3);
}

#[test]
fn missing_proxmox_credentials_are_a_usage_error_as_in_up() {
    let work = proxmox("raw", true);
    let o = Run::with_config(&work.config, &["publish"])
        .folders(work.dir.path())
        .env_remove("PROXMOX_VE_ENDPOINT")
        .env_remove("PROXMOX_VE_API_TOKEN")
        .output();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    assert!(
        text(&o.stderr).contains("PROXMOX_VE_ENDPOINT is not set"),
        "{}",
        text(&o.stderr)
    );
    assert!(
        !work.out().exists(),
        "built before the credentials were read"
    );
}
