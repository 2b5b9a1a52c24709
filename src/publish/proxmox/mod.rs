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
use upload::{download, upload, upload_qcow2};
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
    /// Nodes (by inventory position) whose VM is decided on as if it were
    /// gone: `replace` deletes it before it publishes.
    gone: BTreeSet<usize>,
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
            gone: BTreeSet::new(),
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
        let mut place = place(&self.api, self.inv, &machine.host, &self.vms, index)?;
        if self.gone.contains(&index) {
            place.existing = None;
        }
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
            kept: None,
        };
        let (Some(vm), Some(machine)) = (&self.settings.vm, self.inv.machine(index)) else {
            return Ok(out);
        };
        let decided = self.vm(vm, &machine, index, img.map(|i| i.size), replace)?;
        if !decided.needs_image {
            out.kept = decided
                .place
                .existing
                .as_ref()
                .and_then(|(_, config)| described_volume(config));
        }
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
        .map(|img| publish_node(&survey, img, opts, observer, false))
        .collect())
}

/// What `up` did to one node's machine at publish: the image only where
/// the VM needs one (made, or `--replace-disk`); an existing VM keeps its
/// disk, which Talos upgrades in place through the installer.
#[derive(Debug, Clone)]
pub struct MachinePublished {
    pub node: String,
    /// The volume it boots: the new image's, or for a VM kept the one its
    /// description records (the image it was made from).
    pub volid: Option<String>,
    pub uploaded: bool,
    pub vmid: Option<u32>,
    pub vm: Option<VmChange>,
    pub started: bool,
}

/// The nodes (by inventory position) whose VM needs an image now: the
/// ones to be made and, with `--replace-disk`, every one; all of them
/// without a `vm` section. A node whose VM cannot be decided on is
/// listed too, so that its publish names why. The VMs of `gone` count as
/// deleted. GETs only.
pub fn needing_images(
    inv: &Inventory,
    settings: &ProxmoxSettings,
    creds: &Credentials,
    nodes: &[usize],
    gone: &[usize],
    opts: &PublishOptions,
) -> Result<Vec<usize>, ProxmoxError> {
    let Some(vm) = &settings.vm else {
        return Ok(nodes.to_vec());
    };
    let mut survey = Survey::new(inv, settings, creds, opts)?;
    survey.gone.extend(gone);
    Ok(nodes
        .iter()
        .copied()
        .filter(|&index| {
            inv.machine(index).is_none_or(|machine| {
                match survey.vm(vm, &machine, index, None, opts.replace_disk) {
                    Ok(d) => d.needs_image,
                    Err(_) => true,
                }
            })
        })
        .collect())
}

/// `up`'s publish: each node (by inventory position) with its image when
/// its VM needs one ([`needing_images`]), one after the other. VM settings
/// are left to [`change_settings`], the step after the configs.
pub fn publish_machines(
    inv: &Inventory,
    settings: &ProxmoxSettings,
    creds: &Credentials,
    nodes: &[(usize, Option<PublishImage>)],
    opts: &PublishOptions,
    observer: &dyn Observer,
) -> Result<Vec<Result<MachinePublished, ProxmoxError>>, ProxmoxError> {
    if settings.upload == UploadFormat::DownloadUrl
        && let Some(why) = nodes
            .iter()
            .filter_map(|(_, i)| i.as_ref())
            .find_map(download_problem)
    {
        return Err(ProxmoxError::Setup(why));
    }
    let survey = Survey::new(inv, settings, creds, opts)?;
    Ok(nodes
        .iter()
        .map(|(index, img)| match img {
            Some(img) => {
                publish_node(&survey, img, opts, observer, true).map(|p| MachinePublished {
                    node: p.node,
                    volid: Some(p.volid),
                    uploaded: p.uploaded,
                    vmid: p.vmid,
                    vm: p.vm,
                    started: p.started,
                })
            }
            None => keep_machine(&survey, *index, opts, observer),
        })
        .collect())
}

/// A node whose VM exists and needs no image: started if it is stopped,
/// nothing else.
fn keep_machine(
    survey: &Survey,
    index: usize,
    opts: &PublishOptions,
    observer: &dyn Observer,
) -> Result<MachinePublished, ProxmoxError> {
    let node = survey.inv.nodes[index].name.clone();
    let mut out = MachinePublished {
        node: node.clone(),
        volid: None,
        uploaded: false,
        vmid: None,
        vm: None,
        started: false,
    };
    let (Some(vm), Some(machine)) = (&survey.settings.vm, survey.inv.machine(index)) else {
        return Ok(out);
    };
    let decided = survey
        .vm(vm, &machine, index, None, opts.replace_disk)
        .map_err(|e| e.at(&node, Step::Vm, None))?;
    let Some((_, config)) = &decided.place.existing else {
        return Err(ProxmoxError::Node {
            node,
            step: Step::Upload,
            done: None,
            message: "its VM is to be made and no image was built for it".into(),
        });
    };
    let vmid = decided.place.vmid;
    out.vmid = Some(vmid);
    out.vm = Some(VmChange::Unchanged);
    out.volid = described_volume(config);
    observer.event(
        &node,
        &Event::VmKeepsDisk {
            vmid,
            running: out
                .volid
                .clone()
                .unwrap_or_else(|| "an image imgbuild did not record".into()),
        },
    );
    if decided.start {
        let base = format!("/nodes/{}/qemu/{vmid}", decided.place.host);
        start(&survey.api, &base, vmid, opts).map_err(|e| e.at(&node, Step::Start, None))?;
        observer.event(&node, &Event::VmStarted { vmid });
        out.started = true;
    }
    Ok(out)
}

