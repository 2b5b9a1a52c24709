//! Proxmox VE: each node's verified image into a storage with `import`
//! content (named by its content, since Proxmox lists no checksums and
//! overwrites same-named files), then optionally one VM per node that boots
//! it. Facts: proxmox/pve-storage `src/PVE/API2/Storage/Status.pm`,
//! proxmox/pve-http-server `src/PVE/APIServer/AnyEvent.pm`, proxmox/qemu-server
//! `src/PVE/API2/Qemu.pm`.

mod api;
mod credentials;
pub mod destroy;
mod error;
mod types;
mod upload;
mod vm;

use std::collections::BTreeMap;

use serde_json::Value;

pub use credentials::Credentials;
pub use error::{ProxmoxError, Step};
pub use types::{Event, NodePublished, Observer, PublishOptions, VmChange};
pub use upload::{content_for, volume_file};

use crate::inventory::{Inventory, ProxmoxSettings, ProxmoxVm, VmBoot};
use crate::publish::PublishImage;
use api::Api;
use upload::upload;
use vm::{
    NewDisk, Placement, described_volume, description, drive_volume, place, replace_disk, resize,
    start, vm_decision, vm_params,
};

/// What publishing and planning both start from, read-only: the checked
/// API, the storage's import volumes with their sizes, and the node's VMs
/// (when there are VMs to make).
struct Survey<'a> {
    inv: &'a Inventory,
    settings: &'a ProxmoxSettings,
    api: Api,
    stored: BTreeMap<String, u64>,
    vms: Value,
}

/// Where a node's image goes: the storage half of its [`Decision`].
struct Volume {
    file: String,
    volid: String,
    /// False when the storage already holds these exact bytes.
    upload: bool,
}

/// What happens to a node's VM: the VM half of its [`Decision`].
struct VmDecision {
    place: Placement,
    /// Unknown for an existing VM while the image is not built.
    change: Option<VmChange>,
    start: bool,
}

