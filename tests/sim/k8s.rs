//! The node simulator's Kubernetes side (`imgbuild-sim nodes`, issue 31)
//! driven directly: over its Kubernetes API with curl and an admin
//! certificate, and over the Talos API with a gRPC client, one Talos version
//! per case. What each case holds the simulator to: control-plane static
//! pods and the kubelet restart when an `ApplyConfiguration` NO_REBOOT
//! changes their image (siderolabs/talos `internal/app/machined/pkg/
//! controllers/k8s/control_plane_static_pod.go`, waited for as `pkg/cluster/
//! kubernetes/talos_managed.go` and `kubelet.go` wait); Talos never updates
//! a bootstrap manifest that exists (`manifest_apply.go`), server-side apply
//! does (kubernetes `apiserver/pkg/endpoints/handlers/patch.go`); a kubelet
//! image the running Talos cannot run is refused from v1.11
//! (`pkg/machinery/config/types/v1alpha1/v1alpha1_validation.go`); the
//! deprecated-API metric and removed API versions (kubernetes
//! `apiserver/pkg/endpoints/metrics/metrics.go`).

use std::process::Command;
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use imgbuild::talos::api::common::{ContainerDriver, ContainerdInstance, ContainerdNamespace};
use imgbuild::talos::api::cosi::resource::state_client::StateClient;
use imgbuild::talos::api::cosi::resource::{GetRequest, ListRequest};
use imgbuild::talos::api::machine::apply_configuration_request::Mode;
use imgbuild::talos::api::machine::image_service_client::ImageServiceClient;
use imgbuild::talos::api::machine::machine_service_client::MachineServiceClient;
use imgbuild::talos::api::machine::*;
use imgbuild::talos::pki::{self, CertAndKey, KeyKind, LeafSpec};
use serde_json::{Value, json};
use tonic::Code;
use tonic::transport::Channel;

use crate::common;
use common::sims::Nodes;
use common::text;

/// Delays small enough for tests, long enough to be seen.
const DELAYS: [&str; 16] = [
    "--apply-delay",
    "50",
    "--etcd-delay",
    "150",
    "--kubelet-delay",
    "100",
    "--ready-delay",
    "100",
    "--static-pod-delay",
    "700",
    "--kubelet-restart-delay",
    "700",
    "--rollout-delay",
    "500",
    "--talos-version",
    "v1.11.5",
];

/// A simulated cluster, its CAs and an admin identity for each API.
struct Cluster {
    sim: Nodes,
    net: String,
    talos_ca: CertAndKey,
    talos_admin: CertAndKey,
    k8s_ca: CertAndKey,
    /// ca.crt, admin.crt, admin.key for curl.
    dir: tempfile::TempDir,
}

/// A node to boot: name, last octet, control plane, Talos version.
type Spec<'a> = (&'a str, u8, bool, &'a str);

