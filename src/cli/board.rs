//! Where each node stands during `bootstrap` and `up`. On a terminal, one
//! line per node redrawn in place (its state and the seconds in it) and a
//! cluster line (pending health checks: how many, the oldest); the board
//! goes when the run ends, for the summary. In logs, the event lines as
//! they always were, plus a line while a wait goes on without one.

use super::progress::{PublishView, Screen, Show, paint};
use imgbuild::publish::{hcloud, proxmox};
use imgbuild::talos::bootstrap::{self, Event};
use indicatif::{ProgressBar, ProgressStyle};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The name bootstrap events carry for the cluster as a whole.
const CLUSTER: &str = "cluster";

/// How long one log line may grow with what a node said.
const LOG_LINE_CHARS: usize = 2000;

/// How often the board's seconds move and the log checks its waits.
const TICK: Duration = Duration::from_millis(250);

/// How a state reads on the board.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Tone {
    /// Nothing to wait for.
    Plain,
    /// Waiting on the node or the cluster: the log says so when it is long.
    Waiting,
    Good,
}

/// One node's line.
struct Row {
    name: String,
    state: String,
    tone: Tone,
    since: Instant,
    bar: Option<ProgressBar>,
}

impl Row {
    fn new(name: &str, now: Instant) -> Row {
        Row {
            name: name.to_owned(),
            state: "pending".to_owned(),
            tone: Tone::Plain,
            since: now,
            bar: None,
        }
    }

    fn set(&mut self, state: String, tone: Tone, now: Instant) {
        if state != self.state {
            self.since = now;
        }
        self.state = state;
        self.tone = tone;
    }
}

/// What the cluster line shows: each pending check since it was first
/// seen, or the cluster's last word.
struct Cluster {
    pending: Vec<(String, Instant)>,
    row: Row,
}

struct State {
    rows: Vec<Row>,
    cluster: Cluster,
    /// When the log last got a line (heartbeats come after silences).
    last_line: Instant,
    /// Whether an event came: until then the board stays off the screen
    /// (`up` shows download bars first).
    started: bool,
}

impl State {
    /// The first event: the board's clocks start now, not when the build
    /// before it did.
    fn start(&mut self, now: Instant) {
        if !self.started {
            self.started = true;
            for row in self.rows.iter_mut().chain([&mut self.cluster.row]) {
                row.since = now;
            }
        }
    }
}

struct Inner {
    show: Show,
    screen: Screen,
    start: Instant,
    state: Mutex<State>,
    stop: AtomicBool,
}

/// The per-node board (or log) of one run.
pub struct Board {
    inner: Arc<Inner>,
    ticker: Mutex<Option<JoinHandle<()>>>,
    publish: PublishView,
}

impl Board {
    /// A board for `nodes` (in inventory order) shown as `show`; publish
    /// steps and transfers go to `publish_show` (on the same screen).
    pub fn new(nodes: &[String], show: Show, publish_show: Show) -> Board {
        let screen = Screen::new(if show == Show::Draw || publish_show == Show::Draw {
            Show::Draw
        } else {
            Show::Lines
        });
        let now = Instant::now();
        let inner = Arc::new(Inner {
            show,
            screen: screen.clone(),
            start: now,
            state: Mutex::new(State {
                rows: nodes.iter().map(|n| Row::new(n, now)).collect(),
                cluster: Cluster {
                    pending: Vec::new(),
                    row: Row::new(CLUSTER, now),
                },
                last_line: now,
                started: false,
            }),
            stop: AtomicBool::new(false),
        });
        let ticker = (show != Show::Nothing).then(|| {
            let inner = inner.clone();
            std::thread::spawn(move || {
                while !inner.stop.load(Ordering::Relaxed) {
                    std::thread::park_timeout(TICK);
                    inner.tick();
                }
            })
        });
        Board {
            inner,
            ticker: Mutex::new(ticker),
            publish: PublishView::new(screen, publish_show),
        }
    }

    /// Ends the board: the ticker stops and every line and bar goes, so
    /// the summary takes its place.
    pub fn finish(&self) {
        self.inner.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.ticker.lock().unwrap().take() {
            t.thread().unpark();
            let _ = t.join();
        }
        let mut st = self.inner.state.lock().unwrap();
        if self.inner.show == Show::Draw && st.started {
            // The last states (Ready), drawn once past the rate limit.
            self.inner.draw(&mut st);
        }
        let State { rows, cluster, .. } = &mut *st;
        for row in rows.iter_mut().chain([&mut cluster.row]) {
            if let Some(bar) = row.bar.take() {
                bar.finish();
            }
        }
        st.started = false; // a second finish (on drop) draws nothing
        self.inner.screen.close();
        self.publish.clear();
    }
}

