//! The bootstrap stage as library calls: the cluster's state dir (secrets,
//! talosconfig, rendered configs), where each node is reached and which one
//! gets etcd ([`Reach`]), and the run of the [`bootstrap`] state machine or
//! its dry run ([`survey`]). `imgbuild bootstrap` and `imgbuild up` both
//! call [`bootstrap`]; the CLI only turns flags into [`BootstrapOptions`] and
//! renders what comes back.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::bootstrap::{self, BootstrapError, Observer, Plan, PlannedNode};
use super::client::{self, NodeEndpoint, Probe};
use super::config::{self, ConfigError, PatchVars};
use super::kube::AdminKube;
use super::lock::{self, LockError, StateLock};
use super::remove::record;
use super::secrets::{SecretsBundle, SecretsError};
use super::status::{self, Differences};
use super::talosconfig::{Talosconfig, TalosconfigError};
use super::upgrade;
use crate::inventory::{Inventory, UnknownNode};
use crate::publish::Cancel;

/// Why the stage stopped before or during the run. Never quotes a secret.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    #[error("state dir {}", path.display())]
    StateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "node {node}: talosEndpoint {endpoint:?} must be an IP address or IP:port (host names are not resolved)"
    )]
    BadEndpoint { node: String, endpoint: String },
    #[error(
        "node {node}: no address or talosEndpoint, so imgbuild cannot reach its Talos API (a dhcp node needs address: its current lease, or talosEndpoint: IP or IP:port)"
    )]
    NoAddress { node: String },
    #[error("target override: {0}")]
    UnknownTarget(#[from] UnknownNode),
    #[error(transparent)]
    Secrets(#[from] SecretsError),
    #[error(transparent)]
    Talosconfig(#[from] TalosconfigError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Bootstrap(#[from] BootstrapError),
    #[error(transparent)]
    Lock(#[from] LockError),
    #[error("interrupted; run again to go on (every step is safe to repeat)")]
    Interrupted,
    /// Neither the SOPS file nor the state dir holds the cluster's
    /// secrets, and nothing asked for new ones.
    #[error(
        "no cluster secrets: neither {} nor {} exists (nothing was changed); make them with `imgbuild secrets gen` (then `imgbuild secrets encrypt --age …` to keep them in Git), or give --new-secrets for a new cluster (up, bootstrap)",
        sealed.display(),
        clear.display()
    )]
    NoSecrets { sealed: PathBuf, clear: PathBuf },
    /// `--new-secrets` where a node already runs a cluster's config: new
    /// secrets would make it foreign, and the run would fail only after
    /// making them.
    #[error(
        "--new-secrets makes a new cluster's secrets, but node {node} ({addr}) is already configured: it runs a cluster whose secrets are not here (neither {} nor {} exists; nothing was changed). Use that cluster's secrets (its secrets.sops.yaml with SOPS_AGE_KEY_FILE, or `imgbuild secrets gen --secrets FILE`), or reset the node to maintenance mode",
        sealed.display(),
        clear.display()
    )]
    NewSecretsForConfigured {
        node: String,
        addr: std::net::SocketAddr,
        sealed: PathBuf,
        clear: PathBuf,
    },
    /// The SOPS file and the state dir's `secrets.yaml` are two bundles.
    #[error(
        "two different cluster secrets: {} and {} (nothing was changed); keep one: delete {} if it is a stale copy, or encrypt it over the other (`imgbuild secrets encrypt --force --age …`) if it is the cluster's",
        sealed.display(),
        clear.display(),
        clear.display()
    )]
    SecretsDiffer { sealed: PathBuf, clear: PathBuf },
    /// The SOPS file could not be opened (no key, another recipient's key,
    /// tampered).
    #[error(
        "cluster secrets {}: cannot open them (nothing was changed); give a recipient's age key in SOPS_AGE_KEY_FILE (or SOPS_AGE_KEY)",
        path.display()
    )]
    Sealed {
        path: PathBuf,
        #[source]
        source: SecretsError,
    },
    /// A file in the SOPS file's place that is not SOPS-encrypted: secrets
    /// kept in clear beside a Git inventory.
    #[error(
        "cluster secrets {}: not SOPS-encrypted; secrets beside the inventory are kept encrypted (`imgbuild secrets encrypt --age …` writes them so)",
        path.display()
    )]
    SealedInClear { path: PathBuf },
    /// Something that is not a file where the SOPS file goes (a FIFO, a
    /// folder, a device): never taken for "no secrets yet".
    #[error(
        "cluster secrets {}: exists but is not a regular file (nothing was changed); put the cluster's secrets.sops.yaml there",
        path.display()
    )]
    SealedNotAFile { path: PathBuf },
    /// A node's schematic, to compare with the one it runs.
    #[error(transparent)]
    Schematic(#[from] crate::schematic::EmitError),
    /// `upgrades.json` cannot be read.
    #[error(transparent)]
    Record(#[from] upgrade::RecordError),
}

impl StageError {
    /// Whether the environment or the user's files are at fault (exit 2):
    /// no secrets, two bundles, a SOPS file without its key.
    pub fn is_usage(&self) -> bool {
        use crate::secrets::sops::SopsError;
        match self {
            StageError::NoSecrets { .. }
            | StageError::NewSecretsForConfigured { .. }
            | StageError::SecretsDiffer { .. }
            | StageError::SealedInClear { .. }
            | StageError::SealedNotAFile { .. } => true,
            // A SOPS bundle (committed, or in the state dir) this
            // environment has no key or tool for.
            StageError::Sealed { source, .. } | StageError::Secrets(source) => matches!(
                source,
                SecretsError::Sops(
                    SopsError::NoKey { .. } | SopsError::Keys { .. } | SopsError::NeedsSops { .. }
                )
            ),
            _ => false,
        }
    }
}

/// Where the cluster's secrets were read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SecretsSource {
    /// The SOPS file kept in Git (`cluster.secretsFile`, else
    /// `secrets.sops.yaml` beside the inventory): opened in memory, never
    /// copied in clear into the state dir.
    Sealed(PathBuf),
    /// The state dir's `secrets.yaml` (the laptop's file).
    Clear(PathBuf),
}

impl SecretsSource {
    /// The file.
    pub fn path(&self) -> &Path {
        match self {
            SecretsSource::Sealed(p) | SecretsSource::Clear(p) => p,
        }
    }
}

