//! The inventory's `publish` section: where built images go. Credentials
//! never live here; they come from the environment at publish time.
//!
//! This file uses nothing of the inventory module around it (the module
//! re-exports it): validation gets what it needs of the rest as [`Context`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The `publish` section as the file writes it. Code reads it only through
/// [`PublishSection::target`], which yields one target: validation refuses
/// a section naming both.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PublishSection {
    #[serde(default)]
    proxmox: Option<ProxmoxSettings>,
    #[serde(default)]
    hcloud: Option<HcloudSettings>,
}

/// The inventory's one publish target.
#[derive(Debug, Clone, Copy)]
pub enum PublishSettings<'a> {
    /// No publish section: image files in the out dir.
    None,
    /// `publish.proxmox`.
    Proxmox(&'a ProxmoxSettings),
    /// `publish.hcloud`.
    Hcloud(&'a HcloudSettings),
}

impl PublishSection {
    /// The target this section names. (Only a section that skipped
    /// validation can name both; it reads as Hetzner Cloud.)
    pub fn target(&self) -> PublishSettings<'_> {
        match (&self.proxmox, &self.hcloud) {
            (_, Some(h)) => PublishSettings::Hcloud(h),
            (Some(p), None) => PublishSettings::Proxmox(p),
            (None, None) => PublishSettings::None,
        }
    }

    /// The Proxmox target, if that is the one.
    pub fn proxmox(&self) -> Option<&ProxmoxSettings> {
        match self.target() {
            PublishSettings::Proxmox(p) => Some(p),
            _ => None,
        }
    }

    /// The Hetzner Cloud target, if that is the one.
    pub fn hcloud(&self) -> Option<&HcloudSettings> {
        match self.target() {
            PublishSettings::Hcloud(h) => Some(h),
            _ => None,
        }
    }

    /// The vmid of the node at `index` whose own `vmid` is `own`: that,
    /// else `firstId + index`.
    pub fn vmid(&self, own: Option<u32>, index: usize) -> Option<u32> {
        own.or_else(|| {
            let first = self.proxmox.as_ref()?.vm.as_ref()?.first_id?;
            first.checked_add(u32::try_from(index).ok()?)
        })
    }
}

/// Hetzner Cloud snapshots, made through a temporary server's rescue system;
/// and, with `servers`, the cluster's machines created from them.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct HcloudSettings {
    /// Where the temporary build server (and the cluster's servers) run.
    pub location: String,
    /// Build-server types to choose from, smallest disk first (equal disks
    /// in this order); empty: every type of the image's architecture that
    /// `GET /server_types` lists. A snapshot boots only on types with at
    /// least the disk of the server it was made on.
    #[serde(default)]
    pub server_types: Vec<String>,
    /// Added to the snapshot's labels (imgbuild's own keys win no clash:
    /// a clash is a validation error).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// One server per node, created from the snapshot by `imgbuild up`.
    #[serde(default)]
    pub servers: Option<HcloudServers>,
}

/// The cluster's servers.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct HcloudServers {
    #[serde(rename = "type")]
    pub server_type: String,
    /// A Hetzner network (by name) the servers join at their inventory address.
    #[serde(default)]
    pub network: Option<String>,
}

/// The label keys imgbuild sets on snapshots and temporary resources.
pub const RESERVED_LABELS: [&str; 8] = [
    "os",
    "talos-version",
    "talos-schematic",
    "arch",
    "image-sha256",
    "managed-by",
    "imgbuild-run",
    "imgbuild-cluster",
];

