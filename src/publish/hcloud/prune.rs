//! The cluster's snapshots as `imgbuild prune` sees them: which exist, and
//! which servers boot from them. A snapshot is imgbuild's when it carries
//! every label and the description imgbuild's publish writes (see
//! `snapshot_labels` and `description` in its parent), and the cluster's
//! when it also carries every label of `publish.hcloud.labels`; anything
//! else in the project is never listed, so never deleted.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

use super::api::Api;
use super::error::HcloudError;

/// One snapshot imgbuild published for the cluster.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterSnapshot {
    pub id: u64,
    pub description: String,
    pub talos_version: String,
    /// The `talos-schematic` label (the schematic's first 32 hex digits).
    pub schematic: String,
    pub arch: String,
    /// As the API writes it (RFC 3339, UTC): sorts as it reads.
    pub created: String,
    /// Bytes billed (`image_size`, GB), when the API knows it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    /// The servers (any in the project) created from it.
    pub used_by: Vec<u64>,
}

fn hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// The snapshot as imgbuild's, when its labels and description are the
/// ones imgbuild writes and it carries every one of `cluster_labels`.
fn ours(image: &Value, cluster_labels: &BTreeMap<String, String>) -> Option<ClusterSnapshot> {
    let labels = image["labels"].as_object()?;
    let label = |k: &str| labels.get(k).and_then(Value::as_str);
    let version = label("talos-version")?;
    let schematic = label("talos-schematic")?;
    let arch = label("arch")?;
    let description = image["description"].as_str()?;
    let own = image["type"] == "snapshot"
        && label("os") == Some("talos")
        && hex(schematic, 32)
        && label("image-sha256").is_some_and(|s| hex(s, 32))
        && matches!(arch, "amd64" | "arm64")
        && description
            .strip_prefix(&format!("talos {version} {arch} "))
            .is_some_and(|id| hex(id, 64) && id.starts_with(schematic))
        && cluster_labels
            .iter()
            .all(|(k, v)| label(k) == Some(v.as_str()));
    own.then(|| ClusterSnapshot {
        id: image["id"].as_u64().unwrap_or_default(),
        description: description.to_owned(),
        talos_version: version.to_owned(),
        schematic: schematic.to_owned(),
        arch: arch.to_owned(),
        created: image["created"].as_str().unwrap_or_default().to_owned(),
        size: image["image_size"]
            .as_f64()
            .map(|gb| (gb * 1e9).round() as u64),
        used_by: Vec::new(),
    })
}

/// Which servers of the project boot from which image.
fn users(api: &Api) -> Result<BTreeMap<u64, Vec<u64>>, HcloudError> {
    let mut out: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    for s in api.list("/servers", "servers", &[])? {
        if let (Some(image), Some(id)) = (
            s.pointer("/image/id").and_then(Value::as_u64),
            s["id"].as_u64(),
        ) {
            out.entry(image).or_default().push(id);
        }
    }
    Ok(out)
}

/// The cluster's snapshots (see the module), each with the servers that
/// boot from it. Only reads.
pub fn cluster_snapshots(
    api: &Api,
    cluster_labels: &BTreeMap<String, String>,
) -> Result<Vec<ClusterSnapshot>, HcloudError> {
    let used = users(api)?;
    let images = api.list(
        "/images",
        "images",
        &[
            ("type", "snapshot".into()),
            ("label_selector", "os=talos".into()),
        ],
    )?;
    Ok(images
        .iter()
        .filter_map(|i| ours(i, cluster_labels))
        .map(|mut s| {
            s.used_by = used.get(&s.id).cloned().unwrap_or_default();
            s
        })
        .collect())
}

/// Deletes one snapshot [`cluster_snapshots`] listed, after checking again
/// that no server boots from it. One already gone is done.
pub fn delete_snapshot(api: &Api, id: u64) -> Result<(), HcloudError> {
    if let Some(servers) = users(api)?.get(&id) {
        return Err(HcloudError::Remote(format!(
            "snapshot {id}: server {} now boots from it; left as it is",
            servers
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    match api.delete(&format!("/images/{id}")) {
        Ok(_) | Err(HcloudError::Api { status: 404, .. }) => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn image(labels: Value, description: &str) -> Value {
        json!({"id": 7, "type": "snapshot", "labels": labels, "description": description,
               "created": "2026-01-01T00:00:00+00:00", "image_size": 0.5})
    }

    #[test]
    fn only_snapshots_with_imgbuilds_labels_description_and_the_cluster_labels_count() {
        let schematic = "ab".repeat(32);
        let labels = json!({"os": "talos", "talos-version": "v1.11.2",
            "talos-schematic": &schematic[..32], "arch": "amd64",
            "image-sha256": "cd".repeat(16), "team": "infra"});
        let desc = format!("talos v1.11.2 amd64 {schematic}");
        let cluster = BTreeMap::from([("team".to_owned(), "infra".to_owned())]);
        let found = ours(&image(labels.clone(), &desc), &cluster).unwrap();
        assert_eq!(found.size, Some(500_000_000));
        assert_eq!(found.schematic, &schematic[..32]);
        let other_team = BTreeMap::from([("team".to_owned(), "web".to_owned())]);
        assert!(ours(&image(labels.clone(), &desc), &other_team).is_none());
        assert!(ours(&image(labels.clone(), "talos by hand"), &cluster).is_none());
        let mut no_sha = labels.clone();
        no_sha.as_object_mut().unwrap().remove("image-sha256");
        assert!(ours(&image(no_sha, &desc), &cluster).is_none());
        let mut backup = image(labels, &desc);
        backup["type"] = json!("backup");
        assert!(ours(&backup, &cluster).is_none());
    }
}
