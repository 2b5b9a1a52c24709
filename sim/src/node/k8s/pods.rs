//! The Kubernetes components a node runs from its machine config, and how
//! they restart when the config changes: kube-apiserver, kube-controller-
//! manager and kube-scheduler as static pods on control planes (their mirror
//! pods in `kube-system`), the kubelet on every node (its Node's
//! `status.nodeInfo.kubeletVersion`).
//!
//! Upstream (siderolabs/talos, v1.9.6–v1.14): a config change reaches
//! `internal/app/machined/pkg/controllers/k8s/control_plane.go` (the
//! `APIServerConfig`/`ControllerManagerConfig`/`SchedulerConfig` resources,
//! whose version goes up when they change), then
//! `control_plane_static_pod.go` writes the static pod with labels
//! `k8s-app`/`tier: control-plane` and the annotation
//! `talos.dev/config-version` = that resource version; the kubelet replaces
//! the pod (not Ready until the new container is). talosctl's
//! `pkg/cluster/kubernetes/talos_managed.go` `checkPodStatus` waits for the
//! mirror pod with `k8s-app=<component>`, `status.hostIP` = the node, the
//! expected config version and Ready. A kubelet image change restarts the
//! kubelet service (`kubelet_service.go`); talosctl's `kubelet.go` then waits
//! for the Node (matched by `status.addresses`) to report the new
//! `kubeletVersion` and Ready. Config fields under `.cluster` and
//! `.machine.kubelet` apply without a reboot on every modelled version
//! (`immediate.rs`), so these restarts follow an `ApplyConfiguration`
//! NO_REBOOT.
//!
//! A watcher notices config changes within [`TICK`] (every way a config
//! changes — apply, TRY and its rollback, a staged config at boot — goes
//! through `NodeState::applied`), so no apply path needs a hook.
//!
//! # Interface (see also `objects.rs`)
//! ```text
//!     [--static-pod-delay MS]     a static pod's restart after its image changes (default 300):
//!                                 not Ready meanwhile, and that node's API server (port
//!                                 6443) refuses connections while its kube-apiserver restarts
//!     [--kubelet-restart-delay MS] a kubelet's restart after its image changes (default 300):
//!                                 its Node NotReady with the old kubeletVersion meanwhile, the
//!                                 `kubelet` service unhealthy in ServiceList
//!     [--rollout-delay MS]        a DaemonSet/Deployment rollout after its pod template
//!                                 changes (default 300)
//!     [--node-monitor-grace-period MS] a silent kubelet's Node turns Ready Unknown after
//!                                 this (default 40000)
//! ```
//! - `GET /api/v1/namespaces/kube-system/pods?labelSelector=k8s-app%3Dkube-apiserver`
//!   (also `k8s-app = kube-apiserver`, as client-go sends it; likewise
//!   `kube-controller-manager`, `kube-scheduler`): one mirror pod per registered control
//!   plane, `metadata.name` `<component>-<node>`, `labels` {k8s-app, tier}, `annotations`
//!   {`talos.dev/config-version`: "N", `kubernetes.io/config.source`: "file",
//!   `kubernetes.io/config.mirror`}, `spec.nodeName`, `spec.containers[0].image`,
//!   `status.{phase, hostIP, podIP, conditions[Ready], containerStatuses[0].{image, ready}}`.
//!   Restarting: the new image, phase Pending, Ready False.
//! - `GET /api/v1/nodes` items add `metadata.labels` (`kubernetes.io/hostname`,
//!   `node-role.kubernetes.io/control-plane: ""` on control planes),
//!   `status.addresses` [{InternalIP: the node's address}, {Hostname}] and
//!   `status.nodeInfo.kubeletVersion` (`v1.33.5`, from the kubelet image tag).
//! - COSI State Get/List (over the node's Talos API, routed by `node`):
//!   `controlplane`/`APIServerConfigs.kubernetes.talos.dev` (`kube-apiserver`),
//!   `ControllerManagerConfigs…` (`kube-controller-manager`), `SchedulerConfigs…`
//!   (`kube-scheduler`) on control planes: `metadata.version` = the config version the
//!   mirror pod's annotation reaches, spec `image: …`; `k8s`/`KubeletSpecs.kubernetes.
//!   talos.dev` (`kubelet`): spec `image: …`; `config`/`MachineConfigs.config.talos.dev`
//!   (`v1alpha1`): spec = the running config as applied.
//! - ApplyConfiguration (and a boot with a config) on Talos v1.11+: a kubelet image (or, on
//!   a control plane, a kube-apiserver/controller-manager/scheduler image) whose Kubernetes
//!   version the running Talos does not support → InvalidArgument "1 error occurred:\n\t*
//!   kubelet image is not valid: version of Kubernetes 1.35.0 is too new to be used with
//!   Talos 1.11.5\n\n" (`versions.rs`); nothing changes.
//! - Image pulls (talos api/machine/machine.proto, api/machine/image.proto). `ImageService.Pull` (v1.13+, Unimplemented
//!   before) checks its `ContainerdInstance` as `ctrhelper.go` does: driver
//!   `CONTAINERD` = the system containerd, `CRI` = the CRI one; `NS_CRI` = `k8s.io`,
//!   `NS_SYSTEM` = `system`; else InvalidArgument "invalid containerd driver %s" /
//!   "invalid containerd namespace %s"; `CONTAINERD` with `NS_CRI` → InvalidArgument
//!   "cannot use CRI namespace with containerd driver". `MachineService.ImagePull`
//!   (v1.5+, deprecated from v1.13, still served; `v1alpha1_images.go`): always the CRI
//!   containerd, `NS_CRI` → `k8s.io`, `NS_SYSTEM` → `system`, else InvalidArgument
//!   "invalid namespace %s". A Kubernetes image (`registry.k8s.io/kube-apiserver`,
//!   `…/kube-controller-manager`, `…/kube-scheduler`, `…/kube-proxy`, `…/coredns/coredns`,
//!   `ghcr.io/siderolabs/kubelet`) with a version tag is pulled after
//!   `--pull-cached-delay` (no registry is asked); another tag of those → NotFound.
//!   `LifecycleService.Upgrade` runs the installer from the containerd and namespace
//!   it names, so it must have been pulled there. A kubelet whose image changes pulls
//!   it itself into the CRI containerd's `system` namespace (services/kubelet.go
//!   PreFunc) unless it is there: a pre-pull elsewhere fails nothing, it only does
//!   not save that pull — as on a real node.
//! - A node that goes down (halted, rebooting) keeps its Node object and its last
//!   status for `--node-monitor-grace-period` MS (default 40000, kube-controller-
//!   manager's; `POST /_sim/k8s {"node_monitor_grace_period": MS}` replaces it), then
//!   Ready `Unknown` (reason `NodeStatusUnknown`) with the `node.kubernetes.io/
//!   unreachable` NoSchedule and NoExecute taints (`node_lifecycle_controller.go`).
//! - A component restarts, and its config version goes up, on any change of the
//!   config its Talos resource is built from (`spec_of`), not only its image.
//! - `GET /_sim/stats` adds `k8s`: `restarts` ([{node, control_plane, component,
//!   from_image, image, start_ms, ready_ms (null while restarting or when a later change
//!   superseded it)}], by start), `components` ({NODE: {COMPONENT: {image, ready,
//!   config_version}}}), `pulled` ({NODE: [image…]}, Kubernetes images pulled through
//!   either API), `image_pulls` ([{node, api (`ImageService.Pull`,
//!   `MachineService.ImagePull`, `kubelet service`, `kubelet (static pod)`), driver,
//!   namespace (enum names as sent, null when the API has none), image, at
//!   (`cri/k8s.io`, `cri/system`, `system/system`; null when refused), code (`Ok` or
//!   the gRPC code), message}] in order), and what `objects.rs` adds; each node's
//!   `day2.images` is `{PLACE: [image…]}` (the system containerd's are gone with a
//!   boot).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use tonic::{Request, Response, Status};

