//! `imgbuild cleanup --dry-run`: what `cleanup` would delete, found as
//! `cleanup` finds it, and nothing deleted. The test holds the dry run to
//! what the real `cleanup` then deletes, on the Hetzner simulator.

use std::collections::BTreeSet;

use serde_json::{Value, json};

use crate::common;
use common::run::Run;
use common::sims::Hc;
use common::{json, text};

/// (kind, id, name) of each entry of a cleanup document's `list`.
fn entries(doc: &Value, list: &str) -> BTreeSet<(String, u64, String)> {
    doc[list]
        .as_array()
        .unwrap_or_else(|| panic!("no {list} in {doc}"))
        .iter()
        .map(|e| {
            (
                e["kind"].as_str().unwrap().to_owned(),
                e["id"].as_u64().unwrap(),
                e["name"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// Every server and SSH key in the simulator, as (kind, id, name).
fn everything(hc: &Hc) -> BTreeSet<(String, u64, String)> {
    let mut all = BTreeSet::new();
    for (kind, path, key) in [
        ("server", "/servers", "servers"),
        ("ssh_key", "/ssh_keys", "ssh_keys"),
    ] {
        let (status, _, v) = hc.call("GET", path, None);
        assert_eq!(status, 200, "{v}");
        for item in v[key].as_array().unwrap() {
            all.insert((
                kind.to_owned(),
                item["id"].as_u64().unwrap(),
                item["name"].as_str().unwrap().to_owned(),
            ));
        }
    }
    all
}

fn cleanup(hc: &Hc, args: &[&str]) -> std::process::Output {
    Run::new(&["cleanup"]).args(args).hcloud(hc).output()
}

/// Two killed runs' servers and key, and what imgbuild must never touch:
/// a server without imgbuild's labels and one with a run label but not
/// imgbuild's `managed-by`.
fn leftovers(hc: &Hc) {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("k");
    let o = std::process::Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(&key)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let public = std::fs::read_to_string(key.with_extension("pub")).unwrap();
    let run = |id: &str| json!({"managed-by": "imgbuild", "imgbuild-run": id, "imgbuild-started": "1000000000"});
    let create = |path: &str, body: Value| {
        let (status, _, v) = hc.call("POST", path, Some(body));
        assert_eq!(status, 201, "{v}");
    };
    let server = |name: &str, labels: Value| {
        create(
            "/servers",
            json!({"name": name, "server_type": "cx23", "image": "debian-13",
                "location": "fsn1", "labels": labels}),
        )
    };
    server("imgbuild-killed-1", run("0123456789abcdef"));
    server("imgbuild-killed-2", run("fedcba9876543210"));
    create(
        "/ssh_keys",
        json!({"name": "imgbuild-key", "public_key": public.trim(), "labels": run("0123456789abcdef")}),
    );
    server("someone-elses", json!({"team": "infra"}));
    server(
        "lookalike",
        json!({"imgbuild-run": "0123456789abcdef", "imgbuild-started": "1000000000"}),
    );
}

#[test]
fn a_dry_run_lists_exactly_what_cleanup_then_deletes_and_deletes_nothing() {
    let hc = Hc::start(&[]);
    leftovers(&hc);
    let before = everything(&hc);
    assert_eq!(before.len(), 5, "{before:?}");

    // Everything the simulator made was made just now: a cleanup of only
    // older resources would delete nothing, and its dry run says so.
    let o = cleanup(
        &hc,
        &["--dry-run", "--older-than", "1h", "--output", "json"],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let dry = json(&o);
    assert_eq!(dry["dryRun"], true, "{dry}");
    assert!(entries(&dry, "wouldDelete").is_empty(), "{dry}");

    let o = cleanup(&hc, &["--dry-run", "--output", "json"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let would = entries(&json(&o), "wouldDelete");
    let names: BTreeSet<&str> = would.iter().map(|(_, _, n)| n.as_str()).collect();
    assert_eq!(
        names,
        BTreeSet::from(["imgbuild-killed-1", "imgbuild-killed-2", "imgbuild-key"]),
        "{would:?}"
    );
    assert_eq!(everything(&hc), before, "the dry run deleted something");

    // The same in text, one line per resource.
    let o = cleanup(&hc, &["--dry-run"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let shown = text(&o.stdout);
    for (kind, id, name) in &would {
        let line = format!("would delete {} {id} ({name})", kind.replace('_', " "));
        assert!(shown.lines().any(|l| l == line), "{line}\n{shown}");
    }
    assert_eq!(shown.lines().count(), would.len(), "{shown}");
    assert_eq!(everything(&hc), before, "the dry run deleted something");

    // The real cleanup deletes exactly what the dry run listed.
    let o = cleanup(&hc, &["--output", "json"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let deleted = entries(&json(&o), "deleted");
    assert_eq!(deleted, would);
    let after = everything(&hc);
    assert_eq!(
        before.difference(&after).cloned().collect::<BTreeSet<_>>(),
        would
    );

    // Nothing left to do: the dry run says so.
    let o = cleanup(&hc, &["--dry-run"]);
    assert!(o.status.success());
    assert!(
        text(&o.stdout).starts_with("nothing to delete"),
        "{}",
        text(&o.stdout)
    );
}
