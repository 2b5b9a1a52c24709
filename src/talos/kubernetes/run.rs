//! Executes a [`KubePlan`]: each step not done, in order, waited for before
//! the next, stopping at the first failure. A component moves by
//! ApplyConfiguration NO_REBOOT of the node's rendered config with that
//! component's image at the target and every other one where it runs
//! (siderolabs/talos `pkg/cluster/kubernetes/patch.go` patches the one image
//! the same way); a static pod is done when its mirror pod runs the new
//! image and is Ready (`talos_managed.go`, `checkPodStatus`), a kubelet when
//! its Node reports the new version and is Ready (`kubelet.go`,
//! `checkNodeKubeletVersion`). The manifests are read from the first
//! control plane that answers and synced in the plan's [`SyncMode`]
//! (see [`super::manifests`]): before Talos v1.13 created or replaced whole
//! (`PUT`), never deleted; from v1.13 applied server-side with Talos's
//! inventory mark, the inventory ConfigMap updated, and what Talos no
//! longer renders pruned — only objects carrying Talos's mark. Then each
//! changed DaemonSet and Deployment is waited for until rolled out.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::api::{Kube, Replace, Resource, contains, object_name, object_path};
use super::manifests::{
    self, INVENTORY_NAME, Mark, ObjRef, SyncMode, comparable, inventory_configmap, inventory_path,
    inventory_refs, locate, mark_of, marked, prunable, stage, stale,
};
use super::observe::{
    MANIFESTS, kubelet_seen, manifest_objects, one_line, ordered, pod_on, pod_seen, pods_of,
};
use super::plan::RenderedError;
use super::plan::{
    ClusterSeen, Component, KubePlan, Step, cluster_version, images_of, pins, retag, version_tag,
    with_versions,
};
use crate::inventory::Role;
use crate::talos::bootstrap::{Options, Plan, PlannedNode};
use crate::talos::client::{ApiError, ApplyMode, Mode, NodeClient, PullApi};
use crate::talos::health::{HealthError, kubeconfig};
use crate::talos::kube::KubeError;
use crate::talos::remove::identity;
use crate::talos::upgrade::report::Ending;

/// A node's config could not be pinned to Kubernetes versions.
#[derive(Debug, thiserror::Error)]
#[error("{node}: rendering the config: {source}")]
pub struct PinError {
    pub node: String,
    #[source]
    pub source: RenderedError,
}

/// Why a DaemonSet or Deployment has not rolled out yet.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Rollout {
    #[error("the controller has not seen the change yet")]
    Unseen,
    #[error("{updated} of {wanted} updated")]
    Updating { updated: i64, wanted: i64 },
}

