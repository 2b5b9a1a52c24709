//! The Image Factory double: the HTTP API of siderolabs/image-factory
//! `internal/frontend/http` (`http.go`, `image.go`, `registry.go`), images
//! built from one Talos-shaped base with each schematic's META baked in, and
//! switches that make it misbehave the ways real downloads go wrong.
//!
//! It shares no code with imgbuild (the code under test): a schematic's ID is
//! the sha256 of the exact bytes POSTed (imgbuild sends the canonical form, so
//! the real factory's re-marshalled ID and this one agree exactly when
//! imgbuild's canonical form is right), and META is baked by [`crate::disk`], a GPT
//! reader and ADV writer of the simulator's own.
//!
//! Each architecture gets its own disk (an arm64 one has no BIOS boot
//! partition; its Secure Boot ESP boots `BOOTAA64.efi`). Secure Boot
//! assets are signed as image-factory signs them: `<platform>-<arch>-
//! secureboot-uki.efi` is a UKI (the systemd stub, the kernel, the initramfs
//! and the schematic's command line) signed with sbsign by a key the double
//! makes on first use, whose certificate `/secureboot/signing-cert.pem`
//! serves (sbverify accepts the UKI with it). Not modelled: the factory's
//! PXE routes (none are served), signing the simulated systemd-boot inside
//! the Secure Boot disk and ISO (not a PE file here).

mod secureboot_disk;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use futures_util::StreamExt;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncSeekExt};

#[derive(clap::Args)]
pub struct Args {
    /// Loopback address to listen on.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// A second loopback address (e.g. 127.0.0.2:0) that `redirect` points at.
    #[arg(long)]
    alt_listen: Option<SocketAddr>,
    /// The Talos-shaped raw disk every image is made from.
    #[arg(long)]
    base_image: PathBuf,
    /// Where built images are kept.
    #[arg(long)]
    state_dir: PathBuf,
    #[arg(long, value_delimiter = ',', default_value = "v1.11.2,v1.10.7")]
    versions: Vec<String>,
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "siderolabs/qemu-guest-agent,siderolabs/tailscale,siderolabs/iscsi-tools,siderolabs/amd-ucode,siderolabs/intel-ucode"
    )]
    extensions: Vec<String>,
    /// MODE or MODE:N (first N image requests only). Modes: not-found-200,
    /// html-200, truncate, wrong-length, trailing, 5xx, redirect, slow, wrong-id,
    /// schematics-503 (`POST /schematics` answers 503 Service Unavailable).
    #[arg(long)]
    misbehave: Vec<String>,
    /// A real x86 kernel (bzImage): served as `kernel-amd64` and booted by
    /// real ISOs (grub-mkrescue) instead of the simulated ones.
    #[arg(long, requires = "initramfs")]
    kernel: Option<PathBuf>,
    /// The initramfs served as `initramfs-amd64.xz` and put on real ISOs.
    #[arg(long, requires = "kernel")]
    initramfs: Option<PathBuf>,
    /// The factory's own kernel arguments (instead of Talos's defaults);
    /// extra kernel arguments and META follow them.
    #[arg(long)]
    cmdline: Option<String>,
    /// systemd's EFI stub (`linuxx64.efi.stub`): with it, real ISOs of
    /// Talos v1.10 and later are dual-boot (GRUB on BIOS, a UKI on UEFI).
    #[arg(long, requires = "kernel")]
    uki_stub: Option<PathBuf>,
}

/// What real boot media are made of (see [`Args::kernel`]).
struct RealBoot {
    kernel: PathBuf,
    initramfs: PathBuf,
    uki_stub: Option<PathBuf>,
}

struct Misbehaviour {
    mode: String,
    remaining: Option<u32>,
}

struct Sim {
    base: PathBuf,
    state: PathBuf,
    versions: Vec<String>,
    extensions: Vec<String>,
    alt_url: Option<String>,
    /// Registered schematics by ID.
    schematics: Mutex<HashMap<String, Posted>>,
    modes: Mutex<Vec<Misbehaviour>>,
    image_gets: Mutex<HashMap<String, u64>>,
    build: tokio::sync::Mutex<()>,
    real: Option<RealBoot>,
    base_cmdline: Option<String>,
}

