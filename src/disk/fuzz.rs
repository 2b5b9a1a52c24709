//! Fuzzing through the entry points the commands call — `inspect` (open and
//! read META), `meta set` ([`edit::edit_meta`]), `patch` ([`edit::patch`]),
//! `diff` ([`diff`]), and `verify` (in `build`'s tests, on these fixtures) — with
//! structured mutations of real images' headers: GPT header and entry
//! fields (CRCs made right or left wrong) and qcow2 header and table fields,
//! set to the values that break readers (0, 1, boundaries, 2^26, all ones).
//! `make fuzz` runs them long, each alone, under a memory limit.

use super::edit::{self, MetaEditOptions, PatchOptions};
use super::image::{Image, diff};
use super::layout::META_SIZE;
use proptest::prelude::*;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The fixture script's images plus a qemu-img conversion, made once:
/// `dual-boot.raw` (GPT, META with key 17) and `dual-boot.qcow2`.
pub(crate) fn fixtures() -> &'static Path {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/make-images.sh");
        let ok = Command::new(script).arg(dir.path()).output().unwrap();
        assert!(
            ok.status.success(),
            "{}",
            String::from_utf8_lossy(&ok.stderr)
        );
        let ok = Command::new("qemu-img")
            .args(["convert", "-f", "raw", "-O", "qcow2"])
            .arg(dir.path().join("dual-boot.raw"))
            .arg(dir.path().join("dual-boot.qcow2"))
            .output()
            .unwrap();
        assert!(
            ok.status.success(),
            "{}",
            String::from_utf8_lossy(&ok.stderr)
        );
        dir
    })
    .path()
}

/// Test cases per property: few in `make test` (each copies and opens
/// images), `IMGBUILD_FUZZ_CASES` under `make fuzz`.
pub(crate) fn config() -> ProptestConfig {
    let mut c = crate::fuzz_config();
    if std::env::var_os("IMGBUILD_FUZZ_CASES").is_none() {
        c.cases = 24;
    }
    c
}

/// Values that break readers of a size, count, offset or LBA field.
fn hostile_value() -> impl Strategy<Value = u64> {
    prop_oneof![
        proptest::sample::select(vec![
            0u64,
            1,
            2,
            8,
            9,
            12,
            21,
            22,
            33,
            34,
            92,
            104,
            112,
            127,
            128,
            129,
            512,
            1024,
            2047,
            2048,
            65502,
            65503,
            65534,
            65535,
            65536,
            1 << 26,
            1 << 31,
            u32::MAX as u64,
            1 << 32,
            1 << 50,
            u64::MAX,
        ]),
        0u64..100_000,
        any::<u64>(),
    ]
}

/// One change to a GPT: a header field (primary or backup) or a field of
/// one of the first eight entries (in both arrays).
#[derive(Debug, Clone)]
enum GptEdit {
    Header {
        backup: bool,
        at: usize,
        width: usize,
        value: u64,
    },
    Entry {
        index: usize,
        at: usize,
        width: usize,
        value: u64,
    },
    /// Renames an entry META (a second META, or a used empty slot).
    NameMeta { index: usize },
}

fn gpt_edit() -> impl Strategy<Value = GptEdit> {
    // (offset, width) of the header fields a reader trusts (UEFI 5.3.2).
    let header = proptest::sample::select(vec![
        (8, 4),
        (12, 4),
        (24, 8),
        (32, 8),
        (40, 8),
        (48, 8),
        (72, 8),
        (80, 4),
        (84, 4),
        (88, 4),
    ]);
    // first_lba, last_lba, attributes, the first name character.
    let entry = proptest::sample::select(vec![(32, 8), (40, 8), (48, 8), (56, 2)]);
    prop_oneof![
        (any::<bool>(), header, hostile_value()).prop_map(|(backup, (at, width), value)| {
            GptEdit::Header {
                backup,
                at,
                width,
                value,
            }
        }),
        (0usize..8, entry, hostile_value()).prop_map(|(index, (at, width), value)| {
            GptEdit::Entry {
                index,
                at,
                width,
                value,
            }
        }),
        (0usize..8).prop_map(|index| GptEdit::NameMeta { index }),
    ]
}

fn crc32(b: &[u8]) -> u32 {
    let mut c = flate2::Crc::new();
    c.update(b);
    c.sum()
}

fn put(buf: &mut [u8], at: usize, width: usize, value: u64) {
    buf[at..at + width].copy_from_slice(&value.to_le_bytes()[..width]);
}

