//! `imgbuild status`: each node against the inventory, read from the
//! nodes themselves, all at once (bounded): reachable, Talos version,
//! schematic, config in sync, etcd member, Kubernetes Ready. `up` reports
//! drift from the same rows. Nothing here changes a node: the config is
//! compared with a TRY dry run, the one request that does not cancel a
//! pending TRY rollback (siderolabs/talos
//! `internal/app/machined/internal/server/v1alpha1/v1alpha1_server.go`,
//! `CancelConfigRollbackTimeout` for every other mode, dry runs included).

use std::collections::BTreeMap;

use futures_util::StreamExt;

use super::bootstrap::{Options, Plan, PlannedNode};
use super::client::{ApiError, ApplyMode, Mode, NodeClient};
use super::config::Fingerprints;
use super::health::kube_nodes;
use super::upgrade::{READ_CONCURRENCY, Record, Running, Wanted, running};
use crate::inventory::Role;

/// One node's row.
#[derive(Debug, Clone, serde::Serialize)]
pub struct NodeStatus {
    pub node: String,
    pub role: String,
    pub reachable: bool,
    pub version: Option<String>,
    pub wanted_version: String,
    /// None when the node cannot tell (no `schematic` extension: stock
    /// Talos, or the read failed): unknown, which is not different.
    pub schematic: Option<String>,
    pub wanted_schematic: String,
    /// Whether the running schematic is the wanted one (base, or the node's
    /// own with META before its first upgrade); true when unknown.
    pub schematic_in_sync: bool,
    /// None when the node could not be asked.
    pub config_in_sync: Option<bool>,
    /// The config change needs a reboot (Talos v1.9–v1.13 refuse it in
    /// immediate mode): `imgbuild apply` reboots the node.
    pub config_needs_reboot: bool,
    /// The running config differs, but the node persisted the rendered one
    /// (a STAGED apply): staged, reboot pending. Not drift.
    pub config_staged: bool,
    /// Control planes only: whether etcd lists it as a member.
    pub etcd_member: Option<bool>,
    /// None when Kubernetes could not be asked.
    pub ready: Option<bool>,
    /// Whether Kubernetes marks it unschedulable (cordoned, e.g. by a
    /// drain that did not finish); None when Kubernetes could not be asked.
    pub cordoned: Option<bool>,
    /// What went wrong asking the node (why it is not reachable).
    pub error: Option<String>,
    /// `${NAME}`s not set here whose values were compared by the
    /// fingerprint recorded when they were last applied.
    pub compared_by_fingerprint: Vec<String>,
    /// What the node's SecurityState says (None: it could not tell).
    pub security: Option<super::client::SecurityState>,
    /// Whether the inventory boots it with Secure Boot.
    pub wanted_secure_boot: bool,
}

/// What differs from the inventory, and the command that fixes it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Drift {
    pub node: String,
    /// `version`, `schematic`, `config`, `secureBoot` or `unreachable`.
    pub what: &'static str,
    pub fix: &'static str,
}

impl std::fmt::Display for Drift {
    /// One line: an unreachable node is said to be unreachable (nothing
    /// could be compared), anything else is what differs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.what == UNREACHABLE {
            write!(
                f,
                "{}: unreachable, so not compared with the inventory (if it was never set up: {})",
                self.node, self.fix
            )
        } else {
            write!(
                f,
                "{}: {} differs from the inventory (fix: {})",
                self.node, self.what, self.fix
            )
        }
    }
}

/// [`Drift::what`] of a node that could not be asked.
pub const UNREACHABLE: &str = "unreachable";

impl NodeStatus {
    /// The ways this node drifted from the inventory.
    pub fn drift(&self) -> Vec<Drift> {
        let d = |what, fix| Drift {
            node: self.node.clone(),
            what,
            fix,
        };
        if !self.reachable {
            return vec![d(UNREACHABLE, "imgbuild bootstrap")];
        }
        let mut out = Vec::new();
        if self.version.as_deref() != Some(self.wanted_version.as_str()) {
            out.push(d("version", "imgbuild upgrade"));
        }
        if !self.schematic_in_sync {
            out.push(d("schematic", "imgbuild upgrade"));
        }
        if self.config_in_sync == Some(false) && !self.config_staged {
            out.push(d("config", "imgbuild apply"));
        }
        if self
            .security
            .as_ref()
            .is_some_and(|s| s.secure_boot != self.wanted_secure_boot)
        {
            // siderolabs/talos#9245: no upgrade switches it.
            out.push(d(
                "secureBoot",
                "rebuild the node's disk from the matching image and reinstall it (an upgrade cannot switch Secure Boot)",
            ));
        }
        out
    }

