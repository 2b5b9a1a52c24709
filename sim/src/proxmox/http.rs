//! pveproxy's side of a request (pve-http-server `PVE/APIServer/AnyEvent.pm`):
//! TLS on the loopback, the request head, the API token, and answers in
//! the `{"data": ...}` envelope with pveproxy's status lines.

use super::schema;
use super::schema::Errors;
use super::state::*;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::io::AsyncWriteExt;
use tokio::io::{AsyncBufReadExt, AsyncWrite};

/// A self-signed certificate made at start (as pve-ssl.pem is made at
/// install), and its SHA-256 fingerprint as `pvenode cert info` prints it.
pub(crate) fn tls_config(
    listen: SocketAddr,
) -> anyhow::Result<(Arc<rustls::ServerConfig>, String)> {
    let mut names = vec!["localhost".to_owned(), "127.0.0.1".to_owned()];
    if listen.ip().to_string() != "127.0.0.1" {
        names.push(listen.ip().to_string());
    }
    let certified = rcgen::generate_simple_self_signed(names)?;
    let der = certified.cert.der().clone();
    let fingerprint = Sha256::digest(der.as_ref())
        .iter()
        .map(|b| format!("{b:02X}"))
        .collect::<Vec<_>>()
        .join(":");
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(certified.signing_key.serialize_der().into());
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(vec![der], key)?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok((Arc::new(cfg), fingerprint))
}

/// A request line and its headers (names lowercased).
pub(crate) struct Head {
    pub(crate) method: String,
    pub(crate) path: String,
    pub(crate) query: String,
    pub(crate) headers: BTreeMap<String, String>,
}

impl Head {
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }
}

/// Reads one request head; None when the peer closed or sent garbage.
pub(crate) async fn read_head(r: &mut (impl AsyncBufReadExt + Unpin)) -> Option<Head> {
    let mut line = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line).await.ok()? == 0 {
            return None;
        }
        if !line.trim().is_empty() {
            break;
        }
    }
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next()?.to_owned(), parts.next()?.to_owned());
    let mut headers = BTreeMap::new();
    for _ in 0..64 {
        let mut h = String::new();
        if r.read_line(&mut h).await.ok()? == 0 {
            return None;
        }
        let h = h.trim_end();
        if h.is_empty() {
            let (path, query) = match target.split_once('?') {
                Some((p, q)) => (p.to_owned(), q.to_owned()),
                None => (target, String::new()),
            };
            return Some(Head {
                method,
                path,
                query,
                headers,
            });
        }
        let (k, v) = h.split_once(':')?;
        headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_owned());
    }
    None
}

pub(crate) async fn respond(
    w: &mut (impl AsyncWrite + Unpin),
    status: u16,
    reason: &str,
    body: &Value,
    keep_alive: bool,
) -> std::io::Result<()> {
    let body = body.to_string();
    let reason: String = reason
        .lines()
        .next()
        .unwrap_or("")
        .chars()
        .take(200)
        .collect();
    let head = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json;charset=UTF-8\r\n\
         Content-Length: {}\r\nConnection: {}\r\nCache-Control: max-age=0\r\n\
         Server: pve-api-daemon/3.0\r\n\r\n",
        body.len(),
        if keep_alive { "Keep-Alive" } else { "close" }
    );
    w.write_all(head.as_bytes()).await?;
    w.write_all(body.as_bytes()).await?;
    w.flush().await
}

/// The body of an answer: `{"data": …}`, or for an error `{"data": null,
/// "message": …, "errors": …}` (errors only when there are any).
pub(crate) fn answer(res: &ApiResult) -> (u16, String, Value) {
    match res {
        Ok(data) => (200, "OK".into(), json!({ "data": data })),
        Err(e) => {
            let mut body = json!({"data": null, "message": format!("{}\n", e.message.trim_end())});
            if !e.errors.is_empty() {
                body["errors"] = json!(e.errors);
            }
            (e.status, e.message.clone(), body)
        }
    }
}

pub(crate) fn status(code: u16, msg: impl Into<String>) -> ApiError {
    ApiError {
        status: code,
        message: msg.into(),
        errors: Errors::new(),
    }
}

/// `application/x-www-form-urlencoded` pairs (also query strings).
pub(crate) fn form_pairs(s: &str) -> Vec<(String, String)> {
    s.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            let dec = |x: &str| schema::percent_decode(&x.replace('+', " "));
            (dec(k), dec(v))
        })
        .collect()
}

impl Pve {
    pub(crate) fn authorized(&self, head: &Head) -> bool {
        head.header("authorization")
            .and_then(|a| a.strip_prefix("PVEAPIToken="))
            .is_some_and(|t| t == self.args.token)
    }
}
