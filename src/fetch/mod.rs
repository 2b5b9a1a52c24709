//! Verified downloads into a content-addressed cache. A body only gets a
//! name in the cache after its status, length, magic bytes, decompression
//! and (when pinned) hash all checked out; until then it is a temp file
//! that a crash or kill cannot promote.

use crate::atomic::AtomicFile;
use crate::digest::Sha256;
use crate::io::{
    self, ExactLengthReader, HashingReader, Magic, PeekReader, copy_sparse_from, describe,
};
use crate::net::{self, NetError, Response};
use reqwest::StatusCode;
use reqwest::blocking::Client;
use reqwest::header;
use std::fs::{self, File};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// What a URL promises to deliver, from its file name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expect {
    /// The compression on the wire (`None` for uncompressed).
    pub wire: Option<Magic>,
    /// What the decompressed content must be.
    pub content: Magic,
}

impl Expect {
    /// From a file name: `metal-amd64.raw.zst`, `.raw.xz`, `.raw.gz`, `.raw`,
    /// `.qcow2`, `.iso`; `kernel-<arch>` and `initramfs-<arch>.xz` are kept
    /// as served (a boot loader reads them so).
    pub fn from_name(name: &str) -> Option<(Expect, String)> {
        let boot = if name.starts_with("kernel-") {
            Some(Magic::Kernel)
        } else if name.starts_with("initramfs-") {
            Some(Magic::Initramfs)
        } else {
            None
        };
        if let Some(content) = boot {
            return Some((
                Expect {
                    wire: None,
                    content,
                },
                name.to_owned(),
            ));
        }
        let (stem, wire) = if let Some(s) = name.strip_suffix(".zst") {
            (s, Some(Magic::Zstd))
        } else if let Some(s) = name.strip_suffix(".xz") {
            (s, Some(Magic::Xz))
        } else if let Some(s) = name.strip_suffix(".gz") {
            (s, Some(Magic::Gzip))
        } else {
            (name, None)
        };
        let content = if stem.ends_with(".raw") {
            Magic::Gpt
        } else if stem.ends_with(".qcow2") {
            Magic::Qcow2
        } else if stem.ends_with(".iso") {
            Magic::Iso
        } else {
            return None;
        };
        Some((Expect { wire, content }, stem.to_owned()))
    }
}

/// A pinned digest of the bytes as served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pin {
    Sha256(Sha256),
    /// Lowercase hex.
    Sha512(String),
}

impl std::str::FromStr for Pin {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (algo, hex) = s
            .split_once(':')
            .ok_or_else(|| format!("{s:?}: pin as sha256:<hex> or sha512:<hex>"))?;
        let hex = hex.to_ascii_lowercase();
        let pin = match algo {
            // Plain hex only: what the digest spells back.
            "sha256" => hex
                .parse::<Sha256>()
                .ok()
                .filter(|d| d.hex() == hex)
                .map(Pin::Sha256),
            "sha512" => (hex.len() == 128 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
                .then_some(Pin::Sha512(hex)),
            _ => None,
        };
        pin.ok_or_else(|| format!("{s:?}: pin as sha256:<64 hex> or sha512:<128 hex>"))
    }
}

/// Receives download progress; the CLI draws it, the library never prints.
pub trait Progress: Send + Sync {
    fn start(&self, _url: &str, _total: Option<u64>) {}
    fn advance(&self, _url: &str, _bytes: u64) {}
    fn retry(&self, _url: &str, _attempt: u32, _why: &str) {}
    fn resume(&self, _url: &str, _offset: u64, _why: &str) {}
    fn finish(&self, _url: &str) {}
}

/// Progress that goes nowhere.
pub struct Silent;
impl Progress for Silent {}

