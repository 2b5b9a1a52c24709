//! Deleting what imgbuild made on Proxmox VE for one cluster, and nothing
//! else: its VMs, found on every Proxmox node by the record imgbuild writes
//! into their descriptions (cluster and node; a name proves nothing), and
//! the import volumes and ISOs its uploads named by its own scheme.
//! Facts: proxmox/qemu-server `src/PVE/API2/Qemu.pm` `destroy_vm` (refuses
//! a running VM; `purge` drops the vmid from backup and replication jobs
//! and HA; `destroy-unreferenced-disks` frees every `vm-<vmid>-…` volume of
//! the enabled storages) and `src/PVE/QemuServer.pm` `destroy_vm` (frees
//! only the volumes the VM owns, skips cdroms, and merely warns when a
//! volume cannot be freed: hence the check afterwards);
//! proxmox/pve-storage `src/PVE/API2/Storage/Content.pm` `delete` (frees a
//! volume whether or not a VM uses it: the caller must check).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde::Serialize;
use serde_json::Value;

use super::api::{Api, urlencode};
use super::credentials::Credentials;
use super::error::ProxmoxError;
use super::types::PublishOptions;
use super::vm::{MANAGED, described, drive_volume, listed_id};
use crate::net::RetryPolicy;

/// One VM imgbuild made for a node of the cluster, as its record says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterVm {
    pub vmid: u32,
    /// The Proxmox node it is on.
    pub pve_node: String,
    /// The VM's name.
    pub name: String,
    /// The inventory node it was made for (`imgbuild-node:`), which may be
    /// gone from the inventory.
    pub node: String,
    pub running: bool,
    /// The volumes it owns (named for its vmid): deleting it frees them.
    pub disks: Vec<String>,
}

/// How patient a deletion is.
#[derive(Debug, Clone)]
pub struct DeleteOptions {
    /// How long a running VM is given to shut down (ACPI) before it is
    /// stopped hard.
    pub shutdown_timeout: Duration,
    /// How often tasks are polled.
    pub poll: Duration,
    /// The longest one task (stop, destroy, volume delete) may run.
    pub task_timeout: Duration,
    pub retry: RetryPolicy,
}

impl Default for DeleteOptions {
    fn default() -> Self {
        DeleteOptions {
            shutdown_timeout: Duration::from_secs(120),
            poll: Duration::from_millis(500),
            task_timeout: Duration::from_secs(600),
            retry: RetryPolicy::default(),
        }
    }
}

impl DeleteOptions {
    /// The API's view of these options (its task waits read them).
    fn publish(&self) -> PublishOptions {
        PublishOptions {
            poll: self.poll,
            task_timeout: self.task_timeout,
            retry: self.retry,
            ..PublishOptions::default()
        }
    }

    fn with_deadline(&self, task_timeout: Duration) -> PublishOptions {
        PublishOptions {
            task_timeout,
            ..self.publish()
        }
    }
}

/// How a VM was brought to a stop before it was destroyed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Stopped {
    /// It was not running.
    Already,
    /// It shut down within the deadline.
    Shutdown,
    /// It did not, and was stopped hard.
    Hard,
}

/// What [`delete_vm`] did.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct VmDeleted {
    pub vmid: u32,
    pub node: String,
    /// True when the VM was gone already (a rerun after a kill).
    pub already_gone: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stopped: Option<Stopped>,
    /// The volumes it owned, checked gone afterwards.
    pub volumes: Vec<String>,
}

/// A VM as the cluster lists it, with its config.
pub(super) struct Listed {
    pub(super) vmid: u32,
    pub(super) pve_node: String,
    pub(super) name: String,
    pub(super) running: bool,
    pub(super) config: Value,
}

/// Every QEMU VM of the Proxmox cluster, on every node, with its config
/// (`GET /cluster/resources?type=vm`, then each config from its node).
pub(super) fn all_vms(api: &Api) -> Result<Vec<Listed>, ProxmoxError> {
    let listed = api.get("listing the cluster's VMs", "/cluster/resources?type=vm")?;
    let mut out = Vec::new();
    for v in listed.as_array().into_iter().flatten() {
        // Containers (`lxc`) are never imgbuild's and hold no VM drives.
        if v["type"] != "qemu" {
            continue;
        }
        let (Some(vmid), Some(pve_node)) = (listed_id(v), v["node"].as_str()) else {
            continue;
        };
        let config = match api.get(
            "reading VM config",
            &format!("/nodes/{pve_node}/qemu/{vmid}/config"),
        ) {
            Ok(c) => c,
            // Deleted between the listing and now.
            Err(e) if gone(&e) => continue,
            Err(e) => return Err(e),
        };
        out.push(Listed {
            vmid,
            pve_node: pve_node.to_owned(),
            name: v["name"].as_str().unwrap_or_default().to_owned(),
            running: v["status"] == "running",
            config,
        });
    }
    Ok(out)
}

