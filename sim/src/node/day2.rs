//! What a node keeps across day two (its version, schematic, switches,
//! counters), MetaWrite, and the extension status read through the COSI
//! State API, as machined answers them (siderolabs/talos
//! `internal/app/machined/internal/server/v1alpha1/v1alpha1_server.go`).

use std::collections::BTreeSet;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use futures_util::Stream;
use serde_json::{Value, json};
use tonic::{Request, Response, Status};

use super::identity;
use super::service::Api;
use super::state::Day2;
use super::state::{Applied, Cluster};
use super::upgrade::schematic_of_installer;
use imgbuild::talos::api::cosi::resource::state_server::State as CosiState;
use imgbuild::talos::api::cosi::resource::{
    GetRequest, GetResponse, ListRequest, ListResponse, Metadata as ResMetadata, Resource, Spec,
};
use imgbuild::talos::api::machine::*;

impl Day2 {
    /// The running tag, `default` (`--talos-version`) unless set.
    pub fn version_or(&self, default: &str) -> String {
        self.version.clone().unwrap_or_else(|| default.to_owned())
    }
}

impl super::state::NodeState {
    /// The config the next boot runs: what a STAGED (or a rebooting) apply
    /// persisted, else the running one, except during a TRY, which is
    /// never persisted (siderolabs/talos `v1alpha1_server.go`
    /// ApplyConfiguration: `SetPersistedConfig` for every mode but TRY).
    pub fn persisted(&self) -> Option<Arc<Applied>> {
        self.day2
            .staged
            .clone()
            .or_else(|| self.day2.try_rollback.as_ref().map(|r| r.previous.clone()))
            .or_else(|| self.applied.clone())
    }
}

impl Api {
    /// The running tag of node `i`.
    pub(crate) fn version_tag(&self, i: usize) -> String {
        let node = self.cluster.node(i);
        let st = node.st.lock().unwrap();
        st.day2.version_or(&self.cluster.args.talos_version)
    }

