//! The Talos API through an HTTP CONNECT proxy, as talosctl goes through
//! one (issue 41): `--talos-proxy` sends every Talos connection through the
//! proxy (loopback too, which `HTTPS_PROXY` never covers, as in Go), the
//! proxy's password rides only in `Proxy-Authorization`, and a proxy that
//! refuses or stalls is named and bounded. The proxy here is written for
//! the test: it counts each CONNECT, the target it was asked for and the
//! credentials it was given.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::{Arc, Mutex};

use crate::common;
use common::inventory::{Inventory, NODES};
use common::run::Run;
use common::sims::Nodes;
use common::{json, text};

/// What the test proxy does with a CONNECT.
#[derive(Clone, Copy)]
enum Behaviour {
    /// Opens the tunnel (200) and relays both ways.
    Tunnel,
    /// Answers 403 Forbidden and closes.
    Refuse,
    /// Reads the request and never answers.
    Stall,
}

/// One CONNECT as the proxy received it.
#[derive(Debug, Clone)]
struct Connect {
    target: String,
    authorization: Option<String>,
}

/// An HTTP CONNECT proxy on loopback; its threads end with the test process.
struct ConnectProxy {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Connect>>>,
}

impl ConnectProxy {
    fn start(behaviour: Behaviour) -> ConnectProxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let log = log.clone();
                std::thread::spawn(move || serve(client, behaviour, &log));
            }
        });
        ConnectProxy { addr, seen }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// With a user and password in the URL, as a corporate proxy wants.
    fn url_with(&self, user: &str, password: &str) -> String {
        format!("http://{user}:{password}@{}", self.addr)
    }

    fn connects(&self) -> Vec<Connect> {
        self.seen.lock().unwrap().clone()
    }
}

/// One client: its request head, then what `behaviour` says.
fn serve(mut client: TcpStream, behaviour: Behaviour, log: &Mutex<Vec<Connect>>) {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match client.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => return,
        }
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    let mut lines = head.lines();
    let request: Vec<&str> = lines.next().unwrap_or_default().split(' ').collect();
    if request.first() != Some(&"CONNECT") {
        let _ = client.write_all(b"HTTP/1.1 405 Method Not Allowed\r\n\r\n");
        return;
    }
    let target = request.get(1).copied().unwrap_or_default().to_owned();
    let authorization = lines.find_map(|l| {
        let (name, value) = l.split_once(':')?;
        name.eq_ignore_ascii_case("proxy-authorization")
            .then(|| value.trim().to_owned())
    });
    log.lock().unwrap().push(Connect {
        target: target.clone(),
        authorization,
    });
    match behaviour {
        Behaviour::Refuse => {
            let _ = client.write_all(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n");
        }
        Behaviour::Stall => {
            // Held until the client gives up.
            let _ = client.read_to_end(&mut Vec::new());
        }
        Behaviour::Tunnel => {
            let Ok(node) = TcpStream::connect(&target) else {
                let _ = client.write_all(b"HTTP/1.1 502 Bad Gateway\r\n\r\n");
                return;
            };
            let _ = client.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n");
            let (mut up_r, mut up_w) = (client.try_clone().unwrap(), node.try_clone().unwrap());
            let (mut down_r, mut down_w) = (node, client);
            let up = std::thread::spawn(move || {
                let _ = std::io::copy(&mut up_r, &mut up_w);
                let _ = up_w.shutdown(std::net::Shutdown::Write);
            });
            let _ = std::io::copy(&mut down_r, &mut down_w);
            let _ = down_w.shutdown(std::net::Shutdown::Write);
            let _ = up.join();
        }
    }
}

/// This file's loopback /24 for `scenario` (tests/common/net.rs).
fn net(scenario: &str) -> String {
    common::net::block(&format!("{}::{scenario}", module_path!()))
}

/// The five nodes' inventory on `net` in a fresh folder, with the cluster's
/// secrets made (offline).
fn cluster(net: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let config = Inventory::five_nodes("sim", net).write(dir.path());
    (dir, config)
}

fn imgbuild(dir: &Path, config: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut run = Run::with_config(config, args);
    if args.iter().all(|a| *a != "secrets") {
        run.timeouts(args);
    }
    run.current_dir(dir)
        .env_remove("IMGBUILD_STATE_DIR")
        .env_remove("IMGBUILD_FACTORY")
        .env_remove("TALOSCONFIG")
        .env_remove("IMGBUILD_TALOS_PROXY")
        .env_remove("HTTPS_PROXY")
        .env_remove("https_proxy")
        .env_remove("NO_PROXY")
        .env_remove("no_proxy");
    run.envs(env.iter().copied());
    run.output()
}

