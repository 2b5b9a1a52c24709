//! Disaster recovery as `talosctl bootstrap --recover-from` does it
//! (siderolabs/talos `cmd/talosctl/cmd/talos/bootstrap.go`): the snapshot
//! uploaded to the bootstrap node (`EtcdRecover`, stored as
//! `/var/lib/etcd.snapshot`), then `Bootstrap{recover_etcd}`, whose etcd
//! restores it before it starts (`internal/app/machined/pkg/system/services/
//! etcd.go` recoverFromSnapshot). Talos checks only that the node is a
//! control plane; "etcd data directory is not empty" comes at Bootstrap.
//! The Talos disaster-recovery guide (`advanced/disaster-recovery`) asks
//! that every control plane's etcd be wiped and waiting (service etcd
//! Preparing) first, else the old members stay broken: [`all_preparing`]
//! checks that before anything is uploaded.

use std::io;
use std::path::Path;
use std::sync::{Arc, Mutex};

use super::format::{SnapshotInfo, Verifier};
use crate::talos::api::common::Data;
use crate::talos::client::{ApiError, Mode, NodeClient, NodeEndpoint};

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
pub async fn recover(
    conn: &NodeClient,
    path: &Path,
    skip_hash_check: bool,
) -> Result<SnapshotInfo, RecoverError> {
    let services = conn.services().await.map_err(RecoverError::Api)?;
    if services
        .iter()
        .any(|s| s.id == "etcd" && s.state == "Running")
    {
        return Err(RecoverError::Local(RECOVER_NEEDS_WIPED.to_owned()));
    }
    let info = upload(conn, path).await?;
    conn.bootstrap_recover(skip_hash_check)
        .await
        .map_err(|e| match e {
            ApiError::Status {
                code: tonic::Code::AlreadyExists,
                message,
            } => RecoverError::Local(format!("{message}: {RECOVER_NEEDS_WIPED}")),
            e => RecoverError::Api(e),
        })?;
    Ok(info)
}

/// The state of each control plane's etcd service, by name; None for a
/// node that does not answer (yet).
pub type EtcdStates = Vec<(String, Option<String>)>;

/// Reads each control plane's etcd service state (`ServiceList`).
pub async fn etcd_states(
    control_planes: &[(String, NodeEndpoint)],
    mode: &Mode,
    timeout: std::time::Duration,
) -> EtcdStates {
    let mut out = Vec::new();
    for (name, endpoint) in control_planes {
        let state = match NodeClient::connect(endpoint, mode, timeout).await {
            Ok(c) => c.services().await.ok().map(|list| {
                list.into_iter()
                    .find(|s| s.id == "etcd")
                    .map_or_else(|| "absent".to_owned(), |s| s.state)
            }),
            Err(_) => None,
        };
        out.push((name.clone(), state));
    }
    out
}

/// Whether a recovery may start: every control plane's etcd is Preparing
/// (wiped, waiting for bootstrap). One whose etcd is in another state is
/// named and refused (it would keep its old data and stay broken); one
/// that does not answer yet is "not yet" (Unavailable, retried while the
/// nodes come up).
pub fn all_preparing(states: &EtcdStates) -> Result<(), RecoverError> {
    let not: Vec<String> = states
        .iter()
        .filter_map(|(n, s)| match s.as_deref() {
            Some("Preparing") | None => None,
            Some(other) => Some(format!("{n} (etcd {other})")),
        })
        .collect();
    if !not.is_empty() {
        return Err(RecoverError::Local(format!(
            "recovery needs every control plane's etcd wiped and waiting (service etcd Preparing), and these are not: {}; reset them first (`talosctl reset --graceful=false --system-labels-to-wipe EPHEMERAL`); nothing was uploaded",
            not.join(", ")
        )));
    }
    let silent: Vec<&str> = states
        .iter()
        .filter(|(_, s)| s.is_none())
        .map(|(n, _)| n.as_str())
        .collect();
    if !silent.is_empty() {
        return Err(RecoverError::Api(ApiError::Status {
            code: tonic::Code::Unavailable,
            message: format!(
                "waiting for every control plane before recovering etcd: {} does not answer yet",
                silent.join(", ")
            ),
        }));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn states(list: &[(&str, Option<&str>)]) -> EtcdStates {
        list.iter()
            .map(|(n, s)| (n.to_string(), s.map(str::to_owned)))
            .collect()
    }

    #[test]
    fn every_control_plane_must_be_preparing_and_those_that_are_not_are_named() {
        // Talos v1.11 disaster recovery: all control planes wiped first.
        let ok = states(&[("cp-01", Some("Preparing")), ("cp-02", Some("Preparing"))]);
        assert!(all_preparing(&ok).is_ok());
        let bad = states(&[
            ("cp-01", Some("Preparing")),
            ("cp-02", Some("Running")),
            ("cp-03", Some("Failed")),
        ]);
        let e = all_preparing(&bad).unwrap_err().to_string();
        assert!(
            e.contains("cp-02 (etcd Running), cp-03 (etcd Failed)"),
            "{e}"
        );
        assert!(!e.contains("cp-01"), "{e}");
        let later = states(&[("cp-01", Some("Preparing")), ("cp-02", None)]);
        match all_preparing(&later) {
            Err(RecoverError::Api(e)) => {
                assert_eq!(e.code(), Some(tonic::Code::Unavailable));
                assert!(e.to_string().contains("cp-02 does not answer yet"));
            }
            other => panic!("{other:?}"),
        }
    }
}
