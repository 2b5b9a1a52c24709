//! Every Proxmox VE API request checked against the official API schema
//! (sim/api-schemas/proxmox-ve.apidata.json, the API viewer's apidata.js),
//! the way pve-common's `PVE::JSONSchema` does it (src/PVE/JSONSchema.pm:
//! `check_object`, `check_prop`, `check_type`, `parse_property_string`),
//! with its error texts, so a request the real server refuses is refused here.
//!
//! Named formats checked: pve-node, pve-vmid, pve-storage-id, pve-configid,
//! pve-configid-list, pve-bridge-id, mac-addr, dns-name. Every other named
//! format (pve-volume-id*, pve-qm-boot, pve-vm-cpu-conf, pve-storage-content,
//! pve-tag-list, ip/CIDR formats, …) passes unchecked, as do patterns the
//! Rust regex engine cannot compile.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use regex::Regex;
use serde_json::{Map, Value};

/// The vendored schema; its origin is named in sim/api-schemas/README.md.
const APIDATA: &str = include_str!("../../api-schemas/proxmox-ve.apidata.json");

/// Per-parameter errors, as PVE's `{"errors": {param: msg}}`.
pub type Errors = BTreeMap<String, String>;

/// One API path of the schema, e.g. `/nodes/{node}/qemu/{vmid}/config`.
struct Endpoint {
    path: String,
    segments: Vec<String>,
    info: Map<String, Value>,
}

/// The API tree, flattened for matching request paths.
pub struct Schema {
    endpoints: Vec<Endpoint>,
}

/// A request path matched to its schema entry.
pub struct Route<'a> {
    /// The schema's path template (what handlers dispatch on).
    pub path: &'a str,
    /// `{name}` segments of the template with the request's values.
    pub params: Vec<(String, String)>,
    /// The method's schema (`parameters`, `returns`, …).
    pub method: &'a Value,
}

impl Schema {
    /// The schema the simulator was built with.
    pub fn get() -> &'static Schema {
        static SCHEMA: OnceLock<Schema> = OnceLock::new();
        SCHEMA.get_or_init(|| {
            let tree: Vec<Value> = serde_json::from_str(APIDATA).expect("vendored apidata parses");
            let mut endpoints = Vec::new();
            flatten(&tree, &mut endpoints);
            Schema { endpoints }
        })
    }

    /// The endpoint and method schema for `method path` (path relative to
    /// `/api2/json`), or None when the API has no such path; Some with a
    /// missing method is answered "not implemented" by the caller.
    pub fn route(&self, method: &str, path: &str) -> Option<Result<Route<'_>, ()>> {
        let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
        for ep in &self.endpoints {
            if ep.segments.len() != parts.len() {
                continue;
            }
            let mut params = Vec::new();
            let matched = ep.segments.iter().zip(&parts).all(|(seg, part)| {
                match seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
                    Some(name) if !part.is_empty() => {
                        params.push((name.to_owned(), percent_decode(part)));
                        true
                    }
                    Some(_) => false,
                    None => seg == part,
                }
            });
            if matched {
                return Some(match ep.info.get(method) {
                    Some(m) => Ok(Route {
                        path: &ep.path,
                        params,
                        method: m,
                    }),
                    None => Err(()),
                });
            }
        }
        None
    }
}

fn flatten(nodes: &[Value], out: &mut Vec<Endpoint>) {
    for n in nodes {
        let path = n["path"].as_str().unwrap_or_default().to_owned();
        let segments = path
            .trim_matches('/')
            .split('/')
            .map(str::to_owned)
            .collect();
        if let Some(info) = n["info"].as_object() {
            out.push(Endpoint {
                path,
                segments,
                info: info.clone(),
            });
        }
        if let Some(children) = n["children"].as_array() {
            flatten(children, out);
        }
    }
}

