//! Other tools' cluster definitions as an imgbuild inventory. Today:
//! talhelper's `talconfig.yaml` (field names from talhelper's config
//! structs, <https://budimanjojo.github.io/talhelper/>).
//!
//! What carries over: clusterName, talosVersion, kubernetesVersion,
//! endpoint, nodes (hostname, ipAddress, controlPlane, installDisk, one
//! network interface with its addresses, default route, VIP, DHCP and
//! `deviceSelector.hardwareAddr`, nameservers, `schematic.customization`
//! extensions and kernel args), strategic-merge and JSON6902 patches
//! (cluster, control plane, worker, node; SOPS-encrypted patch files kept
//! encrypted) and
//! `${VAR}` substitution from `talenv.yaml` or the environment (a
//! `talenv.sops.yaml` opened with the environment's age keys). Settings
//! cluster.yaml has no field for but a machine config has become patch files
//! beside it: `cniConfig` (Talos' `cluster.network.cni`), `extensionServices`
//! (`ExtensionServiceConfig` documents) and nameservers that differ by role
//! or node. Everything else is listed, with its line, as not carried over:
//! SOPS files no key opens, inline SOPS patches, unset variables, and every
//! other field.

use crate::inventory::{Cidr, Inventory, InventoryError, LineIndex};
use crate::schematic::{Customization, Schematic, SystemExtensions};
use serde::Serialize;
use serde_yaml_ng::{Mapping, Value};
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

/// What the conversion reads besides the file itself.
pub struct ImportOptions<'a> {
    /// Where the inventory will be written; inline patches go to
    /// `patches/` beside it. None (printing): inline patches cannot be kept.
    pub out_dir: Option<&'a Path>,
    /// Environment lookup for `${VAR}` (after talenv.yaml). The CLI answers
    /// only for names the user listed: a repository's talconfig must not
    /// copy `PROXMOX_VE_API_TOKEN` or the like into the inventory.
    pub env: &'a dyn Fn(&str) -> Option<String>,
}

/// A converted cluster definition.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Imported {
    /// The cluster.yaml text.
    pub inventory: String,
    /// Patch files to write, relative to the inventory's folder.
    pub patch_files: Vec<PatchFile>,
    /// What could not be carried over, in the order of the source.
    pub skipped: Vec<Skipped>,
}

/// A machine-config patch the inventory refers to, written by the caller.
#[derive(Debug, Clone, Serialize)]
pub struct PatchFile {
    pub path: PathBuf,
    #[serde(skip)]
    pub content: String,
}

/// One thing in the source that the inventory does not carry, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Skipped {
    /// The file it stands in (the talconfig, talenv or a patch file).
    pub file: PathBuf,
    pub line: Option<usize>,
    /// The field path or variable, e.g. `nodes[0].machineFiles`.
    pub field: String,
    pub reason: String,
}

/// Why a talconfig could not be converted at all.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error("cannot read {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: {message}", path.display())]
    Parse { path: PathBuf, message: String },
    #[error(
        "{}: the file is SOPS-encrypted; decrypt it first (sops -d {} > talconfig.plain.yaml)",
        path.display(),
        path.display()
    )]
    Encrypted { path: PathBuf },
    #[error("{}: {field} is required by cluster.yaml: {message}", path.display())]
    Missing {
        path: PathBuf,
        field: String,
        message: String,
    },
    #[error(transparent)]
    Sops(#[from] crate::secrets::sops::SopsError),
    #[error("{} exists: give --force to replace it, or another --out", path.display())]
    Exists { path: PathBuf },
    #[error("creating {}", path.display())]
    CreateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("writing {}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Where [`talhelper_into`] writes the converted inventory.
pub struct Destination<'a> {
    /// The cluster.yaml to write (its inline patches go to `patches/`
    /// beside it); `None` writes nothing and leaves printing to the caller.
    pub out: Option<&'a Path>,
    /// Replace an existing `out`.
    pub force: bool,
}

/// A conversion, written where it was asked to go, and the inventory
/// parser's verdict on it there.
#[derive(Debug)]
pub struct Converted {
    pub imported: Imported,
    /// Why the inventory does not load yet; `None` when it is valid.
    pub problems: Option<InventoryError>,
}

/// talhelper's names for the variables file, plain and SOPS-encrypted.
const TALENV_PLAIN: [&str; 2] = ["talenv.yaml", "talenv.yml"];
const TALENV_SOPS: [&str; 2] = ["talenv.sops.yaml", "talenv.sops.yml"];
/// talhelper's names for the cluster secrets (a `talosctl gen secrets` bundle).
const TALSECRET: [&str; 4] = [
    "talsecret.sops.yaml",
    "talsecret.sops.yml",
    "talsecret.yaml",
    "talsecret.yml",
];

/// Converts the talhelper config at `path`.
pub fn talhelper(path: &Path, opts: &ImportOptions) -> Result<Imported, ImportError> {
    let read = |p: &Path| {
        crate::input::read_text(p, crate::input::MAX_TEXT_FILE).map_err(|source| {
            ImportError::Read {
                path: p.to_owned(),
                source,
            }
        })
    };
    let raw = read(path)?;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut c = Converter {
        path: path.to_owned(),
        dir: dir.to_owned(),
        out_dir: opts.out_dir.map(Path::to_owned),
        vars: BTreeMap::new(),
        env: opts.env,
        skipped: Vec::new(),
        patch_files: Vec::new(),
        index: LineIndex::default(),
    };
    c.load_talenv(&read)?;
    let text = c.substitute(&raw, path)?;
    let text = parse_guard(&text, path)?;
    let doc: Value = serde_yaml_ng::from_str(text).map_err(|e| ImportError::Parse {
        path: path.to_owned(),
        message: e.to_string(),
    })?;
    let Value::Mapping(top) = doc else {
        return Err(ImportError::Parse {
            path: path.to_owned(),
            message: "not a talhelper config: the document is not a mapping".into(),
        });
    };
    if top.contains_key("sops") {
        return Err(ImportError::Encrypted {
            path: path.to_owned(),
        });
    }
    c.index = LineIndex::new(text);
    let inventory = c.convert(&top)?;
    // Source order: the talconfig by line, then the other files.
    c.skipped
        .sort_by_key(|s| (s.file != c.path, s.file.clone(), s.line));
    Ok(Imported {
        inventory,
        patch_files: c.patch_files,
        skipped: c.skipped,
    })
}

/// One node as it will appear in cluster.yaml.
#[derive(Default)]
struct NodeOut {
    name: String,
    controlplane: bool,
    address: Option<IpAddr>,
    dhcp: bool,
    mac: Option<String>,
    interface: Option<String>,
    install_disk: Option<String>,
    extensions: Vec<String>,
    kernel_args: Vec<String>,
    patches: Vec<String>,
    /// Its own `nameservers`, if it lists any.
    nameservers: Option<Vec<String>>,
    /// The file-name stem of its patches, e.g. `node-cp-a`.
    scope: String,
}

/// Values that are one per cluster in cluster.yaml but one per node in
/// talhelper: the first node's wins, a different one is reported.
#[derive(Default)]
struct Shared {
    cidr: Option<String>,
    gateway: Option<String>,
    mtu: Option<u64>,
    vip: Option<String>,
    arch: Option<String>,
    platform: Option<String>,
}

struct Converter<'a> {
    path: PathBuf,
    dir: PathBuf,
    out_dir: Option<PathBuf>,
    vars: BTreeMap<String, String>,
    env: &'a dyn Fn(&str) -> Option<String>,
    skipped: Vec<Skipped>,
    patch_files: Vec<PatchFile>,
    index: LineIndex,
}

