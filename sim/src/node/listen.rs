//! Each node's listeners: the machine API on port 50000 (TLS per phase,
//! one connection at a time as apid serves it), the Kubernetes API server
//! once the node is a control plane, and the VIP.

use super::service::*;
use super::state::*;
use super::tls::*;
use super::{health, k8s, remove};
use api::machine::machine_service_server::MachineServiceServer;
use api::storage::storage_service_server::StorageServiceServer;
use axum::Router;
use axum::routing::{get, post};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use imgbuild::talos::api;
use imgbuild::talos::pki::{self};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;
use tokio::net::{TcpListener, TcpStream};
use tonic::Status;

/// Binds `addr`, waiting briefly for a halted node's listener to go.
pub(crate) async fn bind_retrying(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let mut tries = 0;
    loop {
        match TcpListener::bind(addr).await {
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && tries < 50 => {
                tries += 1;
                tokio::time::sleep(ms(20)).await;
            }
            other => return other,
        }
    }
}

/// A booted node's Kubernetes API port opens once its config makes it a
/// control plane, and closes when it halts.
pub(crate) async fn serve_k8s_once_control_plane(cluster: Arc<Cluster>, node: Arc<Node>, i: usize) {
    let addr = SocketAddr::new(node.ip, cluster.args.k8s_port);
    loop {
        if node.halted() {
            return;
        }
        if node.control_plane() && node.phase(Instant::now()) == Phase::Configured {
            if let Ok(l) = bind_retrying(addr).await {
                serve_k8s(cluster, Some(i), l).await;
            }
            return;
        }
        tokio::time::sleep(ms(50)).await;
    }
}

/// Port 50000 of one node (or a forward to it): closed while it reboots,
/// maintenance TLS or mTLS depending on its phase at accept time.
pub(crate) async fn serve_talos(cluster: Arc<Cluster>, i: usize, first: TcpListener) {
    let node = cluster.node(i).clone();
    let addr = first
        .local_addr()
        .unwrap_or(SocketAddr::new(node.ip, cluster.args.talos_port));
    let mut listener = Some(first);
    let mut changes = node.changed.subscribe();
    loop {
        if node.halted() {
            return;
        }
        let down = node.st.lock().unwrap().down_until;
        if let Some(until) = down.filter(|t| Instant::now() < *t) {
            listener = None;
            tokio::time::sleep_until(until.into()).await;
            continue;
        }
        let l = match listener.take() {
            Some(l) => l,
            None => match TcpListener::bind(addr).await {
                Ok(l) => l,
                Err(_) => {
                    tokio::time::sleep(ms(50)).await;
                    continue;
                }
            },
        };
        tokio::select! {
            accepted = l.accept() => {
                if let Ok((tcp, _)) = accepted {
                    cluster.connections.record(k8s::forward::Api::Talos, addr);
                    tokio::spawn(handle_talos(cluster.clone(), i, tcp));
                }
                listener = Some(l);
            }
            _ = changes.changed() => {
                listener = Some(l);
            }
        }
    }
}

