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
use crate::talos::remove::identity;

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
async fn talos_side(plan: &Plan, nodes: &[&PlannedNode], opts: &Options) -> Vec<TalosSide> {
    let mode = Mode::Mtls(plan.identity.clone());
    let reads = nodes.iter().map(|n| {
        let mode = mode.clone();
        async move {
            let conn = match NodeClient::connect(&n.endpoint, &mode, opts.call_timeout).await {
                Ok(c) => c,
                Err(e) => return (Err(e.into()), None, None),
            };
            let version = conn.version().await.map(|v| v.tag).map_err(Into::into);
            let machine = identity::read(&conn)
                .await
                .ok()
                .flatten()
                .and_then(|id| identity::machine_id(&id));
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
            (version, manifests, machine)
        }
    });
    futures_util::future::join_all(reads).await
}

/// What one node's Talos API showed: its version, its control plane's
/// manifest objects, its machine ID ([`identity::machine_id`]).
type TalosSide = (
    Result<String, ReadError>,
    Option<Result<Vec<Value>, ReadError>>,
    Option<String>,
);

/// Whether a pod or Node item is at `node`'s address (a node whose
/// hostname is not its inventory name).
fn at_address(item: &Value, node: &PlannedNode) -> bool {
    let address = node.address.to_string();
    item["status"]["hostIP"].as_str() == Some(address.as_str())
        || item["status"]["addresses"]
            .as_array()
            .is_some_and(|a| a.iter().any(|x| x["address"].as_str() == Some(&address)))
}

/// The item of `items` that belongs to `node`: the one by its name, else
/// one at its address that `same_machine` accepts — a leftover of another
/// machine that had the address before is never taken for it.
fn item_of<'a>(
    items: &'a [Value],
    name_of: impl Fn(&Value) -> Option<&str>,
    node: &PlannedNode,
    same_machine: impl Fn(&Value) -> bool,
) -> Option<&'a Value> {
    items
        .iter()
        .find(|i| name_of(i) == Some(node.name.as_str()))
        .or_else(|| {
            items
                .iter()
                .find(|i| at_address(i, node) && same_machine(i))
        })
}

/// The mirror pod of `component` on `node` in a pod list.
pub fn pod_on<'a>(pods: &'a Value, node: &PlannedNode) -> Option<&'a Value> {
    item_of(
        pods["items"].as_array()?,
        |p| p["spec"]["nodeName"].as_str(),
        node,
        |_| true,
    )
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

/// What `node`'s Kubernetes Node shows: its kubelet's version and Ready.
/// Its Node is the one by its name, else one at its address whose
/// `status.nodeInfo.machineID` is `machine_id` (the machine ID of the
/// machine answering as `node`, [`identity::machine_id`]) where both are
/// known: a replaced machine at an old address is never taken for the old
/// machine's leftover Node (a NotReady Node it would wait on in vain).
pub fn kubelet_seen(nodes: &Value, node: &PlannedNode, machine_id: Option<&str>) -> Option<Seen> {
    let same_machine = |n: &Value| match (n["status"]["nodeInfo"]["machineID"].as_str(), machine_id)
    {
        (Some(theirs), Some(ours)) if !theirs.is_empty() => theirs == ours,
        _ => true,
    };
    let item = item_of(
        nodes["items"].as_array()?,
        |n| n["metadata"]["name"].as_str(),
        node,
        same_machine,
    )?;
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
            nodes.iter().map(|_| (Err(e.clone()), None, None)).collect()
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
    for (n, (version, manifests, machine)) in nodes.iter().zip(talos) {
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
                if let Some(s) = kubelet_seen(list, n, machine.as_deref()) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::talos::client::NodeEndpoint;
    use serde_json::json;

    fn planned(name: &str, address: &str) -> PlannedNode {
        let address: std::net::IpAddr = address.parse().unwrap();
        PlannedNode {
            name: name.into(),
            role: Role::Worker,
            address,
            endpoint: NodeEndpoint {
                addr: std::net::SocketAddr::new(address, 50000),
                server_name: address,
            },
            install_disk: "/dev/sda".into(),
            config: Vec::new(),
        }
    }

    fn node_item(name: &str, address: &str, machine: &str, version: &str, ready: bool) -> Value {
        json!({
            "metadata": {"name": name},
            "status": {
                "addresses": [{"type": "InternalIP", "address": address}],
                "nodeInfo": {"kubeletVersion": version, "machineID": machine},
                "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
            },
        })
    }

    #[test]
    fn a_replaced_machine_is_never_taken_for_the_old_machines_leftover_node() {
        // worker-02's machine is gone, its Node left NotReady; worker-03 (a
        // new machine, machine ID bbbb…) has its address now.
        let old = node_item("worker-02", "10.0.0.22", "aaaa", "v1.32.1", false);
        let new = node_item("worker-03", "10.0.0.22", "bbbb", "v1.33.5", true);
        let w3 = planned("worker-03", "10.0.0.22");
        // Its own Node, by name, wherever it is listed.
        let list = json!({"items": [old.clone(), new.clone()]});
        let seen = kubelet_seen(&list, &w3, Some("bbbb")).unwrap();
        assert_eq!(
            (seen.version.as_deref(), seen.ready),
            (Some("v1.33.5"), true)
        );
        // Not registered yet: the leftover at its address is another
        // machine's, so nothing is seen (the kubelet is waited for).
        let list = json!({"items": [old.clone()]});
        assert_eq!(kubelet_seen(&list, &w3, Some("bbbb")), None);
        // A Node under another hostname, same machine: taken by address.
        let renamed = node_item("host-7", "10.0.0.22", "bbbb", "v1.33.5", true);
        let list = json!({"items": [old.clone(), renamed]});
        assert_eq!(
            kubelet_seen(&list, &w3, Some("bbbb"))
                .unwrap()
                .version
                .as_deref(),
            Some("v1.33.5")
        );
        // The machine ID unknown (unread): by address, as before.
        let list = json!({"items": [old]});
        assert!(kubelet_seen(&list, &w3, None).is_some());
    }
}
