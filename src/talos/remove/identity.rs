//! A Talos machine's identity: the node ID Talos keeps in its STATE
//! partition (COSI `Identities.cluster.talos.dev` `local` in namespace
//! `cluster`, spec `nodeId`; siderolabs/talos
//! `pkg/machinery/resources/cluster/identity.go`): 32 random bytes,
//! base62-encoded (`internal/app/machined/pkg/adapters/cluster/identity.go`,
//! github.com/jxskiss/base62), kept across reboots, new after a wipe of
//! STATE or on another machine. `/etc/machine-id`, which the kubelet
//! reports as a Node's `status.nodeInfo.machineID`, is the hex of its
//! first 16 bytes (`ConvertMachineID`). Every node shares the cluster's
//! CA, so an answer over mTLS proves only "a node of this cluster": the
//! node ID tells which machine answered.

use std::collections::BTreeMap;

use crate::talos::bootstrap::{Options, Plan};
use crate::talos::client::{ApiError, Mode, NodeClient, NodeEndpoint};

/// The COSI resource: (namespace, type, id).
pub const IDENTITY: (&str, &str, &str) = ("cluster", "Identities.cluster.talos.dev", "local");

/// Talos's node IDs are 32 bytes, at most 52 base62 characters; anything
/// longer is not one.
pub const NODE_ID_LIMIT: usize = 64;

/// What the resource's spec holds beyond `nodeId` is ignored.
const SPEC_LIMIT: usize = 4096;

/// Characters of an ID shown in messages: enough to tell two apart.
pub const SHOWN: usize = 8;

/// A node ID as Talos writes it: 1..=[`NODE_ID_LIMIT`] ASCII letters and
/// digits, nothing else (so it is safe in a file, a message, a plan).
pub fn valid_node_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= NODE_ID_LIMIT && id.bytes().all(|b| b.is_ascii_alphanumeric())
}

/// The first [`SHOWN`] characters of an ID, for a message (IDs are not
/// secrets, but long and alike); `?` when it is not a valid one.
pub fn short(id: &str) -> String {
    if id.bytes().all(|b| b.is_ascii_alphanumeric()) && !id.is_empty() {
        id.chars().take(SHOWN).collect()
    } else {
        "?".to_owned()
    }
}

/// The node ID out of the resource's YAML spec, if it is a valid one.
pub fn parse_spec(yaml: &str) -> Option<String> {
    if yaml.len() > SPEC_LIMIT {
        return None;
    }
    #[derive(serde::Deserialize)]
    struct Spec {
        #[serde(rename = "nodeId")]
        node_id: String,
    }
    let spec: Spec = serde_yaml_ng::from_str(yaml).ok()?;
    valid_node_id(&spec.node_id).then_some(spec.node_id)
}

/// The machine's node ID, read through the COSI State API as `talosctl get
/// identities` does. None when the node has no such resource or holds no
/// valid ID there (never taken for any machine's).
pub async fn read(client: &NodeClient) -> Result<Option<String>, ApiError> {
    let (namespace, kind, id) = IDENTITY;
    let yaml = client
        .cosi_get((namespace, kind, id), "a resource", SPEC_LIMIT)
        .await?;
    Ok(yaml.as_deref().and_then(parse_spec))
}

/// What answers over mTLS at an address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// Nothing (no connection, no mTLS, no Version).
    Silent,
    /// A node of the cluster, with its node ID — None when it shows none
    /// (or its reply was too large, too slow, not one): never taken for
    /// any machine's.
    Node(Option<String>),
}

/// What answers over mTLS at `t`, and with which node ID.
pub async fn read_at(plan: &Plan, t: &NodeEndpoint, opts: &Options) -> Answer {
    let mode = Mode::Mtls(plan.identity.clone());
    let Ok(c) = NodeClient::connect(t, &mode, opts.call_timeout).await else {
        return Answer::Silent;
    };
    if c.version().await.is_err() {
        return Answer::Silent;
    }
    Answer::Node(read(&c).await.ok().flatten())
}

/// Each node of `plan` that answers with a node ID, by name (read all at
/// once, each within the call timeout). Blocking: its own runtime; empty
/// when none can be made.
pub fn of_plan(plan: &Plan, opts: &Options) -> BTreeMap<String, String> {
    let Ok(rt) = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    else {
        return BTreeMap::new();
    };
    rt.block_on(of_plan_async(plan, opts))
}

