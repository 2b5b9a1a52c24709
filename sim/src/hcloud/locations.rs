//! `GET /locations` and `GET /server_types` (docs.hetzner.cloud "Locations",
//! "Server Types"): the catalogue as JSON, filtered as the API filters.

use super::catalog::*;
use super::query::*;
use serde_json::{Value, json};

pub(crate) fn location_json(name: &str) -> Value {
    let (i, (name, city, country, zone)) = LOCATIONS
        .iter()
        .enumerate()
        .find(|(_, l)| l.0 == name)
        .expect("known location");
    json!({"id": i + 1, "name": name, "description": format!("{city} DC Park 1"),
        "country": country, "city": city, "network_zone": zone,
        "latitude": 0.0, "longitude": 0.0})
}

pub(crate) fn locations(q: &Query) -> Vec<Value> {
    LOCATIONS
        .iter()
        .filter(|l| q.one("name").is_none_or(|n| n == l.0))
        .map(|l| location_json(l.0))
        .collect()
}

pub(crate) fn deprecation_json(t: &ServerType) -> Value {
    match t.deprecation {
        Some((announced, after)) => json!({"announced": announced, "unavailable_after": after}),
        None => Value::Null,
    }
}

pub(crate) fn server_type_json(t: &ServerType) -> Value {
    let locations: Vec<Value> = LOCATIONS
        .iter()
        .enumerate()
        .map(|(i, l)| {
            json!({"id": i + 1, "name": l.0, "available": t.offered.contains(&l.0),
                "recommended": t.offered.contains(&l.0), "deprecation": deprecation_json(t)})
        })
        .collect();
    json!({
        "id": t.id, "name": t.name, "description": t.name.to_uppercase(),
        "cores": t.cores, "memory": t.memory, "disk": t.disk,
        "deprecated": t.deprecation.is_some(), "deprecation": deprecation_json(t),
        "prices": [], "storage_type": "local", "cpu_type": "shared",
        "architecture": t.arch, "category": if t.arch == "arm" { "cost_optimized" } else { "regular_purpose" },
        "locations": locations,
    })
}

pub(crate) fn server_types(q: &Query) -> Vec<Value> {
    SERVER_TYPES
        .iter()
        .filter(|t| q.one("name").is_none_or(|n| n == t.name))
        .map(server_type_json)
        .collect()
}
