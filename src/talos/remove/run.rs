//! Reading the cluster for the plan ([`survey`]) and carrying the plan out
//! ([`remove`]): one node at a time, each step first looking whether a
//! stopped run already did it (the member gone, the Node gone, the node
//! silent after its reset).

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::plan::{
    self, ClusterView, IdentityRefusal, Member, NodeRemoval, RemovalPlan, RemoveError, RemovedNode,
    SeenKubeNode, Step, shown,
};
use super::{identity, record};
use crate::inventory::Role;
use crate::talos::api::machine::{ResetPartitionSpec, ResetRequest, reset_request};
use crate::talos::bootstrap::{Options, Plan};
use crate::talos::client::{ApiError, Mode, NodeClient, NodeEndpoint};
use crate::talos::health::{HealthError, kubeconfig};
use crate::talos::stage::Prepared;
use crate::talos::upgrade::drain;

/// Why a removal step failed: the message of its [`StepFailed`]. Node
/// replies are shown on one line and bounded ([`shown`]).
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// A plan made by hand never puts a foreign name in an API path.
    #[error("{} is not a Kubernetes node name", shown(node))]
    NotANodeName { node: String },
    #[error("the Kubernetes API does not answer")]
    KubeSilent,
    /// The kubeconfig could not be read.
    #[error(transparent)]
    Kubeconfig(#[from] HealthError),
    #[error(transparent)]
    Drain(#[from] drain::DrainError),
    #[error("Reset: {}", shown(&.0.to_string()))]
    Reset(#[source] ApiError),
    #[error(
        "it still answers {timeout:?} after Reset (its reset sequence may have failed: see its console or `talosctl dmesg`)"
    )]
    StillAnswers { timeout: Duration },
    #[error("no remaining control plane lists the etcd members")]
    NoEtcdLister,
    #[error(
        "etcd would refuse: of the {others} other members {healthy} are started and healthy, {needed} needed"
    )]
    Quorum {
        others: usize,
        healthy: usize,
        needed: usize,
    },
    /// etcd refused to remove a member that would cost quorum (`text` is
    /// etcd's message, shown).
    #[error(
        "{call}: etcd refused: removing this member would leave too few started members for quorum; bring the other control planes' etcd up first (etcd: {text})"
    )]
    TooFewStarted { call: String, text: String },
    #[error(
        "{call}: etcd refused: the cluster is unhealthy (no quorum among the started members) (etcd: {text})"
    )]
    EtcdUnhealthy { call: String, text: String },
    #[error("{call}: {text}")]
    Etcd { call: String, text: String },
    #[error("EtcdLeaveCluster: {}", shown(&.0.to_string()))]
    LeaveConnect(#[source] ApiError),
    #[error(
        "EtcdLeaveCluster: etcd still answered \"unhealthy\" after {limit:?} (the member has no connection to a quorum of the others): {text}"
    )]
    StillUnhealthy { limit: Duration, text: String },
    /// The blocking Kubernetes call panicked or was cancelled.
    #[error("{0}")]
    Join(#[from] tokio::task::JoinError),
    #[error("deleting the Kubernetes node: {}", shown(&.0.to_string()))]
    Delete(#[source] crate::talos::kube::KubeError),
    /// The machine answering where the node was is not its machine (the
    /// node is named once, by [`StepFailed`]).
    #[error("{}", .0.detail())]
    Identity(#[from] IdentityRefusal),
    /// Its Kubernetes Node belongs to another machine than the one of record.
    #[error(
        "its Kubernetes Node reports machine ID {found}…, not the machine of {expected}: the Node was not deleted"
    )]
    NodeOfAnotherMachine { found: String, expected: String },
}

/// How one step went.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "outcome", content = "detail", rename_all = "kebab-case")]
pub enum Outcome {
    /// Done now, and how.
    Done(String),
    /// A stopped run (or someone else) did it already.
    AlreadyDone(String),
    /// Not done, and why that is fine.
    Skipped(String),
}

/// What the run reports as it goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Started(Step),
    /// A step's progress (the drain's cordon, its evictions).
    Progress(String),
    Finished(Step, Outcome),
    /// Every step done: the node left the record of the cluster's nodes.
    Removed,
}

