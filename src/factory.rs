//! Image Factory client: registers schematics (checking the factory agrees
//! on the ID), lists versions and official extensions, and spells image
//! URLs the way talosctl and talhelper print them (installer references,
//! which need no client, are `schematic::installer`).

use crate::net::{self, NetError, RetryPolicy};
use crate::schematic::{Schematic, SchematicId};
use reqwest::blocking::{Client, RequestBuilder};

/// Replies of the factory's JSON API are small; anything bigger is not one.
const REPLY_LIMIT: u64 = 4 << 20;

/// A factory at a base URL.
pub struct Factory<'a> {
    pub base: String,
    client: &'a Client,
    retry: RetryPolicy,
}

/// Why a factory call failed; every variant names the URL or the culprit.
#[derive(Debug, thiserror::Error)]
pub enum FactoryError {
    #[error(transparent)]
    Http(#[from] NetError),
    #[error(
        "{url}: the factory says the schematic ID is {theirs}, but it hashes to {ours} locally"
    )]
    IdMismatch {
        url: String,
        ours: String,
        theirs: String,
    },
    #[error("{url}: unexpected reply: {message}")]
    Reply { url: String, message: String },
    #[error("Talos {version} is not offered by {url} (it has: {})", offered.join(", "))]
    UnknownVersion {
        url: String,
        version: String,
        offered: Vec<String>,
    },
    #[error("extension {name} is not available for Talos {version} at {url}")]
    UnknownExtension {
        url: String,
        name: String,
        version: String,
    },
    #[error(transparent)]
    Emit(#[from] crate::schematic::EmitError),
}

/// One entry of `/version/{v}/extensions/official`. Only the name is read:
/// the entry's `ref` and OCI `digest` (`sha256:<hex>`, siderolabs/image-factory
/// `README.md`) name the container image, which the factory itself pulls.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Extension {
    pub name: String,
}

impl<'a> Factory<'a> {
    pub fn new(base: &str, client: &'a Client) -> Self {
        Factory {
            base: base.trim_end_matches('/').to_owned(),
            client,
            retry: RetryPolicy::default(),
        }
    }

    /// Retries busy or failing factories with `retry` (the downloads' policy).
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// Sends with retries; every factory call is idempotent (a schematic
    /// POSTed twice has one ID), so every retryable failure is retried.
    fn call(&self, make: &dyn Fn() -> RequestBuilder) -> Result<Vec<u8>, NetError> {
        let resp = net::send(&self.retry, make, &NetError::retryable, &mut |_, _, _| {})?;
        net::read_limited(resp, REPLY_LIMIT)
    }

    fn get_json<T: serde::de::DeserializeOwned>(&self, path: &str) -> Result<T, FactoryError> {
        let url = format!("{}{path}", self.base);
        let body = self.call(&|| self.client.get(&url))?;
        serde_json::from_slice(&body).map_err(|e| FactoryError::Reply {
            url,
            message: format!("not the JSON expected: {e}"),
        })
    }

    /// POSTs the schematic; the factory's ID must equal ours.
    pub fn register(&self, schematic: &Schematic) -> Result<SchematicId, FactoryError> {
        let canonical = schematic.canonical()?;
        let ours = crate::schematic::id_of(&canonical);
        let url = format!("{}/schematics", self.base);
        let body = self.call(&|| {
            self.client
                .post(&url)
                .header("content-type", "application/yaml")
                .body(canonical.clone())
        })?;
        #[derive(serde::Deserialize)]
        struct Created {
            id: String,
        }
        let created: Created = serde_json::from_slice(&body).map_err(|e| FactoryError::Reply {
            url: url.clone(),
            message: format!(
                "no schematic id in {:?}: {e}",
                String::from_utf8_lossy(&body[..body.len().min(200)])
            ),
        })?;
        if created.id != ours.as_str() {
            return Err(FactoryError::IdMismatch {
                url,
                ours: ours.to_string(),
                theirs: created.id,
            });
        }
        Ok(ours)
    }

    pub fn versions(&self) -> Result<Vec<String>, FactoryError> {
        self.get_json("/versions")
    }

    pub fn extensions(&self, version: &str) -> Result<Vec<Extension>, FactoryError> {
        self.get_json(&format!("/version/{version}/extensions/official"))
    }

