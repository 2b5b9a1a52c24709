//! The plan is the run: on the 5-node Proxmox cluster of examples/demo
//! (cp-01..03, worker-01..02, VMs 300..304) against the factory, Proxmox VE
//! and Talos node simulators on loopback, each scenario is planned with
//! `up --dry-run --out FILE` and carried out with `up --plan FILE`, and the
//! actions the run reports equal the planned ones (kind, node, from → to,
//! order). A saved plan whose world moved (the inventory, a `${NAME}`, a
//! node upgraded out of band, a VM changed in Proxmox) is refused before
//! any change, naming what moved. The plan file holds no secret.
//! (Scaffolding as tests/up/reconcile.rs.)
// A test's stderr is libtest's to capture, not the CLI's one writer.
#![allow(clippy::disallowed_macros)]

use std::path::{Path, PathBuf};
use std::process::Output;

use crate::common;
use common::inventory::{Inventory, NODES};
use common::run::Run;

use common::plan::assert_plan_is_run;
use common::{json, stdout_ok, text};

/// The loopback /24 of scenario `k` (tests/common/net.rs).
fn net(k: u8) -> String {
    common::net::scenario(module_path!(), k)
}

/// The value of `${PLAN_TOKEN}` in the patch: must never reach a plan file.
const VAR_VALUE: &str = "tok-7f3a9c1e55d2b804";

/// The demo cluster (tests/common/demo.rs), with this file's helpers.
use common::demo::DemoCluster as Cluster;

impl Cluster {
    fn plan_file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `imgbuild <args>` with the simulators, this scenario's state dir
    /// and folders, and `${PLAN_TOKEN}` as `var`.
    fn run_with(&self, args: &[&str], var: &str) -> Output {
        let mut run = self.command(args);
        run.env("PLAN_TOKEN", var);
        run.output()
    }

    /// `imgbuild <args>` as the scenario's CI job runs it.
    fn ci(&self, args: &[&str]) -> Output {
        self.run_with(args, VAR_VALUE)
    }

    /// `up --dry-run --out NAME` as JSON: its document.
    fn plan(&self, name: &str) -> serde_json::Value {
        let file = self.plan_file(name);
        let out = self.ci(&[
            "--output",
            "json",
            "up",
            "--dry-run",
            "--out",
            file.to_str().unwrap(),
        ]);
        stdout_ok(&out);
        assert_valid_plan(&file);
        json(&out)
    }

    /// `up --plan NAME <extra>` as JSON.
    fn apply(&self, name: &str, extra: &[&str]) -> (Output, serde_json::Value) {
        let file = self.plan_file(name);
        let mut args = vec!["--output", "json", "up", "--plan", file.to_str().unwrap()];
        args.extend_from_slice(extra);
        let out = self.ci(&args);
        let v = json(&out);
        (out, v)
    }

    /// The volumes in the Proxmox storage `local`, read back from the
    /// simulator's API.
    fn volumes(&self) -> Vec<String> {
        let (code, body) = self
            .pve
            .curl("/nodes/pve/storage/local/content?content=import", &[]);
        assert_eq!(code, 200, "{body}");
        let mut out: Vec<String> = body["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v["volid"].as_str().unwrap().to_owned())
            .collect();
        out.sort();
        out
    }

    fn upgrades(&self) -> u64 {
        let stats = self.nodes.stats();
        NODES
            .iter()
            .map(|(n, ..)| stats["nodes"][n]["day2"]["upgrades"].as_u64().unwrap_or(0))
            .sum()
    }
}

/// The plan file validates against schemas/plan-v1.schema.json.
fn assert_valid_plan(file: &Path) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let schema: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("schemas/plan-v1.schema.json")).unwrap(),
    )
    .unwrap();
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
    let validator = jsonschema::validator_for(&schema).unwrap();
    let errors: Vec<String> = validator.iter_errors(&doc).map(|e| e.to_string()).collect();
    assert!(errors.is_empty(), "{}: {errors:?}\n{doc}", file.display());
}

fn kinds(v: &serde_json::Value) -> Vec<String> {
    v["plan"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| format!("{} {}", a["kind"]["kind"], a["node"]))
        .collect()
}

fn write_patch(dir: &Path) {
    std::fs::write(
        dir.join("env.yaml"),
        "machine:\n  env:\n    PLAN_TOKEN: \"${PLAN_TOKEN}\"\n",
    )
    .unwrap();
}

