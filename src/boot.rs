//! Bare-metal boot media that tell the factory nothing about the nodes:
//! per-node iPXE scripts over the kernel and initramfs of each node's base
//! schematic (no META, no address), with the node's META on its kernel
//! command line, where Talos (v1.5 and later) applies it before it installs
//! and then writes it to the META partition (siderolabs/talos
//! `pkg/imager/imager.go` `buildCmdline`, `internal/app/machined/pkg/runtime/v1alpha1/v1alpha1_sequencer_tasks.go`
//! `ReloadMeta`/`FlushMeta`).
//!
//! The kernel and initramfs do not depend on META (siderolabs/image-factory
//! `internal/profile/profile.go`), so every node with the same extensions
//! boots the same two files; only its script differs.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::digest::Sha256;
use crate::factory::{Factory, FactoryError};
use crate::fetch::{self, FetchError, FetchOptions, Progress};
use crate::inventory::{Inventory, NodeSpec, UnknownNode, talos_at_least};
use crate::meta::{self, CMDLINE_MAX, CmdlineError, KEY_NETWORK};
use crate::schematic::{self, EmitError, SchematicId};

/// Why boot media could not be made; each names the node or file.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error(transparent)]
    UnknownNode(#[from] UnknownNode),
    #[error("node {node}: no mac in the inventory; a PXE boot finds its script by the MAC address")]
    NoMac { node: String },
    #[error(
        "Talos {version} reads META from the kernel command line only at install; v1.5 or later applies it before (maintenance mode would have no network)"
    )]
    TooOld { version: String },
    #[error("node {node}: {source}")]
    Meta {
        node: String,
        #[source]
        source: CmdlineError,
    },
    #[error(
        "node {node}: the kernel command line is {len} bytes, over the kernel's limit of {CMDLINE_MAX}"
    )]
    CmdlineTooLong { node: String, len: usize },
    #[error(
        "node {node}: PXE with Secure Boot would boot the factory's signed UKI, and systemd-stub ignores a command line passed to a signed UKI under Secure Boot, so the node's META (its address) would never arrive; imgbuild does not hand out a script that boots without it. Ways out: the Secure Boot disk image (image.format raw or qcow2, META patched per node); the factory's own Secure Boot ISO with --route factory (an explicit opt-in: the factory learns the addresses); or dhcp: true on the node"
    )]
    SecureBoot { node: String },
    #[error("--url {0:?} is not a plain http(s) URL (no query, fragment, spaces or quotes)")]
    BadUrl(String),
    /// The factory's command line holds a word iPXE or the kernel would not
    /// read as one argument (a command separator, a comment, an expansion),
    /// or a META of its own: written into a script, it could run commands
    /// or drop the node's META.
    #[error("node {node}: the factory's command line for schematic {schematic}: {refused}")]
    Script {
        node: String,
        schematic: SchematicId,
        refused: crate::bootscript::Refused,
    },
    #[error(transparent)]
    Emit(#[from] EmitError),
    #[error(transparent)]
    Factory(#[from] FactoryError),
    #[error(transparent)]
    Fetch(#[from] FetchError),
    #[error("{}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// What `imgbuild pxe` makes, and where.
#[derive(Clone)]
pub struct PxeOptions {
    /// The folder an HTTP server serves.
    pub out_dir: PathBuf,
    /// Where that folder is served; without it every URL is relative to the
    /// script that names it, which iPXE resolves against the script's own URL.
    pub url: Option<String>,
    pub fetch: FetchOptions,
}

/// One file of the served folder.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ServedFile {
    /// Relative to the out dir.
    pub path: PathBuf,
    pub sha256: Sha256,
    pub size: u64,
    /// False when the file already held these bytes.
    pub written: bool,
}

/// The kernel, initramfs and base command line of one base schematic.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BaseAssets {
    pub schematic: SchematicId,
    pub kernel: ServedFile,
    pub initramfs: ServedFile,
    /// The factory's command line for the schematic, without any META.
    pub cmdline: String,
}

/// One node's script.
#[derive(Debug, Clone, serde::Serialize)]
pub struct NodeScript {
    pub node: String,
    pub mac: String,
    pub script: ServedFile,
    /// The base schematic whose kernel and initramfs it boots.
    pub schematic: SchematicId,
    /// Length of the kernel command line, of at most [`CMDLINE_MAX`].
    pub cmdline_bytes: usize,
}

/// What [`pxe`] left in the out dir.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PxeReport {
    pub out_dir: PathBuf,
    pub boot: ServedFile,
    pub assets: Vec<BaseAssets>,
    pub nodes: Vec<NodeScript>,
}

