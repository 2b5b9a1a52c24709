//! Proxmox VE: each node's verified image into a storage with `import`
//! content (named by its content, since Proxmox lists no checksums and
//! overwrites same-named files), then optionally one VM per node that boots
//! it. Facts: proxmox/pve-storage `src/PVE/API2/Storage/Status.pm`,
//! proxmox/pve-http-server `src/PVE/APIServer/AnyEvent.pm`, proxmox/qemu-server
//! `src/PVE/API2/Qemu.pm`.

mod api;
mod credentials;
mod error;
mod types;
mod upload;
mod vm;

use std::collections::BTreeMap;

use serde_json::Value;

pub use credentials::Credentials;
pub use error::ProxmoxError;
pub use types::{Event, NodePublished, Observer, PublishOptions, VmChange};
pub use upload::{content_for, volume_file};

use crate::inventory::{Inventory, ProxmoxSettings, VmBoot};
use crate::publish::PublishImage;
use api::Api;
use upload::upload;
use vm::{
    NewDisk, described_volume, description, drive_volume, place, replace_disk, resize,
    start_if_wanted, vm_params, vm_verdict,
};

/// What publishing and planning both start from, read-only: the checked
/// API, the storage's import volumes with their sizes, and the node's VMs
/// (when there are VMs to make).
fn survey(
    settings: &ProxmoxSettings,
    creds: &Credentials,
    opts: &PublishOptions,
    content: &'static str,
) -> Result<(Api, BTreeMap<String, u64>, Value), ProxmoxError> {
    let api = Api::new(creds, opts.retry)?;
    preflight(&api, settings, content)?;
    let node = &settings.node;
    let listed = api.get(
        "listing storage",
        &format!(
            "/nodes/{node}/storage/{}/content?content={content}",
            settings.storage
        ),
    )?;
    let stored: BTreeMap<String, u64> = listed
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| Some((v["volid"].as_str()?.to_owned(), v["size"].as_u64()?)))
        .collect();
    let vms = match &settings.vm {
        Some(_) => api.get("listing VMs", &format!("/nodes/{node}/qemu"))?,
        None => Value::Null,
    };
    Ok((api, stored, vms))
}

/// Publishes `images` (built, verified) to the target in `settings`.
/// Preflight problems fail the whole run before a byte is uploaded; after
/// that each node succeeds or fails on its own.
pub fn publish(
    inv: &Inventory,
    settings: &ProxmoxSettings,
    creds: &Credentials,
    images: &[PublishImage],
    opts: &PublishOptions,
    observer: &dyn Observer,
) -> Result<Vec<Result<NodePublished, ProxmoxError>>, ProxmoxError> {
    let (api, stored, vms) = survey(settings, creds, opts, content_for(inv.image.format))?;
    Ok(images
        .iter()
        .map(|img| {
            publish_node(&api, inv, settings, &stored, &vms, img, opts, observer).map_err(|e| {
                match e {
                    e @ ProxmoxError::Node { .. } => e,
                    e => ProxmoxError::Node {
                        node: img.node.clone(),
                        message: e.to_string(),
                    },
                }
            })
        })
        .collect())
}

