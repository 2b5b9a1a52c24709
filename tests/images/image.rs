//! End to end: `patch`, `meta` and `inspect` on Talos-shaped raw and qcow2
//! images built by `fixtures/make-images.sh`, judged by qemu-img and sgdisk.

use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use crate::common;
use common::otherfs::other_fs;
use common::{atlas_copy, imgbuild, root, text};

const ATLAS: &str = "examples/atlas/cluster.yaml";

/// The fixtures, built once per test run (raw by the script, qcow2 by qemu-img).
fn fixtures() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        run_ok(Command::new(root().join("fixtures/make-images.sh")).arg(dir.path()));
        for name in ["dual-boot", "grub"] {
            run_ok(
                Command::new("qemu-img")
                    .args(["convert", "-f", "raw", "-O", "qcow2"])
                    .arg(dir.path().join(format!("{name}.raw")))
                    .arg(dir.path().join(format!("{name}.qcow2"))),
            );
        }
        dir
    })
    .path()
}

fn run_ok(cmd: &mut Command) -> Output {
    let o = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        o.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

fn sha(path: &Path) -> String {
    let mut h = Sha256::new();
    let mut f = File::open(path).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match f.read(&mut buf).unwrap() {
            0 => break,
            n => h.update(&buf[..n]),
        }
    }
    hex::encode(h.finalize())
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// `imgbuild patch` of `base` for `node` into `out`, on the atlas inventory.
fn patch(base: &Path, node: &str, out: &Path) -> Output {
    patch_with(Path::new(ATLAS), base, node, out)
}

/// `imgbuild patch` with another inventory.
fn patch_with(config: &Path, base: &Path, node: &str, out: &Path) -> Output {
    imgbuild(&[
        "--config",
        p(config),
        "patch",
        "--base",
        p(base),
        "--node",
        node,
        "--out",
        p(out),
    ])
}

/// A scratch copy of a fixture.
fn scratch(name: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(name);
    std::fs::copy(fixtures().join(name), &path).unwrap();
    (dir, path)
}

fn inspect_json(image: &Path) -> serde_json::Value {
    let o = imgbuild(&["inspect", p(image), "--output", "json"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

fn meta_of(v: &serde_json::Value, key: u64) -> Option<serde_json::Value> {
    v["meta"]["tags"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["key"] == key)
        .cloned()
}

/// Byte ranges where two raw files differ, compared in 1 MiB chunks.
fn differing_range(a: &Path, b: &Path) -> Option<(u64, u64)> {
    let (mut fa, mut fb) = (File::open(a).unwrap(), File::open(b).unwrap());
    assert_eq!(
        fa.metadata().unwrap().len(),
        fb.metadata().unwrap().len(),
        "sizes differ"
    );
    let (mut ba, mut bb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    let (mut first, mut last, mut off) = (None, 0, 0u64);
    loop {
        let n = fa.read(&mut ba).unwrap();
        if n == 0 {
            break;
        }
        fb.read_exact(&mut bb[..n]).unwrap();
        for i in 0..n {
            if ba[i] != bb[i] {
                first.get_or_insert(off + i as u64);
                last = off + i as u64;
            }
        }
        off += n as u64;
    }
    first.map(|f| (f, last))
}

fn meta_range(image: &Path) -> (u64, u64) {
    let v = inspect_json(image);
    let meta = v["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "META")
        .unwrap()
        .clone();
    let off = meta["offset"].as_u64().unwrap();
    (off, off + meta["size"].as_u64().unwrap())
}

fn check_patched(base: &Path, out: &Path, address: &str) {
    if out.extension().is_some_and(|e| e == "qcow2") {
        run_ok(Command::new("qemu-img").args(["check", p(out)]));
        let raw_base = out.with_extension("base.raw");
        let raw_out = out.with_extension("out.raw");
        run_ok(Command::new("qemu-img").args(["convert", "-O", "raw", p(base), p(&raw_base)]));
        run_ok(Command::new("qemu-img").args(["convert", "-O", "raw", p(out), p(&raw_out)]));
        let sg = run_ok(Command::new("sgdisk").args(["-v", p(&raw_out)]));
        assert!(
            text(&sg.stdout).contains("No problems found"),
            "{}",
            text(&sg.stdout)
        );
        let (lo, hi) = differing_range(&raw_base, &raw_out).expect("META should differ");
        let (mlo, mhi) = meta_range(out);
        assert!(
            lo >= mlo && hi < mhi - 1024,
            "diff {lo}..{hi} outside META {mlo}..{mhi}"
        );
    } else {
        let sg = run_ok(Command::new("sgdisk").args(["-v", p(out)]));
        assert!(
            text(&sg.stdout).contains("No problems found"),
            "{}",
            text(&sg.stdout)
        );
        let (lo, hi) = differing_range(base, out).expect("META should differ");
        let (mlo, mhi) = meta_range(out);
        assert!(
            lo >= mlo && hi < mhi - 1024,
            "diff {lo}..{hi} outside META {mlo}..{mhi}"
        );
    }
    let v = inspect_json(out);
    let k10 = meta_of(&v, 10).expect("key 10");
    assert_eq!(k10["network"]["addresses"][0], address);
    assert_eq!(k10["name"], "MetalNetworkPlatformConfig");
}

/// Patches `base` for `node`; the base must not change, the output must pass
/// [`check_patched`] and keep key 17.
fn patch_keeps_key_17(base_name: &str, node: &str, out_name: &str, address: &str) -> PathBuf {
    let out_dir = tempfile::tempdir().unwrap().keep();
    let out = out_dir.join(out_name);
    let base = fixtures().join(base_name);
    let before = sha(&base);
    let o = patch(&base, node, &out);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(sha(&base), before, "base changed");
    check_patched(&base, &out, address);
    assert_eq!(
        meta_of(&inspect_json(&out), 17).unwrap()["value"],
        "dual-boot"
    );
    out
}

#[test]
fn patch_raw_writes_only_meta_and_keeps_key_17() {
    let out = patch_keeps_key_17("dual-boot.raw", "cp-01", "cp-01.raw", "10.0.0.11/16");
    // Holes stay holes.
    use std::os::unix::fs::MetadataExt;
    assert!(out.metadata().unwrap().blocks() * 512 < 4 << 20);
    std::fs::remove_dir_all(out.parent().unwrap()).unwrap();
}

#[test]
fn patch_across_filesystems_keeps_the_output_sparse() {
    use std::os::unix::fs::MetadataExt;
    let disk = tempfile::tempdir().unwrap();
    let Some(mem) = other_fs(disk.path()) else {
        return;
    };
    let fixture = fixtures().join("dual-boot.raw");
    let data = fixture.metadata().unwrap().blocks() * 512;
    // The base on tmpfs and the output on disk, then the reverse.
    for (base_fs, out_fs) in [(mem.path(), disk.path()), (disk.path(), mem.path())] {
        let base = base_fs.join("base.raw");
        run_ok(
            Command::new("cp")
                .arg("--sparse=always")
                .arg(&fixture)
                .arg(&base),
        );
        let out = out_fs.join("cp-02.raw");
        let o = patch(&base, "cp-02", &out);
        assert!(o.status.success(), "{}", text(&o.stderr));
        check_patched(&base, &out, "10.0.0.12/16");
        let meta = out.metadata().unwrap();
        assert_eq!(meta.len(), fixture.metadata().unwrap().len());
        // The data plus at most META's two ADV copies: not the 32 MiB.
        let allocated = meta.blocks() * 512;
        assert!(
            allocated <= data + 512 * 1024,
            "{}: {allocated} bytes allocated, the base has {data} of data",
            out.display()
        );
        std::fs::remove_file(&base).unwrap();
        std::fs::remove_file(&out).unwrap();
    }
}

#[test]
fn patch_qcow2_passes_qemu_img_check_and_keeps_key_17() {
    let out = patch_keeps_key_17(
        "dual-boot.qcow2",
        "worker-01",
        "worker-01.qcow2",
        "10.0.0.21/16",
    );
    std::fs::remove_dir_all(out.parent().unwrap()).unwrap();
}

#[test]
fn patch_of_a_grub_image_with_empty_meta_starts_a_fresh_adv() {
    let out_dir = tempfile::tempdir().unwrap();
    let out = out_dir.path().join("cp-03.raw");
    let base = fixtures().join("grub.raw");
    let o = patch(&base, "cp-03", &out);
    assert!(o.status.success(), "{}", text(&o.stderr));
    check_patched(&base, &out, "10.0.0.13/16");
    assert!(meta_of(&inspect_json(&out), 17).is_none());
}

#[test]
fn meta_set_get_delete_round_trip_on_raw_and_qcow2() {
    for name in ["dual-boot.raw", "dual-boot.qcow2"] {
        let (dir, img) = scratch(name);
        let value = dir.path().join("v");
        std::fs::write(&value, "hello\nworld\n").unwrap();
        let o = imgbuild(&[
            "meta",
            "set",
            p(&img),
            "--key",
            "0xc",
            "--value-file",
            p(&value),
        ]);
        assert!(o.status.success(), "{name}: {}", text(&o.stderr));
        let o = imgbuild(&["meta", "get", p(&img), "--key", "12"]);
        assert_eq!(text(&o.stdout), "hello\nworld\n", "{name}");
        let o = imgbuild(&["meta", "get", p(&img), "--key", "17"]);
        assert_eq!(text(&o.stdout), "dual-boot", "{name}: key 17 must survive");
        let o = imgbuild(&[
            "meta",
            "set",
            p(&img),
            "--key",
            "0xc",
            "--value-file",
            p(&value),
            "--output",
            "json",
        ]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(
            v["changed"], false,
            "{name}: setting the same value changes nothing"
        );
        let o = imgbuild(&["meta", "delete", p(&img), "--key", "12"]);
        assert!(o.status.success());
        let o = imgbuild(&["meta", "get", p(&img), "--key", "12"]);
        assert_eq!(o.status.code(), Some(1));
        assert!(text(&o.stderr).contains("no key 12"), "{}", text(&o.stderr));
        // Set then delete leaves exactly the fixture's ADV, which an
        // independent encoder wrote: the image equals the fixture again.
        if name.ends_with("qcow2") {
            run_ok(Command::new("qemu-img").args(["check", p(&img)]));
            let raw = dir.path().join("back.raw");
            run_ok(Command::new("qemu-img").args(["convert", "-O", "raw", p(&img), p(&raw)]));
            assert_eq!(
                differing_range(&fixtures().join("dual-boot.raw"), &raw),
                None
            );
        } else {
            run_ok(Command::new("sgdisk").args(["-v", p(&img)]));
            assert_eq!(differing_range(&fixtures().join(name), &img), None);
        }
    }
}

#[test]
fn oversized_values_are_refused_and_the_image_is_untouched() {
    let (dir, img) = scratch("dual-boot.raw");
    let value = dir.path().join("big");
    // Less than one ADV copy (so it is read), more than its tags can hold.
    std::fs::write(&value, vec![b'x'; 262_100]).unwrap();
    let before = sha(&img);
    let o = imgbuild(&[
        "meta",
        "set",
        p(&img),
        "--key",
        "10",
        "--value-file",
        p(&value),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o.stderr).contains(&format!("{}: META is full", img.display())),
        "{}",
        text(&o.stderr)
    );
    assert_eq!(sha(&img), before);
}

/// A bad input: a clear error naming it, exit 1, input untouched, no output.
fn refused(input: &Path, want: &str) {
    let before = sha(input);
    let out_dir = tempfile::tempdir().unwrap();
    let out = out_dir.path().join("out.img");
    let o = patch(input, "cp-01", &out);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    assert!(
        err.contains(p(input)) && err.contains(want),
        "want {want:?} in: {err}"
    );
    assert_eq!(sha(input), before, "input changed");
    assert_eq!(
        std::fs::read_dir(out_dir.path()).unwrap().count(),
        0,
        "output left behind"
    );
    let o = imgbuild(&["inspect", p(input)]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o.stderr).contains(want),
        "inspect: {}",
        text(&o.stderr)
    );
    let o = imgbuild(&["meta", "delete", p(input), "--key", "10"]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(sha(input), before, "input changed by meta delete");
}

#[test]
fn bad_inputs_are_refused_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let not_found = dir.path().join("not-found.raw");
    std::fs::write(&not_found, "Not Found").unwrap();
    refused(&not_found, "not a disk image (9 bytes");

    let zeros = dir.path().join("zeros.raw");
    File::create(&zeros).unwrap().set_len(4 << 20).unwrap();
    refused(&zeros, "not a disk image");

    refused(
        &fixtures().join("no-meta.raw"),
        "no partition named META (partitions: EFI, BOOT)",
    );
    refused(
        &fixtures().join("meta-2mib.raw"),
        "META partition is 2097152 bytes",
    );

    // The fixture cut short at `len` bytes, under another name.
    let cut = |name: &str, len: u64| {
        let path = dir.path().join(name);
        std::fs::copy(fixtures().join("dual-boot.raw"), &path).unwrap();
        File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(len)
            .unwrap();
        path
    };
    refused(
        &cut("truncated.raw", 19 << 20),
        "truncated: the disk its GPT describes (up to the backup header) ends at byte 33554432 but the image has 19922944",
    );
    refused(
        &cut("cut-meta.raw", 18 << 20),
        "truncated: the disk its GPT describes",
    );

    // A GPT whose entry size the gpt crate would assert on, its header CRC
    // made right so the crate would use it: in the primary header alone,
    // the backup is read (as sgdisk does); in both, refused.
    let odd = |name: &str, both: bool| {
        use std::os::unix::fs::FileExt;
        let path = dir.path().join(name);
        std::fs::copy(fixtures().join("dual-boot.raw"), &path).unwrap();
        let f = File::options().read(true).write(true).open(&path).unwrap();
        let mut primary = [0u8; 92];
        f.read_exact_at(&mut primary, 512).unwrap();
        let backup_lba = u64::from_le_bytes(primary[32..40].try_into().unwrap());
        let headers = if both { vec![1, backup_lba] } else { vec![1] };
        for lba in headers {
            let mut h = [0u8; 92];
            f.read_exact_at(&mut h, lba * 512).unwrap();
            h[84..88].copy_from_slice(&256u32.to_le_bytes());
            h[16..20].fill(0);
            let mut crc = flate2::Crc::new();
            crc.update(&h);
            h[16..20].copy_from_slice(&crc.sum().to_le_bytes());
            f.write_all_at(&h, lba * 512).unwrap();
        }
        path
    };
    let one = odd("odd-primary.raw", false);
    let o = patch(&one, "cp-01", &dir.path().join("from-backup.raw"));
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    refused(&odd("odd-entries.raw", true), "partition entry size 256");
}

fn qemu_img_create(dir: &Path, name: &str, opts: &[&str]) -> PathBuf {
    let path = dir.join(name);
    run_ok(
        Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2"])
            .args(opts)
            .arg(&path)
            .arg("64M"),
    );
    path
}

#[test]
fn unsupported_qcow2_features_are_refused_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    refused(
        &qemu_img_create(d, "zstd.qcow2", &["-o", "compression_type=zstd"]),
        "zstd compression",
    );
    refused(
        &qemu_img_create(d, "l2.qcow2", &["-o", "extended_l2=on"]),
        "extended L2",
    );
    let sub = d.join("sub");
    std::fs::create_dir(&sub).unwrap();
    let base = qemu_img_create(d, "base.qcow2", &[]);
    refused(
        &qemu_img_create(
            &sub,
            "overlay.qcow2",
            &["-b", "../base.qcow2", "-F", "qcow2"],
        ),
        "has a backing file \"../base.qcow2\"",
    );
    refused(
        &qemu_img_create(&sub, "abs.qcow2", &["-b", p(&base), "-F", "qcow2"]),
        "reads only self-contained images",
    );
    let dirty = d.join("dirty.qcow2");
    std::fs::copy(fixtures().join("dual-boot.qcow2"), &dirty).unwrap();
    {
        use std::os::unix::fs::FileExt;
        let f = File::options().write(true).open(&dirty).unwrap();
        f.write_all_at(&1u64.to_be_bytes(), 72).unwrap();
    }
    refused(&dirty, "marked dirty");
    let v4 = d.join("v4.qcow2");
    std::fs::copy(fixtures().join("dual-boot.qcow2"), &v4).unwrap();
    {
        use std::os::unix::fs::FileExt;
        let f = File::options().write(true).open(&v4).unwrap();
        f.write_all_at(&4u32.to_be_bytes(), 4).unwrap();
    }
    refused(&v4, "qcow2 version 4");
}

#[test]
fn inspect_text_shows_partitions_and_key_names() {
    let o = imgbuild(&["inspect", p(&fixtures().join("dual-boot.qcow2"))]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let out = text(&o.stdout);
    assert!(out.contains("Qcow2, 33554432 bytes"), "{out}");
    for name in [
        "EFI",
        "BIOS",
        "BOOT",
        "META",
        "17 DiskImageBootloader: dual-boot",
    ] {
        assert!(out.contains(name), "{name} missing in {out}");
    }
}

#[test]
fn a_failed_patch_leaves_no_output() {
    // The output's folder does not exist: nothing may be created anywhere.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("missing/cp-01.raw");
    let o = patch(&fixtures().join("dual-boot.raw"), "cp-01", &out);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o.stderr).contains("missing/cp-01.raw"),
        "{}",
        text(&o.stderr)
    );
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn sigkill_mid_patch_leaves_no_output_and_the_rerun_sweeps_the_debris() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("big.raw");
    File::create(&base).unwrap().set_len(2 << 30).unwrap();
    run_ok(Command::new("sgdisk").args([
        "-n1:2048:+1500M",
        "-c1:BOOT",
        "-n2:0:+1M",
        "-c2:META",
        p(&base),
    ]));
    // 600 MiB of written (non-hole) data so the copy takes a while.
    run_ok(Command::new("dd").args([
        "if=/dev/zero",
        &format!("of={}", p(&base)),
        "bs=1M",
        "seek=1",
        "count=600",
        "conv=notrunc",
        "status=none",
    ]));
    let out_dir = dir.path().join("out");
    std::fs::create_dir(&out_dir).unwrap();
    let out = out_dir.join("cp-01.raw");
    let mut child = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
        .args([
            "--config",
            ATLAS,
            "patch",
            "--base",
            p(&base),
            "--node",
            "cp-01",
            "--out",
            p(&out),
        ])
        .current_dir(root())
        .spawn()
        .unwrap();
    let temp_seen = (0..2000).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(2));
        std::fs::read_dir(&out_dir)
            .unwrap()
            .flatten()
            .any(|e| e.file_name().to_string_lossy().contains(".tmp-"))
    });
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(temp_seen, "the patch never created its temporary file");
    if out.exists() {
        // Killed after the rename: the output must then be complete.
        check_patched(&base, &out, "10.0.0.11/16");
        std::fs::remove_file(&out).unwrap();
    }
    let o = patch(&base, "cp-01", &out);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let names: Vec<String> = std::fs::read_dir(&out_dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["cp-01.raw"], "debris left: {names:?}");
    assert_eq!(
        meta_of(&inspect_json(&out), 10).unwrap()["network"]["addresses"][0],
        "10.0.0.11/16"
    );
}

#[test]
fn patch_refuses_platforms_that_ignore_key_10() {
    let dir = tempfile::tempdir().unwrap();
    let inv = atlas_copy(dir.path(), "platform: metal", "platform: nocloud");
    let out = dir.path().join("cp-01.raw");
    let o = patch_with(&inv, &fixtures().join("dual-boot.raw"), "cp-01", &out);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o.stderr).contains("platform nocloud does not read META key 10"),
        "{}",
        text(&o.stderr)
    );
    assert!(!out.exists());
}

