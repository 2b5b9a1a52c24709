//! The per-node image pipeline. Two routes end in the same place,
//! `<out>/<node>.<fmt>` plus a line in `<out>/manifest.json`:
//! - patch (default): the node's base schematic (no META) → one cached base
//!   image → a sparse copy with the node's key 10 written;
//! - factory: the node's own schematic → the factory's image for it.
//!
//! The manifest names images relative to the out dir, so `out`, `./out` and
//! its absolute path, from any working directory, mean the same images.

use crate::digest::Sha256;
use crate::disk::{self, DiskError};
use crate::factory::{Factory, FactoryError};
use crate::fetch::{self, FetchError, FetchOptions, Progress};
use crate::inventory::{Arch, ImageFormat, Inventory, NodeSpec};
use crate::schematic::{self, SchematicId};
use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};
use std::sync::Mutex;

/// How a node image is made.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Route {
    Patch,
    Factory,
}

/// One built image, as recorded in the manifest.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeImage {
    pub node: String,
    pub route: Route,
    /// The node's own schematic (with META key 10 on metal).
    pub schematic_id: SchematicId,
    /// The schematic of the image it was made from (patch route).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_schematic_id: Option<SchematicId>,
    pub talos_version: String,
    /// The inventory's image platform, which decides where the image can boot
    /// (and whether key 10 is read).
    pub platform: String,
    pub arch: Arch,
    pub format: ImageFormat,
    /// A Secure Boot image (`…-secureboot.*`): the firmware must boot it
    /// with Secure Boot keys it can enroll, and a TPM 2.0 for encryption.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub secure_boot: bool,
    pub size: u64,
    pub sha256: Sha256,
    /// Relative to the out dir (see [`NodeImage::file`]), so the out dir can
    /// be named any way, or moved.
    pub path: PathBuf,
    /// Where the bytes came from.
    pub source_url: String,
}

impl NodeImage {
    /// The image file in `out_dir`, however that is spelled.
    pub fn file(&self, out_dir: &Path) -> PathBuf {
        out_dir.join(&self.path)
    }
}

/// Digests only as imgbuild writes them and `sha256sum` prints them, 64
/// lowercase hex digits: another spelling (which [`Sha256`] would parse)
/// means a hand-edited manifest, refused by the entry it is in.
fn own_digests(doc: &serde_json::Value) -> Result<(), String> {
    let entries = doc.get("images").and_then(|i| i.as_object());
    for (key, image) in entries.into_iter().flatten() {
        if let Some(text) = image.get("sha256").and_then(|s| s.as_str())
            && !(text.len() == 64 && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
        {
            return Err(format!(
                "entry {key:?}: sha256 {text:?} is not 64 lowercase hex digits"
            ));
        }
    }
    Ok(())
}

/// `<out>/manifest.json`.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct Manifest {
    pub images: BTreeMap<String, NodeImage>,
}

impl Manifest {
    pub fn path(out_dir: &Path) -> PathBuf {
        out_dir.join("manifest.json")
    }

