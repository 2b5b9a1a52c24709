//! Deleting what runs made: a run's own temporary resources on every path,
//! and what killed runs left (`imgbuild cleanup`).

use std::time::{Duration, SystemTime};

use serde_json::Value;

use super::api::Api;
use super::error::HcloudError;
use super::types::{
    Deleted, Event, Leftover, MANAGED_BY, OWNER_LABEL, Observer, RUN_LABEL, STARTED_LABEL,
    SnapshotOptions,
};
use crate::publish::Cancel;

/// Deletes every server and SSH key labelled with run `run` (not only the
/// ones this process knows: a lost reply can leave another). Each deletion
/// is tried a few times; what stays is returned.
pub(super) fn delete_run(
    api: &Api,
    run: &str,
    opts: &SnapshotOptions,
    observer: &dyn Observer,
) -> Vec<Leftover> {
    let sel = format!("{}={},{RUN_LABEL}={run}", MANAGED_BY.0, MANAGED_BY.1);
    delete_selected(api, &sel, None, opts, observer, &["server", "ssh_key"])
        .into_iter()
        .filter_map(|r| r.err())
        .collect()
}

/// What a run makes, in the order it is deleted: kind, API path, list key.
const KINDS: [(&str, &str, &str); 2] = [
    ("server", "/servers", "servers"),
    ("ssh_key", "/ssh_keys", "ssh_keys"),
];

/// Deletes the servers, then the SSH keys (those of `kinds`), matching
/// `selector` (and created before `before`, if given).
pub(super) fn delete_selected(
    api: &Api,
    selector: &str,
    before: Option<SystemTime>,
    opts: &SnapshotOptions,
    observer: &dyn Observer,
    kinds: &[&str],
) -> Vec<Result<Deleted, Leftover>> {
    let mut out = Vec::new();
    let never = Cancel::never();
    for (kind, path, key) in KINDS {
        if !kinds.contains(&kind) {
            continue;
        }
        let found = match listed(api, kind, path, key, selector, before) {
            Ok(found) => found,
            Err(l) => {
                out.push(Err(l));
                continue;
            }
        };
        for Deleted { id, name, .. } in found {
            let mut last = None;
            for attempt in 0..4u32 {
                match api.delete(&format!("{path}/{id}")) {
                    Ok(reply) => {
                        if kind == "server"
                            && let Some(a) = reply.get("action")
                        {
                            // The key may go only once the server is gone.
                            let _ = api.wait_action(
                                a,
                                "deleting server",
                                opts.poll,
                                opts.action_timeout,
                                &never,
                            );
                        }
                        last = None;
                        break;
                    }
                    Err(HcloudError::Api { status: 404, .. }) => {
                        last = None;
                        break;
                    }
                    Err(e) => {
                        last = Some(e.to_string());
                        let _ = never.sleep(opts.retry.delay(attempt + 1, None));
                    }
                }
            }
            match last {
                None => {
                    observer.event(&Event::Deleted { kind, id });
                    out.push(Ok(Deleted { kind, id, name }));
                }
                Some(error) => out.push(Err(Leftover { kind, id, error })),
            }
        }
    }
    out
}

/// The resources of one kind (at `path`, listed under `key`) matching
/// `selector` and created before `before`: what [`delete_selected`]
/// deletes and `cleanup --dry-run` shows.
fn listed(
    api: &Api,
    kind: &'static str,
    path: &str,
    key: &str,
    selector: &str,
    before: Option<SystemTime>,
) -> Result<Vec<Deleted>, Leftover> {
    let items = api
        .list(path, key, &[("label_selector", selector.to_owned())])
        .map_err(|e| Leftover {
            kind,
            id: 0,
            error: format!("listing {path}: {e}"),
        })?;
    Ok(items
        .iter()
        .filter_map(|item| {
            let id = item["id"].as_u64()?;
            if let Some(before) = before
                && created_at(item).is_some_and(|t| t > before)
            {
                return None;
            }
            let name = item["name"].as_str().unwrap_or("").to_owned();
            Some(Deleted { kind, id, name })
        })
        .collect())
}

/// This boot's part of [`OWNER_LABEL`], if the kernel tells its boot id.
fn boot() -> Option<String> {
    let id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    Some(crate::digest::Sha256::of(id.trim().as_bytes()).hex()[..16].to_owned())
}

/// The [`OWNER_LABEL`] value of this process's runs.
pub(super) fn owner() -> Option<String> {
    Some(format!("{}-{}", boot()?, std::process::id()))
}

