#![allow(clippy::disallowed_macros)] // boot timings and refusals go to the test harness's stderr
//! Real firmware boots the per-node ISOs of imgbuild's patch route: the
//! factory simulator makes the base ISO as Talos does (grub-mkrescue over
//! Debian's cloud kernel and a busybox initramfs; below v1.12 dual-boot,
//! GRUB on BIOS and a UKI on UEFI), imgbuild adds the node's META, and
//! SeaBIOS or OVMF boot it from a CD or a USB stick until the kernel prints
//! `/proc/cmdline`. Talos v1.12.0 (`bootloader: grub` makes a GRUB ISO,
//! `quirks.ISOSupportsSettingBootloader`) and v1.11.2 (always dual-boot)
//! modelled, after siderolabs/talos `pkg/imager/profile/output.go`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common;
use common::inventory::{Inventory, Node};
use common::realboot::{self, Boot, Firmware, Medium, assert_node_cmdline, key10};
use common::sims::Sim;
use common::{text, with_factory};

const NODES: [(&str, &str); 2] = [("cp-01", "controlplane"), ("worker-01", "worker")];

/// Two metal nodes with ISOs at Talos `version`, `image.bootloader: grub`.
fn inventory(dir: &Path, version: &str) -> PathBuf {
    let mut inv = Inventory::new("realboot-iso")
        .talos(version)
        .endpoint("127.0.0.50")
        .metal("iso")
        .bootloader("grub");
    for (i, (name, role)) in NODES.iter().enumerate() {
        inv = inv.node(
            Node::new(name, role)
                .address(&format!("127.0.0.{}", 51 + i))
                .interface(),
        );
    }
    inv.write(dir)
}

/// `imgbuild build` on the patch route into `dir/out`.
fn build(dir: &Path, sim: &Sim, config: &Path) -> Output {
    let out = dir.join("out");
    with_factory(
        config,
        dir,
        sim,
        &["build", "--out-dir", out.to_str().unwrap()],
    )
}

/// The v1.12 GRUB ISOs of both nodes, built; the inventory's path.
fn grub_isos(dir: &Path, sim: &Sim) -> PathBuf {
    let config = inventory(dir, "v1.12.0");
    let o = build(dir, sim, &config);
    assert!(o.status.success(), "{}", text(&o.stderr));
    config
}

fn iso(dir: &Path, node: &str) -> PathBuf {
    dir.join("out").join(format!("{node}.iso"))
}

fn timed(b: Boot) -> Boot {
    eprintln!("{}: {:.1} s", b.name, b.secs);
    b
}

#[test]
fn grub_node_isos_boot_with_their_meta_from_a_cd_under_seabios_and_ovmf() {
    if realboot::skipped() {
        return;
    }
    let sim = realboot::factory();
    let dir = tempfile::tempdir().unwrap();
    let config = grub_isos(dir.path(), &sim);
    let (cp, worker) = (iso(dir.path(), "cp-01"), iso(dir.path(), "worker-01"));
    let b = timed(realboot::boot(
        "iso-cp-01-seabios-cd",
        dir.path(),
        Firmware::SeaBios,
        Medium::Cdrom(&cp),
        &[],
    ));
    assert_node_cmdline(&b, true, &realboot::iso_cmdline(), &key10(&config, "cp-01"));
    let b = timed(realboot::boot(
        "iso-worker-01-ovmf-cd",
        dir.path(),
        Firmware::Ovmf,
        Medium::Cdrom(&worker),
        &[],
    ));
    assert_node_cmdline(
        &b,
        true,
        &realboot::iso_cmdline(),
        &key10(&config, "worker-01"),
    );
}

#[test]
fn grub_node_isos_boot_with_their_meta_from_a_usb_stick() {
    if realboot::skipped() {
        return;
    }
    let sim = realboot::factory();
    let dir = tempfile::tempdir().unwrap();
    let config = grub_isos(dir.path(), &sim);
    let (cp, worker) = (iso(dir.path(), "cp-01"), iso(dir.path(), "worker-01"));
    let b = timed(realboot::boot(
        "iso-cp-01-ovmf-usb",
        dir.path(),
        Firmware::Ovmf,
        Medium::UsbStick(&cp),
        &[],
    ));
    assert_node_cmdline(&b, true, &realboot::iso_cmdline(), &key10(&config, "cp-01"));
    let b = timed(realboot::boot(
        "iso-worker-01-seabios-usb",
        dir.path(),
        Firmware::SeaBios,
        Medium::UsbStick(&worker),
        &[],
    ));
    assert_node_cmdline(
        &b,
        true,
        &realboot::iso_cmdline(),
        &key10(&config, "worker-01"),
    );
}

/// The primary volume descriptor's modification date, as xorriso shows it.
fn volume_date(iso: &Path) -> String {
    let o = Command::new("xorriso")
        .args(["-indev", iso.to_str().unwrap(), "-pvd_info"])
        .output()
        .unwrap();
    text(&o.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("Modif. Time  : "))
        .unwrap_or_else(|| panic!("no volume date: {}", text(&o.stdout)))
        .to_owned()
}

