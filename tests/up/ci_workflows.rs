//! docs/ci.md's cluster workflow (`.github/workflows/cluster.yml`) run as a
//! local runner runs it (issue 38): each job in a fresh `git clone` of a
//! repository holding only the inventory and `secrets.sops.yaml`, its
//! `run:` steps in order with bash (`-eo pipefail`, as GitHub's `shell:
//! bash`), the workflow's `env` from two CI secrets (the age key and the
//! Proxmox token) and two variables, against the factory, Proxmox VE and
//! Talos node simulators. `uses:` steps are emulated here, each by name in
//! [`emulate`] (checkout, the imgbuild action, artifacts up and down, the
//! pull-request comment); any other fails the test. So do a step that
//! fails and a `run:` step no scenario ran: the docs cannot drift.
//!
//! The scenarios: a pull request on a new cluster plans the creates (its
//! Markdown is the comment); the merge applies that plan from the
//! artifact; the next pull request plans nothing; a push no pull request
//! planned plans anew and applies (nothing). The secrets are made as the
//! docs say, by their `sh` block on a "laptop" clone: `secrets gen`,
//! `secrets encrypt --age` (an `age-keygen` key), the clear state dir
//! removed, the SOPS file committed.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_yaml_ng::Value as Y;

use crate::common;
use common::demo::DemoCluster;
use common::{root, text};

/// The loopback /24 of scenario `k` (tests/common/net.rs).
fn net(k: u8) -> String {
    common::net::scenario(module_path!(), k)
}

/// The workflow's path, as its block's first line names it.
const WORKFLOW: &str = ".github/workflows/cluster.yml";

/// The `uses:` actions this runner emulates, by name (before the `@`).
const EMULATED: [&str; 5] = [
    "actions/checkout",
    "OWNER/imgbuild",
    "actions/upload-artifact",
    "dawidd6/action-download-artifact",
    "marocchino/sticky-pull-request-comment",
];

/// The fenced blocks of docs/ci.md in `lang` whose first line is `first`.
fn doc_block(lang: &str, first: &str) -> String {
    let doc = std::fs::read_to_string(root().join("docs/ci.md")).unwrap();
    let fence = format!("```{lang}\n");
    let mut found = Vec::new();
    let mut rest = doc.as_str();
    while let Some(start) = rest.find(&fence) {
        let body = &rest[start + fence.len()..];
        let end = body.find("```").unwrap();
        let block = &body[..end];
        if block.lines().next() == Some(first) || first.is_empty() {
            found.push(block.to_owned());
        }
        rest = &body[end + 3..];
    }
    assert_eq!(found.len(), 1, "docs/ci.md: one ```{lang} block {first:?}");
    found.remove(0)
}

/// `git ARGS` in `dir`, which must succeed; its stdout.
fn git(dir: &Path, args: &[&str]) -> String {
    let o = Command::new("git")
        .args(["-c", "user.name=ci", "-c", "user.email=ci@example.invalid"])
        .args([
            "-c",
            "init.defaultBranch=main",
            "-c",
            "advice.detachedHead=false",
        ])
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(o.status.success(), "git {args:?}: {}", text(&o.stderr));
    text(&o.stdout)
}

/// A dir holding the built imgbuild as `imgbuild`, for PATH.
fn bin_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_imgbuild"))
        .parent()
        .unwrap()
        .to_owned()
}

/// The GitHub this runner talks to: the repository, the secrets and
/// variables, the artifacts of earlier runs, the pull-request comments.
struct GitHub {
    dir: tempfile::TempDir,
    /// The repository (a non-bare repo: the laptop works in it).
    origin: PathBuf,
    secrets: BTreeMap<&'static str, String>,
    vars: BTreeMap<&'static str, String>,
    /// name → the folder holding what was uploaded.
    artifacts: BTreeMap<String, PathBuf>,
    /// header → body of the sticky comment.
    comments: BTreeMap<String, String>,
    runs: u32,
    /// Every `run:` script executed, as written in the workflow.
    ran: BTreeSet<String>,
}

/// One finished job: its folder (the clone), its step outputs and summary.
struct Job {
    dir: PathBuf,
    summary: String,
}

