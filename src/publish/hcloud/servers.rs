//! The cluster's own servers: one per node, created from the snapshot with
//! the node's machine config as `user_data` (Talos on Hetzner reads it from
//! there, so no maintenance-mode apply is needed), labelled with the cluster
//! and the node so a rerun finds and reuses them and `imgbuild down` can
//! delete them. They never carry a run label: `imgbuild cleanup` leaves
//! them alone. Facts: the OpenAPI document
//! (`sim/api-schemas/hetzner-cloud.openapi.json`: `user_data` ≤ 32 KiB,
//! `attach_to_network`).

use std::collections::BTreeMap;
use std::io::Write;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::Credentials;
use super::api::Api;
use super::cleanup::delete_selected;
use super::error::HcloudError;
pub use super::error::USER_DATA_MAX;
use super::types::{Deleted, Leftover, MANAGED_BY, Quiet, RUN_LABEL, SnapshotOptions};
use crate::inventory::{HcloudSettings, Inventory};
use crate::net::RetryPolicy;
use crate::publish::Cancel;

pub use super::types::CLUSTER_LABEL;
pub const NODE_LABEL: &str = "imgbuild-node";

/// The first Talos release whose hcloud platform decodes base64
/// `user_data` (siderolabs/talos commit ccbd5aed, "optionally decode
/// hcloud userdata as base64").
const BASE64_SINCE: (u32, u32) = (1, 9);

/// What a node's `user_data` holds: its machine config as it is when that
/// fits in [`USER_DATA_MAX`]; else the config gzipped, then base64-encoded.
/// Talos on Hetzner reads that back: its hcloud platform decodes base64
/// text (siderolabs/talos
/// internal/app/machined/pkg/runtime/v1alpha1/platform/hcloud/hcloud.go,
/// `maybeBase64Decode`, v1.9.0 on), then the config acquirer gunzips what
/// starts with the gzip magic
/// (internal/app/machined/pkg/controllers/config/acquire.go,
/// `loadFromPlatform`). gzip alone cannot go: the API's JSON carries text.
pub fn encode_user_data(
    node: &str,
    config: &str,
    talos_version: &str,
) -> Result<String, HcloudError> {
    if config.len() <= USER_DATA_MAX {
        return Ok(config.to_owned());
    }
    let too_large = |detail: String| HcloudError::UserDataTooLarge {
        node: node.to_owned(),
        size: config.len(),
        detail,
    };
    let decodes_base64 = crate::inventory::parse_version(talos_version, true)
        .is_some_and(|(major, minor, _)| (major, minor) >= BASE64_SINCE);
    if !decodes_base64 {
        return Err(too_large(format!(
            "; Talos {talos_version} reads user_data only as plain text (compressed, base64-encoded user_data needs Talos v{}.{}.0 or later)",
            BASE64_SINCE.0, BASE64_SINCE.1
        )));
    }
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    gz.write_all(config.as_bytes())
        .and_then(|()| gz.finish())
        .map(|bytes| base64::engine::general_purpose::STANDARD.encode(bytes))
        .map_err(|e| HcloudError::Io(format!("node {node}: compressing its machine config: {e}")))
        .and_then(|text| {
            if text.len() <= USER_DATA_MAX {
                Ok(text)
            } else {
                Err(too_large(format!(
                    " even gzipped and base64-encoded ({} bytes)",
                    text.len()
                )))
            }
        })
}

/// One node's server as it should be.
#[derive(Debug, Clone)]
pub struct ServerSpec {
    pub node: String,
    /// The snapshot holding the node's image: needed only to create its
    /// server (an existing server's image is history, not drift).
    pub snapshot: Option<u64>,
    /// The node's machine config ([`encode_user_data`] makes it fit).
    pub user_data: String,
    /// The Talos version of its image: whether it can read compressed
    /// `user_data`.
    pub talos_version: String,
    /// Its address in the inventory: where it joins `servers.network`.
    pub private_ip: Option<IpAddr>,
    /// Its server type and location (its own, else the cluster's).
    pub server_type: String,
    pub location: String,
}

/// One node's server as it is.
#[derive(Debug, Clone, Serialize)]
pub struct ClusterServer {
    pub node: String,
    pub id: u64,
    pub name: String,
    pub public_ip: Option<IpAddr>,
    /// False when an existing server was reused.
    pub created: bool,
    /// Whether this run switched it on (created, or found off).
    pub started: bool,
    pub status: String,
}

