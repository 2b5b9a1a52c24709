//! The one redaction set: every secret value imgbuild knows of, each with
//! the name it is shown under (`<redacted: NAME>`). A value is found in the
//! spellings imgbuild itself can print it in (JSON and Rust escapes,
//! `\u{…}` escapes, percent-encoding, base64 at any offset of a longer
//! base64 text, an excerpt cut short by `…`), not only as it was given.
//! Pure over strings: where the values come from is the caller's business,
//! except for the secret fields of a YAML document ([`secret_fields`]).

use std::borrow::Cow;
use std::collections::BTreeSet;
use std::fmt::Write as _;

use base64::Engine as _;

/// Values shorter than this are not secrets worth a mark: they would hide
/// ordinary words everywhere.
const SHORTEST: usize = 4;
/// Shortest base64 fragment searched for: shorter ones occur by chance.
const SHORTEST_ENCODED: usize = 8;
/// Shortest start of a value that counts when an excerpt cut it (`…`).
const SHORTEST_CUT: usize = 12;

/// The secret values known so far and the spellings to look for.
#[derive(Clone, Default)]
pub struct Redactions {
    /// (spelling, name), longest spelling first.
    needles: Vec<(String, String)>,
    /// (value, name): for excerpts cut short.
    values: Vec<(String, String)>,
    seen: BTreeSet<String>,
}

impl std::fmt::Debug for Redactions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: BTreeSet<&str> = self.values.iter().map(|(_, n)| n.as_str()).collect();
        f.debug_set().entries(names).finish()
    }
}

impl Redactions {
    /// Adds `value` under `name`; the first name a value was added under is
    /// kept. Values shorter than four characters are ignored.
    pub fn add(&mut self, name: &str, value: &str) {
        if value.chars().count() < SHORTEST || !self.seen.insert(value.to_owned()) {
            return;
        }
        let name = clean_name(name);
        for spelling in spellings(value) {
            self.needles.push((spelling, name.clone()));
        }
        // A multi-line value (a PEM key) is also found line by line, as a
        // diff shows it.
        for line in value.lines().filter(|l| l.trim().len() >= 16) {
            if line != value && !line.starts_with("-----") {
                self.needles.push((line.trim().to_owned(), name.clone()));
            }
        }
        // base64 text that decodes to text (a PEM key in a kubeconfig or
        // talosconfig) is also found decoded.
        if let Ok(bytes) = base64::engine::general_purpose::STANDARD.decode(value.trim())
            && let Ok(text) = String::from_utf8(bytes)
        {
            for line in text.lines().filter(|l| l.trim().len() >= 16) {
                if !line.starts_with("-----") {
                    self.needles.push((line.trim().to_owned(), name.clone()));
                }
            }
        }
        self.needles
            .sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| a.0.cmp(&b.0)));
        self.needles.dedup_by(|a, b| a.0 == b.0);
        self.values.push((value.to_owned(), name));
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// `text` with every known secret, in any spelling, shown as
    /// `<redacted: NAME>`.
    pub fn apply<'a>(&self, text: &'a str) -> Cow<'a, str> {
        let mut out = Cow::Borrowed(text);
        for (needle, name) in &self.needles {
            if out.contains(needle.as_str()) {
                out = Cow::Owned(out.replace(needle.as_str(), &mark(name)));
            }
        }
        if out.contains('…') {
            out = Cow::Owned(self.cut_short(&out));
        }
        out
    }

    /// An excerpt (`input::excerpt`, `quote`) shows a value's first
    /// characters and `…`: those characters are a secret's too.
    fn cut_short(&self, text: &str) -> String {
        let mut out = String::with_capacity(text.len());
        let mut rest = text;
        while let Some(at) = rest.find('…') {
            let before = &rest[..at];
            let found = self.values.iter().find_map(|(value, name)| {
                let starts = value.char_indices().map(|(i, _)| i).skip(SHORTEST_CUT);
                starts
                    .chain([value.len()])
                    .filter(|&end| before.ends_with(&value[..end]))
                    .max()
                    .map(|end| (end, name))
            });
            match found {
                Some((end, name)) => {
                    out.push_str(&before[..before.len() - end]);
                    out.push_str(&mark(name));
                }
                None => out.push_str(before),
            }
            out.push('…');
            rest = &rest[at + '…'.len_utf8()..];
        }
        out.push_str(rest);
        out
    }
}

