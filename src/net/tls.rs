//! The one place TLS client settings are made: which server certificates
//! are trusted (system roots, a pinned fingerprint, any, or a private CA)
//! and which identity is shown. HTTP clients and the Talos gRPC client both
//! take their `rustls::ClientConfig` from here, always on aws-lc-rs.

use crate::digest::Sha256;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use std::fmt;
use std::sync::{Arc, Mutex};

/// The crypto provider every TLS connection uses (one in the tree).
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// Why TLS settings could not be made.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{what}: {message}")]
    Invalid { what: &'static str, message: String },
}

fn invalid(what: &'static str) -> impl Fn(String) -> TlsError {
    move |message| TlsError::Invalid { what, message }
}

/// Which server certificates a client accepts.
#[derive(Clone, Debug)]
pub enum Trust {
    /// The system's roots and the server name: public services.
    System,
    /// Exactly the certificate with this fingerprint, whoever signed it and
    /// whatever name it carries: self-signed servers such as Proxmox VE.
    Pinned(Sha256),
    /// Any certificate (handshake signatures are still checked): Talos
    /// maintenance mode, or an explicit insecure switch.
    Any,
    /// Certificates that chain to these PEM CA certificates: Kubernetes and
    /// the Talos API in mTLS mode.
    Ca(String),
    /// Certificates that chain to these PEM CA certificates and name
    /// `name`, whatever address was dialled: kubectl's `tls-server-name`,
    /// for an API server reached through a port forward or NAT.
    CaNamed { ca: String, name: String },
}

/// A client certificate chain and its key, both PEM (Talos' Ed25519 key
/// label is accepted).
#[derive(Clone)]
pub struct ClientIdentity {
    pub crt: String,
    pub key: String,
}

impl fmt::Debug for ClientIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClientIdentity { .. }")
    }
}

/// The certificate a server showed, kept for error messages and probes.
#[derive(Clone, Default, Debug)]
pub struct SeenCertificate(Arc<Mutex<Option<Sha256>>>);

impl SeenCertificate {
    pub fn get(&self) -> Option<Sha256> {
        *self.0.lock().expect("not poisoned")
    }
}

/// A pin that did not match, carried inside the rustls error so that every
/// client (reqwest, tonic) reports both fingerprints.
#[derive(Debug, thiserror::Error)]
#[error("the server's certificate has fingerprint {}, not the pinned {}", found.colons(), expected.colons())]
pub struct PinMismatch {
    pub expected: Sha256,
    pub found: Sha256,
}

/// Checks the leaf against a pin (or nothing, for [`Trust::Any`]) and
/// records it; handshake signatures are verified as usual.
#[derive(Debug)]
struct LeafVerifier {
    pin: Option<Sha256>,
    seen: SeenCertificate,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl ServerCertVerifier for LeafVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let found = Sha256::of(end_entity);
        *self.seen.0.lock().expect("not poisoned") = Some(found);
        match self.pin {
            Some(expected) if expected != found => Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::Other(rustls::OtherError(Arc::new(PinMismatch {
                    expected,
                    found,
                }))),
            )),
            _ => Ok(ServerCertVerified::assertion()),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// The rustls error inside a transport error, however deep: HTTP and gRPC
/// stacks wrap it in I/O errors within I/O errors, whose `source()` skips
/// the wrapped error itself.
pub fn rustls_error<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(r) = err.downcast_ref::<rustls::Error>() {
            return Some(r);
        }
        if let Some(inner) = err
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            return rustls_error(inner);
        }
        cur = err.source();
    }
    None
}

/// A refused certificate in words: the pin mismatch itself, or rustls'
/// own description.
pub fn describe_refusal(e: &rustls::Error) -> String {
    match e {
        rustls::Error::InvalidCertificate(rustls::CertificateError::Other(o)) => {
            o.0.downcast_ref::<PinMismatch>()
                .map_or_else(|| e.to_string(), ToString::to_string)
        }
        other => other.to_string(),
    }
}

/// The CA's usual checks against a fixed name instead of the dialled one.
#[derive(Debug)]
struct NamedVerifier {
    inner: Arc<rustls::client::WebPkiServerVerifier>,
    name: ServerName<'static>,
}

