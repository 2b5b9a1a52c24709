//! Powering VMs on and off (qemu-server `PVE/API2/Qemu.pm` `vm_start`,
//! `vm_stop`, `vm_reboot`): pending changes applied, the boot disk found, and
//! the Talos node it boots told its address from META key 10.

use super::config::*;
use super::state::*;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

impl Pve {
    pub(crate) fn power(self: &Arc<Self>, vmid: u32, on: bool) -> ApiResult {
        self.vm(vmid)?;
        let kind = if on { "qmstart" } else { "qmstop" };
        bump(if on {
            &self.stats.starts
        } else {
            &self.stats.stops
        });
        Ok(self.spawn_task(kind, &vmid.to_string(), move |pve, log| {
            // The disk is read and the node booted without holding the lock.
            let mut vm = pve.vm(vmid).map_err(|e| e.message)?;
            if on {
                if vm.running {
                    return Err(format!("VM {vmid} already running"));
                }
                apply_pending(&mut vm);
                power_on(pve, vmid, &mut vm, log);
            } else {
                power_off(pve, &mut vm, log);
            }
            let mut vms = pve.vms.lock().unwrap();
            let current = vms
                .get_mut(&vmid)
                .ok_or_else(|| format!("VM {vmid} does not exist"))?;
            current.running = vm.running;
            current.config = vm.config;
            current.pending = vm.pending;
            current.booted_ip = vm.booted_ip;
            current.boot_error = vm.boot_error;
            current.booted_iso = vm.booted_iso;
            current.installed = vm.installed;
            Ok(())
        }))
    }

    /// `status/reboot` (qemu-server `vm_reboot`): a running VM is shut
    /// down and started again, its pending changes applied.
    pub(crate) fn reboot(self: &Arc<Self>, vmid: u32) -> ApiResult {
        if !self.vm(vmid)?.running {
            return Err(die(format!("VM {vmid} not running")));
        }
        bump(&self.stats.reboots);
        Ok(
            self.spawn_task("qmreboot", &vmid.to_string(), move |pve, log| {
                let mut vm = pve.vm(vmid).map_err(|e| e.message)?;
                power_off(pve, &mut vm, log);
                apply_pending(&mut vm);
                power_on(pve, vmid, &mut vm, log);
                pve.vms.lock().unwrap().insert(vmid, vm);
                Ok(())
            }),
        )
    }
}

/// A start applies what waited (qemu-server `vmconfig_apply_pending`).
pub(crate) fn apply_pending(vm: &mut Vm) {
    let pending = std::mem::take(&mut vm.pending);
    vm.config.extend(pending);
}

/// Where a VM comes to life: with `--nodes-control`, a Talos node boots for
/// it at the loopback address its boot disk's META key 10 names. A disk
/// without one leaves a running VM with no node, as a real one would never
/// answer; why is logged and kept for `/_sim/vms/<vmid>`.
pub(crate) fn power_on(pve: &Pve, vmid: u32, vm: &mut Vm, log: &mut Vec<String>) {
    log.push(format!("starting VM {vmid}"));
    vm.running = true;
    vm.booted_ip = None;
    vm.boot_error = None;
    vm.booted_iso = None;
    bump(&pve.stats.starts_changed);
    let Some(nodes) = &pve.nodes else {
        return;
    };
    let booted = boot_target(pve, vmid, vm).and_then(|(ip, hostname, iso)| {
        vm.booted_iso = iso.then(|| hostname.clone());
        // A Secure Boot disk that boots at all boots with Secure Boot on
        // (systemd-boot enrolled the keys in setup mode).
        let secure_boot = !iso
            && boot_drives(&vm.config).into_iter().any(|(volid, cdrom)| {
                !cdrom
                    && pve
                        .volume_path(&volid)
                        .is_ok_and(|p| super::secureboot::is_secure_boot_disk(&p))
            });
        let body = json!({"name": format!("vm-{vmid}"), "ip": ip, "hostname": hostname, "secure_boot": secure_boot});
        tokio::runtime::Handle::current().block_on(nodes.boot(&body))?;
        Ok(ip)
    });
    match booted {
        Ok(ip) => {
            log.push(format!("Talos node up at {ip}"));
            vm.booted_ip = Some(ip);
        }
        Err(e) => {
            log.push(format!("no Talos node boots: {e}"));
            bump(&pve.stats.boot_failures);
            vm.boot_error = Some(e);
        }
    }
}