/// How a redacted value is shown.
fn mark(name: &str) -> String {
    format!("<redacted: {name}>")
}

/// A name that is safe inside a mark, in JSON and on a terminal.
fn clean_name(name: &str) -> String {
    let kept: String = name
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || "._-:/ ".contains(*c))
        .take(80)
        .collect();
    if kept.is_empty() {
        "secret".to_owned()
    } else {
        kept
    }
}

/// The spellings imgbuild's own output can give `value`: as it is; as a
/// JSON string holds it (serde_json, and ASCII-only JSON as other tools
/// write it); as Rust's `{:?}` and `\u{…}` escapes show it; percent-encoded
/// (a URL); and base64 at each of the three offsets it can start at inside
/// a longer base64 text.
pub fn spellings(value: &str) -> Vec<String> {
    let mut out = vec![value.to_owned()];
    let json = serde_json::to_string(value).unwrap_or_default();
    out.push(json[1..json.len() - 1].to_owned());
    out.push(json_ascii(value, false));
    out.push(json_ascii(value, true));
    let debug = format!("{value:?}");
    out.push(debug[1..debug.len() - 1].to_owned());
    out.push(unicode_escaped(value));
    out.push(percent(value, true, false));
    out.push(percent(value, true, true));
    out.push(percent(value, false, false));
    out.push(percent(value, false, true));
    out.push(percent(value, false, false).replace("%20", "+"));
    for engine in [
        &base64::engine::general_purpose::STANDARD_NO_PAD,
        &base64::engine::general_purpose::URL_SAFE_NO_PAD,
    ] {
        for offset in 0..3 {
            let fragment = base64_fragment(engine, value.as_bytes(), offset);
            if fragment.len() >= SHORTEST_ENCODED {
                out.push(fragment);
            }
        }
    }
    out.sort();
    out.dedup();
    out.retain(|s| s.chars().count() >= SHORTEST);
    out
}

/// A JSON string body with every non-ASCII character as `\uXXXX` (UTF-16,
/// as JSON spells it).
fn json_ascii(value: &str, upper: bool) -> String {
    let mut out = String::new();
    for c in value.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_ascii() && !c.is_ascii_control() => out.push(c),
            c => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    if upper {
                        let _ = write!(out, "\\u{u:04X}");
                    } else {
                        let _ = write!(out, "\\u{u:04x}");
                    }
                }
            }
        }
    }
    out
}

/// Every character that is not printable ASCII as `\u{…}`.
fn unicode_escaped(value: &str) -> String {
    let mut out = String::new();
    for c in value.chars() {
        if c.is_ascii() && !c.is_ascii_control() {
            out.push(c);
        } else {
            let _ = write!(out, "\\u{{{:x}}}", c as u32);
        }
    }
    out
}

