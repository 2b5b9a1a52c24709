//! The simulated Kubernetes API's answers to what `talosctl health` checks
//! beyond etcd and services (siderolabs/talos `pkg/cluster/check/
//! default.go` and `kubernetes.go`): nodes Ready and schedulable
//! (`spec.unschedulable`, set while a node is cordoned), the kube-proxy
//! DaemonSet and the CoreDNS Deployment with their pods' Ready conditions
//! (`DaemonSetPresent`/`DeploymentPresent` by label selector, then
//! `K8sPodReadyAssertion`), and the switches that break them.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Query, State};
use serde_json::{Value, json};

use super::k8s::{objects, selector};
use super::state::{Cluster, ControlReply, Phase, ms, reached};
use super::state::{Facts, Heartbeat};

/// The etcd member ID of a stale member (a removed control plane's).
pub(crate) const STALE_MEMBER_ID: u64 = 0x1fff;

impl Default for Facts {
    fn default() -> Self {
        Facts {
            kube_proxy_ready: true,
            coredns_ready: true,
            stale_etcd_member: false,
            node_monitor_grace_period: None,
        }
    }
}

/// `POST /_sim/k8s`: each field given replaces the fact.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FactsSwitch {
    kube_proxy_ready: Option<bool>,
    coredns_ready: Option<bool>,
    stale_etcd_member: Option<bool>,
    node_monitor_grace_period: Option<u64>,
}

pub(crate) async fn facts_switch(
    State(cluster): State<Arc<Cluster>>,
    axum::Json(req): axum::Json<FactsSwitch>,
) -> ControlReply {
    let mut f = cluster.facts.lock().unwrap();
    if let Some(v) = req.kube_proxy_ready {
        f.kube_proxy_ready = v;
    }
    if let Some(v) = req.coredns_ready {
        f.coredns_ready = v;
    }
    if let Some(v) = req.stale_etcd_member {
        f.stale_etcd_member = v;
    }
    if let Some(v) = req.node_monitor_grace_period {
        f.node_monitor_grace_period = Some(v);
    }
    (axum::http::StatusCode::OK, axum::Json(json!(*f)))
}

/// The Ready message of a kubelet whose runtime has no network plugin.
const NO_CNI: &str = "container runtime network not ready: NetworkReady=false reason:NetworkPluginNotReady message:Network plugin returns error: cni plugin not initialized";

/// A registered Kubernetes node: its name, whether it is Ready, cordoned.
pub(crate) struct Registered {
    pub index: usize,
    pub name: String,
    ready: bool,
    cni: bool,
    cordoned: bool,
    /// Cordoned and its pods gone: nothing is scheduled onto it.
    drained: bool,
}

impl Cluster {
    /// The nodes the API server lists now.
    pub(crate) fn registered(&self, now: Instant) -> Vec<Registered> {
        let api_up = self.api_up_at();
        // A CNI runs once a control plane's config brought one.
        let cni = self.all().iter().any(|n| {
            let st = n.st.lock().unwrap();
            st.applied
                .as_ref()
                .is_some_and(|a| a.control_plane && a.cni && reached(st.configured_at, now))
        });
        (0..self.count())
            .filter_map(|i| {
                if self.k8s_node_deleted(i) {
                    return None;
                }
                let registered = self.kubelet_healthy_at(i)?.max(api_up?);
                if now < registered {
                    return None;
                }
                let node = self.node(i);
                let (cordoned, pods_gone) = {
                    let life = &node.st.lock().unwrap().day2.life;
                    (life.cordoned, life.pods_gone)
                };
                Some(Registered {
                    index: i,
                    name: node.display_name(),
                    ready: cni && now >= registered + ms(self.args.ready_delay),
                    cni,
                    cordoned,
                    drained: cordoned && pods_gone,
                })
            })
            .collect()
    }