/// Whose a VM is, by the record imgbuild writes into its description.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Record {
    /// imgbuild made it for this node of the cluster.
    Node(String),
    /// The record says imgbuild made it for the cluster, but not for a
    /// node it could have made it for (a node name that is no node name,
    /// none, or two records that disagree): not provably the cluster's
    /// node, so never changed or deleted, only listed with this reason.
    Unproven(String),
    /// Not the cluster's (by hand, Terraform, an imgbuild older than the
    /// record, another cluster).
    NotOurs,
}

/// Every value of one `imgbuild-<key>: ` line of a description.
fn described_all(description: &str, key: &str) -> BTreeSet<String> {
    let prefix = format!("imgbuild-{key}: ");
    description
        .lines()
        .filter_map(|l| l.strip_prefix(prefix.as_str()))
        .map(str::to_owned)
        .collect()
}

/// Reads a config's record: the managed line and both `imgbuild-cluster`
/// and `imgbuild-node` must be there, each once (or repeated alike), the
/// cluster's name exactly and a node name as the inventory takes it.
pub(super) fn record(config: &Value, cluster: &str) -> Record {
    let Some(d) = config["description"].as_str() else {
        return Record::NotOurs;
    };
    if !d.lines().any(|l| l.trim_end() == MANAGED) {
        return Record::NotOurs;
    }
    let clusters = described_all(d, "cluster");
    if !clusters.contains(cluster) {
        return Record::NotOurs;
    }
    if clusters.len() > 1 {
        return Record::Unproven("its description names more than one cluster".into());
    }
    let nodes = described_all(d, "node");
    let mut nodes = nodes.into_iter();
    match (nodes.next(), nodes.next()) {
        (None, _) => Record::Unproven("its description names no node".into()),
        (Some(_), Some(_)) => Record::Unproven("its description names more than one node".into()),
        (Some(n), None) if crate::inventory::is_node_name(&n) => Record::Node(n),
        (Some(_), None) => Record::Unproven(
            "its description's node name is not a node name (a lowercase DNS label)".into(),
        ),
    }
}

/// The node a config's record says imgbuild made the VM for, when it says
/// imgbuild made it for `cluster` (see [`record`]). A VM without the
/// record (by hand, Terraform, an imgbuild older than the record, another
/// cluster), or with one that proves no node, is never this cluster's,
/// whatever its name.
pub(super) fn recorded_node(config: &Value, cluster: &str) -> Option<String> {
    match record(config, cluster) {
        Record::Node(n) => Some(n),
        _ => None,
    }
}

/// The vmid a volume is named for (`vm-<vmid>-…`, `base-<vmid>-…`, with or
/// without a `<vmid>/` folder): the VM that owns it, as pve-storage's
/// `parse_volname` reads it.
pub(super) fn volume_owner(volid: &str) -> Option<u32> {
    let name = volid.split_once(':').map_or(volid, |(_, n)| n);
    if name.starts_with("import/") || name.starts_with("iso/") {
        return None;
    }
    let name = name.rsplit('/').next().unwrap_or(name);
    let rest = name
        .strip_prefix("vm-")
        .or_else(|| name.strip_prefix("base-"))?;
    let (id, _) = rest.split_once('-')?;
    id.parse().ok()
}

/// The config keys that hold a volume (qemu-server's drive keys and parked
/// `unusedN`).
fn is_volume_key(key: &str) -> bool {
    let bus = key.trim_end_matches(|c: char| c.is_ascii_digit());
    bus.len() < key.len()
        && matches!(
            bus,
            "ide" | "sata" | "scsi" | "virtio" | "efidisk" | "tpmstate" | "unused"
        )
}

/// Every volume a config references: each drive's volume, a drive's
/// `import-from=` source, and (for VMs imgbuild made) the import volume its
/// record says it was made from, which a recreate or `--replace-disk`
/// would import again.
pub(super) fn referenced(config: &Value) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (k, v) in config.as_object().into_iter().flatten() {
        let Some(drive) = v.as_str().filter(|_| is_volume_key(k)) else {
            continue;
        };
        out.insert(drive_volume(drive).to_owned());
        for opt in drive.split(',').skip(1) {
            if let Some(src) = opt.strip_prefix("import-from=") {
                out.insert(src.to_owned());
            }
        }
    }
    if let Some(v) = described(config, "volume") {
        out.insert(v);
    }
    out
}

