//! What the live cluster shows of Kubernetes, read without changing
//! anything: each node's Talos version (Version), each control plane's
//! static pods (their mirror pods in `kube-system`, matched by
//! `spec.nodeName` or `status.hostIP` as talosctl's `checkPodStatus` does),
//! each node's kubelet (`status.nodeInfo.kubeletVersion` and Ready), the
//! kube-proxy image each control plane's config renders (its
//! `Manifests.kubernetes.talos.dev` resources in `controlplane`, siderolabs/
//! talos `pkg/machinery/resources/k8s/manifest.go`), the bootstrap manifest
//! objects against the live ones, and what the removed-API check needs
//! (each API server's `/metrics`, objects under APIs without successor).

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::Value;

use super::api::{Kube, contains, object_name, object_path};
use super::manifests::{self, SyncMode};
use super::plan::{
    ClusterSeen, Component, NodeSeen, ObjectState, Seen, args_of, images_of, proxy_disabled,
    sync_mode, tag_of,
};
use super::removed::{REMOVED, parse_metric};
use crate::inventory::Role;
use crate::talos::bootstrap::{Options, Plan, PlannedNode};
use crate::talos::client::{ApiError, Mode, NodeClient};
use crate::talos::health::{HealthError, kubeconfig, ready};
use crate::talos::kube::KubeError;

/// Why part of the cluster could not be read. Kept as words in
/// [`ClusterSeen`]; one reason may stand for several reads, so it is
/// shared ([`Arc`]).
#[derive(Debug, Clone, thiserror::Error)]
pub enum ReadError {
    /// A node's Talos API (connect, Version, its manifests), on one line.
    #[error("{}", one_line(&.0.to_string()))]
    Talos(Arc<ApiError>),
    /// No async runtime to read the nodes with.
    #[error("{0}")]
    Runtime(Arc<std::io::Error>),
    /// The state dir's kubeconfig could not be read.
    #[error(transparent)]
    Kubeconfig(Arc<HealthError>),
    #[error(transparent)]
    Kube(Arc<KubeError>),
}

impl From<ApiError> for ReadError {
    fn from(e: ApiError) -> Self {
        ReadError::Talos(Arc::new(e))
    }
}

impl From<KubeError> for ReadError {
    fn from(e: KubeError) -> Self {
        ReadError::Kube(Arc::new(e))
    }
}

/// The COSI type Talos keeps its rendered bootstrap manifests under.
pub const MANIFESTS: (&str, &str) = ("controlplane", "Manifests.kubernetes.talos.dev");

/// The add-ons `status` shows: kube-proxy and CoreDNS, by object.
pub const ADDONS: [(&str, &str, &str); 2] = [
    ("kube-proxy", "DaemonSet", "daemonsets"),
    ("coredns", "Deployment", "deployments"),
];

/// An add-on's image live and as Talos renders it.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Addon {
    pub name: &'static str,
    /// The live object's first container image; None when absent.
    pub live: Option<String>,
    /// What the first control plane's manifests hold.
    pub rendered: Option<String>,
}

/// Everything read, with the add-ons for `status`.
#[derive(Debug, Clone, Default)]
pub struct Observed {
    pub cluster: ClusterSeen,
    pub addons: Vec<Addon>,
}

/// Control planes first, then workers, each in inventory order.
pub fn ordered(plan: &Plan) -> Vec<&PlannedNode> {
    let cps = plan.nodes.iter().filter(|n| n.role == Role::Controlplane);
    let workers = plan.nodes.iter().filter(|n| n.role != Role::Controlplane);
    cps.chain(workers).collect()
}

fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
}

/// One line of outside text.
pub(crate) fn one_line(s: &str) -> String {
    crate::input::excerpt(&s.replace(['\n', '\r'], " "), 300)
}

/// The objects of a manifest resource's YAML spec (a list of objects).
pub fn manifest_objects(yaml: &str) -> Vec<Value> {
    let Ok(text) = crate::input::yaml(yaml) else {
        return Vec::new();
    };
    serde_yaml_ng::from_str::<Vec<Value>>(text).unwrap_or_default()
}

