//! qcow2 images: our own header check (pure, over bytes), then block access
//! through qcow2-rs for images that pass it. qcow2-rs panics or misbehaves
//! on several header features, so nothing reaches it unchecked.

use qcow2_rs::dev::{Qcow2Dev, Qcow2DevParams};
use qcow2_rs::helpers::Qcow2IoBuf;
use qcow2_rs::tokio_io::Qcow2IoTokio;
use std::path::Path;

/// What imgbuild needs to know from a qcow2 header: its geometry and where
/// its two top-level tables lie.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub version: u32,
    pub cluster_bits: u32,
    pub virtual_size: u64,
    pub l1_entries: u32,
    pub l1_offset: u64,
    pub refcount_table_offset: u64,
    pub refcount_table_clusters: u32,
}

/// The largest L1 table imgbuild accepts (qcow2-rs holds the whole table in
/// memory, sized by the virtual size). 16 MiB maps 1 PiB with the default
/// 64 KiB clusters; qemu's own limit is 32 MiB (QCOW_MAX_L1_SIZE in
/// qemu/block/qcow2.h).
pub const MAX_L1_BYTES: u64 = 16 << 20;
/// The largest refcount table, qemu's QCOW_MAX_REFTABLE_SIZE (8 MiB).
pub const MAX_REFCOUNT_TABLE_BYTES: u64 = 8 << 20;
/// Cluster sizes qcow2-rs handles: 4 KiB to 2 MiB (qemu allows 512 bytes,
/// on which qcow2-rs indexes out of bounds).
const CLUSTER_BITS: std::ops::RangeInclusive<u32> = 12..=21;

/// Why a qcow2 image is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("not a qcow2 image (no QFI\\xfb magic)")]
    NotQcow2,
    #[error("the qcow2 header is truncated")]
    Truncated,
    #[error("qcow2 version {0} is not supported (2 or 3 are)")]
    Version(u32),
    #[error(
        "cluster_bits {0} is not supported (12..=21: 4 KiB to 2 MiB clusters); \
         convert with `qemu-img convert -O qcow2 -o cluster_size=64k`"
    )]
    ClusterBits(u32),
    #[error("virtual size {0} is not a positive multiple of 512 bytes")]
    VirtualSize(u64),
    #[error(
        "virtual size {size} needs an L1 table of {bytes} bytes (imgbuild reads at most {} MiB)",
        MAX_L1_BYTES >> 20
    )]
    TooLarge { size: u64, bytes: u64 },
    #[error("the image is encrypted (crypt_method {0}); decrypt it with qemu-img convert first")]
    Encrypted(u32),
    #[error("the image is marked dirty; repair it with `qemu-img check -r all`")]
    Dirty,
    #[error("the image is marked corrupt; repair it with `qemu-img check -r all`")]
    Corrupt,
    #[error("the image keeps its data in an external file, which is not supported")]
    ExternalData,
    #[error(
        "the image uses zstd compression, which imgbuild cannot write; \
         convert with `qemu-img convert -O qcow2 -o compression_type=zlib`"
    )]
    Zstd,
    #[error("the image uses extended L2 entries (subclusters), which imgbuild cannot write")]
    ExtendedL2,
    #[error("unknown incompatible feature bits {0:#x}")]
    UnknownFeatures(u64),
    #[error(
        "the image has a backing file {0:?}; imgbuild reads only self-contained images \
         (flatten it with `qemu-img convert -O qcow2 IMAGE OUT`)"
    )]
    Backing(String),
    #[error(
        "the image has {0} internal snapshot(s), which imgbuild cannot keep consistent; \
         delete them with `qemu-img snapshot -d` or convert the image"
    )]
    Snapshots(u32),
    #[error("refcount_order {0} is outside 0..=6")]
    RefcountOrder(u32),
    #[error("{0}")]
    Table(String),
}

fn be32(b: &[u8], at: usize) -> Result<u32, HeaderError> {
    Ok(u32::from_be_bytes(
        b.get(at..at + 4)
            .ok_or(HeaderError::Truncated)?
            .try_into()
            .expect("4 bytes"),
    ))
}

