//! `imgbuild validate`: the inventory checked, every node's machine config
//! rendered and the address it is reached at resolved.

use super::inventory::load_inventory;
use super::output::{Output, Usage};
use super::talos;
use anyhow::{Context, Result};
use serde_json::json;
use std::path::Path;

#[derive(clap::Args)]
pub struct ValidateArgs {
    /// Whose secrets render the configs (none there: a throwaway bundle,
    /// never written).
    #[command(flatten)]
    state: talos::StateArgs,
    /// Check without the secrets a run needs: a `${NAME}` that is not set
    /// is rendered as a placeholder and named, not an error.
    #[arg(long)]
    offline: bool,
}

pub fn run(args: ValidateArgs, config: &Path, output: Output) -> Result<()> {
    let mut inv = load_inventory(config, output).context("inventory is not valid")?;
    // Talos's own range for its minor (pkg/machinery/compatibility): a pair
    // outside it would bootstrap a cluster whose kubelet never starts. A
    // Talos minor imgbuild has no table for is left to the node.
    use imgbuild::talos::kubernetes::compat::{CompatError, supported};
    if let Err(e @ (CompatError::TooOld { .. } | CompatError::TooNew { .. })) =
        supported(&inv.cluster.talos_version, &inv.cluster.kubernetes_version)
    {
        return Err(Usage(format!(
            "{}: cluster.kubernetesVersion: {e}",
            config.display()
        ))
        .into());
    }
    if let Some(advice) = inv.vmid_advice() {
        if output == Output::Text {
            errln!("warning: {advice}");
        }
        inv.warnings.push(advice);
    }
    let opts = imgbuild::talos::stage::BootstrapOptions {
        state_dir: args.state.state_dir,
        patch_vars: if args.offline {
            talos::patch_vars().comparing_unset()
        } else {
            talos::patch_vars()
        },
        ..Default::default()
    };
    if inv.image.format == imgbuild::inventory::ImageFormat::Iso {
        // Decided by the version alone: `build` would refuse it on the
        // patch route before downloading anything.
        imgbuild::iso::check_patchable(&inv.cluster.talos_version, inv.image.bootloader)
            .map_err(|e| Usage(format!("{}: image.format: iso: {e}", config.display())))?;
        // A Secure Boot ISO's command line is signed: no node's META on it.
        let nodes: Vec<_> = inv.nodes.iter().collect();
        imgbuild::iso::check_secure_boot(&inv, &nodes)
            .map_err(|e| Usage(format!("{}: image.format: iso: {e}", config.display())))?;
    }
    let checked = imgbuild::talos::stage::check(&inv, &opts)
        .map_err(|e| Usage(format!("{}: {:#}", config.display(), anyhow::Error::new(e))))?;
    match output {
        Output::Json => outln!(
            "{}",
            json!({
                "valid": true,
                "file": config,
                "cluster": inv.cluster.name,
                "nodes": inv.nodes.len(),
                "controlPlanes": inv.control_planes().count(),
                "warnings": inv.warnings,
                "throwawaySecrets": checked.throwaway_secrets,
                "unset": checked.unset,
                "reach": checked.reach.iter().map(|(node, t)| {
                    (node.clone(), json!(t.as_ref().map(|t| t.addr.to_string())))
                }).collect::<serde_json::Map<_, _>>(),
            })
        ),
        Output::Text => {
            outln!(
                "{}: valid ({} nodes, {} control planes, {} warnings)",
                config.display(),
                inv.nodes.len(),
                inv.control_planes().count(),
                inv.warnings.len()
            );
            for name in &checked.unset {
                outln!("note: {name} is not set: rendered with a placeholder");
            }
        }
    }
    Ok(())
}
