//! META on the kernel command line: how boot media other than disk images
//! (PXE, ISO) carry META values. Talos reads
//! `talos.environment=INSTALLER_META_BASE64=<v>` at boot, applies the values
//! before it installs (so maintenance mode already has a static network) and
//! writes them into the META partition when it does
//! (siderolabs/talos `pkg/imager/imager.go` `buildCmdline`,
//! `pkg/machinery/meta/meta.go` `Values.Encode`/`Values.Decode`).

use std::io::Write;

/// The longest kernel command line x86 and arm64 kernels take
/// (`COMMAND_LINE_SIZE`).
pub const CMDLINE_MAX: usize = 2048;

/// Why META cannot travel on a command line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CmdlineError {
    /// Talos splits the decoded text on `;`, so such a value would arrive cut.
    #[error("META key 0x{key:x} contains ';', which the kernel-argument encoding cannot carry")]
    Semicolon { key: u8 },
    /// An `INSTALLER_META_BASE64` value that `Values.Decode` would refuse.
    #[error("INSTALLER_META_BASE64 value cannot be decoded: {0}")]
    Undecodable(String),
}

/// The prefix of the kernel argument that carries META.
pub const ENVIRONMENT_PREFIX: &str = "talos.environment=INSTALLER_META_BASE64=";

/// The longest decoded META text accepted (META itself holds 256 KiB at
/// most), so a crafted gzip stream cannot fill memory.
const DECODED_MAX: u64 = 256 << 10;

/// The values an `INSTALLER_META_BASE64` value carries, as `Values.Decode`
/// reads them: base64, gunzip when it is gzip, `0x<key>=<value>` split on `;`.
pub fn decode_installer_meta(v: &str) -> Result<Vec<(u8, String)>, CmdlineError> {
    use base64::Engine;
    use std::io::Read;
    let bad = |m: String| CmdlineError::Undecodable(m);
    let raw = base64::engine::general_purpose::STANDARD
        .decode(v)
        .map_err(|e| bad(format!("base64: {e}")))?;
    let text = if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&raw[..])
            .take(DECODED_MAX + 1)
            .read_to_end(&mut out)
            .map_err(|e| bad(format!("gzip: {e}")))?;
        if out.len() as u64 > DECODED_MAX {
            return Err(bad(format!("over {DECODED_MAX} bytes once unpacked")));
        }
        out
    } else {
        raw
    };
    let text = String::from_utf8(text).map_err(|_| bad("not UTF-8 text".into()))?;
    text.split(';')
        .filter(|part| !part.is_empty())
        .map(|part| {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| bad(format!("{part:?} is not 0x<key>=<value>")))?;
            let key = key
                .strip_prefix("0x")
                .and_then(|k| u8::from_str_radix(k, 16).ok())
                .ok_or_else(|| bad(format!("{key:?} is not a META key like 0xa")))?;
            Ok((key, value.to_owned()))
        })
        .collect()
}

/// `v` of `INSTALLER_META_BASE64=<v>`: the values as `0x<key>=<value>`
/// joined by `;`, gzipped at best compression when `gzip` (Talos v1.6.3 and
/// later decode it) and the text is over 256 bytes, then standard base64.
pub fn installer_meta_base64(values: &[(u8, &str)], gzip: bool) -> Result<String, CmdlineError> {
    use base64::Engine;
    if let Some((key, _)) = values.iter().find(|(_, v)| v.contains(';')) {
        return Err(CmdlineError::Semicolon { key: *key });
    }
    let joined = values
        .iter()
        .map(|(k, v)| format!("0x{k:x}={v}"))
        .collect::<Vec<_>>()
        .join(";");
    let bytes = if gzip && joined.len() > 256 {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        gz.write_all(joined.as_bytes()).expect("writing to memory");
        gz.finish().expect("writing to memory")
    } else {
        joined.into_bytes()
    };
    Ok(base64::engine::general_purpose::STANDARD.encode(bytes))
}

