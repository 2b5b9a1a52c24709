//! The command line: every flag parsed (into typed values, so a bad one
//! is exit 2 before any stage runs), the command dispatched, its error
//! turned into an exit code. Commands import their siblings (`output`,
//! `inventory`, `flags`), never this file.

#[macro_use]
mod output;

mod board;
mod boot;
mod build;
mod complete;
mod day2;
mod down;
mod etcd;
mod flags;
mod guard;
mod hcloud;
mod image;
mod import;
mod inventory;
mod merge;
mod plan;
mod progress;
mod prune;
mod publish;
mod schematic;
mod secrets;
mod signals;
mod talos;
mod up;
mod validate;

use anyhow::Result;
use clap::{ArgAction, CommandFactory, Parser, Subcommand};
use imgbuild::inventory::InventoryError;
use output::{
    Changes, EXIT_CHANGES, EXIT_FAILURE, EXIT_PARTIAL, EXIT_USAGE, Format, Output, Partial,
    Reported, Usage,
};
use serde_json::json;
use std::path::PathBuf;

/// `imgbuild 0.1.0 (commit 1a2b3c4d5e6f; Talos v1.9–v1.14)`: what a bug
/// report needs, the commit and the Talos minors this build knows.
static VERSION: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let table = imgbuild::talos::kubernetes::compat::TABLE;
    format!(
        "{} (commit {}; Talos v1.{}–v1.{})",
        env!("CARGO_PKG_VERSION"),
        env!("IMGBUILD_COMMIT"),
        table.first().map_or(0, |r| r.talos_minor),
        table.last().map_or(0, |r| r.talos_minor),
    )
});

