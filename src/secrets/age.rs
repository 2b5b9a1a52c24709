//! The age file format (age-encryption.org/v1) for X25519 recipients, as
//! far as SOPS uses it: a small payload (the SOPS data key) encrypted to
//! `age1…` recipients and opened with `AGE-SECRET-KEY-1…` identities.
//! Read from FiloSottile/age `age.go`, `x25519.go`, `primitives.go`,
//! `internal/format/format.go`, `internal/stream/stream.go` and
//! `armor/armor.go`; all primitives come from aws-lc-rs.

use aws_lc_rs::aead::{Aad, CHACHA20_POLY1305, LessSafeKey, Nonce, UnboundKey};
use aws_lc_rs::agreement::{self, PrivateKey, UnparsedPublicKey, X25519};
use aws_lc_rs::{hkdf, hmac};
use base64::Engine;
use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD};

/// Why an age file could not be made or opened. Never holds key material.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AgeError {
    #[error("not an age file: {0}")]
    Malformed(String),
    #[error("no identity given opens it")]
    NoIdentityMatches,
    #[error("it was changed after it was encrypted ({0})")]
    Tampered(&'static str),
    #[error("{0}")]
    Crypto(&'static str),
}

const INTRO: &str = "age-encryption.org/v1\n";
const X25519_LABEL: &[u8] = b"age-encryption.org/v1/X25519";
const FILE_KEY_LEN: usize = 16;
const STREAM_NONCE_LEN: usize = 16;
const CHUNK: usize = 64 * 1024;
const TAG: usize = 16;
const ARMOR_BEGIN: &str = "-----BEGIN AGE ENCRYPTED FILE-----";
const ARMOR_END: &str = "-----END AGE ENCRYPTED FILE-----";
/// age's largest payload here: SOPS data keys are 32 bytes.
const MAX_FILE: usize = 1 << 20;

/// An X25519 identity (`AGE-SECRET-KEY-1…`). `Debug` shows its recipient.
#[derive(Clone)]
pub struct Identity {
    secret: [u8; 32],
    public: [u8; 32],
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Identity({})", self.recipient())
    }
}

impl Identity {
    /// Parses one `AGE-SECRET-KEY-1…` line. The message never quotes it.
    pub fn parse(text: &str) -> Result<Identity, String> {
        let (hrp, data) =
            bech32_decode(text).map_err(|e| format!("malformed age secret key: {e}"))?;
        if hrp != "age-secret-key-" {
            return Err("malformed age secret key: not AGE-SECRET-KEY-1…".into());
        }
        let secret: [u8; 32] = data
            .try_into()
            .map_err(|_| "malformed age secret key: not 32 bytes".to_owned())?;
        let key = PrivateKey::from_private_key(&X25519, &secret)
            .map_err(|_| "malformed age secret key".to_owned())?;
        let public: [u8; 32] = key
            .compute_public_key()
            .ok()
            .and_then(|p| p.as_ref().try_into().ok())
            .ok_or("malformed age secret key")?;
        Ok(Identity { secret, public })
    }

    /// A fresh identity (tests and key generation).
    pub fn generate() -> Result<Identity, AgeError> {
        let mut secret = [0u8; 32];
        random(&mut secret)?;
        let text = bech32_encode("age-secret-key-", &secret).to_uppercase();
        Identity::parse(&text).map_err(|_| AgeError::Crypto("cannot make an X25519 key"))
    }

    /// The identity as `AGE-SECRET-KEY-1…`, for a keys file.
    pub fn to_secret_string(&self) -> String {
        bech32_encode("age-secret-key-", &self.secret).to_uppercase()
    }

    /// The `age1…` recipient files for this identity are encrypted to.
    pub fn recipient(&self) -> String {
        bech32_encode("age", &self.public)
    }

    /// The file key from an X25519 stanza made for this identity.
    fn unwrap(&self, stanza: &Stanza) -> Result<Option<[u8; FILE_KEY_LEN]>, AgeError> {
        if stanza.kind != "X25519" {
            return Ok(None);
        }
        let [share] = stanza.args.as_slice() else {
            return Err(AgeError::Malformed(
                "an X25519 stanza needs one argument".into(),
            ));
        };
        let share: [u8; 32] = b64_strict(share)
            .ok()
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| AgeError::Malformed("bad X25519 share".into()))?;
        if stanza.body.len() != FILE_KEY_LEN + TAG {
            return Err(AgeError::Malformed("bad X25519 stanza body".into()));
        }
        let key = PrivateKey::from_private_key(&X25519, &self.secret)
            .map_err(|_| AgeError::Crypto("bad X25519 key"))?;
        let shared = shared_secret(&key, &share)?;
        let wrap = hkdf_32(
            &[&share[..], &self.public[..]].concat(),
            &shared,
            X25519_LABEL,
        )?;
        let mut body = stanza.body.clone();
        // A stanza for another recipient fails here: not this identity's.
        Ok(open_zero_nonce(&wrap, &mut body)
            .ok()
            .and_then(|k| k.try_into().ok()))
    }
}

