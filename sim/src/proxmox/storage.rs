//! Storage (pve-storage `PVE/API2/Storage/Content.pm`, `Upload.pm`): listing
//! storages and content, uploads streamed to disk with their checksum and
//! `qemu-img info` checks, deleting volumes.

use super::http::*;
use super::schema;
use super::schema::Errors;
use super::state::*;
use super::upload::{Multipart, normalize_filename, parse_content_type};
use serde_json::{Value, json};
use sha2::{Digest, Sha224, Sha256, Sha384, Sha512};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::UNIX_EPOCH;
use tokio::io::{AsyncRead, AsyncReadExt};

/// The upload branch of pveproxy: multipart only, streamed to a staging
/// file under `DIR/tmp` (pveproxy: /var/tmp/pveupload-…), then the API call
/// with the fields as parameters. Keep-alive ends after an upload.
pub(crate) async fn upload(
    pve: &Arc<Pve>,
    head: &Head,
    r: &mut (impl AsyncRead + Unpin),
    length: Option<u64>,
    mut params: BTreeMap<String, String>,
    method: &Value,
) -> Option<(ApiResult, bool)> {
    let Some(size) = length.filter(|&l| l > 0) else {
        // No body: pveproxy runs the API call without one.
        for (k, v) in form_pairs(&head.query) {
            params.insert(k, v);
        }
        let res = schema::check(method, &params).map_err(param_exc);
        return Some((res.and(Err(die("missing temporary file name"))), true));
    };
    let ctype = head.header("content-type").unwrap_or_default();
    let (ct, boundary) = parse_content_type(ctype);
    let Some(boundary) = boundary.filter(|_| ct == "multipart/form-data") else {
        // pveproxy dies inside its header reader here and never answers.
        return None;
    };
    let query: BTreeMap<String, String> = form_pairs(&head.query).into_iter().collect();
    if query.contains_key("tmpfilename") {
        return Some((
            Err(die(
                "'tmpfilename' query parameter is not allowed for file uploads",
            )),
            false,
        ));
    }
    bump(&pve.stats.upload_attempts);
    let seq = pve.seq.fetch_add(1, Ordering::Relaxed);
    let staged = format!(
        "pveupload-{:032x}",
        u128::from(seq) ^ (u128::from(now()) << 64)
    );
    let tmp = pve.args.state_dir.join("tmp").join(&staged);
    let mut parser = Multipart::new(&boundary, size, query);
    let received = stream_upload(pve, r, &mut parser, &tmp).await;
    match received {
        Ok(()) => {}
        Err(None) => {
            let _ = std::fs::remove_file(&tmp);
            return None;
        }
        Err(Some(msg)) => {
            let _ = std::fs::remove_file(&tmp);
            return Some((Err(die(msg)), false));
        }
    }
    params.extend(parser.params);
    // The name pveproxy gives the staged file (the schema checks its pattern);
    // the simulator keeps it under DIR/tmp.
    params.insert("tmpfilename".into(), format!("/var/tmp/{staged}"));
    let res = match schema::check(method, &params) {
        Err(errors) => Err(param_exc(errors)),
        Ok(()) => pve.upload_call(&params, &tmp),
    };
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    Some((res, false))
}

/// Streams an upload body through the parser into `tmp`. Err(None): the
/// connection is to be dropped (idle, cut by a switch, closed by the peer);
/// Err(Some): pveproxy's 500 message.
pub(crate) async fn stream_upload(
    pve: &Pve,
    r: &mut (impl AsyncRead + Unpin),
    parser: &mut Multipart,
    tmp: &Path,
) -> Result<(), Option<String>> {
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(tmp)
        .map_err(|e| {
            Some(format!(
                "unable to create temporary upload file '{}' - {e}",
                tmp.display()
            ))
        })?;
    let mut out = std::io::BufWriter::with_capacity(UPLOAD_CHUNK, file);
    let cut_at = pve.args.drop_upload_after.filter(|_| {
        pve.drops_left
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok()
    });
    let mut buf = vec![0u8; UPLOAD_CHUNK];
    let mut total = 0u64;
    while !parser.done() {
        let room = match cut_at {
            Some(c) if total >= c => return Err(None),
            Some(c) => buf.len().min((c - total) as usize),
            None => buf.len(),
        };
        let n = match tokio::time::timeout(IDLE, r.read(&mut buf[..room])).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return Err(None),
            Ok(Ok(n)) => n,
        };
        total += n as u64;
        pve.stats
            .upload_bytes
            .fetch_add(n as u64, Ordering::Relaxed);
        // Large writes on the runtime thread: the disk is faster than TLS.
        parser.feed(&buf[..n], &mut out).map_err(Some)?;
    }
    // Flushed, not synced: pveproxy does not fsync its staging file either.
    out.into_inner().map_err(|e| Some(e.to_string()))?;
    Ok(())
}

