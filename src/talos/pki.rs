//! Keys and certificates the way Talos writes them: Ed25519 for the OS CA and
//! admin identity (PEM label `ED25519 PRIVATE KEY` around PKCS#8), ECDSA P-256
//! CAs for etcd and Kubernetes (`EC PRIVATE KEY`, SEC1), RSA-4096 for the
//! service-account key (`RSA PRIVATE KEY`, PKCS#1). Imported bundles may
//! hold other CAs (an ECDSA OS CA, kubeadm's RSA CAs); a leaf takes its CA's
//! algorithm, as siderolabs/crypto `x509/keypair.go` `NewKeyPair` does.
//! Pure functions over PEM text.

use std::fmt;
use std::net::IpAddr;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use time::{Duration, OffsetDateTime};

/// Why key material could not be made or read. Never carries key bytes.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("{0}")]
    Invalid(String),
    #[error("could not create a certificate: {0}")]
    Generate(#[from] rcgen::Error),
}

/// The key algorithms of Talos and kubeadm CAs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyKind {
    Ed25519,
    EcdsaP256,
    /// kubeadm's `ECDSA-P384` CAs.
    EcdsaP384,
    /// Generated with 4096 bits, as Talos does; read at any size.
    Rsa,
}

impl KeyKind {
    /// The key a certificate issued by a CA of this kind gets: the CA's own
    /// algorithm, ECDSA always on P-256 (siderolabs/crypto
    /// `x509/keypair.go` `NewKeyPair`).
    fn leaf(self) -> KeyKind {
        match self {
            KeyKind::EcdsaP384 => KeyKind::EcdsaP256,
            kind => kind,
        }
    }
}

impl fmt::Display for KeyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KeyKind::Ed25519 => "Ed25519",
            KeyKind::EcdsaP256 => "ECDSA P-256",
            KeyKind::EcdsaP384 => "ECDSA P-384",
            KeyKind::Rsa => "RSA",
        })
    }
}

/// A PEM certificate and its PEM key, as Talos pairs them (`crt`/`key`).
/// `Debug` shows the certificate's subject only: keys never reach a log.
#[derive(Clone, PartialEq, Eq)]
pub struct CertAndKey {
    pub crt: String,
    pub key: String,
}

impl fmt::Debug for CertAndKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CertAndKey")
            .field("crt", &subject_of(&self.crt).unwrap_or_default())
            .field("key", &"<redacted>")
            .finish()
    }
}

/// What a leaf certificate is for.
#[derive(Debug, Clone, Default)]
pub struct LeafSpec {
    pub organization: Option<String>,
    pub common_name: String,
    pub ips: Vec<IpAddr>,
    pub dns_names: Vec<String>,
    pub client: bool,
    pub server: bool,
    pub days: i64,
}

/// `n` bytes from the system CSPRNG.
pub fn random_bytes(n: usize) -> Vec<u8> {
    let mut buf = vec![0u8; n];
    aws_lc_rs::rand::fill(&mut buf).expect("the system random source works");
    buf
}

/// A kubeadm-style token, `[a-z0-9]{6}.[a-z0-9]{16}`, as Talos generates them.
pub fn token() -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut out = String::with_capacity(23);
    while out.len() < 23 {
        for b in random_bytes(32) {
            // Rejection sampling keeps every character equally likely.
            if usize::from(b) >= 252 || out.len() == 23 {
                continue;
            }
            if out.len() == 6 {
                out.push('.');
            }
            out.push(char::from(ALPHABET[usize::from(b) % ALPHABET.len()]));
        }
    }
    out
}

/// Whether `t` has the shape of [`token`]: a secret however short it is.
pub fn is_token(t: &str) -> bool {
    t.split_once('.').is_some_and(|(a, b)| {
        a.len() == 6
            && b.len() == 16
            && (a.chars().chain(b.chars())).all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
    })
}

fn new_key(kind: KeyKind) -> Result<KeyPair, PkiError> {
    Ok(match kind {
        KeyKind::Ed25519 => KeyPair::generate_for(&rcgen::PKCS_ED25519)?,
        KeyKind::EcdsaP256 => KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?,
        KeyKind::EcdsaP384 => KeyPair::generate_for(&rcgen::PKCS_ECDSA_P384_SHA384)?,
        KeyKind::Rsa => {
            KeyPair::generate_rsa_for(&rcgen::PKCS_RSA_SHA256, rcgen::RsaKeySize::_4096)?
        }
    })
}