/// [`of_plan`] on the caller's runtime.
pub async fn of_plan_async(plan: &Plan, opts: &Options) -> BTreeMap<String, String> {
    let reads = plan.nodes.iter().map(|n| async move {
        match read_at(plan, &n.endpoint, opts).await {
            Answer::Node(Some(id)) => Some((n.name.clone(), id)),
            _ => None,
        }
    });
    futures_util::future::join_all(reads)
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// The alphabet of github.com/jxskiss/base62 (`encodeStd`).
const ALPHABET: &[u8; 62] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";

/// Decodes jxskiss/base62 (`base62.go` `decoder.decode`): a bit stream
/// read from the last byte backwards, 6 bits a character except that a
/// character whose bits 1..4 are all set carries 5, and the last one only
/// its significant bits. Not the big-number base62 of other libraries.
pub fn base62_decode(text: &str) -> Option<Vec<u8>> {
    if text.is_empty() || text.len() > NODE_ID_LIMIT {
        return None;
    }
    let mut out: Vec<u8> = Vec::with_capacity(text.len() * 6 / 8 + 1);
    let (mut pos, mut bits) = (0u32, 0u32);
    let last = text.len() - 1;
    for (i, c) in text.bytes().enumerate() {
        let x = ALPHABET.iter().position(|a| *a == c)? as u32;
        bits |= x << pos;
        pos += if i == last {
            32 - x.leading_zeros()
        } else if x & 0x1e == 0x1e {
            5
        } else {
            6
        };
        if pos >= 8 {
            out.push(bits as u8);
            pos %= 8;
            bits >>= 8;
        }
    }
    if pos > 0 {
        out.push(bits as u8);
    }
    out.reverse();
    Some(out)
}

/// The `/etc/machine-id` a machine with node ID `node_id` has, as Talos
/// derives it (`ConvertMachineID`: the hex of the first 16 decoded bytes)
/// and the kubelet reports it (`status.nodeInfo.machineID`).
pub fn machine_id(node_id: &str) -> Option<String> {
    if !valid_node_id(node_id) {
        return None;
    }
    let raw = base62_decode(node_id)?;
    let head = raw.get(..16)?;
    Some(head.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    // Made with jxskiss/base62's encoder (EncodeToString) from 32 bytes
    // `i*37+11`, all 0xff and all zero; the machine ID is the hex of the
    // first 16.
    const VECTORS: [(&str, &str); 3] = [
        (
            "GGGPXIfmRdQvyhi3VuUA3ymIYfxi2HWz4Q6EfT9qCmFA",
            "0b30557a9fc4e90e33587da2c7ec1136",
        ),
        (
            "fffffffffffffffffffffffffffffffffffffffffffffffffffB",
            "ffffffffffffffffffffffffffffffff",
        ),
        (
            "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",
            "00000000000000000000000000000000",
        ),
    ];

    #[test]
    fn the_machine_id_is_the_hex_of_the_node_ids_first_16_bytes() {
        for (node_id, machine) in VECTORS {
            assert_eq!(machine_id(node_id).as_deref(), Some(machine), "{node_id}");
            assert_eq!(base62_decode(node_id).unwrap().len(), 32, "{node_id}");
        }
        let bytes: Vec<u8> = (0..32u32).map(|i| (i * 37 + 11) as u8).collect();
        assert_eq!(base62_decode(VECTORS[0].0).unwrap(), bytes);
    }

    #[test]
    fn only_base62_text_of_bounded_length_is_a_node_id() {
        assert!(valid_node_id(VECTORS[0].0));
        for bad in [
            "",
            "abc-def",
            "abc def",
            "abc\n",
            "ü",
            &"a".repeat(NODE_ID_LIMIT + 1),
        ] {
            assert!(!valid_node_id(bad), "{bad:?}");
            assert_eq!(machine_id(bad), None, "{bad:?}");
        }
        // Too short to hold 16 bytes: no machine ID.
        assert_eq!(machine_id("AB"), None);
        assert_eq!(short(VECTORS[0].0), "GGGPXIfm");
        assert_eq!(short("a\u{1b}[31m"), "?");
    }

    #[test]
    fn the_spec_gives_the_node_id_or_nothing() {
        assert_eq!(
            parse_spec("nodeId: GGGPXIfmRdQvyhi3VuUA3ymIYfxi2HWz4Q6EfT9qCmFA\n").as_deref(),
            Some(VECTORS[0].0)
        );
        assert_eq!(parse_spec("nodeId: \"a/b\"\n"), None);
        assert_eq!(parse_spec("other: 1\n"), None);
        assert_eq!(
            parse_spec(&format!("nodeId: a\nx: {}\n", "y".repeat(5000))),
            None
        );
    }
}
