//! qcow2 images: our own header check (pure, over bytes), then block access
//! through qcow2-rs for images that pass it. qcow2-rs panics or misbehaves
//! on several header features, so nothing reaches it unchecked.

use qcow2_rs::dev::{Qcow2Dev, Qcow2DevParams};
use qcow2_rs::helpers::Qcow2IoBuf;
use qcow2_rs::tokio_io::Qcow2IoTokio;
use std::path::Path;

/// What imgbuild needs to know from a qcow2 header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub version: u32,
    pub cluster_bits: u32,
    pub virtual_size: u64,
    pub backing_file: Option<String>,
}

/// Why a qcow2 image is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("not a qcow2 image (no QFI\\xfb magic)")]
    NotQcow2,
    #[error("the qcow2 header is truncated")]
    Truncated,
    #[error("qcow2 version {0} is not supported (2 or 3 are)")]
    Version(u32),
    #[error("cluster_bits {0} is outside 9..=21")]
    ClusterBits(u32),
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
    #[error("backing file {0:?} lies outside the image's folder")]
    BackingOutside(String),
    #[error(
        "relative backing file {0:?} is not supported; \
         make it absolute with `qemu-img rebase -u -b /abs/path`"
    )]
    BackingRelative(String),
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

/// Checks the first bytes of a qcow2 file (64 KiB covers any header).
pub fn parse_header(b: &[u8]) -> Result<Header, HeaderError> {
    if !b.starts_with(b"QFI\xfb") {
        return Err(HeaderError::NotQcow2);
    }
    let version = be32(b, 4)?;
    if !(2..=3).contains(&version) {
        return Err(HeaderError::Version(version));
    }
    let cluster_bits = be32(b, 20)?;
    if !(9..=21).contains(&cluster_bits) {
        return Err(HeaderError::ClusterBits(cluster_bits));
    }
    let virtual_size = be64(b, 24)?;
    let crypt = be32(b, 32)?;
    if crypt != 0 {
        return Err(HeaderError::Encrypted(crypt));
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
        if header_length > 104 && *b.get(104).ok_or(HeaderError::Truncated)? != 0 {
            return Err(HeaderError::Zstd);
        }
    }
    let backing_offset = be64(b, 8)? as usize;
    let backing_file = if backing_offset == 0 {
        None
    } else {
        let len = be32(b, 16)? as usize;
        let name = backing_offset
            .checked_add(len)
            .and_then(|end| b.get(backing_offset..end))
            .ok_or(HeaderError::Truncated)?;
        let name = String::from_utf8_lossy(name).into_owned();
        if !name.starts_with('/') {
            let escapes = Path::new(&name)
                .components()
                .any(|c| matches!(c, std::path::Component::ParentDir));
            return Err(if escapes {
                HeaderError::BackingOutside(name)
            } else {
                HeaderError::BackingRelative(name)
            });
        }
        Some(name)
    };
    Ok(Header {
        version,
        cluster_bits,
        virtual_size,
        backing_file,
    })
}

/// A checked qcow2 image opened through qcow2-rs. Its futures are not Send,
/// so it drives them on its own current-thread runtime.
pub struct Qcow2 {
    rt: tokio::runtime::Runtime,
    dev: Qcow2Dev<Qcow2IoTokio>,
    path: std::path::PathBuf,
    pub header: Header,
}

impl std::fmt::Debug for Qcow2 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qcow2")
            .field("header", &self.header)
            .finish()
    }
}

/// Runs a qcow2-rs call, turning a panic inside it (it unwraps on some
/// malformed images) into an error instead of a crash.
fn guarded<T>(what: &str, f: impl FnOnce() -> std::io::Result<T>) -> std::io::Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|panic| {
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
        let params = Qcow2DevParams::new(9, None, None, !writable, false);
        let dev = guarded("open", || {
            rt.block_on(qcow2_rs::utils::qcow2_setup_dev_tokio(path, &params))
                .map_err(|e| std::io::Error::other(format!("qcow2: {e:?}")))
        })?;
        Ok(Qcow2 {
            rt,
            dev,
            path: path.to_owned(),
            header,
        })
    }

    /// Reads whole sectors at a sector-aligned offset.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        check_aligned(buf.len(), offset)?;
        let mut aligned = Qcow2IoBuf::<u8>::new(buf.len());
        guarded("read", || {
            self.rt
                .block_on(self.dev.read_at(&mut aligned, offset))
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
        guarded("write", || {
            self.rt
                .block_on(self.dev.write_at(&aligned, offset))
                .map_err(|e| std::io::Error::other(format!("qcow2 write at {offset}: {e:?}")))
        })
    }

    /// Writes back cached metadata (L2 and refcount tables), then fsyncs
    /// the file: qcow2-rs's flush writes but does not sync.
    pub fn flush(&self) -> std::io::Result<()> {
        guarded("flush", || {
            self.rt
                .block_on(self.dev.flush_meta())
                .map_err(|e| std::io::Error::other(format!("qcow2 flush: {e:?}")))
        })?;
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
        b[96..100].copy_from_slice(&4u32.to_be_bytes());
        b[100..104].copy_from_slice(&112u32.to_be_bytes());
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
        assert_eq!(h.backing_file, None);
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
    fn backing_files_are_checked() {
        assert_eq!(
            parse_header(&with_backing("/srv/base.qcow2"))
                .unwrap()
                .backing_file
                .as_deref(),
            Some("/srv/base.qcow2")
        );
        assert!(matches!(
            parse_header(&with_backing("../other/base.qcow2")),
            Err(HeaderError::BackingOutside(_))
        ));
        assert!(matches!(
            parse_header(&with_backing("base.qcow2")),
            Err(HeaderError::BackingRelative(_))
        ));
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
        let mut far = with_backing("/x");
        far[8..16].copy_from_slice(&u64::MAX.to_be_bytes());
        assert_eq!(parse_header(&far), Err(HeaderError::Truncated));
    }

    proptest::proptest! {
        #![proptest_config(crate::fuzz_config())]
        #[test]
        fn fuzz_qcow2_header_never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..4096)) {
            let _ = parse_header(&bytes);
            let mut b = header();
            b[..bytes.len().min(4096)].copy_from_slice(&bytes[..bytes.len().min(4096)]);
            b[..4].copy_from_slice(b"QFI\xfb");
            let _ = parse_header(&b);
        }
    }
}