/// The PEM text Talos stores for `key`.
fn key_pem(kind: KeyKind, key: &KeyPair) -> Result<String, PkiError> {
    let pkcs8 = key.serialize_der();
    let (label, der) = match kind {
        KeyKind::Ed25519 => ("ED25519 PRIVATE KEY", pkcs8),
        KeyKind::EcdsaP256 | KeyKind::EcdsaP384 => {
            use aws_lc_rs::encoding::AsDer;
            use aws_lc_rs::signature::{
                ECDSA_P256_SHA256_ASN1_SIGNING, ECDSA_P384_SHA384_ASN1_SIGNING,
            };
            let alg = if kind == KeyKind::EcdsaP256 {
                &ECDSA_P256_SHA256_ASN1_SIGNING
            } else {
                &ECDSA_P384_SHA384_ASN1_SIGNING
            };
            let pair = aws_lc_rs::signature::EcdsaKeyPair::from_pkcs8(alg, &pkcs8)
                .map_err(|e| PkiError::Invalid(format!("ECDSA key: {e}")))?;
            let sec1 = pair
                .private_key()
                .as_der()
                .map_err(|_| PkiError::Invalid("ECDSA key: cannot encode as SEC1".into()))?;
            ("EC PRIVATE KEY", sec1.as_ref().to_vec())
        }
        KeyKind::Rsa => ("RSA PRIVATE KEY", pkcs8_private_key(&pkcs8)?.to_vec()),
    };
    Ok(pem::encode(&pem::Pem::new(label, der)))
}

/// A new key of `kind` (the Kubernetes service-account key) as PEM.
pub fn new_key_pem(kind: KeyKind) -> Result<String, PkiError> {
    key_pem(kind, &new_key(kind)?)
}

fn serial() -> SerialNumber {
    let mut bytes = random_bytes(16);
    bytes[0] &= 0x7f;
    SerialNumber::from_slice(&bytes)
}

fn name(organization: Option<&str>, common_name: Option<&str>) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    if let Some(o) = organization {
        dn.push(DnType::OrganizationName, o);
    }
    if let Some(cn) = common_name {
        dn.push(DnType::CommonName, cn);
    }
    dn
}

