use super::*;
use crate::digest::Sha256;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Reads one HTTP/1.1 request head and its Content-Length body; returns
/// the head's lines and the body length.
fn read_request(stream: &mut impl Read) -> Option<(Vec<String>, usize)> {
    let mut reader = BufReader::new(stream);
    let mut lines = Vec::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).ok()? == 0 {
            return None;
        }
        let line = line.trim_end().to_owned();
        if line.is_empty() {
            break;
        }
        lines.push(line);
    }
    let len = lines
        .iter()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|v| v.trim().parse::<usize>().unwrap())
        })
        .unwrap_or(0);
    let mut body = vec![0; len];
    reader.read_exact(&mut body).ok()?;
    Some((lines, len))
}

/// A plain-HTTP server on loopback that answers the i-th request with the
/// i-th canned reply (the last one repeats) and records request heads.
struct Canned {
    url: String,
    heads: Arc<Mutex<Vec<Vec<String>>>>,
}

fn canned(replies: Vec<&'static str>) -> Canned {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let heads = Arc::new(Mutex::new(Vec::new()));
    let seen = heads.clone();
    std::thread::spawn(move || {
        for (i, conn) in listener.incoming().enumerate() {
            let Ok(mut conn) = conn else { return };
            let Some((head, _)) = read_request(&mut conn) else {
                continue;
            };
            seen.lock().unwrap().push(head);
            let reply = replies[i.min(replies.len() - 1)];
            let _ = conn.write_all(reply.as_bytes());
        }
    });
    Canned { url, heads }
}

fn reply(status: &str, extra: &str, body: &str) -> &'static str {
    Box::leak(
        format!(
            "HTTP/1.1 {status}\r\nConnection: close\r\nContent-Length: {}\r\n{extra}\r\n{body}",
            body.len()
        )
        .into_boxed_str(),
    )
}

fn quick() -> RetryPolicy {
    RetryPolicy {
        retries: 3,
        backoff: Duration::from_millis(1),
        max_wait: Duration::from_secs(5),
    }
}

#[test]
fn busy_servers_are_retried_until_they_answer() {
    let srv = canned(vec![
        reply("503 Service Unavailable", "", "busy"),
        reply("503 Service Unavailable", "", "busy"),
        reply("201 Created", "", r#"{"id":"x"}"#),
    ]);
    let client = http_client(&HttpOptions::default()).unwrap();
    let mut pauses = Vec::new();
    let resp = send(
        &quick(),
        &|| {
            client
                .post(format!("{}/schematics", srv.url))
                .body("customization: {}\n")
        },
        &NetError::retryable,
        &mut |n, e, d| pauses.push((n, e.status(), d)),
    )
    .unwrap();
    assert_eq!(resp.status().as_u16(), 201);
    assert_eq!(
        pauses,
        vec![
            (1, Some(503), Duration::from_millis(1)),
            (2, Some(503), Duration::from_millis(2))
        ]
    );
    let heads = srv.heads.lock().unwrap();
    assert_eq!(heads.len(), 3);
    assert!(
        heads[0]
            .iter()
            .any(|l| l.eq_ignore_ascii_case(&format!("user-agent: {USER_AGENT}"))),
        "{:?}",
        heads[0]
    );
}

#[test]
fn retry_after_is_honoured_and_capped() {
    let srv = canned(vec![
        reply("429 Too Many Requests", "Retry-After: 1\r\n", ""),
        reply("200 OK", "", "ok"),
    ]);
    let client = http_client(&HttpOptions::default()).unwrap();
    let mut pauses = Vec::new();
    send(
        &quick(),
        &|| client.get(&srv.url),
        &NetError::retryable,
        &mut |_, _, d| pauses.push(d),
    )
    .unwrap();
    assert_eq!(pauses, vec![Duration::from_secs(1)]);

    let capped = RetryPolicy {
        max_wait: Duration::from_millis(300),
        ..quick()
    };
    let err = NetError::Status {
        method: "GET".into(),
        url: "u".into(),
        status: 429,
        body: String::new(),
        wait: Some(WaitHint(Duration::from_secs(3600))),
    };
    assert_eq!(capped.delay(1, err.wait_hint()), Duration::from_millis(300));
    assert_eq!(quick().delay(4, err.wait_hint()), Duration::from_secs(5));
}

#[test]
fn server_wait_hints_in_every_form() {
    let now = SystemTime::UNIX_EPOCH + Duration::from_secs(784_111_777); // 06 Nov 1994 08:49:37
    let mut h = header::HeaderMap::new();
    assert_eq!(wait_hint(&h, now), None);
    h.insert("ratelimit-reset", "784111787".parse().unwrap());
    assert_eq!(wait_hint(&h, now), Some(Duration::from_secs(10)));
    h.insert(
        header::RETRY_AFTER,
        "Sun, 06 Nov 1994 08:49:40 GMT".parse().unwrap(),
    );
    assert_eq!(wait_hint(&h, now), Some(Duration::from_secs(3)));
    h.insert(header::RETRY_AFTER, "7".parse().unwrap());
    assert_eq!(wait_hint(&h, now), Some(Duration::from_secs(7)));
    h.insert(header::RETRY_AFTER, "soon".parse().unwrap());
    assert_eq!(wait_hint(&h, now), Some(Duration::from_secs(10)));
}

#[test]
fn client_errors_are_not_retried_and_show_the_body_but_no_header() {
    let srv = canned(vec![reply(
        "401 Unauthorized",
        "",
        "authentication failure",
    )]);
    let client = http_client(&HttpOptions::default()).unwrap();
    let secret = "PVEAPIToken=root@pam!ci=0123-secret";
    let err = send(
        &quick(),
        &|| {
            client
                .get(format!("{}/api2/json/version", srv.url))
                .header("authorization", secret)
        },
        &NetError::retryable,
        &mut |_, _, _| panic!("a 401 must not be retried"),
    )
    .unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("HTTP 401: authentication failure"), "{msg}");
    assert!(msg.starts_with("GET http://127.0.0.1:"), "{msg}");
    assert!(!msg.contains("secret") && !format!("{err:?}").contains("secret"));
    assert_eq!(srv.heads.lock().unwrap().len(), 1);
}

