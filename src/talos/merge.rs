//! The cluster's kubeconfig and talosconfig merged into the user's own
//! files, as `talosctl kubeconfig` and `talosctl config merge` do: the
//! cluster's entries added under their names, the current context set to
//! the cluster, every other entry kept as it was. An entry of the same name
//! with other content is replaced only when asked (`force`), since it may
//! be another cluster's. Pure over text; the CLI reads and writes the files.
//!
//! Formats: kubeconfig as client-go's `clientcmd/api/v1` (`clusters`,
//! `users`, `contexts`: lists of `{name, <kind>}`; `current-context`);
//! talosconfig as talos `pkg/machinery/client/config` (`context`, and
//! `contexts`: a map from name to context).

use serde_yaml_ng::{Mapping, Value};

/// Why a merge did not happen. Messages name entries, never their content
/// (a user entry holds a client key).
#[derive(Debug, thiserror::Error)]
pub enum MergeError {
    #[error("{what} is not a {kind}: {reason}")]
    Unreadable {
        what: &'static str,
        kind: &'static str,
        reason: String,
    },
    #[error(
        "{} already there with other content ({}): --force replaces {}",
        .0.join(", "),
        if .0.len() == 1 { "another cluster's, or this cluster's before its secrets changed" } else { "other clusters', or this cluster's before its secrets changed" },
        if .0.len() == 1 { "it" } else { "them" }
    )]
    Conflict(Vec<String>),
}

/// The merged file, and what the merge did to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Merged {
    pub text: String,
    /// False when the file already held every entry and context: nothing to
    /// write (a second merge changes no byte).
    pub changed: bool,
    /// Entries of the same name replaced (only with `force`).
    pub replaced: Vec<String>,
    pub context: String,
}

fn parse(text: &str, what: &'static str, kind: &'static str) -> Result<Mapping, MergeError> {
    let unreadable = |reason: String| MergeError::Unreadable { what, kind, reason };
    let text = crate::input::yaml(text).map_err(|e| unreadable(e.to_string()))?;
    match serde_yaml_ng::from_str::<Value>(text)
        .map_err(|e| unreadable(crate::input::yaml_error_without_values(&e)))?
    {
        Value::Null => Ok(Mapping::new()),
        Value::Mapping(m) => Ok(m),
        _ => Err(unreadable("not a mapping".into())),
    }
}

fn key(k: &str) -> Value {
    Value::String(k.to_owned())
}

/// `ours` (the cluster's kubeconfig) merged into `theirs` (the user's
/// kubeconfig, empty when the file is new).
pub fn kubeconfig(theirs: &str, ours: &str, force: bool) -> Result<Merged, MergeError> {
    let ours = parse(ours, "the cluster's kubeconfig", "kubeconfig")?;
    let mut out = parse(theirs, "the kubeconfig to merge into", "kubeconfig")?;
    let before = out.clone();
    let context = ours
        .get("current-context")
        .and_then(Value::as_str)
        .ok_or_else(|| MergeError::Unreadable {
            what: "the cluster's kubeconfig",
            kind: "kubeconfig",
            reason: "it has no current-context".into(),
        })?
        .to_owned();
    if out.is_empty() {
        out.insert(key("apiVersion"), key("v1"));
        out.insert(key("kind"), key("Config"));
    }
    let (mut conflicts, mut replaced) = (Vec::new(), Vec::new());
    for (list, noun) in [
        ("clusters", "cluster"),
        ("users", "user"),
        ("contexts", "context"),
    ] {
        let entries = ours
            .get(list)
            .and_then(Value::as_sequence)
            .cloned()
            .unwrap_or_default();
        let target = out
            .entry(key(list))
            .or_insert_with(|| Value::Sequence(Vec::new()));
        if target.is_null() {
            *target = Value::Sequence(Vec::new());
        }
        let Some(target) = target.as_sequence_mut() else {
            return Err(MergeError::Unreadable {
                what: "the kubeconfig to merge into",
                kind: "kubeconfig",
                reason: format!("{list} is not a list"),
            });
        };
        for entry in entries {
            let name = entry.get("name").and_then(Value::as_str).unwrap_or("");
            let shown = format!("{noun} {}", crate::input::quote(name));
            match target
                .iter_mut()
                .find(|e| e.get("name").and_then(Value::as_str) == Some(name))
            {
                Some(same) if *same == entry => {}
                Some(other) if force => {
                    *other = entry;
                    replaced.push(shown);
                }
                Some(_) => conflicts.push(shown),
                None => target.push(entry),
            }
        }
    }
    if !conflicts.is_empty() {
        return Err(MergeError::Conflict(conflicts));
    }
    out.insert(key("current-context"), key(&context));
    finish(out, before, replaced, context)
}