/// What src/iso.rs keeps the volume date for: GRUB's EFI image would find
/// its root by the volume UUID made of it. Debian's GRUB 2.06 grub-mkrescue
/// builds its EFI image with the prefix `()/boot/grub` and no `search
/// --fs-uuid`: it reads `grub.cfg` from the device it was started from, so
/// an ISO whose date changed in a remaster still boots, from a CD and from a
/// USB stick alike.
#[test]
fn debian_grub_efi_boots_a_node_iso_whose_volume_date_changed() {
    if realboot::skipped() {
        return;
    }
    let sim = realboot::factory();
    let dir = tempfile::tempdir().unwrap();
    let config = grub_isos(dir.path(), &sim);
    let node = iso(dir.path(), "worker-01");
    let cfg = dir.path().join("grub.cfg");
    let redated = dir.path().join("redated.iso");
    let o = Command::new("xorriso")
        .args(["-osirrox", "on", "-indev", node.to_str().unwrap()])
        .args(["-extract", "/boot/grub/grub.cfg", cfg.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let o = Command::new("xorriso")
        .args(["-indev", node.to_str().unwrap()])
        .args(["-outdev", redated.to_str().unwrap()])
        .args(["-boot_image", "any", "replay"])
        .args(["-volume_date", "uuid", "2001020304050600"])
        .args(["-compliance", "no_emul_toc"])
        .args(["-update", cfg.to_str().unwrap(), "/boot/grub/grub.cfg"])
        .arg("-commit")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(volume_date(&redated), "2001020304050600");
    assert_ne!(volume_date(&node), volume_date(&redated));
    let key10 = key10(&config, "worker-01");
    let b = timed(realboot::boot(
        "iso-redated-ovmf-cd",
        dir.path(),
        Firmware::Ovmf,
        Medium::Cdrom(&redated),
        &[],
    ));
    assert_node_cmdline(&b, true, &realboot::iso_cmdline(), &key10);
    let b = timed(realboot::boot(
        "iso-redated-ovmf-usb",
        dir.path(),
        Firmware::Ovmf,
        Medium::UsbStick(&redated),
        &[],
    ));
    assert_node_cmdline(&b, true, &realboot::iso_cmdline(), &key10);
}

/// Talos v1.11's ISO is dual-boot whatever `bootloader` says: UEFI boots a
/// UKI whose command line is inside it. imgbuild either makes a node ISO
/// whose UEFI boot carries the node's META, or refuses before it downloads
/// anything; it never makes one that boots without.
#[test]
fn a_v1_11_node_iso_carries_meta_on_uefi_or_is_refused() {
    if realboot::skipped() {
        return;
    }
    let sim = realboot::factory();
    let dir = tempfile::tempdir().unwrap();
    let config = inventory(dir.path(), "v1.11.2");
    let o = build(dir.path(), &sim, &config);
    let cp = iso(dir.path(), "cp-01");
    if !o.status.success() {
        let err = text(&o.stderr);
        eprintln!("refused: {err}");
        assert!(!cp.exists(), "a refused build left {}", cp.display());
        assert_eq!(sim.image_gets(), 0, "refused only after a download");
        assert!(
            err.contains("v1.11"),
            "the refusal names the version: {err}"
        );
        return;
    }
    let b = timed(realboot::boot(
        "iso-v1.11-cp-01-ovmf-cd",
        dir.path(),
        Firmware::Ovmf,
        Medium::Cdrom(&cp),
        &[],
    ));
    let grub = b.args()[0].starts_with("BOOT_IMAGE=");
    assert_node_cmdline(&b, grub, &realboot::iso_cmdline(), &key10(&config, "cp-01"));
}

/// The factory's own v1.11 ISO for a node's schematic (the factory route)
/// boots its UKI under OVMF with the node's META baked into the UKI: the
/// simulator's dual-boot ISO is what real firmware boots.
#[test]
fn the_factorys_own_v1_11_iso_boots_its_uki_with_meta_under_ovmf() {
    if realboot::skipped() {
        return;
    }
    let sim = realboot::factory();
    let dir = tempfile::tempdir().unwrap();
    let config = inventory(dir.path(), "v1.11.2");
    let out = dir.path().join("factory");
    let o = with_factory(
        &config,
        dir.path(),
        &sim,
        &[
            "build",
            "worker-01",
            "--route",
            "factory",
            "--out-dir",
            out.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let b = timed(realboot::boot(
        "iso-factory-v1.11-worker-01-ovmf-cd",
        dir.path(),
        Firmware::Ovmf,
        Medium::Cdrom(&out.join("worker-01.iso")),
        &[],
    ));
    // No GRUB: the UKI's own command line.
    assert_node_cmdline(
        &b,
        false,
        &realboot::iso_cmdline(),
        &key10(&config, "worker-01"),
    );
}
