//! The Proxmox double's deleting side, as qemu-server and pve-storage do it:
//! - `GET /cluster/resources` (`type` vm|storage|node): every VM with its
//!   node and status (pve-manager `PVE/API2/Cluster.pm` `resources`).
//! - `POST /nodes/{node}/qemu/{vmid}/status/shutdown` (`timeout`,
//!   `forceStop`): task `qmshutdown`; the guest honours ACPI (Talos's
//!   machined shuts down on the power button), so the VM stops and its
//!   Talos node halts. With `--fail-task qmshutdown` the task fails as a
//!   guest that ignores ACPI makes it fail ("VM quit/powerdown failed"),
//!   and the VM keeps running.
//! - `DELETE /nodes/{node}/qemu/{vmid}` (`purge`,
//!   `destroy-unreferenced-disks`, `skiplock`), qemu-server
//!   `src/PVE/API2/Qemu.pm` `destroy_vm`: a missing VM is "Configuration
//!   file … does not exist"; a locked one is refused without `skiplock`;
//!   one in HA resources is refused without `purge` ("used in HA resources
//!   and purge parameter not set"); a running one is refused ("VM N is
//!   running - destroy failed"). The `qmdestroy` task frees the volumes the
//!   VM owns (named `vm-<vmid>-…`; cdroms and other VMs' volumes stay,
//!   `src/PVE/QemuServer.pm` `destroy_vm`), with
//!   `destroy-unreferenced-disks` also every other `vm-<vmid>-…` volume of
//!   the images storages, and with `purge` drops the vmid from HA.
//! - `GET/POST /cluster/ha/resources` (`sid` `vm:<vmid>` or `<vmid>`): the
//!   HA resources, so a test can put a VM under HA.
//! - `GET /nodes/{node}/storage/{storage}/content` for a storage holding
//!   VM disks, or with `vmid`: the `vm-<vmid>-…` volumes (filtered by
//!   `vmid`), as pve-storage lists images.
//!
//! `DELETE …/storage/{storage}/content/{volume}` (in `proxmox.rs`) frees a
//! volume whether or not a VM uses it, as pve-storage's `vdisk_free` does:
//! the client must check.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};

use super::config::{is_drive, split_drive, volume_owner};
use super::power::power_off;
use super::state::{ApiResult, Pve, die};

/// The cluster's HA resources (vmids). One simulated cluster per process.
static HA: Mutex<BTreeSet<u32>> = Mutex::new(BTreeSet::new());

fn flag(p: &BTreeMap<String, String>, key: &str) -> bool {
    p.get(key).is_some_and(|v| v == "1" || v == "true")
}

impl Pve {
    /// The routes this file answers; None for the others.
    pub(super) fn destroy_routes(
        self: &Arc<Self>,
        method: &str,
        path: &str,
        p: &BTreeMap<String, String>,
    ) -> Option<ApiResult> {
        let vmid = || {
            p.get("vmid")
                .and_then(|v| v.parse::<u32>().ok())
                .unwrap_or(0)
        };
        Some(match (method, path) {
            ("GET", "/cluster/resources") => Ok(self.resources(p.get("type").map(String::as_str))),
            ("GET", "/cluster/ha/resources") => Ok(json!(
                HA.lock()
                    .unwrap()
                    .iter()
                    .map(|id| json!({"sid": format!("vm:{id}"), "type": "vm", "state": "started"}))
                    .collect::<Vec<_>>()
            )),
            ("POST", "/cluster/ha/resources") => self.add_ha(&p["sid"]),
            ("POST", "/nodes/{node}/qemu/{vmid}/status/shutdown") => self.shutdown(vmid()),
            ("DELETE", "/nodes/{node}/qemu/{vmid}") => self.destroy(vmid(), p),
            ("GET", "/nodes/{node}/storage/{storage}/content")
                if p.contains_key("vmid")
                    || self
                        .storage(&p["storage"])
                        .is_ok_and(|s| s.content.contains(&"images")) =>
            {
                self.list_disks(p)
            }
            _ => return None,
        })
    }

    fn resources(&self, kind: Option<&str>) -> Value {
        let node = &self.args.node;
        let mut out = Vec::new();
        if kind.is_none_or(|k| k == "node") {
            out.push(json!({"id": format!("node/{node}"), "type": "node", "node": node, "status": "online"}));
        }
        if kind.is_none_or(|k| k == "storage") {
            for s in &self.storages {
                out.push(json!({
                    "id": format!("storage/{node}/{}", s.id), "type": "storage", "node": node,
                    "storage": s.id, "plugintype": s.kind, "content": s.content.join(","),
                    "shared": 0, "status": "available",
                }));
            }
        }
        if kind.is_none_or(|k| k == "vm") {
            for (id, vm) in self.vms.lock().unwrap().iter() {
                out.push(json!({
                    "id": format!("qemu/{id}"), "type": "qemu", "vmid": id, "node": node,
                    "name": vm.config.get("name"), "template": 0,
                    "status": if vm.running { "running" } else { "stopped" },
                }));
            }
        }
        json!(out)
    }

