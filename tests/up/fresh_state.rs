//! A state dir that holds only the cluster's secrets (a fresh CI runner, or
//! a laptop whose kubeconfig is gone): the admin kubeconfig is minted from
//! the secrets, so `status` reads Kubernetes (a fresh clone's plan:
//! tests/up/fresh_clone.rs); when Kubernetes cannot be asked at all,
//! `status` says why and what to do. On the 5-node Proxmox cluster of
//! examples/demo against the factory, Proxmox VE and Talos node simulators.
// A test's stderr is libtest's to capture, not the CLI's one writer.
#![allow(clippy::disallowed_macros)]

use std::path::Path;
use std::time::Duration;

use crate::common;
use common::demo::DemoCluster as Cluster;
use common::inventory::NODES;
use common::run::Run;
use common::sims::{Nodes, Pve, Sim};
use common::{json, stdout_ok, text};
use imgbuild::talos::kube::Kubeconfig;

/// The loopback /24 of scenario `k` (tests/common/net.rs).
fn net(k: u8) -> String {
    common::net::scenario(module_path!(), k)
}

/// `imgbuild <args>` as [`Cluster::command`] runs it, but on another
/// runner: the state dir `state` and the out and cache folders under
/// `folders`.
fn on_runner(c: &Cluster, state: &Path, folders: &Path, args: &[&str]) -> Run {
    let mut run = Run::with_config(&c.config(), args);
    run.timeouts(args)
        .arg("--state-dir")
        .arg(state)
        .env_remove("IMGBUILD_STATE_DIR")
        .env_remove("TALOSCONFIG")
        .proxmox(&c.pve);
    if args.contains(&"up") {
        run.factory(&c.factory)
            .args(["--poll-ms", "50", "--quiet"])
            .folders(folders);
    } else {
        run.args(["--factory", &c.factory.url]);
    }
    run
}

/// `imgbuild <args>` for `imgbuild kubeconfig` (no timeouts, no factory)
/// on the cluster's state dir.
fn kubeconfig_cmd(c: &Cluster, args: &[&str]) -> std::process::Output {
    Run::with_config(&c.config(), args)
        .arg("--state-dir")
        .arg(c.dir.path().join("state"))
        .env_remove("IMGBUILD_STATE_DIR")
        .env_remove("KUBECONFIG")
        .output()
}

/// The laptop's `up` of the demo cluster: five nodes, healthy.
fn laptop_up(c: &Cluster) {
    let out = c.command(&["--output", "json", "up"]).output();
    stdout_ok(&out);
    assert_eq!(json(&out)["healthy"], true);
}

/// Every node the kubeconfig's API lists, with its readiness, sorted.
fn readiness(kc: &Kubeconfig) -> Vec<(String, bool)> {
    let mut ready: Vec<(String, bool)> = kc
        .node_readiness(Duration::from_secs(5))
        .unwrap()
        .into_iter()
        .map(|n| (n.name, n.ready))
        .collect();
    ready.sort();
    ready
}

fn all_ready() -> Vec<(String, bool)> {
    NODES.iter().map(|(n, ..)| (n.to_string(), true)).collect()
}

