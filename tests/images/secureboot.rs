//! End to end, Secure Boot (issue 32), modelling Talos v1.11.2 and the
//! factory's Secure Boot assets: a 3+2 Proxmox inventory with
//! `image.secureBoot: true` builds Secure Boot disk images on the patch
//! route (UKI-only EFI layout, the node's key 10, every byte outside META as
//! the factory served it), its VMs get setup-mode EFI vars and a TPM 2.0 and
//! boot; Hetzner, per-node ISOs and PXE are refused with the ways out.

use std::path::Path;
use std::process::{Command, Output};

use crate::common;
use common::inventory::{Inventory, NODES};
use common::run::{Run, Work};
use common::sims::{Nodes, Pve, Sim};
use common::{json, text};

/// The loopback /24 of scenario `k` (tests/common/net.rs).
fn net(k: u8) -> String {
    common::net::scenario(module_path!(), k)
}

const SECURE_BOOT: &str = "image:\n  secureBoot: true\n  enrollKeys: force\n";

/// [`NODES`] on `net`, Secure Boot, metal raw images.
fn secure_boot_cluster(net: &str) -> Inventory {
    Inventory::five_nodes("sb", net)
        .metal("raw")
        .replace("image:\n", SECURE_BOOT)
}

/// The partitions `sgdisk -p` lists: (name, first byte, size in bytes).
fn partitions(image: &Path) -> Vec<(String, u64, u64)> {
    let o = Command::new("sgdisk")
        .arg("-p")
        .arg(image)
        .output()
        .unwrap();
    assert!(o.status.success(), "sgdisk -p {}", image.display());
    text(&o.stdout)
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() >= 7 && f[0].parse::<u32>().is_ok()).then(|| {
                let (first, last): (u64, u64) = (f[1].parse().unwrap(), f[2].parse().unwrap());
                (
                    f[f.len() - 1].to_owned(),
                    first * 512,
                    (last - first + 1) * 512,
                )
            })
        })
        .collect()
}

/// The files in the FAT at `offset` of `image`, as mtools lists them.
fn fat_files(image: &Path, offset: u64) -> Vec<String> {
    let o = Command::new("mdir")
        .args(["-/", "-b", "-i"])
        .arg(format!("{}@@{offset}", image.display()))
        .arg("::")
        .output()
        .unwrap();
    assert!(o.status.success(), "mdir: {}", text(&o.stderr));
    text(&o.stdout).lines().map(str::to_owned).collect()
}

fn curl_to(url: &str, out: &Path) {
    let o = Command::new("curl")
        .args(["-sf", "-o"])
        .arg(out)
        .arg(url)
        .output()
        .unwrap();
    assert!(o.status.success(), "{url}");
}

/// The factory's Secure Boot image of schematic `id`, decompressed.
fn factory_image(sim: &Sim, id: &str, dir: &Path) -> std::path::PathBuf {
    let zst = dir.join(format!("{id}.raw.zst"));
    curl_to(
        &format!(
            "{}/image/{id}/v1.11.2/metal-amd64-secureboot.raw.zst",
            sim.url
        ),
        &zst,
    );
    let raw = dir.join(format!("{id}.raw"));
    let o = Command::new("zstd")
        .args(["-dqf"])
        .arg(&zst)
        .arg("-o")
        .arg(&raw)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    raw
}

