//! Cordon and drain where the node does not: on the LifecycleService path
//! (Talos v1.13 on) talosctl installs, then cordons and drains the node
//! through the Kubernetes API, reboots it, waits for it to be Ready and
//! uncordons it (siderolabs/talos `cmd/talosctl/cmd/talos/upgrade.go`
//! `upgradeViaLifecycleService`, `drain.go`, `cmd/talosctl/pkg/talos/
//! nodedrain/nodedrain.go`: kubectl's drain helper with `Force`,
//! `IgnoreAllDaemonSets` and `DeleteEmptyDirData`, 5 minutes by default).
//! The node's own Reboot sequence only stops its pods
//! (`v1alpha1_sequencer.go` `Reboot`), and Talos uncordons only a node it
//! cordoned itself (`controllers/k8s/node_apply.go` `ApplyCordoned`), so
//! the uncordon is the client's too. Like Talos, imgbuild marks a node it
//! cordons ([`CORDONED_BY`]) and undoes only such a cordon: a node an admin
//! cordoned is drained for its reboot and stays cordoned.

use std::time::Duration;

use serde_json::{Value, json};

use crate::talos::bootstrap::{Options, Plan};
use crate::talos::health::{CORDONED_BY, HealthError, kube_nodes, kubeconfig};
use crate::talos::kube::{KubeError, Kubeconfig};

/// Why a cordon, drain or uncordon did not finish.
#[derive(Debug, thiserror::Error)]
pub enum DrainError {
    /// The kubeconfig could not be read.
    #[error(transparent)]
    Health(#[from] HealthError),
    #[error("cordoning: {0}")]
    Cordon(#[source] CallError),
    #[error("draining: {0}")]
    List(#[source] CallError),
    /// Pods still on the node when the drain timeout ran out, with the
    /// last refused eviction (a PodDisruptionBudget's 429).
    #[error("draining: {} still on the node after {timeout:?}{}", left.join(", "),
        last.as_ref().map_or(String::new(), |l| format!(" ({l})")))]
    Stuck {
        left: Vec<String>,
        timeout: Duration,
        last: Option<String>,
    },
    #[error("uncordoning: {0}")]
    Uncordon(#[source] CallError),
    #[error("the Kubernetes node was not Ready within {timeout:?}; it stays cordoned")]
    NotReady { timeout: Duration },
    /// SIGINT during the drain: what it left, and how to resume.
    #[error(
        "interrupted (SIGINT) while draining: {node} is left cordoned, the pods evicted so far \
         stay evicted, and it was not rebooted (its new version is installed and boots with its \
         next reboot). Run `imgbuild upgrade` again to resume: it uncordons {node} once it is \
         Ready, then drains and reboots it again; or `kubectl uncordon {node}` to give up"
    )]
    Interrupted { node: String },
}

/// A blocking Kubernetes call run off the async runtime.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error(transparent)]
    Kube(#[from] KubeError),
    /// The blocking task panicked or was cancelled.
    #[error("{0}")]
    Join(#[from] tokio::task::JoinError),
}

/// talosctl's `--drain-timeout` default (`nodedrain.DefaultDrainTimeout`).
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(300);

/// Whether kubectl's drain evicts `pod`: not one a DaemonSet owns (it would
/// come straight back), not a mirror pod (the kubelet's static pods), not
/// one that has finished.
pub fn evictable(pod: &Value) -> bool {
    let daemon = pod["metadata"]["ownerReferences"]
        .as_array()
        .is_some_and(|o| o.iter().any(|r| r["kind"] == "DaemonSet"));
    let mirror = pod["metadata"]["annotations"]
        .get("kubernetes.io/config.mirror")
        .is_some();
    let finished = matches!(
        pod["status"]["phase"].as_str(),
        Some("Succeeded" | "Failed")
    );
    !daemon && !mirror && !finished
}

/// `namespace/name` of a pod.
fn key(pod: &Value) -> String {
    format!(
        "{}/{}",
        pod["metadata"]["namespace"].as_str().unwrap_or(""),
        pod["metadata"]["name"].as_str().unwrap_or("")
    )
}

/// Runs a blocking Kubernetes call off the async runtime.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, KubeError> + Send + 'static,
) -> Result<T, CallError> {
    Ok(tokio::task::spawn_blocking(f).await??)
}

