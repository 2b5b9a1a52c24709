//! Why publishing to Proxmox failed.

use std::time::Duration;

use crate::net::NetError;

/// Why publishing to Proxmox failed. Never carries the token.
#[derive(Debug, thiserror::Error)]
pub enum ProxmoxError {
    #[error("{0}")]
    Setup(String),
    #[error(
        "the Proxmox API refused the token in PROXMOX_VE_API_TOKEN (HTTP 401): check its user, realm, token ID, secret and privileges"
    )]
    Unauthorized,
    #[error("{what}: {message}")]
    Api { what: String, message: String },
    #[error(transparent)]
    Net(#[from] NetError),
    #[error("{what}: task {upid} ended with {exitstatus:?}{}", log_tail(log))]
    Task {
        what: String,
        upid: String,
        exitstatus: String,
        log: Vec<String>,
    },
    #[error("{what}: task {upid} still running after {timeout:?}")]
    TaskTimeout {
        what: String,
        upid: String,
        timeout: Duration,
    },
    #[error("node {node}: {message}")]
    Node { node: String, message: String },
}

pub(super) fn log_tail(log: &[String]) -> String {
    if log.is_empty() {
        String::new()
    } else {
        format!("; task log ends:\n    {}", log.join("\n    "))
    }
}