/// A self-signed CA valid for `years`.
pub fn new_ca(
    kind: KeyKind,
    organization: &str,
    common_name: Option<&str>,
    years: i64,
) -> Result<CertAndKey, PkiError> {
    let key = new_key(kind)?;
    let mut params = CertificateParams::default();
    params.distinguished_name = name(Some(organization), common_name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.serial_number = Some(serial());
    let now = OffsetDateTime::now_utc();
    params.not_before = now - Duration::minutes(5);
    params.not_after = now + Duration::days(365 * years);
    let cert = params.self_signed(&key)?;
    Ok(CertAndKey {
        crt: cert.pem(),
        key: key_pem(kind, &key)?,
    })
}

/// A certificate signed by `ca`, with a fresh key of the CA's algorithm
/// ([`KeyKind::leaf`]).
pub fn issue(ca: &CertAndKey, spec: &LeafSpec) -> Result<CertAndKey, PkiError> {
    let ca_key = KeyPair::from_pem(&ca.key)
        .map_err(|e| PkiError::Invalid(format!("CA key cannot be read: {e}")))?;
    let kind = kind_of(&ca_key)?.leaf();
    let issuer = Issuer::from_ca_cert_pem(&ca.crt, &ca_key)
        .map_err(|e| PkiError::Invalid(format!("CA certificate cannot be read: {e}")))?;
    let key = new_key(kind)?;
    let mut params = CertificateParams::default();
    params.distinguished_name = name(spec.organization.as_deref(), Some(&spec.common_name));
    params.subject_alt_names = spec
        .ips
        .iter()
        .map(|ip| SanType::IpAddress(*ip))
        .chain(
            spec.dns_names
                .iter()
                .filter_map(|d| d.clone().try_into().ok().map(SanType::DnsName)),
        )
        .collect();
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    if spec.client {
        params
            .extended_key_usages
            .push(ExtendedKeyUsagePurpose::ClientAuth);
    }
    if spec.server {
        params
            .extended_key_usages
            .push(ExtendedKeyUsagePurpose::ServerAuth);
    }
    params.serial_number = Some(serial());
    let now = OffsetDateTime::now_utc();
    params.not_before = now - Duration::minutes(5);
    params.not_after = now + Duration::days(spec.days);
    let cert = params.signed_by(&key, &issuer)?;
    Ok(CertAndKey {
        crt: cert.pem(),
        key: key_pem(kind, &key)?,
    })
}

/// A self-signed server certificate (what a node in maintenance mode shows).
pub fn self_signed_server(ips: &[IpAddr]) -> Result<CertAndKey, PkiError> {
    let key = new_key(KeyKind::Ed25519)?;
    let mut params = CertificateParams::default();
    params.distinguished_name = name(None, Some("maintenance"));
    params.subject_alt_names = ips.iter().map(|ip| SanType::IpAddress(*ip)).collect();
    params.serial_number = Some(serial());
    let cert = params.self_signed(&key)?;
    Ok(CertAndKey {
        crt: cert.pem(),
        key: key_pem(KeyKind::Ed25519, &key)?,
    })
}

/// The `privateKey` OCTET STRING of a PKCS#8 `PrivateKeyInfo`: for RSA that
/// is the PKCS#1 key. A minimal DER walk; anything unexpected is an error.
fn pkcs8_private_key(der: &[u8]) -> Result<&[u8], PkiError> {
    let bad = || PkiError::Invalid("malformed PKCS#8 key".into());
    let (tag, body, _) = der_item(der).ok_or_else(bad)?;
    if tag != 0x30 {
        return Err(bad());
    }
    let (version_tag, _, rest) = der_item(body).ok_or_else(bad)?;
    let (alg_tag, _, rest) = der_item(rest).ok_or_else(bad)?;
    let (key_tag, key, _) = der_item(rest).ok_or_else(bad)?;
    if version_tag != 0x02 || alg_tag != 0x30 || key_tag != 0x04 {
        return Err(bad());
    }
    Ok(key)
}

/// One DER TLV: (tag, contents, rest).
fn der_item(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, mut rest) = rest.split_first()?;
    let len = if first < 0x80 {
        usize::from(first)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |acc, &b| (acc << 8) | usize::from(b));
        rest = &rest[n..];
        len
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
}

/// The certificates in PEM `text`, DER-encoded.
pub fn certs_der(text: &str) -> Result<Vec<CertificateDer<'static>>, PkiError> {
    crate::net::tls::certs_der(text).map_err(|e| PkiError::Invalid(format!("not PEM text: {e}")))
}

/// The private key in PEM `text` for rustls, whatever label Talos or
/// Kubernetes gave it (`ED25519 PRIVATE KEY` is PKCS#8 under another name).
pub fn private_key_der(text: &str) -> Result<PrivateKeyDer<'static>, PkiError> {
    crate::net::tls::private_key_der(text).map_err(|e| PkiError::Invalid(format!("key: {e}")))
}

/// The kind of the key in PEM `text`.
pub fn key_kind(text: &str) -> Result<KeyKind, PkiError> {
    let pair = KeyPair::from_pem(text)
        .map_err(|e| PkiError::Invalid(format!("key cannot be read: {e}")))?;
    kind_of(&pair)
}

fn kind_of(pair: &KeyPair) -> Result<KeyKind, PkiError> {
    let alg = pair.algorithm();
    if alg == &rcgen::PKCS_ED25519 {
        Ok(KeyKind::Ed25519)
    } else if alg == &rcgen::PKCS_ECDSA_P256_SHA256 {
        Ok(KeyKind::EcdsaP256)
    } else if alg == &rcgen::PKCS_ECDSA_P384_SHA384 {
        Ok(KeyKind::EcdsaP384)
    } else if alg == &rcgen::PKCS_RSA_SHA256 {
        Ok(KeyKind::Rsa)
    } else {
        Err(PkiError::Invalid("unsupported key algorithm".into()))
    }
}

