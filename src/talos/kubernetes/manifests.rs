//! How the bootstrap manifests are synced, per Talos version, as talosctl
//! `upgrade-k8s` syncs them (siderolabs/talos `pkg/cluster/kubernetes/
//! talos_managed.go`, `PerformManifestsSync`): by the OLDEST Talos version
//! of the cluster's nodes (`VerifyVersionCompatibility` →
//! `SupportsSSAManifestSync`, `pkg/machinery/compatibility/talos_version.go`):
//!
//! - before v1.13, [`SyncMode::Replace`] (go-kubernetes v0.2.26–v0.2.28
//!   `kubernetes/manifests/sync.go`): each object read; a missing one
//!   created (`POST`); an existing one replaced whole (`PUT` with the live
//!   `resourceVersion`) when a dry-run `PUT` shows a difference. Nothing is
//!   ever deleted, and nothing is marked.
//! - from v1.13, [`SyncMode::Apply`] (go-kubernetes v0.2.36+ `kubernetes/
//!   ssa`, `Manager.Apply`, talosctl's default policy `AdoptIfNoInventory`,
//!   pruning on): server-side apply as field manager `talos` of every object
//!   with the annotation [`OWNING_INVENTORY`] = [`INVENTORY_NAME`]; the
//!   inventory is the ConfigMap `kube-system/talos-bootstrap-manifests-
//!   inventory` (`ssa/internal/inventory/configmap`), one data key per
//!   object (`<namespace>_<name>_<group>_<kind>`, fluxcd cli-utils
//!   `ObjMetadata.String`), which Talos v1.13+ nodes write too
//!   (`controllers/k8s/manifest_apply.go`); after the apply, the objects
//!   the inventory lists that Talos no longer renders are deleted (pruned)
//!   and dropped from it. An object carrying another inventory's mark is
//!   refused, as the `AdoptIfNoInventory` policy refuses it.
//!
//! Stricter than go-kubernetes in one place, on purpose: an object is only
//! ever pruned when the live object carries Talos's inventory mark
//! ([`prunable`]); one the inventory lists without the mark (the node's
//! controller backfills existing objects into the inventory unmarked) is
//! kept and named, never deleted.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

use super::api::Kube;
use crate::inventory::parse_version;
use crate::talos::kube::KubeError;

/// The annotation by which go-kubernetes `ssa` (Talos v1.13+, field
/// manager `talos`) marks an object as its inventory's
/// (`ssa.InventoryAnnotationKey`).
pub const OWNING_INVENTORY: &str = "config.k8s.io/owning-inventory";

/// Talos's inventory ConfigMap and the value of its mark
/// (`pkg/machinery/constants`: `KubernetesInventoryNamespace`,
/// `KubernetesBootstrapManifestsInventoryName`; the ConfigMap inventory's
/// ID is its name).
pub const INVENTORY_NAMESPACE: &str = "kube-system";
pub const INVENTORY_NAME: &str = "talos-bootstrap-manifests-inventory";

/// The inventory ConfigMap's path.
pub fn inventory_path() -> String {
    format!("/api/v1/namespaces/{INVENTORY_NAMESPACE}/configmaps/{INVENTORY_NAME}")
}

/// How talosctl syncs the manifests on a cluster.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum SyncMode {
    /// Before Talos v1.13: create or replace whole (`PUT`), never delete.
    #[default]
    Replace,
    /// From Talos v1.13: server-side apply with Talos's inventory, pruning.
    Apply,
}

impl SyncMode {
    /// The mode of a cluster whose nodes run `versions` (unreadable ones
    /// left out): by the oldest, as talosctl decides it.
    pub fn of<'a>(versions: impl IntoIterator<Item = &'a str>) -> SyncMode {
        let oldest = versions
            .into_iter()
            .filter_map(|v| parse_version(v, false))
            .min();
        match oldest {
            Some((major, minor, _)) if (major, minor) >= (1, 13) => SyncMode::Apply,
            _ => SyncMode::Replace,
        }
    }

    pub fn verb(self) -> &'static str {
        match self {
            SyncMode::Replace => "replace",
            SyncMode::Apply => "server-side apply",
        }
    }
}

/// One inventory entry: an object by group, kind, namespace and name
/// (no version: the API server serves one object under all of them).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjRef {
    pub namespace: String,
    pub name: String,
    pub group: String,
    pub kind: String,
}

/// RBAC names may hold `:`, which a ConfigMap key may not: cli-utils
/// writes it as `__` for these kinds (`RBACGroupKind`).
const RBAC_KINDS: [&str; 4] = ["Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"];
const RBAC_GROUP: &str = "rbac.authorization.k8s.io";

