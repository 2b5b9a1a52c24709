//! What every command shares for its results: the output format, the
//! errors that choose the exit code, and the one place where text is
//! written. Every line on stdout and stderr passes [`shown`]: secrets
//! become `<redacted: NAME>` (the one redaction set, `imgbuild::secrets`)
//! and control characters from outside are escaped, so neither a node's
//! reply nor an environment value reaches the terminal raw. A leaf of the
//! cli module graph: commands import it, it imports none of them.

use imgbuild::secrets::protect::{self, Stamp};
use imgbuild::secrets::redact::Redactions;
use serde_json::json;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{PoisonError, RwLock};

/// `println!` that ends the program the way other tools end when their
/// reader went away (`imgbuild … | head -1`), instead of panicking: every
/// line the CLI prints goes through [`stdout_write`], which escapes and
/// redacts it.
macro_rules! outln {
    () => {
        $crate::cli::output::stdout_write(b"\n")
    };
    ($($arg:tt)*) => {
        $crate::cli::output::stdout_write(format!("{}\n", format_args!($($arg)*)).as_bytes())
    };
}

/// `print!` through [`stdout_write`], as [`outln!`].
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::cli::output::stdout_write(format!($($arg)*).as_bytes())
    };
}

/// A stderr line (std's `eprintln`) through [`stderr_line`]: escaped, redacted, and a stderr
/// that cannot be written loses the line instead of panicking.
macro_rules! errln {
    ($($arg:tt)*) => {
        $crate::cli::output::stderr_line("", &format!($($arg)*))
    };
}

/// Stderr text without a newline (a prompt) through [`stderr_text`], as [`errln!`].
macro_rules! err {
    ($($arg:tt)*) => {
        $crate::cli::output::stderr_text(&format!($($arg)*))
    };
}

/// What a command writes: text for people, or one JSON document (which
/// [`stdout_write`] turns into YAML under `--output yaml`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Output {
    Text,
    Json,
}

/// `--output`: text for people, json or yaml for CI and scripts, markdown
/// for a pull-request comment. Commands see only [`Output`]: YAML is their
/// JSON document, rendered here; Markdown is text mode (errors and progress
/// on stderr) whose stdout the commands in [`MARKDOWN_COMMANDS`] write as
/// Markdown (see [`markdown`]).
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Text,
    Json,
    Yaml,
    Markdown,
}

impl Format {
    /// What the command itself writes under this format.
    pub fn commands(self) -> Output {
        match self {
            Format::Text | Format::Markdown => Output::Text,
            Format::Json | Format::Yaml => Output::Json,
        }
    }
}

/// The commands that write `--output markdown`; any other refuses it (exit 2).
pub const MARKDOWN_COMMANDS: &str = "`up` and `replace` (with or without --dry-run)";

/// A failure whose details the command already printed (e.g. as its JSON
/// result): exit 1 with a one-line summary in text mode, nothing more in JSON.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Reported(pub String);

/// Some nodes done, some failed, details already printed: exit 3.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Partial(pub String);

/// A command line, inventory or environment that asks for something
/// imgbuild cannot do: exit 2, as clap's own usage errors.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Usage(pub String);

/// Under `--detailed-exitcode` (Terraform's): a dry run that plans
/// changes, or `status --check` that finds drift, details already printed:
/// exit 4, apart from 0 (nothing to do) and 1 (could not tell).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Changes(pub String);

/// The documented exit codes: 0 ok, 1 failure, 2 usage error or invalid
/// inventory, 3 partial, 4 changes planned or drift (`--detailed-exitcode`).
pub const EXIT_FAILURE: i32 = 1;
pub const EXIT_USAGE: i32 = 2;
pub const EXIT_PARTIAL: i32 = 3;
pub const EXIT_CHANGES: i32 = 4;

/// Every secret value known to this process (see [`redact_also`]), and
/// the state dirs whose files add theirs whenever they change.
static REDACTIONS: RwLock<Known> = RwLock::new(Known {
    set: None,
    watched: Vec::new(),
});

struct Known {
    set: Option<Redactions>,
    watched: Vec<(PathBuf, Stamp)>,
}

impl Known {
    fn add(&mut self, name: &str, value: &str) {
        self.set
            .get_or_insert_with(Redactions::default)
            .add(name, value);
    }

