//! `imgbuild pxe`: a folder of iPXE scripts and boot files for bare metal.

use super::build::{DownloadArgs, progress_for};
use super::inventory::load_inventory;
use super::output::{Output, Usage};
use anyhow::Result;
use clap::Args;
use imgbuild::boot::{self, BootError, PxeOptions};
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct PxeArgs {
    /// Nodes to write scripts for [default: every node].
    nodes: Vec<String>,
    /// The folder to serve over HTTP.
    #[arg(long, default_value = "pxe")]
    out_dir: PathBuf,
    /// Where that folder is served (e.g. http://10.0.0.2:8080/pxe); without
    /// it the scripts use URLs relative to themselves.
    #[arg(long)]
    url: Option<String>,
    #[command(flatten)]
    download: DownloadArgs,
}

pub fn pxe(args: PxeArgs, config: &Path, output: Output) -> Result<()> {
    let inv = load_inventory(config, output)?;
    let opts = PxeOptions {
        out_dir: args.out_dir.clone(),
        url: args.url.clone(),
        fetch: args.download.options(),
    };
    let progress = progress_for(args.download.quiet, output);
    let report = boot::pxe(&inv, &args.nodes, &opts, progress.as_ref()).map_err(|e| {
        // What the inventory or the command line lacks is a usage error.
        match e {
            BootError::NoMac { .. }
            | BootError::TooOld { .. }
            | BootError::BadUrl(_)
            | BootError::UnknownNode(_)
            | BootError::SecureBoot { .. } => anyhow::Error::new(Usage(e.to_string())),
            e => e.into(),
        }
    })?;
    match output {
        Output::Json => outln!("{}", serde_json::to_string(&report)?),
        Output::Text => {
            let word = |written: bool| if written { "wrote" } else { "unchanged" };
            for a in &report.assets {
                outln!(
                    "{:<9} {} ({} bytes) and {} for schematic {}",
                    word(a.kernel.written || a.initramfs.written),
                    a.kernel.path.display(),
                    a.kernel.size,
                    a.initramfs.path.display(),
                    a.schematic
                );
            }
            for n in &report.nodes {
                outln!(
                    "{:<9} {:<16} {} (command line {} bytes)",
                    word(n.script.written),
                    n.node,
                    n.script.path.display(),
                    n.cmdline_bytes
                );
            }
            outln!(
                "{:<9} {}: serve {} over HTTP and let iPXE chain it",
                word(report.boot.written),
                report.boot.path.display(),
                report.out_dir.display(),
            );
        }
    }
    Ok(())
}
