//! A tampered state dir and concurrent runs (issue 28), tried as an
//! attacker or an unlucky operator would: state files that are FIFOs or
//! symlinks to `/dev/zero`, a damaged talosconfig holding the admin key,
//! two runs changing the same nodes at once, and a lock holder killed by
//! SIGKILL. Each case runs the real binary and checks what
//! `tests/cli/hostile_input.rs` checks: exit 1 or 2, no panic or signal death,
//! peak RSS under 64 MiB, an end within its deadline, nothing written
//! outside the given folders, no secret marker and no raw control
//! character in the output. The node cases model Talos v1.11 (the node
//! simulator's `nodes` mode).

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::common;
use common::hostile::{self, Ran};
use common::inventory::Inventory;
use common::run::Run;
use common::sims::{Nodes, Sim};
use common::text;

const LIMIT_TIME: Duration = Duration::from_secs(10);
const KEY_MARKER: &str = "S3CRETKEYMARKER";

/// The loopback /24 of scenario `case` (tests/common/net.rs).
fn net(case: u8) -> String {
    common::net::scenario(module_path!(), case)
}

/// A case (`tests/common/hostile.rs`) with `in` (its inventory) and
/// `state` (the state dir), and this file's time limit.
struct Case(hostile::Case);

impl std::ops::Deref for Case {
    type Target = hostile::Case;
    fn deref(&self) -> &hostile::Case {
        &self.0
    }
}

impl Case {
    fn new(inventory: &Inventory) -> Case {
        let c = hostile::Case::new(&["in"]);
        inventory.write_to(&c.path("in/cluster.yaml"));
        Case(c)
    }

    /// `state/` holding a secrets bundle and a talosconfig, made by
    /// imgbuild itself outside any timed run.
    fn seeded(&self) {
        let o = self
            .command(&["secrets", "gen", "--state-dir", &self.s("state")])
            .output();
        assert!(o.status.success(), "{}", text(&o.stderr));
        let o = self
            .command(&["talosconfig", "--state-dir", &self.s("state")])
            .output();
        assert!(o.status.success(), "{}", text(&o.stderr));
    }

    /// imgbuild on this case's inventory (see [`hostile::Case::command`]).
    fn command(&self, args: &[&str]) -> Run {
        let mut run = self.0.command(&["--config", &self.s("in/cluster.yaml")]);
        run.args(args);
        run
    }

    /// A day-two or bootstrap command with short timeouts, measured.
    fn run(&self, args: &[&str]) -> Ran {
        let mut run = self.command(args);
        run.args(["--state-dir", &self.s("state")]).args([
            "--call-timeout",
            "1s",
            "--node-timeout",
            "2s",
            "--poll",
            "100ms",
        ]);
        self.measure(&mut run, LIMIT_TIME)
    }

    /// Every promise for a refused or failed run: exit 1 or 2, the bounds,
    /// untouched folders, no key marker.
    fn refused(&self, m: &Ran, names: &str) {
        self.0.refused(m, &[1, 2], names, LIMIT_TIME);
        assert!(
            !m.all().contains(KEY_MARKER),
            "the key marker was shown: {}",
            m.all()
        );
    }
}

/// `path` replaced by a FIFO nobody writes to, or a symlink to `/dev/zero`.
fn plant(path: &Path, fifo: bool) {
    let _ = std::fs::remove_file(path);
    if fifo {
        let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: a valid C string; mkfifo only creates the node.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    } else {
        std::os::unix::fs::symlink("/dev/zero", path).unwrap();
    }
}

