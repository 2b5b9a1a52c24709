//! End to end: `imgbuild publish` to the Hetzner Cloud simulator (whose
//! rescue system is a real sshd on loopback), and `imgbuild cleanup`:
//! the disk written is the image, the snapshot is labelled, nothing
//! temporary survives any ending, Ctrl-C and SIGKILL included.
//! Needs openssh-server, openssh-client and zstd (`make deps`); runs as
//! any user (the rescue sshd listens on a high port and lets in the user
//! running the simulator).

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common;
use common::inventory::Inventory;
use common::run::{Run, Work};
use common::sims::{Hc, Sim};
use common::{json, text};

/// The loopback example as a Hetzner inventory (`hcloud`: the target's
/// fields).
fn hetzner(hcloud: &str) -> Inventory {
    Inventory::loopback()
        .replace("platform: metal", "platform: hcloud")
        .hcloud(hcloud)
}

/// `imgbuild publish ARGS` against the simulators, writing into `work`.
fn publish(work: &Work, sim: &Sim, hc: &Hc, args: &[&str]) -> Run {
    let mut run = Run::with_config(&work.config, &["publish"]);
    run.args(args)
        .factory(sim)
        .args(["--poll-ms", "100"])
        .envs(hc.rescue_env())
        .folders(work.dir.path())
        .hcloud(hc);
    run
}

/// cp-01's image and its manifest entry.
fn image(work: &Work) -> (PathBuf, Value) {
    let e = work.manifest()["images"]["cp-01"].clone();
    (work.out().join(e["path"].as_str().unwrap()), e)
}

fn cleanup(hc: &Hc) -> Output {
    Run::new(&["cleanup", "--output", "json"])
        .hcloud(hc)
        .output()
}

/// Zero servers and SSH keys in the simulator.
fn nothing_left(hc: &Hc) {
    let s = hc.stats();
    assert_eq!(s["servers"], 0, "servers left: {s}");
    assert_eq!(s["sshKeys"], 0, "SSH keys left: {s}");
}

