//! End to end: `imgbuild bootstrap`, `config`, `secrets`, `talosconfig`
//! against the Talos node simulator, one loopback address per node, and each
//! trap from the field: a node stuck in maintenance, "certificate required"
//! after apply, bootstrap twice, an endpoint on the VIP, a talosconfig from
//! other secrets, a reboot after apply.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common;
use common::inventory::{Inventory, NODES};
use common::run::Run;
use common::sims::Nodes;
use common::{json, root, text};

/// A simulated cluster (3 control planes, 2 workers) on its own /24 inside
/// 127.0.0.0/8, its inventory and state dir; the simulator dies on drop.
struct Cluster {
    nodes: Nodes,
    dir: tempfile::TempDir,
    net: String,
}

/// The loopback /24 of scenario `k` (tests/common/net.rs).
fn net(k: u8) -> String {
    common::net::scenario(module_path!(), k)
}

impl Cluster {
    /// `vip`: whether the simulator brings the VIP up after bootstrap.
    fn start(k: u8, vip: bool, extra: &[&str]) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let net = net(k);
        Inventory::five_nodes("sim", &net).write(dir.path());
        Cluster {
            nodes: Nodes::cluster(&net, vip, extra),
            dir,
            net,
        }
    }

    fn config(&self) -> PathBuf {
        self.dir.path().join("cluster.yaml")
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join(".talos/sim")
    }

    fn imgbuild(&self, args: &[&str]) -> Output {
        Run::with_config(&self.config(), args)
            .env_remove("IMGBUILD_STATE_DIR")
            .env_remove("TALOSCONFIG")
            .output()
    }

    /// `imgbuild --output json bootstrap` with test-sized timeouts.
    fn bootstrap(&self, extra: &[&str]) -> (Output, serde_json::Value) {
        let out = Run::with_config(
            &self.config(),
            &["--output", "json", "bootstrap", "--new-secrets"],
        )
        .timeouts(extra)
        .args(extra)
        .env_remove("IMGBUILD_STATE_DIR")
        .env_remove("TALOSCONFIG")
        .output();
        let v = json(&out);
        (out, v)
    }

    /// A bootstrap that must fail; its `{"error"}` message.
    fn bootstrap_error(&self, extra: &[&str]) -> String {
        let (out, v) = self.bootstrap(extra);
        assert!(!out.status.success(), "{}", text(&out.stderr));
        v["error"].as_str().expect("an error document").to_owned()
    }

    fn stats(&self) -> serde_json::Value {
        self.nodes.stats()
    }

    fn node_stat(&self, node: &str, key: &str) -> u64 {
        self.stats()["nodes"][node][key].as_u64().unwrap()
    }
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

fn sha(path: &Path) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(std::fs::read(path).unwrap()))
}