impl std::fmt::Display for SecretsSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SecretsSource::Sealed(p) => write!(f, "{} (SOPS)", p.display()),
            SecretsSource::Clear(p) => write!(f, "{}", p.display()),
        }
    }
}

/// The cluster's secrets and where they came from.
#[derive(Debug, Clone)]
pub struct Secrets {
    pub bundle: SecretsBundle,
    pub source: SecretsSource,
    /// Made now (`--new-secrets` on a cluster that had none).
    pub created: bool,
}

/// The SOPS file that holds the cluster's secrets when it exists: the one
/// `cluster.secretsFile` names, else `secrets.sops.yaml` beside the
/// inventory. `secrets encrypt` writes here by default.
pub fn sealed_path(inv: &Inventory) -> PathBuf {
    match &inv.cluster.secrets_file {
        Some(file) => inv.base_dir.join(file),
        None => inv.base_dir.join("secrets.sops.yaml"),
    }
}

/// The state dir `dir` (`--state-dir`) names, else the default beside the
/// inventory; made or not.
pub fn state_path(inv: &Inventory, dir: Option<&Path>) -> PathBuf {
    dir.map_or_else(|| config::default_state_dir(inv), Path::to_owned)
}

/// The cluster's secrets, found and opened without creating or writing
/// anything: the SOPS file ([`sealed_path`]) when it exists, else the
/// state dir's `secrets.yaml`, else None. Both present and different is
/// refused, naming both.
pub fn find_secrets(
    inv: &Inventory,
    state_dir: &Path,
) -> Result<Option<(SecretsBundle, SecretsSource)>, StageError> {
    let sealed = sealed_path(inv);
    let clear = state_dir.join("secrets.yaml");
    // A path that is there (a dangling link included) but no regular file
    // is refused: "missing" would advise new secrets.
    let there = std::fs::symlink_metadata(&sealed).is_ok();
    if there && !sealed.is_file() {
        return Err(StageError::SealedNotAFile { path: sealed });
    }
    if there {
        let text =
            crate::input::read_text(&sealed, crate::input::MAX_TEXT_FILE).map_err(|source| {
                StageError::Io {
                    path: sealed.clone(),
                    source,
                }
            })?;
        if !crate::secrets::sops::is_encrypted(&text) {
            return Err(StageError::SealedInClear { path: sealed });
        }
        let bundle = SecretsBundle::load(&sealed).map_err(|source| StageError::Sealed {
            path: sealed.clone(),
            source,
        })?;
        if clear.exists() && SecretsBundle::load(&clear)? != bundle {
            return Err(StageError::SecretsDiffer { sealed, clear });
        }
        return Ok(Some((bundle, SecretsSource::Sealed(sealed))));
    }
    if clear.exists() {
        return Ok(Some((
            SecretsBundle::load(&clear)?,
            SecretsSource::Clear(clear),
        )));
    }
    Ok(None)
}

/// Checks, before anything is made or changed, that a run has the
/// cluster's secrets: found and opened ([`find_secrets`]), or none yet and
/// `opts.new_secrets` (None then). Creates nothing.
pub fn secrets_ready(
    inv: &Inventory,
    opts: &BootstrapOptions,
) -> Result<Option<Secrets>, StageError> {
    let dir = state_path(inv, opts.state_dir.as_deref());
    match find_secrets(inv, &dir)? {
        Some((bundle, source)) => Ok(Some(Secrets {
            bundle,
            source,
            created: false,
        })),
        None if opts.new_secrets => {
            // New secrets are for new machines: a node that already asks
            // for a client certificate runs some cluster's config.
            let found = survey(inv, opts)?;
            let configured =
                found
                    .reach
                    .nodes
                    .iter()
                    .zip(&found.answers)
                    .find_map(|(n, a)| match (a, &n.endpoint) {
                        (Some(Probe::Configured), Some(e)) => Some((n.node.clone(), e.addr)),
                        _ => None,
                    });
            match configured {
                Some((node, addr)) => Err(StageError::NewSecretsForConfigured {
                    node,
                    addr,
                    sealed: sealed_path(inv),
                    clear: dir.join("secrets.yaml"),
                }),
                None => Ok(None),
            }
        }
        None => Err(no_secrets(inv, &dir)),
    }
}

fn no_secrets(inv: &Inventory, state_dir: &Path) -> StageError {
    StageError::NoSecrets {
        sealed: sealed_path(inv),
        clear: state_dir.join("secrets.yaml"),
    }
}

/// The folder holding one cluster's secrets and client files: 0700, each
/// file 0600. Opening it creates it.
#[derive(Debug, Clone)]
pub struct StateDir {
    /// Given by `--state-dir`, or the default beside the inventory.
    pub path: PathBuf,
    /// The secrets as [`StateDir::existing`] or [`secrets_ready`] opened
    /// them: a SOPS file is decrypted once per command.
    opened: Option<Secrets>,
}

/// What [`StateDir::save_secrets`] wrote.
#[derive(Debug, Clone)]
pub struct SavedSecrets {
    /// The state dir's `secrets.yaml`.
    pub path: PathBuf,
    /// Fields of the imported file imgbuild does not know (a newer
    /// talosctl's): ignored as talosctl ignores them, and not in `path`.
    pub ignored_fields: Vec<String>,
}

/// A talosconfig as [`StateDir::talosconfig`] left it.
#[derive(Debug, Clone)]
pub struct TalosconfigFile {
    /// Where it is, for the user's `TALOSCONFIG`.
    pub path: PathBuf,
    /// Its content, whose identity the bootstrap presents.
    pub config: Talosconfig,
    /// False when the file on disk still fitted and was kept.
    pub written: bool,
}

impl StateDir {
    /// `dir`, or `.talos/<cluster>/` beside the inventory, created 0700 (an
    /// existing one is tightened or refused, see [`config::ensure_private_dir`]).
    pub fn open(inv: &Inventory, dir: Option<&Path>) -> Result<StateDir, StageError> {
        let path = dir.map_or_else(|| config::default_state_dir(inv), Path::to_owned);
        config::ensure_private_dir(&path)
            .and_then(|()| crate::secrets::protect::ignore_in_git(&path))
            .map_err(|source| StageError::StateDir {
                path: path.clone(),
                source,
            })?;
        Ok(StateDir { path, opened: None })
    }