    /// The manifest in `out_dir`, or an empty one. A damaged or hand-edited
    /// one is an error naming the file and what is wrong with it.
    pub fn load(out_dir: &Path) -> Result<Manifest, BuildError> {
        let path = Self::path(out_dir);
        let bytes = match crate::input::read_text(&path, crate::input::MAX_TEXT_FILE) {
            Ok(text) => text.into_bytes(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Manifest::default()),
            Err(e) => return Err(BuildError::Io { path, source: e }),
        };
        let damaged = |message: String| BuildError::Manifest {
            path: path.clone(),
            message,
        };
        let doc: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|e| damaged(e.to_string()))?;
        own_digests(&doc).map_err(damaged)?;
        let manifest: Manifest =
            serde_json::from_slice(&bytes).map_err(|e| damaged(e.to_string()))?;
        manifest
            .check()
            .map_err(|message| BuildError::Manifest { path, message })?;
        Ok(manifest)
    }

    /// What serde cannot check: entries filed under their own node, paths
    /// that stay inside the out dir.
    fn check(&self) -> Result<(), String> {
        for (key, image) in &self.images {
            if *key != image.node {
                return Err(format!("entry {key:?} is for node {:?}", image.node));
            }
            let inside = image
                .path
                .components()
                .any(|c| matches!(c, Component::Normal(_)))
                && image
                    .path
                    .components()
                    .all(|c| matches!(c, Component::Normal(_) | Component::CurDir));
            if !inside {
                return Err(format!(
                    "entry {key:?}: path {:?} must be relative to the out dir, without '..'",
                    image.path
                ));
            }
        }
        Ok(())
    }

    /// Adds `images` to the manifest on disk. Under a lock, the file is read
    /// again and written with the additions, so two builds into one out dir
    /// both keep their entries.
    fn record(out_dir: &Path, images: Vec<NodeImage>) -> Result<(), BuildError> {
        let lock = out_dir.join(".manifest.lock");
        let _held = crate::atomic::lock(&lock).map_err(|source| BuildError::Io {
            path: lock.clone(),
            source,
        })?;
        let mut manifest = Self::load(out_dir)?;
        for image in images {
            manifest.images.insert(image.node.clone(), image);
        }
        manifest.save(out_dir)
    }

    fn save(&self, out_dir: &Path) -> Result<(), BuildError> {
        let path = Self::path(out_dir);
        let json = serde_json::to_vec_pretty(self).expect("plain data");
        crate::atomic::write_if_changed(&path, &json, false)
            .map(|_| ())
            .map_err(|source| BuildError::Io { path, source })
    }
}

/// What a build does.
#[derive(Clone)]
pub struct BuildOptions {
    pub out_dir: PathBuf,
    pub route: Route,
    pub fetch: FetchOptions,
    /// Nodes built at once.
    pub jobs: usize,
}

/// What a build did for one node: the image as the manifest records it,
/// and whether it was made now or already current.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BuildOutcome {
    #[serde(flatten)]
    pub image: NodeImage,
    /// The image file, under the out dir as it was given.
    pub file: PathBuf,
    /// False when the image on disk already matched and nothing was done.
    pub built: bool,
}

/// One node that could not be built, and why.
#[derive(Debug)]
pub struct NodeFailure {
    pub node: String,
    pub error: BuildError,
}