/// The laptop's state dir lost its kubeconfig: `status` reads Kubernetes
/// through one minted from the secrets and is clean; a kubeconfig there
/// that no longer answers is named, with the way out, and `--check` fails;
/// `imgbuild kubeconfig` mints one (into the state dir, or with --merge
/// only into the user's file) that the cluster's API accepts.
#[test]
fn a_state_dir_without_its_kubeconfig_still_reads_kubernetes() {
    let c = Cluster::start(net(2));
    laptop_up(&c);
    let state = c.dir.path().join("state");
    let kubeconfig = state.join("kubeconfig");
    let written = std::fs::read_to_string(&kubeconfig).unwrap();
    std::fs::remove_file(&kubeconfig).unwrap();

    // Clean: every node Ready, every component's version known.
    let out = c
        .command(&["--output", "json", "status", "--check"])
        .output();
    let v = json(&out);
    assert_eq!(out.status.code(), Some(0), "{v}\n{}", text(&out.stderr));
    assert_eq!(v["kubernetesUnasked"], serde_json::Value::Null, "{v}");
    assert_eq!(v["drift"], serde_json::json!([]), "{v}");
    for n in v["nodes"].as_array().unwrap() {
        assert_eq!(n["ready"], true, "{n}");
        assert_eq!(n["cordoned"], false, "{n}");
    }
    let components = v["kubernetes"].as_array().unwrap();
    assert!(!components.is_empty(), "{v}");
    for k in components {
        assert!(k["running"].is_string(), "{k}");
    }
    assert!(!kubeconfig.exists(), "status wrote a kubeconfig");

    // A kubeconfig of this cluster that points where nothing answers: it is
    // used (it fits the secrets), so status says so and what to do.
    let dead = Kubeconfig::parse(&written)
        .unwrap()
        .with_server("https://127.0.0.1:9");
    std::fs::write(&kubeconfig, dead.to_yaml()).unwrap();
    let out = c.command(&["status", "--check"]).output();
    let table = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{table}\n{}", text(&out.stderr));
    let line = table
        .lines()
        .find(|l| l.starts_with("Kubernetes could not be asked"))
        .unwrap_or_else(|| panic!("no line says Kubernetes was not asked:\n{table}"));
    assert!(line.contains("https://127.0.0.1:9"), "{line}");
    assert!(
        line.contains(&format!("delete {}", kubeconfig.display()))
            || line.contains(&format!("{} is used", kubeconfig.display())),
        "{line}"
    );
    std::fs::remove_file(&kubeconfig).unwrap();

    // --merge: into the user's file only; the API accepts the identity.
    let home = tempfile::tempdir().unwrap();
    let mine = home.path().join("config");
    let out = kubeconfig_cmd(&c, &["kubeconfig", "--merge", mine.to_str().unwrap()]);
    stdout_ok(&out);
    assert!(!kubeconfig.exists(), "--merge wrote the state dir");
    let merged = Kubeconfig::parse(&std::fs::read_to_string(&mine).unwrap()).unwrap();
    assert_eq!(readiness(&merged), all_ready());

    // Without --merge: minted into the state dir, and said so.
    let out = kubeconfig_cmd(&c, &["--output", "json", "kubeconfig"]);
    stdout_ok(&out);
    let v = json(&out);
    assert_eq!(v["minted"], true, "{v}");
    assert_eq!(v["kubeconfig"], kubeconfig.to_str().unwrap());
    let minted = Kubeconfig::parse(&std::fs::read_to_string(&kubeconfig).unwrap()).unwrap();
    assert_eq!(readiness(&minted), all_ready());
    // A second call keeps it.
    let out = kubeconfig_cmd(&c, &["--output", "json", "kubeconfig"]);
    assert_eq!(json(&out)["minted"], false);
}

/// The inventory's endpoint is on the VIP, which this node simulator never
/// brings up: the laptop's bootstrap pointed its kubeconfig at cp-01, and a
/// runner with only the secrets points the one it mints there too (in
/// memory), so its dry run plans nothing and its status is clean.
#[test]
fn a_vip_that_does_not_answer_is_passed_over_for_the_minted_kubeconfig_too() {
    let net = net(3);
    let nodes = Nodes::start(&["--reboot-delay", "200", "--upgrade-delay", "50"]);
    let c = Cluster {
        factory: Sim::start_with(&[], 0, &["--versions", "v1.11.2,v1.11.5"]),
        pve: Pve::start(&["--nodes-control", nodes.control.as_str()]),
        nodes,
        dir: tempfile::tempdir().unwrap(),
        net,
    };
    c.write(&c.inventory());
    laptop_up(&c);
    let laptop = std::fs::read_to_string(c.dir.path().join("state/kubeconfig")).unwrap();
    let cp01 = format!("https://{}.11:6443", c.net);
    assert_eq!(Kubeconfig::parse(&laptop).unwrap().server, cp01);

    let runner = tempfile::tempdir().unwrap();
    let state = runner.path().join("state");
    std::fs::create_dir(&state).unwrap();
    std::fs::copy(
        c.dir.path().join("state/secrets.yaml"),
        state.join("secrets.yaml"),
    )
    .unwrap();
    let args = ["--output", "json", "up", "--dry-run", "--detailed-exitcode"];
    let out = on_runner(&c, &state, runner.path(), &args).output();
    let v = json(&out);
    assert_eq!(out.status.code(), Some(0), "{v}\n{}", text(&out.stderr));
    assert_eq!(v["plan"], serde_json::json!([]), "{v}");

    let args = ["--output", "json", "status", "--check"];
    let out = on_runner(&c, &state, runner.path(), &args).output();
    let v = json(&out);
    assert_eq!(out.status.code(), Some(0), "{v}\n{}", text(&out.stderr));
    for n in v["nodes"].as_array().unwrap() {
        assert_eq!(n["ready"], true, "{n}");
    }
    assert!(!state.join("kubeconfig").exists());
}
