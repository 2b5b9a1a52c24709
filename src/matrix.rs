//! The distinct artifacts an inventory needs, each with the nodes whose
//! build and publish make it. CI fans these out as a matrix, one job per
//! artifact, instead of building everything in one job.
//!
//! What counts as one artifact follows how images are made:
//! - patch route: nodes that share a base schematic share one base image
//!   (per schematic, Talos version, platform, arch and format);
//! - factory route: every node downloads its own image;
//! - Hetzner Cloud: one snapshot per (schematic, version, arch), and hcloud
//!   ignores META key 10, so nodes with the same extensions share it.

use crate::build::Route;
use crate::inventory::{Arch, ImageFormat, Inventory, PublishSettings};
use crate::schematic::{self, EmitError, SchematicId};
use serde::Serialize;

/// Where an inventory's images end up: the CI matrix's word for the
/// inventory's publish target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ArtifactTarget {
    /// `publish.proxmox`: storage uploads (and VMs).
    Proxmox,
    /// `publish.hcloud`: snapshots.
    Hcloud,
    /// No publish section: image files in the out dir.
    Files,
}

impl From<PublishSettings<'_>> for ArtifactTarget {
    /// The kind of the inventory's publish target (no credentials needed).
    fn from(target: PublishSettings<'_>) -> ArtifactTarget {
        match target {
            PublishSettings::Hcloud(_) => ArtifactTarget::Hcloud,
            PublishSettings::Proxmox(_) => ArtifactTarget::Proxmox,
            PublishSettings::None => ArtifactTarget::Files,
        }
    }
}

/// What one artifact is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ArtifactKind {
    /// A patch-route base image, shared by the nodes listed with it.
    BaseImage,
    /// A factory-route image of one node.
    NodeImage,
    /// A Hetzner Cloud snapshot, shared by the nodes listed with it.
    Snapshot,
}

/// One distinct artifact and the nodes that need it, in inventory order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Artifact {
    pub kind: ArtifactKind,
    pub target: ArtifactTarget,
    /// The base schematic (patch route), the node's own (factory route), or
    /// the snapshot's.
    pub schematic_id: SchematicId,
    pub talos_version: String,
    pub platform: String,
    pub arch: Arch,
    /// None for snapshots: Hetzner stores the disk, not a file format.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub format: Option<ImageFormat>,
    pub nodes: Vec<String>,
}

impl Artifact {
    /// The nodes whose build (and publish) makes exactly this artifact: every
    /// node that shares a base image (each gets its own patched copy and
    /// upload), but one node of a snapshot (the others reuse it).
    pub fn command_nodes(&self) -> &[String] {
        match self.kind {
            ArtifactKind::Snapshot => &self.nodes[..1],
            ArtifactKind::BaseImage | ArtifactKind::NodeImage => &self.nodes,
        }
    }
}

/// The inventory's artifacts in inventory order (by each one's first node).
/// IDs come from the same schematics `build` uses.
pub fn artifacts(inv: &Inventory, route: Route) -> Result<Vec<Artifact>, EmitError> {
    let target = ArtifactTarget::from(inv.publish.target());
    let mut out: Vec<Artifact> = Vec::new();
    for node in &inv.nodes {
        let (kind, schematic_id, format) = match (target, route) {
            (ArtifactTarget::Hcloud, _) => (
                ArtifactKind::Snapshot,
                schematic::node::for_node(inv, node).id()?,
                None,
            ),
            (_, Route::Patch) => (
                ArtifactKind::BaseImage,
                schematic::node::base_for_node(inv, node).id()?,
                Some(inv.image.format),
            ),
            (_, Route::Factory) => (
                ArtifactKind::NodeImage,
                schematic::node::for_node(inv, node).id()?,
                Some(inv.image.format),
            ),
        };
        let shared = out.iter_mut().find(|a| {
            a.kind != ArtifactKind::NodeImage && a.kind == kind && a.schematic_id == schematic_id
        });
        match shared {
            Some(a) => a.nodes.push(node.name.clone()),
            None => out.push(Artifact {
                kind,
                target,
                schematic_id,
                talos_version: inv.cluster.talos_version.clone(),
                platform: inv.image.platform.clone(),
                arch: inv.image.arch,
                format,
                nodes: vec![node.name.clone()],
            }),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    const LOOPBACK: &str = include_str!("../examples/loopback/cluster.yaml");

    fn inv(text: &str) -> Inventory {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/loopback/cluster.yaml");
        Inventory::parse(text, &path).unwrap()
    }

    /// The loopback example with worker-02 carrying one more extension.
    fn with_extra_extension(text: &str) -> String {
        text.replacen(
            "    address: 127.0.0.22\n",
            "    address: 127.0.0.22\n    extensions: [siderolabs/iscsi-tools]\n",
            1,
        )
    }

    #[test]
    fn nodes_sharing_a_base_share_one_base_image() {
        let inv = inv(LOOPBACK);
        let a = artifacts(&inv, Route::Patch).unwrap();
        assert_eq!(a.len(), 1, "{a:?}");
        assert_eq!(a[0].kind, ArtifactKind::BaseImage);
        assert_eq!(a[0].nodes.len(), 5);
        assert_eq!(a[0].command_nodes(), a[0].nodes.as_slice());
        let base = schematic::node::base(&inv).id().unwrap();
        assert_eq!(a[0].schematic_id, base);
        assert_eq!(a[0].target, ArtifactTarget::Files);
    }

    #[test]
    fn a_node_with_its_own_extension_has_its_own_base_image() {
        let inv = inv(&with_extra_extension(LOOPBACK));
        let a = artifacts(&inv, Route::Patch).unwrap();
        assert_eq!(a.len(), 2, "{a:?}");
        assert_eq!(a[0].nodes.len(), 4);
        assert_eq!(a[1].nodes, ["worker-02"]);
        assert_ne!(a[0].schematic_id, a[1].schematic_id);
    }

    #[test]
    fn the_factory_route_downloads_one_image_per_node() {
        let inv = inv(LOOPBACK);
        let a = artifacts(&inv, Route::Factory).unwrap();
        assert_eq!(a.len(), 5);
        for (artifact, node) in a.iter().zip(&inv.nodes) {
            assert_eq!(artifact.nodes, std::slice::from_ref(&node.name));
            assert_eq!(
                artifact.schematic_id,
                schematic::node::for_node(&inv, node).id().unwrap()
            );
        }
    }

    #[test]
    fn hcloud_makes_one_snapshot_per_schematic_whatever_the_route() {
        let text = with_extra_extension(LOOPBACK).replace("platform: metal", "platform: hcloud")
            + "publish:\n  hcloud:\n    location: fsn1\n";
        let inv = inv(&text);
        for route in [Route::Patch, Route::Factory] {
            let a = artifacts(&inv, route).unwrap();
            assert_eq!(a.len(), 2, "{a:?}");
            assert!(a.iter().all(|a| a.kind == ArtifactKind::Snapshot));
            assert_eq!(a[0].nodes.len(), 4);
            assert_eq!(a[0].command_nodes(), ["cp-01"]);
            assert_eq!(a[1].command_nodes(), ["worker-02"]);
            assert_eq!(a[0].format, None);
            assert_eq!(a[0].target, ArtifactTarget::Hcloud);
        }
    }
}