impl Converter<'_> {
    fn skip(&mut self, field: impl Into<String>, reason: impl Into<String>) {
        let field = field.into();
        self.skipped.push(Skipped {
            file: self.path.clone(),
            line: self.index.line(&field),
            field,
            reason: reason.into(),
        });
    }

    /// Variables from talenv.yaml beside the config, plain or SOPS-encrypted
    /// (opened with the environment's age keys; reported when none fits),
    /// and a note on talsecret.sops.yaml, whose secrets go to the state dir.
    fn load_talenv(
        &mut self,
        read: &dyn Fn(&Path) -> Result<String, ImportError>,
    ) -> Result<(), ImportError> {
        for name in TALSECRET {
            let p = self.dir.join(name);
            if !p.is_file() {
                continue;
            }
            let text = read(&p)?;
            let plain = if crate::secrets::sops::is_encrypted(&text) {
                self.open_sops_file(&text, &p, name)?
            } else {
                Some(text)
            };
            if plain.is_some() {
                self.skipped.push(Skipped {
                    file: p.clone(),
                    line: None,
                    field: name.into(),
                    reason: format!(
                        "the cluster's secrets are not part of cluster.yaml: import them into \
                         the state dir with `imgbuild secrets gen --secrets {}` (a SOPS file is \
                         read with your age key)",
                        p.display()
                    ),
                });
            }
        }
        for name in TALENV_SOPS.iter().chain(&TALENV_PLAIN) {
            let p = self.dir.join(name);
            if !p.is_file() {
                continue;
            }
            let mut text = read(&p)?;
            if crate::secrets::sops::is_encrypted(&text) {
                match self.open_sops_file(&text, &p, name)? {
                    Some(plain) => text = plain,
                    None => continue,
                }
            }
            let parsed: Value = serde_yaml_ng::from_str(parse_guard(&text, &p)?).map_err(|e| {
                ImportError::Parse {
                    path: p.clone(),
                    message: crate::input::yaml_error_without_values(&e),
                }
            })?;
            if let Value::Mapping(m) = parsed {
                for (k, v) in m {
                    let value = match v {
                        Value::String(s) => s,
                        Value::Number(n) => n.to_string(),
                        Value::Bool(b) => b.to_string(),
                        _ => continue,
                    };
                    if let Some(k) = k.as_str() {
                        self.vars.insert(k.to_owned(), value);
                    }
                }
            }
        }
        Ok(())
    }

    /// The plaintext of a SOPS file beside the talconfig, opened with the
    /// environment's age keys, or why it cannot be (for the caller to
    /// report). A file changed after it was encrypted is refused.
    fn open_sops(text: &str, path: &Path) -> Result<Result<String, String>, ImportError> {
        use crate::secrets::sops::{self, SopsError};
        // As a render opens it: age keys, else the sops binary for the
        // key types only it has.
        match sops::open(text, path) {
            Ok(plain) => Ok(Ok(plain.into_owned())),
            // A file changed without its key is an attack, not a gap.
            Err(e @ (SopsError::Tampered { .. } | SopsError::NotEncrypted { .. })) => Err(e.into()),
            Err(e @ (SopsError::NoKey { .. } | SopsError::Keys { .. })) => Ok(Err(format!(
                "{e}: give the age key (SOPS_AGE_KEY_FILE, SOPS_AGE_KEY or \
                 ~/.config/sops/age/keys.txt) and import again"
            ))),
            Err(e) => Ok(Err(e.to_string())),
        }
    }

    /// [`Converter::open_sops`] for a file of its own: None (and reported
    /// as `field` of `path`) when it does not open.
    fn open_sops_file(
        &mut self,
        text: &str,
        path: &Path,
        field: &str,
    ) -> Result<Option<String>, ImportError> {
        Ok(match Self::open_sops(text, path)? {
            Ok(plain) => Some(plain),
            Err(reason) => {
                // The entry names the file; its reason need not again.
                let named = format!("{}: ", path.display());
                let reason = reason
                    .strip_prefix(&named)
                    .map_or(reason.clone(), str::to_owned);
                self.skipped.push(Skipped {
                    file: path.to_owned(),
                    line: None,
                    field: field.into(),
                    reason,
                });
                None
            }
        })
    }

    /// talhelper's envsubst for `${NAME}` and `${NAME:-default}`: talenv.yaml
    /// first, then the environment. An unset variable stays as written and
    /// is reported with its line in `file`.
    fn substitute(&mut self, text: &str, file: &Path) -> Result<String, ImportError> {
        let mut out = String::with_capacity(text.len());
        let mut rest = text;
        let mut consumed = 0;
        while let Some(start) = rest.find("${") {
            let Some(len) = rest[start..].find('}') else {
                break;
            };
            let inner = &rest[start + 2..start + len];
            let (name, default) = match inner.split_once(":-") {
                Some((n, d)) => (n, Some(d)),
                None => (inner, None),
            };
            let is_name =
                !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
            out.push_str(&rest[..start]);
            let whole = &rest[start..start + len + 1];
            let value = is_name
                .then(|| {
                    self.vars
                        .get(name)
                        .cloned()
                        .or_else(|| (self.env)(name))
                        .or(default.map(str::to_owned))
                })
                .flatten();
            match value {
                Some(v) => {
                    out.push_str(&v);
                    // Variables must not grow a small file into a huge one.
                    if out.len() as u64 > crate::input::MAX_TEXT_FILE {
                        return Err(ImportError::Parse {
                            path: file.to_owned(),
                            message: format!(
                                "with its variables filled in, the file passes {} KiB",
                                crate::input::MAX_TEXT_FILE >> 10
                            ),
                        });
                    }
                }
                None => {
                    out.push_str(whole);
                    if is_name {
                        let line = text[..consumed + start].matches('\n').count() + 1;
                        self.skipped.push(Skipped {
                            file: file.to_owned(),
                            line: Some(line),
                            field: format!("${{{name}}}"),
                            reason: format!(
                                "variable {name} is not in talenv.yaml; left as written \
                                 (pass --env {name} to take it from the environment)"
                            ),
                        });
                    }
                }
            }
            consumed += start + len + 1;
            rest = &rest[start + len + 1..];
        }
        out.push_str(rest);
        Ok(out)
    }

    /// Reports every key of `map` (at `at`) that is not in `known`.
    fn skip_unknown(&mut self, map: &Mapping, at: &str, known: &[&str]) {
        for (k, v) in map {
            let key = k.as_str().unwrap_or("?");
            let empty = matches!(v, Value::Null | Value::Bool(false))
                || v.as_sequence().is_some_and(Vec::is_empty)
                || v.as_mapping().is_some_and(Mapping::is_empty);
            if !known.contains(&key) && !empty {
                let field = if at.is_empty() {
                    key.to_owned()
                } else {
                    format!("{at}.{key}")
                };
                self.skip(
                    field,
                    "cluster.yaml has no such setting; a machine-config patch can carry it",
                );
            }
        }
    }

    fn string(
        &mut self,
        map: &Mapping,
        key: &str,
        at: &str,
    ) -> Result<Option<String>, ImportError> {
        match map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(Value::Number(n)) => Ok(Some(n.to_string())),
            Some(_) => {
                let field = join(at, key);
                Err(ImportError::Parse {
                    path: self.path.clone(),
                    message: format!(
                        "line {}: {field} must be a string",
                        self.index.line(&field).unwrap_or(0)
                    ),
                })
            }
        }
    }

    fn required(&mut self, map: &Mapping, key: &str, what: &str) -> Result<String, ImportError> {
        self.string(map, key, "")?
            .ok_or_else(|| ImportError::Missing {
                path: self.path.clone(),
                field: key.into(),
                message: what.into(),
            })
    }

    fn convert(&mut self, top: &Mapping) -> Result<String, ImportError> {
        self.skip_unknown(
            top,
            "",
            &[
                "clusterName",
                "talosVersion",
                "kubernetesVersion",
                "endpoint",
                "nodes",
                "patches",
                "controlPlane",
                "worker",
                "imageFactory",
                "cniConfig",
            ],
        );
        let name = self.required(top, "clusterName", "the cluster's name")?;
        let talos = self.required(
            top,
            "talosVersion",
            "talhelper falls back to its own default version; set it (e.g. v1.11.2)",
        )?;
        let kubernetes = self.required(
            top,
            "kubernetesVersion",
            "talhelper falls back to its own default version; set it (e.g. v1.32.1)",
        )?;
        let endpoint = self.required(top, "endpoint", "the Kubernetes API endpoint")?;
        let factory = self.factory(top)?;
        let mut all_patches = Vec::new();
        if let Some(list) = top.get("patches") {
            all_patches = self.patches(list, "patches", "all");
        }
        if let Some(cni) = top.get("cniConfig") {
            all_patches.extend(self.cni(cni));
        }
        let mut groups: BTreeMap<&str, Group> = BTreeMap::new();
        for (key, scope) in [("controlPlane", "controlplane"), ("worker", "worker")] {
            let mut group = Group::default();
            if let Some(Value::Mapping(g)) = top.get(key) {
                self.skip_unknown(
                    g,
                    key,
                    &["patches", "schematic", "nameservers", "extensionServices"],
                );
                if let Some(list) = g.get("patches") {
                    group.patches = self.patches(list, &format!("{key}.patches"), scope);
                }
                group.schematic = g.get("schematic").cloned();
                group.nameservers = strings(g.get("nameservers"));
                if let Some(list) = g.get("extensionServices") {
                    let at = format!("{key}.extensionServices");
                    group
                        .patches
                        .extend(self.extension_services(list, &at, scope));
                }
            }
            groups.insert(key, group);
        }
        let mut shared = Shared::default();
        let mut nodes = Vec::new();
        let Some(Value::Sequence(list)) = top.get("nodes") else {
            return Err(ImportError::Missing {
                path: self.path.clone(),
                field: "nodes".into(),
                message: "a list of nodes".into(),
            });
        };
        for (i, n) in list.iter().enumerate() {
            let at = format!("nodes[{i}]");
            let Value::Mapping(n) = n else {
                self.skip(at, "not a mapping");
                continue;
            };
            let group = if n.get("controlPlane").and_then(Value::as_bool) == Some(true) {
                "controlPlane"
            } else {
                "worker"
            };
            let group_schematic = groups[group].schematic.clone();
            nodes.push(self.node(n, &at, group_schematic.as_ref(), &mut shared)?);
        }
        let nameservers = self.nameservers(&mut nodes, &mut groups);
        // Extensions and kernel args every node shares belong to the image.
        let common = |f: fn(&NodeOut) -> &Vec<String>| -> Option<Vec<String>> {
            let first = f(nodes.first()?);
            nodes.iter().all(|n| f(n) == first).then(|| first.clone())
        };
        let common_ext = common(|n| &n.extensions).unwrap_or_default();
        let common_args = common(|n| &n.kernel_args).unwrap_or_default();
        if !common_ext.is_empty() {
            nodes.iter_mut().for_each(|n| n.extensions.clear());
        }
        if !common_args.is_empty() {
            nodes.iter_mut().for_each(|n| n.kernel_args.clear());
        }

        let mut out = Mapping::new();
        let mut cluster = Mapping::new();
        cluster.insert("name".into(), name.into());
        cluster.insert("talosVersion".into(), talos.into());
        cluster.insert("kubernetesVersion".into(), kubernetes.into());
        cluster.insert("endpoint".into(), endpoint.into());
        if let Some(vip) = shared.vip {
            cluster.insert("vip".into(), vip.into());
        }
        out.insert("cluster".into(), cluster.into());
        let mut image = Mapping::new();
        insert_some(&mut image, "platform", shared.platform);
        insert_some(&mut image, "arch", shared.arch);
        insert_list(&mut image, "extensions", common_ext);
        insert_list(&mut image, "kernelArgs", common_args);
        insert_some(&mut image, "factory", factory);
        if !image.is_empty() {
            out.insert("image".into(), image.into());
        }
        let mut network = Mapping::new();
        insert_some(&mut network, "cidr", shared.cidr);
        insert_some(&mut network, "gateway", shared.gateway);
        insert_list(&mut network, "nameservers", nameservers);
        if let Some(mtu) = shared.mtu {
            network.insert("mtu".into(), mtu.into());
        }
        if !network.is_empty() {
            out.insert("network".into(), network.into());
        }
        let mut patches = Mapping::new();
        insert_list(&mut patches, "all", all_patches);
        insert_list(
            &mut patches,
            "controlPlane",
            groups["controlPlane"].patches.clone(),
        );
        insert_list(&mut patches, "worker", groups["worker"].patches.clone());
        if !patches.is_empty() {
            out.insert("patches".into(), patches.into());
        }
        let nodes: Vec<Value> = nodes.into_iter().map(node_value).collect();
        out.insert("nodes".into(), nodes.into());
        let body = serde_yaml_ng::to_string(&out).expect("plain data");
        Ok(format!(
            "# Converted from {} by `imgbuild import talhelper`.\n{body}",
            self.path
                .file_name()
                .map_or("talconfig.yaml".into(), |n| n.to_string_lossy())
        ))
    }

    /// `imageFactory.registryURL` (and `protocol`) name the factory.
    fn factory(&mut self, top: &Mapping) -> Result<Option<String>, ImportError> {
        let Some(Value::Mapping(f)) = top.get("imageFactory") else {
            return Ok(None);
        };
        self.skip_unknown(f, "imageFactory", &["registryURL", "protocol"]);
        let Some(host) = self.string(f, "registryURL", "imageFactory")? else {
            return Ok(None);
        };
        let protocol = self
            .string(f, "protocol", "imageFactory")?
            .unwrap_or_else(|| "https".into());
        Ok(Some(format!("{protocol}://{host}")))
    }

    fn node(
        &mut self,
        n: &Mapping,
        at: &str,
        group_schematic: Option<&Value>,
        shared: &mut Shared,
    ) -> Result<NodeOut, ImportError> {
        self.skip_unknown(
            n,
            at,
            &[
                "hostname",
                "ipAddress",
                "controlPlane",
                "installDisk",
                "networkInterfaces",
                "nameservers",
                "schematic",
                "patches",
                "machineSpec",
                "extensionServices",
            ],
        );
        let name = self.string(n, "hostname", at)?.unwrap_or_default();
        // The name becomes a file name: only a valid node name will do
        // (the inventory check reports the name itself).
        let scope = if crate::inventory::is_node_name(&name) {
            format!("node-{name}")
        } else {
            at.replace(['[', ']'], "-").trim_end_matches('-').to_owned()
        };
        let mut node = NodeOut {
            name,
            scope,
            controlplane: n.get("controlPlane").and_then(Value::as_bool) == Some(true),
            install_disk: self.string(n, "installDisk", at)?,
            ..NodeOut::default()
        };
        let reach: Option<IpAddr> = self
            .string(n, "ipAddress", at)?
            .and_then(|s| s.split(',').next().and_then(|a| a.trim().parse().ok()));
        let mut static_address = None;
        match n.get("networkInterfaces") {
            Some(Value::Sequence(ifaces)) if !ifaces.is_empty() => {
                for (k, iface) in ifaces.iter().enumerate() {
                    let iat = format!("{at}.networkInterfaces[{k}]");
                    if k > 0 {
                        self.skip(iat, "imgbuild configures one link per node");
                        continue;
                    }
                    if let Value::Mapping(iface) = iface {
                        static_address = self.interface(iface, &iat, &mut node, shared)?;
                    }
                }
            }
            // No interface configured: Talos' default DHCP on every link.
            _ => node.dhcp = true,
        }
        node.address = static_address.or(reach);
        if static_address.is_some() && reach.is_some_and(|r| Some(r) != static_address) {
            self.skip(
                format!("{at}.ipAddress"),
                "differs from the interface's address; the node is reached at the interface's",
            );
        }
        node.nameservers = strings(n.get("nameservers"));
        if let Some(Value::Mapping(spec)) = n.get("machineSpec") {
            let sat = format!("{at}.machineSpec");
            self.skip_unknown(spec, &sat, &["arch", "mode"]);
            if let Some(arch) = self.string(spec, "arch", &sat)? {
                self.one_per_cluster(&mut shared.arch, arch, &format!("{sat}.arch"));
            }
            if let Some(mode) = self.string(spec, "mode", &sat)? {
                self.one_per_cluster(&mut shared.platform, mode, &format!("{sat}.mode"));
            }
        }
        let schematic = n.get("schematic").or(group_schematic);
        if let Some(s) = schematic {
            self.schematic(s, &format!("{at}.schematic"), &mut node)?;
        }
        if let Some(list) = n.get("patches") {
            node.patches = self.patches(list, &format!("{at}.patches"), &node.scope.clone());
        }
        if let Some(list) = n.get("extensionServices") {
            let at = format!("{at}.extensionServices");
            let scope = node.scope.clone();
            node.patches
                .extend(self.extension_services(list, &at, &scope));
        }
        Ok(node)
    }

    /// `cniConfig` as a patch for every node: Talos' `cluster.network.cni`
    /// with the same `name` (`flannel`, `custom` with its `urls`, or `none`,
    /// which talhelper passes through unchanged).
    fn cni(&mut self, v: &Value) -> Option<String> {
        let at = "cniConfig";
        let Value::Mapping(m) = v else {
            self.skip(at, "not a mapping");
            return None;
        };
        self.skip_unknown(m, at, &["name", "urls"]);
        let name = m.get("name").and_then(Value::as_str).unwrap_or("flannel");
        if !matches!(name, "flannel" | "custom" | "none") {
            self.skip(
                format!("{at}.name"),
                "Talos' CNI is flannel, custom (with urls) or none",
            );
            return None;
        }
        let urls = strings(m.get("urls")).unwrap_or_default();
        if (name == "custom") == urls.is_empty() {
            self.skip(
                format!("{at}.urls"),
                "Talos takes manifest urls with `custom`, and only with it",
            );
            return None;
        }
        let mut cni = Mapping::new();
        cni.insert("name".into(), name.into());
        insert_list(&mut cni, "urls", urls);
        let doc = nest(&["cluster", "network", "cni"], cni.into());
        self.write_patch(to_yaml(&doc), at, "cni", 0)
    }

    /// talhelper's `extensionServices` (a list of name, configFiles,
    /// environment) as one patch of `ExtensionServiceConfig` documents.
    fn extension_services(&mut self, list: &Value, at: &str, scope: &str) -> Option<String> {
        let Some(items) = list.as_sequence() else {
            self.skip(at, "not a list of extension services");
            return None;
        };
        let mut docs = Vec::new();
        for (j, item) in items.iter().enumerate() {
            let sat = format!("{at}[{j}]");
            let Value::Mapping(svc) = item else {
                self.skip(sat, "not a mapping");
                continue;
            };
            self.skip_unknown(svc, &sat, &["name", "configFiles", "environment"]);
            let Some(name) = svc.get("name").and_then(Value::as_str) else {
                self.skip(format!("{sat}.name"), "an extension service needs a name");
                continue;
            };
            let mut doc = Mapping::new();
            doc.insert("apiVersion".into(), "v1alpha1".into());
            doc.insert("kind".into(), "ExtensionServiceConfig".into());
            doc.insert("name".into(), name.into());
            let mut files = Vec::new();
            for (k, f) in svc
                .get("configFiles")
                .and_then(Value::as_sequence)
                .into_iter()
                .flatten()
                .enumerate()
            {
                let fat = format!("{sat}.configFiles[{k}]");
                let (Some(content), Some(mount)) = (
                    f.get("content").and_then(Value::as_str),
                    f.get("mountPath").and_then(Value::as_str),
                ) else {
                    self.skip(fat, "a config file needs content and mountPath");
                    continue;
                };
                let mut file = Mapping::new();
                file.insert("content".into(), content.into());
                file.insert("mountPath".into(), mount.into());
                files.push(Value::from(file));
            }
            if !files.is_empty() {
                doc.insert("configFiles".into(), files.into());
            }
            insert_list(
                &mut doc,
                "environment",
                strings(svc.get("environment")).unwrap_or_default(),
            );
            docs.push(to_yaml(&doc.into()));
        }
        if docs.is_empty() {
            return None;
        }
        self.write_patch(docs.join("---\n"), at, &format!("services-{scope}"), 0)
    }

    /// The nameservers every node shares, for cluster.yaml's `network`.
    /// When they differ, each role whose nodes agree gets a patch, and else
    /// each node with its own (a node's own list wins over its role's, as
    /// in talhelper; Talos appends patched lists, so no node gets two).
    fn nameservers(
        &mut self,
        nodes: &mut [NodeOut],
        groups: &mut BTreeMap<&str, Group>,
    ) -> Vec<String> {
        let role = |n: &NodeOut| {
            if n.controlplane {
                "controlPlane"
            } else {
                "worker"
            }
        };
        let effective: Vec<Option<Vec<String>>> = nodes
            .iter()
            .map(|n| {
                n.nameservers
                    .clone()
                    .or_else(|| groups[role(n)].nameservers.clone())
            })
            .collect();
        if let Some(first) = effective.first()
            && effective.iter().all(|e| e == first)
        {
            return first.clone().unwrap_or_default();
        }
        for (key, scope) in [("controlPlane", "controlplane"), ("worker", "worker")] {
            let mine: Vec<usize> = (0..nodes.len())
                .filter(|&i| role(&nodes[i]) == key)
                .collect();
            let Some(&first) = mine.first() else {
                continue;
            };
            if mine.iter().all(|&i| effective[i] == effective[first]) {
                if let Some(ns) = &effective[first] {
                    let at = format!("{key}.nameservers");
                    let patch = self.nameserver_patch(ns, &at, scope);
                    groups
                        .get_mut(key)
                        .expect("both roles")
                        .patches
                        .extend(patch);
                }
                continue;
            }
            for i in mine {
                if let Some(ns) = &effective[i] {
                    let at = format!("nodes[{i}].nameservers");
                    let scope = nodes[i].scope.clone();
                    let patch = self.nameserver_patch(ns, &at, &scope);
                    nodes[i].patches.extend(patch);
                }
            }
        }
        Vec::new()
    }

    fn nameserver_patch(&mut self, ns: &[String], at: &str, scope: &str) -> Option<String> {
        let list: Vec<Value> = ns.iter().map(|s| s.as_str().into()).collect();
        let doc = nest(&["machine", "network", "nameservers"], list.into());
        self.write_patch(to_yaml(&doc), at, &format!("nameservers-{scope}"), 0)
    }

    /// The node's link; returns its static address.
    fn interface(
        &mut self,
        iface: &Mapping,
        at: &str,
        node: &mut NodeOut,
        shared: &mut Shared,
    ) -> Result<Option<IpAddr>, ImportError> {
        self.skip_unknown(
            iface,
            at,
            &[
                "interface",
                "deviceSelector",
                "addresses",
                "routes",
                "vip",
                "dhcp",
                "mtu",
            ],
        );
        node.interface = self.string(iface, "interface", at)?;
        if let Some(Value::Mapping(sel)) = iface.get("deviceSelector") {
            let sat = format!("{at}.deviceSelector");
            self.skip_unknown(sel, &sat, &["hardwareAddr"]);
            if let Some(mac) = self.string(sel, "hardwareAddr", &sat)? {
                if mac.contains('*') {
                    self.skip(
                        format!("{sat}.hardwareAddr"),
                        "a wildcard selects several NICs; cluster.yaml pins one MAC",
                    );
                } else {
                    node.mac = Some(mac);
                }
            }
        }
        node.dhcp = iface.get("dhcp").and_then(Value::as_bool) == Some(true);
        if let Some(mtu) = iface.get("mtu").and_then(Value::as_u64) {
            self.one_per_cluster(&mut shared.mtu, mtu, &format!("{at}.mtu"));
        }
        let mut address = None;
        if let Some(list) = iface.get("addresses").and_then(Value::as_sequence) {
            for (j, a) in list.iter().enumerate() {
                let aat = format!("{at}.addresses[{j}]");
                let parsed = a.as_str().and_then(|s| s.parse::<Cidr>().ok());
                match parsed {
                    Some(cidr) if address.is_none() => {
                        address = Some(cidr.addr);
                        let network = cidr.network().to_string();
                        self.one_per_cluster(&mut shared.cidr, network, &aat);
                    }
                    _ => self.skip(aat, "imgbuild gives a node one address (ADDRESS/PREFIX)"),
                }
            }
        }
        if let Some(list) = iface.get("routes").and_then(Value::as_sequence) {
            for (j, r) in list.iter().enumerate() {
                let rat = format!("{at}.routes[{j}]");
                let default = matches!(
                    r.get("network").and_then(Value::as_str),
                    None | Some("0.0.0.0/0")
                );
                match (default, r.get("gateway").and_then(Value::as_str)) {
                    (true, Some(gw)) => {
                        self.one_per_cluster(&mut shared.gateway, gw.to_owned(), &rat)
                    }
                    _ => self.skip(rat, "only the default route (network.gateway) carries over"),
                }
            }
        }
        if let Some(Value::Mapping(vip)) = iface.get("vip") {
            let vat = format!("{at}.vip");
            self.skip_unknown(vip, &vat, &["ip"]);
            if let Some(ip) = self.string(vip, "ip", &vat)? {
                self.one_per_cluster(&mut shared.vip, ip, &vat);
            }
        }
        Ok(address.filter(|_| !node.dhcp))
    }

    /// Sets a cluster-wide value from a node, or reports a node that differs.
    fn one_per_cluster<T: PartialEq + std::fmt::Debug>(
        &mut self,
        slot: &mut Option<T>,
        value: T,
        field: &str,
    ) {
        match slot {
            None => *slot = Some(value),
            Some(v) if *v == value => {}
            Some(v) => {
                let reason =
                    format!("cluster.yaml has one value for all nodes; kept {v:?}, not {value:?}");
                self.skip(field, reason);
            }
        }
    }

    /// `schematic.customization`: extensions and kernel args carry over;
    /// anything more (overlay, META, secure boot…) is reported.
    fn schematic(&mut self, s: &Value, at: &str, node: &mut NodeOut) -> Result<(), ImportError> {
        let text = serde_yaml_ng::to_string(s).expect("plain data");
        let parsed = Schematic::parse(&text).map_err(|e| ImportError::Parse {
            path: self.path.clone(),
            message: format!("line {}: {at}: {e}", self.index.line(at).unwrap_or(0)),
        })?;
        let c = &parsed.customization;
        let carried = Schematic {
            customization: Customization {
                extra_kernel_args: c.extra_kernel_args.clone(),
                system_extensions: SystemExtensions {
                    official_extensions: c.system_extensions.official_extensions.clone(),
                },
                ..Default::default()
            },
            ..Default::default()
        };
        if carried != parsed {
            self.skip(
                at,
                "only customization.systemExtensions and extraKernelArgs carry over \
                 (not overlay, meta, secureboot, bootloader, diskImage)",
            );
        }
        node.extensions = carried.customization.system_extensions.official_extensions;
        node.kernel_args = carried.customization.extra_kernel_args;
        Ok(())
    }

    /// talhelper patches: `@file` references and inline documents. Strategic
    /// merge and JSON6902 patches carry over (inline ones as files under
    /// `patches/`), as talhelper hands both to talosctl; inline SOPS
    /// documents are reported; SOPS patch files are kept as they are.
    fn patches(&mut self, list: &Value, at: &str, scope: &str) -> Vec<String> {
        let Some(items) = list.as_sequence() else {
            self.skip(at, "not a list of patches");
            return Vec::new();
        };
        let mut out = Vec::new();
        for (j, item) in items.iter().enumerate() {
            let pat = format!("{at}[{j}]");
            let Some(text) = item.as_str() else {
                self.skip(pat, "not a patch string");
                continue;
            };
            if let Some(file) = text.trim().strip_prefix('@') {
                if let Some(p) = self.patch_file(file, &pat, scope, j) {
                    out.push(p);
                }
                continue;
            }
            match patch_kind(text) {
                PatchKind::Strategic | PatchKind::Json6902 => {
                    if let Some(p) = self.write_patch(text.to_owned(), &pat, scope, j) {
                        out.push(p);
                    }
                }
                PatchKind::Sops => self.skip(pat, "a SOPS-encrypted patch cannot be read"),
                PatchKind::Invalid(e) => self.skip(pat, format!("not YAML: {e}")),
            }
        }
        out
    }

    /// A referenced patch file (inside the talconfig's folder): kept by
    /// reference when the inventory goes beside the talconfig, else copied
    /// beside it; substituted when it has `${VAR}`s.
    fn patch_file(&mut self, file: &str, at: &str, scope: &str, j: usize) -> Option<String> {
        // Only files beside the talconfig: a repository's config must not
        // make imgbuild read (and copy) files elsewhere on the machine.
        let path = match crate::inventory::patch_path(&self.dir, Path::new(file)) {
            Ok(p) => p,
            Err(why) => {
                self.skip(at, why);
                return None;
            }
        };
        let text = match crate::input::read_text(&path, crate::input::MAX_TEXT_FILE) {
            Ok(t) => t,
            Err(e) => {
                self.skip(at, format!("cannot read {}: {e}", path.display()));
                return None;
            }
        };
        match patch_kind(&text) {
            PatchKind::Strategic | PatchKind::Json6902 => {}
            // Kept encrypted (imgbuild opens SOPS patches when it renders)
            // once the age key here opens it.
            PatchKind::Sops => match Self::open_sops(&text, &path) {
                Ok(Ok(_)) => {}
                Ok(Err(reason)) => {
                    self.skip(at, format!("{}: {reason}", path.display()));
                    return None;
                }
                Err(e) => {
                    self.skip(at, e.to_string());
                    return None;
                }
            },
            PatchKind::Invalid(e) => {
                self.skip(at, format!("{} is not YAML: {e}", path.display()));
                return None;
            }
        }
        if text.contains("${") && !crate::secrets::sops::is_encrypted(&text) {
            let substituted = match self.substitute(&text, &path) {
                Ok(t) => t,
                Err(e) => {
                    self.skip(at, e.to_string());
                    return None;
                }
            };
            return self.write_patch(substituted, at, scope, j);
        }
        // The same spelling when the inventory sits beside the talconfig,
        // else a copy beside the inventory (it reads patches only from its
        // own folder).
        let same_dir = match &self.out_dir {
            None => true,
            Some(out) => same_path(out, &self.dir),
        };
        if same_dir {
            Some(file.to_owned())
        } else {
            self.write_patch(text, at, scope, j)
        }
    }

    /// Queues `patches/<scope>-<n>.yaml` for writing beside the inventory.
    fn write_patch(&mut self, content: String, at: &str, scope: &str, j: usize) -> Option<String> {
        if self.out_dir.is_none() {
            self.skip(
                at,
                "this patch becomes a new file beside the inventory: give --out to write it",
            );
            return None;
        }
        let rel = format!("patches/{scope}-{}.yaml", j + 1);
        let mut content = content;
        if !content.ends_with('\n') {
            content.push('\n');
        }
        self.patch_files.push(PatchFile {
            path: PathBuf::from(&rel),
            content,
        });
        Some(rel)
    }
}

