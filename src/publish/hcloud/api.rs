//! The Hetzner Cloud API as the snapshot flow uses it: JSON calls with the
//! bearer token, retries where the API says to retry, paginated lists, and
//! waiting on actions. Facts: hetznercloud/hcloud-go `hcloud/client.go`
//! for retries and pagination, `hcloud/action_waiter.go` for polling.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use reqwest::Method;
use reqwest::blocking::Client;
use serde_json::Value;

use super::error::HcloudError;
use crate::net::{self, HttpOptions, NetError, RetryPolicy};
use crate::publish::Cancel;
use crate::publish::Secret;

/// Largest page the API serves (`per_page` ≤ 50).
const PER_PAGE: u32 = 50;
/// API replies are small; a larger one is not an API reply.
const REPLY_LIMIT: u64 = 8 << 20;

/// One project's API, counting the requests a run makes (the hourly limit
/// is shared by every CI job of the project).
pub struct Api {
    client: Client,
    base: String,
    token: Secret,
    policy: RetryPolicy,
    requests: AtomicU64,
}

/// The API's error object, `{"error": {"code", "message"}}`, when the body
/// holds one; each on one escaped line, since JSON unescaping gives back
/// any line break the server put there.
pub fn error_code(body: &str) -> Option<(String, String)> {
    let v: Value = serde_json::from_str(body).ok()?;
    let e = v.get("error")?;
    Some((
        foreign(e.get("code")?.as_str()?),
        foreign(e.get("message").and_then(Value::as_str).unwrap_or("")),
    ))
}

/// A string from the API's JSON, bounded and on one escaped line.
fn foreign(s: &str) -> String {
    crate::input::one_line(s, 200)
}

/// Worth sending again: rate limited, a gateway failing, or the resource
/// busy (`conflict`, `locked`: another action runs on it); a request that
/// cannot have reached the API; for reads and deletes, any lost answer.
pub fn retryable(method: &Method, e: &NetError) -> bool {
    match e {
        NetError::Status { status, body, .. } => {
            matches!(status, 429 | 502 | 503 | 504)
                || error_code(body).is_some_and(|(c, _)| {
                    matches!(c.as_str(), "conflict" | "locked" | "rate_limit_exceeded")
                })
        }
        NetError::Transfer { before_sending, .. } => {
            *before_sending || matches!(*method, Method::GET | Method::DELETE)
        }
        _ => false,
    }
}

impl Api {
    /// `endpoint` is the API base (`https://api.hetzner.cloud/v1`).
    pub fn new(endpoint: &str, token: Secret, policy: RetryPolicy) -> Result<Api, HcloudError> {
        let client = net::http_client(&HttpOptions {
            timeout: net::stall_timeout(Duration::from_secs(60)),
            ..HttpOptions::default()
        })?;
        Ok(Api {
            client,
            base: endpoint.trim_end_matches('/').to_owned(),
            token,
            policy,
            requests: AtomicU64::new(0),
        })
    }

    /// Requests sent so far, retries included.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// One call; the reply's JSON (`null` for an empty body).
    pub fn call(
        &self,
        method: Method,
        path: &str,
        query: &[(&str, String)],
        body: Option<&Value>,
    ) -> Result<Value, HcloudError> {
        let url = reqwest::Url::parse_with_params(&format!("{}{path}", self.base), query)
            .map_err(|e| HcloudError::Setup(format!("API URL for {path}: {e}")))?;
        let make = || {
            self.requests.fetch_add(1, Ordering::Relaxed);
            let mut b = self
                .client
                .request(method.clone(), url.clone())
                .bearer_auth(self.token.expose());
            if let Some(body) = body {
                b = b
                    .header(reqwest::header::CONTENT_TYPE, "application/json")
                    .body(body.to_string());
            }
            b
        };
        let resp = net::send(
            &self.policy,
            &make,
            &|e| retryable(&method, e),
            &mut |_, _, _| {},
        )
        .map_err(|e| api_error(&method, path, e))?;
        let raw = net::read_limited(resp, REPLY_LIMIT)?;
        if raw.iter().all(u8::is_ascii_whitespace) {
            return Ok(Value::Null);
        }
        serde_json::from_slice(&raw).map_err(|e| HcloudError::Reply {
            request: format!("{method} {path}"),
            message: format!("not JSON: {e}"),
        })
    }

    pub fn get(&self, path: &str, query: &[(&str, String)]) -> Result<Value, HcloudError> {
        self.call(Method::GET, path, query, None)
    }

    pub fn post(&self, path: &str, body: &Value) -> Result<Value, HcloudError> {
        self.call(Method::POST, path, &[], Some(body))
    }

    pub fn delete(&self, path: &str) -> Result<Value, HcloudError> {
        self.call(Method::DELETE, path, &[], None)
    }

    /// Every item of a paginated list (`key` names the array), following
    /// `meta.pagination.next_page`.
    pub fn list(
        &self,
        path: &str,
        key: &str,
        query: &[(&str, String)],
    ) -> Result<Vec<Value>, HcloudError> {
        let mut items = Vec::new();
        let mut page = 1u64;
        loop {
            let mut q = query.to_vec();
            q.push(("page", page.to_string()));
            q.push(("per_page", PER_PAGE.to_string()));
            let v = self.get(path, &q)?;
            let batch = v
                .get(key)
                .and_then(Value::as_array)
                .ok_or_else(|| HcloudError::Reply {
                    request: format!("GET {path}"),
                    message: format!("no {key:?} list in the reply"),
                })?;
            items.extend(batch.iter().cloned());
            match v
                .pointer("/meta/pagination/next_page")
                .and_then(Value::as_u64)
            {
                Some(next) if next > page && !batch.is_empty() => page = next,
                _ => return Ok(items),
            }
        }
    }

