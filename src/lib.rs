//! imgbuild: per-node Talos Linux images from one cluster inventory.
//!
//! Data flows one way: [`inventory`] → [`schematic`] → [`build`] (over
//! [`factory`], [`fetch`] and [`disk`]) → publish → bootstrap.

pub mod atomic;
pub mod boot;
pub mod bootscript;
pub mod build;
pub mod digest;
pub mod disk;
pub mod factory;
pub mod fetch;
pub mod import;
pub mod input;
pub mod inventory;
pub mod io;
pub mod iso;
pub mod matrix;
pub mod meta;
pub mod net;
pub mod publish;
pub mod schematic;
pub mod secrets;
pub mod talos;
pub mod up;

/// How many cases each `fuzz_*` property test runs: 256 in `make test`,
/// `IMGBUILD_FUZZ_CASES` (set by `make fuzz`) when longer runs are wanted.
#[cfg(test)]
pub(crate) fn fuzz_config() -> proptest::prelude::ProptestConfig {
    let cases = std::env::var("IMGBUILD_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    proptest::prelude::ProptestConfig::with_cases(cases)
}

/// Whether the calling fuzz test may run another case: `IMGBUILD_FUZZ_SECS`
/// (set by `make fuzz`) bounds each test's time from its first case on;
/// the cases after that pass without running. Unbounded when unset.
#[cfg(test)]
pub(crate) fn fuzz_time_left() -> bool {
    thread_local!(static START: std::time::Instant = std::time::Instant::now());
    let budget = std::env::var("IMGBUILD_FUZZ_SECS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok());
    budget.is_none_or(|secs| START.with(|t| t.elapsed().as_secs() < secs))
}