    /// Reads again the secret files of every watched dir that changed
    /// since (a bundle generated mid-run, a kubeconfig just fetched).
    fn refresh(&mut self) {
        let mut found = Vec::new();
        for (dir, stamp) in &mut self.watched {
            let now = Stamp::of(dir);
            if now != *stamp {
                found.extend(protect::state_secrets(dir));
                *stamp = now;
            }
        }
        for (name, value) in found {
            self.add(&name, &value);
        }
    }
}

/// `--show-secrets` granted: nothing is redacted.
static SHOW_SECRETS: AtomicBool = AtomicBool::new(false);
/// stdout holds one JSON document (`--output json`): escapes there must be
/// JSON's.
static STDOUT_JSON: AtomicBool = AtomicBool::new(false);
/// `--output yaml`: each JSON document written becomes a YAML document.
static STDOUT_YAML: AtomicBool = AtomicBool::new(false);
/// `--output markdown`: the command writes its summary as Markdown.
static STDOUT_MARKDOWN: AtomicBool = AtomicBool::new(false);
/// YAML documents written so far: every one after the first starts with `---`.
static YAML_DOCUMENTS: AtomicUsize = AtomicUsize::new(0);

/// `--debug`: the library's request log goes to stderr.
static DEBUG: AtomicBool = AtomicBool::new(false);

/// Notes that `--debug` writes the library's request log on stderr (the
/// CLI points `imgbuild::net::debug_to` at [`stderr_line`]).
pub fn debug_log() {
    DEBUG.store(true, Ordering::Relaxed);
}

/// Whether `--debug` writes its request log on stderr.
pub fn debugging() -> bool {
    DEBUG.load(Ordering::Relaxed)
}

/// Fixes how stdout is written, once, before any command runs.
pub fn init(format: Format, show_secrets: bool) {
    STDOUT_JSON.store(format.commands() == Output::Json, Ordering::Relaxed);
    STDOUT_YAML.store(format == Format::Yaml, Ordering::Relaxed);
    STDOUT_MARKDOWN.store(format == Format::Markdown, Ordering::Relaxed);
    SHOW_SECRETS.store(show_secrets, Ordering::Relaxed);
}

/// Whether `--output markdown` was asked for: the commands that take it
/// write their summary with [`md_code`] instead of their text lines.
pub fn markdown() -> bool {
    STDOUT_MARKDOWN.load(Ordering::Relaxed)
}

/// The `--output markdown` refusal of every command but [`MARKDOWN_COMMANDS`].
pub fn markdown_refused() -> Usage {
    Usage(format!(
        "--output markdown is written only by {MARKDOWN_COMMANDS} (a plan or run summary for a pull-request comment); use text, json or yaml here"
    ))
}

/// A string from outside (a version, a patch name, a node's message) as
/// one Markdown code span: at most `max` characters, one line (control
/// characters and newlines escaped as `\n`, so it cannot start a row),
/// fenced by more backticks than any run inside it, and in a GFM table
/// `cell` every `|` escaped so it cannot end the cell. Inside
/// a code span nothing else is markup: no emphasis, link, HTML tag,
/// @mention or issue reference. Secrets are redacted first, as in
/// [`shown`]. Empty text is `""`.
pub fn md_code(text: &str, max: usize, cell: bool) -> String {
    // Redacted before it is cut or escaped: either would hide a secret
    // from the redaction of the whole line.
    let mut line = imgbuild::input::one_line(&redacted(text), max);
    if cell {
        line = line.replace('|', "\\|");
    }
    if line.is_empty() {
        return "`\"\"`".to_owned();
    }
    let mut longest = 0;
    let mut run = 0;
    for c in line.chars() {
        run = if c == '`' { run + 1 } else { 0 };
        longest = longest.max(run);
    }
    let fence = "`".repeat(longest + 1);
    // CommonMark strips one space from each end when both are there: pad
    // when the text itself starts or ends with a backtick or a space.
    let pad = if line.starts_with(['`', ' ']) || line.ends_with(['`', ' ']) {
        " "
    } else {
        ""
    };
    format!("{fence}{pad}{line}{pad}{fence}")
}

/// A word from outside as Markdown: as it is when it is plain (letters,
/// digits, spaces and `-.,()` only, no `www.` a renderer would link), else
/// as [`md_code`] makes it (for a table `cell` or not).
pub fn md_word(text: &str, max: usize, cell: bool) -> String {
    let text = redacted(text);
    let plain = !text.is_empty()
        && text.chars().count() <= max
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || " -.,()".contains(c))
        && !text.to_ascii_lowercase().contains("www.")
        && !text.starts_with(' ')
        && !text.ends_with(' ');
    if plain {
        text.into_owned()
    } else {
        md_code(&text, max, cell)
    }
}

