//! The cluster's secrets bundle, in the layout `talosctl gen secrets` writes
//! (`secrets.yaml`), so either tool can read the other's file.

use std::fmt;
use std::path::Path;

use base64::Engine;
use base64::engine::general_purpose::{STANDARD, URL_SAFE};
use serde::{Deserialize, Serialize};

use super::pki::{self, CertAndKey, KeyKind};

/// Why a secrets bundle could not be made, read or written. Messages name the
/// file and field, never a value.
#[derive(Debug, thiserror::Error)]
pub enum SecretsError {
    #[error("{path}: {message}")]
    Invalid { path: String, message: String },
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "{path} already exists; imgbuild never replaces cluster secrets silently (pass --force to replace them, which makes every existing node's configuration foreign)"
    )]
    Exists { path: String },
    #[error("could not generate secrets: {0}")]
    Generate(#[from] pki::PkiError),
    #[error(transparent)]
    Sops(#[from] crate::secrets::sops::SopsError),
    /// The bundle parsed but would make configs a node rejects.
    #[error("{path}: {problem}")]
    Check {
        path: String,
        #[source]
        problem: BundleProblem,
    },
}

/// What is wrong inside a parsed bundle: names the field, never its value.
#[derive(Debug, thiserror::Error)]
pub enum BundleProblem {
    #[error("{field}: not a token like abcdef.0123456789abcdef")]
    NotToken { field: &'static str },
    #[error("cluster.id and cluster.secret must be set")]
    NoClusterId,
    #[error("secrets: no encryption secret (secretboxencryptionsecret)")]
    NoEncryptionSecret,
    /// A PEM field that is not base64 of PEM text.
    #[error("{field}: {why}")]
    Undecodable { field: String, why: Undecodable },
    /// A PEM field the PKI code could not read.
    #[error("{field}: {source}")]
    Pki {
        field: String,
        #[source]
        source: pki::PkiError,
    },
    #[error("{field}.crt: not a CA certificate")]
    NotCa { field: &'static str },
    #[error("{field}.key: an {found} key; this CA must be {allowed}")]
    WrongKind {
        field: &'static str,
        found: KeyKind,
        /// The kinds this CA may have, comma-separated.
        allowed: String,
    },
    #[error("{field}.key does not belong to {field}.crt")]
    KeyMismatch { field: &'static str },
}

/// Why a base64 PEM field could not be decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Undecodable {
    #[error("not base64")]
    NotBase64,
    #[error("not PEM text")]
    NotPem,
}

/// Which half of a [`PemPair`] could not be decoded.
#[derive(Debug, thiserror::Error)]
#[error("{part}: {why}")]
pub struct PemPairError {
    /// `crt` or `key`.
    pub part: &'static str,
    pub why: Undecodable,
}

/// `talosctl gen secrets` output. Field names are go-yaml's lower-cased Go
/// struct names; PEM values are base64-encoded, as Talos marshals them.
/// Unknown fields are ignored, as talosctl's `LoadBundle`
/// (talos `pkg/machinery/config/generate/secrets/bundle.go`) ignores them:
/// a bundle from a newer talosctl still loads ([`SecretsBundle::read`]
/// names what was left out).
#[derive(Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SecretsBundle {
    pub cluster: ClusterIdentity,
    pub secrets: ClusterSecrets,
    pub trustdinfo: TrustdInfo,
    pub certs: Certs,
}

impl fmt::Debug for SecretsBundle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SecretsBundle { <redacted> }")
    }
}

#[derive(Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ClusterIdentity {
    pub id: String,
    pub secret: String,
}

#[derive(Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ClusterSecrets {
    pub bootstraptoken: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub aescbcencryptionsecret: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub secretboxencryptionsecret: String,
}

#[derive(Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct TrustdInfo {
    pub token: String,
}

#[derive(Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Certs {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admin: Option<PemPair>,
    pub etcd: PemPair,
    pub k8s: PemPair,
    pub k8saggregator: PemPair,
    pub k8sserviceaccount: PemKey,
    pub os: PemPair,
}

/// A certificate and key as base64 of their PEM text.
#[derive(Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PemPair {
    pub crt: String,
    pub key: String,
}

/// A key alone (the service-account key has no certificate).
#[derive(Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PemKey {
    pub key: String,
}

fn b64(pem: &str) -> String {
    STANDARD.encode(pem)
}

impl PemPair {
    fn from_pem(pair: &CertAndKey) -> Self {
        PemPair {
            crt: b64(&pair.crt),
            key: b64(&pair.key),
        }
    }