fn be64(b: &[u8], at: usize) -> Result<u64, HeaderError> {
    Ok(u64::from_be_bytes(
        b.get(at..at + 8)
            .ok_or(HeaderError::Truncated)?
            .try_into()
            .expect("8 bytes"),
    ))
}

/// A backing file's name as messages show it: at most 200 characters, the
/// rest cut (Debug formatting escapes NULs and control characters).
fn backing_name(b: &[u8], offset: u64, len: u32) -> String {
    let name = usize::try_from(offset)
        .ok()
        .and_then(|at| b.get(at..at.checked_add(len.min(1023) as usize)?))
        .unwrap_or_default();
    String::from_utf8_lossy(name).chars().take(200).collect()
}

/// Checks the first bytes of a qcow2 file (64 KiB covers any header):
/// everything qcow2-rs would trip over, before it sees the file.
pub fn parse_header(b: &[u8]) -> Result<Header, HeaderError> {
    if !b.starts_with(b"QFI\xfb") {
        return Err(HeaderError::NotQcow2);
    }
    let version = be32(b, 4)?;
    if !(2..=3).contains(&version) {
        return Err(HeaderError::Version(version));
    }
    let cluster_bits = be32(b, 20)?;
    if !CLUSTER_BITS.contains(&cluster_bits) {
        return Err(HeaderError::ClusterBits(cluster_bits));
    }
    let virtual_size = be64(b, 24)?;
    let crypt = be32(b, 32)?;
    if crypt != 0 {
        return Err(HeaderError::Encrypted(crypt));
    }
    let backing_offset = be64(b, 8)?;
    if backing_offset != 0 {
        return Err(HeaderError::Backing(backing_name(
            b,
            backing_offset,
            be32(b, 16)?,
        )));
    }
    if version == 3 {
        let features = be64(b, 72)?;
        let header_length = be32(b, 100)?;
        let checks = [
            (0, HeaderError::Dirty),
            (1, HeaderError::Corrupt),
            (2, HeaderError::ExternalData),
            (3, HeaderError::Zstd),
            (4, HeaderError::ExtendedL2),
        ];
        for (bit, err) in checks {
            if features & (1 << bit) != 0 {
                return Err(err);
            }
        }
        if features >> 5 != 0 {
            return Err(HeaderError::UnknownFeatures(features));
        }
        if header_length < 104 || !header_length.is_multiple_of(8) {
            return Err(HeaderError::Table(format!(
                "header_length {header_length} is not a multiple of 8 of at least 104"
            )));
        }
        if header_length > 104 && *b.get(104).ok_or(HeaderError::Truncated)? != 0 {
            return Err(HeaderError::Zstd);
        }
        let order = be32(b, 96)?;
        if order > 6 {
            return Err(HeaderError::RefcountOrder(order));
        }
    }
    let snapshots = be32(b, 60)?;
    if snapshots != 0 {
        return Err(HeaderError::Snapshots(snapshots));
    }
    if virtual_size == 0 || !virtual_size.is_multiple_of(512) {
        return Err(HeaderError::VirtualSize(virtual_size));
    }
    // Each L1 entry maps one L2 table: cluster_size / 8 clusters.
    let l1_needed = virtual_size.div_ceil(1 << (2 * cluster_bits - 3));
    if l1_needed * 8 > MAX_L1_BYTES {
        return Err(HeaderError::TooLarge {
            size: virtual_size,
            bytes: l1_needed * 8,
        });
    }
    let l1_entries = be32(b, 36)?;
    if u64::from(l1_entries) < l1_needed || u64::from(l1_entries) * 8 > MAX_L1_BYTES {
        return Err(HeaderError::Table(format!(
            "the L1 table has {l1_entries} entries; a virtual size of {virtual_size} \
             needs {l1_needed} (and at most {} are read)",
            MAX_L1_BYTES / 8
        )));
    }
    let refcount_table_clusters = be32(b, 56)?;
    let refcount_bytes = u64::from(refcount_table_clusters) << cluster_bits;
    if refcount_table_clusters == 0 || refcount_bytes > MAX_REFCOUNT_TABLE_BYTES {
        return Err(HeaderError::Table(format!(
            "the refcount table is {refcount_table_clusters} clusters ({refcount_bytes} bytes; \
             1 cluster to {} MiB are accepted)",
            MAX_REFCOUNT_TABLE_BYTES >> 20
        )));
    }
    Ok(Header {
        version,
        cluster_bits,
        virtual_size,
        l1_entries,
        l1_offset: be64(b, 40)?,
        refcount_table_offset: be64(b, 48)?,
        refcount_table_clusters,
    })
}