impl ObjRef {
    /// The entry of a rendered object. A cluster-scoped object keeps no
    /// namespace (Talos v1.14 `manifest_apply.go` drops one set by mistake).
    pub fn of(obj: &Value, namespaced: bool) -> ObjRef {
        let api = obj["apiVersion"].as_str().unwrap_or("");
        let group = api.rsplit_once('/').map_or("", |(g, _)| g);
        ObjRef {
            namespace: if namespaced {
                obj["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or("default")
                    .to_owned()
            } else {
                String::new()
            },
            name: obj["metadata"]["name"].as_str().unwrap_or("").to_owned(),
            group: group.to_owned(),
            kind: obj["kind"].as_str().unwrap_or("").to_owned(),
        }
    }

    fn rbac(&self) -> bool {
        self.group == RBAC_GROUP && RBAC_KINDS.contains(&self.kind.as_str())
    }

    /// The ConfigMap key (cli-utils `ObjMetadata.String`).
    pub fn key(&self) -> String {
        let name = if self.rbac() {
            self.name.replace(':', "__")
        } else {
            self.name.clone()
        };
        format!("{}_{name}_{}_{}", self.namespace, self.group, self.kind)
    }

    /// A ConfigMap key read back (cli-utils `ParseObjMetadata`: namespace
    /// up to the first `_`, kind and group from the last two). The key is
    /// outside text that becomes an API path: a part with anything but
    /// the characters Kubernetes names, groups and kinds use is refused.
    pub fn parse(key: &str) -> Option<ObjRef> {
        let (namespace, rest) = key.split_once('_')?;
        let (rest, kind) = rest.rsplit_once('_')?;
        let (name, group) = rest.rsplit_once('_')?;
        let r = ObjRef {
            namespace: namespace.to_owned(),
            name: name.replace("__", ":"),
            group: group.to_owned(),
            kind: kind.to_owned(),
        };
        let fits = |s: &str, extra: &[char]| {
            s.len() <= 253
                && s.chars().all(|c| {
                    c.is_ascii_alphanumeric() || c == '-' || c == '.' || extra.contains(&c)
                })
        };
        (fits(&r.namespace, &[])
            && !r.name.is_empty()
            && fits(&r.name, &[':'])
            && fits(&r.group, &[])
            && !r.kind.is_empty()
            && fits(&r.kind, &[])
            && !r.name.starts_with('.'))
        .then_some(r)
    }

    /// Whether it names `obj` (go-kubernetes `calculatePruneObjects`: by
    /// group, kind and name; the namespace too unless the entry has none).
    pub fn names(&self, obj: &Value) -> bool {
        let api = obj["apiVersion"].as_str().unwrap_or("");
        let group = api.rsplit_once('/').map_or("", |(g, _)| g);
        obj["kind"].as_str() == Some(self.kind.as_str())
            && group == self.group
            && obj["metadata"]["name"].as_str() == Some(self.name.as_str())
            && (self.namespace.is_empty()
                || obj["metadata"]["namespace"].as_str().unwrap_or("default") == self.namespace)
    }

    /// The API version to reach it under, for the groups Talos's
    /// manifests use; others by discovery.
    pub fn known_api_version(&self) -> Option<String> {
        match self.group.as_str() {
            "" => Some("v1".to_owned()),
            g @ ("apps" | "rbac.authorization.k8s.io" | "policy" | "apiextensions.k8s.io") => {
                Some(format!("{g}/v1"))
            }
            _ => None,
        }
    }

    /// `apps/v1 DaemonSet kube-system/kube-proxy`, as objects are named in
    /// the plan and report (`api_version` as it is reached under).
    pub fn describe(&self, api_version: &str) -> String {
        let ns = if self.namespace.is_empty() {
            String::new()
        } else {
            format!("{}/", self.namespace)
        };
        crate::input::excerpt(
            &format!("{api_version} {} {ns}{}", self.kind, self.name),
            200,
        )
    }
}

/// Where inventory entry `r` lives: its path and the API version it is
/// reached under (the known groups' own, else the group's preferred one
/// by discovery).
pub fn locate(
    kube: &Kube,
    r: &ObjRef,
    discovery: &mut BTreeMap<String, Value>,
) -> Result<(String, String), KubeError> {
    let api_version = match r.known_api_version() {
        Some(v) => v,
        None => kube
            .get(&format!("/apis/{}", r.group))?
            .and_then(|d| {
                d["preferredVersion"]["groupVersion"]
                    .as_str()
                    .map(str::to_owned)
            })
            .ok_or_else(|| KubeError::Api {
                server: kube.kc.server.clone(),
                message: format!("API group {} is not served", r.group),
            })?,
    };
    let mut probe = serde_json::json!({"apiVersion": api_version, "kind": r.kind,
        "metadata": {"name": r.name}});
    if !r.namespace.is_empty() {
        probe["metadata"]["namespace"] = Value::String(r.namespace.clone());
    }
    let res = kube.resource_of(&probe, discovery)?;
    Ok((super::api::object_path(&res, &probe), api_version))
}

/// The entries of an inventory ConfigMap, in key order; keys that do not
/// parse are left out (go-kubernetes refuses the whole inventory then).
pub fn inventory_refs(configmap: &Value) -> Vec<ObjRef> {
    configmap["data"]
        .as_object()
        .map(|d| d.keys().filter_map(|k| ObjRef::parse(k)).collect())
        .unwrap_or_default()
}

/// The inventory ConfigMap holding exactly `refs`, at the
/// `resource_version` read (a conditional update: a node's controller
/// writing meanwhile makes it a 409, and the caller reads again).
pub fn inventory_configmap(refs: &[ObjRef], resource_version: Option<&str>) -> Value {
    let data: serde_json::Map<String, Value> = refs
        .iter()
        .map(|r| (r.key(), Value::String(String::new())))
        .collect();
    let mut metadata =
        serde_json::json!({"name": INVENTORY_NAME, "namespace": INVENTORY_NAMESPACE});
    if let Some(rv) = resource_version {
        metadata["resourceVersion"] = Value::String(rv.to_owned());
    }
    serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data})
}