fn drive_options(value: &str) -> std::collections::BTreeMap<String, String> {
    value
        .split(',')
        .skip(1)
        .filter_map(|p| p.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

fn publish(work: &Work, sim: &Sim, pve: &Pve) -> Output {
    Run::with_config(&work.config, &["--output", "json", "publish"])
        .factory(sim)
        .args(["--poll-ms", "50", "--quiet"])
        .folders(work.dir.path())
        .proxmox(pve)
        .output()
}

#[test]
fn a_secure_boot_proxmox_cluster_gets_patched_secure_boot_disks_and_vms_that_boot_them() {
    let net = net(1);
    let nodes = Nodes::start(&["--vip", &format!("{net}.10")]);
    let pve = Pve::start(&["--nodes-control", nodes.control.as_str()]);
    let sim = Sim::start(&[]);
    let work = Work::new(&secure_boot_cluster(&net).proxmox(true));
    let o = publish(&work, &sim, &pve);
    assert!(
        o.status.success(),
        "{}\n{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    let v = json(&o);
    let manifest = work.manifest();
    let scratch = tempfile::tempdir().unwrap();
    let rows = v["nodes"].as_array().unwrap();
    assert_eq!(rows.len(), 5, "{v}");
    for (i, (name, host, _)) in NODES.iter().enumerate() {
        let entry = &manifest["images"][name];
        assert_eq!(entry["route"], "patch", "{entry}");
        assert_eq!(entry["secureBoot"], true, "{entry}");
        let source = entry["sourceUrl"].as_str().unwrap();
        assert!(
            source.ends_with("/metal-amd64-secureboot.raw.zst"),
            "{source}"
        );
        let image = work.out().join(entry["path"].as_str().unwrap());

        // UKI-only: EFI and META, no BIOS, no BOOT; systemd-boot and the
        // UKI in the EFI partition, and no GRUB anywhere.
        let parts = partitions(&image);
        let names: Vec<&str> = parts.iter().map(|p| p.0.as_str()).collect();
        assert_eq!(names, ["EFI", "META"], "{name}");
        let files = fat_files(&image, parts[0].1);
        for want in [
            "::/EFI/boot/BOOTX64.efi",
            "::/EFI/Linux/Talos-v1.11.2.efi",
            "::/loader/loader.conf",
            "::/loader/keys/auto/db.auth",
        ] {
            assert!(
                files.iter().any(|f| f == want),
                "{name}: no {want} in {files:?}"
            );
        }
        assert!(
            !files.iter().any(|f| f.to_lowercase().contains("grub")),
            "{files:?}"
        );

        // inspect shows the layout and the node's key 10.
        let o = Run::new(&["inspect"]).arg(&image).output();
        let shown = text(&o.stdout);
        assert!(o.status.success(), "{}", text(&o.stderr));
        assert!(
            shown.contains(" EFI ") && shown.contains(" META "),
            "{shown}"
        );
        assert!(
            !shown.contains(" BOOT ") && !shown.contains(" BIOS "),
            "{shown}"
        );
        assert!(shown.contains(&format!("{net}.{host}/")), "{name}: {shown}");
        assert!(shown.contains("DiskImageBootloader: sd-boot"), "{shown}");

        // Every byte outside META is the factory's base image: the EFI
        // partition's signatures still hold.
        let base = factory_image(
            &sim,
            entry["baseSchematicId"].as_str().unwrap(),
            scratch.path(),
        );
        let (a, b) = (
            std::fs::read(&base).unwrap(),
            std::fs::read(&image).unwrap(),
        );
        assert_eq!(a.len(), b.len(), "{name}");
        let (_, meta_at, meta_size) = parts[1].clone();
        let (meta_at, meta_end) = (meta_at as usize, (meta_at + meta_size) as usize);
        assert!(
            a[..meta_at] == b[..meta_at],
            "{name}: bytes before META differ"
        );
        assert!(
            a[meta_end..] == b[meta_end..],
            "{name}: bytes after META differ"
        );
        assert!(
            a[meta_at..meta_end] != b[meta_at..meta_end],
            "{name}: META unchanged"
        );
        let (efi_at, efi_size) = (parts[0].1 as usize, parts[0].2 as usize);
        assert!(a[efi_at..efi_at + efi_size] == b[efi_at..efi_at + efi_size]);

        // The VM: setup-mode 4m EFI vars and a TPM 2.0, read back.
        let vmid = 300 + i as u64;
        let (code, cfg) = pve.curl(&format!("/nodes/pve/qemu/{vmid}/config"), &[]);
        assert_eq!(code, 200, "{cfg}");
        let cfg = &cfg["data"];
        assert_eq!(cfg["bios"], "ovmf", "{cfg}");
        assert_eq!(cfg["machine"], "q35", "{cfg}");
        let efi = drive_options(cfg["efidisk0"].as_str().unwrap());
        assert_eq!(efi["efitype"], "4m", "{cfg}");
        assert_eq!(efi["pre-enrolled-keys"], "0", "{cfg}");
        let tpm = drive_options(
            cfg["tpmstate0"]
                .as_str()
                .unwrap_or_else(|| panic!("no TPM: {cfg}")),
        );
        assert_eq!(tpm["version"], "v2.0", "{cfg}");
        // and the firmware booted the node at its key-10 address.
        let o = Command::new("curl")
            .arg("-sk")
            .arg(format!("{}_sim/vms/{vmid}", pve.url))
            .output()
            .unwrap();
        let vm: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(vm["bootError"], serde_json::Value::Null, "{vm}");
        assert_eq!(vm["bootedIp"], format!("{net}.{host}"), "{vm}");
    }
}

#[test]
fn the_proxmox_double_boots_a_secure_boot_disk_only_with_a_v2_tpm() {
    let net = net(2);
    let nodes = Nodes::start(&["--vip", &format!("{net}.10")]);
    let pve = Pve::start(&["--nodes-control", nodes.control.as_str()]);
    let sim = Sim::start(&[]);
    let work = Work::new(&secure_boot_cluster(&net).proxmox(true));
    let o = Run::with_config(&work.config, &["build"])
        .factory(&sim)
        .folders(work.dir.path())
        .output();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let manifest = work.manifest();
    let image = work
        .out()
        .join(manifest["images"]["cp-01"]["path"].as_str().unwrap());
    let sum = Command::new("sha256sum").arg(&image).output().unwrap();
    let sum = text(&sum.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned();
    let (code, up) = pve.upload(&image, &sum);
    assert_eq!(code, 200, "{up}");
    assert_eq!(pve.wait(&up["data"])["exitstatus"], "OK");
    let volid = format!(
        "local:import/{}",
        image.file_name().unwrap().to_string_lossy()
    );
    let create = |vmid: &str, tpm: Option<&str>| {
        let mut args = vec![
            "-X".to_owned(),
            "POST".to_owned(),
            "--data-urlencode".to_owned(),
            format!("vmid={vmid}"),
            "--data-urlencode".to_owned(),
            "bios=ovmf".to_owned(),
            "--data-urlencode".to_owned(),
            "efidisk0=local-lvm:1,efitype=4m,pre-enrolled-keys=0".to_owned(),
            "--data-urlencode".to_owned(),
            format!("scsi0=local-lvm:0,import-from={volid}"),
            "--data-urlencode".to_owned(),
            "start=1".to_owned(),
        ];
        if let Some(t) = tpm {
            args.extend(["--data-urlencode".to_owned(), format!("tpmstate0={t}")]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, v) = pve.curl("/nodes/pve/qemu", &args);
        assert_eq!(code, 200, "{v}");
        pve.wait(&v["data"]);
        let o = Command::new("curl")
            .arg("-sk")
            .arg(format!("{}_sim/vms/{vmid}", pve.url))
            .output()
            .unwrap();
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()
    };
    // qemu-server's default TPM is v1.2: the firmware brings no node up.
    let v12 = create("400", Some("local-lvm:1"));
    assert!(
        v12["bootError"]
            .as_str()
            .unwrap_or_default()
            .contains("v1.2"),
        "{v12}"
    );
    let v20 = create("401", Some("local-lvm:1,version=v2.0"));
    assert_eq!(v20["bootError"], serde_json::Value::Null, "{v20}");
    // A version the schema does not know is refused before anything exists.
    let (code, v) = pve.curl(
        "/nodes/pve/qemu",
        &[
            "-X",
            "POST",
            "--data-urlencode",
            "vmid=402",
            "--data-urlencode",
            "tpmstate0=local-lvm:1,version=v3.0",
        ],
    );
    assert_eq!(code, 400, "{v}");
}

#[test]
fn hetzner_with_secure_boot_exits_2_before_anything_is_created() {
    let dir = tempfile::tempdir().unwrap();
    let config = Inventory::five_nodes("sb", &net(3))
        .replace("image:\n", "image:\n  secureBoot: true\n")
        .replace("  platform: metal\n", "  platform: hcloud\n")
        .metal("raw")
        .hcloud("    location: fsn1\n")
        .write(dir.path());
    let o = Run::with_config(&config, &["build"])
        .folders(dir.path())
        .output();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    assert!(err.contains("image.secureBoot"), "{err}");
    assert!(err.contains("Hetzner Cloud offers no Secure Boot"), "{err}");
    assert!(!dir.path().join("out").exists(), "something was built");
}

#[test]
fn a_per_node_secure_boot_iso_and_pxe_are_refused_with_the_ways_out() {
    let sim = Sim::start(&[]);
    let work = Work::new(
        &Inventory::five_nodes("sb", &net(4))
            .metal("iso")
            .replace("image:\n", SECURE_BOOT),
    );
    let o = work.imgbuild(&sim, &["build"]).output();
    assert!(!o.status.success());
    let err = text(&o.stderr);
    for way in ["signed", "raw or qcow2", "--route factory", "dhcp: true"] {
        assert!(err.contains(way), "{way}: {err}");
    }
    assert_eq!(sim.image_gets(), 0, "nothing is downloaded");
    // The explicit opt-in: the factory's own Secure Boot ISO per node, its
    // META signed into the UKI's command line by the factory.
    let o = work
        .imgbuild(
            &sim,
            &["--output", "json", "build", "--route", "factory", "cp-01"],
        )
        .output();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let entry = &work.manifest()["images"]["cp-01"];
    assert!(
        entry["sourceUrl"]
            .as_str()
            .unwrap()
            .ends_with("/metal-amd64-secureboot.iso"),
        "{entry}"
    );
    let o = Run::with_config(&work.config, &["verify", "--out-dir"])
        .arg(work.out())
        .output();
    assert!(o.status.success(), "{}{}", text(&o.stdout), text(&o.stderr));

    let cp01 = format!("    address: {}.11\n", net(4));
    let work = Work::new(
        &Inventory::five_nodes("sb", &net(4))
            .metal("raw")
            .replace("image:\n", SECURE_BOOT)
            .replace(&cp01, &format!("{cp01}    mac: bc:24:11:0a:00:11\n")),
    );
    let gets = sim.image_gets();
    let o = work.imgbuild(&sim, &["pxe", "cp-01"]).output();
    // The inventory's fault, as validate's refusal of such an ISO: exit 2.
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    for way in [
        "ignores a command line",
        "raw or qcow2",
        "--route factory",
        "dhcp: true",
    ] {
        assert!(err.contains(way), "{way}: {err}");
    }
    assert!(
        !work.out().join("boot.ipxe").exists(),
        "no script was written"
    );
    assert_eq!(sim.image_gets(), gets, "nothing is downloaded");
}

fn day2(config: &Path, args: &[&str]) -> Output {
    let mut run = Run::with_config(config, args);
    if args.contains(&"bootstrap") || args.contains(&"upgrade") {
        run.timeouts(&[]);
    }
    run.env_remove("IMGBUILD_STATE_DIR")
        .env_remove("IMGBUILD_FACTORY")
        .env_remove("TALOSCONFIG");
    run.output()
}

/// Talos v1.11.2 → v1.11.5 with Secure Boot: every machine config installs
/// from `metal-installer-secureboot/<base id>`, the upgrade names Secure
/// Boot installers, `status` reads each node's SecurityState, and a node
/// the inventory would switch out of Secure Boot is reported by `status`
/// and refused by `upgrade`, with the reason.
#[test]
fn secure_boot_installers_from_the_first_config_through_upgrades_and_status() {
    let factory = Sim::start_with(&[], 0, &["--versions", "v1.11.2,v1.11.5"]);
    let net = net(5);
    let nodes = Nodes::cluster(&net, true, &["--secure-boot"]);
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("cluster.yaml");
    let inventory = |talos: &str| {
        Inventory::five_nodes("sb", &net)
            .talos(talos)
            .factory(&factory.url)
            .replace("image:\n", "image:\n  secureBoot: true\n")
    };
    inventory("v1.11.2").write(dir.path());
    let o = day2(&config, &["--output", "json", "bootstrap", "--new-secrets"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let host = factory
        .url
        .trim_start_matches("http://")
        .trim_end_matches('/');

    for (node, _, _) in NODES {
        let file = dir.path().join(format!("{node}.yaml"));
        let o = day2(&config, &["config", node, "--out", file.to_str().unwrap()]);
        assert!(o.status.success(), "{}", text(&o.stderr));
        let rendered = std::fs::read_to_string(&file).unwrap();
        let first = serde_yaml_ng::Deserializer::from_str(&rendered)
            .next()
            .unwrap();
        let doc: serde_yaml_ng::Value = serde::Deserialize::deserialize(first).unwrap();
        let image = doc["machine"]["install"]["image"]
            .as_str()
            .unwrap_or_else(|| panic!("{node}: no install image in {rendered}"));
        let prefix = format!("{host}/metal-installer-secureboot/");
        assert!(image.starts_with(&prefix), "{node}: {image}");
        assert!(image.ends_with(":v1.11.2"), "{image}");
    }

    // status: every node booted with Secure Boot, as the inventory says.
    let o = day2(&config, &["--output", "json", "status"]);
    let v = json(&o);
    for row in v["nodes"].as_array().unwrap() {
        assert_eq!(row["security"]["secureBoot"], true, "{row}");
        let pcr = row["security"]["pcrSigningKeyFingerprint"]
            .as_str()
            .unwrap();
        assert_eq!(pcr.split(':').count(), 32, "{pcr}");
    }
    assert!(
        !v["drift"]
            .as_array()
            .unwrap()
            .iter()
            .any(|d| d["what"] == "secureBoot"),
        "{v}"
    );

    // The upgrade names Secure Boot installers of the base schematic.
    inventory("v1.11.5").write(dir.path());
    let o = day2(&config, &["--output", "json", "upgrade", "--dry-run"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let plan = json(&o);
    let posted = factory.posted_schematics();
    let ids: Vec<&String> = posted.as_object().unwrap().keys().collect();
    assert_eq!(ids.len(), 1, "{posted}");
    let want = format!("{host}/metal-installer-secureboot/{}:v1.11.5", ids[0]);
    for r in plan["nodes"].as_array().unwrap() {
        assert_eq!(r["to"]["installer"], want.as_str(), "{r}");
    }

    // worker-02 would leave Secure Boot: status says so, upgrade refuses.
    inventory("v1.11.5")
        .replace(
            &format!("    address: {net}.22\n"),
            &format!("    address: {net}.22\n    secureBoot: false\n"),
        )
        .write(dir.path());
    let o = day2(&config, &["--output", "json", "status"]);
    let v = json(&o);
    let drift: Vec<&serde_json::Value> = v["drift"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| d["what"] == "secureBoot")
        .collect();
    assert_eq!(drift.len(), 1, "{v}");
    assert_eq!(drift[0]["node"], "worker-02");
    let o = day2(&config, &["upgrade", "--dry-run"]);
    assert!(!o.status.success());
    let err = text(&o.stderr);
    assert!(
        err.contains("worker-02") && err.contains("siderolabs/talos#9245"),
        "{err}"
    );
    assert_eq!(
        nodes.stats()["nodes"]["worker-02"]["day2"]["upgrades"],
        0,
        "nothing was upgraded"
    );
    // apply refuses it as well: its config would name the other installer.
    let o = day2(&config, &["apply", "--dry-run"]);
    assert!(!o.status.success());
    let all = format!("{}{}", text(&o.stdout), text(&o.stderr));
    assert!(
        all.contains("worker-02") && all.contains("siderolabs/talos#9245"),
        "{all}"
    );
}

/// image-factory (`internal/frontend/http/image.go`, `secureboot.go`;
/// Talos v1.11.2 assets): `<platform>-<arch>-secureboot-uki.efi` is a UKI
/// carrying the schematic's command line, signed with the factory's key,
/// whose certificate `/secureboot/signing-cert.pem` serves: sbverify
/// accepts it with that certificate and refuses it with another; each
/// architecture gets its own.
#[test]
fn the_factory_serves_a_signed_secure_boot_uki_per_architecture() {
    let sim = Sim::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let body = "customization:\n  extraKernelArgs:\n    - sim.marker=uki\n  secureboot:\n    enrollKeys: if-safe\n";
    let o = Command::new("curl")
        .args(["-sf", "-X", "POST", "--data-binary", body])
        .arg(format!("{}/schematics", sim.url))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let id = serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let cert = dir.path().join("cert.pem");
    curl_to(&format!("{}/secureboot/signing-cert.pem", sim.url), &cert);
    let verify = |uki: &Path, cert: &Path| {
        Command::new("sbverify")
            .arg("--cert")
            .arg(cert)
            .arg(uki)
            .output()
            .unwrap()
    };
    let mut ukis = Vec::new();
    for arch in ["amd64", "arm64"] {
        let uki = dir.path().join(format!("{arch}.efi"));
        curl_to(
            &format!(
                "{}/image/{id}/v1.11.2/metal-{arch}-secureboot-uki.efi",
                sim.url
            ),
            &uki,
        );
        let o = verify(&uki, &cert);
        assert!(
            o.status.success(),
            "{arch}: {}{}",
            text(&o.stdout),
            text(&o.stderr)
        );
        let bytes = std::fs::read(&uki).unwrap();
        assert!(
            bytes.windows(14).any(|w| w == b"sim.marker=uki"),
            "{arch}: the schematic's command line is in the UKI"
        );
        ukis.push(bytes);
    }
    assert_ne!(ukis[0], ukis[1], "one UKI per architecture");
    // The Secure Boot PXE script boots that UKI alone (pxe.go,
    // secureboot.ipxe); the plain one kernel, command line and initramfs.
    let script = |path: &str| {
        let o = Command::new("curl")
            .args(["-sf"])
            .arg(format!("{}/pxe/{id}/v1.11.2/{path}", sim.url))
            .output()
            .unwrap();
        assert!(o.status.success(), "{path}");
        text(&o.stdout)
    };
    let base = format!("{}/image/{id}/v1.11.2", sim.url);
    assert_eq!(
        script("metal-amd64-secureboot"),
        format!("#!ipxe\n\nkernel {base}/metal-amd64-secureboot-uki.efi\nboot\n")
    );
    let plain = script("metal-arm64");
    assert!(
        plain.starts_with(&format!("#!ipxe\n\nimgfree\nkernel {base}/kernel-arm64 ")),
        "{plain}"
    );
    assert!(plain.contains("sim.marker=uki"), "{plain}");
    assert!(
        plain.ends_with(&format!("\ninitrd {base}/initramfs-arm64.xz\nboot\n")),
        "{plain}"
    );
    // Another key's certificate does not verify it.
    let other_key = dir.path().join("other.key");
    let other = dir.path().join("other.pem");
    let o = Command::new("openssl")
        .args([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        ])
        .args(["-subj", "/CN=other"])
        .arg("-keyout")
        .arg(&other_key)
        .arg("-out")
        .arg(&other)
        .output()
        .unwrap();
    assert!(o.status.success());
    assert!(
        !verify(&dir.path().join("amd64.efi"), &other)
            .status
            .success()
    );
}

/// The factory builds each architecture's disk (Talos v1.11.2 imager,
/// `pkg/imager`): an arm64 disk has no BIOS boot partition and its Secure
/// Boot EFI partition boots `BOOTAA64.efi`; asking for amd64 first does
/// not make arm64 get the amd64 disk.
#[test]
fn the_factory_serves_a_different_disk_per_architecture() {
    let sim = Sim::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let body = "customization:\n  extraKernelArgs:\n    - sim.marker=arch\n";
    let o = Command::new("curl")
        .args(["-sf", "-X", "POST", "--data-binary", body])
        .arg(format!("{}/schematics", sim.url))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let id = serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let fetch = |file: &str| {
        let out = dir.path().join(file);
        curl_to(&format!("{}/image/{id}/v1.11.2/{file}", sim.url), &out);
        out
    };
    let names = |image: &Path| -> Vec<String> {
        partitions(image).into_iter().map(|(n, _, _)| n).collect()
    };
    let amd64 = fetch("metal-amd64.raw");
    let arm64 = fetch("metal-arm64.raw");
    assert!(
        names(&amd64).contains(&"BIOS".to_owned()),
        "{:?}",
        names(&amd64)
    );
    assert!(
        !names(&arm64).contains(&"BIOS".to_owned()),
        "{:?}",
        names(&arm64)
    );
    assert!(
        names(&arm64).contains(&"META".to_owned()),
        "{:?}",
        names(&arm64)
    );
    for (arch, loader) in [("amd64", "BOOTX64.efi"), ("arm64", "BOOTAA64.efi")] {
        let sb = fetch(&format!("metal-{arch}-secureboot.raw"));
        let (_, efi, _) = partitions(&sb)
            .into_iter()
            .find(|(n, _, _)| n == "EFI")
            .unwrap();
        let files = fat_files(&sb, efi);
        assert!(
            files
                .iter()
                .any(|f| f.ends_with(&format!("/EFI/boot/{loader}"))),
            "{arch}: {files:?}"
        );
    }
}