/// The first container's image of a workload object.
pub fn first_image(obj: &Value) -> Option<String> {
    obj["spec"]["template"]["spec"]["containers"][0]["image"]
        .as_str()
        .map(str::to_owned)
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> Option<&'a Value> {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
}

/// Reads the Talos side of every node: its version and, on control
/// planes, the manifest objects its config renders.
async fn talos_side(
    plan: &Plan,
    nodes: &[&PlannedNode],
    opts: &Options,
) -> Vec<(
    Result<String, ReadError>,
    Option<Result<Vec<Value>, ReadError>>,
)> {
    let mode = Mode::Mtls(plan.identity.clone());
    let reads = nodes.iter().map(|n| {
        let mode = mode.clone();
        async move {
            let conn = match NodeClient::connect(&n.endpoint, &mode, opts.call_timeout).await {
                Ok(c) => c,
                Err(e) => return (Err(e.into()), None),
            };
            let version = conn.version().await.map(|v| v.tag).map_err(Into::into);
            let manifests = if n.role == Role::Controlplane {
                Some(
                    conn.cosi_list(MANIFESTS.0, MANIFESTS.1)
                        .await
                        .map(|list| {
                            list.iter()
                                .flat_map(|(_, yaml)| manifest_objects(yaml))
                                .collect()
                        })
                        .map_err(Into::into),
                )
            } else {
                None
            };
            (version, manifests)
        }
    });
    futures_util::future::join_all(reads).await
}

/// Whether a pod or Node item belongs to `node`: by name, else by address.
fn is_node(item: &Value, name_field: &Value, node: &PlannedNode) -> bool {
    let address = node.address.to_string();
    name_field.as_str() == Some(node.name.as_str())
        || item["status"]["hostIP"].as_str() == Some(address.as_str())
        || item["status"]["addresses"]
            .as_array()
            .is_some_and(|a| a.iter().any(|x| x["address"].as_str() == Some(&address)))
}

/// The mirror pod of `component` on `node` in a pod list.
pub fn pod_on<'a>(pods: &'a Value, node: &PlannedNode) -> Option<&'a Value> {
    pods["items"]
        .as_array()?
        .iter()
        .find(|p| is_node(p, &p["spec"]["nodeName"], node))
}

/// What a pod shows: its image's tag and Ready.
pub fn pod_seen(pod: &Value) -> Seen {
    Seen {
        version: pod["spec"]["containers"][0]["image"]
            .as_str()
            .and_then(tag_of)
            .map(str::to_owned),
        ready: ready(pod),
    }
}

/// What a Node shows: its kubelet's version and Ready.
pub fn kubelet_seen(nodes: &Value, node: &PlannedNode) -> Option<Seen> {
    let item = nodes["items"]
        .as_array()?
        .iter()
        .find(|n| is_node(n, &n["metadata"]["name"], node))?;
    Some(Seen {
        version: item["status"]["nodeInfo"]["kubeletVersion"]
            .as_str()
            .map(str::to_owned),
        ready: ready(item),
    })
}

/// The pods of `component` in `kube-system`.
pub fn pods_of(kube: &Kube, component: Component) -> Result<Value, KubeError> {
    kube.get_some(&format!(
        "/api/v1/namespaces/kube-system/pods?labelSelector=k8s-app%3D{}",
        component.name()
    ))
}

/// The API server on control plane `node`, at the endpoint's port.
pub fn kube_on(kube: &Kube, node: &PlannedNode) -> Kube {
    let port = reqwest::Url::parse(&kube.kc.server)
        .ok()
        .and_then(|u| u.port_or_known_default())
        .unwrap_or(6443);
    let host = match node.address {
        std::net::IpAddr::V6(a) => format!("[{a}]"),
        std::net::IpAddr::V4(a) => a.to_string(),
    };
    Kube {
        kc: kube.kc.with_server(&format!("https://{host}:{port}")),
        timeout: kube.timeout,
    }
}

