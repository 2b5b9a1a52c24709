//! A fresh runner (a CI checkout): the cluster's secrets come from the
//! SOPS file committed beside the inventory, or from nowhere. imgbuild
//! never makes secrets silently: without them, or without the age key that
//! opens them, every command that needs them stops with exit 2 before any
//! change (no request that changes anything, no file written), naming the
//! file, `SOPS_AGE_KEY_FILE` and the ways out; with the key the state dir
//! never holds them in clear. Nodes: the Talos node simulator (Talos
//! v1.11); machines: the Proxmox VE simulator.

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common;
use common::checkout::Checkout;
use common::inventory::Inventory;
use common::run::Run;
use common::sims::{Pve, Sim};
use common::text;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use serde_yaml_ng::Value;

/// The loopback /24 of scenario `k` (tests/common/net.rs).
fn net(k: u8) -> String {
    common::net::scenario(module_path!(), k)
}

/// The laptop's steps as the guide gives them (`secrets gen`, then
/// `secrets encrypt --age`), then what Git holds: the state dir is not
/// committed, so a fresh clone has only `secrets.sops.yaml`. Returns the
/// bundle in clear, for the tests to look for.
fn committed_secrets(c: &Checkout, recipient: &str) -> String {
    let said = c.seal(recipient);
    assert!(said.contains("no longer needed"), "{said}");
    let plain = std::fs::read_to_string(c.path("state/secrets.yaml")).unwrap();
    std::fs::remove_dir_all(c.path("state")).unwrap();
    plain
}

/// Both streams.
fn said(o: &Output) -> String {
    text(&o.stdout) + &text(&o.stderr)
}

/// Every file under `dir` (none when it does not exist).
fn files(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut all = Vec::new();
    for e in entries {
        let path = e.unwrap().path();
        if path.is_dir() {
            all.extend(files(&path));
        } else {
            all.push(path);
        }
    }
    all
}

