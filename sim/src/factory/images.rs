//! The factory double's image endpoint (siderolabs/image-factory
//! `internal/frontend/http/image.go`, `pkg/imager` for the outputs): which
//! image a file name asks for, building it from the base disk with META and
//! kernel arguments, PXE assets, and serving the bytes with `Range` and the
//! body misbehaviours.

use super::cmdline::*;
use super::iso::*;
use super::state::*;
use super::uki::*;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::StreamExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncSeekExt};

pub(crate) async fn image(
    State(sim): State<Arc<Sim>>,
    method: Method,
    headers: HeaderMap,
    Path((id, version, file)): Path<(String, String, String)>,
) -> Response {
    let Some(Posted { schematic, .. }) = sim.schematics.lock().unwrap().get(&id).cloned() else {
        return text(StatusCode::NOT_FOUND, "schematic not found");
    };
    if !sim.versions.contains(&version) {
        return text(StatusCode::NOT_FOUND, "version not found");
    }
    for ext in &schematic
        .customization
        .system_extensions
        .official_extensions
    {
        if !sim.extensions.contains(ext) {
            return text(
                StatusCode::BAD_REQUEST,
                format!("extension {ext} is not available for version {version}"),
            );
        }
    }
    if let Some(stem) = file.strip_suffix("-secureboot-uki.efi") {
        let Some((platform, arch)) = stem
            .rsplit_once('-')
            .filter(|(p, a)| !p.is_empty() && matches!(*a, "amd64" | "arm64"))
        else {
            return text(StatusCode::BAD_REQUEST, format!("invalid path {file}"));
        };
        let _guard = sim.build.lock().await;
        let built = signed_uki(&sim, &schematic, &id, &version, platform, arch);
        return match built.and_then(|p| Ok(std::fs::read(p)?)) {
            Ok(bytes) => {
                if method == Method::GET {
                    *sim.image_gets
                        .lock()
                        .unwrap()
                        .entry(format!("/image/{id}/{version}/{file}"))
                        .or_default() += 1;
                }
                ([(header::CONTENT_TYPE, "application/octet-stream")], bytes).into_response()
            }
            Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        };
    }
    if let Some(asset) = boot_asset(&sim, &schematic, &version, &file) {
        if method == Method::GET {
            *sim.image_gets
                .lock()
                .unwrap()
                .entry(format!("/image/{id}/{version}/{file}"))
                .or_default() += 1;
        }
        return asset;
    }
    // `internal/profile/profile.go`: an enrollKeys value the imager does not
    // know is an invalid request, for Secure Boot assets only.
    let enroll = &schematic.customization.secure_boot.enroll_keys;
    if is_secure_boot(&file)
        && !enroll.is_empty()
        && !["off", "manual", "if-safe", "force"].contains(&enroll.as_str())
    {
        return text(
            StatusCode::BAD_REQUEST,
            format!("invalid secureboot enrollKeys value {enroll:?}"),
        );
    }
    let Some(kind) = image_kind(&file) else {
        return text(
            StatusCode::BAD_REQUEST,
            format!("invalid image path {file}"),
        );
    };
    let path = format!("/image/{id}/{version}/{file}");
    if method == Method::GET {
        *sim.image_gets
            .lock()
            .unwrap()
            .entry(path.clone())
            .or_default() += 1;
        if let Some(mode) = take_mode(&sim, &["not-found-200", "html-200", "5xx", "redirect"]) {
            return match mode.as_str() {
                "not-found-200" => text(StatusCode::OK, "Not Found"),
                "html-200" => (
                    StatusCode::OK,
                    [(header::CONTENT_TYPE, "text/html")],
                    "<!DOCTYPE html><html><body><h1>502 Bad Gateway</h1></body></html>",
                )
                    .into_response(),
                "5xx" => text(StatusCode::SERVICE_UNAVAILABLE, "upstream unavailable"),
                _ => match &sim.alt_url {
                    Some(alt) => (
                        StatusCode::FOUND,
                        [(header::LOCATION, format!("{alt}{path}"))],
                    )
                        .into_response(),
                    None => text(StatusCode::INTERNAL_SERVER_ERROR, "internal server error"),
                },
            };
        }
    }
    let built = {
        let _one_build_at_a_time = sim.build.lock().await;
        let sim = sim.clone();
        let (id, version, file) = (id.clone(), version.clone(), file.clone());
        tokio::task::spawn_blocking(move || build(&sim, &schematic, &id, &version, &file, kind))
            .await
    };
    let built = match built {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => {
            return text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("internal server error: {e:#}"),
            );
        }
        Err(e) => {
            return text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("internal server error: {e}"),
            );
        }
    };
    serve(&sim, &built, kind, method, &headers).await
}

