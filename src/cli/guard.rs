//! What the CLI tells the redaction set (`output::redact_also`) and the
//! user about secrets: the environment values patches refer to, the
//! secret fields patches carry, the state dir's files (watched for
//! changes), and one warning per state dir that Git tracks or others can
//! read (`--fix-permissions` makes its files 0600).

use imgbuild::inventory::Inventory;
use imgbuild::secrets::{protect, redact};
use imgbuild::talos::config;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// `--fix-permissions`.
static FIX: AtomicBool = AtomicBool::new(false);
/// The state dirs already checked: one warning each per run.
static CHECKED: Mutex<BTreeSet<PathBuf>> = Mutex::new(BTreeSet::new());

/// Shortest value of an environment variable named like a secret that is
/// redacted by its name alone (a short one is more likely a flag).
const SHORTEST_BY_NAME: usize = 8;

/// Before any command: `--fix-permissions`, and every environment
/// variable named like a secret (`HCLOUD_TOKEN`, `PROXMOX_VE_PASSWORD`,
/// `SOPS_AGE_KEY`…) in the redaction set, as is the password of a
/// `--factory` URL.
pub fn init(fix_permissions: bool, factory: Option<&str>) {
    FIX.store(fix_permissions, Ordering::Relaxed);
    for (name, value) in std::env::vars_os() {
        let (Some(name), Some(value)) = (name.to_str(), value.to_str()) else {
            continue;
        };
        if redact::secret_name(name) && value.chars().count() >= SHORTEST_BY_NAME {
            super::output::redact_also(name, value);
        }
    }
    if let Some(password) = factory.and_then(url_password) {
        super::output::redact_also("IMGBUILD_FACTORY password", password);
    }
}

/// The password of `scheme://user:password@host/…`.
fn url_password(url: &str) -> Option<&str> {
    let rest = url.split_once("://")?.1;
    let authority = rest.split(['/', '?', '#']).next()?;
    let userinfo = authority.rsplit_once('@')?.0;
    userinfo.split_once(':').map(|(_, p)| p)
}

/// The environment, for `${NAME}` in patch files (names or values that are
/// not UTF-8 cannot be written in a patch and are left out).
pub fn patch_vars() -> config::PatchVars {
    std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .collect()
}

/// After the inventory is loaded: every `${NAME}` its patches refer to
/// (under NAME), every secret field written in a patch, and the default
/// state dir.
pub fn inventory(inv: &Inventory) {
    let vars = patch_vars();
    let files: BTreeSet<PathBuf> = inv
        .nodes
        .iter()
        .flat_map(|n| config::patch_files(inv, n))
        .collect();
    // A value the inventory itself writes in the clear (a node's name) is
    // no secret, even where a SOPS patch holds it encrypted.
    let clear = serde_json::to_string(inv).unwrap_or_default();
    for file in files {
        let Ok(text) = imgbuild::input::read_text(&file, imgbuild::input::MAX_TEXT_FILE) else {
            continue;
        };
        // A SOPS patch: its fields as the plaintext's, and every string it
        // held encrypted (one no key opens fails later, naming the file).
        let Ok((text, revealed)) = imgbuild::secrets::sops::open_with_values(&text, &file) else {
            continue;
        };
        for r in revealed.iter().filter(|r| r.text) {
            let quoted = serde_json::to_string(&r.value).unwrap_or_default();
            if !clear.contains(&quoted) {
                super::output::redact_also(&r.at, &r.value);
            }
        }
        for (name, value) in vars.referenced_in(&text) {
            super::output::redact_also(name, value);
        }
        for (name, value) in redact::secret_fields_of_yaml(&text) {
            if !value.contains("${") {
                super::output::redact_also(&name, &value);
            }
        }
    }
    // The cluster's SOPS secrets, when this environment has their key
    // (without it, every command that needs them stops naming the file).
    let sealed = imgbuild::talos::stage::sealed_path(inv);
    if let Ok(text) = imgbuild::input::read_text(&sealed, imgbuild::input::MAX_TEXT_FILE)
        && let Ok(plain) = imgbuild::secrets::sops::open(&text, &sealed)
    {
        for (name, value) in redact::secret_fields_of_yaml(&plain) {
            super::output::redact_also(&name, &value);
        }
    }
    state_dir(&config::default_state_dir(inv));
}

/// A state dir in use: its secrets redacted (now and as they change); one
/// warning for each file others can read (fixed with
/// `--fix-permissions`) and for files Git tracks.
pub fn state_dir(dir: &Path) {
    super::output::redact_state_dir(dir);
    let first = CHECKED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert(dir.to_owned());
    if !first || !dir.is_dir() {
        return;
    }
    let warning = super::progress::paint("warning:", "33");
    for finding in protect::check(dir) {
        if FIX.load(Ordering::Relaxed) {
            match protect::fix(&finding) {
                Ok(true) => {
                    if let protect::Finding::Readable { path, mode } = &finding {
                        errln!(
                            "{}: mode {mode:04o} → 0600 (--fix-permissions)",
                            path.display()
                        );
                    }
                    continue;
                }
                Ok(false) => {}
                Err(e) => {
                    super::output::stderr_line(&warning, &format!("{finding}: {e}"));
                    continue;
                }
            }
        }
        super::output::stderr_line(&warning, &finding.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_password_is_found_behind_the_last_at() {
        assert_eq!(url_password("http://u:p%40ss@h:80/x?y"), Some("p%40ss"));
        assert_eq!(url_password("https://u:s3cr@t@h/"), Some("s3cr@t"));
        assert_eq!(url_password("https://h/a@b"), None);
        assert_eq!(url_password("https://user@h/"), None);
    }
}