/// Why a qcow2 image's tables were refused.
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// Something qcow2-rs would misread, or write over the header with.
    #[error(transparent)]
    Bad(#[from] HeaderError),
    /// A table or a data cluster the image needs lies past its end: the
    /// file lost its tail (qcow2-rs would read zeros there).
    #[error("{what} ends at byte {end}, past the end of the file")]
    PastEnd { what: String, end: u64 },
}

/// The guest byte ranges (start, end) that hold data, sorted and merged:
/// all else reads as zeros.
pub type Allocated = Vec<(u64, u64)>;

const L2_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// Bits that must be zero (qemu docs/interop/qcow2.txt): in a refcount
/// table entry, in an L1 entry, and in a standard L2 entry.
const REFTABLE_RESERVED: u64 = 0xff00_0000_0000_01ff;
const L1_RESERVED: u64 = 0x7f00_0000_0000_01ff;
const L2_RESERVED: u64 = 0x3f00_0000_0000_01fe;
const COPIED: u64 = 1 << 63;

fn reserved(what: String, entry: u64) -> TableError {
    HeaderError::Table(format!(
        "{what} is {entry:#x}, which qcow2 forbids (reserved bits, or COPIED without a cluster)"
    ))
    .into()
}

impl Header {
    fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// L1 entries the virtual size uses (the rest are never read).
    fn l1_used(&self) -> u64 {
        self.virtual_size.div_ceil(1 << (2 * self.cluster_bits - 3))
    }
}