use super::versions::{self, Component};
use crate::node::state::Running;
use crate::node::state::{Cluster, Phase, ms};
use crate::node::state::{K8s, NodeComponents, Restart};
use crate::node::version::Talos;
use imgbuild::talos::api::common::{ContainerDriver, ContainerdInstance, ContainerdNamespace};
use imgbuild::talos::api::machine::{ImagePull, ImagePullRequest, ImagePullResponse};

/// How often the watcher looks at the nodes' configs.
pub(crate) const TICK: Duration = Duration::from_millis(20);

/// What the watcher reads from one node.
struct Seen {
    identity: usize,
    name: String,
    control_plane: bool,
    /// Each component's image and its Talos config resource's spec.
    images: Vec<(Component, String, String)>,
}

/// The part of the machine config a component's Talos config resource is
/// built from (`internal/app/machined/pkg/controllers/k8s/control_plane.go`
/// `APIServerConfig`: image, cloud provider, control-plane endpoint,
/// service CIDRs, extra args/volumes, env, resources…; likewise the
/// controller manager's and the scheduler's; `kubelet_spec.go` for the
/// kubelet: `.machine.kubelet` and the cluster DNS from `.cluster.network`).
/// Any change in it is a new resource version, which the static pod's
/// `talos.dev/config-version` follows, and restarts the component.
fn spec_of(c: Component, v1alpha1: &Value) -> String {
    let cluster = &v1alpha1["cluster"];
    let parts = match c {
        Component::ApiServer => json!([
            cluster["apiServer"],
            cluster["network"],
            cluster["controlPlane"],
            cluster["externalCloudProvider"]
        ]),
        Component::ControllerManager => json!([
            cluster["controllerManager"],
            cluster["network"],
            cluster["externalCloudProvider"]
        ]),
        Component::Scheduler => json!([cluster["scheduler"]]),
        Component::Kubelet => json!([v1alpha1["machine"]["kubelet"], cluster["network"]]),
    };
    parts.to_string()
}

