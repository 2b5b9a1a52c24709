//! Kubernetes versions as a Talos node reads them from its machine config:
//! each component's image (the config's, else the default of the Talos
//! release), the version in an image tag, and the runtime check that refuses
//! a Kubernetes version the running Talos does not support.
//!
//! Upstream (siderolabs/talos, the defaults read at every tag v1.9.0–v1.13.9
//! and v1.14.0-rc.1, the rest at v1.9.6, v1.10.9, v1.11.5, v1.12.9, v1.13.5):
//! `pkg/machinery/constants/constants.go`
//! (`DefaultKubernetesVersion`, `DefaultCoreDNSVersion`, `FlannelVersion`),
//! `pkg/machinery/config/types/v1alpha1/*` `Image()` (an empty image field
//! means the default), `pkg/machinery/compatibility/kubernetes_version.go`
//! `SupportedWith` with the bounds of `compatibility/talos1NN`, and
//! `v1alpha1_validation.go` `RuntimeValidate` → `ValidateKubernetesImageTag`
//! (from v1.11.0), which `ApplyConfiguration` runs and answers with
//! InvalidArgument.

use serde_json::Value;
use tonic::Status;

use crate::node::version::Talos;

/// A Kubernetes component a node runs from its config.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Component {
    ApiServer,
    ControllerManager,
    Scheduler,
    Kubelet,
}

impl Component {
    pub const CONTROL_PLANE: [Component; 3] = [
        Component::ApiServer,
        Component::ControllerManager,
        Component::Scheduler,
    ];

    /// The static pod's name, `k8s-app` label and Talos service/config ID.
    pub fn id(self) -> &'static str {
        match self {
            Component::ApiServer => "kube-apiserver",
            Component::ControllerManager => "kube-controller-manager",
            Component::Scheduler => "kube-scheduler",
            Component::Kubelet => "kubelet",
        }
    }

    /// The config section (under `cluster`, or `machine` for the kubelet)
    /// and the repository of its default image.
    fn source(self) -> (&'static str, &'static str, &'static str) {
        match self {
            Component::ApiServer => ("cluster", "apiServer", "registry.k8s.io/kube-apiserver"),
            Component::ControllerManager => (
                "cluster",
                "controllerManager",
                "registry.k8s.io/kube-controller-manager",
            ),
            Component::Scheduler => ("cluster", "scheduler", "registry.k8s.io/kube-scheduler"),
            Component::Kubelet => ("machine", "kubelet", "ghcr.io/siderolabs/kubelet"),
        }
    }
}

/// What a Talos release uses when the config names no image
/// (`constants.go` `DefaultKubernetesVersion`, `DefaultCoreDNSVersion`,
/// `FlannelVersion`): (minor, first patch with these values, Kubernetes,
/// CoreDNS, flannel), read at every tag from v1.9.0 to v1.13.9; v1.14 as of
/// v1.14.0-rc.1.
const DEFAULTS: [(u64, u64, &str, &str, &str); 28] = [
    (9, 0, "1.32.0", "v1.12.0", "v0.26.1"),
    (9, 3, "1.32.1", "v1.12.0", "v0.26.1"),
    (9, 4, "1.32.2", "v1.12.0", "v0.26.4"),
    (9, 5, "1.32.3", "v1.12.0", "v0.26.5"),
    (9, 6, "1.32.4", "v1.12.0", "v0.26.5"),
    (10, 0, "1.33.0", "v1.12.1", "v0.26.7"),
    (10, 3, "1.33.1", "v1.12.1", "v0.26.7"),
    (10, 5, "1.33.2", "v1.12.1", "v0.26.7"),
    (10, 6, "1.33.3", "v1.12.1", "v0.26.7"),
    (10, 7, "1.33.4", "v1.12.1", "v0.26.7"),
    (10, 8, "1.33.6", "v1.12.1", "v0.26.7"),
    (11, 0, "1.34.0", "v1.12.2", "v0.27.2"),
    (11, 1, "1.34.0", "v1.12.3", "v0.27.2"),
    (11, 2, "1.34.1", "v1.12.3", "v0.27.2"),
    (11, 3, "1.34.1", "v1.12.4", "v0.27.4"),
    (12, 0, "1.35.0", "v1.13.2", "v0.27.4"),
    (12, 5, "1.35.2", "v1.13.2", "v0.27.4"),
    (12, 7, "1.35.4", "v1.13.2", "v0.27.4"),
    (12, 8, "1.35.4", "v1.14.3", "v0.27.4"),
    (12, 9, "1.35.4", "v1.14.2", "v0.27.4"),
    (13, 0, "1.36.0", "v1.14.2", "v0.28.4"),
    (13, 3, "1.36.1", "v1.14.2", "v0.28.4"),
    (13, 4, "1.36.1", "v1.14.2", "v0.28.5"),
    (13, 5, "1.36.2", "v1.14.2", "v0.28.5"),
    (13, 7, "1.36.2", "v1.14.4", "v0.28.7"),
    (13, 8, "1.36.2", "v1.14.6", "v0.28.8"),
    (13, 9, "1.36.3", "v1.14.6", "v0.28.8"),
    (14, 0, "1.37.0-rc.0", "v1.14.6", "v0.28.9"),
];