impl ServerCertVerifier for NamedVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _dialled: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.inner
            .verify_server_cert(end_entity, intermediates, &self.name, ocsp, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// The roots of a PEM CA text.
fn ca_roots(pem_text: &str) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for der in certs_der(pem_text).map_err(invalid("CA"))? {
        roots.add(der).map_err(|e| invalid("CA")(e.to_string()))?;
    }
    Ok(roots)
}

/// Every certificate in a PEM text, as DER.
pub fn certs_der(pem_text: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let blocks = pem::parse_many(pem_text).map_err(|e| e.to_string())?;
    let certs: Vec<_> = blocks
        .into_iter()
        .filter(|b| b.tag() == "CERTIFICATE")
        .map(|b| CertificateDer::from(b.into_contents()))
        .collect();
    if certs.is_empty() {
        return Err("no CERTIFICATE block".into());
    }
    Ok(certs)
}

/// The private key in a PEM text. Talos labels PKCS#8 Ed25519 keys
/// `ED25519 PRIVATE KEY`, which rustls does not know: read it as PKCS#8.
pub fn private_key_der(pem_text: &str) -> Result<PrivateKeyDer<'static>, String> {
    let block = pem::parse(pem_text).map_err(|e| e.to_string())?;
    let der = block.contents().to_vec();
    match block.tag() {
        "PRIVATE KEY" | "ED25519 PRIVATE KEY" => Ok(PrivateKeyDer::Pkcs8(der.into())),
        "EC PRIVATE KEY" => Ok(PrivateKeyDer::Sec1(der.into())),
        "RSA PRIVATE KEY" => Ok(PrivateKeyDer::Pkcs1(der.into())),
        other => Err(format!("unsupported key label {other:?}")),
    }
}

/// The rustls settings for `trust` and an optional client identity, plus
/// the recorder of the certificate the server shows (filled for
/// [`Trust::Pinned`] and [`Trust::Any`]). `None` for [`Trust::System`]:
/// the HTTP stack's own platform verifier handles that case.
pub fn client_config(
    trust: &Trust,
    identity: Option<&ClientIdentity>,
) -> Result<Option<(ClientConfig, SeenCertificate)>, TlsError> {
    let provider = provider();
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid("TLS")(e.to_string()))?;
    let seen = SeenCertificate::default();
    let with_roots = match trust {
        Trust::System => return Ok(None),
        Trust::Pinned(_) | Trust::Any => {
            let pin = match trust {
                Trust::Pinned(p) => Some(*p),
                _ => None,
            };
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(LeafVerifier {
                    pin,
                    seen: seen.clone(),
                    provider,
                }))
        }
        Trust::Ca(pem_text) => builder.with_root_certificates(ca_roots(pem_text)?),
        Trust::CaNamed { ca, name } => {
            let name = ServerName::try_from(name.clone())
                .map_err(|e| invalid("TLS server name")(e.to_string()))?;
            let inner = rustls::client::WebPkiServerVerifier::builder_with_provider(
                Arc::new(ca_roots(ca)?),
                provider,
            )
            .build()
            .map_err(|e| invalid("CA")(e.to_string()))?;
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(NamedVerifier { inner, name }))
        }
    };
    let config = match identity {
        None => with_roots.with_no_client_auth(),
        Some(id) => {
            let chain = certs_der(&id.crt).map_err(invalid("client certificate"))?;
            let key = private_key_der(&id.key).map_err(invalid("client key"))?;
            with_roots
                .with_client_auth_cert(chain, key)
                .map_err(|e| invalid("client identity")(e.to_string()))?
        }
    };
    Ok(Some((config, seen)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ed25519_labelled_keys_read_as_pkcs8() {
        let key = "-----BEGIN ED25519 PRIVATE KEY-----\nAAAA\n-----END ED25519 PRIVATE KEY-----\n";
        assert!(matches!(
            private_key_der(key).unwrap(),
            PrivateKeyDer::Pkcs8(_)
        ));
        let other =
            "-----BEGIN OPENSSH PRIVATE KEY-----\nAAAA\n-----END OPENSSH PRIVATE KEY-----\n";
        assert!(private_key_der(other).unwrap_err().contains("OPENSSH"));
    }

    #[test]
    fn system_trust_is_left_to_the_http_stack() {
        assert!(client_config(&Trust::System, None).unwrap().is_none());
        assert!(client_config(&Trust::Any, None).unwrap().is_some());
        let err = client_config(&Trust::Ca("not pem".into()), None).unwrap_err();
        assert!(err.to_string().starts_with("CA:"), "{err}");
    }
}
