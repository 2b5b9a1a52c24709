//! Node removal: `MachineService.EtcdLeaveCluster`,
//! `EtcdRemoveMemberByID` and `Reset` as siderolabs/talos
//! `internal/app/machined/internal/server/v1alpha1/v1alpha1_server.go`
//! answers them (the same from v1.9 to v1.14 unless said), etcd's own rule
//! for removing a member (etcd `server/etcdserver/server.go`
//! `mayRemoveMember`, `api/membership/cluster.go`
//! `IsReadyToRemoveVotingMember`: the started members other than the one
//! removed must be a quorum of the others), and the Kubernetes Node DELETE.
//!
//! - EtcdLeaveCluster / EtcdRemoveMemberByID on a worker: Unimplemented
//!   "etcd leave / etcd remove member is only available on control plane
//!   nodes" (`checkControlplane`, `internal/app/internal/machinehelper`).
//! - EtcdLeaveCluster (`internal/pkg/etcd/etcd.go` `LeaveCluster`): the node
//!   removes its own member (refused as etcd refuses, the only member
//!   included), stops etcd and empties its data. A member already gone is
//!   done from v1.9.1 (talos commit f98efb3, "ignore member not found error
//!   on leave cluster"); v1.9.0 fails with etcd's "member not found".
//! - EtcdRemoveMemberByID: NotFound for an unknown ID; else etcd's rule.
//! - EtcdForfeitLeadership (`v1alpha1_server.go`, `pkg/etcd/etcd.go`
//!   `ForfeitLeadership`, v1.9–v1.14): on a worker Unimplemented
//!   (`checkControlplane`); the only member → "cannot forfeit leadership,
//!   only one member"; a node whose member is gone → "failed to find …
//!   in list of etcd members"; on the leading member's node, leadership
//!   moves to the first other member, whose name is answered; on any
//!   other, an empty answer. The modelled etcd's leader is the
//!   lowest-numbered member until a forfeit moves it.
//! - Reset (`v1alpha1_server.go` `Reset`, `v1alpha1_sequencer.go` `Reset`,
//!   `v1alpha1_sequencer_tasks.go` `LeaveEtcd`): labels to wipe must be
//!   volumes the node has; USER_DISKS with labels, SYSTEM_DISK with user
//!   disks are refused. Acked at once; the sequence then runs: graceful →
//!   cordon and drain, then (control plane) leave etcd — refused as etcd
//!   refuses, which fails the sequence and leaves the node up — then the
//!   wipe and, with `reboot` false, power off: the node never answers
//!   again (`--upgrade-delay` after the ack). `reboot` true is not modelled
//!   and refused (FailedPrecondition), never taken more leniently.
//! - `DELETE /api/v1/nodes/{name}`: 404 for a Node not listed. A Node a
//!   replaced machine left (`health.rs` orphans) is deleted by name and
//!   logged as `DeleteNode` with `kubelet_running: false`, not in
//!   `deleted_nodes` (which names slots). A Node whose
//!   kubelet still runs registers again at once (the kubelet's
//!   `registerWithAPIServer`), so only a node that is down stays deleted.
//!
//! `GET /_sim/stats` → `removals`: `{"calls": [{"node", "via", "call",
//! "ok", "error", "at_ms", …}], "left_etcd": [NAME], "deleted_nodes":
//! [NAME]}`; each Reset call carries `cordoned`, `evictions` and `pods_left`
//! (evictable pods still on it) as the node was when it came, each DeleteNode `kubelet_running`, and the reset sequence
//! logs a `ResetSequence` entry (its `left_etcd`, or why it failed).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use serde_json::{Value, json};
use tonic::{Request, Response, Status};

use super::health::STALE_MEMBER_ID;
use super::service::Api;
use super::state::{Cluster, ControlReply, Phase, ms, reached};
use super::version::Talos;
use super::volumes::{self, Wipe};
use imgbuild::talos::api::machine::reset_request::WipeMode;
use imgbuild::talos::api::machine::*;

/// etcd's refusal when the others would lose quorum.
const NOT_ENOUGH: &str = "etcdserver: re-configuration failed due to not enough started members";

impl Cluster {
    /// Node `i`'s member was removed from etcd (its etcd stopped).
    pub(crate) fn left_etcd(&self, i: usize) -> bool {
        self.removals.lock().unwrap().left_etcd.contains(&i)
    }

