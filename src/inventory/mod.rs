//! The cluster inventory (`cluster.yaml`): one declarative description of the
//! cluster that every later stage reads. Loading validates everything up
//! front and reports every problem at once, each with file, line and field.

mod locate;
mod net;
mod publish;

pub use locate::LineIndex;
pub use net::{Cidr, MacAddr};
pub use publish::{
    HcloudServers, HcloudSettings, Machine, NodeMachine, ProxmoxSettings, ProxmoxVm,
    PublishSection, PublishSettings, RESERVED_LABELS, UploadFormat, VmBoot, label_problem,
};

pub use crate::schematic::Bootloader;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

/// The validated inventory.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Inventory {
    pub cluster: ClusterSettings,
    #[serde(default)]
    pub image: ImageSettings,
    #[serde(default)]
    pub network: NetworkSettings,
    /// Strategic-merge patches for the machine configs.
    #[serde(default)]
    pub patches: Patches,
    /// Where `publish` puts the built images ([`PublishSection::target`]).
    #[serde(default)]
    pub publish: PublishSection,
    pub nodes: Vec<NodeSpec>,
    /// The inventory file's folder: relative paths in it (patches, the
    /// default state dir) start here.
    #[serde(skip)]
    pub base_dir: PathBuf,
    /// Non-fatal findings the CLI shows (and puts in `--output json`).
    #[serde(skip)]
    pub warnings: Vec<String>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ClusterSettings {
    pub name: String,
    pub talos_version: String,
    pub kubernetes_version: String,
    /// The Kubernetes API endpoint, `https://host:port`.
    pub endpoint: String,
    /// A shared control-plane address that exists only after bootstrap.
    #[serde(default)]
    pub vip: Option<IpAddr>,
    /// Where this host reaches the Kubernetes API (`https://host:port`)
    /// when `endpoint` is in-cluster only: a port forward or NAT. Used for
    /// every Kubernetes call and in the written kubeconfig; machine
    /// configs keep `endpoint`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubernetes_endpoint: Option<String>,
    /// The cluster's secrets as a SOPS file kept in Git, relative to the
    /// inventory [default: `secrets.sops.yaml` beside it, when it exists].
    /// Read in memory with the environment's age keys, never copied in
    /// clear into the state dir.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secrets_file: Option<PathBuf>,
    /// Where the etcd snapshot taken before a run's first control-plane
    /// change goes (relative to the inventory's folder): a folder a CI
    /// job keeps as an artifact. None: the state dir's `etcd/`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd_snapshot_dir: Option<PathBuf>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ImageSettings {
    #[serde(default = "default_platform")]
    pub platform: String,
    #[serde(default)]
    pub arch: Arch,
    #[serde(default)]
    pub format: ImageFormat,
    /// The schematic's `customization.bootloader`: `grub` makes ISOs of
    /// Talos v1.10 and later boot GRUB on UEFI too, so a per-node ISO can
    /// carry META on its kernel lines.
    #[serde(default, skip_serializing_if = "Bootloader::is_none")]
    pub bootloader: Bootloader,
    #[serde(default)]
    pub extensions: Vec<String>,
    #[serde(default)]
    pub kernel_args: Vec<String>,
    /// Image Factory base URL.
    #[serde(default = "default_factory")]
    pub factory: String,
    /// Secure Boot images (`<platform>-<arch>-secureboot.*`, installers
    /// `…-installer-secureboot`) for every node that does not say otherwise.
    #[serde(default, skip_serializing_if = "is_false")]
    pub secure_boot: bool,
    /// The schematic's `customization.secureboot.enrollKeys`: how
    /// systemd-boot enrolls the Secure Boot keys on first boot
    /// (`off`, `manual`, `if-safe`, `force`; the factory's default is `if-safe`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enroll_keys: Option<String>,
    /// The schematic's `customization.secureboot.includeWellKnownCertificates`.
    #[serde(default, skip_serializing_if = "is_false")]
    pub include_well_known_certificates: bool,
    /// `tpm`: the STATE and EPHEMERAL volumes are encrypted with keys
    /// sealed to the TPM, enrolled only while Secure Boot is on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encryption: Option<Encryption>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// How the system disk's volumes are encrypted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Encryption {
    /// LUKS2 with a key sealed to the TPM (Talos `tpm` key slot).
    Tpm,
}

/// The values `customization.secureboot.enrollKeys` takes: systemd-boot's
/// `secure-boot-enroll` (siderolabs/image-factory `pkg/schematic/schematic.go`,
/// parsed by `profile.SDBootEnrollKeysString`).
pub const ENROLL_KEYS: &[&str] = &["off", "manual", "if-safe", "force"];

impl Default for ImageSettings {
    fn default() -> Self {
        ImageSettings {
            platform: default_platform(),
            arch: Arch::default(),
            format: ImageFormat::default(),
            bootloader: Bootloader::default(),
            extensions: Vec::new(),
            kernel_args: Vec::new(),
            factory: default_factory(),
            secure_boot: false,
            enroll_keys: None,
            include_well_known_certificates: false,
            encryption: None,
        }
    }
}

fn default_platform() -> String {
    "metal".into()
}

fn default_factory() -> String {
    "https://factory.talos.dev".into()
}

/// CPU architecture of the images.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    #[default]
    Amd64,
    Arm64,
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Arch::Amd64 => "amd64",
            Arch::Arm64 => "arm64",
        })
    }
}

