//! HTTP CONNECT for the Talos gRPC connection, as talosctl gets it: grpc-go
//! (`internal/transport/proxy.go`) asks Go's `http.ProxyFromEnvironment`
//! for an `https://NODE:50000` URL, which reads `HTTPS_PROXY` /
//! `https_proxy` and `NO_PROXY` / `no_proxy` by the rules of
//! `golang.org/x/net/http/httpproxy/proxy.go` (never loopback, never
//! `localhost`), then sends a plaintext `CONNECT NODE:50000` with
//! `Proxy-Authorization: Basic` from the proxy URL's user and password,
//! and speaks TLS through the tunnel. Those rules are copied here, not
//! reqwest's (which differ on `NO_PROXY`).
//!
//! Go never proxies loopback, so `--talos-proxy` (the CLI sets it with
//! [`set_talos_proxy`]) sends every Talos connection through one proxy,
//! loopback included, or none (`direct`).
//!
//! The proxy's credentials live only in the header value: a [`Proxy`]
//! shows as `http://host:port`, in errors and in the `--debug` log alike.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, LazyLock, OnceLock};
use std::time::Instant;

use base64::Engine;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A CONNECT proxy: where it is, and the `Proxy-Authorization` value its
/// URL's user and password make (never shown).
#[derive(Clone, PartialEq, Eq)]
pub struct Proxy {
    host: String,
    port: u16,
    authorization: Option<String>,
}

impl fmt::Display for Proxy {
    /// `http://host:port`: never the user or password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "http://[{}]:{}", self.host, self.port)
        } else {
            write!(f, "http://{}:{}", self.host, self.port)
        }
    }
}

impl fmt::Debug for Proxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Proxy({self}{})",
            if self.authorization.is_some() {
                ", with credentials"
            } else {
                ""
            }
        )
    }
}

/// A proxy URL that cannot be used for the Talos API.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProxyUrlError {
    #[error("is not a proxy URL (http://[user:password@]host[:port])")]
    Invalid,
    /// grpc-go speaks plaintext CONNECT; a SOCKS proxy is another protocol.
    #[error("is a {0} proxy: the Talos API goes only through HTTP CONNECT proxies (http://)")]
    Scheme(String),
}

impl Proxy {
    /// A proxy URL as Go's `parseProxy` reads one: a URL, or `host[:port]`
    /// taken as `http://host[:port]` (anything without `://`). The port defaults to the scheme's
    /// (80, 443) as Go's transport does. `https://` is accepted and
    /// spoken to in plaintext, as grpc-go does (its Documentation/proxy.md:
    /// "Using CONNECT proxies via https is not supported").
    pub fn parse(text: &str) -> Result<Proxy, ProxyUrlError> {
        let text = text.trim();
        let url = if text.contains("://") {
            reqwest::Url::parse(text).map_err(|_| ProxyUrlError::Invalid)?
        } else {
            reqwest::Url::parse(&format!("http://{text}")).map_err(|_| ProxyUrlError::Invalid)?
        };
        if !["http", "https"].contains(&url.scheme()) {
            return Err(ProxyUrlError::Scheme(url.scheme().to_owned()));
        }
        let host = url.host_str().ok_or(ProxyUrlError::Invalid)?;
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host)
            .to_owned();
        if host.is_empty() {
            return Err(ProxyUrlError::Invalid);
        }
        let port = url.port_or_known_default().ok_or(ProxyUrlError::Invalid)?;
        let authorization = (!url.username().is_empty() || url.password().is_some()).then(|| {
            let user = percent_decode(url.username());
            let password = percent_decode(url.password().unwrap_or(""));
            let mut pair = user;
            pair.push(b':');
            pair.extend(password);
            format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(pair)
            )
        });
        Ok(Proxy {
            host,
            port,
            authorization,
        })
    }

    /// Whether the URL carried a user or password.
    pub fn has_credentials(&self) -> bool {
        self.authorization.is_some()
    }
}

/// The password of a proxy URL (`http://user:password@host`) as written
/// and decoded, for the output's redaction set: a proxy URL from the
/// environment or `--talos-proxy` may reach a message through another
/// layer (an HTTP client's error).
pub fn passwords_in(url: &str) -> Vec<String> {
    let url = if url.contains("://") {
        url.to_owned()
    } else {
        format!("http://{url}")
    };
    let Some(raw) = reqwest::Url::parse(&url)
        .ok()
        .and_then(|u| u.password().map(str::to_owned))
    else {
        return Vec::new();
    };
    let decoded = String::from_utf8_lossy(&percent_decode(&raw)).into_owned();
    let mut out = vec![raw];
    if !out.contains(&decoded) {
        out.push(decoded);
    }
    out.retain(|p| !p.is_empty());
    out
}

