//! Why publishing to Hetzner Cloud failed.

use std::time::Duration;

use crate::net::NetError;
use crate::publish::Interrupted;

/// The API's limit on `user_data`.
pub const USER_DATA_MAX: usize = 32 * 1024;

/// Why publishing to Hetzner Cloud failed. Never carries the token.
#[derive(Debug, thiserror::Error)]
pub enum HcloudError {
    #[error("{0}")]
    Setup(String),
    /// The API answered with an error; `body` is its error object as sent.
    #[error("{request}: HTTP {status}: {body}")]
    Api {
        request: String,
        status: u16,
        code: Option<String>,
        body: String,
    },
    #[error(transparent)]
    Net(#[from] NetError),
    #[error("{request}: unexpected reply: {message}")]
    Reply { request: String, message: String },
    #[error("{what}: action {id} ended in error {code}: {message}")]
    Action {
        what: String,
        id: u64,
        code: String,
        message: String,
    },
    #[error("{what}: not done after {after:?}")]
    Timeout { what: String, after: Duration },
    #[error("SSH: {0}")]
    Ssh(String),
    /// The OpenSSH client is not installed: nothing was created.
    #[error(
        "the OpenSSH client `ssh` is not on PATH; writing a snapshot needs it: install the package openssh-client"
    )]
    SshMissing,
    #[error("{0}")]
    Remote(String),
    #[error("{0}")]
    Io(String),
    #[error(
        "no build server type could be created in {location}:\n  {}",
        tried.join("\n  ")
    )]
    NoServerType {
        location: String,
        tried: Vec<String>,
    },
    /// `servers.type` cannot boot a snapshot: its disk is smaller than the
    /// snapshot's `disk_size`.
    #[error(
        "publish.hcloud.servers.type {server_type} has a {disk} GB disk, smaller than the {disk_size} GB disk_size of snapshot {snapshot} (nodes {nodes}): choose a type with at least {disk_size} GB"
    )]
    TypeTooSmall {
        server_type: String,
        disk: f64,
        snapshot: u64,
        disk_size: f64,
        nodes: String,
    },
    /// `servers.type` has another architecture than a snapshot.
    #[error(
        "publish.hcloud.servers.type {server_type} is {type_arch}, snapshot {snapshot} (nodes {nodes}) is {image_arch}: choose a type of the image's architecture"
    )]
    WrongArch {
        server_type: String,
        type_arch: String,
        snapshot: u64,
        image_arch: String,
        nodes: String,
    },
    /// A node's machine config does not fit in `user_data`.
    #[error(
        "node {node}: its machine config is {size} bytes, over Hetzner's {limit}-byte user_data limit{detail} (move large patches or inline manifests out of it)",
        limit = USER_DATA_MAX
    )]
    UserDataTooLarge {
        node: String,
        size: usize,
        /// Why compressing did not help.
        detail: String,
    },
    /// Neither the API nor the state dir's record says where the
    /// cluster's servers are.
    #[error("{0}")]
    NoAddresses(String),
    #[error("interrupted")]
    Interrupted,
    /// An earlier image's run was interrupted, so this one never began.
    #[error("not started: interrupted")]
    NotStarted,
}

impl From<Interrupted> for HcloudError {
    fn from(_: Interrupted) -> Self {
        HcloudError::Interrupted
    }
}
