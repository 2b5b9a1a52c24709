#![allow(clippy::disallowed_macros)] // a skipped test says so on the test harness's stderr
//! Real firmware and bootloaders for the real-boot tests: Debian's cloud
//! kernel over a busybox initramfs that prints `/proc/cmdline` to the serial
//! port (fixtures/realboot.sh), booted by QEMU with SeaBIOS or OVMF from a
//! CD, a USB stick, an NVMe disk or QEMU's iPXE ROM over QEMU's own TFTP
//! server; or by OVMF's Secure Boot build with swtpm as the TPM. Guests get
//! `-netdev user,restrict=on` only: nothing beyond the VM.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::sims::Sim;
use super::{decode_meta, root, text};

/// The factory's own kernel arguments in these tests: Talos's consoles
/// (tty0 last, as Talos has it) and what keeps a boot short and sure:
/// `quiet`, `panic=-1` so that a kernel that cannot go on ends the VM at
/// once, and `no_timer_check` (under TCG on a busy machine the kernel's
/// IO-APIC timer check can miss its ticks and panic).
pub const FACTORY_CMDLINE: &str = "talos.platform=metal console=ttyS0 console=tty0 quiet panic=-1 no_timer_check module.sig_enforce=1";

/// The factory's command line for an ISO of Talos v1.8 or later: the ISO
/// output adds `talos.halt_if_installed=1` (siderolabs/talos
/// `pkg/imager/imager.go`), on GRUB's kernel lines and in a UKI alike.
pub fn iso_cmdline() -> String {
    format!("{FACTORY_CMDLINE} talos.halt_if_installed=1")
}

/// The longest one boot may take under TCG on a busy machine.
const BOOT_DEADLINE: Duration = Duration::from_secs(240);

/// What the tests boot, built once per fixture script and kernel.
pub struct Fixtures {
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
    /// systemd's EFI stub, for the factory's UKIs.
    pub stub: PathBuf,
    /// `kvm` where it boots Linux, else `tcg`.
    pub accel: String,
}

/// Set to 1 to skip the real-boot tests (printing that they were skipped).
pub fn skipped() -> bool {
    let skip = std::env::var("IMGBUILD_SKIP_REALBOOT").is_ok_and(|v| v == "1");
    if skip {
        eprintln!("real-boot test skipped: IMGBUILD_SKIP_REALBOOT=1");
    }
    skip
}

fn target_dir() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .unwrap()
        .to_owned()
}

/// The fixtures, built on first use under `target/realboot/<hash>` (the
/// hash of the script and the kernel's name: a changed script builds anew;
/// test processes racing each build their own and one rename wins).
pub fn fixtures() -> &'static Fixtures {
    static FX: OnceLock<Fixtures> = OnceLock::new();
    FX.get_or_init(|| {
        require(&[
            ("qemu-system-x86_64", "qemu-system-x86"),
            ("grub-mkrescue", "grub-common"),
            ("mformat", "mtools"),
            ("objcopy", "binutils"),
        ]);
        let stub = PathBuf::from("/usr/lib/systemd/boot/efi/linuxx64.efi.stub");
        assert!(
            stub.exists(),
            "{} is missing (Debian package systemd-boot-efi): run make deps",
            stub.display()
        );
        let kdir = target_dir().join("realboot-kernel");
        let kernel = std::fs::read_dir(kdir.join("boot"))
            .ok()
            .and_then(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .find(|n| n.starts_with("vmlinuz-"))
            })
            .unwrap_or_else(|| {
                panic!(
                    "no Debian kernel under {}: run make deps (it downloads linux-image-*-cloud-amd64)",
                    kdir.display()
                )
            });
        let script = root().join("fixtures/realboot.sh");
        let hash = {
            use sha2::Digest;
            let mut h = sha2::Sha256::new();
            h.update(std::fs::read(&script).unwrap());
            h.update(kernel.as_bytes());
            hex::encode(&h.finalize()[..8])
        };
        let dir = target_dir().join("realboot").join(hash);
        if !dir.join("accel").exists() {
            std::fs::create_dir_all(dir.parent().unwrap()).unwrap();
            let tmp = dir.with_extension(format!("tmp{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&tmp);
            let o = Command::new(&script)
                .arg("build")
                .arg(&tmp)
                .arg(&kdir)
                .output()
                .unwrap();
            assert!(o.status.success(), "realboot.sh: {}", text(&o.stderr));
            let accel = probe_kvm(&tmp);
            std::fs::write(tmp.join("accel"), accel).unwrap();
            if std::fs::rename(&tmp, &dir).is_err() {
                // Another test process got there first.
                let _ = std::fs::remove_dir_all(&tmp);
            }
        }
        Fixtures {
            kernel: dir.join("vmlinuz"),
            initramfs: dir.join("initramfs.xz"),
            stub,
            accel: std::fs::read_to_string(dir.join("accel")).unwrap(),
        }
    })
}

