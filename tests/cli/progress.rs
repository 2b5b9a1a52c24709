//! End to end: what a person sees on a terminal and what a CI log gets.
//! Terminal runs go through `script` (util-linux), which gives the binary a
//! pseudo-terminal; a small terminal model below replays what was drawn.
//! Piped runs must hold no escape sequence at all.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common;
use common::inventory::Inventory;
use common::run::Run;
use common::sims::{Hc, Nodes, Pve, Sim};
use common::{json, text};

/// The terminal width the runs get (`stty cols`).
const COLS: usize = 100;

/// A terminal replayed from the bytes a program wrote: printable text with
/// autowrap, carriage return, newline, cursor up/down/column and line
/// erase (what indicatif uses). Colors are ignored. A frame is taken each
/// time the cursor goes up or a line is erased, i.e. before each redraw.
struct Term {
    rows: Vec<Vec<char>>,
    row: usize,
    col: usize,
    /// The last column was written: the next character goes on a new row.
    wrap: bool,
    frames: Vec<Vec<String>>,
}

impl Term {
    fn replay(bytes: &str) -> Term {
        let mut t = Term {
            rows: vec![Vec::new()],
            row: 0,
            col: 0,
            wrap: false,
            frames: Vec::new(),
        };
        let mut chars = bytes.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '\x1b' if chars.peek() == Some(&'[') => {
                    chars.next();
                    let mut params = String::new();
                    let mut fin = ' ';
                    for p in chars.by_ref() {
                        if p.is_ascii_digit() || p == ';' || p == '?' {
                            params.push(p);
                        } else {
                            fin = p;
                            break;
                        }
                    }
                    t.csi(&params, fin);
                }
                '\r' => {
                    t.col = 0;
                    t.wrap = false;
                }
                '\n' => {
                    t.row += 1;
                    t.wrap = false;
                    t.grow();
                }
                c if c >= ' ' => t.put(c),
                _ => {}
            }
        }
        t
    }

    fn grow(&mut self) {
        while self.rows.len() <= self.row {
            self.rows.push(Vec::new());
        }
    }

    fn put(&mut self, c: char) {
        if self.wrap {
            self.row += 1;
            self.col = 0;
            self.wrap = false;
        }
        self.grow();
        let line = &mut self.rows[self.row];
        while line.len() <= self.col {
            line.push(' ');
        }
        line[self.col] = c;
        if self.col + 1 == COLS {
            self.wrap = true;
        } else {
            self.col += 1;
        }
    }

    fn csi(&mut self, params: &str, fin: char) {
        let n = params.parse::<usize>().unwrap_or(1).max(1);
        self.wrap = false;
        match fin {
            'A' => {
                self.frames.push(self.screen());
                self.row = self.row.saturating_sub(n);
            }
            'B' => {
                self.row += n;
                self.grow();
            }
            'G' => self.col = n - 1,
            'K' => {
                if params == "2" {
                    self.frames.push(self.screen());
                }
                let line = &mut self.rows[self.row];
                if params == "2" {
                    line.clear();
                } else {
                    line.truncate(self.col);
                }
            }
            'J' => {
                self.rows[self.row].truncate(self.col);
                self.rows.truncate(self.row + 1);
            }
            _ => {} // colors, cursor visibility
        }
    }

    fn screen(&self) -> Vec<String> {
        self.rows
            .iter()
            .map(|r| r.iter().collect::<String>().trim_end().to_owned())
            .collect()
    }
}

/// Runs `cmd` on a pseudo-terminal `COLS` wide; returns everything it drew
/// (stdout and stderr both go to the terminal).
fn on_terminal(cmd: &Command) -> String {
    let out = terminal_command(cmd).output().unwrap();
    text(&out.stdout)
}

/// `script` running `cmd` (its environment included) on a pseudo-terminal.
fn terminal_command(cmd: &Command) -> Command {
    let quote = |s: &std::ffi::OsStr| format!("'{}'", s.to_string_lossy().replace('\'', "'\\''"));
    let mut line = format!(
        "stty cols {COLS} rows 40; exec {}",
        quote(cmd.get_program())
    );
    for a in cmd.get_args() {
        line += " ";
        line += &quote(a);
    }
    let mut s = Command::new("script");
    s.args(["-q", "-e", "-c", &line, "/dev/null"]);
    // A terminal emulator names itself; a test run from `env -i` or a CI
    // runner has no TERM, and then nothing draws as on a terminal.
    s.env("TERM", "xterm-256color");
    if let Some(dir) = cmd.get_current_dir() {
        s.current_dir(dir);
    }
    for (k, v) in cmd.get_envs() {
        match v {
            Some(v) => s.env(k, v),
            None => s.env_remove(k),
        };
    }
    s.stdin(Stdio::null());
    s
}