    /// The state dir of a cluster that exists, for the day-two commands:
    /// its secrets are found and opened ([`find_secrets`]) before anything
    /// is created, so a mistyped `--state-dir` or a missing age key stops
    /// here and never mints a new cluster identity.
    pub fn existing(inv: &Inventory, dir: Option<&Path>) -> Result<StateDir, StageError> {
        let path = state_path(inv, dir);
        let Some((bundle, source)) = find_secrets(inv, &path)? else {
            return Err(no_secrets(inv, &path));
        };
        let opened = Secrets {
            bundle,
            source,
            created: false,
        };
        Ok(StateDir::open(inv, Some(&path))?.with_opened(Some(opened)))
    }

    /// This state dir with the cluster's secrets already opened.
    fn with_opened(self, opened: Option<Secrets>) -> StateDir {
        StateDir { opened, ..self }
    }

    /// The talosctl-compatible bundle every cluster certificate comes from.
    pub fn secrets_path(&self) -> PathBuf {
        self.path.join("secrets.yaml")
    }

    /// The admin client configuration talosctl reads.
    pub fn talosconfig_path(&self) -> PathBuf {
        self.path.join("talosconfig")
    }

    /// Where the bootstrap leaves the admin kubeconfig.
    pub fn kubeconfig_path(&self) -> PathBuf {
        self.path.join("kubeconfig")
    }

    /// What `imgbuild upgrade` installed on each node ([`upgrade::Record`]).
    pub fn upgrades_path(&self) -> PathBuf {
        self.path.join("upgrades.json")
    }

    /// The cluster's secrets ([`find_secrets`]). None there: with `new`
    /// (`--new-secrets`) a new bundle is generated into `secrets.yaml`,
    /// else [`StageError::NoSecrets`]; nothing is ever generated silently.
    /// Concurrent callers on a fresh state dir agree: the first creates the
    /// bundle under a lock, the others load it.
    pub fn secrets(&self, inv: &Inventory, new: bool) -> Result<Secrets, StageError> {
        if let Some(opened) = &self.opened {
            return Ok(opened.clone());
        }
        let found = |created| {
            find_secrets(inv, &self.path).map(|found| {
                found.map(|(bundle, source)| Secrets {
                    bundle,
                    source,
                    created,
                })
            })
        };
        if let Some(secrets) = found(false)? {
            return Ok(secrets);
        }
        if !new {
            return Err(no_secrets(inv, &self.path));
        }
        let _lock = self.lock_secrets()?;
        if let Some(secrets) = found(false)? {
            return Ok(secrets);
        }
        let path = self.secrets_path();
        let bundle = SecretsBundle::generate()?;
        bundle.save(&path, false)?;
        Ok(Secrets {
            bundle,
            source: SecretsSource::Clear(path),
            created: true,
        })
    }

    /// Writes `secrets.yaml` from `import` (a `talosctl gen secrets` file) or
    /// freshly generated. An existing file is replaced only with `force`.
    pub fn save_secrets(
        &self,
        import: Option<&Path>,
        force: bool,
    ) -> Result<SavedSecrets, StageError> {
        let path = self.secrets_path();
        let _lock = self.lock_secrets()?;
        let (bundle, ignored_fields) = match import {
            Some(src) => SecretsBundle::read(src)?,
            None => (SecretsBundle::generate()?, Vec::new()),
        };
        bundle.save(&path, force)?;
        Ok(SavedSecrets {
            path,
            ignored_fields,
        })
    }

    /// Held while `secrets.yaml` is looked at and created.
    fn lock_secrets(&self) -> Result<std::fs::File, StageError> {
        let path = self.path.join(".secrets.lock");
        crate::atomic::lock(&path).map_err(|source| StageError::StateDir { path, source })
    }

    /// The state dir's `talosconfig` when it still fits `bundle`, else one
    /// made in memory and not written (secrets from SOPS: a client key is
    /// not left in clear on a runner). `written` is false either way.
    /// With the file it came from, None when made now.
    pub fn talosconfig_in_memory(
        &self,
        inv: &Inventory,
        bundle: &SecretsBundle,
    ) -> Result<(TalosconfigFile, Option<PathBuf>), StageError> {
        let path = self.talosconfig_path();
        if path.exists()
            && let Ok(existing) = Talosconfig::load(&path)
            && existing.is_current_for(inv, bundle)
        {
            let file = TalosconfigFile {
                path: path.clone(),
                config: existing,
                written: false,
            };
            return Ok((file, Some(path)));
        }
        let file = TalosconfigFile {
            path,
            config: Talosconfig::generate(inv, bundle)?,
            written: false,
        };
        Ok((file, None))
    }

    /// `talosconfig` for `inv`, rewritten only when `force` or when the file
    /// no longer fits (other CA or endpoints, admin certificate expiring).
    pub fn talosconfig(
        &self,
        inv: &Inventory,
        bundle: &SecretsBundle,
        force: bool,
    ) -> Result<TalosconfigFile, StageError> {
        let path = self.talosconfig_path();
        if !force
            && path.exists()
            && let Ok(existing) = Talosconfig::load(&path)
            && existing.is_current_for(inv, bundle)
        {
            return Ok(TalosconfigFile {
                path,
                config: existing,
                written: false,
            });
        }
        let config = Talosconfig::generate(inv, bundle)?;
        config.save(&path)?;
        Ok(TalosconfigFile {
            path,
            config,
            written: true,
        })
    }
}

/// What the bootstrap stage does. The inventory is passed beside it, as to
/// [`crate::build::build`].
#[derive(Debug, Clone, Default)]
pub struct BootstrapOptions {
    /// [default: `.talos/<cluster>/` beside the inventory]
    pub state_dir: Option<PathBuf>,
    /// A client identity to use instead of `<state dir>/talosconfig`; it must
    /// come from the state dir's secrets.
    pub talosconfig: Option<PathBuf>,
    /// Where to reach nodes whose address the inventory does not know or
    /// that answer elsewhere (a cloud's public IP), by node name. The
    /// target's server name becomes the node's address.
    pub targets: BTreeMap<String, NodeEndpoint>,
    /// Timeouts, polling, certificate pin.
    pub limits: bootstrap::Options,
    /// What `${NAME}` in patch files stands for.
    pub patch_vars: PatchVars,
    /// Stops the bootstrap (`up` on a target whose Ctrl-C is caught sets
    /// it; every step is safe to repeat, so a rerun goes on).
    pub cancel: Cancel,
    /// `--new-secrets`: make the cluster's secrets when it has none yet
    /// (a new cluster). Without it a run without secrets stops first.
    pub new_secrets: bool,
    /// `--lock-timeout`: how long [`lock_state_dir`] waits for a lock
    /// another run holds (until `cancel`), and who hears that it waits.
    pub lock_wait: lock::LockWait,
}

