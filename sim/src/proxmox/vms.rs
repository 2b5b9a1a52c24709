//! VMs (qemu-server `PVE/API2/Qemu.pm`): listing, creating with drives
//! allocated and imported, updating the config (hotplug or pending), deleting
//! unused volumes, resizing.

use super::config::*;
use super::power::*;
use super::schema::Errors;
use super::state::*;
use super::storage::*;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::Arc;

impl Pve {
    pub(crate) fn vm(&self, vmid: u32) -> Result<Vm, ApiError> {
        self.vms.lock().unwrap().get(&vmid).cloned().ok_or_else(|| {
            die(format!(
                "Configuration file 'nodes/{}/qemu-server/{vmid}.conf' does not exist",
                self.args.node
            ))
        })
    }

    /// The cluster's nodes: `--node` first.
    pub(crate) fn hosts(&self) -> impl Iterator<Item = &String> {
        std::iter::once(&self.args.node).chain(&self.args.other_nodes)
    }

    pub(crate) fn list_vms(&self, node: &str) -> Value {
        let vms = self.vms.lock().unwrap();
        let list: Vec<Value> = vms
            .iter()
            .filter(|(_, vm)| vm.host == node)
            .map(|(id, vm)| {
                let mem: u64 = vm
                    .config
                    .get("memory")
                    .and_then(|m| m.trim_start_matches("current=").parse().ok())
                    .unwrap_or(512);
                json!({
                    "vmid": id, "name": vm.config.get("name"),
                    "status": if vm.running { "running" } else { "stopped" },
                    "maxmem": mem << 20, "cpus": vm.config.get("cores").and_then(|c| c.parse::<u64>().ok()).unwrap_or(1),
                })
            })
            .collect();
        json!(list)
    }

    pub(crate) fn create_vm(self: &Arc<Self>, p: &BTreeMap<String, String>) -> ApiResult {
        let vmid: u32 = p["vmid"].parse().unwrap_or(0);
        let mut config = BTreeMap::new();
        for (k, v) in p {
            if !matches!(
                k.as_str(),
                "node"
                    | "vmid"
                    | "start"
                    | "storage"
                    | "pool"
                    | "force"
                    | "unique"
                    | "archive"
                    | "bwlimit"
                    | "live-restore"
                    | "import-working-storage"
            ) {
                config.insert(k.clone(), v.clone());
            }
        }
        for (k, v) in &config {
            if is_drive(k) {
                super::secureboot::check_drive_param(k, v)
                    .and_then(|()| self.check_drive(v))
                    .map_err(|e| param_exc(Errors::from([(k.clone(), e)])))?;
            }
        }
        // The real server reserves the vmid here (create_and_lock_config); the
        // simulator enters the VM when the worker succeeds, so a failed
        // create leaves nothing behind.
        if self.vms.lock().unwrap().contains_key(&vmid) {
            return Err(die(format!(
                "unable to create VM {vmid} - VM {vmid} already exists on node '{}'",
                self.args.node
            )));
        }
        bump(&self.stats.vm_creates);
        let start = p.get("start").is_some_and(|s| s == "1");
        if start {
            bump(&self.stats.starts);
        }
        let host = p["node"].clone();
        let upid = self.spawn_task("qmcreate", &vmid.to_string(), move |pve, log| {
            let res = (|| {
                let mut built = BTreeMap::new();
                let mut taken = Vec::new();
                // The EFI disk is allocated first (disk-0), then the others in order.
                let mut keys: Vec<&String> = config.keys().collect();
                keys.sort_by_key(|k| !k.starts_with("efidisk"));
                for k in keys {
                    let v = &config[k];
                    let v = if is_drive(k) {
                        pve.create_drive(vmid, v, &mut taken, log)?
                    } else if k.starts_with("net") {
                        with_mac(v, vmid)
                    } else {
                        v.clone()
                    };
                    built.insert(k.clone(), v);
                }
                built.insert("smbios1".into(), format!("uuid={}", uuid_for(vmid, 1)));
                built.insert("vmgenid".into(), uuid_for(vmid, 2));
                built.insert(
                    "meta".into(),
                    format!("creation-qemu=10.0.2,ctime={}", now()),
                );
                Ok::<_, String>(built)
            })();
            let mut vm = Vm {
                config: res?,
                host,
                ..Vm::default()
            };
            if start {
                power_on(pve, vmid, &mut vm, log);
            }
            pve.vms.lock().unwrap().insert(vmid, vm);
            Ok(())
        });
        Ok(upid)
    }