/// The disk-image format imgbuild writes for each node.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ImageFormat {
    #[default]
    Raw,
    Qcow2,
    /// A boot ISO (the factory's GRUB ISO with the node's META on its
    /// kernel lines, on the patch route).
    Iso,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NetworkSettings {
    /// The nodes' subnet, `10.0.0.0/16`; gives every static address its prefix.
    #[serde(default)]
    pub cidr: Option<Cidr>,
    #[serde(default)]
    pub gateway: Option<IpAddr>,
    #[serde(default)]
    pub nameservers: Vec<IpAddr>,
    #[serde(default)]
    pub search_domains: Vec<String>,
    #[serde(default)]
    pub time_servers: Vec<String>,
    /// Link name used when a node names neither its own interface nor a MAC.
    #[serde(default)]
    pub interface: Option<String>,
    #[serde(default)]
    pub mtu: Option<u32>,
}

/// Machine-config patch files (relative to the inventory), applied in the
/// order all → role → node.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Patches {
    #[serde(default)]
    pub all: Vec<PathBuf>,
    #[serde(default)]
    pub control_plane: Vec<PathBuf>,
    #[serde(default)]
    pub worker: Vec<PathBuf>,
}

/// What a node does in the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Controlplane,
    Worker,
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Controlplane => "controlplane",
            Role::Worker => "worker",
        })
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NodeSpec {
    pub name: String,
    pub role: Role,
    /// Static address; with `dhcp: true`, the current lease used to reach it.
    #[serde(default)]
    pub address: Option<IpAddr>,
    #[serde(default)]
    pub dhcp: bool,
    /// Pins the node's NIC by hardware address: `deviceSelector` in the
    /// machine config, and (static nodes, Talos ≥ 1.9) the `enx…` altname in
    /// key 10.
    #[serde(default)]
    pub mac: Option<MacAddr>,
    /// The NIC's kernel name (`ens18`): the only name Talos' DHCP operator
    /// in key 10 finds.
    #[serde(default)]
    pub interface: Option<String>,
    #[serde(default = "default_install_disk")]
    pub install_disk: String,
    #[serde(default)]
    pub extensions: Vec<String>,
    #[serde(default)]
    pub kernel_args: Vec<String>,
    /// Where to reach the node's Talos API when not `address:50000`
    /// (e.g. `127.0.0.1:50001` through a port forward).
    #[serde(default)]
    pub talos_endpoint: Option<String>,
    /// Machine-config patches for this node alone, applied last.
    #[serde(default)]
    pub patches: Vec<PathBuf>,
    /// The Proxmox VM ID (default: `publish.proxmox.vm.firstId` + position).
    #[serde(default)]
    pub vmid: Option<u32>,
    /// Overrides `image.secureBoot` for this node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secure_boot: Option<bool>,
    /// This node's Proxmox VM where it differs from `publish.proxmox.vm`
    /// (cores, memory, disk, bridge, VLAN) and `publish.proxmox.node` (the
    /// host it runs on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cores: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_size: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_disks: Option<Vec<u32>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bridge: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vlan: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxmox_node: Option<String>,
    /// Overrides `image.arch` for this node (a mixed arm64/amd64 cluster).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arch: Option<Arch>,
    /// Hetzner: this node's server type (default `publish.hcloud.servers.type`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_type: Option<String>,
    /// Hetzner: where this node's server runs (default `publish.hcloud.location`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub location: Option<String>,
}

fn default_install_disk() -> String {
    "/dev/sda".into()
}

impl NodeSpec {
    /// The node's own Proxmox VM settings (each unset one is the cluster's).
    pub fn machine(&self) -> NodeMachine<'_> {
        NodeMachine {
            cores: self.cores,
            memory: self.memory,
            disk_size: self.disk_size,
            data_disks: self.data_disks.as_deref(),
            bridge: self.bridge.as_deref(),
            vlan: self.vlan,
            host: self.proxmox_node.as_deref(),
        }
    }

    /// Its Hetzner server type: its own, else `servers.type` (None without
    /// a servers section).
    pub fn hcloud_server_type<'a>(&'a self, hc: &'a HcloudSettings) -> Option<&'a str> {
        let shape = hc.servers.as_ref()?;
        Some(self.server_type.as_deref().unwrap_or(&shape.server_type))
    }

    /// Where its Hetzner server runs: its own location, else the cluster's.
    pub fn hcloud_location<'a>(&'a self, hc: &'a HcloudSettings) -> &'a str {
        self.location.as_deref().unwrap_or(&hc.location)
    }

    /// The link name a static address, its route and its `links[]` entry in
    /// key 10 use: Talos resolves altnames there, so a MAC's `enx…` works.
    pub fn link_name(&self, network: &NetworkSettings) -> Option<String> {
        if let Some(iface) = &self.interface {
            return Some(iface.clone());
        }
        if let Some(mac) = &self.mac {
            return Some(mac.altname());
        }
        network.interface.clone()
    }

    /// The NIC's kernel name when the inventory gives one (a MAC pins some
    /// other NIC than `network.interface`): key 10's DHCP operator looks
    /// links up by kernel name only and silently skips an altname.
    pub fn kernel_link(&self, network: &NetworkSettings) -> Option<String> {
        match (&self.interface, &self.mac) {
            (Some(iface), _) => Some(iface.clone()),
            (None, Some(_)) => None,
            (None, None) => network.interface.clone(),
        }
    }
}

