//! The API versions a Kubernetes minor stops serving, and what in a cluster
//! still depends on them: clients that asked for one (the API server's
//! `apiserver_requested_deprecated_apis` gauge, one series per group,
//! version, resource and subresource requested since the server started,
//! labelled with `removed_release`; kubernetes/kubernetes
//! `staging/src/k8s.io/apiserver/pkg/endpoints/deprecation/` and
//! `pkg/endpoints/metrics/metrics.go`), and objects kept only under one
//! (an alpha API with no successor: listing it is what talosctl does,
//! siderolabs/go-kubernetes `kubernetes/upgrade/checks.go`,
//! `PopulateRemovedAPIResources`).
//!
//! The table is the Deprecated API Migration Guide
//! (kubernetes/website `content/en/docs/reference/using-api/deprecation-guide.md`,
//! "Removed APIs by release", v1.25 to v1.32; it lists no removal after
//! v1.32) plus the alpha removals talosctl checks (go-kubernetes
//! `kubernetes/upgrade/checks.go`: v1.29, v1.32, v1.37). Objects of an API
//! with a served successor are readable there after the upgrade, so only
//! requests count for them.

/// One API version of one resource that a Kubernetes minor stops serving.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemovedApi {
    pub group: &'static str,
    pub version: &'static str,
    pub resource: &'static str,
    /// The minor of Kubernetes 1.x that no longer serves it.
    pub removed_in: u32,
    /// The API version that serves the same objects, where there is one.
    pub successor: Option<&'static str>,
}

impl RemovedApi {
    /// `flowschemas.v1beta3.flowcontrol.apiserver.k8s.io`, as talosctl and
    /// `kubectl get` spell a resource at a version.
    pub fn name(&self) -> String {
        resource_name(self.group, self.version, self.resource)
    }

    /// The API path that lists it.
    pub fn list_path(&self) -> String {
        if self.group.is_empty() {
            format!("/api/{}/{}", self.version, self.resource)
        } else {
            format!("/apis/{}/{}/{}", self.group, self.version, self.resource)
        }
    }
}

fn resource_name(group: &str, version: &str, resource: &str) -> String {
    if group.is_empty() {
        format!("{resource}.{version}")
    } else {
        format!("{resource}.{version}.{group}")
    }
}

const fn gone(
    removed_in: u32,
    group: &'static str,
    version: &'static str,
    resource: &'static str,
    successor: Option<&'static str>,
) -> RemovedApi {
    RemovedApi {
        group,
        version,
        resource,
        removed_in,
        successor,
    }
}

const V1: Option<&str> = Some("v1");

/// Every removal from Kubernetes 1.25 on, oldest first.
pub const REMOVED: &[RemovedApi] = &[
    gone(25, "batch", "v1beta1", "cronjobs", V1),
    gone(25, "discovery.k8s.io", "v1beta1", "endpointslices", V1),
    gone(25, "events.k8s.io", "v1beta1", "events", V1),
    gone(
        25,
        "autoscaling",
        "v2beta1",
        "horizontalpodautoscalers",
        Some("v2"),
    ),
    gone(25, "policy", "v1beta1", "poddisruptionbudgets", V1),
    // PodSecurityPolicy has no successor: admission is Pod Security now.
    gone(25, "policy", "v1beta1", "podsecuritypolicies", None),
    gone(25, "node.k8s.io", "v1beta1", "runtimeclasses", V1),
    gone(
        26,
        "flowcontrol.apiserver.k8s.io",
        "v1beta1",
        "flowschemas",
        V1,
    ),
    gone(
        26,
        "flowcontrol.apiserver.k8s.io",
        "v1beta1",
        "prioritylevelconfigurations",
        V1,
    ),
    gone(
        26,
        "autoscaling",
        "v2beta2",
        "horizontalpodautoscalers",
        Some("v2"),
    ),
    gone(27, "storage.k8s.io", "v1beta1", "csistoragecapacities", V1),
    gone(
        29,
        "flowcontrol.apiserver.k8s.io",
        "v1beta2",
        "flowschemas",
        V1,
    ),
    gone(
        29,
        "flowcontrol.apiserver.k8s.io",
        "v1beta2",
        "prioritylevelconfigurations",
        V1,
    ),
    gone(29, "networking.k8s.io", "v1alpha1", "clustercidrs", None),
    gone(
        32,
        "flowcontrol.apiserver.k8s.io",
        "v1beta3",
        "flowschemas",
        V1,
    ),
    gone(
        32,
        "flowcontrol.apiserver.k8s.io",
        "v1beta3",
        "prioritylevelconfigurations",
        V1,
    ),
    gone(
        32,
        "resource.k8s.io",
        "v1alpha3",
        "podschedulingcontexts",
        None,
    ),
    gone(37, "scheduling.k8s.io", "v1alpha2", "workloads", None),
    gone(37, "scheduling.k8s.io", "v1alpha2", "podgroups", None),
];