    /// A machine with no etcd data (a new one, or one whose EPHEMERAL a
    /// Reset wiped) boots in slot `i`: as a control plane it joins etcd as
    /// a new member, as Talos's etcd service does on a bootstrapped cluster.
    pub(crate) fn rejoin_etcd(&self, i: usize) {
        self.removals.lock().unwrap().left_etcd.remove(&i);
        if let Some(real) = &self.real_etcd {
            real.wipe(i);
        }
    }

    /// With `--real-etcd`: etcd's `member remove ID` through node `via`'s
    /// member (Talos's local client), etcd deciding; the node whose member
    /// it was has left (its etcd stopped, its data gone).
    fn remove_real(&self, via: usize, id: u64) -> Result<(), String> {
        let real = self.real_etcd.as_ref().expect("--real-etcd");
        let name = real
            .list(self, via)?
            .into_iter()
            .find(|m| m.id == id)
            .map(|m| m.name);
        real.remove(self, via, id)?;
        if let Some(j) = name.and_then(|n| real.index_of(&n)) {
            self.removals.lock().unwrap().left_etcd.insert(j);
            real.wipe(j);
        }
        Ok(())
    }

    /// Node `i` leaves etcd as Talos's `LeaveCluster` does: its own member
    /// ID from its member, then that member removed. Err: (member ID, why).
    /// Node `i` leaves through its own member, as Talos's `LeaveCluster`
    /// does, retrying what Talos retries until `--etcd-unhealthy-retry`:
    /// - "unhealthy cluster": fewer than a quorum of the voting members
    ///   connected for etcd's 5 s health interval (etcd `mayRemoveMember`:
    ///   a member that is down, or one that just joined), every second;
    /// - "server stopped": the member was removed and stopped before it
    ///   answered; the retry (through another member) then meets "member
    ///   not found", which v1.9.1 on takes as done (talos f98efb3) and
    ///   v1.9.0 returns.
    ///
    /// "not enough started members" (the only member, or one that never
    /// started) is not retried.
    fn leave_real(&self, i: usize) -> Result<(), (Option<u64>, String)> {
        let real = self.real_etcd.as_ref().expect("--real-etcd");
        let id = real.own_id(self, i).map_err(|e| (None, e))?;
        let until = Instant::now() + super::state::ms(self.args.etcd_unhealthy_retry);
        let tag = self
            .node(i)
            .st
            .lock()
            .unwrap()
            .day2
            .version_or(&self.args.talos_version);
        let ignore_missing = Talos::parse(&tag).is_some_and(|t| leave_ignores_missing(&t));
        let mut via = i;
        let mut errors: Vec<String> = Vec::new();
        loop {
            match self.remove_real(via, id) {
                Err(e) if e.contains("unhealthy cluster") && Instant::now() < until => {
                    std::thread::sleep(std::time::Duration::from_secs(1));
                }
                Err(e) if e.contains("server stopped") && Instant::now() < until => {
                    errors.push(format!("failed to remove member {id}: {e}"));
                    match real.healthy_index_except(i) {
                        Some(other) => via = other,
                        None => return Err((Some(id), e)),
                    }
                }
                Err(e) if via != i && e.contains("member not found") => {
                    self.removals.lock().unwrap().left_etcd.insert(i);
                    real.wipe(i);
                    if ignore_missing {
                        return Ok(());
                    }
                    errors.push(format!("failed to remove member {id}: {e}"));
                    return Err((
                        Some(id),
                        format!("{} error(s) occurred: {}", errors.len(), errors.join("; ")),
                    ));
                }
                done => return done.map_err(|e| (Some(id), e)),
            }
        }
    }

    /// Node `i`'s Kubernetes Node was deleted and its kubelet is gone.
    pub(crate) fn k8s_node_deleted(&self, i: usize) -> bool {
        self.removals.lock().unwrap().deleted.contains(&i) && self.node(i).halted()
    }

    fn log(&self, entry: Value) {
        let mut e = entry;
        e["at_ms"] = json!(self.now_ms());
        self.removals.lock().unwrap().calls.push(e);
    }