/// What a start boots, as the firmware walks the boot order: the address
/// and hostname of the node that comes up, and whether it came from an ISO.
pub(crate) fn boot_target(
    pve: &Pve,
    vmid: u32,
    vm: &Vm,
) -> Result<(String, Option<String>, bool), String> {
    let scratch = pve.args.state_dir.join("tmp");
    for (volid, cdrom) in boot_drives(&vm.config) {
        let path = pve.volume_path(&volid)?;
        if cdrom {
            let cfg = scratch.join(format!("grub-{vmid}.cfg"));
            let (ip, hostname, halts) =
                iso_key10_address(&path, &cfg).map_err(|e| format!("{volid}: {e}"))?;
            if halts && vm.installed.is_some() {
                return Err(format!(
                    "{volid}: Talos is already installed to disk but booted from another media and talos.halt_if_installed kernel parameter is set. Please reboot from the disk."
                ));
            }
            return Ok((ip, hostname, true));
        }
        if let Some(i) = vm.installed.as_ref().filter(|i| i.volid == volid) {
            return Ok((i.ip.clone(), i.hostname.clone(), false));
        }
        if is_blank(&path) {
            continue;
        }
        if super::secureboot::is_secure_boot_disk(&path)
            && let Some(why) = super::secureboot::firmware_refusal(&vm.config)
        {
            return Err(format!("{volid}: {why}"));
        }
        let raw = scratch.join(format!("meta-{vmid}.raw"));
        let (ip, hostname) = key10_address(&path, &raw).map_err(|e| format!("{volid}: {e}"))?;
        return Ok((ip, hostname, false));
    }
    Err("no boot disk".to_owned())
}

/// Whether a disk holds nothing a firmware would boot: its first MiB is
/// zeros (no MBR boot signature, no GPT).
pub(crate) fn is_blank(path: &Path) -> bool {
    let Ok(f) = std::fs::File::open(path) else {
        return false;
    };
    let mut head = Vec::new();
    std::io::Read::read_to_end(&mut std::io::Read::take(f, 1 << 20), &mut head).is_ok()
        && head.iter().all(|b| *b == 0)
}

/// A VM stops (or is destroyed): its node halts. A node booted from an ISO
/// whose config was applied has installed Talos to the VM's first blank
/// disk in the boot order, with the META the ISO gave it.
pub(crate) fn power_off(pve: &Pve, vm: &mut Vm, log: &mut Vec<String>) {
    vm.running = false;
    let Some(ip) = vm.booted_ip.take() else {
        return;
    };
    let Some(nodes) = &pve.nodes else {
        return;
    };
    match tokio::runtime::Handle::current().block_on(nodes.halt(&ip)) {
        Err(e) => log.push(format!("halting the Talos node at {ip}: {e}")),
        Ok(reply) => {
            let configured = reply.get("configured") == Some(&Value::Bool(true));
            if let (true, Some(hostname), None) = (configured, vm.booted_iso.clone(), &vm.installed)
            {
                let disk = boot_drives(&vm.config)
                    .into_iter()
                    .filter(|(_, cdrom)| !cdrom)
                    .find(|(volid, _)| pve.volume_path(volid).is_ok_and(|p| is_blank(&p)));
                if let Some((volid, _)) = disk {
                    log.push(format!("Talos installed to {volid}"));
                    vm.installed = Some(Installed {
                        volid,
                        ip,
                        hostname,
                    });
                }
            }
        }
    }
}

/// The volumes a VM may boot from, in its boot order, and whether each is a
/// cdrom: the drives of `boot: order=…` that hold a volume, else scsi0,
/// else virtio0.
pub(crate) fn boot_drives(config: &BTreeMap<String, String>) -> Vec<(String, bool)> {
    let order = config
        .get("boot")
        .and_then(|b| b.split(',').find_map(|p| p.strip_prefix("order=")))
        .map(|o| o.split(';').map(str::to_owned).collect::<Vec<_>>())
        .unwrap_or_else(|| vec!["scsi0".to_owned(), "virtio0".to_owned()]);
    order
        .iter()
        .map(String::as_str)
        .filter(|k| is_drive(k))
        .filter_map(|k| {
            let (file, opts) = split_drive(config.get(k)?);
            let cdrom = opts.iter().any(|(o, v)| o == "media" && v == "cdrom");
            // `none` is an empty drive, `cdrom` the host's physical drive.
            (file != "none" && file != "cdrom").then_some((file, cdrom))
        })
        .collect()
}