/// A `script` run in the background, its output read as it comes.
fn spawn_on_terminal(cmd: &Command) -> Child {
    terminal_command(cmd)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// SGR color sequences (`ESC[31m`, `ESC[1;33m`, `ESC[36m` …), not resets.
fn has_color(s: &str) -> bool {
    s.match_indices("\x1b[").any(|(i, _)| {
        let rest = &s[i + 2..];
        let end = rest.find(|c: char| !c.is_ascii_digit() && c != ';');
        end.is_some_and(|e| rest[e..].starts_with('m') && !matches!(&rest[..e], "" | "0"))
    })
}

/// `imgbuild <args>` against the factory and Proxmox simulators.
fn publish_command(dir: &Path, sim: &Sim, pve: &Pve, args: &[&str]) -> Command {
    let config = Inventory::loopback().proxmox(false).write(dir);
    let mut run = Run::with_config(&config, args);
    run.factory(sim)
        .folders(dir)
        .env_remove("NO_COLOR")
        .env_remove("CLICOLOR_FORCE")
        .proxmox(pve);
    if args.contains(&"publish") {
        run.args(["--poll-ms", "50"]);
    }
    run.into_command()
}

/// Builds cp-01's image, then makes it a 1.3 GB sparse disk (its GPT
/// moved to the new end by sgdisk, the manifest told the new size and
/// sha256 as sha256sum computes it), so publish sees a current image of
/// that size.
fn grow_to_a_big_sparse_image(dir: &Path, sim: &Sim, pve: &Pve) -> u64 {
    let o = publish_command(
        dir,
        sim,
        pve,
        &["--output", "json", "node", "cp-01", "--quiet"],
    )
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let manifest_path = dir.join("out/manifest.json");
    let mut manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&manifest_path).unwrap()).unwrap();
    let entry = &mut manifest["images"]["cp-01"];
    let file = dir.join("out").join(entry["path"].as_str().unwrap());
    let size: u64 = 1300 << 20;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(size)
        .unwrap();
    let ok = Command::new("sgdisk")
        .arg("-e")
        .arg(&file)
        .output()
        .unwrap();
    assert!(ok.status.success(), "{}", text(&ok.stderr));
    let sum = Command::new("sha256sum").arg(&file).output().unwrap();
    let sha = text(&sum.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned();
    entry["size"] = size.into();
    entry["sha256"] = sha.into();
    std::fs::write(&manifest_path, manifest.to_string()).unwrap();
    size
}

/// On a terminal a 1.3 GB upload is a bar that moves: bytes sent out of
/// 1.27 GiB, a rate and an ETA, in color. Once the bar has shown three
/// different byte counts the run is hung up (the whole upload is the
/// simulator's hashing more than the bar's).
#[test]
fn a_big_upload_on_a_terminal_draws_a_moving_bar_with_bytes_and_rate() {
    use std::io::Read;
    let sim = Sim::start(&[]);
    let pve = Pve::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    grow_to_a_big_sparse_image(dir.path(), &sim, &pve);
    let mut child = spawn_on_terminal(&publish_command(
        dir.path(),
        &sim,
        &pve,
        &["publish", "cp-01"],
    ));
    let mut stdout = child.stdout.take().unwrap();
    let mut seen = String::new();
    let mut counts: Vec<String> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(240);
    let mut buf = [0u8; 8192];
    while counts.len() < 3 && Instant::now() < deadline {
        let n = stdout.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
        counts = Term::replay(&seen)
            .frames
            .iter()
            .flatten()
            .filter(|l| l.starts_with("cp-01 ") && l.contains("/1.27 GiB"))
            .map(|l| l.split('/').next().unwrap().trim().to_owned())
            .filter(|c| !c.ends_with(" 0 B"))
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        counts.len() >= 3,
        "the bar did not move: {counts:?}\n{seen}"
    );
    let frames = Term::replay(&seen).frames;
    let bar = frames
        .iter()
        .flatten()
        .rfind(|l| l.starts_with("cp-01 ") && l.contains("/1.27 GiB"))
        .unwrap();
    assert!(
        bar.contains("MiB/s") && bar.contains(" eta ") && bar.contains("MiB/1.27 GiB"),
        "{bar}"
    );
    assert!(has_color(&seen), "a terminal gets a colored bar:\n{seen:?}");
}