    /// What `status` reports beyond [`NodeStatus::drift`]: a control plane
    /// etcd does not list as a member (unknown is not different). `up`
    /// leaves membership to its own steps, so it is not in `drift`.
    pub fn etcd_drift(&self) -> Option<Drift> {
        (self.etcd_member == Some(false)).then(|| Drift {
            node: self.node.clone(),
            what: ETCD_MEMBER,
            fix: "wipe its EPHEMERAL partition so it joins etcd again \
                  (talosctl reset --system-labels-to-wipe EPHEMERAL --reboot)",
        })
    }
}

/// [`Drift::what`] of a control plane that is not an etcd member.
pub const ETCD_MEMBER: &str = "etcdMember";

/// The nodes that do not answer, each with why: a connect and a Version
/// call under one deadline (the call timeout), all nodes at once
/// (bounded). Status asks these once, so that a stalled node costs one
/// call timeout however many reads the command makes.
pub async fn silent(plan: &Plan, opts: &Options) -> BTreeMap<String, String> {
    let mode = Mode::Mtls(plan.identity.clone());
    let probes = plan.nodes.iter().map(|node| {
        let mode = mode.clone();
        async move {
            let started = std::time::Instant::now();
            let answer = tokio::time::timeout(opts.call_timeout, async {
                let conn = NodeClient::connect(&node.endpoint, &mode, opts.call_timeout).await?;
                conn.version().await
            })
            .await;
            let why = match answer {
                Ok(Ok(_)) => None,
                Ok(Err(_)) | Err(_) if started.elapsed() >= opts.call_timeout => {
                    Some(super::upgrade::no_answer(opts.call_timeout))
                }
                Ok(Err(e)) => Some(e.to_string()),
                Err(_) => Some(super::upgrade::no_answer(opts.call_timeout)),
            };
            why.map(|w| (node.name.clone(), w))
        }
    });
    futures_util::stream::iter(probes)
        .buffered(READ_CONCURRENCY)
        .filter_map(|x| async move { x })
        .collect()
        .await
}

/// Kubernetes could not be asked at all, so every node's READY and each
/// component's version are unknown: why, and what to do.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct KubeUnasked {
    pub why: String,
    pub fix: String,
}

impl std::fmt::Display for KubeUnasked {
    /// One line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Kubernetes could not be asked ({}), so READY and the components are unknown: {}",
            self.why, self.fix
        )
    }
}

impl KubeUnasked {
    /// `why` for `plan`: the way out depends on the kubeconfig that was
    /// used (the state dir's, or the one minted from the secrets) and on
    /// where it points.
    pub fn new(plan: &Plan, why: &str) -> KubeUnasked {
        let why = crate::input::one_line(why, 300);
        let fix = if super::health::state_dir_kubeconfig(plan) {
            format!(
                "{} is used while it fits the secrets; delete it to read through one minted from the secrets, or run `imgbuild bootstrap` to renew it",
                plan.kubeconfig_path.display()
            )
        } else if let Some(outside) = &plan.kubernetes_endpoint {
            format!(
                "check that cluster.kubernetesEndpoint {outside} forwards to the API server, then run status again"
            )
        } else {
            format!(
                "check that {} (cluster.endpoint) answers from this host, or set cluster.kubernetesEndpoint to a port forward that reaches it, then run status again",
                plan.endpoint
            )
        };
        KubeUnasked { why, fix }
    }
}

