//! `imgbuild node`, `build` and `verify`, and download progress display.

use super::inventory::load_inventory;
use super::output::{Output, Partial, Reported, failed_json, print_failures};
use anyhow::{Result, bail};
use clap::Args;
use imgbuild::build::{self, BuildError, BuildOptions, BuildOutcome, Route};
use imgbuild::fetch::{FetchOptions, Progress};
use indicatif::{MultiProgress, ProgressBar};
use serde_json::json;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How downloads behave, shared by every command that downloads.
#[derive(Args)]
pub struct DownloadArgs {
    /// Download cache [default: $XDG_CACHE_HOME/imgbuild].
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// Retries for 5xx, resets, timeouts and truncated bodies.
    #[arg(long, default_value_t = 4)]
    retries: u32,
    /// First pause between retries, doubling each time.
    #[arg(long, default_value_t = 500)]
    retry_delay_ms: u64,
    /// Longest silence from the server before an attempt is abandoned.
    #[arg(long, default_value_t = 60)]
    read_timeout_secs: u64,
    /// Longest time a download may take, all attempts together.
    #[arg(long, default_value_t = 3600)]
    download_deadline_secs: u64,
    /// Largest image a download may decompress to, in MiB.
    #[arg(long, default_value_t = 16384)]
    max_image_mib: u64,
    /// Largest kernel a download may be, in MiB (Talos': about 20).
    #[arg(long, default_value_t = 64)]
    max_kernel_mib: u64,
    /// Largest initramfs a download may be, in MiB (Talos': about 100).
    #[arg(long, default_value_t = 512)]
    max_initramfs_mib: u64,
    /// No progress output.
    #[arg(long)]
    pub(super) quiet: bool,
}

impl DownloadArgs {
    pub(super) fn options(&self) -> FetchOptions {
        FetchOptions {
            cache_dir: self
                .cache_dir
                .clone()
                .unwrap_or_else(FetchOptions::default_cache_dir),
            retries: self.retries,
            backoff: Duration::from_millis(self.retry_delay_ms),
            read_timeout: Duration::from_secs(self.read_timeout_secs),
            deadline: Duration::from_secs(self.download_deadline_secs),
            max_image_size: self.max_image_mib.saturating_mul(1 << 20),
            max_kernel_size: self.max_kernel_mib.saturating_mul(1 << 20),
            max_initramfs_size: self.max_initramfs_mib.saturating_mul(1 << 20),
        }
    }
}

#[derive(Args)]
pub struct BuildArgs {
    /// patch: one base image, META written per node (default); factory: one factory image per node.
    #[arg(long, value_enum, default_value_t = Route::Patch)]
    route: Route,
    #[arg(long, default_value = "out")]
    out_dir: PathBuf,
    /// Nodes built at once.
    #[arg(long, default_value_t = 4)]
    jobs: usize,
    #[command(flatten)]
    pub(super) download: DownloadArgs,
}

#[derive(Args)]
pub struct NodeArgs {
    node: String,
    #[command(flatten)]
    build: BuildArgs,
}

#[derive(Args)]
pub struct BuildManyArgs {
    /// Nodes to build (all when none are given).
    nodes: Vec<String>,
    #[command(flatten)]
    build: BuildArgs,
}

#[derive(Args)]
pub struct FetchArgs {
    /// An image URL: .raw.zst, .raw.xz, .raw, .qcow2 or .iso.
    url: String,
    /// The digest of the bytes as served: sha256:<hex> or sha512:<hex>.
    #[arg(long)]
    pin: Option<imgbuild::fetch::Pin>,
    #[command(flatten)]
    download: DownloadArgs,
}

#[derive(Args)]
pub struct VerifyArgs {
    #[arg(long, default_value = "out")]
    out_dir: PathBuf,
}

pub fn node(args: NodeArgs, config: &Path, output: Output) -> Result<()> {
    run(vec![args.node], args.build, config, output)
}

pub fn many(args: BuildManyArgs, config: &Path, output: Output) -> Result<()> {
    run(args.nodes, args.build, config, output)
}

