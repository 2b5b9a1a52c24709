//! Talos's bootstrap manifests: what a control plane renders from its
//! config, the resources a client reads them from, and the apply that
//! creates what is missing and never updates what exists.
//!
//! Upstream (siderolabs/talos v1.11.5, the same IDs v1.9–v1.14):
//! `internal/app/machined/pkg/controllers/k8s/manifest.go` renders one
//! `Manifests.kubernetes.talos.dev` resource per ID in the `controlplane`
//! namespace (`pkg/machinery/resources/k8s/manifest.go`; its YAML spec is the
//! list of objects) — `05-flannel` when the CNI is flannel, `10-kube-proxy`
//! unless `cluster.proxy.disabled`, `11-core-dns` and `11-core-dns-svc`
//! unless `cluster.coreDNS.disabled`, and the always-present RBAC ones;
//! `manifest_apply.go` creates each object that does not exist (field
//! manager `talos`) and skips one that does ("already exists; continue"),
//! which is why kube-proxy and CoreDNS stay on their bootstrap images until
//! someone syncs them (siderolabs/talos#11524). talosctl's `upgrade-k8s`
//! reads them with `manifests.GetBootstrapManifests` (siderolabs/
//! go-kubernetes `kubernetes/manifests/get.go`: a COSI List) from the first
//! node and syncs them (PUT before v1.13, server-side apply with field
//! manager `talos` from v1.13: `pkg/cluster/kubernetes/talos_managed.go`).
//!
//! Simplified: the objects carry the fields that matter here (names,
//! labels, selectors, images, replicas), not Talos's full templates; the
//! `00-kubelet-bootstrapping-token`, `01-csr-*` (but one), `11-kube-config-
//! in-cluster`, `11-talos-node-rbac-template` and `13-talos-service-account-
//! crd` manifests are left out (the first holds a bootstrap token).

use std::sync::Arc;
use std::time::Instant;

use serde_json::{Value, json};

use super::versions::{self, Component};
use super::writes;
use crate::node::service::Api;
use crate::node::state::{Cluster, reached};
use crate::node::state::{Key, Store};
use crate::node::version::Talos;
use imgbuild::talos::api::cosi::resource::{Metadata as ResMetadata, Resource, Spec};

/// A rendered manifest: its ID and objects.
pub(crate) struct Manifest {
    pub id: &'static str,
    pub objects: Vec<Value>,
}

fn meta(name: &str, namespace: Option<&str>, labels: Value) -> Value {
    let mut m = json!({"name": name, "labels": labels});
    if let Some(ns) = namespace {
        m["namespace"] = json!(ns);
    }
    m
}

fn object(api: &str, kind: &str, metadata: Value, rest: Value) -> Value {
    let mut o = json!({"apiVersion": api, "kind": kind, "metadata": metadata});
    if let Value::Object(extra) = rest {
        o.as_object_mut().unwrap().extend(extra);
    }
    o
}

fn service_account(name: &str) -> Value {
    object(
        "v1",
        "ServiceAccount",
        meta(name, Some("kube-system"), json!({})),
        json!({}),
    )
}

fn cluster_role_binding(name: &str, role: &str, subject: Value) -> Value {
    object(
        "rbac.authorization.k8s.io/v1",
        "ClusterRoleBinding",
        meta(name, None, json!({})),
        json!({
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [subject],
        }),
    )
}

fn sa_subject(name: &str) -> Value {
    json!({"kind": "ServiceAccount", "name": name, "namespace": "kube-system"})
}

/// A pod template with one container.
fn template(app: &str, container: &str, image: &str, sa: &str, host_network: bool) -> Value {
    json!({
        "metadata": {"labels": {"k8s-app": app}},
        "spec": {
            "serviceAccountName": sa,
            "hostNetwork": host_network,
            "priorityClassName": "system-node-critical",
            "tolerations": [{"operator": "Exists"}],
            "containers": [{"name": container, "image": image}],
        },
    })
}

