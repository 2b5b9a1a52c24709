//! Per-node ISOs made offline from the base schematic's ISO: the node's META
//! argument goes on every kernel line of `/boot/grub/grub.cfg`, where Talos
//! (v1.5 and later) applies it before it installs (see [`crate::boot`]).
//!
//! xorriso writes the new ISO: it replays the base's boot records
//! (El Torito catalog and system area) and keeps the volume date, because
//! GRUB's EFI image finds its root by the ISO9660 volume UUID, which GRUB
//! makes of the modification date in the primary volume descriptor
//! (grub `grub-core/fs/iso9660.c` `grub_iso9660_uuid`). The factory's ISOs
//! are grub-mkrescue output with `grub.cfg` in this layout
//! (siderolabs/talos `pkg/imager/iso/grub.go`, `pkg/imager/iso/grub.cfg`).

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::inventory::talos_at_least;
use crate::meta::{self, CmdlineError};
use crate::schematic::Bootloader;

/// Where the factory's ISOs keep the GRUB menu.
pub const GRUB_CFG: &str = "/boot/grub/grub.cfg";

/// The longest `grub.cfg` read: the factory's is under 1 KiB.
const GRUB_CFG_MAX: u64 = 1 << 20;

/// Why an ISO could not be read or made; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum IsoError {
    #[error("{}: not an ISO9660 image ({why})", path.display())]
    NotIso { path: PathBuf, why: String },
    #[error("{}: {GRUB_CFG} has no kernel (linux) line to carry the node's META", path.display())]
    NoKernelLine { path: PathBuf },
    #[error("{}: {GRUB_CFG} already carries META (INSTALLER_META_BASE64); the base ISO must have none", path.display())]
    AlreadyHasMeta { path: PathBuf },
    #[error(
        "{}: menu entry {title:?}: the kernel command line would be {len} bytes, over the kernel's limit of {}",
        path.display(),
        meta::CMDLINE_MAX
    )]
    CmdlineTooLong {
        path: PathBuf,
        title: String,
        len: usize,
    },
    #[error("{}: {GRUB_CFG} is over {GRUB_CFG_MAX} bytes", path.display())]
    GrubCfgTooLarge { path: PathBuf },
    #[error("{}: xorriso {action} failed: {stderr}", path.display())]
    Xorriso {
        path: PathBuf,
        action: &'static str,
        stderr: String,
    },
    #[error("xorriso is not installed (Debian package xorriso): {0}")]
    NoXorriso(std::io::Error),
    #[error(
        "Talos {version}'s default ISO boots a UKI on UEFI, with its command line inside the EFI image, where imgbuild cannot add META; set image.bootloader: grub in the inventory, or build with --route factory (which sends the node's network to the factory)"
    )]
    UkiIso { version: String },
    #[error(
        "Talos {version} reads META from the kernel command line only at install; a per-node ISO needs v1.5 or later"
    )]
    TooOld { version: String },
    #[error("{}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> IsoError + '_ {
    move |source| IsoError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Refuses what the patch route cannot make an ISO for: Talos before v1.5
/// (META on the command line is applied only at install), and the dual-boot
/// ISO of Talos v1.10 and later, whose UEFI boot is a UKI with its command
/// line inside the EFI image (siderolabs/talos `pkg/imager/iso/grub.go`:
/// GRUB covers only BIOS there).
pub fn check_patchable(version: &str, bootloader: Bootloader) -> Result<(), IsoError> {
    if !talos_at_least(version, (1, 5, 0)) {
        return Err(IsoError::TooOld {
            version: version.to_owned(),
        });
    }
    if talos_at_least(version, (1, 10, 0)) && bootloader != Bootloader::Grub {
        return Err(IsoError::UkiIso {
            version: version.to_owned(),
        });
    }
    Ok(())
}

/// The primary volume descriptor's modification date (`YYYYMMDDhhmmsscc`)
/// from the descriptor's 2048 bytes (ECMA-119 8.4: type 1, `CD001`, the
/// date at offset 830).
pub fn pvd_modified(pvd: &[u8]) -> Result<String, String> {
    if pvd.len() < 2048 || pvd[0] != 1 || &pvd[1..6] != b"CD001" {
        return Err("no primary volume descriptor at sector 16".into());
    }
    let date = &pvd[830..846];
    if !date.iter().all(u8::is_ascii_digit) {
        return Err("the volume modification date is not 16 digits".into());
    }
    Ok(String::from_utf8_lossy(date).into_owned())
}

