//! Uploads: each image streamed (constant memory) into the storage as a
//! content-addressed volume, checked by the server against its sha256.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use reqwest::multipart::{Form, Part};
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_util::bytes::Bytes;

use super::api::{Api, api_error, urlencode};
use super::error::ProxmoxError;
use super::qcow2::Qcow2;
use super::types::{Event, Observer, PublishOptions};
use crate::digest::Sha256;
use crate::inventory::{ImageFormat, ProxmoxSettings};
use crate::net::{self, NetError};
use crate::publish::PublishImage;

/// What separates the cluster from the node in an upload's name: cluster
/// and node names are DNS labels (`a-z`, `0-9`, `-`), so it occurs in
/// neither, and cluster `a` with node `b-c` never names a file as cluster
/// `a-b` with node `c` would (`<cluster>-<node>`, the scheme before it,
/// did: see `destroy::parse_upload` for how such names are still read).
pub const UPLOAD_SEPARATOR: char = '_';

/// The file name a node's image gets in storage, as pveproxy will store it:
/// content-addressed (`<cluster>_<node>-<talos>-<sha12>.<raw|qcow2>`, see
/// [`UPLOAD_SEPARATOR`]) and normalised the way the server normalises
/// (every character outside `[a-zA-Z0-9_.-]` becomes `_`).
pub fn volume_file(
    cluster: &str,
    node: &str,
    talos: &str,
    sha256: &Sha256,
    format: ImageFormat,
) -> String {
    let ext = match format {
        ImageFormat::Raw => "raw",
        ImageFormat::Qcow2 => "qcow2",
        ImageFormat::Iso => "iso",
    };
    let stem: String = format!(
        "{cluster}{UPLOAD_SEPARATOR}{node}-{talos}-{}",
        &sha256.hex()[..12]
    )
    .chars()
    .map(|c| {
        if c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-') {
            c
        } else {
            '_'
        }
    })
    .collect();
    format!("{stem}.{ext}")
}

/// The multipart body of an upload, in the only order pveproxy's streaming
/// parser accepts (pve-http-server `src/PVE/APIServer/AnyEvent.pm`
/// `file_upload_multipart`): `content`, `checksum-algorithm`, `checksum`,
/// then the file part named `filename`, with a known length (pveproxy
/// refuses an upload without a Content-Length), its bytes taken from
/// `chunks` in constant memory. `sent` counts them as they leave (see
/// [`Counted`]).
fn upload_form(
    chunks: mpsc::Receiver<std::io::Result<Bytes>>,
    size: u64,
    name: &str,
    sha256: &Sha256,
    content: &'static str,
    sent: Arc<AtomicU64>,
) -> Form {
    let mut chunks = chunks;
    let body = reqwest::Body::wrap_stream(Counted {
        inner: futures_util::stream::poll_fn(move |cx| chunks.poll_recv(cx)),
        handed_out: 0,
        sent,
    });
    Form::new()
        .text("content", content)
        .text("checksum-algorithm", "sha256")
        .text("checksum", sha256.hex())
        .part(
            "filename",
            Part::stream_with_length(body, size)
                .file_name(name.to_owned())
                .mime_str("application/octet-stream")
                .expect("a valid MIME type"),
        )
}

/// The storage content type a format is uploaded as: disk images to
/// `import` (for `import-from`), boot ISOs to `iso` (for a cdrom drive).
pub fn content_for(format: ImageFormat) -> &'static str {
    match format {
        ImageFormat::Iso => "iso",
        ImageFormat::Raw | ImageFormat::Qcow2 => "import",
    }
}

/// What an upload's file part is made of.
#[derive(Clone, Copy)]
enum Body<'a> {
    /// The image file as it is.
    File,
    /// The raw image as qcow2, generated as it is sent.
    Qcow2(&'a Qcow2),
}

/// Streams the image file to Proxmox node `host` as the volume `volid`;
/// see [`upload_body`].
pub(super) fn upload(
    api: &Api,
    host: &str,
    s: &ProxmoxSettings,
    img: &PublishImage,
    volid: &str,
    opts: &PublishOptions,
    observer: &dyn Observer,
) -> Result<(), ProxmoxError> {
    upload_body(api, host, s, img, volid, opts, observer, Body::File)
}

