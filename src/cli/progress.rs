//! Progress on stderr, chosen once per command: bars on a terminal, one
//! line per step (and a start and an end line per transfer) in logs, and
//! nothing with `--quiet`. The library only reports typed events; this is
//! where they are drawn.

use super::output::Output;
use clap::ValueEnum;
use imgbuild::publish::{hcloud, proxmox};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::collections::HashMap;
use std::io::IsTerminal;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// `--color`: whether bars, the board and message prefixes get colors.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ColorChoice {
    /// When stderr is a terminal and NO_COLOR is not set.
    Auto,
    Always,
    Never,
}

/// The display settings of this process, from the global flags.
struct Settings {
    color: bool,
    heartbeat: Duration,
}

static SETTINGS: OnceLock<Settings> = OnceLock::new();

/// Fixes the display settings once, before any command runs. `NO_COLOR`
/// (any non-empty value, as no-color.org says) turns `auto` off.
pub fn init(choice: ColorChoice, heartbeat: Duration) {
    let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
    let color = match choice {
        ColorChoice::Always => true,
        ColorChoice::Never => false,
        ColorChoice::Auto => !no_color && std::io::stderr().is_terminal(),
    };
    let _ = SETTINGS.set(Settings { color, heartbeat });
}

fn settings() -> &'static Settings {
    SETTINGS.get_or_init(|| Settings {
        color: false,
        heartbeat: Duration::from_secs(30),
    })
}

/// How long a wait may go on in a log without a line saying so.
pub fn heartbeat() -> Duration {
    settings().heartbeat
}

/// `text` in the SGR color `sgr` (e.g. "31" red) when colors are on.
pub fn paint(text: &str, sgr: &str) -> String {
    if settings().color {
        format!("\x1b[{sgr}m{text}\x1b[0m")
    } else {
        text.to_owned()
    }
}

/// How progress shows on stderr.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Show {
    /// Bars and boards redrawn in place (stderr is a terminal).
    Draw,
    /// Plain lines, no escape sequence (logs, CI).
    Lines,
    /// Nothing (`--quiet`, or `--output json` where progress is not kept).
    Nothing,
}

impl Show {
    /// Bars on a terminal, lines elsewhere; nothing when quiet or when the
    /// command's result is JSON.
    pub fn for_output(quiet: bool, output: Output) -> Show {
        if quiet || output == Output::Json {
            Show::Nothing
        } else {
            Show::lines_or_draw()
        }
    }

    /// Lines even for JSON results, but never drawn there: a log a CI job
    /// keeps beside the JSON document (bootstrap's event log).
    pub fn log_for(quiet: bool, output: Output) -> Show {
        match (quiet, output) {
            (true, _) => Show::Nothing,
            (false, Output::Json) => Show::Lines,
            (false, Output::Text) => Show::lines_or_draw(),
        }
    }

    fn lines_or_draw() -> Show {
        if redraws() { Show::Draw } else { Show::Lines }
    }
}

/// Whether stderr shows progress redrawn in place: on a terminal, unless
/// `--debug` writes its request log there (a log between redraws would be
/// torn apart).
pub fn redraws() -> bool {
    std::io::stderr().is_terminal() && !super::output::debugging()
}

/// stderr for one command: its bars when drawing, lines above them.
#[derive(Clone)]
pub struct Screen {
    multi: Option<MultiProgress>,
}

impl Screen {
    pub fn new(show: Show) -> Screen {
        Screen {
            multi: (show == Show::Draw)
                .then(|| MultiProgress::with_draw_target(ProgressDrawTarget::stderr())),
        }
    }

    pub fn drawing(&self) -> bool {
        self.multi.is_some()
    }

    /// One line on stderr, above the bars when there are some, through
    /// the one writer (escaped, redacted; a closed stderr loses it).
    pub fn line(&self, text: &str) {
        let write = || errln!("{text}");
        match &self.multi {
            Some(m) => m.suspend(write),
            None => write(),
        }
    }

    /// Takes every line and bar off the screen at once, for good: what is
    /// printed next (the summary) takes their place.
    pub fn close(&self) {
        if let Some(m) = &self.multi {
            let _ = m.clear();
            m.set_draw_target(ProgressDrawTarget::hidden());
        }
    }

    /// Adds a bar below the others (hidden when not drawing).
    pub fn add(&self, bar: ProgressBar) -> ProgressBar {
        match &self.multi {
            Some(m) => m.add(bar),
            None => {
                bar.set_draw_target(ProgressDrawTarget::hidden());
                bar
            }
        }
    }
}

