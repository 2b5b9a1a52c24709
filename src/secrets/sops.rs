//! SOPS-encrypted YAML files for age recipients, read and written natively,
//! so `secrets.yaml`, patches and talhelper's `talsecret.sops.yaml` /
//! `talenv.sops.yaml` can live in Git encrypted and `sops -d` still opens
//! what imgbuild writes. Every value is AES-256-GCM with a 32-byte IV and
//! its key path as AAD; `sops.mac` is the SHA-512 of the plaintext values,
//! encrypted with `sops.lastmodified` as AAD; the data key is an age file
//! per recipient in `sops.age[].enc`. Read from getsops/sops
//! `aes/cipher.go`, `sops.go` (tree walk, MAC), `decrypt/decrypt.go`,
//! `stores/stores.go`, `stores/metadata.go` and `age/keysource.go`.

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use aes_gcm::aead::consts::U32;
use aes_gcm::aead::{AeadInOut, KeyInit};
use aes_gcm::{AesGcm, aes::Aes256};
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use serde_yaml_ng::{Mapping, Value};

use super::age::{self, AgeError, Identity, Recipient};

/// AES-256-GCM with the 32-byte IV SOPS uses (`aes/cipher.go`, nonceSize).
type SopsGcm = AesGcm<Aes256, U32>;

/// The suffix whose keys SOPS leaves in the clear by default.
const UNENCRYPTED_SUFFIX: &str = "_unencrypted";
/// The SOPS format version written into `sops.version`.
const SOPS_VERSION: &str = "3.9.0";
/// sops's `MACOnlyEncryptedInitialization` (sha256 of "sops").
const MAC_ONLY_ENCRYPTED_INIT: [u8; 32] = [
    0x8a, 0x3f, 0xd2, 0xad, 0x54, 0xce, 0x66, 0x52, 0x7b, 0x10, 0x34, 0xf3, 0xd1, 0x47, 0xbe, 0x0b,
    0x0b, 0x97, 0x5b, 0x3b, 0xf4, 0x4f, 0x72, 0xc6, 0xfd, 0xad, 0xec, 0x81, 0x76, 0xf2, 0x7d, 0x69,
];

/// Why a SOPS file could not be opened or written. Names the file and, for
/// a key problem, the recipients; never a value or a key.
#[derive(Debug, thiserror::Error)]
pub enum SopsError {
    #[error("{}: not a SOPS file imgbuild can read: {message}", path.display())]
    Invalid { path: PathBuf, message: String },
    #[error(
        "{}: no age key opens it; it is encrypted for {} ({looked})",
        path.display(),
        recipients.join(", ")
    )]
    NoKey {
        path: PathBuf,
        recipients: Vec<String>,
        looked: String,
    },
    #[error(
        "{}: refused: the file was changed after it was encrypted ({what}); restore it from Git or encrypt it again",
        path.display()
    )]
    Tampered { path: PathBuf, what: String },
    #[error(
        "{}: refused: could not decrypt value at {at}: it is in the clear where sops encrypts it (added without the key?); encrypt the file again",
        path.display()
    )]
    NotEncrypted { path: PathBuf, at: String },
    #[error(
        "{}: it is encrypted for {kinds}, which imgbuild opens only through the sops binary, and {why}; install sops (https://github.com/getsops/sops) or add an age recipient to the file",
        path.display()
    )]
    NeedsSops {
        path: PathBuf,
        kinds: String,
        why: String,
    },
    #[error("{}: sops -d failed: {message}", path.display())]
    SopsFailed { path: PathBuf, message: String },
    #[error("age key {source_name}: {message}")]
    Keys {
        source_name: String,
        message: String,
    },
    #[error("cannot encrypt: {0}")]
    Encrypt(String),
}

/// The age identities SOPS would use, from where sops looks
/// (`age/keysource.go`): `SOPS_AGE_KEY`, the file `SOPS_AGE_KEY_FILE`
/// names, and `$XDG_CONFIG_HOME/sops/age/keys.txt` (default
/// `~/.config/sops/age/keys.txt`, on macOS `~/Library/Application
/// Support/sops/age/keys.txt`). SSH keys are not read; a file only
/// `SOPS_AGE_KEY_CMD`, PGP, KMS or Vault opens goes to the sops binary
/// ([`open`]).
#[derive(Debug, Clone, Default)]
pub struct AgeKeys {
    identities: Vec<Identity>,
    /// Where keys were looked for, for the message when none fits.
    looked: Vec<String>,
}

impl AgeKeys {
    /// The given identities (tests, or keys from elsewhere).
    pub fn new(identities: Vec<Identity>) -> AgeKeys {
        AgeKeys {
            identities,
            looked: vec!["the keys given".into()],
        }
    }

    /// The keys of this process's environment, as sops finds them.
    pub fn from_env() -> Result<AgeKeys, SopsError> {
        // sops's getUserConfigDir: XDG_CONFIG_HOME, else Go's
        // os.UserConfigDir (`~/Library/Application Support` on macOS).
        let home_config = if cfg!(target_os = "macos") {
            "Library/Application Support"
        } else {
            ".config"
        };
        let config_dir = std::env::var_os("XDG_CONFIG_HOME")
            .filter(|d| !d.is_empty())
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(home_config)));
        AgeKeys::from_sources(
            std::env::var("SOPS_AGE_KEY").ok(),
            std::env::var_os("SOPS_AGE_KEY_FILE").map(PathBuf::from),
            config_dir.map(|d| d.join("sops/age/keys.txt")),
        )
    }

    /// The keys from these sources; a named key file that cannot be read
    /// or holds a malformed key is an error naming it, a missing default
    /// file is not.
    pub fn from_sources(
        key: Option<String>,
        key_file: Option<PathBuf>,
        default_file: Option<PathBuf>,
    ) -> Result<AgeKeys, SopsError> {
        let mut keys = AgeKeys::default();
        let bad = |source_name: &str, message: String| SopsError::Keys {
            source_name: source_name.to_owned(),
            message,
        };
        keys.looked.push("SOPS_AGE_KEY".into());
        if let Some(text) = key {
            let found = age::parse_identities(&text, true).map_err(|e| bad("SOPS_AGE_KEY", e))?;
            keys.identities.extend(found);
        }
        keys.looked.push("SOPS_AGE_KEY_FILE".into());
        if let Some(file) = key_file {
            let name = format!("file {} (SOPS_AGE_KEY_FILE)", file.display());
            let text =
                crate::input::read_text(&file, 1 << 20).map_err(|e| bad(&name, e.to_string()))?;
            keys.identities
                .extend(age::parse_identities(&text, false).map_err(|e| bad(&name, e))?);
        }
        if let Some(file) = default_file {
            keys.looked.push(file.display().to_string());
            if file.exists() {
                let name = format!("file {}", file.display());
                let text = crate::input::read_text(&file, 1 << 20)
                    .map_err(|e| bad(&name, e.to_string()))?;
                keys.identities
                    .extend(age::parse_identities(&text, false).map_err(|e| bad(&name, e))?);
            }
        }
        Ok(keys)
    }

    fn looked(&self) -> String {
        match self.identities.len() {
            0 => format!("no age key found in {}", self.looked.join(", ")),
            n => format!(
                "tried {n} age key(s) from {}: {}",
                self.looked.join(", "),
                self.identities
                    .iter()
                    .map(Identity::recipient)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }
}

/// Whether `text` is a SOPS file: its first YAML document has a top-level
/// `sops` mapping (cheap: looked at only when a line starts with `sops:`).
pub fn is_encrypted(text: &str) -> bool {
    let has_line = text.starts_with("sops:") || text.contains("\nsops:");
    has_line
        && documents(text, Path::new(""))
            .ok()
            .and_then(|docs| docs.into_iter().next())
            .is_some_and(|d| metadata_of(&d).is_some())
}

/// `text` as it is when it is no SOPS file, else decrypted (with the
/// environment's keys, [`AgeKeys::from_env`]) and its MAC verified. A file
/// only PGP, KMS, Vault or `SOPS_AGE_KEY_CMD` opens is decrypted by the
/// `sops` binary on PATH (`sops -d`, its output never logged), or refused
/// saying that none is there.
pub fn open<'a>(text: &'a str, path: &Path) -> Result<Cow<'a, str>, SopsError> {
    Ok(open_with_values(text, path)?.0)
}

