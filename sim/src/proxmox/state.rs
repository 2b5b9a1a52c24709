//! The Proxmox VE double's state: its flags, storages, VMs, tasks and
//! counters, and pveproxy's error shape (pve-common `PVE/Exception.pm`,
//! `PVE/JSONSchema.pm` parameter exceptions).

use super::schema::Errors;
use crate::chain::Nodes;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// pveproxy drops a connection idle for this long.
pub(crate) const IDLE: Duration = Duration::from_secs(5);
/// pveproxy's `$limit_max_post`: larger non-upload bodies are refused.
pub(crate) const MAX_POST: u64 = 64 * 1024;
/// Read size for upload bodies: few syscalls, few large writes.
pub(crate) const UPLOAD_CHUNK: usize = 4 << 20;

#[derive(clap::Args)]
pub struct Args {
    /// Where storages (and the upload staging area) live.
    #[arg(long)]
    pub(crate) state_dir: PathBuf,
    /// Loopback address to listen on.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub(crate) listen: SocketAddr,
    /// The node's name.
    #[arg(long, default_value = "pve")]
    pub(crate) node: String,
    /// The one valid API token, USER@REALM!TOKENID=SECRET.
    #[arg(
        long,
        default_value = "root@pam!imgbuild=5ec7e7a0-0000-4000-8000-00000000cafe"
    )]
    pub(crate) token: String,
    /// Milliseconds before an authentication failure is answered (pveproxy: 3 s).
    #[arg(long, default_value_t = 3000)]
    pub(crate) auth_delay_ms: u64,
    /// Milliseconds each task runs before it stops.
    #[arg(long, default_value_t = 200)]
    pub(crate) task_delay_ms: u64,
    /// Task type that ends with an error exit status.
    #[arg(long)]
    pub(crate) fail_task: Option<String>,
    /// Close the connection after this many body bytes of an upload.
    #[arg(long)]
    pub(crate) drop_upload_after: Option<u64>,
    /// How many uploads to cut (default 1 when --drop-upload-after is given).
    #[arg(long)]
    pub(crate) drop_uploads: Option<u32>,
    /// `local` lacks the import content type.
    #[arg(long)]
    pub(crate) no_import_storage: bool,
    /// More cluster nodes (hosts) beside `--node`, comma-separated. The
    /// storages are then the cluster's shared ones (`shared: 1`, as an NFS
    /// or Ceph storage is listed on every node, pve-storage
    /// `PVE/API2/Storage/Config.pm`), and each VM lives on one node.
    #[arg(long, value_delimiter = ',')]
    pub(crate) other_nodes: Vec<String>,
    /// The node simulator's control URL: a started VM boots a Talos node at
    /// the address in its boot disk's META key 10.
    #[arg(long)]
    pub(crate) nodes_control: Option<String>,
}

/// A storage of the simulated node.
pub(crate) struct Storage {
    pub(crate) id: &'static str,
    pub(crate) kind: &'static str,
    pub(crate) content: Vec<&'static str>,
    /// Whether it is file-based (has a path; uploads need one).
    pub(crate) has_path: bool,
}

/// Counts reported at `/_sim/stats`, each bumped where the thing happens.
#[derive(Default)]
pub(crate) struct Stats {
    pub(crate) requests: AtomicU64,
    pub(crate) uploads: AtomicU64,
    pub(crate) upload_attempts: AtomicU64,
    pub(crate) upload_bytes: AtomicU64,
    /// Bytes download-url fetched (not sent by the client).
    pub(crate) download_bytes: AtomicU64,
    pub(crate) vm_creates: AtomicU64,
    pub(crate) vm_config_changes: AtomicU64,
    pub(crate) reboots: AtomicU64,
    pub(crate) resizes: AtomicU64,
    pub(crate) starts: AtomicU64,
    /// Starts that took a stopped VM to running.
    pub(crate) starts_changed: AtomicU64,
    /// Starts after which no Talos node booted (no valid key 10).
    pub(crate) boot_failures: AtomicU64,
    pub(crate) stops: AtomicU64,
    pub(crate) rejected: AtomicU64,
}

