//! The cluster's own servers: one per node, created from the snapshot with
//! the node's machine config as `user_data` (Talos on Hetzner reads it from
//! there, so no maintenance-mode apply is needed), labelled with the cluster
//! and the node so a rerun finds and reuses them and `imgbuild down` can
//! delete them. They never carry a run label: `imgbuild cleanup` leaves
//! them alone. Facts: the OpenAPI document
//! (`sim/api-schemas/hetzner-cloud.openapi.json`: `user_data` ≤ 32 KiB,
//! `attach_to_network`).

use std::net::IpAddr;

use serde::Serialize;
use serde_json::{Value, json};

use super::{
    Api, Cancel, Deleted, HcloudError, Leftover, MANAGED_BY, RUN_LABEL, SnapshotOptions,
    delete_selected,
};
use crate::inventory::HcloudSettings;

pub const CLUSTER_LABEL: &str = "imgbuild-cluster";
pub const NODE_LABEL: &str = "imgbuild-node";
/// The API's limit on `user_data`.
pub const USER_DATA_MAX: usize = 32 * 1024;

/// One node's server as it should be.
#[derive(Debug, Clone)]
pub struct ServerSpec {
    pub node: String,
    /// The snapshot holding the node's image.
    pub snapshot: u64,
    /// The node's machine config.
    pub user_data: String,
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

/// Problems that stop a server before any request: a config too large for
/// `user_data`.
pub fn check(specs: &[ServerSpec]) -> Result<(), HcloudError> {
    for s in specs {
        if s.user_data.len() > USER_DATA_MAX {
            return Err(HcloudError::Setup(format!(
                "node {}: its machine config is {} bytes, over Hetzner's {USER_DATA_MAX}-byte user_data limit (move large patches or inline manifests out of it)",
                s.node,
                s.user_data.len()
            )));
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
    check(specs)?;
    let Some(shape) = &settings.servers else {
        return Err(HcloudError::Setup(
            "publish.hcloud.servers is not set: there are no cluster servers to create".into(),
        ));
    };
    let have = existing(api, cluster)?;
    let network = match &shape.network {
        Some(name) => Some(network_id(api, name)?),
        None => None,
    };
    let wait = |reply: &Value, what: &str| {
        api.wait_reply(reply, what, opts.poll, opts.action_timeout, cancel)
    };
    let mut out = Vec::new();
    for spec in specs {
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
                "user_data": spec.user_data,
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
    struct Quiet;
    impl super::Observer for Quiet {
        fn event(&self, _: &super::Event) {}
    }
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

    #[test]
    fn oversized_user_data_names_the_node() {
        let spec = |n: &str, len: usize| ServerSpec {
            node: n.into(),
            snapshot: 1,
            user_data: "x".repeat(len),
            private_ip: None,
        };
        assert!(check(&[spec("cp-01", USER_DATA_MAX)]).is_ok());
        let err = check(&[spec("cp-01", 10), spec("worker-01", USER_DATA_MAX + 1)])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("node worker-01") && err.contains("32768"),
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