/// A value a SOPS file held encrypted, decrypted: for the caller's
/// redaction set, whatever its length.
#[derive(Clone, PartialEq, Eq)]
pub struct Revealed {
    /// Its key path (`machine.token`).
    pub at: String,
    /// As sops's `ToBytes` spells it (`True`, `420`, the text).
    pub value: String,
    /// Whether it was a string (`type:str`), not a number or a bool.
    pub text: bool,
}

impl std::fmt::Debug for Revealed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Revealed({})", self.at)
    }
}

/// [`open`], and every value that was encrypted, decrypted.
pub fn open_with_values<'a>(
    text: &'a str,
    path: &Path,
) -> Result<(Cow<'a, str>, Vec<Revealed>), SopsError> {
    if !is_encrypted(text) {
        return Ok((Cow::Borrowed(text), Vec::new()));
    }
    let key_cmd = std::env::var_os("SOPS_AGE_KEY_CMD").filter(|c| !c.is_empty());
    let opened = AgeKeys::from_env().and_then(|keys| decrypt_with_values(text, path, &keys));
    let kinds = match &opened {
        Err(SopsError::NeedsSops { kinds, .. }) => kinds.clone(),
        Err(SopsError::NoKey { .. }) if key_cmd.is_some() => {
            "age keys from SOPS_AGE_KEY_CMD".into()
        }
        _ => {
            let (plain, values) = opened?;
            return Ok((Cow::Owned(plain), values));
        }
    };
    let (plain, values) = with_sops_binary(text, path, &kinds)?;
    Ok((Cow::Owned(plain), values))
}

/// The key types of a SOPS file imgbuild cannot use itself (sops
/// `stores/stores.go` metadata: PGP, cloud KMS, Vault), by name.
fn other_key_kinds(meta: &Mapping) -> Vec<&'static str> {
    const KINDS: [(&str, &str); 5] = [
        ("pgp", "PGP"),
        ("kms", "AWS KMS"),
        ("gcp_kms", "GCP KMS"),
        ("azure_kv", "Azure Key Vault"),
        ("hc_vault", "HashiCorp Vault"),
    ];
    let groups = meta.get("key_groups").and_then(Value::as_sequence);
    let present = |field: &str| {
        let nonempty = |v: Option<&Value>| {
            v.and_then(Value::as_sequence)
                .is_some_and(|l| !l.is_empty())
        };
        nonempty(meta.get(field))
            || groups.is_some_and(|g| g.iter().any(|grp| nonempty(grp.get(field))))
    };
    KINDS
        .iter()
        .filter(|(field, _)| present(field))
        .map(|(_, name)| *name)
        .collect()
}

/// How long `sops -d` may take (a KMS or Vault round trip included).
const SOPS_DEADLINE: std::time::Duration = std::time::Duration::from_secs(300);

/// `sops -d` of `path` by the sops binary on PATH, for keys imgbuild does
/// not hold itself; its output is never logged, its error is shortened.
/// The revealed values are the leaves that were `ENC[…]` in `text`.
fn with_sops_binary(
    text: &str,
    path: &Path,
    kinds: &str,
) -> Result<(String, Vec<Revealed>), SopsError> {
    use std::io::Read;
    let failed = |message: String| SopsError::SopsFailed {
        path: path.to_owned(),
        message,
    };
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    let kind = if ext == "json" { "json" } else { "yaml" };
    let mut child = match std::process::Command::new("sops")
        .args(["--decrypt", "--input-type", kind, "--output-type", "yaml"])
        .arg(path)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
    {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(SopsError::NeedsSops {
                path: path.to_owned(),
                kinds: kinds.to_owned(),
                why: "no sops binary is on PATH".into(),
            });
        }
        Err(e) => return Err(failed(format!("cannot run sops: {e}"))),
    };
    let pipe = |p: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut out = Vec::new();
            if let Some(p) = p {
                let _ = p.take(crate::input::MAX_TEXT_FILE).read_to_end(&mut out);
            }
            out
        })
    };
    let stdout = pipe(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let stderr = pipe(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let start = std::time::Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if start.elapsed() < SOPS_DEADLINE => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(failed(format!(
                    "no answer within {} s",
                    SOPS_DEADLINE.as_secs()
                )));
            }
            Err(e) => return Err(failed(e.to_string())),
        }
    };
    let out = stdout.join().unwrap_or_default();
    let err = stderr.join().unwrap_or_default();
    if !status.success() {
        let err = String::from_utf8_lossy(&err);
        let last = err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("");
        return Err(failed(crate::input::excerpt(last.trim(), 300)));
    }
    let plain = String::from_utf8(out).map_err(|_| failed("its output is not UTF-8".into()))?;
    let mut values = Vec::new();
    let (enc, dec) = (documents(text, path)?, documents(&plain, path)?);
    for (e, d) in enc.iter().zip(&dec) {
        revealed_between(e, d, &mut Vec::new(), &mut values);
    }
    Ok((plain, values))
}

