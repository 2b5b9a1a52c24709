//! `imgbuild secrets encrypt`: the cluster's secrets bundle as a SOPS file
//! for age recipients, to keep in Git; `sops -d` opens it, and imgbuild
//! reads it from there (`secrets.sops.yaml` beside the inventory, or
//! `cluster.secretsFile`) before the state dir's secrets.yaml.

use super::inventory::load_inventory;
use super::output::{Output, Usage};
use anyhow::{Context, Result};
use clap::Args;
use imgbuild::secrets::age::Recipient;
use imgbuild::secrets::sops;
use imgbuild::talos::stage::StateDir;
use serde_json::json;
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct EncryptArgs {
    /// The state dir whose secrets.yaml to encrypt [default: .talos/<cluster
    /// name>/ beside the inventory].
    #[arg(long, env = "IMGBUILD_STATE_DIR")]
    state_dir: Option<PathBuf>,
    /// An age recipient (age1…) that may open the file; repeat for several.
    #[arg(long = "age", required = true, value_parser = Recipient::parse)]
    age: Vec<Recipient>,
    /// The file to write [default: cluster.secretsFile, else
    /// secrets.sops.yaml beside the inventory: where imgbuild reads it].
    #[arg(long)]
    out: Option<PathBuf>,
    /// Replace an existing file.
    #[arg(long)]
    force: bool,
}

pub fn encrypt(args: EncryptArgs, config: &Path, output: Output) -> Result<()> {
    let inv = load_inventory(config, output)?;
    let state = StateDir::open(&inv, args.state_dir.as_deref())?;
    // The state dir's clear bundle, or the SOPS file itself (re-encrypted
    // for other recipients with --force).
    let Some((bundle, source)) = imgbuild::talos::stage::find_secrets(&inv, &state.path)? else {
        return Err(Usage(format!(
            "{}: no secrets yet; make them with `imgbuild secrets gen` first",
            state.secrets_path().display()
        ))
        .into());
    };
    let from = source.path().to_owned();
    let clear = matches!(source, imgbuild::talos::stage::SecretsSource::Clear(_));
    let plain = serde_yaml_ng::to_string(&bundle).context("the secrets bundle as YAML")?;
    let text = sops::encrypt(&plain, &args.age)?;
    let out = args
        .out
        .unwrap_or_else(|| imgbuild::talos::stage::sealed_path(&inv));
    let read_here = out == imgbuild::talos::stage::sealed_path(&inv);
    if out.exists() && !args.force {
        return Err(Usage(format!(
            "{} exists: give --force to replace it, or another --out",
            out.display()
        ))
        .into());
    }
    imgbuild::atomic::write_if_changed(&out, text.as_bytes(), true)
        .with_context(|| format!("writing {}", out.display()))?;
    let recipients: Vec<String> = args.age.iter().map(ToString::to_string).collect();
    match output {
        Output::Json => outln!(
            "{}",
            json!({"file": out, "from": from, "recipients": recipients, "readByImgbuild": read_here})
        ),
        Output::Text => {
            outln!(
                "{}: the secrets of {}, SOPS-encrypted for {} (sops -d opens it)",
                out.display(),
                from.display(),
                recipients.join(", ")
            );
            if read_here && clear {
                outln!(
                    "imgbuild reads the cluster's secrets from {} now (with the age key in SOPS_AGE_KEY_FILE): the clear copies in {} (secrets.yaml, and talosconfig and kubeconfig, which hold admin keys) are no longer needed; delete them once the SOPS file is in Git",
                    out.display(),
                    state.path.display()
                );
            } else if !read_here {
                outln!(
                    "note: imgbuild does not read {}: name it in the inventory (cluster.secretsFile) to use it",
                    out.display()
                );
            }
        }
    }
    Ok(())
}
