//! The node VMs: found by what they are (never by list position), made to
//! boot Talos, and given a new disk only when asked.

use serde_json::Value;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::api::Api;
use super::error::{ProxmoxError, Step};
use super::settings::{Apply, SettingChange, data_drive};
use super::types::{PublishOptions, VmChange};
use crate::digest::Sha256;
use crate::inventory::{Inventory, Machine, ProxmoxVm, VmBoot};

/// The VM settings that boot Talos. The API's defaults do not: its CPU type
/// kvm64 lacks the x86-64-v2 features Talos needs (siderolabs/talos
/// `website/content/v1.11/talos-guides/install/virtualized-platforms/proxmox.md`).
pub(super) fn vm_params(
    inv: &Inventory,
    node_index: usize,
    vm: &ProxmoxVm,
    machine: &Machine,
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
                format!("{}:{},discard=on,ssd=1", vm.storage, machine.disk_size),
            ),
            ("ide2", format!("{volid},media=cdrom")),
            ("boot", "order=scsi0;ide2".into()),
        ]),
    }
    for (j, &size) in machine.data_disks.iter().enumerate() {
        p.push((data_key(j), blank_disk(vm, size)));
    }
    let model = match &node.mac {
        Some(mac) => format!("virtio={}", mac.to_string().to_uppercase()),
        None => "virtio".into(),
    };
    p.extend([
        ("net0", net0(&model, machine)),
        ("serial0", "socket".into()),
        ("onboot", "1".into()),
        ("balloon", "0".into()),
        ("ostype", "l26".into()),
        ("cores", machine.cores.to_string()),
        ("memory", machine.memory.to_string()),
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

/// The `scsiN` key of data disk `j`, as the API's parameter names go.
fn data_key(j: usize) -> &'static str {
    const KEYS: [&str; 29] = [
        "scsi1", "scsi2", "scsi3", "scsi4", "scsi5", "scsi6", "scsi7", "scsi8", "scsi9", "scsi10",
        "scsi11", "scsi12", "scsi13", "scsi14", "scsi15", "scsi16", "scsi17", "scsi18", "scsi19",
        "scsi20", "scsi21", "scsi22", "scsi23", "scsi24", "scsi25", "scsi26", "scsi27", "scsi28",
        "scsi29",
    ];
    KEYS[j]
}

/// A new blank disk of `size` GiB (`STORAGE_ID:SIZE_IN_GiB`).
fn blank_disk(vm: &ProxmoxVm, size: u32) -> String {
    format!("{}:{size},discard=on,ssd=1", vm.storage)
}

/// `net0` with the model (and MAC) `model`, on the machine's bridge and
/// VLAN (qemu-server `net` property `tag`).
fn net0(model: &str, machine: &Machine) -> String {
    match machine.vlan {
        Some(tag) => format!("{model},bridge={},tag={tag}", machine.bridge),
        None => format!("{model},bridge={}", machine.bridge),
    }
}

pub(super) fn scsi0(vm: &ProxmoxVm, volid: &str) -> String {
    format!("{}:0,import-from={volid},discard=on,ssd=1", vm.storage)
}

/// The first line of every description imgbuild writes: a VM without it
/// was not made by imgbuild and is never started or changed.
pub(super) const MANAGED: &str = "Talos node image managed by imgbuild";

/// The VM's description records whose VM it is (cluster and node: the name
/// alone may be anyone's) and the volume it was made from (the config shows
/// only the VM's own copy of the disk). Volume and sha256 are history, not
/// state: after a Talos upgrade through the installer the disk runs another
/// version, and the record still names the image the VM was made from. It
/// is rewritten only when the disk is (`--replace-disk`); nothing compares
/// it with the inventory (the node's own version and schematic are the
/// drift), and the prune keeps that volume, one a recreate could import.
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
    /// The Proxmox host it is on (or is to be made on).
    pub(super) host: String,
    pub(super) vmid: u32,
    /// The vmid the inventory gives (`firstId` + position) when the node's
    /// VM was found under another.
    pub(super) inventory_vmid: Option<u32>,
    /// The VM when it exists: whether it runs, and its current config
    /// (pending changes not applied).
    pub(super) existing: Option<(bool, Value)>,
}