/// What a step waits for is not there yet: the last answer of its check.
#[derive(Debug, thiserror::Error)]
pub enum Pending {
    #[error(transparent)]
    Kube(#[from] KubeError),
    #[error("its Node is not registered")]
    NodeUnregistered,
    #[error("the Node reports {0}, not Ready")]
    NodeNotReady(String),
    #[error("the Node reports kubelet {}", .0.as_deref().unwrap_or("?"))]
    Kubelet(Option<String>),
    #[error("no mirror pod")]
    NoMirrorPod,
    #[error("the pod runs {0}, not Ready")]
    PodNotReady(String),
    #[error("the pod runs {}", .0.as_deref().unwrap_or("?"))]
    Pod(Option<String>),
    #[error("{path}: {why}")]
    Rollout { path: String, why: Rollout },
}

/// Why a Kubernetes step failed (the [`Failure`]'s error). Node replies
/// are shown on one line and bounded ([`one_line`]).
#[derive(Debug, thiserror::Error)]
pub enum KubeStepError {
    #[error("{0} is not in the inventory")]
    UnknownNode(String),
    /// Connecting to a node's Talos API.
    #[error("{}", one_line(&.0.to_string()))]
    Connect(#[source] ApiError),
    #[error("pulling {image} ({via}): {}", one_line(&source.to_string()))]
    Pull {
        image: String,
        via: &'static str,
        #[source]
        source: ApiError,
    },
    #[error(transparent)]
    Pin(#[from] PinError),
    #[error("ApplyConfiguration: {}", one_line(&.0.to_string()))]
    Apply(#[source] ApiError),
    #[error("not done within {timeout:?}: {last}")]
    NotDone {
        timeout: Duration,
        #[source]
        last: Pending,
    },
    /// No control plane gave its manifests: the last one asked and why.
    #[error("reading the bootstrap manifests: {}", tried_text(tried))]
    Manifests { tried: Option<(String, ApiError)> },
    #[error(transparent)]
    Kube(#[from] KubeError),
    #[error("applying {name}: {source}")]
    ApplyObject {
        name: String,
        #[source]
        source: KubeError,
    },
    /// go-kubernetes ssa (policy AdoptIfNoInventory) refuses an object of
    /// another inventory.
    #[error(
        "{name} belongs to inventory {owner:?}, not Talos's ({INVENTORY_NAME}): not taken over (its config.k8s.io/owning-inventory annotation)"
    )]
    ForeignInventory { name: String, owner: String },
    #[error("Talos's inventory ConfigMap kube-system/{INVENTORY_NAME}: {0}")]
    Inventory(#[source] KubeError),
    #[error("pruning {name}: {source}")]
    Prune {
        name: String,
        #[source]
        source: KubeError,
    },
    /// No async runtime to talk to the nodes with.
    #[error("{0}")]
    Runtime(#[source] std::io::Error),
    /// The state dir's kubeconfig could not be read.
    #[error(transparent)]
    Kubeconfig(#[from] HealthError),
}

fn tried_text(tried: &Option<(String, ApiError)>) -> String {
    match tried {
        None => "no control plane".to_owned(),
        Some((cp, e)) => format!("{cp}: {}", one_line(&e.to_string())),
    }
}

/// Deadlines of a run.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// One image pull (ImageService.Pull answers when the pull is done).
    pub pull_timeout: Duration,
    /// From a component's apply until it runs the new version and is
    /// Ready; also a rollout.
    pub component_timeout: Duration,
}

/// The step that failed and why; later steps were not run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Failure {
    pub step: String,
    pub error: String,
}

/// What one Kubernetes run did.
#[derive(Debug, Clone, Default, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeReport {
    pub from: Option<String>,
    pub to: String,
    /// Why nothing was changed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
    /// Steps this run carried out, in order.
    pub done: Vec<String>,
    /// Steps the cluster showed done already.
    pub already_done: usize,
    pub failed: Option<Failure>,
    /// Steps not reached because of the failure.
    pub not_run: Vec<String>,
    /// Manifest objects applied (created, replaced or server-side applied).
    pub applied: Vec<String>,
    /// Manifest objects deleted as no longer rendered (Talos v1.13+).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub pruned: Vec<String>,
    /// `--skip-api-check`, pre-pulls Talos did not offer.
    pub notes: Vec<String>,
}

impl KubeReport {
    pub fn ending(&self) -> Ending {
        if let Some(r) = &self.refused {
            return Ending::Failed(r.clone());
        }
        match &self.failed {
            None => Ending::Ok,
            Some(f) if self.done.is_empty() => Ending::Failed(format!("{}: {}", f.step, f.error)),
            Some(f) => Ending::Partial(format!(
                "{}: {}; done: {}; not run: {}",
                f.step,
                f.error,
                self.done.join(", "),
                self.not_run.len()
            )),
        }
    }
}

/// The rendered config of `node` with its Kubernetes images at `pins`.
fn config_at(node: &PlannedNode, pins: &BTreeMap<Component, String>) -> Result<Vec<u8>, PinError> {
    with_versions(&node.config, pins).map_err(|source| PinError {
        node: node.name.clone(),
        source,
    })
}

/// The plan with each node's config pinned to the Kubernetes versions it
/// runs, so a Talos upgrade's or `apply`'s config push leaves Kubernetes
/// alone (it moves in `upgrade`'s Kubernetes part, in order). A node that
/// runs the target everywhere keeps its rendered config as it is.
pub fn pin_running(plan: &mut Plan, seen: &ClusterSeen, to: &str) -> Result<(), PinError> {
    let from = cluster_version(seen);
    let to = version_tag(to);
    for node in &mut plan.nodes {
        if let Some(n) = seen.nodes.iter().find(|s| s.node == node.name) {
            let pins = pins(n, from.as_deref(), &to);
            if pins.values().any(|v| *v != to) {
                node.config = config_at(node, &pins)?;
            }
        }
    }
    Ok(())
}

/// Polls `check` until it says done, at most `timeout`; its last answer
/// names what was still missing.
fn wait_until(
    timeout: Duration,
    poll: Duration,
    mut check: impl FnMut() -> Result<(), Pending>,
) -> Result<(), KubeStepError> {
    let deadline = Instant::now() + timeout;
    loop {
        let last = match check() {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        if Instant::now() + poll > deadline {
            return Err(KubeStepError::NotDone { timeout, last });
        }
        std::thread::sleep(poll);
    }
}

/// Whether a DaemonSet or Deployment has rolled its template out
/// (kubectl `rollout status`: the controller saw the generation, and every
/// replica is updated).
pub fn rolled_out(obj: &Value) -> Result<(), Rollout> {
    let status = &obj["status"];
    let observed = status["observedGeneration"].as_i64().unwrap_or(-1);
    let generation = obj["metadata"]["generation"].as_i64().unwrap_or(0);
    if observed < generation {
        return Err(Rollout::Unseen);
    }
    let (updated, wanted) = match obj["kind"].as_str() {
        Some("DaemonSet") => (
            status["updatedNumberScheduled"].as_i64().unwrap_or(0),
            status["desiredNumberScheduled"].as_i64().unwrap_or(0),
        ),
        _ => (
            status["updatedReplicas"].as_i64().unwrap_or(0),
            obj["spec"]["replicas"].as_i64().unwrap_or(1),
        ),
    };
    if updated < wanted {
        return Err(Rollout::Updating { updated, wanted });
    }
    Ok(())
}

/// How often a write is tried again when the object changed meanwhile
/// (409): a Talos node's controller may write the inventory at the same time.
const CONFLICT_TRIES: usize = 5;

fn still_conflicting(kube: &Kube, what: &str) -> KubeError {
    KubeError::Api {
        server: kube.kc.server.clone(),
        message: format!(
            "{what}: changed by someone else on each of {CONFLICT_TRIES} tries (409 Conflict)"
        ),
    }
}

fn workload(obj: &Value) -> bool {
    obj["apiVersion"] == "apps/v1"
        && matches!(obj["kind"].as_str(), Some("DaemonSet" | "Deployment"))
}

struct Runner<'a> {
    plan: &'a Plan,
    opts: &'a Options,
    run: &'a RunOptions,
    rt: tokio::runtime::Runtime,
    kube: Kube,
    pins: BTreeMap<String, BTreeMap<Component, String>>,
    notes: Vec<String>,
    applied: Vec<String>,
    pruned: Vec<String>,
    /// The cluster's oldest node runs Talos v1.14+ (ConfigMaps and Secrets
    /// are applied before the workloads).
    v1_14: bool,
}

impl Runner<'_> {
    fn node(&self, name: &str) -> Result<&PlannedNode, KubeStepError> {
        self.plan
            .nodes
            .iter()
            .find(|n| n.name == name)
            .ok_or_else(|| KubeStepError::UnknownNode(name.to_owned()))
    }

    fn connect(&self, node: &PlannedNode, timeout: Duration) -> Result<NodeClient, ApiError> {
        let mode = Mode::Mtls(self.plan.identity.clone());
        self.rt
            .block_on(NodeClient::connect(&node.endpoint, &mode, timeout))
    }

    /// talosctl `prePullImages`: each image into the node's CRI containerd
    /// (the kubelet's into namespace `system`, where the kubelet service
    /// looks, the rest into `k8s.io`); a node that answers Unimplemented is
    /// skipped with a note.
    fn pre_pull(
        &mut self,
        name: &str,
        images: &[String],
        via: PullApi,
    ) -> Result<(), KubeStepError> {
        let node = self.node(name)?;
        let conn = self
            .connect(node, self.run.pull_timeout)
            .map_err(KubeStepError::Connect)?;
        let kubelet = images_of(&node.config)
            .remove(&Component::Kubelet)
            .map(|k| retag(&k, ""));
        for image in images {
            let is_kubelet = kubelet.as_deref() == Some(retag(image, "").as_str());
            match self
                .rt
                .block_on(conn.pull_kubernetes_image(via, image, is_kubelet))
            {
                Ok(()) => {}
                Err(e) if e.code() == Some(tonic::Code::Unimplemented) => {
                    self.notes.push(format!(
                        "{name}: Talos does not offer {}: not pre-pulled",
                        via.name()
                    ));
                    return Ok(());
                }
                Err(e) => {
                    return Err(KubeStepError::Pull {
                        image: image.clone(),
                        via: via.name(),
                        source: e,
                    });
                }
            }
        }
        Ok(())
    }

    fn component(&mut self, name: &str, c: Component, to: &str) -> Result<(), KubeStepError> {
        let node = self.node(name)?.clone();
        let pins = self.pins.entry(name.to_owned()).or_default();
        pins.insert(c, to.to_owned());
        let config = config_at(&node, pins)?;
        let conn = self
            .connect(&node, self.opts.call_timeout)
            .map_err(KubeStepError::Connect)?;
        self.rt
            .block_on(conn.apply_mode(config, ApplyMode::NoReboot, false))
            .map_err(KubeStepError::Apply)?;
        // Its Node is matched by machine ID where known, never a leftover
        // of the machine that had its address before.
        let machine = self
            .rt
            .block_on(identity::read(&conn))
            .ok()
            .flatten()
            .and_then(|id| identity::machine_id(&id));
        let (kube, poll) = (&self.kube, self.opts.poll);
        match c {
            Component::KubeProxy => Ok(()),
            Component::Kubelet => wait_until(self.run.component_timeout, poll, || {
                let nodes = kube.get_some("/api/v1/nodes")?;
                let seen = kubelet_seen(&nodes, &node, machine.as_deref())
                    .ok_or(Pending::NodeUnregistered)?;
                match seen.version {
                    Some(v) if v == to && seen.ready => Ok(()),
                    Some(v) if v == to => Err(Pending::NodeNotReady(v)),
                    v => Err(Pending::Kubelet(v)),
                }
            }),
            _ => wait_until(self.run.component_timeout, poll, || {
                let pods = pods_of(kube, c)?;
                let pod = pod_on(&pods, &node).ok_or(Pending::NoMirrorPod)?;
                let seen = pod_seen(pod);
                match seen.version {
                    Some(v) if v == to && seen.ready => Ok(()),
                    Some(v) if v == to => Err(Pending::PodNotReady(v)),
                    v => Err(Pending::Pod(v)),
                }
            }),
        }
    }

    /// The manifest objects of the first control plane that answers.
    fn manifests(&self) -> Result<Vec<Value>, KubeStepError> {
        let mut tried = None;
        for cp in self
            .plan
            .nodes
            .iter()
            .filter(|n| n.role == Role::Controlplane)
        {
            let read = self
                .connect(cp, self.opts.call_timeout)
                .and_then(|c| self.rt.block_on(c.cosi_list(MANIFESTS.0, MANIFESTS.1)));
            match read {
                Ok(list) => {
                    return Ok(list.iter().flat_map(|(_, y)| manifest_objects(y)).collect());
                }
                Err(e) => tried = Some((cp.name.clone(), e)),
            }
        }
        Err(KubeStepError::Manifests { tried })
    }

    fn sync(&mut self, mode: SyncMode) -> Result<(), KubeStepError> {
        let objects = self.manifests()?;
        let rollouts = match mode {
            SyncMode::Replace => self.sync_replace(&objects)?,
            SyncMode::Apply => self.sync_apply(&objects)?,
        };
        let kube = &self.kube;
        for path in rollouts {
            wait_until(self.run.component_timeout, self.opts.poll, || {
                rolled_out(&kube.get_some(&path)?).map_err(|why| Pending::Rollout {
                    path: path.clone(),
                    why,
                })
            })?;
        }
        Ok(())
    }

    /// Before Talos v1.13 (go-kubernetes `manifests.Sync`): each object
    /// created when missing, else replaced whole when a dry-run `PUT` shows
    /// a difference. The paths of changed workloads, to wait for.
    fn sync_replace(&mut self, objects: &[Value]) -> Result<Vec<String>, KubeStepError> {
        let mut discovery = BTreeMap::new();
        let mut rollouts = Vec::new();
        for o in objects {
            let name = object_name(o);
            let res = self.kube.resource_of(o, &mut discovery)?;
            let path = object_path(&res, o);
            let changed =
                self.replace_one(&res, &path, o)
                    .map_err(|source| KubeStepError::ApplyObject {
                        name: name.clone(),
                        source,
                    })?;
            if changed {
                self.applied.push(name);
                if workload(o) {
                    rollouts.push(path);
                }
            }
        }
        Ok(rollouts)
    }

    /// go-kubernetes `updateManifest`: `POST` when missing; else a dry-run
    /// `PUT` at the live `resourceVersion`, and the `PUT` itself when what
    /// it would store differs from the live object ([`comparable`]). A
    /// 409 reads again. Whether it changed anything.
    fn replace_one(&self, res: &Resource, path: &str, o: &Value) -> Result<bool, KubeError> {
        for _ in 0..CONFLICT_TRIES {
            let Some(live) = self.kube.get(path)? else {
                if self.kube.create(res, o)? {
                    return Ok(true);
                }
                continue;
            };
            let mut want = o.clone();
            if let Some(rv) = live["metadata"]["resourceVersion"].as_str() {
                want["metadata"]["resourceVersion"] = Value::String(rv.to_owned());
            }
            let dry = match self.kube.replace(path, &want, true) {
                Ok(v) => v,
                Err(Replace::Conflict) => continue,
                Err(Replace::Failed(e)) => return Err(e),
            };
            if comparable(&dry) == comparable(&live) {
                return Ok(false);
            }
            match self.kube.replace(path, &want, false) {
                Ok(_) => return Ok(true),
                Err(Replace::Conflict) => continue,
                Err(Replace::Failed(e)) => return Err(e),
            }
        }
        Err(still_conflicting(&self.kube, path))
    }

    /// Talos's inventory: its entries and `resourceVersion`, the ConfigMap
    /// created empty when missing (go-kubernetes `configmap.NewInventory`).
    fn read_inventory(&self) -> Result<(Vec<ObjRef>, Option<String>), KubeError> {
        for _ in 0..CONFLICT_TRIES {
            if let Some(cm) = self.kube.get(&inventory_path())? {
                let rv = cm["metadata"]["resourceVersion"]
                    .as_str()
                    .map(str::to_owned);
                return Ok((inventory_refs(&cm), rv));
            }
            let res = Resource {
                base: "/api/v1".into(),
                plural: "configmaps".into(),
                namespaced: true,
            };
            self.kube.create(&res, &inventory_configmap(&[], None))?;
        }
        Err(still_conflicting(&self.kube, &inventory_path()))
    }

    /// Writes `refs` as the inventory (`Inventory.Write`: the whole
    /// ConfigMap, `PUT`), at `rv`; on a 409 the entries written meanwhile
    /// are kept, except `dropped`. The new `resourceVersion`.
    fn write_inventory(
        &self,
        refs: &mut Vec<ObjRef>,
        mut rv: Option<String>,
        dropped: &[ObjRef],
    ) -> Result<Option<String>, KubeError> {
        for _ in 0..CONFLICT_TRIES {
            match self.kube.replace(
                &inventory_path(),
                &inventory_configmap(refs, rv.as_deref()),
                false,
            ) {
                Ok(stored) => {
                    return Ok(stored["metadata"]["resourceVersion"]
                        .as_str()
                        .map(str::to_owned));
                }
                Err(Replace::Conflict) => {
                    let (now, now_rv) = self.read_inventory()?;
                    for r in now {
                        if !refs.contains(&r) && !dropped.contains(&r) {
                            refs.push(r);
                        }
                    }
                    rv = now_rv;
                }
                Err(Replace::Failed(e)) => return Err(e),
            }
        }
        Err(still_conflicting(&self.kube, &inventory_path()))
    }

    /// From Talos v1.13 (go-kubernetes `ssa.Manager.Apply`): every object
    /// applied server-side with Talos's inventory mark (Namespaces and CRDs
    /// first), the inventory written, then each entry Talos no longer
    /// renders deleted — only when the live object carries Talos's mark
    /// ([`prunable`]): an object Talos did not create is never deleted —
    /// and the inventory written again. The paths of changed workloads.
    fn sync_apply(&mut self, objects: &[Value]) -> Result<Vec<String>, KubeStepError> {
        let (mut refs, rv) = self.read_inventory().map_err(KubeStepError::Inventory)?;
        let mut order: Vec<&Value> = objects.iter().collect();
        order.sort_by_key(|o| stage(o, self.v1_14));
        let mut discovery = BTreeMap::new();
        let mut rollouts = Vec::new();
        for o in order {
            let name = object_name(o);
            if let Mark::Other(owner) = mark_of(o) {
                return Err(KubeStepError::ForeignInventory { name, owner });
            }
            let res = self.kube.resource_of(o, &mut discovery)?;
            let path = object_path(&res, o);
            let want = marked(o);
            match self.kube.get(&path)? {
                Some(live) if contains(&live, &want) => {}
                Some(live) if matches!(mark_of(&live), Mark::Other(_)) => {
                    let Mark::Other(owner) = mark_of(&live) else {
                        unreachable!()
                    };
                    return Err(KubeStepError::ForeignInventory { name, owner });
                }
                _ => {
                    self.kube
                        .apply(&path, &want)
                        .map_err(|source| KubeStepError::ApplyObject {
                            name: name.clone(),
                            source,
                        })?;
                    self.applied.push(name);
                    if workload(o) {
                        rollouts.push(path);
                    }
                }
            }
            let r = ObjRef::of(o, res.namespaced);
            if !refs.contains(&r) {
                refs.push(r);
            }
        }
        let rv = self
            .write_inventory(&mut refs, rv, &[])
            .map_err(KubeStepError::Inventory)?;
        let mut dropped = Vec::new();
        for r in stale(&refs, objects) {
            let (path, api_version) = locate(&self.kube, &r, &mut discovery)?;
            let name = r.describe(&api_version);
            match self.kube.get(&path)? {
                None => dropped.push(r),
                Some(live) if prunable(&live) => {
                    self.kube
                        .delete(&path)
                        .map_err(|source| KubeStepError::Prune {
                            name: name.clone(),
                            source,
                        })?;
                    self.pruned.push(name);
                    dropped.push(r);
                }
                Some(_) => self.notes.push(format!(
                    "not pruned: {name} (Talos no longer renders it, but it carries no {} mark of Talos's: not created by Talos)",
                    manifests::OWNING_INVENTORY
                )),
            }
        }
        if !dropped.is_empty() {
            refs.retain(|r| !dropped.contains(r));
            self.write_inventory(&mut refs, rv, &dropped)
                .map_err(KubeStepError::Inventory)?;
        }
        Ok(rollouts)
    }
}

/// Runs every step of `kplan` not done; nothing when it refuses.
/// `progress` hears each step as it starts and ends. Blocking.
pub fn execute(
    plan: &Plan,
    kplan: &KubePlan,
    seen: &ClusterSeen,
    opts: &Options,
    run: &RunOptions,
    progress: &dyn Fn(&str),
) -> KubeReport {
    let mut report = KubeReport {
        from: kplan.from.clone(),
        to: kplan.to.clone(),
        notes: kplan.notes.clone(),
        already_done: kplan.steps.iter().filter(|s| s.done).count(),
        ..KubeReport::default()
    };
    if let Some(r) = &kplan.refusal {
        report.refused = Some(r.clone());
        return report;
    }
    let todo: Vec<&Step> = kplan
        .steps
        .iter()
        .filter(|s| !s.done)
        .map(|s| &s.step)
        .collect();
    if todo.is_empty() {
        return report;
    }
    let setup = || -> Result<Runner<'_>, KubeStepError> {
        Ok(Runner {
            plan,
            opts,
            run,
            rt: tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .map_err(KubeStepError::Runtime)?,
            kube: Kube {
                kc: kubeconfig(plan)?,
                timeout: opts.call_timeout,
            },
            pins: ordered(plan)
                .iter()
                .filter_map(|n| seen.nodes.iter().find(|s| s.node == n.name))
                .map(|s| (s.node.clone(), pins(s, kplan.from.as_deref(), &kplan.to)))
                .collect(),
            notes: Vec::new(),
            applied: Vec::new(),
            pruned: Vec::new(),
            v1_14: {
                let oldest = seen
                    .nodes
                    .iter()
                    .filter_map(|n| n.talos.as_deref())
                    .filter_map(|v| crate::inventory::parse_version(v, false))
                    .min();
                oldest.is_some_and(|(major, minor, _)| (major, minor) >= (1, 14))
            },
        })
    };
    let mut runner = match setup() {
        Ok(r) => r,
        Err(error) => {
            report.failed = Some(Failure {
                step: "starting".into(),
                error: error.to_string(),
            });
            report.not_run = todo.iter().map(|s| s.describe()).collect();
            return report;
        }
    };
    let mut rest = todo.into_iter();
    for step in rest.by_ref() {
        let what = step.describe();
        progress(&what);
        let result = match step {
            Step::PrePull { node, images, via } => runner.pre_pull(node, images, *via),
            Step::Component {
                node,
                component,
                to,
                ..
            } => runner.component(node, *component, to),
            Step::SyncManifests { mode, .. } => runner.sync(*mode),
        };
        match result {
            Ok(()) => {
                progress(&format!("done: {what}"));
                report.done.push(what);
            }
            Err(error) => {
                report.failed = Some(Failure {
                    step: what,
                    error: error.to_string(),
                });
                break;
            }
        }
    }
    report.not_run = rest.map(Step::describe).collect();
    report.notes.extend(runner.notes);
    report.applied = runner.applied;
    report.pruned = runner.pruned;
    report
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_rollout_is_over_when_every_replica_is_updated() {
        let ds = |obs: i64, upd: i64| {
            json!({"kind": "DaemonSet", "metadata": {"generation": 2},
                "status": {"observedGeneration": obs, "updatedNumberScheduled": upd, "desiredNumberScheduled": 5}})
        };
        assert!(rolled_out(&ds(1, 5)).is_err(), "generation not seen");
        assert_eq!(
            rolled_out(&ds(2, 3)),
            Err(Rollout::Updating {
                updated: 3,
                wanted: 5
            })
        );
        assert_eq!(
            rolled_out(&ds(2, 3)).unwrap_err().to_string(),
            "3 of 5 updated"
        );
        assert_eq!(rolled_out(&ds(2, 5)), Ok(()));
        let dep = json!({"kind": "Deployment", "metadata": {"generation": 1},
            "spec": {"replicas": 2}, "status": {"observedGeneration": 1, "updatedReplicas": 2}});
        assert_eq!(rolled_out(&dep), Ok(()));
        assert!(rolled_out(&json!({"kind": "Deployment", "metadata": {"generation": 1}})).is_err());
    }

    #[test]
    fn the_ending_says_what_was_done_before_a_failure() {
        let mut r = KubeReport::default();
        assert_eq!(r.ending(), Ending::Ok);
        r.failed = Some(Failure {
            step: "cp-02: kube-apiserver".into(),
            error: "boom".into(),
        });
        assert!(matches!(r.ending(), Ending::Failed(m) if m.contains("cp-02")));
        r.done.push("cp-01: kube-apiserver".into());
        assert!(matches!(r.ending(), Ending::Partial(m) if m.contains("done: cp-01")));
        r.refused = Some("too new".into());
        assert!(matches!(r.ending(), Ending::Failed(m) if m == "too new"));
    }
}