    /// The decoded PEM texts.
    pub fn decode(&self) -> Result<CertAndKey, PemPairError> {
        let half = |part, value| unb64(value).map_err(|why| PemPairError { part, why });
        Ok(CertAndKey {
            crt: half("crt", &self.crt)?,
            key: half("key", &self.key)?,
        })
    }
}

fn unb64(value: &str) -> Result<String, Undecodable> {
    let bytes = STANDARD
        .decode(value.trim())
        .map_err(|_| Undecodable::NotBase64)?;
    String::from_utf8(bytes).map_err(|_| Undecodable::NotPem)
}

impl SecretsBundle {
    /// A fresh bundle, as `talosctl gen secrets` makes it (CAs for 10 years).
    pub fn generate() -> Result<SecretsBundle, SecretsError> {
        Self::generate_with(KeyKind::Rsa)
    }

    /// A bundle only for rendering configs that are checked and thrown
    /// away (`validate`, dry runs): an ECDSA service-account key, as Talos
    /// before 1.6 made it, takes milliseconds where RSA-4096 takes seconds.
    pub fn throwaway() -> Result<SecretsBundle, SecretsError> {
        Self::generate_with(KeyKind::EcdsaP256)
    }

    fn generate_with(service_account: KeyKind) -> Result<SecretsBundle, SecretsError> {
        let ca = |kind, org| pki::new_ca(kind, org, None, 10);
        Ok(SecretsBundle {
            cluster: ClusterIdentity {
                id: URL_SAFE.encode(pki::random_bytes(32)),
                secret: STANDARD.encode(pki::random_bytes(32)),
            },
            secrets: ClusterSecrets {
                bootstraptoken: pki::token(),
                aescbcencryptionsecret: String::new(),
                secretboxencryptionsecret: STANDARD.encode(pki::random_bytes(32)),
            },
            trustdinfo: TrustdInfo {
                token: pki::token(),
            },
            certs: Certs {
                admin: None,
                etcd: PemPair::from_pem(&ca(KeyKind::EcdsaP256, "etcd")?),
                k8s: PemPair::from_pem(&ca(KeyKind::EcdsaP256, "kubernetes")?),
                k8saggregator: PemPair::from_pem(&pki::new_ca(
                    KeyKind::EcdsaP256,
                    "kubernetes",
                    Some("front-proxy"),
                    10,
                )?),
                k8sserviceaccount: PemKey {
                    key: b64(&pki::new_key_pem(service_account)?),
                },
                os: PemPair::from_pem(&ca(KeyKind::Ed25519, "talos")?),
            },
        })
    }

    /// Parses and checks `text` (from `path`, named in errors).
    pub fn parse(text: &str, path: &Path) -> Result<SecretsBundle, SecretsError> {
        let invalid = |message: String| SecretsError::Invalid {
            path: path.display().to_string(),
            message,
        };
        let text = crate::input::yaml(text).map_err(|e| invalid(e.to_string()))?;
        let bundle: SecretsBundle = serde_yaml_ng::from_str(text).map_err(|e| {
            // serde messages quote values, which here are keys and tokens.
            invalid(format!(
                "not a talosctl secrets bundle: {}",
                crate::input::yaml_error_without_values(&e)
            ))
        })?;
        bundle.check().map_err(|problem| SecretsError::Check {
            path: path.display().to_string(),
            problem,
        })?;
        Ok(bundle)
    }

    /// Reads `path`.
    pub fn load(path: &Path) -> Result<SecretsBundle, SecretsError> {
        Ok(Self::read(path)?.0)
    }

    /// Reads `path`, and the fields of it that imgbuild ignored (dotted
    /// paths, e.g. `certs.newca`): the caller warns, since a saved copy
    /// does not keep them.
    pub fn read(path: &Path) -> Result<(SecretsBundle, Vec<String>), SecretsError> {
        let text =
            crate::input::read_text(path, crate::input::MAX_TEXT_FILE).map_err(|source| {
                SecretsError::Io {
                    path: path.display().to_string(),
                    source,
                }
            })?;
        // A SOPS/age-encrypted bundle (kept in Git) reads as its plaintext.
        let text = crate::secrets::sops::open(&text, path)?;
        let bundle = Self::parse(&text, path)?;
        Ok((bundle, unknown_fields(&text)))
    }

