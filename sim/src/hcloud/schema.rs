//! Request bodies held against the vendored Hetzner Cloud OpenAPI document
//! (`sim/api-schemas/hetzner-cloud.openapi.json`), answered the way the real
//! API answers bad input: 422 `invalid_input` with `details.fields`.
//!
//! Two adjustments to the document, both facts about the live API:
//! - `POST /servers` takes IDs (integers) or names (strings) for `image`,
//!   `server_type`, `location` and the `ssh_keys` items; the document lists
//!   only strings, the official clients (hcloud-go) send integer IDs.
//! - Objects that list `properties` and say nothing of others are closed:
//!   the API answers unknown fields with "invalid input: unknown field name
//!   'x'" (seen for `create_image`, cloudpanel-io/cloudpanel-ce#659).

use serde_json::{Value, json};

/// The vendored document (the tests also check responses against it).
pub(crate) const DOCUMENT: &str = include_str!("../../api-schemas/hetzner-cloud.openapi.json");

/// One operation's request body check.
struct Operation {
    method: String,
    /// The path template's segments, `{…}` matching any one segment.
    segments: Vec<String>,
    required: bool,
    validator: jsonschema::Validator,
}

/// The request body checks of every operation in the document.
pub struct Schemas {
    ops: Vec<Operation>,
}

/// Why a request body was refused: HTTP status and the error object.
pub type Refusal = (u16, Value);

impl Schemas {
    /// Compiles the body schema of every operation that has one.
    pub fn load() -> anyhow::Result<Schemas> {
        let doc: Value = serde_json::from_str(DOCUMENT)?;
        let mut ops = Vec::new();
        for (path, item) in doc["paths"].as_object().into_iter().flatten() {
            for (method, op) in item.as_object().into_iter().flatten() {
                let body = &op["requestBody"];
                let Some(schema) = body["content"]["application/json"].get("schema") else {
                    continue;
                };
                let mut schema = schema.clone();
                if path == "/servers" && method == "post" {
                    widen_id_or_name(&mut schema);
                }
                close_objects(&mut schema);
                ops.push(Operation {
                    method: method.to_uppercase(),
                    segments: path
                        .trim_matches('/')
                        .split('/')
                        .map(String::from)
                        .collect(),
                    required: body["required"].as_bool().unwrap_or(false),
                    validator: jsonschema::draft202012::new(&schema)
                        .map_err(|e| anyhow::anyhow!("schema of {method} {path}: {e}"))?,
                });
            }
        }
        Ok(Schemas { ops })
    }

    /// Parses and checks the body of `method path` (path below `/v1`);
    /// operations without a body schema take no body and get `{}`.
    pub fn check(&self, method: &str, path: &str, body: &[u8]) -> Result<Value, Refusal> {
        let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
        let op = self.ops.iter().find(|o| {
            o.method == method
                && o.segments.len() == segs.len()
                && o.segments
                    .iter()
                    .zip(&segs)
                    .all(|(t, s)| t.starts_with('{') || t == s)
        });
        let blank = body.iter().all(u8::is_ascii_whitespace);
        let Some(op) = op else {
            return Ok(json!({}));
        };
        if blank && !op.required {
            return Ok(json!({}));
        }
        let value: Value = serde_json::from_slice(body).map_err(|e| {
            (
                400,
                json!({"code": "json_error", "message": format!("syntax error: {e}"), "details": {}}),
            )
        })?;
        let fields = field_errors(&op.validator, &value);
        if fields.is_empty() {
            return Ok(value);
        }
        Err((422, invalid_input(fields)))
    }
}

/// One refused field: its name (dotted path) and what is wrong with it.
pub struct FieldError {
    pub name: String,
    pub message: String,
    pub unknown: bool,
}

/// The `invalid_input` error object for these fields, worded as the API
/// words it.
pub fn invalid_input(fields: Vec<FieldError>) -> Value {
    let message = if let Some(u) = fields.iter().find(|f| f.unknown) {
        format!("invalid input: unknown field name '{}'", u.name)
    } else {
        let names: Vec<String> = fields.iter().map(|f| format!("'{}'", f.name)).collect();
        match names.len() {
            1 => format!("invalid input in field {}: {}", names[0], fields[0].message),
            _ => format!("invalid input in fields {}", names.join(", ")),
        }
    };
    let mut by_name: Vec<(String, Vec<String>)> = Vec::new();
    for f in fields {
        match by_name.iter_mut().find(|(n, _)| *n == f.name) {
            Some((_, m)) => m.push(f.message),
            None => by_name.push((f.name, vec![f.message])),
        }
    }
    let fields: Vec<Value> = by_name
        .into_iter()
        .map(|(name, messages)| json!({"name": name, "messages": messages}))
        .collect();
    json!({"code": "invalid_input", "message": message, "details": {"fields": fields}})
}

