//! An existing VM's settings against the inventory's: each difference
//! planned from → to with how Proxmox lets it change. Pure: it reads a
//! config already fetched. Facts: proxmox/qemu-server `src/PVE/API2/Qemu.pm`
//! (`update_vm_api`: changes to a running VM that cannot be hot-plugged
//! stay pending until the VM is restarted; `resize_vm` grows only) and
//! `src/PVE/QemuServer.pm` (`vmconfig_hotplug_pending`: `memory` online
//! only with `memory` in `hotplug` and NUMA on, `cores` never; `net`
//! bridge and tag online with `network` in `hotplug`, its default).

use serde_json::Value;

use crate::inventory::Machine;

/// How one setting changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Apply {
    /// Takes effect as it is set (hot-plugged, or the VM is stopped).
    Now,
    /// Set now, pending until the VM restarts: imgbuild reboots it, one
    /// node at a time.
    Reboot,
    /// imgbuild does not move a VM between Proxmox hosts: `imgbuild
    /// replace NODE` recreates it.
    Recreate,
}

/// One setting of a node's VM from → to (sizes as `4096` MiB, `20G`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SettingChange {
    /// The inventory field: `memory`, `cores`, `diskSize`, `dataDisks[N]`,
    /// `bridge`, `vlan`, `proxmoxNode`.
    pub field: String,
    pub from: String,
    pub to: String,
    pub apply: Apply,
}

impl std::fmt::Display for SettingChange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let how = match self.apply {
            Apply::Now => "now",
            Apply::Reboot => "with a reboot",
            Apply::Recreate => "cannot change here: recreate with `imgbuild replace NODE`",
        };
        write!(f, "{} {} → {} ({how})", self.field, self.from, self.to)
    }
}

/// A difference Proxmox cannot make: a disk would shrink.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    pub field: String,
    pub message: String,
}

/// The drive holding data disk `j` (`scsi0` is the boot disk).
pub(super) fn data_drive(j: usize) -> String {
    format!("scsi{}", j + 1)
}

