//! The node VMs: found by what they are (never by list position), made to
//! boot Talos, and given a new disk only when asked.

use serde_json::Value;

use super::api::Api;
use super::error::{ProxmoxError, Step};
use super::types::{PublishOptions, VmChange};
use crate::digest::Sha256;
use crate::inventory::{Inventory, ProxmoxVm, VmBoot};

/// The VM settings that boot Talos. The API's defaults do not: its CPU type
/// kvm64 lacks the x86-64-v2 features Talos needs (siderolabs/talos
/// `website/content/v1.11/talos-guides/install/virtualized-platforms/proxmox.md`).
pub(super) fn vm_params(
    inv: &Inventory,
    node_index: usize,
    vm: &ProxmoxVm,
    vmid: u32,
    volid: &str,
    sha256: &Sha256,
) -> Vec<(&'static str, String)> {
    let node = &inv.nodes[node_index];
    let mut p = vec![
        ("vmid", vmid.to_string()),
        ("name", node.name.clone()),
        ("machine", "q35".into()),
        ("bios", "ovmf".into()),
        (
            "efidisk0",
            format!("{}:1,efitype=4m,pre-enrolled-keys=0", vm.storage),
        ),
        ("cpu", "host".into()),
        ("scsihw", "virtio-scsi-pci".into()),
    ];
    // Secure Boot: the EFI disk above is in setup mode (4m vars without
    // pre-enrolled keys, so systemd-boot can enroll Talos's keys as
    // `enrollKeys` allows), and the TPM is 2.0: qemu-server's default is
    // v1.2 (`PVE/QemuServer/Drive.pm` `tpmstate` `version`), which Talos's
    // disk encryption cannot seal to.
    if inv.secure_boot(node) {
        p.push(("tpmstate0", format!("{}:1,version=v2.0", vm.storage)));
    }
    match vm.boot {
        VmBoot::Disk => p.extend([("scsi0", scsi0(vm, volid)), ("boot", "order=scsi0".into())]),
        // The disk boots first: while it is blank the firmware skips it
        // and boots the node ISO, which installs Talos to it (installDisk)
        // when the config is applied; from then on every start, a Proxmox
        // host restart included, boots the installed disk. The ISO first
        // would halt every boot after the install: Talos ISOs from v1.8
        // carry `talos.halt_if_installed=1` (siderolabs/talos
        // `pkg/imager/imager.go`; `v1alpha1_sequencer.go`, "Please reboot
        // from the disk"). qemu-server `boot` order, `ide2` media=cdrom; a
        // new volume is `STORAGE_ID:SIZE_IN_GiB`
        // (sim/api-schemas/proxmox-ve.apidata.json `scsi[n]`).
        VmBoot::Iso => p.extend([
            (
                "scsi0",
                format!("{}:{},discard=on,ssd=1", vm.storage, vm.disk_size),
            ),
            ("ide2", format!("{volid},media=cdrom")),
            ("boot", "order=scsi0;ide2".into()),
        ]),
    }
    p.extend([
        (
            "net0",
            match &node.mac {
                Some(mac) => format!(
                    "virtio={},bridge={}",
                    mac.to_string().to_uppercase(),
                    vm.bridge
                ),
                None => format!("virtio,bridge={}", vm.bridge),
            },
        ),
        ("serial0", "socket".into()),
        ("onboot", "1".into()),
        ("balloon", "0".into()),
        ("ostype", "l26".into()),
        ("cores", vm.cores.to_string()),
        ("memory", vm.memory.to_string()),
        ("description", description(inv, &node.name, volid, sha256)),
    ]);
    let agent = inv
        .image
        .extensions
        .iter()
        .chain(&node.extensions)
        .any(|e| e.rsplit('/').next() == Some("qemu-guest-agent"));
    if agent {
        p.push(("agent", "enabled=1".into()));
    }
    p
}

