//! Day-two calls of the node double: Upgrade (the installer validated
//! against the factory simulator's registry, the etcd-health refusal on
//! control planes, a reboot, the new tag), ApplyConfiguration on a
//! configured node (modes, dry-run diffs), MetaWrite and the extension
//! status read through the COSI State API, all as machined answers them
//! (siderolabs/talos v1.11.5
//! `internal/app/machined/internal/server/v1alpha1/v1alpha1_server.go`).

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::Stream;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::{Request, Response, Status};

use super::api::cosi::resource::state_server::State as CosiState;
use super::api::cosi::resource::{
    GetRequest, GetResponse, ListRequest, ListResponse, Metadata as ResMetadata, Resource, Spec,
};
use super::api::machine::apply_configuration_request::Mode as ApplyMode;
use super::api::machine::*;
use super::{Api, Applied, Cluster, Phase, ms, reached, read_config};

/// What a node keeps across day-two operations.
#[derive(Default, Clone)]
pub(super) struct Day2 {
    /// The running Talos tag (None: `--talos-version`).
    pub version: Option<String>,
    /// The running schematic ID (None: read from the config's installer).
    pub schematic: Option<String>,
    pub meta: BTreeMap<u32, Vec<u8>>,
    /// Switch: the installer fails after the ack; the node reboots into
    /// the version it ran.
    pub installer_fails: bool,
    /// A config staged for the next reboot (mode STAGED).
    pub staged: Option<Arc<Applied>>,
    pub upgrades: u32,
    pub upgrade_refusals: u32,
    pub dry_runs: u32,
    pub meta_writes: u32,
    /// Every installer image an acked Upgrade named, in order.
    pub installers: Vec<String>,
}