#[derive(Parser)]
#[command(
    name = "imgbuild",
    version = VERSION.as_str(),
    about = "Per-node Talos Linux images from one cluster inventory",
    after_help = "Exit codes: 0 ok, 1 failure, 2 usage error or invalid inventory, 3 partial \
                  (some nodes or artifacts done, some failed). With --output json, stdout holds \
                  exactly one JSON document, also on failure; with --output yaml, the same \
                  document as YAML."
)]
pub struct Cli {
    /// The cluster inventory [default: $IMGBUILD_CONFIG, else ./cluster.yaml];
    /// `plan` takes it several times.
    #[arg(
        long,
        global = true,
        env = "IMGBUILD_CONFIG",
        default_value = "cluster.yaml",
        action = ArgAction::Append
    )]
    config: Vec<PathBuf>,
    /// Image Factory URL, overriding the inventory's image.factory: images,
    /// schematics and the installer each machine config names all follow it.
    #[arg(long, global = true, env = "IMGBUILD_FACTORY")]
    factory: Option<String>,
    /// Output format: text for people; json or yaml (the same document) for
    /// CI and scripts (`-o json`, `-o yaml`, as kubectl and talosctl spell it);
    /// markdown (`up`, `replace`): the summary as a pull-request comment.
    #[arg(short = 'o', long, global = true, value_enum, default_value_t = Format::Text)]
    output: Format,
    /// Colors on stderr (bars, board, error prefixes); auto: on a terminal
    /// unless NO_COLOR is set.
    #[arg(long, global = true, value_enum, default_value_t = progress::ColorChoice::Auto)]
    color: progress::ColorChoice,
    /// Off a terminal, a line after this long without one while a wait
    /// goes on (for tests; 30s).
    #[arg(long, global = true, hide = true, default_value = "30s", value_parser = flags::parse_duration)]
    heartbeat: std::time::Duration,
    /// Show secrets instead of `<redacted: NAME>`: only when stdout is a
    /// terminal, or with --yes.
    #[arg(long, global = true)]
    show_secrets: bool,
    /// Confirm: `down` deletes without asking; `--show-secrets` prints
    /// secrets also where stdout is not a terminal (a log, a pipe).
    #[arg(short = 'y', long, global = true)]
    yes: bool,
    /// Make the state dir's files that hold secrets 0600 when others can
    /// read them (otherwise a warning names each).
    #[arg(long, global = true)]
    fix_permissions: bool,
    /// Log every HTTP request (Proxmox, Hetzner, factory, downloads,
    /// Kubernetes) and gRPC call (Talos) on stderr: method, URL or path,
    /// status, time. Never a header, body, token or key.
    #[arg(long, global = true)]
    debug: bool,
    /// Every Talos API connection through this HTTP CONNECT proxy
    /// (http://[user:password@]host[:port]), loopback included; `direct`:
    /// none. Unset: HTTPS_PROXY / NO_PROXY as talosctl reads them (never
    /// for loopback or localhost).
    #[arg(
        long,
        global = true,
        env = "IMGBUILD_TALOS_PROXY",
        value_name = "URL",
        hide_env_values = true
    )]
    talos_proxy: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check the inventory and report every problem with its line; render
    /// every node's machine config and resolve how each node is reached.
    Validate(validate::ValidateArgs),
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
    /// Write iPXE scripts per node (by MAC) over each base schematic's kernel
    /// and initramfs: the node's network rides on its kernel command line,
    /// and the factory sees only schematics without META.
    Pxe(boot::PxeArgs),
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
    /// Write the admin talosconfig into the state dir (--merge: and into
    /// ~/.talos/config, as talosctl config merge does).
    Talosconfig(talos::TalosconfigArgs),
    /// Where the cluster's admin kubeconfig is (--merge: add it to
    /// ~/.kube/config or $KUBECONFIG, as talosctl kubeconfig does).
    Kubeconfig(talos::KubeconfigArgs),
    /// Apply configs, bootstrap etcd once, wait until the cluster is healthy.
    Bootstrap(talos::BootstrapArgs),
    /// Move running nodes to the inventory's Talos version and schematics
    /// (control planes one at a time, then workers), hopping through each minor where needed.
    Upgrade(day2::UpgradeArgs),
    /// Push config changes to running nodes (each node's diff first).
    Apply(day2::ApplyArgs),
    /// etcd: save a snapshot of the cluster's database.
    Etcd(etcd::EtcdArgs),
    /// One row per node: version, schematic and config against the inventory.
    Status(day2::StatusArgs),
    /// Build what is missing, then publish every node's image (Proxmox VE
    /// storage and VMs, or Hetzner Cloud snapshots).
    Publish(publish::PublishCommand),
    /// Delete the temporary Hetzner servers and SSH keys that killed
    /// `publish` runs left (found by label).
    Cleanup(hcloud::CleanupArgs),
    /// Delete the machines imgbuild made for the cluster: Hetzner servers
    /// (by label), or Proxmox VMs with their disks and uploaded volumes (by
    /// the record in their description).
    Down(down::DownArgs),
    /// Delete what imgbuild made for the cluster and nothing uses: Proxmox
    /// import volumes and ISOs, Hetzner snapshots, download cache entries.
    Prune(prune::PruneArgs),
    /// Build, publish, start, bootstrap and check health: the whole line, resumable.
    Up(up::UpArgs),
    /// Remove nodes (drain, leave etcd, reset, delete the machine and its
    /// volumes) and create them again under the same names through `up`:
    /// for a changed address or a broken disk.
    Replace(up::UpArgs),
    /// List the distinct artifacts the inventories need, each with the command that makes it (CI matrix).
    Plan(plan::PlanArgs),
    /// Convert another tool's cluster definition into a cluster.yaml.
    Import(import::ImportArgs),
    /// Print a shell completion script (bash, zsh or fish); it completes
    /// node names from the inventory (--config, else ./cluster.yaml).
    Completions { shell: clap_complete::Shell },
    /// What the completion scripts ask: `__complete nodes` prints the
    /// inventory's node names, quietly (nothing on stderr, exit 0).
    #[command(name = "__complete", hide = true)]
    Complete { what: CompleteWhat },
    /// Print the manual page (roff) on stdout, or with --dir write one page
    /// per command (imgbuild.1, imgbuild-up.1, imgbuild-etcd-snapshot.1, …).
    Man(ManArgs),
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum CompleteWhat {
    Nodes,
}

#[derive(clap::Args)]
struct ManArgs {
    /// Write imgbuild.1 and a page for every subcommand, with its flags,
    /// into this folder (made if missing) instead of one page on stdout.
    #[arg(long)]
    dir: Option<PathBuf>,
}

