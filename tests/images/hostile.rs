//! End to end: crafted images (issue 18) against every command that reads
//! or writes them — `inspect`, `meta`, `patch`, `diff`, `verify`, `build`.
//! Each must end by itself within 10 s with exit 1 or 2 and one message
//! naming the file: no panic, no signal, peak RSS under 64 MiB, nothing
//! written anywhere. The crafted files are made here, at run time, from the
//! fixture script's images by the `craft` generator below.
// A test's stderr is libtest's to capture, not the CLI's one writer.
#![allow(clippy::disallowed_macros)]

use std::ffi::OsString;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use crate::common;
use common::run::Run;
use common::{root, sim_bin, text};

const MAX_RSS_KIB: i64 = 64 * 1024;
const MAX_SECS: f64 = 10.0;

/// The generator of hostile images: each function copies a fixture and
/// changes a few fields, keeping every checksum right where the point is to
/// get past a check (a GPT CRC) to the code behind it.
mod craft {
    use super::*;

    /// The fixture script's images plus qcow2 conversions, made once.
    pub fn fixtures() -> &'static Path {
        static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
        DIR.get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            run_ok(Command::new(root().join("fixtures/make-images.sh")).arg(dir.path()));
            for (name, cluster) in [("dual-boot", "64k"), ("cluster-512", "512")] {
                run_ok(
                    Command::new("qemu-img")
                        .args(["convert", "-f", "raw", "-O", "qcow2", "-o"])
                        .arg(format!("cluster_size={cluster}"))
                        .arg(dir.path().join("dual-boot.raw"))
                        .arg(dir.path().join(format!("{name}.qcow2"))),
                );
            }
            dir
        })
        .path()
    }

    pub fn run_ok(cmd: &mut Command) {
        let o = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
        assert!(o.status.success(), "{cmd:?}: {}", text(&o.stderr));
    }

    /// A copy of fixture `name` at `to`.
    pub fn copy(name: &str, to: &Path) -> PathBuf {
        std::fs::copy(fixtures().join(name), to).unwrap();
        to.to_owned()
    }

    fn crc32(b: &[u8]) -> u32 {
        let mut c = flate2::Crc::new();
        c.update(b);
        c.sum()
    }

    fn le32(b: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
    }

    fn le64(b: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
    }

    /// The byte offsets of the two GPT headers of a raw image.
    fn header_offsets(f: &std::fs::File) -> [u64; 2] {
        [512, f.metadata().unwrap().len() - 512]
    }

    /// Rewrites GPT header `which` (0 primary, 1 backup) through `edit`,
    /// then sets its CRC right (or, with `break_crc`, wrong).
    pub fn gpt_header(path: &Path, which: usize, break_crc: bool, edit: impl FnOnce(&mut [u8])) {
        let f = rw(path);
        let at = header_offsets(&f)[which];
        let mut h = [0u8; 92];
        f.read_exact_at(&mut h, at).unwrap();
        edit(&mut h);
        h[16..20].fill(0);
        let crc = crc32(&h) ^ u32::from(break_crc);
        h[16..20].copy_from_slice(&crc.to_le_bytes());
        f.write_all_at(&h, at).unwrap();
    }

    /// Rewrites partition entry `index` in both entry arrays through
    /// `edit`, then both headers' entry and header CRCs.
    pub fn gpt_entry(path: &Path, index: u64, edit: impl Fn(&mut [u8])) {
        let f = rw(path);
        for at in header_offsets(&f) {
            let mut h = [0u8; 92];
            f.read_exact_at(&mut h, at).unwrap();
            let (table, count) = (le64(&h, 72) * 512, le32(&h, 80) as usize);
            let mut entries = vec![0u8; count * 128];
            f.read_exact_at(&mut entries, table).unwrap();
            edit(&mut entries[index as usize * 128..][..128]);
            f.write_all_at(&entries, table).unwrap();
            h[88..92].copy_from_slice(&crc32(&entries).to_le_bytes());
            h[16..20].fill(0);
            let crc = crc32(&h);
            h[16..20].copy_from_slice(&crc.to_le_bytes());
            f.write_all_at(&h, at).unwrap();
        }
    }

    /// dual-boot.raw's partitions: EFI, BIOS, BOOT, META (entries 0..=3).
    pub const BOOT: u64 = 2;
    pub const META: u64 = 3;

    pub fn lbas(entry: &mut [u8], first: u64, last: u64) {
        entry[32..40].copy_from_slice(&first.to_le_bytes());
        entry[40..48].copy_from_slice(&last.to_le_bytes());
    }

    pub fn name(entry: &mut [u8], name: &str) {
        entry[56..128].fill(0);
        for (i, u) in name.encode_utf16().enumerate() {
            entry[56 + 2 * i..58 + 2 * i].copy_from_slice(&u.to_le_bytes());
        }
    }

    pub fn first_lba(path: &Path, index: u64) -> u64 {
        let f = std::fs::File::open(path).unwrap();
        let mut e = [0u8; 128];
        f.read_exact_at(&mut e, 1024 + index * 128).unwrap();
        le64(&e, 32)
    }

    /// Writes big-endian `bytes` at `at` (a qcow2 header field).
    pub fn poke(path: &Path, at: u64, bytes: &[u8]) {
        rw(path).write_all_at(bytes, at).unwrap();
    }

    fn rw(path: &Path) -> std::fs::File {
        std::fs::File::options()
            .read(true)
            .write(true)
            .open(path)
            .unwrap()
    }

    /// A qcow2 with 2 MiB clusters and a 1 PiB virtual size whose GPT spans
    /// it: a few hundred KiB of file, 1 PiB of partition to compare.
    pub fn petabyte_qcow2(dir: &Path, file: &str) -> PathBuf {
        const SECTORS: u64 = 1 << 41; // 1 PiB
        let raw = dir.join(format!("{file}.raw"));
        let mut img = vec![0u8; 1 << 20];
        img[510] = 0x55;
        img[511] = 0xaa;
        let mut entries = vec![0u8; 128 * 128];
        let linux: [u8; 16] = [
            0xaf, 0x3d, 0xc6, 0x0f, 0x83, 0x84, 0x72, 0x47, 0x8e, 0x79, 0x3d, 0x69, 0xd8, 0x47,
            0x7d, 0xe4,
        ];
        let parts = [("META", 2048, 4095), ("STATE", 4096, SECTORS - 34)];
        for (i, (n, first, last)) in parts.iter().enumerate() {
            let e = &mut entries[i * 128..][..128];
            e[..16].copy_from_slice(&linux);
            e[16] = i as u8 + 1; // a unique partition GUID
            lbas(e, *first, *last);
            name(e, n);
        }
        img[1024..1024 + entries.len()].copy_from_slice(&entries);
        let h = &mut img[512..604];
        h[..8].copy_from_slice(b"EFI PART");
        h[8..12].copy_from_slice(&0x0001_0000u32.to_le_bytes());
        h[12..16].copy_from_slice(&92u32.to_le_bytes());
        h[24..32].copy_from_slice(&1u64.to_le_bytes());
        h[32..40].copy_from_slice(&(SECTORS - 1).to_le_bytes());
        h[40..48].copy_from_slice(&34u64.to_le_bytes());
        h[48..56].copy_from_slice(&(SECTORS - 34).to_le_bytes());
        h[56] = 1; // disk GUID
        h[72..80].copy_from_slice(&2u64.to_le_bytes());
        h[80..84].copy_from_slice(&128u32.to_le_bytes());
        h[84..88].copy_from_slice(&128u32.to_le_bytes());
        h[88..92].copy_from_slice(&crc32(&entries).to_le_bytes());
        let crc = crc32(h);
        h[16..20].copy_from_slice(&crc.to_le_bytes());
        std::fs::write(&raw, &img).unwrap();
        let q = dir.join(format!("{file}.qcow2"));
        run_ok(
            Command::new("qemu-img")
                .args(["convert", "-q", "-f", "raw", "-O", "qcow2"])
                .args(["-o", "cluster_size=2M"])
                .arg(&raw)
                .arg(&q),
        );
        run_ok(
            Command::new("qemu-img")
                .args(["resize", "-q"])
                .arg(&q)
                .arg("1P"),
        );
        std::fs::remove_file(raw).unwrap();
        q
    }
}