fn secrets_gen(dir: &Path, config: &Path) {
    let o = imgbuild(dir, config, &["secrets", "gen"], &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
}

/// The node addresses of [`NODES`] on `net`, port 50000, sorted.
fn node_targets(net: &str) -> Vec<String> {
    let mut t: Vec<String> = NODES
        .iter()
        .map(|(_, host, _)| format!("{net}.{host}:50000"))
        .collect();
    t.sort();
    t
}

const USER: &str = "proxyuser";
const PASSWORD: &str = "pr0xy-pa55word-41";

/// `Basic base64("proxyuser:pr0xy-pa55word-41")`, computed apart from the
/// code under test (`printf %s proxyuser:pr0xy-pa55word-41 | base64`).
const BASIC: &str = "Basic cHJveHl1c2VyOnByMHh5LXBhNTV3b3JkLTQx";

#[test]
fn talos_calls_through_a_connect_proxy_reach_the_nodes_and_env_proxies_skip_loopback() {
    let net = net("tunnel");
    let _nodes = Nodes::cluster(&net, true, &[]);
    let proxy = ConnectProxy::start(Behaviour::Tunnel);
    let (dir, config) = cluster(&net);
    let url = proxy.url_with(USER, PASSWORD);
    let o = imgbuild(
        dir.path(),
        &config,
        &[
            "--debug",
            "--talos-proxy",
            &url,
            "bootstrap",
            "--new-secrets",
        ],
        &[],
    );
    let err = text(&o.stderr);
    assert!(o.status.success(), "{err}");
    let connects = proxy.connects();
    // Every node was reached through the proxy, with the credentials.
    let mut targets: Vec<String> = connects.iter().map(|c| c.target.clone()).collect();
    targets.sort();
    targets.dedup();
    assert_eq!(targets, node_targets(&net), "{connects:?}");
    assert!(
        connects
            .iter()
            .all(|c| c.authorization.as_deref() == Some(BASIC)),
        "{connects:?}"
    );
    // --debug shows each CONNECT: proxy, target, status; never the password.
    let line = format!(
        "debug: gRPC proxy {} CONNECT {net}.11:50000 → 200 Connection established",
        proxy.url()
    );
    assert!(err.lines().any(|l| l.starts_with(&line)), "{line}\n{err}");
    for leak in [PASSWORD, BASIC, "cHJveHl1c2Vy"] {
        assert!(!err.contains(leak), "{leak:?} reached stderr:\n{err}");
    }

    // status reads every node through the proxy.
    let before = proxy.connects().len();
    let o = imgbuild(
        dir.path(),
        &config,
        &["--output", "json", "--talos-proxy", &url, "status"],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let v = json(&o);
    let reachable: Vec<bool> = v["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["reachable"] == true)
        .collect();
    assert_eq!(reachable, [true; 5], "{v}");
    assert!(proxy.connects().len() >= before + 5);

    // HTTPS_PROXY as talosctl reads it: never for loopback (Go's rule), so
    // the same status goes direct and the (refusing) proxy sees nothing.
    let refusing = ConnectProxy::start(Behaviour::Refuse);
    let o = imgbuild(
        dir.path(),
        &config,
        &["--output", "json", "status"],
        &[("HTTPS_PROXY", &refusing.url())],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(json(&o)["nodes"][0]["reachable"] == true);
    // (The Kubernetes API's HTTP client is reqwest's, which proxies
    // loopback: only the Talos connections are counted here.)
    let talos: Vec<Connect> = refusing
        .connects()
        .into_iter()
        .filter(|c| c.target.ends_with(":50000"))
        .collect();
    assert!(talos.is_empty(), "{talos:?}");
}

#[test]
fn a_proxy_that_refuses_connect_is_named_and_the_command_fails() {
    let net = net("refused");
    let proxy = ConnectProxy::start(Behaviour::Refuse);
    let (dir, config) = cluster(&net);
    secrets_gen(dir.path(), &config);
    let url = proxy.url_with(USER, PASSWORD);
    let o = imgbuild(
        dir.path(),
        &config,
        &["--debug", "--talos-proxy", &url, "apply"],
        &[],
    );
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(1), "{out}{err}");
    let refused = format!(
        "proxy {} refused CONNECT {net}.11:50000: HTTP 403 Forbidden",
        proxy.url()
    );
    // Each node's line names the proxy and what it answered.
    for host in ["11", "21"] {
        let refused = refused.replace(".11:", &format!(".{host}:"));
        assert!(out.contains(&refused), "{refused}\n{out}{err}");
    }
    assert!(
        !out.contains("cannot connect"),
        "the proxy failed, not the node:\n{out}"
    );
    assert!(!proxy.connects().is_empty());
    for leak in [PASSWORD, BASIC] {
        assert!(!format!("{out}{err}").contains(leak), "{leak:?}:\n{err}");
    }
}

#[test]
fn a_proxy_that_never_answers_costs_one_call_timeout_per_node() {
    let net = net("stalled");
    let proxy = ConnectProxy::start(Behaviour::Stall);
    let (dir, config) = cluster(&net);
    secrets_gen(dir.path(), &config);
    let o = imgbuild(
        dir.path(),
        &config,
        &[
            "--output",
            "json",
            "--debug",
            "--talos-proxy",
            &proxy.url_with(USER, PASSWORD),
            "status",
            "--call-timeout",
            "1s",
        ],
        &[],
    );
    let err = text(&o.stderr);
    let v = json(&o);
    let nodes = v["nodes"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}\n{err}"));
    assert_eq!(nodes.len(), 5, "{v}");
    for n in nodes {
        assert_eq!(n["reachable"], false, "{n}");
        assert_eq!(
            n["error"], "no answer within the call timeout (1s, connect and Version together)",
            "{n}"
        );
    }
    // One CONNECT per node: the deadline ended it, nothing asked again.
    let mut targets: Vec<String> = proxy.connects().into_iter().map(|c| c.target).collect();
    targets.sort();
    assert_eq!(targets, node_targets(&net));
    let line = format!(
        "debug: gRPC proxy {} CONNECT {net}.11:50000 → no reply, abandoned after",
        proxy.url()
    );
    assert!(err.lines().any(|l| l.starts_with(&line)), "{line}\n{err}");
    assert!(!err.contains(PASSWORD), "{err}");
}