/// `upgrade --dry-run` and the upgrade part of `up --dry-run` are one
/// renderer's: for the same cluster, the Talos and Kubernetes actions
/// `upgrade` shows (JSON rows and `plan:` lines) are `up`'s, in `up`'s
/// order. `up` adds what it alone compares (each upgrade's config, the
/// etcd snapshot).
fn assert_upgrade_renders_as_up(c: &Cluster, scenario: &str) {
    const UPGRADE_KINDS: [&str; 3] = ["upgradeTalos", "upgradeKubernetes", "syncManifests"];
    let out = c.ci(&["--output", "json", "up", "--dry-run"]);
    stdout_ok(&out);
    let up_json = json(&out);
    let out = c.ci(&["--output", "json", "upgrade", "--dry-run"]);
    stdout_ok(&out);
    let upgrade_json = json(&out);
    let up_rows: Vec<&serde_json::Value> = up_json["plan"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| UPGRADE_KINDS.contains(&a["kind"]["kind"].as_str().unwrap()))
        .collect();
    let upgrade_rows: Vec<&serde_json::Value> =
        upgrade_json["plan"].as_array().unwrap().iter().collect();
    assert!(!upgrade_rows.is_empty(), "{scenario}: {upgrade_json}");
    assert_eq!(
        upgrade_rows, up_rows,
        "{scenario}: upgrade's rows are not up's"
    );
    // The text: the same lines, word for word.
    let lines = |args: &[&str]| -> Vec<String> {
        let out = c.ci(args);
        stdout_ok(&out);
        text(&out.stdout)
            .lines()
            .filter(|l| l.starts_with("plan: "))
            .map(str::to_owned)
            .collect()
    };
    let upgrade_lines = lines(&["upgrade", "--dry-run"]);
    let up_lines = lines(&["up", "--dry-run"]);
    let mut at = 0;
    for l in &upgrade_lines {
        match up_lines[at..].iter().position(|u| u == l) {
            Some(i) => at += i + 1,
            None => panic!(
                "{scenario}: `{l}` of upgrade --dry-run is not (in order) in up --dry-run's:\n{}",
                up_lines.join("\n")
            ),
        }
    }
    assert_eq!(upgrade_lines.len(), upgrade_rows.len(), "{upgrade_lines:?}");
}

