//! Talos META: the small key-value partition a node reads at boot before it
//! has a machine config. Pure data and codecs, no I/O.

pub mod adv;
pub mod cmdline;
pub mod network;

pub use adv::{Adv, AdvError, Decoded, Source};
pub use cmdline::{
    CMDLINE_MAX, CmdlineError, ENVIRONMENT_PREFIX, decode_installer_meta, environment_arg,
    installer_meta_base64,
};
pub use network::{NetworkPlan, PlatformNetworkConfig};

/// META key 10: the metal platform's network configuration.
pub const KEY_NETWORK: u8 = 10;

/// The name Talos gives a META key, for display.
pub fn key_name(key: u32) -> Option<&'static str> {
    Some(match key {
        6 => "Upgrade",
        7 => "StagedUpgradeImageRef",
        8 => "StagedUpgradeInstallOptions",
        9 => "StateEncryptionConfig",
        10 => "MetalNetworkPlatformConfig",
        11 => "DownloadURLCode",
        12 => "UserReserved1",
        13 => "UserReserved2",
        14 => "UserReserved3",
        15 => "UUIDOverride",
        16 => "UniqueMachineToken",
        17 => "DiskImageBootloader",
        _ => return None,
    })
}