#[test]
fn error_pages_are_summarised() {
    assert_eq!(shown("<!DOCTYPE html><html>…"), "an HTML error page");
    let long = "x".repeat(500);
    assert_eq!(shown(&long).chars().count(), ERROR_BODY_SHOW + 1);
    assert_eq!(shown("  Not Found\n"), "Not Found");
}

#[test]
fn refused_connections_are_transfers_and_retryable() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let client = http_client(&HttpOptions::default()).unwrap();
    let mut retries = 0;
    let err = send(
        &quick(),
        &|| client.get(format!("http://127.0.0.1:{port}/")),
        &NetError::retryable,
        &mut |_, _, _| retries += 1,
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            NetError::Transfer {
                before_sending: true,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(retries, 3);
}

#[test]
fn oversized_replies_are_refused() {
    let srv = canned(vec![reply("200 OK", "", &"y".repeat(2000))]);
    let client = http_client(&HttpOptions::default()).unwrap();
    let resp = send_once(client.get(&srv.url)).unwrap();
    let err = read_limited(resp, 1000).unwrap_err();
    assert!(err.to_string().contains("larger than 1000 bytes"), "{err}");
    let resp = send_once(client.get(&srv.url)).unwrap();
    assert_eq!(read_limited(resp, 2000).unwrap().len(), 2000);
}

/// An HTTPS server with a fresh self-signed certificate; counts the bytes of
/// HTTP it received after a handshake.
struct Tls {
    url: String,
    fingerprint: Sha256,
    request_bytes: Arc<AtomicUsize>,
}

fn tls_server() -> Tls {
    let cert = rcgen::generate_simple_self_signed(vec!["127.0.0.1".into()]).unwrap();
    let der = cert.cert.der().to_vec();
    let fingerprint = Sha256::of(&der);
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(cert.signing_key.serialize_der().into());
    let config = Arc::new(
        rustls::ServerConfig::builder_with_provider(tls::provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![der.into()], key)
            .unwrap(),
    );
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("https://{}/", listener.local_addr().unwrap());
    let request_bytes = Arc::new(AtomicUsize::new(0));
    let counted = request_bytes.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(tcp) = conn else { return };
            let conn = rustls::ServerConnection::new(config.clone()).unwrap();
            let mut tls = rustls::StreamOwned::new(conn, tcp);
            if let Some((head, body)) = read_request(&mut tls) {
                let n: usize = head.iter().map(|l| l.len() + 2).sum::<usize>() + body;
                counted.fetch_add(n, Ordering::SeqCst);
                let _ = tls.write_all(reply("200 OK", "", "pinned").as_bytes());
                let _ = tls.flush();
            }
        }
    });
    Tls {
        url,
        fingerprint,
        request_bytes,
    }
}

