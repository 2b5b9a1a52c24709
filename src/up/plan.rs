//! The plan as data: what `up --dry-run` decided, typed per kind of action
//! (from → to values, never free text), with the observations it rests on
//! (the inventory's and each patch file's digest, each `${NAME}`'s
//! fingerprint, each node's Talos state and version, each machine). `up
//! --out FILE` writes it; `up --plan FILE` reads it back and refuses, naming
//! the first difference, when a fresh plan of the same inventory is not
//! this one ([`Plan::differences`]): an edited inventory or patch, a
//! changed `${NAME}`, a node upgraded out of band, a VM changed in Proxmox,
//! a volume a prune would delete now in use. Holds no secret: values from
//! the environment appear as keyed fingerprints only.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::digest::Sha256;
use crate::inventory::{Inventory, Role};
use crate::talos::config::PatchVars;

/// The steps of `up`, in the order they run.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Step {
    /// Each node's image.
    Build,
    /// New images onto the target (only for machines that will boot them).
    Publish,
    /// New machines created and started.
    Machines,
    /// New nodes configured; etcd bootstrapped once; health.
    Bootstrap,
    /// Talos version and schematic, node by node (as `imgbuild upgrade`).
    Upgrade,
    /// The cluster's Kubernetes version (as `imgbuild upgrade`).
    Kubernetes,
    /// Machine configs (as `imgbuild apply`).
    Configs,
    /// VM or server settings (cores, memory, disk, network).
    Settings,
    /// Nodes gone from the inventory: drained, reset, deleted.
    Remove,
    /// Volumes, ISOs and snapshots no machine uses.
    Prune,
}

impl Step {
    pub fn as_str(self) -> &'static str {
        match self {
            Step::Build => "build",
            Step::Publish => "publish",
            Step::Machines => "machines",
            Step::Bootstrap => "bootstrap",
            Step::Upgrade => "upgrade",
            Step::Kubernetes => "kubernetes",
            Step::Configs => "configs",
            Step::Settings => "settings",
            Step::Remove => "remove",
            Step::Prune => "prune",
        }
    }
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A node's Talos API as last seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TalosState {
    /// Answers without a client certificate: waiting for its config.
    Maintenance,
    /// Answers over mTLS only: configured.
    Configured,
    /// Port closed or no TLS answer.
    Unreachable,
}

/// How many differences a refused plan lists before "and N more".
pub const MAX_DIFFERENCES: usize = 20;

/// The plan file's format; a reader refuses any other.
pub const FORMAT: u32 = 1;

/// A value the plan knows now, or one only the action it comes from makes
/// (a built image's digest, a new VM's id): Terraform's "(known after
/// apply)".
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Known<T> {
    Known(T),
    KnownAfterApply,
}

impl<T> Known<T> {
    pub fn of(value: Option<T>) -> Known<T> {
        value.map_or(Known::KnownAfterApply, Known::Known)
    }
}

impl<T: std::fmt::Display> std::fmt::Display for Known<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Known::Known(v) => v.fmt(f),
            Known::KnownAfterApply => f.write_str("(known after apply)"),
        }
    }
}

/// A value before and after an action (`from` None: not there or unknown).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FromTo<T> {
    pub from: Option<T>,
    pub to: T,
}

/// A machine a node runs on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Machine {
    /// A Proxmox VM by id.
    Vm(u32),
    /// A Hetzner server by id.
    Server(u64),
}

impl std::fmt::Display for Machine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Machine::Vm(id) => write!(f, "VM {id}"),
            Machine::Server(id) => write!(f, "server {id}"),
        }
    }
}

/// One VM setting from → to (the inventory's field name).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Setting {
    pub field: String,
    pub from: String,
    pub to: String,
}