    /// Waits for every action a reply started (`action`, `next_actions`).
    pub fn wait_reply(
        &self,
        reply: &Value,
        what: &str,
        poll: Duration,
        timeout: Duration,
        cancel: &Cancel,
    ) -> Result<(), HcloudError> {
        let next = reply.get("next_actions").and_then(Value::as_array);
        let actions = reply
            .get("action")
            .into_iter()
            .chain(next.into_iter().flatten());
        for a in actions.filter(|a| !a.is_null()) {
            self.wait_action(a, what, poll, timeout, cancel)?;
        }
        Ok(())
    }

    /// Polls the action `action` (an object with `id`) until it ends:
    /// `success` → Ok; `error` → its code and message, naming `what`.
    pub fn wait_action(
        &self,
        action: &Value,
        what: &str,
        poll: Duration,
        timeout: Duration,
        cancel: &Cancel,
    ) -> Result<(), HcloudError> {
        let Some(id) = action.get("id").and_then(Value::as_u64) else {
            return Err(HcloudError::Reply {
                request: what.to_owned(),
                message: "the reply names no action".into(),
            });
        };
        let deadline = Instant::now() + timeout;
        let mut current = action.clone();
        loop {
            match current.get("status").and_then(Value::as_str) {
                Some("success") => return Ok(()),
                Some("error") => {
                    let err = current.get("error").cloned().unwrap_or(Value::Null);
                    return Err(HcloudError::Action {
                        what: what.to_owned(),
                        id,
                        code: foreign(err["code"].as_str().unwrap_or("unknown")),
                        message: foreign(err["message"].as_str().unwrap_or("")),
                    });
                }
                _ => {}
            }
            if Instant::now() >= deadline {
                return Err(HcloudError::Timeout {
                    what: format!("{what} (action {id})"),
                    after: timeout,
                });
            }
            cancel.sleep(poll)?;
            current = self.get(&format!("/actions/{id}"), &[])?["action"].take();
        }
    }
}

/// A failed call as the issue asks: the request it answered, the status
/// and the API's error object verbatim.
fn api_error(method: &Method, path: &str, e: NetError) -> HcloudError {
    match &e {
        NetError::Status { status, body, .. } => HcloudError::Api {
            request: format!("{method} {path}"),
            status: *status,
            code: error_code(body).map(|(c, _)| c),
            body: body.trim().chars().take(400).collect(),
        },
        _ => HcloudError::Net(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: u16, body: &str) -> NetError {
        NetError::Status {
            method: "POST".into(),
            url: "http://127.0.0.1/v1/servers".into(),
            status: code,
            body: body.into(),
            wait: None,
        }
    }

    fn transfer(before_sending: bool) -> NetError {
        NetError::Transfer {
            method: "POST".into(),
            url: "http://127.0.0.1/v1/servers".into(),
            message: "reset".into(),
            before_sending,
        }
    }

    #[test]
    fn an_error_message_with_line_breaks_stays_on_one_line() {
        let (code, message) =
            error_code(r#"{"error":{"code":"x\ny","message":"boom\r\nerror: fake"}}"#).unwrap();
        assert_eq!(code, "x\\ny");
        assert_eq!(message, "boom\\r\\nerror: fake");
    }

    #[test]
    fn what_is_retried() {
        let err = |c: &str| format!(r#"{{"error":{{"code":"{c}","message":"m"}}}}"#);
        for (e, want) in [
            (status(429, &err("rate_limit_exceeded")), true),
            (status(503, ""), true),
            (status(409, &err("conflict")), true),
            (status(423, &err("locked")), true),
            (status(412, &err("resource_unavailable")), false),
            (status(422, &err("invalid_input")), false),
            (status(500, &err("server_error")), false),
            (status(404, &err("not_found")), false),
        ] {
            assert_eq!(retryable(&Method::POST, &e), want, "{e}");
        }
        // A POST whose answer was lost may have created something: not resent.
        assert!(!retryable(&Method::POST, &transfer(false)));
        assert!(retryable(&Method::POST, &transfer(true)));
        assert!(retryable(&Method::GET, &transfer(false)));
        assert!(retryable(&Method::DELETE, &transfer(false)));
    }

    #[test]
    fn error_objects_are_read() {
        assert_eq!(
            error_code(r#"{"error":{"code":"locked","message":"server is locked","details":{}}}"#),
            Some(("locked".into(), "server is locked".into()))
        );
        assert_eq!(error_code("<html>bad gateway</html>"), None);
        assert_eq!(error_code(r#"{"error":{"message":"no code"}}"#), None);
    }

    #[test]
    fn failures_show_the_request_and_the_error_object() {
        let body = r#"{"error":{"code":"resource_unavailable","message":"cx23 unavailable"}}"#;
        let e = api_error(&Method::POST, "/servers", status(412, body));
        let text = e.to_string();
        assert!(text.contains("POST /servers"), "{text}");
        assert!(text.contains("HTTP 412"), "{text}");
        assert!(text.contains(body), "{text}");
        assert!(
            matches!(e, HcloudError::Api { code: Some(ref c), .. } if c == "resource_unavailable")
        );
    }
}