pub(crate) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// A worker task (`fork_worker`): UPID, log, and the exit status once stopped.
pub(crate) struct Task {
    pub(crate) upid: String,
    pub(crate) kind: String,
    pub(crate) id: String,
    pub(crate) pid: u32,
    pub(crate) pstart: u32,
    pub(crate) start: u64,
    pub(crate) log: Vec<String>,
    pub(crate) exit: Option<String>,
}

/// A VM: its configuration as `GET …/config` shows it, and whether it runs.
#[derive(Clone, Default)]
pub(crate) struct Vm {
    pub(crate) config: BTreeMap<String, String>,
    /// Changes made while it ran that qemu-server could not hot-plug: they
    /// apply at its next start (`vmconfig_apply_pending`).
    pub(crate) pending: BTreeMap<String, String>,
    /// The cluster node it lives on.
    pub(crate) host: String,
    pub(crate) running: bool,
    /// The address its Talos node booted at on the last start.
    pub(crate) booted_ip: Option<String>,
    /// Why no node booted on the last start.
    pub(crate) boot_error: Option<String>,
    /// The hostname the ISO's META gave, when the last start booted an ISO.
    pub(crate) booted_iso: Option<Option<String>>,
    /// The disk Talos was installed to from an ISO, and the address and
    /// hostname its META gives the installed node.
    pub(crate) installed: Option<Installed>,
}

/// A disk Talos installed itself to from an ISO.
#[derive(Clone)]
pub(crate) struct Installed {
    pub(crate) volid: String,
    pub(crate) ip: String,
    pub(crate) hostname: Option<String>,
}

pub(crate) struct Pve {
    pub(crate) args: Args,
    pub(crate) storages: Vec<Storage>,
    pub(crate) started: u64,
    pub(crate) tasks: Mutex<BTreeMap<String, Task>>,
    pub(crate) vms: Mutex<BTreeMap<u32, Vm>>,
    pub(crate) stats: Stats,
    pub(crate) drops_left: AtomicU32,
    pub(crate) seq: AtomicU32,
    pub(crate) nodes: Option<Nodes>,
}

/// An error answer: HTTP status, message, per-parameter errors.
#[derive(Debug)]
pub(crate) struct ApiError {
    pub(crate) status: u16,
    pub(crate) message: String,
    pub(crate) errors: Errors,
}

/// A `die` in a real handler: 500 with the message.
pub(crate) fn die(msg: impl Into<String>) -> ApiError {
    ApiError {
        status: 500,
        message: msg.into(),
        errors: Errors::new(),
    }
}

/// `raise_param_exc`: 400 with per-parameter errors.
pub(crate) fn param_exc(errors: Errors) -> ApiError {
    ApiError {
        status: 400,
        message: "Parameter verification failed.".into(),
        errors,
    }
}

pub(crate) type ApiResult = Result<Value, ApiError>;

pub(crate) fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl Pve {
    /// The node's fixed storages (directories made under the state dir).
    pub(crate) fn new(args: Args) -> anyhow::Result<Pve> {
        let import = !args.no_import_storage;
        let storages = vec![
            Storage {
                id: "local",
                kind: "dir",
                content: if import {
                    vec!["iso", "vztmpl", "import"]
                } else {
                    vec!["iso", "vztmpl"]
                },
                has_path: true,
            },
            Storage {
                id: "local-lvm",
                kind: "lvmthin",
                content: vec!["images", "rootdir"],
                has_path: false,
            },
            Storage {
                id: "backup",
                kind: "dir",
                content: vec!["backup", "iso"],
                has_path: true,
            },
        ];
        for s in &storages {
            std::fs::create_dir_all(args.state_dir.join("storage").join(s.id))?;
        }
        std::fs::create_dir_all(args.state_dir.join("tmp"))?;
        let drops = match (args.drop_upload_after, args.drop_uploads) {
            (Some(_), n) => n.unwrap_or(1),
            (None, _) => 0,
        };
        let nodes = args
            .nodes_control
            .as_deref()
            .map(Nodes::parse)
            .transpose()?;
        Ok(Pve {
            nodes,
            args,
            storages,
            started: now(),
            tasks: Mutex::new(BTreeMap::new()),
            vms: Mutex::new(BTreeMap::new()),
            stats: Stats::default(),
            drops_left: AtomicU32::new(drops),
            seq: AtomicU32::new(0),
        })
    }
}

