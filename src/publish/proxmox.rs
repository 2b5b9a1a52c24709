//! Proxmox VE: each node's verified image into a storage with `import`
//! content (named by its content, since Proxmox lists no checksums and
//! overwrites same-named files), then optionally one VM per node that boots
//! it. Facts: proxmox/pve-storage `src/PVE/API2/Storage/Status.pm`,
//! proxmox/pve-http-server `src/PVE/APIServer/AnyEvent.pm`, proxmox/qemu-server
//! `src/PVE/API2/Qemu.pm`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use reqwest::blocking::{Client, RequestBuilder};
use reqwest::header::HeaderValue;
use reqwest::multipart::{Form, Part};
use serde_json::Value;

use super::{PublishImage, Secret};
use crate::digest::Sha256;
use crate::inventory::{ImageFormat, Inventory, ProxmoxSettings, ProxmoxVm, VmBoot};
use crate::net::{self, NetError, RetryPolicy, Trust};

/// Why publishing to Proxmox failed. Never carries the token.
#[derive(Debug, thiserror::Error)]
pub enum ProxmoxError {
    #[error("{0}")]
    Setup(String),
    #[error(
        "the Proxmox API refused the token in PROXMOX_VE_API_TOKEN (HTTP 401): check its user, realm, token ID, secret and privileges"
    )]
    Unauthorized,
    #[error("{what}: {message}")]
    Api { what: String, message: String },
    #[error(transparent)]
    Net(#[from] NetError),
    #[error("{what}: task {upid} ended with {exitstatus:?}{}", log_tail(log))]
    Task {
        what: String,
        upid: String,
        exitstatus: String,
        log: Vec<String>,
    },
    #[error("{what}: task {upid} still running after {timeout:?}")]
    TaskTimeout {
        what: String,
        upid: String,
        timeout: Duration,
    },
    #[error("node {node}: {message}")]
    Node { node: String, message: String },
}

fn log_tail(log: &[String]) -> String {
    if log.is_empty() {
        String::new()
    } else {
        format!("; task log ends:\n    {}", log.join("\n    "))
    }
}

/// Where and how to reach the API: from `PROXMOX_VE_*`, named as the bpg
/// Terraform provider names them.
#[derive(Debug, Clone)]
pub struct Credentials {
    /// `https://host:8006/api2/json`.
    pub api: String,
    pub token: Secret,
    pub trust: Trust,
}

impl Credentials {
    /// Reads `PROXMOX_VE_ENDPOINT`, `PROXMOX_VE_API_TOKEN`,
    /// `PROXMOX_VE_FINGERPRINT` (over the inventory's pin) and
    /// `PROXMOX_VE_INSECURE` through `env`.
    pub fn from_env(
        settings: &ProxmoxSettings,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Credentials, ProxmoxError> {
        let setup = |m: String| ProxmoxError::Setup(m);
        let endpoint = env("PROXMOX_VE_ENDPOINT")
            .filter(|v| !v.trim().is_empty())
            .ok_or_else(|| {
                setup("PROXMOX_VE_ENDPOINT is not set (e.g. https://pve.example.com:8006/)".into())
            })?;
        // The value itself is never shown: it may carry a password.
        let url = reqwest::Url::parse(endpoint.trim()).map_err(|e| {
            setup(format!(
                "PROXMOX_VE_ENDPOINT is not a URL ({e}); use https://host:8006/"
            ))
        })?;
        // Scheme, host and port only: a path, query or fragment may hold a
        // ticket or password as well as userinfo can.
        let shown = match (url.host_str(), url.port_or_known_default()) {
            (Some(host), Some(port)) => format!("{}://{host}:{port}", url.scheme()),
            (Some(host), None) => format!("{}://{host}", url.scheme()),
            (None, _) => format!("{}:…", url.scheme()),
        };
        if !url.username().is_empty() || url.password().is_some() {
            return Err(setup(
                "PROXMOX_VE_ENDPOINT holds a user name or password: give https://host:port/ \
                 and the credentials in PROXMOX_VE_API_TOKEN"
                    .into(),
            ));
        }
        if url.scheme() != "https" || url.host_str().is_none() {
            return Err(setup(format!(
                "PROXMOX_VE_ENDPOINT {shown} must be https://host:port/ (pveproxy speaks HTTPS only)"
            )));
        }
        if url.query().is_some() || url.fragment().is_some() {
            return Err(setup(format!(
                "PROXMOX_VE_ENDPOINT {shown}: no query or fragment; give https://host:port/"
            )));
        }
        if !matches!(url.path(), "/" | "/api2/json" | "/api2/json/") {
            return Err(setup(format!(
                "PROXMOX_VE_ENDPOINT {shown}: the path must be / or /api2/json (pveproxy serves the API there only)"
            )));
        }
        let base = url.as_str().trim_end_matches('/');
        let base = base.strip_suffix("/api2/json").unwrap_or(base);
        let token = env("PROXMOX_VE_API_TOKEN").ok_or_else(|| {
            setup("PROXMOX_VE_API_TOKEN is not set (user@realm!tokenid=secret)".into())
        })?;
        if !token_shape_ok(&token) {
            return Err(setup(
                "PROXMOX_VE_API_TOKEN is not of the form user@realm!tokenid=secret (value not shown)"
                    .into(),
            ));
        }
        let insecure = env("PROXMOX_VE_INSECURE").is_some_and(|v| {
            matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes")
        });
        let pin = match env("PROXMOX_VE_FINGERPRINT").filter(|v| !v.trim().is_empty()) {
            Some(v) => Some(
                v.parse::<Sha256>()
                    .map_err(|e| setup(format!("PROXMOX_VE_FINGERPRINT: {e}")))?,
            ),
            None => settings
                .fingerprint
                .as_deref()
                .map(str::parse::<Sha256>)
                .transpose()
                .map_err(|e| setup(format!("publish.proxmox.fingerprint: {e}")))?,
        };
        let trust = match (insecure, pin) {
            (true, _) => Trust::Any,
            (false, Some(p)) => Trust::Pinned(p),
            (false, None) => Trust::System,
        };
        Ok(Credentials {
            api: format!("{base}/api2/json"),
            token: Secret::new(token),
            trust,
        })
    }

    /// True when certificates are not checked at all.
    pub fn insecure(&self) -> bool {
        matches!(self.trust, Trust::Any)
    }
}

/// `user@realm!tokenid=secret`, without looking at the secret.
fn token_shape_ok(t: &str) -> bool {
    let Some((id, secret)) = t.split_once('=') else {
        return false;
    };
    let Some((user, token_id)) = id.split_once('!') else {
        return false;
    };
    user.contains('@')
        && !token_id.is_empty()
        && !secret.is_empty()
        && !t.contains(char::is_whitespace)
}

/// What a publish run does.
#[derive(Debug, Clone)]
pub struct PublishOptions {
    /// Give a VM running an older image the new disk (stop, swap, start).
    pub replace_disk: bool,
    /// How often tasks are polled.
    pub poll: Duration,
    /// The longest any one task may run (an upload's copy, a VM import).
    pub task_timeout: Duration,
    /// Times a broken upload is sent again from the start.
    pub upload_retries: u32,
    /// For API calls that fail on the way (busy proxy, dropped connection).
    pub retry: RetryPolicy,
}

impl Default for PublishOptions {
    fn default() -> Self {
        PublishOptions {
            replace_disk: false,
            poll: Duration::from_millis(500),
            task_timeout: Duration::from_secs(1800),
            upload_retries: 2,
            retry: RetryPolicy::default(),
        }
    }
}

/// Progress a publish reports; the CLI renders it, the library never prints.
pub trait Observer: Sync {
    fn event(&self, node: &str, event: &Event);
    /// During an upload attempt (after [`Event::Uploading`]): how many bytes
    /// of the image have left so far, counted as the HTTP client takes them
    /// off the body, not as they are read from the file. Called a few times
    /// a second at most, so a progress bar can follow.
    fn sent(&self, _node: &str, _bytes: u64) {}
}

/// One step of one node's publish.
#[derive(Debug, Clone)]
pub enum Event {
    Uploading {
        volid: String,
        size: u64,
    },
    UploadRetry {
        attempt: u32,
        why: String,
    },
    Uploaded {
        volid: String,
    },
    AlreadyStored {
        volid: String,
    },
    /// The node's VM is `vmid`, not the `inventory_vmid` that `firstId` +
    /// position gives: it is kept, not made again.
    VmFound {
        vmid: u32,
        inventory_vmid: u32,
    },
    VmCreated {
        vmid: u32,
    },
    VmUnchanged {
        vmid: u32,
    },
    /// The VM runs an older image and `--replace-disk` was not given.
    VmOutdated {
        vmid: u32,
        running: String,
    },
    DiskReplaced {
        vmid: u32,
    },
    VmStarted {
        vmid: u32,
    },
}

/// What happened to a node's VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum VmChange {
    Created,
    Updated,
    Unchanged,
    /// Left as it was although it boots an older image.
    Outdated,
}