/// What a control plane with `config` renders on `talos`.
pub(crate) fn render(config: &Value, talos: &Talos) -> Vec<Manifest> {
    let cluster = &config["cluster"];
    let mut out = vec![Manifest {
        id: "01-csr-approver-role-binding",
        objects: vec![cluster_role_binding(
            "system-bootstrap-approve-node-client-csr",
            "system:certificates.k8s.io:certificatesigningrequests:nodeclient",
            json!({"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "system:bootstrappers"}),
        )],
    }];
    if cluster["coreDNS"]["disabled"] != json!(true) {
        let image = versions::coredns_image(config, talos);
        let domain = cluster["network"]["dnsDomain"]
            .as_str()
            .unwrap_or("cluster.local");
        out.push(Manifest {
            id: "11-core-dns",
            objects: vec![
                service_account("coredns"),
                object(
                    "rbac.authorization.k8s.io/v1",
                    "ClusterRole",
                    meta("system:coredns", None, json!({})),
                    json!({"rules": [{"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"], "verbs": ["list", "watch"]}]}),
                ),
                cluster_role_binding("system:coredns", "system:coredns", sa_subject("coredns")),
                object(
                    "v1",
                    "ConfigMap",
                    meta("coredns", Some("kube-system"), json!({})),
                    json!({"data": {"Corefile": format!(".:53 {{\n    errors\n    health\n    ready\n    kubernetes {domain} in-addr.arpa ip6.arpa\n    forward . /etc/resolv.conf\n    cache 30\n}}\n")}}),
                ),
                object(
                    "apps/v1",
                    "Deployment",
                    meta(
                        "coredns",
                        Some("kube-system"),
                        json!({"k8s-app": "kube-dns", "kubernetes.io/name": "CoreDNS"}),
                    ),
                    json!({"spec": {
                        "replicas": 2,
                        "selector": {"matchLabels": {"k8s-app": "kube-dns"}},
                        "template": template("kube-dns", "coredns", &image, "coredns", false),
                    }}),
                ),
            ],
        });
        out.push(Manifest {
            id: "11-core-dns-svc",
            objects: vec![object(
                "v1",
                "Service",
                meta(
                    "kube-dns",
                    Some("kube-system"),
                    json!({"k8s-app": "kube-dns", "kubernetes.io/name": "CoreDNS"}),
                ),
                json!({"spec": {"selector": {"k8s-app": "kube-dns"},
                    "ports": [{"name": "dns", "port": 53, "protocol": "UDP"}, {"name": "dns-tcp", "port": 53, "protocol": "TCP"}]}}),
            )],
        });
    }
    let cni = cluster["network"]["cni"]["name"]
        .as_str()
        .unwrap_or("flannel");
    if cni == "flannel" {
        out.push(Manifest {
            id: "05-flannel",
            objects: vec![
                object(
                    "rbac.authorization.k8s.io/v1",
                    "ClusterRole",
                    meta("flannel", None, json!({})),
                    json!({"rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}]}),
                ),
                cluster_role_binding("flannel", "flannel", sa_subject("flannel")),
                service_account("flannel"),
                object(
                    "apps/v1",
                    "DaemonSet",
                    meta(
                        "kube-flannel",
                        Some("kube-system"),
                        json!({"k8s-app": "flannel", "tier": "node"}),
                    ),
                    json!({"spec": {
                        "selector": {"matchLabels": {"k8s-app": "flannel"}},
                        "template": template("flannel", "kube-flannel", &versions::flannel_image(talos), "flannel", true),
                    }}),
                ),
            ],
        });
    }
    if cluster["proxy"]["disabled"] != json!(true) {
        let image = versions::proxy_image(config, talos);
        out.push(Manifest {
            id: "10-kube-proxy",
            objects: vec![
                object(
                    "apps/v1",
                    "DaemonSet",
                    meta(
                        "kube-proxy",
                        Some("kube-system"),
                        json!({"k8s-app": "kube-proxy", "tier": "node"}),
                    ),
                    json!({"spec": {
                        "selector": {"matchLabels": {"k8s-app": "kube-proxy"}},
                        "template": template("kube-proxy", "kube-proxy", &image, "kube-proxy", true),
                    }}),
                ),
                service_account("kube-proxy"),
                cluster_role_binding("kube-proxy", "system:node-proxier", sa_subject("kube-proxy")),
            ],
        });
    }
    out
}

/// The inventory ConfigMap in kube-system (talos `pkg/machinery/constants`
/// `KubernetesBootstrapManifestsInventoryName`) and the annotation naming
/// it on each object (go-kubernetes `kubernetes/ssa/inventory.go`).
pub(crate) const INVENTORY: &str = "talos-bootstrap-manifests-inventory";
pub(crate) const INVENTORY_ANNOTATION: &str = "config.k8s.io/owning-inventory";

/// The inventory's name for an object, a key of its ConfigMap's `data`
/// (fluxcd/cli-utils `pkg/object/objmetadata.go` `ObjMetadata.String`:
/// `namespace_name_group_kind`, a colon in an RBAC name as `__`).
pub(crate) fn inventory_entry(namespace: &str, name: &str, group: &str, kind: &str) -> String {
    let name = if group == "rbac.authorization.k8s.io" {
        name.replace(':', "__")
    } else {
        name.to_owned()
    };
    format!("{namespace}_{name}_{group}_{kind}")
}

fn inventory_key() -> Key {
    (
        "v1".into(),
        "configmaps".into(),
        "kube-system".into(),
        INVENTORY.into(),
    )
}

impl Store {
    /// Talos v1.13+ `manifest_apply.go` under its etcd lock: reads the
    /// inventory ConfigMap (creating it empty), skips each object the
    /// inventory lists — even one deleted since —, adds one that exists to
    /// the inventory, creates one that does not by a server-side apply as
    /// `talos` with the `config.k8s.io/owning-inventory` annotation
    /// (namespaces first, then CRDs), then writes the inventory back whole
    /// (a PUT without resourceVersion: `configmap/inventory.go` `Write`).
    /// The typed client's manager is its User-Agent's first part; the
    /// simulator calls it `machined`.
    pub(crate) fn talos_inventory_apply(&mut self, mut objects: Vec<Value>, now: Instant) {
        let key = inventory_key();
        if !self.objects.contains_key(&key) {
            let o = json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": INVENTORY, "namespace": "kube-system"}});
            self.create_if_missing(o, "machined", now);
        }
        let mut inventory: Vec<String> = self.objects[&key].object["data"]
            .as_object()
            .map(|d| d.keys().cloned().collect())
            .unwrap_or_default();
        let rank = |o: &Value| match o["kind"].as_str() {
            Some("Namespace") => 0,
            Some("CustomResourceDefinition") => 1,
            _ => 2,
        };
        objects.sort_by_key(rank);
        for mut o in objects {
            let api = o["apiVersion"].as_str().unwrap_or_default().to_owned();
            let kind = o["kind"].as_str().unwrap_or_default().to_owned();
            let Some(resource) = Self::resource_of(&kind, &api) else {
                continue;
            };
            let namespaced = self.kind_of(&api, resource).is_some_and(|(_, n)| n);
            let name = o["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let namespace = match o["metadata"]["namespace"].as_str() {
                Some(ns) if namespaced => ns.to_owned(),
                None if namespaced => "default".to_owned(),
                _ => String::new(),
            };
            let entry = inventory_entry(&namespace, &name, super::objects::group_of(&api), &kind);
            if inventory.contains(&entry) {
                continue;
            }
            let key = (api, resource.to_owned(), namespace, name);
            if !self.objects.contains_key(&key) {
                o["metadata"]["annotations"][INVENTORY_ANNOTATION] = json!(INVENTORY);
                if !matches!(
                    self.apply(&key, &kind, o, "talos", false, now),
                    super::objects::Applied::Created
                ) {
                    continue;
                }
            }
            inventory.push(entry);
        }
        let mut object = json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": INVENTORY, "namespace": "kube-system"}});
        if !inventory.is_empty() {
            object["data"] = inventory.iter().map(|e| (e.clone(), json!(""))).collect();
        }
        self.replace(&key, object, "machined", now);
    }
}

/// `Manifests.kubernetes.talos.dev` in namespace `controlplane`.
pub(crate) const MANIFEST_TYPE: &str = "Manifests.kubernetes.talos.dev";
pub(crate) const CONTROL_PLANE_NS: &str = "controlplane";

impl Cluster {
    /// What control plane `i` renders now (None: not a configured control
    /// plane).
    pub(crate) fn k8s_rendered(&self, i: usize) -> Option<Vec<Manifest>> {
        let node = self.node(i);
        if !node.control_plane() {
            return None;
        }
        let st = node.st.lock().unwrap();
        let applied = st.applied.as_ref()?;
        if applied.v1alpha1.is_null() {
            return None;
        }
        let talos = Talos::parse(&st.day2.version_or(&self.args.talos_version))?;
        Some(render(&applied.v1alpha1, &talos))
    }

    /// The Talos release control plane `i` runs.
    fn k8s_talos(&self, i: usize) -> Option<Talos> {
        let node = self.node(i);
        let st = node.st.lock().unwrap();
        Talos::parse(&st.day2.version_or(&self.args.talos_version))
    }

    /// `manifest_apply.go` on every control plane whose etcd is healthy,
    /// once the API server is up (which keeps its system namespaces): each
    /// rendered object that does not exist is created by `talos`; one that
    /// exists is left as it is. From v1.13 through the inventory
    /// ([`Store::talos_inventory_apply`]).
    pub(crate) fn k8s_bootstrap_manifests(&self, now: Instant) {
        if !reached(self.api_up_at(), now) {
            return;
        }
        {
            let mut k8s = self.k8s.lock().unwrap();
            for ns in writes::SYSTEM_NAMESPACES {
                let o = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}});
                k8s.objects.create_if_missing(o, "kube-apiserver", now);
            }
        }
        for i in 0..self.count() {
            if !reached(self.etcd_healthy_at(i), now) {
                continue;
            }
            let Some(manifests) = self.k8s_rendered(i) else {
                continue;
            };
            let inventory = self
                .k8s_talos(i)
                .is_some_and(|t| t.applies_manifests_by_inventory());
            let mut k8s = self.k8s.lock().unwrap();
            let objects = manifests.into_iter().flat_map(|m| m.objects);
            if inventory {
                k8s.objects.talos_inventory_apply(objects.collect(), now);
            } else {
                for o in objects {
                    k8s.objects.create_if_missing(o, "talos", now);
                }
            }
        }
    }
}