    /// `$check_drive_param`: a new disk needs a storage with `images`, an
    /// import a source volume of `import` or `images` content.
    pub(crate) fn check_drive(&self, value: &str) -> Result<(), String> {
        let (file, opts) = split_drive(value);
        let Some((sid, size)) = file.split_once(':') else {
            return Ok(());
        };
        if size.parse::<f64>().is_err() {
            return Ok(());
        }
        let s = self.storage(sid).map_err(|e| e.message)?;
        if !s.content.contains(&"images") {
            return Err(format!(
                "storage '{sid}' does not support content-type 'images'"
            ));
        }
        if let Some((_, src)) = opts.iter().find(|(k, _)| k == "import-from") {
            let (_, name) = src.split_once(':').unwrap_or(("", src));
            if name.starts_with("iso/")
                || name.starts_with("vztmpl/")
                || name.starts_with("backup/")
            {
                return Err(format!(
                    "'import-from': wrong content type for volume '{src}'"
                ));
            }
        }
        Ok(())
    }

    /// Allocates a new disk (`STORAGE:SIZE[,import-from=…]`) as
    /// `vm-<vmid>-disk-<n>`; any other drive string is kept as given.
    pub(crate) fn create_drive(
        &self,
        vmid: u32,
        value: &str,
        taken: &mut Vec<u32>,
        log: &mut Vec<String>,
    ) -> Result<String, String> {
        let (file, opts) = split_drive(value);
        let Some((sid, size)) = file.split_once(':') else {
            return Ok(value.to_owned());
        };
        let Ok(gib) = size.parse::<f64>() else {
            return Ok(value.to_owned());
        };
        let dir = self.storage_dir(sid);
        let n = (0..)
            .find(|n| !taken.contains(n) && !dir.join(format!("vm-{vmid}-disk-{n}.raw")).exists())
            .expect("a free disk number");
        taken.push(n);
        let name = format!("vm-{vmid}-disk-{n}");
        let path = dir.join(format!("{name}.raw"));
        let import = opts
            .iter()
            .find(|(k, _)| k == "import-from")
            .map(|(_, v)| v.clone());
        // EFI vars and TPM state are small fixed-size volumes (Drive.pm:
        // "SIZE_IN_GiB is ignored here and 4 MiB will be used instead").
        let is_efi = opts.iter().any(|(k, _)| k == "efitype" || k == "version");
        let bytes = if let Some(src) = &import {
            let from = self.volume_path(src)?;
            if !from.exists() {
                return Err(format!("volume '{src}' does not exist"));
            }
            let format = from
                .extension()
                .and_then(|e| e.to_str())
                .unwrap_or("raw")
                .to_owned();
            log.push(format!("importing disk '{src}' to VM {vmid} ..."));
            let size = qemu_img_info(&from, &format)?;
            // qemu-img writes a sparse raw file, as lvmthin holds raw.
            let ok = std::process::Command::new("qemu-img")
                .args(["convert", "-f", &format, "-O", "raw"])
                .arg(&from)
                .arg(&path)
                .status()
                .is_ok_and(|s| s.success());
            if !ok {
                let _ = std::fs::remove_file(&path);
                return Err(format!(
                    "import failed - qemu-img convert of '{src}' failed"
                ));
            }
            log.push(format!("Successfully imported disk as '{sid}:{name}'"));
            size
        } else {
            // EFI vars are copied at their fixed size; lvmthin rounds to 4 MiB.
            let bytes = if is_efi {
                4 << 20
            } else {
                (gib * (1u64 << 30) as f64) as u64
            };
            let f = std::fs::File::create(&path).map_err(|e| e.to_string())?;
            f.set_len(bytes).map_err(|e| e.to_string())?;
            log.push(format!("  Logical volume \"{name}\" created."));
            bytes
        };
        let mut opts: Vec<(String, String)> = opts
            .into_iter()
            .filter(|(k, _)| k != "import-from" && k != "size")
            .collect();
        opts.push(("size".into(), format_size(bytes)));
        Ok(print_drive(&format!("{sid}:{name}"), opts))
    }

