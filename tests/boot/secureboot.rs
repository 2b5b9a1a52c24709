#![allow(clippy::disallowed_macros)] // boot timings go to the test harness's stderr
//! Real Secure Boot firmware boots a disk whose META imgbuild patched.
//!
//! fixtures/secureboot.sh makes, at test time, a test key hierarchy
//! (PK → KEK → db), a UKI on systemd's EFI stub over Debian's cloud kernel
//! and the busybox initramfs of fixtures/realboot.sh, and GPT disks shaped
//! like Talos's Secure Boot disk image (`metal-amd64-secureboot.raw`: EFI and
//! META): systemd-boot signed with db as the removable-media loader, the UKI
//! in `EFI/Linux` (signed with db, unsigned, or signed with a key the
//! firmware never learns), and `loader/keys/auto/{PK,KEK,db}.auth` with
//! `secure-boot-enroll force`, as Talos's sd-boot installer lays them out.
//! `imgbuild patch` (the CLI, `src/cli/image.rs` → `disk::edit::patch`)
//! writes the node's META key 10 into each. OVMF's Secure Boot build
//! (`OVMF_CODE_4M.secboot.fd`) boots them under QEMU with swtpm as the TPM.
//!
//! What these tests prove, with real firmware:
//! - a blank OVMF variable store has no PK (setup mode: the UEFI
//!   specification's Secure Boot chapter has SetupMode 1 while no PK is
//!   enrolled, and the firmware then runs unsigned code); systemd-boot
//!   enrolls the test keys from the ESP and resets; the store then holds PK,
//!   KEK and db with the test certificates;
//! - the patch leaves every byte outside META alone (the EFI partition
//!   byte-identical, so every signature in it still verifies), and the GPT
//!   stays valid (`sgdisk -v`);
//! - with the keys enrolled, the signed UKI boots from the patched disk: the
//!   kernel says Secure Boot is on, swtpm's PCRs 7 (firmware) and 11
//!   (systemd-stub's measurement of the UKI) hold measurements,
//!   the command line is the UKI's signed one, and the kernel reads the
//!   patched META bytes from the disk it booted from;
//! - the unsigned UKI, and one signed by a key not in db, on otherwise
//!   identical disks, are refused by the firmware: its LoadImage answers
//!   Access Denied, which systemd-boot prints as "Error loading …: Access
//!   Denied", and no kernel runs.
//!
//! What rests on upstream sources, not on these tests:
//! - Talos reads META from the partition labelled META at boot
//!   (siderolabs/talos `internal/pkg/meta/meta.go`) and the metal platform
//!   takes its network from key 10 (`MetalNetworkPlatformConfig`,
//!   `pkg/machinery/meta/constants.go`;
//!   `internal/app/machined/pkg/runtime/v1alpha1/platform/metal/metal.go`);
//!   META is a raw partition outside the ESP, so no signature covers it;
//! - Talos's Secure Boot disk has EFI and META only
//!   (`internal/pkg/partition/partition.go`) and its sd-boot enrolls
//!   `loader/keys/auto` per `secure-boot-enroll`
//!   (`internal/app/machined/pkg/runtime/v1alpha1/bootloader/sdboot/sdboot.go`;
//!   Talos ships its own systemd-boot, which also knows `if-safe`; Debian
//!   bookworm's 252 knows off, manual and force);
//! - the refusal is EDK II's `DxeImageVerificationLib` (Debian's OVMF is a
//!   release build: no debug log says so; the status text is the evidence).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use crate::common;
use common::inventory::{Inventory, Node};
use common::realboot::{self, BLANK_VARS, Boot, FACTORY_CMDLINE, Firmware, Medium, key10};
use common::{imgbuild, root, text};

/// The disks: the base as the factory would serve it, and imgbuild's patch.
struct Disk {
    base: PathBuf,
    node: PathBuf,
}

struct Disks {
    dir: PathBuf,
    signed: Disk,
    unsigned: Disk,
    wrong_key: Disk,
    key10: String,
}

/// The UKI's own (signed) command line: the factory's, as in the other
/// real-boot tests.
const CMDLINE: &str = FACTORY_CMDLINE;