/// Finds a node's VM by what it is, not where the list puts it: the VM
/// named as the node whose description says imgbuild made it for this node
/// of this cluster, on any of the hosts listed in `vms` (a VM on another
/// host than `pve`, the node's, is kept where it is: the settings plan
/// says it cannot move). Such a VM under another vmid than the computed
/// one is kept (`firstId` + position assigns IDs once; inserting a node
/// shifts them) and named with both IDs; under another vmid than a pinned
/// `vmid` it is an error. Never a second VM for a node, and never a VM
/// imgbuild did not make: a VM of the node's name without imgbuild's
/// description is neither started nor changed, nor does the node get
/// another VM beside it.
pub(super) fn place(
    api: &Api,
    inv: &Inventory,
    pve: &str,
    vms: &std::collections::BTreeMap<String, Value>,
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
    let listed: Vec<(&str, u32, &Value)> = vms
        .iter()
        .flat_map(|(host, list)| {
            list.as_array()
                .into_iter()
                .flatten()
                .filter_map(move |v| Some((host.as_str(), listed_id(v)?, v)))
        })
        .collect();
    let mut mine = Vec::new();
    let mut foreign = Vec::new();
    for &(host, id, v) in listed.iter().filter(|(_, _, v)| v["name"] == *node.name) {
        let config = api.get(
            "reading VM config",
            &format!("/nodes/{host}/qemu/{id}/config?current=1"),
        )?;
        match owner(&config, &inv.cluster.name, &node.name) {
            Owner::Node => mine.push((host, id, v["status"] == "running", config)),
            other => foreign.push((host, id, other)),
        }
    }
    if mine.len() > 1 {
        let ids: Vec<String> = mine
            .iter()
            .map(|(host, id, _, _)| format!("{id} on {host}"))
            .collect();
        return Err(err(format!(
            "the cluster has {} VMs made by imgbuild for this node ({}); imgbuild never picks one: remove the extra ones (qm destroy)",
            ids.len(),
            ids.join(", ")
        )));
    }
    if let Some((host, id, running, config)) = mine.pop() {
        let inventory_vmid = match (id == wanted, node.vmid.is_some()) {
            (true, _) => None,
            (false, true) => {
                return Err(err(format!(
                    "its VM on {host} is vmid {id}, but nodes[{index}].vmid is {wanted}; imgbuild never moves a VM nor makes a second one: set vmid: {id}, or remove VM {id} to have the node's VM made as {wanted}"
                )));
            }
            (false, false) => Some(wanted),
        };
        return Ok(Placement {
            host: host.to_owned(),
            vmid: id,
            inventory_vmid,
            existing: Some((running, config)),
        });
    }
    if let Some((host, id, why)) = foreign.first() {
        let why = match why {
            Owner::Other { cluster, node } => {
                format!("imgbuild made it for node {node:?} of cluster {cluster:?}")
            }
            _ => "imgbuild did not make it (its description has no imgbuild record)".into(),
        };
        return Err(err(format!(
            "VM {id} on {host} is named {:?}, but {why}; imgbuild never starts or changes such a VM, nor makes a second {:?} beside it: rename or remove VM {id}",
            node.name, node.name
        )));
    }
    if let Some((host, _, v)) = listed.iter().find(|(_, id, _)| *id == wanted) {
        let name = v["name"].as_str().unwrap_or("");
        return Err(err(format!(
            "vmid {wanted} on {host} belongs to VM {name:?}, not to this node; imgbuild never overwrites another VM (pin another vmid on the node, or change firstId)"
        )));
    }
    Ok(Placement {
        host: pve.to_owned(),
        vmid: wanted,
        inventory_vmid: None,
        existing: None,
    })
}

