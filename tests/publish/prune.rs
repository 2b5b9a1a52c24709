//! `imgbuild prune` against the simulators: a Proxmox cluster taken through
//! three Talos versions (v1.11.2 → v1.11.3 → v1.11.5; `publish` uploads per
//! version, the VMs keep booting what they were made from), Hetzner
//! snapshots of three versions, and the download cache. Only what
//! imgbuild made for the cluster and nothing uses goes.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common;
use common::inventory::Inventory;
use common::run::{Run, Work};
use common::sims::{Hc, Pve, Sim};
use common::{json, text};

const VERSIONS: [&str; 3] = ["v1.11.2", "v1.11.3", "v1.11.5"];

fn factory() -> Sim {
    Sim::start_with(&[], 0, &["--versions", &VERSIONS.join(",")])
}

fn publish(work: &Work, sim: &Sim, pve: &Pve) -> Output {
    Run::with_config(
        &work.config,
        &["publish", "cp-01", "cp-02", "--poll-ms", "20", "--quiet"],
    )
    .factory(sim)
    .folders(work.dir.path())
    .proxmox(pve)
    .output()
}

/// `imgbuild prune ARGS` with the work's out dir and cache.
fn prune(work: &Work, pve: &Pve, args: &[&str]) -> Output {
    Run::with_config(&work.config, &["prune"])
        .args(args)
        .folders(work.dir.path())
        .proxmox(pve)
        .output()
}

