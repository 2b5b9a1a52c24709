//! The inventory as every command reads it: `--factory` applied, warnings
//! shown once on stderr.

use super::output::Output;
use super::progress::paint;
use anyhow::Result;
use imgbuild::inventory::Inventory;
use std::path::Path;

/// `--factory` (or `IMGBUILD_FACTORY`), set once before any command runs:
/// every command that reads the inventory must see the same factory, or a
/// config would name an installer on a factory the images never came from.
static FACTORY: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();

/// Fixes `--factory` for the rest of the process (the first call wins).
pub fn set_factory(url: Option<String>) {
    let _ = FACTORY.set(url);
}

/// Loads the inventory, with `--factory` in place of `image.factory`, and
/// shows its warnings on stderr.
pub fn load_inventory(path: &Path, output: Output) -> Result<Inventory> {
    let mut inv = Inventory::load(path)?;
    if let Some(Some(url)) = FACTORY.get() {
        inv.image.factory.clone_from(url);
    }
    if output == Output::Text {
        for w in &inv.warnings {
            super::output::stderr_line(&paint("warning:", "33"), &w.to_string());
        }
    }
    super::guard::inventory(&inv);
    Ok(inv)
}
