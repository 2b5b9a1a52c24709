//! Installer image references: which installer a node's machine config
//! names, spelled from the inventory and the node's META-less schematic
//! alone. Pure, so configs, review files and upgrades agree on it without a
//! factory client.

use super::{EmitError, SchematicId, id_of};
use crate::inventory::{Inventory, NodeSpec, talos_at_least};

/// The installer `node`'s machine config installs and upgrades from: the
/// factory's installer for the node's schematic *without* META. The factory
/// bakes META only into disk images and ISOs, never into installers
/// (siderolabs/image-factory `internal/profile/profile.go`), and serves
/// installers only for schematics posted to it (`internal/registry/registry.go`
/// `handleManifest`), which on the patch route is the META-less one. Key 10
/// stays in the node's META partition across upgrades, so nothing is lost,
/// and nodes with the same extensions share one installer.
/// A Secure Boot node's is the Secure Boot installer, from its first boot
/// on: a node cannot be moved between the two by an upgrade
/// (siderolabs/talos#9245).
pub fn installer_for(inv: &Inventory, node: &NodeSpec) -> Result<String, EmitError> {
    let canonical = super::node::base_for_node(inv, node).canonical()?;
    Ok(installer_at(
        inv,
        &id_of(&canonical),
        &inv.cluster.talos_version,
        inv.secure_boot(node),
    ))
}

/// The installer of schematic `id` for `inv`'s factory, platform and Talos
/// version; the Secure Boot one when the image is Secure Boot.
pub fn installer_of(inv: &Inventory, id: &SchematicId) -> String {
    installer_at(inv, id, &inv.cluster.talos_version, inv.image.secure_boot)
}

/// The installer of schematic `id` at Talos `version` (an upgrade's hop).
pub fn installer_at(inv: &Inventory, id: &SchematicId, version: &str, secure_boot: bool) -> String {
    installer_ref(
        registry_host(&inv.image.factory),
        &inv.image.platform,
        id,
        version,
        secure_boot,
    )
}

/// The registry host of a factory URL: installer images are pulled from the
/// factory's own host and port, as the factory's UI prints them from its
/// external URL's `Host` (`https://factory.talos.dev/` → `factory.talos.dev`).
fn registry_host(factory: &str) -> &str {
    let rest = factory.split_once("://").map_or(factory, |(_, rest)| rest);
    let host = rest.split(['/', '?', '#']).next().unwrap_or(rest);
    // Never a user name or password into a machine config (validation
    // refuses them; this keeps any that slip through out of the reference).
    host.rsplit_once('@').map_or(host, |(_, h)| h)
}

/// The installer image for a schematic, spelled as the factory's own UI
/// gives it (siderolabs/image-factory `internal/frontend/http/ui.go`):
/// `<platform>-installer/<id>` from Talos v1.10 on, when installers became
/// per platform (`quirks.SupportsUnifiedInstaller`), `installer/<id>` before;
/// Secure Boot adds `-secureboot` to the image name (`installer-secureboot`,
/// `<platform>-installer-secureboot`), which the factory's registry reads
/// back as a Secure Boot request (`registry.go` `getRequestedImage`).
fn installer_ref(
    registry_host: &str,
    platform: &str,
    id: &SchematicId,
    version: &str,
    secure_boot: bool,
) -> String {
    let tag = format!("v{}", version.trim_start_matches('v'));
    let sb = if secure_boot { "-secureboot" } else { "" };
    if talos_at_least(version, (1, 10, 0)) {
        format!("{registry_host}/{platform}-installer{sb}/{id}:{tag}")
    } else {
        format!("{registry_host}/installer{sb}/{id}:{tag}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn installers_are_spelled_like_the_factory_ui() {
        let id = id_of("customization: {}\n");
        assert_eq!(
            installer_ref("factory.talos.dev", "metal", &id, "v1.11.2", false),
            "factory.talos.dev/metal-installer/376567988ad370138ad8b2698212367b8edcb69b5fd68c80be1f2ec7d603b4ba:v1.11.2"
        );
    }

    #[test]
    fn secure_boot_installers_carry_the_suffix_per_version() {
        let id = id_of("customization: {}\n");
        assert_eq!(
            installer_ref("factory.talos.dev", "metal", &id, "v1.11.2", true),
            format!("factory.talos.dev/metal-installer-secureboot/{id}:v1.11.2")
        );
        assert_eq!(
            installer_ref("factory.talos.dev", "metal", &id, "v1.9.5", true),
            format!("factory.talos.dev/installer-secureboot/{id}:v1.9.5")
        );
    }

    #[test]
    fn the_registry_is_the_factory_host_and_port_only() {
        assert_eq!(
            registry_host("https://factory.talos.dev/"),
            "factory.talos.dev"
        );
        assert_eq!(
            registry_host("http://127.0.0.1:8080/api/"),
            "127.0.0.1:8080"
        );
        assert_eq!(registry_host("http://[::1]:80"), "[::1]:80");
    }

    #[test]
    fn installers_before_talos_1_10_are_not_per_platform() {
        let id = id_of("customization: {}\n");
        let cases = [
            ("v1.9.5", "f.example/installer/"),
            ("1.9.0", "f.example/installer/"),
            ("v1.5.0", "f.example/installer/"),
            ("v1.10.0", "f.example/nocloud-installer/"),
            ("v1.10.0-alpha.1", "f.example/nocloud-installer/"),
            ("v2.0.0", "f.example/nocloud-installer/"),
            ("v1.100.0", "f.example/nocloud-installer/"),
        ];
        for (version, prefix) in cases {
            let r = installer_ref("f.example", "nocloud", &id, version, false);
            assert!(r.starts_with(&format!("{prefix}{id}:v")), "{version}: {r}");
            assert!(
                r.ends_with(&format!(":v{}", version.trim_start_matches('v'))),
                "{r}"
            );
        }
    }
}
