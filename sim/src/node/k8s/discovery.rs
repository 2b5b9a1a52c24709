//! API discovery as the API server serves it to a client's REST mapper
//! (client-go `discovery`, which talosctl's manifest sync and go-kubernetes
//! `ssa` use to map a kind to its resource and scope): `GET /api`
//! (`APIVersions`), `GET /apis` (`APIGroupList`), `GET /api/v1` and `GET
//! /apis/{group}/{version}` (`APIResourceList`), as kubernetes/kubernetes
//! v1.33 `staging/src/k8s.io/apiserver/pkg/endpoints/discovery/{legacy,
//! root,group,version}.go` answer them.
//!
//! Simplified: only the resources this API server serves (`objects.rs`'s,
//! the removed-API ones the switch stores while a running release serves
//! them, nodes and pods); no aggregated discovery (`application/json;g=
//! apidiscovery.k8s.io;v=v2`: a client asking for it gets the legacy
//! documents, as from an API server with the feature off); no subresources.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::objects::{KINDS, no_resource};
use crate::node::state::Cluster;

/// The verbs of a resource this simulator serves fully.
const VERBS: [&str; 8] = [
    "create",
    "delete",
    "deletecollection",
    "get",
    "list",
    "patch",
    "update",
    "watch",
];

/// (apiVersion, plural, kind, namespaced) of everything served now.
fn served(cluster: &Cluster) -> Vec<(String, String, String, bool)> {
    let running = cluster.apiserver_minor();
    let mut out: Vec<(String, String, String, bool)> = KINDS
        .iter()
        .map(|(a, r, k, n)| ((*a).to_owned(), (*r).to_owned(), (*k).to_owned(), *n))
        .collect();
    out.push(("v1".into(), "nodes".into(), "Node".into(), false));
    out.push(("v1".into(), "pods".into(), "Pod".into(), true));
    let k8s = cluster.k8s.lock().unwrap();
    for o in &k8s.objects.removed {
        let removed = super::versions::parse(&o.removed_release).map(|(a, b, _)| (a, b));
        let gone = matches!((removed, running), (Some(r), Some(now)) if now >= r);
        let api = format!("{}/{}", o.group, o.version);
        if !gone && !out.iter().any(|(a, r, _, _)| *a == api && *r == o.resource) {
            out.push((
                api,
                o.resource.clone(),
                o.kind.clone(),
                o.namespace.is_some(),
            ));
        }
    }
    out
}

fn resource_list(cluster: &Cluster, api: &str) -> Response {
    let resources: Vec<Value> = served(cluster)
        .into_iter()
        .filter(|(a, _, _, _)| a == api)
        .map(|(_, r, k, n)| {
            json!({"name": r, "singularName": k.to_lowercase(), "namespaced": n,
                "kind": k, "verbs": VERBS})
        })
        .collect();
    if resources.is_empty() {
        return no_resource();
    }
    axum::Json(json!({"kind": "APIResourceList", "apiVersion": "v1",
        "groupVersion": api, "resources": resources}))
    .into_response()
}

async fn core_versions() -> Response {
    axum::Json(json!({"kind": "APIVersions", "versions": ["v1"],
        "serverAddressByClientCIDRs": []}))
    .into_response()
}

async fn groups(State(c): State<Arc<Cluster>>) -> Response {
    let mut by_group: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (api, _, _, _) in served(&c) {
        if let Some((g, v)) = api.split_once('/') {
            let versions = by_group.entry(g.to_owned()).or_default();
            if !versions.iter().any(|x| x == v) {
                versions.push(v.to_owned());
            }
        }
    }
    let groups: Vec<Value> = by_group
        .into_iter()
        .map(|(g, versions)| {
            let vs: Vec<Value> = versions
                .iter()
                .map(|v| json!({"groupVersion": format!("{g}/{v}"), "version": v}))
                .collect();
            json!({"name": g, "versions": vs, "preferredVersion": vs[0]})
        })
        .collect();
    axum::Json(json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}))
        .into_response()
}

async fn core_resources(State(c): State<Arc<Cluster>>) -> Response {
    resource_list(&c, "v1")
}

async fn group_resources(
    State(c): State<Arc<Cluster>>,
    Path((group, version)): Path<(String, String)>,
) -> Response {
    resource_list(&c, &format!("{group}/{version}"))
}

/// The discovery routes, merged into the API server's router.
pub(crate) fn routes() -> axum::Router<Arc<Cluster>> {
    use axum::routing::get;
    axum::Router::new()
        .route("/api", get(core_versions))
        .route("/apis", get(groups))
        .route("/api/v1", get(core_resources))
        .route("/apis/{group}/{version}", get(group_resources))
}