/// How one run of the binary ended.
struct Ran {
    args: Vec<OsString>,
    /// The wait status: exit code or signal.
    status: std::process::ExitStatus,
    stdout: String,
    stderr: String,
    max_rss_kib: i64,
    secs: f64,
}

/// Runs imgbuild in `work` (its HOME and TMPDIR inside it too), measured
/// ([`Run::measured`]), killed after 30 s.
fn run(work: &Path, args: &[&dyn AsRef<std::ffi::OsStr>]) -> Ran {
    let args: Vec<OsString> = args.iter().map(|a| a.as_ref().to_owned()).collect();
    let m = Run::new(&[])
        .args(&args)
        .current_dir(work)
        .env("HOME", work.join("home"))
        .env("TMPDIR", work.join("tmp"))
        .env("XDG_CACHE_HOME", work.join("home/.cache"))
        .measured(Duration::from_secs(30));
    assert!(
        m.signal.is_none(),
        "imgbuild {args:?} was killed: {}",
        m.report
    );
    Ran {
        args,
        status: m.status,
        stdout: m.stdout,
        stderr: m.stderr,
        max_rss_kib: m.rss_kib,
        secs: m.took.as_secs_f64(),
    }
}

impl Ran {
    fn what(&self) -> String {
        format!(
            "imgbuild {:?}: {:?} in {:.2} s, {} KiB\nstdout: {}\nstderr: {}",
            self.args, self.status, self.secs, self.max_rss_kib, self.stdout, self.stderr
        )
    }