/// The leaves of `dec` whose place in `enc` holds an `ENC[…]` value.
fn revealed_between(enc: &Value, dec: &Value, path: &mut Vec<String>, out: &mut Vec<Revealed>) {
    match (enc, dec) {
        (Value::Mapping(e), Value::Mapping(d)) => {
            for (k, ev) in e {
                let (Some(key), Some(dv)) = (k.as_str(), d.get(k)) else {
                    continue;
                };
                path.push(key.to_owned());
                revealed_between(ev, dv, path, out);
                path.pop();
            }
        }
        (Value::Sequence(e), Value::Sequence(d)) => {
            for (ev, dv) in e.iter().zip(d) {
                revealed_between(ev, dv, path, out);
            }
        }
        (Value::String(e), leaf) if e.starts_with("ENC[AES256_GCM,") => out.push(Revealed {
            at: shown_path(path),
            value: plain_bytes(leaf),
            text: matches!(leaf, Value::String(_)),
        }),
        _ => {}
    }
}

/// The plaintext YAML of the SOPS file `text` (from `path`, named in
/// errors), every value decrypted and the MAC checked over all of them.
pub fn decrypt(text: &str, path: &Path, keys: &AgeKeys) -> Result<String, SopsError> {
    Ok(decrypt_with_values(text, path, keys)?.0)
}

/// [`decrypt`], and the decrypted values of the leaves that were encrypted.
/// Which leaves sops encrypts follows `sops.go` `shouldBeEncrypted`: the
/// file's `unencrypted_suffix` (default `_unencrypted`),
/// `encrypted_suffix`, `unencrypted_regex` or `encrypted_regex` on any key
/// of the path; such a leaf that is not `ENC[…]` (nor empty) is refused as
/// sops refuses it ("Could not decrypt value"), and a leaf left in the
/// clear is kept as it is, even one that looks like `ENC[…]`.
pub fn decrypt_with_values(
    text: &str,
    path: &Path,
    keys: &AgeKeys,
) -> Result<(String, Vec<Revealed>), SopsError> {
    let invalid = |message: String| SopsError::Invalid {
        path: path.to_owned(),
        message,
    };
    let tampered = |what: String| SopsError::Tampered {
        path: path.to_owned(),
        what,
    };
    let mut docs = documents(text, path)?;
    let mut hints = scalar_hints(text);
    let meta = docs
        .first()
        .and_then(metadata_of)
        .cloned()
        .ok_or_else(|| invalid("no sops metadata".into()))?;
    for doc in &mut docs {
        if let Value::Mapping(m) = doc {
            m.remove("sops");
        }
    }
    let field = |name: &str| meta.get(name).and_then(Value::as_str);
    let others = other_key_kinds(&meta);
    let needs_sops = |why: &str| SopsError::NeedsSops {
        path: path.to_owned(),
        kinds: others.join(", "),
        why: why.to_owned(),
    };
    let stanzas = match age_stanzas(&meta) {
        Err(e) if e.contains("Shamir") => {
            return Err(SopsError::NeedsSops {
                path: path.to_owned(),
                kinds: "key groups split by Shamir".into(),
                why: "imgbuild does not combine them".into(),
            });
        }
        other => other.map_err(invalid)?,
    };
    if stanzas.is_empty() {
        if !others.is_empty() {
            return Err(needs_sops("it has no age recipient"));
        }
        return Err(invalid(
            "it has no age recipients (sops.age); imgbuild opens only age-encrypted files".into(),
        ));
    }
    let mut data_key = None;
    for (_, enc) in &stanzas {
        let file = age::dearmor(enc).map_err(|e| invalid(format!("sops.age[].enc: {e}")))?;
        match age::decrypt(&file, &keys.identities) {
            Ok(key) => {
                data_key = Some(key);
                break;
            }
            Err(AgeError::NoIdentityMatches) => {}
            Err(AgeError::Tampered(what)) => {
                return Err(tampered(format!("the data key's age file: {what}")));
            }
            Err(e) => return Err(invalid(format!("sops.age[].enc: {e}"))),
        }
    }
    let Some(data_key) = data_key else {
        if !others.is_empty() {
            return Err(needs_sops(&format!(
                "no age key opens it ({})",
                keys.looked()
            )));
        }
        return Err(SopsError::NoKey {
            path: path.to_owned(),
            recipients: stanzas.into_iter().map(|(r, _)| r).collect(),
            looked: keys.looked(),
        });
    };
    let cipher = SopsGcm::new_from_slice(&data_key)
        .map_err(|_| invalid("the data key is not 32 bytes".into()))?;
    let mac_only = meta
        .get("mac_only_encrypted")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let rule = Rule::of(&meta).map_err(invalid)?;
    let mut walk = Walk {
        cipher: &cipher,
        rule: &rule,
        mac_only,
        hash: Sha512::new(),
        hints: hints.as_mut().map(|h| h.drain(..)),
        values: Vec::new(),
    };
    if mac_only {
        walk.hash.update(&MAC_ONLY_ENCRYPTED_INIT);
    }
    for doc in &mut docs {
        walk.decrypt(doc, &mut Vec::new()).map_err(|e| match e {
            WalkError::Tampered(at) => tampered(format!("the value at {at} does not decrypt")),
            WalkError::Clear(at) => SopsError::NotEncrypted {
                path: path.to_owned(),
                at,
            },
            WalkError::Invalid(m) => invalid(m),
        })?;
    }
    let Walk { hash, values, .. } = walk;
    let computed = hex::encode_upper(hash.finish());
    let last_modified = field("lastmodified")
        .ok_or_else(|| invalid("no sops.lastmodified".into()))
        .and_then(|t| {
            go_rfc3339(t).ok_or_else(|| invalid("sops.lastmodified is no RFC 3339 time".into()))
        })?;
    let mac = field("mac").ok_or_else(|| invalid("no sops.mac".into()))?;
    let stored = match decrypt_value(&cipher, mac, &last_modified) {
        Ok(Decrypted::Text(s)) => s,
        Ok(_) => return Err(tampered("sops.mac".into())),
        Err(WalkError::Tampered(_) | WalkError::Clear(_)) => {
            return Err(tampered("sops.mac does not decrypt".into()));
        }
        Err(WalkError::Invalid(m)) => return Err(invalid(format!("sops.mac: {m}"))),
    };
    if aws_lc_rs::constant_time::verify_slices_are_equal(stored.as_bytes(), computed.as_bytes())
        .is_err()
    {
        return Err(tampered("the MAC over the values does not match".into()));
    }
    Ok((emit(&docs).map_err(invalid)?, values))
}

