//! Hetzner Cloud: one snapshot per distinct image, made without Packer by
//! writing the verified image through a temporary server's rescue system,
//! labelled so it can be selected exactly, and leaking nothing: the
//! temporary server and SSH key carry the run's label and are deleted on
//! every path. Facts: apricote/hcloud-upload-image v1.5
//! `hcloudimages/client.go`, hetznercloud/packer-plugin-hcloud
//! `builder/hcloud/step_create_snapshot.go`, hetznercloud/hcloud-go, and the
//! OpenAPI document (`sim/api-schemas/hetzner-cloud.openapi.json`).

pub mod api;
mod cleanup;
mod error;
pub mod prune;
pub mod rescue;
pub mod servers;
mod tally;
mod types;

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{Value, json};

use super::{Cancel, Secret};
use crate::digest::Sha256;
use crate::inventory::{Arch, HcloudSettings};
use crate::net::RetryPolicy;
pub use api::Api;
use cleanup::delete_run;
pub use cleanup::{cleanup, cleanup_candidates};
pub use error::HcloudError;
use rescue::Rescue;
pub use types::{Deleted, Event, Leftover, Observer, Quiet, SnapshotOptions};
use types::{MANAGED_BY, OWNER_LABEL, RUN_LABEL, STARTED_LABEL};

/// The API base when `HCLOUD_ENDPOINT` is not set.
pub const DEFAULT_ENDPOINT: &str = "https://api.hetzner.cloud/v1";

/// The system image the temporary server is created with; the rescue
/// system overwrites its disk, so any will do.
const BUILD_IMAGE: &str = "debian-13";

/// Where and as whom to reach the API: `HCLOUD_TOKEN` and
/// `HCLOUD_ENDPOINT`, as the hcloud CLI names them.
#[derive(Debug, Clone)]
pub struct Credentials {
    pub endpoint: String,
    pub token: Secret,
}

impl Credentials {
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<Credentials, HcloudError> {
        let token = env("HCLOUD_TOKEN")
            .filter(|t| !t.trim().is_empty())
            .ok_or_else(|| {
                HcloudError::Setup(
                    "HCLOUD_TOKEN is not set (an API token of the project, read & write)".into(),
                )
            })?;
        if token.contains(char::is_whitespace) {
            return Err(HcloudError::Setup(
                "HCLOUD_TOKEN contains whitespace (value not shown)".into(),
            ));
        }
        let endpoint = env("HCLOUD_ENDPOINT")
            .filter(|e| !e.trim().is_empty())
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_owned());
        // The value itself is never shown: it may carry a password or token.
        let url = crate::net::base_url(&endpoint).map_err(|e| {
            HcloudError::Setup(format!("HCLOUD_ENDPOINT {e}; e.g. {DEFAULT_ENDPOINT}"))
        })?;
        Ok(Credentials {
            endpoint: url.as_str().trim_end_matches('/').to_owned(),
            token: Secret::new(token),
        })
    }

    /// The API client, retrying as `retry` says: the one place it is built.
    pub fn api(&self, retry: RetryPolicy) -> Result<Api, HcloudError> {
        Api::new(&self.endpoint, self.token.clone(), retry)
    }
}

/// One distinct image to make a snapshot of (every node whose image has
/// these bytes shares it).
#[derive(Debug, Clone)]
pub struct SnapshotImage {
    pub path: PathBuf,
    pub sha256: Sha256,
    pub size: u64,
    pub schematic_id: String,
    pub talos_version: String,
    pub arch: Arch,
    pub nodes: Vec<String>,
}

impl SnapshotImage {
    /// The distinct images among `images` (each with its file): nodes whose
    /// images have the same bytes and architecture share one snapshot (hcloud images carry
    /// no per-node META, so usually every node shares one).
    pub fn distinct<'a>(
        images: impl IntoIterator<Item = (&'a crate::build::NodeImage, PathBuf)>,
    ) -> Vec<SnapshotImage> {
        // One snapshot per architecture even for equal bytes: a snapshot
        // has one architecture, and servers boot only their own.
        let mut by_sha: BTreeMap<(String, Sha256), SnapshotImage> = BTreeMap::new();
        for (image, path) in images {
            by_sha
                .entry((image.arch.to_string(), image.sha256))
                .or_insert_with(|| SnapshotImage {
                    path,
                    sha256: image.sha256,
                    size: image.size,
                    schematic_id: image.schematic_id.to_string(),
                    talos_version: image.talos_version.clone(),
                    arch: image.arch,
                    nodes: Vec::new(),
                })
                .nodes
                .push(image.node.clone());
        }
        by_sha.into_values().collect()
    }
}