/// The entries the inventory lists that `objects` (what Talos renders now)
/// no longer hold: candidates for pruning.
pub fn stale(refs: &[ObjRef], objects: &[Value]) -> Vec<ObjRef> {
    refs.iter()
        .filter(|r| !objects.iter().any(|o| r.names(o)))
        .cloned()
        .collect()
}

/// Whose inventory an object is in by its mark.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mark {
    None,
    Talos,
    Other(String),
}

pub fn mark_of(obj: &Value) -> Mark {
    match obj["metadata"]["annotations"][OWNING_INVENTORY].as_str() {
        None => Mark::None,
        Some(INVENTORY_NAME) => Mark::Talos,
        Some(other) => Mark::Other(crate::input::excerpt(other, 100)),
    }
}

/// Whether the live object `live` may be pruned: only when it carries
/// Talos's inventory mark. An object Talos did not create (no mark, or
/// another inventory's) is never deleted, even if the inventory lists it.
pub fn prunable(live: &Value) -> bool {
    mark_of(live) == Mark::Talos
}

/// `obj` with Talos's inventory mark, as go-kubernetes `prepareObjects`
/// sets it before the apply (and the comparison) in [`SyncMode::Apply`].
pub fn marked(obj: &Value) -> Value {
    let mut out = obj.clone();
    if let Some(meta) = out["metadata"].as_object_mut() {
        let notes = meta
            .entry("annotations")
            .or_insert_with(|| Value::Object(serde_json::Map::new()));
        if let Some(notes) = notes.as_object_mut() {
            notes.insert(
                OWNING_INVENTORY.to_owned(),
                Value::String(INVENTORY_NAME.to_owned()),
            );
        }
    }
    out
}

/// The order objects are applied in (fluxcd `ssa.ApplyAllStaged`):
/// Namespaces and CRDs first, then — Talos v1.14's `CustomStageKinds` —
/// ConfigMaps and Secrets, then the rest, each group in manifest order.
pub fn stage(obj: &Value, v1_14: bool) -> u8 {
    match obj["kind"].as_str() {
        Some("Namespace" | "CustomResourceDefinition") => 0,
        Some("ConfigMap" | "Secret") if v1_14 => 1,
        _ => 2,
    }
}