/// Walks the refcount table, the L1 table and every L2 table of a file
/// whose header passed [`parse_header`]: each must lie inside the file,
/// cluster-aligned and off the header cluster, and so must every data
/// cluster. Reads one cluster at a time. Returns where data lies.
pub fn check_tables(file: &std::fs::File, h: &Header) -> Result<Allocated, TableError> {
    use std::os::unix::fs::FileExt;
    let file_len = file.metadata()?.len();
    let cs = h.cluster_size();
    let place = |what: &str, offset: u64, len: u64| -> Result<(), TableError> {
        if !offset.is_multiple_of(cs) || offset < cs {
            return Err(HeaderError::Table(format!(
                "{what} at byte {offset} is not a cluster of its own past the header"
            ))
            .into());
        }
        let end = offset.saturating_add(len);
        if end > file_len {
            return Err(TableError::PastEnd {
                what: what.to_owned(),
                end,
            });
        }
        Ok(())
    };
    let reftable_len = u64::from(h.refcount_table_clusters) << h.cluster_bits;
    place("the refcount table", h.refcount_table_offset, reftable_len)?;
    for_each_entry(file, h.refcount_table_offset, reftable_len / 8, |i, e| {
        let block = e & L2_OFFSET_MASK;
        if e & REFTABLE_RESERVED != 0 {
            return Err(reserved(format!("refcount table entry {i}"), e));
        }
        if e != 0 {
            place(&format!("refcount block {i}"), block, cs)?;
        }
        Ok(())
    })?;
    place("the L1 table", h.l1_offset, u64::from(h.l1_entries) * 8)?;
    let entries_per_l2 = cs / 8;
    let mut allocated: Allocated = Vec::new();
    let mut l2 = vec![0u8; cs as usize];
    let mut l2_read = 0u64;
    for_each_entry(file, h.l1_offset, h.l1_used(), |i, e| {
        let table = e & L2_OFFSET_MASK;
        if e & L1_RESERVED != 0 {
            return Err(reserved(format!("L1 entry {i}"), e));
        }
        if table == 0 {
            return Ok(());
        }
        place(&format!("L2 table {i}"), table, cs)?;
        // Each L2 table is a cluster of its own, so a file holds at most
        // file_len / cs of them. More means L1 entries share tables, and
        // walking them could read the file many times over.
        l2_read += cs;
        if l2_read > file_len {
            return Err(HeaderError::Table(format!(
                "the L1 table points at more L2 tables than the file's {file_len} bytes hold"
            ))
            .into());
        }
        file.read_exact_at(&mut l2, table)?;
        for (j, raw) in l2.chunks_exact(8).enumerate() {
            let entry = u64::from_be_bytes(raw.try_into().expect("8 bytes"));
            let guest = (i * entries_per_l2 + j as u64) * cs;
            if guest >= h.virtual_size || entry == 0 {
                continue;
            }
            let what = || format!("the cluster of guest byte {guest}");
            if entry & (1 << 62) != 0 {
                // Compressed: host offset in the low bits, then the count
                // of further 512-byte sectors (qcow2 spec, "Compressed
                // Clusters Descriptor").
                let x = 62 - (h.cluster_bits - 8);
                let offset = entry & ((1 << x) - 1);
                let sectors = ((entry >> x) & ((1 << (h.cluster_bits - 8)) - 1)) + 1;
                let end = (offset & !511) + sectors * 512;
                // The last sector of a compressed cluster may be short.
                if offset >= file_len || end > file_len.next_multiple_of(512) {
                    return Err(TableError::PastEnd { what: what(), end });
                }
            } else {
                let host = entry & L2_OFFSET_MASK;
                if entry & L2_RESERVED != 0 || (host == 0 && entry & COPIED != 0) {
                    // qcow2-rs takes a COPIED entry without a cluster for a
                    // backing-file mapping, and fails writing it.
                    return Err(reserved(
                        format!("the L2 entry of guest byte {guest}"),
                        entry,
                    ));
                }
                if host == 0 {
                    continue; // reads as zeros (the "all zeros" flag, or unallocated)
                }
                place(&what(), host, cs)?;
                if entry & 1 != 0 {
                    continue; // preallocated, but reads as zeros
                }
            }
            let end = (guest + cs).min(h.virtual_size);
            match allocated.last_mut() {
                Some(last) if last.1 == guest => last.1 = end,
                _ => allocated.push((guest, end)),
            }
        }
        Ok(())
    })?;
    Ok(allocated)
}

/// Calls `f(index, entry)` for `count` big-endian u64 entries at `offset`,
/// reading 64 KiB at a time.
fn for_each_entry(
    file: &std::fs::File,
    offset: u64,
    count: u64,
    mut f: impl FnMut(u64, u64) -> Result<(), TableError>,
) -> Result<(), TableError> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; 64 * 1024];
    let mut i = 0;
    while i < count {
        let n = (count - i).min(buf.len() as u64 / 8) as usize;
        file.read_exact_at(&mut buf[..n * 8], offset + i * 8)?;
        for raw in buf[..n * 8].chunks_exact(8) {
            f(i, u64::from_be_bytes(raw.try_into().expect("8 bytes")))?;
            i += 1;
        }
    }
    Ok(())
}

/// A checked qcow2 image opened through qcow2-rs. Its futures are not Send,
/// so it drives them on its own current-thread runtime.
pub struct Qcow2 {
    rt: tokio::runtime::Runtime,
    /// Always Some until dropped.
    dev: Option<Qcow2Dev<Qcow2IoTokio>>,
    path: std::path::PathBuf,
    pub header: Header,
    /// False from a write until the flush after it. qcow2-rs asserts in
    /// Drop that no cached table is dirty; after a failed write one is, and
    /// its panic in Drop (twice: an abort) would end the process instead of
    /// the error being reported. Such a device is leaked, not dropped.
    clean: std::cell::Cell<bool>,
}

impl Drop for Qcow2 {
    fn drop(&mut self) {
        if !self.clean.get() {
            std::mem::forget(self.dev.take());
        }
    }
}

impl std::fmt::Debug for Qcow2 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qcow2")
            .field("header", &self.header)
            .finish()
    }
}