/// Everything made ready for the run, and what making it ready changed.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// Holds the secrets, talosconfig and (later) kubeconfig. Rendered
    /// configs hold secrets (and `${NAME}` values) in the clear, so they stay
    /// in memory; `imgbuild config --out` writes one when asked.
    pub state_dir: StateDir,
    /// What [`bootstrap::run`] works through; carries the rendered configs.
    pub plan: Plan,
    /// The talosconfig file whose identity the run uses; None when it was
    /// made in memory from SOPS secrets (a client key is not written in
    /// clear beside secrets kept sealed).
    pub talosconfig: Option<PathBuf>,
    /// Whether this call created `secrets.yaml`.
    pub secrets_created: bool,
    /// Where the secrets came from.
    pub secrets_source: SecretsSource,
    /// Whether this call wrote `<state dir>/talosconfig`.
    pub talosconfig_written: bool,
}

/// What one bootstrap stage did.
#[derive(Debug, Clone)]
pub struct Bootstrapped {
    /// The files and plan the run used.
    pub prepared: Prepared,
    /// What the run did to the nodes.
    pub outcome: bootstrap::BootstrapOutcome,
}

/// Readies a run without contacting any node: state dir, secrets,
/// talosconfig (checked against the secrets), every node's config rendered
/// in memory, and each node's target. A second call with the same inputs
/// writes nothing.
pub fn prepare(inv: &Inventory, opts: &BootstrapOptions) -> Result<Prepared, StageError> {
    // Found and opened before the state dir is made: a missing key or
    // missing secrets change nothing.
    let found = secrets_ready(inv, opts)?;
    let state_dir = StateDir::open(inv, opts.state_dir.as_deref())?.with_opened(found);
    prepare_in(inv, opts, state_dir)
}

/// [`prepare`] in a state dir [`StateDir::existing`] opened (its secrets
/// are not read again).
pub fn prepare_in(
    inv: &Inventory,
    opts: &BootstrapOptions,
    state_dir: StateDir,
) -> Result<Prepared, StageError> {
    for name in opts.targets.keys() {
        inv.node(name)?;
    }
    let Secrets {
        bundle,
        source,
        created: secrets_created,
    } = state_dir.secrets(inv, opts.new_secrets)?;
    // The file the identity is in; None: minted in memory, in no file.
    let (talosconfig, talosconfig_file) = match (&opts.talosconfig, &source) {
        (Some(path), _) => (
            TalosconfigFile {
                path: path.clone(),
                config: Talosconfig::load(path)?,
                written: false,
            },
            Some(path.clone()),
        ),
        (None, SecretsSource::Clear(_)) => {
            let file = state_dir.talosconfig(inv, &bundle, false)?;
            let path = file.path.clone();
            (file, Some(path))
        }
        (None, SecretsSource::Sealed(_)) => state_dir.talosconfig_in_memory(inv, &bundle)?,
    };
    talosconfig
        .config
        .check_matches(&bundle, &talosconfig.path, source.path())?;
    let identity = talosconfig
        .config
        .identity()
        .map_err(|source| TalosconfigError::Context {
            path: talosconfig.path.display().to_string(),
            source,
        })?;

    let mut nodes = Vec::new();
    for node in &inv.nodes {
        let (endpoint, address) = reach(node, opts)?;
        let text = config::machine_config(inv, node, &bundle, &opts.patch_vars)?;
        nodes.push(PlannedNode {
            name: node.name.clone(),
            role: node.role,
            address,
            endpoint,
            install_disk: node.install_disk.clone(),
            config: text.into_bytes(),
        });
    }
    // Secrets from SOPS leave no key in the state dir: the kubeconfig is
    // minted in memory for every read.
    let sealed = matches!(source, SecretsSource::Sealed(_));
    let plan = Plan {
        write_kubeconfig: !sealed,
        admin_kube: AdminKube::of(&inv.cluster.name, &inv.cluster.endpoint, &bundle),
        nodes,
        bootstrap_node: bootstrap_node(inv),
        endpoint: inv.cluster.endpoint.clone(),
        vip: inv.cluster.vip,
        kubernetes_endpoint: inv.cluster.kubernetes_endpoint.clone(),
        identity: Arc::new(identity),
        kubeconfig_path: state_dir.kubeconfig_path(),
    };
    Ok(Prepared {
        state_dir,
        plan,
        talosconfig_written: talosconfig.written,
        talosconfig: talosconfig_file,
        secrets_created,
        secrets_source: source,
    })
}

/// Takes the lock of the state dir `opts` names for `command`, one that
/// changes nodes (`up`, `bootstrap`, `upgrade`, `apply`), before it reads or
/// writes anything there. Read-only commands and dry runs do not take it.
/// Held until the returned value is dropped.
pub fn lock_state_dir(
    inv: &Inventory,
    opts: &BootstrapOptions,
    command: &str,
) -> Result<StateLock, StageError> {
    let state_dir = StateDir::open(inv, opts.state_dir.as_deref())?;
    Ok(lock::acquire(
        &state_dir.path,
        command,
        &opts.lock_wait,
        &opts.cancel,
    )?)
}

/// Where the bootstrap reaches `node`, and the address it has there: the
/// override, else its talosEndpoint or address. The one rule [`prepare`],
/// [`check`] and [`Reach::of`] follow.
fn reach(
    node: &crate::inventory::NodeSpec,
    opts: &BootstrapOptions,
) -> Result<(NodeEndpoint, IpAddr), StageError> {
    if let Some(t) = opts.targets.get(&node.name) {
        return Ok((t.clone(), t.server_name));
    }
    let t =
        NodeEndpoint::new(node.address, node.talos_endpoint.as_deref()).ok_or_else(
            || match &node.talos_endpoint {
                Some(endpoint) => StageError::BadEndpoint {
                    node: node.name.clone(),
                    endpoint: endpoint.clone(),
                },
                None => StageError::NoAddress {
                    node: node.name.clone(),
                },
            },
        )?;
    let address = node.address.unwrap_or(t.server_name);
    Ok((t, address))
}

