//! The component flags, feature gates and admission plugins each Kubernetes
//! minor removes, and the check `talosctl upgrade-k8s` makes before any
//! change: a component started with one of them would not start on the
//! target. Tables and matching from siderolabs/go-kubernetes
//! `kubernetes/upgrade/checks.go` (`NewChecks`, `PopulateRemovedCLIFlags`,
//! `PopulateRemovedFeatureGates`, `PopulateRemovedAdmissionPlugins`), for
//! the minors the supported Talos releases run (1.26 → 1.27 to 1.35 → 1.36).
//! The arguments are the ones the node's rendered config gives each
//! component (`extraArgs`), from which Talos builds its command line.

use std::collections::BTreeMap;

use serde::Serialize;

use super::plan::Component;

/// What one minor step removes (go-kubernetes `componentChecks`).
struct Removed {
    /// `(from minor, to minor)` of Kubernetes 1.x.
    step: (u32, u32),
    /// Common to kube-apiserver, kube-controller-manager, kube-scheduler.
    feature_gates: &'static [&'static str],
    apiserver_flags: &'static [&'static str],
    admission_plugins: &'static [&'static str],
    controller_manager_flags: &'static [&'static str],
    scheduler_flags: &'static [&'static str],
    kubelet_flags: &'static [&'static str],
}

const NONE: &[&str] = &[];

const TABLE: &[Removed] = &[
    Removed {
        step: (26, 27),
        feature_gates: &[
            "ExpandCSIVolumes",
            "ExpandInUsePersistentVolumes",
            "ExpandPersistentVolumes",
            "ControllerManagerLeaderMigration",
            "CSIMigration",
            "CSIInlineVolume",
            "EphemeralContainers",
            "LocalStorageCapacityIsolation",
            "NetworkPolicyEndPort",
            "StatefulSetMinReadySeconds",
            "IdentifyPodOS",
            "DaemonSetUpdateSurge",
        ],
        apiserver_flags: NONE,
        admission_plugins: NONE,
        controller_manager_flags: &["enable-taint-manager", "pod-eviction-timeout"],
        scheduler_flags: NONE,
        kubelet_flags: &["container-runtime", "master-service-namespace"],
    },
    Removed {
        step: (27, 28),
        feature_gates: &[
            "AdvancedAuditing",
            "DelegateFSGroupToCSIDriver",
            "DevicePlugins",
            "DisableAcceleratorUsageMetrics",
            "EndpointSliceTerminatingCondition",
            "CSIStorageCapacity",
            "CSIMigrationGCE",
            "KubeletCredentialProviders",
            "MixedProtocolLBService",
            "ServiceInternalTrafficPolicy",
            "ServiceIPStaticSubrange",
            "WindowsHostProcessContainers",
        ],
        apiserver_flags: NONE,
        admission_plugins: NONE,
        controller_manager_flags: NONE,
        scheduler_flags: NONE,
        kubelet_flags: NONE,
    },
    Removed {
        step: (29, 30),
        feature_gates: &[
            "ExpandedDNSConfig",
            "ExperimentalHostUserNamespaceDefaultingGate",
            "IPTablesOwnershipCleanup",
            "KubeletPodResources",
            "KubeletPodResourcesGetAllocatable",
            "MinimizeIPTablesRestore",
            "ProxyTerminatingEndpoints",
            "RemoveSelfLink",
        ],
        apiserver_flags: NONE,
        admission_plugins: &["SecurityContextDeny"],
        controller_manager_flags: NONE,
        scheduler_flags: NONE,
        kubelet_flags: NONE,
    },
    Removed {
        step: (30, 31),
        feature_gates: &[
            "APIPriorityAndFairness",
            "CSINodeExpandSecret",
            "ConsistentHTTPGetHandlers",
            "DefaultHostNetworkHostPortsInPodTemplates",
            "ServiceNodePortStaticSubrange",
            "SkipReadOnlyValidationGCE",
        ],
        apiserver_flags: NONE,
        admission_plugins: NONE,
        controller_manager_flags: &[
            "volume-host-cidr-denylist",
            "volume-host-allow-local-loopback",
            "horizontal-pod-autoscaler-upscale-delay",
            "horizontal-pod-autoscaler-downscale-delay",
        ],
        scheduler_flags: NONE,
        kubelet_flags: &[
            "keep-terminated-pod-volumes",
            "iptables-masquerade-bit",
            "iptables-drop-bit",
        ],
    },
    Removed {
        step: (31, 32),
        feature_gates: &[
            "AllowServiceLBStatusOnNonLB",
            "CloudDualStackNodeIPs",
            "DRAControlPlaneController",
            "HPAContainerMetrics",
            "KMSv2",
            "KMSv2KDF",
            "LegacyServiceAccountTokenCleanUp",
            "MinDomainsInPodTopologySpread",
            "NewVolumeManagerReconstruction",
            "NodeOutOfServiceVolumeDetach",
            "ServerSideApply",
            "ServerSideFieldValidation",
            "StableLoadBalancerNodeSet",
            "ValidatingAdmissionPolicy",
            "ZeroLimitedNominalConcurrencyShares",
        ],
        apiserver_flags: NONE,
        admission_plugins: NONE,
        controller_manager_flags: NONE,
        scheduler_flags: NONE,
        kubelet_flags: NONE,
    },
    Removed {
        step: (32, 33),
        feature_gates: &[
            "AppArmor",
            "AppArmorFields",
            "CPUManager",
            "DisableCloudProviders",
            "DisableKubeletCloudCredentialProviders",
            "JobPodFailurePolicy",
            "KubeProxyDrainingTerminatingNodes",
            "PDBUnhealthyPodEvictionPolicy",
            "PersistentVolumeLastPhaseTransitionTime",
            "VolumeCapacityPriority",
        ],
        apiserver_flags: &["cloud-config"],
        admission_plugins: NONE,
        controller_manager_flags: NONE,
        scheduler_flags: NONE,
        kubelet_flags: NONE,
    },
    Removed {
        step: (33, 34),
        feature_gates: &[
            "DevicePluginCDIDevices",
            "LegacySidecarContainers",
            "PodDisruptionConditions",
        ],
        apiserver_flags: NONE,
        admission_plugins: NONE,
        controller_manager_flags: NONE,
        scheduler_flags: NONE,
        kubelet_flags: &["cloud-config"],
    },
    Removed {
        step: (34, 35),
        feature_gates: &[
            "SizeMemoryBackedVolumes",
            "UserNamespacesHostNetworkSupport",
        ],
        apiserver_flags: NONE,
        admission_plugins: NONE,
        controller_manager_flags: NONE,
        scheduler_flags: NONE,
        kubelet_flags: &["pod-infra-container-image"],
    },
    Removed {
        step: (35, 36),
        feature_gates: &[
            "CSIMigrationPortworx",
            "InTreePluginPortworxUnregister",
            "WatchFromStorageWithoutResourceVersion",
        ],
        apiserver_flags: NONE,
        admission_plugins: NONE,
        controller_manager_flags: NONE,
        scheduler_flags: NONE,
        kubelet_flags: NONE,
    },
];