/// `%XX` decoding of one URL component (`+` is a space only in forms).
pub fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16)
        {
            out.push(v);
            i += 3;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Checks `params` (path, query and body parameters, all as the strings
/// they arrive as) against a method's `parameters` schema, like
/// `PVE::JSONSchema::validate`.
pub fn check(method: &Value, params: &BTreeMap<String, String>) -> Result<(), Errors> {
    let mut errors = Errors::new();
    let empty = Map::new();
    let props = method["parameters"]["properties"]
        .as_object()
        .unwrap_or(&empty);
    let additional = method["parameters"]["additionalProperties"]
        .as_i64()
        .unwrap_or(0)
        != 0;
    check_object("", props, params, additional, &mut errors);
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors)
    }
}

/// The schema of a parameter: `scsi0` is described by `scsi[n]` ("n is 0 to 30").
fn property<'a>(props: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    if let Some(p) = props.get(key) {
        return Some(p);
    }
    let digits = key.trim_start_matches(|c: char| !c.is_ascii_digit());
    let stem = &key[..key.len() - digits.len()];
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let p = props.get(&format!("{stem}[n]"))?;
    let n: u64 = digits.parse().ok()?;
    let max = p["description"].as_str().and_then(|d| {
        let rest = &d[d.find("(n is 0 to ")? + 11..];
        rest[..rest.find(')')?].trim().parse::<u64>().ok()
    });
    (max.is_none_or(|m| n <= m) && !(digits.len() > 1 && digits.starts_with('0'))).then_some(p)
}

/// A stored string as JSON of the parameter's schema type (what the real
/// server's answers carry: `"cores": 2`, `"memory": "4096"`).
pub fn typed(method: &Value, key: &str, value: &str) -> Value {
    let props = method["parameters"]["properties"].as_object();
    let ty = props
        .and_then(|p| property(p, key))
        .and_then(|s| s["type"].as_str())
        .unwrap_or("string");
    match ty {
        "integer" | "boolean" => value
            .parse::<i64>()
            .map_or_else(|_| Value::from(value), Value::from),
        "number" => value
            .parse::<f64>()
            .map_or_else(|_| Value::from(value), Value::from),
        _ => Value::from(value),
    }
}

fn add(errors: &mut Errors, path: &str, msg: String) {
    let path = if path.is_empty() { "_root" } else { path };
    errors
        .entry(path.to_owned())
        .and_modify(|m| {
            m.push_str("\\n");
            m.push_str(&msg);
        })
        .or_insert(msg);
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_owned()
    } else {
        format!("{path}.{key}")
    }
}

fn check_object(
    path: &str,
    props: &Map<String, Value>,
    value: &BTreeMap<String, String>,
    additional: bool,
    errors: &mut Errors,
) {
    for (k, schema) in props {
        if k.ends_with("[n]") || schema.get("alias").is_some() {
            continue;
        }
        match value.get(k) {
            Some(v) => check_prop(v, schema, &join(path, k), errors),
            None => {
                if !flag(schema, "optional") && !flag(schema, "group") {
                    add(
                        errors,
                        &join(path, k),
                        "property is missing and it is not optional".into(),
                    );
                }
            }
        }
    }
    for (k, v) in value {
        let newpath = join(path, k);
        match property(props, k) {
            Some(schema) => {
                if let Some(req) = schema["requires"].as_str()
                    && !value.contains_key(req)
                {
                    add(
                        errors,
                        &join(path, req),
                        format!("missing property required by '{newpath}'"),
                    );
                }
                if !props.contains_key(k) {
                    check_prop(v, schema, &newpath, errors);
                }
            }
            None if !additional => add(
                errors,
                &newpath,
                "property is not defined in schema and the schema does not allow additional properties"
                    .into(),
            ),
            None => {}
        }
    }
}

fn flag(schema: &Value, name: &str) -> bool {
    match &schema[name] {
        Value::Number(n) => n.as_i64() != Some(0),
        Value::Bool(b) => *b,
        _ => false,
    }
}

fn is_integer(v: &str) -> bool {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| Regex::new(r"^[+-]?\d+$").unwrap())
        .is_match(v)
}

fn is_number(v: &str) -> bool {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| Regex::new(r"^[+-]?(\d+\.\d+|\d+\.|\.\d+|\d+)([eE][+-]?\d+)?$").unwrap())
        .is_match(v)
}