/// What an action does, one variant per kind, each with its typed values.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "camelCase")]
pub enum Kind {
    /// The node's image; its digest (first 12 hex digits) once built.
    BuildImage {
        image: Known<String>,
    },
    /// The image onto the target's storage.
    UploadImage {
        volume: Known<String>,
    },
    CreateMachine {
        machine: Known<Machine>,
    },
    /// A machine's settings rewritten in place (the image it boots).
    UpdateMachine {
        machine: Known<Machine>,
    },
    StartMachine {
        machine: Known<Machine>,
    },
    /// A new node in maintenance mode gets its config.
    ApplyFirstConfig,
    /// etcd bootstrapped once, on this node.
    BootstrapEtcd,
    UpgradeTalos {
        version: FromTo<String>,
        /// None: the schematic stays.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        schematic: Option<FromTo<String>>,
    },
    UpgradeKubernetes {
        version: FromTo<String>,
    },
    /// After the Kubernetes components: server-side apply of the bootstrap
    /// manifests Talos renders (the objects that differ when planned).
    SyncManifests {
        objects: Vec<String>,
    },
    /// The run's one etcd snapshot into the state dir, taken before the
    /// first control-plane change of step `before`.
    SnapshotEtcd {
        before: Step,
    },
    /// A changed machine config; `reboot` when Talos needs one for it,
    /// `staged` when it waits for the next reboot.
    ApplyConfig {
        reboot: bool,
        staged: bool,
    },
    ChangeSettings {
        settings: Vec<Setting>,
    },
    /// A node gone from the inventory: drained, out of etcd, reset.
    RemoveNode {
        role: Role,
    },
    /// Its machine and the volumes it owns, deleted.
    DeleteMachine {
        machine: String,
        volumes: Vec<String>,
    },
    /// A volume, ISO or snapshot nothing uses.
    Prune {
        item: String,
    },
    /// An action the run recorded that no kind names (never planned).
    Other,
}

impl Kind {
    /// The step it belongs to.
    pub fn step(&self) -> Step {
        match self {
            Kind::BuildImage { .. } => Step::Build,
            Kind::UploadImage { .. } => Step::Publish,
            Kind::CreateMachine { .. } | Kind::UpdateMachine { .. } | Kind::StartMachine { .. } => {
                Step::Machines
            }
            Kind::ApplyFirstConfig | Kind::BootstrapEtcd => Step::Bootstrap,
            Kind::UpgradeTalos { .. } => Step::Upgrade,
            Kind::UpgradeKubernetes { .. } | Kind::SyncManifests { .. } => Step::Kubernetes,
            Kind::SnapshotEtcd { before } => *before,
            Kind::ApplyConfig { .. } => Step::Configs,
            Kind::ChangeSettings { .. } => Step::Settings,
            Kind::RemoveNode { .. } | Kind::DeleteMachine { .. } => Step::Remove,
            Kind::Prune { .. } => Step::Prune,
            Kind::Other => Step::Bootstrap,
        }
    }

    /// Its name in the plan file (`upgradeTalos`).
    pub fn name(&self) -> String {
        serde_json::to_value(self)
            .ok()
            .and_then(|v| v["kind"].as_str().map(str::to_owned))
            .unwrap_or_default()
    }
}

/// One action of the plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Planned {
    pub step: Step,
    /// The node it is about; None for the cluster (Kubernetes, prune).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    #[serde(flatten)]
    pub kind: Kind,
    /// Deletes something: done only with `--allow-destroy`.
    pub destructive: bool,
}

impl Planned {
    /// `upgradeTalos worker-01` for messages.
    pub fn label(&self) -> String {
        match (&self.node, &self.kind) {
            (Some(n), _) => format!("{} {}", self.kind.name(), crate::input::one_line(n, 64)),
            // A prune is named by what it deletes.
            (None, Kind::Prune { item }) => {
                format!("prune of {}", crate::input::one_line(item, 200))
            }
            (None, _) => self.kind.name(),
        }
    }
}

/// A file the plan's configs come from, by digest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileDigest {
    pub path: String,
    pub sha256: String,
}

/// A node as the planner saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeSeen {
    pub node: String,
    /// Its Talos API (None: not probed).
    pub talos: Option<TalosState>,
    pub talos_version: Option<String>,
    pub machine: Option<Machine>,
    /// The volume it boots from.
    pub volume: Option<String>,
}