/// `%XX` escapes decoded, as Go's `url.UserPassword` values are.
fn percent_decode(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let hex = |c: u8| (c as char).to_digit(16);
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2]))
        {
            out.push((h * 16 + l) as u8);
            i += 3;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    out
}

/// One `NO_PROXY` entry, as httpproxy's `config.init` sorts them.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Matcher {
    /// `*`: nothing is proxied.
    All,
    /// `10.0.0.0/8`, `fd00::/8`.
    Cidr { net: IpAddr, bits: u8 },
    /// `10.0.0.1`, `10.0.0.1:50000`, `::1`, `[::1]:50000`.
    Ip { ip: IpAddr, port: Option<String> },
    /// `example.com` (it and its subdomains), `.example.com` and
    /// `*.example.com` (subdomains only), each maybe with `:port`; `host`
    /// starts with a dot.
    Domain {
        host: String,
        port: Option<String>,
        match_host: bool,
    },
}

/// Go's `net.SplitHostPort`, for the forms `NO_PROXY` entries take.
fn split_host_port(s: &str) -> Option<(&str, &str)> {
    if let Some(rest) = s.strip_prefix('[') {
        let end = rest.find(']')?;
        let port = rest[end + 1..].strip_prefix(':')?;
        return Some((&rest[..end], port));
    }
    let i = s.rfind(':')?;
    let (host, port) = (&s[..i], &s[i + 1..]);
    (!host.contains(':')).then_some((host, port))
}

/// Go's `net.ParseCIDR`: `address/bits`, the bits within the family.
fn parse_cidr(s: &str) -> Option<(IpAddr, u8)> {
    let (ip, bits) = s.split_once('/')?;
    let ip: IpAddr = ip.parse().ok()?;
    let bits: u8 = bits.parse().ok()?;
    let max = if ip.is_ipv4() { 32 } else { 128 };
    (bits <= max && !s.contains('+')).then_some((ip, bits))
}

/// Whether `ip` is within `net/bits` (an IPv4 net holds IPv4-mapped
/// IPv6 addresses, as Go's `IPNet.Contains` treats them).
fn cidr_contains(net: IpAddr, bits: u8, ip: IpAddr) -> bool {
    match (net.to_canonical(), ip.to_canonical()) {
        (IpAddr::V4(n), IpAddr::V4(a)) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(bits)).unwrap_or(0);
            u32::from(n) & mask == u32::from(a) & mask
        }
        (IpAddr::V6(n), IpAddr::V6(a)) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(bits)).unwrap_or(0);
            u128::from(n) & mask == u128::from(a) & mask
        }
        _ => false,
    }
}

/// `NO_PROXY` parsed as httpproxy parses it: best effort, a malformed
/// entry ignored.
fn no_proxy_matchers(list: &str) -> Vec<Matcher> {
    let mut out = Vec::new();
    for p in list.split(',') {
        let p = p.trim().to_ascii_lowercase();
        if p.is_empty() {
            continue;
        }
        if p == "*" {
            return vec![Matcher::All];
        }
        if let Some((net, bits)) = parse_cidr(&p) {
            out.push(Matcher::Cidr { net, bits });
            continue;
        }
        let (host, port) = match split_host_port(&p) {
            Some(("", _)) => continue,
            Some((h, port)) => (h.to_owned(), Some(port.to_owned())),
            None => (p.clone(), None),
        };
        if let Ok(ip) = host.parse::<IpAddr>() {
            out.push(Matcher::Ip { ip, port });
            continue;
        }
        if host.is_empty() {
            continue;
        }
        let host = match host.strip_prefix("*.") {
            Some(rest) => format!(".{rest}"),
            None => host,
        };
        let (host, match_host) = if host.starts_with('.') {
            (host, false)
        } else {
            (format!(".{host}"), true)
        };
        out.push(Matcher::Domain {
            host,
            port,
            match_host,
        });
    }
    out
}

/// The proxy settings of the environment, as Go's
/// `httpproxy.FromEnvironment` reads them, for `https` URLs (grpc-go asks
/// for `https://NODE:PORT`).
#[derive(Debug, Clone, Default)]
pub struct ProxyEnv {
    https: Option<Proxy>,
    no_proxy: Vec<Matcher>,
}