fn owned_disks(config: &Value, vmid: u32) -> Vec<String> {
    let mut disks: Vec<String> = config
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(k, _)| is_volume_key(k))
        .filter_map(|(_, v)| v.as_str())
        .filter(|d| !d.split(',').any(|o| o == "media=cdrom"))
        .map(|d| drive_volume(d).to_owned())
        .filter(|v| volume_owner(v) == Some(vmid))
        .collect();
    disks.sort();
    disks.dedup();
    disks
}

/// A VM whose description carries imgbuild's record for the cluster but
/// proves no node of it (see [`Record::Unproven`]): listed, never changed
/// or deleted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct UnprovenVm {
    pub vmid: u32,
    /// The Proxmox node it is on.
    pub pve_node: String,
    /// The VM's name.
    pub name: String,
    /// Why it is not provably the cluster's.
    pub reason: String,
}

impl UnprovenVm {
    /// How a person names it.
    pub fn what(&self) -> String {
        format!("VM {} on {} ({})", self.vmid, self.pve_node, self.reason)
    }
}

/// What [`cluster_machines`] finds.
#[derive(Debug, Clone, Default)]
pub struct ClusterVms {
    /// Made by imgbuild for a node of the cluster.
    pub ours: Vec<ClusterVm>,
    /// Carrying the cluster's record but proving no node.
    pub unproven: Vec<UnprovenVm>,
}

/// The VMs imgbuild made for `cluster`, on every Proxmox node, by their
/// record (see [`recorded_node`]). Only reads.
pub fn cluster_vms(
    creds: &Credentials,
    cluster: &str,
    retry: RetryPolicy,
) -> Result<Vec<ClusterVm>, ProxmoxError> {
    Ok(cluster_machines(creds, cluster, retry)?.ours)
}

/// [`cluster_vms`], and the VMs whose record names the cluster but proves
/// no node of it. Only reads.
pub fn cluster_machines(
    creds: &Credentials,
    cluster: &str,
    retry: RetryPolicy,
) -> Result<ClusterVms, ProxmoxError> {
    let api = Api::new(creds, retry)?;
    let mut out = ClusterVms::default();
    for l in all_vms(&api)? {
        match record(&l.config, cluster) {
            Record::Node(node) => out.ours.push(ClusterVm {
                disks: owned_disks(&l.config, l.vmid),
                vmid: l.vmid,
                pve_node: l.pve_node,
                name: l.name,
                node,
                running: l.running,
            }),
            Record::Unproven(reason) => out.unproven.push(UnprovenVm {
                vmid: l.vmid,
                pve_node: l.pve_node,
                name: l.name,
                reason,
            }),
            Record::NotOurs => {}
        }
    }
    Ok(out)
}

/// Whether a reply says the VM (or volume) does not exist.
fn gone(e: &ProxmoxError) -> bool {
    matches!(e, ProxmoxError::Api { message, .. } if message.contains("does not exist"))
}

/// Where VM `vmid` is now, if anywhere: it may have moved since it was
/// listed.
fn locate(api: &Api, vmid: u32) -> Result<Option<(String, bool)>, ProxmoxError> {
    let listed = api.get("listing the cluster's VMs", "/cluster/resources?type=vm")?;
    Ok(listed
        .as_array()
        .into_iter()
        .flatten()
        .find(|v| v["type"] == "qemu" && listed_id(v) == Some(vmid))
        .and_then(|v| Some((v["node"].as_str()?.to_owned(), v["status"] == "running"))))
}