struct Defaults {
    kubernetes: &'static str,
    coredns: &'static str,
    flannel: &'static str,
}

/// The defaults of `talos` (below v1.9.0: v1.9.0's; past the table: its last).
fn defaults(talos: &Talos) -> Defaults {
    let at = (talos.minor, talos.patch);
    let row = DEFAULTS
        .iter()
        .rev()
        .find(|(minor, patch, ..)| (*minor, *patch) <= at)
        .unwrap_or(&DEFAULTS[0]);
    Defaults {
        kubernetes: row.2,
        coredns: row.3,
        flannel: row.4,
    }
}

/// A non-empty string at `v`.
fn named(v: &Value) -> Option<String> {
    v.as_str().filter(|s| !s.is_empty()).map(str::to_owned)
}

/// The image `component` runs per `config` (a v1alpha1 document).
pub(crate) fn image_of(component: Component, config: &Value, talos: &Talos) -> String {
    let (top, section, repo) = component.source();
    named(&config[top][section]["image"])
        .unwrap_or_else(|| format!("{repo}:v{}", defaults(talos).kubernetes))
}

/// `cluster.proxy.image` (`v1alpha1_proxyconfig.go`).
pub(crate) fn proxy_image(config: &Value, talos: &Talos) -> String {
    named(&config["cluster"]["proxy"]["image"])
        .unwrap_or_else(|| format!("registry.k8s.io/kube-proxy:v{}", defaults(talos).kubernetes))
}

/// `cluster.coreDNS.image` (`v1alpha1_provider.go` `CoreDNS.Image`): the
/// default follows the Talos release, not the Kubernetes version.
pub(crate) fn coredns_image(config: &Value, talos: &Talos) -> String {
    named(&config["cluster"]["coreDNS"]["image"]).unwrap_or_else(|| {
        format!(
            "registry.k8s.io/coredns/coredns:{}",
            defaults(talos).coredns
        )
    })
}

/// `images.Flannel` (`pkg/images/list.go`): not configurable.
pub(crate) fn flannel_image(talos: &Talos) -> String {
    format!("ghcr.io/siderolabs/flannel:{}", defaults(talos).flannel)
}

/// A Kubernetes version `MAJOR.MINOR.PATCH` (pre-release ignored).
pub(crate) type Version = (u64, u64, u64);

/// `KubernetesVersionFromImageRef`: the text after the last `:v` (up to an
/// `@digest`), parsed tolerantly as semver.
pub(crate) fn version_of_image(image: &str) -> Result<Version, String> {
    let at = image
        .rfind(":v")
        .ok_or_else(|| format!("invalid image reference: {image:?}"))?;
    let text = &image[at + 2..];
    let text = text.split('@').next().unwrap_or(text);
    parse(text).ok_or_else(|| format!("invalid semantic version {text:?}"))
}