/// How downloads behave.
#[derive(Clone)]
pub struct FetchOptions {
    pub cache_dir: PathBuf,
    /// Attempts after the first, for 5xx, resets, timeouts and truncation.
    pub retries: u32,
    /// First pause between attempts; doubles each time.
    pub backoff: Duration,
    /// Longest silence from the server before the attempt is abandoned
    /// (the stall timeout).
    pub read_timeout: Duration,
    /// Longest time the whole download may take, every attempt, resume and
    /// pause included (a server trickling bytes never trips
    /// `read_timeout`, and a per-attempt bound would multiply by the
    /// attempts).
    pub deadline: Duration,
    /// Most bytes a compressed download may decompress to (a bomb of a few
    /// hundred KB can unfold to terabytes).
    pub max_image_size: u64,
    /// Most bytes a kernel may have (a Talos kernel is about 20 MiB).
    pub max_kernel_size: u64,
    /// Most bytes an initramfs may have (a Talos one is about 100 MiB).
    pub max_initramfs_size: u64,
}

impl FetchOptions {
    /// `$XDG_CACHE_HOME/imgbuild`, else `~/.cache/imgbuild`.
    pub fn default_cache_dir() -> PathBuf {
        std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .unwrap_or_else(|| PathBuf::from(".cache"))
            .join("imgbuild")
    }

    /// The bound on what `content` may be, and the flag that raises it.
    fn bound(&self, content: Magic) -> (u64, &'static str) {
        match content {
            Magic::Kernel => (self.max_kernel_size, "--max-kernel-mib"),
            Magic::Initramfs => (self.max_initramfs_size, "--max-initramfs-mib"),
            _ => (self.max_image_size, "--max-image-mib"),
        }
    }

    /// The retry behaviour of the network layer for these options.
    pub fn retry_policy(&self) -> net::RetryPolicy {
        net::RetryPolicy {
            retries: self.retries,
            backoff: self.backoff,
            ..net::RetryPolicy::default()
        }
    }
}

/// A verified file in the cache.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Artifact {
    pub url: String,
    pub path: PathBuf,
    /// SHA-256 and size of the (decompressed) file.
    pub sha256: Sha256,
    pub size: u64,
    /// SHA-256 and size of the bytes as served.
    pub served_sha256: Sha256,
    pub served_size: u64,
    /// True when it came from the cache without a download.
    #[serde(skip)]
    pub cached: bool,
}