/// Compares each object with the live one, as `mode` would apply it
/// (from Talos v1.13 with Talos's inventory mark).
pub fn compare_objects(
    kube: &Kube,
    objects: &[Value],
    mode: SyncMode,
) -> Result<Vec<(String, ObjectState)>, KubeError> {
    let mut discovery = BTreeMap::new();
    objects
        .iter()
        .map(|o| {
            let res = kube.resource_of(o, &mut discovery)?;
            let live = kube.get(&object_path(&res, o))?;
            let want = match mode {
                SyncMode::Apply => manifests::marked(o),
                SyncMode::Replace => o.clone(),
            };
            let state = match live {
                None => ObjectState::Missing,
                Some(l)
                    if mode == SyncMode::Apply
                        && matches!(manifests::mark_of(&l), manifests::Mark::Other(_)) =>
                {
                    ObjectState::Foreign
                }
                Some(l) if contains(&l, &want) => ObjectState::InSync,
                Some(_) => ObjectState::Differs,
            };
            Ok((object_name(o), state))
        })
        .collect()
}

/// Talos v1.13+: what its inventory lists that `objects` no longer hold,
/// split into what may be pruned (marked as Talos's) and what may not (no
/// mark); entries whose object is gone are left out.
pub fn stale_objects(
    kube: &Kube,
    objects: &[Value],
) -> Result<(Vec<String>, Vec<String>), KubeError> {
    let Some(inventory) = kube.get(&manifests::inventory_path())? else {
        return Ok((Vec::new(), Vec::new()));
    };
    let mut discovery = BTreeMap::new();
    let (mut prune, mut unmarked) = (Vec::new(), Vec::new());
    for r in manifests::stale(&manifests::inventory_refs(&inventory), objects) {
        let (path, api_version) = manifests::locate(kube, &r, &mut discovery)?;
        match kube.get(&path)? {
            None => {}
            Some(live) if manifests::prunable(&live) => prune.push(r.describe(&api_version)),
            Some(_) => unmarked.push(r.describe(&api_version)),
        }
    }
    Ok((prune, unmarked))
}