impl Cluster {
    /// The version of node `i`'s `Manifests` resource `id` now rendering
    /// `yaml`: COSI bumps a resource's version on every change of its spec
    /// (`manifest.go` controller's `safe.WriterModify`), so it starts at 1
    /// and goes up each time the rendered objects change (seen when read).
    pub(crate) fn k8s_manifest_version(&self, i: usize, id: &'static str, yaml: &str) -> u64 {
        let identity = Arc::as_ptr(&self.node(i)) as usize;
        let mut k8s = self.k8s.lock().unwrap();
        let entry = k8s
            .manifest_versions
            .entry((i, id))
            .or_insert_with(|| (identity, yaml.to_owned(), 1));
        if entry.0 != identity {
            *entry = (identity, yaml.to_owned(), 1);
        } else if entry.1 != yaml {
            entry.1 = yaml.to_owned();
            entry.2 += 1;
        }
        entry.2
    }
}

/// A resource with a YAML spec.
fn resource(
    namespace: &str,
    kind: &str,
    id: &str,
    version: u64,
    owner: &str,
    yaml: String,
) -> Resource {
    Resource {
        metadata: Some(ResMetadata {
            namespace: namespace.into(),
            r#type: kind.into(),
            id: id.into(),
            version: version.to_string(),
            phase: "running".into(),
            owner: owner.into(),
            ..ResMetadata::default()
        }),
        spec: Some(Spec {
            proto_spec: Vec::new(),
            yaml_spec: yaml,
        }),
    }
}

