//! One HTTP/TLS layer for every client imgbuild has (factory, downloads,
//! Kubernetes, publishers; the Talos gRPC client takes its TLS from
//! [`tls`]): how clients are built, which failures are retried and how
//! long to wait, and how a failed response is shown — its status and the
//! first bytes of its body, never a header, so never a credential.

pub mod proxy;
pub mod tls;

mod body;

use reqwest::blocking::{Client, RequestBuilder};
use reqwest::header;
use std::io::Read;
use std::time::{Duration, Instant, SystemTime};

pub use body::{Response, Stalled};

pub use tls::{ClientIdentity, Trust};

/// Where `--debug` lines go: the CLI's stderr writer, which redacts every
/// known secret. Unset: nothing is logged, and no line is even made.
static DEBUG_LOG: std::sync::OnceLock<fn(&str)> = std::sync::OnceLock::new();

/// `--debug`: one line per HTTP request and gRPC call to `sink` — method,
/// URL or path, status, time — and never a header, a body or a query value
/// that may be a credential ([`debug_url`]).
pub fn debug_to(sink: fn(&str)) {
    let _ = DEBUG_LOG.set(sink);
}

/// Whether `--debug` asked for the request log.
pub fn debugging() -> bool {
    DEBUG_LOG.get().is_some()
}

/// One `--debug` line, made only when someone listens.
pub fn debug_line(line: impl FnOnce() -> String) {
    if let Some(sink) = DEBUG_LOG.get() {
        sink(&line());
    }
}

/// Query parameters whose value `--debug` never shows: any name holding one
/// of these (`access_token`, `X-Amz-Signature`, `ticket`, …).
const SECRET_PARAMETERS: [&str; 9] = [
    "token",
    "key",
    "secret",
    "pass",
    "ticket",
    "sig",
    "auth",
    "credential",
    "session",
];

/// A URL as the `--debug` log shows it: [`display_url`], and the value of
/// every query parameter that may be a credential replaced.
pub fn debug_url(url: &reqwest::Url) -> String {
    let mut u = url.clone();
    let _ = u.set_username("");
    let _ = u.set_password(None);
    if u.query().is_some() {
        let pairs: Vec<(String, String)> = u
            .query_pairs()
            .map(|(k, v)| {
                let lower = k.to_ascii_lowercase();
                let secret = SECRET_PARAMETERS.iter().any(|s| lower.contains(s));
                let v = if secret {
                    "redacted".to_owned()
                } else {
                    v.into_owned()
                };
                (k.into_owned(), v)
            })
            .collect();
        u.query_pairs_mut().clear().extend_pairs(pairs);
    }
    u.to_string()
}

/// The `--debug` line of one HTTP exchange, when its reply's headers came
/// (or it failed): `HTTP PUT URL → 200 OK in 12 ms`.
fn debug_exchange(
    method: &str,
    url: &reqwest::Url,
    started: Instant,
    outcome: Result<(reqwest::StatusCode, &reqwest::Url), &NetError>,
) {
    debug_line(|| {
        let took = started.elapsed().as_millis();
        let what = format!("HTTP {method} {}", debug_url(url));
        match outcome {
            Ok((status, at)) if at == url => format!("{what} → {status} in {took} ms"),
            Ok((status, at)) => format!(
                "{what} → {status} in {took} ms (redirected to {})",
                debug_url(at)
            ),
            // The request is named once, at the start of the line.
            Err(NetError::Transfer { message, .. } | NetError::Untrusted { message, .. }) => {
                format!("{what} → failed after {took} ms: {message}")
            }
            Err(e) => format!("{what} → failed after {took} ms: {}", error_chain(e)),
        }
    });
}

/// `User-Agent` on every request, so server logs can tell imgbuild apart.
pub const USER_AGENT: &str = concat!("imgbuild/", env!("CARGO_PKG_VERSION"));

/// How much of an error body is kept for parsing (API error objects), and
/// how much of it a message shows.
const ERROR_BODY_KEEP: u64 = 16 << 10;
const ERROR_BODY_SHOW: usize = 200;