/// `<cluster>-<node>`: server names are unique per project.
pub fn server_name(cluster: &str, node: &str) -> String {
    format!("{cluster}-{node}")
}

/// The selector of `cluster`'s servers (never a build run's).
fn cluster_selector(cluster: &str) -> String {
    format!(
        "{}={},{CLUSTER_LABEL}={cluster},!{RUN_LABEL}",
        MANAGED_BY.0, MANAGED_BY.1
    )
}

fn describe(node: &str, server: &Value, created: bool) -> ClusterServer {
    ClusterServer {
        node: node.to_owned(),
        id: server["id"].as_u64().unwrap_or_default(),
        name: server["name"].as_str().unwrap_or_default().to_owned(),
        public_ip: server
            .pointer("/public_net/ipv4/ip")
            .and_then(Value::as_str)
            .and_then(|s| s.parse().ok()),
        created,
        started: created,
        status: server["status"].as_str().unwrap_or_default().to_owned(),
    }
}

/// The cluster's existing servers, by node. Only reads: `--dry-run` uses it.
pub fn existing(api: &Api, cluster: &str) -> Result<Vec<ClusterServer>, HcloudError> {
    let servers = api.list(
        "/servers",
        "servers",
        &[("label_selector", cluster_selector(cluster))],
    )?;
    Ok(servers
        .iter()
        .filter_map(|s| {
            let node = s.pointer(&format!("/labels/{NODE_LABEL}"))?.as_str()?;
            Some(describe(node, s, false))
        })
        .collect())
}

/// Each spec's `user_data` as sent ([`encode_user_data`]), or the first
/// node whose config cannot fit: checked before any request.
pub fn check(specs: &[ServerSpec]) -> Result<Vec<String>, HcloudError> {
    specs
        .iter()
        .map(|s| encode_user_data(&s.node, &s.user_data, &s.talos_version))
        .collect()
}

/// The nodes among `nodes` (every inventory node when empty) that have no
/// server yet: the only ones a run builds and publishes an image for. Once
/// a server exists its image is history; `imgbuild upgrade` moves it on.
pub fn without_server(
    api: &Api,
    inv: &Inventory,
    nodes: &[String],
) -> Result<Vec<String>, HcloudError> {
    let have = existing(api, &inv.cluster.name)?;
    let create: Vec<&crate::inventory::NodeSpec> = inv
        .nodes
        .iter()
        .filter(|n| nodes.is_empty() || nodes.contains(&n.name))
        .filter(|n| !have.iter().any(|h| h.node == n.name))
        .collect();
    check_types(api, inv, &create)?;
    Ok(create.into_iter().map(|n| n.name.clone()).collect())
}

/// Checks, before anything is built, that each node's server type exists,
/// has the node's architecture (`GET /server_types`, `architecture`) and
/// is offered in its location.
fn check_types(
    api: &Api,
    inv: &Inventory,
    nodes: &[&crate::inventory::NodeSpec],
) -> Result<(), HcloudError> {
    let Some(settings) = inv.publish.hcloud() else {
        return Ok(());
    };
    if nodes.is_empty() {
        return Ok(());
    }
    let types = api.list("/server_types", "server_types", &[])?;
    for node in nodes {
        let Some(server_type) = node.hcloud_server_type(settings) else {
            continue;
        };
        let location = node.hcloud_location(settings);
        if let Some(why) = super::unsuitable(&types, server_type, location, inv.arch(node)) {
            return Err(HcloudError::Setup(format!(
                "node {}: server type {server_type} cannot run it in {location}: {why}",
                node.name
            )));
        }
    }
    Ok(())
}

