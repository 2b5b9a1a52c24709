//! The Kubernetes API objects the simulated API server stores — the
//! bootstrap manifests' objects (`manifests.rs` creates them) and
//! objects of API versions a later release removes (`deprecated.rs`) —
//! read by GET and changed by server-side apply (`ssa.rs`), as
//! kubernetes/kubernetes v1.33 `staging/src/k8s.io/apiserver/pkg/endpoints/
//! handlers/{get,patch}.go` answer: `ValidatePatchOptions`
//! (`apimachinery/pkg/apis/meta/v1/validation/validation.go`) requires a
//! `fieldManager` for an apply (422) and forbids `force` on other patches;
//! an apply creates a missing object (201); `dryRun=All` stores nothing.
//! PUT, POST and DELETE are `writes.rs`'s; a list's `labelSelector` is read
//! as `selector.rs` says. Simplified: only apply patches (others 415), no
//! watch; pods and nodes are served as lists only (`health.rs`).
//!
//! # Interface (the rest in `pods.rs`)
//! - Objects: `GET` and `PATCH` (apply only) on `/api/v1/namespaces/{ns}/{resource}/{name}`,
//!   `/api/v1/{resource}/{name}`, `/apis/{group}/{version}/namespaces/{ns}/{resource}/{name}`,
//!   `/apis/{group}/{version}/{resource}/{name}`; `GET` lists on `/api/v1/namespaces/{ns}/
//!   {resource}`, `/apis/{group}/{version}/namespaces/{ns}/{resource}`, `/apis/{group}/
//!   {version}/{resource}` (an object list; `labelSelector=k=v` filters). Resources:
//!   configmaps, services, serviceaccounts, secrets, namespaces (v1); daemonsets,
//!   deployments (apps/v1); clusterroles, clusterrolebindings, roles, rolebindings
//!   (rbac.authorization.k8s.io/v1); customresourcedefinitions (apiextensions.k8s.io/v1);
//!   and the removed-API resources the switch below stores. Errors are `Status` objects.
//!   A DaemonSet/Deployment has `metadata.generation` (up when its spec changes) and a
//!   `status` (`observedGeneration`, `updatedNumberScheduled`/`updatedReplicas` once the
//!   rollout of a changed template is over: `--rollout-delay`). kube-system's DaemonSet
//!   and Deployment lists (`health.rs`) show every stored one, and their pods
//!   (`…/pods?labelSelector=k8s-app%3Dkube-proxy`, `k8s-app%3Dkube-dns`) carry
//!   `spec.containers` of the template rolled out (the one before during a rollout).
//! - Apply: `PATCH …?fieldManager=NAME[&force=true][&dryRun=All]` with
//!   `application/apply-patch+yaml` (YAML or JSON body with apiVersion, kind,
//!   metadata.name); other patch types → 415. A conflict → 409 `Apply failed with 1
//!   conflict: conflict with "talos" using apps/v1: .spec.template.spec.containers[name=
//!   "kube-proxy"].image`.
//!   Talos created the bootstrap objects as manager `talos` (operation Update), so an
//!   apply changing their images conflicts without `force`.
//! - `GET /version`: `{"major","minor","gitVersion": "v1.32.1","platform"}` of the oldest
//!   kube-apiserver image among the control planes.
//! - `GET /metrics`: Prometheus text with `apiserver_requested_deprecated_apis{group=…,
//!   removed_release=…,resource=…,subresource=…,version=…} 1` per requested deprecated API
//!   this API server served since its kube-apiserver (re)started (the VIP: the first
//!   control plane whose kube-apiserver is up), among other lines
//!   (`apiserver_storage_objects{resource=…}`).
//! - `POST /_sim/k8s-apis` `{"requested"?: [{"group","version","resource","subresource"?,
//!   "removed_release","nodes"?: [NAME…] (the API servers that served them; all by
//!   default)}], "stored"?: [{"group","version","resource","kind","namespace"?,
//!   "name","removed_release"}]}`: each list given replaces the last; stored objects are
//!   listed under their group/version/resource until every API server runs a version ≥
//!   `removed_release` (then 404). → 200 with both lists.
//! - `GET /_sim/stats` `k8s` adds `workloads` ({"kube-proxy"|"coredns"|"kube-flannel":
//!   image}), `applies` ([{manager, force, object: "apps/v1/daemonsets/kube-system/
//!   kube-proxy", code}]), `writes` ([{verb: "PUT"|"POST"|"DELETE", object, code}], dry
//!   runs left out), `requested_deprecated`, `removed_stored`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::selector;
use super::ssa::{self, Manager, fields_of, merge, value_at};
use super::versions::{self, Component};
use crate::node::state::{Cluster, ms};
use crate::node::state::{Key, Store, Stored};

