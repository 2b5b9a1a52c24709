//! Talos META: the small key-value partition a node reads at boot before it
//! has a machine config. Pure data and codecs, no I/O.

pub mod network;

pub use network::{NetworkPlan, PlatformNetworkConfig};

/// META key 10: the metal platform's network configuration.
pub const KEY_NETWORK: u8 = 10;