/// Why a build failed.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// Some nodes failed; every one is listed, and the others were built
    /// (or were current) and are in the manifest.
    #[error(
        "{} of {} nodes failed: {}",
        failed.len(),
        failed.len() + built.len(),
        failed.iter().map(|f| f.node.as_str()).collect::<Vec<_>>().join(", ")
    )]
    Incomplete {
        built: Vec<BuildOutcome>,
        failed: Vec<NodeFailure>,
    },
    #[error(transparent)]
    UnknownNode(#[from] crate::inventory::UnknownNode),
    #[error(transparent)]
    Factory(#[from] FactoryError),
    #[error(transparent)]
    Fetch(#[from] FetchError),
    #[error(transparent)]
    Disk(#[from] DiskError),
    #[error(transparent)]
    Iso(#[from] crate::iso::IsoError),
    #[error(transparent)]
    Boot(#[from] Box<crate::boot::BootError>),
    #[error("{}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: not a manifest imgbuild can read: {message}", path.display())]
    Manifest { path: PathBuf, message: String },
}

/// The file extension the factory serves for an output format.
fn factory_ext(format: ImageFormat) -> &'static str {
    match format {
        ImageFormat::Raw => "raw.zst",
        ImageFormat::Qcow2 => "qcow2",
        ImageFormat::Iso => "iso",
    }
}

fn out_name(node: &str, format: ImageFormat) -> String {
    match format {
        ImageFormat::Raw => format!("{node}.raw"),
        ImageFormat::Qcow2 => format!("{node}.qcow2"),
        ImageFormat::Iso => format!("{node}.iso"),
    }
}

/// The IDs a node's image would be built from, computed offline.
struct Plan<'a> {
    node: &'a NodeSpec,
    schematic_id: SchematicId,
    base_schematic_id: Option<SchematicId>,
    /// Relative to the out dir, as the manifest records it.
    path: PathBuf,
    /// `path` under the out dir as given.
    file: PathBuf,
}

/// The selected nodes (all when `nodes` is empty) with the IDs their
/// images would be built from, computed offline.
fn plan<'a>(
    inv: &'a Inventory,
    nodes: &[String],
    opts: &BuildOptions,
) -> Result<Vec<Plan<'a>>, BuildError> {
    let selected = inv.select(nodes)?;
    let mut plans = Vec::new();
    for node in selected {
        let own = schematic::node::for_node(inv, node);
        let schematic_id = own.id().map_err(FactoryError::from)?;
        let base_schematic_id = match opts.route {
            Route::Patch => Some(
                schematic::node::base_for_node(inv, node)
                    .id()
                    .map_err(FactoryError::from)?,
            ),
            Route::Factory => None,
        };
        let path = PathBuf::from(out_name(&node.name, inv.image.format));
        plans.push(Plan {
            node,
            schematic_id,
            base_schematic_id,
            file: opts.out_dir.join(&path),
            path,
        });
    }
    Ok(plans)
}

impl Plan<'_> {
    /// The manifest's image when it is what this plan would build and its
    /// file is still there: nothing to do.
    fn current<'m>(
        &self,
        inv: &Inventory,
        opts: &BuildOptions,
        manifest: &'m Manifest,
    ) -> Option<&'m NodeImage> {
        manifest.images.get(&self.node.name).filter(|m| {
            m.route == opts.route
                && m.schematic_id == self.schematic_id
                && m.base_schematic_id == self.base_schematic_id
                && m.talos_version == inv.cluster.talos_version
                && m.platform == inv.image.platform
                && m.arch == inv.arch(self.node)
                && m.format == inv.image.format
                && m.secure_boot == inv.secure_boot(self.node)
                && m.path == self.path
                && std::fs::metadata(&self.file).is_ok_and(|md| md.len() == m.size)
        })
    }
}

/// Each selected node (all when `nodes` is empty) with its image when the
/// one on disk is current, i.e. what [`build`] would skip. Reads the
/// manifest only: nothing is created, downloaded or sent (a dry run).
pub fn current_images(
    inv: &Inventory,
    nodes: &[String],
    opts: &BuildOptions,
) -> Result<Vec<(String, Option<NodeImage>)>, BuildError> {
    let manifest = Manifest::load(&opts.out_dir)?;
    Ok(plan(inv, nodes, opts)?
        .iter()
        .map(|p| {
            (
                p.node.name.clone(),
                p.current(inv, opts, &manifest).cloned(),
            )
        })
        .collect())
}

