//! The rescue system over SSH: log in as root with the run's temporary key,
//! check where we are, and stream the image into `dd`. The client is
//! OpenSSH's `ssh` (package openssh-client), started once per command with
//! no user or system configuration (`-F /dev/null`). The commands are fixed
//! strings passed as the one argument after the destination: nothing from a
//! URL, a label or the API reaches the remote shell. Facts:
//! apricote/hcloud-upload-image `hcloudimages/client.go` writes the disk the
//! same way; OpenSSH `PROTOCOL.key` and `sshkey.c` (the private key file),
//! `ssh_config(5)` (the options), `ssh(1)` (exit status 255 is ssh's own).

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD};

use super::error::HcloudError;
use crate::publish::Cancel;

/// Empties the disk first so the snapshot holds only what the image writes
/// (a thin snapshot is faster to make and to boot from).
pub const DISCARD: &str = "blkdiscard --force /dev/sda";

/// The one command that writes the disk: zstd-compressed image on stdin.
pub const WRITE: &str =
    "set -euo pipefail; zstd -d | dd of=/dev/sda bs=4M conv=sparse iflag=fullblock; sync";

/// What a login attempt runs: nothing, it only proves the login works.
const LOGIN: &str = "true";

/// The OpenSSH client, looked up on `PATH`.
const SSH: &str = "ssh";

/// How often a wait looks at the cancel flag and whether `ssh` has ended.
const TICK: Duration = Duration::from_millis(50);

/// How long the rescue system may leave the image unread while its command
/// runs (the SSH window is full) before the copy is given up.
const STALL: Duration = Duration::from_secs(120);

/// Output kept per stream of a remote command.
const KEEP: usize = 64 << 10;

/// Bytes `dd` reports having copied, from its final statistics line
/// (`N bytes (… MB, … MiB) copied, …`).
pub fn dd_bytes(stderr: &str) -> Option<u64> {
    stderr.lines().rev().find_map(|line| {
        let (n, rest) = line.trim().split_once(' ')?;
        (rest.starts_with("bytes") || rest.starts_with("byte "))
            .then(|| n.parse().ok())
            .flatten()
    })
}

/// Whether `blkdiscard` failed only because the disk cannot discard, which
/// leaves the disk as it was (and `dd` overwrites it).
pub fn discard_unsupported(stderr: &str) -> bool {
    let s = stderr.to_ascii_lowercase();
    s.contains("not supported") || s.contains("operation not supported")
}

/// What a finished command left.
#[derive(Debug)]
pub struct Exec {
    pub status: Option<u32>,
    pub stdout: String,
    pub stderr: String,
}

/// Fails with [`HcloudError::SshMissing`] unless `ssh` can be started:
/// checked before a run creates anything it would have to clean up.
pub fn check_client() -> Result<(), HcloudError> {
    check_program(Path::new(SSH))
}

fn check_program(program: &Path) -> Result<(), HcloudError> {
    Command::new(program)
        .arg("-V")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(drop)
        .map_err(spawn_error)
}

/// Starts `ssh`, again after a moment when the kernel says its file is
/// busy (another thread's fork held it open for writing for an instant).
fn spawn(ssh: &mut Command) -> Result<Child, HcloudError> {
    let mut tries = 0;
    loop {
        match ssh.spawn() {
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) && tries < 20 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(10));
            }
            r => return r.map_err(spawn_error),
        }
    }
}

fn spawn_error(e: std::io::Error) -> HcloudError {
    if e.kind() == std::io::ErrorKind::NotFound {
        HcloudError::SshMissing
    } else {
        HcloudError::Ssh(format!("starting {SSH}: {e}"))
    }
}

/// The run's temporary SSH identity: an ed25519 key from the system's
/// random source, written 0600 in a private (0700) directory of its own
/// that also takes the rescue system's host key once seen. The directory
/// goes when this is dropped. The key file is written here rather than by
/// `ssh-keygen`: one binary fewer to need, no output to parse, and the key
/// never exists anywhere but in memory and that one file.
pub struct Identity {
    dir: PathBuf,
    /// The public key line for the API (`ssh-ed25519 AAAA…`).
    public: String,
    /// The key file, locked while the run lives: the next run removes the
    /// directory of a run killed before it could (SIGKILL), whose lock
    /// died with it.
    _lock: std::fs::File,
}

