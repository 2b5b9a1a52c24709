//! Disaster recovery as `talosctl bootstrap --recover-from` does it
//! (siderolabs/talos `cmd/talosctl/cmd/talos/bootstrap.go`): the snapshot
//! uploaded to the bootstrap node (`EtcdRecover`, stored as
//! `/var/lib/etcd.snapshot`), then `Bootstrap{recover_etcd}`, whose etcd
//! restores it before it starts (`internal/app/machined/pkg/system/services/
//! etcd.go` recoverFromSnapshot). Talos checks only that the node is a
//! control plane; "etcd data directory is not empty" comes at Bootstrap.

use std::io;
use std::path::Path;
use std::sync::{Arc, Mutex};

use super::format::{SnapshotInfo, Verifier};
use crate::talos::api::common::Data;
use crate::talos::client::{ApiError, NodeClient};

/// How much of a snapshot one upload message carries.
const UPLOAD_CHUNK: usize = 64 << 10;

/// Uploads the snapshot at `path` to `conn`'s node (`EtcdRecover`) in
/// chunks read from disk, checking it again on the way (the file may have
/// changed since it was checked): a file that fails is reported before
/// the node is asked to bootstrap from it.
async fn upload(conn: &NodeClient, path: &Path) -> Result<SnapshotInfo, RecoverError> {
    let file = tokio::fs::File::open(path)
        .await
        .map_err(|e| RecoverError::Local(format!("{}: {e}", path.display())))?;
    let verdict = Arc::new(Mutex::new((Verifier::default(), None::<io::Error>)));
    let seen = verdict.clone();
    let chunks = futures_util::stream::unfold(Some(file), move |file| {
        let seen = seen.clone();
        async move {
            use tokio::io::AsyncReadExt;
            let mut file = file?;
            let mut buf = vec![0; UPLOAD_CHUNK];
            match file.read(&mut buf).await {
                Ok(0) => None,
                Ok(n) => {
                    buf.truncate(n);
                    seen.lock().expect("not poisoned").0.update(&buf);
                    Some((
                        Data {
                            metadata: None,
                            bytes: buf,
                        },
                        Some(file),
                    ))
                }
                Err(e) => {
                    seen.lock().expect("not poisoned").1 = Some(e);
                    None
                }
            }
        }
    });
    conn.etcd_recover(chunks).await.map_err(RecoverError::Api)?;
    let (v, failed) = std::mem::take(&mut *verdict.lock().expect("not poisoned"));
    if let Some(e) = failed {
        return Err(RecoverError::Local(format!("{}: {e}", path.display())));
    }
    v.finish().map_err(|problem| {
        RecoverError::Local(format!(
            "{}: changed while it was uploaded, and is not a whole etcd snapshot now: {problem}",
            path.display()
        ))
    })
}

/// Why a recovery step on the bootstrap node failed.
#[derive(Debug, thiserror::Error)]
pub enum RecoverError {
    /// From the node: retried where it means "not yet".
    #[error(transparent)]
    Api(ApiError),
    /// The file on this machine.
    #[error("{0}")]
    Local(String),
}

/// What a recovery needs of the bootstrap node, said when its etcd runs
/// (Talos answers its `Bootstrap` with "etcd data directory is not empty").
const RECOVER_NEEDS_WIPED: &str = "etcd already has data on this node: recovery needs control planes whose etcd waits for bootstrap (service etcd Preparing), as after `talosctl reset --system-labels-to-wipe EPHEMERAL` or on fresh machines; nothing was uploaded";

/// Recovers etcd on `conn`'s node from the snapshot at `path`, as
/// `talosctl bootstrap --recover-from` does: refuses a node whose etcd
/// runs, uploads (`EtcdRecover`), then `Bootstrap{recover_etcd}`. Talos
/// restores the database on that node with itself as the only member;
/// the other control planes join it as after any bootstrap.
pub async fn recover(conn: &NodeClient, path: &Path) -> Result<SnapshotInfo, RecoverError> {
    let services = conn.services().await.map_err(RecoverError::Api)?;
    if services
        .iter()
        .any(|s| s.id == "etcd" && s.state == "Running")
    {
        return Err(RecoverError::Local(RECOVER_NEEDS_WIPED.to_owned()));
    }
    let info = upload(conn, path).await?;
    conn.bootstrap_recover().await.map_err(|e| match e {
        ApiError::Status {
            code: tonic::Code::AlreadyExists,
            message,
        } => RecoverError::Local(format!("{message}: {RECOVER_NEEDS_WIPED}")),
        e => RecoverError::Api(e),
    })?;
    Ok(info)
}
