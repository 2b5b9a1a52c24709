//! The canonical YAML emitter: the exact bytes Go's YAML library (the one
//! Image Factory hashes) writes for a schematic.
//!
//! Layout: 4 spaces per mapping level; a block sequence under a key is indented
//! to the next multiple of 4; an item's content starts 2 columns after its dash
//! (a mapping item keeps its first key on the dash line). Empty collections are
//! written in flow style (`{}`, `[]`). Scalars pick plain, single-quoted,
//! double-quoted or literal-block style by the library's rules (see
//! [`scalar_style`]); long lines are never folded.

use super::resolve::plain_is_string;

/// A YAML value as the emitter sees it: strings get styled, raw scalars
/// (numbers, booleans, null) are written as given.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Node {
    Map(Vec<(String, Node)>),
    Seq(Vec<Node>),
    Str(String),
    Raw(String),
}

/// Input the emitter refuses rather than risk bytes that differ from Go's.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum EmitError {
    #[error(
        "{0:?} contains a Unicode line or paragraph separator (U+2028/U+2029); \
         schematics with these cannot be hashed reliably"
    )]
    LineSeparator(String),
    #[error("mapping key {0:?} is multi-line or longer than 128 bytes; use a shorter key")]
    ComplexKey(String),
}

const INDENT: usize = 4;

/// Writes a top-level mapping as one YAML document ending in a newline.
pub(crate) fn emit_document(entries: &[(String, Node)]) -> Result<String, EmitError> {
    let mut e = Emitter { out: String::new() };
    if entries.is_empty() {
        e.out.push_str("{}");
    } else {
        e.map(entries, 0, false)?;
    }
    e.line_break();
    Ok(e.out)
}

struct Emitter {
    out: String,
}

impl Emitter {
    fn line_break(&mut self) {
        if !self.out.is_empty() && !self.out.ends_with('\n') {
            self.out.push('\n');
        }
    }

    fn start_line(&mut self, indent: usize) {
        self.line_break();
        self.out.extend(std::iter::repeat_n(' ', indent));
    }

    fn map(
        &mut self,
        entries: &[(String, Node)],
        indent: usize,
        after_dash: bool,
    ) -> Result<(), EmitError> {
        for (i, (key, value)) in entries.iter().enumerate() {
            if i == 0 && after_dash {
                self.out.push(' ');
            } else {
                self.start_line(indent);
            }
            self.key(key)?;
            self.out.push(':');
            self.value(value, INDENT * ((indent + INDENT) / INDENT), false)?;
        }
        Ok(())
    }

    fn seq(&mut self, items: &[Node], indent: usize, after_dash: bool) -> Result<(), EmitError> {
        for (i, item) in items.iter().enumerate() {
            if i == 0 && after_dash {
                self.out.push(' ');
            } else {
                self.start_line(indent);
            }
            self.out.push('-');
            self.value(item, indent + 2, true)?;
        }
        Ok(())
    }

    /// Writes a value after `key:` or `-`; `indent` is where its content goes.
    fn value(&mut self, node: &Node, indent: usize, after_dash: bool) -> Result<(), EmitError> {
        match node {
            Node::Map(entries) if entries.is_empty() => self.out.push_str(" {}"),
            Node::Seq(items) if items.is_empty() => self.out.push_str(" []"),
            Node::Map(entries) => self.map(entries, indent, after_dash)?,
            Node::Seq(items) => self.seq(items, indent, after_dash)?,
            Node::Raw(text) => {
                self.out.push(' ');
                self.out.push_str(text);
            }
            Node::Str(s) => {
                self.out.push(' ');
                match scalar_style(s, false)? {
                    Style::Literal => self.literal(s, indent),
                    style => write_inline(&mut self.out, s, style),
                }
            }
        }
        Ok(())
    }

    fn key(&mut self, key: &str) -> Result<(), EmitError> {
        if key.len() > 128 {
            return Err(EmitError::ComplexKey(key.to_owned()));
        }
        let style = scalar_style(key, true)?;
        write_inline(&mut self.out, key, style);
        Ok(())
    }

