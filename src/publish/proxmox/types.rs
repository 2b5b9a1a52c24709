//! What a publish run is told and what it reports.

use std::time::Duration;

pub use super::settings::{Apply, SettingChange};
use crate::digest::Sha256;
use crate::net::RetryPolicy;

/// What a publish run does.
#[derive(Debug, Clone)]
pub struct PublishOptions {
    /// Give each existing VM a new boot disk from this image (stop, import,
    /// swap, start): the node is installed afresh. Without it an existing
    /// VM's disk is its image of record and nothing is uploaded for it.
    pub replace_disk: bool,
    /// How often tasks are polled.
    pub poll: Duration,
    /// The longest any one task may run (an upload's copy, a VM import).
    pub task_timeout: Duration,
    /// Times a broken upload is sent again from the start.
    pub upload_retries: u32,
    /// For API calls that fail on the way (busy proxy, dropped connection).
    pub retry: RetryPolicy,
}

impl Default for PublishOptions {
    fn default() -> Self {
        PublishOptions {
            replace_disk: false,
            poll: Duration::from_millis(500),
            task_timeout: Duration::from_secs(1800),
            upload_retries: 2,
            retry: RetryPolicy::default(),
        }
    }
}

/// Progress a publish reports; the CLI renders it, the library never prints.
pub trait Observer: Sync {
    fn event(&self, node: &str, event: &Event);
    /// During an upload attempt (after [`Event::Uploading`]): how many bytes
    /// of the image have left so far, counted as the HTTP client takes them
    /// off the body, not as they are read from the file. Called a few times
    /// a second at most, so a progress bar can follow.
    fn sent(&self, _node: &str, _bytes: u64) {}
}

/// One step of one node's publish.
#[derive(Debug, Clone)]
pub enum Event {
    Uploading {
        volid: String,
        size: u64,
    },
    UploadRetry {
        attempt: u32,
        why: String,
    },
    Uploaded {
        volid: String,
    },
    AlreadyStored {
        volid: String,
    },
    /// `upload: download-url`: Proxmox fetches the image from `url`.
    Downloading {
        volid: String,
        url: String,
    },
    /// Proxmox fetched and checked it; the runner sent no image bytes.
    Downloaded {
        volid: String,
    },
    /// The node's VM is `vmid`, not the `inventory_vmid` that `firstId` +
    /// position gives: it is kept, not made again.
    VmFound {
        vmid: u32,
        inventory_vmid: u32,
    },
    VmCreated {
        vmid: u32,
    },
    VmUnchanged {
        vmid: u32,
    },
    /// The VM exists: its disk is the image of record (it was installed
    /// from `running`, and upgrades move it), so nothing is uploaded for it.
    VmKeepsDisk {
        vmid: u32,
        running: String,
    },
    /// One setting of the VM changed (or, for [`Apply::Reboot`], is
    /// pending until the reboot that follows).
    VmSetting {
        vmid: u32,
        change: SettingChange,
    },
    /// Rebooted for pending settings; it runs and its Talos API answers.
    VmRebooted {
        vmid: u32,
    },
    DiskReplaced {
        vmid: u32,
    },
    VmStarted {
        vmid: u32,
    },
}

/// What happened to a node's VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum VmChange {
    Created,
    /// Its boot disk replaced (`--replace-disk`).
    Updated,
    /// Its settings changed (see `settings`).
    Changed,
    Unchanged,
}

/// One node's result.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodePublished {
    pub node: String,
    pub volid: String,
    pub sha256: Sha256,
    /// False when nothing was sent: the storage held this exact volume, or
    /// the node's VM exists and keeps its disk.
    pub uploaded: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vmid: Option<u32>,
    /// The vmid the inventory gives (`firstId` + position) when the node's
    /// VM was found under another one (`vmid`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inventory_vmid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vm: Option<VmChange>,
    /// The VM's settings that changed, from → to.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub settings: Vec<SettingChange>,
    pub started: bool,
}
