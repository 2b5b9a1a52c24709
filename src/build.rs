//! The per-node image pipeline. Two routes end in the same place,
//! `<out>/<node>.<fmt>` plus a line in `<out>/manifest.json`:
//! - patch (default): the node's base schematic (no META) → one cached base
//!   image → a sparse copy with the node's key 10 written;
//! - factory: the node's own schematic → the factory's image for it.

use crate::disk::{self, DiskError};
use crate::factory::{Factory, FactoryError};
use crate::fetch::{self, FetchError, FetchOptions, Progress};
use crate::inventory::{ImageFormat, Inventory, NodeSpec};
use crate::meta::KEY_NETWORK;
use crate::schematic::{self, SchematicId};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
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
    pub format: ImageFormat,
    pub size: u64,
    pub sha256: String,
    pub path: PathBuf,
    /// Where the bytes came from.
    pub source_url: String,
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

    /// The manifest in `out_dir`, or an empty one.
    pub fn load(out_dir: &Path) -> Result<Manifest, BuildError> {
        let path = Self::path(out_dir);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| BuildError::Manifest {
                path,
                message: e.to_string(),
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Manifest::default()),
            Err(e) => Err(BuildError::Io { path, source: e }),
        }
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
    /// Overrides `image.factory` (e.g. a local simulator).
    pub factory: Option<String>,
}

/// What happened to one node.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Outcome {
    #[serde(flatten)]
    pub image: NodeImage,
    /// False when the image on disk already matched and nothing was done.
    pub built: bool,
}

