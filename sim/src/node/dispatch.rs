//! How a machine API call reaches a node (siderolabs/talos
//! `internal/app/apid/pkg/director/director.go`, `internal/app/machined/
//! internal/server/v1alpha1/v1alpha1_server.go`): maintenance mode, the
//! `node`/`nodes` metadata, per-node replies and errors.

use super::config::*;
use super::service::*;
use super::state::*;
use super::{health, hostile, k8s};
use api::common::{Data, Metadata};
use api::machine::apply_configuration_request::Mode as ApplyMode;
use api::machine::*;
use api::storage::{Disk, Disks};
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use imgbuild::talos::api;
use imgbuild::talos::pki::{self, LeafSpec};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;
use tonic::{Request, Status};

impl Api {
    /// The routing metadata of a call. Maintenance mode has no apid: its
    /// server implements only ApplyConfiguration and Disks.
    pub(crate) fn route<T>(&self, req: &Request<T>) -> Result<Route, Status> {
        if !self.secure {
            return Err(Status::unimplemented(NOT_IN_MAINTENANCE));
        }
        let values = |key: &str| -> Vec<String> {
            req.metadata()
                .get_all(key)
                .iter()
                .filter_map(|v| v.to_str().ok().map(str::to_owned))
                .collect()
        };
        let nodes = values("nodes");
        if !nodes.is_empty() {
            return Ok(Route::One2Many(nodes));
        }
        Ok(match <[String; 1]>::try_from(values("node")) {
            Ok([target]) => Route::One2One(target),
            Err(_) => Route::Local,
        })
    }

    /// The node apid's remote backend reaches for `target` (dialled as
    /// `target:50000`): failures read like a failed dial.
    pub(crate) fn backend(&self, target: &str) -> Result<usize, Status> {
        let dial_failed = |why: &str| {
            Status::unavailable(format!(
                "connection error: desc = \"transport: Error while dialing: dial tcp {target}:50000: {why}\""
            ))
        };
        let i = target
            .parse::<IpAddr>()
            .ok()
            .and_then(|ip| self.cluster.index_of(ip))
            .ok_or_else(|| dial_failed("connect: no route to host"))?;
        if self.cluster.node(i).phase(Instant::now()) != Phase::Configured {
            return Err(dial_failed("connect: connection refused"));
        }
        Ok(i)
    }

    /// Answers a call as apid does, `machined(i)` being node `i`'s own
    /// answer: locally and one-to-one it passes untouched (no metadata,
    /// errors as gRPC statuses); one-to-many each target's messages get
    /// `metadata.hostname` = the target as sent, and a target that fails
    /// yields one message carrying `metadata.error` and `status` instead.
    pub(crate) fn answer<T, M: Envelope>(
        &self,
        req: &Request<T>,
        machined: impl Fn(usize) -> Result<Vec<M>, Status>,
    ) -> Result<Vec<M>, Status> {
        match self.route(req)? {
            Route::Local => machined(self.me),
            Route::One2One(target) => machined(self.backend(&target)?),
            Route::One2Many(targets) => Ok(targets
                .iter()
                .flat_map(|target| {
                    let stamp = Metadata {
                        hostname: target.clone(),
                        ..Metadata::default()
                    };
                    match self.backend(target).and_then(&machined) {
                        Ok(mut messages) => {
                            for m in &mut messages {
                                m.set_metadata(stamp.clone());
                            }
                            messages
                        }
                        Err(s) => {
                            let mut m = M::default();
                            m.set_metadata(Metadata {
                                error: format!(
                                    "rpc error: code = {:?} desc = {}",
                                    s.code(),
                                    s.message()
                                ),
                                status: Some(api::google::rpc::Status {
                                    code: s.code() as i32,
                                    message: s.message().to_owned(),
                                    details: Vec::new(),
                                }),
                                ..stamp
                            });
                            vec![m]
                        }
                    }
                })
                .collect()),
        }
    }

