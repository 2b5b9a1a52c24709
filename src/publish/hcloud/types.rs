//! What a Hetzner run is told, what it reports and what it leaves.

use std::net::SocketAddr;
use std::time::Duration;

use serde::Serialize;

use crate::net::RetryPolicy;

/// Labels every temporary resource of a run carries: `imgbuild cleanup`
/// finds leftovers by them (and never touches a cluster's own servers,
/// which have no run label).
pub(super) const MANAGED_BY: (&str, &str) = ("managed-by", "imgbuild");
pub(super) const RUN_LABEL: &str = "imgbuild-run";
/// Which process made a run's resources: `<boot>-<pid>`, `<boot>` the
/// first 16 hex digits of the SHA-256 of the kernel's boot id. A later run
/// in the same boot whose owner process is gone knows them as a killed
/// run's leftovers.
pub(super) const OWNER_LABEL: &str = "imgbuild-owner";
/// When a run made the resource, in unix seconds: a run on another machine
/// or boot, whose process cannot be asked, is over once this is older than
/// [`SnapshotOptions::stale_after`].
pub(super) const STARTED_LABEL: &str = "imgbuild-started";
/// The cluster a server, and every snapshot published for it, belongs to:
/// its name, compared whole (see `prune`).
pub const CLUSTER_LABEL: &str = "imgbuild-cluster";

/// How patient a snapshot run is.
#[derive(Debug, Clone)]
pub struct SnapshotOptions {
    /// How often actions and statuses are polled (hcloud-go: 500 ms).
    pub poll: Duration,
    /// The longest one action may run.
    pub action_timeout: Duration,
    /// How long to keep trying to log in to the rescue system.
    pub ssh_timeout: Duration,
    /// The rescue system's SSH port.
    pub ssh_port: u16,
    /// Who logs in to the rescue system (root on Hetzner).
    pub ssh_user: String,
    /// The longest a new snapshot may take to become available.
    pub image_timeout: Duration,
    pub retry: RetryPolicy,
    /// zstd level and worker threads for images not already compressed.
    pub zstd_level: i32,
    pub zstd_threads: u32,
    /// How old another machine's run must be before a later run takes its
    /// temporary resources for a killed run's leftovers: longer than any
    /// run lasts (action, login, stream and snapshot waits together).
    pub stale_after: Duration,
}

impl Default for SnapshotOptions {
    fn default() -> Self {
        SnapshotOptions {
            poll: Duration::from_millis(1000),
            action_timeout: Duration::from_secs(600),
            ssh_timeout: Duration::from_secs(300),
            ssh_port: 22,
            ssh_user: "root".to_owned(),
            image_timeout: Duration::from_secs(1800),
            retry: RetryPolicy::default(),
            zstd_level: 3,
            zstd_threads: std::thread::available_parallelism()
                .map_or(1, |n| n.get() as u32)
                .min(8),
            stale_after: Duration::from_secs(6 * 3600),
        }
    }
}

/// Progress a snapshot run reports; the CLI renders it.
pub trait Observer: Sync {
    fn event(&self, event: &Event);
    /// While the image streams to the rescue system (between
    /// [`Event::Writing`] and [`Event::Written`]), once per chunk that has
    /// left: how many bytes of the image the compressed bytes sent so far
    /// stand for, and those compressed bytes. `nodes` boot this image.
    fn sent(&self, _nodes: &[String], _image_bytes: u64, _wire_bytes: u64) {}
}

/// An observer that shows nothing (JSON output, dry runs).
pub struct Quiet;

impl Observer for Quiet {
    fn event(&self, _: &Event) {}
}

/// One step of a snapshot run.
#[derive(Debug, Clone)]
pub enum Event {
    Found {
        id: u64,
    },
    /// A snapshot holds these bytes but on a larger disk than the smallest
    /// build type here: servers of that type could not use it.
    TooLarge {
        id: u64,
        disk_size: f64,
        server_type: String,
        disk: f64,
    },
    KeyCreated {
        id: u64,
    },
    TypeSkipped {
        server_type: String,
        why: String,
    },
    ServerCreated {
        id: u64,
        server_type: String,
    },
    RescueBooting {
        id: u64,
    },
    /// Logged in; the rescue host key is new on every boot, so it was
    /// accepted for this session only.
    Connected {
        addr: SocketAddr,
        host_key: String,
    },
    Discarded {
        supported: bool,
    },
    Writing {
        size: u64,
    },
    Written {
        bytes: u64,
        sent: u64,
    },
    PoweredOff,
    Snapshotting,
    SnapshotReady {
        id: u64,
    },
    Deleted {
        kind: &'static str,
        id: u64,
    },
}

/// A temporary resource that could not be deleted.
#[derive(Debug, Clone, Serialize)]
pub struct Leftover {
    pub kind: &'static str,
    pub id: u64,
    pub error: String,
}

/// A temporary resource `imgbuild cleanup` deleted.
#[derive(Debug, Clone, Serialize)]
pub struct Deleted {
    pub kind: &'static str,
    pub id: u64,
    pub name: String,
}