/// `plain` (YAML) as a SOPS file for `recipients`: every value but those
/// under keys ending in `_unencrypted` encrypted, the MAC over all values,
/// the data key as an armored age file per recipient (what `sops
/// --encrypt --age` writes).
pub fn encrypt(plain: &str, recipients: &[Recipient]) -> Result<String, SopsError> {
    if recipients.is_empty() {
        return Err(SopsError::Encrypt("no age recipient given".into()));
    }
    let mut docs =
        documents(plain, Path::new("")).map_err(|e| SopsError::Encrypt(e.to_string()))?;
    if docs.first().and_then(metadata_of).is_some() {
        return Err(SopsError::Encrypt("it is already SOPS-encrypted".into()));
    }
    let mut data_key = [0u8; 32];
    aws_lc_rs::rand::fill(&mut data_key)
        .map_err(|_| SopsError::Encrypt("no random bytes".into()))?;
    let cipher =
        SopsGcm::new_from_slice(&data_key).map_err(|_| SopsError::Encrypt("AES key".into()))?;
    let mut hash = Sha512::new();
    let mut hints = scalar_hints(plain).map(Vec::into_iter);
    for doc in &mut docs {
        walk_encrypt(doc, &mut Vec::new(), false, &cipher, &mut hash, &mut hints)?;
    }
    let last_modified = now_rfc3339();
    let mac = encrypt_value(
        &cipher,
        hex::encode_upper(hash.finish()).as_bytes(),
        "str",
        &last_modified,
    )?;
    let mut age_list = Vec::new();
    for r in recipients {
        let file = age::encrypt(&data_key, std::slice::from_ref(r))
            .map_err(|e| SopsError::Encrypt(e.to_string()))?;
        let mut entry = Mapping::new();
        entry.insert("recipient".into(), r.to_string().into());
        entry.insert("enc".into(), age::armor(&file).into());
        age_list.push(Value::Mapping(entry));
    }
    let mut meta = Mapping::new();
    meta.insert("age".into(), Value::Sequence(age_list));
    meta.insert("lastmodified".into(), last_modified.into());
    meta.insert("mac".into(), mac.into());
    meta.insert("unencrypted_suffix".into(), UNENCRYPTED_SUFFIX.into());
    meta.insert("version".into(), SOPS_VERSION.into());
    for doc in &mut docs {
        let Value::Mapping(m) = doc else {
            return Err(SopsError::Encrypt("a document is not a mapping".into()));
        };
        m.insert("sops".into(), Value::Mapping(meta.clone()));
    }
    emit(&docs).map_err(SopsError::Encrypt)
}

/// The YAML documents of `text`, through the input gate's budget.
fn documents(text: &str, path: &Path) -> Result<Vec<Value>, SopsError> {
    use serde::Deserialize;
    let invalid = |message: String| SopsError::Invalid {
        path: path.to_owned(),
        message,
    };
    let text = crate::input::yaml(text).map_err(|e| invalid(e.to_string()))?;
    serde_yaml_ng::Deserializer::from_str(text)
        .map(|de| {
            Value::deserialize(de).map_err(|e| {
                invalid(format!(
                    "not YAML: {}",
                    crate::input::yaml_error_without_values(&e)
                ))
            })
        })
        .filter(|v| !matches!(v, Ok(Value::Null)))
        .collect()
}

fn metadata_of(doc: &Value) -> Option<&Mapping> {
    doc.as_mapping()?.get("sops")?.as_mapping()
}

/// `(recipient, armored age file)` of every age key, at `sops.age` or in
/// a single key group (`sops.key_groups[].age`; Shamir splits are refused).
fn age_stanzas(meta: &Mapping) -> Result<Vec<(String, String)>, String> {
    let mut lists: Vec<&Value> = meta.get("age").into_iter().collect();
    if let Some(groups) = meta.get("key_groups").and_then(Value::as_sequence) {
        let threshold = meta
            .get("shamir_threshold")
            .and_then(Value::as_u64)
            .unwrap_or(0);
        if groups.len() > 1 && threshold > 1 {
            return Err(
                "its data key is split over key groups (Shamir); decrypt it with sops".into(),
            );
        }
        lists.extend(groups.iter().filter_map(|g| g.get("age")));
    }
    let mut out = Vec::new();
    for list in lists {
        for entry in list.as_sequence().ok_or("sops.age is not a list")? {
            let (Some(r), Some(enc)) = (
                entry.get("recipient").and_then(Value::as_str),
                entry.get("enc").and_then(Value::as_str),
            ) else {
                return Err("a sops.age entry needs recipient and enc".into());
            };
            out.push((crate::input::excerpt(r, 100), enc.to_owned()));
        }
    }
    Ok(out)
}

enum WalkError {
    /// The key path of the value that failed authentication.
    Tampered(String),
    /// The key path of a value in the clear where sops encrypts.
    Clear(String),
    Invalid(String),
}

/// A decrypted `ENC[…]` value, by its `type:`.
enum Decrypted {
    Text(String),
    Int(i64),
    Float(f64),
    Bool(bool),
}

/// `path` as SOPS's AAD: every map key followed by `:` (list indices are
/// not part of it).
fn aad(path: &[String]) -> String {
    path.iter().map(|k| format!("{k}:")).collect()
}

fn key_text(key: &Value) -> Result<String, String> {
    match key {
        Value::String(s) => Ok(s.clone()),
        _ => Err("a map key is not a string; SOPS supports only string keys".into()),
    }
}

/// Which keys' values sops encrypts (`sops.go` `shouldBeEncrypted`), from
/// the file's metadata; at most one rule is set (`stores/stores.go`), none
/// means the default unencrypted suffix.
enum Rule {
    UnencryptedSuffix(String),
    EncryptedSuffix(String),
    UnencryptedRegex(jsonschema::Validator),
    EncryptedRegex(jsonschema::Validator),
}

impl Rule {
    fn of(meta: &Mapping) -> Result<Rule, String> {
        let field = |name: &str| {
            meta.get(name)
                .and_then(Value::as_str)
                .filter(|v| !v.is_empty())
        };
        for name in ["unencrypted_comment_regex", "encrypted_comment_regex"] {
            if field(name).is_some() {
                return Err(format!(
                    "it uses sops.{name}, which imgbuild does not read; decrypt it with sops"
                ));
            }
        }
        let set: Vec<&str> = [
            "unencrypted_suffix",
            "encrypted_suffix",
            "unencrypted_regex",
            "encrypted_regex",
        ]
        .into_iter()
        .filter(|n| field(n).is_some())
        .collect();
        if set.len() > 1 {
            return Err(format!(
                "it sets more than one of {}; sops allows one",
                set.join(", ")
            ));
        }
        // Go's regexp.Match finds the pattern anywhere in the key, as a JSON
        // Schema `pattern` does (jsonschema's regex engine).
        let regex = |name: &str, re: &str| {
            jsonschema::validator_for(&serde_json::json!({"type": "string", "pattern": re}))
                .map_err(|_| format!("sops.{name} is not a regular expression imgbuild can read"))
        };
        Ok(match set.first().copied() {
            None => Rule::UnencryptedSuffix(UNENCRYPTED_SUFFIX.into()),
            Some(name) => {
                let v = field(name).unwrap_or_default().to_owned();
                match name {
                    "unencrypted_suffix" => Rule::UnencryptedSuffix(v),
                    "encrypted_suffix" => Rule::EncryptedSuffix(v),
                    "unencrypted_regex" => Rule::UnencryptedRegex(regex(name, &v)?),
                    _ => Rule::EncryptedRegex(regex(name, &v)?),
                }
            }
        })
    }