impl Cluster {
    /// The node `i`'s configured components, if it runs any now.
    fn seen(&self, i: usize, now: Instant) -> Option<Seen> {
        let node = self.node(i);
        if node.phase(now) != Phase::Configured {
            return None;
        }
        let name = node.display_name();
        let control_plane = node.control_plane();
        let st = node.st.lock().unwrap();
        let applied = st.applied.as_ref()?;
        if applied.v1alpha1.is_null() {
            return None;
        }
        let talos = Talos::parse(&st.day2.version_or(&self.args.talos_version))?;
        let mut components = vec![Component::Kubelet];
        if control_plane {
            components.extend(Component::CONTROL_PLANE);
        }
        let images = components
            .into_iter()
            .map(|c| {
                let image = versions::image_of(c, &applied.v1alpha1, &talos);
                (c, image, spec_of(c, &applied.v1alpha1))
            })
            .collect();
        Some(Seen {
            identity: Arc::as_ptr(&node) as usize,
            name,
            control_plane,
            images,
        })
    }

    /// Records every component whose image changed since the last look:
    /// it restarts from `now`.
    pub(crate) fn k8s_observe(&self, now: Instant) {
        let seen: Vec<(usize, Seen)> = (0..self.count())
            .filter_map(|i| Some((i, self.seen(i, now)?)))
            .collect();
        let delays = &self.args.k8s;
        // Images the kubelet pulls itself: its own (services/kubelet.go
        // PreFunc pulls it into the CRI containerd, namespace `system`,
        // skipping it when already there) and the static pods' (CRI
        // `k8s.io`); (node, component, image, restarted).
        let mut pulls: Vec<(usize, Component, String, bool)> = Vec::new();
        let mut k8s = self.k8s.lock().unwrap();
        let K8s {
            nodes, timeline, ..
        } = &mut *k8s;
        for (i, s) in seen {
            let entry = nodes.entry(i).or_insert_with(|| NodeComponents {
                node: s.identity,
                running: BTreeMap::new(),
            });
            if entry.node != s.identity {
                entry.node = s.identity;
                entry.running.clear();
            }
            for (component, image, spec) in s.images {
                let Some(r) = entry.running.get_mut(&component) else {
                    pulls.push((i, component, image.clone(), false));
                    entry.running.insert(
                        component,
                        Running {
                            previous: image.clone(),
                            image,
                            spec,
                            ready_at: now,
                            config_version: 1,
                            restart: None,
                        },
                    );
                    continue;
                };
                if r.image == image && r.spec == spec {
                    continue;
                }
                let delay = if component == Component::Kubelet {
                    delays.kubelet_restart_delay
                } else {
                    delays.static_pod_delay
                };
                if let Some(prev) = r.restart.filter(|_| now < r.ready_at) {
                    timeline[prev].superseded = true;
                }
                timeline.push(Restart {
                    node: s.name.clone(),
                    control_plane: s.control_plane,
                    component,
                    from_image: r.image.clone(),
                    image: image.clone(),
                    start: now,
                    ready: now + ms(delay),
                    superseded: false,
                });
                if r.image != image {
                    pulls.push((i, component, image.clone(), true));
                }
                r.spec = spec;
                r.previous = std::mem::replace(&mut r.image, image);
                r.ready_at = now + ms(delay);
                r.config_version += 1;
                r.restart = Some(timeline.len() - 1);
            }
        }
        drop(k8s);
        for (i, component, image, restarted) in pulls {
            let (place, api) = if component == Component::Kubelet {
                (CRI_SYSTEM, "kubelet service")
            } else {
                (CRI_K8S, "kubelet (static pod)")
            };
            let held = self
                .node(i)
                .st
                .lock()
                .unwrap()
                .day2
                .images
                .contains(&(place, image.clone()));
            if !restarted || held {
                // There since the node booted, or pre-pulled: no pull.
                let node = self.node(i);
                node.st.lock().unwrap().day2.images.insert((place, image));
                continue;
            }
            let call = PullCall {
                node: i,
                api,
                driver: None,
                namespace: None,
                image: &image,
            };
            self.record_pull(call, &Ok(place));
        }
    }

