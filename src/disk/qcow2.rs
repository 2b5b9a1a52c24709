//! qcow2 images: the header check (pure, over bytes), the walk over the
//! tables, then block access of our own for images that pass both. The
//! format: qemu's docs/interop/qcow2.txt. Only what imgbuild meets is read
//! or written (no backing files, snapshots, encryption, external data, zstd
//! or subclusters): everything else is refused by the checks, by name.

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
    /// log2 of a refcount's width in bits (4 in version 2).
    pub refcount_order: u32,
}

/// The largest L1 table imgbuild accepts (a bound on what a header can make
/// it read and check, sized by the virtual size). 16 MiB maps 1 PiB with the default
/// 64 KiB clusters; qemu's own limit is 32 MiB (QCOW_MAX_L1_SIZE in
/// qemu/block/qcow2.h).
pub const MAX_L1_BYTES: u64 = 16 << 20;
/// The largest refcount table, qemu's QCOW_MAX_REFTABLE_SIZE (8 MiB).
pub const MAX_REFCOUNT_TABLE_BYTES: u64 = 8 << 20;
/// Cluster sizes imgbuild accepts: 4 KiB to 2 MiB (qemu allows 512 bytes
/// too, which no image builder writes).
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
/// everything the block access below does not handle, refused by name.
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
    let mut refcount_order = 4;
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
        refcount_order = order;
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
        refcount_order,
    })
}

/// Why a qcow2 image's tables were refused.
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// Something the block access would misread, or write over the header with.
    #[error(transparent)]
    Bad(#[from] HeaderError),
    /// A table or a data cluster the image needs lies past its end: the
    /// file lost its tail (its bytes would read as zeros).
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
                    // qcow2.txt: COPIED must be 0 when there is no cluster.
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

/// A checked qcow2 image: reads through its L1 and L2 tables (standard,
/// zero and deflate-compressed clusters); a write lands in place when the
/// cluster is the image's own, else in a new cluster appended at the end of
/// the file, with the L2 table and the refcounts kept as `qemu-img check`
/// expects (qemu docs/interop/qcow2.txt). Every table and data cluster was
/// checked to lie inside the file by [`check_tables`] before this opens.
pub struct Qcow2 {
    file: std::fs::File,
    pub header: Header,
    /// Where the next cluster is allocated: the file's end, cluster-aligned.
    end: std::cell::Cell<u64>,
}

impl std::fmt::Debug for Qcow2 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qcow2")
            .field("header", &self.header)
            .finish()
    }
}

/// The I/O granularity [`Qcow2::read_at`] and [`Qcow2::write_at`] take.
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

fn invalid(msg: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg)
}

/// Where a guest cluster's bytes are.
#[derive(Debug, Clone, Copy)]
enum Mapping {
    /// Unallocated or the zero flag without a cluster: reads as zeros.
    Zero,
    /// A host cluster with data; `own` when COPIED (refcount 1).
    Data { host: u64, own: bool },
    /// A host cluster that reads as zeros (preallocated, zero flag set).
    ZeroAt { host: u64, own: bool },
    /// A compressed cluster: the raw L2 entry.
    Compressed(u64),
}

impl Qcow2 {
    /// Opens an image whose header passed [`parse_header`] and whose tables
    /// passed [`check_tables`].
    pub fn open(path: &Path, header: Header, writable: bool) -> std::io::Result<Qcow2> {
        let file = crate::io::open_regular(path, writable)?;
        let cs = header.cluster_size();
        let end = file.metadata()?.len().next_multiple_of(cs);
        Ok(Qcow2 {
            file,
            header,
            end: std::cell::Cell::new(end),
        })
    }

    fn cs(&self) -> u64 {
        self.header.cluster_size()
    }

    fn read_u64(&self, at: u64) -> std::io::Result<u64> {
        use std::os::unix::fs::FileExt;
        let mut b = [0u8; 8];
        self.file.read_exact_at(&mut b, at)?;
        Ok(u64::from_be_bytes(b))
    }