/// The file name iPXE's `${netX/mac:hexhyp}` gives a MAC: lowercase hex
/// pairs joined by hyphens.
pub fn mac_hexhyp(mac: &str) -> String {
    mac.to_ascii_lowercase().replace(':', "-")
}

/// The script every machine boots first: it chains the script named after
/// the MAC of the device it booted from (`netX`, the last opened network
/// device; `net0` is the first NIC, which a machine booting from its second
/// port would not be: matchbox #410/#415), and says so plainly when there
/// is none.
pub fn boot_script(nodes: &[(String, String)]) -> String {
    let mut known = String::new();
    for (node, mac) in nodes {
        known.push_str(&format!("#   {mac}  {node}\n"));
    }
    format!(
        "#!ipxe\n\
         # imgbuild: each machine chains nodes/<its MAC>.ipxe. Known machines:\n\
         {known}\
         chain --autofree nodes/${{netX/mac:hexhyp}}.ipxe || goto unknown\n\
         :unknown\n\
         echo imgbuild: no Talos node has the MAC ${{netX/mac}} (no nodes/${{netX/mac:hexhyp}}.ipxe).\n\
         echo Add it as a node's mac in the inventory and run imgbuild pxe again.\n\
         sleep 10\n\
         exit 1\n"
    )
}

/// A node's script, in the shape of the factory's own
/// (siderolabs/image-factory `internal/frontend/http/pxe.go`): its kernel
/// line is the kernel URL and `args`, each one iPXE word
/// ([`crate::bootscript::ipxe_line`]). `node` is a DNS label (the inventory
/// checks it), the URLs are plain (checked in [`pxe`]).
pub fn node_script(
    node: &str,
    kernel: &str,
    initramfs: &str,
    args: &[&str],
) -> Result<String, crate::bootscript::Refused> {
    let mut line = vec!["kernel", kernel];
    line.extend_from_slice(args);
    let kernel_line = crate::bootscript::ipxe_line(&line)?;
    let initrd = crate::bootscript::ipxe_line(&["initrd", initramfs])?;
    Ok(format!(
        "#!ipxe\n# imgbuild: Talos node {node}\nimgfree\n{kernel_line}\n{initrd}\nboot\n"
    ))
}

/// The kernel's arguments: the factory's command line for the base
/// schematic, each word checked ([`crate::bootscript::split_cmdline`]: no
/// separator, comment, expansion, quote or META of its own), then `node`'s
/// META as one more argument.
pub fn node_cmdline<'a>(
    base: &'a str,
    meta_arg: Option<&'a str>,
) -> Result<Vec<&'a str>, crate::bootscript::Refused> {
    let mut args = crate::bootscript::split_cmdline(base)?;
    args.extend(meta_arg);
    Ok(args)
}

/// `node`'s META as one kernel argument, encoded for the inventory's Talos
/// version; `None` off the metal platform (nothing else reads key 10).
pub fn meta_arg(inv: &Inventory, node: &NodeSpec) -> Result<Option<String>, BootError> {
    let Some(value) = schematic::node::network_value(inv, node) else {
        return Ok(None);
    };
    let gzip = talos_at_least(&inv.cluster.talos_version, (1, 6, 3));
    meta::environment_arg(&[(KEY_NETWORK, &value)], gzip)
        .map(Some)
        .map_err(|source| BootError::Meta {
            node: node.name.clone(),
            source,
        })
}

