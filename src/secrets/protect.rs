//! A folder of secrets or build output that guards itself: a `.gitignore`
//! of `*` so `git add -A` passes it by (as talhelper does for its generated
//! folder), and the checks that say when a secret is readable by others or
//! already tracked by Git.

use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The files of a state dir that hold secrets.
pub const SECRET_FILES: [&str; 3] = ["secrets.yaml", "talosconfig", "kubeconfig"];

/// Writes `<dir>/.gitignore` holding `*` unless one is there: the folder
/// and everything in it (the `.gitignore` too) stay out of a commit.
pub fn ignore_in_git(dir: &Path) -> io::Result<()> {
    let path = dir.join(".gitignore");
    if fs::symlink_metadata(&path).is_ok() {
        return Ok(());
    }
    crate::atomic::write_if_changed(
        &path,
        b"# Written by imgbuild: secrets and generated files never go into Git.\n*\n",
        false,
    )
    .map(|_| ())
}

/// What is wrong with a state dir.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finding {
    /// A file holding secrets that others may read.
    Readable { path: PathBuf, mode: u32 },
    /// Files of the state dir already in Git's index.
    Tracked { paths: Vec<PathBuf> },
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Finding::Readable { path, mode } => write!(
                f,
                "{} holds secrets and is readable by others (mode {mode:04o}); run with --fix-permissions to make it 0600",
                path.display()
            ),
            Finding::Tracked { paths } => write!(
                f,
                "{} file(s) of the state dir are tracked by Git ({}): `git rm --cached` them and rotate the secrets they hold",
                paths.len(),
                paths
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }
}

/// The files of `dir` that hold secrets: the bundle, the client configs
/// and any rendered machine config under `configs/`.
pub fn secret_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = SECRET_FILES.iter().map(|f| dir.join(f)).collect();
    if let Ok(entries) = fs::read_dir(dir.join("configs")) {
        let mut configs: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
        configs.sort();
        files.extend(configs);
    }
    files.retain(|f| fs::symlink_metadata(f).is_ok_and(|m| m.is_file()));
    files
}

/// The secret values the files of `dir` hold, each with its field path
/// (`certs.os.key`, `contexts.admin.key`, `machine.token`…). Only regular
/// files are read, bounded; one that cannot be read gives nothing. A SOPS
/// file (`secrets.yaml` kept encrypted) gives the fields of its plaintext,
/// so it is redacted exactly as the plain file would be; one no key opens
/// gives nothing here (the command that reads it fails, naming it).
pub fn state_secrets(dir: &Path) -> Vec<(String, String)> {
    secret_files(dir)
        .iter()
        .filter_map(|f| {
            let text = crate::input::read_text(f, crate::input::MAX_TEXT_FILE).ok()?;
            let plain = super::sops::open(&text, f).ok()?;
            Some(super::redact::secret_fields_of_yaml(&plain))
        })
        .flatten()
        .collect()
}

/// When each secret file of a dir last changed, to read it again only
/// then.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Stamp(Vec<(PathBuf, Option<std::time::SystemTime>, u64)>);

impl Stamp {
    /// The files of `dir` as they are now.
    pub fn of(dir: &Path) -> Stamp {
        Stamp(
            secret_files(dir)
                .into_iter()
                .map(|f| {
                    let m = fs::metadata(&f).ok();
                    let modified = m.as_ref().and_then(|m| m.modified().ok());
                    (f, modified, m.map_or(0, |m| m.len()))
                })
                .collect(),
        )
    }
}

/// Every file of `dir` holding secrets that others may read, and the
/// files Git tracks there.
pub fn check(dir: &Path) -> Vec<Finding> {
    let mut found: Vec<Finding> = secret_files(dir)
        .into_iter()
        .filter_map(|path| {
            let mode = fs::metadata(&path).ok()?.permissions().mode() & 0o777;
            (mode & 0o077 != 0).then_some(Finding::Readable { path, mode })
        })
        .collect();
    let tracked = tracked(dir);
    if !tracked.is_empty() {
        found.push(Finding::Tracked { paths: tracked });
    }
    found
}

/// Makes a readable file 0600; a tracked file is left to the user.
pub fn fix(finding: &Finding) -> io::Result<bool> {
    match finding {
        Finding::Readable { path, .. } => {
            fs::set_permissions(path, fs::Permissions::from_mode(0o600))?;
            Ok(true)
        }
        Finding::Tracked { .. } => Ok(false),
    }
}

/// The files under `dir` in the index of the Git work tree holding it
/// (none when Git is not installed or `dir` is in no work tree). Asks
/// `git ls-files`, which reads the index as Git does.
fn tracked(dir: &Path) -> Vec<PathBuf> {
    let Ok(out) = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["ls-files", "-z", "--full-name", "--", "."])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
    else {
        return Vec::new();
    };
    if !out.status.success() {
        return Vec::new();
    }
    out.stdout
        .split(|b| *b == 0)
        .filter(|p| !p.is_empty())
        .map(|p| PathBuf::from(String::from_utf8_lossy(p).into_owned()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_readable_secrets_file_is_found_and_fixed() {
        let dir = std::env::temp_dir().join(format!("imgbuild-protect-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let secrets = dir.join("secrets.yaml");
        fs::write(&secrets, "cluster: {}\n").unwrap();
        fs::set_permissions(&secrets, fs::Permissions::from_mode(0o644)).unwrap();
        fs::write(dir.join("kubeconfig"), "x").unwrap();
        fs::set_permissions(dir.join("kubeconfig"), fs::Permissions::from_mode(0o600)).unwrap();
        let found = check(&dir);
        assert_eq!(
            found,
            [Finding::Readable {
                path: secrets.clone(),
                mode: 0o644
            }]
        );
        assert!(found[0].to_string().contains("mode 0644"));
        assert!(fix(&found[0]).unwrap());
        assert!(check(&dir).is_empty());
        ignore_in_git(&dir).unwrap();
        assert_eq!(
            fs::read_to_string(dir.join(".gitignore"))
                .unwrap()
                .lines()
                .last(),
            Some("*")
        );
        fs::remove_dir_all(&dir).unwrap();
    }
}
