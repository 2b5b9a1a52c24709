//! Which Kubernetes versions a Talos minor runs, and which version moves
//! Kubernetes may make, decided before any change.
//!
//! The ranges are Talos's own (siderolabs/talos
//! `pkg/machinery/compatibility/talos1NN/talos1NN.go`,
//! `MinimumKubernetesVersion` and `MaximumKubernetesVersion`, the same in
//! every release tag of a minor: v1.9.0–v1.9.6, v1.10.0–v1.10.9,
//! v1.11.0–v1.11.6, v1.12.0–v1.12.11, v1.13.0–v1.13.9, v1.14.0-rc.1), compared
//! as `KubernetesVersion.SupportedWith` in `kubernetes_version.go` does: too
//! old below the minimum, too new at or above the maximum (`1.34.99`).
//!
//! The minor rule is Kubernetes's version skew policy as talosctl enforces it
//! (siderolabs/go-kubernetes `kubernetes/upgrade/path.go`, `IsSupported`:
//! `1.N->1.N` and `1.N->1.N+1` only): a component moves within its minor or
//! to the next one. A larger jump is refused, naming the minor to go to
//! first; so is a move to an older minor.

use crate::inventory::parse_version;

/// A version as `(major, minor, patch)`.
pub type Version = (u32, u32, u32);

/// One Talos minor's Kubernetes range: `min <= k8s < max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    pub talos_minor: u32,
    pub min: Version,
    pub max: Version,
}

/// Talos v1.9 to v1.14, from the files named in the module comment.
pub const TABLE: [Range; 6] = [
    Range {
        talos_minor: 9,
        min: (1, 27, 0),
        max: (1, 32, 99),
    },
    Range {
        talos_minor: 10,
        min: (1, 28, 0),
        max: (1, 33, 99),
    },
    Range {
        talos_minor: 11,
        min: (1, 29, 0),
        max: (1, 34, 99),
    },
    Range {
        talos_minor: 12,
        min: (1, 30, 0),
        max: (1, 35, 99),
    },
    Range {
        talos_minor: 13,
        min: (1, 31, 0),
        max: (1, 36, 99),
    },
    Range {
        talos_minor: 14,
        min: (1, 32, 0),
        max: (1, 37, 99),
    },
];

impl Range {
    /// `1.29–1.34`, as the README's table shows it.
    pub fn minors(&self) -> String {
        format!(
            "{}.{}–{}.{}",
            self.min.0, self.min.1, self.max.0, self.max.1
        )
    }
}

/// Why Kubernetes `kubernetes` cannot run on Talos `talos`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CompatError {
    #[error("Kubernetes {kubernetes} is too old for Talos {talos}, which runs Kubernetes {range}")]
    TooOld {
        kubernetes: String,
        talos: String,
        range: String,
    },
    #[error("Kubernetes {kubernetes} is too new for Talos {talos}, which runs Kubernetes {range}")]
    TooNew {
        kubernetes: String,
        talos: String,
        range: String,
    },
    #[error("imgbuild knows no Kubernetes range for Talos {talos} (it knows Talos v1.9 to v1.14)")]
    UnknownTalos { talos: String },
    #[error("cannot read version {0:?}")]
    Unparsable(String),
}

/// The range of Talos `talos` (`v1.11.5`), if the table has its minor.
pub fn range_of(talos: Version) -> Option<Range> {
    (talos.0 == 1)
        .then(|| TABLE.iter().find(|r| r.talos_minor == talos.1).copied())
        .flatten()
}

/// Whether Talos `talos` runs Kubernetes `kubernetes` (either with or
/// without the leading `v`).
pub fn supported(talos: &str, kubernetes: &str) -> Result<(), CompatError> {
    let t = parse_version(talos, false).ok_or_else(|| CompatError::Unparsable(talos.into()))?;
    let k = parse_version(kubernetes, false)
        .ok_or_else(|| CompatError::Unparsable(kubernetes.into()))?;
    let range = range_of(t).ok_or_else(|| CompatError::UnknownTalos {
        talos: talos.into(),
    })?;
    let shown = || (tag(k), talos.to_owned(), range.minors());
    if k < range.min {
        let (kubernetes, talos, range) = shown();
        return Err(CompatError::TooOld {
            kubernetes,
            talos,
            range,
        });
    }
    if k >= range.max {
        let (kubernetes, talos, range) = shown();
        return Err(CompatError::TooNew {
            kubernetes,
            talos,
            range,
        });
    }
    Ok(())
}

/// `v1.33.5`.
pub fn tag(v: Version) -> String {
    format!("v{}.{}.{}", v.0, v.1, v.2)
}

