//! Per-node schematics from the inventory: the cluster's and the node's
//! extensions and kernel arguments, plus the node's network in META key 10.

use super::{Customization, MetaValue, Schematic, SecureBoot, SystemExtensions};
use crate::inventory::{Inventory, NodeSpec};
use crate::meta::{KEY_NETWORK, NetworkPlan, PlatformNetworkConfig};

/// The networking `node` should boot with, from the inventory. A DHCP node
/// names its link only by kernel name: the DHCP operator does not resolve
/// `enx…` altnames, and a `links[]` entry would switch off Talos' default
/// DHCP on that NIC, so a node known only by MAC is left to that default.
pub fn network_plan(inv: &Inventory, node: &NodeSpec) -> NetworkPlan {
    let net = &inv.network;
    let address = if node.dhcp {
        None
    } else {
        node.address.zip(net.cidr.map(|c| c.prefix))
    };
    NetworkPlan {
        hostname: node.name.clone(),
        link: if node.dhcp {
            node.kernel_link(net)
        } else {
            node.link_name(net)
        },
        mtu: net.mtu,
        address,
        gateway: net.gateway.filter(|_| address.is_some()),
        nameservers: net.nameservers.clone(),
        search_domains: net.search_domains.clone(),
        time_servers: net.time_servers.clone(),
    }
}

/// The META key 10 value for `node`: its network as Talos reads it. `None`
/// off the metal platform, which is the only one that reads key 10.
pub fn network_value(inv: &Inventory, node: &NodeSpec) -> Option<String> {
    (inv.image.platform == "metal")
        .then(|| PlatformNetworkConfig::from_plan(&network_plan(inv, node)).to_yaml())
}

/// The schematic of `node`'s own image. Only the metal platform reads key 10,
/// so on other platforms every node shares [`base_for_node`]'s schematic.
pub fn for_node(inv: &Inventory, node: &NodeSpec) -> Schematic {
    let mut s = base_for_node(inv, node);
    if let Some(value) = network_value(inv, node) {
        s.customization.meta.push(MetaValue {
            key: KEY_NETWORK,
            value,
        });
    }
    s
}

/// `node`'s schematic without META: what its patch-route base image is built from.
/// A Secure Boot node's carries the image's `secureboot` settings; Secure
/// Boot itself is not in the schematic but in the asset's name
/// (`…-secureboot.raw.xz`, `…-installer-secureboot`).
pub fn base_for_node(inv: &Inventory, node: &NodeSpec) -> Schematic {
    let mut s = base(inv);
    let c = &mut s.customization;
    c.secure_boot = if inv.secure_boot(node) {
        secure_boot(inv)
    } else {
        SecureBoot::default()
    };
    c.system_extensions
        .official_extensions
        .extend(node.extensions.iter().cloned());
    c.extra_kernel_args.extend(node.kernel_args.iter().cloned());
    s
}

/// The image's `customization.secureboot` (siderolabs/image-factory
/// `pkg/schematic/schematic.go` `SecureBootCustomization`; the factory
/// applies it to Secure Boot assets only, `internal/profile/profile.go`).
fn secure_boot(inv: &Inventory) -> SecureBoot {
    SecureBoot {
        enroll_keys: inv.image.enroll_keys.clone().unwrap_or_default(),
        include_well_known_certificates: inv.image.include_well_known_certificates,
    }
}