/// The whole kernel argument carrying `values`.
pub fn environment_arg(values: &[(u8, &str)], gzip: bool) -> Result<String, CmdlineError> {
    Ok(format!(
        "{ENVIRONMENT_PREFIX}{}",
        installer_meta_base64(values, gzip)?
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine;

    fn decode(v: &str) -> Vec<u8> {
        base64::engine::general_purpose::STANDARD.decode(v).unwrap()
    }

    #[test]
    fn the_public_vector_round_trips() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/vectors/meta-adv.txt");
        let text = std::fs::read_to_string(path).unwrap();
        let want = text
            .lines()
            .find_map(|l| l.strip_prefix("env-0xa=foo "))
            .unwrap();
        assert_eq!(installer_meta_base64(&[(10, "foo")], true).unwrap(), want);
    }

    #[test]
    fn long_values_are_gzipped_only_where_talos_can_read_it() {
        let long = "x".repeat(300);
        let b = decode(&installer_meta_base64(&[(10, &long)], true).unwrap());
        assert_eq!(&b[..2], &[0x1f, 0x8b]);
        let mut out = String::new();
        std::io::Read::read_to_string(&mut flate2::read::GzDecoder::new(&b[..]), &mut out).unwrap();
        assert_eq!(out, format!("0xa={long}"));
        let plain = decode(&installer_meta_base64(&[(10, &long)], false).unwrap());
        assert_eq!(plain, format!("0xa={long}").into_bytes());
        // 256 bytes exactly stay plain even where gzip is understood.
        let edge = "y".repeat(256 - 4);
        let b = decode(&installer_meta_base64(&[(10, &edge)], true).unwrap());
        assert_eq!(b, format!("0xa={edge}").into_bytes());
    }

    #[test]
    fn several_keys_are_joined_in_order_with_hex_keys() {
        let b = decode(&installer_meta_base64(&[(10, "a"), (0x11, "b")], true).unwrap());
        assert_eq!(b, b"0xa=a;0x11=b");
        assert_eq!(
            environment_arg(&[(10, "foo")], true).unwrap(),
            "talos.environment=INSTALLER_META_BASE64=MHhhPWZvbw=="
        );
    }

    #[test]
    fn encoded_values_decode_back_plain_and_gzipped() {
        let long = "z".repeat(400);
        for gzip in [false, true] {
            let v = installer_meta_base64(&[(10, &long), (0x11, "b")], gzip).unwrap();
            assert_eq!(
                decode_installer_meta(&v).unwrap(),
                vec![(10, long.clone()), (0x11, "b".to_owned())]
            );
        }
        // Talos' own vector: 0xa=foo.
        assert_eq!(
            decode_installer_meta("MHhhPWZvbw==").unwrap(),
            vec![(10, "foo".to_owned())]
        );
    }

    #[test]
    fn undecodable_values_say_why() {
        use base64::Engine;
        let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
        let cases = [
            ("not base64!".to_owned(), "base64"),
            (b64(b"0xzz=1"), "not a META key"),
            (b64(b"novalue"), "is not 0x<key>=<value>"),
            (b64(&[0x1f, 0x8b, 8, 0, 1, 2]), "gzip"),
            (b64(&[0xff, 0xfe]), "UTF-8"),
        ];
        for (v, want) in cases {
            let e = decode_installer_meta(&v).unwrap_err().to_string();
            assert!(e.contains(want), "{v}: {e}");
        }
        // A gzip bomb stops at the limit.
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        gz.write_all(&vec![b'a'; (DECODED_MAX + 10) as usize])
            .unwrap();
        let e = decode_installer_meta(&b64(&gz.finish().unwrap())).unwrap_err();
        assert!(e.to_string().contains("once unpacked"), "{e}");
    }

    #[test]
    fn a_semicolon_is_refused_naming_the_key() {
        assert_eq!(
            installer_meta_base64(&[(10, "ok"), (12, "a;b")], true),
            Err(CmdlineError::Semicolon { key: 12 })
        );
    }
}