/// The token works, the node exists, the storage takes `import` (and, for
/// VMs, the VM storage takes `images`): checked before anything is sent.
fn preflight(api: &Api, s: &ProxmoxSettings, content: &str) -> Result<(), ProxmoxError> {
    api.get("checking the API token", "/version")?;
    let nodes = api.get("listing nodes", "/nodes")?;
    let names: Vec<&str> = nodes
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| n["node"].as_str())
        .collect();
    if !names.contains(&s.node.as_str()) {
        return Err(ProxmoxError::Setup(format!(
            "publish.proxmox.node: the cluster has no node {:?} (it has: {})",
            s.node,
            names.join(", ")
        )));
    }
    let has = |content: &str, storage: &str| -> Result<bool, ProxmoxError> {
        let list = api.get(
            "listing storages",
            &format!("/nodes/{}/storage?content={content}&enabled=1", s.node),
        )?;
        Ok(list
            .as_array()
            .into_iter()
            .flatten()
            .any(|st| st["storage"] == storage))
    };
    if content == "iso" && !has("iso", &s.storage)? {
        return Err(ProxmoxError::Setup(format!(
            "publish.proxmox.storage: storage {:?} on node {:?} does not hold ISO images (content `iso`); \
             enable it under Datacenter → Storage → {} → Content: ISO image",
            s.storage, s.node, s.storage
        )));
    }
    if content == "import" && !has("import", &s.storage)? {
        return Err(ProxmoxError::Setup(format!(
            "publish.proxmox.storage: storage {:?} on node {:?} is not enabled for the `import` content type. \
             Enable it under Datacenter → Storage → {} → Content: Import (Proxmox VE 8.4 or later; \
             file-based storages only: dir, NFS, CIFS, CephFS, BTRFS)",
            s.storage, s.node, s.storage
        )));
    }
    if let Some(vm) = &s.vm
        && !has("images", &vm.storage)?
    {
        return Err(ProxmoxError::Setup(format!(
            "publish.proxmox.vm.storage: storage {:?} on node {:?} does not hold VM disks (content `images`)",
            vm.storage, s.node
        )));
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn publish_node(
    api: &Api,
    inv: &Inventory,
    s: &ProxmoxSettings,
    stored: &BTreeMap<String, u64>,
    vms: &Value,
    img: &PublishImage,
    opts: &PublishOptions,
    observer: &dyn Observer,
) -> Result<NodePublished, ProxmoxError> {
    let node_err = |message: String| ProxmoxError::Node {
        node: img.node.clone(),
        message,
    };
    let file = volume_file(
        &inv.cluster.name,
        &img.node,
        &inv.cluster.talos_version,
        &img.sha256,
        img.format,
    );
    let volid = format!("{}:{}/{file}", s.storage, content_for(img.format));
    let uploaded = if stored.get(&volid) == Some(&img.size) {
        observer.event(
            &img.node,
            &Event::AlreadyStored {
                volid: volid.clone(),
            },
        );
        false
    } else {
        upload(api, s, img, &file, &volid, opts, observer)?;
        true
    };
    let mut out = NodePublished {
        node: img.node.clone(),
        volid: volid.clone(),
        sha256: img.sha256.clone(),
        uploaded,
        vmid: None,
        inventory_vmid: None,
        vm: None,
        started: false,
    };
    let Some(vm) = &s.vm else {
        return Ok(out);
    };
    let index = inv
        .nodes
        .iter()
        .position(|n| n.name == img.node)
        .ok_or_else(|| node_err("not in the inventory".into()))?;
    if vm.boot == VmBoot::Disk && img.size > u64::from(vm.disk_size) << 30 {
        return Err(node_err(format!(
            "the image ({} bytes) is larger than publish.proxmox.vm.diskSize ({} GiB)",
            img.size, vm.disk_size
        )));
    }
    let pve = &s.node;
    let place = place(api, inv, pve, vms, index)?;
    let vmid = place.vmid;
    out.vmid = Some(vmid);
    out.inventory_vmid = place.inventory_vmid;
    if let Some(inventory_vmid) = place.inventory_vmid {
        observer.event(
            &img.node,
            &Event::VmFound {
                vmid,
                inventory_vmid,
            },
        );
    }
    let base = format!("/nodes/{pve}/qemu/{vmid}");
    let running = match place.existing {
        None => {
            let params = vm_params(inv, index, vm, vmid, &volid, &img.sha256);
            let task = api.post("creating VM", &format!("/nodes/{pve}/qemu"), &params)?;
            api.wait(&format!("creating VM {vmid}"), &task, opts)?;
            if vm.boot == VmBoot::Disk {
                resize(api, &base, vm, opts)?;
            }
            observer.event(&img.node, &Event::VmCreated { vmid });
            out.vm = Some(VmChange::Created);
            false
        }
        Some((running, config)) => {
            let current = described_volume(&config);
            match vm_verdict(current.as_deref(), &volid, opts.replace_disk) {
                VmChange::Unchanged => {
                    observer.event(&img.node, &Event::VmUnchanged { vmid });
                    out.vm = Some(VmChange::Unchanged);
                }
                VmChange::Outdated => {
                    let running_image =
                        current.unwrap_or_else(|| "an image imgbuild did not record".into());
                    observer.event(
                        &img.node,
                        &Event::VmOutdated {
                            vmid,
                            running: running_image,
                        },
                    );
                    out.vm = Some(VmChange::Outdated);
                }
                VmChange::Created | VmChange::Updated if vm.boot == VmBoot::Iso => {
                    // The new ISO goes into the cdrom drive; the disk Talos
                    // installed to stays.
                    let desc = description(inv, &img.node, &volid, &img.sha256);
                    api.put(
                        "attaching the node ISO",
                        &format!("{base}/config"),
                        &[
                            ("ide2", format!("{volid},media=cdrom")),
                            ("description", desc),
                        ],
                    )?;
                    out.vm = Some(VmChange::Updated);
                }
                VmChange::Created | VmChange::Updated => {
                    let old = config["scsi0"].as_str().map(drive_volume);
                    let disk = NewDisk {
                        volid: &volid,
                        description: &description(inv, &img.node, &volid, &img.sha256),
                        replaces: old,
                    };
                    replace_disk(api, &base, vm, vmid, &disk, running, opts)?;
                    observer.event(&img.node, &Event::DiskReplaced { vmid });
                    out.vm = Some(VmChange::Updated);
                    return start_if_wanted(
                        api, &base, vm, vmid, false, opts, observer, &img.node, out,
                    );
                }
            }
            running
        }
    };
    start_if_wanted(
        api, &base, vm, vmid, running, opts, observer, &img.node, out,
    )
}

/// What publishing one node would do, read from the server with GETs only.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodePlan {
    pub node: String,
    /// The volume its image would be stored as; unknown until the image is
    /// built (the name holds its sha256).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub volid: Option<String>,
    /// Whether the image would be uploaded; unknown until it is built.
    pub upload: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vmid: Option<u32>,
    /// The vmid the inventory gives when the node's VM is another one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inventory_vmid: Option<u32>,
    /// What would happen to its VM: `created` for a new one; unknown for an
    /// existing VM while the image is not built.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vm: Option<VmChange>,
    /// Whether the VM would be started.
    pub start: bool,
}