impl GitHub {
    /// Evaluates the `${{ … }}` expressions in `s` that the workflow uses.
    fn eval(&self, s: &str, outputs: &BTreeMap<String, BTreeMap<String, String>>) -> String {
        let mut out = String::new();
        let mut rest = s;
        while let Some(start) = rest.find("${{") {
            out.push_str(&rest[..start]);
            let end = rest[start..].find("}}").unwrap() + start;
            let expr = rest[start + 3..end].trim();
            let value = if let Some(name) = expr.strip_prefix("secrets.") {
                self.secrets
                    .get(name)
                    .unwrap_or_else(|| {
                        panic!("no CI secret {name}: only the age key and the token")
                    })
                    .clone()
            } else if let Some(name) = expr.strip_prefix("vars.") {
                self.vars[name].clone()
            } else if let Some(step) = expr.strip_prefix("steps.") {
                let (id, key) = step.split_once(".outputs.").unwrap();
                outputs
                    .get(id)
                    .and_then(|o| o.get(key))
                    .unwrap_or_else(|| panic!("step {id} wrote no output {key}"))
                    .clone()
            } else if expr == "github.run_id" {
                self.runs.to_string()
            } else if expr == "github.event.pull_request.number" {
                "1".to_owned()
            } else {
                panic!("this runner does not evaluate ${{{{ {expr} }}}}")
            };
            out.push_str(&value);
            rest = &rest[end + 2..];
        }
        out.push_str(rest);
        out
    }

    /// Runs job `name` of `workflow` for `event` as a fresh runner would.
    fn job(&mut self, workflow: &Y, name: &str, event: &str) -> Job {
        self.runs += 1;
        let job = &workflow["jobs"][name];
        let condition = job["if"].as_str().unwrap_or("");
        assert!(
            condition.starts_with(&format!("github.event_name == '{event}'")),
            "job {name} runs on {event}: if: {condition}"
        );
        let dir = self.dir.path().join(format!("run-{}-{name}", self.runs));
        let home = self.dir.path().join(format!("home-{}", self.runs));
        std::fs::create_dir_all(&home).unwrap();
        let summary_file = home.join("step-summary.md");
        let mut outputs: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
        let env: Vec<(String, String)> = workflow["env"]
            .as_mapping()
            .into_iter()
            .flatten()
            .chain(job["env"].as_mapping().into_iter().flatten())
            .map(|(k, v)| {
                (
                    k.as_str().unwrap().to_owned(),
                    self.eval(v.as_str().unwrap(), &outputs),
                )
            })
            .collect();
        for (i, step) in job["steps"].as_sequence().unwrap().iter().enumerate() {
            if let Some(uses) = step["uses"].as_str() {
                let action = uses.split('@').next().unwrap();
                let with: BTreeMap<String, String> = step["with"]
                    .as_mapping()
                    .into_iter()
                    .flatten()
                    .map(|(k, v)| {
                        let v = match v {
                            Y::String(s) => s.clone(),
                            other => serde_yaml_ng::to_string(other).unwrap().trim().to_owned(),
                        };
                        (k.as_str().unwrap().to_owned(), self.eval(&v, &outputs))
                    })
                    .collect();
                self.emulate(action, &with, &dir);
                continue;
            }
            let script = step["run"]
                .as_str()
                .unwrap_or_else(|| panic!("{name} step {i}: neither uses nor run"));
            let output_file = home.join(format!("output-{i}"));
            std::fs::write(&output_file, "").unwrap();
            let mut cmd = Command::new("bash");
            cmd.args(["--noprofile", "--norc", "-eo", "pipefail", "-c"])
                .arg(self.eval(script, &outputs))
                .current_dir(&dir)
                .env_clear()
                .env(
                    "PATH",
                    format!("{}:/usr/local/bin:/usr/bin:/bin", bin_dir().display()),
                )
                .env("HOME", &home)
                .env("XDG_CACHE_HOME", home.join("cache"))
                .env("GITHUB_OUTPUT", &output_file)
                .env("GITHUB_STEP_SUMMARY", &summary_file)
                .env("CI", "true")
                .env("GITHUB_ACTIONS", "true")
                .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
            let o = cmd.output().unwrap();
            assert!(
                o.status.success(),
                "{name} step {i} ({script}) exited {:?}:\nstdout: {}\nstderr: {}\nstep summary: {}",
                o.status.code(),
                text(&o.stdout),
                text(&o.stderr),
                std::fs::read_to_string(&summary_file).unwrap_or_default()
            );
            self.ran.insert(script.to_owned());
            if let Some(id) = step["id"].as_str() {
                let written = std::fs::read_to_string(&output_file).unwrap();
                let map = written
                    .lines()
                    .filter_map(|l| l.split_once('='))
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
                    .collect();
                outputs.insert(id.to_owned(), map);
            }
        }
        Job {
            summary: std::fs::read_to_string(&summary_file).unwrap_or_default(),
            dir,
        }
    }

