//! The simulators as processes: each prints one JSON line naming where it
//! listens, and every address there is on 127.0.0.0/8 (tests and the demo
//! never send traffic elsewhere). Being this package's integration test,
//! it also makes `cargo test --workspace` build the `imgbuild-sim` binary
//! with the test build's features, so the tests that start it find it
//! current (tests/common's `sim_bin`).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

/// The first line `imgbuild-sim ARGS` prints, the process killed after.
fn first_line(args: &[&str]) -> serde_json::Value {
    let mut child = Command::new(env!("CARGO_BIN_EXE_imgbuild-sim"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut line = String::new();
    let read = BufReader::new(child.stdout.take().unwrap()).read_line(&mut line);
    child.kill().unwrap();
    child.wait().unwrap();
    read.unwrap();
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {line:?}"))
}

/// Every `scheme://host:port` in `v`, with where it was found.
fn urls(v: &serde_json::Value, at: &str, out: &mut Vec<(String, String)>) {
    match v {
        serde_json::Value::String(s) if s.contains("://") => out.push((at.to_owned(), s.clone())),
        serde_json::Value::Object(m) => m
            .iter()
            .for_each(|(k, v)| urls(v, &format!("{at}.{k}"), out)),
        serde_json::Value::Array(a) => a.iter().for_each(|v| urls(v, at, out)),
        _ => {}
    }
}

#[test]
fn every_simulator_listens_on_loopback_only() {
    let dir = tempfile::tempdir().unwrap();
    let state = |name: &str| dir.path().join(name).display().to_string();
    let base = dir.path().join("base.raw");
    std::fs::write(&base, vec![0u8; 1 << 20]).unwrap();
    let (pve, hc, factory, base) = (
        state("pve"),
        state("hcloud"),
        state("factory"),
        base.display().to_string(),
    );
    let runs: [&[&str]; 4] = [
        &["nodes"],
        &["proxmox", "--state-dir", &pve],
        &["hcloud", "--state-dir", &hc],
        &["factory", "--state-dir", &factory, "--base-image", &base],
    ];
    for args in runs {
        let mut found = Vec::new();
        urls(&first_line(args), "", &mut found);
        assert!(!found.is_empty(), "{args:?} names no address");
        for (at, url) in found {
            let host = url
                .split("://")
                .nth(1)
                .unwrap()
                .split([':', '/'])
                .next()
                .unwrap();
            let ip: std::net::Ipv4Addr = host
                .parse()
                .unwrap_or_else(|_| panic!("{args:?} {at}: {url}"));
            assert!(
                ip.is_loopback(),
                "{args:?} {at}: {url} is not on 127.0.0.0/8"
            );
        }
    }
}