    /// Whether sops encrypts the leaf at `path` (its map keys).
    fn encrypts(&self, path: &[String]) -> bool {
        let matches = |re: &jsonschema::Validator, k: &String| re.is_valid(&serde_json::json!(k));
        match self {
            Rule::UnencryptedSuffix(s) => !path.iter().any(|k| k.ends_with(s.as_str())),
            Rule::EncryptedSuffix(s) => path.iter().any(|k| k.ends_with(s.as_str())),
            Rule::UnencryptedRegex(re) => !path.iter().any(|k| matches(re, k)),
            Rule::EncryptedRegex(re) => path.iter().any(|k| matches(re, k)),
        }
    }
}

/// How a scalar was written: its text, when it was plain (unquoted,
/// untagged) — the only scalars Go's yaml.v3 may read as another type than
/// the YAML 1.2 reader here does (`0644`, `1_000`, `.inf`).
type Hint = Option<String>;

/// Every value scalar of `text` (not map keys) in document order, as
/// [`Hint`]s; None when the text uses anchors or aliases (then the values
/// are taken as read).
fn scalar_hints(text: &str) -> Option<Vec<Hint>> {
    use yaml_rust2::parser::{Event, EventReceiver, Parser};
    use yaml_rust2::scanner::TScalarStyle;
    #[derive(Default)]
    struct Collect {
        /// Per open container: Some(expecting a key) for a map, None for a
        /// sequence.
        stack: Vec<Option<bool>>,
        hints: Vec<Hint>,
        unusable: bool,
    }
    impl Collect {
        /// A value (scalar or container) ended: a map expects a key again.
        fn value_done(&mut self) {
            if let Some(Some(expect_key)) = self.stack.last_mut() {
                *expect_key = !*expect_key;
            }
        }
    }
    impl EventReceiver for Collect {
        fn on_event(&mut self, ev: Event) {
            match ev {
                Event::Alias(_) => self.unusable = true,
                Event::Scalar(text, style, anchor, tag) => {
                    if anchor != 0 {
                        self.unusable = true;
                    }
                    let is_key = matches!(self.stack.last(), Some(Some(true)));
                    if !is_key && !self.stack.is_empty() {
                        let plain = style == TScalarStyle::Plain && tag.is_none();
                        self.hints.push(plain.then_some(text));
                    }
                    self.value_done();
                }
                Event::MappingStart(anchor, _) | Event::SequenceStart(anchor, _) => {
                    if anchor != 0 {
                        self.unusable = true;
                    }
                    if matches!(self.stack.last(), Some(Some(true))) {
                        // A complex key: sops refuses those anyway.
                        self.unusable = true;
                    }
                    let map = matches!(ev, Event::MappingStart(..));
                    self.stack.push(map.then_some(true));
                }
                Event::MappingEnd | Event::SequenceEnd => {
                    self.stack.pop();
                    self.value_done();
                }
                _ => {}
            }
        }
    }
    let mut c = Collect::default();
    Parser::new_from_str(text).load(&mut c, true).ok()?;
    (!c.unusable).then_some(c.hints)
}

/// A plain scalar as Go's yaml.v3 resolves it (`resolve.go`), where that
/// differs from a string: null, bool, int (base prefixes, legacy `0644`
/// octal, `_` separators), float (`.inf`, `.nan`, exponents).
fn go_resolve(text: &str) -> Option<Value> {
    match text {
        "" | "~" | "null" | "Null" | "NULL" => return Some(Value::Null),
        "true" | "True" | "TRUE" => return Some(Value::Bool(true)),
        "false" | "False" | "FALSE" => return Some(Value::Bool(false)),
        ".inf" | ".Inf" | ".INF" | "+.inf" | "+.Inf" | "+.INF" => {
            return Some(Value::from(f64::INFINITY));
        }
        "-.inf" | "-.Inf" | "-.INF" => return Some(Value::from(f64::NEG_INFINITY)),
        ".nan" | ".NaN" | ".NAN" => return Some(Value::from(f64::NAN)),
        _ => {}
    }
    if !text.starts_with(|c: char| c.is_ascii_digit() || "+-.".contains(c)) {
        return None;
    }
    if let Some(t) = go_timestamp(text) {
        return Some(Value::String(t));
    }
    let plain = text.replace('_', "");
    if let Some(i) = go_parse_int(&plain) {
        return Some(match i64::try_from(i) {
            Ok(i) => Value::from(i),
            Err(_) => Value::from(u64::try_from(i).ok()?),
        });
    }
    let (sign, digits) = match plain.strip_prefix('-') {
        Some(d) => (-1.0, d),
        None => (1.0, plain.strip_prefix('+').unwrap_or(&plain)),
    };
    // yamlStyleFloat: [-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?
    let (mantissa, exp) = match digits.find(['e', 'E']) {
        Some(at) => (&digits[..at], Some(&digits[at + 1..])),
        None => (digits, None),
    };
    let all_digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let mantissa_ok = match mantissa.split_once('.') {
        Some(("", frac)) => all_digits(frac),
        Some((int, frac)) => all_digits(int) && (frac.is_empty() || all_digits(frac)),
        None => all_digits(mantissa),
    };
    let exp_ok = exp.is_none_or(|e| all_digits(e.strip_prefix(['+', '-']).unwrap_or(e)));
    if mantissa_ok && exp_ok {
        return digits.parse::<f64>().ok().map(|f| go_float_value(sign * f));
    }
    None
}

/// A plain timestamp as yaml.v3 reads it (a date, or RFC 3339 with `T`)
/// and sops then spells it (`time.RFC3339`): `2024-01-01T00:00:00Z`.
fn go_timestamp(text: &str) -> Option<String> {
    let digits = |s: &str, n: std::ops::RangeInclusive<usize>| {
        n.contains(&s.len()) && s.bytes().all(|b| b.is_ascii_digit())
    };
    let mut parts = text.splitn(3, '-');
    let (y, m, rest) = (parts.next()?, parts.next()?, parts.next()?);
    if !digits(y, 4..=4) || !digits(m, 1..=2) {
        return None;
    }
    let (d, time) = match rest.find(['T', 't']) {
        Some(at) => (&rest[..at], Some(&rest[at + 1..])),
        None => (rest, None),
    };
    if !digits(d, 1..=2) {
        return None;
    }
    let date = format!("{y}-{m:0>2}-{d:0>2}");
    match time {
        None => {
            let t = format!("{date}T00:00:00Z");
            go_rfc3339(&t).map(|_| t)
        }
        Some(time) => {
            let (hms, zone) = match time.find(['Z', 'z', '+', '-']) {
                Some(at) => (&time[..at], &time[at..]),
                None => return None,
            };
            let hms = hms.split('.').next()?;
            let mut f = hms.split(':');
            let (h, mi, sec) = (f.next()?, f.next()?, f.next()?);
            let zone = if zone.eq_ignore_ascii_case("z") {
                "Z"
            } else {
                zone
            };
            go_rfc3339(&format!("{date}T{h:0>2}:{mi:0>2}:{sec:0>2}{zone}"))
        }
    }
}

