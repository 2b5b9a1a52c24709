//! The inventory's publish target as a value, chosen here in one function
//! for `publish` and `up` (`plan` names the same choice through
//! `PublishSection::target`, as it runs without credentials).

use std::collections::BTreeSet;

use super::hcloud::{self, Api, HcloudError, SnapshotImage, SnapshotOptions, SnapshotOutcome};
use super::proxmox::{self, Decision, NodePublished, ProxmoxError, PublishOptions};
use super::{Cancel, PublishImage};
use crate::inventory::{HcloudSettings, Inventory, ProxmoxSettings, PublishSettings};

/// Where the images go and the machines come from.
#[derive(Debug, Clone)]
pub enum Target {
    /// No publish section: image files in the out dir (machines booted by
    /// other means).
    None,
    /// Images uploaded to Proxmox VE (and one VM per node).
    Proxmox(Box<ProxmoxTarget>),
    /// Snapshots in Hetzner Cloud (and one server per node created from
    /// them with its machine config as `user_data`).
    Hcloud(Box<HcloudTarget>),
}

/// A Hetzner Cloud target: where, as whom, and how patiently.
#[derive(Debug, Clone)]
pub struct HcloudTarget {
    pub settings: HcloudSettings,
    pub credentials: hcloud::Credentials,
    pub options: SnapshotOptions,
    /// Stops the snapshot runs (which then delete their temporary server).
    pub cancel: Cancel,
}

impl HcloudTarget {
    /// The API client of this run.
    pub fn api(&self) -> Result<Api, HcloudError> {
        self.credentials.api(self.options.retry)
    }

    /// The dry run: the snapshot each image would be published as, where
    /// one exists (the lookup the real run starts with). GETs only.
    pub fn plan(
        &self,
        api: &Api,
        images: &[SnapshotImage],
    ) -> Result<Vec<Option<u64>>, HcloudError> {
        images
            .iter()
            .map(|image| hcloud::find_snapshot(api, &self.settings, image))
            .collect()
    }

    /// Snapshots of `images`, one after another; none is started after an
    /// interrupt (see [`hcloud::publish_snapshots`]).
    pub fn publish(
        &self,
        api: &Api,
        images: &[SnapshotImage],
        observer: &dyn hcloud::Observer,
    ) -> Vec<SnapshotOutcome> {
        hcloud::publish_snapshots(
            api,
            &self.settings,
            images,
            &self.options,
            &self.cancel,
            observer,
        )
    }
}

/// A Proxmox VE target: where, as whom, and how to publish.
#[derive(Debug, Clone)]
pub struct ProxmoxTarget {
    pub settings: ProxmoxSettings,
    pub credentials: proxmox::Credentials,
    pub options: PublishOptions,
}

impl ProxmoxTarget {
    /// The dry run: each node's [`Decision`] (by inventory position, with
    /// its image when built). GETs only.
    pub fn plan(
        &self,
        inv: &Inventory,
        nodes: &[(usize, Option<PublishImage>)],
    ) -> Result<Vec<Result<Decision, ProxmoxError>>, ProxmoxError> {
        self.dry_run_without(inv, nodes, &[])
    }

    /// [`ProxmoxTarget::plan`] with the VMs of the nodes in `gone` (by
    /// inventory position) as if deleted first (`replace`'s dry run).
    pub fn dry_run_without(
        &self,
        inv: &Inventory,
        nodes: &[(usize, Option<PublishImage>)],
        gone: &[usize],
    ) -> Result<Vec<Result<Decision, ProxmoxError>>, ProxmoxError> {
        proxmox::plan(
            inv,
            &self.settings,
            &self.credentials,
            nodes,
            gone,
            &self.options,
        )
    }

    /// Publishes `images`, each node carrying out the same decision.
    pub fn publish(
        &self,
        inv: &Inventory,
        images: &[PublishImage],
        observer: &dyn proxmox::Observer,
    ) -> Result<Vec<Result<NodePublished, ProxmoxError>>, ProxmoxError> {
        proxmox::publish(
            inv,
            &self.settings,
            &self.credentials,
            images,
            &self.options,
            observer,
        )
    }
}

