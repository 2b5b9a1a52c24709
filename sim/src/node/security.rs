//! The node's SecurityState resource (siderolabs/talos
//! `pkg/machinery/resources/runtime/security_status.go`: type
//! `SecurityStates.talos.dev`, ID `securitystate`, namespace `runtime`;
//! filled once at boot by `internal/app/machined/pkg/controllers/runtime/
//! security_state.go`): `secureBoot` is true when the firmware has Secure
//! Boot on and is not in setup mode, `bootedWithUKI` when systemd-boot's
//! default entry (or the stub's image) is a `Talos-*` UKI, and
//! `pcrSigningKeyFingerprint` is the SHA-256 of the PCR signing
//! certificate the UKI carries, uppercase hex pairs joined by `:`
//! (`x509CertFingerprint`). `ukiSigningKeyFingerprint` exists in the spec
//! but no controller of v1.9–v1.12 sets it, so it is never written here.
//! Which way a node booted comes from the boot request (`secure_boot`, as
//! the Proxmox double tells it from the disk and firmware) or
//! `--secure-boot`.

use sha2::{Digest, Sha256};

use imgbuild::talos::api::cosi::resource::{Metadata as ResMetadata, Resource, Spec};

pub(crate) const SECURITY_STATE: &str = "SecurityStates.talos.dev";

/// The fingerprint of the factory double's PCR signing certificate: a
/// fixed stand-in, the same for every Secure Boot image it serves.
fn pcr_fingerprint() -> String {
    let hash = Sha256::digest(b"imgbuild-sim factory PCR signing certificate");
    hash.iter()
        .map(|b| format!("{b:02X}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// The resource of a node that booted with Secure Boot on or off. A
/// Secure Boot boot is a UKI boot; an ordinary one (dual-boot on UEFI, the
/// simulated VMs) is a UKI too, without a PCR key to report.
pub(crate) fn resource(secure_boot: bool) -> Resource {
    let mut yaml = format!("secureBoot: {secure_boot}\n");
    if secure_boot {
        yaml.push_str(&format!(
            "pcrSigningKeyFingerprint: {}\n",
            pcr_fingerprint()
        ));
    }
    yaml.push_str("bootedWithUKI: true\n");
    Resource {
        metadata: Some(ResMetadata {
            namespace: "runtime".into(),
            r#type: SECURITY_STATE.into(),
            id: "securitystate".into(),
            version: "1".into(),
            phase: "running".into(),
            ..ResMetadata::default()
        }),
        spec: Some(Spec {
            proto_spec: Vec::new(),
            yaml_spec: yaml,
        }),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_fingerprint_is_uppercase_hex_pairs_joined_by_colons() {
        let f = super::pcr_fingerprint();
        assert_eq!(f.len(), 32 * 3 - 1);
        assert!(f.split(':').all(|p| {
            p.len() == 2
                && p.chars()
                    .all(|c| c.is_ascii_digit() || c.is_ascii_uppercase())
        }));
    }
}
