//! Powering a simulated server on and off: booting its disk (a Talos image's
//! config from user data, or the rescue system) and stopping it.

use super::rescue;
use super::state::*;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

/// The server is now running; with rescue enabled its sshd comes up after
/// `--ssh-refuse-seconds` (never with `--ssh-never`). A server made from a
/// snapshot boots Talos instead: with `--nodes-control`, a node configured
/// from its user_data comes up on its public address.
pub(crate) fn power_on(sim: &Arc<Sim>, s: &mut Server) {
    s.status = "running";
    s.boot += 1;
    if !s.rescue_enabled
        && s.from_snapshot
        && let Some(nodes) = sim.nodes.clone()
    {
        let id = s.id;
        let config = match s.user_data.as_deref().map(talos_config).transpose() {
            Ok(c) => c,
            Err(e) => {
                // Talos stops acquiring: no config, no node.
                eprintln!("hcloud sim: server {id}: Talos cannot read its user_data: {e}");
                return;
            }
        };
        s.node_booted = true;
        let body = json!({"name": s.name, "ip": s.ip.to_string(), "config": config});
        tokio::spawn(async move {
            if let Err(e) = nodes.boot(&body).await {
                eprintln!("hcloud sim: booting Talos for server {id}: {e}");
            }
        });
    }
    if !s.rescue_enabled || sim.args.ssh_never {
        return;
    }
    let port = match s.ssh_port.or(sim.args.rescue_ssh_port) {
        Some(p) => p,
        None => match rescue::choose_port(s.ip, true) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("hcloud sim: no port for server {} on {}: {e}", s.id, s.ip);
                return;
            }
        },
    };
    s.ssh_port = Some(port);
    let spec = rescue::Spec {
        dir: sim.server_dir(s.id).join("rescue"),
        disk: sim.disk(s.id),
        ip: s.ip,
        port,
        keys: s.rescue_keys.clone(),
        dd_fails: sim.args.dd_fails,
    };
    let (sim, id, boot) = (sim.clone(), s.id, s.boot);
    let refuse = Duration::from_secs_f64(sim.args.ssh_refuse_seconds.max(0.0));
    tokio::spawn(async move {
        tokio::time::sleep(refuse).await;
        let mut spec = spec;
        let mut started = rescue::start(&spec).await;
        if started.is_err() && spec.port == 22 {
            // Port 22 was taken meanwhile (another simulator, a host sshd).
            started = match rescue::choose_port(spec.ip, false) {
                Ok(port) => {
                    spec.port = port;
                    rescue::start(&spec).await
                }
                Err(e) => Err(e),
            };
        }
        let child = match started {
            Ok(c) => c,
            Err(e) => {
                eprintln!("hcloud sim: rescue system of server {id}: {e:#}");
                return;
            }
        };
        let mut w = sim.world.lock().unwrap();
        if let Some(s) = w.servers.get_mut(&id)
            && s.boot == boot
            && s.status == "running"
        {
            s.ssh_port = Some(spec.port);
            s.sshd = Some(child); // otherwise dropped: killed
        }
    });
}

/// The machine config Talos makes of a server's `user_data`. Its hcloud
/// platform decodes standard base64 when the text is base64, else keeps it
/// as it is (siderolabs/talos
/// internal/app/machined/pkg/runtime/v1alpha1/platform/hcloud/hcloud.go,
/// `maybeBase64Decode`, Talos v1.9.0 on; Go's decoder skips `\r` and
/// `\n`); then the config acquirer gunzips what Go's
/// `http.DetectContentType` calls `application/x-gzip` (bytes 1f 8b 08;
/// internal/app/machined/pkg/controllers/config/acquire.go,
/// `loadFromPlatform`).
pub(crate) fn talos_config(user_data: &str) -> Result<String, String> {
    use base64::Engine;
    use std::io::Read;
    let go_std = base64::engine::GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        base64::engine::GeneralPurposeConfig::new()
            .with_decode_allow_trailing_bits(true)
            .with_decode_padding_mode(base64::engine::DecodePaddingMode::RequireCanonical),
    );
    let text: String = user_data
        .chars()
        .filter(|c| !matches!(c, '\r' | '\n'))
        .collect();
    let bytes = go_std
        .decode(&text)
        .unwrap_or_else(|_| user_data.as_bytes().to_vec());
    let bytes = if bytes.starts_with(&[0x1f, 0x8b, 0x08]) {
        let mut out = Vec::new();
        flate2::read::MultiGzDecoder::new(&bytes[..])
            .read_to_end(&mut out)
            .map_err(|e| format!("error unzipping machine config: {e}"))?;
        out
    } else {
        bytes
    };
    String::from_utf8(bytes).map_err(|_| "the machine config is not UTF-8 text".to_owned())
}

/// Power is cut: the rescue sshd (or the Talos node) goes with it, and the
/// next boot is a normal one.
pub(crate) fn power_off(sim: &Sim, s: &mut Server) {
    s.boot += 1;
    s.sshd = None;
    s.rescue_enabled = false;
    if let (Some(nodes), true) = (sim.nodes.clone(), std::mem::take(&mut s.node_booted)) {
        let (id, ip) = (s.id, s.ip.to_string());
        tokio::spawn(async move {
            if let Err(e) = nodes.halt(&ip).await {
                eprintln!("hcloud sim: halting Talos of server {id}: {e}");
            }
        });
    }
}