#[test]
fn five_nodes_come_up_healthy_and_a_second_run_changes_nothing() {
    let c = Cluster::start(1, true, &[]);
    let (out, v) = c.bootstrap(&[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(v["healthy"], true);
    assert_eq!(v["bootstrapped"], true);
    assert_eq!(v["bootstrapNode"], "cp-01");
    assert_eq!(v["applied"].as_array().unwrap().len(), 5, "{v}");
    // Progress names each node's states.
    let log = text(&out.stderr);
    for want in [
        "cp-01: maintenance mode",
        "worker-02: config applied",
        "cp-03: configured, mTLS ok",
        "cp-01: etcd bootstrapped",
        "cluster healthy",
    ] {
        assert!(log.contains(want), "{want}:\n{log}");
    }

    let state = c.state();
    assert_eq!(mode(&state), 0o700);
    for f in ["secrets.yaml", "talosconfig", "kubeconfig"] {
        assert_eq!(mode(&state.join(f)), 0o600, "{f}");
    }
    // Rendered configs hold the secrets in the clear: never kept unasked.
    assert!(!state.join("configs").exists());
    // The kubeconfig works: the VIP answered by the end, so it is the server.
    let kc = std::fs::read_to_string(state.join("kubeconfig")).unwrap();
    let kc = imgbuild::talos::kube::Kubeconfig::parse(&kc).unwrap();
    assert_eq!(kc.server, format!("https://{}.10:6443", c.net));
    assert_eq!(v["fallbacks"], serde_json::json!([]), "no fallback: {v}");
    let ready = kc
        .node_readiness(std::time::Duration::from_secs(5))
        .unwrap();
    assert_eq!(ready.len(), 5);
    assert!(ready.iter().all(|n| n.ready), "{ready:?}");
    // The simulator's view: one apply per node, one bootstrap, and never a
    // Version call to a node in maintenance mode.
    let stats = c.stats();
    assert_eq!(stats["bootstrapped"], true);
    for (name, ..) in NODES {
        let n = &stats["nodes"][name];
        assert_eq!(n["applies"], 1, "{name}: {n}");
        assert_eq!(n["maintenance_version_calls"], 0, "{name}: {n}");
        assert_eq!(n["phase"], "configured");
    }
    assert_eq!(c.node_stat("cp-01", "bootstraps"), 1);

    let files: Vec<String> = ["secrets.yaml", "talosconfig", "kubeconfig"]
        .iter()
        .map(|f| sha(&state.join(f)))
        .collect();
    let (out, v) = c.bootstrap(&[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(v["applied"], serde_json::json!([]));
    assert_eq!(v["alreadyConfigured"].as_array().unwrap().len(), 5);
    assert_eq!(v["bootstrapped"], false);
    assert!(text(&out.stderr).contains("etcd already bootstrapped, nothing to do"));
    let after: Vec<String> = ["secrets.yaml", "talosconfig", "kubeconfig"]
        .iter()
        .map(|f| sha(&state.join(f)))
        .collect();
    assert_eq!(files, after, "a second run rewrote a file");
    for (name, ..) in NODES {
        assert_eq!(c.node_stat(name, "applies"), 1, "{name} got a second apply");
    }
    assert_eq!(c.node_stat("cp-01", "bootstraps"), 1);
    assert_eq!(c.node_stat("cp-01", "bootstrap_refusals"), 0);
}

#[test]
fn a_node_stuck_in_maintenance_times_out_naming_maintenance_mode() {
    let c = Cluster::start(
        2,
        true,
        &["--misbehave", "never-leave-maintenance@worker-01"],
    );
    let err = c.bootstrap_error(&["--node-timeout", "3s"]);
    assert!(
        err.contains("node worker-01: stuck in maintenance mode"),
        "{err}"
    );
    assert!(
        err.contains("install disk"),
        "the hint says what it usually means: {err}"
    );
    // It was never probed with Version while waiting.
    assert_eq!(c.node_stat("worker-01", "maintenance_version_calls"), 0);
    assert_eq!(
        c.node_stat("worker-01", "applies"),
        1,
        "applied once, not in a loop"
    );
}

#[test]
fn certificate_required_after_apply_is_handled_by_switching_to_mtls() {
    use imgbuild::talos::client::{ApiError, Mode, NodeClient, NodeEndpoint, Probe, probe};
    let c = Cluster::start(3, true, &[]);
    let (out, _) = c.bootstrap(&[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    // The trap: a client that keeps the insecure (maintenance) channel after
    // apply gets "tls: certificate required" from the configured node.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let ip = format!("{}.11", c.net).parse().unwrap();
    let target = NodeEndpoint::new(Some(ip), None).unwrap();
    let timeout = std::time::Duration::from_secs(5);
    let insecure = rt.block_on(async {
        let conn = NodeClient::connect(&target, &Mode::Maintenance { pin: None }, timeout).await?;
        conn.disks().await
    });
    assert!(
        matches!(insecure, Err(ApiError::CertificateRequired)),
        "{insecure:?}"
    );
    assert!(
        ApiError::CertificateRequired
            .to_string()
            .contains("tls: certificate required")
    );
    // The probe reads the same fact from the handshake, without an API call.
    assert_eq!(
        rt.block_on(probe(&target, timeout)).unwrap(),
        Probe::Configured
    );
    // With the admin identity the same node answers, and `nodes` routing
    // reaches another node through it (as talosctl does through endpoints):
    // apid stamps the reply with the target as sent, never a hostname.
    let tc =
        imgbuild::talos::talosconfig::Talosconfig::load(&c.state().join("talosconfig")).unwrap();
    let admin = Mode::Mtls(std::sync::Arc::new(tc.identity().unwrap()));
    let worker: std::net::IpAddr = format!("{}.21", c.net).parse().unwrap();
    let (direct, routed) = rt.block_on(async {
        let conn = NodeClient::connect(&target, &admin, timeout).await.unwrap();
        let direct = conn.version().await.unwrap();
        let routed = conn.via(worker).version().await.unwrap();
        (direct, routed)
    });
    assert_eq!(
        (direct.hostname.as_str(), direct.tag.as_str()),
        ("", "v1.11.2")
    );
    assert_eq!(routed.hostname, worker.to_string());
    // A target the endpoint cannot reach fails inside the reply; the client
    // makes that the call's error.
    let nowhere: std::net::IpAddr = format!("{}.99", c.net).parse().unwrap();
    let err = rt.block_on(async {
        let conn = NodeClient::connect(&target, &admin, timeout).await.unwrap();
        conn.via(nowhere).version().await.unwrap_err()
    });
    assert!(
        matches!(
            err,
            ApiError::Status {
                code: tonic::Code::Unavailable,
                ..
            }
        ),
        "{err:?}"
    );
    // And the bootstrap, finding configured nodes, goes straight to mTLS.
    let (out, v) = c.bootstrap(&[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(v["alreadyConfigured"].as_array().unwrap().len(), 5);
}

#[test]
fn bootstrapping_twice_at_once_bootstraps_etcd_once() {
    // etcd stays "Preparing" for 3 s after Bootstrap, so a second run that
    // starts in that window finds etcd not running, calls Bootstrap, and gets
    // AlreadyExists, which must count as done.
    let c = Cluster::start(4, true, &["--etcd-start-delay", "3000"]);
    let ((out_a, v_a), (out_b, v_b)) = std::thread::scope(|s| {
        let a = s.spawn(|| c.bootstrap(&[]));
        while c.node_stat("cp-01", "bootstraps") == 0 {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        // The second run works from a copy of the same secrets: a second
        // run on the same state dir is refused by its lock (issue 28).
        let copy = c.state().with_extension("copy");
        std::fs::create_dir(&copy).unwrap();
        std::fs::set_permissions(&copy, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .unwrap();
        for f in ["secrets.yaml", "talosconfig"] {
            std::fs::copy(c.state().join(f), copy.join(f)).unwrap();
        }
        let b = c.bootstrap(&["--state-dir", copy.to_str().unwrap()]);
        (a.join().unwrap(), b)
    });
    assert!(out_a.status.success(), "{}", text(&out_a.stderr));
    assert!(out_b.status.success(), "{}", text(&out_b.stderr));
    assert_eq!(c.node_stat("cp-01", "bootstraps"), 1);
    assert_eq!(c.node_stat("cp-01", "bootstrap_refusals"), 1);
    assert_eq!(
        (&v_a["bootstrapped"], &v_b["bootstrapped"]),
        (&true.into(), &false.into())
    );
    assert!(text(&out_b.stderr).contains("etcd already bootstrapped"));
    let total_applies: u64 = NODES.iter().map(|(n, ..)| c.node_stat(n, "applies")).sum();
    assert!(total_applies >= 5);
    // The node's answer itself, to a direct second call.
    use imgbuild::talos::client::{ApiError, Mode, NodeClient, NodeEndpoint};
    let tc =
        imgbuild::talos::talosconfig::Talosconfig::load(&c.state().join("talosconfig")).unwrap();
    let mode = Mode::Mtls(std::sync::Arc::new(tc.identity().unwrap()));
    let target = NodeEndpoint::new(Some(format!("{}.11", c.net).parse().unwrap()), None).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let again = rt.block_on(async {
        NodeClient::connect(&target, &mode, std::time::Duration::from_secs(5))
            .await?
            .bootstrap()
            .await
    });
    match again {
        Err(ApiError::Status { code, message }) => {
            assert_eq!(code, tonic::Code::AlreadyExists);
            assert!(message.contains("etcd data directory is not empty"));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_endpoint_on_a_vip_that_never_answers_still_bootstraps_the_node() {
    // The inventory's endpoint is the VIP, but this simulator never brings it
    // up: bootstrap must target cp-01's own address and the kubeconfig must
    // point at a control plane that answers.
    let c = Cluster::start(5, false, &[]);
    let (out, v) = c.bootstrap(&[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(c.node_stat("cp-01", "bootstraps"), 1);
    assert_eq!(v["kubeconfigServer"], format!("https://{}.11:6443", c.net));
    let tc = std::fs::read_to_string(c.state().join("talosconfig")).unwrap();
    assert!(
        !tc.contains(&format!("{}.10", c.net)),
        "VIP in talosconfig:\n{tc}"
    );
    let kc = std::fs::read_to_string(c.state().join("kubeconfig")).unwrap();
    assert!(
        kc.contains(&format!("server: https://{}.11:6443", c.net)),
        "{kc}"
    );
    // The fallback is named on the result, with what was seen.
    let f = &v["fallbacks"][0];
    assert_eq!(f["setting"], "cluster.vip", "{v}");
    assert_eq!(f["node"], "cp-01", "{v}");
    assert_eq!(f["used"], format!("https://{}.11:6443", c.net), "{v}");
    assert!(f["reason"].as_str().unwrap().contains("refused"), "{v}");
    assert_eq!(v["fallbacks"].as_array().unwrap().len(), 1, "{v}");
    let out = c.imgbuild(&["bootstrap", "--new-secrets", "--quiet", "--poll", "100ms"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains(&format!(
            "note: cluster.vip {}.10 (in https://{}.10:6443) did not answer",
            c.net, c.net
        )) && stdout.contains("so the kubeconfig points at cp-01"),
        "{stdout}"
    );
}

#[test]
fn a_talosconfig_from_other_secrets_is_refused_with_an_explanation() {
    let c = Cluster::start(6, true, &[]);
    let other = c.dir.path().join("other");
    let out = c.imgbuild(&["secrets", "gen", "--state-dir", other.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = c.imgbuild(&["talosconfig", "--state-dir", other.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let err = c.bootstrap_error(&["--talosconfig", other.join("talosconfig").to_str().unwrap()]);
    assert!(err.contains("unknown authority"), "{err}");
    assert!(err.contains("other secrets"), "{err}");
    // Refused before any node was touched.
    for (name, ..) in NODES {
        assert_eq!(c.node_stat(name, "applies"), 0);
    }
}

#[test]
fn a_node_configured_with_a_foreign_ca_is_named() {
    let c = Cluster::start(7, true, &["--misbehave", "foreign-ca@cp-02"]);
    // Secrets made first: --new-secrets would refuse a configured node
    // before the bootstrap (tests/up/fresh_clone.rs).
    let out = c.imgbuild(&["secrets", "gen"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let err = c.bootstrap_error(&["--node-timeout", "5s"]);
    assert!(err.contains("node cp-02"), "{err}");
    assert!(err.contains("unknown authority"), "{err}");
    assert!(err.contains("other secrets"), "{err}");
    assert_eq!(
        c.node_stat("cp-02", "applies"),
        0,
        "a configured node gets no apply"
    );
}

#[test]
fn a_reboot_after_apply_is_waited_out() {
    let c = Cluster::start(
        8,
        true,
        &[
            "--misbehave",
            "reboot-after-apply",
            "--reboot-delay",
            "1000",
        ],
    );
    let (out, v) = c.bootstrap(&[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(v["applied"].as_array().unwrap().len(), 5);
    assert!(
        text(&out.stderr).contains("port closed (rebooting?)"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn a_reboot_that_never_ends_is_reported_as_such() {
    let c = Cluster::start(
        9,
        true,
        &[
            "--misbehave",
            "reboot-after-apply@worker-02",
            "--reboot-delay",
            "60000",
        ],
    );
    let err = c.bootstrap_error(&["--node-timeout", "3s"]);
    assert!(
        err.contains("node worker-02: did not come back after apply"),
        "{err}"
    );
}

#[test]
fn slow_time_sync_delays_bootstrap_but_does_not_fail_it() {
    let c = Cluster::start(
        10,
        true,
        &[
            "--misbehave",
            "slow-time-sync@cp-01",
            "--time-sync-delay",
            "1500",
        ],
    );
    let (out, v) = c.bootstrap(&[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(v["bootstrapped"], true);
    assert!(text(&out.stderr).contains("time is not in sync yet"));
    assert!(c.node_stat("cp-01", "bootstrap_refusals") >= 1);
    assert_eq!(c.node_stat("cp-01", "bootstraps"), 1);
}

#[test]
fn a_missing_install_disk_is_caught_before_apply() {
    let c = Cluster::start(11, true, &["--disks", "vda"]);
    let err = c.bootstrap_error(&[]);
    assert!(
        err.contains("install disk /dev/sda does not exist"),
        "{err}"
    );
    assert!(err.contains("/dev/vda"), "{err}");
}

#[test]
fn a_node_that_never_boots_is_named_with_its_port() {
    // Inventory with one node the simulator does not run.
    let c = Cluster::start(12, true, &[]);
    let inv = Inventory::five_nodes("sim", &c.net).text()
        + &format!(
            "  - name: worker-03\n    role: worker\n    address: {}.23\n",
            c.net
        );
    std::fs::write(c.config(), inv).unwrap();
    let err = c.bootstrap_error(&["--node-timeout", "1s"]);
    assert!(
        err.contains("node worker-03: port 50000 never opened"),
        "{err}"
    );
}

#[test]
fn a_duration_too_large_for_the_clock_is_a_usage_error_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    Inventory::five_nodes("sim", &net(15)).write(dir.path());
    let out = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
        .arg("--config")
        .arg(dir.path().join("cluster.yaml"))
        .args([
            "bootstrap",
            "--new-secrets",
            "--node-timeout",
            "99999999999999999999h",
        ])
        .env_remove("IMGBUILD_STATE_DIR")
        .env_remove("TALOSCONFIG")
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--node-timeout"), "{err}");
    assert!(err.contains("too long"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    // Nothing was started: no state dir.
    assert!(!dir.path().join(".talos").exists());
}

#[test]
fn config_secrets_and_talosconfig_commands() {
    let dir = tempfile::tempdir().unwrap();
    Inventory::five_nodes("sim", &net(13)).write(dir.path());
    let cfg = dir.path().join("cluster.yaml");
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_imgbuild"))
            .arg("--config")
            .arg(&cfg)
            .args(args)
            .env_remove("IMGBUILD_STATE_DIR")
            .output()
            .unwrap()
    };
    // `config` never creates the secrets: it names the way to make them.
    let out = run(&["config", "cp-01"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("imgbuild secrets gen"));
    assert!(!dir.path().join(".talos/sim/secrets.yaml").exists());
    let out = run(&["secrets", "gen"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    // Then it prints a schema-valid config (its secrets shown only when
    // asked: else they are redacted).
    let out = run(&["--show-secrets", "--yes", "config", "cp-01"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let doc: serde_json::Value = serde_yaml_ng::from_slice(&out.stdout).unwrap();
    let schema: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("schemas/talos-v1.11-config.schema.json")).unwrap(),
    )
    .unwrap();
    let validator = jsonschema::validator_for(&schema).unwrap();
    let errors: Vec<String> = validator.iter_errors(&doc).map(|e| e.to_string()).collect();
    assert!(errors.is_empty(), "{errors:?}");
    let state = dir.path().join(".talos/sim");
    assert_eq!(mode(&state), 0o700);
    assert_eq!(mode(&state.join("secrets.yaml")), 0o600);
    // The same secrets every time: configs are stable.
    let again = run(&["--show-secrets", "--yes", "config", "cp-01"]);
    assert_eq!(out.stdout, again.stdout);
    let out = run(&["config", "nope"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("no node named \"nope\""));

    // secrets gen never overwrites silently.
    let before = sha(&state.join("secrets.yaml"));
    let out = run(&["secrets", "gen"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("--force"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(before, sha(&state.join("secrets.yaml")));
    // Import (as from `talosctl gen secrets`) into another state dir.
    let other = dir.path().join("imported");
    let out = run(&[
        "secrets",
        "gen",
        "--state-dir",
        other.to_str().unwrap(),
        "--secrets",
        state.join("secrets.yaml").to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(mode(&other.join("secrets.yaml")), 0o600);
    // A broken bundle is refused naming the file and field.
    let broken = dir.path().join("broken.yaml");
    let good = std::fs::read_to_string(state.join("secrets.yaml")).unwrap();
    std::fs::write(&broken, good.replace("trustdinfo:", "trustd:")).unwrap();
    let out = run(&[
        "secrets",
        "gen",
        "--force",
        "--secrets",
        broken.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("broken.yaml") && err.contains("trustd"),
        "{err}"
    );
    assert_eq!(
        before,
        sha(&state.join("secrets.yaml")),
        "nothing half-written"
    );

    // talosconfig: written once, unchanged after, endpoints without the VIP.
    let out = run(&["--output", "json", "talosconfig"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["written"], true);
    let n = net(13);
    assert_eq!(
        v["endpoints"],
        serde_json::json!([format!("{n}.11"), format!("{n}.12"), format!("{n}.13")])
    );
    let out = run(&["--output", "json", "talosconfig"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["written"], false);
    assert_eq!(mode(&state.join("talosconfig")), 0o600);
    // No secret reaches stdout or stderr of these commands.
    for args in [
        &["talosconfig"][..],
        &["--output", "json", "talosconfig"][..],
    ] {
        let out = run(args);
        let all = text(&out.stdout) + &text(&out.stderr);
        assert!(
            !all.contains("PRIVATE KEY") && !all.contains("LS0t"),
            "{all}"
        );
    }
}

#[test]
fn the_simulator_speaks_maintenance_mode_like_talos() {
    use imgbuild::talos::client::{ApiError, Mode, NodeClient, NodeEndpoint, Probe, probe};
    use tonic::Code;
    let c = Cluster::start(14, true, &[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let target = NodeEndpoint::new(Some(format!("{}.11", c.net).parse().unwrap()), None).unwrap();
    let t = std::time::Duration::from_secs(5);
    let status = |r: Result<_, ApiError>| match r {
        Err(ApiError::Status { code, message }) => (code, message),
        other => panic!("{other:?}"),
    };
    rt.block_on(async {
        let conn = NodeClient::connect(&target, &Mode::Maintenance { pin: None }, t)
            .await
            .unwrap();
        assert_eq!(conn.disks().await.unwrap(), ["/dev/sda"]);
        assert_eq!(
            status(conn.version().await.map(|_| ())),
            (
                Code::Unimplemented,
                "API is not implemented in maintenance mode".into()
            )
        );
        assert_eq!(
            status(conn.bootstrap().await),
            (
                Code::Unimplemented,
                "method Bootstrap not implemented".into()
            )
        );
        let (code, msg) = status(conn.apply(b"version: [unclosed".to_vec()).await.map(|_| ()));
        assert_eq!(code, Code::InvalidArgument, "{msg}");
        let (code, msg) = status(
            conn.apply(b"version: v1alpha1\nmachine:\n  typo: 1\n".to_vec())
                .await
                .map(|_| ()),
        );
        assert_eq!(code, Code::InvalidArgument);
        assert!(msg.contains("typo"), "{msg}");
    });
    // --cert-fingerprint: a wrong pin refuses the node, the right one works.
    let Probe::Maintenance { fingerprint } = rt.block_on(probe(&target, t)).unwrap() else {
        panic!("not in maintenance mode");
    };
    let wrong = Mode::Maintenance {
        pin: Some("00".repeat(32)),
    };
    let err = rt
        .block_on(NodeClient::connect(&target, &wrong, t))
        .err()
        .unwrap();
    assert!(
        matches!(err, ApiError::PinMismatch { ref found, .. } if *found == fingerprint),
        "{err:?}"
    );
    let right = Mode::Maintenance {
        pin: Some(fingerprint),
    };
    let disks = rt.block_on(async { NodeClient::connect(&target, &right, t).await?.disks().await });
    assert_eq!(disks.unwrap(), ["/dev/sda"]);
    // Invalid configs changed nothing; our one Version probe was counted.
    assert_eq!(c.node_stat("cp-01", "applies"), 0);
    assert_eq!(c.node_stat("cp-01", "maintenance_version_calls"), 1);
    assert_eq!(c.stats()["nodes"]["cp-01"]["phase"], "maintenance");
}

#[test]
fn a_wrong_certificate_name_is_named_not_blamed_on_a_reboot() {
    // worker-01's mTLS certificate names {net}.254, not the address the
    // inventory gives it: a name mismatch, not a node that went away.
    let c = Cluster::start(16, true, &["--misbehave", "wrong-cert-name@worker-01"]);
    let err = c.bootstrap_error(&["--node-timeout", "20s"]);
    assert!(
        err.contains("node worker-01: configured, but its certificate names other addresses"),
        "{err}"
    );
    let (want, named) = (format!("{}.21", c.net), format!("{}.254", c.net));
    assert!(
        err.contains(&format!("not valid for {want}: it names {named}")),
        "{err}"
    );
    assert!(err.contains("machine.certSANs"), "the way out: {err}");
    assert!(!err.contains("went away"), "blamed on a reboot: {err}");
    assert!(
        !err.contains("gave up after"),
        "waited for a timeout: {err}"
    );
}

#[test]
fn a_node_that_fails_early_does_not_hold_back_etcd_bootstrap() {
    // worker-01 fails on its first probe (another cluster's CA), long before
    // cp-01 has taken its config: cp-01 is still brought up and bootstrapped.
    let c = Cluster::start(17, true, &["--misbehave", "foreign-ca@worker-01"]);
    let out = c.imgbuild(&["secrets", "gen"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let (out, v) = c.bootstrap(&[]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let err = v["error"].as_str().unwrap();
    assert!(err.contains("node worker-01"), "{err}");
    assert!(err.contains("unknown authority"), "{err}");
    assert!(
        err.contains("etcd was bootstrapped on cp-01") && err.contains("Fix worker-01"),
        "{err}"
    );
    assert_eq!(c.node_stat("cp-01", "bootstraps"), 1);
    for (name, ..) in NODES.iter().filter(|(n, ..)| *n != "worker-01") {
        assert_eq!(c.node_stat(name, "applies"), 1, "{name}");
        assert_eq!(c.stats()["nodes"][name]["phase"], "configured", "{name}");
    }
}

/// Writes `patch` as the inventory's patch for every node.
fn patch_all(c: &Cluster, patch: &str) {
    std::fs::write(c.dir.path().join("cni.yaml"), patch).unwrap();
    let inv = Inventory::five_nodes("sim", &c.net)
        .append("patches:\n  all: [cni.yaml]\n")
        .text();
    std::fs::write(c.config(), inv).unwrap();
}

const NO_CNI: &str = "cluster:\n  network:\n    cni:\n      name: none\n";

#[test]
fn a_cluster_without_a_cni_is_its_own_state_with_exit_3() {
    let c = Cluster::start(18, true, &[]);
    patch_all(&c, NO_CNI);
    let (out, v) = c.bootstrap(&["--health-timeout", "60s"]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    assert_eq!(v["healthy"], false, "{v}");
    assert_eq!(v["health"]["state"], "noCni", "{v}");
    let mut not_ready: Vec<&str> = v["health"]["notReady"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap())
        .collect();
    not_ready.sort_unstable();
    let mut all: Vec<&str> = NODES.iter().map(|(n, ..)| *n).collect();
    all.sort_unstable();
    assert_eq!(not_ready, all);
    assert!(
        v["health"]["message"]
            .as_str()
            .unwrap()
            .contains("cni plugin not initialized"),
        "the kubelet's own words: {v}"
    );
    for (name, ..) in NODES {
        assert_eq!(v["ready"][name], false, "{v}");
    }
    // Talos itself came up: etcd bootstrapped, kubeconfig written.
    assert_eq!(v["bootstrapped"], true);
    assert!(c.state().join("kubeconfig").exists());
    // Text: the setting and the ways out, and never "healthy".
    let out = c.imgbuild(&[
        "bootstrap",
        "--new-secrets",
        "--poll",
        "100ms",
        "--health-timeout",
        "60s",
    ]);
    assert_eq!(out.status.code(), Some(3));
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(!stdout.contains("is healthy"), "{stdout}");
    for want in [
        "cluster.network.cni.name is none",
        "cluster.inlineManifests",
        "cluster.extraManifests",
        "NotReady",
    ] {
        assert!(stderr.contains(want), "{want}:\n{stderr}");
    }
    assert!(!stderr.contains("health checks still failing"), "{stderr}");
}

#[test]
fn a_cni_in_inline_manifests_brings_the_nodes_ready() {
    let c = Cluster::start(19, true, &[]);
    patch_all(
        &c,
        &format!(
            "{NO_CNI}  inlineManifests:\n    - name: cni\n      contents: |\n        apiVersion: v1\n        kind: Namespace\n        metadata:\n          name: cni\n"
        ),
    );
    let (out, v) = c.bootstrap(&[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(v["healthy"], true);
    assert_eq!(v["health"]["state"], "healthy");
}

/// A state dir with secrets (`imgbuild secrets gen`) and an admin
/// kubeconfig as a bootstrap leaves it (cluster `sim`, context `admin@sim`,
/// Talos's names), for the merge commands; returns the inventory.
fn cluster_with_kubeconfig(dir: &Path, key: &str) -> PathBuf {
    let config = Inventory::five_nodes("sim", "127.0.0").write(dir);
    if !dir.join(".talos/sim/secrets.yaml").exists() {
        let o = Run::with_config(&config, &["secrets", "gen"])
            .env_remove("IMGBUILD_STATE_DIR")
            .output();
        assert!(o.status.success(), "{}", text(&o.stderr));
    }
    let kubeconfig = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: sim\n  cluster:\n    server: https://127.0.0.10:6443\n    certificate-authority-data: Q0E=\ncontexts:\n- name: admin@sim\n  context:\n    cluster: sim\n    namespace: default\n    user: admin@sim\nusers:\n- name: admin@sim\n  user:\n    client-certificate-data: Q1JU\n    client-key-data: {key}\ncurrent-context: admin@sim\n"
    );
    let path = dir.join(".talos/sim/kubeconfig");
    std::fs::write(&path, kubeconfig).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    config
}

fn kubectl(file: &Path, args: &[&str]) -> Output {
    let o = Command::new("kubectl")
        .args(args)
        .arg("--kubeconfig")
        .arg(file)
        .output()
        .expect("kubectl is installed (make deps: kubernetes-client)");
    assert!(o.status.success(), "kubectl {args:?}: {}", text(&o.stderr));
    o
}

#[test]
fn kubeconfig_merge_adds_one_context_keeps_the_others_and_twice_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let config = cluster_with_kubeconfig(dir.path(), "S0VZ");
    // A kubeconfig with two other clusters, written by kubectl itself.
    let file = dir.path().join("home/.kube/config");
    std::fs::create_dir_all(file.parent().unwrap()).unwrap();
    for (c, server) in [
        ("lab", "https://10.1.0.1:6443"),
        ("prod", "https://10.2.0.1:6443"),
    ] {
        kubectl(&file, &["config", "set-cluster", c, "--server", server]);
        kubectl(
            &file,
            &[
                "config",
                "set-credentials",
                c,
                "--token",
                &format!("tok-{c}"),
            ],
        );
        kubectl(
            &file,
            &["config", "set-context", c, "--cluster", c, "--user", c],
        );
    }
    kubectl(&file, &["config", "use-context", "lab"]);
    let view = |f: &Path| -> serde_json::Value {
        serde_json::from_slice(&kubectl(f, &["config", "view", "--raw", "-o", "json"]).stdout)
            .unwrap()
    };
    let before = view(&file);
    let written = std::fs::read_to_string(&file).unwrap();
    let merge = || {
        Run::with_config(&config, &["kubeconfig", "--merge"])
            .env_remove("IMGBUILD_STATE_DIR")
            .env_remove("KUBECONFIG")
            .env("HOME", dir.path().join("home"))
            .output()
    };
    let o = merge();
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(
        text(&o.stdout).contains("merged (context admin@sim, current)"),
        "{}",
        text(&o.stdout)
    );
    let after = view(&file);
    assert_eq!(after["current-context"], "admin@sim");
    for list in ["clusters", "users", "contexts"] {
        let entries =
            |v: &serde_json::Value| -> std::collections::BTreeMap<String, serde_json::Value> {
                v[list]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|e| (e["name"].as_str().unwrap().to_owned(), e.clone()))
                    .collect()
            };
        let (was, now) = (entries(&before), entries(&after));
        let ours = if list == "clusters" {
            "sim"
        } else {
            "admin@sim"
        };
        assert!(now.contains_key(ours), "{list}: {now:?}");
        assert_eq!(now.len(), was.len() + 1, "{list}");
        // The other entries, as kubectl reads them, are what they were.
        for (name, entry) in &was {
            assert_eq!(now.get(name), Some(entry), "{list} {name}");
        }
    }
    // ... and, in kubectl's own layout, byte for byte.
    let merged = std::fs::read_to_string(&file).unwrap();
    let mut items = Vec::new();
    for line in written.lines() {
        if line.starts_with("- ") {
            items.push(line.to_owned());
        } else if line.starts_with("  ") && !items.is_empty() {
            let last = items.last_mut().unwrap();
            last.push('\n');
            last.push_str(line);
        }
    }
    assert_eq!(items.len(), 6, "{written}");
    for item in &items {
        assert!(
            merged.contains(item.as_str()),
            "lost {item:?} in:\n{merged}"
        );
    }
    let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    // Twice: nothing changes, not a byte.
    let o = merge();
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(text(&o.stdout).contains("unchanged"), "{}", text(&o.stdout));
    assert_eq!(std::fs::read_to_string(&file).unwrap(), merged);
}

#[test]
fn kubeconfig_merge_replaces_an_entry_of_the_same_name_only_with_force() {
    let dir = tempfile::tempdir().unwrap();
    let config = cluster_with_kubeconfig(dir.path(), "S0VZ");
    let file = dir.path().join("mine.yaml");
    let merge = |extra: &[&str]| {
        let mut args = vec!["kubeconfig", "--merge", file.to_str().unwrap()];
        args.extend(extra);
        Run::with_config(&config, &args)
            .env_remove("IMGBUILD_STATE_DIR")
            .output()
    };
    assert!(merge(&[]).status.success());
    // The secrets changed: the same names, another key.
    cluster_with_kubeconfig(dir.path(), "TkVX");
    let o = merge(&[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    assert!(err.contains("user \"admin@sim\" already there"), "{err}");
    assert!(!err.contains("TkVX") && !err.contains("S0VZ"), "{err}");
    assert!(std::fs::read_to_string(&file).unwrap().contains("S0VZ"));
    let o = merge(&["--force"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(
        text(&o.stdout).contains("replaced user \"admin@sim\""),
        "{}",
        text(&o.stdout)
    );
    let now = std::fs::read_to_string(&file).unwrap();
    assert!(now.contains("TkVX") && !now.contains("S0VZ"), "{now}");
}

#[test]
fn talosconfig_merge_adds_the_cluster_context_to_talosctl_s_file() {
    let dir = tempfile::tempdir().unwrap();
    let config = cluster_with_kubeconfig(dir.path(), "S0VZ");
    let file = dir.path().join("talos/config");
    std::fs::create_dir_all(file.parent().unwrap()).unwrap();
    std::fs::write(
        &file,
        "context: lab\ncontexts:\n  lab:\n    endpoints:\n    - 192.168.1.2\n",
    )
    .unwrap();
    let o = Run::with_config(&config, &["talosconfig", "--merge"])
        .env_remove("IMGBUILD_STATE_DIR")
        .env("TALOSCONFIG", &file)
        .output();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let v: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(v["context"].as_str(), Some("sim"));
    assert_eq!(
        v["contexts"]["lab"]["endpoints"][0].as_str(),
        Some("192.168.1.2")
    );
    assert!(
        v["contexts"]["sim"]["crt"]
            .as_str()
            .is_some_and(|c| !c.is_empty())
    );
}