    /// `|` block: an indentation hint when the text starts with a space or
    /// break, then `-` (no final newline), nothing (one) or `+` (more).
    fn literal(&mut self, s: &str, indent: usize) {
        self.out.push('|');
        if s.starts_with([' ', '\n']) {
            self.out.push_str(&INDENT.to_string());
        }
        let trailing_breaks = s.len() - s.trim_end_matches('\n').len();
        match trailing_breaks {
            0 => self.out.push('-'),
            1 if s.len() > 1 => {}
            _ => self.out.push('+'),
        }
        // The first break ends the header line; empty lines get no indent.
        for line in s.split('\n') {
            self.out.push('\n');
            if !line.is_empty() {
                self.out.extend(std::iter::repeat_n(' ', indent));
                self.out.push_str(line);
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Style {
    Plain,
    Single,
    Double,
    Literal,
}

/// What the emitter may do with a string, from a scan of its characters.
struct Analysis {
    block_plain_allowed: bool,
    single_quoted_allowed: bool,
    block_allowed: bool,
}

/// The style Go's library picks for a string in block context.
pub(crate) fn scalar_style(s: &str, is_key: bool) -> Result<Style, EmitError> {
    if s.contains(['\u{2028}', '\u{2029}']) {
        return Err(EmitError::LineSeparator(s.to_owned()));
    }
    let a = analyze(s);
    if s.contains('\n') {
        if is_key {
            return Err(EmitError::ComplexKey(s.to_owned()));
        }
        // rc.4 keeps literal blocks for text with something visible in it.
        let literal_worthy = s.len() >= 2 && !s.chars().all(char::is_whitespace);
        return Ok(if a.block_allowed && literal_worthy {
            Style::Literal
        } else {
            Style::Double
        });
    }
    if !plain_is_string(s) {
        return Ok(Style::Double);
    }
    if a.block_plain_allowed {
        Ok(Style::Plain)
    } else if a.single_quoted_allowed {
        Ok(Style::Single)
    } else {
        Ok(Style::Double)
    }
}

fn is_printable(c: char) -> bool {
    matches!(c as u32,
        0x0A | 0x20..=0x7E | 0xA0..=0xD7FF | 0xE000..=0xFEFE | 0xFF00..=0xFFFD)
}

fn is_break(c: char) -> bool {
    matches!(c, '\r' | '\n' | '\u{85}' | '\u{2028}' | '\u{2029}')
}

fn analyze(s: &str) -> Analysis {
    let chars: Vec<char> = s.chars().collect();
    if chars.is_empty() {
        return Analysis {
            block_plain_allowed: true,
            single_quoted_allowed: true,
            block_allowed: false,
        };
    }
    let mut block_indicators = s.starts_with("---") || s.starts_with("...");
    let (mut special, mut tabs, mut line_breaks) = (false, false, false);
    let (mut space_break, mut break_space) = (false, false);
    let (mut previous_space, mut previous_break) = (false, false);
    let mut preceded_by_whitespace = true;
    let last = chars.len() - 1;
    for (i, &c) in chars.iter().enumerate() {
        let followed_by_whitespace = i == last || matches!(chars[i + 1], ' ' | '\t');
        if i == 0 {
            match c {
                '#' | ',' | '[' | ']' | '{' | '}' | '&' | '*' | '!' | '|' | '>' | '\'' | '"'
                | '%' | '@' | '`' => block_indicators = true,
                '?' | ':' | '-' if followed_by_whitespace => block_indicators = true,
                _ => {}
            }
        } else {
            match c {
                ':' if followed_by_whitespace => block_indicators = true,
                '#' if preceded_by_whitespace => block_indicators = true,
                _ => {}
            }
        }
        if c == '\t' {
            tabs = true;
        } else if !is_printable(c) {
            special = true;
        }
        if c == ' ' {
            if previous_break {
                break_space = true;
            }
            previous_space = true;
            previous_break = false;
        } else if is_break(c) {
            line_breaks = true;
            if previous_space {
                space_break = true;
            }
            previous_space = false;
            previous_break = true;
        } else {
            previous_space = false;
            previous_break = false;
        }
        preceded_by_whitespace = matches!(c, ' ' | '\t' | '\0') || is_break(c);
    }
    let leading_space = chars[0] == ' ';
    let trailing_space = chars[last] == ' ';
    let edge_break = is_break(chars[0]) || is_break(chars[last]);
    Analysis {
        block_plain_allowed: !(leading_space
            || trailing_space
            || edge_break
            || break_space
            || space_break
            || tabs
            || special
            || line_breaks
            || block_indicators),
        single_quoted_allowed: !(break_space || space_break || tabs || special),
        block_allowed: !(trailing_space || space_break || special),
    }
}

fn write_inline(out: &mut String, s: &str, style: Style) {
    match style {
        Style::Plain => out.push_str(s),
        Style::Single => {
            out.push('\'');
            out.push_str(&s.replace('\'', "''"));
            out.push('\'');
        }
        Style::Double | Style::Literal => write_double_quoted(out, s),
    }
}

fn write_double_quoted(out: &mut String, s: &str) {
    // Go's BOM test looks at the string's first bytes, not the current
    // character: text that starts with a BOM gets every character escaped.
    let escape_all = s.starts_with('\u{feff}');
    out.push('"');
    for c in s.chars() {
        if !escape_all && is_printable(c) && !is_break(c) && c != '"' && c != '\\' {
            out.push(c);
            continue;
        }
        out.push('\\');
        match c {
            '\0' => out.push('0'),
            '\u{7}' => out.push('a'),
            '\u{8}' => out.push('b'),
            '\t' => out.push('t'),
            '\n' => out.push('n'),
            '\u{b}' => out.push('v'),
            '\u{c}' => out.push('f'),
            '\r' => out.push('r'),
            '\u{1b}' => out.push('e'),
            '"' => out.push('"'),
            '\\' => out.push('\\'),
            '\u{85}' => out.push('N'),
            '\u{a0}' => out.push('_'),
            '\u{2028}' => out.push('L'),
            '\u{2029}' => out.push('P'),
            c if (c as u32) <= 0xFF => out.push_str(&format!("x{:02X}", c as u32)),
            c if (c as u32) <= 0xFFFF => out.push_str(&format!("u{:04X}", c as u32)),
            c => out.push_str(&format!("U{:08X}", c as u32)),
        }
    }
    out.push('"');
}

/// Go's `strconv.FormatFloat(f, 'g', -1, 64)` with YAML's names for the
/// non-finite values: shortest digits, exponent form below 1e-4 or from 1e6.
pub(crate) fn go_float(f: f64) -> String {
    if f.is_nan() {
        return ".nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { ".inf" } else { "-.inf" }.into();
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0" } else { "0" }.into();
    }
    // Rust's `{:e}` yields the same shortest round-trip digits Go uses.
    let sci = format!("{:e}", f.abs());
    let (mantissa, exp) = sci.split_once('e').expect("{:e} always has an exponent");
    let exp: i32 = exp.parse().expect("{:e} exponent is an integer");
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let sign = if f < 0.0 { "-" } else { "" };
    if !(-4..6).contains(&exp) {
        let (head, tail) = digits.split_at(1);
        let dot = if tail.is_empty() { "" } else { "." };
        let esign = if exp < 0 { '-' } else { '+' };
        return format!("{sign}{head}{dot}{tail}e{esign}{:02}", exp.abs());
    }
    let nd = digits.len() as i32;
    if exp < 0 {
        let zeros = "0".repeat((-exp - 1) as usize);
        format!("{sign}0.{zeros}{digits}")
    } else if exp + 1 >= nd {
        format!("{sign}{digits}{}", "0".repeat((exp + 1 - nd) as usize))
    } else {
        let (int, frac) = digits.split_at((exp + 1) as usize);
        format!("{sign}{int}.{frac}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(value: Node) -> String {
        emit_document(&[("k".into(), value)]).unwrap()
    }

    fn s(v: &str) -> Node {
        Node::Str(v.into())
    }

    #[test]
    fn plain_strings_stay_bare() {
        for v in [
            "-talos.halt_if_installed",
            "a#b",
            "console=ttyS0,115200n8",
            "ip=10.0.0.2::10.0.0.1:255.255.255.0:host:eth0:off",
            "é",
            ".",
            "+",
        ] {
            assert_eq!(doc(s(v)), format!("k: {v}\n"));
        }
    }

    #[test]
    fn strings_that_read_as_other_types_are_double_quoted() {
        for v in [
            "true",
            "123",
            "1.5",
            "0x10",
            "~",
            "null",
            "",
            "+1",
            "2001-12-14",
            "yes",
            "1:20",
        ] {
            assert_eq!(doc(s(v)), format!("k: \"{v}\"\n"));
        }
    }

    #[test]
    fn strings_with_tabs_or_control_characters_are_escaped() {
        assert_eq!(doc(s("a\tb")), "k: \"a\\tb\"\n");
        assert_eq!(doc(s("a\r")), "k: \"a\\r\"\n");
        assert_eq!(doc(s("\u{1F600}")), "k: \"\\U0001F600\"\n");
        assert_eq!(doc(s("a\u{1}\"\\")), "k: \"a\\x01\\\"\\\\\"\n");
        assert_eq!(doc(s("\u{feff}x \t")), "k: \"\\uFEFF\\x78\\x20\\t\"\n");
        assert_eq!(doc(s("x\u{feff}")), "k: \"x\\uFEFF\"\n");
    }

    #[test]
    fn refused_plain_strings_are_single_quoted() {
        for (v, want) in [
            ("{a", "'{a'"),
            ("[a", "'[a'"),
            ("@x", "'@x'"),
            ("*x", "'*x'"),
            ("!x", "'!x'"),
            ("%x", "'%x'"),
            ("'x", "'''x'"),
            ("a: b", "'a: b'"),
            ("a #b", "'a #b'"),
            ("- a", "'- a'"),
            ("? a", "'? a'"),
            (" lead", "' lead'"),
            ("trail ", "'trail '"),
            ("---x", "'---x'"),
            ("it's: x", "'it''s: x'"),
        ] {
            assert_eq!(doc(s(v)), format!("k: {want}\n"), "for {v:?}");
        }
    }

    #[test]
    fn multi_line_strings_use_literal_blocks_with_chomping() {
        assert_eq!(doc(s("a\nb")), "k: |-\n    a\n    b\n");
        assert_eq!(doc(s("a\nb\n")), "k: |\n    a\n    b\n");
        assert_eq!(doc(s("a\n\n")), "k: |+\n    a\n\n");
        assert_eq!(doc(s("a\n\nb")), "k: |-\n    a\n\n    b\n");
        assert_eq!(doc(s(" a\nb")), "k: |4-\n     a\n    b\n");
        assert_eq!(doc(s("\na")), "k: |4-\n\n    a\n");
        assert_eq!(doc(s("t\tx\ny")), "k: |-\n    t\tx\n    y\n");
    }

    #[test]
    fn multi_line_strings_that_blocks_cannot_hold_are_double_quoted() {
        assert_eq!(doc(s("x\n ")), "k: \"x\\n \"\n");
        assert_eq!(doc(s("x \ny")), "k: \"x \\ny\"\n");
        assert_eq!(doc(s("x\r\ny")), "k: \"x\\r\\ny\"\n");
        // Whitespace-only text is never a literal block (rc.4's rule).
        assert_eq!(doc(s("\n")), "k: \"\\n\"\n");
        assert_eq!(doc(s("\n\t\n")), "k: \"\\n\\t\\n\"\n");
    }

    #[test]
    fn literal_content_goes_to_the_next_multiple_of_four() {
        let item = Node::Map(vec![
            ("key".into(), Node::Raw("10".into())),
            ("value".into(), s("a: 1\n")),
        ]);
        let out = emit_document(&[(
            "customization".into(),
            Node::Map(vec![("meta".into(), Node::Seq(vec![item]))]),
        )])
        .unwrap();
        assert_eq!(
            out,
            "customization:\n    meta:\n        - key: 10\n          value: |\n            a: 1\n"
        );
    }

    #[test]
    fn sequences_nest_two_columns_after_the_dash() {
        let out = doc(Node::Seq(vec![
            Node::Seq(vec![s("a"), s("b")]),
            Node::Map(vec![("j".into(), s("w")), ("k".into(), s("v"))]),
            s("x\ny"),
        ]));
        assert_eq!(
            out,
            "k:\n    - - a\n      - b\n    - j: w\n      k: v\n    - |-\n      x\n      y\n"
        );
    }

    #[test]
    fn empty_collections_are_flow_style() {
        assert_eq!(emit_document(&[]).unwrap(), "{}\n");
        assert_eq!(doc(Node::Map(vec![])), "k: {}\n");
        assert_eq!(doc(Node::Seq(vec![])), "k: []\n");
    }

    #[test]
    fn keys_are_styled_like_values_but_never_as_blocks() {
        let out = emit_document(&[("y".into(), Node::Raw("1".into()))]).unwrap();
        assert_eq!(out, "\"y\": 1\n");
        assert!(matches!(
            emit_document(&[("a\nb".into(), Node::Raw("1".into()))]),
            Err(EmitError::ComplexKey(_))
        ));
        assert!(matches!(
            emit_document(&[("x".repeat(129), Node::Raw("1".into()))]),
            Err(EmitError::ComplexKey(_))
        ));
    }

    #[test]
    fn line_separators_are_refused() {
        assert!(matches!(
            scalar_style("a\u{2028}b", false),
            Err(EmitError::LineSeparator(_))
        ));
    }

    #[test]
    fn floats_follow_go_shortest_g_format() {
        for (f, want) in [
            (1.5, "1.5"),
            (1e6, "1e+06"),
            (123456.0, "123456"),
            (1e-5, "1e-05"),
            (0.001, "0.001"),
            (1.0, "1"),
            (-2.5e-7, "-2.5e-07"),
            (1e20, "1e+20"),
            (1234567.0, "1.234567e+06"),
            (100000.0, "100000"),
            (1.234e-5, "1.234e-05"),
            (0.0, "0"),
            (f64::INFINITY, ".inf"),
            (f64::NEG_INFINITY, "-.inf"),
            (f64::NAN, ".nan"),
        ] {
            assert_eq!(go_float(f), want, "for {f}");
        }
    }
}