/// What a talhelper `controlPlane` or `worker` section gives its nodes.
#[derive(Default)]
struct Group {
    patches: Vec<String>,
    schematic: Option<Value>,
    nameservers: Option<Vec<String>>,
}

/// A list of strings (other items dropped), if `v` is a list.
fn strings(v: Option<&Value>) -> Option<Vec<String>> {
    let list = v?.as_sequence()?;
    Some(
        list.iter()
            .filter_map(|v| v.as_str().map(str::to_owned))
            .collect(),
    )
}

/// `value` under the mapping keys `path`, outermost first.
fn nest(path: &[&str], value: Value) -> Value {
    path.iter().rev().fold(value, |inner, key| {
        let mut m = Mapping::new();
        m.insert((*key).into(), inner);
        m.into()
    })
}

fn to_yaml(v: &Value) -> String {
    serde_yaml_ng::to_string(v).expect("plain data")
}

enum PatchKind {
    Strategic,
    Json6902,
    Sops,
    Invalid(String),
}

/// What a patch is. Its content may be any file: messages show no value.
fn patch_kind(text: &str) -> PatchKind {
    let text = match crate::input::yaml(text) {
        Ok(t) => t,
        Err(e) => return PatchKind::Invalid(e.to_string()),
    };
    match serde_yaml_ng::from_str::<Value>(text) {
        Ok(Value::Sequence(_)) => PatchKind::Json6902,
        Ok(Value::Mapping(m)) if m.contains_key("sops") => PatchKind::Sops,
        Ok(Value::Mapping(_)) => PatchKind::Strategic,
        Ok(_) => PatchKind::Invalid("neither a mapping nor a list".into()),
        Err(e) => PatchKind::Invalid(crate::input::yaml_error_without_values(&e)),
    }
}

