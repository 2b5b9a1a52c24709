//! The component flags, feature gates and admission plugins each Kubernetes
//! minor removes, and the check `talosctl upgrade-k8s` makes before any
//! change: a component started with one of them would not start on the
//! target. Tables and matching from siderolabs/go-kubernetes
//! `kubernetes/upgrade/checks.go` (`NewChecks`, `PopulateRemovedCLIFlags`,
//! `PopulateRemovedFeatureGates`, `PopulateRemovedAdmissionPlugins`), for
//! the minors the supported Talos releases run (1.26 → 1.27 to 1.35 → 1.36).
//! The arguments are the ones the node's rendered config gives each
//! component (`extraArgs`), from which Talos builds its command line.
//! Components are named as Kubernetes names them (`kube-apiserver`,
//! `kubelet`).

use serde::Serialize;

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
    pub component: String,
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
            self.component,
            self.kind.name()
        )
    }
}

/// One `extraArgs` value as it goes on the command line: a list joined
/// with commas.
pub fn arg_value(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Array(items) => {
            items.iter().map(arg_value).collect::<Vec<_>>().join(",")
        }
        other => other.to_string(),
    }
}

/// The settings removed between Kubernetes 1.`from` and 1.`to` that
/// `args` (one component's, on `node`) still use; nothing for a patch or
/// a step the table does not know.
pub fn removed_in(
    from: u32,
    to: u32,
    node: &str,
    component: &str,
    args: &[String],
) -> Vec<RemovedSetting> {
    let Some(r) = TABLE.iter().find(|r| r.step == (from, to)) else {
        return Vec::new();
    };
    let hit = |kind: Kind, value: &str| RemovedSetting {
        node: node.to_owned(),
        component: component.to_owned(),
        kind,
        value: value.to_owned(),
    };
    let mut out = Vec::new();
    let flags = match component {
        "kube-apiserver" => r.apiserver_flags,
        "kube-controller-manager" => r.controller_manager_flags,
        "kube-scheduler" => r.scheduler_flags,
        "kubelet" => r.kubelet_flags,
        _ => NONE,
    };
    let static_pod = matches!(
        component,
        "kube-apiserver" | "kube-controller-manager" | "kube-scheduler"
    );
    if component == "kube-apiserver" {
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
    if static_pod && let Some(list) = args.iter().find_map(|a| a.strip_prefix("--feature-gates=")) {
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
        let found = removed_in(34, 35, "worker-01", "kubelet", &a);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(
            found[0].describe(),
            "worker-01 kubelet: flag --pod-infra-container-image"
        );
        // A patch, or the minor before, removes nothing.
        assert!(removed_in(35, 35, "worker-01", "kubelet", &a).is_empty());
        assert!(removed_in(33, 34, "worker-01", "kubelet", &a).is_empty());
        // A flag that only shares the prefix is not the flag.
        let a = args(&["--pod-infra-container-image-pull=x"]);
        assert!(removed_in(34, 35, "w", "kubelet", &a).is_empty());
    }

    #[test]
    fn feature_gates_and_admission_plugins_are_matched_as_go_kubernetes_does() {
        let a = args(&[
            "--feature-gates=Foo=true,AppArmor=false",
            "--cloud-config=/etc/c",
        ]);
        let found = removed_in(32, 33, "cp-01", "kube-apiserver", &a);
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
        assert!(removed_in(32, 33, "cp-01", "kubelet", &a).is_empty());
        let a = args(&["--enable-admission-plugins=NodeRestriction,SecurityContextDeny"]);
        let found = removed_in(29, 30, "cp-02", "kube-apiserver", &a);
        assert_eq!(
            found[0].describe(),
            "cp-02 kube-apiserver: admission plugin SecurityContextDeny"
        );
    }

    #[test]
    fn list_values_are_joined_with_commas() {
        assert_eq!(arg_value(&json!(["A=true", "B=false"])), "A=true,B=false");
        assert_eq!(arg_value(&json!("x")), "x");
        assert_eq!(arg_value(&json!(3)), "3");
    }
}
