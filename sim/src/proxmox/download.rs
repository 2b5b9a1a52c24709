//! `POST /nodes/{node}/storage/{storage}/download-url`, as pve-storage
//! src/PVE/API2/Storage/Status.pm (`download_url`) and pve-common
//! `PVE::Tools::download_file_from_url` do it: the same content and file
//! name checks as an upload, then a `download` worker that fetches the URL
//! into a temp file beside the target (an existing file is kept when its
//! checksum matches, else refused), verifies the checksum (a mismatch
//! fails the task and leaves nothing), checks an image with `qemu-img info`
//! and renames it into place. `compression` is refused except for `iso`.
//!
//! Divergence: the simulator fetches only plain `http://` on 127.0.0.0/8;
//! any other host fails the task the way an unreachable host does.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::state::{ApiResult, Pve};
use super::storage::{file_hash, qemu_img_info};
use super::upload::normalize_filename;

/// How long the fetch may sit idle (wget's read timeout is of this order).
const IDLE: Duration = Duration::from_secs(30);

impl Pve {
    /// Status.pm `download_url`: checked at once, fetched in a worker.
    pub(super) fn download_url(self: &Arc<Self>, p: &BTreeMap<String, String>) -> ApiResult {
        let content = p["content"].clone();
        let filename = normalize_filename(&p["filename"]);
        let (dest_dir, image_format) = self.content_dir(&p["storage"], &content, &filename)?;
        if p.contains_key("compression") && content != "iso" {
            // Status.pm dies in the worker; the task fails before fetching.
            return Ok(self.spawn_task("download", &filename, move |_, _| {
                Err(format!("decompression not supported for {content}"))
            }));
        }
        let url = p["url"].clone();
        let want = p.get("checksum").cloned();
        let algo = p.get("checksum-algorithm").cloned();
        let dest = dest_dir.join(&filename);
        let id = filename.clone();
        Ok(self.spawn_task("download", &id, move |pve, log| {
            log.push(format!("downloading {url} to {}", dest.display()));
            if dest.exists() {
                // download_file_from_url: an existing file is kept when its
                // checksum matches, else the download is refused.
                let Some((want, algo)) = want.as_ref().zip(algo.as_ref()) else {
                    return Err(format!("refusing to override existing file '{}'", dest.display()));
                };
                let got = file_hash(algo, &dest)?;
                if got.eq_ignore_ascii_case(want) {
                    log.push("calculating checksum of existing file...OK, got correct file already, no need to download".into());
                    return Ok(());
                }
                return Err(format!(
                    "checksum mismatch: got '{got}' != expect '{want}', aborting"
                ));
            }
            std::fs::create_dir_all(&dest_dir).map_err(|e| e.to_string())?;
            let tmp = dest_dir.join(format!("{filename}.tmp.{}", std::process::id()));
            let result = (|| {
                let wget = |code: u8| {
                    format!(
                        "download failed: command 'wget --progress=dot:giga -O {} {url}' failed: exit code {code}",
                        tmp.display()
                    )
                };
                fetch(&url, &tmp, &|n| {
                    pve.stats.download_bytes.fetch_add(n, Ordering::Relaxed);
                })
                .map_err(|(code, why)| {
                    log.push(why);
                    wget(code)
                })?;
                if let (Some(want), Some(algo)) = (&want, &algo) {
                    let got = file_hash(algo, &tmp)?;
                    if !got.eq_ignore_ascii_case(want) {
                        log.push("calculating checksum...".into());
                        return Err(format!("checksum mismatch: got '{got}' != expect '{want}'"));
                    }
                    log.push("calculating checksum...OK, checksum verified".into());
                }
                if let Some(fmt) = &image_format {
                    qemu_img_info(&tmp, fmt)?;
                }
                std::fs::rename(&tmp, &dest)
                    .map_err(|e| format!("unable to rename temporary file: {e}"))
            })();
            if result.is_err() {
                let _ = std::fs::remove_file(&tmp);
            } else {
                log.push(format!("download of '{url}' to '{}' finished", dest.display()));
            }
            result
        }))
    }
}

/// Fetches `url` (plain HTTP, loopback only) into `to`, streamed; tells
/// `fetched` each chunk's size. An error is wget's exit code (4: network
/// failure, 8: the server answered with an error) and what wget says.
fn fetch(url: &str, to: &Path, fetched: &dyn Fn(u64)) -> Result<u64, (u8, String)> {
    let unreachable = |host: &str| {
        (
            4,
            format!("Resolving {host}... failed: Name or service not known."),
        )
    };
    let io = |e: std::io::Error| (4, e.to_string());
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| unreachable(url))?;
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let addr: SocketAddr = authority
        .parse()
        .or_else(|_| format!("{authority}:80").parse())
        .map_err(|_| unreachable(authority))?;
    let loopback = matches!(addr.ip(), std::net::IpAddr::V4(ip) if ip.octets()[0] == Ipv4Addr::LOCALHOST.octets()[0]);
    if !loopback {
        return Err(unreachable(authority));
    }
    let mut conn = TcpStream::connect_timeout(&addr, IDLE)
        .map_err(|e| (4, format!("Connecting to {authority}... failed: {e}.")))?;
    conn.set_read_timeout(Some(IDLE)).map_err(io)?;
    // HTTP/1.0: the body ends with the connection, never chunked.
    write!(
        conn,
        "GET /{path} HTTP/1.0\r\nHost: {authority}\r\nUser-Agent: Wget/1.21.3\r\n\r\n"
    )
    .map_err(io)?;
    let mut r = BufReader::new(conn);
    let mut status = String::new();
    r.read_line(&mut status).map_err(io)?;
    let code = status.split_whitespace().nth(1).unwrap_or("");
    if code != "200" {
        let shown: String = status.trim().chars().take(200).collect();
        return Err((8, format!("ERROR: {shown}")));
    }
    loop {
        let mut line = String::new();
        let n = r.read_line(&mut line).map_err(io)?;
        if n == 0 || line == "\r\n" || line == "\n" {
            break;
        }
    }
    let mut out = std::fs::File::create(to).map_err(io)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = r.read(&mut buf).map_err(io)?;
        if n == 0 {
            break;
        }
        out.write_all(&buf[..n]).map_err(io)?;
        total += n as u64;
        fetched(n as u64);
    }
    out.sync_all().map_err(io)?;
    Ok(total)
}
