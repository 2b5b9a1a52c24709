//! The Talos version a node runs, and what differs between v1.9 and v1.14
//! on the paths day two takes. Each predicate names the upstream change
//! (siderolabs/talos, read at the release tags).

use std::fmt;

/// A Talos release `vMAJOR.MINOR.PATCH` (a pre-release suffix is kept in
/// the text but ignored when comparing, as semver's `Core()` does).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Talos {
    pub major: u64,
    pub minor: u64,
    pub patch: u64,
    tag: String,
}

impl Talos {
    /// `v1.11.5` (or `1.11.5`); None for anything else.
    pub fn parse(tag: &str) -> Option<Talos> {
        let core = tag.strip_prefix('v').unwrap_or(tag);
        let core = core.split(['-', '+']).next()?;
        let mut parts = core.split('.').map(|p| p.parse::<u64>().ok());
        let (major, minor, patch) = (parts.next()??, parts.next()??, parts.next()??);
        if parts.next().is_some() {
            return None;
        }
        Some(Talos {
            major,
            minor,
            patch,
            tag: tag.to_owned(),
        })
    }

    fn at_least(&self, minor: u64, patch: u64) -> bool {
        (self.major, self.minor, self.patch) >= (1, minor, patch)
    }

    /// `minor`, at least its `patch`.
    fn patch_of(&self, minor: u64, patch: u64) -> bool {
        self.major == 1 && self.minor == minor && self.patch >= patch
    }

    /// v1.9–v1.13 hold a configured node's changes against
    /// `CanApplyImmediate` (`internal/app/machined/pkg/runtime/v1alpha1/
    /// v1alpha1_runtime.go`); v1.14 dropped the check and the REBOOT mode
    /// (`v1alpha1_server.go`, siderolabs/talos#13557).
    pub fn checks_immediate(&self) -> bool {
        !self.at_least(14, 0)
    }

    /// `applyConfigMu.TryLock` in `ApplyConfiguration`: v1.14, backported
    /// to v1.12.9 and v1.13.3.
    pub fn locks_apply(&self) -> bool {
        self.patch_of(12, 9) || self.patch_of(13, 3) || self.at_least(14, 0)
    }

    /// `!in.GetForce() && !in.GetPreserve()` guards the etcd checks in
    /// `Upgrade` from v1.12.9, v1.13.4 and v1.14 (talos commit 89e307e);
    /// before, only `force` skips them.
    pub fn preserve_skips_etcd_checks(&self) -> bool {
        self.patch_of(12, 9) || self.patch_of(13, 4) || self.at_least(14, 0)
    }

    /// The persisted config is a COSI resource (`MachineConfigs.config.
    /// talos.dev` `persistent`) from v1.10.0 (`pkg/machinery/resources/
    /// config/machine_config.go` `PersistentID`); v1.9 keeps only the file.
    pub fn has_persistent_config_resource(&self) -> bool {
        self.at_least(10, 0)
    }

    /// v1.14's promotable system volumes (ETCD, CRI, KUBELET, LOG: a
    /// directory under EPHEMERAL or a partition of their own,
    /// `pkg/machinery/config/config/volume.go`); see `volumes.rs`.
    pub fn has_promotable_volumes(&self) -> bool {
        self.at_least(14, 0)
    }

    /// From v1.13.0 `manifest_apply.go` creates the bootstrap manifests by
    /// server-side apply with an inventory ConfigMap (`ssa.GetInventory`,
    /// the `config.k8s.io/owning-inventory` annotation); before, by a
    /// create with field manager `talos`.
    pub fn applies_manifests_by_inventory(&self) -> bool {
        self.at_least(13, 0)
    }

    /// `api/machine/lifecycle.proto` exists from v1.13.0.
    pub fn has_lifecycle_service(&self) -> bool {
        self.at_least(13, 0)
    }

    /// The installer's pre-flight check of the host it runs on
    /// (`cmd/installer/pkg/install/preflight.go` → `compatibility.
    /// TalosVersion.UpgradeableFrom`, the bounds from
    /// `pkg/machinery/compatibility/talos1NN/talos1NN.go`): the error text
    /// Talos logs before it reverts.
    pub fn installer_accepts(&self, host: &Talos) -> Result<(), String> {
        // (installer minor, MinimumHostUpgradeVersion, MaximumHostDowngradeVersion)
        type MajorMinor = (u64, u64);
        const BOUNDS: [(u64, MajorMinor, MajorMinor); 6] = [
            (9, (1, 8), (1, 11)),
            (10, (1, 8), (1, 12)),
            (11, (1, 9), (1, 13)),
            (12, (1, 10), (1, 14)),
            (13, (1, 11), (1, 15)),
            (14, (1, 12), (1, 16)),
        ];
        let name = |v: &Talos| format!("{}.{}.{}", v.major, v.minor, v.patch);
        let Some((_, min, max)) = BOUNDS
            .iter()
            .find(|(m, _, _)| self.major == 1 && *m == self.minor)
        else {
            return Err(format!(
                "pre-flight checks failed: upgrades to version {} are not supported",
                name(self)
            ));
        };
        let core = (host.major, host.minor);
        if core < *min {
            return Err(format!(
                "pre-flight checks failed: host version {} is too old to upgrade to Talos {}",
                name(host),
                name(self)
            ));
        }
        if core >= *max {
            return Err(format!(
                "pre-flight checks failed: host version {} is too new to downgrade to Talos {}",
                name(host),
                name(self)
            ));
        }
        Ok(())
    }
}

impl fmt::Display for Talos {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.tag)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(tag: &str) -> Talos {
        Talos::parse(tag).unwrap()
    }

    #[test]
    fn the_backports_start_at_their_patch_releases() {
        for (tag, lock, preserve, immediate) in [
            ("v1.9.6", false, false, true),
            ("v1.11.5", false, false, true),
            ("v1.12.8", false, false, true),
            ("v1.12.9", true, true, true),
            ("v1.13.2", false, false, true),
            ("v1.13.3", true, false, true),
            ("v1.13.4", true, true, true),
            ("v1.14.0", true, true, false),
            ("v1.14.0-rc.1", true, true, false),
        ] {
            let t = v(tag);
            assert_eq!(
                (
                    t.locks_apply(),
                    t.preserve_skips_etcd_checks(),
                    t.checks_immediate()
                ),
                (lock, preserve, immediate),
                "{tag}"
            );
        }
        assert!(Talos::parse("v1.11").is_none() && Talos::parse("latest").is_none());
    }

    #[test]
    fn installers_refuse_hosts_two_minors_back() {
        assert!(v("v1.11.5").installer_accepts(&v("v1.9.0")).is_ok());
        assert_eq!(
            v("v1.11.5").installer_accepts(&v("v1.8.3")).unwrap_err(),
            "pre-flight checks failed: host version 1.8.3 is too old to upgrade to Talos 1.11.5"
        );
        assert!(v("v1.12.0").installer_accepts(&v("v1.9.6")).is_err());
        assert!(v("v1.13.5").installer_accepts(&v("v1.10.9")).is_err());
        assert!(v("v1.13.5").installer_accepts(&v("v1.11.0")).is_ok());
        assert!(v("v1.10.0").installer_accepts(&v("v1.12.0")).is_err());
    }
}