/// The PXE assets of siderolabs/image-factory `internal/frontend/http/image.go`:
/// `kernel-<arch>`, `initramfs-<arch>.xz` and `cmdline-<platform>-<arch>`.
/// The kernel depends on the version only and the initramfs on the
/// extensions too, never on META (`internal/profile/profile.go` puts META
/// on the command line of boot assets instead, as `buildCmdline` in
/// siderolabs/talos `pkg/imager/imager.go` does).
pub(crate) fn boot_asset(
    sim: &Sim,
    schematic: &SchematicShape,
    version: &str,
    file: &str,
) -> Option<Response> {
    let bytes = |body: Vec<u8>| {
        ([(header::CONTENT_TYPE, "application/octet-stream")], body).into_response()
    };
    if let Some(real) = &sim.real {
        let path = match file {
            "kernel-amd64" => Some(&real.kernel),
            "initramfs-amd64.xz" => Some(&real.initramfs),
            _ => None,
        };
        if let Some(path) = path {
            return Some(match std::fs::read(path) {
                Ok(b) => bytes(b),
                Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
            });
        }
    }
    if let Some(arch) = file.strip_prefix("kernel-") {
        return Some(match simulated_kernel(version, arch) {
            Some(k) => bytes(k),
            None => text(
                StatusCode::BAD_REQUEST,
                format!("invalid kernel path {file}"),
            ),
        });
    }
    if let Some(arch) = file
        .strip_prefix("initramfs-")
        .and_then(|f| f.strip_suffix(".xz"))
    {
        if !["amd64", "arm64"].contains(&arch) {
            return Some(text(
                StatusCode::BAD_REQUEST,
                format!("invalid path {file}"),
            ));
        }
        let mut listing = format!("070701 simulated initramfs {version} {arch}\n");
        for ext in &schematic
            .customization
            .system_extensions
            .official_extensions
        {
            listing.push_str(&format!("extension {ext}\n"));
        }
        listing.push_str(&"\0".repeat(64 << 10));
        let mut xz = Vec::new();
        let mut enc = liblzma::read::XzEncoder::new(listing.as_bytes(), 6);
        std::io::Read::read_to_end(&mut enc, &mut xz).expect("xz in memory");
        return Some(bytes(xz));
    }
    let (platform, arch) = file.strip_prefix("cmdline-")?.rsplit_once('-')?;
    Some(text(
        StatusCode::OK,
        cmdline(sim, schematic, version, platform, arch),
    ))
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Raw,
    RawZst,
    RawXz,
    RawGz,
    Qcow2,
    Iso,
}

pub(crate) fn image_kind(file: &str) -> Option<Kind> {
    let (stem, kind) = if let Some(s) = file.strip_suffix(".raw.zst") {
        (s, Kind::RawZst)
    } else if let Some(s) = file.strip_suffix(".raw.xz") {
        (s, Kind::RawXz)
    } else if let Some(s) = file.strip_suffix(".raw.gz") {
        (s, Kind::RawGz)
    } else if let Some(s) = file.strip_suffix(".raw") {
        (s, Kind::Raw)
    } else if let Some(s) = file.strip_suffix(".qcow2") {
        (s, Kind::Qcow2)
    } else if let Some(s) = file.strip_suffix(".iso") {
        (s, Kind::Iso)
    } else {
        return None;
    };
    let stem = stem.strip_suffix("-secureboot").unwrap_or(stem);
    let (platform, arch) = stem.rsplit_once('-')?;
    (!platform.is_empty() && matches!(arch, "amd64" | "arm64")).then_some(kind)
}

/// Whether an image path asks for a Secure Boot asset
/// (`metal-amd64-secureboot.raw.xz`, siderolabs/talos `pkg/imager/profile`
/// output names: `-secureboot` after the architecture).
pub(crate) fn is_secure_boot(file: &str) -> bool {
    file.split('.')
        .next()
        .is_some_and(|stem| stem.ends_with("-secureboot"))
}

