//! SSH keys (docs.hetzner.cloud "SSH Keys"): listing and creating, with the
//! fingerprint hcloud computes (MD5 of the key blob).

use super::labels;
use super::query::*;
use super::state::*;
use serde_json::{Value, json};

pub(crate) fn ssh_key_json(k: &SshKey) -> Value {
    json!({"id": k.id, "name": k.name, "fingerprint": k.fingerprint,
        "public_key": k.public_key, "labels": k.labels, "created": iso(k.created)})
}

pub(crate) fn list_ssh_keys(sim: &Sim, q: &Query) -> Answer {
    let w = sim.world.lock().unwrap();
    list_matching(
        q,
        "ssh_keys",
        &["id", "name"],
        w.ssh_keys.values(),
        |k| (Some(&k.name), &k.labels),
        |k| q.one("fingerprint").is_none_or(|f| f == k.fingerprint),
        ssh_key_json,
    )
}

pub(crate) fn body_labels(body: &Value) -> Result<Labels, ApiError> {
    let labels: Labels = serde_json::from_value(body["labels"].clone()).unwrap_or_default();
    labels::check_labels(&labels).map_err(|m| field_error("labels", m))?;
    Ok(labels)
}

/// The MD5 fingerprint the API shows, from `ssh-keygen` (which also
/// refuses what is not a public key, as the API does).
pub(crate) fn fingerprint(public_key: &str) -> Option<String> {
    use std::io::Write;
    let mut child = std::process::Command::new("ssh-keygen")
        .args(["-l", "-E", "md5", "-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    child.stdin.take()?.write_all(public_key.as_bytes()).ok()?;
    let out = child.wait_with_output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let fp = text.split_whitespace().nth(1)?.strip_prefix("MD5:")?;
    out.status.success().then(|| fp.to_owned())
}

pub(crate) fn create_ssh_key(sim: &Sim, body: Value) -> Answer {
    let name = body["name"].as_str().unwrap_or_default().to_owned();
    let public_key = body["public_key"]
        .as_str()
        .unwrap_or_default()
        .trim()
        .to_owned();
    let labels = body_labels(&body)?;
    let fingerprint =
        fingerprint(&public_key).ok_or_else(|| field_error("public_key", "invalid public key"))?;
    let mut w = sim.world.lock().unwrap();
    for k in w.ssh_keys.values() {
        if k.name == name {
            return Err(err(409, "uniqueness_error", "name is already used"));
        }
        if k.fingerprint == fingerprint {
            return Err(err(
                409,
                "uniqueness_error",
                "SSH key with the same fingerprint already exists",
            ));
        }
    }
    let id = w.id();
    let key = SshKey {
        id,
        name,
        public_key,
        fingerprint,
        labels,
        created: now(),
    };
    let v = ssh_key_json(&key);
    w.ssh_keys.insert(id, key);
    Ok((201, json!({ "ssh_key": v })))
}