/// Adds a secret to the set every later line is redacted against.
pub fn redact_also(name: &str, value: &str) {
    let mut known = REDACTIONS.write().unwrap_or_else(PoisonError::into_inner);
    known.add(name, value);
}

/// Adds the secrets the files of state dir `dir` hold, now and whenever
/// they change.
pub fn redact_state_dir(dir: &Path) {
    let mut known = REDACTIONS.write().unwrap_or_else(PoisonError::into_inner);
    if !known.watched.iter().any(|(d, _)| d == dir) {
        known.watched.push((dir.to_owned(), Stamp::default()));
    }
}

/// `text` as it may be shown: secrets redacted (unless `--show-secrets`),
/// then every control character but newline and tab (and what reorders or
/// hides text) escaped, as JSON escapes it in a JSON document
/// (`json`), else as `\u{..}`. Our own colors never pass here (see
/// [`stderr_line`]).
pub fn shown(text: &str, json: bool) -> String {
    let redacted = redacted(text);
    if !json {
        // imgbuild's own lines never hold a CR: a CRLF came from outside
        // and must not start a line of its own.
        let one_line = redacted.replace("\r\n", "\\r\\n");
        return imgbuild::input::escape(&one_line).into_owned();
    }
    // In a JSON document control characters are already escaped inside
    // strings and never occur outside them; the others are spelled `\uXXXX`,
    // which a JSON reader turns back into the same character.
    let mut out = String::with_capacity(redacted.len());
    for c in redacted.chars() {
        if (c.is_control() && c != '\n' && c != '\t') || imgbuild::input::hides_text(c) {
            use std::fmt::Write as _;
            let _ = write!(out, "\\u{:04x}", c as u32);
        } else {
            out.push(c);
        }
    }
    out
}

/// `text` with every known secret redacted, unless `--show-secrets`.
fn redacted(text: &str) -> std::borrow::Cow<'_, str> {
    if SHOW_SECRETS.load(Ordering::Relaxed) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut known = REDACTIONS.write().unwrap_or_else(PoisonError::into_inner);
    known.refresh();
    match known.set.as_ref() {
        Some(set) => std::borrow::Cow::Owned(set.apply(text).into_owned()),
        None => std::borrow::Cow::Borrowed(text),
    }
}

/// A node's config diff as it may be shown: every line that sets a
/// secret field loses its value, known or not, unless `--show-secrets`
/// (the writer then redacts the known values that remain).
pub fn diff(text: &str) -> String {
    if SHOW_SECRETS.load(Ordering::Relaxed) {
        text.to_owned()
    } else {
        imgbuild::secrets::redact::secret_lines(text)
    }
}

/// Text from outside (a node's reply, a factory's string) as one cell of
/// a row: newlines escaped too, so it cannot forge a row, and at most
/// [`OUTSIDE_CHARS`] characters.
pub fn outside(text: &str) -> String {
    imgbuild::input::one_line(text, OUTSIDE_CHARS)
}

/// How much of one string from outside a row shows.
pub const OUTSIDE_CHARS: usize = 200;

/// Writes `bytes` to stdout at once, as [`shown`] makes them. A reader
/// that closed the pipe ends the program as it ends `cat` or `seq`: killed
/// by SIGPIPE, silently, so the shell sees the usual status (141). Rust
/// ignores SIGPIPE so that sockets and child pipes report EPIPE instead;
/// only stdout dies of it. Any other write error (a full disk behind `>`)
/// is one message and exit 1.
pub fn stdout_write(bytes: &[u8]) {
    let mut text = shown(
        &String::from_utf8_lossy(bytes),
        STDOUT_JSON.load(Ordering::Relaxed),
    );
    if STDOUT_YAML.load(Ordering::Relaxed) {
        text = yaml_documents(&text);
    }
    let mut out = std::io::stdout().lock();
    let Err(e) = out.write_all(text.as_bytes()).and_then(|()| out.flush()) else {
        return;
    };
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        // SAFETY: restoring the default action and raising a signal have
        // no memory effects; the default action for SIGPIPE ends the process.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
            libc::raise(libc::SIGPIPE);
        }
    }
    stderr_line("error:", &format!("writing to stdout: {e}"));
    std::process::exit(EXIT_FAILURE);
}