/// Runs the CLI; returns the process exit code.
pub fn run() -> i32 {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(e),
    };
    let output = cli.output.commands();
    let terminal = std::io::IsTerminal::is_terminal(&std::io::stdout());
    output::init(cli.output, cli.show_secrets && (terminal || cli.yes));
    if cli.show_secrets && !terminal && !cli.yes {
        errln!(
            "--show-secrets ignored: stdout is not a terminal, and a log keeps what it shows (add --yes to show them anyway)"
        );
    }
    if cli.debug {
        // Through the one writer: redacted and escaped like every line.
        imgbuild::net::debug_to(|line| output::stderr_line("debug:", line));
        output::debug_log();
    }
    guard::init(cli.fix_permissions, cli.factory.as_deref());
    if let Some(Err(e)) = cli.factory.as_deref().map(imgbuild::net::base_url) {
        return usage_error(Cli::command().error(
            clap::error::ErrorKind::ValueValidation,
            format!("--factory / IMGBUILD_FACTORY {e}"),
        ));
    }
    // A proxy's password never reaches the output, whichever layer meets it.
    let proxies = [
        "HTTPS_PROXY",
        "https_proxy",
        "HTTP_PROXY",
        "http_proxy",
        "ALL_PROXY",
        "all_proxy",
    ]
    .iter()
    .filter_map(|k| std::env::var(k).ok())
    .chain(cli.talos_proxy.clone());
    for url in proxies {
        for password in imgbuild::net::proxy::passwords_in(&url) {
            output::redact_also("proxy password", &password);
        }
    }
    if let Some(Err(e)) = cli
        .talos_proxy
        .as_deref()
        .map(imgbuild::net::proxy::set_talos_proxy)
    {
        return usage_error(Cli::command().error(
            clap::error::ErrorKind::ValueValidation,
            format!("--talos-proxy / IMGBUILD_TALOS_PROXY {e}"),
        ));
    }
    inventory::set_factory(cli.factory.clone());
    progress::init(cli.color, cli.heartbeat);
    match dispatch(cli) {
        Ok(()) => 0,
        Err(e) => {
            // Errors may carry text from files, images and replies. Each
            // cause once: an error that shows its source (`{path}: {source}`)
            // would otherwise say it twice.
            let message = imgbuild::net::error_chain(e.as_ref());
            let message = imgbuild::input::escape(&message).into_owned();
            let partial = e.downcast_ref::<Partial>().is_some();
            if e.downcast_ref::<Changes>().is_some() {
                // Not an error: what is planned or differs was printed.
                if output == Output::Text {
                    errln!("{message}");
                }
            } else if output == Output::Json && (partial || e.downcast_ref::<Reported>().is_some())
            {
                // The JSON result on stdout already says what went wrong.
            } else if output == Output::Json {
                outln!("{}", json!({ "error": message }));
            } else {
                output::stderr_line(&progress::paint("error:", "1;31"), &message);
            }
            exit_code(&e)
        }
    }
}

fn exit_code(e: &anyhow::Error) -> i32 {
    // A node name the inventory lacks is a usage error, wherever it surfaced.
    let usage = e.chain().any(|c| {
        c.downcast_ref::<InventoryError>().is_some()
            || c.downcast_ref::<Usage>().is_some()
            || c.downcast_ref::<imgbuild::inventory::UnknownNode>()
                .is_some()
            || matches!(
                c.downcast_ref::<imgbuild::build::BuildError>(),
                Some(imgbuild::build::BuildError::UnknownNode(_))
            )
            // No secrets, two bundles, a SOPS file without its key.
            || c.downcast_ref::<imgbuild::talos::stage::StageError>()
                .is_some_and(imgbuild::talos::stage::StageError::is_usage)
    });
    if e.downcast_ref::<Changes>().is_some() {
        EXIT_CHANGES
    } else if e.downcast_ref::<Partial>().is_some() {
        EXIT_PARTIAL
    } else if usage {
        EXIT_USAGE
    } else {
        EXIT_FAILURE
    }
}

