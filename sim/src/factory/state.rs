//! The factory double's state: what it was started with, the schematics it
//! registered, its misbehaviours, and just enough of image-factory's
//! `pkg/schematic` types (siderolabs/image-factory) to refuse what the real
//! factory refuses.

use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;

/// What real boot media are made of (see [`Args::kernel`]).
pub(crate) struct RealBoot {
    pub(crate) kernel: PathBuf,
    pub(crate) initramfs: PathBuf,
    pub(crate) uki_stub: Option<PathBuf>,
}

pub(crate) struct Misbehaviour {
    pub(crate) mode: String,
    pub(crate) remaining: Option<u32>,
}

pub(crate) struct Sim {
    pub(crate) base: PathBuf,
    pub(crate) state: PathBuf,
    pub(crate) versions: Vec<String>,
    pub(crate) extensions: Vec<String>,
    pub(crate) alt_url: Option<String>,
    /// Registered schematics by ID.
    pub(crate) schematics: Mutex<HashMap<String, Posted>>,
    pub(crate) modes: Mutex<Vec<Misbehaviour>>,
    pub(crate) image_gets: Mutex<HashMap<String, u64>>,
    pub(crate) build: tokio::sync::Mutex<()>,
    pub(crate) real: Option<RealBoot>,
    pub(crate) base_cmdline: Option<String>,
}

/// The misbehaviour to apply to this image request, if any (counts down).
pub(crate) fn take_mode(sim: &Sim, only: &[&str]) -> Option<String> {
    let mut modes = sim.modes.lock().unwrap();
    let m = modes
        .iter_mut()
        .find(|m| only.contains(&m.mode.as_str()) && m.remaining != Some(0))?;
    if let Some(n) = &mut m.remaining {
        *n -= 1;
    }
    Some(m.mode.clone())
}

pub(crate) fn text(status: StatusCode, body: impl Into<String>) -> Response {
    (status, [(header::CONTENT_TYPE, "text/plain")], body.into()).into_response()
}

/// A schematic as the factory keeps it: the bytes received, and what the
/// images need from them.
#[derive(Clone)]
pub(crate) struct Posted {
    pub(crate) body: String,
    pub(crate) schematic: SchematicShape,
}

/// Just enough of image-factory's `pkg/schematic` types to refuse what the
/// real factory refuses (yaml.v3 with KnownFields: unknown fields are an
/// error) and to read the META values and extensions the images need.
#[derive(Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)] // fields parsed only so that unknown ones are refused
pub(crate) struct SchematicShape {
    #[serde(default)]
    pub(crate) owner: String,
    #[serde(default)]
    pub(crate) overlay: OverlayShape,
    #[serde(default)]
    pub(crate) customization: CustomizationShape,
}

#[derive(Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)] // fields parsed only so that unknown ones are refused
pub(crate) struct OverlayShape {
    #[serde(default)]
    pub(crate) image: String,
    #[serde(default)]
    pub(crate) name: String,
    #[serde(default)]
    pub(crate) options: serde_yaml_ng::Mapping,
}

#[derive(Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[allow(dead_code)] // fields parsed only so that unknown ones are refused
pub(crate) struct CustomizationShape {
    #[serde(default)]
    pub(crate) embedded_machine_configuration: String,
    #[serde(default)]
    pub(crate) extra_kernel_args: Vec<String>,
    #[serde(default)]
    pub(crate) meta: Vec<MetaShape>,
    #[serde(default)]
    pub(crate) system_extensions: ExtensionsShape,
    #[serde(default)]
    pub(crate) bootloader: String,
    #[serde(default, rename = "secureboot")]
    pub(crate) secure_boot: SecureBootShape,
    #[serde(default)]
    pub(crate) disk_image: DiskImageShape,
}

/// `SecureBootCustomization` (siderolabs/image-factory `pkg/schematic/schematic.go`).
#[derive(Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(crate) struct SecureBootShape {
    #[serde(default)]
    pub(crate) enroll_keys: String,
    #[serde(default)]
    #[allow(dead_code)] // parsed only so that unknown fields are refused
    pub(crate) include_well_known_certificates: bool,
}

#[derive(Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct MetaShape {
    pub(crate) key: u8,
    #[serde(default)]
    pub(crate) value: String,
}

#[derive(Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(crate) struct ExtensionsShape {
    #[serde(default)]
    pub(crate) official_extensions: Vec<String>,
}

#[derive(Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[allow(dead_code)] // fields parsed only so that unknown ones are refused
pub(crate) struct DiskImageShape {
    #[serde(default)]
    pub(crate) sector_size: u64,
}

/// The ID the simulator gives a schematic: sha256 of the bytes received.
pub(crate) fn schematic_id(body: &[u8]) -> String {
    hex_lower(&Sha256::digest(body))
}

pub(crate) fn hex_lower(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
