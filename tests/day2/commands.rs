//! End to end: `imgbuild upgrade` against the node and factory simulators:
//! 3 control planes and 2 workers bootstrapped at v1.11.2, the inventory
//! moved to v1.11.5.

use std::path::Path;
use std::process::{Command, Output};

use crate::common;
use common::inventory::{Inventory, NODES};
use common::run::Run;
use common::sims::{Nodes, Sim};
use common::{json, text};

/// This file's loopback /24 (tests/common/net.rs).
fn net() -> String {
    common::net::block(module_path!())
}

fn imgbuild(config: &Path, args: &[&str], limits: bool) -> Output {
    let mut run = Run::with_config(config, args);
    if limits {
        run.timeouts(&[]);
    }
    run.env_remove("IMGBUILD_STATE_DIR")
        .env_remove("IMGBUILD_FACTORY")
        .env_remove("TALOSCONFIG")
        .output()
}

fn upgrades(nodes: &Nodes) -> Vec<u64> {
    let stats = nodes.stats();
    NODES
        .iter()
        .map(|(n, _, _)| stats["nodes"][n]["day2"]["upgrades"].as_u64().unwrap())
        .collect()
}

fn post(url: &str, body: &str) {
    let o = Command::new("curl")
        .args(["-sf", "-X", "POST", "-H", "content-type: application/json"])
        .args(["-d", body, url])
        .output()
        .unwrap();
    assert!(o.status.success(), "{url}: {}", text(&o.stderr));
}

