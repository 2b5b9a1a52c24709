//! Why publishing to Proxmox failed.

use std::time::Duration;

use super::types::NodePublished;
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
    Node {
        node: String,
        /// Where in the node's publish it failed.
        step: Step,
        message: String,
        /// What finished before it failed (the stored image, the VM).
        done: Option<Box<NodePublished>>,
    },
}

/// The steps of one node's publish, in order: what a summary marks failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Step {
    /// Storing the image.
    Upload,
    /// Finding, creating or updating the VM.
    Vm,
    /// Starting the VM.
    Start,
}

impl ProxmoxError {
    /// This error as `node`'s, at `step`, after `done`; one that is
    /// already a node's keeps its step and message.
    pub(super) fn at(self, node: &str, step: Step, done: Option<&NodePublished>) -> ProxmoxError {
        let done = done.map(|d| Box::new(d.clone()));
        match self {
            ProxmoxError::Node {
                node,
                step,
                message,
                ..
            } => ProxmoxError::Node {
                node,
                step,
                message,
                done,
            },
            e => ProxmoxError::Node {
                node: node.to_owned(),
                step,
                message: e.to_string(),
                done,
            },
        }
    }
}

pub(super) fn log_tail(log: &[String]) -> String {
    if log.is_empty() {
        String::new()
    } else {
        format!("; task log ends:\n    {}", log.join("\n    "))
    }
}
