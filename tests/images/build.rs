//! End to end: `imgbuild build`/`node`/`verify` against the factory
//! simulator on loopback, both routes, and every way a download goes wrong.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use crate::common;
use common::inventory::Inventory;
use common::otherfs::other_fs;
use common::run::Work;
use common::sims::Sim;
use common::{root, text};

const LOOPBACK: &str = "examples/loopback/cluster.yaml";

/// Every file and folder under the cache's images/ (the lock file of a
/// download in progress included).
fn cache_entries(work: &Work) -> Vec<PathBuf> {
    fn walk(p: &Path, acc: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(p).into_iter().flatten().flatten() {
            let path = e.path();
            acc.push(path.clone());
            if path.is_dir() {
                walk(&path, acc);
            }
        }
    }
    let mut acc = Vec::new();
    walk(&work.cache().join("images"), &mut acc);
    acc
}

fn out_images(work: &Work) -> Vec<PathBuf> {
    std::fs::read_dir(work.out())
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "raw" || e == "qcow2"))
        .collect()
}

fn key10_address(image: &Path) -> String {
    let o = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
        .args(["inspect", image.to_str().unwrap(), "--output", "json"])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    v["meta"]["tags"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["key"] == 10)
        .map(|t| t["network"]["addresses"][0].as_str().unwrap().to_owned())
        .unwrap_or_default()
}

fn build_json(o: &Output) -> serde_json::Value {
    assert!(o.status.success(), "{}{}", text(&o.stdout), text(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

fn check_built(work: &Work, v: &serde_json::Value, nodes: &[(&str, &str)]) {
    let images = v["images"].as_array().unwrap();
    assert_eq!(images.len(), nodes.len());
    for (node, addr) in nodes {
        let img = images.iter().find(|i| i["node"] == *node).unwrap();
        let path = PathBuf::from(img["file"].as_str().unwrap());
        assert_eq!(key10_address(&path), *addr, "{node}");
    }
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(work.out().join("manifest.json")).unwrap()).unwrap();
    for (node, _) in nodes {
        let m = &manifest["images"][node];
        assert_eq!(m["platform"], "metal", "{node}");
        assert_eq!(m["arch"], "amd64", "{node}");
        let path = work.out().join(m["path"].as_str().unwrap());
        let sha = Command::new("sha256sum").arg(&path).output().unwrap();
        assert_eq!(
            text(&sha.stdout).split(' ').next().unwrap(),
            m["sha256"].as_str().unwrap()
        );
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            m["size"].as_u64().unwrap()
        );
    }
}

const ALL: &[(&str, &str)] = &[
    ("cp-01", "127.0.0.11/8"),
    ("cp-02", "127.0.0.12/8"),
    ("cp-03", "127.0.0.13/8"),
    ("worker-01", "127.0.0.21/8"),
    ("worker-02", "127.0.0.22/8"),
];

/// Every node's machine config names an installer the factory can serve:
/// its registry answers the installer's manifest (it knows the schematic
/// and the version) for each node, as a node's upgrade would pull it.
fn installers_resolve(work: &Work, sim: &Sim) {
    let state = work.dir.path().join("state");
    // `config` renders with the cluster's secrets, made first.
    if !state.join("secrets.yaml").exists() {
        let o = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
            .args(["--config", LOOPBACK, "secrets", "gen", "--state-dir"])
            .arg(&state)
            .current_dir(root())
            .env_remove("IMGBUILD_CONFIG")
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", text(&o.stderr));
    }
    for (node, _) in ALL {
        let o = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
            .args(["--config", LOOPBACK, "config", node, "--factory", &sim.url])
            .arg("--state-dir")
            .arg(&state)
            .current_dir(root())
            .env_remove("IMGBUILD_CONFIG")
            .output()
            .unwrap();
        assert!(o.status.success(), "{node}: {}", text(&o.stderr));
        let config = text(&o.stdout);
        let image = config
            .lines()
            .find_map(|l| {
                l.trim()
                    .strip_prefix("image: ")
                    .filter(|i| i.contains("installer"))
            })
            .unwrap_or_else(|| panic!("{node}: no installer in\n{config}"));
        let host = sim.url.trim_start_matches("http://");
        let rest = image
            .strip_prefix(&format!("{host}/"))
            .unwrap_or_else(|| panic!("{node}: {image} is not on {host}"));
        let (repo, tag) = rest.rsplit_once(':').unwrap();
        let o = Command::new("curl")
            .args(["-s", "-o", "/dev/null", "-w", "%{http_code}"])
            .arg(format!("{}/v2/{repo}/manifests/{tag}", sim.url))
            .output()
            .unwrap();
        assert_eq!(
            text(&o.stdout),
            "200",
            "{node}: the factory cannot serve {image}"
        );
    }
}

#[test]
fn patch_route_builds_every_node_from_one_download_and_reruns_do_nothing() {
    let sim = Sim::start(&[]);
    let work = Work::on(LOOPBACK);
    let v = build_json(&work.imgbuild(&sim, &["build", "--output", "json"]).output());
    check_built(&work, &v, ALL);
    assert_eq!(sim.image_gets(), 1, "one base image for five nodes");
    let again = work.imgbuild(&sim, &["build"]).output();
    assert!(
        text(&again.stdout).contains("nothing to do"),
        "{}",
        text(&again.stdout)
    );
    assert_eq!(sim.image_gets(), 1, "a re-run downloads nothing");
    installers_resolve(&work, &sim);
    let o = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
        .args(["verify", "--out-dir"])
        .arg(work.out())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stdout));
    assert_eq!(text(&o.stdout).matches(" ok ").count(), 5);
}