/// One node's result.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodePublished {
    pub node: String,
    pub volid: String,
    pub sha256: String,
    /// False when the storage already held this exact volume.
    pub uploaded: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vmid: Option<u32>,
    /// The vmid the inventory gives (`firstId` + position) when the node's
    /// VM was found under another one (`vmid`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inventory_vmid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vm: Option<VmChange>,
    pub started: bool,
}

/// The file name a node's image gets in storage, as pveproxy will store it:
/// content-addressed (`<cluster>-<node>-<talos>-<sha12>.<raw|qcow2>`) and
/// normalised the way the server normalises (every character outside
/// `[a-zA-Z0-9_.-]` becomes `_`).
pub fn volume_file(
    cluster: &str,
    node: &str,
    talos: &str,
    sha256: &str,
    format: ImageFormat,
) -> String {
    let ext = match format {
        ImageFormat::Raw => "raw",
        ImageFormat::Qcow2 => "qcow2",
        ImageFormat::Iso => "iso",
    };
    let stem: String = format!(
        "{cluster}-{node}-{talos}-{}",
        &sha256[..sha256.len().min(12)]
    )
    .chars()
    .map(|c| {
        if c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-') {
            c
        } else {
            '_'
        }
    })
    .collect();
    format!("{stem}.{ext}")
}

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes read from the image per body chunk: large chunks keep TLS records
/// full and the per-chunk overhead negligible (the blocking client would
/// cut the body into 8 KiB pieces).
const UPLOAD_CHUNK: usize = 1 << 20;

/// The multipart body of an upload, in the only order pveproxy's streaming
/// parser accepts: `content`, `checksum-algorithm`, `checksum`, then the
/// file part named `filename`, with a known length (so a Content-Length and
/// no chunking), streamed from the file in constant memory.
/// `sent` counts the file's bytes as they leave (see [`Counted`]).
fn upload_form(
    file: tokio::fs::File,
    size: u64,
    name: &str,
    sha256: &str,
    content: &'static str,
    sent: Arc<AtomicU64>,
) -> Form {
    let body = reqwest::Body::wrap_stream(Counted {
        inner: tokio_util::io::ReaderStream::with_capacity(file, UPLOAD_CHUNK),
        handed_out: 0,
        sent,
    });
    Form::new()
        .text("content", content)
        .text("checksum-algorithm", "sha256")
        .text("checksum", sha256.to_owned())
        .part(
            "filename",
            Part::stream_with_length(body, size)
                .file_name(name.to_owned())
                .mime_str("application/octet-stream")
                .expect("a valid MIME type"),
        )
}

/// The storage content type a format is uploaded as: disk images to
/// `import` (for `import-from`), boot ISOs to `iso` (for a cdrom drive).
pub fn content_for(format: ImageFormat) -> &'static str {
    match format {
        ImageFormat::Iso => "iso",
        ImageFormat::Raw | ImageFormat::Qcow2 => "import",
    }
}