/// The name of a run's key directory in the temp dir: this, 16 hex digits.
const DIR_PREFIX: &str = "imgbuild-ssh-";

/// The private key file in it.
const KEY_FILE: &str = "id_ed25519";

impl Identity {
    pub fn new() -> Result<Identity, HcloudError> {
        let random = |b: &mut [u8]| {
            aws_lc_rs::rand::fill(b)
                .map_err(|_| HcloudError::Setup("the system's random source failed".into()))
        };
        let mut seed = [0u8; 32];
        random(&mut seed)?;
        let mut check = [0u8; 4];
        random(&mut check)?;
        let pair = aws_lc_rs::signature::Ed25519KeyPair::from_seed_unchecked(&seed)
            .map_err(|e| HcloudError::Setup(format!("making the SSH key: {e}")))?;
        let public: &[u8] = aws_lc_rs::signature::KeyPair::public_key(&pair).as_ref();
        let public: [u8; 32] = public
            .try_into()
            .map_err(|_| HcloudError::Setup("an ed25519 public key of another size".into()))?;
        let mut name = [0u8; 8];
        random(&mut name)?;
        let base = temp_base();
        let name = hex::encode(name);
        let dir = base.join(format!("{DIR_PREFIX}{name}"));
        // Made under another name and renamed once locked, so that no run
        // ever sees it unlocked.
        let staging = base.join(format!("{DIR_PREFIX}new-{name}"));
        let made = std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&staging)
            .and_then(|()| {
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(staging.join(KEY_FILE))?;
                f.lock()?;
                f.write_all(
                    private_key_file(&seed, &public, u32::from_ne_bytes(check)).as_bytes(),
                )?;
                std::fs::rename(&staging, &dir)?;
                Ok(f)
            });
        let lock = made.map_err(|e| {
            let _ = std::fs::remove_dir_all(&staging);
            HcloudError::Io(format!(
                "writing the run's SSH key in {}: {e}",
                base.display()
            ))
        })?;
        sweep(&base, &dir);
        Ok(Identity {
            dir,
            public: format!("ssh-ed25519 {}", STANDARD.encode(public_blob(&public))),
            _lock: lock,
        })
    }

    /// The public key line the API takes (`ssh-ed25519 AAAA…`).
    pub fn public_line(&self) -> &str {
        &self.public
    }

    fn key_file(&self) -> PathBuf {
        self.dir.join(KEY_FILE)
    }

    fn known_hosts(&self) -> PathBuf {
        self.dir.join("known_hosts")
    }
}

impl Drop for Identity {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Removes the key directories in `base` (but `own`) of runs that are
/// gone: ours, and nobody holds their key file locked.
fn sweep(base: &Path, own: &Path) {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let ours = name
            .to_str()
            .and_then(|n| n.strip_prefix(DIR_PREFIX))
            .is_some_and(|rest| rest.len() == 16 && rest.bytes().all(|b| b.is_ascii_hexdigit()));
        let mine = std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir() && m.uid() == uid);
        if !ours || !mine || path == own {
            continue;
        }
        let Ok(key) = std::fs::File::open(path.join(KEY_FILE)) else {
            continue;
        };
        if key.try_lock().is_ok() {
            let _ = std::fs::remove_dir_all(&path);
        }
    }
}

/// The temp dir, unless ssh would read its path otherwise than as written
/// (`IdentityFile` and `UserKnownHostsFile` split at spaces and expand `%`
/// and `~`): then `/tmp`.
fn temp_base() -> PathBuf {
    let dir = std::env::temp_dir();
    let plain = dir.to_str().is_some_and(|s| {
        s.starts_with('/')
            && s.bytes()
                .all(|c| c.is_ascii_alphanumeric() || b"/._-+".contains(&c))
    });
    if plain { dir } else { PathBuf::from("/tmp") }
}