/// Panics naming the Debian package of the first `(tool, package)` whose
/// tool is not on the PATH.
pub fn require(tools: &[(&str, &str)]) {
    for (tool, package) in tools {
        let ok = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .is_ok_and(|o| o.status.success());
        assert!(
            ok,
            "{tool} is missing (Debian package {package}): run make deps, or set IMGBUILD_SKIP_REALBOOT=1"
        );
    }
}

/// `kvm` when a KVM guest boots the fixture kernel within seconds; on
/// machines whose KVM cannot run a Linux guest (a nested `kvm_pvm`) or has
/// none, `tcg`.
fn probe_kvm(fx: &Path) -> &'static str {
    if std::env::var("IMGBUILD_REALBOOT_ACCEL").is_ok_and(|a| a == "tcg")
        || !Path::new("/dev/kvm").exists()
    {
        return "tcg";
    }
    let args: Vec<String> = [
        "-kernel",
        fx.join("vmlinuz").to_str().unwrap(),
        "-initrd",
        fx.join("initramfs.xz").to_str().unwrap(),
        "-append",
        "console=ttyS0 quiet panic=-1",
        "-nic",
        "none",
    ]
    .map(str::to_owned)
    .to_vec();
    let b = run_qemu("kvm", fx, "kvm-probe", &args, &[], Duration::from_secs(10));
    if b.cmdline.is_some() { "kvm" } else { "tcg" }
}

/// A factory simulator that serves the fixture kernel and initramfs with
/// [`FACTORY_CMDLINE`], and makes real ISOs (dual-boot below v1.12).
pub fn factory() -> Sim {
    let fx = fixtures();
    Sim::start_with(
        &[],
        0,
        &[
            "--versions",
            "v1.11.2,v1.12.0",
            "--kernel",
            fx.kernel.to_str().unwrap(),
            "--initramfs",
            fx.initramfs.to_str().unwrap(),
            "--uki-stub",
            fx.stub.to_str().unwrap(),
            "--cmdline",
            FACTORY_CMDLINE,
        ],
    )
}

#[derive(Clone, Copy, Debug)]
pub enum Firmware<'a> {
    SeaBios,
    Ovmf,
    /// OVMF's Secure Boot build (`OVMF_CODE_4M.secboot.fd`: q35 with SMM,
    /// so that only SMM code writes the variables) on this variable store,
    /// which the boot writes in place (keys enrolled stay enrolled), and a
    /// TPM 2.0 from swtpm, fresh for each boot.
    OvmfSecureBoot {
        vars: &'a Path,
    },
}

/// One network card of a VM.
pub struct Nic<'a> {
    pub mac: &'a str,
    /// The firmware boots from this card (its iPXE ROM) first.
    pub boots: bool,
}