/// Builds `nodes` (all when empty), skipping those whose image is current.
/// When some nodes fail, the others are still built and recorded, and the
/// error ([`BuildError::Incomplete`]) lists every failure.
pub fn build(
    inv: &Inventory,
    nodes: &[String],
    opts: &BuildOptions,
    progress: &dyn Progress,
) -> Result<Vec<BuildOutcome>, BuildError> {
    let plans = plan(inv, nodes, opts)?;
    if inv.image.format == ImageFormat::Iso && opts.route == Route::Patch {
        let nodes: Vec<&NodeSpec> = plans.iter().map(|p| p.node).collect();
        crate::iso::check_secure_boot(inv, &nodes)?;
        crate::iso::check_patchable(&inv.cluster.talos_version, inv.image.bootloader)?;
    }
    std::fs::create_dir_all(&opts.out_dir).map_err(|source| BuildError::Io {
        path: opts.out_dir.clone(),
        source: match std::fs::metadata(&opts.out_dir) {
            Ok(m) if !m.is_dir() => std::io::Error::new(
                std::io::ErrorKind::NotADirectory,
                "the out dir is a file, not a folder",
            ),
            _ => source,
        },
    })?;
    // Gigabytes of images never belong in a commit.
    crate::secrets::protect::ignore_in_git(&opts.out_dir).map_err(|source| BuildError::Io {
        path: opts.out_dir.join(".gitignore"),
        source,
    })?;
    let manifest = Manifest::load(&opts.out_dir)?;
    let current = |p: &Plan| p.current(inv, opts, &manifest);
    let todo: Vec<&Plan> = plans.iter().filter(|p| current(p).is_none()).collect();
    let mut outcomes: BTreeMap<String, BuildOutcome> = plans
        .iter()
        .filter_map(|p| {
            current(p).map(|m| {
                (
                    m.node.clone(),
                    BuildOutcome {
                        image: m.clone(),
                        file: p.file.clone(),
                        built: false,
                    },
                )
            })
        })
        .collect();
    let mut failed = Vec::new();
    if !todo.is_empty() {
        let client = fetch::client(&opts.fetch);
        let factory =
            Factory::new(&inv.image.factory, &client).with_retry(opts.fetch.retry_policy());
        let mut wanted: Vec<String> = inv.image.extensions.clone();
        for p in &todo {
            wanted.extend(p.node.extensions.iter().cloned());
        }
        wanted.sort();
        wanted.dedup();
        factory.check_available(&inv.cluster.talos_version, &wanted)?;
        let queue = Mutex::new(todo.into_iter());
        let results = Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for _ in 0..opts.jobs.max(1) {
                s.spawn(|| {
                    loop {
                        let Some(plan) = queue.lock().unwrap().next() else {
                            break;
                        };
                        let r = build_one(inv, plan, opts, &client, &factory, progress)
                            .map(|image| BuildOutcome {
                                image,
                                file: plan.file.clone(),
                                built: true,
                            })
                            .map_err(|error| NodeFailure {
                                node: plan.node.name.clone(),
                                error,
                            });
                        results.lock().unwrap().push(r);
                    }
                });
            }
        });
        let mut images = Vec::new();
        for r in results.into_inner().unwrap() {
            match r {
                Ok(o) => {
                    images.push(o.image.clone());
                    outcomes.insert(o.image.node.clone(), o);
                }
                Err(f) => failed.push(f),
            }
        }
        // Record what did succeed, even when another node failed; when
        // nothing did, the manifest (or its absence) stays as it was.
        if !images.is_empty() {
            Manifest::record(&opts.out_dir, images)?;
        }
    }
    let built: Vec<BuildOutcome> = plans
        .iter()
        .filter_map(|p| outcomes.remove(&p.node.name))
        .collect();
    if failed.is_empty() {
        return Ok(built);
    }
    // In inventory order, whatever order the workers finished in.
    failed.sort_by_key(|f| plans.iter().position(|p| p.node.name == f.node));
    Err(BuildError::Incomplete { built, failed })
}

fn build_one(
    inv: &Inventory,
    plan: &Plan,
    opts: &BuildOptions,
    client: &reqwest::blocking::Client,
    factory: &Factory,
    progress: &dyn Progress,
) -> Result<NodeImage, BuildError> {
    let node = plan.node;
    let version = &inv.cluster.talos_version;
    let arch = inv.arch(node).to_string();
    let format = inv.image.format;
    let ext = factory_ext(format);
    let secure_boot = inv.secure_boot(node);
    let (source_url, sha256, size) = match opts.route {
        Route::Factory => {
            let id = factory.register(&schematic::node::for_node(inv, node))?;
            // The installer the node's config names is the META-less
            // schematic's (see `schematic::installer::installer_for`): the factory
            // serves installers only for schematics it was given.
            let base = schematic::node::base_for_node(inv, node);
            if base != schematic::node::for_node(inv, node) {
                factory.register(&base)?;
            }
            let url = factory.image_url(&id, version, &inv.image.platform, &arch, secure_boot, ext);
            let art = fetch::fetch(client, &url, None, &opts.fetch, progress)?;
            copy_out(&art.path, &plan.file)?;
            (url, art.sha256, art.size)
        }
        Route::Patch => {
            let id = factory.register(&schematic::node::base_for_node(inv, node))?;
            let url = factory.image_url(&id, version, &inv.image.platform, &arch, secure_boot, ext);
            let art = fetch::fetch(client, &url, None, &opts.fetch, progress)?;
            if format == ImageFormat::Iso {
                // Key 10 as PXE carries it; off metal nothing reads it and
                // the node's ISO is the base's.
                match crate::boot::meta_arg(inv, node).map_err(Box::new)? {
                    Some(arg) => {
                        crate::iso::write_node_iso(&art.path, &plan.file, &arg)?;
                    }
                    None => copy_out(&art.path, &plan.file)?,
                }
            } else {
                let edits: Vec<_> = schematic::node::network_value(inv, node)
                    .map(crate::meta::network_change)
                    .into_iter()
                    .collect();
                disk::write_patched_copy(&art.path, &plan.file, &edits)?;
            }
            let (sha256, size) = hash_file(&plan.file)?;
            (url, sha256, size)
        }
    };
    Ok(NodeImage {
        node: node.name.clone(),
        route: opts.route,
        schematic_id: plan.schematic_id.clone(),
        base_schematic_id: plan.base_schematic_id.clone(),
        talos_version: version.clone(),
        platform: inv.image.platform.clone(),
        arch: inv.arch(node),
        format,
        secure_boot,
        size,
        sha256,
        path: plan.path.clone(),
        source_url,
    })
}

