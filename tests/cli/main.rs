//! The command line as users and scripts meet it: exit codes, progress, install, the CI matrix, hostile input and output.
//!
//! One test binary per feature (issue 40): each file here is a module, the
//! helpers in `tests/common/` are shared by every binary.
// A test's stderr is libtest's to capture, not the CLI's one writer.
#![allow(clippy::disallowed_macros)]

#[path = "../common/mod.rs"]
mod common;

mod action_download;
mod ci_matrix;
mod cleanup_dry_run;
mod completion_nodes;
mod debug;
mod exit;
mod hostile_input;
mod hostile_output;
mod hostile_state;
mod hostile_streams;
mod install;
mod man_pages;
mod output_markdown;
mod output_yaml;
mod progress;
