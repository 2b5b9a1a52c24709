//! The rescue system of a simulated Hetzner server: a real OpenSSH `sshd`
//! on the server's own loopback address, with a host key made for this boot
//! and only the keys given to `enable_rescue`. Its sessions run with a PATH
//! whose `hostname`, `blkdiscard` and `dd` are wrapper scripts standing in
//! for the rescue system's (hostname `rescue`; `/dev/sda` is the server's
//! disk file); `zstd`, `sync` and the shell are the machine's own.

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// What one rescue boot needs.
pub struct Spec {
    /// Where its key, config, wrappers and log are written (remade each boot).
    pub dir: PathBuf,
    /// The file that `/dev/sda` stands for.
    pub disk: PathBuf,
    /// The server's own loopback address (its `public_net.ipv4.ip`).
    pub ip: Ipv4Addr,
    /// `--rescue-ssh-port`, else 22, or a free port when 22 is not ours
    /// to take.
    pub port: u16,
    /// OpenSSH public key lines allowed to log in as root.
    pub keys: Vec<String>,
    /// `dd` exits non-zero (the `--dd-fails` switch).
    pub dd_fails: bool,
}

/// The port sshd should use on `ip`: 22 as on the real rescue system when
/// `try_22`, we may, and it is free there; otherwise any free one.
pub fn choose_port(ip: Ipv4Addr, try_22: bool) -> anyhow::Result<u16> {
    if try_22 && is_root() && TcpListener::bind((ip, 22)).is_ok() {
        return Ok(22);
    }
    Ok(TcpListener::bind((ip, 0))?.local_addr()?.port())
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Quotes `s` for a POSIX shell.
fn sq(s: &Path) -> String {
    format!("'{}'", s.display().to_string().replace('\'', r"'\''"))
}

fn write_exec(path: &Path, text: &str) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))?;
    Ok(())
}

/// The first of `candidates` that exists (the real `dd` the wrapper execs).
fn find(candidates: &[&str]) -> anyhow::Result<PathBuf> {
    candidates
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .with_context(|| format!("none of {candidates:?} exists"))
}

/// Writes the wrappers, host key, authorized keys and config for one boot.
fn prepare(spec: &Spec) -> anyhow::Result<PathBuf> {
    let _ = std::fs::remove_dir_all(&spec.dir);
    let bin = spec.dir.join("bin");
    std::fs::create_dir_all(&bin)?;
    let disk = sq(&spec.disk);
    write_exec(&bin.join("hostname"), "#!/bin/sh\necho rescue\n")?;
    write_exec(
        &bin.join("blkdiscard"),
        &format!(
            r#"#!/bin/bash
# blkdiscard of the simulated rescue system: /dev/sda is {disk}.
force=0 dev=
for a in "$@"; do
  case "$a" in
    -f|--force) force=1 ;;
    -*) echo "blkdiscard: unrecognized option '$a'" >&2; exit 1 ;;
    *) dev=$a ;;
  esac
done
if [ "$dev" != /dev/sda ]; then echo "blkdiscard: cannot open $dev: No such file or directory" >&2; exit 1; fi
if [ $force = 0 ]; then echo "blkdiscard: /dev/sda contains existing partition (gpt); use --force" >&2; exit 1; fi
: > {disk}
"#
        ),
    )?;
    let dd = if spec.dd_fails {
        // As GNU dd fails when it cannot open its output (coreutils
        // `src/dd.c`, `open_fd` of `of=`): before reading a byte of input,
        // so the client must notice the exit, not a full pipe.
        "#!/bin/bash\n# dd of the simulated rescue system, failing (--dd-fails).\n\
         echo \"dd: failed to open '/dev/sda': Input/output error\" >&2\nexit 1\n"
            .to_owned()
    } else {
        let real = find(&["/usr/bin/dd", "/bin/dd"])?;
        format!(
            r#"#!/bin/bash
# dd of the simulated rescue system: of=/dev/sda writes {disk}; every other operand passes.
args=()
for a in "$@"; do
  case "$a" in
    of=/dev/sda) args+=(of={disk}) ;;
    *) args+=("$a") ;;
  esac
done
exec {} "${{args[@]}}"
"#,
            sq(&real)
        )
    };
    write_exec(&bin.join("dd"), &dd)?;
    // Every session runs the command the client asked for under bash with
    // the wrappers first in PATH (--norc: no rc file may change PATH back).
    let session = spec.dir.join("session");
    write_exec(
        &session,
        &format!(
            "#!/bin/sh\nPATH={}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n\
             export PATH\nexec /bin/bash --norc -c \"${{SSH_ORIGINAL_COMMAND:-exit 0}}\"\n",
            sq(&bin)
        ),
    )?;
    let host_key = spec.dir.join("ssh_host_ed25519_key");
    let st = std::process::Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C", "rescue", "-f"])
        .arg(&host_key)
        .status()
        .context("running ssh-keygen (package openssh-client)")?;
    anyhow::ensure!(st.success(), "ssh-keygen failed making the rescue host key");
    let authorized = spec.dir.join("authorized_keys");
    std::fs::write(&authorized, spec.keys.join("\n") + "\n")?;
    let config = spec.dir.join("sshd_config");
    std::fs::write(
        &config,
        format!(
            "ListenAddress {}:{}\nHostKey {}\nAuthorizedKeysFile {}\nPermitRootLogin prohibit-password\n\
             PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n\
             PidFile none\nForceCommand {}\nPrintMotd no\nLogLevel ERROR\n",
            spec.ip,
            spec.port,
            host_key.display(),
            authorized.display(),
            session.display(),
        ),
    )?;
    Ok(config)
}

/// Starts the rescue sshd and waits until it listens. The child is killed
/// when dropped, and by the kernel if the simulator dies first.
pub async fn start(spec: &Spec) -> anyhow::Result<tokio::process::Child> {
    let config = prepare(spec)?;
    if is_root() {
        std::fs::create_dir_all("/run/sshd")?; // sshd's privilege separation directory
    }
    let log = std::fs::File::create(spec.dir.join("sshd.log"))?;
    let mut cmd = tokio::process::Command::new("/usr/sbin/sshd");
    cmd.args(["-D", "-e", "-f"])
        .arg(&config)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .kill_on_drop(true);
    // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .context("starting /usr/sbin/sshd (package openssh-server)")?;
    let addr = SocketAddr::from((spec.ip, spec.port));
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            return Ok(child);
        }
        if let Some(status) = child.try_wait()? {
            let log = std::fs::read_to_string(spec.dir.join("sshd.log")).unwrap_or_default();
            bail!("rescue sshd on {addr} exited ({status}): {}", log.trim());
        }
        if Instant::now() > deadline {
            bail!("rescue sshd on {addr} did not listen within 5 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