    /// The running schematic of node `i`: what its last upgrade installed,
    /// else the one its config's installer names; none on stock Talos.
    pub(crate) fn schematic_on(&self, i: usize) -> Option<String> {
        let node = self.cluster.node(i);
        let st = node.st.lock().unwrap();
        if st.day2.stock {
            return None;
        }
        st.day2.schematic.clone().or_else(|| {
            st.applied
                .as_ref()
                .and_then(|a| schematic_of_installer(&a.install_image))
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

    /// The MachineConfig resources of node `i` (siderolabs/talos
    /// `pkg/machinery/resources/config/machine_config.go`): `v1alpha1`, the
    /// active config, and from v1.10 `persistent`, the one saved for the
    /// next boot (ahead of the active one after a STAGED apply, behind it
    /// during a TRY). The spec is the config's YAML as applied.
    fn machine_configs_on(&self, i: usize) -> Vec<Resource> {
        let has_persistent = self.talos(i).has_persistent_config_resource();
        let node = self.cluster.node(i);
        let st = node.st.lock().unwrap();
        let resource = |id: &str, a: &Applied| Resource {
            metadata: Some(ResMetadata {
                namespace: CONFIG.into(),
                r#type: MACHINE_CONFIG.into(),
                id: id.into(),
                version: "1".into(),
                phase: "running".into(),
                ..ResMetadata::default()
            }),
            spec: Some(Spec {
                proto_spec: Vec::new(),
                yaml_spec: a.raw.clone(),
            }),
        };
        let mut out = Vec::new();
        if let Some(a) = &st.applied {
            out.push(resource("v1alpha1", a));
        }
        if has_persistent && let Some(p) = st.persisted() {
            out.push(resource("persistent", &p));
        }
        out
    }

    /// The node a COSI call is for: apid routes it by `nodes`/`node`
    /// metadata like any other (one target only for State).
    pub(crate) fn state_target<T>(&self, req: &Request<T>) -> Result<usize, Status> {
        match self.route(req)? {
            super::service::Route::Local => Ok(self.me),
            super::service::Route::One2One(t) => self.backend(&t),
            super::service::Route::One2Many(t) if t.len() == 1 => self.backend(&t[0]),
            super::service::Route::One2Many(_) => Err(Status::invalid_argument(
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
        // Maintenance mode serves the COSI state read-only (v1.11/v1.12
        // `internal/app/maintenance/server.go` `RegisterStateServer` behind
        // `resources.AccessPolicy`; from v1.13 machined's own): the node
        // identity is not there, for STATE is not mounted on a new or wiped
        // machine (`identity.rs`), so Get is NotFound and List empty. Other
        // types stay Unimplemented here (not modelled).
        if !self.secure && namespace == identity::IDENTITY_NS && kind == identity::IDENTITY_TYPE {
            return Ok(Vec::new());
        }
        let i = self.state_target(req)?;
        if namespace == RUNTIME && kind == EXTENSION_STATUS {
            if self
                .cluster
                .node(i)
                .st
                .lock()
                .unwrap()
                .day2
                .schematic_read_fails
            {
                return Err(Status::unavailable(
                    "error listing resources: the runtime state is not available",
                ));
            }
            Ok(self.extensions_on(i))
        } else if namespace == CONFIG && kind == MACHINE_CONFIG {
            Ok(self.machine_configs_on(i))
        } else if let Some(found) = self.k8s_resources(i, namespace, kind) {
            Ok(found)
        } else if namespace == identity::IDENTITY_NS && kind == identity::IDENTITY_TYPE {
            let node_id = self.cluster.node(i).st.lock().unwrap().node_id.clone();
            Ok(vec![identity::identity_resource(&node_id)])
        } else if namespace == identity::NETWORK_NS && kind == identity::HOSTNAME_STATUS_TYPE {
            let name = self.cluster.node(i).display_name();
            let (host, domain) = name.split_once('.').unwrap_or((&name, ""));
            Ok(vec![identity::hostname_resource(host, domain)])
        } else if namespace == RUNTIME && kind == super::security::SECURITY_STATE {
            let secure_boot = self.cluster.node(i).st.lock().unwrap().secure_boot;
            Ok(vec![super::security::resource(secure_boot)])
        } else {
            Err(Status::not_found(format!(
                "resource type {kind:?} in namespace {namespace:?} is not registered"
            )))
        }
    }

    pub(crate) fn meta_write_call(
        &self,
        req: Request<MetaWriteRequest>,
    ) -> Result<Response<MetaWriteResponse>, Status> {
        let messages = self.answer(&req, |i| Ok(vec![self.meta_write_on(i, req.get_ref())?]))?;
        Ok(Response::new(MetaWriteResponse { messages }))
    }
}

const RUNTIME: &str = "runtime";
const CONFIG: &str = "config";
const MACHINE_CONFIG: &str = "MachineConfigs.config.talos.dev";
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

/// The day-two part of a node's stats.
pub(crate) fn stats_of(
    cluster: &Cluster,
    d: &Day2,
    version: String,
    schematic: Option<String>,
    now: Instant,
) -> Value {
    json!({
        "version": version,
        "schematic": schematic,
        "boot_id": d.life.boot_id(),
        "boot_ids": d.life.boot_ids,
        "reboots": d.life.reboots,
        "cordoned": d.life.cordoned,
        "cordoned_by_client": d.life.cordoned_by_client,
        "evictions": d.life.evictions,
        "reboots_undrained": d.life.reboots_undrained,
        "timeline": cluster.outages_json(&d.life, now),
        "staged": d.staged.is_some(),
        "try_pending": d.try_rollback.is_some(),
        "upgrade_calls": d.upgrade_calls,
        "staged_upgrades": d.staged_upgrades,
        "upgrades": d.upgrades,
        "upgrade_refusals": d.upgrade_refusals,
        "sequences_locked": d.sequences_locked,
        "pulls": d.pulls,
        "pulls_cancelled": d.pulls_cancelled,
        "installer_refusals": d.installer_refusals,
        "last_error": d.last_error,
        "requests_by_mode": d.requests_by_mode,
        "applies_by_mode": d.applies_by_mode,
        "apply_refusals": d.apply_refusals,
        "dry_runs": d.dry_runs,
        "try_cancellations": d.try_cancellations,
        "try_rollbacks": d.try_rollbacks,
        "read_calls": d.read_calls,
        "lifecycle_upgrades": d.lifecycle_upgrades,
        "pulled": d.pulled,
        "images": images_by_place(&d.images),
        "next_boot": d.next_boot.as_ref().map(|(v, _)| v),
        "reboot_calls": d.reboot_calls,
        "meta_writes": d.meta_writes,
        "meta_keys": d.meta.keys().collect::<Vec<_>>(),
        "installers": d.installers,
        "reboot_modes": d.reboot_modes,
        "installer_fails": d.installer_fails,
        "stock": d.stock,
        "schematic_read_fails": d.schematic_read_fails,
    })
}

/// `{PLACE: [image…]}` for the stats.
fn images_by_place(images: &BTreeSet<(&'static str, String)>) -> Value {
    let mut out = serde_json::Map::new();
    for (place, image) in images {
        out.entry(place.to_string())
            .or_insert_with(|| json!([]))
            .as_array_mut()
            .expect("made an array")
            .push(json!(image));
    }
    Value::Object(out)
}