/// Why a download failed; every variant names the URL.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error(transparent)]
    Http(#[from] NetError),
    #[error("{url}: expected {expected}, got {found}")]
    WrongContent {
        url: String,
        expected: String,
        found: String,
    },
    #[error("{url}: {message}")]
    Transfer { url: String, message: String },
    #[error("{url}: pinned {algo} {want} but the body hashes to {got}")]
    PinMismatch {
        url: String,
        algo: &'static str,
        want: String,
        got: String,
    },
    #[error(
        "{url}: don't know what {name:?} should contain (expected .raw[.zst|.xz], .qcow2[.zst|.xz] or .iso)"
    )]
    UnknownKind { url: String, name: String },
    #[error(
        "{url}: the server announces {announced} bytes, more than the {limit} a {what} may have (raise {flag} if it is real)"
    )]
    TooLarge {
        url: String,
        what: String,
        announced: u64,
        limit: u64,
        flag: &'static str,
    },
    #[error("{url}: no download within {after:?} (all attempts together; last: {last})")]
    Deadline {
        url: String,
        after: Duration,
        last: String,
    },
    #[error("cache {}: the disk is full (free space, or give --cache-dir on another disk)", path.display())]
    CacheFull {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cache {}", path.display())]
    Cache {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl FetchError {
    /// Worth another attempt: the server or the network, not the content.
    fn retryable(&self) -> bool {
        match self {
            FetchError::Http(e) => e.retryable(),
            FetchError::Transfer { .. } => true,
            _ => false,
        }
    }
}

fn cache_err(path: &Path) -> impl FnOnce(std::io::Error) -> FetchError + '_ {
    move |source| {
        let path = path.to_owned();
        if disk_full(&source) {
            FetchError::CacheFull { path, source }
        } else {
            FetchError::Cache { path, source }
        }
    }
}

/// Whether writing failed for want of space (ENOSPC, or a quota: EDQUOT).
fn disk_full(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::StorageFull
        || e.raw_os_error() == Some(libc::ENOSPC)
        || e.raw_os_error() == Some(libc::EDQUOT)
}

/// The client downloads and factory calls share: system roots, and a fresh
/// connection per request (a retry after a broken body must not reuse the
/// broken connection).
pub fn client(opts: &FetchOptions) -> Client {
    net::http_client(&net::HttpOptions {
        timeout: opts.read_timeout,
        reuse_connections: false,
        ..net::HttpOptions::default()
    })
    .expect("system-root TLS needs no settings that can be wrong")
}

/// Returns the cached artifact for `url`, downloading and verifying it first
/// if needed. Concurrent callers for the same URL download it once.
pub fn fetch(
    client: &Client,
    url: &str,
    pin: Option<&Pin>,
    opts: &FetchOptions,
    progress: &dyn Progress,
) -> Result<Artifact, FetchError> {
    let name = url.rsplit('/').next().unwrap_or_default().to_owned();
    let (expect, stored_name) =
        Expect::from_name(&name).ok_or_else(|| FetchError::UnknownKind {
            url: url.to_owned(),
            name: name.clone(),
        })?;
    // The first 16 bytes of the URL's digest name its cache folder.
    let key = &Sha256::of(url.as_bytes()).hex()[..32];
    let dir = opts.cache_dir.join("images").join(key);
    fs::create_dir_all(&dir).map_err(cache_err(&dir))?;
    let lock_path = dir.join(".lock");
    let _lock = lock(&lock_path)?;
    // A failed holder before us may have removed the folder.
    fs::create_dir_all(&dir).map_err(cache_err(&dir))?;
    let record = dir.join("artifact.json");
    if let Some(mut hit) = load_record(&record, pin) {
        hit.cached = true;
        return Ok(hit);
    }
    let target = dir.join(&stored_name);
    let until = Instant::now() + opts.deadline;
    let mut attempt = 0;
    let artifact = loop {
        let failed = match download(client, url, expect, pin, &target, opts, until, progress) {
            Ok(a) => break a,
            Err(e) if e.retryable() && attempt < opts.retries => {
                let hint = match &e {
                    FetchError::Http(n) => n.wait_hint(),
                    _ => None,
                };
                let pause = opts.retry_policy().delay(attempt + 1, hint);
                if Instant::now() + pause < until {
                    attempt += 1;
                    progress.retry(url, attempt, &e.to_string());
                    std::thread::sleep(pause);
                    continue;
                }
                FetchError::Deadline {
                    url: url.to_owned(),
                    after: opts.deadline,
                    last: e.to_string(),
                }
            }
            Err(e) => e,
        };
        // Leave no trace of a failed entry (a waiter on the lock then
        // simply downloads again).
        let _ = fs::remove_file(&lock_path);
        let _ = fs::remove_dir(&dir);
        return Err(failed);
    };
    // The record is the commit point: without it the entry does not exist.
    let json = serde_json::to_vec_pretty(&artifact).expect("plain data");
    crate::atomic::write_if_changed(&record, &json, false).map_err(cache_err(&record))?;
    Ok(artifact)
}

/// A cache entry is valid when its record exists, its file has the recorded
/// size, and it satisfies the pin.
fn load_record(record: &Path, pin: Option<&Pin>) -> Option<Artifact> {
    let a: Artifact = serde_json::from_slice(&fs::read(record).ok()?).ok()?;
    let size_ok = fs::metadata(&a.path).is_ok_and(|m| m.len() == a.size);
    let pin_ok = match pin {
        None => true,
        Some(Pin::Sha256(h)) => *h == a.served_sha256,
        // A sha512 pin is only known after hashing the served bytes again.
        Some(Pin::Sha512(_)) => false,
    };
    (size_ok && pin_ok).then_some(a)
}

/// An exclusive lock held for the life of the returned file.
fn lock(path: &Path) -> Result<File, FetchError> {
    crate::atomic::lock(path).map_err(cache_err(path))
}

fn transfer(url: &str, e: impl std::fmt::Display) -> FetchError {
    FetchError::Transfer {
        url: url.to_owned(),
        message: e.to_string(),
    }
}

/// Maps an I/O error from deep in the reader stack back to what went wrong.
/// The body layer's own failures are transfer problems (retried; a body that
/// stopped short says so in numbers); anything else was raised by a decoder
/// reading bytes that did arrive, so the content is corrupt (not retried).
fn body_error(
    url: &str,
    e: &std::io::Error,
    got: u64,
    total: Option<u64>,
    expect: Expect,
) -> FetchError {
    let from_body = e
        .get_ref()
        .is_some_and(|inner| inner.is::<BodyBroken>() || inner.is::<io::LengthError>());
    match total {
        _ if !from_body => FetchError::WrongContent {
            url: url.to_owned(),
            expected: format!("a valid {:?} stream", expect.wire.unwrap_or(expect.content))
                .to_lowercase(),
            found: format!("corrupt data after {got} bytes ({})", io_cause(e)),
        },
        Some(total) if got < total => transfer(
            url,
            format!(
                "the body broke off after {got} of {total} bytes ({})",
                io_cause(e)
            ),
        ),
        _ => transfer(url, io_cause(e)),
    }
}

fn stream_error(url: &str, e: std::io::Error) -> FetchError {
    transfer(url, io_cause(&e))
}

/// What an I/O error from the reader stack says, without the wrapper.
fn io_cause(e: &std::io::Error) -> String {
    e.get_ref()
        .map_or_else(|| e.to_string(), |inner| net::error_chain(inner))
}

/// What is left of the time until `until`, or the deadline error.
fn left(url: &str, until: Instant, opts: &FetchOptions) -> Result<Duration, FetchError> {
    let left = until.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(FetchError::Deadline {
            url: url.to_owned(),
            after: opts.deadline,
            last: "the time ran out".into(),
        });
    }
    Ok(left)
}