/// The VM settings that boot Talos. The API's defaults do not: its CPU type
/// kvm64 lacks the x86-64-v2 features Talos needs (siderolabs/talos
/// `website/content/v1.11/talos-guides/install/virtualized-platforms/proxmox.md`).
fn vm_params(
    inv: &Inventory,
    node_index: usize,
    vm: &ProxmoxVm,
    vmid: u32,
    volid: &str,
    sha256: &str,
) -> Vec<(&'static str, String)> {
    let node = &inv.nodes[node_index];
    let mut p = vec![
        ("vmid", vmid.to_string()),
        ("name", node.name.clone()),
        ("machine", "q35".into()),
        ("bios", "ovmf".into()),
        (
            "efidisk0",
            format!("{}:1,efitype=4m,pre-enrolled-keys=0", vm.storage),
        ),
        ("cpu", "host".into()),
        ("scsihw", "virtio-scsi-pci".into()),
    ];
    match vm.boot {
        VmBoot::Disk => p.extend([("scsi0", scsi0(vm, volid)), ("boot", "order=scsi0".into())]),
        // The node ISO boots first; Talos installs to the blank scsi0
        // (installDisk) when its config is applied, and from then on the
        // ISO's installer-less boot falls through to the disk
        // (qemu-server `boot` order, `ide2` media=cdrom; a new volume is
        // `STORAGE_ID:SIZE_IN_GiB`, sim/api-schemas/proxmox-ve.apidata.json
        // `scsi[n]`).
        VmBoot::Iso => p.extend([
            (
                "scsi0",
                format!("{}:{},discard=on,ssd=1", vm.storage, vm.disk_size),
            ),
            ("ide2", format!("{volid},media=cdrom")),
            ("boot", "order=ide2;scsi0".into()),
        ]),
    }
    p.extend([
        (
            "net0",
            match &node.mac {
                Some(mac) => format!(
                    "virtio={},bridge={}",
                    mac.to_string().to_uppercase(),
                    vm.bridge
                ),
                None => format!("virtio,bridge={}", vm.bridge),
            },
        ),
        ("serial0", "socket".into()),
        ("onboot", "1".into()),
        ("balloon", "0".into()),
        ("ostype", "l26".into()),
        ("cores", vm.cores.to_string()),
        ("memory", vm.memory.to_string()),
        ("description", description(inv, &node.name, volid, sha256)),
    ]);
    let agent = inv
        .image
        .extensions
        .iter()
        .chain(&node.extensions)
        .any(|e| e.rsplit('/').next() == Some("qemu-guest-agent"));
    if agent {
        p.push(("agent", "enabled=1".into()));
    }
    p
}

fn scsi0(vm: &ProxmoxVm, volid: &str) -> String {
    format!("{}:0,import-from={volid},discard=on,ssd=1", vm.storage)
}

/// The first line of every description imgbuild writes: a VM without it
/// was not made by imgbuild and is never started or changed.
const MANAGED: &str = "Talos node image managed by imgbuild";

/// The VM's description records whose VM it is (cluster and node: the name
/// alone may be anyone's) and the volume it was made from (the config shows
/// only the VM's own copy of the disk).
fn description(inv: &Inventory, node: &str, volid: &str, sha256: &str) -> String {
    format!(
        "{MANAGED}\nimgbuild-cluster: {}\nimgbuild-node: {node}\nimgbuild-volume: {volid}\nimgbuild-sha256: {sha256}\n",
        inv.cluster.name
    )
}

/// The value of one `imgbuild-<key>: ` line of the description.
fn described(config: &Value, key: &str) -> Option<String> {
    let prefix = format!("imgbuild-{key}: ");
    config["description"]
        .as_str()?
        .lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .map(str::to_owned)
}

fn described_volume(config: &Value) -> Option<String> {
    described(config, "volume")
}

/// Whose VM a config is, by its description.
#[derive(Debug, PartialEq, Eq)]
enum Owner {
    /// imgbuild made it for this node of this cluster (or, before it
    /// recorded them, for a node of this name).
    Node,
    /// imgbuild did not make it (by hand, Terraform, …).
    NotImgbuild,
    /// imgbuild made it for another cluster's node, or another node.
    Other { cluster: String, node: String },
}

fn owner(config: &Value, cluster: &str, node: &str) -> Owner {
    let managed = config["description"]
        .as_str()
        .is_some_and(|d| d.lines().any(|l| l.trim_end() == MANAGED));
    if !managed {
        return Owner::NotImgbuild;
    }
    let c = described(config, "cluster");
    let n = described(config, "node");
    if c.as_deref().is_none_or(|c| c == cluster) && n.as_deref().is_none_or(|n| n == node) {
        Owner::Node
    } else {
        Owner::Other {
            cluster: c.unwrap_or_default(),
            node: n.unwrap_or_default(),
        }
    }
}

/// The node a UPID belongs to (its second field).
fn upid_node(upid: &str) -> Option<&str> {
    upid.split(':').nth(1).filter(|n| !n.is_empty())
}

/// An authenticated API at one endpoint.
struct Api {
    client: Client,
    /// For upload bodies only.
    uploads: reqwest::Client,
    base: String,
    auth: HeaderValue,
    retry: RetryPolicy,
}

