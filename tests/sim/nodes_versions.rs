//! The node simulator (`imgbuild-sim nodes`) driven directly over gRPC, one
//! Talos version per case, against the behaviour of that release's source
//! (siderolabs/talos `internal/app/machined/internal/server/v1alpha1/
//! v1alpha1_server.go`, `internal/pkg/etcd/etcd.go`, `cmd/installer/pkg/
//! install/preflight.go`, `internal/app/lifecycle/lifecycle.go`). Nodes boot
//! configured (`POST /_sim/boot` with a config and a version); a small
//! registry on loopback answers the installers' manifests.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::process::Command;
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use imgbuild::talos::api::common::{
    ContainerDriver, ContainerdInstance, ContainerdNamespace, Data,
};
use imgbuild::talos::api::machine::apply_configuration_request::Mode;
use imgbuild::talos::api::machine::image_service_client::ImageServiceClient;
use imgbuild::talos::api::machine::lifecycle_service_client::LifecycleServiceClient;
use imgbuild::talos::api::machine::lifecycle_service_install_progress::Response as Progress;
use imgbuild::talos::api::machine::machine_service_client::MachineServiceClient;
use imgbuild::talos::api::machine::*;
use imgbuild::talos::pki::{self, CertAndKey, KeyKind, LeafSpec};
use serde_json::{Value, json};
use tonic::Code;
use tonic::transport::Channel;

use crate::common;
use common::sims::Nodes;
use common::text;

/// The loopback /24 of scenario `k` (tests/common/net.rs).
fn net(k: u8) -> String {
    common::net::scenario(module_path!(), k)
}

/// A registry that serves every installer manifest whose tag is a Talos
/// version (what the node's pull resolves first); its `host:port`.
fn registry() -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for tcp in l.incoming().flatten() {
            let mut line = String::new();
            let _ = BufReader::new(&tcp).read_line(&mut line);
            let path = line.split_whitespace().nth(1).unwrap_or("");
            let ok = path.starts_with("/v2/")
                && path.contains("/manifests/v1.")
                && path.rsplit(':').count() == 1;
            let reply = if ok {
                "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
            } else {
                "HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\nConnection: close\r\n\r\nnot found"
            };
            let _ = (&tcp).write_all(reply.as_bytes());
        }
    });
    addr
}

/// The delays every case runs with: small, but long enough to be states.
const DELAYS: [&str; 16] = [
    "--apply-delay",
    "50",
    "--etcd-delay",
    "150",
    "--kubelet-delay",
    "100",
    "--ready-delay",
    "100",
    "--upgrade-delay",
    "50",
    "--reboot-delay",
    "400",
    "--drain-delay",
    "300",
    "--talos-version",
    "v1.11.2",
];

struct Cluster {
    sim: Nodes,
    net: String,
    ca: CertAndKey,
    admin: CertAndKey,
    registry: String,
    schematic: String,
}

impl Cluster {
    /// A simulator with `extra` flags and `nodes` (name, last octet,
    /// control plane, version) booted configured; etcd bootstrapped on the
    /// first control plane, if any, and healthy everywhere.
    async fn start(k: u8, extra: &[&str], nodes: &[(&str, u8, bool, &str)]) -> Cluster {
        let ca = pki::new_ca(KeyKind::Ed25519, "talos", None, 10).unwrap();
        let admin = pki::issue(
            &ca,
            &LeafSpec {
                organization: Some("os:admin".into()),
                common_name: "admin".into(),
                client: true,
                days: 1,
                ..LeafSpec::default()
            },
        )
        .unwrap();
        // A delay `extra` names replaces the default one.
        let mut flags: Vec<&str> = DELAYS
            .chunks(2)
            .filter(|pair| !extra.contains(&pair[0]))
            .flatten()
            .copied()
            .collect();
        flags.extend(extra);
        let c = Cluster {
            sim: Nodes::start_with(&flags, &[]),
            net: net(k),
            ca,
            admin,
            registry: registry(),
            schematic: "5c".repeat(32),
        };
        for (name, host, cp, version) in nodes {
            let config = c.config(name, *cp, &[]);
            let v = c.post(
                "boot",
                json!({"name": name, "ip": c.ip(*host), "hostname": name,
                    "config": config, "talos_version": version}),
            );
            assert_eq!(v["configured"], true, "{v}");
        }
        if let Some((_, host, _, _)) = nodes.iter().find(|n| n.2) {
            let mut m = c.machine(*host).await;
            m.bootstrap(BootstrapRequest::default()).await.unwrap();
            tokio::time::sleep(Duration::from_millis(700)).await;
        }
        c
    }

    fn ip(&self, host: u8) -> String {
        format!("{}.{host}", self.net)
    }

    fn installer(&self, tag: &str) -> String {
        format!("{}/metal-installer/{}:{tag}", self.registry, self.schematic)
    }