    pub(crate) fn update_config(
        self: &Arc<Self>,
        vmid: u32,
        p: &BTreeMap<String, String>,
        asynchronous: bool,
    ) -> ApiResult {
        self.vm(vmid)?;
        let mut changes = BTreeMap::new();
        for (k, v) in p {
            if !matches!(
                k.as_str(),
                "node"
                    | "vmid"
                    | "delete"
                    | "digest"
                    | "force"
                    | "skiplock"
                    | "revert"
                    | "background_delay"
            ) {
                changes.insert(k.clone(), v.clone());
            }
        }
        let current = self.vm(vmid)?.config;
        for (k, v) in &changes {
            if is_drive(k) {
                super::secureboot::check_drive_param(k, v)
                    .and_then(|()| self.check_drive(v))
                    .map_err(|e| param_exc(Errors::from([(k.clone(), e)])))?;
            }
            if k == "tpmstate0" {
                super::secureboot::check_tpm_change(current.get(k).map(String::as_str), v)
                    .map_err(die)?;
            }
        }
        let deletes: Vec<String> = p
            .get("delete")
            .map(|d| {
                d.split([',', ';', ' '])
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        bump(&self.stats.vm_config_changes);
        let apply = move |pve: &Pve, log: &mut Vec<String>| -> Result<(), String> {
            let mut vm = pve.vm(vmid).map_err(|e| e.message)?;
            for d in &deletes {
                let Some(old) = vm.config.remove(d) else {
                    continue;
                };
                if d.starts_with("unused") {
                    pve.deallocate_unused(vmid, &vm.config, &old, log)?;
                } else if is_drive(d) {
                    move_to_unused(&mut vm.config, &old, vmid);
                }
            }
            let mut taken = Vec::new();
            for (k, v) in &changes {
                let v = if is_drive(k) {
                    let new = pve.create_drive(vmid, v, &mut taken, log)?;
                    if let Some(old) = vm.config.get(k).cloned()
                        && split_drive(&old).0 != split_drive(&new).0
                    {
                        move_to_unused(&mut vm.config, &old, vmid);
                    }
                    new
                } else if k.starts_with("net") {
                    with_mac(v, vmid)
                } else {
                    v.clone()
                };
                log.push(format!("update VM {vmid}: -{k} {v}"));
                if vm.running && !hot_pluggable(&vm.config, k) {
                    vm.pending.insert(k.clone(), v);
                } else {
                    vm.pending.remove(k);
                    vm.config.insert(k.clone(), v);
                }
            }
            pve.vms.lock().unwrap().insert(vmid, vm);
            Ok(())
        };
        if asynchronous {
            Ok(self.spawn_task("qmconfig", &vmid.to_string(), apply))
        } else {
            apply(self, &mut Vec::new()).map_err(die)?;
            Ok(Value::Null)
        }
    }

    /// `delete=unusedN` (qemu-server src/PVE/QemuServer.pm
    /// `try_deallocate_drive`): a volume the VM owns is freed, unless a
    /// drive of the config (`config`, the entry already taken out) still
    /// uses it; a volume of another VM only leaves the config.
    pub(crate) fn deallocate_unused(
        &self,
        vmid: u32,
        config: &BTreeMap<String, String>,
        entry: &str,
        log: &mut Vec<String>,
    ) -> Result<(), String> {
        let (file, _) = split_drive(entry);
        if volume_owner(&file) != Some(vmid) {
            return Ok(());
        }
        let in_use = config
            .iter()
            .any(|(k, v)| is_drive(k) && split_drive(v).0 == file);
        if in_use {
            return Err(format!(
                "unable to delete '{file}' - volume is still in use (snapshot?)"
            ));
        }
        let path = self.volume_path(&file)?;
        let _ = std::fs::remove_file(&path);
        log.push(format!("delete unused disk '{file}'"));
        Ok(())
    }

    pub(crate) fn resize(self: &Arc<Self>, vmid: u32, p: &BTreeMap<String, String>) -> ApiResult {
        let vm = self.vm(vmid)?;
        let disk = p["disk"].clone();
        let Some(current) = vm.config.get(&disk).cloned() else {
            return Err(die(format!("disk '{disk}' does not exist")));
        };
        let Some((relative, amount)) = parse_size(&p["size"]) else {
            return Err(param_exc(Errors::from([(
                "size".to_owned(),
                "unable to parse size".to_owned(),
            )])));
        };
        bump(&self.stats.resizes);
        Ok(
            self.spawn_task("qmresize", &vmid.to_string(), move |pve, log| {
                let (file, opts) = split_drive(&current);
                let path = pve.volume_path(&file)?;
                let size = std::fs::metadata(&path).map_err(|e| e.to_string())?.len();
                let new = if relative { size + amount } else { amount };
                if new < size {
                    return Err("shrinking disks is not supported".into());
                }
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .and_then(|f| f.set_len(new))
                    .map_err(|e| e.to_string())?;
                log.push(format!(
                    "  Size of logical volume changed from {size} to {new} bytes."
                ));
                let mut opts: Vec<(String, String)> =
                    opts.into_iter().filter(|(k, _)| k != "size").collect();
                opts.push(("size".into(), format_size(new)));
                if let Some(vm) = pve.vms.lock().unwrap().get_mut(&vmid) {
                    vm.config.insert(disk.clone(), print_drive(&file, opts));
                }
                Ok(())
            }),
        )
    }
}