/// Create, a patch edit with a `${NAME}`, a memory change, a version bump:
/// each planned to a file and carried out from it, the run's actions the
/// plan's; each kind of world change in between refused before any change.
#[test]
fn each_saved_plan_is_what_its_run_does_and_a_moved_world_refuses_it() {
    let c = Cluster::start(net(1));

    // Create: five nodes from nothing.
    let planned = c.plan("create.json");
    assert!(
        kinds(&planned).contains(&"\"bootstrapEtcd\" \"cp-01\"".to_owned()),
        "{planned}"
    );
    let (out, run) = c.apply("create.json", &[]);
    stdout_ok(&out);
    assert_eq!(run["healthy"], true, "{run}");
    assert_plan_is_run("create", &planned, &run);

    // A patch edit that uses ${PLAN_TOKEN}.
    write_patch(c.dir.path());
    c.write(&c.inventory().append("patches:\n  all: [env.yaml]\n"));
    let planned = c.plan("patch.json");
    let file = std::fs::read_to_string(c.plan_file("patch.json")).unwrap();
    assert!(file.contains("PLAN_TOKEN"), "{file}");
    // No secret in the plan file: the ${NAME} value, the Proxmox token, any
    // key of the cluster's secrets.
    assert!(!file.contains(VAR_VALUE), "{file}");
    assert!(!file.contains(&c.pve.token), "{file}");
    let secrets = std::fs::read_to_string(c.dir.path().join("state/secrets.yaml")).unwrap();
    for value in secrets
        .lines()
        .filter_map(|l| l.split_once(": ").map(|(_, v)| v.trim()))
        .filter(|v| v.len() >= 16)
    {
        assert!(
            !file.contains(value),
            "a secret of secrets.yaml in the plan"
        );
    }
    // Another ${PLAN_TOKEN} value: refused, naming it; nothing applied.
    let applies = c.nodes.stats()["nodes"]["cp-01"]["applies"].clone();
    let file = c.plan_file("patch.json");
    let o = c.run_with(
        &["up", "--plan", file.to_str().unwrap()],
        "another-value-0000",
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    assert!(
        text(&o.stderr).contains("${PLAN_TOKEN} changed since the plan"),
        "{}",
        text(&o.stderr)
    );
    assert_eq!(c.nodes.stats()["nodes"]["cp-01"]["applies"], applies);
    let (out, run) = c.apply("patch.json", &[]);
    stdout_ok(&out);
    assert_plan_is_run("patch edit", &planned, &run);

    // A memory change needing a reboot, with a patch edit beside it: the
    // configs first, then the settings (their order is the plan's).
    let with_patch = || c.inventory().append("patches:\n  all: [env.yaml]\n");
    std::fs::write(
        c.dir.path().join("env.yaml"),
        "machine:\n  env:\n    PLAN_TOKEN: \"${PLAN_TOKEN}\"\n    STEP: memory\n",
    )
    .unwrap();
    c.write(&with_patch().replace("memory: 2048", "memory: 4096"));
    let planned = c.plan("memory.json");
    assert!(
        kinds(&planned).contains(&"\"changeSettings\" \"worker-02\"".to_owned()),
        "{planned}"
    );
    // The inventory edited after the plan: refused, naming it.
    c.write(&with_patch().replace("memory: 2048", "memory: 3072"));
    let (o, v) = c.apply("memory.json", &[]);
    assert_eq!(o.status.code(), Some(2), "{v}");
    assert!(
        v["refused"]
            .to_string()
            .contains("the inventory was edited"),
        "{v}"
    );
    c.write(&with_patch().replace("memory: 2048", "memory: 4096"));
    // A VM changed in Proxmox after the plan (its network put on VLAN 42,
    // which a running VM takes at once; a memory change would wait in
    // Proxmox's pending config until its reboot): refused, naming it.
    let (_, config) = c.pve.curl("/nodes/pve/qemu/304/config", &[]);
    let net0 = config["data"]["net0"].as_str().unwrap().to_owned();
    let (code, body) = c.pve.curl(
        "/nodes/pve/qemu/304/config",
        &[
            "-X",
            "PUT",
            "--data-urlencode",
            &format!("net0={net0},tag=42"),
        ],
    );
    assert_eq!(code, 200, "{body}");
    let (o, v) = c.apply("memory.json", &[]);
    assert_eq!(o.status.code(), Some(2), "{v}");
    assert!(v["refused"].to_string().contains("worker-02"), "{v}");
    let planned = c.plan("memory.json");
    let (out, run) = c.apply("memory.json", &[]);
    stdout_ok(&out);
    assert_plan_is_run("memory change", &planned, &run);
    // The settings (and their reboot) run after the configs, where the
    // plan puts them, not at publish: the run's recorded order says so.
    let steps: Vec<String> = run["plan"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["step"].as_str().unwrap().to_owned())
        .collect();
    let settings = steps.iter().position(|s| s == "settings");
    let configs = steps.iter().rposition(|s| s == "configs");
    assert!(
        configs.is_some() && settings.is_some() && configs < settings,
        "settings not after the configs: {steps:?}"
    );
    assert!(
        !kinds(&run).contains(&"\"updateMachine\" \"worker-02\"".to_owned()),
        "a memory change is a settings action, not a machine update: {run}"
    );

    // A version bump with a patch edit beside it (machine.env: a change
    // Talos v1.11 applies only with a reboot); worker-01 upgraded out of
    // band after the plan.
    std::fs::write(
        c.dir.path().join("env.yaml"),
        "machine:\n  env:\n    PLAN_TOKEN: \"${PLAN_TOKEN}\"\n    STEP: bump\n",
    )
    .unwrap();
    let bumped = with_patch()
        .replace("memory: 2048", "memory: 4096")
        .talos("v1.11.5");
    c.write(&bumped);
    let planned = c.plan("bump.json");
    assert!(
        kinds(&planned).contains(&"\"upgradeTalos\" \"worker-01\"".to_owned()),
        "{planned}"
    );
    // (`upgrade` applies the rendered config without a reboot as its last
    // step: out of band, with the patch the nodes run.)
    let env = |step: &str| {
        std::fs::write(
            c.dir.path().join("env.yaml"),
            format!("machine:\n  env:\n    PLAN_TOKEN: \"${{PLAN_TOKEN}}\"\n    STEP: {step}\n"),
        )
        .unwrap()
    };
    env("memory");
    let o = c.ci(&["upgrade", "worker-01"]);
    stdout_ok(&o);
    env("bump");
    let upgrades = c.upgrades();
    let (o, v) = c.apply("bump.json", &[]);
    assert_eq!(o.status.code(), Some(2), "{v}");
    assert!(
        v["refused"]
            .to_string()
            .contains("upgradeTalos worker-01 is no longer what a plan does now"),
        "{v}"
    );
    assert_eq!(c.upgrades(), upgrades, "a refused plan upgraded a node");
    let planned = c.plan("bump.json");
    assert_upgrade_renders_as_up(&c, "version bump");
    // The run's etcd snapshot comes before the first control plane moves.
    let kinds_now = kinds(&planned);
    let snapshot = kinds_now.iter().position(|k| k == "\"snapshotEtcd\" null");
    let first_cp = kinds_now
        .iter()
        .position(|k| k.starts_with("\"upgradeTalos\" \"cp-"));
    assert!(
        snapshot.is_some() && snapshot < first_cp,
        "no etcd snapshot before the first control-plane upgrade: {kinds_now:?}"
    );
    // Existing VMs upgrade through the installer: no image is built or
    // uploaded for them, planned or done, and the storage holds no new
    // volume afterwards.
    let images = |v: &serde_json::Value| -> Vec<String> {
        kinds(v)
            .into_iter()
            .filter(|k| k.starts_with("\"buildImage\"") || k.starts_with("\"uploadImage\""))
            .collect()
    };
    assert_eq!(images(&planned), Vec::<String>::new(), "{planned}");
    // Every node's config changes with the bump (the patch edit, and the
    // installer its install.image names): each an applyConfig of its own,
    // planned and done, none left for the configs after it.
    let configs = |v: &serde_json::Value| -> Vec<(String, String)> {
        v["plan"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|a| a["kind"]["kind"] == "applyConfig")
            .map(|a| {
                (
                    a["node"].as_str().unwrap().to_owned(),
                    a["outcome"].as_str().unwrap().to_owned(),
                )
            })
            .collect()
    };
    let mut nodes: Vec<String> = configs(&planned).into_iter().map(|(n, _)| n).collect();
    nodes.sort();
    assert_eq!(
        nodes,
        NODES.map(|(n, ..)| n.to_owned()),
        "not every node's config change planned: {planned}"
    );
    let before = c.volumes();
    let (out, run) = c.apply("bump.json", &[]);
    stdout_ok(&out);
    assert_plan_is_run("version bump with a patch edit", &planned, &run);
    assert!(
        configs(&run).iter().all(|(_, outcome)| outcome == "done"),
        "{run}"
    );
    assert_eq!(images(&run), Vec::<String>::new(), "{run}");
    assert_eq!(c.volumes(), before, "the bump stored a new volume");
    // What was planned is what the nodes run: a new dry run has nothing
    // left for their configs.
    let after = c.plan("after-bump.json");
    assert_eq!(configs(&after), Vec::new(), "{after}");

    // worker-02 leaves the inventory: its removal, its VM's deletion and
    // the prune of the upload only that VM used are all in the plan.
    let mut gone = Inventory::new("demo").vip(&format!("{}.10", c.net));
    for (name, host, role) in NODES.into_iter().filter(|(n, ..)| *n != "worker-02") {
        gone = gone
            .node(common::inventory::Node::new(name, role).address(&format!("{}.{host}", c.net)));
    }
    c.write(
        &gone
            .metal("raw")
            .proxmox(true)
            .append("patches:\n  all: [env.yaml]\n")
            .replace("memory: 2048", "memory: 4096")
            .talos("v1.11.5"),
    );
    let planned = c.plan("remove.json");
    let kinds_now = kinds(&planned);
    assert!(
        kinds_now.contains(&"\"removeNode\" \"worker-02\"".to_owned())
            && kinds_now.contains(&"\"deleteMachine\" \"worker-02\"".to_owned())
            && kinds_now.iter().any(|k| k.starts_with("\"prune\"")),
        "{planned}"
    );
    // The volume that prune would delete, now used by another VM (as a
    // cdrom of cp-01's): refused before any change, naming it.
    let item = planned["plan"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["kind"]["kind"] == "prune")
        .map(|a| a["kind"]["item"].as_str().unwrap().to_owned())
        .unwrap();
    let volid = item
        .strip_prefix("volume ")
        .and_then(|v| v.split(' ').next())
        .unwrap()
        .to_owned();
    let attach = |params: &[&str]| {
        let mut args = vec!["-X", "PUT"];
        for p in params {
            args.extend_from_slice(&["--data-urlencode", p]);
        }
        let (code, body) = c.pve.curl("/nodes/pve/qemu/300/config", &args);
        assert_eq!(code, 200, "{body}");
    };
    attach(&[&format!("ide3={volid},media=cdrom")]);
    let removes = c.nodes.stats()["nodes"]["worker-02"].clone();
    let (o, v) = c.apply("remove.json", &["--allow-destroy"]);
    assert_eq!(o.status.code(), Some(2), "{v}");
    assert!(
        v["refused"]
            .to_string()
            .contains(&format!("prune of {item}")),
        "{v}"
    );
    assert!(
        c.pve.curl("/nodes/pve/qemu/304/config", &[]).0 == 200,
        "VM 304 deleted"
    );
    assert_eq!(c.nodes.stats()["nodes"]["worker-02"], removes);
    attach(&["delete=ide3"]);
    let (out, run) = c.apply("remove.json", &["--allow-destroy"]);
    stdout_ok(&out);
    assert_plan_is_run("node removed, then prune", &planned, &run);

    // A Kubernetes bump: the components, then the bootstrap manifests'
    // sync, each an action of its own; no Talos node moves, no snapshot.
    let inventory = std::fs::read_to_string(c.config()).unwrap();
    std::fs::write(
        c.config(),
        inventory.replace("kubernetesVersion: v1.32.1", "kubernetesVersion: v1.33.5"),
    )
    .unwrap();
    let planned = c.plan("kubernetes.json");
    assert_upgrade_renders_as_up(&c, "Kubernetes bump");
    let kinds_now = kinds(&planned);
    assert_eq!(
        kinds_now,
        ["\"upgradeKubernetes\" null", "\"syncManifests\" null"],
        "{planned}"
    );
    let (out, run) = c.apply("kubernetes.json", &[]);
    stdout_ok(&out);
    assert_plan_is_run("Kubernetes bump", &planned, &run);
    let outcomes: Vec<&serde_json::Value> = run["plan"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| &a["outcome"])
        .collect();
    assert!(outcomes.iter().all(|o| *o == "done"), "{run}");
}

/// The schema is not a rubber stamp: a plan file with an unknown kind, a
/// value where a digest belongs, or a format it does not describe fails.
#[test]
fn the_plan_schema_rejects_what_a_plan_file_cannot_hold() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("plan.json");
    let good = serde_json::json!({
        "format": 1, "cluster": "demo", "target": "proxmox", "salt": "0".repeat(64),
        "observed": {"inventory": "a".repeat(64), "patches": [], "vars": {"TOKEN": "b".repeat(64)}, "nodes": [
            {"node": "cp-01", "talos": "configured", "talosVersion": "v1.11.2", "machine": {"vm": 300}, "volume": null}]},
        "actions": [{"step": "upgrade", "node": "cp-01", "kind": "upgradeTalos",
            "version": {"from": "v1.11.2", "to": "v1.11.5"}, "destructive": false}]
    });
    let schema: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("schemas/plan-v1.schema.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let validator = jsonschema::validator_for(&schema).unwrap();
    assert!(validator.is_valid(&good));
    std::fs::write(&file, good.to_string()).unwrap();
    assert_valid_plan(&file);
    let mut bad = good.clone();
    bad["actions"][0]["kind"] = "rebootEverything".into();
    assert!(!validator.is_valid(&bad));
    let mut bad = good.clone();
    bad["observed"]["vars"]["TOKEN"] = "the-value-itself".into();
    assert!(!validator.is_valid(&bad));
    let mut bad = good.clone();
    bad["actions"][0]["version"] = "v1.11.5".into();
    assert!(!validator.is_valid(&bad));
    let mut bad = good;
    bad["format"] = 2.into();
    assert!(!validator.is_valid(&bad));
}

/// A plan file of another format is refused as such.
#[test]
fn a_plan_file_of_another_format_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("plan.json");
    let config = Inventory::loopback().write(dir.path());
    // Another number, the right one as a string, one that wraps to 1 in 32
    // bits, none: each named as it is.
    for (format, shown) in [
        ("99", "99"),
        ("1.0", "1.0"),
        (r#""1""#, r#""1""#),
        ("4294967297", "4294967297"),
        ("null", "missing"),
    ] {
        std::fs::write(&file, format!(r#"{{"format": {format}, "actions": []}}"#)).unwrap();
        let o = Run::with_config(&config, &["up", "--plan", file.to_str().unwrap()]).output();
        assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
        assert!(
            text(&o.stderr).contains(&format!(
                "is plan format {shown}; this imgbuild reads format 1"
            )),
            "{}",
            text(&o.stderr)
        );
    }
}

/// `replace` and `--replace-disk`, then a prune: each dry run lists what
/// its run does, in the order it does it (the removal first).
#[test]
fn replace_and_replace_disk_do_what_their_dry_runs_show() {
    let c = Cluster::start(net(2));
    let planned = c.plan("create.json");
    let (out, run) = c.apply("create.json", &[]);
    stdout_ok(&out);
    assert_plan_is_run("create", &planned, &run);

    // A new disk for worker-01 from a fresh image.
    let dry = |args: &[&str]| {
        let mut all = vec!["--output", "json"];
        all.extend_from_slice(args);
        all.push("--dry-run");
        let out = c.ci(&all);
        stdout_ok(&out);
        json(&out)
    };
    let wet = |args: &[&str]| {
        let mut all = vec!["--output", "json"];
        all.extend_from_slice(args);
        let out = c.ci(&all);
        stdout_ok(&out);
        json(&out)
    };
    let args = ["up", "worker-01", "--replace-disk"];
    let planned = dry(&args);
    let kinds_now = kinds(&planned);
    assert!(
        kinds_now.contains(&"\"updateMachine\" \"worker-01\"".to_owned()),
        "{planned}"
    );
    let run = wet(&args);
    assert_eq!(run["healthy"], true, "{run}");
    assert_plan_is_run("--replace-disk", &planned, &run);

    // Then a prune of what the old disk left.
    let args = ["up", "--allow-destroy"];
    let planned = dry(&args);
    let run = wet(&args);
    assert_plan_is_run("prune after --replace-disk", &planned, &run);

    // `replace worker-02`: removed (drained, reset, its VM deleted) and
    // made again; its dry run shows all of it, the removal first.
    let args = ["replace", "worker-02"];
    let planned = dry(&args);
    let kinds_now = kinds(&planned);
    assert_eq!(
        kinds_now.first().map(String::as_str),
        Some("\"removeNode\" \"worker-02\""),
        "{planned}"
    );
    for k in [
        "\"deleteMachine\" \"worker-02\"",
        "\"createMachine\" \"worker-02\"",
        "\"startMachine\" \"worker-02\"",
        "\"applyFirstConfig\" \"worker-02\"",
    ] {
        assert!(
            kinds_now.contains(&k.to_owned()),
            "{k} not planned: {planned}"
        );
    }
    let run = wet(&args);
    assert_eq!(run["healthy"], true, "{run}");
    assert_plan_is_run("replace", &planned, &run);
}

/// A plan file with a field no plan has, or a salt shorter than the one
/// imgbuild writes, is refused as a usage error before anything is read
/// from the world.
#[test]
fn a_plan_file_with_unknown_fields_or_a_short_salt_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("plan.json");
    let config = Inventory::loopback().write(dir.path());
    let plan = |salt: &str, extra_top: &str, extra_action: &str| {
        format!(
            r#"{{"format": 1, "cluster": "demo", "target": "none", "salt": "{salt}"{extra_top},
              "observed": {{"inventory": "{a}", "patches": [], "vars": {{}}, "nodes": []}},
              "actions": [{{"step": "kubernetes", "kind": "upgradeKubernetes",
                "version": {{"from": "v1.32.1", "to": "v1.33.5"}}, "destructive": false{extra_action}}}]}}"#,
            a = "a".repeat(64)
        )
    };
    let full = "0".repeat(64);
    for (body, says) in [
        (
            plan(&full, r#", "approvedBy": "ci""#, ""),
            "unknown field .approvedBy",
        ),
        (
            plan(&full, "", r#", "force": true"#),
            "unknown field .actions[0].force",
        ),
        (
            plan(&"0".repeat(16), "", ""),
            "the plan's salt is not 64 hex digits",
        ),
    ] {
        std::fs::write(&file, body).unwrap();
        let o = Run::with_config(&config, &["up", "--plan", file.to_str().unwrap()]).output();
        assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
        assert!(
            text(&o.stderr).contains(says),
            "{says}: {}",
            text(&o.stderr)
        );
    }
}