/// Why an HTTP exchange failed. Every variant names the request; none
/// carries a header.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// The server answered with a non-success status.
    #[error("{method} {url}: HTTP {status}: {}", shown(body))]
    Status {
        method: String,
        url: String,
        status: u16,
        /// The first bytes of the body (at most 16 KiB), for callers that
        /// parse API error objects; messages show the first 200 characters.
        body: String,
        /// What `Retry-After` or `RateLimit-Reset` asked for.
        #[source]
        wait: Option<WaitHint>,
    },
    /// No answer: connection refused or reset, timeout, TLS failure.
    #[error("{method} {url}: {message}")]
    Transfer {
        method: String,
        url: String,
        message: String,
        /// True when the request cannot have reached the server.
        before_sending: bool,
    },
    /// The server's certificate was refused (wrong pin, unknown issuer,
    /// wrong name): no request was sent, and trying again cannot help.
    #[error("{method} {url}: {message}")]
    Untrusted {
        method: String,
        url: String,
        message: String,
    },
    /// A body larger than the caller allows.
    #[error("{method} {url}: the reply is larger than {limit} bytes")]
    TooLarge {
        method: String,
        url: String,
        limit: u64,
    },
    /// The client could not be built (bad CA, key or pin).
    #[error("TLS settings: {0}")]
    Tls(#[from] tls::TlsError),
}

/// A server's request to wait before trying again.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the server asked to wait {0:?}")]
pub struct WaitHint(pub Duration);

fn shown(body: &str) -> String {
    let t = body.trim();
    let lower = t.to_ascii_lowercase();
    if lower.starts_with("<!doctype html") || lower.starts_with("<html") {
        return "an HTML error page".into();
    }
    // One line: a newline in a server's text must not start a line of ours.
    crate::input::one_line(t, ERROR_BODY_SHOW)
}

impl NetError {
    /// Worth another attempt: the server is busy or failing, rate limits
    /// apply, or the request never got through. Content and client errors
    /// are not.
    pub fn retryable(&self) -> bool {
        match self {
            NetError::Status { status, .. } => *status >= 500 || *status == 429,
            NetError::Transfer { .. } => true,
            NetError::Untrusted { .. } | NetError::TooLarge { .. } | NetError::Tls(_) => false,
        }
    }