/// An SSH wire string: length (u32, big-endian), then the bytes.
fn put(buf: &mut Vec<u8>, s: &[u8]) {
    buf.extend((s.len() as u32).to_be_bytes());
    buf.extend(s);
}

/// The public key blob of an ed25519 key (RFC 8709).
fn public_blob(public: &[u8; 32]) -> Vec<u8> {
    let mut b = Vec::new();
    put(&mut b, b"ssh-ed25519");
    put(&mut b, public);
    b
}

/// The unencrypted `openssh-key-v1` file of an ed25519 key, as
/// `ssh-keygen -N ''` writes it (PROTOCOL.key): `check` is the random
/// check integer, written twice.
fn private_key_file(seed: &[u8; 32], public: &[u8; 32], check: u32) -> String {
    let mut private = Vec::new();
    private.extend(check.to_be_bytes());
    private.extend(check.to_be_bytes());
    put(&mut private, b"ssh-ed25519");
    put(&mut private, public);
    let mut secret = seed.to_vec();
    secret.extend(public);
    put(&mut private, &secret);
    put(&mut private, b""); // the comment
    let mut pad = 1u8;
    while private.len() % 8 != 0 {
        private.push(pad);
        pad += 1;
    }
    let mut body = b"openssh-key-v1\0".to_vec();
    put(&mut body, b"none"); // cipher
    put(&mut body, b"none"); // KDF
    put(&mut body, b""); // KDF options
    body.extend(1u32.to_be_bytes());
    put(&mut body, &public_blob(public));
    put(&mut body, &private);
    let text = STANDARD.encode(body);
    let mut out = String::from("-----BEGIN OPENSSH PRIVATE KEY-----\n");
    for line in text.as_bytes().chunks(70) {
        out.push_str(std::str::from_utf8(line).unwrap_or_default());
        out.push('\n');
    }
    out.push_str("-----END OPENSSH PRIVATE KEY-----\n");
    out
}

/// `SHA256:…` (base64 without padding, as `ssh-keygen -l` shows it) of the
/// first host key in an OpenSSH known_hosts file.
fn known_host_fingerprint(text: &str) -> Option<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .find_map(|l| {
            let mut fields = l.split_whitespace();
            if fields.next()?.starts_with('@') {
                fields.next()?; // a marker came before the host
            }
            let _kind = fields.next()?;
            let blob = STANDARD.decode(fields.next()?).ok()?;
            let digest = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, &blob);
            Some(format!(
                "SHA256:{}",
                STANDARD_NO_PAD.encode(digest.as_ref())
            ))
        })
}

/// A login to the rescue system that worked; each command is a new `ssh`
/// that must see the same host key.
pub struct Rescue<'a> {
    /// `ssh` (another program only in tests).
    program: PathBuf,
    identity: &'a Identity,
    addr: SocketAddr,
    user: String,
    /// `SHA256:…` of the host key accepted for this session.
    pub host_key: String,
}

