//! `imgbuild plan` end to end: the artifacts of the example inventories
//! (counts and exact commands), the GitHub matrix rules, and docs/ci.md
//! itself: every imgbuild command in its workflows is run here, the plan is
//! parsed as a matrix, and one entry's command publishes exactly its artifact
//! to the Image Factory and Proxmox VE simulators. Also checks action.yml.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common;
use common::sims::{Hc, Pve, Sim};
use common::{imgbuild, root, stdout_ok, text};

const SECRET: &str = "s3cr3t-sentinel-0123456789";

/// `imgbuild --config C… plan ARGS` from the repository root.
fn plan(configs: &[&str], args: &[&str]) -> Output {
    let mut all = Vec::new();
    for c in configs {
        all.extend(["--config", c]);
    }
    all.push("plan");
    all.extend(args);
    imgbuild(&all)
}

fn plan_json(configs: &[&str], args: &[&str]) -> Vec<serde_json::Value> {
    let mut args = args.to_vec();
    args.extend(["--output", "json"]);
    let v: serde_json::Value = serde_json::from_str(&stdout_ok(&plan(configs, &args))).unwrap();
    v["artifacts"].as_array().unwrap().clone()
}

const ATLAS: &str = "examples/atlas/cluster.yaml";

/// `schematic --all` of an inventory: every node's ID and the base's.
fn schematic_ids(config: &str) -> serde_json::Value {
    let o = imgbuild(&["--config", config, "--output", "json", "schematic", "--all"]);
    serde_json::from_str(&stdout_ok(&o)).unwrap()
}
const LAB: &str = "examples/ci/clusters/lab.yaml";
const HETZNER: &str = "examples/ci/clusters/hetzner.yaml";

#[test]
fn the_atlas_example_needs_one_base_image_by_the_patch_route() {
    let a = plan_json(&[ATLAS], &[]);
    assert_eq!(a.len(), 1, "{a:?}");
    assert_eq!(a[0]["kind"], "base-image");
    assert_eq!(
        a[0]["command"],
        "imgbuild --config examples/atlas/cluster.yaml build cp-01 cp-02 cp-03 worker-01 worker-02"
    );
    // The base is the cluster's schematic without META, as `schematic --all` names it.
    let all = schematic_ids(ATLAS);
    let base = all
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["node"] == "base")
        .unwrap();
    assert_eq!(a[0]["schematicId"], base["id"]);
}

#[test]
fn the_factory_route_plans_one_image_per_node_with_its_own_schematic() {
    let a = plan_json(&[ATLAS], &["--route", "factory"]);
    let all = schematic_ids(ATLAS);
    let nodes = ["cp-01", "cp-02", "cp-03", "worker-01", "worker-02"];
    assert_eq!(a.len(), nodes.len());
    for (entry, node) in a.iter().zip(nodes) {
        assert_eq!(entry["kind"], "node-image");
        assert_eq!(entry["name"], format!("atlas-{node}"));
        assert_eq!(
            entry["command"],
            format!("imgbuild --config examples/atlas/cluster.yaml build --route factory {node}")
        );
        let own = all
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["node"] == node)
            .unwrap();
        assert_eq!(entry["schematicId"], own["id"], "{node}");
    }
}