/// The first loopback address (prefix stripped) and the hostname in META
/// key 10 of the disk image at `path` (raw, or qcow2 read through a raw
/// copy qemu-img makes at `scratch`).
pub(crate) fn key10_address(
    path: &Path,
    scratch: &Path,
) -> Result<(String, Option<String>), String> {
    let qcow2 = path.extension().is_some_and(|e| e == "qcow2");
    let tags = if qcow2 {
        let raw = scratch;
        let ok = std::process::Command::new("qemu-img")
            .args(["convert", "-f", "qcow2", "-O", "raw"])
            .arg(path)
            .arg(raw)
            .status()
            .is_ok_and(|s| s.success());
        let tags = if ok {
            crate::disk::read_meta(raw)
        } else {
            Err("qemu-img could not read the disk".to_owned())
        };
        let _ = std::fs::remove_file(raw);
        tags?
    } else {
        crate::disk::read_meta(path)?
    };
    key10_target(tags.get(&10).ok_or("META has no key 10")?)
}

/// The address a node booted from a Talos ISO comes up at: the META that
/// the kernel line of the first GRUB menu entry carries
/// (`talos.environment=INSTALLER_META_BASE64=<v>`, siderolabs/talos
/// `pkg/imager/imager.go` `buildCmdline`), decoded as `Values.Decode` in
/// `pkg/machinery/meta/meta.go` does: base64, gunzip when gzip, `0x<key>=<value>`
/// split on `;`; and whether that line sets `talos.halt_if_installed=1`.
/// `grub.cfg` is extracted with xorriso to `scratch`.
pub(crate) fn iso_key10_address(
    iso: &Path,
    scratch: &Path,
) -> Result<(String, Option<String>, bool), String> {
    let _ = std::fs::create_dir_all(scratch.parent().unwrap_or(Path::new(".")));
    let _ = std::fs::remove_file(scratch);
    let o = std::process::Command::new("xorriso")
        .args(["-osirrox", "on", "-indev"])
        .arg(iso)
        .args(["-extract", "/boot/grub/grub.cfg"])
        .arg(scratch)
        .output()
        .map_err(|e| format!("xorriso: {e}"))?;
    let cfg = std::fs::read_to_string(scratch);
    let _ = std::fs::remove_file(scratch);
    if !o.status.success() {
        return Err("no /boot/grub/grub.cfg on the ISO".into());
    }
    let cfg = cfg.map_err(|e| e.to_string())?;
    let kernel = cfg
        .lines()
        .map(str::trim_start)
        .find(|l| l.starts_with("linux "))
        .ok_or("grub.cfg has no linux line")?;
    // Talos reads the parameter with strconv.ParseBool.
    let halts = kernel.split_whitespace().any(|w| {
        matches!(
            w.strip_prefix("talos.halt_if_installed="),
            Some("1" | "t" | "T" | "true" | "TRUE" | "True")
        )
    });
    let v = kernel
        .split_whitespace()
        .find_map(|w| w.strip_prefix("talos.environment=INSTALLER_META_BASE64="))
        .ok_or("the kernel line carries no META")?;
    let value = installer_meta_key(v, 10)?.ok_or("META has no key 10")?;
    let (ip, hostname) = key10_target(value.as_bytes())?;
    Ok((ip, hostname, halts))
}

/// One key's value in an `INSTALLER_META_BASE64` value.
pub(crate) fn installer_meta_key(v: &str, key: u8) -> Result<Option<String>, String> {
    use base64::Engine;
    let raw = base64::engine::general_purpose::STANDARD
        .decode(v)
        .map_err(|e| format!("META is not base64: {e}"))?;
    let text = if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = String::new();
        std::io::Read::read_to_string(&mut flate2::read::GzDecoder::new(&raw[..]), &mut out)
            .map_err(|e| format!("META is not gzip text: {e}"))?;
        out
    } else {
        String::from_utf8(raw).map_err(|_| "META is not text".to_owned())?
    };
    let want = format!("0x{key:x}");
    Ok(text
        .split(';')
        .find_map(|kv| kv.split_once('=').filter(|(k, _)| *k == want))
        .map(|(_, v)| v.to_owned()))
}

/// The first loopback address and the hostname in a key-10 value
/// (PlatformNetworkConfig as YAML or JSON).
pub(crate) fn key10_target(value: &[u8]) -> Result<(String, Option<String>), String> {
    let doc: Value = serde_yaml_ng::from_slice(value)
        .map_err(|e| format!("META key 10 is not YAML or JSON: {e}"))?;
    let ip = doc["addresses"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| a["address"].as_str())
        .filter_map(|a| a.split('/').next()?.parse::<std::net::IpAddr>().ok())
        .find(|ip| ip.is_loopback())
        .ok_or("META key 10 has no address in 127.0.0.0/8")?;
    let hostname = doc["hostnames"]
        .as_array()
        .into_iter()
        .flatten()
        .find_map(|h| h["hostname"].as_str())
        .map(str::to_owned);
    Ok((ip.to_string(), hostname))
}
