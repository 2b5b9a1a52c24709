//! `imgbuild import talhelper`: a talhelper talconfig.yaml as a cluster.yaml.

use super::Output;
use anyhow::Result;
use clap::Args;

#[derive(Args)]
pub struct ImportArgs {}

pub fn run(_args: ImportArgs, _output: Output) -> Result<()> {
    anyhow::bail!("not yet")
}