/// Hears of the run's progress, per node.
pub trait Observer: Sync {
    fn event(&self, node: &str, event: &Event);
}

impl<F: Fn(&str, &Event) + Sync> Observer for F {
    fn event(&self, node: &str, event: &Event) {
        self(node, event)
    }
}

/// One node's removal as it went.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct NodeReport {
    pub node: String,
    pub steps: Vec<(Step, Outcome)>,
    /// Every step done, the node dropped from the record.
    pub removed: bool,
}

/// A step that failed: the run stops there, a rerun goes on from it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, serde::Serialize)]
#[error("node {node}: {step}: {message}")]
pub struct StepFailed {
    pub node: String,
    pub step: Step,
    pub message: String,
}

/// What [`remove`] did: the plan's nodes in order, as far as it got.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct RemovalReport {
    pub nodes: Vec<NodeReport>,
    /// The plan's warnings (a 2-member etcd).
    pub warnings: Vec<String>,
    /// The step that stopped the run; None when every node was removed.
    pub failed: Option<StepFailed>,
}

impl RemovalReport {
    /// Every planned node was removed.
    pub fn complete(&self) -> bool {
        self.failed.is_none()
    }
}

/// What the run may take beyond the plan.
#[derive(Debug, Clone)]
pub struct RemoveOptions {
    /// Call timeout and polling (as the bootstrap's).
    pub limits: Options,
    /// Cordon and drain, per node (talosctl's default, 5 minutes).
    pub drain_timeout: Duration,
    /// From Reset until the node stops answering.
    pub reset_timeout: Duration,
}

impl Default for RemoveOptions {
    fn default() -> Self {
        RemoveOptions {
            limits: Options::default(),
            drain_timeout: crate::talos::upgrade::drain::DRAIN_TIMEOUT,
            reset_timeout: Duration::from_secs(600),
        }
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, RemoveError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| RemoveError::Runtime(e.to_string()))
}

fn mtls(plan: &Plan) -> Mode {
    Mode::Mtls(plan.identity.clone())
}

/// The Talos endpoint of a node reached at `endpoint`, its certificate
/// naming `address` (else the endpoint's IP).
fn target(endpoint: SocketAddr, address: Option<IpAddr>) -> NodeEndpoint {
    NodeEndpoint {
        addr: endpoint,
        server_name: address.unwrap_or(endpoint.ip()),
    }
}

/// A client of the node at `t`, if it answers its Version over mTLS.
async fn answering(plan: &Plan, t: &NodeEndpoint, opts: &Options) -> Result<NodeClient, ApiError> {
    let c = NodeClient::connect(t, &mtls(plan), opts.call_timeout).await?;
    c.version().await?;
    Ok(c)
}

/// The etcd members as the first remaining control plane (the plan's, in
/// order) lists them — or, with `or_removed`, a removed node when none
/// does — with the name of the one that did and a client of it; each
/// member marked healthy only when it is started and the node behind it (a
/// remaining one, or a removed one of `removed`) reports etcd healthy.
async fn members(
    plan: &Plan,
    removed: &[(String, Option<NodeEndpoint>)],
    or_removed: bool,
    opts: &Options,
) -> Option<(Vec<Member>, String, NodeClient)> {
    let mode = mtls(plan);
    let remaining = plan
        .nodes
        .iter()
        .filter(|n| n.role == Role::Controlplane)
        .map(|n| (&n.name, Some(&n.endpoint)));
    let fallback = removed
        .iter()
        .filter(|_| or_removed)
        .map(|(name, t)| (name, t.as_ref()));
    let mut listed = None;
    for (name, endpoint) in remaining.chain(fallback) {
        let Some(endpoint) = endpoint else { continue };
        if let Ok(c) = NodeClient::connect(endpoint, &mode, opts.call_timeout).await
            && let Ok(m) = c.etcd_members().await
        {
            listed = Some((m, name.clone(), c));
            break;
        }
    }
    let (raw, from, client) = listed?;
    let mut out = Vec::new();
    for m in raw {
        let peer_hosts: Vec<IpAddr> = m
            .peer_urls
            .iter()
            .filter_map(|u| reqwest::Url::parse(u).ok())
            .filter_map(|u| {
                let host = u.host_str()?;
                host.trim_start_matches('[')
                    .trim_end_matches(']')
                    .parse()
                    .ok()
            })
            .collect();
        let behind = plan
            .nodes
            .iter()
            .find(|n| n.name == m.hostname || peer_hosts.contains(&n.address))
            .map(|n| n.endpoint.clone())
            .or_else(|| {
                removed
                    .iter()
                    .find(|(name, _)| *name == m.hostname)
                    .and_then(|(_, t)| t.clone())
            });
        let started = !m.hostname.is_empty();
        let healthy = match (started, behind) {
            (true, Some(t)) => etcd_healthy(plan, &t, opts).await,
            _ => false,
        };
        out.push(Member {
            id: m.id,
            hostname: m.hostname,
            learner: m.is_learner,
            healthy,
            peer_hosts,
        });
    }
    Some((out, from, client))
}

