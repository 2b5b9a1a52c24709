//! Kernel arguments as words of the two boot-script languages imgbuild
//! writes kernel lines in, iPXE and GRUB script, and of the kernel's own
//! command line. Text from outside (the factory's command line, an
//! inventory's `kernelArgs`, a base ISO's `grub.cfg`) becomes script here
//! only as words that each language reads back as exactly those words, or
//! it is refused. Pure functions; each language has a small reader written
//! from its upstream rules, so tests can check that what is written is what
//! is read.
//!
//! - iPXE (ipxe `src/core/exec.c` `split_command`, `command_terminator`,
//!   `src/core/settings.c` `expand_settings`, `src/image/script.c`
//!   `process_script`): no quoting at all. Words are split at `isspace`; a
//!   word `;`, `&&` or `||` ends the command, a word starting with `#` starts
//!   a comment, `${…}` is expanded in every word (repeatedly; unknown names
//!   become empty), a line ending in `\` continues on the next one. So a
//!   word holding any of these is refused, never escaped. Options are parsed
//!   only before the first non-option (`src/core/getopt.c`), and the kernel
//!   URL comes first.
//! - GRUB script (grub `grub-core/script/yylex.l`, `docs/grub.texi`
//!   "Shell-like scripting"): `'…'` quotes everything but `'`, so any word
//!   without control characters can be written; a safe word stays bare.
//! - The kernel (linux `lib/cmdline.c` `next_arg`) splits at spaces outside
//!   `"…"`, and GRUB's `linux` re-quotes a word with a space in `"…"` and
//!   escapes `"` with `\`, which the kernel does not undo: a `"` inside a
//!   word can swallow every later argument, META included.

use std::fmt;

/// The kernel-argument prefix of META (siderolabs/talos
/// `pkg/imager/imager.go`); a second one would compete with the node's.
pub const META_MARKER: &str = "INSTALLER_META_BASE64";

/// Why a word cannot be written into a script as one argument.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    /// The word, as given (shown escaped and bounded).
    pub word: String,
    pub why: &'static str,
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shown: String = self.word.chars().take(80).collect();
        let more = if shown.len() < self.word.len() {
            "…"
        } else {
            ""
        };
        write!(f, "argument {shown:?}{more}: {}", self.why)
    }
}

impl std::error::Error for Refused {}

fn refuse(word: &str, why: &'static str) -> Refused {
    Refused {
        word: word.to_owned(),
        why,
    }
}

/// iPXE's `isspace` (ipxe `src/core/ctype.c`).
fn ipxe_space(c: char) -> bool {
    matches!(c, ' ' | '\x0c' | '\n' | '\r' | '\t' | '\x0b')
}

/// Why the kernel itself would not read `word` as one argument, or would
/// see a second META in it.
fn kernel_problem(word: &str) -> Option<&'static str> {
    if word.is_empty() {
        Some("empty")
    } else if word.chars().any(char::is_control) {
        Some("holds a control character")
    } else if word.contains('"') {
        Some("holds a double quote, which changes how the kernel splits every later argument")
    } else if word.contains(META_MARKER) {
        Some("is a second META argument; the node's META must be the only one")
    } else {
        None
    }
}

/// Why iPXE would not read `word` back as one literal argument.
fn ipxe_problem(word: &str) -> Option<&'static str> {
    if word.chars().any(ipxe_space) {
        Some("holds whitespace, which iPXE splits on and cannot quote")
    } else if matches!(word, ";" | "&&" | "||") {
        Some("ends the command in iPXE (a command separator)")
    } else if word.starts_with('#') {
        Some("starts a comment in iPXE and GRUB, dropping every later argument")
    } else if word.contains("${") {
        Some("is expanded by iPXE (${…} settings cannot be quoted)")
    } else if word.ends_with('\\') {
        Some("ends in a backslash, which continues an iPXE line")
    } else {
        None
    }
}

