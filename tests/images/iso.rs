//! End to end: per-node ISOs (`image.format: iso`) against the factory
//! simulator. Each node's ISO must carry its META on every kernel line of
//! `grub.cfg` (the same values the factory bakes into the node's own
//! schematic's ISO), keep the base ISO's boot records and volume date, and
//! the factory must learn nothing about the nodes on the patch route.
//! Talos v1.12 is the first whose ISO the factory makes GRUB-only on
//! `bootloader: grub`; v1.10 and v1.11 ISOs are dual-boot (a UKI on UEFI)
//! and refused before anything is downloaded.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common;
use common::inventory::{Inventory, Node};
use common::run::Run;
use common::sims::{Nodes, Pve, Sim};
use common::{decode_meta, json, text, with_factory};

/// Two metal nodes with ISOs on the network `net` (`127.x.y`), Talos
/// `version`.
fn two_isos(net: &str, version: &str) -> Inventory {
    let mut inv = Inventory::new("iso")
        .talos(version)
        .endpoint("127.0.0.30")
        .metal("iso");
    for (i, (name, role)) in [("cp-01", "controlplane"), ("worker-01", "worker")]
        .iter()
        .enumerate()
    {
        inv = inv.node(
            Node::new(name, role)
                .address(&format!("{net}.{}", 31 + i))
                .interface(),
        );
    }
    inv
}

fn xorriso(args: &[&str]) -> String {
    let o = Command::new("xorriso").args(args).output().unwrap();
    assert!(o.status.success(), "xorriso {args:?}: {}", text(&o.stderr));
    text(&o.stdout)
}

/// `grub.cfg` of an ISO, as xorriso extracts it.
fn grub_cfg(iso: &Path, scratch: &Path) -> String {
    let to = scratch.join(format!(
        "{}.grub.cfg",
        iso.file_name().unwrap().to_string_lossy()
    ));
    xorriso(&[
        "-osirrox",
        "on",
        "-indev",
        iso.to_str().unwrap(),
        "-extract",
        "/boot/grub/grub.cfg",
        to.to_str().unwrap(),
    ]);
    std::fs::read_to_string(to).unwrap()
}

fn el_torito(iso: &Path) -> String {
    xorriso(&[
        "-indev",
        iso.to_str().unwrap(),
        "-report_el_torito",
        "plain",
    ])
}

/// The creation and modification dates of the primary volume descriptor.
fn volume_dates(iso: &Path) -> Vec<String> {
    xorriso(&["-indev", iso.to_str().unwrap(), "-pvd_info"])
        .lines()
        .filter(|l| l.starts_with("Creation Time") || l.starts_with("Modif. Time"))
        .map(str::to_owned)
        .collect()
}

/// The kernel lines of a `grub.cfg`, each as its words.
fn kernel_lines(cfg: &str) -> Vec<Vec<String>> {
    cfg.lines()
        .map(str::trim)
        .filter(|l| l.starts_with("linux "))
        .map(|l| l.split_whitespace().map(str::to_owned).collect())
        .collect()
}

/// The one META value every kernel line of `cfg` carries.
fn meta_of(cfg: &str) -> String {
    let lines = kernel_lines(cfg);
    assert!(lines.len() >= 2, "{cfg}");
    let values: Vec<String> = lines
        .iter()
        .map(|words| {
            let metas: Vec<&String> = words
                .iter()
                .filter(|w| w.starts_with("talos.environment="))
                .collect();
            assert_eq!(metas.len(), 1, "{cfg}");
            String::from_utf8(decode_meta(metas[0])).unwrap()
        })
        .collect();
    assert!(values.windows(2).all(|w| w[0] == w[1]), "{cfg}");
    values[0].clone()
}

fn curl(url: &str, to: &Path) {
    let o = Command::new("curl")
        .args(["-sf", "-o", to.to_str().unwrap(), url])
        .output()
        .unwrap();
    assert!(o.status.success(), "{url}");
}

/// The factory simulator serving Talos v1.12.1 (GRUB ISOs on request) and
/// v1.11.2 (dual-boot ISOs).
fn factory() -> Sim {
    Sim::start_with(&[], 0, &["--versions", "v1.12.1,v1.11.2"])
}