    /// What the `uses:` action `action` does, for this runner.
    fn emulate(&mut self, action: &str, with: &BTreeMap<String, String>, dir: &Path) {
        assert!(
            EMULATED.contains(&action),
            "docs/ci.md uses {action}, which this runner does not emulate"
        );
        match action {
            // A fresh clone of the repository at its head.
            "actions/checkout" => {
                assert!(with.is_empty(), "{with:?}");
                git(
                    self.dir.path(),
                    &[
                        "clone",
                        "-q",
                        self.origin.to_str().unwrap(),
                        dir.to_str().unwrap(),
                    ],
                );
            }
            // Installs only: the built imgbuild is on PATH.
            "OWNER/imgbuild" => assert!(
                with.get("args").is_none_or(String::is_empty),
                "the install step runs nothing: {with:?}"
            ),
            "actions/upload-artifact" => {
                let name = &with["name"];
                let from = dir.join(&with["path"]);
                let store = self
                    .dir
                    .path()
                    .join(format!("artifact-{}", self.artifacts.len()));
                std::fs::create_dir_all(&store).unwrap();
                if from.is_dir() {
                    let files = copy_dir(&from, &store);
                    if files == 0 {
                        assert_eq!(
                            with.get("if-no-files-found").map(String::as_str),
                            Some("ignore"),
                            "{name}: nothing to upload"
                        );
                        return;
                    }
                } else if from.is_file() {
                    std::fs::copy(&from, store.join(from.file_name().unwrap())).unwrap();
                } else {
                    panic!("upload {name}: no {}", from.display());
                }
                self.artifacts.insert(name.clone(), store);
            }
            // By name among the workflow's successful runs; none: a warning.
            "dawidd6/action-download-artifact" => {
                assert_eq!(with["workflow"], WORKFLOW.rsplit('/').next().unwrap());
                assert_eq!(with["search_artifacts"], "true");
                match self.artifacts.get(&with["name"]) {
                    Some(store) => {
                        let to = dir.join(with.get("path").map_or(".", String::as_str));
                        copy_dir(store, &to);
                    }
                    None => assert_eq!(with["if_no_artifact_found"], "warn"),
                }
            }
            "marocchino/sticky-pull-request-comment" => {
                let body = std::fs::read_to_string(dir.join(&with["path"])).unwrap();
                self.comments.insert(with["header"].clone(), body);
            }
            _ => unreachable!(),
        }
    }
}

/// Copies the files of `from` into `to` (made); how many.
fn copy_dir(from: &Path, to: &Path) -> usize {
    std::fs::create_dir_all(to).unwrap();
    let mut n = 0;
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            n += copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
            n += 1;
        }
    }
    n
}

/// Every `run:` script of the workflow's jobs, in order.
fn run_steps(workflow: &Y) -> Vec<String> {
    let mut all = Vec::new();
    for (_, job) in workflow["jobs"].as_mapping().unwrap() {
        for step in job["steps"].as_sequence().unwrap() {
            if let Some(run) = step["run"].as_str() {
                all.push(run.to_owned());
            }
        }
    }
    all
}