/// The node at `t` answers and reports its etcd service healthy.
async fn etcd_healthy(plan: &Plan, t: &NodeEndpoint, opts: &Options) -> bool {
    let Ok(c) = NodeClient::connect(t, &mtls(plan), opts.call_timeout).await else {
        return false;
    };
    c.services().await.is_ok_and(|s| {
        s.iter()
            .any(|s| s.id == "etcd" && s.health.as_ref().is_some_and(|h| h.healthy))
    })
}

/// The Kubernetes nodes, or None when the API does not answer.
async fn kube_nodes(plan: &Plan, opts: &Options) -> Option<Vec<SeenKubeNode>> {
    let kc = kubeconfig(plan).ok()?;
    let t = opts.call_timeout;
    let list = tokio::task::spawn_blocking(move || kc.get_json("/api/v1/nodes", t))
        .await
        .ok()?
        .ok()?;
    Some(seen_nodes(&list))
}

/// Each item of a NodeList: its name, InternalIP and control-plane label.
fn seen_nodes(list: &Value) -> Vec<SeenKubeNode> {
    list["items"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[])
        .iter()
        .map(|n| SeenKubeNode {
            name: n["metadata"]["name"].as_str().unwrap_or("").to_owned(),
            internal_ip: n["status"]["addresses"]
                .as_array()
                .and_then(|a| a.iter().find(|a| a["type"] == "InternalIP"))
                .and_then(|a| a["address"].as_str()?.parse().ok()),
            control_plane: n["metadata"]["labels"]
                .get("node-role.kubernetes.io/control-plane")
                .is_some(),
            machine_id: n["status"]["nodeInfo"]["machineID"]
                .as_str()
                .filter(|m| valid_machine_id(m))
                .map(str::to_owned),
        })
        .collect()
}