/// What kind of setting the target removes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Kind {
    AdmissionPlugin,
    FeatureGate,
    Flag,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::AdmissionPlugin => "admission plugin",
            Kind::FeatureGate => "feature gate",
            Kind::Flag => "flag",
        }
    }
}

/// One removed setting a node's component is started with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RemovedSetting {
    pub node: String,
    pub component: Component,
    pub kind: Kind,
    pub value: String,
}

impl RemovedSetting {
    pub fn describe(&self) -> String {
        let value = match self.kind {
            Kind::Flag => format!("--{}", self.value),
            _ => self.value.clone(),
        };
        format!(
            "{} {}: {} {value}",
            self.node,
            self.component.name(),
            self.kind.name()
        )
    }
}

/// The command-line arguments (`--key=value`) of each component in a
/// rendered config's `extraArgs`; a list value is joined with commas.
pub fn args_of(doc: &serde_json::Value) -> BTreeMap<Component, Vec<String>> {
    Component::ALL
        .into_iter()
        .filter_map(|c| {
            let [a, b] = c.config_path();
            let args = doc[a][b]["extraArgs"].as_object()?;
            let list = args
                .iter()
                .map(|(k, v)| {
                    let v = match v {
                        serde_json::Value::String(s) => s.clone(),
                        serde_json::Value::Array(items) => items
                            .iter()
                            .map(|i| i.as_str().map_or_else(|| i.to_string(), str::to_owned))
                            .collect::<Vec<_>>()
                            .join(","),
                        other => other.to_string(),
                    };
                    format!("--{k}={v}")
                })
                .collect();
            Some((c, list))
        })
        .collect()
}