impl ProxyEnv {
    /// From `get` (the environment): `HTTPS_PROXY`, else `https_proxy`;
    /// `NO_PROXY`, else `no_proxy`; an empty value counts as unset and an
    /// unusable proxy URL as none, as in Go.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> ProxyEnv {
        let any = |names: [&str; 2]| {
            names
                .iter()
                .find_map(|n| get(n).filter(|v| !v.is_empty()))
                .unwrap_or_default()
        };
        let https = any(["HTTPS_PROXY", "https_proxy"]);
        ProxyEnv {
            https: (!https.is_empty())
                .then(|| Proxy::parse(&https).ok())
                .flatten(),
            no_proxy: no_proxy_matchers(&any(["NO_PROXY", "no_proxy"])),
        }
    }

    /// The proxy a connection to `target` goes through, if any.
    pub fn proxy_for(&self, target: SocketAddr) -> Option<&Proxy> {
        let proxy = self.https.as_ref()?;
        let host = target.ip().to_string();
        self.use_proxy(&host, &target.port().to_string())
            .then_some(proxy)
    }

    /// httpproxy's `useProxy` for `host` (a name or an address, IPv6
    /// without brackets) and `port`: never `localhost` or loopback; then
    /// the `NO_PROXY` entries, the IP ones for an address, the domain ones
    /// against the host as text.
    fn use_proxy(&self, host: &str, port: &str) -> bool {
        if host == "localhost" {
            return false;
        }
        let ip = host.parse::<IpAddr>().ok().map(|ip| ip.to_canonical());
        if ip.is_some_and(|ip| ip.is_loopback()) {
            return false;
        }
        let host = host.trim().to_ascii_lowercase();
        let port_ok = |want: &Option<String>| want.as_ref().is_none_or(|p| p == port);
        let exempt = self.no_proxy.iter().any(|m| match (m, ip) {
            (Matcher::All, _) => true,
            (Matcher::Cidr { net, bits }, Some(ip)) => cidr_contains(*net, *bits, ip),
            (Matcher::Ip { ip: want, port: p }, Some(ip)) => {
                want.to_canonical() == ip && port_ok(p)
            }
            (Matcher::Cidr { .. } | Matcher::Ip { .. }, None) => false,
            (
                Matcher::Domain {
                    host: suffix,
                    port: p,
                    match_host,
                },
                _,
            ) => {
                (host.ends_with(suffix.as_str()) || (*match_host && host == suffix[1..]))
                    && port_ok(p)
            }
        });
        !exempt
    }
}

/// How Talos connections reach their nodes.
#[derive(Debug, Clone)]
pub enum TalosRoute {
    /// As talosctl: `HTTPS_PROXY` / `NO_PROXY` by Go's rules.
    Environment(ProxyEnv),
    /// `--talos-proxy URL`: every node through this proxy, loopback too.
    Always(Arc<Proxy>),
    /// `--talos-proxy direct`: never through a proxy.
    Direct,
}

static TALOS_ROUTE: OnceLock<TalosRoute> = OnceLock::new();
static FROM_ENV: LazyLock<TalosRoute> =
    LazyLock::new(|| TalosRoute::Environment(ProxyEnv::from_lookup(|k| std::env::var(k).ok())));

/// `--talos-proxy`: `direct`, or a proxy URL every Talos connection goes
/// through. Set once, before the first connection.
pub fn set_talos_proxy(value: &str) -> Result<(), ProxyUrlError> {
    let route = if value.trim().eq_ignore_ascii_case("direct") {
        TalosRoute::Direct
    } else {
        TalosRoute::Always(Arc::new(Proxy::parse(value)?))
    };
    let _ = TALOS_ROUTE.set(route);
    Ok(())
}

/// The proxy a Talos connection to `target` goes through, if any.
pub fn talos_proxy_for(target: SocketAddr) -> Option<Proxy> {
    match TALOS_ROUTE.get().unwrap_or(&FROM_ENV) {
        TalosRoute::Environment(env) => env.proxy_for(target).cloned(),
        TalosRoute::Always(p) => Some((**p).clone()),
        TalosRoute::Direct => None,
    }
}

/// Why a connection through a proxy failed. Each names the proxy (never
/// its credentials) and the node it was asked for.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("cannot reach proxy {proxy} (to tunnel to {target}): {source}")]
    Unreachable {
        proxy: String,
        target: SocketAddr,
        source: std::io::Error,
    },
    #[error("proxy {proxy} refused CONNECT {target}: HTTP {status}")]
    Refused {
        proxy: String,
        target: SocketAddr,
        status: String,
    },
    #[error("proxy {proxy} answered CONNECT {target} with something other than HTTP ({what})")]
    Garbled {
        proxy: String,
        target: SocketAddr,
        what: String,
    },
}