impl Api {
    fn new(creds: &Credentials, retry: RetryPolicy) -> Result<Api, ProxmoxError> {
        let opts = net::HttpOptions {
            trust: creds.trust.clone(),
            timeout: Duration::from_secs(300),
            ..net::HttpOptions::default()
        };
        let client = net::http_client(&opts)?;
        let uploads = net::async_http_client(&opts)?;
        let mut auth = HeaderValue::from_str(&format!("PVEAPIToken={}", creds.token.expose()))
            .map_err(|_| {
                ProxmoxError::Setup(
                    "PROXMOX_VE_API_TOKEN holds characters a header cannot carry".into(),
                )
            })?;
        auth.set_sensitive(true);
        Ok(Api {
            client,
            uploads,
            base: creds.api.clone(),
            auth,
            retry,
        })
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Sends with retries and returns `data`. A 500 is not retried: pveproxy
    /// answers every `die` of a handler with it (a VM that exists, a storage
    /// that refuses), so it is an answer, not a busy server. Only a request
    /// that never reached the server, a busy proxy (502–504) or a rate limit
    /// is sent again, so no POST is repeated after it was acted on.
    fn call(&self, what: &str, make: &dyn Fn() -> RequestBuilder) -> Result<Value, ProxmoxError> {
        let auth = self.auth.clone();
        let resp = net::send(
            &self.retry,
            &|| make().header(reqwest::header::AUTHORIZATION, auth.clone()),
            &|e| match e {
                NetError::Status { status, .. } => matches!(status, 429 | 502..=504),
                NetError::Transfer { before_sending, .. } => *before_sending,
                _ => false,
            },
            &mut |_, _, _| {},
        )
        .map_err(|e| api_error(what, e))?;
        let body = net::read_limited(resp, 16 << 20).map_err(|e| api_error(what, e))?;
        let doc: Value = serde_json::from_slice(&body).map_err(|e| ProxmoxError::Api {
            what: what.to_owned(),
            message: format!("the reply is not JSON: {e}"),
        })?;
        Ok(doc.get("data").cloned().unwrap_or(Value::Null))
    }

    fn get(&self, what: &str, path: &str) -> Result<Value, ProxmoxError> {
        let url = self.url(path);
        self.call(what, &|| self.client.get(&url))
    }

    fn post(&self, what: &str, path: &str, form: &[(&str, String)]) -> Result<Value, ProxmoxError> {
        let url = self.url(path);
        self.call(what, &|| self.client.post(&url).form(form))
    }

    fn put(&self, what: &str, path: &str, form: &[(&str, String)]) -> Result<Value, ProxmoxError> {
        let url = self.url(path);
        self.call(what, &|| self.client.put(&url).form(form))
    }

    fn delete(&self, what: &str, path: &str) -> Result<Value, ProxmoxError> {
        let url = self.url(path);
        self.call(what, &|| self.client.delete(&url))
    }

    /// Waits for a task to stop; `OK` and `WARNINGS: n` are success.
    fn wait(&self, what: &str, data: &Value, opts: &PublishOptions) -> Result<(), ProxmoxError> {
        let Some(upid) = data.as_str() else {
            return Ok(()); // synchronous on this server version
        };
        let node = upid_node(upid).ok_or_else(|| ProxmoxError::Api {
            what: what.to_owned(),
            message: format!("{upid:?} is not a task ID"),
        })?;
        let path = format!("/nodes/{node}/tasks/{}", urlencode(upid));
        let start = Instant::now();
        loop {
            let st = self.get(what, &format!("{path}/status"))?;
            if st["status"] == "stopped" {
                let exit = st["exitstatus"].as_str().unwrap_or("").to_owned();
                if exit == "OK" || exit.starts_with("WARNINGS") {
                    return Ok(());
                }
                let log = self
                    .get(what, &format!("{path}/log?start=0&limit=500"))
                    .ok()
                    .and_then(|v| v.as_array().cloned())
                    .unwrap_or_default();
                let lines: Vec<String> = log
                    .iter()
                    .filter_map(|l| l["t"].as_str().map(str::to_owned))
                    .collect();
                let tail = lines[lines.len().saturating_sub(5)..].to_vec();
                return Err(ProxmoxError::Task {
                    what: what.to_owned(),
                    upid: upid.to_owned(),
                    exitstatus: exit,
                    log: tail,
                });
            }
            if start.elapsed() > opts.task_timeout {
                return Err(ProxmoxError::TaskTimeout {
                    what: what.to_owned(),
                    upid: upid.to_owned(),
                    timeout: opts.task_timeout,
                });
            }
            std::thread::sleep(opts.poll);
        }
    }
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// A failed call, with Proxmox's per-field `errors` spelled out.
fn api_error(what: &str, e: NetError) -> ProxmoxError {
    if e.status() == Some(401) {
        return ProxmoxError::Unauthorized;
    }
    let detail = e
        .body()
        .and_then(|b| serde_json::from_str::<Value>(b).ok())
        .map(|doc| {
            let mut parts: Vec<String> = Vec::new();
            if let Some(m) = doc["message"].as_str() {
                parts.push(m.trim().to_owned());
            }
            if let Some(errs) = doc["errors"].as_object() {
                for (k, v) in errs {
                    parts.push(format!(
                        "{k}: {}",
                        v.as_str().unwrap_or(&v.to_string()).trim()
                    ));
                }
            }
            parts.join("; ")
        });
    match (detail, e.status()) {
        (Some(d), Some(status)) if !d.is_empty() => ProxmoxError::Api {
            what: what.to_owned(),
            message: format!("HTTP {status}: {d}"),
        },
        _ => ProxmoxError::Api {
            what: what.to_owned(),
            message: e.to_string(),
        },
    }
}

/// What publishing and planning both start from, read-only: the checked
/// API, the storage's import volumes with their sizes, and the node's VMs
/// (when there are VMs to make).
fn survey(
    settings: &ProxmoxSettings,
    creds: &Credentials,
    opts: &PublishOptions,
    content: &'static str,
) -> Result<(Api, BTreeMap<String, u64>, Value), ProxmoxError> {
    let api = Api::new(creds, opts.retry)?;
    preflight(&api, settings, content)?;
    let node = &settings.node;
    let listed = api.get(
        "listing storage",
        &format!(
            "/nodes/{node}/storage/{}/content?content={content}",
            settings.storage
        ),
    )?;
    let stored: BTreeMap<String, u64> = listed
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| Some((v["volid"].as_str()?.to_owned(), v["size"].as_u64()?)))
        .collect();
    let vms = match &settings.vm {
        Some(_) => api.get("listing VMs", &format!("/nodes/{node}/qemu"))?,
        None => Value::Null,
    };
    Ok((api, stored, vms))
}

/// Publishes `images` (built, verified) to the target in `settings`.
/// Preflight problems fail the whole run before a byte is uploaded; after
/// that each node succeeds or fails on its own.
pub fn publish(
    inv: &Inventory,
    settings: &ProxmoxSettings,
    creds: &Credentials,
    images: &[PublishImage],
    opts: &PublishOptions,
    observer: &dyn Observer,
) -> Result<Vec<Result<NodePublished, ProxmoxError>>, ProxmoxError> {
    let (api, stored, vms) = survey(settings, creds, opts, content_for(inv.image.format))?;
    Ok(images
        .iter()
        .map(|img| {
            publish_node(&api, inv, settings, &stored, &vms, img, opts, observer).map_err(|e| {
                match e {
                    e @ ProxmoxError::Node { .. } => e,
                    e => ProxmoxError::Node {
                        node: img.node.clone(),
                        message: e.to_string(),
                    },
                }
            })
        })
        .collect())
}

/// The token works, the node exists, the storage takes `import` (and, for
/// VMs, the VM storage takes `images`): checked before anything is sent.
fn preflight(api: &Api, s: &ProxmoxSettings, content: &str) -> Result<(), ProxmoxError> {
    api.get("checking the API token", "/version")?;
    let nodes = api.get("listing nodes", "/nodes")?;
    let names: Vec<&str> = nodes
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| n["node"].as_str())
        .collect();
    if !names.contains(&s.node.as_str()) {
        return Err(ProxmoxError::Setup(format!(
            "publish.proxmox.node: the cluster has no node {:?} (it has: {})",
            s.node,
            names.join(", ")
        )));
    }
    let has = |content: &str, storage: &str| -> Result<bool, ProxmoxError> {
        let list = api.get(
            "listing storages",
            &format!("/nodes/{}/storage?content={content}&enabled=1", s.node),
        )?;
        Ok(list
            .as_array()
            .into_iter()
            .flatten()
            .any(|st| st["storage"] == storage))
    };
    if content == "iso" && !has("iso", &s.storage)? {
        return Err(ProxmoxError::Setup(format!(
            "publish.proxmox.storage: storage {:?} on node {:?} does not hold ISO images (content `iso`); \
             enable it under Datacenter → Storage → {} → Content: ISO image",
            s.storage, s.node, s.storage
        )));
    }
    if content == "import" && !has("import", &s.storage)? {
        return Err(ProxmoxError::Setup(format!(
            "publish.proxmox.storage: storage {:?} on node {:?} is not enabled for the `import` content type. \
             Enable it under Datacenter → Storage → {} → Content: Import (Proxmox VE 8.4 or later; \
             file-based storages only: dir, NFS, CIFS, CephFS, BTRFS)",
            s.storage, s.node, s.storage
        )));
    }
    if let Some(vm) = &s.vm
        && !has("images", &vm.storage)?
    {
        return Err(ProxmoxError::Setup(format!(
            "publish.proxmox.vm.storage: storage {:?} on node {:?} does not hold VM disks (content `images`)",
            vm.storage, s.node
        )));
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn publish_node(
    api: &Api,
    inv: &Inventory,
    s: &ProxmoxSettings,
    stored: &BTreeMap<String, u64>,
    vms: &Value,
    img: &PublishImage,
    opts: &PublishOptions,
    observer: &dyn Observer,
) -> Result<NodePublished, ProxmoxError> {
    let node_err = |message: String| ProxmoxError::Node {
        node: img.node.clone(),
        message,
    };
    let file = volume_file(
        &inv.cluster.name,
        &img.node,
        &inv.cluster.talos_version,
        &img.sha256,
        img.format,
    );
    let volid = format!("{}:{}/{file}", s.storage, content_for(img.format));
    let uploaded = if stored.get(&volid) == Some(&img.size) {
        observer.event(
            &img.node,
            &Event::AlreadyStored {
                volid: volid.clone(),
            },
        );
        false
    } else {
        upload(api, s, img, &file, &volid, opts, observer)?;
        true
    };
    let mut out = NodePublished {
        node: img.node.clone(),
        volid: volid.clone(),
        sha256: img.sha256.clone(),
        uploaded,
        vmid: None,
        inventory_vmid: None,
        vm: None,
        started: false,
    };
    let Some(vm) = &s.vm else {
        return Ok(out);
    };
    let index = inv
        .nodes
        .iter()
        .position(|n| n.name == img.node)
        .ok_or_else(|| node_err("not in the inventory".into()))?;
    if vm.boot == VmBoot::Disk && img.size > u64::from(vm.disk_size) << 30 {
        return Err(node_err(format!(
            "the image ({} bytes) is larger than publish.proxmox.vm.diskSize ({} GiB)",
            img.size, vm.disk_size
        )));
    }
    let pve = &s.node;
    let place = place(api, inv, pve, vms, index)?;
    let vmid = place.vmid;
    out.vmid = Some(vmid);
    out.inventory_vmid = place.inventory_vmid;
    if let Some(inventory_vmid) = place.inventory_vmid {
        observer.event(
            &img.node,
            &Event::VmFound {
                vmid,
                inventory_vmid,
            },
        );
    }
    let base = format!("/nodes/{pve}/qemu/{vmid}");
    let running = match place.existing {
        None => {
            let params = vm_params(inv, index, vm, vmid, &volid, &img.sha256);
            let task = api.post("creating VM", &format!("/nodes/{pve}/qemu"), &params)?;
            api.wait(&format!("creating VM {vmid}"), &task, opts)?;
            if vm.boot == VmBoot::Disk {
                resize(api, &base, vm, opts)?;
            }
            observer.event(&img.node, &Event::VmCreated { vmid });
            out.vm = Some(VmChange::Created);
            false
        }
        Some((running, config)) => {
            let current = described_volume(&config);
            match vm_verdict(current.as_deref(), &volid, opts.replace_disk) {
                VmChange::Unchanged => {
                    observer.event(&img.node, &Event::VmUnchanged { vmid });
                    out.vm = Some(VmChange::Unchanged);
                }
                VmChange::Outdated => {
                    let running_image =
                        current.unwrap_or_else(|| "an image imgbuild did not record".into());
                    observer.event(
                        &img.node,
                        &Event::VmOutdated {
                            vmid,
                            running: running_image,
                        },
                    );
                    out.vm = Some(VmChange::Outdated);
                }
                VmChange::Created | VmChange::Updated if vm.boot == VmBoot::Iso => {
                    // The new ISO goes into the cdrom drive; the disk Talos
                    // installed to stays.
                    let desc = description(inv, &img.node, &volid, &img.sha256);
                    api.put(
                        "attaching the node ISO",
                        &format!("{base}/config"),
                        &[
                            ("ide2", format!("{volid},media=cdrom")),
                            ("description", desc),
                        ],
                    )?;
                    out.vm = Some(VmChange::Updated);
                }
                VmChange::Created | VmChange::Updated => {
                    let old = config["scsi0"].as_str().map(drive_volume);
                    let disk = NewDisk {
                        volid: &volid,
                        description: &description(inv, &img.node, &volid, &img.sha256),
                        replaces: old,
                    };
                    replace_disk(api, &base, vm, vmid, &disk, running, opts)?;
                    observer.event(&img.node, &Event::DiskReplaced { vmid });
                    out.vm = Some(VmChange::Updated);
                    return start_if_wanted(
                        api, &base, vm, vmid, false, opts, observer, &img.node, out,
                    );
                }
            }
            running
        }
    };
    start_if_wanted(
        api, &base, vm, vmid, running, opts, observer, &img.node, out,
    )
}

/// The volume of a drive string (`local-lvm:vm-300-disk-1,size=10G`).
fn drive_volume(drive: &str) -> &str {
    drive.split(',').next().unwrap_or_default()
}

/// A listed VM's vmid (a number, or a string on some versions).
fn listed_id(v: &Value) -> Option<u32> {
    match &v["vmid"] {
        Value::Number(n) => n.as_u64().and_then(|n| u32::try_from(n).ok()),
        Value::String(s) => s.parse().ok(),
        _ => None,
    }
}

/// Where a node's VM is, or is to be made.
struct Placement {
    vmid: u32,
    /// The vmid the inventory gives (`firstId` + position) when the node's
    /// VM was found under another.
    inventory_vmid: Option<u32>,
    /// The VM when it exists: whether it runs, and its config.
    existing: Option<(bool, Value)>,
}

/// Finds a node's VM by what it is, not where the list puts it: the VM
/// named as the node whose description says imgbuild made it for this node
/// of this cluster. Such a VM under another vmid than the computed one is
/// kept (`firstId` + position assigns IDs once; inserting a node shifts
/// them) and named with both IDs; under another vmid than a pinned `vmid`
/// it is an error. Never a second VM for a node, and never a VM imgbuild
/// did not make: a VM of the node's name without imgbuild's description is
/// neither started nor changed, nor does the node get another VM beside it.
fn place(
    api: &Api,
    inv: &Inventory,
    pve: &str,
    vms: &Value,
    index: usize,
) -> Result<Placement, ProxmoxError> {
    let node = &inv.nodes[index];
    let err = |message: String| ProxmoxError::Node {
        node: node.name.clone(),
        message,
    };
    let wanted = inv
        .vmid(index)
        .ok_or_else(|| err("no vmid (set publish.proxmox.vm.firstId or the node's vmid)".into()))?;
    let listed: Vec<(u32, &Value)> = vms
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| Some((listed_id(v)?, v)))
        .collect();
    let mut mine = Vec::new();
    let mut foreign = Vec::new();
    for &(id, v) in listed.iter().filter(|(_, v)| v["name"] == *node.name) {
        let config = api.get(
            "reading VM config",
            &format!("/nodes/{pve}/qemu/{id}/config"),
        )?;
        match owner(&config, &inv.cluster.name, &node.name) {
            Owner::Node => mine.push((id, v["status"] == "running", config)),
            other => foreign.push((id, other)),
        }
    }
    if mine.len() > 1 {
        let ids: Vec<String> = mine.iter().map(|(id, _, _)| id.to_string()).collect();
        return Err(err(format!(
            "{pve} has {} VMs made by imgbuild for this node ({}); imgbuild never picks one: remove the extra ones (qm destroy)",
            ids.len(),
            ids.join(", ")
        )));
    }
    if let Some((id, running, config)) = mine.pop() {
        let inventory_vmid = match (id == wanted, node.vmid.is_some()) {
            (true, _) => None,
            (false, true) => {
                return Err(err(format!(
                    "its VM on {pve} is vmid {id}, but nodes[{index}].vmid is {wanted}; imgbuild never moves a VM nor makes a second one: set vmid: {id}, or remove VM {id} to have the node's VM made as {wanted}"
                )));
            }
            (false, false) => Some(wanted),
        };
        return Ok(Placement {
            vmid: id,
            inventory_vmid,
            existing: Some((running, config)),
        });
    }
    if let Some((id, why)) = foreign.first() {
        let why = match why {
            Owner::Other { cluster, node } => {
                format!("imgbuild made it for node {node:?} of cluster {cluster:?}")
            }
            _ => "imgbuild did not make it (its description has no imgbuild record)".into(),
        };
        return Err(err(format!(
            "VM {id} on {pve} is named {:?}, but {why}; imgbuild never starts or changes such a VM, nor makes a second {:?} beside it: rename or remove VM {id}",
            node.name, node.name
        )));
    }
    if let Some((_, v)) = listed.iter().find(|(id, _)| *id == wanted) {
        let name = v["name"].as_str().unwrap_or("");
        return Err(err(format!(
            "vmid {wanted} on {pve} belongs to VM {name:?}, not to this node; imgbuild never overwrites another VM (pin another vmid on the node, or change firstId)"
        )));
    }
    Ok(Placement {
        vmid: wanted,
        inventory_vmid: None,
        existing: None,
    })
}

/// What an existing VM that boots `current` (as its description records)
/// gets when it should boot `volid`: nothing, or its disk replaced when
/// `replace` allows (else it is left outdated).
fn vm_verdict(current: Option<&str>, volid: &str, replace: bool) -> VmChange {
    match current {
        Some(c) if c == volid => VmChange::Unchanged,
        _ if replace => VmChange::Updated,
        _ => VmChange::Outdated,
    }
}

/// What publishing one node would do, read from the server with GETs only.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodePlan {
    pub node: String,
    /// The volume its image would be stored as; unknown until the image is
    /// built (the name holds its sha256).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub volid: Option<String>,
    /// Whether the image would be uploaded; unknown until it is built.
    pub upload: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vmid: Option<u32>,
    /// The vmid the inventory gives when the node's VM is another one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inventory_vmid: Option<u32>,
    /// What would happen to its VM: `created` for a new one; unknown for an
    /// existing VM while the image is not built.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vm: Option<VmChange>,
    /// Whether the VM would be started.
    pub start: bool,
}