/// Percent-encoding: `all` encodes every byte but the unreserved ones (RFC
/// 3986), else only non-ASCII bytes, controls and spaces (as URL parsers
/// leave a path or query).
fn percent(value: &str, all: bool, lower: bool) -> String {
    let mut out = String::new();
    for b in value.bytes() {
        let keep = if all {
            b.is_ascii_alphanumeric() || b"-._~".contains(&b)
        } else {
            b.is_ascii_graphic()
        };
        if keep {
            out.push(char::from(b));
        } else if lower {
            let _ = write!(out, "%{b:02x}");
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// The base64 characters that depend only on `bytes` when they start
/// `offset` bytes into a longer encoded text.
fn base64_fragment(engine: &base64::engine::GeneralPurpose, bytes: &[u8], offset: usize) -> String {
    let mut padded = vec![0u8; offset];
    padded.extend_from_slice(bytes);
    let encoded = engine.encode(&padded);
    let first = (offset * 8).div_ceil(6);
    let last = padded.len() * 8 / 6;
    encoded.get(first..last).unwrap_or_default().to_owned()
}

/// The secret string values of a YAML document (a machine config, the
/// secrets bundle, a talosconfig or kubeconfig), each with its field path:
/// the fields Talos's schema holds secrets in (machine token, CA and
/// service-account keys, `cluster.secret`, bootstrap tokens,
/// `aescbcEncryptionSecret`, `secretboxEncryptionSecret`), every field
/// named like a key, token, secret or password, and the entries of an
/// `ExtensionServiceConfig` environment whose name says so
/// (`TS_AUTHKEY=…`).
pub fn secret_fields(doc: &serde_json::Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    walk(doc, "", false, &mut out);
    if doc["kind"] == "ExtensionServiceConfig"
        && let Some(env) = doc["environment"].as_array()
    {
        for entry in env.iter().filter_map(|e| e.as_str()) {
            if let Some((name, value)) = entry.split_once('=')
                && secret_name(name)
            {
                out.push((name.to_owned(), value.to_owned()));
            }
        }
    }
    out
}

fn walk(v: &serde_json::Value, path: &str, secret: bool, out: &mut Vec<(String, String)>) {
    match v {
        serde_json::Value::String(s) if secret => out.push((path.to_owned(), s.clone())),
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                let path = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                walk(v, &path, secret || secret_key(k), out);
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|v| walk(v, path, secret, out)),
        _ => {}
    }
}

/// A YAML field holding a secret: `key`, `…Key` but a public key,
/// `client-key-data`, and anything naming a token, secret or password.
fn secret_key(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    (k.ends_with("key") && !k.ends_with("publickey"))
        || k.contains("key-data")
        || ["token", "secret", "password"]
            .iter()
            .any(|w| k.contains(w))
}

/// An environment variable name that says it holds a secret. One that
/// names a file or folder (`SOPS_AGE_KEY_FILE`) holds a path, shown in
/// clear so that an error can say which file.
pub fn secret_name(name: &str) -> bool {
    let n = name.to_ascii_uppercase();
    let path = ["_FILE", "_PATH", "_DIR"].iter().any(|s| n.ends_with(s));
    !path
        && ["KEY", "TOKEN", "SECRET", "PASSWORD"]
            .iter()
            .any(|w| n.contains(w))
}

/// A config diff with the value of every line that sets a secret field
/// (`token: …`, `key: …`, `- TS_AUTHKEY=…`) shown as `<redacted: FIELD>`,
/// whether or not the value is known: a node's old config holds secrets
/// imgbuild no longer has (a rotated token).
pub fn secret_lines(diff: &str) -> String {
    let mut out = String::with_capacity(diff.len());
    for line in diff.split_inclusive('\n') {
        let (body, end) = match line.strip_suffix('\n') {
            Some(b) => (b, "\n"),
            None => (line, ""),
        };
        out.push_str(&secret_line(body).unwrap_or_else(|| body.to_owned()));
        out.push_str(end);
    }
    out
}

/// One diff line with a secret field's value redacted, or None.
fn secret_line(line: &str) -> Option<String> {
    // The diff's own marks, the YAML indent and a list item's dash.
    let rest = line.trim_start_matches(['+', '-', ' ', '\t']);
    let head = &line[..line.len() - rest.len()];
    // An environment entry: NAME=value.
    if let Some((name, value)) = rest.split_once('=')
        && !name.is_empty()
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && secret_name(name)
        && !value.is_empty()
    {
        return Some(format!("{head}{name}={}", mark(name)));
    }
    let (key, value) = rest.split_once(':')?;
    let name = key.trim().trim_matches(['"', '\'']);
    let value = value.trim();
    let scalar = !value.is_empty() && !value.starts_with(['|', '>', '{', '[', '&', '*']);
    (scalar && !name.contains(' ') && secret_key(name))
        .then(|| format!("{head}{key}: {}", mark(name)))
}

/// [`secret_fields`] of every document of a YAML text; a text that is not
/// YAML gives none.
pub fn secret_fields_of_yaml(text: &str) -> Vec<(String, String)> {
    use serde::Deserialize;
    let mut out = Vec::new();
    // Through the input gate first: serde's parser is quadratic in flow
    // nesting before its own depth limit.
    let Ok(text) = crate::input::yaml(text) else {
        return out;
    };
    for de in serde_yaml_ng::Deserializer::from_str(text) {
        match serde_json::Value::deserialize(de) {
            Ok(doc) => out.extend(secret_fields(&doc)),
            Err(_) => break,
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "tskey-auth-kÖnig-ÿ€𝄞-1234";

    fn set() -> Redactions {
        let mut r = Redactions::default();
        r.add("TS_AUTHKEY", TOKEN);
        r
    }

    #[test]
    fn a_value_is_hidden_in_every_spelling_imgbuild_prints() {
        let r = set();
        let json = serde_json::to_string(&serde_json::json!({ "v": TOKEN })).unwrap();
        let cases = [
            TOKEN.to_owned(),
            json,
            format!("{TOKEN:?}"),
            json_ascii(TOKEN, false),
            unicode_escaped(TOKEN),
            format!("https://x/?token={}", percent(TOKEN, true, false)),
            percent(TOKEN, false, true),
            base64::engine::general_purpose::STANDARD.encode(format!("ab{TOKEN}cd")),
            base64::engine::general_purpose::URL_SAFE.encode(format!("a{TOKEN}")),
            format!("value \"{}…\"", TOKEN.chars().take(14).collect::<String>()),
        ];
        for text in cases {
            let shown = r.apply(&text);
            assert!(shown.contains("<redacted: TS_AUTHKEY>"), "{text} → {shown}");
            for bit in ["kÖnig", "\\u00d6", "%C3%96", "1234"] {
                assert!(!shown.contains(bit), "{text} → {shown}");
            }
        }
    }

    #[test]
    fn other_text_is_left_alone() {
        let r = set();
        let text = "cp-01: v1.11.2 → v1.11.3, schematic 376567988ad3 (done)";
        assert!(matches!(r.apply(text), Cow::Borrowed(_)));
        let mut short = Redactions::default();
        short.add("X", "abc");
        assert_eq!(short.apply("abc abc"), "abc abc");
    }

    #[test]
    fn a_multi_line_key_is_found_line_by_line_and_decoded() {
        let pem = "-----BEGIN EC PRIVATE KEY-----\nMHcCAQEEIBkg4LVWM9nuwNSk3yByxZpYRTBnVJk5oDVwPYCg6DRp\n-----END EC PRIVATE KEY-----\n";
        let b64 = base64::engine::general_purpose::STANDARD.encode(pem);
        let mut r = Redactions::default();
        r.add("contexts.key", &b64);
        let diff = "-    MHcCAQEEIBkg4LVWM9nuwNSk3yByxZpYRTBnVJk5oDVwPYCg6DRp";
        assert_eq!(r.apply(diff), "-    <redacted: contexts.key>");
    }

    #[test]
    fn a_diff_loses_every_secret_value_known_or_not() {
        let diff = "+    token: new.0123456789abcdef\n-    token: old.0123456789abcdef\n         key: LS0tLS1CRUdJTiBFQyBQUklWQVRF\n+  - TS_AUTHKEY=tskey-new\n-  - TS_ROUTES=10.0.0.0/8\n+    hostname: cp-01\n";
        assert_eq!(
            secret_lines(diff),
            "+    token: <redacted: token>\n-    token: <redacted: token>\n         key: <redacted: key>\n+  - TS_AUTHKEY=<redacted: TS_AUTHKEY>\n-  - TS_ROUTES=10.0.0.0/8\n+    hostname: cp-01\n"
        );
    }

    #[test]
    fn secret_fields_follow_the_talos_schema() {
        let doc: serde_json::Value = serde_json::json!({
            "machine": {"token": "abcdef.0123456789abcdef", "ca": {"crt": "PUBLIC", "key": "PRIVATEKEY"},
                        "network": {"hostname": "cp-01"}},
            "cluster": {"secret": "clustersecret", "aescbcEncryptionSecret": "aes-secret",
                        "serviceAccount": {"key": "sakey-value"}},
        });
        let found = secret_fields(&doc);
        let names: Vec<&str> = found.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "machine.token",
                "machine.ca.key",
                "cluster.secret",
                "cluster.aescbcEncryptionSecret",
                "cluster.serviceAccount.key"
            ]
        );
        let ext = serde_json::json!({"apiVersion": "v1alpha1", "kind": "ExtensionServiceConfig",
            "name": "tailscale", "environment": ["TS_AUTHKEY=tskey-1", "TS_ROUTES=10.0.0.0/8"]});
        assert_eq!(
            secret_fields(&ext),
            [("TS_AUTHKEY".to_owned(), "tskey-1".to_owned())]
        );
    }

    #[test]
    fn a_variable_naming_a_key_file_holds_a_path_not_a_secret() {
        assert!(secret_name("SOPS_AGE_KEY"));
        assert!(secret_name("HCLOUD_TOKEN"));
        assert!(!secret_name("SOPS_AGE_KEY_FILE"));
        assert!(!secret_name("GOOGLE_APPLICATION_CREDENTIALS_KEY_PATH"));
        assert!(!secret_name("TALOSCONFIG"));
    }
}
