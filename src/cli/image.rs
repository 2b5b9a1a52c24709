//! `imgbuild inspect`, `meta get|set|delete` and `patch`: looking inside
//! images and writing a node's network into them.

use super::inventory::load_inventory;
use super::output::{Output, Reported, stdout_write};
use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use imgbuild::disk::edit::{self, MetaChange, MetaEditOptions, PatchOptions};
use imgbuild::disk::{self, Image};
use imgbuild::input::escape;
use imgbuild::meta::{self, KEY_NETWORK, PlatformNetworkConfig, adv, key_name};
use imgbuild::schematic;
use serde_json::json;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

/// A META key, decimal or `0x` hex.
fn parse_key(s: &str) -> Result<u32, String> {
    let v = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u8::from_str_radix(hex, 16),
        None => s.parse::<u8>(),
    }
    .map_err(|_| format!("{s:?} is not a META key (1-255, decimal or 0x hex)"))?;
    if v == 0 {
        return Err("META key 0 ends the tag list and cannot be stored".into());
    }
    Ok(u32::from(v))
}

#[derive(Args)]
pub struct InspectArgs {
    image: PathBuf,
}

#[derive(Args)]
pub struct MetaArgs {
    #[command(subcommand)]
    command: MetaCommand,
}

#[derive(Subcommand)]
enum MetaCommand {
    /// Print one key's value.
    Get {
        image: PathBuf,
        /// The META key: 1-255, decimal or 0x hex (10 is the network configuration).
        #[arg(long, value_parser = parse_key)]
        key: u32,
    },
    /// Set one key from a file (`-` for standard input); other keys survive.
    Set {
        image: PathBuf,
        /// The META key: 1-255, decimal or 0x hex (10 is the network configuration).
        #[arg(long, value_parser = parse_key)]
        key: u32,
        /// The file holding the new value, `-` for standard input.
        #[arg(long)]
        value_file: String,
    },
    /// Remove one key; other keys survive.
    Delete {
        image: PathBuf,
        /// The META key: 1-255, decimal or 0x hex (10 is the network configuration).
        #[arg(long, value_parser = parse_key)]
        key: u32,
    },
}

#[derive(Args)]
pub struct DiffArgs {
    a: PathBuf,
    b: PathBuf,
}

#[derive(Args)]
pub struct PatchArgs {
    /// The base image (the node-independent factory image).
    #[arg(long)]
    base: PathBuf,
    /// The node whose network goes into META key 10.
    #[arg(long)]
    node: String,
    /// Where the node's image is written.
    #[arg(long)]
    out: PathBuf,
}

/// A text rendering of one META value, indented under its key.
fn show_value(key: u32, text: &str) {
    let name = key_name(key).unwrap_or("unknown");
    // META is whatever the image's maker wrote.
    let text = escape(text);
    if text.contains('\n') {
        outln!("  {key:>3} {name}:");
        for line in text.lines() {
            outln!("        {line}");
        }
    } else {
        outln!("  {key:>3} {name}: {text}");
    }
}

/// `inspect` of an ISO: its volume date, and per kernel menu entry the
/// command line and the META it carries, decoded.
fn inspect_iso(path: &Path, output: Output) -> Result<()> {
    let r = imgbuild::iso::inspect(path)?;
    match output {
        Output::Json => outln!(
            "{}",
            json!({"image": path, "format": "iso", "volumeDate": r.volume_date,
                   "entries": r.entries.iter().map(|e| json!({
                       "title": e.entry.title, "kernel": e.entry.kernel, "args": e.entry.args,
                       "meta": e.meta.iter().map(|(k, v)| json!({"key": k, "name": key_name(u32::from(*k)), "value": v})).collect::<Vec<_>>(),
                       "problem": e.problem,
                   })).collect::<Vec<_>>(), "ukis": r.ukis})
        ),
        Output::Text => {
            outln!("{}: ISO, volume date {}", path.display(), r.volume_date);
            for e in &r.entries {
                // grub.cfg is whatever the ISO's maker wrote.
                outln!(
                    "menu entry {:?}: {}",
                    e.entry.title,
                    escape(&e.entry.kernel)
                );
                outln!("  command line: {}", escape(&e.entry.args.join(" ")));
                if let Some(p) = &e.problem {
                    errln!("warning: menu entry {:?}: {p}", e.entry.title);
                }
                outln!("  META on the command line: {} value(s)", e.meta.len());
                for (key, value) in &e.meta {
                    show_value(u32::from(*key), value);
                }
            }
            for u in &r.ukis {
                outln!(
                    "UEFI: a UKI at byte {}, its baked-in command line {}",
                    u.offset,
                    if u.has_meta {
                        "carries META"
                    } else {
                        "carries no META"
                    }
                );
            }
        }
    }
    Ok(())
}