/// Every node's row, in inventory order; the nodes in `silent` (see
/// [`silent`]) are reported unreachable without being asked again. Also
/// why Kubernetes could not be asked, when it could not.
pub async fn collect(
    plan: &Plan,
    wanted: &BTreeMap<String, Wanted>,
    record: &Record,
    fingerprints: &Fingerprints,
    opts: &Options,
    silent: &BTreeMap<String, String>,
) -> (Vec<NodeStatus>, Option<KubeUnasked>) {
    let mut asked = plan.clone();
    asked.nodes.retain(|n| !silent.contains_key(&n.name));
    let (ready, read) = futures_util::join!(
        kube_nodes(plan, opts),
        read_nodes(&asked, wanted, record, fingerprints, opts)
    );
    let mut read = read.into_iter();
    let mut rows: Vec<NodeStatus> = plan
        .nodes
        .iter()
        .map(|node| match silent.get(&node.name) {
            Some(why) => unreachable_row(node, &wanted[&node.name], why),
            None => read.next().expect("a row per asked node"),
        })
        .collect();
    let unasked = ready
        .as_ref()
        .err()
        .map(|e| KubeUnasked::new(plan, &e.to_string()));
    let ready = ready.ok();
    for row in &mut rows {
        row.ready = ready
            .as_ref()
            .map(|list| list.iter().any(|k| k.name == row.node && k.ready));
        row.cordoned = ready
            .as_ref()
            .map(|list| list.iter().any(|k| k.name == row.node && k.cordoned));
    }
    (rows, unasked)
}

/// How the nodes differ from the inventory, and which hold the rendered
/// config staged for their next reboot (not a difference).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Differences {
    pub drift: Vec<Drift>,
    /// Nodes whose config is staged, reboot pending.
    pub staged: Vec<String>,
}

/// How the nodes differ from the inventory, from the same rows without
/// asking Kubernetes: `up` knows who is Ready from its last health round.
pub async fn drift(
    plan: &Plan,
    wanted: &BTreeMap<String, Wanted>,
    record: &Record,
    fingerprints: &Fingerprints,
    opts: &Options,
) -> Differences {
    let rows = read_nodes(plan, wanted, record, fingerprints, opts).await;
    Differences {
        drift: rows.iter().flat_map(NodeStatus::drift).collect(),
        staged: rows
            .iter()
            .filter(|r| r.config_staged)
            .map(|r| r.node.clone())
            .collect(),
    }
}

/// How a node's config compares with the rendered one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigState {
    InSync,
    /// Differs; applies without a reboot.
    Differs,
    /// Differs in a way the node applies only with a reboot.
    NeedsReboot,
}

/// The diff in a dry run's mode details: what follows "Config diff:",
/// empty for "No changes.".
pub fn diff_of(mode_details: &str) -> String {
    let diff = mode_details
        .split_once("Config diff:")
        .map_or(mode_details, |(_, d)| d)
        .trim();
    if diff == "No changes." {
        String::new()
    } else {
        diff.to_owned()
    }
}

/// Whether an error is Talos v1.9–v1.13 refusing a change in immediate
/// mode (`CanApplyImmediate`: "this config change can't be applied in
/// immediate mode"): the change needs a reboot.
pub fn needs_reboot_error(e: &ApiError) -> bool {
    e.code() == Some(tonic::Code::InvalidArgument) && e.to_string().contains("immediate mode")
}

/// Compares `node`'s config with the rendered one by a TRY dry run: the
/// node answers its diff, or refuses a change that needs a reboot.
pub async fn config_state(conn: &NodeClient, node: &PlannedNode) -> Result<ConfigState, ApiError> {
    Ok(compared_config_state(conn, node, &Fingerprints::default())
        .await?
        .0)
}

/// [`config_state`] of a config rendered with placeholders for unset
/// `${NAME}`s, those compared by the fingerprints recorded when they were
/// last applied; also the names so compared.
async fn compared_config_state(
    conn: &NodeClient,
    node: &PlannedNode,
    fingerprints: &Fingerprints,
) -> Result<(ConfigState, Vec<String>), ApiError> {
    match conn
        .apply_mode(node.config.clone(), ApplyMode::Try, true)
        .await
    {
        Ok(details) => {
            let compared = fingerprints.compare(&diff_of(&details));
            let state = if compared.in_sync {
                ConfigState::InSync
            } else {
                ConfigState::Differs
            };
            Ok((state, compared.by_fingerprint))
        }
        Err(e) if needs_reboot_error(&e) => Ok((ConfigState::NeedsReboot, Vec::new())),
        Err(e) => Err(e),
    }
}

/// Whether Talos `version` keeps its persisted config as the COSI resource
/// `MachineConfigs.config.talos.dev` `persistent` (v1.10 on; siderolabs/talos
/// `pkg/machinery/resources/config/machine_config.go`); v1.9 keeps only
/// the file.
pub fn persisted_as_resource(version: &str) -> bool {
    crate::inventory::parse_version(version, false).is_some_and(|v| v >= (1, 10, 0))
}

