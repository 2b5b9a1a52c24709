//! The calls only day two makes: the boot ID (how talosctl's
//! `BootIDChangedPostCheckFn` knows a node rebooted), Reboot, and the two
//! ways a node is asked to upgrade — `MachineService.Upgrade` below Talos
//! v1.13, `ImageService.Pull` + `LifecycleService.Upgrade` from v1.13
//! (siderolabs/talos `cmd/talosctl/cmd/talos/upgrade.go`,
//! `internal/app/lifecycle/lifecycle.go`).

use super::super::api::common::{ContainerDriver, ContainerdInstance, ContainerdNamespace};
use super::super::api::machine::image_service_client::ImageServiceClient;
use super::super::api::machine::image_service_pull_response::Response as PullReply;
use super::super::api::machine::lifecycle_service_client::LifecycleServiceClient;
use super::super::api::machine::lifecycle_service_install_progress::Response as Progress;
use super::super::api::machine::{
    ImageServicePullRequest, InstallArtifactsSource, LifecycleServiceUpgradeRequest, ReadRequest,
    Reboot, RebootRequest, UpgradeRequest, reboot_request, upgrade_request,
};
use super::{ApiError, NodeClient, Reply};

/// Where Linux keeps the ID of the running boot: a new UUID every boot.
pub const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";

/// A boot ID is a UUID and a newline; anything longer is not one.
const BOOT_ID_LIMIT: usize = 128;

impl Reply for Reboot {
    fn metadata(&self) -> Option<&super::Metadata> {
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
    ContainerdInstance {
        driver: ContainerDriver::Containerd as i32,
        namespace: ContainerdNamespace::NsSystem as i32,
    }
}

impl NodeClient {
    /// The node's boot ID (`MachineService.Read` of [`BOOT_ID_PATH`]).
    pub async fn boot_id(&self) -> Result<String, ApiError> {
        let req = ReadRequest {
            path: BOOT_ID_PATH.into(),
        };
        let mut stream = self.call(self.machine().read(self.request(req))).await?;
        let mut out = Vec::new();
        loop {
            match stream.message().await {
                Ok(Some(chunk)) => {
                    self.check(std::slice::from_ref(&chunk))?;
                    out.extend_from_slice(&chunk.bytes);
                    if out.len() > BOOT_ID_LIMIT {
                        return Err(ApiError::Status {
                            code: tonic::Code::OutOfRange,
                            message: format!("{BOOT_ID_PATH} is longer than {BOOT_ID_LIMIT} bytes"),
                        });
                    }
                }
                Ok(None) => break,
                Err(s) => return Err(self.fail(s).await),
            }
        }
        Ok(String::from_utf8_lossy(&out).trim().to_owned())
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
        let req = ImageServicePullRequest {
            containerd: Some(system_containerd()),
            image_ref: image.to_owned(),
        };
        let mut images = ImageServiceClient::new(self.channel.clone());
        let mut stream = self.call(images.pull(self.request(req))).await?;
        let mut name = None;
        loop {
            match stream.message().await {
                Ok(Some(reply)) => {
                    if let Some(PullReply::Name(n)) = reply.response {
                        name = Some(n);
                    }
                }
                Ok(None) => break,
                Err(s) => return Err(self.fail(s).await),
            }
        }
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
        let mut code = None;
        loop {
            match stream.message().await {
                Ok(Some(reply)) => match reply.progress.and_then(|p| p.response) {
                    Some(Progress::Message(m)) => progress(&m),
                    Some(Progress::ExitCode(c)) => code = Some(c),
                    None => {}
                },
                Ok(None) => break,
                Err(s) => return Err(self.fail(s).await),
            }
        }
        code.ok_or_else(|| ApiError::Status {
            code: tonic::Code::Unknown,
            message: "the upgrade stream ended without the installer's exit code".into(),
        })
    }
}
