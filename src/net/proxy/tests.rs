//! The proxy choice against Go's documented behaviour: the cases of
//! golang.org/x/net `http/httpproxy/proxy_test.go` (`UseProxyTests` with its
//! `noProxy` list, `TestAllNoProxy`, `TestInvalidNoProxy`, `FromEnvironment`
//! precedence) and `parseProxy`'s forms, restated here.

use super::*;

fn env(vars: &[(&str, &str)]) -> ProxyEnv {
    let vars: Vec<(String, String)> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    ProxyEnv::from_lookup(move |k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
}

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

/// httpproxy's `noProxy` test list.
const GO_NO_PROXY: &str = "foobar.com, .barbaz.net, *.wildcard.io, 192.168.1.1, 192.168.1.2:81, 192.168.1.3:80, 10.0.0.0/30, 2001:db8::52:0:1, [2001:db8::52:0:2]:443, [2001:db8::52:0:3]:80, 2002:db8:a::45/64";

#[test]
fn no_proxy_follows_gos_use_proxy_table() {
    let e = env(&[
        ("HTTPS_PROXY", "proxy.corp:3128"),
        ("NO_PROXY", GO_NO_PROXY),
    ]);
    // (host, proxied) at port 80, as Go's TestUseProxy asks.
    let table = [
        ("localhost", false),
        ("127.0.0.1", false),
        ("127.0.0.2", false),
        ("::1", false),
        ("::2", true),
        ("192.168.1.1", false),
        ("192.168.1.2", true),
        ("192.168.1.3", false),
        ("192.168.1.4", true),
        ("10.0.0.2", false),
        ("2001:db8::52:0:1", false),
        ("2001:db8::52:0:2", true),
        ("2001:db8::52:0:3", false),
        ("2002:db8:a::123", false),
        ("fe80::424b:c8be:1643:a1b6", true),
        ("barbaz.net", true),
        ("www.barbaz.net", false),
        ("foobar.com", false),
        ("www.foobar.com", false),
        ("foofoobar.com", true),
        ("baz.com", true),
        ("localhost.net", true),
        ("local.localhost", true),
        ("barbarbaz.net", true),
        ("wildcard.io", true),
        ("nested.wildcard.io", false),
        ("awildcard.io", true),
    ];
    let wrong: Vec<_> = table
        .iter()
        .filter(|(host, proxied)| e.use_proxy(host, "80") != *proxied)
        .collect();
    assert!(wrong.is_empty(), "differs from Go for {wrong:?}");
}

#[test]
fn a_star_exempts_everything_and_a_malformed_entry_nothing() {
    let all = env(&[("HTTPS_PROXY", "proxy:3128"), ("NO_PROXY", "10.0.0.0/8, *")]);
    assert!(all.proxy_for(addr("192.0.2.10:50000")).is_none());
    assert!(!all.use_proxy("example.com", "80"));
    let bad = env(&[("HTTPS_PROXY", "proxy:3128"), ("NO_PROXY", ":1")]);
    assert!(bad.use_proxy("example.com", "80"));
}

#[test]
fn node_addresses_match_cidr_ip_and_ip_port_entries() {
    let e = env(&[
        ("HTTPS_PROXY", "http://proxy.corp:3128"),
        (
            "NO_PROXY",
            "10.5.0.0/16,192.0.2.7,192.0.2.8:50001,[fd00::1]:50000",
        ),
    ]);
    let via = |s| e.proxy_for(addr(s)).map(|p| p.to_string());
    assert_eq!(via("10.5.3.4:50000"), None);
    assert_eq!(
        via("10.6.3.4:50000").as_deref(),
        Some("http://proxy.corp:3128")
    );
    assert_eq!(via("192.0.2.7:50000"), None);
    assert_eq!(
        via("192.0.2.8:50000").as_deref(),
        Some("http://proxy.corp:3128")
    );
    assert_eq!(via("192.0.2.8:50001"), None);
    assert_eq!(via("[fd00::1]:50000"), None);
    assert_eq!(
        via("[fd00::1]:50001").as_deref(),
        Some("http://proxy.corp:3128")
    );
    // Loopback never, whatever NO_PROXY says (Go's useProxy).
    assert_eq!(via("127.0.0.1:50000"), None);
    assert_eq!(via("[::1]:50000"), None);
}

#[test]
fn upper_case_wins_and_empty_counts_as_unset() {
    let e = env(&[("HTTPS_PROXY", "upper:1"), ("https_proxy", "lower:2")]);
    assert_eq!(
        e.proxy_for(addr("192.0.2.1:50000")).unwrap().to_string(),
        "http://upper:1"
    );
    let e = env(&[("HTTPS_PROXY", ""), ("https_proxy", "lower:2")]);
    assert_eq!(
        e.proxy_for(addr("192.0.2.1:50000")).unwrap().to_string(),
        "http://lower:2"
    );
    let e = env(&[
        ("https_proxy", "lower:2"),
        ("NO_PROXY", ""),
        ("no_proxy", "192.0.2.1"),
    ]);
    assert!(e.proxy_for(addr("192.0.2.1:50000")).is_none());
    // HTTP_PROXY is for http:// URLs; grpc-go asks for https://.
    let e = env(&[("HTTP_PROXY", "plain:3128")]);
    assert!(e.proxy_for(addr("192.0.2.1:50000")).is_none());
}

#[test]
fn proxy_urls_parse_as_go_reads_them() {
    let shown = |s: &str| Proxy::parse(s).map(|p| p.to_string());
    assert_eq!(shown("127.0.0.1:8080").unwrap(), "http://127.0.0.1:8080");
    assert_eq!(
        shown("cache.corp.example.com:1234").unwrap(),
        "http://cache.corp.example.com:1234"
    );
    assert_eq!(
        shown("cache.corp.example.com").unwrap(),
        "http://cache.corp.example.com:80"
    );
    assert_eq!(shown("localhost").unwrap(), "http://localhost:80");
    // https:// is spoken to in plaintext, as grpc-go does; its port is 443.
    assert_eq!(
        shown("https://proxy.corp").unwrap(),
        "http://proxy.corp:443"
    );
    assert_eq!(
        shown("http://[fd00::9]:3128").unwrap(),
        "http://[fd00::9]:3128"
    );
    assert!(matches!(
        Proxy::parse("socks5://127.0.0.1"),
        Err(ProxyUrlError::Scheme(_))
    ));
    assert_eq!(Proxy::parse("http://"), Err(ProxyUrlError::Invalid));
}

#[test]
fn credentials_make_basic_authorization_and_are_never_shown() {
    let p = Proxy::parse("http://al%40ice:s3cr%3At@proxy.corp:3128").unwrap();
    // Go decodes the userinfo before base64 ("al@ice:s3cr:t").
    assert_eq!(
        p.authorization.as_deref(),
        Some("Basic YWxAaWNlOnMzY3I6dA==")
    );
    assert!(p.has_credentials());
    for shown in [p.to_string(), format!("{p:?}")] {
        for leak in ["s3cr", "al@ice", "al%40ice"] {
            assert!(!shown.contains(leak), "{shown}");
        }
    }
    let e = ProxyError::Refused {
        proxy: p.to_string(),
        target: addr("192.0.2.1:50000"),
        status: "407 Proxy Authentication Required".into(),
    };
    assert_eq!(
        e.to_string(),
        "proxy http://proxy.corp:3128 refused CONNECT 192.0.2.1:50000: HTTP 407 Proxy Authentication Required"
    );
    assert!(
        Proxy::parse("proxy.corp:3128")
            .unwrap()
            .authorization
            .is_none()
    );
}

#[test]
fn a_proxy_urls_password_is_found_for_redaction_as_written_and_decoded() {
    assert_eq!(
        passwords_in("http://bob:s3cr%3At@proxy:3128"),
        ["s3cr%3At", "s3cr:t"]
    );
    assert_eq!(passwords_in("bob:hunter2@proxy:3128"), ["hunter2"]);
    assert!(passwords_in("http://proxy:3128").is_empty());
    assert!(passwords_in("http://bob@proxy:3128").is_empty());
}