/// The platform and architecture an image path names
/// (`metal-amd64-secureboot.raw.xz` → `metal`, `amd64`).
pub(crate) fn platform_arch(file: &str) -> (&str, &str) {
    let stem = file.split('.').next().unwrap_or(file);
    let stem = stem.strip_suffix("-secureboot").unwrap_or(stem);
    stem.rsplit_once('-').unwrap_or((stem, "amd64"))
}

/// Builds (once) the image for a schematic: the base with its META, then
/// compressed or converted as the path asks.
pub(crate) fn build(
    sim: &Sim,
    schematic: &SchematicShape,
    id: &str,
    version: &str,
    file: &str,
    kind: Kind,
) -> anyhow::Result<PathBuf> {
    let dir = sim.state.join(id).join(version);
    std::fs::create_dir_all(&dir)?;
    let out = dir.join(file);
    if out.exists() {
        return Ok(out);
    }
    let secure_boot = is_secure_boot(file);
    // One disk per architecture (their layouts differ), not one per
    // schematic and version.
    let (_, disk_arch) = platform_arch(file);
    let raw = dir.join(if secure_boot {
        format!("disk-secureboot-{disk_arch}.raw")
    } else {
        format!("disk-{disk_arch}.raw")
    });
    if secure_boot && kind != Kind::Iso && !raw.exists() {
        let tmp = dir.join(format!(".disk-secureboot-{disk_arch}.raw.tmp"));
        let enroll = &schematic.customization.secure_boot.enroll_keys;
        let real = sim.real.as_ref().map(|r| {
            (
                r.kernel.as_path(),
                r.initramfs.as_path(),
                r.uki_stub.as_deref(),
            )
        });
        let (platform, arch) = platform_arch(file);
        let cmdline = cmdline(sim, schematic, version, platform, arch);
        crate::factory::secureboot_disk::make(&tmp, arch, version, enroll, &cmdline, real)?;
        let mut tags: Vec<(u32, Vec<u8>)> = Vec::new();
        // Talos v1.10+ images record their bootloader in META key 17
        // (DiskImageBootloader); a Secure Boot image boots sd-boot.
        if talos_version(version) >= (1, 10, 0) {
            tags.push((17, b"sd-boot".to_vec()));
        }
        tags.extend(
            schematic
                .customization
                .meta
                .iter()
                .map(|m| (u32::from(m.key), m.value.clone().into_bytes())),
        );
        if !tags.is_empty() {
            crate::disk::merge_meta(&tmp, &tags)?;
        }
        std::fs::rename(&tmp, &raw)?;
    }
    // An ISO is made from the boot assets, not from the disk.
    if kind != Kind::Iso && !raw.exists() {
        let tags: Vec<(u32, Vec<u8>)> = schematic
            .customization
            .meta
            .iter()
            .map(|m| (u32::from(m.key), m.value.clone().into_bytes()))
            .collect();
        let tmp = dir.join(format!(".disk-{disk_arch}.raw.tmp"));
        crate::disk::sparse_copy(&sim.base, &tmp)?;
        // An arm64 image has no BIOS boot partition (the imager installs
        // GRUB's i386-pc core on amd64 only, siderolabs/talos
        // `internal/pkg/partition`, `pkg/imager`).
        if disk_arch == "arm64" {
            drop_partition(&tmp, "BIOS")?;
        }
        // The imager writes META only for a schematic's `meta` values: an
        // image without them is the base as the installer left it.
        if !tags.is_empty() {
            crate::disk::merge_meta(&tmp, &tags)?;
        }
        std::fs::rename(&tmp, &raw)?;
    }
    let tmp = dir.join(format!(".{file}.tmp"));
    match kind {
        Kind::Raw => return Ok(raw),
        Kind::RawZst => {
            let mut enc = zstd::Encoder::new(std::fs::File::create(&tmp)?, 3)?;
            std::io::copy(&mut std::fs::File::open(&raw)?, &mut enc)?;
            enc.finish()?;
        }
        Kind::RawXz => {
            let stream = liblzma::stream::MtStreamBuilder::new()
                .threads(2)
                .preset(1)
                .block_size(8 << 20)
                .encoder()?;
            let mut enc =
                liblzma::write::XzEncoder::new_stream(std::fs::File::create(&tmp)?, stream);
            std::io::copy(&mut std::fs::File::open(&raw)?, &mut enc)?;
            enc.finish()?;
        }
        Kind::RawGz => {
            let mut enc = flate2::write::GzEncoder::new(
                std::fs::File::create(&tmp)?,
                flate2::Compression::fast(),
            );
            std::io::copy(&mut std::fs::File::open(&raw)?, &mut enc)?;
            enc.finish()?;
        }
        Kind::Qcow2 => {
            let st = std::process::Command::new("qemu-img")
                .args(["convert", "-f", "raw", "-O", "qcow2"])
                .arg(&raw)
                .arg(&tmp)
                .status()?;
            anyhow::ensure!(st.success(), "qemu-img convert failed");
        }
        Kind::Iso if secure_boot => {
            let enroll = &schematic.customization.secure_boot.enroll_keys;
            let real = sim.real.as_ref().map(|r| {
                (
                    r.kernel.as_path(),
                    r.initramfs.as_path(),
                    r.uki_stub.as_deref(),
                )
            });
            let (platform, arch) = platform_arch(file);
            let cmdline = cmdline(sim, schematic, version, platform, arch);
            crate::factory::secureboot_disk::make_iso(&tmp, arch, version, enroll, &cmdline, real)?;
        }
        Kind::Iso => {
            let stem = file.strip_suffix(".iso").unwrap_or(file);
            let (platform, arch) = stem.rsplit_once('-').unwrap_or((stem, "amd64"));
            let mut cmdline = cmdline(sim, schematic, version, platform, arch);
            // Talos ISOs from v1.8 halt when booted again once installed
            // (siderolabs/talos `pkg/imager/imager.go`:
            // `SupportsHaltIfInstalled`, ISO output only).
            if talos_version(version) >= (1, 8, 0) {
                cmdline.push_str(" talos.halt_if_installed=1");
            }
            match &sim.real {
                Some(real) => real_iso(real, &tmp, &cmdline, version, schematic)?,
                None => make_iso(&tmp, &cmdline, version, arch)?,
            }
        }
    }
    std::fs::rename(&tmp, &out)?;
    Ok(out)
}