impl ProxmoxTarget {
    /// The nodes (by inventory position) whose VM needs an image now; the
    /// VMs of `gone` as if deleted.
    pub fn needing_images(
        &self,
        inv: &Inventory,
        nodes: &[usize],
        gone: &[usize],
    ) -> Result<Vec<usize>, ProxmoxError> {
        proxmox::needing_images(
            inv,
            &self.settings,
            &self.credentials,
            nodes,
            gone,
            &self.options,
        )
    }

    /// `up`'s publish: images only where a VM needs one; settings left
    /// for [`ProxmoxTarget::change_settings`].
    pub fn publish_machines(
        &self,
        inv: &Inventory,
        nodes: &[(usize, Option<PublishImage>)],
        observer: &dyn proxmox::Observer,
    ) -> Result<Vec<Result<proxmox::MachinePublished, ProxmoxError>>, ProxmoxError> {
        proxmox::publish_machines(
            inv,
            &self.settings,
            &self.credentials,
            nodes,
            &self.options,
            observer,
        )
    }

    /// `up`'s settings step over `nodes` (by inventory position).
    pub fn change_settings(
        &self,
        inv: &Inventory,
        nodes: &[usize],
        observer: &dyn proxmox::Observer,
        dry_run: bool,
    ) -> Result<Vec<Result<proxmox::NodeSettings, ProxmoxError>>, ProxmoxError> {
        proxmox::change_settings(
            inv,
            &self.settings,
            &self.credentials,
            nodes,
            &self.options,
            observer,
            dry_run,
        )
    }
}

/// A machine imgbuild made for a node of the cluster (by imgbuild's
/// marker: a Proxmox VM's description, a Hetzner server's labels).
#[derive(Debug, Clone)]
pub struct ClusterMachine {
    pub node: String,
    /// `VM 304 on pve`, `server 42 (demo-worker-02)`.
    pub what: String,
    /// The volumes deleting it frees.
    pub volumes: Vec<String>,
    /// The Proxmox VM it is (None: a Hetzner server).
    vm: Option<proxmox::destroy::ClusterVm>,
}

impl ClusterMachine {
    /// The Proxmox VM's id (None for a server).
    pub fn vmid(&self) -> Option<u32> {
        self.vm.as_ref().map(|vm| vm.vmid)
    }
}