/// The dry run of [`publish`]: for each node (its image when built) what
/// would be uploaded, created and started. Sends only GETs.
pub fn plan(
    inv: &Inventory,
    settings: &ProxmoxSettings,
    creds: &Credentials,
    images: &[(String, Option<PublishImage>)],
    opts: &PublishOptions,
) -> Result<Vec<Result<NodePlan, ProxmoxError>>, ProxmoxError> {
    let (api, stored, vms) = survey(settings, creds, opts, content_for(inv.image.format))?;
    let pve = &settings.node;
    let plan_node = |node: &str, img: Option<&PublishImage>| -> Result<NodePlan, ProxmoxError> {
        let volid = img.map(|img| {
            let file = volume_file(
                &inv.cluster.name,
                node,
                &inv.cluster.talos_version,
                &img.sha256,
                img.format,
            );
            format!("{}:{}/{file}", settings.storage, content_for(img.format))
        });
        let upload = img
            .zip(volid.as_ref())
            .map(|(img, volid)| stored.get(volid) != Some(&img.size));
        let mut out = NodePlan {
            node: node.to_owned(),
            volid,
            upload,
            vmid: None,
            inventory_vmid: None,
            vm: None,
            start: false,
        };
        let Some(vm) = &settings.vm else {
            return Ok(out);
        };
        let index = inv
            .nodes
            .iter()
            .position(|n| n.name == node)
            .ok_or_else(|| ProxmoxError::Node {
                node: node.to_owned(),
                message: "not in the inventory".into(),
            })?;
        let place = place(&api, inv, pve, &vms, index)?;
        out.vmid = Some(place.vmid);
        out.inventory_vmid = place.inventory_vmid;
        match place.existing {
            None => {
                out.vm = Some(VmChange::Created);
                out.start = vm.start;
            }
            Some((running, config)) => {
                if let Some(volid) = &out.volid {
                    let verdict = vm_verdict(
                        described_volume(&config).as_deref(),
                        volid,
                        opts.replace_disk,
                    );
                    out.vm = Some(verdict);
                    out.start = vm.start && (!running || verdict == VmChange::Updated);
                } else {
                    out.start = vm.start && !running;
                }
            }
        }
        Ok(out)
    };
    Ok(images
        .iter()
        .map(|(node, img)| plan_node(node, img.as_ref()))
        .collect())
}

#[cfg(test)]
mod tests;
