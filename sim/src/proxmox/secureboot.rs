//! Secure Boot on the Proxmox VE double: what qemu-server refuses about the
//! EFI vars disk and the TPM state disk, and whether OVMF boots a Secure
//! Boot Talos disk with the VM's firmware settings.
//!
//! From proxmox/qemu-server: `src/PVE/API2/Qemu.pm` (`$check_drive_param`:
//! an `import-from` efidisk0 needs `efitype` and `pre-enrolled-keys`, a
//! tpmstate0 needs `version`; `prohibit_tpm_version_change`: "cannot change
//! TPM state version after creation"), `src/PVE/QemuServer/Drive.pm`
//! (tpmstate `version` defaults to `v1.2`), `src/PVE/QemuServer/OVMF.pm`
//! (only `efitype=4m` selects the Secure Boot capable 4M firmware, and
//! `pre-enrolled-keys=1` the vars template with distribution and Microsoft
//! keys enrolled, Secure Boot on; without it the vars are empty: setup mode),
//! `src/PVE/QemuServer.pm` (swtpm gets `--tpm2` only for `version=v2.0`).

use std::collections::BTreeMap;
use std::path::Path;

/// The value of option `key` in a drive string (`local-lvm:1,efitype=4m`).
fn option<'a>(drive: &'a str, key: &str) -> Option<&'a str> {
    drive
        .split(',')
        .skip(1)
        .filter_map(|p| p.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v)
}

/// `$check_drive_param` for the two firmware drives.
pub fn check_drive_param(opt: &str, drive: &str) -> Result<(), String> {
    if option(drive, "import-from").is_none() {
        return Ok(());
    }
    let required: &[&str] = if opt.starts_with("efidisk") {
        &["efitype", "pre-enrolled-keys"]
    } else if opt.starts_with("tpmstate") {
        &["version"]
    } else {
        &[]
    };
    match required.iter().find(|k| option(drive, k).is_none()) {
        Some(k) => Err(format!("need to specify '{k}' when using 'import-from'")),
        None => Ok(()),
    }
}

/// `prohibit_tpm_version_change`: the same TPM volume with another version.
pub fn check_tpm_change(old: Option<&str>, new: &str) -> Result<(), String> {
    let Some(old) = old else { return Ok(()) };
    let file = |d: &str| d.split(',').next().unwrap_or_default().to_owned();
    if file(old) != file(new) {
        return Ok(());
    }
    let version = |d| option(d, "version").unwrap_or("v1.2").to_owned();
    if version(old) != version(new) {
        return Err("cannot change TPM state version after creation".into());
    }
    Ok(())
}

/// Whether a boot disk is a Secure Boot Talos disk: its EFI partition holds
/// the keys systemd-boot enrolls (`loader/keys/auto/db.auth`), which only
/// the Secure Boot images carry (siderolabs/talos `sdboot.go`). Read with
/// mtools, as a firmware reads the FAT.
pub fn is_secure_boot_disk(disk: &Path) -> bool {
    let Ok(mut f) = std::fs::File::open(disk) else {
        return false;
    };
    let Ok((offset, _)) = crate::disk::find_partition(&mut f, "EFI") else {
        return false;
    };
    std::process::Command::new("mdir")
        .arg("-i")
        .arg(format!("{}@@{offset}", disk.display()))
        .arg("::/loader/keys/auto/db.auth")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Why the VM's firmware would not bring up a Secure Boot Talos disk, if it
/// would not: OVMF needs the 4M Secure Boot vars, empty (setup mode) so
/// systemd-boot can enroll Talos's keys; with Microsoft's keys pre-enrolled
/// the factory-signed systemd-boot is refused ("Security Violation"); and
/// Talos seals its disk keys to a TPM 2.0, which swtpm emulates only with
/// `version=v2.0` (the default is v1.2).
pub fn firmware_refusal(config: &BTreeMap<String, String>) -> Option<String> {
    if config.get("bios").map(String::as_str) != Some("ovmf") {
        return Some("Secure Boot image on SeaBIOS: set bios=ovmf".into());
    }
    let Some(efi) = config.get("efidisk0") else {
        return Some("Secure Boot image without an EFI disk: OVMF has no key store (add efidisk0 with efitype=4m,pre-enrolled-keys=0)".into());
    };
    if option(efi, "efitype") != Some("4m") {
        return Some(format!(
            "efidisk0 {efi}: the 2m EFI vars have no Secure Boot; use efitype=4m"
        ));
    }
    if option(efi, "pre-enrolled-keys").is_some_and(|v| matches!(v, "1" | "true" | "yes" | "on")) {
        return Some(format!(
            "efidisk0 {efi}: Microsoft's keys are pre-enrolled (Secure Boot in user mode), so the factory-signed systemd-boot is refused: Verification failed: (0x1A) Security Violation; use pre-enrolled-keys=0 (setup mode)"
        ));
    }
    let Some(tpm) = config.get("tpmstate0") else {
        return Some("Secure Boot image without a TPM: add tpmstate0 with version=v2.0".into());
    };
    let version = option(tpm, "version").unwrap_or("v1.2");
    if version != "v2.0" {
        return Some(format!(
            "tpmstate0 {tpm}: a TPM {version} (qemu-server's default is v1.2); Talos seals its disk keys to a TPM 2.0: use version=v2.0"
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn only_setup_mode_4m_vars_and_a_v2_tpm_boot_secure_boot() {
        let good = [
            ("bios", "ovmf"),
            (
                "efidisk0",
                "local-lvm:vm-1-disk-0,efitype=4m,pre-enrolled-keys=0,size=4M",
            ),
            ("tpmstate0", "local-lvm:vm-1-disk-1,size=4M,version=v2.0"),
        ];
        assert_eq!(firmware_refusal(&config(&good)), None);
        let mut c = config(&good);
        c.insert("tpmstate0".into(), "local-lvm:vm-1-disk-1,size=4M".into());
        assert!(firmware_refusal(&c).unwrap().contains("v1.2"));
        let mut c = config(&good);
        c.insert(
            "efidisk0".into(),
            "local-lvm:vm-1-disk-0,efitype=4m,pre-enrolled-keys=1".into(),
        );
        assert!(firmware_refusal(&c).unwrap().contains("Security Violation"));
        let mut c = config(&good);
        c.insert("efidisk0".into(), "local-lvm:vm-1-disk-0".into());
        assert!(firmware_refusal(&c).unwrap().contains("4m"));
    }

    #[test]
    fn qemu_server_refusals() {
        assert!(check_drive_param("tpmstate0", "s:0,import-from=s:import/t.raw").is_err());
        assert!(check_drive_param("efidisk0", "s:0,import-from=x,efitype=4m").is_err());
        assert!(check_drive_param("tpmstate0", "s:1").is_ok());
        assert!(
            check_tpm_change(Some("s:vm-1-disk-1,size=4M"), "s:vm-1-disk-1,version=v2.0").is_err()
        );
        assert!(check_tpm_change(Some("s:vm-1-disk-1,version=v1.2"), "s:1,version=v2.0").is_ok());
    }
}
