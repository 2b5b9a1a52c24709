//! The GPT layout rules, on header fields and partition lists alone (no
//! I/O): the checks the gpt crate would panic on instead of refusing, the
//! usable area and partitions that must stay off the GPT and each other,
//! and which partition is META.

/// META is exactly this large in every Talos image.
pub const META_SIZE: u64 = 1024 * 1024;
/// The GPT's logical block size; imgbuild reads 512-byte-sector disks.
pub(super) const SECTOR: u64 = 512;

/// One GPT partition, with its byte range in the image.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Partition {
    pub number: u32,
    pub name: String,
    pub type_guid: String,
    pub offset: u64,
    pub size: u64,
}

/// The fields of a GPT header imgbuild checks (UEFI 2.10, 5.3.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptHeader {
    pub current_lba: u64,
    pub backup_lba: u64,
    pub first_usable: u64,
    pub last_usable: u64,
    pub entries_lba: u64,
    pub entries: u32,
    pub entry_size: u32,
    /// CRC32 of the partition entry array.
    pub entries_crc: u32,
}

fn gpt_crc32(b: &[u8]) -> u32 {
    let mut c = flate2::Crc::new();
    c.update(b);
    c.sum()
}

/// Whether the gpt crate takes `sector` as a header: the signature, and a
/// CRC32 over its first 92 bytes (gpt 4.1 `header::file_read_header`).
pub(super) fn gpt_header_valid(sector: &[u8]) -> bool {
    if sector.len() < 92 || &sector[..8] != b"EFI PART" {
        return false;
    }
    let mut h = sector[..92].to_vec();
    let stored = u32::from_le_bytes(h[16..20].try_into().expect("4 bytes"));
    h[16..20].fill(0);
    gpt_crc32(&h) == stored
}

/// The checks the gpt crate asserts (panics) on instead of returning an
/// error, and the bounds of what it allocates, made on the header it will
/// use before it sees the disk.
pub fn precheck_gpt_header(sector: &[u8]) -> Result<GptHeader, String> {
    if sector.len() < 92 || &sector[..8] != b"EFI PART" {
        return Err("no GPT signature".into());
    }
    let le32 = |at: usize| u32::from_le_bytes(sector[at..at + 4].try_into().expect("4 bytes"));
    let le64 = |at: usize| u64::from_le_bytes(sector[at..at + 8].try_into().expect("8 bytes"));
    let (header_size, entries, entry_size) = (le32(12), le32(80), le32(84));
    if !(92..=512).contains(&header_size) {
        return Err(format!("header size {header_size} is outside 92..=512"));
    }
    if entry_size != 128 {
        return Err(format!(
            "partition entry size {entry_size} (only 128 is supported)"
        ));
    }
    if entries > 1024 {
        return Err(format!(
            "{entries} partition entries (at most 1024 are supported)"
        ));
    }
    Ok(GptHeader {
        current_lba: le64(24),
        backup_lba: le64(32),
        first_usable: le64(40),
        last_usable: le64(48),
        entries_lba: le64(72),
        entries,
        entry_size,
        entries_crc: le32(88),
    })
}

impl GptHeader {
    /// The byte range of this header's partition entry array, if it is one.
    pub fn table_range(&self) -> Option<std::ops::Range<u64>> {
        let start = self.entries_lba.checked_mul(SECTOR)?;
        let len = u64::from(self.entries) * u64::from(self.entry_size);
        Some(start..start.checked_add(len)?)
    }

    /// Whether `table` (read from [`GptHeader::table_range`]) is the entry
    /// array this header's CRC describes.
    pub fn table_matches(&self, table: &[u8]) -> bool {
        gpt_crc32(table) == self.entries_crc
    }

    /// Where the disk this header describes ends: just past the later of
    /// its two headers. An image shorter than that lost its tail.
    pub fn disk_end(&self) -> Option<u64> {
        self.current_lba
            .max(self.backup_lba)
            .checked_add(1)?
            .checked_mul(SECTOR)
    }