/// An `age1…` X25519 recipient.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recipient {
    public: [u8; 32],
}

impl Recipient {
    pub fn parse(text: &str) -> Result<Recipient, String> {
        let bad = |why: &str| format!("{text:?} is not an age recipient (age1…): {why}");
        let (hrp, data) = bech32_decode(text).map_err(|e| bad(&e))?;
        if hrp != "age" {
            return Err(bad("it does not start with age1"));
        }
        let public = data.try_into().map_err(|_| bad("not 32 bytes"))?;
        Ok(Recipient { public })
    }
}

impl std::fmt::Display for Recipient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&bech32_encode("age", &self.public))
    }
}

/// Every identity in a keys file or `SOPS_AGE_KEY`: `#` comments and
/// blank lines skipped; `many_per_line` splits lines at whitespace (as
/// sops does for `SOPS_AGE_KEY`).
pub fn parse_identities(text: &str, many_per_line: bool) -> Result<Vec<Identity>, String> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let words: Vec<&str> = if many_per_line {
            line.split_whitespace().collect()
        } else {
            vec![line]
        };
        for word in words {
            out.push(Identity::parse(word).map_err(|e| format!("line {}: {e}", i + 1))?);
        }
    }
    Ok(out)
}

/// One recipient stanza of the header.
struct Stanza {
    kind: String,
    args: Vec<String>,
    body: Vec<u8>,
}

/// `plaintext` as a binary age file for `recipients`.
pub fn encrypt(plaintext: &[u8], recipients: &[Recipient]) -> Result<Vec<u8>, AgeError> {
    let mut file_key = [0u8; FILE_KEY_LEN];
    random(&mut file_key)?;
    let mut header = INTRO.to_owned();
    for r in recipients {
        let mut eph = [0u8; 32];
        random(&mut eph)?;
        let key = PrivateKey::from_private_key(&X25519, &eph)
            .map_err(|_| AgeError::Crypto("cannot make an X25519 key"))?;
        let share: [u8; 32] = key
            .compute_public_key()
            .ok()
            .and_then(|p| p.as_ref().try_into().ok())
            .ok_or(AgeError::Crypto("cannot make an X25519 key"))?;
        let shared = shared_secret(&key, &r.public)?;
        let wrap = hkdf_32(&[&share[..], &r.public[..]].concat(), &shared, X25519_LABEL)?;
        let body = seal(&wrap, [0; 12], &file_key)?;
        header.push_str(&format!("-> X25519 {}\n", STANDARD_NO_PAD.encode(share)));
        header.push_str(&wrapped_b64(&body));
    }
    header.push_str("---");
    let mac = header_mac(&file_key, header.as_bytes())?;
    header.push_str(&format!(" {}\n", STANDARD_NO_PAD.encode(mac)));
    let mut out = header.into_bytes();
    let mut nonce = [0u8; STREAM_NONCE_LEN];
    random(&mut nonce)?;
    out.extend_from_slice(&nonce);
    let key = hkdf_32(&nonce, &file_key, b"payload")?;
    let chunks: Vec<&[u8]> = if plaintext.is_empty() {
        vec![&[]]
    } else {
        plaintext.chunks(CHUNK).collect()
    };
    for (i, chunk) in chunks.iter().enumerate() {
        let last = i + 1 == chunks.len();
        out.extend(seal(&key, chunk_nonce(i as u64, last), chunk)?);
    }
    Ok(out)
}