/// Checks a kernel argument from the inventory: one that every boot medium
/// imgbuild writes (iPXE, GRUB, the kernel) carries as exactly itself.
pub fn check_kernel_arg(word: &str) -> Result<(), Refused> {
    if let Some(why) = kernel_problem(word).or_else(|| ipxe_problem(word)) {
        return Err(refuse(word, why));
    }
    if word.contains(['\'', '\\']) {
        return Err(refuse(
            word,
            "holds a quote or backslash, which GRUB passes to the kernel escaped",
        ));
    }
    Ok(())
}

/// The kernel's arguments in a command line the factory gave: split at
/// whitespace, each checked for iPXE and the kernel. A `"` is refused, so
/// the kernel splits the same way.
pub fn split_cmdline(cmdline: &str) -> Result<Vec<&str>, Refused> {
    let words: Vec<&str> = cmdline
        .split(ipxe_space)
        .filter(|w| !w.is_empty())
        .collect();
    for w in &words {
        if let Some(why) = kernel_problem(w).or_else(|| ipxe_problem(w)) {
            return Err(refuse(w, why));
        }
    }
    Ok(words)
}

/// One iPXE command line of `words` (the command and its arguments), each
/// checked to read back as itself.
pub fn ipxe_line(words: &[&str]) -> Result<String, Refused> {
    for w in words {
        if w.is_empty() {
            return Err(refuse(w, "empty (iPXE drops empty words)"));
        }
        if w.chars().any(char::is_control) {
            return Err(refuse(w, "holds a control character"));
        }
        if let Some(why) = ipxe_problem(w) {
            return Err(refuse(w, why));
        }
    }
    Ok(words.join(" "))
}

/// The commands an iPXE script runs, each as its arguments after
/// expansion, with every setting unset (as iPXE reads them: lines joined
/// at a trailing `\`, a trailing CR dropped, a `:label` skipped, comments
/// dropped, `;`/`&&`/`||` between commands, `${…}` expanded to nothing).
/// The `#!ipxe` line is a comment like any other.
pub fn ipxe_read(script: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut line = String::new();
    for raw in script.split('\n') {
        let raw = raw.strip_suffix('\r').unwrap_or(raw);
        if let Some(cont) = raw.strip_suffix('\\') {
            line.push_str(cont);
            continue;
        }
        line.push_str(raw);
        let mut command = line.trim_start_matches(ipxe_space);
        if let Some(label) = command.strip_prefix(':') {
            command = label.find(ipxe_space).map_or("", |at| &label[at..]);
        }
        let mut argv = Vec::new();
        for token in command.split(ipxe_space).filter(|t| !t.is_empty()) {
            if token.starts_with('#') {
                break;
            }
            if matches!(token, ";" | "&&" | "||") {
                out.push(std::mem::take(&mut argv));
                continue;
            }
            argv.push(ipxe_expand(token));
        }
        out.push(argv);
        line.clear();
    }
    out.retain(|c| !c.is_empty());
    out
}

/// `expand_settings` with every setting unset: the last `${` before the
/// first `}` after it goes, with its name, until none is left.
fn ipxe_expand(token: &str) -> String {
    let mut s = token.to_owned();
    loop {
        let mut start = None;
        let mut end = None;
        let b = s.as_bytes();
        for i in 0..b.len() {
            if b[i] == b'$' && b.get(i + 1) == Some(&b'{') {
                start = Some(i);
            }
            if start.is_some() && b[i] == b'}' {
                end = Some(i);
                break;
            }
        }
        match (start, end) {
            (Some(a), Some(z)) => s.replace_range(a..=z, ""),
            _ => return s,
        }
    }
}

/// GRUB's reserved words (grub `grub-core/script/yylex.l`): bare, they are
/// keywords, so they are written quoted.
const GRUB_RESERVED: [&str; 17] = [
    "case", "do", "done", "elif", "else", "esac", "fi", "for", "if", "in", "select", "then",
    "until", "while", "function", "[[", "]]",
];