/// What the nodes that share one snapshot have in common, known before
/// anything is built: architecture, Secure Boot and base schematic (hcloud
/// images carry no per-node META). Reports count a shared image once.
pub fn snapshot_key(
    inv: &crate::inventory::Inventory,
    node: &crate::inventory::NodeSpec,
) -> String {
    let schematic = crate::schematic::node::base_for_node(inv, node)
        .canonical()
        .map(|c| crate::schematic::id_of(&c).to_string())
        // Unknowable here: the node counts on its own.
        .unwrap_or_else(|_| format!("node {}", node.name));
    let secure_boot = if inv.secure_boot(node) {
        "-secureboot"
    } else {
        ""
    };
    format!("{}{secure_boot} {schematic}", inv.arch(node))
}

/// The labels that identify a snapshot's content: what Terraform selects
/// it by. Values are at most 63 characters, hence the 32-hex prefixes.
pub fn snapshot_labels(image: &SnapshotImage) -> BTreeMap<String, String> {
    let short = |s: &str| s.chars().take(32).collect::<String>();
    BTreeMap::from([
        ("os".to_owned(), "talos".to_owned()),
        ("talos-version".to_owned(), image.talos_version.clone()),
        ("talos-schematic".to_owned(), short(&image.schematic_id)),
        ("arch".to_owned(), image.arch.to_string()),
        ("image-sha256".to_owned(), short(&image.sha256.hex())),
    ])
}

/// The labels a new snapshot of `image` carries and a publish selects an
/// existing one by: its content's ([`snapshot_labels`]) and the
/// inventory's `publish.hcloud.labels`, which [`for_cluster`] gives the
/// cluster's own label. So a cluster reuses only a snapshot that is its
/// own: another cluster's may be pruned by that cluster once none of its
/// servers boots from it, and one without a cluster label is nobody's to
/// prune, so it would never go.
pub fn published_labels(
    image: &SnapshotImage,
    settings: &HcloudSettings,
) -> BTreeMap<String, String> {
    let mut labels = settings.labels.clone();
    // imgbuild's own win (validation refuses a clash anyway).
    labels.extend(snapshot_labels(image));
    labels
}

/// `settings` with the label that makes the snapshots published with them
/// `cluster`'s (`imgbuild-cluster=<cluster>`, the label its servers carry):
/// what `prune` deletes ([`prune::cluster_snapshots`]). The cluster's name
/// rather than an ID: it is what its servers are found by, a label value
/// is compared whole (no two names claim each other's), and it is known
/// wherever a publish or prune runs (the Talos cluster ID lives in the
/// secrets, which `publish` and `prune` need not open).
pub fn for_cluster(settings: &HcloudSettings, cluster: &str) -> HcloudSettings {
    let mut settings = settings.clone();
    settings
        .labels
        .insert(types::CLUSTER_LABEL.to_owned(), cluster.to_owned());
    settings
}

/// A label selector matching every label in `labels` exactly.
pub fn selector(labels: &BTreeMap<String, String>) -> String {
    labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// Hetzner's name for an architecture in server types and images.
fn api_arch(arch: Arch) -> &'static str {
    match arch {
        Arch::Amd64 => "x86",
        Arch::Arm64 => "arm",
    }
}

/// A finished snapshot.
#[derive(Debug, Clone, Serialize)]
pub struct Snapshot {
    pub id: u64,
    pub labels: BTreeMap<String, String>,
    /// False when a snapshot with these labels already existed.
    pub created: bool,
    pub description: String,
    pub sha256: Sha256,
    pub nodes: Vec<String>,
    /// Compressed bytes sent to the rescue system (0 when nothing was made).
    pub bytes_sent: u64,
    /// The disk (GB) it holds: servers made from it need at least this.
    #[serde(serialize_with = "gigabytes")]
    pub disk_size: f64,
}