/// The dry run of [`publish`]: for each node (its image when built) what
/// would be uploaded, created and started. Sends only GETs.
pub fn plan(
    inv: &Inventory,
    settings: &ProxmoxSettings,
    creds: &Credentials,
    images: &[(String, Option<PublishImage>)],
    opts: &PublishOptions,
) -> Result<Vec<Result<NodePlan, ProxmoxError>>, ProxmoxError> {
    let (api, stored, vms) = survey(settings, creds, opts, content_for(inv.image.format))?;
    let pve = &settings.node;
    let plan_node = |node: &str, img: Option<&PublishImage>| -> Result<NodePlan, ProxmoxError> {
        let volid = img.map(|img| {
            let file = volume_file(
                &inv.cluster.name,
                node,
                &inv.cluster.talos_version,
                &img.sha256,
                img.format,
            );
            format!("{}:{}/{file}", settings.storage, content_for(img.format))
        });
        let upload = img
            .zip(volid.as_ref())
            .map(|(img, volid)| stored.get(volid) != Some(&img.size));
        let mut out = NodePlan {
            node: node.to_owned(),
            volid,
            upload,
            vmid: None,
            inventory_vmid: None,
            vm: None,
            start: false,
        };
        let Some(vm) = &settings.vm else {
            return Ok(out);
        };
        let index = inv
            .nodes
            .iter()
            .position(|n| n.name == node)
            .ok_or_else(|| ProxmoxError::Node {
                node: node.to_owned(),
                message: "not in the inventory".into(),
            })?;
        let place = place(&api, inv, pve, &vms, index)?;
        out.vmid = Some(place.vmid);
        out.inventory_vmid = place.inventory_vmid;
        match place.existing {
            None => {
                out.vm = Some(VmChange::Created);
                out.start = vm.start;
            }
            Some((running, config)) => {
                if let Some(volid) = &out.volid {
                    let verdict = vm_verdict(
                        described_volume(&config).as_deref(),
                        volid,
                        opts.replace_disk,
                    );
                    out.vm = Some(verdict);
                    out.start = vm.start && (!running || verdict == VmChange::Updated);
                } else {
                    out.start = vm.start && !running;
                }
            }
        }
        Ok(out)
    };
    Ok(images
        .iter()
        .map(|(node, img)| plan_node(node, img.as_ref()))
        .collect())
}

