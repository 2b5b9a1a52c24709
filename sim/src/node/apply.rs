//! ApplyConfiguration on a configured node, per the version it runs
//! (siderolabs/talos `internal/app/machined/internal/server/v1alpha1/
//! v1alpha1_server.go`, read at v1.9.6, v1.11.5, v1.12.9, v1.13.3 and
//! v1.14.0): the apply lock (v1.12.9+, v1.13.3+, v1.14) first, then every
//! non-TRY request cancels a pending TRY rollback, then the config is read;
//! v1.9–v1.13 hold NO_REBOOT and TRY to `CanApplyImmediate` and turn AUTO
//! into REBOOT where it refuses (the config persisted, then a reboot);
//! v1.14 refuses REBOOT and turns AUTO into NO_REBOOT. A dry run answers
//! the summary and the diff against the RUNNING config.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tonic::Status;

use super::config::read_config;
use super::immediate;
use super::service::Api;
use super::state::TryRollback;
use imgbuild::talos::api::machine::apply_configuration_request::Mode as ApplyMode;
use imgbuild::talos::api::machine::*;

/// `constants.ConfigTryTimeout`.
const TRY_TIMEOUT: Duration = Duration::from_secs(60);

/// The config diff a dry run answers: a unified diff of the old and new
/// YAML with three lines of context around each change, hunks closer than
/// that merged, under `--- a` / `+++ b` (siderolabs/talos
/// `pkg/machinery/config/configdiff/configdiff.go`: gotextdiff's
/// `ToUnified`, printed by `outputDiff`); empty when the configs are the
/// same. Lines are matched by longest common subsequence, deletions first.
fn line_diff(old: &str, new: &str) -> String {
    const CONTEXT: usize = 3;
    let (a, b): (Vec<&str>, Vec<&str>) = (old.lines().collect(), new.lines().collect());
    let mut lcs = vec![vec![0u32; b.len() + 1]; a.len() + 1];
    for i in (0..a.len()).rev() {
        for j in (0..b.len()).rev() {
            lcs[i][j] = if a[i] == b[j] {
                lcs[i + 1][j + 1] + 1
            } else {
                lcs[i + 1][j].max(lcs[i][j + 1])
            };
        }
    }
    let (mut i, mut j) = (0, 0);
    let mut ops: Vec<(char, &str)> = Vec::new();
    while i < a.len() || j < b.len() {
        if i < a.len() && j < b.len() && a[i] == b[j] {
            ops.push((' ', a[i]));
            i += 1;
            j += 1;
        } else if i < a.len() && (j == b.len() || lcs[i + 1][j] >= lcs[i][j + 1]) {
            ops.push(('-', a[i]));
            i += 1;
        } else {
            ops.push(('+', b[j]));
            j += 1;
        }
    }
    let changes: Vec<usize> = (0..ops.len()).filter(|&k| ops[k].0 != ' ').collect();
    let Some(&first) = changes.first() else {
        return String::new();
    };
    // Hunks: runs of changes whose gaps are at most twice the context.
    let mut hunks: Vec<(usize, usize)> = vec![(first, first + 1)];
    for &k in &changes[1..] {
        let last = hunks.last_mut().expect("one hunk at least");
        if k - last.1 <= 2 * CONTEXT {
            last.1 = k + 1;
        } else {
            hunks.push((k, k + 1));
        }
    }
    let mut out = String::from("--- a\n+++ b\n");
    for (s, e) in hunks {
        let (from, to) = (s.saturating_sub(CONTEXT), (e + CONTEXT).min(ops.len()));
        let line_at = |keep: char| 1 + ops[..from].iter().filter(|(c, _)| *c != keep).count();
        let count = |keep: char| ops[from..to].iter().filter(|(c, _)| *c != keep).count();
        let range = |sign: char, at: usize, n: usize| {
            if n > 1 {
                format!("{sign}{at},{n}")
            } else {
                format!("{sign}{at}")
            }
        };
        out += &format!(
            "@@ {} {} @@\n",
            range('-', line_at('+'), count('+')),
            range('+', line_at('-'), count('-'))
        );
        for (c, line) in &ops[from..to] {
            out += &format!("{c}{line}\n");
        }
    }
    out
}

