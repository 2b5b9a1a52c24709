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
mod qcow2;
mod settings;
mod types;
mod upload;
mod vm;

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

pub use credentials::Credentials;
pub use error::{ProxmoxError, Step};
pub use types::{Apply, Event, NodePublished, Observer, PublishOptions, SettingChange, VmChange};
pub use upload::{content_for, download_problem, volume_file};

use crate::inventory::{
    ImageFormat, Inventory, Machine, ProxmoxSettings, ProxmoxVm, UploadFormat, VmBoot,
};
use crate::publish::PublishImage;
use api::Api;
use upload::{download, upload};
use vm::{
    NewDisk, Placement, apply_settings, described_volume, description, drive_volume, place, reboot,
    replace_disk, resize, start, vm_decision, vm_params,
};

/// What publishing and planning both start from, read-only: the checked
/// API, each Proxmox host's import volumes with their sizes, and each
/// host's VMs (when there are VMs to make).
struct Survey<'a> {
    inv: &'a Inventory,
    settings: &'a ProxmoxSettings,
    api: Api,
    stored: BTreeMap<String, BTreeMap<String, u64>>,
    vms: BTreeMap<String, Value>,
}

/// Where a node's image goes: the storage half of its [`Decision`].
struct Volume {
    volid: String,
    /// True when the node's host's storage already holds these exact bytes.
    stored: bool,
}

/// What happens to a node's VM: the VM half of its [`Decision`].
struct VmDecision {
    place: Placement,
    /// Unknown for an existing VM while the image is not built.
    change: Option<VmChange>,
    /// Its settings from → to (an existing VM's).
    settings: Vec<SettingChange>,
    /// Whether the image must be stored: for a VM made or given a new disk.
    needs_image: bool,
    start: bool,
}

/// The Proxmox hosts a publish touches: `publish.proxmox.node` and every
/// node's own.
fn hosts(inv: &Inventory, settings: &ProxmoxSettings) -> BTreeSet<String> {
    (0..inv.nodes.len())
        .filter_map(|i| inv.machine(i).map(|m| m.host))
        .chain([settings.node.clone()])
        .collect()
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
        let hosts = hosts(inv, settings);
        preflight(&api, settings, &hosts, content)?;
        let mut stored = BTreeMap::new();
        let mut vms = BTreeMap::new();
        for host in &hosts {
            let listed = api.get(
                "listing storage",
                &format!(
                    "/nodes/{host}/storage/{}/content?content={content}",
                    settings.storage
                ),
            )?;
            let volumes: BTreeMap<String, u64> = listed
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|v| Some((v["volid"].as_str()?.to_owned(), v["size"].as_u64()?)))
                .collect();
            stored.insert(host.clone(), volumes);
            if settings.vm.is_some() {
                let list = api.get("listing VMs", &format!("/nodes/{host}/qemu"))?;
                vms.insert(host.clone(), list);
            }
        }
        Ok(Survey {
            inv,
            settings,
            api,
            stored,
            vms,
        })
    }

    /// The Proxmox host the node at `index` belongs on.
    fn host(&self, index: usize) -> String {
        self.inv
            .machine(index)
            .map_or_else(|| self.settings.node.clone(), |m| m.host)
    }

    /// The volume `img` is stored as on its node's host: a raw image is
    /// sent as qcow2 unless `upload: raw`, under the raw image's sha256.
    fn volume(&self, img: &PublishImage) -> Volume {
        let inv = self.inv;
        let converted = converts(self.settings, img.format);
        let file = volume_file(
            &inv.cluster.name,
            &img.node,
            &inv.cluster.talos_version,
            &img.sha256,
            if converted {
                ImageFormat::Qcow2
            } else {
                img.format
            },
        );
        let volid = format!(
            "{}:{}/{file}",
            self.settings.storage,
            content_for(img.format)
        );
        // A converted image's size is known only once converted; its name
        // holds the raw image's sha256, and a failed upload leaves no volume.
        let listed = self
            .stored
            .get(&self.host(img.index))
            .and_then(|s| s.get(&volid));
        let stored = if converted {
            listed.is_some()
        } else {
            listed == Some(&img.size)
        };
        Volume { volid, stored }
    }

    /// Where the VM of the node at `index` is and what happens to it, given
    /// its image's size once built. GETs the VM configs of the node's name.
    fn vm(
        &self,
        vm: &ProxmoxVm,
        machine: &Machine,
        index: usize,
        size: Option<u64>,
        replace: bool,
    ) -> Result<VmDecision, ProxmoxError> {
        let node = &self.inv.nodes[index].name;
        let err = |message: String| ProxmoxError::Node {
            node: node.clone(),
            step: Step::Vm,
            done: None,
            message,
        };
        let place = place(&self.api, self.inv, &machine.host, &self.vms, index)?;
        let settings = match &place.existing {
            Some((running, config)) => settings::plan(config, &place.host, *running, machine)
                .map_err(|r| {
                    err(format!(
                        "nodes[{index}].{}: {} (VM {} on {})",
                        r.field, r.message, place.vmid, place.host
                    ))
                })?,
            None => Vec::new(),
        };
        let (change, start) = vm_decision(vm, place.existing.as_ref(), &settings, replace);
        let needs_image = matches!(change, VmChange::Created | VmChange::Updated);
        if let Some(size) = size
            && needs_image
            && vm.boot == VmBoot::Disk
            && size > u64::from(machine.disk_size) << 30
        {
            return Err(err(format!(
                "the image ({size} bytes) is larger than its diskSize ({} GiB)",
                machine.disk_size
            )));
        }
        Ok(VmDecision {
            place,
            change: Some(change),
            settings,
            needs_image,
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
            upload: volume.as_ref().map(|v| !v.stored),
            vmid: None,
            inventory_vmid: None,
            vm: None,
            settings: Vec::new(),
            start: false,
        };
        let (Some(vm), Some(machine)) = (&self.settings.vm, self.inv.machine(index)) else {
            return Ok(out);
        };
        let decided = self.vm(vm, &machine, index, img.map(|i| i.size), replace)?;
        if !decided.needs_image {
            out.upload = Some(false);
        }
        out.vmid = Some(decided.place.vmid);
        out.inventory_vmid = decided.place.inventory_vmid;
        out.vm = decided.change;
        out.settings = decided.settings;
        out.start = decided.start;
        Ok(out)
    }
}

