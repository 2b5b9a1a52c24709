//! The simulated API server's PUT (replace), POST (create) and DELETE, as
//! kubernetes/kubernetes v1.33 answers them: `staging/src/k8s.io/apiserver/
//! pkg/endpoints/handlers/{update,create,delete}.go` over the generic store
//! (`apiserver/pkg/registry/generic/registry/store.go`) and each resource's
//! strategy (`pkg/registry/*/*/strategy.go`, `apiextensions-apiserver/pkg/
//! registry/customresourcedefinition/strategy.go`).
//!
//! These are the calls talosctl's manifest sync makes: before Talos v1.13
//! (siderolabs/go-kubernetes v0.2.26–v0.2.28 `kubernetes/manifests/sync.go`)
//! a GET, a PUT `dryRun=All` carrying the live `resourceVersion` (the
//! diff), then a POST for a missing object or a PUT for a changed one; from
//! v1.13 (go-kubernetes v0.2.38+ `kubernetes/ssa`, talos `pkg/cluster/
//! kubernetes/talos_managed.go` `syncManifestsSSA`) the inventory ConfigMap
//! `kube-system/talos-bootstrap-manifests-inventory` is read or POSTed
//! (`internal/inventory/configmap/inventory.go`), the objects applied as
//! field manager `talos`, the inventory rewritten by a PUT without a
//! `resourceVersion`, and objects the inventory holds and the manifests no
//! more are DELETEd with `propagationPolicy: Background` (`apply.go`).
//!
//! - PUT `…/{name}[?dryRun=All][&fieldManager=M]`: the body replaces the
//!   object. A `metadata.resourceVersion` must be the stored one, else 409
//!   `Operation cannot be fulfilled on configmaps "x": the object has been
//!   modified; please apply your changes to the latest version and try
//!   again`; none is accepted where the strategy allows an unconditional
//!   update (all here but CustomResourceDefinitions: 422 `metadata.
//!   resourceVersion: Invalid value: 0x0: must be specified for an update`).
//!   A missing object is a 404 unless the strategy creates on update
//!   (services and the four RBAC kinds: 201). The manager (`fieldManager`,
//!   else the User-Agent's first `/` part) takes the fields it changed
//!   (operation Update); fields the body drops leave every manager.
//! - POST on the collection: 201; 409 `AlreadyExists` (`configmaps "x"
//!   already exists`); 404 `namespaces "x" not found` into a namespace that
//!   does not exist (the NamespaceLifecycle admission plugin); 422 without
//!   `metadata.name` or `generateName`; 405 on the all-namespaces path.
//! - DELETE `…/{name}[?propagationPolicy=P][&dryRun=All]` or a
//!   `DeleteOptions` body (`propagationPolicy`, `preconditions.
//!   resourceVersion`, `dryRun`; the query is read only without a body, as
//!   delete.go does): 200 with the object; 404 when missing; 422 for a
//!   policy other than Foreground, Background, Orphan; 409 when a
//!   precondition fails; 403 for `default`, `kube-system`, `kube-public`
//!   (`this namespace may not be deleted`).
//!
//! Simplified: no garbage collector or owner references — a Foreground or
//! Orphan delete answers the object with `deletionTimestamp` and its
//! finalizer and removes it at once, and deleting a namespace answers it
//! Terminating and removes it and its objects at once; no validation of the
//! objects' own fields; status subresources are not served (a PUT's
//! `status` is ignored, as the main resource's strategies do).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::objects::{
    Params, Target, Where, group_of, mismatch, no_resource, not_found, qualified, shown, status,
};
use super::ssa::{Manager, fields_of};
use crate::node::state::{Cluster, Key, Store, Stored};

/// The namespaces the API server keeps (`pkg/controlplane/controller/
/// systemnamespaces`: default, kube-system, kube-public, kube-node-lease).
pub(crate) const SYSTEM_NAMESPACES: [&str; 4] =
    ["default", "kube-system", "kube-public", "kube-node-lease"];

/// The namespaces NamespaceLifecycle refuses to delete
/// (`plugin/pkg/admission/namespace/lifecycle/admission.go`
/// `immortalNamespaces`).
const IMMORTAL: [&str; 3] = ["default", "kube-system", "kube-public"];