/// One line on stderr: `prefix` as given (ours, possibly colored; empty
/// for none), then `text` as [`shown`] makes it.
pub fn stderr_line(prefix: &str, text: &str) {
    let text = shown(text, false);
    stderr_raw(&if prefix.is_empty() {
        format!("{text}\n")
    } else {
        format!("{prefix} {text}\n")
    });
}

/// `text` on stderr as [`shown`] makes it, without a newline (a prompt).
pub fn stderr_text(text: &str) {
    stderr_raw(&shown(text, false));
}

/// stderr is where a failure would be told, so a stderr that cannot be
/// written (closed, full) loses the text and the command goes on to its
/// own exit code.
fn stderr_raw(text: &str) {
    let mut err = std::io::stderr().lock();
    let _ = err.write_all(text.as_bytes()).and_then(|()| err.flush());
}

/// Failed nodes as the `failed` list of a JSON result.
pub fn failed_json(failures: &[(String, String)]) -> serde_json::Value {
    failures
        .iter()
        .map(|(node, error)| json!({"node": node, "error": error}))
        .collect()
}

/// Failed nodes on stderr, one line each.
pub fn print_failures(failures: &[(String, String)]) {
    for (node, error) in failures {
        errln!("error: node {node}: {error}");
    }
}

/// The JSON documents in `json` (already redacted and escaped by [`shown`])
/// as YAML documents, `---` before every one but the first this process
/// writes. Text that is not JSON stays as it is.
fn yaml_documents(json: &str) -> String {
    let documents: Result<Vec<serde_json::Value>, _> = serde_json::Deserializer::from_str(json)
        .into_iter()
        .collect();
    let Ok(documents) = documents else {
        return json.to_owned();
    };
    let mut out = String::new();
    for document in &documents {
        if YAML_DOCUMENTS.fetch_add(1, Ordering::Relaxed) > 0 {
            out.push_str("---\n");
        }
        out.push_str(&yaml(document));
    }
    out
}

/// One JSON value as a YAML document in block style, read back the same by
/// YAML 1.1 and 1.2 readers alike: a string is plain only when no reader
/// could take it for anything else, a literal block (`|`) when it is text
/// of several lines, else double-quoted with every character a terminal
/// or a reader could trip on escaped.
pub fn yaml(value: &serde_json::Value) -> String {
    let mut out = String::new();
    yaml_node(value, 0, &mut out);
    out
}

/// `value` after a key's `:` or a list's `-` (or at the top), its block
/// lines indented by `indent`; ends with a newline.
fn yaml_node(value: &serde_json::Value, indent: usize, out: &mut String) {
    use serde_json::Value;
    let pad = " ".repeat(indent);
    match value {
        Value::Object(map) if !map.is_empty() => {
            for (i, (key, item)) in map.iter().enumerate() {
                if i > 0 || !out.ends_with("- ") {
                    out.push_str(&pad);
                }
                out.push_str(&yaml_scalar(key));
                out.push(':');
                yaml_child(item, indent, out);
            }
        }
        Value::Array(items) if !items.is_empty() => {
            for (i, item) in items.iter().enumerate() {
                if i > 0 || !out.ends_with("- ") {
                    out.push_str(&pad);
                }
                out.push('-');
                yaml_child(item, indent, out);
            }
        }
        Value::String(s) if literal_block(s) => {
            let chomp = if !s.ends_with('\n') {
                "-"
            } else if s.ends_with("\n\n") {
                "+"
            } else {
                ""
            };
            out.push('|');
            out.push_str(chomp);
            out.push('\n');
            let body = s.strip_suffix('\n').unwrap_or(s);
            for line in body.split('\n') {
                if !line.is_empty() {
                    out.push_str(&" ".repeat(indent + 2));
                    out.push_str(line);
                }
                out.push('\n');
            }
        }
        scalar => {
            out.push_str(&yaml_flow(scalar));
            out.push('\n');
        }
    }
}

/// What follows `key:` or `-`: a scalar on the same line, a list item's
/// collection starting on the same line (`- a: 1`), a map's on the next.
fn yaml_child(value: &serde_json::Value, indent: usize, out: &mut String) {
    use serde_json::Value;
    let nested = match value {
        Value::Object(m) => !m.is_empty(),
        Value::Array(a) => !a.is_empty(),
        _ => false,
    };
    if !nested {
        out.push(' ');
        yaml_node(value, indent, out);
    } else if out.ends_with('-') {
        out.push(' ');
        yaml_node(value, indent + 2, out);
    } else {
        out.push('\n');
        yaml_node(value, indent + 2, out);
    }
}