    /// Ended by itself, quickly, small, without a panic.
    fn bounded(&self) -> &Self {
        // Shown with --nocapture: what each run took.
        eprintln!(
            "{:?}: exit {:?}, {:.2} s, {} KiB",
            self.args,
            self.status.code(),
            self.secs,
            self.max_rss_kib
        );
        let all = format!("{}{}", self.stdout, self.stderr);
        assert!(self.status.code().is_some(), "killed: {}", self.what());
        assert!(
            !all.contains("panicked") && !all.contains("RUST_BACKTRACE"),
            "{}",
            self.what()
        );
        assert!(self.secs < MAX_SECS, "too slow: {}", self.what());
        assert!(self.max_rss_kib < MAX_RSS_KIB, "too big: {}", self.what());
        self
    }

    /// Exit 1 or 2 with one line of error naming `file` and saying `want`.
    fn refused(&self, file: &Path, want: &str) {
        self.bounded();
        assert!(
            matches!(self.status.code(), Some(1 | 2)),
            "not refused: {}",
            self.what()
        );
        let lines: Vec<&str> = self.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "one message: {}", self.what());
        let name = file.file_name().unwrap().to_str().unwrap();
        assert!(
            lines[0].starts_with("error: ") && lines[0].contains(name) && lines[0].contains(want),
            "want {name:?} and {want:?}: {}",
            self.what()
        );
    }
}

/// Every entry under `dir` with its kind, length and modification time (a
/// write changes the time; hashing every image each run would be slow).
fn snapshot(dir: &Path) -> Vec<(PathBuf, String)> {
    let mut acc = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let (path, meta) = (e.path(), e.metadata().unwrap());
            if meta.is_dir() {
                stack.push(path.clone());
            }
            let when = meta.modified().unwrap();
            acc.push((
                path,
                format!("{:?} {} {when:?}", meta.file_type(), meta.len()),
            ));
        }
    }
    acc.sort();
    acc
}

/// A scratch folder: `in/` for crafted inputs, `out/` for outputs, and
/// the HOME and TMPDIR the binary gets.
struct Work {
    dir: tempfile::TempDir,
}