/// One attempt, ending by `until`: GET, check, stream through the
/// verifying stack into a temp file next to `target`, then rename.
#[allow(clippy::too_many_arguments)]
fn download(
    client: &Client,
    url: &str,
    expect: Expect,
    pin: Option<&Pin>,
    target: &Path,
    opts: &FetchOptions,
    until: Instant,
    progress: &dyn Progress,
) -> Result<Artifact, FetchError> {
    let resp = net::send_once(client.get(url).timeout(left(url, until, opts)?))?
        .with_stall(opts.read_timeout);
    let total = resp.content_length();
    let (bound, flag) = opts.bound(expect.content);
    // A body larger than its content may be is refused before it is read
    // (a compressed one is smaller than what it unfolds to).
    if let Some(n) = total.filter(|&n| n > bound) {
        return Err(FetchError::TooLarge {
            url: url.to_owned(),
            what: format!("{:?}", expect.content).to_lowercase(),
            announced: n,
            limit: bound,
            flag,
        });
    }
    // What the content may unfold to: the bound, and for a compressed body
    // of known length 1000 times that length (Talos images compress about
    // 10:1; zeros alone go past 10000:1), but never less than 64 MiB
    // (small test images are mostly zeros).
    let cap = match (expect.wire, total) {
        (Some(_), Some(n)) => bound.min(n.saturating_mul(MAX_RATIO).max(MIN_RATIO_CAP)),
        _ => bound,
    };
    progress.start(url, total);
    let body = ProgressReader {
        inner: ResumableBody::new(client, url, resp, opts, until, progress),
        url,
        progress,
    };
    let bounded: Box<dyn Read + '_> = match total {
        Some(n) => Box::new(ExactLengthReader::new(body, n)),
        None => Box::new(body),
    };
    let mut served = HashingReader::new(bounded, matches!(pin, Some(Pin::Sha512(_))));
    let wire = match PeekReader::new(&mut served, Magic::PEEK) {
        Ok(w) => w,
        Err(e) => return Err(body_error(url, &e, served.count(), total, expect)),
    };
    let wire_kind = expect.wire.unwrap_or(expect.content);
    if !wire_kind.matches(wire.peek()) {
        return Err(FetchError::WrongContent {
            url: url.to_owned(),
            expected: format!("{wire_kind:?} data").to_lowercase(),
            found: describe(wire.peek()),
        });
    }
    let decoded = match expect.wire {
        Some(Magic::Zstd) => {
            Decoder::Zstd(zstd::Decoder::new(wire).map_err(|e| stream_error(url, e))?)
        }
        Some(Magic::Xz) => Decoder::Xz(liblzma::read::XzDecoder::new_parallel(wire)),
        Some(Magic::Gzip) => Decoder::Gzip(flate2::read::MultiGzDecoder::new(wire)),
        _ => Decoder::Plain(wire),
    };
    let mut content = HashingReader::new(decoded.take(cap + 1), false);
    let inner = match PeekReader::new(&mut content, Magic::PEEK) {
        Ok(i) => i,
        Err(e) => {
            drop(content); // ends the borrow of the served-bytes counter
            return Err(body_error(url, &e, served.count(), total, expect));
        }
    };
    if !expect.content.matches(inner.peek()) {
        return Err(FetchError::WrongContent {
            url: url.to_owned(),
            expected: format!("{:?} inside", expect.content).to_lowercase(),
            found: describe(inner.peek()),
        });
    }
    let mut tmp = AtomicFile::create(target, false).map_err(cache_err(target))?;
    if let Err(e) = copy_sparse_from(inner, tmp.file()) {
        // Writing the cache failed: the disk, not the content (not retried).
        if disk_full(&e) {
            return Err(cache_err(target)(e));
        }
        drop(content); // ends the borrow of the served-bytes counter
        return Err(body_error(url, &e, served.count(), total, expect));
    }
    let consumed = content.get_mut().get_ref().compressed_input();
    let unfolded = content.count();
    let (sha256, _) = content.finish();
    if unfolded > cap {
        let what = format!("{:?}", expect.content).to_lowercase();
        return Err(FetchError::WrongContent {
            url: url.to_owned(),
            expected: format!("a {what} of at most {cap} bytes"),
            found: match expect.wire {
                Some(_) => format!(
                    "more after decompressing {} served bytes (raise {flag} if it is real)",
                    served.count()
                ),
                None => format!("more (raise {flag} if it is real)"),
            },
        });
    }
    // The decompressor stops at the end of its stream; whatever follows must
    // still be read, so the served hash (and pin) covers the whole body and
    // the length check sees its end. The decoder's own input count tells
    // bytes it buffered but did not use.
    let drained = std::io::copy(&mut served, &mut std::io::sink());
    drained.map_err(|e| body_error(url, &e, served.count(), total, expect))?;
    let trailing = consumed.map_or(0, |used| served.count().saturating_sub(used));
    if trailing > 0 {
        return Err(FetchError::WrongContent {
            url: url.to_owned(),
            expected: "nothing after the compressed image".into(),
            found: format!("{trailing} more bytes"),
        });
    }
    let size = fs::metadata(tmp.temp_path())
        .map_err(cache_err(target))?
        .len();
    let served_size = served.count();
    let (served_sha256, served_sha512) = served.finish();
    match pin {
        Some(Pin::Sha256(want)) if *want != served_sha256 => {
            return Err(FetchError::PinMismatch {
                url: url.to_owned(),
                algo: "sha256",
                want: want.to_string(),
                got: served_sha256.to_string(),
            });
        }
        Some(Pin::Sha512(want)) if Some(want) != served_sha512.as_ref() => {
            return Err(FetchError::PinMismatch {
                url: url.to_owned(),
                algo: "sha512",
                want: want.clone(),
                got: served_sha512.unwrap_or_default(),
            });
        }
        _ => {}
    }
    tmp.commit().map_err(cache_err(target))?;
    progress.finish(url);
    Ok(Artifact {
        url: url.to_owned(),
        path: target.to_owned(),
        sha256,
        size,
        served_sha256,
        served_size,
        cached: false,
    })
}

