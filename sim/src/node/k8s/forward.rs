//! Port forwards to a node's APIs and the log of every connection, for
//! labs whose nodes the host reaches only through published ports (Talos
//! in Docker: `docker run -p 127.0.0.1:6443:6443`, `talosctl cluster create
//! --provisioner docker`). A forward serves what the node's own port
//! serves, certificate included: a port forward relays bytes and does not
//! terminate TLS (moby `cmd/docker-proxy/tcp_proxy.go`), so the API server
//! still shows the certificate naming its in-cluster addresses.
//!
//! The log counts connections by the address they came in on, so a test
//! can tell the forward from the in-cluster `:6443`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Mutex;

use serde_json::{Value, json};

#[derive(clap::Args, Default)]
pub struct Forwards {
    /// NAME=IP:PORT: control plane NAME's Kubernetes API also on this
    /// loopback address (port 0: a free one; the start line names it).
    #[arg(long = "kube-forward")]
    pub kube: Vec<String>,
    /// NAME=IP:PORT: node NAME's Talos API also on this loopback address.
    #[arg(long = "talos-forward")]
    pub talos: Vec<String>,
    /// The VIP stays unbound, even once etcd elects a leader, until
    /// `POST /_sim/vip`: a VIP that takes its time to appear (Talos' VIP
    /// controller acquires it only after the election, and an ARP
    /// announcement may be slow to reach this host).
    #[arg(long)]
    pub vip_held: bool,
}

/// Whether the VIP may be bound: false while `--vip-held` holds it.
pub struct VipGate(tokio::sync::watch::Sender<bool>);

impl VipGate {
    pub fn new(held: bool) -> VipGate {
        VipGate(tokio::sync::watch::channel(!held).0)
    }

    /// Waits until the VIP may be bound.
    pub async fn open(&self) {
        let mut rx = self.0.subscribe();
        let _ = rx.wait_for(|open| *open).await;
    }

    pub fn release(&self) {
        self.0.send_replace(true);
    }
}

/// `NAME=IP:PORT` of `flag`, the address loopback.
pub fn parse(flag: &str, spec: &str) -> anyhow::Result<(String, SocketAddr)> {
    let parsed = spec
        .split_once('=')
        .and_then(|(name, addr)| Some((name.to_owned(), addr.parse::<SocketAddr>().ok()?)));
    match parsed {
        Some((name, addr)) if addr.ip().is_loopback() => Ok((name, addr)),
        _ => anyhow::bail!("{flag} {spec}: want NAME=IP:PORT on loopback"),
    }
}

/// Which API a connection was for.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Api {
    Kubernetes,
    Talos,
}

/// Connections accepted, by API and the listening address they came in on.
#[derive(Default)]
pub struct ConnLog(Mutex<BTreeMap<(Api, SocketAddr), u64>>);

impl ConnLog {
    pub fn record(&self, api: Api, on: SocketAddr) {
        *self.0.lock().unwrap().entry((api, on)).or_default() += 1;
    }

    /// `{"k8s":{"IP:PORT":n,…},"talos":{…}}`.
    pub fn json(&self) -> Value {
        let mut out = json!({"k8s": {}, "talos": {}});
        for ((api, on), n) in self.0.lock().unwrap().iter() {
            let key = match api {
                Api::Kubernetes => "k8s",
                Api::Talos => "talos",
            };
            out[key][on.to_string()] = json!(n);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forwards_are_loopback_and_the_log_counts_by_address() {
        let (name, addr) = parse("--kube-forward", "cp-01=127.0.0.1:0").unwrap();
        assert_eq!((name.as_str(), addr.port()), ("cp-01", 0));
        for bad in ["cp-01", "cp-01=10.0.0.1:6443", "cp-01=127.0.0.1"] {
            assert!(parse("--kube-forward", bad).is_err(), "{bad}");
        }
        let log = ConnLog::default();
        let fwd: SocketAddr = "127.0.0.1:6443".parse().unwrap();
        log.record(Api::Kubernetes, fwd);
        log.record(Api::Kubernetes, fwd);
        log.record(Api::Talos, "127.0.0.11:50000".parse().unwrap());
        assert_eq!(
            log.json(),
            json!({"k8s": {"127.0.0.1:6443": 2}, "talos": {"127.0.0.11:50000": 1}})
        );
    }
}
