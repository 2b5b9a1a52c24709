//! Reading an applied machine config as Talos does (siderolabs/talos
//! `pkg/machinery/config/configloader`): documents split and decoded, each
//! validated against the vendored Talos 1.11 JSON schema.

use super::state::*;
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use imgbuild::talos::pki::{self, CertAndKey};
use serde_json::{Value, json};
use std::collections::HashMap;
use tonic::Status;

pub(crate) fn b64_pem(v: &Value, what: &str) -> Result<String, String> {
    let s = v.as_str().ok_or_else(|| format!("{what} is missing"))?;
    let bytes = STANDARD
        .decode(s.trim())
        .map_err(|_| format!("{what} is not base64"))?;
    String::from_utf8(bytes).map_err(|_| format!("{what} is not PEM"))
}

/// The official Talos 1.11 config schema, vendored in the repository.
pub(crate) const SCHEMA: &str = include_str!("../../../schemas/talos-v1.11-config.schema.json");

/// Talos' registry of document kinds as the vendored schema lists them (its
/// `oneOf`), each with a validator for its definition, keyed by
/// (apiVersion, kind); the v1alpha1 document under ("v1alpha1", "").
pub(crate) fn registry() -> &'static HashMap<(String, String), jsonschema::Validator> {
    static REGISTRY: std::sync::OnceLock<HashMap<(String, String), jsonschema::Validator>> =
        std::sync::OnceLock::new();
    REGISTRY.get_or_init(|| {
        let official: Value = serde_json::from_str(SCHEMA).expect("vendored schema is JSON");
        let mut kinds = HashMap::new();
        for branch in official["oneOf"].as_array().expect("schema has oneOf") {
            let reference = branch["$ref"].as_str().expect("oneOf holds $refs");
            let def = &official["$defs"][reference.trim_start_matches("#/$defs/")];
            let only = |key: &str| {
                def["properties"][key]["enum"][0]
                    .as_str()
                    .map(str::to_owned)
            };
            let key = match (only("apiVersion"), only("kind")) {
                (Some(version), Some(kind)) => (version, kind),
                _ => ("v1alpha1".to_owned(), String::new()),
            };
            let schema = json!({
                "$schema": official["$schema"],
                "$ref": reference,
                "$defs": official["$defs"],
            });
            kinds.insert(
                key,
                jsonschema::validator_for(&schema).expect("vendored schema compiles"),
            );
        }
        kinds
    })
}

/// Schema violations of a document, checked here with this crate's own
/// validator rather than imgbuild's. Like Talos, which picks a document's
/// type by its `version`/`kind` before decoding, each document is held
/// against its kind's definition. Messages name paths and unknown keys,
/// never values.
pub(crate) fn problems_of(validator: &jsonschema::Validator, doc: &Value) -> Vec<String> {
    validator
        .iter_errors(doc)
        .map(|e| {
            let at = e.instance_path().to_string();
            match e.kind() {
                jsonschema::error::ValidationErrorKind::AdditionalProperties { unexpected } => {
                    format!(
                        "unknown keys found during decoding: {at}: {}",
                        unexpected.join(", ")
                    )
                }
                kind => format!("{at}: does not satisfy the schema's {:?}", kind.keyword()),
            }
        })
        .collect()
}

