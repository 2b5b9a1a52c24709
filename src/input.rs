//! Files, YAML and text that other people made (inventories and talhelper
//! configs from repositories, patches, secrets bundles, replies, images):
//! read with a size bound, parsed within a budget, shown escaped. Every
//! reader of such input goes through here, so the bounds are one set.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::io::{self, Read};
use std::path::Path;
use yaml_rust2::parser::{Event, Parser};
use yaml_rust2::scanner::TScalarStyle;

/// The largest text file (inventory, talconfig, talenv, patch, manifest,
/// secrets bundle) imgbuild reads: hand-written files are kilobytes.
pub const MAX_TEXT_FILE: u64 = 4 << 20;

/// Reads the text file at `path`: a regular file (a FIFO would block, a
/// device never end), at most `limit` bytes, UTF-8, without a leading
/// byte-order mark. Errors are `io::Error`s whose message says which rule
/// the file broke; callers name the file.
pub fn read_text(path: &Path, limit: u64) -> io::Result<String> {
    use std::os::unix::fs::OpenOptionsExt;
    let not_regular = |m: &std::fs::Metadata| -> Option<io::Error> {
        if m.is_dir() {
            Some(io::Error::new(
                io::ErrorKind::IsADirectory,
                "is a directory, not a file",
            ))
        } else if !m.is_file() {
            Some(io::Error::new(
                io::ErrorKind::InvalidInput,
                "is not a regular file (a FIFO, socket or device)",
            ))
        } else {
            None
        }
    };
    if let Some(e) = not_regular(&std::fs::metadata(path)?) {
        return Err(e);
    }
    // O_NONBLOCK: a FIFO swapped in after the check must not hang the open.
    let file = std::fs::File::options()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    if let Some(e) = not_regular(&file.metadata()?) {
        return Err(e);
    }
    let mut bytes = Vec::new();
    file.take(limit + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("is larger than {} KiB", limit >> 10),
        ));
    }
    let text = String::from_utf8(bytes).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("is not UTF-8 text (byte {})", e.utf8_error().valid_up_to()),
        )
    })?;
    Ok(match text.strip_prefix('\u{feff}') {
        Some(rest) => rest.to_owned(),
        None => text,
    })
}

/// How much YAML may unfold to. Hand-written documents stay far below:
/// a 100-node inventory is a few thousand nodes.
const MAX_DEPTH: usize = 64;
const MAX_NODES: u64 = 100_000;
const MAX_SCALAR_BYTES: u64 = 16 << 20;

/// Why a YAML document was refused before it was deserialised.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {message}")]
pub struct YamlRefused {
    pub line: usize,
    pub message: String,
}

