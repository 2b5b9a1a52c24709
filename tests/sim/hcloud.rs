//! The Hetzner Cloud simulator driven the way the tools that make snapshots
//! by hand drive the real API: curl for the API, the system OpenSSH client
//! (with a key from ssh-keygen) for the rescue system, and `zstd | ssh …
//! dd` for the image. The simulator shares no code with imgbuild, so these
//! test it against the upstream facts alone (apricote/hcloud-upload-image
//! `hcloudimages/client.go`, the OpenAPI document in `sim/api-schemas/`).
//! Needs openssh-server, openssh-client and zstd (`make deps`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::common;
use common::sims::{Hc, RESCUE_SSH_PORT, rescue_user};
use common::text;

/// An ed25519 key pair made by ssh-keygen; (private key path, public key).
fn keypair(dir: &Path, name: &str) -> (PathBuf, String) {
    let key = dir.join(name);
    let st = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C", name, "-f"])
        .arg(&key)
        .status()
        .unwrap();
    assert!(st.success());
    let public = std::fs::read_to_string(key.with_extension("pub")).unwrap();
    (key, public.trim().to_owned())
}

/// Where the rescue sshd of `server` listens: (ip, port).
fn ssh_target(server: &Value) -> (String, u16) {
    let ip = server["public_net"]["ipv4"]["ip"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(ip.starts_with("127.4."), "{ip}");
    let port = server["sim_ssh_port"].as_u64().unwrap_or(22) as u16;
    assert_eq!(port, RESCUE_SSH_PORT, "{server}");
    (ip, port)
}

/// `ssh root@ip -p port COMMAND` with `key`, stdin from `input`.
fn ssh(key: &Path, (ip, port): &(String, u16), command: &str, input: Option<&[u8]>) -> Output {
    let mut child = Command::new("ssh")
        .args([
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "BatchMode=yes",
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "ConnectTimeout=5",
            "-o",
            "LogLevel=ERROR",
            "-i",
        ])
        .arg(key)
        .args(["-p", &port.to_string()])
        .arg(format!("{}@{ip}", rescue_user()))
        .arg(command)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    if let Some(data) = input {
        stdin.write_all(data).unwrap();
    }
    drop(stdin);
    child.wait_with_output().unwrap()
}

/// Retries `hostname` over SSH until it answers or `limit` passes.
fn ssh_hostname(key: &Path, target: &(String, u16), limit: Duration) -> Result<String, String> {
    let deadline = Instant::now() + limit;
    loop {
        let o = ssh(key, target, "hostname", None);
        if o.status.success() {
            return Ok(text(&o.stdout).trim().to_owned());
        }
        if Instant::now() > deadline {
            return Err(text(&o.stderr));
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn create_key(hc: &Hc, public: &str) -> u64 {
    let v = hc.ok(
        "POST",
        "/ssh_keys",
        Some(json!({"name": "imgbuild-tmp", "public_key": public,
            "labels": {"managed-by": "imgbuild"}})),
    );
    v["ssh_key"]["id"].as_u64().unwrap()
}

fn server_body(server_type: &str, key: u64) -> Value {
    json!({"name": "imgbuild-build", "server_type": server_type, "image": "debian-13",
        "location": "fsn1", "start_after_create": false, "ssh_keys": [key],
        "labels": {"managed-by": "imgbuild"}})
}

/// Creates a server, enables rescue with `key` and powers it on; the server.
fn rescue_server(hc: &Hc, server_type: &str, key: u64) -> Value {
    let v = hc.ok("POST", "/servers", Some(server_body(server_type, key)));
    assert_eq!(v["root_password"], Value::Null);
    assert_eq!(v["next_actions"], json!([]));
    assert_eq!(v["server"]["status"], "initializing");
    hc.wait_ok(&v["action"]);
    let id = v["server"]["id"].as_u64().unwrap();
    let path = format!("/servers/{id}");
    assert_eq!(hc.ok("GET", &path, None)["server"]["status"], "off");
    let r = hc.ok(
        "POST",
        &format!("{path}/actions/enable_rescue"),
        Some(json!({"type": "linux64", "ssh_keys": [key]})),
    );
    hc.wait_ok(&r["action"]);
    let on = hc.ok("POST", &format!("{path}/actions/poweron"), None);
    assert_eq!(on["action"]["command"], "start_server");
    hc.wait_ok(&on["action"]);
    let server = hc.ok("GET", &path, None)["server"].clone();
    assert_eq!(server["status"], "running");
    assert_eq!(server["rescue_enabled"], true);
    server
}

#[test]
fn snapshot_through_the_rescue_system() {
    let hc = Hc::start(&["--unavailable", "cx23@fsn1"]);
    let keys = tempfile::tempdir().unwrap();
    let (key, public) = keypair(keys.path(), "id_imgbuild");
    let (other, _) = keypair(keys.path(), "id_other");

    // Wrong token, bad bodies.
    let o = Command::new("curl")
        .args(["-s", "-H", "Authorization: Bearer nope"])
        .arg(format!("{}/servers", hc.url))
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["error"]["code"], "unauthorized");
    let (status, _, v) = hc.call(
        "POST",
        "/servers",
        Some(json!({"name": "x", "server_type": "cx23", "image": "debian-13", "sshkeys": []})),
    );
    assert_eq!(
        (status, &v["error"]["code"]),
        (422, &json!("invalid_input"))
    );
    assert_eq!(v["error"]["details"]["fields"][0]["name"], "sshkeys");

    let key_id = create_key(&hc, &public);
    let (status, _, v) = hc.call("POST", "/servers", Some(server_body("cx22", key_id)));
    assert_eq!(
        (status, &v["error"]["code"]),
        (422, &json!("invalid_server_type"))
    );
    let (status, _, v) = hc.call("POST", "/servers", Some(server_body("cx23", key_id)));
    assert_eq!(
        (status, &v["error"]["code"]),
        (412, &json!("resource_unavailable"))
    );
    let server = rescue_server(&hc, "cpx22", key_id);
    let id = server["id"].as_u64().unwrap();
    let target = ssh_target(&server);

    assert_eq!(
        ssh_hostname(&key, &target, Duration::from_secs(10)).unwrap(),
        "rescue"
    );
    let refused = ssh(&other, &target, "hostname", None);
    assert!(
        !refused.status.success(),
        "a key the API never saw logged in"
    );

    // The image: 3 MiB of noise then 1 MiB of zeros (sparse on the disk).
    let fixture = keys.path().join("image.raw");
    let mut bytes: Vec<u8> = (0..3u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    bytes.extend(std::iter::repeat_n(0u8, 1 << 20));
    std::fs::write(&fixture, &bytes).unwrap();
    let disk = hc.disk(id);
    assert_ne!(std::fs::read(&disk).unwrap(), bytes);
    let o = ssh(&key, &target, "blkdiscard --force /dev/sda", None);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(std::fs::metadata(&disk).unwrap().len(), 0);
    let compressed = Command::new("zstd")
        .args(["-q", "-c"])
        .arg(&fixture)
        .output()
        .unwrap()
        .stdout;
    let o = ssh(
        &key,
        &target,
        "set -euo pipefail; zstd -d | dd of=/dev/sda bs=4M conv=sparse iflag=fullblock; sync",
        Some(&compressed),
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(
        text(&o.stderr).contains(&format!("{} bytes", bytes.len())),
        "{}",
        text(&o.stderr)
    );
    assert!(
        std::fs::read(&disk).unwrap() == bytes,
        "the disk differs from the image"
    );

    // Power off (sshd goes), snapshot with labels.
    let off = hc.ok("POST", &format!("/servers/{id}/actions/poweroff"), None);
    hc.wait_ok(&off["action"]);
    assert_eq!(
        hc.ok("GET", &format!("/servers/{id}"), None)["server"]["status"],
        "off"
    );
    assert!(
        !ssh(&key, &target, "hostname", None).status.success(),
        "sshd outlived poweroff"
    );
    let labels = json!({"os": "talos", "talos-version": "v1.11.2", "arch": "amd64"});
    let v = hc.ok(
        "POST",
        &format!("/servers/{id}/actions/create_image"),
        Some(json!({"type": "snapshot", "description": "talos v1.11.2 amd64", "labels": labels})),
    );
    assert_eq!(v["image"]["status"], "creating");
    let (status, _, locked) = hc.call("DELETE", &format!("/servers/{id}"), None);
    assert_eq!((status, &locked["error"]["code"]), (423, &json!("locked")));
    hc.wait_ok(&v["action"]);
    let image_id = v["image"]["id"].as_u64().unwrap();
    let image = hc.ok("GET", &format!("/images/{image_id}"), None)["image"].clone();
    assert_eq!(image["status"], "available");
    assert_eq!(image["type"], "snapshot");
    assert_eq!(image["labels"], labels);
    assert_eq!(image["created_from"]["id"], id);
    let stored = hc.dir.path().join(format!("state/images/{image_id}.raw"));
    assert!(
        std::fs::read(stored).unwrap() == bytes,
        "the snapshot differs from the disk"
    );
    // It holds cpx22's 80 GB disk: servers from it need at least that, and
    // its architecture.
    assert_eq!(image["disk_size"], 80);
    assert_eq!(image["architecture"], "x86");
    let from_snapshot = |server_type: &str| {
        let mut body = server_body(server_type, key_id);
        body["image"] = json!(image_id);
        body["name"] = json!(format!("from-{server_type}"));
        hc.call("POST", "/servers", Some(body))
    };
    let (status, _, v) = from_snapshot("cpx12");
    assert_eq!(
        (status, &v["error"]["code"]),
        (422, &json!("invalid_server_type")),
        "{v}"
    );
    let (status, _, v) = from_snapshot("cax21");
    assert_eq!(
        (status, &v["error"]["code"]),
        (422, &json!("placement_error")),
        "{v}"
    );
    let v = from_snapshot("cx33").2;
    let bigger = v["server"]["id"].as_u64().unwrap_or_else(|| panic!("{v}"));
    assert_eq!(v["server"]["image"]["id"], image_id);
    hc.wait_ok(&v["action"]);
    hc.ok("DELETE", &format!("/servers/{bigger}"), None);
    let found = hc.ok(
        "GET",
        "/images?type=snapshot&status=available&label_selector=os%3Dtalos,talos-version%3Dv1.11.2,arch+in+(amd64)&sort=created:desc",
        None,
    );
    assert_eq!(found["images"].as_array().unwrap().len(), 1, "{found}");
    assert_eq!(found["meta"]["pagination"]["total_entries"], 1);
    let none = hc.ok(
        "GET",
        "/images?type=snapshot&label_selector=arch%3Darm64",
        None,
    );
    assert_eq!(none["images"], json!([]));

    let mine = hc.ok(
        "GET",
        "/servers?label_selector=managed-by%3Dimgbuild&per_page=50",
        None,
    );
    assert_eq!(mine["servers"][0]["id"], id, "{mine}");
    assert_eq!(mine["meta"]["pagination"]["total_entries"], 1);
    let mine = hc.ok("GET", "/ssh_keys?label_selector=managed-by", None);
    assert_eq!(mine["ssh_keys"][0]["id"], key_id, "{mine}");
    let other = hc.ok("GET", "/ssh_keys?label_selector=!managed-by", None);
    assert_eq!(other["ssh_keys"], json!([]));

    hc.ok("DELETE", &format!("/servers/{id}"), None);
    hc.ok("DELETE", &format!("/ssh_keys/{key_id}"), None);
    let s = hc.stats();
    assert_eq!(s["servers"], 0, "{s}");
    assert_eq!(s["sshKeys"], 0, "{s}");
    assert_eq!(s["serversCreated"], 2, "{s}");
    assert_eq!(s["imagesCreated"], 1, "{s}");
    assert_eq!(s["rejected"], 1, "{s}");
}

#[test]
fn ssh_refused_then_accepted_and_dd_failing() {
    let hc = Hc::start(&["--ssh-refuse-seconds", "3", "--dd-fails"]);
    let keys = tempfile::tempdir().unwrap();
    let (key, public) = keypair(keys.path(), "id_imgbuild");
    let key_id = create_key(&hc, &public);
    let server = rescue_server(&hc, "cx23", key_id);
    let booted = Instant::now();
    let target = ssh_target(&server);
    let first = ssh(&key, &target, "hostname", None);
    assert!(!first.status.success(), "sshd accepted at once");
    assert!(
        text(&first.stderr).contains("refused"),
        "{}",
        text(&first.stderr)
    );
    assert_eq!(
        ssh_hostname(&key, &target, Duration::from_secs(15)).unwrap(),
        "rescue"
    );
    assert!(
        booted.elapsed() >= Duration::from_millis(2500),
        "{:?}",
        booted.elapsed()
    );
    let o = ssh(
        &key,
        &target,
        "set -euo pipefail; zstd -d | dd of=/dev/sda bs=4M conv=sparse iflag=fullblock; sync",
        Some(&[0u8; 64]),
    );
    assert!(!o.status.success(), "dd was to fail");
    assert!(
        text(&o.stderr).contains("dd: failed to open '/dev/sda'"),
        "{}",
        text(&o.stderr)
    );
}

/// One request sent again while it is rate limited (429), for at most 10 s;
/// its status and body (`body` null: none).
fn past_limit(hc: &Hc, method: &str, path: &str, body: Value) -> (u16, Value) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (s, _, v) = hc.call(method, path, (!body.is_null()).then(|| body.clone()));
        if s != 429 {
            return (s, v);
        }
        assert!(Instant::now() < deadline, "{method} {path}: still 429");
    }
}

#[test]
fn rate_limit_and_action_errors() {
    let hc = Hc::start(&["--rate-limit-every", "3", "--action-error", "create_image"]);
    let (a, _, _) = hc.call("GET", "/server_types", None);
    let (b, _, types) = hc.call("GET", "/locations", None);
    let (c, head, v) = hc.call("GET", "/images", None);
    assert_eq!((a, b, c), (200, 200, 429), "{v}");
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");
    let reset: u64 = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("ratelimit-reset: ")
                .map(String::from)
        })
        .unwrap_or_else(|| panic!("no RateLimit-Reset in {head}"))
        .trim()
        .parse()
        .unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!(reset >= now && reset <= now + 3600, "{reset} vs {now}");
    assert!(
        types["locations"]
            .as_array()
            .unwrap()
            .iter()
            .any(|l| l["name"] == "fsn1")
    );
    let types = hc.ok("GET", "/server_types", None);
    let cx22 = types["server_types"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "cx22")
        .unwrap()
        .clone();
    assert_eq!(cx22["deprecated"], true);
    // Each type's disk, as Hetzner lists them (GB).
    let disks: Vec<(String, u64)> = types["server_types"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["name"].as_str().unwrap().to_owned(),
                t["disk"].as_u64().unwrap(),
            )
        })
        .collect();
    for (name, disk) in [
        ("cx23", 40),
        ("cpx12", 40),
        ("cax11", 40),
        ("cx33", 80),
        ("cpx22", 80),
        ("cax21", 80),
    ] {
        assert!(
            disks.contains(&(name.to_owned(), disk)),
            "{name}: {disks:?}"
        );
    }
    assert!(
        cx22["locations"]
            .as_array()
            .unwrap()
            .iter()
            .all(|l| l["available"] == false)
    );

    // A failing create_image: the action ends in error, no snapshot remains.
    let keys = tempfile::tempdir().unwrap();
    let (_, public) = keypair(keys.path(), "id");
    let (s, v) = past_limit(
        &hc,
        "POST",
        "/ssh_keys",
        json!({"name": "k", "public_key": public}),
    );
    assert_eq!(s, 201, "{v}");
    let key_id = v["ssh_key"]["id"].as_u64().unwrap();
    let (_, v) = past_limit(&hc, "POST", "/servers", server_body("cx23", key_id));
    let id = v["server"]["id"].as_u64().unwrap();
    let wait = |a: &Value| {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let (s, _, v) = hc.call("GET", &format!("/actions/{}", a["id"]), None);
            if s == 200 && v["action"]["status"] != "running" {
                return v["action"].clone();
            }
            assert!(Instant::now() < deadline, "action {} never ended", a["id"]);
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    assert_eq!(wait(&v["action"])["status"], "success");
    let (_, img) = past_limit(
        &hc,
        "POST",
        &format!("/servers/{id}/actions/create_image"),
        json!({"type": "snapshot"}),
    );
    let a = wait(&img["action"]);
    assert_eq!(a["status"], "error");
    assert_eq!(a["error"]["code"], "action_failed");
    let (s, _) = past_limit(
        &hc,
        "GET",
        &format!("/images/{}", img["image"]["id"]),
        Value::Null,
    );
    assert_eq!(s, 404, "a failed snapshot remained");
    assert!(hc.stats()["rateLimited"].as_u64().unwrap() >= 1);
}