/// A resource the API server serves: (apiVersion, plural, kind, namespaced).
pub(crate) type Kind = (&'static str, &'static str, &'static str, bool);

pub(crate) const KINDS: [Kind; 12] = [
    ("v1", "configmaps", "ConfigMap", true),
    ("v1", "services", "Service", true),
    ("v1", "serviceaccounts", "ServiceAccount", true),
    ("v1", "secrets", "Secret", true),
    ("v1", "namespaces", "Namespace", false),
    ("apps/v1", "daemonsets", "DaemonSet", true),
    ("apps/v1", "deployments", "Deployment", true),
    (
        "rbac.authorization.k8s.io/v1",
        "clusterroles",
        "ClusterRole",
        false,
    ),
    (
        "rbac.authorization.k8s.io/v1",
        "clusterrolebindings",
        "ClusterRoleBinding",
        false,
    ),
    ("rbac.authorization.k8s.io/v1", "roles", "Role", true),
    (
        "rbac.authorization.k8s.io/v1",
        "rolebindings",
        "RoleBinding",
        true,
    ),
    (
        "apiextensions.k8s.io/v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        false,
    ),
];

/// A Kubernetes `Status` error reply.
pub(crate) fn status(code: StatusCode, reason: &str, message: String, details: Value) -> Response {
    let body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "details": details, "code": code.as_u16()});
    (code, axum::Json(body)).into_response()
}

pub(crate) fn no_resource() -> Response {
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        "the server could not find the requested resource".into(),
        json!({}),
    )
}

/// The group of an apiVersion (`apps/v1` → `apps`, `v1` → ``).
pub(crate) fn group_of(api: &str) -> &str {
    api.rsplit_once('/').map_or("", |(g, _)| g)
}

/// `daemonsets.apps "kube-proxy" not found`.
pub(crate) fn not_found(api: &str, resource: &str, name: &str) -> Response {
    let group = group_of(api);
    let qualified = qualified(api, resource);
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        format!("{qualified} {name:?} not found"),
        json!({"name": name, "group": group, "kind": resource}),
    )
}

/// `daemonsets.apps`, `configmaps`: how the API server's errors name a
/// resource (`schema.GroupResource.String`).
pub(crate) fn qualified(api: &str, resource: &str) -> String {
    let group = group_of(api);
    if group.is_empty() {
        resource.to_owned()
    } else {
        format!("{resource}.{group}")
    }
}

/// What in `body` does not match the request's `key` and `kind` (a 400
/// for an apply and an update: `handlers/{patch,update}.go`, `rest.
/// EnsureObjectNamespaceMatchesRequestNamespace`).
pub(crate) fn mismatch(key: &Key, kind: &str, body: &Value) -> Option<String> {
    let (api, _, ns, name) = key;
    if body["apiVersion"].as_str() != Some(api) {
        return Some(format!(
            "the API version in the data ({}) does not match the expected API version ({api})",
            body["apiVersion"].as_str().unwrap_or_default()
        ));
    }
    if body["kind"].as_str() != Some(kind) {
        return Some(format!(
            "the kind in the data ({}) does not match the expected kind ({kind})",
            body["kind"].as_str().unwrap_or_default()
        ));
    }
    if body["metadata"]["name"].as_str() != Some(name) {
        return Some(format!(
            "the name of the object ({}) does not match the name on the URL ({name})",
            body["metadata"]["name"].as_str().unwrap_or_default()
        ));
    }
    match body["metadata"]["namespace"].as_str() {
        Some(n) if n != ns => Some(
            "the namespace of the provided object does not match the namespace sent on the request"
                .into(),
        ),
        _ => None,
    }
}

/// What an apply did, as the handler answers it.
pub(crate) enum Applied {
    Created,
    Updated,
    Conflict(Vec<(String, String)>),
    Invalid(String),
}

impl Store {
    pub(crate) fn kind_of(&self, api: &str, resource: &str) -> Option<(String, bool)> {
        KINDS
            .iter()
            .find(|(a, r, _, _)| *a == api && *r == resource)
            .map(|(_, _, k, n)| ((*k).to_owned(), *n))
            .or_else(|| {
                self.removed
                    .iter()
                    .find(|o| format!("{}/{}", o.group, o.version) == api && o.resource == resource)
                    .map(|o| (o.kind.clone(), o.namespace.is_some()))
            })
    }