#[test]
fn several_inventories_are_planned_in_one_run() {
    let a = plan_json(&[HETZNER, LAB], &[]);
    let got: Vec<(&str, &str)> = a
        .iter()
        .map(|e| (e["kind"].as_str().unwrap(), e["command"].as_str().unwrap()))
        .collect();
    assert_eq!(
        got,
        [
            (
                "snapshot",
                "imgbuild --config examples/ci/clusters/hetzner.yaml publish cp-01"
            ),
            (
                "snapshot",
                "imgbuild --config examples/ci/clusters/hetzner.yaml publish worker-01"
            ),
            (
                "base-image",
                "imgbuild --config examples/ci/clusters/lab.yaml publish cp-01 cp-02 cp-03 worker-01"
            ),
            (
                "base-image",
                "imgbuild --config examples/ci/clusters/lab.yaml publish worker-02"
            ),
        ]
    );
    assert_eq!(
        a[0]["nodes"],
        serde_json::json!(["cp-01", "cp-02", "cp-03"])
    );
    assert_eq!(a[1]["nodes"], serde_json::json!(["worker-01", "worker-02"]));
    assert!(
        a[0].get("format").is_none(),
        "a snapshot has no file format"
    );
    // --target keeps one kind of target.
    assert_eq!(plan_json(&[HETZNER, LAB], &["--target", "hcloud"]).len(), 2);
    assert_eq!(plan_json(&[HETZNER, LAB], &["--target", "files"]).len(), 0);
}

/// One line of compact JSON: only `include`, entries with exactly name,
/// config and command (strings), unique names that GitHub accepts as job and
/// artifact names, and no secret from the environment anywhere.
#[test]
fn the_github_format_is_a_valid_matrix_without_secrets() {
    let o = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
        .args(["--config", HETZNER, "--config", LAB, "--config", ATLAS])
        .args(["plan", "--format", "github"])
        .current_dir(root())
        .env("HCLOUD_TOKEN", SECRET)
        .env("PROXMOX_VE_API_TOKEN", format!("root@pam!ci={SECRET}"))
        .output()
        .unwrap();
    let out = stdout_ok(&o);
    assert!(out.ends_with('\n') && out.lines().count() == 1, "{out:?}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(out.trim_end(), v.to_string(), "not compact");
    assert!(!out.contains(SECRET));
    let top = v.as_object().unwrap();
    assert_eq!(top.keys().collect::<Vec<_>>(), ["include"]);
    let include = v["include"].as_array().unwrap();
    assert_eq!(include.len(), 5);
    let mut names = BTreeSet::new();
    for e in include {
        let e = e.as_object().unwrap();
        assert_eq!(
            e.keys().map(String::as_str).collect::<BTreeSet<_>>(),
            BTreeSet::from(["name", "config", "command"]),
            "{e:?}"
        );
        let name = e["name"].as_str().unwrap();
        assert!(
            name.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)),
            "{name}"
        );
        assert!(names.insert(name.to_owned()), "duplicate {name}");
        let config = e["config"].as_str().unwrap();
        let command = e["command"].as_str().unwrap();
        assert!(
            command.starts_with(&format!("imgbuild --config {config} ")),
            "{command}"
        );
    }
}

#[test]
fn an_empty_plan_is_an_empty_include_and_exit_0() {
    let o = plan(&[HETZNER], &["--target", "proxmox", "--format", "github"]);
    assert_eq!(stdout_ok(&o), "{\"include\":[]}\n");
    let o = plan(&[HETZNER], &["--target", "proxmox", "--format", "gitlab"]);
    let jobs: serde_yaml_ng::Mapping = serde_yaml_ng::from_str(&stdout_ok(&o)).unwrap();
    assert_eq!(jobs.len(), 1, "GitLab needs one job: {jobs:?}");
}

/// An inventory of `n` nodes (one control plane); with the factory route
/// each is an artifact.
fn big_inventory(dir: &Path, n: usize) -> PathBuf {
    let mut inv = String::from(
        "cluster: {name: big, talosVersion: v1.11.2, kubernetesVersion: v1.32.1, endpoint: 'https://10.0.0.2:6443'}\n\
         network: {cidr: 10.0.0.0/16, gateway: 10.0.0.1, interface: eth0}\nnodes:\n",
    );
    for i in 0..n {
        let role = if i == 0 { "controlplane" } else { "worker" };
        inv.push_str(&format!(
            "  - {{name: n{i}, role: {role}, address: 10.0.{}.{}}}\n",
            1 + i / 200,
            10 + i % 200
        ));
    }
    let path = dir.join("big.yaml");
    std::fs::write(&path, inv).unwrap();
    path
}