/// Whether process `pid` of this boot is gone.
fn gone(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    let r = unsafe { libc::kill(pid, 0) };
    r != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

/// Deletes what killed runs left (found by imgbuild's labels; nothing
/// without them is looked at): a publish or up that follows a killed one
/// cleans up after it, on this machine or another. A run is over when its
/// process, of this boot, is gone, or when it started longer ago than
/// [`SnapshotOptions::stale_after`] (another machine's process cannot be
/// asked). What stays is returned.
pub(super) fn sweep_killed_runs(
    api: &Api,
    opts: &SnapshotOptions,
    observer: &dyn Observer,
) -> Vec<Leftover> {
    let sel = format!("{}={},{RUN_LABEL}", MANAGED_BY.0, MANAGED_BY.1);
    let (boot, now) = (boot(), SystemTime::now());
    let mut runs = std::collections::BTreeSet::new();
    for (path, key) in [("/servers", "servers"), ("/ssh_keys", "ssh_keys")] {
        let Ok(items) = api.list(path, key, &[("label_selector", sel.clone())]) else {
            continue;
        };
        for item in items {
            let labels = &item["labels"];
            let Some(run) = labels[RUN_LABEL].as_str() else {
                continue;
            };
            let gone_here = owner_pid(labels, boot.as_deref())
                .is_some_and(|pid| pid != std::process::id() as i32 && gone(pid));
            let stale = started(&item)
                .and_then(|t| now.duration_since(t).ok())
                .is_some_and(|age| age > opts.stale_after);
            if gone_here || stale {
                runs.insert(run.to_owned());
            }
        }
    }
    runs.iter()
        .flat_map(|run| delete_run(api, run, opts, observer))
        .collect()
}

/// The process that made a resource, when it ran in this boot.
fn owner_pid(labels: &Value, boot: Option<&str>) -> Option<i32> {
    labels[OWNER_LABEL]
        .as_str()?
        .strip_prefix(boot?)?
        .strip_prefix('-')?
        .parse()
        .ok()
}

/// When a run made a resource: its [`STARTED_LABEL`], else the API's
/// `created` (resources of runs from before the label).
fn started(item: &Value) -> Option<SystemTime> {
    match item["labels"][STARTED_LABEL].as_str() {
        Some(secs) => SystemTime::UNIX_EPOCH.checked_add(Duration::from_secs(secs.parse().ok()?)),
        None => created_at(item),
    }
}

/// A resource's `created` time (RFC 3339).
pub(super) fn created_at(item: &Value) -> Option<SystemTime> {
    let t = time::OffsetDateTime::parse(
        item["created"].as_str()?,
        &time::format_description::well_known::Rfc3339,
    )
    .ok()?;
    let secs = u64::try_from(t.unix_timestamp()).ok()?;
    Some(SystemTime::UNIX_EPOCH + Duration::from_secs(secs))
}

/// Deletes every temporary server and SSH key any imgbuild run left (found
/// by label), created at least `older_than` ago: what `imgbuild cleanup`
/// does after a run was killed. A cluster's own servers carry no run label
/// and are never touched.
pub fn cleanup(
    api: &Api,
    older_than: Duration,
    opts: &SnapshotOptions,
    observer: &dyn Observer,
) -> (Vec<Deleted>, Vec<Leftover>) {
    let (sel, before) = cleanup_selection(older_than);
    let mut deleted = Vec::new();
    let mut left = Vec::new();
    for r in delete_selected(api, &sel, before, opts, observer, &["server", "ssh_key"]) {
        match r {
            Ok(d) => deleted.push(d),
            Err(l) => left.push(l),
        }
    }
    (deleted, left)
}

/// What [`cleanup`] looks for: every resource of any run, created at
/// least `older_than` ago.
fn cleanup_selection(older_than: Duration) -> (String, Option<SystemTime>) {
    let sel = format!("{}={},{RUN_LABEL}", MANAGED_BY.0, MANAGED_BY.1);
    let before = (!older_than.is_zero()).then(|| SystemTime::now() - older_than);
    (sel, before)
}

/// `imgbuild cleanup --dry-run`: what [`cleanup`] would delete now, found
/// as it finds it, nothing deleted; a listing that failed is a leftover.
pub fn cleanup_candidates(api: &Api, older_than: Duration) -> (Vec<Deleted>, Vec<Leftover>) {
    let (sel, before) = cleanup_selection(older_than);
    let mut found = Vec::new();
    let mut left = Vec::new();
    for (kind, path, key) in KINDS {
        match listed(api, kind, path, key, &sel, before) {
            Ok(items) => found.extend(items),
            Err(l) => left.push(l),
        }
    }
    (found, left)
}