/// Checks `text` before serde sees it, and returns it without a leading
/// byte-order mark. Refuses nesting deeper than 64 levels (deep flow
/// collections take the parser quadratic time), aliases that unfold to more
/// than 100 000 nodes or 16 MiB of scalars (an alias bomb: serde expands
/// every alias), and a key repeated in one mapping (serde reports those at
/// the document's start). A syntax error passes: the deserialiser reports
/// it with its own position.
pub fn yaml(text: &str) -> Result<&str, YamlRefused> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut parser = Parser::new_from_str(text);
    // One open collection: its anchor, what it unfolds to so far, and for
    // a mapping the keys seen and whether the next node is a key.
    struct Open {
        anchor: usize,
        nodes: u64,
        bytes: u64,
        keys: Option<HashSet<(bool, String)>>,
        at_key: bool,
    }
    let mut stack: Vec<Open> = Vec::new();
    let mut anchors: HashMap<usize, (u64, u64)> = HashMap::new();
    let (mut nodes, mut bytes) = (0u64, 0u64);
    loop {
        let (event, mark) = match parser.next_token() {
            Ok(next) => next,
            // The scanner's own bound on flow nesting (255 levels).
            Err(e) if e.info().contains("recursion limit") => {
                return Err(YamlRefused {
                    line: e.marker().line(),
                    message: format!("nested deeper than {MAX_DEPTH} levels"),
                });
            }
            // A syntax error passes to serde's parser, which reports it
            // with its own position; but libyaml scans deep flow nesting
            // in quadratic time before its own depth limit (seconds for a
            // few thousand levels, a minute for 100 000): a text that
            // opens more flow collections than the limit is refused first.
            Err(_) => {
                return match flow_too_deep(text) {
                    Some(line) => Err(YamlRefused {
                        line,
                        message: format!("nested deeper than {MAX_DEPTH} levels"),
                    }),
                    None => Ok(text),
                };
            }
        };
        let line = mark.line();
        let refuse = |message: String| Err(YamlRefused { line, message });
        // What the event adds to its parent, once the node it ends is whole.
        let done: Option<Done> = match event {
            Event::StreamEnd => return Ok(text),
            Event::SequenceStart(anchor, _) | Event::MappingStart(anchor, _) => {
                if stack.len() >= MAX_DEPTH {
                    return refuse(format!("nested deeper than {MAX_DEPTH} levels"));
                }
                let map = matches!(event, Event::MappingStart(..));
                stack.push(Open {
                    anchor,
                    nodes: 1,
                    bytes: 0,
                    keys: map.then(HashSet::new),
                    at_key: true,
                });
                nodes += 1;
                None
            }
            Event::SequenceEnd | Event::MappingEnd => {
                let o = stack.pop().expect("the parser balances collections");
                Some(Done {
                    nodes: o.nodes,
                    bytes: o.bytes,
                    anchor: o.anchor,
                    key: None,
                })
            }
            Event::Scalar(value, style, anchor, _) => {
                nodes += 1;
                bytes += value.len() as u64;
                let plain = style == TScalarStyle::Plain;
                Some(Done {
                    nodes: 1,
                    bytes: value.len() as u64,
                    anchor,
                    key: Some((plain, value)),
                })
            }
            Event::Alias(id) => {
                let (n, b) = anchors.get(&id).copied().unwrap_or((1, 0));
                nodes = nodes.saturating_add(n);
                bytes = bytes.saturating_add(b);
                Some(Done {
                    nodes: n,
                    bytes: b,
                    anchor: 0,
                    key: None,
                })
            }
            _ => None,
        };
        if nodes > MAX_NODES || bytes > MAX_SCALAR_BYTES {
            return refuse(format!(
                "the document unfolds to more than {MAX_NODES} nodes or {} MiB \
                 (aliases repeat what they refer to)",
                MAX_SCALAR_BYTES >> 20
            ));
        }
        let Some(Done {
            nodes: n,
            bytes: b,
            anchor,
            key,
        }) = done
        else {
            continue;
        };
        if anchor != 0 {
            anchors.insert(anchor, (n, b));
        }
        if let Some(parent) = stack.last_mut() {
            parent.nodes = parent.nodes.saturating_add(n);
            parent.bytes = parent.bytes.saturating_add(b);
            if let Some(keys) = &mut parent.keys {
                if parent.at_key
                    && let Some(key) = key
                    && key.1 != "<<"
                    && !keys.insert(key.clone())
                {
                    return refuse(format!("key {} appears twice", quote(&key.1)));
                }
                parent.at_key = !parent.at_key;
            }
        }
    }
}