/// Sends the raw image as a qcow2 of its non-zero clusters (the volume
/// `volid`), generated as it is sent: no file is written. The server
/// checks the qcow2's sha256, which it must have before the file's first
/// byte, so the image's data is read three times (scan, hash, send), the
/// last two from the page cache; see [`Qcow2`].
pub(super) fn upload_qcow2(
    api: &Api,
    host: &str,
    s: &ProxmoxSettings,
    img: &PublishImage,
    volid: &str,
    opts: &PublishOptions,
    observer: &dyn Observer,
) -> Result<(), ProxmoxError> {
    let err = |e: std::io::Error| ProxmoxError::Api {
        what: format!("converting {} to qcow2", img.path.display()),
        message: e.to_string(),
    };
    let qcow2 = Qcow2::scan(&img.path).map_err(err)?;
    let converted = PublishImage {
        size: qcow2.len(),
        sha256: qcow2.sha256().map_err(err)?,
        format: ImageFormat::Qcow2,
        ..img.clone()
    };
    upload_body(
        api,
        host,
        s,
        &converted,
        volid,
        opts,
        observer,
        Body::Qcow2(&qcow2),
    )
}

/// Streams `body` to Proxmox node `host` as the multipart body of the
/// volume `volid` (constant memory), waits for the server's task
/// (checksum, `qemu-img info`, copy), and retries a broken transfer from
/// the start. A failed upload leaves no volume behind.
#[allow(clippy::too_many_arguments)]
fn upload_body(
    api: &Api,
    host: &str,
    s: &ProxmoxSettings,
    img: &PublishImage,
    volid: &str,
    opts: &PublishOptions,
    observer: &dyn Observer,
    body: Body<'_>,
) -> Result<(), ProxmoxError> {
    let file_name = volid.rsplit('/').next().unwrap_or(volid);
    let what = format!("uploading {file_name}");
    let url = api.url(&format!("/nodes/{host}/storage/{}/upload", s.storage));
    let mut attempt = 0;
    loop {
        observer.event(
            &img.node,
            &Event::Uploading {
                volid: volid.to_owned(),
                size: img.size,
            },
        );
        let sent = send_upload(api, &url, img, body, file_name, &|n| {
            observer.sent(&img.node, n)
        });
        match sent {
            Ok(body) => {
                let doc: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                let result = api.wait(&what, &doc["data"], opts);
                if result.is_err() {
                    discard_volume(api, host, s, volid);
                }
                return result.map(|()| {
                    observer.event(
                        &img.node,
                        &Event::Uploaded {
                            volid: volid.to_owned(),
                        },
                    )
                });
            }
            Err(e) if e.retryable() && e.status().is_none() && attempt < opts.upload_retries => {
                attempt += 1;
                observer.event(
                    &img.node,
                    &Event::UploadRetry {
                        attempt,
                        why: e.to_string(),
                    },
                );
                std::thread::sleep(opts.retry.delay(attempt, None));
            }
            Err(e) => {
                let err = api_error(&what, e);
                return Err(match err {
                    ProxmoxError::Api { what, message } if attempt > 0 => ProxmoxError::Api {
                        what,
                        message: format!("{message} (after {} attempts)", attempt + 1),
                    },
                    other => other,
                });
            }
        }
    }
}

/// Why `upload: download-url` cannot fetch a node's image from the
/// factory, if it cannot: the image was patched offline (its bytes are on
/// no server), or its factory URL is not http(s) (the only schemes
/// download-url takes). Checked for every node before anything is sent.
pub fn download_problem(img: &PublishImage) -> Option<String> {
    let Some(url) = &img.source_url else {
        return Some(format!(
            "node {}: publish.proxmox.upload: download-url needs the image from the factory \
             route (build --route factory); this one was patched offline, so no server has its bytes",
            img.node
        ));
    };
    let scheme = url.split_once("://").map(|(s, _)| s.to_ascii_lowercase());
    if !matches!(scheme.as_deref(), Some("http" | "https")) {
        return Some(format!(
            "node {}: publish.proxmox.upload: download-url needs an http(s) factory URL, not {}",
            img.node,
            crate::input::quote(url)
        ));
    }
    None
}

