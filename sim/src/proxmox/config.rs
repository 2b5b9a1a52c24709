//! VM configuration as qemu-server keeps it (`PVE/QemuServer.pm`,
//! `PVE/QemuServer/Drive.pm`): drive strings, sizes, MAC and UUID defaults,
//! pending changes, hotplug and the config digest.

use super::schema;
use super::schema::Schema;
use super::state::*;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;

/// PVE's `format_size`: the largest unit that divides the size.
pub(crate) fn format_size(bytes: u64) -> String {
    for (unit, shift) in [("T", 40), ("G", 30), ("M", 20), ("K", 10)] {
        if bytes.is_multiple_of(1u64 << shift) && bytes >= 1u64 << shift {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

/// A size like `20G`, `+1G`, `512M` or bytes: (relative, bytes).
pub(crate) fn parse_size(s: &str) -> Option<(bool, u64)> {
    let (plus, s) = match s.strip_prefix('+') {
        Some(rest) => (true, rest),
        None => (false, s),
    };
    let (num, mult) = match s.chars().last()? {
        'K' => (&s[..s.len() - 1], 1u64 << 10),
        'M' => (&s[..s.len() - 1], 1 << 20),
        'G' => (&s[..s.len() - 1], 1 << 30),
        'T' => (&s[..s.len() - 1], 1 << 40),
        _ => (s, 1),
    };
    let n: f64 = num.parse().ok()?;
    (n >= 0.0).then_some((plus, (n * mult as f64) as u64))
}

/// Drive keys: the config entries that hold volumes.
pub(crate) fn is_drive(key: &str) -> bool {
    let stem = key.trim_end_matches(|c: char| c.is_ascii_digit());
    stem.len() < key.len()
        && matches!(
            stem,
            "scsi" | "virtio" | "sata" | "ide" | "efidisk" | "tpmstate"
        )
}

/// Splits a drive string into its volume and its options, in order.
pub(crate) fn split_drive(value: &str) -> (String, Vec<(String, String)>) {
    let mut parts = value.split(',');
    let mut file = parts.next().unwrap_or_default().to_owned();
    let mut opts = Vec::new();
    for p in parts {
        match p.split_once('=') {
            Some(("file", v)) => file = v.to_owned(),
            Some((k, v)) => opts.push((k.to_owned(), v.to_owned())),
            None => {}
        }
    }
    if let Some(v) = file.strip_prefix("file=") {
        file = v.to_owned();
    }
    (file, opts)
}

/// A drive string as PVE prints it: the volume, then options sorted.
pub(crate) fn print_drive(file: &str, mut opts: Vec<(String, String)>) -> String {
    opts.sort();
    let mut s = file.to_owned();
    for (k, v) in opts {
        s.push_str(&format!(",{k}={v}"));
    }
    s
}

/// Replacing or deleting a disk keeps its volume as the first free
/// `unusedN`, once, and only when the VM owns it (qemu-server
/// src/PVE/QemuServer.pm `vmconfig_register_unused_drive`, pve-guest-common
/// `add_unused_volume`): another VM's volume just leaves the config.
pub(crate) fn move_to_unused(config: &mut BTreeMap<String, String>, old: &str, vmid: u32) {
    let (file, _) = split_drive(old);
    if volume_owner(&file) != Some(vmid)
        || config
            .iter()
            .any(|(k, v)| k.starts_with("unused") && *v == file)
    {
        return;
    }
    let n = (0..)
        .find(|n| !config.contains_key(&format!("unused{n}")))
        .expect("a free unused slot");
    config.insert(format!("unused{n}"), file);
}

/// The VM a volume belongs to by its name (`vm-<vmid>-…`, `base-<vmid>-…`),
/// as pve-storage's `parse_volname` gives it; None for ISO, import and
/// other volumes no VM owns.
pub(crate) fn volume_owner(volid: &str) -> Option<u32> {
    let name = volid.split_once(':')?.1;
    let rest = name
        .strip_prefix("vm-")
        .or_else(|| name.strip_prefix("base-"))?;
    let (id, disk) = rest.split_once('-')?;
    (!disk.is_empty()).then_some(())?;
    id.parse().ok()
}

/// `add_random_macs`: a NIC without a MAC gets one (Proxmox's BC:24:11 prefix).
pub(crate) fn with_mac(net: &str, vmid: u32) -> String {
    let mut parts: Vec<String> = net.split(',').map(str::to_owned).collect();
    let models = ["virtio", "e1000", "rtl8139", "vmxnet3", "e1000e"];
    if let Some(first) = parts.first_mut()
        && models.contains(&first.as_str())
    {
        *first = format!(
            "{first}=BC:24:11:{:02X}:{:02X}:{:02X}",
            (vmid >> 16) as u8,
            (vmid >> 8) as u8,
            vmid as u8
        );
    }
    if let Some(i) = parts.iter().position(|p| p.starts_with("model=")) {
        let model = parts.remove(i)[6..].to_owned();
        let mac = parts
            .iter()
            .position(|p| p.starts_with("macaddr="))
            .map(|j| parts.remove(j)[8..].to_owned())
            .unwrap_or_else(|| {
                format!(
                    "BC:24:11:{:02X}:{:02X}:{:02X}",
                    (vmid >> 16) as u8,
                    (vmid >> 8) as u8,
                    vmid as u8
                )
            });
        parts.insert(0, format!("{model}={mac}"));
    }
    parts.join(",")
}

/// A stable UUID-shaped string for a VM's generated ids.
pub(crate) fn uuid_for(vmid: u32, salt: u8) -> String {
    let h = Sha256::digest([&vmid.to_be_bytes()[..], &[salt]].concat());
    let x: String = h.iter().take(16).map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &x[..8],
        &x[8..12],
        &x[12..16],
        &x[16..20],
        &x[20..32]
    )
}

/// `GET …/config`: each value typed as the config schema says, plus `digest`.
pub(crate) fn vm_config_json(vm: &Vm, with_pending: bool) -> Value {
    let mut config = vm.config.clone();
    if with_pending {
        config.extend(vm.pending.clone());
    }
    let Some(Ok(route)) = Schema::get().route("PUT", "/nodes/n/qemu/100/config") else {
        return json!(config);
    };
    let mut c = serde_json::Map::new();
    for (k, v) in &config {
        c.insert(k.clone(), schema::typed(route.method, k, v));
    }
    c.insert("digest".into(), json!(config_digest(&vm.config)));
    Value::Object(c)
}

/// `GET …/pending` (qemu-server `vm_pending`): every key with its current
/// value, and `pending` where a change waits for the next start.
pub(crate) fn vm_pending_json(vm: &Vm) -> Value {
    let keys: std::collections::BTreeSet<&String> =
        vm.config.keys().chain(vm.pending.keys()).collect();
    let list: Vec<Value> = keys
        .into_iter()
        .map(|k| {
            let mut e = json!({"key": k});
            if let Some(v) = vm.config.get(k) {
                e["value"] = json!(v);
            }
            if let Some(v) = vm.pending.get(k) {
                e["pending"] = json!(v);
            }
            e
        })
        .collect();
    json!(list)
}

/// Whether qemu-server changes `key` of a running VM now or leaves it
/// pending until the next start (src/PVE/QemuServer.pm
/// `vmconfig_hotplug_pending`, `$fast_plug_option`): the `hotplug`
/// features decide for NICs (`network`), disks (`disk`) and vCPUs
/// (`cpu`); memory needs `memory` there AND NUMA on
/// (`PVE::QemuServer::Memory::qemu_memory_hotplug` dies "NUMA needs to be
/// enabled for memory hotplug", the change stays pending); cores, sockets,
/// CPU type, NUMA, machine and firmware are never hot-plugged.
pub(crate) fn hot_pluggable(config: &BTreeMap<String, String>, key: &str) -> bool {
    let features = hotplug_features(config.get("hotplug").map_or("1", String::as_str));
    let has = |what: &str| features.contains(&what);
    match key {
        "memory" => has("memory") && config.get("numa").is_some_and(|n| n == "1"),
        "vcpus" => has("cpu"),
        "cores" | "sockets" | "cpu" | "numa" | "machine" | "bios" | "balloon" | "hotplug" => false,
        k if k.starts_with("net") => has("network"),
        k if is_drive(k) && !k.starts_with("ide") => has("disk"),
        _ => true,
    }
}

/// qemu-server `parse_hotplug_features` (PVE 8/9, src/PVE/QemuServer.pm):
/// `0` is none, `1` the schema default `network,disk,usb` (not every
/// feature), else the comma list as written. Unset is the default too.
pub(crate) fn hotplug_features(value: &str) -> Vec<&str> {
    match value {
        "0" => Vec::new(),
        "1" => vec!["network", "disk", "usb"],
        list => list
            .split([',', ';', ' '])
            .filter(|f| !f.is_empty())
            .collect(),
    }
}

pub(crate) fn config_digest(config: &BTreeMap<String, String>) -> String {
    let text: String = config.iter().map(|(k, v)| format!("{k}: {v}\n")).collect();
    Sha256::digest(text.as_bytes())
        .iter()
        .take(20)
        .map(|b| format!("{b:02x}"))
        .collect()
}
