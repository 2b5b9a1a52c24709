//! Per-node ISOs made offline from the base schematic's ISO: the node's META
//! argument goes on every kernel line of `/boot/grub/grub.cfg`, where Talos
//! (v1.5 and later) applies it before it installs (see [`crate::boot`]).
//!
//! Only an ISO whose every boot path reads that `grub.cfg` can be made this
//! way. Talos v1.10 and v1.11 ISOs are dual-boot: GRUB on BIOS, and on UEFI
//! a UKI whose command line is baked into the EFI image; the factory
//! honours `customization.bootloader: grub` for ISOs only from v1.12
//! (siderolabs/talos `pkg/imager/profile/output.go`,
//! `quirks.ISOSupportsSettingBootloader`). Those are refused
//! ([`check_patchable`]), and so is any base ISO that holds a UKI
//! ([`ukis`]): an ISO that boots without the node's META is never made.
//!
//! `grub.cfg` is read straight from the ISO's bytes at the extent xorriso
//! reports for it, and only when it is a regular file of at most
//! [`GRUB_CFG_MAX`] bytes: nothing is extracted to the host, so a symlink,
//! FIFO, device or directory in its place cannot pull in a host file, hang,
//! or leave a tree behind. Its kernel lines are read as GRUB reads them
//! ([`crate::bootscript::grub_read_line`]) and written back as quoted
//! words with META as one more word.
//!
//! xorriso writes the new ISO: it replays the base's boot records
//! (El Torito catalog and system area), keeps the `/.disk/*.uuid` file and
//! keeps the volume date. Which of these GRUB needs to find its
//! `grub.cfg` depends on the GRUB that made the ISO (grub
//! `util/grub-mkrescue.c` `make_image_abs`): grub-mkrescue before GRUB 2.12
//! embeds `search --fs-uuid <uuid>` in its EFI images, and GRUB makes an
//! ISO's UUID of the modification date in the primary volume descriptor
//! (`grub-core/fs/iso9660.c` `grub_iso9660_uuid`), so a changed date loses
//! the root there; from 2.12 (commit b7ec14c8 "Search by file UUID rather
//! than partition UUID") the EFI images search for the file
//! `/.disk/<uuid>.uuid` instead; the BIOS El Torito image searches for
//! nothing and reads `/boot/grub` of the device it booted from; and
//! Debian bookworm's grub-mkrescue (GRUB 2.06) EFI image embeds no search,
//! only the prefix `()/boot/grub`, and boots with the date changed (booted
//! under OVMF in `tests/boot/iso.rs`). Keeping the date costs nothing and covers
//! the pre-2.12 EFI images. The factory's ISOs are grub-mkrescue
//! output with `grub.cfg` in this layout (siderolabs/talos
//! `pkg/imager/iso/grub.go`, `pkg/imager/iso/grub.cfg`).

use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::inventory::talos_at_least;
use crate::meta::{self, CmdlineError};
use crate::schematic::Bootloader;

/// Where the factory's ISOs keep the GRUB menu.
pub const GRUB_CFG: &str = "/boot/grub/grub.cfg";

/// The longest `grub.cfg` read: the factory's is under 1 KiB.
pub const GRUB_CFG_MAX: u64 = 1 << 20;