#[allow(clippy::too_many_arguments)]
fn start_if_wanted(
    api: &Api,
    base: &str,
    vm: &ProxmoxVm,
    vmid: u32,
    running: bool,
    opts: &PublishOptions,
    observer: &dyn Observer,
    node: &str,
    mut out: NodePublished,
) -> Result<NodePublished, ProxmoxError> {
    if vm.start && !running {
        let task = api.post("starting VM", &format!("{base}/status/start"), &[])?;
        api.wait(&format!("starting VM {vmid}"), &task, opts)?;
        observer.event(node, &Event::VmStarted { vmid });
        out.started = true;
    }
    Ok(out)
}

fn resize(
    api: &Api,
    base: &str,
    vm: &ProxmoxVm,
    opts: &PublishOptions,
) -> Result<(), ProxmoxError> {
    let task = api.put(
        "growing the disk",
        &format!("{base}/resize"),
        &[
            ("disk", "scsi0".into()),
            ("size", format!("{}G", vm.disk_size)),
        ],
    )?;
    api.wait("growing the disk", &task, opts)
}

/// The disk a VM gets in place of its `scsi0`.
struct NewDisk<'a> {
    /// The import volume.
    volid: &'a str,
    /// The VM's description that records it.
    description: &'a str,
    /// The volume `scsi0` holds now.
    replaces: Option<&'a str>,
}