    /// `removals` in `/_sim/stats`.
    pub(crate) fn removal_stats(&self) -> Value {
        let r = self.removals.lock().unwrap();
        let names = |set: &BTreeSet<usize>| -> Vec<String> {
            set.iter().map(|&i| self.node(i).display_name()).collect()
        };
        json!({
            "calls": r.calls,
            "left_etcd": names(&r.left_etcd),
            "deleted_nodes": names(&r.deleted),
        })
    }

    /// The voting members as etcd holds them: every control plane that
    /// joined and was not removed (up or down), by index.
    fn members(&self) -> Vec<usize> {
        (0..self.count())
            .filter(|&j| self.etcd_start(j).is_some())
            .collect()
    }

    /// Whether member `j` is started: its node up, its services running
    /// and its etcd healthy.
    fn started(&self, j: usize, now: Instant) -> bool {
        let node = self.node(j);
        let stopped = node.st.lock().unwrap().day2.life.services_stopped(now);
        node.phase(now) == Phase::Configured && !stopped && reached(self.etcd_healthy_at(j), now)
    }

    /// etcd's rule for removing member `id`: the started members besides
    /// it must be a quorum of those others. A stale member counts as one
    /// that never started.
    fn may_remove(&self, removing: Option<usize>, now: Instant) -> Result<(), String> {
        let others: Vec<usize> = self
            .members()
            .into_iter()
            .filter(|&j| Some(j) != removing)
            .collect();
        let stale = self.facts.lock().unwrap().stale_etcd_member;
        let total = others.len() + usize::from(stale && removing.is_some());
        let started = others.iter().filter(|&&j| self.started(j, now)).count();
        if started < total / 2 + 1 {
            return Err(NOT_ENOUGH.to_owned());
        }
        Ok(())
    }

    /// Removes member `j` (or the stale member for None) under etcd's rule.
    fn remove_member(&self, j: Option<usize>, now: Instant) -> Result<(), String> {
        self.may_remove(j, now)?;
        match j {
            Some(j) => {
                self.removals.lock().unwrap().left_etcd.insert(j);
            }
            None => self.facts.lock().unwrap().stale_etcd_member = false,
        }
        Ok(())
    }
}

fn member_id(j: usize) -> u64 {
    0x1000 + j as u64
}

/// Whether node version `t` treats a missing member as left (v1.9.1 on).
fn leave_ignores_missing(t: &Talos) -> bool {
    (t.major, t.minor, t.patch) >= (1, 9, 1)
}

impl Api {
    pub(crate) fn control_plane_only(&self, i: usize, api: &str) -> Result<(), Status> {
        if self.cluster.node(i).control_plane() {
            Ok(())
        } else {
            Err(Status::unimplemented(format!(
                "{api} is only available on control plane nodes"
            )))
        }
    }

    /// Logs a call about node `node` served by node `i`.
    fn logged<T>(&self, node: &str, call: &str, extra: Value, result: &Result<T, Status>) {
        let mut e = json!({
            "node": node,
            "via": self.cluster.node(self.me).display_name(),
            "call": call,
            "ok": result.is_ok(),
            "error": result.as_ref().err().map(|s| s.message().to_owned()),
        });
        if let (Some(m), Some(x)) = (e.as_object_mut(), extra.as_object()) {
            m.extend(x.clone());
        }
        self.cluster.log(e);
    }

    fn leave_on(&self, i: usize) -> Result<EtcdLeaveCluster, Status> {
        let result = (|| {
            self.control_plane_only(i, "etcd leave")?;
            let now = Instant::now();
            if self.cluster.left_etcd(i) {
                return if leave_ignores_missing(&self.talos(i)) {
                    Ok(())
                } else {
                    Err(Status::unknown(format!(
                        "failed to leave cluster: failed to remove member {}: etcdserver: member not found",
                        member_id(i)
                    )))
                };
            }
            if !reached(self.cluster.etcd_start(i), now) {
                return Err(Status::unknown(
                    "failed to get local etcd member ID: context deadline exceeded",
                ));
            }
            if self.cluster.real_etcd.is_some() {
                return self.cluster.leave_real(i).map_err(|(id, e)| match id {
                    None => Status::unknown(format!("failed to get local etcd member ID: {e}")),
                    Some(id) => Status::unknown(format!(
                        "failed to leave cluster: failed to remove member {id}: {e}"
                    )),
                });
            }
            self.cluster.remove_member(Some(i), now).map_err(|e| {
                Status::unknown(format!(
                    "failed to leave cluster: failed to remove member {}: {e}",
                    member_id(i)
                ))
            })
        })();
        let name = self.cluster.node(i).display_name();
        self.logged(&name, "EtcdLeaveCluster", json!({}), &result);
        result.map(|()| EtcdLeaveCluster { metadata: None })
    }

