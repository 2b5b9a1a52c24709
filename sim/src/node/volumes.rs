//! The system volumes a Reset may name, per Talos version, and what wiping
//! them takes with it (the machine config on STATE, etcd's data).
//!
//! Upstream (siderolabs/talos): `Reset` (`internal/app/machined/internal/
//! server/v1alpha1/v1alpha1_server.go`) looks each `system_partitions_to_wipe`
//! label up as a `VolumeStatus`; a label with none is "failed to get volume
//! status with label …". An empty list wipes the system disk whole
//! (`block.GetSystemDiskPaths`).
//! - v1.11–v1.13 (v1.11.6, v1.12.11, v1.13.9): etcd's data is the directory
//!   volume `ETCD` (`/var/lib/etcd` under EPHEMERAL: `controllers/block/
//!   volume_config.go` in v1.11, `controllers/block/internal/volumes/
//!   volumeconfig/system_volumes.go` `standardVolumeDefinitions` after); a
//!   volume without a block device of its own is refused: "failed to reset:
//!   volume \"ETCD\" is not located". Wiping EPHEMERAL wipes etcd's data.
//! - v1.14 (v1.14.0-rc.1, the newest v1.14 tag read): ETCD, CRI, KUBELET and
//!   LOG are promotable (`pkg/machinery/config/config/volume.go`
//!   `PromotableSystemVolumeNames`): a directory under EPHEMERAL unless a
//!   `VolumeConfig` of that name requests provisioning (`diskSelector`,
//!   `grow`, `minSize` or `maxSize`: `pkg/machinery/config/types/block/
//!   volume_config.go` `ProvisioningRequested`), then a partition of its own
//!   (`system_volumes.go` `GetPromotableSystemVolumesTransformer`). A
//!   directory one may be named only when the volume it resides on is wiped
//!   too (`internal/app/machined/pkg/system/volumes.go` `FindBackingVolume`);
//!   a partition is wiped by naming it, and survives EPHEMERAL's wipe (as
//!   talos `internal/integration/api/etcd.go` wipes `ETCD` alone, or
//!   `EPHEMERAL` when ETCD is a directory).
//!
//! Simplified: the other directory volumes (IDs that are paths, such as
//! `/var/lib`) are not offered; a dedicated partition is taken to be on the
//! system disk (the default `diskSelector`), so an empty list wipes it.

use serde_json::Value;

use super::version::Talos;

/// The partitions of a Talos system disk (`VolumeStatus` IDs).
pub(crate) const PARTITIONS: [&str; 5] = ["EFI", "BOOT", "META", "STATE", "EPHEMERAL"];

/// v1.14's promotable system volumes.
const PROMOTABLE: [&str; 4] = ["ETCD", "CRI", "KUBELET", "LOG"];

/// What a Reset wipes.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Wipe {
    /// The volumes wiped, in the request's order (the system disk's
    /// partitions and dedicated volumes for an empty list).
    pub(crate) volumes: Vec<String>,
    /// STATE, and with it the machine config.
    pub(crate) config: bool,
    /// etcd's data directory.
    pub(crate) etcd_data: bool,
}

/// The promotable volumes a config puts on partitions of their own: its
/// `VolumeConfig` documents that request provisioning (none before v1.14).
pub(crate) fn dedicated(talos: &Talos, raw_config: &str) -> Vec<String> {
    if !talos.has_promotable_volumes() {
        return Vec::new();
    }
    let mut out = Vec::new();
    for doc in serde_yaml_ng::Deserializer::from_str(raw_config) {
        let Ok(v) = <Value as serde::Deserialize>::deserialize(doc) else {
            continue;
        };
        let name = v["name"].as_str().unwrap_or_default();
        let p = &v["provisioning"];
        let requested = ["diskSelector", "grow", "minSize", "maxSize"]
            .iter()
            .any(|k| !p[k].is_null());
        if v["kind"] == "VolumeConfig" && PROMOTABLE.contains(&name) && requested {
            out.push(name.to_owned());
        }
    }
    out
}