/// Reads the cluster. `talos_after` names the Talos version a node will
/// run when Kubernetes moves (a Talos upgrade in the same run). Blocking.
pub fn observe(plan: &Plan, talos_after: &BTreeMap<String, String>, opts: &Options) -> Observed {
    let nodes = ordered(plan);
    let mut seen = ClusterSeen {
        proxy_disabled: nodes
            .iter()
            .find(|n| n.role == Role::Controlplane)
            .is_some_and(|n| proxy_disabled(&n.config)),
        ..ClusterSeen::default()
    };
    let talos = match runtime() {
        Ok(rt) => rt.block_on(talos_side(plan, &nodes, opts)),
        Err(e) => {
            let e = ReadError::Runtime(Arc::new(e));
            nodes.iter().map(|_| (Err(e.clone()), None)).collect()
        }
    };
    let kube = kubeconfig(plan)
        .map(|kc| Kube {
            kc,
            timeout: opts.call_timeout,
        })
        .map_err(|e| ReadError::Kubeconfig(Arc::new(e)));
    let kube_nodes = kube
        .as_ref()
        .map_err(Clone::clone)
        .and_then(|k| Ok(k.get_some("/api/v1/nodes")?));
    let pods: BTreeMap<Component, Result<Value, ReadError>> = Component::STATIC_PODS
        .into_iter()
        .map(|c| {
            let list = kube
                .as_ref()
                .map_err(Clone::clone)
                .and_then(|k| Ok(pods_of(k, c)?));
            (c, list)
        })
        .collect();
    let mut first_manifests: Option<Result<Vec<Value>, ReadError>> = None;
    for (n, (version, manifests)) in nodes.iter().zip(talos) {
        let mut row = NodeSeen {
            node: n.name.clone(),
            control_plane: n.role == Role::Controlplane,
            wanted_images: images_of(&n.config),
            args: args_of(&n.config),
            ..NodeSeen::default()
        };
        let mut errors = Vec::new();
        match version {
            Ok(v) => row.talos = Some(talos_after.get(&n.name).cloned().unwrap_or(v)),
            Err(e) => errors.push(e.to_string()),
        }
        match &kube_nodes {
            Ok(list) => {
                if let Some(s) = kubelet_seen(list, n) {
                    row.components.insert(Component::Kubelet, s);
                }
            }
            Err(e) => errors.push(format!("Kubernetes nodes: {e}")),
        }
        if row.control_plane {
            for (c, list) in &pods {
                match list {
                    Ok(l) => {
                        if let Some(p) = pod_on(l, n) {
                            row.components.insert(*c, pod_seen(p));
                        }
                    }
                    Err(e) => errors.push(format!("{} pods: {e}", c.name())),
                }
            }
            match &manifests {
                Some(Ok(objects)) => {
                    if let Some(img) =
                        find(objects, "DaemonSet", "kube-proxy").and_then(first_image)
                    {
                        row.components.insert(
                            Component::KubeProxy,
                            Seen {
                                version: tag_of(&img).map(str::to_owned),
                                ready: true,
                            },
                        );
                    }
                }
                Some(Err(e)) => errors.push(format!("manifests: {e}")),
                None => {}
            }
            if first_manifests.as_ref().is_none_or(|m| m.is_err()) {
                first_manifests = manifests;
            }
        }
        row.error = (!errors.is_empty()).then(|| errors.join("; "));
        seen.nodes.push(row);
    }
    let mut addons: Vec<Addon> = ADDONS
        .iter()
        .map(|(name, _, _)| Addon {
            name,
            ..Addon::default()
        })
        .collect();
    match (&kube, first_manifests) {
        (Ok(k), Some(Ok(objects))) => {
            let mode = sync_mode(&seen);
            match compare_objects(k, &objects, mode) {
                Ok(states) => seen.manifests = states,
                Err(e) => seen.manifests_error = Some(e.to_string()),
            }
            if mode == SyncMode::Apply {
                match stale_objects(k, &objects) {
                    Ok((prune, unmarked)) => {
                        seen.prune = prune;
                        seen.unmarked = unmarked;
                    }
                    Err(e) => seen.manifests_error = Some(e.to_string()),
                }
            }
            for (a, (name, kind, plural)) in addons.iter_mut().zip(ADDONS) {
                a.rendered = find(&objects, kind, name).and_then(first_image);
                a.live = k
                    .get(&format!(
                        "/apis/apps/v1/namespaces/kube-system/{plural}/{name}"
                    ))
                    .ok()
                    .flatten()
                    .as_ref()
                    .and_then(first_image);
            }
        }
        (Err(e), _) => seen.manifests_error = Some(e.to_string()),
        (_, Some(Err(e))) => seen.manifests_error = Some(e.to_string()),
        (_, None) => seen.manifests_error = Some("no control plane".into()),
    }
    match &kube {
        Ok(k) => removed_side(k, plan, &mut seen),
        Err(e) => seen.api_check_error = Some(e.to_string()),
    }
    Observed {
        cluster: seen,
        addons,
    }
}

/// Each control plane's requested deprecated APIs and the objects stored
/// under APIs without successor.
fn removed_side(kube: &Kube, plan: &Plan, seen: &mut ClusterSeen) {
    let mut errors = Vec::new();
    // Behind a port forward (`cluster.kubernetesEndpoint`) only the API
    // server it leads to can be asked.
    let forwarded = plan.kubernetes_endpoint.is_some();
    let cps = plan.nodes.iter().filter(|n| n.role == Role::Controlplane);
    for cp in cps.take(if forwarded { 1 } else { usize::MAX }) {
        let on = if forwarded {
            kube.clone()
        } else {
            kube_on(kube, cp)
        };
        match on.metrics() {
            Ok(text) => seen.requested.extend(
                parse_metric(&text)
                    .into_iter()
                    .map(|r| (cp.name.clone(), r)),
            ),
            Err(e) => errors.push(format!("{}: {e}", cp.name)),
        }
    }
    for api in REMOVED.iter().filter(|r| r.successor.is_none()) {
        match kube.get(&api.list_path()) {
            Ok(Some(list)) => {
                let n = list["items"].as_array().map_or(0, Vec::len) as u64;
                seen.stored.push((*api, n));
            }
            Ok(None) => {}
            Err(e) => errors.push(e.to_string()),
        }
    }
    if !errors.is_empty() {
        seen.api_check_error = Some(errors.join("; "));
    }
}