impl Work {
    fn new() -> Work {
        let dir = tempfile::tempdir().unwrap();
        for d in ["in", "out", "home", "tmp"] {
            std::fs::create_dir(dir.path().join(d)).unwrap();
        }
        Work { dir }
    }
    fn path(&self) -> &Path {
        self.dir.path()
    }
    fn input(&self, name: &str) -> PathBuf {
        self.path().join("in").join(name)
    }
    fn out(&self, name: &str) -> PathBuf {
        self.path().join("out").join(name)
    }

    /// Runs `args`, then checks that nothing under the work folder changed
    /// (inputs untouched, no output, no temp file).
    fn refused(&self, args: &[&dyn AsRef<std::ffi::OsStr>], file: &Path, want: &str) {
        let before = snapshot(self.path());
        run(self.path(), args).refused(file, want);
        assert_eq!(snapshot(self.path()), before, "something was written");
    }

    /// The commands that read or write an image, each on `image`, each
    /// refused with `want`.
    fn every_command_refuses(&self, image: &Path, want: &str) {
        let value = self.input("value");
        std::fs::write(&value, b"x").unwrap();
        let good = craft::fixtures().join("dual-boot.raw");
        let config = root().join("examples/atlas/cluster.yaml");
        let out = self.out("node.raw");
        let cases: Vec<Vec<&dyn AsRef<std::ffi::OsStr>>> = vec![
            vec![&"inspect", &image],
            vec![&"inspect", &image, &"--output", &"json"],
            vec![&"meta", &"get", &image, &"--key", &"17"],
            vec![
                &"meta",
                &"set",
                &image,
                &"--key",
                &"12",
                &"--value-file",
                &value,
            ],
            vec![&"meta", &"delete", &image, &"--key", &"17"],
            vec![
                &"--config",
                &config,
                &"patch",
                &"--base",
                &image,
                &"--node",
                &"cp-01",
                &"--out",
                &out,
            ],
            vec![&"diff", &image, &good],
            vec![&"diff", &good, &image],
        ];
        for args in cases {
            if args[0].as_ref() == "inspect" && args.len() == 4 {
                // JSON mode: the one message is a JSON document on stdout.
                let before = snapshot(self.path());
                let ran = run(self.path(), &args);
                ran.bounded();
                assert_eq!(ran.status.code(), Some(1), "{}", ran.what());
                let v: serde_json::Value = serde_json::from_str(&ran.stdout).unwrap();
                let msg = v["error"].as_str().unwrap();
                assert!(msg.contains(want), "{}", ran.what());
                assert_eq!(snapshot(self.path()), before);
                continue;
            }
            self.refused(&args, image, want);
        }
    }
}

#[test]
fn gpt_backup_headers_the_crate_would_panic_on_are_refused() {
    let w = Work::new();
    // Item 9: a bad primary header, a backup with part_size = 0.
    let zero = craft::copy("dual-boot.raw", &w.input("backup-part-size-0.raw"));
    craft::gpt_header(&zero, 0, true, |_| {});
    craft::gpt_header(&zero, 1, false, |h| h[84..88].fill(0));
    w.every_command_refuses(&zero, "partition entry size 0");
    // Item 13: a backup claiming 2^26 entries (an 8 GiB table).
    let many = craft::copy("dual-boot.raw", &w.input("backup-2p26.raw"));
    craft::gpt_header(&many, 0, true, |_| {});
    craft::gpt_header(&many, 1, false, |h| {
        h[80..84].copy_from_slice(&(1u32 << 26).to_le_bytes())
    });
    w.every_command_refuses(&many, "67108864 partition entries");
    // Both headers bad: no GPT at all.
    let none = craft::copy("dual-boot.raw", &w.input("no-valid-header.raw"));
    craft::gpt_header(&none, 0, true, |_| {});
    craft::gpt_header(&none, 1, true, |_| {});
    w.every_command_refuses(&none, "neither the primary GPT header");
}

