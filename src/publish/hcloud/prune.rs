//! The cluster's snapshots as `imgbuild prune` sees them: which exist, and
//! which servers boot from them. A snapshot is imgbuild's when it carries
//! every label and the description imgbuild's publish writes (see
//! `snapshot_labels` and `description` in its parent), and the cluster's
//! when it also carries every label of `publish.hcloud.labels` and the
//! cluster's own label (`imgbuild-cluster=<cluster>`, the label its servers
//! carry: a label value is compared whole, so no two cluster names claim
//! the same snapshot, whatever text they share). One of imgbuild's that
//! carries no cluster label (published before snapshots had one) is
//! anybody's: listed, never deleted. Anything else in the project is never
//! listed, so never deleted.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

use super::api::Api;
use super::error::HcloudError;
use super::types::CLUSTER_LABEL;

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

/// Whose a snapshot of imgbuild's is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Owner {
    /// It carries this cluster's label.
    Cluster,
    /// It carries no cluster label: published before snapshots had one,
    /// by this cluster or any other.
    Unknown,
}

/// The snapshot as imgbuild's, when its labels and description are the
/// ones imgbuild writes, it carries every one of `wanted` (the inventory's
/// `publish.hcloud.labels`), and its cluster label is `cluster`'s or
/// missing; with which of the two.
fn ours(
    image: &Value,
    cluster: &str,
    wanted: &BTreeMap<String, String>,
) -> Option<(Owner, ClusterSnapshot)> {
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
        && wanted
            .iter()
            .filter(|(k, _)| k.as_str() != CLUSTER_LABEL)
            .all(|(k, v)| label(k) == Some(v.as_str()));
    let owner = match label(CLUSTER_LABEL) {
        None => Owner::Unknown,
        Some(c) if c == cluster => Owner::Cluster,
        // Another cluster's: never this one's to list or delete.
        Some(_) => return None,
    };
    own.then(|| {
        (
            owner,
            ClusterSnapshot {
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
            },
        )
    })
}

/// A snapshot's labels that are text.
fn labels_of(image: &Value) -> BTreeMap<&str, &str> {
    image["labels"]
        .as_object()
        .into_iter()
        .flatten()
        .filter_map(|(k, v)| Some((k.as_str(), v.as_str()?)))
        .collect()
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

/// The snapshots [`cluster_snapshots`] finds.
#[derive(Debug, Clone, Default)]
pub struct Snapshots {
    /// Carrying the cluster's label: the only ones prune may delete.
    pub cluster: Vec<ClusterSnapshot>,
    /// imgbuild's, with the cluster's `publish.hcloud.labels`, but no
    /// cluster label at all: whose they are cannot be proven, so they are
    /// only listed.
    pub unowned: Vec<ClusterSnapshot>,
}

/// The cluster's snapshots and those of no known cluster (see the module),
/// each with the servers that boot from it. Only reads.
pub fn cluster_snapshots(
    api: &Api,
    cluster: &str,
    labels: &BTreeMap<String, String>,
) -> Result<Snapshots, HcloudError> {
    let used = users(api)?;
    let images = api.list(
        "/images",
        "images",
        &[
            ("type", "snapshot".into()),
            ("label_selector", "os=talos".into()),
        ],
    )?;
    let mut out = Snapshots::default();
    for (owner, mut s) in images.iter().filter_map(|i| ours(i, cluster, labels)) {
        s.used_by = used.get(&s.id).cloned().unwrap_or_default();
        match owner {
            Owner::Cluster => out.cluster.push(s),
            Owner::Unknown => out.unowned.push(s),
        }
    }
    Ok(out)
}

/// Deletes one snapshot [`cluster_snapshots`] listed as `cluster`'s, after
/// checking again that it still carries `cluster`'s label and that no
/// server boots from it. One already gone is done.
pub fn delete_snapshot(api: &Api, cluster: &str, id: u64) -> Result<(), HcloudError> {
    let path = format!("/images/{id}");
    let image = match api.get(&path, &[]) {
        Ok(reply) => reply["image"].clone(),
        Err(HcloudError::Api { status: 404, .. }) => return Ok(()),
        Err(e) => return Err(e),
    };
    let labels = labels_of(&image);
    let label = labels.get(CLUSTER_LABEL).copied();
    if label != Some(cluster) {
        return Err(HcloudError::Remote(format!(
            "snapshot {id}: its {CLUSTER_LABEL} label is {} now, not {cluster:?}; left as it is",
            label.map_or("gone".to_owned(), |l| format!("{l:?}"))
        )));
    }
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
    match api.delete(&path) {
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
        let mut mine = labels.clone();
        mine[CLUSTER_LABEL] = json!("a");
        let (owner, found) = ours(&image(mine.clone(), &desc), "a", &cluster).unwrap();
        assert_eq!(owner, Owner::Cluster);
        assert_eq!(found.size, Some(500_000_000));
        assert_eq!(found.schematic, &schematic[..32]);
        // Another cluster's, even one whose name starts the same: not listed.
        for name in ["a-b", "b", "a "] {
            let mut theirs = labels.clone();
            theirs[CLUSTER_LABEL] = json!(name);
            assert!(
                ours(&image(theirs, &desc), "a", &cluster).is_none(),
                "{name}"
            );
        }
        // None at all (published before the label): listed as nobody's.
        let (owner, _) = ours(&image(labels.clone(), &desc), "a", &cluster).unwrap();
        assert_eq!(owner, Owner::Unknown);
        let other_team = BTreeMap::from([("team".to_owned(), "web".to_owned())]);
        assert!(ours(&image(mine.clone(), &desc), "a", &other_team).is_none());
        assert!(ours(&image(mine.clone(), "talos by hand"), "a", &cluster).is_none());
        let mut no_sha = mine.clone();
        no_sha.as_object_mut().unwrap().remove("image-sha256");
        assert!(ours(&image(no_sha, &desc), "a", &cluster).is_none());
        let mut backup = image(mine, &desc);
        backup["type"] = json!("backup");
        assert!(ours(&backup, "a", &cluster).is_none());
    }
}