pub(super) fn scsi0(vm: &ProxmoxVm, volid: &str) -> String {
    format!("{}:0,import-from={volid},discard=on,ssd=1", vm.storage)
}

/// The first line of every description imgbuild writes: a VM without it
/// was not made by imgbuild and is never started or changed.
pub(super) const MANAGED: &str = "Talos node image managed by imgbuild";

/// The VM's description records whose VM it is (cluster and node: the name
/// alone may be anyone's) and the volume it was made from (the config shows
/// only the VM's own copy of the disk).
pub(super) fn description(inv: &Inventory, node: &str, volid: &str, sha256: &Sha256) -> String {
    format!(
        "{MANAGED}\nimgbuild-cluster: {}\nimgbuild-node: {node}\nimgbuild-volume: {volid}\nimgbuild-sha256: {sha256}\n",
        inv.cluster.name
    )
}

/// The value of one `imgbuild-<key>: ` line of the description.
pub(super) fn described(config: &Value, key: &str) -> Option<String> {
    let prefix = format!("imgbuild-{key}: ");
    config["description"]
        .as_str()?
        .lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .map(str::to_owned)
}

pub(super) fn described_volume(config: &Value) -> Option<String> {
    described(config, "volume")
}

/// Whose VM a config is, by its description.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Owner {
    /// imgbuild made it for this node of this cluster (or, before it
    /// recorded them, for a node of this name).
    Node,
    /// imgbuild did not make it (by hand, Terraform, …).
    NotImgbuild,
    /// imgbuild made it for another cluster's node, or another node.
    Other { cluster: String, node: String },
}

pub(super) fn owner(config: &Value, cluster: &str, node: &str) -> Owner {
    let managed = config["description"]
        .as_str()
        .is_some_and(|d| d.lines().any(|l| l.trim_end() == MANAGED));
    if !managed {
        return Owner::NotImgbuild;
    }
    let c = described(config, "cluster");
    let n = described(config, "node");
    if c.as_deref().is_none_or(|c| c == cluster) && n.as_deref().is_none_or(|n| n == node) {
        Owner::Node
    } else {
        Owner::Other {
            cluster: c.unwrap_or_default(),
            node: n.unwrap_or_default(),
        }
    }
}

/// The volume of a drive string (`local-lvm:vm-300-disk-1,size=10G`).
pub(super) fn drive_volume(drive: &str) -> &str {
    drive.split(',').next().unwrap_or_default()
}

/// A listed VM's vmid (a number, or a string on some versions).
pub(super) fn listed_id(v: &Value) -> Option<u32> {
    match &v["vmid"] {
        Value::Number(n) => n.as_u64().and_then(|n| u32::try_from(n).ok()),
        Value::String(s) => s.parse().ok(),
        _ => None,
    }
}

/// Where a node's VM is, or is to be made.
pub(super) struct Placement {
    pub(super) vmid: u32,
    /// The vmid the inventory gives (`firstId` + position) when the node's
    /// VM was found under another.
    pub(super) inventory_vmid: Option<u32>,
    /// The VM when it exists: whether it runs, and its config.
    pub(super) existing: Option<(bool, Value)>,
}