#[test]
fn upgrade_keeps_schematics_goes_one_node_at_a_time_and_resumes() {
    let factory = Sim::start_with(&[], 0, &["--versions", "v1.11.2,v1.11.5"]);
    let net = net();
    let nodes = Nodes::cluster(
        &net,
        true,
        &["--reboot-delay", "300", "--upgrade-delay", "50"],
    );
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("cluster.yaml");

    // A version the factory does not offer is refused before any node is
    // contacted: the nodes are still in maintenance mode and nothing is
    // written, not even the secrets.
    Inventory::five_nodes("sim", &net)
        .talos("v1.11.9")
        .factory(&factory.url)
        .write(dir.path());
    // Without the cluster's secrets it stops first, exit 2.
    let o = imgbuild(&config, &["upgrade"], true);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    assert!(!dir.path().join(".talos").exists());
    let o = imgbuild(&config, &["secrets", "gen"], false);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let o = imgbuild(&config, &["upgrade"], true);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("v1.11.9"), "{}", text(&o.stderr));
    assert_eq!(nodes.stats()["totals"]["applies"], 0);

    Inventory::five_nodes("sim", &net)
        .talos("v1.11.2")
        .factory(&factory.url)
        .write(dir.path());
    let o = imgbuild(
        &config,
        &["--output", "json", "bootstrap", "--new-secrets"],
        true,
    );
    assert!(o.status.success(), "{}", text(&o.stderr));

    Inventory::five_nodes("sim", &net)
        .talos("v1.11.5")
        .factory(&factory.url)
        .write(dir.path());
    // --dry-run: every node from → to, no Upgrade sent.
    let o = imgbuild(&config, &["--output", "json", "upgrade", "--dry-run"], true);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let plan = json(&o);
    let rows = plan["nodes"].as_array().unwrap();
    assert_eq!(
        rows.iter()
            .map(|r| r["node"].as_str().unwrap())
            .collect::<Vec<_>>(),
        ["cp-01", "cp-02", "cp-03", "worker-01", "worker-02"]
    );
    for r in rows {
        assert_eq!(r["from"]["version"], "v1.11.2", "{r}");
        assert_eq!(r["to"]["version"], "v1.11.5", "{r}");
        assert_eq!(r["upgrade"], true, "{r}");
    }
    assert_eq!(upgrades(&nodes), [0, 0, 0, 0, 0]);

    // The base schematic the factory now knows: every installer names it.
    let posted = factory.posted_schematics();
    let ids: Vec<&String> = posted.as_object().unwrap().keys().collect();
    assert_eq!(
        ids.len(),
        1,
        "one base schematic for nodes without own extensions: {posted}"
    );
    let host = factory
        .url
        .trim_start_matches("http://")
        .trim_end_matches('/');
    let installer = format!("{host}/metal-installer/{}:v1.11.5", ids[0]);
    assert_eq!(rows[0]["to"]["installer"], installer.as_str());

    // worker-01's installer fails after the ack.
    post(
        &format!("{}/_sim/installer", nodes.control),
        r#"{"node":"worker-01","fail":true}"#,
    );
    let o = imgbuild(&config, &["--output", "json", "upgrade"], true);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o.stderr));
    let run = json(&o);
    assert_eq!(run["failed"]["node"], "worker-01", "{run}");
    assert!(
        run["failed"]["error"].as_str().unwrap().contains("v1.11.2"),
        "{run}"
    );
    assert_eq!(
        run["upgraded"],
        serde_json::json!(["cp-01", "cp-02", "cp-03"])
    );
    assert_eq!(run["untouched"], serde_json::json!(["worker-02"]));
    assert_eq!(upgrades(&nodes), [1, 1, 1, 1, 0]);
    let stats = nodes.stats();
    let events = stats["upgrades"].as_array().unwrap();
    // Control planes first, one at a time: each is back before the next
    // goes down, and all are back before any worker is asked.
    for w in events.windows(2) {
        assert!(
            w[0]["up_ms"].as_u64() <= w[1]["down_ms"].as_u64(),
            "two nodes down at once: {w:?}"
        );
    }
    assert_eq!(
        events
            .iter()
            .map(|e| e["node"].as_str().unwrap())
            .collect::<Vec<_>>(),
        ["cp-01", "cp-02", "cp-03", "worker-01"]
    );
    for (name, _, _) in NODES {
        for image in stats["nodes"][name]["day2"]["installers"]
            .as_array()
            .unwrap()
        {
            assert_eq!(image, installer.as_str(), "{name}");
        }
    }
    assert_eq!(stats["nodes"]["worker-01"]["day2"]["version"], "v1.11.2");
    assert_eq!(stats["nodes"]["worker-02"]["day2"]["version"], "v1.11.2");

    // The rerun upgrades only the nodes not yet done.
    post(
        &format!("{}/_sim/installer", nodes.control),
        r#"{"node":"worker-01","fail":false}"#,
    );
    let o = imgbuild(&config, &["--output", "json", "upgrade"], true);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let run = json(&o);
    assert_eq!(
        run["upgraded"],
        serde_json::json!(["worker-01", "worker-02"])
    );
    assert_eq!(upgrades(&nodes), [1, 1, 1, 2, 1]);
    for (name, _, _) in NODES {
        assert_eq!(run["versions"][name], "v1.11.5", "{run}");
    }

    // The state dir records what each node got (for nodes that cannot say).
    let record: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.path().join(".talos/sim/upgrades.json")).unwrap(),
    )
    .unwrap();
    for (name, _, _) in NODES {
        assert_eq!(
            record["nodes"][name]["installer"],
            installer.as_str(),
            "{record}"
        );
    }

    // A further rerun sends nothing.
    let o = imgbuild(&config, &["--output", "json", "upgrade"], true);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(json(&o)["upgraded"], serde_json::json!([]));
    assert_eq!(upgrades(&nodes), [1, 1, 1, 2, 1]);

    // After the upgrade every node's config is the rendered one.
    let (v, code) = apply(&config, &["--dry-run"]);
    assert_eq!(code, Some(0), "{v}");
    assert_eq!(changed(&v), [false; 5], "{v}");
    assert_eq!(status_check(&config), Some(0));

    // A worker patch: shown on the two workers only, nothing applied.
    std::fs::write(
        dir.path().join("worker.yaml"),
        "machine:\n  sysctls:\n    vm.max_map_count: \"262144\"\n",
    )
    .unwrap();
    std::fs::write(
        &config,
        Inventory::five_nodes("sim", &net)
            .talos("v1.11.5")
            .factory(&factory.url)
            .append("patches:\n  worker: [worker.yaml]\n")
            .text(),
    )
    .unwrap();
    let applies_before = nodes.stats()["totals"]["applies"].as_u64().unwrap();
    let (v, code) = apply(&config, &["--dry-run"]);
    assert_eq!(code, Some(0), "{v}");
    assert_eq!(changed(&v), [false, false, false, true, true], "{v}");
    for n in &v["nodes"].as_array().unwrap()[3..] {
        assert!(
            n["diff"].as_str().unwrap().contains("vm.max_map_count"),
            "{n}"
        );
        assert_eq!(n["applied"], false);
    }
    assert_eq!(nodes.stats()["totals"]["applies"], applies_before);
    // status --check: config drift on the workers.
    assert_eq!(status_check(&config), Some(1));

    // apply changes exactly those two; a rerun applies nothing.
    let (v, code) = apply(&config, &[]);
    assert_eq!(code, Some(0), "{v}");
    let applied: Vec<bool> = v["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["applied"] == true)
        .collect();
    assert_eq!(applied, [false, false, false, true, true], "{v}");
    assert_eq!(
        nodes.stats()["totals"]["applies"].as_u64().unwrap(),
        applies_before + 2
    );
    let (v, _) = apply(&config, &[]);
    assert_eq!(changed(&v), [false; 5], "{v}");
    assert_eq!(
        nodes.stats()["totals"]["applies"].as_u64().unwrap(),
        applies_before + 2
    );
    assert_eq!(status_check(&config), Some(0));

    // A version drift: the inventory moves on, status --check fails.
    std::fs::write(
        &config,
        Inventory::five_nodes("sim", &net)
            .talos("v1.11.6")
            .factory(&factory.url)
            .append("patches:\n  worker: [worker.yaml]\n")
            .text(),
    )
    .unwrap();
    let o = imgbuild(&config, &["--output", "json", "status", "--check"], true);
    assert_eq!(o.status.code(), Some(1));
    let drift = &json(&o)["drift"];
    // Every node: its version, and its config (install.image names the new
    // installer), each with the command that fixes it.
    let drift: Vec<(&str, &str, &str)> = drift
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            (
                d["node"].as_str().unwrap(),
                d["what"].as_str().unwrap(),
                d["fix"].as_str().unwrap(),
            )
        })
        .collect();
    for (name, _, _) in NODES {
        assert!(
            drift.contains(&(name, "version", "imgbuild upgrade")),
            "{drift:?}"
        );
        assert!(
            drift.contains(&(name, "config", "imgbuild apply")),
            "{drift:?}"
        );
    }
    assert_eq!(drift.len(), 10, "{drift:?}");

    // `up` converges: it upgrades as `upgrade` does, so a version the
    // factory does not offer stops it (exit 1) before any node is touched.
    let out_dir = dir.path().join("out");
    let before = upgrades(&nodes);
    let o = imgbuild(
        &config,
        &[
            "--output",
            "json",
            "up",
            "--quiet",
            "--out-dir",
            out_dir.to_str().unwrap(),
        ],
        true,
    );
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    let up = json(&o);
    assert_eq!(up["healthy"], true, "{up}");
    assert_eq!(up["failedStage"], "upgrade", "{up}");
    assert!(up["error"].as_str().unwrap().contains("v1.11.6"), "{up}");
    assert_eq!(upgrades(&nodes), before, "a node was touched");

    // A schematic drift: worker-02 gets an extension (a new base schematic).
    let with_ext = Inventory::five_nodes("sim", &net)
        .talos("v1.11.5")
        .factory(&factory.url)
        .text()
        .replace(
            &format!("address: {net}.22\n"),
            &format!("address: {net}.22\n    extensions: [siderolabs/qemu-guest-agent]\n"),
        )
        + "patches:\n  worker: [worker.yaml]\n";
    std::fs::write(&config, with_ext).unwrap();
    let o = imgbuild(&config, &["--output", "json", "status", "--check"], true);
    assert_eq!(o.status.code(), Some(1));
    let v = json(&o);
    let whats: Vec<(&str, &str)> = v["drift"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| (d["node"].as_str().unwrap(), d["what"].as_str().unwrap()))
        .collect();
    assert_eq!(
        whats,
        [("worker-02", "schematic"), ("worker-02", "config")],
        "{v}"
    );
}

