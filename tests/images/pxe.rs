//! End to end: `imgbuild pxe` against the factory simulator. Each node's
//! script must carry exactly the key-10 value the patch route writes into its
//! disk image, over the factory's own kernel and initramfs, while the
//! factory learns nothing about the nodes.

use std::process::Command;

use crate::common;
use common::inventory::{Inventory, NODES, Node};
use common::sims::Sim;
use common::{decode_meta, json, text, with_factory};

/// A loopback inventory of five nodes with MACs at Talos `version`;
/// worker-02 has one more extension, so two base schematics are in play.
fn five_macs(version: &str) -> Inventory {
    let mut inv = Inventory::new("pxe")
        .talos(version)
        .vip("127.0.0.20")
        .metal("raw")
        .extensions("siderolabs/qemu-guest-agent");
    for (i, (name, _, role)) in NODES.iter().enumerate() {
        let mut node = Node::new(name, role)
            .address(&format!("127.0.0.{}", 11 + i))
            .mac(&format!("BC:24:11:00:00:{:02X}", 0x11 + i))
            .interface();
        if *name == "worker-02" {
            node = node.extensions("siderolabs/iscsi-tools");
        }
        inv = inv.node(node);
    }
    inv
}

/// The kernel line of a node's script, split into the kernel URL and args.
fn kernel_line(script: &str) -> (String, Vec<String>) {
    let line = script
        .lines()
        .find_map(|l| l.strip_prefix("kernel "))
        .unwrap_or_else(|| panic!("no kernel line in {script}"));
    let mut words = line.split(' ').map(str::to_owned);
    (words.next().unwrap(), words.collect())
}

fn sha256(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}

fn curl(url: &str) -> Vec<u8> {
    let o = Command::new("curl").args(["-sf", url]).output().unwrap();
    assert!(o.status.success(), "{url}");
    o.stdout
}