impl<'a> Survey<'a> {
    fn new(
        inv: &'a Inventory,
        settings: &'a ProxmoxSettings,
        creds: &Credentials,
        opts: &PublishOptions,
    ) -> Result<Survey<'a>, ProxmoxError> {
        let content = content_for(inv.image.format);
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
        Ok(Survey {
            inv,
            settings,
            api,
            stored,
            vms,
        })
    }

    /// The volume `img` is stored as, and whether it must be uploaded.
    fn volume(&self, img: &PublishImage) -> Volume {
        let inv = self.inv;
        let file = volume_file(
            &inv.cluster.name,
            &img.node,
            &inv.cluster.talos_version,
            &img.sha256,
            img.format,
        );
        let volid = format!(
            "{}:{}/{file}",
            self.settings.storage,
            content_for(img.format)
        );
        let upload = self.stored.get(&volid) != Some(&img.size);
        Volume {
            file,
            volid,
            upload,
        }
    }

    /// Where the VM of the node at `index` is and what happens to it, given
    /// its image's volume and size once built. GETs the VM configs of the
    /// node's name.
    fn vm(
        &self,
        vm: &ProxmoxVm,
        index: usize,
        image: Option<(&str, u64)>,
        replace: bool,
    ) -> Result<VmDecision, ProxmoxError> {
        if let Some((_, size)) = image
            && vm.boot == VmBoot::Disk
            && size > u64::from(vm.disk_size) << 30
        {
            return Err(ProxmoxError::Node {
                node: self.inv.nodes[index].name.clone(),
                step: Step::Vm,
                done: None,
                message: format!(
                    "the image ({size} bytes) is larger than publish.proxmox.vm.diskSize ({} GiB)",
                    vm.disk_size
                ),
            });
        }
        let place = place(&self.api, self.inv, &self.settings.node, &self.vms, index)?;
        let volid = image.map(|(volid, _)| volid);
        let (change, start) = vm_decision(vm, place.existing.as_ref(), volid, replace);
        Ok(VmDecision {
            place,
            change,
            start,
        })
    }

    /// What publishing the node at `index` (its image when built) does:
    /// both halves, as the dry run reports them.
    fn decide(
        &self,
        index: usize,
        img: Option<&PublishImage>,
        replace: bool,
    ) -> Result<Decision, ProxmoxError> {
        let volume = img.map(|img| self.volume(img));
        let mut out = Decision {
            node: self.inv.nodes[index].name.clone(),
            volid: volume.as_ref().map(|v| v.volid.clone()),
            upload: volume.as_ref().map(|v| v.upload),
            vmid: None,
            inventory_vmid: None,
            vm: None,
            start: false,
        };
        let Some(vm) = &self.settings.vm else {
            return Ok(out);
        };
        let image = volume
            .as_ref()
            .zip(img)
            .map(|(v, i)| (v.volid.as_str(), i.size));
        let decided = self.vm(vm, index, image, replace)?;
        out.vmid = Some(decided.place.vmid);
        out.inventory_vmid = decided.place.inventory_vmid;
        out.vm = decided.change;
        out.start = decided.start;
        Ok(out)
    }
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
    let survey = Survey::new(inv, settings, creds, opts)?;
    Ok(images
        .iter()
        .map(|img| publish_node(&survey, img, opts, observer))
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

/// Carries out one node's decision, half by half as it is made: the
/// upload, then the VM (so nothing about the VM is read before the image
/// is stored). Every error is the node's, at the step it happened in.
fn publish_node(
    survey: &Survey,
    img: &PublishImage,
    opts: &PublishOptions,
    observer: &dyn Observer,
) -> Result<NodePublished, ProxmoxError> {
    let (api, s) = (&survey.api, survey.settings);
    let Volume {
        file,
        volid,
        upload: needed,
    } = survey.volume(img);
    if needed {
        upload(api, s, img, &file, &volid, opts, observer)
            .map_err(|e| e.at(&img.node, Step::Upload, None))?;
    } else {
        observer.event(
            &img.node,
            &Event::AlreadyStored {
                volid: volid.clone(),
            },
        );
    }
    let mut out = NodePublished {
        node: img.node.clone(),
        volid: volid.clone(),
        sha256: img.sha256,
        uploaded: needed,
        vmid: None,
        inventory_vmid: None,
        vm: None,
        started: false,
    };
    let Some(vm) = &s.vm else {
        return Ok(out);
    };
    let decided = survey
        .vm(vm, img.index, Some((&volid, img.size)), opts.replace_disk)
        .map_err(|e| e.at(&img.node, Step::Vm, Some(&out)))?;
    let vmid = decided.place.vmid;
    out.vmid = Some(vmid);
    out.inventory_vmid = decided.place.inventory_vmid;
    if let Some(inventory_vmid) = decided.place.inventory_vmid {
        observer.event(
            &img.node,
            &Event::VmFound {
                vmid,
                inventory_vmid,
            },
        );
    }
    let base = format!("/nodes/{}/qemu/{vmid}", s.node);
    let start_it = decided.start;
    out.vm = Some(
        converge_vm(survey, img, &volid, vm, decided, opts, observer)
            .map_err(|e| e.at(&img.node, Step::Vm, Some(&out)))?,
    );
    if start_it {
        start(api, &base, vmid, opts).map_err(|e| e.at(&img.node, Step::Start, Some(&out)))?;
        observer.event(&img.node, &Event::VmStarted { vmid });
        out.started = true;
    }
    Ok(out)
}

/// Makes the node's VM what its decision says (created, left, or its disk
/// or ISO replaced); what it did.
fn converge_vm(
    survey: &Survey,
    img: &PublishImage,
    volid: &str,
    vm: &ProxmoxVm,
    decided: VmDecision,
    opts: &PublishOptions,
    observer: &dyn Observer,
) -> Result<VmChange, ProxmoxError> {
    let VmDecision { place, change, .. } = decided;
    let (api, inv, s) = (&survey.api, survey.inv, survey.settings);
    let (index, vmid) = (img.index, place.vmid);
    let pve = &s.node;
    let base = format!("/nodes/{pve}/qemu/{vmid}");
    let desc = || description(inv, &img.node, volid, &img.sha256);
    Ok(match (place.existing, change) {
        (None, _) => {
            let params = vm_params(inv, index, vm, vmid, volid, &img.sha256);
            let task = api.post("creating VM", &format!("/nodes/{pve}/qemu"), &params)?;
            api.wait(&format!("creating VM {vmid}"), &task, opts)?;
            if vm.boot == VmBoot::Disk {
                resize(api, &base, vm, opts)?;
            }
            observer.event(&img.node, &Event::VmCreated { vmid });
            VmChange::Created
        }
        (Some(_), Some(VmChange::Unchanged)) => {
            observer.event(&img.node, &Event::VmUnchanged { vmid });
            VmChange::Unchanged
        }
        (Some((_, config)), Some(VmChange::Outdated)) => {
            let running_image = described_volume(&config)
                .unwrap_or_else(|| "an image imgbuild did not record".into());
            observer.event(
                &img.node,
                &Event::VmOutdated {
                    vmid,
                    running: running_image,
                },
            );
            VmChange::Outdated
        }
        (Some(_), _) if vm.boot == VmBoot::Iso => {
            // The new ISO goes into the cdrom drive; the disk Talos
            // installed to stays.
            api.put(
                "attaching the node ISO",
                &format!("{base}/config"),
                &[
                    ("ide2", format!("{volid},media=cdrom")),
                    ("description", desc()),
                ],
            )?;
            VmChange::Updated
        }
        (Some((running, config)), _) => {
            let old = config["scsi0"].as_str().map(drive_volume);
            let disk = NewDisk {
                volid,
                description: &desc(),
                replaces: old,
            };
            replace_disk(api, &base, vm, vmid, &disk, running, opts)?;
            observer.event(&img.node, &Event::DiskReplaced { vmid });
            VmChange::Updated
        }
    })
}

/// What publishing one node would do, read from the server with GETs only;
/// the real run makes the same decision (see [`Survey::decide`]).
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Decision {
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

/// The dry run of [`publish`]: for each node (by inventory position, with
/// its image when built) what would be uploaded, created and started.
/// Sends only GETs.
pub fn plan(
    inv: &Inventory,
    settings: &ProxmoxSettings,
    creds: &Credentials,
    nodes: &[(usize, Option<PublishImage>)],
    opts: &PublishOptions,
) -> Result<Vec<Result<Decision, ProxmoxError>>, ProxmoxError> {
    let survey = Survey::new(inv, settings, creds, opts)?;
    Ok(nodes
        .iter()
        .map(|(index, img)| survey.decide(*index, img.as_ref(), opts.replace_disk))
        .collect())
}

#[cfg(test)]
mod tests;
