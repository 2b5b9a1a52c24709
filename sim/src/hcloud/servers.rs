//! Servers (docs.hetzner.cloud "Servers"): their JSON, listing, creating with
//! the API's validation, and deleting.

use super::actions::*;
use super::catalog::*;
use super::images::*;
use super::locations::*;
use super::networks::network_json;
use super::power::*;
use super::query::*;
use super::ssh_keys::*;
use super::state::*;
use serde_json::{Value, json};
use std::net::Ipv4Addr;
use std::sync::Arc;

pub(crate) fn server_json(s: &Server, w: &World) -> Value {
    let image = w.images.get(&s.image).map(image_json);
    let mut v = json!({
        "id": s.id,
        "name": s.name,
        "status": s.status,
        "created": iso(s.created),
        "public_net": {
            "ipv4": {"id": s.id, "ip": s.ip.to_string(), "blocked": false,
                "dns_ptr": format!("static.{}.clients.your-server.de", s.ip)},
            "ipv6": null, "floating_ips": [], "firewalls": [],
        },
        "private_net": s.private_net.iter().map(|(network, ip)| json!({
            "network": network, "ip": ip.to_string(), "alias_ips": [],
            "mac_address": format!("86:00:00:{:02x}:{:02x}:{:02x}", (s.id >> 16) as u8, (s.id >> 8) as u8, s.id as u8),
        })).collect::<Vec<_>>(),
        "server_type": server_type_json(s.server_type),
        "location": location_json(s.location),
        "image": image,
        "iso": null,
        "rescue_enabled": s.rescue_enabled,
        "locked": s.busy.is_some(),
        "backup_window": null,
        "outgoing_traffic": 0, "ingoing_traffic": 0,
        "included_traffic": 21990232555520u64,
        "protection": {"delete": false, "rebuild": false},
        "labels": s.labels,
        "volumes": [], "load_balancers": [],
        "primary_disk_size": s.server_type.disk,
        "placement_group": null,
    });
    if let Some(p) = s.ssh_port.filter(|p| *p != 22) {
        v["sim_ssh_port"] = json!(p);
    }
    v
}

pub(crate) fn list_networks(sim: &Sim, q: &Query) -> Answer {
    let w = sim.world.lock().unwrap();
    list_matching(
        q,
        "networks",
        &["id", "name", "created"],
        w.networks.values(),
        |n| (Some(&n.name), &n.labels),
        |_| true,
        |n| network_json(n, iso),
    )
}

/// The network zone of a location.
pub(crate) fn zone_of(location: &str) -> &'static str {
    LOCATIONS
        .iter()
        .find(|l| l.0 == location)
        .map_or("eu-central", |l| l.3)
}

pub(crate) fn list_servers(sim: &Sim, q: &Query) -> Answer {
    let statuses = q.all("status");
    let w = sim.world.lock().unwrap();
    list_matching(
        q,
        "servers",
        &["id", "name", "created"],
        w.servers.values(),
        |s| (Some(&s.name), &s.labels),
        |s| statuses.is_empty() || statuses.contains(&s.status),
        |s| server_json(s, &w),
    )
}

/// An "ID (integer) or name (string)" field's two forms.
pub(crate) enum Ref<'a> {
    Id(u64),
    Name(&'a str),
}

pub(crate) fn id_or_name(v: &Value) -> Option<Ref<'_>> {
    match v {
        Value::Number(n) => n.as_u64().map(Ref::Id),
        Value::String(s) => Some(match s.parse() {
            Ok(id) => Ref::Id(id),
            Err(_) => Ref::Name(s),
        }),
        _ => None,
    }
}

