//! Commands, their flags, and how their results are shown.

mod build;
mod hcloud;
mod image;
mod publish;
mod schematic;
mod signals;
mod talos;
mod up;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use imgbuild::inventory::Inventory;
use serde_json::json;
use std::path::{Path, PathBuf};

#[derive(Parser)]
#[command(
    name = "imgbuild",
    version,
    about = "Per-node Talos Linux images from one cluster inventory"
)]
pub struct Cli {
    /// The cluster inventory [default: $IMGBUILD_CONFIG, else ./cluster.yaml]
    #[arg(
        long,
        global = true,
        env = "IMGBUILD_CONFIG",
        default_value = "cluster.yaml"
    )]
    config: PathBuf,
    /// Output format: text for people, json for CI.
    #[arg(long, global = true, value_enum, default_value_t = Output::Text)]
    output: Output,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Check the inventory and report every problem with its line.
    Validate,
    /// Show, write or compute Image Factory schematics and their IDs.
    Schematic(schematic::SchematicArgs),
    /// Show an image's format, partitions and META tags.
    Inspect(image::InspectArgs),
    /// Read or change one META key of an image in place.
    Meta(image::MetaArgs),
    /// Copy a base image and write a node's network into its META.
    Patch(image::PatchArgs),
    /// Build one node's image (factory download or patched base) into --out-dir.
    Node(build::NodeArgs),
    /// Build every node's image (or the named ones), concurrently.
    Build(build::BuildManyArgs),
    /// Re-hash the built images against out/manifest.json.
    Verify(build::VerifyArgs),
    /// Compare two images: GPT layout, per-partition hashes, META tags.
    Diff(image::DiffArgs),
    /// Download one image into the cache, verified (optionally pinned).
    Fetch(build::FetchArgs),
    /// The cluster's secrets bundle (talosctl-compatible secrets.yaml).
    Secrets(talos::SecretsArgs),
    /// Print one node's machine config (patched, schema-checked).
    Config(talos::ConfigArgs),
    /// Write the admin talosconfig into the state dir.
    Talosconfig(talos::TalosconfigArgs),
    /// Apply configs, bootstrap etcd once, wait until the cluster is healthy.
    Bootstrap(talos::BootstrapArgs),
    /// Build what is missing, then publish every node's image (Proxmox VE
    /// storage and VMs, or Hetzner Cloud snapshots).
    Publish(publish::PublishArgs),
    /// Delete the temporary Hetzner servers and SSH keys that killed
    /// `publish` runs left (found by label).
    Cleanup(hcloud::CleanupArgs),
    /// Delete the cluster's Hetzner servers that `up` created (by label).
    Down(hcloud::DownArgs),
    /// Build, publish, start, bootstrap and check health: the whole line, resumable.
    Up(up::UpArgs),
}

/// A failure whose details the command already printed (e.g. as its JSON
/// result): exit 1 with a one-line summary in text mode, nothing more in JSON.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Reported(pub String);

/// Some nodes done, some failed, details already printed: exit 3.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Partial(pub String);

/// The inventory, environment or arguments are at fault: exit 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Usage(pub String);

/// Runs the CLI; returns the process exit code.
pub fn run() -> i32 {
    let cli = Cli::parse();
    let output = cli.output;
    match dispatch(cli) {
        Ok(()) => 0,
        Err(e) => {
            let message = format!("{e:#}");
            let partial = e.downcast_ref::<Partial>().is_some();
            if output == Output::Json && (partial || e.downcast_ref::<Reported>().is_some()) {
                // The JSON result on stdout already says what went wrong.
            } else if output == Output::Json {
                println!("{}", json!({ "error": message }));
            } else {
                eprintln!("error: {message}");
            }
            if partial {
                3
            } else if e.downcast_ref::<Usage>().is_some() {
                2
            } else {
                1
            }
        }
    }
}

fn dispatch(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Validate => validate(&cli.config, cli.output),
        Command::Schematic(args) => schematic::run(args, &cli.config, cli.output),
        Command::Inspect(args) => image::inspect(args, cli.output),
        Command::Meta(args) => image::meta(args, cli.output),
        Command::Patch(args) => image::patch(args, &cli.config, cli.output),
        Command::Node(args) => build::node(args, &cli.config, cli.output),
        Command::Build(args) => build::many(args, &cli.config, cli.output),
        Command::Verify(args) => build::verify(args, cli.output),
        Command::Diff(args) => image::diff(args, cli.output),
        Command::Fetch(args) => build::fetch(args, cli.output),
        Command::Secrets(args) => talos::secrets(args, &cli.config, cli.output),
        Command::Config(args) => talos::machine_config(args, &cli.config, cli.output),
        Command::Talosconfig(args) => talos::talosconfig(args, &cli.config, cli.output),
        Command::Bootstrap(args) => talos::bootstrap(args, &cli.config, cli.output),
        Command::Publish(args) => publish::run(args, &cli.config, cli.output),
        Command::Cleanup(args) => hcloud::cleanup(args, cli.output),
        Command::Down(args) => hcloud::down(args, &cli.config, cli.output),
        Command::Up(args) => up::run(args, &cli.config, cli.output),
    }
}

/// Loads the inventory and shows its warnings on stderr.
pub fn load_inventory(path: &Path, output: Output) -> Result<Inventory> {
    let inv = Inventory::load(path)?;
    if output == Output::Text {
        for w in &inv.warnings {
            eprintln!("warning: {w}");
        }
    }
    Ok(inv)
}

fn validate(config: &Path, output: Output) -> Result<()> {
    let inv = load_inventory(config, output).context("inventory is not valid")?;
    match output {
        Output::Json => println!(
            "{}",
            json!({
                "valid": true,
                "file": config,
                "cluster": inv.cluster.name,
                "nodes": inv.nodes.len(),
                "controlPlanes": inv.control_planes().count(),
                "warnings": inv.warnings,
            })
        ),
        Output::Text => println!(
            "{}: valid ({} nodes, {} control planes, {} warnings)",
            config.display(),
            inv.nodes.len(),
            inv.control_planes().count(),
            inv.warnings.len()
        ),
    }
    Ok(())
}