    /// Writes the bundle to `path` (0600, atomically). Refuses to replace an
    /// existing file unless `force`.
    pub fn save(&self, path: &Path, force: bool) -> Result<(), SecretsError> {
        let io = |source| SecretsError::Io {
            path: path.display().to_string(),
            source,
        };
        if path.exists() && !force {
            return Err(SecretsError::Exists {
                path: path.display().to_string(),
            });
        }
        let text = serde_yaml_ng::to_string(self).expect("bundle serialises");
        let mut file = crate::atomic::AtomicFile::create(path, true).map_err(io)?;
        std::io::Write::write_all(file.file(), text.as_bytes()).map_err(io)?;
        file.commit().map_err(io)
    }

    /// Every check that keeps a bad bundle from producing configs a node
    /// rejects later: decodable PEM, key matching certificate, right kinds.
    fn check(&self) -> Result<(), BundleProblem> {
        if !pki::is_token(&self.secrets.bootstraptoken) {
            return Err(BundleProblem::NotToken {
                field: "secrets.bootstraptoken",
            });
        }
        if !pki::is_token(&self.trustdinfo.token) {
            return Err(BundleProblem::NotToken {
                field: "trustdinfo.token",
            });
        }
        if self.cluster.id.is_empty() || self.cluster.secret.is_empty() {
            return Err(BundleProblem::NoClusterId);
        }
        if self.secrets.secretboxencryptionsecret.is_empty()
            && self.secrets.aescbcencryptionsecret.is_empty()
        {
            return Err(BundleProblem::NoEncryptionSecret);
        }
        // talosctl makes ECDSA Kubernetes/etcd CAs and an Ed25519 OS CA
        // (ECDSA in FIPS mode); `--from-kubernetes-pki` takes kubeadm's CAs,
        // RSA or ECDSA.
        const KUBE: &[KeyKind] = &[KeyKind::EcdsaP256, KeyKind::EcdsaP384, KeyKind::Rsa];
        const OS: &[KeyKind] = &[KeyKind::Ed25519, KeyKind::EcdsaP256, KeyKind::EcdsaP384];
        let pairs = [
            ("certs.etcd", &self.certs.etcd, KUBE),
            ("certs.k8s", &self.certs.k8s, KUBE),
            ("certs.k8saggregator", &self.certs.k8saggregator, KUBE),
            ("certs.os", &self.certs.os, OS),
        ];
        let pki_at = |field: String| move |source| BundleProblem::Pki { field, source };
        for (field, pair, kinds) in pairs {
            let decoded = pair.decode().map_err(|e| BundleProblem::Undecodable {
                field: format!("{field}.{}", e.part),
                why: e.why,
            })?;
            let info = pki::cert_info(&decoded.crt).map_err(pki_at(format!("{field}.crt")))?;
            if !info.is_ca {
                return Err(BundleProblem::NotCa { field });
            }
            let found = pki::key_kind(&decoded.key).map_err(pki_at(format!("{field}.key")))?;
            if !kinds.contains(&found) {
                let allowed: Vec<String> = kinds.iter().map(KeyKind::to_string).collect();
                return Err(BundleProblem::WrongKind {
                    field,
                    found,
                    allowed: allowed.join(", "),
                });
            }
            if !pki::key_matches(&decoded.crt, &decoded.key).map_err(pki_at(field.to_owned()))? {
                return Err(BundleProblem::KeyMismatch { field });
            }
        }
        const SA: &str = "certs.k8sserviceaccount.key";
        let sa =
            unb64(&self.certs.k8sserviceaccount.key).map_err(|why| BundleProblem::Undecodable {
                field: SA.to_owned(),
                why,
            })?;
        pki::key_kind(&sa).map_err(pki_at(SA.to_owned()))?;
        Ok(())
    }

    /// The OS (Talos API) CA, decoded.
    pub fn os_ca(&self) -> CertAndKey {
        self.certs.os.decode().expect("checked when loaded")
    }

    /// A talosctl admin identity: the OS CA's algorithm, O=os:admin, one year.
    pub fn admin_identity(&self) -> Result<CertAndKey, SecretsError> {
        Ok(pki::issue(
            &self.os_ca(),
            &pki::LeafSpec {
                organization: Some("os:admin".into()),
                common_name: "admin".into(),
                client: true,
                days: 365,
                ..pki::LeafSpec::default()
            },
        )?)
    }
}

/// The fields of a bundle, by dotted parent path, that imgbuild reads.
const LAYOUT: &[(&str, &[&str])] = &[
    ("", &["cluster", "secrets", "trustdinfo", "certs"]),
    ("cluster", &["id", "secret"]),
    (
        "secrets",
        &[
            "bootstraptoken",
            "aescbcencryptionsecret",
            "secretboxencryptionsecret",
        ],
    ),
    ("trustdinfo", &["token"]),
    (
        "certs",
        &[
            "admin",
            "etcd",
            "k8s",
            "k8saggregator",
            "k8sserviceaccount",
            "os",
        ],
    ),
    ("certs.admin", &["crt", "key"]),
    ("certs.etcd", &["crt", "key"]),
    ("certs.k8s", &["crt", "key"]),
    ("certs.k8saggregator", &["crt", "key"]),
    ("certs.k8sserviceaccount", &["key"]),
    ("certs.os", &["crt", "key"]),
];

