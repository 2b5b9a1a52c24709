//! `imgbuild apply`: brings running nodes' machine configs to the rendered
//! ones. The node itself says what would change: `ApplyConfiguration` with
//! `dry_run` answers "Dry run summary: … Config diff: … / No changes." in
//! its mode details (siderolabs/talos
//! `internal/app/machined/internal/server/v1alpha1/v1alpha1_server.go`
//! `ApplyConfiguration`, `generateDiff`).
//!
//! Per version (siderolabs/talos `v1alpha1_server.go` ApplyConfiguration): on v1.9–v1.13 a change `CanApplyImmediate`
//! refuses turns AUTO into REBOOT, and a NO_REBOOT or TRY dry run of it
//! fails before any diff; so the comparison is an AUTO dry run, whose
//! summary says "with a reboot" for such a change. Those nodes are applied
//! one at a time, each waited for until its new boot runs the new config
//! and the cluster is healthy. On v1.14 AUTO is NO_REBOOT and REBOOT is
//! refused: nothing reboots and REBOOT is never sent (by any version here).

use futures_util::StreamExt;

use super::bootstrap::{Options, Plan, PlannedNode};
use super::client::{ApiError, ApplyMode, Mode, NodeClient};
use super::config::Fingerprints;
use super::health::{HealthError, wait_healthy};
use super::status::{ConfigState, config_state, diff_of, staged};
use super::upgrade::{READ_CONCURRENCY, RebootError, ordered, wait_rebooted};
use crate::inventory::Role;