    /// Checks that partitions can only live where no GPT structure does:
    /// the usable LBAs lie past the protective MBR, the first header and
    /// its entry array, and before the second entry array and header.
    pub fn check_usable_area(&self) -> Result<(), String> {
        let table = (u64::from(self.entries) * u64::from(self.entry_size)).div_ceil(SECTOR);
        let (lo, hi) = (
            self.current_lba.min(self.backup_lba),
            self.current_lba.max(self.backup_lba),
        );
        let (first, last) = (self.first_usable, self.last_usable);
        let own_table = self.entries_lba..self.entries_lba.saturating_add(table);
        let ok = first <= last
            && lo >= 1
            && first >= lo.saturating_add(1).saturating_add(table)
            && last.saturating_add(table) < hi
            && (own_table.end <= first || own_table.start > last);
        if ok {
            Ok(())
        } else {
            Err(format!(
                "usable LBAs {first}..={last} overlap the GPT's own structures \
                 (headers at LBA {lo} and {hi}, {table}-sector entry arrays, entries at LBA {})",
                self.entries_lba
            ))
        }
    }
}

/// Partitions that lie outside the usable LBAs (on the MBR or the GPT) or
/// on each other: writing META into one would destroy another structure.
pub fn check_partition_layout(header: &GptHeader, parts: &[Partition]) -> Result<(), String> {
    let lba = |p: &Partition| (p.offset / SECTOR, (p.offset + p.size) / SECTOR - 1);
    for p in parts {
        let (first, last) = lba(p);
        if first < header.first_usable || last > header.last_usable {
            return Err(format!(
                "partition {} ({:?}) spans LBA {first}..={last}, outside the usable LBAs {}..={} \
                 (it lies on the partition table)",
                p.number, p.name, header.first_usable, header.last_usable
            ));
        }
    }
    let mut sorted: Vec<&Partition> = parts.iter().collect();
    sorted.sort_by_key(|p| p.offset);
    for pair in sorted.windows(2) {
        if pair[0].offset + pair[0].size > pair[1].offset {
            return Err(format!(
                "partitions {} ({:?}) and {} ({:?}) overlap",
                pair[0].number, pair[0].name, pair[1].number, pair[1].name
            ));
        }
    }
    Ok(())
}

/// Why [`find_meta`] found no usable META.
#[derive(Debug, PartialEq, Eq)]
pub enum MetaLookup {
    Missing,
    WrongSize(u64),
    /// Several partitions are named META (their numbers).
    Duplicate(Vec<u32>),
}