/// Copies a cached artifact to its output name: sparse, atomic.
fn copy_out(from: &Path, to: &Path) -> Result<(), BuildError> {
    let io_err = |path: &Path| {
        let path = path.to_owned();
        move |source| BuildError::Io { path, source }
    };
    let src = std::fs::File::open(from).map_err(io_err(from))?;
    let mut tmp = crate::atomic::AtomicFile::create(to, false).map_err(io_err(to))?;
    crate::io::copy_sparse(&src, tmp.file()).map_err(io_err(to))?;
    tmp.commit().map_err(io_err(to))
}

/// Streams a file through SHA-256.
pub fn hash_file(path: &Path) -> Result<(Sha256, u64), BuildError> {
    let io_err = |source| BuildError::Io {
        path: path.to_owned(),
        source,
    };
    // A FIFO or a device in place of an image would never end.
    let f = crate::io::open_regular(path, false).map_err(io_err)?;
    crate::io::sha256_of(f).map_err(io_err)
}

/// What is wrong with a metal node's ISO beyond its bytes: a kernel menu
/// entry without the node's META, or with META that does not decode, or a
/// UKI (UEFI boot) whose baked-in command line has none.
fn iso_problem(file: &Path) -> Option<String> {
    let report = match crate::iso::inspect(file) {
        Ok(r) => r,
        Err(e) => return Some(e.to_string()),
    };
    let bad: Vec<String> = report
        .entries
        .iter()
        .filter_map(|e| match (&e.problem, e.meta.is_empty()) {
            (Some(p), _) => Some(format!("menu entry {:?}: {p}", e.entry.title)),
            (None, true) => Some(format!("menu entry {:?} carries no META", e.entry.title)),
            (None, false) => None,
        })
        .collect();
    if let Some(u) = report.ukis.iter().find(|u| !u.has_meta) {
        return Some(format!(
            "UEFI boots a UKI (at byte {}) whose command line carries no META",
            u.offset
        ));
    }
    (!bad.is_empty() || report.entries.is_empty()).then(|| {
        format!(
            "grub.cfg: {}",
            if bad.is_empty() {
                "no kernel menu entry".to_owned()
            } else {
                bad.join("; ")
            }
        )
    })
}

/// One manifest entry checked against the file on disk.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Verified {
    pub node: String,
    /// The image file, under the out dir as it was given.
    pub path: PathBuf,
    pub ok: bool,
    pub problem: Option<String>,
}

