//! The gate day two passes between nodes: the checks `talosctl health`
//! runs (siderolabs/talos `pkg/cluster/check/default.go`): etcd healthy on
//! every control plane, etcd members equal to the control planes, the
//! node's kubelet healthy, every Kubernetes node Ready and schedulable,
//! kube-proxy and CoreDNS ready unless the config disables them.

use std::collections::BTreeSet;
use std::time::Instant;

use super::bootstrap::{Options, Plan, PlannedNode};
use super::client::{Mode, NodeClient};
use super::kube::Kubeconfig;
use crate::inventory::Role;

/// Why the cluster could not be read or did not become healthy.
#[derive(Debug, thiserror::Error)]
pub enum HealthError {
    #[error(transparent)]
    Kube(#[from] super::kube::KubeError),
    /// The blocking Kubernetes call did not finish (panicked or cancelled).
    #[error("{0}")]
    Join(#[from] tokio::task::JoinError),
    /// What was still wrong when the health timeout ran out.
    #[error("the cluster did not become healthy within {within:?}: {}", pending.join("; "))]
    Unhealthy {
        within: std::time::Duration,
        pending: Vec<String>,
    },
}

/// Why a node's services could not be read for the health gate.
#[derive(Debug, thiserror::Error)]
enum ServicesUnread {
    #[error(transparent)]
    Api(#[from] super::client::ApiError),
    #[error("no answer within the call timeout ({}s)", .0.as_secs_f64())]
    NoAnswer(std::time::Duration),
}

/// What one Kubernetes node says about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeNode {
    pub name: String,
    pub ready: bool,
    /// `spec.unschedulable`: cordoned.
    pub cordoned: bool,
    /// Cordoned by imgbuild (its [`CORDONED_BY`] annotation): only such a
    /// cordon is ever undone by imgbuild, never an admin's.
    pub cordoned_by_imgbuild: bool,
}

/// The annotation imgbuild puts on a Kubernetes node it cordons, as Talos
/// marks the nodes it cordons (`talos.dev/cordoned`,
/// `internal/app/machined/pkg/controllers/k8s/node_apply.go`
/// `ApplyCordoned`): an uncordon undoes only a cordon of one's own.
pub const CORDONED_BY: &str = "imgbuild/cordoned";

/// The add-ons whose pods must be ready, by `k8s-app` label, unless the
/// config disables them (`cluster.proxy.disabled`, `cluster.coreDNS.disabled`).
const ADDONS: [(&str, &str, &str); 2] = [
    ("kube-proxy", "kube-proxy", "proxy"),
    ("CoreDNS", "kube-dns", "coreDNS"),
];

/// The admin kubeconfig every Kubernetes call goes through: the one the
/// bootstrap wrote into the state dir while it trusts these secrets'
/// Kubernetes CA, else (a fresh runner, a sealed cluster, a file from
/// other secrets) the one minted from the secrets for this run. Pointed
/// at `cluster.kubernetesEndpoint` when the inventory has one (even if the
/// file predates the setting).
pub(crate) fn kubeconfig(plan: &Plan) -> Result<Kubeconfig, HealthError> {
    let kc = match on_disk(plan) {
        Some(kc) => kc,
        None if plan.kubernetes_endpoint.is_some() => plan.admin_kube.get()?,
        None => plan
            .admin_kube
            .get_settled(|kc| where_it_answers(plan, kc))?,
    };
    Ok(match &plan.kubernetes_endpoint {
        Some(outside) => kc.through(outside, crate::inventory::endpoint_host(&plan.endpoint)),
        None => kc,
    })
}

/// `kc` pointed where the API answers: the endpoint, else (the VIP is
/// held by no one yet, or not reachable from here) the first control
/// plane's own address that does, as the bootstrap falls back when it
/// writes the kubeconfig; the endpoint when none does. Probed once per
/// run, on a thread of its own: the blocking client must not run on the
/// async runtime's.
fn where_it_answers(plan: &Plan, kc: Kubeconfig) -> Kubeconfig {
    let port = plan
        .endpoint
        .trim_end_matches('/')
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse::<u16>().ok())
        .unwrap_or(443);
    let own = plan
        .nodes
        .iter()
        .filter(|n| n.role == Role::Controlplane)
        .map(|n| match n.address {
            std::net::IpAddr::V6(v6) => format!("https://[{v6}]:{port}"),
            v4 => format!("https://{v4}:{port}"),
        });
    let candidates: Vec<String> = std::iter::once(plan.endpoint.clone()).chain(own).collect();
    let probe = kc.with_tls_server_name(None);
    let answering = std::thread::scope(|s| {
        s.spawn(|| {
            candidates.into_iter().find(|server| {
                probe
                    .with_server(server)
                    .get_json("/version", std::time::Duration::from_secs(2))
                    .is_ok()
            })
        })
        .join()
        .ok()
        .flatten()
    });
    match answering {
        Some(server) if server != kc.server => kc.with_server(&server),
        _ => kc,
    }
}

/// Whether reads go through the state dir's kubeconfig (not a minted one).
pub(crate) fn state_dir_kubeconfig(plan: &Plan) -> bool {
    on_disk(plan).is_some()
}

/// The state dir's kubeconfig when it may be used: written by a bootstrap
/// of an unsealed cluster from these secrets. Through the bounded reader:
/// a FIFO or `/dev/zero` there is no kubeconfig.
fn on_disk(plan: &Plan) -> Option<Kubeconfig> {
    if !plan.write_kubeconfig {
        return None;
    }
    let text = crate::input::read_text(&plan.kubeconfig_path, crate::input::MAX_TEXT_FILE).ok()?;
    Kubeconfig::parse(&text)
        .ok()
        .filter(|kc| plan.admin_kube.issued_for(kc))
}

/// Every Kubernetes node, Ready and cordoned.
pub async fn kube_nodes(plan: &Plan, opts: &Options) -> Result<Vec<KubeNode>, HealthError> {
    let kc = kubeconfig(plan)?;
    let timeout = opts.call_timeout;
    let list = tokio::task::spawn_blocking(move || kc.get_json("/api/v1/nodes", timeout)).await??;
    Ok(nodes_of(&list))
}

/// Each item of a `NodeList`.
fn nodes_of(list: &serde_json::Value) -> Vec<KubeNode> {
    let items = list["items"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    items
        .iter()
        .map(|n| KubeNode {
            name: n["metadata"]["name"].as_str().unwrap_or("").to_owned(),
            ready: ready(n),
            cordoned: n["spec"]["unschedulable"] == true,
            cordoned_by_imgbuild: n["spec"]["unschedulable"] == true
                && n["metadata"]["annotations"][CORDONED_BY].is_string(),
        })
        .collect()
}

/// Whether an object's `Ready` condition is `True`.
pub(crate) fn ready(obj: &serde_json::Value) -> bool {
    obj["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == "Ready"))
        .is_some_and(|c| c["status"] == "True")
}

/// Whether `section` (`proxy`, `coreDNS`) is disabled in a machine config's
/// `cluster` document.
fn disabled(config: &[u8], section: &str) -> bool {
    let text = String::from_utf8_lossy(config);
    serde_yaml_ng::Deserializer::from_str(&text).any(|doc| {
        <serde_yaml_ng::Value as serde::Deserialize>::deserialize(doc)
            .is_ok_and(|v| v["cluster"][section]["disabled"] == serde_yaml_ng::Value::Bool(true))
    })
}

/// What keeps `label`'s pods in kube-system from being ready, if anything.
async fn addon_pending(kc: &Kubeconfig, name: &str, label: &str, opts: &Options) -> Option<String> {
    let kc = kc.clone();
    let timeout = opts.call_timeout;
    let path = format!("/api/v1/namespaces/kube-system/pods?labelSelector=k8s-app%3D{label}");
    let list = tokio::task::spawn_blocking(move || kc.get_json(&path, timeout)).await;
    let list = match list {
        Ok(Ok(l)) => l,
        Ok(Err(e)) => return Some(format!("{name}: {e}")),
        Err(e) => return Some(format!("{name}: {e}")),
    };
    let pods = list["items"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    let unready = pods.iter().filter(|p| !ready(p)).count();
    if pods.is_empty() {
        Some(format!("{name}: no pods"))
    } else if unready > 0 {
        Some(format!(
            "{name}: {unready} of {} pods not ready",
            pods.len()
        ))
    } else {
        None
    }
}

/// What still keeps the cluster from being healthy around `node`. One
/// round reads every control plane and `node` at once (one deadline each
/// for its connect and calls) while Kubernetes is asked, so a round costs
/// the slowest read, not their sum.
pub async fn unhealthy(plan: &Plan, node: &PlannedNode, opts: &Options) -> Vec<String> {
    let mode = Mode::Mtls(plan.identity.clone());
    let mut pending = Vec::new();
    let control_planes: BTreeSet<&str> = plan
        .nodes
        .iter()
        .filter(|n| n.role == Role::Controlplane)
        .map(|n| n.name.as_str())
        .collect();
    let asked: Vec<&PlannedNode> = plan
        .nodes
        .iter()
        .filter(|n| n.role == Role::Controlplane || n.name == node.name)
        .collect();
    let reads = futures_util::future::join_all(asked.iter().map(|n| {
        let mode = mode.clone();
        async move {
            let read = async {
                let conn = NodeClient::connect(&n.endpoint, &mode, opts.call_timeout).await?;
                let services = conn.services().await?;
                let members = if n.role == Role::Controlplane {
                    conn.etcd_members().await.ok().map(|m| {
                        m.into_iter()
                            .map(|m| m.hostname)
                            // Control planes `up` removes later in the run.
                            .filter(|name| !opts.leaving.contains(name))
                            .collect::<BTreeSet<String>>()
                    })
                } else {
                    None
                };
                Ok::<_, ServicesUnread>((services, members))
            };
            tokio::time::timeout(opts.call_timeout, read)
                .await
                .unwrap_or(Err(ServicesUnread::NoAnswer(opts.call_timeout)))
        }
    }));
    let addons = async {
        let mut out = Vec::new();
        if let (Ok(kc), Some(cp)) = (
            kubeconfig(plan),
            plan.nodes.iter().find(|n| n.role == Role::Controlplane),
        ) {
            let checks = ADDONS
                .iter()
                .filter(|(_, _, section)| !disabled(&cp.config, section))
                .map(|(name, label, _)| addon_pending(&kc, name, label, opts));
            out.extend(
                futures_util::future::join_all(checks)
                    .await
                    .into_iter()
                    .flatten(),
            );
        }
        out
    };
    let (reads, kube, addons) = futures_util::join!(reads, kube_nodes(plan, opts), addons);
    // The members as the first control plane that answers sees them.
    let mut members: Option<BTreeSet<String>> = None;
    for (n, read) in asked.iter().zip(reads) {
        let (services, seen) = match read {
            Ok(r) => r,
            Err(e) => {
                pending.push(format!("{}: {e}", n.name));
                continue;
            }
        };
        let mut wanted = Vec::new();
        if n.role == Role::Controlplane {
            wanted.push("etcd");
            if members.is_none() {
                members = seen;
            }
        }
        if n.name == node.name {
            wanted.push("kubelet");
        }
        for id in wanted {
            let ok = services.iter().any(|s| {
                s.id == id && s.state == "Running" && s.health.as_ref().is_some_and(|h| h.healthy)
            });
            if !ok {
                pending.push(format!("{}: {id} not healthy", n.name));
            }
        }
    }
    if let Some(m) = members
        && m.iter().map(String::as_str).collect::<BTreeSet<_>>() != control_planes
    {
        pending.push(format!(
            "etcd members ({}) are not the control planes ({})",
            m.iter()
                .map(|h| crate::input::excerpt(h, 64))
                .collect::<Vec<_>>()
                .join(", "),
            control_planes
                .iter()
                .copied()
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    match kube {
        Ok(list) => {
            for n in &plan.nodes {
                match list.iter().find(|k| k.name == n.name) {
                    Some(k) if k.ready && !k.cordoned => {}
                    Some(k) if k.ready => {
                        pending.push(format!("{}: Kubernetes node cordoned", n.name))
                    }
                    _ => pending.push(format!("{}: Kubernetes node not Ready", n.name)),
                }
            }
        }
        Err(e) => pending.push(format!("Kubernetes: {e}")),
    }
    pending.extend(addons);
    pending
}

/// Waits until [`unhealthy`] has nothing to say, at most `opts.health_timeout`.
pub async fn wait_healthy(
    plan: &Plan,
    node: &PlannedNode,
    opts: &Options,
) -> Result<(), HealthError> {
    let deadline = Instant::now() + opts.health_timeout;
    loop {
        let pending = unhealthy(plan, node, opts).await;
        if pending.is_empty() {
            return Ok(());
        }
        if Instant::now() + opts.poll > deadline {
            return Err(HealthError::Unhealthy {
                within: opts.health_timeout,
                pending,
            });
        }
        tokio::time::sleep(opts.poll).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cordoned_node_is_read_as_such() {
        let list = serde_json::json!({"items": [
            {"metadata": {"name": "w1"}, "spec": {"unschedulable": true},
             "status": {"conditions": [{"type": "Ready", "status": "True"}]}},
            {"metadata": {"name": "w2"}, "spec": {},
             "status": {"conditions": [{"type": "Ready", "status": "False"}]}},
            {"metadata": {"name": "w3", "annotations": {CORDONED_BY: "1764400000"}},
             "spec": {"unschedulable": true}, "status": {"conditions": []}},
        ]});
        let node = |name: &str, ready, cordoned, cordoned_by_imgbuild| KubeNode {
            name: name.into(),
            ready,
            cordoned,
            cordoned_by_imgbuild,
        };
        assert_eq!(
            nodes_of(&list),
            [
                node("w1", true, true, false),
                node("w2", false, false, false),
                node("w3", false, true, true)
            ]
        );
    }

    #[test]
    fn addons_count_unless_the_config_disables_them() {
        let cfg = b"version: v1alpha1\ncluster:\n  proxy:\n    disabled: true\n---\nkind: Other\n";
        assert!(disabled(cfg, "proxy"));
        assert!(!disabled(cfg, "coreDNS"));
        assert!(!disabled(
            b"cluster:\n  proxy:\n    disabled: false\n",
            "proxy"
        ));
    }
}
