//! Server-side apply's field ownership, as structured-merge-diff keeps it
//! and the API server reports it (kubernetes/kubernetes v1.33
//! `staging/src/k8s.io/apiserver/pkg/endpoints/handlers/fieldmanager/`,
//! sigs.k8s.io/structured-merge-diff `merge/conflict.go`): each manager owns
//! leaf field paths; an applier that sets a field another manager owns to
//! another value conflicts (409) unless it forces, which moves the field to
//! it; what it leaves out stays.
//!
//! Simplified: lists of mappings with a `name` are keyed by it (the schema's
//! list-map keys otherwise), other lists are atomic; a manager's fields
//! are not removed from the object when it stops applying them.

use std::collections::BTreeMap;

use serde_json::{Value, json};

/// A field manager's entry (`metadata.managedFields`): its fields, as
/// dotted paths with their values when it set them.
#[derive(Clone)]
pub(super) struct Manager {
    pub manager: String,
    pub operation: &'static str,
    pub api_version: String,
    pub fields: BTreeMap<String, Value>,
}

/// The leaf fields of an object as structured-merge-diff paths
/// (`.spec.template.spec.containers[name="kube-proxy"].image`): lists of
/// mappings with a `name` are keyed by it, other lists are atomic; of
/// `metadata` only labels and annotations are fields.
pub(super) fn fields_of(v: &Value, at: &str, out: &mut BTreeMap<String, Value>) {
    match v {
        Value::Object(map) if !map.is_empty() => {
            for (k, child) in map {
                let skip = match at {
                    "" => matches!(k.as_str(), "apiVersion" | "kind" | "status"),
                    ".metadata" => !matches!(k.as_str(), "labels" | "annotations"),
                    _ => false,
                };
                if !skip {
                    fields_of(child, &format!("{at}.{k}"), out);
                }
            }
        }
        Value::Array(items) if keyed(items) => {
            for item in items {
                let name = item["name"].as_str().unwrap_or_default();
                fields_of(item, &format!("{at}[name={name:?}]"), out);
            }
        }
        _ => {
            out.insert(at.to_owned(), v.clone());
        }
    }
}

/// A list merged by its items' `name` (containers, ports, volumes).
pub(super) fn keyed(items: &[Value]) -> bool {
    !items.is_empty() && items.iter().all(|i| i["name"].is_string())
}

/// Merges an applied configuration into the live object: mappings key by
/// key, keyed lists item by item, anything else replaced.
pub(super) fn merge(live: &mut Value, applied: &Value) {
    match (live, applied) {
        (Value::Object(l), Value::Object(a)) => {
            for (k, v) in a {
                match l.get_mut(k) {
                    Some(existing) => merge(existing, v),
                    None => {
                        l.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (Value::Array(l), Value::Array(a)) if keyed(l) && keyed(a) => {
            for item in a {
                match l.iter_mut().find(|x| x["name"] == item["name"]) {
                    Some(existing) => merge(existing, item),
                    None => l.push(item.clone()),
                }
            }
        }
        (live, applied) => *live = applied.clone(),
    }
}

/// The value at a field path of `fields_of`, if the object has it.
pub(super) fn value_at(object: &Value, path: &str) -> Option<Value> {
    let mut all = BTreeMap::new();
    fields_of(object, "", &mut all);
    all.remove(path)
}

/// `printManager`: an Update manager names its API version.
pub(super) fn manager_name(m: &Manager) -> String {
    if m.operation == "Update" {
        format!("{:?} using {}", m.manager, m.api_version)
    } else {
        format!("{:?}", m.manager)
    }
}

/// The 409's message and causes for `conflicts` (manager, path)
/// (`internal/conflict.go` `NewConflictError`).
pub(super) fn conflict_report(conflicts: &[(String, String)]) -> (String, Vec<Value>) {
    let message = if let [(m, path)] = conflicts {
        format!("Apply failed with 1 conflict: conflict with {m}: {path}")
    } else {
        let mut by: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (m, p) in conflicts {
            by.entry(m).or_default().push(p);
        }
        let lines: Vec<String> = by
            .iter()
            .flat_map(|(m, ps)| {
                std::iter::once(format!("conflicts with {m}:"))
                    .chain(ps.iter().map(|p| format!("- {p}")))
            })
            .collect();
        format!(
            "Apply failed with {} conflicts: {}",
            conflicts.len(),
            lines.join("\n")
        )
    };
    let causes = conflicts
        .iter()
        .map(|(m, p)| json!({"reason": "FieldManagerConflict", "message": format!("conflict with {m}"), "field": p}))
        .collect();
    (message, causes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_paths_keyed_by_name() {
        let ds = json!({"apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": {"name": "kube-proxy", "namespace": "kube-system", "labels": {"k8s-app": "kube-proxy"}},
            "spec": {"template": {"spec": {"containers": [{"name": "kube-proxy", "image": "a:v1"}]}}}});
        let mut f = BTreeMap::new();
        fields_of(&ds, "", &mut f);
        let paths: Vec<&str> = f.keys().map(String::as_str).collect();
        assert_eq!(
            paths,
            [
                ".metadata.labels.k8s-app",
                ".spec.template.spec.containers[name=\"kube-proxy\"].image",
                ".spec.template.spec.containers[name=\"kube-proxy\"].name",
            ]
        );
    }

    #[test]
    fn conflicts_are_reported_per_manager() {
        let one = [(
            "\"talos\" using apps/v1".to_owned(),
            ".spec.replicas".to_owned(),
        )];
        let (message, causes) = conflict_report(&one);
        assert_eq!(
            message,
            "Apply failed with 1 conflict: conflict with \"talos\" using apps/v1: .spec.replicas"
        );
        assert_eq!(causes[0]["reason"], "FieldManagerConflict");
        let two = [
            one[0].clone(),
            (
                "\"talos\" using apps/v1".to_owned(),
                ".spec.paused".to_owned(),
            ),
        ];
        assert_eq!(
            conflict_report(&two).0,
            "Apply failed with 2 conflicts: conflicts with \"talos\" using apps/v1:\n- .spec.replicas\n- .spec.paused"
        );
    }
}