impl Api {
    /// The Kubernetes-side COSI resources of node `i` in `namespace` of
    /// type `kind` (None: not one of them): `Manifests`, the control-plane
    /// component configs (`pkg/machinery/resources/k8s/
    /// {apiserver,controllermanager,scheduler}_config.go`, versioned as the
    /// static pods' `talos.dev/config-version`), `KubeletSpecs`
    /// (`kubelet_spec.go`), and the running `MachineConfigs`
    /// (`pkg/machinery/resources/config/machine_config.go`, ID `v1alpha1`,
    /// which talosctl's `patch.go` patches).
    pub(crate) fn k8s_resources(
        &self,
        i: usize,
        namespace: &str,
        kind: &str,
    ) -> Option<Vec<Resource>> {
        let now = Instant::now();
        let component = |c: Component| -> Vec<Resource> {
            let Some((image, _)) = self.cluster.k8s_component(i, c, now) else {
                return Vec::new();
            };
            let version = self.cluster.k8s_config_version(i, c).unwrap_or(1);
            vec![resource(
                namespace,
                kind,
                c.id(),
                version,
                "k8s.ControlPlaneController",
                format!("image: {image}\n"),
            )]
        };
        Some(match (namespace, kind) {
            (CONTROL_PLANE_NS, MANIFEST_TYPE) => self.manifest_resources(i),
            (CONTROL_PLANE_NS, "APIServerConfigs.kubernetes.talos.dev") => {
                component(Component::ApiServer)
            }
            (CONTROL_PLANE_NS, "ControllerManagerConfigs.kubernetes.talos.dev") => {
                component(Component::ControllerManager)
            }
            (CONTROL_PLANE_NS, "SchedulerConfigs.kubernetes.talos.dev") => {
                component(Component::Scheduler)
            }
            ("k8s", "KubeletSpecs.kubernetes.talos.dev") => component(Component::Kubelet),
            ("config", "MachineConfigs.config.talos.dev") => {
                let applied = self.cluster.node(i).st.lock().unwrap().applied.clone();
                applied
                    .filter(|a| !a.raw.is_empty())
                    .map(|a| resource(namespace, kind, "v1alpha1", 1, "", a.raw.clone()))
                    .into_iter()
                    .collect()
            }
            _ => return None,
        })
    }