#[test]
fn start_after_create_and_sshd_gone_at_exit() {
    let mut hc = Hc::start(&[]);
    let keys = tempfile::tempdir().unwrap();
    let (key, public) = keypair(keys.path(), "id_imgbuild");
    let key_id = create_key(&hc, &public);
    let mut body = server_body("cax11", key_id);
    body["start_after_create"] = json!(true);
    body["name"] = json!("started");
    let v = hc.ok("POST", "/servers", Some(body));
    let next = &v["next_actions"][0];
    assert_eq!(next["command"], "start_server", "{v}");
    assert_ne!(next["id"], v["action"]["id"]);
    hc.wait_ok(next);
    let id = v["server"]["id"].as_u64().unwrap();
    let server = hc.ok("GET", &format!("/servers/{id}"), None)["server"].clone();
    assert_eq!(server["status"], "running");
    assert_eq!(server["server_type"]["architecture"], "arm");
    assert_eq!(server["image"]["architecture"], "arm");
    hc.ok("DELETE", &format!("/servers/{id}"), None);

    let server = rescue_server(&hc, "cx23", key_id);
    let target = ssh_target(&server);
    assert_eq!(
        ssh_hostname(&key, &target, Duration::from_secs(10)).unwrap(),
        "rescue"
    );
    let st = Command::new("kill")
        .args(["-TERM", &hc.child.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    let _ = hc.child.wait();
    let addr: std::net::SocketAddr = format!("{}:{}", target.0, target.1).parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while std::net::TcpStream::connect(addr).is_ok() {
        assert!(
            Instant::now() < deadline,
            "the rescue sshd outlived the simulator"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn networks_are_listed_and_servers_attach_with_their_addresses() {
    let hc = Hc::start(&["--network", "lan=192.168.7.0/24"]);
    let talos = hc.ok("GET", "/networks?name=talos", None);
    assert_eq!(talos["meta"]["pagination"]["total_entries"], 1, "{talos}");
    let net = &talos["networks"][0];
    assert_eq!(net["ip_range"], "10.0.0.0/16");
    assert_eq!(
        net["subnets"],
        json!([{"type": "cloud", "ip_range": "10.0.1.0/24", "network_zone": "eu-central",
            "gateway": "10.0.0.1", "vswitch_id": null}])
    );
    let talos_id = net["id"].as_u64().unwrap();
    let all = hc.ok("GET", "/networks?per_page=1&page=2&sort=name:desc", None);
    assert_eq!(all["networks"][0]["name"], "lan", "{all}");
    assert_eq!(all["meta"]["pagination"]["total_entries"], 2);
    let none = hc.ok("GET", "/networks?label_selector=env%3Dprod", None);
    assert_eq!(none["networks"], json!([]));

    // At create: the first free address of the zone's subnet.
    let body = |name: &str, networks: Value| {
        json!({"name": name, "server_type": "cpx22", "image": "debian-13",
            "location": "fsn1", "start_after_create": false, "networks": networks})
    };
    let a = hc.ok("POST", "/servers", Some(body("a", json!([talos_id]))));
    hc.wait_ok(&a["action"]);
    let a_id = a["server"]["id"].as_u64().unwrap();
    let got = hc.ok("GET", &format!("/servers/{a_id}"), None);
    assert_eq!(got["server"]["private_net"][0]["network"], talos_id);
    assert_eq!(got["server"]["private_net"][0]["ip"], "10.0.1.2");
    let (code, _, v) = hc.call("POST", "/servers", Some(body("b", json!([999]))));
    assert_eq!((code, &v["error"]["code"]), (422, &json!("invalid_input")));

    // Afterwards: an action; the address asked for, once.
    let b = hc.ok("POST", "/servers", Some(body("b", json!([]))));
    hc.wait_ok(&b["action"]);
    let b_id = b["server"]["id"].as_u64().unwrap();
    let attach = format!("/servers/{b_id}/actions/attach_to_network");
    let (code, _, v) = hc.call(
        "POST",
        &attach,
        Some(json!({"network": talos_id, "ip": "10.0.1.2"})),
    );
    assert_eq!(
        (code, &v["error"]["code"]),
        (422, &json!("ip_not_available"))
    );
    let (code, _, v) = hc.call(
        "POST",
        &attach,
        Some(json!({"network": talos_id, "ip": "10.0.9.9"})),
    );
    assert_eq!(
        (code, &v["error"]["code"]),
        (422, &json!("ip_not_available"))
    );
    let (code, _, v) = hc.call("POST", &attach, Some(json!({"network": "talos"})));
    assert_eq!((code, &v["error"]["code"]), (422, &json!("invalid_input")));
    let ok = hc.ok(
        "POST",
        &attach,
        Some(json!({"network": talos_id, "ip": "10.0.1.11"})),
    );
    assert_eq!(ok["action"]["command"], "attach_to_network");
    hc.wait_ok(&ok["action"]);
    let got = hc.ok("GET", &format!("/servers/{b_id}"), None);
    assert_eq!(got["server"]["private_net"][0]["ip"], "10.0.1.11", "{got}");
    let (code, _, v) = hc.call("POST", &attach, Some(json!({"network": talos_id})));
    assert_eq!(
        (code, &v["error"]["code"]),
        (422, &json!("server_already_attached"))
    );
    let listed = hc.ok("GET", &format!("/networks/{talos_id}"), None);
    assert_eq!(listed["network"]["servers"], json!([a_id, b_id]));
    hc.ok("DELETE", &format!("/servers/{a_id}"), None);
    let listed = hc.ok("GET", &format!("/networks/{talos_id}"), None);
    assert_eq!(listed["network"]["servers"], json!([b_id]));
}
