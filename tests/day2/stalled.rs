//! `status` on nodes that accept TCP and never answer (issue 42): one
//! deadline per node covers its connect and first call, the nodes are read
//! in parallel (bounded), each stalled node is tried once and asked nothing
//! more, and the rows come in inventory order. No timing is asserted here
//! (the ratio to one call timeout is `bench/day2.sh`'s): the proof is the
//! error each row carries and the count of connections each node saw.

use std::collections::BTreeMap;
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

use crate::common;
use common::inventory::{Inventory, Node};
use common::run::Run;
use common::{json, text};

/// Listeners on `addresses` (port 50000) that accept and never read or
/// answer; counts the connections each accepted.
struct Stalled {
    accepted: Arc<Mutex<BTreeMap<String, usize>>>,
}

impl Stalled {
    fn start(addresses: &[String]) -> Stalled {
        let accepted = Arc::new(Mutex::new(BTreeMap::new()));
        for a in addresses {
            let listener = TcpListener::bind((a.as_str(), 50000)).unwrap();
            accepted.lock().unwrap().insert(a.clone(), 0);
            let (count, a) = (accepted.clone(), a.clone());
            std::thread::spawn(move || {
                let mut held: Vec<TcpStream> = Vec::new();
                for c in listener.incoming().flatten() {
                    *count.lock().unwrap().get_mut(&a).unwrap() += 1;
                    held.push(c);
                }
            });
        }
        Stalled { accepted }
    }

    fn accepted(&self) -> BTreeMap<String, usize> {
        self.accepted.lock().unwrap().clone()
    }
}

/// `n` nodes on this scenario's /24 (3 control planes, the rest workers),
/// stalled; `status` with a 1 s call timeout. Returns the rows, the
/// listeners' counts and the addresses in inventory order.
fn status_on_stalled(n: usize) -> (Vec<serde_json::Value>, BTreeMap<String, usize>, Vec<String>) {
    let net = common::net::block(&format!("{}::{n}", module_path!()));
    let addresses: Vec<String> = (0..n).map(|i| format!("{net}.{}", 11 + i)).collect();
    let stalled = Stalled::start(&addresses);
    let mut inv = Inventory::new("stalled").vip(&format!("{net}.10"));
    for (i, a) in addresses.iter().enumerate() {
        let role = if i < 3 { "controlplane" } else { "worker" };
        inv = inv.node(Node::new(&format!("n-{:02}", i + 1), role).address(a));
    }
    let dir = tempfile::tempdir().unwrap();
    let config = inv.write(dir.path());
    let run = |args: &[&str]| {
        Run::with_config(&config, args)
            .current_dir(dir.path())
            .env_remove("IMGBUILD_STATE_DIR")
            .env_remove("IMGBUILD_FACTORY")
            .env_remove("TALOSCONFIG")
            .env_remove("IMGBUILD_TALOS_PROXY")
            .output()
    };
    let o = run(&["secrets", "gen"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let o = run(&["--output", "json", "status", "--call-timeout", "1s"]);
    let v = json(&o);
    let rows = v["nodes"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}\n{}", text(&o.stderr)))
        .clone();
    (rows, stalled.accepted(), addresses)
}

fn assert_one_deadline_each(n: usize) {
    let (rows, accepted, _) = status_on_stalled(n);
    let names: Vec<&str> = rows.iter().map(|r| r["node"].as_str().unwrap()).collect();
    let want: Vec<String> = (1..=n).map(|i| format!("n-{i:02}")).collect();
    assert_eq!(names, want, "rows in inventory order");
    for r in &rows {
        assert_eq!(r["reachable"], false, "{r}");
        // The one deadline, covering connect and call together.
        assert_eq!(
            r["error"], "no answer within the call timeout (1s, connect and Version together)",
            "{r}"
        );
    }
    // Every node tried once, and not asked again after its deadline.
    let tried: Vec<(&String, &usize)> = accepted.iter().filter(|(_, c)| **c != 1).collect();
    assert!(tried.is_empty(), "nodes not tried exactly once: {tried:?}");
}

#[test]
fn status_on_five_stalled_nodes_tries_each_once_under_one_deadline() {
    assert_one_deadline_each(5);
}

#[test]
fn status_on_fifty_stalled_nodes_tries_each_once_under_one_deadline() {
    assert_one_deadline_each(50);
}