/// Sets `spec.unschedulable` of Kubernetes node `name` (kubectl's cordon:
/// a strategic merge patch of the node).
async fn set_unschedulable(
    kc: &Kubeconfig,
    name: &str,
    on: bool,
    t: Duration,
) -> Result<(), CallError> {
    let (kc, path) = (kc.clone(), format!("/api/v1/nodes/{name}"));
    blocking(move || {
        // The mark goes and comes with the cordon, in one patch.
        let mark = on.then(|| time::OffsetDateTime::now_utc().unix_timestamp().to_string());
        kc.send_json(
            reqwest::Method::PATCH,
            &path,
            Some((
                "application/strategic-merge-patch+json",
                &json!({"metadata": {"annotations": {CORDONED_BY: mark}},
                        "spec": {"unschedulable": on}}),
            )),
            t,
        )
        .map(|_| ())
    })
    .await
}

/// The pods kubectl's drain evicts from node `name`, by `namespace/name`.
async fn evictable_pods(kc: &Kubeconfig, name: &str, t: Duration) -> Result<Vec<Value>, CallError> {
    let kc = kc.clone();
    let path = format!("/api/v1/pods?fieldSelector=spec.nodeName%3D{name}");
    let list = blocking(move || kc.get_json(&path, t)).await?;
    Ok(list["items"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[])
        .iter()
        .filter(|p| evictable(p))
        .cloned()
        .collect())
}

/// Cordons Kubernetes node `name` (unless it is cordoned already: then it
/// is not imgbuild's to undo), then evicts its pods (a refused eviction, a
/// PodDisruptionBudget's 429, is retried) and waits until they are gone,
/// within `timeout`. Whether this call cordoned it.
pub async fn cordon_and_drain(
    plan: &Plan,
    name: &str,
    timeout: Duration,
    opts: &Options,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<bool, DrainError> {
    let kc = kubeconfig(plan)?;
    let t = opts.call_timeout;
    let mut pace = super::pace::Pace::new(opts.poll, timeout);
    let already = kube_nodes(plan, opts)
        .await?
        .iter()
        .any(|n| n.name == name && n.cordoned);
    if already {
        progress("already cordoned, not by imgbuild: drained, and left cordoned");
    } else {
        progress("cordoning the Kubernetes node");
        set_unschedulable(&kc, name, true, t)
            .await
            .map_err(DrainError::Cordon)?;
    }
    progress("draining the Kubernetes node");
    loop {
        let pods = evictable_pods(&kc, name, t)
            .await
            .map_err(DrainError::List)?;
        if pods.is_empty() {
            return Ok(!already);
        }
        let mut last = None;
        for pod in &pods {
            let (ns, pod_name) = (
                pod["metadata"]["namespace"].as_str().unwrap_or(""),
                pod["metadata"]["name"].as_str().unwrap_or(""),
            );
            let path = format!("/api/v1/namespaces/{ns}/pods/{pod_name}/eviction");
            let body = json!({
                "apiVersion": "policy/v1",
                "kind": "Eviction",
                "metadata": {"name": pod_name, "namespace": ns},
            });
            let kc = kc.clone();
            if let Err(e) = blocking(move || {
                kc.send_json(
                    reqwest::Method::POST,
                    &path,
                    Some(("application/json", &body)),
                    t,
                )
            })
            .await
            {
                last = Some(format!("evicting {}: {e}", key(pod)));
            }
        }
        if !pace.wait().await {
            return Err(DrainError::Stuck {
                left: pods.iter().map(key).collect(),
                timeout,
                last,
            });
        }
    }
}

/// What [`uncordon_when_ready`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Uncordon {
    /// imgbuild's cordon undone, or none there any more.
    Done,
    /// Cordoned, but not by imgbuild: left as it is.
    NotOurs,
}

