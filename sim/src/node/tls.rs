//! TLS for the simulated nodes (siderolabs/talos `internal/app/apid`,
//! `internal/app/trustd`): the maintenance self-signed certificate, mTLS
//! with the config's `machine.ca`, and the Kubernetes API server's
//! certificate from `cluster.ca`.

use super::k8s;
use super::state::*;
use imgbuild::talos::pki::{self, CertAndKey, LeafSpec};
use rustls::ServerConfig;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

/// The mTLS server config of a configured node: a certificate for its
/// address from the config's OS CA, client certificates from that CA only.
pub(crate) fn mtls_config(cluster: &Cluster, node: &Node) -> Option<Arc<ServerConfig>> {
    let mut st = node.st.lock().unwrap();
    if let Some(cfg) = &st.mtls {
        return Some(cfg.clone());
    }
    let applied = st.applied.clone()?;
    let key = if applied.os_ca.key.is_empty() {
        cluster
            .ca_keys
            .lock()
            .unwrap()
            .get(&applied.os_ca.crt)
            .cloned()?
    } else {
        applied.os_ca.key.clone()
    };
    let ca = CertAndKey {
        crt: applied.os_ca.crt.clone(),
        key,
    };
    // Talos names the node's addresses in its API certificate; with
    // `wrong-cert-name` the node has another one than it is reached at
    // (a DHCP lease, a NAT address).
    let ip = match node.ip {
        IpAddr::V4(v4) if node.has("wrong-cert-name") => {
            let [a, b, c, _] = v4.octets();
            IpAddr::from([a, b, c, 254])
        }
        ip => ip,
    };
    let leaf = pki::issue(
        &ca,
        &LeafSpec {
            common_name: node.name.clone(),
            ips: vec![ip],
            server: true,
            client: true,
            days: 365,
            ..LeafSpec::default()
        },
    )
    .ok()?;
    let cfg = server_config(&leaf, Some(&ca.crt)).ok()?;
    st.mtls = Some(cfg.clone());
    Some(cfg)
}

/// The API server's TLS config once one is up: a certificate from the
/// cluster CA naming every address it may be reached on.
pub(crate) fn k8s_tls(cluster: &Cluster, serving: Option<usize>) -> Option<Arc<ServerConfig>> {
    let now = Instant::now();
    let up = reached(cluster.api_up_at(), now);
    if !up {
        return None;
    }
    if let Some(i) = serving
        && (!reached(cluster.etcd_healthy_at(i), now)
            || cluster.k8s_restarting(i, k8s::versions::Component::ApiServer, now))
    {
        return None;
    }
    let from = serving
        .or_else(|| (0..cluster.count()).find(|&i| reached(cluster.etcd_healthy_at(i), now)))?;
    let applied = cluster.node(from).st.lock().unwrap().applied.clone()?;
    let ca = applied.k8s_ca.clone()?;
    let key = (from, ca.crt.clone());
    if let Some(tls) = cluster.apiserver_tls.lock().unwrap().get(&key) {
        return Some(tls.clone());
    }
    let mut ips = applied.api_sans.clone();
    ips.push(cluster.node(from).ip);
    ips.extend(cluster.args.vip);
    let leaf = pki::issue(
        &ca,
        &LeafSpec {
            common_name: "kube-apiserver".into(),
            ips,
            server: true,
            days: 365,
            ..LeafSpec::default()
        },
    )
    .ok()?;
    let tls = server_config(&leaf, Some(&ca.crt)).ok()?;
    cluster
        .apiserver_tls
        .lock()
        .unwrap()
        .insert(key, tls.clone());
    Some(tls)
}