/// The schematic ID in an installer reference
/// (`host/<platform>-installer/<id>:<tag>`).
pub(super) fn schematic_of_installer(image: &str) -> Option<String> {
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

/// Pulls the installer's manifest from the registry its reference names
/// (`install.PullAndValidateInstallerImage`): plain HTTP on loopback, the
/// factory simulator's `GET /v2/<image>/<id>/manifests/<tag>`.
async fn validate_installer(image: &str) -> Result<(String, String), Status> {
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
        tcp.read_to_end(&mut reply).await?;
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

/// A line diff (`-` old, `+` new) by longest common subsequence: enough to
/// show which settings change; empty when the configs are the same.
fn line_diff(old: &str, new: &str) -> String {
    let (a, b): (Vec<&str>, Vec<&str>) = (old.lines().collect(), new.lines().collect());
    let mut lcs = vec![vec![0u32; b.len() + 1]; a.len() + 1];
    for i in (0..a.len()).rev() {
        for j in (0..b.len()).rev() {
            lcs[i][j] = if a[i] == b[j] {
                lcs[i + 1][j + 1] + 1
            } else {
                lcs[i + 1][j].max(lcs[i][j + 1])
            };
        }
    }
    let (mut i, mut j, mut out) = (0, 0, String::new());
    while i < a.len() || j < b.len() {
        if i < a.len() && j < b.len() && a[i] == b[j] {
            i += 1;
            j += 1;
        } else if j < b.len() && (i == a.len() || lcs[i][j + 1] >= lcs[i + 1][j]) {
            out += &format!("+{}\n", b[j]);
            j += 1;
        } else {
            out += &format!("-{}\n", a[i]);
            i += 1;
        }
    }
    out
}

impl Cluster {
    /// Whether every etcd member is healthy, else the first that is not
    /// (`etcd.ValidateForUpgrade`: all members started and healthy).
    fn unhealthy_member(&self, now: Instant) -> Option<usize> {
        (0..self.count()).find(|&j| {
            self.etcd_start(j).is_some()
                && (self.node(j).phase(now) == Phase::Down
                    || !reached(self.etcd_healthy_at(j), now))
        })
    }
}

impl Api {
    /// The running tag of node `i`.
    pub(super) fn version_tag(&self, i: usize) -> String {
        let node = self.cluster.node(i);
        let st = node.st.lock().unwrap();
        st.day2
            .version
            .clone()
            .unwrap_or_else(|| self.cluster.args.talos_version.clone())
    }

    /// The running schematic of node `i`: what its last upgrade installed,
    /// else the one its config's installer names.
    pub(super) fn schematic_on(&self, i: usize) -> Option<String> {
        let node = self.cluster.node(i);
        let st = node.st.lock().unwrap();
        st.day2.schematic.clone().or_else(|| {
            st.applied
                .as_ref()
                .and_then(|a| schematic_of_installer(&a.install_image))
        })
    }

    /// machined's Upgrade on node `i` once the image is validated: the etcd
    /// check on a control plane unless forced (v1.11.5 checks regardless of
    /// `preserve`), the ack, then a reboot into `tag` (or, with a failing
    /// installer, back into the old version).
    fn upgrade_on(
        &self,
        i: usize,
        req: &UpgradeRequest,
        tag: &str,
        schematic: &str,
    ) -> Result<Upgrade, Status> {
        let node = self.cluster.node(i);
        let now = Instant::now();
        if node.control_plane()
            && !req.force
            && let Some(j) = self.cluster.unhealthy_member(now)
        {
            node.st.lock().unwrap().day2.upgrade_refusals += 1;
            return Err(Status::unknown(format!(
                "error validating etcd for upgrade: etcd member {:016x} is not healthy; all members must be healthy to perform an upgrade",
                0x1000 + j as u64
            )));
        }
        let down_at = now + ms(self.cluster.args.upgrade_delay);
        let up_at = down_at + ms(self.cluster.args.reboot_delay);
        let ok;
        {
            let mut st = node.st.lock().unwrap();
            st.day2.upgrades += 1;
            st.day2.installers.push(req.image.clone());
            ok = !st.day2.installer_fails;
            if ok {
                st.day2.version = Some(tag.to_owned());
                st.day2.schematic = Some(schematic.to_owned());
            }
            if let Some(staged) = st.day2.staged.take() {
                st.applied = Some(staged);
                st.mtls = None;
            }
            st.down_until = Some(up_at);
            st.configured_at = Some(up_at);
        }
        let at = |t: Instant| t.duration_since(self.cluster.started).as_millis() as u64;
        self.cluster.events.lock().unwrap().push(json!({
            "node": node.display_name(),
            "control_plane": node.control_plane(),
            "image": req.image,
            "ok": ok,
            "acked_ms": at(now),
            "down_ms": at(now),
            "up_ms": at(up_at),
        }));
        let cluster = self.cluster.clone();
        tokio::spawn(async move {
            for t in [down_at, up_at] {
                tokio::time::sleep_until(t.into()).await;
                cluster.node(i).bump();
            }
        });
        Ok(Upgrade {
            metadata: None,
            ack: "Upgrade request received".into(),
            actor_id: format!("sim-upgrade-{i}-{}", at(now)),
        })
    }

    /// ApplyConfiguration on a configured node: REBOOT refused, AUTO
    /// becomes NO_REBOOT, STAGED kept for the next reboot; a dry run answers
    /// the summary and the config diff and changes nothing.
    pub(super) fn apply_configured(
        &self,
        i: usize,
        req: &ApplyConfigurationRequest,
    ) -> Result<ApplyConfiguration, Status> {
        let mut applied = read_config(&req.data)?;
        let mode = ApplyMode::try_from(req.mode).unwrap_or(ApplyMode::Reboot);
        let (mode, details) = match mode {
            ApplyMode::Reboot => {
                return Err(Status::unimplemented(
                    "the REBOOT mode is not supported, please use AUTO or NO_REBOOT modes instead",
                ));
            }
            ApplyMode::Auto | ApplyMode::NoReboot | ApplyMode::Try => (
                ApplyMode::NoReboot,
                "Applied configuration without a reboot",
            ),
            ApplyMode::Staged => (
                ApplyMode::Staged,
                "Staged configuration to be applied after the next reboot",
            ),
        };
        let node = self.cluster.node(i);
        let mut st = node.st.lock().unwrap();
        if req.dry_run {
            st.day2.dry_runs += 1;
            let old = st.applied.as_ref().map(|a| a.raw.as_str()).unwrap_or("");
            let diff = line_diff(old, &applied.raw);
            let diff = if diff.is_empty() {
                "No changes.".to_owned()
            } else {
                diff
            };
            return Ok(ApplyConfiguration {
                metadata: None,
                warnings: Vec::new(),
                mode: mode as i32,
                mode_details: format!(
                    "Dry run summary:\n{details} (skipped in dry-run).\nConfig diff:\n\n{diff}"
                ),
            });
        }
        st.stats.applies += 1;
        if applied.os_ca.key.is_empty()
            && let Some(old) = &st.applied
        {
            applied.os_ca.key = old.os_ca.key.clone();
        }
        if mode == ApplyMode::Staged {
            st.day2.staged = Some(Arc::new(applied));
        } else {
            st.applied = Some(Arc::new(applied));
            st.mtls = None;
        }
        Ok(ApplyConfiguration {
            metadata: None,
            warnings: Vec::new(),
            mode: mode as i32,
            mode_details: details.into(),
        })
    }

    fn meta_write_on(&self, i: usize, req: &MetaWriteRequest) -> Result<MetaWrite, Status> {
        if req.key > 0xff {
            return Err(Status::invalid_argument(format!(
                "meta key {} is out of range",
                req.key
            )));
        }
        let node = self.cluster.node(i);
        let mut st = node.st.lock().unwrap();
        st.day2.meta_writes += 1;
        st.day2.meta.insert(req.key, req.value.clone());
        Ok(MetaWrite { metadata: None })
    }

    /// The extension statuses of node `i`: the factory adds an extension
    /// named `schematic` whose version is the schematic ID
    /// (siderolabs/image-factory `pkg/constants/constants.go`
    /// `SchematicIDExtensionName`); IDs are ordinals, the spec is an
    /// `extensions.Layer` (siderolabs/talos
    /// `pkg/machinery/resources/runtime/extension_status.go`).
    fn extensions_on(&self, i: usize) -> Vec<Resource> {
        let Some(id) = self.schematic_on(i) else {
            return Vec::new();
        };
        vec![Resource {
            metadata: Some(ResMetadata {
                namespace: RUNTIME.into(),
                r#type: EXTENSION_STATUS.into(),
                id: "0".into(),
                version: "1".into(),
                phase: "running".into(),
                ..ResMetadata::default()
            }),
            spec: Some(Spec {
                proto_spec: Vec::new(),
                yaml_spec: format!(
                    "image: schematic.sqsh\nmetadata:\n    name: schematic\n    version: {id}\n    author: Image Factory\n    description: This extension holds the schematic ID of the image.\n"
                ),
            }),
        }]
    }

    /// The node a COSI call is for: apid routes it by `nodes`/`node`
    /// metadata like any other (one target only for State).
    fn state_target<T>(&self, req: &Request<T>) -> Result<usize, Status> {
        match self.route(req)? {
            super::Route::Local => Ok(self.me),
            super::Route::One2One(t) => self.backend(&t),
            super::Route::One2Many(t) if t.len() == 1 => self.backend(&t[0]),
            super::Route::One2Many(_) => Err(Status::invalid_argument(
                "one-to-many proxying is not supported for COSI methods",
            )),
        }
    }

    fn resources<T>(
        &self,
        req: &Request<T>,
        namespace: &str,
        kind: &str,
    ) -> Result<Vec<Resource>, Status> {
        let i = self.state_target(req)?;
        if namespace == RUNTIME && kind == EXTENSION_STATUS {
            Ok(self.extensions_on(i))
        } else {
            Err(Status::not_found(format!(
                "resource type {kind:?} in namespace {namespace:?} is not registered"
            )))
        }
    }

    pub(super) async fn upgrade_call(
        &self,
        req: Request<UpgradeRequest>,
    ) -> Result<Response<UpgradeResponse>, Status> {
        self.route(&req)?;
        let (tag, schematic) = validate_installer(&req.get_ref().image).await?;
        let messages = self.answer(&req, |i| {
            Ok(vec![self.upgrade_on(i, req.get_ref(), &tag, &schematic)?])
        })?;
        Ok(Response::new(UpgradeResponse { messages }))
    }

    pub(super) fn meta_write_call(
        &self,
        req: Request<MetaWriteRequest>,
    ) -> Result<Response<MetaWriteResponse>, Status> {
        let messages = self.answer(&req, |i| Ok(vec![self.meta_write_on(i, req.get_ref())?]))?;
        Ok(Response::new(MetaWriteResponse { messages }))
    }
}

const RUNTIME: &str = "runtime";
const EXTENSION_STATUS: &str = "ExtensionStatuses.runtime.talos.dev";

type ListStream = Pin<Box<dyn Stream<Item = Result<ListResponse, Status>> + Send>>;

#[tonic::async_trait]
impl CosiState for Api {
    async fn get(&self, req: Request<GetRequest>) -> Result<Response<GetResponse>, Status> {
        let r = req.get_ref();
        let found = self
            .resources(&req, &r.namespace, &r.r#type)?
            .into_iter()
            .find(|res| res.metadata.as_ref().is_some_and(|m| m.id == r.id))
            .ok_or_else(|| {
                Status::not_found(format!("resource {}({}) doesn't exist", r.r#type, r.id))
            })?;
        Ok(Response::new(GetResponse {
            resource: Some(found),
        }))
    }

    type ListStream = ListStream;

    async fn list(&self, req: Request<ListRequest>) -> Result<Response<ListStream>, Status> {
        let r = req.get_ref();
        let items = self.resources(&req, &r.namespace, &r.r#type)?;
        Ok(Response::new(Box::pin(futures_util::stream::iter(
            items.into_iter().map(|resource| {
                Ok(ListResponse {
                    resource: Some(resource),
                })
            }),
        ))))
    }
}

/// `POST /_sim/installer` `{"node": NAME, "fail": bool}`: whether the
/// node's installer fails after the ack.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct InstallerSwitch {
    node: String,
    fail: bool,
}

pub(super) async fn installer_switch(
    axum::extract::State(cluster): axum::extract::State<Arc<Cluster>>,
    axum::Json(req): axum::Json<InstallerSwitch>,
) -> super::ControlReply {
    match cluster.all().iter().find(|n| n.display_name() == req.node) {
        Some(n) => {
            n.st.lock().unwrap().day2.installer_fails = req.fail;
            (
                axum::http::StatusCode::OK,
                axum::Json(json!({"node": req.node, "fail": req.fail})),
            )
        }
        None => super::control_error(
            axum::http::StatusCode::NOT_FOUND,
            format!("no node named {}", req.node),
        ),
    }
}

/// The day-two part of a node's stats.
pub(super) fn stats_of(d: &Day2, version: String, schematic: Option<String>) -> Value {
    json!({
        "version": version,
        "schematic": schematic,
        "upgrades": d.upgrades,
        "upgrade_refusals": d.upgrade_refusals,
        "dry_runs": d.dry_runs,
        "meta_writes": d.meta_writes,
        "meta_keys": d.meta.keys().collect::<Vec<_>>(),
        "installers": d.installers,
        "installer_fails": d.installer_fails,
    })
}

#[cfg(test)]
mod tests {
    use super::super::Boot;
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: super::super::Args,
    }

    /// Two control planes and a worker, configured long ago, etcd
    /// bootstrapped on the first and healthy everywhere.
    fn healthy_cluster() -> Arc<Cluster> {
        let cli = Cli::parse_from([
            "sim",
            "--node",
            "cp-01=127.0.0.11:controlplane",
            "--node",
            "cp-02=127.0.0.12:controlplane",
            "--node",
            "worker-01=127.0.0.21:worker",
            "--etcd-delay",
            "10",
        ]);
        let cluster = super::super::new_cluster(cli.args).unwrap();
        let long_ago = Instant::now() - Duration::from_secs(60);
        for n in cluster.all() {
            n.st.lock().unwrap().configured_at = Some(long_ago);
        }
        *cluster.boot.lock().unwrap() = Some(Boot {
            at: long_ago,
            node: 0,
        });
        cluster
    }

    fn upgrade(image: &str, force: bool) -> UpgradeRequest {
        UpgradeRequest {
            image: image.into(),
            preserve: true,
            force,
            ..UpgradeRequest::default()
        }
    }

    #[tokio::test]
    async fn a_control_plane_refuses_while_an_etcd_member_is_down_unless_forced() {
        let cluster = healthy_cluster();
        let api = Api {
            cluster: cluster.clone(),
            me: 0,
            secure: true,
        };
        let id = "ab".repeat(32);
        let image = format!("127.0.0.1:1/metal-installer/{id}:v1.11.5");
        // cp-02 is rebooting: its etcd member is not healthy.
        cluster.node(1).st.lock().unwrap().down_until =
            Some(Instant::now() + Duration::from_secs(30));
        let e = api
            .upgrade_on(0, &upgrade(&image, false), "v1.11.5", &id)
            .unwrap_err();
        assert!(
            e.message().starts_with(
                "error validating etcd for upgrade: etcd member 0000000000001001 is not healthy"
            ),
            "{e:?}"
        );
        assert_eq!(cluster.node(0).st.lock().unwrap().day2.upgrade_refusals, 1);
        assert_eq!(api.version_tag(0), "v1.11.2");
        // A worker is not checked; a forced control plane is not either.
        let ack = api
            .upgrade_on(2, &upgrade(&image, false), "v1.11.5", &id)
            .unwrap();
        assert_eq!(ack.ack, "Upgrade request received");
        api.upgrade_on(0, &upgrade(&image, true), "v1.11.5", &id)
            .unwrap();
        assert_eq!(api.version_tag(0), "v1.11.5");
        assert_eq!(api.schematic_on(0), Some(id.clone()));
        assert_eq!(cluster.node(0).phase(Instant::now()), Phase::Down);
        let cp = cluster.node(0);
        assert_eq!(cp.st.lock().unwrap().day2.installers, [image]);
    }

    #[tokio::test]
    async fn a_failing_installer_acks_and_keeps_the_old_version() {
        let cluster = healthy_cluster();
        let api = Api {
            cluster: cluster.clone(),
            me: 2,
            secure: true,
        };
        cluster.node(2).st.lock().unwrap().day2.installer_fails = true;
        let id = "cd".repeat(32);
        let image = format!("127.0.0.1:1/metal-installer/{id}:v1.11.5");
        api.upgrade_on(2, &upgrade(&image, false), "v1.11.5", &id)
            .unwrap();
        assert_eq!(api.version_tag(2), "v1.11.2");
        assert_eq!(api.schematic_on(2), None);
        assert_eq!(cluster.events.lock().unwrap()[0]["ok"], false);
    }

    #[tokio::test]
    async fn an_installer_the_registry_does_not_serve_is_refused() {
        // Nothing listens on port 1: the pull fails, as containerd's would.
        let id = "ab".repeat(32);
        let e = validate_installer(&format!("127.0.0.1:1/metal-installer/{id}:v1.11.5"))
            .await
            .unwrap_err();
        assert!(
            e.message().starts_with("error validating installer image"),
            "{e:?}"
        );
        let e = validate_installer("127.0.0.1:1/metal-installer/short:v1.11.5")
            .await
            .unwrap_err();
        assert!(e.message().contains("no schematic ID"), "{e:?}");
    }

    #[test]
    fn the_diff_names_changed_lines_only() {
        assert_eq!(line_diff("a\nb\nc\n", "a\nb\nc\n"), "");
        assert_eq!(line_diff("a\nb\nc\n", "a\nx\nc\n"), "+x\n-b\n");
        assert_eq!(line_diff("a\n", "a\nb\n"), "+b\n");
    }

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
}