    /// Node `i` takes a config: in maintenance mode it comes up on mTLS
    /// later (or misbehaves), configured it applies without a reboot.
    pub(crate) fn apply_on(&self, i: usize, data: &[u8]) -> Result<ApplyConfiguration, Status> {
        let applied = read_config(data)?;
        k8s::versions::runtime_validate(&self.talos(i), &applied.v1alpha1)?;
        let node = &self.cluster.node(i);
        let now = Instant::now();
        if !applied.os_ca.key.is_empty() {
            self.cluster
                .ca_keys
                .lock()
                .unwrap()
                .insert(applied.os_ca.crt.clone(), applied.os_ca.key.clone());
        }
        let details;
        {
            let mut st = node.st.lock().unwrap();
            st.stats.applies += 1;
            st.applied = Some(Arc::new(applied));
            st.mtls = None;
            if node.has("never-leave-maintenance") {
                details = "Applied configuration".to_owned();
            } else if node.has("reboot-after-apply") {
                let down = now + ms(100);
                st.down_until = Some(down + ms(self.cluster.args.reboot_delay));
                st.configured_at = st.down_until;
                details = "Applied configuration, the node will reboot".to_owned();
            } else {
                st.configured_at = Some(now + ms(self.cluster.args.apply_delay));
                details = "Applied configuration without a reboot".to_owned();
            }
        }
        // Phase changes happen later; wake the listener and connections then.
        let cluster = self.cluster.clone();
        let wake_at: Vec<Instant> = {
            let st = node.st.lock().unwrap();
            [
                st.down_until
                    .map(|t| t - ms(self.cluster.args.reboot_delay)),
                st.down_until,
                st.configured_at,
            ]
            .into_iter()
            .flatten()
            .collect()
        };
        tokio::spawn(async move {
            for t in wake_at {
                tokio::time::sleep_until(t.into()).await;
                cluster.node(i).bump();
            }
        });
        Ok(ApplyConfiguration {
            metadata: None,
            warnings: Vec::new(),
            mode: ApplyMode::Auto as i32,
            mode_details: details,
        })
    }

    pub(crate) fn bootstrap_on(&self, i: usize, recover: bool) -> Result<Bootstrap, Status> {
        let node = &self.cluster.node(i);
        if !node.control_plane() {
            return Err(Status::failed_precondition(
                "bootstrap is not available on worker nodes",
            ));
        }
        let conf = self.cluster.configured_at(i).unwrap_or_else(Instant::now);
        if node.has("slow-time-sync")
            && Instant::now() < conf + ms(self.cluster.args.time_sync_delay)
        {
            node.st.lock().unwrap().stats.bootstrap_refusals += 1;
            return Err(Status::failed_precondition("time is not in sync yet"));
        }
        let mut boot = self.cluster.boot.lock().unwrap();
        if boot.is_some() {
            node.st.lock().unwrap().stats.bootstrap_refusals += 1;
            return Err(Status::already_exists("etcd data directory is not empty"));
        }
        node.st.lock().unwrap().stats.bootstraps += 1;
        // A recovery that cannot restore leaves etcd failed, not started.
        if recover && self.restore_on(i).is_err() {
            return Ok(Bootstrap { metadata: None });
        }
        *boot = Some(Boot {
            at: Instant::now(),
            node: i,
        });
        Ok(Bootstrap { metadata: None })
    }

    pub(crate) fn etcd_members_on(&self, i: usize) -> Result<EtcdMembers, Status> {
        let now = Instant::now();
        if !reached(self.cluster.etcd_start(i), now) {
            return Err(Status::failed_precondition(
                "etcd is not running on this node",
            ));
        }
        if self.cluster.real_etcd.is_some() {
            return self.real_members_on(i);
        }
        let members = (0..self.cluster.count())
            .filter(|&j| reached(self.cluster.etcd_start(j), now))
            .map(|j| {
                let n = &self.cluster.node(j);
                let hostname =
                    n.st.lock()
                        .unwrap()
                        .applied
                        .as_ref()
                        .map(|a| a.hostname.clone())
                        .unwrap_or_default();
                EtcdMember {
                    id: 0x1000 + j as u64,
                    hostname: hostile::said(self.cluster.args.hostile_text.as_deref(), &hostname),
                    peer_urls: vec![format!("https://{}:2380", n.ip)],
                    client_urls: vec![format!("https://{}:2379", n.ip)],
                    is_learner: false,
                }
            })
            .chain(
                self.cluster
                    .facts
                    .lock()
                    .unwrap()
                    .stale_etcd_member
                    .then(|| EtcdMember {
                        id: health::STALE_MEMBER_ID,
                        hostname: "cp-gone".into(),
                        peer_urls: vec!["https://127.0.0.254:2380".into()],
                        client_urls: vec!["https://127.0.0.254:2379".into()],
                        is_learner: false,
                    }),
            )
            .collect();
        Ok(EtcdMembers {
            metadata: None,
            legacy_members: Vec::new(),
            members,
        })
    }