/// A scalar or an empty collection in flow style.
fn yaml_flow(value: &serde_json::Value) -> String {
    use serde_json::Value;
    match value {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) if n.is_f64() => {
            // YAML 1.1 reads a float only with a dot and a signed exponent.
            let text = n.to_string();
            let (mantissa, exponent) = match text.split_once('e') {
                Some((m, e)) => (m.to_owned(), Some(e.to_owned())),
                None => (text.clone(), None),
            };
            let mantissa = if mantissa.contains('.') {
                mantissa
            } else {
                format!("{mantissa}.0")
            };
            match exponent {
                Some(e) if e.starts_with('-') => format!("{mantissa}e{e}"),
                Some(e) => format!("{mantissa}e+{}", e.trim_start_matches('+')),
                None => mantissa,
            }
        }
        Value::Number(n) => n.to_string(),
        Value::String(s) => yaml_scalar(s),
        Value::Array(_) => "[]".into(),
        Value::Object(_) => "{}".into(),
    }
}

/// A string (or a key) as one YAML scalar: plain when only letters,
/// digits and `._/-` after a leading letter, `_` or `/`, and no YAML 1.1
/// boolean or null word; else double-quoted.
fn yaml_scalar(s: &str) -> String {
    let mut chars = s.chars();
    let plain = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == '/')
        && chars.all(|c| c.is_ascii_alphanumeric() || "._/-".contains(c))
        && !["y", "n", "yes", "no", "on", "off", "true", "false", "null"]
            .contains(&s.to_ascii_lowercase().as_str());
    if plain {
        return s.to_owned();
    }
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            c if yaml_printable(c) => out.push(c),
            c => {
                use std::fmt::Write as _;
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
        }
    }
    out.push('"');
    out
}

/// Characters a YAML reader takes as they are and a terminal shows as they
/// are: YAML's printable set without the line breaks YAML 1.1 adds (NEL,
/// U+2028/9) and without what reorders or hides text.
fn yaml_printable(c: char) -> bool {
    matches!(c, ' '..='~' | '\u{a0}'..='\u{d7ff}' | '\u{e000}'..='\u{fffd}' | '\u{10000}'..)
        && !imgbuild::input::hides_text(c)
}

/// Whether `s` reads best as a literal block: several lines of printable
/// text, none with whitespace at its end, the first not indented (a block
/// takes its indentation from it).
fn literal_block(s: &str) -> bool {
    let body = s.strip_suffix('\n').unwrap_or(s);
    body.contains('\n')
        && !body.starts_with([' ', '\t', '\n'])
        && body.split('\n').all(|line| {
            !line.ends_with([' ', '\t']) && line.chars().all(|c| c == '\t' || yaml_printable(c))
        })
}

#[cfg(test)]
mod markdown_tests {
    use super::{md_code, md_word, redact_also};

    /// A secret with a `|` in a table cell: redacted before the cell's
    /// escape could hide it from the redaction, and before the cut.
    #[test]
    fn a_secret_is_redacted_before_it_is_escaped_or_cut() {
        redact_also("MD_TEST_TOKEN", "s3cr3t|md-0123456789abcdef");
        let cell = md_code("token s3cr3t|md-0123456789abcdef in a patch", 200, true);
        assert_eq!(cell, "`token <redacted: MD_TEST_TOKEN> in a patch`");
        let cut = md_code("s3cr3t|md-0123456789abcdef", 10, true);
        assert!(!cut.contains("s3cr3t"), "{cut}");
        let word = md_word("s3cr3t|md-0123456789abcdef", 64, false);
        assert!(!word.contains("s3cr3t"), "{word}");
    }

    #[test]
    fn code_spans_outfence_backticks_and_escape_pipes_only_in_cells() {
        assert_eq!(md_code("v1.11.2", 64, true), "`v1.11.2`");
        assert_eq!(md_code("a``b", 64, false), "```a``b```");
        assert_eq!(md_code("`x", 64, false), "`` `x ``");
        assert_eq!(md_code("a|b", 64, true), "`a\\|b`");
        assert_eq!(md_code("a|b", 64, false), "`a|b`");
        assert_eq!(md_code("a\nb", 64, false), "`a\\nb`");
        assert_eq!(md_code("", 64, false), "`\"\"`");
        assert_eq!(md_word("cp-01", 64, true), "cp-01");
        assert_eq!(md_word("www.example.com", 64, true), "`www.example.com`");
        assert_eq!(md_word("*x*", 64, true), "`*x*`");
    }
}