impl<'a> Rescue<'a> {
    /// Logs in as `user` (root on Hetzner) at `addr`, trying again until
    /// `deadline`: the rescue system boots for about a minute and refuses
    /// connections meanwhile. Its host key is new on every rescue boot, so
    /// there is nothing to check it against: the first one a login attempt
    /// sees is accepted, and every later command must see it again.
    pub fn connect(
        addr: SocketAddr,
        user: &str,
        identity: &'a Identity,
        deadline: Instant,
        cancel: &Cancel,
    ) -> Result<Rescue<'a>, HcloudError> {
        let known_hosts = identity.known_hosts();
        loop {
            cancel.check()?;
            // A failed attempt may have recorded a key: each attempt starts
            // afresh, as a new session did.
            let _ = std::fs::remove_file(&known_hosts);
            let mut rescue = Rescue {
                program: PathBuf::from(SSH),
                identity,
                addr,
                user: user.to_owned(),
                host_key: String::new(),
            };
            let last = match rescue.exec(LOGIN, None::<std::io::Empty>, cancel, &mut |_| {}) {
                Ok((e, _)) if e.status == Some(0) => {
                    let text = std::fs::read_to_string(&known_hosts).unwrap_or_default();
                    rescue.host_key = known_host_fingerprint(&text).ok_or_else(|| {
                        HcloudError::Ssh(format!(
                            "logged in to {addr}, but ssh recorded no host key in {}",
                            known_hosts.display()
                        ))
                    })?;
                    return Ok(rescue);
                }
                Ok((e, _)) => format!("{LOGIN:?} exited with {:?}", e.status),
                Err(HcloudError::Ssh(m)) => m,
                Err(e) => return Err(e),
            };
            if Instant::now() + Duration::from_secs(1) >= deadline {
                return Err(HcloudError::Ssh(format!(
                    "could not log in to the rescue system at {addr}: {last}"
                )));
            }
            cancel.sleep(Duration::from_secs(1))?;
        }
    }

    /// Runs `command` with no input and collects its output.
    pub fn run(&self, command: &str) -> Result<Exec, HcloudError> {
        let (out, _) = self.exec(
            command,
            None::<std::io::Empty>,
            &Cancel::never(),
            &mut |_| {},
        )?;
        Ok(out)
    }

    /// `ssh … -- IP COMMAND` in a process group of its own (a Ctrl-C
    /// reaches imgbuild, which then ends it), reading no configuration.
    fn command(&self, command: &str) -> Command {
        let mut ssh = Command::new(&self.program);
        // Only what ssh needs of the environment: no agent (one that never
        // answers would hang the login past every deadline; the run's own
        // key is the only one used) and none of imgbuild's secrets
        // (HCLOUD_TOKEN and the like).
        ssh.env_clear();
        for keep in [
            "PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TMPDIR",
        ] {
            if let Some(v) = std::env::var_os(keep) {
                ssh.env(keep, v);
            }
        }
        ssh.args(["-F", "/dev/null", "-T"]);
        let options = [
            "BatchMode=yes".to_owned(),
            "IdentitiesOnly=yes".to_owned(),
            "IdentityAgent=none".to_owned(),
            format!("IdentityFile={}", self.identity.key_file().display()),
            format!(
                "UserKnownHostsFile={}",
                self.identity.known_hosts().display()
            ),
            "StrictHostKeyChecking=accept-new".to_owned(),
            "GlobalKnownHostsFile=/dev/null".to_owned(),
            // The one key the session saw is the one recorded and shown.
            "UpdateHostKeys=no".to_owned(),
            "ConnectTimeout=20".to_owned(),
            "ServerAliveInterval=15".to_owned(),
            "ServerAliveCountMax=8".to_owned(),
            "LogLevel=ERROR".to_owned(),
        ];
        for o in options {
            ssh.arg("-o").arg(o);
        }
        ssh.arg("-p")
            .arg(self.addr.port().to_string())
            .arg("-l")
            .arg(&self.user)
            .arg("--")
            .arg(self.addr.ip().to_string())
            .arg(command)
            .process_group(0);
        ssh
    }

    /// Runs `command` with `input` streamed on its stdin (read on a thread
    /// of its own in chunks: compressing is CPU work), telling `sent` of
    /// every chunk's size once `ssh` has taken it; `input` comes back once
    /// read (to ask it what it read). Output is kept up to 64 KiB per
    /// stream. When the command ends before the input does (a `dd` that
    /// cannot open the disk), `ssh` ends and the copy stops at once with
    /// the output so far; a command that stops reading without ending fails
    /// after [`STALL`]. A cancel is honoured within a fraction of a second;
    /// `ssh` is killed on every way out but its own end.
    pub fn exec<R: Read + Send + 'static>(
        &self,
        command: &str,
        input: Option<R>,
        cancel: &Cancel,
        sent: &mut dyn FnMut(usize),
    ) -> Result<(Exec, Option<R>), HcloudError> {
        let mut ssh = self.command(command);
        ssh.stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        let mut child = Reaped(spawn(&mut ssh)?);
        let stdout = keep(child.0.stdout.take());
        let stderr = keep(child.0.stderr.take());
        let (tell, told) = mpsc::channel();
        let feeder = match (input, child.0.stdin.take()) {
            (Some(input), Some(stdin)) => Some(feed(input, stdin, tell.clone())),
            _ => None,
        };
        let mut writing_since = None;
        let status = loop {
            cancel.check()?;
            let ended = child
                .0
                .try_wait()
                .map_err(|e| HcloudError::Ssh(format!("{command:?}: waiting for {SSH}: {e}")))?;
            if let Some(status) = ended {
                break status;
            }
            match told.recv_timeout(TICK) {
                Ok(Fed::Writing) => writing_since = Some(Instant::now()),
                Ok(Fed::Sent(n)) => {
                    writing_since = None;
                    sent(n);
                }
                Ok(Fed::ReadFailed(e)) => {
                    return Err(HcloudError::Io(format!("reading the image: {e}")));
                }
                Err(_) => {}
            }
            if writing_since.is_some_and(|t: Instant| t.elapsed() >= STALL) {
                return Err(HcloudError::Ssh(format!(
                    "{command:?}: the rescue system took no input for {STALL:?} and did not end"
                )));
            }
        };
        // ssh is gone: a write under way fails at once (its pipe is
        // closed), the reader stops after the chunk it reads.
        let returned = feeder.and_then(|f| f.join().ok());
        drop(tell);
        for fed in told.try_iter() {
            match fed {
                Fed::Sent(n) => sent(n),
                Fed::ReadFailed(e) => {
                    return Err(HcloudError::Io(format!("reading the image: {e}")));
                }
                Fed::Writing => {}
            }
        }
        let out = Exec {
            status: status.code().and_then(|c| u32::try_from(c).ok()),
            stdout: stdout.join().unwrap_or_default(),
            stderr: stderr.join().unwrap_or_default(),
        };
        match status.code() {
            // 255 is ssh's own failure (no connection, no login, a lost
            // session, or a command ended by a signal).
            Some(255) | None => Err(HcloudError::Ssh(format!(
                "{command:?}: {}",
                ssh_said(&out.stderr, status)
            ))),
            Some(_) => Ok((out, returned)),
        }
    }
}

