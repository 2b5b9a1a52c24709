//! Why `up` stopped, and at which stage: shared by the run ([`super::up`])
//! and its report ([`super::report`]), so neither imports the other for it.

use super::converge::ConvergeError;
use crate::build::BuildError;
use crate::publish::hcloud::HcloudError;
use crate::publish::proxmox::ProxmoxError;
use crate::talos::stage::StageError;

/// Why `up` could not start or a stage stopped it. Never carries a secret.
#[derive(Debug, thiserror::Error)]
pub enum UpError {
    /// The inventory or environment lacks what `up` needs.
    #[error("{0}")]
    Setup(String),
    #[error(transparent)]
    Build(#[from] BuildError),
    #[error(transparent)]
    Proxmox(#[from] ProxmoxError),
    #[error(transparent)]
    Hcloud(#[from] HcloudError),
    #[error(transparent)]
    Bootstrap(#[from] StageError),
    #[error(transparent)]
    Converge(Box<ConvergeError>),
    #[error(transparent)]
    Remove(Box<crate::talos::remove::RemoveError>),
    #[error(transparent)]
    Prune(Box<crate::publish::prune::PruneError>),
    /// A day-two step refused to start (as its own command would).
    #[error("{stage} refused: {why}")]
    Refused { stage: Stage, why: String },
    /// A day-two step failed; `partial` when it changed some nodes first.
    #[error("{stage}: {message}")]
    Step {
        stage: Stage,
        message: String,
        partial: bool,
    },
    /// Some nodes failed a stage (each named in its report); the others
    /// finished it. Bootstrapping waits until every node is published.
    #[error("{stage}: {} failed ({}); the cluster was not bootstrapped", failed.len(), failed.join(", "))]
    Nodes { stage: Stage, failed: Vec<String> },
}

impl UpError {
    /// Whether the inventory or environment is at fault (not a server or node).
    pub fn is_setup(&self) -> bool {
        match self {
            UpError::Setup(_)
            | UpError::Proxmox(ProxmoxError::Setup(_))
            | UpError::Hcloud(HcloudError::Setup(_)) => true,
            UpError::Build(BuildError::UnknownNode(_)) => true,
            UpError::Bootstrap(e) => {
                matches!(
                    e,
                    StageError::UnknownTarget(_)
                        | StageError::BadEndpoint { .. }
                        | StageError::NoAddress { .. }
                        | StageError::Config(_)
                ) || e.is_usage()
            }
            _ => false,
        }
    }
}

pub use crate::publish::target::MachineError;

/// What stopped a stage: the stage, and why (the error half of every
/// stage's result in [`super::up`]).
pub type Stopped = (Stage, UpError);

/// The stages, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Stage {
    Build,
    Publish,
    Bootstrap,
    Upgrade,
    Kubernetes,
    Configs,
    Settings,
    Remove,
    Prune,
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Stage::Build => "build",
            Stage::Publish => "publish",
            Stage::Bootstrap => "bootstrap",
            Stage::Upgrade => "upgrade",
            Stage::Kubernetes => "kubernetes",
            Stage::Configs => "configs",
            Stage::Settings => "settings",
            Stage::Remove => "remove",
            Stage::Prune => "prune",
        })
    }
}