    /// The HTTP status, when the server answered.
    pub fn status(&self) -> Option<u16> {
        match self {
            NetError::Status { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// The kept error body, when the server answered.
    pub fn body(&self) -> Option<&str> {
        match self {
            NetError::Status { body, .. } => Some(body),
            _ => None,
        }
    }

    /// How long the server asked the client to wait, if it did.
    pub fn wait_hint(&self) -> Option<Duration> {
        match self {
            NetError::Status { wait, .. } => wait.map(|w| w.0),
            _ => None,
        }
    }
}

/// Every message in an error's source chain, each once: the first line of
/// a transport error is vague, its sources say what happened.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = vec![e.to_string()];
    let mut cur = e.source();
    while let Some(s) = cur {
        let m = s.to_string();
        if !parts.iter().any(|p| p.contains(&m)) {
            parts.push(m);
        }
        cur = s.source();
    }
    parts.join(": ")
}

/// A reqwest error without its URL (the caller names the request once).
pub fn request_error(e: reqwest::Error) -> String {
    error_chain(&e.without_url())
}

/// How a client connects and how patient it is.
#[derive(Clone, Debug)]
pub struct HttpOptions {
    pub trust: Trust,
    pub identity: Option<ClientIdentity>,
    pub connect_timeout: Duration,
    /// The stall timeout: the longest wait for the response headers or
    /// for any piece of a body (a silent server). A body that delivers
    /// less than [`body::TRICKLE_FLOOR`] bytes in this long is cut off too
    /// (see [`Response`]).
    pub timeout: Duration,
    /// Keep idle connections for the next request. Off for downloads: a
    /// retry after a broken body must not reuse the broken connection.
    pub reuse_connections: bool,
}

impl Default for HttpOptions {
    fn default() -> Self {
        HttpOptions {
            trust: Trust::System,
            identity: None,
            connect_timeout: Duration::from_secs(10),
            timeout: stall_timeout(Duration::from_secs(60)),
            reuse_connections: true,
        }
    }
}

/// Applies `opts` to a reqwest client builder; the blocking and the async
/// builder share method names but no trait, hence a macro.
macro_rules! configure {
    ($builder:expr, $opts:expr) => {{
        let opts: &HttpOptions = $opts;
        let mut b = $builder
            .user_agent(USER_AGENT)
            .connect_timeout(opts.connect_timeout);
        if !opts.reuse_connections {
            b = b.pool_max_idle_per_host(0);
        }
        if let Some((config, _seen)) = tls::client_config(&opts.trust, opts.identity.as_ref())? {
            b = b.tls_backend_preconfigured(config);
        }
        b
    }};
}

fn build_error(e: reqwest::Error) -> NetError {
    NetError::Tls(tls::TlsError::Invalid {
        what: "HTTP client",
        message: request_error(e),
    })
}

/// A blocking client with imgbuild's User-Agent, the environment's proxies
/// (`HTTPS_PROXY`, `NO_PROXY`, … as reqwest reads them) and `opts`' TLS.
/// Blocking: build and use it off the async runtime.
///
/// Built from the async builder, since only that one has a read timeout
/// (reset by every piece of the body, so a stalled body is cut after
/// `opts.timeout` whatever the request's total deadline). Its timer is
/// made while the body is read, on the reading thread: [`Response`] lends
/// that thread a timer runtime, so read bodies only through it (the bare
/// `RequestBuilder::send` is banned in clippy.toml).
pub fn http_client(opts: &HttpOptions) -> Result<Client, NetError> {
    let builder = configure!(reqwest::Client::builder(), opts).read_timeout(opts.timeout);
    reqwest::blocking::ClientBuilder::from(builder)
        .timeout(opts.timeout)
        .build()
        .map_err(build_error)
}

/// The same client for async use: large streamed request bodies (uploads),
/// whose chunks the blocking client cuts to 8 KiB. Without reqwest's read
/// timeout, which runs from the request's start to the reply's headers and
/// so would cut any upload longer than it: the request's own deadline
/// bounds the upload, and [`read_limited_async`] gives each piece of the
/// reply the stall timeout.
pub fn async_http_client(opts: &HttpOptions) -> Result<reqwest::Client, NetError> {
    configure!(reqwest::Client::builder(), opts)
        .build()
        .map_err(build_error)
}

/// Renders an async failure the way [`send_once`] renders a blocking one.
/// The request gets [`request_deadline`] unless it has a deadline of its own.
pub async fn send_once_async(make: reqwest::RequestBuilder) -> Result<reqwest::Response, NetError> {
    let (client, req) = make.build_split();
    let mut req = req.map_err(unbuildable)?;
    req.timeout_mut().get_or_insert_with(request_deadline);
    let method = req.method().to_string();
    let url = display_url(req.url());
    let asked = req.url().clone();
    let sent = credentials(req.headers());
    let started = Instant::now();
    let resp = client
        .execute(req)
        .await
        .map_err(|e| transfer_error(&method, &url, e))
        .inspect_err(|e| debug_exchange(&method, &asked, started, Err(e)))?;
    debug_exchange(&method, &asked, started, Ok((resp.status(), resp.url())));
    if resp.status().is_success() {
        return Ok(resp);
    }
    let (status, headers) = (resp.status(), resp.headers().clone());
    let stall = stall_timeout(Duration::from_secs(60));
    let body = read_limited_async(resp, ERROR_BODY_KEEP, true, stall)
        .await
        .unwrap_or_default();
    Err(status_error(&method, &url, status, &headers, &body, &sent))
}

/// The async twin of [`read_limited`]; `cut` keeps the first `limit` bytes
/// of a longer body instead of refusing it (error bodies). A piece of the
/// body that takes longer than `stall` ends it.
pub async fn read_limited_async(
    mut resp: reqwest::Response,
    limit: u64,
    cut: bool,
    stall: Duration,
) -> Result<Vec<u8>, NetError> {
    let method = "reading the reply of".to_owned();
    let url = display_url(resp.url());
    let failed = |message: String| NetError::Transfer {
        method: method.clone(),
        url: url.clone(),
        message,
        before_sending: false,
    };
    let mut body = Vec::new();
    loop {
        let waited = Instant::now();
        let chunk = tokio::time::timeout(stall, resp.chunk())
            .await
            .map_err(|_| failed(Stalled::Silent(waited.elapsed()).to_string()))?
            .map_err(|e| failed(request_error(e)))?;
        let Some(chunk) = chunk else {
            return Ok(body);
        };
        body.extend_from_slice(&chunk);
        if body.len() as u64 > limit {
            if cut {
                body.truncate(limit as usize);
                return Ok(body);
            }
            return Err(NetError::TooLarge { method, url, limit });
        }
    }
}

/// The longest any request may take, from connecting to the body's last
/// byte, unless its caller set another (downloads do). 10 minutes, or
/// `IMGBUILD_REQUEST_DEADLINE_SECS`.
pub fn request_deadline() -> Duration {
    secs_from_env("IMGBUILD_REQUEST_DEADLINE_SECS").unwrap_or(Duration::from_secs(600))
}

/// The stall timeout API clients use (see [`HttpOptions::timeout`]):
/// `default`, or `IMGBUILD_READ_TIMEOUT_SECS` (the environment twin of
/// the download commands' `--read-timeout-secs`).
pub fn stall_timeout(default: Duration) -> Duration {
    secs_from_env("IMGBUILD_READ_TIMEOUT_SECS").unwrap_or(default)
}

/// A whole number of seconds above zero from the environment variable `name`.
fn secs_from_env(name: &str) -> Option<Duration> {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|&s| s > 0)
        .map(Duration::from_secs)
}

/// The credentials a request carries, to be cut out of anything a server
/// sends back (a proxy or a debug endpoint may echo the request): every
/// `Authorization`, `Proxy-Authorization` and `Cookie` value, and the
/// secret part of each (after the scheme, after the last `=`).
fn credentials(headers: &header::HeaderMap) -> Vec<String> {
    let mut out = Vec::new();
    for name in [
        header::AUTHORIZATION,
        header::PROXY_AUTHORIZATION,
        header::COOKIE,
    ] {
        for v in headers.get_all(&name) {
            let Ok(v) = v.to_str() else { continue };
            let v = v.trim();
            out.push(v.to_owned());
            if let Some((_, rest)) = v.split_once(' ') {
                out.push(rest.trim().to_owned());
            }
            if let Some((_, rest)) = v.rsplit_once('=') {
                out.push(rest.to_owned());
            }
        }
    }
    // Short pieces (a bare scheme, an empty value) would redact ordinary text.
    out.retain(|s| s.len() >= 8);
    // Longest first, so a whole value goes before its parts.
    out.sort_by_key(|s| std::cmp::Reverse(s.len()));
    out
}

/// `body` without any of `secrets`; a body cut off inside one loses the
/// cut piece too.
fn redact(body: &str, secrets: &[String]) -> String {
    let mut text = body.to_owned();
    for s in secrets {
        text = text.replace(s.as_str(), "<redacted>");
    }
    for s in secrets {
        let tail = (4..s.len())
            .rev()
            .filter(|&n| s.is_char_boundary(n))
            .find(|&n| text.ends_with(&s[..n]));
        if let Some(n) = tail {
            text.truncate(text.len() - n);
            text.push_str("<redacted>");
        }
    }
    text
}

/// A request that could not even be built (a malformed URL or header).
fn unbuildable(e: reqwest::Error) -> NetError {
    NetError::Transfer {
        method: "?".into(),
        url: "?".into(),
        message: request_error(e),
        before_sending: true,
    }
}

/// A non-success answer: its status, the wait it asks for, the body kept.
fn status_error(
    method: &str,
    url: &str,
    status: reqwest::StatusCode,
    headers: &header::HeaderMap,
    body: &[u8],
    sent: &[String],
) -> NetError {
    // Redacted, and safe for a terminal (line ends kept for parsers).
    let body = redact(&String::from_utf8_lossy(body), sent).replace("\r\n", "\n");
    let mut body = crate::input::escape(&body).into_owned();
    // A redirect reqwest did not follow (another scheme, too many hops)
    // has an empty body; where it leads is the explanation.
    if status.is_redirection()
        && let Some(to) = headers.get(header::LOCATION)
    {
        let to = String::from_utf8_lossy(to.as_bytes());
        let to = match reqwest::Url::parse(&to) {
            Ok(u) => display_url(&u),
            Err(_) => to.into_owned(),
        };
        body = format!(
            "a redirect to {} that imgbuild does not follow (only http and https, at most 10 hops) {body}",
            crate::input::quote(&redact(&to, sent))
        )
        .trim_end()
        .to_owned();
    }
    NetError::Status {
        method: method.to_owned(),
        url: url.to_owned(),
        status: status.as_u16(),
        body,
        wait: wait_hint(headers, SystemTime::now()).map(WaitHint),
    }
}

/// A transport error, told apart: a refused certificate, or a transfer.
fn transfer_error(method: &str, url: &str, e: reqwest::Error) -> NetError {
    if let Some(r @ rustls::Error::InvalidCertificate(_)) = tls::rustls_error(&e) {
        return NetError::Untrusted {
            method: method.to_owned(),
            url: url.to_owned(),
            message: tls::describe_refusal(r),
        };
    }
    NetError::Transfer {
        method: method.to_owned(),
        url: url.to_owned(),
        before_sending: e.is_connect(),
        message: request_error(e),
    }
}

/// How often and how patiently a failed request is tried again.
#[derive(Clone, Copy, Debug)]
pub struct RetryPolicy {
    /// Attempts after the first.
    pub retries: u32,
    /// First pause; doubles with each attempt.
    pub backoff: Duration,
    /// The longest single pause, even when a server asks for more.
    pub max_wait: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            retries: 4,
            backoff: Duration::from_millis(500),
            max_wait: Duration::from_secs(60),
        }
    }
}