/// Publishes `images` (built, verified) to the target in `settings`.
/// Preflight problems fail the whole run before a byte is uploaded; after
/// that each node succeeds or fails on its own, one after the other (so a
/// reboot for new settings takes one node down at a time).
pub fn publish(
    inv: &Inventory,
    settings: &ProxmoxSettings,
    creds: &Credentials,
    images: &[PublishImage],
    opts: &PublishOptions,
    observer: &dyn Observer,
) -> Result<Vec<Result<NodePublished, ProxmoxError>>, ProxmoxError> {
    if settings.upload == UploadFormat::DownloadUrl
        && let Some(why) = images.iter().find_map(download_problem)
    {
        return Err(ProxmoxError::Setup(why));
    }
    let survey = Survey::new(inv, settings, creds, opts)?;
    Ok(images
        .iter()
        .map(|img| publish_node(&survey, img, opts, observer))
        .collect())
}

/// The token works, every host exists, the storage takes `import` there
/// (and, for VMs, the VM storage takes `images`): checked before anything
/// is sent.
fn preflight(
    api: &Api,
    s: &ProxmoxSettings,
    hosts: &BTreeSet<String>,
    content: &str,
) -> Result<(), ProxmoxError> {
    api.get("checking the API token", "/version")?;
    let nodes = api.get("listing nodes", "/nodes")?;
    let names: Vec<&str> = nodes
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| n["node"].as_str())
        .collect();
    for host in hosts {
        if !names.contains(&host.as_str()) {
            let field = if *host == s.node {
                "publish.proxmox.node".to_owned()
            } else {
                "nodes[].proxmoxNode".to_owned()
            };
            return Err(ProxmoxError::Setup(format!(
                "{field}: the cluster has no node {host:?} (it has: {})",
                names.join(", ")
            )));
        }
        preflight_host(api, s, host, content)?;
    }
    Ok(())
}