impl BuildArgs {
    pub(super) fn options(&self) -> BuildOptions {
        BuildOptions {
            out_dir: self.out_dir.clone(),
            route: self.route,
            fetch: self.download.options(),
            jobs: self.jobs,
        }
    }
}

/// The images that were built or already current, each node that failed
/// (one line: the node, then its error chain), and the summary of the
/// failure, if any.
pub(super) type Built = (Vec<BuildOutcome>, Vec<(String, String)>, Option<String>);

/// Builds `nodes` with download progress shown as `args` asks; a build that
/// failed for some nodes still returns the others.
pub(super) fn build_nodes(
    inv: &imgbuild::inventory::Inventory,
    nodes: &[String],
    args: &BuildArgs,
    output: Output,
) -> Result<Built> {
    let progress = progress_for(args.download.quiet, output);
    let (outcomes, failed, summary) =
        match build::build(inv, nodes, &args.options(), progress.as_ref()) {
            Ok(outcomes) => (outcomes, Vec::new(), None),
            Err(e) => {
                let summary = e.to_string();
                match e {
                    BuildError::Incomplete { built, failed } => (built, failed, Some(summary)),
                    e => return Err(e.into()),
                }
            }
        };
    let failures = failed
        .into_iter()
        .map(|f| (f.node, format!("{:#}", anyhow::Error::new(f.error))))
        .collect();
    Ok((outcomes, failures, summary))
}

fn run(nodes: Vec<String>, args: BuildArgs, config: &Path, output: Output) -> Result<()> {
    let inv = load_inventory(config, output)?;
    let (outcomes, failures, summary) = build_nodes(&inv, &nodes, &args, output)?;
    let opts = args.options();
    match output {
        Output::Json => {
            outln!(
                "{}",
                json!({"images": outcomes, "failed": failed_json(&failures)})
            );
        }
        Output::Text => {
            print_outcomes(&outcomes, &opts.out_dir, failures.is_empty());
            print_failures(&failures);
        }
    }
    // Some images done and some not is the documented "partial" (3).
    match summary {
        Some(s) if outcomes.is_empty() => Err(Reported(s).into()),
        Some(s) => Err(Partial(s).into()),
        None => Ok(()),
    }
}

fn print_outcomes(outcomes: &[BuildOutcome], out_dir: &Path, complete: bool) {
    for o in outcomes {
        let state = if o.built { "built" } else { "up to date" };
        outln!(
            "{:<12} {:<10} {}  sha256 {}  ({state})",
            o.image.node,
            format!("{:?}", o.image.route).to_lowercase(),
            o.file.display(),
            &o.image.sha256.hex()[..16]
        );
    }
    if complete && outcomes.iter().all(|o| !o.built) {
        outln!(
            "nothing to do: every image matches {}",
            build::Manifest::path(out_dir).display()
        );
    }
}

/// Downloads one image into the cache (verified, decompressed) and prints where.
pub fn fetch(args: FetchArgs, output: Output) -> Result<()> {
    let opts = args.download.options();
    let progress = progress_for(args.download.quiet, output);
    let client = imgbuild::fetch::client(&opts);
    let art = imgbuild::fetch::fetch(
        &client,
        &args.url,
        args.pin.as_ref(),
        &opts,
        progress.as_ref(),
    )?;
    match output {
        Output::Json => outln!("{}", json!({"artifact": art, "cached": art.cached})),
        Output::Text => outln!(
            "{}  sha256 {}  {} bytes{}",
            art.path.display(),
            art.sha256,
            art.size,
            if art.cached { "  (cached)" } else { "" }
        ),
    }
    Ok(())
}

pub(super) fn progress_for(quiet: bool, output: Output) -> Box<dyn Progress> {
    if quiet || output == Output::Json {
        Box::new(imgbuild::fetch::Silent)
    } else if super::progress::redraws() {
        Box::new(Bars::default())
    } else {
        Box::new(Lines::default())
    }
}