#[test]
fn factory_route_gets_each_nodes_own_image() {
    let sim = Sim::start(&[]);
    let work = Work::on(LOOPBACK);
    let v = build_json(
        &work
            .imgbuild(&sim, &["build", "--route", "factory", "--output", "json"])
            .output(),
    );
    check_built(&work, &v, ALL);
    assert_eq!(sim.image_gets(), 5, "one factory image per node");
    installers_resolve(&work, &sim);
}

#[test]
fn verify_catches_a_changed_image() {
    let sim = Sim::start(&[]);
    let work = Work::on(LOOPBACK);
    build_json(
        &work
            .imgbuild(&sim, &["node", "cp-01", "--output", "json"])
            .output(),
    );
    let img = work.out().join("cp-01.raw");
    {
        use std::os::unix::fs::FileExt;
        std::fs::File::options()
            .write(true)
            .open(&img)
            .unwrap()
            .write_all_at(b"X", 4096)
            .unwrap();
    }
    let o = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
        .args(["verify", "--out-dir"])
        .arg(work.out())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o.stdout).contains("cp-01") && text(&o.stdout).contains("MISMATCH"),
        "{}",
        text(&o.stdout)
    );
}

/// A failing build: names the URL and the problem; nothing in cache or out.
fn fails_cleanly(misbehave: &[&str], extra: &[&str], want: &[&str]) {
    let sim = Sim::start(misbehave);
    let work = Work::on(LOOPBACK);
    let mut args = vec!["node", "cp-01"];
    args.extend_from_slice(extra);
    let o = work.imgbuild(&sim, &args).output();
    assert_eq!(
        o.status.code(),
        Some(1),
        "{misbehave:?}: {}",
        text(&o.stdout)
    );
    let err = text(&o.stderr);
    assert!(
        err.contains(&format!("{}/image/", sim.url)),
        "{misbehave:?}: no URL in {err}"
    );
    for w in want {
        assert!(err.contains(w), "{misbehave:?}: want {w:?} in {err}");
    }
    assert_eq!(
        cache_entries(&work),
        Vec::<PathBuf>::new(),
        "{misbehave:?}: cache not clean"
    );
    assert_eq!(
        out_images(&work),
        Vec::<PathBuf>::new(),
        "{misbehave:?}: out not clean"
    );
    // Every node failed: no manifest (an empty one would say "built").
    assert!(
        !work.out().join("manifest.json").exists(),
        "{misbehave:?}: a manifest was written"
    );
}

#[test]
fn a_9_byte_not_found_with_status_200_is_refused() {
    fails_cleanly(
        &["not-found-200"],
        &[],
        &["expected zstd data, got 9 bytes of text: \"Not Found\""],
    );
}

#[test]
fn an_html_error_page_is_refused() {
    fails_cleanly(
        &["html-200"],
        &[],
        &["expected zstd data, got an HTML page"],
    );
}