#[test]
fn state_files_that_are_fifos_or_endless_are_not_waited_on_or_read_whole() {
    let case = Case::new(&Inventory::five_nodes("hostile", &net(0)));
    case.seeded();
    for fifo in [true, false] {
        for file in ["talosconfig", "upgrades.json", "configs/cp-01.yaml"] {
            std::fs::create_dir_all(case.path("state/configs")).unwrap();
            let path = case.path(&format!("state/{file}"));
            plant(&path, fifo);
            // `status` reads every one of them, then finds no node: with
            // --check, exit 1. An upgrade record that is not a regular file
            // is an error naming it (never taken as empty).
            let m = case.run(&["status", "--check"]);
            case.refused(
                &m,
                if file == "upgrades.json" {
                    "upgrades.json"
                } else {
                    "cp-01"
                },
            );
            // The planted talosconfig was replaced by imgbuild's own; the
            // record and a leftover config are left alone and not read.
            if file == "talosconfig" {
                assert!(
                    std::fs::symlink_metadata(&path).unwrap().is_file(),
                    "{file} ({})",
                    if fifo { "FIFO" } else { "/dev/zero" }
                );
            }
            let _ = std::fs::remove_file(&path);
        }
        // --talosconfig naming one: refused, naming it.
        let given = case.path("in/given-talosconfig");
        plant(&given, fifo);
        for command in ["status", "apply"] {
            let m = case.run(&[command, "--talosconfig", given.to_str().unwrap()]);
            case.refused(&m, "given-talosconfig");
            assert!(
                m.stderr.contains("not a regular file"),
                "{command}: {}",
                m.stderr
            );
            // Said once, naming the path.
            assert_eq!(
                m.stderr.matches("not a regular file").count(),
                1,
                "{command}: {}",
                m.stderr
            );
        }
        // The path named on the command line directly (not a symlink).
        if !fifo {
            let m = case.run(&["status", "--talosconfig", "/dev/zero"]);
            case.refused(&m, "/dev/zero: is not a regular file");
            assert_eq!(
                m.stderr.matches("not a regular file").count(),
                1,
                "{}",
                m.stderr
            );
        }
        std::fs::remove_file(&given).unwrap();
    }
}

#[test]
fn a_damaged_talosconfig_never_quotes_its_key() {
    let case = Case::new(&Inventory::five_nodes("hostile", &net(1)));
    case.seeded();
    let good = std::fs::read_to_string(case.path("state/talosconfig")).unwrap();
    let key_line = good
        .lines()
        .find(|l| l.trim_start().starts_with("key:"))
        .unwrap();
    let indent = &key_line[..key_line.len() - key_line.trim_start().len()];
    let damaged = [
        // The key where a string belongs is a list.
        format!("{indent}key: [LS0t{KEY_MARKER}]"),
        // A mapping.
        format!("{indent}key: {{pem: LS0t{KEY_MARKER}}}"),
        // An unterminated quote: a syntax error at the key.
        format!("{indent}key: \"LS0t{KEY_MARKER}"),
        // Not base64, then not a key.
        format!("{indent}key: '!!{KEY_MARKER}!!'"),
        format!("{indent}key: TFMwdFMzQ1JFVEtFWU1BUktFUg=="),
        // The key twice: serde would report it at the document's start.
        format!("{indent}key: a\n{indent}key: LS0t{KEY_MARKER}"),
    ];
    let mut files: Vec<String> = damaged.iter().map(|l| good.replace(key_line, l)).collect();
    // The context's fields lost: the key's text where the context belongs.
    files.push(format!(
        "context: hostile\ncontexts:\n  hostile: LS0t{KEY_MARKER}\n"
    ));
    for (i, damaged) in files.iter().enumerate() {
        let file = case.path(&format!("in/talosconfig-{i}"));
        std::fs::write(&file, damaged).unwrap();
        let m = case.run(&["status", "--talosconfig", file.to_str().unwrap()]);
        case.refused(&m, &format!("talosconfig-{i}"));
    }
}

/// The node simulator's five nodes at v1.11.2, bootstrapped, the inventory
/// moved to v1.11.5 on the factory simulator.
struct Upgradable {
    _factory: Sim,
    nodes: Nodes,
    case: Case,
}

fn upgradable(net: &str) -> Upgradable {
    let factory = Sim::start_with(&[], 0, &["--versions", "v1.11.2,v1.11.5"]);
    let nodes = Nodes::cluster(
        net,
        true,
        &["--reboot-delay", "1500", "--upgrade-delay", "200"],
    );
    let inventory = |v: &str| {
        Inventory::five_nodes("hostile", net)
            .talos(v)
            .factory(&factory.url)
    };
    let case = Case::new(&inventory("v1.11.2"));
    let mut run = case.command(&[
        "bootstrap",
        "--new-secrets",
        "--quiet",
        "--state-dir",
        &case.s("state"),
    ]);
    let o = run.timeouts(&[]).output();
    assert!(o.status.success(), "{}", text(&o.stderr));
    inventory("v1.11.5").write_to(&case.path("in/cluster.yaml"));
    Upgradable {
        _factory: factory,
        nodes,
        case,
    }
}