/// Why one node could not be compared or applied. Its Display is the
/// line the report shows for the node.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// A Talos API call (connect, apply, version) failed.
    #[error(transparent)]
    Api(#[from] ApiError),
    #[error(transparent)]
    Health(#[from] HealthError),
    #[error(transparent)]
    Reboot(#[from] RebootError),
    #[error(
        "it runs with Secure Boot {}, its rendered config names a Secure Boot {} installer; applying it cannot move the node between Secure Boot and not (siderolabs/talos#9245): set secureBoot on the node to match what it runs",
        on_off(*running),
        on_off(*wanted)
    )]
    SecureBootSwitch { running: bool, wanted: bool },
    #[error("reading the persisted config: {0}")]
    Staged(#[source] ApiError),
    #[error("reading the boot ID (needed to see the reboot): {0}")]
    BootId(#[source] ApiError),
    #[error("came back without the new config")]
    NotApplied,
    #[error("comparing the config after the reboot: {0}")]
    Recompare(#[source] ApiError),
}

impl ApplyError {
    /// The node is busy with another apply (one at a time per node):
    /// worth one more try.
    fn in_progress(&self) -> bool {
        matches!(self, ApplyError::Api(ApiError::Status { message, .. })
            if message.contains("already in progress"))
    }
}

fn on_off(b: bool) -> &'static str {
    if b { "on" } else { "off" }
}

/// One node's result.
#[derive(Debug, Clone, serde::Serialize)]
pub struct NodeApply {
    pub node: String,
    /// Whether the node's config differs from the rendered one.
    pub changed: bool,
    /// The node's config diff (empty when unchanged).
    pub diff: String,
    /// The change takes a reboot (Talos v1.9–v1.13, `CanApplyImmediate`).
    pub needs_reboot: bool,
    /// What the reboot-needing change touches (`machine.files`, …).
    pub fields: Vec<String>,
    /// The node persisted the rendered config for its next boot (a STAGED
    /// apply): staged, applies at the next reboot. `--mode staged` leaves it.
    pub staged: bool,
    /// Whether this run applied the rendered config.
    pub applied: bool,
    /// Whether this run rebooted the node for it.
    pub rebooted: bool,
}

/// A node that could not be compared or applied.
#[derive(Debug, Clone, serde::Serialize)]
pub struct NodeFailure {
    pub node: String,
    pub error: String,
}

/// What a run found and did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ApplyOutcome {
    pub nodes: Vec<NodeApply>,
    pub failed: Vec<NodeFailure>,
    /// Why nothing was applied (`--mode no-reboot` and a change needing a reboot).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
}

/// Whether a dry run's summary says the node would reboot for it.
pub fn summary_reboots(mode_details: &str) -> bool {
    mode_details
        .split_once("Config diff:")
        .map_or(mode_details, |(s, _)| s)
        .contains("with a reboot")
}

/// The fields a diff changes, two levels deep (`machine.files`): each
/// changed key whose enclosing keys did not change too, under the context
/// the diff carries, else found in the rendered config's `machine` or
/// `cluster` section.
pub fn changed_fields(diff: &str, rendered: &[u8]) -> Vec<String> {
    let text = String::from_utf8_lossy(rendered);
    let docs: Vec<serde_yaml_ng::Value> = serde_yaml_ng::Deserializer::from_str(&text)
        .filter_map(|d| serde::Deserialize::deserialize(d).ok())
        .collect();
    let section_of = |key: &str| {
        ["machine", "cluster"].into_iter().find(|s| {
            docs.iter()
                .any(|d| d[*s].as_mapping().is_some_and(|m| m.contains_key(key)))
        })
    };
    // (indent, key, changed) of the lines enclosing the current one.
    let mut stack: Vec<(usize, String, bool)> = Vec::new();
    let mut out: Vec<String> = Vec::new();
    for line in diff.lines() {
        if line.starts_with("+++") || line.starts_with("---") || line.starts_with("@@") {
            continue;
        }
        let (changed, body) = match line.chars().next() {
            Some('+' | '-') => (true, &line[1..]),
            Some(' ') => (false, &line[1..]),
            _ => (false, line),
        };
        let mut indent = body.len() - body.trim_start().len();
        let mut rest = body.trim_start();
        while let Some(r) = rest.strip_prefix("- ") {
            indent += 2;
            rest = r.trim_start();
        }
        let Some((key, _)) = rest.split_once(':') else {
            continue;
        };
        if key.is_empty() || key.contains(' ') {
            continue;
        }
        while stack.last().is_some_and(|(i, _, _)| *i >= indent) {
            stack.pop();
        }
        let inside_change = stack.iter().any(|(_, _, c)| *c);
        stack.push((indent, key.to_owned(), changed));
        if !changed || inside_change {
            continue;
        }
        let mut path: Vec<&str> = stack.iter().map(|(_, k, _)| k.as_str()).collect();
        if path.len() == 1
            && let Some(section) = section_of(key)
        {
            path.insert(0, section);
        }
        path.truncate(2);
        let path = crate::input::excerpt(&path.join("."), 80);
        if !out.contains(&path) {
            out.push(path);
        }
    }
    out
}

/// `node`'s API over mTLS as the cluster's admin.
async fn connect(plan: &Plan, node: &PlannedNode, opts: &Options) -> Result<NodeClient, ApiError> {
    NodeClient::connect(
        &node.endpoint,
        &Mode::Mtls(plan.identity.clone()),
        opts.call_timeout,
    )
    .await
}

/// What a node would do with the rendered config.
#[derive(Debug, Clone)]
pub struct Compared {
    pub diff: String,
    pub needs_reboot: bool,
    /// The node's next boot runs the rendered config already.
    pub staged: bool,
}

/// Asks `node` for the diff between its config and the rendered one: an
/// AUTO dry run (STAGED for `--mode staged`), which answers even for a
/// change that needs a reboot.
pub async fn compare(
    plan: &Plan,
    node: &PlannedNode,
    mode: ApplyMode,
    opts: &Options,
) -> Result<Compared, ApplyError> {
    let conn = connect(plan, node, opts).await?;
    refuse_secure_boot_switch(&conn, node).await?;
    let ask = if mode == ApplyMode::Staged {
        ApplyMode::Staged
    } else {
        ApplyMode::Auto
    };
    let details = conn.apply_mode(node.config.clone(), ask, true).await?;
    let diff = diff_of(&details);
    let staged = if diff.is_empty() {
        false
    } else {
        let version = conn.version().await?.tag;
        staged(&conn, node, &version, &Fingerprints::default())
            .await
            .map_err(ApplyError::Staged)?
    };
    Ok(Compared {
        diff,
        needs_reboot: ask == ApplyMode::Auto && summary_reboots(&details),
        staged,
    })
}

/// A config whose installer would move the node between Secure Boot and
/// not is refused, as `upgrade` refuses it: the next install would keep
/// the disk's boot layout (siderolabs/talos#9245). Unknown is no reason.
async fn refuse_secure_boot_switch(
    conn: &NodeClient,
    node: &PlannedNode,
) -> Result<(), ApplyError> {
    let Ok(Some(state)) = conn.security_state().await else {
        return Ok(());
    };
    let wanted = String::from_utf8_lossy(&node.config).contains("installer-secureboot/");
    if state.secure_boot == wanted {
        return Ok(());
    }
    Err(ApplyError::SecureBootSwitch {
        running: state.secure_boot,
        wanted,
    })
}

/// Applies without a reboot; control planes with the health gate around.
async fn apply_live(
    plan: &Plan,
    node: &PlannedNode,
    mode: ApplyMode,
    opts: &Options,
) -> Result<(), ApplyError> {
    if node.role == Role::Controlplane {
        wait_healthy(plan, node, opts).await?;
    }
    let conn = connect(plan, node, opts).await?;
    conn.apply_mode(node.config.clone(), mode, false).await?;
    if node.role == Role::Controlplane {
        wait_healthy(plan, node, opts).await?;
    }
    Ok(())
}

/// Applies a change that takes a reboot (AUTO; the node persists the
/// config and reboots itself), then waits for its new boot to run the new
/// config and for the cluster to be healthy.
async fn apply_rebooting(
    plan: &Plan,
    node: &PlannedNode,
    reboot_timeout: std::time::Duration,
    opts: &Options,
) -> Result<(), ApplyError> {
    wait_healthy(plan, node, opts).await?;
    let conn = connect(plan, node, opts).await?;
    let version = conn.version().await?.tag;
    let boot = conn.boot_id().await.map_err(ApplyError::BootId)?;
    conn.apply_mode(node.config.clone(), ApplyMode::Auto, false)
        .await?;
    drop(conn);
    wait_rebooted(plan, node, Some(&boot), &version, reboot_timeout, opts).await?;
    let conn = connect(plan, node, opts).await?;
    match config_state(&conn, node).await {
        Ok(ConfigState::InSync) => {}
        Ok(_) => return Err(ApplyError::NotApplied),
        Err(e) => return Err(ApplyError::Recompare(e)),
    }
    Ok(wait_healthy(plan, node, opts).await?)
}

/// Compares every selected node (all when `select` is empty, all at once);
/// unless `dry_run`, applies to those whose diff is not empty: those that
/// apply live first (control planes one at a time with the health gate),
/// then those that take a reboot, one at a time. `NoReboot` refuses up
/// front when any change takes a reboot. Stops applying at the first failure.
pub async fn run(
    plan: &Plan,
    select: &[String],
    mode: ApplyMode,
    dry_run: bool,
    reboot_timeout: std::time::Duration,
    opts: &Options,
) -> ApplyOutcome {
    let mut outcome = ApplyOutcome::default();
    let order = ordered(plan, select);
    let compared: Vec<Result<Compared, ApplyError>> =
        futures_util::stream::iter(order.iter().map(|n| compare(plan, n, mode, opts)))
            .buffered(READ_CONCURRENCY)
            .collect()
            .await;
    let mut todo = Vec::new();
    for (node, c) in order.iter().zip(compared) {
        match c {
            Ok(c) => {
                let fields = if c.needs_reboot {
                    changed_fields(&c.diff, &node.config)
                } else {
                    Vec::new()
                };
                outcome.nodes.push(NodeApply {
                    node: node.name.clone(),
                    changed: !c.diff.is_empty(),
                    diff: c.diff,
                    needs_reboot: c.needs_reboot,
                    fields,
                    staged: c.staged,
                    applied: false,
                    rebooted: false,
                });
                todo.push((*node, outcome.nodes.len() - 1));
            }
            Err(error) => outcome.failed.push(NodeFailure {
                node: node.name.clone(),
                error: error.to_string(),
            }),
        }
    }
    if mode == ApplyMode::NoReboot {
        let rebooting: Vec<String> = outcome
            .nodes
            .iter()
            .filter(|n| n.changed && n.needs_reboot)
            .map(|n| format!("{} ({})", n.node, n.fields.join(", ")))
            .collect();
        if !rebooting.is_empty() {
            outcome.refused = Some(format!(
                "--mode no-reboot: these changes need a reboot on the version the node runs: {}",
                rebooting.join("; ")
            ));
            return outcome;
        }
    }
    if dry_run {
        return outcome;
    }
    // Live changes first, then the rebooting ones, one at a time.
    todo.sort_by_key(|(_, i)| outcome.nodes[*i].needs_reboot);
    for (node, i) in todo {
        let staged_already = mode == ApplyMode::Staged && outcome.nodes[i].staged;
        if !outcome.nodes[i].changed || staged_already || !outcome.failed.is_empty() {
            continue;
        }
        let reboot = outcome.nodes[i].needs_reboot;
        let mut result = if reboot {
            apply_rebooting(plan, node, reboot_timeout, opts).await
        } else {
            apply_live(plan, node, mode, opts).await
        };
        // Another apply in progress (one at a time per node): once more.
        if let Err(e) = &result
            && e.in_progress()
        {
            tokio::time::sleep(opts.poll).await;
            result = if reboot {
                apply_rebooting(plan, node, reboot_timeout, opts).await
            } else {
                apply_live(plan, node, mode, opts).await
            };
        }
        match result {
            Ok(()) => {
                outcome.nodes[i].applied = true;
                outcome.nodes[i].rebooted = reboot;
            }
            Err(error) => outcome.failed.push(NodeFailure {
                node: node.name.clone(),
                error: crate::input::excerpt(&error.to_string(), 500),
            }),
        }
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_diff_is_what_follows_config_diff() {
        let none = "Dry run summary:\nApplied configuration without a reboot (skipped in dry-run).\nConfig diff:\n\nNo changes.";
        assert_eq!(diff_of(none), "");
        assert!(!summary_reboots(none));
        let some = "Dry run summary:\nApplied configuration with a reboot (skipped in dry-run).\nConfig diff:\n\n-  a: 1\n+  a: 2\n";
        assert_eq!(diff_of(some), "-  a: 1\n+  a: 2");
        assert!(summary_reboots(some));
    }

    #[test]
    fn the_fields_come_from_the_diffs_context() {
        let diff = "--- a\n+++ b\n@@ -1,5 +1,9 @@\n machine:\n     type: worker\n+    files:\n+        - content: x\n+          path: /var/etc/x\n     kubelet:\n-        image: a\n+        image: b\n";
        assert_eq!(
            changed_fields(diff, b""),
            ["machine.files", "machine.kubelet"]
        );
        // Without context: the rendered config says where a key lives.
        let bare = "+  files:\n+  - path: /var/etc/motd\n+    op: create\n";
        let rendered = b"version: v1alpha1\nmachine:\n  files: []\ncluster: {}\n";
        assert_eq!(changed_fields(bare, rendered), ["machine.files"]);
    }
}