/// Has Proxmox node `host` fetch the node's image from the factory as the
/// volume `volid` (storage `download-url`, checked there against the
/// image's sha256) and waits for its task: the runner sends no image
/// bytes. A failed task leaves no volume (the server fetches to a temp
/// file); one left anyway is removed. pve-storage Status.pm `download_url`
/// takes `import` content for qcow2/raw images from libpve-storage-perl
/// 8.3.6 (PVE 8.4); the factory's certificate is checked (the default
/// `verify-certificates=1`); no `compression`, which it applies to ISOs only.
pub(super) fn download(
    api: &Api,
    host: &str,
    s: &ProxmoxSettings,
    img: &PublishImage,
    volid: &str,
    opts: &PublishOptions,
    observer: &dyn Observer,
) -> Result<(), ProxmoxError> {
    if let Some(why) = download_problem(img) {
        return Err(ProxmoxError::Setup(why));
    }
    let url = img.source_url.clone().unwrap_or_default();
    let file_name = volid.rsplit('/').next().unwrap_or(volid);
    observer.event(
        &img.node,
        &Event::Downloading {
            volid: volid.to_owned(),
            url: url.clone(),
        },
    );
    let what = format!("Proxmox node {host} fetching {file_name} from the factory");
    let form = [
        ("url", url),
        ("filename", file_name.to_owned()),
        ("content", content_for(img.format).to_owned()),
        ("checksum", img.sha256.hex()),
        ("checksum-algorithm", "sha256".to_owned()),
    ];
    let path = format!("/nodes/{host}/storage/{}/download-url", s.storage);
    let task = api.post(&what, &path, &form)?;
    let result = api.wait(&what, &task, opts);
    if result.is_err() {
        discard_volume(api, host, s, volid);
    }
    result?;
    observer.event(
        &img.node,
        &Event::Downloaded {
            volid: volid.to_owned(),
        },
    );
    Ok(())
}

/// One upload attempt on a runtime of its own (the publisher is blocking
/// code), telling `progress` how many bytes have left; returns the reply
/// body. The file part's bytes are read (or generated) on a thread of
/// their own, a few 1 MiB chunks ahead of the sender, so reading and
/// encrypting overlap.
fn send_upload(
    api: &Api,
    url: &str,
    img: &PublishImage,
    body: Body<'_>,
    file_name: &str,
    progress: &dyn Fn(u64),
) -> Result<Vec<u8>, NetError> {
    let local = |e: std::io::Error| NetError::Transfer {
        method: "reading".into(),
        url: img.path.display().to_string(),
        message: e.to_string(),
        before_sending: true,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(local)?;
    let file = match body {
        Body::File => {
            let file = crate::io::open_regular(&img.path, false).map_err(local)?;
            let len = file.metadata().map_err(local)?.len();
            if len != img.size {
                return Err(local(std::io::Error::other(format!(
                    "the file has {len} bytes, the manifest says {}: rebuild the image",
                    img.size
                ))));
            }
            Some(file)
        }
        Body::Qcow2(_) => None,
    };
    let sent = Arc::new(AtomicU64::new(0));
    let counter = sent.clone();
    let (tx, rx) = mpsc::channel(AHEAD);
    std::thread::scope(|scope| {
        scope.spawn(move || match (body, file) {
            (Body::Qcow2(q), _) => produce_qcow2(q, &tx),
            (Body::File, Some(file)) => produce_file(&file, img.size, &tx),
            (Body::File, None) => {}
        });
        let attempt = async {
            let req = api
                .uploads
                .post(url)
                .header(reqwest::header::AUTHORIZATION, api.auth.clone())
                // The API deadline, plus the image at 256 KiB/s.
                .timeout(net::request_deadline() + Duration::from_secs(img.size >> 18))
                .multipart(upload_form(
                    rx,
                    img.size,
                    file_name,
                    &img.sha256,
                    content_for(img.format),
                    counter,
                ));
            let resp = net::send_once_async(req).await?;
            net::read_limited_async(resp, 1 << 20, false, api.stall).await
        };
        // The request (and the channel's receiver in it) is dropped when
        // this returns, which ends the producer if it is still sending.
        rt.block_on(async {
            tokio::pin!(attempt);
            let mut tick = tokio::time::interval(PROGRESS_EVERY);
            let mut told = 0;
            let mut tell = || {
                let now = sent.load(Ordering::Relaxed);
                if now != told {
                    told = now;
                    progress(now);
                }
            };
            loop {
                tokio::select! {
                    result = &mut attempt => {
                        tell();
                        return result;
                    }
                    _ = tick.tick() => tell(),
                }
            }
        })
    })
}

/// Chunks the producer may have ready ahead of the sender (memory: this
/// many MiB, plus the one being sent).
const AHEAD: usize = 4;

/// A MiB of zeros: a hole is sent from here, never read from the file.
static ZEROS: [u8; crate::io::BUF_SIZE] = [0; crate::io::BUF_SIZE];

/// Sends the generated qcow2 into `tx` until its end, an error (sent on as
/// the body's error) or the receiver being gone.
fn produce_qcow2(q: &Qcow2, tx: &mpsc::Sender<std::io::Result<Bytes>>) {
    let mut buf = vec![0u8; crate::io::BUF_SIZE];
    let mut chunks = q.chunks();
    loop {
        let next = match chunks.next_into(&mut buf) {
            Ok(Some(n)) => Ok(Bytes::copy_from_slice(&buf[..n])),
            Ok(None) => return,
            Err(e) => Err(e),
        };
        let failed = next.is_err();
        if tx.blocking_send(next).is_err() || failed {
            return;
        }
    }
}

/// Sends the file's `size` bytes into `tx` in 1 MiB chunks: its data
/// extents read, its holes (SEEK_DATA/SEEK_HOLE) sent as zeros without a
/// read. Ends at the end, an error (sent on) or the receiver being gone.
fn produce_file(file: &File, size: u64, tx: &mpsc::Sender<std::io::Result<Bytes>>) {
    let zeros = |from: u64, to: u64| -> bool {
        let mut at = from;
        while at < to {
            let n = (to - at).min(ZEROS.len() as u64) as usize;
            if tx
                .blocking_send(Ok(Bytes::from_static(&ZEROS[..n])))
                .is_err()
            {
                return false;
            }
            at += n as u64;
        }
        true
    };
    let mut buf = vec![0u8; crate::io::BUF_SIZE];
    let mut pos = 0u64;
    let result = (|| -> std::io::Result<bool> {
        for extent in crate::io::data_extents(file, size) {
            let (start, end) = extent?;
            if !zeros(pos, start) {
                return Ok(false);
            }
            let mut at = start;
            while at < end {
                let n = (end - at).min(buf.len() as u64) as usize;
                file.read_exact_at(&mut buf[..n], at)?;
                if tx
                    .blocking_send(Ok(Bytes::copy_from_slice(&buf[..n])))
                    .is_err()
                {
                    return Ok(false);
                }
                at += n as u64;
            }
            pos = end;
        }
        Ok(zeros(pos, size))
    })();
    if let Err(e) = result {
        let _ = tx.blocking_send(Err(e));
    }
}

/// A body stream that counts the bytes the HTTP client has consumed: a
/// chunk counts once the client asks for the next one (hyper writes a
/// chunk out before it polls the body again), so the count follows the
/// bytes leaving, not the file being read ahead.
pub(super) struct Counted<S> {
    inner: S,
    /// The size of the chunk last handed to the client, not yet counted.
    handed_out: u64,
    sent: Arc<AtomicU64>,
}

impl<S, B, E> futures_util::Stream for Counted<S>
where
    S: futures_util::Stream<Item = Result<B, E>> + Unpin,
    B: AsRef<[u8]>,
{
    type Item = Result<B, E>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        let this = &mut *self;
        let done = std::mem::take(&mut this.handed_out);
        this.sent.fetch_add(done, Ordering::Relaxed);
        let next = std::pin::Pin::new(&mut this.inner).poll_next(cx);
        if let std::task::Poll::Ready(Some(Ok(chunk))) = &next {
            this.handed_out = chunk.as_ref().len() as u64;
        }
        next
    }
}

