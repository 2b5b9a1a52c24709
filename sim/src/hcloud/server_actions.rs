//! Server actions (docs.hetzner.cloud "Server Actions"): power, reset,
//! rebuild, rescue, `create_image` and `attach_to_network`.

use super::actions::*;
use super::images::*;
use super::power::*;
use super::servers::*;
use super::ssh_keys::*;
use super::state::*;
use serde_json::{Value, json};
use std::net::Ipv4Addr;
use std::sync::Arc;

pub(crate) fn server_action(sim: &Arc<Sim>, id: u64, endpoint: &str, body: Value) -> Answer {
    let mut w = sim.world.lock().unwrap();
    let s = w.servers.get(&id).ok_or_else(|| not_found("server"))?;
    if s.busy.is_some() {
        return Err(err(423, "locked", "server is locked: an action is running"));
    }
    let status = s.status;
    match endpoint {
        "enable_rescue" => {
            let mut keys = Vec::new();
            for k in body["ssh_keys"].as_array().into_iter().flatten() {
                let key = k.as_u64().and_then(|k| w.ssh_keys.get(&k));
                keys.push(
                    key.ok_or_else(|| field_error("ssh_keys", "SSH key not found"))?
                        .public_key
                        .clone(),
                );
            }
            let a = start_action(
                sim,
                &mut w,
                id,
                endpoint,
                "enable_rescue",
                None,
                move |_, w, ok| {
                    if let Some(s) = w.servers.get_mut(&id)
                        && ok
                    {
                        s.rescue_enabled = true;
                        s.rescue_keys = keys;
                    }
                },
            );
            Ok((201, json!({"root_password": null, "action": a})))
        }
        "poweron" => {
            if status == "running" {
                return Ok((
                    201,
                    json!({"action": finished_action(&mut w, id, "start_server")}),
                ));
            }
            w.servers.get_mut(&id).unwrap().status = "starting";
            let a = start_action(
                sim,
                &mut w,
                id,
                endpoint,
                "start_server",
                None,
                move |sim, w, ok| {
                    if let Some(s) = w.servers.get_mut(&id) {
                        if ok {
                            power_on(sim, s);
                        } else {
                            s.status = "off";
                        }
                    }
                },
            );
            Ok((201, json!({ "action": a })))
        }
        "poweroff" | "shutdown" => {
            let command = if endpoint == "poweroff" {
                "stop_server"
            } else {
                "shutdown_server"
            };
            if status == "off" {
                return Ok((201, json!({"action": finished_action(&mut w, id, command)})));
            }
            let s = w.servers.get_mut(&id).unwrap();
            s.status = "stopping";
            power_off(sim, s);
            let a = start_action(sim, &mut w, id, endpoint, command, None, move |_, w, _| {
                if let Some(s) = w.servers.get_mut(&id) {
                    s.status = "off";
                }
            });
            Ok((201, json!({ "action": a })))
        }
        "create_image" => create_image(sim, &mut w, id, body),
        "attach_to_network" => attach_to_network(sim, &mut w, id, body),
        _ => Err(not_found("action endpoint")),
    }
}

pub(crate) fn create_image(sim: &Arc<Sim>, w: &mut World, server: u64, body: Value) -> Answer {
    let labels = body_labels(&body)?;
    if body["type"].as_str() == Some("backup") {
        return Err(err(
            422,
            "unsupported_error",
            "backups are not enabled for this server",
        ));
    }
    let s = &w.servers[&server];
    let (disk_size, arch, from_name) = (s.server_type.disk, s.server_type.arch, s.name.clone());
    let image_id = w.id();
    let description = body["description"]
        .as_str()
        .map(String::from)
        .unwrap_or_else(|| format!("{from_name}-{}", now()));
    let tmp = image_file(sim, image_id).with_extension("part");
    // The snapshot holds the disk as it is now.
    std::fs::copy(sim.disk(server), &tmp).map_err(|e| err(500, "server_error", e.to_string()))?;
    w.images.insert(
        image_id,
        Image {
            id: image_id,
            snapshot: true,
            name: None,
            description,
            status: "creating",
            labels,
            created: now(),
            image_size: None,
            disk_size,
            created_from: Some((server, from_name)),
            arch,
        },
    );
    bump(&sim.stats.images_created);
    let sim2 = sim.clone();
    let action = start_action(
        sim,
        w,
        server,
        "create_image",
        "create_image",
        sim.args.slow_create_image,
        move |_, w, ok| {
            let done = image_file(&sim2, image_id);
            if ok && std::fs::rename(&tmp, &done).is_ok() {
                let size = std::fs::metadata(&done).map(|m| m.len()).unwrap_or(0);
                if let Some(i) = w.images.get_mut(&image_id) {
                    i.status = "available";
                    i.image_size = Some(size as f64 / 1e9);
                }
            } else {
                let _ = std::fs::remove_file(&tmp);
                w.images.remove(&image_id);
            }
        },
    );
    let action = with_resource(w, action, (image_id, "image"));
    let image = image_json(&w.images[&image_id]);
    Ok((201, json!({"image": image, "action": action})))
}

/// `attach_to_network {network, ip?}`: the address is reserved now and
/// shown in `private_net` once the action succeeds.
pub(crate) fn attach_to_network(sim: &Arc<Sim>, w: &mut World, id: u64, body: Value) -> Answer {
    let network_id = body["network"].as_u64().unwrap_or(0);
    let zone = zone_of(w.servers[&id].location);
    let network = w
        .networks
        .get(&network_id)
        .ok_or_else(|| not_found("network"))?;
    if network.servers.contains_key(&id) {
        return Err(err(
            422,
            "server_already_attached",
            "server is already attached to the network",
        ));
    }
    let want = match body["ip"].as_str() {
        Some(ip) => Some(
            ip.parse::<Ipv4Addr>()
                .map_err(|_| field_error("ip", "is not a valid IPv4 address"))?,
        ),
        None => None,
    };
    let ip = network
        .assign(zone, want)
        .map_err(|(code, msg)| err(422, code, msg))?;
    w.networks
        .get_mut(&network_id)
        .expect("found above")
        .servers
        .insert(id, ip);
    let a = start_action(
        sim,
        w,
        id,
        "attach_to_network",
        "attach_to_network",
        None,
        move |_, w, ok| {
            if ok {
                if let Some(s) = w.servers.get_mut(&id) {
                    s.private_net.push((network_id, ip));
                }
            } else if let Some(n) = w.networks.get_mut(&network_id) {
                n.servers.remove(&id);
            }
        },
    );
    let a = with_resource(w, a, (network_id, "network"));
    Ok((201, json!({ "action": a })))
}