/// The last lines ssh wrote, or its status when it wrote nothing.
fn ssh_said(stderr: &str, status: std::process::ExitStatus) -> String {
    let lines: Vec<&str> = stderr.trim().lines().rev().take(3).collect();
    if lines.is_empty() {
        format!("{SSH} ended with {status} and said nothing")
    } else {
        lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
    }
}

/// An `ssh` child killed and reaped when dropped before it ended (an
/// error, a cancel, a stall): no orphan keeps writing to the rescue disk.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
        }
        let _ = self.0.wait();
    }
}

/// What the thread feeding `ssh`'s stdin says.
enum Fed {
    /// A chunk is being written.
    Writing,
    /// A chunk of this many bytes was taken.
    Sent(usize),
    ReadFailed(std::io::Error),
}

/// Feeds `input` into `stdin` on a thread (with a reader thread of its own
/// ahead of it), closing `stdin` at the end so the command sees its end;
/// returns `input` once done. A write that fails means ssh is gone: the
/// thread then stops, and the caller learns why from ssh's end.
fn feed<R: Read + Send + 'static>(
    mut input: R,
    mut stdin: ChildStdin,
    tell: mpsc::Sender<Fed>,
) -> JoinHandle<R> {
    std::thread::spawn(move || {
        let (chunks, next) = mpsc::sync_channel(2);
        let reader = std::thread::spawn(move || {
            pump(&mut input, &chunks);
            input
        });
        for chunk in next.iter() {
            let data: Vec<u8> = match chunk {
                Ok(data) => data,
                Err(e) => {
                    let _ = tell.send(Fed::ReadFailed(e));
                    break;
                }
            };
            let _ = tell.send(Fed::Writing);
            if stdin.write_all(&data).is_err() {
                break;
            }
            let _ = tell.send(Fed::Sent(data.len()));
        }
        drop(stdin);
        drop(next);
        reader.join().expect("the image reader panicked")
    })
}

