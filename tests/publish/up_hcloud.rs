//! End to end: `imgbuild up` and `imgbuild down` on Hetzner Cloud, against
//! the factory, Hetzner and Talos node simulators on loopback. The Hetzner
//! simulator boots a node for each server made from a snapshot, configured
//! from that server's `user_data` (validated by the node simulator's own
//! schema check) at the public IP the API reports: the chain is checked.
//! Needs OpenSSH (the snapshot's rescue system), like cli_hcloud.

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

use crate::common;
use common::run::Run;
use common::sims::{Hc, Nodes, Sim};
use common::{json, text};

const INVENTORY: &str = "\
cluster:
  name: hup
  talosVersion: v1.11.2
  kubernetesVersion: v1.32.1
  # A load balancer that does not exist yet: bootstrap and kubeconfig use
  # the first control plane's public IP until it answers.
  endpoint: https://127.0.9.250:6443
image:
  platform: hcloud
  factory: http://127.0.0.1:9
publish:
  hcloud:
    location: fsn1
    labels: {team: infra}
    servers: {type: cpx22}
nodes:
  - {name: cp-01, role: controlplane}
  - {name: worker-01, role: worker}
  - {name: worker-02, role: worker}
";

struct Chain {
    factory: Sim,
    hc: Hc,
    nodes: Nodes,
    dir: tempfile::TempDir,
}

impl Chain {
    fn start() -> Chain {
        Self::start_with(INVENTORY, &[])
    }

    /// With another inventory and more Hetzner simulator switches.
    fn start_with(inventory: &str, hc_extra: &[&str]) -> Chain {
        let nodes = Nodes::start(&[]);
        let mut extra = vec!["--nodes-control", nodes.control.as_str()];
        extra.extend_from_slice(hc_extra);
        let hc = Hc::start(&extra);
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("cluster.yaml"), inventory).unwrap();
        Chain {
            factory: Sim::start(&[]),
            hc,
            nodes,
            dir,
        }
    }

    fn config(&self) -> PathBuf {
        self.dir.path().join("cluster.yaml")
    }

    fn imgbuild(&self, args: &[&str]) -> Run {
        let mut run = Run::with_config(&self.config(), args);
        run.hcloud(&self.hc);
        run
    }

    fn up(&self, extra: &[&str]) -> Output {
        let dir = self.dir.path();
        self.imgbuild(&[
            "up",
            "--new-secrets",
            "--output",
            "json",
            "--quiet",
            "--poll-ms",
            "100",
        ])
        .args(extra)
        .factory(&self.factory)
        .envs(self.hc.rescue_env())
        .folders(dir)
        .arg("--state-dir")
        .arg(dir.join("state"))
        .args(["--node-timeout", "60s", "--health-timeout", "90s"])
        .output()
    }

    /// Counts that change when anything is created anywhere.
    fn changes(&self) -> (u64, u64, u64, u64, u64) {
        let totals = &self.nodes.stats()["totals"];
        (
            self.hc.stat("serversCreated"),
            self.hc.stat("imagesCreated"),
            self.hc.stat("serversFromSnapshots"),
            totals["applies"].as_u64().unwrap(),
            totals["bootstraps"].as_u64().unwrap(),
        )
    }
}