fn check_prop(value: &str, schema: &Value, path: &str, errors: &mut Errors) {
    let ty = schema["type"].as_str().unwrap_or("string");
    let type_ok = match ty {
        "boolean" => value == "0" || value == "1",
        "integer" => is_integer(value),
        "number" => is_number(value),
        _ => true,
    };
    if !type_ok {
        add(
            errors,
            path,
            format!("type check ('{ty}') failed - got '{value}'"),
        );
        return;
    }
    match &schema["format"] {
        Value::Object(format) => {
            if let Err(e) = check_property_string(format, value, path) {
                add(errors, path, format!("invalid format - {e}"));
                return;
            }
        }
        Value::String(name) => {
            if let Err(e) = check_named_format(name, value) {
                add(errors, path, format!("invalid format - {e}"));
                return;
            }
        }
        _ => {}
    }
    if let Some(pattern) = schema["pattern"].as_str()
        && let Ok(re) = Regex::new(&format!("^(?:{pattern})$"))
        && !re.is_match(value)
    {
        add(
            errors,
            path,
            "value does not match the regex pattern".into(),
        );
        return;
    }
    if let Some(max) = schema["maxLength"].as_u64()
        && value.chars().count() as u64 > max
    {
        add(
            errors,
            path,
            format!("value may only be {max} characters long"),
        );
        return;
    }
    if let Some(min) = schema["minLength"].as_u64()
        && (value.chars().count() as u64) < min
    {
        add(
            errors,
            path,
            format!("value must be at least {min} characters long"),
        );
        return;
    }
    if is_number(value) {
        let n: f64 = value.parse().unwrap_or(0.0);
        if let Some(max) = schema["maximum"].as_f64()
            && n > max
        {
            add(
                errors,
                path,
                format!("value must have a maximum value of {}", schema["maximum"]),
            );
            return;
        }
        if let Some(min) = schema["minimum"].as_f64()
            && n < min
        {
            add(
                errors,
                path,
                format!("value must have a minimum value of {}", schema["minimum"]),
            );
            return;
        }
    }
    if let Some(list) = schema["enum"].as_array()
        && !list.iter().any(|e| e.as_str() == Some(value))
    {
        let names: Vec<&str> = list.iter().filter_map(Value::as_str).collect();
        add(
            errors,
            path,
            format!(
                "value '{value}' does not have a value in the enumeration '{}'",
                names.join(", ")
            ),
        );
    }
}

/// `parse_property_string` then `check_object` with no additional keys;
/// the error text is what `PVE::Exception` stringifies to.
fn check_property_string(
    format: &Map<String, Value>,
    data: &str,
    path: &str,
) -> Result<(), String> {
    let mut res: BTreeMap<String, String> = BTreeMap::new();
    let mut default_key: Option<String> = None;
    for part in data.split(',') {
        if part.trim().is_empty() {
            continue;
        }
        match part.split_once('=') {
            Some((k, v)) if !k.is_empty() && !v.is_empty() => {
                if res.contains_key(k) {
                    return Err(format!(
                        "duplicate key in comma-separated list property: {k}\n"
                    ));
                }
                let mut k = k.to_owned();
                let mut schema = format.get(&k);
                if let Some(alias) = schema.and_then(|s| s["alias"].as_str()) {
                    if let Some(key_alias) = schema.and_then(|s| s["keyAlias"].as_str()) {
                        if res.contains_key(key_alias) {
                            return Err(format!("key alias '{key_alias}' is already defined\n"));
                        }
                        res.insert(key_alias.to_owned(), k.clone());
                    }
                    k = alias.to_owned();
                    if res.contains_key(&k) {
                        return Err(format!("key '{k}' is already defined (via alias)\n"));
                    }
                    schema = format.get(&k);
                }
                let Some(schema) = schema else {
                    return Err(format!(
                        "invalid key in comma-separated list property: {k}\n"
                    ));
                };
                let v = if schema["type"] == "boolean" {
                    parse_boolean(v).unwrap_or(v)
                } else {
                    v
                };
                res.insert(k, v.to_owned());
            }
            None => {
                if let Some(k) = default_key {
                    return Err(format!(
                        "duplicate key in comma-separated list property: {k}\n"
                    ));
                }
                let Some((k, _)) = format.iter().find(|(_, s)| flag(s, "default_key")) else {
                    return Err(
                        "value without key, but schema does not define a default key\n".into(),
                    );
                };
                if res.contains_key(k) {
                    return Err(format!(
                        "duplicate key in comma-separated list property: {k}\n"
                    ));
                }
                res.insert(k.clone(), part.to_owned());
                default_key = Some(k.clone());
            }
            Some(_) => return Err("missing key in comma-separated list property\n".into()),
        }
    }
    let mut errors = Errors::new();
    check_object(path, format, &res, false, &mut errors);
    if errors.is_empty() {
        return Ok(());
    }
    let mut msg = "format error\n".to_owned();
    for (k, v) in errors {
        msg.push_str(&format!("{k}: {v}\n"));
    }
    Err(msg)
}

