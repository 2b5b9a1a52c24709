//! The Kubernetes API calls an upgrade makes, blocking (call them off the
//! async runtime): reads, the metrics text, and server-side apply
//! (kubernetes/kubernetes `staging/src/k8s.io/apiserver/pkg/endpoints/
//! handlers/patch.go`: `PATCH` with `application/apply-patch+yaml`, a
//! `fieldManager`, `force=true` to take over fields another manager set).
//! Every reply is bounded; no credential is ever part of an error.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::Value;

use crate::net;
use crate::talos::kube::{KubeError, Kubeconfig};

/// Lists, objects and the metrics page are small; a reply larger than
/// this is not one.
const REPLY_LIMIT: u64 = 16 << 20;

/// The field manager Talos applies its manifests as (siderolabs/talos
/// `pkg/machinery/constants/constants.go`, `KubernetesFieldManagerName`).
pub const FIELD_MANAGER: &str = "talos";

/// One API server (or the endpoint in front of them).
#[derive(Debug, Clone)]
pub struct Kube {
    pub kc: Kubeconfig,
    pub timeout: Duration,
}

/// Where objects of one kind live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resource {
    /// `/api/v1` or `/apis/apps/v1`.
    pub base: String,
    /// `daemonsets`.
    pub plural: String,
    pub namespaced: bool,
}

/// The kinds Talos's bootstrap manifests hold, with Kubernetes's own
/// resource names; other kinds are looked up by discovery.
const KINDS: [(&str, &str, bool); 14] = [
    ("ServiceAccount", "serviceaccounts", true),
    ("ConfigMap", "configmaps", true),
    ("Secret", "secrets", true),
    ("Service", "services", true),
    ("Namespace", "namespaces", false),
    ("DaemonSet", "daemonsets", true),
    ("Deployment", "deployments", true),
    ("ClusterRole", "clusterroles", false),
    ("ClusterRoleBinding", "clusterrolebindings", false),
    ("Role", "roles", true),
    ("RoleBinding", "rolebindings", true),
    ("PodDisruptionBudget", "poddisruptionbudgets", true),
    (
        "CustomResourceDefinition",
        "customresourcedefinitions",
        false,
    ),
    ("PodSecurityPolicy", "podsecuritypolicies", false),
];

/// `/api/v1` for `v1`, `/apis/apps/v1` for `apps/v1`.
pub fn base_of(api_version: &str) -> String {
    if api_version.contains('/') {
        format!("/apis/{api_version}")
    } else {
        format!("/api/{api_version}")
    }
}

/// The path of `obj` (an object with apiVersion, kind, metadata).
pub fn object_path(res: &Resource, obj: &Value) -> String {
    let name = obj["metadata"]["name"].as_str().unwrap_or("");
    match obj["metadata"]["namespace"].as_str() {
        Some(ns) if res.namespaced => {
            format!("{}/namespaces/{ns}/{}/{name}", res.base, res.plural)
        }
        _ if res.namespaced => {
            format!("{}/namespaces/default/{}/{name}", res.base, res.plural)
        }
        _ => format!("{}/{}/{name}", res.base, res.plural),
    }
}

/// The collection `obj` is created in (its namespace's, `default` when it
/// names none, as client-go defaults it).
pub fn collection_path(res: &Resource, obj: &Value) -> String {
    match obj["metadata"]["namespace"].as_str() {
        Some(ns) if res.namespaced => format!("{}/namespaces/{ns}/{}", res.base, res.plural),
        _ if res.namespaced => format!("{}/namespaces/default/{}", res.base, res.plural),
        _ => format!("{}/{}", res.base, res.plural),
    }
}

/// Why a `PUT` was not stored.
#[derive(Debug, thiserror::Error)]
pub enum Replace {
    /// 409: someone changed the object since it was read.
    #[error("the object changed since it was read (409 Conflict)")]
    Conflict,
    #[error(transparent)]
    Failed(#[from] KubeError),
}

/// `apps/v1 DaemonSet kube-system/kube-proxy`, for lines and the report.
pub fn object_name(obj: &Value) -> String {
    let ns = obj["metadata"]["namespace"]
        .as_str()
        .map(|n| format!("{n}/"))
        .unwrap_or_default();
    crate::input::excerpt(
        &format!(
            "{} {} {ns}{}",
            obj["apiVersion"].as_str().unwrap_or("?"),
            obj["kind"].as_str().unwrap_or("?"),
            obj["metadata"]["name"].as_str().unwrap_or("?")
        ),
        200,
    )
}

impl Kube {
    fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<Vec<u8>, net::NetError> {
        let client = self
            .kc
            .client(self.timeout)
            .map_err(|e| net::NetError::Transfer {
                method: method.to_string(),
                url: self.kc.server.clone(),
                message: e.to_string(),
                before_sending: true,
            })?;
        let url = format!("{}{path}", self.kc.server.trim_end_matches('/'));
        // Server-side apply is a PATCH of its own type; PUT, POST and
        // DELETE carry plain JSON.
        let content_type = if method == reqwest::Method::PATCH {
            "application/apply-patch+yaml"
        } else {
            "application/json"
        };
        let mut req = client.request(method, &url);
        if let Some(b) = body {
            req = req.header("content-type", content_type).body(b);
        }
        let reply = net::send_once(req)?;
        net::read_limited(reply, REPLY_LIMIT)
    }