/// The storages on one host take what is sent there.
fn preflight_host(
    api: &Api,
    s: &ProxmoxSettings,
    host: &str,
    content: &str,
) -> Result<(), ProxmoxError> {
    let has = |content: &str, storage: &str| -> Result<bool, ProxmoxError> {
        let list = api.get(
            "listing storages",
            &format!("/nodes/{host}/storage?content={content}&enabled=1"),
        )?;
        Ok(list
            .as_array()
            .into_iter()
            .flatten()
            .any(|st| st["storage"] == storage))
    };
    if content == "iso" && !has("iso", &s.storage)? {
        return Err(ProxmoxError::Setup(format!(
            "publish.proxmox.storage: storage {:?} on node {host:?} does not hold ISO images (content `iso`); \
             enable it under Datacenter → Storage → {} → Content: ISO image",
            s.storage, s.storage
        )));
    }
    if content == "import" && !has("import", &s.storage)? {
        return Err(ProxmoxError::Setup(format!(
            "publish.proxmox.storage: storage {:?} on node {host:?} is not enabled for the `import` content type. \
             Enable it under Datacenter → Storage → {} → Content: Import (Proxmox VE 8.4 or later; \
             file-based storages only: dir, NFS, CIFS, CephFS, BTRFS)",
            s.storage, s.storage
        )));
    }
    if let Some(vm) = &s.vm
        && !has("images", &vm.storage)?
    {
        return Err(ProxmoxError::Setup(format!(
            "publish.proxmox.vm.storage: storage {:?} on node {host:?} does not hold VM disks (content `images`)",
            vm.storage
        )));
    }
    Ok(())
}