#[test]
fn a_body_that_keeps_getting_cut_fails_after_retries() {
    fails_cleanly(
        &["truncate"],
        &["--retries", "2"],
        &["retry 2 for", "the body broke off after"],
    );
}

#[test]
fn a_wrong_content_length_is_refused_without_retrying() {
    // The server says the body is complete after half the stream: the data
    // is corrupt, not the transfer, so there is nothing to retry.
    fails_cleanly(
        &["wrong-length"],
        &[],
        &["expected a valid zstd stream, got corrupt data after"],
    );
}

#[test]
fn persistent_5xx_fails_with_the_status() {
    fails_cleanly(
        &["5xx"],
        &["--retries", "2"],
        &["HTTP 503: upstream unavailable"],
    );
}

/// Misbehaves at first, then works: the build succeeds after retrying.
fn recovers(misbehave: &[&str], want_stderr: &str) {
    let sim = Sim::start(misbehave);
    let work = Work::on(LOOPBACK);
    let o = work.imgbuild(&sim, &["node", "cp-02"]).output();
    assert!(o.status.success(), "{misbehave:?}: {}", text(&o.stderr));
    assert!(
        text(&o.stderr).contains(want_stderr),
        "{misbehave:?}: {}",
        text(&o.stderr)
    );
    assert_eq!(key10_address(&work.out().join("cp-02.raw")), "127.0.0.12/8");
}

#[test]
fn a_factory_answering_503_twice_then_201_to_a_schematic_post_succeeds() {
    recovers(&["schematics-503:2"], "");
    // Always 503: the retries run out and the error names the request.
    let sim = Sim::start(&["schematics-503"]);
    let o = Work::on(LOOPBACK)
        .imgbuild(&sim, &["node", "cp-01", "--retries", "2"])
        .output();
    assert_eq!(o.status.code(), Some(1));
    let err = text(&o.stderr);
    let want = format!("POST {}/schematics: HTTP 503: service unavailable", sim.url);
    assert!(err.contains(&want), "want {want:?} in {err}");
}

#[test]
fn a_5xx_then_success_is_retried() {
    recovers(&["5xx:2"], "retry 2 for");
}

#[test]
fn a_cut_body_is_resumed_with_range_where_it_stopped() {
    // 6 MiB of incompressible data, so the cut lands mid-stream.
    let sim = Sim::start_with(&["truncate:1"], 6, &[]);
    let work = Work::on(LOOPBACK);
    let o = work.imgbuild(&sim, &["node", "cp-02"]).output();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    assert!(err.contains("resuming") && err.contains("at byte"), "{err}");
    assert!(
        !err.contains("retry 1 for"),
        "resumed, not restarted: {err}"
    );
    assert_eq!(sim.image_gets(), 2, "one GET and one ranged GET");
    assert_eq!(key10_address(&work.out().join("cp-02.raw")), "127.0.0.12/8");
}

#[test]
fn a_redirect_to_another_loopback_host_is_followed() {
    recovers(&["redirect:1"], "downloaded");
}

#[test]
fn a_slow_stream_completes() {
    recovers(&["slow"], "downloaded");
}

#[test]
fn a_factory_that_disagrees_on_the_id_is_an_error_naming_both() {
    let sim = Sim::start(&["wrong-id:1"]);
    let work = Work::on(LOOPBACK);
    let o = work.imgbuild(&sim, &["node", "cp-01"]).output();
    assert_eq!(o.status.code(), Some(1));
    let err = text(&o.stderr);
    assert!(
        err.contains("the factory says the schematic ID is") && err.contains("hashes to"),
        "{err}"
    );
    assert!(err.contains("node cp-01"), "{err}");
}

#[test]
fn an_extension_the_factory_lacks_is_named_before_any_download() {
    let sim = Sim::start_with(&[], 0, &["--extensions", "siderolabs/qemu-guest-agent"]);
    let work = Work::on(LOOPBACK);
    let o = work.imgbuild(&sim, &["build"]).output();
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o.stderr)
            .contains("extension siderolabs/tailscale is not available for Talos v1.11.2"),
        "{}",
        text(&o.stderr)
    );
    assert_eq!(sim.image_gets(), 0);
}