/// The plaintext of a binary age file, opened by the first identity one
/// of its stanzas was made for. The header MAC and every chunk are checked.
pub fn decrypt(file: &[u8], identities: &[Identity]) -> Result<Vec<u8>, AgeError> {
    if file.len() > MAX_FILE {
        return Err(AgeError::Malformed("larger than 1 MiB".into()));
    }
    let (stanzas, header_len, mac, payload) = parse_header(file)?;
    let mut file_key = None;
    'found: for id in identities {
        for s in &stanzas {
            if let Some(k) = id.unwrap(s)? {
                file_key = Some(k);
                break 'found;
            }
        }
    }
    let file_key = file_key.ok_or(AgeError::NoIdentityMatches)?;
    let want = header_mac(&file_key, &file[..header_len])?;
    hmac_eq(&want, &mac).map_err(|()| AgeError::Tampered("header MAC"))?;
    if payload.len() < STREAM_NONCE_LEN {
        return Err(AgeError::Malformed("no payload nonce".into()));
    }
    let (nonce, body) = payload.split_at(STREAM_NONCE_LEN);
    let key = hkdf_32(nonce, &file_key, b"payload")?;
    let mut out = Vec::new();
    let chunks: Vec<&[u8]> = body.chunks(CHUNK + TAG).collect();
    if chunks.is_empty() {
        return Err(AgeError::Tampered("payload missing"));
    }
    for (i, chunk) in chunks.iter().enumerate() {
        let last = i + 1 == chunks.len();
        if chunk.len() < TAG || (last && i > 0 && chunk.len() == TAG) {
            return Err(AgeError::Tampered("payload truncated"));
        }
        let mut buf = chunk.to_vec();
        let plain = open(&key, chunk_nonce(i as u64, last), &mut buf)
            .map_err(|()| AgeError::Tampered("payload"))?;
        out.extend_from_slice(plain);
    }
    Ok(out)
}

/// `file` in age's ASCII armor (what SOPS keeps in `sops.age[].enc`).
pub fn armor(file: &[u8]) -> String {
    let b64 = STANDARD.encode(file);
    let mut out = format!("{ARMOR_BEGIN}\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(line).unwrap_or_default());
        out.push('\n');
    }
    out.push_str(ARMOR_END);
    out.push('\n');
    out
}

/// The binary file inside age's ASCII armor.
pub fn dearmor(text: &str) -> Result<Vec<u8>, AgeError> {
    let text = text.trim();
    let inner = text
        .strip_prefix(ARMOR_BEGIN)
        .and_then(|t| t.strip_suffix(ARMOR_END))
        .ok_or_else(|| AgeError::Malformed("not in age's armor".into()))?;
    let b64: String = inner.split_whitespace().collect();
    STANDARD
        .decode(b64)
        .map_err(|_| AgeError::Malformed("armor is not base64".into()))
}

/// Stanzas, header length up to and including `---`, the MAC, the payload.
type Header<'a> = (Vec<Stanza>, usize, Vec<u8>, &'a [u8]);

fn parse_header(file: &[u8]) -> Result<Header<'_>, AgeError> {
    let bad = |m: &str| AgeError::Malformed(m.to_owned());
    let mut pos = 0;
    let mut line = || -> Result<(usize, &str), AgeError> {
        let end = file[pos..]
            .iter()
            .position(|&b| b == b'\n')
            .ok_or_else(|| bad("header ends early"))?;
        let start = pos;
        pos += end + 1;
        let text =
            std::str::from_utf8(&file[start..start + end]).map_err(|_| bad("header not text"))?;
        Ok((start, text))
    };
    if line()?.1 != INTRO.trim_end() {
        return Err(bad("no age-encryption.org/v1 intro"));
    }
    let mut stanzas = Vec::new();
    let mut current: Option<Stanza> = None;
    loop {
        let (start, text) = line()?;
        if let Some(mut s) = current.take() {
            let part = b64_strict(text).map_err(|()| bad("bad stanza body"))?;
            if part.len() > 48 {
                return Err(bad("stanza body line too long"));
            }
            let short = part.len() < 48;
            s.body.extend(part);
            if short {
                stanzas.push(s);
            } else {
                current = Some(s);
            }
            continue;
        }
        if let Some(mac) = text.strip_prefix("--- ") {
            let mac = b64_strict(mac).map_err(|()| bad("bad header MAC"))?;
            if mac.len() != 32 {
                return Err(bad("bad header MAC"));
            }
            let header_len = start + 3;
            return Ok((stanzas, header_len, mac, &file[pos..]));
        }
        let Some(rest) = text.strip_prefix("-> ") else {
            return Err(bad("bad stanza line"));
        };
        let mut words = rest.split(' ');
        let kind = words
            .next()
            .filter(|k| !k.is_empty())
            .ok_or_else(|| bad("empty stanza"))?;
        current = Some(Stanza {
            kind: kind.to_owned(),
            args: words.map(str::to_owned).collect(),
            body: Vec::new(),
        });
    }
}

fn b64_strict(text: &str) -> Result<Vec<u8>, ()> {
    let out = STANDARD_NO_PAD.decode(text).map_err(|_| ())?;
    // Non-canonical trailing bits would let two texts mean one body.
    if STANDARD_NO_PAD.encode(&out) != text {
        return Err(());
    }
    Ok(out)
}