/// Waits (within `timeout`) for Kubernetes node `name` to be Ready again,
/// then uncordons it, as talosctl does after the reboot, when the cordon
/// is imgbuild's.
pub async fn uncordon_when_ready(
    plan: &Plan,
    name: &str,
    timeout: Duration,
    opts: &Options,
) -> Result<Uncordon, DrainError> {
    let kc = kubeconfig(plan)?;
    let mut pace = super::pace::Pace::new(opts.poll, timeout);
    loop {
        let nodes = kube_nodes(plan, opts).await.unwrap_or_default();
        if let Some(n) = nodes.iter().find(|n| n.name == name && n.ready) {
            return match (n.cordoned, n.cordoned_by_imgbuild) {
                (false, _) => Ok(Uncordon::Done),
                (true, false) => Ok(Uncordon::NotOurs),
                (true, true) => set_unschedulable(&kc, name, false, opts.call_timeout)
                    .await
                    .map(|()| Uncordon::Done)
                    .map_err(DrainError::Uncordon),
            };
        }
        if !pace.wait().await {
            return Err(DrainError::NotReady { timeout });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn daemonset_mirror_and_finished_pods_are_left_alone() {
        let pod = |owner: &str, annotations: Value, phase: &str| {
            json!({
                "metadata": {"name": "p", "namespace": "kube-system", "annotations": annotations,
                             "ownerReferences": [{"kind": owner, "name": "x"}]},
                "status": {"phase": phase},
            })
        };
        assert!(evictable(&pod("ReplicaSet", json!({}), "Running")));
        assert!(!evictable(&pod("DaemonSet", json!({}), "Running")));
        assert!(!evictable(&pod(
            "Node",
            json!({"kubernetes.io/config.mirror": "abc"}),
            "Running"
        )));
        assert!(!evictable(&pod("ReplicaSet", json!({}), "Succeeded")));
        assert!(evictable(&json!({"metadata": {"name": "bare"}})));
    }
}

/// Set by SIGINT while an [`InterruptibleDrain`] is alive.
static INTERRUPTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    INTERRUPTED.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// SIGINT caught for the length of a drain, so that the run can say what
/// the drain left (a cordoned node, pods evicted) and how a rerun resumes,
/// instead of dying silently; the previous disposition comes back on drop
/// (elsewhere a SIGINT kills the run as before, and the record already
/// says what a rerun resumes).
pub struct InterruptibleDrain {
    previous: libc::sigaction,
}

impl InterruptibleDrain {
    pub fn new() -> InterruptibleDrain {
        INTERRUPTED.store(false, std::sync::atomic::Ordering::SeqCst);
        // SAFETY: the handler only stores to an atomic; `previous` is
        // written by sigaction before it is read.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_sigint as *const () as usize;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            let mut previous: libc::sigaction = std::mem::zeroed();
            libc::sigaction(libc::SIGINT, &action, &mut previous);
            InterruptibleDrain { previous }
        }
    }

    /// Resolves once SIGINT arrived (checked every 50 ms).
    pub async fn interrupted(&self) {
        while !INTERRUPTED.load(std::sync::atomic::Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Default for InterruptibleDrain {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for InterruptibleDrain {
    fn drop(&mut self) {
        // SAFETY: restores the disposition saved in `new`.
        unsafe { libc::sigaction(libc::SIGINT, &self.previous, std::ptr::null_mut()) };
    }
}

/// What a SIGINT during `node`'s drain left, and how a rerun resumes.
pub fn interrupted_drain(node: &str) -> DrainError {
    DrainError::Interrupted {
        node: node.to_owned(),
    }
}

#[cfg(test)]
mod sigint {
    use super::*;

    /// A SIGINT during the drain is caught (the test process survives)
    /// and reported; afterwards the previous disposition is back.
    #[test]
    fn sigint_during_a_drain_is_caught_and_the_old_handler_restored() {
        let current = || unsafe {
            let mut now: libc::sigaction = std::mem::zeroed();
            libc::sigaction(libc::SIGINT, std::ptr::null(), &mut now);
            now.sa_sigaction
        };
        let before = current();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let guard = InterruptibleDrain::new();
            assert_eq!(current(), on_sigint as *const () as usize);
            // SAFETY: raising a signal this process handles.
            unsafe { libc::raise(libc::SIGINT) };
            tokio::time::timeout(Duration::from_secs(30), guard.interrupted())
                .await
                .expect("the SIGINT was not seen");
        });
        assert_eq!(current(), before, "the previous SIGINT handler is back");
        let said = interrupted_drain("cp-01").to_string();
        assert!(said.contains("cp-01 is left cordoned"), "{said}");
        assert!(
            said.contains("Run `imgbuild upgrade` again to resume"),
            "{said}"
        );
    }
}