#[test]
fn sigkill_mid_download_leaves_no_cache_entry_and_the_next_run_succeeds() {
    let sim = Sim::start_with(&["slow:1"], 6, &[]);
    let work = Work::on(LOOPBACK);
    let mut child = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
        .args([
            "--config",
            LOOPBACK,
            "node",
            "cp-01",
            "--factory",
            &sim.url,
            "--out-dir",
        ])
        .arg(work.out())
        .arg("--cache-dir")
        .arg(work.cache())
        .current_dir(root())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Wait until the download's temp file exists, then kill.
    let seen = (0..3000).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(5));
        cache_entries(&work)
            .iter()
            .any(|p| p.to_string_lossy().contains(".tmp-"))
    });
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(seen, "the download never started");
    assert!(
        !cache_entries(&work)
            .iter()
            .any(|p| p.ends_with("artifact.json")),
        "a killed download left a cache entry: {:?}",
        cache_entries(&work)
    );
    assert!(out_images(&work).is_empty());
    let o = work.imgbuild(&sim, &["node", "cp-01"]).output();
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(key10_address(&work.out().join("cp-01.raw")), "127.0.0.11/8");
    assert!(
        !cache_entries(&work)
            .iter()
            .any(|p| p.to_string_lossy().contains(".tmp-")),
        "debris: {:?}",
        cache_entries(&work)
    );
}

#[test]
fn diff_finds_the_patch_route_image_identical_to_the_factorys_own() {
    let sim = Sim::start(&[]);
    let work = Work::on(LOOPBACK);
    build_json(
        &work
            .imgbuild(&sim, &["node", "worker-01", "--output", "json"])
            .output(),
    );
    let patched = work.out().join("worker-01.raw");
    let factory_dir = work.dir.path().join("factory");
    let o = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
        .args([
            "--config",
            LOOPBACK,
            "node",
            "worker-01",
            "--route",
            "factory",
            "--factory",
            &sim.url,
            "--out-dir",
        ])
        .arg(&factory_dir)
        .arg("--cache-dir")
        .arg(work.cache())
        .current_dir(root())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let diff = |a: &Path, b: &Path| {
        Command::new(env!("CARGO_BIN_EXE_imgbuild"))
            .args(["diff", "--output", "json"])
            .args([a, b])
            .output()
            .unwrap()
    };
    let o = diff(&patched, &factory_dir.join("worker-01.raw"));
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stdout));
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["identical"],
        true
    );

    // The same disk as qcow2 is still identical; another node differs in key 10 only.
    let q = work.dir.path().join("w.qcow2");
    assert!(
        Command::new("qemu-img")
            .args(["convert", "-O", "qcow2"])
            .arg(&patched)
            .arg(&q)
            .status()
            .unwrap()
            .success()
    );
    assert_eq!(diff(&patched, &q).status.code(), Some(0));
    build_json(
        &work
            .imgbuild(&sim, &["node", "worker-02", "--output", "json"])
            .output(),
    );
    let o = diff(&patched, &work.out().join("worker-02.raw"));
    assert_eq!(o.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["diff"]["meta"], serde_json::json!(["key 10 differs"]));
    assert_eq!(v["diff"]["contents"], serde_json::json!([]));
}

/// A node image that needs no META edit (hcloud ignores key 10) is the
/// factory's image byte for byte, although Talos stored its ADV tags out of
/// ascending order (17, then 12). On metal, where key 10 is written, the
/// simulator's factory orders the tags otherwise: equivalent, not identical.
#[test]
fn an_image_that_needs_no_edit_is_the_factorys_byte_for_byte() {
    let sim = Sim::start_on("two-tags.raw");
    let dir = tempfile::tempdir().unwrap();
    let hcloud = Inventory::loopback()
        .replace("platform: metal", "platform: hcloud")
        .write_to(&dir.path().join("hcloud.yaml"));
    let build = |config: &Path, route: &str| {
        let out = dir.path().join(format!(
            "{}-{route}",
            config.file_stem().unwrap().to_str().unwrap()
        ));
        let o = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
            .arg("--config")
            .arg(config)
            .args(["node", "worker-01", "--route", route, "--factory", &sim.url])
            .arg("--out-dir")
            .arg(&out)
            .arg("--cache-dir")
            .arg(dir.path().join("cache"))
            .output()
            .unwrap();
        assert!(o.status.success(), "{route}: {}", text(&o.stderr));
        out.join("worker-01.raw")
    };
    let diff = |a: &Path, b: &Path| {
        Command::new(env!("CARGO_BIN_EXE_imgbuild"))
            .arg("diff")
            .args([a, b])
            .output()
            .unwrap()
    };
    let cmp = |a: &Path, b: &Path| Command::new("cmp").args([a, b]).output().unwrap().status;

    let (patched, factory) = (build(&hcloud, "patch"), build(&hcloud, "factory"));
    assert!(cmp(&patched, &factory).success());
    let o = diff(&patched, &factory);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stdout));
    assert_eq!(text(&o.stdout), "identical: the same bytes\n");

    let metal = root().join(LOOPBACK);
    let (patched, factory) = (build(&metal, "patch"), build(&metal, "factory"));
    assert!(!cmp(&patched, &factory).success());
    let o = diff(&patched, &factory);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    assert_eq!(
        text(&o.stdout),
        "same META tags and partition contents, different bytes\n"
    );
}