/// The keys of `text` (a bundle that parsed) outside [`LAYOUT`], as dotted
/// paths. Names only: values are never looked at.
fn unknown_fields(text: &str) -> Vec<String> {
    let Ok(doc) = serde_yaml_ng::from_str::<serde_yaml_ng::Value>(text) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (parent, known) in LAYOUT {
        let node = parent
            .split('.')
            .filter(|p| !p.is_empty())
            .try_fold(&doc, |v, k| v.get(k));
        let Some(map) = node.and_then(|n| n.as_mapping()) else {
            continue;
        };
        for key in map.keys() {
            let name = match key {
                serde_yaml_ng::Value::String(s) => s.clone(),
                other => serde_yaml_ng::to_string(other)
                    .unwrap_or_default()
                    .trim()
                    .to_owned(),
            };
            if !known.contains(&name.as_str()) {
                out.push(if parent.is_empty() {
                    name
                } else {
                    format!("{parent}.{name}")
                });
            }
        }
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::OnceLock;

    /// One generated bundle for every test (RSA-4096 takes a while).
    pub(crate) fn bundle() -> &'static SecretsBundle {
        static B: OnceLock<SecretsBundle> = OnceLock::new();
        B.get_or_init(|| SecretsBundle::generate().unwrap())
    }

    #[test]
    fn round_trips_through_yaml_with_the_talosctl_layout() {
        let b = bundle();
        let text = serde_yaml_ng::to_string(b).unwrap();
        let back = SecretsBundle::parse(&text, Path::new("s.yaml")).unwrap();
        assert!(back == *b);
        let v: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).unwrap();
        let keys = |v: &serde_yaml_ng::Value| -> Vec<String> {
            v.as_mapping()
                .unwrap()
                .keys()
                .map(|k| k.as_str().unwrap().to_owned())
                .collect()
        };
        assert_eq!(keys(&v), ["cluster", "secrets", "trustdinfo", "certs"]);
        assert_eq!(keys(&v["cluster"]), ["id", "secret"]);
        assert_eq!(
            keys(&v["secrets"]),
            ["bootstraptoken", "secretboxencryptionsecret"]
        );
        assert_eq!(
            keys(&v["certs"]),
            ["etcd", "k8s", "k8saggregator", "k8sserviceaccount", "os"]
        );
        assert_eq!(URL_SAFE.decode(&b.cluster.id).unwrap().len(), 32);
        assert_eq!(STANDARD.decode(&b.cluster.secret).unwrap().len(), 32);
        let os = unb64(v["certs"]["os"]["key"].as_str().unwrap()).unwrap();
        assert!(os.starts_with("-----BEGIN ED25519 PRIVATE KEY-----"));
        let sa = unb64(v["certs"]["k8sserviceaccount"]["key"].as_str().unwrap()).unwrap();
        assert!(sa.starts_with("-----BEGIN RSA PRIVATE KEY-----"));
    }

    #[test]
    fn bad_bundles_name_the_field() {
        let text = serde_yaml_ng::to_string(bundle()).unwrap();
        let cases = [
            (
                text.replace(&bundle().secrets.bootstraptoken, "nope"),
                "secrets.bootstraptoken",
            ),
            (
                text.replace(&bundle().certs.os.key, &bundle().certs.etcd.key),
                "certs.os.key",
            ),
            (
                text.replace(&bundle().certs.k8s.key, &bundle().certs.etcd.key),
                "certs.k8s.key does not belong",
            ),
            (
                text.replace(&bundle().certs.k8s.crt, "not*base64"),
                "certs.k8s.crt: not base64",
            ),
            (
                text.replace("trustdinfo:", "trustd:"),
                "missing field `trustdinfo`",
            ),
        ];
        for (bad, want) in cases {
            let err = SecretsBundle::parse(&bad, Path::new("/x/secrets.yaml"))
                .unwrap_err()
                .to_string();
            assert!(err.starts_with("/x/secrets.yaml: "), "{err}");
            assert!(err.contains(want), "{want}: {err}");
            assert!(!err.contains("PRIVATE KEY"), "{err}");
        }
    }

    #[test]
    fn unknown_fields_are_ignored_and_named_like_talosctl_does() {
        let text = serde_yaml_ng::to_string(bundle()).unwrap();
        let newer = text
            .replace("certs:\n", "certs:\n  newca:\n    crt: c2VjcmV0\n")
            .replace("trustdinfo:\n", "trustdinfo:\n  extra: s3cret-value\n")
            + "futurefield: 1\n";
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secrets.yaml");
        std::fs::write(&path, &newer).unwrap();
        let (read, ignored) = SecretsBundle::read(&path).unwrap();
        assert!(read == *bundle());
        assert_eq!(ignored, ["futurefield", "trustdinfo.extra", "certs.newca"]);
        assert!(!ignored.iter().any(|f| f.contains("s3cret")));
        let (_, none) = {
            std::fs::write(&path, &text).unwrap();
            SecretsBundle::read(&path).unwrap()
        };
        assert!(none.is_empty(), "{none:?}");
    }

    /// `bundle()` with `os`, `etcd` and `k8s` CAs of other algorithms.
    fn with_cas(os: KeyKind, etcd: KeyKind, k8s: KeyKind) -> SecretsBundle {
        let mut b = bundle().clone();
        let ca = |kind, org| PemPair::from_pem(&pki::new_ca(kind, org, None, 1).unwrap());
        b.certs.os = ca(os, "talos");
        b.certs.etcd = ca(etcd, "etcd");
        b.certs.k8s = ca(k8s, "kubernetes");
        b
    }

    fn reparse(b: &SecretsBundle) -> Result<SecretsBundle, SecretsError> {
        let text = serde_yaml_ng::to_string(b).unwrap();
        SecretsBundle::parse(&text, Path::new("s.yaml"))
    }

    #[test]
    fn fips_and_kubeadm_cas_are_accepted_and_leaves_follow_the_ca() {
        // talosctl in FIPS mode: an ECDSA OS CA; the admin identity follows it.
        let fips = with_cas(KeyKind::EcdsaP256, KeyKind::EcdsaP384, KeyKind::EcdsaP256);
        let b = reparse(&fips).unwrap();
        let admin = b.admin_identity().unwrap();
        assert_eq!(pki::key_kind(&admin.key).unwrap(), KeyKind::EcdsaP256);
        assert!(admin.key.starts_with("-----BEGIN EC PRIVATE KEY-----"));
        // kubeadm's RSA CAs (`talosctl gen secrets --from-kubernetes-pki`).
        let rsa = pki::new_ca(KeyKind::Rsa, "kubernetes", None, 1).unwrap();
        let mut kubeadm = bundle().clone();
        kubeadm.certs.k8s = PemPair::from_pem(&rsa);
        kubeadm.certs.etcd = PemPair::from_pem(&rsa);
        reparse(&kubeadm).unwrap();
        // What Talos never makes is still refused, naming the field.
        let err = reparse(&with_cas(
            KeyKind::Ed25519,
            KeyKind::Ed25519,
            KeyKind::EcdsaP256,
        ))
        .unwrap_err();
        assert!(
            matches!(
                &err,
                SecretsError::Check {
                    problem: BundleProblem::WrongKind {
                        field: "certs.etcd",
                        found: KeyKind::Ed25519,
                        ..
                    },
                    ..
                }
            ),
            "{err:?}"
        );
        let err = err.to_string();
        assert!(
            err.contains(
                "certs.etcd.key: an Ed25519 key; this CA must be ECDSA P-256, ECDSA P-384, RSA"
            ),
            "{err}"
        );
        let mut rsa_os = bundle().clone();
        rsa_os.certs.os = PemPair::from_pem(&rsa);
        let err = reparse(&rsa_os).unwrap_err().to_string();
        assert!(err.contains("certs.os.key: an RSA key"), "{err}");
    }

    #[test]
    fn save_is_private_and_never_overwrites_silently() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secrets.yaml");
        bundle().save(&path, false).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let err = bundle().save(&path, false).unwrap_err().to_string();
        assert!(err.contains("--force"), "{err}");
        bundle().save(&path, true).unwrap();
        assert!(SecretsBundle::load(&path).unwrap() == *bundle());
    }

    #[test]
    fn admin_identity_is_os_admin_under_the_os_ca() {
        let admin = bundle().admin_identity().unwrap();
        let info = pki::cert_info(&admin.crt).unwrap();
        assert_eq!(info.organizations, ["os:admin"]);
        let days = (info.not_after - info.not_before) / 86400;
        assert!((364..=366).contains(&days), "{days}");
        assert_eq!(pki::key_kind(&admin.key).unwrap(), KeyKind::Ed25519);
    }
}