/// The volume date of the ISO at `path`, read from its sector 16 only.
pub fn volume_date(path: &Path) -> Result<String, IsoError> {
    let mut f = crate::io::open_regular(path, false).map_err(io_err(path))?;
    let mut pvd = vec![0u8; 2048];
    f.seek(SeekFrom::Start(16 * 2048))
        .and_then(|_| f.read_exact(&mut pvd))
        .map_err(|e| IsoError::NotIso {
            path: path.to_owned(),
            why: format!("sector 16: {e}"),
        })?;
    pvd_modified(&pvd).map_err(|why| IsoError::NotIso {
        path: path.to_owned(),
        why,
    })
}

/// The disk GUID of a hybrid ISO's GPT (grub-mkrescue puts the EFI image
/// in one), as xorriso's `gpt_disk_guid=` takes it: the 16 bytes of the
/// header at LBA 1, offset 56, in hex as they lie on disk. `None` without
/// a GPT.
pub fn gpt_disk_guid(lba1: &[u8]) -> Option<String> {
    (lba1.get(..8) == Some(b"EFI PART")).then_some(())?;
    lba1.get(56..72).map(hex::encode)
}

/// The GPT disk GUID of the ISO at `path`, if it is hybrid.
fn read_gpt_disk_guid(path: &Path) -> Result<Option<String>, IsoError> {
    let mut f = crate::io::open_regular(path, false).map_err(io_err(path))?;
    let mut lba1 = [0u8; 512];
    f.seek(SeekFrom::Start(512))
        .and_then(|_| f.read_exact(&mut lba1))
        .map_err(io_err(path))?;
    Ok(gpt_disk_guid(&lba1))
}

/// One GRUB menu entry that boots a kernel.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct MenuEntry {
    pub title: String,
    pub kernel: String,
    /// The arguments after the kernel path, as GRUB passes them.
    pub args: Vec<String>,
}

impl MenuEntry {
    /// The values of the entry's META argument, when it has one.
    pub fn meta(&self) -> Option<Result<Vec<(u8, String)>, CmdlineError>> {
        self.args
            .iter()
            .find_map(|a| a.strip_prefix(meta::ENVIRONMENT_PREFIX))
            .map(meta::decode_installer_meta)
    }
}

/// GRUB's words of one line: blanks separate them, `'…'` and `"…"` quote,
/// `\` escapes one character (GRUB's shell-like lexer).
fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut chars = line.chars();
    let mut quote: Option<char> = None;
    while let Some(c) = chars.next() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some('"'), '\\') | (None, '\\') => {
                if let Some(n) = chars.next() {
                    cur.push(n);
                }
                in_word = true;
            }
            (Some(_), c) => cur.push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                in_word = true;
            }
            (None, c) if c.is_whitespace() => {
                if in_word {
                    out.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            (None, c) => {
                cur.push(c);
                in_word = true;
            }
        }
    }
    if in_word {
        out.push(cur);
    }
    out
}

/// Whether a line of `grub.cfg` loads a kernel (`linux`, `linuxefi`).
fn is_kernel_line(line: &str) -> bool {
    matches!(
        line.split_whitespace().next(),
        Some("linux" | "linuxefi" | "linux16")
    )
}

/// The kernel-booting menu entries of a `grub.cfg`, in order.
pub fn menu_entries(cfg: &str) -> Vec<MenuEntry> {
    let mut title = String::new();
    let mut out = Vec::new();
    for line in cfg.lines() {
        let w = words(line);
        match w.first().map(String::as_str) {
            Some("menuentry") => title = w.get(1).cloned().unwrap_or_default(),
            Some(_) if is_kernel_line(line) => out.push(MenuEntry {
                title: title.clone(),
                kernel: w.get(1).cloned().unwrap_or_default(),
                args: w.iter().skip(2).cloned().collect(),
            }),
            _ => {}
        }
    }
    out
}

/// The first menu entry whose kernel command line is over the kernel's
/// limit ([`meta::CMDLINE_MAX`]), with its length.
pub fn too_long(cfg: &str) -> Option<(String, usize)> {
    menu_entries(cfg).into_iter().find_map(|e| {
        let len = e.args.join(" ").len();
        (len > meta::CMDLINE_MAX).then_some((e.title, len))
    })
}