/// The node etcd is bootstrapped on: the first control plane (see
/// [`Inventory::control_planes`]).
fn bootstrap_node(inv: &Inventory) -> Option<String> {
    inv.control_planes().next().map(|n| n.name.clone())
}

/// Where the bootstrap reaches one node.
#[derive(Debug, Clone)]
pub struct NodeReach {
    pub node: String,
    /// Its Talos API; None when the inventory gives no way in ([`check`]
    /// and [`prepare`] refuse that, naming the node).
    pub endpoint: Option<NodeEndpoint>,
    /// Its own address: the override's, else the inventory's, else the
    /// talosEndpoint's host.
    pub address: Option<IpAddr>,
}

/// What the bootstrap decides before it touches any node: where it reaches
/// each one and which one gets etcd bootstrapped. [`prepare`] plans by the
/// same rules; `up` reports these and its dry run probes them, so it never
/// decides them itself.
#[derive(Debug, Clone)]
pub struct Reach {
    /// In inventory order.
    pub nodes: Vec<NodeReach>,
    /// The first control plane.
    pub bootstrap_node: Option<String>,
}

impl Reach {
    /// Reads nothing and fails for no node: a node without a way in is
    /// left without an endpoint here, for [`check`] or [`prepare`] to name.
    pub fn of(inv: &Inventory, opts: &BootstrapOptions) -> Reach {
        let nodes = inv
            .nodes
            .iter()
            .map(|node| {
                let (endpoint, address) = match reach(node, opts) {
                    Ok((endpoint, address)) => (Some(endpoint), Some(address)),
                    Err(_) => (None, node.address),
                };
                NodeReach {
                    node: node.name.clone(),
                    endpoint,
                    address,
                }
            })
            .collect();
        Reach {
            nodes,
            bootstrap_node: bootstrap_node(inv),
        }
    }
}

/// What a bootstrap would find, found without changing anything.
#[derive(Debug, Clone)]
pub struct Survey {
    pub reach: Reach,
    /// Per node, in the order of `reach.nodes`, how its Talos API answered
    /// a TLS handshake; None when it did not (port closed, no TLS answer,
    /// no way in).
    pub answers: Vec<Option<Probe>>,
}

/// The dry run of [`bootstrap`]: one TLS handshake per node, all at once,
/// without a client certificate or any API call. A node in maintenance
/// mode would get its config, a configured one nothing.
pub fn survey(inv: &Inventory, opts: &BootstrapOptions) -> Result<Survey, StageError> {
    let reach = Reach::of(inv, opts);
    let timeout = opts.limits.call_timeout.min(Duration::from_secs(3));
    let probes = reach.nodes.iter().map(|n| async move {
        match &n.endpoint {
            Some(endpoint) => client::probe(endpoint, timeout).await.ok(),
            None => None,
        }
    });
    let answers = runtime()?.block_on(futures_util::future::join_all(probes));
    Ok(Survey { reach, answers })
}

/// What [`check`] found: nothing is wrong with the configs or the reach.
#[derive(Debug, Clone)]
pub struct Checked {
    /// Where each node is reached, by node; None where the target reports
    /// it later (Hetzner servers, at their public IP).
    pub reach: Vec<(String, Option<NodeEndpoint>)>,
    /// Whether the configs were rendered with a throwaway bundle (the
    /// state dir has no secrets yet).
    pub throwaway_secrets: bool,
    /// `${NAME}`s not set, rendered as placeholders (only when the options'
    /// [`PatchVars::comparing_unset`] asked for it).
    pub unset: Vec<String>,
}

/// The checks a run would otherwise fail only after machines exist: every
/// node's config rendered (patches, `${NAME}`s, schema) and every node's
/// way in resolved. Writes nothing: the state dir's secrets when it has
/// them, else a throwaway bundle kept in memory.
pub fn check(inv: &Inventory, opts: &BootstrapOptions) -> Result<Checked, StageError> {
    for name in opts.targets.keys() {
        inv.node(name)?;
    }
    let dir = state_path(inv, opts.state_dir.as_deref());
    // Configs render alike with any bundle: a SOPS file this environment
    // has no key for is checked with a throwaway one (`validate` in a CI
    // job without the key); a run stops on it in [`secrets_ready`].
    let found = match find_secrets(inv, &dir) {
        Err(e @ StageError::Sealed { .. }) if e.is_usage() => None,
        found => found?,
    };
    let (bundle, throwaway_secrets) = match found {
        Some((bundle, _)) => (bundle, false),
        None => (SecretsBundle::throwaway()?, true),
    };
    // Hetzner servers are reached at the public IP the API reports.
    let reported = inv.publish.hcloud().is_some_and(|h| h.servers.is_some());
    let mut reach_of = Vec::new();
    let mut unset: Vec<String> = Vec::new();
    for node in &inv.nodes {
        let text = config::machine_config(inv, node, &bundle, &opts.patch_vars)?;
        for name in config::unset_in(&text) {
            if !unset.contains(&name) {
                unset.push(name);
            }
        }
        let target = if reported && !opts.targets.contains_key(&node.name) {
            None
        } else {
            Some(reach(node, opts)?.0)
        };
        reach_of.push((node.name.clone(), target));
    }
    Ok(Checked {
        reach: reach_of,
        throwaway_secrets,
        unset,
    })
}

/// Every node's machine config, by node, for machines that take it at
/// creation (Hetzner `user_data`) before anyone knows their address: the
/// secrets and configs [`prepare`] would use (rendered in memory alike).
pub fn machine_configs(
    inv: &Inventory,
    opts: &BootstrapOptions,
) -> Result<Vec<(String, String)>, StageError> {
    let found = secrets_ready(inv, opts)?;
    let state_dir = StateDir::open(inv, opts.state_dir.as_deref())?.with_opened(found);
    let bundle = state_dir.secrets(inv, opts.new_secrets)?.bundle;
    inv.nodes
        .iter()
        .map(|node| {
            let text = config::machine_config(inv, node, &bundle, &opts.patch_vars)?;
            Ok((node.name.clone(), text))
        })
        .collect()
}