/// `1.33.5`, `1.33`, `1.33.5-fat` → (1, 33, 5).
pub(crate) fn parse(text: &str) -> Option<Version> {
    let core = text.trim_start_matches('v').split(['-', '+']).next()?;
    let mut parts = core.split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next().map_or(Some(0), |p| p.parse().ok())?;
    let patch = parts.next().map_or(Some(0), |p| p.parse().ok())?;
    parts.next().is_none().then_some((major, minor, patch))
}

/// The `vMAJOR.MINOR.PATCH` a Node reports for its kubelet image.
pub(crate) fn kubelet_version(image: &str) -> String {
    match version_of_image(image) {
        Ok((a, b, c)) => format!("v{a}.{b}.{c}"),
        Err(_) => "v0.0.0-unknown".into(),
    }
}

/// `SupportedWith`: Kubernetes `v` against the running Talos minor's
/// bounds (`talos1NN.go`: minimum inclusive, maximum `1.N.99` exclusive).
pub(crate) fn supported_with(v: Version, talos: &Talos) -> Result<(), String> {
    let (min, max) = match (talos.major, talos.minor) {
        (1, 9) => ((1, 27, 0), (1, 32, 99)),
        (1, 10) => ((1, 28, 0), (1, 33, 99)),
        (1, 11) => ((1, 29, 0), (1, 34, 99)),
        (1, 12) => ((1, 30, 0), (1, 35, 99)),
        (1, 13) => ((1, 31, 0), (1, 36, 99)),
        (1, 14) => ((1, 32, 0), (1, 37, 99)),
        _ => {
            return Err(format!(
                "compatibility with version {}.{}.{} is not supported",
                talos.major, talos.minor, talos.patch
            ));
        }
    };
    let (k, t) = (
        format!("{}.{}.{}", v.0, v.1, v.2),
        format!("{}.{}.{}", talos.major, talos.minor, talos.patch),
    );
    if v < min {
        return Err(format!(
            "version of Kubernetes {k} is too old to be used with Talos {t}"
        ));
    }
    if v >= max {
        return Err(format!(
            "version of Kubernetes {k} is too new to be used with Talos {t}"
        ));
    }
    Ok(())
}