/// `cfg` with `arg` appended to every kernel line, and how many lines that
/// was. `arg` must need no quoting (a META argument is base64).
pub fn add_kernel_arg(cfg: &str, arg: &str) -> (String, usize) {
    let mut n = 0;
    let mut out = String::with_capacity(cfg.len() + 4 * arg.len());
    for line in cfg.split_inclusive('\n') {
        let (body, end) = match line.strip_suffix('\n') {
            Some(b) => (b, "\n"),
            None => (line, ""),
        };
        if is_kernel_line(body) {
            n += 1;
            out.push_str(body.trim_end());
            out.push(' ');
            out.push_str(arg);
            out.push_str(end);
        } else {
            out.push_str(line);
        }
    }
    (out, n)
}

fn xorriso(path: &Path, action: &'static str, args: &mut Command) -> Result<(), IsoError> {
    let o = args.output().map_err(IsoError::NoXorriso)?;
    if o.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&o.stderr);
    // xorriso is chatty; its failure is in the lines it marks so.
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("FAILURE") || l.contains("SORRY") || l.contains("FATAL"))
        .collect();
    Err(IsoError::Xorriso {
        path: path.to_owned(),
        action,
        stderr: if lines.is_empty() {
            stderr.trim().to_owned()
        } else {
            lines.join("; ")
        },
    })
}

