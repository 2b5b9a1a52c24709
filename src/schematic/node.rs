//! Per-node schematics from the inventory: the cluster's and the node's
//! extensions and kernel arguments, plus the node's network in META key 10.

use super::{Customization, MetaValue, Schematic, SystemExtensions};
use crate::inventory::{Inventory, NodeSpec};
use crate::meta::{KEY_NETWORK, NetworkPlan, PlatformNetworkConfig};

/// The networking `node` should boot with, from the inventory.
pub fn network_plan(inv: &Inventory, node: &NodeSpec) -> NetworkPlan {
    let net = &inv.network;
    let address = if node.dhcp {
        None
    } else {
        node.address.zip(net.cidr.map(|c| c.prefix))
    };
    NetworkPlan {
        hostname: node.name.clone(),
        link: node.link_name(net),
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
pub fn base_for_node(inv: &Inventory, node: &NodeSpec) -> Schematic {
    let mut s = base(inv);
    let c = &mut s.customization;
    c.system_extensions
        .official_extensions
        .extend(node.extensions.iter().cloned());
    c.extra_kernel_args.extend(node.kernel_args.iter().cloned());
    s
}

/// The cluster-wide schematic: the image's extensions and kernel arguments only.
pub fn base(inv: &Inventory) -> Schematic {
    Schematic {
        customization: Customization {
            extra_kernel_args: inv.image.kernel_args.clone(),
            system_extensions: SystemExtensions {
                official_extensions: inv.image.extensions.clone(),
            },
            ..Default::default()
        },
        ..Default::default()
    }
}