/// Hetzner's label rule (hcloud API "Labels"): an optional DNS-subdomain
/// prefix and `/`, then a name of at most 63 characters, alphanumeric at both
/// ends with `-`, `_`, `.` inside; values the same, possibly empty.
pub fn label_problem(key: &str, value: &str) -> Option<String> {
    fn name_ok(s: &str, empty_ok: bool) -> bool {
        if s.is_empty() {
            return empty_ok;
        }
        let b = s.as_bytes();
        s.len() <= 63
            && b[0].is_ascii_alphanumeric()
            && b[b.len() - 1].is_ascii_alphanumeric()
            && b.iter()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
    }
    let (prefix, name) = match key.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    if let Some(p) = prefix {
        if p == "hetzner.cloud" || p.ends_with(".hetzner.cloud") {
            return Some(format!(
                "label key {key:?}: the hetzner.cloud/ prefix is reserved"
            ));
        }
        if p.is_empty() || p.len() > 253 || !p.split('.').all(|part| name_ok(part, false)) {
            return Some(format!(
                "label key {key:?}: {p:?} is not a DNS subdomain prefix"
            ));
        }
    }
    if !name_ok(name, false) {
        return Some(format!(
            "label key {key:?}: at most 63 characters, letters and digits at both ends, '-', '_', '.' inside"
        ));
    }
    if !name_ok(value, true) {
        return Some(format!(
            "label {key}: value {value:?} must be at most 63 characters, letters and digits at both ends, '-', '_', '.' inside"
        ));
    }
    None
}

/// Images into a Proxmox VE storage with `import` content, and optionally
/// one VM per node that boots its own image.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ProxmoxSettings {
    /// The Proxmox node that receives uploads and runs the VMs.
    pub node: String,
    /// A file-based storage with the `import` content type.
    pub storage: String,
    /// SHA-256 pin of pveproxy's certificate (`AB:CD:…` or plain hex).
    #[serde(default)]
    pub fingerprint: Option<String>,
    #[serde(default)]
    pub vm: Option<ProxmoxVm>,
    /// How a raw image crosses the wire: as qcow2 (only its allocated
    /// clusters; Proxmox's import converts it) or as the raw bytes; or,
    /// with `download-url`, not at all: Proxmox fetches each factory-route
    /// image from the factory.
    #[serde(default)]
    pub upload: UploadFormat,
}

/// The form a raw image is uploaded in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum UploadFormat {
    #[default]
    Qcow2,
    Raw,
    /// Proxmox fetches the image from the factory itself (storage
    /// `download-url`, checked against the image's sha256): opt-in, since
    /// the factory then sees each node's schematic and addresses.
    #[serde(rename = "download-url")]
    DownloadUrl,
}

/// The VMs' shape. Explicit values throughout: the API's defaults (SeaBIOS,
/// i440fx, lsi, kvm64) do not boot Talos.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ProxmoxVm {
    /// Where VM disks live (content `images`).
    pub storage: String,
    /// vmid of the first node; later nodes count up by inventory position.
    #[serde(default)]
    pub first_id: Option<u32>,
    #[serde(default = "default_cores")]
    pub cores: u32,
    /// MiB.
    #[serde(default = "default_memory")]
    pub memory: u32,
    /// GiB; the imported disk is grown to this.
    #[serde(default = "default_disk_size")]
    pub disk_size: u32,
    #[serde(default = "default_bridge")]
    pub bridge: String,
    /// The VLAN tag on `net0` (none: untagged).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vlan: Option<u16>,
    /// Extra blank disks (`scsi1`…, GiB each), e.g. for Longhorn or
    /// user volumes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub data_disks: Vec<u32>,
    #[serde(default = "default_start")]
    pub start: bool,
    /// What the VM boots: its image as `scsi0` (`disk`), or its node ISO
    /// as a cdrom before a blank `scsi0` Talos installs to (`iso`).
    #[serde(default)]
    pub boot: VmBoot,
}

/// A node's own VM settings from the inventory; each unset one is the
/// cluster's.
#[derive(Debug, Clone, Copy, Default)]
pub struct NodeMachine<'a> {
    pub cores: Option<u32>,
    pub memory: Option<u32>,
    pub disk_size: Option<u32>,
    pub data_disks: Option<&'a [u32]>,
    pub bridge: Option<&'a str>,
    pub vlan: Option<u16>,
    /// The Proxmox node (host) the VM runs on.
    pub host: Option<&'a str>,
}

