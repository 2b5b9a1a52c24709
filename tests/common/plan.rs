//! What `up` planned against what it did: the actions of two JSON reports
//! (a dry run's and a run's) compared as `up --plan` promises.

/// Each action of a JSON report's plan as one comparable line: step, kind,
/// node and the kind's typed values. A value the plan knew only as
/// `knownAfterApply` matches whatever the run made.
pub fn actions(v: &serde_json::Value) -> Vec<String> {
    v["plan"]
        .as_array()
        .unwrap_or_else(|| panic!("no plan in {v}"))
        .iter()
        .map(|a| {
            let mut kind = a["kind"].clone();
            if let Some(o) = kind.as_object_mut() {
                o.retain(|_, v| v != "knownAfterApply");
            }
            format!("{} {} {}", a["step"], a["node"], kind)
        })
        .collect()
}

/// The run did exactly what the dry run planned, in its order.
pub fn assert_plan_is_run(scenario: &str, planned: &serde_json::Value, run: &serde_json::Value) {
    let (p, r) = (actions(planned), actions(run));
    // knownAfterApply fields were dropped from the plan's side only: match
    // the run's line by prefix of the plan's known fields.
    let same = p.len() == r.len()
        && p.iter().zip(&r).all(|(p, r)| {
            let (pk, rk) = (p.split_once(" {"), r.split_once(" {"));
            match (pk, rk) {
                (Some((ph, pb)), Some((rh, rb))) => {
                    let pv: serde_json::Value = serde_json::from_str(&format!("{{{pb}")).unwrap();
                    let rv: serde_json::Value = serde_json::from_str(&format!("{{{rb}")).unwrap();
                    ph == rh
                        && pv
                            .as_object()
                            .unwrap()
                            .iter()
                            .all(|(k, v)| rv.get(k) == Some(v))
                }
                _ => p == r,
            }
        });
    assert!(
        same,
        "{scenario}: the run is not the plan\nplanned:\n  {}\nrun:\n  {}",
        p.join("\n  "),
        r.join("\n  ")
    );
}