impl Pve {
    pub(crate) fn token_user(&self) -> &str {
        self.args.token.split('=').next().unwrap_or_default()
    }

    pub(crate) fn stats_json(&self) -> Value {
        let s = &self.stats;
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        json!({
            "requests": g(&s.requests),
            "uploads": g(&s.uploads),
            "uploadAttempts": g(&s.upload_attempts),
            "uploadBytes": g(&s.upload_bytes),
            "downloadBytes": g(&s.download_bytes),
            "vmCreates": g(&s.vm_creates),
            "vmConfigChanges": g(&s.vm_config_changes),
            "reboots": g(&s.reboots),
            "resizes": g(&s.resizes),
            "starts": g(&s.starts),
            "startsChanged": g(&s.starts_changed),
            "bootFailures": g(&s.boot_failures),
            "stops": g(&s.stops),
            "rejected": g(&s.rejected),
            "tasksRunning": self.tasks.lock().unwrap().values().filter(|t| t.exit.is_none()).count(),
        })
    }

    /// `GET /_sim/stats` and `GET /_sim/vms/<vmid>`.
    pub(crate) fn sim_view(&self, path: &str) -> (u16, &'static str, Value) {
        if path == "/_sim/stats" {
            return (200, "OK", self.stats_json());
        }
        let vm = path
            .strip_prefix("/_sim/vms/")
            .and_then(|id| id.parse::<u32>().ok())
            .and_then(|id| self.vms.lock().unwrap().get(&id).cloned());
        match vm {
            Some(vm) => (
                200,
                "OK",
                json!({"running": vm.running, "bootedIp": vm.booted_ip, "bootError": vm.boot_error,
                       "host": vm.host, "config": vm.config, "pending": vm.pending}),
            ),
            None => (
                404,
                "Not Found",
                json!({"error": format!("no such VM: {path}")}),
            ),
        }
    }

    pub(crate) fn storage(&self, id: &str) -> Result<&Storage, ApiError> {
        self.storages
            .iter()
            .find(|s| s.id == id)
            .ok_or_else(|| die(format!("storage '{id}' does not exist")))
    }

    pub(crate) fn storage_dir(&self, id: &str) -> PathBuf {
        self.args.state_dir.join("storage").join(id)
    }

    /// The file behind a volume ID (`local:import/x.raw`, `local-lvm:vm-1-disk-0`).
    pub(crate) fn volume_path(&self, volid: &str) -> Result<PathBuf, String> {
        let (sid, name) = volid
            .split_once(':')
            .ok_or_else(|| format!("unable to parse volume ID '{volid}'"))?;
        let s = self.storage(sid).map_err(|e| e.message)?;
        let dir = self.storage_dir(s.id);
        if !s.has_path {
            return Ok(dir.join(format!("{name}.raw")));
        }
        let (kind, file) = name
            .split_once('/')
            .ok_or_else(|| format!("unable to parse directory volume name '{name}'"))?;
        Ok(match kind {
            "iso" => dir.join("template/iso").join(file),
            "vztmpl" => dir.join("template/cache").join(file),
            "import" => dir.join("import").join(file),
            "backup" => dir.join("dump").join(file),
            other => {
                return Err(format!(
                    "unable to parse directory volume name '{other}/{file}'"
                ));
            }
        })
    }
}
