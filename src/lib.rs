//! imgbuild: per-node Talos Linux images from one cluster inventory.
//!
//! Data flows one way: [`inventory`] → [`schematic`] → build → publish → bootstrap.

pub mod atomic;
pub mod disk;
pub mod inventory;
pub mod meta;
pub mod schematic;
