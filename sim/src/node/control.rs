//! The `/_sim` control endpoints that boot and halt simulated nodes
//! (`POST /_sim/boot`, `POST /_sim/halt`), as a hypervisor would.

use super::config::*;
use super::listen::*;
use super::state::*;
use super::version;
use axum::extract::State;
use serde_json::json;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;

/// `POST /_sim/boot`: a machine (VM, server) came up with this address.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct BootRequest {
    pub(crate) name: String,
    pub(crate) ip: IpAddr,
    pub(crate) hostname: Option<String>,
    /// A machine config the platform hands over (hcloud `user_data`).
    pub(crate) config: Option<String>,
    /// The Talos version it boots (else `--node-version`, `--talos-version`).
    pub(crate) talos_version: Option<String>,
    /// Whether the firmware booted it with Secure Boot on (else `--secure-boot`).
    pub(crate) secure_boot: Option<bool>,
    /// What makes it this machine and no other (a Proxmox VM's creation, a
    /// Hetzner server's id): another value at an address means another
    /// machine, with its own disk, even under the same `name`. Without it
    /// the `name` alone tells.
    pub(crate) machine: Option<String>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct HaltRequest {
    pub(crate) ip: IpAddr,
}

/// Boots a node for a machine: it listens on `ip` in maintenance mode, or
/// configured from `config` if that passes the node's validation (else it
/// stays in maintenance and stats show why). Booting a running address
/// again changes nothing; after a halt the machine's node comes back with
/// what its disk held (same `name`), or fresh (another machine).
pub(crate) async fn boot(
    State(cluster): State<Arc<Cluster>>,
    axum::Json(req): axum::Json<BootRequest>,
) -> ControlReply {
    use axum::http::StatusCode;
    if !req.ip.is_loopback() {
        return control_error(
            StatusCode::BAD_REQUEST,
            format!("ip {} is not a loopback address", req.ip),
        );
    }
    if let Some(v) = req.talos_version.as_deref()
        && version::Talos::parse(v).is_none()
    {
        return control_error(
            StatusCode::BAD_REQUEST,
            format!("talos_version {v:?} is not a Talos version (vX.Y.Z)"),
        );
    }
    let slot = cluster.index_of(req.ip);
    let previous = slot.map(|i| cluster.node(i));
    if let Some(p) = &previous
        && !p.halted()
    {
        return (
            StatusCode::OK,
            axum::Json(json!({"booted": false, "name": p.display_name(), "ip": p.ip})),
        );
    }
    let info = BootInfo {
        hostname: req.hostname.clone(),
        machine: req.machine.clone(),
    };
    let node = match Node::new(&cluster.args, req.name.clone(), req.ip, None, Some(info)) {
        Ok(n) => n,
        Err(e) => return control_error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    };
    let other_machine = |p: &Node| {
        p.name != req.name
            || req
                .machine
                .as_ref()
                .is_some_and(|m| p.boot.as_ref().and_then(|b| b.machine.as_ref()) != Some(m))
    };
    let wiped = previous
        .as_ref()
        .is_some_and(|p| other_machine(p) || p.st.lock().unwrap().wiped);
    // A new machine, or one whose etcd data a Reset wiped, joins etcd anew.
    let etcd_fresh = previous
        .as_ref()
        .is_some_and(|p| other_machine(p) || p.st.lock().unwrap().etcd_wiped);
    {
        let mut st = node.st.lock().unwrap();
        if let Some(p) = previous.as_ref().filter(|_| !wiped) {
            // The same machine restarted: its disk kept the config.
            let old = p.st.lock().unwrap();
            st.applied = old.applied.clone();
            st.configured_at = old.configured_at;
            st.stats = old.stats.clone();
            st.day2 = old.day2.clone();
            st.node_id = old.node_id.clone();
            let id = super::state::new_boot_id(&req.name, st.day2.life.boot_ids.len());
            st.day2.life.boot_ids.push(id);
        }
        if req.talos_version.is_some() {
            st.day2.version = req.talos_version.clone();
        }
        if let Some(sb) = req.secure_boot {
            st.secure_boot = sb;
        }
        if let Some(config) = &req.config {
            match read_config(config.as_bytes()) {
                Ok(applied) => {
                    if !applied.os_ca.key.is_empty() {
                        cluster
                            .ca_keys
                            .lock()
                            .unwrap()
                            .insert(applied.os_ca.crt.clone(), applied.os_ca.key.clone());
                    }
                    st.applied = Some(Arc::new(applied));
                    st.configured_at = Some(Instant::now());
                }
                Err(status) => st.config_error = Some(status.message().to_owned()),
            }
        }
    }
    let talos = match bind_retrying(SocketAddr::new(req.ip, cluster.args.talos_port)).await {
        Ok(l) => l,
        Err(e) => {
            return control_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("{}:{}: {e}", req.ip, cluster.args.talos_port),
            );
        }
    };
    // Another machine in the slot: the Node the one before left stays.
    if let Some(i) = slot.filter(|_| wiped) {
        cluster.k8s_orphan(i);
    }
    let node = Arc::new(node);
    let i = {
        let mut nodes = cluster.nodes.write().unwrap();
        match slot {
            Some(i) => {
                nodes[i] = node.clone();
                i
            }
            None => {
                nodes.push(node.clone());
                nodes.len() - 1
            }
        }
    };
    if etcd_fresh {
        cluster.rejoin_etcd(i);
    }
    tokio::spawn(serve_talos(cluster.clone(), i, talos));
    tokio::spawn(serve_k8s_once_control_plane(
        cluster.clone(),
        node.clone(),
        i,
    ));
    let st = node.st.lock().unwrap();
    (
        StatusCode::OK,
        axum::Json(json!({
            "booted": true,
            "name": node.name,
            "ip": node.ip,
            "configured": st.configured_at.is_some(),
            "config_error": st.config_error,
        })),
    )
}

/// Stops the node on `ip` (its machine stopped or was deleted).
pub(crate) async fn halt(
    State(cluster): State<Arc<Cluster>>,
    axum::Json(req): axum::Json<HaltRequest>,
) -> ControlReply {
    let Some(i) = cluster.index_of(req.ip) else {
        return control_error(
            axum::http::StatusCode::NOT_FOUND,
            format!("no node on {}", req.ip),
        );
    };
    let node = cluster.node(i);
    let (was_up, configured) = {
        let mut st = node.st.lock().unwrap();
        (
            !std::mem::replace(&mut st.halted, true),
            st.applied.is_some(),
        )
    };
    node.bump();
    (
        axum::http::StatusCode::OK,
        axum::Json(json!({"halted": was_up, "ip": req.ip, "configured": configured})),
    )
}