#[test]
fn every_script_carries_the_key10_its_disk_image_would_and_the_factory_learns_no_address() {
    let sim = Sim::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let config = five_macs("v1.11.2").write(dir.path());
    let pxe = dir.path().join("pxe");
    let o = with_factory(
        &config,
        dir.path(),
        &sim,
        &[
            "pxe",
            "--out-dir",
            pxe.to_str().unwrap(),
            "--output",
            "json",
        ],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let report = json(&o);
    assert_eq!(report["nodes"].as_array().unwrap().len(), 5);
    assert_eq!(report["assets"].as_array().unwrap().len(), 2, "{report}");

    // The patch route's disk images, for the key-10 value each node gets.
    let out = dir.path().join("out");
    let o = with_factory(
        &config,
        dir.path(),
        &sim,
        &["build", "--out-dir", out.to_str().unwrap()],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));

    for (i, node) in ["cp-01", "cp-02", "cp-03", "worker-01", "worker-02"]
        .iter()
        .enumerate()
    {
        let mac = format!("bc-24-11-00-00-{:02x}", 0x11 + i);
        let script = std::fs::read_to_string(pxe.join(format!("nodes/{mac}.ipxe"))).unwrap();
        let (kernel, args) = kernel_line(&script);
        assert!(args.iter().any(|a| a == "talos.platform=metal"), "{script}");
        let meta_args: Vec<&String> = args
            .iter()
            .filter(|a| a.starts_with("talos.environment="))
            .collect();
        assert_eq!(meta_args.len(), 1, "{script}");
        let decoded = decode_meta(meta_args[0]);
        assert!(decoded.starts_with(&[0x1f, 0x8b]) || decoded.starts_with(b"0xa="));
        let key10 = String::from_utf8(decoded).unwrap();
        let key10 = key10.strip_prefix("0xa=").unwrap();

        let o = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
            .arg("inspect")
            .arg(out.join(format!("{node}.raw")))
            .args(["--output", "json"])
            .output()
            .unwrap();
        let v = json(&o);
        let tag = v["meta"]["tags"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["key"] == 10)
            .unwrap_or_else(|| panic!("{node}: no key 10 in {v}"));
        assert_eq!(tag["value"].as_str().unwrap(), key10, "{node}");
        assert!(
            key10.contains(&format!("127.0.0.{}/8", 11 + i)),
            "{node}: {key10}"
        );

        // The kernel and initramfs are the factory's bytes.
        let kernel_path = pxe.join("nodes").join(&kernel);
        let initrd = script
            .lines()
            .find_map(|l| l.strip_prefix("initrd "))
            .unwrap();
        let initrd_path = pxe.join("nodes").join(initrd);
        let rel = kernel.strip_prefix("../assets/").unwrap();
        let (id, rest) = rel.split_once('/').unwrap();
        assert_eq!(rest, "v1.11.2/kernel-amd64");
        let served = |file: &str| curl(&format!("{}/image/{id}/v1.11.2/{file}", sim.url));
        assert_eq!(
            sha256(&std::fs::read(&kernel_path).unwrap()),
            sha256(&served("kernel-amd64"))
        );
        assert_eq!(
            sha256(&std::fs::read(&initrd_path).unwrap()),
            sha256(&served("initramfs-amd64.xz"))
        );
        // Besides META, the factory's own command line for that schematic.
        let base = String::from_utf8(served("cmdline-metal-amd64")).unwrap();
        let without_meta: Vec<&str> = args
            .iter()
            .filter(|a| !a.starts_with("talos.environment="))
            .map(String::as_str)
            .collect();
        assert_eq!(without_meta.join(" "), base.trim(), "{node}");
    }

    // What the factory was told: schematics without META or any address.
    let posted = sim.posted_schematics();
    let posted = posted.as_object().unwrap();
    assert_eq!(posted.len(), 2, "{posted:?}");
    for body in posted.values() {
        let body = body.as_str().unwrap();
        assert!(!body.contains("meta"), "{body}");
        assert!(!body.contains("127.0.0."), "{body}");
    }

    let boot = std::fs::read_to_string(pxe.join("boot.ipxe")).unwrap();
    assert!(
        boot.contains("chain --autofree nodes/${netX/mac:hexhyp}.ipxe"),
        "{boot}"
    );

    // A rerun rewrites nothing.
    let o = with_factory(
        &config,
        dir.path(),
        &sim,
        &[
            "pxe",
            "--out-dir",
            pxe.to_str().unwrap(),
            "--output",
            "json",
        ],
    );
    let again = json(&o);
    let written: Vec<&serde_json::Value> = again["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| &n["script"]["written"])
        .chain(
            again["assets"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|a| [&a["kernel"]["written"], &a["initramfs"]["written"]]),
        )
        .collect();
    assert!(written.iter().all(|w| **w == false), "{again}");
}

#[test]
fn an_absolute_url_base_is_used_when_given() {
    let sim = Sim::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let config = five_macs("v1.11.2").write(dir.path());
    let pxe = dir.path().join("pxe");
    let o = with_factory(
        &config,
        dir.path(),
        &sim,
        &[
            "pxe",
            "cp-01",
            "--out-dir",
            pxe.to_str().unwrap(),
            "--url",
            "http://127.0.0.9:8080/boot/",
        ],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let script = std::fs::read_to_string(pxe.join("nodes/bc-24-11-00-00-11.ipxe")).unwrap();
    let (kernel, _) = kernel_line(&script);
    assert!(
        kernel.starts_with("http://127.0.0.9:8080/boot/assets/"),
        "{kernel}"
    );
    assert!(
        !pxe.join("nodes/bc-24-11-00-00-12.ipxe").exists(),
        "only the named node"
    );
    for bad in [
        "http://x/\"; shell ;",
        "http://x/?a=b",
        "ftp://x/",
        "http://x/$net0",
    ] {
        let o = with_factory(
            &config,
            dir.path(),
            &sim,
            &["pxe", "--out-dir", pxe.to_str().unwrap(), "--url", bad],
        );
        assert_eq!(o.status.code(), Some(2), "{bad}: {}", text(&o.stderr));
        assert!(text(&o.stderr).contains("--url"), "{}", text(&o.stderr));
    }
}

#[test]
fn talos_before_1_6_3_gets_meta_uncompressed() {
    let sim = Sim::start_with(&[], 0, &["--versions", "v1.6.2,v1.11.2"]);
    let dir = tempfile::tempdir().unwrap();
    for (version, gzipped) in [("v1.6.2", false), ("v1.11.2", true)] {
        let config = five_macs(version).write(dir.path());
        let pxe = dir.path().join(format!("pxe-{version}"));
        let o = with_factory(
            &config,
            dir.path(),
            &sim,
            &["pxe", "cp-01", "--out-dir", pxe.to_str().unwrap()],
        );
        assert!(o.status.success(), "{version}: {}", text(&o.stderr));
        let script = std::fs::read_to_string(pxe.join("nodes/bc-24-11-00-00-11.ipxe")).unwrap();
        let (_, args) = kernel_line(&script);
        let arg = args
            .iter()
            .find(|a| a.starts_with("talos.environment="))
            .unwrap();
        use base64::Engine;
        let b64 = arg.split_once("INSTALLER_META_BASE64=").unwrap().1;
        let raw = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap();
        assert_eq!(raw.starts_with(&[0x1f, 0x8b]), gzipped, "{version}");
        assert!(
            decode_meta(arg).len() > 256,
            "long enough to be gzipped where allowed"
        );
    }
}

#[test]
fn what_cannot_be_carried_is_refused_naming_the_node() {
    let sim = Sim::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let pxe = dir.path().join("pxe");

    // A value with ';' would arrive cut.
    let config = five_macs("v1.11.2")
        .network("  searchDomains: [\"lab;evil\"]\n")
        .write(dir.path());
    let o = with_factory(
        &config,
        dir.path(),
        &sim,
        &["pxe", "--out-dir", pxe.to_str().unwrap()],
    );
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    assert!(
        text(&o.stderr).contains("cp-01") && text(&o.stderr).contains("';'"),
        "{}",
        text(&o.stderr)
    );
    assert!(!pxe.join("nodes").exists(), "nothing written on refusal");

    // A node without a MAC cannot be found by iPXE.
    let config = five_macs("v1.11.2").write(dir.path());
    let text_in = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text_in.replace("    mac: BC:24:11:00:00:14\n", "")).unwrap();
    let o = with_factory(
        &config,
        dir.path(),
        &sim,
        &["pxe", "--out-dir", pxe.to_str().unwrap()],
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    assert!(
        text(&o.stderr).contains("worker-01") && text(&o.stderr).contains("mac"),
        "{}",
        text(&o.stderr)
    );

    // A command line over the kernel's 2048 bytes.
    let config = five_macs("v1.11.2").write(dir.path());
    let long: Vec<String> = (0..22)
        .map(|i| format!("imgbuild.pad{i}={}", "x".repeat(60)))
        .collect();
    let text_in = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        text_in.replace(
            "  extensions: [siderolabs/qemu-guest-agent]\n",
            &format!(
                "  extensions: [siderolabs/qemu-guest-agent]\n  kernelArgs: [{}]\n",
                long.join(", ")
            ),
        ),
    )
    .unwrap();
    let o = with_factory(
        &config,
        dir.path(),
        &sim,
        &["pxe", "--out-dir", pxe.to_str().unwrap()],
    );
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    assert!(
        err.contains("cp-01") && err.contains("2048") && err.contains("bytes"),
        "{err}"
    );
}