impl Drop for Board {
    fn drop(&mut self) {
        self.finish();
    }
}

/// A node's state on the board, short, and how it reads.
fn node_state(e: &Event) -> Option<(String, Tone)> {
    use Tone::*;
    Some(match e {
        Event::WaitingForPort => (
            format!("waiting for port {}", imgbuild::talos::client::PORT),
            Waiting,
        ),
        Event::PortOpen => ("probing TLS".into(), Plain),
        Event::Maintenance { .. } => ("maintenance".into(), Plain),
        Event::Applying => ("applying".into(), Plain),
        Event::Applied { .. } => ("applied".into(), Plain),
        Event::PortClosed => ("rebooting".into(), Waiting),
        Event::StillInMaintenance => ("maintenance, waiting".into(), Waiting),
        Event::Configured { version } => (
            format!("configured (Talos {})", super::output::outside(version)),
            Plain,
        ),
        Event::Bootstrapping => ("bootstrapping etcd".into(), Waiting),
        Event::BootstrapRetry { .. } => ("bootstrapping etcd".into(), Waiting),
        Event::Bootstrapped => ("etcd bootstrapped".into(), Plain),
        Event::AlreadyBootstrapped => ("etcd running".into(), Plain),
        Event::Waiting { .. } | Event::Kubeconfig { .. } | Event::Healthy | Event::NoCni => {
            return None;
        }
    })
}

/// A node's state during publish.
fn publish_state(e: &proxmox::Event) -> (String, Tone) {
    use proxmox::Event as P;
    let text = match e {
        P::Uploading { .. } | P::UploadRetry { .. } => "uploading".to_owned(),
        P::Downloading { .. } => "Proxmox fetching".to_owned(),
        P::Uploaded { .. } | P::AlreadyStored { .. } | P::Downloaded { .. } => {
            "image stored".to_owned()
        }
        P::VmFound { vmid, .. } => format!("VM {vmid} kept"),
        P::VmCreated { vmid } => format!("VM {vmid} created"),
        P::VmUnchanged { vmid } => format!("VM {vmid} unchanged"),
        P::VmKeepsDisk { vmid, .. } => format!("VM {vmid} keeps its disk"),
        P::VmSetting { vmid, change } => format!("VM {vmid} {}", change.field),
        P::VmRebooted { vmid } => format!("VM {vmid} rebooted"),
        P::DiskReplaced { vmid } => format!("VM {vmid} got the new disk"),
        P::VmStarted { vmid } => format!("VM {vmid} booting"),
    };
    (text, Tone::Plain)
}

impl Inner {
    /// A log line with the time since start: one line, whatever the
    /// event quotes from a node.
    fn log(&self, st: &mut State, text: &str) {
        self.log_lines(st, &[imgbuild::input::one_line(text, LOG_LINE_CHARS)]);
    }

    /// Prints `lines` (each already one line) as one stamped entry, the
    /// lines after the first indented under it.
    fn log_lines(&self, st: &mut State, lines: &[String]) {
        st.last_line = Instant::now();
        let stamp = format!("[{:>6.1}s]", self.start.elapsed().as_secs_f64());
        for (i, line) in lines.iter().enumerate() {
            let lead: &str = if i == 0 { &stamp } else { "" };
            errln!("{lead:<w$} {line}", w = stamp.len());
        }
    }