/// A size in GB as the API writes it: `40`, not `40.0`, when whole.
fn gigabytes<S: serde::Serializer>(gb: &f64, s: S) -> Result<S::Ok, S::Error> {
    if gb.fract() == 0.0 && (0.0..1e15).contains(gb) {
        s.serialize_u64(*gb as u64)
    } else {
        s.serialize_f64(*gb)
    }
}

/// What a snapshot run left: its result, and anything it failed to delete
/// (empty unless the API refused every attempt).
#[derive(Debug)]
pub struct SnapshotOutcome {
    pub result: Result<Snapshot, HcloudError>,
    pub leftovers: Vec<Leftover>,
}

/// Makes (or finds) the snapshot of `image`. The temporary server and key
/// are deleted on every path, cancellation included; what could not be
/// deleted is in [`SnapshotOutcome::leftovers`].
fn publish_snapshot(
    api: &Api,
    settings: &HcloudSettings,
    image: &SnapshotImage,
    opts: &SnapshotOptions,
    cancel: &Cancel,
    observer: &dyn Observer,
) -> SnapshotOutcome {
    let labels = published_labels(image, settings);
    let found = build_types(api, settings, image.arch).and_then(|types| {
        let found = find_fitting(api, &labels, &types, observer)?;
        Ok((types, found))
    });
    let types = match found {
        Ok((_, Some((id, disk_size)))) => {
            observer.event(&Event::Found { id });
            return SnapshotOutcome {
                result: Ok(Snapshot {
                    id,
                    labels,
                    created: false,
                    description: description(image),
                    sha256: image.sha256,
                    nodes: image.nodes.clone(),
                    bytes_sent: 0,
                    disk_size,
                }),
                leftovers: Vec::new(),
            };
        }
        Ok((types, None)) => types,
        Err(e) => {
            return SnapshotOutcome {
                result: Err(e),
                leftovers: Vec::new(),
            };
        }
    };
    // Without `ssh` nothing can be written: said before anything is made.
    if let Err(e) = rescue::check_client() {
        return SnapshotOutcome {
            result: Err(e),
            leftovers: Vec::new(),
        };
    }
    // Before a run makes servers of its own, what a killed run before it
    // left goes (what cannot be deleted is reported as a leftover).
    let mut leftovers = cleanup::sweep_killed_runs(api, opts, observer);
    let run = run_id();
    let mut build = Build {
        api,
        settings,
        image,
        opts,
        cancel,
        observer,
        run: run.clone(),
        labels,
        types,
    };
    let result = build.make();
    leftovers.extend(delete_run(api, &run, opts, observer));
    SnapshotOutcome { result, leftovers }
}

/// Snapshots of `images`, one after another, each with its outcome. After
/// an interrupt the images not yet started are not started (their outcome
/// says so); the run under way has deleted what it made.
pub fn publish_snapshots(
    api: &Api,
    settings: &HcloudSettings,
    images: &[SnapshotImage],
    opts: &SnapshotOptions,
    cancel: &Cancel,
    observer: &dyn Observer,
) -> Vec<SnapshotOutcome> {
    let mut out = Vec::with_capacity(images.len());
    let mut interrupted = false;
    for image in images {
        if interrupted {
            out.push(SnapshotOutcome {
                result: Err(HcloudError::NotStarted),
                leftovers: Vec::new(),
            });
            continue;
        }
        let run = publish_snapshot(api, settings, image, opts, cancel, observer);
        interrupted |= matches!(run.result, Err(HcloudError::Interrupted));
        out.push(run);
    }
    out
}

fn description(image: &SnapshotImage) -> String {
    format!(
        "talos {} {} {}",
        image.talos_version, image.arch, image.schematic_id
    )
}

/// The snapshot `image` would be published as, if one exists: what
/// [`publish_snapshot`] would find, for a dry run.
pub fn find_snapshot(
    api: &Api,
    settings: &HcloudSettings,
    image: &SnapshotImage,
) -> Result<Option<u64>, HcloudError> {
    let types = build_types(api, settings, image.arch)?;
    let found = find_fitting(api, &published_labels(image, settings), &types, &Quiet)?;
    Ok(found.map(|(id, _)| id))
}

