//! The admin kubeconfig Talos hands out, and the one Kubernetes question the
//! health check asks: are all nodes registered and Ready?

use std::io::Read;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use serde_yaml_ng::Value;

use super::pki::{self, CertAndKey, LeafSpec};
use super::secrets::SecretsBundle;
use crate::net;

/// A node list is small; a reply larger than this is not one.
const NODE_LIST_LIMIT: u64 = 16 << 20;

/// Why a kubeconfig could not be read or used. Never quotes credentials.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    #[error("kubeconfig archive: {0}")]
    Archive(String),
    #[error("kubeconfig: {0}")]
    Invalid(String),
    #[error("Kubernetes API {server}: {message}")]
    Api { server: String, message: String },
    /// The admin certificate could not be issued from the secrets' CA.
    #[error("minting the admin kubeconfig from the secrets' Kubernetes CA (certs.k8s): {0}")]
    Mint(#[from] pki::PkiError),
}

/// How long a kubeconfig minted for one run stays valid: a day (the
/// smallest step [`pki::issue`] takes, five minutes backdated for clock
/// skew), longer than any run, and the key is never written.
pub const RUN_LIFETIME_DAYS: i64 = 1;

/// How long a kubeconfig minted on request (`imgbuild kubeconfig`) stays
/// valid: Talos's default `cluster.adminKubeconfig.certLifetime`, one year,
/// what `talosctl kubeconfig` hands out.
pub const REQUESTED_LIFETIME_DAYS: i64 = 365;

/// Mints a run's admin kubeconfig from the cluster's Kubernetes CA when
/// it is first needed, and holds, in memory only, the one the run uses
/// (the bootstrap's VIP fallback applied). Clones share it. The CA key is
/// a secret: `Debug` shows the cluster only.
#[derive(Clone)]
pub struct AdminKube {
    cluster: String,
    endpoint: String,
    ca: Arc<CertAndKey>,
    held: Arc<Mutex<Option<Kubeconfig>>>,
}

impl std::fmt::Debug for AdminKube {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminKube")
            .field("cluster", &self.cluster)
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

impl AdminKube {
    /// [`AdminKube::new`] with `secrets`' Kubernetes CA.
    pub fn of(cluster: &str, endpoint: &str, secrets: &SecretsBundle) -> AdminKube {
        let ca = secrets.certs.k8s.decode().expect("checked when loaded");
        AdminKube::new(cluster, endpoint, ca)
    }

    /// For cluster `cluster` whose machine configs carry `endpoint`
    /// (`cluster.controlPlane.endpoint`), signed by `k8s_ca` (`certs.k8s`).
    pub fn new(cluster: &str, endpoint: &str, k8s_ca: CertAndKey) -> AdminKube {
        AdminKube {
            cluster: cluster.to_owned(),
            endpoint: endpoint.to_owned(),
            ca: Arc::new(k8s_ca),
            held: Arc::new(Mutex::new(None)),
        }
    }

    /// The kubeconfig this run uses: the one held, else one minted now
    /// (valid [`RUN_LIFETIME_DAYS`]) and held from then on.
    pub fn get(&self) -> Result<Kubeconfig, KubeError> {
        self.get_settled(|kc| kc)
    }

    /// [`AdminKube::get`], a new one first passed through `settle` (pointed
    /// where the API answers). Concurrent callers wait for the first.
    pub fn get_settled(
        &self,
        settle: impl FnOnce(Kubeconfig) -> Kubeconfig,
    ) -> Result<Kubeconfig, KubeError> {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(kc) = held.as_ref() {
            return Ok(kc.clone());
        }
        let kc = settle(self.mint(RUN_LIFETIME_DAYS)?);
        *held = Some(kc.clone());
        Ok(kc)
    }

    /// From now on the run uses `kc` (the same identity, pointed where the
    /// API answers).
    pub fn hold(&self, kc: Kubeconfig) {
        *self.held.lock().unwrap_or_else(|e| e.into_inner()) = Some(kc);
    }

    /// A new admin kubeconfig valid `days`, not held.
    pub fn mint(&self, days: i64) -> Result<Kubeconfig, KubeError> {
        Kubeconfig::mint_admin(&self.cluster, &self.endpoint, &self.ca, days)
    }