    fn api_error(&self, e: impl std::fmt::Display) -> KubeError {
        KubeError::Api {
            server: self.kc.server.clone(),
            message: crate::input::excerpt(&e.to_string().replace('\n', " "), 300),
        }
    }

    /// A GET's reply as JSON; None for 404 (not there, or not served).
    pub fn get(&self, path: &str) -> Result<Option<Value>, KubeError> {
        match self.send(reqwest::Method::GET, path, None) {
            Ok(body) => serde_json::from_slice(&body)
                .map(Some)
                .map_err(|e| self.api_error(format!("{path}: not JSON: {e}"))),
            Err(e) if e.status() == Some(404) => Ok(None),
            Err(e) => Err(self.api_error(e)),
        }
    }

    /// A GET that must answer.
    pub fn get_some(&self, path: &str) -> Result<Value, KubeError> {
        self.get(path)?
            .ok_or_else(|| self.api_error(format!("{path}: not found")))
    }

    /// `GET /metrics` as text.
    pub fn metrics(&self) -> Result<String, KubeError> {
        let body = self
            .send(reqwest::Method::GET, "/metrics", None)
            .map_err(|e| self.api_error(e))?;
        Ok(String::from_utf8_lossy(&body).into_owned())
    }

    /// Server-side apply of `obj` at `path` as [`FIELD_MANAGER`], taking
    /// over fields others set; fields it leaves out stay as they are.
    pub fn apply(&self, path: &str, obj: &Value) -> Result<Value, KubeError> {
        let body = serde_json::to_vec(obj).map_err(|e| self.api_error(e))?;
        let query = format!("{path}?fieldManager={FIELD_MANAGER}&force=true");
        let reply = self
            .send(reqwest::Method::PATCH, &query, Some(body))
            .map_err(|e| self.api_error(e))?;
        serde_json::from_slice(&reply).map_err(|e| self.api_error(format!("{path}: not JSON: {e}")))
    }

    /// `POST` of `obj` to its collection (go-kubernetes `manifests.Sync`
    /// creates a missing object so before Talos v1.13). Ok(false) when the
    /// API server answers 409 AlreadyExists.
    pub fn create(&self, res: &Resource, obj: &Value) -> Result<bool, KubeError> {
        let path = collection_path(res, obj);
        let body = serde_json::to_vec(obj).map_err(|e| self.api_error(e))?;
        match self.send(reqwest::Method::POST, &path, Some(body)) {
            Ok(_) => Ok(true),
            Err(e) if e.status() == Some(409) => Ok(false),
            Err(e) => Err(self.api_error(e)),
        }
    }

    /// `PUT` of the whole of `obj` at `path` (an update: what `obj` leaves
    /// out goes). `dry_run`: the API server only answers what it would
    /// store (`dryRun=All`). Err(Conflict) on 409: the object changed since
    /// its `metadata.resourceVersion` was read.
    pub fn replace(&self, path: &str, obj: &Value, dry_run: bool) -> Result<Value, Replace> {
        let body = serde_json::to_vec(obj).map_err(|e| Replace::Failed(self.api_error(e)))?;
        let query = if dry_run {
            format!("{path}?dryRun=All")
        } else {
            path.to_owned()
        };
        match self.send(reqwest::Method::PUT, &query, Some(body)) {
            Ok(reply) => serde_json::from_slice(&reply)
                .map_err(|e| Replace::Failed(self.api_error(format!("{path}: not JSON: {e}")))),
            Err(e) if e.status() == Some(409) => Err(Replace::Conflict),
            Err(e) => Err(Replace::Failed(self.api_error(e))),
        }
    }