/// What moving from minor `from` to minor `to` stops serving: removals in
/// `from+1 ..= to`.
pub fn removed_by(from: u32, to: u32) -> Vec<RemovedApi> {
    REMOVED
        .iter()
        .filter(|r| r.removed_in > from && r.removed_in <= to)
        .copied()
        .collect()
}

/// One series of `apiserver_requested_deprecated_apis`.
#[derive(Debug, Clone, PartialEq)]
pub struct Requested {
    pub group: String,
    pub version: String,
    pub resource: String,
    pub subresource: String,
    /// `1.32`, or empty when the server does not know yet.
    pub removed_release: String,
    pub value: f64,
}

impl Requested {
    pub fn name(&self) -> String {
        let base = resource_name(&self.group, &self.version, &self.resource);
        if self.subresource.is_empty() {
            base
        } else {
            format!("{base}/{}", self.subresource)
        }
    }
}

const METRIC: &str = "apiserver_requested_deprecated_apis";

/// The metric's series in a Prometheus text exposition (`GET /metrics`).
/// Lines that are not its samples, or that do not parse, are skipped.
pub fn parse_metric(text: &str) -> Vec<Requested> {
    text.lines().filter_map(sample).collect()
}

fn sample(line: &str) -> Option<Requested> {
    let rest = line.trim().strip_prefix(METRIC)?.strip_prefix('{')?;
    let (labels, value) = labels(rest)?;
    let value: f64 = value.split_whitespace().next()?.parse().ok()?;
    let get = |k: &str| {
        labels
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    Some(Requested {
        group: get("group"),
        version: get("version"),
        resource: get("resource"),
        subresource: get("subresource"),
        removed_release: get("removed_release"),
        value,
    })
}

/// `name="value",…}` and what follows the closing brace. Values may
/// escape `\"`, `\\` and `\n` (the text format's rules).
fn labels(mut s: &str) -> Option<(Vec<(String, String)>, &str)> {
    let mut out = Vec::new();
    loop {
        s = s.trim_start_matches([',', ' ']);
        if let Some(rest) = s.strip_prefix('}') {
            return Some((out, rest));
        }
        let (name, rest) = s.split_once('=')?;
        let mut chars = rest.strip_prefix('"')?.char_indices();
        let mut value = String::new();
        let end = loop {
            match chars.next()? {
                (i, '"') => break i,
                (_, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    c => value.push(c),
                },
                (_, c) => value.push(c),
            }
        };
        out.push((name.trim().to_owned(), value));
        s = &rest[1 + end + 1..];
    }
}

/// What still depends on an API the target stops serving.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Finding {
    /// `flowschemas.v1beta3.flowcontrol.apiserver.k8s.io`.
    pub resource: String,
    /// `1.32`.
    pub removed_in: String,
    /// `requested` (a client asked for it since the API server started)
    /// or `stored` (objects kept only under it).
    pub why: &'static str,
    /// Where it was seen: the API server(s), or how many objects.
    pub detail: String,
}