    /// Whether `kc` trusts this cluster's Kubernetes CA: a kubeconfig made
    /// from other secrets does not serve this cluster.
    pub fn issued_for(&self, kc: &Kubeconfig) -> bool {
        let first = |pem: &str| pki::certs_der(pem).ok().and_then(|c| c.into_iter().next());
        first(&kc.ca).is_some() && first(&kc.ca) == first(&self.ca.crt)
    }
}

/// The most the kubeconfig inside the archive may unpack to: talosctl's is
/// a few KiB, and a small archive of zeros can unfold to gigabytes.
pub const KUBECONFIG_TEXT_LIMIT: u64 = 1 << 20;

/// The kubeconfig file from the `.tar.gz` the Kubeconfig call streams. The
/// archive has no end-of-archive blocks, so only the first entry is read,
/// and only up to [`KUBECONFIG_TEXT_LIMIT`] bytes of it.
pub fn from_archive(archive: &[u8]) -> Result<String, KubeError> {
    let gz = flate2::read::GzDecoder::new(archive);
    let mut tar = tar::Archive::new(gz);
    let mut entries = tar
        .entries()
        .map_err(|e| KubeError::Archive(e.to_string()))?;
    let mut entry = entries
        .next()
        .ok_or_else(|| KubeError::Archive("empty archive".into()))?
        .map_err(|e| KubeError::Archive(e.to_string()))?;
    if entry.size() > KUBECONFIG_TEXT_LIMIT {
        return Err(KubeError::Archive(format!(
            "the kubeconfig inside is larger than {KUBECONFIG_TEXT_LIMIT} bytes"
        )));
    }
    let mut text = String::new();
    (&mut entry)
        .take(KUBECONFIG_TEXT_LIMIT + 1)
        .read_to_string(&mut text)
        .map_err(|e| KubeError::Archive(format!("first entry: {e}")))?;
    if text.len() as u64 > KUBECONFIG_TEXT_LIMIT {
        return Err(KubeError::Archive(format!(
            "the kubeconfig inside is larger than {KUBECONFIG_TEXT_LIMIT} bytes"
        )));
    }
    Ok(text)
}

/// A parsed admin kubeconfig (current context only).
#[derive(Clone)]
pub struct Kubeconfig {
    doc: Value,
    pub server: String,
    /// The name the server's certificate must carry when `server` is not
    /// it (kubectl's `tls-server-name`): the in-cluster endpoint's host
    /// when the API is reached through a port forward.
    pub tls_server_name: Option<String>,
    ca: String,
    crt: String,
    key: String,
}

impl std::fmt::Debug for Kubeconfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kubeconfig")
            .field("server", &self.server)
            .field("tls_server_name", &self.tls_server_name)
            .finish_non_exhaustive()
    }
}

fn named<'a>(doc: &'a Value, list: &str, name: &str) -> Option<&'a Value> {
    doc.get(list)?
        .as_sequence()?
        .iter()
        .find(|e| e.get("name").and_then(Value::as_str) == Some(name))
}

fn data(v: Option<&Value>, field: &str) -> Result<String, KubeError> {
    let b64 = v
        .and_then(|v| v.get(field))
        .and_then(Value::as_str)
        .ok_or_else(|| KubeError::Invalid(format!("no {field}")))?;
    let bytes = STANDARD
        .decode(b64.trim())
        .map_err(|_| KubeError::Invalid(format!("{field}: not base64")))?;
    String::from_utf8(bytes).map_err(|_| KubeError::Invalid(format!("{field}: not PEM text")))
}

