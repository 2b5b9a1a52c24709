//! `imgbuild import talhelper`: a talhelper talconfig.yaml as a cluster.yaml,
//! with everything that could not be carried over listed by line.

use super::output::{Output, Reported};
use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use imgbuild::import::{self, ImportOptions, Imported, Skipped};
use imgbuild::inventory::Inventory;
use serde_json::json;
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct ImportArgs {
    #[command(subcommand)]
    from: ImportFrom,
}

#[derive(Subcommand)]
enum ImportFrom {
    /// A talhelper talconfig.yaml (talenv.yaml beside it fills `${VAR}`s).
    Talhelper {
        /// The talconfig.yaml to convert.
        file: PathBuf,
        /// Write the inventory here (inline patches go to patches/ beside
        /// it) instead of printing it.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Replace an existing --out file.
        #[arg(long)]
        force: bool,
        /// Fill `${NAME}` from the environment (repeatable). Without it only
        /// talenv.yaml fills variables, so a talconfig cannot copy a token.
        #[arg(long = "env", value_name = "NAME")]
        env: Vec<String>,
    },
}

pub fn run(args: ImportArgs, output: Output) -> Result<()> {
    let ImportFrom::Talhelper {
        file,
        out,
        force,
        env: allowed,
    } = args.from;
    if let Some(out) = &out
        && out.exists()
        && !force
    {
        bail!(
            "{} exists: give --force to replace it, or another --out",
            out.display()
        );
    }
    let out_dir = out.as_deref().map(|o| {
        o.parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .to_owned()
    });
    if let Some(dir) = &out_dir {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let env = |k: &str| {
        allowed
            .iter()
            .any(|a| a == k)
            .then(|| std::env::var(k).ok())
            .flatten()
    };
    let imported = import::talhelper(
        &file,
        &ImportOptions {
            out_dir: out_dir.as_deref(),
            env: &env,
        },
    )?;
    // The inventory is checked where it will live, so its patch paths resolve.
    let home = match (&out, &out_dir) {
        (Some(out), Some(dir)) => {
            for p in &imported.patch_files {
                let target = import::patch_target(dir, &p.path)?;
                if let Some(parent) = target.parent() {
                    std::fs::create_dir_all(parent)?;
                }
                imgbuild::atomic::write_if_changed(&target, p.content.as_bytes(), false)
                    .with_context(|| format!("writing {}", target.display()))?;
            }
            imgbuild::atomic::write_if_changed(out, imported.inventory.as_bytes(), false)
                .with_context(|| format!("writing {}", out.display()))?;
            out.clone()
        }
        _ => file.parent().unwrap_or(Path::new(".")).join("cluster.yaml"),
    };
    let problems = match Inventory::parse(&imported.inventory, &home) {
        Ok(_) => None,
        Err(e) => Some(e.to_string()),
    };
    render(&imported, out.as_deref(), problems.as_deref(), output);
    match problems {
        None => Ok(()),
        Some(_) => Err(Reported(format!(
            "the converted inventory is not valid yet: fix {} as listed",
            out.as_deref().unwrap_or(Path::new("it")).display()
        ))
        .into()),
    }
}

fn skipped_line(s: &Skipped) -> String {
    match s.line {
        Some(line) => format!("{}:{line}: {}: {}", s.file.display(), s.field, s.reason),
        None => format!("{}: {}: {}", s.file.display(), s.field, s.reason),
    }
}

fn render(imported: &Imported, out: Option<&Path>, problems: Option<&str>, output: Output) {
    match output {
        Output::Json => {
            let mut v = json!({
                "out": out,
                "patches": imported.patch_files.iter().map(|p| &p.path).collect::<Vec<_>>(),
                "skipped": imported.skipped,
                "valid": problems.is_none(),
                "problems": problems,
            });
            if out.is_none() {
                v["inventory"] = json!(imported.inventory);
            }
            outln!("{v}");
        }
        Output::Text => {
            match out {
                Some(out) => {
                    for p in &imported.patch_files {
                        eprintln!("wrote {}", p.path.display());
                    }
                    eprintln!("wrote {}", out.display());
                }
                None => out!("{}", imported.inventory),
            }
            if imported.skipped.is_empty() {
                eprintln!("everything was carried over");
            } else {
                eprintln!("not carried over ({}):", imported.skipped.len());
                for s in &imported.skipped {
                    eprintln!("  {}", skipped_line(s));
                }
            }
            if let Some(p) = problems {
                eprintln!("the converted inventory is not valid yet: {p}");
            }
        }
    }
}