/// Applies `edits` to the raw GPT image at `path` (primary at LBA 1, backup
/// in the last sector, 128 entries after each as sgdisk lays them out),
/// then recomputes the entry and header CRCs of the headers in `fix_crc`.
fn mutate_gpt(path: &Path, edits: &[GptEdit], fix_crc: [bool; 2]) {
    let f = std::fs::File::options()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let len = f.metadata().unwrap().len();
    let headers = [512, len - 512];
    // The entry arrays where the fixture has them (not where a mutated
    // header says), so entry edits land in the real tables.
    let tables = [1024, len - 512 - 128 * 128];
    let mut h = [[0u8; 92]; 2];
    let mut t = [vec![0u8; 128 * 128], vec![0u8; 128 * 128]];
    for i in 0..2 {
        f.read_exact_at(&mut h[i], headers[i]).unwrap();
        f.read_exact_at(&mut t[i], tables[i]).unwrap();
    }
    for e in edits {
        match *e {
            GptEdit::Header {
                backup,
                at,
                width,
                value,
            } => put(&mut h[usize::from(backup)], at, width, value),
            GptEdit::Entry {
                index,
                at,
                width,
                value,
            } => {
                for table in &mut t {
                    put(&mut table[index * 128..], at, width, value);
                }
            }
            GptEdit::NameMeta { index } => {
                for table in &mut t {
                    let name = &mut table[index * 128 + 56..index * 128 + 128];
                    name.fill(0);
                    for (i, c) in "META".encode_utf16().enumerate() {
                        name[2 * i..2 * i + 2].copy_from_slice(&c.to_le_bytes());
                    }
                }
            }
        }
    }
    for i in 0..2 {
        if fix_crc[i] {
            let crc = crc32(&t[i]);
            h[i][88..92].copy_from_slice(&crc.to_le_bytes());
            h[i][16..20].fill(0);
            let crc = crc32(&h[i]);
            h[i][16..20].copy_from_slice(&crc.to_le_bytes());
        }
        f.write_all_at(&t[i], tables[i]).unwrap();
        f.write_all_at(&h[i], headers[i]).unwrap();
    }
}

/// One change to a qcow2: a header field (big-endian) or an entry of the
/// L1 table or of the first L2 table.
#[derive(Debug, Clone)]
enum Qcow2Edit {
    Header { at: usize, width: usize, value: u64 },
    L1 { index: u64, value: u64 },
    L2 { index: u64, value: u64 },
}

fn qcow2_edit() -> impl Strategy<Value = Qcow2Edit> {
    // The fields of the qcow2 header (qemu docs/interop/qcow2.txt).
    let header = proptest::sample::select(vec![
        (8, 8),
        (16, 4),
        (20, 4),
        (24, 8),
        (36, 4),
        (40, 8),
        (48, 8),
        (56, 4),
        (60, 4),
        (64, 8),
        (72, 8),
        (80, 8),
        (88, 8),
        (96, 4),
        (100, 4),
    ]);
    prop_oneof![
        (header, hostile_value()).prop_map(|((at, width), value)| Qcow2Edit::Header {
            at,
            width,
            value
        }),
        (0u64..4, hostile_value()).prop_map(|(index, value)| Qcow2Edit::L1 { index, value }),
        (0u64..1024, hostile_value()).prop_map(|(index, value)| Qcow2Edit::L2 { index, value }),
    ]
}

fn be(f: &std::fs::File, at: u64) -> u64 {
    let mut b = [0u8; 8];
    f.read_exact_at(&mut b, at).unwrap();
    u64::from_be_bytes(b)
}

/// Applies `edits` to the qcow2 at `path`; table entries are found through
/// the fixture's own header, before any header edit.
fn mutate_qcow2(path: &Path, edits: &[Qcow2Edit]) {
    let f = std::fs::File::options()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let l1 = be(&f, 40);
    let l2 = be(&f, l1) & 0x00ff_ffff_ffff_fe00;
    for e in edits {
        match *e {
            Qcow2Edit::Header { at, width, value } => {
                let b = value.to_be_bytes();
                f.write_all_at(&b[8 - width..], at as u64).unwrap();
            }
            Qcow2Edit::L1 { index, value } => {
                f.write_all_at(&value.to_be_bytes(), l1 + 8 * index)
                    .unwrap();
            }
            Qcow2Edit::L2 { index, value } if l2 != 0 => {
                f.write_all_at(&value.to_be_bytes(), l2 + 8 * index)
                    .unwrap();
            }
            Qcow2Edit::L2 { .. } => {}
        }
    }
}