/// Why an inventory could not be used.
#[derive(Debug, thiserror::Error)]
pub enum InventoryError {
    #[error("cannot read {}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {message}", path.display())]
    Parse { path: PathBuf, message: String },
    #[error("{}: {} problem(s):\n{}", path.display(), problems.len(), list(problems))]
    Invalid {
        path: PathBuf,
        problems: Vec<Problem>,
    },
}

/// Whether `url` is an http(s) URL with a host: what an Image Factory
/// address must be, in the inventory or given by `--factory`.
pub fn is_http_url(url: &str) -> bool {
    (url.starts_with("https://") || url.starts_with("http://"))
        && url.split("://").nth(1).is_some_and(|rest| !rest.is_empty())
}

/// Whether Talos `version` (`v1.6.3`, `v1.10.0-alpha.1`) is at least `min`.
/// A version that does not parse counts as the latest, as the factory's
/// `pkg/quirks` assumes; a pre-release counts as its release.
pub fn talos_at_least(version: &str, min: (u32, u32, u32)) -> bool {
    parse_version(version, false).is_none_or(|v| v >= min)
}

fn list(problems: &[Problem]) -> String {
    problems
        .iter()
        .map(|p| format!("  {p}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// One validation finding, tied to a line and a field path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Problem {
    pub line: Option<usize>,
    pub field: String,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "line {line}: {}: {}", self.field, self.message),
            None => write!(f, "{}: {}", self.field, self.message),
        }
    }
}

impl Inventory {
    /// Reads and validates `path`.
    pub fn load(path: &Path) -> Result<Inventory, InventoryError> {
        let text =
            crate::input::read_text(path, crate::input::MAX_TEXT_FILE).map_err(|source| {
                InventoryError::Read {
                    path: path.to_owned(),
                    source,
                }
            })?;
        Self::parse(&text, path)
    }

    /// Validates `text`, naming `path` in every error.
    pub fn parse(text: &str, path: &Path) -> Result<Inventory, InventoryError> {
        let text = crate::input::yaml(text).map_err(|e| InventoryError::Parse {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
        let mut inv: Inventory =
            serde_yaml_ng::from_str(text).map_err(|e| InventoryError::Parse {
                path: path.to_owned(),
                message: describe_parse_error(&e),
            })?;
        let index = LineIndex::new(text);
        let mut v = Validator {
            index: &index,
            problems: Vec::new(),
        };
        inv.base_dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .to_owned();
        inv.warnings = v.check(&inv);
        if v.problems.is_empty() {
            Ok(inv)
        } else {
            Err(InventoryError::Invalid {
                path: path.to_owned(),
                problems: v.problems,
            })
        }
    }

    /// The node called `name`, or an error listing the names there are.
    pub fn node(&self, name: &str) -> Result<&NodeSpec, UnknownNode> {
        self.nodes
            .iter()
            .find(|n| n.name == name)
            .ok_or_else(|| UnknownNode {
                name: name.to_owned(),
                known: self.nodes.iter().map(|n| n.name.clone()).collect(),
            })
    }

    /// The nodes a command names, in the order given; every node when it
    /// names none (how `build`, `node` and `pxe` read their arguments).
    pub fn select(&self, names: &[String]) -> Result<Vec<&NodeSpec>, UnknownNode> {
        if names.is_empty() {
            return Ok(self.nodes.iter().collect());
        }
        names.iter().map(|n| self.node(n)).collect()
    }

    /// The vmid of the node at `index`: its own `vmid`, else `firstId + index`.
    pub fn vmid(&self, index: usize) -> Option<u32> {
        self.publish.vmid(self.nodes.get(index)?.vmid, index)
    }

    /// The Proxmox VM of the node at `index`: its own settings over the
    /// cluster's (`publish.proxmox.vm`, `publish.proxmox.node`).
    pub fn machine(&self, index: usize) -> Option<Machine> {
        let px = self.publish.proxmox()?;
        px.machine(&self.nodes.get(index)?.machine())
    }

    /// `validate`'s advice on vmids: nodes that take theirs from
    /// `firstId` + position, which shifts when a node is inserted or removed
    /// before them (existing VMs are found by name, new ones take the
    /// shifted ID). Not a load warning: every command would repeat it.
    pub fn vmid_advice(&self) -> Option<String> {
        self.publish.proxmox()?.vm.as_ref()?.first_id?;
        let unpinned: Vec<String> = self
            .nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.vmid.is_none())
            .filter_map(|(i, n)| Some(format!("{} ({})", n.name, self.vmid(i)?)))
            .collect();
        (!unpinned.is_empty()).then(|| {
            format!(
                "vmids from publish.proxmox.vm.firstId + position shift when a node is inserted or removed before them; pin `vmid:` on {}",
                unpinned.join(", ")
            )
        })
    }

    /// Whether `node` boots Secure Boot images: its own `secureBoot`, else
    /// the image's.
    pub fn secure_boot(&self, node: &NodeSpec) -> bool {
        node.secure_boot.unwrap_or(self.image.secure_boot)
    }

    /// The architecture of `node`'s image: its own, else `image.arch`.
    pub fn arch(&self, node: &NodeSpec) -> Arch {
        node.arch.unwrap_or(self.image.arch)
    }

    /// Control planes in inventory order; the first one is bootstrapped.
    pub fn control_planes(&self) -> impl Iterator<Item = &NodeSpec> {
        self.nodes.iter().filter(|n| n.role == Role::Controlplane)
    }
}

/// A node name that is not in the inventory.
#[derive(Debug, thiserror::Error)]
#[error("no node named {name:?} in the inventory (nodes: {})", known.join(", "))]
pub struct UnknownNode {
    pub name: String,
    pub known: Vec<String>,
}

fn describe_parse_error(e: &serde_yaml_ng::Error) -> String {
    let msg = e.to_string();
    match e.location() {
        Some(loc) if !msg.contains("line ") => format!("line {}: {msg}", loc.line()),
        _ => msg,
    }
}

struct Validator<'a> {
    index: &'a LineIndex,
    problems: Vec<Problem>,
}