    fn bootstrap_event(&self, node: &str, e: &Event) {
        if self.show == Show::Nothing {
            return;
        }
        let now = Instant::now();
        let mut st = self.state.lock().unwrap();
        st.start(now);
        if node == CLUSTER {
            let c = &mut st.cluster;
            match e {
                Event::Waiting { pending } => {
                    let kept: Vec<(String, Instant)> = pending
                        .iter()
                        .map(|p| {
                            let first = c.pending.iter().find(|(q, _)| q == p);
                            (p.clone(), first.map_or(now, |(_, t)| *t))
                        })
                        .collect();
                    c.pending = kept;
                    c.row.set("health checks".into(), Tone::Waiting, now);
                }
                Event::Kubeconfig { .. } => {}
                Event::NoCni => {
                    c.pending.clear();
                    c.row
                        .set("no CNI: nodes stay NotReady".into(), Tone::Waiting, now);
                }
                Event::Healthy => {
                    c.pending.clear();
                    c.row.set("healthy".into(), Tone::Good, now);
                    for row in &mut st.rows {
                        row.set("Ready".into(), Tone::Good, now);
                    }
                }
                other => {
                    if let Some((s, tone)) = node_state(other) {
                        c.row.set(s, tone, now);
                    }
                }
            }
        } else if let Some((s, tone)) = node_state(e) {
            match st.rows.iter_mut().find(|r| r.name == node) {
                Some(row) => row.set(s, tone, now),
                None => {
                    let mut row = Row::new(node, now);
                    row.set(s, tone, now);
                    st.rows.push(row);
                }
            }
        }
        match self.show {
            Show::Lines => {
                let lines = event_lines(node, e);
                self.log_lines(&mut st, &lines);
            }
            Show::Draw => self.draw(&mut st),
            Show::Nothing => {}
        }
    }

    fn publish_event(&self, node: &str, e: &proxmox::Event) {
        if self.show != Show::Draw {
            return;
        }
        let now = Instant::now();
        let mut st = self.state.lock().unwrap();
        st.start(now);
        let (s, tone) = publish_state(e);
        if let Some(row) = st.rows.iter_mut().find(|r| r.name == node) {
            row.set(s, tone, now);
        }
        self.draw(&mut st);
    }

    fn tick(&self) {
        let mut st = self.state.lock().unwrap();
        match self.show {
            Show::Draw if st.started => self.draw(&mut st),
            Show::Lines => self.heartbeat(&mut st),
            Show::Draw | Show::Nothing => {}
        }
    }

    /// Off a terminal: after a silence of [`super::progress::heartbeat`]
    /// while something waits, one line naming each wait and how long it
    /// has lasted.
    fn heartbeat(&self, st: &mut State) {
        if st.last_line.elapsed() < super::progress::heartbeat() {
            return;
        }
        let mut waits: Vec<String> = st
            .rows
            .iter()
            .filter(|r| r.tone == Tone::Waiting)
            .map(|r| {
                format!(
                    "{} {} for {:.1}s",
                    r.name,
                    r.state,
                    r.since.elapsed().as_secs_f64()
                )
            })
            .collect();
        if let Some(text) = pending_text(&st.cluster) {
            waits.push(format!("cluster: {text}"));
        }
        if !waits.is_empty() {
            let line = format!("still waiting: {}", waits.join("; "));
            self.log(st, &line);
        }
    }

    /// Creates the lines on first use, then rewrites each.
    fn draw(&self, st: &mut State) {
        let width = st
            .rows
            .iter()
            .map(|r| r.name.chars().count())
            .chain([CLUSTER.len()])
            .max()
            .unwrap_or(0);
        let State { rows, cluster, .. } = st;
        let pending = pending_text(cluster);
        for row in rows.iter_mut() {
            let text = row_text(row, width, None);
            show_row(&self.screen, row, text);
        }
        let text = row_text(&cluster.row, width, pending);
        show_row(&self.screen, &mut cluster.row, text);
    }
}

/// "2 check(s) pending, oldest 12.5s: etcd members", or None when none is.
/// The lines a bootstrap event prints off a terminal: the checks a wait
/// lists go one per line (imgbuild's own line breaks), while whatever came
/// from outside is escaped into its line and cannot start one.
fn event_lines(node: &str, e: &Event) -> Vec<String> {
    let one = |t: &str| imgbuild::input::one_line(t, LOG_LINE_CHARS);
    match e {
        Event::Waiting { pending } => std::iter::once(format!(
            "{}: waiting for {} check(s):",
            one(node),
            pending.len()
        ))
        .chain(pending.iter().map(|p| format!("    - {}", one(p))))
        .collect(),
        other => vec![one(&format!("{node}: {other}"))],
    }
}

fn pending_text(c: &Cluster) -> Option<String> {
    let (oldest, since) = c.pending.iter().min_by_key(|(_, t)| *t)?;
    Some(format!(
        "{} check(s) pending, oldest {:.1}s: {oldest}",
        c.pending.len(),
        since.elapsed().as_secs_f64()
    ))
}