/// `/boot/grub/grub.cfg` of the ISO at `iso`, extracted with xorriso next
/// to `scratch` (a temporary name that is removed again).
pub fn read_grub_cfg(iso: &Path, scratch: &Path) -> Result<String, IsoError> {
    volume_date(iso)?;
    let tmp = crate::atomic::AtomicFile::create(scratch, false).map_err(io_err(scratch))?;
    xorriso(
        iso,
        "extracting /boot/grub/grub.cfg",
        Command::new("xorriso")
            .args(["-osirrox", "on", "-overwrite", "on", "-indev"])
            .arg(iso)
            .args(["-extract", GRUB_CFG])
            .arg(tmp.temp_path()),
    )?;
    // Dropped uncommitted: the extracted copy goes away with `tmp`.
    let f = std::fs::File::open(tmp.temp_path()).map_err(io_err(tmp.temp_path()))?;
    let mut bytes = Vec::new();
    f.take(GRUB_CFG_MAX + 1)
        .read_to_end(&mut bytes)
        .map_err(io_err(tmp.temp_path()))?;
    if bytes.len() as u64 > GRUB_CFG_MAX {
        return Err(IsoError::GrubCfgTooLarge {
            path: iso.to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Writes `out`: the ISO `base` with `arg` on every kernel line of its
/// `grub.cfg`, the same boot records and the same volume date. Returns the
/// number of kernel lines. Written under a temporary name, fsynced, renamed.
pub fn write_node_iso(base: &Path, out: &Path, arg: &str) -> Result<usize, IsoError> {
    let date = volume_date(base)?;
    let cfg_path = out.with_extension("grub.cfg");
    let cfg = read_grub_cfg(base, &cfg_path)?;
    if cfg.contains(meta::ENVIRONMENT_PREFIX) {
        return Err(IsoError::AlreadyHasMeta {
            path: base.to_owned(),
        });
    }
    let (cfg, lines) = add_kernel_arg(&cfg, arg);
    if lines == 0 {
        return Err(IsoError::NoKernelLine {
            path: base.to_owned(),
        });
    }
    if let Some((title, len)) = too_long(&cfg) {
        return Err(IsoError::CmdlineTooLong {
            path: out.to_owned(),
            title,
            len,
        });
    }
    let mut new_cfg =
        crate::atomic::AtomicFile::create(&cfg_path, false).map_err(io_err(&cfg_path))?;
    std::io::Write::write_all(new_cfg.file(), cfg.as_bytes()).map_err(io_err(&cfg_path))?;
    let iso = crate::atomic::AtomicFile::create(out, false).map_err(io_err(out))?;
    let mut cmd = Command::new("xorriso");
    cmd.arg("-indev")
        .arg(base)
        .arg("-outdev")
        .arg(iso.temp_path())
        .args(["-boot_image", "any", "replay"]);
    // A hybrid ISO's GPT keeps its disk GUID (xorriso would make a new
    // one), so the partition GUIDs derived from it stay too.
    if let Some(guid) = read_gpt_disk_guid(base)? {
        cmd.args(["-boot_image", "any", &format!("gpt_disk_guid={guid}")]);
    }
    // `-compliance no_emul_toc`: no multi-session table in front of the
    // data, so every file (boot images, catalog) keeps the base's address.
    xorriso(
        out,
        "writing the node ISO",
        cmd.args(["-volume_date", "uuid", &date])
            .args(["-compliance", "no_emul_toc"])
            .arg("-update")
            .arg(new_cfg.temp_path())
            .args([GRUB_CFG, "-commit"]),
    )?;
    // xorriso wrote through its own descriptor; ours syncs the same inode.
    iso.commit().map_err(io_err(out))?;
    Ok(lines)
}

/// What `inspect` shows of an ISO.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct IsoReport {
    pub volume_date: String,
    pub entries: Vec<EntryReport>,
}

/// One menu entry with its decoded META.
#[derive(Debug, Clone, serde::Serialize)]
pub struct EntryReport {
    #[serde(flatten)]
    pub entry: MenuEntry,
    /// `key → value` of its META argument.
    pub meta: Vec<(u8, String)>,
    /// Why its META argument could not be decoded.
    pub problem: Option<String>,
}

/// The volume date and the menu entries (with decoded META) of an ISO.
pub fn inspect(iso: &Path, scratch: &Path) -> Result<IsoReport, IsoError> {
    let volume_date = volume_date(iso)?;
    let cfg = read_grub_cfg(iso, scratch)?;
    let entries = menu_entries(&cfg)
        .into_iter()
        .map(|entry| {
            let (meta, problem) = match entry.meta() {
                None => (Vec::new(), None),
                Some(Ok(v)) => (v, None),
                Some(Err(e)) => (Vec::new(), Some(e.to_string())),
            };
            EntryReport {
                entry,
                meta,
                problem,
            }
        })
        .collect();
    Ok(IsoReport {
        volume_date,
        entries,
    })
}

/// Whether `path` is an ISO9660 image (a primary volume descriptor at
/// sector 16), hybrid or not.
pub fn is_iso(path: &Path) -> bool {
    volume_date(path).is_ok()
}

/// What `diff` finds between two ISOs.
#[derive(Debug, Clone, serde::Serialize)]
pub struct IsoDiff {
    /// One line per difference in volume date, menu entries or META.
    pub changes: Vec<String>,
    /// The same bytes.
    pub identical: bool,
}

impl IsoDiff {
    /// Same volume date, menu entries and META, whatever the bytes.
    pub fn equivalent(&self) -> bool {
        self.changes.is_empty()
    }
}

/// The differences between two ISO reports, as lines for people.
pub fn compare(a: &IsoReport, b: &IsoReport) -> Vec<String> {
    let mut out = Vec::new();
    if a.volume_date != b.volume_date {
        out.push(format!(
            "volume date: {} vs {} (GRUB's EFI image finds its root by it)",
            a.volume_date, b.volume_date
        ));
    }
    if a.entries.len() != b.entries.len() {
        out.push(format!(
            "kernel menu entries: {} vs {}",
            a.entries.len(),
            b.entries.len()
        ));
    }
    for (i, (x, y)) in a.entries.iter().zip(&b.entries).enumerate() {
        let at = format!("entry {} {:?}", i + 1, x.entry.title);
        if x.entry.title != y.entry.title || x.entry.kernel != y.entry.kernel {
            out.push(format!(
                "{at}: {:?} {} vs {:?} {}",
                x.entry.title, x.entry.kernel, y.entry.title, y.entry.kernel
            ));
        }
        let plain = |e: &EntryReport| -> Vec<String> {
            e.entry
                .args
                .iter()
                .filter(|a| !a.starts_with(meta::ENVIRONMENT_PREFIX))
                .cloned()
                .collect()
        };
        let (px, py) = (plain(x), plain(y));
        for arg in px.iter().filter(|a| !py.contains(a)) {
            out.push(format!("{at}: argument {arg} only in the first"));
        }
        for arg in py.iter().filter(|a| !px.contains(a)) {
            out.push(format!("{at}: argument {arg} only in the second"));
        }
        let keys: std::collections::BTreeSet<u8> =
            x.meta.iter().chain(&y.meta).map(|(k, _)| *k).collect();
        for key in keys {
            fn get(e: &EntryReport, key: u8) -> Option<&String> {
                e.meta.iter().find(|(k, _)| *k == key).map(|(_, v)| v)
            }
            match (get(x, key), get(y, key)) {
                (Some(v), Some(w)) if v == w => {}
                (Some(_), Some(_)) => out.push(format!("{at}: META key 0x{key:x} differs")),
                (Some(_), None) => out.push(format!("{at}: META key 0x{key:x} only in the first")),
                (None, _) => out.push(format!("{at}: META key 0x{key:x} only in the second")),
            }
        }
    }
    out
}

/// Compares two ISOs: bytes, volume date, menu entries and decoded META.
pub fn diff(a: &Path, b: &Path, scratch: &Path) -> Result<IsoDiff, IsoError> {
    let (ra, rb) = (inspect(a, scratch)?, inspect(b, scratch)?);
    let hash = |p: &Path| -> Result<(crate::digest::Sha256, u64), IsoError> {
        let f = crate::io::open_regular(p, false).map_err(io_err(p))?;
        crate::io::sha256_of(f).map_err(io_err(p))
    };
    Ok(IsoDiff {
        changes: compare(&ra, &rb),
        identical: hash(a)? == hash(b)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The factory's template (siderolabs/talos `pkg/imager/iso/grub.cfg`), filled.
    const FACTORY_CFG: &str = "set default=0\nset timeout=3\n\ninsmod all_video\n\nterminal_input console\nterminal_output console\n\nmenuentry \"Talos ISO\" {\n\tset gfxmode=auto\n\tset gfxpayload=text\n\tlinux /boot/vmlinuz talos.platform=metal console=ttyS0\n\tinitrd /boot/initramfs.xz\n}\n\nmenuentry \"Reset Talos installation\" {\n\tset gfxmode=auto\n\tset gfxpayload=text\n\tlinux /boot/vmlinuz talos.platform=metal console=ttyS0 talos.experimental.wipe=system\n\tinitrd /boot/initramfs.xz\n}\n";

    #[test]
    fn every_kernel_line_gets_the_argument_and_nothing_else_changes() {
        let (cfg, n) = add_kernel_arg(FACTORY_CFG, "a=1");
        assert_eq!(n, 2);
        let changed: Vec<(&str, &str)> = FACTORY_CFG
            .lines()
            .zip(cfg.lines())
            .filter(|(a, b)| a != b)
            .collect();
        assert_eq!(changed.len(), 2, "{cfg}");
        for (before, after) in changed {
            assert_eq!(after, format!("{before} a=1"));
        }
        assert_eq!(cfg.lines().count(), FACTORY_CFG.lines().count());
        assert!(cfg.ends_with("}\n"));
        assert_eq!(add_kernel_arg("set x=1\ninitrd /i", "a").1, 0);
    }

    #[test]
    fn menu_entries_name_their_title_kernel_and_arguments() {
        let e = menu_entries(FACTORY_CFG);
        assert_eq!(e.len(), 2);
        assert_eq!(e[0].title, "Talos ISO");
        assert_eq!(e[0].kernel, "/boot/vmlinuz");
        assert_eq!(e[0].args, ["talos.platform=metal", "console=ttyS0"]);
        assert_eq!(e[1].title, "Reset Talos installation");
        assert_eq!(e[1].args.last().unwrap(), "talos.experimental.wipe=system");
        assert!(e[0].meta().is_none());
    }

    fn report(cfg: &str, date: &str) -> IsoReport {
        IsoReport {
            volume_date: date.into(),
            entries: menu_entries(cfg)
                .into_iter()
                .map(|entry| EntryReport {
                    meta: entry.meta().map(|m| m.unwrap()).unwrap_or_default(),
                    entry,
                    problem: None,
                })
                .collect(),
        }
    }

    #[test]
    fn compare_names_dates_arguments_and_meta_keys() {
        let one = meta::environment_arg(&[(10, "a")], true).unwrap();
        let two = meta::environment_arg(&[(10, "b"), (12, "x")], true).unwrap();
        let a = report(&add_kernel_arg(FACTORY_CFG, &one).0, "2025061210203000");
        assert!(compare(&a, &a).is_empty());
        let b = report(
            &add_kernel_arg(&FACTORY_CFG.replace("console=ttyS0", "quiet"), &two).0,
            "2025061210203001",
        );
        let lines = compare(&a, &b);
        let want = [
            "volume date: 2025061210203000 vs 2025061210203001",
            "entry 1 \"Talos ISO\": argument console=ttyS0 only in the first",
            "entry 1 \"Talos ISO\": argument quiet only in the second",
            "entry 1 \"Talos ISO\": META key 0xa differs",
            "entry 2 \"Reset Talos installation\": META key 0xc only in the second",
        ];
        for w in want {
            assert!(
                lines.iter().any(|l| l.starts_with(w)),
                "{w:?} in {lines:#?}"
            );
        }
        let fewer = report("menuentry \"x\" {\nlinux /k\n}\n", "2025061210203000");
        assert!(compare(&a, &fewer).contains(&"kernel menu entries: 2 vs 1".to_owned()));
    }

    #[test]
    fn command_lines_over_the_kernel_limit_are_found() {
        assert_eq!(too_long(FACTORY_CFG), None);
        let arg = "x".repeat(meta::CMDLINE_MAX);
        let (cfg, _) = add_kernel_arg(FACTORY_CFG, &arg);
        let (title, len) = too_long(&cfg).unwrap();
        assert_eq!(title, "Talos ISO");
        assert_eq!(len, "talos.platform=metal console=ttyS0 ".len() + arg.len());
    }

    #[test]
    fn the_gpt_disk_guid_is_read_as_it_lies_on_disk() {
        let mut lba1 = [0u8; 512];
        assert_eq!(gpt_disk_guid(&lba1), None);
        lba1[..8].copy_from_slice(b"EFI PART");
        for (i, b) in lba1[56..72].iter_mut().enumerate() {
            *b = i as u8 * 17;
        }
        assert_eq!(
            gpt_disk_guid(&lba1).unwrap(),
            "00112233445566778899aabbccddeeff"
        );
        assert_eq!(gpt_disk_guid(&lba1[..60]), None);
    }

    #[test]
    fn grub_quoting_is_undone() {
        assert_eq!(
            words("  linux /k 'a b' \"c\\\"d\" e\\ f \"\" x"),
            ["linux", "/k", "a b", "c\"d", "e f", "", "x"]
        );
    }

    #[test]
    fn the_meta_of_an_entry_decodes() {
        let arg = meta::environment_arg(&[(10, "hello")], true).unwrap();
        let (cfg, _) = add_kernel_arg(FACTORY_CFG, &arg);
        let e = menu_entries(&cfg);
        for entry in &e {
            assert_eq!(entry.meta().unwrap().unwrap(), [(10, "hello".to_owned())]);
        }
        let bad = menu_entries("linux /k talos.environment=INSTALLER_META_BASE64=%%%");
        assert!(bad[0].meta().unwrap().is_err());
    }

    #[test]
    fn the_volume_date_is_read_from_the_primary_descriptor_only() {
        let mut pvd = vec![0u8; 2048];
        pvd[0] = 1;
        pvd[1..6].copy_from_slice(b"CD001");
        pvd[830..846].copy_from_slice(b"2025061210203000");
        assert_eq!(pvd_modified(&pvd).unwrap(), "2025061210203000");
        pvd[831] = b' ';
        assert!(pvd_modified(&pvd).unwrap_err().contains("16 digits"));
        pvd[0] = 2;
        assert!(pvd_modified(&pvd).unwrap_err().contains("primary"));
        assert!(pvd_modified(&pvd[..100]).is_err());
    }

    #[test]
    fn only_grub_isos_of_v1_5_and_later_can_be_patched() {
        assert!(check_patchable("v1.9.5", Bootloader::None).is_ok());
        assert!(check_patchable("v1.11.2", Bootloader::Grub).is_ok());
        let e = check_patchable("v1.10.0", Bootloader::None).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("bootloader: grub") && msg.contains("--route factory"),
            "{msg}"
        );
        assert!(check_patchable("v1.11.2", Bootloader::SdBoot).is_err());
        assert!(matches!(
            check_patchable("v1.4.8", Bootloader::Grub),
            Err(IsoError::TooOld { .. })
        ));
    }
}