/// Why a machine of a node the inventory dropped could not be deleted (as
/// `imgbuild down` deletes each). Never carries a secret.
#[derive(Debug, thiserror::Error)]
pub enum MachineError {
    /// `what` names the VM (`VM 303 on pve`).
    #[error("deleting {what}: {source}")]
    Vm {
        what: String,
        #[source]
        source: Box<ProxmoxError>,
    },
    /// No Hetzner Cloud API client (the token is missing or invalid).
    #[error(transparent)]
    Hcloud(#[from] HcloudError),
    /// Hetzner Cloud left the server (or a volume of it) behind.
    #[error("deleting server {id}: {error}")]
    Server { id: u64, error: String },
}

/// How each kind of target publishes, and what the command needs of it.
#[derive(Debug, Clone)]
pub struct TargetOptions {
    pub proxmox: PublishOptions,
    pub hcloud: SnapshotOptions,
    pub cancel: Cancel,
    /// One running machine per node (`up`): a target without VMs or
    /// servers is refused, and Proxmox VMs start whatever `vm.start` says.
    pub machines: bool,
}

/// Why the inventory's target cannot be used. Never carries a secret.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    /// The inventory lacks what the command needs.
    #[error("{0}")]
    Setup(String),
    #[error(transparent)]
    Proxmox(#[from] ProxmoxError),
    #[error(transparent)]
    Hcloud(#[from] HcloudError),
}

impl TargetError {
    /// Whether the inventory or environment is at fault (not a server).
    pub fn is_setup(&self) -> bool {
        matches!(
            self,
            TargetError::Setup(_)
                | TargetError::Proxmox(ProxmoxError::Setup(_))
                | TargetError::Hcloud(HcloudError::Setup(_))
        )
    }
}

/// What a caller does on each kind of target, one method per kind:
/// [`Target::visit`] calls the one that applies, so the caller (`up`'s
/// publish, which records its report rows) needs no match on the target.
pub trait Visitor {
    type Out;
    /// No publish section: no machines to make.
    fn none(self) -> Self::Out;
    fn proxmox(self, pve: &ProxmoxTarget) -> Self::Out;
    fn hcloud(self, hc: &HcloudTarget) -> Self::Out;
}

impl Target {
    /// Calls `v`'s method for this kind of target.
    pub fn visit<V: Visitor>(&self, v: V) -> V::Out {
        match self {
            Target::None => v.none(),
            Target::Proxmox(pve) => v.proxmox(pve),
            Target::Hcloud(hc) => v.hcloud(hc),
        }
    }

    /// The inventory's `publish` section as a target, credentials read
    /// through `env` (before anything is built: a missing token must not
    /// wait for a build).
    pub fn from_inventory(
        inv: &Inventory,
        env: &dyn Fn(&str) -> Option<String>,
        options: TargetOptions,
    ) -> Result<Target, TargetError> {
        match inv.publish.target() {
            PublishSettings::None => Ok(Target::None),
            PublishSettings::Hcloud(settings) => {
                if options.machines && settings.servers.is_none() {
                    return Err(TargetError::Setup(
                        "publish.hcloud has no servers section (`servers: {type: cpx22}`): `up` needs servers to bootstrap (`imgbuild publish` only makes snapshots)".into(),
                    ));
                }
                Ok(Target::Hcloud(Box::new(HcloudTarget {
                    settings: hcloud::for_cluster(settings, &inv.cluster.name),
                    credentials: hcloud::Credentials::from_env(env)?,
                    options: options.hcloud,
                    cancel: options.cancel,
                })))
            }
            PublishSettings::Proxmox(settings) => {
                let mut settings = settings.clone();
                if options.machines {
                    let Some(vm) = settings.vm.as_mut() else {
                        return Err(TargetError::Setup(
                            "publish.proxmox has no vm section: `up` needs VMs to bootstrap (`imgbuild publish` only uploads)".into(),
                        ));
                    };
                    vm.start = true;
                }
                let credentials = proxmox::Credentials::from_env(&settings, env)?;
                Ok(Target::Proxmox(Box::new(ProxmoxTarget {
                    settings,
                    credentials,
                    options: options.proxmox,
                })))
            }
        }
    }

    /// The nodes among `nodes` (all when empty) whose machine needs an
    /// image now, by name: none without a target (machines booted by
    /// other means); on Hetzner those without a server (a server's image
    /// is history); on Proxmox the VMs to be made or, with
    /// `--replace-disk`, given a new disk (an existing VM's disk is
    /// upgraded in place through the installer). `gone` (by inventory
    /// position): VMs counted as deleted (`replace`'s dry run). Only reads.
    pub fn needing_images(
        &self,
        inv: &Inventory,
        nodes: &[String],
        gone: &[usize],
    ) -> Result<Vec<String>, TargetError> {
        match self {
            Target::None => Ok(Vec::new()),
            Target::Hcloud(hc) => {
                let api = hc.api()?;
                Ok(hcloud::servers::without_server(&api, inv, nodes)?)
            }
            Target::Proxmox(pve) => {
                let selected: Vec<usize> = (0..inv.nodes.len())
                    .filter(|&i| nodes.is_empty() || nodes.contains(&inv.nodes[i].name))
                    .collect();
                Ok(pve
                    .needing_images(inv, &selected, gone)?
                    .into_iter()
                    .map(|i| inv.nodes[i].name.clone())
                    .collect())
            }
        }
    }

    /// What stops a run's snapshots and bootstrap (Hetzner's signal
    /// handler); None where nothing needs one.
    pub fn cancel(&self) -> Option<Cancel> {
        match self {
            Target::Hcloud(hc) => Some(hc.cancel),
            _ => None,
        }
    }

    /// Every machine imgbuild made for `cluster`, whatever the inventory
    /// says now (none without a target). Only reads.
    pub fn machines(&self, cluster: &str) -> Result<Vec<ClusterMachine>, TargetError> {
        Ok(match self {
            Target::None => Vec::new(),
            Target::Proxmox(pve) => {
                proxmox::destroy::cluster_vms(&pve.credentials, cluster, pve.options.retry)?
                    .into_iter()
                    .map(|vm| ClusterMachine {
                        node: vm.node.clone(),
                        what: format!("VM {} on {}", vm.vmid, vm.pve_node),
                        volumes: vm.disks.clone(),
                        vm: Some(vm),
                    })
                    .collect()
            }
            Target::Hcloud(hc) => {
                let api = hc.api()?;
                hcloud::servers::existing(&api, cluster)?
                    .into_iter()
                    .map(|s| ClusterMachine {
                        node: s.node.clone(),
                        what: format!("server {} ({})", s.id, s.name),
                        volumes: Vec::new(),
                        vm: None,
                    })
                    .collect()
            }
        })
    }

    /// Deletes machine `m` of `cluster` with its volumes, as `imgbuild
    /// down` deletes each.
    pub fn delete_machine(&self, cluster: &str, m: &ClusterMachine) -> Result<(), MachineError> {
        match (self, &m.vm) {
            (Target::Proxmox(pve), Some(vm)) => {
                proxmox::destroy::delete_vm(&pve.credentials, cluster, vm, &self.delete_options())
                    .map_err(|source| MachineError::Vm {
                        what: m.what.clone(),
                        source: Box::new(source),
                    })?;
            }
            (Target::Hcloud(hc), _) => {
                let api = hc.api()?;
                let (_, left) = hcloud::servers::delete_node(&api, cluster, &m.node, &hc.options);
                if let Some(l) = left.first() {
                    return Err(MachineError::Server {
                        id: l.id,
                        error: l.error.clone(),
                    });
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// How this target's deletions poll and retry (a Proxmox target's
    /// own settings; the defaults elsewhere).
    pub fn delete_options(&self) -> proxmox::destroy::DeleteOptions {
        match self {
            Target::Proxmox(pve) => proxmox::destroy::DeleteOptions {
                poll: pve.options.poll,
                retry: pve.options.retry,
                ..proxmox::destroy::DeleteOptions::default()
            },
            _ => proxmox::destroy::DeleteOptions::default(),
        }
    }

    /// The uploads of `nodes` that only the VMs `deleted` use, named as the
    /// prune names them: unused once those are deleted (Proxmox only).
    pub fn freed_by(
        &self,
        cluster: &str,
        nodes: &BTreeSet<String>,
        deleted: &[u32],
    ) -> Result<Vec<String>, TargetError> {
        let Target::Proxmox(pve) = self else {
            return Ok(Vec::new());
        };
        if nodes.is_empty() || deleted.is_empty() {
            return Ok(Vec::new());
        }
        let volumes = proxmox::destroy::cluster_volumes(
            &pve.credentials,
            &pve.settings.storage,
            cluster,
            nodes,
            pve.options.retry,
        )?;
        Ok(volumes
            .into_iter()
            .filter(|v| nodes.contains(&v.node))
            .filter(|v| !v.used_by.is_empty() && v.used_by.iter().all(|id| deleted.contains(id)))
            .map(|v| format!("volume {} on {}", v.volid, v.pve_node))
            .collect())
    }

    /// `up`'s settings step over `nodes` (by inventory position): each VM's
    /// settings changed where they differ (none to change elsewhere: a
    /// server's type is its own).
    pub fn change_settings(
        &self,
        inv: &Inventory,
        nodes: &[usize],
        observer: &dyn proxmox::Observer,
        dry_run: bool,
    ) -> Result<Vec<Result<proxmox::NodeSettings, ProxmoxError>>, ProxmoxError> {
        match self {
            Target::Proxmox(pve) => pve.change_settings(inv, nodes, observer, dry_run),
            _ => Ok(Vec::new()),
        }
    }

    /// The name reports carry.
    pub fn name(&self) -> &'static str {
        match self {
            Target::None => "none",
            Target::Proxmox(_) => "proxmox",
            Target::Hcloud(_) => "hcloud",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn inv(publish: &str) -> Inventory {
        let text = format!(
            r#"
cluster: {{name: lab, talosVersion: v1.11.2, kubernetesVersion: v1.34.1, endpoint: "https://10.0.0.10:6443"}}
network: {{cidr: 10.0.0.0/24, gateway: 10.0.0.1, interface: ens18}}
{publish}
nodes:
  - {{name: cp-01, role: controlplane, address: 10.0.0.11}}
  - {{name: w-01, role: worker, address: 10.0.0.21}}
"#
        );
        Inventory::parse(&text, Path::new("cluster.yaml")).unwrap()
    }

    const ENV: [(&str, &str); 2] = [
        ("PROXMOX_VE_ENDPOINT", "https://127.0.0.1:8006/"),
        ("PROXMOX_VE_API_TOKEN", "root@pam!up=secret"),
    ];

    fn target(publish: &str, env: &[(&str, &str)], machines: bool) -> Result<Target, TargetError> {
        let lookup = |k: &str| {
            env.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        };
        let options = TargetOptions {
            proxmox: PublishOptions::default(),
            hcloud: SnapshotOptions::default(),
            cancel: Cancel::never(),
            machines,
        };
        Target::from_inventory(&inv(publish), &lookup, options)
    }

    const PVE: &str = "publish:\n  proxmox:\n    node: pve\n    storage: local\n    vm: {storage: local-lvm, firstId: 300, start: false}";

    #[test]
    fn no_publish_section_means_no_target() {
        assert!(matches!(target("", &[], true).unwrap(), Target::None));
    }

    #[test]
    fn machines_start_whatever_the_inventory_says() {
        for machines in [true, false] {
            let t = target(PVE, &ENV, machines).unwrap();
            let Target::Proxmox(pve) = t else {
                panic!("not proxmox: {t:?}")
            };
            assert_eq!(pve.settings.vm.unwrap().start, machines);
        }
    }

    #[test]
    fn targets_without_machines_are_setup_errors_only_when_machines_are_needed() {
        let uploads = "publish:\n  proxmox:\n    node: pve\n    storage: local";
        let no_vm = target(uploads, &ENV, true).unwrap_err();
        assert!(no_vm.is_setup());
        assert!(no_vm.to_string().contains("no vm section"), "{no_vm}");
        assert_eq!(target(uploads, &ENV, false).unwrap().name(), "proxmox");
        let no_env = target(PVE, &[], true).unwrap_err();
        assert!(no_env.is_setup());
        assert!(
            no_env.to_string().contains("PROXMOX_VE_ENDPOINT"),
            "{no_env}"
        );
        let snapshots = "image: {platform: hcloud}\npublish:\n  hcloud: {location: fsn1}";
        let hcloud = target(snapshots, &ENV, true).unwrap_err();
        assert!(hcloud.is_setup());
        assert!(
            hcloud.to_string().contains("no servers section"),
            "{hcloud}"
        );
        let only_snapshots = target(snapshots, &[("HCLOUD_TOKEN", "t0ken")], false).unwrap();
        assert_eq!(only_snapshots.name(), "hcloud");
        let servers = "image: {platform: hcloud}\npublish:\n  hcloud: {location: fsn1, servers: {type: cpx22}}";
        let no_token = target(servers, &ENV, true).unwrap_err();
        assert!(no_token.is_setup());
        assert!(no_token.to_string().contains("HCLOUD_TOKEN"), "{no_token}");
        let t = target(servers, &[("HCLOUD_TOKEN", "t0ken")], true).unwrap();
        assert_eq!(t.name(), "hcloud");
        assert!(!format!("{t:?}").contains("t0ken"));
    }
}
