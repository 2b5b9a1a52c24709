//! The one digest type: a SHA-256 value, whether it names an image in a
//! manifest, a file the factory served, or a pinned certificate. Parsed
//! here once, so a field or flag that holds a digest holds this type and a
//! bad one is refused before any work starts (a manifest adds its own
//! stricter spelling rule: only what imgbuild writes).

use sha2::Digest;
use std::fmt;

/// A SHA-256 digest. Shown and serialized as lowercase hex (manifests,
/// JSON output); [`Sha256::colons`] gives the `AB:CD:…` spelling Proxmox
/// prints for certificates. Both spellings parse.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Sha256([u8; 32]);

impl Sha256 {
    /// The digest of `bytes` (a DER certificate, a small file).
    pub fn of(bytes: &[u8]) -> Sha256 {
        Sha256(sha2::Sha256::digest(bytes).into())
    }

    /// Lowercase hex without separators.
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Uppercase byte pairs joined by colons, as `pvenode cert info` shows.
    pub fn colons(&self) -> String {
        let parts: Vec<String> = self.0.iter().map(|b| format!("{b:02X}")).collect();
        parts.join(":")
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl From<[u8; 32]> for Sha256 {
    fn from(bytes: [u8; 32]) -> Sha256 {
        Sha256(bytes)
    }
}

impl From<sha2::Sha256> for Sha256 {
    /// A running hash, finished.
    fn from(hasher: sha2::Sha256) -> Sha256 {
        Sha256(hasher.finalize().into())
    }
}

impl fmt::Display for Sha256 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.hex())
    }
}

impl fmt::Debug for Sha256 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Sha256({self})")
    }
}

impl std::str::FromStr for Sha256 {
    type Err = String;
    /// 64 hex digits, any case, with or without colons between byte pairs
    /// (talosctl and sha256sum print plain hex, Proxmox the colon form).
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        let plain: String = if t.contains(':') {
            let groups: Vec<&str> = t.split(':').collect();
            if groups.len() != 32 || groups.iter().any(|g| g.len() != 2) {
                return Err(format!(
                    "{t:?} is not a SHA-256 fingerprint (32 colon-separated byte pairs such as AB:CD:…)"
                ));
            }
            groups.concat()
        } else {
            t.to_owned()
        };
        let mut out = [0u8; 32];
        hex::decode_to_slice(&plain, &mut out).map_err(|_| {
            format!("{t:?} is not a SHA-256 fingerprint (64 hex digits, with or without colons)")
        })?;
        Ok(Sha256(out))
    }
}

impl serde::Serialize for Sha256 {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.hex())
    }
}

impl<'de> serde::Deserialize<'de> for Sha256 {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_parse_in_every_spelling_users_paste() {
        let hex64 = "ab".repeat(31) + "0f";
        let plain: Sha256 = hex64.parse().unwrap();
        let colons = plain.colons();
        assert!(colons.starts_with("AB:AB:"), "{colons}");
        assert!(colons.ends_with(":0F"));
        assert_eq!(colons.parse::<Sha256>().unwrap(), plain);
        assert_eq!(colons.to_lowercase().parse::<Sha256>().unwrap(), plain);
        assert_eq!(hex64.to_uppercase().parse::<Sha256>().unwrap(), plain);
        assert_eq!(plain.hex(), hex64);
        assert_eq!(plain.to_string(), hex64);
    }

    #[test]
    fn malformed_digests_say_what_is_expected() {
        for bad in [
            "",
            "abc",
            &"ab".repeat(31),
            &"zz".repeat(32),
            "AB:CD",
            &"ABC:".repeat(31),
        ] {
            let err = bad.parse::<Sha256>().unwrap_err();
            assert!(err.contains("SHA-256 fingerprint"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn digests_serialize_as_the_hex_sha256sum_prints() {
        let d = Sha256::of(b"imgbuild");
        let json = serde_json::to_string(&d).unwrap();
        assert_eq!(json, format!("\"{}\"", d.hex()));
        assert_eq!(serde_json::from_str::<Sha256>(&json).unwrap(), d);
        assert!(serde_json::from_str::<Sha256>("\"nothex\"").is_err());
        let mut running = <sha2::Sha256 as sha2::Digest>::new();
        sha2::Digest::update(&mut running, b"imgbuild");
        assert_eq!(Sha256::from(running), d);
    }
}
