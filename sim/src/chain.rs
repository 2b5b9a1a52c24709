//! The link from a machine simulator (Proxmox, Hetzner) to the node
//! simulator's control server: when a machine starts, a Talos node boots for
//! it (`POST /_sim/boot`); when it stops, the node halts (`POST /_sim/halt`).
//! A minimal HTTP/1.1 client over loopback, so the simulators need no HTTP
//! client library.

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The node simulator's control server, as given by `--nodes-control`.
#[derive(Clone, Debug)]
pub struct Nodes {
    /// `host:port` (always loopback).
    addr: String,
}

impl Nodes {
    /// Takes the `control` URL the node simulator prints (`http://127.0.0.1:PORT`).
    pub fn parse(url: &str) -> anyhow::Result<Nodes> {
        let addr = url
            .strip_prefix("http://")
            .ok_or_else(|| anyhow::anyhow!("--nodes-control {url}: want http://127.x.y.z:PORT"))?
            .trim_end_matches('/');
        let sock: std::net::SocketAddr = addr
            .parse()
            .map_err(|_| anyhow::anyhow!("--nodes-control {url}: want http://127.x.y.z:PORT"))?;
        anyhow::ensure!(
            sock.ip().is_loopback(),
            "--nodes-control {url}: not a loopback address"
        );
        Ok(Nodes {
            addr: addr.to_owned(),
        })
    }

    /// Boots a node for a machine; `body` as the node simulator's
    /// `POST /_sim/boot` takes it.
    pub async fn boot(&self, body: &Value) -> Result<Value, String> {
        self.post("/_sim/boot", body).await
    }

    /// Halts the node on `ip`, with the node simulator's reply (`null` for a
    /// node that never booted, which is not an error).
    pub async fn halt(&self, ip: &str) -> Result<Value, String> {
        match self
            .post("/_sim/halt", &serde_json::json!({ "ip": ip }))
            .await
        {
            Ok(v) => Ok(v),
            Err(e) if e.starts_with("404") => Ok(Value::Null),
            Err(e) => Err(e),
        }
    }

    async fn post(&self, path: &str, body: &Value) -> Result<Value, String> {
        let failed = |e: std::io::Error| format!("node simulator at {}: {e}", self.addr);
        let body = body.to_string();
        let mut tcp = TcpStream::connect(&self.addr).await.map_err(failed)?;
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            self.addr,
            body.len()
        );
        tcp.write_all(head.as_bytes()).await.map_err(failed)?;
        tcp.write_all(body.as_bytes()).await.map_err(failed)?;
        let mut reply = Vec::new();
        tcp.read_to_end(&mut reply).await.map_err(failed)?;
        let reply = String::from_utf8_lossy(&reply);
        let (head, text) = reply.split_once("\r\n\r\n").unwrap_or((&reply, ""));
        let code = head.split(' ').nth(1).unwrap_or("000");
        if code != "200" {
            return Err(format!("{code} from the node simulator: {}", text.trim()));
        }
        serde_json::from_str(text).map_err(|e| format!("node simulator reply: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_control_urls_are_taken() {
        assert!(Nodes::parse("http://127.0.0.1:4000").is_ok());
        assert!(Nodes::parse("http://127.0.0.1:4000/").is_ok());
        assert!(Nodes::parse("http://10.0.0.1:4000").is_err());
        assert!(Nodes::parse("https://127.0.0.1:4000").is_err());
        assert!(Nodes::parse("127.0.0.1:4000").is_err());
    }
}
