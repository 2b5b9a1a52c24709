//! The Talos ADV codec: the tag-length-value store inside the META
//! partition, kept twice so one torn write cannot lose it. Pure functions
//! over bytes; reading and writing partitions is `disk`'s job.
//!
//! Layout of each 256 KiB copy (big-endian): `u32 magic1`, then entries
//! `u32 tag, u32 size, value` packed back to back (a zero tag, or fewer than
//! 8 bytes left, ends them), a SHA-256 at [`CHECKSUM_OFFSET`] computed with
//! its own 32 bytes zeroed, and `u32 magic2` in the last 4 bytes.

use sha2::{Digest, Sha256};

/// Size of one ADV copy.
pub const COPY_SIZE: usize = 256 * 1024;
/// Both copies, as they sit at the start of the META partition.
pub const ADV_SIZE: usize = 2 * COPY_SIZE;
const MAGIC1: u32 = 0x5a4b_3c2d;
const MAGIC2: u32 = 0xa5b4_c3d2;
const CHECKSUM_OFFSET: usize = 0x3FFDC;
const MAGIC2_OFFSET: usize = 0x3FFFC;
/// Bytes the entries may take, 8 of header each included.
pub const CAPACITY: usize = 262_104 - 20;

/// Which copy a decoded ADV came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    First,
    Second,
    /// Neither copy was valid: META reads as empty.
    Empty,
}

/// A decoded ADV: tags in the order they are stored. Talos writes them in
/// Go's map order (siderolabs/talos
/// `internal/pkg/meta/internal/adv/talos/talos.go`, `Marshal`), so an image
/// is reproduced byte for byte only if that order is kept.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Adv {
    tags: Vec<(u32, Vec<u8>)>,
}

/// The result of reading both copies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decoded {
    pub adv: Adv,
    pub source: Source,
    /// Why a copy was passed over, one line per problem.
    pub problems: Vec<String>,
}

/// Why an ADV could not be written.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AdvError {
    #[error(
        "META is full: the tags need {needed} bytes but an ADV holds {CAPACITY} \
         (8 bytes per tag plus its value)"
    )]
    TooLarge { needed: usize },
}

impl Adv {
    /// Reads `meta` (at least [`ADV_SIZE`] bytes): copy 1 if valid, else copy 2, else empty.
    /// All-zero META (never written, as in grub-era images) is empty without complaint.
    pub fn decode(meta: &[u8]) -> Decoded {
        let mut problems = Vec::new();
        if meta.len() >= ADV_SIZE && meta[..ADV_SIZE].iter().all(|&b| b == 0) {
            return Decoded {
                adv: Adv::default(),
                source: Source::Empty,
                problems,
            };
        }
        for (i, source) in [(0, Source::First), (1, Source::Second)] {
            let copy = meta.get(i * COPY_SIZE..(i + 1) * COPY_SIZE);
            match copy
                .ok_or_else(|| "META is shorter than 512 KiB".to_owned())
                .and_then(decode_copy)
            {
                Ok(adv) => {
                    return Decoded {
                        adv,
                        source,
                        problems,
                    };
                }
                Err(why) => problems.push(format!("ADV copy {}: {why}", i + 1)),
            }
        }
        Decoded {
            adv: Adv::default(),
            source: Source::Empty,
            problems,
        }
    }

    /// Both copies, identical, ready to write at the start of META.
    pub fn encode(&self) -> Result<Vec<u8>, AdvError> {
        let needed = self.used();
        if needed > CAPACITY {
            return Err(AdvError::TooLarge { needed });
        }
        let mut copy = vec![0u8; COPY_SIZE];
        copy[..4].copy_from_slice(&MAGIC1.to_be_bytes());
        let mut at = 4;
        for (tag, value) in &self.tags {
            copy[at..at + 4].copy_from_slice(&tag.to_be_bytes());
            copy[at + 4..at + 8].copy_from_slice(&(value.len() as u32).to_be_bytes());
            copy[at + 8..at + 8 + value.len()].copy_from_slice(value);
            at += 8 + value.len();
        }
        copy[MAGIC2_OFFSET..].copy_from_slice(&MAGIC2.to_be_bytes());
        let sum = Sha256::digest(&copy);
        copy[CHECKSUM_OFFSET..CHECKSUM_OFFSET + 32].copy_from_slice(&sum);
        let mut both = copy.clone();
        both.extend_from_slice(&copy);
        Ok(both)
    }

    fn position(&self, tag: u32) -> Option<usize> {
        self.tags.iter().position(|(t, _)| *t == tag)
    }

    /// The value of `tag`.
    pub fn get(&self, tag: u32) -> Option<&[u8]> {
        self.position(tag).map(|i| self.tags[i].1.as_slice())
    }