/// The whole stage: [`prepare`], then apply, bootstrap etcd once and wait
/// for health ([`bootstrap::run`] on a runtime of its own), reporting
/// progress to `observer`. Idempotent: on a healthy cluster it applies
/// nothing and bootstraps nothing.
pub fn bootstrap(
    inv: &Inventory,
    opts: &BootstrapOptions,
    observer: &dyn Observer,
) -> Result<Bootstrapped, StageError> {
    let prepared = prepare(inv, opts)?;
    let outcome = runtime()?.block_on(async {
        tokio::select! {
            done = bootstrap::run(&prepared.plan, &opts.limits, observer) => Ok(done?),
            () = opts.cancel.cancelled() => Err(StageError::Interrupted),
        }
    });
    let outcome = outcome.map_err(|e| match e {
        StageError::Bootstrap(e) => {
            StageError::Bootstrap(naming_secrets(e, &prepared.secrets_source))
        }
        e => e,
    })?;
    // What is on the nodes now, for read-only commands run without it.
    let dir = &prepared.state_dir.path;
    config::Fingerprints::record(dir, inv, &opts.patch_vars).map_err(|source| StageError::Io {
        path: config::Fingerprints::path(dir),
        source,
    })?;
    // The nodes of record: a node later gone from the inventory is removed.
    record::record_nodes(dir, &prepared.plan, &opts.limits).map_err(|source| StageError::Io {
        path: record::NodesRecord::path(dir),
        source,
    })?;
    Ok(Bootstrapped { prepared, outcome })
}

/// A node that answers to another CA: the hint names the secrets in use.
fn naming_secrets(e: BootstrapError, source: &SecretsSource) -> BootstrapError {
    match e {
        BootstrapError::Stuck {
            node,
            state,
            detail,
            hint,
        } => BootstrapError::Stuck {
            node,
            state,
            detail,
            hint: bootstrap::foreign_hint(&hint, &source.to_string()),
        },
        BootstrapError::Nodes {
            failed,
            etcd,
            settled,
        } => BootstrapError::Nodes {
            failed: failed
                .into_iter()
                .map(|e| naming_secrets(e, source))
                .collect(),
            etcd,
            settled,
        },
        e => e,
    }
}

/// How the cluster a [`bootstrap`] just brought up differs from the
/// inventory (version, schematic, config), as `imgbuild status` would
/// flag it: read over the plan that run used (its endpoints, its configs).
pub fn drift(
    inv: &Inventory,
    prepared: &Prepared,
    opts: &BootstrapOptions,
) -> Result<Differences, StageError> {
    let wanted = upgrade::wanted(inv)?;
    let record = upgrade::Record::load(&prepared.state_dir.upgrades_path())?;
    let fingerprints = config::Fingerprints::load(&prepared.state_dir.path);
    let plan = &prepared.plan;
    Ok(runtime()?.block_on(status::drift(
        plan,
        &wanted,
        &record,
        &fingerprints,
        &opts.limits,
    )))
}

