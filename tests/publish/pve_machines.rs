//! Per-node Proxmox machines against the Proxmox VE simulator (a two-host
//! cluster, Proxmox VE 9.1 as the simulator models it) and the factory
//! simulator, Talos v1.11.2 images: each node's cores, memory, disks,
//! bridge, VLAN and host read back from the VM configs; a change planned
//! from → to and applied; a shrink refused; and an existing VM's disk as
//! its image of record (no upload after a version bump, none "outdated").

use std::net::TcpListener;
use std::process::Output;

use crate::common;
use common::inventory::Inventory;
use common::run::{Run, Work};
use common::sims::{Pve, Sim};
use common::{json, text};

/// `imgbuild publish ARGS` against both simulators.
fn publish(work: &Work, sim: &Sim, pve: &Pve, args: &[&str]) -> Output {
    Run::with_config(&work.config, &["publish"])
        .args(args)
        .factory(sim)
        .args(["--poll-ms", "50", "--quiet"])
        .folders(work.dir.path())
        .proxmox(pve)
        .output()
}

fn ok(o: &Output) -> &Output {
    assert!(
        o.status.success(),
        "{}\n{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    o
}

/// The loopback cluster with VMs (2048 MiB, 10 GiB, 2 cores on `pve`,
/// `upload: raw` as the shared test inventory has it);
/// worker-02 carries its own settings `own` (YAML under the node).
fn cluster(own: &str) -> Work {
    let work = Work::new(&Inventory::loopback().proxmox(true));
    work.edit(
        "    address: 127.0.0.22\n",
        &format!("    address: 127.0.0.22\n{own}"),
    );
    work
}

/// VM `vmid` as the simulator holds it: its host, config and pending
/// changes.
fn vm(pve: &Pve, vmid: u32) -> serde_json::Value {
    let o = std::process::Command::new("curl")
        .args(["-sk", &format!("{}_sim/vms/{vmid}", pve.url)])
        .output()
        .unwrap();
    serde_json::from_slice(&o.stdout).unwrap()
}

fn stat(pve: &Pve, key: &str) -> u64 {
    pve.stats()[key].as_u64().unwrap()
}

/// An option of a drive or NIC string (`…,bridge=vmbr1,tag=30`).
fn opt(value: &serde_json::Value, key: &str) -> Option<String> {
    value
        .as_str()?
        .split(',')
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
        .map(str::to_owned)
}

#[test]
fn each_node_gets_its_own_machine_on_its_own_host() {
    let sim = Sim::start(&[]);
    let pve = Pve::start(&["--other-nodes", "pve2"]);
    let work = cluster(
        "    memory: 4096\n    cores: 4\n    diskSize: 12\n    dataDisks: [5]\n    bridge: vmbr1\n    vlan: 30\n    proxmoxNode: pve2\n",
    );
    let v = json(ok(&publish(&work, &sim, &pve, &["--output", "json"])));
    assert_eq!(v["nodes"].as_array().unwrap().len(), 5, "{v}");
    let w2 = vm(&pve, 304);
    assert_eq!(w2["host"], "pve2", "{w2}");
    let c = &w2["config"];
    assert_eq!(c["memory"], "4096", "{c}");
    assert_eq!(c["cores"], "4", "{c}");
    assert_eq!(opt(&c["net0"], "bridge").as_deref(), Some("vmbr1"), "{c}");
    assert_eq!(opt(&c["net0"], "tag").as_deref(), Some("30"), "{c}");
    assert_eq!(opt(&c["scsi0"], "size").as_deref(), Some("12G"), "{c}");
    assert_eq!(opt(&c["scsi1"], "size").as_deref(), Some("5G"), "{c}");
    // Reached through its host only, as Proxmox does.
    let (code, _) = pve.curl("/nodes/pve/qemu/304/config", &[]);
    assert_eq!(code, 500);
    let (code, cfg) = pve.curl("/nodes/pve2/qemu/304/config", &[]);
    assert_eq!(code, 200, "{cfg}");
    // The others keep the cluster's settings, on the cluster's host.
    let cp = vm(&pve, 300);
    assert_eq!(cp["host"], "pve", "{cp}");
    let c = &cp["config"];
    assert_eq!(
        (c["memory"].as_str(), c["cores"].as_str()),
        (Some("2048"), Some("2"))
    );
    assert_eq!(opt(&c["net0"], "bridge").as_deref(), Some("vmbr0"), "{c}");
    assert_eq!(opt(&c["net0"], "tag"), None, "{c}");
    assert!(c.get("scsi1").is_none(), "{c}");
}

#[test]
fn a_memory_change_is_planned_from_to_and_applied_with_one_reboot() {
    let sim = Sim::start(&[]);
    let pve = Pve::start(&[]);
    // The reboot waits for the node's Talos API: here a listener of ours.
    let talos = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = talos.local_addr().unwrap().port();
    let work = cluster(&format!("    talosEndpoint: 127.0.0.1:{port}\n"));
    ok(&publish(&work, &sim, &pve, &["--output", "json"]));
    let uploads = stat(&pve, "uploads");
    work.edit(
        "    talosEndpoint",
        "    memory: 4096\n    cores: 3\n    talosEndpoint",
    );

    let plan = json(ok(&publish(
        &work,
        &sim,
        &pve,
        &["--dry-run", "--output", "json"],
    )));
    let w2 = &plan["nodes"][4];
    assert_eq!(w2["node"], "worker-02", "{plan}");
    assert_eq!(w2["vm"], "changed", "{plan}");
    assert_eq!(w2["upload"], false, "{plan}");
    assert_eq!(
        w2["settings"],
        serde_json::json!([
            {"field": "memory", "from": "2048", "to": "4096", "apply": "reboot"},
            {"field": "cores", "from": "2", "to": "3", "apply": "reboot"},
        ]),
        "{plan}"
    );
    for n in plan["nodes"].as_array().unwrap().iter().take(4) {
        assert_eq!(n["vm"], "unchanged", "{n}");
        assert!(n.get("settings").is_none(), "{n}");
    }
    let text_plan = publish(&work, &sim, &pve, &["--dry-run"]);
    let shown = text(&text_plan.stdout);
    assert!(text_plan.status.success(), "{shown}");
    assert!(
        shown.contains("memory 2048 → 4096 (with a reboot)"),
        "{shown}"
    );
    assert_eq!(vm(&pve, 304)["config"]["memory"], "2048");
    assert_eq!(stat(&pve, "reboots"), 0);

    let v = json(ok(&publish(&work, &sim, &pve, &["--output", "json"])));
    assert_eq!(v["nodes"][4]["vm"], "changed", "{v}");
    let after = vm(&pve, 304);
    assert_eq!(after["config"]["memory"], "4096", "{after}");
    assert_eq!(after["config"]["cores"], "3", "{after}");
    assert_eq!(after["pending"], serde_json::json!({}), "{after}");
    assert_eq!(after["running"], true, "{after}");
    assert_eq!(stat(&pve, "reboots"), 1);
    assert_eq!(
        stat(&pve, "uploads"),
        uploads,
        "a settings change uploads nothing"
    );
    // Converged: the next run has nothing to change.
    let again = json(ok(&publish(
        &work,
        &sim,
        &pve,
        &["--dry-run", "--output", "json"],
    )));
    assert_eq!(again["nodes"][4]["vm"], "unchanged", "{again}");
}

#[test]
fn a_smaller_disk_is_refused_naming_the_node_and_field() {
    let sim = Sim::start(&[]);
    let pve = Pve::start(&[]);
    let work = cluster("    diskSize: 12\n");
    ok(&publish(&work, &sim, &pve, &[]));
    let resizes = stat(&pve, "resizes");
    work.edit("    diskSize: 12\n", "    diskSize: 11\n");
    let o = publish(&work, &sim, &pve, &[]);
    assert!(!o.status.success());
    let err = text(&o.stderr);
    assert!(err.contains("worker-02"), "{err}");
    assert!(err.contains("nodes[4].diskSize"), "{err}");
    assert!(err.contains("disks only grow"), "{err}");
    assert_eq!(stat(&pve, "resizes"), resizes);
    assert_eq!(
        opt(&vm(&pve, 304)["config"]["scsi0"], "size").as_deref(),
        Some("12G")
    );
}

#[test]
fn after_a_version_bump_nothing_is_uploaded_unless_the_disk_is_replaced() {
    let sim = Sim::start_with(&[], 0, &["--versions", "v1.11.2,v1.11.5"]);
    let pve = Pve::start(&[]);
    let work = cluster("");
    ok(&publish(&work, &sim, &pve, &[]));
    assert_eq!(stat(&pve, "uploads"), 5);
    let bytes = stat(&pve, "uploadBytes");
    work.edit("talosVersion: v1.11.2", "talosVersion: v1.11.5");

    let v = json(ok(&publish(&work, &sim, &pve, &["--output", "json"])));
    for n in v["nodes"].as_array().unwrap() {
        assert_eq!(n["uploaded"], false, "{n}");
        assert_eq!(n["vm"], "unchanged", "{n}");
    }
    assert!(!v.to_string().contains("outdated"), "{v}");
    assert_eq!(stat(&pve, "uploads"), 5);
    assert_eq!(stat(&pve, "uploadBytes"), bytes, "bytes were uploaded");
    let shown = text(&publish(&work, &sim, &pve, &[]).stdout);
    assert!(shown.contains("the VM keeps its disk"), "{shown}");

    let v = json(ok(&publish(
        &work,
        &sim,
        &pve,
        &["cp-01", "--replace-disk", "--output", "json"],
    )));
    assert_eq!(v["nodes"][0]["uploaded"], true, "{v}");
    assert_eq!(v["nodes"][0]["vm"], "updated", "{v}");
    assert_eq!(stat(&pve, "uploads"), 6);
    let described = vm(&pve, 300)["config"]["description"].to_string();
    assert!(described.contains("v1.11.5"), "{described}");
}

/// Raw images cross the wire as qcow2 by default: far fewer bytes than
/// `upload: raw` for the same cluster, and the imported disks are the same
/// (the simulator checks the qcow2 with `qemu-img info` on upload and
/// converts it at import, as pve-storage does).
#[test]
fn qcow2_uploads_send_far_fewer_bytes_than_raw() {
    let sim = Sim::start(&[]);
    let raw_pve = Pve::start(&[]);
    let raw = cluster("");
    let r = json(ok(&publish(
        &raw,
        &sim,
        &raw_pve,
        &["cp-01", "--output", "json"],
    )));
    let q_pve = Pve::start(&[]);
    let q = cluster("");
    q.edit("    upload: raw\n", "");
    let v = json(ok(&publish(
        &q,
        &sim,
        &q_pve,
        &["cp-01", "--output", "json"],
    )));
    let (raw_bytes, q_bytes) = (stat(&raw_pve, "uploadBytes"), stat(&q_pve, "uploadBytes"));
    assert!(
        q_bytes * 10 < raw_bytes,
        "qcow2 sent {q_bytes} bytes, raw {raw_bytes}"
    );
    for (a, b) in r["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .zip(v["nodes"].as_array().unwrap())
    {
        assert!(a["volid"].as_str().unwrap().ends_with(".raw"), "{a}");
        assert!(b["volid"].as_str().unwrap().ends_with(".qcow2"), "{b}");
        assert_eq!(
            a["sha256"], b["sha256"],
            "the volume name carries the raw image's sha256"
        );
    }
    // Each VM disk holds the same bytes either way.
    let disk = |pve: &Pve, vmid: u32| {
        let volume = vm(pve, vmid)["config"]["scsi0"]
            .as_str()
            .unwrap()
            .split(',')
            .next()
            .unwrap()
            .to_owned();
        pve.dir.path().join(format!(
            "state/storage/local-lvm/{}.raw",
            volume.strip_prefix("local-lvm:").unwrap()
        ))
    };
    let same = std::process::Command::new("cmp")
        .arg(disk(&raw_pve, 300))
        .arg(disk(&q_pve, 300))
        .output()
        .unwrap();
    assert!(same.status.success(), "{}", text(&same.stdout));
}

/// A qcow2 upload sends what the image holds and no more: its allocated
/// bytes (to within the rounding to 64 KiB clusters: 5 %) plus the qcow2's
/// tables and the multipart framing; and the volume the server stored is
/// a qcow2 that `qemu-img check` finds clean and `qemu-img compare` finds
/// equal to the raw image.
#[test]
fn a_qcow2_upload_sends_the_allocated_bytes_and_reads_back_as_the_image() {
    // 16 MiB of random data in the base's BOOT partition.
    let sim = Sim::start_with(&[], 16, &[]);
    let pve = Pve::start(&[]);
    let work = cluster("");
    work.edit("    upload: raw\n", "");
    let v = json(ok(&publish(
        &work,
        &sim,
        &pve,
        &["cp-01", "--output", "json"],
    )));
    let image = work.dir.path().join("out/cp-01.raw");
    let meta = std::fs::metadata(&image).unwrap();
    let allocated = std::os::unix::fs::MetadataExt::blocks(&meta) * 512;
    assert!(allocated > 16 << 20, "{allocated} bytes allocated");
    assert!(meta.len() < 512 << 20, "one L2 table: {} bytes", meta.len());
    // Header, refcount table, one refcount block, L1 and one L2 table.
    let tables = 5 * 65536;
    let framing = 1024;
    let sent = stat(&pve, "uploadBytes");
    assert!(
        sent <= allocated * 105 / 100 + tables + framing,
        "sent {sent} bytes for {allocated} allocated"
    );
    let volid = v["nodes"][0]["volid"].as_str().unwrap();
    let file = volid.rsplit('/').next().unwrap();
    assert!(file.ends_with(".qcow2"), "{volid}");
    let stored = pve.stored(file);
    assert!(
        std::fs::metadata(&stored).unwrap().len() + framing >= sent,
        "the file is what was sent"
    );
    let qemu_img = |args: &[&str]| {
        let o = std::process::Command::new("qemu-img")
            .args(args)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "qemu-img {args:?}: {}{}",
            text(&o.stdout),
            text(&o.stderr)
        );
    };
    qemu_img(&["check", "-f", "qcow2", stored.to_str().unwrap()]);
    qemu_img(&[
        "compare",
        "-f",
        "raw",
        "-F",
        "qcow2",
        image.to_str().unwrap(),
        stored.to_str().unwrap(),
    ]);
}

/// A VM a user switched to `hotplug: 1` and `numa: 1` in Proxmox:
/// qemu-server reads `1` as `network,disk,usb` (`parse_hotplug_features`),
/// so memory is no hotplug feature and a memory change stays pending until
/// the VM restarts. It is planned as a reboot and converges in one run;
/// with `memory` listed too it applies at once, without one.
#[test]
fn with_hotplug_1_and_numa_a_memory_change_is_a_reboot_and_converges_in_one_run() {
    for (hotplug, apply, reboots) in [("1", "reboot", 1), ("network,disk,memory", "now", 0)] {
        let sim = Sim::start(&[]);
        let pve = Pve::start(&[]);
        let talos = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = talos.local_addr().unwrap().port();
        let work = cluster(&format!("    talosEndpoint: 127.0.0.1:{port}\n"));
        ok(&publish(&work, &sim, &pve, &["--output", "json"]));
        let (code, v) = pve.curl(
            "/nodes/pve/qemu/304/config",
            &[
                "--data-urlencode",
                &format!("hotplug={hotplug}"),
                "-d",
                "numa=1",
            ],
        );
        assert_eq!(code, 200, "{v}");
        pve.wait(&v["data"]);
        // Neither applies to a running VM (qemu-server leaves both pending):
        // the user restarts it, as Proxmox's GUI asks.
        for step in ["stop", "start"] {
            let (_, v) = pve.curl(
                &format!("/nodes/pve/qemu/304/status/{step}"),
                &["-X", "POST"],
            );
            assert_eq!(pve.wait(&v["data"])["exitstatus"], "OK", "{step}");
        }
        assert_eq!(vm(&pve, 304)["config"]["numa"], "1");
        let reboots_before = stat(&pve, "reboots");
        work.edit("    talosEndpoint", "    memory: 4096\n    talosEndpoint");

        let plan = json(ok(&publish(
            &work,
            &sim,
            &pve,
            &["--dry-run", "--output", "json"],
        )));
        assert_eq!(
            plan["nodes"][4]["settings"],
            serde_json::json!([{"field": "memory", "from": "2048", "to": "4096", "apply": apply}]),
            "hotplug {hotplug}: {plan}"
        );

        ok(&publish(&work, &sim, &pve, &["--output", "json"]));
        let after = vm(&pve, 304);
        assert_eq!(
            after["config"]["memory"], "4096",
            "hotplug {hotplug}: {after}"
        );
        assert_eq!(
            after["pending"],
            serde_json::json!({}),
            "hotplug {hotplug}: {after}"
        );
        assert_eq!(after["running"], true, "{after}");
        assert_eq!(
            stat(&pve, "reboots") - reboots_before,
            reboots,
            "hotplug {hotplug}"
        );
        let again = json(ok(&publish(
            &work,
            &sim,
            &pve,
            &["--dry-run", "--output", "json"],
        )));
        assert_eq!(
            again["nodes"][4]["vm"], "unchanged",
            "hotplug {hotplug}: {again}"
        );
    }
}