/// The longest UKI command line read (the kernel's limit, with room).
const UKI_CMDLINE_MAX: u64 = 8 << 10;

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
    #[error("{}: {GRUB_CFG} is {size} bytes, over the {GRUB_CFG_MAX} imgbuild reads", path.display())]
    GrubCfgTooLarge { path: PathBuf, size: u64 },
    #[error(
        "{}: {GRUB_CFG} is not a regular file in the ISO (a symlink, directory, FIFO, device, or missing); only a regular file is read",
        path.display()
    )]
    GrubCfgNotRegular { path: PathBuf },
    #[error(
        "{}: {GRUB_CFG} line {line}: {why}; the node's META would not be exactly one argument of every kernel line",
        path.display()
    )]
    Script {
        path: PathBuf,
        line: usize,
        why: String,
    },
    #[error(
        "{}: the ISO's UEFI boot is a UKI (a PE image with a .cmdline section, at byte {offset}) whose command line is baked into the EFI image, where imgbuild cannot add the node's META; a per-node ISO made from it would boot UEFI machines without their address. Use a GRUB ISO (Talos v1.12 or later with image.bootloader: grub), imgbuild pxe, or --route factory (the factory then learns the node's addresses)",
        path.display()
    )]
    UefiUki { path: PathBuf, offset: u64 },
    #[error("{}: xorriso {action} failed: {stderr}", path.display())]
    Xorriso {
        path: PathBuf,
        action: &'static str,
        stderr: String,
    },
    #[error("xorriso is not installed (Debian package xorriso): {0}")]
    NoXorriso(std::io::Error),
    #[error(
        "Talos {version}'s default ISO boots a UKI on UEFI, with its command line inside the EFI image, where imgbuild cannot add META; set image.bootloader: grub in the inventory (honoured for ISOs from v1.12), use imgbuild pxe, or build with --route factory (an explicit opt-in: the factory then learns each node's addresses)"
    )]
    UkiIso { version: String },
    #[error(
        "Talos {version}'s ISO is dual-boot whatever image.bootloader says (the factory honours it for ISOs only from v1.12): GRUB on BIOS, and on UEFI a UKI whose command line is baked into the EFI image, where imgbuild cannot add META, so every UEFI boot (every Proxmox VM imgbuild makes) would come up without the node's address. Ways out: Talos v1.12 or later with image.bootloader: grub; imgbuild pxe; or build with --route factory (an explicit opt-in: the factory then learns each node's addresses)"
    )]
    DualBootIso { version: String },
    #[error(
        "Talos {version} reads META from the kernel command line only at install; a per-node ISO needs v1.5 or later"
    )]
    TooOld { version: String },
    #[error(
        "node {node}: a Secure Boot ISO boots a signed UKI whose kernel command line is part of what is signed, so a per-node ISO cannot carry the node's META (its address). Ways out: image.format raw or qcow2 (the Secure Boot disk image, whose META partition is outside what is signed, patched per node); build with --route factory (an explicit opt-in: the factory's own Secure Boot ISO, and the factory then learns each node's addresses); or dhcp: true on the node (no META needed)"
    )]
    SecureBootIso { node: String },
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

/// Refuses a per-node ISO for a Secure Boot node that needs META: the
/// UKI's `.cmdline` is measured and signed with the rest of it
/// (siderolabs/talos `pkg/imager/uki`), and systemd-stub ignores a command
/// line passed to a signed UKI under Secure Boot, so remastering would
/// either break the signature or be ignored. A DHCP node needs no META.
pub fn check_secure_boot(
    inv: &crate::inventory::Inventory,
    nodes: &[&crate::inventory::NodeSpec],
) -> Result<(), IsoError> {
    match nodes.iter().find(|n| inv.secure_boot(n) && !n.dhcp) {
        Some(n) => Err(IsoError::SecureBootIso {
            node: n.name.clone(),
        }),
        None => Ok(()),
    }
}