/// The most a proxy's reply head may hold.
const REPLY_HEAD_LIMIT: usize = 16 << 10;

/// A TCP connection to `target`, through `proxy` when given (plaintext
/// CONNECT, as grpc-go's `doHTTPConnectHandshake`). The reply head is read
/// byte by byte up to its blank line, so nothing after it is lost: the
/// stream is the tunnel. With `--debug`, one line per CONNECT: the proxy,
/// the target, the status, the time.
pub async fn dial(target: SocketAddr, proxy: Option<&Proxy>) -> std::io::Result<TcpStream> {
    let Some(proxy) = proxy else {
        return TcpStream::connect(target).await;
    };
    let mut pending = Unanswered {
        what: Some(format!("gRPC proxy {proxy} CONNECT {target}")),
        started: Instant::now(),
    };
    let result = connect_through(target, proxy).await;
    let what = pending.what.take().unwrap_or_default();
    super::debug_line(|| {
        let took = pending.started.elapsed().as_millis();
        match &result {
            Ok((_, status)) => format!("{what} → {status} in {took} ms"),
            Err(ProxyError::Refused { status, .. }) => format!("{what} → {status} in {took} ms"),
            Err(e) => format!("{what} → failed after {took} ms: {e}"),
        }
    });
    result.map(|(tcp, _)| tcp).map_err(std::io::Error::other)
}

/// A CONNECT abandoned before its reply (the call's deadline) says so in
/// the `--debug` log.
struct Unanswered {
    what: Option<String>,
    started: Instant,
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        if let Some(what) = self.what.take() {
            let took = self.started.elapsed().as_millis();
            super::debug_line(|| format!("{what} → no reply, abandoned after {took} ms"));
        }
    }
}

/// The CONNECT exchange: the tunnel and the proxy's status line.
async fn connect_through(
    target: SocketAddr,
    proxy: &Proxy,
) -> Result<(TcpStream, String), ProxyError> {
    let shown = proxy.to_string();
    let unreachable = |source| ProxyError::Unreachable {
        proxy: shown.clone(),
        target,
        source,
    };
    let mut tcp = TcpStream::connect((proxy.host.as_str(), proxy.port))
        .await
        .map_err(unreachable)?;
    let mut head = format!(
        "CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nUser-Agent: {}\r\n",
        super::USER_AGENT
    );
    if let Some(auth) = &proxy.authorization {
        head.push_str("Proxy-Authorization: ");
        head.push_str(auth);
        head.push_str("\r\n");
    }
    head.push_str("\r\n");
    tcp.write_all(head.as_bytes()).await.map_err(unreachable)?;
    drop(head);
    let mut reply = Vec::new();
    let mut byte = [0u8; 1];
    while !reply.ends_with(b"\r\n\r\n") && !reply.ends_with(b"\n\n") {
        if reply.len() >= REPLY_HEAD_LIMIT {
            return Err(ProxyError::Garbled {
                proxy: shown,
                target,
                what: format!("a reply head over {REPLY_HEAD_LIMIT} bytes"),
            });
        }
        match tcp.read(&mut byte).await {
            Ok(0) => {
                return Err(ProxyError::Garbled {
                    proxy: shown,
                    target,
                    what: if reply.is_empty() {
                        "closed the connection without a reply".to_owned()
                    } else {
                        "closed the connection within its reply".to_owned()
                    },
                });
            }
            Ok(_) => reply.push(byte[0]),
            Err(e) => return Err(unreachable(e)),
        }
    }
    let text = String::from_utf8_lossy(&reply);
    let line = text.lines().next().unwrap_or_default();
    let mut parts = line.splitn(3, ' ');
    let (version, code, reason) = (
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default().trim(),
    );
    if !version.starts_with("HTTP/1.") || code.len() != 3 || code.parse::<u16>().is_err() {
        return Err(ProxyError::Garbled {
            proxy: shown,
            target,
            what: format!("{:?}", crate::input::one_line(line, 80)),
        });
    }
    let status = crate::input::one_line(&format!("{code} {reason}"), 120)
        .trim()
        .to_owned();
    if code != "200" {
        return Err(ProxyError::Refused {
            proxy: shown,
            target,
            status,
        });
    }
    Ok((tcp, status))
}

#[cfg(test)]
mod tests;