/// Deletes one VM imgbuild made for `cluster`: stopped (an ACPI shutdown,
/// then a hard stop once `opts.shutdown_timeout` has passed), destroyed
/// with `purge` and `destroy-unreferenced-disks`, its task waited for, and
/// its volumes checked gone. Its record is read again first, so a vmid
/// that now holds another VM is refused. A VM already gone is done
/// (`already_gone`): a rerun after a kill converges.
pub fn delete_vm(
    creds: &Credentials,
    cluster: &str,
    vm: &ClusterVm,
    opts: &DeleteOptions,
) -> Result<VmDeleted, ProxmoxError> {
    let api = Api::new(creds, opts.retry)?;
    let vmid = vm.vmid;
    let mut out = VmDeleted {
        vmid,
        node: vm.node.clone(),
        already_gone: false,
        stopped: None,
        volumes: Vec::new(),
    };
    let Some((pve, running)) = locate(&api, vmid)? else {
        out.already_gone = true;
        return Ok(out);
    };
    let base = format!("/nodes/{pve}/qemu/{vmid}");
    let config = match api.get("reading VM config", &format!("{base}/config")) {
        Ok(c) => c,
        Err(e) if gone(&e) => {
            out.already_gone = true;
            return Ok(out);
        }
        Err(e) => return Err(e),
    };
    if recorded_node(&config, cluster).as_deref() != Some(vm.node.as_str()) {
        return Err(ProxmoxError::Api {
            what: format!("deleting VM {vmid}"),
            message: format!(
                "its description no longer says imgbuild made it for node {:?} of cluster {cluster:?}; left as it is",
                vm.node
            ),
        });
    }
    out.volumes = owned_disks(&config, vmid);
    out.stopped = Some(stop(&api, &base, vmid, running, opts)?);
    let destroyed = api.delete(
        &format!("destroying VM {vmid}"),
        &format!("{base}?purge=1&destroy-unreferenced-disks=1"),
    );
    match destroyed {
        Ok(task) => api.wait(&format!("destroying VM {vmid}"), &task, &opts.publish())?,
        Err(e) if gone(&e) => out.already_gone = true,
        Err(e) => return Err(e),
    }
    confirm_gone(&api, &pve, vmid, &out.volumes)?;
    Ok(out)
}

/// Brings a VM to a stop: a shutdown with the deadline, then a hard stop
/// if it is still running. qemu-server refuses to destroy a running VM.
fn stop(
    api: &Api,
    base: &str,
    vmid: u32,
    running: bool,
    opts: &DeleteOptions,
) -> Result<Stopped, ProxmoxError> {
    if !running && !is_running(api, base)? {
        return Ok(Stopped::Already);
    }
    let secs = opts.shutdown_timeout.as_secs().max(1);
    let shutdown = api
        .post(
            "shutting the VM down",
            &format!("{base}/status/shutdown"),
            &[("timeout", secs.to_string())],
        )
        .and_then(|task| {
            // The task ends by itself at its timeout; a little slack for
            // the API around it.
            let deadline = opts.shutdown_timeout + Duration::from_secs(30);
            api.wait(
                &format!("shutting VM {vmid} down"),
                &task,
                &opts.with_deadline(deadline),
            )
        });
    if shutdown.is_ok() && !is_running(api, base)? {
        return Ok(Stopped::Shutdown);
    }
    let task = api.post("stopping VM", &format!("{base}/status/stop"), &[])?;
    api.wait(&format!("stopping VM {vmid}"), &task, &opts.publish())?;
    if is_running(api, base)? {
        return Err(ProxmoxError::Api {
            what: format!("stopping VM {vmid}"),
            message: "it still runs after a hard stop".into(),
        });
    }
    Ok(Stopped::Hard)
}

fn is_running(api: &Api, base: &str) -> Result<bool, ProxmoxError> {
    let st = api.get("reading the VM's status", &format!("{base}/status/current"))?;
    Ok(st["status"] == "running")
}

/// After the destroy task: the VM is no longer listed, and none of the
/// volumes it owned is left (qemu-server only warns when it cannot free
/// one, and the task still ends OK).
fn confirm_gone(api: &Api, pve: &str, vmid: u32, volumes: &[String]) -> Result<(), ProxmoxError> {
    if locate(api, vmid)?.is_some() {
        return Err(ProxmoxError::Api {
            what: format!("destroying VM {vmid}"),
            message: "the task ended but the VM is still listed".into(),
        });
    }
    let storages: BTreeSet<&str> = volumes
        .iter()
        .filter_map(|v| v.split_once(':').map(|(s, _)| s))
        .collect();
    let mut left = Vec::new();
    for storage in storages {
        let listed = api.get(
            "listing the VM's volumes",
            &format!("/nodes/{pve}/storage/{storage}/content?vmid={vmid}"),
        )?;
        left.extend(
            listed
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|v| v["volid"].as_str())
                .filter(|v| volume_owner(v) == Some(vmid))
                .map(str::to_owned),
        );
    }
    if left.is_empty() {
        Ok(())
    } else {
        Err(ProxmoxError::Api {
            what: format!("destroying VM {vmid}"),
            message: format!(
                "the VM is gone but Proxmox could not free {} (see the task log); delete it under the storage's content",
                left.join(", ")
            ),
        })
    }
}