#[test]
fn fetch_honours_a_pinned_digest() {
    let sim = Sim::start(&[]);
    let work = Work::on(LOOPBACK);
    build_json(
        &work
            .imgbuild(&sim, &["node", "cp-01", "--output", "json"])
            .output(),
    );
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(work.out().join("manifest.json")).unwrap()).unwrap();
    let url = manifest["images"]["cp-01"]["sourceUrl"]
        .as_str()
        .unwrap()
        .to_owned();
    let served = Command::new("curl")
        .args(["-s", &url])
        .output()
        .unwrap()
        .stdout;
    let sha = Command::new("sha256sum")
        .arg("-")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().unwrap().write_all(&served)?;
            c.wait_with_output()
        })
        .unwrap();
    let good = text(&sha.stdout).split(' ').next().unwrap().to_owned();
    let fresh = work.dir.path().join("fresh-cache");
    let fetch = |pin: &str| {
        Command::new(env!("CARGO_BIN_EXE_imgbuild"))
            .args([
                "fetch",
                &url,
                "--pin",
                pin,
                "--output",
                "json",
                "--cache-dir",
            ])
            .arg(&fresh)
            .output()
            .unwrap()
    };
    let bad = fetch(&format!("sha256:{}", "0".repeat(64)));
    assert_eq!(bad.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&bad.stdout).unwrap();
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains(&format!("but the body hashes to {good}")),
        "{v}"
    );
    let ok = fetch(&format!("sha256:{good}"));
    let v: serde_json::Value = serde_json::from_slice(&ok.stdout).unwrap();
    assert_eq!(v["cached"], false, "{v}");
    assert_eq!(v["artifact"]["served_sha256"], good.as_str());
    let again: serde_json::Value =
        serde_json::from_slice(&fetch(&format!("sha256:{good}")).stdout).unwrap();
    assert_eq!(again["cached"], true);
}

#[test]
fn qcow2_format_builds_by_both_routes() {
    let sim = Sim::start(&[]);
    let work = Work::on(LOOPBACK);
    let inv = work.dir.path().join("qcow2.yaml");
    Inventory::loopback()
        .replace("format: raw", "format: qcow2")
        .write_to(&inv);
    let build = |route: &str, out: &str| {
        Command::new(env!("CARGO_BIN_EXE_imgbuild"))
            .args([
                "--config",
                inv.to_str().unwrap(),
                "build",
                "cp-03",
                "--route",
                route,
            ])
            .args(["--factory", &sim.url, "--output", "json", "--out-dir"])
            .arg(work.dir.path().join(out))
            .arg("--cache-dir")
            .arg(work.cache())
            .output()
            .unwrap()
    };
    for (route, out) in [("patch", "p"), ("factory", "f")] {
        let v = build_json(&build(route, out));
        let path = PathBuf::from(v["images"][0]["file"].as_str().unwrap());
        assert!(path.to_string_lossy().ends_with("cp-03.qcow2"), "{path:?}");
        let check = Command::new("qemu-img")
            .arg("check")
            .arg(&path)
            .output()
            .unwrap();
        assert!(check.status.success(), "{route}: {}", text(&check.stdout));
        assert_eq!(key10_address(&path), "127.0.0.13/8", "{route}");
    }
    let o = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
        .arg("diff")
        .arg(work.dir.path().join("p/cp-03.qcow2"))
        .arg(work.dir.path().join("f/cp-03.qcow2"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stdout));
}