/// Whether `key` is the private half of the certificate `crt`.
pub fn key_matches(crt: &str, key: &str) -> Result<bool, PkiError> {
    let der = certs_der(crt)?.remove(0);
    let (_, cert) = x509_parser::parse_x509_certificate(&der)
        .map_err(|e| PkiError::Invalid(format!("certificate cannot be parsed: {e}")))?;
    let pair = KeyPair::from_pem(key)
        .map_err(|e| PkiError::Invalid(format!("key cannot be read: {e}")))?;
    let spki = cert.public_key().subject_public_key.data.as_ref();
    Ok(rcgen::PublicKeyData::der_bytes(&pair) == spki)
}

/// Facts about a certificate that the checks and messages need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertInfo {
    pub subject: String,
    pub organizations: Vec<String>,
    pub is_ca: bool,
    pub not_after: i64,
    pub not_before: i64,
}

/// Reads the first certificate in PEM `crt`.
pub fn cert_info(crt: &str) -> Result<CertInfo, PkiError> {
    let der = certs_der(crt)?.remove(0);
    let (_, cert) = x509_parser::parse_x509_certificate(&der)
        .map_err(|e| PkiError::Invalid(format!("certificate cannot be parsed: {e}")))?;
    Ok(CertInfo {
        subject: cert.subject().to_string(),
        organizations: cert
            .subject()
            .iter_organization()
            .filter_map(|o| o.as_str().ok().map(str::to_owned))
            .collect(),
        is_ca: cert.is_ca(),
        not_after: cert.validity().not_after.timestamp(),
        not_before: cert.validity().not_before.timestamp(),
    })
}