pub fn verify(args: VerifyArgs, output: Output) -> Result<()> {
    let results = build::verify(&args.out_dir)?;
    if results.is_empty() {
        bail!(
            "{}: no images recorded",
            build::Manifest::path(&args.out_dir).display()
        );
    }
    match output {
        Output::Json => outln!("{}", json!({"images": results})),
        Output::Text => {
            for r in &results {
                match &r.problem {
                    None => outln!("{:<12} ok        {}", r.node, r.path.display()),
                    Some(p) => outln!("{:<12} MISMATCH  {}: {p}", r.node, r.path.display()),
                }
            }
        }
    }
    let bad = results.iter().filter(|r| !r.ok).count();
    if bad > 0 {
        // The JSON result above already lists each mismatch.
        return Err(Reported(format!(
            "{bad} of {} images do not match the manifest",
            results.len()
        ))
        .into());
    }
    Ok(())
}

/// indicatif bars, one per download, on a terminal.
#[derive(Default)]
struct Bars {
    multi: MultiProgress,
    bars: Mutex<HashMap<String, ProgressBar>>,
}

impl Progress for Bars {
    fn start(&self, url: &str, total: Option<u64>) {
        let bar = self.multi.add(ProgressBar::new(total.unwrap_or(0)));
        bar.set_style(super::progress::transfer_style());
        bar.set_message(short_label(url));
        self.bars.lock().unwrap().insert(url.to_owned(), bar);
    }
    fn advance(&self, url: &str, bytes: u64) {
        if let Some(bar) = self.bars.lock().unwrap().get(url) {
            bar.inc(bytes);
        }
    }
    fn retry(&self, url: &str, attempt: u32, why: &str) {
        let _ = self
            .multi
            .println(format!("retry {attempt} for {url}: {why}"));
    }
    fn finish(&self, url: &str) {
        if let Some(bar) = self.bars.lock().unwrap().remove(url) {
            bar.finish_and_clear();
        }
    }
}

/// The last three URL segments, long ones (schematic IDs) cut to 8 characters:
/// `7d4c31cb…/v1.11.2/metal-amd64.raw.zst`.
fn short_label(url: &str) -> String {
    let mut parts: Vec<String> = url
        .rsplit('/')
        .take(3)
        .map(|p| {
            if p.chars().count() > 24 {
                format!("{}…", p.chars().take(8).collect::<String>())
            } else {
                p.to_owned()
            }
        })
        .collect();
    parts.reverse();
    parts.join("/")
}

/// Plain lines for logs: start, every 10 seconds per download, retries, finish.
#[derive(Default)]
struct Lines {
    downloads: Mutex<HashMap<String, LineState>>,
}

struct LineState {
    bytes: u64,
    total: Option<u64>,
    started: Instant,
    last: Instant,
}

impl Progress for Lines {
    fn start(&self, url: &str, total: Option<u64>) {
        let now = Instant::now();
        self.downloads.lock().unwrap().insert(
            url.to_owned(),
            LineState {
                bytes: 0,
                total,
                started: now,
                last: now,
            },
        );
        errln!(
            "downloading {url} ({} bytes)",
            total.map_or("unknown".into(), |t| t.to_string())
        );
    }
    fn advance(&self, url: &str, bytes: u64) {
        let mut all = self.downloads.lock().unwrap();
        let Some(s) = all.get_mut(url) else { return };
        s.bytes += bytes;
        if s.last.elapsed() >= Duration::from_secs(10) {
            s.last = Instant::now();
            let rate = s.bytes as f64 / s.started.elapsed().as_secs_f64().max(0.001);
            errln!(
                "  {url}: {} / {} bytes, {:.1} MB/s",
                s.bytes,
                s.total.map_or("?".into(), |t| t.to_string()),
                rate / 1e6
            );
        }
    }
    fn retry(&self, url: &str, attempt: u32, why: &str) {
        errln!("retry {attempt} for {url}: {why}");
    }
    fn resume(&self, url: &str, offset: u64, why: &str) {
        errln!("resuming {url} at byte {offset} after: {why}");
    }
    fn finish(&self, url: &str) {
        if let Some(s) = self.downloads.lock().unwrap().remove(url) {
            errln!(
                "downloaded {url}: {} bytes in {:.1}s",
                s.bytes,
                s.started.elapsed().as_secs_f64()
            );
        }
    }
}
