#![allow(clippy::disallowed_macros)] // boot timings and refusals go to the test harness's stderr
//! Real iPXE boots `imgbuild pxe` output: QEMU's iPXE ROM (Debian
//! ipxe-qemu) under SeaBIOS fetches `boot.ipxe` from QEMU's TFTP server (the
//! served folder as imgbuild wrote it), chains the node's script by the MAC
//! of the card it booted from, and boots the factory's kernel with it. The
//! kernel (Debian's cloud kernel, busybox initramfs) prints `/proc/cmdline`.
//! Talos v1.11.2 modelled (META on the PXE kernel line from v1.5,
//! siderolabs/image-factory `internal/frontend/http/pxe.go`).

use std::path::Path;

use crate::common;
use common::inventory::{Inventory, Node};
use common::realboot::{self, Firmware, Medium, Nic, assert_node_cmdline, key10};
use common::{json, text, with_factory};

const CP_MAC: &str = "52:54:00:27:00:01";
const WORKER_MAC: &str = "52:54:00:27:00:02";
/// In no inventory.
const STRANGER_MAC: &str = "52:54:00:27:00:99";

/// Two metal nodes known by MAC; `imgbuild pxe` writes their folder to
/// `dir/pxe`. Returns the inventory's path.
fn served(dir: &Path, sim: &common::sims::Sim) -> std::path::PathBuf {
    let mut inv = Inventory::new("realboot-pxe")
        .talos("v1.11.2")
        .endpoint("127.0.0.40")
        .metal("raw");
    for (i, (name, role, mac)) in [
        ("cp-01", "controlplane", CP_MAC),
        ("worker-01", "worker", WORKER_MAC),
    ]
    .iter()
    .enumerate()
    {
        inv = inv.node(
            Node::new(name, role)
                .address(&format!("127.0.0.{}", 41 + i))
                .mac(mac)
                .interface(),
        );
    }
    let config = inv.write(dir);
    let pxe = dir.join("pxe");
    let o = with_factory(
        &config,
        dir,
        sim,
        &[
            "pxe",
            "--out-dir",
            pxe.to_str().unwrap(),
            "--output",
            "json",
        ],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(json(&o)["nodes"].as_array().unwrap().len(), 2);
    config
}

/// The boot script's explanation for a MAC it does not know: the text of
/// its `echo`, up to the first variable.
fn explanation(pxe: &Path) -> String {
    let script = std::fs::read_to_string(pxe.join("boot.ipxe")).unwrap();
    let text = script
        .lines()
        .find_map(|l| l.strip_prefix("echo "))
        .map(|l| l.split("${").next().unwrap().trim().to_owned())
        .unwrap_or_else(|| panic!("no explanation in {script}"));
    assert!(text.len() > 10, "{text:?}");
    text
}

fn network<'a>(dir: &'a Path, nics: &'a [Nic<'a>]) -> Medium<'a> {
    Medium::Network {
        tftp: dir,
        bootfile: "boot.ipxe",
        nics,
    }
}

#[test]
fn ipxe_boots_a_node_by_its_mac_with_its_meta_and_tells_a_stranger_why_not() {
    if realboot::skipped() {
        return;
    }
    let sim = realboot::factory();
    let dir = tempfile::tempdir().unwrap();
    let config = served(dir.path(), &sim);
    let pxe = dir.path().join("pxe");

    let nics = [Nic {
        mac: CP_MAC,
        boots: true,
    }];
    let explanation = explanation(&pxe);
    let b = realboot::boot(
        "pxe-cp-01",
        dir.path(),
        Firmware::SeaBios,
        network(&pxe, &nics),
        &[&explanation],
    );
    assert_node_cmdline(
        &b,
        false,
        realboot::FACTORY_CMDLINE,
        &key10(&config, "cp-01"),
    );
    eprintln!("{}: {:.1} s", b.name, b.secs);

    // A machine in no inventory gets the boot script's explanation and no
    // kernel.
    let nics = [Nic {
        mac: STRANGER_MAC,
        boots: true,
    }];
    let b = realboot::boot(
        "pxe-stranger",
        dir.path(),
        Firmware::SeaBios,
        network(&pxe, &nics),
        &[&explanation],
    );
    eprintln!("{}: {:.1} s", b.name, b.secs);
    assert!(
        b.cmdline.is_none(),
        "an unknown MAC booted a kernel: {:?}",
        b.cmdline
    );
    assert!(
        b.serial.contains(&explanation),
        "the stranger was not told {explanation:?}:\n{}",
        b.serial
    );
}

#[test]
fn ipxe_boots_a_node_from_its_second_network_card() {
    if realboot::skipped() {
        return;
    }
    let sim = realboot::factory();
    let dir = tempfile::tempdir().unwrap();
    let config = served(dir.path(), &sim);
    let pxe = dir.path().join("pxe");
    // The first card's MAC is in no inventory; the firmware boots the
    // second, worker-01's. iPXE must chain by the card it booted from.
    let nics = [
        Nic {
            mac: STRANGER_MAC,
            boots: false,
        },
        Nic {
            mac: WORKER_MAC,
            boots: true,
        },
    ];
    let b = realboot::boot(
        "pxe-worker-01-nic2",
        dir.path(),
        Firmware::SeaBios,
        network(&pxe, &nics),
        &[&explanation(&pxe)],
    );
    eprintln!("{}: {:.1} s", b.name, b.secs);
    assert_node_cmdline(
        &b,
        false,
        realboot::FACTORY_CMDLINE,
        &key10(&config, "worker-01"),
    );
}