/// The newest available snapshot with `labels` whose disk fits the
/// smallest build type (the first; any when no type can build here): its
/// ID and `disk_size`. A larger one (made when only larger types could
/// build) is reported and passed over, so a snapshot that fits is made.
fn find_fitting(
    api: &Api,
    labels: &BTreeMap<String, String>,
    types: &BuildTypes,
    observer: &dyn Observer,
) -> Result<Option<(u64, f64)>, HcloudError> {
    let found = api.list(
        "/images",
        "images",
        &[
            ("type", "snapshot".into()),
            ("status", "available".into()),
            ("label_selector", selector(labels)),
            ("sort", "created:desc".into()),
        ],
    )?;
    for i in &found {
        let Some(id) = i["id"].as_u64() else {
            continue;
        };
        let disk_size = i["disk_size"].as_f64().unwrap_or(0.0);
        match types.usable.first() {
            Some(t) if disk_size > t.disk => observer.event(&Event::TooLarge {
                id,
                disk_size,
                server_type: t.name.clone(),
                disk: t.disk,
            }),
            _ => return Ok(Some((id, disk_size))),
        }
    }
    Ok(None)
}

/// A server type that can host a build here, and its disk (GB).
#[derive(Debug, Clone, PartialEq)]
struct BuildType {
    name: String,
    disk: f64,
}

/// The server types to build a snapshot of `arch` on, in the order to try
/// them: the inventory's `serverTypes`, else every type `GET /server_types`
/// lists for the architecture; those that cannot host it in the location
/// left out; the smallest `disk` first (a snapshot boots only on types with
/// at least its disk), equal disks in list order.
fn build_types(
    api: &Api,
    settings: &HcloudSettings,
    arch: Arch,
) -> Result<BuildTypes, HcloudError> {
    let types = api.list("/server_types", "server_types", &[])?;
    Ok(order_build_types(&types, settings, arch))
}

/// The build types to try, in order, and those passed over with why.
#[derive(Debug, Clone, Default, PartialEq)]
struct BuildTypes {
    usable: Vec<BuildType>,
    skipped: Vec<(String, String)>,
}

/// [`build_types`] on a listing.
fn order_build_types(types: &[Value], settings: &HcloudSettings, arch: Arch) -> BuildTypes {
    let names: Vec<String> = if settings.server_types.is_empty() {
        types
            .iter()
            .filter(|t| t["architecture"].as_str() == Some(api_arch(arch)))
            .filter_map(|t| t["name"].as_str().map(str::to_owned))
            .collect()
    } else {
        settings.server_types.clone()
    };
    let mut usable = Vec::new();
    let mut skipped = Vec::new();
    for name in names {
        match unsuitable(types, &name, &settings.location, arch) {
            Some(why) => skipped.push((name, why)),
            None => {
                let disk = types
                    .iter()
                    .find(|t| t["name"] == name.as_str())
                    .and_then(|t| t["disk"].as_f64())
                    .unwrap_or(f64::INFINITY);
                usable.push(BuildType { name, disk });
            }
        }
    }
    // A stable sort: equal disks keep the list's order.
    usable.sort_by(|a, b| a.disk.total_cmp(&b.disk));
    BuildTypes { usable, skipped }
}

/// 64 random bits in hex: names and labels this run's temporary resources.
fn run_id() -> String {
    let mut b = [0u8; 8];
    aws_lc_rs::rand::fill(&mut b).expect("the system's random source");
    hex::encode(b)
}

/// The state of one snapshot run.
struct Build<'a> {
    api: &'a Api,
    settings: &'a HcloudSettings,
    image: &'a SnapshotImage,
    opts: &'a SnapshotOptions,
    cancel: &'a Cancel,
    observer: &'a dyn Observer,
    run: String,
    labels: BTreeMap<String, String>,
    /// The build types to try, in order ([`build_types`]).
    types: BuildTypes,
}

