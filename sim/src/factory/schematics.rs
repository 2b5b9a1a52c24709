//! The factory double's schematic and catalogue endpoints (siderolabs/
//! image-factory `internal/frontend/http/schematic.go`, `versions.go`,
//! `extensions.go`): `POST /schematics`, `GET /schematics/ID`, versions,
//! extensions, the installer manifest, and the `/_sim` views of what it saw.

use super::state::*;
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

pub(crate) async fn post_schematic(State(sim): State<Arc<Sim>>, body: String) -> Response {
    if take_mode(&sim, &["schematics-503"]).is_some() {
        return text(StatusCode::SERVICE_UNAVAILABLE, "service unavailable");
    }
    let schematic: SchematicShape = match serde_yaml_ng::from_str::<Option<SchematicShape>>(&body) {
        Ok(s) => s.unwrap_or_default(),
        Err(e) => return text(StatusCode::BAD_REQUEST, e.to_string()),
    };
    let mut id = schematic_id(body.as_bytes());
    let posted = Posted {
        body: body.clone(),
        schematic,
    };
    sim.schematics.lock().unwrap().insert(id.clone(), posted);
    if take_mode(&sim, &["wrong-id"]).is_some() {
        id = id.chars().rev().collect();
    }
    (
        StatusCode::CREATED,
        axum::Json(serde_json::json!({"id": id, "schematic": body})),
    )
        .into_response()
}

pub(crate) async fn get_schematic(State(sim): State<Arc<Sim>>, Path(id): Path<String>) -> Response {
    match sim.schematics.lock().unwrap().get(&id) {
        Some(p) => ([(header::CONTENT_TYPE, "application/yaml")], p.body.clone()).into_response(),
        None => text(StatusCode::NOT_FOUND, "schematic not found"),
    }
}

/// The factory's registry face: what a node pulls `<host>/<image>/<id>:<tag>`
/// from. As siderolabs/image-factory `internal/frontend/http/registry.go`
/// `handleManifest`: the schematic must have been posted (else "schematic not
/// found"), the image is `installer` or `<platform>-installer`
/// (`getRequestedImage`), and the version must be one the factory builds.
/// Per-platform installers exist from Talos v1.10 on
/// (`quirks.SupportsUnifiedInstaller`).
pub(crate) async fn installer_manifest(
    State(sim): State<Arc<Sim>>,
    Path((image, id, tag)): Path<(String, String, String)>,
) -> Response {
    if !sim.schematics.lock().unwrap().contains_key(&id) {
        return text(StatusCode::NOT_FOUND, "schematic not found");
    }
    // `installer-secureboot` and `<platform>-installer-secureboot` are the
    // Secure Boot installers (`getRequestedImage` tries that suffix first).
    let plain = image.strip_suffix("-secureboot").unwrap_or(&image);
    let platform = plain.strip_suffix("-installer");
    if plain != "installer" && platform.is_none_or(str::is_empty) {
        return text(StatusCode::NOT_FOUND, format!("unknown image {image:?}"));
    }
    if !sim.versions.contains(&tag) {
        return text(StatusCode::NOT_FOUND, format!("version {tag} not found"));
    }
    let minor = tag
        .trim_start_matches('v')
        .split('.')
        .nth(1)
        .and_then(|m| m.parse::<u32>().ok())
        .unwrap_or(u32::MAX);
    if platform.is_some() && minor < 10 {
        return text(
            StatusCode::NOT_FOUND,
            format!("{image}: per-platform installers start with Talos v1.10"),
        );
    }
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "annotations": {"org.opencontainers.image.title": format!("{image}/{id}:{tag}")},
    });
    (
        [(
            header::CONTENT_TYPE,
            "application/vnd.oci.image.manifest.v1+json",
        )],
        manifest.to_string(),
    )
        .into_response()
}

pub(crate) async fn versions(State(sim): State<Arc<Sim>>) -> Response {
    axum::Json(&sim.versions).into_response()
}

pub(crate) async fn extensions(State(sim): State<Arc<Sim>>, Path(v): Path<String>) -> Response {
    if !sim.versions.contains(&v) {
        return text(StatusCode::NOT_FOUND, "version not found");
    }
    let list: Vec<_> = sim
        .extensions
        .iter()
        .map(|name| {
            serde_json::json!({
                "name": name,
                "ref": format!("ghcr.io/{name}:{v}"),
                "digest": format!("sha256:{}", "0".repeat(64)),
                "author": "Sidero Labs",
                "description": format!("{name} (simulated)"),
            })
        })
        .collect();
    axum::Json(list).into_response()
}

pub(crate) async fn stats(State(sim): State<Arc<Sim>>) -> Response {
    axum::Json(sim.image_gets.lock().unwrap().clone()).into_response()
}

/// Every schematic posted so far, as received: what the factory's operator
/// can read about the nodes that were built.
pub(crate) async fn posted(State(sim): State<Arc<Sim>>) -> Response {
    let map: std::collections::BTreeMap<String, String> = sim
        .schematics
        .lock()
        .unwrap()
        .iter()
        .map(|(id, p)| (id.clone(), p.body.clone()))
        .collect();
    axum::Json(map).into_response()
}
