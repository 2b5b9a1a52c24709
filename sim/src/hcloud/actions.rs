//! Actions (docs.hetzner.cloud "Actions"): their JSON, the resources they
//! name, and how one runs from `running` to `success` or `error`.

use super::state::*;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(crate) fn action_json(a: &Action) -> Value {
    let (status, progress) = match (a.finished, a.error) {
        (Some(_), false) => ("success", 100),
        (Some(_), true) => ("error", 100),
        (None, _) => {
            let done = a.started_at.elapsed().as_secs_f64() / a.duration.as_secs_f64().max(1e-3);
            ("running", ((done * 100.0) as u64).min(99))
        }
    };
    let error = a.error.then(|| {
        json!({"code": "action_failed",
            "message": format!("{} failed (simulated by --action-error)", a.command)})
    });
    json!({
        "id": a.id, "command": a.command, "status": status, "progress": progress,
        "started": iso(a.started), "finished": a.finished.map(iso),
        "resources": a.resources.iter().map(|(id, t)| json!({"id": id, "type": t})).collect::<Vec<_>>(),
        "error": error,
    })
}

/// `action` (as answered) with one more resource it acts on, besides its server.
pub(crate) fn with_resource(w: &mut World, action: Value, resource: (u64, &'static str)) -> Value {
    match w.actions.get_mut(&action["id"].as_u64().unwrap_or(0)) {
        Some(a) => {
            a.resources.push(resource);
            action_json(a)
        }
        None => action,
    }
}

/// Starts an action on server `server` (locking it) that ends after its
/// duration; `done` then runs under the world lock with whether it
/// succeeded. Returns the action as first shown.
pub(crate) fn start_action(
    sim: &Arc<Sim>,
    w: &mut World,
    server: u64,
    endpoint: &str,
    command: &str,
    duration: Option<f64>,
    done: impl FnOnce(&Arc<Sim>, &mut World, bool) + Send + 'static,
) -> Value {
    let id = w.id();
    let duration = Duration::from_secs_f64(duration.unwrap_or(sim.args.action_seconds).max(0.0));
    let error = sim.fails(endpoint, command);
    let action = Action {
        id,
        command: command.into(),
        started: now(),
        started_at: Instant::now(),
        duration,
        finished: None,
        error: false,
        resources: vec![(server, "server")],
    };
    let v = action_json(&action);
    w.actions.insert(id, action);
    if let Some(s) = w.servers.get_mut(&server) {
        s.busy = Some(id);
    }
    let sim = sim.clone();
    tokio::spawn(async move {
        tokio::time::sleep(duration).await;
        let mut w = sim.world.lock().unwrap();
        if let Some(a) = w.actions.get_mut(&id) {
            a.finished = Some(now());
            a.error = error;
        }
        if let Some(s) = w.servers.get_mut(&server)
            && s.busy == Some(id)
        {
            s.busy = None;
        }
        done(&sim, &mut w, !error);
    });
    v
}

/// An action that has nothing to do (e.g. poweron of a running server).
pub(crate) fn finished_action(w: &mut World, server: u64, command: &str) -> Value {
    let id = w.id();
    let a = Action {
        id,
        command: command.into(),
        started: now(),
        started_at: Instant::now(),
        duration: Duration::ZERO,
        finished: Some(now()),
        error: false,
        resources: vec![(server, "server")],
    };
    let v = action_json(&a);
    w.actions.insert(id, a);
    v
}