impl Validator<'_> {
    fn problem(&mut self, field: impl Into<String>, message: impl Into<String>) {
        let field = field.into();
        self.problems.push(Problem {
            line: self.index.line(&field),
            field,
            message: message.into(),
        });
    }

    /// Records every problem; returns the warnings.
    fn check(&mut self, inv: &Inventory) -> Vec<String> {
        let mut warnings = Vec::new();
        self.check_cluster(&inv.cluster);
        if let Some(file) = &inv.cluster.secrets_file
            && let Err(why) = secrets_file_path(&inv.base_dir, file)
        {
            self.problem("cluster.secretsFile", why);
        }
        self.check_image(&inv.image);
        self.check_network(&inv.network);
        self.check_nodes(inv);
        self.check_vip(inv, &mut warnings);
        self.check_patches(inv);
        self.check_secure_boot(inv);
        let cx = publish::Context {
            platform: &inv.image.platform,
            raw: inv.image.format == ImageFormat::Raw,
            iso: inv.image.format == ImageFormat::Iso,
            nodes: inv
                .nodes
                .iter()
                .map(|n| (n.name.as_str(), n.vmid, n.machine()))
                .collect(),
        };
        for (field, message) in publish::problems(&inv.publish, &cx) {
            self.problem(field, message);
        }
        let own: Vec<_> = (inv.nodes.iter())
            .map(|n| {
                (
                    n.name.as_str(),
                    n.server_type.as_deref(),
                    n.location.as_deref(),
                )
            })
            .collect();
        for (field, message) in publish::hcloud_node_problems(&inv.publish, &own) {
            self.problem(field, message);
        }
        let cps = inv.control_planes().count();
        if cps == 0 && !inv.nodes.is_empty() {
            self.problem(
                "nodes",
                "no node has role controlplane; a cluster needs at least one",
            );
        } else if cps > 0 && cps.is_multiple_of(2) {
            warnings.push(format!(
                "{cps} control planes: an even count tolerates no more failures than {} would",
                cps - 1
            ));
        }
        if inv.nodes.is_empty() {
            self.problem("nodes", "the inventory lists no nodes");
        }
        warnings
    }

    /// Patch files must exist (relative to the inventory's folder), so a
    /// typo is found here rather than when a node's config is rendered.
    fn check_patches(&mut self, inv: &Inventory) {
        let lists = [
            ("patches.all".to_owned(), &inv.patches.all),
            (
                "patches.controlPlane".to_owned(),
                &inv.patches.control_plane,
            ),
            ("patches.worker".to_owned(), &inv.patches.worker),
        ];
        let node_lists = inv
            .nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (format!("nodes[{i}].patches"), &n.patches));
        for (field, files) in lists.into_iter().chain(node_lists) {
            for (j, file) in files.iter().enumerate() {
                if let Err(why) = patch_path(&inv.base_dir, file) {
                    self.problem(format!("{field}[{j}]"), why);
                }
            }
        }
    }

    fn check_cluster(&mut self, c: &ClusterSettings) {
        if !is_dns_label(&c.name) {
            self.problem(
                "cluster.name",
                format!("{:?} must be a lowercase DNS label (a-z, 0-9, '-')", c.name),
            );
        }
        match parse_version(&c.talos_version, true) {
            None => self.problem(
                "cluster.talosVersion",
                format!(
                    "{} is not a Talos version like v1.11.2",
                    crate::input::quote(&c.talos_version)
                ),
            ),
            Some(_) if has_leading_zero(&c.talos_version) => self.problem(
                "cluster.talosVersion",
                format!(
                    "{} has a leading zero: Talos tags have none (v1.11.2, not v1.11.02)",
                    crate::input::quote(&c.talos_version)
                ),
            ),
            Some((major, minor, _)) if (major, minor) < (1, 4) => self.problem(
                "cluster.talosVersion",
                format!(
                    "{} predates META network configuration (Talos v1.4.0); imgbuild needs v1.4.0 or later",
                    c.talos_version
                ),
            ),
            Some(_) => {}
        }
        if let Some(why) = kubernetes_version_rule(&c.kubernetes_version) {
            self.problem(
                "cluster.kubernetesVersion",
                format!("{} {why}", crate::input::quote(&c.kubernetes_version)),
            );
        }
        if let Some(why) = url_rule(&c.endpoint) {
            self.problem(
                "cluster.endpoint",
                format!(
                    "{} {why}",
                    crate::input::quote(&without_userinfo(&c.endpoint))
                ),
            );
        } else if endpoint_host(&c.endpoint).is_none() {
            self.problem(
                "cluster.endpoint",
                format!(
                    "{:?} is not an https://host:port URL (e.g. https://10.0.0.20:6443)",
                    c.endpoint
                ),
            );
        }
        if let Some(ep) = &c.kubernetes_endpoint {
            if let Some(why) = url_rule(ep) {
                self.problem(
                    "cluster.kubernetesEndpoint",
                    format!("{} {why}", crate::input::quote(&without_userinfo(ep))),
                );
            } else if endpoint_host(ep).is_none() {
                self.problem(
                    "cluster.kubernetesEndpoint",
                    format!(
                        "{} is not an https://host:port URL (the host-side address of the Kubernetes API, e.g. https://127.0.0.1:6443)",
                        crate::input::quote(ep)
                    ),
                );
            }
        }
    }

    fn check_image(&mut self, img: &ImageSettings) {
        const PLATFORMS: &[&str] = &[
            "metal",
            "nocloud",
            "hcloud",
            "aws",
            "azure",
            "gcp",
            "digital-ocean",
            "openstack",
            "vmware",
            "exoscale",
            "scaleway",
            "upcloud",
            "vultr",
            "oracle",
            "akamai",
            "cloudstack",
            "opennebula",
        ];
        if !PLATFORMS.contains(&img.platform.as_str()) {
            self.problem(
                "image.platform",
                format!(
                    "{:?} is not a Talos platform (one of {})",
                    img.platform,
                    PLATFORMS.join(", ")
                ),
            );
        }
        if let Err(e) = crate::net::base_url(&img.factory) {
            self.problem("image.factory", e.to_string());
        }
        self.check_extensions("image.extensions", &img.extensions);
        self.check_kernel_args("image.kernelArgs", &img.kernel_args);
    }

    /// Secure Boot settings: known values, a Talos that boots UKIs, a target
    /// that can boot them, and TPM encryption only where Secure Boot is on.
    fn check_secure_boot(&mut self, inv: &Inventory) {
        let img = &inv.image;
        let sb_nodes: Vec<&NodeSpec> = inv.nodes.iter().filter(|n| inv.secure_boot(n)).collect();
        if let Some(v) = &img.enroll_keys
            && !ENROLL_KEYS.contains(&v.as_str())
        {
            self.problem(
                "image.enrollKeys",
                format!(
                    "{} is not one of {} (systemd-boot's secure-boot-enroll)",
                    crate::input::quote(v),
                    ENROLL_KEYS.join(", ")
                ),
            );
        }
        if sb_nodes.is_empty() {
            for (set, field) in [
                (img.enroll_keys.is_some(), "image.enrollKeys"),
                (
                    img.include_well_known_certificates,
                    "image.includeWellKnownCertificates",
                ),
            ] {
                if set {
                    self.problem(
                        field,
                        "is a Secure Boot setting, but no node has secureBoot: true",
                    );
                }
            }
            if img.encryption == Some(Encryption::Tpm) {
                self.problem(
                    "image.encryption",
                    "tpm encryption is enrolled only while Secure Boot is on \
                     (checkSecurebootStatusOnEnroll); set image.secureBoot: true",
                );
            }
            return;
        }
        if img.encryption == Some(Encryption::Tpm)
            && !talos_at_least(&inv.cluster.talos_version, (1, 11, 0))
        {
            self.problem(
                "image.encryption",
                format!(
                    "tpm encryption is written as VolumeConfig documents, which Talos reads from v1.11.0 (talosVersion is {}); imgbuild writes it for v1.11.0 and later",
                    inv.cluster.talos_version
                ),
            );
        }
        if img.encryption == Some(Encryption::Tpm) {
            for (i, n) in inv.nodes.iter().enumerate() {
                if !inv.secure_boot(n) {
                    self.problem(
                        format!("nodes[{i}].secureBoot"),
                        format!(
                            "node {}: image.encryption: tpm seals keys only under Secure Boot \
                             (checkSecurebootStatusOnEnroll); this node turns Secure Boot off",
                            n.name
                        ),
                    );
                }
            }
        }
        let field = if img.secure_boot {
            "image.secureBoot".to_owned()
        } else {
            let i = inv
                .nodes
                .iter()
                .position(|n| inv.secure_boot(n))
                .unwrap_or(0);
            format!("nodes[{i}].secureBoot")
        };
        if !talos_at_least(&inv.cluster.talos_version, (1, 5, 0)) {
            self.problem(
                field.clone(),
                format!(
                    "Secure Boot images are UKIs, which Talos boots from v1.5.0 (talosVersion is {})",
                    inv.cluster.talos_version
                ),
            );
        }
        if inv.publish.hcloud().is_some() {
            self.problem(
                field,
                format!(
                    "Hetzner Cloud offers no Secure Boot for user images (snapshots boot \
                     without it); nodes {} cannot be published there with secureBoot: true",
                    sb_nodes
                        .iter()
                        .map(|n| n.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            );
        }
    }

    fn check_extensions(&mut self, field: &str, exts: &[String]) {
        for (i, ext) in exts.iter().enumerate() {
            if !is_extension_name(ext) {
                self.problem(
                    format!("{field}[{i}]"),
                    format!(
                        "{ext:?} is not an official extension name like siderolabs/qemu-guest-agent"
                    ),
                );
            }
        }
    }

    fn check_kernel_args(&mut self, field: &str, args: &[String]) {
        // Each argument reaches the kernel through iPXE scripts and GRUB
        // menus as well as the factory: one that either language would
        // split, expand, comment out or end a command at is refused here.
        for (i, arg) in args.iter().enumerate() {
            if let Err(refused) = crate::bootscript::check_kernel_arg(arg) {
                self.problem(
                    format!("{field}[{i}]"),
                    format!(
                        "{}: a kernel argument must be one word every boot medium carries as itself; it {}",
                        crate::input::quote(arg),
                        refused.why
                    ),
                );
            }
        }
        let total: usize = args.iter().map(|a| a.len() + 1).sum();
        if total > KERNEL_CMDLINE_MAX {
            self.problem(
                field,
                format!(
                    "{total} bytes of kernel arguments; the kernel command line holds \
                     {KERNEL_CMDLINE_MAX} (COMMAND_LINE_SIZE on amd64 and arm64)"
                ),
            );
        }
    }

    fn check_network(&mut self, net: &NetworkSettings) {
        if let (Some(cidr), Some(gw)) = (&net.cidr, net.gateway)
            && !cidr.contains(gw)
        {
            self.problem(
                "network.gateway",
                format!("{gw} is outside network.cidr {cidr}"),
            );
        }
        if let Some(iface) = &net.interface {
            self.check_interface("network.interface", iface);
        }
        if let Some(mtu) = net.mtu
            && !(576..=9216).contains(&mtu)
        {
            self.problem("network.mtu", format!("{mtu} is outside 576..9216"));
        }
        for (i, ts) in net.time_servers.iter().enumerate() {
            if ts.is_empty() || ts.chars().any(char::is_whitespace) {
                self.problem(
                    format!("network.timeServers[{i}]"),
                    format!("{ts:?} is not a host name or address"),
                );
            }
        }
    }

    fn check_interface(&mut self, field: &str, iface: &str) {
        if iface.is_empty()
            || iface.len() > 15
            || iface
                .chars()
                .any(|c| c.is_whitespace() || c == '/' || c == ':')
        {
            self.problem(
                field,
                format!("{iface:?} is not a Linux interface name (1-15 characters, no '/', ':' or spaces)"),
            );
        }
    }

    fn check_nodes(&mut self, inv: &Inventory) {
        let mut names: HashMap<&str, usize> = HashMap::new();
        let mut addrs: HashMap<IpAddr, usize> = HashMap::new();
        let mut macs: HashMap<String, usize> = HashMap::new();
        for (i, node) in inv.nodes.iter().enumerate() {
            let at = format!("nodes[{i}]");
            let who = &node.name;
            if !is_dns_label(who) {
                self.problem(
                    format!("{at}.name"),
                    format!("{who:?} must be a lowercase DNS label (it becomes the hostname)"),
                );
            }
            if let Some(&first) = names.get(who.as_str()) {
                self.problem(
                    format!("{at}.name"),
                    format!("node name {who:?} is used twice (also nodes[{first}])"),
                );
            } else {
                names.insert(who, i);
            }
            if let Some(addr) = node.address {
                if let Some(&first) = addrs.get(&addr) {
                    self.problem(
                        format!("{at}.address"),
                        format!(
                            "node {who}: address {addr} is already used by node {}",
                            inv.nodes[first].name
                        ),
                    );
                } else {
                    addrs.insert(addr, i);
                }
                if Some(addr) == inv.network.gateway {
                    self.problem(
                        format!("{at}.address"),
                        format!("node {who}: address {addr} is the gateway"),
                    );
                }
            }
            // One MAC is one NIC: two nodes with it would take each other's
            // DHCP lease, VM network card and PXE script.
            if let Some(mac) = &node.mac {
                let mac = mac.to_string();
                if let Some(&first) = macs.get(&mac) {
                    self.problem(
                        format!("{at}.mac"),
                        format!(
                            "node {who}: mac {mac} is already used by node {}",
                            inv.nodes[first].name
                        ),
                    );
                } else {
                    macs.insert(mac, i);
                }
            }
            self.check_node_addressing(inv, node, &at);
            if let Some(iface) = &node.interface {
                self.check_interface(&format!("{at}.interface"), iface);
            }
            if !node.install_disk.starts_with("/dev/") {
                self.problem(
                    format!("{at}.installDisk"),
                    format!(
                        "node {who}: {:?} is not a device path like /dev/sda",
                        node.install_disk
                    ),
                );
            }
            self.check_extensions(&format!("{at}.extensions"), &node.extensions);
            for (j, ext) in node.extensions.iter().enumerate() {
                if inv.image.extensions.contains(ext) || node.extensions[..j].contains(ext) {
                    self.problem(
                        format!("{at}.extensions[{j}]"),
                        format!("node {who}: extension {ext} is listed twice"),
                    );
                }
            }
            self.check_kernel_args(&format!("{at}.kernelArgs"), &node.kernel_args);
            if let Some(ep) = &node.talos_endpoint
                && talos_endpoint(ep).is_none()
            {
                self.problem(
                    format!("{at}.talosEndpoint"),
                    format!(
                        "node {who}: {ep:?} is not an IP address or IP:port (e.g. 127.0.0.1:50001); host names are not resolved"
                    ),
                );
            }
        }
    }

    fn check_node_addressing(&mut self, inv: &Inventory, node: &NodeSpec, at: &str) {
        let who = &node.name;
        if node.dhcp {
            return; // an address, if given, is only the lease used to reach it
        }
        if inv.publish.hcloud().is_some_and(|h| h.servers.is_some()) {
            // Hetzner servers are reached at the public IP the API reports;
            // an address, if given, is the node's place in servers.network.
            return;
        }
        let Some(addr) = node.address else {
            self.problem(
                format!("{at}.address"),
                format!("node {who}: needs an address, or dhcp: true"),
            );
            return;
        };
        match &inv.network.cidr {
            None => self.problem(
                "network.cidr",
                format!("node {who}: static address {addr} needs network.cidr for its prefix"),
            ),
            Some(cidr) if !cidr.contains(addr) => self.problem(
                format!("{at}.address"),
                format!("node {who}: address {addr} is outside network.cidr {cidr}"),
            ),
            Some(cidr) if cidr.is_network_or_broadcast(addr) => self.problem(
                format!("{at}.address"),
                format!("node {who}: address {addr} is the network or broadcast address of {cidr}"),
            ),
            Some(_) => {}
        }
        if node.link_name(&inv.network).is_none() {
            self.problem(
                format!("{at}.interface"),
                format!(
                    "node {who}: static addressing needs a link: set interface or mac on the node, or network.interface"
                ),
            );
        }
        let before_altnames = parse_version(&inv.cluster.talos_version, true)
            .is_some_and(|(major, minor, _)| (major, minor) < (1, 9));
        if let (None, Some(mac), true) = (&node.interface, &node.mac, before_altnames) {
            self.problem(
                format!("{at}.mac"),
                format!(
                    "node {who}: mac {mac} names the static link {}, an altname Talos gives NICs only since v1.9 (talosVersion is {}); set interface: to its kernel name (e.g. ens18)",
                    mac.altname(),
                    inv.cluster.talos_version
                ),
            );
        }
    }

    fn check_vip(&mut self, inv: &Inventory, warnings: &mut Vec<String>) {
        let Some(vip) = inv.cluster.vip else {
            return;
        };
        if let Some(node) = inv.nodes.iter().find(|n| n.address == Some(vip)) {
            self.problem(
                "cluster.vip",
                format!(
                    "VIP {vip} equals node {}'s address; the VIP must be a free address",
                    node.name
                ),
            );
        }
        if Some(vip) == inv.network.gateway {
            self.problem("cluster.vip", format!("VIP {vip} is the gateway"));
        }
        if let Some(cidr) = &inv.network.cidr
            && !cidr.contains(vip)
        {
            self.problem(
                "cluster.vip",
                format!("VIP {vip} is outside network.cidr {cidr}"),
            );
        }
        let endpoint_is_vip = endpoint_host(&inv.cluster.endpoint)
            .and_then(|h| h.parse::<IpAddr>().ok())
            == Some(vip);
        if let Some(first) = inv.control_planes().next()
            && endpoint_is_vip
            && first.address.is_none()
            && first.talos_endpoint.is_none()
        {
            warnings.push(format!(
                "cluster.endpoint is the VIP {vip}, which appears only after bootstrap, \
                 and control plane {} has no address or talosEndpoint to bootstrap through",
                first.name
            ));
        }
    }
}

/// `vX.Y.Z` with an optional pre-release suffix; the `v` is optional for Kubernetes.
pub(crate) fn parse_version(v: &str, need_v: bool) -> Option<(u32, u32, u32)> {
    let rest = match v.strip_prefix('v') {
        Some(r) => r,
        None if need_v => return None,
        None => v,
    };
    let (core, pre) = match rest.split_once('-') {
        Some((c, p)) => (c, Some(p)),
        None => (rest, None),
    };
    if pre.is_some_and(|p| {
        p.is_empty()
            || !p
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-')
    }) {
        return None;
    }
    let mut parts = core.split('.').map(|p| {
        (!p.is_empty() && p.chars().all(|c| c.is_ascii_digit()))
            .then(|| p.parse::<u32>().ok())
            .flatten()
    });
    let v = (parts.next()??, parts.next()??, parts.next()??);
    parts.next().is_none().then_some(v)
}

/// Whether a number of `v`'s `MAJOR.MINOR.PATCH` has a leading zero, which
/// no release tag has (semver 2.0.0 §2): `v1.13.05` names no release.
fn has_leading_zero(v: &str) -> bool {
    let core = v.strip_prefix('v').unwrap_or(v);
    let core = core.split_once('-').map_or(core, |(c, _)| c);
    core.split('.').any(|p| p.len() > 1 && p.starts_with('0'))
}

/// Why `v` is not a Kubernetes release tag (`v1.32.1`, `1.32.1`,
/// `v1.33.0-rc.1`): Kubernetes has only major 1, and its tags carry no
/// leading zeros (semver 2.0.0 §2), so `v1.32.01` names no release.
fn kubernetes_version_rule(v: &str) -> Option<&'static str> {
    let Some((major, minor, _)) = parse_version(v, false) else {
        return Some("is not a Kubernetes version like v1.32.1");
    };
    if has_leading_zero(v) {
        return Some("has a leading zero: Kubernetes tags have none (v1.32.1, not v1.32.01)");
    }
    if major != 1 || minor == 0 {
        return Some("is not a Kubernetes release: Kubernetes versions are v1.N.P");
    }
    None
}