#[test]
fn more_than_256_matrix_entries_is_an_error_that_suggests_splitting() {
    let dir = tempfile::tempdir().unwrap();
    let at_limit = big_inventory(dir.path(), 256);
    let o = plan(
        &[at_limit.to_str().unwrap()],
        &["--route", "factory", "--format", "github"],
    );
    let v: serde_json::Value = serde_json::from_str(&stdout_ok(&o)).unwrap();
    assert_eq!(v["include"].as_array().unwrap().len(), 256);

    let over = big_inventory(dir.path(), 257);
    let over = over.to_str().unwrap();
    let o = plan(&[over], &["--route", "factory", "--format", "github"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(o.stdout.is_empty(), "{}", text(&o.stdout));
    let err = text(&o.stderr);
    assert!(
        err.contains("257") && err.contains("256") && err.contains("split"),
        "{err}"
    );
    // The same as one JSON document for CI.
    let o = plan(
        &[over],
        &[
            "--route", "factory", "--format", "github", "--output", "json",
        ],
    );
    assert_eq!(o.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["error"].as_str().unwrap().contains("split"), "{v}");
}

#[test]
fn clusters_with_the_same_name_cannot_share_a_plan() {
    let o = plan(&[LAB, LAB], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("different names"));
}

/// docs/ci.md's fenced YAML blocks, by the path named in each one's first
/// line (`# .github/workflows/x.yml`); unnamed blocks under "".
fn doc_blocks() -> BTreeMap<String, Vec<String>> {
    let doc = std::fs::read_to_string(root().join("docs/ci.md")).unwrap();
    let mut blocks: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut rest = doc.as_str();
    while let Some(start) = rest.find("```yaml\n") {
        let body = &rest[start + 8..];
        let end = body.find("```").unwrap();
        let block = &body[..end];
        let first = block.lines().next().unwrap_or("");
        let name = first
            .strip_prefix("# ")
            .filter(|n| n.starts_with('.'))
            .unwrap_or("");
        blocks
            .entry(name.to_owned())
            .or_default()
            .push(block.to_owned());
        rest = &body[end + 3..];
    }
    blocks
}

fn doc_json_sample() -> serde_json::Value {
    let doc = std::fs::read_to_string(root().join("docs/ci.md")).unwrap();
    let start = doc.find("```json\n").unwrap() + 8;
    let end = start + doc[start..].find("```").unwrap();
    serde_json::from_str(&doc[start..end]).unwrap()
}

/// Every shell line of a workflow that runs imgbuild: GitHub `run` scripts
/// and GitLab `script`/`before_script` items.
fn imgbuild_lines(v: &serde_yaml_ng::Value, out: &mut Vec<String>) {
    use serde_yaml_ng::Value as Y;
    match v {
        Y::Mapping(m) => {
            for (k, v) in m {
                let key = k.as_str().unwrap_or("");
                let scripts: Vec<&str> = match (key, v) {
                    ("run", Y::String(s)) => vec![s.as_str()],
                    ("script" | "before_script", Y::Sequence(items)) => {
                        items.iter().filter_map(|i| i.as_str()).collect()
                    }
                    _ => Vec::new(),
                };
                for s in scripts {
                    for line in s.lines() {
                        let runs_imgbuild = line.trim_start().starts_with("imgbuild ")
                            || line.contains("$(imgbuild ")
                            || line.contains("matrix.command");
                        if runs_imgbuild {
                            out.push(line.trim().to_owned());
                        }
                    }
                }
                imgbuild_lines(v, out);
            }
        }
        Y::Sequence(items) => items.iter().for_each(|i| imgbuild_lines(i, out)),
        _ => {}
    }
}

/// The `run` script of the step with `id` in job `job`.
fn step_run(workflow: &serde_yaml_ng::Value, job: &str, id: &str) -> String {
    workflow["jobs"][job]["steps"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|s| s["id"].as_str() == Some(id))
        .unwrap_or_else(|| panic!("no step {id} in job {job}"))["run"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// The `run` script of the job's step that runs the matrix entry's command.
fn matrix_step(workflow: &serde_yaml_ng::Value, job: &str) -> String {
    workflow["jobs"][job]["steps"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|s| s["run"].as_str())
        .find(|r| r.contains("matrix.command"))
        .unwrap_or_else(|| panic!("job {job} runs no matrix command"))
        .to_owned()
}

/// A CI checkout: the example inventories under `clusters/`.
struct Checkout {
    dir: tempfile::TempDir,
    /// Every script run so far, to prove each documented line ran.
    ran: Vec<String>,
}

impl Checkout {
    fn new() -> Checkout {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("clusters")).unwrap();
        for name in ["lab.yaml", "hetzner.yaml"] {
            std::fs::copy(
                root().join("examples/ci/clusters").join(name),
                dir.path().join("clusters").join(name),
            )
            .unwrap();
        }
        Checkout {
            dir,
            ran: Vec::new(),
        }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    /// Runs `script` with bash (as GitHub's `run` does: -e, pipefail) in
    /// the checkout, imgbuild on PATH.
    fn bash(&mut self, script: &str, env: &[(&str, &str)]) -> Output {
        let bin = PathBuf::from(env!("CARGO_BIN_EXE_imgbuild"));
        let path = format!(
            "{}:{}",
            bin.parent().unwrap().display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let mut cmd = Command::new("bash");
        cmd.args(["--noprofile", "--norc", "-eo", "pipefail", "-c", script])
            .current_dir(self.dir.path())
            .env("PATH", path)
            .env("XDG_CACHE_HOME", self.path("cache"))
            .env("GITHUB_OUTPUT", self.path("github-output"))
            .env_remove("IMGBUILD_CONFIG")
            .env_remove("IMGBUILD_FACTORY")
            .env_remove("PROXMOX_VE_INSECURE");
        for (k, v) in env {
            cmd.env(k, v);
        }
        self.ran.push(script.to_owned());
        cmd.output().unwrap()
    }

    /// What the last plan step wrote to $GITHUB_OUTPUT.
    fn output(&self, key: &str) -> String {
        let all = std::fs::read_to_string(self.path("github-output")).unwrap();
        let prefix = format!("{key}=");
        all.lines()
            .rev()
            .find_map(|l| l.strip_prefix(&prefix))
            .unwrap_or_else(|| panic!("no {key} in $GITHUB_OUTPUT: {all}"))
            .to_owned()
    }
}

fn workflow(blocks: &BTreeMap<String, Vec<String>>, path: &str) -> serde_yaml_ng::Value {
    let text = &blocks
        .get(path)
        .unwrap_or_else(|| panic!("docs/ci.md has no {path}"))[0];
    serde_yaml_ng::from_str(text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The matrix a plan step produced, checked against GitHub's rules.
fn matrix(checkout: &Checkout) -> Vec<serde_json::Value> {
    let line = checkout.output("matrix");
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(line, v.to_string(), "one compact line");
    v["include"].as_array().unwrap().clone()
}

#[test]
fn the_documented_workflows_run_and_one_entry_publishes_exactly_its_artifact() {
    let blocks = doc_blocks();
    let hcloud = workflow(&blocks, ".github/workflows/talos-hcloud.yml");
    let proxmox = workflow(&blocks, ".github/workflows/talos-proxmox.yml");
    let gitlab = workflow(&blocks, ".gitlab-ci.yml");
    let template = &blocks[".gitlab/imgbuild-jobs.yml"][0];
    let mut c = Checkout::new();

    // Both GitHub workflows guard the matrix job against an empty plan and
    // never fail fast.
    for w in [&hcloud, &proxmox] {
        let publish = &w["jobs"]["publish"];
        assert_eq!(
            publish["if"].as_str(),
            Some("needs.plan.outputs.matrix != '{\"include\":[]}'")
        );
        assert_eq!(publish["strategy"]["fail-fast"].as_bool(), Some(false));
        assert!(publish["strategy"]["max-parallel"].as_u64().unwrap() <= 4);
        assert_eq!(
            publish["strategy"]["matrix"].as_str(),
            Some("${{ fromJSON(needs.plan.outputs.matrix) }}")
        );
    }

    // Hetzner: the plan step gives a matrix of two snapshots.
    let o = c.bash(&step_run(&hcloud, "plan", "plan"), &[]);
    stdout_ok(&o);
    let snapshots = matrix(&c);
    assert_eq!(snapshots.len(), 2, "{snapshots:?}");
    assert_eq!(
        snapshots[0]["command"],
        "imgbuild --config clusters/hetzner.yaml publish cp-01"
    );

    // Proxmox: the plan step, then one entry's step against the simulators.
    let o = c.bash(&step_run(&proxmox, "plan", "plan"), &[]);
    stdout_ok(&o);
    let entries = matrix(&c);
    assert_eq!(entries.len(), 2, "{entries:?}");
    assert!(
        doc_json_sample()["include"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| entries.contains(e)),
        "the JSON sample in docs/ci.md is not what plan prints"
    );
    let entry = entries
        .iter()
        .find(|e| e["command"].as_str().unwrap().ends_with(" worker-02"))
        .unwrap();
    let step = matrix_step(&proxmox, "publish");
    assert_eq!(
        step,
        matrix_step(&hcloud, "publish"),
        "both workflows run entries alike"
    );
    let script = step.replace("${{ matrix.command }}", entry["command"].as_str().unwrap());
    let sim = Sim::start(&[]);
    let pve = Pve::start(&[]);
    let o = c.bash(
        &script,
        &[
            ("IMGBUILD_FACTORY", sim.url.as_str()),
            ("PROXMOX_VE_ENDPOINT", pve.url.as_str()),
            ("PROXMOX_VE_API_TOKEN", pve.token.as_str()),
            ("PROXMOX_VE_FINGERPRINT", pve.fingerprint.as_str()),
        ],
    );
    stdout_ok(&o);
    c.ran.push(step.clone());
    let result: serde_json::Value =
        serde_json::from_slice(&std::fs::read(c.path("result.json")).unwrap()).unwrap();
    let published = result["nodes"].as_array().unwrap();
    assert_eq!(published.len(), 1, "{result}");
    assert_eq!(published[0]["node"], "worker-02");
    let stats = pve.stats();
    assert_eq!(stats["uploads"], 1, "{stats}");
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(c.path("out/manifest.json")).unwrap()).unwrap();
    let built: Vec<&String> = manifest["images"].as_object().unwrap().keys().collect();
    assert_eq!(built, ["worker-02"], "only this artifact's node is built");
    let sha = manifest["images"]["worker-02"]["sha256"].as_str().unwrap();
    // A raw image crosses the wire as qcow2 (publish.proxmox.upload).
    let volume = format!("lab_worker-02-v1.11.2-{}.qcow2", &sha[..12]);
    assert_eq!(published[0]["volid"], format!("local:import/{volume}"));
    assert!(
        pve.stored(&volume).is_file(),
        "{volume} is not in the storage"
    );
    assert_eq!(
        std::fs::read_dir(pve.stored(&volume).parent().unwrap())
            .unwrap()
            .count(),
        1,
        "exactly one volume stored"
    );

    // The snapshot collector, with that result standing in for a job's.
    std::fs::create_dir_all(c.path("results/result-one")).unwrap();
    std::fs::copy(
        c.path("result.json"),
        c.path("results/result-one/result.json"),
    )
    .unwrap();

    // Hetzner: the first entry's step against the factory and Hetzner
    // simulators makes exactly its snapshot, and leaves nothing temporary.
    let hc = Hc::start(&[]);
    let script = step.replace(
        "${{ matrix.command }}",
        snapshots[0]["command"].as_str().unwrap(),
    );
    let [(port_var, port), (user_var, user)] = hc.rescue_env();
    let o = c.bash(
        &script,
        &[
            ("IMGBUILD_FACTORY", sim.url.as_str()),
            ("HCLOUD_ENDPOINT", hc.url.as_str()),
            ("HCLOUD_TOKEN", hc.token.as_str()),
            (port_var, port.as_str()),
            (user_var, user.as_str()),
        ],
    );
    stdout_ok(&o);
    let snapshot: serde_json::Value =
        serde_json::from_slice(&std::fs::read(c.path("result.json")).unwrap()).unwrap();
    let made = snapshot["snapshots"].as_array().unwrap();
    assert_eq!(made.len(), 1, "{snapshot}");
    assert_eq!(made[0]["created"], true);
    assert_eq!(made[0]["nodes"], serde_json::json!(["cp-01"]));
    let stats = hc.stats();
    assert_eq!(stats["imagesCreated"], 1, "{stats}");
    assert_eq!(stats["servers"], 0, "{stats}");
    assert_eq!(stats["sshKeys"], 0, "{stats}");
    std::fs::create_dir_all(c.path("results/result-two")).unwrap();
    std::fs::copy(
        c.path("result.json"),
        c.path("results/result-two/result.json"),
    )
    .unwrap();
    let o = c.bash(&step_run(&hcloud, "snapshots", "collect"), &[]);
    stdout_ok(&o);
    let collected: serde_json::Value =
        serde_json::from_slice(&std::fs::read(c.path("snapshots.json")).unwrap()).unwrap();
    let plan = plan_json(&[HETZNER], &["--target", "hcloud"]);
    let listed = collected["snapshots"].as_array().unwrap();
    assert_eq!(listed.len(), plan.len());
    for (s, p) in listed.iter().zip(&plan) {
        let schematic = p["schematicId"].as_str().unwrap();
        assert_eq!(
            s["selector"],
            format!(
                "os=talos,talos-version=v1.11.2,talos-schematic={},arch=amd64",
                &schematic[..32]
            )
        );
    }
    assert_eq!(collected["results"], serde_json::json!([result, snapshot]));
    assert_eq!(
        collected["published"],
        serde_json::json!([{
            "id": made[0]["id"], "nodes": ["cp-01"], "created": true, "labels": made[0]["labels"]
        }])
    );

    // GitLab: the plan job's script (all but the install) writes a child
    // pipeline: the template plus one job per artifact.
    std::fs::create_dir_all(c.path(".gitlab")).unwrap();
    std::fs::write(c.path(".gitlab/imgbuild-jobs.yml"), template).unwrap();
    let script: Vec<&str> = gitlab["plan"]["script"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .filter(|s| !s.starts_with("cargo install"))
        .collect();
    let o = c.bash(&script.join("\n"), &[]);
    stdout_ok(&o);
    let child: serde_yaml_ng::Mapping =
        serde_yaml_ng::from_str(&std::fs::read_to_string(c.path("child-pipeline.yml")).unwrap())
            .unwrap();
    assert!(child.contains_key(".imgbuild"));
    let jobs: Vec<_> = child
        .iter()
        .filter(|(k, _)| !k.as_str().unwrap().starts_with('.'))
        .collect();
    assert_eq!(jobs.len(), 4);
    let all = plan_json(&[HETZNER, LAB], &[]);
    for ((name, job), p) in jobs.iter().zip(&all) {
        assert_eq!(name.as_str(), p["name"].as_str());
        assert_eq!(job["extends"].as_str(), Some(".imgbuild"));
        let command = p["command"].as_str().unwrap().replace("examples/ci/", "");
        assert_eq!(job["script"][0].as_str(), Some(command.as_str()));
    }
    let sample: serde_yaml_ng::Mapping = serde_yaml_ng::from_str(&blocks[""][0]).unwrap();
    for (name, job) in &sample {
        assert_eq!(
            child.get(name),
            Some(job),
            "docs/ci.md's sample job {name:?}"
        );
    }
    // The template's own commands are the install (not imgbuild) and PATH.
    let mut template_lines = Vec::new();
    imgbuild_lines(
        &serde_yaml_ng::from_str(template).unwrap(),
        &mut template_lines,
    );
    assert!(template_lines.is_empty(), "{template_lines:?}");

    // Every documented line that runs imgbuild ran above.
    let mut documented = Vec::new();
    for w in [&hcloud, &proxmox, &gitlab] {
        imgbuild_lines(w, &mut documented);
    }
    assert!(documented.len() >= 6, "{documented:?}");
    for line in &documented {
        assert!(
            c.ran.iter().any(|s| s.contains(line.as_str())),
            "docs/ci.md runs `{line}`, which no test ran"
        );
    }
}

/// action.yml: a composite action with inputs `args` and `version` that,
/// when it builds from source (a commit, a branch, `uses: ./`), caches the
/// cargo registry and the build and installs with `cargo install --locked`;
/// puts imgbuild on PATH and runs `imgbuild <args>`; every shell step is
/// valid bash. The release download: tests/cli/action_download.rs.
#[test]
fn the_action_installs_caches_and_runs_imgbuild() {
    let yaml = std::fs::read_to_string(root().join("action.yml")).unwrap();
    let action: serde_yaml_ng::Value = serde_yaml_ng::from_str(&yaml).unwrap();
    for input in ["args", "version"] {
        let i = &action["inputs"][input];
        assert!(i["description"].as_str().is_some(), "input {input}");
        assert_eq!(i["required"].as_bool(), Some(false), "input {input}");
    }
    assert_eq!(action["runs"]["using"].as_str(), Some("composite"));
    let steps = action["runs"]["steps"].as_sequence().unwrap();
    let cache = steps
        .iter()
        .find(|s| {
            s["uses"]
                .as_str()
                .is_some_and(|u| u.starts_with("actions/cache@"))
        })
        .expect("a cache step");
    let paths = cache["with"]["path"].as_str().unwrap();
    assert!(paths.contains("~/.cargo/registry"), "{paths}");
    assert!(paths.contains("imgbuild-target"), "{paths}");
    let runs: Vec<&str> = steps.iter().filter_map(|s| s["run"].as_str()).collect();
    let install = runs
        .iter()
        .find(|r| r.contains("cargo install --locked"))
        .expect("an install step");
    assert!(install.contains("--path \"$ACTION_PATH\""), "{install}");
    assert!(install.contains("--tag \"$VERSION\""), "{install}");
    assert!(install.contains("GITHUB_PATH"), "{install}");
    let target_dir = steps
        .iter()
        .find(|s| s["run"].as_str() == Some(install))
        .unwrap()["env"]["CARGO_TARGET_DIR"]
        .as_str()
        .unwrap();
    assert!(target_dir.ends_with("imgbuild-target"), "cached target dir");
    assert!(runs.contains(&"imgbuild ${{ inputs.args }}"), "{runs:?}");
    for (i, step) in steps.iter().enumerate() {
        if let Some(run) = step["run"].as_str() {
            assert_eq!(step["shell"].as_str(), Some("bash"), "step {i}");
            let plain = run.replace("${{ inputs.args }}", "--help");
            let o = Command::new("bash")
                .args(["-n", "-c", &plain])
                .output()
                .unwrap();
            assert!(o.status.success(), "step {i}: {}", text(&o.stderr));
        }
    }
}