    fn write_u64(&self, at: u64, v: u64) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        self.file.write_all_at(&v.to_be_bytes(), at)
    }

    /// The L1 index and L2 index of guest cluster `g`.
    fn indices(&self, g: u64) -> std::io::Result<(u64, u64)> {
        let per_l2 = self.cs() / 8;
        let (i, j) = (g / per_l2, g % per_l2);
        if i >= u64::from(self.header.l1_entries) {
            return Err(invalid(format!(
                "qcow2: guest cluster {g} is past the L1 table"
            )));
        }
        Ok((i, j))
    }

    /// The L2 table of guest cluster `g` (0 for none) and its entry.
    fn lookup(&self, g: u64) -> std::io::Result<(u64, u64, Mapping)> {
        let (i, j) = self.indices(g)?;
        let l1 = self.read_u64(self.header.l1_offset + 8 * i)?;
        let table = l1 & L2_OFFSET_MASK;
        if table == 0 {
            return Ok((l1, 0, Mapping::Zero));
        }
        let entry = self.read_u64(table + 8 * j)?;
        let host = entry & L2_OFFSET_MASK;
        let own = entry & COPIED != 0;
        let mapping = if entry & (1 << 62) != 0 {
            Mapping::Compressed(entry)
        } else if host == 0 {
            Mapping::Zero
        } else if entry & 1 != 0 {
            Mapping::ZeroAt { host, own }
        } else {
            Mapping::Data { host, own }
        };
        Ok((l1, entry, mapping))
    }

    /// A compressed cluster's host byte range: its offset and the end of
    /// its last 512-byte sector (qcow2.txt, "Compressed Clusters Descriptor").
    fn compressed_range(&self, entry: u64) -> (u64, u64) {
        let cb = self.header.cluster_bits;
        let x = 62 - (cb - 8);
        let offset = entry & ((1 << x) - 1);
        let sectors = ((entry >> x) & ((1 << (cb - 8)) - 1)) + 1;
        (offset, (offset & !511) + sectors * 512)
    }

    /// A whole guest cluster's bytes.
    fn read_cluster(&self, mapping: Mapping, out: &mut [u8]) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        match mapping {
            Mapping::Zero | Mapping::ZeroAt { .. } => out.fill(0),
            Mapping::Data { host, .. } => self.file.read_exact_at(out, host)?,
            Mapping::Compressed(entry) => {
                let (offset, end) = self.compressed_range(entry);
                let len = self.file.metadata()?.len();
                let end = end.min(len);
                let mut raw = vec![0u8; end.saturating_sub(offset) as usize];
                self.file.read_exact_at(&mut raw, offset)?;
                // Raw deflate (no zlib header), at most one cluster out.
                let mut z = flate2::Decompress::new(false);
                let status = z.decompress(&raw, out, flate2::FlushDecompress::Finish);
                if !matches!(status, Ok(flate2::Status::StreamEnd)) || z.total_out() != self.cs() {
                    return Err(invalid(format!(
                        "qcow2: the compressed cluster at byte {offset} does not inflate to one cluster"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Reads whole sectors at a sector-aligned offset.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        check_aligned(buf.len(), offset)?;
        self.in_bounds(buf.len(), offset)?;
        let cs = self.cs();
        let mut cluster = Vec::new();
        let mut done = 0usize;
        while done < buf.len() {
            let pos = offset + done as u64;
            let (g, within) = (pos / cs, pos % cs);
            let n = ((cs - within) as usize).min(buf.len() - done);
            let out = &mut buf[done..done + n];
            match self.lookup(g)?.2 {
                Mapping::Data { host, .. } => self.file.read_exact_at(out, host + within)?,
                Mapping::Zero | Mapping::ZeroAt { .. } => out.fill(0),
                m @ Mapping::Compressed(_) => {
                    cluster.resize(cs as usize, 0);
                    self.read_cluster(m, &mut cluster)?;
                    out.copy_from_slice(&cluster[within as usize..within as usize + n]);
                }
            }
            done += n;
        }
        Ok(())
    }

    fn in_bounds(&self, len: usize, offset: u64) -> std::io::Result<()> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.header.virtual_size => Ok(()),
            _ => Err(invalid(format!(
                "qcow2 I/O of {len} bytes at {offset} is past the virtual size {}",
                self.header.virtual_size
            ))),
        }
    }

    /// Writes whole sectors at a sector-aligned offset. Call [`Qcow2::flush`]
    /// to make them durable.
    pub fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        check_aligned(buf.len(), offset)?;
        self.in_bounds(buf.len(), offset)?;
        let cs = self.cs();
        let mut done = 0usize;
        while done < buf.len() {
            let pos = offset + done as u64;
            let (g, within) = (pos / cs, pos % cs);
            let n = ((cs - within) as usize).min(buf.len() - done);
            let data = &buf[done..done + n];
            let (l1, _, mapping) = self.lookup(g)?;
            match mapping {
                Mapping::Data { host, own: true } => self.file.write_all_at(data, host + within)?,
                Mapping::ZeroAt { host, own: true } => {
                    let mut cluster = vec![0u8; cs as usize];
                    cluster[within as usize..within as usize + n].copy_from_slice(data);
                    self.file.write_all_at(&cluster, host)?;
                    self.set_l2(g, l1, host | COPIED)?;
                }
                old => {
                    // Copy on write: the old contents with the new bytes
                    // over them, into a cluster of our own.
                    let mut cluster = vec![0u8; cs as usize];
                    self.read_cluster(old, &mut cluster)?;
                    cluster[within as usize..within as usize + n].copy_from_slice(data);
                    let host = self.allocate()?;
                    self.file.write_all_at(&cluster, host)?;
                    self.set_l2(g, l1, host | COPIED)?;
                    match old {
                        Mapping::Data { host, .. } | Mapping::ZeroAt { host, .. } => {
                            self.add_refcount(host, -1)?;
                        }
                        Mapping::Compressed(entry) => {
                            let (offset, end) = self.compressed_range(entry);
                            let mut c = offset & !(cs - 1);
                            while c < end {
                                self.add_refcount(c, -1)?;
                                c += cs;
                            }
                        }
                        Mapping::Zero => {}
                    }
                }
            }
            done += n;
        }
        Ok(())
    }

    /// Points guest cluster `g`'s L2 entry at `entry`, giving it an L2 table
    /// of its own first if it has none (`l1` is its L1 entry).
    fn set_l2(&self, g: u64, l1: u64, entry: u64) -> std::io::Result<()> {
        let (i, j) = self.indices(g)?;
        let mut table = l1 & L2_OFFSET_MASK;
        if table != 0 && l1 & COPIED == 0 {
            return Err(invalid(format!(
                "qcow2: L2 table {i} is shared (not COPIED), which imgbuild does not write"
            )));
        }
        if table == 0 {
            table = self.allocate()?;
            use std::os::unix::fs::FileExt;
            self.file
                .write_all_at(&vec![0u8; self.cs() as usize], table)?;
            self.write_u64(self.header.l1_offset + 8 * i, table | COPIED)?;
        }
        self.write_u64(table + 8 * j, entry)
    }

    /// A new cluster at the end of the file, its refcount 1.
    fn allocate(&self) -> std::io::Result<u64> {
        let host = self.end.get();
        self.end.set(host + self.cs());
        self.add_refcount(host, 1)?;
        Ok(host)
    }

    /// Adds `delta` to the refcount of the cluster at `host`, giving the
    /// refcount table a new block (itself counted) where it has none.
    fn add_refcount(&self, host: u64, delta: i64) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        let h = &self.header;
        let cs = self.cs();
        let bits = 1u64 << h.refcount_order;
        let per_block = cs * 8 / bits;
        let cluster = host / cs;
        let (b, k) = (cluster / per_block, cluster % per_block);
        let table_entries = (u64::from(h.refcount_table_clusters) << h.cluster_bits) / 8;
        if b >= table_entries {
            return Err(invalid(format!(
                "qcow2: the refcount table has no room for byte {host}; \
                 convert the image with `qemu-img convert -O qcow2`"
            )));
        }
        let slot = h.refcount_table_offset + 8 * b;
        let mut block = self.read_u64(slot)? & L2_OFFSET_MASK;
        if block == 0 {
            block = self.end.get();
            self.end.set(block + cs);
            self.file.write_all_at(&vec![0u8; cs as usize], block)?;
            self.write_u64(slot, block)?;
            self.add_refcount(block, 1)?;
        }
        // Refcounts narrower than a byte fill it from the low bits (qemu's
        // get_refcount_ro0..2); wider ones are big-endian.
        let bit = k * bits;
        let width = bits.div_ceil(8) as usize;
        let at = block + bit / 8;
        let mut raw = [0u8; 8];
        self.file.read_exact_at(&mut raw[8 - width..], at)?;
        let word = u64::from_be_bytes(raw);
        let (shift, mask) = if bits < 8 {
            (bit % 8, (1u64 << bits) - 1)
        } else {
            (0, u64::MAX >> (64 - bits))
        };
        let old = (word >> shift) & mask;
        let new = old
            .checked_add_signed(delta)
            .filter(|v| *v <= mask)
            .ok_or_else(|| {
                invalid(format!(
                    "qcow2: the refcount of byte {host} is {old}, which cannot change by {delta}"
                ))
            })?;
        let word = (word & !(mask << shift)) | (new << shift);
        self.file.write_all_at(&word.to_be_bytes()[8 - width..], at)
    }

    /// Makes the writes so far durable.
    pub fn flush(&self) -> std::io::Result<()> {
        self.file.sync_all()
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
    fn geometry_imgbuild_does_not_handle_is_refused() {
        // 512-byte clusters.
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
        // refcount_table_clusters = 2^31 (2^47 bytes of table) and 0.
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

    fn qemu_img(args: &[&str]) -> std::process::Output {
        let out = std::process::Command::new("qemu-img")
            .args(args)
            .output()
            .expect("qemu-img runs (make deps installs it)");
        assert!(
            out.status.success(),
            "qemu-img {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    /// Images as qemu-img writes them (plain, deflate-compressed, 1-bit
    /// refcounts, 4 KiB clusters, 64-bit refcounts), written through
    /// [`Qcow2`] over data, over zeros, where no L2 table exists yet and
    /// past the last refcount block: reading back through
    /// [`Qcow2`] and through qemu-img gives what a raw copy given the same
    /// writes holds, and `qemu-img check` finds no error and no leak.
    #[test]
    fn writes_read_back_through_qemu_img_with_consistent_refcounts() {
        use std::os::unix::fs::FileExt;
        const SIZE: u64 = 640 << 20;
        let dir = tempfile::tempdir().unwrap();
        let raw = dir.path().join("base.raw");
        let base = std::fs::File::create(&raw).unwrap();
        base.set_len(SIZE).unwrap();
        let data: Vec<u8> = (0..(1u32 << 20)).map(|i| (i % 251) as u8).collect();
        base.write_all_at(&data, 0).unwrap();
        base.write_all_at(&data[..70_000], 300 << 20).unwrap();
        let writes: [(u64, usize, u8); 6] = [
            (0, 512, 0xaa),                          // inside data
            (3 * 65536 - 1024, 4096, 0xbb),          // across two data clusters
            ((2 << 20) + 1024, 70_144, 0xcc),        // zeros, L2 table present
            ((300 << 20) + 65536 - 512, 1024, 0xdd), // data, then zeros
            ((600 << 20) + 512, 8192, 0xee),         // no L2 table yet
            (100 << 20, 5 << 19, 0xf1),              // past a refcount block
        ];
        for opts in [
            &[][..],
            &["-c"],
            &["-o", "refcount_bits=1"],
            &["-o", "cluster_size=4096"],
            // A refcount block covers 2 MiB of file: the 2.5 MiB write
            // needs a new one.
            &["-o", "cluster_size=4096,refcount_bits=64"],
        ] {
            let q = dir.path().join("image.qcow2");
            let want = dir.path().join("want.raw");
            std::fs::copy(&raw, &want).unwrap();
            let mut args = vec!["convert", "-f", "raw", "-O", "qcow2"];
            args.extend_from_slice(opts);
            args.extend([raw.to_str().unwrap(), q.to_str().unwrap()]);
            qemu_img(&args);
            let head = std::fs::read(&q).unwrap();
            let h = parse_header(&head[..head.len().min(65536)]).unwrap();
            check_tables(&std::fs::File::open(&q).unwrap(), &h).unwrap();
            let image = Qcow2::open(&q, h, true).unwrap();
            let want_file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&want)
                .unwrap();
            for (at, len, byte) in writes {
                image.write_at(&vec![byte; len], at).unwrap();
                want_file.write_all_at(&vec![byte; len], at).unwrap();
            }
            image.flush().unwrap();
            for (at, len, _) in writes {
                let (at, len) = (at.saturating_sub(65536 + 512), len + 2 * 65536);
                let mut got = vec![0u8; len];
                image.read_at(&mut got, at).unwrap();
                let mut expected = vec![0u8; len];
                want_file.read_exact_at(&mut expected, at).unwrap();
                assert!(got == expected, "{opts:?}: bytes at {at} differ");
            }
            drop(image);
            let check = qemu_img(&["check", q.to_str().unwrap()]);
            let report = String::from_utf8_lossy(&check.stdout);
            assert!(
                report.contains("No errors were found"),
                "{opts:?}: {report}"
            );
            let back = dir.path().join("back.raw");
            qemu_img(&[
                "convert",
                "-O",
                "raw",
                q.to_str().unwrap(),
                back.to_str().unwrap(),
            ]);
            let same = std::process::Command::new("cmp")
                .args([&back, &want])
                .status()
                .unwrap();
            assert!(same.success(), "{opts:?}: qemu-img reads other bytes");
        }
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