fn loopback(addr: SocketAddr) -> anyhow::Result<SocketAddr> {
    anyhow::ensure!(addr.ip().is_loopback(), "{addr} is not a loopback address");
    Ok(addr)
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.state_dir)?;
    let main = tokio::net::TcpListener::bind(loopback(args.listen)?).await?;
    let alt = match args.alt_listen {
        Some(a) => Some(tokio::net::TcpListener::bind(loopback(a)?).await?),
        None => None,
    };
    let url = format!("http://{}", main.local_addr()?);
    let alt_url = alt
        .as_ref()
        .map(|l| l.local_addr().map(|a| format!("http://{a}")))
        .transpose()?;
    const MODES: [&str; 10] = [
        "not-found-200",
        "html-200",
        "truncate",
        "wrong-length",
        "trailing",
        "5xx",
        "redirect",
        "slow",
        "wrong-id",
        "schematics-503",
    ];
    for m in &args.misbehave {
        let mode = m.split_once(':').map_or(m.as_str(), |(mode, _)| mode);
        anyhow::ensure!(MODES.contains(&mode), "unknown --misbehave mode {mode:?}");
    }
    let modes = args
        .misbehave
        .iter()
        .map(|m| match m.split_once(':') {
            Some((mode, n)) => Misbehaviour {
                mode: mode.into(),
                remaining: n.parse().ok(),
            },
            None => Misbehaviour {
                mode: m.clone(),
                remaining: None,
            },
        })
        .collect();
    let sim = Arc::new(Sim {
        base: args.base_image,
        state: args.state_dir,
        versions: args.versions,
        extensions: args.extensions,
        alt_url: alt_url.clone(),
        schematics: Mutex::new(HashMap::new()),
        modes: Mutex::new(modes),
        image_gets: Mutex::new(HashMap::new()),
        build: tokio::sync::Mutex::new(()),
        real: args
            .kernel
            .zip(args.initramfs)
            .map(|(kernel, initramfs)| RealBoot {
                kernel,
                initramfs,
                uki_stub: args.uki_stub,
            }),
        base_cmdline: args.cmdline,
    });
    let app = Router::new()
        .route("/schematics", post(post_schematic))
        .route("/schematics/{id}", get(get_schematic))
        .route("/versions", get(versions))
        .route("/version/{v}/extensions/official", get(extensions))
        .route("/image/{id}/{version}/{file}", get(image).head(image))
        .route(
            "/v2/{image}/{id}/manifests/{tag}",
            get(installer_manifest).head(installer_manifest),
        )
        .route("/secureboot/signing-cert.pem", get(signing_cert))
        .route("/pxe/{id}/{version}/{path}", get(pxe))
        .route("/_sim/stats", get(stats))
        .route("/_sim/schematics", get(posted))
        .with_state(sim);
    println!("{}", serde_json::json!({"url": url, "alt_url": alt_url}));
    if let Some(alt) = alt {
        let app = app.clone();
        tokio::spawn(async move { axum::serve(alt, app).await });
    }
    axum::serve(main, app).await?;
    Ok(())
}

/// The misbehaviour to apply to this image request, if any (counts down).
fn take_mode(sim: &Sim, only: &[&str]) -> Option<String> {
    let mut modes = sim.modes.lock().unwrap();
    let m = modes
        .iter_mut()
        .find(|m| only.contains(&m.mode.as_str()) && m.remaining != Some(0))?;
    if let Some(n) = &mut m.remaining {
        *n -= 1;
    }
    Some(m.mode.clone())
}

fn text(status: StatusCode, body: impl Into<String>) -> Response {
    (status, [(header::CONTENT_TYPE, "text/plain")], body.into()).into_response()
}

/// A schematic as the factory keeps it: the bytes received, and what the
/// images need from them.
#[derive(Clone)]
struct Posted {
    body: String,
    schematic: SchematicShape,
}

/// Just enough of image-factory's `pkg/schematic` types to refuse what the
/// real factory refuses (yaml.v3 with KnownFields: unknown fields are an
/// error) and to read the META values and extensions the images need.
#[derive(Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)] // fields parsed only so that unknown ones are refused
struct SchematicShape {
    #[serde(default)]
    owner: String,
    #[serde(default)]
    overlay: OverlayShape,
    #[serde(default)]
    customization: CustomizationShape,
}