impl Cluster {
    /// Boots `nodes` configured with Kubernetes v1.32.1 (VIP `.10`),
    /// bootstraps the first control plane and waits until every Node is
    /// Ready.
    async fn start(k: u8, nodes: &[Spec<'_>]) -> Cluster {
        let talos_ca = pki::new_ca(KeyKind::Ed25519, "talos", None, 10).unwrap();
        let issue = |ca: &CertAndKey, org: &str| {
            pki::issue(
                ca,
                &LeafSpec {
                    organization: Some(org.into()),
                    common_name: "admin".into(),
                    client: true,
                    days: 1,
                    ..LeafSpec::default()
                },
            )
            .unwrap()
        };
        let k8s_ca = pki::new_ca(KeyKind::EcdsaP256, "kubernetes", None, 10).unwrap();
        let k8s_admin = issue(&k8s_ca, "system:masters");
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ca.crt"), &k8s_ca.crt).unwrap();
        std::fs::write(dir.path().join("admin.crt"), &k8s_admin.crt).unwrap();
        std::fs::write(dir.path().join("admin.key"), &k8s_admin.key).unwrap();
        let net = common::net::scenario(module_path!(), k);
        let vip = format!("{net}.10");
        let c = Cluster {
            sim: Nodes::start_with(&DELAYS, &["--vip", &vip]),
            net,
            talos_admin: issue(&talos_ca, "os:admin"),
            talos_ca,
            k8s_ca,
            dir,
        };
        for (name, host, cp, version) in nodes {
            let config = c.config(name, *cp, "v1.32.1", &[]);
            let v = c.post(
                "boot",
                json!({"name": name, "ip": c.ip(*host), "hostname": name,
                    "config": config, "talos_version": version}),
            );
            assert_eq!(v["configured"], true, "{v}");
        }
        let (_, first, _, _) = nodes.iter().find(|n| n.2).expect("a control plane");
        c.machine(*first)
            .await
            .bootstrap(BootstrapRequest::default())
            .await
            .unwrap();
        c.wait("every Node Ready", || {
            let (code, v) = c.kube(10, "GET", "/api/v1/nodes", None);
            code == 200
                && v["items"].as_array().map_or(0, Vec::len) == nodes.len()
                && v["items"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .all(|n| n["status"]["conditions"][0]["status"] == "True")
        })
        .await;
        c
    }

    fn ip(&self, host: u8) -> String {
        format!("{}.{host}", self.net)
    }

    /// A machine config for Kubernetes `k8s`, with `edits` (a JSON pointer
    /// into the v1alpha1 document and its value) applied.
    fn config(&self, name: &str, cp: bool, k8s: &str, edits: &[(&str, Value)]) -> String {
        let b64 = |s: &str| STANDARD.encode(s);
        let mut doc = json!({
            "version": "v1alpha1",
            "machine": {
                "type": if cp { "controlplane" } else { "worker" },
                "ca": {"crt": b64(&self.talos_ca.crt), "key": b64(&self.talos_ca.key)},
                "network": {"hostname": name},
                "install": {"disk": "/dev/sda", "image": "factory.talos.dev/metal-installer/5c:v1.11.5"},
                "kubelet": {"image": format!("ghcr.io/siderolabs/kubelet:{k8s}")},
            },
            "cluster": {
                "clusterName": "sim",
                "controlPlane": {"endpoint": format!("https://{}:6443", self.ip(10))},
                "ca": {"crt": b64(&self.k8s_ca.crt), "key": if cp { b64(&self.k8s_ca.key) } else { String::new() }},
            },
        });
        if cp {
            let cluster = &mut doc["cluster"];
            for (key, repo) in [
                ("apiServer", "kube-apiserver"),
                ("controllerManager", "kube-controller-manager"),
                ("scheduler", "kube-scheduler"),
                ("proxy", "kube-proxy"),
            ] {
                cluster[key] = json!({"image": format!("registry.k8s.io/{repo}:{k8s}")});
            }
        }
        for (pointer, value) in edits {
            *doc.pointer_mut(pointer).unwrap() = value.clone();
        }
        serde_yaml_ng::to_string(&doc).unwrap()
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

    fn k8s_stats(&self) -> Value {
        self.sim.stats()["k8s"].clone()
    }

    /// A Kubernetes API request to the node on `host` (10: the VIP) as the
    /// cluster admin: the HTTP status (0: no connection) and the body
    /// (JSON, else a string).
    fn kube(&self, host: u8, method: &str, path: &str, body: Option<(&str, &str)>) -> (u16, Value) {
        let d = self.dir.path();
        let mut cmd = Command::new("curl");
        cmd.args([
            "-s",
            "--max-time",
            "5",
            "-X",
            method,
            "-w",
            "\n%{http_code}",
        ])
        .arg("--cacert")
        .arg(d.join("ca.crt"))
        .arg("--cert")
        .arg(d.join("admin.crt"))
        .arg("--key")
        .arg(d.join("admin.key"));
        if let Some((content_type, data)) = body {
            cmd.args([
                "-H",
                &format!("content-type: {content_type}"),
                "--data-binary",
                data,
            ]);
        }
        let o = cmd
            .arg(format!("https://{}:6443{path}", self.ip(host)))
            .output()
            .unwrap();
        let out = text(&o.stdout);
        let (body, code) = out.rsplit_once('\n').unwrap_or(("", "0"));
        let value = serde_json::from_str(body).unwrap_or_else(|_| json!(body));
        (code.trim().parse().unwrap_or(0), value)
    }

    /// The items a Kubernetes list at `path` returns through the VIP.
    fn items(&self, path: &str) -> Vec<Value> {
        let (code, v) = self.kube(10, "GET", path, None);
        assert_eq!(code, 200, "{path}: {v}");
        v["items"].as_array().unwrap().clone()
    }

    /// Polls `ok` every 50 ms for up to 15 s.
    async fn wait(&self, what: &str, mut ok: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(15);
        while !ok() {
            assert!(Instant::now() < deadline, "never: {what}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// An mTLS channel to the Talos API of the node on `host`.
    async fn channel(&self, host: u8) -> Channel {
        common::talos::channel(
            &self.talos_ca,
            &self.talos_admin,
            self.ip(host).parse().unwrap(),
        )
        .await
        .unwrap()
    }

    async fn machine(&self, host: u8) -> MachineServiceClient<Channel> {
        MachineServiceClient::new(self.channel(host).await)
    }

    async fn apply(&self, host: u8, config: &str) -> Result<ApplyConfiguration, tonic::Status> {
        let req = ApplyConfigurationRequest {
            data: config.as_bytes().to_vec(),
            mode: Mode::NoReboot as i32,
            dry_run: false,
            try_mode_timeout: None,
        };
        let r = self.machine(host).await.apply_configuration(req).await?;
        Ok(r.into_inner().messages.remove(0))
    }

    /// A COSI resource's (version, YAML spec) on the node on `host`.
    async fn resource(&self, host: u8, namespace: &str, kind: &str, id: &str) -> (String, String) {
        let r = StateClient::new(self.channel(host).await)
            .get(GetRequest {
                namespace: namespace.into(),
                r#type: kind.into(),
                id: id.into(),
                ..GetRequest::default()
            })
            .await
            .unwrap()
            .into_inner()
            .resource
            .unwrap();
        (r.metadata.unwrap().version, r.spec.unwrap().yaml_spec)
    }

    /// The IDs and YAML specs of the `Manifests` on the node on `host`.
    async fn manifests(&self, host: u8) -> Vec<(String, String)> {
        let mut stream = StateClient::new(self.channel(host).await)
            .list(ListRequest {
                namespace: "controlplane".into(),
                r#type: "Manifests.kubernetes.talos.dev".into(),
                ..ListRequest::default()
            })
            .await
            .unwrap()
            .into_inner();
        let mut out = Vec::new();
        while let Some(r) = stream.message().await.unwrap() {
            let r = r.resource.unwrap();
            out.push((r.metadata.unwrap().id, r.spec.unwrap().yaml_spec));
        }
        out
    }

    /// The IDs and versions of the `Manifests` on the node on `host`.
    async fn manifest_versions(&self, host: u8) -> Vec<(String, String)> {
        let mut stream = StateClient::new(self.channel(host).await)
            .list(ListRequest {
                namespace: "controlplane".into(),
                r#type: "Manifests.kubernetes.talos.dev".into(),
                ..ListRequest::default()
            })
            .await
            .unwrap()
            .into_inner();
        let mut out = Vec::new();
        while let Some(r) = stream.message().await.unwrap() {
            let m = r.resource.unwrap().metadata.unwrap();
            out.push((m.id, m.version));
        }
        out
    }
}

/// The mirror pod of `component` on `node`, as listed by label through the
/// VIP (talosctl's selector, with its spaces).
fn mirror_pod(c: &Cluster, component: &str, node: &str) -> Option<Value> {
    let path =
        format!("/api/v1/namespaces/kube-system/pods?labelSelector=k8s-app%20%3D%20{component}");
    c.items(&path)
        .into_iter()
        .find(|p| p["spec"]["nodeName"] == node)
}

fn ready(pod: &Value) -> bool {
    pod["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .any(|c| c["type"] == "Ready" && c["status"] == "True")
}

fn image(object: &Value) -> &str {
    object["spec"]["containers"][0]["image"]
        .as_str()
        .or(object["spec"]["template"]["spec"]["containers"][0]["image"].as_str())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_static_pod_restarts_after_its_image_changes_and_its_api_server_is_down_meanwhile_v1_11_5()
 {
    let c = Cluster::start(
        1,
        &[
            ("cp-01", 11, true, "v1.11.5"),
            ("cp-02", 12, true, "v1.11.5"),
            ("worker-01", 21, false, "v1.11.5"),
        ],
    )
    .await;
    c.wait("both apiservers' mirror pods Ready", || {
        ["cp-01", "cp-02"]
            .iter()
            .all(|n| mirror_pod(&c, "kube-apiserver", n).is_some_and(|p| ready(&p)))
    })
    .await;
    let pod = mirror_pod(&c, "kube-apiserver", "cp-01").unwrap();
    assert_eq!(pod["metadata"]["name"], "kube-apiserver-cp-01");
    assert_eq!(pod["metadata"]["labels"]["tier"], "control-plane");
    assert_eq!(pod["status"]["hostIP"], c.ip(11));
    assert_eq!(image(&pod), "registry.k8s.io/kube-apiserver:v1.32.1");
    assert_eq!(
        pod["metadata"]["annotations"]["talos.dev/config-version"],
        "1"
    );
    let (version, spec) = c
        .resource(
            11,
            "controlplane",
            "APIServerConfigs.kubernetes.talos.dev",
            "kube-apiserver",
        )
        .await;
    assert_eq!(
        (version.as_str(), spec.as_str()),
        ("1", "image: registry.k8s.io/kube-apiserver:v1.32.1\n")
    );

    // talosctl's patch: only the apiserver image, NO_REBOOT.
    let new = "registry.k8s.io/kube-apiserver:v1.33.5";
    let config = c.config(
        "cp-01",
        true,
        "v1.32.1",
        &[("/cluster/apiServer/image", json!(new))],
    );
    let t = Instant::now();
    let r = c.apply(11, &config).await.unwrap();
    assert_eq!(r.mode, Mode::NoReboot as i32, "{r:?}");
    c.wait("the new pod spec", || {
        mirror_pod(&c, "kube-apiserver", "cp-01").is_some_and(|p| image(&p) == new)
    })
    .await;
    let pod = mirror_pod(&c, "kube-apiserver", "cp-01").unwrap();
    assert!(!ready(&pod), "Ready while restarting: {pod}");
    assert_eq!(
        pod["metadata"]["annotations"]["talos.dev/config-version"],
        "2"
    );
    let (code, _) = c.kube(11, "GET", "/api/v1/nodes", None);
    assert_eq!(code, 0, "cp-01's API server answered while it restarts");
    assert_eq!(
        c.kube(12, "GET", "/api/v1/nodes", None).0,
        200,
        "cp-02's did not"
    );
    let (version, _) = c
        .resource(
            11,
            "controlplane",
            "APIServerConfigs.kubernetes.talos.dev",
            "kube-apiserver",
        )
        .await;
    assert_eq!(version, "2", "the version the pod annotation reaches");
    c.wait("the restarted pod Ready", || {
        mirror_pod(&c, "kube-apiserver", "cp-01").is_some_and(|p| ready(&p))
    })
    .await;
    assert!(
        t.elapsed() >= Duration::from_millis(700),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(c.kube(11, "GET", "/api/v1/nodes", None).0, 200);
    let (_, version) = c.kube(10, "GET", "/version", None);
    assert_eq!(version["gitVersion"], "v1.32.1", "cp-02's is the oldest");
    // Nothing else restarted.
    let other = mirror_pod(&c, "kube-scheduler", "cp-01").unwrap();
    assert_eq!(
        other["metadata"]["annotations"]["talos.dev/config-version"],
        "1"
    );
    assert_eq!(
        image(&mirror_pod(&c, "kube-apiserver", "cp-02").unwrap()),
        "registry.k8s.io/kube-apiserver:v1.32.1"
    );
    let restarts = c.k8s_stats()["restarts"].clone();
    let r = restarts.as_array().unwrap();
    assert_eq!(r.len(), 1, "{restarts}");
    assert_eq!(
        (
            &r[0]["node"],
            &r[0]["component"],
            &r[0]["from_image"],
            &r[0]["image"]
        ),
        (
            &json!("cp-01"),
            &json!("kube-apiserver"),
            &json!("registry.k8s.io/kube-apiserver:v1.32.1"),
            &json!(new)
        )
    );
    let took = r[0]["ready_ms"].as_u64().unwrap() - r[0]["start_ms"].as_u64().unwrap();
    assert!((700..800).contains(&took), "{took}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_restarts_with_its_image_and_talos_refuses_one_it_cannot_run_v1_11_5_v1_12_9() {
    let c = Cluster::start(
        2,
        &[
            ("cp-01", 11, true, "v1.11.5"),
            ("worker-11", 21, false, "v1.11.5"),
            ("worker-12", 22, false, "v1.12.9"),
        ],
    )
    .await;
    let node = |name: &str| {
        c.items("/api/v1/nodes")
            .into_iter()
            .find(|n| n["metadata"]["name"] == name)
            .unwrap()
    };
    let worker = node("worker-11");
    assert_eq!(worker["status"]["nodeInfo"]["kubeletVersion"], "v1.32.1");
    assert_eq!(
        worker["status"]["addresses"][0],
        json!({"type": "InternalIP", "address": c.ip(21)})
    );
    assert!(
        worker["metadata"]["labels"]
            .get("node-role.kubernetes.io/control-plane")
            .is_none()
    );
    assert_eq!(
        node("cp-01")["metadata"]["labels"]["node-role.kubernetes.io/control-plane"],
        ""
    );
    let (_, spec) = c
        .resource(21, "k8s", "KubeletSpecs.kubernetes.talos.dev", "kubelet")
        .await;
    assert_eq!(spec, "image: ghcr.io/siderolabs/kubelet:v1.32.1\n");

    let config = c.config("worker-11", false, "v1.33.5", &[]);
    c.apply(21, &config).await.unwrap();
    c.wait("the kubelet restarting", || {
        node("worker-11")["status"]["conditions"][0]["status"] == "False"
    })
    .await;
    let restarting = node("worker-11");
    assert_eq!(
        restarting["status"]["nodeInfo"]["kubeletVersion"], "v1.32.1",
        "{restarting}"
    );
    let services = c
        .machine(21)
        .await
        .service_list(())
        .await
        .unwrap()
        .into_inner();
    let kubelet = services.messages[0]
        .services
        .iter()
        .find(|s| s.id == "kubelet")
        .unwrap();
    assert!(!kubelet.health.as_ref().unwrap().healthy, "{kubelet:?}");
    c.wait("the new kubelet Ready", || {
        let n = node("worker-11");
        n["status"]["conditions"][0]["status"] == "True"
    })
    .await;
    assert_eq!(
        node("worker-11")["status"]["nodeInfo"]["kubeletVersion"],
        "v1.33.5"
    );
    let stats = c.k8s_stats();
    assert_eq!(stats["restarts"][0]["component"], "kubelet", "{stats}");
    assert_eq!(
        stats["components"]["worker-11"]["kubelet"]["image"],
        "ghcr.io/siderolabs/kubelet:v1.33.5"
    );

    // Kubernetes 1.35 is past Talos 1.11's range (1.29–1.34), not 1.12's.
    let too_new = c.config("worker-11", false, "v1.35.0", &[]);
    let e = c.apply(21, &too_new).await.unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (
            Code::InvalidArgument,
            "1 error occurred:\n\t* kubelet image is not valid: version of Kubernetes 1.35.0 is too new to be used with Talos 1.11.5\n\n"
        )
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        node("worker-11")["status"]["nodeInfo"]["kubeletVersion"],
        "v1.33.5"
    );
    assert_eq!(
        c.sim.stats()["nodes"]["worker-11"]["day2"]["apply_refusals"],
        1
    );
    let on_112 = c.config("worker-12", false, "v1.35.0", &[]);
    c.apply(22, &on_112).await.unwrap();
    c.wait("worker-12 on 1.35", || {
        node("worker-12")["status"]["nodeInfo"]["kubeletVersion"] == "v1.35.0"
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bootstrap_manifests_are_created_once_and_changed_only_by_server_side_apply_v1_13_5() {
    let c = Cluster::start(
        3,
        &[
            ("cp-01", 11, true, "v1.13.5"),
            ("worker-01", 21, false, "v1.13.5"),
        ],
    )
    .await;
    let proxy = "/apis/apps/v1/namespaces/kube-system/daemonsets/kube-proxy";
    c.wait("the kube-proxy DaemonSet", || {
        c.kube(10, "GET", proxy, None).0 == 200
    })
    .await;
    let (_, ds) = c.kube(10, "GET", proxy, None);
    assert_eq!(image(&ds), "registry.k8s.io/kube-proxy:v1.32.1");
    assert_eq!(ds["metadata"]["managedFields"][0]["manager"], "talos");
    let dns = c
        .items("/apis/apps/v1/namespaces/kube-system/deployments?labelSelector=k8s-app%3Dkube-dns");
    assert_eq!(
        image(&dns[0]),
        "registry.k8s.io/coredns/coredns:v1.14.2",
        "Talos 1.13.5's default"
    );

    // Each Manifests resource starts at version 1.
    let versions = c.manifest_versions(11).await;
    assert!(versions.iter().all(|(_, v)| v == "1"), "{versions:?}");

    // talosctl's kube-proxy step patches the config; Talos re-renders the
    // manifest but leaves the DaemonSet that exists alone.
    let new = "registry.k8s.io/kube-proxy:v1.33.5";
    let config = c.config(
        "cp-01",
        true,
        "v1.32.1",
        &[("/cluster/proxy/image", json!(new))],
    );
    c.apply(11, &config).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let manifests = c.manifests(11).await;
    let ids: Vec<&str> = manifests.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(
        ids,
        [
            "01-csr-approver-role-binding",
            "11-core-dns",
            "11-core-dns-svc",
            "05-flannel",
            "10-kube-proxy"
        ]
    );
    let rendered: Vec<Value> = serde_yaml_ng::from_str(&manifests[4].1).unwrap();
    assert_eq!(image(&rendered[0]), new);
    // Only the re-rendered one has a new version (COSI: any spec change).
    let versions = c.manifest_versions(11).await;
    let changed: Vec<&(String, String)> = versions.iter().filter(|(_, v)| v != "1").collect();
    assert_eq!(
        changed,
        [&("10-kube-proxy".to_owned(), "2".to_owned())],
        "{versions:?}"
    );
    assert!(c.manifests(21).await.is_empty(), "a worker renders none");
    let (_, ds) = c.kube(10, "GET", proxy, None);
    assert_eq!(
        image(&ds),
        "registry.k8s.io/kube-proxy:v1.32.1",
        "Talos updated it"
    );

    // Server-side apply of what Talos renders.
    let body = serde_json::to_string(&rendered[0]).unwrap();
    let apply = Some(("application/apply-patch+yaml", body.as_str()));
    let (code, v) = c.kube(10, "PATCH", proxy, apply);
    assert_eq!(code, 422, "{v}");
    assert_eq!(
        v["message"],
        "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value: is required for apply patch"
    );
    let (code, v) = c.kube(
        10,
        "PATCH",
        &format!("{proxy}?fieldManager=imgbuild"),
        apply,
    );
    assert_eq!(code, 409, "{v}");
    assert_eq!(
        v["message"],
        "Apply failed with 1 conflict: conflict with \"talos\": .spec.template.spec.containers[name=\"kube-proxy\"].image",
        "Talos v1.13 applies its manifests (operation Apply, manifest_apply.go)"
    );
    let forced = format!("{proxy}?fieldManager=imgbuild&force=true");
    let (code, v) = c.kube(10, "PATCH", &format!("{forced}&dryRun=All"), apply);
    assert_eq!((code, image(&v)), (200, new), "{v}");
    let (_, ds) = c.kube(10, "GET", proxy, None);
    assert_eq!(
        image(&ds),
        "registry.k8s.io/kube-proxy:v1.32.1",
        "a dry run stored it"
    );
    let (code, v) = c.kube(10, "PATCH", &forced, apply);
    assert_eq!(code, 200, "{v}");
    assert_eq!(image(&v), new);
    assert_eq!(
        (
            &v["metadata"]["generation"],
            &v["status"]["updatedNumberScheduled"]
        ),
        (&json!(2), &json!(0))
    );
    // The pods (what talosctl's `DetectLowestVersion` reads) follow the
    // rollout.
    let proxy_pods = || -> Vec<String> {
        c.items("/api/v1/namespaces/kube-system/pods?labelSelector=k8s-app%3Dkube-proxy")
            .iter()
            .map(|p| image(p).to_owned())
            .collect()
    };
    assert_eq!(proxy_pods(), ["registry.k8s.io/kube-proxy:v1.32.1"; 2]);
    c.wait("the rollout", || {
        let (_, ds) = c.kube(10, "GET", proxy, None);
        ds["status"]["observedGeneration"] == 2 && ds["status"]["updatedNumberScheduled"] == 2
    })
    .await;
    assert_eq!(proxy_pods(), [new; 2]);
    let (code, _) = c.kube(
        10,
        "PATCH",
        proxy,
        Some(("application/merge-patch+json", "{}")),
    );
    assert_eq!(code, 415, "only apply patches are simulated");
    let stats = c.k8s_stats();
    assert_eq!(stats["workloads"]["kube-proxy"], new, "{stats}");
    let codes: Vec<&Value> = stats["applies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| &a["code"])
        .collect();
    assert_eq!(codes, [&json!(409), &json!(200)], "dry runs are not logged");

    // v1.13's ImageService pre-pulls Kubernetes images (talosctl's
    // `--pre-pull-images`); a tag that is no version is not found.
    let pull = |image: &str| ImageServicePullRequest {
        containerd: Some(cri(ContainerdNamespace::NsCri)),
        image_ref: image.into(),
    };
    let mut images = ImageServiceClient::new(c.channel(11).await);
    images
        .pull(pull("registry.k8s.io/kube-apiserver:v1.33.5"))
        .await
        .unwrap();
    let e = images
        .pull(pull("registry.k8s.io/kube-apiserver:latest"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    assert_eq!(
        c.k8s_stats()["pulled"]["cp-01"],
        json!(["registry.k8s.io/kube-apiserver:v1.33.5"])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removed_apis_are_in_the_metric_and_listed_until_the_release_that_removes_them_v1_11_5() {
    let c = Cluster::start(4, &[("cp-01", 11, true, "v1.11.5")]).await;
    let v = c.post(
        "k8s-apis",
        json!({"requested": [{"group": "flowcontrol.apiserver.k8s.io", "version": "v1beta3",
                "resource": "flowschemas", "removed_release": "1.32"}],
            "stored": [{"group": "flowcontrol.apiserver.k8s.io", "version": "v1beta3",
                "resource": "flowschemas", "kind": "FlowSchema", "name": "legacy", "removed_release": "1.32"}]}),
    );
    assert_eq!(v["stored"][0]["name"], "legacy", "{v}");
    let (code, metrics) = c.kube(10, "GET", "/metrics", None);
    assert_eq!(code, 200);
    let metrics = metrics.as_str().unwrap();
    assert!(
        metrics.lines().any(|l| l == "apiserver_requested_deprecated_apis{group=\"flowcontrol.apiserver.k8s.io\",removed_release=\"1.32\",resource=\"flowschemas\",subresource=\"\",version=\"v1beta3\"} 1"),
        "{metrics}"
    );
    // Per API server: requests another one served are not counted here.
    let deprecated = |c: &Cluster, host: u8| {
        let (code, metrics) = c.kube(host, "GET", "/metrics", None);
        assert_eq!(code, 200);
        metrics
            .as_str()
            .unwrap()
            .lines()
            .filter(|l| l.starts_with("apiserver_requested_deprecated_apis{"))
            .count()
    };
    assert_eq!(deprecated(&c, 11), 1);
    c.post(
        "k8s-apis",
        json!({"requested": [{"group": "flowcontrol.apiserver.k8s.io", "version": "v1beta3",
            "resource": "flowschemas", "removed_release": "1.32", "nodes": ["cp-02"]}]}),
    );
    assert_eq!(deprecated(&c, 11), 0, "served by cp-02, counted by cp-01");
    c.post(
        "k8s-apis",
        json!({"requested": [{"group": "flowcontrol.apiserver.k8s.io", "version": "v1beta3",
            "resource": "flowschemas", "removed_release": "1.32"}]}),
    );
    assert_eq!(deprecated(&c, 11), 1);
    // Kubernetes 1.31 still serves flowcontrol v1beta3 …
    let downgrade = c.config("cp-01", true, "v1.31.4", &[]);
    c.apply(11, &downgrade).await.unwrap();
    let list = "/apis/flowcontrol.apiserver.k8s.io/v1beta3/flowschemas";
    c.wait("1.31 serving", || {
        let (code, v) = c.kube(11, "GET", list, None);
        code == 200 && v["items"][0]["metadata"]["name"] == "legacy"
    })
    .await;
    // … and its restart reset the gauge (a process's own counters).
    assert_eq!(deprecated(&c, 11), 0, "counted across a restart");
    // … 1.32 does not.
    let upgrade = c.config("cp-01", true, "v1.32.1", &[]);
    c.apply(11, &upgrade).await.unwrap();
    c.wait("1.32 not serving", || {
        c.kube(10, "GET", list, None).0 == 404
    })
    .await;
}

/// The (start, ready) of each restart of `component` in the timeline.
fn intervals(restarts: &[Value], component: &str) -> Vec<(u64, u64)> {
    restarts
        .iter()
        .filter(|r| r["component"] == component)
        .map(|r| {
            (
                r["start_ms"].as_u64().unwrap(),
                r["ready_ms"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_timeline_shows_a_talosctl_ordered_upgrade_of_three_control_planes_and_two_workers_v1_11_5()
 {
    let nodes = [
        ("cp-01", 11, true, "v1.11.5"),
        ("cp-02", 12, true, "v1.11.5"),
        ("cp-03", 13, true, "v1.11.5"),
        ("worker-01", 21, false, "v1.11.5"),
        ("worker-02", 22, false, "v1.11.5"),
    ];
    let c = Cluster::start(5, &nodes).await;
    // Driven here as talosctl's `upgrade-k8s` drives it: per component,
    // control plane after control plane, each waited for; then kubelets.
    let mut edits: Vec<Vec<(&str, Value)>> = vec![Vec::new(); nodes.len()];
    for (pointer, component) in [
        ("/cluster/apiServer/image", "kube-apiserver"),
        (
            "/cluster/controllerManager/image",
            "kube-controller-manager",
        ),
        ("/cluster/scheduler/image", "kube-scheduler"),
    ] {
        for (k, (name, host, _, _)) in nodes.iter().enumerate().take(3) {
            let new = format!("registry.k8s.io/{component}:v1.33.5");
            edits[k].push((pointer, json!(new)));
            c.apply(*host, &c.config(name, true, "v1.32.1", &edits[k]))
                .await
                .unwrap();
            c.wait(&format!("{component} on {name}"), || {
                mirror_pod(&c, component, name).is_some_and(|p| image(&p) == new && ready(&p))
            })
            .await;
        }
    }
    for (k, (name, host, cp, _)) in nodes.iter().enumerate() {
        edits[k].push((
            "/machine/kubelet/image",
            json!("ghcr.io/siderolabs/kubelet:v1.33.5"),
        ));
        c.apply(*host, &c.config(name, *cp, "v1.32.1", &edits[k]))
            .await
            .unwrap();
        c.wait(&format!("the kubelet on {name}"), || {
            c.items("/api/v1/nodes").iter().any(|n| {
                n["metadata"]["name"] == *name
                    && n["status"]["nodeInfo"]["kubeletVersion"] == "v1.33.5"
                    && n["status"]["conditions"][0]["status"] == "True"
            })
        })
        .await;
    }
    let stats = c.k8s_stats();
    let restarts = stats["restarts"].as_array().unwrap();
    assert_eq!(restarts.len(), 3 * 3 + 5, "{stats}");
    let apiservers = intervals(restarts, "kube-apiserver");
    assert_eq!(apiservers.len(), 3);
    for pair in apiservers.windows(2) {
        assert!(pair[0].1 <= pair[1].0, "two apiservers at once: {pair:?}");
    }
    let control_plane_done = restarts
        .iter()
        .filter(|r| r["component"] != "kubelet")
        .map(|r| r["ready_ms"].as_u64().unwrap())
        .max()
        .unwrap();
    let kubelets = intervals(restarts, "kubelet");
    assert_eq!(kubelets.len(), 5);
    assert!(
        kubelets
            .iter()
            .all(|(start, _)| *start >= control_plane_done),
        "{stats}"
    );
    assert!(
        restarts
            .iter()
            .filter(|r| r["component"] == "kubelet")
            .all(|r| r["control_plane"] == (r["node"].as_str().unwrap().starts_with("cp-"))),
        "{stats}"
    );
    for name in ["cp-01", "cp-02", "cp-03"] {
        for component in [
            "kube-apiserver",
            "kube-controller-manager",
            "kube-scheduler",
        ] {
            let v = &stats["components"][name][component];
            assert_eq!(
                (&v["image"], &v["config_version"]),
                (
                    &json!(format!("registry.k8s.io/{component}:v1.33.5")),
                    &json!(2)
                ),
                "{name} {component}"
            );
        }
    }
}

/// The CRI containerd's `namespace`.
fn cri(namespace: ContainerdNamespace) -> ContainerdInstance {
    ContainerdInstance {
        driver: ContainerDriver::Cri as i32,
        namespace: namespace as i32,
    }
}

/// The images node `name` holds, by place (`cri/k8s.io`, `cri/system`,
/// `system/system`).
fn images_on(c: &Cluster, name: &str) -> Value {
    c.sim.stats()["nodes"][name]["day2"]["images"].clone()
}

/// Talos v1.13.5 `ImageService.Pull` checks its containerd instance as
/// `internal/app/internal/ctrhelper/ctrhelper.go` does; v1.11.5 has no
/// ImageService, and `MachineService.ImagePull` (`v1alpha1_images.go`,
/// v1.5+, still served on v1.13) always pulls into the CRI containerd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_pulls_land_where_talos_puts_them_and_the_cri_namespace_needs_the_cri_driver_v1_13_5_v1_11_5()
 {
    let c = Cluster::start(
        6,
        &[
            ("cp-01", 11, true, "v1.13.5"),
            ("worker-01", 21, false, "v1.11.5"),
        ],
    )
    .await;
    let apiserver = "registry.k8s.io/kube-apiserver:v1.33.5";
    let kubelet = "ghcr.io/siderolabs/kubelet:v1.33.5";
    let mut images = ImageServiceClient::new(c.channel(11).await);
    let pull = |driver: i32, namespace: i32, image: &str| ImageServicePullRequest {
        containerd: Some(ContainerdInstance { driver, namespace }),
        image_ref: image.into(),
    };
    let (containerd, cri_driver) = (
        ContainerDriver::Containerd as i32,
        ContainerDriver::Cri as i32,
    );
    let (ns_cri, ns_system) = (
        ContainerdNamespace::NsCri as i32,
        ContainerdNamespace::NsSystem as i32,
    );
    let refused = [
        (
            pull(containerd, ns_cri, apiserver),
            "cannot use CRI namespace with containerd driver",
        ),
        (
            pull(cri_driver, 0, apiserver),
            "invalid containerd namespace NS_UNKNOWN",
        ),
        (pull(7, ns_cri, apiserver), "invalid containerd driver 7"),
        (
            ImageServicePullRequest {
                containerd: None,
                image_ref: apiserver.into(),
            },
            "invalid containerd namespace NS_UNKNOWN",
        ),
    ];
    for (req, message) in refused {
        let e = images.pull(req).await.unwrap_err();
        assert_eq!(
            (e.code(), e.message()),
            (Code::InvalidArgument, message),
            "{e:?}"
        );
    }
    images
        .pull(pull(cri_driver, ns_cri, apiserver))
        .await
        .unwrap();
    images
        .pull(pull(cri_driver, ns_system, kubelet))
        .await
        .unwrap();
    let held = images_on(&c, "cp-01");
    let has = |place: &str, image: &str| {
        held[place]
            .as_array()
            .is_some_and(|a| a.contains(&json!(image)))
    };
    assert!(has("cri/k8s.io", apiserver), "{held}");
    assert!(has("cri/system", kubelet), "{held}");
    assert!(!has("cri/system", apiserver), "{held}");
    assert_eq!(held["system/system"], Value::Null, "{held}");

    // v1.11.5: no ImageService; MachineService.ImagePull into the CRI one.
    let e = ImageServiceClient::new(c.channel(21).await)
        .pull(pull(cri_driver, ns_system, kubelet))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented, "{e:?}");
    let image_pull = |namespace: i32, image: &str| ImagePullRequest {
        namespace,
        reference: image.into(),
    };
    let mut machine = c.machine(21).await;
    let e = machine
        .image_pull(image_pull(0, kubelet))
        .await
        .unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (Code::InvalidArgument, "invalid namespace NS_UNKNOWN")
    );
    let e = machine
        .image_pull(image_pull(ns_system, "ghcr.io/siderolabs/kubelet:latest"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    // Pre-pulled into `k8s.io`, where the kubelet does not run from.
    machine
        .image_pull(image_pull(ns_cri, kubelet))
        .await
        .unwrap();
    assert_eq!(images_on(&c, "worker-01")["cri/k8s.io"], json!([kubelet]));
    // Also served on v1.13 (deprecated, not removed).
    c.machine(11)
        .await
        .image_pull(image_pull(ns_cri, apiserver))
        .await
        .unwrap();

    // A new kubelet image: the kubelet service pulls it into the CRI
    // containerd's `system` namespace itself unless it is there already.
    for (name, host) in [("cp-01", 11), ("worker-01", 21)] {
        let config = c.config(name, name.starts_with("cp"), "v1.33.5", &[]);
        c.apply(host, &config).await.unwrap();
    }
    c.wait("both kubelets on v1.33.5", || {
        let comps = &c.k8s_stats()["components"];
        ["cp-01", "worker-01"]
            .iter()
            .all(|n| comps[n]["kubelet"]["image"] == kubelet)
    })
    .await;
    let calls = c.k8s_stats()["image_pulls"].clone();
    let self_pulls: Vec<(&str, &str)> = calls
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["api"] == "kubelet service")
        .map(|p| (p["node"].as_str().unwrap(), p["at"].as_str().unwrap()))
        .collect();
    assert_eq!(self_pulls, [("worker-01", "cri/system")], "{calls:#}");
    let first = &calls[0];
    assert_eq!(
        (
            &first["api"],
            &first["driver"],
            &first["namespace"],
            &first["code"],
            &first["at"]
        ),
        (
            &json!("ImageService.Pull"),
            &json!("CONTAINERD"),
            &json!("NS_CRI"),
            &json!("InvalidArgument"),
            &Value::Null
        ),
        "{calls:#}"
    );
    assert!(
        images_on(&c, "worker-01")["cri/system"]
            .as_array()
            .unwrap()
            .contains(&json!(kubelet))
    );
}

/// A node that goes down keeps its last status until kube-controller-
/// manager's node lifecycle controller (`node_lifecycle_controller.go`
/// `tryUpdateNodeHealth`, Kubernetes 1.32) finds no heartbeat for
/// `--node-monitor-grace-period` (40 s by default): then Ready Unknown
/// and the unreachable taints. Not instantly, not never; the Node object
/// stays listed. Talos v1.11.5.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_goes_down_turns_unknown_after_the_node_monitor_grace_period_v1_11_5() {
    let c = Cluster::start(
        7,
        &[
            ("cp-01", 11, true, "v1.11.5"),
            ("worker-01", 21, false, "v1.11.5"),
        ],
    )
    .await;
    let worker = || {
        c.items("/api/v1/nodes")
            .into_iter()
            .find(|n| n["metadata"]["name"] == "worker-01")
    };
    // Ready first (its kubelet starts after the cluster answers): the
    // status it then keeps is Ready.
    c.wait("worker-01 Ready", || {
        worker().is_some_and(|n| n["status"]["conditions"][0]["status"] == "True")
    })
    .await;
    let v = c.post("halt", json!({"ip": c.ip(21)}));
    assert_eq!(v["halted"], true, "{v}");
    // Within the default 40 s: still listed with its last status.
    let node = worker().expect("the Node object stays");
    assert_eq!(node["status"]["conditions"][0]["status"], "True", "{node}");
    assert_eq!(node["spec"].get("taints"), None, "{node}");
    // Past the grace period (shortened): Unknown, tainted unreachable.
    c.post("k8s", json!({"node_monitor_grace_period": 100}));
    c.wait("worker-01 Unknown", || {
        worker().is_some_and(|n| n["status"]["conditions"][0]["status"] == "Unknown")
    })
    .await;
    let node = worker().unwrap();
    assert_eq!(
        node["status"]["conditions"][0],
        json!({"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
            "message": "Kubelet stopped posting node status."})
    );
    assert_eq!(
        node["spec"]["taints"][1],
        json!({"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"})
    );
    // The control plane still posts.
    let cp = c
        .items("/api/v1/nodes")
        .into_iter()
        .find(|n| n["metadata"]["name"] == "cp-01")
        .unwrap();
    assert_eq!(cp["status"]["conditions"][0]["status"], "True");
}

/// Talos (`control_plane.go`, v1.11.5): a component's config resource gets
/// a new version on any change of what it is built from, not only its
/// image; the static pod's `talos.dev/config-version` follows and the pod
/// restarts. A change elsewhere in the config moves no version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_change_of_a_components_config_moves_its_config_version_v1_11_5() {
    let c = Cluster::start(8, &[("cp-01", 11, true, "v1.11.5")]).await;
    let version = |component: &str| {
        mirror_pod(&c, component, "cp-01").map(|p| {
            p["metadata"]["annotations"]["talos.dev/config-version"]
                .as_str()
                .unwrap()
                .to_owned()
        })
    };
    assert_eq!(version("kube-apiserver").as_deref(), Some("1"));
    let apiserver = json!({"image": "registry.k8s.io/kube-apiserver:v1.32.1",
        "extraArgs": {"audit-log-maxage": "7"}});
    let config = c.config(
        "cp-01",
        true,
        "v1.32.1",
        &[("/cluster/apiServer", apiserver.clone())],
    );
    c.apply(11, &config).await.unwrap();
    c.wait("kube-apiserver's config version 2", || {
        version("kube-apiserver").as_deref() == Some("2")
    })
    .await;
    let pod = mirror_pod(&c, "kube-apiserver", "cp-01").unwrap();
    assert_eq!(image(&pod), "registry.k8s.io/kube-apiserver:v1.32.1");
    let (v, _) = c
        .resource(
            11,
            "controlplane",
            "APIServerConfigs.kubernetes.talos.dev",
            "kube-apiserver",
        )
        .await;
    assert_eq!(v, "2");
    // Not a component's config: nothing moves. Then the scheduler's.
    let mut edits = vec![
        ("/cluster/apiServer", apiserver.clone()),
        (
            "/machine/install",
            json!({"disk": "/dev/sdb", "image": "factory.talos.dev/metal-installer/5c:v1.11.5"}),
        ),
    ];
    let config = c.config("cp-01", true, "v1.32.1", &edits);
    c.apply(11, &config).await.unwrap();
    edits.push((
        "/cluster/scheduler",
        json!({"image": "registry.k8s.io/kube-scheduler:v1.32.1", "extraArgs": {"v": "2"}}),
    ));
    let config = c.config("cp-01", true, "v1.32.1", &edits);
    c.apply(11, &config).await.unwrap();
    c.wait("kube-scheduler's config version 2", || {
        version("kube-scheduler").as_deref() == Some("2")
    })
    .await;
    assert_eq!(version("kube-apiserver").as_deref(), Some("2"));
    assert_eq!(version("kube-controller-manager").as_deref(), Some("1"));
    let restarts = c.k8s_stats()["restarts"].clone();
    let components: Vec<&str> = restarts
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["component"].as_str().unwrap())
        .collect();
    assert_eq!(
        components,
        ["kube-apiserver", "kube-scheduler"],
        "{restarts:#}"
    );
}

/// The kube-proxy DaemonSet's path.
const PROXY: &str = "/apis/apps/v1/namespaces/kube-system/daemonsets/kube-proxy";

/// talosctl's manifest sync before Talos v1.13 (go-kubernetes v0.2.28
/// `manifests/sync.go`): GET, a PUT `dryRun=All` with the live
/// resourceVersion, a POST for what is missing, a PUT for what changed; the
/// API server's answers (kubernetes `handlers/{update,create,delete,get}.go`,
/// the resources' `strategy.go`): a stale resourceVersion is a 409, a PUT
/// creates only services and RBAC objects, a CRD needs a resourceVersion,
/// a POST of what exists is AlreadyExists, DELETE takes a propagation
/// policy, lists take equality, existence and set selectors. Talos v1.12
/// recreates a bootstrap object someone deleted (`manifest_apply.go`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn put_post_delete_and_selectors_answer_as_the_api_server_does_v1_12_9() {
    let c = Cluster::start(9, &[("cp-01", 11, true, "v1.12.9")]).await;
    c.wait("the kube-proxy DaemonSet", || {
        c.kube(10, "GET", PROXY, None).0 == 200
    })
    .await;
    let json_body = |v: &Value| v.to_string();
    let (_, live) = c.kube(10, "GET", PROXY, None);
    let rv = live["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(live["metadata"]["managedFields"][0]["operation"], "Update");
    assert_eq!(
        live["metadata"]["annotations"].get("config.k8s.io/owning-inventory"),
        None,
        "v1.12 has no inventory"
    );
    let new = "registry.k8s.io/kube-proxy:v1.33.5";
    let mut changed = live.clone();
    changed["spec"]["template"]["spec"]["containers"][0]["image"] = json!(new);
    let body = json_body(&changed);
    let put = Some(("application/json", body.as_str()));

    // The diff: a dry run stores nothing.
    let (code, v) = c.kube(10, "PUT", &format!("{PROXY}?dryRun=All"), put);
    assert_eq!((code, image(&v)), (200, new), "{v}");
    assert_eq!(image(&c.kube(10, "GET", PROXY, None).1), image(&live));
    // The update with the live version.
    let (code, v) = c.kube(10, "PUT", &format!("{PROXY}?fieldManager=imgbuild"), put);
    assert_eq!((code, image(&v)), (200, new), "{v}");
    assert_eq!(v["metadata"]["generation"], 2);
    assert_ne!(v["metadata"]["resourceVersion"], json!(rv));
    assert_eq!(
        v["metadata"]["uid"], live["metadata"]["uid"],
        "an update keeps the uid"
    );
    // The same body again carries a stale version.
    let (code, v) = c.kube(10, "PUT", PROXY, put);
    assert_eq!(code, 409, "{v}");
    assert_eq!(
        v["message"],
        "Operation cannot be fulfilled on daemonsets.apps \"kube-proxy\": the object has been modified; please apply your changes to the latest version and try again"
    );
    assert_eq!(v["reason"], "Conflict");
    // Without a version a DaemonSet updates unconditionally.
    let mut unversioned = changed.clone();
    unversioned["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("resourceVersion");
    let body = json_body(&unversioned);
    let (code, v) = c.kube(10, "PUT", PROXY, Some(("application/json", &body)));
    assert_eq!(code, 200, "{v}");

    // Discovery, as a REST mapper reads it.
    let (code, v) = c.kube(10, "GET", "/apis/apps/v1", None);
    assert_eq!(code, 200, "{v}");
    let ds = v["resources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["kind"] == "DaemonSet")
        .cloned()
        .unwrap();
    assert_eq!(
        (&ds["name"], &ds["namespaced"]),
        (&json!("daemonsets"), &json!(true))
    );
    let (_, v) = c.kube(10, "GET", "/apis", None);
    assert!(
        v["groups"]
            .as_array()
            .unwrap()
            .iter()
            .any(|g| g["preferredVersion"]["groupVersion"] == "rbac.authorization.k8s.io/v1"),
        "{v}"
    );
    assert_eq!(c.kube(10, "GET", "/api", None).1["versions"], json!(["v1"]));
    assert_eq!(c.kube(10, "GET", "/apis/widgets.sim.dev/v1", None).0, 404);

    // Create: 201, then AlreadyExists; a namespace must exist.
    let cms = "/api/v1/namespaces/kube-system/configmaps";
    let cm = json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "extra", "labels": {"tier": "node"}}, "data": {"a": "1"}});
    let body = json_body(&cm);
    let (code, v) = c.kube(10, "POST", cms, Some(("application/json", &body)));
    assert_eq!(code, 201, "{v}");
    assert_eq!(v["metadata"]["namespace"], "kube-system");
    assert_eq!(
        v["metadata"].get("generation"),
        None,
        "a ConfigMap has none"
    );
    let (code, v) = c.kube(10, "POST", cms, Some(("application/json", &body)));
    assert_eq!((code, &v["reason"]), (409, &json!("AlreadyExists")), "{v}");
    assert_eq!(v["message"], "configmaps \"extra\" already exists");
    let (code, v) = c.kube(
        10,
        "POST",
        "/api/v1/namespaces/nope/configmaps",
        Some(("application/json", &body)),
    );
    assert_eq!(code, 404, "{v}");
    assert_eq!(v["message"], "namespaces \"nope\" not found");

    let agent = json!({"apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": "sim-agent", "namespace": "kube-system"},
        "spec": {"template": {"spec": {"containers": [{"name": "a", "image": "a:1"}]}}}});
    let (code, v) = c.kube(
        10,
        "POST",
        "/apis/apps/v1/namespaces/kube-system/daemonsets",
        Some(("application/json", &json_body(&agent))),
    );
    assert_eq!(code, 201, "{v}");
    let (_, list) = c.kube(
        10,
        "GET",
        "/apis/apps/v1/namespaces/kube-system/daemonsets",
        None,
    );
    assert!(list["metadata"]["resourceVersion"].is_string(), "{list}");
    let listed: Vec<&Value> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| &d["metadata"]["name"])
        .collect();
    assert!(
        listed.contains(&&json!("sim-agent")),
        "every stored one: {list}"
    );

    // PUT of what is missing: a ConfigMap is not created, a ClusterRole is.
    let (code, v) = c.kube(
        10,
        "PUT",
        &format!("{cms}/other"),
        Some((
            "application/json",
            &json_body(
                &json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "other"}}),
            ),
        )),
    );
    assert_eq!(code, 404, "{v}");
    assert_eq!(v["message"], "configmaps \"other\" not found");
    let role = json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": "sim:reader"}, "rules": []});
    let (code, v) = c.kube(
        10,
        "PUT",
        "/apis/rbac.authorization.k8s.io/v1/clusterroles/sim:reader",
        Some(("application/json", &json_body(&role))),
    );
    assert_eq!(code, 201, "{v}");

    // A CRD's update needs its resourceVersion.
    let crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions";
    let crd = json!({"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.sim.dev"}, "spec": {"group": "sim.dev"}});
    let (code, v) = c.kube(
        10,
        "POST",
        crds,
        Some(("application/json", &json_body(&crd))),
    );
    assert_eq!(code, 201, "{v}");
    let (code, v) = c.kube(
        10,
        "PUT",
        &format!("{crds}/widgets.sim.dev"),
        Some(("application/json", &json_body(&crd))),
    );
    assert_eq!(code, 422, "{v}");
    assert_eq!(
        v["message"],
        "customresourcedefinitions.apiextensions.k8s.io \"widgets.sim.dev\" is invalid: metadata.resourceVersion: Invalid value: 0x0: must be specified for an update"
    );

    // Lists: equality, existence, set; the list's resourceVersion moves.
    let names = |selector: &str| -> Vec<String> {
        c.items(&format!("{cms}?labelSelector={selector}"))
            .iter()
            .map(|o| o["metadata"]["name"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(names("tier"), ["extra"]);
    assert_eq!(names("tier%3D%3Dnode"), ["extra"]);
    assert_eq!(names("tier%20in%20(a,node)"), ["extra"]);
    assert!(!names("!tier").contains(&"extra".to_owned()));
    assert!(!names("tier!%3Dnode").contains(&"extra".to_owned()));
    assert!(
        names("tier!%3Dother").contains(&"extra".to_owned()),
        "!= selects other values"
    );
    let (code, v) = c.kube(10, "GET", &format!("{cms}?labelSelector=a%20b"), None);
    assert_eq!(code, 400, "{v}");
    let list_rv =
        |c: &Cluster| c.kube(10, "GET", cms, None).1["metadata"]["resourceVersion"].clone();
    let before = list_rv(&c);
    assert_eq!(c.kube(10, "GET", cms, None).1["kind"], "ConfigMapList");

    // Delete: a policy it knows, 404 the second time; kube-system stays.
    let (code, v) = c.kube(
        10,
        "DELETE",
        &format!("{cms}/extra?propagationPolicy=Sideways"),
        None,
    );
    assert_eq!(code, 422, "{v}");
    let (code, v) = c.kube(
        10,
        "DELETE",
        &format!("{cms}/extra"),
        Some(("application/json", r#"{"kind":"DeleteOptions","apiVersion":"v1","propagationPolicy":"Background","preconditions":{"resourceVersion":"1"}}"#)),
    );
    assert_eq!(code, 409, "a failed precondition: {v}");
    let (code, v) = c.kube(
        10,
        "DELETE",
        &format!("{cms}/extra?propagationPolicy=Background"),
        None,
    );
    assert_eq!(
        (code, &v["metadata"]["name"]),
        (200, &json!("extra")),
        "{v}"
    );
    assert_ne!(list_rv(&c), before);
    let (code, v) = c.kube(10, "DELETE", &format!("{cms}/extra"), None);
    assert_eq!(code, 404, "{v}");
    let (code, v) = c.kube(10, "DELETE", "/api/v1/namespaces/kube-system", None);
    assert_eq!(code, 403, "{v}");
    assert_eq!(
        v["message"],
        "namespaces \"kube-system\" is forbidden: this namespace may not be deleted"
    );

    // Talos v1.12 recreates a bootstrap object that is gone.
    let dns = "/apis/apps/v1/namespaces/kube-system/deployments/coredns";
    let (code, _) = c.kube(
        10,
        "DELETE",
        &format!("{dns}?propagationPolicy=Foreground"),
        None,
    );
    assert_eq!(code, 200);
    let (code, v) = c.kube(10, "GET", dns, None);
    assert_eq!(code, 200, "recreated by manifest_apply: {v}");

    let writes: Vec<(String, u64)> = c.k8s_stats()["writes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            (
                w["verb"].as_str().unwrap().to_owned(),
                w["code"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        writes.iter().filter(|(verb, _)| verb == "PUT").count(),
        4,
        "dry runs are not logged: {writes:?}"
    );
}

/// Talos v1.13 (`manifest_apply.go`): the bootstrap objects are created by
/// a server-side apply as `talos`, annotated `config.k8s.io/owning-
/// inventory`, and listed in the inventory ConfigMap
/// `kube-system/talos-bootstrap-manifests-inventory` (cli-utils
/// `ObjMetadata.String` keys); an object the inventory lists is never
/// recreated. talosctl's sync (go-kubernetes `ssa`) then applies as
/// `talos`, rewrites the inventory by an unconditional PUT, and prunes by
/// DELETE with `propagationPolicy=Background`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn talos_1_13_creates_the_bootstrap_manifests_through_an_inventory_v1_13_5() {
    let c = Cluster::start(10, &[("cp-01", 11, true, "v1.13.5")]).await;
    let inventory = "/api/v1/namespaces/kube-system/configmaps/talos-bootstrap-manifests-inventory";
    c.wait("the inventory", || {
        c.kube(10, "GET", inventory, None).0 == 200
    })
    .await;
    let (_, ds) = c.kube(10, "GET", PROXY, None);
    assert_eq!(
        ds["metadata"]["annotations"]["config.k8s.io/owning-inventory"],
        "talos-bootstrap-manifests-inventory"
    );
    assert_eq!(
        (
            &ds["metadata"]["managedFields"][0]["manager"],
            &ds["metadata"]["managedFields"][0]["operation"]
        ),
        (&json!("talos"), &json!("Apply"))
    );
    let (_, inv) = c.kube(10, "GET", inventory, None);
    let data = inv["data"].as_object().unwrap();
    for entry in [
        "kube-system_kube-proxy_apps_DaemonSet",
        "kube-system_coredns_apps_Deployment",
        "kube-system_kube-dns__Service",
    ] {
        assert!(data.contains_key(entry), "{entry}: {inv}");
    }
    assert!(
        data.keys().all(|k| !k.contains(':')),
        "RBAC colons are transcoded: {inv}"
    );
    assert_eq!(
        c.kube(10, "GET", "/api/v1/namespaces/kube-system", None).0,
        200
    );

    // talosctl's apply as `talos` takes over without a conflict.
    let applied = json!({"apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": "kube-proxy", "namespace": "kube-system",
            "annotations": {"config.k8s.io/owning-inventory": "talos-bootstrap-manifests-inventory"}},
        "spec": {"template": {"spec": {"containers": [{"name": "kube-proxy", "image": "registry.k8s.io/kube-proxy:v1.33.5"}]}}}});
    let body = applied.to_string();
    let (code, v) = c.kube(
        10,
        "PATCH",
        &format!("{PROXY}?fieldManager=talos&force=true"),
        Some(("application/apply-patch+yaml", &body)),
    );
    assert_eq!(code, 200, "{v}");

    // A DELETE with talosctl's prune policy; Talos does not recreate an
    // object its inventory lists.
    let dns = "/apis/apps/v1/namespaces/kube-system/deployments/coredns";
    let (code, v) = c.kube(
        10,
        "DELETE",
        &format!("{dns}?propagationPolicy=Background"),
        None,
    );
    assert_eq!(code, 200, "{v}");
    let (code, _) = c.kube(10, "GET", dns, None);
    assert_eq!(code, 404, "listed in the inventory: Talos skips it");
    assert!(
        c.items(
            "/apis/apps/v1/namespaces/kube-system/deployments?labelSelector=k8s-app%3Dkube-dns"
        )
        .is_empty(),
        "the list shows what is stored"
    );

    // The inventory is rewritten whole, without a resourceVersion; what it
    // no longer lists and the manifests hold, Talos creates again and
    // lists again.
    let mut rewritten = json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "talos-bootstrap-manifests-inventory", "namespace": "kube-system"},
        "data": inv["data"].clone()});
    rewritten["data"]
        .as_object_mut()
        .unwrap()
        .remove("kube-system_coredns_apps_Deployment");
    let body = rewritten.to_string();
    let (code, v) = c.kube(10, "PUT", inventory, Some(("application/json", &body)));
    assert_eq!(code, 200, "{v}");
    let (code, _) = c.kube(10, "GET", dns, None);
    assert_eq!(code, 200, "not in the inventory: manifest_apply creates it");
    let (_, inv) = c.kube(10, "GET", inventory, None);
    assert_eq!(
        inv["data"]["kube-system_coredns_apps_Deployment"], "",
        "{inv}"
    );
}

/// kubernetes `pkg/kubelet/nodestatus/setters.go` `MachineInfo`: a Node's
/// `status.nodeInfo.machineID` is the machine's `/etc/machine-id`, which
/// Talos writes from its node identity (siderolabs/talos
/// `controllers/cluster/node_identity.go`); `bootID` the running boot's.
/// A new machine under the old hostname re-registers the same Node with its
/// own IDs; until then the Node keeps what the old kubelet posted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_report_the_machine_id_of_the_machine_their_kubelet_runs_on() {
    let c = Cluster::start(
        11,
        &[("cp-1", 11, true, "v1.12.9"), ("w-1", 21, false, "v1.12.9")],
    )
    .await;
    let info = |name: &str| -> Value {
        c.items("/api/v1/nodes")
            .into_iter()
            .find(|n| n["metadata"]["name"] == name)
            .map_or(Value::Null, |n| n["status"]["nodeInfo"].clone())
    };
    let stats = c.sim.stats();
    for name in ["cp-1", "w-1"] {
        let node = &stats["nodes"][name];
        let machine_id = node["machine_id"].as_str().unwrap();
        assert_eq!(machine_id.len(), 32, "{node}");
        assert!(machine_id.chars().all(|ch| ch.is_ascii_hexdigit()));
        let i = info(name);
        assert_eq!(i["machineID"], machine_id, "{name}: {i}");
        assert_eq!(i["bootID"], node["day2"]["boot_id"], "{name}: {i}");
    }
    let old = stats["nodes"]["w-1"]["machine_id"].clone();
    assert_ne!(old, stats["nodes"]["cp-1"]["machine_id"]);

    // The worker's VM deleted: its Node stays with what it posted.
    let v = c.post("halt", json!({"ip": c.ip(21)}));
    assert_eq!(v["halted"], true, "{v}");
    assert_eq!(info("w-1")["machineID"], old);

    // Another machine with the same hostname at the same address.
    let config = c.config("w-1", false, "v1.32.1", &[]);
    let v = c.post(
        "boot",
        json!({"name": "vm-2", "ip": c.ip(21), "hostname": "w-1",
            "config": config, "talos_version": "v1.12.9"}),
    );
    assert_eq!(v["booted"], true, "{v}");
    let new = c.sim.stats()["nodes"]["w-1"]["machine_id"].clone();
    assert_ne!(new, old);
    c.wait("the new kubelet posted", || info("w-1")["machineID"] == new)
        .await;
}

/// A machine replaced by another with another hostname at the same
/// address: the old Node stays (NotReady once the grace period passes) with
/// the old machine's IDs beside the new one's, until deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_machines_node_stays_beside_the_new_one_until_deleted() {
    let c = Cluster::start(
        12,
        &[("cp-1", 11, true, "v1.13.5"), ("w-1", 21, false, "v1.13.5")],
    )
    .await;
    let info = |name: &str| -> Value {
        c.items("/api/v1/nodes")
            .into_iter()
            .find(|n| n["metadata"]["name"] == name)
            .map_or(Value::Null, |n| n["status"]["nodeInfo"].clone())
    };
    let old = c.sim.stats()["nodes"]["w-1"]["machine_id"].clone();
    assert_eq!(info("w-1")["machineID"], old);
    let v = c.post("halt", json!({"ip": c.ip(21)}));
    assert_eq!(v["halted"], true, "{v}");
    let config = c.config("w-2", false, "v1.32.1", &[]);
    let v = c.post(
        "boot",
        json!({"name": "vm-2", "ip": c.ip(21), "hostname": "w-2",
            "config": config, "talos_version": "v1.13.5"}),
    );
    assert_eq!(v["booted"], true, "{v}");
    let new = c.sim.stats()["nodes"]["w-2"]["machine_id"].clone();
    assert_ne!(new, old);
    c.wait("w-2 registered", || info("w-2")["machineID"] == new)
        .await;
    assert_eq!(info("w-1")["machineID"], old, "the old Node stays");
    let (code, v) = c.kube(10, "DELETE", "/api/v1/nodes/w-1", None);
    assert_eq!(code, 200, "{v}");
    assert_eq!(info("w-1"), Value::Null, "deleted");
    assert_eq!(info("w-2")["machineID"], new);
}
