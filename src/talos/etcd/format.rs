//! The bytes of an etcd snapshot: the bolt database etcd's maintenance
//! `Snapshot` streams, with its SHA-256 appended, so its size modulo 512 is
//! 32. talosctl checks that size after saving (siderolabs/talos
//! `cmd/talosctl/cmd/talos/etcd.go`) and then opens the database; etcd's
//! restore checks the hash (`etcdutl/snapshot/v3_snapshot.go`, `hasHash :=
//! (off % 512) == sha256.Size`). [`Verifier`] checks all three as the bytes
//! go by — the size, the hash, and the bolt meta page at the start
//! (go.etcd.io/bbolt `page.go`, `db.go`: magic 0xED0CDAED, version 2,
//! FNV-64a checksum) — so a file that passes is one etcd restores. Pure but
//! for [`verify_file`].

use std::io;
use std::path::{Path, PathBuf};

use sha2::Digest;

/// The largest snapshot imgbuild takes unless told otherwise, and the
/// largest it recovers from: etcd's largest recommended backend quota
/// (`--quota-backend-bytes`, 8 GiB).
pub const LARGEST: u64 = 8 << 30;

/// The bolt meta page: a 16-byte page header (id u64, flags u16, count u16,
/// overflow u32), then magic u32, version u32, page size u32, flags u32,
/// root bucket (u64, u64), freelist u64, pgid u64, txid u64 and the FNV-64a
/// of the 56 meta bytes before it.
const BOLT_MAGIC: u32 = 0xED0C_DAED;
const BOLT_VERSION: u32 = 2;
const BOLT_META_FLAG: u16 = 0x04;
const META_AT: usize = 16;
const META_SUMMED: usize = 56;
const HEAD: usize = META_AT + META_SUMMED + 8;

/// Why a byte stream is not a whole etcd snapshot.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    #[error("it is empty")]
    Empty,
    #[error(
        "sha256 checksum not found (size {size}: a snapshot is a bolt database of whole 512-byte blocks with its 32-byte SHA-256 appended)"
    )]
    NoChecksum { size: u64 },
    #[error("its database hashes to {found}, but the snapshot carries {expected}")]
    ChecksumMismatch { expected: String, found: String },
    #[error("it does not start with a bolt meta page: {0}")]
    NotBolt(String),
}

/// What a whole snapshot holds, read from its bytes.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotInfo {
    /// Bytes, the appended hash included.
    pub size: u64,
    /// SHA-256 of the whole file (what the `.sha256` record holds).
    pub sha256: String,
    /// The bolt database's page size and last transaction.
    pub page_size: u32,
    pub txid: u64,
}

/// Checks a snapshot as its bytes go by, holding only its first page's
/// meta and its last 32 bytes.
pub struct Verifier {
    head: Vec<u8>,
    tail: Vec<u8>,
    db: sha2::Sha256,
    file: sha2::Sha256,
    size: u64,
}

impl Default for Verifier {
    fn default() -> Self {
        Verifier {
            head: Vec::with_capacity(HEAD),
            tail: Vec::with_capacity(2 * sha2::Sha256::output_size()),
            db: sha2::Sha256::new(),
            file: sha2::Sha256::new(),
            size: 0,
        }
    }
}

impl Verifier {
    /// Bytes so far.
    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn update(&mut self, bytes: &[u8]) {
        const HASH: usize = 32;
        self.size += bytes.len() as u64;
        self.file.update(bytes);
        let room = HEAD.saturating_sub(self.head.len()).min(bytes.len());
        self.head.extend_from_slice(&bytes[..room]);
        // Everything but the last 32 bytes seen is database.
        if bytes.len() >= HASH {
            self.db.update(&self.tail);
            self.db.update(&bytes[..bytes.len() - HASH]);
            self.tail.clear();
            self.tail.extend_from_slice(&bytes[bytes.len() - HASH..]);
        } else {
            self.tail.extend_from_slice(bytes);
            let extra = self.tail.len().saturating_sub(HASH);
            self.db.update(&self.tail[..extra]);
            self.tail.drain(..extra);
        }
    }

    /// The verdict on everything seen.
    pub fn finish(self) -> Result<SnapshotInfo, FormatError> {
        if self.size == 0 {
            return Err(FormatError::Empty);
        }
        if self.size % 512 != 32 {
            return Err(FormatError::NoChecksum { size: self.size });
        }
        let found = hex::encode(self.db.finalize());
        let expected = hex::encode(&self.tail);
        if found != expected {
            return Err(FormatError::ChecksumMismatch { expected, found });
        }
        let (page_size, txid) = bolt_meta(&self.head)?;
        Ok(SnapshotInfo {
            size: self.size,
            sha256: hex::encode(self.file.finalize()),
            page_size,
            txid,
        })
    }
}