/// NO_COLOR on a terminal: the bars are drawn (in place) without a color;
/// `--output json` on a terminal draws nothing at all.
#[test]
fn no_color_bars_and_json_draws_nothing() {
    let sim = Sim::start(&[]);
    let pve = Pve::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = publish_command(dir.path(), &sim, &pve, &["publish", "cp-01", "cp-02"]);
    cmd.env("NO_COLOR", "1");
    let drawn = on_terminal(&cmd);
    let t = Term::replay(&drawn);
    let bars: Vec<&String> = t
        .frames
        .iter()
        .flatten()
        .filter(|l| l.starts_with("cp-0") && l.contains("/32.00 MiB") && l.contains("B/s"))
        .collect();
    assert!(!bars.is_empty(), "no upload bar:\n{drawn:?}");
    assert!(!has_color(&drawn), "NO_COLOR drew colors:\n{drawn:?}");
    let end: Vec<String> = t.screen();
    for node in ["cp-01", "cp-02"] {
        assert!(
            end.iter().any(
                |l| l.starts_with(&format!("{node}: stored ")) && l.contains(" bytes sent in ")
            ),
            "{end:#?}"
        );
    }

    let pve = Pve::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let cmd = publish_command(
        dir.path(),
        &sim,
        &pve,
        &["--output", "json", "publish", "cp-01"],
    );
    let drawn = on_terminal(&cmd);
    assert!(!drawn.contains('\x1b'), "{drawn:?}");
    let doc = drawn.lines().last().unwrap();
    let v: serde_json::Value = serde_json::from_str(doc).unwrap();
    assert_eq!(v["nodes"][0]["uploaded"], true, "{v}");
}

/// Piped: no escape sequence; each upload is exactly a start line and an
/// end line (bytes, seconds, rate); `--quiet` leaves only the result.
#[test]
fn piped_uploads_print_two_lines_each_and_quiet_prints_none() {
    let sim = Sim::start(&[]);
    let pve = Pve::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let o = publish_command(dir.path(), &sim, &pve, &["publish"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert!(!out.contains('\x1b') && !err.contains('\x1b'), "{err:?}");
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("out/manifest.json")).unwrap())
            .unwrap();
    let nodes = manifest["images"].as_object().unwrap();
    assert_eq!(nodes.len(), 5);
    for (node, image) in nodes {
        let lines: Vec<&str> = err
            .lines()
            .filter(|l| {
                ["uploading ", "stored ", "upload retry"]
                    .iter()
                    .any(|w| l.starts_with(&format!("{node}: {w}")))
            })
            .collect();
        assert_eq!(lines.len(), 2, "{node}: {lines:#?}\n{err}");
        let size = image["size"].as_u64().unwrap();
        assert!(
            lines[0].contains(&format!("({size} bytes)")),
            "{}",
            lines[0]
        );
        let end = lines[1];
        assert!(
            end.contains(&format!(": {size} bytes sent in ")) && end.ends_with(" MB/s)"),
            "{end}"
        );
    }

    let pve = Pve::start(&[]);
    let o = publish_command(dir.path(), &sim, &pve, &["publish", "--quiet"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(text(&o.stderr), "", "--quiet printed progress");
    assert_eq!(text(&o.stdout).lines().count(), 5, "{}", text(&o.stdout));
}

/// `imgbuild publish` of the loopback example as Hetzner snapshots.
fn hcloud_publish(dir: &Path, sim: &Sim, hc: &Hc) -> Command {
    let config = Inventory::loopback()
        .replace("platform: metal", "platform: hcloud")
        .hcloud("    location: fsn1\n")
        .write(dir);
    let mut run = Run::with_config(&config, &["publish"]);
    run.factory(sim)
        .args(["--poll-ms", "100"])
        .folders(dir)
        .env_remove("NO_COLOR")
        .hcloud(hc)
        .envs(hc.rescue_env());
    run.into_command()
}

/// Piped, the stream into the Hetzner rescue system is also exactly a start
/// and an end line (bytes written, seconds, rate, compressed bytes sent);
/// on a terminal it is a bar over the image's bytes, named by its nodes.
#[test]
fn a_rescue_stream_is_two_lines_piped_and_a_bar_on_a_terminal() {
    let sim = Sim::start(&[]);
    let hc = Hc::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let o = hcloud_publish(dir.path(), &sim, &hc).output().unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    assert!(!err.contains('\x1b'), "{err:?}");
    let stream: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("hcloud: writing ") || l.starts_with("hcloud: dd wrote "))
        .collect();
    assert_eq!(stream.len(), 2, "{err}");
    assert!(stream[0].starts_with("hcloud: writing "), "{err}");
    let end = stream[1];
    assert!(
        end.contains(" bytes in ") && end.contains(" MB/s; ") && end.ends_with(" bytes sent)"),
        "{end}"
    );

    let hc = Hc::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let drawn = on_terminal(&hcloud_publish(dir.path(), &sim, &hc));
    let t = Term::replay(&drawn);
    let bar = t
        .frames
        .iter()
        .flatten()
        .find(|l| l.starts_with("cp-01,cp-02,") && l.contains("/32.00 MiB"));
    assert!(bar.is_some(), "no stream bar:\n{drawn:?}");
    assert!(
        t.screen()
            .iter()
            .any(|l| l.starts_with("hcloud: dd wrote ")),
        "{drawn:?}"
    );
}

/// `--color always` colors the error prefix even in a pipe; `never` and
/// the default in a pipe do not.
#[test]
fn color_flag_and_pipes() {
    let run = |extra: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
            .args(extra)
            .args(["--config", "/nonexistent/cluster.yaml", "validate"])
            .env_remove("NO_COLOR")
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2));
        text(&o.stderr)
    };
    assert!(run(&["--color", "always"]).starts_with("\x1b[1;31merror:\x1b[0m "));
    for plain in [run(&["--color", "never"]), run(&[])] {
        assert!(
            plain.starts_with("error: ") && !plain.contains('\x1b'),
            "{plain:?}"
        );
    }
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_imgbuild"));
    cmd.args(["--config", "/nonexistent/cluster.yaml", "validate"]);
    cmd.env_remove("NO_COLOR");
    assert!(has_color(&on_terminal(&cmd)), "auto on a terminal");
    cmd.env("NO_COLOR", "1");
    let drawn = on_terminal(&cmd);
    assert!(drawn.contains("error: ") && !has_color(&drawn), "{drawn:?}");
}

