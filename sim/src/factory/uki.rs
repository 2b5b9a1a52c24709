//! Unified kernel images for the factory double (siderolabs/talos
//! `pkg/imager/uki`): a UKI made with systemd's EFI stub, signed with the
//! factory's Secure Boot keys, and an ESP that holds it; the PE reading the
//! ISO needs.

use super::cmdline::*;
use super::state::*;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use std::path::PathBuf;
use std::sync::Arc;

pub(crate) fn le(b: &[u8], at: usize, n: usize) -> anyhow::Result<u64> {
    let bytes = b
        .get(at..at + n)
        .ok_or_else(|| anyhow::anyhow!("PE header cut short at {at}"))?;
    Ok(bytes.iter().rev().fold(0, |v, &x| (v << 8) | u64::from(x)))
}

/// The first address past the sections of a PE32+ image (PE/COFF: the
/// optional header's ImageBase plus each section's VirtualAddress and
/// VirtualSize): where a UKI's own sections may start.
pub(crate) fn pe_end(image: &[u8]) -> anyhow::Result<u64> {
    let pe = le(image, 0x3c, 4)? as usize;
    anyhow::ensure!(image.get(pe..pe + 4) == Some(b"PE\0\0"), "not a PE image");
    let coff = pe + 4;
    let sections = le(image, coff + 2, 2)? as usize;
    let optional = coff + 20;
    anyhow::ensure!(le(image, optional, 2)? == 0x20b, "not PE32+");
    let base = le(image, optional + 24, 8)?;
    let table = optional + le(image, coff + 16, 2)? as usize;
    let mut end = 0;
    for i in 0..sections {
        let s = table + 40 * i;
        end = end.max(le(image, s + 12, 4)? + le(image, s + 8, 4)?);
    }
    Ok(base + end)
}

/// The systemd EFI stub a UKI is built on when the factory has no real
/// one (the Debian `systemd-boot-efi` package's).
pub(crate) const SYSTEM_UKI_STUB: &str = "/usr/lib/systemd/boot/efi/linuxx64.efi.stub";