    /// A machine config for `name`, its `machine` section extended by
    /// `machine_extra` YAML lines (indented two spaces).
    fn config(&self, name: &str, cp: bool, machine_extra: &[&str]) -> String {
        let b64 = |s: &str| STANDARD.encode(s);
        let role = if cp { "controlplane" } else { "worker" };
        let extra: String = machine_extra.iter().map(|l| format!("  {l}\n")).collect();
        format!(
            "version: v1alpha1\nmachine:\n  type: {role}\n  ca:\n    crt: {}\n    key: {}\n  network:\n    hostname: {name}\n  install:\n    disk: /dev/sda\n    image: {}\n{extra}cluster:\n  clusterName: sim\n  controlPlane:\n    endpoint: https://{}:6443\n",
            b64(&self.ca.crt),
            b64(&self.ca.key),
            self.installer("v1.11.2"),
            self.ip(11),
        )
    }

    fn post(&self, path: &str, body: Value) -> Value {
        let o = Command::new("curl")
            .args(["-s", "-X", "POST", "-H", "content-type: application/json"])
            .args(["-d", &body.to_string()])
            .arg(format!("{}/_sim/{path}", self.sim.control))
            .output()
            .unwrap();
        serde_json::from_slice(&o.stdout)
            .unwrap_or_else(|e| panic!("/_sim/{path} ({e}): {}", text(&o.stdout)))
    }

    /// One node's day-two stats.
    fn day2(&self, name: &str) -> Value {
        self.sim.stats()["nodes"][name]["day2"].clone()
    }

    /// An mTLS channel to the node on `host`, as talosctl opens one.
    async fn channel(&self, host: u8) -> Result<Channel, tonic::transport::Error> {
        common::talos::channel(&self.ca, &self.admin, self.ip(host).parse().unwrap()).await
    }

    async fn machine(&self, host: u8) -> MachineServiceClient<Channel> {
        MachineServiceClient::new(self.channel(host).await.unwrap())
    }

    /// The boot ID as talosctl reads it, None while the node is down.
    async fn boot_id(&self, host: u8) -> Option<String> {
        let mut m = MachineServiceClient::new(self.channel(host).await.ok()?);
        let mut stream = m
            .read(ReadRequest {
                path: "/proc/sys/kernel/random/boot_id".into(),
            })
            .await
            .ok()?
            .into_inner();
        let mut out = Vec::new();
        while let Ok(Some(Data { bytes, .. })) = stream.message().await {
            out.extend(bytes);
        }
        Some(String::from_utf8(out).unwrap().trim().to_owned())
    }