impl Build<'_> {
    fn temp_labels(&self) -> Value {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let mut labels = json!({
            MANAGED_BY.0: MANAGED_BY.1,
            RUN_LABEL: self.run,
            STARTED_LABEL: now.to_string(),
        });
        if let Some(owner) = cleanup::owner() {
            labels[OWNER_LABEL] = owner.into();
        }
        labels
    }

    fn wait(&self, reply: &Value, what: &str) -> Result<(), HcloudError> {
        let opts = self.opts;
        self.api
            .wait_reply(reply, what, opts.poll, opts.action_timeout, self.cancel)
    }

    fn make(&mut self) -> Result<Snapshot, HcloudError> {
        // The key lives in a private temp dir that goes with the run.
        let identity = rescue::Identity::new()?;
        let public = identity.public_line();
        self.cancel.check()?;
        let name = format!("imgbuild-{}", self.run);
        let reply = self.api.post(
            "/ssh_keys",
            &json!({"name": name, "public_key": public, "labels": self.temp_labels()}),
        )?;
        let key_id = id_of(&reply, "ssh_key", "POST /ssh_keys")?;
        self.observer.event(&Event::KeyCreated { id: key_id });

        let (server, type_disk) = self.create_server(&name, key_id)?;
        let server_id = server["id"].as_u64().ok_or_else(|| HcloudError::Reply {
            request: "POST /servers".into(),
            message: "no server.id in the reply".into(),
        })?;
        let path = format!("/servers/{server_id}");

        let reply = self.api.post(
            &format!("{path}/actions/enable_rescue"),
            &json!({"type": "linux64", "ssh_keys": [key_id]}),
        )?;
        self.wait(&reply, &format!("enable_rescue on server {server_id}"))?;
        let reply = self
            .api
            .post(&format!("{path}/actions/poweron"), &json!({}))?;
        self.wait(&reply, &format!("poweron of server {server_id}"))?;
        self.observer.event(&Event::RescueBooting { id: server_id });

        let ip: IpAddr = server
            .pointer("/public_net/ipv4/ip")
            .and_then(Value::as_str)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| HcloudError::Reply {
                request: "POST /servers".into(),
                message: format!("server {server_id} has no public IPv4 address"),
            })?;
        let addr = SocketAddr::new(ip, self.opts.ssh_port);
        let sent = self.write_disk(server_id, addr, &identity)?;
        drop(identity);

        let reply = self
            .api
            .post(&format!("{path}/actions/poweroff"), &json!({}))?;
        self.wait(&reply, &format!("poweroff of server {server_id}"))?;
        self.until(&format!("server {server_id} off"), || {
            let s = self.api.get(&path, &[])?;
            Ok(s.pointer("/server/status").and_then(Value::as_str) == Some("off"))
        })?;
        self.observer.event(&Event::PoweredOff);

        let labels = self.labels.clone();
        let description = description(self.image);
        self.observer.event(&Event::Snapshotting);
        let reply = self.api.post(
            &format!("{path}/actions/create_image"),
            &json!({"type": "snapshot", "description": description, "labels": labels}),
        )?;
        let image_id = id_of(&reply, "image", "create_image")?;
        let image_path = format!("/images/{image_id}");
        // The API's own record of the disk the snapshot holds.
        let mut disk_size = type_disk;
        let made = self
            .wait(&reply, &format!("create_image of server {server_id}"))
            .and_then(|()| {
                self.until_within(
                    &format!("snapshot {image_id} available"),
                    self.opts.image_timeout,
                    || {
                        let i = self.api.get(&image_path, &[])?;
                        if let Some(d) = i.pointer("/image/disk_size").and_then(Value::as_f64) {
                            disk_size = d;
                        }
                        Ok(i.pointer("/image/status").and_then(Value::as_str) == Some("available"))
                    },
                )
            });
        if let Err(e) = made {
            // A half-made snapshot is billed like a whole one and could be
            // picked by label: it goes too (gone already is fine).
            match self.api.delete(&image_path) {
                Ok(_) | Err(HcloudError::Api { status: 404, .. }) => {
                    self.observer.event(&Event::Deleted {
                        kind: "image",
                        id: image_id,
                    })
                }
                Err(d) => {
                    return Err(HcloudError::Remote(format!(
                        "{e}; and the unfinished snapshot {image_id} could not be deleted ({d}): delete it by hand"
                    )));
                }
            }
            return Err(e);
        }
        self.observer.event(&Event::SnapshotReady { id: image_id });
        Ok(Snapshot {
            id: image_id,
            labels,
            created: true,
            description,
            sha256: self.image.sha256,
            nodes: self.image.nodes.clone(),
            bytes_sent: sent,
            disk_size,
        })
    }

    /// The first build type ([`build_types`]) whose server can be created
    /// here: the created server's object and the type's disk (GB).
    fn create_server(&self, name: &str, key_id: u64) -> Result<(Value, f64), HcloudError> {
        let location = &self.settings.location;
        let mut tried = Vec::new();
        for (t, why) in &self.types.skipped {
            // Only the inventory's own choices are worth a line each.
            if !self.settings.server_types.is_empty() {
                self.observer.event(&Event::TypeSkipped {
                    server_type: t.clone(),
                    why: why.clone(),
                });
            }
            tried.push(format!("{t}: {why}"));
        }
        for BuildType { name: t, disk } in &self.types.usable {
            self.cancel.check()?;
            let body = json!({
                "name": name,
                "server_type": t,
                "image": BUILD_IMAGE,
                "location": location,
                "start_after_create": false,
                "ssh_keys": [key_id],
                "labels": self.temp_labels(),
            });
            match self.api.post("/servers", &body) {
                Ok(reply) => {
                    let server = reply["server"].clone();
                    let id = server["id"].as_u64().unwrap_or_default();
                    self.observer.event(&Event::ServerCreated {
                        id,
                        server_type: t.clone(),
                    });
                    self.wait(&reply, &format!("creating server {id}"))?;
                    return Ok((server, *disk));
                }
                Err(HcloudError::Api {
                    code: Some(code),
                    status,
                    body,
                    ..
                }) if matches!(
                    code.as_str(),
                    "resource_unavailable" | "placement_error" | "invalid_server_type"
                ) =>
                {
                    let why = format!("POST /servers: HTTP {status}: {body}");
                    self.observer.event(&Event::TypeSkipped {
                        server_type: t.clone(),
                        why: why.clone(),
                    });
                    tried.push(format!("{t}: {why}"));
                }
                Err(e) => return Err(e),
            }
        }
        Err(HcloudError::NoServerType {
            location: location.clone(),
            tried,
        })
    }

    /// Logs in to the rescue system with the run's `identity` and writes
    /// the image to its disk; the compressed bytes sent.
    fn write_disk(
        &self,
        server_id: u64,
        addr: SocketAddr,
        identity: &rescue::Identity,
    ) -> Result<u64, HcloudError> {
        let deadline = Instant::now() + self.opts.ssh_timeout;
        let image = self.image;
        let login = Rescue::connect(addr, &self.opts.ssh_user, identity, deadline, self.cancel);
        let session = login.map_err(|e| match e {
            HcloudError::Ssh(m) => HcloudError::Ssh(format!(
                "server {server_id}: no login within {:?} ({m})",
                self.opts.ssh_timeout
            )),
            e => e,
        })?;
        self.observer.event(&Event::Connected {
            addr,
            host_key: session.host_key.clone(),
        });
        let host = session.run("hostname")?;
        let name = host.stdout.trim();
        if host.status != Some(0) || name != "rescue" {
            return Err(HcloudError::Remote(format!(
                "server {server_id} at {addr} is not in its rescue system (hostname {name:?}): its disk is left alone"
            )));
        }
        let d = session.run(rescue::DISCARD)?;
        let supported = d.status == Some(0);
        if !supported && !rescue::discard_unsupported(&d.stderr) {
            return Err(remote_failure(rescue::DISCARD, &d));
        }
        self.observer.event(&Event::Discarded { supported });
        self.observer.event(&Event::Writing { size: image.size });
        let file = crate::io::open_regular(&image.path, false)
            .map_err(|e| HcloudError::Io(format!("opening {}: {e}", image.path.display())))?;
        let read = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let file = tally::Tally::new(file, read.clone());
        let hashing = crate::io::HashingReader::new(file, false);
        let mut encoder = zstd::stream::read::Encoder::new(hashing, self.opts.zstd_level)
            .map_err(|e| HcloudError::Io(format!("starting zstd: {e}")))?;
        if self.opts.zstd_threads > 1 {
            // Small jobs keep each worker's buffers (and so the
            // process's memory) small; zeros and random data gain
            // nothing from larger ones.
            encoder
                .multithread(self.opts.zstd_threads)
                .and_then(|()| encoder.set_parameter(zstd::zstd_safe::CParameter::JobSize(1 << 20)))
                .map_err(|e| HcloudError::Io(format!("zstd workers: {e}")))?;
        }
        let (encoder, mut marks) = tally::marked(encoder, read);
        let mut sent = 0u64;
        let (w, encoder) = session.exec(rescue::WRITE, Some(encoder), self.cancel, &mut |n| {
            let (image_bytes, wire) = marks.sent(n as u64);
            sent = wire;
            self.observer.sent(&image.nodes, image_bytes, wire);
        })?;
        if w.status != Some(0) {
            return Err(remote_failure(rescue::WRITE, &w));
        }
        let hashing = encoder
            .ok_or_else(|| HcloudError::Io("the image reader did not finish".into()))?
            .inner
            .finish()
            .into_inner();
        let read = hashing.count();
        let (sha, _) = hashing.finish();
        if read != image.size || sha != image.sha256 {
            return Err(HcloudError::Io(format!(
                "{} changed while it was sent ({read} bytes, sha256 {sha}; the manifest says {} bytes, {}): no snapshot is made",
                image.path.display(),
                image.size,
                image.sha256
            )));
        }
        match rescue::dd_bytes(&w.stderr) {
            Some(n) if n == image.size => {}
            other => {
                return Err(HcloudError::Remote(format!(
                    "dd on server {server_id} reported {} bytes written, the image has {}: no snapshot is made",
                    other.map_or("no count of".to_owned(), |n| n.to_string()),
                    image.size
                )));
            }
        }
        self.observer.event(&Event::Written {
            bytes: image.size,
            sent,
        });
        Ok(sent)
    }

    fn until(
        &self,
        what: &str,
        done: impl FnMut() -> Result<bool, HcloudError>,
    ) -> Result<(), HcloudError> {
        self.until_within(what, self.opts.action_timeout, done)
    }

    fn until_within(
        &self,
        what: &str,
        timeout: Duration,
        mut done: impl FnMut() -> Result<bool, HcloudError>,
    ) -> Result<(), HcloudError> {
        let deadline = Instant::now() + timeout;
        while !done()? {
            if Instant::now() >= deadline {
                return Err(HcloudError::Timeout {
                    what: what.to_owned(),
                    after: timeout,
                });
            }
            self.cancel.sleep(self.opts.poll)?;
        }
        Ok(())
    }
}