    /// `EtcdForfeitLeadership` (`v1alpha1_server.go`, `pkg/etcd`
    /// `ForfeitLeadership`): control planes only; when this node's member
    /// leads, leadership moves to another member (etcd `MoveLeader`) and
    /// that member's name is the answer; otherwise the answer is empty.
    fn forfeit_on(&self, i: usize) -> Result<EtcdForfeitLeadership, Status> {
        let result = (|| {
            self.control_plane_only(i, "etcd forfeit leadership")?;
            if !reached(self.cluster.etcd_start(i), Instant::now()) {
                return Err(Status::unknown(
                    "failed to get local etcd member ID: context deadline exceeded",
                ));
            }
            if let Some(real) = &self.cluster.real_etcd {
                return real
                    .forfeit(&self.cluster, i)
                    .map_err(|e| Status::unknown(format!("failed to move leadership: {e}")));
            }
            let members = self.cluster.members();
            if members.len() == 1 {
                return Err(Status::unknown(
                    "failed to forfeit leadership: cannot forfeit leadership, only one member",
                ));
            }
            if !members.contains(&i) {
                return Err(Status::unknown(format!(
                    "failed to forfeit leadership: failed to find \"{:016x}\" in list of etcd members",
                    member_id(i)
                )));
            }
            let mut removals = self.cluster.removals.lock().unwrap();
            let leader = removals
                .leader
                .filter(|l| members.contains(l))
                .or(members.first().copied());
            if leader != Some(i) {
                return Ok(String::new());
            }
            let Some(&to) = members.iter().find(|&&j| j != i) else {
                return Ok(String::new());
            };
            removals.leader = Some(to);
            Ok(self.cluster.node(to).display_name())
        })();
        let name = self.cluster.node(i).display_name();
        let to = result.as_deref().unwrap_or_default();
        self.logged(&name, "EtcdForfeitLeadership", json!({"to": to}), &result);
        result.map(|member| EtcdForfeitLeadership {
            metadata: None,
            member,
        })
    }

    pub(crate) fn etcd_forfeit_leadership_call(
        &self,
        req: Request<EtcdForfeitLeadershipRequest>,
    ) -> Result<Response<EtcdForfeitLeadershipResponse>, Status> {
        let messages = self.answer(&req, |i| Ok(vec![self.forfeit_on(i)?]))?;
        Ok(Response::new(EtcdForfeitLeadershipResponse { messages }))
    }

    pub(crate) fn etcd_leave_cluster_call(
        &self,
        req: Request<EtcdLeaveClusterRequest>,
    ) -> Result<Response<EtcdLeaveClusterResponse>, Status> {
        let messages = self.answer(&req, |i| Ok(vec![self.leave_on(i)?]))?;
        Ok(Response::new(EtcdLeaveClusterResponse { messages }))
    }

    fn remove_by_id_on(&self, i: usize, id: u64) -> Result<EtcdRemoveMemberById, Status> {
        let mut name = format!("member {id:x}");
        let result = (|| {
            self.control_plane_only(i, "etcd remove member")?;
            let now = Instant::now();
            let stale = self.cluster.facts.lock().unwrap().stale_etcd_member;
            if let (Some(real), false) = (&self.cluster.real_etcd, id == STALE_MEMBER_ID && stale) {
                if let Some(m) = real
                    .list(&self.cluster, i)
                    .ok()
                    .and_then(|l| l.into_iter().find(|m| m.id == id))
                {
                    name = m.name;
                }
                return self.cluster.remove_real(i, id).map_err(|e| {
                    let text = format!("failed to remove member {id}: {e}");
                    if e.contains("member not found") {
                        Status::not_found(text)
                    } else {
                        Status::unknown(format!("failed to remove member: {text}"))
                    }
                });
            }
            let target = if id == STALE_MEMBER_ID && stale {
                None
            } else {
                let j = self
                    .cluster
                    .members()
                    .into_iter()
                    .find(|&j| member_id(j) == id)
                    .ok_or_else(|| {
                        Status::not_found(format!(
                            "failed to remove member {id}: etcdserver: member not found"
                        ))
                    })?;
                name = self.cluster.node(j).display_name();
                Some(j)
            };
            self.cluster.remove_member(target, now).map_err(|e| {
                Status::unknown(format!(
                    "failed to remove member: failed to remove member {id}: {e}"
                ))
            })
        })();
        self.logged(
            &name,
            "EtcdRemoveMemberByID",
            json!({"member_id": id}),
            &result,
        );
        result.map(|()| EtcdRemoveMemberById { metadata: None })
    }