impl Kubeconfig {
    /// The admin kubeconfig Talos hands out, minted offline as
    /// siderolabs/talos `pkg/kubeconfig/generate.go`
    /// (`GenerateAdmin`, `Generate`) does: a client certificate
    /// CN=admin, O=system:masters signed by the Kubernetes CA, that CA as
    /// the trusted one, `endpoint` as the server, user and context
    /// `admin@<cluster>`. Valid `days`.
    pub fn mint_admin(
        cluster: &str,
        endpoint: &str,
        k8s_ca: &CertAndKey,
        days: i64,
    ) -> Result<Kubeconfig, KubeError> {
        let admin = pki::issue(
            k8s_ca,
            &LeafSpec {
                organization: Some("system:masters".into()),
                common_name: "admin".into(),
                client: true,
                days,
                ..LeafSpec::default()
            },
        )?;
        let user = format!("admin@{cluster}");
        let doc = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": cluster, "cluster": {
                "server": endpoint,
                "certificate-authority-data": STANDARD.encode(&k8s_ca.crt),
            }}],
            "users": [{"name": user, "user": {
                "client-certificate-data": STANDARD.encode(&admin.crt),
                "client-key-data": STANDARD.encode(&admin.key),
            }}],
            "contexts": [{"name": user, "context": {
                "cluster": cluster,
                "namespace": "default",
                "user": user,
            }}],
            "current-context": user,
        });
        let text = serde_yaml_ng::to_string(&doc).expect("kubeconfig serialises");
        Kubeconfig::parse(&text)
    }

    /// Parses kubeconfig YAML.
    pub fn parse(text: &str) -> Result<Kubeconfig, KubeError> {
        let doc: Value = serde_yaml_ng::from_str(text)
            .map_err(|e| KubeError::Invalid(format!("not YAML: {e}")))?;
        let current = doc
            .get("current-context")
            .and_then(Value::as_str)
            .ok_or_else(|| KubeError::Invalid("no current-context".into()))?;
        let ctx = named(&doc, "contexts", current)
            .and_then(|c| c.get("context"))
            .ok_or_else(|| KubeError::Invalid(format!("context {current:?} missing")))?;
        let cluster_name = ctx.get("cluster").and_then(Value::as_str).unwrap_or("");
        let user_name = ctx.get("user").and_then(Value::as_str).unwrap_or("");
        let cluster = named(&doc, "clusters", cluster_name).and_then(|c| c.get("cluster"));
        let user = named(&doc, "users", user_name).and_then(|u| u.get("user"));
        let server = cluster
            .and_then(|c| c.get("server"))
            .and_then(Value::as_str)
            .ok_or_else(|| KubeError::Invalid(format!("cluster {cluster_name:?} has no server")))?
            .to_owned();
        let tls_server_name = cluster
            .and_then(|c| c.get("tls-server-name"))
            .and_then(Value::as_str)
            .map(str::to_owned);
        Ok(Kubeconfig {
            tls_server_name,
            ca: data(cluster, "certificate-authority-data")?,
            crt: data(user, "client-certificate-data")?,
            key: data(user, "client-key-data")?,
            server,
            doc,
        })
    }

    /// The same kubeconfig pointing at `server` (every cluster entry).
    pub fn with_server(&self, server: &str) -> Kubeconfig {
        let mut doc = self.doc.clone();
        if let Some(list) = doc.get_mut("clusters").and_then(Value::as_sequence_mut) {
            for c in list {
                if let Some(cluster) = c.get_mut("cluster").and_then(Value::as_mapping_mut) {
                    cluster.insert("server".into(), server.into());
                }
            }
        }
        Kubeconfig {
            doc,
            server: server.to_owned(),
            ..self.clone()
        }
    }

    /// The same kubeconfig whose server certificate must name `name` (or,
    /// for `None`, the server's own host), in every cluster entry.
    pub fn with_tls_server_name(&self, name: Option<&str>) -> Kubeconfig {
        let mut doc = self.doc.clone();
        if let Some(list) = doc.get_mut("clusters").and_then(Value::as_sequence_mut) {
            for c in list {
                if let Some(cluster) = c.get_mut("cluster").and_then(Value::as_mapping_mut) {
                    match name {
                        Some(n) => cluster.insert("tls-server-name".into(), n.into()),
                        None => cluster.remove("tls-server-name"),
                    };
                }
            }
        }
        Kubeconfig {
            doc,
            tls_server_name: name.map(str::to_owned),
            ..self.clone()
        }
    }

    /// The same kubeconfig reaching the API at `outside` (a port forward,
    /// `cluster.kubernetesEndpoint`), checking the certificate against the
    /// name it carries, the in-cluster endpoint's host: kubectl's
    /// `tls-server-name`.
    pub fn through(&self, outside: &str, in_cluster_host: Option<&str>) -> Kubeconfig {
        self.with_server(outside)
            .with_tls_server_name(in_cluster_host)
    }

    /// The YAML text to write.
    pub fn to_yaml(&self) -> String {
        serde_yaml_ng::to_string(&self.doc).expect("kubeconfig serialises")
    }

    pub(crate) fn client(&self, timeout: Duration) -> Result<reqwest::blocking::Client, KubeError> {
        net::http_client(&net::HttpOptions {
            trust: match &self.tls_server_name {
                Some(name) => net::Trust::CaNamed {
                    ca: self.ca.clone(),
                    name: name.clone(),
                },
                None => net::Trust::Ca(self.ca.clone()),
            },
            identity: Some(net::ClientIdentity {
                crt: self.crt.clone(),
                key: self.key.clone(),
            }),
            connect_timeout: timeout,
            timeout,
            reuse_connections: false,
        })
        .map_err(|e| KubeError::Invalid(e.to_string()))
    }

    /// Every registered node and its Ready condition.
    /// Blocking: call it off the async runtime.
    pub fn node_readiness(&self, timeout: Duration) -> Result<Vec<NodeReady>, KubeError> {
        Ok(readiness(&self.get_json("/api/v1/nodes", timeout)?))
    }

    /// One GET of the API (`path` with its query), its reply as JSON,
    /// bounded like a node list. Blocking: call it off the async runtime.
    pub fn get_json(&self, path: &str, timeout: Duration) -> Result<serde_json::Value, KubeError> {
        self.send_json(reqwest::Method::GET, path, None, timeout)
    }

    /// One request with an optional JSON body and its content type (a
    /// node's patch, a pod's eviction), its reply as JSON, bounded like a
    /// node list. Blocking: call it off the async runtime.
    pub fn send_json(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<(&str, &serde_json::Value)>,
        timeout: Duration,
    ) -> Result<serde_json::Value, KubeError> {
        let api = |message: String| KubeError::Api {
            server: self.server.clone(),
            message,
        };
        let url = format!("{}{path}", self.server.trim_end_matches('/'));
        // The call timeout bounds the whole exchange, body included: a
        // reply trickling inside the stall timeout ends with it (without
        // it, the 10-minute request deadline applied).
        let mut request = self.client(timeout)?.request(method, &url).timeout(timeout);
        if let Some((content_type, body)) = body {
            request = request
                .header(reqwest::header::CONTENT_TYPE, content_type)
                .body(body.to_string());
        }
        let reply = net::send_once(request).map_err(|e| api(e.to_string()))?;
        let body = net::read_limited(reply, NODE_LIST_LIMIT).map_err(|e| api(e.to_string()))?;
        serde_json::from_slice(&body).map_err(|e| api(format!("{path}: not JSON: {e}")))
    }
}

