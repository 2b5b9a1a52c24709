//! The factory double's ISOs (siderolabs/talos `pkg/imager/iso`): simulated
//! ones, and real ones (grub-mkrescue, dual-boot with a UKI from Talos
//! v1.10) when the factory has a real kernel.

use super::cmdline::*;
use super::state::*;
use super::uki::*;

/// The volume date of every simulated ISO (`YYYYMMDDhhmmsscc`): GRUB's EFI
/// image finds its root by the UUID made of it, so a remaster must keep it.
pub(crate) const ISO_VOLUME_DATE: &str = "2025061210203000";

/// A small ISO in the layout of siderolabs/talos `pkg/imager/iso/grub.go`
/// and `grub.cfg`: `/boot/vmlinuz`, `/boot/initramfs.xz`, a
/// `/boot/grub/grub.cfg` whose menu entries boot the kernel with the
/// schematic's command line (META included), and El Torito BIOS and EFI
/// boot images (dummy files here) as grub-mkrescue lays them out, hybrid
/// (GPT with the EFI image as a partition).
pub(crate) fn make_iso(
    out: &std::path::Path,
    cmdline: &str,
    version: &str,
    arch: &str,
) -> anyhow::Result<()> {
    let tree = out.with_extension("tree");
    let _ = std::fs::remove_dir_all(&tree);
    let boot = tree.join("boot");
    std::fs::create_dir_all(boot.join("grub/i386-pc"))?;
    let kernel =
        simulated_kernel(version, arch).ok_or_else(|| anyhow::anyhow!("no kernel for {arch}"))?;
    std::fs::write(boot.join("vmlinuz"), kernel)?;
    std::fs::write(
        boot.join("initramfs.xz"),
        format!("simulated initramfs {version} {arch}"),
    )?;
    std::fs::write(boot.join("grub/i386-pc/eltorito.img"), [0xEBu8; 2048])?;
    std::fs::write(boot.join("grub/efi.img"), vec![0xF6u8; 64 << 10])?;
    std::fs::write(boot.join("grub/grub.cfg"), grub_cfg(cmdline))?;
    let _ = std::fs::remove_file(out);
    let o = std::process::Command::new("xorriso")
        .args(["-as", "mkisofs", "-R", "-iso-level", "3", "-V", "TALOS"])
        .args(["-b", "boot/grub/i386-pc/eltorito.img", "-no-emul-boot"])
        .args(["-boot-load-size", "4", "-boot-info-table"])
        .args([
            "-eltorito-alt-boot",
            "-e",
            "boot/grub/efi.img",
            "-no-emul-boot",
        ])
        // Hybrid as grub-mkrescue makes it: the EFI image also a GPT
        // partition, behind a protective MBR.
        .args([
            "-efi-boot-part",
            "--efi-boot-image",
            "--protective-msdos-label",
        ])
        .arg(format!("--modification-date={ISO_VOLUME_DATE}"))
        .arg("-o")
        .arg(out)
        .arg(&tree)
        .output()?;
    std::fs::remove_dir_all(&tree)?;
    anyhow::ensure!(
        o.status.success(),
        "xorriso failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    Ok(())
}

/// The GRUB menu of siderolabs/talos `pkg/imager/iso/grub.cfg`, filled.
pub(crate) fn grub_cfg(cmdline: &str) -> String {
    format!(
        "set default=0\nset timeout=3\n\ninsmod all_video\n\nterminal_input console\nterminal_output console\n\n\
         menuentry \"Talos ISO\" {{\n\tset gfxmode=auto\n\tset gfxpayload=text\n\tlinux /boot/vmlinuz {cmdline}\n\tinitrd /boot/initramfs.xz\n}}\n\n\
         menuentry \"Reset Talos installation\" {{\n\tset gfxmode=auto\n\tset gfxpayload=text\n\tlinux /boot/vmlinuz {cmdline} talos.experimental.wipe=system\n\tinitrd /boot/initramfs.xz\n}}\n"
    )
}

/// Whether Talos `version` makes the dual-boot ISO for `schematic`: from
/// v1.10 the default ISO boots GRUB on BIOS and a UKI on UEFI, and
/// `customization.bootloader: grub` makes a GRUB-only ISO from v1.12 on
/// (`quirks.ISOSupportsSettingBootloader`, siderolabs/talos
/// `pkg/imager/profile/output.go`, `pkg/imager/iso/`).
pub(crate) fn dual_boot_iso(version: &str, schematic: &SchematicShape) -> bool {
    let v = talos_version(version);
    v >= (1, 10, 0) && !(v >= (1, 12, 0) && schematic.customization.bootloader == "grub")
}

/// A bootable ISO of the real kernel and initramfs, made as Talos makes
/// its own: grub-mkrescue over `/boot/vmlinuz`, `/boot/initramfs.xz` and
/// the `grub.cfg` above; the dual-boot kind has GRUB for BIOS only and, in
/// an appended EFI system partition, `EFI/BOOT/BOOTX64.EFI`: a UKI with
/// `cmdline` baked in.
pub(crate) fn real_iso(
    real: &RealBoot,
    out: &std::path::Path,
    cmdline: &str,
    version: &str,
    schematic: &SchematicShape,
) -> anyhow::Result<()> {
    let tree = out.with_extension("tree");
    let _ = std::fs::remove_dir_all(&tree);
    std::fs::create_dir_all(tree.join("boot/grub"))?;
    std::fs::copy(&real.kernel, tree.join("boot/vmlinuz"))?;
    std::fs::copy(&real.initramfs, tree.join("boot/initramfs.xz"))?;
    std::fs::write(tree.join("boot/grub/grub.cfg"), grub_cfg(cmdline))?;
    let (uki, esp) = (out.with_extension("uki"), out.with_extension("esp"));
    let mut cmd = std::process::Command::new("grub-mkrescue");
    cmd.arg("-o").arg(out);
    let stub = real
        .uki_stub
        .as_ref()
        .filter(|_| dual_boot_iso(version, schematic));
    if let Some(stub) = stub {
        make_uki(stub, &real.kernel, &real.initramfs, cmdline, &uki)?;
        make_esp(&uki, &esp)?;
        // GRUB for BIOS only; UEFI firmware boots the appended partition.
        cmd.args(["-d", "/usr/lib/grub/i386-pc"])
            .arg(&tree)
            .args(["--", "-append_partition", "2", "0xef"])
            .arg(&esp)
            .args(["-boot_image", "any", "next"])
            .args([
                "-boot_image",
                "any",
                "efi_path=--interval:appended_partition_2:all::",
            ]);
    } else {
        cmd.arg(&tree);
    }
    let o = cmd.output();
    let _ = std::fs::remove_dir_all(&tree);
    let _ = std::fs::remove_file(&uki);
    let _ = std::fs::remove_file(&esp);
    let o = o?;
    anyhow::ensure!(
        o.status.success(),
        "grub-mkrescue failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    Ok(())
}
