//! The rescue system over SSH: log in as root with the run's temporary key,
//! check where we are, and stream the image into `dd`. The commands are
//! fixed strings: nothing from a URL, a label or the API reaches the remote
//! shell. Facts: apricote/hcloud-upload-image `hcloudimages/client.go`
//! writes the disk the same way.

use std::io::Read;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use russh::keys::{HashAlg, PrivateKey, PrivateKeyWithHashAlg, PublicKeyOrCertificate};
use russh::{ChannelMsg, client};

use super::error::HcloudError;
use crate::publish::Cancel;

/// Empties the disk first so the snapshot holds only what the image writes
/// (a thin snapshot is faster to make and to boot from).
pub const DISCARD: &str = "blkdiscard --force /dev/sda";

/// The one command that writes the disk: zstd-compressed image on stdin.
pub const WRITE: &str =
    "set -euo pipefail; zstd -d | dd of=/dev/sda bs=4M conv=sparse iflag=fullblock; sync";

/// How often a wait looks at the cancel flag.
const TICK: Duration = Duration::from_millis(200);

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

/// Records the host key the rescue system shows. It is new on every rescue
/// boot, so there is nothing to check it against: it is accepted for this
/// one session, and its fingerprint reported.
struct Handler {
    seen: Arc<Mutex<Option<String>>>,
}

impl client::Handler for Handler {
    type Error = russh::Error;

    async fn check_server_key(
        &mut self,
        key: &PublicKeyOrCertificate,
    ) -> Result<bool, Self::Error> {
        let fingerprint = match key {
            PublicKeyOrCertificate::PublicKey { key, .. } => key.fingerprint(HashAlg::Sha256),
            PublicKeyOrCertificate::Certificate(c) => c.public_key().fingerprint(HashAlg::Sha256),
        };
        *self.seen.lock().unwrap() = Some(fingerprint.to_string());
        Ok(true)
    }
}

/// A logged-in session with the rescue system.
pub struct Rescue {
    handle: client::Handle<Handler>,
    /// `SHA256:…` of the host key accepted for this session.
    pub host_key: String,
}

