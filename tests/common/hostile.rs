//! The harness the `hostile_*` tests share: a case's folders, the real
//! binary run measured (peak RSS, time, the signal that ended it), and the
//! promises every run keeps whatever it was given: no panic and no signal
//! death, no raw control character in any output, peak RSS under 64 MiB,
//! an end within the case's time, and nothing written into the working
//! folder, `$HOME`, `$TMPDIR` or `outside`.

use std::path::PathBuf;
use std::time::Duration;

use super::run::{Measured, Run};

pub const LIMIT_RSS_KIB: i64 = 64 << 10;

/// Environment that would point a run at someone's real cluster, factory
/// or account.
const CLEARED: &[&str] = &[
    "IMGBUILD_CONFIG",
    "IMGBUILD_FACTORY",
    "IMGBUILD_STATE_DIR",
    "TALOSCONFIG",
    "PROXMOX_VE_ENDPOINT",
    "PROXMOX_VE_API_TOKEN",
    "HCLOUD_TOKEN",
    "HCLOUD_ENDPOINT",
];

/// One case's folders: `cwd`, `home` and `outside` always (the first two
/// must stay empty, the last as the test left it), `outside/keep` in it,
/// and whichever others the test asks for (`in`, `out`, `tmp`, …).
pub struct Case {
    pub dir: tempfile::TempDir,
}

/// How a run ended, and what `outside` held before it.
pub struct Ran {
    pub code: Option<i32>,
    pub signal: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub rss_kib: i64,
    pub took: Duration,
    outside_before: Vec<(String, Vec<u8>)>,
}

impl Ran {
    pub fn all(&self) -> String {
        format!("{}{}", self.stdout, self.stderr)
    }
}

impl Case {
    pub fn new(folders: &[&str]) -> Case {
        let dir = tempfile::tempdir().unwrap();
        for d in ["cwd", "home", "outside"].iter().chain(folders) {
            std::fs::create_dir_all(dir.path().join(d)).unwrap();
        }
        std::fs::write(dir.path().join("outside/keep"), "untouched").unwrap();
        Case { dir }
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    pub fn s(&self, rel: &str) -> String {
        self.path(rel).to_str().unwrap().to_owned()
    }

    /// Writes `content` at `rel` (folders made); its path.
    pub fn write(&self, rel: &str, content: impl AsRef<[u8]>) -> String {
        let p = self.path(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, content).unwrap();
        self.s(rel)
    }

    /// imgbuild with `args`, in `cwd`, HOME in `home` (its cache there
    /// too), TMPDIR in `tmp` when the case has one, and none of the
    /// environment that names a real cluster or account.
    pub fn command(&self, args: &[&str]) -> Run {
        let mut run = Run::new(args);
        run.current_dir(&self.path("cwd"))
            .env("HOME", self.path("home"))
            .env("XDG_CACHE_HOME", self.path("home/cache"));
        if self.path("tmp").is_dir() {
            run.env("TMPDIR", self.path("tmp"));
        }
        for k in CLEARED {
            run.env_remove(k);
        }
        run
    }

    /// Runs `run` measured; a run still going at twice `limit` is killed
    /// and fails the test.
    pub fn measure(&self, run: &mut Run, limit: Duration) -> Ran {
        let outside_before = self.outside();
        let m: Measured = run.measured(2 * limit);
        assert!(
            !m.killed,
            "ran past {:?}: {}{}",
            2 * limit,
            m.stdout,
            m.stderr
        );
        let Some(code) = m.status.code() else {
            panic!("GNU time died: {}", m.status);
        };
        Ran {
            code: m.signal.is_none().then_some(code),
            signal: m.signal,
            stdout: m.stdout,
            stderr: m.stderr,
            rss_kib: m.rss_kib,
            took: m.took,
            outside_before,
        }
    }

    /// [`Case::command`] with `args`, measured.
    pub fn run(&self, args: &[&str], limit: Duration) -> Ran {
        self.measure(&mut self.command(args), limit)
    }

    /// Names and contents of the files in `outside`, sorted.
    fn outside(&self) -> Vec<(String, Vec<u8>)> {
        let mut found: Vec<(String, Vec<u8>)> = std::fs::read_dir(self.path("outside"))
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                let content = std::fs::read(e.path()).unwrap_or_default();
                (e.file_name().to_string_lossy().into_owned(), content)
            })
            .collect();
        found.sort();
        found
    }

    /// The bounds every run keeps, accepted input or not, `limit` its time.
    pub fn bounded(&self, ran: &Ran, limit: Duration) {
        let all = ran.all();
        assert_eq!(ran.signal, None, "killed by a signal: {all}");
        assert!(!all.contains("panicked"), "{all}");
        no_raw_control("the output", &all);
        assert!(
            ran.rss_kib < LIMIT_RSS_KIB,
            "peak RSS {} KiB: {all}",
            ran.rss_kib
        );
        assert!(ran.took < limit, "took {:?}: {all}", ran.took);
        for d in ["cwd", "home", "tmp"] {
            let Ok(entries) = std::fs::read_dir(self.path(d)) else {
                continue;
            };
            let left: Vec<_> = entries.map(|e| e.unwrap().file_name()).collect();
            assert!(left.is_empty(), "wrote into {d}: {left:?}");
        }
        let names = |v: &[(String, Vec<u8>)]| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
        let now = self.outside();
        assert_eq!(names(&now), names(&ran.outside_before), "wrote outside");
        assert!(now == ran.outside_before, "changed a file outside");
    }

    /// A refused input: the bounds, an exit code among `codes`, and a
    /// message naming `names`.
    pub fn refused(&self, ran: &Ran, codes: &[i32], names: &str, limit: Duration) {
        let all = ran.all();
        self.bounded(ran, limit);
        assert!(
            ran.code.is_some_and(|c| codes.contains(&c)),
            "exit {:?}, wanted one of {codes:?}: {all}",
            ran.code
        );
        assert!(all.contains(names), "no mention of {names:?}: {all}");
    }
}

/// Fails when `text` holds a control character other than newline and tab
/// (C0, DEL, C1) or a bidi override, raw: `what` says whose text it is.
pub fn no_raw_control(what: &str, text: &str) {
    let bad = text.chars().find(|&c| {
        (c.is_control() && c != '\n' && c != '\t')
            || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    });
    assert!(
        bad.is_none(),
        "{what}: raw {bad:?} reached the terminal:\n{text:?}"
    );
}
