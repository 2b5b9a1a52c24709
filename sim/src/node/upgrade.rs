//! `MachineService.Upgrade` as machined answers it, per the version the
//! node runs (siderolabs/talos `internal/app/machined/internal/server/
//! v1alpha1/v1alpha1_server.go`, v1.9.0 to v1.14): (1) pull and validate
//! the installer (`install.PullAndValidateInstallerImage`) under the call's
//! context, so the caller's deadline cancels it; (2) on a control plane
//! the etcd checks (`internal/pkg/etcd/etcd.go` `ValidateForUpgrade`),
//! skipped with `force`, and with `preserve` from v1.12.9, v1.13.4 and
//! v1.14; (3) the ack; (4) the upgrade sequence: cordon and drain while
//! the old version answers, the installer (whose pre-flight check refuses
//! hosts below its floor: the node reverts and reboots on the old
//! version), reboot. `Reboot` runs the reboot sequence (no drain).

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Status};

use super::boot::Sequence;
use super::service::{Api, Route};
use super::state::{Cluster, Phase, ms, reached};
use super::version::Talos;
use imgbuild::talos::api::machine::*;

/// META keys of a staged upgrade (`pkg/machinery/meta/constants.go`).
const META_STAGED_IMAGE: u32 = 7;
const META_STAGED_OPTIONS: u32 = 8;

/// The schematic ID in an installer reference
/// (`host/<platform>-installer/<id>:<tag>`).
pub(crate) fn schematic_of_installer(image: &str) -> Option<String> {
    let (path, _) = image.rsplit_once(':')?;
    let id = path.rsplit('/').next()?;
    (id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit())).then(|| id.to_owned())
}

/// `host`, `<image>/<id>` and the tag of an installer reference.
fn split_reference(image: &str) -> Option<(&str, &str, &str)> {
    let (host, rest) = image.split_once('/')?;
    let (path, tag) = rest.rsplit_once(':')?;
    Some((host, path, tag))
}