impl Rescue {
    /// Logs in as `user` (root on Hetzner) at `addr`, trying again until
    /// `deadline`: the rescue system boots for about a minute and refuses
    /// connections meanwhile.
    pub async fn connect(
        addr: SocketAddr,
        user: &str,
        key: Arc<PrivateKey>,
        deadline: Instant,
        cancel: &Cancel,
    ) -> Result<Rescue, HcloudError> {
        let config = Arc::new(client::Config {
            inactivity_timeout: Some(Duration::from_secs(120)),
            keepalive_interval: Some(Duration::from_secs(15)),
            ..client::Config::default()
        });
        loop {
            cancel.check()?;
            let seen = Arc::new(Mutex::new(None));
            let attempt = async {
                let mut handle = tokio::time::timeout(
                    Duration::from_secs(20),
                    client::connect(config.clone(), addr, Handler { seen: seen.clone() }),
                )
                .await
                .map_err(|_| "no SSH greeting within 20 s".to_owned())?
                .map_err(|e| e.to_string())?;
                let auth = handle
                    .authenticate_publickey(user, PrivateKeyWithHashAlg::new(key.clone(), None))
                    .await
                    .map_err(|e| e.to_string())?;
                if !auth.success() {
                    return Err(format!(
                        "the rescue system refused the run's key for {user}"
                    ));
                }
                Ok(handle)
            };
            let last = match attempt.await {
                Ok(handle) => {
                    let host_key = seen.lock().unwrap().clone().unwrap_or_default();
                    return Ok(Rescue { handle, host_key });
                }
                Err(e) => e,
            };
            if Instant::now() + Duration::from_secs(1) >= deadline {
                return Err(HcloudError::Ssh(format!(
                    "could not log in to the rescue system at {addr}: {last}"
                )));
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    /// Runs `command` with no input and collects its output.
    pub async fn run(&self, command: &str) -> Result<Exec, HcloudError> {
        let (out, _) = self
            .exec(
                command,
                None::<std::io::Empty>,
                &Cancel::never(),
                &mut |_| {},
            )
            .await?;
        Ok(out)
    }

    /// Runs `command` with `input` streamed on its stdin (read on a thread
    /// of its own in chunks: compressing is CPU work), telling `sent` of
    /// every chunk's size once the channel has taken it; `input` comes
    /// back once read (to ask it what it read). Output is kept up to 64 KiB
    /// per stream. The channel is watched while sending: when the command
    /// exits or the channel closes before the input ends (a `dd` that
    /// cannot open the disk), the copy stops at once and the output so far
    /// is returned; a command that stops reading without ending fails after
    /// [`STALL`]. A cancel is honoured within a fraction of a second.
    pub async fn exec<R: Read + Send + 'static>(
        &self,
        command: &str,
        input: Option<R>,
        cancel: &Cancel,
        sent: &mut dyn FnMut(usize),
    ) -> Result<(Exec, Option<R>), HcloudError> {
        let ssh = |e: russh::Error| HcloudError::Ssh(format!("{command:?}: {e}"));
        let channel = self.handle.channel_open_session().await.map_err(ssh)?;
        channel.exec(true, command).await.map_err(ssh)?;
        let (mut rx, tx) = channel.split();
        let mut out = Exec {
            status: None,
            stdout: String::new(),
            stderr: String::new(),
        };
        let mut returned = None;
        let mut ended = false;
        if let Some(mut input) = input {
            let (chunks, mut next) = tokio::sync::mpsc::channel::<std::io::Result<Vec<u8>>>(2);
            let reader = std::thread::spawn(move || {
                pump(&mut input, &chunks);
                input
            });
            'copy: loop {
                let chunk = tokio::select! {
                    chunk = next.recv() => chunk,
                    msg = rx.wait() => {
                        if record(&mut out, msg) {
                            ended = true;
                            break 'copy;
                        }
                        continue;
                    }
                    () = tokio::time::sleep(TICK) => {
                        cancel.check()?;
                        continue;
                    }
                };
                let data = match chunk {
                    Some(Ok(data)) => data,
                    Some(Err(e)) => {
                        return Err(HcloudError::Io(format!("reading the image: {e}")));
                    }
                    None => {
                        tx.eof().await.map_err(ssh)?;
                        break;
                    }
                };
                cancel.check()?;
                let n = data.len();
                let send = tx.data_bytes(data);
                tokio::pin!(send);
                let stalled = tokio::time::Instant::now() + STALL;
                loop {
                    tokio::select! {
                        r = &mut send => {
                            r.map_err(ssh)?;
                            sent(n);
                            break;
                        }
                        msg = rx.wait() => if record(&mut out, msg) {
                            ended = true;
                            break 'copy;
                        },
                        () = tokio::time::sleep(TICK) => {
                            cancel.check()?;
                            if tokio::time::Instant::now() >= stalled {
                                return Err(HcloudError::Ssh(format!(
                                    "{command:?}: the rescue system took no input for {STALL:?} and did not end"
                                )));
                            }
                        }
                    }
                }
            }
            drop(next);
            returned = reader.join().ok();
        }
        drop(tx);
        if ended {
            // The command is gone: what it still says (its stderr, the
            // close) comes at once or not at all.
            let rest = async {
                while let Some(m) = rx.wait().await {
                    if matches!(m, ChannelMsg::Close) {
                        break;
                    }
                    record(&mut out, Some(m));
                }
            };
            let _ = tokio::time::timeout(Duration::from_secs(2), rest).await;
            return Ok((out, returned));
        }
        loop {
            tokio::select! {
                msg = rx.wait() => if matches!(msg, None | Some(ChannelMsg::Close)) {
                    break;
                } else {
                    record(&mut out, msg);
                },
                () = tokio::time::sleep(TICK) => cancel.check()?,
            }
        }
        Ok((out, returned))
    }

    /// Says goodbye; the rescue system is about to be switched off anyway.
    pub async fn close(self) {
        let _ = self
            .handle
            .disconnect(russh::Disconnect::ByApplication, "", "en")
            .await;
    }
}

/// Notes what the channel said; true when it says the command is over
/// (its exit status or signal, the channel's close, or the session's end).
fn record(out: &mut Exec, m: Option<ChannelMsg>) -> bool {
    let keep = |buf: &mut String, data: &[u8]| {
        if buf.len() < KEEP {
            buf.push_str(&String::from_utf8_lossy(data));
        }
    };
    match m {
        Some(ChannelMsg::Data { data }) => keep(&mut out.stdout, &data),
        Some(ChannelMsg::ExtendedData { data, ext: 1 }) => keep(&mut out.stderr, &data),
        Some(ChannelMsg::ExitStatus { exit_status }) => {
            out.status = Some(exit_status);
            return true;
        }
        Some(ChannelMsg::ExitSignal { .. } | ChannelMsg::Close) | None => return true,
        Some(_) => {}
    }
    false
}

/// Reads `input` in [`crate::io::BUF_SIZE`] chunks into `chunks` until it
/// ends, fails, or the receiver is gone.
fn pump<R: Read>(input: &mut R, chunks: &tokio::sync::mpsc::Sender<std::io::Result<Vec<u8>>>) {
    loop {
        let mut buf = vec![0u8; crate::io::BUF_SIZE];
        let mut filled = 0;
        while filled < buf.len() {
            match input.read(&mut buf[filled..]) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    let _ = chunks.blocking_send(Err(e));
                    return;
                }
            }
        }
        if filled == 0 {
            return;
        }
        buf.truncate(filled);
        if chunks.blocking_send(Ok(buf)).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
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
        let (tx, mut rx) = tokio::sync::mpsc::channel(2);
        let src = data.clone();
        let t = std::thread::spawn(move || pump(&mut std::io::Cursor::new(src), &tx));
        let mut got = Vec::new();
        while let Some(chunk) = rx.blocking_recv() {
            got.extend(chunk.unwrap());
        }
        t.join().unwrap();
        assert_eq!(got, data);
    }
}