/// What a Reset naming `specs` (label, wipe) wipes on a node running
/// `talos` with `dedicated` volumes, or Reset's refusal.
pub(crate) fn plan(
    talos: &Talos,
    dedicated: &[String],
    specs: &[(String, bool)],
) -> Result<Wipe, String> {
    if specs.is_empty() {
        let mut volumes: Vec<String> = PARTITIONS.iter().map(|p| (*p).to_owned()).collect();
        volumes.extend(dedicated.iter().cloned());
        return Ok(Wipe {
            volumes,
            config: true,
            etcd_data: true,
        });
    }
    let requested = |label: &str| specs.iter().any(|(l, wipe)| *wipe && l == label);
    let mut volumes = Vec::new();
    for (label, wipe) in specs {
        let label = label.as_str();
        let promotable = talos.has_promotable_volumes() && PROMOTABLE.contains(&label);
        if PARTITIONS.contains(&label) || promotable && dedicated.iter().any(|d| d == label) {
            if *wipe {
                volumes.push(label.to_owned());
            }
        } else if promotable {
            if !requested("EPHEMERAL") {
                return Err(format!(
                    "failed to reset: volume {label:?} resides on volume \"EPHEMERAL\", and therefore {label:?} cannot be wiped without wiping \"EPHEMERAL\""
                ));
            }
        } else if label == "ETCD" {
            return Err("failed to reset: volume \"ETCD\" is not located".into());
        } else {
            return Err(format!(
                "failed to get volume status with label {label:?}: resource VolumeStatuses.block.talos.dev(runtime/{label}@undefined) doesn't exist"
            ));
        }
    }
    let etcd_on_partition = dedicated.iter().any(|d| d == "ETCD");
    let wiped = |l: &str| volumes.iter().any(|v| v == l);
    Ok(Wipe {
        config: wiped("STATE"),
        etcd_data: if etcd_on_partition {
            wiped("ETCD")
        } else {
            wiped("EPHEMERAL")
        },
        volumes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specs(labels: &[&str]) -> Vec<(String, bool)> {
        labels.iter().map(|l| ((*l).to_owned(), true)).collect()
    }

    const ETCD_PARTITION: &str = "version: v1alpha1\nmachine: {}\n---\napiVersion: v1alpha1\nkind: VolumeConfig\nname: ETCD\nprovisioning:\n  minSize: 2GiB\n---\napiVersion: v1alpha1\nkind: VolumeConfig\nname: EPHEMERAL\nprovisioning:\n  maxSize: 40GiB\n";

    #[test]
    fn before_v1_14_etcd_is_a_directory_that_no_reset_may_name_and_ephemeral_takes_it() {
        let t = Talos::parse("v1.13.9").unwrap();
        assert!(
            dedicated(&t, ETCD_PARTITION).is_empty(),
            "no promotable volumes"
        );
        assert_eq!(
            plan(&t, &[], &specs(&["STATE", "EPHEMERAL", "ETCD"])).unwrap_err(),
            "failed to reset: volume \"ETCD\" is not located"
        );
        let w = plan(&t, &[], &specs(&["STATE", "EPHEMERAL"])).unwrap();
        assert!(w.config && w.etcd_data, "{w:?}");
        let e = plan(&t, &[], &specs(&["CRI"])).unwrap_err();
        assert!(
            e.starts_with("failed to get volume status with label \"CRI\""),
            "{e}"
        );
    }

    #[test]
    fn v1_14_wipes_a_dedicated_etcd_partition_only_when_named() {
        let t = Talos::parse("v1.14.0").unwrap();
        let d = dedicated(&t, ETCD_PARTITION);
        assert_eq!(d, ["ETCD"]);
        // EPHEMERAL's wipe leaves the partition and its etcd data.
        let w = plan(&t, &d, &specs(&["STATE", "EPHEMERAL"])).unwrap();
        assert!(w.config && !w.etcd_data, "{w:?}");
        let w = plan(&t, &d, &specs(&["ETCD"])).unwrap();
        assert_eq!((w.config, w.etcd_data), (false, true));
        let w = plan(&t, &d, &[]).unwrap();
        assert!(w.volumes.contains(&"ETCD".to_owned()) && w.etcd_data);
        // A directory one needs EPHEMERAL with it.
        assert_eq!(
            plan(&t, &[], &specs(&["ETCD"])).unwrap_err(),
            "failed to reset: volume \"ETCD\" resides on volume \"EPHEMERAL\", and therefore \"ETCD\" cannot be wiped without wiping \"EPHEMERAL\""
        );
        let w = plan(&t, &[], &specs(&["EPHEMERAL", "ETCD"])).unwrap();
        assert_eq!(w.volumes, ["EPHEMERAL"], "wiped as part of EPHEMERAL");
        assert!(w.etcd_data);
        let not_wiped = vec![("EPHEMERAL".to_owned(), false), ("ETCD".to_owned(), true)];
        assert!(
            plan(&t, &[], &not_wiped).is_err(),
            "EPHEMERAL named but not wiped"
        );
    }
}