fn remote_failure(command: &str, e: &rescue::Exec) -> HcloudError {
    let tail: Vec<&str> = e.stderr.trim().lines().rev().take(5).collect();
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    HcloudError::Remote(format!(
        "{command:?} on the rescue system exited with {}: {}",
        e.status
            .map_or("no exit status".to_owned(), |s| format!("status {s}")),
        if tail.is_empty() {
            "(no output)".to_owned()
        } else {
            tail.join(" | ")
        }
    ))
}

/// `reply[key].id`, or an error naming the request.
fn id_of(reply: &Value, key: &str, request: &str) -> Result<u64, HcloudError> {
    reply
        .get(key)
        .and_then(|o| o.get("id"))
        .and_then(Value::as_u64)
        .ok_or_else(|| HcloudError::Reply {
            request: request.to_owned(),
            message: format!("no {key}.id in the reply"),
        })
}

/// Why server type `name` cannot host the build here, if it cannot: not
/// listed, another architecture, deprecated, or not offered in `location`.
pub fn unsuitable(types: &[Value], name: &str, location: &str, arch: Arch) -> Option<String> {
    let Some(t) = types.iter().find(|t| t["name"] == name) else {
        return Some("no such server type".into());
    };
    if t["architecture"].as_str() != Some(api_arch(arch)) {
        return Some(format!(
            "its architecture is {}, the image's {arch}",
            t["architecture"].as_str().unwrap_or("unknown")
        ));
    }
    if t["deprecation"].is_object() || t["deprecated"] == true {
        return Some("deprecated".into());
    }
    let Some(locations) = t["locations"].as_array() else {
        return None; // an older answer without per-location data: try it
    };
    match locations.iter().find(|l| l["name"] == location) {
        None => Some(format!("not offered in {location}")),
        Some(l) if !l["deprecation"].is_null() => Some(format!("deprecated in {location}")),
        Some(l) if l["available"] == false => Some(format!("unavailable in {location}")),
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests;