fn pinned_client(pin: &str) -> Client {
    http_client(&HttpOptions {
        trust: Trust::Pinned(pin.parse().unwrap()),
        ..HttpOptions::default()
    })
    .unwrap()
}

#[test]
fn the_right_pin_is_accepted_in_both_spellings() {
    let srv = tls_server();
    for pin in [srv.fingerprint.colons(), srv.fingerprint.hex()] {
        let resp = send_once(pinned_client(&pin).get(&srv.url)).unwrap();
        assert_eq!(read_limited(resp, 100).unwrap(), b"pinned", "pin {pin}");
    }
    // Lowercase with colons, as some users paste it.
    let lower = srv.fingerprint.colons().to_lowercase();
    assert!(send_once(pinned_client(&lower).get(&srv.url)).is_ok());
}

#[test]
fn a_wrong_pin_is_refused_before_any_request_is_sent() {
    let srv = tls_server();
    let wrong = Sha256::of(b"another certificate");
    let client = pinned_client(&wrong.to_string());
    let err = send_once(client.post(&srv.url).body(vec![7u8; 1 << 16])).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains(&srv.fingerprint.colons()) && msg.contains(&wrong.colons()),
        "{msg}"
    );
    assert!(matches!(err, NetError::Untrusted { .. }), "{err:?}");
    assert!(!err.retryable(), "a refused certificate cannot get better");
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(srv.request_bytes.load(Ordering::SeqCst), 0);
    // The same server with the system roots is refused too: it is self-signed.
    let system = http_client(&HttpOptions::default()).unwrap();
    assert!(send_once(system.get(&srv.url)).is_err());
    assert_eq!(srv.request_bytes.load(Ordering::SeqCst), 0);
}

/// A server that answers with every request head line in its body, as a
/// debugging proxy might.
fn reflecting() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for conn in listener.incoming().take(4) {
            let Ok(mut conn) = conn else { return };
            let Some((head, _)) = read_request(&mut conn) else {
                continue;
            };
            let _ =
                conn.write_all(reply("500 Internal Server Error", "", &head.join("\n")).as_bytes());
        }
    });
    url
}

#[test]
fn credentials_sent_are_cut_out_of_reflected_bodies() {
    let url = reflecting();
    let client = http_client(&HttpOptions::default()).unwrap();
    let token = "root@pam!ci=0e7c6a57-9f0d-4c8e-a7a5-2b7d63c4e111";
    let err = send_once(
        client
            .get(&url)
            .header(header::AUTHORIZATION, format!("PVEAPIToken={token}")),
    )
    .unwrap_err();
    let shown = format!("{err} {:?}", err.body());
    assert!(shown.contains("<redacted>"), "{shown}");
    assert!(!shown.contains("0e7c6a57"), "{shown}");
    assert!(!shown.contains("PVEAPIToken="), "{shown}");
    // A body cut inside the token loses the cut piece too.
    assert_eq!(
        redact("x: Bearer abcdefgh12", &["abcdefgh12345678".into()]),
        "x: Bearer <redacted>"
    );
}

#[test]
fn a_redirect_imgbuild_cannot_follow_says_where_it_leads() {
    let srv = canned(vec![reply(
        "302 Found",
        "Location: file:///etc/passwd\r\n",
        "",
    )]);
    let client = http_client(&HttpOptions::default()).unwrap();
    let err = send_once(client.get(&srv.url)).unwrap_err().to_string();
    assert!(err.contains("HTTP 302"), "{err}");
    assert!(
        err.contains("a redirect to \"file:///etc/passwd\""),
        "{err}"
    );
}