/// Go's `strconv.ParseInt(s, 0, 64)`, then `ParseUint`: a sign, then
/// `0x`/`0o`/`0b` or a leading `0` (octal) or decimal.
fn go_parse_int(s: &str) -> Option<i128> {
    let (neg, rest) = match s.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    };
    let lower = rest.to_ascii_lowercase();
    let (radix, digits) = if let Some(d) = lower.strip_prefix("0x") {
        (16, d)
    } else if let Some(d) = lower.strip_prefix("0o") {
        (8, d)
    } else if let Some(d) = lower.strip_prefix("0b") {
        (2, d)
    } else if lower.len() > 1 && lower.starts_with('0') {
        (8, &lower[1..])
    } else {
        (10, lower.as_str())
    };
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    let v = u64::from_str_radix(digits, radix).ok()?;
    let v = i128::from(v);
    let v = if neg { -v } else { v };
    (v >= i128::from(i64::MIN) && (neg || v <= i128::from(u64::MAX))).then_some(v)
}

/// A float as `sops -d` writes it (yaml.v3 `FormatFloat(f, 'g', -1, 64)`):
/// a whole number below 1e6 in magnitude reads back as an integer.
fn go_float_value(f: f64) -> Value {
    if f.is_finite() && f.fract() == 0.0 && f.abs() < 1e6 {
        // Exact: a whole number of this size converts without loss.
        #[allow(clippy::cast_possible_truncation)]
        Value::from(f as i64)
    } else {
        Value::from(f)
    }
}

/// Go's `strconv.FormatFloat(f, 'f', -1, 64)`.
fn go_float(f: f64) -> String {
    if f.is_nan() {
        "NaN".into()
    } else if f.is_infinite() {
        if f > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else {
        f.to_string()
    }
}

/// One decryption pass over a file's documents.
struct Walk<'a, I: Iterator<Item = Hint>> {
    cipher: &'a SopsGcm,
    rule: &'a Rule,
    mac_only: bool,
    hash: Sha512,
    hints: Option<I>,
    values: Vec<Revealed>,
}

impl<I: Iterator<Item = Hint>> Walk<'_, I> {
    fn decrypt(&mut self, value: &mut Value, path: &mut Vec<String>) -> Result<(), WalkError> {
        match value {
            Value::Mapping(m) => {
                for (k, v) in m.iter_mut() {
                    path.push(key_text(k).map_err(WalkError::Invalid)?);
                    self.decrypt(v, path)?;
                    path.pop();
                }
                return Ok(());
            }
            Value::Sequence(items) => {
                for v in items {
                    self.decrypt(v, path)?;
                }
                return Ok(());
            }
            Value::Tagged(t) => return self.decrypt(&mut t.value, path),
            _ => {}
        }
        // A leaf: how it was written, for the values sops types otherwise.
        let hint = self.hints.as_mut().and_then(Iterator::next).flatten();
        if let Some(go) = hint.as_deref().and_then(go_resolve) {
            *value = go;
        }
        if value.is_null() {
            return Ok(());
        }
        if !self.rule.encrypts(path) {
            if !self.mac_only {
                self.hash.update(plain_bytes(value).as_bytes());
            }
            return Ok(());
        }
        let s = match value {
            Value::String(s) if s.is_empty() => return Ok(()),
            Value::String(s) if s.starts_with("ENC[AES256_GCM,") => s.clone(),
            _ => return Err(WalkError::Clear(shown_path(path))),
        };
        let plain = decrypt_value(self.cipher, &s, &aad(path)).map_err(|e| match e {
            WalkError::Tampered(_) => WalkError::Tampered(shown_path(path)),
            other => other,
        })?;
        let text = matches!(plain, Decrypted::Text(_));
        let (bytes, new) = match plain {
            Decrypted::Text(t) => (t.clone(), Value::String(t)),
            Decrypted::Int(i) => (i.to_string(), Value::from(i)),
            Decrypted::Float(f) => (go_float(f), go_float_value(f)),
            Decrypted::Bool(b) => (go_bool(b).into(), Value::Bool(b)),
        };
        self.hash.update(bytes.as_bytes());
        self.values.push(Revealed {
            at: shown_path(path),
            value: bytes,
            text,
        });
        *value = new;
        Ok(())
    }
}

/// Every leaf but those under `_unencrypted` keys encrypted, each typed as
/// Go's yaml.v3 reads it (`hints`, from [`scalar_hints`]), as `sops -e` does.
fn walk_encrypt(
    value: &mut Value,
    path: &mut Vec<String>,
    clear: bool,
    cipher: &SopsGcm,
    hash: &mut Sha512,
    hints: &mut Option<std::vec::IntoIter<Hint>>,
) -> Result<(), SopsError> {
    match value {
        Value::Mapping(m) => {
            for (k, v) in m.iter_mut() {
                let key = key_text(k).map_err(SopsError::Encrypt)?;
                let clear = clear || key.ends_with(UNENCRYPTED_SUFFIX);
                path.push(key);
                walk_encrypt(v, path, clear, cipher, hash, hints)?;
                path.pop();
            }
            return Ok(());
        }
        Value::Sequence(items) => {
            for v in items {
                walk_encrypt(v, path, clear, cipher, hash, hints)?;
            }
            return Ok(());
        }
        Value::Tagged(t) => return walk_encrypt(&mut t.value, path, clear, cipher, hash, hints),
        _ => {}
    }
    let hint = hints.as_mut().and_then(Iterator::next).flatten();
    if let Some(go) = hint.as_deref().and_then(go_resolve) {
        *value = go;
    }
    if value.is_null() {
        return Ok(());
    }
    let bytes = plain_bytes(value);
    hash.update(bytes.as_bytes());
    let kind = match value {
        Value::Bool(_) => "bool",
        Value::Number(n) if n.is_f64() => "float",
        Value::Number(_) => "int",
        _ => "str",
    };
    // sops keeps empty strings as they are (aes.Cipher.Encrypt).
    if !clear && !bytes.is_empty() {
        *value = Value::String(encrypt_value(cipher, bytes.as_bytes(), kind, &aad(path))?);
    }
    Ok(())
}

/// A leaf as sops's `ToBytes` spells it for the MAC.
fn plain_bytes(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Bool(b) => go_bool(*b).into(),
        Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => i.to_string(),
            (_, Some(u), _) => u.to_string(),
            (_, _, Some(f)) => go_float(f),
            _ => n.to_string(),
        },
        _ => String::new(),
    }
}

