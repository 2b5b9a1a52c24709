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

/// One change to an image's META: a key and its new value, `None`
/// removing it (the form `disk::edit` applies).
pub type Change = (u32, Option<Vec<u8>>);

/// The change that gives a node its network: key 10 set to `network`, the
/// [`PlatformNetworkConfig`] YAML the metal platform reads at boot. Off
/// metal nothing reads key 10, so a node there gets no such change.
pub fn network_change(network: String) -> Change {
    (u32::from(KEY_NETWORK), Some(network.into_bytes()))
}

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

#[cfg(test)]
mod tests {
    use super::*;

    /// Applied to META that already holds other keys and an old network,
    /// the change replaces key 10 in place and leaves the rest, and the
    /// metal platform reads the node's network back from the written bytes.
    #[test]
    fn the_network_change_replaces_key_10_only() {
        let plan = NetworkPlan {
            hostname: "worker-01".into(),
            link: Some("ens18".into()),
            mtu: None,
            address: Some(("10.0.0.21".parse().unwrap(), 24)),
            gateway: Some("10.0.0.1".parse().unwrap()),
            nameservers: vec!["1.1.1.1".parse().unwrap()],
            search_domains: Vec::new(),
            time_servers: Vec::new(),
        };
        let network = PlatformNetworkConfig::from_plan(&plan);
        let mut adv = Adv::default();
        adv.set(12, b"user".to_vec()).unwrap();
        adv.set(u32::from(KEY_NETWORK), b"hostnames: []\n".to_vec())
            .unwrap();
        adv.set(15, b"uuid".to_vec()).unwrap();
        let (key, value) = network_change(network.to_yaml());
        assert_eq!(key, 10);
        adv.set(key, value.expect("a network is set, not removed"))
            .unwrap();
        let written = Adv::decode(&adv.encode().unwrap()).adv;
        let keys: Vec<u32> = written.iter().map(|(k, _)| k).collect();
        assert_eq!(keys, [10, 12, 15], "one key 10, the others kept");
        assert_eq!(written.get(12), Some(&b"user"[..]));
        let read = std::str::from_utf8(written.get(10).unwrap()).unwrap();
        let read = PlatformNetworkConfig::from_yaml(read).unwrap();
        assert_eq!(read, network);
        assert_eq!(read.hostnames[0].hostname, "worker-01");
        assert_eq!(read.addresses[0].address, "10.0.0.21/24");
    }
}