/// (AllowCreateOnUpdate, AllowUnconditionalUpdate) of a resource's
/// strategy: configmap, secret, serviceaccount, namespace, daemonset,
/// deployment (false, true); service and the RBAC kinds (true, true);
/// customresourcedefinition (false, false).
fn strategy(resource: &str) -> (bool, bool) {
    match resource {
        "services" | "clusterroles" | "clusterrolebindings" | "roles" | "rolebindings" => {
            (true, true)
        }
        "customresourcedefinitions" => (false, false),
        _ => (false, true),
    }
}

fn details(api: &str, resource: &str, name: &str) -> Value {
    json!({"name": name, "group": group_of(api), "kind": resource})
}

/// 409 `Conflict` (`errors.NewConflict`).
fn conflict(api: &str, resource: &str, name: &str, why: &str) -> Response {
    status(
        StatusCode::CONFLICT,
        "Conflict",
        format!(
            "Operation cannot be fulfilled on {} {name:?}: {why}",
            qualified(api, resource)
        ),
        details(api, resource, name),
    )
}

/// 422 `Invalid` of `what` (`errors.NewInvalid`) with one field error.
fn invalid(what: &str, name: &str, field: &str, why: &str, details: Value) -> Response {
    let mut details = details;
    details["causes"] = json!([{"reason": "FieldValueInvalid", "message": why, "field": field}]);
    status(
        StatusCode::UNPROCESSABLE_ENTITY,
        "Invalid",
        format!("{what} {name:?} is invalid: {field}: {why}"),
        details,
    )
}

fn bad_request(why: String) -> Response {
    status(StatusCode::BAD_REQUEST, "BadRequest", why, json!({}))
}

/// `dryRun` may only be `All` (`validation.ValidateDryRun`).
fn check_dry_run(options: &str, dry_run: Option<&str>) -> Result<bool, Box<Response>> {
    match dry_run {
        None | Some("") => Ok(false),
        Some("All") => Ok(true),
        Some(other) => Err(Box::new(invalid(
            &format!("{options}.meta.k8s.io"),
            "",
            "dryRun",
            &format!("Unsupported value: []string{{{other:?}}}: supported values: \"All\""),
            json!({"group": "meta.k8s.io", "kind": options}),
        ))),
    }
}

/// The manager of a write without `fieldManager`: the User-Agent up to its
/// first `/` (`fieldmanager.prefixFromUserAgent`).
fn manager_of(params: &Params, headers: &HeaderMap) -> String {
    params.field_manager.clone().unwrap_or_else(|| {
        headers
            .get(axum::http::header::USER_AGENT)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .split('/')
            .next()
            .unwrap_or_default()
            .to_owned()
    })
}

fn parse_body(body: &str) -> Result<Value, Box<Response>> {
    match serde_yaml_ng::from_str::<Value>(body) {
        Ok(v @ Value::Object(_)) => Ok(v),
        _ => Err(Box::new(bad_request(
            "error decoding YAML: the body is not a YAML or JSON mapping".into(),
        ))),
    }
}

/// The body as stored: what the server sets itself removed.
fn cleaned(mut body: Value, namespace: &str) -> Value {
    if let Some(md) = body["metadata"].as_object_mut() {
        for k in [
            "resourceVersion",
            "uid",
            "generation",
            "managedFields",
            "creationTimestamp",
            "deletionTimestamp",
            "selfLink",
        ] {
            md.remove(k);
        }
    }
    if let Some(o) = body.as_object_mut() {
        o.remove("status");
    }
    if !namespace.is_empty() {
        body["metadata"]["namespace"] = json!(namespace);
    }
    body
}

/// Field ownership after `manager` (operation Update) replaced `before`
/// with `after` (`fieldmanager/internal/managedfieldsupdater.go`,
/// structured-merge-diff `Updater.Update`): it owns what it changed, the
/// others keep what it did not change, and what is gone leaves everyone.
fn updated_managers(
    managers: &[Manager],
    manager: &str,
    api: &str,
    before: &Value,
    after: &Value,
) -> Vec<Manager> {
    let (mut old, mut new) = (BTreeMap::new(), BTreeMap::new());
    fields_of(before, "", &mut old);
    fields_of(after, "", &mut new);
    let changed: BTreeMap<String, Value> = new
        .iter()
        .filter(|(p, v)| old.get(*p) != Some(v))
        .map(|(p, v)| (p.clone(), v.clone()))
        .collect();
    let gone: BTreeSet<&String> = old.keys().filter(|p| !new.contains_key(*p)).collect();
    let mut out: Vec<Manager> = managers
        .iter()
        .cloned()
        .map(|mut m| {
            m.fields
                .retain(|p, _| !gone.contains(p) && !changed.contains_key(p));
            m
        })
        .collect();
    let mine =
        |m: &Manager| m.manager == manager && m.operation == "Update" && m.api_version == api;
    match out.iter_mut().find(|m| mine(m)) {
        Some(m) => m.fields.extend(changed),
        None if !changed.is_empty() => out.push(Manager {
            manager: manager.into(),
            operation: "Update",
            api_version: api.into(),
            fields: changed,
        }),
        None => {}
    }
    out.retain(|m| !m.fields.is_empty());
    out
}