/// clap's verdict on the command line: help and version on stdout (exit
/// 0, or 1 when stdout cannot take them); a usage error as one JSON
/// document on stdout when `--output json` was asked for (CI parses
/// stdout), else clap's message, exit 2 either way.
fn usage_error(e: clap::Error) -> i32 {
    use clap::error::ErrorKind;
    if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
        // Through stdout_write, which exits 1 when stdout cannot take it
        // (clap's own printing ignores a full or closed stdout and exits 0).
        outln!("{}", e.render().to_string().trim_end());
        return 0;
    }
    // args_os: a non-UTF-8 argument is clap's usage error, not a panic here.
    let args: Vec<String> = std::env::args_os()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let asked = |format: &str| {
        args.windows(2)
            .any(|w| (w[0] == "--output" || w[0] == "-o") && w[1] == format)
            || args.iter().any(|a| {
                [
                    format!("--output={format}"),
                    format!("-o{format}"),
                    format!("-o={format}"),
                ]
                .contains(a)
            })
    };
    let format = if asked("yaml") {
        Format::Yaml
    } else if asked("json") {
        Format::Json
    } else {
        Format::Text
    };
    if format != Format::Text {
        output::init(format, false);
        let message = e.render().to_string();
        outln!("{}", json!({ "error": message.trim_end() }));
    } else {
        let _ = e.print();
    }
    EXIT_USAGE
}

fn dispatch(cli: Cli) -> Result<()> {
    let several = cli.config.len() > 1;
    if several && !matches!(cli.command, Command::Plan(_)) {
        return Err(Usage(format!(
            "--config was given {} times; only `plan` reads several inventories",
            cli.config.len()
        ))
        .into());
    }
    if cli.output == Format::Markdown
        && !matches!(cli.command, Command::Up(_) | Command::Replace(_))
    {
        return Err(output::markdown_refused().into());
    }
    let one = Invocation {
        config: cli.config[0].clone(),
        configs: &cli.config,
        output: cli.output.commands(),
        yes: cli.yes,
    };
    dispatch_one(cli.command, one)
}

/// The global flags: the inventory every command reads, or with `plan`
/// all of them.
struct Invocation<'a> {
    config: PathBuf,
    configs: &'a [PathBuf],
    output: Output,
    /// `--yes`.
    yes: bool,
}

fn dispatch_one(command: Command, cli: Invocation) -> Result<()> {
    match command {
        Command::Validate(args) => validate::run(args, &cli.config, cli.output),
        Command::Schematic(args) => schematic::run(args, &cli.config, cli.output),
        Command::Inspect(args) => image::inspect(args, cli.output),
        Command::Meta(args) => image::meta(args, cli.output),
        Command::Patch(args) => image::patch(args, &cli.config, cli.output),
        Command::Node(args) => build::node(args, &cli.config, cli.output),
        Command::Build(args) => build::many(args, &cli.config, cli.output),
        Command::Pxe(args) => boot::pxe(args, &cli.config, cli.output),
        Command::Verify(args) => build::verify(args, cli.output),
        Command::Diff(args) => image::diff(args, cli.output),
        Command::Fetch(args) => build::fetch(args, cli.output),
        Command::Secrets(args) => talos::secrets(args, &cli.config, cli.output),
        Command::Config(args) => talos::machine_config(args, &cli.config, cli.output),
        Command::Talosconfig(args) => talos::talosconfig(args, &cli.config, cli.output),
        Command::Kubeconfig(args) => talos::kubeconfig(args, &cli.config, cli.output),
        Command::Bootstrap(args) => talos::bootstrap(args, &cli.config, cli.output),
        Command::Upgrade(args) => day2::upgrade(args, &cli.config, cli.output),
        Command::Apply(args) => day2::apply(args, &cli.config, cli.output),
        Command::Etcd(args) => etcd::run(args, &cli.config, cli.output),
        Command::Status(args) => day2::status(args, &cli.config, cli.output),
        Command::Publish(args) => publish::run(args, &cli.config, cli.output),
        Command::Cleanup(args) => hcloud::cleanup(args, cli.output),
        Command::Down(args) => down::run(args, &cli.config, cli.output, cli.yes),
        Command::Prune(args) => prune::run(args, &cli.config, cli.output),
        Command::Up(args) => up::run(args, &cli.config, cli.output),
        Command::Replace(args) => up::replace(args, &cli.config, cli.output),
        Command::Plan(args) => plan::run(args, cli.configs, cli.output),
        Command::Import(args) => import::run(args, cli.output),
        Command::Complete {
            what: CompleteWhat::Nodes,
        } => {
            // Quiet whatever happens: the inventory's names, or nothing.
            let names = complete::node_names(&cli.config);
            if !names.is_empty() {
                outln!("{}", names.join("\n"));
            }
            Ok(())
        }
        Command::Completions { shell } => {
            // Into memory first: clap_complete panics when a write fails.
            let script = complete::script(shell, Cli::command());
            print_generated(&script, json!({"shell": shell.to_string()}), cli.output)
        }
        Command::Man(ManArgs { dir: None }) => {
            let mut page = Vec::new();
            clap_mangen::Man::new(Cli::command()).render(&mut page)?;
            print_generated(&page, json!({"format": "roff"}), cli.output)
        }
        Command::Man(ManArgs { dir: Some(dir) }) => {
            let pages = man_pages(&dir)?;
            match cli.output {
                Output::Json => outln!("{}", json!({"dir": dir, "pages": pages})),
                Output::Text => {
                    for page in &pages {
                        outln!("{}", page.display());
                    }
                }
            }
            Ok(())
        }
    }
}

