//! The factory double's Secure Boot disk image: the UKI-only layout the
//! Talos imager writes for a Secure Boot `image` output (siderolabs/talos
//! `cmd/installer/pkg/install/install.go` with `internal/pkg/partition`:
//! an EFI partition sized for UKIs, then META; no BIOS and no BOOT
//! partition, no GRUB). The EFI partition holds what the sd-boot
//! bootloader installs (`internal/app/machined/pkg/runtime/v1alpha1/
//! bootloader/sdboot/sdboot.go`, `pkg/imager/iso/uefi.go`):
//! systemd-boot as the removable-media loader, the UKI in `EFI/Linux`,
//! `loader/loader.conf` (with `secure-boot-enroll` when the schematic sets
//! `enrollKeys`) and the keys systemd-boot enrolls from
//! `loader/keys/auto` (`PK.auth`, `KEK.auth`, `db.auth`,
//! `pkg/machinery/constants`). Made with sgdisk and mtools, not with
//! imgbuild's code.

use std::path::Path;
use std::process::Command;

/// Total size of the simulated disk and of its EFI partition, in MiB
/// (scaled down like fixtures/make-images.sh; META is exactly 1 MiB).
const DISK_MIB: u64 = 32;
const EFI_MIB: u64 = 24;

fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let o = cmd.output()?;
    anyhow::ensure!(
        o.status.success(),
        "{:?} failed: {}",
        cmd.get_program(),
        String::from_utf8_lossy(&o.stderr)
    );
    Ok(())
}

/// Writes the Secure Boot disk image of Talos `version` to `out`. `real`
/// is the real kernel, initramfs and EFI stub when the factory has them:
/// the UKI is then a bootable one with `cmdline` baked in.
pub fn make(
    out: &Path,
    arch: &str,
    version: &str,
    enroll_keys: &str,
    cmdline: &str,
    real: Option<(&Path, &Path, Option<&Path>)>,
) -> anyhow::Result<()> {
    let _ = std::fs::remove_file(out);
    std::fs::File::create(out)?.set_len(DISK_MIB << 20)?;
    run(Command::new("sgdisk")
        .arg(format!("-n1:2048:+{EFI_MIB}M"))
        .args(["-t1:C12A7328-F81F-11D2-BA4B-00A0C93EC93B", "-c1:EFI"])
        .args([
            "-n2:0:+1M",
            "-t2:0FC63DAF-8483-4772-8E79-3D69D8477DE4",
            "-c2:META",
        ])
        .arg(out))?;
    esp_at(
        out,
        2048 * 512,
        EFI_MIB,
        arch,
        version,
        enroll_keys,
        cmdline,
        real,
    )
}

/// The Secure Boot ISO (`metal-amd64-secureboot.iso`, siderolabs/talos
/// `pkg/imager/iso/uefi.go`): UEFI only, an El Torito EFI image holding the
/// same EFI partition contents (systemd-boot, the UKI with the schematic's
/// command line, META included, signed into it; loader.conf; the keys to
/// enroll). No GRUB and no BIOS boot: the command line is only in the UKI.
pub fn make_iso(
    out: &Path,
    arch: &str,
    version: &str,
    enroll_keys: &str,
    cmdline: &str,
    real: Option<(&Path, &Path, Option<&Path>)>,
) -> anyhow::Result<()> {
    let tree = out.with_extension("tree");
    let _ = std::fs::remove_dir_all(&tree);
    std::fs::create_dir_all(&tree)?;
    let esp = tree.join("efiboot.img");
    std::fs::File::create(&esp)?.set_len(EFI_MIB << 20)?;
    let r = esp_at(&esp, 0, EFI_MIB, arch, version, enroll_keys, cmdline, real).and_then(|()| {
        run(Command::new("xorriso")
            .args([
                "-as",
                "mkisofs",
                "-V",
                "TALOS",
                "-e",
                "efiboot.img",
                "-no-emul-boot",
            ])
            .arg("-o")
            .arg(out)
            .arg(&tree))
    });
    let _ = std::fs::remove_dir_all(&tree);
    r
}

