//! Each Kubernetes component's version for `imgbuild status`: the static
//! pods per control plane, the kubelet per node, and the kube-proxy and
//! CoreDNS objects. A component not at the inventory's version (kube-proxy:
//! its image tag; CoreDNS: the image Talos renders for the running
//! version, which Talos never updates on its own) is drift that
//! `imgbuild upgrade` fixes. What could not be read is unknown, which is
//! not different.

use super::observe::{Addon, Observed};
use super::plan::{Component, tag_of, version_tag};
use crate::talos::status::Drift;

/// One component's row.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ComponentStatus {
    /// The node, or `cluster` for kube-proxy and CoreDNS.
    pub node: String,
    pub component: &'static str,
    /// What runs: a version (`v1.32.1`), or CoreDNS's image.
    pub running: Option<String>,
    pub wanted: Option<String>,
    pub in_sync: bool,
}

impl ComponentStatus {
    pub fn drift(&self) -> Option<Drift> {
        (!self.in_sync).then(|| Drift {
            node: self.node.clone(),
            what: self.component,
            fix: "imgbuild upgrade",
        })
    }
}

fn row(
    node: &str,
    component: &'static str,
    running: Option<String>,
    wanted: Option<String>,
) -> ComponentStatus {
    let in_sync = match (&running, &wanted) {
        (Some(r), Some(w)) => r == w,
        _ => true,
    };
    ComponentStatus {
        node: node.to_owned(),
        component,
        running,
        wanted,
        in_sync,
    }
}

/// The rows, control planes' static pods first, then kubelets, then the
/// add-ons; `kubernetes` is the inventory's version.
pub fn rows(observed: &Observed, kubernetes: &str) -> Vec<ComponentStatus> {
    let to = version_tag(kubernetes);
    let seen = &observed.cluster;
    let mut out = Vec::new();
    for n in seen.nodes.iter().filter(|n| n.control_plane) {
        for c in Component::STATIC_PODS {
            let v = n.components.get(&c).and_then(|s| s.version.clone());
            out.push(row(&n.node, c.name(), v, Some(to.clone())));
        }
    }
    for n in &seen.nodes {
        let v = n
            .components
            .get(&Component::Kubelet)
            .and_then(|s| s.version.clone());
        out.push(row(&n.node, "kubelet", v, Some(to.clone())));
    }
    for a in &observed.addons {
        match a {
            Addon {
                name: "kube-proxy", ..
            } if seen.proxy_disabled => {}
            Addon {
                name: "kube-proxy",
                live,
                ..
            } => {
                let v = live.as_deref().and_then(tag_of).map(str::to_owned);
                out.push(row("cluster", "kube-proxy", v, Some(to.clone())));
            }
            Addon {
                name,
                live,
                rendered,
            } => {
                out.push(row("cluster", name, live.clone(), rendered.clone()));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::talos::kubernetes::plan::{ClusterSeen, NodeSeen, Seen};

    fn observed(kubelet: &str, coredns: &str) -> Observed {
        let seen = |v: &str| Seen {
            version: Some(v.into()),
            ready: true,
        };
        let mut cp = NodeSeen {
            node: "cp-01".into(),
            control_plane: true,
            ..NodeSeen::default()
        };
        for c in Component::STATIC_PODS {
            cp.components.insert(c, seen("v1.33.5"));
        }
        cp.components.insert(Component::Kubelet, seen(kubelet));
        Observed {
            cluster: ClusterSeen {
                nodes: vec![cp],
                ..ClusterSeen::default()
            },
            addons: vec![
                Addon {
                    name: "kube-proxy",
                    live: Some("registry.k8s.io/kube-proxy:v1.33.5".into()),
                    rendered: None,
                },
                Addon {
                    name: "coredns",
                    live: Some(coredns.into()),
                    rendered: Some("registry.k8s.io/coredns/coredns:v1.12.3".into()),
                },
            ],
        }
    }

    #[test]
    fn components_off_the_inventory_version_are_drift() {
        let o = observed("v1.33.5", "registry.k8s.io/coredns/coredns:v1.12.3");
        let r = rows(&o, "1.33.5");
        assert_eq!(r.len(), 6);
        assert!(r.iter().all(|r| r.in_sync), "{r:?}");
        let o = observed("v1.32.1", "registry.k8s.io/coredns/coredns:v1.11.1");
        let drift: Vec<(String, &str)> = rows(&o, "1.33.5")
            .iter()
            .filter_map(ComponentStatus::drift)
            .map(|d| (d.node, d.what))
            .collect();
        assert_eq!(
            drift,
            [("cp-01".into(), "kubelet"), ("cluster".into(), "coredns")]
        );
    }

    #[test]
    fn unknown_is_not_different_and_a_disabled_proxy_has_no_row() {
        let mut o = observed("v1.33.5", "x");
        o.addons[1].rendered = None;
        o.cluster.proxy_disabled = true;
        let r = rows(&o, "v1.33.5");
        assert!(r.iter().all(|r| r.in_sync));
        assert!(!r.iter().any(|r| r.component == "kube-proxy"));
    }
}