/// What makes `url` more than an `https://host:port` endpoint: user info
/// (a credential that would be sent, and logged, with every request), a
/// path's query or fragment, or a space or control character (which a
/// kubeconfig or talosconfig would carry, and a terminal would act on).
fn url_rule(url: &str) -> Option<&'static str> {
    if url
        .chars()
        .any(|c| c.is_whitespace() || c.is_control() || crate::input::hides_text(c))
    {
        return Some("holds a space or a control character: an endpoint is https://host:port");
    }
    let authority = url
        .strip_prefix("https://")
        .unwrap_or(url)
        .split('/')
        .next()
        .unwrap_or("");
    if authority.contains('@') {
        return Some(
            "carries user info (user@): an endpoint is https://host:port, credentials come from the secrets",
        );
    }
    if url.contains('?') {
        return Some("has a query (?…): an endpoint is https://host:port");
    }
    if url.contains('#') {
        return Some("has a fragment (#…): an endpoint is https://host:port");
    }
    None
}

/// `url` with its user info (a password, maybe) shown as `…@`.
fn without_userinfo(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    match rest[..end].rfind('@') {
        Some(at) if scheme.is_empty() => format!("…@{}", &rest[at + 1..]),
        Some(at) => format!("{scheme}://…@{}", &rest[at + 1..]),
        None => url.to_owned(),
    }
}