/// Why a component may not move from one version to another.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SkewError {
    #[error(
        "{component} on {node} runs {from}; {to} skips Kubernetes 1.{next}: set kubernetesVersion to a v1.{next}.x first (Kubernetes upgrades one minor at a time)"
    )]
    SkipsMinor {
        component: String,
        node: String,
        from: String,
        to: String,
        next: u32,
    },
    #[error(
        "{component} on {node} runs {from}, a newer minor than {to}: imgbuild does not downgrade Kubernetes"
    )]
    Downgrade {
        component: String,
        node: String,
        from: String,
        to: String,
    },
}

/// Whether `component` on `node` may go from `from` to `to`: the same
/// minor (any patch), or the next minor.
pub fn step_allowed(
    component: &str,
    node: &str,
    from: Version,
    to: Version,
) -> Result<(), SkewError> {
    let err_from = || (component.to_owned(), node.to_owned(), tag(from), tag(to));
    if (from.0, from.1) > (to.0, to.1) {
        let (component, node, from, to) = err_from();
        return Err(SkewError::Downgrade {
            component,
            node,
            from,
            to,
        });
    }
    if from.0 != to.0 || to.1 > from.1 + 1 {
        let next = from.1 + 1;
        let (component, node, from, to) = err_from();
        return Err(SkewError::SkipsMinor {
            component,
            node,
            from,
            to,
            next,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_talos_minor_has_its_upstream_range() {
        let cases = [
            ("v1.9.5", "1.27.0", "1.32.98", "1.26.9", "1.32.99"),
            ("v1.10.7", "1.28.0", "1.33.5", "1.27.9", "1.34.0"),
            ("v1.11.2", "1.29.0", "1.34.1", "1.28.15", "1.35.0"),
            ("v1.12.4", "1.30.0", "1.35.0", "1.29.9", "1.36.0"),
            ("v1.13.0", "1.31.0", "1.36.2", "1.30.14", "1.37.0"),
            ("v1.14.0", "1.32.0", "1.37.0", "1.31.9", "1.38.0"),
        ];
        for (talos, lowest, highest, too_old, too_new) in cases {
            assert_eq!(supported(talos, lowest), Ok(()), "{talos} {lowest}");
            assert_eq!(supported(talos, highest), Ok(()), "{talos} {highest}");
            assert!(
                matches!(supported(talos, too_old), Err(CompatError::TooOld { .. })),
                "{talos} {too_old}"
            );
            assert!(
                matches!(supported(talos, too_new), Err(CompatError::TooNew { .. })),
                "{talos} {too_new}"
            );
        }
    }

    #[test]
    fn a_refusal_names_both_versions_and_the_range() {
        let e = supported("v1.11.5", "v1.35.0").unwrap_err().to_string();
        assert_eq!(
            e,
            "Kubernetes v1.35.0 is too new for Talos v1.11.5, which runs Kubernetes 1.29–1.34"
        );
        let e = supported("v1.11.5", "1.28.3").unwrap_err().to_string();
        assert!(e.contains("v1.28.3 is too old for Talos v1.11.5"), "{e}");
    }

    #[test]
    fn talos_outside_the_table_is_refused_not_guessed() {
        for talos in ["v1.8.3", "v1.15.0", "v2.0.0"] {
            assert!(
                matches!(
                    supported(talos, "1.33.0"),
                    Err(CompatError::UnknownTalos { .. })
                ),
                "{talos}"
            );
        }
        assert!(matches!(
            supported("latest", "1.33.0"),
            Err(CompatError::Unparsable(_))
        ));
    }

    #[test]
    fn the_table_moves_one_minor_per_talos_minor() {
        for w in TABLE.windows(2) {
            assert_eq!(w[1].talos_minor, w[0].talos_minor + 1);
            assert_eq!(w[1].min.1, w[0].min.1 + 1);
            assert_eq!(w[1].max.1, w[0].max.1 + 1);
        }
        assert_eq!(range_of((1, 11, 3)).unwrap().minors(), "1.29–1.34");
    }

    #[test]
    fn components_move_within_a_minor_or_to_the_next() {
        let ok = [
            ((1, 32, 1), (1, 33, 5)),
            ((1, 33, 1), (1, 33, 5)),
            ((1, 33, 5), (1, 33, 1)),
            ((1, 33, 5), (1, 33, 5)),
        ];
        for (from, to) in ok {
            assert_eq!(step_allowed("kubelet", "w1", from, to), Ok(()), "{from:?}");
        }
        let e = step_allowed("kube-apiserver", "cp-01", (1, 32, 1), (1, 34, 0)).unwrap_err();
        assert!(matches!(e, SkewError::SkipsMinor { next: 33, .. }), "{e}");
        assert!(e.to_string().contains("v1.33.x first"), "{e}");
        let e = step_allowed("kubelet", "w1", (1, 33, 0), (1, 32, 9)).unwrap_err();
        assert!(matches!(e, SkewError::Downgrade { .. }), "{e}");
        assert!(matches!(
            step_allowed("kubelet", "w1", (1, 33, 0), (2, 0, 0)),
            Err(SkewError::SkipsMinor { .. })
        ));
    }
}
