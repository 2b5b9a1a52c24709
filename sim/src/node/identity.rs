//! A machine's node identity, as Talos keeps and serves it (siderolabs/talos
//! `controllers/cluster/node_identity.go`).
//!
//! Read at v1.11.0, v1.12.0, v1.13.0 and v1.14.0-rc.1 (the same since v1.12;
//! v1.11 only mounts STATE differently):
//! - `internal/app/machined/pkg/controllers/cluster/node_identity.go`:
//!   once STATE is mounted, `LoadOrNewFromFile(STATE, "node-identity.yaml")`
//!   loads the identity saved there or generates one and saves it; so it is
//!   made on the first boot that has STATE, kept across reboots and upgrades
//!   (STATE survives both), and new after a Reset that wipes STATE or on
//!   another machine. The same controller writes `/etc/machine-id` from it,
//!   which the kubelet reports as the Node's `status.nodeInfo.machineID`.
//! - `pkg/machinery/resources/cluster/identity.go`: type
//!   `Identities.cluster.talos.dev`, namespace `cluster`, ID `local`, spec
//!   `nodeId` (YAML `nodeId: <id>`).
//! - `internal/app/machined/pkg/adapters/cluster/identity.go`: `Generate` is
//!   `base62.EncodeToString` (github.com/jxskiss/base62 v1.1.0, alphabet
//!   `A–Za–z0–9`, its own bit packing, not a big-number base 62) of
//!   `constants.DefaultNodeIdentitySize` = 32 random bytes;
//!   `ConvertMachineID` decodes it and hex-encodes the first 16 bytes.
//!
//! Maintenance mode (no config): STATE is only mounted when a partition
//! labelled STATE with a filesystem already exists
//! (`block/internal/volumes/volumeconfig/system_volumes.go`
//! `manageStateNoConfig`), so a new or wiped machine has no identity until
//! it is configured. Maintenance mode serves COSI reads on every version
//! (v1.11/v1.12 `internal/app/maintenance/server.go`, v1.13+ machined), so a
//! Get there is NotFound and a List empty (`day2.rs`); the simulated
//! machines in maintenance are always new or wiped.
//!
//! Also `HostnameStatuses.net.talos.dev` (`pkg/machinery/resources/network/
//! hostname_status.go`: namespace `network`, ID `hostname`, spec `hostname`,
//! `domainname`).

use std::io::Read;

use imgbuild::talos::api::cosi::resource::{Metadata as ResMetadata, Resource, Spec};

pub(crate) const IDENTITY_TYPE: &str = "Identities.cluster.talos.dev";
pub(crate) const IDENTITY_NS: &str = "cluster";
pub(crate) const IDENTITY_ID: &str = "local";
pub(crate) const HOSTNAME_STATUS_TYPE: &str = "HostnameStatuses.net.talos.dev";
pub(crate) const NETWORK_NS: &str = "network";
pub(crate) const HOSTNAME_ID: &str = "hostname";

/// `constants.DefaultNodeIdentitySize`.
const NODE_IDENTITY_SIZE: usize = 32;

/// jxskiss/base62's `encodeStd`.
const ALPHABET: &[u8; 62] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
const COMPACT_MASK: u8 = 0x1E;
const MASK5: u8 = 0x1F;
const MASK6: u8 = 0x3F;

/// jxskiss/base62 `Encoding.Encode` (`encodeV2`): 6 bits at a time from the
/// end of `src`; a value whose bits 1–4 are all set stands for 5 bits only
/// (so 62 and 63 never occur), except at the very start.
pub(crate) fn base62_encode(src: &[u8]) -> String {
    let mut out = String::with_capacity(src.len() * 9 / 5);
    let mut pos = src.len() * 8;
    while pos > 0 {
        let mut size = 6;
        let mut b = six_bits(src, pos);
        if b & COMPACT_MASK == COMPACT_MASK {
            if pos > 6 || b > MASK5 {
                size = 5;
            }
            b &= MASK5;
        }
        out.push(ALPHABET[usize::from(b)] as char);
        pos = pos.saturating_sub(size);
    }
    out
}

/// jxskiss/base62 `encoder.get6bits`.
fn six_bits(src: &[u8], pos: usize) -> u8 {
    let mut r = pos & 7;
    let mut i = pos >> 3;
    if r == 0 {
        i -= 1;
        r = 8;
    }
    let mut b = src[i] >> (8 - r);
    if r < 6 && i > 0 {
        b |= src[i - 1] << r;
    }
    b & MASK6
}

/// jxskiss/base62 `Encoding.Decode`; None for a byte outside the alphabet.
pub(crate) fn base62_decode(src: &str) -> Option<Vec<u8>> {
    let src = src.as_bytes();
    if src.is_empty() {
        return Some(Vec::new());
    }
    let mut dst = vec![0u8; src.len() * 6 / 8 + 1];
    let mut idx = dst.len();
    let mut pos: u32 = 0;
    let mut b: u64 = 0;
    for (i, c) in src.iter().enumerate() {
        let x = ALPHABET.iter().position(|a| a == c)? as u8;
        b |= u64::from(x) << pos;
        if i == src.len() - 1 {
            pos += 8 - x.leading_zeros();
        } else if x & COMPACT_MASK == COMPACT_MASK {
            pos += 5;
        } else {
            pos += 6;
        }
        if pos >= 8 {
            idx -= 1;
            dst[idx] = b as u8;
            pos %= 8;
            b >>= 8;
        }
    }
    if pos > 0 {
        idx -= 1;
        dst[idx] = b as u8;
    }
    Some(dst.split_off(idx))
}

