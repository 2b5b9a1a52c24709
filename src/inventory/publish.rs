//! The inventory's `publish` section: where built images go. Credentials
//! never live here; they come from the environment at publish time.

use super::{Inventory, Validator};
use serde::{Deserialize, Serialize};

/// Publishing targets; at most one is used per inventory.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PublishSettings {
    #[serde(default)]
    pub proxmox: Option<ProxmoxSettings>,
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
    #[serde(default = "default_start")]
    pub start: bool,
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

impl Inventory {
    /// The vmid of the node at `index`: its own `vmid`, else `firstId + index`.
    pub fn vmid(&self, index: usize) -> Option<u32> {
        let node = self.nodes.get(index)?;
        node.vmid.or_else(|| {
            let first = self.publish.proxmox.as_ref()?.vm.as_ref()?.first_id?;
            first.checked_add(u32::try_from(index).ok()?)
        })
    }
}

/// Proxmox storage and node identifiers (`pve-storage-id`, `pve-node`).
fn is_pve_id(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

impl Validator<'_> {
    pub(super) fn check_publish(&mut self, inv: &Inventory) {
        let Some(px) = &inv.publish.proxmox else {
            if let Some((i, _)) = inv.nodes.iter().enumerate().find(|(_, n)| n.vmid.is_some()) {
                self.problem(
                    format!("nodes[{i}].vmid"),
                    "vmid needs publish.proxmox.vm (there is no Proxmox target)",
                );
            }
            return;
        };
        for (field, value) in [
            ("publish.proxmox.node", &px.node),
            ("publish.proxmox.storage", &px.storage),
        ] {
            if !is_pve_id(value) {
                self.problem(
                    field,
                    format!("{value:?} is not a Proxmox identifier (a letter, then letters, digits, '-', '_', '.')"),
                );
            }
        }
        if let Some(fp) = &px.fingerprint
            && let Err(e) = fp.parse::<crate::net::Fingerprint>()
        {
            self.problem("publish.proxmox.fingerprint", e);
        }
        let Some(vm) = &px.vm else {
            if let Some((i, _)) = inv.nodes.iter().enumerate().find(|(_, n)| n.vmid.is_some()) {
                self.problem(
                    format!("nodes[{i}].vmid"),
                    "vmid needs publish.proxmox.vm (without it imgbuild only uploads)",
                );
            }
            return;
        };
        if !is_pve_id(&vm.storage) {
            self.problem(
                "publish.proxmox.vm.storage",
                format!("{:?} is not a Proxmox storage identifier", vm.storage),
            );
        }
        if !is_pve_id(&vm.bridge) {
            self.problem(
                "publish.proxmox.vm.bridge",
                format!("{:?} is not a bridge name such as vmbr0", vm.bridge),
            );
        }
        for (field, value, min) in [
            ("cores", vm.cores, 1),
            ("memory", vm.memory, 2048),
            ("diskSize", vm.disk_size, 10),
        ] {
            if value < min {
                self.problem(
                    format!("publish.proxmox.vm.{field}"),
                    format!("{value} is below the {min} Talos needs"),
                );
            }
        }
        let mut seen: Vec<(u32, &str)> = Vec::new();
        for (i, node) in inv.nodes.iter().enumerate() {
            let at = format!("nodes[{i}]");
            match inv.vmid(i) {
                None => self.problem(
                    format!("{at}.name"),
                    format!(
                        "node {}: no vmid (set publish.proxmox.vm.firstId or the node's vmid)",
                        node.name
                    ),
                ),
                Some(id) if !VMID_RANGE.contains(&u64::from(id)) => self.problem(
                    format!("{at}.vmid"),
                    format!("node {}: vmid {id} is outside 100..999999999", node.name),
                ),
                Some(id) => {
                    if let Some((_, other)) = seen.iter().find(|(v, _)| *v == id) {
                        self.problem(
                            format!("{at}.vmid"),
                            format!("node {}: vmid {id} is already node {other}'s", node.name),
                        );
                    }
                    seen.push((id, &node.name));
                }
            }
        }
    }
}