/// The host of an `https://host[:port][/]` URL.
pub fn endpoint_host(endpoint: &str) -> Option<&str> {
    let rest = endpoint.strip_prefix("https://")?;
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.contains('/') {
        return None;
    }
    let host = if let Some(v6) = authority.strip_prefix('[') {
        let (h, tail) = v6.split_once(']')?;
        if !(tail.is_empty() || tail.strip_prefix(':')?.parse::<u16>().is_ok()) {
            return None;
        }
        h
    } else {
        match authority.split_once(':') {
            Some((h, port)) => {
                port.parse::<u16>().ok()?;
                h
            }
            None => authority,
        }
    };
    // A host name or an address, nothing a URL parser would read as more.
    let v6 = authority.starts_with('[');
    let host_byte =
        |b: u8| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || (v6 && b == b':');
    (!host.is_empty() && host.bytes().all(host_byte)).then_some(host)
}

/// The port of the Talos API (apid, and machined in maintenance mode).
pub const TALOS_API_PORT: u16 = 50000;

/// A node's `talosEndpoint`: an IP address (port 50000) or `IP:port`
/// (`[v6]:port`). Host names are refused, not resolved: the node's
/// certificate names addresses. `validate` and `bootstrap` both ask this.
pub fn talos_endpoint(ep: &str) -> Option<SocketAddr> {
    ep.parse::<SocketAddr>()
        .ok()
        .or_else(|| Some(SocketAddr::new(ep.parse().ok()?, TALOS_API_PORT)))
}