/// `GET /pxe/{id}/{version}/{platform}-{arch}[-secureboot]`
/// (image-factory `internal/frontend/http/pxe.go`, `standard.ipxe`,
/// `secureboot.ipxe`): an iPXE script booting the kernel and initramfs with
/// the schematic's command line, or, for Secure Boot, the signed UKI alone
/// (its command line is inside it). URLs point back at this factory.
pub(crate) async fn pxe(
    State(sim): State<Arc<Sim>>,
    headers: HeaderMap,
    Path((id, version, path)): Path<(String, String, String)>,
) -> Response {
    let Some(Posted { schematic, .. }) = sim.schematics.lock().unwrap().get(&id).cloned() else {
        return text(StatusCode::NOT_FOUND, "schematic not found");
    };
    if !sim.versions.contains(&version) {
        return text(StatusCode::NOT_FOUND, "version not found");
    }
    let (stem, secure_boot) = match path.strip_suffix("-secureboot") {
        Some(stem) => (stem, true),
        None => (path.as_str(), false),
    };
    let Some((platform, arch)) = stem
        .rsplit_once('-')
        .filter(|(p, a)| !p.is_empty() && matches!(*a, "amd64" | "arm64"))
    else {
        return text(
            StatusCode::BAD_REQUEST,
            format!("error parsing profile from path: invalid path cmdline-{path}"),
        );
    };
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("localhost");
    let base = format!("http://{host}/image/{id}/{version}");
    let script = if secure_boot {
        format!("#!ipxe\n\nkernel {base}/{platform}-{arch}-secureboot-uki.efi\nboot\n")
    } else {
        let cmdline = cmdline(&sim, &schematic, &version, platform, arch);
        format!(
            "#!ipxe\n\nimgfree\nkernel {base}/kernel-{arch} {cmdline}\ninitrd {base}/initramfs-{arch}.xz\nboot\n"
        )
    };
    text(StatusCode::OK, script)
}

