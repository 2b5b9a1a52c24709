//! The Talos API as talosctl opens it (mutual TLS, HTTP/2 on port 50000),
//! for tests that drive the node simulator directly, not through imgbuild's
//! own client.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use imgbuild::talos::pki::{self, CertAndKey};
use rustls::pki_types::ServerName;
use tonic::transport::{Channel, Endpoint};

/// A channel to the node at `ip`, trusting `ca` and showing `admin`.
pub async fn channel(
    ca: &CertAndKey,
    admin: &CertAndKey,
    ip: IpAddr,
) -> Result<Channel, tonic::transport::Error> {
    let mut roots = rustls::RootCertStore::empty();
    for der in pki::certs_der(&ca.crt).unwrap() {
        roots.add(der).unwrap();
    }
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(
            pki::certs_der(&admin.crt).unwrap(),
            pki::private_key_der(&admin.key).unwrap(),
        )
        .unwrap();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let config = Arc::new(config);
    let connector = tower::service_fn(move |_: tonic::codegen::http::Uri| {
        let config = config.clone();
        async move {
            let tcp = tokio::net::TcpStream::connect(SocketAddr::new(ip, 50000)).await?;
            let tls = tokio_rustls::TlsConnector::from(config)
                .connect(ServerName::IpAddress(ip.into()), tcp)
                .await?;
            Ok::<_, std::io::Error>(TokioIo::new(tls))
        }
    });
    Endpoint::from_static("http://talos-node")
        .connect_timeout(Duration::from_secs(3))
        .connect_with_connector(connector)
        .await
}