/// Finds a node's VM by what it is, not where the list puts it: the VM
/// named as the node whose description says imgbuild made it for this node
/// of this cluster. Such a VM under another vmid than the computed one is
/// kept (`firstId` + position assigns IDs once; inserting a node shifts
/// them) and named with both IDs; under another vmid than a pinned `vmid`
/// it is an error. Never a second VM for a node, and never a VM imgbuild
/// did not make: a VM of the node's name without imgbuild's description is
/// neither started nor changed, nor does the node get another VM beside it.
pub(super) fn place(
    api: &Api,
    inv: &Inventory,
    pve: &str,
    vms: &Value,
    index: usize,
) -> Result<Placement, ProxmoxError> {
    let node = &inv.nodes[index];
    let err = |message: String| ProxmoxError::Node {
        node: node.name.clone(),
        step: Step::Vm,
        message,
        done: None,
    };
    let wanted = inv
        .vmid(index)
        .ok_or_else(|| err("no vmid (set publish.proxmox.vm.firstId or the node's vmid)".into()))?;
    let listed: Vec<(u32, &Value)> = vms
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| Some((listed_id(v)?, v)))
        .collect();
    let mut mine = Vec::new();
    let mut foreign = Vec::new();
    for &(id, v) in listed.iter().filter(|(_, v)| v["name"] == *node.name) {
        let config = api.get(
            "reading VM config",
            &format!("/nodes/{pve}/qemu/{id}/config"),
        )?;
        match owner(&config, &inv.cluster.name, &node.name) {
            Owner::Node => mine.push((id, v["status"] == "running", config)),
            other => foreign.push((id, other)),
        }
    }
    if mine.len() > 1 {
        let ids: Vec<String> = mine.iter().map(|(id, _, _)| id.to_string()).collect();
        return Err(err(format!(
            "{pve} has {} VMs made by imgbuild for this node ({}); imgbuild never picks one: remove the extra ones (qm destroy)",
            ids.len(),
            ids.join(", ")
        )));
    }
    if let Some((id, running, config)) = mine.pop() {
        let inventory_vmid = match (id == wanted, node.vmid.is_some()) {
            (true, _) => None,
            (false, true) => {
                return Err(err(format!(
                    "its VM on {pve} is vmid {id}, but nodes[{index}].vmid is {wanted}; imgbuild never moves a VM nor makes a second one: set vmid: {id}, or remove VM {id} to have the node's VM made as {wanted}"
                )));
            }
            (false, false) => Some(wanted),
        };
        return Ok(Placement {
            vmid: id,
            inventory_vmid,
            existing: Some((running, config)),
        });
    }
    if let Some((id, why)) = foreign.first() {
        let why = match why {
            Owner::Other { cluster, node } => {
                format!("imgbuild made it for node {node:?} of cluster {cluster:?}")
            }
            _ => "imgbuild did not make it (its description has no imgbuild record)".into(),
        };
        return Err(err(format!(
            "VM {id} on {pve} is named {:?}, but {why}; imgbuild never starts or changes such a VM, nor makes a second {:?} beside it: rename or remove VM {id}",
            node.name, node.name
        )));
    }
    if let Some((_, v)) = listed.iter().find(|(id, _)| *id == wanted) {
        let name = v["name"].as_str().unwrap_or("");
        return Err(err(format!(
            "vmid {wanted} on {pve} belongs to VM {name:?}, not to this node; imgbuild never overwrites another VM (pin another vmid on the node, or change firstId)"
        )));
    }
    Ok(Placement {
        vmid: wanted,
        inventory_vmid: None,
        existing: None,
    })
}

/// What an existing VM that boots `current` (as its description records)
/// gets when it should boot `volid`: nothing, or its disk replaced when
/// `replace` allows (else it is left outdated).
pub(super) fn vm_verdict(current: Option<&str>, volid: &str, replace: bool) -> VmChange {
    match current {
        Some(c) if c == volid => VmChange::Unchanged,
        _ if replace => VmChange::Updated,
        _ => VmChange::Outdated,
    }
}

/// What happens to a node's VM and whether it is started afterwards: the
/// one rule the real run follows and the dry run reports. `existing` is the
/// node's VM when it has one (running, config); `volid` the image's volume,
/// unknown while the image is not built.
pub(super) fn vm_decision(
    vm: &ProxmoxVm,
    existing: Option<&(bool, Value)>,
    volid: Option<&str>,
    replace: bool,
) -> (Option<VmChange>, bool) {
    match (existing, volid) {
        (None, _) => (Some(VmChange::Created), vm.start),
        (Some((running, config)), Some(volid)) => {
            let change = vm_verdict(described_volume(config).as_deref(), volid, replace);
            // A new disk is swapped in with the VM stopped; a new ISO goes
            // into the running VM's cdrom drive.
            let restarts = change == VmChange::Updated && vm.boot == VmBoot::Disk;
            (Some(change), vm.start && (restarts || !running))
        }
        (Some((running, _)), None) => (None, vm.start && !running),
    }
}

