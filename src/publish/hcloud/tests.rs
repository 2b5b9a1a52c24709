use super::cleanup::created_at;
use super::*;
use std::time::SystemTime;

fn image() -> SnapshotImage {
    SnapshotImage {
        path: PathBuf::from("out/cp-01.raw"),
        sha256: "ab".repeat(32).parse().unwrap(),
        size: 1 << 20,
        schematic_id: "376567988ad370138ad8b2698212367b8edcb69b5fd68c80be1f2ec7d603b4ba".into(),
        talos_version: "v1.11.2".into(),
        arch: Arch::Amd64,
        nodes: vec!["cp-01".into()],
    }
}

#[test]
fn snapshot_labels_fit_hetzner_and_identify_the_content() {
    let labels = snapshot_labels(&image());
    assert_eq!(labels["os"], "talos");
    assert_eq!(labels["talos-version"], "v1.11.2");
    assert_eq!(
        labels["talos-schematic"],
        "376567988ad370138ad8b2698212367b"
    );
    assert_eq!(labels["image-sha256"], "ab".repeat(16));
    assert_eq!(labels["arch"], "amd64");
    for (k, v) in &labels {
        assert_eq!(crate::inventory::label_problem(k, v), None, "{k}={v}");
        assert!(
            crate::inventory::RESERVED_LABELS.contains(&k.as_str()),
            "{k}"
        );
    }
    assert_eq!(
        selector(&labels),
        format!(
            "arch=amd64,image-sha256={},os=talos,talos-schematic=376567988ad370138ad8b2698212367b,talos-version=v1.11.2",
            "ab".repeat(16)
        )
    );
}

#[test]
fn server_types_are_judged_per_location_and_architecture() {
    let types: Vec<Value> = serde_json::from_value(json!([
        {"name": "cx23", "architecture": "x86", "deprecation": null,
         "locations": [{"name": "fsn1", "available": true, "deprecation": null},
                       {"name": "hel1", "available": false, "deprecation": null}]},
        {"name": "cx22", "architecture": "x86", "deprecation": {"announced": "2025-10-01T00:00:00Z", "unavailable_after": "2026-01-01T00:00:00Z"},
         "locations": [{"name": "fsn1", "available": true, "deprecation": null}]},
        {"name": "cax11", "architecture": "arm", "deprecation": null,
         "locations": [{"name": "fsn1", "available": true, "deprecation": null}]},
        {"name": "cpx22", "architecture": "x86", "deprecation": null,
         "locations": [{"name": "nbg1", "available": true, "deprecation": null},
                       {"name": "fsn1", "available": true, "deprecation": {"announced": "x", "unavailable_after": "y"}}]}
    ]))
    .unwrap();
    let judge = |n, l, a| unsuitable(&types, n, l, a);
    assert_eq!(judge("cx23", "fsn1", Arch::Amd64), None);
    assert_eq!(
        judge("cx23", "hel1", Arch::Amd64).unwrap(),
        "unavailable in hel1"
    );
    assert_eq!(
        judge("cx23", "ash", Arch::Amd64).unwrap(),
        "not offered in ash"
    );
    assert_eq!(judge("cx22", "fsn1", Arch::Amd64).unwrap(), "deprecated");
    assert!(
        judge("cax11", "fsn1", Arch::Amd64)
            .unwrap()
            .contains("architecture is arm")
    );
    assert_eq!(judge("cax11", "fsn1", Arch::Arm64), None);
    assert_eq!(
        judge("cpx22", "fsn1", Arch::Amd64).unwrap(),
        "deprecated in fsn1"
    );
    assert_eq!(judge("cpx22", "nbg1", Arch::Amd64), None);
    assert_eq!(
        judge("nope", "fsn1", Arch::Amd64).unwrap(),
        "no such server type"
    );
}

#[test]
fn credentials_come_from_the_environment_and_stay_hidden() {
    let env = |pairs: &'static [(&'static str, &'static str)]| {
        move |k: &str| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    };
    let err = Credentials::from_env(&env(&[])).unwrap_err().to_string();
    assert!(err.contains("HCLOUD_TOKEN is not set"), "{err}");
    let c = Credentials::from_env(&env(&[("HCLOUD_TOKEN", "s3cret")])).unwrap();
    assert_eq!(c.endpoint, DEFAULT_ENDPOINT);
    assert!(!format!("{c:?}").contains("s3cret"));
    let c = Credentials::from_env(&env(&[
        ("HCLOUD_TOKEN", "s3cret"),
        ("HCLOUD_ENDPOINT", "http://127.0.0.1:8080/v1/"),
    ]))
    .unwrap();
    assert_eq!(c.endpoint, "http://127.0.0.1:8080/v1");
    let err = Credentials::from_env(&env(&[
        ("HCLOUD_TOKEN", "s3cret"),
        ("HCLOUD_ENDPOINT", "ftp://x"),
    ]))
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("HCLOUD_ENDPOINT") && !err.contains("s3cret"),
        "{err}"
    );
    let err = Credentials::from_env(&env(&[("HCLOUD_TOKEN", "a b")]))
        .unwrap_err()
        .to_string();
    assert!(!err.contains("a b"), "{err}");
}