/// What the plan rests on; a fresh plan that sees otherwise refuses.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Observed {
    /// The inventory file's sha256.
    pub inventory: String,
    /// Each patch file the inventory names, by sha256.
    pub patches: Vec<FileDigest>,
    /// Each `${NAME}` the patches use: a keyed fingerprint of its value
    /// (HMAC-SHA256 under [`Plan::salt`]), `unset` when it is not set.
    pub vars: BTreeMap<String, String>,
    pub nodes: Vec<NodeSeen>,
}

impl Observed {
    /// What a plan rests on besides its nodes: `inventory_file` is the
    /// inventory as read; `vars` the `${NAME}` values (fingerprinted under
    /// `salt`, never kept).
    pub fn of(
        inv: &Inventory,
        inventory_file: &[u8],
        vars: &PatchVars,
        salt: &str,
        nodes: Vec<NodeSeen>,
    ) -> Observed {
        let mut files: Vec<&Path> = inv
            .patches
            .all
            .iter()
            .chain(&inv.patches.control_plane)
            .chain(&inv.patches.worker)
            .map(|p| p.as_path())
            .collect();
        for n in &inv.nodes {
            files.extend(n.patches.iter().map(|p| p.as_path()));
        }
        files.sort();
        files.dedup();
        let mut patches = Vec::new();
        let mut used = BTreeMap::new();
        for f in files {
            let path = inv.base_dir.join(f);
            let (sha, text) = match crate::input::read_text(&path, crate::input::MAX_TEXT_FILE) {
                Ok(text) => (Sha256::of(text.as_bytes()).hex(), text),
                Err(_) => ("unreadable".to_owned(), String::new()),
            };
            patches.push(FileDigest {
                path: f.display().to_string(),
                sha256: sha,
            });
            let set = vars.referenced_in(&text);
            for name in names_in(&text) {
                let value = set.iter().find(|(n, _)| *n == name).map(|(_, v)| *v);
                used.insert(name, value.map_or("unset".to_owned(), |v| keyed(salt, v)));
            }
        }
        Observed {
            inventory: Sha256::of(inventory_file).hex(),
            patches,
            vars: used,
            nodes,
        }
    }
}

/// The plan file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Plan {
    pub format: u32,
    pub cluster: String,
    pub target: String,
    /// The random salt of the `${NAME}` fingerprints, whose key is this
    /// salt keyed by the cluster's secret ([`fingerprint_key`]): the file
    /// alone does not let anyone test guesses of a value.
    pub salt: String,
    pub observed: Observed,
    /// In the order they run.
    pub actions: Vec<Planned>,
}

/// Why a plan file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not a plan file: {source}")]
    Parse {
        path: String,
        source: serde_json::Error,
    },
    /// `found`: the file's `format` value as JSON (bounded), or `missing`.
    #[error("{path} is plan format {found}; this imgbuild reads format {FORMAT}")]
    Format { path: String, found: String },
    /// A field no plan of this format has (`field`: its JSON path): a
    /// file edited, or written by another imgbuild, is not carried out.
    #[error("{path} is not a plan this imgbuild wrote: unknown field {field}")]
    Unknown { path: String, field: String },
    /// The salt is not the 64 hex digits [`Plan::new_salt`] makes: a
    /// weaker one would let the file's fingerprints be guessed at.
    #[error("{path}: the plan's salt is not {SALT_HEX} hex digits as imgbuild writes it")]
    Salt { path: String },
}

/// How many hex digits a plan's salt has (32 random bytes).
pub const SALT_HEX: usize = 64;