/// A board line. indicatif draws it, not the one writer, so it is
/// escaped and redacted here, before our colors are added.
fn row_text(row: &Row, width: usize, detail: Option<String>) -> String {
    let state = detail.unwrap_or_else(|| row.state.clone());
    let state = super::output::shown(&super::output::outside(&state), false);
    let state = match row.tone {
        Tone::Good => paint(&state, "32"),
        Tone::Waiting => paint(&state, "33"),
        Tone::Plain => state,
    };
    format!(
        "{:<width$}  {:>5}s  {state}",
        row.name,
        row.since.elapsed().as_secs()
    )
}

fn show_row(screen: &Screen, row: &mut Row, text: String) {
    let bar = row.bar.get_or_insert_with(|| {
        let bar = screen.add(ProgressBar::new_spinner());
        bar.set_style(ProgressStyle::with_template("{wide_msg}").expect("valid template"));
        bar
    });
    bar.set_message(text);
}

impl bootstrap::Observer for Board {
    fn event(&self, node: &str, event: &Event) {
        self.inner.bootstrap_event(node, event);
    }
}

impl proxmox::Observer for Board {
    /// On the board a node's line says where its VM stands; the log above
    /// it keeps the transfers and what needs a person's eye.
    fn event(&self, node: &str, event: &proxmox::Event) {
        use proxmox::Event as P;
        self.inner.publish_event(node, event);
        let on_board = matches!(
            event,
            P::AlreadyStored { .. }
                | P::VmCreated { .. }
                | P::VmUnchanged { .. }
                | P::DiskReplaced { .. }
                | P::VmStarted { .. }
        );
        if !(on_board && self.inner.show == Show::Draw) {
            proxmox::Observer::event(&self.publish, node, event);
        }
    }

    fn sent(&self, node: &str, bytes: u64) {
        proxmox::Observer::sent(&self.publish, node, bytes);
    }
}

impl hcloud::Observer for Board {
    fn event(&self, event: &hcloud::Event) {
        hcloud::Observer::event(&self.publish, event);
    }

    fn sent(&self, nodes: &[String], image_bytes: u64, wire_bytes: u64) {
        hcloud::Observer::sent(&self.publish, nodes, image_bytes, wire_bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn board() -> Board {
        Board::new(
            &["cp-01".into(), "w-01".into()],
            Show::Nothing,
            Show::Nothing,
        )
    }

    #[test]
    fn a_wait_lists_its_checks_on_lines_of_their_own_and_outside_breaks_stay_escaped() {
        let e = Event::Waiting {
            pending: vec!["etcd healthy".into(), "x\ncp-09: forged".into()],
        };
        assert_eq!(
            event_lines("cluster", &e),
            [
                "cluster: waiting for 2 check(s):",
                "    - etcd healthy",
                "    - x\\ncp-09: forged",
            ]
        );
        let e = Event::BootstrapRetry {
            reason: "busy\r\nfake line".into(),
        };
        assert_eq!(
            event_lines("cp-01", &e),
            ["cp-01: bootstrap not possible yet: busy\\r\\nfake line"]
        );
    }

    #[test]
    fn states_follow_events_and_seconds_restart_on_change() {
        let b = board();
        let inner = &b.inner;
        let mut st = inner.state.lock().unwrap();
        let t0 = Instant::now() - Duration::from_secs(5);
        st.rows[0].since = t0;
        st.rows[0].set("pending".into(), Tone::Plain, Instant::now());
        assert_eq!(st.rows[0].since, t0, "the same state keeps its start");
        st.rows[0].set("rebooting".into(), Tone::Waiting, Instant::now());
        assert!(st.rows[0].since > t0);
        assert_eq!(
            node_state(&Event::PortClosed),
            Some(("rebooting".into(), Tone::Waiting))
        );
        assert_eq!(node_state(&Event::Healthy), None);
    }

    #[test]
    fn the_cluster_line_names_the_oldest_pending_check() {
        let now = Instant::now();
        let c = Cluster {
            pending: vec![
                ("kubelet on w-01".into(), now - Duration::from_secs(2)),
                ("etcd members".into(), now - Duration::from_secs(9)),
            ],
            row: Row::new(CLUSTER, now),
        };
        let text = pending_text(&c).unwrap();
        assert!(text.starts_with("2 check(s) pending, oldest 9."), "{text}");
        assert!(text.ends_with(": etcd members"), "{text}");
        let none = Cluster {
            pending: vec![],
            row: Row::new(CLUSTER, now),
        };
        assert_eq!(pending_text(&none), None);
    }
}
