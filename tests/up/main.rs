//! `imgbuild up`: the whole pipeline, reconciling with the inventory, and the plan that is the run.
//!
//! One test binary per feature (issue 40): each file here is a module, the
//! helpers in `tests/common/` are shared by every binary.
// A test's stderr is libtest's to capture, not the CLI's one writer.
#![allow(clippy::disallowed_macros)]

#[path = "../common/mod.rs"]
mod common;

mod ci_workflows;
mod fresh_clone;
mod fresh_state;
mod plan_is_run;
mod reconcile;
mod up;