fn wrapped_b64(body: &[u8]) -> String {
    let b64 = STANDARD_NO_PAD.encode(body);
    let mut out = String::new();
    for line in b64.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(line).unwrap_or_default());
        out.push('\n');
    }
    // A body ending on a full line is closed by an empty one.
    if b64.len().is_multiple_of(64) {
        out.push('\n');
    }
    out
}

fn chunk_nonce(index: u64, last: bool) -> [u8; 12] {
    let mut n = [0u8; 12];
    n[3..11].copy_from_slice(&index.to_be_bytes());
    n[11] = u8::from(last);
    n
}

fn random(out: &mut [u8]) -> Result<(), AgeError> {
    aws_lc_rs::rand::fill(out).map_err(|_| AgeError::Crypto("no random bytes"))
}

fn shared_secret(key: &PrivateKey, peer: &[u8; 32]) -> Result<Vec<u8>, AgeError> {
    let shared = agreement::agree(
        key,
        UnparsedPublicKey::new(&X25519, peer),
        AgeError::Crypto("X25519 failed"),
        |s| Ok(s.to_vec()),
    )?;
    if shared.iter().all(|&b| b == 0) {
        return Err(AgeError::Malformed("X25519 share of low order".into()));
    }
    Ok(shared)
}

struct Len32;

impl hkdf::KeyType for Len32 {
    fn len(&self) -> usize {
        32
    }
}

fn hkdf_32(salt: &[u8], secret: &[u8], info: &[u8]) -> Result<[u8; 32], AgeError> {
    let mut out = [0u8; 32];
    hkdf::Salt::new(hkdf::HKDF_SHA256, salt)
        .extract(secret)
        .expand(&[info], Len32)
        .and_then(|okm| okm.fill(&mut out))
        .map_err(|_| AgeError::Crypto("HKDF failed"))?;
    Ok(out)
}

fn header_mac(file_key: &[u8], header: &[u8]) -> Result<Vec<u8>, AgeError> {
    let key = hkdf_32(&[], file_key, b"header")?;
    let key = hmac::Key::new(hmac::HMAC_SHA256, &key);
    Ok(hmac::sign(&key, header).as_ref().to_vec())
}

fn hmac_eq(a: &[u8], b: &[u8]) -> Result<(), ()> {
    aws_lc_rs::constant_time::verify_slices_are_equal(a, b).map_err(|_| ())
}

fn aead_key(key: &[u8; 32]) -> Result<LessSafeKey, AgeError> {
    UnboundKey::new(&CHACHA20_POLY1305, key)
        .map(LessSafeKey::new)
        .map_err(|_| AgeError::Crypto("ChaCha20-Poly1305 key"))
}

fn seal(key: &[u8; 32], nonce: [u8; 12], plain: &[u8]) -> Result<Vec<u8>, AgeError> {
    let mut buf = plain.to_vec();
    aead_key(key)?
        .seal_in_place_append_tag(Nonce::assume_unique_for_key(nonce), Aad::empty(), &mut buf)
        .map_err(|_| AgeError::Crypto("ChaCha20-Poly1305 failed"))?;
    Ok(buf)
}

fn open<'a>(key: &[u8; 32], nonce: [u8; 12], buf: &'a mut [u8]) -> Result<&'a [u8], ()> {
    let key = aead_key(key).map_err(|_| ())?;
    key.open_in_place(Nonce::assume_unique_for_key(nonce), Aad::empty(), buf)
        .map(|p| &*p)
        .map_err(|_| ())
}

fn open_zero_nonce(key: &[u8; 32], buf: &mut [u8]) -> Result<Vec<u8>, ()> {
    open(key, [0; 12], buf).map(<[u8]>::to_vec)
}

const CHARSET: &[u8; 32] = b"qpzry9x8gf2tvdw0s3jn54khce6mua7l";

fn polymod(values: &[u8]) -> u32 {
    const GEN: [u32; 5] = [0x3b6a57b2, 0x26508e6d, 0x1ea119fa, 0x3d4233dd, 0x2a1462b3];
    let mut chk: u32 = 1;
    for &v in values {
        let top = chk >> 25;
        chk = ((chk & 0x1ffffff) << 5) ^ u32::from(v);
        for (i, g) in GEN.iter().enumerate() {
            if (top >> i) & 1 == 1 {
                chk ^= g;
            }
        }
    }
    chk
}

fn hrp_expand(hrp: &str) -> Vec<u8> {
    let b = hrp.as_bytes();
    let mut out: Vec<u8> = b.iter().map(|c| c >> 5).collect();
    out.push(0);
    out.extend(b.iter().map(|c| c & 31));
    out
}