    /// The `Manifests` resources node `i` holds (a worker: none).
    pub(crate) fn manifest_resources(&self, i: usize) -> Vec<Resource> {
        let Some(manifests) = self.cluster.k8s_rendered(i) else {
            return Vec::new();
        };
        manifests
            .into_iter()
            .map(|m| {
                let yaml = serde_yaml_ng::to_string(&m.objects).unwrap_or_default();
                let version = self.cluster.k8s_manifest_version(i, m.id, &yaml);
                resource(
                    CONTROL_PLANE_NS,
                    MANIFEST_TYPE,
                    m.id,
                    version,
                    "k8s.ManifestController",
                    yaml,
                )
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(m: &[Manifest]) -> Vec<&str> {
        m.iter().map(|m| m.id).collect()
    }

    #[test]
    fn the_render_follows_the_config_and_the_talos_release() {
        let t = Talos::parse("v1.11.5").unwrap();
        let cfg = json!({"cluster": {"proxy": {"image": "registry.k8s.io/kube-proxy:v1.32.1"}}});
        let m = render(&cfg, &t);
        assert_eq!(
            ids(&m),
            [
                "01-csr-approver-role-binding",
                "11-core-dns",
                "11-core-dns-svc",
                "05-flannel",
                "10-kube-proxy"
            ]
        );
        let proxy = &m[4].objects[0];
        assert_eq!(
            proxy["spec"]["template"]["spec"]["containers"][0]["image"],
            "registry.k8s.io/kube-proxy:v1.32.1"
        );
        let dns = &m[1].objects[4];
        assert_eq!(dns["kind"], "Deployment");
        assert_eq!(
            dns["spec"]["template"]["spec"]["containers"][0]["image"],
            "registry.k8s.io/coredns/coredns:v1.12.4"
        );
        let off = json!({"cluster": {"proxy": {"disabled": true}, "coreDNS": {"disabled": true},
            "network": {"cni": {"name": "none"}}}});
        assert_eq!(ids(&render(&off, &t)), ["01-csr-approver-role-binding"]);
    }
}