/// One Kubernetes node as the health check reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeReady {
    pub name: String,
    /// The Ready condition is True.
    pub ready: bool,
    /// The Ready condition's message (the kubelet's reason when not Ready).
    pub message: String,
}

/// Each item of a `NodeList` with its Ready condition.
fn readiness(list: &serde_json::Value) -> Vec<NodeReady> {
    list["items"]
        .as_array()
        .map(|items| {
            items
                .iter()
                .map(|n| {
                    let condition = n["status"]["conditions"]
                        .as_array()
                        .and_then(|cs| cs.iter().find(|c| c["type"] == "Ready"));
                    NodeReady {
                        name: n["metadata"]["name"].as_str().unwrap_or("").to_owned(),
                        ready: condition.is_some_and(|c| c["status"] == "True"),
                        message: condition
                            .and_then(|c| c["message"].as_str())
                            .unwrap_or("")
                            .to_owned(),
                    }
                })
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::talos::pki;

    /// A Kubernetes API reply that trickles (a byte of chunked body every
    /// 100 ms for 45 s, inside any stall timeout) ends at the call
    /// timeout, not at the 10-minute request deadline.
    #[test]
    fn a_trickling_reply_ends_at_the_call_timeout() {
        use std::io::Write;
        use std::sync::Arc;
        let ca = pki::new_ca(pki::KeyKind::EcdsaP256, "kubernetes", None, 1).unwrap();
        let leaf = |server: bool| pki::LeafSpec {
            organization: None,
            common_name: "kube-apiserver".into(),
            ips: vec!["127.0.0.1".parse().unwrap()],
            dns_names: Vec::new(),
            client: !server,
            server,
            days: 1,
        };
        let server = pki::issue(&ca, &leaf(true)).unwrap();
        let admin = pki::issue(&ca, &leaf(false)).unwrap();
        let config = Arc::new(
            rustls::ServerConfig::builder_with_provider(crate::net::tls::provider())
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_no_client_auth()
                .with_single_cert(
                    pki::certs_der(&server.crt).unwrap(),
                    pki::private_key_der(&server.key).unwrap(),
                )
                .unwrap(),
        );
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for tcp in listener.incoming().flatten() {
                let config = config.clone();
                std::thread::spawn(move || {
                    let conn = rustls::ServerConnection::new(config).unwrap();
                    let mut tls = rustls::StreamOwned::new(conn, tcp);
                    let mut head = [0u8; 4096];
                    let _ = tls.read(&mut head);
                    let _ = tls.write_all(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n",
                    );
                    for _ in 0..450 {
                        if tls
                            .write_all(b"1\r\n \r\n")
                            .and_then(|()| tls.flush())
                            .is_err()
                        {
                            return;
                        }
                        std::thread::sleep(Duration::from_millis(100));
                    }
                });
            }
        });
        let b = |s: &str| STANDARD.encode(s);
        let kc = Kubeconfig::parse(&format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: t\n  cluster:\n    server: https://127.0.0.1:{port}\n    certificate-authority-data: {}\nusers:\n- name: a\n  user:\n    client-certificate-data: {}\n    client-key-data: {}\ncontexts:\n- context:\n    cluster: t\n    user: a\n  name: a\ncurrent-context: a\n",
            b(&ca.crt),
            b(&admin.crt),
            b(&admin.key)
        ))
        .unwrap();
        let started = std::time::Instant::now();
        let err = kc
            .get_json("/api/v1/nodes", Duration::from_secs(1))
            .unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(30), "{err}");
    }

    /// An admin kubeconfig for `https://10.0.0.10:6443` with a fresh CA.
    pub(crate) fn sample() -> String {
        let b = |s: &str| STANDARD.encode(s);
        let ca = pki::new_ca(pki::KeyKind::EcdsaP256, "kubernetes", None, 1).unwrap();
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: atlas\n  cluster:\n    server: https://10.0.0.10:6443\n    certificate-authority-data: {}\nusers:\n- name: admin@atlas\n  user:\n    client-certificate-data: {}\n    client-key-data: {}\ncontexts:\n- context:\n    cluster: atlas\n    namespace: default\n    user: admin@atlas\n  name: admin@atlas\ncurrent-context: admin@atlas\n",
            b(&ca.crt),
            b(&ca.crt),
            b(&ca.key)
        )
    }

    #[test]
    fn first_entry_of_an_archive_without_end_blocks() {
        let text = sample();
        let mut tar = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(text.len() as u64);
        h.set_mode(0o600);
        tar.append_data(&mut h, "kubeconfig", text.as_bytes())
            .unwrap();
        let mut raw = tar.into_inner().unwrap();
        // Talos' archive stops after the entry: drop the two zero blocks.
        raw.truncate(raw.len() - 1024);
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        std::io::Write::write_all(&mut gz, &raw).unwrap();
        let archive = gz.finish().unwrap();
        assert_eq!(from_archive(&archive).unwrap(), text);
        assert!(from_archive(b"not gzip").is_err());
    }

    /// A gzip'd tar whose one entry is `size` zeros under a header that
    /// says `declared`.
    fn zeros_archive(size: u64, declared: u64) -> Vec<u8> {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        let mut h = tar::Header::new_gnu();
        h.set_path("kubeconfig").unwrap();
        h.set_size(declared);
        h.set_mode(0o600);
        h.set_cksum();
        std::io::Write::write_all(&mut gz, h.as_bytes()).unwrap();
        std::io::copy(&mut std::io::repeat(0).take(size), &mut gz).unwrap();
        gz.finish().unwrap()
    }

    #[test]
    fn an_archive_unpacking_past_the_limit_is_refused_unread() {
        // Declared honestly: refused from the header.
        let honest = zeros_archive(64 << 20, 64 << 20);
        let e = from_archive(&honest).unwrap_err().to_string();
        assert!(e.contains("larger than 1048576 bytes"), "{e}");
        // A header that lies small and a body that goes on: cut at the limit.
        let liar = zeros_archive(64 << 20, 100);
        assert_eq!(from_archive(&liar).unwrap().len(), 100);
        let liar = zeros_archive(8 << 20, KUBECONFIG_TEXT_LIMIT);
        assert_eq!(
            from_archive(&liar).unwrap().len() as u64,
            KUBECONFIG_TEXT_LIMIT
        );
    }

    #[test]
    fn server_is_rewritten_everywhere_and_nothing_else_changes() {
        let kc = Kubeconfig::parse(&sample()).unwrap();
        assert_eq!(kc.server, "https://10.0.0.10:6443");
        let moved = kc.with_server("https://10.0.0.11:6443");
        let again = Kubeconfig::parse(&moved.to_yaml()).unwrap();
        assert_eq!(again.server, "https://10.0.0.11:6443");
        assert_eq!(again.ca, kc.ca);
        assert_eq!(again.key, kc.key);
        assert!(!format!("{kc:?}").contains("PRIVATE"));
    }

    #[test]
    fn tls_server_name_is_written_read_and_removed() {
        let kc = Kubeconfig::parse(&sample()).unwrap();
        assert_eq!(kc.tls_server_name, None);
        let named = kc
            .with_server("https://127.0.0.1:6443")
            .with_tls_server_name(Some("10.5.0.2"));
        let again = Kubeconfig::parse(&named.to_yaml()).unwrap();
        assert_eq!(again.server, "https://127.0.0.1:6443");
        assert_eq!(again.tls_server_name.as_deref(), Some("10.5.0.2"));
        assert!(named.to_yaml().contains("tls-server-name: 10.5.0.2"));
        let plain = again.with_tls_server_name(None);
        assert!(!plain.to_yaml().contains("tls-server-name"));
        assert_eq!(
            Kubeconfig::parse(&plain.to_yaml()).unwrap().tls_server_name,
            None
        );
    }

    #[test]
    fn readiness_reads_the_ready_condition() {
        let list = serde_json::json!({"items": [
            {"metadata": {"name": "a"}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}},
            {"metadata": {"name": "b"}, "status": {"conditions": [
                {"type": "MemoryPressure", "status": "False", "message": "ok"},
                {"type": "Ready", "status": "False", "message": "cni plugin not initialized"}]}},
            {"metadata": {"name": "c"}, "status": {}},
        ]});
        let seen: Vec<(String, bool, String)> = readiness(&list)
            .into_iter()
            .map(|n| (n.name, n.ready, n.message))
            .collect();
        assert_eq!(
            seen,
            [
                ("a".into(), true, "".into()),
                ("b".into(), false, "cni plugin not initialized".into()),
                ("c".into(), false, "".into())
            ]
        );
    }

    /// The subject's, or the issuer's, attribute values of type `oid`.
    fn names(der: &[u8], issuer: bool, oid: &x509_parser::der_parser::Oid) -> Vec<String> {
        use x509_parser::prelude::*;
        let (_, cert) = X509Certificate::from_der(der).unwrap();
        let name = if issuer {
            cert.issuer()
        } else {
            cert.subject()
        };
        name.iter_by_oid(oid)
            .map(|a| a.as_str().unwrap().to_owned())
            .collect()
    }

    #[test]
    fn the_minted_admin_kubeconfig_is_talos_admin_under_the_kubernetes_ca() {
        use x509_parser::oid_registry::{OID_X509_COMMON_NAME, OID_X509_ORGANIZATION_NAME};
        let secrets = crate::talos::secrets::tests::bundle();
        let k8s = secrets.certs.k8s.decode().unwrap();
        let minter = AdminKube::of("atlas", "https://10.0.0.10:6443", secrets);
        let kc = minter.get().unwrap();
        assert_eq!(kc.server, "https://10.0.0.10:6443");
        assert_eq!(kc.tls_server_name, None);
        // The trusted CA is the bundle's Kubernetes CA, nothing else.
        assert_eq!(kc.ca, k8s.crt);
        let der = pki::certs_der(&kc.crt).unwrap().remove(0);
        assert_eq!(names(&der, false, &OID_X509_COMMON_NAME), ["admin"]);
        assert_eq!(
            names(&der, false, &OID_X509_ORGANIZATION_NAME),
            ["system:masters"]
        );
        let ca_der = pki::certs_der(&k8s.crt).unwrap().remove(0);
        assert_eq!(
            names(&der, true, &OID_X509_COMMON_NAME),
            names(&ca_der, false, &OID_X509_COMMON_NAME)
        );
        // Signed by that CA's key (not merely naming it as issuer).
        {
            use x509_parser::prelude::*;
            let (_, cert) = X509Certificate::from_der(&der).unwrap();
            let (_, ca) = X509Certificate::from_der(&ca_der).unwrap();
            cert.verify_signature(Some(ca.public_key())).unwrap();
            let other = pki::new_ca(pki::KeyKind::EcdsaP256, "kubernetes", None, 1).unwrap();
            let other_der = pki::certs_der(&other.crt).unwrap().remove(0);
            let (_, other) = X509Certificate::from_der(&other_der).unwrap();
            assert!(cert.verify_signature(Some(other.public_key())).is_err());
        }
        // Valid for the run: a day, five minutes backdated for clock skew.
        let info = pki::cert_info(&kc.crt).unwrap();
        let now = time::OffsetDateTime::now_utc().unix_timestamp();
        assert!((now - info.not_before - 300).abs() < 60, "{info:?}");
        assert!(
            (info.not_after - now - RUN_LIFETIME_DAYS * 86400).abs() < 60,
            "{info:?}"
        );
        assert!(pki::key_matches(&kc.crt, &kc.key).unwrap());
        // The file as Talos writes it: user and context admin@<cluster>.
        let yaml = kc.to_yaml();
        assert!(yaml.contains("current-context: admin@atlas"), "{yaml}");
        assert!(yaml.contains("namespace: default"), "{yaml}");
        // The key stays out of Debug.
        assert!(!format!("{kc:?}{minter:?}").contains("PRIVATE"));
    }

    #[test]
    fn a_run_mints_once_and_holds_where_the_api_answered() {
        let minter = AdminKube::of(
            "atlas",
            "https://10.0.0.10:6443",
            crate::talos::secrets::tests::bundle(),
        );
        let first = minter.get().unwrap();
        // A clone shares what is held: the same certificate, not a new one.
        assert_eq!(minter.clone().get().unwrap().crt, first.crt);
        minter.hold(first.with_server("https://10.0.0.11:6443"));
        let moved = minter.get().unwrap();
        assert_eq!(moved.server, "https://10.0.0.11:6443");
        assert_eq!(moved.crt, first.crt);
        // A fresh mint is a new certificate, of the requested length.
        let asked = minter.mint(REQUESTED_LIFETIME_DAYS).unwrap();
        assert_ne!(asked.crt, first.crt);
        let info = pki::cert_info(&asked.crt).unwrap();
        assert_eq!((info.not_after - info.not_before + 300) / 86400, 365);
    }

    #[test]
    fn a_kubeconfig_from_other_secrets_is_not_issued_for_this_cluster() {
        let minter = AdminKube::of(
            "atlas",
            "https://10.0.0.10:6443",
            crate::talos::secrets::tests::bundle(),
        );
        assert!(minter.issued_for(&minter.get().unwrap()));
        // `sample()` has a CA of its own.
        assert!(!minter.issued_for(&Kubeconfig::parse(&sample()).unwrap()));
    }

    #[test]
    fn broken_kubeconfigs_say_what_is_missing() {
        let text = sample().replace("current-context: admin@atlas", "current-context: x");
        let err = Kubeconfig::parse(&text).unwrap_err().to_string();
        assert!(err.contains("context \"x\" missing"), "{err}");
    }
}