/// The first place where `file` holds what `written` (the plan as parsed,
/// written again) does not: a field the plan has no room for. `at` is the
/// JSON path so far.
fn unknown_field(
    file: &serde_json::Value,
    written: &serde_json::Value,
    at: &str,
) -> Option<String> {
    use serde_json::Value;
    match (file, written) {
        (Value::Object(f), Value::Object(w)) => f.iter().find_map(|(k, v)| {
            let here = format!("{at}.{}", crate::input::one_line(k, 40));
            match w.get(k) {
                None => Some(here),
                Some(wv) => unknown_field(v, wv, &here),
            }
        }),
        (Value::Array(f), Value::Array(w)) => f
            .iter()
            .zip(w)
            .enumerate()
            .find_map(|(i, (v, wv))| unknown_field(v, wv, &format!("{at}[{i}]"))),
        _ => None,
    }
}

impl Plan {
    /// A new random salt for [`Observed::of`]'s fingerprints.
    pub fn new_salt(inventory_file: &[u8]) -> String {
        let mut salt = [0u8; 32];
        // Without random bytes the salt is the inventory's digest: still
        // keyed, just the same key across plans of one inventory.
        if aws_lc_rs::rand::fill(&mut salt).is_err() {
            salt = *Sha256::of(inventory_file).as_bytes();
        }
        hex::encode(salt)
    }

    /// Reads a plan file, refusing another format.
    pub fn read(path: &Path) -> Result<Plan, PlanError> {
        let shown = path.display().to_string();
        let text = crate::input::read_text(path, 16 << 20).map_err(|source| PlanError::Read {
            path: shown.clone(),
            source,
        })?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|source| PlanError::Parse {
                path: shown.clone(),
                source,
            })?;
        // Exactly the number: `"1"` or 2^32 + 1 is no format 1.
        if v["format"].as_u64() != Some(u64::from(FORMAT)) {
            let found = match &v["format"] {
                serde_json::Value::Null => "missing".to_owned(),
                other => crate::input::one_line(&other.to_string(), 40),
            };
            return Err(PlanError::Format { path: shown, found });
        }
        let plan: Plan = serde_json::from_value(v.clone()).map_err(|source| PlanError::Parse {
            path: shown.clone(),
            source,
        })?;
        // Nothing the plan does not hold: what serde would skip over
        // (an unknown field, here or in an action) refuses the file.
        let written = serde_json::to_value(&plan).map_err(|source| PlanError::Parse {
            path: shown.clone(),
            source,
        })?;
        if let Some(field) = unknown_field(&v, &written, "") {
            return Err(PlanError::Unknown { path: shown, field });
        }
        if plan.salt.len() != SALT_HEX || !plan.salt.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(PlanError::Salt { path: shown });
        }
        Ok(plan)
    }

    /// Every way `now` (a fresh plan under this plan's salt) departs from
    /// this one, first what it rests on, then the actions; empty: this
    /// plan still holds.
    /// Text from the plan file is escaped and bounded, and at most
    /// [`MAX_DIFFERENCES`] are listed (then how many more).
    pub fn differences(&self, now: &Plan) -> Vec<String> {
        let mut out = self.all_differences(now);
        if out.len() > MAX_DIFFERENCES {
            let more = out.len() - MAX_DIFFERENCES;
            out.truncate(MAX_DIFFERENCES);
            out.push(format!("and {more} more"));
        }
        out
    }

    fn all_differences(&self, now: &Plan) -> Vec<String> {
        let e = |s: &str| crate::input::one_line(s, 64);
        let mut out = Vec::new();
        let (was, is) = (&self.observed, &now.observed);
        if self.cluster != now.cluster || self.target != now.target {
            out.push(format!(
                "the plan is for cluster {} on {}, the inventory names {} on {}",
                e(&self.cluster),
                e(&self.target),
                e(&now.cluster),
                e(&now.target)
            ));
        }
        if was.inventory != is.inventory {
            out.push("the inventory was edited since the plan".to_owned());
        }
        for p in &was.patches {
            match is.patches.iter().find(|q| q.path == p.path) {
                Some(q) if q.sha256 == p.sha256 => {}
                Some(_) => out.push(format!("patch {} changed since the plan", e(&p.path))),
                None => out.push(format!("patch {} is no longer used", e(&p.path))),
            }
        }
        for q in is
            .patches
            .iter()
            .filter(|q| !was.patches.iter().any(|p| p.path == q.path))
        {
            out.push(format!("patch {} is new since the plan", e(&q.path)));
        }
        let names: std::collections::BTreeSet<&String> =
            was.vars.keys().chain(is.vars.keys()).collect();
        for name in names {
            if was.vars.get(name) != is.vars.get(name) {
                out.push(format!("${{{}}} changed since the plan", e(name)));
            }
        }
        for n in &was.nodes {
            let Some(m) = is.nodes.iter().find(|m| m.node == n.node) else {
                out.push(format!(
                    "node {} is not in the inventory any more",
                    e(&n.node)
                ));
                continue;
            };
            let node = e(&n.node);
            let shown = |v: &Option<String>| v.as_deref().map_or_else(|| "unknown".into(), e);
            if n.talos_version != m.talos_version {
                out.push(format!(
                    "node {node} runs Talos {} now, the plan saw {}",
                    shown(&m.talos_version),
                    shown(&n.talos_version)
                ));
            } else if n.talos != m.talos {
                out.push(format!(
                    "node {node}'s Talos API changed state since the plan"
                ));
            }
            if n.machine != m.machine {
                out.push(format!("node {node}'s machine changed since the plan"));
            }
            if n.volume != m.volume {
                out.push(format!("node {node}'s boot volume changed since the plan"));
            }
        }
        for a in &self.actions {
            if let Kind::Prune { .. } = &a.kind
                && !now.actions.contains(a)
            {
                // Not deleted now: a VM uses it, or it is gone.
                out.push(format!(
                    "{} is no longer what a plan does now: a VM uses it, or it is gone",
                    a.label()
                ));
                continue;
            }
            if !now.actions.contains(a) {
                out.push(format!(
                    "{} is no longer what a plan does now: {}",
                    a.label(),
                    now.actions
                        .iter()
                        .find(|b| b.node == a.node && b.kind.name() == a.kind.name())
                        .map_or("not planned".to_owned(), |b| {
                            e(&serde_json::to_string(&b.kind).unwrap_or_default())
                        })
                ));
            }
        }
        for b in &now.actions {
            if !self.actions.contains(b) {
                out.push(format!(
                    "{} is planned now and not in the plan file",
                    b.label()
                ));
            }
        }
        if out.is_empty() && self.actions != now.actions {
            out.push("the plan's actions run in another order now".to_owned());
        }
        out
    }
}