/// The names of the CI secrets the workflow reads.
fn secrets_named(text: &str) -> BTreeSet<String> {
    text.match_indices("secrets.")
        .map(|(i, _)| {
            text[i + 8..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        })
        .collect()
}

#[test]
fn the_documented_cluster_workflow_plans_on_the_pull_request_and_applies_on_merge() {
    let block = doc_block("yaml", &format!("# {WORKFLOW}"));
    let workflow: Y = serde_yaml_ng::from_str(&block).unwrap();
    assert_eq!(
        secrets_named(&block),
        BTreeSet::from(["SOPS_AGE_KEY".to_owned(), "PROXMOX_VE_API_TOKEN".to_owned()]),
        "only the age key and the platform token are CI secrets"
    );
    let c = DemoCluster::start(net(1));
    let dir = tempfile::tempdir().unwrap();

    // The repository: the inventory (its factory the simulator), and the
    // secrets made on a laptop as the docs say.
    let origin = dir.path().join("origin");
    std::fs::create_dir_all(origin.join("clusters")).unwrap();
    git(&origin, &["init", "-q"]);
    c.inventory()
        .factory(&c.factory.url)
        .write_to(&origin.join("clusters/lab.yaml"));
    git(&origin, &["add", "clusters/lab.yaml"]);
    git(&origin, &["commit", "-qm", "lab: the inventory"]);
    let key_file = dir.path().join("ci.agekey");
    let o = Command::new("age-keygen")
        .arg("-o")
        .arg(&key_file)
        .output()
        .expect("age-keygen (Debian package age; make deps installs it)");
    assert!(o.status.success(), "{}", text(&o.stderr));
    let key = std::fs::read_to_string(&key_file).unwrap();
    let recipient = key
        .lines()
        .find_map(|l| l.strip_prefix("# public key: "))
        .unwrap()
        .to_owned();
    let laptop = doc_block("sh", "imgbuild --config clusters/lab.yaml secrets gen")
        .replace("age1...", &recipient);
    let o = Command::new("bash")
        .args(["--noprofile", "--norc", "-eo", "pipefail", "-c", &laptop])
        .current_dir(&origin)
        .env(
            "PATH",
            format!("{}:{}", bin_dir().display(), std::env::var("PATH").unwrap()),
        )
        .env("GIT_AUTHOR_NAME", "laptop")
        .env("GIT_AUTHOR_EMAIL", "laptop@example.invalid")
        .env("GIT_COMMITTER_NAME", "laptop")
        .env("GIT_COMMITTER_EMAIL", "laptop@example.invalid")
        .env_remove("IMGBUILD_CONFIG")
        .env_remove("IMGBUILD_STATE_DIR")
        .env_remove("IMGBUILD_FACTORY")
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "the docs' laptop steps: {}",
        text(&o.stderr)
    );
    let tracked = git(&origin, &["ls-files"]);
    assert_eq!(
        tracked.lines().collect::<Vec<_>>(),
        ["clusters/lab.yaml", "clusters/secrets.sops.yaml"],
        "the repository holds only the inventory and the SOPS file"
    );
    assert!(
        !origin.join("clusters/.talos").exists(),
        "no secret in clear left on the laptop"
    );

    let mut gh = GitHub {
        dir,
        origin: origin.clone(),
        secrets: BTreeMap::from([
            ("SOPS_AGE_KEY", key.clone()),
            ("PROXMOX_VE_API_TOKEN", c.pve.token.clone()),
        ]),
        vars: BTreeMap::from([
            ("PROXMOX_VE_ENDPOINT", c.pve.url.clone()),
            ("PROXMOX_VE_FINGERPRINT", c.pve.fingerprint.clone()),
        ]),
        artifacts: BTreeMap::new(),
        comments: BTreeMap::new(),
        runs: 0,
        ran: BTreeSet::new(),
    };
    let tree = git(&origin, &["rev-parse", "HEAD:clusters"])
        .trim()
        .to_owned();

    // The pull request: a plan of the creates, as a comment and an artifact.
    let pr = gh.job(&workflow, "plan", "pull_request");
    let comment = gh.comments.values().next().expect("a comment").clone();
    assert!(
        comment.starts_with("### imgbuild plan for cluster demo (proxmox)"),
        "{comment}"
    );
    assert_eq!(
        comment
            .lines()
            .filter(|l| l.contains("| to create |"))
            .count(),
        5,
        "{comment}"
    );
    for vm in 300..305 {
        assert!(comment.contains(&format!("`VM {vm}`")), "{comment}");
    }
    let artifact = gh
        .artifacts
        .get(&format!("plan-{tree}"))
        .unwrap_or_else(|| panic!("plan-{tree} uploaded: {:?}", gh.artifacts.keys()));
    let plan: serde_json::Value =
        serde_json::from_slice(&std::fs::read(artifact.join("plan.json")).unwrap()).unwrap();
    let planned = plan["actions"].as_array().unwrap().len();
    assert!(planned >= 16, "{plan}");
    assert!(
        !pr.dir.join("clusters/.talos/demo/secrets.yaml").exists(),
        "no secrets in clear in the runner's state dir"
    );

    // The merge: that plan, carried out.
    let merge = gh.job(&workflow, "apply", "push");
    assert!(
        merge
            .summary
            .contains("### imgbuild run on cluster demo (proxmox)"),
        "{}",
        merge.summary
    );
    assert!(
        merge.summary.contains(&format!(
            "**{planned} done, 0 failed, 0 left, 0 not reached**"
        )),
        "{}",
        merge.summary
    );
    let nodes = c.nodes.stats();
    for (node, _, _) in common::inventory::NODES {
        assert!(
            nodes["nodes"][node]["applies"].as_u64() >= Some(1),
            "{node} configured: {nodes}"
        );
    }

    // The next pull request: nothing to do, on a runner that kept nothing.
    let again = gh.job(&workflow, "plan", "pull_request");
    let comment = gh.comments.values().next().unwrap().clone();
    assert!(comment.contains("**No changes.**"), "{comment}");
    let plan: serde_json::Value =
        serde_json::from_slice(&std::fs::read(again.dir.join("plan.json")).unwrap()).unwrap();
    assert_eq!(plan["actions"], serde_json::json!([]), "{plan}");

    // A push no pull request planned: planned anew and applied (nothing).
    let inventory = std::fs::read_to_string(origin.join("clusters/lab.yaml")).unwrap();
    std::fs::write(
        origin.join("clusters/lab.yaml"),
        format!("# pushed to main\n{inventory}"),
    )
    .unwrap();
    git(&origin, &["commit", "-qam", "lab: a comment"]);
    let pushed = gh.job(&workflow, "apply", "push");
    assert_eq!(
        pushed.summary.matches("**No changes.**").count(),
        2,
        "the fresh plan and its run: {}",
        pushed.summary
    );

    // Every documented `run:` step ran.
    for script in run_steps(&workflow) {
        assert!(
            gh.ran.contains(&script),
            "docs/ci.md runs `{script}`, which no job here ran"
        );
    }
}