/// The findings that refuse an upgrade from minor `from` to minor `to`:
/// each requested series the metric says is removed by then (by its own
/// `removed_release`, or by the table), and each stored count. `requested`
/// pairs a series with the API server that reported it.
pub fn findings(
    from: u32,
    to: u32,
    requested: &[(String, Requested)],
    stored: &[(RemovedApi, u64)],
) -> Vec<Finding> {
    let table = removed_by(from, to);
    let mut out: Vec<Finding> = Vec::new();
    for (server, r) in requested.iter().filter(|(_, r)| r.value > 0.0) {
        let by_label = r
            .removed_release
            .split_once('.')
            .and_then(|(maj, min)| Some((maj.parse::<u32>().ok()?, min.parse::<u32>().ok()?)))
            .filter(|(maj, min)| *maj == 1 && *min > from && *min <= to)
            .map(|(_, min)| min);
        let by_table = table
            .iter()
            .find(|t| t.group == r.group && t.version == r.version && t.resource == r.resource)
            .map(|t| t.removed_in);
        let Some(minor) = by_label.or(by_table) else {
            continue;
        };
        let resource = r.name();
        match out
            .iter_mut()
            .find(|f| f.why == "requested" && f.resource == resource)
        {
            Some(f) => {
                f.detail.push_str(", ");
                f.detail.push_str(server);
            }
            None => out.push(Finding {
                resource,
                removed_in: format!("1.{minor}"),
                why: "requested",
                detail: format!("requested from {server}"),
            }),
        }
    }
    for (api, count) in stored.iter().filter(|(_, n)| *n > 0) {
        out.push(Finding {
            resource: api.name(),
            removed_in: format!("1.{}", api.removed_in),
            why: "stored",
            detail: format!("{count} object(s) stored"),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const METRICS: &str = r#"# HELP apiserver_requested_deprecated_apis [STABLE] Gauge of deprecated APIs that have been requested, broken out by API group, version, resource, subresource, and removed_release.
# TYPE apiserver_requested_deprecated_apis gauge
apiserver_requested_deprecated_apis{group="flowcontrol.apiserver.k8s.io",removed_release="1.32",resource="flowschemas",subresource="",version="v1beta3"} 1
apiserver_requested_deprecated_apis{group="",removed_release="",resource="componentstatuses",subresource="",version="v1"} 1
apiserver_requested_deprecated_apis{group="x.io",removed_release="1.40",resource="we\"ird",subresource="status",version="v1"} 1
apiserver_request_total{code="200"} 5
"#;

    #[test]
    fn the_metric_is_read_series_by_series() {
        let got = parse_metric(METRICS);
        assert_eq!(got.len(), 3);
        assert_eq!(
            got[0].name(),
            "flowschemas.v1beta3.flowcontrol.apiserver.k8s.io"
        );
        assert_eq!(got[0].removed_release, "1.32");
        assert_eq!(got[1].name(), "componentstatuses.v1");
        assert_eq!(got[2].resource, "we\"ird");
        assert_eq!(got[2].name(), "we\"ird.v1.x.io/status");
        assert!(parse_metric("apiserver_requested_deprecated_apis{group=\"a\" 1").is_empty());
        assert!(parse_metric("apiserver_requested_deprecated_apis{group=\"a\"} x").is_empty());
    }

    #[test]
    fn only_what_the_target_removes_refuses() {
        let req: Vec<(String, Requested)> = parse_metric(METRICS)
            .into_iter()
            .map(|r| ("cp-01".to_owned(), r))
            .collect();
        let f = findings(31, 32, &req, &[]);
        assert_eq!(f.len(), 1, "{f:?}");
        assert_eq!(
            f[0].resource,
            "flowschemas.v1beta3.flowcontrol.apiserver.k8s.io"
        );
        assert_eq!(f[0].removed_in, "1.32");
        assert_eq!(f[0].detail, "requested from cp-01");
        assert!(findings(32, 33, &req, &[]).is_empty(), "gone already");
        assert!(findings(30, 31, &req, &[]).is_empty(), "not yet");
        let two: Vec<(String, Requested)> = ["cp-01", "cp-02"]
            .iter()
            .map(|s| (s.to_string(), req[0].1.clone()))
            .collect();
        assert_eq!(
            findings(31, 32, &two, &[])[0].detail,
            "requested from cp-01, cp-02"
        );
    }

    #[test]
    fn the_table_answers_where_the_label_is_empty_and_zero_is_no_request() {
        let mut r = parse_metric(METRICS).remove(0);
        r.removed_release.clear();
        let f = findings(31, 32, &[("cp-01".into(), r.clone())], &[]);
        assert_eq!(f.len(), 1);
        r.value = 0.0;
        assert!(findings(31, 32, &[("cp-01".into(), r)], &[]).is_empty());
    }

    #[test]
    fn stored_objects_of_an_api_without_successor_refuse() {
        let pods = removed_by(31, 32)
            .into_iter()
            .find(|r| r.resource == "podschedulingcontexts")
            .unwrap();
        assert_eq!(pods.successor, None);
        assert_eq!(
            pods.list_path(),
            "/apis/resource.k8s.io/v1alpha3/podschedulingcontexts"
        );
        let f = findings(31, 32, &[], &[(pods, 2), (pods, 0)]);
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].why, "stored");
        assert_eq!(f[0].detail, "2 object(s) stored");
    }

    #[test]
    fn removals_are_taken_from_the_minors_crossed() {
        let names = |from, to| -> Vec<String> {
            removed_by(from, to).iter().map(RemovedApi::name).collect()
        };
        assert!(names(32, 33).is_empty());
        assert_eq!(names(28, 29).len(), 3);
        assert!(names(31, 32).contains(
            &"prioritylevelconfigurations.v1beta3.flowcontrol.apiserver.k8s.io".to_owned()
        ));
        assert_eq!(names(24, 25).len(), 7);
        for w in REMOVED.windows(2) {
            assert!(w[0].removed_in <= w[1].removed_in, "oldest first");
        }
    }
}