/// Stop, import the new volume as `scsi0`, delete the old disk, grow it;
/// the caller starts the VM again. qemu-server parks the old volume as an
/// `unusedN` entry, and deleting an `unusedN` frees its volume
/// (src/PVE/API2/Qemu.pm `update_vm_api`, src/PVE/QemuServer.pm
/// `try_deallocate_drive`): only the entry holding the old `scsi0` is
/// deleted, never a disk the user parked on the VM.
fn replace_disk(
    api: &Api,
    base: &str,
    vm: &ProxmoxVm,
    vmid: u32,
    disk: &NewDisk,
    running: bool,
    opts: &PublishOptions,
) -> Result<(), ProxmoxError> {
    if running {
        let task = api.post("stopping VM", &format!("{base}/status/stop"), &[])?;
        api.wait(&format!("stopping VM {vmid}"), &task, opts)?;
    }
    let task = api.post(
        "importing the new disk",
        &format!("{base}/config"),
        &[
            ("scsi0", scsi0(vm, disk.volid)),
            ("description", disk.description.to_owned()),
        ],
    )?;
    api.wait(
        &format!("importing the new disk into VM {vmid}"),
        &task,
        opts,
    )?;
    let config = api.get("reading VM config", &format!("{base}/config"))?;
    let unused: Vec<String> = config
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(k, v)| {
            k.starts_with("unused")
                && disk
                    .replaces
                    .is_some_and(|old| v.as_str().map(drive_volume) == Some(old))
        })
        .map(|(k, _)| k.clone())
        .collect();
    if !unused.is_empty() {
        let task = api.post(
            "deleting the old disk",
            &format!("{base}/config"),
            &[("delete", unused.join(","))],
        )?;
        api.wait(&format!("deleting the old disk of VM {vmid}"), &task, opts)?;
    }
    resize(api, base, vm, opts)
}