/// Under target/tmp, one directory per test process; those of processes
/// gone are removed first (statics are never dropped).
fn scratch() -> PathBuf {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    for e in std::fs::read_dir(tmp).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(pid) = name.strip_prefix("secureboot-")
            && !Path::new("/proc").join(pid).exists()
        {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
    let dir = tmp.join(format!("secureboot-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Keys, UKIs and disks, built once per test process, each disk patched by
/// `imgbuild patch` for node cp-01 of a metal inventory (Talos v1.11.2).
fn disks() -> &'static Disks {
    static D: OnceLock<Disks> = OnceLock::new();
    D.get_or_init(|| {
        let fx = realboot::fixtures();
        realboot::require(&[
            ("swtpm", "swtpm"),
            ("sbsign", "sbsigntool"),
            ("sbverify", "sbsigntool"),
            ("sign-efi-sig-list", "efitools"),
        ]);
        let dir = scratch();
        let o = Command::new(root().join("fixtures/secureboot.sh"))
            .arg("build")
            .arg(&dir)
            .arg(&fx.kernel)
            .arg(&fx.initramfs)
            .arg(CMDLINE)
            .output()
            .unwrap();
        assert!(o.status.success(), "secureboot.sh: {}", text(&o.stderr));
        let config = Inventory::new("realboot-secureboot")
            .endpoint("127.0.0.60")
            .metal("raw")
            .node(
                Node::new("cp-01", "controlplane")
                    .address("127.0.0.61")
                    .interface(),
            )
            .write(&dir);
        let patch = |name: &str| {
            let base = dir.join(format!("{name}.raw"));
            let node = dir.join(format!("{name}-cp-01.raw"));
            let o = imgbuild(&[
                "--config",
                config.to_str().unwrap(),
                "patch",
                "--base",
                base.to_str().unwrap(),
                "--node",
                "cp-01",
                "--out",
                node.to_str().unwrap(),
            ]);
            assert!(o.status.success(), "imgbuild patch: {}", text(&o.stderr));
            Disk { base, node }
        };
        Disks {
            signed: patch("signed"),
            unsigned: patch("unsigned"),
            wrong_key: patch("wrong-key"),
            key10: key10(&config, "cp-01"),
            dir,
        }
    })
}

/// The firmware's variable store after systemd-boot enrolled the test keys
/// in setup mode, and that boot.
struct Enrolled {
    vars: PathBuf,
    boot: Boot,
}

fn enrolled() -> &'static Enrolled {
    static E: OnceLock<Enrolled> = OnceLock::new();
    E.get_or_init(|| {
        let d = disks();
        let vars = d.dir.join("enrolled.vars.fd");
        std::fs::copy(BLANK_VARS, &vars).unwrap();
        // systemd-boot resets the machine after enrolling; -no-reboot ends
        // QEMU there.
        let boot = timed(realboot::boot(
            "enroll",
            &d.dir,
            Firmware::OvmfSecureBoot { vars: &vars },
            Medium::Nvme(&d.signed.node),
            &[],
        ));
        Enrolled { vars, boot }
    })
}

fn timed(b: Boot) -> Boot {
    eprintln!("{}: {:.1} s", b.name, b.secs);
    b
}

/// What systemd-boot prints when the firmware's LoadImage refuses the UKI.
const REFUSED: &str = "Error loading \\EFI\\Linux\\Talos-test.efi: Access Denied";

/// Boots `disk` under Secure Boot with the enrolled keys (a copy of the
/// store for this boot), stopping once the firmware refused the UKI or gave
/// the disk up.
fn boot_enrolled(name: &str, disk: &Path) -> Boot {
    let e = enrolled();
    let d = disks();
    let vars = d.dir.join(format!("{name}.vars.fd"));
    std::fs::copy(&e.vars, &vars).unwrap();
    timed(realboot::boot(
        name,
        &d.dir,
        Firmware::OvmfSecureBoot { vars: &vars },
        Medium::Nvme(disk),
        &[REFUSED, "BdsDxe: failed to start Boot0001"],
    ))
}

/// `(name, byte offset, byte length)` of each GPT partition, from sgdisk.
fn partitions(img: &Path) -> Vec<(String, u64, u64)> {
    let o = Command::new("sgdisk").arg("-p").arg(img).output().unwrap();
    assert!(o.status.success(), "sgdisk -p: {}", text(&o.stderr));
    text(&o.stdout)
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (first, last) = (
                f.get(1)?.parse::<u64>().ok()?,
                f.get(2)?.parse::<u64>().ok()?,
            );
            f.first()?.parse::<u32>().ok()?;
            Some((f.last()?.to_string(), first * 512, (last - first + 1) * 512))
        })
        .collect()
}