/// The style of every transfer bar, downloads and uploads alike: label,
/// bar, bytes done out of the total, rate, time left.
pub fn transfer_style() -> ProgressStyle {
    let bar = if settings().color {
        "{bar:20.cyan/blue}"
    } else {
        "{bar:20}"
    };
    ProgressStyle::with_template(&format!(
        "{{msg:30!}} {bar} {{bytes:>10}}/{{total_bytes:10}} {{bytes_per_sec:>12}} eta {{eta}}"
    ))
    .expect("valid template")
    .progress_chars("=> ")
}

/// `bytes` over `secs` as the log lines say it.
pub fn rate(bytes: u64, secs: f64) -> String {
    format!("{:.1} MB/s", bytes as f64 / secs.max(0.001) / 1e6)
}

/// One transfer under way: its bar when drawing, and what the end line
/// needs.
struct Transfer {
    bar: ProgressBar,
    started: Instant,
    bytes: u64,
    /// When the count last grew: the transfer's end, not the server's
    /// checks after it.
    moved: Instant,
}

/// Publish progress for both targets: a bar per transfer on a terminal,
/// else one line when a transfer starts and one when it ends; each other
/// step as a line.
pub struct PublishView {
    screen: Screen,
    show: Show,
    transfers: Mutex<HashMap<String, Transfer>>,
}

/// The key of the one Hetzner stream at a time.
const HCLOUD: &str = "hcloud";

impl PublishView {
    pub fn new(screen: Screen, show: Show) -> PublishView {
        PublishView {
            screen,
            show,
            transfers: Mutex::default(),
        }
    }

    fn step(&self, text: &str) {
        if self.show != Show::Nothing {
            self.screen.line(text);
        }
    }

    /// Starts a transfer; prints its start line unless a bar shows it.
    fn begin(&self, key: &str, label: &str, size: u64, start_line: String) {
        if self.show == Show::Nothing {
            return;
        }
        let bar = self.screen.add(ProgressBar::new(size));
        bar.set_style(transfer_style());
        bar.set_message(label.to_owned());
        let now = Instant::now();
        let old = self.transfers.lock().unwrap().insert(
            key.to_owned(),
            Transfer {
                bar,
                started: now,
                bytes: 0,
                moved: now,
            },
        );
        if let Some(old) = old {
            old.bar.finish_and_clear();
        }
        if !self.screen.drawing() {
            self.step(&start_line);
        }
    }

    fn advance(&self, key: &str, label: Option<String>, bytes: u64) {
        if let Some(t) = self.transfers.lock().unwrap().get_mut(key) {
            if bytes != t.bytes {
                t.moved = Instant::now();
            }
            t.bytes = bytes;
            t.bar.set_position(bytes);
            if let Some(label) = label {
                t.bar.set_message(label);
            }
        }
    }

    /// Ends a transfer: its bar goes; the bytes and seconds it took.
    fn end(&self, key: &str) -> Option<(u64, f64)> {
        let t = self.transfers.lock().unwrap().remove(key)?;
        t.bar.finish_and_clear();
        let secs = t.moved.duration_since(t.started).as_secs_f64();
        Some((t.bytes, secs))
    }

    /// Removes every bar still shown (a run that stopped midway).
    pub fn clear(&self) {
        for (_, t) in self.transfers.lock().unwrap().drain() {
            t.bar.finish_and_clear();
        }
    }
}

impl Drop for PublishView {
    fn drop(&mut self) {
        self.clear();
    }
}

impl proxmox::Observer for PublishView {
    fn event(&self, node: &str, e: &proxmox::Event) {
        use proxmox::Event;
        match e {
            Event::Uploading { volid, size } => self.begin(
                node,
                node,
                *size,
                format!("{node}: uploading {volid} ({size} bytes)"),
            ),
            Event::Uploaded { volid } => {
                let (bytes, secs) = self.end(node).unwrap_or_default();
                self.step(&format!(
                    "{node}: stored {volid}: {bytes} bytes sent in {secs:.1}s ({})",
                    rate(bytes, secs)
                ));
            }
            Event::UploadRetry { .. } => {
                self.end(node);
                self.step(&format!("{node}: {}", proxmox_step(e)));
            }
            _ => self.step(&format!("{node}: {}", proxmox_step(e))),
        }
    }

    fn sent(&self, node: &str, bytes: u64) {
        self.advance(node, None, bytes);
    }
}

impl hcloud::Observer for PublishView {
    fn event(&self, e: &hcloud::Event) {
        use hcloud::Event;
        match e {
            Event::Writing { size } => self.begin(
                HCLOUD,
                "hcloud → rescue /dev/sda",
                *size,
                format!("hcloud: writing {size} bytes to /dev/sda (zstd on the wire)"),
            ),
            Event::Written { bytes, sent } => {
                let (_, secs) = self.end(HCLOUD).unwrap_or_default();
                self.step(&format!(
                    "hcloud: dd wrote {bytes} bytes in {secs:.1}s ({}; {sent} bytes sent)",
                    rate(*bytes, secs)
                ));
            }
            _ => self.step(&format!("hcloud: {}", hcloud_step(e))),
        }
    }