/// Streams the image file as the multipart body (constant memory), waits
/// for the server's task (checksum, `qemu-img info`, copy), and retries a
/// broken transfer from the start. A failed upload leaves no volume behind.
fn upload(
    api: &Api,
    s: &ProxmoxSettings,
    img: &PublishImage,
    file_name: &str,
    volid: &str,
    opts: &PublishOptions,
    observer: &dyn Observer,
) -> Result<(), ProxmoxError> {
    let what = format!("uploading {file_name}");
    let url = api.url(&format!("/nodes/{}/storage/{}/upload", s.node, s.storage));
    let mut attempt = 0;
    loop {
        observer.event(
            &img.node,
            &Event::Uploading {
                volid: volid.to_owned(),
                size: img.size,
            },
        );
        let sent = send_upload(api, &url, img, file_name, &|n| observer.sent(&img.node, n));
        match sent {
            Ok(body) => {
                let doc: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                let result = api.wait(&what, &doc["data"], opts);
                if result.is_err() {
                    discard_volume(api, s, volid);
                }
                return result.map(|()| {
                    observer.event(
                        &img.node,
                        &Event::Uploaded {
                            volid: volid.to_owned(),
                        },
                    )
                });
            }
            Err(e) if e.retryable() && e.status().is_none() && attempt < opts.upload_retries => {
                attempt += 1;
                observer.event(
                    &img.node,
                    &Event::UploadRetry {
                        attempt,
                        why: e.to_string(),
                    },
                );
                std::thread::sleep(opts.retry.delay(attempt, None));
            }
            Err(e) => {
                let err = api_error(&what, e);
                return Err(match err {
                    ProxmoxError::Api { what, message } if attempt > 0 => ProxmoxError::Api {
                        what,
                        message: format!("{message} (after {} attempts)", attempt + 1),
                    },
                    other => other,
                });
            }
        }
    }
}

/// One upload attempt on a runtime of its own (the publisher is blocking
/// code), telling `progress` how many bytes have left; returns the reply
/// body.
fn send_upload(
    api: &Api,
    url: &str,
    img: &PublishImage,
    file_name: &str,
    progress: &dyn Fn(u64),
) -> Result<Vec<u8>, NetError> {
    let local = |e: std::io::Error| NetError::Transfer {
        method: "reading".into(),
        url: img.path.display().to_string(),
        message: e.to_string(),
        before_sending: true,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(local)?;
    let sent = Arc::new(AtomicU64::new(0));
    let counter = sent.clone();
    let attempt = async {
        let file =
            tokio::fs::File::from_std(crate::io::open_regular(&img.path, false).map_err(local)?);
        let req = api
            .uploads
            .post(url)
            .header(reqwest::header::AUTHORIZATION, api.auth.clone())
            // The API deadline, plus the image at 256 KiB/s.
            .timeout(net::request_deadline() + Duration::from_secs(img.size >> 18))
            .multipart(upload_form(
                file,
                img.size,
                file_name,
                &img.sha256,
                content_for(img.format),
                counter,
            ));
        let resp = net::send_once_async(req).await?;
        net::read_limited_async(resp, 1 << 20, false).await
    };
    rt.block_on(async {
        tokio::pin!(attempt);
        let mut tick = tokio::time::interval(PROGRESS_EVERY);
        let mut told = 0;
        let mut tell = || {
            let now = sent.load(Ordering::Relaxed);
            if now != told {
                told = now;
                progress(now);
            }
        };
        loop {
            tokio::select! {
                result = &mut attempt => {
                    tell();
                    return result;
                }
                _ = tick.tick() => tell(),
            }
        }
    })
}

/// A body stream that counts the bytes the HTTP client has consumed: a
/// chunk counts once the client asks for the next one (hyper writes a
/// chunk out before it polls the body again), so the count follows the
/// bytes leaving, not the file being read ahead.
struct Counted<S> {
    inner: S,
    /// The size of the chunk last handed to the client, not yet counted.
    handed_out: u64,
    sent: Arc<AtomicU64>,
}

impl<S, B, E> futures_util::Stream for Counted<S>
where
    S: futures_util::Stream<Item = Result<B, E>> + Unpin,
    B: AsRef<[u8]>,
{
    type Item = Result<B, E>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        let this = &mut *self;
        let done = std::mem::take(&mut this.handed_out);
        this.sent.fetch_add(done, Ordering::Relaxed);
        let next = std::pin::Pin::new(&mut this.inner).poll_next(cx);
        if let std::task::Poll::Ready(Some(Ok(chunk))) = &next {
            this.handed_out = chunk.as_ref().len() as u64;
        }
        next
    }
}

#[cfg(test)]
mod counted {
    use super::*;
    use futures_util::StreamExt;

    /// A chunk counts only once the client comes back for the next one:
    /// the count trails what was read by exactly the chunk in flight.
    #[test]
    fn bytes_count_when_the_client_takes_the_next_chunk() {
        let chunks: Vec<Result<Vec<u8>, ()>> = vec![Ok(vec![0; 5]), Ok(vec![0; 7]), Ok(vec![0; 3])];
        let sent = Arc::new(AtomicU64::new(0));
        let mut body = Counted {
            inner: futures_util::stream::iter(chunks),
            handed_out: 0,
            sent: sent.clone(),
        };
        let mut seen = Vec::new();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            while body.next().await.is_some() {
                seen.push(sent.load(Ordering::Relaxed));
            }
        });
        assert_eq!(seen, [0, 5, 12]);
        assert_eq!(sent.load(Ordering::Relaxed), 15);
    }
}

/// How often an upload's progress is reported.
const PROGRESS_EVERY: Duration = Duration::from_millis(100);

/// Removes a volume an upload may have left half-checked; best effort,
/// since the upload's own error is what the user needs to see.
fn discard_volume(api: &Api, s: &ProxmoxSettings, volid: &str) {
    let path = format!(
        "/nodes/{}/storage/{}/content/{}",
        s.node,
        s.storage,
        urlencode(volid)
    );
    let _ = api.delete("removing a failed upload", &path);
}

#[cfg(test)]
mod tests;
