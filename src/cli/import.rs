//! `imgbuild import talhelper`: a talhelper talconfig.yaml as a cluster.yaml,
//! with everything that could not be carried over listed by line.

use super::output::{Output, Partial, Reported};
use anyhow::Result;
use clap::{Args, Subcommand};
use imgbuild::import::{self, Converted, Imported, Skipped};
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
    let env = |k: &str| {
        allowed
            .iter()
            .any(|a| a == k)
            .then(|| std::env::var(k).ok())
            .flatten()
    };
    let dest = import::Destination {
        out: out.as_deref(),
        force,
    };
    let Converted { imported, problems } = import::talhelper_into(&file, &dest, &env)?;
    let problems = problems.map(|e| e.to_string());
    render(&imported, out.as_deref(), problems.as_deref(), output);
    let at = out.as_deref().unwrap_or(Path::new("it"));
    match problems {
        // Valid, but without something the talconfig asked for: partial.
        None if !imported.skipped.is_empty() => Err(Partial(format!(
            "{} setting(s) not carried over: add them to {} as listed",
            imported.skipped.len(),
            at.display()
        ))
        .into()),
        None => Ok(()),
        Some(_) => Err(Reported(format!(
            "the converted inventory is not valid yet: fix {} as listed",
            at.display()
        ))
        .into()),
    }
}

fn skipped_line(s: &Skipped) -> String {
    match s.line {
        Some(line) => format!("{}:{line}: {}: {}", s.file.display(), s.field, s.reason),
        // A whole file (the field is its name): named once.
        None if s.file.file_name().is_some_and(|n| n == s.field.as_str()) => {
            format!("{}: {}", s.file.display(), s.reason)
        }
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
                        errln!("wrote {}", p.path.display());
                    }
                    errln!("wrote {}", out.display());
                }
                None => out!("{}", imported.inventory),
            }
            if imported.skipped.is_empty() {
                errln!("everything was carried over");
            } else {
                errln!("not carried over ({}):", imported.skipped.len());
                for s in &imported.skipped {
                    errln!("  {}", skipped_line(s));
                }
            }
            if let Some(p) = problems {
                errln!("the converted inventory is not valid yet: {p}");
            }
        }
    }
}
