//! Server-side apply's field ownership, as structured-merge-diff keeps it
//! and the API server reports it (kubernetes/kubernetes v1.33
//! `staging/src/k8s.io/apiserver/pkg/endpoints/handlers/fieldmanager/`,
//! sigs.k8s.io/structured-merge-diff `merge/conflict.go`): each manager owns
//! leaf field paths; an applier that sets a field another manager owns to
//! another value conflicts (409) unless it forces, which moves the field to
//! it; what it leaves out stays.
//!
//! Lists merge as their schema says (`+listType=map` with
//! `+listMapKey`): containers, env, volumes… by `name`, container ports
//! by `containerPort`+`protocol`, Service ports by `port`+`protocol`,
//! volume mounts by `mountPath`; other lists are atomic (replaced whole).
//! A manager that applies again without a field it applied before gives it
//! up, and a field nobody owns any more is removed from the object
//! (structured-merge-diff `merge/update.go` `Apply` → `prune`), a list
//! item with it once none of its fields is left.

use std::collections::BTreeMap;

use serde_json::{Value, json};

/// A field manager's entry (`metadata.managedFields`): its fields, as
/// paths with their values when it set them.
#[derive(Clone)]
pub(crate) struct Manager {
    pub manager: String,
    pub operation: &'static str,
    pub api_version: String,
    pub fields: BTreeMap<String, Value>,
}

/// The list-map keys of the list at field `field` (None: atomic), from the
/// Kubernetes API's `+listMapKey` markers for the lists imgbuild's objects
/// carry.
fn list_keys(field: &str, items: &[Value]) -> Option<&'static [&'static str]> {
    if items.is_empty() || !items.iter().all(Value::is_object) {
        return None;
    }
    let all = |k: &str| items.iter().all(|i| i.get(k).is_some());
    match field {
        "ports" if all("containerPort") => Some(&["containerPort", "protocol"]),
        "ports" if all("port") => Some(&["port", "protocol"]),
        "volumeMounts" if all("mountPath") => Some(&["mountPath"]),
        "volumeDevices" if all("devicePath") => Some(&["devicePath"]),
        "tolerations" | "args" | "command" | "subjects" | "rules" => None,
        _ if items.iter().all(|i| i["name"].is_string()) => Some(&["name"]),
        _ => None,
    }
}

/// An item's key value for `key` (a port's protocol defaults to TCP, as
/// the API server defaults it before merging).
fn key_value(item: &Value, key: &str) -> Value {
    match item.get(key) {
        Some(v) => v.clone(),
        None if key == "protocol" => json!("TCP"),
        None => Value::Null,
    }
}

/// The `[k=v,…]` path segment naming `item` by `keys`.
fn item_segment(item: &Value, keys: &[&str]) -> String {
    let parts: Vec<String> = keys
        .iter()
        .map(|k| format!("{k}={}", key_value(item, k)))
        .collect();
    format!("[{}]", parts.join(","))
}

fn same_item(a: &Value, b: &Value, keys: &[&str]) -> bool {
    keys.iter().all(|k| key_value(a, k) == key_value(b, k))
}

/// The field name a path ends with (`.spec.ports` → `ports`).
fn last_field(at: &str) -> &str {
    at.rsplit('.').next().unwrap_or_default()
}

/// The leaf fields of an object as structured-merge-diff paths
/// (`.spec.template.spec.containers[name="kube-proxy"].image`): list-map
/// items by their keys, other lists atomic; of `metadata` only labels and
/// annotations are fields.
pub(crate) fn fields_of(v: &Value, at: &str, out: &mut BTreeMap<String, Value>) {
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
        Value::Array(items) if list_keys(last_field(at), items).is_some() => {
            let keys = list_keys(last_field(at), items).expect("checked");
            for item in items {
                fields_of(item, &format!("{at}{}", item_segment(item, keys)), out);
            }
        }
        _ => {
            out.insert(at.to_owned(), v.clone());
        }
    }
}

/// Merges an applied configuration into the live object: mappings key by
/// key, list-maps item by item, anything else replaced.
pub(crate) fn merge(live: &mut Value, applied: &Value) {
    merge_at(live, applied, "");
}