/// A node's VM as it should be: its settings over the cluster's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Machine {
    /// The Proxmox node (host) that stores its image and runs it.
    pub host: String,
    pub cores: u32,
    /// MiB.
    pub memory: u32,
    /// GiB.
    pub disk_size: u32,
    /// GiB each, as `scsi1`, `scsi2`, ….
    pub data_disks: Vec<u32>,
    pub bridge: String,
    pub vlan: Option<u16>,
}

impl ProxmoxSettings {
    /// The VM of a node with settings `own`; none without `vm`.
    pub fn machine(&self, own: &NodeMachine) -> Option<Machine> {
        let vm = self.vm.as_ref()?;
        Some(Machine {
            host: own.host.unwrap_or(&self.node).to_owned(),
            cores: own.cores.unwrap_or(vm.cores),
            memory: own.memory.unwrap_or(vm.memory),
            disk_size: own.disk_size.unwrap_or(vm.disk_size),
            data_disks: own.data_disks.unwrap_or(&vm.data_disks).to_vec(),
            bridge: own.bridge.unwrap_or(&vm.bridge).to_owned(),
            vlan: own.vlan.or(vm.vlan),
        })
    }
}

/// What a node's VM boots from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum VmBoot {
    #[default]
    Disk,
    Iso,
}

fn default_cores() -> u32 {
    2
}
fn default_memory() -> u32 {
    4096
}
fn default_disk_size() -> u32 {
    20
}
fn default_bridge() -> String {
    "vmbr0".into()
}
fn default_start() -> bool {
    true
}

/// The smallest and largest vmid Proxmox accepts (`pve-vmid`).
const VMID_RANGE: std::ops::RangeInclusive<u64> = 100..=999_999_999;

/// Proxmox storage and node identifiers (`pve-storage-id`, `pve-node`).
/// The most vCPUs KVM gives one VM (`KVM_MAX_VCPUS`).
const MAX_VCPUS: u32 = 4096;

fn is_pve_id(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// A Proxmox node is a host: its name is a host name label (at most 63
/// characters, RFC 1123), so a longer one names no node and only makes
/// every URL and message long.
fn is_pve_node(s: &str) -> bool {
    s.len() <= 63 && is_pve_id(s)
}

/// A Linux network interface name, as a bridge is: at most 15 bytes
/// (`IFNAMSIZ` 16 with its NUL, linux include/uapi/linux/if.h).
fn is_bridge_name(s: &str) -> bool {
    s.len() <= 15 && is_pve_id(s)
}

/// A Hetzner location or server type name: lowercase letters, digits, `-`.
fn is_hcloud_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
}

/// The nodes' own Hetzner `serverType` and `location`: names, and only
/// where there are servers to make.
/// `nodes`: each node's name, own server type and location.
pub(super) fn hcloud_node_problems(
    section: &PublishSection,
    nodes: &[(&str, Option<&str>, Option<&str>)],
) -> Vec<(String, String)> {
    let servers = section.hcloud.as_ref().is_some_and(|h| h.servers.is_some());
    let mut out = Vec::new();
    for (i, (name, server_type, location)) in nodes.iter().enumerate() {
        for (field, value, example) in [
            ("serverType", server_type, "cax21"),
            ("location", location, "nbg1"),
        ] {
            let Some(value) = value else { continue };
            let at = format!("nodes[{i}].{field}");
            if !servers {
                out.push((
                    at,
                    format!(
                        "node {name}: {field} needs publish.hcloud.servers (there are no Hetzner servers to make)"
                    ),
                ));
            } else if !is_hcloud_name(value) {
                out.push((
                    at,
                    format!("node {name}: {value:?} is not a Hetzner {field} such as {example}"),
                ));
            }
        }
    }
    out
}

