//! Publishing built images where machines boot them. Each target reads its
//! credentials from the environment, never from the inventory, and keeps
//! them out of every message.

pub mod hcloud;
pub mod proxmox;
pub mod target;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::inventory::ImageFormat;

/// One built image to publish, as the manifest recorded it.
#[derive(Debug, Clone)]
pub struct PublishImage {
    pub node: String,
    /// The file, resolved against the out dir.
    pub path: PathBuf,
    pub sha256: String,
    pub size: u64,
    pub format: ImageFormat,
}

/// An API secret: shown as `***` by `Debug`, so it cannot reach a log.
#[derive(Clone)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: String) -> Secret {
        Secret(s)
    }

    /// The value, for the one header that needs it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl From<&crate::build::Outcome> for PublishImage {
    /// A built (or already current) image, as the build reported it.
    fn from(o: &crate::build::Outcome) -> PublishImage {
        PublishImage {
            node: o.image.node.clone(),
            path: o.file.clone(),
            sha256: o.image.sha256.clone(),
            size: o.image.size,
            format: o.image.format,
        }
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

/// Asks a long run to stop at its next step (the CLI sets it on SIGINT or
/// SIGTERM); the run then cleans up what it created.
#[derive(Clone, Copy, Debug)]
pub struct Cancel(Option<&'static AtomicBool>);

/// The run was asked to stop.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("interrupted")]
pub struct Interrupted;

impl Cancel {
    /// Follows `flag`.
    pub fn on(flag: &'static AtomicBool) -> Cancel {
        Cancel(Some(flag))
    }

    /// Never cancels: for cleanup, which must finish.
    pub fn never() -> Cancel {
        Cancel(None)
    }

    pub fn check(&self) -> Result<(), Interrupted> {
        match self.0 {
            Some(f) if f.load(Ordering::SeqCst) => Err(Interrupted),
            _ => Ok(()),
        }
    }

    /// Sleeps `d` in short steps, returning early when cancelled.
    pub fn sleep(&self, d: Duration) -> Result<(), Interrupted> {
        let end = Instant::now() + d;
        loop {
            self.check()?;
            let now = Instant::now();
            if now >= end {
                return Ok(());
            }
            std::thread::sleep((end - now).min(Duration::from_millis(100)));
        }
    }
}