/// `text` past the YAML guard (aliases, nesting, repeated keys).
fn parse_guard<'t>(text: &'t str, path: &Path) -> Result<&'t str, ImportError> {
    crate::input::yaml(text).map_err(|e| ImportError::Parse {
        path: path.to_owned(),
        message: e.to_string(),
    })
}

/// Where patch file `rel` (from [`Imported::patch_files`]) goes under
/// `dir`: a path that stays inside it, else an error.
fn patch_target(dir: &Path, rel: &Path) -> Result<PathBuf, ImportError> {
    let inside = rel
        .components()
        .all(|c| matches!(c, std::path::Component::Normal(_)));
    if !inside || rel.as_os_str().is_empty() {
        return Err(ImportError::Parse {
            path: rel.to_owned(),
            message: format!("refusing to write outside {}", dir.display()),
        });
    }
    Ok(dir.join(rel))
}

/// Converts the talhelper config at `path` (`env` as in [`ImportOptions`])
/// and writes it to `dest`: the patch files first, then the inventory, each
/// atomically and only when changed, so no reader sees a half-written file
/// and an inventory never names a patch that is not there yet. An existing
/// inventory is refused before anything is read unless `dest.force`. The
/// result is then parsed where it lives, so its patch paths resolve.
pub fn talhelper_into(
    path: &Path,
    dest: &Destination,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Converted, ImportError> {
    if let Some(out) = dest.out
        && out.exists()
        && !dest.force
    {
        return Err(ImportError::Exists {
            path: out.to_owned(),
        });
    }
    let out_dir = dest.out.map(|o| {
        o.parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .to_owned()
    });
    let create_dir = |dir: &Path| {
        std::fs::create_dir_all(dir).map_err(|source| ImportError::CreateDir {
            path: dir.to_owned(),
            source,
        })
    };
    if let Some(dir) = &out_dir {
        create_dir(dir)?;
    }
    let imported = talhelper(
        path,
        &ImportOptions {
            out_dir: out_dir.as_deref(),
            env,
        },
    )?;
    let write = |target: &Path, text: &str| {
        crate::atomic::write_if_changed(target, text.as_bytes(), false).map_err(|source| {
            ImportError::Write {
                path: target.to_owned(),
                source,
            }
        })
    };
    let home = match (dest.out, &out_dir) {
        (Some(out), Some(dir)) => {
            for p in &imported.patch_files {
                let target = patch_target(dir, &p.path)?;
                if let Some(parent) = target.parent() {
                    create_dir(parent)?;
                }
                write(&target, &p.content)?;
            }
            write(out, &imported.inventory)?;
            out.to_owned()
        }
        _ => path.parent().unwrap_or(Path::new(".")).join("cluster.yaml"),
    };
    let problems = Inventory::parse(&imported.inventory, &home).err();
    Ok(Converted { imported, problems })
}

fn same_path(a: &Path, b: &Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

fn join(at: &str, key: &str) -> String {
    if at.is_empty() {
        key.to_owned()
    } else {
        format!("{at}.{key}")
    }
}

fn insert_some(m: &mut Mapping, key: &str, v: Option<String>) {
    if let Some(v) = v {
        m.insert(key.into(), v.into());
    }
}

fn insert_list(m: &mut Mapping, key: &str, v: Vec<String>) {
    if !v.is_empty() {
        m.insert(key.into(), v.into());
    }
}

fn node_value(n: NodeOut) -> Value {
    let mut m = Mapping::new();
    m.insert("name".into(), n.name.into());
    let role = if n.controlplane {
        "controlplane"
    } else {
        "worker"
    };
    m.insert("role".into(), role.into());
    if let Some(a) = n.address {
        m.insert("address".into(), a.to_string().into());
    }
    if n.dhcp {
        m.insert("dhcp".into(), true.into());
    }
    insert_some(&mut m, "mac", n.mac);
    insert_some(&mut m, "interface", n.interface);
    insert_some(&mut m, "installDisk", n.install_disk);
    insert_list(&mut m, "extensions", n.extensions);
    insert_list(&mut m, "kernelArgs", n.kernel_args);
    insert_list(&mut m, "patches", n.patches);
    m.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn convert(text: &str, env: &[(&str, &str)]) -> Imported {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("talconfig.yaml");
        std::fs::write(&path, text).unwrap();
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let lookup = move |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        talhelper(
            &path,
            &ImportOptions {
                out_dir: Some(dir.path()),
                env: &lookup,
            },
        )
        .unwrap()
    }

    const MINIMAL: &str = "clusterName: c\ntalosVersion: v1.11.2\nkubernetesVersion: v1.32.1\nendpoint: https://${VIP}:6443\nnodes:\n  - hostname: a\n    ipAddress: 10.0.0.5\n    controlPlane: true\n";

    /// Three nodes (control plane a, workers b and c), then `tail`.
    fn three(nodes: [&str; 3], tail: &str) -> Imported {
        let text = format!(
            "clusterName: c\ntalosVersion: v1.11.2\nkubernetesVersion: v1.32.1\nendpoint: https://10.0.0.2:6443\nnodes:\n  - hostname: a\n    ipAddress: 10.0.0.5\n    controlPlane: true\n{}  - hostname: b\n    ipAddress: 10.0.0.6\n{}  - hostname: c\n    ipAddress: 10.0.0.7\n{}{tail}",
            nodes[0], nodes[1], nodes[2]
        );
        convert(&text, &[])
    }

    fn patch<'a>(i: &'a Imported, path: &str) -> &'a str {
        i.patch_files
            .iter()
            .find(|p| p.path == Path::new(path))
            .map(|p| p.content.as_str())
            .unwrap_or_else(|| panic!("no {path}: {:?}", i.patch_files))
    }

    #[test]
    fn nameservers_go_to_the_cluster_a_role_or_a_node_never_twice() {
        let ns = |list: &str| format!("    nameservers: [{list}]\n");
        // All alike: the cluster's.
        let same = three([&ns("10.0.0.1"), &ns("10.0.0.1"), &ns("10.0.0.1")], "");
        assert!(
            same.inventory.contains("nameservers:\n  - 10.0.0.1"),
            "{}",
            same.inventory
        );
        assert!(same.patch_files.is_empty() && same.skipped.is_empty());
        // By role: the control plane its own, the workers the group's.
        let roles = three(
            [&ns("10.0.0.53"), "", ""],
            "worker:\n  nameservers: [10.0.0.1]\n",
        );
        assert!(roles.skipped.is_empty(), "{:?}", roles.skipped);
        assert!(!roles.inventory.contains("network:"), "{}", roles.inventory);
        assert_eq!(
            patch(&roles, "patches/nameservers-controlplane-1.yaml"),
            "machine:\n  network:\n    nameservers:\n    - 10.0.0.53\n"
        );
        assert!(patch(&roles, "patches/nameservers-worker-1.yaml").contains("10.0.0.1"));
        // Workers that differ: one patch each, and no role patch.
        let nodes = three(["", &ns("10.0.0.1"), &ns("10.0.0.2")], "");
        assert!(patch(&nodes, "patches/nameservers-node-b-1.yaml").contains("10.0.0.1"));
        assert!(patch(&nodes, "patches/nameservers-node-c-1.yaml").contains("10.0.0.2"));
        assert_eq!(nodes.patch_files.len(), 2, "{:?}", nodes.patch_files);
    }

    #[test]
    fn cni_and_extension_services_become_patches_and_what_talos_refuses_is_reported() {
        let services = "    extensionServices:\n      - name: tailscale\n        environment: [TS_ROUTES=10.0.0.0/24]\n        configFiles:\n          - {content: x, mountPath: /etc/x}\n          - {content: y}\n";
        let tail = "cniConfig:\n  name: custom\n  urls: [https://example.net/cilium.yaml]\n";
        let i = three([services, "", ""], tail);
        assert_eq!(
            patch(&i, "patches/cni-1.yaml"),
            "cluster:\n  network:\n    cni:\n      name: custom\n      urls:\n      - https://example.net/cilium.yaml\n"
        );
        let svc = patch(&i, "patches/services-node-a-1.yaml");
        assert!(
            svc.starts_with(
                "apiVersion: v1alpha1\nkind: ExtensionServiceConfig\nname: tailscale\n"
            ),
            "{svc}"
        );
        assert!(
            svc.contains("mountPath: /etc/x") && !svc.contains("content: y"),
            "{svc}"
        );
        // The config file without a mount path is the one thing not carried.
        let fields: Vec<&str> = i.skipped.iter().map(|s| s.field.as_str()).collect();
        assert_eq!(fields, ["nodes[0].extensionServices[0].configFiles[1]"]);
        // `custom` without urls, or an unknown name: reported, no patch.
        for bad in [
            "cniConfig:\n  name: custom\n",
            "cniConfig:\n  name: calico\n",
        ] {
            let i = three(["", "", ""], bad);
            assert!(i.patch_files.is_empty(), "{bad}");
            assert_eq!(i.skipped.len(), 1, "{bad}: {:?}", i.skipped);
        }
    }

    #[test]
    fn variables_come_from_the_environment_and_unset_ones_are_reported_with_their_line() {
        let done = convert(MINIMAL, &[("VIP", "10.0.0.2")]);
        assert!(
            done.inventory.contains("https://10.0.0.2:6443"),
            "{}",
            done.inventory
        );
        assert!(done.skipped.is_empty(), "{:?}", done.skipped);
        let open = convert(MINIMAL, &[]);
        assert_eq!(open.skipped.len(), 1);
        assert_eq!(open.skipped[0].line, Some(4));
        assert_eq!(open.skipped[0].field, "${VIP}");
        assert!(open.inventory.contains("${VIP}"));
    }

    #[test]
    fn a_default_fills_an_unset_variable() {
        let text = MINIMAL.replace("${VIP}", "${VIP:-10.0.0.3}");
        let done = convert(&text, &[]);
        assert!(done.inventory.contains("https://10.0.0.3:6443"));
        assert!(done.skipped.is_empty());
    }

    #[test]
    fn a_node_without_interfaces_uses_dhcp_and_is_reached_at_its_ip_address() {
        let done = convert(MINIMAL, &[("VIP", "10.0.0.2")]);
        assert!(
            done.inventory.contains("  address: 10.0.0.5\n  dhcp: true"),
            "{}",
            done.inventory
        );
    }

    const WITH_PATCH: &str = "    patches:\n      - |\n        machine:\n          kubelet:\n            extraArgs:\n              max-pods: \"200\"\n";

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn an_import_writes_its_patches_then_an_inventory_that_loads_there() {
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("talconfig.yaml");
        let text = MINIMAL.replace("${VIP}", "10.0.0.2") + WITH_PATCH;
        std::fs::write(&source, text).unwrap();
        let out = dir.path().join("new/cluster.yaml");
        let dest = Destination {
            out: Some(&out),
            force: false,
        };
        let done = talhelper_into(&source, &dest, &no_env).unwrap();
        assert!(done.problems.is_none(), "{:?}", done.problems);
        assert_eq!(
            std::fs::read_to_string(&out).unwrap(),
            done.imported.inventory
        );
        let [patch] = &done.imported.patch_files[..] else {
            panic!("{:?}", done.imported.patch_files);
        };
        let written = std::fs::read_to_string(dir.path().join("new").join(&patch.path)).unwrap();
        assert!(written.contains("max-pods"), "{written}");
        // What `load` reads from disk is what was checked.
        Inventory::load(&out).unwrap();
        let again = talhelper_into(&source, &dest, &no_env).unwrap_err();
        assert!(matches!(again, ImportError::Exists { .. }), "{again:?}");
    }

    #[test]
    fn an_existing_inventory_is_refused_before_the_source_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("cluster.yaml");
        std::fs::write(&out, "mine\n").unwrap();
        let missing = dir.path().join("no-such-talconfig.yaml");
        let dest = Destination {
            out: Some(&out),
            force: false,
        };
        let err = talhelper_into(&missing, &dest, &no_env).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "{} exists: give --force to replace it, or another --out",
                out.display()
            )
        );
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "mine\n");
        let source = dir.path().join("talconfig.yaml");
        std::fs::write(&source, MINIMAL.replace("${VIP}", "10.0.0.2")).unwrap();
        let forced = Destination {
            out: Some(&out),
            force: true,
        };
        talhelper_into(&source, &forced, &no_env).unwrap();
        assert!(std::fs::read_to_string(&out).unwrap().contains("10.0.0.2"));
    }

    #[test]
    fn printing_writes_nothing_and_still_reports_an_inventory_that_does_not_load() {
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("talconfig.yaml");
        let twice = "  - hostname: a\n    ipAddress: 10.0.0.6\n";
        let text = MINIMAL.replace("${VIP}", "10.0.0.2") + twice;
        std::fs::write(&source, text).unwrap();
        let dest = Destination {
            out: None,
            force: false,
        };
        let done = talhelper_into(&source, &dest, &no_env).unwrap();
        let problems = done.problems.expect("node a twice").to_string();
        assert!(problems.contains("nodes[1]"), "{problems}");
        let files: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(files.len(), 1, "only the source: {files:?}");
    }
}