/// How many times its compressed size an image may be, above a floor.
const MAX_RATIO: u64 = 1000;
const MIN_RATIO_CAP: u64 = 64 << 20;

/// The decompressor (or none) between the served bytes and the image.
enum Decoder<R: Read> {
    Zstd(zstd::Decoder<'static, std::io::BufReader<R>>),
    Xz(liblzma::read::XzDecoder<R>),
    Gzip(flate2::read::MultiGzDecoder<R>),
    Plain(R),
}

impl<R: Read> Decoder<R> {
    /// Compressed bytes the decoder used, where it can tell (zstd and gzip
    /// instead read on and fail on anything after their frames/members).
    fn compressed_input(&self) -> Option<u64> {
        match self {
            Decoder::Xz(d) => Some(d.total_in()),
            _ => None,
        }
    }
}

impl<R: Read> Read for Decoder<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Decoder::Zstd(d) => d.read(buf),
            Decoder::Xz(d) => d.read(buf),
            Decoder::Gzip(d) => d.read(buf),
            Decoder::Plain(r) => r.read(buf),
        }
    }
}

/// Marks an I/O error as coming from the body itself (the connection), so it
/// can be told apart from a decoder's complaint about the content.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct BodyBroken(String);

/// A response body that, when the connection breaks, asks for the rest
/// with `Range` (guarded by `If-Range`) and carries on where it stopped, so
/// the readers above never notice. Servers that cannot resume get the
/// original error back, and the whole download is retried instead.
struct ResumableBody<'a> {
    client: &'a Client,
    url: &'a str,
    resp: Response,
    offset: u64,
    total: Option<u64>,
    validator: Option<String>,
    ranges: bool,
    resumes_left: u32,
    backoff: Duration,
    /// The stall timeout each reopened body gets.
    stall: Duration,
    /// When the whole download must be done.
    until: Instant,
    progress: &'a dyn Progress,
}