/// The line where `text` first has more than [`MAX_DEPTH`] flow
/// collections (`[`, `{`) open, counted byte by byte in one pass. Only for
/// a text the parser already found no valid YAML: brackets inside quotes,
/// comments or block scalars count too, which at worst names this
/// refusal instead of the syntax error.
fn flow_too_deep(text: &str) -> Option<usize> {
    let (mut depth, mut line) = (0usize, 1usize);
    for b in text.bytes() {
        match b {
            b'\n' => line += 1,
            b'[' | b'{' => {
                depth += 1;
                if depth > MAX_DEPTH {
                    return Some(line);
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    None
}

/// A node the guard finished: what it unfolds to, its anchor (0: none)
/// and, for a scalar, its text (and whether it was plain) in case it is a key.
struct Done {
    nodes: u64,
    bytes: u64,
    anchor: usize,
    key: Option<(bool, String)>,
}

/// Text from an image, a reply or a foreign file, safe for a terminal:
/// control characters (ESC, CSI, BEL, DEL, carriage returns, C1…) and the
/// characters that reorder or hide text (bidi overrides, zero-width
/// marks, line separators) become `\u{..}` escapes. Newlines and tabs stay.
pub fn escape(s: &str) -> Cow<'_, str> {
    let unsafe_char = |c: char| (c.is_control() && c != '\n' && c != '\t') || hides_text(c);
    if !s.chars().any(unsafe_char) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if unsafe_char(c) {
            let _ = write!(out, "\\u{{{:x}}}", c as u32);
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// Characters that reorder or hide what a terminal shows: bidi marks,
/// embeddings, overrides and isolates, zero-width characters, the Unicode
/// line and paragraph separators, and the byte order mark.
pub fn hides_text(c: char) -> bool {
    matches!(c, '\u{61c}' | '\u{200b}'..='\u{200f}' | '\u{2028}'..='\u{202e}' | '\u{2060}'..='\u{2069}' | '\u{feff}')
}

/// Foreign text as one cell of a row: every control character, newlines
/// and tabs included, escaped (so it cannot start a row of its own), and
/// at most `n` characters (an ellipsis says more followed).
pub fn one_line(s: &str, n: usize) -> String {
    let mut out = String::new();
    for c in cut(s, n).chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() || hides_text(c) => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    out
}

/// A short excerpt of foreign text for a message: at most 40 characters,
/// escaped, in quotes.
pub fn quote(s: &str) -> String {
    format!("{:?}", cut(s, 40))
}

/// At most `n` characters of `s` (an ellipsis says more followed), escaped.
pub fn excerpt(s: &str, n: usize) -> String {
    escape(&cut(s, n)).into_owned()
}

fn cut(s: &str, n: usize) -> String {
    let mut cut: String = s.chars().take(n).collect();
    if s.chars().nth(n).is_some() {
        cut.push('…');
    }
    cut
}

/// A serde_yaml_ng error without any value from the document: the field
/// path, what was expected, and the position. serde quotes the offending
/// value ("invalid type: string \"LS0t…\"") and unknown keys, which in a
/// secrets bundle may be a key or a token.
pub fn yaml_error_without_values(e: &serde_yaml_ng::Error) -> String {
    let full = e.to_string();
    let loc = e.location();
    let mut msg = full.as_str();
    if let Some(l) = &loc
        && let Some(cut) = msg.rfind(&format!(" at line {} column {}", l.line(), l.column()))
    {
        msg = &msg[..cut];
    }
    const MARKERS: [&str; 7] = [
        "invalid type: ",
        "invalid value: ",
        "invalid length ",
        "unknown field ",
        "unknown variant ",
        "missing field ",
        "duplicate field ",
    ];
    let found = MARKERS
        .iter()
        .filter_map(|m| msg.find(m).map(|i| (i, *m)))
        .min_by_key(|(i, _)| *i);
    let at = loc
        .map(|l| format!(" at line {} column {}", l.line(), l.column()))
        .unwrap_or_default();
    let Some((i, marker)) = found else {
        // libyaml's syntax messages are fixed texts; anything else that
        // quotes is not shown.
        return if msg.contains(['"', '`', '\'']) {
            format!("not valid here{at}")
        } else {
            format!("{}{at}", escape(msg))
        };
    };
    let (path, rest) = msg.split_at(i);
    let expected = rest
        .rfind(", expected ")
        .map(|j| &rest[j + 2..])
        .filter(|_| !matches!(marker, "missing field " | "duplicate field "));
    let what = match marker {
        "invalid type: " => {
            let found = rest[marker.len()..]
                .split([' ', ','])
                .next()
                .unwrap_or("value");
            format!(
                "a {found} found, {}",
                expected.unwrap_or("another type expected")
            )
        }
        "invalid value: " => format!("an invalid value, {}", expected.unwrap_or("")),
        "unknown field " => format!("an unknown field, {}", expected.unwrap_or("")),
        "unknown variant " => format!("an unknown variant, {}", expected.unwrap_or("")),
        // Field names in these come from imgbuild's own types.
        _ => rest.to_owned(),
    };
    format!("{path}{}{at}", what.trim_end_matches(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_alias_bomb_is_refused_early() {
        let mut text = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n");
        for i in 1..12 {
            let p = i - 1;
            text.push_str(&format!(
                "a{i}: &a{i} [*a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}]\n"
            ));
        }
        let e = yaml(&text).unwrap_err();
        assert!(e.message.contains("unfolds"), "{e}");
        assert!(e.line <= 6, "{e}");
        // A few aliases are fine.
        assert!(yaml("a: &x {b: 1}\nc: *x\nd: {<<: *x, e: 2}\n").is_ok());
    }

    #[test]
    fn a_syntax_error_before_deep_flow_nesting_is_refused_by_the_count() {
        // The guard's parser stops at the tab on line 2; serde's would
        // scan the 100 000 open mappings after it in quadratic time.
        let deep = format!("a: 1\n\tb: 2\nc: {}x\n", "{d: ".repeat(100_000));
        let e = yaml(&deep).unwrap_err();
        assert!(e.message.contains("nested deeper than 64"), "{e}");
        assert_eq!(e.line, 3, "{e}");
        // Closed as often as opened, flow brackets count only while open.
        let wide = format!("a: 1\n\tb: 2\n{}\n", "[x] ".repeat(1000));
        assert_eq!(yaml(&wide), Ok(wide.as_str()));
        assert_eq!(flow_too_deep(&"[".repeat(64)), None);
        assert_eq!(flow_too_deep(&format!("\n\n{}", "{".repeat(65))), Some(3));
    }

    #[test]
    fn deep_nesting_and_repeated_keys_are_refused_with_their_line() {
        let deep = format!("{}{}", "[".repeat(5000), "]".repeat(5000));
        let t = std::time::Instant::now();
        assert!(yaml(&deep).unwrap_err().message.contains("nested"));
        assert!(t.elapsed().as_secs() < 2);
        let e = yaml("cluster:\n  name: a\nnodes: []\ncluster:\n  name: b\n").unwrap_err();
        assert_eq!(
            (e.line, e.message.as_str()),
            (4, "key \"cluster\" appears twice")
        );
        // Equal keys in different mappings, and a quoted twin of a plain key.
        assert!(yaml("a: {x: 1}\nb: {x: 1}\nc: [{x: 1}, {x: 2}]\n").is_ok());
    }

    #[test]
    fn a_bom_is_dropped_and_syntax_errors_pass_through() {
        assert_eq!(yaml("\u{feff}a: 1\n").unwrap(), "a: 1\n");
        assert!(yaml("a: [\n").is_ok());
    }

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(escape("ok\ttext\n"), "ok\ttext\n");
        assert_eq!(escape("\x1b[2Jx\u{9b}"), "\\u{1b}[2Jx\\u{9b}");
        assert_eq!(quote(&"a".repeat(50)).chars().count(), 43);
    }

    #[test]
    fn serde_messages_lose_their_values() {
        #[derive(serde::Deserialize, Debug)]
        #[allow(dead_code)]
        struct Pair {
            crt: String,
        }
        #[derive(serde::Deserialize, Debug)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        struct Doc {
            etcd: Pair,
            n: u8,
        }
        let cases = [
            (
                "etcd: LS0tSECRET\nn: 1\n",
                "etcd: a string found, expected struct Pair",
            ),
            (
                "etcd: {crt: [SECRET]}\nn: 1\n",
                "etcd.crt: a sequence found, expected a string",
            ),
            (
                "etcd: {crt: a}\nn: 999\n",
                "n: an invalid value, expected u8",
            ),
            (
                "etcd: {crt: a}\nn: 1\nSECRET: 1\n",
                "an unknown field, expected",
            ),
            ("etcd: {crt: a}\n", "missing field `n`"),
        ];
        for (text, want) in cases {
            let e = serde_yaml_ng::from_str::<Doc>(text).unwrap_err();
            let shown = yaml_error_without_values(&e);
            assert!(shown.contains(want), "{shown} / {e}");
            assert!(
                !shown.contains("SECRET") && !shown.contains("999"),
                "{shown}"
            );
        }
    }
}