/// One import volume or ISO an imgbuild upload made for the cluster, as
/// its name proves (`<cluster>_<node>-<talos>-<sha12>.<ext>`, see
/// [`super::volume_file`], or an older name only one cluster and node can
/// have written: see [`claim_upload`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StoredVolume {
    /// The Proxmox node it was listed on (the first one, for a shared
    /// storage).
    pub pve_node: String,
    pub storage: String,
    pub volid: String,
    /// `import` or `iso`.
    pub content: String,
    /// The inventory node its name holds.
    pub node: String,
    pub talos_version: String,
    pub size: u64,
    /// When it was stored, in unix seconds (the storage's `ctime`).
    pub ctime: u64,
    /// The VMs (any VM of the Proxmox cluster) whose config references it.
    pub used_by: Vec<u32>,
}

/// How a stored file name relates to the cluster.
#[derive(Debug, PartialEq, Eq)]
enum Claim {
    /// Provably the cluster's upload for the node, at the Talos version.
    Ours(String, String),
    /// A name of the old scheme that reads as the cluster's for the node,
    /// and as another cluster's too: nobody's to delete.
    Ambiguous(String, String),
}

/// Reads a stored file name as imgbuild's upload scheme writes it for
/// `cluster` and one of `nodes`: the node and the Talos version, as a
/// [`Claim`], or None for any other name.
///
/// `<cluster>_<node>-<talos>-<sha12>.<ext>` names its cluster exactly (no
/// DNS label holds `_`). A name of the scheme before it,
/// `<cluster>-<node>-…`, is the cluster's only when its `<cluster>-<node>`
/// splits into two DNS labels in one way alone: `lab-cp-01` could be
/// cluster `lab` with node `cp-01` or cluster `lab-cp` with node `01`, so
/// it is [`Claim::Ambiguous`] (listed, deleted by neither).
fn claim_upload(
    file: &str,
    content: &str,
    cluster: &str,
    nodes: &BTreeSet<String>,
) -> Option<Claim> {
    let (stem, ext) = file.rsplit_once('.')?;
    let ext_ok = match content {
        "import" => matches!(ext, "raw" | "qcow2"),
        "iso" => ext == "iso",
        _ => false,
    };
    let (rest, sha) = stem.rsplit_once('-')?;
    let hex = sha.len() == 12 && sha.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    if !(ext_ok && hex) {
        return None;
    }
    let (owner, talos) = split_version(rest)?;
    if !talos_version(talos) {
        return None;
    }
    let claim = |node: &str| {
        nodes
            .contains(node)
            .then(|| (node.to_owned(), talos.to_owned()))
    };
    if let Some((c, node)) = owner.split_once(super::upload::UPLOAD_SEPARATOR) {
        return (c == cluster)
            .then(|| claim(node))
            .flatten()
            .map(|(n, t)| Claim::Ours(n, t));
    }
    if let Some((c, node)) = only_split(owner) {
        return (c == cluster)
            .then(|| claim(node))
            .flatten()
            .map(|(n, t)| Claim::Ours(n, t));
    }
    let node = owner.strip_prefix(cluster)?.strip_prefix('-')?;
    claim(node).map(|(n, t)| Claim::Ambiguous(n, t))
}

/// `<owner>-<talos>` split at the hyphen before the version's first `.`
/// (no cluster or node name holds a `.`).
fn split_version(s: &str) -> Option<(&str, &str)> {
    let dot = s.find('.')?;
    let at = s[..dot].rfind('-')?;
    Some((&s[..at], &s[at + 1..]))
}

/// The one way `text` splits at a `-` into two DNS labels, when there is
/// exactly one.
fn only_split(text: &str) -> Option<(&str, &str)> {
    let mut splits = text
        .match_indices('-')
        .map(|(i, _)| (&text[..i], &text[i + 1..]))
        .filter(|(a, b)| dns_label(a) && dns_label(b));
    let first = splits.next()?;
    splits.next().is_none().then_some(first)
}

/// A cluster or node name as the inventory takes it.
fn dns_label(s: &str) -> bool {
    crate::inventory::is_node_name(s)
}

/// `v<major>.<minor>.<patch>` with an optional pre-release suffix.
fn talos_version(s: &str) -> bool {
    let Some(v) = s.strip_prefix('v') else {
        return false;
    };
    let core = v.split(['-', '_']).next().unwrap_or_default();
    let parts: Vec<&str> = core.split('.').collect();
    parts.len() == 3
        && parts
            .iter()
            .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
}

