//! `imgbuild schematic`: per-node schematics, files for review, IDs of any file.

use super::inventory::load_inventory;
use super::output::Output;
use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use imgbuild::schematic::Schematic;
use imgbuild::schematic::review::{ReviewFile, write_review_files};
use serde_json::json;
use std::path::{Path, PathBuf};

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct SchematicArgs {
    /// The node whose schematic to print.
    node: Option<String>,
    /// Every node (and the cluster's base schematic).
    #[arg(long)]
    all: bool,
    /// With --all: write <dir>/<node>.yaml and <dir>/base.yaml for review in Git.
    #[arg(long, requires = "all")]
    write: bool,
    /// Where --write puts the files.
    #[arg(long, default_value = "schematics", requires = "write")]
    dir: PathBuf,
    #[command(subcommand)]
    command: Option<SchematicCommand>,
}

#[derive(Subcommand)]
enum SchematicCommand {
    /// The ID of any schematic file (`-` for standard input).
    Id { file: String },
}

pub fn run(args: SchematicArgs, config: &Path, output: Output) -> Result<()> {
    if let Some(SchematicCommand::Id { file }) = &args.command {
        return id_of_file(file, output);
    }
    let inv = load_inventory(config, output)?;
    let rendered = match (&args.node, args.all) {
        (Some(name), false) => vec![ReviewFile::for_node(&inv, inv.node(name)?)?],
        (None, true) => ReviewFile::all(&inv)?,
        (Some(_), true) => bail!("give a node name or --all, not both"),
        (None, false) => bail!("give a node name, --all, or `schematic id FILE`"),
    };
    if args.write {
        return write_all(&rendered, &args.dir, output);
    }
    match output {
        Output::Json => {
            let list: Vec<_> = rendered
                .iter()
                .map(|r| json!({"node": r.name, "id": r.id, "installer": r.installer, "schematic": r.canonical}))
                .collect();
            let value = if args.all {
                json!(list)
            } else {
                list[0].clone()
            };
            outln!("{value}");
        }
        Output::Text if args.all => {
            for r in &rendered {
                outln!("{:<16} {}", r.name, r.id);
            }
        }
        Output::Text => out!("{}", rendered[0].text()),
    }
    Ok(())
}

fn write_all(rendered: &[ReviewFile], dir: &Path, output: Output) -> Result<()> {
    let written = write_review_files(rendered, dir)?;
    let report: Vec<_> = rendered
        .iter()
        .zip(written)
        .map(|(r, (path, changed))| (&r.name, &r.id, path, changed))
        .collect();
    match output {
        Output::Json => {
            let list: Vec<_> = report
                .iter()
                .map(|(n, id, p, c)| json!({"node": n, "id": id, "path": p, "changed": c}))
                .collect();
            outln!("{}", json!(list));
        }
        Output::Text => {
            for (name, id, path, changed) in &report {
                let state = if *changed { "written" } else { "unchanged" };
                outln!("{name:<16} {id}  {} ({state})", path.display());
            }
        }
    }
    Ok(())
}

/// The most a schematic file may hold. A schematic is a few hundred bytes
/// of YAML; the largest (many extensions, kernel arguments, an overlay)
/// stay far below this, and `/dev/zero` never ends.
const MAX_SCHEMATIC_BYTES: u64 = 4 << 20;

fn id_of_file(file: &str, output: Output) -> Result<()> {
    let name = if file == "-" { "standard input" } else { file };
    let bytes = if file == "-" {
        imgbuild::io::read_bounded(std::io::stdin().lock(), MAX_SCHEMATIC_BYTES)
    } else {
        std::fs::File::open(file).and_then(|f| imgbuild::io::read_bounded(f, MAX_SCHEMATIC_BYTES))
    }
    .with_context(|| format!("cannot read {name}"))?;
    let text = String::from_utf8(bytes).with_context(|| format!("{name}: not UTF-8 text"))?;
    let id = Schematic::parse(&text)
        .and_then(|s| Ok(s.id()?))
        .with_context(|| format!("{file}: not a valid schematic"))?;
    match output {
        Output::Json => outln!("{}", json!({"file": file, "id": id})),
        Output::Text => outln!("{id}"),
    }
    Ok(())
}