/// Checks that `server_type` can boot the snapshots of the servers to be
/// created (`specs`), before any is: the same architecture, and a disk at
/// least each snapshot's `disk_size` (the API refuses others with 422
/// `invalid_server_type`).
fn check_fits(api: &Api, server_type: &str, specs: &[&ServerSpec]) -> Result<(), HcloudError> {
    if specs.is_empty() {
        return Ok(());
    }
    let types = api.list(
        "/server_types",
        "server_types",
        &[("name", server_type.to_owned())],
    )?;
    let t = types
        .iter()
        .find(|t| t["name"] == server_type)
        .ok_or_else(|| {
            HcloudError::Setup(format!(
                "publish.hcloud.servers.type: the API lists no server type {server_type:?}"
            ))
        })?;
    let type_arch = t["architecture"].as_str().unwrap_or("unknown");
    let disk = t["disk"].as_f64().unwrap_or(0.0);
    let mut nodes_of: BTreeMap<u64, Vec<&str>> = BTreeMap::new();
    for s in specs {
        let snapshot = s.snapshot.ok_or_else(|| {
            HcloudError::Setup(format!(
                "node {} has no server and no snapshot to create one from",
                s.node
            ))
        })?;
        nodes_of.entry(snapshot).or_default().push(&s.node);
    }
    for (snapshot, nodes) in nodes_of {
        let image = api.get(&format!("/images/{snapshot}"), &[])?;
        let image = &image["image"];
        let image_arch = image["architecture"].as_str().unwrap_or("unknown");
        let disk_size = image["disk_size"].as_f64().unwrap_or(0.0);
        let nodes = nodes.join(", ");
        if image_arch != type_arch {
            return Err(HcloudError::WrongArch {
                server_type: server_type.to_owned(),
                type_arch: type_arch.to_owned(),
                snapshot,
                image_arch: image_arch.to_owned(),
                nodes,
            });
        }
        if disk < disk_size {
            return Err(HcloudError::TypeTooSmall {
                server_type: server_type.to_owned(),
                disk,
                snapshot,
                disk_size,
                nodes,
            });
        }
    }
    Ok(())
}

/// Makes sure every node of `specs` has a running server made from its
/// snapshot: existing ones (matched by label) are reused and started if
/// off, missing ones created. One server per node, never two.
pub fn ensure(
    api: &Api,
    settings: &HcloudSettings,
    cluster: &str,
    specs: &[ServerSpec],
    opts: &SnapshotOptions,
    cancel: &Cancel,
) -> Result<Vec<ClusterServer>, HcloudError> {
    let user_data = check(specs)?;
    let Some(shape) = &settings.servers else {
        return Err(HcloudError::Setup(
            "publish.hcloud.servers is not set: there are no cluster servers to create".into(),
        ));
    };
    let have = existing(api, cluster)?;
    let missing: Vec<&ServerSpec> = specs
        .iter()
        .filter(|s| !have.iter().any(|h| h.node == s.node))
        .collect();
    let mut by_type: BTreeMap<&str, Vec<&ServerSpec>> = BTreeMap::new();
    for s in &missing {
        by_type.entry(&s.server_type).or_default().push(s);
    }
    for (server_type, specs) in by_type {
        check_fits(api, server_type, &specs)?;
    }
    let network = match &shape.network {
        Some(name) => Some(network_id(api, name)?),
        None => None,
    };
    let wait = |reply: &Value, what: &str| {
        api.wait_reply(reply, what, opts.poll, opts.action_timeout, cancel)
    };
    let mut out = Vec::new();
    for (spec, user_data) in specs.iter().zip(user_data) {
        cancel.check()?;
        if let Some(s) = have.iter().find(|s| s.node == spec.node) {
            let mut s = s.clone();
            if s.status == "off" {
                let reply = api.post(&format!("/servers/{}/actions/poweron", s.id), &json!({}))?;
                wait(
                    &reply,
                    &format!("poweron of server {} (node {})", s.id, spec.node),
                )?;
                s.status = "running".into();
                s.started = true;
            }
            out.push(s);
            continue;
        }
        let labels = json!({
            MANAGED_BY.0: MANAGED_BY.1,
            CLUSTER_LABEL: cluster,
            NODE_LABEL: spec.node,
        });
        let reply = api.post(
            "/servers",
            &json!({
                "name": server_name(cluster, &spec.node),
                "server_type": spec.server_type,
                "image": spec.snapshot,
                "location": spec.location,
                "labels": labels,
                "user_data": user_data,
                "start_after_create": network.is_none(),
            }),
        )?;
        let server = reply["server"].clone();
        let id = server["id"].as_u64().unwrap_or_default();
        wait(
            &reply,
            &format!("creating server {id} (node {})", spec.node),
        )?;
        if let Some(net) = network {
            let mut body = json!({"network": net});
            if let Some(ip) = spec.private_ip {
                body["ip"] = json!(ip.to_string());
            }
            let reply = api.post(&format!("/servers/{id}/actions/attach_to_network"), &body)?;
            wait(
                &reply,
                &format!("attaching server {id} (node {}) to its network", spec.node),
            )?;
            let reply = api.post(&format!("/servers/{id}/actions/poweron"), &json!({}))?;
            wait(
                &reply,
                &format!("poweron of server {id} (node {})", spec.node),
            )?;
        }
        let now = api.get(&format!("/servers/{id}"), &[])?;
        out.push(describe(&spec.node, &now["server"], true));
    }
    Ok(out)
}