/// Deletes the GPT partition named `name` from `disk`, if it has one.
pub(crate) fn drop_partition(disk: &std::path::Path, name: &str) -> anyhow::Result<()> {
    let o = std::process::Command::new("sgdisk")
        .arg("-p")
        .arg(disk)
        .output()?;
    anyhow::ensure!(o.status.success(), "sgdisk -p failed");
    let listing = String::from_utf8_lossy(&o.stdout);
    let number = listing.lines().find_map(|l| {
        let cols: Vec<&str> = l.split_whitespace().collect();
        (cols.last() == Some(&name) && cols.first().is_some_and(|n| n.parse::<u32>().is_ok()))
            .then(|| cols[0].to_owned())
    });
    if let Some(n) = number {
        let st = std::process::Command::new("sgdisk")
            .arg(format!("--delete={n}"))
            .arg(disk)
            .output()?;
        anyhow::ensure!(
            st.status.success(),
            "sgdisk --delete failed: {}",
            String::from_utf8_lossy(&st.stderr)
        );
    }
    Ok(())
}

/// Serves a built file, honouring `Range: bytes=N-` (for resumed downloads)
/// and the misbehaviours that act on the body.
pub(crate) async fn serve(
    sim: &Sim,
    path: &std::path::Path,
    kind: Kind,
    method: Method,
    headers: &HeaderMap,
) -> Response {
    let mut file = match tokio::fs::File::open(path).await {
        Ok(f) => f,
        Err(e) => {
            return text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("internal server error: {e}"),
            );
        }
    };
    let len = file.metadata().await.map(|m| m.len()).unwrap_or(0);
    let content_type = match kind {
        Kind::RawXz => "application/x-xz",
        Kind::RawGz => "application/gzip",
        Kind::Qcow2 => "application/x-qemu-disk",
        Kind::Iso => "application/x-iso9660-image",
        _ => "application/octet-stream",
    };
    let start = headers
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("bytes="))
        .and_then(|v| v.strip_suffix('-'))
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|&s| s < len);
    let mut builder = Response::builder()
        .header(header::CONTENT_TYPE, content_type)
        .header(header::ACCEPT_RANGES, "bytes");
    let (status, body_len) = match start {
        Some(s) => {
            builder = builder.header(
                header::CONTENT_RANGE,
                format!("bytes {s}-{}/{len}", len - 1),
            );
            (StatusCode::PARTIAL_CONTENT, len - s)
        }
        None => (StatusCode::OK, len),
    };
    if method == Method::HEAD {
        return builder
            .status(status)
            .header(header::CONTENT_LENGTH, body_len)
            .body(Body::empty())
            .unwrap();
    }
    if let Some(s) = start {
        let _ = file.seek(std::io::SeekFrom::Start(s)).await;
    }
    let mode = take_mode(sim, &["truncate", "wrong-length", "slow", "trailing"]);
    const GARBAGE: &[u8] = b"GARBAGE-GARBAGE!";
    let trailing = mode.as_deref() == Some("trailing");
    let announced = match mode.as_deref() {
        Some("wrong-length") => body_len / 2,
        Some("trailing") => body_len + GARBAGE.len() as u64,
        _ => body_len,
    };
    let cut = match mode.as_deref() {
        Some("truncate") => Some(body_len / 2),
        _ => None,
    };
    let delay = (mode.as_deref() == Some("slow")).then(|| Duration::from_millis(20));
    let chunk = if delay.is_some() { 64 * 1024 } else { 1 << 20 };
    let stream = futures_util::stream::unfold(
        (file, 0u64, false),
        move |(mut file, sent, done)| async move {
            if done {
                return None;
            }
            if cut.is_some_and(|c| sent >= c) {
                let err = std::io::Error::other("simulated connection reset");
                return Some((Err(err), (file, sent, true)));
            }
            if let Some(d) = delay {
                tokio::time::sleep(d).await;
            }
            // Never send past the cut point: the body must really end early.
            let room = cut.map_or(chunk as u64, |c| (c - sent).min(chunk as u64));
            let mut buf = vec![0u8; room as usize];
            match file.read(&mut buf).await {
                Ok(0) if trailing && sent == body_len => Some((
                    Ok(Bytes::from_static(GARBAGE)),
                    (file, sent + GARBAGE.len() as u64, true),
                )),
                Ok(0) => None,
                Ok(n) => {
                    buf.truncate(n);
                    Some((Ok(Bytes::from(buf)), (file, sent + n as u64, false)))
                }
                Err(e) => Some((Err(e), (file, sent, true))),
            }
        },
    )
    .boxed();
    builder
        .status(status)
        .header(header::CONTENT_LENGTH, announced)
        .body(Body::from_stream(stream))
        .unwrap()
}
