//! Day two against the version-faithful node simulator (issue 26): each
//! test names the Talos version its nodes run, and the simulator behaves
//! as that version's source says (siderolabs/talos, each behaviour named in sim/src/node/). Delays are scaled down;
//! where a test is about a deadline, the deadline is scaled with them
//! (`--call-timeout`), so what must outlast it still does.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common;
use common::inventory::{Inventory, NODES, Node};
use common::run::Run;
use common::sims::{Nodes, Sim};
use common::{json, text};

/// The loopback /24 of scenario `block` (tests/common/net.rs).
fn net(block: u32) -> String {
    common::net::scenario(module_path!(), block)
}

/// Runs imgbuild on `config` with test-sized timeouts, `given` overriding
/// those it names.
fn imgbuild(config: &Path, args: &[&str], given: &[&str]) -> Output {
    run(config, args, given).output()
}

fn run(config: &Path, args: &[&str], given: &[&str]) -> Run {
    let mut r = Run::with_config(config, args);
    r.timeouts(given);
    r.env_remove("IMGBUILD_STATE_DIR")
        .env_remove("IMGBUILD_FACTORY")
        .env_remove("TALOSCONFIG");
    r
}

fn post(url: &str, body: &str) {
    let o = Command::new("curl")
        .args(["-sf", "-X", "POST", "-H", "content-type: application/json"])
        .args(["-d", body, url])
        .output()
        .unwrap();
    assert!(o.status.success(), "{url} {body}: {}", text(&o.stderr));
}

/// A bootstrapped cluster of `nodes` whose Talos runs `version`.
struct Cluster {
    factory: Sim,
    nodes: Nodes,
    dir: tempfile::TempDir,
    config: PathBuf,
    net: String,
    names: Vec<&'static str>,
}

impl Cluster {
    /// The five [`NODES`] at `version`; the factory offers `offered`.
    fn five(block: u32, version: &str, offered: &str, extra: &[&str]) -> Cluster {
        Cluster::start(block, version, offered, &NODES, extra)
    }

    fn start(
        block: u32,
        version: &str,
        offered: &str,
        nodes: &[(&'static str, u8, &'static str)],
        extra: &[&str],
    ) -> Cluster {
        let factory = Sim::start_with(&[], 0, &["--versions", offered]);
        let net = net(block);
        let upgrades = [
            "--talos-version",
            version,
            "--reboot-delay",
            "300",
            "--upgrade-delay",
            "50",
        ];
        let sim = Nodes::machines(&net, nodes, true, &[&upgrades[..], extra].concat());
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("cluster.yaml");
        let c = Cluster {
            factory,
            nodes: sim,
            dir,
            config,
            net,
            names: nodes.iter().map(|(n, _, _)| *n).collect(),
        };
        c.inventory(version, "").write(c.dir.path());
        let o = imgbuild(
            &c.config,
            &["--output", "json", "bootstrap", "--new-secrets"],
            &[],
        );
        assert!(o.status.success(), "bootstrap: {}", text(&o.stderr));
        c
    }

    fn inventory(&self, version: &str, tail: &str) -> Inventory {
        let mut inv = Inventory::new("sim")
            .vip(&format!("{}.10", self.net))
            .talos(version)
            .factory(&self.factory.url);
        for name in &self.names {
            let (_, host, role) = NODES.iter().find(|(n, _, _)| n == name).unwrap();
            inv = inv.node(Node::new(name, role).address(&format!("{}.{host}", self.net)));
        }
        inv.append(tail)
    }

    /// The inventory moves to `version`, with `tail` appended.
    fn want(&self, version: &str, tail: &str) {
        std::fs::write(&self.config, self.inventory(version, tail).text()).unwrap();
    }

    fn stats(&self) -> serde_json::Value {
        self.nodes.stats()
    }

    fn day2(&self, node: &str, field: &str) -> serde_json::Value {
        self.stats()["nodes"][node]["day2"][field].clone()
    }

    fn per_node(&self, field: &str) -> Vec<u64> {
        let stats = self.stats();
        self.names
            .iter()
            .map(|n| stats["nodes"][n]["day2"][field].as_u64().unwrap_or(0))
            .collect()
    }

    fn switch(&self, body: &str) {
        post(&format!("{}/_sim/node", self.nodes.control), body);
    }
}