    /// Waits until the node on `host` answers with a boot ID other than
    /// `old`: the new one.
    async fn next_boot(&self, host: u8, old: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(id) = self.boot_id(host).await
                && id != old
            {
                return id;
            }
            assert!(Instant::now() < deadline, "{host} never rebooted");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn version(&self, host: u8) -> String {
        let v = self.machine(host).await.version(()).await.unwrap();
        v.into_inner().messages[0].version.clone().unwrap().tag
    }

    async fn apply(
        &self,
        host: u8,
        config: &str,
        mode: Mode,
        dry_run: bool,
    ) -> Result<ApplyConfiguration, tonic::Status> {
        let req = ApplyConfigurationRequest {
            data: config.as_bytes().to_vec(),
            mode: mode as i32,
            dry_run,
            try_mode_timeout: None,
        };
        let r = self.machine(host).await.apply_configuration(req).await?;
        Ok(r.into_inner().messages.remove(0))
    }
}

fn upgrade_request(image: &str, preserve: bool, force: bool) -> tonic::Request<UpgradeRequest> {
    tonic::Request::new(UpgradeRequest {
        image: image.into(),
        preserve,
        force,
        ..UpgradeRequest::default()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_pulls_before_the_ack_and_a_short_deadline_cancels_it_v1_11_2_to_v1_11_5() {
    let c = Cluster::start(
        1,
        // A drain long enough that the two reads after the ack land
        // inside it on a loaded machine too.
        &[
            "--pull-delay",
            "3000",
            "--pull-cached-delay",
            "100",
            "--drain-delay",
            "1500",
        ],
        &[("worker-01", 21, false, "v1.11.2")],
    )
    .await;
    let first = c.boot_id(21).await.unwrap();
    let image = c.installer("v1.11.5");

    // A 1 s deadline over a 3 s pull: cancelled, nothing upgraded.
    let mut req = upgrade_request(&image, true, false);
    req.set_timeout(Duration::from_secs(1));
    let t = Instant::now();
    let e = c.machine(21).await.upgrade(req).await.unwrap_err();
    assert!(
        matches!(e.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{e:?}"
    );
    assert!(
        t.elapsed() < Duration::from_millis(2500),
        "{:?}",
        t.elapsed()
    );
    tokio::time::sleep(Duration::from_millis(800)).await;
    let d = c.day2("worker-01");
    assert_eq!(
        (&d["upgrade_calls"], &d["upgrades"], &d["pulls_cancelled"]),
        (&json!(1), &json!(0), &json!(1)),
        "{d}"
    );
    assert_eq!(c.boot_id(21).await.unwrap(), first);
    assert_eq!(c.version(21).await, "v1.11.2");

    // A long deadline: the ack comes once the pull is done (the factory's
    // build went on meanwhile), then the drain on the old version.
    let mut req = upgrade_request(&image, true, false);
    req.set_timeout(Duration::from_secs(30));
    let t = Instant::now();
    let ack = c.machine(21).await.upgrade(req).await.unwrap().into_inner();
    assert_eq!(ack.messages[0].ack, "Upgrade request received");
    assert!(
        t.elapsed() >= Duration::from_millis(700),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(c.version(21).await, "v1.11.2", "still draining");
    assert_eq!(c.day2("worker-01")["cordoned"], true);
    let second = c.next_boot(21, &first).await;
    assert_eq!(c.version(21).await, "v1.11.5");
    let d = c.day2("worker-01");
    assert_eq!(d["upgrades"], 1, "{d}");
    assert_eq!(d["upgrade_calls"], 2, "{d}");
    assert_eq!(d["boot_ids"], json!([first, second]), "{d}");
    assert_eq!(d["timeline"][0]["why"], "upgrade", "{d}");
    assert_eq!(d["cordoned"], false, "uncordoned at boot: {d}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_etcd_members_refuse_unless_forced_and_preserve_skips_from_v1_12_9_v1_13_4_v1_14() {
    let c = Cluster::start(
        2,
        &[],
        &[
            ("cp-01", 11, true, "v1.11.5"),
            ("cp-02", 12, true, "v1.11.5"),
        ],
    )
    .await;
    let quorum = "error validating etcd for upgrade: etcd member count(2) is insufficient to maintain quorum if upgrade commences";
    // (the version cp-01 runs, preserve, force, acked)
    for (version, preserve, force, acked) in [
        ("v1.11.5", true, false, false),
        ("v1.11.5", false, true, true),
        ("v1.12.8", true, false, false),
        ("v1.12.9", true, false, true),
        ("v1.13.3", true, false, false),
        ("v1.13.5", true, false, true),
        ("v1.13.5", false, false, false),
        ("v1.14.0", true, false, true),
    ] {
        c.post("node", json!({"node": "cp-01", "version": version}));
        let boot = c.boot_id(11).await.unwrap();
        let before = c.day2("cp-01");
        let r = c
            .machine(11)
            .await
            .upgrade(upgrade_request(&c.installer(version), preserve, force))
            .await;
        let d = c.day2("cp-01");
        let case = format!("{version} preserve={preserve} force={force}: {r:?} {d}");
        if acked {
            assert!(r.is_ok(), "{case}");
            assert_eq!(
                d["upgrades"],
                before["upgrades"].as_u64().unwrap() + 1,
                "{case}"
            );
            c.next_boot(11, &boot).await;
            tokio::time::sleep(Duration::from_millis(400)).await;
        } else {
            let e = r.unwrap_err();
            assert_eq!((e.code(), e.message()), (Code::Unknown, quorum), "{case}");
            assert_eq!(d["upgrades"], before["upgrades"], "{case}");
            assert_eq!(
                d["upgrade_refusals"],
                before["upgrade_refusals"].as_u64().unwrap() + 1,
                "{case}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_installer_below_its_host_floor_reverts_after_the_drain_v1_9_6_host() {
    let c = Cluster::start(3, &[], &[("worker-01", 21, false, "v1.9.6")]).await;
    let first = c.boot_id(21).await.unwrap();
    // The v1.12 installer refuses hosts below v1.10.0, but only once it
    // runs: the Upgrade is acked.
    let ack = c
        .machine(21)
        .await
        .upgrade(upgrade_request(&c.installer("v1.12.0"), false, false))
        .await
        .unwrap();
    assert_eq!(ack.into_inner().messages[0].ack, "Upgrade request received");
    let second = c.next_boot(21, &first).await;
    assert_eq!(c.version(21).await, "v1.9.6", "reverted");
    let d = c.day2("worker-01");
    assert_eq!(d["installer_refusals"], 1, "{d}");
    assert_eq!(
        d["last_error"],
        "pre-flight checks failed: host version 1.9.6 is too old to upgrade to Talos 1.12.0"
    );
    assert_eq!(d["timeline"][0]["why"], "revert", "{d}");
    // Through the v1.11 installer (floor v1.9.0) it goes.
    c.machine(21)
        .await
        .upgrade(upgrade_request(&c.installer("v1.11.6"), false, false))
        .await
        .unwrap();
    c.next_boot(21, &second).await;
    assert_eq!(c.version(21).await, "v1.11.6");
    assert_eq!(c.day2("worker-01")["installer_refusals"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn machine_files_need_a_reboot_on_v1_11_5_and_apply_immediately_on_v1_14_0() {
    let c = Cluster::start(
        4,
        &[],
        &[
            ("worker-11", 21, false, "v1.11.5"),
            ("worker-14", 22, false, "v1.14.0"),
        ],
    )
    .await;
    let files = [
        "files:",
        "  - path: /var/etc/motd",
        "    content: hello",
        "    op: create",
    ];
    let sysctls = ["sysctls:", "  vm.max_map_count: \"262144\""];

    // v1.11.5: CanApplyImmediate refuses .machine.files.
    let with_files = c.config("worker-11", false, &files);
    for mode in [Mode::NoReboot, Mode::Try] {
        for dry_run in [true, false] {
            let e = c.apply(21, &with_files, mode, dry_run).await.unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument, "{mode:?} {e:?}");
            assert!(
                e.message()
                    .starts_with("this config change can't be applied in immediate mode\ndiff:"),
                "{e:?}"
            );
            assert!(e.message().contains(".machine.files"), "{e:?}");
        }
    }
    let dry = c.apply(21, &with_files, Mode::Auto, true).await.unwrap();
    assert_eq!(dry.mode, Mode::Reboot as i32);
    assert!(
        dry.mode_details.starts_with(
            "Dry run summary:\nApplied configuration with a reboot (skipped in dry-run).\nConfig diff:\n\n"
        ),
        "{}",
        dry.mode_details
    );
    assert!(
        dry.mode_details.contains("+      op: create"),
        "{}",
        dry.mode_details
    );
    let sysctl_only = c.config("worker-11", false, &sysctls);
    let dry = c
        .apply(21, &sysctl_only, Mode::NoReboot, true)
        .await
        .unwrap();
    assert_eq!(dry.mode, Mode::NoReboot as i32);
    // AUTO becomes REBOOT: persisted, then a reboot into it.
    let first = c.boot_id(21).await.unwrap();
    let r = c.apply(21, &with_files, Mode::Auto, false).await.unwrap();
    assert_eq!(r.mode, Mode::Reboot as i32);
    assert!(
        r.mode_details.starts_with(
            "Applied configuration with a reboot: this config change can't be applied in immediate mode"
        ),
        "{}",
        r.mode_details
    );
    c.next_boot(21, &first).await;
    let dry = c
        .apply(21, &with_files, Mode::NoReboot, true)
        .await
        .unwrap();
    assert!(
        dry.mode_details.ends_with("No changes."),
        "{}",
        dry.mode_details
    );
    let d = c.day2("worker-11");
    assert_eq!(d["applies_by_mode"], json!({"reboot": 1}), "{d}");
    assert_eq!(d["timeline"][0]["why"], "apply", "{d}");

    // v1.14.0: no CanApplyImmediate, no REBOOT mode, AUTO is NO_REBOOT.
    let with_files = c.config("worker-14", false, &files);
    let dry = c
        .apply(22, &with_files, Mode::NoReboot, true)
        .await
        .unwrap();
    assert!(
        dry.mode_details.starts_with(
            "Dry run summary:\nApplied configuration without a reboot (skipped in dry-run)."
        ),
        "{}",
        dry.mode_details
    );
    let e = c
        .apply(22, &with_files, Mode::Reboot, true)
        .await
        .unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (
            Code::Unimplemented,
            "the REBOOT mode is not supported, please use AUTO or NO_REBOOT modes instead"
        )
    );
    let boot = c.boot_id(22).await.unwrap();
    let r = c.apply(22, &with_files, Mode::Auto, false).await.unwrap();
    assert_eq!(
        (r.mode, r.mode_details.as_str()),
        (
            Mode::NoReboot as i32,
            "Applied configuration without a reboot"
        )
    );
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(c.boot_id(22).await.unwrap(), boot, "no reboot on v1.14");
    let dry = c
        .apply(22, &with_files, Mode::NoReboot, true)
        .await
        .unwrap();
    assert!(
        dry.mode_details.ends_with("No changes."),
        "{}",
        dry.mode_details
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_boot_id_changes_on_every_reboot_v1_12_9() {
    let c = Cluster::start(5, &[], &[("worker-01", 21, false, "v1.12.9")]).await;
    let mut ids = vec![c.boot_id(21).await.unwrap()];
    for mode in [
        reboot_request::Mode::Powercycle,
        reboot_request::Mode::Default,
    ] {
        let r = c
            .machine(21)
            .await
            .reboot(RebootRequest { mode: mode as i32 })
            .await
            .unwrap();
        assert!(!r.into_inner().messages[0].actor_id.is_empty());
        let next = c.next_boot(21, ids.last().unwrap()).await;
        assert!(!ids.contains(&next), "{next} seen before: {ids:?}");
        ids.push(next);
    }
    let d = c.day2("worker-01");
    assert_eq!(d["boot_ids"], json!(ids), "{d}");
    assert_eq!(d["reboots"], 2, "{d}");
    assert_eq!(d["reboot_modes"], json!(["POWERCYCLE", "DEFAULT"]), "{d}");
    assert_eq!(c.version(21).await, "v1.12.9");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_apply_meets_the_apply_lock_on_v1_14_0_not_on_v1_11_5() {
    let c = Cluster::start(
        6,
        &["--apply-time", "1500"],
        &[
            ("worker-11", 21, false, "v1.11.5"),
            ("worker-14", 22, false, "v1.14.0"),
        ],
    )
    .await;
    let sysctls = ["sysctls:", "  vm.max_map_count: \"262144\""];
    for (name, host, locks) in [("worker-14", 22, true), ("worker-11", 21, false)] {
        let config = c.config(name, false, &sysctls);
        let (a, b) = tokio::join!(c.apply(host, &config, Mode::NoReboot, false), async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            c.apply(host, &config, Mode::NoReboot, false).await
        });
        assert!(a.is_ok(), "{name}: {a:?}");
        if locks {
            let e = b.unwrap_err();
            assert_eq!(
                (e.code(), e.message()),
                (
                    Code::FailedPrecondition,
                    "another apply configuration is already in progress"
                ),
                "{name}"
            );
        } else {
            assert!(b.is_ok(), "{name}: {b:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_non_try_request_even_a_dry_run_cancels_a_pending_try_v1_11_5() {
    let c = Cluster::start(7, &[], &[("worker-01", 21, false, "v1.11.5")]).await;
    let tried = c.config("worker-01", false, &["sysctls:", "  a.b: \"1\""]);
    let try_for = |secs: i64| ApplyConfigurationRequest {
        data: tried.as_bytes().to_vec(),
        mode: Mode::Try as i32,
        dry_run: false,
        try_mode_timeout: Some(prost_types::Duration {
            seconds: secs,
            nanos: 0,
        }),
    };
    let r = c
        .machine(21)
        .await
        .apply_configuration(try_for(2))
        .await
        .unwrap();
    assert!(
        r.into_inner().messages[0]
            .mode_details
            .ends_with("will be automatically reverted back in 2s")
    );
    assert_eq!(c.day2("worker-01")["try_pending"], true);
    // A NO_REBOOT dry run (what a status check sends) cancels the rollback.
    let dry = c.apply(21, &tried, Mode::NoReboot, true).await.unwrap();
    assert!(
        dry.mode_details.ends_with("No changes."),
        "{}",
        dry.mode_details
    );
    let d = c.day2("worker-01");
    assert_eq!(
        (&d["try_pending"], &d["try_cancellations"]),
        (&json!(false), &json!(1)),
        "{d}"
    );
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let d = c.day2("worker-01");
    assert_eq!(d["try_rollbacks"], 0, "{d}");
    let dry = c.apply(21, &tried, Mode::NoReboot, true).await.unwrap();
    assert!(
        dry.mode_details.ends_with("No changes."),
        "kept: {}",
        dry.mode_details
    );

    // Left alone, a TRY rolls back.
    let other = c.config("worker-01", false, &["sysctls:", "  a.b: \"2\""]);
    let mut req = try_for(1);
    req.data = other.as_bytes().to_vec();
    c.machine(21).await.apply_configuration(req).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let d = c.day2("worker-01");
    assert_eq!(
        (&d["try_rollbacks"], &d["try_cancellations"]),
        (&json!(1), &json!(1)),
        "{d}"
    );
    let dry = c.apply(21, &tried, Mode::NoReboot, true).await.unwrap();
    assert!(
        dry.mode_details.ends_with("No changes."),
        "rolled back: {}",
        dry.mode_details
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_answers_on_the_old_version_and_stalls_connects_v1_12_9() {
    let c = Cluster::start(
        8,
        &["--stall-delay", "1000"],
        &[("worker-01", 21, false, "v1.12.9")],
    )
    .await;
    c.post(
        "node",
        json!({"node": "worker-01", "drain_ms": 3000, "stall_connects": true, "leave_cordoned": true}),
    );
    let first = c.boot_id(21).await.unwrap();
    c.machine(21)
        .await
        .upgrade(upgrade_request(&c.installer("v1.12.10"), false, false))
        .await
        .unwrap();
    // A 500 ms connect during the drain times out: not a reboot.
    let t = Instant::now();
    let stalled = tokio::time::timeout(Duration::from_millis(500), c.channel(21)).await;
    assert!(stalled.is_err(), "connected in {:?}", t.elapsed());
    assert_eq!(c.version(21).await, "v1.12.9", "the old version answers");
    assert_eq!(c.boot_id(21).await.unwrap(), first);
    c.next_boot(21, &first).await;
    assert_eq!(c.version(21).await, "v1.12.10");
    assert_eq!(c.day2("worker-01")["cordoned"], true, "left cordoned");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_upgrade_installs_for_the_next_boot_from_v1_13_not_below() {
    let c = Cluster::start(
        9,
        &[],
        &[
            ("worker-12", 21, false, "v1.12.9"),
            ("worker-13", 22, false, "v1.13.5"),
        ],
    )
    .await;
    let image = c.installer("v1.13.6");
    // The system containerd, namespace `system` (ctrhelper.go).
    let system = ContainerdInstance {
        driver: ContainerDriver::Containerd as i32,
        namespace: ContainerdNamespace::NsSystem as i32,
    };
    let upgrade = |image: &str| LifecycleServiceUpgradeRequest {
        containerd: Some(system),
        source: Some(InstallArtifactsSource {
            image_name: image.into(),
        }),
    };
    let pull = ImageServicePullRequest {
        containerd: Some(system),
        image_ref: image.clone(),
    };
    // v1.12.9 has neither service.
    let ch = c.channel(21).await.unwrap();
    let e = LifecycleServiceClient::new(ch.clone())
        .upgrade(upgrade(&image))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented, "{e:?}");
    let e = ImageServiceClient::new(ch)
        .pull(pull.clone())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented, "{e:?}");

    let ch = c.channel(22).await.unwrap();
    // Not pulled yet: the installer container cannot start.
    let e = LifecycleServiceClient::new(ch.clone())
        .upgrade(upgrade(&image))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Internal, "{e:?}");
    // No instance named: driver CONTAINERD, namespace NS_UNKNOWN.
    let mut unnamed = upgrade(&image);
    unnamed.containerd = None;
    let e = LifecycleServiceClient::new(ch.clone())
        .upgrade(unnamed)
        .await
        .unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (
            Code::InvalidArgument,
            "invalid containerd namespace NS_UNKNOWN"
        )
    );
    let mut s = ImageServiceClient::new(ch.clone())
        .pull(pull)
        .await
        .unwrap()
        .into_inner();
    let mut name = None;
    while let Some(m) = s.message().await.unwrap() {
        if let Some(image_service_pull_response::Response::Name(n)) = m.response {
            name = Some(n);
        }
    }
    assert_eq!(name.as_deref(), Some(image.as_str()));
    let mut s = LifecycleServiceClient::new(ch.clone())
        .upgrade(upgrade(&image))
        .await
        .unwrap()
        .into_inner();
    let mut exit = None;
    while let Some(m) = s.message().await.unwrap() {
        if let Some(Progress::ExitCode(code)) = m.progress.and_then(|p| p.response) {
            exit = Some(code);
        }
    }
    assert_eq!(exit, Some(0));
    // No reboot of its own: the old version runs until the next boot.
    let first = c.boot_id(22).await.unwrap();
    assert_eq!(c.version(22).await, "v1.13.5");
    c.machine(22)
        .await
        .reboot(RebootRequest::default())
        .await
        .unwrap();
    c.next_boot(22, &first).await;
    assert_eq!(c.version(22).await, "v1.13.6");
    let d = c.day2("worker-13");
    assert_eq!(
        (&d["lifecycle_upgrades"], &d["upgrades"]),
        (&json!(3), &json!(1)),
        "{d}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stock_nodes_have_no_schematic_and_a_read_can_fail_v1_11_5() {
    use imgbuild::talos::api::cosi::resource::ListRequest;
    use imgbuild::talos::api::cosi::resource::state_client::StateClient;
    let c = Cluster::start(
        10,
        &["--misbehave", "stock@worker-01"],
        &[
            ("worker-01", 21, false, "v1.11.5"),
            ("worker-02", 22, false, "v1.11.5"),
        ],
    )
    .await;
    let list = || ListRequest {
        namespace: "runtime".into(),
        r#type: "ExtensionStatuses.runtime.talos.dev".into(),
        ..ListRequest::default()
    };
    let count = |host: u8| {
        let c = &c;
        async move {
            let mut s = StateClient::new(c.channel(host).await.unwrap())
                .list(list())
                .await?
                .into_inner();
            let mut n = 0;
            while s.message().await?.is_some() {
                n += 1;
            }
            Ok::<_, tonic::Status>(n)
        }
    };
    assert_eq!(count(21).await.unwrap(), 0, "stock: no schematic extension");
    assert_eq!(count(22).await.unwrap(), 1);
    c.post(
        "node",
        json!({"node": "worker-02", "schematic_read_fails": true}),
    );
    assert_eq!(count(22).await.unwrap_err().code(), Code::Unavailable);
}

/// Reset's `system_partitions_to_wipe` per release (siderolabs/talos
/// `v1alpha1_server.go` `Reset`): before v1.14 etcd's data is the directory
/// volume ETCD under EPHEMERAL, which a Reset may not name ("is not
/// located"); v1.14 (v1.14.0-rc.1) lets ETCD have a partition of its own
/// (a `VolumeConfig` named ETCD with provisioning): naming it wipes it, and
/// wiping STATE and EPHEMERAL leaves it and the etcd data on it; as a
/// directory it may be named only with EPHEMERAL (`FindBackingVolume`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_wipes_a_separate_etcd_volume_only_on_v1_14_and_only_when_named() {
    let c = Cluster::start(
        11,
        &[],
        &[
            ("w-13", 21, false, "v1.13.5"),
            ("w-14", 22, false, "v1.14.0"),
        ],
    )
    .await;
    let etcd_partition = "---\napiVersion: v1alpha1\nkind: VolumeConfig\nname: ETCD\nprovisioning:\n  minSize: 2GiB\n";
    let config = format!("{}{etcd_partition}", c.config("w-14p", false, &[]));
    let v = c.post(
        "boot",
        json!({"name": "w-14p", "ip": c.ip(23), "hostname": "w-14p",
            "config": config, "talos_version": "v1.14.0"}),
    );
    assert_eq!(v["configured"], true, "{v}");
    let reset = |labels: &[&str]| ResetRequest {
        graceful: false,
        system_partitions_to_wipe: labels
            .iter()
            .map(|l| ResetPartitionSpec {
                label: (*l).into(),
                wipe: true,
            })
            .collect(),
        ..ResetRequest::default()
    };
    let refused = |r: Result<tonic::Response<ResetResponse>, tonic::Status>| {
        let e = r.unwrap_err();
        assert_eq!(e.code(), Code::Unknown, "{e:?}");
        e.message().to_owned()
    };
    let e = refused(
        c.machine(21)
            .await
            .reset(reset(&["STATE", "EPHEMERAL", "ETCD"]))
            .await,
    );
    assert_eq!(e, "failed to reset: volume \"ETCD\" is not located");
    let e = refused(c.machine(22).await.reset(reset(&["STATE", "ETCD"])).await);
    assert_eq!(
        e,
        "failed to reset: volume \"ETCD\" resides on volume \"EPHEMERAL\", and therefore \"ETCD\" cannot be wiped without wiping \"EPHEMERAL\""
    );
    c.machine(22)
        .await
        .reset(reset(&["STATE", "EPHEMERAL", "ETCD"]))
        .await
        .unwrap();
    c.machine(23)
        .await
        .reset(reset(&["STATE", "EPHEMERAL"]))
        .await
        .unwrap();
    let sequence = |node: &str| {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let calls = c.sim.stats()["removals"]["calls"].clone();
            if let Some(s) = calls
                .as_array()
                .unwrap()
                .iter()
                .find(|x| x["node"] == node && x["call"] == "ResetSequence")
            {
                return s.clone();
            }
            assert!(
                Instant::now() < deadline,
                "no ResetSequence for {node}: {calls}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let s = sequence("w-14");
    assert_eq!(
        (&s["wiped"], &s["etcd_data_wiped"]),
        (&json!(["STATE", "EPHEMERAL"]), &json!(true)),
        "ETCD went with EPHEMERAL: {s}"
    );
    let s = sequence("w-14p");
    assert_eq!(
        (&s["wiped"], &s["etcd_data_wiped"]),
        (&json!(["STATE", "EPHEMERAL"]), &json!(false)),
        "the ETCD partition stays: {s}"
    );
}

impl Cluster {
    /// The node identity as `talosctl get nodeidentity` reads it (COSI
    /// `Identities.cluster.talos.dev` `cluster/local`, siderolabs/talos
    /// `pkg/machinery/resources/cluster/identity.go`): its `nodeId`.
    async fn node_id(&self, host: u8) -> Result<String, tonic::Status> {
        use imgbuild::talos::api::cosi::resource::GetRequest;
        use imgbuild::talos::api::cosi::resource::state_client::StateClient;
        let channel = self
            .channel(host)
            .await
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        let r = StateClient::new(channel)
            .get(GetRequest {
                namespace: "cluster".into(),
                r#type: "Identities.cluster.talos.dev".into(),
                id: "local".into(),
                options: None,
            })
            .await?
            .into_inner()
            .resource
            .unwrap();
        let md = r.metadata.unwrap();
        assert_eq!(
            (md.namespace.as_str(), md.r#type.as_str(), md.id.as_str()),
            ("cluster", "Identities.cluster.talos.dev", "local")
        );
        let yaml = r.spec.unwrap().yaml_spec;
        let id = yaml
            .strip_prefix("nodeId: ")
            .and_then(|s| s.strip_suffix('\n'))
            .unwrap_or_else(|| panic!("spec {yaml:?}"));
        // 32 bytes in jxskiss/base62: 43 to 45 characters of [A-Za-z0-9].
        assert!(
            (43..=45).contains(&id.len()) && id.chars().all(|c| c.is_ascii_alphanumeric()),
            "{id}"
        );
        Ok(id.to_owned())
    }

    /// Waits until the node on `host` answers the identity read (after a
    /// boot or a reboot).
    async fn node_id_when_up(&self, host: u8) -> String {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match self.node_id(host).await {
                Ok(id) => return id,
                Err(e) => assert!(Instant::now() < deadline, "{host}: {e:?}"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn halt(&self, host: u8) {
        let v = self.post("halt", json!({"ip": self.ip(host)}));
        assert_eq!(v["halted"], true, "{v}");
    }

    /// Boots machine `name` (`machine`: its creation, if given) configured
    /// at `host`.
    fn boot(&self, name: &str, machine: Option<&str>, host: u8, version: &str) {
        let mut body = json!({"name": name, "ip": self.ip(host), "hostname": name,
            "config": self.config(name, false, &[]), "talos_version": version});
        if let Some(m) = machine {
            body["machine"] = json!(m);
        }
        let v = self.post("boot", body);
        assert_eq!(v["booted"], true, "{v}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_identity_survives_reboots_upgrades_and_restarts_v1_12_9() {
    let c = Cluster::start(
        12,
        &[],
        &[("w-a", 21, false, "v1.12.9"), ("w-b", 22, false, "v1.12.9")],
    )
    .await;
    let a = c.node_id(21).await.unwrap();
    let b = c.node_id(22).await.unwrap();
    assert_ne!(a, b, "every machine has its own");
    let stats = c.sim.stats();
    assert_eq!(stats["nodes"]["w-a"]["node_id"], json!(a), "{stats}");

    // A reboot: a new boot, the same identity (STATE kept node-identity.yaml).
    let boot = c.boot_id(21).await.unwrap();
    c.machine(21)
        .await
        .reboot(RebootRequest {
            mode: reboot_request::Mode::Default as i32,
        })
        .await
        .unwrap();
    c.next_boot(21, &boot).await;
    assert_eq!(c.node_id_when_up(21).await, a, "after a reboot");

    // An upgrade: the same.
    let boot = c.boot_id(21).await.unwrap();
    c.machine(21)
        .await
        .upgrade(upgrade_request(&c.installer("v1.12.10"), true, false))
        .await
        .unwrap();
    c.next_boot(21, &boot).await;
    assert_eq!(c.version(21).await, "v1.12.10");
    assert_eq!(c.node_id_when_up(21).await, a, "after an upgrade");

    // The VM stopped and started again: its disk kept STATE.
    c.halt(22);
    c.boot("w-b", None, 22, "v1.12.9");
    assert_eq!(c.node_id_when_up(22).await, b, "after a power cycle");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_machine_or_a_wiped_state_at_an_address_has_another_identity_v1_13_5() {
    let c = Cluster::start(
        13,
        &[],
        &[
            ("w-a", 21, false, "v1.13.5"),
            ("w-b", 22, false, "v1.13.5"),
            ("w-c", 23, false, "v1.13.5"),
        ],
    )
    .await;
    let a = c.node_id(21).await.unwrap();
    let b = c.node_id(22).await.unwrap();
    let cc = c.node_id(23).await.unwrap();

    // Another machine at w-a's address (the VM deleted, another created
    // there): another identity.
    c.halt(21);
    c.boot("w-new", None, 21, "v1.13.5");
    let fresh = c.node_id_when_up(21).await;
    assert_ne!(fresh, a, "a new machine at a reused address");

    // The same name, but another creation (a vmid or a server name reused):
    // another machine too.
    c.halt(23);
    c.boot("w-c", Some("second"), 23, "v1.13.5");
    assert_ne!(
        c.node_id_when_up(23).await,
        cc,
        "same name, another machine"
    );

    // A Reset wiping STATE: the next configured boot makes a new identity;
    // one wiping EPHEMERAL only keeps it.
    let reset = |labels: &[&str]| ResetRequest {
        graceful: false,
        system_partitions_to_wipe: labels
            .iter()
            .map(|l| ResetPartitionSpec {
                label: (*l).into(),
                wipe: true,
            })
            .collect(),
        ..ResetRequest::default()
    };
    let halted = |name: &str| {
        let deadline = Instant::now() + Duration::from_secs(10);
        while c.sim.stats()["nodes"][name]["halted"] != true {
            assert!(Instant::now() < deadline, "{name} never powered off");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    c.machine(22)
        .await
        .reset(reset(&["EPHEMERAL"]))
        .await
        .unwrap();
    halted("w-b");
    c.boot("w-b", None, 22, "v1.13.5");
    assert_eq!(c.node_id_when_up(22).await, b, "STATE kept");
    c.machine(22)
        .await
        .reset(reset(&["STATE", "EPHEMERAL"]))
        .await
        .unwrap();
    halted("w-b");
    c.boot("w-b", None, 22, "v1.13.5");
    let after = c.node_id_when_up(22).await;
    assert_ne!(after, b, "STATE wiped");
    assert_ne!(after, fresh);
}