/// The pid the state dir's lock file names, once it names one.
fn holder_pid(state: &Path, deadline: Duration) -> Option<u64> {
    let started = Instant::now();
    while started.elapsed() < deadline {
        if let Ok(text) = std::fs::read_to_string(state.join(".imgbuild.lock"))
            && let Ok(v) = serde_json::from_str::<serde_json::Value>(&text)
            && let Some(pid) = v["pid"].as_u64()
        {
            return Some(pid);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

#[test]
fn a_second_upgrade_is_refused_naming_the_first_and_one_control_plane_is_down_at_a_time() {
    let net = net(2);
    let up = upgradable(&net);
    let case = &up.case;
    // The lock file of the bootstrap names a process that has ended.
    let _ = std::fs::remove_file(case.path("state/.imgbuild.lock"));
    let mut run = case.command(&[
        "--output",
        "json",
        "upgrade",
        "--state-dir",
        &case.s("state"),
    ]);
    run.timeouts(&[]);
    let first = run
        .into_command()
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = holder_pid(&case.path("state"), Duration::from_secs(20))
        .expect("the first upgrade took the lock");
    assert_eq!(pid, u64::from(first.id()));
    let second = case.run(&["upgrade", "--lock-timeout", "0s"]);
    case.refused(&second, &format!("pid {pid} (imgbuild upgrade) since 20"));
    assert_eq!(second.code, Some(1), "{}", second.stderr);
    assert!(second.stderr.contains("is in use"), "{}", second.stderr);
    // A read-only command does not wait for the lock nor take it.
    let status = case.run(&["status"]);
    assert!(!status.stderr.contains("is in use"), "{}", status.stderr);

    let out = first.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stats = up.nodes.stats();
    let events = stats["upgrades"].as_array().unwrap();
    // Every node upgraded once, by the first run only; never two nodes down
    // at once, so never two of three control planes.
    assert_eq!(events.len(), 5, "{stats}");
    for w in events.windows(2) {
        assert!(
            w[0]["up_ms"].as_u64() <= w[1]["down_ms"].as_u64(),
            "two nodes down at once: {w:?}"
        );
    }
    for name in ["cp-01", "cp-02", "cp-03"] {
        assert_eq!(stats["nodes"][name]["day2"]["upgrades"], 1, "{stats}");
    }
}

#[test]
fn a_lock_holder_killed_by_sigkill_does_not_block_the_next_run() {
    let case = Case::new(&Inventory::five_nodes("hostile", &net(3)));
    case.seeded();
    // A bootstrap waiting for nodes that never come: it holds the lock.
    let mut run = case.command(&[
        "bootstrap",
        "--new-secrets",
        "--quiet",
        "--state-dir",
        &case.s("state"),
    ]);
    run.args(["--node-timeout", "60s"]);
    let mut holder = run
        .into_command()
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = holder_pid(&case.path("state"), Duration::from_secs(10));
    assert_eq!(pid, Some(u64::from(holder.id())));
    let refused = case.run(&["bootstrap", "--new-secrets", "--lock-timeout", "0s"]);
    case.refused(&refused, "(imgbuild bootstrap)");
    assert_eq!(refused.code, Some(1));
    holder.kill().unwrap(); // SIGKILL: no destructor runs
    holder.wait().unwrap();
    // The kernel released the lock with the process: the rerun runs (and
    // fails only because no node answers).
    let rerun = case.run(&["bootstrap", "--new-secrets"]);
    case.refused(&rerun, "cp-01");
    assert!(!rerun.stderr.contains("is in use"), "{}", rerun.stderr);
}

#[test]
fn a_planted_lock_file_is_refused_not_followed() {
    let case = Case::new(&Inventory::five_nodes("hostile", &net(4)));
    case.seeded();
    for fifo in [true, false] {
        plant(&case.path("state/.imgbuild.lock"), fifo);
        let m = case.run(&["bootstrap", "--new-secrets"]);
        case.refused(&m, ".imgbuild.lock");
        assert!(m.stderr.contains("lock"), "{}", m.stderr);
    }
}