/// How often an upload's progress is reported.
const PROGRESS_EVERY: Duration = Duration::from_millis(100);

/// Removes a volume an upload may have left half-checked; best effort,
/// since the upload's own error is what the user needs to see.
fn discard_volume(api: &Api, host: &str, s: &ProxmoxSettings, volid: &str) {
    let path = format!(
        "/nodes/{host}/storage/{}/content/{}",
        s.storage,
        urlencode(volid)
    );
    let _ = api.delete("removing a failed upload", &path);
}

#[cfg(test)]
mod counted {
    use super::*;
    use futures_util::StreamExt;

    /// A chunk counts only once the client comes back for the next one:
    /// the count trails what was read by exactly the chunk in flight.
    #[test]
    fn bytes_count_when_the_client_takes_the_next_chunk() {
        let chunks: Vec<Result<Vec<u8>, ()>> = vec![Ok(vec![0; 5]), Ok(vec![0; 7]), Ok(vec![0; 3])];
        let sent = Arc::new(AtomicU64::new(0));
        let mut body = Counted {
            inner: futures_util::stream::iter(chunks),
            handed_out: 0,
            sent: sent.clone(),
        };
        let mut seen = Vec::new();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            while body.next().await.is_some() {
                seen.push(sent.load(Ordering::Relaxed));
            }
        });
        assert_eq!(seen, [0, 5, 12]);
        assert_eq!(sent.load(Ordering::Relaxed), 15);
    }
}
