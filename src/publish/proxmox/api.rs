//! An authenticated Proxmox VE API at one endpoint: calls with retries,
//! task waits, and Proxmox's error replies spelled out.

use std::time::{Duration, Instant};

use reqwest::blocking::{Client, RequestBuilder};
use reqwest::header::HeaderValue;
use serde_json::Value;

use super::credentials::Credentials;
use super::error::ProxmoxError;
use super::types::PublishOptions;
use crate::net::{self, NetError, RetryPolicy};

/// The node a UPID belongs to (its second field).
pub(super) fn upid_node(upid: &str) -> Option<&str> {
    upid.split(':').nth(1).filter(|n| !n.is_empty())
}

/// An authenticated API at one endpoint.
pub(super) struct Api {
    pub(super) client: Client,
    /// For upload bodies only.
    pub(super) uploads: reqwest::Client,
    /// The stall timeout, for the replies to uploads.
    pub(super) stall: Duration,
    pub(super) base: String,
    pub(super) auth: HeaderValue,
    pub(super) retry: RetryPolicy,
}

impl Api {
    pub(super) fn new(creds: &Credentials, retry: RetryPolicy) -> Result<Api, ProxmoxError> {
        let opts = net::HttpOptions {
            trust: creds.trust.clone(),
            timeout: net::stall_timeout(Duration::from_secs(300)),
            ..net::HttpOptions::default()
        };
        let client = net::http_client(&opts)?;
        let uploads = net::async_http_client(&opts)?;
        let mut auth = HeaderValue::from_str(&format!("PVEAPIToken={}", creds.token.expose()))
            .map_err(|_| {
                ProxmoxError::Setup(
                    "PROXMOX_VE_API_TOKEN holds characters a header cannot carry".into(),
                )
            })?;
        auth.set_sensitive(true);
        Ok(Api {
            client,
            uploads,
            stall: opts.timeout,
            base: creds.api.clone(),
            auth,
            retry,
        })
    }

    pub(super) fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Sends with retries and returns `data`. A 500 is not retried: pveproxy
    /// answers every `die` of a handler with it (a VM that exists, a storage
    /// that refuses), so it is an answer, not a busy server. Only a request
    /// that never reached the server, a busy proxy (502–504) or a rate limit
    /// is sent again, so no POST is repeated after it was acted on.
    pub(super) fn call(
        &self,
        what: &str,
        make: &dyn Fn() -> RequestBuilder,
    ) -> Result<Value, ProxmoxError> {
        let auth = self.auth.clone();
        let resp = net::send(
            &self.retry,
            &|| make().header(reqwest::header::AUTHORIZATION, auth.clone()),
            &|e| match e {
                NetError::Status { status, .. } => matches!(status, 429 | 502..=504),
                NetError::Transfer { before_sending, .. } => *before_sending,
                _ => false,
            },
            &mut |_, _, _| {},
        )
        .map_err(|e| api_error(what, e))?;
        let body = net::read_limited(resp, 16 << 20).map_err(|e| api_error(what, e))?;
        let doc: Value = serde_json::from_slice(&body).map_err(|e| ProxmoxError::Api {
            what: what.to_owned(),
            message: format!("the reply is not JSON: {e}"),
        })?;
        Ok(doc.get("data").cloned().unwrap_or(Value::Null))
    }

    pub(super) fn get(&self, what: &str, path: &str) -> Result<Value, ProxmoxError> {
        let url = self.url(path);
        self.call(what, &|| self.client.get(&url))
    }

    pub(super) fn post(
        &self,
        what: &str,
        path: &str,
        form: &[(&str, String)],
    ) -> Result<Value, ProxmoxError> {
        let url = self.url(path);
        self.call(what, &|| self.client.post(&url).form(form))
    }

    pub(super) fn put(
        &self,
        what: &str,
        path: &str,
        form: &[(&str, String)],
    ) -> Result<Value, ProxmoxError> {
        let url = self.url(path);
        self.call(what, &|| self.client.put(&url).form(form))
    }

    pub(super) fn delete(&self, what: &str, path: &str) -> Result<Value, ProxmoxError> {
        let url = self.url(path);
        self.call(what, &|| self.client.delete(&url))
    }

    /// Waits for a task to stop; `OK` and `WARNINGS: n` are success.
    pub(super) fn wait(
        &self,
        what: &str,
        data: &Value,
        opts: &PublishOptions,
    ) -> Result<(), ProxmoxError> {
        let Some(upid) = data.as_str() else {
            return Ok(()); // synchronous on this server version
        };
        let node = upid_node(upid).ok_or_else(|| ProxmoxError::Api {
            what: what.to_owned(),
            message: format!("{upid:?} is not a task ID"),
        })?;
        let path = format!("/nodes/{node}/tasks/{}", urlencode(upid));
        let start = Instant::now();
        loop {
            let st = self.get(what, &format!("{path}/status"))?;
            if st["status"] == "stopped" {
                let exit = st["exitstatus"].as_str().unwrap_or("").to_owned();
                if exit == "OK" || exit.starts_with("WARNINGS") {
                    return Ok(());
                }
                let log = self
                    .get(what, &format!("{path}/log?start=0&limit=500"))
                    .ok()
                    .and_then(|v| v.as_array().cloned())
                    .unwrap_or_default();
                // The task log is the server's text: one escaped, bounded
                // line each, so it cannot forge lines of its own.
                let lines: Vec<String> = log
                    .iter()
                    .filter_map(|l| l["t"].as_str().map(|t| crate::input::one_line(t, 300)))
                    .collect();
                let tail = lines[lines.len().saturating_sub(5)..].to_vec();
                return Err(ProxmoxError::Task {
                    what: what.to_owned(),
                    upid: upid.to_owned(),
                    exitstatus: crate::input::excerpt(&exit, 300),
                    log: tail,
                });
            }
            if start.elapsed() > opts.task_timeout {
                return Err(ProxmoxError::TaskTimeout {
                    what: what.to_owned(),
                    upid: upid.to_owned(),
                    timeout: opts.task_timeout,
                });
            }
            std::thread::sleep(opts.poll);
        }
    }
}

pub(super) fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// A failed call, with Proxmox's per-field `errors` spelled out.
pub(super) fn api_error(what: &str, e: NetError) -> ProxmoxError {
    if e.status() == Some(401) {
        return ProxmoxError::Unauthorized;
    }
    let detail = e
        .body()
        .and_then(|b| serde_json::from_str::<Value>(b).ok())
        .map(|doc| {
            let mut parts: Vec<String> = Vec::new();
            if let Some(m) = doc["message"].as_str() {
                parts.push(m.trim().to_owned());
            }
            if let Some(errs) = doc["errors"].as_object() {
                for (k, v) in errs {
                    parts.push(format!(
                        "{k}: {}",
                        v.as_str().unwrap_or(&v.to_string()).trim()
                    ));
                }
            }
            parts.join("; ")
        });
    match (detail, e.status()) {
        (Some(d), Some(status)) if !d.is_empty() => ProxmoxError::Api {
            what: what.to_owned(),
            message: format!("HTTP {status}: {d}"),
        },
        _ => ProxmoxError::Api {
            what: what.to_owned(),
            message: e.to_string(),
        },
    }
}