    pub(crate) fn etcd_remove_member_by_id_call(
        &self,
        req: Request<EtcdRemoveMemberByIdRequest>,
    ) -> Result<Response<EtcdRemoveMemberByIdResponse>, Status> {
        let id = req.get_ref().member_id;
        let messages = self.answer(&req, |i| Ok(vec![self.remove_by_id_on(i, id)?]))?;
        Ok(Response::new(EtcdRemoveMemberByIdResponse { messages }))
    }

    /// Checks a Reset request to node `i` as `Reset` does before the
    /// sequence starts; what it will wipe (`volumes.rs`, per version).
    fn check_reset(&self, i: usize, req: &ResetRequest) -> Result<Wipe, Status> {
        let mode = WipeMode::try_from(req.mode).unwrap_or(WipeMode::All);
        if !req.user_disks_to_wipe.is_empty() {
            if mode == WipeMode::SystemDisk {
                return Err(Status::unknown(
                    "reset failed: invalid input, wipe mode SYSTEM_DISK doesn't support UserDisksToWipe parameter",
                ));
            }
            for d in &req.user_disks_to_wipe {
                let known = self
                    .cluster
                    .args
                    .disks
                    .iter()
                    .position(|id| format!("/dev/{id}") == *d);
                match known {
                    None => {
                        return Err(Status::unknown(format!(
                            "reset user disk failed: device {d} wasn't found"
                        )));
                    }
                    Some(0) => {
                        return Err(Status::unknown(format!(
                            "reset user disk failed: device {d} is the system disk"
                        )));
                    }
                    Some(_) => {}
                }
            }
        }
        if !req.system_partitions_to_wipe.is_empty() && mode == WipeMode::UserDisks {
            return Err(Status::unknown(
                "reset failed: invalid input, wipe mode USER_DISKS doesn't support SystemPartitionsToWipe parameter",
            ));
        }
        let talos = self.talos(i);
        let raw = {
            let node = self.cluster.node(i);
            let st = node.st.lock().unwrap();
            st.applied
                .as_ref()
                .map(|a| a.raw.clone())
                .unwrap_or_default()
        };
        let specs: Vec<(String, bool)> = req
            .system_partitions_to_wipe
            .iter()
            .map(|p| (p.label.clone(), p.wipe))
            .collect();
        let wipe = match mode {
            // USER_DISKS leaves the system disk alone.
            WipeMode::UserDisks => Wipe {
                volumes: Vec::new(),
                config: false,
                etcd_data: false,
            },
            _ => volumes::plan(&talos, &volumes::dedicated(&talos, &raw), &specs)
                .map_err(Status::unknown)?,
        };
        if req.reboot {
            return Err(Status::failed_precondition(
                "imgbuild-sim models Reset with reboot=false only",
            ));
        }
        Ok(wipe)
    }

    fn reset_on(&self, i: usize, req: &ResetRequest) -> Result<Reset, Status> {
        let node = self.cluster.node(i);
        let name = node.display_name();
        let (cordoned, evictions) = {
            let life = &node.st.lock().unwrap().day2.life;
            (life.cordoned, life.evictions)
        };
        // What kubectl's drain would still evict: not a DaemonSet's, not a
        // mirror pod.
        let pods_left = super::health::pods_now(&self.cluster, None)
            .iter()
            .filter(|p| p["spec"]["nodeName"] == name.as_str())
            .filter(|p| {
                let owners = p["metadata"]["ownerReferences"].as_array();
                !owners.is_some_and(|o| o.iter().any(|r| r["kind"] == "DaemonSet"))
                    && p["metadata"]["annotations"]
                        .get("kubernetes.io/config.mirror")
                        .is_none()
            })
            .count();
        let result = self.check_reset(i, req);
        let extra = json!({
            "graceful": req.graceful,
            "cordoned": cordoned,
            "evictions": evictions,
            "pods_left": pods_left,
            "member": self.cluster.members().contains(&i),
        });
        self.logged(&name, "Reset", extra, &result);
        let wipe = result?;
        let cluster = self.cluster.clone();
        let graceful = req.graceful;
        tokio::spawn(async move {
            tokio::time::sleep(ms(cluster.args.upgrade_delay)).await;
            reset_sequence(&cluster, i, graceful, &wipe);
        });
        Ok(Reset {
            metadata: None,
            actor_id: format!("sim-reset-{i}-{}", self.cluster.now_ms()),
        })
    }

