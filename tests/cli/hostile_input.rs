//! Input made by someone else, tried as an attacker would (issue 18): each
//! case runs the real binary on a crafted file, environment or loopback
//! server, and checks what imgbuild promises for untrusted input: exit 1 or
//! 2 with one message naming the file (or variable, or URL), no panic and no
//! signal death, peak RSS under 64 MiB, an end within 10 s, nothing written
//! outside the folders given, and no secret, token or foreign file content
//! in stdout or stderr. Every crafted input is made here, by code.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common;
use common::hostile::{self, Ran};
use common::inventory::Inventory;
use common::root;

const LIMIT_TIME: Duration = Duration::from_secs(10);

/// A case (`tests/common/hostile.rs`) with `in` (the crafted inputs) and
/// `out` (where the command may write), and this file's time limit.
struct Case(hostile::Case);

impl std::ops::Deref for Case {
    type Target = hostile::Case;
    fn deref(&self) -> &hostile::Case {
        &self.0
    }
}

impl Case {
    fn new() -> Case {
        Case(hostile::Case::new(&["in", "out"]))
    }

    /// `out/state` holding a valid secrets bundle, generated once per test
    /// process (outside any timed run: key generation is not what is tested).
    fn seeded_state(&self) -> String {
        static BUNDLE: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
        let bundle = BUNDLE.get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            let config = dir.path().join("cluster.yaml");
            std::fs::copy(root().join("examples/loopback/cluster.yaml"), &config).unwrap();
            let o = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
                .arg("--config")
                .arg(&config)
                .args(["secrets", "gen", "--state-dir"])
                .arg(dir.path().join("state"))
                .env_remove("IMGBUILD_CONFIG")
                .output()
                .unwrap();
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            std::fs::read(dir.path().join("state/secrets.yaml")).unwrap()
        });
        self.write("out/state/secrets.yaml", bundle);
        std::fs::set_permissions(
            self.path("out/state"),
            std::os::unix::fs::PermissionsExt::from_mode(0o700),
        )
        .unwrap();
        self.s("out/state")
    }

    /// The loopback inventory as `in/cluster.yaml` after `edit`.
    fn inventory(&self, edit: impl FnOnce(String) -> String) -> String {
        self.write("in/cluster.yaml", edit(Inventory::loopback().text()))
    }

    /// Runs imgbuild with `args` and `env`, measured (see
    /// [`hostile::Case::command`]).
    fn run(&self, args: &[&str], env: &[(&str, &str)]) -> Ran {
        let mut run = self.command(args);
        run.envs(env.iter().copied());
        self.measure(&mut run, LIMIT_TIME)
    }

    /// `imgbuild build` of the loopback example from the factory at `url`,
    /// with no retries.
    fn build_from(&self, url: &str, env: &[(&str, &str)]) -> Ran {
        let config = self.inventory(|t| t);
        let args = [
            "--config",
            &config,
            "build",
            "--factory",
            url,
            "--retries",
            "0",
        ];
        let out = self.s("out/img");
        self.run(&[&args[..], &["--out-dir", &out, "--quiet"]].concat(), env)
    }

    /// Every promise for a refused input: `codes`, one message naming
    /// `names`, none of `hidden`, the bounds, and untouched folders.
    fn refused(&self, ran: &Ran, codes: &[i32], names: &str, hidden: &[&str]) {
        self.0.refused(ran, codes, names, LIMIT_TIME);
        let all = ran.all();
        let errors: Vec<&str> = ran
            .stderr
            .lines()
            .filter(|l| l.starts_with("error:"))
            .collect();
        let mut distinct = errors.clone();
        distinct.dedup();
        assert_eq!(errors, distinct, "a message repeated: {all}");
        for h in hidden {
            assert!(!all.contains(h), "{h:?} shown: {all}");
        }
    }

    /// The bounds every run keeps, accepted input or not.
    fn bounded(&self, ran: &Ran) {
        self.0.bounded(ran, LIMIT_TIME);
    }
}

// ---- generators -----------------------------------------------------------

