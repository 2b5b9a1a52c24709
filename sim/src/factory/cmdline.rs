//! What a booted image is told: the kernel command line the factory bakes
//! (siderolabs/image-factory `internal/profile`, Talos' `pkg/imager/profile`
//! defaults, extra arguments, then META), the simulated kernels, and the
//! Talos version a name asks for.

use super::state::*;
use sha2::{Digest, Sha256};

/// The kernel command line the factory gives a schematic's boot assets,
/// with its META on it when it has any.
pub(crate) fn cmdline(
    sim: &Sim,
    schematic: &SchematicShape,
    version: &str,
    platform: &str,
    arch: &str,
) -> String {
    let mut args: Vec<String> = vec![
        format!("talos.platform={platform}"),
        "console=ttyS0".into(),
        "console=tty0".into(),
        "init_on_alloc=1".into(),
        "slab_nomerge".into(),
        "pti=on".into(),
        "consoleblank=0".into(),
        "nvme_core.io_timeout=4294967295".into(),
        "printk.devkmsg=on".into(),
        "selinux=1".into(),
        "module.sig_enforce=1".into(),
    ];
    if arch != "amd64" {
        args.retain(|a| a != "pti=on");
    }
    if let Some(base) = &sim.base_cmdline {
        args = base.split_whitespace().map(str::to_owned).collect();
    }
    args.extend(schematic.customization.extra_kernel_args.iter().cloned());
    if !schematic.customization.meta.is_empty() {
        args.push(format!(
            "talos.environment=INSTALLER_META_BASE64={}",
            encode_meta_values(&schematic.customization.meta, version)
        ));
    }
    args.join(" ")
}

/// A few KiB that a boot loader would take for a kernel of `arch`: an x86
/// bzImage header (`HdrS` at 0x202) or an arm64 `Image` (`MZ`, `ARM\x64` at
/// 0x38), then bytes that depend on the version.
pub(crate) fn simulated_kernel(version: &str, arch: &str) -> Option<Vec<u8>> {
    let mut k = vec![0u8; 40 << 10];
    match arch {
        "amd64" => k[0x202..0x206].copy_from_slice(b"HdrS"),
        "arm64" => {
            k[..2].copy_from_slice(b"MZ");
            k[0x38..0x3c].copy_from_slice(b"ARM\x64");
        }
        _ => return None,
    }
    let seed = Sha256::digest(format!("kernel {version} {arch}"));
    for (i, b) in k[0x400..].iter_mut().enumerate() {
        *b = seed[i % 32] ^ (i as u8);
    }
    Some(k)
}

/// `Values.Encode` of siderolabs/talos `pkg/machinery/meta/meta.go`:
/// `0x<key>=<value>` joined by `;`, gzipped at best compression when over
/// 256 bytes (from v1.6.3), standard base64.
pub(crate) fn encode_meta_values(values: &[MetaShape], version: &str) -> String {
    use base64::Engine;
    let joined = values
        .iter()
        .map(|m| format!("0x{:x}={}", m.key, m.value))
        .collect::<Vec<_>>()
        .join(";");
    let bytes = if talos_version(version) >= (1, 6, 3) && joined.len() > 256 {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        std::io::Write::write_all(&mut gz, joined.as_bytes()).expect("in memory");
        gz.finish().expect("in memory")
    } else {
        joined.into_bytes()
    };
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// `vX.Y.Z` as numbers (a missing or odd part is 0).
pub(crate) fn talos_version(version: &str) -> (u32, u32, u32) {
    let mut parts = version
        .trim_start_matches('v')
        .split('.')
        .map(|p| p.parse::<u32>().unwrap_or(0));
    (
        parts.next().unwrap_or(0),
        parts.next().unwrap_or(0),
        parts.next().unwrap_or(0),
    )
}
