//! talosctl's client configuration: which endpoints to talk to and the admin
//! identity (CA, certificate, key as base64 PEM) to talk with.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use serde::{Deserialize, Serialize};

use super::pki::{self, CertAndKey};
use super::secrets::SecretsBundle;
use crate::inventory::Inventory;

/// What is wrong with a talosconfig's current context (the file is named
/// by the caller). Names the field, never its value.
#[derive(Debug, thiserror::Error)]
pub enum ContextError {
    #[error("context {context:?} is not in contexts")]
    Missing { context: String },
    #[error("contexts.{context}.{field}: {why}")]
    Undecodable {
        context: String,
        field: &'static str,
        why: super::secrets::Undecodable,
    },
    #[error("contexts.{context}.{field}: {source}")]
    Pki {
        context: String,
        field: &'static str,
        #[source]
        source: pki::PkiError,
    },
}

/// Why a talosconfig could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TalosconfigError {
    #[error("{path}: {message}")]
    Invalid { path: String, message: String },
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Secrets(#[from] super::secrets::SecretsError),
    #[error("{path}: {source}")]
    Context {
        path: String,
        #[source]
        source: ContextError,
    },
    #[error(
        "{path} was made from other secrets: its CA is not the OS CA in {secrets}. Nodes configured from {secrets} will refuse it (\"x509: certificate signed by unknown authority\"), and it refuses them. Regenerate it with `imgbuild talosconfig --force`, or use the secrets.yaml that talosconfig came from."
    )]
    ForeignCa { path: String, secrets: String },
}

/// The file as talosctl reads it.
#[derive(Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Talosconfig {
    pub context: String,
    pub contexts: BTreeMap<String, Context>,
}

impl fmt::Debug for Talosconfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Talosconfig")
            .field("context", &self.context)
            .finish_non_exhaustive()
    }
}

/// One cluster's endpoints and identity.
#[derive(Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Context {
    #[serde(default)]
    pub endpoints: Vec<String>,
    #[serde(default)]
    pub nodes: Vec<String>,
    pub ca: String,
    pub crt: String,
    pub key: String,
}

/// The identity a Talos API client presents and the CA it trusts, as PEM.
#[derive(Clone)]
pub struct Identity {
    pub ca: String,
    pub client: CertAndKey,
}

impl fmt::Debug for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Identity")
            .field("client", &self.client)
            .finish_non_exhaustive()
    }
}

/// The endpoints talosctl should use: every control plane's own address,
/// never the VIP (it exists only while etcd elects a holder).
pub fn endpoints(inv: &Inventory) -> Vec<String> {
    inv.control_planes()
        .filter_map(|n| {
            n.talos_endpoint
                .clone()
                .or_else(|| n.address.map(|a| a.to_string()))
        })
        .collect()
}

impl Talosconfig {
    /// A talosconfig for `inv` with a fresh admin certificate from `secrets`.
    pub fn generate(inv: &Inventory, secrets: &SecretsBundle) -> Result<Self, TalosconfigError> {
        let admin = secrets.admin_identity()?;
        let os = secrets.os_ca();
        let endpoints = endpoints(inv);
        let context = Context {
            nodes: endpoints.iter().take(1).cloned().collect(),
            endpoints,
            ca: STANDARD.encode(&os.crt),
            crt: STANDARD.encode(&admin.crt),
            key: STANDARD.encode(&admin.key),
        };
        Ok(Talosconfig {
            context: inv.cluster.name.clone(),
            contexts: BTreeMap::from([(inv.cluster.name.clone(), context)]),
        })
    }

    /// Reads `path` through the bounded reader (a FIFO or `/dev/zero` is
    /// refused, not waited on or read forever). A parse error names field
    /// paths and types, never a value: the file holds the admin key.
    pub fn load(path: &Path) -> Result<Self, TalosconfigError> {
        let invalid = |message: String| TalosconfigError::Invalid {
            path: path.display().to_string(),
            message,
        };
        let text =
            crate::input::read_text(path, crate::input::MAX_TEXT_FILE).map_err(|source| {
                TalosconfigError::Io {
                    path: path.display().to_string(),
                    source,
                }
            })?;
        let text =
            crate::input::yaml(&text).map_err(|e| invalid(format!("not a talosconfig: {e}")))?;
        let cfg: Talosconfig = serde_yaml_ng::from_str(text).map_err(|e| {
            invalid(format!(
                "not a talosconfig: {}",
                crate::input::yaml_error_without_values(&e)
            ))
        })?;
        cfg.identity().map_err(|source| TalosconfigError::Context {
            path: path.display().to_string(),
            source,
        })?;
        Ok(cfg)
    }

    /// Writes `path` 0600, atomically.
    pub fn save(&self, path: &Path) -> Result<(), TalosconfigError> {
        let text = serde_yaml_ng::to_string(self).expect("talosconfig serialises");
        crate::atomic::write_if_changed(path, text.as_bytes(), true).map_err(|source| {
            TalosconfigError::Io {
                path: path.display().to_string(),
                source,
            }
        })?;
        Ok(())
    }

    /// The current context.
    pub fn current(&self) -> Result<&Context, ContextError> {
        self.contexts
            .get(&self.context)
            .ok_or_else(|| ContextError::Missing {
                context: self.context.clone(),
            })
    }

