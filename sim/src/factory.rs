//! The Image Factory double: the HTTP API of shared/FORMATS.md §2, images
//! built from one Talos-shaped base with each schematic's META baked in, and
//! switches that make it misbehave the ways real downloads go wrong.

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use futures_util::StreamExt;
use imgbuild::schematic::Schematic;
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
    /// html-200, truncate, wrong-length, trailing, 5xx, redirect, slow, wrong-id.
    #[arg(long)]
    misbehave: Vec<String>,
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
    schematics: Mutex<HashMap<String, Schematic>>,
    modes: Mutex<Vec<Misbehaviour>>,
    image_gets: Mutex<HashMap<String, u64>>,
    build: tokio::sync::Mutex<()>,
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
    });
    let app = Router::new()
        .route("/schematics", post(post_schematic))
        .route("/schematics/{id}", get(get_schematic))
        .route("/versions", get(versions))
        .route("/version/{v}/extensions/official", get(extensions))
        .route("/image/{id}/{version}/{file}", get(image).head(image))
        .route("/_sim/stats", get(stats))
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

async fn post_schematic(State(sim): State<Arc<Sim>>, body: String) -> Response {
    let schematic = match Schematic::parse(&body) {
        Ok(s) => s,
        Err(e) => return text(StatusCode::BAD_REQUEST, e.to_string()),
    };
    let canonical = match schematic.canonical() {
        Ok(c) => c,
        Err(e) => return text(StatusCode::BAD_REQUEST, e.to_string()),
    };
    let mut id = imgbuild::schematic::id_of(&canonical).to_string();
    sim.schematics.lock().unwrap().insert(id.clone(), schematic);
    if take_mode(&sim, &["wrong-id"]).is_some() {
        id = id.chars().rev().collect();
    }
    (
        StatusCode::CREATED,
        axum::Json(serde_json::json!({"id": id, "schematic": canonical})),
    )
        .into_response()
}

async fn get_schematic(State(sim): State<Arc<Sim>>, Path(id): Path<String>) -> Response {
    match sim.schematics.lock().unwrap().get(&id) {
        Some(s) => (
            [(header::CONTENT_TYPE, "application/yaml")],
            s.canonical().unwrap_or_default(),
        )
            .into_response(),
        None => text(StatusCode::NOT_FOUND, "schematic not found"),
    }
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
    let Some(schematic) = sim.schematics.lock().unwrap().get(&id).cloned() else {
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

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Raw,
    RawZst,
    RawXz,
    RawGz,
    Qcow2,
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
    } else {
        return None;
    };
    let stem = stem.strip_suffix("-secureboot").unwrap_or(stem);
    let (platform, arch) = stem.rsplit_once('-')?;
    (!platform.is_empty() && matches!(arch, "amd64" | "arm64")).then_some(kind)
}

/// Builds (once) the image for a schematic: the base with its META, then
/// compressed or converted as the path asks.
fn build(
    sim: &Sim,
    schematic: &Schematic,
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
    let raw = dir.join("disk.raw");
    if !raw.exists() {
        let edits: Vec<(u32, Option<Vec<u8>>)> = schematic
            .customization
            .meta
            .iter()
            .map(|m| (u32::from(m.key), Some(m.value.clone().into_bytes())))
            .collect();
        imgbuild::disk::write_patched_copy(&sim.base, &raw, &edits)?;
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
    }
    std::fs::rename(&tmp, &out)?;
    Ok(out)
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