/// `imgbuild diff` says "identical" only for the same bytes, as cmp and
/// qemu-img compare judge them; the same tags in another ADV order are
/// equivalent but not identical: exit 1 with that said.
#[test]
fn diff_calls_identical_only_the_same_bytes() {
    let a = fixtures().join("two-tags.raw");
    // The same tags stored 12 then 17: deleting 17 and setting it again
    // puts it after 12.
    let (dir, b) = scratch("two-tags.raw");
    let value = dir.path().join("v");
    std::fs::write(&value, "dual-boot").unwrap();
    run_ok(Command::new(env!("CARGO_BIN_EXE_imgbuild")).args([
        "meta",
        "delete",
        p(&b),
        "--key",
        "17",
    ]));
    run_ok(Command::new(env!("CARGO_BIN_EXE_imgbuild")).args([
        "meta",
        "set",
        p(&b),
        "--key",
        "17",
        "--value-file",
        p(&value),
    ]));
    let order = |img: &Path| -> Vec<u64> {
        inspect_json(img)["meta"]["tags"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["key"].as_u64().unwrap())
            .collect()
    };
    assert_eq!(order(&a), [17, 12]);
    assert_eq!(order(&b), [12, 17]);
    let cmp = |x: &Path, y: &Path| Command::new("cmp").args([x, y]).output().unwrap().status;
    let qemu_compare = |x: &Path, y: &Path| {
        Command::new("qemu-img")
            .args(["compare", p(x), p(y)])
            .output()
            .unwrap()
            .status
    };
    assert!(!cmp(&a, &b).success());
    assert_eq!(qemu_compare(&a, &b).code(), Some(1));
    let o = imgbuild(&["diff", p(&a), p(&b)]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    assert_eq!(
        text(&o.stdout),
        "same META tags and partition contents, different bytes\n"
    );
    let o = imgbuild(&["diff", p(&a), p(&b), "--output", "json"]);
    assert_eq!(o.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        (&v["identical"], &v["equivalent"]),
        (&false.into(), &true.into()),
        "{v}"
    );
    assert_eq!(v["diff"]["sameBytes"], false, "{v}");

    // A copy, and the same disk as qcow2: identical, as cmp and qemu-img say.
    let copy = dir.path().join("copy.raw");
    std::fs::copy(&a, &copy).unwrap();
    let qcow2 = dir.path().join("a.qcow2");
    run_ok(Command::new("qemu-img").args(["convert", "-O", "qcow2", p(&a), p(&qcow2)]));
    assert!(cmp(&a, &copy).success());
    assert!(qemu_compare(&a, &qcow2).success());
    for other in [&copy, &qcow2] {
        let o = imgbuild(&["diff", p(&a), p(other)]);
        assert_eq!(o.status.code(), Some(0), "{}", text(&o.stdout));
        assert_eq!(text(&o.stdout), "identical: the same bytes\n");
    }
    // One byte outside every partition: same tags and contents, other bytes.
    std::os::unix::fs::FileExt::write_all_at(
        &File::options().write(true).open(&copy).unwrap(),
        b"X",
        std::fs::metadata(&copy).unwrap().len() - 40 * 512,
    )
    .unwrap();
    assert_eq!(qemu_compare(&a, &copy).code(), Some(1));
    let o = imgbuild(&["diff", p(&a), p(&copy)]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o.stdout).contains("different bytes"),
        "{}",
        text(&o.stdout)
    );
}
