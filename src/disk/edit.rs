//! META edits as library calls, one options struct each: in place on an
//! existing image (`imgbuild meta set|delete`), and into a fresh copy of a
//! base image (`imgbuild patch`). Both read and check the image, merge the
//! edits into the ADV it holds (other keys survive), and write META once.

use super::error::{DiskError, io};
use super::image::Image;
use crate::meta::{Adv, Decoded};
use std::path::{Path, PathBuf};

/// One META change: `Some(value)` sets the key, `None` deletes it.
pub type MetaChange = (u32, Option<Vec<u8>>);

/// An in-place change to one image's META.
#[derive(Debug, Clone)]
pub struct MetaEditOptions {
    /// Raw or qcow2; written in place.
    pub image: PathBuf,
    /// Applied in order.
    pub changes: Vec<MetaChange>,
}

/// What an in-place edit found and did.
#[derive(Debug, Clone)]
pub struct MetaEdited {
    /// Why an ADV copy in the image was passed over (damaged, stale).
    pub problems: Vec<String>,
    /// False when META already held exactly this and nothing was written.
    pub changed: bool,
    /// META as it is now.
    pub adv: Adv,
}

/// Reads META, merges `changes`, and writes it back only if that changed
/// anything. The new ADV is encoded (and "META is full" found) before the
/// one write.
pub fn edit_meta(opts: &MetaEditOptions) -> Result<MetaEdited, DiskError> {
    let mut img = Image::open(&opts.image, true)?;
    let before = img.read_meta()?;
    let mut adv = before.adv.clone();
    apply(&opts.image, &mut adv, &opts.changes)?;
    let changed = adv != before.adv;
    if changed {
        img.write_meta(&adv)?;
    }
    Ok(MetaEdited {
        problems: before.problems,
        changed,
        adv,
    })
}

/// A node image made from a base image: a sparse copy with META changed.
#[derive(Debug, Clone)]
pub struct PatchOptions {
    /// The node-independent image; only read.
    pub base: PathBuf,
    /// The node's image, replaced atomically.
    pub out: PathBuf,
    /// Applied in order to the base's META.
    pub changes: Vec<MetaChange>,
}

/// What a patch found in the base image.
#[derive(Debug, Clone)]
pub struct Patched {
    /// Why an ADV copy in the base was passed over.
    pub problems: Vec<String>,
    /// The base's keys that the copy carries over unchanged.
    pub kept_keys: Vec<u32>,
}

/// Writes `out` as `base` with `changes` applied; `out` appears only
/// complete, and `base` is never written.
pub fn patch(opts: &PatchOptions) -> Result<Patched, DiskError> {
    let before = write_patched_copy(&opts.base, &opts.out, &opts.changes)?;
    let kept_keys = before
        .adv
        .iter()
        .map(|(k, _)| k)
        .filter(|k| opts.changes.iter().all(|(c, _)| c != k))
        .collect();
    Ok(Patched {
        problems: before.problems,
        kept_keys,
    })
}

/// Writes `out` as a copy of `base` (holes kept) with `edits` applied to
/// META: `Some(value)` sets a key, `None` deletes it; other keys survive in
/// their order. When the edits change no tag, META is not rewritten and
/// `out` is `base` byte for byte (blocks shared where the filesystem can).
/// `base` is checked before anything is written, and `out` appears only
/// complete (temp name, fsync, rename).
pub fn write_patched_copy(
    base: &Path,
    out: &Path,
    edits: &[MetaChange],
) -> Result<Decoded, DiskError> {
    let before = Image::open(base, false)?.read_meta()?;
    let mut adv = before.adv.clone();
    apply(out, &mut adv, edits)?;
    let mut tmp = crate::atomic::AtomicFile::create(out, false).map_err(io(out))?;
    let src = crate::io::open_regular(base, false).map_err(io(base))?;
    crate::io::copy_sparse(&src, tmp.file()).map_err(io(out))?;
    if adv != before.adv {
        Image::open(tmp.temp_path(), true)?.write_meta(&adv)?;
    }
    tmp.commit().map_err(io(out))?;
    Ok(before)
}