thread_local! {
    /// Set while this thread runs a [`guarded`] call.
    static GUARDED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs a qcow2-rs call, turning a panic inside it (it unwraps on some
/// malformed images the checks above may still miss) into an error instead
/// of a crash. The panic's own "panicked at" report is kept off stderr: the
/// error says what failed, once.
fn guarded<T>(what: &str, f: impl FnOnce() -> std::io::Result<T>) -> std::io::Result<T> {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let report = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !GUARDED.with(|g| g.get()) {
                report(info);
            }
        }));
    });
    let was = GUARDED.with(|g| g.replace(true));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    GUARDED.with(|g| g.set(was));
    result.unwrap_or_else(|panic| {
        let why = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        Err(std::io::Error::other(format!(
            "qcow2 {what} failed on a malformed image: {why}"
        )))
    })
}

/// I/O granularity qcow2-rs requires.
pub const ALIGN: u64 = 512;

fn check_aligned(len: usize, offset: u64) -> std::io::Result<()> {
    if offset.is_multiple_of(ALIGN) && (len as u64).is_multiple_of(ALIGN) {
        Ok(())
    } else {
        Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("qcow2 I/O of {len} bytes at {offset} is not {ALIGN}-byte aligned"),
        ))
    }
}

impl Qcow2 {
    /// Opens an image whose header already passed [`parse_header`].
    pub fn open(path: &Path, header: Header, writable: bool) -> std::io::Result<Qcow2> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        // A 1 MiB cache of 4 KiB L2 slices, not qcow2-rs's default of up to
        // 32 MiB: imgbuild touches META and streams partitions once.
        let params = Qcow2DevParams::new(9, None, Some((12, 1 << 20)), !writable, false);
        let dev = guarded("open", || {
            rt.block_on(qcow2_rs::utils::qcow2_setup_dev_tokio(path, &params))
                .map_err(|e| std::io::Error::other(format!("qcow2: {e:?}")))
        })?;
        Ok(Qcow2 {
            rt,
            dev: Some(dev),
            path: path.to_owned(),
            header,
            clean: std::cell::Cell::new(true),
        })
    }

    fn dev(&self) -> &Qcow2Dev<Qcow2IoTokio> {
        self.dev
            .as_ref()
            .expect("the device lives until Qcow2 is dropped")
    }

    /// Reads whole sectors at a sector-aligned offset.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        check_aligned(buf.len(), offset)?;
        let mut aligned = Qcow2IoBuf::<u8>::new(buf.len());
        guarded("read", || {
            self.rt
                .block_on(self.dev().read_at(&mut aligned, offset))
                .map_err(|e| std::io::Error::other(format!("qcow2 read at {offset}: {e:?}")))
        })?;
        buf.copy_from_slice(&aligned);
        Ok(())
    }

    /// Writes whole sectors at a sector-aligned offset.
    pub fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        check_aligned(buf.len(), offset)?;
        let mut aligned = Qcow2IoBuf::<u8>::new(buf.len());
        aligned.copy_from_slice(buf);
        self.clean.set(false);
        guarded("write", || {
            self.rt
                .block_on(self.dev().write_at(&aligned, offset))
                .map_err(|e| std::io::Error::other(format!("qcow2 write at {offset}: {e:?}")))
        })
    }

    /// Writes back cached metadata (L2 and refcount tables), then fsyncs
    /// the file: qcow2-rs's flush writes but does not sync.
    pub fn flush(&self) -> std::io::Result<()> {
        guarded("flush", || {
            self.rt
                .block_on(self.dev().flush_meta())
                .map_err(|e| std::io::Error::other(format!("qcow2 flush: {e:?}")))
        })?;
        self.clean.set(true);
        std::fs::File::open(&self.path)?.sync_all()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal v3 header: 64 KiB clusters, 1 GiB, no features.
    fn header() -> Vec<u8> {
        let mut b = vec![0u8; 4096];
        b[..4].copy_from_slice(b"QFI\xfb");
        b[4..8].copy_from_slice(&3u32.to_be_bytes());
        b[20..24].copy_from_slice(&16u32.to_be_bytes());
        b[24..32].copy_from_slice(&(1u64 << 30).to_be_bytes());
        b[36..40].copy_from_slice(&2u32.to_be_bytes());
        b[56..60].copy_from_slice(&1u32.to_be_bytes());
        b[96..100].copy_from_slice(&4u32.to_be_bytes());
        b[100..104].copy_from_slice(&112u32.to_be_bytes());
        b
    }

    fn with(at: usize, bytes: &[u8]) -> Vec<u8> {
        let mut b = header();
        b[at..at + bytes.len()].copy_from_slice(bytes);
        b
    }

    fn with_features(bits: u64) -> Vec<u8> {
        let mut b = header();
        b[72..80].copy_from_slice(&bits.to_be_bytes());
        b
    }

    fn with_backing(name: &str) -> Vec<u8> {
        let mut b = header();
        b[8..16].copy_from_slice(&512u64.to_be_bytes());
        b[16..20].copy_from_slice(&(name.len() as u32).to_be_bytes());
        b[512..512 + name.len()].copy_from_slice(name.as_bytes());
        b
    }

    #[test]
    fn panics_inside_qcow2_rs_become_errors() {
        let err = guarded::<()>("read", || panic!("index out of bounds")).unwrap_err();
        assert!(
            err.to_string()
                .contains("qcow2 read failed on a malformed image: index out of bounds")
        );
    }

    #[test]
    fn a_plain_header_passes() {
        let h = parse_header(&header()).unwrap();
        assert_eq!(
            (h.version, h.cluster_bits, h.virtual_size),
            (3, 16, 1 << 30)
        );
        assert_eq!((h.l1_entries, h.refcount_table_clusters), (2, 1));
    }

    #[test]
    fn every_unsupported_feature_is_named() {
        assert_eq!(parse_header(&with_features(1)), Err(HeaderError::Dirty));
        assert_eq!(parse_header(&with_features(2)), Err(HeaderError::Corrupt));
        assert_eq!(
            parse_header(&with_features(4)),
            Err(HeaderError::ExternalData)
        );
        assert_eq!(parse_header(&with_features(8)), Err(HeaderError::Zstd));
        assert_eq!(
            parse_header(&with_features(16)),
            Err(HeaderError::ExtendedL2)
        );
        assert_eq!(
            parse_header(&with_features(64)),
            Err(HeaderError::UnknownFeatures(64))
        );
        let mut zstd_field = header();
        zstd_field[104] = 1;
        assert_eq!(parse_header(&zstd_field), Err(HeaderError::Zstd));
        let mut enc = header();
        enc[32..36].copy_from_slice(&2u32.to_be_bytes());
        assert_eq!(parse_header(&enc), Err(HeaderError::Encrypted(2)));
    }

    #[test]
    fn any_backing_file_is_refused_with_its_name_escaped() {
        for name in [
            "/srv/base.qcow2",
            "../other/base.qcow2",
            "base.qcow2",
            "a\0b",
        ] {
            let err = parse_header(&with_backing(name)).unwrap_err();
            assert_eq!(err, HeaderError::Backing(name.into()));
            let msg = err.to_string();
            assert!(!msg.contains('\0'), "{msg:?}");
        }
        let mut far = with_backing("/x");
        far[8..16].copy_from_slice(&u64::MAX.to_be_bytes());
        assert_eq!(parse_header(&far), Err(HeaderError::Backing(String::new())));
    }

    #[test]
    fn geometry_qcow2_rs_cannot_handle_is_refused() {
        // 512-byte clusters (qcow2-rs indexes out of bounds).
        assert_eq!(
            parse_header(&with(20, &9u32.to_be_bytes())),
            Err(HeaderError::ClusterBits(9))
        );
        // Size 0 and a size that is not whole sectors.
        assert_eq!(
            parse_header(&with(24, &0u64.to_be_bytes())),
            Err(HeaderError::VirtualSize(0))
        );
        assert_eq!(
            parse_header(&with(24, &1000u64.to_be_bytes())),
            Err(HeaderError::VirtualSize(1000))
        );
        // The largest size: an L1 table of 2^48 bytes.
        let huge = !511u64;
        assert!(matches!(
            parse_header(&with(24, &huge.to_be_bytes())),
            Err(HeaderError::TooLarge { size, .. }) if size == huge
        ));
        // An L1 table too short for the size.
        let short = parse_header(&with(36, &1u32.to_be_bytes())).unwrap_err();
        assert!(short.to_string().contains("needs 2"), "{short}");
        // refcount_table_clusters = 2^31 (a SIGSEGV in qcow2-rs) and 0.
        for clusters in [1u32 << 31, 50_000, 0] {
            let err = parse_header(&with(56, &clusters.to_be_bytes())).unwrap_err();
            assert!(
                err.to_string().contains(&format!("{clusters} clusters")),
                "{err}"
            );
        }
        assert_eq!(
            parse_header(&with(60, &1u32.to_be_bytes())),
            Err(HeaderError::Snapshots(1))
        );
        assert_eq!(
            parse_header(&with(96, &7u32.to_be_bytes())),
            Err(HeaderError::RefcountOrder(7))
        );
    }

    /// A 4 GiB image of four 64 KiB clusters: header, L1 (8 entries),
    /// refcount table, one L2 table mapping guest cluster 5 to cluster 3.
    fn tables(l1: &[u64]) -> (tempfile::NamedTempFile, Header) {
        let mut b = with(24, &(4u64 << 30).to_be_bytes());
        b[36..40].copy_from_slice(&8u32.to_be_bytes());
        b[40..48].copy_from_slice(&65536u64.to_be_bytes());
        b[48..56].copy_from_slice(&(2 * 65536u64).to_be_bytes());
        b.resize(4 * 65536, 0);
        for (i, e) in l1.iter().enumerate() {
            b[65536 + 8 * i..][..8].copy_from_slice(&e.to_be_bytes());
        }
        let l2 = 3 * 65536usize;
        b[l2 + 40..l2 + 48].copy_from_slice(&((1u64 << 63) | l2 as u64).to_be_bytes());
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), &b).unwrap();
        let h = parse_header(&b).unwrap();
        (f, h)
    }

    #[test]
    fn tables_are_walked_within_the_file() {
        let l2 = (1u64 << 63) | (3 * 65536);
        let (f, h) = tables(&[l2]);
        let allocated = check_tables(f.as_file(), &h).unwrap();
        assert_eq!(allocated, vec![(5 * 65536, 6 * 65536)]);
        // Eight L1 entries sharing one L2 table: more tables than the file
        // can hold, which would read it over and over.
        let (f, h) = tables(&[l2; 8]);
        let err = check_tables(f.as_file(), &h).unwrap_err().to_string();
        assert!(
            err.contains("more L2 tables than the file's 262144 bytes"),
            "{err}"
        );
        // An L2 table past the end, and one on the header.
        let (f, h) = tables(&[9 * 65536]);
        let err = check_tables(f.as_file(), &h).unwrap_err().to_string();
        assert_eq!(
            err,
            "L2 table 0 ends at byte 655360, past the end of the file"
        );
        let (f, h) = tables(&[512]);
        let err = check_tables(f.as_file(), &h).unwrap_err().to_string();
        assert!(
            err.contains("not a cluster of its own past the header"),
            "{err}"
        );
    }

    #[test]
    fn malformed_headers_are_errors_not_panics() {
        assert_eq!(parse_header(b"QFI\xfb\0\0"), Err(HeaderError::Truncated));
        assert_eq!(parse_header(b"Not Found"), Err(HeaderError::NotQcow2));
        let mut v = header();
        v[4..8].copy_from_slice(&9u32.to_be_bytes());
        assert_eq!(parse_header(&v), Err(HeaderError::Version(9)));
        let mut c = header();
        c[20..24].copy_from_slice(&40u32.to_be_bytes());
        assert_eq!(parse_header(&c), Err(HeaderError::ClusterBits(40)));
    }

    proptest::proptest! {
        #![proptest_config(crate::fuzz_config())]
        #[test]
        fn fuzz_qcow2_header_never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..4096)) {
            if !crate::fuzz_time_left() {
                return Ok(());
            }
            let _ = parse_header(&bytes);
            let mut b = header();
            b[..bytes.len().min(4096)].copy_from_slice(&bytes[..bytes.len().min(4096)]);
            b[..4].copy_from_slice(b"QFI\xfb");
            let _ = parse_header(&b);
        }
    }
}
