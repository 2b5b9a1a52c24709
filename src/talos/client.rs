//! A Talos machine API client with the two ways a node must be spoken to:
//! maintenance mode (TLS, the node's self-signed certificate, no client
//! certificate) and mTLS (the cluster's OS CA, the admin identity). TLS is
//! done here with rustls on aws-lc-rs, not by tonic, so a probe can see what
//! the node asked for during the handshake.

use std::error::Error as StdError;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use rustls::{ClientConfig, SignatureScheme};
use tonic::transport::{Channel, Endpoint};

use super::api::common::{Data, Metadata};
pub use super::api::machine::apply_configuration_request::Mode as ApplyMode;
use super::api::machine::machine_service_client::MachineServiceClient;
use super::api::machine::{
    ApplyConfiguration, ApplyConfigurationRequest, Bootstrap, BootstrapRequest, EtcdMember,
    EtcdMemberListRequest, EtcdMembers, EtcdRecover, EtcdSnapshotRequest, ServiceInfo, ServiceList,
    Upgrade, Version,
};
use super::api::storage::Disks;
use super::api::storage::storage_service_client::StorageServiceClient;
use super::talosconfig::Identity;
use crate::net::error_chain;
use crate::net::proxy;
use crate::net::tls::{self, ClientIdentity, SeenCertificate, Trust};

use super::api::common::{ContainerDriver, ContainerdInstance, ContainerdNamespace};
use super::api::machine::image_service_client::ImageServiceClient;
use super::api::machine::image_service_pull_response::Response as PullReply;
use super::api::machine::lifecycle_service_client::LifecycleServiceClient;
use super::api::machine::lifecycle_service_install_progress::Response as Progress;
use super::api::machine::{
    EtcdForfeitLeadership, EtcdForfeitLeadershipRequest, EtcdLeaveCluster, EtcdLeaveClusterRequest,
    EtcdRemoveMemberById, EtcdRemoveMemberByIdRequest, ImagePull, ImagePullRequest, Reset,
    ResetRequest,
};
use super::api::machine::{
    ImageServicePullRequest, InstallArtifactsSource, LifecycleServiceUpgradeRequest, ReadRequest,
    Reboot, RebootRequest, UpgradeRequest, reboot_request, upgrade_request,
};

pub use crate::inventory::TALOS_API_PORT as PORT;

/// How to authenticate to a node.
#[derive(Clone)]
pub enum Mode {
    /// Unconfigured node: accept its self-signed certificate, or only the one
    /// whose SHA-256 is `pin`.
    Maintenance { pin: Option<String> },
    /// Configured node: verify it against the OS CA and present the admin cert.
    Mtls(Arc<Identity>),
}

impl fmt::Debug for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mode::Maintenance { pin } => write!(f, "Maintenance {{ pin: {pin:?} }}"),
            Mode::Mtls(_) => f.write_str("Mtls"),
        }
    }
}

/// Why a call failed, sorted into what the bootstrap must react to.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    /// The node wants a client certificate: it has a config, use mTLS.
    #[error(
        "the node requires a client certificate (\"tls: certificate required\"): it is configured and only speaks mTLS"
    )]
    CertificateRequired,
    /// The node's certificate is not from our CA (or ours is not from its).
    #[error("certificate signed by unknown authority: {0}")]
    UnknownAuthority(String),
    /// The node's certificate is from our CA but does not name the address
    /// it was reached as.
    #[error("the node's certificate is not valid for {expected}: it names {}", if presented.is_empty() { "no address at all".to_owned() } else { presented.join(", ") })]
    WrongName {
        expected: String,
        presented: Vec<String>,
    },
    #[error("the node's certificate has SHA-256 {found}, not the pinned {expected}")]
    PinMismatch { expected: String, found: String },
    #[error("cannot connect: {0}")]
    Unreachable(String),
    /// The proxy the connection goes through (`HTTPS_PROXY`,
    /// `--talos-proxy`) failed it: it is named, the node may be fine.
    #[error("{0}")]
    Proxy(String),
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// A reply larger than anything the node should send.
    #[error("{what} is larger than {limit} bytes")]
    TooLarge { what: &'static str, limit: usize },
    #[error("{code:?}: {message}")]
    Status { code: tonic::Code, message: String },
    #[error("TLS: {0}")]
    Tls(String),
    /// A routed call came back without the target's stamp: the endpoint did
    /// not proxy it there.
    #[error(
        "a call routed to {target} came back stamped {answered:?}, not {target:?}: the endpoint did not proxy it"
    )]
    Misrouted {
        target: String,
        answered: Vec<String>,
    },
}