    /// The admin kubeconfig of node `i` as the chunks machined streams.
    pub(crate) fn kubeconfig_on(&self, i: usize) -> Result<Vec<Data>, Status> {
        let now = Instant::now();
        if !reached(self.cluster.etcd_healthy_at(i), now) {
            return Err(Status::failed_precondition(
                "kubeconfig is not available yet: the API server is not running",
            ));
        }
        let node = &self.cluster.node(i);
        let applied = node.st.lock().unwrap().applied.clone().expect("configured");
        let ca = applied
            .k8s_ca
            .clone()
            .ok_or_else(|| Status::failed_precondition("no Kubernetes CA key on this node"))?;
        let admin = pki::issue(
            &ca,
            &LeafSpec {
                organization: Some("system:masters".into()),
                common_name: "admin".into(),
                client: true,
                days: 365,
                ..LeafSpec::default()
            },
        )
        .map_err(|e| Status::internal(e.to_string()))?;
        let name = &applied.cluster_name;
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n    - name: {name}\n      cluster:\n        server: {}\n        certificate-authority-data: {}\nusers:\n    - name: admin@{name}\n      user:\n        client-certificate-data: {}\n        client-key-data: {}\ncontexts:\n    - context:\n        cluster: {name}\n        namespace: default\n        user: admin@{name}\n      name: admin@{name}\ncurrent-context: admin@{name}\n",
            applied.endpoint,
            STANDARD.encode(&ca.crt),
            STANDARD.encode(&admin.crt),
            STANDARD.encode(&admin.key),
        );
        // A tar with one entry and no end-of-archive blocks, gzipped.
        let mut tar = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(text.len() as u64);
        h.set_mode(0o600);
        h.set_cksum();
        tar.append_data(&mut h, "kubeconfig", text.as_bytes())
            .map_err(|e| Status::internal(e.to_string()))?;
        let mut raw = tar
            .into_inner()
            .map_err(|e| Status::internal(e.to_string()))?;
        raw.truncate(raw.len() - 1024);
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        std::io::Write::write_all(&mut gz, &raw).map_err(|e| Status::internal(e.to_string()))?;
        let archive = gz.finish().map_err(|e| Status::internal(e.to_string()))?;
        node.st.lock().unwrap().stats.kubeconfigs += 1;
        let (first, second) = archive.split_at(archive.len() / 2);
        Ok([first, second]
            .map(|bytes| Data {
                metadata: None,
                bytes: bytes.to_vec(),
            })
            .into())
    }

    pub(crate) fn services_on(&self, i: usize) -> ServiceList {
        let now = Instant::now();
        let service = |id: &str, state: &str, healthy: Option<bool>, msg: &str| ServiceInfo {
            id: id.into(),
            state: state.into(),
            events: None,
            health: Some(ServiceHealth {
                unknown: healthy.is_none(),
                healthy: healthy.unwrap_or(false),
                last_message: hostile::said(self.cluster.args.hostile_text.as_deref(), msg),
                last_change: None,
            }),
        };
        let mut services = vec![
            service("apid", "Running", Some(true), ""),
            service("machined", "Running", Some(true), ""),
        ];
        let kubelet = self.cluster.kubelet_healthy_at(i);
        let restarting = self
            .cluster
            .k8s_restarting(i, k8s::versions::Component::Kubelet, now);
        services.push(match kubelet {
            Some(t) if now >= t && !restarting => service("kubelet", "Running", Some(true), ""),
            _ => service(
                "kubelet",
                "Running",
                Some(false),
                "waiting for kubelet to become healthy",
            ),
        });
        if self.cluster.node(i).control_plane() {
            let start = self.cluster.etcd_start(i);
            let healthy = self.cluster.etcd_healthy_at(i);
            let failed = self.cluster.etcd_failed(i);
            services.push(match (start, healthy) {
                _ if failed.is_some() => {
                    service("etcd", "Failed", None, failed.as_deref().unwrap_or(""))
                }
                (Some(_), Some(h)) if now >= h => service("etcd", "Running", Some(true), ""),
                (Some(s), _) if now >= s => {
                    service("etcd", "Running", Some(false), "etcd is starting")
                }
                _ => service(
                    "etcd",
                    "Preparing",
                    None,
                    "Waiting for etcd bootstrap or join",
                ),
            });
        }
        ServiceList {
            metadata: None,
            services,
        }
    }

    pub(crate) fn version_on(&self, i: usize) -> Version {
        Version {
            metadata: None,
            version: Some(VersionInfo {
                tag: self.version_tag(i),
                sha: "imgbuild-sim".into(),
                built: String::new(),
                go_version: String::new(),
                os: "linux".into(),
                arch: "amd64".into(),
            }),
            platform: Some(PlatformInfo {
                name: "metal".into(),
                mode: "metal".into(),
            }),
        }
    }

    /// storaged's disks: `device_name` is `/dev/` joined with the disk's id.
    pub(crate) fn disks_on(&self) -> Disks {
        Disks {
            metadata: None,
            disks: self
                .cluster
                .args
                .disks
                .iter()
                .map(|id| Disk {
                    size: 20 << 30,
                    model: "QEMU HARDDISK".into(),
                    device_name: format!("/dev/{id}"),
                })
                .collect(),
        }
    }
}