/// Starts the VM at `base` and waits until it runs.
/// Starts the VM; one found running when the start fails is started, as
/// asked. qemu-server's `vm_start` dies "VM N already running" (its
/// src/PVE/QemuServer.pm), which is what a rerun meets when a start posted
/// by a killed run is still in flight or finished after the VMs were listed.
pub(super) fn start(
    api: &Api,
    base: &str,
    vmid: u32,
    opts: &PublishOptions,
) -> Result<(), ProxmoxError> {
    let started = api
        .post("starting VM", &format!("{base}/status/start"), &[])
        .and_then(|task| api.wait(&format!("starting VM {vmid}"), &task, opts));
    match started {
        Err(_) if running(api, base) => Ok(()),
        other => other,
    }
}

/// Whether the VM runs now, as its current status says.
fn running(api: &Api, base: &str) -> bool {
    api.get("reading the VM's status", &format!("{base}/status/current"))
        .is_ok_and(|s| s["status"] == "running")
}

pub(super) fn resize(
    api: &Api,
    base: &str,
    vm: &ProxmoxVm,
    opts: &PublishOptions,
) -> Result<(), ProxmoxError> {
    let task = api.put(
        "growing the disk",
        &format!("{base}/resize"),
        &[
            ("disk", "scsi0".into()),
            ("size", format!("{}G", vm.disk_size)),
        ],
    )?;
    api.wait("growing the disk", &task, opts)
}

/// The disk a VM gets in place of its `scsi0`.
pub(super) struct NewDisk<'a> {
    /// The import volume.
    pub(super) volid: &'a str,
    /// The VM's description that records it.
    pub(super) description: &'a str,
    /// The volume `scsi0` holds now.
    pub(super) replaces: Option<&'a str>,
}

/// Stop, import the new volume as `scsi0`, delete the old disk, grow it;
/// the caller starts the VM again. qemu-server parks the old volume as an
/// `unusedN` entry, and deleting an `unusedN` frees its volume
/// (src/PVE/API2/Qemu.pm `update_vm_api`, src/PVE/QemuServer.pm
/// `try_deallocate_drive`): only the entry holding the old `scsi0` is
/// deleted, never a disk the user parked on the VM.
pub(super) fn replace_disk(
    api: &Api,
    base: &str,
    vm: &ProxmoxVm,
    vmid: u32,
    disk: &NewDisk,
    running: bool,
    opts: &PublishOptions,
) -> Result<(), ProxmoxError> {
    if running {
        let task = api.post("stopping VM", &format!("{base}/status/stop"), &[])?;
        api.wait(&format!("stopping VM {vmid}"), &task, opts)?;
    }
    let task = api.post(
        "importing the new disk",
        &format!("{base}/config"),
        &[
            ("scsi0", scsi0(vm, disk.volid)),
            ("description", disk.description.to_owned()),
        ],
    )?;
    api.wait(
        &format!("importing the new disk into VM {vmid}"),
        &task,
        opts,
    )?;
    let config = api.get("reading VM config", &format!("{base}/config"))?;
    let unused: Vec<String> = config
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(k, v)| {
            k.starts_with("unused")
                && disk
                    .replaces
                    .is_some_and(|old| v.as_str().map(drive_volume) == Some(old))
        })
        .map(|(k, _)| k.clone())
        .collect();
    if !unused.is_empty() {
        let task = api.post(
            "deleting the old disk",
            &format!("{base}/config"),
            &[("delete", unused.join(","))],
        )?;
        api.wait(&format!("deleting the old disk of VM {vmid}"), &task, opts)?;
    }
    resize(api, base, vm, opts)
}