fn field_errors(v: &jsonschema::Validator, value: &Value) -> Vec<FieldError> {
    use jsonschema::error::ValidationErrorKind as K;
    let mut out = Vec::new();
    for e in v.iter_errors(value) {
        let at: Vec<String> = e
            .instance_path()
            .to_string()
            .split('/')
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect();
        let join = |extra: Option<&str>| {
            let mut p = at.clone();
            p.extend(extra.map(String::from));
            p.join(".")
        };
        match e.kind() {
            K::AdditionalProperties { unexpected } => {
                out.extend(unexpected.iter().map(|u| FieldError {
                    name: join(Some(u)),
                    message: "unknown field".into(),
                    unknown: true,
                }))
            }
            K::Required { property } => out.push(FieldError {
                name: join(property.as_str()),
                message: "Missing data for required field.".into(),
                unknown: false,
            }),
            K::Type { kind } => {
                use jsonschema::error::TypeKind;
                let types: Vec<String> = match kind {
                    TypeKind::Single(t) => vec![t.to_string()],
                    TypeKind::Multiple(set) => set.into_iter().map(|t| t.to_string()).collect(),
                };
                out.push(FieldError {
                    name: join(None),
                    message: format!("is not a valid {}", types.join(" or ")),
                    unknown: false,
                })
            }
            K::Enum { options } => out.push(FieldError {
                name: join(None),
                message: format!("must be one of {options}"),
                unknown: false,
            }),
            kind => out.push(FieldError {
                name: join(None),
                message: format!("does not satisfy {:?}", kind.keyword()),
                unknown: false,
            }),
        }
    }
    out
}

fn widen_id_or_name(schema: &mut Value) {
    let props = &mut schema["properties"];
    for field in ["image", "server_type", "location"] {
        props[field]["type"] = json!(["string", "integer"]);
    }
    props["ssh_keys"]["items"]["type"] = json!(["string", "integer"]);
}

fn close_objects(schema: &mut Value) {
    match schema {
        Value::Object(m) => {
            if m.contains_key("properties") && !m.contains_key("additionalProperties") {
                m.insert("additionalProperties".into(), Value::Bool(false));
            }
            m.values_mut().for_each(close_objects);
        }
        Value::Array(a) => a.iter_mut().for_each(close_objects),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schemas() -> &'static Schemas {
        static S: std::sync::OnceLock<Schemas> = std::sync::OnceLock::new();
        S.get_or_init(|| Schemas::load().unwrap())
    }

    fn post_servers(body: Value) -> Result<Value, Refusal> {
        schemas().check("POST", "/servers", body.to_string().as_bytes())
    }

    #[test]
    fn good_create_server_passes_with_ids_or_names() {
        let body = json!({
            "name": "imgbuild-1", "server_type": "cx23", "image": 114690387,
            "location": "fsn1", "start_after_create": false,
            "ssh_keys": [42, "named-key"], "labels": {"managed-by": "imgbuild"},
            "public_net": {"enable_ipv4": true, "enable_ipv6": false}
        });
        assert_eq!(post_servers(body.clone()).unwrap(), body);
    }

    #[test]
    fn bad_create_server_names_each_field() {
        let (status, err) = post_servers(json!({
            "server_type": 1.5, "image": "debian-13", "start_after_create": "no",
            "ssh_keys": [true]
        }))
        .unwrap_err();
        assert_eq!(status, 422);
        assert_eq!(err["code"], "invalid_input");
        let mut names: Vec<&str> = err["details"]["fields"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["name"].as_str().unwrap())
            .collect();
        names.sort();
        assert_eq!(
            names,
            ["name", "server_type", "ssh_keys.0", "start_after_create"]
        );
    }

    #[test]
    fn unknown_field_refused_like_the_api() {
        let (_, err) = schemas()
            .check(
                "POST",
                "/servers/7/actions/create_image",
                br#"{"type":"snapshot","labelkey":"x"}"#,
            )
            .unwrap_err();
        assert_eq!(
            err["message"],
            "invalid input: unknown field name 'labelkey'"
        );
        let (_, err) = schemas()
            .check(
                "POST",
                "/servers/7/actions/enable_rescue",
                br#"{"type":"linux32"}"#,
            )
            .unwrap_err();
        assert_eq!(err["details"]["fields"][0]["name"], "type");
    }

    #[test]
    fn broken_json_is_a_json_error() {
        let (status, err) = schemas().check("POST", "/ssh_keys", b"{").unwrap_err();
        assert_eq!((status, err["code"].as_str()), (400, Some("json_error")));
    }
}