    /// Fails unless the version is offered and every extension exists for it.
    pub fn check_available(&self, version: &str, wanted: &[String]) -> Result<(), FactoryError> {
        let offered = self.versions()?;
        if !offered.iter().any(|v| v == version) {
            return Err(FactoryError::UnknownVersion {
                url: format!("{}/versions", self.base),
                version: version.to_owned(),
                offered,
            });
        }
        let exts = self.extensions(version)?;
        for name in wanted {
            if !exts.iter().any(|e| &e.name == name) {
                return Err(FactoryError::UnknownExtension {
                    url: format!("{}/version/{version}/extensions/official", self.base),
                    name: name.clone(),
                    version: version.to_owned(),
                });
            }
        }
        Ok(())
    }

    /// Asks the factory's registry for an installer's manifest
    /// (`GET /v2/<image>/<id>/manifests/<tag>`, siderolabs/image-factory
    /// `internal/frontend/http/registry.go`): the factory builds an
    /// installer on its first request, so a node's pull later finds it
    /// ready. `installer` is `<host>/<image>/<id>:<tag>` on this factory.
    pub fn warm_installer(&self, installer: &str) -> Result<(), FactoryError> {
        let reply = |message: String| FactoryError::Reply {
            url: installer.to_owned(),
            message,
        };
        let (_, path) = installer
            .split_once('/')
            .ok_or_else(|| reply("not <host>/<image>/<id>:<tag>".into()))?;
        let (repo, tag) = path
            .rsplit_once(':')
            .ok_or_else(|| reply("no :<tag>".into()))?;
        let url = format!("{}/v2/{repo}/manifests/{tag}", self.base);
        self.call(&|| {
            self.client.get(&url).header(
                "accept",
                "application/vnd.oci.image.index.v1+json, application/vnd.oci.image.manifest.v1+json",
            )
        })?;
        Ok(())
    }

    /// `/image/{id}/{version}/{file}`: a boot asset such as `kernel-amd64`
    /// or `initramfs-amd64.xz`.
    pub fn asset_url(&self, id: &SchematicId, version: &str, file: &str) -> String {
        format!("{}/image/{id}/{version}/{file}", self.base)
    }

    /// The kernel command line the factory boots schematic `id` with
    /// (`/image/{id}/{version}/cmdline-{platform}-{arch}`, siderolabs/image-factory
    /// `internal/frontend/http/image.go`): the platform's arguments plus the
    /// schematic's extra ones, one line of text.
    pub fn cmdline(
        &self,
        id: &SchematicId,
        version: &str,
        platform: &str,
        arch: &str,
    ) -> Result<String, FactoryError> {
        let url = self.asset_url(id, version, &format!("cmdline-{platform}-{arch}"));
        let body = self.call(&|| self.client.get(&url))?;
        let reply = |message: String| FactoryError::Reply {
            url: url.clone(),
            message,
        };
        let text = String::from_utf8(body).map_err(|_| reply("not UTF-8 text".into()))?;
        let line = text.trim();
        if line.is_empty() || line.contains(['\n', '\r']) || line.chars().any(char::is_control) {
            return Err(reply(format!(
                "not one line of kernel arguments ({} bytes)",
                text.len()
            )));
        }
        Ok(line.to_owned())
    }

    /// `/image/{id}/{version}/{platform}-{arch}[-secureboot].{ext}`: the
    /// Secure Boot assets carry `-secureboot` after the architecture
    /// (siderolabs/talos `pkg/imager/profile` output names, as the factory
    /// parses them in `internal/frontend/http/image.go`).
    pub fn image_url(
        &self,
        id: &SchematicId,
        version: &str,
        platform: &str,
        arch: &str,
        secure_boot: bool,
        ext: &str,
    ) -> String {
        let sb = if secure_boot { "-secureboot" } else { "" };
        format!(
            "{}/image/{id}/{version}/{platform}-{arch}{sb}.{ext}",
            self.base
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_spelled_like_talosctl() {
        let id = crate::schematic::id_of("customization: {}\n");
        let client = Client::new();
        let f = Factory::new("https://factory.talos.dev/", &client);
        assert_eq!(
            f.image_url(&id, "v1.11.2", "metal", "amd64", false, "raw.zst"),
            "https://factory.talos.dev/image/376567988ad370138ad8b2698212367b8edcb69b5fd68c80be1f2ec7d603b4ba/v1.11.2/metal-amd64.raw.zst"
        );
        assert!(
            f.image_url(&id, "v1.11.2", "metal", "amd64", true, "raw.xz")
                .ends_with("/v1.11.2/metal-amd64-secureboot.raw.xz")
        );
    }
}
