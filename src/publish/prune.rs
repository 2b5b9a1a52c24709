//! `imgbuild prune` (and `up --allow-destroy`): what imgbuild made for the
//! cluster and nothing uses any more, planned first, then deleted.
//! - Proxmox import volumes and ISOs named by imgbuild's upload scheme for
//!   this cluster and one of its nodes (the inventory's, the VM records',
//!   or `former_nodes`), that no VM references (drives, `import-from`,
//!   cdroms, imgbuild's `imgbuild-volume` record), beyond the newest
//!   `keep` per Proxmox node, storage, content and node. One whose name is
//!   of the old scheme and could be another cluster's too is listed in
//!   [`PrunePlan::unowned`], never deleted, as is a VM whose record names
//!   the cluster but no node it could be (a malformed node name);
//! - Hetzner snapshots with imgbuild's labels and description, the
//!   cluster's `publish.hcloud.labels` and its `imgbuild-cluster` label
//!   (the whole value, as its servers carry it), that no server boots
//!   from, beyond the newest `keep` per base schematic and architecture.
//!   Those without any cluster label (published before snapshots carried
//!   one) are listed in [`PrunePlan::unowned`] and never deleted;
//! - download cache entries (`<cache>/images/<key>/`) that the out dir's
//!   `manifest.json` does not reference (its `sourceUrl`s name them): a
//!   PXE run's kernels and initramfs are not in it, so they go and are
//!   downloaded again when needed. Only folders named as the cache names
//!   them, only real folders (a symlink is never followed), and one whose
//!   download is under way (its lock held) is left.
//!
//! "Newest" counts every item of a group, used or not, so what stays is
//! what is used plus the newest `keep`. A node no longer in the inventory
//! keeps only what a VM uses.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::Cancel;
use super::hcloud::HcloudError;
use super::hcloud::prune::{ClusterSnapshot, cluster_snapshots, delete_snapshot};
use super::proxmox::ProxmoxError;
use super::proxmox::destroy::{
    DeleteOptions, StoredVolume, UnprovenVm, Uploads, cluster_machines, cluster_uploads,
    delete_volume,
};
use super::target::{HcloudTarget, ProxmoxTarget, Target};
use crate::build::Manifest;
use crate::digest::Sha256;
use crate::inventory::Inventory;

/// What a prune looks at.
pub struct PruneScope<'a> {
    pub inv: &'a Inventory,
    pub target: &'a Target,
    /// How many of the newest per group stay beside what is used.
    pub keep: usize,
    /// The download cache and the out dir whose manifest says what in it
    /// is used; None leaves the cache alone.
    pub cache: Option<CacheScope>,
    /// Nodes no longer in the inventory whose uploads are still the
    /// cluster's (a removed node's, once its VM is gone).
    pub former_nodes: Vec<String>,
    /// How Proxmox deletions wait.
    pub delete: DeleteOptions,
}

#[derive(Debug, Clone)]
pub struct CacheScope {
    pub cache_dir: PathBuf,
    pub out_dir: PathBuf,
}

/// One download cache entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CacheEntry {
    pub path: PathBuf,
    /// The URL its record names, when it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    pub size: u64,
}

/// Something prune deletes.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "camelCase")]
pub enum Item {
    ProxmoxVolume(StoredVolume),
    HcloudSnapshot(ClusterSnapshot),
    CacheEntry(CacheEntry),
    /// A VM whose record names the cluster but proves no node of it: only
    /// ever listed as unowned.
    ProxmoxVm(UnprovenVm),
}

impl Item {
    /// How a person names it.
    pub fn name(&self) -> String {
        match self {
            Item::ProxmoxVolume(v) => format!("volume {} on {}", v.volid, v.pve_node),
            Item::HcloudSnapshot(s) => format!("snapshot {} ({})", s.id, s.description),
            Item::CacheEntry(e) => format!("cache entry {}", e.path.display()),
            Item::ProxmoxVm(vm) => vm.what(),
        }
    }

    /// Its size in bytes, when known.
    pub fn size(&self) -> Option<u64> {
        match self {
            Item::ProxmoxVolume(v) => Some(v.size),
            Item::HcloudSnapshot(s) => s.size,
            Item::CacheEntry(e) => Some(e.size),
            Item::ProxmoxVm(_) => None,
        }
    }
}

/// Why an item goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "reason", rename_all = "camelCase")]
pub enum Why {
    /// Nothing references it (cache entries).
    Unreferenced,
    /// Unused, and not among the newest `keep` of its group.
    OlderThanNewest { keep: usize },
    /// Unused, and its node is no longer in the inventory.
    NodeGone,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Pruned {
    pub item: Item,
    pub why: Why,
}

/// What [`prune`] would delete; everything else the scope found stays.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PrunePlan {
    pub delete: Vec<Pruned>,
    /// How many items were found and stay (used, or among the newest).
    pub kept: usize,
    /// Found, but not provably this cluster's, so never deleted: Hetzner
    /// snapshots of imgbuild's without a cluster label, and Proxmox
    /// uploads whose old-scheme name (`<cluster>-<node>-…`) reads as this
    /// cluster's and as another's. Deleting one is the user's call.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub unowned: Vec<Item>,
}