/// The cluster-wide schematic: the image's extensions and kernel arguments
/// (and its Secure Boot settings when the image is Secure Boot).
pub fn base(inv: &Inventory) -> Schematic {
    Schematic {
        customization: Customization {
            secure_boot: if inv.image.secure_boot {
                secure_boot(inv)
            } else {
                SecureBoot::default()
            },
            extra_kernel_args: inv.image.kernel_args.clone(),
            bootloader: inv.image.bootloader,
            system_extensions: SystemExtensions {
                official_extensions: inv.image.extensions.clone(),
            },
            ..Default::default()
        },
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::PlatformNetworkConfig;
    use std::path::Path;

    const ATLAS: &str = include_str!("../../examples/atlas/cluster.yaml");

    /// The atlas example with worker-01's `address` line replaced by `node`
    /// lines (and `cluster` changed by `cluster`); returns worker-01's key 10.
    fn worker_key10(node: &str, cluster: (&str, &str)) -> Result<PlatformNetworkConfig, String> {
        let text = ATLAS
            .replacen("    address: 10.0.0.21\n", node, 1)
            .replacen(cluster.0, cluster.1, 1);
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/atlas/cluster.yaml");
        let inv = Inventory::parse(&text, &path).map_err(|e| e.to_string())?;
        let node = inv.node("worker-01").unwrap();
        let yaml = network_value(&inv, node).unwrap();
        Ok(PlatformNetworkConfig::from_yaml(&yaml).unwrap())
    }

    const SAME: (&str, &str) = ("", "");

    #[test]
    fn a_dhcp_node_known_only_by_mac_leaves_dhcp_to_talos() {
        let cfg = worker_key10("    dhcp: true\n    mac: bc:24:11:00:00:21\n", SAME).unwrap();
        assert!(cfg.links.is_empty(), "{cfg:?}");
        assert!(cfg.operators.is_empty(), "{cfg:?}");
        assert!(cfg.addresses.is_empty() && cfg.routes.is_empty(), "{cfg:?}");
        assert_eq!(cfg.hostnames[0].hostname, "worker-01");
        assert_eq!(cfg.resolvers[0].dns_servers, ["1.1.1.1", "8.8.8.8"]);
    }

    #[test]
    fn a_dhcp_node_with_its_kernel_interface_gets_an_operator_on_it() {
        let cfg = worker_key10(
            "    dhcp: true\n    mac: bc:24:11:00:00:21\n    interface: ens18\n",
            SAME,
        )
        .unwrap();
        assert_eq!(cfg.operators.len(), 1, "{cfg:?}");
        assert_eq!(cfg.operators[0].operator, "dhcp4");
        assert_eq!(cfg.operators[0].link_name, "ens18");
        assert_eq!(cfg.links.len(), 1);
        assert_eq!(cfg.links[0].name, "ens18");
    }

    #[test]
    fn a_static_node_with_a_mac_uses_its_altname_everywhere() {
        let cfg =
            worker_key10("    address: 10.0.0.21\n    mac: BC:24:11:00:00:21\n", SAME).unwrap();
        assert_eq!(cfg.addresses[0].address, "10.0.0.21/16");
        assert_eq!(cfg.addresses[0].link_name, "enxbc2411000021");
        assert_eq!(cfg.routes[0].out_link_name, "enxbc2411000021");
        assert_eq!(cfg.links[0].name, "enxbc2411000021");
        assert!(cfg.operators.is_empty());
    }

    #[test]
    fn a_mac_link_name_before_talos_1_9_is_an_error_naming_the_node() {
        let err = worker_key10(
            "    address: 10.0.0.21\n    mac: bc:24:11:00:00:21\n",
            ("talosVersion: v1.11.2", "talosVersion: v1.8.3"),
        )
        .unwrap_err();
        let text = ATLAS.replacen(
            "    address: 10.0.0.21\n",
            "    address: 10.0.0.21\n    mac: bc:24:11:00:00:21\n",
            1,
        );
        let line = text.lines().position(|l| l.contains("mac:")).unwrap() + 1;
        assert!(
            err.contains(&format!("line {line}: nodes[3].mac: node worker-01:")),
            "{err}"
        );
        assert!(err.contains("v1.9") && err.contains("v1.8.3"), "{err}");
        // With the kernel name given, the MAC only pins the NIC: fine on 1.8.
        worker_key10(
            "    address: 10.0.0.21\n    mac: bc:24:11:00:00:21\n    interface: ens18\n",
            ("talosVersion: v1.11.2", "talosVersion: v1.8.3"),
        )
        .unwrap();
    }
}