fn imports(pve: &Pve) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(pve.dir.path().join("state/storage/local/import"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    out.sort();
    out
}

fn cache_entries(work: &Work) -> usize {
    std::fs::read_dir(work.cache().join("images"))
        .unwrap()
        .count()
}

/// A file uploaded into `local` as `name` by someone else.
fn foreign_upload(pve: &Pve, dir: &Path, name: &str) {
    let file = dir.join(name);
    std::fs::write(&file, vec![0u8; 4096]).unwrap();
    let sum = text(
        &Command::new("sha256sum")
            .arg(&file)
            .output()
            .unwrap()
            .stdout,
    );
    let (code, v) = pve.upload(&file, sum.split_whitespace().next().unwrap());
    assert_eq!(code, 200, "{v}");
    assert_eq!(pve.wait(&v["data"])["exitstatus"], "OK");
}

/// The inventory's VM line (tests/common/inventory.rs `proxmox(true)`).
const VM_LINE: &str = "    vm: {storage: local-lvm, firstId: 300, diskSize: 10, memory: 2048}\n";

/// Publishes cp-01 and cp-02 at each version in turn, each version's
/// uploads an hour apart, plus three volumes that are not the cluster's: by
/// hand, another cluster's, and a name of the scheme for a node this
/// cluster never had. The VMs are made at the first version; an existing
/// VM's disk is its image of record (no upload for it), so the later
/// versions are published to storage only, as a job that stages images
/// ahead of an upgrade does (an inventory without `vm`).
fn three_versions(pve: &Pve, sim: &Sim) -> Work {
    let work = Work::new(&Inventory::loopback().proxmox(true));
    for (i, version) in VERSIONS.iter().enumerate() {
        if i == 1 {
            work.edit(VM_LINE, "");
        }
        if i > 0 {
            work.edit(
                &format!("talosVersion: {}", VERSIONS[i - 1]),
                &format!("talosVersion: {version}"),
            );
        }
        let o = publish(&work, sim, pve);
        assert!(o.status.success(), "{version}: {}", text(&o.stderr));
        // Storage keeps whole seconds: give each version its own hour.
        let age = format!("{} hours ago", 3 - i);
        for f in imports(pve).iter().filter(|f| f.contains(version)) {
            let ok = Command::new("touch")
                .args(["-d", &age])
                .arg(pve.stored(f))
                .status()
                .unwrap();
            assert!(ok.success());
        }
    }
    for name in [
        "talos-v1.11.2-by-hand.raw",
        "other-cp-01-v1.11.2-0123456789ab.raw",
        "loopback-ghost-v1.11.2-0123456789ab.raw",
    ] {
        foreign_upload(pve, work.dir.path(), name);
    }
    work.edit(
        "    storage: local\n",
        &format!("    storage: local\n{VM_LINE}"),
    );
    work
}

fn with(versions: &[&str], files: &[String]) -> Vec<String> {
    files
        .iter()
        .filter(|f| versions.iter().any(|v| f.contains(&format!("-{v}-"))))
        .cloned()
        .collect()
}

const FOREIGN: [&str; 3] = [
    "loopback-ghost-v1.11.2-0123456789ab.raw",
    "other-cp-01-v1.11.2-0123456789ab.raw",
    "talos-v1.11.2-by-hand.raw",
];

fn ours(files: &[String]) -> Vec<String> {
    files
        .iter()
        .filter(|f| !FOREIGN.contains(&f.as_str()))
        .cloned()
        .collect()
}

#[test]
fn keep_1_leaves_what_machines_use_plus_the_newest_and_nothing_of_anyone_else() {
    let sim = factory();
    let pve = Pve::start(&[]);
    let work = three_versions(&pve, &sim);
    let before = imports(&pve);
    let all = ours(&before);
    assert_eq!(all.len(), 6, "{before:?}");
    assert_eq!(cache_entries(&work), 3);

    let o = prune(
        &work,
        &pve,
        &["--keep", "1", "--dry-run", "--output", "json"],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let v = json(&o);
    let planned = v["plan"]["delete"].as_array().unwrap();
    let mut volumes: Vec<String> = planned
        .iter()
        .filter(|p| p["item"]["kind"] == "proxmoxVolume")
        .map(|p| {
            assert_eq!(p["why"]["reason"], "olderThanNewest", "{p}");
            assert!(p["item"]["size"].as_u64().unwrap() > 0, "{p}");
            let volid = p["item"]["volid"].as_str().unwrap();
            volid.strip_prefix("local:import/").unwrap().to_owned()
        })
        .collect();
    volumes.sort();
    assert_eq!(volumes, with(&["v1.11.3"], &all), "{v}");
    let cache: Vec<&serde_json::Value> = planned
        .iter()
        .filter(|p| p["item"]["kind"] == "cacheEntry")
        .collect();
    assert_eq!(cache.len(), 2, "{v}");
    assert!(cache.iter().all(|p| p["why"]["reason"] == "unreferenced"));
    // The dry run deleted nothing.
    assert_eq!(imports(&pve), before);
    assert_eq!(cache_entries(&work), 3);

    let o = prune(&work, &pve, &["--keep", "1", "--poll-ms", "20"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let after = imports(&pve);
    assert_eq!(ours(&after), with(&["v1.11.2", "v1.11.5"], &all));
    for f in FOREIGN {
        assert!(after.iter().any(|a| a == f), "{f} was deleted");
    }
    assert_eq!(cache_entries(&work), 1);

    // Converged: nothing more to do.
    let o = prune(
        &work,
        &pve,
        &["--keep", "1", "--dry-run", "--output", "json"],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(json(&o)["plan"]["delete"], serde_json::json!([]));

    // cp-02 leaves the inventory (its VM stays): its newest upload goes,
    // what its VM was made from stays.
    work.edit(
        "  - name: cp-02\n    role: controlplane\n    address: 127.0.0.12\n",
        "",
    );
    let o = prune(
        &work,
        &pve,
        &["--keep", "1", "--dry-run", "--output", "json"],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let v = json(&o);
    let planned = v["plan"]["delete"].as_array().unwrap();
    assert_eq!(planned.len(), 1, "{v}");
    assert_eq!(planned[0]["why"]["reason"], "nodeGone", "{v}");
    let volid = planned[0]["item"]["volid"].as_str().unwrap();
    assert!(volid.contains("_cp-02-v1.11.5-"), "{volid}");
}

/// Killed with a volume's delete task in flight, then run again at once
/// (the task still running, the volume still listed): the rerun's delete
/// of it fails once the first task has freed it, which is done, not an
/// error. The end is the same as one whole run's.
#[test]
fn a_prune_killed_midway_converges_when_run_again() {
    let sim = factory();
    let pve = Pve::start(&["--task-delay-ms", "1500"]);
    let work = three_versions(&pve, &sim);
    let before = imports(&pve);
    assert_eq!(pve.idle_stats()["tasksRunning"], 0);
    let mut cmd = Run::with_config(&work.config, &["prune", "--keep", "0", "--poll-ms", "20"]);
    cmd.folders(work.dir.path()).proxmox(&pve);
    let mut child = cmd
        .into_command()
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while pve.stats()["tasksRunning"] == 0 {
        assert!(Instant::now() < deadline, "prune deleted nothing");
        assert!(child.try_wait().unwrap().is_none(), "prune ended first");
        std::thread::sleep(Duration::from_millis(10));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    assert_eq!(imports(&pve), before, "a volume went before its task ran");

    let o = prune(&work, &pve, &["--keep", "0", "--poll-ms", "20"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let after = imports(&pve);
    assert_eq!(ours(&after), with(&["v1.11.2"], &ours(&before)));
    assert_eq!(after.len(), 2 + FOREIGN.len(), "{after:?}");
}

/// Ctrl-C while a volume's delete task runs: that delete finishes, the
/// rest are left untouched and named, the run says how to finish (exit 3,
/// some deleted), and the rerun does.
#[test]
fn ctrl_c_during_a_prune_finishes_the_item_names_what_is_left_and_how_to_resume() {
    let sim = factory();
    let pve = Pve::start(&["--task-delay-ms", "1500"]);
    let work = three_versions(&pve, &sim);
    let before = imports(&pve);
    let mut cmd = Run::with_config(&work.config, &["prune", "--keep", "0", "--poll-ms", "20"]);
    cmd.folders(work.dir.path()).proxmox(&pve);
    let child = cmd
        .into_command()
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while pve.stats()["tasksRunning"] == 0 {
        assert!(Instant::now() < deadline, "prune deleted nothing");
        std::thread::sleep(Duration::from_millis(10));
    }
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
    let o = child.wait_with_output().unwrap();
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(
        err.contains("stopping after the item being deleted"),
        "{err}"
    );
    assert!(
        err.contains("interrupted: 1 deleted,") && err.contains("run `imgbuild prune` again"),
        "{err}"
    );
    let after_stop = imports(&pve);
    let left = err.lines().filter(|l| l.starts_with("left ")).count();
    assert!(left > 0, "{err}");
    assert_eq!(
        before.len() - after_stop.len(),
        1,
        "one deleted: {after_stop:?}"
    );

    let o = prune(&work, &pve, &["--keep", "0", "--poll-ms", "20"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let after = imports(&pve);
    assert_eq!(ours(&after), with(&["v1.11.2"], &ours(&before)));
    // The rerun deletes exactly what was left (volumes and cache entries).
    let deleted = text(&o.stdout)
        .lines()
        .filter(|l| l.starts_with("deleted "))
        .count();
    assert_eq!(deleted, left, "{}", text(&o.stdout));
}

/// `prune` beside a run that holds the cluster's state-dir lock (`up`
/// uploading): it waits, deleting nothing, says so, and prunes once the lock
/// is free; with a short `--lock-timeout` it gives up naming the holder.
#[test]
fn prune_waits_for_the_state_dir_lock_another_run_holds() {
    let sim = factory();
    let pve = Pve::start(&[]);
    let work = three_versions(&pve, &sim);
    let o = Run::with_config(&work.config, &["secrets", "gen"]).output();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let state = work.dir.path().join(".talos/loopback");
    assert!(state.join("secrets.yaml").is_file());
    // Held as `up` holds it: flock(2) on the lock file, the holder inside.
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(state.join(".imgbuild.lock"))
        .unwrap();
    lock.lock().unwrap();
    std::fs::write(
        state.join(".imgbuild.lock"),
        format!(
            r#"{{"pid":{},"command":"up","since":0}}"#,
            std::process::id()
        ) + "\n",
    )
    .unwrap();
    let before = imports(&pve);

    let o = prune(&work, &pve, &["--keep", "0", "--lock-timeout", "1s"]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("waiting up to 1s for the state dir lock"),
        "{err}"
    );
    assert!(
        err.contains("is in use") && err.contains("(imgbuild up)"),
        "{err}"
    );
    assert_eq!(imports(&pve), before, "deleted while the lock was held");

    let mut cmd = Run::with_config(&work.config, &["prune", "--keep", "0", "--poll-ms", "20"]);
    cmd.folders(work.dir.path()).proxmox(&pve);
    let child = cmd
        .into_command()
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(imports(&pve), before, "deleted while the lock was held");
    drop(lock);
    let o = child.wait_with_output().unwrap();
    let err = text(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("waiting up to 10m for the state dir lock"),
        "{err}"
    );
    assert_eq!(ours(&imports(&pve)), with(&["v1.11.2"], &ours(&before)));
}

/// A snapshot labelled and described as imgbuild's publish does, with
/// `extra` labels.
fn snapshot(hc: &Hc, version: &str, extra: serde_json::Value) -> u64 {
    static BUILDS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = BUILDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let build = server(hc, &format!("build-{n}"), "debian-13".into());
    let schematic = "ab".repeat(32);
    let mut labels = serde_json::json!({"os": "talos", "talos-version": version,
        "talos-schematic": &schematic[..32], "arch": "amd64", "image-sha256": "cd".repeat(16)});
    for (k, val) in extra.as_object().unwrap() {
        labels[k] = val.clone();
    }
    create_image(
        hc,
        build,
        &format!("talos {version} amd64 {schematic}"),
        labels,
    )
}

/// Until `path`'s `field` (a JSON pointer) is `want`.
fn wait_for(hc: &Hc, path: &str, field: &str, want: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, _, v) = hc.call("GET", path, None);
        if v.pointer(field).and_then(|s| s.as_str()) == Some(want) {
            return;
        }
        assert!(Instant::now() < deadline, "{path}: {v}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A server from the system image, once created (off).
fn server(hc: &Hc, name: &str, image: serde_json::Value) -> u64 {
    let (code, _, v) = hc.call(
        "POST",
        "/servers",
        Some(
            serde_json::json!({"name": name, "server_type": "cx23", "image": image,
            "start_after_create": false}),
        ),
    );
    assert_eq!(code, 201, "{v}");
    let id = v["server"]["id"].as_u64().unwrap();
    wait_for(hc, &format!("/servers/{id}"), "/server/status", "off");
    id
}

/// A snapshot of `server` with `description` and `labels`, once available.
fn create_image(hc: &Hc, server: u64, description: &str, labels: serde_json::Value) -> u64 {
    let (code, _, v) = hc.call(
        "POST",
        &format!("/servers/{server}/actions/create_image"),
        Some(serde_json::json!({"type": "snapshot", "labels": labels, "description": description})),
    );
    assert_eq!(code, 201, "{v}");
    let id = v["image"]["id"].as_u64().unwrap();
    wait_for(hc, &format!("/images/{id}"), "/image/status", "available");
    id
}

fn snapshot_ids(hc: &Hc) -> Vec<u64> {
    let (code, _, v) = hc.call("GET", "/images?type=snapshot", None);
    assert_eq!(code, 200, "{v}");
    let mut ids: Vec<u64> = v["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["id"].as_u64().unwrap())
        .collect();
    ids.sort();
    ids
}

#[test]
fn hetzner_snapshots_a_server_uses_and_the_newest_stay_and_anothers_survive() {
    let hc = Hc::start(&[]);
    let work = Work::new(
        &Inventory::loopback()
            .replace("platform: metal", "platform: hcloud")
            .hcloud("    location: fsn1\n    labels: {team: infra}\n"),
    );
    let team = serde_json::json!({"team": "infra", "imgbuild-cluster": "loopback"});
    let v1 = snapshot(&hc, VERSIONS[0], team.clone());
    let v2 = snapshot(&hc, VERSIONS[1], team.clone());
    let v3 = snapshot(&hc, VERSIONS[2], team.clone());
    // Someone else's: another team's labels, and one without imgbuild's
    // description.
    let other_team = snapshot(
        &hc,
        VERSIONS[0],
        serde_json::json!({"team": "web", "imgbuild-cluster": "loopback"}),
    );
    let by_hand_server = server(&hc, "by-hand", "debian-13".into());
    let by_hand = create_image(
        &hc,
        by_hand_server,
        "my talos",
        serde_json::json!({"os": "talos", "team": "infra"}),
    );
    // A machine boots v1.
    server(&hc, "loopback-cp-01", v1.into());

    let prune = |args: &[&str]| {
        Run::with_config(&work.config, args)
            .arg("--no-cache")
            .hcloud(&hc)
            .output()
    };
    let o = prune(&["prune", "--keep", "1", "--dry-run", "--output", "json"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let v = json(&o);
    let planned: Vec<u64> = v["plan"]["delete"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["item"]["id"].as_u64().unwrap())
        .collect();
    assert_eq!(planned, [v2], "{v}");
    let all = snapshot_ids(&hc);
    assert_eq!(all.len(), 5);

    let o = prune(&["prune", "--keep", "1"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let mut left = vec![v1, v3, other_team, by_hand];
    left.sort();
    assert_eq!(snapshot_ids(&hc), left);
}

/// `imgbuild prune ARGS` for the cluster of `work` on the Hetzner simulator.
fn prune_hcloud(work: &Work, hc: &Hc, args: &[&str]) -> Output {
    Run::with_config(&work.config, &["prune"])
        .args(args)
        .arg("--no-cache")
        .hcloud(hc)
        .output()
}

#[test]
fn two_clusters_without_extra_labels_each_prune_only_their_own_snapshots() {
    let hc = Hc::start(&[]);
    // Names that overlap as text: one is the other's prefix.
    let cluster = |name: &str| {
        Work::new(
            &Inventory::loopback()
                .replace("name: loopback", &format!("name: {name}"))
                .replace("platform: metal", "platform: hcloud")
                .hcloud("    location: fsn1\n"),
        )
    };
    let (a, ab) = (cluster("lab"), cluster("lab-b"));
    let of = |name: &str| serde_json::json!({"imgbuild-cluster": name});
    let a_old = snapshot(&hc, VERSIONS[0], of("lab"));
    let a_new = snapshot(&hc, VERSIONS[1], of("lab"));
    let ab_old = snapshot(&hc, VERSIONS[0], of("lab-b"));
    let ab_new = snapshot(&hc, VERSIONS[1], of("lab-b"));
    // Published before snapshots carried a cluster label: anybody's.
    let unlabelled = snapshot(&hc, VERSIONS[0], serde_json::json!({}));

    let o = prune_hcloud(&a, &hc, &["--keep", "1", "--dry-run", "--output", "json"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let v = json(&o);
    let ids = |list: &serde_json::Value, at: &str| -> Vec<u64> {
        list.as_array()
            .unwrap_or_else(|| panic!("{at}: {v}"))
            .iter()
            .map(|p| p.pointer(at).and_then(|i| i.as_u64()).unwrap())
            .collect()
    };
    assert_eq!(ids(&v["plan"]["delete"], "/item/id"), [a_old], "{v}");
    assert_eq!(ids(&v["plan"]["unowned"], "/id"), [unlabelled], "{v}");

    let o = prune_hcloud(&a, &hc, &["--keep", "1"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let mut left = vec![a_new, ab_old, ab_new, unlabelled];
    left.sort();
    assert_eq!(snapshot_ids(&hc), left, "lab pruned only its own");

    let o = prune_hcloud(&ab, &hc, &["--keep", "1"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let mut left = vec![a_new, ab_new, unlabelled];
    left.sort();
    assert_eq!(snapshot_ids(&hc), left, "lab-b pruned only its own");

    // With nothing kept, each still deletes only its own: the unlabelled
    // one stays whoever prunes.
    for work in [&a, &ab] {
        let o = prune_hcloud(work, &hc, &["--keep", "0"]);
        assert!(o.status.success(), "{}", text(&o.stderr));
    }
    assert_eq!(snapshot_ids(&hc), [unlabelled]);
}