/// Applies META edits to the ADV of `image` (named when it would overflow).
pub fn apply(image: &Path, adv: &mut Adv, edits: &[MetaChange]) -> Result<(), DiskError> {
    for (key, value) in edits {
        match value {
            Some(v) => adv
                .set(*key, v.clone())
                .map_err(|source| DiskError::MetaFull {
                    path: image.to_owned(),
                    source,
                })?,
            None => {
                adv.delete(*key);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use std::process::Command;

    /// Talos-shaped images from the fixture script, whose ADV (key 17 in
    /// dual-boot.raw) is written by its own encoder, not ours.
    fn fixtures() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/make-images.sh");
        let out = Command::new(script).arg(dir.path()).output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        dir
    }

    fn keys(path: &Path) -> Vec<(u32, Vec<u8>)> {
        let meta = Image::open(path, false).unwrap().read_meta().unwrap();
        meta.adv.iter().map(|(k, v)| (k, v.to_vec())).collect()
    }

    fn everything_but_meta(path: &Path) -> Vec<u8> {
        let img = Image::open(path, false).unwrap();
        let meta = img.meta_partition().unwrap().clone();
        let mut bytes = std::fs::read(path).unwrap();
        bytes.drain(meta.offset as usize..(meta.offset + meta.size) as usize);
        bytes
    }

    #[test]
    fn in_place_edit_merges_with_the_keys_already_there() {
        let dir = fixtures();
        let image = dir.path().join("dual-boot.raw");
        let rest = everything_but_meta(&image);
        let before = keys(&image);
        assert!(before.iter().any(|(k, _)| *k == 17), "{before:?}");
        let edited = edit_meta(&MetaEditOptions {
            image: image.clone(),
            changes: vec![(10, Some(b"addresses: []\n".to_vec()))],
        })
        .unwrap();
        assert!(edited.changed);
        let after = keys(&image);
        assert_eq!(
            after,
            edited
                .adv
                .iter()
                .map(|(k, v)| (k, v.to_vec()))
                .collect::<Vec<_>>()
        );
        assert!(after.contains(&(10, b"addresses: []\n".to_vec())));
        for kept in &before {
            assert!(after.contains(kept), "{kept:?} lost: {after:?}");
        }
        assert_eq!(
            everything_but_meta(&image),
            rest,
            "bytes outside META changed"
        );
    }

    #[test]
    fn an_edit_that_changes_nothing_writes_nothing() {
        let dir = fixtures();
        let image = dir.path().join("dual-boot.raw");
        let (key, value) = keys(&image)[0].clone();
        let mtime = || std::fs::metadata(&image).unwrap().modified().unwrap();
        let was = mtime();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let same = edit_meta(&MetaEditOptions {
            image: image.clone(),
            changes: vec![(key, Some(value))],
        })
        .unwrap();
        assert!(!same.changed);
        assert_eq!(mtime(), was);
        let gone = edit_meta(&MetaEditOptions {
            image: image.clone(),
            changes: vec![(key, None)],
        })
        .unwrap();
        assert!(gone.changed);
        assert!(keys(&image).iter().all(|(k, _)| *k != key));
    }

    #[test]
    fn a_full_meta_is_refused_before_anything_is_written() {
        let dir = fixtures();
        let image = dir.path().join("dual-boot.raw");
        let original = std::fs::read(&image).unwrap();
        let err = edit_meta(&MetaEditOptions {
            image: image.clone(),
            changes: vec![(10, Some(vec![b'x'; 300 * 1024]))],
        })
        .unwrap_err();
        let msg = format!("{:#}", anyhow::Error::new(err));
        assert!(
            msg.contains("dual-boot.raw") && msg.contains("META is full"),
            "{msg}"
        );
        assert!(std::fs::read(&image).unwrap() == original);
    }

    #[test]
    fn patch_writes_a_copy_and_reports_the_keys_it_kept() {
        let dir = fixtures();
        let base = dir.path().join("dual-boot.raw");
        let out = dir.path().join("node.raw");
        let original = std::fs::read(&base).unwrap();
        let patched = patch(&PatchOptions {
            base: base.clone(),
            out: out.clone(),
            changes: vec![(10, Some(b"hostnames: []\n".to_vec()))],
        })
        .unwrap();
        assert_eq!(patched.kept_keys, vec![17]);
        assert!(
            std::fs::read(&base).unwrap() == original,
            "base was written"
        );
        let after = keys(&out);
        assert!(after.contains(&(10, b"hostnames: []\n".to_vec())));
        assert!(after.iter().any(|(k, _)| *k == 17));
        assert!(everything_but_meta(&out) == everything_but_meta(&base));
    }

    #[test]
    fn a_patch_that_changes_no_tag_is_the_base_byte_for_byte() {
        let dir = fixtures();
        let base = dir.path().join("two-tags.raw");
        let out = dir.path().join("node.raw");
        // A damaged second ADV copy stays damaged: META is not rewritten.
        let meta = Image::open(&base, false)
            .unwrap()
            .meta_partition()
            .unwrap()
            .offset;
        let second = meta + crate::meta::adv::COPY_SIZE as u64 + 100;
        std::os::unix::fs::FileExt::write_all_at(
            &std::fs::File::options().write(true).open(&base).unwrap(),
            b"X",
            second,
        )
        .unwrap();
        let nothing: [Vec<MetaChange>; 3] = [
            vec![],
            vec![(12, Some(b"user-reserved".to_vec()))],
            vec![(10, None)],
        ];
        for changes in nothing {
            patch(&PatchOptions {
                base: base.clone(),
                out: out.clone(),
                changes: changes.clone(),
            })
            .unwrap();
            let cmp = Command::new("cmp").arg(&base).arg(&out).output().unwrap();
            assert!(
                cmp.status.success(),
                "{changes:?}: {}",
                String::from_utf8_lossy(&cmp.stdout)
            );
        }
        // An edit rewrites META, the other tags in their order (17 before 12).
        patch(&PatchOptions {
            base: base.clone(),
            out: out.clone(),
            changes: vec![(12, Some(b"changed".to_vec()))],
        })
        .unwrap();
        assert_eq!(
            keys(&out),
            [(17, b"dual-boot".to_vec()), (12, b"changed".to_vec())]
        );
        assert!(everything_but_meta(&out) == everything_but_meta(&base));
    }

    #[test]
    fn a_file_that_is_not_an_image_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("notes.txt");
        std::fs::write(&image, b"Not Found").unwrap();
        let err = edit_meta(&MetaEditOptions {
            image: image.clone(),
            changes: vec![(10, None)],
        })
        .unwrap_err();
        assert!(
            err.to_string().contains("notes.txt: not a disk image"),
            "{err}"
        );
    }

    #[test]
    fn meta_full_names_the_image() {
        let mut adv = Adv::default();
        let big = vec![b'x'; 300 * 1024];
        let err = apply(Path::new("out/cp-01.raw"), &mut adv, &[(10, Some(big))]).unwrap_err();
        assert_eq!(err.to_string(), "out/cp-01.raw");
        let why = std::error::Error::source(&err).unwrap().to_string();
        assert!(why.starts_with("META is full"), "{why}");
        assert_eq!(adv, Adv::default(), "nothing was set");
    }
}