/// A new object as the store keeps it.
fn created(object: Value, manager: &str, api: &str, rv: u64, now: Instant) -> Stored {
    let mut fields = BTreeMap::new();
    fields_of(&object, "", &mut fields);
    Stored {
        object,
        managers: vec![Manager {
            manager: manager.into(),
            operation: "Update",
            api_version: api.into(),
            fields,
        }],
        generation: 1,
        resource_version: rv,
        template_at: now,
        previous_template: None,
        removed_release: None,
        created: rv,
    }
}

impl Store {
    /// Replaces the stored object at `key` with `object` (already checked)
    /// as `manager`.
    pub(crate) fn replace(&mut self, key: &Key, object: Value, manager: &str, now: Instant) {
        if self.objects[key].object == object {
            return;
        }
        let rv = self.next_revision();
        let stored = self.objects.get_mut(key).expect("checked");
        let managers = updated_managers(&stored.managers, manager, &key.0, &stored.object, &object);
        let before = std::mem::replace(&mut stored.object, object);
        stored.managers = managers;
        stored.resource_version = rv;
        if before["spec"] != stored.object["spec"] {
            stored.generation += 1;
        }
        if before["spec"]["template"] != stored.object["spec"]["template"] {
            stored.template_at = now;
            stored.previous_template = Some(before["spec"]["template"].clone());
        }
    }

    fn log_write(&mut self, verb: &str, key: &Key, code: u16) {
        self.writes.push(json!({"verb": verb,
            "object": format!("{}/{}/{}/{}", key.0, key.1, key.2, key.3), "code": code}));
    }

    fn namespace_exists(&self, ns: &str) -> bool {
        self.objects
            .contains_key(&("v1".into(), "namespaces".into(), String::new(), ns.into()))
    }
}

/// What an object that is an API version the running release removed
/// answers: the resource is not served.
fn served(cluster: &Cluster, stored: Option<&Stored>) -> bool {
    let running = cluster.apiserver_minor();
    match (stored.and_then(|s| s.removed_release), running) {
        (Some(removed), Some(running)) => running < removed,
        _ => true,
    }
}