/// The kernel's command-line buffer (`COMMAND_LINE_SIZE`, 2048 on x86 and
/// arm64, linux arch/*/include/uapi/asm/setup.h).
const KERNEL_CMDLINE_MAX: usize = 2048;

/// Where `cluster.secretsFile` is: a path inside the inventory's folder
/// (it is kept in Git beside it). It need not exist yet (`secrets encrypt`
/// writes it); when it does, it is a regular file that stays inside.
pub fn secrets_file_path(base: &Path, file: &Path) -> Result<PathBuf, String> {
    let path = base.join(file);
    let shown = path.display();
    if file.as_os_str().is_empty()
        || file.is_absolute()
        || file
            .components()
            .any(|c| matches!(c, std::path::Component::ParentDir))
    {
        return Err(format!(
            "secrets file {shown}: give a path inside the inventory's folder (no leading / or ..)"
        ));
    }
    match std::fs::metadata(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(path),
        Err(e) => Err(format!("secrets file {shown}: {e}")),
        Ok(m) if !m.is_file() => Err(format!("secrets file {shown} is not a regular file")),
        Ok(_) => {
            let inside = match (std::fs::canonicalize(base), std::fs::canonicalize(&path)) {
                (Ok(b), Ok(p)) => p.starts_with(b),
                _ => false,
            };
            if inside {
                Ok(path)
            } else {
                Err(format!(
                    "secrets file {shown} leads outside the inventory's folder (a symbolic link?)"
                ))
            }
        }
    }
}

