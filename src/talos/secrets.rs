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
}

/// `talosctl gen secrets` output. Field names are go-yaml's lower-cased Go
/// struct names; PEM values are base64-encoded, as Talos marshals them.
#[derive(Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
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
#[serde(deny_unknown_fields)]
pub struct ClusterIdentity {
    pub id: String,
    pub secret: String,
}

#[derive(Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ClusterSecrets {
    pub bootstraptoken: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub aescbcencryptionsecret: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub secretboxencryptionsecret: String,
}

#[derive(Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TrustdInfo {
    pub token: String,
}

#[derive(Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
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
#[serde(deny_unknown_fields)]
pub struct PemPair {
    pub crt: String,
    pub key: String,
}

/// A key alone (the service-account key has no certificate).
#[derive(Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
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
    pub fn decode(&self) -> Result<CertAndKey, String> {
        Ok(CertAndKey {
            crt: unb64(&self.crt).map_err(|e| format!("crt: {e}"))?,
            key: unb64(&self.key).map_err(|e| format!("key: {e}"))?,
        })
    }
}

fn unb64(value: &str) -> Result<String, String> {
    let bytes = STANDARD
        .decode(value.trim())
        .map_err(|_| "not base64".to_owned())?;
    String::from_utf8(bytes).map_err(|_| "not PEM text".to_owned())
}

impl SecretsBundle {
    /// A fresh bundle, as `talosctl gen secrets` makes it (CAs for 10 years).
    pub fn generate() -> Result<SecretsBundle, SecretsError> {
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
                    key: b64(&pki::new_rsa_key_pem()?),
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
        bundle.check().map_err(invalid)?;
        Ok(bundle)
    }

    /// Reads `path`.
    pub fn load(path: &Path) -> Result<SecretsBundle, SecretsError> {
        let text =
            crate::input::read_text(path, crate::input::MAX_TEXT_FILE).map_err(|source| {
                SecretsError::Io {
                    path: path.display().to_string(),
                    source,
                }
            })?;
        Self::parse(&text, path)
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
    fn check(&self) -> Result<(), String> {
        if !pki::is_token(&self.secrets.bootstraptoken) {
            return Err("secrets.bootstraptoken: not a token like abcdef.0123456789abcdef".into());
        }
        if !pki::is_token(&self.trustdinfo.token) {
            return Err("trustdinfo.token: not a token like abcdef.0123456789abcdef".into());
        }
        if self.cluster.id.is_empty() || self.cluster.secret.is_empty() {
            return Err("cluster.id and cluster.secret must be set".into());
        }
        if self.secrets.secretboxencryptionsecret.is_empty()
            && self.secrets.aescbcencryptionsecret.is_empty()
        {
            return Err("secrets: no encryption secret (secretboxencryptionsecret)".into());
        }
        let pairs = [
            ("certs.etcd", &self.certs.etcd, KeyKind::EcdsaP256),
            ("certs.k8s", &self.certs.k8s, KeyKind::EcdsaP256),
            (
                "certs.k8saggregator",
                &self.certs.k8saggregator,
                KeyKind::EcdsaP256,
            ),
            ("certs.os", &self.certs.os, KeyKind::Ed25519),
        ];
        for (field, pair, kind) in pairs {
            let decoded = pair.decode().map_err(|e| format!("{field}.{e}"))?;
            let info = pki::cert_info(&decoded.crt).map_err(|e| format!("{field}.crt: {e}"))?;
            if !info.is_ca {
                return Err(format!("{field}.crt: not a CA certificate"));
            }
            let found = pki::key_kind(&decoded.key).map_err(|e| format!("{field}.key: {e}"))?;
            if found != kind {
                return Err(format!(
                    "{field}.key: a {found:?} key where Talos uses {kind:?}"
                ));
            }
            if !pki::key_matches(&decoded.crt, &decoded.key).map_err(|e| format!("{field}: {e}"))? {
                return Err(format!("{field}.key does not belong to {field}.crt"));
            }
        }
        let sa = unb64(&self.certs.k8sserviceaccount.key)
            .map_err(|e| format!("certs.k8sserviceaccount.key: {e}"))?;
        pki::key_kind(&sa).map_err(|e| format!("certs.k8sserviceaccount.key: {e}"))?;
        Ok(())
    }

    /// The OS (Talos API) CA, decoded.
    pub fn os_ca(&self) -> CertAndKey {
        self.certs.os.decode().expect("checked when loaded")
    }

    /// A talosctl admin identity: Ed25519, O=os:admin, one year.
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
            (text.replace("trustdinfo:", "trustd:"), "unknown field"),
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