/// Whether a character stands for itself in a bare GRUB word and in every
/// wildcard translator (no `*`, `?`, `[`).
fn grub_bare(c: char) -> bool {
    c.is_ascii_alphanumeric()
        || matches!(c, '_' | '-' | '.' | '/' | ':' | '=' | ',' | '+' | '@' | '%')
}

/// `word` as one GRUB script word: bare when it can be, else in `'…'`
/// (a `'` itself as `'\''`). Control characters are refused: GRUB would
/// read a newline as the end of a command.
pub fn grub_quote(word: &str) -> Result<String, Refused> {
    if word.chars().any(char::is_control) {
        return Err(refuse(word, "holds a control character"));
    }
    if !word.is_empty() && word.chars().all(grub_bare) && !GRUB_RESERVED.contains(&word) {
        return Ok(word.to_owned());
    }
    Ok(format!("'{}'", word.replace('\'', r"'\''")))
}

/// One GRUB command line of `words`, each quoted as [`grub_quote`] does.
pub fn grub_line(words: &[&str]) -> Result<String, Refused> {
    let quoted: Result<Vec<String>, Refused> = words.iter().map(|w| grub_quote(w)).collect();
    Ok(quoted?.join(" "))
}

/// Why a line of GRUB script is not one simple command of literal words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrubLineError {
    #[error("{0:?} joins or ends commands")]
    Operator(&'static str),
    #[error("a {0:?} block")]
    Block(char),
    #[error("a variable (${{…}}) is expanded")]
    Variable,
    #[error("an unquoted {0:?} is a wildcard")]
    Wildcard(char),
    #[error("a quote is not closed on its line")]
    OpenQuote,
    #[error("it continues on the next line")]
    Continued,
    #[error("it holds a control character")]
    Control,
}

/// The words of one line of GRUB script, as GRUB passes them to the
/// command, or why the line is more than one simple command of literal
/// words (grub `grub-core/script/yylex.l`: blanks are space and tab, a
/// word-initial `#` comments out the rest, `\` escapes one character,
/// `'…'` is literal, `"…"` undoes `\$`, `\\` and `\"` only).
pub fn grub_read_line(line: &str) -> Result<Vec<String>, GrubLineError> {
    let mut words = Vec::new();
    let mut chars = line.chars().peekable();
    loop {
        while chars.next_if(|c| matches!(c, ' ' | '\t')).is_some() {}
        let Some(&c) = chars.peek() else {
            return Ok(words);
        };
        match c {
            '#' => return Ok(words),
            ';' | '&' | '|' | '<' | '>' => {
                chars.next();
                let two = chars.next_if(|n| matches!((c, n), ('|', '|') | ('&', '&') | (';', ';')));
                return Err(GrubLineError::Operator(match (c, two) {
                    ('|', Some(_)) => "||",
                    ('&', Some(_)) => "&&",
                    (';', Some(_)) => ";;",
                    ('|', None) => "|",
                    ('&', None) => "&",
                    (';', None) => ";",
                    ('<', _) => "<",
                    _ => ">",
                }));
            }
            _ => {}
        }
        let mut word = String::new();
        while let Some(&c) = chars.peek() {
            match c {
                ' ' | '\t' => break,
                ';' | '&' | '|' | '<' | '>' => break,
                '{' | '}' => return Err(GrubLineError::Block(c)),
                '$' => return Err(GrubLineError::Variable),
                '*' | '?' | '[' | ']' => return Err(GrubLineError::Wildcard(c)),
                c if c.is_control() => return Err(GrubLineError::Control),
                '\\' => {
                    chars.next();
                    match chars.next() {
                        None => return Err(GrubLineError::Continued),
                        Some(n) if n.is_control() => return Err(GrubLineError::Control),
                        Some(n) => word.push(n),
                    }
                }
                '\'' => {
                    chars.next();
                    loop {
                        match chars.next() {
                            None => return Err(GrubLineError::OpenQuote),
                            Some('\'') => break,
                            Some(n) if n.is_control() => return Err(GrubLineError::Control),
                            Some(n) => word.push(n),
                        }
                    }
                }
                '"' => {
                    chars.next();
                    loop {
                        match chars.next() {
                            None => return Err(GrubLineError::OpenQuote),
                            Some('"') => break,
                            Some('$') => return Err(GrubLineError::Variable),
                            Some('\\') => match chars.next() {
                                None => return Err(GrubLineError::Continued),
                                Some(n @ ('$' | '\\' | '"')) => word.push(n),
                                Some(n) if n.is_control() => return Err(GrubLineError::Control),
                                Some(n) => {
                                    word.push('\\');
                                    word.push(n);
                                }
                            },
                            Some(n) if n.is_control() => return Err(GrubLineError::Control),
                            Some(n) => word.push(n),
                        }
                    }
                }
                c => {
                    chars.next();
                    word.push(c);
                }
            }
        }
        words.push(word);
    }
}