impl RetryPolicy {
    /// The pause before retry number `attempt` (from 1): the doubling
    /// backoff, or what the server asked for (`hint`) if that is longer,
    /// capped at `max_wait`.
    pub fn delay(&self, attempt: u32, hint: Option<Duration>) -> Duration {
        let exp = self
            .backoff
            .saturating_mul(2u32.saturating_pow(attempt.saturating_sub(1)));
        exp.max(hint.unwrap_or_default()).min(self.max_wait)
    }
}

/// Sends the request `make` builds, once: a non-success status becomes a
/// rendered [`NetError::Status`], without the credentials it sent. The
/// request gets [`request_deadline`] unless it has a deadline of its own.
pub fn send_once(make: RequestBuilder) -> Result<Response, NetError> {
    let (client, req) = make.build_split();
    let mut req = req.map_err(unbuildable)?;
    let total = *req.timeout_mut().get_or_insert_with(request_deadline);
    let method = req.method().to_string();
    let url = display_url(req.url());
    let asked = req.url().clone();
    let sent = credentials(req.headers());
    let started = Instant::now();
    #[allow(clippy::disallowed_methods)] // the one place: wrapped just below
    let resp = client
        .execute(req)
        .map_err(|e| transfer_error(&method, &url, e))
        .inspect_err(|e| debug_exchange(&method, &asked, started, Err(e)))?;
    debug_exchange(&method, &asked, started, Ok((resp.status(), resp.url())));
    let stall = stall_timeout(Duration::from_secs(60));
    let shown = display_url(resp.url()); // where any redirect led
    let resp = Response::new(resp, shown, started + total, stall);
    if resp.status().is_success() {
        Ok(resp)
    } else {
        Err(failure(&method, &url, resp, &sent))
    }
}