#[test]
fn each_node_iso_carries_its_meta_on_every_kernel_line_with_the_base_boot_records() {
    let sim = factory();
    let dir = tempfile::tempdir().unwrap();
    let config = two_isos("127.0.0", "v1.12.1")
        .bootloader("grub")
        .write(dir.path());
    let out = dir.path().join("out");
    let o = with_factory(
        &config,
        dir.path(),
        &sim,
        &[
            "build",
            "--out-dir",
            out.to_str().unwrap(),
            "--output",
            "json",
        ],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let report = json(&o);

    // The factory saw base schematics only: GRUB, no META, no address.
    let posted = sim.posted_schematics().to_string();
    assert!(posted.contains("bootloader: grub"), "{posted}");
    assert!(!posted.contains("meta"), "{posted}");
    assert!(!posted.contains("127.0.0.3"), "{posted}");

    // The factory route's ISOs: the node's own schematic, META baked in by
    // the simulator's own encoder.
    let theirs = dir.path().join("factory");
    let o = with_factory(
        &config,
        dir.path(),
        &sim,
        &[
            "build",
            "--route",
            "factory",
            "--out-dir",
            theirs.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));

    let images = report["images"].as_array().unwrap();
    assert_eq!(images.len(), 2, "{report}");
    for (i, node) in ["cp-01", "worker-01"].iter().enumerate() {
        let img = images.iter().find(|i| i["node"] == *node).unwrap();
        let iso = PathBuf::from(img["file"].as_str().unwrap());
        assert_eq!(iso, out.join(format!("{node}.iso")));
        let base = dir.path().join(format!("{node}-base.iso"));
        curl(img["sourceUrl"].as_str().unwrap(), &base);

        let ours = meta_of(&grub_cfg(&iso, dir.path()));
        let key10 = ours
            .strip_prefix("0xa=")
            .unwrap_or_else(|| panic!("{ours}"));
        assert!(key10.contains(&format!("127.0.0.{}/8", 31 + i)), "{key10}");
        assert!(key10.contains(node), "{key10}");
        let factory_iso = theirs.join(format!("{node}.iso"));
        assert_eq!(ours, meta_of(&grub_cfg(&factory_iso, dir.path())), "{node}");

        // Nothing but the argument changed in grub.cfg.
        let base_cfg = grub_cfg(&base, dir.path());
        assert!(
            kernel_lines(&base_cfg)
                .iter()
                .all(|w| !w.iter().any(|a| a.starts_with("talos.environment=")))
        );
        let node_cfg = grub_cfg(&iso, dir.path());
        let stripped: String = node_cfg
            .lines()
            .map(|l| match l.find(" talos.environment=") {
                Some(at) => l[..at].to_owned() + "\n",
                None => format!("{l}\n"),
            })
            .collect();
        assert_eq!(stripped, base_cfg, "{node}");

        // The same boot records and volume date as the base ISO.
        assert!(el_torito(&base).contains("El Torito boot img"));
        assert_eq!(el_torito(&iso), el_torito(&base), "{node}");
        // The hybrid GPT: the same disk and partition GUIDs, types, names
        // and EFI partition. The image's size, and with it the trailing gap
        // partition and the usable LBA range, follow grub.cfg's size.
        let system_area = |iso: &Path| {
            let report = xorriso(&[
                "-indev",
                iso.to_str().unwrap(),
                "-report_system_area",
                "plain",
            ]);
            let mut lines: Vec<String> = report
                .lines()
                .filter(|l| l.starts_with("GPT ") && !l.starts_with("GPT lba range"))
                .map(str::to_owned)
                .collect();
            let last_extent = lines
                .iter()
                .rposition(|l| l.starts_with("GPT start and size"))
                .unwrap();
            lines.remove(last_extent);
            lines.join("\n")
        };
        assert!(
            system_area(&base).contains("GPT partition path"),
            "{}",
            system_area(&base)
        );
        assert_eq!(system_area(&iso), system_area(&base), "{node}");
        assert_eq!(volume_dates(&iso), volume_dates(&base), "{node}");
        assert_eq!(volume_dates(&base).len(), 2);

        // inspect shows every menu entry's command line and decoded META.
        let v = json(&imgbuild(&[
            "inspect",
            iso.to_str().unwrap(),
            "--output",
            "json",
        ]));
        assert_eq!(v["format"], "iso", "{v}");
        let entries = v["entries"].as_array().unwrap();
        assert_eq!(entries.len(), kernel_lines(&node_cfg).len(), "{v}");
        for e in entries {
            assert_eq!(e["meta"][0]["key"], 10, "{v}");
            assert_eq!(e["meta"][0]["value"].as_str().unwrap(), key10, "{v}");
            assert!(
                e["args"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|a| a == "talos.platform=metal")
            );
        }
        let t = text(&imgbuild(&["inspect", iso.to_str().unwrap()]).stdout);
        assert!(t.contains("menu entry \"Reset Talos installation\""), "{t}");
        assert!(t.contains(&format!("127.0.0.{}/8", 31 + i)), "{t}");

        // diff: against the base, key 10 is only in the node's ISO; against
        // the factory's ISO for the node, the decoded META is the same.
        let o = imgbuild(&["diff", iso.to_str().unwrap(), base.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(1));
        let t = text(&o.stdout);
        assert!(
            t.contains("entry 1 \"Talos ISO\": META key 0xa only in the first"),
            "{t}"
        );
        let o = imgbuild(&[
            "diff",
            iso.to_str().unwrap(),
            factory_iso.to_str().unwrap(),
            "--output",
            "json",
        ]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["equivalent"], true, "{v}");
    }

    // verify re-hashes the ISOs like any image.
    let o = imgbuild(&["verify", "--out-dir", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}{}", text(&o.stdout), text(&o.stderr));
    // No temporary names are left behind.
    let mut names: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    // `.manifest.lock` is the manifest's lock file, kept on purpose;
    // `.gitignore` keeps the folder out of a commit.
    assert_eq!(
        names,
        [
            ".gitignore",
            ".manifest.lock",
            "cp-01.iso",
            "manifest.json",
            "worker-01.iso"
        ]
    );

    // verify finds a node ISO whose grub.cfg lost its META, even with a
    // manifest that matches its bytes.
    let base = dir.path().join("cp-01-base.iso");
    let cp = out.join("cp-01.iso");
    std::fs::copy(&base, &cp).unwrap();
    let manifest = out.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
    let (sha, size) = {
        use sha2::Digest;
        let bytes = std::fs::read(&cp).unwrap();
        (hex::encode(sha2::Sha256::digest(&bytes)), bytes.len())
    };
    m["images"]["cp-01"]["sha256"] = sha.into();
    m["images"]["cp-01"]["size"] = size.into();
    std::fs::write(&manifest, serde_json::to_vec(&m).unwrap()).unwrap();
    let o = imgbuild(&["verify", "--out-dir", out.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    let t = format!("{}{}", text(&o.stdout), text(&o.stderr));
    assert!(
        t.contains("menu entry \"Talos ISO\" carries no META"),
        "{t}"
    );
}

fn imgbuild(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_imgbuild"))
        .args(args)
        .env_remove("IMGBUILD_CONFIG")
        .output()
        .unwrap()
}

#[test]
fn the_dual_boot_iso_of_talos_1_10_and_1_11_is_refused_before_any_download() {
    let sim = factory();
    let dir = tempfile::tempdir().unwrap();
    // bootloader: grub changes nothing for a v1.11 ISO: the factory honours
    // it for ISOs only from v1.12.
    for bootloader in [None, Some("grub")] {
        let mut inv = two_isos("127.0.0", "v1.11.2");
        if let Some(b) = bootloader {
            inv = inv.bootloader(b);
        }
        let config = inv.write(dir.path());
        let out = dir.path().join("out");
        let o = with_factory(
            &config,
            dir.path(),
            &sim,
            &["build", "--out-dir", out.to_str().unwrap()],
        );
        assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
        let err = text(&o.stderr);
        for way_out in [
            "v1.12",
            "bootloader: grub",
            "imgbuild pxe",
            "--route factory",
        ] {
            assert!(err.contains(way_out), "{bootloader:?}: {way_out}: {err}");
        }
        // Before: the factory saw no schematic and served no image.
        assert_eq!(sim.image_gets(), 0, "{bootloader:?}");
        assert_eq!(
            sim.posted_schematics(),
            serde_json::json!({}),
            "{bootloader:?}"
        );
        assert!(!out.join("cp-01.iso").exists());
    }

    // v1.12 without GRUB: the default ISO boots a UKI on UEFI.
    let config = two_isos("127.0.0", "v1.12.1").write(dir.path());
    let out = dir.path().join("out");
    let o = with_factory(
        &config,
        dir.path(),
        &sim,
        &["build", "--out-dir", out.to_str().unwrap()],
    );
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    assert!(
        text(&o.stderr).contains("bootloader: grub"),
        "{}",
        text(&o.stderr)
    );
    assert_eq!(sim.image_gets(), 0);

    // The named alternative works: the factory's ISO of the node's own
    // schematic, with its META from the factory.
    let config = two_isos("127.0.0", "v1.11.2").write(dir.path());
    let o = with_factory(
        &config,
        dir.path(),
        &sim,
        &[
            "build",
            "--route",
            "factory",
            "--out-dir",
            out.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let key10 = meta_of(&grub_cfg(&out.join("cp-01.iso"), dir.path()));
    assert!(key10.contains("127.0.0.31/8"), "{key10}");
}

/// This file's loopback /24 (tests/common/net.rs).
fn net() -> String {
    common::net::block(module_path!())
}

#[test]
fn a_proxmox_vm_boots_its_node_iso_and_comes_up_at_the_address_the_iso_carries() {
    let sim = factory();
    let nodes = Nodes::start(&[]);
    let pve = Pve::start(&["--nodes-control", &nodes.control]);
    let dir = tempfile::tempdir().unwrap();
    let config = two_isos(&net(), "v1.12.1")
        .bootloader("grub")
        .append("publish:\n  proxmox:\n    node: pve\n    storage: local\n    vm: {storage: local-lvm, firstId: 300, diskSize: 10, memory: 2048, boot: iso}\n")
        .write(dir.path());
    let out = dir.path().join("out");
    let o = Run::with_config(&config, &["publish", "--poll-ms", "50", "--quiet"])
        .factory(&sim)
        .folders(dir.path())
        .proxmox(&pve)
        .output();
    assert!(
        o.status.success(),
        "{}\n{}",
        text(&o.stdout),
        text(&o.stderr)
    );

    let stats = nodes.stats();
    for (i, node) in ["cp-01", "worker-01"].iter().enumerate() {
        let vmid = 300 + i;
        let n = &stats["nodes"][node];
        assert_eq!(n["ip"], format!("{}.{}", net(), 31 + i), "{node}: {stats}");
        assert_eq!(n["booted_by"], format!("vm-{vmid}"), "{node}");
        assert_eq!(n["phase"], "maintenance", "{node}");

        let (code, cfg) = pve.curl(&format!("/nodes/pve/qemu/{vmid}/config"), &[]);
        assert_eq!(code, 200, "{cfg}");
        let cfg = &cfg["data"];
        // The disk first: blank, the firmware skips it and boots the ISO.
        assert_eq!(cfg["boot"], "order=scsi0;ide2", "{cfg}");
        let ide2 = cfg["ide2"].as_str().unwrap();
        assert!(
            ide2.starts_with("local:iso/iso_") && ide2.contains(".iso,"),
            "{ide2}"
        );
        assert!(ide2.split(',').any(|o| o == "media=cdrom"), "{ide2}");
        let scsi0 = cfg["scsi0"].as_str().unwrap();
        assert!(scsi0.split(',').any(|o| o == "size=10G"), "{scsi0}");
        assert!(!scsi0.contains("import-from"), "{scsi0}");

        // The stored ISO is the node's ISO, byte for byte.
        let volume = ide2.split(',').next().unwrap();
        let stored = pve.dir.path().join(format!(
            "state/storage/local/template/iso/{}",
            volume.strip_prefix("local:iso/").unwrap()
        ));
        assert_eq!(
            std::fs::read(&stored).unwrap(),
            std::fs::read(out.join(format!("{node}.iso"))).unwrap(),
            "{node}"
        );
    }
    assert_eq!(stats["totals"]["nodes"], 2, "{stats}");
}

/// `POST …/status/<what>` and waits for the task.
fn power(pve: &Pve, vmid: u32, what: &str) {
    let (code, v) = pve.curl(
        &format!("/nodes/pve/qemu/{vmid}/status/{what}"),
        &["-X", "POST"],
    );
    assert_eq!(code, 200, "{v}");
    assert_eq!(pve.wait(&v["data"])["exitstatus"], "OK", "{what} {vmid}");
}

/// `GET /_sim/vms/<vmid>`: running, bootedIp, bootError.
fn vm_state(pve: &Pve, vmid: u32) -> serde_json::Value {
    let o = Command::new("curl")
        .args(["-sk", &format!("{}_sim/vms/{vmid}", pve.url)])
        .output()
        .unwrap();
    serde_json::from_slice(&o.stdout).unwrap()
}

/// Talos v1.12.1, whose ISOs carry `talos.halt_if_installed=1`: after `up`
/// installed every node from its ISO, a VM stopped and started again (a
/// Proxmox host restart) boots its disk and comes back configured; with
/// the ISO first in the boot order it would halt.
#[test]
fn after_up_from_iso_a_restarted_vm_comes_back_on_its_disk() {
    let net = common::net::scenario(module_path!(), "4");
    let sim = factory();
    let nodes = Nodes::start(&["--vip", &format!("{net}.10"), "--talos-version", "v1.12.1"]);
    let pve = Pve::start(&["--nodes-control", &nodes.control]);
    let dir = tempfile::tempdir().unwrap();
    let config = Inventory::five_nodes("isoup", &net)
        .talos("v1.12.1")
        .metal("iso")
        .bootloader("grub")
        .append("publish:\n  proxmox:\n    node: pve\n    storage: local\n    vm: {storage: local-lvm, firstId: 300, diskSize: 10, memory: 2048, boot: iso}\n")
        .write(dir.path());
    let mut run = Run::with_config(&config, &["--output", "json", "up", "--new-secrets"]);
    run.timeouts(&[])
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .factory(&sim)
        .args(["--poll-ms", "50", "--quiet"])
        .folders(dir.path())
        .env_remove("IMGBUILD_STATE_DIR")
        .env_remove("TALOSCONFIG")
        .proxmox(&pve);
    let o = run.output();
    assert!(
        o.status.success(),
        "{}\n{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    assert_eq!(json(&o)["healthy"], true);

    // cp-01 (VM 300) and worker-01's VM: configured from the ISO, so
    // installed to scsi0.
    let cp = format!("{net}.11");
    for vmid in [300, 304] {
        let before = vm_state(&pve, vmid);
        assert_eq!(before["bootError"], serde_json::Value::Null, "{before}");
        let ip = before["bootedIp"].clone();
        power(&pve, vmid, "stop");
        power(&pve, vmid, "start");
        let after = vm_state(&pve, vmid);
        assert_eq!(after["bootedIp"], ip, "{vmid}: {after}");
        assert_eq!(after["bootError"], serde_json::Value::Null, "{after}");
    }
    assert_eq!(vm_state(&pve, 300)["bootedIp"], cp.as_str());
    let stats = nodes.stats();
    assert_eq!(stats["nodes"]["cp-01"]["phase"], "configured", "{stats}");

    // The same VM with the ISO first: Talos halts ("Please reboot from the
    // disk") and no node comes up. The order imgbuild sends is what keeps
    // the VM alive.
    let (code, v) = pve.curl(
        "/nodes/pve/qemu/300/config",
        &["-X", "POST", "--data-urlencode", "boot=order=ide2;scsi0"],
    );
    assert_eq!(code, 200, "{v}");
    if let Some(upid) = v["data"].as_str() {
        pve.wait(&serde_json::Value::from(upid));
    }
    power(&pve, 300, "stop");
    power(&pve, 300, "start");
    let halted = vm_state(&pve, 300);
    assert_eq!(halted["bootedIp"], serde_json::Value::Null, "{halted}");
    assert!(
        halted["bootError"]
            .as_str()
            .is_some_and(|e| e.contains("Please reboot from the disk")),
        "{halted}"
    );
}
