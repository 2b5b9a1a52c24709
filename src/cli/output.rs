//! What every command shares for its results: the output format, the
//! errors that choose the exit code, and stdout that survives a closed pipe.
//! A leaf of the cli module graph: commands import it, it imports none of them.

use serde_json::json;
use std::io::Write;

/// `println!` that ends the program the way other tools end when their
/// reader went away (`imgbuild … | head -1`), instead of panicking: every
/// line the CLI prints goes through [`stdout_write`].
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

/// The documented exit codes: 0 ok, 1 failure, 2 usage error or invalid
/// inventory, 3 partial.
pub const EXIT_FAILURE: i32 = 1;
pub const EXIT_USAGE: i32 = 2;
pub const EXIT_PARTIAL: i32 = 3;

/// Writes `bytes` to stdout at once. A reader that closed the pipe ends
/// the program as it ends `cat` or `seq`: killed by SIGPIPE, silently, so
/// the shell sees the usual status (141). Rust ignores SIGPIPE so that
/// sockets and child pipes report EPIPE instead; only stdout dies of it.
/// Any other write error (a full disk behind `>`) is one message and exit 1.
pub fn stdout_write(bytes: &[u8]) {
    let mut out = std::io::stdout().lock();
    let Err(e) = out.write_all(bytes).and_then(|()| out.flush()) else {
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
    eprintln!("error: writing to stdout: {e}");
    std::process::exit(EXIT_FAILURE);
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
        eprintln!("error: node {node}: {error}");
    }
}