#[cfg(test)]
mod tests {
    use super::yaml;
    use serde_json::{Value, json};

    /// `docs` as PyYAML (YAML 1.1, Debian's python3-yaml) reads them,
    /// through Python's JSON writer (a date or a set would fail there).
    fn python(text: &str) -> Value {
        use std::io::Write;
        let mut child = std::process::Command::new("/usr/bin/python3")
            .args([
                "-c",
                "import sys, json, yaml; print(json.dumps(yaml.safe_load(sys.stdin)))",
            ])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("python3 with PyYAML (python3-yaml)");
        child
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
        let o = child.wait_with_output().unwrap();
        assert!(
            o.status.success(),
            "PyYAML refused:\n{text}\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
        serde_json::from_slice(&o.stdout).unwrap()
    }

    /// Strings every YAML reader would otherwise turn into something else,
    /// or a terminal would show other than they are.
    const TRICKY: &[&str] = &[
        "",
        " ",
        "yes",
        "No",
        "ON",
        "off",
        "y",
        "N",
        "true",
        "False",
        "null",
        "Null",
        "~",
        "1",
        "-1",
        "0x1f",
        "0o17",
        "017",
        "1e3",
        "1_000",
        "1:20",
        ".inf",
        "-.Inf",
        ".NaN",
        "2026-11-29",
        "2026-11-29T05:00:00Z",
        "a: b",
        "a:b",
        "- x",
        "? x",
        "#x",
        "x #y",
        "&a",
        "*a",
        "!tag",
        "%YAML",
        "@x",
        "`x",
        "|",
        ">",
        "'",
        "\"",
        "\\",
        "[x]",
        "{x}",
        ",",
        "---",
        "...",
        "<<",
        "=",
        "a\nb",
        "a\nb\n",
        "a\nb\n\n",
        "\na",
        " lead\nx",
        "trail \nx",
        "x\n ",
        "tab\tin",
        "cr\r\nlf",
        "nel\u{85}x",
        "ls\u{2028}x",
        "bidi\u{202e}x",
        "bom\u{feff}",
        "bell\u{7}",
        "del\u{7f}",
        "ü€😀",
        "v1.11.2",
        "cp-01",
        "/dev/sda",
        "sha256:abc",
        "http://x/y?z=1#f",
        "\u{fffe}",
        "key: |\n  nested\n",
    ];

    #[test]
    fn every_tricky_string_reads_back_the_same_in_yaml_1_1_and_1_2() {
        for s in TRICKY {
            let value = json!({ *s: s, "list": [s, [s], {*s: [s]}], "top": {"in": s} });
            let text = yaml(&value);
            assert_eq!(python(&text), value, "PyYAML read {s:?} otherwise:\n{text}");
            let back: Value =
                serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("{s:?}: {e}\n{text}"));
            assert_eq!(back, value, "serde_yaml_ng read {s:?} otherwise:\n{text}");
            for c in text.chars() {
                assert!(
                    c == '\n' || !(c.is_control() || imgbuild::input::hides_text(c)),
                    "{s:?} put {c:?} raw on the terminal:\n{text}"
                );
            }
        }
    }

    #[test]
    fn numbers_booleans_nulls_and_empty_collections_keep_their_types() {
        let value = json!({
            "int": 42, "negative": -7, "big": u64::MAX, "float": 1.5, "tiny": 1e-300,
            "huge": 1e300, "whole": 100.0, "t": true, "f": false, "none": null,
            "emptyMap": {}, "emptyList": [], "nested": [[], {}, [[1]], {"a": {"b": []}}],
        });
        let text = yaml(&value);
        assert_eq!(python(&text), value, "{text}");
        let back: Value = serde_yaml_ng::from_str(&text).unwrap();
        assert_eq!(back, value, "{text}");
        for top in [json!("x\ny"), json!([]), json!({}), json!(3), json!(null)] {
            assert_eq!(python(&yaml(&top)), top, "{}", yaml(&top));
        }
    }

    #[test]
    fn plain_words_stay_plain_and_text_becomes_a_literal_block() {
        let text = yaml(&json!({"node": "cp-01", "config": "version: v1alpha1\nmachine: {}\n"}));
        assert_eq!(
            text,
            "node: cp-01\nconfig: |\n  version: v1alpha1\n  machine: {}\n"
        );
        assert_eq!(
            yaml(&json!({"list": [{"a": 1, "b": [2]}]})),
            "list:\n  - a: 1\n    b:\n      - 2\n"
        );
    }
}