/// The documents of a machine config, as talos
/// `pkg/machinery/config/configloader/internal/decoder/decoder.go` decodes
/// them: null documents skipped; a mapping with `machine`, `cluster`,
/// `debug` or `persist` (or `apiVersion: v1alpha1` without a kind) is the
/// v1alpha1 document; any other needs `kind` and `apiVersion` of a
/// registered kind; no (apiVersion, kind, name) twice. Each is checked
/// against its kind's schema. The v1alpha1 document, and the others as
/// `Kind/name`.
pub(crate) fn read_documents(data: &[u8]) -> Result<(Value, Vec<String>), Status> {
    use serde::Deserialize;
    let invalid = |m: String| Status::invalid_argument(format!("config validation failed: {m}"));
    let mut v1alpha1 = None;
    let mut others = Vec::new();
    let mut seen = Vec::new();
    for de in serde_yaml_ng::Deserializer::from_slice(data) {
        let doc = Value::deserialize(de)
            .map_err(|e| Status::invalid_argument(format!("failed to parse config: {e}")))?;
        let map = match &doc {
            Value::Null => continue,
            Value::Object(map) => map,
            _ => return Err(invalid("expected a YAML document".into())),
        };
        let field = |k: &str| map.get(k).and_then(Value::as_str).unwrap_or_default();
        let legacy = ["machine", "cluster", "debug", "persist"]
            .iter()
            .any(|k| map.contains_key(*k));
        let version = if legacy {
            "v1alpha1"
        } else {
            field("apiVersion")
        };
        let kind = field("kind");
        let id = (
            version.to_owned(),
            kind.to_owned(),
            field("name").to_owned(),
        );
        let validator = match (version, kind) {
            ("v1alpha1", "") => &registry()[&("v1alpha1".to_owned(), String::new())],
            (_, "") => return Err(invalid("missing kind".into())),
            ("", _) => return Err(invalid("missing apiVersion".into())),
            (version, kind) => registry()
                .get(&(version.to_owned(), kind.to_owned()))
                .ok_or_else(|| invalid(format!("{kind:?} {version:?}: not registered")))?,
        };
        if seen.contains(&id) {
            return Err(invalid(format!(
                "duplicate document {}/{}/{} is not allowed",
                id.0, id.1, id.2
            )));
        }
        seen.push(id);
        let problems = problems_of(validator, &doc);
        if !problems.is_empty() {
            return Err(invalid(problems.join("; ")));
        }
        if kind.is_empty() {
            v1alpha1 = Some(doc);
        } else {
            others.push(format!("{kind}/{}", field("name")));
        }
    }
    let doc = v1alpha1.ok_or_else(|| invalid("no v1alpha1 document".into()))?;
    Ok((doc, others))
}

/// Validates a machine config as a node does and extracts what it uses.
pub(crate) fn read_config(data: &[u8]) -> Result<Applied, Status> {
    let (doc, documents) = read_documents(data)?;
    let invalid = |m: String| Status::invalid_argument(format!("config validation failed: {m}"));
    let crt = b64_pem(&doc["machine"]["ca"]["crt"], "machine.ca.crt").map_err(invalid)?;
    pki::cert_info(&crt).map_err(|e| invalid(format!("machine.ca.crt: {e}")))?;
    let key = match doc["machine"]["ca"]["key"].as_str() {
        Some(k) if !k.is_empty() => {
            b64_pem(&doc["machine"]["ca"]["key"], "machine.ca.key").map_err(invalid)?
        }
        _ => String::new(),
    };
    let endpoint = doc["cluster"]["controlPlane"]["endpoint"]
        .as_str()
        .ok_or_else(|| invalid("cluster.controlPlane.endpoint is missing".into()))?
        .to_owned();
    let k8s_ca = match doc["cluster"]["ca"]["key"].as_str() {
        Some(k) if !k.is_empty() => Some(CertAndKey {
            crt: b64_pem(&doc["cluster"]["ca"]["crt"], "cluster.ca.crt").map_err(invalid)?,
            key: b64_pem(&doc["cluster"]["ca"]["key"], "cluster.ca.key").map_err(invalid)?,
        }),
        _ => None,
    };
    // Talos deploys flannel only for `cni.name: flannel`, the default
    // (siderolabs/talos internal/app/machined/pkg/controllers/k8s/
    // control_plane.go, FlannelEnabled); `custom` installs cni.urls.
    let cluster = &doc["cluster"];
    let listed = |v: &Value| v.as_array().is_some_and(|a| !a.is_empty());
    let cni = match cluster["network"]["cni"]["name"]
        .as_str()
        .unwrap_or("flannel")
    {
        "flannel" => true,
        "custom" => listed(&cluster["network"]["cni"]["urls"]),
        _ => false,
    } || listed(&cluster["inlineManifests"])
        || listed(&cluster["extraManifests"]);
    let api_sans = doc["cluster"]["apiServer"]["certSANs"]
        .as_array()
        .map(|a| a.iter().filter_map(|s| s.as_str()?.parse().ok()).collect())
        .unwrap_or_default();
    Ok(Applied {
        control_plane: doc["machine"]["type"].as_str() == Some("controlplane"),
        hostname: doc["machine"]["network"]["hostname"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        os_ca: CertAndKey { crt, key },
        k8s_ca,
        endpoint,
        cluster_name: doc["cluster"]["clusterName"]
            .as_str()
            .unwrap_or("cluster")
            .to_owned(),
        api_sans,
        documents,
        raw: String::from_utf8_lossy(data).into_owned(),
        v1alpha1: doc.clone(),
        install_image: doc["machine"]["install"]["image"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        cni,
    })
}