#[test]
fn bytes_after_the_compressed_image_are_refused() {
    // zstd reads them as a broken next frame.
    fails_cleanly(
        &["trailing"],
        &[],
        &["got corrupt data", "Unknown frame descriptor"],
    );
    // xz stops at its stream's end; the rest of the body is read and refused.
    fetch_refused(
        &["trailing"],
        "raw.xz",
        "expected nothing after the compressed image, got 16 more bytes",
    );
}

/// `imgbuild fetch` of the empty schematic's image in `ext` from a simulator
/// misbehaving as told: exit 1, `want` after the URL, nothing in the cache.
fn fetch_refused(misbehave: &[&str], ext: &str, want: &str) {
    let sim = Sim::start(misbehave);
    let work = Work::on(LOOPBACK);
    let url = format!("{}.{ext}", empty_schematic_url(&sim));
    let o = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
        .args(["fetch", &url, "--cache-dir"])
        .arg(work.cache())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let err = text(&o.stderr);
    assert!(err.contains(&format!("{url}: {want}")), "{err}");
    assert_eq!(cache_entries(&work), Vec::<PathBuf>::new());
}

/// Registers an empty schematic with the simulator; returns its image URL stem.
fn empty_schematic_url(sim: &Sim) -> String {
    let post = Command::new("curl")
        .args(["-s", "-X", "POST", "--data-binary", "customization: {}"])
        .arg(format!("{}/schematics", sim.url))
        .output()
        .unwrap();
    let id: serde_json::Value = serde_json::from_slice(&post.stdout).unwrap();
    format!(
        "{}/image/{}/v1.11.2/metal-amd64",
        sim.url,
        id["id"].as_str().unwrap()
    )
}

