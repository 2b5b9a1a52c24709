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

use base64::Engine;

use serde::Serialize;
use serde_json::{Value, json};

use super::api::Api;
use super::cleanup::delete_selected;
use super::error::HcloudError;
pub use super::error::USER_DATA_MAX;
use super::types::{Deleted, Leftover, MANAGED_BY, Quiet, RUN_LABEL, SnapshotOptions};
use crate::inventory::HcloudSettings;
use crate::publish::Cancel;

pub const CLUSTER_LABEL: &str = "imgbuild-cluster";
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
    /// The snapshot holding the node's image.
    pub snapshot: u64,
    /// The node's machine config ([`encode_user_data`] makes it fit).
    pub user_data: String,
    /// The Talos version of its image: whether it can read compressed
    /// `user_data`.
    pub talos_version: String,
    /// Its address in the inventory: where it joins `servers.network`.
    pub private_ip: Option<IpAddr>,
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
        nodes_of.entry(s.snapshot).or_default().push(&s.node);
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
    check_fits(api, &shape.server_type, &missing)?;
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
                "server_type": shape.server_type,
                "image": spec.snapshot,
                "location": settings.location,
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
    let mut deleted = Vec::new();
    let mut left = Vec::new();
    for r in delete_selected(
        api,
        &cluster_selector(cluster),
        None,
        opts,
        &Quiet,
        &["server"],
    ) {
        match r {
            Ok(d) => deleted.push(d),
            Err(l) => left.push(l),
        }
    }
    (deleted, left)
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
            snapshot: 1,
            user_data,
            talos_version: talos_version.into(),
            private_ip: None,
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