/// `man --dir DIR`: a page for the program and one for every command and
/// subcommand (the global flags on each), named as man(1) finds them
/// (`man imgbuild-up`); a page already as it would be written is kept.
fn man_pages(dir: &std::path::Path) -> Result<Vec<PathBuf>> {
    use anyhow::Context as _;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut root = Cli::command().disable_help_subcommand(true);
    root.build();
    let mut commands = vec![root];
    let mut pages = Vec::new();
    while let Some(cmd) = commands.pop() {
        let subcommands: Vec<clap::Command> = cmd
            .get_subcommands()
            .filter(|c| !c.is_hide_set())
            .cloned()
            .collect();
        // Depth first, in --help's order.
        commands.extend(subcommands.into_iter().rev());
        let man =
            clap_mangen::Man::new(cmd).source(format!("imgbuild {}", env!("CARGO_PKG_VERSION")));
        let path = dir.join(man.get_filename());
        let mut page = Vec::new();
        man.render(&mut page)?;
        // A page already as it would be written stays untouched (make's mtimes).
        if std::fs::read(&path).ok().as_deref() != Some(page.as_slice()) {
            std::fs::write(&path, &page).with_context(|| format!("writing {}", path.display()))?;
        }
        pages.push(path);
    }
    Ok(pages)
}

/// A generated file on stdout as it is, or with `--output json` as the
/// `text` of one document (`fields` say what it is).
fn print_generated(bytes: &[u8], mut fields: serde_json::Value, output: Output) -> Result<()> {
    match output {
        Output::Text => output::stdout_write(bytes),
        Output::Json => {
            fields["text"] = json!(String::from_utf8_lossy(bytes));
            outln!("{fields}");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::error::ErrorKind;

    /// A bad pin is clap's usage error (exit 2): `up` never reaches its
    /// build, publish or bootstrap stage with it.
    #[test]
    fn a_bad_cert_fingerprint_is_a_usage_error_before_anything_runs() {
        for command in ["up", "bootstrap", "upgrade", "apply", "status"] {
            for bad in ["nothex", "AB:CD", &"ab".repeat(31)] {
                let argv = ["imgbuild", command, "--cert-fingerprint", bad];
                let Err(e) = Cli::try_parse_from(argv) else {
                    panic!("{command} --cert-fingerprint {bad:?} was accepted");
                };
                assert_eq!(e.kind(), ErrorKind::ValueValidation, "{command} {bad:?}");
                assert_eq!(e.exit_code(), EXIT_USAGE);
                let text = e.to_string();
                assert!(
                    text.contains("--cert-fingerprint") && text.contains("SHA-256 fingerprint"),
                    "{text}"
                );
            }
        }
    }

    #[test]
    fn a_good_cert_fingerprint_in_either_spelling_parses() {
        let hex = "0f".repeat(32);
        let colons = vec!["0F"; 32].join(":");
        for pin in [hex.as_str(), &colons, &hex.to_uppercase()] {
            let argv = ["imgbuild", "up", "--cert-fingerprint", pin];
            let cli = Cli::try_parse_from(argv).unwrap_or_else(|e| panic!("{pin}: {e}"));
            assert!(matches!(cli.command, Command::Up(_)));
        }
    }

    #[test]
    fn a_bad_duration_is_a_usage_error_before_anything_runs() {
        for flag in ["--node-timeout", "--poll", "--heartbeat"] {
            let argv = ["imgbuild", "up", flag, "3d"];
            let e = Cli::try_parse_from(argv).err().expect(flag);
            assert_eq!(e.kind(), ErrorKind::ValueValidation, "{flag}");
            assert_eq!(e.exit_code(), EXIT_USAGE);
            assert!(e.to_string().contains("unknown unit"), "{e}");
        }
    }
}
