//! Images (docs.hetzner.cloud "Images"): listing, reading, deleting
//! snapshots, and where their bytes are kept.

use super::query::*;
use super::state::*;
use serde_json::{Value, json};
use std::path::PathBuf;

pub(crate) fn image_json(i: &Image) -> Value {
    json!({
        "id": i.id,
        "type": if i.snapshot { "snapshot" } else { "system" },
        "status": i.status,
        "name": i.name,
        "description": i.description,
        "image_size": i.image_size,
        "disk_size": i.disk_size,
        "created": iso(i.created),
        "created_from": i.created_from.as_ref().map(|(id, name)| json!({"id": id, "name": name})),
        "bound_to": null,
        "os_flavor": if i.snapshot { "unknown" } else { "debian" },
        "os_version": i.name.as_ref().map(|n| n.rsplit('-').next().unwrap_or("").to_owned()),
        "rapid_deploy": !i.snapshot,
        "protection": {"delete": false},
        "deprecated": null,
        "deleted": null,
        "labels": i.labels,
        "architecture": i.arch,
    })
}

pub(crate) fn list_images(sim: &Sim, q: &Query) -> Answer {
    let (types, statuses, archs) = (q.all("type"), q.all("status"), q.all("architecture"));
    let w = sim.world.lock().unwrap();
    list_matching(
        q,
        "images",
        &["id", "name", "created", "description"],
        w.images.values(),
        |i| (i.name.as_deref(), &i.labels),
        |i| {
            let kind = if i.snapshot { "snapshot" } else { "system" };
            (types.is_empty() || types.contains(&kind))
                && (statuses.is_empty() || statuses.contains(&i.status))
                && (archs.is_empty() || archs.contains(&i.arch))
        },
        image_json,
    )
}

pub(crate) fn get_image(sim: &Sim, id: u64) -> Answer {
    let w = sim.world.lock().unwrap();
    let i = w.images.get(&id).ok_or_else(|| not_found("image"))?;
    Ok((200, json!({"image": image_json(i)})))
}

pub(crate) fn delete_image(sim: &Sim, id: u64) -> Answer {
    let mut w = sim.world.lock().unwrap();
    match w.images.get(&id) {
        None => Err(not_found("image")),
        Some(i) if !i.snapshot => Err(err(
            422,
            "unsupported_error",
            "system images cannot be deleted",
        )),
        Some(_) => {
            w.images.remove(&id);
            let _ = std::fs::remove_file(image_file(sim, id));
            Ok((204, Value::Null))
        }
    }
}

pub(crate) fn image_file(sim: &Sim, id: u64) -> PathBuf {
    sim.args.state_dir.join("images").join(format!("{id}.raw"))
}