/// A loopback server whose one connection, after the request head, is
/// handed to `answer`; the URL to reach it.
fn one_connection(answer: impl FnOnce(std::net::TcpStream) + Send + 'static) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/reply", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        let Ok((mut conn, _)) = listener.accept() else {
            return;
        };
        let _ = read_request(&mut conn);
        answer(conn);
    });
    url
}

#[test]
fn a_trickling_body_ends_at_the_deadline() {
    let url = one_connection(|mut conn| {
        let _ = conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n");
        for _ in 0..100 {
            if conn.write_all(b"x").is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    });
    let client = http_client(&HttpOptions::default()).unwrap();
    let started = std::time::Instant::now();
    let resp = send_once(client.get(&url).timeout(Duration::from_secs(1))).unwrap();
    let err = read_limited(resp, 1000).unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(5), "{err}");
    assert!(err.to_string().contains("deadline passed"), "{err}");
}

fn stall_after(secs: u64) -> Client {
    http_client(&HttpOptions {
        timeout: Duration::from_secs(secs),
        ..HttpOptions::default()
    })
    .unwrap()
}

/// Holds a connection open, silent, for longer than any test waits.
fn hold(conn: std::net::TcpStream) {
    std::thread::sleep(Duration::from_secs(120));
    drop(conn);
}

#[test]
fn a_body_that_stalls_after_its_headers_is_cut_at_the_stall_timeout() {
    let url = one_connection(|mut conn| {
        let _ = conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nfirst");
        hold(conn);
    });
    let started = std::time::Instant::now();
    let resp = send_once(stall_after(1).get(&url)).unwrap();
    let err = read_limited(resp, 1000).unwrap_err().to_string();
    assert!(started.elapsed() < Duration::from_secs(20), "{err}");
    assert!(err.contains("the server sent nothing for"), "{err}");
    assert!(err.contains(&url), "{err}");
}

#[test]
fn a_server_silent_after_the_request_is_cut_at_the_stall_timeout() {
    let url = one_connection(hold);
    let started = std::time::Instant::now();
    let err = send_once(stall_after(1).get(&url)).unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(20), "{err}");
    assert!(matches!(err, NetError::Transfer { .. }), "{err}");
    assert!(err.to_string().contains("timed out"), "{err}");
}

#[test]
fn a_body_trickling_in_time_is_cut_after_a_stall_window() {
    let url = one_connection(|mut conn| {
        let _ = conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n");
        // A byte every 300 ms: each read gets one well within the timeout.
        while conn.write_all(b"x").is_ok() {
            std::thread::sleep(Duration::from_millis(300));
        }
    });
    let started = std::time::Instant::now();
    let resp = send_once(stall_after(2).get(&url))
        .unwrap()
        .with_stall(Duration::from_secs(2));
    let err = read_limited(resp, 1 << 20).unwrap_err().to_string();
    assert!(started.elapsed() < Duration::from_secs(20), "{err}");
    assert!(err.contains("the server sent only"), "{err}");
}

#[test]
fn an_endless_blocking_reply_is_refused_at_its_limit() {
    let url = one_connection(|mut conn| {
        let _ = conn.write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n");
        let chunk = format!("10000\r\n{}\r\n", "z".repeat(0x10000));
        while conn.write_all(chunk.as_bytes()).is_ok() {}
    });
    let resp = send_once(stall_after(2).get(&url)).unwrap();
    let err = read_limited(resp, 1 << 20).unwrap_err();
    assert!(matches!(err, NetError::TooLarge { .. }), "{err}");
}

#[test]
fn an_endless_async_reply_is_refused_at_its_limit() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        let Ok((mut conn, _)) = listener.accept() else {
            return;
        };
        let _ = read_request(&mut conn);
        let _ = conn.write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n");
        let chunk = format!("10000\r\n{}\r\n", "z".repeat(0x10000));
        while conn.write_all(chunk.as_bytes()).is_ok() {}
    });
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let err = rt
        .block_on(async {
            let client = async_http_client(&HttpOptions::default()).unwrap();
            let resp = send_once_async(client.get(&url)).await.unwrap();
            read_limited_async(resp, 1 << 20, false, Duration::from_secs(5)).await
        })
        .unwrap_err();
    assert!(matches!(err, NetError::TooLarge { .. }), "{err}");
}