    fn add_ha(&self, sid: &str) -> ApiResult {
        let id = sid.strip_prefix("vm:").unwrap_or(sid);
        let vmid: u32 = id
            .parse()
            .map_err(|_| die(format!("unable to parse service id '{sid}'")))?;
        self.vm(vmid)?;
        if !HA.lock().unwrap().insert(vmid) {
            return Err(die(format!("resource ID 'vm:{vmid}' already defined")));
        }
        Ok(Value::Null)
    }

    fn shutdown(self: &Arc<Self>, vmid: u32) -> ApiResult {
        let vm = self.vm(vmid)?;
        if !vm.running {
            return Err(die(format!("VM {vmid} not running")));
        }
        Ok(
            self.spawn_task("qmshutdown", &vmid.to_string(), move |pve, log| {
                let mut vm = pve.vm(vmid).map_err(|e| e.message)?;
                power_off(pve, &mut vm, log);
                if let Some(current) = pve.vms.lock().unwrap().get_mut(&vmid) {
                    current.running = false;
                    current.booted_ip = None;
                    current.installed = vm.installed;
                }
                Ok(())
            }),
        )
    }

    fn destroy(self: &Arc<Self>, vmid: u32, p: &BTreeMap<String, String>) -> ApiResult {
        let vm = self.vm(vmid)?;
        if let Some(lock) = vm.config.get("lock")
            && !flag(p, "skiplock")
        {
            return Err(die(format!("VM is locked ({lock})")));
        }
        let purge = flag(p, "purge");
        if !purge && HA.lock().unwrap().contains(&vmid) {
            return Err(die(format!(
                "unable to remove VM {vmid} - used in HA resources and purge parameter not set."
            )));
        }
        if vm.running {
            return Err(die(format!("VM {vmid} is running - destroy failed")));
        }
        let unreferenced = flag(p, "destroy-unreferenced-disks");
        Ok(
            self.spawn_task("qmdestroy", &vmid.to_string(), move |pve, log| {
                let mut vm = pve.vms.lock().unwrap().remove(&vmid).unwrap_or_default();
                power_off(pve, &mut vm, log);
                for (k, v) in &vm.config {
                    if !(is_drive(k) || k.starts_with("unused")) {
                        continue;
                    }
                    let (file, opts) = split_drive(v);
                    let cdrom = opts.iter().any(|(k, v)| k == "media" && v == "cdrom");
                    if cdrom || volume_owner(&file) != Some(vmid) {
                        continue;
                    }
                    if let Ok(path) = pve.volume_path(&file)
                        && std::fs::remove_file(path).is_ok()
                    {
                        log.push(format!("  Logical volume \"{file}\" successfully removed."));
                    }
                }
                if unreferenced {
                    for volid in pve.disks_of(Some(vmid)) {
                        if let Ok(path) = pve.volume_path(&volid)
                            && std::fs::remove_file(path).is_ok()
                        {
                            log.push(format!(
                                "  Logical volume \"{volid}\" successfully removed."
                            ));
                        }
                    }
                }
                if purge {
                    log.push(format!("purging VM {vmid} from related configurations.."));
                    if HA.lock().unwrap().remove(&vmid) {
                        log.push(format!(
                            "NOTE: removed VM {vmid} from HA resource configuration."
                        ));
                    }
                }
                Ok(())
            }),
        )
    }

    /// The `vm-<vmid>-…` volumes of the storages holding VM disks (of one
    /// VM, or all).
    fn disks_of(&self, vmid: Option<u32>) -> Vec<String> {
        let mut out = Vec::new();
        for s in self
            .storages
            .iter()
            .filter(|s| s.content.contains(&"images"))
        {
            let Ok(dir) = std::fs::read_dir(self.storage_dir(s.id)) else {
                continue;
            };
            for e in dir.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let Some(stem) = name.strip_suffix(".raw") else {
                    continue;
                };
                let volid = format!("{}:{stem}", s.id);
                if let Some(owner) = volume_owner(&volid)
                    && vmid.is_none_or(|v| v == owner)
                {
                    out.push(volid);
                }
            }
        }
        out.sort();
        out
    }

    fn list_disks(&self, p: &BTreeMap<String, String>) -> ApiResult {
        let s = self.storage(&p["storage"])?;
        let vmid = match p.get("vmid") {
            Some(v) => Some(v.parse::<u32>().map_err(|_| die("invalid vmid"))?),
            None => None,
        };
        let list: Vec<Value> = self
            .disks_of(vmid)
            .into_iter()
            .filter(|v| v.starts_with(&format!("{}:", s.id)))
            .map(|volid| {
                let size = self
                    .volume_path(&volid)
                    .ok()
                    .and_then(|p| std::fs::metadata(p).ok())
                    .map_or(0, |m| m.len());
                json!({
                    "volid": volid, "vmid": volume_owner(&volid), "format": "raw",
                    "size": size, "content": "images",
                })
            })
            .collect();
        Ok(json!(list))
    }
}