/// The page size and txid of the bolt meta page `head` starts with. Bolt
/// writes two meta pages and a snapshot writes both fresh, so the first
/// must be valid.
fn bolt_meta(head: &[u8]) -> Result<(u32, u64), FormatError> {
    let bad = |why: &str| Err(FormatError::NotBolt(why.to_owned()));
    if head.len() < HEAD {
        return bad("shorter than a meta page");
    }
    let u16_at = |at: usize| u16::from_le_bytes([head[at], head[at + 1]]);
    let u32_at = |at: usize| u32::from_le_bytes(head[at..at + 4].try_into().expect("4 bytes"));
    let u64_at = |at: usize| u64::from_le_bytes(head[at..at + 8].try_into().expect("8 bytes"));
    if u16_at(8) & BOLT_META_FLAG == 0 {
        return bad("page 0 is not flagged as meta");
    }
    if u32_at(META_AT) != BOLT_MAGIC {
        return bad("no bolt magic");
    }
    if u32_at(META_AT + 4) != BOLT_VERSION {
        return bad("not bolt format version 2");
    }
    if fnv64a(&head[META_AT..META_AT + META_SUMMED]) != u64_at(META_AT + META_SUMMED) {
        return bad("its meta checksum does not match");
    }
    Ok((u32_at(META_AT + 8), u64_at(META_AT + 48)))
}

/// FNV-1a, 64 bits (Go's `hash/fnv` New64a, which bolt sums its meta with).
fn fnv64a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Why a snapshot file will not do.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotFileError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
    #[error("{}: not a whole etcd snapshot: {problem}", path.display())]
    Invalid { path: PathBuf, problem: FormatError },
}

/// Checks a snapshot file, reading it once (streamed).
pub fn verify_file(path: &Path) -> Result<SnapshotInfo, SnapshotFileError> {
    let io_at = |source| SnapshotFileError::Io {
        path: path.to_owned(),
        source,
    };
    let mut file = crate::io::open_regular(path, false).map_err(io_at)?;
    let mut v = Verifier::default();
    let mut buf = vec![0; crate::io::BUF_SIZE];
    loop {
        let n = io::Read::read(&mut file, &mut buf).map_err(io_at)?;
        if n == 0 {
            break;
        }
        v.update(&buf[..n]);
    }
    v.finish().map_err(|problem| SnapshotFileError::Invalid {
        path: path.to_owned(),
        problem,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bolt-shaped database of `pages` 4 KiB pages with its hash appended,
    /// built here by hand from the layout in bbolt's `page.go`/`db.go`.
    fn snapshot_bytes(pages: usize) -> Vec<u8> {
        let mut db = vec![0u8; pages * 4096];
        db[8..10].copy_from_slice(&BOLT_META_FLAG.to_le_bytes());
        db[16..20].copy_from_slice(&BOLT_MAGIC.to_le_bytes());
        db[20..24].copy_from_slice(&2u32.to_le_bytes());
        db[24..28].copy_from_slice(&4096u32.to_le_bytes());
        db[64..72].copy_from_slice(&7u64.to_le_bytes());
        let sum = fnv64a(&db[16..72]);
        db[72..80].copy_from_slice(&sum.to_le_bytes());
        let hash = sha2::Sha256::digest(&db);
        db.extend_from_slice(&hash);
        db
    }

    fn verdict(bytes: &[u8], chunk: usize) -> Result<SnapshotInfo, FormatError> {
        let mut v = Verifier::default();
        for c in bytes.chunks(chunk) {
            v.update(c);
        }
        v.finish()
    }

    #[test]
    fn a_whole_snapshot_passes_in_any_chunking() {
        let bytes = snapshot_bytes(4);
        for chunk in [1, 7, 31, 32, 33, 4096, 1 << 20] {
            let info = verdict(&bytes, chunk).unwrap();
            assert_eq!((info.size, info.page_size, info.txid), (16416, 4096, 7));
            assert_eq!(info.sha256, hex::encode(sha2::Sha256::digest(&bytes)));
        }
    }

    #[test]
    fn fnv64a_matches_go_hash_fnv() {
        // Go: fnv.New64a().Sum64() of "" and of "a".
        assert_eq!(fnv64a(b""), 0xcbf29ce484222325);
        assert_eq!(fnv64a(b"a"), 0xaf63dc4c8601ec8c);
    }

    #[test]
    fn truncated_flipped_or_foreign_bytes_fail() {
        let bytes = snapshot_bytes(2);
        assert_eq!(
            verdict(&bytes[..bytes.len() - 1], 100),
            Err(FormatError::NoChecksum { size: 8223 })
        );
        assert_eq!(verdict(&[], 1), Err(FormatError::Empty));
        let mut flipped = bytes.clone();
        flipped[5000] ^= 1;
        assert!(matches!(
            verdict(&flipped, 1000),
            Err(FormatError::ChecksumMismatch { .. })
        ));
        let mut foreign = vec![0u8; 4096];
        foreign.extend_from_slice(&sha2::Sha256::digest(&foreign));
        assert!(matches!(
            verdict(&foreign, 4096),
            Err(FormatError::NotBolt(_))
        ));
    }
}