/// The ID of the network named `name`.
fn network_id(api: &Api, name: &str) -> Result<u64, HcloudError> {
    let found = api.list("/networks", "networks", &[("name", name.to_owned())])?;
    found.first().and_then(|n| n["id"].as_u64()).ok_or_else(|| {
        HcloudError::Setup(format!(
            "publish.hcloud.servers.network: no network named {name:?} in this project"
        ))
    })
}

/// Deletes `cluster`'s servers (found by label): `imgbuild down`.
pub fn delete_cluster(
    api: &Api,
    cluster: &str,
    opts: &SnapshotOptions,
) -> (Vec<Deleted>, Vec<Leftover>) {
    delete_by(api, &cluster_selector(cluster), opts)
}

/// Deletes the server imgbuild made for `node` of `cluster` (by its
/// labels, as [`delete_cluster`]): `up --allow-destroy` removing a node.
pub fn delete_node(
    api: &Api,
    cluster: &str,
    node: &str,
    opts: &SnapshotOptions,
) -> (Vec<Deleted>, Vec<Leftover>) {
    let selector = format!("{},{NODE_LABEL}={node}", cluster_selector(cluster));
    delete_by(api, &selector, opts)
}

fn delete_by(api: &Api, selector: &str, opts: &SnapshotOptions) -> (Vec<Deleted>, Vec<Leftover>) {
    let mut deleted = Vec::new();
    let mut left = Vec::new();
    for r in delete_selected(api, selector, None, opts, &Quiet, &["server"]) {
        match r {
            Ok(d) => deleted.push(d),
            Err(l) => left.push(l),
        }
    }
    (deleted, left)
}

/// The state dir's record of where the last `up` found the servers: the
/// fallback when the API cannot be asked. Names, IDs and addresses only.
pub const RECORD_FILE: &str = "hcloud-servers.json";

/// The record's largest size: one line per server, a few hundred servers.
const RECORD_MAX: u64 = 1 << 20;

/// What [`RECORD_FILE`] holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Record {
    cluster: String,
    /// Unix seconds.
    recorded_at: u64,
    servers: Vec<RecordedServer>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RecordedServer {
    node: String,
    id: u64,
    name: String,
    public_ip: Option<IpAddr>,
}

fn record_path(state_dir: &Path) -> PathBuf {
    state_dir.join(RECORD_FILE)
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Writes where `servers` are into `state_dir` (atomically, 0600 like
/// everything there): what `up` found, for the commands after it.
pub fn record<'a>(
    inv: &Inventory,
    state_dir: &Path,
    servers: impl IntoIterator<Item = &'a ClusterServer>,
) -> Result<(), HcloudError> {
    let mut servers: Vec<RecordedServer> = servers
        .into_iter()
        .map(|s| RecordedServer {
            node: s.node.clone(),
            id: s.id,
            name: s.name.clone(),
            public_ip: s.public_ip,
        })
        .collect();
    servers.sort_by(|a, b| a.node.cmp(&b.node));
    let record = Record {
        cluster: inv.cluster.name.clone(),
        recorded_at: now(),
        servers,
    };
    let path = record_path(state_dir);
    let mut text = serde_json::to_vec_pretty(&record)
        .map_err(|e| HcloudError::Io(format!("encoding {}: {e}", path.display())))?;
    text.push(b'\n');
    crate::atomic::write_if_changed(&path, &text, true)
        .map(drop)
        .map_err(|e| HcloudError::Io(format!("writing {}: {e}", path.display())))
}

/// The record `up` left, if it is this cluster's.
fn read_record(inv: &Inventory, state_dir: &Path) -> Result<Record, String> {
    let path = record_path(state_dir);
    let shown = path.display();
    let file = crate::io::open_regular(&path, false).map_err(|e| format!("{shown}: {e}"))?;
    let bytes = crate::io::read_bounded(file, RECORD_MAX).map_err(|e| format!("{shown}: {e}"))?;
    let record: Record = serde_json::from_slice(&bytes)
        .map_err(|e| format!("{shown}: {}", crate::input::one_line(&e.to_string(), 200)))?;
    if record.cluster != inv.cluster.name {
        return Err(format!(
            "{shown} is cluster {:?}'s, not {:?}'s",
            crate::input::one_line(&record.cluster, 64),
            inv.cluster.name
        ));
    }
    Ok(record)
}

/// Where the addresses came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase", tag = "source")]
pub enum Source {
    /// The API listed the servers now.
    Api,
    /// The API could not be asked (`why`): the last `up`'s record, written
    /// `age` ago. Stale: servers may have changed since.
    Recorded {
        #[serde(serialize_with = "seconds")]
        age: Duration,
        why: String,
    },
}

fn seconds<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(d.as_secs())
}