    pub(crate) fn reset_call(
        &self,
        req: Request<ResetRequest>,
    ) -> Result<Response<ResetResponse>, Status> {
        let messages = self.answer(&req, |i| Ok(vec![self.reset_on(i, req.get_ref())?]))?;
        Ok(Response::new(ResetResponse { messages }))
    }
}

/// The reset sequence of node `i`: graceful → cordon and drain, then leave
/// etcd on a control plane that is a member (failing the sequence, the
/// node left up, where etcd refuses); then wipe `wipe` and power off.
fn reset_sequence(cluster: &Arc<Cluster>, i: usize, graceful: bool, wipe: &Wipe) {
    let node = cluster.node(i);
    let name = node.display_name();
    if graceful {
        let life = &mut node.st.lock().unwrap().day2.life;
        life.cordoned = true;
        life.pods_gone = true;
    }
    let member = cluster.members().contains(&i);
    let mut left = false;
    if graceful && node.control_plane() && member {
        let removed = if cluster.real_etcd.is_some() {
            cluster.leave_real(i).map_err(|(_, e)| e)
        } else {
            cluster.remove_member(Some(i), Instant::now())
        };
        if let Err(e) = removed {
            cluster.log(json!({"node": name, "call": "ResetSequence", "ok": false,
                "error": format!("leaveEtcd: failed to leave cluster: failed to remove member {}: {e}", member_id(i))}));
            return;
        }
        left = true;
    }
    {
        let mut st = node.st.lock().unwrap();
        st.wiped = wipe.config;
        st.etcd_wiped = wipe.etcd_data;
        st.halted = true;
    }
    node.bump();
    cluster.log(
        json!({"node": name, "call": "ResetSequence", "ok": true, "left_etcd": left,
        "powered_off": true, "wiped": wipe.volumes, "etcd_data_wiped": wipe.etcd_data}),
    );
}