/// Go's `time.Duration.String()` for whole seconds (`1m0s`, `30s`).
fn go_duration(d: Duration) -> String {
    let s = d.as_secs();
    match (s / 3600, s % 3600 / 60, s % 60) {
        (0, 0, sec) => format!("{sec}s"),
        (0, m, sec) => format!("{m}m{sec}s"),
        (h, m, sec) => format!("{h}h{m}m{sec}s"),
    }
}

/// The stats name of a mode.
pub(crate) fn mode_name(mode: ApplyMode) -> &'static str {
    match mode {
        ApplyMode::Reboot => "reboot",
        ApplyMode::Auto => "auto",
        ApplyMode::NoReboot => "no_reboot",
        ApplyMode::Staged => "staged",
        ApplyMode::Try => "try",
    }
}

impl Api {
    pub(crate) fn apply_configured(
        &self,
        i: usize,
        req: &ApplyConfigurationRequest,
    ) -> Result<ApplyConfiguration, Status> {
        let talos = self.talos(i);
        let node = self.cluster.node(i);
        let now = Instant::now();
        let requested = ApplyMode::try_from(req.mode).unwrap_or(ApplyMode::Reboot);
        let mut st = node.st.lock().unwrap();
        *st.day2
            .requests_by_mode
            .entry(mode_name(requested))
            .or_default() += 1;
        if talos.locks_apply() && st.day2.applying_until.is_some_and(|t| now < t) {
            st.day2.apply_refusals += 1;
            return Err(Status::failed_precondition(
                "another apply configuration is already in progress",
            ));
        }
        if requested != ApplyMode::Try && st.day2.try_rollback.take().is_some() {
            st.day2.try_cancellations += 1;
        }
        let refuse = |st: &mut super::state::NodeState, s: Status| {
            st.day2.apply_refusals += 1;
            s
        };
        let mut applied = read_config(&req.data).map_err(|s| refuse(&mut st, s))?;
        super::k8s::versions::runtime_validate(&talos, &applied.v1alpha1)
            .map_err(|s| refuse(&mut st, s))?;
        let running = st.applied.clone().expect("a configured node has a config");
        let (mode, details, why) = if talos.checks_immediate() {
            let blocked = immediate::blocking_fields(&running.v1alpha1, &applied.v1alpha1);
            let refusal = blocked.as_ref().map(|fields| {
                format!(
                    "this config change can't be applied in immediate mode\ndiff:\n{}",
                    fields
                        .iter()
                        .map(|f| format!("  {f}\n"))
                        .collect::<String>()
                )
            });
            match (requested, refusal) {
                (ApplyMode::Try | ApplyMode::NoReboot, Some(why)) => {
                    return Err(refuse(&mut st, Status::invalid_argument(why)));
                }
                (ApplyMode::Try | ApplyMode::NoReboot, None) | (ApplyMode::Auto, None) => (
                    if requested == ApplyMode::Try {
                        ApplyMode::Try
                    } else {
                        ApplyMode::NoReboot
                    },
                    "Applied configuration without a reboot",
                    None,
                ),
                (ApplyMode::Auto, Some(why)) => (
                    ApplyMode::Reboot,
                    "Applied configuration with a reboot",
                    Some(why),
                ),
                (ApplyMode::Reboot, _) => (
                    ApplyMode::Reboot,
                    "Applied configuration with a reboot",
                    None,
                ),
                (ApplyMode::Staged, _) => (
                    ApplyMode::Staged,
                    "Staged configuration to be applied after the next reboot",
                    None,
                ),
            }
        } else {
            match requested {
                ApplyMode::Reboot => {
                    return Err(refuse(
                        &mut st,
                        Status::unimplemented(
                            "the REBOOT mode is not supported, please use AUTO or NO_REBOOT modes instead",
                        ),
                    ));
                }
                ApplyMode::Auto | ApplyMode::NoReboot => (
                    ApplyMode::NoReboot,
                    "Applied configuration without a reboot",
                    None,
                ),
                ApplyMode::Try => (
                    ApplyMode::Try,
                    "Applied configuration without a reboot",
                    None,
                ),
                ApplyMode::Staged => (
                    ApplyMode::Staged,
                    "Staged configuration to be applied after the next reboot",
                    None,
                ),
            }
        };
        if req.dry_run {
            st.day2.dry_runs += 1;
            let diff = line_diff(&running.raw, &applied.raw);
            let diff = if diff.is_empty() {
                "No changes.".to_owned()
            } else {
                diff
            };
            return Ok(ApplyConfiguration {
                metadata: None,
                warnings: Vec::new(),
                mode: mode as i32,
                mode_details: format!(
                    "Dry run summary:\n{details} (skipped in dry-run).\nConfig diff:\n\n{diff}"
                ),
            });
        }
        st.stats.applies += 1;
        *st.day2.applies_by_mode.entry(mode_name(mode)).or_default() += 1;
        st.day2.applying_until = Some(now + super::state::ms(self.cluster.args.apply_time));
        if applied.os_ca.key.is_empty() {
            applied.os_ca.key = running.os_ca.key.clone();
        }
        let applied = Arc::new(applied);
        let mut details = details.to_owned();
        match mode {
            ApplyMode::NoReboot => {
                st.applied = Some(applied);
                st.day2.staged = None;
                st.mtls = None;
            }
            ApplyMode::Try => {
                let timeout = req
                    .try_mode_timeout
                    .as_ref()
                    .and_then(|d| u64::try_from(d.seconds).ok())
                    .map_or(TRY_TIMEOUT, Duration::from_secs);
                details += &format!(
                    "\nThe config is applied in 'try' mode and will be automatically reverted back in {}",
                    go_duration(timeout)
                );
                st.day2.tries += 1;
                let id = st.day2.tries;
                st.day2.try_rollback = Some(TryRollback {
                    id,
                    previous: running,
                });
                st.applied = Some(applied);
                st.mtls = None;
                let node = node.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(timeout).await;
                    let mut st = node.st.lock().unwrap();
                    if let Some(r) = st.day2.try_rollback.take_if(|r| r.id == id) {
                        st.applied = Some(r.previous);
                        st.mtls = None;
                        st.day2.try_rollbacks += 1;
                    }
                });
            }
            ApplyMode::Staged => st.day2.staged = Some(applied),
            ApplyMode::Reboot | ApplyMode::Auto => {
                st.day2.staged = Some(applied);
                drop(st);
                self.reboot_for_apply(i);
            }
        }
        Ok(ApplyConfiguration {
            metadata: None,
            warnings: Vec::new(),
            mode: mode as i32,
            mode_details: match why {
                Some(why) => format!("{details}: {why}"),
                None => details,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_diff_is_unified_with_three_lines_of_context() {
        assert_eq!(line_diff("a\nb\nc\n", "a\nb\nc\n"), "");
        assert_eq!(
            line_diff("a\nb\nc\n", "a\nx\nc\n"),
            "--- a\n+++ b\n@@ -1,3 +1,3 @@\n a\n-b\n+x\n c\n"
        );
        assert_eq!(
            line_diff("a\n", "a\nb\n"),
            "--- a\n+++ b\n@@ -1 +1,2 @@\n a\n+b\n"
        );
        // Changes eight lines apart: two hunks, three lines around each.
        let old: String = (1..=12).map(|n| format!("l{n}\n")).collect();
        let new = old.replace("l2\n", "L2\n").replace("l11\n", "L11\n");
        assert_eq!(
            line_diff(&old, &new),
            "--- a\n+++ b\n@@ -1,5 +1,5 @@\n l1\n-l2\n+L2\n l3\n l4\n l5\n@@ -8,5 +8,5 @@\n l8\n l9\n l10\n-l11\n+L11\n l12\n"
        );
    }

    #[test]
    fn durations_print_as_go_prints_them() {
        assert_eq!(go_duration(TRY_TIMEOUT), "1m0s");
        assert_eq!(go_duration(Duration::from_secs(30)), "30s");
        assert_eq!(go_duration(Duration::from_secs(3725)), "1h2m5s");
    }
}