impl ApiError {
    /// The gRPC code of an answered call.
    pub fn code(&self) -> Option<tonic::Code> {
        match self {
            ApiError::Status { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// Where a node's API is and which name its certificate carries.
#[derive(Debug, Clone)]
pub struct NodeEndpoint {
    pub addr: SocketAddr,
    pub server_name: IpAddr,
}

impl NodeEndpoint {
    /// `endpoint` is the inventory's talosEndpoint (see
    /// [`crate::inventory::talos_endpoint`]), else `address:50000`. The
    /// certificate is checked against `address` when there is one.
    pub fn new(address: Option<IpAddr>, endpoint: Option<&str>) -> Option<NodeEndpoint> {
        let addr = match endpoint {
            Some(ep) => crate::inventory::talos_endpoint(ep)?,
            None => SocketAddr::new(address?, PORT),
        };
        Some(NodeEndpoint {
            addr,
            server_name: address.unwrap_or(addr.ip()),
        })
    }
}

/// A Version answer: the Talos tag and the reply's `metadata.hostname`,
/// which apid leaves empty on a direct call and sets to the target as sent
/// on a routed one (never the machine's hostname).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeVersion {
    pub hostname: String,
    pub tag: String,
}

/// A per-node reply message: each starts with `common.Metadata`.
trait Reply {
    fn metadata(&self) -> Option<&Metadata>;
}

macro_rules! replies {
    ($($t:ty),*) => {$(
        impl Reply for $t {
            fn metadata(&self) -> Option<&Metadata> {
                self.metadata.as_ref()
            }
        }
    )*};
}

replies!(
    Version,
    ServiceList,
    EtcdMembers,
    Bootstrap,
    ApplyConfiguration,
    Disks,
    Data,
    Upgrade
);

/// What a TLS handshake without a client certificate revealed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// Handshake done without a certificate request: maintenance mode.
    Maintenance { fingerprint: String },
    /// The node asked for a client certificate: it is configured.
    Configured,
}

/// Presents no certificate but notes that the server asked for one.
#[derive(Debug, Default)]
struct NoteRequest(AtomicBool);

impl rustls::client::ResolvesClientCert for NoteRequest {
    fn resolve(
        &self,
        _hints: &[&[u8]],
        _schemes: &[SignatureScheme],
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        self.0.store(true, Ordering::SeqCst);
        None
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// The rustls settings for `mode`, from the one TLS layer, and the
/// recorder of the certificate the node showed.
fn tls_config(mode: &Mode) -> Result<(ClientConfig, SeenCertificate), ApiError> {
    let (trust, identity) = match mode {
        Mode::Maintenance { pin: None } => (Trust::Any, None),
        Mode::Maintenance { pin: Some(pin) } => {
            (Trust::Pinned(pin.parse().map_err(ApiError::Tls)?), None)
        }
        Mode::Mtls(id) => (
            Trust::Ca(id.ca.clone()),
            Some(ClientIdentity {
                crt: id.client.crt.clone(),
                key: id.client.key.clone(),
            }),
        ),
    };
    let (mut config, seen) = tls::client_config(&trust, identity.as_ref())
        .map_err(|e| ApiError::Tls(e.to_string()))?
        .expect("only system trust is left to the HTTP stack");
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok((config, seen))
}

/// Waits until something accepts TCP connections on `addr`, never sending a
/// byte: a node that is still booting must not be probed with API calls.
pub async fn wait_for_port(addr: SocketAddr, timeout: Duration) -> Result<(), ApiError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let proxy = proxy::talos_proxy_for(addr);
    loop {
        let last =
            match tokio::time::timeout(Duration::from_secs(2), proxy::dial(addr, proxy.as_ref()))
                .await
            {
                Ok(Ok(_)) => return Ok(()),
                Ok(Err(e)) => e.to_string(),
                Err(_) => "connect timed out".to_owned(),
            };
        if tokio::time::Instant::now() + Duration::from_millis(200) > deadline {
            return Err(ApiError::Unreachable(format!(
                "{addr}: port not open after {timeout:?} ({last})"
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One TLS handshake without a client certificate: tells maintenance mode
/// (no certificate request) from a configured node (request, then the
/// `certificate_required` alert) without calling any API.
pub async fn probe(target: &NodeEndpoint, timeout: Duration) -> Result<Probe, ApiError> {
    let (mut config, seen) = tls_config(&Mode::Maintenance { pin: None })?;
    let noted = Arc::new(NoteRequest::default());
    config.client_auth_cert_resolver = noted.clone();
    let work = async {
        let proxy = proxy::talos_proxy_for(target.addr);
        let tcp = proxy::dial(target.addr, proxy.as_ref())
            .await
            .map_err(|e| {
                proxy_error(&e)
                    .unwrap_or_else(|| ApiError::Unreachable(format!("{}: {e}", target.addr)))
            })?;
        let name = ServerName::IpAddress(target.server_name.into());
        let result = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await;
        if noted.0.load(Ordering::SeqCst) {
            return Ok(Probe::Configured);
        }
        match result {
            Ok(_) => {
                let fingerprint = seen.get().map(|f| f.hex()).unwrap_or_default();
                Ok(Probe::Maintenance { fingerprint })
            }
            Err(e) => Err(classify(&e).unwrap_or_else(|| ApiError::Tls(e.to_string()))),
        }
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| ApiError::Timeout(timeout))?
}

/// The channel every call of a [`NodeClient`] goes through: with
/// `--debug`, one line per call — the node, the method's path, the HTTP
/// status and any `grpc-status` the reply's headers carry, the time to
/// them. Never metadata or a message: the request log holds no secret.
#[derive(Clone)]
struct Logged {
    channel: Channel,
    addr: SocketAddr,
}

/// A call whose future was dropped before its reply (a timeout, an
/// abandoned wait) says so in the `--debug` log.
struct Unanswered {
    what: Option<String>,
    started: std::time::Instant,
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        if let Some(what) = self.what.take() {
            let took = self.started.elapsed().as_millis();
            crate::net::debug_line(|| format!("{what} → no reply, abandoned after {took} ms"));
        }
    }
}

type HttpRequest = tonic::codegen::http::Request<tonic::body::Body>;
type HttpResponse = tonic::codegen::http::Response<tonic::body::Body>;

impl tower::Service<HttpRequest> for Logged {
    type Response = HttpResponse;
    type Error = tonic::transport::Error;
    type Future = tonic::codegen::BoxFuture<HttpResponse, tonic::transport::Error>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.channel.poll_ready(cx)
    }

    fn call(&mut self, req: HttpRequest) -> Self::Future {
        if !crate::net::debugging() {
            return Box::pin(self.channel.call(req));
        }
        let what = format!("gRPC {} {}", self.addr, req.uri().path());
        let reply = self.channel.call(req);
        Box::pin(async move {
            let mut pending = Unanswered {
                what: Some(what),
                started: std::time::Instant::now(),
            };
            let reply = reply.await;
            let what = pending.what.take().unwrap_or_default();
            let took = pending.started.elapsed().as_millis();
            crate::net::debug_line(|| match &reply {
                Ok(r) => {
                    let grpc = r
                        .headers()
                        .get("grpc-status")
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.parse::<i32>().ok())
                        .map(|c| format!(", grpc-status {c} ({:?})", tonic::Code::from(c)))
                        .unwrap_or_default();
                    format!("{what} → HTTP {}{grpc} in {took} ms", r.status())
                }
                Err(e) => format!("{what} → failed after {took} ms: {}", error_chain(e)),
            });
            reply
        })
    }
}

/// A connection to one node's API.
#[derive(Clone)]
pub struct NodeClient {
    channel: Logged,
    endpoint: NodeEndpoint,
    insecure: bool,
    /// The target apid proxies every call to (`nodes` metadata), exactly as
    /// sent: each reply must come back stamped with it.
    node: Option<String>,
    timeout: Duration,
}

impl NodeClient {
    /// Connects (TCP + TLS handshake) to `target` in `mode`.
    pub async fn connect(
        target: &NodeEndpoint,
        mode: &Mode,
        timeout: Duration,
    ) -> Result<NodeClient, ApiError> {
        let (config, _) = tls_config(mode)?;
        let config = Arc::new(config);
        let addr = target.addr;
        let name = ServerName::IpAddress(target.server_name.into());
        // Chosen once per client: HTTPS_PROXY / NO_PROXY, or --talos-proxy.
        let via = proxy::talos_proxy_for(addr).map(Arc::new);
        let connector = tower::service_fn(move |_: tonic::codegen::http::Uri| {
            let config = config.clone();
            let name = name.clone();
            let via = via.clone();
            async move {
                let tcp = proxy::dial(addr, via.as_deref()).await?;
                let tls = tokio_rustls::TlsConnector::from(config)
                    .connect(name, tcp)
                    .await?;
                Ok::<_, std::io::Error>(TokioIo::new(tls))
            }
        });
        let channel = Endpoint::from_static("http://talos-node")
            .connect_timeout(timeout)
            .timeout(timeout)
            .connect_with_connector(connector)
            .await
            .map_err(|e| classify(&e).unwrap_or_else(|| ApiError::Unreachable(error_chain(&e))))?;
        Ok(NodeClient {
            channel: Logged { channel, addr },
            endpoint: target.clone(),
            insecure: matches!(mode, Mode::Maintenance { .. }),
            node: None,
            timeout,
        })
    }

    /// Sends every call through this endpoint to `node` with `nodes`
    /// metadata, as talosctl does: apid proxies one-to-many, stamps each
    /// reply's `metadata.hostname` with the target as sent (which proves the
    /// call got there) and reports a failed target in `metadata.error`.
    /// (`node` metadata proxies too, but its replies carry no metadata.)
    pub fn via(mut self, node: IpAddr) -> Self {
        self.node = Some(node.to_string());
        self
    }

    fn request<T>(&self, msg: T) -> tonic::Request<T> {
        let mut req = tonic::Request::new(msg);
        req.set_timeout(self.timeout);
        if let Some(node) = &self.node
            && let Ok(v) = node.parse()
        {
            req.metadata_mut().insert("nodes", v);
        }
        req
    }

    /// [`check`] for this client's routing.
    fn check<M: Reply>(&self, messages: &[M]) -> Result<(), ApiError> {
        check(self.node.as_deref(), messages)
    }

    /// Sorts a failed call. A configured node rejects a channel without a
    /// client certificate with an alert that may arrive as a bare
    /// "connection closed"; a fresh handshake tells which it was.
    async fn fail(&self, s: tonic::Status) -> ApiError {
        let err = status_error(&s, self.timeout);
        let transport = matches!(
            err.code(),
            Some(tonic::Code::Cancelled | tonic::Code::Unknown | tonic::Code::Unavailable)
        );
        if self.insecure
            && transport
            && matches!(
                probe(&self.endpoint, self.timeout).await,
                Ok(Probe::Configured)
            )
        {
            return ApiError::CertificateRequired;
        }
        err
    }

    fn machine(&self) -> MachineServiceClient<Logged> {
        MachineServiceClient::new(self.channel.clone())
    }

    /// A unary `MachineService` call by its path: for the RPCs proto/ lists
    /// only by their messages (the node simulator does not serve them all
    /// yet); the same bytes on the wire as a generated method.
    async fn machine_unary<Q, R>(&self, path: &'static str, msg: Q) -> Result<R, ApiError>
    where
        Q: prost::Message + Send + Sync + 'static,
        R: prost::Message + Default + Send + Sync + 'static,
    {
        let mut grpc = tonic::client::Grpc::new(self.channel.clone());
        let req = self.request(msg);
        let reply = async move {
            grpc.ready()
                .await
                .map_err(|e| tonic::Status::unknown(format!("Service was not ready: {e}")))?;
            grpc.unary(
                req,
                tonic::codegen::http::uri::PathAndQuery::from_static(path),
                tonic_prost::ProstCodec::<Q, R>::default(),
            )
            .await
        };
        self.call(reply).await
    }

    /// Awaits one call, sorting its failure. The client's timeout bounds
    /// the whole call, body included: tonic's own covers only the response
    /// headers, and a node that sends them and then stalls would hold the
    /// caller forever.
    async fn call<T>(
        &self,
        reply: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, ApiError> {
        match self.within(reply).await? {
            Ok(r) => Ok(r.into_inner()),
            Err(s) => Err(self.fail(s).await),
        }
    }

    /// `work` within the client's timeout: a call, or a whole server stream
    /// (the replies imgbuild streams are small and come at once).
    async fn within<T>(&self, work: impl std::future::Future<Output = T>) -> Result<T, ApiError> {
        tokio::time::timeout(self.timeout, work)
            .await
            .map_err(|_| ApiError::Timeout(self.timeout))
    }

    /// The node's disks: answers in maintenance mode too.
    pub async fn disks(&self) -> Result<Vec<String>, ApiError> {
        let mut storage = StorageServiceClient::new(self.channel.clone());
        let reply = self.call(storage.disks(self.request(()))).await?;
        self.check(&reply.messages)?;
        Ok(reply
            .messages
            .into_iter()
            .flat_map(|m| m.disks)
            .map(|d| d.device_name)
            .collect())
    }

    /// The Talos version and which node answered (fails in maintenance
    /// mode, by design).
    pub async fn version(&self) -> Result<NodeVersion, ApiError> {
        let reply = self.call(self.machine().version(self.request(()))).await?;
        self.check(&reply.messages)?;
        let first = reply.messages.into_iter().next();
        Ok(NodeVersion {
            hostname: first
                .as_ref()
                .and_then(|m| m.metadata.as_ref())
                .map(|m| m.hostname.clone())
                .unwrap_or_default(),
            tag: first
                .and_then(|m| m.version)
                .map(|v| v.tag)
                .unwrap_or_default(),
        })
    }

    /// Applies `config` in AUTO mode; returns the node's mode details.
    pub async fn apply(&self, config: Vec<u8>) -> Result<String, ApiError> {
        self.apply_mode(config, ApplyMode::Auto, false).await
    }

    /// Applies `config` in `mode`, or with `dry_run` only asks for the
    /// node's summary and config diff; returns the node's mode details.
    pub async fn apply_mode(
        &self,
        config: Vec<u8>,
        mode: ApplyMode,
        dry_run: bool,
    ) -> Result<String, ApiError> {
        let req = ApplyConfigurationRequest {
            data: config,
            mode: mode as i32,
            dry_run,
            try_mode_timeout: None,
        };
        let reply = self
            .call(self.machine().apply_configuration(self.request(req)))
            .await?;
        self.check(&reply.messages)?;
        Ok(reply
            .messages
            .into_iter()
            .map(|m| m.mode_details)
            .collect::<Vec<_>>()
            .join("; "))
    }

    /// The schematic the node runs: the version of the extension named
    /// `schematic` the factory puts into its images (siderolabs/image-factory
    /// `pkg/constants/constants.go`), read as `talosctl get extensions` does,
    /// through the COSI State API (`ExtensionStatuses.runtime.talos.dev` in
    /// namespace `runtime`, siderolabs/talos
    /// `pkg/machinery/resources/runtime/extension_status.go`). None when the
    /// node runs an image without one.
    pub async fn running_schematic(&self) -> Result<Option<String>, ApiError> {
        let specs = self
            .cosi_list("runtime", "ExtensionStatuses.runtime.talos.dev")
            .await?;
        Ok(specs
            .iter()
            .find_map(|(_, yaml)| schematic_extension_version(yaml)))
    }

    /// Every resource of `kind` in `namespace` as `talosctl get` lists them
    /// (the COSI State API): each one's ID and YAML spec, read within the
    /// client's timeout and refused past [`COSI_LIST_LIMIT`] bytes.
    pub async fn cosi_list(
        &self,
        namespace: &str,
        kind: &str,
    ) -> Result<Vec<(String, String)>, ApiError> {
        use super::api::cosi::resource::ListRequest;
        use super::api::cosi::resource::state_client::StateClient;
        let req = ListRequest {
            namespace: namespace.into(),
            r#type: kind.into(),
            options: None,
        };
        let mut state = StateClient::new(self.channel.clone());
        let mut stream = self.call(state.list(self.request(req))).await?;
        let read = async {
            let mut out = Vec::new();
            let mut size = 0;
            loop {
                match stream.message().await {
                    Ok(Some(item)) => {
                        let Some(r) = item.resource else { continue };
                        let id = r.metadata.map(|m| m.id).unwrap_or_default();
                        let yaml = r.spec.map(|s| s.yaml_spec).unwrap_or_default();
                        size += id.len() + yaml.len();
                        if size > COSI_LIST_LIMIT {
                            return Err(ApiError::TooLarge {
                                what: "the resource list",
                                limit: COSI_LIST_LIMIT,
                            });
                        }
                        out.push((id, yaml));
                    }
                    Ok(None) => return Ok(out),
                    Err(s) => return Err(self.fail(s).await),
                }
            }
        };
        self.within(read).await?
    }

    /// One COSI resource (`talosctl get TYPE ID`): its YAML spec, None when
    /// the node has no such resource; refused past `limit` bytes, naming
    /// `what` it is.
    pub async fn cosi_get(
        &self,
        (namespace, kind, id): (&str, &str, &str),
        what: &'static str,
        limit: usize,
    ) -> Result<Option<String>, ApiError> {
        use super::api::cosi::resource::GetRequest;
        use super::api::cosi::resource::state_client::StateClient;
        let req = GetRequest {
            namespace: namespace.into(),
            r#type: kind.into(),
            id: id.into(),
            options: None,
        };
        let mut state = StateClient::new(self.channel.clone());
        match self.call(state.get(self.request(req))).await {
            Ok(reply) => {
                let yaml = reply
                    .resource
                    .and_then(|r| r.spec)
                    .map(|s| s.yaml_spec)
                    .unwrap_or_default();
                if yaml.len() > limit {
                    return Err(ApiError::TooLarge { what, limit });
                }
                Ok(Some(yaml))
            }
            Err(e) if e.code() == Some(tonic::Code::NotFound) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The node's SecurityState (siderolabs/talos
    /// `pkg/machinery/resources/runtime/security_status.go`, Talos v1.5+):
    /// whether it booted with Secure Boot on and the signing keys' fingerprints,
    /// read as `talosctl get securitystate` does. None when the node has no
    /// such resource.
    pub async fn security_state(&self) -> Result<Option<SecurityState>, ApiError> {
        use super::api::cosi::resource::GetRequest;
        use super::api::cosi::resource::state_client::StateClient;
        let req = GetRequest {
            namespace: "runtime".into(),
            r#type: "SecurityStates.talos.dev".into(),
            id: "securitystate".into(),
            options: None,
        };
        let mut state = StateClient::new(self.channel.clone());
        let reply = match self.call(state.get(self.request(req))).await {
            Ok(r) => r,
            Err(e) if e.code() == Some(tonic::Code::NotFound) => return Ok(None),
            Err(e) => return Err(e),
        };
        let yaml = reply
            .resource
            .and_then(|r| r.spec)
            .map(|s| s.yaml_spec)
            .unwrap_or_default();
        let Ok(mut read) = serde_yaml_ng::from_str::<SecurityState>(&yaml) else {
            return Ok(None);
        };
        // Shown to the user: keep only what a fingerprint can be.
        let plain = |f: &Option<String>| {
            f.as_ref().is_some_and(|f| {
                f.len() <= 200 && f.chars().all(|c| c.is_ascii_hexdigit() || c == ':')
            })
        };
        for f in [
            &mut read.uki_signing_key_fingerprint,
            &mut read.pcr_signing_key_fingerprint,
        ] {
            if !plain(f) {
                *f = None;
            }
        }
        Ok(Some(read))
    }

    /// Asks the node to bootstrap etcd.
    pub async fn bootstrap(&self) -> Result<(), ApiError> {
        let reply = self
            .call(
                self.machine()
                    .bootstrap(self.request(BootstrapRequest::default())),
            )
            .await?;
        self.check(&reply.messages)
    }

    /// The node's services and their health.
    pub async fn services(&self) -> Result<Vec<ServiceInfo>, ApiError> {
        let reply = self
            .call(self.machine().service_list(self.request(())))
            .await?;
        self.check(&reply.messages)?;
        Ok(reply
            .messages
            .into_iter()
            .flat_map(|m| m.services)
            .collect())
    }

    /// The etcd members as this node sees them.
    pub async fn etcd_members(&self) -> Result<Vec<EtcdMember>, ApiError> {
        let req = EtcdMemberListRequest { query_local: false };
        let reply = self
            .call(self.machine().etcd_member_list(self.request(req)))
            .await?;
        self.check(&reply.messages)?;
        Ok(reply.messages.into_iter().flat_map(|m| m.members).collect())
    }

    /// The admin kubeconfig archive (a .tar.gz) streamed by the node, read
    /// within the client's timeout and refused past [`KUBECONFIG_LIMIT`]
    /// bytes (an endless stream must not fill memory).
    pub async fn kubeconfig(&self) -> Result<Vec<u8>, ApiError> {
        let mut stream = self
            .call(self.machine().kubeconfig(self.request(())))
            .await?;
        let read = async {
            let mut out = Vec::new();
            loop {
                match stream.message().await {
                    Ok(Some(chunk)) => {
                        self.check(std::slice::from_ref(&chunk))?;
                        if out.len() + chunk.bytes.len() > KUBECONFIG_LIMIT {
                            return Err(ApiError::TooLarge {
                                what: "the kubeconfig archive",
                                limit: KUBECONFIG_LIMIT,
                            });
                        }
                        out.extend_from_slice(&chunk.bytes);
                    }
                    Ok(None) => return Ok(out),
                    Err(s) => return Err(self.fail(s).await),
                }
            }
        };
        self.within(read).await?
    }
}

// The calls only node removal makes (siderolabs/talos
// `internal/app/machined/internal/server/v1alpha1/v1alpha1_server.go`, the
// same from v1.9 to v1.14): etcd leave / remove by member ID (control
// planes only), and Reset.
replies!(
    EtcdLeaveCluster,
    EtcdRemoveMemberById,
    Reset,
    EtcdForfeitLeadership,
    ImagePull
);

impl NodeClient {
    /// `MachineService.EtcdLeaveCluster`: this node removes its own etcd
    /// member, stops etcd and empties its data directory.
    pub async fn etcd_leave_cluster(&self) -> Result<(), ApiError> {
        let reply = self
            .call(
                self.machine()
                    .etcd_leave_cluster(self.request(EtcdLeaveClusterRequest {})),
            )
            .await?;
        self.check(&reply.messages)
    }

    /// `MachineService.EtcdForfeitLeadership`: if this node leads etcd, it
    /// hands leadership to another member (talosctl `reset` does it before
    /// the node leaves). The member that leads afterwards, when Talos names
    /// it (empty when this node was not the leader).
    pub async fn etcd_forfeit_leadership(&self) -> Result<String, ApiError> {
        let reply: super::api::machine::EtcdForfeitLeadershipResponse = self
            .machine_unary(
                "/machine.MachineService/EtcdForfeitLeadership",
                EtcdForfeitLeadershipRequest {},
            )
            .await?;
        self.check(&reply.messages)?;
        Ok(reply
            .messages
            .into_iter()
            .map(|m| m.member)
            .find(|m| !m.is_empty())
            .unwrap_or_default())
    }

    /// `MachineService.EtcdRemoveMemberByID`: this control plane removes
    /// member `id` (NotFound when there is no such member).
    pub async fn etcd_remove_member_by_id(&self, id: u64) -> Result<(), ApiError> {
        let req = EtcdRemoveMemberByIdRequest { member_id: id };
        let reply = self
            .call(self.machine().etcd_remove_member_by_id(self.request(req)))
            .await?;
        self.check(&reply.messages)
    }

    /// `MachineService.Reset`: acked at once, the reset sequence then runs
    /// on the node (graceful: cordon, drain, leave etcd; then wipe the
    /// labelled system partitions; then reboot or power off).
    pub async fn reset(&self, req: ResetRequest) -> Result<(), ApiError> {
        let reply = self.call(self.machine().reset(self.request(req))).await?;
        self.check(&reply.messages)
    }
}

// etcd backup and recovery (siderolabs/talos `cmd/talosctl/cmd/talos/etcd.go`
// snapshot, `cmd/talosctl/cmd/talos/bootstrap.go` --recover-from); the
// reading, bounds and files are [`super::etcd`]'s.
impl Reply for EtcdRecover {
    fn metadata(&self) -> Option<&Metadata> {
        self.metadata.as_ref()
    }
}

impl NodeClient {
    /// The node's etcd snapshot as it streams it (`EtcdSnapshot`). The
    /// request carries no gRPC deadline, as Talos would end a snapshot at it:
    /// the caller reads with its own deadline per message and its own bound.
    pub async fn etcd_snapshot(&self) -> Result<tonic::Streaming<Data>, ApiError> {
        let req = tonic::Request::new(EtcdSnapshotRequest {});
        self.call(self.machine().etcd_snapshot(req)).await
    }

    /// Uploads a snapshot to recover etcd from (`EtcdRecover`, a client
    /// stream), within this client's timeout: connect it with one that
    /// covers the upload.
    pub async fn etcd_recover(
        &self,
        chunks: impl futures_util::Stream<Item = Data> + Send + 'static,
    ) -> Result<(), ApiError> {
        let reply = self
            .call(self.machine().etcd_recover(tonic::Request::new(chunks)))
            .await?;
        self.check(&reply.messages)
    }

    /// Bootstrap that starts etcd from the snapshot [`Self::etcd_recover`]
    /// uploaded (`recover_etcd`).
    /// `skip_hash_check`: the upload is a copy of an etcd data directory's
    /// `member/snap/db`, which carries no snapshot hash
    /// (`recover_skip_hash_check`, talosctl `--recover-skip-hash-check`).
    pub async fn bootstrap_recover(&self, skip_hash_check: bool) -> Result<(), ApiError> {
        let req = BootstrapRequest {
            recover_etcd: true,
            recover_skip_hash_check: skip_hash_check,
        };
        let reply = self
            .call(self.machine().bootstrap(self.request(req)))
            .await?;
        self.check(&reply.messages)
    }
}

/// The most a kubeconfig archive may take on the wire: talosctl's is a few
/// KiB (one file, gzip).
pub const KUBECONFIG_LIMIT: usize = 4 << 20;

/// The most one COSI list may hold: the bootstrap manifests are a few
/// hundred KiB.
pub const COSI_LIST_LIMIT: usize = 16 << 20;

// The calls only day two makes: the boot ID (how talosctl's
// `BootIDChangedPostCheckFn` knows a node rebooted), Reboot, and the two
// ways a node is asked to upgrade — `MachineService.Upgrade` below Talos
// v1.13, `ImageService.Pull` + `LifecycleService.Upgrade` from v1.13
// (siderolabs/talos `cmd/talosctl/cmd/talos/upgrade.go`,
// `internal/app/lifecycle/lifecycle.go`).

/// Where Linux keeps the ID of the running boot: a new UUID every boot.
pub const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";

/// A boot ID is a UUID and a newline; anything longer is not one.
const BOOT_ID_LIMIT: usize = 128;

/// Where Talos keeps the config its next boot runs (`constants.ConfigPath`).
pub const PERSISTED_CONFIG_PATH: &str = "/system/state/config.yaml";

/// A machine config larger than this is not one imgbuild rendered.
const CONFIG_LIMIT: usize = 4 << 20;

impl Reply for Reboot {
    fn metadata(&self) -> Option<&Metadata> {
        self.metadata.as_ref()
    }
}

/// How the node reboots into the new install (talosctl `--reboot-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RebootMode {
    /// kexec where the node can.
    #[default]
    Default,
    /// A full power cycle (firmware, BIOS/UEFI) instead of kexec.
    Powercycle,
}

/// What `MachineService.Upgrade` is asked besides the image.
#[derive(Debug, Clone, Copy, Default)]
pub struct UpgradeFlags {
    /// Keep data: meaningful only below v1.8, and from v1.12.9/v1.13.4/v1.14
    /// it also skips the etcd checks, so it is sent only below v1.8.
    pub preserve: bool,
    /// Skip the etcd checks (a 2-member etcd).
    pub force: bool,
    pub reboot_mode: RebootMode,
}

/// The system containerd, where Talos runs its installer from.
fn system_containerd() -> ContainerdInstance {
    containerd(ContainerdNamespace::NsSystem)
}

/// `namespace` of the system containerd.
fn containerd(namespace: ContainerdNamespace) -> ContainerdInstance {
    ContainerdInstance {
        driver: ContainerDriver::Containerd as i32,
        namespace: namespace as i32,
    }
}

/// Where a Kubernetes image must land: always the CRI containerd (the
/// kubelet runs from its `system` namespace, services/kubelet.go; the static
/// pods' images are in `k8s.io`). The system containerd with `NS_CRI` is
/// refused by Talos (ctrhelper.go: "cannot use CRI namespace with
/// containerd driver").
pub fn kubernetes_containerd(kubelet: bool) -> ContainerdInstance {
    ContainerdInstance {
        driver: ContainerDriver::Cri as i32,
        namespace: kubernetes_namespace(kubelet) as i32,
    }
}

/// The CRI namespace of a Kubernetes image (talosctl `prePullImages`:
/// `NS_SYSTEM` for the kubelet, `NS_CRI` for the rest).
pub fn kubernetes_namespace(kubelet: bool) -> ContainerdNamespace {
    if kubelet {
        ContainerdNamespace::NsSystem
    } else {
        ContainerdNamespace::NsCri
    }
}

/// The Talos API a Kubernetes image is pre-pulled through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum PullApi {
    /// `MachineService.ImagePull` (v1.5–v1.12; deprecated from v1.13):
    /// always the CRI containerd.
    ImagePull,
    /// `ImageService.Pull` (v1.13+) with the CRI driver.
    ImageService,
}

impl PullApi {
    /// The API for a node on Talos `(major, minor)`; None below v1.5, which
    /// has neither.
    pub fn for_talos(major: u64, minor: u64) -> Option<PullApi> {
        match (major, minor) {
            (1, m) if m >= 13 => Some(PullApi::ImageService),
            (1, m) if m >= 5 => Some(PullApi::ImagePull),
            (m, _) if m > 1 => Some(PullApi::ImageService),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            PullApi::ImagePull => "MachineService.ImagePull",
            PullApi::ImageService => "ImageService.Pull",
        }
    }
}

impl NodeClient {
    /// The node's boot ID (`MachineService.Read` of [`BOOT_ID_PATH`]).
    pub async fn boot_id(&self) -> Result<String, ApiError> {
        let bytes = self
            .read_file(BOOT_ID_PATH, "the boot ID", BOOT_ID_LIMIT)
            .await?;
        Ok(String::from_utf8_lossy(&bytes).trim().to_owned())
    }

    /// `MachineService.Read` of `path` (machined streams the file), at most
    /// `limit` bytes.
    async fn read_file(
        &self,
        path: &str,
        what: &'static str,
        limit: usize,
    ) -> Result<Vec<u8>, ApiError> {
        let req = ReadRequest { path: path.into() };
        let mut stream = self.call(self.machine().read(self.request(req))).await?;
        let read = async {
            let mut out = Vec::new();
            loop {
                match stream.message().await {
                    Ok(Some(chunk)) => {
                        self.check(std::slice::from_ref(&chunk))?;
                        out.extend_from_slice(&chunk.bytes);
                        if out.len() > limit {
                            return Err(ApiError::TooLarge { what, limit });
                        }
                    }
                    Ok(None) => return Ok(out),
                    Err(s) => return Err(self.fail(s).await),
                }
            }
        };
        self.within(read).await?
    }

    /// The machine config the node persisted: what its next boot runs (a
    /// STAGED apply's config until that boot; behind the running one while
    /// a TRY is pending). From Talos v1.10 the COSI resource
    /// `MachineConfigs.config.talos.dev` `persistent` (siderolabs/talos
    /// `pkg/machinery/resources/config/machine_config.go`, `PersistentID`);
    /// v1.9 has no such resource and the file at `constants.ConfigPath` is
    /// read instead. None when the node has none.
    pub async fn persisted_config(&self, as_resource: bool) -> Result<Option<Vec<u8>>, ApiError> {
        if !as_resource {
            return match self
                .read_file(PERSISTED_CONFIG_PATH, "the persisted config", CONFIG_LIMIT)
                .await
            {
                Ok(b) => Ok(Some(b)),
                Err(e) if e.code() == Some(tonic::Code::NotFound) => Ok(None),
                Err(e) => Err(e),
            };
        }
        self.machine_config("persistent").await
    }

    /// The COSI resource `MachineConfigs.config.talos.dev` `id`: its YAML,
    /// the config as applied (`v1alpha1`: the active one, every version;
    /// `persistent` from v1.10). None when the node has no such resource.
    pub async fn machine_config(&self, id: &str) -> Result<Option<Vec<u8>>, ApiError> {
        let resource = ("config", "MachineConfigs.config.talos.dev", id);
        let yaml = self
            .cosi_get(resource, "a machine config", CONFIG_LIMIT)
            .await?;
        Ok(yaml.map(String::into_bytes))
    }

    /// `MachineService.Reboot`: the node stops its pods and services and
    /// reboots (no drain: the client drains first where it must).
    pub async fn reboot(&self, mode: RebootMode) -> Result<(), ApiError> {
        let req = RebootRequest {
            mode: match mode {
                RebootMode::Default => reboot_request::Mode::Default,
                RebootMode::Powercycle => reboot_request::Mode::Powercycle,
            } as i32,
        };
        let reply = self.call(self.machine().reboot(self.request(req))).await?;
        self.check(&reply.messages)
    }

    /// `MachineService.Upgrade` (below v1.13; deprecated from v1.13, removed
    /// in v1.18): the node pulls and validates the installer, checks etcd
    /// unless forced, acks, then drains, installs and reboots on its own.
    /// The pull happens before the ack, so the call needs a deadline that
    /// covers it: connect this client with the pull timeout.
    pub async fn upgrade(&self, image: &str, flags: UpgradeFlags) -> Result<String, ApiError> {
        let req = UpgradeRequest {
            image: image.to_owned(),
            preserve: flags.preserve,
            stage: false,
            force: flags.force,
            reboot_mode: match flags.reboot_mode {
                RebootMode::Default => upgrade_request::RebootMode::Default,
                RebootMode::Powercycle => upgrade_request::RebootMode::Powercycle,
            } as i32,
        };
        let reply = self.call(self.machine().upgrade(self.request(req))).await?;
        self.check(&reply.messages)?;
        Ok(reply
            .messages
            .into_iter()
            .map(|m| m.ack)
            .collect::<Vec<_>>()
            .join("; "))
    }

    /// `ImageService.Pull` of the installer into the system containerd
    /// (v1.13+), read to its end: the name of the pulled image.
    pub async fn pull(&self, image: &str) -> Result<String, ApiError> {
        self.pull_into(image, ContainerdNamespace::NsSystem).await
    }

    /// `ImageService.Pull` of `image` into `namespace` of the system
    /// containerd (v1.13+): the installer.
    pub async fn pull_into(
        &self,
        image: &str,
        namespace: ContainerdNamespace,
    ) -> Result<String, ApiError> {
        self.pull_with(image, containerd(namespace)).await
    }

    /// Pre-pulls a Kubernetes image into the CRI containerd (the kubelet's
    /// into its `system` namespace) through `api`, as talosctl
    /// `upgrade-k8s` does (`talos_managed.go` `prePullImages`).
    pub async fn pull_kubernetes_image(
        &self,
        api: PullApi,
        image: &str,
        kubelet: bool,
    ) -> Result<(), ApiError> {
        match api {
            PullApi::ImagePull => {
                let req = ImagePullRequest {
                    namespace: kubernetes_namespace(kubelet) as i32,
                    reference: image.to_owned(),
                };
                let reply: super::api::machine::ImagePullResponse = self
                    .machine_unary("/machine.MachineService/ImagePull", req)
                    .await?;
                self.check(&reply.messages)
            }
            PullApi::ImageService => self
                .pull_with(image, kubernetes_containerd(kubelet))
                .await
                .map(drop),
        }
    }

    /// `ImageService.Pull` of `image` into `instance`, read to its end: the
    /// name of the pulled image.
    async fn pull_with(
        &self,
        image: &str,
        instance: ContainerdInstance,
    ) -> Result<String, ApiError> {
        let req = ImageServicePullRequest {
            containerd: Some(instance),
            image_ref: image.to_owned(),
        };
        let mut images = ImageServiceClient::new(self.channel.clone());
        let mut stream = self.call(images.pull(self.request(req))).await?;
        let read = async {
            let mut name = None;
            loop {
                match stream.message().await {
                    Ok(Some(reply)) => {
                        if let Some(PullReply::Name(n)) = reply.response {
                            name = Some(n);
                        }
                    }
                    Ok(None) => return Ok(name),
                    Err(s) => return Err(self.fail(s).await),
                }
            }
        };
        let name: Option<String> = self.within(read).await??;
        name.ok_or_else(|| ApiError::Status {
            code: tonic::Code::Unknown,
            message: format!("the pull of {image} ended without naming the image"),
        })
    }

    /// `LifecycleService.Upgrade` (v1.13+): runs the pulled installer on the
    /// system disk, streaming its progress to `progress`; the node does not
    /// reboot (the caller does). The installer's exit code, 0 for success.
    pub async fn lifecycle_upgrade(
        &self,
        image: &str,
        progress: &(dyn Fn(&str) + Sync),
    ) -> Result<i32, ApiError> {
        let req = LifecycleServiceUpgradeRequest {
            containerd: Some(system_containerd()),
            source: Some(InstallArtifactsSource {
                image_name: image.to_owned(),
            }),
        };
        let mut lifecycle = LifecycleServiceClient::new(self.channel.clone());
        let mut stream = self.call(lifecycle.upgrade(self.request(req))).await?;
        let read = async {
            let mut code = None;
            loop {
                match stream.message().await {
                    Ok(Some(reply)) => match reply.progress.and_then(|p| p.response) {
                        Some(Progress::Message(m)) => progress(&m),
                        Some(Progress::ExitCode(c)) => code = Some(c),
                        None => {}
                    },
                    Ok(None) => return Ok(code),
                    Err(s) => return Err(self.fail(s).await),
                }
            }
        };
        let code: Option<i32> = self.within(read).await??;
        code.ok_or_else(|| ApiError::Status {
            code: tonic::Code::Unknown,
            message: "the upgrade stream ended without the installer's exit code".into(),
        })
    }
}

fn from_rustls(e: &rustls::Error) -> ApiError {
    use rustls::{AlertDescription, CertificateError, Error};
    match e {
        Error::AlertReceived(AlertDescription::CertificateRequired) => {
            ApiError::CertificateRequired
        }
        Error::InvalidCertificate(CertificateError::Other(other))
            if let Some(m) = other.0.downcast_ref::<tls::PinMismatch>() =>
        {
            ApiError::PinMismatch {
                expected: m.expected.hex(),
                found: m.found.hex(),
            }
        }
        Error::InvalidCertificate(CertificateError::NotValidForNameContext {
            expected,
            presented,
        }) => ApiError::WrongName {
            expected: expected.to_str().into_owned(),
            presented: presented.iter().map(|n| plain_name(n)).collect(),
        },
        Error::InvalidCertificate(CertificateError::NotValidForName) => ApiError::WrongName {
            expected: String::new(),
            presented: Vec::new(),
        },
        Error::InvalidCertificate(CertificateError::UnknownIssuer)
        | Error::InvalidCertificate(CertificateError::BadSignature)
        | Error::AlertReceived(AlertDescription::UnknownCA)
        | Error::AlertReceived(AlertDescription::BadCertificate) => {
            ApiError::UnknownAuthority(e.to_string())
        }
        other => ApiError::Tls(other.to_string()),
    }
}

/// A name as webpki presents it (`IpAddress(10.0.0.1)`, `DnsName("cp-01")`)
/// as a user writes it.
fn plain_name(presented: &str) -> String {
    presented
        .split_once('(')
        .and_then(|(_, rest)| rest.strip_suffix(')'))
        .unwrap_or(presented)
        .trim_matches('"')
        .to_owned()
}

/// Finds the TLS or socket failure inside a transport error.
fn classify(e: &(dyn StdError + 'static)) -> Option<ApiError> {
    let mut cur: Option<&(dyn StdError + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(r) = tls::rustls_error(err) {
            return Some(from_rustls(r));
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if let Some(p) = proxy_error(io) {
                return Some(p);
            }
            // Alerts read after the handshake reach us as text only.
            let text = io.to_string();
            if text.contains("received fatal alert: CertificateRequired") {
                return Some(ApiError::CertificateRequired);
            }
            if ["UnknownCA", "BadCertificate", "UnknownIssuer"]
                .iter()
                .any(|a| text.contains(a))
            {
                return Some(ApiError::UnknownAuthority(text));
            }
            use std::io::ErrorKind::*;
            if matches!(
                io.kind(),
                ConnectionRefused | ConnectionReset | ConnectionAborted | TimedOut | NotConnected
            ) {
                return Some(ApiError::Unreachable(io.to_string()));
            }
        }
        cur = err.source();
    }
    None
}

/// A failure of the proxy in between, named as such: a refused CONNECT, a
/// proxy that cannot be reached or does not speak HTTP.
fn proxy_error(io: &std::io::Error) -> Option<ApiError> {
    io.get_ref()
        .and_then(|e| e.downcast_ref::<proxy::ProxyError>())
        .map(|e| ApiError::Proxy(e.to_string()))
}

/// Checks the per-node envelopes of a reply: an error apid put there
/// becomes the call's error, and a call routed to `routed_to` must come
/// back stamped with exactly that target.
fn check<M: Reply>(routed_to: Option<&str>, messages: &[M]) -> Result<(), ApiError> {
    if let Some(md) = messages
        .iter()
        .filter_map(Reply::metadata)
        .find(|md| !md.error.is_empty())
    {
        return Err(envelope_error(md));
    }
    let Some(target) = routed_to else {
        return Ok(());
    };
    let answered: Vec<String> = messages
        .iter()
        .map(|m| {
            m.metadata()
                .map(|md| md.hostname.clone())
                .unwrap_or_default()
        })
        .collect();
    if answered.is_empty() || answered.iter().any(|h| h != target) {
        return Err(ApiError::Misrouted {
            target: target.to_owned(),
            answered,
        });
    }
    Ok(())
}

/// The error apid reports for a failed target inside a reply: its gRPC
/// status when given, else the text alone.
fn envelope_error(md: &Metadata) -> ApiError {
    match &md.status {
        Some(st) => ApiError::Status {
            code: tonic::Code::from(st.code),
            message: if st.message.is_empty() {
                md.error.clone()
            } else {
                st.message.clone()
            },
        },
        None => ApiError::Status {
            code: tonic::Code::Unknown,
            message: md.error.clone(),
        },
    }
}

fn status_error(s: &tonic::Status, timeout: Duration) -> ApiError {
    if let Some(err) = classify(s) {
        return err;
    }
    // A transport failure inside a call surfaces as Unavailable/Unknown whose
    // message is all that is left of the TLS alert.
    let msg = s.message();
    if msg.contains("certificate required") || msg.contains("CertificateRequired") {
        return ApiError::CertificateRequired;
    }
    if s.code() == tonic::Code::DeadlineExceeded && msg.contains("Timeout expired") {
        return ApiError::Timeout(timeout);
    }
    ApiError::Status {
        code: s.code(),
        message: msg.to_owned(),
    }
}

/// What a node's SecurityState says (its spec's YAML field names).
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SecurityState {
    pub secure_boot: bool,
    #[serde(
        default,
        rename = "ukiSigningKeyFingerprint",
        skip_serializing_if = "Option::is_none"
    )]
    pub uki_signing_key_fingerprint: Option<String>,
    #[serde(
        default,
        rename = "pcrSigningKeyFingerprint",
        skip_serializing_if = "Option::is_none"
    )]
    pub pcr_signing_key_fingerprint: Option<String>,
}

/// The version of an extension status spec (`extensions.Layer` as YAML)
/// whose `metadata.name` is `schematic`.
fn schematic_extension_version(yaml: &str) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Layer {
        metadata: LayerMeta,
    }
    #[derive(serde::Deserialize)]
    struct LayerMeta {
        name: String,
        version: String,
    }
    let layer: Layer = serde_yaml_ng::from_str(yaml).ok()?;
    (layer.metadata.name == "schematic").then_some(layer.metadata.version)
}

#[cfg(test)]
mod tests {

    #[test]
    fn kubernetes_images_go_to_the_cri_containerd_on_every_talos_version() {
        use super::*;
        // talos api/machine/machine.proto, image.proto: ImagePull from v1.5, ImageService from v1.13.
        assert_eq!(PullApi::for_talos(1, 4), None);
        assert_eq!(PullApi::for_talos(1, 5), Some(PullApi::ImagePull));
        assert_eq!(PullApi::for_talos(1, 11), Some(PullApi::ImagePull));
        assert_eq!(PullApi::for_talos(1, 12), Some(PullApi::ImagePull));
        assert_eq!(PullApi::for_talos(1, 13), Some(PullApi::ImageService));
        assert_eq!(PullApi::for_talos(1, 14), Some(PullApi::ImageService));
        // Talos v1.13/v1.14 ImageService.Pull: driver CRI, never CONTAINERD
        // (ctrhelper.go refuses CONTAINERD with NS_CRI); the kubelet in the
        // CRI containerd's `system` namespace (services/kubelet.go).
        let pods = kubernetes_containerd(false);
        assert_eq!(pods.driver, ContainerDriver::Cri as i32);
        assert_eq!(pods.namespace, ContainerdNamespace::NsCri as i32);
        let kubelet = kubernetes_containerd(true);
        assert_eq!(kubelet.driver, ContainerDriver::Cri as i32);
        assert_eq!(kubelet.namespace, ContainerdNamespace::NsSystem as i32);
        // Talos v1.11 ImagePull: NS_CRI for the pods, NS_SYSTEM the kubelet.
        assert_eq!(kubernetes_namespace(false), ContainerdNamespace::NsCri);
        assert_eq!(kubernetes_namespace(true), ContainerdNamespace::NsSystem);
        // The installer stays in the system containerd.
        assert_eq!(
            system_containerd().driver,
            ContainerDriver::Containerd as i32
        );
    }

    #[test]
    fn the_schematic_comes_from_the_extension_named_schematic() {
        let id = "ab".repeat(32);
        let spec =
            format!("image: schematic.sqsh\nmetadata:\n    name: schematic\n    version: {id}\n");
        assert_eq!(schematic_extension_version(&spec), Some(id));
        let other = "image: x.sqsh\nmetadata:\n    name: qemu-guest-agent\n    version: 9.2.0\n";
        assert_eq!(schematic_extension_version(other), None);
        assert_eq!(schematic_extension_version("not: [yaml"), None);
    }

    use super::*;

    #[test]
    fn targets_default_to_port_50000_and_honour_endpoints() {
        let ip: IpAddr = "127.0.0.5".parse().unwrap();
        let t = NodeEndpoint::new(Some(ip), None).unwrap();
        assert_eq!(t.addr, "127.0.0.5:50000".parse().unwrap());
        let t = NodeEndpoint::new(Some(ip), Some("127.0.0.1:50001")).unwrap();
        assert_eq!(t.addr, "127.0.0.1:50001".parse().unwrap());
        assert_eq!(
            t.server_name, ip,
            "the certificate names the node, not the forward"
        );
        assert!(NodeEndpoint::new(None, None).is_none());
        assert!(NodeEndpoint::new(Some(ip), Some("host:port")).is_none());
    }

    fn version_stamped(hostname: &str, error: &str, code: i32) -> Version {
        Version {
            metadata: Some(Metadata {
                hostname: hostname.into(),
                error: error.into(),
                status: (code != 0).then(|| super::super::api::google::rpc::Status {
                    code,
                    message: "etcd is not running".into(),
                    details: Vec::new(),
                }),
            }),
            ..Version::default()
        }
    }

    #[test]
    fn routed_replies_must_carry_the_target_as_sent() {
        let direct = Version::default();
        // A direct call: apid's local backend adds no metadata.
        assert!(check(None, std::slice::from_ref(&direct)).is_ok());
        // Routed: the stamp must be the target exactly as sent.
        let stamped = version_stamped("10.0.0.12", "", 0);
        assert!(check(Some("10.0.0.12"), std::slice::from_ref(&stamped)).is_ok());
        for wrong in [direct, version_stamped("cp-02", "", 0)] {
            let err = check(Some("10.0.0.12"), &[wrong]).unwrap_err();
            assert!(matches!(err, ApiError::Misrouted { .. }), "{err:?}");
        }
        let none: [Version; 0] = [];
        assert!(matches!(
            check(Some("10.0.0.12"), &none),
            Err(ApiError::Misrouted { .. })
        ));
    }

    #[test]
    fn an_error_in_the_envelope_is_the_calls_error() {
        let failed = version_stamped(
            "10.0.0.12",
            "rpc error: code = FailedPrecondition desc = etcd is not running",
            tonic::Code::FailedPrecondition as i32,
        );
        match check(Some("10.0.0.12"), &[failed]) {
            Err(ApiError::Status { code, message }) => {
                assert_eq!(code, tonic::Code::FailedPrecondition);
                assert_eq!(message, "etcd is not running");
            }
            other => panic!("{other:?}"),
        }
        let bare = version_stamped("10.0.0.12", "dial tcp: no route to host", 0);
        match check(Some("10.0.0.12"), &[bare]) {
            Err(ApiError::Status { code, message }) => {
                assert_eq!(code, tonic::Code::Unknown);
                assert_eq!(message, "dial tcp: no route to host");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn rustls_failures_map_to_what_the_bootstrap_reacts_to() {
        use rustls::{AlertDescription, CertificateError, Error};
        let io = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            Error::AlertReceived(AlertDescription::CertificateRequired),
        );
        assert!(matches!(classify(&io), Some(ApiError::CertificateRequired)));
        let io = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            Error::InvalidCertificate(CertificateError::UnknownIssuer),
        );
        assert!(matches!(classify(&io), Some(ApiError::UnknownAuthority(_))));
        let io = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "received fatal alert: CertificateRequired",
        );
        assert!(matches!(classify(&io), Some(ApiError::CertificateRequired)));
        let io = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert!(matches!(classify(&io), Some(ApiError::Unreachable(_))));
        let io = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            Error::InvalidCertificate(CertificateError::NotValidForNameContext {
                expected: rustls::pki_types::ServerName::IpAddress(
                    "10.0.0.11".parse::<IpAddr>().unwrap().into(),
                ),
                presented: vec!["IpAddress(10.0.0.99)".into(), "DnsName(\"cp-01\")".into()],
            }),
        );
        let e = classify(&io).unwrap();
        assert_eq!(
            e.to_string(),
            "the node's certificate is not valid for 10.0.0.11: it names 10.0.0.99, cp-01"
        );
    }
}