/// `DELETE /api/v1/nodes/{name}`.
pub(crate) async fn delete_node(
    State(cluster): State<Arc<Cluster>>,
    axum::extract::Path(name): axum::extract::Path<String>,
) -> ControlReply {
    let now = Instant::now();
    let found = cluster
        .registered(now)
        .into_iter()
        .find(|r| r.name == name)
        .map(|r| r.index);
    let Some(i) = found else {
        if cluster.k8s_delete_orphan(&name) {
            cluster.log(json!({"node": name, "call": "DeleteNode", "ok": true,
                "kubelet_running": false}));
            return (
                axum::http::StatusCode::OK,
                axum::Json(
                    json!({"kind": "Status", "apiVersion": "v1", "status": "Success", "details": {"name": name, "kind": "nodes"}}),
                ),
            );
        }
        cluster.log(json!({"node": name, "call": "DeleteNode", "ok": false, "error": "not found"}));
        return (
            axum::http::StatusCode::NOT_FOUND,
            axum::Json(
                json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404, "message": format!("nodes \"{name}\" not found")}),
            ),
        );
    };
    let kubelet_running = !cluster.node(i).halted();
    cluster.removals.lock().unwrap().deleted.insert(i);
    cluster.log(json!({"node": name, "call": "DeleteNode", "ok": true,
        "kubelet_running": kubelet_running}));
    (
        axum::http::StatusCode::OK,
        axum::Json(
            json!({"kind": "Status", "apiVersion": "v1", "status": "Success", "details": {"name": name, "kind": "nodes"}}),
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::super::state::{Args, Boot, new_cluster};
    use super::*;
    use clap::Parser;
    use std::time::Duration;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    /// `cps` control planes and a worker on Talos `version`, configured and
    /// bootstrapped 10 s ago (etcd healthy on every control plane); the API
    /// of the first.
    fn cluster(version: &str, cps: usize) -> Api {
        let mut argv = vec!["sim".to_owned(), "--talos-version".into(), version.into()];
        for k in 1..=cps {
            argv.extend([
                "--node".into(),
                format!("cp-0{k}=127.0.0.{}:controlplane", 10 + k),
            ]);
        }
        argv.extend(["--node".into(), "worker-01=127.0.0.21:worker".into()]);
        let cluster = new_cluster(Cli::parse_from(argv).args).unwrap();
        let then = Instant::now() - Duration::from_secs(10);
        for n in cluster.all() {
            n.st.lock().unwrap().configured_at = Some(then);
        }
        *cluster.boot.lock().unwrap() = Some(Boot { at: then, node: 0 });
        Api {
            cluster,
            me: 0,
            secure: true,
        }
    }

    fn message<T: std::fmt::Debug>(r: Result<T, Status>) -> (tonic::Code, String) {
        let s = r.unwrap_err();
        (s.code(), s.message().to_owned())
    }

    #[test]
    fn v1_11_a_worker_cannot_leave_etcd_or_remove_members() {
        let api = cluster("v1.11.5", 3);
        let worker = 3;
        assert_eq!(
            message(api.leave_on(worker)),
            (
                tonic::Code::Unimplemented,
                "etcd leave is only available on control plane nodes".into()
            )
        );
        assert_eq!(
            message(api.remove_by_id_on(worker, 0x1000)).0,
            tonic::Code::Unimplemented
        );
    }

    #[test]
    fn v1_11_the_only_member_cannot_leave() {
        let api = cluster("v1.11.5", 1);
        let (code, text) = message(api.leave_on(0));
        assert_eq!(code, tonic::Code::Unknown);
        assert!(text.contains(NOT_ENOUGH), "{text}");
        assert!(!api.cluster.left_etcd(0));
    }

    #[test]
    fn v1_12_a_healthy_member_stays_while_another_is_down_but_the_down_one_may_go() {
        let api = cluster("v1.12.4", 3);
        api.cluster.node(2).st.lock().unwrap().halted = true; // cp-03 down
        let (_, text) = message(api.remove_by_id_on(0, 0x1001));
        assert!(text.contains(NOT_ENOUGH), "{text}");
        api.remove_by_id_on(0, 0x1002).unwrap();
        assert_eq!(api.cluster.members(), [0, 1]);
        // Gone is gone: NotFound, as EtcdRemoveMemberByID maps etcd's error.
        assert_eq!(
            message(api.remove_by_id_on(0, 0x1002)).0,
            tonic::Code::NotFound
        );
    }

    #[test]
    fn leaving_twice_fails_on_v1_9_0_only() {
        let old = cluster("v1.9.0", 3);
        old.leave_on(2).unwrap();
        let (_, text) = message(old.leave_on(2));
        assert!(text.contains("member not found"), "{text}");
        let new = cluster("v1.9.1", 3);
        new.leave_on(2).unwrap();
        new.leave_on(2).unwrap();
        assert_eq!(new.cluster.members(), [0, 1]);
    }

    #[test]
    fn v1_13_reset_checks_labels_and_refuses_what_is_not_modelled() {
        let api = cluster("v1.13.4", 3);
        let spec = |label: &str| ResetPartitionSpec {
            label: label.into(),
            wipe: true,
        };
        let ok = ResetRequest {
            graceful: true,
            system_partitions_to_wipe: vec![spec("STATE"), spec("EPHEMERAL")],
            ..ResetRequest::default()
        };
        api.check_reset(0, &ok).unwrap();
        let bad = ResetRequest {
            system_partitions_to_wipe: vec![spec("DATA")],
            ..ok.clone()
        };
        assert!(message(api.check_reset(0, &bad)).1.contains("\"DATA\""));
        let users = ResetRequest {
            mode: WipeMode::UserDisks as i32,
            ..ok.clone()
        };
        assert!(message(api.check_reset(0, &users)).1.contains("USER_DISKS"));
        let reboot = ResetRequest { reboot: true, ..ok };
        assert_eq!(
            message(api.check_reset(0, &reboot)).0,
            tonic::Code::FailedPrecondition
        );
    }
}
