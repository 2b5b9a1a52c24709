//! What `upgrade` will do, decided before any node is touched, from what
//! the nodes run, what the inventory wants and what the factory offers:
//! each node's hops, the API each hop goes through, and why the whole run
//! is refused (a 2-member etcd without `--force`). Pure: `--dry-run`
//! prints it, the run executes it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use std::path::Path;

use crate::inventory::parse_version;
use crate::talos::client::RebootMode;

/// What a node should run after the upgrade.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Wanted {
    /// `v1.11.5`.
    pub version: String,
    /// The installer image (factory host + `<platform>-installer/<base ID>:<version>`).
    pub installer: String,
    /// The base schematic ID (without META) the installer installs.
    pub schematic: String,
    /// The node's own schematic (with META): a factory-route node reports
    /// it until its first upgrade on the base installer, and runs what the
    /// inventory asks for all the same.
    pub own_schematic: String,
    /// The inventory boots the node with Secure Boot (its installer is
    /// `…-installer-secureboot`).
    pub secure_boot: bool,
}

/// What a node runs now.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Running {
    pub version: Option<String>,
    pub schematic: Option<String>,
    /// Why the node could not tell (unreachable, call failed).
    pub error: Option<String>,
    /// The installer its active machine config names
    /// (`machine.install.image`); None when it could not be read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub install_image: Option<String>,
    /// Its SecurityState; None when it could not tell.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub security: Option<crate::talos::client::SecurityState>,
}

impl Running {
    /// Whether the node runs `wanted` already.
    pub fn is(&self, wanted: &Wanted) -> bool {
        self.version.as_deref() == Some(wanted.version.as_str()) && self.schematic_is(wanted)
    }

    /// Whether the node runs the wanted schematic (the base one, or its
    /// own with META, as a factory-route node does before any upgrade).
    pub fn schematic_is(&self, wanted: &Wanted) -> bool {
        self.schematic
            .as_deref()
            .is_some_and(|s| s == wanted.schematic || s == wanted.own_schematic)
    }

    /// Whether its config is known to name another installer than the
    /// wanted one: a run stopped between a node's reboot and the config
    /// applied after it leaves the old reference behind.
    pub fn config_names_another_installer(&self, wanted: &Wanted) -> bool {
        self.install_image
            .as_deref()
            .is_some_and(|i| i != wanted.installer)
    }
}

/// `machine.install.image` of a machine config (the v1alpha1 document of
/// a multi-document config); None when it names none.
pub fn install_image_of(config: &str) -> Option<String> {
    serde_yaml_ng::Deserializer::from_str(config)
        .filter_map(|d| serde_yaml_ng::Value::deserialize(d).ok())
        .find_map(|doc| {
            doc.get("machine")?
                .get("install")?
                .get("image")?
                .as_str()
                .map(str::to_owned)
        })
}

/// What `upgrade` installed on each node, kept in the state dir
/// (`upgrades.json`, by node): the running schematic for nodes that cannot
/// report theirs (an image without the factory's `schematic` extension).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Record {
    pub nodes: BTreeMap<String, Installed>,
    /// The path (versions, the target last) a node is on while a run moves
    /// it through several minors: a rerun after a stop resumes it.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub paths: BTreeMap<String, Vec<String>>,
    /// Kubernetes nodes a run cordoned before a reboot (Talos v1.13 on) and
    /// has not uncordoned yet: a run stopped there leaves them to the next.
    #[serde(default, skip_serializing_if = "std::collections::BTreeSet::is_empty")]
    pub cordoned: std::collections::BTreeSet<String>,
}

/// The most versions a recorded path may hold: one per Talos minor, and
/// Talos has had fewer than 20.
const MAX_PATH_HOPS: usize = 32;

/// The most cordon entries a record may hold: a run records only the
/// nodes it reboots, one at a time for control planes.
const MAX_CORDONED: usize = 1000;

/// Why the [`Record`] could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{}: {why} (it records where a stopped upgrade left each node; fix it, or remove it to plan from what the nodes report)",
    path.display()
)]
pub struct RecordError {
    pub path: std::path::PathBuf,
    pub why: String,
}

/// One node's entry in the [`Record`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Installed {
    pub version: String,
    pub schematic: String,
    pub installer: String,
}

