//! `--merge` of `imgbuild kubeconfig` and `imgbuild talosconfig`: the
//! cluster added to the user's own kubeconfig or talosconfig, as `talosctl
//! kubeconfig` and `talosctl config merge` do.

use super::output::{Output, Usage};
use anyhow::{Context, Result};
use imgbuild::talos::merge::{self, Merged};
use serde_json::json;
use std::path::{Path, PathBuf};

/// `talosctl kubeconfig --merge`: the cluster's kubeconfig (at `ours`)
/// into `file`, else the first file of $KUBECONFIG, else ~/.kube/config.
pub fn kubeconfig(ours: &Path, file: Option<PathBuf>, force: bool, output: Output) -> Result<()> {
    kubeconfig_text(&read(ours)?, file, force, output)
}

/// [`kubeconfig`] of a kubeconfig held in memory (minted from the
/// secrets): its key is written only into the user's file.
pub fn kubeconfig_text(
    ours: &str,
    file: Option<PathBuf>,
    force: bool,
    output: Output,
) -> Result<()> {
    let target = file.unwrap_or_else(default_kubeconfig);
    let merged = merge_file(&target, ours, force, merge::kubeconfig)?;
    report(&target, &merged, "kubeconfig", output);
    Ok(())
}

/// `talosctl config merge`: the cluster's talosconfig (at `ours`) into
/// `file`, else $TALOSCONFIG, else ~/.talos/config.
pub fn talosconfig(ours: &Path, file: Option<PathBuf>, force: bool, output: Output) -> Result<()> {
    let target = file.unwrap_or_else(default_talosconfig);
    let merged = merge_file(&target, &read(ours)?, force, merge::talosconfig)?;
    report(&target, &merged, "talosconfig", output);
    Ok(())
}

/// kubectl writes new entries to the first file of $KUBECONFIG.
fn default_kubeconfig() -> PathBuf {
    std::env::var_os("KUBECONFIG")
        .and_then(|list| std::env::split_paths(&list).find(|p| !p.as_os_str().is_empty()))
        .unwrap_or_else(|| home().join(".kube/config"))
}

fn default_talosconfig() -> PathBuf {
    std::env::var_os("TALOSCONFIG")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| home().join(".talos/config"))
}

fn home() -> PathBuf {
    std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from)
}

/// Reads both files, merges, and writes `target` (through a symlink, as
/// kubectl does, and 0600) only when something changed.
/// A file through the bounded reader.
fn read(p: &Path) -> Result<String> {
    imgbuild::input::read_text(p, imgbuild::input::MAX_TEXT_FILE)
        .with_context(|| format!("{}", p.display()))
}

fn merge_file(
    target: &Path,
    ours_text: &str,
    force: bool,
    merge: fn(&str, &str, bool) -> Result<Merged, merge::MergeError>,
) -> Result<Merged> {
    let target = match std::fs::canonicalize(target) {
        Ok(real) => real,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => target.to_owned(),
        Err(e) => return Err(anyhow::anyhow!("{}: {e}", target.display())),
    };
    if let Some(dir) = target.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("{}", dir.display()))?;
    }
    // Held until the merged file is in place: a concurrent merge waits,
    // then reads what this one wrote.
    let _lock = lock_target(&target).with_context(|| format!("{}", target.display()))?;
    let theirs = read(&target)?;
    let merged = merge(&theirs, ours_text, force)
        .map_err(|e| Usage(format!("{}: {e}", target.display())))?;
    if merged.changed {
        imgbuild::atomic::write_if_changed(&target, merged.text.as_bytes(), true)
            .with_context(|| format!("{}", target.display()))?;
    }
    Ok(merged)
}

/// An exclusive lock on the file at `target` (created empty, 0600, when
/// missing) that is still the file there once locked: a merge replaces the
/// file by rename, so a waiter that locked the old one looks again.
fn lock_target(target: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    loop {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .mode(0o600)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW)
            .open(target)?;
        let meta = file.metadata()?;
        if !meta.is_file() {
            return Err(std::io::Error::other("not a regular file"));
        }
        file.lock()?;
        if std::fs::symlink_metadata(target).is_ok_and(|now| now.ino() == meta.ino()) {
            return Ok(file);
        }
    }
}

fn report(target: &Path, merged: &Merged, kind: &str, output: Output) {
    match output {
        Output::Json => outln!(
            "{}",
            json!({
                kind: target,
                "context": merged.context,
                "changed": merged.changed,
                "replaced": merged.replaced,
            })
        ),
        Output::Text => {
            for r in &merged.replaced {
                outln!("replaced {r}");
            }
            outln!(
                "{}: {} (context {}, current)",
                target.display(),
                if merged.changed {
                    "merged"
                } else {
                    "unchanged"
                },
                merged.context
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn concurrent_merges_into_one_file_keep_every_cluster() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("kube/config");
        let ours: Vec<PathBuf> = (0..8)
            .map(|i| {
                let p = dir.path().join(format!("ours-{i}"));
                std::fs::write(
                    &p,
                    format!(
                        "apiVersion: v1\nkind: Config\nclusters:\n- name: c{i}\n  cluster:\n    server: https://10.0.0.{i}:6443\nusers:\n- name: admin@c{i}\n  user:\n    token: t{i}\ncontexts:\n- name: admin@c{i}\n  context:\n    cluster: c{i}\n    user: admin@c{i}\ncurrent-context: admin@c{i}\n"
                    ),
                )
                .unwrap();
                p
            })
            .collect();
        std::thread::scope(|s| {
            for p in &ours {
                let target = &target;
                s.spawn(move || {
                    merge_file(target, &read(p).unwrap(), false, merge::kubeconfig).unwrap()
                });
            }
        });
        let text = std::fs::read_to_string(&target).unwrap();
        for i in 0..8 {
            assert!(
                text.contains(&format!("name: admin@c{i}")),
                "c{i} lost:\n{text}"
            );
        }
    }
}