/// The `${NAME}`s `text` uses, each once.
fn names_in(text: &str) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for (at, _) in text.match_indices("${") {
        let rest = &text[at + 2..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() && rest[name.len()..].starts_with('}') && !names.contains(&name) {
            names.push(name);
        }
    }
    names
}

/// The key of a plan's `${NAME}` fingerprints: the plan's salt keyed by
/// the cluster's secret, so the plan file (a CI artifact) alone cannot
/// test guesses of a value; the salt alone where the cluster has no
/// secrets yet.
pub fn fingerprint_key(salt: &str, secret: Option<&str>) -> String {
    match secret {
        Some(secret) => keyed(secret, &format!("imgbuild plan fingerprints {salt}")),
        None => salt.to_owned(),
    }
}

/// The keyed fingerprint of a value: HMAC-SHA256 under `salt`.
fn keyed(salt: &str, value: &str) -> String {
    let key = aws_lc_rs::hmac::Key::new(aws_lc_rs::hmac::HMAC_SHA256, salt.as_bytes());
    hex::encode(aws_lc_rs::hmac::sign(&key, value.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn planned(node: &str, kind: Kind) -> Planned {
        Planned {
            step: kind.step(),
            node: Some(node.into()),
            kind,
            destructive: false,
        }
    }

    fn plan(actions: Vec<Planned>) -> Plan {
        Plan {
            format: FORMAT,
            cluster: "c".into(),
            target: "proxmox".into(),
            salt: "s".into(),
            observed: Observed {
                inventory: "i".into(),
                patches: vec![],
                vars: BTreeMap::new(),
                nodes: vec![],
            },
            actions,
        }
    }

    #[test]
    fn a_plan_holds_when_nothing_moved_and_names_what_did() {
        let up = |from: &str| Kind::UpgradeTalos {
            version: FromTo {
                from: Some(from.into()),
                to: "v1.11.5".into(),
            },
            schematic: None,
        };
        let saved = plan(vec![planned("w1", up("v1.11.2"))]);
        assert!(saved.differences(&saved.clone()).is_empty());
        let now = plan(vec![planned("w1", up("v1.11.3"))]);
        let d = saved.differences(&now);
        assert_eq!(d.len(), 2, "{d:?}");
        assert!(d[0].starts_with("upgradeTalos w1 is no longer"), "{d:?}");
        assert!(d[0].contains("v1.11.3"), "{d:?}");
        let mut edited = saved.clone();
        edited.observed.inventory = "j".into();
        assert_eq!(
            saved.differences(&edited),
            vec!["the inventory was edited since the plan".to_owned()]
        );
        let mut reordered = plan(vec![
            planned("a", Kind::BootstrapEtcd),
            planned("b", Kind::ApplyFirstConfig),
        ]);
        let other = reordered.clone();
        reordered.actions.reverse();
        assert_eq!(
            other.differences(&reordered),
            vec!["the plan's actions run in another order now".to_owned()]
        );
    }

    /// A prune the saved plan holds and a fresh one does not (a VM uses
    /// the volume now) is named by the volume, not by another prune.
    #[test]
    fn a_prune_no_longer_planned_names_its_volume() {
        let prune = |item: &str| Planned {
            step: Step::Prune,
            node: None,
            kind: Kind::Prune { item: item.into() },
            destructive: true,
        };
        let saved = plan(vec![
            prune("volume local:import/a.raw on pve"),
            prune("volume local:import/b.raw on pve"),
        ]);
        let now = plan(vec![prune("volume local:import/b.raw on pve")]);
        assert_eq!(
            saved.differences(&now),
            vec!["prune of volume local:import/a.raw on pve is no longer what a plan does now: a VM uses it, or it is gone".to_owned()]
        );
    }

    /// A crafted plan file cannot forge a line of output or flood it.
    #[test]
    fn a_crafted_plans_differences_are_escaped_and_bounded() {
        let mut crafted = plan(vec![]);
        crafted.cluster = format!("x\nerror: forged line{}", "y".repeat(10_000));
        crafted.observed.nodes = (0..100)
            .map(|i| NodeSeen {
                node: format!("ghost-{i}\n"),
                talos: None,
                talos_version: None,
                machine: None,
                volume: None,
            })
            .collect();
        let d = crafted.differences(&plan(vec![]));
        assert_eq!(d.len(), MAX_DIFFERENCES + 1, "{d:?}");
        assert_eq!(d.last().unwrap(), "and 81 more");
        assert!(
            d.iter().all(|l| !l.contains('\n') && l.len() < 400),
            "{d:?}"
        );
        assert!(d[0].contains("x\\nerror: forged"), "{}", d[0]);
    }

    #[test]
    fn known_after_apply_reads_as_terraform_says_it() {
        let k: Known<Machine> = Known::of(None);
        assert_eq!(k.to_string(), "(known after apply)");
        assert_eq!(Known::of(Some(Machine::Vm(303))).to_string(), "VM 303");
        let json = serde_json::to_value(Kind::CreateMachine { machine: k }).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"kind": "createMachine", "machine": "knownAfterApply"})
        );
    }

    #[test]
    fn fingerprints_are_keyed_and_hold_no_value() {
        assert_ne!(
            fingerprint_key("salt1", Some("cluster secret")),
            fingerprint_key("salt1", None)
        );
        assert!(!fingerprint_key("salt1", Some("cluster secret")).contains("cluster secret"));
        let a = keyed("salt1", "hunter2");
        assert_ne!(a, keyed("salt2", "hunter2"));
        assert_eq!(a, keyed("salt1", "hunter2"));
        assert!(!a.contains("hunter2"));
    }
}