/// Resolves the installer's manifest at the registry its reference names
/// (plain HTTP on loopback, the factory simulator's
/// `GET /v2/<image>/<id>/manifests/<tag>`): the tag and schematic it
/// installs. The pull of its layers is timed separately
/// ([`Cluster::pull_time`]).
async fn resolve_installer(image: &str) -> Result<(String, String), Status> {
    let fail =
        |why: String| Status::unknown(format!("error validating installer image {image:?}: {why}"));
    let (host, path, tag) =
        split_reference(image).ok_or_else(|| fail("not a valid image reference".into()))?;
    let schematic = schematic_of_installer(image)
        .ok_or_else(|| fail("no schematic ID in the reference".into()))?;
    let get = async {
        let mut tcp = tokio::net::TcpStream::connect(host).await?;
        tcp.write_all(
            format!("GET /v2/{path}/manifests/{tag} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await?;
        let mut reply = Vec::new();
        tcp.take(1 << 20).read_to_end(&mut reply).await?;
        Ok::<_, std::io::Error>(String::from_utf8_lossy(&reply).into_owned())
    };
    let reply = tokio::time::timeout(Duration::from_secs(5), get)
        .await
        .map_err(|_| fail(format!("{host}: timed out")))?
        .map_err(|e| fail(format!("failed to resolve reference {image:?}: {e}")))?;
    let status = reply.split_whitespace().nth(1).unwrap_or("");
    if status != "200" {
        let body = reply.split_once("\r\n\r\n").map_or("", |(_, b)| b).trim();
        return Err(fail(format!(
            "failed to resolve reference {image:?}: {image}: not found ({status} {body})"
        )));
    }
    Ok((tag.to_owned(), schematic))
}

/// The deadline a gRPC client sent (`grpc-timeout`: digits and a unit),
/// which grpc-go turns into the handler's context deadline.
pub(crate) fn grpc_deadline(md: &MetadataMap) -> Option<Duration> {
    let v = md.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = v.split_at(v.len().checked_sub(1)?);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// Counts the pulls of `nodes` that end without completing: the caller's
/// deadline passed, or it hung up (the handler's future is dropped).
struct PullGuard {
    cluster: Arc<Cluster>,
    nodes: Vec<usize>,
    done: bool,
}

impl Drop for PullGuard {
    fn drop(&mut self) {
        if !self.done {
            for &i in &self.nodes {
                self.cluster.node(i).st.lock().unwrap().day2.pulls_cancelled += 1;
            }
        }
    }
}

impl Cluster {
    /// How long node `i` takes to pull `image` from `now`: its own
    /// `pull_ms` if set; else the first pull of a reference waits for the
    /// factory's build (`--pull-delay`), later pulls for what is left of
    /// it, and at least `--pull-cached-delay`.
    fn pull_time(&self, i: usize, image: &str, now: Instant) -> Duration {
        if let Some(own) = self.node(i).st.lock().unwrap().day2.pull_ms {
            return ms(own);
        }
        let mut builds = self.builds.lock().unwrap();
        let ready = *builds
            .entry(image.to_owned())
            .or_insert(now + ms(self.args.pull_delay));
        ready
            .saturating_duration_since(now)
            .max(ms(self.args.pull_cached_delay))
    }

    /// etcd's members as `ValidateForUpgrade` lists them: each control
    /// plane that joined (started or not), and a stale member if asked.
    fn etcd_member_count(&self) -> usize {
        let joined = (0..self.count())
            .filter(|&j| self.etcd_start(j).is_some())
            .count();
        joined + usize::from(self.facts.lock().unwrap().stale_etcd_member)
    }

    /// `ValidateForUpgrade` (`internal/pkg/etcd/etcd.go`, the same text
    /// from v1.9 to v1.14): two members refuse, then every member must be
    /// started and healthy.
    fn validate_etcd_for_upgrade(&self, now: Instant) -> Result<(), String> {
        let members = self.etcd_member_count();
        if members == 2 {
            return Err(format!(
                "etcd member count({members}) is insufficient to maintain quorum if upgrade commences"
            ));
        }
        for j in 0..self.count() {
            let Some(start) = self.etcd_start(j) else {
                continue;
            };
            let id = 0x1000 + j as u64;
            let node = self.node(j);
            let (rebooted, stopped) = {
                let st = node.st.lock().unwrap();
                let life = &st.day2.life;
                (life.reboots > 0, life.services_stopped(now))
            };
            // A member's name is empty only until its etcd first started
            // (etcd.go: "If the member is not started, the name will be an
            // empty string"); one that started before and is down now (its
            // node rebooting, or its services stopped by a sequence that
            // still answers on apid) fails the health check of every member.
            if now < start && !rebooted {
                return Err(format!(
                    "etcd member {id:016x} is not started, all members must be running to perform an upgrade"
                ));
            }
            if node.phase(now) == Phase::Down || stopped || !reached(self.etcd_healthy_at(j), now) {
                return Err(format!(
                    "etcd member {id:016x} is not healthy; all members must be healthy to perform an upgrade: context deadline exceeded"
                ));
            }
        }
        if self.facts.lock().unwrap().stale_etcd_member {
            return Err(format!(
                "etcd member {:016x} is not healthy; all members must be healthy to perform an upgrade: context deadline exceeded",
                super::health::STALE_MEMBER_ID
            ));
        }
        Ok(())
    }
}

impl Api {
    /// The running Talos version of node `i`.
    pub(crate) fn talos(&self, i: usize) -> Talos {
        let tag = self.version_tag(i);
        Talos::parse(&tag).expect("versions are checked when set")
    }

    /// The nodes a call reaches, as apid routes it (unreachable targets
    /// left out: `answer` reports them).
    fn targets<T>(&self, req: &Request<T>) -> Result<Vec<usize>, Status> {
        Ok(match self.route(req)? {
            Route::Local => vec![self.me],
            Route::One2One(t) => vec![self.backend(&t)?],
            Route::One2Many(ts) => ts.iter().filter_map(|t| self.backend(t).ok()).collect(),
        })
    }

    /// machined's Upgrade on node `i` once the installer is pulled: the
    /// etcd checks on a control plane, the ack, then the upgrade sequence.
    fn upgrade_on(
        &self,
        i: usize,
        req: &UpgradeRequest,
        tag: &str,
        schematic: &str,
    ) -> Result<Upgrade, Status> {
        let node = self.cluster.node(i);
        let now = Instant::now();
        let running = self.talos(i);
        let skip = req.force || (req.preserve && running.preserve_skips_etcd_checks());
        if node.control_plane()
            && !skip
            && let Err(why) = self.cluster.validate_etcd_for_upgrade(now)
        {
            let msg = format!("error validating etcd for upgrade: {why}");
            let mut st = node.st.lock().unwrap();
            st.day2.upgrade_refusals += 1;
            st.day2.last_error = Some(msg.clone());
            return Err(Status::unknown(msg));
        }
        let at = self.cluster.now_ms();
        let ack = Upgrade {
            metadata: None,
            ack: "Upgrade request received".into(),
            actor_id: format!("sim-upgrade-{i}-{at}"),
        };
        {
            let mut st = node.st.lock().unwrap();
            st.day2.upgrades += 1;
            st.day2.installers.push(req.image.clone());
            st.day2.reboot_modes.push(
                upgrade_request::RebootMode::try_from(req.reboot_mode)
                    .map_or("unknown", |m| m.as_str_name())
                    .to_owned(),
            );
            // The sequence runs in a goroutine after the ack: a second one
            // fails there ("locked"), only logged.
            if st.day2.life.busy(now) {
                st.day2.sequences_locked += 1;
                return Ok(ack);
            }
        }
        let target = Talos::parse(tag);
        let (tag, schematic, image) = (tag.to_owned(), schematic.to_owned(), req.image.clone());
        let cluster = self.cluster.clone();
        let name = node.display_name();
        let control_plane = node.control_plane();
        let then = move |st: &mut super::state::NodeState| {
            let host = Talos::parse(&st.day2.version_or(&cluster.args.talos_version))
                .expect("versions are checked when set");
            let verdict = match &target {
                _ if st.day2.installer_fails => Err("installer failed".to_owned()),
                Some(t) => t.installer_accepts(&host),
                None => Err(format!("error parsing installer Talos version: {tag}")),
            };
            let ok = verdict.is_ok();
            match verdict {
                Ok(()) => {
                    st.day2.version = Some(tag);
                    st.day2.schematic = Some(schematic);
                    st.day2.stock = false;
                }
                Err(why) => {
                    st.day2.installer_refusals += 1;
                    st.day2.last_error = Some(why);
                }
            }
            let up = cluster.now_ms() + cluster.args.reboot_delay;
            cluster.events.lock().unwrap().push(json!({
                "node": name,
                "control_plane": control_plane,
                "image": image,
                "ok": ok,
                "acked_ms": at,
                "down_ms": cluster.now_ms(),
                "up_ms": up,
            }));
            if ok { "upgrade" } else { "revert" }
        };
        let args = &self.cluster.args;
        if req.stage {
            // `stage`: the image and install options go into META
            // (`pkg/machinery/meta/constants.go`: StagedUpgradeImageRef = 7,
            // StagedUpgradeInstallOptions = 8), then `SequenceStageUpgrade`
            // reboots WITHOUT a drain; the next boot reads and deletes the
            // tags, installs before apid starts and reboots again
            // (`v1alpha1_state.go`): seen from outside, one long outage.
            {
                let mut st = node.st.lock().unwrap();
                st.day2
                    .meta
                    .insert(META_STAGED_IMAGE, req.image.clone().into_bytes());
                st.day2
                    .meta
                    .insert(META_STAGED_OPTIONS, b"{\"Upgrade\":true}".to_vec());
                st.day2.staged_upgrades += 1;
            }
            let name = node.name.clone();
            self.cluster.run_sequence(
                i,
                Sequence {
                    drain: Duration::ZERO,
                    stop: ms(args.upgrade_delay),
                    down: ms(2 * args.reboot_delay + args.upgrade_delay),
                    then: Box::new(move |st| {
                        st.day2.meta.remove(&META_STAGED_IMAGE);
                        st.day2.meta.remove(&META_STAGED_OPTIONS);
                        // The boot that installed, never seen by a client.
                        let n = st.day2.life.boot_ids.len();
                        st.day2
                            .life
                            .boot_ids
                            .push(super::state::new_boot_id(&name, n));
                        match then(st) {
                            "upgrade" => "staged upgrade",
                            _ => "revert",
                        }
                    }),
                },
            );
            return Ok(ack);
        }
        let drain = node.st.lock().unwrap().day2.drain_ms;
        self.cluster.run_sequence(
            i,
            Sequence {
                drain: ms(drain.unwrap_or(args.drain_delay)),
                stop: ms(args.upgrade_delay),
                down: ms(args.reboot_delay),
                then: Box::new(then),
            },
        );
        Ok(ack)
    }

    pub(crate) async fn upgrade_call(
        &self,
        req: Request<UpgradeRequest>,
    ) -> Result<Response<UpgradeResponse>, Status> {
        let nodes = self.targets(&req)?;
        for &i in &nodes {
            self.cluster.node(i).st.lock().unwrap().day2.upgrade_calls += 1;
        }
        let image = req.get_ref().image.clone();
        let (tag, schematic) = self.timed_pull(&req, &nodes, &image).await?;
        let messages = self.answer(&req, |i| {
            Ok(vec![self.upgrade_on(i, req.get_ref(), &tag, &schematic)?])
        })?;
        Ok(Response::new(UpgradeResponse { messages }))
    }

    /// Pulls `image` on `nodes` as containerd does for machined: resolved
    /// at its registry, then as long as [`Cluster::pull_time`] says (none
    /// for a node that has it since its last boot), all nodes in parallel;
    /// past the caller's deadline the pull is cancelled. The installer's
    /// tag and schematic.
    pub(crate) async fn timed_pull<T>(
        &self,
        req: &Request<T>,
        nodes: &[usize],
        image: &str,
    ) -> Result<(String, String), Status> {
        let resolved = resolve_installer(image).await?;
        let now = Instant::now();
        let wait = nodes
            .iter()
            .map(|&i| {
                let cached = {
                    let node = self.cluster.node(i);
                    let mut st = node.st.lock().unwrap();
                    st.day2.pulls += 1;
                    st.day2.pulled.contains(image)
                };
                if cached {
                    Duration::ZERO
                } else {
                    self.cluster.pull_time(i, image, now)
                }
            })
            .max()
            .unwrap_or_default();
        let mut guard = PullGuard {
            cluster: self.cluster.clone(),
            nodes: nodes.to_vec(),
            done: false,
        };
        match grpc_deadline(req.metadata()) {
            Some(deadline) if deadline < wait => {
                tokio::time::sleep(deadline).await;
                return Err(Status::deadline_exceeded(format!(
                    "error validating installer image {image:?}: context deadline exceeded"
                )));
            }
            _ => tokio::time::sleep(wait).await,
        }
        guard.done = true;
        for &i in nodes {
            let node = self.cluster.node(i);
            node.st.lock().unwrap().day2.pulled.insert(image.to_owned());
        }
        Ok(resolved)
    }

    /// machined's Reboot on node `i` (`SequenceReboot`: no drain; every
    /// mode reboots, POWERCYCLE without kexec).
    pub(crate) fn reboot_on(&self, i: usize, req: &RebootRequest) -> Result<(), Status> {
        let node = self.cluster.node(i);
        {
            let mut st = node.st.lock().unwrap();
            st.day2.reboot_calls += 1;
            if !st.day2.life.cordoned {
                st.day2.life.reboots_undrained += 1;
            }
            st.day2.reboot_modes.push(
                reboot_request::Mode::try_from(req.mode)
                    .map_or("unknown", |m| m.as_str_name())
                    .to_owned(),
            );
            if st.day2.life.busy(Instant::now()) {
                return Err(Status::failed_precondition("locked"));
            }
        }
        self.cluster.run_sequence(
            i,
            Sequence {
                drain: Duration::ZERO,
                stop: ms(self.cluster.args.upgrade_delay),
                down: ms(self.cluster.args.reboot_delay),
                then: Box::new(|_| "reboot"),
            },
        );
        Ok(())
    }

    /// The reboot AUTO or REBOOT asks for on v1.9–v1.13 (`SequenceReboot`
    /// with takeover, after the config is persisted).
    pub(crate) fn reboot_for_apply(&self, i: usize) {
        self.cluster.run_sequence(
            i,
            Sequence {
                drain: Duration::ZERO,
                stop: ms(self.cluster.args.upgrade_delay),
                down: ms(self.cluster.args.reboot_delay),
                then: Box::new(|_| "apply"),
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn installer_references_split_into_host_path_and_tag() {
        let id = "ab".repeat(32);
        let image = format!("127.0.0.1:5000/metal-installer/{id}:v1.11.5");
        assert_eq!(
            split_reference(&image),
            Some((
                "127.0.0.1:5000",
                &*format!("metal-installer/{id}"),
                "v1.11.5"
            ))
        );
        assert_eq!(schematic_of_installer(&image), Some(id));
        assert_eq!(
            schematic_of_installer("ghcr.io/siderolabs/installer:v1.11.5"),
            None
        );
    }

    #[test]
    fn grpc_timeouts_read_as_grpc_go_reads_them() {
        let mut md = MetadataMap::new();
        assert_eq!(grpc_deadline(&md), None);
        for (v, d) in [
            ("15S", Duration::from_secs(15)),
            ("14999m", Duration::from_millis(14999)),
            ("2M", Duration::from_secs(120)),
            ("100u", Duration::from_micros(100)),
        ] {
            md.insert("grpc-timeout", v.parse().unwrap());
            assert_eq!(grpc_deadline(&md), Some(d), "{v}");
        }
        md.insert("grpc-timeout", "15x".parse().unwrap());
        assert_eq!(grpc_deadline(&md), None);
    }

    /// Three control planes configured long ago, etcd bootstrapped on the
    /// first and healthy everywhere (Talos v1.11.2, the default).
    fn three_control_planes() -> Arc<Cluster> {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: super::super::state::Args,
        }
        let cli = Cli::parse_from([
            "sim",
            "--node",
            "cp-01=127.0.0.11:controlplane",
            "--node",
            "cp-02=127.0.0.12:controlplane",
            "--node",
            "cp-03=127.0.0.13:controlplane",
            "--etcd-delay",
            "10",
        ]);
        let cluster = super::super::state::new_cluster(cli.args).unwrap();
        let long_ago = Instant::now() - Duration::from_secs(60);
        for n in cluster.all() {
            n.st.lock().unwrap().configured_at = Some(long_ago);
        }
        *cluster.boot.lock().unwrap() = Some(super::super::state::Boot {
            at: long_ago,
            node: 0,
        });
        cluster
    }

    #[tokio::test]
    async fn a_member_down_or_a_stale_one_fails_the_etcd_checks_unless_forced() {
        let cluster = three_control_planes();
        let api = Api {
            cluster: cluster.clone(),
            me: 0,
            secure: true,
        };
        let image = format!("127.0.0.1:1/metal-installer/{}:v1.11.5", "ab".repeat(32));
        let request = |force| UpgradeRequest {
            image: image.clone(),
            preserve: true,
            force,
            ..UpgradeRequest::default()
        };
        assert!(cluster.validate_etcd_for_upgrade(Instant::now()).is_ok());
        cluster.facts.lock().unwrap().stale_etcd_member = true;
        let e = cluster
            .validate_etcd_for_upgrade(Instant::now())
            .unwrap_err();
        assert!(
            e.starts_with("etcd member 0000000000001fff is not healthy"),
            "{e}"
        );
        cluster.facts.lock().unwrap().stale_etcd_member = false;
        // cp-02 is rebooting.
        cluster.node(1).st.lock().unwrap().down_until =
            Some(Instant::now() + Duration::from_secs(30));
        let e = api
            .upgrade_on(0, &request(false), "v1.11.5", "ab")
            .unwrap_err();
        assert!(
            e.message().starts_with(
                "error validating etcd for upgrade: etcd member 0000000000001001 is not healthy"
            ),
            "{e:?}"
        );
        let d = cluster.node(0).st.lock().unwrap().day2.clone();
        assert_eq!((d.upgrade_refusals, d.upgrades), (1, 0));
        // Forced: acked, draining on the old version, then the sequence.
        let ack = api.upgrade_on(0, &request(true), "v1.11.5", "ab").unwrap();
        assert_eq!(ack.ack, "Upgrade request received");
        assert_eq!(api.version_tag(0), "v1.11.2");
        // A second Upgrade while the sequence runs is acked and does nothing.
        api.upgrade_on(0, &request(true), "v1.11.5", "ab").unwrap();
        let d = cluster.node(0).st.lock().unwrap().day2.clone();
        assert_eq!((d.upgrades, d.sequences_locked), (2, 1));
    }

    #[tokio::test]
    async fn a_member_whose_services_stopped_or_that_rebooted_is_not_healthy() {
        let cluster = three_control_planes();
        let now = Instant::now();
        let not_healthy = |e: String| {
            assert!(
                e.starts_with("etcd member 0000000000001001 is not healthy"),
                "{e}"
            )
        };
        // cp-02 drained and stopped its services; apid still answers.
        {
            let n = cluster.node(1);
            let mut st = n.st.lock().unwrap();
            st.day2.life.busy_until = Some(now + Duration::from_secs(30));
            st.day2.life.services_stop_at = Some(now - Duration::from_secs(1));
        }
        assert_eq!(cluster.node(1).phase(now), Phase::Configured);
        not_healthy(cluster.validate_etcd_for_upgrade(now).unwrap_err());
        // Back up after the reboot, etcd not healthy yet: it started before,
        // so its name is set: "not healthy", never "not started".
        {
            let n = cluster.node(1);
            let mut st = n.st.lock().unwrap();
            st.day2.life.busy_until = None;
            st.day2.life.reboots = 1;
            st.configured_at = Some(now);
        }
        not_healthy(cluster.validate_etcd_for_upgrade(now).unwrap_err());
    }

    #[tokio::test]
    async fn a_staged_upgrade_writes_meta_and_reboots_without_a_drain() {
        let cluster = three_control_planes();
        let api = Api {
            cluster: cluster.clone(),
            me: 0,
            secure: true,
        };
        let image = format!("127.0.0.1:1/metal-installer/{}:v1.11.5", "ab".repeat(32));
        let req = UpgradeRequest {
            image: image.clone(),
            stage: true,
            ..UpgradeRequest::default()
        };
        api.upgrade_on(2, &req, "v1.11.5", "ab").unwrap();
        let d = cluster.node(2).st.lock().unwrap().day2.clone();
        assert!(!d.life.cordoned && d.life.draining_until.is_none());
        assert_eq!(d.meta.get(&7), Some(&image.into_bytes()));
        assert!(d.meta.contains_key(&8));
        assert_eq!(d.staged_upgrades, 1);
        assert_eq!(api.version_tag(2), "v1.11.2", "installed at the next boot");
    }

    #[tokio::test]
    async fn an_installer_the_registry_does_not_serve_is_refused() {
        // Nothing listens on port 1: the pull fails, as containerd's would.
        let id = "ab".repeat(32);
        let e = resolve_installer(&format!("127.0.0.1:1/metal-installer/{id}:v1.11.5"))
            .await
            .unwrap_err();
        assert!(
            e.message().starts_with("error validating installer image"),
            "{e:?}"
        );
        let e = resolve_installer("127.0.0.1:1/metal-installer/short:v1.11.5")
            .await
            .unwrap_err();
        assert!(e.message().contains("no schematic ID"), "{e:?}");
    }
}