/// No two nodes were down at once, by the simulator's own clock.
fn one_down_at_a_time(stats: &serde_json::Value) {
    let timeline = stats["timeline"].as_array().unwrap();
    for w in timeline.windows(2) {
        let up = w[0]["up_ms"].as_u64().expect("a node never came back");
        assert!(
            up <= w[1]["down_ms"].as_u64().unwrap(),
            "two nodes down at once: {w:?}"
        );
    }
}

const PATH_VERSIONS: &str = "v1.9.5,v1.10.3,v1.10.7,v1.11.2,v1.11.5,v1.12.1,v1.12.4";

#[test]
fn v1_9_to_v1_12_goes_through_each_minor_and_a_stopped_run_resumes() {
    // Talos v1.9.5 nodes, the inventory at v1.12.4: the v1.12 installer
    // refuses hosts below v1.10.0, so the path is v1.10.7 → v1.11.5 → v1.12.4.
    let c = Cluster::five(0, "v1.9.5", PATH_VERSIONS, &[]);
    c.want("v1.12.4", "");
    let o = imgbuild(
        &c.config,
        &["--output", "json", "upgrade", "--dry-run"],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let plan = json(&o);
    for n in plan["nodes"].as_array().unwrap() {
        let hops: Vec<&str> = n["hops"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h["version"].as_str().unwrap())
            .collect();
        assert_eq!(hops, ["v1.10.7", "v1.11.5", "v1.12.4"], "{n}");
        assert_eq!(n["api"], "machineService", "{n}");
    }
    assert_eq!(c.per_node("upgrade_calls"), [0; 5]);

    // Stop the run once cp-01 is on its first hop.
    run(&c.config, &["upgrade"], &[]).kill_at("cp-01: runs v1.10.7");
    let cp01 = c.day2("cp-01", "version");
    assert!(cp01 == "v1.10.7" || cp01 == "v1.11.5", "{cp01}");

    // The rerun resumes cp-01's path (not straight to v1.12.4, which its
    // installer would accept from v1.10.7) and takes every other node
    // through all three hops.
    let o = imgbuild(&c.config, &["--output", "json", "upgrade"], &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let report = json(&o);
    for name in &c.names {
        assert_eq!(report["versions"][name], "v1.12.4", "{report}");
    }
    let stats = c.stats();
    for name in &c.names {
        let installers: Vec<String> = stats["nodes"][name]["day2"]["installers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i.as_str().unwrap().rsplit(':').next().unwrap().to_owned())
            .collect();
        assert_eq!(installers, ["v1.10.7", "v1.11.5", "v1.12.4"], "{name}");
        assert_eq!(
            stats["nodes"][name]["day2"]["installer_refusals"], 0,
            "{name}"
        );
    }
    one_down_at_a_time(&stats);
    // Nothing left: the record's path is gone and a rerun sends nothing.
    let o = imgbuild(&c.config, &["--output", "json", "upgrade"], &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(json(&o)["upgraded"], serde_json::json!([]));
    assert_eq!(c.per_node("upgrade_calls"), [3; 5]);
}

#[test]
fn v1_11_a_40_s_first_pull_over_the_default_15_s_call_timeout_upgrades_every_node_once() {
    // v1.11.2 → v1.11.5 with the issue's real numbers and imgbuild's
    // default timeouts (--call-timeout 15s, --pull-timeout 10m): the
    // factory builds the installer on its first request, so the first
    // node's pull takes 40 s before Talos acks the Upgrade (the old code
    // gave Upgrade the call timeout, whose deadline cancelled the pull).
    let c = Cluster::five(1, "v1.11.2", "v1.11.2,v1.11.5", &["--pull-delay", "40000"]);
    c.want("v1.11.5", "");
    let before = c.stats()["now_ms"].as_u64().unwrap();
    let o = imgbuild(&c.config, &["upgrade"], &["--call-timeout"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(c.per_node("upgrade_calls"), [1; 5]);
    assert_eq!(c.per_node("upgrades"), [1; 5]);
    assert_eq!(c.per_node("pulls_cancelled"), [0; 5]);
    let stats = c.stats();
    let first = &stats["upgrades"][0];
    assert_eq!(first["node"], "cp-01", "{first}");
    let waited = first["acked_ms"].as_u64().unwrap() - before;
    assert!(waited >= 40_000, "the first ack came after {waited} ms");
    assert!(
        text(&o.stderr).contains("pulling the installer"),
        "{}",
        text(&o.stderr)
    );

    // With the pull deadline below the pull, the node's cancelled pull is
    // reported as such, not as a refusal or a failed installer.
    c.want("v1.11.2", "");
    let o = imgbuild(
        &c.config,
        &[
            "upgrade",
            "--call-timeout",
            "2s",
            "--pull-timeout",
            "2s",
            "cp-01",
        ],
        &["--call-timeout"],
    );
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    assert!(
        text(&o.stderr).contains("did not pull the installer within"),
        "{}",
        text(&o.stderr)
    );
}

/// A worker patch that v1.9–v1.13 can only apply with a reboot.
const FILES_PATCH: &str = "machine:\n  files:\n    - path: /var/etc/motd\n      op: create\n      permissions: 0o644\n      content: hello\n";

fn apply(c: &Cluster, extra: &[&str]) -> (serde_json::Value, Option<i32>) {
    let mut args = vec!["--output", "json", "apply"];
    args.extend_from_slice(extra);
    let o = imgbuild(&c.config, &args, &[]);
    (json(&o), o.status.code())
}

fn status_check(c: &Cluster) -> (serde_json::Value, Option<i32>) {
    let o = imgbuild(&c.config, &["--output", "json", "status", "--check"], &[]);
    (json(&o), o.status.code())
}

#[test]
fn v1_11_a_machine_files_change_reboots_workers_one_at_a_time() {
    let c = Cluster::five(2, "v1.11.5", "v1.11.5", &[]);
    std::fs::write(c.dir.path().join("files.yaml"), FILES_PATCH).unwrap();
    c.want("v1.11.5", "patches:\n  worker: [files.yaml]\n");

    let (v, code) = apply(&c, &["--dry-run"]);
    assert_eq!(code, Some(0), "{v}");
    let nodes = v["nodes"].as_array().unwrap();
    for n in &nodes[3..] {
        assert_eq!(n["changed"], true, "{n}");
        assert_eq!(n["needs_reboot"], true, "{n}");
        assert_eq!(n["fields"], serde_json::json!(["machine.files"]), "{n}");
        assert!(n["diff"].as_str().unwrap().contains("motd"), "{n}");
    }
    for n in &nodes[..3] {
        assert_eq!(n["changed"], false, "{n}");
    }
    let o = imgbuild(&c.config, &["apply", "--dry-run"], &[]);
    assert!(
        text(&o.stdout).contains("worker-01: would change, needs a reboot"),
        "{}",
        text(&o.stdout)
    );

    // status never changes a node: TRY dry runs only, and drift.
    let (v, code) = status_check(&c);
    assert_eq!(code, Some(1), "{v}");
    let drift: Vec<(&str, &str)> = v["drift"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| (d["node"].as_str().unwrap(), d["what"].as_str().unwrap()))
        .collect();
    assert_eq!(drift, [("worker-01", "config"), ("worker-02", "config")]);
    assert_eq!(c.day2("worker-01", "try_cancellations"), 0);

    // --mode no-reboot refuses before anything is applied, naming the field.
    let (v, code) = apply(&c, &["--mode", "no-reboot"]);
    assert_eq!(code, Some(1), "{v}");
    assert!(
        v["refused"].as_str().unwrap().contains("machine.files"),
        "{v}"
    );
    assert_eq!(c.per_node("reboots"), [0; 5]);

    let (v, code) = apply(&c, &[]);
    assert_eq!(code, Some(0), "{v}");
    let rebooted: Vec<bool> = v["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["rebooted"] == true)
        .collect();
    assert_eq!(rebooted, [false, false, false, true, true], "{v}");
    let stats = c.stats();
    assert_eq!(c.per_node("reboots"), [0, 0, 0, 1, 1]);
    one_down_at_a_time(&stats);
    for n in ["worker-01", "worker-02"] {
        // AUTO, which Talos turned into a reboot; REBOOT itself never sent.
        let sent = &stats["nodes"][n]["day2"]["requests_by_mode"]["reboot"];
        assert_eq!(sent.as_u64().unwrap_or(0), 0, "{n}");
    }

    let (v, _) = apply(&c, &[]);
    assert!(
        v["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .all(|n| n["changed"] == false),
        "{v}"
    );
    assert_eq!(c.per_node("reboots"), [0, 0, 0, 1, 1]);
    let (v, code) = status_check(&c);
    assert_eq!(code, Some(0), "{v}");
}

#[test]
fn v1_14_apply_never_sends_reboot() {
    let c = Cluster::five(3, "v1.14.0", "v1.14.0", &[]);
    std::fs::write(c.dir.path().join("files.yaml"), FILES_PATCH).unwrap();
    c.want("v1.14.0", "patches:\n  worker: [files.yaml]\n");
    let (v, code) = apply(&c, &["--dry-run"]);
    assert_eq!(code, Some(0), "{v}");
    for n in &v["nodes"].as_array().unwrap()[3..] {
        assert_eq!(n["changed"], true, "{n}");
        assert_eq!(n["needs_reboot"], false, "v1.14 applies it live: {n}");
    }
    let (v, code) = apply(&c, &[]);
    assert_eq!(code, Some(0), "{v}");
    let stats = c.stats();
    for name in &c.names {
        let day2 = &stats["nodes"][name]["day2"];
        for key in ["requests_by_mode", "applies_by_mode"] {
            assert_eq!(
                day2[key]["reboot"].as_u64().unwrap_or(0),
                0,
                "{name}: {day2}"
            );
        }
        assert_eq!(day2["reboots"], 0, "{name}");
    }
    let (v, code) = status_check(&c);
    assert_eq!(code, Some(0), "{v}");
}

const TWO_CPS: [(&str, u8, &str); 3] = [
    ("cp-01", 11, "controlplane"),
    ("cp-02", 12, "controlplane"),
    ("worker-01", 21, "worker"),
];

fn two_control_planes(block: u32, from: &str, to: &str) {
    let c = Cluster::start(block, from, &format!("{from},{to}"), &TWO_CPS, &[]);
    c.want(to, "");
    let o = imgbuild(&c.config, &["upgrade"], &[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    assert!(
        text(&o.stderr).contains("etcd has 2 members"),
        "{}",
        text(&o.stderr)
    );
    assert_eq!(c.per_node("upgrade_calls"), [0; 3], "no node touched");
    assert_eq!(c.per_node("lifecycle_upgrades"), [0; 3]);

    let o = imgbuild(
        &c.config,
        &["--output", "json", "upgrade", "--dry-run", "--force"],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(json(&o)["notes"][0].as_str().unwrap().contains("--force"));

    let o = imgbuild(&c.config, &["--output", "json", "upgrade", "--force"], &[]);
    assert!(o.status.success(), "{}", text(&o.stdout));
    let report = json(&o);
    for name in &c.names {
        assert_eq!(report["versions"][name], to, "{report}");
    }
}

#[test]
fn v1_11_two_control_planes_are_refused_unless_forced() {
    two_control_planes(4, "v1.11.2", "v1.11.5");
}

#[test]
fn v1_13_5_two_control_planes_are_refused_unless_forced() {
    // v1.13.4+ skips the etcd checks with `preserve` too; imgbuild checks
    // itself and goes through LifecycleService there.
    two_control_planes(5, "v1.13.5", "v1.13.6");
}

#[test]
fn v1_11_a_slow_drain_with_stalled_connects_is_not_an_installer_failure() {
    // A drain of 3 s (scaled from 20 s) while new connections stall for
    // 1.5 s, with a 1 s call timeout: the node answers on its old boot.
    let c = Cluster::five(
        6,
        "v1.11.2",
        "v1.11.2,v1.11.5",
        &["--drain-delay", "3000", "--stall-delay", "1500"],
    );
    c.want("v1.11.5", "");
    c.switch(r#"{"node":"worker-01","stall_connects":true}"#);
    let o = imgbuild(
        &c.config,
        &[
            "--output",
            "json",
            "upgrade",
            "worker-01",
            "--call-timeout",
            "1s",
        ],
        &["--call-timeout"],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(!text(&o.stdout).contains("installer failed"));
    assert_eq!(c.day2("worker-01", "version"), "v1.11.5");
    assert_eq!(c.day2("worker-01", "upgrade_calls"), 1);
}

#[test]
fn v1_11_stock_nodes_show_schematic_unknown_and_exit_0() {
    let c = Cluster::five(7, "v1.11.5", "v1.11.5", &["--misbehave", "stock"]);
    let o = imgbuild(&c.config, &["status", "--check"], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stdout));
    assert!(text(&o.stdout).contains("unknown"), "{}", text(&o.stdout));
    let out_dir = c.dir.path().join("out");
    let o = imgbuild(
        &c.config,
        &[
            "--output",
            "json",
            "up",
            "--quiet",
            "--out-dir",
            out_dir.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let o = imgbuild(&c.config, &["--output", "json", "upgrade"], &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(c.per_node("upgrade_calls"), [0; 5]);
}

#[test]
fn v1_11_a_schematic_read_failing_mid_upgrade_is_an_error_and_no_second_upgrade() {
    let c = Cluster::five(8, "v1.11.2", "v1.11.2,v1.11.5", &[]);
    c.want("v1.11.5", "");
    c.switch(r#"{"node":"cp-01","schematic_read_fails":true}"#);
    let o = imgbuild(&c.config, &["--output", "json", "upgrade"], &[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    let report = json(&o);
    assert_eq!(report["failed"]["node"], "cp-01", "{report}");
    assert!(
        report["failed"]["error"]
            .as_str()
            .unwrap()
            .contains("schematic"),
        "{report}"
    );
    assert_eq!(c.day2("cp-01", "upgrade_calls"), 1);
    let o = imgbuild(&c.config, &["--output", "json", "upgrade"], &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(
        c.day2("cp-01", "upgrade_calls"),
        1,
        "no second Upgrade to cp-01"
    );
    assert_eq!(c.per_node("upgrade_calls"), [1; 5]);
}

/// The day-two scenario on one version line: a patch upgrade, then a
/// worker patch that applies live, drift gone after each step.
fn scenario(block: u32, from: &str, to: &str) {
    let c = Cluster::five(block, from, &format!("{from},{to}"), &[]);
    c.want(to, "");
    let o = imgbuild(&c.config, &["--output", "json", "upgrade"], &[]);
    assert!(o.status.success(), "{from} → {to}: {}", text(&o.stderr));
    assert_eq!(c.per_node("upgrade_calls"), [1; 5]);
    one_down_at_a_time(&c.stats());
    let (v, code) = status_check(&c);
    assert_eq!(code, Some(0), "{v}");
    std::fs::write(
        c.dir.path().join("worker.yaml"),
        "machine:\n  sysctls:\n    vm.max_map_count: \"262144\"\n",
    )
    .unwrap();
    c.want(to, "patches:\n  worker: [worker.yaml]\n");
    let (v, code) = status_check(&c);
    assert_eq!(code, Some(1), "{v}");
    let reboots = c.per_node("reboots");
    let (v, code) = apply(&c, &[]);
    assert_eq!(code, Some(0), "{v}");
    assert_eq!(c.per_node("reboots"), reboots, "sysctls apply live");
    let (v, code) = status_check(&c);
    assert_eq!(code, Some(0), "{v}");
}

#[test]
fn scenario_v1_9() {
    scenario(9, "v1.9.2", "v1.9.5");
}

#[test]
fn scenario_v1_11() {
    scenario(10, "v1.11.2", "v1.11.5");
}

#[test]
fn scenario_v1_12() {
    scenario(11, "v1.12.1", "v1.12.4");
}

#[test]
fn scenario_v1_14() {
    scenario(12, "v1.14.0", "v1.14.1");
}

/// Waits until `node` answers on `version` (the simulator's own word).
fn wait_for_version(c: &Cluster, node: &str, version: &str) {
    c.nodes.wait_for_version(node, version);
}

#[test]
fn v1_11_an_upgrade_killed_while_a_node_reboots_leaves_no_stale_config_after_the_rerun() {
    // Talos v1.11.2 → v1.11.5. SIGKILL while cp-01 reboots into v1.11.5:
    // the config apply that follows its reboot never ran, so its machine
    // config still names the v1.11.2 installer. The rerun sees cp-01 on
    // the target and applies the config (no second Upgrade).
    let c = Cluster::five(13, "v1.11.2", "v1.11.2,v1.11.5", &[]);
    c.want("v1.11.5", "");
    run(&c.config, &["upgrade"], &[]).kill_at("cp-01: waiting for the node to reboot");
    wait_for_version(&c, "cp-01", "v1.11.5");
    let image = |node: &str| {
        c.stats()["nodes"][node]["install_image"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    assert!(image("cp-01").ends_with(":v1.11.2"), "{}", image("cp-01"));

    let o = imgbuild(
        &c.config,
        &["--output", "json", "upgrade", "--dry-run"],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let plan = json(&o);
    assert_eq!(plan["nodes"][0]["node"], "cp-01", "{plan}");
    assert_eq!(plan["nodes"][0]["action"], "config", "{plan}");

    let o = imgbuild(&c.config, &["--output", "json", "upgrade"], &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let report = json(&o);
    assert_eq!(
        report["configured"],
        serde_json::json!(["cp-01"]),
        "{report}"
    );
    for name in &c.names {
        assert!(image(name).ends_with(":v1.11.5"), "{name}: {}", image(name));
    }
    assert_eq!(c.day2("cp-01", "upgrade_calls"), 1, "no second Upgrade");
    let (v, code) = status_check(&c);
    assert_eq!(code, Some(0), "{v}");
}

/// A worker sysctl staged with `apply --mode staged` on `version`: status
/// shows it staged (not drift), a rerun stages nothing again.
fn staged_config_is_not_drift(block: u32, version: &str) {
    let c = Cluster::start(block, version, version, &[NODES[0], NODES[3]], &[]);
    std::fs::write(
        c.dir.path().join("worker.yaml"),
        "machine:\n  sysctls:\n    vm.max_map_count: \"262144\"\n",
    )
    .unwrap();
    c.want(version, "patches:\n  worker: [worker.yaml]\n");
    let (v, code) = status_check(&c);
    assert_eq!(code, Some(1), "not staged yet: drift {v}");
    let worker = NODES[3].0;
    let (v, code) = apply(&c, &["--mode", "staged"]);
    assert_eq!(code, Some(0), "{v}");
    assert_eq!(c.day2(worker, "staged"), true);
    let staged_applies = c.day2(worker, "applies_by_mode")["staged"].clone();
    assert_eq!(staged_applies, 1, "{v}");

    let (v, code) = status_check(&c);
    assert_eq!(code, Some(0), "staged is not drift: {v}");
    let row = v["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["node"] == worker)
        .unwrap();
    assert_eq!(row["config_staged"], true, "{v}");
    assert_eq!(
        row["config_in_sync"], false,
        "the running config differs: {v}"
    );
    assert_eq!(row["error"], serde_json::Value::Null, "not unreadable: {v}");
    let o = imgbuild(&c.config, &["status"], &[]);
    assert!(
        text(&o.stdout).contains(&format!("{worker}: config staged, reboot pending")),
        "{}",
        text(&o.stdout)
    );

    let o = imgbuild(&c.config, &["apply", "--dry-run", "--mode", "staged"], &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(
        text(&o.stdout).contains(&format!("{worker}: staged, applies at the next reboot")),
        "{}",
        text(&o.stdout)
    );
    let (v, code) = apply(&c, &["--mode", "staged"]);
    assert_eq!(code, Some(0), "{v}");
    assert_eq!(
        c.day2(worker, "applies_by_mode")["staged"],
        staged_applies,
        "staged again: {v}"
    );
    // `up`'s status step: staged, not drift (exit 0).
    let out_dir = c.dir.path().join("out");
    let o = imgbuild(
        &c.config,
        &[
            "--output",
            "json",
            "up",
            "--quiet",
            "--out-dir",
            out_dir.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let report = json(&o);
    assert_eq!(report["drift"], serde_json::json!([]), "{report}");
    assert_eq!(report["staged"], serde_json::json!([worker]), "{report}");
}

#[test]
fn v1_9_a_staged_config_is_not_drift() {
    // v1.9 has no `persistent` MachineConfig: the file is read.
    staged_config_is_not_drift(14, "v1.9.5");
}

#[test]
fn v1_11_a_staged_config_is_not_drift() {
    staged_config_is_not_drift(15, "v1.11.5");
}

#[test]
fn v1_13_the_client_drains_before_a_lifecycle_reboot_and_uncordons_after() {
    // Talos v1.13.3 → v1.13.5 through LifecycleService. The node's Reboot
    // sequence does not drain (v1alpha1_sequencer.go `Reboot`), so imgbuild
    // cordons and drains first, as talosctl does, and uncordons after the
    // node is Ready again (Talos uncordons only nodes it cordoned).
    let c = Cluster::five(16, "v1.13.3", "v1.13.3,v1.13.5", &[]);
    c.want("v1.13.5", "");
    let o = imgbuild(&c.config, &["--output", "json", "upgrade"], &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(c.per_node("lifecycle_upgrades"), [1; 5]);
    assert_eq!(c.per_node("reboot_calls"), [1; 5]);
    assert_eq!(
        c.per_node("reboots_undrained"),
        [0; 5],
        "a Reboot undrained"
    );
    assert!(
        c.per_node("evictions").iter().sum::<u64>() >= 2,
        "CoreDNS was never evicted: {:?}",
        c.per_node("evictions")
    );
    for name in &c.names {
        assert_eq!(c.day2(name, "cordoned"), false, "{name} left cordoned");
    }
    one_down_at_a_time(&c.stats());
}

#[test]
fn v1_13_a_run_killed_while_a_node_is_cordoned_leaves_the_uncordon_to_the_rerun() {
    // Talos v1.13.3 → v1.13.5. SIGKILL once cp-01 is cordoned for its
    // reboot: the killed run never uncordons it, and Talos uncordons only
    // nodes it cordoned itself (controllers/k8s/node_apply.go). The state
    // dir's record names it; the rerun uncordons it once it is Ready.
    let c = Cluster::five(17, "v1.13.3", "v1.13.3,v1.13.5", &[]);
    c.want("v1.13.5", "");
    run(&c.config, &["upgrade"], &[]).kill_at("cp-01: waiting for the node to reboot");
    assert_eq!(
        c.day2("cp-01", "cordoned"),
        true,
        "the kill left it cordoned"
    );
    wait_for_version(&c, "cp-01", "v1.13.5");
    let o = imgbuild(&c.config, &["--output", "json", "upgrade"], &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    for name in &c.names {
        assert_eq!(c.day2(name, "cordoned"), false, "{name} left cordoned");
    }
    let notes = json(&o)["notes"].to_string();
    assert!(notes.contains("cp-01: uncordoned"), "{notes}");
}

#[test]
fn v1_13_a_record_never_uncordons_a_node_an_admin_cordoned() {
    // Talos v1.13.3 → v1.13.5. The upgrade record says a stopped run left
    // worker-01 cordoned, but the cordon there now is an operator's (no
    // imgbuild mark): it stays, as Talos leaves a cordon it did not set
    // (controllers/k8s/node_apply.go `ApplyCordoned`), and the health gate
    // (talosctl's "all k8s nodes schedulable") stops the run before any
    // node, naming it. A recorded name that is no node costs no call.
    let c = Cluster::five(20, "v1.13.3", "v1.13.3,v1.13.5", &[]);
    c.switch(r#"{"node": "worker-01", "cordoned": true}"#);
    let record = c.dir.path().join(".talos/sim/upgrades.json");
    let mut r: serde_json::Value = std::fs::read(&record)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_else(|| serde_json::json!({"nodes": {}}));
    r["cordoned"] = serde_json::json!(["worker-01", "ghost\u{1b}[2J"]);
    std::fs::write(&record, r.to_string()).unwrap();
    c.want("v1.13.5", "");
    let o = imgbuild(&c.config, &["--output", "json", "upgrade"], &[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    let v = json(&o);
    assert!(
        v["failed"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("worker-01: Kubernetes node cordoned")),
        "{v}"
    );
    assert_eq!(c.per_node("lifecycle_upgrades"), [0; 5]);
    for name in &c.names {
        assert_eq!(c.day2(name, "cordoned"), *name == "worker-01", "{name}");
    }
    let notes = v["notes"].to_string();
    assert!(
        notes.contains(
            "worker-01: cordoned, but not by imgbuild (no imgbuild/cordoned mark): left cordoned"
        ),
        "{notes}"
    );
    assert!(
        notes.contains("no node of the inventory: dropped"),
        "{notes}"
    );
    assert!(!notes.contains('\u{1b}'), "{notes}");
}

#[test]
fn v1_11_status_shows_a_cordoned_node() {
    // Talos v1.11.5: worker-01 is unschedulable (a drain that did not
    // finish, or an operator): `status` says so in its row and its JSON,
    // and names the way back.
    let c = Cluster::five(18, "v1.11.5", "v1.11.5", &[]);
    c.switch(r#"{"node": "worker-01", "cordoned": true}"#);
    let o = imgbuild(&c.config, &["--output", "json", "status"], &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let v = json(&o);
    let cordoned: Vec<(&str, bool)> = v["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["node"].as_str().unwrap(), r["cordoned"] == true))
        .collect();
    assert_eq!(
        cordoned,
        c.names
            .iter()
            .map(|n| (*n, *n == "worker-01"))
            .collect::<Vec<_>>(),
        "{v}"
    );
    let o = imgbuild(&c.config, &["status"], &[]);
    let out = text(&o.stdout);
    assert!(out.contains("worker-01: cordoned (unschedulable)"), "{out}");
}

#[test]
fn v1_13_drain_timeout_bounds_the_clients_drain() {
    // Talos v1.13.3 → v1.13.5 through LifecycleService, where imgbuild
    // drains: with `--drain-timeout 0s` the first node with evictable pods
    // (CoreDNS) stops the run at its drain, before its Reboot, naming the
    // pods and the deadline (talosctl's `--drain-timeout`).
    let c = Cluster::five(19, "v1.13.3", "v1.13.3,v1.13.5", &[]);
    c.want("v1.13.5", "");
    let o = imgbuild(
        &c.config,
        &["--output", "json", "upgrade", "--drain-timeout", "0s"],
        &[],
    );
    assert_ne!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let report = json(&o);
    let error = report["failed"]["error"].as_str().unwrap_or_default();
    assert!(
        error.starts_with("draining: ") && error.contains("still on the node after 0ns"),
        "{report}"
    );
    let failed = report["failed"]["node"].as_str().unwrap();
    assert_eq!(
        c.day2(failed, "reboot_calls"),
        0,
        "{failed} rebooted undrained"
    );
}

#[test]
fn v1_13_ctrl_c_during_a_drain_says_what_it_left_and_the_rerun_resumes() {
    // Talos v1.13.3 → v1.13.5 through LifecycleService, drained by the
    // client. A PodDisruptionBudget refuses cp-01's evictions (429), so its
    // drain retries; Ctrl-C there stops the run, which says cp-01 is left
    // cordoned and not rebooted, and how to resume. With the budget gone,
    // the rerun finishes: every node on v1.13.5, none cordoned. cp-01 runs
    // v1.13.3 until it reboots, which is all a node shows: the rerun
    // installs it again, the others once.
    let c = Cluster::five(21, "v1.13.3", "v1.13.3,v1.13.5", &[]);
    c.want("v1.13.5", "");
    c.switch(r#"{"node": "cp-01", "disruption_budget": true}"#);
    let s = run(&c.config, &["upgrade"], &[])
        .signal_at("cp-01: draining the Kubernetes node", libc::SIGINT);
    let said = s.after.join("\n");
    assert_eq!(s.status.code(), Some(1), "{said}");
    assert!(
        said.contains("interrupted (SIGINT) while draining: cp-01 is left cordoned")
            && said.contains("Run `imgbuild upgrade` again to resume"),
        "{said}"
    );
    assert_eq!(c.day2("cp-01", "cordoned"), true, "{said}");
    assert_eq!(c.day2("cp-01", "reboot_calls"), 0, "rebooted: {said}");

    c.switch(r#"{"node": "cp-01", "disruption_budget": false}"#);
    let o = imgbuild(&c.config, &["--output", "json", "upgrade"], &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    for name in &c.names {
        assert_eq!(c.day2(name, "cordoned"), false, "{name} left cordoned");
        assert_eq!(c.day2(name, "version"), "v1.13.5", "{name}");
    }
    assert_eq!(c.per_node("lifecycle_upgrades"), [2, 1, 1, 1, 1]);
}
