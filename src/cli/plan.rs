//! `imgbuild plan`: the distinct artifacts of one or more inventories, each
//! with the exact command that builds and publishes only it, as a table, as
//! JSON, or as a GitHub Actions matrix.

use super::inventory::load_inventory;
use super::output::{Output, Usage};
use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use imgbuild::build::Route;
use imgbuild::inventory::ImageFormat;
use imgbuild::matrix::{self as plan, Artifact, ArtifactKind, ArtifactTarget};
use serde_json::{Value, json};
use std::path::PathBuf;

/// GitHub Actions refuses a matrix of more than 256 jobs.
pub const GITHUB_MATRIX_LIMIT: usize = 256;

#[derive(Args)]
pub struct PlanArgs {
    /// The route the commands build by (as `build --route`).
    #[arg(long, value_enum, default_value_t = Route::Patch)]
    route: Route,
    /// Only artifacts for this publish target (an empty plan is fine).
    #[arg(long, value_enum)]
    target: Option<ArtifactTarget>,
    /// text (a table), json (every detail), github (one line: `{"include":[…]}`
    /// for `strategy.matrix`) or gitlab (child-pipeline jobs extending `.imgbuild`)
    /// [default: --output's].
    #[arg(long, value_enum)]
    format: Option<PlanFormat>,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum PlanFormat {
    Text,
    Json,
    Github,
    Gitlab,
}

/// One planned job: the artifact, the inventory it comes from, its name and command.
struct Entry {
    name: String,
    config: String,
    command: String,
    artifact: Artifact,
}

pub fn run(args: PlanArgs, configs: &[PathBuf], output: Output) -> Result<()> {
    let format = args.format.unwrap_or(match output {
        Output::Text => PlanFormat::Text,
        Output::Json => PlanFormat::Json,
    });
    if output == Output::Json && matches!(format, PlanFormat::Text | PlanFormat::Gitlab) {
        // --output json promises one JSON document on stdout.
        return Err(Usage(
            "--format text and gitlab print text, not JSON: drop --output json|yaml or use --format json|github"
                .into(),
        )
        .into());
    }
    let mut entries: Vec<Entry> = Vec::new();
    for config in configs {
        let inv = load_inventory(config, output)?;
        let artifacts = plan::artifacts(&inv, args.route)
            .with_context(|| format!("{}: computing schematic IDs", config.display()))?;
        let config_word = config.to_string_lossy().into_owned();
        for artifact in artifacts {
            if args.target.is_some_and(|t| t != artifact.target) {
                continue;
            }
            let name = entry_name(&inv.cluster.name, &artifact);
            if let Some(other) = entries.iter().find(|e| e.name == name) {
                return Err(Usage(format!(
                    "{} and {} both plan {name}: give their clusters different names",
                    other.config,
                    config.display()
                ))
                .into());
            }
            entries.push(Entry {
                command: command(&config_word, args.route, &artifact),
                config: config_word.clone(),
                name,
                artifact,
            });
        }
    }
    match format {
        PlanFormat::Github => outln!("{}", github_matrix(&entries)?),
        PlanFormat::Gitlab => out!("{}", gitlab_jobs(&entries)?),
        PlanFormat::Json => {
            let list: Vec<Value> = entries
                .iter()
                .map(|e| {
                    let mut v = json!({"name": e.name, "config": e.config, "command": e.command});
                    if let (Value::Object(m), Ok(Value::Object(a))) =
                        (&mut v, serde_json::to_value(&e.artifact))
                    {
                        m.extend(a);
                    }
                    v
                })
                .collect();
            outln!("{}", json!({"artifacts": list}));
        }
        PlanFormat::Text => {
            for e in &entries {
                outln!("{:<48} {}", e.name, e.command);
            }
            outln!("{} artifact(s)", entries.len());
        }
    }
    Ok(())
}

/// `{"include":[{name, config, command}, …]}` on one line. Every value is
/// the inventory's path, a name made of cluster, node and IDs, or a command:
/// never a secret (those live in the environment of the job that runs it).
fn github_matrix(entries: &[Entry]) -> Result<String> {
    if entries.len() > GITHUB_MATRIX_LIMIT {
        anyhow::bail!(
            "the plan has {} artifacts, more than the {GITHUB_MATRIX_LIMIT} jobs a GitHub Actions matrix allows: \
             split it, e.g. one plan job per --config or per --target, each feeding its own matrix",
            entries.len()
        );
    }
    let include: Vec<Value> = entries
        .iter()
        .map(|e| json!({"name": e.name, "config": e.config, "command": e.command}))
        .collect();
    Ok(json!({ "include": include }).to_string())
}

/// GitLab child-pipeline jobs, one per entry, each extending the `.imgbuild`
/// template the pipeline defines (image, install, credentials). GitLab
/// refuses a pipeline without jobs, so an empty plan gets one that says so.
fn gitlab_jobs(entries: &[Entry]) -> Result<String> {
    use serde_yaml_ng::{Mapping, Value as Yaml};
    let mut jobs = Mapping::new();
    for e in entries {
        let mut job = Mapping::new();
        job.insert("extends".into(), ".imgbuild".into());
        job.insert(
            "script".into(),
            Yaml::Sequence(vec![e.command.clone().into()]),
        );
        jobs.insert(e.name.clone().into(), Yaml::Mapping(job));
    }
    if entries.is_empty() {
        let mut job = Mapping::new();
        job.insert(
            "script".into(),
            Yaml::Sequence(vec!["echo the imgbuild plan is empty".into()]),
        );
        jobs.insert("imgbuild-empty-plan".into(), Yaml::Mapping(job));
    }
    Ok(serde_yaml_ng::to_string(&jobs)?)
}

/// A name usable as a job name and as an artifact name (no `/`, `:` or spaces).
fn entry_name(cluster: &str, a: &Artifact) -> String {
    let short = &a.schematic_id.as_str()[..12];
    match a.kind {
        ArtifactKind::NodeImage => format!("{cluster}-{}", a.nodes[0]),
        ArtifactKind::BaseImage => format!(
            "{cluster}-base-{short}-{}-{}-{}-{}",
            a.talos_version,
            a.platform,
            a.arch,
            a.format.map_or("", |f| match f {
                ImageFormat::Raw => "raw",
                ImageFormat::Qcow2 => "qcow2",
                ImageFormat::Iso => "iso",
            })
        ),
        ArtifactKind::Snapshot => {
            format!("{cluster}-snapshot-{short}-{}-{}", a.talos_version, a.arch)
        }
    }
}

/// The command that builds (and, with a publish target, publishes) only
/// this artifact.
fn command(config: &str, route: Route, a: &Artifact) -> String {
    let mut words = vec![
        "imgbuild".to_owned(),
        "--config".to_owned(),
        shell_word(config),
    ];
    words.push(
        match a.target {
            ArtifactTarget::Files => "build",
            ArtifactTarget::Proxmox | ArtifactTarget::Hcloud => "publish",
        }
        .to_owned(),
    );
    if route == Route::Factory {
        words.push("--route".into());
        words.push("factory".into());
    }
    words.extend(a.command_nodes().iter().map(|n| shell_word(n)));
    words.join(" ")
}

/// `s` as one POSIX shell word: as it is when it is plain, else single-quoted.
fn shell_word(s: &str) -> String {
    let plain = !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./=:@+,".contains(&b));
    if plain {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::shell_word;

    #[test]
    fn shell_words_survive_spaces_and_quotes() {
        assert_eq!(shell_word("clusters/a.yaml"), "clusters/a.yaml");
        assert_eq!(shell_word("my cluster.yaml"), "'my cluster.yaml'");
        assert_eq!(shell_word("it's.yaml"), r"'it'\''s.yaml'");
        assert_eq!(shell_word("$HOME"), "'$HOME'");
        assert_eq!(shell_word(""), "''");
    }
}
