use super::networks::{Network, network_json};
use super::power::*;
use super::*;
use serde_json::{Value, json};
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

fn page(query: &str, n: usize) -> Result<(Vec<Value>, Value), ApiError> {
    let items = (1..=n).map(|i| json!(i)).collect();
    paginate(&Query::parse(query), items)
}

#[test]
fn pagination_pages_and_meta() {
    let (items, meta) = page("", 60).unwrap();
    assert_eq!(items.len(), 25);
    assert_eq!(meta["last_page"], 3);
    assert_eq!(meta["next_page"], 2);
    assert_eq!(meta["previous_page"], Value::Null);
    let (items, meta) = page("page=2&per_page=50", 60).unwrap();
    assert_eq!(items, (51..=60).map(|i| json!(i)).collect::<Vec<_>>());
    assert_eq!(meta["next_page"], Value::Null);
    assert_eq!(meta["previous_page"], 1);
    assert_eq!(meta["total_entries"], 60);
    let (items, meta) = page("page=9", 60).unwrap();
    assert!(items.is_empty());
    assert_eq!(meta["last_page"], 3);
    let (items, meta) = page("", 0).unwrap();
    assert!(items.is_empty());
    assert_eq!(meta["last_page"], 1);
}

#[test]
fn pagination_refuses_out_of_range() {
    for q in ["per_page=51", "per_page=0", "page=0", "page=x"] {
        let (status, e) = page(q, 5).unwrap_err();
        assert_eq!(
            (status, e["code"].as_str()),
            (422, Some("invalid_input")),
            "{q}"
        );
    }
}

#[test]
fn query_decoding_and_sort() {
    let q = Query::parse("label_selector=k+in+%28a%2Cb%29&sort=id:desc&type=a&type=b");
    assert_eq!(q.one("label_selector"), Some("k in (a,b)"));
    assert_eq!(q.all("type"), ["a", "b"]);
    let mut items = vec![json!({"id": 1}), json!({"id": 3}), json!({"id": 2})];
    sort(&q, &mut items, &["id"]).unwrap();
    assert_eq!(
        items,
        [json!({"id": 3}), json!({"id": 2}), json!({"id": 1})]
    );
    assert!(sort(&Query::parse("sort=size"), &mut items, &["id"]).is_err());
}

/// The 200 response schema of `GET path` in the vendored document.
fn response_schema(path: &str) -> jsonschema::Validator {
    let doc: Value = serde_json::from_str(self::schema::DOCUMENT).unwrap();
    let schema =
        &doc["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]["schema"];
    jsonschema::draft202012::new(schema).unwrap()
}

fn assert_valid(path: &str, v: &Value) {
    let errors: Vec<String> = response_schema(path)
        .iter_errors(v)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect();
    assert!(errors.is_empty(), "GET {path}: {errors:?}");
}

#[test]
fn answers_match_the_documented_responses() {
    let mut labels = Labels::new();
    labels.insert("os".into(), "talos".into());
    let mut w = World::default();
    w.images.insert(
        7,
        Image {
            id: 7,
            snapshot: true,
            name: None,
            description: "talos".into(),
            status: "creating",
            labels: labels.clone(),
            created: 1_767_225_600,
            image_size: None,
            disk_size: 40,
            created_from: Some((9, "build".into())),
            arch: "x86",
        },
    );
    let server = Server {
        id: 9,
        name: "build".into(),
        status: "running",
        created: 1_767_225_600,
        server_type: &SERVER_TYPES[1],
        location: "fsn1",
        image: 7,
        labels: labels.clone(),
        rescue_enabled: true,
        rescue_keys: Vec::new(),
        ip: Ipv4Addr::new(127, 4, 0, 2),
        ssh_port: Some(2222),
        busy: None,
        boot: 1,
        sshd: None,
        user_data: None,
        from_snapshot: false,
        node_booted: false,
        private_net: vec![(4, Ipv4Addr::new(10, 0, 1, 2))],
    };
    let key = SshKey {
        id: 3,
        name: "k".into(),
        public_key: "ssh-ed25519 AAAA".into(),
        fingerprint: "00:11".into(),
        labels,
        created: 0,
    };
    let action = Action {
        id: 5,
        command: "create_image".into(),
        started: 0,
        started_at: Instant::now(),
        duration: Duration::from_secs(1),
        finished: None,
        error: false,
        resources: vec![(9, "server"), (7, "image")],
    };
    assert_valid(
        "/servers/{id}",
        &json!({"server": server_json(&server, &w)}),
    );
    assert_valid("/images/{id}", &json!({"image": image_json(&w.images[&7])}));
    assert_valid("/ssh_keys/{id}", &json!({"ssh_key": ssh_key_json(&key)}));
    let mut net = Network::seeded(4, 1_767_225_600);
    net.servers.insert(9, Ipv4Addr::new(10, 0, 1, 2));
    assert_valid(
        "/networks/{id}",
        &json!({"network": network_json(&net, iso)}),
    );
    assert_valid("/actions/{id}", &json!({"action": action_json(&action)}));
    let types: Vec<Value> = SERVER_TYPES.iter().map(server_type_json).collect();
    assert_valid(
        "/server_types",
        &json!({"server_types": types, "meta": {"pagination": paginate(&Query::parse(""), vec![]).unwrap().1}}),
    );
    let (locations, meta) = paginate(&Query::parse(""), locations(&Query::parse(""))).unwrap();
    assert_valid(
        "/locations",
        &json!({"locations": locations, "meta": {"pagination": meta}}),
    );
}

#[test]
fn user_data_is_read_as_talos_reads_it() {
    use base64::Engine;
    use std::io::Write;
    let config = "version: v1alpha1\nmachine:\n  type: worker\n#\n";
    assert_eq!(talos_config(config).unwrap(), config);
    let b64 = base64::engine::general_purpose::STANDARD.encode(config);
    assert_eq!(talos_config(&b64).unwrap(), config);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    gz.write_all(config.as_bytes()).unwrap();
    let gz = base64::engine::general_purpose::STANDARD.encode(gz.finish().unwrap());
    // Line breaks inside the base64 are skipped, as Go's decoder does.
    let wrapped: String = gz
        .as_bytes()
        .chunks(20)
        .map(|c| String::from_utf8_lossy(c) + "\r\n")
        .collect();
    assert_eq!(talos_config(&wrapped).unwrap(), config);
    // Unpadded base64 is not base64 to Go's StdEncoding: kept as text.
    let unpadded = b64.trim_end_matches('=');
    assert_ne!(unpadded, b64);
    assert_eq!(talos_config(unpadded).unwrap(), unpadded);
    // gzip magic with a broken stream is an error, as in Talos.
    let broken = base64::engine::general_purpose::STANDARD.encode([0x1f, 0x8b, 0x08, 0, 1]);
    assert!(talos_config(&broken).is_err());
}

#[test]
fn iso_dates() {
    assert_eq!(iso(0), "1970-01-01T00:00:00+00:00");
    assert_eq!(iso(1_767_225_600), "2026-01-01T00:00:00+00:00");
    assert_eq!(iso(951_782_400 + 3661), "2000-02-29T01:01:01+00:00");
}