/// Where the bootstrap reaches each of the cluster's servers, and how that
/// is known.
#[derive(Debug, Clone)]
pub struct Addresses {
    /// Each server's public IP by node (inventory nodes only): where `up`
    /// reaches them (`BootstrapOptions::targets`).
    pub reached: BTreeMap<String, IpAddr>,
    pub source: Source,
}

impl Addresses {
    /// A warning when the addresses are the record's, not the API's.
    pub fn stale(&self) -> Option<String> {
        match &self.source {
            Source::Api => None,
            Source::Recorded { age, why } => Some(format!(
                "the Hetzner API could not be asked where the servers are ({why}): using the addresses the last `up` recorded {} ago (stale: servers may have changed since)",
                age_text(*age)
            )),
        }
    }
}

/// `3m`, `2h`, `5d`: how old a record is, roughly.
fn age_text(age: Duration) -> String {
    let s = age.as_secs();
    match s {
        0..120 => format!("{s}s"),
        120..7200 => format!("{}m", s / 60),
        7200..172_800 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86_400),
    }
}

/// Retries for a lookup: brief, since the record stands in when the API
/// does not answer.
const LOOKUP_RETRY: RetryPolicy = RetryPolicy {
    retries: 2,
    backoff: Duration::from_millis(250),
    max_wait: Duration::from_secs(2),
};

