//! A node's boots: the boot ID (`/proc/sys/kernel/random/boot_id`, new on
//! every boot, which talosctl's `BootIDChangedPostCheckFn` watches), the
//! down/up timeline, and the sequences that end in a reboot. machined runs
//! one sequence at a time (`internal/app/machined/pkg/runtime/v1alpha1/
//! v1alpha1_controller.go`: a second one without takeover fails with
//! "locked"); Upgrade cordons and drains first, Reboot does not
//! (`v1alpha1_sequencer.go`: `Upgrade` starts with `CordonAndDrainNode`,
//! `Reboot` with `StopAllPods`), and the boot after uncordons the node
//! (`Boot`: `UncordonNode`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::state::Outage;
use super::state::{Cluster, NodeState};
use super::state::{Life, new_boot_id};

impl Life {
    pub fn boot_id(&self) -> &str {
        self.boot_ids.last().map_or("", String::as_str)
    }

    pub fn busy(&self, now: Instant) -> bool {
        self.busy_until.is_some_and(|t| now < t)
    }

    pub fn draining(&self, now: Instant) -> bool {
        self.draining_until.is_some_and(|t| now < t)
    }

    /// Whether a sequence has stopped the services (etcd) and the node is
    /// not back up yet.
    pub fn services_stopped(&self, now: Instant) -> bool {
        self.busy(now) && self.services_stop_at.is_some_and(|t| now >= t)
    }
}

/// A sequence that ends in a reboot: drain for `drain` (cordoned, still
/// answering), stop for `stop`, down for `down`. `then` runs as the node
/// goes down and says why it rebooted (an upgrade may turn into a revert).
pub(crate) struct Sequence {
    pub drain: Duration,
    pub stop: Duration,
    pub down: Duration,
    pub then: Box<dyn FnOnce(&mut NodeState) -> &'static str + Send>,
}

impl Cluster {
    fn ms_since_start(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.started).as_millis() as u64
    }

    /// Runs `seq` on node `i` (the caller checked that none runs): the
    /// node is busy from now until it is back up.
    pub(crate) fn run_sequence(self: &Arc<Self>, i: usize, seq: Sequence) {
        let now = Instant::now();
        let drained = now + seq.drain;
        let down_at = drained + seq.stop;
        let up_at = down_at + seq.down;
        {
            let node = self.node(i);
            let mut st = node.st.lock().unwrap();
            st.day2.life.busy_until = Some(up_at);
            st.day2.life.services_stop_at = Some(drained);
            if !seq.drain.is_zero() {
                st.day2.life.cordoned = true;
                st.day2.life.draining_until = Some(drained);
            }
        }
        let cluster = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep_until(down_at.into()).await;
            let node = cluster.node(i);
            {
                let mut st = node.st.lock().unwrap();
                // What LifecycleService.Upgrade installed boots now.
                if let Some((version, schematic)) = st.day2.next_boot.take() {
                    st.day2.version = Some(version);
                    if schematic.is_some() {
                        st.day2.schematic = schematic;
                        st.day2.stock = false;
                    }
                }
                // The system containerd's images live in memory: gone with the
                // boot (the CRI one's stay on EPHEMERAL).
                st.day2.pulled.clear();
                st.day2
                    .images
                    .retain(|(place, _)| *place != super::k8s::pods::SYSTEM_SYSTEM);
                let why = (seq.then)(&mut st);
                // A TRY config was never persisted: the boot runs the one
                // that was (or what is staged).
                if let Some(r) = st.day2.try_rollback.take() {
                    st.applied = Some(r.previous);
                }
                let staged = st.day2.staged.take();
                if let Some(staged) = staged {
                    st.applied = Some(staged);
                    st.mtls = None;
                }
                st.down_until = Some(up_at);
                st.configured_at = Some(up_at);
                let life = &mut st.day2.life;
                life.reboots += 1;
                life.pods_gone = true;
                let id = new_boot_id(&node.name, life.boot_ids.len());
                life.boot_ids.push(id);
                life.outages.push(Outage {
                    down: down_at,
                    up: up_at,
                    why,
                });
            }
            node.bump();
            tokio::time::sleep_until(up_at.into()).await;
            {
                let mut st = node.st.lock().unwrap();
                let day2 = &mut st.day2;
                if !day2.leave_cordoned && !day2.life.cordoned_by_client {
                    day2.life.cordoned = false;
                }
            }
            node.bump();
        });
    }

    /// A node's outages for stats: `[{"down_ms","up_ms","why"}]`, `up_ms`
    /// null while it is still down.
    pub(crate) fn outages_json(&self, life: &Life, now: Instant) -> Vec<Value> {
        life.outages
            .iter()
            .map(|o| {
                json!({
                    "down_ms": self.ms_since_start(o.down),
                    "up_ms": (now >= o.up).then(|| self.ms_since_start(o.up)),
                    "why": o.why,
                })
            })
            .collect()
    }

    /// Every node's outages, by the time each went down.
    pub(crate) fn timeline_json(&self, now: Instant) -> Vec<Value> {
        let mut all: Vec<Value> = self
            .all()
            .iter()
            .flat_map(|n| {
                let name = n.display_name();
                let cp = n.control_plane();
                let life = n.st.lock().unwrap().day2.life.clone();
                self.outages_json(&life, now).into_iter().map(move |mut o| {
                    o["node"] = json!(name);
                    o["control_plane"] = json!(cp);
                    o
                })
            })
            .collect();
        all.sort_by_key(|o| o["down_ms"].as_u64());
        all
    }

    pub(crate) fn now_ms(&self) -> u64 {
        self.ms_since_start(Instant::now())
    }
}

impl super::service::Api {
    /// MachineService.Read of node `i` (machined streams the file): the
    /// boot ID and the persisted config are the files this node has.
    pub(crate) fn read_on(
        &self,
        i: usize,
        path: &str,
    ) -> Result<Vec<imgbuild::talos::api::common::Data>, tonic::Status> {
        let node = self.cluster.node(i);
        let mut st = node.st.lock().unwrap();
        st.day2.read_calls += 1;
        let bytes = match path {
            BOOT_ID => format!("{}\n", st.day2.life.boot_id()).into_bytes(),
            // `constants.ConfigPath`, on the STATE partition: what the next
            // boot loads (every version writes it on a non-TRY apply).
            CONFIG_PATH => match st.persisted() {
                Some(a) => a.raw.clone().into_bytes(),
                None => return Err(not_found(path)),
            },
            // Read stats the path first: codes.NotFound for a missing file.
            _ => return Err(not_found(path)),
        };
        Ok(vec![imgbuild::talos::api::common::Data {
            metadata: None,
            bytes,
        }])
    }
}

/// Where Linux shows the boot ID.
const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

/// Where Talos keeps the persisted machine config (`constants.ConfigPath`).
const CONFIG_PATH: &str = "/system/state/config.yaml";

/// machined's `Read` of a missing file (`os.Stat` fails: codes.NotFound).
fn not_found(path: &str) -> tonic::Status {
    tonic::Status::not_found(format!("stat {path}: no such file or directory"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boot_ids_are_uuids_and_differ_per_boot() {
        let a = new_boot_id("cp-01", 0);
        let b = new_boot_id("cp-01", 1);
        assert_ne!(a, b);
        let groups: Vec<usize> = a.split('-').map(str::len).collect();
        assert_eq!(groups, [8, 4, 4, 4, 12], "{a}");
    }
}