const NODES: [(&str, u8, &str); 5] = [
    ("cp-01", 11, "controlplane"),
    ("cp-02", 12, "controlplane"),
    ("cp-03", 13, "controlplane"),
    ("worker-01", 21, "worker"),
    ("worker-02", 22, "worker"),
];

/// The loopback /24 of scenario `k` (tests/common/net.rs).
fn net(k: u8) -> String {
    common::net::scenario(module_path!(), k)
}

/// Five simulated nodes on their own /24 (plus `ghost`, a node nobody
/// simulates, when asked), and a working folder with their inventory.
struct Cluster {
    _nodes: Nodes,
    dir: tempfile::TempDir,
}

impl Cluster {
    fn start(k: u8, ghost: bool) -> Cluster {
        let net = net(k);
        let mut args = vec!["--vip".to_owned(), format!("{net}.10")];
        let mut inv = format!(
            "cluster:\n  name: sim\n  talosVersion: v1.11.2\n  kubernetesVersion: v1.32.1\n  endpoint: https://{net}.10:6443\n  vip: {net}.10\nimage:\n  factory: http://127.0.0.1:9\nnetwork:\n  cidr: 127.0.0.0/8\n  gateway: 127.0.0.1\n  nameservers: [127.0.0.53]\n  interface: eth0\nnodes:\n"
        );
        for (name, host, role) in NODES {
            args.extend(["--node".to_owned(), format!("{name}={net}.{host}:{role}")]);
            inv += &format!("  - name: {name}\n    role: {role}\n    address: {net}.{host}\n");
        }
        if ghost {
            inv += &format!("  - name: ghost\n    role: worker\n    address: {net}.99\n");
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let nodes = Nodes::start(&args);
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("cluster.yaml"), inv).unwrap();
        Cluster { _nodes: nodes, dir }
    }

    /// `imgbuild <global> bootstrap <extra>` with test-sized timeouts.
    fn bootstrap(&self, global: &[&str], extra: &[&str]) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_imgbuild"));
        cmd.arg("--config")
            .arg(self.dir.path().join("cluster.yaml"))
            .args(global)
            .args(["bootstrap", "--new-secrets"])
            .args(extra);
        for (flag, value) in [
            ("--poll", "100ms"),
            ("--node-timeout", "20s"),
            ("--bootstrap-timeout", "20s"),
            ("--health-timeout", "30s"),
        ] {
            if !extra.contains(&flag) {
                cmd.args([flag, value]);
            }
        }
        cmd.current_dir(self.dir.path())
            .env_remove("IMGBUILD_CONFIG")
            .env_remove("IMGBUILD_STATE_DIR")
            .env_remove("TALOSCONFIG")
            .env_remove("NO_COLOR");
        cmd
    }
}