pub(crate) fn create_server(sim: &Arc<Sim>, body: Value) -> Answer {
    let name = body["name"].as_str().unwrap_or_default().to_owned();
    let labels = body_labels(&body)?;
    let valid_name = !name.is_empty()
        && name.len() <= 63
        && name.split('.').all(|l| {
            !l.is_empty()
                && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        });
    if !valid_name {
        return Err(field_error("name", "is not a valid hostname"));
    }
    let server_type = match id_or_name(&body["server_type"]) {
        Some(Ref::Id(id)) => SERVER_TYPES.iter().find(|t| t.id == id),
        Some(Ref::Name(n)) => SERVER_TYPES.iter().find(|t| t.name == n),
        None => None,
    }
    .ok_or_else(|| field_error("server_type", "server type not found"))?;
    let location = match id_or_name(&body["location"]) {
        Some(Ref::Id(id)) => LOCATIONS.get((id as usize).wrapping_sub(1)).map(|l| l.0),
        Some(Ref::Name(n)) => LOCATIONS.iter().find(|l| l.0 == n).map(|l| l.0),
        None if body.get("location").is_none() => Some("fsn1"),
        None => None,
    }
    .ok_or_else(|| field_error("location", "location not found"))?;
    if let Some(data) = body["user_data"].as_str()
        && data.len() > 32 * 1024
    {
        return Err(field_error("user_data", "must be at most 32768 bytes"));
    }
    if server_type.deprecation.is_some() {
        return Err(err(
            422,
            "invalid_server_type",
            format!("server type {} is deprecated", server_type.name),
        ));
    }
    if !server_type.offered.contains(&location) || sim.unavailable(server_type.name, location) {
        return Err(err(
            412,
            "resource_unavailable",
            format!(
                "server type {} is unavailable in {location}",
                server_type.name
            ),
        ));
    }
    let start = body["start_after_create"].as_bool().unwrap_or(true);
    let mut w = sim.world.lock().unwrap();
    let image = {
        let found: Vec<&Image> = w
            .images
            .values()
            .filter(|i| match id_or_name(&body["image"]) {
                Some(Ref::Id(id)) => i.id == id,
                Some(Ref::Name(n)) => i.name.as_deref() == Some(n),
                None => false,
            })
            .filter(|i| i.status == "available")
            .collect();
        if found.is_empty() {
            return Err(field_error("image", "image not found"));
        }
        let image = found
            .iter()
            .find(|i| i.arch == server_type.arch)
            .ok_or_else(|| {
                err(
                    422,
                    "placement_error",
                    format!("image does not support architecture {}", server_type.arch),
                )
            })?;
        // A snapshot holds the whole disk it was taken of: the API makes
        // servers from it only on types with at least that disk
        // (`disk_size`, GB).
        if server_type.disk < image.disk_size {
            return Err(err(
                422,
                "invalid_server_type",
                format!(
                    "server type {} has a {} GB disk, too small for image {} ({} GB)",
                    server_type.name, server_type.disk, image.id, image.disk_size
                ),
            ));
        }
        image.id
    };
    let mut keys = Vec::new();
    for k in body["ssh_keys"].as_array().into_iter().flatten() {
        let key = w.ssh_keys.values().find(|s| match id_or_name(k) {
            Some(Ref::Id(id)) => s.id == id,
            Some(Ref::Name(n)) => s.name == n,
            None => false,
        });
        keys.push(
            key.ok_or_else(|| field_error("ssh_keys", "SSH key not found"))?
                .id,
        );
    }
    if w.servers.values().any(|s| s.name == name) {
        return Err(err(409, "uniqueness_error", "server name is already used"));
    }
    let mut networks = Vec::new();
    for n in body["networks"].as_array().into_iter().flatten() {
        let network = n
            .as_u64()
            .and_then(|id| w.networks.get(&id))
            .ok_or_else(|| field_error("networks", "network not found"))?;
        let ip = network
            .assign(zone_of(location), None)
            .map_err(|(code, msg)| err(422, code, msg))?;
        networks.push((network.id, ip));
    }
    let from_snapshot = w.images.get(&image).is_some_and(|i| i.snapshot);
    let id = w.id();
    for (network, ip) in &networks {
        if let Some(n) = w.networks.get_mut(network) {
            n.servers.insert(id, *ip);
        }
    }
    std::fs::create_dir_all(sim.server_dir(id))
        .map_err(|e| err(500, "server_error", e.to_string()))?;
    let marker = format!("system image {image} of server {id}\n").repeat(4096);
    std::fs::write(sim.disk(id), marker).map_err(|e| err(500, "server_error", e.to_string()))?;
    let x = 2 + w.addresses % 250;
    w.addresses += 1;
    let server = Server {
        id,
        name,
        status: "initializing",
        created: now(),
        server_type,
        location,
        image,
        labels,
        rescue_enabled: false,
        rescue_keys: Vec::new(),
        ip: Ipv4Addr::new(127, 4, sim.address_base as u8, x as u8),
        ssh_port: None,
        busy: None,
        boot: 0,
        sshd: None,
        user_data: body["user_data"].as_str().map(str::to_owned),
        from_snapshot,
        node_booted: false,
        private_net: networks,
    };
    w.servers.insert(id, server);
    bump(&sim.stats.servers_created);
    if from_snapshot {
        bump(&sim.stats.servers_from_snapshots);
    }
    let action = start_action(
        sim,
        &mut w,
        id,
        "create_server",
        "create_server",
        None,
        move |_, w, _| {
            if let Some(s) = w.servers.get_mut(&id) {
                s.status = if start { "starting" } else { "off" };
            }
        },
    );
    // start_after_create: a start_server action that ends after the
    // creation (and holds the lock until then).
    let next: Vec<Value> = if start {
        let twice = 2.0 * sim.args.action_seconds;
        vec![start_action(
            sim,
            &mut w,
            id,
            "poweron",
            "start_server",
            Some(twice),
            move |sim, w, ok| {
                if let Some(s) = w.servers.get_mut(&id) {
                    if ok {
                        power_on(sim, s);
                    } else {
                        s.status = "off";
                    }
                }
            },
        )]
    } else {
        Vec::new()
    };
    let server = server_json(&w.servers[&id], &w);
    Ok((
        201,
        json!({"server": server, "action": action, "root_password": null, "next_actions": next}),
    ))
}

pub(crate) fn delete_server(sim: &Arc<Sim>, id: u64) -> Answer {
    let mut w = sim.world.lock().unwrap();
    let s = w.servers.get(&id).ok_or_else(|| not_found("server"))?;
    if s.busy.is_some() {
        return Err(err(423, "locked", "server is locked: an action is running"));
    }
    if let Some(mut s) = w.servers.remove(&id) {
        power_off(sim, &mut s); // kills its sshd, halts its node
    }
    for n in w.networks.values_mut() {
        n.servers.remove(&id);
    }
    let _ = std::fs::remove_dir_all(sim.server_dir(id));
    let a = finished_action(&mut w, id, "delete_server");
    Ok((200, json!({ "action": a })))
}