/// The factory's Secure Boot signing key and certificate, made on first
/// use (image-factory signs every Secure Boot asset with its own key,
/// `internal/secureboot`, and serves the certificate).
pub(crate) fn signing_pair(sim: &Sim) -> anyhow::Result<(PathBuf, PathBuf)> {
    let (key, cert) = (
        sim.state.join("secureboot-signing.key"),
        sim.state.join("secureboot-signing.pem"),
    );
    if cert.exists() {
        return Ok((key, cert));
    }
    let (tmp_key, tmp_cert) = (
        key.with_extension("key.tmp"),
        cert.with_extension("pem.tmp"),
    );
    let o = std::process::Command::new("openssl")
        .args([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650",
        ])
        .args([
            "-subj",
            "/CN=imgbuild-sim image factory Secure Boot signing",
        ])
        .arg("-keyout")
        .arg(&tmp_key)
        .arg("-out")
        .arg(&tmp_cert)
        .output()?;
    anyhow::ensure!(
        o.status.success(),
        "openssl req failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    std::fs::rename(&tmp_key, &key)?;
    std::fs::rename(&tmp_cert, &cert)?;
    Ok((key, cert))
}

/// `GET /secureboot/signing-cert.pem` (siderolabs/image-factory
/// `internal/frontend/http/secureboot.go`): the certificate whose key signs
/// the Secure Boot assets, `application/x-pem-file`.
pub(crate) async fn signing_cert(State(sim): State<Arc<Sim>>) -> Response {
    let _guard = sim.build.lock().await;
    match signing_pair(&sim).and_then(|(_, cert)| Ok(std::fs::read(cert)?)) {
        Ok(pem) => ([(header::CONTENT_TYPE, "application/x-pem-file")], pem).into_response(),
        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

/// `<platform>-<arch>-secureboot-uki.efi` (image-factory
/// `internal/frontend/http/image.go`, the imager's `OutKindUKI`): the UKI
/// with the schematic's command line (META included) baked in, signed
/// with the factory's key (sbsign), per architecture.
pub(crate) fn signed_uki(
    sim: &Sim,
    schematic: &SchematicShape,
    id: &str,
    version: &str,
    platform: &str,
    arch: &str,
) -> anyhow::Result<PathBuf> {
    let dir = sim.state.join(id).join(version);
    std::fs::create_dir_all(&dir)?;
    let out = dir.join(format!("{platform}-{arch}-secureboot-uki.efi"));
    if out.exists() {
        return Ok(out);
    }
    let (key, cert) = signing_pair(sim)?;
    let real = sim.real.as_ref().filter(|_| arch == "amd64");
    let stub = real
        .and_then(|r| r.uki_stub.clone())
        .or_else(|| sim.real.as_ref().and_then(|r| r.uki_stub.clone()))
        .unwrap_or_else(|| PathBuf::from(SYSTEM_UKI_STUB));
    let (kernel, initramfs) = match real {
        Some(r) => (r.kernel.clone(), r.initramfs.clone()),
        None => {
            let kernel = dir.join(format!(".kernel-{arch}"));
            let k = simulated_kernel(version, arch)
                .ok_or_else(|| anyhow::anyhow!("no kernel for {arch}"))?;
            std::fs::write(&kernel, k)?;
            let initramfs = dir.join(format!(".initramfs-{arch}"));
            std::fs::write(
                &initramfs,
                format!("070701 simulated initramfs {version} {arch}\n"),
            )?;
            (kernel, initramfs)
        }
    };
    let cmdline = cmdline(sim, schematic, version, platform, arch);
    let unsigned = dir.join(format!(".{platform}-{arch}-uki.unsigned"));
    make_uki(&stub, &kernel, &initramfs, &cmdline, &unsigned)?;
    let tmp = out.with_extension("efi.tmp");
    let o = std::process::Command::new("sbsign")
        .arg("--key")
        .arg(&key)
        .arg("--cert")
        .arg(&cert)
        .arg("--output")
        .arg(&tmp)
        .arg(&unsigned)
        .output()?;
    let _ = std::fs::remove_file(&unsigned);
    anyhow::ensure!(
        o.status.success(),
        "sbsign failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    std::fs::rename(&tmp, &out)?;
    Ok(out)
}

/// A UKI (systemd's `ukify` layout): the EFI stub with `.cmdline`, `.initrd`
/// and `.linux` sections added past its own, page-aligned, by objcopy.
pub(crate) fn make_uki(
    stub: &std::path::Path,
    kernel: &std::path::Path,
    initramfs: &std::path::Path,
    cmdline: &str,
    out: &std::path::Path,
) -> anyhow::Result<()> {
    let align = |n: u64| n.div_ceil(4096) * 4096;
    let cmdline_file = out.with_extension("cmdline");
    std::fs::write(&cmdline_file, cmdline)?;
    let mut at = align(pe_end(&std::fs::read(stub)?)?);
    let mut cmd = std::process::Command::new("objcopy");
    for (name, file) in [
        (".cmdline", cmdline_file.as_path()),
        (".initrd", initramfs),
        (".linux", kernel),
    ] {
        cmd.arg("--add-section")
            .arg(format!("{name}={}", file.display()))
            .arg("--change-section-vma")
            .arg(format!("{name}={at:#x}"));
        at = align(at + std::fs::metadata(file)?.len());
    }
    let o = cmd.arg(stub).arg(out).output();
    let _ = std::fs::remove_file(&cmdline_file);
    let o = o?;
    anyhow::ensure!(
        o.status.success(),
        "objcopy failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    Ok(())
}

/// A FAT EFI system partition image holding `uki` as the removable-media
/// boot file `EFI/BOOT/BOOTX64.EFI` (mtools).
pub(crate) fn make_esp(uki: &std::path::Path, out: &std::path::Path) -> anyhow::Result<()> {
    let sectors = (std::fs::metadata(uki)?.len() + (2 << 20)).div_ceil(512);
    let _ = std::fs::remove_file(out);
    std::fs::File::create(out)?.set_len(sectors * 512)?;
    let img = out.to_string_lossy().into_owned();
    let steps: [Vec<String>; 3] = [
        [
            "mformat",
            "-i",
            &img,
            "-T",
            &sectors.to_string(),
            "-h",
            "64",
            "-s",
            "32",
            "::",
        ]
        .map(str::to_owned)
        .to_vec(),
        ["mmd", "-i", &img, "::/EFI", "::/EFI/BOOT"]
            .map(str::to_owned)
            .to_vec(),
        vec![
            "mcopy".into(),
            "-i".into(),
            img.clone(),
            uki.to_string_lossy().into_owned(),
            "::/EFI/BOOT/BOOTX64.EFI".into(),
        ],
    ];
    for step in steps {
        let o = std::process::Command::new(&step[0])
            .args(&step[1..])
            .output()?;
        anyhow::ensure!(
            o.status.success(),
            "{} failed: {}",
            step[0],
            String::from_utf8_lossy(&o.stderr)
        );
    }
    Ok(())
}