#[test]
fn up_on_hetzner_creates_servers_from_the_snapshot_and_down_removes_them() {
    let c = Chain::start();

    // The dry run changes nothing anywhere.
    let o = c.up(&["--dry-run"]);
    assert!(
        o.status.success(),
        "{}\n{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    let planned = json(&o);
    assert_eq!(planned["dryRun"], true);
    assert_eq!(planned["target"], "hcloud");
    assert_eq!(c.changes(), (0, 0, 0, 0, 0));
    assert_eq!(c.hc.stat("sshKeys"), 0);

    let o = c.up(&[]);
    assert!(
        o.status.success(),
        "{}\n{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    let v = json(&o);
    // What the dry run planned is what the run did: servers boot with
    // their config in user_data, so no first apply in either.
    common::plan::assert_plan_is_run("Hetzner first run", &planned, &v);
    assert!(
        !common::plan::actions(&planned)
            .iter()
            .any(|a| a.contains("applyFirstConfig")),
        "{planned}"
    );
    assert_eq!(v["healthy"], true, "{v}");
    assert_eq!(v["bootstrap"], "bootstrapped");
    let nodes = v["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 3);
    let mut servers = Vec::new();
    for n in nodes {
        assert_eq!(n["kubernetesReady"], true, "{n}");
        assert_eq!(n["stages"]["vm"], "created", "{n}");
        let ip = n["address"].as_str().unwrap();
        assert!(ip.starts_with("127.4."), "{n}");
        servers.push(n["server"].as_u64().unwrap());
        assert!(
            n["volume"].as_str().unwrap().starts_with("snapshot "),
            "{n}"
        );
    }
    // One snapshot for the three nodes; its temporary server and key gone.
    assert_eq!(c.hc.stat("imagesCreated"), 1);
    assert_eq!(c.hc.stat("serversFromSnapshots"), 3);
    assert_eq!(c.hc.stat("servers"), 3, "only the cluster's servers remain");
    assert_eq!(c.hc.stat("sshKeys"), 0);
    let (_, _, temp) =
        c.hc.call("GET", "/servers?label_selector=imgbuild-run", None);
    assert_eq!(temp["servers"], serde_json::json!([]));

    // Each server took its node's config as user_data: under 32 KiB, and the
    // node simulator (its own schema check) booted it configured.
    let stats = c.nodes.stats();
    for (id, name) in servers.iter().zip(["cp-01", "worker-01", "worker-02"]) {
        let o = Command::new("curl")
            .arg("-s")
            .arg(
                c.hc.url
                    .replace("/v1", &format!("/_sim/servers/{id}/user_data")),
            )
            .output()
            .unwrap();
        let user_data: String = serde_json::from_slice(&o.stdout).unwrap();
        assert!(
            user_data.len() < 32 * 1024,
            "{name}: {} bytes",
            user_data.len()
        );
        assert!(user_data.contains(&format!("hostname: {name}")), "{name}");
        let node = &stats["nodes"][name];
        assert_eq!(node["config_error"], Value::Null, "{name}: {node}");
        assert_eq!(node["phase"], "configured", "{name}: {node}");
    }
    // Configured from user_data: nothing applied in maintenance mode.
    assert_eq!(stats["totals"]["applies"], 0, "{stats}");
    assert_eq!(stats["totals"]["bootstraps"], 1, "{stats}");
    // Servers are labelled with the cluster and node, never a run label.
    let (_, _, listed) = c.hc.call("GET", &format!("/servers/{}", servers[0]), None);
    let labels = &listed["server"]["labels"];
    assert_eq!(labels["imgbuild-cluster"], "hup");
    assert_eq!(labels["imgbuild-node"], "cp-01");
    assert!(labels.get("imgbuild-run").is_none(), "{labels}");

    // A second run changes nothing.
    let before = c.changes();
    let o = c.up(&[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let v = json(&o);
    assert_eq!(v["healthy"], true);
    assert_eq!(v["bootstrap"], "unchanged");
    for n in v["nodes"].as_array().unwrap() {
        assert_eq!(n["stages"]["vm"], "unchanged", "{n}");
        assert_eq!(n["stages"]["upload"], "unchanged", "{n}");
    }
    assert_eq!(c.changes(), before);

    // cleanup leaves the cluster alone; down without --yes asks, and a
    // script cannot answer: exit 2, nothing deleted.
    let o = c.imgbuild(&["cleanup"]).output();
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(c.hc.stat("servers"), 3);
    let o = c.imgbuild(&["down"]).output();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("--yes"), "{}", text(&o.stderr));
    assert_eq!(c.hc.stat("servers"), 3);
    // --dry-run lists the servers the deletion takes; nothing goes.
    let o = c.imgbuild(&["down", "--dry-run", "-o", "json"]).output();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let dry = json(&o);
    assert_eq!(c.hc.stat("servers"), 3);
    let o = c.imgbuild(&["down", "--yes", "--output", "json"]).output();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let ids = |list: &Value| {
        let mut ids: Vec<u64> = list
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["id"].as_u64().unwrap())
            .collect();
        ids.sort_unstable();
        ids
    };
    let deleted = json(&o)["deleted"].clone();
    assert_eq!(ids(&deleted).len(), 3, "{deleted}");
    assert_eq!(ids(&dry["wouldDelete"]["servers"]), ids(&deleted), "{dry}");
    assert_eq!(c.hc.stat("servers"), 0);
    assert_eq!(c.hc.stat("sshKeys"), 0);
}

/// With `servers.network`, each server also joins that Hetzner network at
/// its node's inventory address (loopback here, as the simulator's network).
#[test]
fn servers_join_their_network_at_the_inventory_address() {
    let inventory = INVENTORY
        .replace(
            "servers: {type: cpx22}",
            "servers: {type: cpx22, network: lan}",
        )
        .replace(
            "{name: cp-01, role: controlplane}",
            "{name: cp-01, role: controlplane, address: 127.8.0.11}",
        )
        .replace(
            "{name: worker-01, role: worker}",
            "{name: worker-01, role: worker, address: 127.8.0.21}",
        )
        .replace("  - {name: worker-02, role: worker}\n", "");
    let c = Chain::start_with(&inventory, &["--network", "lan=127.8.0.0/16"]);
    let o = c.up(&[]);
    assert!(
        o.status.success(),
        "{}\n{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    let v = json(&o);
    assert_eq!(v["healthy"], true, "{v}");
    let (_, _, nets) = c.hc.call("GET", "/networks?name=lan", None);
    let lan = nets["networks"][0]["id"].as_u64().unwrap();
    for (n, want) in v["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .zip(["127.8.0.11", "127.8.0.21"])
    {
        let id = n["server"].as_u64().unwrap();
        let (_, _, server) = c.hc.call("GET", &format!("/servers/{id}"), None);
        let private = &server["server"]["private_net"];
        assert_eq!(private.as_array().map(Vec::len), Some(1), "{server}");
        assert_eq!(private[0]["network"], lan, "{server}");
        assert_eq!(private[0]["ip"], want, "{server}");
        assert_eq!(server["server"]["status"], "running");
    }
}

/// `servers.type` must boot the snapshot: a type with a smaller disk than
/// the snapshot's `disk_size`, or another architecture, fails before any
/// server is created, naming the type, its disk and the snapshot's.
#[test]
fn a_server_type_that_cannot_boot_the_snapshot_fails_before_any_server() {
    let inventory = INVENTORY.replace(
        "    servers: {type: cpx22}\n",
        "    serverTypes: [cpx22]\n    servers: {type: cx23}\n",
    );
    let c = Chain::start_with(&inventory, &[]);
    let o = c.up(&[]);
    let all = format!("{}\n{}", text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(1), "{all}");
    // imgbuild's own check, not the API's 422 after a first attempt.
    assert!(
        all.contains("publish.hcloud.servers.type cx23 has a 40 GB disk, smaller than the 80 GB disk_size of snapshot"),
        "{all}"
    );
    assert!(!all.contains("POST /servers"), "{all}");
    assert_eq!(c.hc.stat("imagesCreated"), 1);
    assert_eq!(c.hc.stat("serversFromSnapshots"), 0);
    assert_eq!(c.hc.stat("servers"), 0, "the build server is gone too");

    std::fs::write(
        c.config(),
        inventory.replace("{type: cx23}", "{type: cax21}"),
    )
    .unwrap();
    // Another architecture than the node's is refused before anything is
    // built, from the type's `architecture` in `GET /server_types`.
    let o = c.up(&[]);
    let all = format!("{}\n{}", text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(2), "{all}");
    assert!(
        all.contains("node cp-01: server type cax21 cannot run it in fsn1: its architecture is arm, the image's amd64"),
        "{all}"
    );
    assert_eq!(c.hc.stat("imagesCreated"), 1, "no other snapshot");
    assert_eq!(c.hc.stat("serversCreated"), 1, "only the one build server");
}

/// `len` bytes of filler for a patch: `random` hex digits compress only to
/// about half, else repeated lines compress to almost nothing.
fn filler(len: usize, random: bool) -> String {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    (0..len)
        .map(|i| {
            if !random {
                return b"# a line of a large config\n"[i % 27] as char;
            }
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            char::from_digit((x % 16) as u32, 16).unwrap()
        })
        .collect()
}

/// A patch writing `content` to a file: YAML, the content as a block.
fn file_patch(content: &str) -> String {
    let body: String = content.lines().map(|l| format!("        {l}\n")).collect();
    let body = if body.is_empty() {
        format!("        {content}\n")
    } else {
        body
    };
    format!(
        "machine:\n  files:\n    - path: /var/etc/filler.txt\n      op: create\n      permissions: 0o644\n      content: |\n{body}"
    )
}

/// A machine config over the 32 KiB `user_data` limit goes gzipped and
/// base64-encoded, and the node (the simulator reads it as Talos does)
/// boots configured from it; one that stays too large even so is refused,
/// naming the node, before any server is touched.
#[test]
fn a_config_over_32_kib_is_gzipped_and_boots() {
    let inventory = INVENTORY
        .replace(
            "{name: cp-01, role: controlplane}",
            "{name: cp-01, role: controlplane, patches: [big.yaml]}",
        )
        .replace("  - {name: worker-01, role: worker}\n", "")
        .replace("  - {name: worker-02, role: worker}\n", "");
    let c = Chain::start_with(&inventory, &[]);
    let patch = c.dir.path().join("big.yaml");
    std::fs::write(&patch, file_patch(&filler(40 * 1024, false))).unwrap();
    let o = c.up(&[]);
    assert!(
        o.status.success(),
        "{}\n{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    let v = json(&o);
    assert_eq!(v["healthy"], true, "{v}");
    let id = v["nodes"][0]["server"].as_u64().unwrap();
    let o = Command::new("curl")
        .arg("-s")
        .arg(
            c.hc.url
                .replace("/v1", &format!("/_sim/servers/{id}/user_data")),
        )
        .output()
        .unwrap();
    let user_data: String = serde_json::from_slice(&o.stdout).unwrap();
    assert!(user_data.len() <= 32 * 1024, "{} bytes", user_data.len());
    // Read back with the system's base64 and gzip: the whole config.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("user_data"), &user_data).unwrap();
    let o = Command::new("sh")
        .arg("-c")
        .arg("base64 -d user_data | gzip -d")
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let config = text(&o.stdout);
    assert!(config.len() > 40 * 1024, "{} bytes", config.len());
    assert!(config.contains("hostname: cp-01"), "{config}");
    assert!(config.contains("# a line of a large config"));
    let stats = c.nodes.stats();
    let node = &stats["nodes"]["cp-01"];
    assert_eq!(node["config_error"], Value::Null, "{node}");
    assert_eq!(node["phase"], "configured", "{node}");
    assert_eq!(stats["totals"]["applies"], 0, "{stats}");

    // 100 KiB of noise does not fit even compressed.
    std::fs::write(&patch, file_patch(&filler(100 * 1024, true))).unwrap();
    let before = c.changes();
    let o = c.up(&[]);
    let all = format!("{}\n{}", text(&o.stdout), text(&o.stderr));
    assert_eq!(o.status.code(), Some(1), "{all}");
    assert!(all.contains("node cp-01"), "{all}");
    assert!(all.contains("even gzipped and base64-encoded"), "{all}");
    assert_eq!(c.changes(), before);
}