/// Why a build failed; node-level failures name the node.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("node {node}")]
    Node {
        node: String,
        #[source]
        source: Box<BuildError>,
    },
    #[error(transparent)]
    UnknownNode(#[from] crate::inventory::UnknownNode),
    #[error(transparent)]
    Factory(#[from] FactoryError),
    #[error(transparent)]
    Fetch(#[from] FetchError),
    #[error(transparent)]
    Disk(#[from] DiskError),
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
    }
}

fn out_name(node: &str, format: ImageFormat) -> String {
    match format {
        ImageFormat::Raw => format!("{node}.raw"),
        ImageFormat::Qcow2 => format!("{node}.qcow2"),
    }
}

/// The IDs a node's image would be built from, computed offline.
struct Plan<'a> {
    node: &'a NodeSpec,
    schematic_id: SchematicId,
    base_schematic_id: Option<SchematicId>,
    path: PathBuf,
}

/// Builds `nodes` (all when empty), skipping those whose image is current.
pub fn build(
    inv: &Inventory,
    nodes: &[String],
    opts: &BuildOptions,
    progress: &dyn Progress,
) -> Result<Vec<Outcome>, BuildError> {
    let selected: Vec<&NodeSpec> = if nodes.is_empty() {
        inv.nodes.iter().collect()
    } else {
        nodes
            .iter()
            .map(|n| inv.node(n))
            .collect::<Result<_, _>>()?
    };
    std::fs::create_dir_all(&opts.out_dir).map_err(|source| BuildError::Io {
        path: opts.out_dir.clone(),
        source,
    })?;
    let mut manifest = Manifest::load(&opts.out_dir)?;
    let format = inv.image.format;
    let mut plans = Vec::new();
    for node in selected {
        let own = schematic::for_node(inv, node);
        let schematic_id = own.id().map_err(FactoryError::from)?;
        let base_schematic_id = match opts.route {
            Route::Patch => Some(
                schematic::base_for_node(inv, node)
                    .id()
                    .map_err(FactoryError::from)?,
            ),
            Route::Factory => None,
        };
        plans.push(Plan {
            node,
            schematic_id,
            base_schematic_id,
            path: opts.out_dir.join(out_name(&node.name, format)),
        });
    }
    let current = |p: &Plan| {
        manifest.images.get(&p.node.name).filter(|m| {
            m.route == opts.route
                && m.schematic_id == p.schematic_id
                && m.base_schematic_id == p.base_schematic_id
                && m.talos_version == inv.cluster.talos_version
                && m.format == format
                && m.path == p.path
                && std::fs::metadata(&m.path).is_ok_and(|md| md.len() == m.size)
        })
    };
    let todo: Vec<&Plan> = plans.iter().filter(|p| current(p).is_none()).collect();
    let mut outcomes: BTreeMap<String, Outcome> = plans
        .iter()
        .filter_map(|p| {
            current(p).map(|m| {
                (
                    m.node.clone(),
                    Outcome {
                        image: m.clone(),
                        built: false,
                    },
                )
            })
        })
        .collect();
    if !todo.is_empty() {
        let client = fetch::client(&opts.fetch);
        let factory = Factory::new(
            opts.factory.as_deref().unwrap_or(&inv.image.factory),
            &client,
        )
        .with_retry(opts.fetch.retry_policy());
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
                        let r =
                            build_one(inv, plan, opts, &client, &factory, progress).map_err(|e| {
                                BuildError::Node {
                                    node: plan.node.name.clone(),
                                    source: Box::new(e),
                                }
                            });
                        results.lock().unwrap().push(r);
                    }
                });
            }
        });
        let mut first_error = None;
        for r in results.into_inner().unwrap() {
            match r {
                Ok(image) => {
                    manifest.images.insert(image.node.clone(), image.clone());
                    outcomes.insert(image.node.clone(), Outcome { image, built: true });
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        // Record what did succeed, even when another node failed.
        manifest.save(&opts.out_dir)?;
        if let Some(e) = first_error {
            return Err(e);
        }
    }
    Ok(plans
        .iter()
        .filter_map(|p| outcomes.remove(&p.node.name))
        .collect())
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
    let format = inv.image.format;
    let version = &inv.cluster.talos_version;
    let arch = inv.image.arch.to_string();
    let ext = factory_ext(format);
    let (source_url, sha256, size) = match opts.route {
        Route::Factory => {
            let id = factory.register(&schematic::for_node(inv, node))?;
            let url = factory.image_url(&id, version, &inv.image.platform, &arch, ext);
            let art = fetch::fetch(client, &url, None, &opts.fetch, progress)?;
            copy_out(&art.path, &plan.path)?;
            (url, art.sha256, art.size)
        }
        Route::Patch => {
            let id = factory.register(&schematic::base_for_node(inv, node))?;
            let url = factory.image_url(&id, version, &inv.image.platform, &arch, ext);
            let art = fetch::fetch(client, &url, None, &opts.fetch, progress)?;
            let edits: Vec<_> = schematic::network_value(inv, node)
                .map(|v| (u32::from(KEY_NETWORK), Some(v.into_bytes())))
                .into_iter()
                .collect();
            disk::write_patched_copy(&art.path, &plan.path, &edits)?;
            let (sha256, size) = hash_file(&plan.path)?;
            (url, sha256, size)
        }
    };
    Ok(NodeImage {
        node: node.name.clone(),
        route: opts.route,
        schematic_id: plan.schematic_id.clone(),
        base_schematic_id: plan.base_schematic_id.clone(),
        talos_version: version.clone(),
        format,
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
    disk::copy_sparse(&src, tmp.file()).map_err(io_err(to))?;
    tmp.commit().map_err(io_err(to))
}

/// Streams a file through SHA-256.
pub fn hash_file(path: &Path) -> Result<(String, u64), BuildError> {
    let io_err = |source| BuildError::Io {
        path: path.to_owned(),
        source,
    };
    let f = std::fs::File::open(path).map_err(io_err)?;
    let mut r = fetch::io::HashingReader::new(f, false);
    std::io::copy(&mut r, &mut std::io::sink()).map_err(io_err)?;
    let size = r.count();
    Ok((r.finish().0, size))
}

/// One manifest entry checked against the file on disk.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Verified {
    pub node: String,
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
            let problem = match hash_file(&m.path) {
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
                Ok(_) => None,
            };
            Verified {
                node: m.node.clone(),
                path: m.path.clone(),
                ok: problem.is_none(),
                problem,
            }
        })
        .collect())
}