/// `PVE::Storage::get_file_hash`'s algorithms that the simulator has.
pub(crate) fn file_hash(algorithm: &str, path: &Path) -> Result<String, String> {
    fn run<D: Digest>(path: &Path) -> std::io::Result<Vec<u8>> {
        use std::io::Read;
        let mut f = std::fs::File::open(path)?;
        let mut d = D::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            match f.read(&mut buf)? {
                0 => return Ok(d.finalize().to_vec()),
                n => d.update(&buf[..n]),
            }
        }
    }
    let sum = match algorithm {
        "sha224" => run::<Sha224>(path),
        "sha256" => run::<Sha256>(path),
        "sha384" => run::<Sha384>(path),
        "sha512" => run::<Sha512>(path),
        other => {
            return Err(format!(
                "simulator: checksum algorithm '{other}' not implemented"
            ));
        }
    };
    let sum = sum.map_err(|e| e.to_string())?;
    Ok(sum.iter().map(|b| format!("{b:02x}")).collect())
}

/// `qemu-img info` on an untrusted image, as `file_size_info(…, 1)` does:
/// the virtual size; refuses backing and data files and a wrong format.
pub(crate) fn qemu_img_info(path: &Path, format: &str) -> Result<u64, String> {
    let out = std::process::Command::new("qemu-img")
        .args(["info", "--output=json", "-f", format])
        .arg(path)
        .output()
        .map_err(|e| format!("qemu-img: {e}"))?;
    if !out.status.success() {
        return Err("failed to query file information with qemu-img".into());
    }
    let info: Value = serde_json::from_slice(&out.stdout).map_err(|e| {
        format!(
            "could not parse qemu-img info command output for '{}' - {e}",
            path.display()
        )
    })?;
    if info["format-specific"]["data"]["data-file"].is_string() {
        return Err(format!(
            "{}: 'data-file' references are not allowed!",
            path.display()
        ));
    }
    if info["backing-filename"].is_string() {
        return Err(format!(
            "backing file not allowed for untrusted image '{}'!",
            path.display()
        ));
    }
    if info["format"].as_str() != Some(format) {
        return Err(format!(
            "qemu-img bug: queried format does not match format in result '{format} ne {}'",
            info["format"]
        ));
    }
    info["virtual-size"]
        .as_u64()
        .ok_or_else(|| "size not an integer".into())
}

impl Pve {
    pub(crate) fn list_storages(&self, p: &BTreeMap<String, String>) -> Value {
        let list: Vec<Value> = self
            .storages
            .iter()
            .filter(|s| p.get("storage").is_none_or(|id| id == s.id))
            .filter(|s| {
                p.get("content")
                    .is_none_or(|c| c.split(',').all(|c| s.content.contains(&c)))
            })
            .map(|s| {
                json!({
                    "storage": s.id, "type": s.kind, "content": s.content.join(","),
                    "active": 1, "enabled": 1, "shared": u8::from(!self.args.other_nodes.is_empty()),
                    "total": 1u64 << 40, "used": 1u64 << 30, "avail": (1u64 << 40) - (1u64 << 30),
                })
            })
            .collect();
        json!(list)
    }

    pub(crate) fn list_content(&self, p: &BTreeMap<String, String>) -> ApiResult {
        let s = self.storage(&p["storage"])?;
        let kinds: Vec<&str> = match p.get("content") {
            Some(c) => c.split(',').collect(),
            None => s.content.clone(),
        };
        let mut list = Vec::new();
        for kind in kinds.into_iter().filter(|k| s.content.contains(k)) {
            let sub = match kind {
                "import" => "import",
                "iso" => "template/iso",
                "vztmpl" => "template/cache",
                _ => continue,
            };
            let Ok(dir) = std::fs::read_dir(self.storage_dir(s.id).join(sub)) else {
                continue;
            };
            for e in dir.flatten() {
                let Ok(meta) = e.metadata() else { continue };
                let name = e.file_name().to_string_lossy().into_owned();
                let format = match kind {
                    "import" => {
                        match name
                            .rsplit_once('.')
                            .map(|(_, ext)| ext.to_ascii_lowercase())
                        {
                            Some(ext)
                                if ["ova", "ovf", "qcow2", "raw", "vmdk"]
                                    .contains(&ext.as_str()) =>
                            {
                                ext
                            }
                            _ => continue,
                        }
                    }
                    "iso" => "iso".into(),
                    _ => "tgz".into(),
                };
                let ctime = meta
                    .modified()
                    .ok()
                    .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                    .map_or(0, |d| d.as_secs());
                list.push(json!({
                    "volid": format!("{}:{kind}/{name}", s.id), "format": format,
                    "size": meta.len(), "ctime": ctime, "content": kind,
                }));
            }
        }
        Ok(json!(list))
    }

    pub(crate) fn delete_volume(self: &Arc<Self>, p: &BTreeMap<String, String>) -> ApiResult {
        let volume = &p["volume"];
        let volid = if volume.contains(':') {
            volume.clone()
        } else {
            format!("{}:{volume}", p["storage"])
        };
        let path = self.volume_path(&volid).map_err(die)?;
        if !path.exists() {
            return Err(die(format!("volume '{volid}' does not exist")));
        }
        let id = volid.clone();
        Ok(self.spawn_task("imgdel", &id, move |_, log| {
            std::fs::remove_file(&path).map_err(|e| e.to_string())?;
            log.push(format!("Removed volume '{volid}'"));
            Ok(())
        }))
    }

