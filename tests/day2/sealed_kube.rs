//! A sealed cluster (secrets from SOPS) keeps no kubeconfig: the bootstrap
//! writes none into the state dir and the run reads Kubernetes through one
//! minted from the secrets, in memory, pointed at a control plane that
//! answers when the VIP does not (as the written one would be). Through the
//! library against the Talos node simulator; `Plan.write_kubeconfig` is
//! what the secrets' source sets.

use std::time::Duration;

use crate::common;
use common::inventory::{Inventory, NODES};
use common::sims::Nodes;
use imgbuild::talos::bootstrap::{self, Event, Health, Observer, Options};
use imgbuild::talos::stage::{self, BootstrapOptions};

/// The loopback /24 of scenario `k` (tests/common/net.rs).
fn net(k: u8) -> String {
    common::net::scenario(module_path!(), k)
}

/// Drops every event: the test reads the outcome.
struct Silent;

impl Observer for Silent {
    fn event(&self, _: &str, _: &Event) {}
}

fn limits() -> Options {
    Options {
        node_timeout: Duration::from_secs(20),
        bootstrap_timeout: Duration::from_secs(20),
        health_timeout: Duration::from_secs(30),
        call_timeout: Duration::from_secs(5),
        poll: Duration::from_millis(100),
        ..Options::default()
    }
}

#[test]
fn a_sealed_cluster_is_bootstrapped_without_writing_a_kubeconfig() {
    let net = net(1);
    // The simulator never brings the VIP up: the endpoint does not answer.
    let _nodes = Nodes::cluster(&net, false, &[]);
    let dir = tempfile::tempdir().unwrap();
    let config = Inventory::five_nodes("sim", &net).write(dir.path());
    let inv = imgbuild::inventory::Inventory::load(&config).unwrap();
    let opts = BootstrapOptions {
        limits: limits(),
        new_secrets: true,
        ..BootstrapOptions::default()
    };
    let mut prepared = stage::prepare(&inv, &opts).unwrap();
    prepared.plan.write_kubeconfig = false;
    let plan = &prepared.plan;

    let rt = tokio::runtime::Runtime::new().unwrap();
    let outcome = rt
        .block_on(bootstrap::run(plan, &opts.limits, &Silent))
        .unwrap();
    assert_eq!(outcome.health, Health::Healthy);
    let cp01 = format!("https://{net}.11:6443");
    assert_eq!(outcome.kubeconfig_server, cp01);
    assert_eq!(outcome.fallbacks.len(), 1, "{:?}", outcome.fallbacks);
    assert_eq!(outcome.fallbacks[0].setting, "cluster.vip");

    // Nothing written: no kubeconfig in the state dir, and the key of the
    // one the run used is in no file there.
    assert!(!plan.kubeconfig_path.exists());
    let held = plan.admin_kube.get().unwrap();
    assert_eq!(held.server, cp01, "the VIP fallback is held in memory");
    let yaml = held.to_yaml();
    let key = yaml
        .lines()
        .find_map(|l| l.trim().strip_prefix("client-key-data: "))
        .unwrap()
        .to_owned();
    for entry in std::fs::read_dir(&prepared.state_dir.path).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() {
            let text = String::from_utf8_lossy(&std::fs::read(&path).unwrap()).into_owned();
            assert!(!text.contains(&key), "{} holds the key", path.display());
        }
    }
    // ... and the cluster's API takes it: every node Ready.
    let mut ready: Vec<(String, bool)> = held
        .node_readiness(Duration::from_secs(5))
        .unwrap()
        .into_iter()
        .map(|n| (n.name, n.ready))
        .collect();
    ready.sort();
    let want: Vec<(String, bool)> = NODES.iter().map(|(n, ..)| (n.to_string(), true)).collect();
    assert_eq!(ready, want);

    // A second run reads through it too, and still writes nothing.
    let again = rt
        .block_on(bootstrap::run(plan, &opts.limits, &Silent))
        .unwrap();
    assert_eq!(again.health, Health::Healthy);
    assert!(!again.bootstrapped);
    assert!(!plan.kubeconfig_path.exists());
}
