//! Where and as whom to reach the API, read from the environment.

use crate::digest::Sha256;
use crate::inventory::ProxmoxSettings;
use crate::net::Trust;
use crate::publish::Secret;

use super::error::ProxmoxError;

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
pub(super) fn token_shape_ok(t: &str) -> bool {
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