/// `ours` (the cluster's talosconfig) merged into `theirs` (the user's
/// talosconfig, empty when the file is new).
pub fn talosconfig(theirs: &str, ours: &str, force: bool) -> Result<Merged, MergeError> {
    let ours = parse(ours, "the cluster's talosconfig", "talosconfig")?;
    let mut out = parse(theirs, "the talosconfig to merge into", "talosconfig")?;
    let before = out.clone();
    let context = ours
        .get("context")
        .and_then(Value::as_str)
        .ok_or_else(|| MergeError::Unreadable {
            what: "the cluster's talosconfig",
            kind: "talosconfig",
            reason: "it has no context".into(),
        })?
        .to_owned();
    let entry = ours
        .get("contexts")
        .and_then(|c| c.get(context.as_str()))
        .cloned()
        .ok_or_else(|| MergeError::Unreadable {
            what: "the cluster's talosconfig",
            kind: "talosconfig",
            reason: "its context is not among its contexts".into(),
        })?;
    let contexts = out
        .entry(key("contexts"))
        .or_insert_with(|| Value::Mapping(Mapping::new()));
    if contexts.is_null() {
        *contexts = Value::Mapping(Mapping::new());
    }
    let Some(contexts) = contexts.as_mapping_mut() else {
        return Err(MergeError::Unreadable {
            what: "the talosconfig to merge into",
            kind: "talosconfig",
            reason: "contexts is not a mapping".into(),
        });
    };
    let shown = format!("context {}", crate::input::quote(&context));
    let mut replaced = Vec::new();
    match contexts.get_mut(context.as_str()) {
        Some(same) if *same == entry => {}
        Some(other) if force => {
            *other = entry;
            replaced.push(shown);
        }
        Some(_) => return Err(MergeError::Conflict(vec![shown])),
        None => {
            contexts.insert(key(&context), entry);
        }
    }
    out.insert(key("context"), key(&context));
    finish(out, before, replaced, context)
}

fn finish(
    out: Mapping,
    before: Mapping,
    replaced: Vec<String>,
    context: String,
) -> Result<Merged, MergeError> {
    Ok(Merged {
        changed: out != before,
        text: serde_yaml_ng::to_string(&out).expect("YAML values serialise"),
        replaced,
        context,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const OURS: &str = "apiVersion: v1\nkind: Config\nclusters:\n- cluster:\n    server: https://10.0.0.20:6443\n    certificate-authority-data: Q0E=\n  name: demo\nusers:\n- name: admin@demo\n  user:\n    client-certificate-data: Q1JU\n    client-key-data: S0VZ\ncontexts:\n- context:\n    cluster: demo\n    namespace: default\n    user: admin@demo\n  name: admin@demo\ncurrent-context: admin@demo\n";

    const THEIRS: &str = "apiVersion: v1\nclusters:\n- cluster:\n    server: https://other:6443\n  name: other\ncontexts:\n- context:\n    cluster: other\n    user: me\n  name: other\ncurrent-context: other\nkind: Config\npreferences: {}\nusers:\n- name: me\n  user:\n    token: abc\n";

    #[test]
    fn a_kubeconfig_merge_adds_the_cluster_and_keeps_the_rest() {
        let m = kubeconfig(THEIRS, OURS, false).unwrap();
        assert!(m.changed);
        assert_eq!(m.context, "admin@demo");
        let v: Value = serde_yaml_ng::from_str(&m.text).unwrap();
        assert_eq!(v["current-context"].as_str(), Some("admin@demo"));
        assert_eq!(v["clusters"].as_sequence().unwrap().len(), 2);
        assert_eq!(v["users"][0]["user"]["token"].as_str(), Some("abc"));
        assert_eq!(
            v["preferences"],
            serde_yaml_ng::from_str::<Value>("{}").unwrap()
        );
        // Again: nothing changes.
        let again = kubeconfig(&m.text, OURS, false).unwrap();
        assert!(!again.changed);
        assert_eq!(again.text, m.text);
    }

    #[test]
    fn a_new_kubeconfig_is_the_cluster_s() {
        let m = kubeconfig("", OURS, false).unwrap();
        let v: Value = serde_yaml_ng::from_str(&m.text).unwrap();
        assert_eq!(v["kind"].as_str(), Some("Config"));
        assert_eq!(v["contexts"][0]["name"].as_str(), Some("admin@demo"));
    }

    #[test]
    fn an_entry_with_the_same_name_is_replaced_only_with_force() {
        let first = kubeconfig(THEIRS, OURS, false).unwrap().text;
        let rotated = OURS.replace("S0VZ", "TkVX");
        let e = kubeconfig(&first, &rotated, false).unwrap_err().to_string();
        assert!(e.contains("user \"admin@demo\" already there"), "{e}");
        assert!(!e.contains("TkVX") && !e.contains("S0VZ"), "{e}");
        let m = kubeconfig(&first, &rotated, true).unwrap();
        assert_eq!(m.replaced, ["user \"admin@demo\""]);
        assert!(m.text.contains("TkVX") && !m.text.contains("S0VZ"));
    }

    #[test]
    fn a_broken_kubeconfig_is_refused_without_its_content() {
        let e = kubeconfig("clusters: 5\n", OURS, false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("clusters is not a list"), "{e}");
        let e = kubeconfig("- [secret-value\n", OURS, false)
            .unwrap_err()
            .to_string();
        assert!(!e.contains("secret-value"), "{e}");
    }

    const TALOS: &str = "context: demo\ncontexts:\n  demo:\n    endpoints:\n    - 10.0.0.11\n    ca: Q0E=\n    crt: Q1JU\n    key: S0VZ\n";

    #[test]
    fn a_talosconfig_merge_adds_the_context_and_keeps_the_others() {
        let theirs = "context: lab\ncontexts:\n  lab:\n    endpoints:\n    - 192.168.1.2\n";
        let m = talosconfig(theirs, TALOS, false).unwrap();
        let v: Value = serde_yaml_ng::from_str(&m.text).unwrap();
        assert_eq!(v["context"].as_str(), Some("demo"));
        assert_eq!(
            v["contexts"]["lab"]["endpoints"][0].as_str(),
            Some("192.168.1.2")
        );
        assert_eq!(v["contexts"]["demo"]["key"].as_str(), Some("S0VZ"));
        assert!(!talosconfig(&m.text, TALOS, false).unwrap().changed);
        let e = talosconfig(&m.text, &TALOS.replace("S0VZ", "TkVX"), false).unwrap_err();
        assert!(
            e.to_string().contains("context \"demo\" already there"),
            "{e}"
        );
    }
}