impl Record {
    /// The record at `path`; an absent one is empty. One that cannot be
    /// read or parsed is an error naming the file, never taken as empty:
    /// it holds the paths of nodes stopped mid-hop and the schematics of
    /// nodes that cannot report theirs, and planning without them could
    /// send a stock node its Upgrade again.
    pub fn load(path: &Path) -> Result<Record, RecordError> {
        let bad = |why: String| RecordError {
            path: path.to_owned(),
            why,
        };
        let text = match crate::input::read_text(path, crate::input::MAX_TEXT_FILE) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Record::default()),
            Err(e) => return Err(bad(e.to_string())),
        };
        // serde may quote what it found: bounded (the writer escapes it).
        let record: Record = serde_json::from_str(&text).map_err(|e| {
            bad(format!(
                "not an upgrade record: {}",
                crate::input::excerpt(&e.to_string(), 200)
            ))
        })?;
        record.check_paths(path)?;
        record.check_cordoned(path)?;
        Ok(record)
    }

    /// The cordon entries are node names, as many as a cluster has nodes
    /// at most: a record of thousands is not one a run wrote.
    fn check_cordoned(&self, file: &Path) -> Result<(), RecordError> {
        if self.cordoned.len() > MAX_CORDONED {
            return Err(RecordError {
                path: file.to_owned(),
                why: format!(
                    "{} cordoned nodes recorded (at most {MAX_CORDONED})",
                    self.cordoned.len()
                ),
            });
        }
        match self.cordoned.iter().find(|n| n.is_empty() || n.len() > 253) {
            Some(n) => Err(RecordError {
                path: file.to_owned(),
                why: format!(
                    "{} among the cordoned nodes is no node name",
                    crate::input::quote(n)
                ),
            }),
            None => Ok(()),
        }
    }

    /// A path as [`path`] makes one: Talos versions, one a minor, the
    /// target last, in ascending order (a hand-edited or damaged record
    /// would otherwise send a node an Upgrade to what it names).
    fn check_paths(&self, file: &Path) -> Result<(), RecordError> {
        let bad = |why: String| RecordError {
            path: file.to_owned(),
            why,
        };
        for (node, path) in &self.paths {
            let node = crate::input::quote(node);
            if path.is_empty() || path.len() > MAX_PATH_HOPS {
                return Err(bad(format!(
                    "node {node}: a path of {} versions (1 to {MAX_PATH_HOPS})",
                    path.len()
                )));
            }
            let mut last = None;
            for v in path {
                let Some(now) = parse_version(v, false) else {
                    return Err(bad(format!(
                        "node {node}: {} in its path is not a Talos version",
                        crate::input::quote(v)
                    )));
                };
                if last.is_some_and(|l| now <= l) {
                    return Err(bad(format!(
                        "node {node}: its path does not ascend at {}",
                        crate::input::quote(v)
                    )));
                }
                last = Some(now);
            }
        }
        Ok(())
    }

    /// Writes the record atomically (0600, beside the secrets).
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        let text = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        crate::atomic::write_if_changed(path, &text, true).map(|_| ())
    }

    /// What is left of the path `node` was on, while it runs a version of
    /// it and the path still ends at `target`.
    pub fn resume(&self, node: &str, host: &str, target: &str) -> Option<Vec<String>> {
        let path = self.paths.get(node)?;
        if path.last().map(String::as_str) != Some(target) {
            return None;
        }
        let at = path.iter().position(|v| v == host)?;
        let rest = path[at + 1..].to_vec();
        (!rest.is_empty()).then_some(rest)
    }

    /// Fills in `running`'s schematic from the record when the node did not
    /// report one and runs the version the record says it installed.
    pub fn fill(&self, node: &str, running: &mut Running) {
        if running.schematic.is_none()
            && let Some(i) = self.nodes.get(node)
            && running.version.as_deref() == Some(i.version.as_str())
        {
            running.schematic = Some(i.schematic.clone());
        }
    }
}

/// A Talos version as `(major, minor, patch)`.
type Version = (u32, u32, u32);

/// The oldest host the installer of Talos `target` accepts
/// (`MinimumHostUpgradeVersion`, siderolabs/talos
/// `cmd/installer/pkg/install/preflight.go`, `pkg/machinery/compatibility/
/// talos19..talos113`): v1.9 and v1.10 refuse hosts older than v1.8.0,
/// v1.11 older than v1.9.0, v1.12 older than v1.10.0, v1.13 older than
/// v1.11.0; later minors keep the two-minor rule. None below v1.9 (not
/// modelled).
pub fn host_floor(target: Version) -> Option<Version> {
    match target {
        (1, 9 | 10, _) => Some((1, 8, 0)),
        (1, m, _) if m >= 11 => Some((1, m - 2, 0)),
        _ => None,
    }
}