pub fn inspect(args: InspectArgs, output: Output) -> Result<()> {
    if imgbuild::iso::is_iso(&args.image) {
        return inspect_iso(&args.image, output);
    }
    let mut img = Image::open(&args.image, false)?;
    let meta = img.read_meta()?;
    let tags: Vec<_> = meta
        .adv
        .iter()
        .map(|(key, value)| {
            let text = String::from_utf8_lossy(value).into_owned();
            let network = (key == u32::from(KEY_NETWORK))
                .then(|| PlatformNetworkConfig::from_yaml(&text).ok())
                .flatten();
            (key, text, network)
        })
        .collect();
    match output {
        Output::Json => {
            let tags: Vec<_> = tags
                .iter()
                .map(|(key, text, network)| {
                    json!({"key": key, "name": key_name(*key), "value": text,
                    "network": network.as_ref().map(|n| json!({
                        "addresses": n.addresses.iter().map(|a| &a.address).collect::<Vec<_>>(),
                        "gateways": n.routes.iter().map(|r| &r.gateway).collect::<Vec<_>>(),
                        "hostnames": n.hostnames.iter().map(|h| &h.hostname).collect::<Vec<_>>(),
                    }))})
                })
                .collect();
            outln!(
                "{}",
                json!({
                    "image": args.image, "format": img.format, "virtualSize": img.size,
                    "partitions": img.partitions, "meta": {"source": meta.source, "problems": meta.problems, "tags": tags},
                })
            );
        }
        Output::Text => {
            outln!(
                "{}: {:?}, {} bytes",
                args.image.display(),
                img.format,
                img.size
            );
            outln!(
                "  {:>3}  {:<10} {:>14} {:>14}  type",
                "#",
                "name",
                "offset",
                "size"
            );
            for p in &img.partitions {
                outln!(
                    "  {:>3}  {:<10} {:>14} {:>14}  {}",
                    p.number,
                    escape(&p.name),
                    p.offset,
                    p.size,
                    p.type_guid
                );
            }
            for problem in &meta.problems {
                errln!("warning: {}", escape(problem));
            }
            outln!("META ({:?} copy): {} tag(s)", meta.source, tags.len());
            for (key, text, _) in &tags {
                show_value(*key, text);
            }
        }
    }
    Ok(())
}

pub fn meta(args: MetaArgs, output: Output) -> Result<()> {
    match args.command {
        MetaCommand::Get { image, key } => {
            let meta = Image::open(&image, false)?.read_meta()?;
            let Some(value) = meta.adv.get(key) else {
                bail!("{}: META has no key {key}", image.display());
            };
            match output {
                Output::Json => outln!(
                    "{}",
                    json!({"key": key, "name": key_name(key), "value": String::from_utf8_lossy(value)})
                ),
                // Raw for a pipe; escaped for a terminal.
                Output::Text if std::io::stdout().is_terminal() => {
                    out!("{}", escape(&String::from_utf8_lossy(value)))
                }
                Output::Text => stdout_write(value),
            }
        }
        MetaCommand::Set {
            image,
            key,
            value_file,
        } => {
            let value = read_value(&value_file)?;
            edit_in_place(&image, vec![(key, Some(value))], output)?;
        }
        MetaCommand::Delete { image, key } => edit_in_place(&image, vec![(key, None)], output)?,
    }
    Ok(())
}

/// A META value from a file or standard input, read no further than one
/// ADV copy (256 KiB): nothing larger can fit, and `/dev/zero` never ends.
fn read_value(file: &str) -> Result<Vec<u8>> {
    let limit = adv::COPY_SIZE as u64;
    let read = if file == "-" {
        imgbuild::io::read_bounded(std::io::stdin().lock(), limit)
    } else {
        std::fs::File::open(file).and_then(|f| imgbuild::io::read_bounded(f, limit))
    };
    read.with_context(|| {
        let name = if file == "-" { "standard input" } else { file };
        format!("cannot read the value from {name}")
    })
}