/// A new identity: `Generate`, from the kernel's random bytes.
pub(crate) fn new_node_id() -> String {
    let mut buf = [0u8; NODE_IDENTITY_SIZE];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut buf))
        .expect("/dev/urandom is readable");
    base62_encode(&buf)
}

/// `/etc/machine-id` from a node ID (`ConvertMachineID`): the first 16
/// decoded bytes in lowercase hex. None where upstream errors (not base62,
/// or too short, where upstream would panic).
pub(crate) fn machine_id(node_id: &str) -> Option<String> {
    let raw = base62_decode(node_id)?;
    let first = raw.get(..16)?;
    Some(first.iter().map(|b| format!("{b:02x}")).collect())
}

fn resource(namespace: &str, kind: &str, id: &str, yaml: String) -> Resource {
    Resource {
        metadata: Some(ResMetadata {
            namespace: namespace.into(),
            r#type: kind.into(),
            id: id.into(),
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

/// The `Identities.cluster.talos.dev` resource `cluster/local`.
pub(crate) fn identity_resource(node_id: &str) -> Resource {
    resource(
        IDENTITY_NS,
        IDENTITY_TYPE,
        IDENTITY_ID,
        format!("nodeId: {node_id}\n"),
    )
}

/// The `HostnameStatuses.net.talos.dev` resource `network/hostname` (YAML
/// as Go's yaml.v3 writes the spec: an empty domain name is `""`).
pub(crate) fn hostname_resource(hostname: &str, domainname: &str) -> Resource {
    let quoted = |s: &str| {
        if s.is_empty() {
            "\"\"".to_owned()
        } else {
            s.to_owned()
        }
    };
    resource(
        NETWORK_NS,
        HOSTNAME_STATUS_TYPE,
        HOSTNAME_ID,
        format!(
            "hostname: {}\ndomainname: {}\n",
            quoted(hostname),
            quoted(domainname)
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// siderolabs/talos `internal/app/machined/pkg/adapters/cluster/
    /// identity_test.go` `TestIdentityConvertMachineID`.
    #[test]
    fn the_machine_id_is_derived_as_upstream_derives_it() {
        assert_eq!(
            machine_id("sou7yy34ykX3n373Zw1DXKb8zD7UnyKT6HT3QDsGH6L").as_deref(),
            Some("be871ac0d0dd31fa4caca753b0f3f1b2")
        );
    }

    /// The upstream vector decodes to 32 bytes and encodes back to itself;
    /// generated IDs are 43–45 characters (upstream `TestIdentityGenerate`)
    /// and round-trip, all zeros and all ones included.
    #[test]
    fn node_ids_round_trip_through_jxskiss_base62() {
        let v = "sou7yy34ykX3n373Zw1DXKb8zD7UnyKT6HT3QDsGH6L";
        let raw = base62_decode(v).unwrap();
        assert_eq!(raw.len(), 32);
        assert_eq!(base62_encode(&raw), v);
        for _ in 0..2000 {
            let id = new_node_id();
            assert!((43..=45).contains(&id.len()), "{id}");
            assert_eq!(base62_decode(&id).unwrap().len(), 32, "{id}");
        }
        for fill in [0u8, 0xff] {
            for n in 0..40 {
                let src = vec![fill; n];
                assert_eq!(base62_decode(&base62_encode(&src)).unwrap(), src);
            }
        }
        assert_ne!(new_node_id(), new_node_id());
        assert_eq!(base62_decode("not-base62"), None);
    }

    /// Vectors from jxskiss/base62 v1.1.0 itself (`EncodeToString`, run
    /// with Go 1.x): bytes chosen to hit the 5-bit values (0x1e/0x1f runs).
    #[test]
    fn the_encoding_matches_jxskiss_base62() {
        let hex = |s: &str| -> Vec<u8> {
            (0..s.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
                .collect()
        };
        for (src, want) in [
            ("000102feff7c3e1f8040", "AB4Hehvf7vABAA"),
            (
                "0b30557a9fc4e90e33587da2c7ec11365b80a5caef14395e83a8cdf2173c6186",
                "GGGPXIfmRdQvyhi3VuUA3ymIYfxi2HWz4Q6EfT9qCmFA",
            ),
            (&"00".repeat(32), &"A".repeat(43)),
        ] {
            assert_eq!(base62_encode(&hex(src)), want, "{src}");
            assert_eq!(base62_decode(want).unwrap(), hex(src), "{want}");
        }
    }

    #[test]
    fn the_resources_are_in_talos_wire_form() {
        let r = identity_resource("abc");
        let md = r.metadata.unwrap();
        assert_eq!(
            (md.namespace.as_str(), md.r#type.as_str(), md.id.as_str()),
            ("cluster", "Identities.cluster.talos.dev", "local")
        );
        assert_eq!(r.spec.unwrap().yaml_spec, "nodeId: abc\n");
        let h = hostname_resource("cp-01", "");
        assert_eq!(
            h.spec.unwrap().yaml_spec,
            "hostname: cp-01\ndomainname: \"\"\n"
        );
    }
}