#[test]
fn partitions_on_the_gpt_or_on_each_other_are_refused() {
    let w = Work::new();
    // Item 19: META at LBA 0 would overwrite the MBR and the GPT header.
    let lba0 = craft::copy("dual-boot.raw", &w.input("meta-at-lba0.raw"));
    craft::gpt_entry(&lba0, craft::META, |e| craft::lbas(e, 0, 2047));
    w.every_command_refuses(&lba0, "spans LBA 0..=2047, outside the usable LBAs");
    // META starting inside BOOT.
    let overlap = craft::copy("dual-boot.raw", &w.input("meta-in-boot.raw"));
    let boot = craft::first_lba(&overlap, craft::BOOT);
    craft::gpt_entry(&overlap, craft::META, |e| {
        craft::lbas(e, boot + 100, boot + 2147)
    });
    w.every_command_refuses(&overlap, "(\"BOOT\") and 4 (\"META\") overlap");
    // A usable area that starts on the header itself.
    let usable = craft::copy("dual-boot.raw", &w.input("usable-from-0.raw"));
    craft::gpt_header(&usable, 0, false, |h| h[40..48].fill(0));
    w.every_command_refuses(&usable, "overlap the GPT's own structures");
}

#[test]
fn two_partitions_named_meta_are_refused_not_guessed() {
    // Item 23: BOOT renamed META; editing the first META silently is wrong.
    let w = Work::new();
    let two = craft::copy("dual-boot.raw", &w.input("two-meta.raw"));
    craft::gpt_entry(&two, craft::BOOT, |e| craft::name(e, "META"));
    let o = Command::new("sgdisk").arg("-v").arg(&two).output().unwrap();
    assert!(
        text(&o.stdout).contains("No problems found"),
        "{}",
        text(&o.stdout)
    );
    let want = "2 partitions are named META (#3, #4)";
    for args in [
        vec![&"inspect" as &dyn AsRef<std::ffi::OsStr>, &two],
        vec![&"meta", &"delete", &two, &"--key", &"17"],
    ] {
        w.refused(&args, &two, want);
    }
}

#[test]
fn qcow2_headers_qcow2_rs_would_crash_on_are_refused() {
    let w = Work::new();
    let q = |name: &str| craft::copy("dual-boot.qcow2", &w.input(name));
    // Item 7: refcount_table_clusters = 2^31 (SIGSEGV); item 13: 50k
    // clusters (3.2 GB).
    for clusters in [1u32 << 31, 50_000] {
        let f = q(&format!("refcount-{clusters}.qcow2"));
        craft::poke(&f, 56, &clusters.to_be_bytes());
        w.every_command_refuses(&f, &format!("refcount table is {clusters} clusters"));
    }
    // Item 8: a backing file that is the image itself (a stack overflow).
    let own = q("own-backing.qcow2");
    let name = own.to_str().unwrap().as_bytes().to_vec();
    craft::poke(&own, 8, &4096u64.to_be_bytes());
    craft::poke(&own, 16, &(name.len() as u32).to_be_bytes());
    craft::poke(&own, 4096, &name);
    w.every_command_refuses(&own, "has a backing file");
    // Item 11: a NUL in the backing name, shown escaped.
    let nul = q("nul-backing.qcow2");
    craft::poke(&nul, 8, &4096u64.to_be_bytes());
    craft::poke(&nul, 16, &3u32.to_be_bytes());
    craft::poke(&nul, 4096, b"a\0b");
    w.every_command_refuses(&nul, "backing file \"a\\0b\"");
    // Item 11: size 0 and the largest size.
    let empty = q("size-0.qcow2");
    craft::poke(&empty, 24, &0u64.to_be_bytes());
    w.every_command_refuses(&empty, "virtual size 0 is not");
    let huge = q("size-max.qcow2");
    craft::poke(&huge, 24, &(!511u64).to_be_bytes());
    w.every_command_refuses(&huge, "needs an L1 table of");
    // An L2 entry marked COPIED without a cluster, over META: qcow2-rs
    // takes it for a backing-file mapping, fails the write, then panics
    // twice in Drop (an abort) — found by `make fuzz`.
    let copied = q("copied-no-cluster.qcow2");
    let f = std::fs::File::open(&copied).unwrap();
    let be = |at: u64| {
        let mut b = [0u8; 8];
        f.read_exact_at(&mut b, at).unwrap();
        u64::from_be_bytes(b)
    };
    let l2 = be(be(40)) & 0x00ff_ffff_ffff_fe00;
    let meta = craft::first_lba(&craft::fixtures().join("dual-boot.raw"), craft::META) * 512;
    craft::poke(&copied, l2 + 8 * (meta >> 16), &(1u64 << 63).to_be_bytes());
    w.every_command_refuses(&copied, "COPIED without a cluster");
    // Item 10: 512-byte clusters (an index out of bounds, then an abort).
    let small = craft::copy("cluster-512.qcow2", &w.input("cluster-512.qcow2"));
    w.every_command_refuses(&small, "cluster_bits 9 is not supported");
}