/// Refuses what the patch route cannot make an ISO for, before anything is
/// downloaded: Talos before v1.5 (META on the command line is applied only
/// at install); v1.10 and v1.11, whose ISO is dual-boot whatever the
/// schematic's bootloader (the factory honours `customization.bootloader`
/// for ISOs only from v1.12, siderolabs/talos `pkg/imager/profile/output.go`
/// `quirks.ISOSupportsSettingBootloader`); and from v1.12 any bootloader but
/// GRUB (the default ISO boots a UKI on UEFI).
pub fn check_patchable(version: &str, bootloader: Bootloader) -> Result<(), IsoError> {
    if !talos_at_least(version, (1, 5, 0)) {
        return Err(IsoError::TooOld {
            version: version.to_owned(),
        });
    }
    if talos_at_least(version, (1, 10, 0)) && !talos_at_least(version, (1, 12, 0)) {
        return Err(IsoError::DualBootIso {
            version: version.to_owned(),
        });
    }
    if talos_at_least(version, (1, 12, 0)) && bootloader != Bootloader::Grub {
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
    /// Why the kernel line is not one command of literal words (a
    /// separator, comment, variable, wildcard or open quote), when it is not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub script_problem: Option<String>,
}

impl MenuEntry {
    /// The values of the entry's META argument, when it has one.
    pub fn meta(&self) -> Option<Result<Vec<(u8, String)>, CmdlineError>> {
        self.args
            .iter()
            .find_map(|a| a.strip_prefix(meta::ENVIRONMENT_PREFIX))
            .map(meta::decode_installer_meta)
    }

    /// How many arguments carry META.
    pub fn meta_args(&self) -> usize {
        self.args
            .iter()
            .filter(|a| a.contains(crate::bootscript::META_MARKER))
            .count()
    }
}

/// The commands that load a kernel: each kernel GRUB can boot from the ISO
/// is on a line that starts with one of these.
const KERNEL_COMMANDS: [&str; 3] = ["linux", "linuxefi", "linux16"];

/// Commands that read another script, whose kernel lines imgbuild could not
/// give META.
const SCRIPT_COMMANDS: [&str; 4] = [
    "configfile",
    "source",
    "extract_entries_configfile",
    "extract_entries_source",
];

/// The raw tokens of a line, split at blanks and GRUB's operators: enough
/// to find a command name, not to read its arguments.
fn raw_tokens(line: &str) -> impl Iterator<Item = &str> {
    line.split(|c: char| c.is_whitespace() || matches!(c, ';' | '&' | '|' | '{' | '}' | '(' | ')'))
        .filter(|t| !t.is_empty())
}

/// Whether a line of `grub.cfg` loads a kernel (`linux`, `linuxefi`).
fn is_kernel_line(line: &str) -> bool {
    raw_tokens(line)
        .next()
        .is_some_and(|t| KERNEL_COMMANDS.contains(&t))
}

/// The kernel-booting menu entries of a `grub.cfg`, in order.
pub fn menu_entries(cfg: &str) -> Vec<MenuEntry> {
    let mut title = String::new();
    let mut out = Vec::new();
    for line in cfg.lines() {
        if raw_tokens(line).next() == Some("menuentry") {
            let head = line.trim_end().strip_suffix('{').unwrap_or(line);
            title = crate::bootscript::grub_read_line(head)
                .ok()
                .and_then(|w| w.get(1).cloned())
                .unwrap_or_default();
        } else if is_kernel_line(line) {
            let (words, script_problem) = match crate::bootscript::grub_read_line(line) {
                Ok(w) => (w, None),
                Err(e) => (
                    raw_tokens(line).map(str::to_owned).collect(),
                    Some(format!(
                        "the kernel line is not one command of literal words: {e}"
                    )),
                ),
            };
            out.push(MenuEntry {
                title: title.clone(),
                kernel: words.get(1).cloned().unwrap_or_default(),
                args: words.iter().skip(2).cloned().collect(),
                script_problem,
            });
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

/// `cfg` with `arg` as one more argument of every kernel line, and how many
/// lines that was. Each kernel line is read as GRUB reads it and written
/// back as quoted words ([`crate::bootscript::grub_line`]), so `arg` is
/// exactly one argument; a line GRUB would read as more than one command
/// of literal words, a word the kernel would not read as one argument, a
/// META already there, a kernel command later in a line, or a command that
/// reads another script is refused with its line number.
pub fn add_kernel_arg(cfg: &str, arg: &str) -> Result<(String, usize), (usize, String)> {
    let mut n = 0;
    let mut out = String::with_capacity(cfg.len() + 4 * arg.len());
    for (i, line) in cfg.split_inclusive('\n').enumerate() {
        let at = i + 1;
        let (body, end) = match line.strip_suffix('\n') {
            Some(b) => (b, "\n"),
            None => (line, ""),
        };
        let mut tokens = raw_tokens(body);
        let first = tokens.next();
        if let Some(t) = first.filter(|t| SCRIPT_COMMANDS.contains(t)) {
            return Err((at, format!("{t} reads another script")));
        }
        // A menu title or a message may say "linux"; a command may not.
        let prose = matches!(first, Some("menuentry" | "submenu" | "echo"));
        if !prose && tokens.any(|t| KERNEL_COMMANDS.contains(&t) || SCRIPT_COMMANDS.contains(&t)) {
            return Err((
                at,
                "a kernel or script command after the start of the line".into(),
            ));
        }
        if !first.is_some_and(|t| KERNEL_COMMANDS.contains(&t)) {
            out.push_str(line);
            continue;
        }
        let words = crate::bootscript::grub_read_line(body).map_err(|e| {
            (
                at,
                format!("the kernel line is not one command of literal words: {e}"),
            )
        })?;
        // `linux(` is one word to GRUB (a command of that name), though our
        // token split reads `linux`: neither is guessed.
        if !words
            .first()
            .is_some_and(|w| KERNEL_COMMANDS.contains(&w.as_str()))
        {
            return Err((at, "a kernel command glued to other characters".into()));
        }
        if words.len() < 2 {
            return Err((at, "a kernel command without a kernel".into()));
        }
        for w in &words[2..] {
            crate::bootscript::check_grub_kernel_word(w).map_err(|e| (at, e.to_string()))?;
        }
        let mut all: Vec<&str> = words.iter().map(String::as_str).collect();
        all.push(arg);
        let text = crate::bootscript::grub_line(&all).map_err(|e| (at, e.to_string()))?;
        n += 1;
        out.push_str(&body[..body.len() - body.trim_start().len()]);
        out.push_str(&text);
        out.push_str(end);
    }
    Ok((out, n))
}

fn xorriso(
    path: &Path,
    action: &'static str,
    args: &mut Command,
) -> Result<std::process::Output, IsoError> {
    let o = args.output().map_err(IsoError::NoXorriso)?;
    if o.status.success() {
        return Ok(o);
    }
    let stderr = String::from_utf8_lossy(&o.stderr);
    // xorriso is chatty; its failure is in the lines it marks so.
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("FAILURE") || l.contains("SORRY") || l.contains("FATAL"))
        .take(5)
        .collect();
    let text = if lines.is_empty() {
        stderr.trim().to_owned()
    } else {
        lines.join("; ")
    };
    Err(IsoError::Xorriso {
        path: path.to_owned(),
        action,
        stderr: text.chars().take(1000).collect(),
    })
}

/// Where a regular file's data lies in the ISO, from xorriso's
/// `-exec report_lba` lines (`File data lba: XT , LBA , BLOCKS , SIZE ,
/// 'PATH'`): `(byte offset, size)` when `path` is one single-extent regular
/// file. A symlink, FIFO, device or missing file has no such line; a
/// directory has lines for the files under it only.
pub fn data_extent(report: &str, path: &str) -> Option<(u64, u64)> {
    let quoted = format!("'{path}'");
    let mut found = report
        .lines()
        .filter_map(|l| l.strip_prefix("File data lba:"))
        .filter_map(|l| {
            let f: Vec<&str> = l.splitn(5, ',').map(str::trim).collect();
            (f.len() == 5 && f[4] == quoted).then_some(f)
        });
    let f = found.next()?;
    if found.next().is_some() || f[0] != "0" {
        return None;
    }
    let lba: u64 = f[1].parse().ok()?;
    let size: u64 = f[3].parse().ok()?;
    Some((lba.checked_mul(2048)?, size))
}

/// `/boot/grub/grub.cfg` of the ISO at `iso`: a regular file of at most
/// [`GRUB_CFG_MAX`] bytes, read from the ISO's own bytes at the extent
/// xorriso reports. Nothing is extracted, so nothing is left behind, and a
/// symlink, FIFO, device or directory in its place is refused unread.
pub fn read_grub_cfg(iso: &Path) -> Result<String, IsoError> {
    volume_date(iso)?;
    let o = xorriso(
        iso,
        "listing /boot/grub/grub.cfg",
        Command::new("xorriso")
            .args(["-abort_on", "FAILURE", "-indev"])
            .arg(iso)
            .args(["-find", GRUB_CFG, "-maxdepth", "0", "-exec", "report_lba"]),
    )?;
    let report = String::from_utf8_lossy(&o.stdout);
    let (offset, size) =
        data_extent(&report, GRUB_CFG).ok_or_else(|| IsoError::GrubCfgNotRegular {
            path: iso.to_owned(),
        })?;
    if size > GRUB_CFG_MAX {
        return Err(IsoError::GrubCfgTooLarge {
            path: iso.to_owned(),
            size,
        });
    }
    let f = crate::io::open_regular(iso, false).map_err(io_err(iso))?;
    let mut bytes = vec![0u8; size as usize];
    f.read_exact_at(&mut bytes, offset)
        .map_err(|e| IsoError::NotIso {
            path: iso.to_owned(),
            why: format!("{GRUB_CFG} lies past the end of the image: {e}"),
        })?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// A UKI found in an ISO: a PE image with a `.cmdline` section.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Uki {
    /// Where its PE image starts in the ISO.
    pub offset: u64,
    /// Whether its baked-in command line carries META.
    pub has_meta: bool,
}

/// The `.cmdline` section of a PE image as `(offset from the image's
/// start, size)`, from the image's first bytes (the DOS header's
/// `e_lfanew`, the COFF header's section count and optional-header size,
/// then 40-byte section headers: name, VirtualSize, VirtualAddress,
/// SizeOfRawData, PointerToRawData; PE/COFF specification). `None` for
/// anything else.
pub fn pe_cmdline_section(head: &[u8]) -> Option<(u64, u64)> {
    let u16_at = |o: usize| Some(u16::from_le_bytes(head.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(head.get(o..o + 4)?.try_into().ok()?));
    if head.get(..2)? != b"MZ" {
        return None;
    }
    let pe = u32_at(0x3c)? as usize;
    if head.get(pe..pe + 4)? != b"PE\0\0" {
        return None;
    }
    let sections = usize::from(u16_at(pe + 6)?);
    let table = pe + 24 + usize::from(u16_at(pe + 20)?);
    (0..sections).find_map(|i| {
        let h = table + 40 * i;
        (head.get(h..h + 8)? == b".cmdline").then_some(())?;
        let virtual_size = u32_at(h + 8)?;
        let raw_size = u32_at(h + 16)?;
        let size = if virtual_size == 0 {
            raw_size
        } else {
            virtual_size.min(raw_size)
        };
        Some((u64::from(u32_at(h + 20)?), u64::from(size)))
    })
}

/// The UKIs in the ISO at `iso`, wherever they lie (the ISO9660 tree, an
/// El Torito EFI image, an appended EFI partition): every 512-byte aligned
/// PE image with a `.cmdline` section (files in ISO9660 and FAT start on
/// sector boundaries). Reads the ISO once, in bounded chunks.
pub fn ukis(iso: &Path) -> Result<Vec<Uki>, IsoError> {
    let f = crate::io::open_regular(iso, false).map_err(io_err(iso))?;
    let len = f.metadata().map_err(io_err(iso))?.len();
    let mut found = Vec::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut head = vec![0u8; 8 << 10];
    let mut pos = 0u64;
    while pos < len {
        let n = (len - pos).min(buf.len() as u64) as usize;
        f.read_exact_at(&mut buf[..n], pos).map_err(io_err(iso))?;
        for at in (0..n).step_by(512) {
            if buf.get(at..at + 2) != Some(b"MZ") {
                continue;
            }
            let start = pos + at as u64;
            let h = (len - start).min(head.len() as u64) as usize;
            f.read_exact_at(&mut head[..h], start)
                .map_err(io_err(iso))?;
            let Some((off, size)) = pe_cmdline_section(&head[..h]) else {
                continue;
            };
            let mut cmdline = vec![0u8; size.min(UKI_CMDLINE_MAX) as usize];
            let has_meta = start
                .checked_add(off)
                .is_some_and(|o| f.read_exact_at(&mut cmdline, o).is_ok())
                && String::from_utf8_lossy(&cmdline).contains(crate::bootscript::META_MARKER);
            found.push(Uki {
                offset: start,
                has_meta,
            });
        }
        pos += n as u64;
    }
    Ok(found)
}

/// Writes `out`: the ISO `base` with `arg` on every kernel line of its
/// `grub.cfg`, the same boot records and the same volume date. Returns the
/// number of kernel lines. Written under a temporary name, fsynced, renamed.
pub fn write_node_iso(base: &Path, out: &Path, arg: &str) -> Result<usize, IsoError> {
    let date = volume_date(base)?;
    let cfg = read_grub_cfg(base)?;
    if let Some(uki) = ukis(base)?.first() {
        return Err(IsoError::UefiUki {
            path: base.to_owned(),
            offset: uki.offset,
        });
    }
    if cfg.contains(crate::bootscript::META_MARKER) {
        return Err(IsoError::AlreadyHasMeta {
            path: base.to_owned(),
        });
    }
    let (cfg, lines) = add_kernel_arg(&cfg, arg).map_err(|(line, why)| IsoError::Script {
        path: base.to_owned(),
        line,
        why,
    })?;
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
    let cfg_path = out.with_extension("grub.cfg");
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
    /// The UKIs its UEFI boot may start, which `grub.cfg` does not reach.
    pub ukis: Vec<Uki>,
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

/// The volume date, the menu entries (with decoded META) and the UKIs of
/// an ISO.
pub fn inspect(iso: &Path) -> Result<IsoReport, IsoError> {
    let volume_date = volume_date(iso)?;
    let cfg = read_grub_cfg(iso)?;
    let ukis = ukis(iso)?;
    let entries = menu_entries(&cfg)
        .into_iter()
        .map(|entry| {
            let (meta, problem) = match (&entry.script_problem, entry.meta_args(), entry.meta()) {
                (Some(p), _, _) => (Vec::new(), Some(p.clone())),
                (None, n, _) if n > 1 => (Vec::new(), Some(format!("{n} META arguments"))),
                (None, _, None) => (Vec::new(), None),
                (None, _, Some(Ok(v))) => (v, None),
                (None, _, Some(Err(e))) => (Vec::new(), Some(e.to_string())),
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
        ukis,
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
            "volume date: {} vs {} (GRUB EFI images made before GRUB 2.12 find their root by it)",
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
pub fn diff(a: &Path, b: &Path) -> Result<IsoDiff, IsoError> {
    let (ra, rb) = (inspect(a)?, inspect(b)?);
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
        let (cfg, n) = add_kernel_arg(FACTORY_CFG, "a=1").unwrap();
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
        assert_eq!(add_kernel_arg("set x=1\ninitrd /i", "a").unwrap().1, 0);
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
            ukis: Vec::new(),
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
        let a = report(
            &add_kernel_arg(FACTORY_CFG, &one).unwrap().0,
            "2025061210203000",
        );
        assert!(compare(&a, &a).is_empty());
        let b = report(
            &add_kernel_arg(&FACTORY_CFG.replace("console=ttyS0", "quiet"), &two)
                .unwrap()
                .0,
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
        let (cfg, _) = add_kernel_arg(FACTORY_CFG, &arg).unwrap();
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
        let e = menu_entries("menuentry 'T' {\n  linux /k 'a b' \"c\\\"d\" e\\ f \"\" x\n}\n");
        assert_eq!(e[0].title, "T");
        assert_eq!(e[0].args, ["a b", "c\"d", "e f", "", "x"]);
        assert_eq!(e[0].script_problem, None);
    }

    /// The entries a GRUB reading `cfg` would boot, each as its words.
    fn booted(cfg: &str) -> Vec<Vec<String>> {
        menu_entries(cfg)
            .into_iter()
            .map(|e| {
                assert_eq!(e.script_problem, None, "{cfg}");
                e.args
            })
            .collect()
    }

    #[test]
    fn meta_is_exactly_one_argument_of_every_kernel_line() {
        let meta = "talos.environment=INSTALLER_META_BASE64=AAAA";
        let cfg = FACTORY_CFG.replace("console=ttyS0", "console=ttyS0 'a b' x\\'y");
        let (out, n) = add_kernel_arg(&cfg, meta).unwrap();
        assert_eq!(n, 2);
        for args in booted(&out) {
            assert_eq!(args.iter().filter(|a| *a == meta).count(), 1, "{out}");
            assert_eq!(args.last().unwrap(), meta);
            assert!(
                args.contains(&"a b".to_owned()) && args.contains(&"x'y".to_owned()),
                "{out}"
            );
        }
    }

    #[test]
    fn a_kernel_line_grub_would_not_read_as_literal_words_is_refused() {
        let meta = "talos.environment=INSTALLER_META_BASE64=AAAA";
        for (hostile, why) in [
            ("console=ttyS0 ; chain x", "\";\""),
            ("console=ttyS0 # x", ""),
            ("console=ttyS0 && shell", "&&"),
            ("console=ttyS0 || shell ||", "||"),
            ("console=ttyS0 ${root}", "variable"),
            ("a=\"b", "quote"),
            ("a='b", "quote"),
            ("x talos.environment=INSTALLER_META_BASE64=BBBB", "META"),
            ("a=\\\"b", "double quote"),
        ] {
            let cfg = FACTORY_CFG.replace("console=ttyS0", hostile);
            match add_kernel_arg(&cfg, meta) {
                // A comment: GRUB drops the rest, so META must go in the
                // words before it; it does, and the comment goes.
                Ok((out, _)) if hostile.contains('#') => {
                    for args in booted(&out) {
                        assert_eq!(args.last().unwrap(), meta, "{out}");
                    }
                }
                Ok((out, _)) => panic!("{hostile:?} accepted: {out}"),
                Err((line, e)) => {
                    assert_eq!(line, 12, "{hostile:?}");
                    assert!(e.contains(why), "{hostile:?}: {e}");
                }
            }
        }
        for cfg in [
            "set x=1; linux /k a\n",
            "configfile /x.cfg\n",
            "if true; then linux /k; fi\n",
        ] {
            assert!(add_kernel_arg(cfg, meta).is_err(), "{cfg}");
        }
    }

    #[test]
    fn xorriso_reports_only_regular_single_extent_files() {
        let report = "Report layout: xt , Startlba ,   Blocks , Filesize , ISO image path\n\
            File data lba:  0 ,       34 ,        1 ,       11 , '/boot/grub/grub.cfg'\n\
            File data lba:  0 ,       33 ,        1 ,        2 , '/boot/grub/grub.cfg/f'\n";
        assert_eq!(data_extent(report, GRUB_CFG), Some((34 * 2048, 11)));
        assert_eq!(data_extent("Report layout: xt\n", GRUB_CFG), None);
        let dir = "File data lba:  0 ,       33 ,        1 ,        2 , '/boot/grub/grub.cfg/f'\n";
        assert_eq!(data_extent(dir, GRUB_CFG), None);
        let two = "File data lba:  0 , 1 , 1 , 9 , '/boot/grub/grub.cfg'\nFile data lba:  1 , 9 , 1 , 9 , '/boot/grub/grub.cfg'\n";
        assert_eq!(data_extent(two, GRUB_CFG), None);
    }

    /// A minimal PE image with the given section names; `.cmdline`'s data
    /// is `cmdline`, at offset 0x400.
    fn pe(sections: &[&str], cmdline: &str) -> Vec<u8> {
        let mut b = vec![0u8; 0x400];
        b[..2].copy_from_slice(b"MZ");
        b[0x3c..0x40].copy_from_slice(&0x80u32.to_le_bytes());
        b[0x80..0x84].copy_from_slice(b"PE\0\0");
        b[0x86..0x88].copy_from_slice(&(sections.len() as u16).to_le_bytes());
        b[0x94..0x96].copy_from_slice(&0xf0u16.to_le_bytes());
        for (i, name) in sections.iter().enumerate() {
            let h = 0x80 + 24 + 0xf0 + 40 * i;
            b[h..h + name.len()].copy_from_slice(name.as_bytes());
            b[h + 8..h + 12].copy_from_slice(&(cmdline.len() as u32).to_le_bytes());
            b[h + 16..h + 20].copy_from_slice(&0x200u32.to_le_bytes());
            b[h + 20..h + 24].copy_from_slice(&0x400u32.to_le_bytes());
        }
        b.extend_from_slice(cmdline.as_bytes());
        b.resize(0x600, 0);
        b
    }

    #[test]
    fn a_uki_is_a_pe_image_with_a_cmdline_section() {
        let uki = pe(&[".text", ".linux", ".cmdline"], "console=ttyS0");
        assert_eq!(pe_cmdline_section(&uki), Some((0x400, 13)));
        assert_eq!(pe_cmdline_section(&pe(&[".text", ".reloc"], "")), None);
        assert_eq!(pe_cmdline_section(&uki[..0x100]), None);
        assert_eq!(pe_cmdline_section(b"MZ"), None);
        let mut not_pe = uki.clone();
        not_pe[0x80] = b'X';
        assert_eq!(pe_cmdline_section(&not_pe), None);
    }

    #[test]
    fn ukis_are_found_anywhere_in_an_iso_and_their_meta_seen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.iso");
        let mut bytes = vec![0u8; 3 << 20];
        let plain = pe(&[".cmdline"], "console=ttyS0");
        let with_meta = pe(
            &[".cmdline"],
            "a talos.environment=INSTALLER_META_BASE64=AA==",
        );
        // One across the 1 MiB chunk boundary's neighbourhood, one later.
        let at1 = (1 << 20) - 512;
        bytes[at1..at1 + plain.len()].copy_from_slice(&plain);
        let at2 = (2 << 20) + 4096;
        bytes[at2..at2 + with_meta.len()].copy_from_slice(&with_meta);
        // Not sector aligned: not a file start.
        bytes[100..100 + plain.len()].copy_from_slice(&plain);
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(
            ukis(&path).unwrap(),
            [
                Uki {
                    offset: at1 as u64,
                    has_meta: false
                },
                Uki {
                    offset: at2 as u64,
                    has_meta: true
                },
            ]
        );
    }

    #[test]
    fn the_meta_of_an_entry_decodes() {
        let arg = meta::environment_arg(&[(10, "hello")], true).unwrap();
        let (cfg, _) = add_kernel_arg(FACTORY_CFG, &arg).unwrap();
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
        assert!(check_patchable("v1.12.0", Bootloader::Grub).is_ok());
        assert!(check_patchable("v1.13.1", Bootloader::Grub).is_ok());
        // v1.10 and v1.11 ISOs are dual-boot whatever the bootloader.
        for v in ["v1.10.0", "v1.11.2"] {
            for b in [Bootloader::None, Bootloader::Grub, Bootloader::SdBoot] {
                let msg = check_patchable(v, b).unwrap_err().to_string();
                assert!(
                    msg.contains("v1.12")
                        && msg.contains("bootloader: grub")
                        && msg.contains("imgbuild pxe")
                        && msg.contains("--route factory"),
                    "{msg}"
                );
            }
        }
        let e = check_patchable("v1.12.0", Bootloader::None).unwrap_err();
        assert!(matches!(e, IsoError::UkiIso { .. }), "{e}");
        assert!(check_patchable("v1.12.0", Bootloader::SdBoot).is_err());
        assert!(matches!(
            check_patchable("v1.4.8", Bootloader::Grub),
            Err(IsoError::TooOld { .. })
        ));
    }

    #[test]
    fn fuzz_grub_cfg_text_never_panics_and_meta_stays_one_last_argument() {
        use proptest::prelude::*;
        let line = proptest::string::string_regex(
            "(linux|linuxefi|menuentry|set|if|configfile|echo)?[ -~\t]{0,40}",
        )
        .unwrap();
        let meta = "talos.environment=INSTALLER_META_BASE64=AAAA";
        proptest!(crate::fuzz_config(), |(lines in proptest::collection::vec(line, 0..12))| {
            if !crate::fuzz_time_left() { return Ok(()); }
            let cfg = lines.join("\n");
            let _ = menu_entries(&cfg);
            let _ = too_long(&cfg);
            if let Ok((out, n)) = add_kernel_arg(&cfg, meta) {
                let entries = menu_entries(&out);
                prop_assert_eq!(entries.len(), n);
                for e in entries {
                    prop_assert_eq!(&e.script_problem, &None);
                    prop_assert_eq!(e.meta_args(), 1);
                    prop_assert_eq!(e.args.last().map(String::as_str), Some(meta));
                }
            }
        });
    }

    #[test]
    fn fuzz_xorriso_reports_and_pe_headers_never_panic() {
        use proptest::prelude::*;
        proptest!(crate::fuzz_config(), |(report in "[ -~\n]{0,200}", head in proptest::collection::vec(any::<u8>(), 0..2048), at in 0usize..1024)| {
            if !crate::fuzz_time_left() { return Ok(()); }
            let _ = data_extent(&report, GRUB_CFG);
            let _ = pe_cmdline_section(&head);
            // A real PE header with one byte changed: found or not, never
            // a section past the bytes it was given.
            let mut pe = pe(&[".text", ".cmdline"], "x");
            let i = at % pe.len();
            pe[i] = head.first().copied().unwrap_or(0);
            let _ = pe_cmdline_section(&pe);
        });
    }

    /// Rock Ridge entries and directory records mutated at random in a
    /// small ISO made by xorriso: reading `grub.cfg` ends (xorriso parses the
    /// tree; imgbuild reads at most 1 MiB from the image), never panics and
    /// leaves nothing behind. 32 cases unless `IMGBUILD_FUZZ_CASES` says.
    #[test]
    fn fuzz_rock_ridge_entries_of_a_mutated_iso() {
        use proptest::prelude::*;
        let dir = tempfile::tempdir().unwrap();
        let tree = dir.path().join("tree");
        std::fs::create_dir_all(tree.join("boot/grub")).unwrap();
        std::fs::write(tree.join("boot/grub/grub.cfg"), FACTORY_CFG).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", tree.join("boot/grub/link")).unwrap();
        let base = dir.path().join("base.iso");
        let ok = Command::new("xorriso")
            .args(["-as", "mkisofs", "-R", "-o"])
            .arg(&base)
            .arg(&tree)
            .output()
            .is_ok_and(|o| o.status.success());
        if !ok {
            panic!("xorriso is needed (Debian package xorriso)");
        }
        let bytes = std::fs::read(&base).unwrap();
        let cases = std::env::var("IMGBUILD_FUZZ_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(32);
        let work = dir.path().join("work");
        std::fs::create_dir(&work).unwrap();
        let iso = work.join("m.iso");
        // Sectors 18 on: path tables and directory records with their
        // Rock Ridge (SUSP) entries; 16 and 17 stay a valid volume.
        let span = bytes.len().min(40 * 2048) - 18 * 2048;
        proptest!(ProptestConfig::with_cases(cases), |(edits in proptest::collection::vec((0..span, any::<u8>()), 1..16))| {
            if !crate::fuzz_time_left() { return Ok(()); }
            let mut m = bytes.clone();
            for (at, b) in &edits {
                m[18 * 2048 + at] = *b;
            }
            std::fs::write(&iso, &m).unwrap();
            if let Ok(cfg) = read_grub_cfg(&iso) {
                prop_assert!(cfg.len() as u64 <= GRUB_CFG_MAX);
            }
            let _ = ukis(&iso);
            let left: Vec<_> = std::fs::read_dir(&work).unwrap().map(|e| e.unwrap().file_name()).collect();
            prop_assert_eq!(left, vec![std::ffi::OsString::from("m.iso")]);
        });
    }
}