/// Where the cluster's servers are, for every command after `up`: found by
/// label through the API (the token from `env`, as `up` reads it), else
/// from the state dir's record of the last `up` (marked stale). Only
/// inventory nodes; an error only when neither answers.
pub fn addresses(
    inv: &Inventory,
    state_dir: &Path,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Addresses, HcloudError> {
    let listed = Credentials::from_env(env)
        .and_then(|c| c.api(LOOKUP_RETRY))
        .and_then(|api| existing(&api, &inv.cluster.name));
    let (found, source): (Vec<(String, Option<IpAddr>)>, Source) = match listed {
        Ok(servers) => (
            servers.into_iter().map(|s| (s.node, s.public_ip)).collect(),
            Source::Api,
        ),
        Err(e) => {
            let why = crate::input::one_line(&e.to_string(), 300);
            let record = read_record(inv, state_dir).map_err(|r| {
                HcloudError::NoAddresses(format!(
                    "the Hetzner API could not be asked where cluster {}'s servers are ({why}), and there is no record of the last `up` ({r})",
                    inv.cluster.name
                ))
            })?;
            let age = Duration::from_secs(now().saturating_sub(record.recorded_at));
            let found = record.servers.into_iter().map(|s| (s.node, s.public_ip));
            (found.collect(), Source::Recorded { age, why })
        }
    };
    let reached = found
        .into_iter()
        .filter(|(node, _)| inv.node(node).is_ok())
        .filter_map(|(node, ip)| Some((node, ip?)))
        .collect();
    Ok(Addresses { reached, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_servers_are_selected_without_build_runs() {
        assert_eq!(
            cluster_selector("prod"),
            "managed-by=imgbuild,imgbuild-cluster=prod,!imgbuild-run"
        );
        assert_eq!(server_name("prod", "cp-01"), "prod-cp-01");
    }

    /// `len` bytes of YAML-ish text; `random`: hex digits that compress
    /// only to about half.
    fn config(len: usize, random: bool) -> String {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        (0..len)
            .map(|i| {
                if !random {
                    return b"machine:\n  files: []\n"[i % 21] as char;
                }
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                char::from_digit((x % 16) as u32, 16).unwrap()
            })
            .collect()
    }

    fn spec(node: &str, user_data: String, talos_version: &str) -> ServerSpec {
        ServerSpec {
            node: node.into(),
            snapshot: Some(1),
            user_data,
            talos_version: talos_version.into(),
            private_ip: None,
            server_type: "cpx22".into(),
            location: "fsn1".into(),
        }
    }

    #[test]
    fn user_data_is_compressed_only_when_it_must_be() {
        use std::io::Read;
        let fits = config(USER_DATA_MAX, false);
        assert_eq!(
            check(&[spec("cp-01", fits.clone(), "v1.11.2")]).unwrap(),
            std::slice::from_ref(&fits)
        );
        // Talos before v1.9 cannot read it compressed, but this one fits.
        assert_eq!(encode_user_data("cp-01", &fits, "v1.8.3").unwrap(), fits);

        let big = config(40 * 1024, false);
        let sent = encode_user_data("cp-01", &big, "v1.11.2").unwrap();
        assert!(sent.len() <= USER_DATA_MAX, "{} bytes", sent.len());
        // What Talos does with it: base64, then gunzip (bytes 1f 8b 08).
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(&sent)
            .unwrap();
        assert_eq!(bytes[..3], [0x1f, 0x8b, 0x08]);
        let mut back = String::new();
        flate2::read::GzDecoder::new(&bytes[..])
            .read_to_string(&mut back)
            .unwrap();
        assert_eq!(back, big);
        // A pre-release of v1.9 has the base64 decoding too.
        assert!(encode_user_data("cp-01", &big, "v1.9.0-alpha.0").is_ok());
    }

    #[test]
    fn user_data_that_cannot_fit_names_the_node() {
        let big = config(40 * 1024, false);
        let err = check(&[
            spec("cp-01", config(10, false), "v1.8.3"),
            spec("worker-01", big.clone(), "v1.8.3"),
        ])
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("node worker-01") && err.contains("32768") && err.contains("v1.9.0"),
            "{err}"
        );
        let err = check(&[spec("worker-02", config(100 * 1024, true), "v1.11.2")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("node worker-02") && err.contains("even gzipped"),
            "{err}"
        );
    }

    fn inventory(name: &str) -> Inventory {
        let text = format!(
            "cluster: {{name: {name}, talosVersion: v1.11.2, kubernetesVersion: v1.34.1, endpoint: \"https://10.0.0.10:6443\"}}\n\
             image: {{platform: hcloud}}\n\
             publish:\n  hcloud: {{location: fsn1, servers: {{type: cpx22}}}}\n\
             nodes:\n  - {{name: cp-01, role: controlplane}}\n  - {{name: w-01, role: worker}}\n"
        );
        Inventory::parse(&text, Path::new("cluster.yaml")).unwrap()
    }

    /// Without a token the API cannot be asked: the record stands in,
    /// marked stale; only inventory nodes with an address are kept; another
    /// cluster's record, or none, is an error naming the file.
    #[test]
    fn the_record_stands_in_when_the_api_cannot_be_asked() {
        let dir = tempfile::tempdir().unwrap();
        let no_env = |_: &str| None;
        let err = addresses(&inventory("lab"), dir.path(), &no_env)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("HCLOUD_TOKEN") && err.contains(RECORD_FILE),
            "{err}"
        );
        let server = |node: &str, ip: Option<&str>| ClusterServer {
            node: node.into(),
            id: 1,
            name: format!("lab-{node}"),
            public_ip: ip.map(|i| i.parse().unwrap()),
            created: true,
            started: true,
            status: "running".into(),
        };
        let servers = [
            server("cp-01", Some("127.4.0.2")),
            server("w-01", None),
            server("gone", Some("127.4.0.9")),
        ];
        record(&inventory("lab"), dir.path(), &servers).unwrap();
        let found = addresses(&inventory("lab"), dir.path(), &no_env).unwrap();
        assert_eq!(
            found.reached,
            BTreeMap::from([("cp-01".to_owned(), "127.4.0.2".parse().unwrap())])
        );
        assert!(matches!(found.source, Source::Recorded { .. }));
        let warning = found.stale().unwrap();
        assert!(
            warning.contains("HCLOUD_TOKEN is not set") && warning.contains("stale"),
            "{warning}"
        );
        let err = addresses(&inventory("other"), dir.path(), &no_env)
            .unwrap_err()
            .to_string();
        assert!(err.contains("cluster \"lab\"'s, not \"other\"'s"), "{err}");
    }

    #[test]
    fn servers_are_described_from_the_api_object() {
        let s = describe(
            "cp-01",
            &json!({"id": 7, "name": "prod-cp-01", "status": "running",
                    "public_net": {"ipv4": {"ip": "127.4.0.9"}}}),
            true,
        );
        assert_eq!(s.id, 7);
        assert_eq!(s.public_ip, Some("127.4.0.9".parse().unwrap()));
        assert!(s.created);
    }
}
