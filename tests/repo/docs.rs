//! The README keeps its promises: it opens with what imgbuild is and the
//! two set-up commands, documents every inventory key with its default, and
//! the CHANGELOG follows Keep a Changelog.

use serde_json::Value;

use crate::common;
use common::root;

fn readme() -> String {
    std::fs::read_to_string(root().join("README.md")).unwrap()
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
cluster: {name: c, talosVersion: v1.11.2, kubernetesVersion: v1.32.1, endpoint: "https://10.0.0.2:6443", vip: 10.0.0.2, kubernetesEndpoint: "https://127.0.0.1:6443"}
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
fn the_readme_documents_every_inventory_key_with_its_default() {
    let text = readme();
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
            .unwrap_or_else(|| panic!("README.md's inventory table lacks `{key}`"));
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
