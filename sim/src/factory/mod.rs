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

mod cmdline;
mod images;
mod iso;
mod schematics;
mod secureboot_disk;
pub(crate) mod state;
mod uki;

use axum::Router;
use axum::routing::{get, post};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use self::images::*;
use self::schematics::*;
use self::state::*;
use self::uki::*;

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

#[cfg(test)]
mod tests;