    fn running(&self, i: usize, c: Component) -> Option<Running> {
        let k8s = self.k8s.lock().unwrap();
        k8s.nodes.get(&i)?.running.get(&c).cloned()
    }

    /// Node `i`'s `c` is restarting (a kube-apiserver's port 6443 refuses
    /// meanwhile, a kubelet's service is unhealthy).
    pub(crate) fn k8s_restarting(&self, i: usize, c: Component, now: Instant) -> bool {
        self.running(i, c).is_some_and(|r| now < r.ready_at)
    }

    /// The image of the process that answers for node `i`'s `c` now: the
    /// previous one while it restarts (a request on a connection accepted
    /// before the restart is still served by the old process).
    pub(crate) fn k8s_serving(&self, i: usize, c: Component, now: Instant) -> Option<String> {
        self.running(i, c).map(|r| {
            if now < r.ready_at {
                r.previous
            } else {
                r.image
            }
        })
    }

    /// The image node `i` runs `c` with, and whether it is ready.
    pub(crate) fn k8s_component(
        &self,
        i: usize,
        c: Component,
        now: Instant,
    ) -> Option<(String, bool)> {
        self.running(i, c).map(|r| (r.image, now >= r.ready_at))
    }

    /// When node `i`'s `c` last came up after a restart (None: it never
    /// restarted since it was first seen).
    pub(crate) fn k8s_started(&self, i: usize, c: Component) -> Option<Instant> {
        self.running(i, c)
            .filter(|r| r.restart.is_some())
            .map(|r| r.ready_at)
    }

    /// The config version of node `i`'s `c` (its Talos config resource's).
    pub(crate) fn k8s_config_version(&self, i: usize, c: Component) -> Option<u64> {
        self.running(i, c).map(|r| r.config_version)
    }

    /// The `status.nodeInfo` `machineID` and `bootID` node `i`'s kubelet
    /// reports (kubernetes `pkg/kubelet/nodestatus/setters.go` `MachineInfo`:
    /// cAdvisor's `/etc/machine-id`, which Talos writes from the node
    /// identity, `identity.rs`; and `/proc/sys/kernel/random/boot_id`).
    /// No `systemUUID`: the simulated machines have no SMBIOS.
    pub(crate) fn k8s_node_ids(&self, i: usize) -> (Option<String>, String) {
        let node = self.node(i);
        let st = node.st.lock().unwrap();
        (
            super::super::identity::machine_id(&st.node_id),
            st.day2.life.boot_id().to_owned(),
        )
    }