/// One node's VM settings as the settings step found them: changed
/// (each from → to), or, in a dry run, to change.
#[derive(Debug, Clone)]
pub struct NodeSettings {
    pub index: usize,
    pub node: String,
    pub vmid: u32,
    pub changes: Vec<SettingChange>,
}

/// The settings step of `up` (after the configs): each existing VM's
/// settings read again and, unless `dry_run`, changed as Proxmox allows,
/// a VM that needs a reboot for them rebooted (one at a time, waiting for
/// its Talos API). Nodes whose settings already match are left out.
pub fn change_settings(
    inv: &Inventory,
    settings: &ProxmoxSettings,
    creds: &Credentials,
    nodes: &[usize],
    opts: &PublishOptions,
    observer: &dyn Observer,
    dry_run: bool,
) -> Result<Vec<Result<NodeSettings, ProxmoxError>>, ProxmoxError> {
    let Some(vm) = &settings.vm else {
        return Ok(Vec::new());
    };
    let survey = Survey::new(inv, settings, creds, opts)?;
    let mut out = Vec::new();
    for &index in nodes {
        let Some(machine) = inv.machine(index) else {
            continue;
        };
        let node = &inv.nodes[index].name;
        let decided = match survey.vm(vm, &machine, index, None, false) {
            Ok(d) => d,
            Err(e) => {
                out.push(Err(e.at(node, Step::Vm, None)));
                continue;
            }
        };
        let Some((running, config)) = &decided.place.existing else {
            continue;
        };
        if decided.settings.is_empty() {
            continue;
        }
        let vmid = decided.place.vmid;
        let found = NodeSettings {
            index,
            node: node.clone(),
            vmid,
            changes: decided.settings.clone(),
        };
        if dry_run {
            out.push(Ok(found));
            continue;
        }
        let base = format!("/nodes/{}/qemu/{vmid}", decided.place.host);
        let applied = apply_settings(
            &survey.api,
            &base,
            vm,
            config,
            &decided.settings,
            false,
            opts,
        )
        .and_then(|reboot_for| {
            for c in &decided.settings {
                observer.event(
                    node,
                    &Event::VmSetting {
                        vmid,
                        change: c.clone(),
                    },
                );
            }
            if reboot_for && *running {
                reboot(&survey.api, &base, vmid, talos_endpoint(inv, index), opts)?;
                observer.event(node, &Event::VmRebooted { vmid });
            }
            Ok(())
        });
        out.push(
            applied
                .map(|()| found)
                .map_err(|e| e.at(node, Step::Vm, None)),
        );
    }
    Ok(out)
}

/// Where the Talos API of the node at `index` answers, when known: what
/// a reboot waits for.
fn talos_endpoint(inv: &Inventory, index: usize) -> Option<std::net::SocketAddr> {
    let node = &inv.nodes[index];
    node.talos_endpoint
        .as_deref()
        .and_then(crate::inventory::talos_endpoint)
        .or_else(|| {
            node.address
                .map(|a| std::net::SocketAddr::new(a, crate::inventory::TALOS_API_PORT))
        })
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
/// With `defer_settings` (`up`), an existing VM's settings are left for
/// [`change_settings`].
fn publish_node(
    survey: &Survey,
    img: &PublishImage,
    opts: &PublishOptions,
    observer: &dyn Observer,
    defer_settings: bool,
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
        (Some(vm), Some(machine)) => {
            let mut d = survey
                .vm(vm, &machine, img.index, Some(img.size), opts.replace_disk)
                .map_err(|e| e.at(&img.node, Step::Vm, None))?;
            if defer_settings {
                d.settings.clear();
                if d.change == Some(VmChange::Changed) {
                    d.change = Some(VmChange::Unchanged);
                }
            }
            Some(d)
        }
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
/// the factory (`upload: download-url`), or uploaded, a raw image as a
/// qcow2 generated while it is sent, so only its non-zero clusters cross
/// the wire.
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
    if converts(s, img.format) {
        return upload_qcow2(api, host, s, img, volid, opts, observer);
    }
    upload(api, host, s, img, volid, opts, observer)
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
            reboot(api, &base, vmid, talos_endpoint(inv, index), opts)?;
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
    /// The volume an existing VM that needs no image keeps booting, as its
    /// description records it.
    #[serde(skip)]
    pub kept: Option<String>,
}

/// The dry run of [`publish`]: for each node (by inventory position, with
/// its image when built) what would be uploaded, created and started; the
/// VMs of the nodes in `gone` as if deleted first. Sends only GETs.
pub fn plan(
    inv: &Inventory,
    settings: &ProxmoxSettings,
    creds: &Credentials,
    nodes: &[(usize, Option<PublishImage>)],
    gone: &[usize],
    opts: &PublishOptions,
) -> Result<Vec<Result<Decision, ProxmoxError>>, ProxmoxError> {
    let mut survey = Survey::new(inv, settings, creds, opts)?;
    survey.gone.extend(gone);
    Ok(nodes
        .iter()
        .map(|(index, img)| survey.decide(*index, img.as_ref(), opts.replace_disk))
        .collect())
}

#[cfg(test)]
mod tests;