#[test]
fn base_urls_with_secrets_are_refused_without_quoting_them() {
    assert_eq!(
        base_url("https://factory.talos.dev/").unwrap().as_str(),
        "https://factory.talos.dev/"
    );
    assert!(base_url("http://127.0.0.1:8080/sub").is_ok());
    for (bad, want) in [
        (
            "http://user:PASSMARK@127.0.0.1:8080/",
            BaseUrlError::Credentials {
                shown: "http://127.0.0.1:8080".into(),
            },
        ),
        (
            "https://PASSMARK@factory.talos.dev/",
            BaseUrlError::Credentials {
                shown: "https://factory.talos.dev".into(),
            },
        ),
        (
            "https://factory.talos.dev/?token=PASSMARK",
            BaseUrlError::Query {
                shown: "https://factory.talos.dev".into(),
            },
        ),
        (
            "https://factory.talos.dev/#PASSMARK",
            BaseUrlError::Query {
                shown: "https://factory.talos.dev".into(),
            },
        ),
        (
            "ftp://factory.talos.dev/PASSMARK",
            BaseUrlError::NotHttp {
                shown: "ftp://factory.talos.dev".into(),
            },
        ),
        ("PASSMARK not a url", BaseUrlError::Unparsable),
    ] {
        let e = base_url(bad).unwrap_err();
        assert_eq!(e, want, "{bad}");
        assert!(!e.to_string().contains("PASSMARK"), "{e}");
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn an_upload_longer_than_the_stall_timeout_completes() {
    const SIZE: usize = 12 << 20;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/upload", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        let Ok((mut conn, _)) = listener.accept() else {
            return;
        };
        let mut reader = BufReader::new(conn.try_clone().unwrap());
        let mut line = String::new();
        while reader.read_line(&mut line).is_ok_and(|n| n > 2) {
            line.clear();
        }
        // The body at about 4 MiB/s: some 3 s for 12 MiB, three stall
        // timeouts, each piece well within one.
        let (mut buf, mut got) = (vec![0; 64 << 10], 0);
        while got < SIZE {
            match reader.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => got += n,
            }
            std::thread::sleep(Duration::from_millis(15));
        }
        let body = got.to_string();
        let _ = write!(
            conn,
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
    });
    let reply = runtime().block_on(async {
        let client = async_http_client(&HttpOptions {
            timeout: Duration::from_secs(1),
            ..HttpOptions::default()
        })
        .unwrap();
        let resp = send_once_async(client.post(&url).body(vec![7u8; SIZE]))
            .await
            .unwrap();
        read_limited_async(resp, 100, false, Duration::from_secs(1)).await
    });
    assert_eq!(reply.unwrap(), SIZE.to_string().as_bytes());
}

#[test]
fn an_async_reply_that_stalls_is_cut_at_the_stall_timeout() {
    let url = one_connection(|mut conn| {
        let _ = conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{");
        hold(conn);
    });
    let started = std::time::Instant::now();
    let err = runtime()
        .block_on(async {
            let client = async_http_client(&HttpOptions::default()).unwrap();
            let resp = send_once_async(client.get(&url)).await.unwrap();
            read_limited_async(resp, 1000, false, Duration::from_secs(1)).await
        })
        .unwrap_err()
        .to_string();
    assert!(started.elapsed() < Duration::from_secs(20), "{err}");
    assert!(err.contains("the server sent nothing for"), "{err}");
}

/// `--debug` shows where a request went, never a credential the URL carries.
#[test]
fn the_debug_log_shows_no_password_or_credential_query_value() {
    let u = reqwest::Url::parse(
        "https://user:pw@pve:8006/api2/json/x?content=import&access_token=abc123&X-Amz-Signature=beef&ticket=PVE%3Aroot&apiKey=k",
    )
    .unwrap();
    assert_eq!(
        debug_url(&u),
        "https://pve:8006/api2/json/x?content=import&access_token=redacted&X-Amz-Signature=redacted&ticket=redacted&apiKey=redacted"
    );
    let plain =
        reqwest::Url::parse("http://127.0.0.1:9/image/abc/v1.11.2/metal-amd64.raw.xz").unwrap();
    assert_eq!(debug_url(&plain), plain.as_str());
}