/// The one partition named META (by name: its type GUID is shared),
/// exactly 1 MiB. Two named META are refused: editing the first while Talos
/// reads the other would lose the update silently.
pub fn find_meta(parts: &[Partition]) -> Result<&Partition, MetaLookup> {
    let named: Vec<&Partition> = parts.iter().filter(|p| p.name == "META").collect();
    if named.len() > 1 {
        return Err(MetaLookup::Duplicate(
            named.iter().map(|p| p.number).collect(),
        ));
    }
    let meta = named.first().ok_or(MetaLookup::Missing)?;
    if meta.size != META_SIZE {
        return Err(MetaLookup::WrongSize(meta.size));
    }
    Ok(meta)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(name: &str, size: u64) -> Partition {
        Partition {
            number: 1,
            name: name.into(),
            type_guid: "0FC63DAF-8483-4772-8E79-3D69D8477DE4".into(),
            offset: 1 << 20,
            size,
        }
    }

    #[test]
    fn meta_is_found_by_name_not_by_type() {
        let parts = [part("STATE", META_SIZE), part("META", META_SIZE)];
        assert_eq!(find_meta(&parts).unwrap().name, "META");
        assert_eq!(find_meta(&parts[..1]), Err(MetaLookup::Missing));
        let mut twice = [part("META", META_SIZE), part("META", META_SIZE)];
        twice[1].number = 4;
        assert_eq!(find_meta(&twice), Err(MetaLookup::Duplicate(vec![1, 4])));
        assert_eq!(
            find_meta(&[part("META", 2 * META_SIZE)]),
            Err(MetaLookup::WrongSize(2 * META_SIZE))
        );
    }

    #[test]
    fn gpt_headers_the_crate_would_panic_on_are_refused() {
        let mut h = vec![0u8; 512];
        h[..8].copy_from_slice(b"EFI PART");
        h[12..16].copy_from_slice(&92u32.to_le_bytes());
        h[80..84].copy_from_slice(&128u32.to_le_bytes());
        h[84..88].copy_from_slice(&128u32.to_le_bytes());
        assert!(precheck_gpt_header(&h).is_ok());
        h[84..88].copy_from_slice(&256u32.to_le_bytes());
        assert!(
            precheck_gpt_header(&h)
                .unwrap_err()
                .contains("entry size 256")
        );
        h[84..88].copy_from_slice(&128u32.to_le_bytes());
        h[80..84].copy_from_slice(&100_000u32.to_le_bytes());
        assert!(
            precheck_gpt_header(&h)
                .unwrap_err()
                .contains("100000 partition entries")
        );
        h[12..16].copy_from_slice(&8u32.to_le_bytes());
        assert!(
            precheck_gpt_header(&h)
                .unwrap_err()
                .contains("header size 8")
        );
        assert!(precheck_gpt_header(&[0u8; 512]).is_err());
    }

    /// sgdisk's layout of a 32 MiB disk: headers at LBA 1 and 65535, 128
    /// entries (32 sectors) at LBA 2 and before the backup.
    fn standard_header() -> GptHeader {
        GptHeader {
            current_lba: 1,
            backup_lba: 65535,
            first_usable: 34,
            last_usable: 65502,
            entries_lba: 2,
            entries: 128,
            entry_size: 128,
            entries_crc: 0,
        }
    }

    #[test]
    fn usable_areas_that_overlap_the_gpt_are_refused() {
        let h = standard_header();
        assert_eq!(h.check_usable_area(), Ok(()));
        assert_eq!(h.disk_end(), Some(32 << 20));
        let backup = GptHeader {
            current_lba: 65535,
            backup_lba: 1,
            entries_lba: 65503,
            ..h
        };
        assert_eq!(backup.check_usable_area(), Ok(()));
        for bad in [
            GptHeader {
                first_usable: 0,
                ..h
            },
            GptHeader {
                first_usable: 33,
                ..h
            },
            GptHeader {
                last_usable: 65503,
                ..h
            },
            GptHeader {
                entries_lba: 40,
                ..h
            },
            GptHeader {
                first_usable: 70000,
                ..h
            },
        ] {
            let err = bad.check_usable_area().unwrap_err();
            assert!(err.contains("overlap the GPT's own structures"), "{err}");
        }
    }

    #[test]
    fn partitions_on_the_gpt_or_on_each_other_are_refused() {
        let h = standard_header();
        let at = |number, name: &str, first: u64, last: u64| Partition {
            number,
            name: name.into(),
            type_guid: String::new(),
            offset: first * SECTOR,
            size: (last - first + 1) * SECTOR,
        };
        let good = [at(1, "EFI", 2048, 4095), at(2, "META", 4096, 6143)];
        assert_eq!(check_partition_layout(&h, &good), Ok(()));
        let err = check_partition_layout(&h, &[at(4, "META", 0, 2047)]).unwrap_err();
        assert!(
            err.contains("partition 4 (\"META\") spans LBA 0..=2047"),
            "{err}"
        );
        let err = check_partition_layout(&h, &[at(1, "X", 65000, 65535)]).unwrap_err();
        assert!(err.contains("outside the usable LBAs 34..=65502"), "{err}");
        let err =
            check_partition_layout(&h, &[good[1].clone(), at(3, "BOOT", 6000, 7000)]).unwrap_err();
        assert_eq!(err, "partitions 2 (\"META\") and 3 (\"BOOT\") overlap");
    }
}