/// Writes the PXE folder for `nodes` (all when empty): `boot.ipxe`,
/// `nodes/<mac>.ipxe` per node and `assets/<schematic>/<version>/` per
/// distinct base schematic. Only base schematics reach the factory.
pub fn pxe(
    inv: &Inventory,
    nodes: &[String],
    opts: &PxeOptions,
    progress: &dyn Progress,
) -> Result<PxeReport, BootError> {
    // The URL lands in iPXE script lines: one plain URL, nothing iPXE or
    // a shell would split or expand.
    if let Some(url) = &opts.url
        && !(crate::inventory::is_http_url(url)
            && reqwest::Url::parse(url)
                .is_ok_and(|u| u.query().is_none() && u.fragment().is_none())
            && !url.contains(|c: char| {
                c.is_whitespace() || c.is_control() || matches!(c, '"' | '\'' | '$' | '\\')
            }))
    {
        return Err(BootError::BadUrl(url.clone()));
    }
    let version = &inv.cluster.talos_version;
    if !talos_at_least(version, (1, 5, 0)) {
        return Err(BootError::TooOld {
            version: version.clone(),
        });
    }
    let selected = inv.select(nodes)?;
    // Everything that can be refused is refused before any download.
    // The inventory refuses a MAC used twice, so each script is one node's.
    let mut planned = Vec::new();
    for node in &selected {
        let mac = node.mac.as_ref().ok_or_else(|| BootError::NoMac {
            node: node.name.clone(),
        })?;
        if inv.secure_boot(node) {
            return Err(BootError::SecureBoot {
                node: node.name.clone(),
            });
        }
        let mac = mac.to_string();
        let base = schematic::node::base_for_node(inv, node);
        let id = schematic::id_of(&base.canonical()?);
        planned.push((*node, mac, base, id, meta_arg(inv, node)?));
    }
    let client = fetch::client(&opts.fetch);
    let factory = Factory::new(&inv.image.factory, &client).with_retry(opts.fetch.retry_policy());
    let arch = inv.image.arch.to_string();
    let mut assets: BTreeMap<SchematicId, BaseAssets> = BTreeMap::new();
    for (_, _, base, id, _) in &planned {
        if assets.contains_key(id) {
            continue;
        }
        factory.register(base)?;
        let cmdline = factory.cmdline(id, version, &inv.image.platform, &arch)?;
        let dir = Path::new("assets").join(id.as_str()).join(version);
        let served = |file: String| -> Result<ServedFile, BootError> {
            let art = fetch::fetch(
                &client,
                &factory.asset_url(id, version, &file),
                None,
                &opts.fetch,
                progress,
            )?;
            let path = dir.join(&file);
            let written = place(&art.path, art.sha256, &opts.out_dir.join(&path))?;
            Ok(ServedFile {
                path,
                sha256: art.sha256,
                size: art.size,
                written,
            })
        };
        let kernel = served(format!("kernel-{arch}"))?;
        let initramfs = served(format!("initramfs-{arch}.xz"))?;
        assets.insert(
            id.clone(),
            BaseAssets {
                schematic: id.clone(),
                kernel,
                initramfs,
                cmdline,
            },
        );
    }
    let url_of = |path: &Path| match &opts.url {
        Some(base) => format!("{}/{}", base.trim_end_matches('/'), path.display()),
        None => format!("../{}", path.display()),
    };
    let mut scripts = Vec::new();
    for (node, mac, _, id, arg) in &planned {
        let a = &assets[id];
        let refused = |refused| BootError::Script {
            node: node.name.clone(),
            schematic: id.clone(),
            refused,
        };
        let args = node_cmdline(&a.cmdline, arg.as_deref()).map_err(refused)?;
        let cmdline = args.join(" ");
        if cmdline.len() > CMDLINE_MAX {
            return Err(BootError::CmdlineTooLong {
                node: node.name.clone(),
                len: cmdline.len(),
            });
        }
        let text = node_script(
            &node.name,
            &url_of(&a.kernel.path),
            &url_of(&a.initramfs.path),
            &args,
        )
        .map_err(refused)?;
        let path = Path::new("nodes").join(format!("{}.ipxe", mac_hexhyp(mac)));
        scripts.push(NodeScript {
            node: node.name.clone(),
            mac: mac.clone(),
            script: write_text(&opts.out_dir, &path, &text)?,
            schematic: id.clone(),
            cmdline_bytes: cmdline.len(),
        });
    }
    let known: Vec<(String, String)> = inv
        .nodes
        .iter()
        .filter_map(|n| n.mac.as_ref().map(|m| (n.name.clone(), m.to_string())))
        .collect();
    let boot = write_text(&opts.out_dir, Path::new("boot.ipxe"), &boot_script(&known))?;
    Ok(PxeReport {
        out_dir: opts.out_dir.clone(),
        boot,
        assets: assets.into_values().collect(),
        nodes: scripts,
    })
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> BootError + '_ {
    move |source| BootError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Writes a script (atomically, only when it changed).
fn write_text(out_dir: &Path, rel: &Path, text: &str) -> Result<ServedFile, BootError> {
    let path = out_dir.join(rel);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(io_err(parent))?;
    }
    let written =
        crate::atomic::write_if_changed(&path, text.as_bytes(), false).map_err(io_err(&path))?;
    let (sha256, size) = crate::io::sha256_of(text.as_bytes()).map_err(io_err(&path))?;
    Ok(ServedFile {
        path: rel.to_owned(),
        sha256,
        size,
        written,
    })
}