/// Sends what `make` builds until it succeeds, a failure is not worth
/// retrying (`retry` says which are), or the policy's attempts run out.
/// `on_retry` hears of each pause (attempt number, the failure, the pause).
pub fn send(
    policy: &RetryPolicy,
    make: &dyn Fn() -> RequestBuilder,
    retry: &dyn Fn(&NetError) -> bool,
    on_retry: &mut dyn FnMut(u32, &NetError, Duration),
) -> Result<Response, NetError> {
    let mut attempt = 0;
    loop {
        match send_once(make()) {
            Ok(r) => return Ok(r),
            Err(e) if attempt < policy.retries && retry(&e) => {
                attempt += 1;
                let pause = policy.delay(attempt, e.wait_hint());
                on_retry(attempt, &e, pause);
                std::thread::sleep(pause);
            }
            Err(e) => return Err(e),
        }
    }
}

/// The whole body, refused past `limit` bytes: API replies are small, and
/// a server that sends an image instead must not fill memory.
pub fn read_limited(resp: Response, limit: u64) -> Result<Vec<u8>, NetError> {
    // The response does not know its request method; say what was done.
    let method = "reading the reply of".to_owned();
    let url = resp.shown_url().to_owned();
    let mut body = Vec::new();
    resp.take(limit + 1)
        .read_to_end(&mut body)
        .map_err(|e| NetError::Transfer {
            method: method.clone(),
            url: url.clone(),
            message: error_chain(&e),
            before_sending: false,
        })?;
    if body.len() as u64 > limit {
        return Err(NetError::TooLarge { method, url, limit });
    }
    Ok(body)
}