/// The import volumes and ISOs in `storage` on every Proxmox node whose
/// names imgbuild's upload scheme gives `cluster` and one of `nodes`, each
/// with the VMs that reference it. A shared storage is listed once. Only
/// reads.
pub fn cluster_volumes(
    creds: &Credentials,
    storage: &str,
    cluster: &str,
    nodes: &BTreeSet<String>,
    retry: RetryPolicy,
) -> Result<Vec<StoredVolume>, ProxmoxError> {
    Ok(cluster_uploads(creds, storage, cluster, nodes, retry)?.ours)
}

/// What [`cluster_uploads`] finds.
#[derive(Debug, Clone, Default)]
pub struct Uploads {
    /// Provably the cluster's ([`cluster_volumes`]).
    pub ours: Vec<StoredVolume>,
    /// Named by the old scheme as the cluster's for one of its nodes, but
    /// as another cluster's as well (see [`claim_upload`]): never deleted,
    /// only listed.
    pub ambiguous: Vec<StoredVolume>,
}

/// [`cluster_volumes`], and the uploads whose old-scheme name could be the
/// cluster's or another's. Only reads.
pub fn cluster_uploads(
    creds: &Credentials,
    storage: &str,
    cluster: &str,
    nodes: &BTreeSet<String>,
    retry: RetryPolicy,
) -> Result<Uploads, ProxmoxError> {
    let api = Api::new(creds, retry)?;
    let mut used: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    for l in all_vms(&api)? {
        for v in referenced(&l.config) {
            used.entry(v).or_default().push(l.vmid);
        }
    }
    let pves = api.get("listing nodes", "/nodes")?;
    let mut out = Uploads::default();
    let mut shared_seen = false;
    for pve in pves
        .as_array()
        .into_iter()
        .flatten()
        .filter(|n| n["status"] != "offline")
        .filter_map(|n| n["node"].as_str())
    {
        let storages = api.get(
            "listing storages",
            &format!("/nodes/{pve}/storage?storage={}", urlencode(storage)),
        )?;
        let Some(st) = storages
            .as_array()
            .into_iter()
            .flatten()
            .find(|s| s["storage"] == storage && s["enabled"] != 0 && s["active"] != 0)
        else {
            continue;
        };
        let shared = st["shared"] == 1;
        if shared && shared_seen {
            continue;
        }
        shared_seen |= shared;
        let listed = api.get(
            "listing storage",
            &format!("/nodes/{pve}/storage/{}/content", urlencode(storage)),
        )?;
        for v in listed.as_array().into_iter().flatten() {
            let (Some(volid), Some(content)) = (v["volid"].as_str(), v["content"].as_str()) else {
                continue;
            };
            let prefix = format!("{storage}:{content}/");
            let Some(file) = volid.strip_prefix(&prefix) else {
                continue;
            };
            let (list, (node, talos_version)) = match claim_upload(file, content, cluster, nodes) {
                Some(Claim::Ours(node, talos)) => (&mut out.ours, (node, talos)),
                Some(Claim::Ambiguous(node, talos)) => (&mut out.ambiguous, (node, talos)),
                None => continue,
            };
            list.push(StoredVolume {
                pve_node: pve.to_owned(),
                storage: storage.to_owned(),
                volid: volid.to_owned(),
                content: content.to_owned(),
                node,
                talos_version,
                size: v["size"].as_u64().unwrap_or(0),
                ctime: v["ctime"].as_u64().unwrap_or(0),
                used_by: used.get(volid).cloned().unwrap_or_default(),
            });
        }
    }
    Ok(out)
}