pub enum Medium<'a> {
    Cdrom(&'a Path),
    /// The image written to a USB stick as it is (a hybrid ISO's MBR/GPT).
    UsbStick(&'a Path),
    /// A disk image on an NVMe drive (the kernel's driver is built in);
    /// writes go to a throwaway overlay, so the file stays as it is.
    Nvme(&'a Path),
    /// iPXE over QEMU's TFTP server, which serves `tftp` and names
    /// `bootfile` in its DHCP answer.
    Network {
        tftp: &'a Path,
        bootfile: &'a str,
        nics: &'a [Nic<'a>],
    },
}

/// What one boot printed.
pub struct Boot {
    pub name: String,
    /// Everything on the serial port.
    pub serial: String,
    /// `/proc/cmdline` as the booted kernel saw it, when it got that far.
    pub cmdline: Option<String>,
    pub secs: f64,
}

/// What the initramfs reports before the command line (fixtures/realboot.sh):
/// the kernel's lines on Secure Boot, the TPM's PCRs, a META partition's
/// first 4 KiB.
#[derive(Debug, Default)]
pub struct Facts {
    /// dmesg lines naming Secure Boot.
    pub secure_boot: Vec<String>,
    /// `(7, hex)` and `(11, hex)` when the kernel found a TPM.
    pub pcrs: Vec<(u32, String)>,
    /// The first 4 KiB of the partition named META, as the kernel read it.
    pub meta_head: Option<Vec<u8>>,
}

impl Boot {
    /// The kernel's arguments, after asserting that the kernel ran.
    pub fn args(&self) -> Vec<String> {
        let c = self.cmdline.as_ref().unwrap_or_else(|| {
            panic!(
                "{}: no kernel printed /proc/cmdline in {:.0} s; serial output:\n{}",
                self.name,
                self.secs,
                tail(&self.serial)
            )
        });
        c.split_whitespace().map(str::to_owned).collect()
    }
}

impl Boot {
    /// What the initramfs reported; panics (with the serial output) when the
    /// kernel never got there.
    pub fn facts(&self) -> Facts {
        let body = self
            .serial
            .find(FACTS_BEGIN)
            .and_then(|b| {
                let rest = &self.serial[b + FACTS_BEGIN.len()..];
                rest.find(FACTS_END).map(|e| &rest[..e])
            })
            .unwrap_or_else(|| {
                panic!(
                    "{}: the initramfs reported nothing; serial output:\n{}",
                    self.name,
                    tail(&self.serial)
                )
            });
        let mut facts = Facts::default();
        for line in body.lines().map(str::trim) {
            if let Some(b64) = line.strip_prefix("meta=") {
                use base64::Engine;
                facts.meta_head = Some(
                    base64::engine::general_purpose::STANDARD
                        .decode(b64)
                        .unwrap(),
                );
            } else if let Some((pcr, hex)) = line
                .strip_prefix("pcr")
                .and_then(|l| l.split_once('='))
                .and_then(|(n, h)| Some((n.parse().ok()?, h.to_ascii_lowercase())))
            {
                facts.pcrs.push((pcr, hex));
            } else if line.to_ascii_lowercase().contains("secure boot") {
                facts.secure_boot.push(line.to_owned());
            }
        }
        facts
    }
}

fn tail(s: &str) -> String {
    let cut = s.len().saturating_sub(3000);
    let cut = (cut..s.len()).find(|&i| s.is_char_boundary(i)).unwrap_or(0);
    s[cut..].to_owned()
}

/// Boots `medium` under `firmware` until the initramfs prints its command
/// line (or any of `stop_at` appears, or the deadline passes); `scratch`
/// holds the serial log and OVMF's variables.
pub fn boot(
    name: &str,
    scratch: &Path,
    firmware: Firmware,
    medium: Medium,
    stop_at: &[&str],
) -> Boot {
    let fx = fixtures();
    let mut args: Vec<String> = Vec::new();
    let mut push = |a: &[&str]| args.extend(a.iter().map(|s| (*s).to_owned()));
    let mut _tpm = None;
    match firmware {
        Firmware::SeaBios => {}
        Firmware::Ovmf => {
            let vars = scratch.join(format!("{name}.vars.fd"));
            std::fs::copy("/usr/share/OVMF/OVMF_VARS_4M.fd", &vars).unwrap();
            push(&[
                "-drive",
                "if=pflash,format=raw,readonly=on,file=/usr/share/OVMF/OVMF_CODE_4M.fd",
                "-drive",
                &format!("if=pflash,format=raw,file={}", vars.display()),
            ]);
        }
        Firmware::OvmfSecureBoot { vars } => {
            let tpm = Swtpm::start(&scratch.join(format!("{name}.tpm")));
            push(&[
                "-machine",
                "q35,smm=on",
                "-global",
                "driver=cfi.pflash01,property=secure,value=on",
                "-drive",
                &format!("if=pflash,format=raw,unit=0,readonly=on,file={SECBOOT_CODE}"),
                "-drive",
                &format!("if=pflash,format=raw,unit=1,file={}", vars.display()),
                "-chardev",
                &format!("socket,id=chrtpm,path={}", tpm.socket.display()),
                "-tpmdev",
                "emulator,id=tpm0,chardev=chrtpm",
                "-device",
                "tpm-tis,tpmdev=tpm0",
            ]);
            _tpm = Some(tpm);
        }
    }
    match medium {
        Medium::Cdrom(iso) => push(&[
            "-drive",
            &format!("media=cdrom,readonly=on,format=raw,file={}", iso.display()),
            "-nic",
            "none",
        ]),
        Medium::UsbStick(img) => push(&[
            "-drive",
            &format!(
                "if=none,id=stick,readonly=on,format=raw,file={}",
                img.display()
            ),
            "-device",
            "qemu-xhci",
            "-device",
            "usb-storage,drive=stick,bootindex=1",
        ]),
        Medium::Nvme(img) => push(&[
            "-drive",
            &format!(
                "if=none,id=disk,snapshot=on,format=raw,file={}",
                img.display()
            ),
            "-device",
            "nvme,drive=disk,serial=realboot,bootindex=1",
            "-nic",
            "none",
        ]),
        Medium::Network {
            tftp,
            bootfile,
            nics,
        } => {
            for (i, nic) in nics.iter().enumerate() {
                push(&[
                    "-netdev",
                    &format!(
                        "user,id=n{i},restrict=on,tftp={},bootfile={bootfile}",
                        tftp.display()
                    ),
                    "-device",
                    &format!(
                        "e1000,netdev=n{i},mac={}{}",
                        nic.mac,
                        if nic.boots { ",bootindex=1" } else { "" }
                    ),
                ]);
            }
        }
    }
    if matches!(medium, Medium::UsbStick(_)) {
        push(&["-nic", "none"]);
    }
    run_qemu(&fx.accel, scratch, name, &args, stop_at, BOOT_DEADLINE)
}

/// What firmware and GRUB print when they have nothing to boot: a boot that
/// shows one of these has failed, and ends at once.
const DEAD_ENDS: [&str; 5] = [
    "No bootable device",
    "No bootable option or device was found",
    "Shell> ",
    "grub rescue>",
    "grub> ",
];

const BEGIN: &str = "REALBOOT-CMDLINE-BEGIN";
const END: &str = "REALBOOT-CMDLINE-END";
const FACTS_BEGIN: &str = "REALBOOT-FACTS-BEGIN";
const FACTS_END: &str = "REALBOOT-FACTS-END";

/// OVMF built with Secure Boot and SMM (Debian's ovmf); its variable store
/// template `OVMF_VARS_4M.fd` holds no keys: setup mode.
pub const SECBOOT_CODE: &str = "/usr/share/OVMF/OVMF_CODE_4M.secboot.fd";
pub const BLANK_VARS: &str = "/usr/share/OVMF/OVMF_VARS_4M.fd";

/// A swtpm TPM 2.0 on a Unix socket for one VM; it ends when QEMU lets go
/// of it (`--terminate`) or when this is dropped.
struct Swtpm {
    child: std::process::Child,
    socket: PathBuf,
}

impl Swtpm {
    fn start(dir: &Path) -> Swtpm {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).unwrap();
        let socket = dir.join("sock");
        let child = Command::new("swtpm")
            .arg("socket")
            .arg("--tpm2")
            .arg("--terminate")
            .arg("--tpmstate")
            .arg(format!("dir={}", dir.display()))
            .arg("--ctrl")
            .arg(format!("type=unixio,path={}", socket.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("swtpm (Debian package swtpm): run make deps");
        let started = Instant::now();
        while !socket.exists() {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "swtpm did not open {}",
                socket.display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Swtpm { child, socket }
    }
}

impl Drop for Swtpm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Guests that may boot at once in one test process: one per core, so a
/// test binary run with many threads (they mostly wait on simulators) does
/// not starve TCG guests past their deadlines.
struct GuestSlot;

static GUESTS: std::sync::Mutex<usize> = std::sync::Mutex::new(0);
static GUEST_FREED: std::sync::Condvar = std::sync::Condvar::new();

impl GuestSlot {
    fn take() -> GuestSlot {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut running = GUESTS.lock().unwrap_or_else(|e| e.into_inner());
        while *running >= cores {
            running = GUEST_FREED.wait(running).unwrap_or_else(|e| e.into_inner());
        }
        *running += 1;
        GuestSlot
    }
}

impl Drop for GuestSlot {
    fn drop(&mut self) {
        *GUESTS.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
        GUEST_FREED.notify_one();
    }
}

fn run_qemu(
    accel: &str,
    scratch: &Path,
    name: &str,
    args: &[String],
    stop_at: &[&str],
    deadline: Duration,
) -> Boot {
    let _slot = GuestSlot::take();
    let log = scratch.join(format!("{name}.serial"));
    let started = Instant::now();
    let mut child = Command::new("qemu-system-x86_64")
        .args(["-accel", accel, "-m", "256", "-nographic", "-no-reboot"])
        .args(args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(Stdio::piped())
        .spawn()
        .expect("qemu-system-x86_64 (run make deps)");
    let serial = || String::from_utf8_lossy(&std::fs::read(&log).unwrap_or_default()).into_owned();
    loop {
        let out = serial();
        let done = child.try_wait().unwrap().is_some()
            || out.contains(END)
            || stop_at.iter().chain(&DEAD_ENDS).any(|s| out.contains(s))
            || started.elapsed() > deadline;
        if done {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    // The initramfs powers off right after the marker; give it a moment.
    for _ in 0..20 {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
    let mut err = String::new();
    let _ = child.stderr.take().unwrap().read_to_string(&mut err);
    let mut serial = serial();
    if !err.trim().is_empty() {
        serial.push_str("\n[qemu stderr] ");
        serial.push_str(&err);
    }
    let cmdline = serial.find(BEGIN).and_then(|b| {
        let rest = &serial[b + BEGIN.len()..];
        rest.find(END).map(|e| rest[..e].trim().to_owned())
    });
    Boot {
        name: name.to_owned(),
        serial,
        cmdline,
        secs: started.elapsed().as_secs_f64(),
    }
}

/// Asserts that `boot`'s kernel got exactly the factory's command line
/// `factory` (behind GRUB's `BOOT_IMAGE=` when `grub`) and one META
/// argument whose value, decoded here, is `0xa=<key10>`.
pub fn assert_node_cmdline(boot: &Boot, grub: bool, factory: &str, key10: &str) {
    let mut args = boot.args();
    let shown = args.join(" ");
    if grub {
        assert_eq!(
            args.first().map(String::as_str),
            Some("BOOT_IMAGE=/boot/vmlinuz"),
            "{}: GRUB puts BOOT_IMAGE first: {shown}",
            boot.name
        );
        args.remove(0);
    }
    let (meta, rest): (Vec<String>, Vec<String>) = args
        .into_iter()
        .partition(|a| a.starts_with("talos.environment="));
    assert_eq!(
        rest.join(" "),
        factory,
        "{}: the factory's command line, nothing more or less: {shown}",
        boot.name
    );
    assert_eq!(
        meta.len(),
        1,
        "{}: exactly one META argument: {shown}",
        boot.name
    );
    let value = String::from_utf8(decode_meta(&meta[0])).unwrap();
    assert_eq!(
        value.strip_prefix("0xa="),
        Some(key10),
        "{}: META must be the node's key 10 and nothing else",
        boot.name
    );
}

/// Node `node`'s key-10 value as imgbuild's schematic for it carries it.
pub fn key10(config: &Path, node: &str) -> String {
    let o = super::run::Run::with_config(config, &["schematic", node, "--output", "json"]).output();
    let v = super::json(&o);
    let yaml: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(v["schematic"].as_str().unwrap()).unwrap();
    yaml["customization"]["meta"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| m["key"].as_u64() == Some(10))
        .and_then(|m| m["value"].as_str())
        .unwrap_or_else(|| panic!("{node}: no key 10 in {}", v["schematic"]))
        .to_owned()
}