/// `RuntimeValidate`'s image checks on a node running `talos`: the kubelet
/// image on every node, the three control-plane images on a control plane;
/// from v1.11.0 only (v1.9 and v1.10 do not check). The errors as
/// hashicorp/go-multierror formats them.
pub(crate) fn runtime_validate(talos: &Talos, config: &Value) -> Result<(), Status> {
    if (talos.major, talos.minor) < (1, 11) {
        return Ok(());
    }
    let mut checked = vec![("kubelet", Component::Kubelet)];
    if config["machine"]["type"].as_str() == Some("controlplane") {
        checked.extend(Component::CONTROL_PLANE.map(|c| (c.id(), c)));
    }
    let errors: Vec<String> = checked
        .into_iter()
        .filter_map(|(name, c)| {
            let image = image_of(c, config, talos);
            let why = match version_of_image(&image) {
                Ok(v) => supported_with(v, talos).err()?,
                Err(e) => format!(
                    "failed to parse Kubernetes version from image reference {image:?}: {e}"
                ),
            };
            Some(format!("{name} image is not valid: {why}"))
        })
        .collect();
    match errors.len() {
        0 => Ok(()),
        1 => Err(Status::invalid_argument(format!(
            "1 error occurred:\n\t* {}\n\n",
            errors[0]
        ))),
        n => Err(Status::invalid_argument(format!(
            "{n} errors occurred:\n\t* {}\n\n",
            errors.join("\n\t* ")
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn talos(tag: &str) -> Talos {
        Talos::parse(tag).unwrap()
    }

    #[test]
    fn images_come_from_the_config_else_the_releases_defaults() {
        let cfg = json!({"machine": {"type": "controlplane", "kubelet": {"image": "ghcr.io/siderolabs/kubelet:v1.32.1"}},
            "cluster": {"apiServer": {"image": "registry.k8s.io/kube-apiserver:v1.32.1"}, "scheduler": {"image": ""}}});
        let t = talos("v1.11.5");
        assert_eq!(
            image_of(Component::Kubelet, &cfg, &t),
            "ghcr.io/siderolabs/kubelet:v1.32.1"
        );
        assert_eq!(
            image_of(Component::ApiServer, &cfg, &t),
            "registry.k8s.io/kube-apiserver:v1.32.1"
        );
        assert_eq!(
            image_of(Component::Scheduler, &cfg, &t),
            "registry.k8s.io/kube-scheduler:v1.34.1"
        );
        assert_eq!(
            coredns_image(&cfg, &talos("v1.12.9")),
            "registry.k8s.io/coredns/coredns:v1.14.2"
        );
        assert_eq!(
            proxy_image(&cfg, &talos("v1.13.5")),
            "registry.k8s.io/kube-proxy:v1.36.2"
        );
        // Patch releases moved the defaults.
        assert_eq!(
            coredns_image(&cfg, &talos("v1.11.2")),
            "registry.k8s.io/coredns/coredns:v1.12.3"
        );
        assert_eq!(
            coredns_image(&cfg, &talos("v1.12.8")),
            "registry.k8s.io/coredns/coredns:v1.14.3"
        );
        assert_eq!(
            flannel_image(&talos("v1.10.9")),
            "ghcr.io/siderolabs/flannel:v0.26.7"
        );
    }

    #[test]
    fn versions_come_from_the_last_v_tag() {
        assert_eq!(
            version_of_image("ghcr.io/siderolabs/kubelet:v1.33.5-fat"),
            Ok((1, 33, 5))
        );
        assert_eq!(
            version_of_image("reg:5000/kube-apiserver:v1.32.1@sha256:ab"),
            Ok((1, 32, 1))
        );
        assert!(version_of_image("kube-apiserver:latest").is_err());
        assert_eq!(
            kubelet_version("ghcr.io/siderolabs/kubelet:v1.33.5"),
            "v1.33.5"
        );
    }

    #[test]
    fn talos_1_11_runs_kubernetes_1_29_to_1_34() {
        let t = talos("v1.11.5");
        assert!(supported_with((1, 29, 0), &t).is_ok());
        assert!(supported_with((1, 34, 7), &t).is_ok());
        assert_eq!(
            supported_with((1, 35, 0), &t).unwrap_err(),
            "version of Kubernetes 1.35.0 is too new to be used with Talos 1.11.5"
        );
        assert_eq!(
            supported_with((1, 28, 9), &t).unwrap_err(),
            "version of Kubernetes 1.28.9 is too old to be used with Talos 1.11.5"
        );
        assert!(supported_with((1, 35, 0), &talos("v1.12.9")).is_ok());
    }

    #[test]
    fn apply_refuses_a_kubelet_the_node_cannot_run_from_v1_11() {
        let cfg = json!({"machine": {"type": "worker", "kubelet": {"image": "ghcr.io/siderolabs/kubelet:v1.35.0"}}});
        let e = runtime_validate(&talos("v1.11.5"), &cfg).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert_eq!(
            e.message(),
            "1 error occurred:\n\t* kubelet image is not valid: version of Kubernetes 1.35.0 is too new to be used with Talos 1.11.5\n\n"
        );
        assert!(
            runtime_validate(&talos("v1.10.9"), &cfg).is_ok(),
            "no check before v1.11"
        );
        assert!(runtime_validate(&talos("v1.12.9"), &cfg).is_ok());
        // A control plane's three images are checked too.
        let cp = json!({"machine": {"type": "controlplane", "kubelet": {"image": "ghcr.io/siderolabs/kubelet:v1.34.1"}},
            "cluster": {"apiServer": {"image": "registry.k8s.io/kube-apiserver:v1.35.0"},
                "controllerManager": {"image": "registry.k8s.io/kube-controller-manager:v1.35.0"},
                "scheduler": {"image": "registry.k8s.io/kube-scheduler:v1.34.1"}}});
        let e = runtime_validate(&talos("v1.11.5"), &cp).unwrap_err();
        assert!(
            e.message()
                .starts_with("2 errors occurred:\n\t* kube-apiserver image is not valid"),
            "{}",
            e.message()
        );
    }
}
