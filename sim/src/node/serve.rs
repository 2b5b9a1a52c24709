//! The simulated cluster's entry point: the control HTTP server with its
//! `/_sim` endpoints and `/_sim/stats`, and the nodes started.

use super::control::*;
use super::listen::*;
use super::service::*;
use super::state::*;
use super::{day2, etcd, etcd_real, health, k8s, switches};
use axum::Router;
use axum::extract::State;
use axum::routing::{get, post};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;
use tokio::net::TcpListener;

pub async fn run(args: Args) -> anyhow::Result<()> {
    let cluster = new_cluster(args)?;
    let control = TcpListener::bind("127.0.0.1:0").await?;
    let control_url = format!("http://{}", control.local_addr()?);
    let mut listeners = Vec::new();
    for (i, node) in cluster.all().iter().enumerate() {
        let talos = TcpListener::bind(SocketAddr::new(node.ip, cluster.args.talos_port)).await?;
        let k8s = if node.control_plane() {
            Some(TcpListener::bind(SocketAddr::new(node.ip, cluster.args.k8s_port)).await?)
        } else {
            None
        };
        listeners.push((i, talos, k8s));
    }
    let mut forwards = Vec::new();
    let mut forwarded = json!({"kube": {}, "talos": {}});
    for (flag, key, specs) in [
        ("--kube-forward", "kube", &cluster.args.forwards.kube),
        ("--talos-forward", "talos", &cluster.args.forwards.talos),
    ] {
        for spec in specs {
            let (name, addr) = k8s::forward::parse(flag, spec)?;
            let i = cluster
                .all()
                .iter()
                .position(|n| n.name == name && (key == "talos" || n.control_plane()))
                .ok_or_else(|| anyhow::anyhow!("{flag} {spec}: no such control plane or node"))?;
            let l = TcpListener::bind(addr).await?;
            forwarded[key][&name] = json!(l.local_addr()?.to_string());
            forwards.push((key == "kube", i, l));
        }
    }
    println!(
        "{}",
        json!({
            "control": control_url,
            "nodes": cluster.all().iter().map(|n| (n.name.clone(), format!("{}:{}", n.ip, cluster.args.talos_port))).collect::<HashMap<_, _>>(),
            "forwards": forwarded,
        })
    );
    for (i, talos, k8s) in listeners {
        tokio::spawn(serve_talos(cluster.clone(), i, talos));
        if let Some(k8s) = k8s {
            tokio::spawn(serve_k8s(cluster.clone(), Some(i), k8s));
        }
    }
    for (kube, i, l) in forwards {
        if kube {
            tokio::spawn(serve_k8s(cluster.clone(), Some(i), l));
        } else {
            tokio::spawn(serve_talos(cluster.clone(), i, l));
        }
    }
    if let Some(vip) = cluster.args.vip {
        tokio::spawn(serve_vip(cluster.clone(), vip));
    }
    tokio::spawn(k8s::pods::watch(cluster.clone()));
    if cluster.real_etcd.is_some() {
        etcd_real::reconcile_forever(cluster.clone());
    }
    let app = Router::new()
        .route("/_sim/stats", get(stats))
        .route("/_sim/boot", post(boot))
        .route("/_sim/halt", post(halt))
        .route("/_sim/installer", post(switches::installer_switch))
        .route("/_sim/node", post(switches::node_switch))
        .route("/_sim/k8s", post(health::facts_switch))
        .route("/_sim/k8s-apis", post(k8s::deprecated::apis_switch))
        .route("/_sim/etcd", get(etcd::show).post(etcd::control))
        .route("/_sim/vip", post(release_vip))
        .with_state(cluster);
    axum::serve(control, app).await?;
    Ok(())
}

pub(crate) async fn stats(State(cluster): State<Arc<Cluster>>) -> axum::Json<Value> {
    let now = Instant::now();
    let mut totals = Stats::default();
    let (mut up, mut configured, mut config_errors) = (0, 0, 0);
    let nodes: serde_json::Map<String, Value> = cluster
        .all()
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let api = Api {
                cluster: cluster.clone(),
                me: i,
                secure: true,
            };
            let (version, schematic) = (api.version_tag(i), api.schematic_on(i));
            let phase = n.phase(now);
            let name = n.display_name();
            let st = n.st.lock().unwrap();
            totals.applies += st.stats.applies;
            totals.bootstraps += st.stats.bootstraps;
            totals.bootstrap_refusals += st.stats.bootstrap_refusals;
            totals.maintenance_version_calls += st.stats.maintenance_version_calls;
            totals.kubeconfigs += st.stats.kubeconfigs;
            up += u32::from(!st.halted);
            configured += u32::from(phase == Phase::Configured);
            config_errors += u32::from(st.config_error.is_some());
            let mut v = serde_json::to_value(&st.stats).unwrap();
            v["phase"] = json!(format!("{phase:?}").to_lowercase());
            v["ip"] = json!(n.ip);
            v["booted_by"] = json!(n.boot.as_ref().map(|_| &n.name));
            v["config_error"] = json!(st.config_error);
            v["halted"] = json!(st.halted);
            v["node_id"] = json!(st.node_id);
            v["machine_id"] = json!(super::identity::machine_id(&st.node_id));
            v["documents"] = json!(st.applied.as_ref().map(|a| &a.documents));
            v["install_image"] = json!(st.applied.as_ref().map(|a| &a.install_image));
            v["day2"] = day2::stats_of(&cluster, &st.day2, version, schematic, now);
            (name, v)
        })
        .collect();
    let mut totals = serde_json::to_value(totals).unwrap();
    totals["nodes"] = json!(nodes.len());
    totals["up"] = json!(up);
    totals["configured"] = json!(configured);
    totals["config_errors"] = json!(config_errors);
    axum::Json(json!({
        "nodes": nodes,
        "bootstrapped": cluster.boot.lock().unwrap().is_some(),
        "upgrades": *cluster.events.lock().unwrap(),
        "timeline": cluster.timeline_json(now),
        "now_ms": cluster.now_ms(),
        "facts": *cluster.facts.lock().unwrap(),
        "k8s": cluster.k8s_stats(now),
        "removals": cluster.removal_stats(),
        "connections": cluster.connections.json(),
        "totals": totals,
    }))
}

/// `POST /_sim/vip`: the held VIP may appear now.
pub(crate) async fn release_vip(State(cluster): State<Arc<Cluster>>) -> axum::Json<Value> {
    cluster.vip_gate.release();
    axum::Json(json!({"released": true}))
}