    /// `PVE::API2::Storage::Status` upload, after pveproxy has staged the
    /// file (pve-storage src/PVE/API2/Storage/Status.pm).
    pub(crate) fn upload_call(
        self: &Arc<Self>,
        p: &BTreeMap<String, String>,
        tmp: &Path,
    ) -> ApiResult {
        let node = &p["node"];
        if !self.hosts().any(|h| h == node) {
            return Err(die(format!(
                "hostname lookup '{node}' failed - failed to get address info for: {node}: Name or service not known"
            )));
        }
        let content = p["content"].clone();
        let filename = normalize_filename(&p["filename"]);
        let (dest_dir, image_format) = self.content_dir(&p["storage"], &content, &filename)?;
        let dest = dest_dir.join(&filename);
        let (tmp, sum, algo) = (
            tmp.to_owned(),
            p.get("checksum").cloned(),
            p.get("checksum-algorithm").cloned(),
        );
        let node = self.args.node.clone();
        if self.args.fail_task.as_deref() == Some("imgcopy") {
            // The failing worker never runs; like a real failure it leaves no staged file.
            let _ = std::fs::remove_file(&tmp);
        }
        Ok(self.spawn_task("imgcopy", "", move |pve, log| {
            log.push(format!("starting file import from: {}", tmp.display()));
            let checked = (|| {
                if let Some(algo) = &algo {
                    let got = file_hash(algo, &tmp)?;
                    let want = sum.clone().unwrap_or_default();
                    if !got.eq_ignore_ascii_case(&want) {
                        log.push("calculating checksum...".into());
                        return Err(format!("checksum mismatch: got '{got}' != expect '{want}'"));
                    }
                    log.push("calculating checksum...OK, checksum verified".into());
                }
                if let Some(fmt) = &image_format {
                    qemu_img_info(&tmp, fmt)?;
                }
                Ok(())
            })();
            if let Err(e) = checked {
                let _ = std::fs::remove_file(&tmp);
                return Err(e);
            }
            let size = std::fs::metadata(&tmp).map(|m| m.len()).unwrap_or(0);
            log.push(format!("target node: {node}"));
            log.push(format!("target file: {}", dest.display()));
            log.push(format!("file size is: {size}"));
            log.push(format!(
                "command: cp -- {} {}",
                tmp.display(),
                dest.display()
            ));
            std::fs::create_dir_all(&dest_dir).map_err(|e| e.to_string())?;
            // Same filesystem here: a rename is the copy (and silently overwrites).
            if let Err(e) = std::fs::rename(&tmp, &dest) {
                let _ = std::fs::remove_file(&tmp);
                return Err(format!("import failed: {e}"));
            }
            log.push("finished file import successfully".into());
            bump(&pve.stats.uploads);
            Ok(())
        }))
    }

    /// Where a file of `content` named `filename` goes in storage `sid`,
    /// and the image format `qemu-img info` must find in it: the checks
    /// upload and download-url share (pve-storage Status.pm).
    pub(crate) fn content_dir(
        &self,
        sid: &str,
        content: &str,
        filename: &str,
    ) -> Result<(PathBuf, Option<String>), ApiError> {
        let s = self.storage(sid)?;
        if !s.has_path {
            return Err(die(format!("can't upload to storage type '{}'", s.kind)));
        }
        let bad =
            |key: &str, msg: &str| param_exc(Errors::from([(key.to_owned(), msg.to_owned())]));
        let dir = self.storage_dir(s.id);
        let lower_ext = |exts: &[&str]| {
            filename
                .rsplit_once('.')
                .filter(|(stem, _)| !stem.is_empty())
                .map(|(_, e)| e.to_ascii_lowercase())
                .filter(|e| exts.contains(&e.as_str()))
        };
        let (dest_dir, image_format) = match content {
            "iso" => {
                lower_ext(&["iso", "img"])
                    .ok_or_else(|| bad("filename", "wrong file extension"))?;
                (dir.join("template/iso"), None)
            }
            "vztmpl" => {
                let ok = [".tar.gz", ".tar.xz", ".tar.zst", ".tar.bz2"]
                    .iter()
                    .any(|e| filename.ends_with(e));
                if !ok || filename.len() < 8 {
                    return Err(bad("filename", "wrong file extension"));
                }
                (dir.join("template/cache"), None)
            }
            "import" => {
                let ext = filename
                    .rsplit_once('.')
                    .filter(|(stem, _)| !stem.is_empty())
                    .map(|(_, e)| e)
                    .filter(|e| ["ova", "qcow2", "raw", "vmdk"].contains(e))
                    .ok_or_else(|| bad("filename", "invalid filename or wrong extension"))?;
                (dir.join("import"), (ext != "ova").then(|| ext.to_owned()))
            }
            other => {
                return Err(bad(
                    "content",
                    &format!("upload content type '{other}' not allowed"),
                ));
            }
        };
        if !s.content.contains(&content) {
            return Err(die(format!(
                "storage '{sid}' does not support '{content}' content"
            )));
        }
        Ok((dest_dir, image_format))
    }
}