fn merge_at(live: &mut Value, applied: &Value, field: &str) {
    match (live, applied) {
        (Value::Object(l), Value::Object(a)) => {
            for (k, v) in a {
                match l.get_mut(k) {
                    Some(existing) => merge_at(existing, v, k),
                    None => {
                        l.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (Value::Array(l), Value::Array(a))
            if list_keys(field, a).is_some()
                && (l.is_empty() || list_keys(field, l) == list_keys(field, a)) =>
        {
            let keys = list_keys(field, a).expect("checked");
            for item in a {
                match l.iter_mut().find(|x| same_item(x, item, keys)) {
                    Some(existing) => merge_at(existing, item, field),
                    None => l.push(item.clone()),
                }
            }
        }
        (live, applied) => *live = applied.clone(),
    }
}

/// Removes the leaf at `path` (a `fields_of` path) from `object`, then
/// what that leaves empty: a mapping, a list-map item with no field but
/// its keys (unless `keep` still owns one of them), a list.
pub(crate) fn remove_field(object: &mut Value, path: &str, keep: &dyn Fn(&str) -> bool) {
    let segments = split_path(path);
    remove_at(object, &segments, "", "", &[], keep);
}

/// `.a.b[k=v].c` → [".a", ".b", "[k=v]", ".c"].
fn split_path(path: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let (mut depth, mut quoted, mut escaped) = (0, false, false);
    for ch in path.chars() {
        if quoted {
            cur.push(ch);
            if escaped {
                escaped = false;
            } else if ch == '\\' {
                escaped = true;
            } else if ch == '"' {
                quoted = false;
            }
            continue;
        }
        match ch {
            '"' => {
                quoted = true;
                cur.push(ch);
            }
            '.' | '[' if depth == 0 => {
                if !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
                if ch == '[' {
                    depth = 1;
                }
                cur.push(ch);
            }
            ']' => {
                depth = 0;
                cur.push(ch);
                out.push(std::mem::take(&mut cur));
            }
            _ => cur.push(ch),
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// Removes below `v` (at path `at`, the field `field`; a list-map item
/// with `item_keys`, which stay until the item goes); whether `v` is left
/// empty.
fn remove_at(
    v: &mut Value,
    segments: &[String],
    at: &str,
    field: &str,
    item_keys: &[&str],
    keep: &dyn Fn(&str) -> bool,
) -> bool {
    let Some((first, rest)) = segments.split_first() else {
        return true;
    };
    let here = format!("{at}{first}");
    if let Some(key) = first.strip_prefix('.') {
        let Some(map) = v.as_object_mut() else {
            return false;
        };
        let gone = match map.get_mut(key) {
            Some(_) if rest.is_empty() => !item_keys.contains(&key),
            Some(child) => remove_at(child, rest, &here, key, &[], keep),
            None => false,
        };
        if gone {
            map.remove(key);
        }
        return map.is_empty();
    }
    let Some(items) = v.as_array_mut() else {
        return false;
    };
    let Some(keys) = list_keys(field, items) else {
        return false;
    };
    let Some(pos) = items
        .iter()
        .position(|item| item_segment(item, keys) == *first)
    else {
        return false;
    };
    remove_at(&mut items[pos], rest, &here, field, keys, keep);
    // An item with nothing but its keys, none of them owned, goes.
    let item = &items[pos];
    let only_keys = item
        .as_object()
        .is_some_and(|m| m.keys().all(|k| keys.contains(&k.as_str())));
    let keys_owned = keys.iter().any(|k| keep(&format!("{here}.{k}")));
    if only_keys && !keys_owned {
        items.remove(pos);
    }
    items.is_empty()
}

/// The value at a field path of `fields_of`, if the object has it.
pub(crate) fn value_at(object: &Value, path: &str) -> Option<Value> {
    let mut all = BTreeMap::new();
    fields_of(object, "", &mut all);
    all.remove(path)
}

/// `printManager`: an Update manager names its API version.
pub(crate) fn manager_name(m: &Manager) -> String {
    if m.operation == "Update" {
        format!("{:?} using {}", m.manager, m.api_version)
    } else {
        format!("{:?}", m.manager)
    }
}

/// The 409's message and causes for `conflicts` (manager, path)
/// (`internal/conflict.go` `NewConflictError`).
pub(crate) fn conflict_report(conflicts: &[(String, String)]) -> (String, Vec<Value>) {
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
