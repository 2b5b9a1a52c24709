//! The API's routes (pve-manager `PVE/API2.pm` and the per-module paths):
//! method and path to the handler, with the schema check of every request.

use super::config::*;
use super::state::*;
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::Arc;

impl Pve {
    /// Request routing by the schema's path template.
    pub(crate) fn dispatch(
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
        // A VM is reached through its own node only (its config file is in
        // that node's directory of the cluster filesystem).
        if path.starts_with("/nodes/{node}/qemu/{vmid}")
            && let Some(vm) = self.vms.lock().unwrap().get(&vmid())
            && vm.host != p["node"]
        {
            return Some(Err(die(format!(
                "Configuration file 'nodes/{}/qemu-server/{}.conf' does not exist",
                p["node"],
                vmid()
            ))));
        }
        if let Some(answer) = self.destroy_routes(method, path, p) {
            return Some(answer);
        }
        Some(match (method, path) {
            ("GET", "/version") => Ok(json!({"version": "9.1.1", "release": "9.1", "repoid": "42ab1fbe"})),
            ("GET", "/nodes") => Ok(json!(self.hosts().map(|node| json!({
                "node": node, "status": "online", "type": "node",
                "id": format!("node/{node}"), "maxcpu": 8, "cpu": 0.01,
                "maxmem": 34359738368u64, "mem": 4294967296u64, "uptime": now() - self.started + 1,
            })).collect::<Vec<_>>())),
            ("GET", "/nodes/{node}/storage") => Ok(self.list_storages(p)),
            ("GET", "/nodes/{node}/storage/{storage}/content") => self.list_content(p),
            ("DELETE", "/nodes/{node}/storage/{storage}/content/{volume}") => self.delete_volume(p),
            ("POST", "/nodes/{node}/storage/{storage}/download-url") => self.download_url(p),
            ("GET", "/nodes/{node}/tasks/{upid}/status") => self.task_status(&p["upid"]),
            ("GET", "/nodes/{node}/tasks/{upid}/log") => self.task_log(p),
            ("GET", "/nodes/{node}/qemu") => Ok(self.list_vms(&p["node"])),
            ("POST", "/nodes/{node}/qemu") => self.create_vm(p),
            ("GET", "/nodes/{node}/qemu/{vmid}/config") => self.vm(vmid()).map(|vm| {
                // qemu-server `vm_config`: pending values unless `current`.
                vm_config_json(&vm, p.get("current").is_none_or(|c| c != "1"))
            }),
            ("GET", "/nodes/{node}/qemu/{vmid}/pending") => self.vm(vmid()).map(|vm| vm_pending_json(&vm)),
            ("POST", "/nodes/{node}/qemu/{vmid}/status/reboot") => self.reboot(vmid()),
            ("POST", "/nodes/{node}/qemu/{vmid}/config") => self.update_config(vmid(), p, true),
            ("PUT", "/nodes/{node}/qemu/{vmid}/config") => self.update_config(vmid(), p, false),
            ("PUT", "/nodes/{node}/qemu/{vmid}/resize") => self.resize(vmid(), p),
            ("POST", "/nodes/{node}/qemu/{vmid}/status/start") => self.power(vmid(), true),
            ("POST", "/nodes/{node}/qemu/{vmid}/status/stop") => self.power(vmid(), false),
            ("GET", "/nodes/{node}/qemu/{vmid}/status/current") => self.vm(vmid()).map(|vm| {
                let st = if vm.running { "running" } else { "stopped" };
                json!({"vmid": vmid(), "name": vm.config.get("name"), "status": st, "qmpstatus": st})
            }),
            _ => return None,
        })
    }
}