/// What go-kubernetes compares after a dry-run `PUT`
/// (`getResourceDiff`): the object without what Kubernetes sets itself
/// (uid, versions, timestamps, managedFields, finalizers, owners), its
/// `*kubernetes.io/*` annotations, and a ServiceAccount's `secrets`. Also
/// without `status`, which a `PUT` of the object never changes (the API
/// server keeps the stored one): a reply that leaves it out is no change.
pub fn comparable(obj: &Value) -> Value {
    let mut o = obj.clone();
    if let Some(m) = o.as_object_mut() {
        m.remove("status");
    }
    if let Some(meta) = o["metadata"].as_object_mut() {
        for k in [
            "uid",
            "resourceVersion",
            "generation",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "managedFields",
            "finalizers",
            "selfLink",
            "ownerReferences",
        ] {
            meta.remove(k);
        }
        if let Some(notes) = meta.get_mut("annotations").and_then(Value::as_object_mut) {
            notes.retain(|k, _| !k.contains("kubernetes.io/"));
            if notes.is_empty() {
                meta.remove("annotations");
            }
        }
    }
    if o["kind"] == "ServiceAccount"
        && let Some(m) = o.as_object_mut()
    {
        m.remove("secrets");
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn talos_1_13_and_later_sync_by_server_side_apply_older_clusters_replace() {
        // talos_managed.go v1.13.0: useSSA := minTalosVersion.SupportsSSAManifestSync().
        assert_eq!(SyncMode::of(["v1.11.5"]), SyncMode::Replace);
        assert_eq!(SyncMode::of(["v1.12.9"]), SyncMode::Replace);
        assert_eq!(SyncMode::of(["v1.13.0"]), SyncMode::Apply);
        assert_eq!(SyncMode::of(["v1.14.0", "v1.13.5"]), SyncMode::Apply);
        // The oldest node decides: one v1.12 worker keeps the old way.
        assert_eq!(SyncMode::of(["v1.14.0", "v1.12.4"]), SyncMode::Replace);
        assert_eq!(SyncMode::of([]), SyncMode::Replace);
    }

    #[test]
    fn inventory_keys_are_cli_utils_object_metadata() {
        let ds = json!({"apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": {"name": "kube-proxy", "namespace": "kube-system"}});
        let r = ObjRef::of(&ds, true);
        assert_eq!(r.key(), "kube-system_kube-proxy_apps_DaemonSet");
        assert_eq!(ObjRef::parse(&r.key()), Some(r.clone()));
        // RBAC names: ':' written as "__"; cluster-scoped: no namespace.
        let crb = json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": "system:coredns"}});
        let r = ObjRef::of(&crb, false);
        assert_eq!(
            r.key(),
            "_system__coredns_rbac.authorization.k8s.io_ClusterRoleBinding"
        );
        assert_eq!(ObjRef::parse(&r.key()).unwrap().name, "system:coredns");
        assert!(r.names(&crb));
        let sa = json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "x"}});
        assert_eq!(ObjRef::of(&sa, true).key(), "default_x__ServiceAccount");
        assert_eq!(ObjRef::parse("nonsense"), None);
        // Keys become API paths: nothing but name characters.
        assert_eq!(ObjRef::parse("kube-system_a/../../x_apps_DaemonSet"), None);
        assert_eq!(ObjRef::parse("kube-system_a?b_apps_DaemonSet"), None);
    }

    #[test]
    fn what_the_inventory_lists_and_talos_no_longer_renders_is_stale() {
        let cm = inventory_configmap(
            &[
                ObjRef::parse("kube-system_kube-proxy_apps_DaemonSet").unwrap(),
                ObjRef::parse("kube-system_kube-flannel_apps_DaemonSet").unwrap(),
            ],
            Some("7"),
        );
        assert_eq!(cm["metadata"]["resourceVersion"], "7");
        let refs = inventory_refs(&cm);
        let rendered = [json!({"apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": {"name": "kube-proxy", "namespace": "kube-system"}})];
        let gone = stale(&refs, &rendered);
        assert_eq!(gone.len(), 1);
        assert_eq!(
            gone[0].describe("apps/v1"),
            "apps/v1 DaemonSet kube-system/kube-flannel"
        );
    }

    #[test]
    fn only_an_object_with_talos_inventory_mark_is_ever_pruned() {
        let obj = |notes: Value| json!({"metadata": {"name": "x", "annotations": notes}});
        assert!(prunable(&obj(json!({OWNING_INVENTORY: INVENTORY_NAME}))));
        assert!(!prunable(&obj(json!({}))), "no mark: not Talos's");
        assert!(!prunable(&obj(json!({OWNING_INVENTORY: "flux-system"}))));
        assert!(!prunable(&json!({"metadata": {"name": "x"}})));
        assert_eq!(
            mark_of(&obj(json!({OWNING_INVENTORY: "flux-system"}))),
            Mark::Other("flux-system".into())
        );
    }

    #[test]
    fn an_applied_object_carries_the_mark_and_a_replaced_one_compares_without_server_fields() {
        let o = json!({"metadata": {"name": "coredns", "annotations": {"a": "b"}}});
        assert_eq!(
            marked(&o)["metadata"]["annotations"],
            json!({"a": "b", OWNING_INVENTORY: INVENTORY_NAME})
        );
        let live = json!({"kind": "ServiceAccount", "secrets": [{"name": "t"}],
            "metadata": {"name": "x", "uid": "1", "resourceVersion": "9",
            "annotations": {"deployment.kubernetes.io/revision": "3"}}});
        assert_eq!(
            comparable(&live),
            json!({"kind": "ServiceAccount", "metadata": {"name": "x"}})
        );
        assert!(
            stage(&json!({"kind": "Namespace"}), false)
                < stage(&json!({"kind": "ConfigMap"}), false)
        );
        assert!(
            stage(&json!({"kind": "ConfigMap"}), true)
                < stage(&json!({"kind": "Deployment"}), true)
        );
    }
}