/// Why a word GRUB reads from a base ISO's kernel line would not reach the
/// kernel as one argument, or is a second META.
pub fn check_grub_kernel_word(word: &str) -> Result<(), Refused> {
    match kernel_problem(word) {
        Some(why) => Err(refuse(word, why)),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOSTILE: [&str; 12] = [
        ";",
        "&&",
        "||",
        "#",
        "#x",
        "${net0/mac}",
        "a${x}b",
        "a b",
        "a\tb",
        "tail\\",
        "x\ny",
        "q\"uote",
    ];

    #[test]
    fn ipxe_refuses_every_word_its_shell_would_not_read_as_itself() {
        for w in HOSTILE {
            let e = ipxe_line(&["kernel", "http://x/k", w]);
            // A double quote is fine for iPXE; the kernel refuses it.
            if w == "q\"uote" {
                assert!(e.is_ok());
                assert!(split_cmdline(w).is_err());
                continue;
            }
            assert!(e.is_err(), "{w:?}");
        }
        for w in [
            "a#b", "a;b", "a&&b", "$x", "$", "{x}", "}", "a\\b", "x=1", "-", "--name=y",
        ] {
            let line = ipxe_line(&["kernel", "u", w]).unwrap();
            assert_eq!(ipxe_read(&line), [vec!["kernel", "u", w]], "{w:?}");
        }
    }

    #[test]
    fn the_ipxe_reader_follows_exec_c() {
        let s =
            "#!ipxe\n  kernel u a ; chain x || shell && y # z\n:l echo ${a}${b}c\ninitrd \\\ni\r\n";
        assert_eq!(
            ipxe_read(s),
            [
                vec!["kernel", "u", "a"],
                vec!["chain", "x"],
                vec!["shell"],
                vec!["y"],
                vec!["echo", "c"],
                vec!["initrd", "i"],
            ]
        );
        assert_eq!(ipxe_expand("$${x}{y}}"), "}");
        assert_eq!(ipxe_expand("${"), "${");
    }

    #[test]
    fn a_factory_command_line_is_split_and_checked() {
        assert_eq!(
            split_cmdline(" talos.platform=metal  console=ttyS0\t").unwrap(),
            ["talos.platform=metal", "console=ttyS0"]
        );
        for bad in [
            "a ; chain http://evil/x",
            "a && shell",
            "a || shell ||",
            "a #",
            "a ${x}",
            "talos.environment=INSTALLER_META_BASE64=AA==",
            "a \"b c\"",
        ] {
            assert!(split_cmdline(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn inventory_kernel_args_must_survive_every_medium() {
        for bad in [
            "#", "#a", ";", "&&", "||", "${x}", "a b", "", "x\"y", "x'y", "x\\y", "\u{7}",
        ] {
            let e = check_kernel_arg(bad).unwrap_err();
            assert!(!e.to_string().contains('\u{7}'), "{e}");
        }
        for good in ["console=ttyS0", "a#b", "x=$y", "net.ifnames=0", "-x"] {
            check_kernel_arg(good).unwrap();
        }
    }

    #[test]
    fn grub_quotes_what_is_not_bare_and_reads_it_back() {
        assert_eq!(grub_quote("console=ttyS0").unwrap(), "console=ttyS0");
        assert_eq!(grub_quote("a b").unwrap(), "'a b'");
        assert_eq!(grub_quote("it's").unwrap(), r"'it'\''s'");
        assert_eq!(grub_quote("if").unwrap(), "'if'");
        assert_eq!(grub_quote("").unwrap(), "''");
        assert!(grub_quote("a\nb").is_err());
        for w in [
            ";", "#", "${x}", "$x", "a'b", "\"", "\\", "{", "}", "*", "[", "&&", "||", "|", "<",
            ">", "if", "",
        ] {
            let line = grub_line(&["linux", "/k", w]).unwrap();
            assert_eq!(grub_read_line(&line).unwrap(), ["linux", "/k", w], "{w:?}");
        }
    }

    #[test]
    fn the_grub_reader_follows_yylex() {
        assert_eq!(
            grub_read_line("\tlinux /k a\\ b 'c d' \"e\\\"f\\g\" h#i # j").unwrap(),
            ["linux", "/k", "a b", "c d", "e\"f\\g", "h#i"]
        );
        use GrubLineError::*;
        for (line, e) in [
            ("linux /k a; chain x", Operator(";")),
            ("linux /k a || shell", Operator("||")),
            ("linux /k && x", Operator("&&")),
            ("linux /k $x", Variable),
            ("linux /k \"${x}\"", Variable),
            ("linux /k 'a", OpenQuote),
            ("linux /k a\\", Continued),
            ("linux /k *", Wildcard('*')),
            ("linux /k {", Block('{')),
        ] {
            assert_eq!(grub_read_line(line), Err(e), "{line:?}");
        }
        assert_eq!(grub_read_line("linux /k # a").unwrap(), ["linux", "/k"]);
    }

    #[test]
    fn fuzz_ipxe_and_grub_lines_read_back_as_the_words_given() {
        use proptest::prelude::*;
        let word = proptest::string::string_regex("[ -~\t\u{a0}é#;&|$\\{}'\"]{0,12}").unwrap();
        proptest!(crate::fuzz_config(), |(words in proptest::collection::vec(word, 0..8))| {
            if !crate::fuzz_time_left() { return Ok(()); }
            let mut all = vec!["kernel".to_owned(), "http://x/k".to_owned()];
            all.extend(words.iter().cloned());
            let refs: Vec<&str> = all.iter().map(String::as_str).collect();
            if let Ok(line) = ipxe_line(&refs) {
                prop_assert_eq!(ipxe_read(&line), vec![all.clone()]);
            } else {
                prop_assert!(words.iter().any(|w| w.is_empty() || ipxe_problem(w).is_some()));
            }
            match grub_line(&refs) {
                Ok(line) => prop_assert_eq!(grub_read_line(&line).unwrap(), all.clone()),
                Err(e) => prop_assert!(e.word.chars().any(char::is_control)),
            }
            // What the factory may say: either refused, or every word is
            // one kernel argument and one iPXE word.
            let cmdline = words.join(" ");
            if let Ok(split) = split_cmdline(&cmdline) {
                let mut line = vec!["kernel", "http://x/k"];
                line.extend(split.iter().copied());
                line.push("talos.environment=INSTALLER_META_BASE64=AA==");
                let text = ipxe_line(&line).unwrap();
                let read = ipxe_read(&text);
                prop_assert_eq!(read.len(), 1);
                prop_assert_eq!(read[0].iter().filter(|w| w.contains(META_MARKER)).count(), 1);
                prop_assert_eq!(read[0].last().unwrap(), "talos.environment=INSTALLER_META_BASE64=AA==");
            }
        });
    }
}
