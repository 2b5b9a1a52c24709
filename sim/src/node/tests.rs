use super::config::*;
use super::control::*;
use super::service::Api;
use super::state::*;
use api::machine::machine_service_server::MachineService;
use api::machine::*;
use axum::extract::State;
use clap::Parser;
use imgbuild::talos::api;
use serde_json::{Value, json};
use std::time::Instant;
use tonic::{Request, Status};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: Args,
}

/// A control plane and a worker, both configured; the API of the first.
fn configured() -> Api {
    let cli = Cli::parse_from([
        "sim",
        "--node",
        "cp-01=127.0.0.11:controlplane",
        "--node",
        "worker-01=127.0.0.21:worker",
    ]);
    let cluster = new_cluster(cli.args).unwrap();
    for n in cluster.all() {
        n.st.lock().unwrap().configured_at = Some(Instant::now());
    }
    Api {
        cluster,
        me: 0,
        secure: true,
    }
}

fn routed(key: &'static str, value: &str) -> Request<()> {
    let mut req = Request::new(());
    req.metadata_mut().insert(key, value.parse().unwrap());
    req
}

fn services(api: &Api, req: Request<()>) -> Result<Vec<ServiceList>, Status> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(api.service_list(req))
        .map(|r| r.into_inner().messages)
}

fn has_etcd(list: &ServiceList) -> bool {
    list.services.iter().any(|s| s.id == "etcd")
}

#[test]
fn direct_and_one_to_one_replies_carry_no_metadata() {
    let api = configured();
    let local = services(&api, Request::new(())).unwrap();
    assert!(local[0].metadata.is_none() && has_etcd(&local[0]));
    let one = services(&api, routed("node", "127.0.0.21")).unwrap();
    assert_eq!(one.len(), 1);
    assert!(one[0].metadata.is_none(), "{:?}", one[0].metadata);
    assert!(!has_etcd(&one[0]), "answered by the worker");
    // A target that cannot be reached is a gRPC error one-to-one.
    let err = services(&api, routed("node", "127.0.0.99")).unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable);
}

#[test]
fn one_to_many_stamps_the_target_as_sent_and_reports_failures_inside() {
    let api = configured();
    let many = services(&api, routed("nodes", "127.0.0.21")).unwrap();
    assert_eq!(many.len(), 1);
    let md = many[0].metadata.as_ref().unwrap();
    assert_eq!(md.hostname, "127.0.0.21", "the target, not worker-01");
    assert!(md.error.is_empty() && !has_etcd(&many[0]));
    // A failed target: a reply, not a gRPC error.
    let failed = services(&api, routed("nodes", "127.0.0.99")).unwrap();
    let md = failed[0].metadata.as_ref().unwrap();
    assert_eq!(md.hostname, "127.0.0.99");
    assert!(
        md.error.starts_with("rpc error: code = Unavailable"),
        "{}",
        md.error
    );
    assert_eq!(
        md.status.as_ref().unwrap().code,
        tonic::Code::Unavailable as i32
    );
    assert!(failed[0].services.is_empty());
}

#[test]
fn booting_is_idempotent_per_address_and_a_restart_keeps_the_config() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let cli = Cli::parse_from(["sim", "--talos-port", "0", "--k8s-port", "0"]);
        let cluster = new_cluster(cli.args).unwrap();
        let body = |name: &str, ip: &str, config: Option<&str>| {
            axum::Json(BootRequest {
                name: name.into(),
                ip: ip.parse().unwrap(),
                hostname: Some("cp-01".into()),
                config: config.map(str::to_owned),
                talos_version: None,
                secure_boot: None,
                machine: None,
            })
        };
        let st = State(cluster.clone());
        let (code, v) = boot(st.clone(), body("vm-300", "127.77.0.11", None)).await;
        assert_eq!((code.as_u16(), &v["booted"]), (200, &json!(true)), "{v:?}");
        let (_, v) = boot(st.clone(), body("vm-301", "127.77.0.11", None)).await;
        assert_eq!(v["booted"], false, "the address is up already");
        assert_eq!(cluster.count(), 1);
        let node = cluster.node(0);
        assert_eq!(node.display_name(), "cp-01");
        node.st.lock().unwrap().configured_at = Some(Instant::now());

        let halt_body = || {
            axum::Json(HaltRequest {
                ip: "127.77.0.11".parse().unwrap(),
            })
        };
        let (_, v) = halt(st.clone(), halt_body()).await;
        assert_eq!(v["halted"], true);
        assert_eq!(cluster.node(0).phase(Instant::now()), Phase::Down);
        let (_, v) = halt(st.clone(), halt_body()).await;
        assert_eq!(v["halted"], false);
        // The same VM again: its disk kept the config.
        let (_, v) = boot(st.clone(), body("vm-300", "127.77.0.11", None)).await;
        assert_eq!(v["booted"], true);
        assert_eq!(cluster.node(0).phase(Instant::now()), Phase::Configured);
        // Another machine on that address after a halt: a fresh node.
        let (code, _) = halt(st.clone(), halt_body()).await;
        assert_eq!(code.as_u16(), 200);
        let (_, v) = boot(st.clone(), body("vm-302", "127.77.0.11", None)).await;
        assert_eq!(v["booted"], true);
        assert_eq!(cluster.node(0).phase(Instant::now()), Phase::Maintenance);
        assert_eq!(cluster.count(), 1);

        let (_, v) = boot(st.clone(), body("srv", "127.77.0.12", Some("machine: [1]"))).await;
        let why = v["config_error"].as_str().unwrap();
        assert!(why.starts_with("config validation failed"), "{why}");
        let (code, _) = boot(st, body("x", "10.0.0.1", None)).await;
        assert_eq!(code.as_u16(), 400);
    });
}

