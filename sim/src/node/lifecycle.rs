//! The v1.13+ way to upgrade (siderolabs/talos `api/machine/
//! lifecycle.proto`, `api/machine/image.proto`): `ImageService.Pull` puts
//! the installer into containerd (the same timed pull as Upgrade's, under
//! the caller's deadline), `LifecycleService.Upgrade`
//! (`internal/app/lifecycle/lifecycle.go`) runs it from there — no etcd
//! checks, no drain, no reboot: its pre-flight check's failure is a
//! non-zero exit code in the stream, success takes effect at the next boot
//! (the client reboots the node). Below v1.13 neither service exists.
//! Both name a containerd instance, checked as `ctrhelper.go` does
//! (`k8s::pods::containerd_instance`): the installer runs from where it
//! was pulled, and a Kubernetes image pulled with driver `CONTAINERD` and
//! `NS_CRI` is refused.

use std::pin::Pin;
use std::time::Instant;

use futures_util::Stream;
use tonic::{Request, Response, Status};

use super::k8s::pods::{PullCall, SYSTEM_SYSTEM, containerd_instance};
use super::service::Api;
use super::version::Talos;
use imgbuild::talos::api::machine::image_service_server::ImageService;
use imgbuild::talos::api::machine::lifecycle_service_install_progress::Response as Progress;
use imgbuild::talos::api::machine::lifecycle_service_server::LifecycleService;
use imgbuild::talos::api::machine::*;

type Stream2<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

impl Api {
    /// The one node a streaming call is for, which must run v1.13+ (grpc-go
    /// answers an unregistered service with Unimplemented).
    fn v113_target<T>(&self, req: &Request<T>, service: &str) -> Result<usize, Status> {
        let i = self.state_target(req)?;
        if !self.talos(i).has_lifecycle_service() {
            return Err(Status::unimplemented(format!(
                "unknown service machine.{service}"
            )));
        }
        Ok(i)
    }
}

#[tonic::async_trait]
impl ImageService for Api {
    type PullStream = Stream2<ImageServicePullResponse>;

    async fn pull(
        &self,
        req: Request<ImageServicePullRequest>,
    ) -> Result<Response<Self::PullStream>, Status> {
        let i = self.v113_target(&req, "ImageService")?;
        let r = req.get_ref();
        let image = r.image_ref.clone();
        let outcome = async {
            let place = containerd_instance(r.containerd.as_ref())?;
            match self.k8s_image_pull(i, &image).await {
                Some(pulled) => pulled?,
                None if place == SYSTEM_SYSTEM => {
                    self.timed_pull(&req, &[i], &image).await?;
                }
                None => self.pull_elsewhere(&req, i, &image).await?,
            }
            Ok(place)
        }
        .await;
        self.cluster.record_pull(
            PullCall {
                node: i,
                api: "ImageService.Pull",
                driver: Some(r.containerd.as_ref().map_or(0, |c| c.driver)),
                namespace: Some(r.containerd.as_ref().map_or(0, |c| c.namespace)),
                image: &image,
            },
            &outcome,
        );
        outcome?;
        let reply = ImageServicePullResponse {
            response: Some(image_service_pull_response::Response::Name(image)),
        };
        Ok(Response::new(Box::pin(futures_util::stream::iter([Ok(
            reply,
        )]))))
    }
}

#[tonic::async_trait]
impl LifecycleService for Api {
    type UpgradeStream = Stream2<LifecycleServiceUpgradeResponse>;

    async fn upgrade(
        &self,
        req: Request<LifecycleServiceUpgradeRequest>,
    ) -> Result<Response<Self::UpgradeStream>, Status> {
        let i = self.v113_target(&req, "LifecycleService")?;
        let node = self.cluster.node(i);
        let image = req
            .get_ref()
            .source
            .as_ref()
            .map(|s| s.image_name.clone())
            .unwrap_or_default();
        let containerd = req.get_ref().containerd.as_ref();
        let mut st = node.st.lock().unwrap();
        st.day2.upgrade_calls += 1;
        st.day2.lifecycle_upgrades += 1;
        // runInstallerContainer: the instance first, as ImageService.Pull.
        let place = containerd_instance(containerd)?;
        if st.day2.life.busy(Instant::now()) {
            return Err(Status::failed_precondition(
                "another installation/upgrade is already in progress",
            ));
        }
        if image.is_empty() {
            return Err(Status::invalid_argument("installer image name is required"));
        }
        // The installer runs from the containerd and namespace named, so
        // it must have been pulled there.
        if !st.day2.images.contains(&(place, image.clone())) {
            return Err(Status::internal(format!(
                "upgrade failed: image \"{image}\": not found"
            )));
        }
        let host = Talos::parse(&st.day2.version_or(&self.cluster.args.talos_version))
            .expect("versions are checked when set");
        let tag = image.rsplit_once(':').map_or("", |(_, t)| t).to_owned();
        let verdict = match Talos::parse(&tag) {
            _ if st.day2.installer_fails => Err("installer failed".to_owned()),
            Some(t) => t.installer_accepts(&host),
            None => Err(format!("error parsing installer Talos version: {tag}")),
        };
        let message = |m: String| LifecycleServiceUpgradeResponse {
            progress: Some(LifecycleServiceInstallProgress {
                response: Some(Progress::Message(m)),
            }),
        };
        let mut replies = vec![message(format!("running the installer {image}"))];
        let code = match verdict {
            Ok(()) => {
                st.day2.upgrades += 1;
                st.day2.installers.push(image.clone());
                st.day2.next_boot = Some((tag, super::upgrade::schematic_of_installer(&image)));
                0
            }
            Err(why) => {
                st.day2.installer_refusals += 1;
                st.day2.last_error = Some(why.clone());
                replies.push(message(why));
                1
            }
        };
        replies.push(LifecycleServiceUpgradeResponse {
            progress: Some(LifecycleServiceInstallProgress {
                response: Some(Progress::ExitCode(code)),
            }),
        });
        Ok(Response::new(Box::pin(futures_util::stream::iter(
            replies.into_iter().map(Ok),
        ))))
    }
}