/// Reads, merges and rewrites META through the library; shows what it found.
fn edit_in_place(image: &Path, changes: Vec<MetaChange>, output: Output) -> Result<()> {
    let edited = edit::edit_meta(&MetaEditOptions {
        image: image.to_owned(),
        changes,
    })?;
    for problem in &edited.problems {
        errln!("warning: {problem}");
    }
    let keys: Vec<u32> = edited.adv.iter().map(|(k, _)| k).collect();
    let changed = edited.changed;
    match output {
        Output::Json => outln!(
            "{}",
            json!({"image": image, "changed": changed, "keys": keys})
        ),
        Output::Text => outln!(
            "{}: META {} (keys: {keys:?})",
            image.display(),
            if changed { "written" } else { "unchanged" }
        ),
    }
    Ok(())
}

pub fn patch(args: PatchArgs, config: &Path, output: Output) -> Result<()> {
    let inv = load_inventory(config, output)?;
    let node = inv.node(&args.node)?;
    let Some(value) = schematic::node::network_value(&inv, node) else {
        bail!(
            "platform {} does not read META key 10: nothing to write for {}",
            inv.image.platform,
            node.name
        );
    };
    let patched = edit::patch(&PatchOptions {
        base: args.base.clone(),
        out: args.out.clone(),
        changes: vec![meta::network_change(value)],
    })?;
    for problem in &patched.problems {
        errln!("warning: base {}: {problem}", args.base.display());
    }
    let kept = patched.kept_keys;
    match output {
        Output::Json => outln!(
            "{}",
            json!({"node": node.name, "base": args.base, "out": args.out, "keptKeys": kept})
        ),
        Output::Text => outln!(
            "{}: {} with META key 10 for {} (kept keys {kept:?})",
            args.out.display(),
            args.base.display(),
            node.name
        ),
    }
    Ok(())
}

/// Exit 0 when the images are the same bytes, 1 (after the report) when
/// they are not, also when only the bytes differ (ADV tag order, say).
pub fn diff(args: DiffArgs, output: Output) -> Result<()> {
    if imgbuild::iso::is_iso(&args.a) && imgbuild::iso::is_iso(&args.b) {
        return diff_iso(args, output);
    }
    let d = disk::diff(&args.a, &args.b)?;
    match output {
        Output::Json => outln!(
            "{}",
            json!({"a": args.a, "b": args.b, "identical": d.identical(),
                   "equivalent": d.equivalent(), "diff": d})
        ),
        Output::Text => {
            for line in d.layout.iter().chain(&d.meta) {
                outln!("{}", escape(line));
            }
            for name in &d.contents {
                outln!("{}: contents differ", escape(name));
            }
            if d.identical() {
                outln!("identical: the same bytes");
            } else if d.equivalent() {
                outln!("same META tags and partition contents, different bytes");
            }
        }
    }
    differ_unless(d.identical(), &args)
}

/// `diff` of two ISOs: volume date, kernel menu entries and their decoded
/// META; exit 1 unless they are the same bytes.
fn diff_iso(args: DiffArgs, output: Output) -> Result<()> {
    let d = imgbuild::iso::diff(&args.a, &args.b)?;
    match output {
        Output::Json => outln!(
            "{}",
            json!({"a": args.a, "b": args.b, "identical": d.identical,
                   "equivalent": d.equivalent(), "diff": d})
        ),
        Output::Text => {
            for line in &d.changes {
                outln!("{line}");
            }
            if d.identical {
                outln!("identical: the same bytes");
            } else if d.equivalent() {
                outln!("same volume date, menu entries and META, different bytes");
            }
        }
    }
    differ_unless(d.identical, &args)
}

/// `diff`'s exit: 0 for the same bytes, else 1 naming both files.
fn differ_unless(identical: bool, args: &DiffArgs) -> Result<()> {
    if identical {
        return Ok(());
    }
    Err(Reported(format!(
        "{} and {} differ",
        args.a.display(),
        args.b.display()
    ))
    .into())
}