    /// Adds to a Node item what the kubelet reports: labels, addresses,
    /// its version, machine and boot IDs; NotReady while it restarts.
    pub(crate) fn k8s_node_item(&self, i: usize, item: &mut Value, now: Instant) {
        let node = self.node(i);
        let name = item["metadata"]["name"].clone();
        let mut labels = json!({"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"});
        if node.control_plane() {
            labels["node-role.kubernetes.io/control-plane"] = json!("");
        }
        item["metadata"]["labels"] = labels;
        item["status"]["addresses"] = json!([
            {"type": "InternalIP", "address": node.ip.to_string()},
            {"type": "Hostname", "address": name},
        ]);
        let Some(kubelet) = self.running(i, Component::Kubelet) else {
            return;
        };
        let restarting = now < kubelet.ready_at;
        let image = if restarting {
            &kubelet.previous
        } else {
            &kubelet.image
        };
        let (machine_id, boot_id) = self.k8s_node_ids(i);
        item["status"]["nodeInfo"] = json!({
            "kubeletVersion": versions::kubelet_version(image),
            "containerRuntimeVersion": "containerd://2.1.4",
            "operatingSystem": "linux",
            "machineID": machine_id,
            "bootID": boot_id,
        });
        if restarting {
            // kubernetes pkg/kubelet/nodestatus/setters.go: a kubelet that
            // just started has no runtime status yet.
            item["status"]["conditions"] = json!([{"type": "Ready", "status": "False",
                "reason": "KubeletNotReady",
                "message": "container runtime status check may not have completed yet"}]);
        }
    }

    /// The mirror pods of the control planes among `registered` (node
    /// index, name), for the `k8s-app` asked (None: all).
    pub(crate) fn k8s_static_pods(
        &self,
        registered: &[(usize, String)],
        app: Option<&str>,
        now: Instant,
    ) -> Vec<Value> {
        let mut pods = Vec::new();
        for (i, name) in registered {
            let ip = self.node(*i).ip.to_string();
            for c in Component::CONTROL_PLANE {
                if app.is_some_and(|a| a != c.id()) {
                    continue;
                }
                let Some(r) = self.running(*i, c) else {
                    continue;
                };
                let ready = now >= r.ready_at;
                let flag = if ready { "True" } else { "False" };
                pods.push(json!({
                    "metadata": {
                        "name": format!("{}-{name}", c.id()),
                        "namespace": "kube-system",
                        "labels": {"k8s-app": c.id(), "tier": "control-plane"},
                        "annotations": {
                            "kubernetes.io/config.mirror": format!("{:016x}", r.config_version ^ (*i as u64) << 32),
                            "kubernetes.io/config.source": "file",
                            "talos.dev/config-version": r.config_version.to_string(),
                        },
                    },
                    "spec": {
                        "nodeName": name,
                        "hostNetwork": true,
                        "priorityClassName": "system-cluster-critical",
                        "containers": [{"name": c.id(), "image": r.image}],
                    },
                    "status": {
                        "phase": if ready { "Running" } else { "Pending" },
                        "hostIP": ip,
                        "podIP": ip,
                        "conditions": [
                            {"type": "ContainersReady", "status": flag},
                            {"type": "Ready", "status": flag},
                        ],
                        "containerStatuses": [{"name": c.id(), "image": r.image,
                            "ready": ready, "started": ready, "restartCount": 0}],
                    },
                }));
            }
        }
        pods
    }

    /// The `k8s` part of the stats.
    pub(crate) fn k8s_stats(&self, now: Instant) -> Value {
        let names: HashMap<usize, String> = (0..self.count())
            .map(|i| (i, self.node(i).display_name()))
            .collect();
        let k8s = self.k8s.lock().unwrap();
        let at = |t: Instant| t.saturating_duration_since(self.started).as_millis() as u64;
        let restarts: Vec<Value> = k8s
            .timeline
            .iter()
            .map(|r| {
                json!({
                    "node": r.node,
                    "control_plane": r.control_plane,
                    "component": r.component.id(),
                    "from_image": r.from_image,
                    "image": r.image,
                    "start_ms": at(r.start),
                    "ready_ms": (!r.superseded && now >= r.ready).then(|| at(r.ready)),
                })
            })
            .collect();
        let components: serde_json::Map<String, Value> = k8s
            .nodes
            .iter()
            .filter_map(|(i, n)| {
                let comps: serde_json::Map<String, Value> = n
                    .running
                    .iter()
                    .map(|(c, r)| {
                        (
                            c.id().to_owned(),
                            json!({"image": r.image, "ready": now >= r.ready_at,
                                "config_version": r.config_version}),
                        )
                    })
                    .collect();
                Some((names.get(i)?.clone(), Value::Object(comps)))
            })
            .collect();
        let mut out = json!({"restarts": restarts, "components": components, "pulled": k8s.pulled,
            "image_pulls": k8s.pull_calls});
        k8s.objects.stats_into(&mut out);
        out
    }
}