    /// `DELETE` of the object at `path` with background propagation (its
    /// dependents go after it, as go-kubernetes `ssa` prunes). Ok(false)
    /// when it was gone already (404).
    pub fn delete(&self, path: &str) -> Result<bool, KubeError> {
        let options = serde_json::json!({"kind": "DeleteOptions", "apiVersion": "v1",
            "propagationPolicy": "Background"});
        let body = serde_json::to_vec(&options).map_err(|e| self.api_error(e))?;
        match self.send(reqwest::Method::DELETE, path, Some(body)) {
            Ok(_) => Ok(true),
            Err(e) if e.status() == Some(404) => Ok(false),
            Err(e) => Err(self.api_error(e)),
        }
    }

    /// Where objects of `obj`'s kind live: the built-in kinds by name,
    /// others by the group version's discovery document (cached in `seen`).
    pub fn resource_of(
        &self,
        obj: &Value,
        seen: &mut BTreeMap<String, Value>,
    ) -> Result<Resource, KubeError> {
        let api_version = obj["apiVersion"].as_str().unwrap_or("");
        let kind = obj["kind"].as_str().unwrap_or("");
        let base = base_of(api_version);
        if let Some((_, plural, namespaced)) = KINDS.iter().find(|(k, _, _)| *k == kind) {
            return Ok(Resource {
                base,
                plural: (*plural).to_owned(),
                namespaced: *namespaced,
            });
        }
        if !seen.contains_key(&base) {
            let doc = self.get(&base)?.unwrap_or(Value::Null);
            seen.insert(base.clone(), doc);
        }
        seen[&base]["resources"]
            .as_array()
            .and_then(|list| {
                list.iter().find(|r| {
                    r["kind"] == kind && r["name"].as_str().is_some_and(|n| !n.contains('/'))
                })
            })
            .map(|r| Resource {
                base: base.clone(),
                plural: r["name"].as_str().unwrap_or("").to_owned(),
                namespaced: r["namespaced"] == true,
            })
            .ok_or_else(|| {
                self.api_error(format!(
                    "{} {}: the API server does not serve this kind",
                    crate::input::excerpt(api_version, 100),
                    crate::input::excerpt(kind, 100)
                ))
            })
    }
}

/// Whether `live` already holds everything `want` says: every field of
/// `want` present with the same value (lists element by element, of the
/// same length). What the API server adds (defaults, status) is ignored,
/// so an object applied before compares equal.
pub fn contains(live: &Value, want: &Value) -> bool {
    match (live, want) {
        (Value::Object(l), Value::Object(w)) => w
            .iter()
            .all(|(k, wv)| l.get(k).is_some_and(|lv| contains(lv, wv))),
        (Value::Array(l), Value::Array(w)) => {
            l.len() == w.len() && l.iter().zip(w).all(|(a, b)| contains(a, b))
        }
        (Value::Number(l), Value::Number(w)) => l.as_f64() == w.as_f64(),
        (l, w) => l == w,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn objects_are_found_where_kubernetes_keeps_them() {
        let ds = json!({"apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": {"name": "kube-proxy", "namespace": "kube-system"}});
        let res = Resource {
            base: base_of("apps/v1"),
            plural: "daemonsets".into(),
            namespaced: true,
        };
        assert_eq!(
            object_path(&res, &ds),
            "/apis/apps/v1/namespaces/kube-system/daemonsets/kube-proxy"
        );
        assert_eq!(object_name(&ds), "apps/v1 DaemonSet kube-system/kube-proxy");
        let crb = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "x"}});
        let res = Resource {
            base: base_of("v1"),
            plural: "namespaces".into(),
            namespaced: false,
        };
        assert_eq!(object_path(&res, &crb), "/api/v1/namespaces/x");
    }

    #[test]
    fn an_object_contains_what_was_applied_and_not_more() {
        let live = json!({"metadata": {"name": "a", "uid": "1", "labels": {"k": "v", "user": "x"}},
            "spec": {"replicas": 2, "template": {"spec": {"containers": [
                {"name": "c", "image": "i:v2", "terminationMessagePath": "/dev/x"}]}}}});
        assert!(contains(
            &live,
            &json!({"metadata": {"name": "a", "labels": {"k": "v"}},
            "spec": {"replicas": 2.0, "template": {"spec": {"containers": [{"name": "c", "image": "i:v2"}]}}}})
        ));
        assert!(!contains(
            &live,
            &json!({"spec": {"template": {"spec": {"containers": [
            {"name": "c", "image": "i:v3"}]}}}})
        ));
        assert!(!contains(
            &live,
            &json!({"spec": {"template": {"spec": {"containers": [
            {"name": "c"}, {"name": "d"}]}}}})
        ));
        assert!(!contains(&live, &json!({"spec": {"paused": true}})));
    }
}
