//! `imgbuild apply`: brings running nodes' machine configs to the rendered
//! ones. The node itself says what would change: `ApplyConfiguration` with
//! `dry_run` answers "Dry run summary: … Config diff: … / No changes." in
//! its mode details (siderolabs/talos
//! `internal/app/machined/internal/server/v1alpha1/v1alpha1_server.go`
//! `ApplyConfiguration`, `generateDiff`).

use super::bootstrap::{Options, Plan, PlannedNode};
use super::client::{ApplyMode, Mode, NodeClient};
use super::upgrade::{ordered, wait_healthy};
use crate::inventory::Role;

/// One node's result.
#[derive(Debug, Clone, serde::Serialize)]
pub struct NodeApply {
    pub node: String,
    /// Whether the node's config differs from the rendered one.
    pub changed: bool,
    /// The node's config diff (empty when unchanged).
    pub diff: String,
    /// Whether this run applied the rendered config.
    pub applied: bool,
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

/// `node`'s API over mTLS as the cluster's admin.
async fn connect(plan: &Plan, node: &PlannedNode, opts: &Options) -> Result<NodeClient, String> {
    NodeClient::connect(
        &node.endpoint,
        &Mode::Mtls(plan.identity.clone()),
        opts.call_timeout,
    )
    .await
    .map_err(|e| e.to_string())
}

/// Asks `node` for the diff between its config and the rendered one.
pub async fn diff(
    plan: &Plan,
    node: &PlannedNode,
    mode: ApplyMode,
    opts: &Options,
) -> Result<String, String> {
    let conn = connect(plan, node, opts).await?;
    let details = conn
        .apply_mode(node.config.clone(), mode, true)
        .await
        .map_err(|e| e.to_string())?;
    Ok(diff_of(&details))
}

async fn apply_one(
    plan: &Plan,
    node: &PlannedNode,
    mode: ApplyMode,
    opts: &Options,
) -> Result<(), String> {
    if node.role == Role::Controlplane {
        wait_healthy(plan, node, opts).await?;
    }
    let conn = connect(plan, node, opts).await?;
    conn.apply_mode(node.config.clone(), mode, false)
        .await
        .map_err(|e| e.to_string())?;
    if node.role == Role::Controlplane {
        wait_healthy(plan, node, opts).await?;
    }
    Ok(())
}

/// Compares every selected node (all when `select` is empty); unless
/// `dry_run`, applies to those whose diff is not empty: control planes one
/// at a time with etcd healthy around each, then workers. Stops applying
/// at the first failure.
pub async fn run(
    plan: &Plan,
    select: &[String],
    mode: ApplyMode,
    dry_run: bool,
    opts: &Options,
) -> ApplyOutcome {
    let mut outcome = ApplyOutcome::default();
    for node in ordered(plan, select) {
        let d = match diff(plan, node, mode, opts).await {
            Ok(d) => d,
            Err(error) => {
                outcome.failed.push(NodeFailure {
                    node: node.name.clone(),
                    error,
                });
                continue;
            }
        };
        let changed = !d.is_empty();
        let mut applied = false;
        if changed && !dry_run && outcome.failed.is_empty() {
            match apply_one(plan, node, mode, opts).await {
                Ok(()) => applied = true,
                Err(error) => outcome.failed.push(NodeFailure {
                    node: node.name.clone(),
                    error,
                }),
            }
        }
        outcome.nodes.push(NodeApply {
            node: node.name.clone(),
            changed,
            diff: d,
            applied,
        });
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
        let some = "Dry run summary:\nApplied configuration without a reboot (skipped in dry-run).\nConfig diff:\n\n-  a: 1\n+  a: 2\n";
        assert_eq!(diff_of(some), "-  a: 1\n+  a: 2");
    }
}
