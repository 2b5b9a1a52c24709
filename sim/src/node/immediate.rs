//! `CanApplyImmediate` of Talos v1.9 to v1.13 (siderolabs/talos
//! `internal/app/machined/pkg/runtime/v1alpha1/v1alpha1_runtime.go`, the
//! same list in every release from v1.9.0 to v1.13.x): the new v1alpha1
//! document, with the fields a running node can take over copied from the
//! current one, must equal the current one. Other documents are not looked at.

use serde_json::{Map, Value};

/// `.machine` fields that apply without a reboot.
const MACHINE: [&str; 18] = [
    "ca",
    "acceptedCAs",
    "time",
    "certSANs",
    "install",
    "network",
    "sysfs",
    "sysctls",
    "logging",
    "controlplane",
    "kubelet",
    "kernel",
    "registries",
    "pods",
    "seccompProfiles",
    "nodeAnnotations",
    "nodeLabels",
    "nodeTaints",
];

/// `.machine.features` fields that apply without a reboot (copied only when
/// both configs have `features`, as upstream does).
const FEATURES: [&str; 5] = [
    "kubernetesTalosAPIAccess",
    "kubePrism",
    "hostDNS",
    "imageCache",
    "nodeAddressSortAlgorithm",
];

/// Sets `key` in `to` to what `from` has (absent stays absent).
fn take(to: &mut Map<String, Value>, from: &Map<String, Value>, key: &str) {
    match from.get(key) {
        Some(v) => to.insert(key.to_owned(), v.clone()),
        None => to.remove(key),
    };
}

/// None when `new` may replace `current` without a reboot, else the
/// v1alpha1 fields that stop it (dotted paths, for the error's diff).
pub(crate) fn blocking_fields(current: &Value, new: &Value) -> Option<Vec<String>> {
    let (Some(cur), Some(new)) = (current.as_object(), new.as_object()) else {
        return Some(vec![".".into()]);
    };
    let mut masked = new.clone();
    take(&mut masked, cur, "debug");
    take(&mut masked, cur, "cluster");
    if let (Some(Value::Object(nm)), Some(Value::Object(cm))) =
        (masked.get_mut("machine"), cur.get("machine"))
    {
        for key in MACHINE {
            take(nm, cm, key);
        }
        if let (Some(Value::Object(nf)), Some(Value::Object(cf))) =
            (nm.get_mut("features"), cm.get("features"))
        {
            for key in FEATURES {
                take(nf, cf, key);
            }
        }
    }
    if &masked == cur {
        return None;
    }
    let mut paths = Vec::new();
    differing(
        &Value::Object(cur.clone()),
        &Value::Object(masked),
        "",
        &mut paths,
    );
    Some(paths)
}

/// The dotted paths where `a` and `b` differ, down to the first
/// non-mapping value.
fn differing(a: &Value, b: &Value, at: &str, out: &mut Vec<String>) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
            keys.sort();
            keys.dedup();
            for k in keys {
                let (va, vb) = (
                    x.get(k).unwrap_or(&Value::Null),
                    y.get(k).unwrap_or(&Value::Null),
                );
                if va != vb {
                    differing(va, vb, &format!("{at}.{k}"), out);
                }
            }
        }
        _ => out.push(at.to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn files_env_and_udev_need_a_reboot_sysctls_and_the_cluster_do_not() {
        let cur = json!({"version": "v1alpha1", "machine": {"type": "worker", "sysctls": {"a": "1"},
            "features": {"kubePrism": {"enabled": true}}}, "cluster": {"clusterName": "a"}});
        let mut new = cur.clone();
        new["machine"]["sysctls"]["b"] = json!("2");
        new["cluster"]["clusterName"] = json!("b");
        new["machine"]["features"]["kubePrism"]["port"] = json!(7445);
        new["debug"] = json!(true);
        assert_eq!(blocking_fields(&cur, &new), None);
        for (key, value) in [
            (
                "files",
                json!([{"path": "/var/f", "content": "x", "op": "create"}]),
            ),
            ("env", json!({"A": "b"})),
            ("udev", json!({"rules": ["x"]})),
        ] {
            let mut changed = new.clone();
            changed["machine"][key] = value;
            assert_eq!(
                blocking_fields(&cur, &changed),
                Some(vec![format!(".machine.{key}")])
            );
        }
        let mut features = cur.clone();
        features["machine"]["features"]["rbac"] = json!(true);
        assert_eq!(
            blocking_fields(&cur, &features),
            Some(vec![".machine.features.rbac".to_owned()])
        );
    }
}
