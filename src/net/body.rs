//! A response whose body cannot hang: every read has the client's stall
//! timeout (reqwest's read timeout, whose timer needs a tokio runtime on
//! the reading thread: [`timer`] lends one), and a body that trickles (a
//! byte now and then, each in time) is cut off by [`TRICKLE_FLOOR`].

use reqwest::header::HeaderMap;
use reqwest::{StatusCode, Url};
use std::io::{self, Read};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The fewest bytes a body must deliver per stall timeout spent waiting
/// for it: a server that sends a byte a second never trips a per-read
/// timeout, yet would hold a download for days.
pub const TRICKLE_FLOOR: u64 = 1024;

/// Why a body read was cut off.
#[derive(Debug, thiserror::Error)]
pub enum Stalled {
    #[error("the server sent nothing for {0:.1?} (the stall timeout)")]
    Silent(Duration),
    #[error(
        "the server sent only {bytes} bytes in {waited:.1?} (less than {TRICKLE_FLOOR} bytes per stall timeout)"
    )]
    Trickle { bytes: u64, waited: Duration },
    #[error("the request's deadline passed while the body was still coming")]
    Deadline,
}

/// A blocking response from `net::send_once`. Reads go through here
/// only: reqwest's read timeout makes its timer on the reading thread,
/// and panics there without a runtime.
pub struct Response {
    inner: reqwest::blocking::Response,
    url: String,
    /// When the request's total deadline passes.
    deadline: Instant,
    window: Window,
}

/// The trickle check: at least [`TRICKLE_FLOOR`] bytes per `stall` of time
/// spent waiting in reads (time the caller spends elsewhere is not the
/// server's).
#[derive(Debug, Clone, Copy)]
struct Window {
    stall: Duration,
    /// Time spent waiting in reads, and bytes read, in the current window.
    waited: Duration,
    got: u64,
}

impl Window {
    fn new(stall: Duration) -> Window {
        Window {
            stall,
            waited: Duration::ZERO,
            got: 0,
        }
    }

    /// Counts a read of `n` bytes that waited `took`; an error once a
    /// window of waiting brought less than the floor.
    fn account(&mut self, n: usize, took: Duration) -> Result<(), Stalled> {
        self.waited += took;
        self.got += n as u64;
        if self.waited < self.stall {
            return Ok(());
        }
        if n > 0 && self.got < TRICKLE_FLOOR {
            return Err(Stalled::Trickle {
                bytes: self.got,
                waited: self.waited,
            });
        }
        *self = Window::new(self.stall);
        Ok(())
    }
}

impl std::fmt::Debug for Response {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Response")
            .field("status", &self.status())
            .field("url", &self.url)
            .finish()
    }
}

impl Response {
    /// `inner`, shown as `url`, its request over at `deadline`, its trickle
    /// window `stall`.
    pub(super) fn new(
        inner: reqwest::blocking::Response,
        url: String,
        deadline: Instant,
        stall: Duration,
    ) -> Response {
        Response {
            inner,
            url,
            deadline,
            window: Window::new(stall),
        }
    }

    /// Sets the trickle window (the caller's stall timeout).
    pub fn with_stall(mut self, stall: Duration) -> Response {
        self.window = Window::new(stall);
        self
    }

    pub fn status(&self) -> StatusCode {
        self.inner.status()
    }

    pub fn headers(&self) -> &HeaderMap {
        self.inner.headers()
    }

    pub fn content_length(&self) -> Option<u64> {
        self.inner.content_length()
    }

    pub fn url(&self) -> &Url {
        self.inner.url()
    }

    /// The URL as messages show it (no user name or password).
    pub fn shown_url(&self) -> &str {
        &self.url
    }
}

impl Read for Response {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let started = Instant::now();
        let read = {
            let _lent = timer()?.enter();
            self.inner.read(buf)
        };
        let took = started.elapsed();
        match read {
            Ok(n) => {
                self.window
                    .account(n, took)
                    .map_err(|s| io::Error::new(io::ErrorKind::TimedOut, s))?;
                Ok(n)
            }
            Err(e) if timed_out(&e) => {
                let why = if Instant::now() + Duration::from_millis(50) >= self.deadline {
                    Stalled::Deadline
                } else {
                    Stalled::Silent(took)
                };
                Err(io::Error::new(io::ErrorKind::TimedOut, why))
            }
            Err(e) => Err(e),
        }
    }
}

/// Whether reqwest gave up waiting (its read timeout or the total one).
fn timed_out(e: &io::Error) -> bool {
    e.get_ref()
        .and_then(|inner| inner.downcast_ref::<reqwest::Error>())
        .is_some_and(reqwest::Error::is_timeout)
}

/// The runtime whose timer reqwest's read timeout uses while a blocking
/// body is read: one thread that only drives timers, started on first use
/// and kept for the life of the process.
fn timer() -> io::Result<&'static tokio::runtime::Runtime> {
    static TIMER: OnceLock<Result<tokio::runtime::Runtime, String>> = OnceLock::new();
    TIMER
        .get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name("imgbuild-net-timer")
                .enable_time()
                .build()
                .map_err(|e| format!("starting the HTTP read timer: {e}"))
        })
        .as_ref()
        .map_err(|m| io::Error::other(m.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_trickle_is_cut_once_a_window_of_waiting_brought_less_than_the_floor() {
        let mut w = Window::new(2 * S);
        assert!(w.account(1, S).is_ok());
        let err = w.account(1, S).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the server sent only 2 bytes in 2.0s (less than 1024 bytes per stall timeout)"
        );
    }

    #[test]
    fn a_slow_but_steady_body_starts_a_new_window_each_time() {
        let mut w = Window::new(2 * S);
        for _ in 0..10 {
            assert!(w.account(600, S).is_ok());
        }
        // The end of the body (0 bytes) is never a trickle.
        let mut w = Window::new(2 * S);
        assert!(w.account(0, 3 * S).is_ok());
    }
}