fn part(img: &Path, name: &str) -> (u64, u64) {
    partitions(img)
        .into_iter()
        .find(|p| p.0 == name)
        .map(|p| (p.1, p.2))
        .unwrap_or_else(|| panic!("{}: no partition {name}", img.display()))
}

fn bytes(img: &Path, (offset, len): (u64, u64)) -> Vec<u8> {
    use std::io::{Read, Seek};
    let mut f = std::fs::File::open(img).unwrap();
    f.seek(std::io::SeekFrom::Start(offset)).unwrap();
    let mut buf = vec![0; len as usize];
    f.read_exact(&mut buf).unwrap();
    buf
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// The DER bytes of a PEM certificate made by the fixture.
fn der(pem: &Path) -> Vec<u8> {
    use base64::Engine;
    let b64: String = std::fs::read_to_string(pem)
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with("-----"))
        .collect();
    base64::engine::general_purpose::STANDARD
        .decode(b64)
        .unwrap()
}

/// Whether an OVMF variable store holds a live variable `name` of the EFI
/// global (PK, KEK) or image security database (db) vendor GUID: an
/// authenticated variable header (edk2 `AUTHENTICATED_VARIABLE_HEADER`:
/// StartId 0x55AA, State, …, VendorGuid) whose name follows the GUID, with
/// State `VAR_ADDED` (0x3f) and not deleted.
fn has_variable(store: &[u8], name: &str) -> bool {
    // 8be4df61-93ca-11d2-aa0d-00e098032b8c and d719b2cb-3d3a-4596-a3bc-dad00e67656f.
    let guid: [u8; 16] = if name == "db" {
        [
            0xcb, 0xb2, 0x19, 0xd7, 0x3a, 0x3d, 0x96, 0x45, 0xa3, 0xbc, 0xda, 0xd0, 0x0e, 0x67,
            0x65, 0x6f,
        ]
    } else {
        [
            0x61, 0xdf, 0xe4, 0x8b, 0xca, 0x93, 0xd2, 0x11, 0xaa, 0x0d, 0x00, 0xe0, 0x98, 0x03,
            0x2b, 0x8c,
        ]
    };
    let mut tail: Vec<u8> = guid.to_vec();
    for c in name.encode_utf16().chain([0]) {
        tail.extend(c.to_le_bytes());
    }
    // StartId(2) State(1) Reserved(1) Attributes(4) MonotonicCount(8)
    // TimeStamp(16) PubKeyIndex(4) NameSize(4) DataSize(4): 44 bytes.
    (44..store.len().saturating_sub(tail.len())).any(|i| {
        store[i..i + tail.len()] == tail[..]
            && store[i - 44..i - 42] == [0xaa, 0x55]
            && store[i - 42] == 0x3f
    })
}

#[test]
fn the_patch_keeps_the_efi_partition_byte_identical_so_its_signatures_hold() {
    if realboot::skipped() {
        return;
    }
    let d = disks();
    for disk in [&d.signed, &d.unsigned, &d.wrong_key] {
        let (base, node) = (&disk.base, &disk.node);
        let v = Command::new("sgdisk").arg("-v").arg(node).output().unwrap();
        assert!(
            text(&v.stdout).contains("No problems found"),
            "{}: sgdisk -v: {}",
            node.display(),
            text(&v.stdout)
        );
        assert_eq!(partitions(base), partitions(node), "the GPT is unchanged");
        let esp = part(base, "EFI");
        assert!(
            bytes(base, esp) == bytes(node, esp),
            "{}: the EFI partition changed",
            node.display()
        );
        // Every byte outside META is the base's.
        let (meta_at, meta_len) = part(base, "META");
        let (a, b) = (std::fs::read(base).unwrap(), std::fs::read(node).unwrap());
        assert_eq!(a.len(), b.len());
        let m = meta_at as usize..(meta_at + meta_len) as usize;
        assert!(a[..m.start] == b[..m.start] && a[m.end..] == b[m.end..]);
        // META now holds an ADV (magic 0x5a4b3c2d) whose key 10 is the node's.
        assert!(
            a[m.clone()].iter().all(|&x| x == 0),
            "the base's META is empty"
        );
        assert_eq!(b[m.start..m.start + 4], [0x5a, 0x4b, 0x3c, 0x2d]);
        assert!(contains(&b[m.clone()], d.key10.as_bytes()));
    }
    // The signatures inside the patched disk's ESP still verify against db.
    let node = &d.signed.node;
    let (esp_at, _) = part(node, "EFI");
    for (file, out) in [
        ("::/EFI/BOOT/BOOTX64.EFI", "patched-sd-boot.efi"),
        ("::/EFI/Linux/Talos-test.efi", "patched-uki.efi"),
    ] {
        let out = d.dir.join(out);
        let o = Command::new("mcopy")
            .arg("-o")
            .arg("-i")
            .arg(format!("{}@@{esp_at}", node.display()))
            .arg(file)
            .arg(&out)
            .output()
            .unwrap();
        assert!(o.status.success(), "mcopy {file}: {}", text(&o.stderr));
        let o = Command::new("sbverify")
            .arg("--cert")
            .arg(d.dir.join("keys/db.crt"))
            .arg(&out)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{file} no longer verifies against db: {}{}",
            text(&o.stdout),
            text(&o.stderr)
        );
    }
}