fn put(cluster: &Cluster, t: Target, params: &Params, headers: &HeaderMap, body: &str) -> Response {
    let now = Instant::now();
    cluster.k8s_bootstrap_manifests(now);
    let Some(name) = t.name.clone() else {
        return no_resource();
    };
    let dry_run = match check_dry_run("UpdateOptions", params.dry_run.as_deref()) {
        Ok(d) => d,
        Err(r) => return *r,
    };
    let body = match parse_body(body) {
        Ok(b) => b,
        Err(r) => return *r,
    };
    let manager = manager_of(params, headers);
    let running_ok = {
        let k8s = cluster.k8s.lock().unwrap();
        let key = (
            t.api.clone(),
            t.resource.clone(),
            t.namespace.clone(),
            name.clone(),
        );
        let stored = k8s.objects.objects.get(&key).cloned();
        drop(k8s);
        served(cluster, stored.as_ref())
    };
    if !running_ok {
        return no_resource();
    }
    let mut k8s = cluster.k8s.lock().unwrap();
    let store = &mut k8s.objects;
    let Some((kind, namespaced)) = store.kind_of(&t.api, &t.resource) else {
        return no_resource();
    };
    if namespaced == t.namespace.is_empty() {
        return no_resource();
    }
    let key = (
        t.api.clone(),
        t.resource.clone(),
        t.namespace.clone(),
        name.clone(),
    );
    if let Some(why) = mismatch(&key, &kind, &body) {
        return bad_request(why);
    }
    let (create_on_update, unconditional) = strategy(&t.resource);
    let rv = body["metadata"]["resourceVersion"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let object = cleaned(body, &t.namespace);
    let Some(stored) = store.objects.get(&key) else {
        if !create_on_update {
            return not_found(&t.api, &t.resource, &name);
        }
        let revision = store.revision + 1;
        let new = created(object, &manager, &t.api, revision, now);
        if dry_run {
            return (StatusCode::CREATED, axum::Json(shown(&new))).into_response();
        }
        store.next_revision();
        store.objects.insert(key.clone(), new);
        store.log_write("PUT", &key, 201);
        let o = cluster.with_status(&key, &k8s.objects.objects[&key], now);
        return (StatusCode::CREATED, axum::Json(o)).into_response();
    };
    if rv.is_empty() && !unconditional {
        return invalid(
            &qualified(&t.api, &t.resource),
            &name,
            "metadata.resourceVersion",
            "Invalid value: 0x0: must be specified for an update",
            details(&t.api, &t.resource, &name),
        );
    }
    if !rv.is_empty() && rv != stored.resource_version.to_string() {
        let code = 409;
        if !dry_run {
            store.log_write("PUT", &key, code);
        }
        return conflict(
            &t.api,
            &t.resource,
            &name,
            "the object has been modified; please apply your changes to the latest version and try again",
        );
    }
    if dry_run {
        let mut scratch = Store::default();
        scratch.objects.insert(key.clone(), stored.clone());
        scratch.revision = store.revision;
        scratch.replace(&key, object, &manager, now);
        let o = cluster.with_status(&key, &scratch.objects[&key], now);
        return axum::Json(o).into_response();
    }
    store.replace(&key, object, &manager, now);
    store.log_write("PUT", &key, 200);
    let o = cluster.with_status(&key, &k8s.objects.objects[&key], now);
    axum::Json(o).into_response()
}

fn post(
    cluster: &Cluster,
    t: Target,
    params: &Params,
    headers: &HeaderMap,
    body: &str,
) -> Response {
    let now = Instant::now();
    cluster.k8s_bootstrap_manifests(now);
    let dry_run = match check_dry_run("CreateOptions", params.dry_run.as_deref()) {
        Ok(d) => d,
        Err(r) => return *r,
    };
    let mut body = match parse_body(body) {
        Ok(b) => b,
        Err(r) => return *r,
    };
    let manager = manager_of(params, headers);
    let mut k8s = cluster.k8s.lock().unwrap();
    let store = &mut k8s.objects;
    let Some((kind, namespaced)) = store.kind_of(&t.api, &t.resource) else {
        return no_resource();
    };
    if namespaced && t.namespace.is_empty() {
        return status(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource".into(),
            json!({}),
        );
    }
    if !namespaced && !t.namespace.is_empty() {
        return no_resource();
    }
    let name = match (
        body["metadata"]["name"].as_str().filter(|n| !n.is_empty()),
        body["metadata"]["generateName"]
            .as_str()
            .filter(|n| !n.is_empty()),
    ) {
        (Some(n), _) => n.to_owned(),
        // names.SimpleNameGenerator: the prefix and five characters.
        (None, Some(prefix)) => format!("{prefix}{:05x}", (store.revision + 1) & 0xfffff),
        (None, None) => {
            return invalid(
                &kind,
                "",
                "metadata.name",
                "Required value: name or generateName is required",
                json!({"kind": kind}),
            );
        }
    };
    body["metadata"]["name"] = json!(name);
    let key = (
        t.api.clone(),
        t.resource.clone(),
        t.namespace.clone(),
        name.clone(),
    );
    if let Some(why) = mismatch(&key, &kind, &body) {
        return bad_request(why);
    }
    if namespaced && !store.namespace_exists(&t.namespace) {
        return not_found("v1", "namespaces", &t.namespace);
    }
    if store.objects.contains_key(&key) {
        if !dry_run {
            store.log_write("POST", &key, 409);
        }
        return status(
            StatusCode::CONFLICT,
            "AlreadyExists",
            format!("{} {name:?} already exists", qualified(&t.api, &t.resource)),
            details(&t.api, &t.resource, &name),
        );
    }
    let object = cleaned(body, &t.namespace);
    let new = created(object, &manager, &t.api, store.revision + 1, now);
    if dry_run {
        return (StatusCode::CREATED, axum::Json(shown(&new))).into_response();
    }
    store.next_revision();
    store.objects.insert(key.clone(), new);
    store.log_write("POST", &key, 201);
    let o = cluster.with_status(&key, &k8s.objects.objects[&key], now);
    (StatusCode::CREATED, axum::Json(o)).into_response()
}

/// `DeleteOptions` from the body, else from the query (delete.go).
struct DeleteOptions {
    policy: Option<String>,
    dry_run: Option<String>,
    resource_version: Option<String>,
}

fn delete_options(params: &Params, body: &str) -> Result<DeleteOptions, Box<Response>> {
    if body.trim().is_empty() {
        return Ok(DeleteOptions {
            policy: params.propagation_policy.clone(),
            dry_run: params.dry_run.clone(),
            resource_version: None,
        });
    }
    let v: Value = serde_json::from_str(body)
        .map_err(|e| Box::new(bad_request(format!("error decoding DeleteOptions: {e}"))))?;
    let dry_run = match &v["dryRun"] {
        Value::Array(a) => a.first().and_then(Value::as_str).map(str::to_owned),
        _ => None,
    };
    Ok(DeleteOptions {
        policy: v["propagationPolicy"].as_str().map(str::to_owned),
        dry_run,
        resource_version: v["preconditions"]["resourceVersion"]
            .as_str()
            .map(str::to_owned),
    })
}

fn delete(cluster: &Cluster, t: Target, params: &Params, body: &str) -> Response {
    let now = Instant::now();
    cluster.k8s_bootstrap_manifests(now);
    let Some(name) = t.name.clone() else {
        return no_resource();
    };
    let options = match delete_options(params, body) {
        Ok(o) => o,
        Err(r) => return *r,
    };
    let dry_run = match check_dry_run("DeleteOptions", options.dry_run.as_deref()) {
        Ok(d) => d,
        Err(r) => return *r,
    };
    // `ValidateDeleteOptions`.
    let finalizer = match options.policy.as_deref() {
        None | Some("Background") => None,
        Some("Foreground") => Some("foregroundDeletion"),
        Some("Orphan") => Some("orphan"),
        Some(other) => {
            return invalid(
                "DeleteOptions.meta.k8s.io",
                "",
                "propagationPolicy",
                &format!(
                    "Unsupported value: {other:?}: supported values: \"Foreground\", \"Background\", \"Orphan\", \"nil\""
                ),
                json!({"group": "meta.k8s.io", "kind": "DeleteOptions"}),
            );
        }
    };
    let key = (
        t.api.clone(),
        t.resource.clone(),
        t.namespace.clone(),
        name.clone(),
    );
    let stored = cluster
        .k8s
        .lock()
        .unwrap()
        .objects
        .objects
        .get(&key)
        .cloned();
    if !served(cluster, stored.as_ref()) {
        return no_resource();
    }
    let mut k8s = cluster.k8s.lock().unwrap();
    let store = &mut k8s.objects;
    let Some((_, namespaced)) = store.kind_of(&t.api, &t.resource) else {
        return no_resource();
    };
    if namespaced == t.namespace.is_empty() {
        return no_resource();
    }
    let Some(stored) = store.objects.get(&key) else {
        return not_found(&t.api, &t.resource, &name);
    };
    if t.resource == "namespaces" && IMMORTAL.contains(&name.as_str()) {
        return status(
            StatusCode::FORBIDDEN,
            "Forbidden",
            format!("namespaces {name:?} is forbidden: this namespace may not be deleted"),
            details(&t.api, &t.resource, &name),
        );
    }
    if let Some(rv) = &options.resource_version
        && *rv != stored.resource_version.to_string()
    {
        let why = format!(
            "Precondition failed: ResourceVersion in precondition: {rv}, ResourceVersion in object meta: {}",
            stored.resource_version
        );
        return conflict(&t.api, &t.resource, &name, &why);
    }
    let mut o = cluster.with_status(&key, stored, now);
    let deleting = finalizer.is_some() || t.resource == "namespaces";
    if deleting {
        o["metadata"]["deletionTimestamp"] = json!("1970-01-01T00:00:00Z");
        o["metadata"]["deletionGracePeriodSeconds"] = json!(0);
    }
    if let Some(f) = finalizer {
        o["metadata"]["finalizers"] = json!([f]);
    }
    if t.resource == "namespaces" {
        o["status"] = json!({"phase": "Terminating"});
    }
    if dry_run {
        return axum::Json(o).into_response();
    }
    store.objects.remove(&key);
    if t.resource == "namespaces" {
        store.objects.retain(|k, _| k.2 != name);
    }
    store.next_revision();
    store.log_write("DELETE", &key, 200);
    axum::Json(o).into_response()
}

/// PUT and DELETE on the object routes, POST on the collections (merged
/// with `objects.rs`'s GET and PATCH on the same paths).
pub(crate) fn routes() -> axum::Router<Arc<Cluster>> {
    use axum::routing::{post as on_post, put as on_put};
    let mut router = axum::Router::new();
    for prefix in ["/api/v1", "/apis/{group}/{version}"] {
        for at in ["/namespaces/{ns}/{resource}", "/{resource}"] {
            router = router
                .route(&format!("{prefix}{at}"), on_post(post_handler))
                .route(
                    &format!("{prefix}{at}/{{name}}"),
                    on_put(put_handler).delete(delete_handler),
                );
        }
    }
    router
}

/// POST into kube-system's `resource` of `api`, for the collection paths
/// the health lists serve (`health.rs`), which win over the routes above.
pub(crate) fn post_into_kube_system(
    api: &'static str,
    resource: &'static str,
) -> axum::routing::MethodRouter<Arc<Cluster>> {
    axum::routing::post(
        move |State(c): State<Arc<Cluster>>,
              Query(p): Query<Params>,
              headers: HeaderMap,
              body: String| async move {
            let t = Target {
                api: api.into(),
                resource: resource.into(),
                namespace: "kube-system".into(),
                name: None,
            };
            post(&c, t, &p, &headers, &body)
        },
    )
}

async fn put_handler(
    State(c): State<Arc<Cluster>>,
    axum::extract::Path(at): Where,
    Query(p): Query<Params>,
    headers: HeaderMap,
    body: String,
) -> Response {
    put(&c, Target::from(at), &p, &headers, &body)
}

async fn post_handler(
    State(c): State<Arc<Cluster>>,
    axum::extract::Path(at): Where,
    Query(p): Query<Params>,
    headers: HeaderMap,
    body: String,
) -> Response {
    post(&c, Target::from(at), &p, &headers, &body)
}

async fn delete_handler(
    State(c): State<Arc<Cluster>>,
    axum::extract::Path(at): Where,
    Query(p): Query<Params>,
    body: String,
) -> Response {
    delete(&c, Target::from(at), &p, &body)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cm(data: Value) -> Value {
        json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "inv", "namespace": "kube-system", "labels": {"a": "1"}}, "data": data})
    }

    /// A PUT by another manager takes the fields it changed and drops
    /// from every manager what it removed (managedfieldsupdater.go).
    #[test]
    fn a_replace_moves_changed_fields_to_its_manager_and_drops_removed_ones() {
        let now = Instant::now();
        let mut s = Store::default();
        let key: Key = (
            "v1".into(),
            "configmaps".into(),
            "kube-system".into(),
            "inv".into(),
        );
        s.objects.insert(
            key.clone(),
            created(cm(json!({"x": "1", "y": "2"})), "talos", "v1", 1, now),
        );
        s.revision = 1;
        s.replace(&key, cm(json!({"x": "1", "z": "3"})), "imgbuild", now);
        let st = &s.objects[&key];
        assert_eq!(st.resource_version, 2);
        let owned = |m: &str| -> Vec<String> {
            st.managers
                .iter()
                .filter(|x| x.manager == m)
                .flat_map(|x| x.fields.keys().cloned())
                .collect()
        };
        assert_eq!(owned("talos"), [".data.x", ".metadata.labels.a"]);
        assert_eq!(owned("imgbuild"), [".data.z"]);
        // The same object again changes nothing, not even the version.
        s.replace(&key, cm(json!({"x": "1", "z": "3"})), "imgbuild", now);
        assert_eq!(s.objects[&key].resource_version, 2);
    }

    #[test]
    fn only_services_and_rbac_create_on_update_and_crds_need_a_resource_version() {
        assert_eq!(strategy("configmaps"), (false, true));
        assert_eq!(strategy("daemonsets"), (false, true));
        assert_eq!(strategy("clusterrolebindings"), (true, true));
        assert_eq!(strategy("services"), (true, true));
        assert_eq!(strategy("customresourcedefinitions"), (false, false));
    }
}