/// Whether a node on `host` upgrades through `LifecycleService` (Talos
/// v1.13 on, as talosctl decides by the node's version); below, through
/// the deprecated `MachineService.Upgrade`.
pub fn uses_lifecycle(host: &str) -> bool {
    parse_version(host, false).is_some_and(|v| v >= (1, 13, 0))
}

/// Whether `preserve` still means "keep data" on `host`: below v1.8 only.
/// From v1.12.9, v1.13.4 and v1.14 it also skips the etcd checks (talos
/// commit 89e307e), so it is never sent there.
pub fn sends_preserve(host: &str) -> bool {
    parse_version(host, false).is_some_and(|v| v < (1, 8, 0))
}

/// Which API a hop goes through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Api {
    /// `MachineService.Upgrade` (below v1.13).
    MachineService,
    /// `ImageService.Pull`, `LifecycleService.Upgrade`, then `Reboot` (v1.13+).
    LifecycleService,
}

/// One step of a node's path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Hop {
    pub version: String,
    pub installer: String,
}

/// Why a path cannot be planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error(
        "the node runs {host}, below what the {target} installer accepts ({floor}), and the factory offers no v1.{minor}.x to go through"
    )]
    NoHop {
        host: String,
        target: String,
        floor: String,
        minor: u32,
    },
    #[error("cannot read Talos version {0:?}")]
    Unparsable(String),
}

/// The versions from `host` to `target`: `[target]` when the target's
/// installer accepts the host; else the newest offered patch of every
/// minor in between, then the target (Talos's "Supported Upgrade Paths").
pub fn path(host: &str, target: &str, offered: &[String]) -> Result<Vec<String>, PathError> {
    let h = parse_version(host, false).ok_or_else(|| PathError::Unparsable(host.into()))?;
    let t = parse_version(target, false).ok_or_else(|| PathError::Unparsable(target.into()))?;
    let Some(floor) = host_floor(t).filter(|f| h < *f) else {
        return Ok(vec![target.to_owned()]);
    };
    let mut out = Vec::new();
    for minor in h.1 + 1..t.1 {
        let newest = offered
            .iter()
            .filter_map(|v| parse_version(v, true).map(|p| (p, v)))
            .filter(|(p, v)| p.0 == t.0 && p.1 == minor && !v.contains('-'))
            .max_by_key(|(p, _)| *p)
            .map(|(_, v)| v.clone());
        out.push(newest.ok_or_else(|| PathError::NoHop {
            host: host.into(),
            target: target.into(),
            floor: format!("v{}.{}.{}", floor.0, floor.1, floor.2),
            minor,
        })?);
    }
    out.push(target.to_owned());
    Ok(out)
}

/// What happens to one node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Action {
    /// Runs the target version and schematic.
    Done,
    /// Runs the target version; its schematic cannot be told (no `schematic`
    /// extension, or the read failed): left alone, never upgraded again.
    SchematicUnknown,
    /// Runs the target, but its config still names another installer (a
    /// run stopped after the reboot, before the config apply): the
    /// rendered config is applied, no upgrade.
    Config,
    /// Goes through `hops`.
    Upgrade,
    /// Could not be read or planned: the run stops here.
    Blocked,
}

/// One node's part of the plan.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodePlan {
    pub node: String,
    pub control_plane: bool,
    pub from: Running,
    pub to: Wanted,
    pub action: Action,
    /// In order; the last is the target.
    pub hops: Vec<Hop>,
    /// The API the first hop goes through (by the version the node runs).
    pub api: Option<Api>,
    /// Why the node is [`Action::Blocked`].
    pub problem: Option<String>,
}

/// The whole run, decided up front.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct UpgradePlan {
    pub nodes: Vec<NodePlan>,
    /// `--force`: the etcd checks are skipped.
    pub force: bool,
    pub reboot_mode: RebootMode,
    /// How many etcd members there are (from the nodes, else the inventory's
    /// control planes).
    pub etcd_members: usize,
    /// Said in the plan: what `--force` accepts.
    pub notes: Vec<String>,
    /// Why nothing may be touched (a 2-member etcd without `--force`).
    pub refusal: Option<String>,
}

