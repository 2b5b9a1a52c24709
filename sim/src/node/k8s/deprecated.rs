//! The signals of APIs a Kubernetes release removes: the API server's
//! `apiserver_requested_deprecated_apis` gauge on `GET /metrics`
//! (kubernetes/kubernetes v1.33 `staging/src/k8s.io/apiserver/pkg/endpoints/
//! metrics/metrics.go`: STABLE, labels group, version, resource,
//! subresource, removed_release; Prometheus text sorts labels by name) and
//! stored objects of such an API version (listed until the API servers run
//! the release that removed it: then 404, as siderolabs/go-kubernetes
//! `kubernetes/upgrade/checks.go` `PopulateRemovedAPIResources` expects).
//! A test sets both with `POST /_sim/k8s-apis` (see `objects.rs`).
//!
//! Per API server, as a real one counts what it served since it started:
//! a requested API shows on the API servers the switch names (`nodes`,
//! default all) until that kube-apiserver restarts (a new image or config,
//! or its node's reboot); the VIP is answered by the first control plane
//! whose kube-apiserver is up.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::objects::group_of;
use super::versions::{self, Component};
use crate::node::state::{Cluster, ControlReply};
use crate::node::state::{RemovedObject, Requested, Stored};

/// Prometheus label values escape `\`, `"` and newlines.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl Cluster {
    /// The node whose kube-apiserver answers a request for `host` (the
    /// authority asked for: a node's address, or the VIP).
    fn apiserver_of(&self, host: &str, now: Instant) -> Option<usize> {
        let ip = host
            .rsplit_once(':')
            .map_or(host, |(ip, _)| ip)
            .trim_matches(['[', ']']);
        let ip: std::net::IpAddr = ip.parse().ok()?;
        if let Some(i) = self.index_of(ip) {
            return Some(i);
        }
        (0..self.count()).find(|&i| {
            self.node(i).control_plane()
                && self
                    .k8s_component(i, Component::ApiServer, now)
                    .is_some_and(|(_, ready)| ready)
        })
    }

    /// When node `i`'s kube-apiserver last started: its last restart, or
    /// its node's last boot, whichever is later.
    fn apiserver_started(&self, i: usize) -> Option<Instant> {
        let restarted = self.k8s_started(i, Component::ApiServer);
        let booted = self.configured_at(i);
        restarted.max(booted)
    }
}

/// `GET /metrics` of the API server.
pub(crate) async fn metrics(
    State(c): State<Arc<Cluster>>,
    uri: axum::http::Uri,
    headers: axum::http::HeaderMap,
) -> Response {
    let now = Instant::now();
    let host = uri
        .authority()
        .map(|a| a.as_str().to_owned())
        .or_else(|| {
            headers
                .get(axum::http::header::HOST)
                .and_then(|h| h.to_str().ok())
                .map(str::to_owned)
        })
        .unwrap_or_default();
    let serving = c.apiserver_of(&host, now);
    let name = serving.map(|i| c.node(i).display_name());
    let started = serving.and_then(|i| c.apiserver_started(i));
    let k8s = c.k8s.lock().unwrap();
    let mut text = String::from(
        "# HELP apiserver_requested_deprecated_apis [STABLE] Gauge of deprecated APIs that have been requested, broken out by API group, version, resource, subresource, and removed_release.\n# TYPE apiserver_requested_deprecated_apis gauge\n",
    );
    let counted = k8s.objects.requested.iter().filter(|r| {
        let here = match (&r.nodes, &name) {
            (None, _) => true,
            (Some(nodes), Some(name)) => nodes.contains(name),
            (Some(_), None) => false,
        };
        here && r.at.zip(started).is_none_or(|(at, started)| at >= started)
    });
    for r in counted {
        text += &format!(
            "apiserver_requested_deprecated_apis{{group=\"{}\",removed_release=\"{}\",resource=\"{}\",subresource=\"{}\",version=\"{}\"}} 1\n",
            label(&r.group),
            label(&r.removed_release),
            label(&r.resource),
            label(&r.subresource),
            label(&r.version)
        );
    }
    let mut counts: HashMap<String, usize> = HashMap::new();
    for k in k8s.objects.objects.keys() {
        let group = group_of(&k.0);
        let name = if group.is_empty() {
            k.1.clone()
        } else {
            format!("{}.{group}", k.1)
        };
        *counts.entry(name).or_default() += 1;
    }
    let mut counts: Vec<_> = counts.into_iter().collect();
    counts.sort();
    text += "# HELP apiserver_storage_objects [STABLE] Number of stored objects at the time of last check split by kind. In case of a fetching error, the value will be -1.\n# TYPE apiserver_storage_objects gauge\n";
    for (resource, n) in counts {
        text += &format!(
            "apiserver_storage_objects{{resource=\"{}\"}} {n}\n",
            label(&resource)
        );
    }
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// `POST /_sim/k8s-apis`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ApisSwitch {
    requested: Option<Vec<Requested>>,
    stored: Option<Vec<RemovedObject>>,
}

pub(crate) async fn apis_switch(
    State(c): State<Arc<Cluster>>,
    axum::Json(req): axum::Json<ApisSwitch>,
) -> ControlReply {
    let now = Instant::now();
    // Checked before anything changes.
    if let Some(bad) = req
        .stored
        .iter()
        .flatten()
        .find(|o| versions::parse(&o.removed_release).is_none())
    {
        return crate::node::state::control_error(
            StatusCode::BAD_REQUEST,
            format!(
                "removed_release {:?} is not a Kubernetes version",
                bad.removed_release
            ),
        );
    }
    let mut k8s = c.k8s.lock().unwrap();
    let store = &mut k8s.objects;
    if let Some(mut r) = req.requested {
        for one in &mut r {
            one.at = Some(now);
        }
        store.requested = r;
    }
    if let Some(objects) = req.stored {
        store.objects.retain(|_, s| s.removed_release.is_none());
        for o in &objects {
            let api = format!("{}/{}", o.group, o.version);
            let mut object =
                json!({"apiVersion": api, "kind": o.kind, "metadata": {"name": o.name}});
            if let Some(ns) = &o.namespace {
                object["metadata"]["namespace"] = json!(ns);
            }
            let rv = store.next_revision();
            let release = versions::parse(&o.removed_release).map(|(a, b, _)| (a, b));
            store.objects.insert(
                (
                    api.clone(),
                    o.resource.clone(),
                    o.namespace.clone().unwrap_or_default(),
                    o.name.clone(),
                ),
                Stored {
                    object,
                    managers: Vec::new(),
                    generation: 1,
                    resource_version: rv,
                    template_at: now,
                    previous_template: None,
                    removed_release: release,
                    created: rv,
                },
            );
        }
        store.removed = objects;
    }
    (
        StatusCode::OK,
        axum::Json(json!({"requested": store.requested, "stored": store.removed})),
    )
}