/// Where patch `file` of an inventory in `base` is, if it may be used: a
/// regular file inside the inventory's folder (after symlinks), so a
/// repository's inventory cannot make imgbuild read, and quote, files
/// elsewhere on the machine.
pub fn patch_path(base: &Path, file: &Path) -> Result<PathBuf, String> {
    let path = base.join(file);
    let shown = path.display();
    let rel = file;
    if rel.is_absolute()
        || rel
            .components()
            .any(|c| matches!(c, std::path::Component::ParentDir))
    {
        return Err(format!(
            "patch file {shown}: give a path inside the inventory's folder (no leading / or ..)"
        ));
    }
    let meta = match std::fs::metadata(&path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(format!("patch file {shown} does not exist"));
        }
        Err(e) => return Err(format!("patch file {shown}: {e}")),
    };
    if meta.is_dir() {
        return Err(format!("patch file {shown} is a directory, not a file"));
    }
    if !meta.is_file() {
        return Err(format!(
            "patch file {shown} is not a regular file (a FIFO, socket or device)"
        ));
    }
    let inside = match (std::fs::canonicalize(base), std::fs::canonicalize(&path)) {
        (Ok(b), Ok(p)) => p.starts_with(b),
        _ => false,
    };
    if !inside {
        return Err(format!(
            "patch file {shown} leads outside the inventory's folder (a symbolic link?)"
        ));
    }
    Ok(path)
}

/// A node name as the inventory takes it (a DNS label: it becomes the
/// hostname and file names).
pub fn is_node_name(s: &str) -> bool {
    is_dns_label(s)
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

fn is_extension_name(s: &str) -> bool {
    let part = |p: &str| {
        !p.is_empty()
            && p.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
            && p.bytes().all(|b| {
                b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'_' | b'.')
            })
    };
    matches!(s.split_once('/'), Some((owner, name)) if part(owner) && part(name))
}

#[cfg(test)]
mod tests;
