//! Executes a [`KubePlan`]: each step not done, in order, waited for before
//! the next, stopping at the first failure. A component moves by
//! ApplyConfiguration NO_REBOOT of the node's rendered config with that
//! component's image at the target and every other one where it runs
//! (siderolabs/talos `pkg/cluster/kubernetes/patch.go` patches the one image
//! the same way); a static pod is done when its mirror pod runs the new
//! image and is Ready (`talos_managed.go`, `checkPodStatus`), a kubelet when
//! its Node reports the new version and is Ready (`kubelet.go`,
//! `checkNodeKubeletVersion`). The manifests are read from the first
//! control plane that answers and applied server-side, each object only
//! when the live one lacks what Talos renders; then each changed
//! DaemonSet and Deployment is waited for until rolled out. Nothing is
//! deleted; the inventory annotation Talos v1.13+ sets is kept
//! ([`keep_inventory`]).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::api::{Kube, contains, object_name, object_path};
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
    /// Manifest objects applied.
    pub applied: Vec<String>,
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

/// The annotation by which Talos v1.13+'s server-side apply manager
/// (go-kubernetes `kubernetes/ssa`, field manager `talos`, the same as
/// imgbuild's) tracks the objects of its inventory, to prune them later.
pub const OWNING_INVENTORY: &str = "config.k8s.io/owning-inventory";

/// `want` with the live object's [`OWNING_INVENTORY`] annotation kept:
/// applying as manager `talos` without it would make the API server drop
/// it (server-side apply removes what a manager stops applying), and
/// Talos's next sync would no longer see the object as its own.
pub fn keep_inventory(live: Option<&Value>, want: &Value) -> Value {
    let mut out = want.clone();
    if let Some(id) = live.and_then(|l| l["metadata"]["annotations"][OWNING_INVENTORY].as_str())
        && out["metadata"]["annotations"][OWNING_INVENTORY].is_null()
        && let Some(meta) = out["metadata"].as_object_mut()
    {
        let notes = meta
            .entry("annotations")
            .or_insert_with(|| Value::Object(serde_json::Map::new()));
        if let Some(notes) = notes.as_object_mut() {
            notes.insert(OWNING_INVENTORY.to_owned(), Value::String(id.to_owned()));
        }
    }
    out
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
        let (kube, poll) = (&self.kube, self.opts.poll);
        match c {
            Component::KubeProxy => Ok(()),
            Component::Kubelet => wait_until(self.run.component_timeout, poll, || {
                let nodes = kube.get_some("/api/v1/nodes")?;
                let seen = kubelet_seen(&nodes, &node).ok_or(Pending::NodeUnregistered)?;
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

    fn sync(&mut self) -> Result<(), KubeStepError> {
        let objects = self.manifests()?;
        let mut discovery = BTreeMap::new();
        let mut rollouts = Vec::new();
        for o in &objects {
            let name = object_name(o);
            let res = self.kube.resource_of(o, &mut discovery)?;
            let path = object_path(&res, o);
            let live = self.kube.get(&path)?;
            if live.as_ref().is_some_and(|l| contains(l, o)) {
                continue;
            }
            let o = &keep_inventory(live.as_ref(), o);
            self.kube
                .apply(&path, o)
                .map_err(|source| KubeStepError::ApplyObject {
                    name: name.clone(),
                    source,
                })?;
            self.applied.push(name);
            if matches!(o["kind"].as_str(), Some("DaemonSet" | "Deployment")) {
                rollouts.push(path);
            }
        }
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
            Step::SyncManifests { .. } => runner.sync(),
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
    fn talos_1_13s_inventory_annotation_is_kept_on_apply() {
        // Talos v1.13 SSA sync annotates what it applied; a sync by
        // imgbuild (same field manager) must not drop it.
        let live = json!({"metadata": {"name": "coredns", "annotations": {
            OWNING_INVENTORY: "talos-bootstrap-manifests", "other": "x"}}});
        let want = json!({"metadata": {"name": "coredns"}, "spec": {"replicas": 2}});
        let out = keep_inventory(Some(&live), &want);
        assert_eq!(
            out["metadata"]["annotations"],
            json!({OWNING_INVENTORY: "talos-bootstrap-manifests"})
        );
        assert_eq!(out["spec"], want["spec"]);
        // Before v1.13 (no annotation), or a new object: as rendered.
        assert_eq!(keep_inventory(None, &want), want);
        let old = json!({"metadata": {"name": "coredns"}});
        assert_eq!(keep_inventory(Some(&old), &want), want);
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