    /// Whether a control plane's config turns an addon off
    /// (`cluster.proxy.disabled`, `cluster.coreDNS.disabled`).
    fn addon_disabled(&self, key: &str) -> bool {
        self.all().iter().any(|n| {
            let st = n.st.lock().unwrap();
            st.applied.as_ref().is_some_and(|a| {
                a.control_plane && a.v1alpha1["cluster"][key]["disabled"] == json!(true)
            })
        })
    }
}

impl Cluster {
    /// Notes the status every registered node's kubelet posts now (the
    /// watcher's tick stands for `nodeStatusUpdateFrequency`); a node that
    /// is down posts nothing.
    pub(crate) fn k8s_heartbeats(&self, now: Instant) {
        let posted: Vec<(usize, Heartbeat)> = self
            .registered(now)
            .into_iter()
            .filter(|r| self.node(r.index).phase(now) != Phase::Down)
            .map(|r| {
                let (machine_id, boot_id) = self.k8s_node_ids(r.index);
                let beat = Heartbeat {
                    name: r.name,
                    at: now,
                    ready: r.ready,
                    machine_id,
                    boot_id,
                };
                (r.index, beat)
            })
            .collect();
        let mut k8s = self.k8s.lock().unwrap();
        // A kubelet registering an orphan's name takes its Node over.
        k8s.orphans
            .retain(|(_, o)| !posted.iter().any(|(_, b)| b.name == o.name));
        k8s.heartbeats.extend(posted);
    }

    /// The Node of a node whose kubelet stopped posting (down, rebooting,
    /// powered off) and whose Node object was not deleted: kube-controller-
    /// manager's node lifecycle controller (kubernetes
    /// `pkg/controller/nodelifecycle/node_lifecycle_controller.go`
    /// `tryUpdateNodeHealth`) leaves its last status until
    /// `--node-monitor-grace-period` has passed since the last heartbeat,
    /// then sets Ready Unknown ("Kubelet stopped posting node status.") and
    /// taints it unreachable.
    fn silent_node(&self, i: usize, beat: &Heartbeat, now: Instant) -> Value {
        let item = self.posted_node(i, beat, now);
        self.aged(item, beat, now)
    }

    /// What node `i`'s kubelet last posted, without its Ready condition.
    fn posted_node(&self, i: usize, beat: &Heartbeat, now: Instant) -> Value {
        let (cordoned, notes) = {
            let node = self.node(i);
            let st = node.st.lock().unwrap();
            (st.day2.life.cordoned, annotations(&st.day2.life))
        };
        let mut item = json!({
            "metadata": {"name": beat.name, "annotations": notes},
            "spec": {"unschedulable": cordoned},
        });
        self.k8s_node_item(i, &mut item, now);
        // What that kubelet last posted, whichever machine is in the slot now.
        item["status"]["nodeInfo"]["machineID"] = json!(beat.machine_id);
        item["status"]["nodeInfo"]["bootID"] = json!(beat.boot_id);
        item
    }