/// What publish validation needs of the rest of the inventory.
pub(super) struct Context<'a> {
    pub platform: &'a str,
    /// `image.format` is raw / iso.
    pub raw: bool,
    pub iso: bool,
    /// Each node's name, own `vmid` and own VM settings, in inventory order.
    pub nodes: Vec<(&'a str, Option<u32>, NodeMachine<'a>)>,
}

/// The section's problems, each as (field path, message), in the order
/// validation has always listed them.
pub(super) fn problems(section: &PublishSection, cx: &Context) -> Vec<(String, String)> {
    let mut check = Check {
        section,
        cx,
        problems: Vec::new(),
    };
    check.publish();
    check.problems
}

struct Check<'a> {
    section: &'a PublishSection,
    cx: &'a Context<'a>,
    problems: Vec<(String, String)>,
}

impl Check<'_> {
    fn problem(&mut self, field: impl Into<String>, message: impl Into<String>) {
        self.problems.push((field.into(), message.into()));
    }

    fn publish(&mut self) {
        self.hcloud();
        let (section, cx) = (self.section, self.cx);
        let Some(px) = &section.proxmox else {
            if let Some((i, _)) = cx.nodes.iter().enumerate().find(|(_, n)| n.1.is_some()) {
                self.problem(
                    format!("nodes[{i}].vmid"),
                    "vmid needs publish.proxmox.vm (there is no Proxmox target)",
                );
            }
            self.machines_unused("there is no Proxmox target");
            return;
        };
        for (field, value, ok) in [
            ("publish.proxmox.node", &px.node, is_pve_node(&px.node)),
            (
                "publish.proxmox.storage",
                &px.storage,
                is_pve_id(&px.storage),
            ),
        ] {
            if !ok {
                self.problem(
                    field,
                    format!("{} is not a Proxmox identifier (at most 63 characters: a letter, then letters, digits, '-', '_', '.')", crate::input::quote(value)),
                );
            }
        }
        if let Some(fp) = &px.fingerprint
            && let Err(e) = fp.parse::<crate::digest::Sha256>()
        {
            self.problem("publish.proxmox.fingerprint", e);
        }
        if px.upload == UploadFormat::DownloadUrl && cx.raw {
            self.problem(
                "publish.proxmox.upload",
                "download-url needs image.format qcow2 or iso: the factory serves raw images \
                 zstd-compressed, and Proxmox decompresses downloads only for ISOs",
            );
        }
        let Some(vm) = &px.vm else {
            if let Some((i, _)) = cx.nodes.iter().enumerate().find(|(_, n)| n.1.is_some()) {
                self.problem(
                    format!("nodes[{i}].vmid"),
                    "vmid needs publish.proxmox.vm (without it imgbuild only uploads)",
                );
            }
            self.machines_unused("without it imgbuild only uploads");
            return;
        };
        if !is_pve_id(&vm.storage) {
            self.problem(
                "publish.proxmox.vm.storage",
                format!("{:?} is not a Proxmox storage identifier", vm.storage),
            );
        }
        let iso = cx.iso;
        if (vm.boot == VmBoot::Iso) != iso {
            self.problem(
                "publish.proxmox.vm.boot",
                if iso {
                    "image.format iso needs boot: iso (the VM boots the node's ISO as a cdrom)"
                } else {
                    "boot: iso needs image.format: iso"
                },
            );
        }
        let cluster = NodeMachine {
            cores: Some(vm.cores),
            memory: Some(vm.memory),
            disk_size: Some(vm.disk_size),
            data_disks: Some(&vm.data_disks),
            bridge: Some(&vm.bridge),
            vlan: vm.vlan,
            host: None,
        };
        self.machine("publish.proxmox.vm", "", &cluster);
        for (i, (name, _, own)) in cx.nodes.iter().enumerate() {
            let at = format!("nodes[{i}]");
            let whose = format!("node {name}: ");
            self.machine(&at, &whose, own);
            if let Some(host) = own.host
                && !is_pve_node(host)
            {
                self.problem(
                    format!("{at}.proxmoxNode"),
                    format!("{whose}{} is not a Proxmox node name (at most 63 characters: a letter, then letters, digits, '-', '_', '.')", crate::input::quote(host)),
                );
            }
        }
        if let Some(first) = vm.first_id {
            let last = u64::from(first) + cx.nodes.len().saturating_sub(1) as u64;
            if !VMID_RANGE.contains(&u64::from(first)) || !VMID_RANGE.contains(&last) {
                self.problem(
                    "publish.proxmox.vm.firstId",
                    format!(
                        "{first}: the vmids {first}..{last} of {} node(s) must lie in 100..999999999",
                        cx.nodes.len()
                    ),
                );
                return;
            }
        }
        let mut seen: Vec<(u32, &str)> = Vec::new();
        for (i, &(name, own, _)) in cx.nodes.iter().enumerate() {
            let at = format!("nodes[{i}]");
            match section.vmid(own, i) {
                None => self.problem(
                    format!("{at}.name"),
                    format!(
                        "node {}: no vmid (set publish.proxmox.vm.firstId or the node's vmid)",
                        name
                    ),
                ),
                Some(id) if !VMID_RANGE.contains(&u64::from(id)) => self.problem(
                    format!("{at}.vmid"),
                    format!("node {}: vmid {id} is outside 100..999999999", name),
                ),
                Some(id) => {
                    if let Some((_, other)) = seen.iter().find(|(v, _)| *v == id) {
                        self.problem(
                            format!("{at}.vmid"),
                            format!("node {}: vmid {id} is already node {other}'s", name),
                        );
                    }
                    seen.push((id, name));
                }
            }
        }
    }

    /// Per-node VM settings where no VM is made: each is a problem.
    fn machines_unused(&mut self, why: &str) {
        for (i, (name, _, own)) in self.cx.nodes.iter().enumerate() {
            let set = [
                ("cores", own.cores.is_some()),
                ("memory", own.memory.is_some()),
                ("diskSize", own.disk_size.is_some()),
                ("dataDisks", own.data_disks.is_some()),
                ("bridge", own.bridge.is_some()),
                ("vlan", own.vlan.is_some()),
                ("proxmoxNode", own.host.is_some()),
            ];
            for (field, _) in set.iter().filter(|(_, set)| *set) {
                self.problem(
                    format!("nodes[{i}].{field}"),
                    format!("node {name}: {field} needs publish.proxmox.vm ({why})"),
                );
            }
        }
    }

    /// The VM settings given at `at` (`publish.proxmox.vm` or `nodes[i]`),
    /// each within what Talos needs and Proxmox takes. Upper bounds:
    /// qemu-server's MAX_MEM in MiB (PVE/QemuServer/Memory.pm), its 30
    /// SCSI drives (`scsi0` is the boot disk) and VLAN tags 1..4094
    /// (PVE/QemuServer/Network.pm `tag`); 64 TiB of disk is beyond any
    /// Talos node; a VM has at most KVM's `KVM_MAX_VCPUS` (4096, linux
    /// arch/x86/include/asm/kvm_host.h) cores.
    fn machine(&mut self, at: &str, whose: &str, m: &NodeMachine) {
        let sizes = [
            ("cores", m.cores, 1, MAX_VCPUS),
            ("memory", m.memory, 2048, 4_194_304),
            ("diskSize", m.disk_size, 10, 65_536),
        ];
        for (field, value, min, max) in sizes {
            let Some(value) = value else { continue };
            if value < min {
                self.problem(
                    format!("{at}.{field}"),
                    format!("{whose}{value} is below the {min} Talos needs"),
                );
            } else if value > max {
                self.problem(
                    format!("{at}.{field}"),
                    format!("{whose}{value} is above the largest value Proxmox takes ({max})"),
                );
            }
        }
        let disks = m.data_disks.unwrap_or_default();
        if disks.len() > 29 {
            self.problem(
                format!("{at}.dataDisks"),
                format!(
                    "{whose}{} data disks: a VM has scsi1..scsi29 for them",
                    disks.len()
                ),
            );
        }
        for (j, &size) in disks.iter().enumerate() {
            if !(1..=65_536).contains(&size) {
                self.problem(
                    format!("{at}.dataDisks[{j}]"),
                    format!("{whose}{size} GiB: a data disk is 1..65536 GiB"),
                );
            }
        }
        if let Some(bridge) = m.bridge
            && !is_bridge_name(bridge)
        {
            self.problem(
                format!("{at}.bridge"),
                format!(
                    "{whose}{} is not a bridge name such as vmbr0 (Linux allows 15 characters)",
                    crate::input::quote(bridge)
                ),
            );
        }
        if let Some(tag) = m.vlan
            && !(1..=4094).contains(&tag)
        {
            self.problem(
                format!("{at}.vlan"),
                format!("{whose}VLAN tag {tag} is outside 1..4094"),
            );
        }
    }

    fn hcloud(&mut self) {
        let (section, cx) = (self.section, self.cx);
        let Some(hc) = &section.hcloud else {
            return;
        };
        if section.proxmox.is_some() {
            self.problem(
                "publish.hcloud",
                "publish has both proxmox and hcloud: an inventory publishes to one target",
            );
        }
        if cx.platform != "hcloud" {
            self.problem(
                "image.platform",
                format!(
                    "publish.hcloud needs image.platform: hcloud (it is {:?}; Hetzner servers boot only hcloud images)",
                    cx.platform
                ),
            );
        }
        if !cx.raw {
            self.problem(
                "image.format",
                "publish.hcloud writes the image to a disk with dd: image.format must be raw",
            );
        }
        let is_name = |s: &str| {
            !s.is_empty()
                && s.len() <= 63
                && s.bytes()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
        };
        if !is_name(&hc.location) {
            self.problem(
                "publish.hcloud.location",
                format!(
                    "{:?} is not a Hetzner location name such as fsn1",
                    hc.location
                ),
            );
        }
        for (i, t) in hc.server_types.iter().enumerate() {
            if !is_name(t) {
                self.problem(
                    format!("publish.hcloud.serverTypes[{i}]"),
                    format!("{t:?} is not a server type name such as cx23"),
                );
            }
        }
        for (k, v) in &hc.labels {
            if RESERVED_LABELS.contains(&k.as_str()) {
                self.problem(
                    format!("publish.hcloud.labels.{k}"),
                    format!("label {k} is set by imgbuild itself; choose another key"),
                );
            } else if let Some(p) = label_problem(k, v) {
                self.problem(format!("publish.hcloud.labels.{k}"), p);
            }
        }
        if let Some(servers) = &hc.servers
            && !is_name(&servers.server_type)
        {
            self.problem(
                "publish.hcloud.servers.type",
                format!(
                    "{:?} is not a server type name such as cpx22",
                    servers.server_type
                ),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(yaml: &str) -> PublishSection {
        serde_yaml_ng::from_str(yaml).unwrap()
    }

    #[test]
    fn node_server_types_and_locations_need_servers_and_names() {
        let with = section("hcloud: {location: fsn1, servers: {type: cpx22}}");
        let without = section("hcloud: {location: fsn1}");
        let nodes = [
            ("cp-01", None, None),
            ("w-01", Some("cax21"), Some("nbg1")),
            ("w-02", Some("CAX21"), Some("nbg 1")),
        ];
        let fields = |p: Vec<(String, String)>| p.into_iter().map(|(f, _)| f).collect::<Vec<_>>();
        assert_eq!(
            fields(hcloud_node_problems(&with, &nodes)),
            ["nodes[2].serverType", "nodes[2].location"]
        );
        let p = hcloud_node_problems(&without, &nodes[..2]);
        assert_eq!(
            fields(p.clone()),
            ["nodes[1].serverType", "nodes[1].location"]
        );
        assert!(
            p[0].1
                .contains("node w-01: serverType needs publish.hcloud.servers"),
            "{p:?}"
        );
    }
}