/// A machine ID as the kubelet reports `/etc/machine-id`: lowercase hex,
/// bounded (32 characters on Talos).
pub fn valid_machine_id(m: &str) -> bool {
    !m.is_empty() && m.len() <= 64 && m.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Where a removed node's Talos API is, by what is known of it.
fn endpoint_of(
    r: &RemovedNode,
    kube: Option<&[SeenKubeNode]>,
    members: Option<&[Member]>,
) -> Option<NodeEndpoint> {
    let address = plan::address_of(r, kube.unwrap_or(&[]), members.unwrap_or(&[]));
    let endpoint = r
        .endpoint
        .or_else(|| address.map(|a| SocketAddr::new(a, crate::inventory::TALOS_API_PORT)))?;
    Some(target(endpoint, address))
}

/// Reads what the plan needs, changing nothing: the etcd members (from a
/// remaining control plane) and their health, the Kubernetes nodes, and
/// which removed nodes answer. Blocking.
pub fn survey(
    prepared: &Prepared,
    removed: &[RemovedNode],
    limits: &Options,
) -> Result<ClusterView, RemoveError> {
    let plan = &prepared.plan;
    runtime()?.block_on(async {
        let kube = kube_nodes(plan, limits).await;
        let given: Vec<(String, Option<NodeEndpoint>)> = removed
            .iter()
            .map(|r| (r.name.clone(), endpoint_of(r, kube.as_deref(), None)))
            .collect();
        let listed = members(plan, &given, true, limits).await;
        let (members, from) = match listed {
            Some((m, from, _)) => (Some(m), Some(from)),
            None => (None, None),
        };
        let mut answering_nodes = BTreeSet::new();
        let mut identities = BTreeMap::new();
        for r in removed {
            if let Some(t) = endpoint_of(r, kube.as_deref(), members.as_deref())
                && let Ok(c) = answering(plan, &t, limits).await
            {
                answering_nodes.insert(r.name.clone());
                identities.insert(r.name.clone(), identity::read(&c).await.ok().flatten());
            }
        }
        // The inventory's machines: as they answer now, else as recorded.
        let mut inventory_ids = BTreeMap::new();
        if !removed.is_empty() {
            if let Ok(record) = record::NodesRecord::load(&prepared.state_dir.path) {
                inventory_ids.extend(record.nodes.into_iter().filter_map(|n| {
                    let id = n.node_id?;
                    plan.nodes
                        .iter()
                        .any(|p| p.name == n.name)
                        .then_some((n.name, id))
                }));
            }
            inventory_ids.extend(identity::of_plan_async(plan, limits).await);
        }
        Ok(ClusterView {
            members,
            members_from: from,
            kube_nodes: kube,
            answering: answering_nodes,
            identities,
            inventory_ids,
        })
    })
}

/// Carries `removal` out, node after node, each step in order; stops at
/// the first step that fails (the report says which). A node whose steps
/// are all done leaves the record of the cluster's nodes. Blocking.
pub fn remove(
    prepared: &Prepared,
    removal: &RemovalPlan,
    opts: &RemoveOptions,
    observer: &dyn Observer,
) -> Result<RemovalReport, RemoveError> {
    let mut report = RemovalReport {
        warnings: removal.warnings.clone(),
        ..RemovalReport::default()
    };
    let rt = runtime()?;
    for n in &removal.nodes {
        let mut node = NodeReport {
            node: n.node.clone(),
            steps: Vec::new(),
            removed: false,
        };
        for &step in &n.steps {
            observer.event(&n.node, &Event::Started(step));
            let progress = |m: &str| observer.event(&n.node, &Event::Progress(m.to_owned()));
            let done = rt.block_on(run_step(prepared, removal, n, step, opts, &progress));
            match done {
                Ok(outcome) => {
                    observer.event(&n.node, &Event::Finished(step, outcome.clone()));
                    node.steps.push((step, outcome));
                }
                Err(e) => {
                    report.nodes.push(node);
                    report.failed = Some(StepFailed {
                        node: n.node.clone(),
                        step,
                        message: e.to_string(),
                    });
                    return Ok(report);
                }
            }
        }
        let dir = &prepared.state_dir.path;
        record::forget_node(dir, &n.node).map_err(|source| RemoveError::Record {
            path: record::NodesRecord::path(dir),
            source,
        })?;
        node.removed = true;
        observer.event(&n.node, &Event::Removed);
        report.nodes.push(node);
    }
    Ok(report)
}

/// One step of one node; the error is the message for [`StepFailed`].
async fn run_step(
    prepared: &Prepared,
    removal: &RemovalPlan,
    n: &NodeRemoval,
    step: Step,
    opts: &RemoveOptions,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<Outcome, StepError> {
    // A plan made by hand never puts a foreign name in an API path.
    if !plan::valid_node_name(&n.node) {
        return Err(StepError::NotANodeName {
            node: n.node.clone(),
        });
    }
    let plan = &prepared.plan;
    let limits = &opts.limits;
    let own = n.endpoint.map(|e| target(e, n.address));
    // Just before acting: whatever answers where the node was must be its
    // machine, and no inventory node's (every node shares the CA).
    if let Some(t) = &own {
        prove(plan, removal, n, t, limits).await?;
    }
    match step {
        Step::Drain => {
            if !in_kubernetes(plan, &n.node, limits).await? {
                return Ok(Outcome::AlreadyDone(
                    "no Kubernetes node by that name".into(),
                ));
            }
            let up = match &own {
                Some(t) => answering(plan, t, limits).await.is_ok(),
                None => false,
            };
            if !up {
                return Ok(Outcome::Skipped(
                    "its Talos API does not answer: nothing runs there to drain".into(),
                ));
            }
            drain::cordon_and_drain(plan, &n.node, opts.drain_timeout, limits, progress).await?;
            Ok(Outcome::Done("cordoned and drained".into()))
        }
        Step::LeaveEtcd => leave_etcd(plan, removal, n, own.as_ref(), limits).await,
        Step::Reset => {
            let Some(t) = own else {
                return Ok(Outcome::Skipped("no address to reach it at".into()));
            };
            let client = match answering(plan, &t, limits).await {
                Ok(c) => c,
                Err(e) => {
                    return Ok(Outcome::Skipped(format!(
                        "it does not answer ({}): reset already, or gone",
                        shown(&e.to_string())
                    )));
                }
            };
            // `answering` read it a moment ago; unreadable: the labels every
            // version accepts.
            let talos = client.version().await.ok().map(|v| v.tag);
            let request = reset_request(talos.as_deref());
            let labels: Vec<&str> = request
                .system_partitions_to_wipe
                .iter()
                .map(|p| p.label.as_str())
                .collect();
            let done = format!(
                "Reset (graceful, {} wiped); it powered off",
                labels.join(", ")
            );
            client.reset(request).await.map_err(StepError::Reset)?;
            wait_silent(plan, &t, opts).await?;
            Ok(Outcome::Done(done))
        }
        Step::DeleteNode => delete_node(plan, n, limits).await,
    }
}

/// Whether the machine answering at `t` is node `n`'s machine (see
/// [`plan::check_identity`]); nothing answering proves nothing and stops
/// nothing (a step on a silent node goes through the others).
async fn prove(
    plan: &Plan,
    removal: &RemovalPlan,
    n: &NodeRemoval,
    t: &NodeEndpoint,
    limits: &Options,
) -> Result<(), StepError> {
    let identity::Answer::Node(answered) = identity::read_at(plan, t, limits).await else {
        return Ok(());
    };
    plan::check_identity(
        &n.node,
        &t.addr.to_string(),
        &n.expected,
        answered.as_deref(),
        &removal.inventory_ids,
    )?;
    Ok(())
}

/// The system volumes Talos v1.14 lets a machine config place on
/// partitions of their own instead of directories under EPHEMERAL
/// (siderolabs/talos v1.14 `pkg/machinery/config/config/volume.go`
/// `PromotableSystemVolumeNames`: ETCD — etcd's data —, CRI, KUBELET, LOG).
pub const V1_14_SYSTEM_VOLUMES: [&str; 4] = ["ETCD", "CRI", "KUBELET", "LOG"];

/// What `talosctl reset --graceful --reboot=false
/// --system-labels-to-wipe STATE --system-labels-to-wipe EPHEMERAL …` sends
/// (`cmd/talosctl/cmd/talos/reset.go`) to a node running Talos `talos`: the
/// node's config and its data go, the boot partitions and META stay, and it
/// powers off. Its data is STATE and EPHEMERAL — and on Talos v1.14+ also
/// the [`V1_14_SYSTEM_VOLUMES`]: a control plane's etcd data may sit on a
/// partition of its own there, which wiping EPHEMERAL leaves alone (the
/// removed member's data would stay on the disk). v1.14's Reset
/// (`v1alpha1_server.go`, "allow directory-backed volumes in reset api")
/// takes such a label for a volume that is only a directory too, when the
/// volume it resides on (EPHEMERAL) is wiped in the same request, as here
/// — the set Talos's own tests reset with (`internal/integration/api/
/// reset.go`, `ephemeralWithSystemVolumesToWipe`). Before v1.14 (and for an
/// unreadable version) only STATE and EPHEMERAL: v1.13's Reset refuses the
/// directory-backed ETCD ("volume \"ETCD\" is not located").
pub(crate) fn reset_request(talos: Option<&str>) -> ResetRequest {
    let v1_14 = talos
        .and_then(|v| crate::inventory::parse_version(v, false))
        .is_some_and(|(major, minor, _)| (major, minor) >= (1, 14));
    let extra: &[&str] = if v1_14 { &V1_14_SYSTEM_VOLUMES } else { &[] };
    ResetRequest {
        graceful: true,
        reboot: false,
        system_partitions_to_wipe: ["STATE", "EPHEMERAL"]
            .iter()
            .chain(extra)
            .map(|label| ResetPartitionSpec {
                label: (*label).into(),
                wipe: true,
            })
            .collect(),
        user_disks_to_wipe: Vec::new(),
        mode: reset_request::WipeMode::All as i32,
    }
}

/// Waits until the node at `t` no longer answers (its reset sequence ran
/// and it powered off), at most the reset timeout.
async fn wait_silent(plan: &Plan, t: &NodeEndpoint, opts: &RemoveOptions) -> Result<(), StepError> {
    let deadline = Instant::now() + opts.reset_timeout;
    loop {
        let probe = tokio::time::timeout(
            opts.limits.call_timeout * 2,
            answering(plan, t, &opts.limits),
        )
        .await;
        if matches!(probe, Ok(Err(_))) {
            return Ok(());
        }
        if Instant::now() + opts.limits.poll > deadline {
            return Err(StepError::StillAnswers {
                timeout: opts.reset_timeout,
            });
        }
        tokio::time::sleep(opts.limits.poll).await;
    }
}

/// The control plane leaves etcd: on itself when it answers
/// (EtcdLeaveCluster), else removed by member ID from the remaining
/// control plane that lists the members. Re-checks etcd's quorum rule on
/// the members as they are now: a member of another node this run removes
/// later is healthy when that node says so (as `survey` judged it for the
/// plan), so two control planes leave one after the other.
async fn leave_etcd(
    plan: &Plan,
    removal: &RemovalPlan,
    n: &NodeRemoval,
    own: Option<&NodeEndpoint>,
    limits: &Options,
) -> Result<Outcome, StepError> {
    let removed: Vec<(String, Option<NodeEndpoint>)> = removal
        .nodes
        .iter()
        .map(|r| (r.node.clone(), r.endpoint.map(|e| target(e, r.address))))
        .collect();
    let Some((now, from, lister)) = members(plan, &removed, false, limits).await else {
        return Err(StepError::NoEtcdLister);
    };
    let member = now
        .iter()
        .find(|m| m.hostname == n.node)
        .or_else(|| n.member.and_then(|id| now.iter().find(|m| m.id == id)));
    let Some(member) = member else {
        return Ok(Outcome::AlreadyDone(format!(
            "not an etcd member any more ({from} lists {})",
            now.len()
        )));
    };
    let id = member.id;
    plan::may_remove(&now, id).map_err(|q| StepError::Quorum {
        others: q.others,
        healthy: q.healthy,
        needed: q.needed,
    })?;
    if let Some(t) = own
        && let Ok(c) = answering(plan, t, limits).await
    {
        // talosctl reset's order: hand leadership off first, so the
        // cluster does not lose its leader with the member.
        let handed = match c.etcd_forfeit_leadership().await {
            Ok(to) if !to.is_empty() => format!("leadership handed to {to}; "),
            Ok(_) => String::new(),
            Err(e) if e.code() == Some(tonic::Code::Unimplemented) => String::new(),
            Err(e) => {
                return Err(etcd_refusal(
                    "EtcdForfeitLeadership",
                    &shown(&e.to_string()),
                ));
            }
        };
        let long = NodeClient::connect(t, &mtls(plan), LEAVE_TIMEOUT + limits.call_timeout)
            .await
            .map_err(StepError::LeaveConnect)?;
        leave_while_unhealthy(&long, LEAVE_TIMEOUT, limits.poll).await?;
        return Ok(Outcome::Done(format!(
            "{handed}EtcdLeaveCluster on the node"
        )));
    }
    match lister.etcd_remove_member_by_id(id).await {
        Ok(()) => Ok(Outcome::Done(format!(
            "it does not answer: EtcdRemoveMemberByID {id:016x} on {from}"
        ))),
        Err(e) if e.code() == Some(tonic::Code::NotFound) => Ok(Outcome::AlreadyDone(format!(
            "member {id:016x} was gone when {from} tried to remove it"
        ))),
        Err(e) => Err(etcd_refusal(
            &format!("EtcdRemoveMemberByID {id:016x} on {from}"),
            &shown(&e.to_string()),
        )),
    }
}

/// How long Talos retries etcd's "unhealthy" inside EtcdLeaveCluster
/// (siderolabs/talos `pkg/etcd/etcd.go` `LeaveCluster`:
/// `retry.Constant(5*time.Minute, retry.WithUnits(10*time.Second))` on
/// `rpctypes.ErrUnhealthy`): the call needs a deadline past it, and imgbuild
/// keeps asking for as long where a node gives up sooner.
pub const LEAVE_TIMEOUT: Duration = Duration::from_secs(300);

/// EtcdLeaveCluster on `c`, asked again every `poll` while etcd answers
/// "unhealthy" (the member has no connection to a quorum of the others
/// yet), at most `limit`.
async fn leave_while_unhealthy(
    c: &NodeClient,
    limit: Duration,
    poll: Duration,
) -> Result<(), StepError> {
    let deadline = Instant::now() + limit;
    loop {
        match c.etcd_leave_cluster().await {
            Ok(()) => return Ok(()),
            Err(e) => {
                let text = shown(&e.to_string());
                if !is_unhealthy(&text) {
                    return Err(etcd_refusal("EtcdLeaveCluster", &text));
                }
                if Instant::now() + poll > deadline {
                    return Err(StepError::StillUnhealthy { limit, text });
                }
                tokio::time::sleep(poll).await;
            }
        }
    }
}

/// Whether etcd said "unhealthy cluster" (`rpctypes.ErrUnhealthy`).
fn is_unhealthy(text: &str) -> bool {
    text.contains("etcdserver: unhealthy cluster")
}

/// An etcd failure as the user needs it: etcd's own refusal to remove a
/// member that would cost quorum said in words, with etcd's message kept.
fn etcd_refusal(call: &str, text: &str) -> StepError {
    let (call, text) = (call.to_owned(), text.to_owned());
    if text.contains("not enough started members") {
        StepError::TooFewStarted { call, text }
    } else if is_unhealthy(&text) {
        StepError::EtcdUnhealthy { call, text }
    } else {
        StepError::Etcd { call, text }
    }
}

/// Whether Kubernetes has a Node `name` (the API must answer).
async fn in_kubernetes(plan: &Plan, name: &str, limits: &Options) -> Result<bool, StepError> {
    let nodes = kube_nodes(plan, limits)
        .await
        .ok_or(StepError::KubeSilent)?;
    Ok(nodes.iter().any(|k| k.name == name))
}

/// `DELETE /api/v1/nodes/NAME` (bounded reply, deadline), unless it is
/// gone; never a Node whose machine ID shows another machine than the one
/// of record.
async fn delete_node(plan: &Plan, n: &NodeRemoval, limits: &Options) -> Result<Outcome, StepError> {
    let name = n.node.as_str();
    let nodes = kube_nodes(plan, limits)
        .await
        .ok_or(StepError::KubeSilent)?;
    let Some(k) = nodes.iter().find(|k| k.name == name) else {
        return Ok(Outcome::AlreadyDone(
            "no Kubernetes node by that name".into(),
        ));
    };
    if let (Some(found), Some(m)) = (&k.machine_id, n.expected.machine_id())
        && m != *found
    {
        return Err(StepError::NodeOfAnotherMachine {
            found: identity::short(found),
            expected: n.expected.describe(),
        });
    }
    let kc = kubeconfig(plan)?;
    let (path, t) = (format!("/api/v1/nodes/{name}"), limits.call_timeout);
    let deleted = tokio::task::spawn_blocking(move || {
        kc.send_json(reqwest::Method::DELETE, &path, None, t)
            .map(|_| ())
    })
    .await?;
    match deleted {
        Ok(()) => Ok(Outcome::Done("Kubernetes Node deleted".into())),
        // Someone else deleted it meanwhile: as good.
        Err(_) if !in_kubernetes(plan, name, limits).await? => Ok(Outcome::AlreadyDone(
            "no Kubernetes node by that name".into(),
        )),
        Err(e) => Err(StepError::Delete(e)),
    }
}

#[cfg(test)]
mod etcd_tests {
    use super::*;

    #[test]
    fn etcds_refusal_reaches_the_user_in_words() {
        // etcd 3.4 ErrNotEnoughStartedMembers, as Talos passes it on.
        let e = etcd_refusal(
            "EtcdLeaveCluster",
            "rpc error: code = Unknown desc = etcdserver: re-configuration failed due to not enough started members",
        );
        assert!(matches!(&e, StepError::TooFewStarted { call, .. } if call == "EtcdLeaveCluster"));
        let e = e.to_string();
        assert!(e.starts_with("EtcdLeaveCluster: etcd refused: removing this member would leave too few started members for quorum"), "{e}");
        assert!(e.contains("(etcd: rpc error"), "{e}");
        assert_eq!(etcd_refusal("X", "boom").to_string(), "X: boom");
        assert!(is_unhealthy("etcdserver: unhealthy cluster"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn node_list_items_give_internal_ip_and_control_plane_label() {
        let list = json!({"items": [
            {"metadata": {"name": "cp-01", "labels": {"node-role.kubernetes.io/control-plane": ""}},
             "status": {"addresses": [{"type": "Hostname", "address": "cp-01"},
                                      {"type": "InternalIP", "address": "10.0.0.11"}]}},
            {"metadata": {"name": "w-01", "labels": {}}, "status": {}},
            {"metadata": {"name": "w-02"}, "status": {"nodeInfo": {"machineID": "0b30557a9fc4e90e33587da2c7ec1136"}}},
            {"metadata": {"name": "w-03"}, "status": {"nodeInfo": {"machineID": "../x"}}},
        ]});
        let seen = seen_nodes(&list);
        assert_eq!(seen[1].machine_id, None);
        assert_eq!(
            seen[2].machine_id.as_deref(),
            Some("0b30557a9fc4e90e33587da2c7ec1136")
        );
        assert_eq!(seen[3].machine_id, None);
        assert_eq!(seen[0].internal_ip, Some("10.0.0.11".parse().unwrap()));
        assert!(seen[0].control_plane);
        assert_eq!(seen[1].internal_ip, None);
        assert!(!seen[1].control_plane);
    }

    fn wiped(r: &ResetRequest) -> Vec<&str> {
        r.system_partitions_to_wipe
            .iter()
            .filter(|p| p.wipe)
            .map(|p| p.label.as_str())
            .collect()
    }

    #[test]
    fn reset_wipes_state_and_ephemeral_gracefully_and_powers_off() {
        // Talos v1.13.5: ETCD is a directory under EPHEMERAL, and naming it
        // is refused ("volume \"ETCD\" is not located").
        for talos in [Some("v1.11.5"), Some("v1.13.5"), None] {
            let r = reset_request(talos);
            assert!(r.graceful && !r.reboot);
            assert_eq!(wiped(&r), ["STATE", "EPHEMERAL"], "{talos:?}");
            // talosctl's default wipe mode (no user disks named: none wiped).
            assert_eq!(r.mode, reset_request::WipeMode::All as i32);
        }
    }

    #[test]
    fn talos_1_14_reset_also_wipes_the_etcd_volume_and_the_other_system_volumes() {
        // Talos v1.14.0: ETCD (etcd's data), CRI, KUBELET and LOG may be
        // partitions of their own; EPHEMERAL is in the same request, so a
        // directory-backed one is accepted too.
        let r = reset_request(Some("v1.14.0"));
        assert_eq!(
            wiped(&r),
            ["STATE", "EPHEMERAL", "ETCD", "CRI", "KUBELET", "LOG"]
        );
        assert!(r.graceful && !r.reboot);
        assert_eq!(wiped(&reset_request(Some("v1.15.2"))).len(), 6);
    }
}