/// The lines only `old` has (`-`) and only `new` has (`+`), as multisets:
/// enough to tell whether two configs hold the same settings, and in the
/// shape [`Fingerprints::compare`] reads.
pub fn changed_lines(old: &str, new: &str) -> String {
    let mut left: Vec<&str> = old.lines().collect();
    let mut out = String::new();
    for line in new.lines() {
        match left.iter().position(|l| *l == line) {
            Some(i) => {
                left.swap_remove(i);
            }
            None => out += &format!("+{line}\n"),
        }
    }
    for line in left {
        out += &format!("-{line}\n");
    }
    out
}

/// Whether `node` (running Talos `version`) persisted the rendered config
/// for its next boot: a STAGED apply waiting for a reboot. The persisted
/// config is compared line by line, unset `${NAME}`s by `fingerprints`.
pub async fn staged(
    conn: &NodeClient,
    node: &PlannedNode,
    version: &str,
    fingerprints: &Fingerprints,
) -> Result<bool, ApiError> {
    let Some(persisted) = conn
        .persisted_config(persisted_as_resource(version))
        .await?
    else {
        return Ok(false);
    };
    let diff = changed_lines(
        &String::from_utf8_lossy(&persisted),
        &String::from_utf8_lossy(&node.config),
    );
    Ok(fingerprints.compare(&diff).in_sync)
}

/// One node's row as the node tells it, and (control planes) the etcd
/// members it sees.
async fn read_node(
    plan: &Plan,
    node: &PlannedNode,
    want: &Wanted,
    record: &Record,
    fingerprints: &Fingerprints,
    opts: &Options,
) -> (NodeStatus, Option<Vec<String>>) {
    let mode = Mode::Mtls(plan.identity.clone());
    let now: Running = running(plan, node, record, opts).await;
    let mut row = NodeStatus {
        node: node.name.clone(),
        role: if node.role == Role::Controlplane {
            "controlplane"
        } else {
            "worker"
        }
        .into(),
        reachable: now.version.is_some(),
        schematic_in_sync: now.schematic.is_none() || now.schematic_is(want),
        version: now.version,
        wanted_version: want.version.clone(),
        schematic: now.schematic,
        wanted_schematic: want.schematic.clone(),
        config_in_sync: None,
        config_needs_reboot: false,
        config_staged: false,
        etcd_member: None,
        ready: None,
        cordoned: None,
        error: now.error,
        compared_by_fingerprint: Vec::new(),
        security: now.security,
        wanted_secure_boot: want.secure_boot,
    };
    let mut members = None;
    if row.reachable
        && let Ok(conn) = NodeClient::connect(&node.endpoint, &mode, opts.call_timeout).await
    {
        match compared_config_state(&conn, node, fingerprints).await {
            Ok((state, by_fingerprint)) => {
                row.config_in_sync = Some(state == ConfigState::InSync);
                row.config_needs_reboot = state == ConfigState::NeedsReboot;
                row.compared_by_fingerprint = by_fingerprint;
                // A read that fails leaves the difference standing.
                if state != ConfigState::InSync
                    && let Some(version) = row.version.as_deref()
                {
                    row.config_staged = staged(&conn, node, version, fingerprints)
                        .await
                        .unwrap_or(false);
                }
            }
            Err(e) => row.error = Some(format!("config diff: {e}")),
        }
        if node.role == Role::Controlplane {
            members = conn
                .etcd_members()
                .await
                .ok()
                .map(|m| m.into_iter().map(|m| m.hostname).collect());
        }
    }
    (row, members)
}

/// The row of a node that did not answer.
fn unreachable_row(node: &PlannedNode, want: &Wanted, why: &str) -> NodeStatus {
    NodeStatus {
        node: node.name.clone(),
        role: if node.role == Role::Controlplane {
            "controlplane"
        } else {
            "worker"
        }
        .into(),
        reachable: false,
        version: None,
        wanted_version: want.version.clone(),
        schematic: None,
        wanted_schematic: want.schematic.clone(),
        schematic_in_sync: true,
        config_in_sync: None,
        config_needs_reboot: false,
        config_staged: false,
        etcd_member: None,
        ready: None,
        cordoned: None,
        error: Some(why.to_owned()),
        compared_by_fingerprint: Vec::new(),
        security: None,
        wanted_secure_boot: want.secure_boot,
    }
}