fn apply(config: &Path, extra: &[&str]) -> (serde_json::Value, Option<i32>) {
    let mut args = vec!["--output", "json", "apply"];
    args.extend_from_slice(extra);
    let o = imgbuild(config, &args, true);
    (json(&o), o.status.code())
}

fn changed(v: &serde_json::Value) -> Vec<bool> {
    v["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["changed"] == true)
        .collect()
}

/// `status --check`'s exit code; with `--detailed-exitcode` drift is 4
/// (a failure to check would stay 1), in sync 0 either way.
fn status_check(config: &Path) -> Option<i32> {
    let o = imgbuild(config, &["--output", "json", "status", "--check"], true);
    let v = json(&o);
    assert_eq!(v["nodes"].as_array().map(Vec::len), Some(5), "{v}");
    let detailed = imgbuild(
        config,
        &[
            "--output",
            "json",
            "status",
            "--check",
            "--detailed-exitcode",
        ],
        true,
    );
    let want = match o.status.code() {
        Some(1) if !v["drift"].as_array().unwrap().is_empty() => Some(4),
        code => code,
    };
    assert_eq!(detailed.status.code(), want, "{v}");
    o.status.code()
}

/// Five nodes that accept TCP on the Talos API port and never answer (no
/// TLS handshake, no reply): `status` reports each as not reachable, naming
/// the one deadline that covered its connect and its first call, in
/// inventory order. (How long it takes is measured by `make bench`.)
#[test]
fn status_reports_stalled_nodes_with_the_one_deadline_that_covered_them() {
    let net = common::net::scenario(module_path!(), "207");
    let mut held = Vec::new();
    for (_, last, _) in NODES {
        let listener = std::net::TcpListener::bind(format!("{net}.{last}:50000")).unwrap();
        held.push(std::thread::spawn(move || {
            let mut open = Vec::new();
            for conn in listener.incoming() {
                open.push(conn); // accepted, never read, never answered
            }
        }));
    }
    let dir = tempfile::tempdir().unwrap();
    let config = Inventory::five_nodes("stalled", &net).write(dir.path());
    let o = Run::with_config(&config, &["secrets", "gen"])
        .env_remove("IMGBUILD_STATE_DIR")
        .output();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let o = Run::with_config(&config, &["talosconfig"])
        .env_remove("IMGBUILD_STATE_DIR")
        .env_remove("TALOSCONFIG")
        .output();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let mut run = Run::with_config(&config, &["--output", "json", "status", "--check"]);
    run.timeouts(&["--call-timeout"])
        .args(["--call-timeout", "2s"])
        .env_remove("IMGBUILD_STATE_DIR")
        .env_remove("IMGBUILD_FACTORY")
        .env_remove("TALOSCONFIG");
    let o = run.output();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    let v = json(&o);
    let rows = v["nodes"].as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["node"].as_str().unwrap()).collect();
    assert_eq!(names, NODES.map(|(n, _, _)| n), "{v}");
    for r in rows {
        assert_eq!(r["reachable"], false, "{r}");
        let error = r["error"].as_str().unwrap_or_default();
        assert!(
            error.contains("no answer within the call timeout (2s, connect and Version together)"),
            "{r}"
        );
    }
}

