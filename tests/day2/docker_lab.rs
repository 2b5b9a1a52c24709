//! End to end: `examples/docker-lab`, three Talos nodes (v1.11.2, the node
//! simulator's default) that this host reaches only through published
//! ports, as Talos containers on a Docker bridge are. The Talos APIs come
//! through `--talos-forward`s, the Kubernetes API through a
//! `--kube-forward` showing the in-cluster certificate; the simulator's
//! connection log shows which addresses were used. And the kubeconfig of a
//! cluster whose VIP comes late moving to the VIP once it answers.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use imgbuild::talos::kube::Kubeconfig;

use crate::common;
use common::run::Run;
use common::sims::Nodes;
use common::{json, root, text};

/// The loopback /24 of scenario `k` (tests/common/net.rs).
fn net(k: u8) -> String {
    common::net::scenario(module_path!(), k)
}

/// The lab's three nodes on `net` as the simulator takes them.
fn node_args(net: &str) -> Vec<String> {
    [
        ("cp-01", 2, "controlplane"),
        ("worker-01", 3, "worker"),
        ("worker-02", 4, "worker"),
    ]
    .iter()
    .flat_map(|(name, host, role)| ["--node".to_owned(), format!("{name}={net}.{host}:{role}")])
    .collect()
}

/// `examples/docker-lab/cluster.yaml` moved onto `net`, each of its
/// forwards replaced by `forward(example's address)`.
fn lab_inventory(dir: &Path, net: &str, forward: impl Fn(&str) -> String) -> PathBuf {
    let mut text =
        std::fs::read_to_string(root().join("examples/docker-lab/cluster.yaml")).unwrap();
    for example in [
        "127.0.0.1:50000",
        "127.0.0.1:50001",
        "127.0.0.1:50002",
        "https://127.0.0.1:6443",
    ] {
        assert!(text.contains(example), "the example has {example}");
        text = text.replace(example, &forward(example));
    }
    let text = text.replace("10.5.0.", &format!("{net}."));
    let path = dir.join("cluster.yaml");
    std::fs::write(&path, text).unwrap();
    path
}