/// Every node's row as the nodes tell it (Ready left unknown), all nodes
/// at once (bounded).
async fn read_nodes(
    plan: &Plan,
    wanted: &BTreeMap<String, Wanted>,
    record: &Record,
    fingerprints: &Fingerprints,
    opts: &Options,
) -> Vec<NodeStatus> {
    let read: Vec<(NodeStatus, Option<Vec<String>>)> = futures_util::stream::iter(
        plan.nodes
            .iter()
            .map(|node| read_node(plan, node, &wanted[&node.name], record, fingerprints, opts)),
    )
    .buffered(READ_CONCURRENCY)
    .collect()
    .await;
    let members = read.iter().find_map(|(_, m)| m.clone());
    let mut rows: Vec<NodeStatus> = read.into_iter().map(|(r, _)| r).collect();
    for (row, node) in rows.iter_mut().zip(&plan.nodes) {
        if node.role == Role::Controlplane {
            row.etcd_member = members.as_ref().map(|m| m.contains(&node.name));
        }
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row() -> NodeStatus {
        NodeStatus {
            node: "cp-01".into(),
            role: "controlplane".into(),
            reachable: true,
            version: Some("v1.11.2".into()),
            wanted_version: "v1.11.2".into(),
            schematic: Some("a".into()),
            wanted_schematic: "a".into(),
            schematic_in_sync: true,
            config_in_sync: Some(true),
            config_needs_reboot: false,
            config_staged: false,
            etcd_member: Some(true),
            ready: Some(true),
            cordoned: Some(false),
            error: None,
            compared_by_fingerprint: Vec::new(),
            security: None,
            wanted_secure_boot: false,
        }
    }

    #[test]
    fn changed_lines_are_a_multiset_difference() {
        assert_eq!(changed_lines("a\nb\nb\n", "b\na\nb\n"), "");
        assert_eq!(changed_lines("a\nb\n", "a\nc\n"), "+c\n-b\n");
        assert_eq!(changed_lines("a\nb\nb\n", "a\nb\n"), "-b\n");
        assert!(persisted_as_resource("v1.10.0") && !persisted_as_resource("v1.9.6"));
    }

    /// A control plane etcd does not list is a difference for `status`;
    /// unknown membership (no control plane answered) is not.
    #[test]
    fn a_control_plane_outside_etcd_is_a_difference() {
        assert_eq!(row().etcd_drift(), None);
        let mut r = row();
        r.etcd_member = None;
        assert_eq!(r.etcd_drift(), None);
        r.etcd_member = Some(false);
        let d = r.etcd_drift().expect("a difference");
        assert_eq!(d.what, ETCD_MEMBER);
        assert!(d.to_string().contains("cp-01: etcdMember differs"), "{d}");
    }

    #[test]
    fn a_staged_config_is_not_drift() {
        let mut r = row();
        r.config_in_sync = Some(false);
        r.config_staged = true;
        assert!(r.drift().is_empty());
        r.config_staged = false;
        assert_eq!(r.drift()[0].what, "config");
    }

    #[test]
    fn drift_names_what_differs_and_the_fixing_command() {
        assert!(row().drift().is_empty());
        let mut r = row();
        r.wanted_version = "v1.11.5".into();
        r.config_in_sync = Some(false);
        let d = r.drift();
        assert_eq!(
            d.iter().map(|d| (d.what, d.fix)).collect::<Vec<_>>(),
            [
                ("version", "imgbuild upgrade"),
                ("config", "imgbuild apply")
            ]
        );
        let mut r = row();
        r.wanted_secure_boot = true;
        assert!(r.drift().is_empty(), "unknown is not different");
        r.security = Some(super::super::client::SecurityState {
            secure_boot: false,
            uki_signing_key_fingerprint: None,
            pcr_signing_key_fingerprint: None,
        });
        assert_eq!(r.drift()[0].what, "secureBoot");
        let mut r = row();
        r.schematic_in_sync = false;
        assert_eq!(r.drift()[0].what, "schematic");
        assert_eq!(
            r.drift()[0].to_string(),
            "cp-01: schematic differs from the inventory (fix: imgbuild upgrade)"
        );
        r.reachable = false;
        assert_eq!(r.drift()[0].what, "unreachable");
        let said = r.drift()[0].to_string();
        assert!(
            said.starts_with("cp-01: unreachable, so not compared") && !said.contains("differs"),
            "{said}"
        );
    }
}