/// Every secret of a bundle (`talosctl gen secrets` layout): each string
/// leaf but the CA certificates (public: a kubeconfig carries one), and of
/// each base64 PEM key its body lines as well, for a file that holds it
/// decoded.
fn secrets_of(bundle: &str) -> Vec<(String, String)> {
    fn walk(v: &Value, at: &str, out: &mut Vec<(String, String)>) {
        match v {
            Value::Mapping(m) => {
                for (k, v) in m {
                    let k = k.as_str().unwrap();
                    walk(v, &format!("{at}.{k}"), out);
                }
            }
            Value::String(s) if !at.ends_with(".crt") => {
                out.push((at.to_owned(), s.clone()));
                if let Ok(pem) = STANDARD.decode(s)
                    && let Ok(pem) = String::from_utf8(pem)
                {
                    for line in pem
                        .lines()
                        .filter(|l| l.len() >= 24 && !l.starts_with("-----"))
                    {
                        out.push((format!("{at} (PEM)"), line.to_owned()));
                    }
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(&serde_yaml_ng::from_str(bundle).unwrap(), "", &mut out);
    assert!(out.len() >= 10, "{out:?}");
    out
}

/// The secrets of `secrets` that a file under `dir` holds: (file, field).
fn in_clear(dir: &Path, secrets: &[(String, String)]) -> Vec<(PathBuf, String)> {
    let mut found = Vec::new();
    for file in files(dir) {
        let bytes = std::fs::read(&file).unwrap();
        for (at, value) in secrets {
            let v = value.as_bytes();
            if bytes.windows(v.len()).any(|w| w == v) {
                found.push((file.clone(), at.clone()));
            }
        }
    }
    found
}

#[test]
fn up_on_a_fresh_inventory_without_secrets_stops_before_any_request() {
    let net = net(0);
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("cluster.yaml");
    Inventory::five_nodes("fresh", &net)
        .metal("raw")
        .proxmox(true)
        .write_to(&config);
    let pve = Pve::start(&[]);
    let factory = Sim::start(&[]);
    let up = |extra: &[&str]| {
        let mut run = Run::with_config(&config, &["up"]);
        run.args(extra)
            .timeouts(&[])
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .env_remove("IMGBUILD_STATE_DIR")
            .env_remove("TALOSCONFIG")
            .env_remove("SOPS_AGE_KEY")
            .env_remove("SOPS_AGE_KEY_FILE")
            .env("HOME", dir.path())
            .proxmox(&pve)
            .factory(&factory)
            .folders(dir.path())
            .output()
    };
    let sealed = dir.path().join("secrets.sops.yaml");
    let clear = dir.path().join("state/secrets.yaml");
    for extra in [&[][..], &["--dry-run"], &["--output", "json"]] {
        let o = up(extra);
        let out = said(&o);
        assert_eq!(o.status.code(), Some(2), "up {extra:?}: {out}");
        for needed in [
            "no cluster secrets",
            &sealed.display().to_string(),
            &clear.display().to_string(),
            "imgbuild secrets gen",
            "imgbuild secrets encrypt --age",
            "--new-secrets",
        ] {
            assert!(out.contains(needed), "up {extra:?}: {needed:?} in {out}");
        }
    }
    // Nothing was asked of Proxmox or the factory, nothing was written.
    let stats = pve.idle_stats();
    assert_eq!(stats["requests"], 0, "{stats}");
    assert_eq!(factory.image_gets(), 0);
    assert_eq!(factory.posted_schematics(), serde_json::json!({}));
    let left: Vec<PathBuf> = files(dir.path())
        .into_iter()
        .filter(|f| f != &config)
        .collect();
    assert_eq!(left, Vec::<PathBuf>::new(), "written by a refused up");

    // The way out for a new cluster: a dry run says it would make them
    // and writes none; then `up --new-secrets` makes them.
    let o = up(&["--dry-run", "--new-secrets"]);
    let out = said(&o);
    assert_eq!(o.status.code(), Some(0), "{out}");
    assert!(
        out.contains(&format!(
            "the cluster has no secrets yet: `up --new-secrets` makes them into {}",
            clear.display()
        )),
        "{out}"
    );
    assert!(!clear.exists(), "a dry run wrote secrets");
    assert!(
        files(dir.path())
            .iter()
            .all(|f| !f.ends_with("secrets.yaml")),
        "{:?}",
        files(dir.path())
    );
}

/// Every command that needs the cluster's secrets.
const NEED_SECRETS: &[&[&str]] = &[
    &["up"],
    &["up", "--dry-run"],
    &["up", "--new-secrets"],
    &["bootstrap"],
    &["bootstrap", "--new-secrets"],
    &["config", "cp-01"],
    &["apply"],
    &["apply", "--dry-run"],
    &["upgrade"],
    &["etcd", "snapshot"],
    &["talosconfig"],
    &["kubeconfig"],
    &["status"],
    &["--output", "json", "up"],
    &["--output", "json", "bootstrap"],
];

#[test]
fn without_the_age_key_every_command_that_needs_secrets_stops_naming_the_file() {
    let c = Checkout::new("fresh", &net(1));
    let (key, recipient) = c.keygen("key.txt");
    let (other, _) = c.keygen("other.txt");
    committed_secrets(&c, &recipient);
    let sealed = c.path("secrets.sops.yaml");
    let sealed_text = std::fs::read(&sealed).unwrap();
    let sim = c.nodes();
    // No key at all, then a key that is no recipient's.
    for env in [&[][..], &[("SOPS_AGE_KEY_FILE", other.as_path())]] {
        for args in NEED_SECRETS {
            let o = c.imgbuild(args, env);
            let out = said(&o);
            assert_eq!(o.status.code(), Some(2), "{args:?} {env:?}: {out}");
            assert!(
                out.contains(&sealed.display().to_string()) && out.contains("SOPS_AGE_KEY_FILE"),
                "{args:?} {env:?}: {out}"
            );
            assert!(out.contains(&recipient), "the recipients: {out}");
        }
    }
    // Nothing generated, nothing changed: no state dir, no node touched.
    assert!(!c.path("state").exists(), "{:?}", files(&c.path("state")));
    assert!(!c.path("out").exists());
    assert_eq!(std::fs::read(&sealed).unwrap(), sealed_text);
    let stats = sim.stats();
    assert_eq!(stats["totals"]["applies"], 0, "{stats}");
    assert_eq!(stats["totals"]["bootstraps"], 0, "{stats}");
    // `validate` needs no secrets: a CI job without the key checks the
    // inventory with throwaway ones.
    let o = c.imgbuild(&["--output", "json", "validate"], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", said(&o));
    assert_eq!(common::json(&o)["throwawaySecrets"], true);
    assert!(!c.path("state").exists());
    // With it, the same checkout works (the refusals were the key's).
    let o = c.imgbuild(&["config", "cp-01"], &[("SOPS_AGE_KEY_FILE", &key)]);
    assert_eq!(o.status.code(), Some(0), "{}", said(&o));
}

#[test]
fn with_the_key_the_state_dir_never_holds_a_secret_in_clear() {
    let c = Checkout::new("fresh", &net(2));
    let (key, recipient) = c.keygen("key.txt");
    let plain = committed_secrets(&c, &recipient);
    let secrets = secrets_of(&plain);
    let _sim = c.nodes();
    let with_key = [("SOPS_AGE_KEY_FILE", key.as_path())];
    let state = c.path("state");
    let commands: &[&[&str]] = &[
        &["up", "--dry-run"],
        // A no-op: the cluster has its secrets.
        &["bootstrap", "--new-secrets"],
        &["config", "cp-01"],
        &["up", "--dry-run"],
        &["up"],
        &["apply"],
        &["status"],
        &["etcd", "snapshot"],
        // Minted into the user's kubeconfig (HOME is the checkout's).
        &["kubeconfig", "--merge"],
        &["--output", "json", "bootstrap"],
    ];
    for args in commands {
        let o = c.imgbuild(args, &with_key);
        let out = said(&o);
        assert_eq!(o.status.code(), Some(0), "{args:?}: {out}");
        let leaked = in_clear(&state, &secrets);
        assert_eq!(leaked, Vec::new(), "after {args:?}");
        assert!(!state.join("secrets.yaml").exists(), "after {args:?}");
        assert!(
            !state.join("talosconfig").exists(),
            "a client key in clear after {args:?}"
        );
        // Printed configs hold `cluster.id` (Talos shows it: discovery).
        for (at, v) in secrets.iter().filter(|(at, _)| at != ".cluster.id") {
            assert!(!out.contains(v.as_str()), "{args:?} shows {at}: {out}");
        }
    }
    // The bootstrap used the committed secrets: its CA is theirs.
    let o = c.imgbuild(&["--output", "json", "bootstrap"], &with_key);
    let v = common::json(&o);
    assert_eq!(v["healthy"], true, "{v}");
    assert_eq!(
        v["secrets"],
        c.path("secrets.sops.yaml").display().to_string()
    );
    assert_eq!(v["talosconfig"], serde_json::Value::Null, "{v}");
    // `imgbuild talosconfig` writes one where the user asks, from them.
    let o = c.imgbuild(&["talosconfig"], &with_key);
    assert_eq!(o.status.code(), Some(0), "{}", said(&o));
    let doc: Value = serde_yaml_ng::from_str(&plain).unwrap();
    let tc = std::fs::read_to_string(state.join("talosconfig")).unwrap();
    assert!(tc.contains(doc["certs"]["os"]["crt"].as_str().unwrap()));
    // The kubeconfig goes only into the user's own file.
    let o = c.imgbuild(&["kubeconfig"], &with_key);
    assert_eq!(o.status.code(), Some(2), "{}", said(&o));
    assert!(said(&o).contains("kubeconfig --merge"), "{}", said(&o));
    assert!(!state.join("kubeconfig").exists());
}

#[test]
fn a_sops_file_and_a_different_state_dir_bundle_are_refused_naming_both() {
    let c = Checkout::new("fresh", &net(3));
    let (key, recipient) = c.keygen("key.txt");
    let plain = committed_secrets(&c, &recipient);
    let with_key = [("SOPS_AGE_KEY_FILE", key.as_path())];
    // The laptop's state dir holds other secrets than Git (made elsewhere:
    // `secrets gen` beside the SOPS file refuses).
    let elsewhere = c.path("elsewhere");
    std::fs::rename(c.path("secrets.sops.yaml"), c.path("moved.sops.yaml")).unwrap();
    let o = c.imgbuild(
        &["secrets", "gen", "--state-dir", elsewhere.to_str().unwrap()],
        &[],
    );
    assert!(o.status.success(), "{}", said(&o));
    std::fs::rename(c.path("moved.sops.yaml"), c.path("secrets.sops.yaml")).unwrap();
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(c.path("state"))
        .unwrap();
    std::fs::copy(elsewhere.join("secrets.yaml"), c.path("state/secrets.yaml")).unwrap();
    let sealed = c.path("secrets.sops.yaml");
    let clear = c.path("state/secrets.yaml");
    let before = std::fs::read(&clear).unwrap();
    for args in [
        &["config", "cp-01"][..],
        &["bootstrap"],
        &["up", "--dry-run"],
    ] {
        let o = c.imgbuild(args, &with_key);
        let out = said(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {out}");
        assert!(
            out.contains("two different cluster secrets")
                && out.contains(&sealed.display().to_string())
                && out.contains(&clear.display().to_string()),
            "{args:?}: {out}"
        );
    }
    assert_eq!(std::fs::read(&clear).unwrap(), before);
    // The same bundle in both places is no conflict: the SOPS file is read.
    std::fs::write(&clear, &plain).unwrap();
    let o = c.imgbuild(&["config", "cp-01"], &with_key);
    assert_eq!(o.status.code(), Some(0), "{}", said(&o));
}

#[test]
fn the_inventory_names_its_secrets_file() {
    let c = Checkout::new("fresh", &net(4));
    let (key, recipient) = c.keygen("key.txt");
    let inv = std::fs::read_to_string(c.path("cluster.yaml")).unwrap();
    let named = inv.replacen(
        "cluster:\n",
        "cluster:\n  secretsFile: secrets/fresh.sops.yaml\n",
        1,
    );
    assert_ne!(named, inv);
    std::fs::write(c.path("cluster.yaml"), &named).unwrap();
    std::fs::create_dir(c.path("secrets")).unwrap();
    // `secrets encrypt` writes where the inventory says, and imgbuild reads it.
    let o = c.imgbuild(&["secrets", "gen"], &[]);
    assert!(o.status.success(), "{}", said(&o));
    let o = c.imgbuild(&["secrets", "encrypt", "--age", &recipient], &[]);
    assert!(o.status.success(), "{}", said(&o));
    let file = c.path("secrets/fresh.sops.yaml");
    assert!(file.is_file());
    std::fs::remove_dir_all(c.path("state")).unwrap();
    let o = c.imgbuild(&["config", "cp-01"], &[]);
    let out = said(&o);
    assert_eq!(o.status.code(), Some(2), "{out}");
    assert!(out.contains(&file.display().to_string()), "{out}");
    let o = c.imgbuild(&["config", "cp-01"], &[("SOPS_AGE_KEY_FILE", &key)]);
    assert_eq!(o.status.code(), Some(0), "{}", said(&o));
    // A path outside the inventory's folder is an invalid inventory.
    std::fs::write(
        c.path("cluster.yaml"),
        inv.replacen(
            "cluster:\n",
            "cluster:\n  secretsFile: ../elsewhere.yaml\n",
            1,
        ),
    )
    .unwrap();
    let o = c.imgbuild(&["validate"], &[]);
    let out = said(&o);
    assert_eq!(o.status.code(), Some(2), "{out}");
    assert!(out.contains("cluster.secretsFile"), "{out}");
}

#[test]
fn a_node_from_other_secrets_names_the_secrets_file_in_use() {
    let c = Checkout::new("fresh", &net(5));
    let (key, recipient) = c.keygen("key.txt");
    committed_secrets(&c, &recipient);
    let sim = c.nodes();
    let with_key = [("SOPS_AGE_KEY_FILE", key.as_path())];
    let o = c.imgbuild(&["bootstrap"], &with_key);
    assert_eq!(o.status.code(), Some(0), "{}", said(&o));
    // Git's file now holds another bundle (a runner made its own, with
    // the SOPS file moved away: beside it `secrets gen` refuses).
    std::fs::rename(c.path("secrets.sops.yaml"), c.path("moved.sops.yaml")).unwrap();
    let o = c.imgbuild(&["secrets", "gen"], &[]);
    assert!(o.status.success(), "{}", said(&o));
    let o = c.imgbuild(&["secrets", "encrypt", "--force", "--age", &recipient], &[]);
    assert!(o.status.success(), "{}", said(&o));
    std::fs::remove_file(c.path("state/secrets.yaml")).unwrap();
    let applies = sim.stats()["totals"]["applies"].clone();
    let o = c.imgbuild(&["bootstrap"], &with_key);
    let out = said(&o);
    assert!(matches!(o.status.code(), Some(1 | 3)), "{out}");
    assert!(out.contains("configured by someone else"), "{out}");
    let sealed = c.path("secrets.sops.yaml");
    assert!(
        out.contains(&format!(
            "a different CA than the cluster secrets in use ({} (SOPS))",
            sealed.display()
        )),
        "{out}"
    );
    assert!(out.contains("SOPS_AGE_KEY_FILE"), "{out}");
    assert_eq!(sim.stats()["totals"]["applies"], applies, "nothing applied");
}

/// Beside the cluster's SOPS file `secrets gen` makes nothing (the new
/// bundle would be another cluster's), `secrets encrypt --force` adds a
/// recipient from the SOPS file itself, and a FIFO or a folder in the SOPS
/// file's place is refused as such, never taken for "no secrets yet".
#[test]
fn the_sops_file_is_never_replaced_by_new_secrets_and_takes_new_recipients() {
    let c = Checkout::new("fresh", &net(6));
    let (key, recipient) = c.keygen("key.txt");
    let (other_key, other) = c.keygen("other.txt");
    let plain = committed_secrets(&c, &recipient);
    let sealed = c.path("secrets.sops.yaml");
    let before = std::fs::read(&sealed).unwrap();
    let with_key = [("SOPS_AGE_KEY_FILE", key.as_path())];

    let o = c.imgbuild(&["secrets", "gen"], &with_key);
    assert_eq!(o.status.code(), Some(2), "{}", said(&o));
    assert!(
        said(&o).contains("would make another cluster's"),
        "{}",
        said(&o)
    );
    assert!(!c.path("state/secrets.yaml").exists());

    // A second recipient, from the SOPS file (no clear copy anywhere).
    let o = c.imgbuild(
        &[
            "secrets", "encrypt", "--force", "--age", &recipient, "--age", &other,
        ],
        &with_key,
    );
    assert_eq!(o.status.code(), Some(0), "{}", said(&o));
    assert_ne!(std::fs::read(&sealed).unwrap(), before);
    assert!(!c.path("state/secrets.yaml").exists());
    let o = c.imgbuild(
        &["config", "cp-01"],
        &[("SOPS_AGE_KEY_FILE", other_key.as_path())],
    );
    assert_eq!(o.status.code(), Some(0), "{}", said(&o));
    let doc: Value = serde_yaml_ng::from_str(&plain).unwrap();
    let ca = doc["certs"]["os"]["crt"].as_str().unwrap();
    assert!(
        text(&o.stdout).contains(ca),
        "the new recipient opens the same bundle"
    );

    // Not a file where the SOPS file goes.
    std::fs::rename(&sealed, c.path("kept.sops.yaml")).unwrap();
    let fifo = Command::new("mkfifo").arg(&sealed).status().unwrap();
    assert!(fifo.success());
    for folder in [false, true] {
        if folder {
            std::fs::remove_file(&sealed).unwrap();
            std::fs::create_dir(&sealed).unwrap();
        }
        let o = c.imgbuild(&["up", "--dry-run", "--new-secrets"], &with_key);
        assert_eq!(o.status.code(), Some(2), "{}", said(&o));
        assert!(said(&o).contains("is not a regular file"), "{}", said(&o));
        assert!(!said(&o).contains("secrets gen"), "{}", said(&o));
    }
}