fn parse_boolean(v: &str) -> Option<&'static str> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some("1"),
        "0" | "false" | "no" | "off" => Some("0"),
        _ => None,
    }
}

/// The named formats the simulator knows (see the module comment).
fn check_named_format(name: &str, value: &str) -> Result<(), String> {
    fn re(p: &str) -> Regex {
        Regex::new(p).expect("static regex")
    }
    let ok = |p: &str| re(p).is_match(value);
    match name {
        "pve-node" if !ok(r"^([a-zA-Z0-9]([a-zA-Z0-9\-]*[a-zA-Z0-9])?)$") => {
            Err("value does not look like a valid node name\n".into())
        }
        "pve-vmid" if !ok(r"^[1-9][0-9]{2,8}$") => {
            Err("value does not look like a valid VM ID\n".into())
        }
        "pve-storage-id" if value.len() < 2 => Err(format!(
            "storage ID '{value}' cannot be shorter than 2 characters\n"
        )),
        "pve-storage-id" if !ok(r"(?i)^[a-z][a-z0-9\-_.]*[a-z0-9]$") => Err(format!(
            "storage ID '{value}' contains illegal characters\n"
        )),
        "pve-configid" if !ok(r"(?i)^[a-z][a-z0-9_-]+$") => {
            Err(format!("invalid configuration ID '{value}'\n"))
        }
        "pve-configid-list" => {
            for id in value.split([',', ';', ' ', '\0']).filter(|s| !s.is_empty()) {
                if !re(r"(?i)^[a-z][a-z0-9_-]+$").is_match(id) {
                    return Err(format!("invalid configuration ID '{id}'\n"));
                }
            }
            Ok(())
        }
        "pve-bridge-id" if !ok(r"^[-_.\w\d]+$") => Err(format!("invalid bridge ID '{value}'\n")),
        "mac-addr" if !ok(r"(?i)^[a-f0-9][02468ace](?::[a-f0-9]{2}){5}$") => {
            Err("value does not look like a valid unicast MAC address\n".into())
        }
        "dns-name"
            if !ok(
                r"^(?:(?:[a-zA-Z0-9](?:[a-zA-Z0-9\-]*[a-zA-Z0-9])?)\.)*(?:[A-Za-z0-9](?:[A-Za-z0-9\-]*[A-Za-z0-9])?)$",
            ) =>
        {
            Err("value does not look like a valid DNS name\n".into())
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn create(extra: &[(&str, &str)]) -> Result<(), Errors> {
        let route = Schema::get()
            .route("POST", "/nodes/pve/qemu")
            .unwrap()
            .unwrap();
        let mut p = params(
            route
                .params
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect::<Vec<_>>()
                .as_slice(),
        );
        p.extend(params(extra));
        check(route.method, &p)
    }

    const GOOD: &[(&str, &str)] = &[
        ("vmid", "301"),
        ("name", "cp-01"),
        ("machine", "q35"),
        ("bios", "ovmf"),
        ("cpu", "host"),
        ("cores", "2"),
        ("memory", "4096"),
        ("balloon", "0"),
        ("onboot", "1"),
        ("scsihw", "virtio-scsi-pci"),
        (
            "scsi0",
            "local-lvm:0,import-from=local:import/a.raw,discard=on,ssd=1",
        ),
        ("efidisk0", "local-lvm:1,efitype=4m,pre-enrolled-keys=0"),
        ("net0", "virtio=BC:24:11:00:00:11,bridge=vmbr0"),
        ("serial0", "socket"),
        ("agent", "enabled=1"),
        ("boot", "order=scsi0"),
    ];

    #[test]
    fn a_talos_vm_create_passes() {
        assert_eq!(create(GOOD), Ok(()));
    }

    fn error_of(extra: &[(&str, &str)], key: &str) -> String {
        let mut p: Vec<_> = GOOD
            .iter()
            .filter(|(k, _)| !extra.iter().any(|(e, _)| e == k))
            .copied()
            .collect();
        p.extend(extra.iter().filter(|(_, v)| !v.is_empty()));
        let errors = create(&p).unwrap_err();
        errors
            .get(key)
            .cloned()
            .unwrap_or_else(|| panic!("no error for {key}: {errors:?}"))
    }

    #[test]
    fn bad_create_params_are_refused_by_name() {
        assert_eq!(
            error_of(&[("colour", "red")], "colour"),
            "property is not defined in schema and the schema does not allow additional properties"
        );
        assert_eq!(
            error_of(&[("cores", "two")], "cores"),
            "type check ('integer') failed - got 'two'"
        );
        assert_eq!(
            error_of(&[("onboot", "true")], "onboot"),
            "type check ('boolean') failed - got 'true'"
        );
        assert_eq!(
            error_of(&[("vmid", "")], "vmid"),
            "property is missing and it is not optional"
        );
        assert_eq!(
            error_of(&[("vmid", "99")], "vmid"),
            "invalid format - value does not look like a valid VM ID\n"
        );
        assert_eq!(
            error_of(&[("cores", "0")], "cores"),
            "value must have a minimum value of 1"
        );
        assert!(
            error_of(&[("scsihw", "virtio-scsi")], "scsihw")
                .starts_with("value 'virtio-scsi' does not have a value in the enumeration 'lsi, ")
        );
        assert_eq!(
            error_of(&[("serial0", "tcp")], "serial0"),
            "value does not match the regex pattern"
        );
        assert_eq!(
            error_of(&[("scsi31", "local-lvm:1")], "scsi31"),
            "property is not defined in schema and the schema does not allow additional properties"
        );
    }

    #[test]
    fn bad_property_strings_are_refused_by_key() {
        assert_eq!(
            error_of(
                &[("net0", "virtio=BC:24:11:00:00:11,bridge=vmbr0,colour=red")],
                "net0"
            ),
            "invalid format - invalid key in comma-separated list property: colour\n"
        );
        assert_eq!(
            error_of(&[("efidisk0", "local-lvm:1,efitype=8m")], "efidisk0"),
            "invalid format - format error\nefidisk0.efitype: value '8m' does not have a value in the enumeration '2m, 4m'\n"
        );
        assert_eq!(
            error_of(&[("scsi0", "local-lvm:0,ssd=maybe")], "scsi0"),
            "invalid format - format error\nscsi0.ssd: type check ('boolean') failed - got 'maybe'\n"
        );
        assert_eq!(
            error_of(&[("net0", "bridge=vmbr0")], "net0"),
            "invalid format - format error\nnet0.model: property is missing and it is not optional\n"
        );
        // Booleans inside property strings take every spelling parse_boolean knows.
        assert_eq!(
            create(&[GOOD, &[("agent", "enabled=yes")]].concat()),
            Ok(())
        );
    }

    #[test]
    fn unknown_paths_and_methods_are_told_apart() {
        let s = Schema::get();
        assert!(s.route("GET", "/nodes/pve/nothing").is_none());
        assert!(s.route("PATCH", "/nodes/pve/qemu").unwrap().is_err());
        let r = s
            .route("GET", "/nodes/pve/tasks/UPID%3Apve%3A1/status")
            .unwrap()
            .unwrap();
        assert_eq!(r.path, "/nodes/{node}/tasks/{upid}/status");
        assert_eq!(r.params[1], ("upid".into(), "UPID:pve:1".into()));
    }
}