    /// A silent Node's Ready condition (and taints) `now`.
    fn aged(&self, mut item: Value, beat: &Heartbeat, now: Instant) -> Value {
        let grace = ms(self
            .facts
            .lock()
            .unwrap()
            .node_monitor_grace_period
            .unwrap_or(self.args.k8s.node_monitor_grace_period));
        let condition = if now < beat.at + grace {
            if beat.ready {
                json!({"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting ready status"})
            } else {
                json!({"type": "Ready", "status": "False", "reason": "KubeletNotReady", "message": "kubelet is starting"})
            }
        } else {
            item["spec"]["taints"] = json!([
                {"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule"},
                {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"},
            ]);
            json!({"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
                "message": "Kubelet stopped posting node status."})
        };
        item["status"]["conditions"] = json!([condition]);
        item
    }

    /// Another machine (or a wiped one) boots into slot `i`: the Node the
    /// machine before it left stays in the API server as it last posted it,
    /// unless it was deleted.
    pub(crate) fn k8s_orphan(&self, i: usize) {
        if self.k8s_node_deleted(i) {
            return;
        }
        let Some(beat) = self.heartbeat(i) else {
            return;
        };
        let item = self.posted_node(i, &beat, Instant::now());
        let mut k8s = self.k8s.lock().unwrap();
        k8s.heartbeats.remove(&i);
        k8s.orphans.retain(|(_, b)| b.name != beat.name);
        k8s.orphans.push((item, beat));
    }

    /// Deletes the orphaned Node `name`; whether there was one.
    pub(crate) fn k8s_delete_orphan(&self, name: &str) -> bool {
        let mut k8s = self.k8s.lock().unwrap();
        let before = k8s.orphans.len();
        k8s.orphans.retain(|(_, b)| b.name != name);
        k8s.orphans.len() != before
    }

    fn heartbeat(&self, i: usize) -> Option<Heartbeat> {
        self.k8s.lock().unwrap().heartbeats.get(&i).cloned()
    }

    /// The Nodes of nodes that posted before but are not registered now
    /// (and were not deleted), by name.
    fn silent_nodes(&self, registered: &[Registered], now: Instant) -> Vec<Value> {
        let beats: Vec<(usize, Heartbeat)> = {
            let k8s = self.k8s.lock().unwrap();
            let mut b: Vec<_> = k8s
                .heartbeats
                .iter()
                .map(|(i, b)| (*i, b.clone()))
                .collect();
            b.sort_by(|x, y| x.1.name.cmp(&y.1.name));
            b
        };
        let mut out: Vec<Value> = beats
            .into_iter()
            .filter(|(i, b)| {
                *i < self.count()
                    && !registered.iter().any(|r| r.index == *i || r.name == b.name)
                    && !self.k8s_node_deleted(*i)
            })
            .map(|(i, b)| self.silent_node(i, &b, now))
            .collect();
        let orphans = self.k8s.lock().unwrap().orphans.clone();
        for (item, beat) in orphans {
            let named = |n: &Value| n["metadata"]["name"] == beat.name.as_str();
            if !registered.iter().any(|r| r.name == beat.name) && !out.iter().any(named) {
                out.push(self.aged(item, &beat, now));
            }
        }
        out
    }
}

pub(crate) async fn nodes(
    State(cluster): State<Arc<Cluster>>,
) -> Result<axum::Json<Value>, Infallible> {
    let now = Instant::now();
    let registered = cluster.registered(now);
    let silent = cluster.silent_nodes(&registered, now);
    let mut items: Vec<Value> = registered
        .into_iter()
        .map(|r| {
            if cluster.node(r.index).phase(now) == Phase::Down
                && let Some(beat) = cluster.heartbeat(r.index)
            {
                return cluster.silent_node(r.index, &beat, now);
            }
            // The kubelet's Ready condition (kubernetes pkg/kubelet/nodestatus
            // setters.go ReadyCondition): without a network plugin it names
            // the runtime's NetworkReady error.
            let condition = if r.ready {
                json!({"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting ready status"})
            } else if !r.cni {
                json!({"type": "Ready", "status": "False", "reason": "KubeletNotReady", "message": NO_CNI})
            } else {
                json!({"type": "Ready", "status": "False", "reason": "KubeletNotReady", "message": "kubelet is starting"})
            };
            let notes = annotations(&cluster.node(r.index).st.lock().unwrap().day2.life);
            let mut item = json!({
                "metadata": {"name": r.name, "annotations": notes},
                "spec": {"unschedulable": r.cordoned},
                "status": {"conditions": [condition]},
            });
            cluster.k8s_node_item(r.index, &mut item, now);
            item
        })
        .collect();
    items.extend(silent);
    // The API server lists from etcd's keys (`/registry/minions/<name>`,
    // apiserver pkg/storage/etcd3/store.go GetList): by name.
    items.sort_by(|a, b| {
        a["metadata"]["name"]
            .as_str()
            .cmp(&b["metadata"]["name"].as_str())
    });
    Ok(axum::Json(
        json!({"kind": "NodeList", "apiVersion": "v1", "items": items}),
    ))
}

#[derive(serde::Deserialize)]
pub(crate) struct Selector {
    #[serde(rename = "labelSelector")]
    label_selector: Option<String>,
}

fn list(kind: &str, items: Vec<Value>) -> axum::Json<Value> {
    axum::Json(json!({"kind": kind, "apiVersion": "v1", "items": items}))
}

/// The pods now: kube-proxy (a DaemonSet's, one per registered node), the
/// API server's mirror pod on each control plane (a static pod), and two
/// CoreDNS pods (a ReplicaSet's) on Ready nodes, each Ready as the facts
/// say. A CoreDNS pod stays on a cordoned node until it is evicted (or
/// the node reboots): cordoning alone moves nothing.
pub(crate) fn pods_now(cluster: &Cluster, app: Option<&str>) -> Vec<Value> {
    let facts = cluster.facts.lock().unwrap().clone();
    let now = Instant::now();
    let nodes = cluster.registered(now);
    let pod = |name: String, app: &str, node: &str, ready: bool, meta: Value| {
        let mut metadata =
            json!({"name": name, "namespace": "kube-system", "labels": {"k8s-app": app}});
        if let (Some(m), Some(extra)) = (metadata.as_object_mut(), meta.as_object()) {
            m.extend(extra.clone());
        }
        json!({
            "metadata": metadata,
            "spec": {"nodeName": node},
            "status": {"phase": "Running", "conditions": [
                {"type": "Ready", "status": if ready { "True" } else { "False" }}
            ]},
        })
    };
    let owned = |kind: &str, name: &str| json!({"ownerReferences": [{"kind": kind, "name": name}]});
    let mut items = Vec::new();
    if app.is_none_or(|a| a == "kube-proxy") && !cluster.addon_disabled("proxy") {
        for (k, n) in nodes.iter().enumerate() {
            items.push(pod(
                format!("kube-proxy-{k:05}"),
                "kube-proxy",
                &n.name,
                facts.kube_proxy_ready,
                owned("DaemonSet", "kube-proxy"),
            ));
        }
    }
    if app.is_none_or(|a| a == "kube-dns") && !cluster.addon_disabled("coreDNS") {
        let ready: Vec<&Registered> = nodes.iter().filter(|n| n.ready && !n.drained).collect();
        for k in 0..2 {
            if let Some(n) = ready.get(k % ready.len().max(1)) {
                items.push(pod(
                    format!("coredns-{k}"),
                    "kube-dns",
                    &n.name,
                    facts.coredns_ready,
                    owned("ReplicaSet", "coredns-sim"),
                ));
            }
        }
    }
    cluster.k8s_workload_pods(&mut items, now);
    let named: Vec<(usize, String)> = nodes.iter().map(|n| (n.index, n.name.clone())).collect();
    items.extend(cluster.k8s_static_pods(&named, app, now));
    items
}

pub(crate) async fn pods(
    State(cluster): State<Arc<Cluster>>,
    Query(sel): Query<Selector>,
) -> axum::Json<Value> {
    // The pods of one app are made alone (a static pod's own list); any
    // selector then filters by labels as the API server does.
    let requirements = selector::parse(sel.label_selector.as_deref().unwrap_or_default());
    let Ok(requirements) = requirements else {
        return list("PodList", Vec::new());
    };
    let app = requirements.iter().find_map(|r| match r {
        selector::Requirement::In(k, values) if k == "k8s-app" && values.len() == 1 => {
            Some(values[0].as_str())
        }
        _ => None,
    });
    let items = pods_now(&cluster, app)
        .into_iter()
        .filter(|p| selector::matches(&requirements, p))
        .collect();
    list("PodList", items)
}

#[derive(serde::Deserialize)]
pub(crate) struct FieldSelector {
    #[serde(rename = "fieldSelector")]
    field_selector: Option<String>,
}

/// `GET /api/v1/pods` (all namespaces), `fieldSelector=spec.nodeName=X`
/// as kubectl's drain asks for a node's pods.
pub(crate) async fn all_pods(
    State(cluster): State<Arc<Cluster>>,
    Query(sel): Query<FieldSelector>,
) -> axum::Json<Value> {
    let on = sel
        .field_selector
        .as_deref()
        .and_then(|s| s.strip_prefix("spec.nodeName="));
    let items = pods_now(&cluster, None)
        .into_iter()
        .filter(|p| on.is_none_or(|n| p["spec"]["nodeName"] == n))
        .collect();
    list("PodList", items)
}

/// The index of the node Kubernetes calls `name`.
fn node_named(cluster: &Cluster, name: &str) -> Option<usize> {
    (0..cluster.count()).find(|&i| cluster.node(i).display_name() == name)
}

/// A node item's `metadata.annotations`: what clients set, and Talos's
/// `talos.dev/cordoned` while Talos itself holds the cordon
/// (`controllers/k8s/node_apply.go` `ApplyCordoned` sets it with the cordon
/// and removes it with the uncordon).
fn annotations(life: &super::state::Life) -> Value {
    let mut out: serde_json::Map<String, Value> = life
        .annotations
        .iter()
        .map(|(k, v)| (k.clone(), Value::String(v.clone())))
        .collect();
    if life.cordoned && !life.cordoned_by_client {
        out.insert("talos.dev/cordoned".into(), "true".into());
    }
    Value::Object(out)
}

/// `PATCH /api/v1/nodes/{name}` (strategic merge patch): `spec.unschedulable`
/// (kubectl's cordon and uncordon) and `metadata.annotations` (a string
/// sets, null removes; any other value is refused as the apiserver's
/// decoder refuses it). An uncordon lets pods be scheduled back.
pub(crate) async fn patch_node(
    State(cluster): State<Arc<Cluster>>,
    axum::extract::Path(name): axum::extract::Path<String>,
    axum::Json(patch): axum::Json<Value>,
) -> ControlReply {
    let Some(i) = node_named(&cluster, &name) else {
        return (
            axum::http::StatusCode::NOT_FOUND,
            axum::Json(
                json!({"kind": "Status", "code": 404, "message": format!("nodes \"{name}\" not found")}),
            ),
        );
    };
    let on = patch["spec"]["unschedulable"].as_bool();
    let notes = patch["metadata"]["annotations"].as_object();
    let other = patch.as_object().is_some_and(|p| {
        p.keys().any(|k| k != "spec" && k != "metadata")
            || p.get("spec")
                .and_then(Value::as_object)
                .is_some_and(|s| s.keys().any(|k| k != "unschedulable"))
            || p.get("metadata")
                .and_then(Value::as_object)
                .is_some_and(|m| m.keys().any(|k| k != "annotations"))
    });
    if other || (on.is_none() && notes.is_none()) {
        return (
            axum::http::StatusCode::UNPROCESSABLE_ENTITY,
            axum::Json(
                json!({"kind": "Status", "code": 422, "message": "only spec.unschedulable and metadata.annotations are patched here"}),
            ),
        );
    }
    if let Some((k, _)) = notes
        .into_iter()
        .flatten()
        .find(|(_, v)| !v.is_string() && !v.is_null())
    {
        // apimachinery's JSON decoder: annotations are map[string]string.
        return (
            axum::http::StatusCode::BAD_REQUEST,
            axum::Json(
                json!({"kind": "Status", "code": 400, "message": format!("json: cannot unmarshal into Go struct field ObjectMeta.metadata.annotations of type string ({k})")}),
            ),
        );
    }
    let node = cluster.node(i);
    let life = &mut node.st.lock().unwrap().day2.life;
    for (k, v) in notes.into_iter().flatten() {
        match v.as_str() {
            Some(v) => life.annotations.insert(k.clone(), v.to_owned()),
            None => life.annotations.remove(k),
        };
    }
    if let Some(on) = on {
        life.cordoned = on;
        life.cordoned_by_client = on;
        if !on {
            life.pods_gone = false;
        }
    }
    (
        axum::http::StatusCode::OK,
        axum::Json(
            json!({"metadata": {"name": name, "annotations": annotations(life)},
            "spec": {"unschedulable": life.cordoned}}),
        ),
    )
}

/// `POST /api/v1/namespaces/{ns}/pods/{name}/eviction`: the pod leaves its
/// node (its controller makes a new one elsewhere, not on a cordoned node).
pub(crate) async fn evict(
    State(cluster): State<Arc<Cluster>>,
    axum::extract::Path((ns, name)): axum::extract::Path<(String, String)>,
) -> ControlReply {
    let found = pods_now(&cluster, None).into_iter().find(|p| {
        p["metadata"]["namespace"] == ns.as_str() && p["metadata"]["name"] == name.as_str()
    });
    let Some(i) = found.and_then(|p| node_named(&cluster, p["spec"]["nodeName"].as_str()?)) else {
        return (
            axum::http::StatusCode::NOT_FOUND,
            axum::Json(
                json!({"kind": "Status", "code": 404, "message": format!("pods \"{name}\" not found")}),
            ),
        );
    };
    let node = cluster.node(i);
    let day2 = &mut node.st.lock().unwrap().day2;
    if day2.disruption_budget {
        // pkg/registry/core/pod/storage/eviction.go: a budget whose
        // disruptionsAllowed is 0 refuses the eviction with
        // createTooManyRequestsError (no Retry-After for 0 seconds).
        return (
            axum::http::StatusCode::TOO_MANY_REQUESTS,
            axum::Json(json!({
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": "Cannot evict pod as it would violate the pod's disruption budget.",
                "reason": "TooManyRequests",
                "details": {"causes": [{
                    "reason": "DisruptionBudget",
                    "message": format!("The disruption budget {name}-pdb needs 1 healthy pods and has 1 currently"),
                }]},
                "code": 429,
            })),
        );
    }
    let life = &mut day2.life;
    life.evictions += 1;
    if life.cordoned {
        life.pods_gone = true;
    }
    (
        axum::http::StatusCode::CREATED,
        axum::Json(json!({"kind": "Status", "status": "Success", "code": 201})),
    )
}

/// A list of kube-system's stored `resource` (`apps/v1`) as the API server
/// answers it (`objects.rs`): every stored object the selector selects,
/// with its status, and the list's resourceVersion; a 400 for a selector
/// that does not parse.
fn workloads(
    cluster: &Cluster,
    resource: &str,
    kind: &str,
    sel: &Selector,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let now = Instant::now();
    cluster.k8s_bootstrap_manifests(now);
    let requirements = match selector::parse(sel.label_selector.as_deref().unwrap_or_default()) {
        Ok(r) => r,
        Err(why) => {
            return objects::status(
                axum::http::StatusCode::BAD_REQUEST,
                "BadRequest",
                why,
                json!({}),
            );
        }
    };
    let (items, revision) = cluster.k8s_kube_system(resource, now);
    let items: Vec<Value> = items
        .into_iter()
        .filter(|o| selector::matches(&requirements, o))
        .collect();
    axum::Json(json!({"kind": kind, "apiVersion": "apps/v1",
        "metadata": {"resourceVersion": revision.to_string()}, "items": items}))
    .into_response()
}

pub(crate) async fn daemonsets(
    State(cluster): State<Arc<Cluster>>,
    Query(sel): Query<Selector>,
) -> axum::response::Response {
    workloads(&cluster, "daemonsets", "DaemonSetList", &sel)
}

pub(crate) async fn deployments(
    State(cluster): State<Arc<Cluster>>,
    Query(sel): Query<Selector>,
) -> axum::response::Response {
    workloads(&cluster, "deployments", "DeploymentList", &sel)
}