/// Carries out one node's decision: the VM is found first (an existing
/// VM's disk is its image of record, so nothing is uploaded for it unless
/// `--replace-disk`), then the upload, then the VM. Every error is the
/// node's, at the step it happened in.
fn publish_node(
    survey: &Survey,
    img: &PublishImage,
    opts: &PublishOptions,
    observer: &dyn Observer,
) -> Result<NodePublished, ProxmoxError> {
    let (api, s) = (&survey.api, survey.settings);
    let host = survey.host(img.index);
    let Volume { volid, stored } = survey.volume(img);
    let mut out = NodePublished {
        node: img.node.clone(),
        volid: volid.clone(),
        sha256: img.sha256,
        uploaded: false,
        vmid: None,
        inventory_vmid: None,
        vm: None,
        settings: Vec::new(),
        started: false,
    };
    let decided = match (&s.vm, survey.inv.machine(img.index)) {
        (Some(vm), Some(machine)) => Some(
            survey
                .vm(vm, &machine, img.index, Some(img.size), opts.replace_disk)
                .map_err(|e| e.at(&img.node, Step::Vm, None))?,
        ),
        _ => None,
    };
    let needs_image = decided.as_ref().is_none_or(|d| d.needs_image);
    if needs_image && !stored {
        send(api, &host, s, img, &volid, opts, observer)
            .map_err(|e| e.at(&img.node, Step::Upload, None))?;
        out.uploaded = true;
    } else if needs_image {
        observer.event(
            &img.node,
            &Event::AlreadyStored {
                volid: volid.clone(),
            },
        );
    }
    let (Some(vm), Some(decided)) = (&s.vm, decided) else {
        return Ok(out);
    };
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
    let base = format!("/nodes/{}/qemu/{vmid}", decided.place.host);
    let start_it = decided.start;
    out.settings = decided.settings.clone();
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

/// Whether a publish to `s` sends an image of `format` as qcow2.
fn converts(s: &ProxmoxSettings, format: ImageFormat) -> bool {
    format == ImageFormat::Raw && s.upload == UploadFormat::Qcow2
}

/// Stores the node's image as the volume `volid`: fetched by Proxmox from
/// the factory (`upload: download-url`), or uploaded, a raw image converted
/// to a qcow2 file beside it first (removed afterwards), so only its
/// allocated clusters cross the wire.
fn send(
    api: &Api,
    host: &str,
    s: &ProxmoxSettings,
    img: &PublishImage,
    volid: &str,
    opts: &PublishOptions,
    observer: &dyn Observer,
) -> Result<(), ProxmoxError> {
    if s.upload == UploadFormat::DownloadUrl {
        return download(api, host, s, img, volid, opts, observer);
    }
    if !converts(s, img.format) {
        return upload(api, host, s, img, volid, opts, observer);
    }
    let mut path = img.path.clone().into_os_string();
    path.push(".upload.qcow2");
    let path = std::path::PathBuf::from(path);
    let converted = qcow2::raw_to_qcow2(&img.path, &path).map(|(size, sha256)| PublishImage {
        path: path.clone(),
        size,
        sha256,
        format: ImageFormat::Qcow2,
        ..img.clone()
    });
    let result = converted
        .map_err(|e| ProxmoxError::Api {
            what: format!("converting {} to qcow2", img.path.display()),
            message: e.to_string(),
        })
        .and_then(|qcow2| upload(api, host, s, &qcow2, volid, opts, observer));
    let _ = std::fs::remove_file(&path);
    result
}

/// Makes the node's VM what its decision says (created, its settings
/// changed, its disk or ISO replaced, or left); what it did.
fn converge_vm(
    survey: &Survey,
    img: &PublishImage,
    volid: &str,
    vm: &ProxmoxVm,
    decided: VmDecision,
    opts: &PublishOptions,
    observer: &dyn Observer,
) -> Result<VmChange, ProxmoxError> {
    let VmDecision {
        place,
        change,
        settings,
        ..
    } = decided;
    let (api, inv) = (&survey.api, survey.inv);
    let (index, vmid) = (img.index, place.vmid);
    let machine = inv
        .machine(index)
        .expect("a node with a VM decision has a machine");
    let pve = &place.host;
    let base = format!("/nodes/{pve}/qemu/{vmid}");
    let desc = || description(inv, &img.node, volid, &img.sha256);
    let Some((running, config)) = place.existing else {
        let params = vm_params(inv, index, vm, &machine, vmid, volid, &img.sha256);
        let task = api.post("creating VM", &format!("/nodes/{pve}/qemu"), &params)?;
        api.wait(&format!("creating VM {vmid}"), &task, opts)?;
        if vm.boot == VmBoot::Disk {
            resize(api, &base, "scsi0", machine.disk_size, opts)?;
        }
        observer.event(&img.node, &Event::VmCreated { vmid });
        return Ok(VmChange::Created);
    };
    let replacing = change == Some(VmChange::Updated);
    let reboot_for = apply_settings(api, &base, vm, &config, &settings, replacing, opts)?;
    for c in &settings {
        observer.event(
            &img.node,
            &Event::VmSetting {
                vmid,
                change: c.clone(),
            },
        );
    }
    if !replacing {
        if reboot_for && running {
            let node = &inv.nodes[index];
            let talos = node
                .talos_endpoint
                .as_deref()
                .and_then(crate::inventory::talos_endpoint)
                .or_else(|| {
                    node.address
                        .map(|a| std::net::SocketAddr::new(a, crate::inventory::TALOS_API_PORT))
                });
            reboot(api, &base, vmid, talos, opts)?;
            observer.event(&img.node, &Event::VmRebooted { vmid });
        }
        if change == Some(VmChange::Unchanged) {
            let running_image = described_volume(&config)
                .unwrap_or_else(|| "an image imgbuild did not record".into());
            observer.event(
                &img.node,
                &Event::VmKeepsDisk {
                    vmid,
                    running: running_image,
                },
            );
        }
        return Ok(change.unwrap_or(VmChange::Unchanged));
    }
    if vm.boot == VmBoot::Iso {
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
        return Ok(VmChange::Updated);
    }
    let old = config["scsi0"].as_str().map(drive_volume);
    let disk = NewDisk {
        volid,
        description: &desc(),
        replaces: old,
        size: machine.disk_size,
    };
    replace_disk(api, &base, vm, vmid, &disk, running, opts)?;
    observer.event(&img.node, &Event::DiskReplaced { vmid });
    Ok(VmChange::Updated)
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
    /// Whether the image would be uploaded; unknown until it is built,
    /// except for an existing VM (its disk is kept: no upload).
    pub upload: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vmid: Option<u32>,
    /// The vmid the inventory gives when the node's VM is another one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inventory_vmid: Option<u32>,
    /// What would happen to its VM.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vm: Option<VmChange>,
    /// An existing VM's settings that would change, from → to.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub settings: Vec<SettingChange>,
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
