//! The control server's per-node switches: `POST /_sim/node` sets a
//! node's version and field failures while the simulator runs, and
//! `POST /_sim/installer` (the older form of `installer_fails`).

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use serde_json::json;

use super::state::{Cluster, ControlReply, Node, control_error};
use super::version::Talos;

/// `POST /_sim/node`: each field given replaces the node's switch.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct NodeSwitch {
    node: String,
    version: Option<String>,
    installer_fails: Option<bool>,
    schematic_read_fails: Option<bool>,
    stock: Option<bool>,
    stall_connects: Option<bool>,
    leave_cordoned: Option<bool>,
    cordoned: Option<bool>,
    pull_ms: Option<u64>,
    drain_ms: Option<u64>,
    disruption_budget: Option<bool>,
}

impl Cluster {
    /// The node stats call `name`.
    fn named(&self, name: &str) -> Option<Arc<Node>> {
        self.all().into_iter().find(|n| n.display_name() == name)
    }
}

pub(crate) async fn node_switch(
    State(cluster): State<Arc<Cluster>>,
    axum::Json(req): axum::Json<NodeSwitch>,
) -> ControlReply {
    if let Some(v) = req.version.as_deref()
        && Talos::parse(v).is_none()
    {
        return control_error(
            StatusCode::BAD_REQUEST,
            format!("version {v:?} is not a Talos version (vX.Y.Z)"),
        );
    }
    let Some(n) = cluster.named(&req.node) else {
        return control_error(StatusCode::NOT_FOUND, format!("no node named {}", req.node));
    };
    let mut st = n.st.lock().unwrap();
    let d = &mut st.day2;
    if req.version.is_some() {
        d.version = req.version;
    }
    let set = |to: &mut bool, v: Option<bool>| {
        if let Some(v) = v {
            *to = v;
        }
    };
    set(&mut d.installer_fails, req.installer_fails);
    set(&mut d.schematic_read_fails, req.schematic_read_fails);
    set(&mut d.stock, req.stock);
    set(&mut d.stall_connects, req.stall_connects);
    set(&mut d.leave_cordoned, req.leave_cordoned);
    set(&mut d.disruption_budget, req.disruption_budget);
    // An operator's `kubectl cordon`: no Talos mark, so no boot undoes it.
    set(&mut d.life.cordoned, req.cordoned);
    set(&mut d.life.cordoned_by_client, req.cordoned);
    d.pull_ms = req.pull_ms.or(d.pull_ms);
    d.drain_ms = req.drain_ms.or(d.drain_ms);
    (
        StatusCode::OK,
        axum::Json(json!({
            "node": req.node,
            "version": d.version_or(&cluster.args.talos_version),
            "installer_fails": d.installer_fails,
            "schematic_read_fails": d.schematic_read_fails,
            "stock": d.stock,
            "stall_connects": d.stall_connects,
            "leave_cordoned": d.leave_cordoned,
            "cordoned": d.life.cordoned,
            "pull_ms": d.pull_ms,
            "drain_ms": d.drain_ms,
            "disruption_budget": d.disruption_budget,
        })),
    )
}

/// `POST /_sim/installer` `{"node": NAME, "fail": bool}`: whether the
/// node's installer fails after the ack.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct InstallerSwitch {
    node: String,
    fail: bool,
}

pub(crate) async fn installer_switch(
    State(cluster): State<Arc<Cluster>>,
    axum::Json(req): axum::Json<InstallerSwitch>,
) -> ControlReply {
    match cluster.named(&req.node) {
        Some(n) => {
            n.st.lock().unwrap().day2.installer_fails = req.fail;
            (
                StatusCode::OK,
                axum::Json(json!({"node": req.node, "fail": req.fail})),
            )
        }
        None => control_error(StatusCode::NOT_FOUND, format!("no node named {}", req.node)),
    }
}
