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
use std::sync::atomic::{AtomicBool, Ordering};
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

/// `--output`: text for people, json for CI.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    Text,
    Json,
}

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

/// Fixes how stdout is written, once, before any command runs.
pub fn init(output: Output, show_secrets: bool) {
    STDOUT_JSON.store(output == Output::Json, Ordering::Relaxed);
    SHOW_SECRETS.store(show_secrets, Ordering::Relaxed);
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
    let redacted = if SHOW_SECRETS.load(Ordering::Relaxed) {
        std::borrow::Cow::Borrowed(text)
    } else {
        let mut known = REDACTIONS.write().unwrap_or_else(PoisonError::into_inner);
        known.refresh();
        match known.set.as_ref() {
            Some(set) => std::borrow::Cow::Owned(set.apply(text).into_owned()),
            None => std::borrow::Cow::Borrowed(text),
        }
    };
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
    let text = shown(
        &String::from_utf8_lossy(bytes),
        STDOUT_JSON.load(Ordering::Relaxed),
    );
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