    pub(crate) fn resource_of(kind: &str, api: &str) -> Option<&'static str> {
        KINDS
            .iter()
            .find(|(a, _, k, _)| *a == api && *k == kind)
            .map(|(_, r, _, _)| *r)
    }

    pub(crate) fn next_revision(&mut self) -> u64 {
        self.revision += 1;
        self.revision
    }

    /// Talos's `manifest_apply.go`: creates `object` as `manager`
    /// (operation Update) unless it exists.
    pub(crate) fn create_if_missing(&mut self, object: Value, manager: &str, now: Instant) {
        let api = object["apiVersion"].as_str().unwrap_or_default().to_owned();
        let Some(resource) = Self::resource_of(object["kind"].as_str().unwrap_or_default(), &api)
        else {
            return;
        };
        let key = (
            api.clone(),
            resource.to_owned(),
            object["metadata"]["namespace"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            object["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        );
        if self.objects.contains_key(&key) {
            return;
        }
        let mut fields = BTreeMap::new();
        fields_of(&object, "", &mut fields);
        let rv = self.next_revision();
        self.objects.insert(
            key,
            Stored {
                object,
                managers: vec![Manager {
                    manager: manager.into(),
                    operation: "Update",
                    api_version: api,
                    fields,
                }],
                generation: 1,
                resource_version: rv,
                template_at: now,
                previous_template: None,
                removed_release: None,
                created: rv,
            },
        );
    }

    /// Server-side apply of `body` to `key` by `manager`.
    pub(crate) fn apply(
        &mut self,
        key: &Key,
        kind: &str,
        body: Value,
        manager: &str,
        force: bool,
        now: Instant,
    ) -> Applied {
        let (api, _, ns, _) = key;
        if let Some(why) = mismatch(key, kind, &body) {
            return Applied::Invalid(why);
        }
        let mut wanted = BTreeMap::new();
        fields_of(&body, "", &mut wanted);
        let mine = Manager {
            manager: manager.into(),
            operation: "Apply",
            api_version: api.clone(),
            fields: wanted.clone(),
        };
        let rv = self.next_revision();
        let Some(stored) = self.objects.get_mut(key) else {
            let mut object = body;
            if !ns.is_empty() {
                object["metadata"]["namespace"] = json!(ns);
            }
            self.objects.insert(
                key.clone(),
                Stored {
                    object,
                    managers: vec![mine],
                    generation: 1,
                    resource_version: rv,
                    template_at: now,
                    previous_template: None,
                    removed_release: None,
                    created: rv,
                },
            );
            return Applied::Created;
        };
        let mut conflicts = Vec::new();
        for other in &stored.managers {
            if other.manager == manager && other.operation == "Apply" {
                continue;
            }
            for (path, value) in &wanted {
                if other.fields.contains_key(path)
                    && value_at(&stored.object, path).as_ref() != Some(value)
                {
                    conflicts.push((ssa::manager_name(other), path.clone()));
                }
            }
        }
        if !conflicts.is_empty() && !force {
            return Applied::Conflict(conflicts);
        }
        for other in &mut stored.managers {
            for (_, path) in &conflicts {
                other.fields.remove(path);
            }
        }
        let is_mine = |m: &Manager| m.manager == manager && m.operation == "Apply";
        let previous = stored
            .managers
            .iter()
            .find(|m| is_mine(m))
            .map(|m| m.fields.clone())
            .unwrap_or_default();
        let others: std::collections::BTreeSet<String> = stored
            .managers
            .iter()
            .filter(|m| !is_mine(m))
            .flat_map(|m| m.fields.keys().cloned())
            .collect();
        stored
            .managers
            .retain(|m| !(m.fields.is_empty() || m.manager == manager && m.operation == "Apply"));
        stored.managers.push(mine);
        let before = stored.object.clone();
        merge(&mut stored.object, &body);
        // What this manager applied before and applies no more, and nobody
        // else owns, leaves the object.
        let kept = |p: &str| wanted.contains_key(p) || others.contains(p);
        for path in previous.keys().filter(|p| !kept(p)) {
            ssa::remove_field(&mut stored.object, path, &kept);
        }
        if before["spec"] != stored.object["spec"] {
            stored.generation += 1;
        }
        if before["spec"]["template"] != stored.object["spec"]["template"] {
            stored.template_at = now;
            stored.previous_template = Some(before["spec"]["template"].clone());
        }
        if before != stored.object {
            stored.resource_version = rv;
        }
        Applied::Updated
    }

    /// The first container image of a stored workload.
    fn image(&self, api: &str, resource: &str, name: &str) -> Option<String> {
        let key = (
            api.into(),
            resource.into(),
            "kube-system".into(),
            name.into(),
        );
        let o = &self.objects.get(&key)?.object;
        o["spec"]["template"]["spec"]["containers"][0]["image"]
            .as_str()
            .map(str::to_owned)
    }

    /// Adds the store's part of the stats.
    pub(crate) fn stats_into(&self, out: &mut Value) {
        out["workloads"] = json!({
            "kube-proxy": self.image("apps/v1", "daemonsets", "kube-proxy"),
            "kube-flannel": self.image("apps/v1", "daemonsets", "kube-flannel"),
            "coredns": self.image("apps/v1", "deployments", "coredns"),
        });
        out["applies"] = json!(self.applies);
        out["writes"] = json!(self.writes);
        out["requested_deprecated"] = json!(self.requested);
        out["removed_stored"] = json!(self.removed);
    }
}

/// `metadata` as the API server shows it.
pub(crate) fn shown(stored: &Stored) -> Value {
    let mut o = stored.object.clone();
    // Only kinds whose strategy keeps a generation have one (ConfigMaps,
    // Services, RBAC objects… show none: `PrepareForCreate` of
    // `pkg/registry/apps/*/strategy.go` and the CRD strategy set it).
    let generation = matches!(
        o["kind"].as_str(),
        Some("DaemonSet" | "Deployment" | "StatefulSet" | "CustomResourceDefinition")
    );
    let md = &mut o["metadata"];
    if generation {
        md["generation"] = json!(stored.generation);
    }
    md["resourceVersion"] = json!(stored.resource_version.to_string());
    md["uid"] = json!(format!(
        "00000000-0000-4000-8000-{:012x}",
        stored.created ^ 0x5eed
    ));
    md["managedFields"] = Value::Array(
        stored
            .managers
            .iter()
            .map(|m| json!({"manager": m.manager, "operation": m.operation, "apiVersion": m.api_version, "fieldsType": "FieldsV1"}))
            .collect(),
    );
    o
}

impl Cluster {
    /// The oldest Kubernetes minor any control plane's API server runs.
    pub(crate) fn apiserver_minor(&self) -> Option<(u64, u64)> {
        self.apiserver_version().map(|(a, b, _)| (a, b))
    }

    /// The oldest Kubernetes version any control plane's API server runs
    /// (the old one until a restart is over).
    fn apiserver_version(&self) -> Option<versions::Version> {
        (0..self.count())
            .filter_map(|i| self.k8s_serving(i, Component::ApiServer, Instant::now()))
            .filter_map(|image| versions::version_of_image(&image).ok())
            .min()
    }

    /// A stored workload with its status as the controllers keep it.
    pub(crate) fn with_status(&self, key: &Key, stored: &Stored, now: Instant) -> Value {
        let mut o = shown(stored);
        let rolled = now >= stored.template_at + ms(self.args.k8s.rollout_delay);
        let observed = if rolled {
            stored.generation
        } else {
            stored.generation - 1
        };
        let facts = self.facts.lock().unwrap().clone();
        match (key.1.as_str(), key.3.as_str()) {
            ("daemonsets", name) => {
                let n = self.registered(now).len();
                let ready = if name == "kube-proxy" && !facts.kube_proxy_ready {
                    0
                } else {
                    n
                };
                o["status"] = json!({"currentNumberScheduled": n, "desiredNumberScheduled": n,
                    "numberReady": ready, "numberAvailable": ready, "numberMisscheduled": 0,
                    "observedGeneration": observed, "updatedNumberScheduled": if rolled { n } else { 0 }});
            }
            ("deployments", name) => {
                let n = o["spec"]["replicas"].as_u64().unwrap_or(1);
                let ready = if name == "coredns" && !facts.coredns_ready {
                    0
                } else {
                    n
                };
                o["status"] = json!({"replicas": n, "readyReplicas": ready, "availableReplicas": ready,
                    "observedGeneration": observed, "updatedReplicas": if rolled { n } else { 0 }});
            }
            _ => {}
        }
        o
    }

    /// Gives the kube-proxy and CoreDNS pods among `pods` (by `k8s-app`)
    /// the container their workload's pods run: the template's once
    /// rolled out, the one before meanwhile. talosctl's `DetectLowestVersion`
    /// (`pkg/cluster/kubernetes/detect.go`) reads the kube-proxy pods'.
    pub(crate) fn k8s_workload_pods(&self, pods: &mut [Value], now: Instant) {
        let k8s = self.k8s.lock().unwrap();
        let container = |resource: &str, name: &str| -> Option<Value> {
            let key = (
                "apps/v1".to_owned(),
                resource.to_owned(),
                "kube-system".to_owned(),
                name.to_owned(),
            );
            let s = k8s.objects.objects.get(&key)?;
            let rolled = now >= s.template_at + ms(self.args.k8s.rollout_delay);
            let template = match &s.previous_template {
                Some(before) if !rolled => before,
                _ => &s.object["spec"]["template"],
            };
            Some(template["spec"]["containers"].clone())
        };
        let proxy = container("daemonsets", "kube-proxy");
        let dns = container("deployments", "coredns");
        for pod in pods {
            let containers = match pod["metadata"]["labels"]["k8s-app"].as_str() {
                Some("kube-proxy") => &proxy,
                Some("kube-dns") => &dns,
                _ => continue,
            };
            if let Some(c) = containers {
                pod["spec"]["containers"] = c.clone();
            }
        }
    }

    /// kube-system's stored `resource` of `apps/v1`, with their status, and
    /// the store's revision.
    pub(crate) fn k8s_kube_system(&self, resource: &str, now: Instant) -> (Vec<Value>, u64) {
        let k8s = self.k8s.lock().unwrap();
        let items = k8s
            .objects
            .objects
            .iter()
            .filter(|(k, _)| k.0 == "apps/v1" && k.1 == resource && k.2 == "kube-system")
            .map(|(k, s)| self.with_status(k, s, now))
            .collect();
        (items, k8s.objects.revision)
    }
}

/// Where a request points: apiVersion, resource, namespace, name.
pub(crate) struct Target {
    pub(crate) api: String,
    pub(crate) resource: String,
    pub(crate) namespace: String,
    pub(crate) name: Option<String>,
}

#[derive(serde::Deserialize, Default)]
pub(crate) struct Params {
    #[serde(rename = "fieldManager")]
    pub(crate) field_manager: Option<String>,
    force: Option<String>,
    #[serde(rename = "labelSelector")]
    label_selector: Option<String>,
    #[serde(rename = "dryRun")]
    pub(crate) dry_run: Option<String>,
    #[serde(rename = "propagationPolicy")]
    pub(crate) propagation_policy: Option<String>,
}

fn get(cluster: &Cluster, t: Target, params: &Params) -> Response {
    let now = Instant::now();
    cluster.k8s_bootstrap_manifests(now);
    // Read before the store is locked (it locks the store itself).
    let running = cluster.apiserver_minor();
    let k8s = cluster.k8s.lock().unwrap();
    let Some((kind, namespaced)) = k8s.objects.kind_of(&t.api, &t.resource) else {
        return no_resource();
    };
    if namespaced == t.namespace.is_empty() && t.name.is_some() {
        return no_resource();
    }
    let selector = match selector::parse(params.label_selector.as_deref().unwrap_or_default()) {
        Ok(s) => s,
        Err(why) => return status(StatusCode::BAD_REQUEST, "BadRequest", why, json!({})),
    };
    // An API version the running release removed is not served.
    let visible = |s: &Stored| match (s.removed_release, running) {
        (Some(removed), Some(running)) => running < removed,
        _ => true,
    };
    match &t.name {
        Some(name) => {
            let key = (
                t.api.clone(),
                t.resource.clone(),
                t.namespace.clone(),
                name.clone(),
            );
            match k8s.objects.objects.get(&key).filter(|s| visible(s)) {
                Some(s) => axum::Json(cluster.with_status(&key, s, now)).into_response(),
                None if !k8s.objects.objects.get(&key).is_none_or(visible) => no_resource(),
                None => not_found(&t.api, &t.resource, name),
            }
        }
        None => {
            let mut served = true;
            let items: Vec<Value> = k8s
                .objects
                .objects
                .iter()
                .filter(|(k, _)| k.0 == t.api && k.1 == t.resource)
                .filter(|(k, _)| t.namespace.is_empty() || k.2 == t.namespace)
                .filter(|(_, s)| {
                    let ok = visible(s);
                    served &= ok;
                    ok
                })
                .map(|(k, s)| cluster.with_status(k, s, now))
                .filter(|o| selector::matches(&selector, o))
                .collect();
            if !served {
                return no_resource();
            }
            axum::Json(json!({"kind": format!("{kind}List"), "apiVersion": t.api,
                "metadata": {"resourceVersion": k8s.objects.revision.to_string()}, "items": items}))
            .into_response()
        }
    }
}

fn patch(
    cluster: &Cluster,
    t: Target,
    params: &Params,
    headers: &HeaderMap,
    body: &str,
) -> Response {
    let now = Instant::now();
    cluster.k8s_bootstrap_manifests(now);
    let content_type = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let apply = content_type.starts_with("application/apply-patch+yaml");
    let manager = params.field_manager.clone().unwrap_or_default();
    let invalid = |field: &str, why: &str| {
        status(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            format!("PatchOptions.meta.k8s.io \"\" is invalid: {field}: {why}"),
            json!({"group": "meta.k8s.io", "kind": "PatchOptions"}),
        )
    };
    if !apply && params.force.is_some() {
        return invalid(
            "force",
            "Forbidden: may not be specified for non-apply patch",
        );
    }
    if apply && manager.is_empty() {
        return invalid(
            "fieldManager",
            "Required value: is required for apply patch",
        );
    }
    if !apply {
        return status(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "UnsupportedMediaType",
            format!(
                "the simulated API server takes only application/apply-patch+yaml, not {content_type:?}"
            ),
            json!({}),
        );
    }
    let force = params.force.as_deref() == Some("true");
    let Some(name) = t.name.clone() else {
        return no_resource();
    };
    let parsed: Result<Value, _> = serde_yaml_ng::from_str(body);
    let Ok(body @ Value::Object(_)) = parsed else {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "error decoding YAML: the body is not a YAML or JSON mapping".into(),
            json!({}),
        );
    };
    let mut k8s = cluster.k8s.lock().unwrap();
    let Some((kind, namespaced)) = k8s.objects.kind_of(&t.api, &t.resource) else {
        return no_resource();
    };
    if namespaced == t.namespace.is_empty() {
        return no_resource();
    }
    let key = (t.api.clone(), t.resource.clone(), t.namespace.clone(), name);
    // `dryRun=All` answers what the apply would store and stores nothing
    // (how an SSA diff is taken).
    if params.dry_run.as_deref() == Some("All") {
        let mut scratch = Store::default();
        if let Some(s) = k8s.objects.objects.get(&key) {
            scratch.objects.insert(key.clone(), s.clone());
        }
        scratch.revision = k8s.objects.revision;
        let outcome = scratch.apply(&key, &kind, body, &manager, force, now);
        return answer(cluster, &scratch, &key, outcome, now);
    }
    let outcome = k8s.objects.apply(&key, &kind, body, &manager, force, now);
    let code = match &outcome {
        Applied::Created => 201,
        Applied::Updated => 200,
        Applied::Conflict(_) => 409,
        Applied::Invalid(_) => 400,
    };
    k8s.objects
        .applies
        .push(json!({"manager": manager, "force": force,
        "object": format!("{}/{}/{}/{}", key.0, key.1, key.2, key.3), "code": code}));
    answer(cluster, &k8s.objects, &key, outcome, now)
}

/// The reply to an apply.
fn answer(cluster: &Cluster, store: &Store, key: &Key, outcome: Applied, now: Instant) -> Response {
    let code = match &outcome {
        Applied::Created => StatusCode::CREATED,
        _ => StatusCode::OK,
    };
    let stored = store.objects.get(key);
    match outcome {
        Applied::Created | Applied::Updated => {
            let o = cluster.with_status(key, stored.expect("applied"), now);
            (code, axum::Json(o)).into_response()
        }
        Applied::Invalid(why) => status(StatusCode::BAD_REQUEST, "BadRequest", why, json!({})),
        Applied::Conflict(conflicts) => {
            let (message, causes) = ssa::conflict_report(&conflicts);
            status(
                StatusCode::CONFLICT,
                "Conflict",
                message,
                json!({"causes": causes}),
            )
        }
    }
}

/// The path parameters of the object routes: `group` and `version`
/// (absent: the core API `v1`), `ns` (absent: cluster-scoped), `resource`,
/// `name` (absent: a list).
pub(crate) type Where = Path<HashMap<String, String>>;

impl Target {
    pub(crate) fn from(mut p: HashMap<String, String>) -> Target {
        let api = match (p.remove("group"), p.remove("version")) {
            (Some(g), Some(v)) => format!("{g}/{v}"),
            _ => "v1".into(),
        };
        Target {
            api,
            resource: p.remove("resource").unwrap_or_default(),
            namespace: p.remove("ns").unwrap_or_default(),
            name: p.remove("name"),
        }
    }
}

/// `GET /version` (`staging/src/k8s.io/apimachinery/pkg/version/types.go`
/// `Info`): the oldest API server's (the simulator does not tell which one
/// answers).
async fn version(State(c): State<Arc<Cluster>>) -> Response {
    match c.apiserver_version() {
        Some((major, minor, patch)) => axum::Json(json!({
            "major": major.to_string(),
            "minor": minor.to_string(),
            "gitVersion": format!("v{major}.{minor}.{patch}"),
            "platform": "linux/amd64",
        }))
        .into_response(),
        None => no_resource(),
    }
}

async fn get_handler(
    State(c): State<Arc<Cluster>>,
    Path(at): Where,
    Query(p): Query<Params>,
) -> Response {
    get(&c, Target::from(at), &p)
}

async fn patch_handler(
    State(c): State<Arc<Cluster>>,
    Path(at): Where,
    Query(p): Query<Params>,
    headers: HeaderMap,
    body: String,
) -> Response {
    patch(&c, Target::from(at), &p, &headers, &body)
}

/// The object routes and `/version`, merged into the API server's router
/// (its static routes, such as the health lists and `/metrics`, win over these).
pub(crate) fn routes() -> axum::Router<Arc<Cluster>> {
    use axum::routing::get as on_get;
    let mut router = axum::Router::new().route("/version", on_get(version));
    for prefix in ["/api/v1", "/apis/{group}/{version}"] {
        for at in ["/namespaces/{ns}/{resource}", "/{resource}"] {
            router = router
                .route(&format!("{prefix}{at}"), on_get(get_handler))
                .route(
                    &format!("{prefix}{at}/{{name}}"),
                    on_get(get_handler).patch(patch_handler),
                );
        }
    }
    router
}

#[cfg(test)]
mod tests {
    use super::*;

    fn daemonset(image: &str) -> Value {
        json!({"apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": {"name": "kube-proxy", "namespace": "kube-system", "labels": {"k8s-app": "kube-proxy"}},
            "spec": {"template": {"spec": {"containers": [{"name": "kube-proxy", "image": image}]}}}})
    }

    fn key() -> Key {
        (
            "apps/v1".into(),
            "daemonsets".into(),
            "kube-system".into(),
            "kube-proxy".into(),
        )
    }

    #[test]
    fn an_apply_over_talos_fields_conflicts_unless_forced_and_keeps_what_others_added() {
        let now = Instant::now();
        let mut s = Store::default();
        s.create_if_missing(
            daemonset("registry.k8s.io/kube-proxy:v1.32.1"),
            "talos",
            now,
        );
        // Talos never updates what exists.
        s.create_if_missing(
            daemonset("registry.k8s.io/kube-proxy:v1.33.5"),
            "talos",
            now,
        );
        assert_eq!(
            s.image("apps/v1", "daemonsets", "kube-proxy").unwrap(),
            "registry.k8s.io/kube-proxy:v1.32.1"
        );
        // A user's label, by another manager.
        let mut user = daemonset("registry.k8s.io/kube-proxy:v1.32.1");
        user["metadata"]["labels"]["team"] = json!("net");
        user.as_object_mut().unwrap().remove("spec");
        assert!(matches!(
            s.apply(&key(), "DaemonSet", user, "kubectl", false, now),
            Applied::Updated
        ));

        let new = daemonset("registry.k8s.io/kube-proxy:v1.33.5");
        match s.apply(&key(), "DaemonSet", new.clone(), "imgbuild", false, now) {
            Applied::Conflict(c) => assert_eq!(
                c,
                [(
                    "\"talos\" using apps/v1".to_owned(),
                    ".spec.template.spec.containers[name=\"kube-proxy\"].image".to_owned()
                )]
            ),
            _ => panic!("no conflict"),
        }
        assert!(matches!(
            s.apply(&key(), "DaemonSet", new, "imgbuild", true, now),
            Applied::Updated
        ));
        let o = &s.objects[&key()].object;
        assert_eq!(
            o["spec"]["template"]["spec"]["containers"][0]["image"],
            "registry.k8s.io/kube-proxy:v1.33.5"
        );
        assert_eq!(
            o["metadata"]["labels"]["team"], "net",
            "nothing the user added is pruned"
        );
        assert_eq!(s.objects[&key()].generation, 2);
        // Now imgbuild owns the image: its next apply needs no force.
        let again = daemonset("registry.k8s.io/kube-proxy:v1.33.6");
        assert!(matches!(
            s.apply(&key(), "DaemonSet", again, "imgbuild", false, now),
            Applied::Updated
        ));
    }

    /// structured-merge-diff (Kubernetes 1.33 apiserver): a manager that
    /// stops applying a field gives it up and, when nobody else owns it,
    /// it leaves the object; list-maps merge by their keys (ports by
    /// containerPort+protocol), atomic lists are replaced whole.
    #[test]
    fn an_apply_removes_what_its_manager_stopped_applying_and_merges_lists_by_their_keys() {
        let now = Instant::now();
        let mut s = Store::default();
        let ds = |containers: Value, labels: Value| {
            json!({"apiVersion": "apps/v1", "kind": "DaemonSet",
                "metadata": {"name": "kube-proxy", "namespace": "kube-system", "labels": labels},
                "spec": {"template": {"spec": {"containers": containers}}}})
        };
        let first = ds(
            json!([
                {"name": "kube-proxy", "image": "p:1", "args": ["--a", "--b"],
                    "ports": [{"containerPort": 10249, "name": "metrics"}]},
                {"name": "sidecar", "image": "s:1"},
            ]),
            json!({"k8s-app": "kube-proxy", "old": "x"}),
        );
        assert!(matches!(
            s.apply(&key(), "DaemonSet", first, "imgbuild", false, now),
            Applied::Created
        ));
        // Another manager adds a port of its own and owns the sidecar's image.
        let other = ds(
            json!([
                {"name": "kube-proxy", "ports": [{"containerPort": 10256, "protocol": "TCP"}]},
                {"name": "sidecar", "image": "s:1"},
            ]),
            json!({}),
        );
        assert!(matches!(
            s.apply(&key(), "DaemonSet", other, "kubectl", false, now),
            Applied::Updated
        ));
        let o = &s.objects[&key()].object;
        let ports = &o["spec"]["template"]["spec"]["containers"][0]["ports"];
        assert_eq!(ports.as_array().unwrap().len(), 2, "merged by key: {o}");
        // imgbuild drops a label, an arg, the metrics port and the sidecar.
        let second = ds(
            json!([{"name": "kube-proxy", "image": "p:2", "args": ["--a"]}]),
            json!({"k8s-app": "kube-proxy"}),
        );
        assert!(matches!(
            s.apply(&key(), "DaemonSet", second, "imgbuild", false, now),
            Applied::Updated
        ));
        let o = &s.objects[&key()].object;
        assert_eq!(
            o["metadata"]["labels"],
            json!({"k8s-app": "kube-proxy"}),
            "{o}"
        );
        let containers = &o["spec"]["template"]["spec"]["containers"];
        assert_eq!(containers[0]["args"], json!(["--a"]), "atomic: replaced");
        assert_eq!(
            containers[0]["ports"],
            json!([{"containerPort": 10256, "protocol": "TCP"}]),
            "kubectl's port stays, imgbuild's goes: {o}"
        );
        assert_eq!(
            containers[1],
            json!({"name": "sidecar", "image": "s:1"}),
            "still kubectl's: {o}"
        );
        // Once kubectl gives the sidecar up too, it is gone.
        let mine = ds(
            json!([{"name": "kube-proxy", "ports": [{"containerPort": 10256, "protocol": "TCP"}]}]),
            json!({}),
        );
        assert!(matches!(
            s.apply(&key(), "DaemonSet", mine, "kubectl", false, now),
            Applied::Updated
        ));
        let containers = &s.objects[&key()].object["spec"]["template"]["spec"]["containers"];
        assert_eq!(containers.as_array().unwrap().len(), 1, "{containers}");
        assert_eq!(containers[0]["image"], "p:2");
    }

    #[test]
    fn an_apply_names_what_does_not_match_the_url() {
        let now = Instant::now();
        let mut s = Store::default();
        let mut wrong = daemonset("x:v1");
        wrong["metadata"]["name"] = json!("other");
        let Applied::Invalid(why) = s.apply(&key(), "DaemonSet", wrong, "m", false, now) else {
            panic!("accepted");
        };
        assert_eq!(
            why,
            "the name of the object (other) does not match the name on the URL (kube-proxy)"
        );
        assert!(matches!(
            s.apply(&key(), "DaemonSet", daemonset("x:v1"), "m", false, now),
            Applied::Created
        ));
    }
}