#[test]
fn every_wire_format_decodes_to_the_same_verified_image() {
    let sim = Sim::start(&[]);
    let work = Work::on(LOOPBACK);
    let stem = empty_schematic_url(&sim);
    let mut hashes = Vec::new();
    for ext in ["raw", "raw.zst", "raw.xz", "raw.gz"] {
        let o = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
            .args([
                "fetch",
                &format!("{stem}.{ext}"),
                "--output",
                "json",
                "--cache-dir",
            ])
            .arg(work.cache())
            .output()
            .unwrap();
        assert!(o.status.success(), "{ext}: {}", text(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        hashes.push(v["artifact"]["sha256"].as_str().unwrap().to_owned());
    }
    hashes.dedup();
    assert_eq!(hashes.len(), 1, "formats decoded differently: {hashes:?}");
}

#[test]
fn gzip_with_trailing_bytes_is_refused() {
    fetch_refused(
        &["trailing"],
        "raw.gz",
        "expected a valid gzip stream, got corrupt data",
    );
}

#[test]
fn progress_is_plain_lines_off_a_terminal_and_nothing_with_quiet() {
    let sim = Sim::start(&[]);
    let work = Work::on(LOOPBACK);
    let quiet = work.imgbuild(&sim, &["node", "cp-01", "--quiet"]).output();
    assert!(quiet.status.success(), "{}", text(&quiet.stderr));
    assert_eq!(text(&quiet.stderr), "", "--quiet must print no progress");
    let other = Work::on(LOOPBACK);
    let loud = other.imgbuild(&sim, &["node", "cp-01"]).output();
    let err = text(&loud.stderr);
    assert!(
        err.contains("downloading ") && err.contains("downloaded "),
        "{err}"
    );
    assert!(
        !err.contains('\r'),
        "no bar redraws off a terminal: {err:?}"
    );
}

/// Runs imgbuild from `cwd` on the loopback inventory (by absolute path)
/// against `sim`; `args` carry `--out-dir` and `--cache-dir` as the test
/// wants them spelled.
fn imgbuild_in(cwd: &Path, sim: &Sim, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_imgbuild"))
        .arg("--config")
        .arg(root().join(LOOPBACK))
        .args(args)
        .args(["--factory", &sim.url, "--retry-delay-ms", "10"])
        .current_dir(cwd)
        .env_remove("IMGBUILD_CONFIG")
        .output()
        .unwrap()
}

/// `imgbuild verify` from `cwd`.
fn verify_in(cwd: &Path, out_dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_imgbuild"))
        .args(["verify", "--out-dir"])
        .arg(out_dir)
        .current_dir(cwd)
        .output()
        .unwrap()
}

fn allocated(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().blocks() * 512
}

#[test]
fn both_routes_build_across_filesystems_and_the_images_stay_sparse() {
    let sim = Sim::start(&[]);
    let disk = tempfile::tempdir().unwrap();
    let Some(mem) = other_fs(disk.path()) else {
        return;
    };
    // Cache on tmpfs with out/ on disk, then the reverse.
    for (cache_fs, out_fs) in [(mem.path(), disk.path()), (disk.path(), mem.path())] {
        for route in ["patch", "factory"] {
            let cache = cache_fs.join(format!("cache-{route}"));
            let out = out_fs.join(format!("out-{route}"));
            let o = imgbuild_in(
                disk.path(),
                &sim,
                &[
                    "build",
                    "cp-01",
                    "worker-02",
                    "--route",
                    route,
                    "--out-dir",
                    out.to_str().unwrap(),
                    "--cache-dir",
                    cache.to_str().unwrap(),
                ],
            );
            assert!(o.status.success(), "{route}: {}", text(&o.stderr));
            assert_eq!(key10_address(&out.join("cp-01.raw")), "127.0.0.11/8");
            assert_eq!(key10_address(&out.join("worker-02.raw")), "127.0.0.22/8");
            assert!(verify_in(disk.path(), &out).status.success());
            for node in ["cp-01", "worker-02"] {
                let image = out.join(format!("{node}.raw"));
                let size = std::fs::metadata(&image).unwrap().len();
                // The fixture is 32 MiB with about 0.5 MiB of data, META 0.5 MiB more.
                assert_eq!(size, 32 << 20);
                assert!(
                    allocated(&image) < 2 << 20,
                    "{route} {}: {} bytes allocated of {size}",
                    image.display(),
                    allocated(&image)
                );
            }
            std::fs::remove_dir_all(&cache).unwrap();
            std::fs::remove_dir_all(&out).unwrap();
        }
    }
}

#[test]
fn verify_works_from_another_directory_with_an_absolute_out_dir() {
    let sim = Sim::start(&[]);
    let work = Work::on(LOOPBACK);
    build_json(&work.imgbuild(&sim, &["build", "--output", "json"]).output());
    let elsewhere = tempfile::tempdir().unwrap();
    let o = verify_in(elsewhere.path(), &work.out());
    assert!(o.status.success(), "{}{}", text(&o.stdout), text(&o.stderr));
    assert_eq!(text(&o.stdout).matches(" ok ").count(), 5);
}

#[test]
fn out_dot_out_and_the_absolute_path_are_the_same_images() {
    let sim = Sim::start(&[]);
    let work = Work::on(LOOPBACK);
    let cwd = work.dir.path();
    let cache = work.cache();
    let build = |out: &str| {
        imgbuild_in(
            cwd,
            &sim,
            &[
                "build",
                "--out-dir",
                out,
                "--cache-dir",
                cache.to_str().unwrap(),
            ],
        )
    };
    let first = build("out");
    assert!(first.status.success(), "{}", text(&first.stderr));
    assert_eq!(text(&first.stdout).matches("(built)").count(), 5);
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(work.out().join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["images"]["cp-01"]["path"], "cp-01.raw");
    let absolute = work.out();
    for out in ["./out", absolute.to_str().unwrap(), "out/"] {
        let again = build(out);
        assert!(again.status.success(), "{out}: {}", text(&again.stderr));
        assert!(
            text(&again.stdout).contains("nothing to do"),
            "{out}: {}",
            text(&again.stdout)
        );
        let o = verify_in(cwd, Path::new(out));
        assert!(o.status.success(), "{out}: {}", text(&o.stdout));
        assert_eq!(text(&o.stdout).matches(" ok ").count(), 5, "{out}");
    }
    assert_eq!(sim.image_gets(), 1, "nothing was built twice");
}

#[test]
fn a_build_where_two_nodes_fail_names_both_and_keeps_the_others() {
    // The factory's first two image downloads are a 9-byte "Not Found".
    let sim = Sim::start(&["not-found-200:2"]);
    let work = Work::on(LOOPBACK);
    let o = work
        .imgbuild(
            &sim,
            &[
                "build",
                "--route",
                "factory",
                "--jobs",
                "1",
                "--retries",
                "0",
            ],
        )
        .output();
    assert_eq!(o.status.code(), Some(3), "partial: {}", text(&o.stdout));
    let err = text(&o.stderr);
    let failed: Vec<&str> = err
        .lines()
        .filter_map(|l| l.strip_prefix("error: node "))
        .map(|l| l.split(':').next().unwrap())
        .collect();
    // One job: the nodes are downloaded in inventory order.
    assert_eq!(failed, ["cp-01", "cp-02"], "{err}");
    assert!(
        err.contains("expected zstd data, got 9 bytes of text"),
        "{err}"
    );
    assert!(
        err.contains("error: 2 of 5 nodes failed: cp-01, cp-02"),
        "{err}"
    );
    // The other three are built, on disk and in the manifest.
    let out = text(&o.stdout);
    for node in ["cp-03", "worker-01", "worker-02"] {
        assert!(out.contains(node), "{out}");
    }
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(work.out().join("manifest.json")).unwrap()).unwrap();
    let mut recorded: Vec<&String> = manifest["images"].as_object().unwrap().keys().collect();
    recorded.sort();
    assert_eq!(recorded, ["cp-03", "worker-01", "worker-02"]);
    assert_eq!(out_images(&work).len(), 3);
    // A re-run builds only the two that failed.
    let v = build_json(
        &work
            .imgbuild(&sim, &["build", "--route", "factory", "--output", "json"])
            .output(),
    );
    let built: Vec<&str> = v["images"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["built"] == true)
        .map(|i| i["node"].as_str().unwrap())
        .collect();
    assert_eq!(built, ["cp-01", "cp-02"]);
    assert_eq!(v["failed"], serde_json::json!([]));
}

#[test]
fn json_lists_every_failed_node() {
    let sim = Sim::start(&["not-found-200:2"]);
    let work = Work::on(LOOPBACK);
    let o = work
        .imgbuild(
            &sim,
            &[
                "build",
                "--route",
                "factory",
                "--jobs",
                "3",
                "--retries",
                "0",
                "--output",
                "json",
            ],
        )
        .output();
    assert_eq!(o.status.code(), Some(3), "partial: {}", text(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let failed = v["failed"].as_array().unwrap();
    assert_eq!(failed.len(), 2, "{v}");
    for f in failed {
        assert!(
            f["error"].as_str().unwrap().contains("got 9 bytes of text"),
            "{f}"
        );
    }
    assert_eq!(v["images"].as_array().unwrap().len(), 3, "{v}");
    let mut names: Vec<&str> = failed
        .iter()
        .chain(v["images"].as_array().unwrap())
        .map(|i| i["node"].as_str().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["cp-01", "cp-02", "cp-03", "worker-01", "worker-02"]);
}

#[test]
fn a_damaged_manifest_is_an_error_naming_it() {
    let sim = Sim::start(&[]);
    let work = Work::on(LOOPBACK);
    std::fs::create_dir_all(work.out()).unwrap();
    let manifest = work.out().join("manifest.json");
    for damage in [
        "{\"images\": {\"cp-01\": ".to_owned(),
        serde_json::json!({"images": {"cp-01": {"node": "cp-01"}}}).to_string(),
        std::fs::read_to_string(root().join("Cargo.toml")).unwrap(),
    ] {
        std::fs::write(&manifest, &damage).unwrap();
        for o in [
            work.imgbuild(&sim, &["build"]).output(),
            verify_in(&root(), &work.out()),
        ] {
            assert_eq!(o.status.code(), Some(1), "{}", text(&o.stdout));
            let err = text(&o.stderr);
            assert!(
                err.contains(&format!(
                    "{}: not a manifest imgbuild can read",
                    manifest.display()
                )),
                "{err}"
            );
            assert!(!err.contains("panicked"), "{err}");
        }
        assert_eq!(std::fs::read_to_string(&manifest).unwrap(), damage);
    }
    assert_eq!(sim.image_gets(), 0);
}