#[derive(Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)] // fields parsed only so that unknown ones are refused
struct OverlayShape {
    #[serde(default)]
    image: String,
    #[serde(default)]
    name: String,
    #[serde(default)]
    options: serde_yaml_ng::Mapping,
}

#[derive(Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[allow(dead_code)] // fields parsed only so that unknown ones are refused
struct CustomizationShape {
    #[serde(default)]
    embedded_machine_configuration: String,
    #[serde(default)]
    extra_kernel_args: Vec<String>,
    #[serde(default)]
    meta: Vec<MetaShape>,
    #[serde(default)]
    system_extensions: ExtensionsShape,
    #[serde(default)]
    bootloader: String,
    #[serde(default, rename = "secureboot")]
    secure_boot: SecureBootShape,
    #[serde(default)]
    disk_image: DiskImageShape,
}

/// `SecureBootCustomization` (siderolabs/image-factory `pkg/schematic/schematic.go`).
#[derive(Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(crate) struct SecureBootShape {
    #[serde(default)]
    pub(crate) enroll_keys: String,
    #[serde(default)]
    #[allow(dead_code)] // parsed only so that unknown fields are refused
    include_well_known_certificates: bool,
}

#[derive(Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct MetaShape {
    key: u8,
    #[serde(default)]
    value: String,
}

#[derive(Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ExtensionsShape {
    #[serde(default)]
    official_extensions: Vec<String>,
}

#[derive(Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[allow(dead_code)] // fields parsed only so that unknown ones are refused
struct DiskImageShape {
    #[serde(default)]
    sector_size: u64,
}

/// The ID the simulator gives a schematic: sha256 of the bytes received.
fn schematic_id(body: &[u8]) -> String {
    hex_lower(&Sha256::digest(body))
}

pub(crate) fn hex_lower(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

async fn post_schematic(State(sim): State<Arc<Sim>>, body: String) -> Response {
    if take_mode(&sim, &["schematics-503"]).is_some() {
        return text(StatusCode::SERVICE_UNAVAILABLE, "service unavailable");
    }
    let schematic: SchematicShape = match serde_yaml_ng::from_str::<Option<SchematicShape>>(&body) {
        Ok(s) => s.unwrap_or_default(),
        Err(e) => return text(StatusCode::BAD_REQUEST, e.to_string()),
    };
    let mut id = schematic_id(body.as_bytes());
    let posted = Posted {
        body: body.clone(),
        schematic,
    };
    sim.schematics.lock().unwrap().insert(id.clone(), posted);
    if take_mode(&sim, &["wrong-id"]).is_some() {
        id = id.chars().rev().collect();
    }
    (
        StatusCode::CREATED,
        axum::Json(serde_json::json!({"id": id, "schematic": body})),
    )
        .into_response()
}

async fn get_schematic(State(sim): State<Arc<Sim>>, Path(id): Path<String>) -> Response {
    match sim.schematics.lock().unwrap().get(&id) {
        Some(p) => ([(header::CONTENT_TYPE, "application/yaml")], p.body.clone()).into_response(),
        None => text(StatusCode::NOT_FOUND, "schematic not found"),
    }
}

/// The factory's registry face: what a node pulls `<host>/<image>/<id>:<tag>`
/// from. As siderolabs/image-factory `internal/frontend/http/registry.go`
/// `handleManifest`: the schematic must have been posted (else "schematic not
/// found"), the image is `installer` or `<platform>-installer`
/// (`getRequestedImage`), and the version must be one the factory builds.
/// Per-platform installers exist from Talos v1.10 on
/// (`quirks.SupportsUnifiedInstaller`).
async fn installer_manifest(
    State(sim): State<Arc<Sim>>,
    Path((image, id, tag)): Path<(String, String, String)>,
) -> Response {
    if !sim.schematics.lock().unwrap().contains_key(&id) {
        return text(StatusCode::NOT_FOUND, "schematic not found");
    }
    // `installer-secureboot` and `<platform>-installer-secureboot` are the
    // Secure Boot installers (`getRequestedImage` tries that suffix first).
    let plain = image.strip_suffix("-secureboot").unwrap_or(&image);
    let platform = plain.strip_suffix("-installer");
    if plain != "installer" && platform.is_none_or(str::is_empty) {
        return text(StatusCode::NOT_FOUND, format!("unknown image {image:?}"));
    }
    if !sim.versions.contains(&tag) {
        return text(StatusCode::NOT_FOUND, format!("version {tag} not found"));
    }
    let minor = tag
        .trim_start_matches('v')
        .split('.')
        .nth(1)
        .and_then(|m| m.parse::<u32>().ok())
        .unwrap_or(u32::MAX);
    if platform.is_some() && minor < 10 {
        return text(
            StatusCode::NOT_FOUND,
            format!("{image}: per-platform installers start with Talos v1.10"),
        );
    }
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "annotations": {"org.opencontainers.image.title": format!("{image}/{id}:{tag}")},
    });
    (
        [(
            header::CONTENT_TYPE,
            "application/vnd.oci.image.manifest.v1+json",
        )],
        manifest.to_string(),
    )
        .into_response()
}

