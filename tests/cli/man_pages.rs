//! `imgbuild man --dir DIR`: one manual page per command, as `man
//! imgbuild-up` finds it, each with every flag that command's `--help`
//! lists. The commands and flags come from `--help` (clap's help renderer,
//! not the man page's), the page as man-db renders it.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use crate::common;
use common::{imgbuild, text};

/// The subcommands `--help` lists for `path` (without `help`).
fn subcommands(help: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut inside = false;
    for line in help.lines() {
        if line == "Commands:" {
            inside = true;
        } else if inside && line.trim().is_empty() {
            break;
        } else if inside && line.starts_with("  ") && !line.starts_with("   ") {
            let name = line.split_whitespace().next().unwrap();
            if name != "help" {
                out.push(name.to_owned());
            }
        }
    }
    out
}

/// The long flags (and `-o`-style short ones) `--help` lists in its options.
fn flags(help: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut inside = false;
    for line in help.lines() {
        if line == "Options:" {
            inside = true;
            continue;
        }
        if !inside {
            continue;
        }
        // An option line: "  -o, --output <OUTPUT>" or "      --config <CONFIG>".
        let t = line.trim_start();
        if line.len() - t.len() > 6 || !t.starts_with('-') {
            continue;
        }
        for word in t.split([' ', ',']) {
            if word.starts_with('-') && word.len() > 1 && !word.contains('<') {
                out.insert(word.to_owned());
            }
        }
    }
    out
}

/// Every command path under `imgbuild` with its `--help`, depth first.
fn commands() -> Vec<(Vec<String>, String)> {
    let mut out = Vec::new();
    let mut todo = vec![Vec::<String>::new()];
    while let Some(path) = todo.pop() {
        let mut args: Vec<&str> = path.iter().map(String::as_str).collect();
        args.push("--help");
        let o = imgbuild(&args);
        assert!(o.status.success(), "{args:?}: {}", text(&o.stderr));
        let help = text(&o.stdout);
        for sub in subcommands(&help) {
            let mut p = path.clone();
            p.push(sub);
            todo.push(p);
        }
        out.push((path, help));
    }
    out
}

/// The page as `man -l` renders it, wide enough that no flag is broken.
fn rendered(page: &Path) -> String {
    let o = Command::new("man")
        .arg("-l")
        .arg(page)
        .env("MANPAGER", "cat")
        .env("MANWIDTH", "250")
        .env_remove("MAN_KEEP_FORMATTING")
        .output()
        .expect("man is installed (make deps)");
    assert!(
        o.status.success(),
        "{}: {}",
        page.display(),
        text(&o.stderr)
    );
    // No hyphenation marks or overstrike: the words as typed.
    text(&o.stdout).replace('\u{2010}', "-")
}

#[test]
fn every_command_has_a_page_listing_every_flag_its_help_lists() {
    let dir = tempfile::tempdir().unwrap();
    let o = imgbuild(&[
        "man",
        "--dir",
        dir.path().to_str().unwrap(),
        "--output",
        "json",
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let written: BTreeSet<String> = doc["pages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap().to_owned())
        .collect();

    let commands = commands();
    assert!(commands.len() > 30, "{} commands", commands.len());
    let mut expected = BTreeSet::new();
    for (path, help) in &commands {
        let name = std::iter::once("imgbuild")
            .chain(path.iter().map(String::as_str))
            .collect::<Vec<_>>()
            .join("-");
        let page = dir.path().join(format!("{name}.1"));
        expected.insert(page.to_str().unwrap().to_owned());
        assert!(page.is_file(), "no page for `{}`", path.join(" "));
        let shown = rendered(&page);
        assert!(
            shown.contains(&format!("{name} - ")),
            "{name}: NAME section\n{shown}"
        );
        let wanted = flags(help);
        assert!(wanted.contains("--output"), "{path:?}: {wanted:?}");
        for flag in &wanted {
            let listed = shown
                .split(|c: char| c.is_whitespace() || c == ',' || c == '[' || c == ']' || c == '|')
                .any(|w| w == flag);
            assert!(listed, "{name}.1 does not list {flag}:\n{shown}");
        }
    }
    assert_eq!(written, expected);

    // A second run writes the same pages and changes none of them.
    let before: Vec<_> = expected
        .iter()
        .map(|p| std::fs::metadata(p).unwrap().modified().unwrap())
        .collect();
    let o = imgbuild(&["man", "--dir", dir.path().to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(text(&o.stdout).lines().count(), expected.len());
    let after: Vec<_> = expected
        .iter()
        .map(|p| std::fs::metadata(p).unwrap().modified().unwrap())
        .collect();
    assert_eq!(before, after);
}

/// Without --dir: the one page on stdout, as `make install` uses it.
#[test]
fn without_dir_the_program_page_goes_to_stdout() {
    let o = imgbuild(&["man"]);
    assert!(o.status.success());
    let page = text(&o.stdout);
    assert!(page.contains("\n.TH imgbuild 1 "), "{page}");
    assert!(page.contains("\\-\\-config"), "{page}");
}