/// What happens to a node's VM and whether it is started afterwards: the
/// one rule the real run follows and the dry run reports. `existing` is the
/// node's VM when it has one (running, config), `settings` its planned
/// changes. An existing VM keeps its disk (the image of record: upgrades
/// move the node, not a new upload) unless `replace` gives it a new one.
pub(super) fn vm_decision(
    vm: &ProxmoxVm,
    existing: Option<&(bool, Value)>,
    settings: &[SettingChange],
    replace: bool,
) -> (VmChange, bool) {
    match existing {
        None => (VmChange::Created, vm.start),
        // A new disk is swapped in with the VM stopped; a new ISO goes
        // into the running VM's cdrom drive.
        Some((running, _)) if replace => (
            VmChange::Updated,
            vm.start && (vm.boot == VmBoot::Disk || !running),
        ),
        Some((running, _)) => {
            let changes = settings.iter().any(|c| c.apply != Apply::Recreate);
            let change = if changes {
                VmChange::Changed
            } else {
                VmChange::Unchanged
            };
            (change, vm.start && !running)
        }
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

/// Grows `disk` to `size` GiB.
pub(super) fn resize(
    api: &Api,
    base: &str,
    disk: &str,
    size: u32,
    opts: &PublishOptions,
) -> Result<(), ProxmoxError> {
    let task = api.put(
        "growing the disk",
        &format!("{base}/resize"),
        &[("disk", disk.into()), ("size", format!("{size}G"))],
    )?;
    api.wait(&format!("growing {disk}"), &task, opts)
}

/// Sets the planned `changes` on the VM whose current `config` they were
/// planned from: memory, cores and `net0` in one config change (pending on
/// a running VM where qemu-server cannot hot-plug them), new data disks
/// added, disks grown (`scsi0` not when `replacing` it: the new disk is
/// grown as it comes). Whether a reboot must follow.
pub(super) fn apply_settings(
    api: &Api,
    base: &str,
    vm: &ProxmoxVm,
    config: &Value,
    changes: &[SettingChange],
    replacing: bool,
    opts: &PublishOptions,
) -> Result<bool, ProxmoxError> {
    let mut params: Vec<(&str, String)> = Vec::new();
    let mut grow: Vec<(String, u32)> = Vec::new();
    let net = config["net0"].as_str().unwrap_or_default();
    let mut bridge = None;
    let mut vlan = None;
    for c in changes.iter().filter(|c| c.apply != Apply::Recreate) {
        let to_gib = || c.to.trim_end_matches('G').parse::<u32>().unwrap_or(0);
        match c.field.as_str() {
            "memory" => params.push(("memory", c.to.clone())),
            "cores" => params.push(("cores", c.to.clone())),
            "bridge" => bridge = Some(c.to.clone()),
            "vlan" => vlan = Some(c.to.clone()),
            "diskSize" if !replacing => grow.push(("scsi0".into(), to_gib())),
            field => {
                let Some(j) = field
                    .strip_prefix("dataDisks[")
                    .and_then(|f| f.strip_suffix(']'))
                    .and_then(|j| j.parse::<usize>().ok())
                else {
                    continue;
                };
                if c.from == "none" {
                    params.push((data_key(j), blank_disk(vm, to_gib())));
                } else {
                    grow.push((data_drive(j), to_gib()));
                }
            }
        }
    }
    if bridge.is_some() || vlan.is_some() {
        // The model and MAC stay; only the bridge and tag change.
        let mut opts: Vec<String> = net
            .split(',')
            .filter(|o| !o.starts_with("bridge=") && !o.starts_with("tag="))
            .map(str::to_owned)
            .collect();
        let old = |key: &str| {
            net.split(',')
                .find_map(|o| o.strip_prefix(key).map(str::to_owned))
        };
        if let Some(b) = bridge.or_else(|| old("bridge=")) {
            opts.push(format!("bridge={b}"));
        }
        match vlan.or_else(|| old("tag=")) {
            Some(t) if t != "none" => opts.push(format!("tag={t}")),
            _ => {}
        }
        params.push(("net0", opts.join(",")));
    }
    if !params.is_empty() {
        let task = api.post("changing VM settings", &format!("{base}/config"), &params)?;
        api.wait("changing VM settings", &task, opts)?;
    }
    for (disk, size) in grow {
        resize(api, base, &disk, size, opts)?;
    }
    Ok(changes.iter().any(|c| c.apply == Apply::Reboot))
}

/// Reboots a running VM so its pending settings apply (qemu-server
/// `status/reboot`: shutdown, then start with pending applied), and waits
/// until it runs again and, when known, its Talos API at `talos` accepts
/// connections, so the next node goes down only once this one is back.
pub(super) fn reboot(
    api: &Api,
    base: &str,
    vmid: u32,
    talos: Option<SocketAddr>,
    opts: &PublishOptions,
) -> Result<(), ProxmoxError> {
    let task = api.post("rebooting VM", &format!("{base}/status/reboot"), &[])?;
    api.wait(&format!("rebooting VM {vmid}"), &task, opts)?;
    let deadline = Instant::now() + opts.task_timeout;
    let what = format!("waiting for VM {vmid} to run again");
    while !running(api, base) {
        if Instant::now() > deadline {
            return Err(ProxmoxError::Api {
                what,
                message: format!("not running after {:?}", opts.task_timeout),
            });
        }
        std::thread::sleep(opts.poll);
    }
    let Some(addr) = talos else {
        return Ok(());
    };
    while std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).is_err() {
        if Instant::now() > deadline {
            return Err(ProxmoxError::Api {
                what,
                message: format!(
                    "its Talos API at {addr} accepted no connection within {:?}",
                    opts.task_timeout
                ),
            });
        }
        std::thread::sleep(opts.poll);
    }
    Ok(())
}

/// The disk a VM gets in place of its `scsi0`.
pub(super) struct NewDisk<'a> {
    /// The import volume.
    pub(super) volid: &'a str,
    /// The VM's description that records it.
    pub(super) description: &'a str,
    /// The volume `scsi0` holds now.
    pub(super) replaces: Option<&'a str>,
    /// GiB the new disk is grown to.
    pub(super) size: u32,
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
    resize(api, base, "scsi0", disk.size, opts)
}