/// The repositories of the images a Kubernetes upgrade pre-pulls.
const KUBERNETES_IMAGES: [&str; 6] = [
    "registry.k8s.io/kube-apiserver",
    "registry.k8s.io/kube-controller-manager",
    "registry.k8s.io/kube-scheduler",
    "registry.k8s.io/kube-proxy",
    "registry.k8s.io/coredns/coredns",
    "ghcr.io/siderolabs/kubelet",
];

/// Where an image lands on a node (talos ctrhelper.go, services/kubelet.go): the CRI containerd
/// (`/run/containerd/containerd.sock`), namespace `k8s.io` (pods' images)
/// or `system` (the kubelet's, services/kubelet.go), or the system
/// containerd (`/system/run/containerd/containerd.sock`), namespace
/// `system` (the installer's).
pub(crate) const CRI_K8S: &str = "cri/k8s.io";
pub(crate) const CRI_SYSTEM: &str = "cri/system";
pub(crate) const SYSTEM_SYSTEM: &str = "system/system";

/// An enum value as Go's `%s` prints a protobuf enum: its name, or its
/// number when it has none.
fn enum_name(name: Option<&str>, value: i32) -> String {
    name.map_or_else(|| value.to_string(), str::to_owned)
}

fn driver_name(d: i32) -> String {
    enum_name(
        ContainerDriver::try_from(d).ok().map(|d| d.as_str_name()),
        d,
    )
}

fn namespace_name(n: i32) -> String {
    enum_name(
        ContainerdNamespace::try_from(n)
            .ok()
            .map(|n| n.as_str_name()),
        n,
    )
}

/// Talos v1.13+ `ctrhelper.ContainerdInstanceHelper`
/// (`internal/app/internal/ctrhelper/ctrhelper.go`), used by
/// ImageService and LifecycleService: driver `CONTAINERD` is the system
/// containerd, `CRI` the CRI one; `NS_CRI` is `k8s.io`, `NS_SYSTEM`
/// `system`; checked in that order, then `CONTAINERD` with `NS_CRI` is
/// refused. An absent instance is driver 0 (`CONTAINERD`) and `NS_UNKNOWN`.
pub(crate) fn containerd_instance(c: Option<&ContainerdInstance>) -> Result<&'static str, Status> {
    let (driver, namespace) = c.map_or((0, 0), |c| (c.driver, c.namespace));
    let system = match ContainerDriver::try_from(driver) {
        Ok(ContainerDriver::Containerd) => true,
        Ok(ContainerDriver::Cri) => false,
        Err(_) => {
            return Err(Status::invalid_argument(format!(
                "invalid containerd driver {}",
                driver_name(driver)
            )));
        }
    };
    let cri_namespace = match ContainerdNamespace::try_from(namespace) {
        Ok(ContainerdNamespace::NsCri) => true,
        Ok(ContainerdNamespace::NsSystem) => false,
        _ => {
            return Err(Status::invalid_argument(format!(
                "invalid containerd namespace {}",
                namespace_name(namespace)
            )));
        }
    };
    match (system, cri_namespace) {
        (true, true) => Err(Status::invalid_argument(
            "cannot use CRI namespace with containerd driver",
        )),
        (true, false) => Ok(SYSTEM_SYSTEM),
        (false, true) => Ok(CRI_K8S),
        (false, false) => Ok(CRI_SYSTEM),
    }
}

/// One image pull a node was asked for (or its kubelet did), for the stats.
pub(crate) struct PullCall<'a> {
    pub node: usize,
    /// `ImageService.Pull`, `MachineService.ImagePull`, or who pulled
    /// without being asked.
    pub api: &'static str,
    /// As sent (None: the call has no driver).
    pub driver: Option<i32>,
    pub namespace: Option<i32>,
    pub image: &'a str,
}

impl Cluster {
    /// Records a pull and, when it succeeded, the image at `place` on the
    /// node.
    pub(crate) fn record_pull(&self, call: PullCall<'_>, outcome: &Result<&'static str, Status>) {
        let node = self.node(call.node);
        let name = node.display_name();
        if let Ok(place) = outcome {
            let mut st = node.st.lock().unwrap();
            st.day2.images.insert((place, call.image.to_owned()));
        }
        let mut k8s = self.k8s.lock().unwrap();
        k8s.pull_calls.push(json!({
            "node": name,
            "api": call.api,
            "driver": call.driver.map(driver_name),
            "namespace": call.namespace.map(namespace_name),
            "image": call.image,
            "at": outcome.as_ref().ok(),
            "code": match outcome {
                Ok(_) => "Ok".to_owned(),
                Err(s) => format!("{:?}", s.code()),
            },
            "message": outcome.as_ref().err().map(|s| s.message().to_owned()),
        }));
    }
}