/// On a terminal, each node has one line that stays where it is while its
/// state changes, with a cluster line below; at the end the board gives
/// way to the summary. No event log scrolls by.
#[test]
fn a_five_node_bootstrap_on_a_terminal_is_a_board_updated_in_place() {
    let c = Cluster::start(1, false);
    let drawn = on_terminal(&c.bootstrap(&[], &[]));
    let t = Term::replay(&drawn);
    assert!(t.frames.len() > 5, "nothing redrawn:\n{drawn:?}");
    for (node, ..) in NODES {
        let mut rows = std::collections::BTreeSet::new();
        let mut states = std::collections::BTreeSet::new();
        for frame in &t.frames {
            let lines: Vec<(usize, &String)> = frame
                .iter()
                .enumerate()
                .filter(|(_, l)| l.split_whitespace().next() == Some(node))
                .collect();
            assert!(lines.len() <= 1, "{node} twice in one frame: {frame:#?}");
            for (i, l) in lines {
                rows.insert(i);
                // "cp-01      3s  state": the state without the seconds.
                states.insert(l.split_whitespace().skip(2).collect::<Vec<_>>().join(" "));
            }
        }
        assert_eq!(rows.len(), 1, "{node} moved between rows {rows:?}");
        assert!(states.len() >= 4, "{node}: {states:?}");
        assert!(states.contains("Ready"), "{node}: {states:?}");
    }
    let cluster: Vec<&String> = t
        .frames
        .iter()
        .flatten()
        .filter(|l| l.starts_with("cluster ") && l.contains("check(s) pending, oldest "))
        .collect();
    assert!(!cluster.is_empty(), "no pending checks shown");
    let end = t.screen();
    let end: Vec<&String> = end.iter().filter(|l| !l.is_empty()).collect();
    assert!(end[0].starts_with("cluster sim is healthy ("), "{end:#?}");
    assert!(
        end.iter()
            .all(|l| !l.starts_with("cp-0") && !l.starts_with("[")),
        "the board or a log line stayed: {end:#?}"
    );
}

/// Piped: the event log as it always was, without an escape sequence, and
/// never the same "waiting for checks" block twice in a row.
#[test]
fn a_piped_bootstrap_logs_plain_lines_without_repeated_waiting_blocks() {
    let c = Cluster::start(2, false);
    let o: Output = c.bootstrap(&[], &[]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert!(!out.contains('\x1b') && !err.contains('\x1b'), "{err:?}");
    assert!(err.contains("] cp-01: etcd bootstrapped"), "{err}");
    let mut blocks: Vec<String> = Vec::new();
    let mut current: Option<String> = None;
    for line in err.lines() {
        let body = line.split_once("] ").map_or(line, |(_, b)| b);
        if body.starts_with("cluster: waiting for ") {
            blocks.extend(current.take());
            current = Some(body.to_owned());
        } else if let (Some(b), true) = (current.as_mut(), line.starts_with("    - ")) {
            b.push('\n');
            b.push_str(line);
        } else {
            blocks.extend(current.take());
        }
    }
    blocks.extend(current);
    assert!(blocks.len() >= 2, "{err}");
    for w in blocks.windows(2) {
        assert_ne!(w[0], w[1], "the same waiting block twice:\n{err}");
    }
    // JSON results: the log stays, nothing is drawn.
    let o = c.bootstrap(&["--output", "json"], &[]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(json(&o)["healthy"], true);
    assert!(!text(&o.stderr).contains('\x1b'));
}

/// Piped, a wait that goes on gets a line after each silence of the
/// heartbeat (30 s by default), naming what waits and for how long.
#[test]
fn a_long_wait_in_a_log_gets_a_line_with_the_elapsed_time() {
    let c = Cluster::start(3, true);
    let o = c
        .bootstrap(&["--heartbeat", "400ms"], &["--node-timeout", "4s"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    let beats: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("] still waiting: "))
        .collect();
    assert!(beats.len() >= 3, "{err}");
    let mut last = -1.0;
    for b in &beats {
        let (_, rest) = b.split_once("ghost waiting for port 50000 for ").expect(b);
        let secs: f64 = rest.split('s').next().unwrap().parse().unwrap();
        assert!(secs > last, "{beats:#?}");
        last = secs;
    }
    assert!(last >= 1.0, "{beats:#?}");
    assert!(!err.contains('\x1b'));
    // --quiet: only the error.
    let o = c
        .bootstrap(
            &["--heartbeat", "400ms"],
            &["--node-timeout", "2s", "--quiet"],
        )
        .output()
        .unwrap();
    let err = text(&o.stderr);
    assert!(err.starts_with("error: node ghost: "), "{err}");
    assert!(!err.contains("] "), "a progress line with --quiet: {err}");
}