/// The settings removed between Kubernetes 1.`from` and 1.`to` that
/// `args` (one component's, on `node`) still use; nothing for a patch or
/// a step the table does not know.
pub fn removed_in(
    from: u32,
    to: u32,
    node: &str,
    component: Component,
    args: &[String],
) -> Vec<RemovedSetting> {
    let Some(r) = TABLE.iter().find(|r| r.step == (from, to)) else {
        return Vec::new();
    };
    let hit = |kind: Kind, value: &str| RemovedSetting {
        node: node.to_owned(),
        component,
        kind,
        value: value.to_owned(),
    };
    let mut out = Vec::new();
    let flags = match component {
        Component::KubeApiserver => r.apiserver_flags,
        Component::KubeControllerManager => r.controller_manager_flags,
        Component::KubeScheduler => r.scheduler_flags,
        Component::Kubelet => r.kubelet_flags,
        Component::KubeProxy => NONE,
    };
    if component == Component::KubeApiserver {
        // The first --enable-admission-plugins, split on commas.
        if let Some(list) = args
            .iter()
            .find_map(|a| a.strip_prefix("--enable-admission-plugins="))
        {
            let plugins: Vec<&str> = list.split(',').collect();
            for p in r.admission_plugins {
                if plugins.contains(p) {
                    out.push(hit(Kind::AdmissionPlugin, p));
                }
            }
        }
    }
    if Component::STATIC_PODS.contains(&component)
        && let Some(list) = args.iter().find_map(|a| a.strip_prefix("--feature-gates="))
    {
        let gates: Vec<&str> = list
            .split(',')
            .map(|g| g.split('=').next().unwrap_or(""))
            .collect();
        for g in r.feature_gates {
            if gates.contains(g) {
                out.push(hit(Kind::FeatureGate, g));
            }
        }
    }
    for f in flags {
        let flag = format!("--{f}");
        if args
            .iter()
            .any(|a| a.split('=').next() == Some(flag.as_str()))
        {
            out.push(hit(Kind::Flag, f));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_kubelet_flag_removed_in_1_35_is_found_and_named() {
        let a = args(&["--pod-infra-container-image=pause:3.10", "--v=2"]);
        let found = removed_in(34, 35, "worker-01", Component::Kubelet, &a);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(
            found[0].describe(),
            "worker-01 kubelet: flag --pod-infra-container-image"
        );
        // A patch, or the minor before, removes nothing.
        assert!(removed_in(35, 35, "worker-01", Component::Kubelet, &a).is_empty());
        assert!(removed_in(33, 34, "worker-01", Component::Kubelet, &a).is_empty());
        // A flag that only shares the prefix is not the flag.
        let a = args(&["--pod-infra-container-image-pull=x"]);
        assert!(removed_in(34, 35, "w", Component::Kubelet, &a).is_empty());
    }

    #[test]
    fn feature_gates_and_admission_plugins_are_matched_as_go_kubernetes_does() {
        let a = args(&[
            "--feature-gates=Foo=true,AppArmor=false",
            "--cloud-config=/etc/c",
        ]);
        let found = removed_in(32, 33, "cp-01", Component::KubeApiserver, &a);
        let what: Vec<String> = found.iter().map(RemovedSetting::describe).collect();
        assert_eq!(
            what,
            [
                "cp-01 kube-apiserver: feature gate AppArmor",
                "cp-01 kube-apiserver: flag --cloud-config"
            ]
        );
        // The kubelet's feature gates are not checked (checks.go checks the
        // static pods' only); its cloud-config goes in 1.34.
        assert!(removed_in(32, 33, "cp-01", Component::Kubelet, &a).is_empty());
        let a = args(&["--enable-admission-plugins=NodeRestriction,SecurityContextDeny"]);
        let found = removed_in(29, 30, "cp-02", Component::KubeApiserver, &a);
        assert_eq!(
            found[0].describe(),
            "cp-02 kube-apiserver: admission plugin SecurityContextDeny"
        );
    }

    #[test]
    fn extra_args_become_the_command_line() {
        let doc = json!({
            "machine": {"kubelet": {"extraArgs": {"pod-infra-container-image": "pause:3.10"}}},
            "cluster": {"apiServer": {"extraArgs": {"feature-gates": ["A=true", "B=false"]}}}
        });
        let args = args_of(&doc);
        assert_eq!(
            args[&Component::Kubelet],
            ["--pod-infra-container-image=pause:3.10"]
        );
        assert_eq!(
            args[&Component::KubeApiserver],
            ["--feature-gates=A=true,B=false"]
        );
    }
}