async fn versions(State(sim): State<Arc<Sim>>) -> Response {
    axum::Json(&sim.versions).into_response()
}

async fn extensions(State(sim): State<Arc<Sim>>, Path(v): Path<String>) -> Response {
    if !sim.versions.contains(&v) {
        return text(StatusCode::NOT_FOUND, "version not found");
    }
    let list: Vec<_> = sim
        .extensions
        .iter()
        .map(|name| {
            serde_json::json!({
                "name": name,
                "ref": format!("ghcr.io/{name}:{v}"),
                "digest": format!("sha256:{}", "0".repeat(64)),
                "author": "Sidero Labs",
                "description": format!("{name} (simulated)"),
            })
        })
        .collect();
    axum::Json(list).into_response()
}

async fn stats(State(sim): State<Arc<Sim>>) -> Response {
    axum::Json(sim.image_gets.lock().unwrap().clone()).into_response()
}

async fn image(
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
fn boot_asset(
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

/// The kernel command line the factory gives a schematic's boot assets,
/// with its META on it when it has any.
fn cmdline(
    sim: &Sim,
    schematic: &SchematicShape,
    version: &str,
    platform: &str,
    arch: &str,
) -> String {
    let mut args: Vec<String> = vec![
        format!("talos.platform={platform}"),
        "console=ttyS0".into(),
        "console=tty0".into(),
        "init_on_alloc=1".into(),
        "slab_nomerge".into(),
        "pti=on".into(),
        "consoleblank=0".into(),
        "nvme_core.io_timeout=4294967295".into(),
        "printk.devkmsg=on".into(),
        "selinux=1".into(),
        "module.sig_enforce=1".into(),
    ];
    if arch != "amd64" {
        args.retain(|a| a != "pti=on");
    }
    if let Some(base) = &sim.base_cmdline {
        args = base.split_whitespace().map(str::to_owned).collect();
    }
    args.extend(schematic.customization.extra_kernel_args.iter().cloned());
    if !schematic.customization.meta.is_empty() {
        args.push(format!(
            "talos.environment=INSTALLER_META_BASE64={}",
            encode_meta_values(&schematic.customization.meta, version)
        ));
    }
    args.join(" ")
}

/// A few KiB that a boot loader would take for a kernel of `arch`: an x86
/// bzImage header (`HdrS` at 0x202) or an arm64 `Image` (`MZ`, `ARM\x64` at
/// 0x38), then bytes that depend on the version.
fn simulated_kernel(version: &str, arch: &str) -> Option<Vec<u8>> {
    let mut k = vec![0u8; 40 << 10];
    match arch {
        "amd64" => k[0x202..0x206].copy_from_slice(b"HdrS"),
        "arm64" => {
            k[..2].copy_from_slice(b"MZ");
            k[0x38..0x3c].copy_from_slice(b"ARM\x64");
        }
        _ => return None,
    }
    let seed = Sha256::digest(format!("kernel {version} {arch}"));
    for (i, b) in k[0x400..].iter_mut().enumerate() {
        *b = seed[i % 32] ^ (i as u8);
    }
    Some(k)
}

/// `Values.Encode` of siderolabs/talos `pkg/machinery/meta/meta.go`:
/// `0x<key>=<value>` joined by `;`, gzipped at best compression when over
/// 256 bytes (from v1.6.3), standard base64.
fn encode_meta_values(values: &[MetaShape], version: &str) -> String {
    use base64::Engine;
    let joined = values
        .iter()
        .map(|m| format!("0x{:x}={}", m.key, m.value))
        .collect::<Vec<_>>()
        .join(";");
    let bytes = if talos_version(version) >= (1, 6, 3) && joined.len() > 256 {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        std::io::Write::write_all(&mut gz, joined.as_bytes()).expect("in memory");
        gz.finish().expect("in memory")
    } else {
        joined.into_bytes()
    };
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// `vX.Y.Z` as numbers (a missing or odd part is 0).
fn talos_version(version: &str) -> (u32, u32, u32) {
    let mut parts = version
        .trim_start_matches('v')
        .split('.')
        .map(|p| p.parse::<u32>().unwrap_or(0));
    (
        parts.next().unwrap_or(0),
        parts.next().unwrap_or(0),
        parts.next().unwrap_or(0),
    )
}

/// Every schematic posted so far, as received: what the factory's operator
/// can read about the nodes that were built.
async fn posted(State(sim): State<Arc<Sim>>) -> Response {
    let map: std::collections::BTreeMap<String, String> = sim
        .schematics
        .lock()
        .unwrap()
        .iter()
        .map(|(id, p)| (id.clone(), p.body.clone()))
        .collect();
    axum::Json(map).into_response()
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Raw,
    RawZst,
    RawXz,
    RawGz,
    Qcow2,
    Iso,
}

fn image_kind(file: &str) -> Option<Kind> {
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
fn is_secure_boot(file: &str) -> bool {
    file.split('.')
        .next()
        .is_some_and(|stem| stem.ends_with("-secureboot"))
}

/// The platform and architecture an image path names
/// (`metal-amd64-secureboot.raw.xz` → `metal`, `amd64`).
fn platform_arch(file: &str) -> (&str, &str) {
    let stem = file.split('.').next().unwrap_or(file);
    let stem = stem.strip_suffix("-secureboot").unwrap_or(stem);
    stem.rsplit_once('-').unwrap_or((stem, "amd64"))
}

/// Builds (once) the image for a schematic: the base with its META, then
/// compressed or converted as the path asks.
fn build(
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

/// The volume date of every simulated ISO (`YYYYMMDDhhmmsscc`): GRUB's EFI
/// image finds its root by the UUID made of it, so a remaster must keep it.
const ISO_VOLUME_DATE: &str = "2025061210203000";

/// A small ISO in the layout of siderolabs/talos `pkg/imager/iso/grub.go`
/// and `grub.cfg`: `/boot/vmlinuz`, `/boot/initramfs.xz`, a
/// `/boot/grub/grub.cfg` whose menu entries boot the kernel with the
/// schematic's command line (META included), and El Torito BIOS and EFI
/// boot images (dummy files here) as grub-mkrescue lays them out, hybrid
/// (GPT with the EFI image as a partition).
fn make_iso(out: &std::path::Path, cmdline: &str, version: &str, arch: &str) -> anyhow::Result<()> {
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
fn grub_cfg(cmdline: &str) -> String {
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
fn dual_boot_iso(version: &str, schematic: &SchematicShape) -> bool {
    let v = talos_version(version);
    v >= (1, 10, 0) && !(v >= (1, 12, 0) && schematic.customization.bootloader == "grub")
}

/// A bootable ISO of the real kernel and initramfs, made as Talos makes
/// its own: grub-mkrescue over `/boot/vmlinuz`, `/boot/initramfs.xz` and
/// the `grub.cfg` above; the dual-boot kind has GRUB for BIOS only and, in
/// an appended EFI system partition, `EFI/BOOT/BOOTX64.EFI`: a UKI with
/// `cmdline` baked in.
fn real_iso(
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

fn le(b: &[u8], at: usize, n: usize) -> anyhow::Result<u64> {
    let bytes = b
        .get(at..at + n)
        .ok_or_else(|| anyhow::anyhow!("PE header cut short at {at}"))?;
    Ok(bytes.iter().rev().fold(0, |v, &x| (v << 8) | u64::from(x)))
}

/// The first address past the sections of a PE32+ image (PE/COFF: the
/// optional header's ImageBase plus each section's VirtualAddress and
/// VirtualSize): where a UKI's own sections may start.
fn pe_end(image: &[u8]) -> anyhow::Result<u64> {
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

/// `GET /pxe/{id}/{version}/{platform}-{arch}[-secureboot]`
/// (image-factory `internal/frontend/http/pxe.go`, `standard.ipxe`,
/// `secureboot.ipxe`): an iPXE script booting the kernel and initramfs with
/// the schematic's command line, or, for Secure Boot, the signed UKI alone
/// (its command line is inside it). URLs point back at this factory.
async fn pxe(
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
fn drop_partition(disk: &std::path::Path, name: &str) -> anyhow::Result<()> {
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

/// The systemd EFI stub a UKI is built on when the factory has no real
/// one (the Debian `systemd-boot-efi` package's).
const SYSTEM_UKI_STUB: &str = "/usr/lib/systemd/boot/efi/linuxx64.efi.stub";

/// The factory's Secure Boot signing key and certificate, made on first
/// use (image-factory signs every Secure Boot asset with its own key,
/// `internal/secureboot`, and serves the certificate).
fn signing_pair(sim: &Sim) -> anyhow::Result<(PathBuf, PathBuf)> {
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
async fn signing_cert(State(sim): State<Arc<Sim>>) -> Response {
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
fn signed_uki(
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
fn make_esp(uki: &std::path::Path, out: &std::path::Path) -> anyhow::Result<()> {
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

/// Serves a built file, honouring `Range: bytes=N-` (for resumed downloads)
/// and the misbehaviours that act on the body.
async fn serve(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_id_is_the_sha256_of_the_bytes_received() {
        // The public ID of the empty schematic (image-factory's vanilla Talos).
        assert_eq!(
            schematic_id(b"customization: {}\n"),
            "376567988ad370138ad8b2698212367b8edcb69b5fd68c80be1f2ec7d603b4ba"
        );
        // No canonicalisation: other bytes, another ID.
        assert_ne!(
            schematic_id(b"customization: {}"),
            schematic_id(b"customization: {}\n")
        );
    }

    #[test]
    fn isos_are_dual_boot_from_v1_10_unless_grub_is_asked_for_from_v1_12() {
        let grub =
            serde_yaml_ng::from_str::<SchematicShape>("customization: {bootloader: grub}").unwrap();
        let default = SchematicShape::default();
        assert!(!dual_boot_iso("v1.9.5", &default));
        assert!(dual_boot_iso("v1.10.0", &default));
        assert!(
            dual_boot_iso("v1.11.2", &grub),
            "grub is not honoured before v1.12"
        );
        assert!(dual_boot_iso("v1.12.0", &default));
        assert!(!dual_boot_iso("v1.12.0", &grub));
    }

    #[test]
    fn a_pe_image_ends_past_its_last_section() {
        let mut pe = vec![0u8; 0x200];
        pe[0x3c] = 0x40;
        pe[0x40..0x44].copy_from_slice(b"PE\0\0");
        pe[0x46] = 2; // two sections
        pe[0x54] = 0xf0; // optional header size
        pe[0x58..0x5a].copy_from_slice(&0x20bu16.to_le_bytes());
        pe[0x58 + 24..0x58 + 32].copy_from_slice(&0x1000_0000u64.to_le_bytes());
        let table = 0x58 + 0xf0;
        for (i, (size, addr)) in [(0x500u32, 0x9000u32), (0x100, 0x4000)].iter().enumerate() {
            let s = table + 40 * i;
            pe[s + 8..s + 12].copy_from_slice(&size.to_le_bytes());
            pe[s + 12..s + 16].copy_from_slice(&addr.to_le_bytes());
        }
        assert_eq!(pe_end(&pe).unwrap(), 0x1000_9500);
        pe[0x58] = 0x0b;
        pe[0x59] = 0x01;
        assert!(pe_end(&pe).unwrap_err().to_string().contains("PE32+"));
        assert!(pe_end(&pe[..0x60]).is_err());
    }

    #[test]
    fn unknown_fields_and_bad_yaml_are_refused() {
        let parse = |s: &str| serde_yaml_ng::from_str::<Option<SchematicShape>>(s);
        assert!(parse("customization:\n  extraKernelArgs: [a]\n").is_ok());
        assert!(parse("customization:\n  colour: red\n").is_err());
        assert!(parse("overlay: {image: x, foo: 1}\n").is_err());
        assert!(parse("customization: [\n").is_err());
        let meta = parse("customization:\n  meta:\n    - key: 0xa\n      value: x\n")
            .unwrap()
            .unwrap();
        assert_eq!(meta.customization.meta[0].key, 10);
    }
}