/// Re-hashes every image in the manifest.
pub fn verify(out_dir: &Path) -> Result<Vec<Verified>, BuildError> {
    let manifest = Manifest::load(out_dir)?;
    Ok(manifest
        .images
        .values()
        .map(|m| {
            let file = m.file(out_dir);
            let problem = match hash_file(&file) {
                Err(e) => Some(format!(
                    "{e}: {}",
                    std::error::Error::source(&e)
                        .map(|s| s.to_string())
                        .unwrap_or_default()
                )),
                Ok((_, size)) if size != m.size => {
                    Some(format!("size {size}, manifest says {}", m.size))
                }
                Ok((sha, _)) if sha != m.sha256 => {
                    Some(format!("sha256 {sha}, manifest says {}", m.sha256))
                }
                // A Secure Boot ISO (the factory route's opt-in) has no
                // grub.cfg: its META is signed into the UKI by the factory.
                Ok(_)
                    if m.format == ImageFormat::Iso && m.platform == "metal" && !m.secure_boot =>
                {
                    iso_problem(&file)
                }
                Ok(_) => None,
            };
            Verified {
                node: m.node.clone(),
                path: file,
                ok: problem.is_none(),
                problem,
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::{Value, json};

    fn entry() -> Value {
        json!({
            "node": "cp-01",
            "route": "patch",
            "schematicId": "a".repeat(64),
            "baseSchematicId": "b".repeat(64),
            "talosVersion": "v1.11.2",
            "platform": "metal",
            "arch": "amd64",
            "format": "raw",
            "size": 4096,
            "sha256": "c".repeat(64),
            "path": "cp-01.raw",
            "sourceUrl": "http://127.0.0.1:1/image/x/v1.11.2/metal-amd64.raw.zst",
        })
    }

    /// Writes `manifest` into a new out dir and loads it.
    fn load(manifest: &[u8]) -> (tempfile::TempDir, Result<Manifest, BuildError>) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(Manifest::path(dir.path()), manifest).unwrap();
        let loaded = Manifest::load(dir.path());
        (dir, loaded)
    }

    fn with_entry(e: Value) -> Vec<u8> {
        serde_json::to_vec(&json!({"images": {"cp-01": e}})).unwrap()
    }

    #[test]
    fn an_entry_resolves_against_the_out_dir_however_it_is_spelled() {
        let (_dir, m) = load(&with_entry(entry()));
        let image = &m.unwrap().images["cp-01"];
        assert_eq!(image.platform, "metal");
        assert_eq!(image.arch, Arch::Amd64);
        assert_eq!(image.file(Path::new("out")), Path::new("out/cp-01.raw"));
        assert_eq!(image.file(Path::new("./out")), Path::new("./out/cp-01.raw"));
        assert_eq!(
            image.file(Path::new("/srv/out")),
            Path::new("/srv/out/cp-01.raw")
        );
    }

    /// The manifest as imgbuild has always written it (field order, digest
    /// spelling, indentation) loads and saves back byte for byte.
    #[test]
    fn a_manifest_is_saved_as_it_was_read() {
        let text = format!(
            r#"{{
  "images": {{
    "cp-01": {{
      "node": "cp-01",
      "route": "patch",
      "schematicId": "{a}",
      "baseSchematicId": "{b}",
      "talosVersion": "v1.11.2",
      "platform": "metal",
      "arch": "amd64",
      "format": "raw",
      "size": 4096,
      "sha256": "{c}",
      "path": "cp-01.raw",
      "sourceUrl": "http://127.0.0.1:1/image/x/v1.11.2/metal-amd64.raw.zst"
    }}
  }}
}}"#,
            a = "a".repeat(64),
            b = "b".repeat(64),
            c = "0123456789abcdef".repeat(4),
        );
        let (dir, loaded) = load(text.as_bytes());
        loaded.unwrap().save(dir.path()).unwrap();
        assert_eq!(
            std::fs::read_to_string(Manifest::path(dir.path())).unwrap(),
            text
        );
    }

    /// Spellings the digest type parses elsewhere (pins, fingerprints)
    /// are not what imgbuild writes: in a manifest they mean a hand edit.
    #[test]
    fn a_manifest_digest_in_another_spelling_is_refused() {
        let digest: crate::digest::Sha256 = "ab".repeat(32).parse().unwrap();
        for spelling in [digest.hex().to_uppercase(), digest.colons()] {
            let mut e = entry();
            e["sha256"] = json!(spelling);
            let (_dir, loaded) = load(&with_entry(e));
            let err = loaded.unwrap_err().to_string();
            let want =
                format!("entry \"cp-01\": sha256 {spelling:?} is not 64 lowercase hex digits");
            assert!(err.contains(&want), "{err}");
        }
    }

    #[test]
    fn a_missing_manifest_is_an_empty_one() {
        let dir = tempfile::tempdir().unwrap();
        assert!(Manifest::load(dir.path()).unwrap().images.is_empty());
    }

    #[test]
    fn damaged_or_hand_edited_manifests_are_errors_naming_the_file() {
        let mut absolute = entry();
        absolute["path"] = json!("/etc/passwd");
        let mut dotdot = entry();
        dotdot["path"] = json!("../elsewhere/cp-01.raw");
        let mut empty_path = entry();
        empty_path["path"] = json!("");
        let mut no_arch = entry();
        no_arch.as_object_mut().unwrap().remove("arch");
        let mut short_sha = entry();
        short_sha["sha256"] = json!("abc");
        let mut negative = entry();
        negative["size"] = json!(-1);
        let mut other_node = entry();
        other_node["node"] = json!("cp-02");
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (b"{\"images\": {".to_vec(), "EOF while parsing"),
            (b"".to_vec(), "EOF while parsing"),
            (b"42".to_vec(), "invalid type"),
            (b"{}".to_vec(), "missing field `images`"),
            (
                with_entry(absolute),
                "path \"/etc/passwd\" must be relative",
            ),
            (with_entry(dotdot), "without '..'"),
            (with_entry(empty_path), "path \"\" must be relative"),
            (with_entry(no_arch), "missing field `arch`"),
            (
                with_entry(short_sha),
                "sha256 \"abc\" is not 64 lowercase hex",
            ),
            (with_entry(negative), "invalid value: integer `-1`"),
            (
                with_entry(other_node),
                "entry \"cp-01\" is for node \"cp-02\"",
            ),
        ];
        for (bytes, want) in cases {
            let (dir, loaded) = load(&bytes);
            let err = loaded.unwrap_err().to_string();
            let file = Manifest::path(dir.path()).display().to_string();
            assert!(err.starts_with(&file), "{err}");
            assert!(err.contains(want), "want {want:?} in {err}");
        }
    }

    proptest::proptest! {
        #![proptest_config(crate::disk::fuzz::config())]

        /// `verify` over a manifest with mutated bytes and entries that point
        /// at crafted files (a FIFO, a directory, a truncated image).
        #[test]
        fn fuzz_verify_on_mutated_manifests(
            edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
            target in proptest::sample::select(vec!["cp-01.raw", "fifo", "dir", "../dual-boot.raw", "missing"]),
        ) {
            if crate::fuzz_time_left() {
                let dir = tempfile::tempdir().unwrap();
                let out = dir.path().join("out");
                std::fs::create_dir(&out).unwrap();
                let fixture = crate::disk::fuzz::fixtures().join("dual-boot.raw");
                std::fs::copy(fixture, out.join("cp-01.raw")).unwrap();
                std::fs::create_dir(out.join("dir")).unwrap();
                let fifo = std::ffi::CString::new(out.join("fifo").to_str().unwrap()).unwrap();
                // SAFETY: a valid NUL-terminated path.
                assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
                let entry = serde_json::json!({
                    "node": "cp-01", "route": "patch", "schematicId": "a".repeat(64),
                    "baseSchematicId": "b".repeat(64), "talosVersion": "v1.11.2",
                    "platform": "metal", "arch": "amd64", "format": "raw", "size": 4096,
                    "sha256": "c".repeat(64), "path": target,
                    "sourceUrl": "http://127.0.0.1:1/image/x/v1.11.2/metal-amd64.raw",
                });
                let mut bytes =
                    serde_json::to_vec(&serde_json::json!({"images": {"cp-01": entry}})).unwrap();
                for (at, byte) in edits {
                    let at = at.index(bytes.len());
                    bytes[at] = byte;
                }
                std::fs::write(Manifest::path(&out), &bytes).unwrap();
                if let Ok(results) = verify(&out) {
                    for r in results {
                        prop_assert!(!r.ok, "{r:?} cannot match a made-up sha256");
                    }
                }
            }
        }
    }
}