#[test]
fn disks_are_full_device_paths() {
    let api = configured();
    assert_eq!(api.disks_on().disks[0].device_name, "/dev/sda");
}

#[test]
fn multi_document_configs_are_read_as_talos_reads_them() {
    let v1 = "version: v1alpha1\nmachine:\n  type: worker\n";
    let ts = "apiVersion: v1alpha1\nkind: ExtensionServiceConfig\nname: tailscale\nenvironment: [TS_AUTHKEY=x]\n";
    let read = |text: String| read_documents(text.as_bytes()).map_err(|s| s.message().to_owned());
    let (doc, others) = read(format!("---\n{v1}---\n{ts}---\n")).unwrap();
    assert_eq!(doc["machine"]["type"], "worker");
    assert_eq!(others, ["ExtensionServiceConfig/tailscale"]);
    for (text, want) in [
        (
            format!("{v1}---\n{ts}---\n{ts}"),
            "duplicate document v1alpha1/ExtensionServiceConfig/tailscale",
        ),
        (format!("{v1}---\n{v1}"), "duplicate document v1alpha1//"),
        (
            format!("{v1}---\nkind: ExtensionServiceConfig\nname: a\n"),
            "missing apiVersion",
        ),
        (
            format!("{v1}---\napiVersion: v1alpha1\nname: a\n"),
            "unknown keys found during decoding: : apiVersion, name",
        ),
        (
            format!("{v1}---\napiVersion: v1alpha2\nname: a\n"),
            "missing kind",
        ),
        (
            format!("{v1}---\napiVersion: v1alpha1\nkind: HostnameConfig\n"),
            "\"HostnameConfig\" \"v1alpha1\": not registered",
        ),
        (
            format!("{v1}---\n{ts}environ: []\n"),
            "unknown keys found during decoding: : environ",
        ),
        (ts.to_owned(), "no v1alpha1 document"),
        (format!("{v1}---\n- 1\n"), "expected a YAML document"),
    ] {
        let err = read(text).unwrap_err();
        assert!(err.contains(want), "{want}: {err}");
    }
}

fn schema_problems(doc: &Value) -> Vec<String> {
    problems_of(&registry()[&("v1alpha1".to_owned(), String::new())], doc)
}

#[test]
fn configs_are_held_against_the_vendored_schema() {
    assert!(
        schema_problems(&json!({"version": "v1alpha1", "machine": {"type": "worker"}})).is_empty()
    );
    let problems = schema_problems(&json!({"version": "v1alpha1", "machine": {"typo": "s3cret"}}));
    assert_eq!(
        problems,
        ["unknown keys found during decoding: /machine: typo"]
    );
    let problems =
        schema_problems(&json!({"version": "v1alpha1", "machine": {"certSANs": "s3cret"}}));
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(problems[0].starts_with("/machine/certSANs:") && !problems[0].contains("s3cret"));
}

/// The COSI Get of `Identities.cluster.talos.dev` `cluster/local` (and
/// `HostnameStatuses.net.talos.dev` `network/hostname`) on node `req`'s
/// target: its spec YAML.
fn cosi_get(api: &Api, req: Request<()>, ns: &str, kind: &str, id: &str) -> Result<String, Status> {
    use api::cosi::resource::GetRequest;
    use api::cosi::resource::state_server::State as _;
    let mut get = Request::new(GetRequest {
        namespace: ns.into(),
        r#type: kind.into(),
        id: id.into(),
        options: None,
    });
    *get.metadata_mut() = req.metadata().clone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(api.get(get))
        .map(|r| r.into_inner().resource.unwrap().spec.unwrap().yaml_spec)
}

fn node_id(api: &Api, req: Request<()>) -> Result<String, Status> {
    cosi_get(api, req, "cluster", "Identities.cluster.talos.dev", "local")
        .map(|y| y.strip_prefix("nodeId: ").unwrap().trim_end().to_owned())
}

#[test]
fn every_machine_serves_its_own_node_identity_through_cosi() {
    let api = configured();
    let cp = node_id(&api, Request::new(())).unwrap();
    let worker = node_id(&api, routed("node", "127.0.0.21")).unwrap();
    assert_ne!(cp, worker);
    assert!(super::identity::machine_id(&cp).is_some(), "{cp}");
    // The same again: read, not made, by a Get.
    assert_eq!(node_id(&api, Request::new(())).unwrap(), cp);
    let host = cosi_get(
        &api,
        routed("node", "127.0.0.21"),
        "network",
        "HostnameStatuses.net.talos.dev",
        "hostname",
    )
    .unwrap();
    assert_eq!(host, "hostname: worker-01\ndomainname: \"\"\n");
    // Another id in the namespace: NotFound, as COSI's Get answers.
    let missing = cosi_get(
        &api,
        Request::new(()),
        "cluster",
        "Identities.cluster.talos.dev",
        "x",
    );
    assert_eq!(missing.unwrap_err().code(), tonic::Code::NotFound);
    // Maintenance mode: no identity before STATE exists (NotFound); the
    // other types are not served.
    let maintenance = Api {
        secure: false,
        ..api.clone()
    };
    let err = node_id(&maintenance, Request::new(())).unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");
    let err = cosi_get(
        &maintenance,
        Request::new(()),
        "network",
        "HostnameStatuses.net.talos.dev",
        "hostname",
    )
    .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unimplemented);
}