/// Keeps the first [`KEEP`] bytes of `out` (reading on to its end so ssh
/// never blocks on it), on a thread.
fn keep<R: Read + Send + 'static>(out: Option<R>) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut kept = Vec::new();
        if let Some(mut out) = out {
            let mut buf = [0u8; 8192];
            loop {
                match out.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        let room = KEEP.saturating_sub(kept.len());
                        kept.extend_from_slice(&buf[..n.min(room)]);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
        }
        String::from_utf8_lossy(&kept).into_owned()
    })
}

/// Reads `input` in [`crate::io::BUF_SIZE`] chunks into `chunks` until it
/// ends, fails, or the receiver is gone.
fn pump<R: Read>(input: &mut R, chunks: &mpsc::SyncSender<std::io::Result<Vec<u8>>>) {
    loop {
        let mut buf = vec![0u8; crate::io::BUF_SIZE];
        let mut filled = 0;
        while filled < buf.len() {
            match input.read(&mut buf[filled..]) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    let _ = chunks.send(Err(e));
                    return;
                }
            }
        }
        if filled == 0 {
            return;
        }
        buf.truncate(filled);
        if chunks.send(Ok(buf)).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    #[test]
    fn dd_statistics_give_the_byte_count() {
        let gnu = "0+1 records in\n0+1 records out\n1073741824 bytes (1.1 GB, 1.0 GiB) copied, 2.1 s, 511 MB/s\n";
        assert_eq!(dd_bytes(gnu), Some(1_073_741_824));
        let busybox =
            "2+0 records in\n2+0 records out\n8388608 bytes (8.0MB) copied, 0.01 seconds\n";
        assert_eq!(dd_bytes(busybox), Some(8_388_608));
        assert_eq!(dd_bytes("1 byte copied, 0.0001 s, 10 kB/s"), Some(1));
        assert_eq!(
            dd_bytes("dd: error writing '/dev/sda': No space left"),
            None
        );
        assert_eq!(dd_bytes(""), None);
    }

    #[test]
    fn discard_support() {
        assert!(discard_unsupported(
            "blkdiscard: /dev/sda: BLKDISCARD ioctl failed: Operation not supported"
        ));
        assert!(!discard_unsupported(
            "blkdiscard: cannot open /dev/sda: Permission denied"
        ));
    }

    #[test]
    fn commands_are_fixed_and_fail_loudly() {
        // pipefail: a failing zstd -d must fail the whole pipeline.
        assert!(WRITE.starts_with("set -euo pipefail;"));
        assert!(WRITE.contains("of=/dev/sda") && WRITE.contains("iflag=fullblock"));
        assert!(!WRITE.contains('$') && !DISCARD.contains('$'));
    }

    #[test]
    fn pump_delivers_every_byte_in_order() {
        let data: Vec<u8> = (0..(3 << 20) + 17).map(|i| (i % 251) as u8).collect();
        let (tx, rx) = mpsc::sync_channel(2);
        let src = data.clone();
        let t = std::thread::spawn(move || pump(&mut std::io::Cursor::new(src), &tx));
        let mut got = Vec::new();
        for chunk in rx.iter() {
            got.extend(chunk.unwrap());
        }
        t.join().unwrap();
        assert_eq!(got, data);
    }

    fn ssh_keygen(args: &[&str]) -> String {
        let o = Command::new("ssh-keygen")
            .args(args)
            .output()
            .expect("ssh-keygen (package openssh-client)");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap()
    }

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn the_run_key_is_a_private_openssh_key_file_that_goes_with_the_run() {
        let id = Identity::new().unwrap();
        let key = id.key_file();
        assert_eq!(mode(&id.dir), 0o700);
        assert_eq!(mode(&key), 0o600);
        // OpenSSH reads the file and derives the very public line the API gets.
        let derived = ssh_keygen(&["-y", "-f", key.to_str().unwrap()]);
        assert_eq!(derived.trim(), id.public_line());
        assert!(
            id.public_line()
                .starts_with("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI")
        );
        let other = Identity::new().unwrap();
        assert_ne!(other.public_line(), id.public_line(), "keys are random");
        let dir = id.dir.clone();
        drop(id);
        assert!(!dir.exists(), "the key outlived the run");
    }

    #[test]
    fn a_killed_runs_key_directory_goes_with_the_next_run_and_a_live_ones_stays() {
        let live = Identity::new().unwrap();
        // What a run killed by SIGKILL leaves: its directory and key file,
        // the lock gone with the process.
        let mut name = [0u8; 8];
        aws_lc_rs::rand::fill(&mut name).unwrap();
        let dead = live
            .dir
            .with_file_name(format!("{DIR_PREFIX}{}", hex::encode(name)));
        std::fs::create_dir(&dead).unwrap();
        std::fs::write(dead.join(KEY_FILE), "a dead run's key").unwrap();
        let next = Identity::new().unwrap();
        assert!(!dead.exists(), "a dead run's key stayed");
        assert!(live.key_file().exists(), "a live run's key was removed");
        assert!(next.key_file().exists());
    }

    #[test]
    fn the_host_key_fingerprint_is_the_one_ssh_keygen_shows() {
        let id = Identity::new().unwrap();
        let line = format!("[127.4.0.2]:2222 {}\n", id.public_line());
        std::fs::write(id.known_hosts(), &line).unwrap();
        let shown = ssh_keygen(&[
            "-l",
            "-E",
            "sha256",
            "-f",
            id.known_hosts().to_str().unwrap(),
        ]);
        let expected = shown.split_whitespace().nth(1).unwrap();
        assert!(expected.starts_with("SHA256:"), "{shown}");
        assert_eq!(known_host_fingerprint(&line).as_deref(), Some(expected));
        let marked = format!("# comment\n\n@cert-authority {line}");
        assert_eq!(known_host_fingerprint(&marked).as_deref(), Some(expected));
        assert_eq!(known_host_fingerprint("host ssh-ed25519 !!!"), None);
        assert_eq!(known_host_fingerprint(""), None);
    }

    /// A rescue session whose `ssh` is the shell script `body`.
    fn fake<'a>(id: &'a Identity, body: &str) -> Rescue<'a> {
        let program = id.dir.join("fake-ssh");
        std::fs::write(&program, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();
        Rescue {
            program,
            identity: id,
            addr: "127.4.0.2:2222".parse().unwrap(),
            user: "root".into(),
            host_key: String::new(),
        }
    }

    #[test]
    fn the_command_is_one_argument_after_the_destination_and_no_config_is_read() {
        let id = Identity::new().unwrap();
        let r = fake(&id, r#"for a in "$@"; do printf '%s\n' "$a"; done"#);
        let out = r.run(WRITE).unwrap();
        let args: Vec<&str> = out.stdout.lines().collect();
        let n = args.len();
        assert_eq!(args[n - 3..], ["--", "127.4.0.2", WRITE], "{args:?}");
        assert_eq!(args[..3], ["-F", "/dev/null", "-T"], "{args:?}");
        for o in [
            "BatchMode=yes",
            "IdentitiesOnly=yes",
            &format!("IdentityFile={}", id.key_file().display()),
            &format!("UserKnownHostsFile={}", id.known_hosts().display()),
            "StrictHostKeyChecking=accept-new",
            "GlobalKnownHostsFile=/dev/null",
        ] {
            let at = args.iter().position(|a| *a == o);
            assert!(at.is_some_and(|i| args[i - 1] == "-o"), "{o}: {args:?}");
        }
        let port = args.iter().position(|a| *a == "-p").unwrap();
        assert_eq!(args[port + 1], "2222");
        let user = args.iter().position(|a| *a == "-l").unwrap();
        assert_eq!(args[user + 1], "root");
    }

    /// An agent that never answers, or a token in imgbuild's environment,
    /// never reaches ssh.
    #[test]
    fn ssh_gets_no_agent_and_none_of_imgbuilds_environment() {
        let id = Identity::new().unwrap();
        // `env -0`: what the child got, names only (the shell adds PWD,
        // SHLVL and `_` itself).
        let out = fake(&id, "env -0 | tr '\\0' '\\n' | cut -d= -f1")
            .run("true")
            .unwrap();
        let allowed = [
            "PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TMPDIR", "PWD", "SHLVL", "_",
        ];
        let names: Vec<&str> = out.stdout.lines().filter(|l| !l.is_empty()).collect();
        assert!(names.contains(&"PATH"), "{names:?}");
        assert!(
            names.iter().all(|n| allowed.contains(n)),
            "ssh got more of the environment: {names:?}"
        );
        let args = fake(&id, r#"for a in "$@"; do printf '%s\n' "$a"; done"#)
            .run("true")
            .unwrap()
            .stdout;
        assert!(args.lines().any(|a| a == "IdentityAgent=none"), "{args}");
    }

    #[test]
    fn stdin_reaches_the_command_and_every_chunk_is_counted() {
        let id = Identity::new().unwrap();
        let r = fake(&id, "wc -c; echo 'to stderr' >&2; exit 3");
        let data = vec![7u8; (5 << 20) + 3];
        let mut counted = 0;
        let (out, back) = r
            .exec(
                "x",
                Some(std::io::Cursor::new(data)),
                &Cancel::never(),
                &mut |n| counted += n,
            )
            .unwrap();
        assert_eq!(out.stdout.trim(), ((5 << 20) + 3).to_string());
        assert_eq!(out.stderr, "to stderr\n");
        assert_eq!(out.status, Some(3));
        assert_eq!(counted, (5 << 20) + 3);
        assert_eq!(back.unwrap().position(), (5 << 20) + 3);
    }

    #[test]
    fn a_command_that_ends_without_reading_ends_the_copy() {
        let id = Identity::new().unwrap();
        let r = fake(&id, "echo 'dd: failed to open' >&2; exit 1");
        // Endless input: only the command's end can stop the copy.
        let (out, back) = r
            .exec("x", Some(std::io::repeat(0)), &Cancel::never(), &mut |_| {})
            .unwrap();
        assert_eq!(out.status, Some(1));
        assert_eq!(out.stderr.trim(), "dd: failed to open");
        assert!(back.is_some(), "the input comes back");
    }

    #[test]
    fn ssh_failures_and_a_missing_ssh_are_errors_of_their_own() {
        let id = Identity::new().unwrap();
        let r = fake(
            &id,
            "echo 'ssh: connect to host 127.4.0.2 port 2222: Connection refused' >&2; exit 255",
        );
        let e = r.run(LOGIN).unwrap_err();
        assert!(
            matches!(&e, HcloudError::Ssh(m) if m.ends_with("Connection refused")),
            "{e:?}"
        );
        let mut r = fake(&id, "exit 0");
        r.program = id.dir.join("no-such-ssh");
        let e = r.run(LOGIN).unwrap_err();
        assert!(matches!(e, HcloudError::SshMissing), "{e:?}");
        assert!(e.to_string().contains("openssh-client"), "{e}");
        let e = check_program(&id.dir.join("no-such-ssh")).unwrap_err();
        assert!(matches!(e, HcloudError::SshMissing), "{e:?}");
        check_program(&r.identity.dir.join("fake-ssh")).unwrap();
    }

    #[test]
    fn a_cancel_kills_ssh_and_leaves_no_process() {
        static FLAG: AtomicBool = AtomicBool::new(false);
        let id = Identity::new().unwrap();
        let pid_file = id.dir.join("pid");
        let r = fake(
            &id,
            &format!("echo $$ > '{}'; exec sleep 600", pid_file.display()),
        );
        let setter = std::thread::spawn(move || {
            while !pid_file.exists() {
                std::thread::sleep(Duration::from_millis(20));
            }
            FLAG.store(true, Ordering::SeqCst);
            pid_file
        });
        let e = r
            .exec(
                "x",
                Some(std::io::repeat(0)),
                &Cancel::on(&FLAG),
                &mut |_| {},
            )
            .unwrap_err();
        assert!(matches!(e, HcloudError::Interrupted), "{e:?}");
        let pid_file = setter.join().unwrap();
        let pid: i32 = std::fs::read_to_string(pid_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        // SAFETY: signal 0 only asks whether the process exists.
        let alive = unsafe { libc::kill(pid, 0) } == 0;
        assert!(!alive, "ssh (pid {pid}) outlived the cancel");
    }
}