#[test]
fn setup_mode_firmware_enrolls_the_test_keys_from_the_esp() {
    if realboot::skipped() {
        return;
    }
    let blank = std::fs::read(BLANK_VARS).unwrap();
    assert!(
        !has_variable(&blank, "PK"),
        "{BLANK_VARS} holds a PK: not setup mode"
    );
    let d = disks();
    let e = enrolled();
    assert!(
        e.boot
            .serial
            .contains("Enrolling secure boot keys from directory: \\loader\\keys\\auto"),
        "systemd-boot did not enroll; serial output:\n{}",
        e.boot.serial
    );
    assert!(
        e.boot.cmdline.is_none(),
        "the enrolling boot resets before any kernel runs"
    );
    let store = std::fs::read(&e.vars).unwrap();
    for k in ["PK", "KEK", "db"] {
        assert!(has_variable(&store, k), "no {k} after enrollment");
        assert!(
            contains(&store, &der(&d.dir.join(format!("keys/{k}.crt")))),
            "the test {k} certificate is not in the store"
        );
    }
    assert!(!contains(&store, &der(&d.dir.join("keys/other.crt"))));
}

#[test]
fn the_signed_uki_boots_from_the_patched_disk_under_secure_boot_with_a_tpm() {
    if realboot::skipped() {
        return;
    }
    let d = disks();
    let b = boot_enrolled("signed", &d.signed.node);
    assert_eq!(
        b.args().join(" "),
        CMDLINE,
        "the kernel runs with the UKI's signed command line"
    );
    let facts = b.facts();
    assert!(
        facts
            .secure_boot
            .iter()
            .any(|l| l.contains("secureboot: Secure boot enabled")),
        "the kernel did not see Secure Boot on: {:?}",
        facts.secure_boot
    );
    let pcr = |n: u32| facts.pcrs.iter().find(|p| p.0 == n).map(|p| p.1.as_str());
    for n in [7, 11] {
        let v = pcr(n).unwrap_or_else(|| panic!("no TPM PCR {n}: {:?}", facts.pcrs));
        assert!(
            v.len() == 64 && v.chars().any(|c| c != '0'),
            "PCR {n} = {v}: nothing measured"
        );
    }
    let meta = part(&d.signed.node, "META");
    let head = facts.meta_head.expect("the kernel found no META partition");
    assert!(
        head == bytes(&d.signed.node, (meta.0, 4096)),
        "the booted kernel reads imgbuild's META from its disk"
    );
    assert!(contains(&head, d.key10.as_bytes()));
}

/// Asserts that the firmware refused the UKI on `disk` and nothing booted.
fn assert_refused(name: &str, disk: &Path) {
    let b = boot_enrolled(name, disk);
    assert!(
        b.serial.contains(REFUSED),
        "{name}: the firmware did not refuse the UKI; serial output:\n{}",
        b.serial
    );
    assert!(b.cmdline.is_none(), "{name}: a kernel ran");
}

#[test]
fn an_unsigned_uki_is_refused_by_the_firmware() {
    if realboot::skipped() {
        return;
    }
    assert_refused("unsigned", &disks().unsigned.node);
}

#[test]
fn a_uki_signed_with_a_key_not_in_db_is_refused_by_the_firmware() {
    if realboot::skipped() {
        return;
    }
    assert_refused("wrong-key", &disks().wrong_key.node);
}