/// Formats a FAT file system of `mib` MiB at byte `offset` of `image` and
/// fills it as the sd-boot bootloader does.
#[allow(clippy::too_many_arguments)]
fn esp_at(
    image: &Path,
    offset: u64,
    mib: u64,
    arch: &str,
    version: &str,
    enroll_keys: &str,
    cmdline: &str,
    real: Option<(&Path, &Path, Option<&Path>)>,
) -> anyhow::Result<()> {
    let work = image.with_extension("esp.d");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work)?;
    let r = fill_esp(
        image,
        offset,
        mib,
        &work,
        arch,
        version,
        enroll_keys,
        cmdline,
        real,
    );
    let _ = std::fs::remove_dir_all(&work);
    r
}

#[allow(clippy::too_many_arguments)]
fn fill_esp(
    out: &Path,
    offset: u64,
    mib: u64,
    work: &Path,
    arch: &str,
    version: &str,
    enroll_keys: &str,
    cmdline: &str,
    real: Option<(&Path, &Path, Option<&Path>)>,
) -> anyhow::Result<()> {
    let uki = work.join("uki.efi");
    match real {
        Some((kernel, initramfs, Some(stub))) => {
            super::uki::make_uki(stub, kernel, initramfs, cmdline, &uki)?
        }
        _ => std::fs::write(
            &uki,
            format!("MZ simulated Talos {version} UKI (signed)\n.cmdline {cmdline}\n"),
        )?,
    }
    // The removable-media loader's name is per architecture (UEFI spec
    // 3.5.1.1): BOOTX64.efi on amd64, BOOTAA64.efi on arm64.
    let loader = if arch == "arm64" {
        "BOOTAA64.efi"
    } else {
        "BOOTX64.efi"
    };
    let sdboot = work.join(loader);
    std::fs::write(
        &sdboot,
        format!("MZ simulated systemd-boot {arch} (signed)\n"),
    )?;
    let mut conf = String::from("timeout 10\n");
    if !enroll_keys.is_empty() {
        conf.push_str(&format!("\nsecure-boot-enroll {enroll_keys}\n"));
    }
    let loader_conf = work.join("loader.conf");
    std::fs::write(&loader_conf, conf)?;
    let keys: Vec<(std::path::PathBuf, &str)> = ["PK.auth", "KEK.auth", "db.auth"]
        .into_iter()
        .map(|k| (work.join(k), k))
        .collect();
    for (path, name) in &keys {
        std::fs::write(
            path,
            format!("simulated {name} of the factory's Secure Boot keys\n"),
        )?;
    }
    let img = format!("{}@@{offset}", out.display());
    run(Command::new("mformat")
        .args(["-i", &img, "-T"])
        .arg(((mib << 20) / 512).to_string())
        .args(["-h", "64", "-s", "32", "-v", "EFI", "::"]))?;
    run(Command::new("mmd").args([
        "-i",
        &img,
        "::/EFI",
        "::/EFI/boot",
        "::/EFI/Linux",
        "::/loader",
        "::/loader/keys",
        "::/loader/keys/auto",
    ]))?;
    let mut copies: Vec<(std::path::PathBuf, String)> = vec![
        (sdboot, format!("::/EFI/boot/{loader}")),
        (uki, format!("::/EFI/Linux/Talos-{version}.efi")),
        (loader_conf, "::/loader/loader.conf".into()),
    ];
    copies.extend(
        keys.into_iter()
            .map(|(p, n)| (p, format!("::/loader/keys/auto/{n}"))),
    );
    for (from, to) in copies {
        run(Command::new("mcopy").args(["-i", &img]).arg(&from).arg(&to))?;
    }
    Ok(())
}