/// Why a base URL given by the user (a flag, the environment, the
/// inventory) was refused. Never quotes the value: it may carry a password
/// or a token; [`BaseUrlError::shown`] is what may be said of it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BaseUrlError {
    #[error("is not a URL (value not shown)")]
    Unparsable,
    #[error("{shown} is not an http(s) URL with a host")]
    NotHttp { shown: String },
    #[error(
        "{shown} carries a user name or password: give the URL without them (a password in a URL ends up in logs and machine configs)"
    )]
    Credentials { shown: String },
    #[error(
        "{shown} has a query or fragment (it may hold a token, which would end up in logs and machine configs): give scheme, host, port and path only"
    )]
    Query { shown: String },
}

/// `url` as a base URL imgbuild may use, show and write down: http or
/// https, a host, and no user name, password, query or fragment (each of
/// which can carry a secret into every derived URL, download line, cache
/// record and machine config).
pub fn base_url(url: &str) -> Result<reqwest::Url, BaseUrlError> {
    let u = reqwest::Url::parse(url.trim()).map_err(|_| BaseUrlError::Unparsable)?;
    let shown = origin(&u);
    if !matches!(u.scheme(), "http" | "https") || u.host_str().is_none_or(str::is_empty) {
        return Err(BaseUrlError::NotHttp { shown });
    }
    if !u.username().is_empty() || u.password().is_some() {
        return Err(BaseUrlError::Credentials { shown });
    }
    if u.query().is_some() || u.fragment().is_some() {
        return Err(BaseUrlError::Query { shown });
    }
    Ok(u)
}

/// Scheme, host and port of `u`: all a message says of a refused URL.
fn origin(u: &reqwest::Url) -> String {
    match (u.host_str(), u.port()) {
        (Some(h), Some(p)) => format!("{}://{h}:{p}", u.scheme()),
        (Some(h), None) => format!("{}://{h}", u.scheme()),
        (None, _) => format!("a {}: URL", u.scheme()),
    }
}

/// A URL as messages show it: no user name or password.
pub fn display_url(url: &reqwest::Url) -> String {
    let mut u = url.clone();
    let _ = u.set_username("");
    let _ = u.set_password(None);
    u.to_string()
}

/// Renders a failed response: status, the wait it asks for, and the first
/// bytes of its body, without the credentials `sent`.
fn failure(method: &str, url: &str, resp: Response, sent: &[String]) -> NetError {
    let (status, headers) = (resp.status(), resp.headers().clone());
    let mut raw = Vec::new();
    let _ = resp.take(ERROR_BODY_KEEP).read_to_end(&mut raw);
    status_error(method, url, status, &headers, &raw, sent)
}

/// `Retry-After` (seconds or an HTTP date) or Hetzner's `RateLimit-Reset`
/// (a unix time), as a pause from `now`.
fn wait_hint(headers: &header::HeaderMap, now: SystemTime) -> Option<Duration> {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if let Some(v) = text(header::RETRY_AFTER.as_str()) {
        if let Ok(secs) = v.trim().parse::<u64>() {
            return Some(Duration::from_secs(secs));
        }
        if let Ok(at) = httpdate(v) {
            return Some(at.duration_since(now).unwrap_or_default());
        }
    }
    let reset = text("ratelimit-reset")?.trim().parse::<u64>().ok()?;
    let at = SystemTime::UNIX_EPOCH + Duration::from_secs(reset);
    Some(at.duration_since(now).unwrap_or_default())
}

/// An IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`), the form HTTP servers send.
fn httpdate(s: &str) -> Result<SystemTime, ()> {
    let fmt = time::macros::format_description!(
        "[weekday repr:short], [day] [month repr:short] [year] [hour]:[minute]:[second] GMT"
    );
    let t = time::PrimitiveDateTime::parse(s.trim(), fmt).map_err(|_| ())?;
    let secs = t.assume_utc().unix_timestamp();
    u64::try_from(secs)
        .map(|s| SystemTime::UNIX_EPOCH + Duration::from_secs(s))
        .map_err(|_| ())
}

#[cfg(test)]
mod tests;
