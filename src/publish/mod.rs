//! Publishing built images where machines boot them. Each target reads its
//! credentials from the environment, never from the inventory, and keeps
//! them out of every message.

pub mod hcloud;
pub mod proxmox;
pub mod prune;
pub mod target;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::build::NodeImage;
use crate::digest::Sha256;
use crate::inventory::{ImageFormat, Inventory};

/// One built image to publish, as the manifest recorded it, with its node:
/// targets read the node's settings (vmid, MAC, extensions) from it and
/// reports place it by it, never by looking its name up again.
#[derive(Debug, Clone)]
pub struct PublishImage {
    /// The node's position in the inventory.
    pub index: usize,
    /// Its name, for messages and volume names.
    pub node: String,
    /// The file, resolved against the out dir.
    pub path: PathBuf,
    pub sha256: Sha256,
    pub size: u64,
    pub format: ImageFormat,
    /// The factory URL that serves exactly these bytes (factory route);
    /// `None` for an image patched offline.
    pub source_url: Option<String>,
}

/// A manifest entry that cannot be published.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("node {0}: its image is in the manifest, but the node is not in the inventory")]
    UnknownNode(String),
}

impl PublishImage {
    /// The one way a publish image is made: the manifest entry `image` of
    /// one of `inv`'s nodes, its file at `path`.
    pub fn new(inv: &Inventory, image: &NodeImage, path: PathBuf) -> Result<Self, ImageError> {
        let index = inv
            .nodes
            .iter()
            .position(|n| n.name == image.node)
            .ok_or_else(|| ImageError::UnknownNode(image.node.clone()))?;
        Ok(PublishImage {
            index,
            node: image.node.clone(),
            path,
            sha256: image.sha256,
            size: image.size,
            format: image.format,
            source_url: (image.route == crate::build::Route::Factory)
                .then(|| image.source_url.clone()),
        })
    }

    /// Every built (or already current) image, as the build reported them.
    pub fn built(
        inv: &Inventory,
        built: &[crate::build::BuildOutcome],
    ) -> Result<Vec<Self>, ImageError> {
        built
            .iter()
            .map(|o| PublishImage::new(inv, &o.image, o.file.clone()))
            .collect()
    }
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

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

/// Asks a long run to stop at its next step (the CLI sets it on SIGINT or
/// SIGTERM); the run then cleans up what it created.
#[derive(Clone, Copy, Debug, Default)]
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

    /// Resolves once cancelled (never for [`Cancel::never`]): for racing
    /// async work that has no step of its own to check at.
    pub async fn cancelled(&self) {
        while self.check().is_ok() {
            tokio::time::sleep(Duration::from_millis(100)).await;
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