    fn sent(&self, nodes: &[String], image_bytes: u64, _wire_bytes: u64) {
        self.advance(HCLOUD, Some(nodes.join(",")), image_bytes);
    }
}

/// One step of a node's publish as a log line (without the node).
fn proxmox_step(e: &proxmox::Event) -> String {
    use proxmox::Event;
    match e {
        Event::Uploading { volid, size } => format!("uploading {volid} ({size} bytes)"),
        Event::UploadRetry { attempt, why } => format!("upload retry {attempt}: {why}"),
        Event::Uploaded { volid } => format!("stored {volid}"),
        Event::AlreadyStored { volid } => format!("{volid} already stored"),
        Event::Downloading { volid, url } => format!("Proxmox fetching {volid} from {url}"),
        Event::Downloaded { volid } => format!("stored {volid} (fetched by Proxmox, 0 bytes sent)"),
        Event::VmFound {
            vmid,
            inventory_vmid,
        } => format!(
            "its VM is {vmid}, not {inventory_vmid} (firstId + position): kept; pin `vmid: {vmid}` on the node"
        ),
        Event::VmCreated { vmid } => format!("VM {vmid} created"),
        Event::VmUnchanged { vmid } => format!("VM {vmid} already boots this image"),
        Event::VmKeepsDisk { vmid, running } => format!(
            "VM {vmid} keeps its disk (installed from {running}; `imgbuild upgrade` moves the node; --replace-disk reinstalls it from this image)"
        ),
        Event::VmSetting { vmid, change } => format!("VM {vmid}: {change}"),
        Event::VmRebooted { vmid } => format!("VM {vmid} rebooted for its new settings"),
        Event::DiskReplaced { vmid } => format!("VM {vmid} got the new disk"),
        Event::VmStarted { vmid } => format!("VM {vmid} started"),
    }
}

/// One step of a snapshot run as a log line.
fn hcloud_step(e: &hcloud::Event) -> String {
    use hcloud::Event;
    match e {
        Event::Found { id } => format!("snapshot {id} already holds this image"),
        Event::TooLarge {
            id,
            disk_size,
            server_type,
            disk,
        } => format!(
            "snapshot {id} holds this image on a {disk_size} GB disk, larger than {server_type}'s {disk} GB: servers of that type could not boot it, so one that fits is made"
        ),
        Event::KeyCreated { id } => format!("temporary SSH key {id} created"),
        Event::TypeSkipped { server_type, why } => {
            format!("server type {server_type} skipped: {why}")
        }
        Event::ServerCreated { id, server_type } => {
            format!("temporary server {id} ({server_type}) created")
        }
        Event::RescueBooting { id } => format!("server {id} boots its rescue system"),
        Event::Connected { addr, host_key } => format!(
            "logged in to the rescue system at {addr}; its host key {host_key} is new on every rescue boot and was accepted for this session only"
        ),
        Event::Discarded { supported } => {
            if *supported {
                "disk discarded".to_owned()
            } else {
                "disk cannot discard; dd overwrites it".to_owned()
            }
        }
        Event::Writing { size } => {
            format!("writing {size} bytes to /dev/sda (zstd on the wire)")
        }
        Event::Written { bytes, sent } => format!("dd wrote {bytes} bytes ({sent} bytes sent)"),
        Event::PoweredOff => "server off".to_owned(),
        Event::Snapshotting => "creating the snapshot".to_owned(),
        Event::SnapshotReady { id } => format!("snapshot {id} available"),
        Event::Deleted { kind, id } => format!("deleted {} {id}", kind.replace('_', " ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_read_as_megabytes_per_second() {
        assert_eq!(rate(1_300_000_000, 2.0), "650.0 MB/s");
        assert_eq!(rate(0, 0.0), "0.0 MB/s");
    }

    /// Off a terminal a transfer has exactly a start and an end; bars are
    /// hidden and the count follows what was reported as sent.
    #[test]
    fn a_transfer_off_a_terminal_is_counted_without_a_bar() {
        let view = PublishView::new(Screen::new(Show::Lines), Show::Lines);
        view.begin("cp-01", "cp-01", 100, String::new());
        view.advance("cp-01", None, 40);
        view.advance("cp-01", None, 100);
        {
            let all = view.transfers.lock().unwrap();
            assert!(all["cp-01"].bar.is_hidden());
            assert_eq!(all["cp-01"].bar.position(), 100);
        }
        let (bytes, _) = view.end("cp-01").unwrap();
        assert_eq!(bytes, 100);
        assert!(view.end("cp-01").is_none());
    }
}