/// Regroups bits; `pad` adds zero bits to the last group (encoding), else
/// leftover bits must be zero padding (decoding).
fn regroup(data: &[u8], from: u32, to: u32, pad: bool) -> Result<Vec<u8>, String> {
    let (mut acc, mut bits, mut out) = (0u32, 0u32, Vec::new());
    let max = (1u32 << to) - 1;
    for &v in data {
        acc = (acc << from) | u32::from(v);
        bits += from;
        while bits >= to {
            bits -= to;
            out.push(((acc >> bits) & max) as u8);
        }
    }
    if pad {
        if bits > 0 {
            out.push(((acc << (to - bits)) & max) as u8);
        }
    } else if bits >= from || (acc << (to - bits)) & max != 0 {
        return Err("bad padding".into());
    }
    Ok(out)
}

/// Bech32 (BIP 173, without its length limit, as age uses it): the
/// lower-cased human-readable part and the data.
fn bech32_decode(text: &str) -> Result<(String, Vec<u8>), String> {
    if text.chars().any(|c| c.is_ascii_lowercase()) && text.chars().any(|c| c.is_ascii_uppercase())
    {
        return Err("mixed case".into());
    }
    let lower = text.to_ascii_lowercase();
    let at = lower.rfind('1').ok_or("no separator")?;
    let (hrp, rest) = (&lower[..at], &lower[at + 1..]);
    if hrp.is_empty() || rest.len() < 6 || !hrp.bytes().all(|b| (33..=126).contains(&b)) {
        return Err("malformed".into());
    }
    let values: Vec<u8> = rest
        .bytes()
        .map(|c| CHARSET.iter().position(|&x| x == c).map(|p| p as u8))
        .collect::<Option<_>>()
        .ok_or("invalid character")?;
    let mut all = hrp_expand(hrp);
    all.extend(&values);
    if polymod(&all) != 1 {
        return Err("bad checksum".into());
    }
    let data = regroup(&values[..values.len() - 6], 5, 8, false)?;
    Ok((hrp.to_owned(), data))
}

fn bech32_encode(hrp: &str, data: &[u8]) -> String {
    let values = regroup(data, 8, 5, true).unwrap_or_default();
    let mut all = hrp_expand(hrp);
    all.extend(&values);
    all.extend([0u8; 6]);
    let m = polymod(&all) ^ 1;
    let mut out = format!("{hrp}1");
    for v in values
        .iter()
        .copied()
        .chain((0..6).map(|i| ((m >> (5 * (5 - i))) & 31) as u8))
    {
        out.push(char::from(CHARSET[usize::from(v)]));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The key pair in age's own README (FiloSottile/age `README.md`).
    const SECRET: &str =
        "AGE-SECRET-KEY-1GFPYYSJZGFPYYSJZGFPYYSJZGFPYYSJZGFPYYSJZGFPYYSJZGFPQ4EGAEX";
    const PUBLIC: &str = "age1zvkyg2lqzraa2lnjvqej32nkuu0ues2s82hzrye869xeexvn73equnujwj";

    #[test]
    fn an_identity_gives_its_recipient_as_age_does() {
        let id = Identity::parse(SECRET).unwrap();
        assert_eq!(id.recipient(), PUBLIC);
        assert_eq!(id.to_secret_string(), SECRET);
        let mut bad = SECRET.to_owned();
        bad.replace_range(20..21, "Q");
        let err = Identity::parse(&bad).unwrap_err();
        assert!(err.contains("checksum"), "{err}");
        assert!(!err.contains("GFPYY"), "{err}");
    }

    #[test]
    fn a_file_opens_with_the_right_identity_only() {
        let id = Identity::generate().unwrap();
        let other = Identity::generate().unwrap();
        let to = [Recipient::parse(&id.recipient()).unwrap()];
        for len in [0, 32, CHUNK, CHUNK + 1] {
            let plain: Vec<u8> = (0..len).map(|i| i as u8).collect();
            let file = encrypt(&plain, &to).unwrap();
            assert_eq!(decrypt(&file, &[other.clone(), id.clone()]).unwrap(), plain);
            assert_eq!(
                decrypt(&file, std::slice::from_ref(&other)),
                Err(AgeError::NoIdentityMatches)
            );
            let armored = armor(&file);
            assert_eq!(dearmor(&armored).unwrap(), file);
        }
        let file = encrypt(b"data key", &to).unwrap();
        let mut bad = file.clone();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        assert_eq!(
            decrypt(&bad, std::slice::from_ref(&id)),
            Err(AgeError::Tampered("payload"))
        );
    }
}