#[test]
fn created_times_parse() {
    let t = created_at(&json!({"created": "2026-11-26T08:00:00+00:00"})).unwrap();
    assert_eq!(
        t.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs(),
        1_795_680_000
    );
    assert!(created_at(&json!({"created": "yesterday"})).is_none());
}

#[test]
fn cancel_stops_sleeps() {
    static FLAG: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);
    let t = Instant::now();
    assert!(Cancel::on(&FLAG).sleep(Duration::from_secs(5)).is_err());
    assert!(t.elapsed() < Duration::from_secs(1));
    assert!(Cancel::never().sleep(Duration::from_millis(1)).is_ok());
}

#[test]
fn build_types_are_the_smallest_disks_first_in_list_order() {
    let loc =
        |available: bool| json!([{"name": "fsn1", "available": available, "deprecation": null}]);
    let t = |name: &str, arch: &str, disk: u64, available: bool| {
        json!({"name": name, "architecture": arch, "disk": disk, "deprecation": null,
               "locations": loc(available)})
    };
    let mut deprecated = t("cx22", "x86", 40, true);
    deprecated["deprecation"] = json!({"announced": "2025-10-01T00:00:00Z",
        "unavailable_after": "2026-01-01T00:00:00Z"});
    let types = vec![
        deprecated,
        t("cx23", "x86", 40, false),
        t("cx33", "x86", 80, true),
        t("cpx22", "x86", 80, true),
        t("cpx12", "x86", 40, true),
        t("cax11", "arm", 40, true),
        t("cax21", "arm", 80, true),
    ];
    let settings = |types: &[&str]| -> HcloudSettings {
        serde_json::from_value(json!({"location": "fsn1", "serverTypes": types})).unwrap()
    };
    let names = |b: &BuildTypes| {
        b.usable
            .iter()
            .map(|t| format!("{}:{}", t.name, t.disk))
            .collect::<Vec<_>>()
    };
    // Default: every type of the architecture; an unavailable 40 GB type
    // gives way to the next 40 GB one, not to an 80 GB one listed earlier.
    let b = order_build_types(&types, &settings(&[]), Arch::Amd64);
    assert_eq!(names(&b), ["cpx12:40", "cx33:80", "cpx22:80"]);
    assert_eq!(
        b.skipped,
        [
            ("cx22".to_owned(), "deprecated".to_owned()),
            ("cx23".to_owned(), "unavailable in fsn1".to_owned())
        ]
    );
    let b = order_build_types(&types, &settings(&[]), Arch::Arm64);
    assert_eq!(names(&b), ["cax11:40", "cax21:80"]);
    assert!(b.skipped.is_empty());
    // The inventory's list: its types only, equal disks in its order.
    let b = order_build_types(
        &types,
        &settings(&["cpx22", "cax11", "cx33", "cpx12"]),
        Arch::Amd64,
    );
    assert_eq!(names(&b), ["cpx12:40", "cpx22:80", "cx33:80"]);
    assert_eq!(b.skipped.len(), 1);
    assert!(b.skipped[0].1.contains("architecture is arm"), "{b:?}");
}

#[test]
fn disk_sizes_are_written_as_the_api_writes_them() {
    let snap = |disk_size| Snapshot {
        id: 1,
        labels: BTreeMap::new(),
        created: true,
        description: String::new(),
        sha256: Sha256::of(b""),
        nodes: Vec::new(),
        bytes_sent: 0,
        disk_size,
    };
    let v = serde_json::to_value(snap(40.0)).unwrap();
    assert_eq!(v["disk_size"], json!(40));
    assert_eq!(
        serde_json::to_value(snap(0.5)).unwrap()["disk_size"],
        json!(0.5)
    );
}

#[test]
fn a_clusters_snapshots_carry_its_label_and_it_reuses_only_its_own() {
    let settings = HcloudSettings {
        location: "fsn1".into(),
        server_types: Vec::new(),
        labels: BTreeMap::from([("team".to_owned(), "infra".to_owned())]),
        servers: None,
    };
    let a = published_labels(&image(), &for_cluster(&settings, "a"));
    assert_eq!(a[types::CLUSTER_LABEL], "a");
    assert_eq!(a["team"], "infra");
    assert_eq!(a["image-sha256"], "ab".repeat(16));
    // What a publish selects an existing snapshot by: another cluster's,
    // even one whose name starts the same, is not the same selector.
    let ab = published_labels(&image(), &for_cluster(&settings, "a-b"));
    assert!(
        selector(&a).contains("imgbuild-cluster=a,"),
        "{}",
        selector(&a)
    );
    assert_ne!(selector(&a), selector(&ab));
}