/// Copies a verified cache file to `to` unless `to` already holds it.
fn place(from: &Path, sha256: Sha256, to: &Path) -> Result<bool, BootError> {
    if let Ok(f) = std::fs::File::open(to)
        && crate::io::sha256_of(f).is_ok_and(|(have, _)| have == sha256)
    {
        return Ok(false);
    }
    if let Some(parent) = to.parent() {
        std::fs::create_dir_all(parent).map_err(io_err(parent))?;
    }
    let src = std::fs::File::open(from).map_err(io_err(from))?;
    let mut tmp = crate::atomic::AtomicFile::create(to, false).map_err(io_err(to))?;
    crate::io::copy_sparse(&src, tmp.file()).map_err(io_err(to))?;
    tmp.commit().map_err(io_err(to))?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_are_named_as_ipxe_spells_them() {
        assert_eq!(mac_hexhyp("BC:24:11:00:00:2A"), "bc-24-11-00-00-2a");
    }

    #[test]
    fn the_boot_script_chains_by_mac_and_explains_an_unknown_one() {
        let s = boot_script(&[("cp-01".into(), "bc:24:11:00:00:11".into())]);
        assert!(s.starts_with("#!ipxe\n"), "{s}");
        assert!(
            s.contains("chain --autofree nodes/${netX/mac:hexhyp}.ipxe || goto unknown"),
            "{s}"
        );
        assert!(s.contains("bc:24:11:00:00:11  cp-01"), "{s}");
        let after = s.split(":unknown\n").nth(1).unwrap();
        assert!(
            after.contains("echo imgbuild: no Talos node has the MAC"),
            "{s}"
        );
        assert!(after.trim_end().ends_with("exit 1"), "{s}");
    }

    #[test]
    fn a_node_script_boots_the_kernel_with_its_command_line() {
        let s = node_script("w1", "../k", "../i.xz", &["talos.platform=metal", "x=1"]).unwrap();
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines[0], "#!ipxe");
        assert!(
            lines.contains(&"kernel ../k talos.platform=metal x=1"),
            "{s}"
        );
        assert!(lines.contains(&"initrd ../i.xz"), "{s}");
        assert_eq!(lines.last(), Some(&"boot"));
        assert_eq!(node_cmdline("a  b", Some("c")).unwrap(), ["a", "b", "c"]);
        assert_eq!(node_cmdline("a b", None).unwrap(), ["a", "b"]);
    }

    /// What iPXE runs for a node script: exactly imgfree, the kernel with
    /// the factory's arguments and META last, initrd, boot.
    fn commands(base: &str) -> Result<Vec<Vec<String>>, crate::bootscript::Refused> {
        let meta = "talos.environment=INSTALLER_META_BASE64=AAAA";
        let args = node_cmdline(base, Some(meta))?;
        let s = node_script("w1", "../k", "../i.xz", &args)?;
        Ok(crate::bootscript::ipxe_read(&s))
    }

    #[test]
    fn factory_text_never_becomes_an_ipxe_command_or_drops_meta() {
        let ok = commands("talos.platform=metal console=ttyS0").unwrap();
        assert_eq!(ok.len(), 4, "{ok:?}");
        assert_eq!(
            ok[1],
            [
                "kernel",
                "../k",
                "talos.platform=metal",
                "console=ttyS0",
                "talos.environment=INSTALLER_META_BASE64=AAAA"
            ]
        );
        for hostile in [
            "a ; chain http://127.0.0.1/evil.ipxe",
            "a && shell",
            "a || shell ||",
            "a #",
            "a ;",
            "a ${net0/mac}",
            "a talos.environment=INSTALLER_META_BASE64=BBBB",
            "a x\\",
        ] {
            let e = commands(hostile).unwrap_err();
            assert!(!e.why.is_empty(), "{hostile:?}");
        }
    }
}