#[test]
fn snapshot_is_the_image_labelled_exactly_and_a_rerun_creates_nothing() {
    let sim = Sim::start(&[]);
    let hc = Hc::start(&[]);
    let work = Work::new(&hetzner("    location: fsn1\n    labels: {team: infra}\n"));
    let o = publish(&work, &sim, &hc, &["--output", "json"]).output();
    assert!(
        o.status.success(),
        "{}\n{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    let v = json(&o);
    let snaps = v["snapshots"].as_array().unwrap();
    // platform hcloud: no per-node META, so the five nodes share one image.
    assert_eq!(snaps.len(), 1, "{v}");
    let snap = &snaps[0];
    assert_eq!(snap["created"], true);
    assert_eq!(snap["nodes"].as_array().unwrap().len(), 5);
    let (image, entry) = image(&work);
    let sha = entry["sha256"].as_str().unwrap();
    let schematic = entry["schematicId"].as_str().unwrap();
    let want = serde_json::json!({
        "os": "talos", "talos-version": "v1.11.2", "arch": "amd64", "team": "infra",
        "talos-schematic": &schematic[..32], "image-sha256": &sha[..32],
        "imgbuild-cluster": "loopback",
    });
    assert_eq!(snap["labels"], want);
    let requests = v["requests"].as_u64().unwrap();
    assert!((10..=60).contains(&requests), "{requests} API requests");

    // The API's own view: the snapshot, its labels and description.
    let id = snap["id"].as_u64().unwrap();
    let (status, _, img) = hc.call("GET", &format!("/images/{id}"), None);
    assert_eq!(status, 200);
    assert_eq!(img["image"]["labels"], want);
    assert_eq!(img["image"]["status"], "available");
    assert_eq!(
        img["image"]["description"],
        format!("talos v1.11.2 amd64 {schematic}")
    );
    // The snapshot's bytes (the server's disk when it was taken) are the image.
    let raw = hc.dir.path().join(format!("state/images/{id}.raw"));
    assert_eq!(
        std::fs::read(&raw).unwrap(),
        std::fs::read(&image).unwrap(),
        "snapshot {} differs from {}",
        raw.display(),
        image.display()
    );
    nothing_left(&hc);
    assert_eq!(hc.stat("imagesCreated"), 1);
    assert_eq!(hc.stat("rejected"), 0, "requests the API schema refused");

    let servers = hc.stat("serversCreated");
    let o = publish(&work, &sim, &hc, &["--output", "json"]).output();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let v = json(&o);
    assert_eq!(v["snapshots"][0]["created"], false, "{v}");
    assert_eq!(v["snapshots"][0]["id"], id);
    assert_eq!(
        hc.stat("serversCreated"),
        servers,
        "a rerun created a server"
    );
    assert_eq!(hc.stat("imagesCreated"), 1);
    assert!(v["requests"].as_u64().unwrap() <= 2, "{v}");
}

#[test]
fn ssh_refused_for_a_while_then_accepted_and_the_first_type_unavailable() {
    let sim = Sim::start(&[]);
    let hc = Hc::start(&["--ssh-refuse-seconds", "20", "--unavailable", "cx23@fsn1"]);
    let work = Work::new(&hetzner(
        "    location: fsn1\n    serverTypes: [cx23, cpx22]\n",
    ));
    let t = Instant::now();
    let o = publish(&work, &sim, &hc, &[]).output();
    let err = text(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(t.elapsed() >= Duration::from_secs(20), "{:?}", t.elapsed());
    assert!(err.contains("server type cx23 skipped"), "{err}");
    assert!(err.contains("resource_unavailable"), "{err}");
    assert!(err.contains("(cpx22) created"), "{err}");
    assert!(err.contains("accepted for this session only"), "{err}");
    assert!(
        text(&o.stdout).contains("created for cp-01"),
        "{}",
        text(&o.stdout)
    );
    nothing_left(&hc);
}

/// The build server has the smallest disk of the image's architecture:
/// with cx23 (40 GB) full, cpx12 (40 GB, later in the list) and not an
/// 80 GB type listed before it. A snapshot on a larger disk than that (made
/// while only larger types were allowed) is passed over for one that fits.
#[test]
fn builds_take_the_smallest_disk_and_too_large_snapshots_are_remade() {
    let sim = Sim::start(&[]);
    let hc = Hc::start(&["--unavailable", "cx23@fsn1"]);
    let work = Work::new(&hetzner("    location: fsn1\n    serverTypes: [cpx22]\n"));
    let disk_of = |id: &Value| {
        let (_, _, img) = hc.call("GET", &format!("/images/{id}"), None);
        img["image"]["disk_size"].as_f64().unwrap()
    };
    let o = publish(&work, &sim, &hc, &["--output", "json"]).output();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let large = json(&o)["snapshots"][0].clone();
    assert_eq!(large["created"], true, "{large}");
    assert_eq!(large["disk_size"].as_f64(), Some(80.0), "{large}");
    assert_eq!(disk_of(&large["id"]), 80.0);

    // The default types: the 80 GB snapshot is too large for cx23 (full for
    // now, but listed available), so cpx12 makes one that fits.
    hetzner("    location: fsn1\n").write(work.dir.path());
    let o = publish(&work, &sim, &hc, &[]).output();
    let err = text(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains(&format!(
            "snapshot {} holds this image on a 80 GB disk, larger than cx23's 40 GB",
            large["id"]
        )),
        "{err}"
    );
    assert!(err.contains("server type cx23 skipped"), "{err}");
    assert!(err.contains("(cpx12) created"), "{err}");
    assert!(!err.contains("(cpx22) created"), "{err}");
    let o = publish(&work, &sim, &hc, &["--output", "json"]).output();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let fits = json(&o)["snapshots"][0].clone();
    assert_eq!(fits["created"], false, "the fitting one is reused: {fits}");
    assert_ne!(fits["id"], large["id"]);
    assert_eq!(fits["disk_size"].as_f64(), Some(40.0), "{fits}");
    assert_eq!(disk_of(&fits["id"]), 40.0);
    assert_eq!(hc.stat("imagesCreated"), 2);
    nothing_left(&hc);
}

#[test]
fn ssh_never_accepted_is_bounded_and_named() {
    let sim = Sim::start(&[]);
    let hc = Hc::start(&["--ssh-never"]);
    let work = Work::new(&hetzner("    location: fsn1\n"));
    let t = Instant::now();
    let o = publish(&work, &sim, &hc, &["--ssh-timeout", "4s"]).output();
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(t.elapsed() < Duration::from_secs(60), "{:?}", t.elapsed());
    assert!(err.contains("no login within 4s"), "{err}");
    let id = err
        .split("temporary server ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("no server named: {err}"));
    assert!(err.contains(&format!("server {id}: no login")), "{err}");
    nothing_left(&hc);
    assert_eq!(hc.stat("imagesCreated"), 0);
}

#[test]
fn without_the_openssh_client_nothing_is_created_and_the_package_is_named() {
    let sim = Sim::start(&[]);
    let hc = Hc::start(&[]);
    let work = Work::new(&hetzner("    location: fsn1\n"));
    let no_ssh = tempfile::tempdir().unwrap();
    let o = publish(&work, &sim, &hc, &[])
        .env("PATH", no_ssh.path())
        .output();
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("install the package openssh-client"), "{err}");
    assert!(!err.contains("temporary SSH key"), "a key was made: {err}");
    assert_eq!(hc.stat("serversCreated"), 0, "{err}");
    nothing_left(&hc);
}

#[test]
fn remote_dd_failure_and_failed_actions_leave_nothing() {
    let sim = Sim::start(&[]);
    for (switch, needle) in [
        (&["--dd-fails"][..], "Input/output error"),
        (&["--action-error", "create_image"][..], "ended in error"),
        (
            &["--action-error", "enable_rescue"][..],
            "enable_rescue on server",
        ),
    ] {
        let hc = Hc::start(switch);
        let work = Work::new(&hetzner("    location: fsn1\n"));
        let o = publish(&work, &sim, &hc, &["--output", "json"]).output();
        assert_eq!(o.status.code(), Some(1), "{switch:?}: {}", text(&o.stderr));
        let v = json(&o);
        let why = v["failed"][0]["error"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(why.contains(needle), "{switch:?}: {v}");
        assert!(v["snapshots"].as_array().unwrap().is_empty());
        nothing_left(&hc);
        if switch[0] == "--dd-fails" {
            assert_eq!(hc.stat("imagesCreated"), 0, "a snapshot of a failed write");
        }
    }
}

#[test]
fn rate_limits_are_waited_out() {
    let sim = Sim::start(&[]);
    let hc = Hc::start(&["--rate-limit-every", "4"]);
    let work = Work::new(&hetzner("    location: fsn1\n"));
    let o = publish(&work, &sim, &hc, &["--output", "json"]).output();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let v = json(&o);
    assert_eq!(v["snapshots"][0]["created"], true);
    assert!(hc.stat("rateLimited") >= 3, "{}", hc.stats());
    nothing_left(&hc);
}

/// Starts a publish of a large image and waits until it streams.
fn publish_until_streaming(work: &Work, sim: &Sim, hc: &Hc) -> (Child, Vec<String>) {
    let mut child = publish(work, sim, hc, &[])
        .into_command()
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = Vec::new();
    let mut reader = BufReader::new(child.stderr.take().unwrap());
    loop {
        let mut line = String::new();
        assert!(
            reader.read_line(&mut line).unwrap() > 0,
            "publish ended before streaming:\n{}",
            lines.join("")
        );
        let streaming = line.contains("writing ");
        lines.push(line);
        if streaming {
            break;
        }
    }
    std::thread::spawn(move || std::io::copy(&mut reader, &mut std::io::sink()));
    (child, lines)
}

#[test]
fn sigint_during_the_stream_cleans_up() {
    let sim = Sim::start_with(&[], 400, &[]);
    let hc = Hc::start(&[]);
    let work = Work::new(&hetzner("    location: fsn1\n"));
    let (mut child, lines) = publish_until_streaming(&work, &sim, &hc);
    assert_eq!(hc.stats()["servers"], 1);
    // The host key said is the rescue sshd's own (its key sits beside the
    // server's disk file in the simulator's state).
    let said = lines.concat();
    let id: u64 = said
        .split("temporary server ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|id| id.parse().ok())
        .unwrap_or_else(|| panic!("no server named: {said}"));
    let host_key = hc
        .disk(id)
        .with_file_name("rescue")
        .join("ssh_host_ed25519_key.pub");
    let o = Command::new("ssh-keygen")
        .args(["-l", "-E", "sha256", "-f"])
        .arg(&host_key)
        .output()
        .unwrap();
    let shown = text(&o.stdout);
    let fingerprint = shown.split_whitespace().nth(1).unwrap_or_default();
    assert!(
        fingerprint.starts_with("SHA256:"),
        "{shown}{}",
        text(&o.stderr)
    );
    assert!(
        said.contains(&format!("its host key {fingerprint} is new")),
        "{fingerprint}: {said}"
    );
    let kill = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(1), "{status:?}");
    nothing_left(&hc);
    assert_eq!(hc.stat("imagesCreated"), 0);
}

#[test]
fn a_dd_that_fails_before_reading_ends_the_stream_at_once() {
    // dd cannot open the disk: it exits before reading a byte, and the
    // image (64 MiB of random data, far more than the SSH window and the
    // pipes hold) must not be pushed into a channel nobody reads.
    let sim = Sim::start_with(&[], 64, &[]);
    let hc = Hc::start(&["--dd-fails"]);
    let work = Work::new(&hetzner("    location: fsn1\n"));
    let t = Instant::now();
    let o = publish(&work, &sim, &hc, &[]).output();
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    assert!(
        err.contains("dd: failed to open '/dev/sda': Input/output error"),
        "{err}"
    );
    nothing_left(&hc);
    assert_eq!(hc.stat("imagesCreated"), 0);
}

#[test]
fn sigterm_during_the_stream_cleans_up_within_10_seconds() {
    let sim = Sim::start_with(&[], 400, &[]);
    let hc = Hc::start(&[]);
    let work = Work::new(&hetzner("    location: fsn1\n"));
    let (mut child, _) = publish_until_streaming(&work, &sim, &hc);
    assert_eq!(hc.stats()["servers"], 1);
    let t = Instant::now();
    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let status = child.wait().unwrap();
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert_eq!(status.code(), Some(1), "{status:?}");
    nothing_left(&hc);
    assert_eq!(hc.stat("imagesCreated"), 0);
}

#[test]
fn sigkill_during_the_stream_then_cleanup_leaves_nothing() {
    let sim = Sim::start_with(&[], 400, &[]);
    let hc = Hc::start(&[]);
    // Something imgbuild must never delete: a server with no run label.
    let (status, _, _) = hc.call(
        "POST",
        "/servers",
        Some(serde_json::json!({
            "name": "cluster-cp-01", "server_type": "cx23", "image": "debian-13",
            "location": "fsn1", "labels": {"managed-by": "imgbuild", "imgbuild-cluster": "x"}
        })),
    );
    assert_eq!(status, 201);
    let work = Work::new(&hetzner("    location: fsn1\n"));
    let (mut child, _) = publish_until_streaming(&work, &sim, &hc);
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(hc.stats()["servers"], 2);
    assert_eq!(hc.stats()["sshKeys"], 1);
    let o = cleanup(&hc);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let v = json(&o);
    let kinds: Vec<&str> = v["deleted"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["server", "ssh_key"], "{v}");
    let s = hc.stats();
    assert_eq!(s["servers"], 1, "{s}");
    assert_eq!(s["sshKeys"], 0, "{s}");
    let (_, _, left) = hc.call("GET", "/servers", None);
    assert_eq!(left["servers"][0]["name"], "cluster-cp-01");
    // Nothing more to do.
    let v = json(&cleanup(&hc));
    assert!(v["deleted"].as_array().unwrap().is_empty(), "{v}");
}

#[test]
fn the_next_publish_removes_what_a_killed_run_left() {
    let sim = Sim::start_with(&[], 128, &[]);
    let hc = Hc::start(&[]);
    let work = Work::new(&hetzner("    location: fsn1\n"));
    let (mut child, _) = publish_until_streaming(&work, &sim, &hc);
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(hc.stats()["servers"], 1);
    assert_eq!(hc.stats()["sshKeys"], 1);
    let o = publish(&work, &sim, &hc, &[]).output();
    assert!(o.status.success(), "{}", text(&o.stderr));
    nothing_left(&hc);
    assert_eq!(hc.stat("imagesCreated"), 1);
}

#[test]
fn the_next_publish_removes_another_machines_stale_run_and_nothing_without_imgbuilds_labels() {
    let sim = Sim::start_with(&[], 128, &[]);
    let hc = Hc::start(&[]);
    let server = |name: &str, labels: Value| {
        let (status, _, v) = hc.call(
            "POST",
            "/servers",
            Some(serde_json::json!({
                "name": name, "server_type": "cx23", "image": "debian-13",
                "location": "fsn1", "labels": labels
            })),
        );
        assert_eq!(status, 201, "{v}");
    };
    let run = |run: &str, started: u64| {
        serde_json::json!({
            "managed-by": "imgbuild", "imgbuild-run": run,
            // Another machine's boot: its process cannot be asked.
            "imgbuild-owner": "00000000deadbeef-4242",
            "imgbuild-started": started.to_string(),
        })
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    // Killed on another machine a day ago: a leftover.
    server("imgbuild-killed", run("0123456789abcdef", now - 86400));
    // Under way on another machine: left alone.
    server("imgbuild-running", run("fedcba9876543210", now - 60));
    // Someone else's, old, one with a label like ours but not imgbuild's
    // managed-by: never touched.
    server(
        "someone-elses",
        serde_json::json!({"imgbuild-started": "1000000000"}),
    );
    server(
        "lookalike",
        serde_json::json!({"imgbuild-run": "0123456789abcdef", "imgbuild-started": "1000000000"}),
    );
    let work = Work::new(&hetzner("    location: fsn1\n"));
    let o = publish(&work, &sim, &hc, &[]).output();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let (_, _, left) = hc.call("GET", "/servers", None);
    let mut names: Vec<&str> = left["servers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["imgbuild-running", "lookalike", "someone-elses"],
        "{left}"
    );
    assert_eq!(hc.stats()["sshKeys"], 0);
}

#[test]
fn token_problems_stop_before_anything_is_built() {
    let work = Work::new(&hetzner("    location: fsn1\n"));
    let o = Run::with_config(&work.config, &["publish", "--out-dir"])
        .arg(work.out())
        .env_remove("HCLOUD_TOKEN")
        .output();
    // A missing credential is a usage error, as in `up`.
    assert_eq!(o.status.code(), Some(2));
    assert!(
        text(&o.stderr).contains("HCLOUD_TOKEN is not set"),
        "{}",
        text(&o.stderr)
    );
    assert!(!work.out().exists());
    // A wrong token: the API's error object, verbatim, with the request; the token nowhere.
    let sim = Sim::start(&[]);
    let hc = Hc::start(&[]);
    let o = publish(&work, &sim, &hc, &[])
        .env("HCLOUD_TOKEN", "wrongtoken123")
        .output();
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("GET /server_types: HTTP 401"), "{err}");
    assert!(err.contains(r#""code":"unauthorized""#), "{err}");
    assert!(!err.contains("wrongtoken123"), "{err}");
}