impl UpgradePlan {
    /// Every installer the run will ask for, first use first: the ones the
    /// factory is asked to build before the first node.
    pub fn installers(&self) -> Vec<&str> {
        let mut out: Vec<&str> = Vec::new();
        for n in self.nodes.iter().filter(|n| n.action == Action::Upgrade) {
            for h in &n.hops {
                if !out.contains(&h.installer.as_str()) {
                    out.push(&h.installer);
                }
            }
        }
        out
    }

    /// Whether any node will be upgraded.
    pub fn has_work(&self) -> bool {
        self.nodes.iter().any(|n| n.action == Action::Upgrade)
    }
}

/// One node as read, in upgrade order.
#[derive(Debug, Clone)]
pub struct Observed {
    pub node: String,
    pub control_plane: bool,
    pub running: Running,
}

/// Decides the plan. `installer_at(node, version)` spells the node's base
/// installer at another version (for hops); a path a stopped run recorded
/// (`record.paths`) is resumed while the node is still on it.
#[allow(clippy::too_many_arguments)]
pub fn decide(
    observed: &[Observed],
    wanted: &BTreeMap<String, Wanted>,
    offered: &[String],
    record: &Record,
    etcd_members: usize,
    force: bool,
    reboot_mode: RebootMode,
    installer_at: &dyn Fn(&str, &str) -> String,
) -> UpgradePlan {
    let mut nodes = Vec::new();
    for o in observed {
        let to = &wanted[&o.node];
        let mut plan = NodePlan {
            node: o.node.clone(),
            control_plane: o.control_plane,
            from: o.running.clone(),
            to: to.clone(),
            action: Action::Done,
            hops: Vec::new(),
            api: None,
            problem: None,
        };
        let on_target = o.running.version.as_deref() == Some(to.version.as_str());
        match o.running.version.as_deref() {
            None => {
                plan.action = Action::Blocked;
                plan.problem = Some(format!(
                    "could not read what it runs: {}",
                    o.running.error.as_deref().unwrap_or("no answer")
                ));
            }
            // Only a resumed run's leftover: a schematic known to differ
            // needs the installer itself, not just the config naming it.
            Some(_)
                if on_target
                    && (o.running.schematic_is(to) || o.running.schematic.is_none())
                    && o.running.config_names_another_installer(to) =>
            {
                plan.action = Action::Config;
            }
            Some(_) if on_target && o.running.schematic_is(to) => {}
            // Unknown is not different: only a schematic known to differ
            // makes a node on the target version go again.
            Some(_) if on_target && o.running.schematic.is_none() => {
                plan.action = Action::SchematicUnknown;
            }
            Some(host) => {
                let versions = record
                    .resume(&o.node, host, &to.version)
                    .map_or_else(|| path(host, &to.version, offered), Ok);
                match versions {
                    Ok(versions) => {
                        plan.action = Action::Upgrade;
                        plan.api = Some(if uses_lifecycle(host) {
                            Api::LifecycleService
                        } else {
                            Api::MachineService
                        });
                        plan.hops = versions
                            .into_iter()
                            .map(|v| Hop {
                                installer: if v == to.version {
                                    to.installer.clone()
                                } else {
                                    installer_at(&o.node, &v)
                                },
                                version: v,
                            })
                            .collect();
                    }
                    Err(e) => {
                        plan.action = Action::Blocked;
                        plan.problem = Some(e.to_string());
                    }
                }
            }
        }
        nodes.push(plan);
    }
    let mut notes: Vec<String> = nodes
        .iter()
        .filter(|n| n.action == Action::SchematicUnknown)
        .map(|n| {
            format!(
                "{}: runs {} but cannot report its schematic (no `schematic` extension) and the upgrade record (upgrades.json) has none for it: taken as the target's, not upgraded again; only the record of the run that installed it can tell",
                crate::input::excerpt(&n.node, 64),
                n.to.version
            )
        })
        .collect();
    let mut refusal = None;
    let cps_to_upgrade: Vec<&str> = nodes
        .iter()
        .filter(|n| n.control_plane && n.action == Action::Upgrade)
        .map(|n| n.node.as_str())
        .collect();
    if etcd_members == 2 && !cps_to_upgrade.is_empty() {
        let why = format!(
            "etcd has 2 members: while {} reboots, the other alone cannot keep quorum (Talos refuses: \"insufficient to maintain quorum\")",
            cps_to_upgrade.join(", ")
        );
        if force {
            notes.push(format!("--force: {why}; upgrading anyway"));
        } else {
            refusal = Some(format!(
                "{why}; add a third control plane, or pass --force to upgrade anyway"
            ));
        }
    }
    UpgradePlan {
        nodes,
        force,
        reboot_mode,
        etcd_members,
        notes,
        refusal,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offered() -> Vec<String> {
        [
            "v1.9.0",
            "v1.9.5",
            "v1.10.0",
            "v1.10.7",
            "v1.10.8-beta.0",
            "v1.11.2",
            "v1.11.5",
            "v1.12.0",
            "v1.12.4",
        ]
        .map(String::from)
        .to_vec()
    }

    #[test]
    fn floors_follow_the_installers_preflight() {
        assert_eq!(host_floor((1, 11, 5)), Some((1, 9, 0)));
        assert_eq!(host_floor((1, 12, 0)), Some((1, 10, 0)));
        assert_eq!(host_floor((1, 13, 5)), Some((1, 11, 0)));
        assert_eq!(host_floor((1, 10, 3)), Some((1, 8, 0)));
        assert_eq!(host_floor((1, 8, 3)), None);
    }

    #[test]
    fn a_host_below_the_floor_goes_through_the_newest_patch_of_each_minor() {
        assert_eq!(
            path("v1.9.5", "v1.12.4", &offered()).unwrap(),
            ["v1.10.7", "v1.11.5", "v1.12.4"]
        );
        assert_eq!(path("v1.10.7", "v1.12.4", &offered()).unwrap(), ["v1.12.4"]);
        assert_eq!(path("v1.11.2", "v1.11.5", &offered()).unwrap(), ["v1.11.5"]);
        let only_target = ["v1.12.4".to_owned()];
        let e = path("v1.9.5", "v1.12.4", &only_target).unwrap_err();
        assert!(e.to_string().contains("v1.10.x"), "{e}");
    }

    #[test]
    fn lifecycle_from_v1_13_and_preserve_below_v1_8() {
        assert!(!uses_lifecycle("v1.12.9"));
        assert!(uses_lifecycle("v1.13.0"));
        assert!(uses_lifecycle("v1.14.1"));
        assert!(sends_preserve("v1.7.6"));
        assert!(!sends_preserve("v1.8.0"));
        assert!(!sends_preserve("v1.12.9"));
    }

    fn wanted() -> BTreeMap<String, Wanted> {
        ["cp-01", "cp-02", "w-01"]
            .iter()
            .map(|n| {
                (
                    n.to_string(),
                    Wanted {
                        version: "v1.12.4".into(),
                        installer: "f/metal-installer/b:v1.12.4".into(),
                        schematic: "b".into(),
                        own_schematic: "o".into(),
                        secure_boot: false,
                    },
                )
            })
            .collect()
    }

    fn seen(node: &str, cp: bool, v: Option<&str>, s: Option<&str>) -> Observed {
        Observed {
            node: node.into(),
            control_plane: cp,
            running: Running {
                version: v.map(String::from),
                schematic: s.map(String::from),
                ..Running::default()
            },
        }
    }

    fn decide_with(observed: &[Observed], members: usize, force: bool) -> UpgradePlan {
        decide(
            observed,
            &wanted(),
            &offered(),
            &Record::default(),
            members,
            force,
            RebootMode::Default,
            &|_, v| format!("f/metal-installer/b:{v}"),
        )
    }

    #[test]
    fn unknown_is_not_different() {
        let plan = decide_with(
            &[
                seen("cp-01", true, Some("v1.12.4"), None),
                seen("cp-02", true, Some("v1.12.4"), Some("x")),
                seen("w-01", false, Some("v1.12.4"), Some("b")),
            ],
            3,
            false,
        );
        let actions: Vec<&Action> = plan.nodes.iter().map(|n| &n.action).collect();
        assert_eq!(
            actions,
            [&Action::SchematicUnknown, &Action::Upgrade, &Action::Done]
        );
        assert_eq!(plan.installers(), ["f/metal-installer/b:v1.12.4"]);
    }

    #[test]
    fn a_lost_record_plans_from_what_the_nodes_report_and_says_where_it_was_needed() {
        // A fresh runner: no record. A node mid-path (v1.10.7 of v1.9.5 →
        // v1.12.4) goes on from the version it runs, never back through a
        // hop it took; a node on the target is done; one that cannot tell
        // its schematic is left alone, and the plan says why.
        let plan = decide_with(
            &[
                seen("cp-01", true, Some("v1.10.7"), Some("b")),
                seen("cp-02", true, Some("v1.12.4"), Some("b")),
                seen("w-01", false, Some("v1.12.4"), None),
            ],
            3,
            false,
        );
        let hops: Vec<&str> = plan.nodes[0]
            .hops
            .iter()
            .map(|h| h.version.as_str())
            .collect();
        assert_eq!(hops, ["v1.12.4"]);
        assert_eq!(plan.nodes[1].action, Action::Done);
        assert_eq!(plan.nodes[2].action, Action::SchematicUnknown);
        assert_eq!(plan.notes.len(), 1, "{:?}", plan.notes);
        assert!(
            plan.notes[0].starts_with("w-01: runs v1.12.4 but cannot report its schematic"),
            "{:?}",
            plan.notes
        );
        assert!(plan.notes[0].contains("upgrades.json"), "{:?}", plan.notes);
    }

    #[test]
    fn a_node_on_the_target_with_another_schematic_is_upgraded_not_just_reconfigured() {
        let mut other = seen("cp-01", true, Some("v1.12.4"), Some("x"));
        other.running.install_image = Some("f/metal-installer/x:v1.12.4".into());
        let plan = decide_with(&[other], 3, false);
        assert_eq!(plan.nodes[0].action, Action::Upgrade);
    }

    #[test]
    fn a_node_on_the_target_whose_config_names_the_old_installer_gets_the_config() {
        let mut stale = seen("cp-01", true, Some("v1.12.4"), Some("b"));
        stale.running.install_image = Some("f/metal-installer/b:v1.11.5".into());
        let mut fresh = seen("cp-02", true, Some("v1.12.4"), Some("b"));
        fresh.running.install_image = Some("f/metal-installer/b:v1.12.4".into());
        let plan = decide_with(&[stale, fresh], 3, false);
        let actions: Vec<&Action> = plan.nodes.iter().map(|n| &n.action).collect();
        assert_eq!(actions, [&Action::Config, &Action::Done]);
        assert!(plan.nodes[0].hops.is_empty());
        assert!(plan.installers().is_empty(), "nothing to pull");
    }

    #[test]
    fn the_install_image_is_read_from_the_v1alpha1_document() {
        let config = "version: v1alpha1\nmachine:\n  type: worker\n  install:\n    disk: /dev/sda\n    image: f/metal-installer/b:v1.12.4\n---\napiVersion: v1alpha1\nkind: HostnameConfig\n";
        assert_eq!(
            install_image_of(config).as_deref(),
            Some("f/metal-installer/b:v1.12.4")
        );
        assert_eq!(install_image_of("version: v1alpha1\nmachine: {}\n"), None);
    }

    #[test]
    fn two_etcd_members_refuse_unless_forced_and_the_plan_says_so() {
        let observed = [
            seen("cp-01", true, Some("v1.11.5"), Some("b")),
            seen("cp-02", true, Some("v1.11.5"), Some("b")),
        ];
        let plan = decide_with(&observed, 2, false);
        assert!(plan.refusal.as_deref().unwrap().contains("2 members"));
        let plan = decide_with(&observed, 2, true);
        assert_eq!(plan.refusal, None);
        assert!(plan.notes[0].contains("--force"));
        assert_eq!(decide_with(&observed, 3, false).refusal, None);
    }

    #[test]
    fn hops_name_their_installers_and_the_first_api() {
        let plan = decide_with(&[seen("w-01", false, Some("v1.9.5"), Some("b"))], 3, false);
        let n = &plan.nodes[0];
        assert_eq!(n.api, Some(Api::MachineService));
        assert_eq!(
            n.hops
                .iter()
                .map(|h| h.installer.as_str())
                .collect::<Vec<_>>(),
            [
                "f/metal-installer/b:v1.10.7",
                "f/metal-installer/b:v1.11.5",
                "f/metal-installer/b:v1.12.4"
            ]
        );
    }
}