pub(crate) async fn handle_talos(cluster: Arc<Cluster>, i: usize, tcp: TcpStream) {
    let node = cluster.node(i).clone();
    let phase = node.phase(Instant::now());
    let (config, secure) = match phase {
        Phase::Down => return,
        Phase::Maintenance => (node.maintenance_tls.clone(), false),
        Phase::Configured => match mtls_config(&cluster, &node) {
            Some(c) => (c, true),
            // A worker waiting for a control plane's CA (trustd): no API yet.
            None => return,
        },
    };
    let stalls = {
        let st = node.st.lock().unwrap();
        st.day2.stall_connects && st.day2.life.draining(Instant::now())
    };
    if stalls {
        tokio::time::sleep(ms(cluster.args.stall_delay)).await;
    }
    let Ok(tls) = tokio_rustls::TlsAcceptor::from(config).accept(tcp).await else {
        return;
    };
    if secure {
        let admin = tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .and_then(|der| {
                let text = pem::encode(&pem::Pem::new("CERTIFICATE", der.to_vec()));
                pki::cert_info(&text).ok()
            })
            .is_some_and(|info| info.organizations.iter().any(|o| o == "os:admin"));
        if !admin {
            return;
        }
    }
    let api = Api {
        cluster: cluster.clone(),
        me: i,
        secure,
    };
    // A reboot ends every connection (the kernel goes with it): a call that
    // reaches this connection after the node went down, before the close
    // below runs, must not be answered from the new boot's state.
    let up = {
        let node = node.clone();
        move |req: tonic::Request<()>| {
            if node.phase(Instant::now()) == Phase::Down {
                Err(Status::unavailable("error reading from server: EOF"))
            } else {
                Ok(req)
            }
        }
    };
    let routes = tonic::service::Routes::new(MachineServiceServer::with_interceptor(
        api.clone(),
        up.clone(),
    ))
    .add_service(StorageServiceServer::with_interceptor(
        api.clone(),
        up.clone(),
    ))
    .add_service(
        api::machine::lifecycle_service_server::LifecycleServiceServer::with_interceptor(
            api.clone(),
            up.clone(),
        ),
    )
    .add_service(
        api::machine::image_service_server::ImageServiceServer::with_interceptor(
            api.clone(),
            up.clone(),
        ),
    )
    .add_service(api::cosi::resource::state_server::StateServer::with_interceptor(api, up))
    .prepare();
    let conn = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
        .http2_only()
        .serve_connection(TokioIo::new(tls), TowerToHyperService::new(routes))
        .into_owned();
    // The maintenance server stops when the node leaves maintenance mode:
    // a client that keeps this channel loses it. Any connection ends when
    // the node halts.
    let mut changes = node.changed.subscribe();
    let leaves = async {
        loop {
            if changes.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
            let phase = node.phase(Instant::now());
            if node.halted() || phase == Phase::Down || (!secure && phase != Phase::Maintenance) {
                return;
            }
        }
    };
    tokio::select! {
        _ = conn => {}
        _ = leaves => {}
    }
}

pub(crate) async fn serve_k8s(
    cluster: Arc<Cluster>,
    serving: Option<usize>,
    listener: TcpListener,
) {
    let node = serving.map(|i| cluster.node(i));
    let Ok(on) = listener.local_addr() else {
        return;
    };
    let mut changes = node.as_ref().map(|n| n.changed.subscribe());
    loop {
        let halted = async {
            match changes.as_mut() {
                Some(c) => {
                    let _ = c.changed().await;
                }
                None => std::future::pending().await,
            }
        };
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = halted => {
                if node.as_ref().is_some_and(|n| n.halted()) {
                    return;
                }
                continue;
            }
        };
        let Ok((tcp, _)) = accepted else {
            continue;
        };
        cluster
            .connections
            .record(k8s::forward::Api::Kubernetes, on);
        let cluster = cluster.clone();
        tokio::spawn(async move {
            let Some(cfg) = k8s_tls(&cluster, serving) else {
                return;
            };
            let Ok(tls) = tokio_rustls::TlsAcceptor::from(cfg).accept(tcp).await else {
                return;
            };
            let app = Router::new()
                .route("/api/v1/nodes", get(health::nodes))
                .route(
                    "/api/v1/nodes/{name}",
                    axum::routing::patch(health::patch_node).delete(remove::delete_node),
                )
                .route("/api/v1/pods", get(health::all_pods))
                .route(
                    "/api/v1/namespaces/{ns}/pods/{name}/eviction",
                    post(health::evict),
                )
                .route("/api/v1/namespaces/kube-system/pods", get(health::pods))
                .route(
                    "/apis/apps/v1/namespaces/kube-system/daemonsets",
                    get(health::daemonsets)
                        .merge(k8s::writes::post_into_kube_system("apps/v1", "daemonsets")),
                )
                .route(
                    "/apis/apps/v1/namespaces/kube-system/deployments",
                    get(health::deployments)
                        .merge(k8s::writes::post_into_kube_system("apps/v1", "deployments")),
                )
                .route("/metrics", get(k8s::deprecated::metrics))
                .merge(k8s::objects::routes())
                .merge(k8s::writes::routes())
                .merge(k8s::discovery::routes())
                .with_state(cluster);
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(tls), TowerToHyperService::new(app))
                .await;
        });
    }
}

/// The VIP appears once etcd elects a leader (after bootstrap), never before,
/// and not while `--vip-held` holds it.
pub(crate) async fn serve_vip(cluster: Arc<Cluster>, vip: IpAddr) {
    cluster.vip_gate.open().await;
    loop {
        if reached(cluster.api_up_at(), Instant::now()) {
            break;
        }
        tokio::time::sleep(ms(50)).await;
    }
    if let Ok(l) = TcpListener::bind(SocketAddr::new(vip, cluster.args.k8s_port)).await {
        serve_k8s(cluster, None, l).await;
    }
}