fn bootstrap(config: &Path) -> (Output, serde_json::Value) {
    let out = Run::with_config(config, &["--output", "json", "bootstrap", "--new-secrets"])
        .timeouts(&[])
        .env_remove("IMGBUILD_STATE_DIR")
        .env_remove("TALOSCONFIG")
        .output();
    let v = json(&out);
    (out, v)
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

/// The addresses (`IP:PORT`) the simulator accepted `api` connections on.
fn connections(nodes: &Nodes, api: &str) -> Vec<String> {
    let stats = nodes.stats();
    let map = stats["connections"][api]
        .as_object()
        .unwrap_or_else(|| panic!("no connection log: {stats}"));
    map.keys().cloned().collect()
}

#[test]
fn the_docker_lab_bootstraps_and_checks_health_through_the_forwards_only() {
    let net = net(240);
    let mut args = node_args(&net);
    for (flag, name) in [
        ("--kube-forward", "cp-01"),
        ("--talos-forward", "cp-01"),
        ("--talos-forward", "worker-01"),
        ("--talos-forward", "worker-02"),
    ] {
        args.extend([flag.to_owned(), format!("{name}=127.0.0.1:0")]);
    }
    let nodes = Nodes::start(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let fwd = |kind: &str, name: &str| nodes.forwards[kind][name].as_str().unwrap().to_owned();
    let kube = fwd("kube", "cp-01");
    let talos = [
        fwd("talos", "cp-01"),
        fwd("talos", "worker-01"),
        fwd("talos", "worker-02"),
    ];
    let dir = tempfile::tempdir().unwrap();
    let config = lab_inventory(dir.path(), &net, |example| match example {
        "127.0.0.1:50000" => talos[0].clone(),
        "127.0.0.1:50001" => talos[1].clone(),
        "127.0.0.1:50002" => talos[2].clone(),
        _ => format!("https://{kube}"),
    });

    let (out, v) = bootstrap(&config);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(v["healthy"], true, "{v}");
    assert_eq!(v["kubeconfigServer"], format!("https://{kube}"), "{v}");
    assert_eq!(v["fallbacks"], serde_json::json!([]), "{v}");

    // The kubeconfig written: the host-side server, the in-cluster name.
    let path = dir.path().join(".talos/docker-lab/kubeconfig");
    assert_eq!(mode(&path), 0o600);
    let written = std::fs::read_to_string(&path).unwrap();
    assert!(
        written.contains(&format!("tls-server-name: {net}.2")),
        "{written}"
    );
    let kc = Kubeconfig::parse(&written).unwrap();
    assert_eq!(kc.server, format!("https://{kube}"));
    assert_eq!(kc.tls_server_name, Some(format!("{net}.2")));

    // `status` asks Kubernetes too, through the same kubeconfig.
    let through_forward = || nodes.stats()["connections"]["k8s"][&kube].as_u64().unwrap();
    let before_status = through_forward();
    let out = Run::with_config(&config, &["--output", "json", "status"])
        .timeouts(&[])
        .env_remove("IMGBUILD_STATE_DIR")
        .env_remove("TALOSCONFIG")
        .output();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let status = text(&out.stdout);
    assert!(
        status.contains("Ready") || status.contains("ready"),
        "{status}"
    );

    // The connection log: Kubernetes only through the forward (never the
    // in-cluster :6443), Talos only through the forwards.
    let k8s = connections(&nodes, "k8s");
    assert_eq!(k8s, std::slice::from_ref(&kube), "Kubernetes connections");
    let mut seen = connections(&nodes, "talos");
    seen.sort();
    let mut want = talos.to_vec();
    want.sort();
    assert_eq!(seen, want, "Talos connections");
    assert!(through_forward() > before_status, "status asked Kubernetes");

    // Verification is real: the right CA and name pass, anything else fails.
    let t = Duration::from_secs(5);
    assert_eq!(kc.node_readiness(t).unwrap().len(), 3);
    let other_name = kc.with_tls_server_name(Some("10.9.9.9"));
    let e = other_name.node_readiness(t).unwrap_err().to_string();
    assert!(e.contains("invalid peer certificate"), "{e}");
    // Without the name, 127.0.0.1 is checked: the in-cluster certificate
    // does not carry it.
    let no_name = kc.with_tls_server_name(None);
    let e = no_name.node_readiness(t).unwrap_err().to_string();
    assert!(e.contains("invalid peer certificate"), "{e}");
    let other_ca = imgbuild::talos::pki::new_ca(
        imgbuild::talos::pki::KeyKind::EcdsaP256,
        "kubernetes",
        None,
        1,
    )
    .unwrap();
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD;
    let ca_line = written
        .lines()
        .find(|l| l.trim_start().starts_with("certificate-authority-data:"))
        .unwrap();
    let wrong_ca = written.replace(
        ca_line,
        &format!(
            "    certificate-authority-data: {}",
            b64.encode(&other_ca.crt)
        ),
    );
    let e = Kubeconfig::parse(&wrong_ca)
        .unwrap()
        .node_readiness(t)
        .unwrap_err()
        .to_string();
    // Another CA of the same name: its signature does not verify.
    assert!(e.contains("invalid peer certificate"), "{e}");
}

/// `POST /_sim/vip`: the held VIP may appear.
fn release_vip(nodes: &Nodes) {
    let ok = Command::new("curl")
        .args(["-sf", "-X", "POST", &format!("{}/_sim/vip", nodes.control)])
        .output()
        .unwrap();
    assert!(ok.status.success(), "{}", text(&ok.stderr));
}

#[test]
fn the_kubeconfig_moves_to_the_vip_once_it_answers() {
    let net = net(241);
    let mut args = node_args(&net);
    args.extend([
        "--vip".to_owned(),
        format!("{net}.10"),
        "--vip-held".to_owned(),
    ]);
    let nodes = Nodes::start(&args.iter().map(String::as_str).collect::<Vec<_>>());
    // The lab's inventory on the nodes' own addresses, its endpoint the VIP.
    let dir = tempfile::tempdir().unwrap();
    let config = lab_inventory(dir.path(), &net, |_| "REMOVE".into());
    let text_in = std::fs::read_to_string(&config).unwrap();
    let kept: Vec<&str> = text_in.lines().filter(|l| !l.contains("REMOVE")).collect();
    let inv = kept.join("\n").replace(
        &format!("endpoint: https://{net}.2:6443"),
        &format!("endpoint: https://{net}.10:6443\n  vip: {net}.10"),
    );
    std::fs::write(&config, inv).unwrap();

    let cp = format!("https://{net}.2:6443");
    let vip = format!("https://{net}.10:6443");
    let (out, v) = bootstrap(&config);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(v["kubeconfigServer"], cp, "{v}");
    assert_eq!(v["fallbacks"][0]["setting"], "cluster.vip", "{v}");
    let path = dir.path().join(".talos/docker-lab/kubeconfig");
    assert_eq!(
        Kubeconfig::parse(&std::fs::read_to_string(&path).unwrap())
            .unwrap()
            .server,
        cp
    );

    release_vip(&nodes);
    let deadline = Instant::now() + Duration::from_secs(20);
    let vip_addr: std::net::SocketAddr = format!("{net}.10:6443").parse().unwrap();
    while std::net::TcpStream::connect_timeout(&vip_addr, Duration::from_millis(200)).is_err() {
        assert!(Instant::now() < deadline, "the VIP never came up");
        std::thread::sleep(Duration::from_millis(100));
    }

    let out = Run::with_config(&config, &["--output", "json", "bootstrap", "--new-secrets"])
        .timeouts(&[])
        .env_remove("IMGBUILD_STATE_DIR")
        .env_remove("TALOSCONFIG")
        .output();
    let v = json(&out);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(v["kubeconfigServer"], vip, "{v}");
    assert_eq!(v["kubeconfigMovedFrom"], cp, "{v}");
    assert_eq!(v["fallbacks"], serde_json::json!([]), "{v}");
    let log = text(&out.stderr);
    assert!(
        log.contains(&format!("kubeconfig moved from {cp} to {vip}")),
        "{log}"
    );
    assert_eq!(mode(&path), 0o600);
    let kc = Kubeconfig::parse(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(kc.server, vip);
    assert_eq!(kc.tls_server_name, None);
    assert_eq!(kc.node_readiness(Duration::from_secs(5)).unwrap().len(), 3);

    // Moved once: a third run has nothing to move.
    let (out, v) = bootstrap(&config);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(v["kubeconfigMovedFrom"], serde_json::Value::Null, "{v}");
}

#[test]
fn a_kubernetes_endpoint_that_is_not_an_https_url_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let config = lab_inventory(dir.path(), "10.5.0", |example| match example {
        "https://127.0.0.1:6443" => "127.0.0.1:6443".into(),
        other => other.into(),
    });
    let out = Run::with_config(&config, &["validate"]).output();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(
        err.contains("cluster.kubernetesEndpoint") && err.contains("\"127.0.0.1:6443\""),
        "{err}"
    );
    // The example itself is valid as shipped.
    let out = Run::with_config(
        &root().join("examples/docker-lab/cluster.yaml"),
        &["validate"],
    )
    .output();
    assert!(out.status.success(), "{}", text(&out.stderr));
}