#[test]
fn a_truncated_qcow2_is_refused_not_read_as_zeros() {
    // Item 20: the data clusters at the end are gone; key 17 with them.
    let w = Work::new();
    let cut = craft::copy("dual-boot.qcow2", &w.input("truncated.qcow2"));
    let len = std::fs::metadata(&cut).unwrap().len();
    std::fs::File::options()
        .write(true)
        .open(&cut)
        .unwrap()
        .set_len(len - 128 * 1024)
        .unwrap();
    w.every_command_refuses(&cut, "truncated: the cluster of guest byte");
    let o = Command::new("qemu-img")
        .arg("check")
        .arg(&cut)
        .output()
        .unwrap();
    assert!(!o.status.success(), "qemu-img agrees it is damaged");
}

#[test]
fn fifos_and_devices_are_refused_without_blocking() {
    // Item 18: a FIFO without a writer blocks open(2) and read(2) forever.
    let w = Work::new();
    let fifo = w.input("fifo.raw");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    w.every_command_refuses(&fifo, "not a regular file (a FIFO)");
    let zero = Path::new("/dev/zero");
    w.refused(
        &[&"inspect", &zero],
        zero,
        "not a regular file (a character device)",
    );
    let dir = w.input("");
    w.refused(
        &[&"inspect", &dir],
        &dir,
        "not a regular file (a directory)",
    );
}

#[test]
fn endless_value_and_schematic_files_are_read_only_as_far_as_the_format_allows() {
    // Item 14: /dev/zero as a META value (an ADV holds 256 KiB) and as a
    // schematic (a few MiB at most).
    let w = Work::new();
    let image = craft::copy("dual-boot.raw", &w.input("image.raw"));
    let zero = Path::new("/dev/zero");
    w.refused(
        &[
            &"meta",
            &"set",
            &image,
            &"--key",
            &"12",
            &"--value-file",
            &zero,
        ],
        zero,
        "longer than the 262144 bytes allowed",
    );
    w.refused(
        &[&"schematic", &"id", &zero],
        zero,
        "longer than the 4194304 bytes allowed",
    );
}

#[test]
fn a_fifo_in_the_manifest_is_a_mismatch_not_a_hang() {
    // Item 18: `verify` hashes each manifest entry; a FIFO never ends.
    let w = Work::new();
    let out = w.path().join("out");
    let fifo = out.join("cp-01.raw");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let entry = serde_json::json!({
        "node": "cp-01", "route": "patch", "schematicId": "a".repeat(64),
        "baseSchematicId": "b".repeat(64), "talosVersion": "v1.11.2", "platform": "metal",
        "arch": "amd64", "format": "raw", "size": 4096, "sha256": "c".repeat(64),
        "path": "cp-01.raw", "sourceUrl": "http://127.0.0.1:1/image/x/v1.11.2/metal-amd64.raw",
    });
    std::fs::write(
        out.join("manifest.json"),
        serde_json::to_vec(&serde_json::json!({"images": {"cp-01": entry}})).unwrap(),
    )
    .unwrap();
    let before = snapshot(w.path());
    let ran = run(w.path(), &[&"verify", &"--out-dir", &out]);
    ran.bounded();
    assert_eq!(ran.status.code(), Some(1), "{}", ran.what());
    assert!(
        ran.stdout.contains("cp-01.raw") && ran.stdout.contains("not a regular file (a FIFO)"),
        "{}",
        ran.what()
    );
    assert_eq!(snapshot(w.path()), before);
}