/// Deletes one volume [`cluster_volumes`] listed, after checking again
/// that no VM references it (pve-storage frees a volume in use without a
/// word). One already gone is done.
pub fn delete_volume(
    creds: &Credentials,
    volume: &StoredVolume,
    opts: &DeleteOptions,
) -> Result<(), ProxmoxError> {
    let api = Api::new(creds, opts.retry)?;
    let what = format!("deleting {}", volume.volid);
    let users: Vec<u32> = all_vms(&api)?
        .iter()
        .filter(|l| referenced(&l.config).contains(&volume.volid))
        .map(|l| l.vmid)
        .collect();
    if !users.is_empty() {
        return Err(ProxmoxError::Api {
            what,
            message: format!(
                "VM {} now uses it; left as it is",
                users
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        });
    }
    let path = format!(
        "/nodes/{}/storage/{}/content/{}",
        volume.pve_node,
        urlencode(&volume.storage),
        urlencode(&volume.volid)
    );
    let deleted = api
        .delete(&what, &path)
        .and_then(|task| api.wait(&what, &task, &opts.publish()));
    match deleted {
        Ok(()) => Ok(()),
        // A delete a killed run sent may have freed it meanwhile: a task
        // that failed on a volume no longer there is done.
        Err(e) if gone(&e) || !still_stored(&api, volume)? => Ok(()),
        Err(e) => Err(e),
    }
}

/// Whether the storage still lists the volume.
fn still_stored(api: &Api, volume: &StoredVolume) -> Result<bool, ProxmoxError> {
    let listed = api.get(
        "listing storage",
        &format!(
            "/nodes/{}/storage/{}/content?content={}",
            volume.pve_node,
            urlencode(&volume.storage),
            volume.content
        ),
    )?;
    Ok(listed
        .as_array()
        .into_iter()
        .flatten()
        .any(|v| v["volid"] == volume.volid.as_str()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The node and version when the name is provably the cluster's.
    fn parse_upload(
        file: &str,
        content: &str,
        cluster: &str,
        nodes: &BTreeSet<String>,
    ) -> Option<(String, String)> {
        match claim_upload(file, content, cluster, nodes)? {
            Claim::Ours(node, talos) => Some((node, talos)),
            Claim::Ambiguous(..) => None,
        }
    }

    fn nodes(list: &[&str]) -> BTreeSet<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn only_names_of_the_scheme_for_this_cluster_and_its_nodes_parse() {
        let n = nodes(&["cp-01", "dev-cp-01"]);
        let ok = "atlas_cp-01-v1.11.2-0123456789ab.raw";
        assert_eq!(
            parse_upload(ok, "import", "atlas", &n),
            Some(("cp-01".into(), "v1.11.2".into()))
        );
        assert_eq!(
            parse_upload(
                "atlas_cp-01-v1.12.0-beta.1-0123456789ab.iso",
                "iso",
                "atlas",
                &n
            ),
            Some(("cp-01".into(), "v1.12.0-beta.1".into()))
        );
        for bad in [
            "atlas_cp-01-v1.11.2-0123456789ab.iso",     // not an import
            "atlas_cp-01-v1.11.2-0123456789a.raw",      // 11 hex
            "atlas_cp-01-v1.11.2-0123456789AB.raw",     // not as written
            "atlas_cp-09-v1.11.2-0123456789ab.raw",     // no such node
            "atlas2_cp-01-v1.11.2-0123456789ab.raw",    // another cluster
            "atlas-dev_cp-01-v1.11.2-0123456789ab.raw", // another cluster
            "atlas_cp-01-latest-0123456789ab.raw",      // no version
            "talos-v1.11.2-nocloud-amd64.raw",          // someone else's
        ] {
            assert_eq!(parse_upload(bad, "import", "atlas", &n), None, "{bad}");
        }
    }

    #[test]
    fn names_that_overlap_as_text_belong_to_one_cluster_only() {
        // Cluster `a` with node `b-c`, and cluster `a-b` with node `c`.
        let (a, ab) = (nodes(&["b-c"]), nodes(&["c"]));
        let of_a = "a_b-c-v1.11.2-0123456789ab.raw";
        let of_ab = "a-b_c-v1.11.2-0123456789ab.raw";
        assert_eq!(
            parse_upload(of_a, "import", "a", &a),
            Some(("b-c".into(), "v1.11.2".into()))
        );
        assert_eq!(parse_upload(of_a, "import", "a-b", &ab), None);
        assert_eq!(
            parse_upload(of_ab, "import", "a-b", &ab),
            Some(("c".into(), "v1.11.2".into()))
        );
        assert_eq!(parse_upload(of_ab, "import", "a", &a), None);
        // The scheme before: `a-b-c-…` is either's, so neither's.
        let old = "a-b-c-v1.11.2-0123456789ab.raw";
        assert_eq!(parse_upload(old, "import", "a", &a), None);
        assert_eq!(parse_upload(old, "import", "a-b", &ab), None);
        let listed = Claim::Ambiguous("c".into(), "v1.11.2".into());
        assert_eq!(claim_upload(old, "import", "a-b", &ab), Some(listed));
        // One only one cluster and node can have written still counts.
        let plain = "atlas-worker-v1.11.2-0123456789ab.raw";
        assert_eq!(
            parse_upload(plain, "import", "atlas", &nodes(&["worker"])),
            Some(("worker".into(), "v1.11.2".into()))
        );
        let hyphens = "atlas-cp-01-v1.11.2-0123456789ab.raw";
        assert_eq!(
            parse_upload(hyphens, "import", "atlas", &nodes(&["cp-01"])),
            None
        );
        // No label starts or ends with `-`: `a--b-c` splits one way only.
        let double = "a--b-c-v1.11.2-0123456789ab.raw";
        assert_eq!(
            parse_upload(double, "import", "a--b", &nodes(&["c"])),
            Some(("c".into(), "v1.11.2".into()))
        );
        assert_eq!(parse_upload(double, "import", "a", &nodes(&["-b-c"])), None);
    }

    #[test]
    fn a_record_names_cluster_and_node_or_the_vm_is_not_ours() {
        let desc = |d: &str| json!({ "description": d });
        let full = format!("{MANAGED}\nimgbuild-cluster: atlas\nimgbuild-node: cp-01\n");
        assert_eq!(
            recorded_node(&desc(&full), "atlas").as_deref(),
            Some("cp-01")
        );
        assert_eq!(recorded_node(&desc(&full), "other"), None);
        let old = format!("{MANAGED}\nimgbuild-node: cp-01\n");
        assert_eq!(recorded_node(&desc(&old), "atlas"), None);
        let forged = "imgbuild-cluster: atlas\nimgbuild-node: cp-01\n";
        assert_eq!(recorded_node(&desc(forged), "atlas"), None);
        assert_eq!(recorded_node(&json!({}), "atlas"), None);
    }

    #[test]
    fn a_record_of_the_cluster_that_proves_no_node_is_unproven_not_ours() {
        let desc = |d: &str| json!({ "description": d });
        let head = format!("{MANAGED}\nimgbuild-cluster: atlas\n");
        for (tail, why) in [
            ("imgbuild-node: Bad_Name!\n", "not a node name"),
            ("imgbuild-node: \n", "not a node name"),
            ("imgbuild-node: \u{1b}[31mcp\n", "not a node name"),
            ("", "names no node"),
            (
                "imgbuild-node: cp-01\nimgbuild-node: cp-02\n",
                "more than one node",
            ),
            (
                "imgbuild-cluster: other\nimgbuild-node: cp-01\n",
                "more than one cluster",
            ),
        ] {
            let d = desc(&format!("{head}{tail}"));
            match record(&d, "atlas") {
                Record::Unproven(reason) => assert!(reason.contains(why), "{tail:?}: {reason}"),
                other => panic!("{tail:?}: {other:?}"),
            }
            assert_eq!(recorded_node(&d, "atlas"), None, "{tail:?}");
        }
        // Another cluster's malformed record is simply not ours.
        let other = format!("{MANAGED}\nimgbuild-cluster: other\nimgbuild-node: Bad!\n");
        assert_eq!(record(&desc(&other), "atlas"), Record::NotOurs);
        // The same node repeated alike is one node.
        let twice = format!("{head}imgbuild-node: cp-01\nimgbuild-node: cp-01\n");
        assert_eq!(record(&desc(&twice), "atlas"), Record::Node("cp-01".into()));
    }

    #[test]
    fn references_cover_drives_imports_cdroms_and_the_record() {
        let config = json!({
            "scsi0": "local-lvm:vm-300-disk-1,size=10G",
            "scsi1": "local-lvm:0,import-from=local:import/a.raw",
            "ide2": "local:iso/b.iso,media=cdrom",
            "unused0": "local-lvm:vm-300-disk-0",
            "description": format!("{MANAGED}\nimgbuild-volume: local:import/c.raw\n"),
            "name": "local:import/not-a-drive.raw",
        });
        let r = referenced(&config);
        for v in [
            "local-lvm:vm-300-disk-1",
            "local:import/a.raw",
            "local:iso/b.iso",
            "local-lvm:vm-300-disk-0",
            "local:import/c.raw",
        ] {
            assert!(r.contains(v), "{v}: {r:?}");
        }
        assert!(!r.contains("local:import/not-a-drive.raw"));
        assert_eq!(
            owned_disks(&config, 300),
            ["local-lvm:vm-300-disk-0", "local-lvm:vm-300-disk-1"]
        );
    }

    #[test]
    fn volumes_belong_to_the_vmid_their_name_gives() {
        assert_eq!(volume_owner("local-lvm:vm-304-disk-0"), Some(304));
        assert_eq!(volume_owner("local:304/vm-304-disk-0.qcow2"), Some(304));
        assert_eq!(volume_owner("local-lvm:base-9000-disk-0"), Some(9000));
        assert_eq!(volume_owner("local:import/vm-304-disk-0.raw"), None);
        assert_eq!(volume_owner("local:iso/talos.iso"), None);
    }
}