/// A billion laughs: each level lists the previous one ten times.
fn alias_bomb(levels: usize) -> String {
    let mut s = String::from("l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
    for i in 1..levels {
        let p = i - 1;
        let refs = vec![format!("*l{p}"); 10].join(", ");
        s.push_str(&format!("l{i}: &l{i} [{refs}]\n"));
    }
    s
}

/// A secrets bundle in talosctl's layout with `field` (a line of it)
/// replaced by `value`; every value marked so a leak is found.
fn secrets_with(field: &str, value: &str) -> String {
    let lines = [
        ("cluster.id", "cluster:\n  id: SECRETMARK-id"),
        ("cluster.secret", "  secret: SECRETMARK-secret"),
        (
            "secrets",
            "secrets:\n  bootstraptoken: abcdef.0123456789abcdef\n  secretboxencryptionsecret: SECRETMARK-box",
        ),
        (
            "trustdinfo.token",
            "trustdinfo:\n  token: abcdef.0123456789abcdef",
        ),
        (
            "certs.etcd",
            "certs:\n  etcd:\n    crt: LS0tSECRETMARK\n    key: LS0tSECRETMARK",
        ),
        (
            "certs.k8s",
            "  k8s:\n    crt: LS0tSECRETMARK\n    key: LS0tSECRETMARK",
        ),
        (
            "certs.k8saggregator",
            "  k8saggregator:\n    crt: LS0tSECRETMARK\n    key: LS0tSECRETMARK",
        ),
        (
            "certs.k8sserviceaccount",
            "  k8sserviceaccount:\n    key: LS0tSECRETMARK",
        ),
        (
            "certs.os",
            "  os:\n    crt: LS0tSECRETMARK\n    key: LS0tSECRETMARK",
        ),
    ];
    lines
        .iter()
        .map(|(name, text)| {
            if *name != field {
                return text.to_string();
            }
            match field {
                "cluster.secret" => format!("  secret: {value}"),
                "trustdinfo.token" => format!("trustdinfo:\n  token: {value}"),
                "certs.etcd" => format!("certs:\n  etcd: {value}"),
                _ => unreachable!(),
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

/// A plain-HTTP server on loopback that hands each of at most `n`
/// connections to `answer` (request line, head, body); it stops by itself.
fn serve(
    n: usize,
    answer: impl Fn(&str, &[String], &[u8], &mut TcpStream) + Send + 'static,
) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for conn in listener.incoming().take(n) {
            let Ok(mut conn) = conn else { return };
            let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
            let mut reader = BufReader::new(conn.try_clone().unwrap());
            let mut head = Vec::new();
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 {
                    break;
                }
                let line = line.trim_end().to_owned();
                if line.is_empty() {
                    break;
                }
                head.push(line);
            }
            let Some(first) = head.first().cloned() else {
                continue;
            };
            let len = head
                .iter()
                .find_map(|l| {
                    let l = l.to_ascii_lowercase();
                    l.strip_prefix("content-length:")
                        .and_then(|v| v.trim().parse::<usize>().ok())
                })
                .unwrap_or(0);
            let mut body = vec![0; len];
            let _ = reader.read_exact(&mut body);
            answer(&first, &head, &body, &mut conn);
        }
    });
    url
}

fn reply(conn: &mut TcpStream, status: &str, extra: &str, body: &[u8]) {
    let _ = write!(
        conn,
        "HTTP/1.1 {status}\r\nConnection: close\r\nContent-Length: {}\r\n{extra}\r\n",
        body.len()
    );
    let _ = conn.write_all(body);
}

/// A factory on loopback that offers v1.11.2 and the loopback inventory's
/// extensions, registers any schematic (its ID is the SHA-256 of the YAML,
/// as the real factory computes it) and answers image GETs with `image`.
fn factory(image: Vec<u8>) -> String {
    serve(32, move |first, _, body, conn| {
        let path = first.split(' ').nth(1).unwrap_or("");
        if path == "/versions" {
            reply(conn, "200 OK", "", br#"["v1.11.2"]"#);
        } else if path.ends_with("/extensions/official") {
            let list =
                br#"[{"name":"siderolabs/qemu-guest-agent"},{"name":"siderolabs/tailscale"}]"#;
            reply(conn, "200 OK", "", list);
        } else if path == "/schematics" {
            use sha2::Digest;
            let id = hex::encode(sha2::Sha256::digest(body));
            reply(
                conn,
                "201 Created",
                "",
                format!(r#"{{"id":"{id}"}}"#).as_bytes(),
            );
        } else if path.starts_with("/image/") {
            reply(conn, "200 OK", "", &image);
        } else {
            reply(conn, "404 Not Found", "", b"not found");
        }
    })
}

// ---- 1, 4: import talhelper ----------------------------------------------

const TALCONFIG: &str = "clusterName: c\ntalosVersion: v1.11.2\nkubernetesVersion: v1.32.1\nendpoint: https://127.0.0.20:6443\n";

#[test]
fn an_import_never_writes_outside_out() {
    let c = Case::new();
    let escape = format!("/../../../../..{}/x", c.s("outside"));
    let talconfig = format!(
        "{TALCONFIG}nodes:\n  - hostname: \"{escape}\"\n    ipAddress: 127.0.0.11\n    controlPlane: true\n    patches:\n      - |\n        machine:\n          env:\n            owned: \"yes\"\n"
    );
    let src = c.write("in/talconfig.yaml", talconfig);
    let ran = c.run(
        &[
            "import",
            "talhelper",
            &src,
            "--out",
            &c.s("out/cluster.yaml"),
        ],
        &[],
    );
    c.refused(&ran, &[1, 2], "cluster.yaml", &[]);
    // What was written stayed in out/.
    assert!(
        c.path("out/patches/nodes-0-1.yaml").is_file(),
        "{}",
        ran.all()
    );
}

#[test]
fn an_import_takes_only_talenv_and_named_variables() {
    let c = Case::new();
    let src = c.write(
        "in/talconfig.yaml",
        TALCONFIG.replace("clusterName: c", "clusterName: ${PROXMOX_VE_API_TOKEN}")
            + "nodes:\n  - hostname: cp-01\n    ipAddress: 127.0.0.11\n    controlPlane: true\n",
    );
    let token = "root@pam!ci=TOKENMARK-5f1e";
    let out = c.s("out/cluster.yaml");
    let ran = c.run(
        &["import", "talhelper", &src, "--out", &out],
        &[("PROXMOX_VE_API_TOKEN", token)],
    );
    c.refused(&ran, &[1], "PROXMOX_VE_API_TOKEN", &["TOKENMARK"]);
    assert!(
        ran.stderr.contains("--env PROXMOX_VE_API_TOKEN"),
        "{}",
        ran.stderr
    );
    let written = std::fs::read_to_string(&out).unwrap();
    assert!(!written.contains("TOKENMARK"), "{written}");
    // A patch referenced outside the talconfig's folder is not read.
    let c = Case::new();
    c.write("outside/shadow", "root: SHADOWMARK\n");
    let src = c.write(
        "in/talconfig.yaml",
        format!(
            "{TALCONFIG}patches:\n  - \"@../outside/shadow\"\n  - \"@{}\"\nnodes:\n  - hostname: cp-01\n    ipAddress: 127.0.0.11\n    controlPlane: true\n",
            c.s("outside/shadow")
        ),
    );
    let ran = c.run(
        &[
            "import",
            "talhelper",
            &src,
            "--out",
            &c.s("out/cluster.yaml"),
        ],
        &[],
    );
    c.bounded(&ran);
    assert!(
        ran.stderr.contains("inside the inventory's folder"),
        "{}",
        ran.stderr
    );
    assert!(!ran.all().contains("SHADOWMARK"));
    let written = std::fs::read_to_string(c.path("out/cluster.yaml")).unwrap();
    assert!(!written.contains("shadow"), "{written}");
}

// ---- 2: secrets -----------------------------------------------------------

#[test]
fn secrets_never_reach_a_message() {
    let cases = [
        (
            "certs.etcd",
            "LS0tLS1CRUdJTiBFQyBQUklWQVRFIEtFWS0tLS0tSECRETMARK",
        ),
        ("cluster.secret", "[SECRETMARK-list]"),
        ("cluster.secret", "1234567890123"),
        ("trustdinfo.token", "{SECRETMARK: 1}"),
    ];
    for (field, value) in cases {
        let c = Case::new();
        let config = c.inventory(|t| t);
        let state = c.path("out/state");
        std::fs::create_dir_all(&state).unwrap();
        let text = secrets_with(field, value);
        std::fs::write(state.join("secrets.yaml"), &text).unwrap();
        let hidden = ["SECRETMARK", "1234567890123", "LS0t"];
        for output in ["text", "json"] {
            let ran = c.run(
                &[
                    "--output",
                    output,
                    "--config",
                    &config,
                    "config",
                    "cp-01",
                    "--state-dir",
                    state.to_str().unwrap(),
                ],
                &[],
            );
            c.refused(&ran, &[1], "secrets.yaml", &hidden);
        }
        let foreign = c.write("in/foreign.yaml", &text);
        let ran = c.run(
            &[
                "--config",
                &config,
                "secrets",
                "gen",
                "--secrets",
                &foreign,
                "--state-dir",
                &c.s("out/state2"),
            ],
            &[],
        );
        c.refused(&ran, &[1], "foreign.yaml", &hidden);
    }
}

// ---- 3, 23: patches ------------------------------------------------------

fn with_patch(file: &str) -> impl FnOnce(String) -> String {
    let file = file.to_owned();
    move |t| format!("{t}\npatches:\n  all: [\"{file}\"]\n")
}

#[test]
fn patches_outside_the_inventory_folder_are_refused_unread() {
    let c = Case::new();
    let shadow = c.write(
        "outside/shadow",
        "root: $6$SHADOWMARK$hash\ndaemon: '*'\nbin: '*'\n",
    );
    std::os::unix::fs::symlink(&shadow, c.path("in/linked.yaml")).unwrap();
    for file in ["linked.yaml", shadow.as_str(), "../outside/shadow"] {
        let config = c.inventory(with_patch(file));
        let ran = c.run(&["--config", &config, "validate"], &[]);
        c.refused(&ran, &[2], "cluster.yaml", &["SHADOWMARK", "daemon"]);
        assert!(ran.stderr.contains("patches.all[0]"), "{}", ran.stderr);
    }
}

#[test]
fn a_schema_error_shows_keys_not_a_file() {
    let c = Case::new();
    let mut patch = String::from("machine:\n");
    for i in 0..300 {
        patch.push_str(&format!("  user{i}: VALUEMARK{i}-$6$abcdefgh\n"));
    }
    c.write("in/p.yaml", patch);
    let config = c.inventory(with_patch("p.yaml"));
    let ran = c.run(
        &[
            "--config",
            &config,
            "config",
            "cp-01",
            "--state-dir",
            &c.seeded_state(),
        ],
        &[],
    );
    c.refused(&ran, &[1], "p.yaml", &["VALUEMARK"]);
    assert!(ran.stderr.lines().count() < 20, "{}", ran.stderr);
}

#[test]
fn a_patch_that_is_no_file_says_what_it_is() {
    let c = Case::new();
    std::fs::create_dir(c.path("in/dir.yaml")).unwrap();
    let fifo = std::ffi::CString::new(c.s("in/fifo.yaml")).unwrap();
    // SAFETY: a valid C string.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    for (file, what) in [
        ("dir.yaml", "is a directory"),
        ("fifo.yaml", "not a regular file"),
    ] {
        let config = c.inventory(with_patch(file));
        let ran = c.run(&["--config", &config, "validate"], &[]);
        c.refused(&ran, &[2], file, &[]);
        assert!(ran.stderr.contains(what), "{}", ran.stderr);
    }
}

// ---- 14: sizes -----------------------------------------------------------

#[test]
fn huge_patches_and_manifests_are_not_read_whole() {
    let c = Case::new();
    let big = std::fs::File::create(c.path("in/big.yaml")).unwrap();
    big.set_len(3 << 30).unwrap();
    let config = c.inventory(with_patch("big.yaml"));
    let ran = c.run(
        &[
            "--config",
            &config,
            "config",
            "cp-01",
            "--state-dir",
            &c.seeded_state(),
        ],
        &[],
    );
    c.refused(&ran, &[1], "big.yaml", &[]);
    assert!(ran.stderr.contains("larger than"), "{}", ran.stderr);
    let manifest = std::fs::File::create(c.path("out/manifest.json")).unwrap();
    manifest.set_len(3 << 30).unwrap();
    let ran = c.run(&["verify", "--out-dir", &c.s("out")], &[]);
    c.refused(&ran, &[1], "manifest.json", &[]);
}

// ---- 4, 6, 16, 23: servers -----------------------------------------------

#[test]
fn a_reflected_token_and_escapes_are_not_shown() {
    let c = Case::new();
    let url = serve(8, |first, head, _, conn| {
        let body = format!("{first}\n{}\n\x1b[2J\x1b]0;owned\x07", head.join("\n"));
        reply(
            conn,
            "403 Forbidden",
            "Content-Type: text/plain\r\n",
            body.as_bytes(),
        );
    });
    let token = "TOKENMARKabcdefghijklmnopqrstuvwxyz0123456789";
    let ran = c.run(
        &["cleanup"],
        &[("HCLOUD_ENDPOINT", &url), ("HCLOUD_TOKEN", token)],
    );
    c.refused(&ran, &[1], "/servers", &["TOKENMARK", "Bearer"]);
    // The escape inside a JSON error object, decoded by the client.
    let url = serve(8, |_, _, _, conn| {
        let body = br#"{"error":{"code":"forbidden","message":"\u001b[2J\u001b]0;owned\u0007no"}}"#;
        reply(
            conn,
            "403 Forbidden",
            "Content-Type: application/json\r\n",
            body,
        );
    });
    let ran = c.run(
        &["cleanup"],
        &[("HCLOUD_ENDPOINT", &url), ("HCLOUD_TOKEN", token)],
    );
    c.refused(&ran, &[1], "/servers", &["TOKENMARK"]);
}

#[test]
fn a_trickling_factory_ends_at_the_deadline() {
    let c = Case::new();
    let url = serve(4, |_, _, _, conn| {
        let _ = conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n[");
        for _ in 0..60 {
            std::thread::sleep(Duration::from_millis(500));
            if conn.write_all(b" ").is_err() {
                return;
            }
        }
    });
    let ran = c.build_from(&url, &[("IMGBUILD_REQUEST_DEADLINE_SECS", "2")]);
    c.refused(&ran, &[1], &url, &[]);
}

#[test]
fn a_redirect_to_a_file_url_is_explained() {
    let c = Case::new();
    let url = serve(4, |_, _, _, conn| {
        reply(conn, "302 Found", "Location: file:///etc/passwd\r\n", b"");
    });
    let ran = c.build_from(&url, &[]);
    c.refused(&ran, &[1], "file:///etc/passwd", &["root:"]);
    assert!(ran.stderr.contains("redirect"), "{}", ran.stderr);
}

// ---- 15: decompression bomb ----------------------------------------------

#[test]
fn a_zstd_bomb_is_cut_off() {
    // A GPT-looking head, then 1 GiB of zeros: some 30 KB compressed.
    let mut enc = zstd::Encoder::new(Vec::new(), 3).unwrap();
    let mut head = vec![0u8; 1024];
    head[512..520].copy_from_slice(b"EFI PART");
    enc.write_all(&head).unwrap();
    let zeros = vec![0u8; 1 << 20];
    for _ in 0..1024 {
        enc.write_all(&zeros).unwrap();
    }
    let bomb = enc.finish().unwrap();
    assert!(bomb.len() < 1 << 20, "{}", bomb.len());
    let c = Case::new();
    let url = factory(bomb);
    let config = c.inventory(|t| t);
    let ran = c.run(
        &[
            "--config",
            &config,
            "node",
            "cp-01",
            "--factory",
            &url,
            "--retries",
            "0",
            "--out-dir",
            &c.s("out/img"),
            "--cache-dir",
            &c.s("out/cache"),
            "--quiet",
            // The bound is configurable; a small one keeps the test fast.
            "--max-image-mib",
            "8",
        ],
        &[],
    );
    c.refused(&ran, &[1], "metal-amd64.raw.zst", &[]);
    assert!(ran.stderr.contains("at most"), "{}", ran.stderr);
}

// ---- 12, 17, 23: YAML ----------------------------------------------------

#[test]
fn alias_bombs_and_deep_nesting_are_refused_quickly() {
    let c = Case::new();
    let bomb = alias_bomb(9);
    let config = c.inventory(|t| format!("{t}\nx-extra:\n{}", indent(&bomb)));
    let ran = c.run(&["--config", &config, "validate"], &[]);
    c.refused(&ran, &[2], "cluster.yaml", &[]);
    assert!(ran.stderr.contains("unfolds"), "{}", ran.stderr);
    let deep = format!("nodes: {}{}\n", "[".repeat(20_000), "]".repeat(20_000));
    let config = c.write("in/deep.yaml", deep);
    let ran = c.run(&["--config", &config, "validate"], &[]);
    c.refused(&ran, &[2], "deep.yaml", &[]);
    assert!(ran.stderr.contains("nested deeper"), "{}", ran.stderr);
    // talhelper's config and its talenv.
    let src = c.write("in/t/talconfig.yaml", format!("{TALCONFIG}{bomb}"));
    let ran = c.run(&["import", "talhelper", &src], &[]);
    c.refused(&ran, &[1], "talconfig.yaml", &[]);
    c.write("in/t2/talenv.yaml", &bomb);
    let src = c.write("in/t2/talconfig.yaml", TALCONFIG);
    let ran = c.run(&["import", "talhelper", &src], &[]);
    c.refused(&ran, &[1], "talenv.yaml", &[]);
}

/// 100 000 levels of nesting in a patch, in each shape the review tried:
/// refused (exit 2, naming the patch and the rule) by the input gate before
/// any reader hands the text to serde's parser, which scans deep flow
/// nesting in quadratic time (a minute for each, and the redaction set's
/// reading of patches came first).
#[test]
fn deep_nesting_in_a_patch_is_refused_in_every_shape() {
    const N: usize = 100_000;
    let c = Case::new();
    let shapes = [
        (
            "flow-maps.yaml",
            format!("a: {}x{}", "{b: ".repeat(N), "}".repeat(N)),
        ),
        (
            "json.yaml",
            format!("{}1{}", "{\"a\": ".repeat(N), "}".repeat(N)),
        ),
        ("mixed.yaml", format!("k: {}", "[{a: ".repeat(N))),
        ("seqs.yaml", format!("{}[]\n", "[".repeat(N))),
        ("block.yaml", format!("{}x\n", "- ".repeat(N))),
        ("keys.yaml", format!("{}x\n", "? ".repeat(N))),
        (
            "tab-first.yaml",
            format!("a: 1\n\tb: 2\nc: {}x\n", "{d: ".repeat(N)),
        ),
    ];
    for (file, text) in shapes {
        c.write(&format!("in/{file}"), text);
        let config = c.inventory(with_patch(file));
        let ran = c.run(&["--config", &config, "validate"], &[]);
        c.refused(&ran, &[2], file, &[]);
        assert!(
            ran.stderr.contains("nested deeper than 64"),
            "{file}: {}",
            ran.stderr
        );
    }
}

fn indent(s: &str) -> String {
    s.lines().map(|l| format!("  {l}\n")).collect()
}

#[test]
fn a_network_bomb_in_meta_is_not_unfolded() {
    let c = Case::new();
    let fx = c.path("out/fx");
    let ok = Command::new(root().join("fixtures/make-images.sh"))
        .arg(&fx)
        .output()
        .unwrap();
    assert!(ok.status.success());
    let img = fx.join("dual-boot.raw");
    let value = c.write("in/bomb.yaml", alias_bomb(9));
    let set = c.run(
        &[
            "meta",
            "set",
            "--key",
            "10",
            "--value-file",
            &value,
            img.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(set.code, Some(0), "{}", set.all());
    let ran = c.run(&["inspect", img.to_str().unwrap()], &[]);
    c.bounded(&ran);
    assert_eq!(ran.code, Some(0), "{}", ran.all());
}

#[test]
fn escapes_in_partition_names_and_meta_are_shown_escaped() {
    let c = Case::new();
    let img = c.path("out/esc.raw");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(8 << 20)
        .unwrap();
    let ok = Command::new("sgdisk")
        .args(["-n1:2048:+1M", "-c1:\x1b[2JEVIL", "-n2:0:+1M", "-c2:META"])
        .arg(&img)
        .output()
        .unwrap();
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let value = c.write("in/v", "\x1b]0;owned\x07hello");
    let set = c.run(
        &[
            "meta",
            "set",
            "--key",
            "12",
            "--value-file",
            &value,
            img.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(set.code, Some(0), "{}", set.all());
    let ran = c.run(&["inspect", img.to_str().unwrap()], &[]);
    c.bounded(&ran);
    assert!(ran.stdout.contains("\\u{1b}[2JEVIL"), "{}", ran.stdout);
    assert!(
        ran.stdout.contains("\\u{1b}]0;owned\\u{7}hello"),
        "{}",
        ran.stdout
    );
}

// ---- 5: the Proxmox endpoint ---------------------------------------------

#[test]
fn a_proxmox_endpoint_with_credentials_path_or_query_is_refused() {
    let c = Case::new();
    let config =
        c.inventory(|t| format!("{t}\npublish:\n  proxmox:\n    node: pve\n    storage: local\n"));
    for (endpoint, what) in [
        (
            "https://user:PASSMARK@127.0.0.1:9/",
            "user name or password",
        ),
        ("https://127.0.0.1:9/PASSMARK", "the path must be"),
        ("https://127.0.0.1:9/?ticket=PASSMARK", "no query"),
        ("https://127.0.0.1:9/api2/json#PASSMARK", "no query"),
    ] {
        let ran = c.run(
            &["--config", &config, "publish", "--out-dir", &c.s("out/img")],
            &[
                ("PROXMOX_VE_ENDPOINT", endpoint),
                ("PROXMOX_VE_API_TOKEN", "root@pam!ci=TOKENMARK-0000"),
            ],
        );
        c.refused(
            &ran,
            &[1, 2],
            "PROXMOX_VE_ENDPOINT",
            &["PASSMARK", "TOKENMARK"],
        );
        assert!(ran.stderr.contains(what), "{}", ran.stderr);
    }
}

// ---- 21, 22: concurrency -------------------------------------------------

#[test]
fn concurrent_configs_on_a_fresh_state_dir_make_no_bundle() {
    let c = Case::new();
    let config = c.inventory(|t| t);
    // Started together, so they race for the fresh state dir: none makes
    // secrets (only `secrets gen` and `--new-secrets` do), each says so.
    let children: Vec<_> = ["cp-01", "cp-02", "cp-03", "worker-01"]
        .iter()
        .map(|node| {
            Command::new(env!("CARGO_BIN_EXE_imgbuild"))
                .args([
                    "--config",
                    &config,
                    "config",
                    node,
                    "--state-dir",
                    &c.s("out/fresh"),
                ])
                .env_remove("IMGBUILD_CONFIG")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for child in children {
        let o = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(err.contains("no cluster secrets"), "{err}");
    }
    assert!(!c.path("out/fresh/secrets.yaml").exists());
}

#[test]
fn concurrent_builds_into_one_out_dir_keep_every_entry() {
    let c = Case::new();
    let fx = c.path("out/fx");
    let ok = Command::new(root().join("fixtures/make-images.sh"))
        .arg(&fx)
        .output()
        .unwrap();
    assert!(ok.status.success());
    let raw = std::fs::read(fx.join("dual-boot.raw")).unwrap();
    let url = factory(zstd::encode_all(&raw[..], 3).unwrap());
    let config = c.inventory(|t| t);
    let build = |nodes: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_imgbuild"))
            .args(["--config", &config, "build"])
            .args(nodes)
            .args(["--route", "factory", "--factory", &url, "--quiet"])
            .args([
                "--out-dir",
                &c.s("out/img"),
                "--cache-dir",
                &c.s("out/cache"),
            ])
            .env_remove("IMGBUILD_CONFIG")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let a = build(&["cp-01", "cp-02"]);
    let b = build(&["cp-03", "worker-01"]);
    for child in [a, b] {
        let o = child.wait_with_output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(c.path("out/img/manifest.json")).unwrap()).unwrap();
    let nodes: Vec<_> = manifest["images"].as_object().unwrap().keys().collect();
    assert_eq!(
        nodes,
        ["cp-01", "cp-02", "cp-03", "worker-01"],
        "{manifest}"
    );
}

// ---- 23: messages that said the wrong thing ------------------------------

#[test]
fn a_byte_order_mark_is_read_past() {
    let c = Case::new();
    let config = c.inventory(|t| format!("\u{feff}{t}"));
    let ran = c.run(&["--config", &config, "validate"], &[]);
    c.bounded(&ran);
    assert_eq!(ran.code, Some(0), "{}", ran.all());
}

#[test]
fn a_repeated_key_is_reported_where_it_repeats() {
    let c = Case::new();
    let config = c.inventory(|t| format!("{t}\ncluster:\n  name: other\n"));
    let line = std::fs::read_to_string(&config).unwrap().lines().count() - 1;
    let ran = c.run(&["--config", &config, "validate"], &[]);
    c.refused(&ran, &[2], "cluster.yaml", &[]);
    assert!(
        ran.stderr
            .contains(&format!("line {line}: key \"cluster\" appears twice")),
        "{}",
        ran.stderr
    );
}

#[test]
fn numbers_past_what_proxmox_and_the_kernel_take_are_refused() {
    let c = Case::new();
    let vm = |first: &str, memory: &str, disk: &str| {
        let (first, memory, disk) = (first.to_owned(), memory.to_owned(), disk.to_owned());
        move |t: String| {
            format!(
                "{t}\npublish:\n  proxmox:\n    node: pve\n    storage: local\n    vm:\n      storage: local-lvm\n      firstId: {first}\n      memory: {memory}\n      diskSize: {disk}\n"
            )
        }
    };
    for (edit, field) in [
        (vm("4294967295", "4096", "20"), "firstId"),
        (vm("999999998", "4096", "20"), "firstId"),
        (vm("100", "4294967295", "20"), "memory"),
        (vm("100", "4096", "4294967295"), "diskSize"),
    ] {
        let config = c.inventory(edit);
        let ran = c.run(&["--config", &config, "validate"], &[]);
        c.refused(&ran, &[2], "cluster.yaml", &[]);
        assert!(
            ran.stderr.contains(&format!("publish.proxmox.vm.{field}")),
            "{}",
            ran.stderr
        );
        assert!(!ran.stderr.contains("no vmid"), "{}", ran.stderr);
    }
    // A kernel argument of 3 MB: refused by length, not echoed whole.
    let arg = format!("a={}", "x".repeat(3 << 20));
    let config = c.inventory(|t| {
        t.replace(
            "  format: raw\n",
            &format!("  format: raw\n  kernelArgs: [{arg}]\n"),
        )
    });
    let ran = c.run(&["--config", &config, "validate"], &[]);
    c.refused(&ran, &[2], "cluster.yaml", &[]);
    assert!(ran.stderr.contains("image.kernelArgs"), "{}", ran.stderr);
    assert!(
        ran.all().len() < 4096,
        "{} bytes of output",
        ran.all().len()
    );
    // A 10 MB one: the file is too large to be an inventory.
    let arg = format!("a={}", "x".repeat(10 << 20));
    let config = c.inventory(|t| {
        t.replace(
            "  format: raw\n",
            &format!("  format: raw\n  kernelArgs: [{arg}]\n"),
        )
    });
    let ran = c.run(&["--config", &config, "validate"], &[]);
    c.refused(&ran, &[2], "cluster.yaml", &[]);
    assert!(ran.stderr.contains("larger than"), "{}", ran.stderr);
}

#[test]
fn an_out_dir_that_is_a_file_is_named_as_such() {
    let c = Case::new();
    let file = c.write("out/img", "a file");
    let config = c.inventory(|t| t);
    let ran = c.run(
        &[
            "--config",
            &config,
            "build",
            "--factory",
            "http://127.0.0.1:9",
            "--out-dir",
            &file,
            "--quiet",
        ],
        &[],
    );
    c.refused(&ran, &[1], &file, &[]);
    assert!(
        ran.stderr.contains("is a file, not a folder"),
        "{}",
        ran.stderr
    );
}

#[test]
fn a_manifest_may_name_its_images_with_a_leading_dot() {
    let c = Case::new();
    let image = c.write("out/cp-01.raw", "image bytes");
    use sha2::Digest;
    let sha = hex::encode(sha2::Sha256::digest(std::fs::read(&image).unwrap()));
    let manifest = serde_json::json!({"images": {"cp-01": {
        "node": "cp-01", "route": "factory", "schematicId": "a".repeat(64),
        "talosVersion": "v1.11.2", "platform": "metal", "arch": "amd64", "format": "raw",
        "size": 11, "sha256": sha, "path": "./cp-01.raw", "sourceUrl": "http://127.0.0.1:9/x",
    }}});
    c.write("out/manifest.json", manifest.to_string());
    let ran = c.run(&["verify", "--out-dir", &c.s("out")], &[]);
    c.bounded(&ran);
    assert_eq!(ran.code, Some(0), "{}", ran.all());
}
