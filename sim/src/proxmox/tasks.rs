//! Worker tasks (pve-common `PVE/RESTEnvironment.pm` `fork_worker`): UPIDs,
//! their status and log, and the `--fail-task` misbehaviour.

use super::state::*;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

impl Pve {
    /// `fork_worker`: a UPID now, the work after `--task-delay-ms`; a task
    /// of the `--fail-task` type ends with an error and does nothing.
    pub(crate) fn spawn_task(
        self: &Arc<Self>,
        kind: &str,
        id: &str,
        work: impl FnOnce(&Pve, &mut Vec<String>) -> Result<(), String> + Send + 'static,
    ) -> Value {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let (pid, pstart, start) = (std::process::id() * 16 + seq, 1000 + seq, now());
        let upid = format!(
            "UPID:{}:{pid:08X}:{pstart:08X}:{start:08X}:{kind}:{id}:{}:",
            self.args.node,
            self.token_user()
        );
        self.tasks.lock().unwrap().insert(
            upid.clone(),
            Task {
                upid: upid.clone(),
                kind: kind.to_owned(),
                id: id.to_owned(),
                pid,
                pstart,
                start,
                log: Vec::new(),
                exit: None,
            },
        );
        let fail = self.args.fail_task.as_deref() == Some(kind);
        let pve = self.clone();
        let key = upid.clone();
        let kind = kind.to_owned();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(pve.args.task_delay_ms)).await;
            let worker = pve.clone();
            let done = tokio::task::spawn_blocking(move || {
                let mut log = Vec::new();
                let res = if fail {
                    Err(format!("{kind} failed (simulated by --fail-task)"))
                } else {
                    work(&worker, &mut log)
                };
                (log, res)
            })
            .await;
            let (mut log, res) =
                done.unwrap_or_else(|e| (Vec::new(), Err(format!("worker panicked: {e}"))));
            let exit = match res {
                Ok(()) => {
                    log.push("TASK OK".into());
                    "OK".to_owned()
                }
                Err(e) => {
                    log.push(format!("TASK ERROR: {e}"));
                    e
                }
            };
            if let Some(t) = pve.tasks.lock().unwrap().get_mut(&key) {
                t.log = log;
                t.exit = Some(exit);
            }
        });
        json!(upid)
    }

    pub(crate) fn task_status(&self, upid: &str) -> ApiResult {
        let tasks = self.tasks.lock().unwrap();
        let t = tasks
            .get(upid)
            .ok_or_else(|| die(format!("no such task: '{upid}'")))?;
        let mut v = json!({
            "upid": t.upid, "node": self.args.node, "pid": t.pid, "pstart": t.pstart,
            "starttime": t.start, "type": t.kind, "id": t.id, "user": self.token_user(),
            "status": if t.exit.is_some() { "stopped" } else { "running" },
        });
        if let Some(e) = &t.exit {
            v["exitstatus"] = json!(e);
        }
        Ok(v)
    }

    pub(crate) fn task_log(&self, p: &BTreeMap<String, String>) -> ApiResult {
        let tasks = self.tasks.lock().unwrap();
        let t = tasks
            .get(&p["upid"])
            .ok_or_else(|| die(format!("no such task: '{}'", p["upid"])))?;
        let start: usize = p.get("start").and_then(|v| v.parse().ok()).unwrap_or(0);
        let limit: usize = p.get("limit").and_then(|v| v.parse().ok()).unwrap_or(50);
        let lines: Vec<Value> = t
            .log
            .iter()
            .enumerate()
            .skip(start)
            .take(limit)
            .map(|(i, l)| json!({"n": i + 1, "t": l}))
            .collect();
        Ok(json!(lines))
    }
}