impl<'a> ResumableBody<'a> {
    fn new(
        client: &'a Client,
        url: &'a str,
        resp: Response,
        opts: &FetchOptions,
        until: Instant,
        progress: &'a dyn Progress,
    ) -> Self {
        let h = resp.headers();
        let ranges = h
            .get(header::ACCEPT_RANGES)
            .is_some_and(|v| v.as_bytes() == b"bytes");
        let validator = h
            .get(header::ETAG)
            .or_else(|| h.get(header::LAST_MODIFIED))
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        ResumableBody {
            client,
            url,
            total: resp.content_length(),
            resp,
            offset: 0,
            validator,
            ranges,
            resumes_left: opts.retries,
            backoff: opts.backoff,
            stall: opts.read_timeout,
            until,
            progress,
        }
    }

    /// GET the rest; only a 206 starting exactly at `offset` will do.
    fn reopen(&self) -> Result<Response, String> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err("the download deadline has passed".into());
        }
        let mut req = self
            .client
            .get(self.url)
            .header(header::RANGE, format!("bytes={}-", self.offset))
            .timeout(left);
        if let Some(v) = &self.validator {
            req = req.header(header::IF_RANGE, v);
        }
        let resp = net::send_once(req)
            .map_err(|e| e.to_string())?
            .with_stall(self.stall);
        let want = format!("bytes {}-", self.offset);
        let starts_right = resp
            .headers()
            .get(header::CONTENT_RANGE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with(&want));
        if resp.status() == StatusCode::PARTIAL_CONTENT && starts_right {
            Ok(resp)
        } else {
            Err(format!(
                "the server answered {} to a resume at byte {}",
                resp.status(),
                self.offset
            ))
        }
    }
}