    /// Sets `tag`, refusing a value that would overflow the ADV. A tag
    /// already there keeps its place; a new one goes before the first
    /// larger tag (an ascending ADV stays ascending), else last.
    pub fn set(&mut self, tag: u32, value: Vec<u8>) -> Result<(), AdvError> {
        let at = self.position(tag);
        let old = at.map_or(0, |i| 8 + self.tags[i].1.len());
        let needed = self.used() - old + 8 + value.len();
        if needed > CAPACITY {
            return Err(AdvError::TooLarge { needed });
        }
        match at {
            Some(i) => self.tags[i].1 = value,
            None => {
                let before = self.tags.iter().position(|(t, _)| *t > tag);
                self.tags
                    .insert(before.unwrap_or(self.tags.len()), (tag, value));
            }
        }
        Ok(())
    }

    /// Removes `tag` (the others keep their order); returns whether it was there.
    pub fn delete(&mut self, tag: u32) -> bool {
        self.position(tag).map(|i| self.tags.remove(i)).is_some()
    }

    /// Every tag with its value, in stored order.
    pub fn iter(&self) -> impl Iterator<Item = (u32, &[u8])> {
        self.tags.iter().map(|(t, v)| (*t, v.as_slice()))
    }

    fn used(&self) -> usize {
        self.tags.iter().map(|(_, v)| 8 + v.len()).sum()
    }
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn decode_copy(copy: &[u8]) -> Result<Adv, String> {
    if be32(copy, 0) != MAGIC1 {
        return Err(format!("bad magic {:#010x} at offset 0", be32(copy, 0)));
    }
    if be32(copy, MAGIC2_OFFSET) != MAGIC2 {
        return Err(format!(
            "bad magic {:#010x} at the end",
            be32(copy, MAGIC2_OFFSET)
        ));
    }
    let mut zeroed = copy.to_vec();
    zeroed[CHECKSUM_OFFSET..CHECKSUM_OFFSET + 32].fill(0);
    if Sha256::digest(&zeroed)[..] != copy[CHECKSUM_OFFSET..CHECKSUM_OFFSET + 32] {
        return Err("checksum mismatch".into());
    }
    let mut adv = Adv::default();
    let mut at = 4;
    while at + 8 <= CHECKSUM_OFFSET {
        let tag = be32(copy, at);
        if tag == 0 {
            break;
        }
        let size = be32(copy, at + 4) as usize;
        let end = at + 8 + size;
        if end > CHECKSUM_OFFSET {
            return Err(format!(
                "tag {tag} at offset {at} claims {size} bytes, past the end of the data"
            ));
        }
        // A repeated tag overrides the earlier one, as in Talos' reader.
        let value = copy[at + 8..end].to_vec();
        match adv.position(tag) {
            Some(i) => adv.tags[i].1 = value,
            None => adv.tags.push((tag, value)),
        }
        at = end;
    }
    Ok(adv)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// `tests/vectors/meta-adv.txt` as name → hex value.
    fn vectors() -> HashMap<String, String> {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/vectors/meta-adv.txt");
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.split_once(' '))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    }

    fn foo() -> Adv {
        let mut adv = Adv::default();
        adv.set(10, b"foo".to_vec()).unwrap();
        adv
    }

    #[test]
    fn published_vectors_are_reproduced() {
        let v = vectors();
        let both = foo().encode().unwrap();
        assert_eq!(hex::encode(&both[..16]), v["first-16-bytes"]);
        assert_eq!(
            hex::encode(&both[CHECKSUM_OFFSET..CHECKSUM_OFFSET + 32]),
            v["checksum-at-0x3FFDC"]
        );
        assert_eq!(
            hex::encode(Sha256::digest(&both)),
            v["sha256-of-both-copies-512KiB"]
        );
        let empty = Adv::default().encode().unwrap();
        assert_eq!(
            hex::encode(&empty[CHECKSUM_OFFSET..CHECKSUM_OFFSET + 32]),
            v["empty-checksum-at-0x3FFDC"]
        );
    }

    #[test]
    fn round_trip_keeps_every_tag() {
        let mut adv = foo();
        adv.set(17, b"dual-boot".to_vec()).unwrap();
        let d = Adv::decode(&adv.encode().unwrap());
        assert_eq!(d.source, Source::First);
        assert!(d.problems.is_empty());
        assert_eq!(d.adv, adv);
        assert_eq!(d.adv.get(17), Some(&b"dual-boot"[..]));
    }

    #[test]
    fn corrupt_first_copy_falls_back_to_the_second() {
        let mut both = foo().encode().unwrap();
        both[20] ^= 0xff;
        let d = Adv::decode(&both);
        assert_eq!(d.source, Source::Second);
        assert_eq!(d.adv, foo());
        assert!(
            d.problems[0].contains("copy 1: checksum mismatch"),
            "{:?}",
            d.problems
        );
    }

    #[test]
    fn both_copies_corrupt_read_as_empty_with_reasons() {
        let mut both = foo().encode().unwrap();
        both[0] = 0;
        both[COPY_SIZE + MAGIC2_OFFSET] = 0;
        let d = Adv::decode(&both);
        assert_eq!(d.source, Source::Empty);
        assert_eq!(d.adv, Adv::default());
        assert_eq!(d.problems.len(), 2);
        assert!(d.problems[0].contains("bad magic"));
        assert!(d.problems[1].contains("bad magic"));
    }