/// A config value as text (the API types numbers; older versions send
/// strings).
fn text(config: &Value, key: &str) -> Option<String> {
    match &config[key] {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// One `key=value` option of a property string (`virtio=…,bridge=vmbr0`).
fn option(prop: &str, key: &str) -> Option<String> {
    prop.split(',')
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
        .map(str::to_owned)
}

/// A drive's `size=` in GiB, rounded up (`20G`, `512M`, `1T`).
pub(super) fn drive_gib(drive: &str) -> Option<u64> {
    let size = option(drive, "size")?;
    let (num, unit) = size.split_at(size.find(|c: char| !c.is_ascii_digit())?);
    let n: u64 = num.parse().ok()?;
    let bytes = match unit {
        "K" => n << 10,
        "M" => n << 20,
        "G" => n << 30,
        "T" => n << 40,
        _ => return None,
    };
    Some(bytes.div_ceil(1 << 30))
}

/// `memory` is `4096` or, from qemu-server 8.1, `current=4096,…`.
fn memory_mib(config: &Value) -> Option<u32> {
    let m = text(config, "memory")?;
    let m = option(&m, "current").unwrap_or(m);
    m.parse().ok()
}

/// Whether `hotplug` includes `what`, as qemu-server's
/// `parse_hotplug_features` reads it: `0` none, `1` the default
/// (`network,disk,usb`, not everything), else a list split on commas,
/// semicolons or spaces (`PVE::Tools::split_list`).
fn hotplugs(config: &Value, what: &str) -> bool {
    const DEFAULT: &str = "network,disk,usb";
    let list = text(config, "hotplug").unwrap_or_else(|| DEFAULT.into());
    let list = match list.trim() {
        "0" => return false,
        "1" => DEFAULT,
        other => other,
    };
    list.split([',', ';', ' ', '\t', '\n'])
        .any(|h| h.trim() == what)
}

/// What differs between the VM's `config` (its current values, found on
/// Proxmox node `host`, `running` or not) and `want`. A disk smaller than
/// the VM's is refused.
pub(super) fn plan(
    config: &Value,
    host: &str,
    running: bool,
    want: &Machine,
) -> Result<Vec<SettingChange>, Refused> {
    let mut out = Vec::new();
    let mut add = |field: &str, from: String, to: String, apply: Apply| {
        if from != to {
            out.push(SettingChange {
                field: field.to_owned(),
                from,
                to,
                apply,
            });
        }
    };
    let later = |online: bool| {
        if online || !running {
            Apply::Now
        } else {
            Apply::Reboot
        }
    };
    add(
        "proxmoxNode",
        host.to_owned(),
        want.host.clone(),
        Apply::Recreate,
    );
    let numa = text(config, "numa").as_deref() == Some("1");
    add(
        "memory",
        memory_mib(config).map_or("unset".into(), |m| m.to_string()),
        want.memory.to_string(),
        later(numa && hotplugs(config, "memory")),
    );
    add(
        "cores",
        text(config, "cores").unwrap_or_else(|| "1".into()),
        want.cores.to_string(),
        later(false),
    );
    let net = text(config, "net0").unwrap_or_default();
    let net_now = later(hotplugs(config, "network"));
    add(
        "bridge",
        option(&net, "bridge").unwrap_or_else(|| "unset".into()),
        want.bridge.clone(),
        net_now,
    );
    add(
        "vlan",
        option(&net, "tag").unwrap_or_else(|| "none".into()),
        want.vlan.map_or("none".into(), |t| t.to_string()),
        net_now,
    );
    let disks = std::iter::once(("diskSize".to_owned(), "scsi0".to_owned(), want.disk_size)).chain(
        want.data_disks
            .iter()
            .enumerate()
            .map(|(j, &size)| (format!("dataDisks[{j}]"), data_drive(j), size)),
    );
    for (field, drive, size) in disks {
        let disk_now = later(hotplugs(config, "disk"));
        let from = text(config, &drive);
        match from.as_deref().map(drive_gib) {
            None => add(&field, "none".into(), format!("{size}G"), disk_now),
            Some(None) => add(&field, "unknown".into(), format!("{size}G"), disk_now),
            Some(Some(have)) if have > u64::from(size) => {
                return Err(Refused {
                    message: format!(
                        "{drive} is {have}G and {field} asks {size}G: disks only grow (Proxmox cannot shrink one)"
                    ),
                    field,
                });
            }
            // Growing is online whatever `hotplug` says.
            Some(Some(have)) => add(&field, format!("{have}G"), format!("{size}G"), Apply::Now),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn want() -> Machine {
        Machine {
            host: "pve".into(),
            cores: 2,
            memory: 4096,
            disk_size: 20,
            data_disks: vec![],
            bridge: "vmbr0".into(),
            vlan: None,
        }
    }

    fn config() -> Value {
        json!({"memory": "4096", "cores": 2, "scsi0": "local-lvm:vm-300-disk-1,discard=on,size=20G,ssd=1",
               "net0": "virtio=BC:24:11:00:00:11,bridge=vmbr0"})
    }

    #[test]
    fn a_vm_as_wanted_has_no_changes() {
        assert_eq!(plan(&config(), "pve", true, &want()), Ok(vec![]));
    }

    #[test]
    fn memory_and_cores_wait_for_a_reboot_unless_hot_plugged() {
        let w = Machine {
            memory: 8192,
            cores: 4,
            ..want()
        };
        let changes = plan(&config(), "pve", true, &w).unwrap();
        let got: Vec<(&str, &str, &str, Apply)> = changes
            .iter()
            .map(|c| (c.field.as_str(), c.from.as_str(), c.to.as_str(), c.apply))
            .collect();
        assert_eq!(
            got,
            [
                ("memory", "4096", "8192", Apply::Reboot),
                ("cores", "2", "4", Apply::Reboot)
            ]
        );
        let mut hot = config();
        hot["hotplug"] = json!("network,disk,memory");
        hot["numa"] = json!(1);
        let changes = plan(&hot, "pve", true, &w).unwrap();
        assert_eq!(changes[0].apply, Apply::Now);
        assert_eq!(changes[1].apply, Apply::Reboot);
        let stopped = plan(&config(), "pve", false, &w).unwrap();
        assert!(stopped.iter().all(|c| c.apply == Apply::Now));
    }

    #[test]
    fn hotplug_1_is_the_default_set_so_memory_waits_for_a_reboot() {
        let w = Machine {
            memory: 8192,
            ..want()
        };
        let mut one = config();
        one["hotplug"] = json!("1");
        one["numa"] = json!(1);
        let changes = plan(&one, "pve", true, &w).unwrap();
        assert_eq!(changes[0].field, "memory");
        assert_eq!(
            changes[0].apply,
            Apply::Reboot,
            "hotplug 1 is network,disk,usb"
        );
        // Its network part is still online.
        let vlan = Machine {
            vlan: Some(20),
            ..want()
        };
        assert_eq!(plan(&one, "pve", true, &vlan).unwrap()[0].apply, Apply::Now);
        // `0` is none; a list may be split by `;` or spaces as well.
        one["hotplug"] = json!("0");
        assert_eq!(
            plan(&one, "pve", true, &vlan).unwrap()[0].apply,
            Apply::Reboot
        );
        one["hotplug"] = json!("disk; memory");
        assert_eq!(plan(&one, "pve", true, &w).unwrap()[0].apply, Apply::Now);
    }

    #[test]
    fn bridge_vlan_disks_and_host_are_planned() {
        let w = Machine {
            host: "pve2".into(),
            bridge: "vmbr1".into(),
            vlan: Some(20),
            disk_size: 30,
            data_disks: vec![50],
            ..want()
        };
        let changes = plan(&config(), "pve", true, &w).unwrap();
        let got: Vec<(&str, &str, &str, Apply)> = changes
            .iter()
            .map(|c| (c.field.as_str(), c.from.as_str(), c.to.as_str(), c.apply))
            .collect();
        assert_eq!(
            got,
            [
                ("proxmoxNode", "pve", "pve2", Apply::Recreate),
                ("bridge", "vmbr0", "vmbr1", Apply::Now),
                ("vlan", "none", "20", Apply::Now),
                ("diskSize", "20G", "30G", Apply::Now),
                ("dataDisks[0]", "none", "50G", Apply::Now),
            ]
        );
    }

    #[test]
    fn a_smaller_disk_is_refused_naming_the_field() {
        let w = Machine {
            disk_size: 10,
            ..want()
        };
        let err = plan(&config(), "pve", true, &w).unwrap_err();
        assert_eq!(err.field, "diskSize");
        assert!(err.message.contains("scsi0 is 20G"), "{}", err.message);
        assert_eq!(drive_gib("x,size=512M"), Some(1));
        assert_eq!(drive_gib("x,size=1T"), Some(1024));
    }
}