/// `apply` beside a run that holds the cluster's state-dir lock (`up`):
/// it waits as `prune` and `down` do, saying who holds it and sending
/// nothing; with a short `--lock-timeout` it gives up naming the holder;
/// once the lock is free it applies. (Before, it failed at once.)
#[test]
fn apply_waits_for_the_state_dir_lock_another_run_holds() {
    use std::process::Stdio;
    let factory = Sim::start_with(&[], 0, &["--versions", "v1.11.2"]);
    let net = common::net::scenario(module_path!(), "lock");
    let nodes = Nodes::cluster(&net, true, &[]);
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("cluster.yaml");
    Inventory::five_nodes("sim", &net)
        .talos("v1.11.2")
        .factory(&factory.url)
        .write(dir.path());
    let o = imgbuild(&config, &["secrets", "gen"], false);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let o = imgbuild(&config, &["bootstrap"], true);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let applies = || nodes.stats()["totals"]["applies"].as_u64().unwrap();
    let before = applies();

    // Held as `up` holds it: flock(2) on the lock file, the holder inside.
    let state = dir.path().join(".talos/sim");
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(state.join(".imgbuild.lock"))
        .unwrap();
    lock.lock().unwrap();
    std::fs::write(
        state.join(".imgbuild.lock"),
        format!(
            r#"{{"pid":{},"command":"up","since":0}}"#,
            std::process::id()
        ) + "\n",
    )
    .unwrap();

    let o = imgbuild(&config, &["apply", "--lock-timeout", "1s"], true);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("waiting up to 1s for the state dir lock"),
        "{err}"
    );
    assert!(
        err.contains("is in use") && err.contains("(imgbuild up)"),
        "{err}"
    );
    assert_eq!(applies(), before, "applied while the lock was held");

    let mut run = Run::with_config(&config, &["--output", "json", "apply"]);
    run.timeouts(&[])
        .env_remove("IMGBUILD_STATE_DIR")
        .env_remove("IMGBUILD_FACTORY")
        .env_remove("TALOSCONFIG");
    let child = run
        .into_command()
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_secs(2));
    assert_eq!(applies(), before, "applied while the lock was held");
    drop(lock);
    let o = child.wait_with_output().unwrap();
    let err = text(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("waiting up to 10m for the state dir lock") && err.contains("(imgbuild up)"),
        "{err}"
    );
    assert_eq!(json(&o)["nodes"].as_array().map(Vec::len), Some(5), "{err}");
}