fn go_bool(b: bool) -> &'static str {
    if b { "True" } else { "False" }
}

/// Where a value sits, for messages: `cluster.secret`.
fn shown_path(path: &[String]) -> String {
    crate::input::excerpt(&path.join("."), 200)
}

fn decrypt_value(cipher: &SopsGcm, text: &str, aad: &str) -> Result<Decrypted, WalkError> {
    let bad = |m: &str| WalkError::Invalid(format!("malformed ENC[…] value: {m}"));
    let inner = text
        .strip_prefix("ENC[AES256_GCM,")
        .and_then(|t| t.strip_suffix(']'))
        .ok_or_else(|| bad("not ENC[AES256_GCM,…]"))?;
    let mut parts = inner.split(',');
    let mut field = |name: &str| {
        parts
            .next()
            .and_then(|p| p.strip_prefix(name))
            .and_then(|p| p.strip_prefix(':'))
            .ok_or_else(|| bad(&format!("no {name}")))
    };
    let (data, iv, tag, kind) = (field("data")?, field("iv")?, field("tag")?, field("type")?);
    let decode = |s: &str, what: &str| STANDARD.decode(s).map_err(|_| bad(what));
    let mut data = decode(data, "data is not base64")?;
    let iv = decode(iv, "iv is not base64")?;
    let tag = decode(tag, "tag is not base64")?;
    let nonce =
        <&aes_gcm::Nonce<U32>>::try_from(iv.as_slice()).map_err(|_| bad("iv is not 32 bytes"))?;
    let tag = <&aes_gcm::Tag>::try_from(tag.as_slice()).map_err(|_| bad("tag is not 16 bytes"))?;
    cipher
        .decrypt_inout_detached(nonce, aad.as_bytes(), data.as_mut_slice().into(), tag)
        .map_err(|_| WalkError::Tampered(String::new()))?;
    let text = String::from_utf8(data).map_err(|_| bad("not UTF-8"))?;
    Ok(match kind {
        "str" | "bytes" | "time" | "comment" => Decrypted::Text(text),
        "int" => Decrypted::Int(
            text.parse()
                .map_err(|_| bad("type int, but not an integer"))?,
        ),
        "float" => Decrypted::Float(
            text.parse()
                .map_err(|_| bad("type float, but not a number"))?,
        ),
        "bool" => Decrypted::Bool(match text.as_str() {
            "1" | "t" | "T" | "TRUE" | "true" | "True" => true,
            "0" | "f" | "F" | "FALSE" | "false" | "False" => false,
            _ => return Err(bad("type bool, but not a boolean")),
        }),
        _ => return Err(bad("unknown type")),
    })
}

fn encrypt_value(
    cipher: &SopsGcm,
    plain: &[u8],
    kind: &str,
    aad: &str,
) -> Result<String, SopsError> {
    let mut iv = [0u8; 32];
    aws_lc_rs::rand::fill(&mut iv).map_err(|_| SopsError::Encrypt("no random bytes".into()))?;
    let mut data = plain.to_vec();
    let nonce = <&aes_gcm::Nonce<U32>>::from(&iv);
    let tag = cipher
        .encrypt_inout_detached(nonce, aad.as_bytes(), data.as_mut_slice().into())
        .map_err(|_| SopsError::Encrypt("AES-GCM failed".into()))?;
    Ok(format!(
        "ENC[AES256_GCM,data:{},iv:{},tag:{},type:{kind}]",
        STANDARD.encode(&data),
        STANDARD.encode(iv),
        STANDARD.encode(tag.as_slice())
    ))
}

/// `sops.lastmodified` as Go's `time.Parse(RFC3339)` then
/// `Format(RFC3339)` spells it (the MAC's AAD): fractions of a second
/// dropped, UTC as `Z`.
fn go_rfc3339(text: &str) -> Option<String> {
    let t =
        time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339).ok()?;
    let off = t.offset();
    let zone = if off.is_utc() {
        "Z".to_owned()
    } else {
        let (h, m, _) = off.as_hms();
        let sign = if off.is_negative() { '-' } else { '+' };
        format!("{sign}{:02}:{:02}", h.abs(), m.abs())
    };
    Some(format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}{zone}",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    ))
}

fn now_rfc3339() -> String {
    let t = time::OffsetDateTime::now_utc();
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    )
}

/// The documents as YAML, `---` between them.
fn emit(docs: &[Value]) -> Result<String, String> {
    let texts: Result<Vec<String>, String> = docs
        .iter()
        .map(|d| serde_yaml_ng::to_string(d).map_err(|e| e.to_string()))
        .collect();
    Ok(texts?.join("---\n"))
}

/// SHA-512 through aws-lc-rs.
struct Sha512(aws_lc_rs::digest::Context);

impl Sha512 {
    fn new() -> Self {
        Sha512(aws_lc_rs::digest::Context::new(&aws_lc_rs::digest::SHA512))
    }

    fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    fn finish(self) -> Vec<u8> {
        self.0.finish().as_ref().to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PLAIN: &str = "cluster:\n  id: abc\n  secret: s3cr3t-value\nsecrets:\n  bootstraptoken: tok.en\n  count: 3\n  ratio: 0.5\n  on: true\n  empty: \"\"\n  none: null\n  list:\n    - one\n    - 2\n  note_unencrypted: visible\n";

    fn keys() -> (AgeKeys, Recipient) {
        let id = Identity::generate().unwrap();
        let r = Recipient::parse(&id.recipient()).unwrap();
        (AgeKeys::new(vec![id]), r)
    }

    #[test]
    fn a_file_round_trips_with_every_value_encrypted_but_unencrypted_keys() {
        let (keys, r) = keys();
        let enc = encrypt(PLAIN, &[r]).unwrap();
        assert!(is_encrypted(&enc));
        assert!(!is_encrypted(PLAIN));
        assert!(
            !enc.contains("s3cr3t-value") && !enc.contains("tok.en"),
            "{enc}"
        );
        assert!(enc.contains("note_unencrypted: visible"), "{enc}");
        assert!(
            enc.contains("type:int]") && enc.contains("type:bool]"),
            "{enc}"
        );
        let plain = decrypt(&enc, Path::new("s.yaml"), &keys).unwrap();
        let want: Value = serde_yaml_ng::from_str(PLAIN).unwrap();
        let got: Value = serde_yaml_ng::from_str(&plain).unwrap();
        assert_eq!(got, want);
    }

    #[test]
    fn a_changed_value_or_mac_is_refused_naming_the_file() {
        let (keys, r) = keys();
        let enc = encrypt(PLAIN, &[r]).unwrap();
        // Swap two encrypted values: each still decrypts under its own
        // path only, so the swap is caught by the value's AAD.
        let line = enc.lines().find(|l| l.contains("secret: ENC[")).unwrap();
        let value = line.split_once(": ").unwrap().1;
        let other = enc.lines().find(|l| l.contains(" id: ENC[")).unwrap();
        let swapped = enc.replacen(other, &format!("  id: {value}"), 1);
        let err = decrypt(&swapped, Path::new("s.yaml"), &keys)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("s.yaml: refused") && err.contains("cluster.id"),
            "{err}"
        );
        // A plain value replaced: the MAC no longer matches.
        let plain = enc.replace("note_unencrypted: visible", "note_unencrypted: changed");
        let err = decrypt(&plain, Path::new("s.yaml"), &keys)
            .unwrap_err()
            .to_string();
        assert!(err.contains("MAC over the values does not match"), "{err}");
        // The MAC itself changed.
        let mac_line = enc
            .lines()
            .find(|l| l.trim_start().starts_with("mac: "))
            .unwrap();
        let mac = mac_line.split_once("data:").unwrap().1;
        let flipped = if mac.starts_with('A') { "B" } else { "A" };
        let bad = enc.replace(
            mac_line,
            &mac_line.replacen(
                &format!("data:{}", &mac[..1]),
                &format!("data:{flipped}"),
                1,
            ),
        );
        let err = decrypt(&bad, Path::new("s.yaml"), &keys)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("s.yaml: refused") && err.contains("sops.mac"),
            "{err}"
        );
    }

    #[test]
    fn a_wrong_key_is_refused_naming_the_recipients() {
        let (_, r) = keys();
        let (other, _) = keys();
        let enc = encrypt(PLAIN, std::slice::from_ref(&r)).unwrap();
        let err = decrypt(&enc, Path::new("s.yaml"), &other)
            .unwrap_err()
            .to_string();
        assert!(err.contains(&format!("encrypted for {r}")), "{err}");
        assert!(err.starts_with("s.yaml: no age key opens it"), "{err}");
        let none = AgeKeys::from_sources(None, None, None).unwrap();
        let err = decrypt(&enc, Path::new("s.yaml"), &none)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("no age key found in SOPS_AGE_KEY, SOPS_AGE_KEY_FILE"),
            "{err}"
        );
    }

    #[test]
    fn keys_come_from_sops_age_key_and_the_key_files() {
        let dir = tempfile::tempdir().unwrap();
        let a = Identity::generate().unwrap();
        let b = Identity::generate().unwrap();
        let c = Identity::generate().unwrap();
        let file = dir.path().join("keys.txt");
        std::fs::write(&file, format!("# created: now\n{}\n", b.to_secret_string())).unwrap();
        let default = dir.path().join("default.txt");
        std::fs::write(&default, c.to_secret_string()).unwrap();
        let keys = AgeKeys::from_sources(
            Some(a.to_secret_string()),
            Some(file.clone()),
            Some(default),
        )
        .unwrap();
        let got: Vec<String> = keys.identities.iter().map(Identity::recipient).collect();
        assert_eq!(got, [a.recipient(), b.recipient(), c.recipient()]);
        std::fs::write(&file, "AGE-SECRET-KEY-1NOTAKEY\n").unwrap();
        let err = AgeKeys::from_sources(None, Some(file.clone()), None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&file.display().to_string()) && err.contains("line 1"),
            "{err}"
        );
        assert!(!err.contains("NOTAKEY"), "{err}");
    }

    #[test]
    fn plain_scalars_are_typed_as_gos_yaml_reads_them() {
        let v = |t: &str| go_resolve(t);
        assert_eq!(v("0644"), Some(Value::from(420)));
        assert_eq!(v("1_000"), Some(Value::from(1000)));
        assert_eq!(v("0x1F"), Some(Value::from(31)));
        assert_eq!(v("0o17"), Some(Value::from(15)));
        assert_eq!(v("-0b101"), Some(Value::from(-5)));
        assert_eq!(v("1e3"), Some(Value::from(1000)));
        assert_eq!(v("1.5"), Some(Value::from(1.5)));
        assert_eq!(v("09"), Some(Value::from(9)), "no octal: a float");
        assert_eq!(v(".inf"), Some(Value::from(f64::INFINITY)));
        assert_eq!(v("-.Inf"), Some(Value::from(f64::NEG_INFINITY)));
        assert_eq!(v("True"), Some(Value::Bool(true)));
        assert_eq!(v("~"), Some(Value::Null));
        assert_eq!(
            v("2024-1-2"),
            Some(Value::from("2024-01-02T00:00:00Z".to_owned()))
        );
        assert_eq!(
            v("2024-01-02T03:04:05.5+02:00"),
            Some(Value::from("2024-01-02T03:04:05+02:00".to_owned()))
        );
        for text in [
            "yes",
            "1.2.3",
            "10.0.0.1",
            "v1.11",
            "0x",
            "2024-13-01",
            "abc",
        ] {
            assert_eq!(v(text), None, "{text}");
        }
        assert_eq!(go_float(f64::INFINITY), "+Inf");
        assert_eq!(go_float(0.1), "0.1");
    }

    #[test]
    fn which_values_are_encrypted_follows_the_files_rule() {
        let meta = |yaml: &str| -> Mapping { serde_yaml_ng::from_str(yaml).unwrap() };
        let path = |p: &[&str]| p.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let default = Rule::of(&meta("version: 3.11.0")).unwrap();
        assert!(default.encrypts(&path(&["a", "b"])));
        assert!(!default.encrypts(&path(&["a_unencrypted", "b"])));
        let re = Rule::of(&meta("encrypted_regex: ^(data|stringData)$")).unwrap();
        assert!(re.encrypts(&path(&["data", "x"])));
        assert!(!re.encrypts(&path(&["metadata", "name"])));
        let un = Rule::of(&meta("unencrypted_regex: pub")).unwrap();
        assert!(
            !un.encrypts(&path(&["a", "my_pub_key"])),
            "found anywhere, as Go's regexp.Match"
        );
        let suffix = Rule::of(&meta("encrypted_suffix: _secret")).unwrap();
        assert!(suffix.encrypts(&path(&["db_secret", "x"])));
        assert!(!suffix.encrypts(&path(&["db", "x"])));
        assert!(Rule::of(&meta("encrypted_regex: a\nunencrypted_suffix: b")).is_err());
        assert!(Rule::of(&meta("encrypted_comment_regex: sops")).is_err());
    }

    #[test]
    fn lastmodified_is_spelled_as_go_formats_it() {
        assert_eq!(
            go_rfc3339("2024-05-01T10:11:12Z").unwrap(),
            "2024-05-01T10:11:12Z"
        );
        assert_eq!(
            go_rfc3339("2024-05-01T10:11:12.5+02:00").unwrap(),
            "2024-05-01T10:11:12+02:00"
        );
        assert!(go_rfc3339("yesterday").is_none());
    }
}