/// What [`prune`] did.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PruneReport {
    pub deleted: Vec<Pruned>,
    /// Items that could not be deleted, with why (in use by now, an API
    /// error, a download under way).
    pub failed: Vec<(Pruned, String)>,
    /// Not tried: the run was interrupted first (a rerun deletes them).
    pub left: Vec<Pruned>,
}

/// Why a prune could not be planned.
#[derive(Debug, thiserror::Error)]
pub enum PruneError {
    #[error(transparent)]
    Proxmox(#[from] ProxmoxError),
    #[error(transparent)]
    Hcloud(#[from] HcloudError),
    #[error(transparent)]
    Manifest(#[from] crate::build::BuildError),
    #[error("cache {}: {source}", path.display())]
    Cache {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The items of each group beyond the newest `keep`, unless used; in the
/// order given. `group` names an item's group, `age` orders it (larger is
/// newer).
fn beyond_newest<T, G: Ord, A: Ord>(
    items: Vec<T>,
    keep: usize,
    group: impl Fn(&T) -> G,
    age: impl Fn(&T) -> A,
    used: impl Fn(&T) -> bool,
) -> (Vec<T>, usize) {
    let mut groups: BTreeMap<G, Vec<usize>> = BTreeMap::new();
    for (i, item) in items.iter().enumerate() {
        groups.entry(group(item)).or_default().push(i);
    }
    let mut newest = BTreeSet::new();
    for members in groups.values_mut() {
        members.sort_by(|a, b| age(&items[*b]).cmp(&age(&items[*a])));
        newest.extend(members.iter().take(keep).copied());
    }
    let (mut out, mut kept) = (Vec::new(), 0);
    for (i, item) in items.into_iter().enumerate() {
        if newest.contains(&i) || used(&item) {
            kept += 1;
        } else {
            out.push(item);
        }
    }
    (out, kept)
}

/// What a prune of `scope` would delete. Only reads.
pub fn plan(scope: &PruneScope) -> Result<PrunePlan, PruneError> {
    let mut plan = PrunePlan::default();
    let old = Why::OlderThanNewest { keep: scope.keep };
    match scope.target {
        Target::None => {}
        Target::Proxmox(t) => {
            // A node gone from the inventory keeps nothing but what a VM
            // still uses: no machine of its will be made again.
            let (uploads, unproven) = proxmox_volumes(scope, t)?;
            plan.unowned
                .extend(unproven.into_iter().map(Item::ProxmoxVm));
            plan.unowned
                .extend(uploads.ambiguous.into_iter().map(Item::ProxmoxVolume));
            let (current, former): (Vec<_>, Vec<_>) = uploads
                .ours
                .into_iter()
                .partition(|v| scope.inv.nodes.iter().any(|n| n.name == v.node));
            for (volumes, keep, why) in [(current, scope.keep, old), (former, 0, Why::NodeGone)] {
                let (volumes, kept) = beyond_newest(
                    volumes,
                    keep,
                    |v| {
                        (
                            v.pve_node.clone(),
                            v.storage.clone(),
                            v.content.clone(),
                            v.node.clone(),
                        )
                    },
                    |v| (v.ctime, v.volid.clone()),
                    |v| !v.used_by.is_empty(),
                );
                plan.kept += kept;
                plan.delete.extend(volumes.into_iter().map(|v| Pruned {
                    item: Item::ProxmoxVolume(v),
                    why,
                }));
            }
        }
        Target::Hcloud(t) => {
            let found = cluster_snapshots(&t.api()?, &scope.inv.cluster.name, &t.settings.labels)?;
            plan.unowned
                .extend(found.unowned.into_iter().map(Item::HcloudSnapshot));
            let (snapshots, kept) = beyond_newest(
                found.cluster,
                scope.keep,
                |s| (s.schematic.clone(), s.arch.clone()),
                |s| (s.created.clone(), s.id),
                |s| !s.used_by.is_empty(),
            );
            plan.kept += kept;
            plan.delete.extend(snapshots.into_iter().map(|s| Pruned {
                item: Item::HcloudSnapshot(s),
                why: old,
            }));
        }
    }
    if let Some(cache) = &scope.cache {
        let (entries, kept) = unreferenced_entries(cache)?;
        plan.kept += kept;
        plan.delete.extend(entries.into_iter().map(|e| Pruned {
            item: Item::CacheEntry(e),
            why: Why::Unreferenced,
        }));
    }
    Ok(plan)
}

/// The cluster's uploads in the target's storage, with the nodes whose
/// names count: the inventory's, the VM records', and the former ones; and
/// the VMs whose record names the cluster but proves no node.
fn proxmox_volumes(
    scope: &PruneScope,
    t: &ProxmoxTarget,
) -> Result<(Uploads, Vec<UnprovenVm>), ProxmoxError> {
    let cluster = &scope.inv.cluster.name;
    let retry = scope.delete.retry;
    let mut nodes: BTreeSet<String> = scope.inv.nodes.iter().map(|n| n.name.clone()).collect();
    nodes.extend(scope.former_nodes.iter().cloned());
    let vms = cluster_machines(&t.credentials, cluster, retry)?;
    nodes.extend(vms.ours.into_iter().map(|vm| vm.node));
    let uploads = cluster_uploads(&t.credentials, &t.settings.storage, cluster, &nodes, retry)?;
    Ok((uploads, vms.unproven))
}

/// Deletes what `plan` lists, each item checked again first (no VM or
/// server uses it, no download holds it). Resumable: an item already gone
/// is done.
pub fn prune(scope: &PruneScope, plan: &PrunePlan) -> PruneReport {
    prune_until(scope, plan, &Cancel::never())
}

/// [`prune`], stopping between items once `cancel` says so: what was not
/// tried is `left`, never half-deleted.
pub fn prune_until(scope: &PruneScope, plan: &PrunePlan, cancel: &Cancel) -> PruneReport {
    let mut report = PruneReport::default();
    for (i, p) in plan.delete.iter().enumerate() {
        if cancel.check().is_err() {
            report.left = plan.delete[i..].to_vec();
            break;
        }
        let done = match (&p.item, scope.target) {
            (Item::ProxmoxVolume(v), Target::Proxmox(t)) => {
                delete_volume(&t.credentials, v, &scope.delete).map_err(|e| e.to_string())
            }
            (Item::HcloudSnapshot(s), Target::Hcloud(t)) => {
                hcloud_delete(t, &scope.inv.cluster.name, s.id)
            }
            (Item::CacheEntry(e), _) => delete_entry(scope, e),
            _ => Err("the plan is for another target".to_owned()),
        };
        match done {
            Ok(()) => report.deleted.push(p.clone()),
            Err(e) => report.failed.push((p.clone(), e)),
        }
    }
    report
}

fn hcloud_delete(t: &HcloudTarget, cluster: &str, id: u64) -> Result<(), String> {
    let api = t.api().map_err(|e| e.to_string())?;
    delete_snapshot(&api, cluster, id).map_err(|e| e.to_string())
}

/// The name the cache gives a URL's entry (see `fetch`).
fn entry_key(url: &str) -> String {
    Sha256::of(url.as_bytes()).hex()[..32].to_owned()
}

fn is_key(name: &str) -> bool {
    name.len() == 32 && name.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// The cache entries the out dir's manifest does not reference, and how
/// many it does.
fn unreferenced_entries(cache: &CacheScope) -> Result<(Vec<CacheEntry>, usize), PruneError> {
    let used: BTreeSet<String> = Manifest::load(&cache.out_dir)?
        .images
        .values()
        .map(|i| entry_key(&i.source_url))
        .collect();
    let images = cache.cache_dir.join("images");
    let io = |source| PruneError::Cache {
        path: images.clone(),
        source,
    };
    match std::fs::symlink_metadata(&images) {
        Ok(m) if m.is_dir() => {}
        // No cache yet, or not a folder imgbuild made.
        _ => return Ok((Vec::new(), 0)),
    }
    let (mut out, mut kept) = (Vec::new(), 0);
    for e in std::fs::read_dir(&images).map_err(io)? {
        let e = e.map_err(io)?;
        let name = e.file_name().to_string_lossy().into_owned();
        let real_dir = std::fs::symlink_metadata(e.path()).is_ok_and(|m| m.is_dir());
        if !(real_dir && is_key(&name)) {
            continue;
        }
        if used.contains(&name) {
            kept += 1;
            continue;
        }
        out.push(CacheEntry {
            url: record_url(&e.path()),
            size: entry_size(&e.path()),
            path: e.path(),
        });
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok((out, kept))
}

/// The URL an entry's record names.
fn record_url(entry: &Path) -> Option<String> {
    let text = crate::input::read_text(&entry.join("artifact.json"), 1 << 16).ok()?;
    let doc: serde_json::Value = serde_json::from_str(&text).ok()?;
    doc["url"].as_str().map(str::to_owned)
}

/// The bytes of an entry's own files (no link followed).
fn entry_size(entry: &Path) -> u64 {
    std::fs::read_dir(entry)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|f| std::fs::symlink_metadata(f.path()).ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum()
}

/// Deletes one cache entry under its lock, taken without waiting: a
/// download under way keeps it. Checked again to be inside the cache,
/// a real folder, and unreferenced.
fn delete_entry(scope: &PruneScope, entry: &CacheEntry) -> Result<(), String> {
    let Some(cache) = &scope.cache else {
        return Err("no cache in this prune".into());
    };
    let images = cache.cache_dir.join("images");
    let name = entry
        .path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("");
    if entry.path.parent() != Some(images.as_path()) || !is_key(name) {
        return Err("not an entry of the cache".into());
    }
    match std::fs::symlink_metadata(&entry.path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e.to_string()),
        Ok(m) if !m.is_dir() => return Err("not a folder".into()),
        Ok(_) => {}
    }
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(entry.path.join(".lock"))
        .map_err(|e| e.to_string())?;
    // Released when `lock` closes (flock(2) on Linux, as the download's
    // atomic::lock takes it).
    match lock.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            return Err("a download of it is under way".into());
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(e.to_string()),
    }
    let used = Manifest::load(&cache.out_dir)
        .map_err(|e| e.to_string())?
        .images
        .values()
        .any(|i| entry_key(&i.source_url) == name);
    if used {
        return Err("the manifest references it by now".into());
    }
    // remove_dir_all removes links, never what they point to.
    std::fs::remove_dir_all(&entry.path).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_used_and_the_newest_per_group_stay() {
        // (group, age, used)
        let items = vec![
            ("cp-01", 1, true),
            ("cp-01", 2, false),
            ("cp-01", 3, false),
            ("cp-02", 1, false),
            ("cp-02", 2, false),
        ];
        let (gone, kept) = beyond_newest(items.clone(), 1, |i| i.0, |i| i.1, |i| i.2);
        assert_eq!(gone, [("cp-01", 2, false), ("cp-02", 1, false)]);
        assert_eq!(kept, 3);
        let (gone, kept) = beyond_newest(items.clone(), 0, |i| i.0, |i| i.1, |i| i.2);
        assert_eq!(gone.len(), 4);
        assert_eq!(kept, 1);
        let (gone, _) = beyond_newest(items, 5, |i| i.0, |i| i.1, |i| i.2);
        assert!(gone.is_empty());
    }

    #[test]
    fn the_cache_keeps_what_the_manifest_names_and_follows_no_link() {
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join("cache");
        let out = dir.path().join("out");
        let images = cache.join("images");
        std::fs::create_dir_all(&out).unwrap();
        let url = "http://127.0.0.1:1/image/abc/v1.11.2/metal-amd64.raw.zst";
        let manifest = serde_json::json!({"images": {"cp-01": {
            "node": "cp-01", "route": "patch", "schematicId": "a".repeat(64),
            "talosVersion": "v1.11.2", "platform": "metal", "arch": "amd64", "format": "raw",
            "size": 1, "sha256": "b".repeat(64), "path": "cp-01.raw", "sourceUrl": url}}});
        std::fs::write(out.join("manifest.json"), manifest.to_string()).unwrap();
        let used = images.join(entry_key(url));
        let old = images.join(entry_key("http://127.0.0.1:1/old.raw.zst"));
        for d in [&used, &old] {
            std::fs::create_dir_all(d).unwrap();
            std::fs::write(d.join("image.raw"), b"12345").unwrap();
        }
        // A link out of the cache, and names the cache never writes.
        let outside = dir.path().join("precious");
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("keep"), b"x").unwrap();
        std::os::unix::fs::symlink(&outside, images.join("c".repeat(32))).unwrap();
        std::os::unix::fs::symlink(&outside, old.join("link")).unwrap();
        std::fs::create_dir_all(images.join("notes")).unwrap();
        let scope = CacheScope {
            cache_dir: cache.clone(),
            out_dir: out,
        };
        let (entries, kept) = unreferenced_entries(&scope).unwrap();
        assert_eq!(kept, 1);
        assert_eq!(entries.len(), 1, "{entries:?}");
        assert_eq!(entries[0].path, old);
        assert_eq!(entries[0].size, 5);
        let inv = Inventory::load(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/loopback/cluster.yaml"),
        )
        .unwrap();
        let prune_scope = PruneScope {
            inv: &inv,
            target: &Target::None,
            keep: 1,
            cache: Some(scope),
            former_nodes: Vec::new(),
            delete: DeleteOptions::default(),
        };
        let p = plan(&prune_scope).unwrap();
        let report = prune(&prune_scope, &p);
        assert_eq!(report.deleted.len(), 1, "{report:?}");
        assert!(!old.exists() && used.join("image.raw").exists());
        assert!(outside.join("keep").exists());
        assert!(images.join("notes").exists());
        // A rerun finds nothing more.
        assert!(plan(&prune_scope).unwrap().delete.is_empty());
    }
}