    /// The decoded identity of the current context.
    pub fn identity(&self) -> Result<Identity, ContextError> {
        use super::secrets::Undecodable;
        let ctx = self.current()?;
        let context = || self.context.clone();
        let decode = |field: &'static str, v: &str| -> Result<String, ContextError> {
            let undecodable = |why| ContextError::Undecodable {
                context: context(),
                field,
                why,
            };
            let bytes = STANDARD
                .decode(v.trim())
                .map_err(|_| undecodable(Undecodable::NotBase64))?;
            String::from_utf8(bytes).map_err(|_| undecodable(Undecodable::NotPem))
        };
        let id = Identity {
            ca: decode("ca", &ctx.ca)?,
            client: CertAndKey {
                crt: decode("crt", &ctx.crt)?,
                key: decode("key", &ctx.key)?,
            },
        };
        let pki_at = |field| {
            move |source| ContextError::Pki {
                context: context(),
                field,
                source,
            }
        };
        pki::certs_der(&id.ca).map_err(pki_at("ca"))?;
        pki::private_key_der(&id.client.key).map_err(pki_at("key"))?;
        Ok(id)
    }

    /// Whether this file still serves `inv` with `secrets`: same CA, same
    /// endpoints, and an admin certificate with more than 30 days left.
    pub fn is_current_for(&self, inv: &Inventory, secrets: &SecretsBundle) -> bool {
        let Ok(id) = self.identity() else {
            return false;
        };
        let Ok(ctx) = self.current() else {
            return false;
        };
        let now = time::OffsetDateTime::now_utc().unix_timestamp();
        self.context == inv.cluster.name
            && same_cert(&id.ca, &secrets.os_ca().crt)
            && ctx.endpoints == endpoints(inv)
            && pki::cert_info(&id.client.crt)
                .is_ok_and(|i| i.not_after - now > 30 * 86400 && i.organizations == ["os:admin"])
    }

    /// Refuses a talosconfig whose CA is not `secrets`' OS CA, before any node
    /// is contacted: that mismatch otherwise surfaces as "unknown authority".
    pub fn check_matches(
        &self,
        secrets: &SecretsBundle,
        path: &Path,
        secrets_path: &Path,
    ) -> Result<(), TalosconfigError> {
        let id = self
            .identity()
            .map_err(|source| TalosconfigError::Context {
                path: path.display().to_string(),
                source,
            })?;
        if same_cert(&id.ca, &secrets.os_ca().crt) {
            Ok(())
        } else {
            Err(TalosconfigError::ForeignCa {
                path: path.display().to_string(),
                secrets: secrets_path.display().to_string(),
            })
        }
    }
}

fn same_cert(a: &str, b: &str) -> bool {
    match (pki::certs_der(a), pki::certs_der(b)) {
        (Ok(a), Ok(b)) => a.first() == b.first(),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::talos::secrets::tests::bundle;

    fn atlas() -> Inventory {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/atlas/cluster.yaml");
        Inventory::load(&path).unwrap()
    }

    #[test]
    fn a_damaged_talosconfig_is_refused_without_its_values() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("talosconfig");
        let cases = [
            "context: a\ncontexts:\n  a:\n    ca: x\n    crt: y\n    key: [LS0tSECRET]\n",
            "context: a\ncontexts:\n  a:\n    ca: x\n    crt: y\n    key: \"LS0tSECRET\n",
            "context: a\ncontexts:\n  a:\n    ca: x\n    crt: y\n    key: a\n    key: LS0tSECRET\n",
            "context: a\ncontexts:\n  a: LS0tSECRET\n",
        ];
        for text in cases {
            std::fs::write(&path, text).unwrap();
            let e = Talosconfig::load(&path).unwrap_err().to_string();
            assert!(
                e.contains("not a talosconfig") && !e.contains("SECRET"),
                "{e}"
            );
        }
        // Neither a FIFO nor an endless device is read.
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
        let e = Talosconfig::load(&path).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
    }

    #[test]
    fn endpoints_are_control_plane_addresses_never_the_vip() {
        let inv = atlas();
        let cfg = Talosconfig::generate(&inv, bundle()).unwrap();
        let ctx = cfg.current().unwrap();
        let cps: Vec<String> = inv
            .control_planes()
            .map(|n| n.address.unwrap().to_string())
            .collect();
        assert_eq!(ctx.endpoints, cps);
        assert!(
            !ctx.endpoints
                .contains(&inv.cluster.vip.unwrap().to_string())
        );
        let id = cfg.identity().unwrap();
        assert!(
            id.client
                .key
                .starts_with("-----BEGIN ED25519 PRIVATE KEY-----")
        );
        assert!(cfg.is_current_for(&inv, bundle()));
    }

    #[test]
    fn a_talosconfig_from_other_secrets_is_explained() {
        let inv = atlas();
        let other = crate::talos::secrets::SecretsBundle::generate().unwrap();
        let cfg = Talosconfig::generate(&inv, &other).unwrap();
        assert!(!cfg.is_current_for(&inv, bundle()));
        let err = cfg
            .check_matches(bundle(), Path::new("tc"), Path::new("s.yaml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown authority"), "{err}");
        assert!(err.contains("other secrets"), "{err}");
        cfg.check_matches(&other, Path::new("tc"), Path::new("s.yaml"))
            .unwrap();
    }

    #[test]
    fn saved_file_is_private_and_loads_back() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("talosconfig");
        let cfg = Talosconfig::generate(&atlas(), bundle()).unwrap();
        cfg.save(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(Talosconfig::load(&path).unwrap() == cfg);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.starts_with("context: atlas"), "{text}");
    }
}