fn subject_of(crt: &str) -> Option<String> {
    cert_info(crt).ok().map(|i| i.subject)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_have_the_kubeadm_shape() {
        for _ in 0..200 {
            let t = token();
            let (a, b) = t.split_once('.').unwrap();
            assert_eq!((a.len(), b.len()), (6, 16), "{t}");
            assert!(
                t.chars()
                    .all(|c| c == '.' || c.is_ascii_lowercase() || c.is_ascii_digit())
            );
        }
        assert_ne!(token(), token());
    }

    #[test]
    fn keys_carry_the_labels_talos_writes() {
        let os = new_ca(KeyKind::Ed25519, "talos", None, 10).unwrap();
        assert!(os.key.starts_with("-----BEGIN ED25519 PRIVATE KEY-----"));
        let etcd = new_ca(KeyKind::EcdsaP256, "etcd", None, 10).unwrap();
        assert!(etcd.key.starts_with("-----BEGIN EC PRIVATE KEY-----"));
        assert_eq!(key_kind(&os.key).unwrap(), KeyKind::Ed25519);
        assert_eq!(key_kind(&etcd.key).unwrap(), KeyKind::EcdsaP256);
        assert!(key_matches(&os.crt, &os.key).unwrap());
        assert!(!key_matches(&os.crt, &etcd.key).unwrap());
        let info = cert_info(&os.crt).unwrap();
        assert!(info.is_ca);
        assert_eq!(info.organizations, ["talos"]);
        let years = (info.not_after - info.not_before) as f64 / (365.0 * 86400.0);
        assert!((9.9..10.1).contains(&years), "{years}");
        // rustls reads both after the relabel.
        assert!(matches!(
            private_key_der(&os.key).unwrap(),
            PrivateKeyDer::Pkcs8(_)
        ));
        assert!(matches!(
            private_key_der(&etcd.key).unwrap(),
            PrivateKeyDer::Sec1(_)
        ));
    }

    #[test]
    fn rsa_keys_are_pkcs1() {
        let key = new_key_pem(KeyKind::Rsa).unwrap();
        assert!(key.starts_with("-----BEGIN RSA PRIVATE KEY-----"));
        let der = pem::parse(&key).unwrap().into_contents();
        // PKCS#1 RSAPrivateKey: SEQUENCE { INTEGER 0, INTEGER n (4096 bits) ... }
        let (_, body, _) = der_item(&der).unwrap();
        let (_, _, rest) = der_item(body).unwrap();
        let (tag, n, _) = der_item(rest).unwrap();
        assert_eq!(tag, 0x02);
        assert_eq!(n.len(), 513, "4096-bit modulus with its sign byte");
        assert_eq!(key_kind(&key).unwrap(), KeyKind::Rsa);
    }

    #[test]
    fn issued_certs_chain_to_their_ca_and_carry_the_org() {
        let ca = new_ca(KeyKind::Ed25519, "talos", None, 10).unwrap();
        let leaf = issue(
            &ca,
            &LeafSpec {
                organization: Some("os:admin".into()),
                common_name: "admin".into(),
                client: true,
                days: 365,
                ..LeafSpec::default()
            },
        )
        .unwrap();
        let info = cert_info(&leaf.crt).unwrap();
        assert_eq!(info.organizations, ["os:admin"]);
        assert!(!info.is_ca);
        let ca_der = certs_der(&ca.crt).unwrap().remove(0);
        let leaf_der = certs_der(&leaf.crt).unwrap().remove(0);
        let (_, ca_cert) = x509_parser::parse_x509_certificate(&ca_der).unwrap();
        let (_, leaf_cert) = x509_parser::parse_x509_certificate(&leaf_der).unwrap();
        assert!(
            leaf_cert
                .verify_signature(Some(ca_cert.public_key()))
                .is_ok()
        );
        let other = new_ca(KeyKind::Ed25519, "talos", None, 10).unwrap();
        let other_der = certs_der(&other.crt).unwrap().remove(0);
        let (_, other_cert) = x509_parser::parse_x509_certificate(&other_der).unwrap();
        assert!(
            leaf_cert
                .verify_signature(Some(other_cert.public_key()))
                .is_err()
        );
    }

    #[test]
    fn a_leaf_takes_its_cas_algorithm() {
        for (ca_kind, leaf_kind, label) in [
            (KeyKind::EcdsaP256, KeyKind::EcdsaP256, "EC PRIVATE KEY"),
            // siderolabs/crypto issues P-256 under any ECDSA CA.
            (KeyKind::EcdsaP384, KeyKind::EcdsaP256, "EC PRIVATE KEY"),
            (KeyKind::Rsa, KeyKind::Rsa, "RSA PRIVATE KEY"),
            (KeyKind::Ed25519, KeyKind::Ed25519, "ED25519 PRIVATE KEY"),
        ] {
            let ca = new_ca(ca_kind, "kubernetes", None, 1).unwrap();
            assert_eq!(key_kind(&ca.key).unwrap(), ca_kind);
            let leaf = issue(
                &ca,
                &LeafSpec {
                    common_name: "admin".into(),
                    client: true,
                    days: 1,
                    ..LeafSpec::default()
                },
            )
            .unwrap();
            assert_eq!(key_kind(&leaf.key).unwrap(), leaf_kind, "{ca_kind}");
            assert!(leaf.key.starts_with(&format!("-----BEGIN {label}-----")));
            assert!(key_matches(&leaf.crt, &leaf.key).unwrap());
            let ca_der = certs_der(&ca.crt).unwrap().remove(0);
            let leaf_der = certs_der(&leaf.crt).unwrap().remove(0);
            let (_, ca_cert) = x509_parser::parse_x509_certificate(&ca_der).unwrap();
            let (_, leaf_cert) = x509_parser::parse_x509_certificate(&leaf_der).unwrap();
            assert!(
                leaf_cert
                    .verify_signature(Some(ca_cert.public_key()))
                    .is_ok(),
                "{ca_kind}"
            );
        }
    }

    #[test]
    fn debug_never_shows_the_key() {
        let ca = new_ca(KeyKind::Ed25519, "talos", None, 10).unwrap();
        let shown = format!("{ca:?}");
        assert!(!shown.contains("PRIVATE"), "{shown}");
        assert!(shown.contains("O=talos"), "{shown}");
    }

    #[test]
    fn der_walk_refuses_truncation() {
        assert!(der_item(&[0x30, 0x05, 1, 2]).is_none());
        assert!(der_item(&[0x30, 0x85, 0, 0, 0, 0, 1]).is_none());
        assert!(pkcs8_private_key(&[0x04, 0x00]).is_err());
        assert_eq!(
            der_item(&[0x04, 0x81, 0x01, 9]),
            Some((0x04, &[9u8][..], &[][..]))
        );
    }
}