impl Read for ResumableBody<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            let err = match self.resp.read(buf) {
                Ok(0) if self.total.is_some_and(|t| self.offset < t) => std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the connection closed early",
                ),
                Ok(n) => {
                    self.offset += n as u64;
                    return Ok(n);
                }
                Err(e) => e,
            };
            if !self.ranges || self.total.is_none() || self.resumes_left == 0 {
                return Err(std::io::Error::other(BodyBroken(io_cause(&err))));
            }
            self.resumes_left -= 1;
            std::thread::sleep(self.backoff);
            self.progress.resume(self.url, self.offset, &io_cause(&err));
            match self.reopen() {
                Ok(resp) => self.resp = resp,
                Err(why) => {
                    let msg = format!("{}; {why}", io_cause(&err));
                    return Err(std::io::Error::other(BodyBroken(msg)));
                }
            }
        }
    }
}

struct ProgressReader<'a, R> {
    inner: R,
    url: &'a str,
    progress: &'a dyn Progress,
}

impl<R: Read> Read for ProgressReader<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.progress.advance(self.url, n as u64);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_say_what_to_expect() {
        let (e, stored) = Expect::from_name("metal-amd64.raw.zst").unwrap();
        assert_eq!(
            (e.wire, e.content, stored.as_str()),
            (Some(Magic::Zstd), Magic::Gpt, "metal-amd64.raw")
        );
        let (e, _) = Expect::from_name("nocloud-amd64.raw.xz").unwrap();
        assert_eq!(e.wire, Some(Magic::Xz));
        let (e, stored) = Expect::from_name("digital-ocean-amd64.raw.gz").unwrap();
        assert_eq!(
            (e.wire, stored.as_str()),
            (Some(Magic::Gzip), "digital-ocean-amd64.raw")
        );
        let (e, stored) = Expect::from_name("metal-amd64.qcow2").unwrap();
        assert_eq!(
            (e.wire, e.content, stored.as_str()),
            (None, Magic::Qcow2, "metal-amd64.qcow2")
        );
        assert_eq!(
            Expect::from_name("metal-amd64.iso").unwrap().0.content,
            Magic::Iso
        );
        assert!(Expect::from_name("metal-amd64.vhd").is_none());
    }

    #[test]
    fn a_body_that_unfolds_past_1000_times_its_size_is_refused() {
        use std::io::Write;
        let mut enc = zstd::Encoder::new(Vec::new(), 3).unwrap();
        let mut head = vec![0u8; 1024];
        head[512..520].copy_from_slice(b"EFI PART");
        enc.write_all(&head).unwrap();
        for _ in 0..80 {
            enc.write_all(&[0u8; 1 << 20]).unwrap();
        }
        let bomb = enc.finish().unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!(
            "http://{}/metal-amd64.raw.zst",
            listener.local_addr().unwrap()
        );
        std::thread::spawn(move || {
            let Ok((mut conn, _)) = listener.accept() else {
                return;
            };
            let mut head = [0u8; 4096];
            let _ = conn.read(&mut head);
            let _ = write!(
                conn,
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n",
                bomb.len()
            );
            let _ = conn.write_all(&bomb);
        });
        let dir = tempfile::tempdir().unwrap();
        let opts = FetchOptions {
            cache_dir: dir.path().to_owned(),
            retries: 0,
            backoff: Duration::from_millis(1),
            read_timeout: Duration::from_secs(10),
            deadline: Duration::from_secs(30),
            max_image_size: 16 << 30,
            max_kernel_size: 64 << 20,
            max_initramfs_size: 512 << 20,
        };
        let err = fetch(&client(&opts), &url, None, &opts, &Silent).unwrap_err();
        assert!(
            err.to_string()
                .contains(&format!("at most {MIN_RATIO_CAP} bytes")),
            "{err}"
        );
    }

    #[test]
    fn pins_parse_strictly() {
        let h = "a".repeat(64);
        assert_eq!(
            format!("sha256:{h}").parse::<Pin>(),
            Ok(Pin::Sha256(h.parse().unwrap()))
        );
        assert!(format!("sha512:{h}").parse::<Pin>().is_err());
        assert!("md5:abc".parse::<Pin>().is_err());
        assert!(h.parse::<Pin>().is_err());
    }
}