#[test]
fn diff_of_petabyte_qcow2s_reads_only_what_is_allocated() {
    // Item 18: 1 PiB of holes on each side compares equal without reading.
    let w = Work::new();
    let a = craft::petabyte_qcow2(&w.path().join("in"), "a");
    let b = craft::petabyte_qcow2(&w.path().join("in"), "b");
    // A few 2 MiB clusters: header, L1, refcounts, L2, the GPT.
    let len = std::fs::metadata(&a).unwrap().len();
    assert!(len <= 16 << 20, "{len}");
    let before = snapshot(w.path());
    let same = run(w.path(), &[&"diff", &a, &b]);
    same.bounded();
    assert_eq!(same.status.code(), Some(0), "{}", same.what());
    assert!(same.stdout.contains("identical"), "{}", same.what());
    // One byte of data in B's 1 PiB STATE partition, far out.
    craft::run_ok(
        Command::new("qemu-io")
            .args(["-f", "qcow2", "-c", "write -P 7 512T 512"])
            .arg(&b),
    );
    let before_b = snapshot(w.path());
    let differ = run(w.path(), &[&"diff", &a, &b]);
    differ.bounded();
    assert_eq!(differ.status.code(), Some(1), "{}", differ.what());
    assert!(differ.stdout.contains("STATE"), "{}", differ.what());
    assert_eq!(snapshot(w.path()), before_b);
    assert_ne!(before, before_b);
}

/// A factory simulator serving `base` as every image; killed on drop.
struct Factory(std::process::Child, String);

impl Factory {
    fn start(base: &Path, state: &Path) -> Factory {
        use std::io::BufRead;
        let mut child = Command::new(sim_bin())
            .args(["factory", "--base-image"])
            .arg(base)
            .arg("--state-dir")
            .arg(state)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        let url = v["url"].as_str().unwrap().to_owned();
        Factory(child, url)
    }
}

impl Drop for Factory {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn build_refuses_a_base_image_with_a_hostile_gpt() {
    // Items 9 and 19 through `build`: the factory serves the crafted image.
    let dir = tempfile::tempdir().unwrap();
    let backup = craft::copy("dual-boot.raw", &dir.path().join("backup-0.raw"));
    craft::gpt_header(&backup, 0, true, |_| {});
    craft::gpt_header(&backup, 1, false, |h| h[84..88].fill(0));
    // META inside BOOT (the factory writes its META there; at LBA 0 it
    // would destroy the GPT before imgbuild sees it).
    let overlap = craft::copy("dual-boot.raw", &dir.path().join("overlap.raw"));
    let boot = craft::first_lba(&overlap, craft::BOOT);
    craft::gpt_entry(&overlap, craft::META, |e| {
        craft::lbas(e, boot + 100, boot + 2147)
    });
    let config = root().join("examples/loopback/cluster.yaml");
    for (base, want) in [
        (&backup, "partition entry size 0"),
        (&overlap, "(\"BOOT\") and 4 (\"META\") overlap"),
    ] {
        let w = Work::new();
        let sim = Factory::start(base, &w.path().join("factory"));
        let out = w.out("");
        let ran = run(
            w.path(),
            &[
                &"--config",
                &config,
                &"build",
                &"cp-01",
                &"--quiet",
                &"--factory",
                &sim.1,
                &"--out-dir",
                &out,
                &"--cache-dir",
                &w.path().join("home/cache"),
            ],
        );
        ran.bounded();
        assert_eq!(ran.status.code(), Some(1), "{}", ran.what());
        assert!(ran.stderr.contains(want), "{}", ran.what());
        let images: Vec<_> = std::fs::read_dir(&out)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .filter(|n| n.to_string_lossy().ends_with(".raw"))
            .collect();
        assert!(images.is_empty(), "{images:?}");
    }
}