/// The structures a META write must never touch in a raw GPT image: the
/// MBR, the primary header and entries (LBA 0..34), and the backup ones.
fn gpt_structures(path: &Path) -> Vec<u8> {
    let bytes = std::fs::read(path).unwrap();
    let tail = bytes.len() - 33 * 512;
    [&bytes[..34 * 512], &bytes[tail..]].concat()
}

/// Drives every command's entry point on `image` (a mutated copy of
/// `pristine`, inside `dir`). None may panic; a reported success must be
/// real: META reads back, and nothing outside META changed in a raw image.
fn every_entry_point(dir: &Path, image: &Path, pristine: &Path, raw: bool) {
    let value = b"hostile: true\n".to_vec();
    // inspect
    let opened = Image::open(image, false).and_then(|mut i| {
        let meta = i.read_meta()?;
        let part = i.meta_partition()?.clone();
        Ok((meta, part))
    });
    // diff, both ways
    let _ = diff(image, pristine);
    let _ = diff(pristine, image);
    // patch
    let out = dir.join("out.img");
    let patched = edit::patch(&PatchOptions {
        base: image.to_owned(),
        out: out.clone(),
        changes: vec![(12, Some(value.clone()))],
    });
    match patched {
        Ok(_) => {
            let got = Image::open(&out, false).and_then(|mut i| i.read_meta());
            let got = got.expect("a patched copy opens");
            assert_eq!(got.adv.get(12), Some(&value[..]), "patch lost the value");
        }
        Err(_) => assert!(!out.exists(), "a failed patch left {}", out.display()),
    }
    // meta set, in place
    let before = raw.then(|| gpt_structures(image));
    let edited = edit::edit_meta(&MetaEditOptions {
        image: image.to_owned(),
        changes: vec![(12, Some(value.clone()))],
    });
    if let Ok(edited) = edited {
        assert!(edited.changed);
        let (_, part) = opened.expect("an image meta set wrote was readable before");
        assert_eq!(part.size, META_SIZE);
        let again = Image::open(image, false).and_then(|mut i| i.read_meta());
        let again = again.expect("the image opens after meta set");
        assert_eq!(
            again.adv.get(12),
            Some(&value[..]),
            "meta set lost the value"
        );
        if let Some(before) = before {
            assert!(
                before == gpt_structures(image),
                "meta set wrote over the MBR or the GPT"
            );
        }
    }
}

/// A fresh copy of fixture `name` in a new folder.
fn scratch(name: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join(name);
    std::fs::copy(fixtures().join(name), &image).unwrap();
    (dir, image)
}

proptest! {
    #![proptest_config(config())]

    /// GPT header and entry mutations through every command's entry point.
    #[test]
    fn fuzz_commands_on_mutated_gpt(
        edits in proptest::collection::vec(gpt_edit(), 1..4),
        fix_crc in any::<[bool; 2]>(),
    ) {
        if crate::fuzz_time_left() {
            let (dir, image) = scratch("dual-boot.raw");
            mutate_gpt(&image, &edits, fix_crc);
            every_entry_point(dir.path(), &image, &fixtures().join("dual-boot.raw"), true);
        }
    }

    /// qcow2 header and table mutations through every command's entry point.
    #[test]
    fn fuzz_commands_on_mutated_qcow2(
        edits in proptest::collection::vec(qcow2_edit(), 1..4),
    ) {
        if crate::fuzz_time_left() {
            let (dir, image) = scratch("dual-boot.qcow2");
            mutate_qcow2(&image, &edits);
            every_entry_point(dir.path(), &image, &fixtures().join("dual-boot.qcow2"), false);
        }
    }
}

/// A real qcow2 (made by qemu-img from a GPT disk with META) to corrupt.
fn qcow2_fixture() -> Vec<u8> {
    std::fs::read(fixtures().join("dual-boot.qcow2")).unwrap()
}

proptest::proptest! {
    #![proptest_config(crate::fuzz_config())]
    /// A valid header over corrupted tables (L1, refcounts, L2): opening
    /// and reading META give an error or data, never a panic or a hang.
    #[test]
    fn fuzz_qcow2_tables_never_panic(
        edits in proptest::collection::vec((0usize..0x60000, proptest::num::u8::ANY), 1..64),
    ) {
        if !crate::fuzz_time_left() {
            return Ok(());
        }
        let mut img = qcow2_fixture();
        for (at, byte) in edits {
            // Keep the first 112 header bytes, so our check passes and
            // the corruption reaches the block access.
            let at = 112 + at % (img.len() - 112);
            img[at] = byte;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.qcow2");
        std::fs::write(&path, &img).unwrap();
        let _ = Image::open(&path, false).map(|mut i| i.read_meta());
    }
}