/// The runtime [`bootstrap`], [`survey`] and [`drift`] run their node
/// calls on.
fn runtime() -> Result<tokio::runtime::Runtime, StageError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| BootstrapError::Local(format!("cannot start the async runtime: {e}")).into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::talos::secrets::tests::bundle;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn atlas() -> Inventory {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/atlas/cluster.yaml");
        Inventory::load(&path).unwrap()
    }

    fn mode(path: &Path) -> u32 {
        std::fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    /// Options for a state dir under `root` holding the shared test bundle
    /// as its secrets (generating one per test is slow).
    fn seeded(root: &Path) -> BootstrapOptions {
        let state = root.join("nested/state");
        std::fs::create_dir_all(&state).unwrap();
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700)).unwrap();
        bundle().save(&state.join("secrets.yaml"), false).unwrap();
        BootstrapOptions {
            state_dir: Some(state),
            ..Default::default()
        }
    }

    /// Every file under `dir` with its inode and modification time.
    fn snapshot(dir: &Path) -> BTreeMap<PathBuf, (u64, i64, i64)> {
        let mut all = BTreeMap::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let md = std::fs::metadata(&path).unwrap();
            if md.is_dir() {
                all.extend(snapshot(&path));
            }
            all.insert(path, (md.ino(), md.mtime(), md.mtime_nsec()));
        }
        all
    }

    #[test]
    fn a_state_dir_opened_as_existing_reads_its_secrets_once() {
        let root = tempfile::tempdir().unwrap();
        let inv = atlas();
        let path = root.path().join("state");
        let made = StateDir::open(&inv, Some(&path))
            .unwrap()
            .secrets(&inv, true)
            .unwrap();
        let state = StateDir::existing(&inv, Some(&path)).unwrap();
        // Gone from disk now: what the command uses is what it opened (a
        // SOPS file is decrypted once per command, not per step).
        std::fs::remove_file(state.secrets_path()).unwrap();
        let again = state.secrets(&inv, false).unwrap();
        assert!(again.bundle == made.bundle && !again.created);
        let prepared = prepare_in(&inv, &BootstrapOptions::default(), state).unwrap();
        assert_eq!(
            prepared.secrets_source,
            SecretsSource::Clear(path.join("secrets.yaml"))
        );
        // Opened anew, there are none.
        assert!(StateDir::existing(&inv, Some(&path)).is_err());
    }

    #[test]
    fn a_new_state_dir_is_private_and_gets_secrets_only_when_asked() {
        let root = tempfile::tempdir().unwrap();
        let mut inv = atlas();
        inv.base_dir = root.path().to_owned();
        let path = root.path().join("a/b/state");
        let state = StateDir::open(&inv, Some(&path)).unwrap();
        assert_eq!(state.path, path);
        assert_eq!(mode(&path), 0o700);
        // Never silently: without `new`, none is made and both places are named.
        let err = state.secrets(&inv, false).unwrap_err();
        assert!(matches!(err, StageError::NoSecrets { .. }), "{err}");
        assert!(err.is_usage());
        let text = err.to_string();
        assert!(
            text.contains(&root.path().join("secrets.sops.yaml").display().to_string())
                && text.contains(&state.secrets_path().display().to_string())
                && text.contains("imgbuild secrets gen")
                && text.contains("--new-secrets"),
            "{text}"
        );
        assert!(!state.secrets_path().exists());
        let created = state.secrets(&inv, true).unwrap();
        assert!(created.created);
        assert_eq!(created.source, SecretsSource::Clear(state.secrets_path()));
        assert_eq!(mode(&state.secrets_path()), 0o600);
        let loaded = state.secrets(&inv, true).unwrap();
        assert!(!loaded.created);
        assert!(
            loaded.bundle == created.bundle,
            "the second call must load, not generate"
        );
        let err = state.save_secrets(None, false).unwrap_err().to_string();
        assert!(err.contains("already exists"), "{err}");
    }

    #[test]
    fn a_clear_file_where_the_sops_file_goes_is_refused() {
        let root = tempfile::tempdir().unwrap();
        let mut inv = atlas();
        inv.base_dir = root.path().to_owned();
        inv.cluster.secrets_file = Some("secrets/cluster.sops.yaml".into());
        let sealed = root.path().join("secrets/cluster.sops.yaml");
        assert_eq!(sealed_path(&inv), sealed);
        std::fs::create_dir(root.path().join("secrets")).unwrap();
        bundle().save(&sealed, false).unwrap();
        let err = find_secrets(&inv, &root.path().join("state")).unwrap_err();
        assert!(matches!(err, StageError::SealedInClear { .. }), "{err}");
        assert!(err.to_string().contains(&sealed.display().to_string()));
        assert!(!root.path().join("state").exists());
    }

    #[test]
    fn the_default_state_dir_is_beside_the_inventory() {
        let root = tempfile::tempdir().unwrap();
        let mut inv = atlas();
        inv.base_dir = root.path().to_owned();
        let state = StateDir::open(&inv, None).unwrap();
        assert_eq!(state.path, root.path().join(".talos/atlas"));
        assert_eq!(mode(&state.path), 0o700);
    }

    #[test]
    fn prepare_writes_the_talosconfig_privately_and_no_rendered_config() {
        let root = tempfile::tempdir().unwrap();
        let inv = atlas();
        let opts = seeded(root.path());
        let p = prepare(&inv, &opts).unwrap();
        let state = &p.state_dir;
        assert!(!p.secrets_created);
        assert!(p.talosconfig_written);
        assert_eq!(p.talosconfig, Some(state.talosconfig_path()));
        assert_eq!(mode(&state.talosconfig_path()), 0o600);
        assert!(!state.path.join("configs").exists());
        for (node, planned) in inv.nodes.iter().zip(&p.plan.nodes) {
            let secrets = state.secrets(&inv, false).unwrap();
            assert_eq!(secrets.source, SecretsSource::Clear(state.secrets_path()));
            let rendered =
                config::machine_config(&inv, node, &secrets.bundle, &opts.patch_vars).unwrap();
            assert_eq!(rendered.as_bytes(), planned.config);
            assert_eq!(planned.name, node.name);
            assert_eq!(Some(planned.address), node.address);
            assert_eq!(
                planned.endpoint.addr.to_string(),
                format!("{}:50000", planned.address)
            );
        }
        assert_eq!(p.plan.kubeconfig_path, state.kubeconfig_path());
        assert_eq!(p.plan.endpoint, "https://10.0.0.20:6443");
    }

    #[test]
    fn a_second_prepare_writes_nothing() {
        let root = tempfile::tempdir().unwrap();
        let inv = atlas();
        let opts = seeded(root.path());
        let first = prepare(&inv, &opts).unwrap();
        let before = snapshot(&first.state_dir.path);
        std::thread::sleep(std::time::Duration::from_millis(20));
        let second = prepare(&inv, &opts).unwrap();
        assert!(!second.secrets_created);
        assert!(!second.talosconfig_written);
        assert_eq!(snapshot(&second.state_dir.path), before);
        assert_eq!(before.len(), 2 + 1, "{before:?}");
    }

    #[test]
    fn a_changed_node_config_changes_only_that_nodes_plan() {
        let root = tempfile::tempdir().unwrap();
        let mut inv = atlas();
        let opts = seeded(root.path());
        let first = prepare(&inv, &opts).unwrap();
        inv.nodes[4].install_disk = "/dev/vdb".into();
        let p = prepare(&inv, &opts).unwrap();
        let changed: Vec<&str> = first
            .plan
            .nodes
            .iter()
            .zip(&p.plan.nodes)
            .filter(|(a, b)| a.config != b.config)
            .map(|(_, b)| b.name.as_str())
            .collect();
        assert_eq!(changed, ["worker-02"]);
        assert!(!p.talosconfig_written);
    }

    #[test]
    fn check_renders_every_config_and_resolves_every_node_writing_nothing() {
        let root = tempfile::tempdir().unwrap();
        let mut inv = atlas();
        let state = root.path().join("state");
        let mut opts = BootstrapOptions {
            state_dir: Some(state.clone()),
            ..Default::default()
        };
        // No secrets yet: a throwaway bundle, and no state dir appears.
        let checked = check(&inv, &opts).unwrap();
        assert!(checked.throwaway_secrets);
        assert!(!state.exists());
        assert_eq!(checked.reach.len(), inv.nodes.len());
        let (name, target) = &checked.reach[0];
        assert_eq!(name, &inv.nodes[0].name);
        assert_eq!(
            target.as_ref().unwrap().addr,
            std::net::SocketAddr::new(inv.nodes[0].address.unwrap(), 50000)
        );
        // The state dir's own secrets when it has them.
        let opts_seeded = seeded(root.path());
        let before = snapshot(root.path());
        assert!(!check(&inv, &opts_seeded).unwrap().throwaway_secrets);
        assert_eq!(before, snapshot(root.path()));
        // A bad patch and a dhcp node nobody can reach fail here.
        std::fs::write(root.path().join("bad.yaml"), "machine:\n  tyop: 1\n").unwrap();
        inv.base_dir = root.path().to_owned();
        inv.patches = Default::default();
        inv.nodes[4].patches = vec!["bad.yaml".into()];
        let err = check(&inv, &opts).unwrap_err().to_string();
        assert!(
            err.contains(&format!("node {}", inv.nodes[4].name)),
            "{err}"
        );
        assert!(err.contains("bad.yaml") && err.contains("tyop"), "{err}");
        inv.nodes[4].patches.clear();
        inv.nodes[3].dhcp = true;
        inv.nodes[3].address = None;
        let err = check(&inv, &opts).unwrap_err().to_string();
        assert!(
            err.starts_with("node worker-01: no address or talosEndpoint"),
            "{err}"
        );
        // An override (a cloud's address) reaches it.
        let t = NodeEndpoint::new(Some("127.0.0.9".parse().unwrap()), None).unwrap();
        opts.targets.insert("worker-01".into(), t);
        assert!(check(&inv, &opts).is_ok());
        assert!(!state.exists());
    }

    #[test]
    fn a_node_the_bootstrap_cannot_reach_is_named() {
        let root = tempfile::tempdir().unwrap();
        let opts = seeded(root.path());
        let mut inv = atlas();
        inv.nodes[3].address = None;
        let err = prepare(&inv, &opts).unwrap_err().to_string();
        assert!(
            err.starts_with("node worker-01: no address or talosEndpoint"),
            "{err}"
        );
        inv.nodes[3].talos_endpoint = Some("worker-01.lan".into());
        let err = prepare(&inv, &opts).unwrap_err().to_string();
        assert!(
            err.starts_with("node worker-01: talosEndpoint \"worker-01.lan\" must be an IP"),
            "{err}"
        );
    }

    #[test]
    fn a_target_override_reaches_a_node_the_inventory_cannot() {
        let root = tempfile::tempdir().unwrap();
        let mut opts = seeded(root.path());
        let mut inv = atlas();
        inv.nodes[3].address = None;
        let target = NodeEndpoint::new(None, Some("127.0.0.9:50123")).unwrap();
        opts.targets.insert("worker-01".into(), target);
        let p = prepare(&inv, &opts).unwrap();
        let w = &p.plan.nodes[3];
        assert_eq!(w.endpoint.addr.to_string(), "127.0.0.9:50123");
        assert_eq!(w.address.to_string(), "127.0.0.9");

        opts.targets.insert(
            "worker-09".into(),
            NodeEndpoint::new(None, Some("127.0.0.9")).unwrap(),
        );
        let err = prepare(&inv, &opts).unwrap_err().to_string();
        assert!(err.contains("no node named \"worker-09\""), "{err}");
    }

    #[test]
    fn up_reports_and_probes_where_prepare_plans() {
        let root = tempfile::tempdir().unwrap();
        let mut opts = seeded(root.path());
        let mut inv = atlas();
        // Control planes listed after a worker: the first control plane
        // is bootstrapped, not the first node.
        inv.nodes.rotate_left(3);
        inv.nodes[0].address = None;
        opts.targets.insert(
            inv.nodes[0].name.clone(),
            NodeEndpoint::new(None, Some("127.0.0.9:50123")).unwrap(),
        );
        inv.nodes[1].talos_endpoint = Some("127.0.0.8:50001".into());
        let reach = Reach::of(&inv, &opts);
        let plan = prepare(&inv, &opts).unwrap().plan;
        assert_eq!(reach.bootstrap_node.as_deref(), Some("cp-01"));
        assert_eq!(plan.bootstrap_node, reach.bootstrap_node);
        assert_eq!(reach.nodes.len(), plan.nodes.len());
        for (r, p) in reach.nodes.iter().zip(&plan.nodes) {
            assert_eq!(r.node, p.name);
            assert_eq!(r.address, Some(p.address));
            assert_eq!(r.endpoint.as_ref().unwrap().addr, p.endpoint.addr);
        }
        assert_eq!(reach.nodes[0].address, "127.0.0.9".parse().ok());
        assert_eq!(
            reach.nodes[1].endpoint.as_ref().unwrap().addr.to_string(),
            "127.0.0.8:50001"
        );
        // A node without a way in has no endpoint here (prepare names it).
        inv.nodes[2].address = None;
        let reach = Reach::of(&inv, &opts);
        assert!(reach.nodes[2].endpoint.is_none());
        assert!(reach.nodes[2].address.is_none());
        assert!(prepare(&inv, &opts).is_err());
    }

    #[test]
    fn a_survey_finds_closed_ports_and_writes_nothing() {
        let root = tempfile::tempdir().unwrap();
        let mut inv = atlas();
        inv.nodes.truncate(2);
        // Bound, then closed: nothing answers there.
        let free = |_| {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().to_string()
        };
        for node in &mut inv.nodes {
            node.talos_endpoint = Some(free(()));
        }
        let opts = BootstrapOptions {
            state_dir: Some(root.path().join("state")),
            ..Default::default()
        };
        let survey = survey(&inv, &opts).unwrap();
        assert_eq!(survey.answers, [None, None]);
        assert_eq!(survey.reach.nodes.len(), 2);
        assert!(!root.path().join("state").exists());
    }

    #[test]
    fn a_talosconfig_from_other_secrets_is_refused_before_any_node() {
        let root = tempfile::tempdir().unwrap();
        let inv = atlas();
        let mut opts = seeded(root.path());
        let other = SecretsBundle::generate().unwrap();
        let foreign = root.path().join("foreign-talosconfig");
        Talosconfig::generate(&inv, &other)
            .unwrap()
            .save(&foreign)
            .unwrap();
        opts.talosconfig = Some(foreign);
        let err = prepare(&inv, &opts).unwrap_err();
        assert!(
            matches!(
                err,
                StageError::Talosconfig(TalosconfigError::ForeignCa { .. })
            ),
            "{err}"
        );
    }

    #[test]
    fn a_shared_folder_is_not_taken_as_a_state_dir() {
        let root = tempfile::tempdir().unwrap();
        let project = root.path().join("project");
        std::fs::create_dir(&project).unwrap();
        std::fs::set_permissions(&project, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(project.join("notes.txt"), "mine").unwrap();
        let err = StateDir::open(&atlas(), Some(&project)).unwrap_err();
        let text = format!("{err}: {}", std::error::Error::source(&err).unwrap());
        assert!(
            text.starts_with(&format!("state dir {}: ", project.display())),
            "{text}"
        );
        assert!(text.contains("readable by others"), "{text}");
        assert_eq!(mode(&project), 0o755);
    }
}