    #[test]
    fn zeroed_meta_reads_as_empty() {
        let d = Adv::decode(&vec![0u8; ADV_SIZE]);
        assert_eq!(d.source, Source::Empty);
        assert!(d.problems.is_empty(), "never-written META is not corrupt");
        assert!(Adv::decode(&[0u8; 100]).problems[0].contains("shorter"));
    }

    #[test]
    fn an_entry_past_the_data_is_refused() {
        // A valid checksum over a copy whose one entry claims too many bytes.
        let mut copy = vec![0u8; COPY_SIZE];
        copy[..4].copy_from_slice(&MAGIC1.to_be_bytes());
        copy[4..8].copy_from_slice(&10u32.to_be_bytes());
        copy[8..12].copy_from_slice(&(COPY_SIZE as u32).to_be_bytes());
        copy[MAGIC2_OFFSET..].copy_from_slice(&MAGIC2.to_be_bytes());
        let sum = Sha256::digest(&copy);
        copy[CHECKSUM_OFFSET..CHECKSUM_OFFSET + 32].copy_from_slice(&sum);
        let d = Adv::decode(&[copy.clone(), copy].concat());
        assert_eq!(d.source, Source::Empty);
        assert!(d.problems[0].contains("past the end"), "{:?}", d.problems);
    }

    /// Both copies of an ADV holding `entries` in exactly this order, laid
    /// out by hand as talos.go's `Marshal` does.
    fn written_in_order(entries: &[(u32, &[u8])]) -> Vec<u8> {
        let mut copy = vec![0u8; COPY_SIZE];
        copy[..4].copy_from_slice(&MAGIC1.to_be_bytes());
        let mut at = 4;
        for (tag, value) in entries {
            copy[at..at + 4].copy_from_slice(&tag.to_be_bytes());
            copy[at + 4..at + 8].copy_from_slice(&(value.len() as u32).to_be_bytes());
            copy[at + 8..at + 8 + value.len()].copy_from_slice(value);
            at += 8 + value.len();
        }
        copy[MAGIC2_OFFSET..].copy_from_slice(&MAGIC2.to_be_bytes());
        let sum = Sha256::digest(&copy);
        copy[CHECKSUM_OFFSET..CHECKSUM_OFFSET + 32].copy_from_slice(&sum);
        [copy.clone(), copy].concat()
    }

    #[test]
    fn tags_keep_their_stored_order_through_decode_edit_and_encode() {
        let factory = written_in_order(&[(17, b"dual-boot"), (12, b"user")]);
        let mut adv = Adv::decode(&factory).adv;
        assert!(adv.encode().unwrap() == factory, "re-encoding reordered");
        adv.set(12, b"changed".to_vec()).unwrap();
        adv.set(10, b"net".to_vec()).unwrap();
        adv.set(20, b"last".to_vec()).unwrap();
        let order = |a: &Adv| a.iter().map(|(k, _)| k).collect::<Vec<_>>();
        assert_eq!(order(&adv), [10, 17, 12, 20]);
        let want = written_in_order(&[
            (10, b"net"),
            (17, b"dual-boot"),
            (12, b"changed"),
            (20, b"last"),
        ]);
        assert!(adv.encode().unwrap() == want);
        assert!(adv.delete(17));
        assert!(!adv.delete(17));
        assert_eq!(order(&adv), [10, 12, 20]);
        // A repeated tag reads as its last value, in its first place.
        let twice = written_in_order(&[(12, b"a"), (17, b"b"), (12, b"c")]);
        let adv = Adv::decode(&twice).adv;
        assert_eq!(order(&adv), [12, 17]);
        assert_eq!(adv.get(12), Some(&b"c"[..]));
    }

    #[test]
    fn over_size_values_are_refused_and_the_limit_is_exact() {
        let mut adv = Adv::default();
        assert!(adv.set(10, vec![b'x'; CAPACITY - 8]).is_ok());
        assert!(adv.encode().is_ok());
        let err = adv.set(11, vec![]).unwrap_err();
        assert_eq!(
            err,
            AdvError::TooLarge {
                needed: CAPACITY + 8
            }
        );
        assert!(err.to_string().contains("META is full"));
        // Replacing a value counts only the new size.
        assert!(adv.set(10, vec![b'y'; CAPACITY - 8]).is_ok());
    }

    proptest::proptest! {
        #![proptest_config(crate::fuzz_config())]
        #[test]
        fn fuzz_adv_decoder_never_panics(
            bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..2048),
            at in 0usize..ADV_SIZE,
        ) {
            if !crate::fuzz_time_left() {
                return Ok(());
            }
            let mut meta = foo().encode().unwrap();
            let end = (at + bytes.len()).min(ADV_SIZE);
            meta[at..end].copy_from_slice(&bytes[..end - at]);
            let _ = Adv::decode(&meta);
            let _ = Adv::decode(&bytes);
        }
    }
}