impl crate::node::service::Api {
    /// A pull of a Kubernetes image, as talosctl's `upgrade-k8s`
    /// pre-pull sends them (`talos_managed.go` `prePullImages`): one with a
    /// version tag is pulled after `--pull-cached-delay`; another tag of
    /// those repositories is not found. None: not a Kubernetes image (an
    /// installer's pull).
    pub(crate) async fn k8s_image_pull(
        &self,
        i: usize,
        image: &str,
    ) -> Option<Result<(), tonic::Status>> {
        let (repo, _) = image.rsplit_once(':')?;
        if !KUBERNETES_IMAGES.contains(&repo) {
            return None;
        }
        if versions::version_of_image(image).is_err() {
            return Some(Err(tonic::Status::not_found(format!(
                "failed to pull image {image:?}: {image}: not found"
            ))));
        }
        tokio::time::sleep(ms(self.cluster.args.pull_cached_delay)).await;
        let name = self.cluster.node(i).display_name();
        let mut k8s = self.cluster.k8s.lock().unwrap();
        k8s.pulled.entry(name).or_default().push(image.to_owned());
        Some(Ok(()))
    }

    /// `MachineService.ImagePull` (Talos v1.5+, deprecated from v1.13 and
    /// still served; `internal/app/machined/internal/server/v1alpha1/
    /// v1alpha1_images.go`): always the CRI containerd, `NS_CRI` → `k8s.io`,
    /// `NS_SYSTEM` → `system`, anything else InvalidArgument "invalid
    /// namespace %s"; an image that is not there is NotFound "error pulling
    /// image: …".
    pub(crate) async fn image_pull_call(
        &self,
        req: Request<ImagePullRequest>,
    ) -> Result<Response<ImagePullResponse>, Status> {
        let i = self.state_target(&req)?;
        let r = req.get_ref();
        let image = r.reference.clone();
        let outcome = async {
            let place = match ContainerdNamespace::try_from(r.namespace) {
                Ok(ContainerdNamespace::NsCri) => CRI_K8S,
                Ok(ContainerdNamespace::NsSystem) => CRI_SYSTEM,
                _ => {
                    return Err(Status::invalid_argument(format!(
                        "invalid namespace {}",
                        namespace_name(r.namespace)
                    )));
                }
            };
            match self.k8s_image_pull(i, &image).await {
                Some(pulled) => pulled.map_err(|e| {
                    Status::not_found(format!("error pulling image: {}", e.message()))
                })?,
                None => self.pull_elsewhere(&req, i, &image).await?,
            }
            Ok(place)
        }
        .await;
        self.cluster.record_pull(
            PullCall {
                node: i,
                api: "MachineService.ImagePull",
                driver: None,
                namespace: Some(r.namespace),
                image: &image,
            },
            &outcome,
        );
        outcome?;
        Ok(Response::new(ImagePullResponse {
            messages: vec![ImagePull { metadata: None }],
        }))
    }

    /// An installer pulled somewhere other than the system containerd:
    /// timed as an installer pull, but not cached for the system
    /// containerd's later pulls.
    pub(crate) async fn pull_elsewhere<T>(
        &self,
        req: &Request<T>,
        i: usize,
        image: &str,
    ) -> Result<(), Status> {
        let had = {
            let node = self.cluster.node(i);
            let st = node.st.lock().unwrap();
            st.day2.pulled.contains(image)
        };
        self.timed_pull(req, &[i], image).await?;
        if !had {
            let node = self.cluster.node(i);
            node.st.lock().unwrap().day2.pulled.remove(image);
        }
        Ok(())
    }
}

/// Watches the configs for the life of the simulator.
pub(crate) async fn watch(cluster: Arc<Cluster>) {
    loop {
        let now = Instant::now();
        cluster.k8s_observe(now);
        cluster.k8s_heartbeats(now);
        cluster.k8s_bootstrap_manifests(now);
        tokio::time::sleep(TICK).await;
    }
}
