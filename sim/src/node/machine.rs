//! The `MachineService` and `StorageService` gRPC services (siderolabs/talos
//! `api/machine/machine.proto`, `api/storage/storage.proto`): each call
//! handed to the module that simulates it.

use super::service::*;
use super::state::*;
use api::common::Data;
use api::machine::apply_configuration_request::Mode as ApplyMode;
use api::machine::machine_service_server::MachineService;
use api::machine::*;
use api::storage::DisksResponse;
use api::storage::storage_service_server::StorageService;
use imgbuild::talos::api;
use tonic::{Request, Response, Status};

/// A Kubeconfig archive (gzip'd tar, one entry) whose entry is 128 MiB of
/// zeros: about 128 KiB on the wire. Made once.
pub(crate) fn zeros_archive() -> &'static [u8] {
    static ARCHIVE: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    ARCHIVE.get_or_init(|| {
        let size = 128u64 << 20;
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        let mut h = tar::Header::new_gnu();
        h.set_path("kubeconfig").expect("a short name");
        h.set_size(size);
        h.set_mode(0o600);
        h.set_cksum();
        std::io::Write::write_all(&mut gz, h.as_bytes()).expect("in memory");
        std::io::copy(&mut std::io::Read::take(std::io::repeat(0), size), &mut gz)
            .expect("in memory");
        gz.finish().expect("in memory")
    })
}

#[tonic::async_trait]
impl MachineService for Api {
    async fn apply_configuration(
        &self,
        req: Request<ApplyConfigurationRequest>,
    ) -> Result<Response<ApplyConfigurationResponse>, Status> {
        let mode = ApplyMode::try_from(req.get_ref().mode).unwrap_or(ApplyMode::Reboot);
        let messages = if self.secure {
            let messages =
                self.answer(&req, |i| Ok(vec![self.apply_configured(i, req.get_ref())?]))?;
            // Persisting takes a while, the apply lock held meanwhile.
            if !req.get_ref().dry_run {
                tokio::time::sleep(ms(self.cluster.args.apply_time)).await;
            }
            messages
        } else if matches!(mode, ApplyMode::Auto | ApplyMode::Reboot | ApplyMode::Try) {
            vec![self.apply_on(self.me, &req.get_ref().data)?]
        } else {
            return Err(Status::invalid_argument(format!(
                "apply mode {mode:?} is not supported in maintenance mode"
            )));
        };
        Ok(Response::new(ApplyConfigurationResponse { messages }))
    }

    async fn bootstrap(
        &self,
        req: Request<BootstrapRequest>,
    ) -> Result<Response<BootstrapResponse>, Status> {
        if !self.secure {
            return Err(Status::unimplemented("method Bootstrap not implemented"));
        }
        let recover = req.get_ref().recover_etcd;
        let messages = self.answer(&req, |i| Ok(vec![self.bootstrap_on(i, recover)?]))?;
        Ok(Response::new(BootstrapResponse { messages }))
    }

    async fn etcd_member_list(
        &self,
        req: Request<EtcdMemberListRequest>,
    ) -> Result<Response<EtcdMemberListResponse>, Status> {
        let messages = self.answer(&req, |i| Ok(vec![self.etcd_members_on(i)?]))?;
        Ok(Response::new(EtcdMemberListResponse { messages }))
    }

    async fn etcd_recover(
        &self,
        req: Request<tonic::Streaming<Data>>,
    ) -> Result<Response<EtcdRecoverResponse>, Status> {
        self.etcd_recover_call(req).await
    }

    type EtcdSnapshotStream = DataStream;

    async fn etcd_snapshot(
        &self,
        req: Request<EtcdSnapshotRequest>,
    ) -> Result<Response<Self::EtcdSnapshotStream>, Status> {
        self.etcd_snapshot_call(req)
    }

    type KubeconfigStream = DataStream;

    async fn kubeconfig(
        &self,
        req: Request<()>,
    ) -> Result<Response<Self::KubeconfigStream>, Status> {
        let chunks = self.answer(&req, |i| self.kubeconfig_on(i))?;
        // Hostile nodes (the tests of imgbuild's bounds): a stream that
        // never ends, or an archive whose one entry unpacks to 128 MiB.
        let me = self.cluster.node(self.me);
        let metadata = chunks.first().and_then(|c| c.metadata.clone());
        if me.has("endless-kubeconfig") {
            let chunk = Data {
                metadata,
                bytes: vec![0x1f; 1 << 20],
            };
            return Ok(Response::new(Box::pin(futures_util::stream::repeat_with(
                move || Ok(chunk.clone()),
            ))));
        }
        if me.has("kubeconfig-bomb") {
            let chunks: Vec<Data> = zeros_archive()
                .chunks(1 << 20)
                .map(|bytes| Data {
                    metadata: metadata.clone(),
                    bytes: bytes.to_vec(),
                })
                .collect();
            return Ok(Response::new(Box::pin(futures_util::stream::iter(
                chunks.into_iter().map(Ok),
            ))));
        }
        Ok(Response::new(Box::pin(futures_util::stream::iter(
            chunks.into_iter().map(Ok),
        ))))
    }

    async fn service_list(
        &self,
        req: Request<()>,
    ) -> Result<Response<ServiceListResponse>, Status> {
        let messages = self.answer(&req, |i| Ok(vec![self.services_on(i)]))?;
        Ok(Response::new(ServiceListResponse { messages }))
    }

    async fn version(&self, req: Request<()>) -> Result<Response<VersionResponse>, Status> {
        if !self.secure {
            self.cluster
                .node(self.me)
                .st
                .lock()
                .unwrap()
                .stats
                .maintenance_version_calls += 1;
        }
        let messages = self.answer(&req, |i| Ok(vec![self.version_on(i)]))?;
        Ok(Response::new(VersionResponse { messages }))
    }

    async fn upgrade(
        &self,
        req: Request<UpgradeRequest>,
    ) -> Result<Response<UpgradeResponse>, Status> {
        self.upgrade_call(req).await
    }

    async fn meta_write(
        &self,
        req: Request<MetaWriteRequest>,
    ) -> Result<Response<MetaWriteResponse>, Status> {
        self.meta_write_call(req)
    }

    type ReadStream = DataStream;

    async fn read(&self, req: Request<ReadRequest>) -> Result<Response<Self::ReadStream>, Status> {
        let chunks = self.answer(&req, |i| self.read_on(i, &req.get_ref().path))?;
        Ok(Response::new(Box::pin(futures_util::stream::iter(
            chunks.into_iter().map(Ok),
        ))))
    }

    async fn reboot(
        &self,
        req: Request<RebootRequest>,
    ) -> Result<Response<RebootResponse>, Status> {
        let messages = self.answer(&req, |i| {
            self.reboot_on(i, req.get_ref())?;
            Ok(vec![Reboot {
                metadata: None,
                actor_id: format!("sim-reboot-{i}-{}", self.cluster.now_ms()),
            }])
        })?;
        Ok(Response::new(RebootResponse { messages }))
    }

    async fn etcd_leave_cluster(
        &self,
        req: Request<EtcdLeaveClusterRequest>,
    ) -> Result<Response<EtcdLeaveClusterResponse>, Status> {
        self.etcd_leave_cluster_call(req)
    }

    async fn etcd_forfeit_leadership(
        &self,
        req: Request<EtcdForfeitLeadershipRequest>,
    ) -> Result<Response<EtcdForfeitLeadershipResponse>, Status> {
        self.etcd_forfeit_leadership_call(req)
    }

    async fn etcd_remove_member_by_id(
        &self,
        req: Request<EtcdRemoveMemberByIdRequest>,
    ) -> Result<Response<EtcdRemoveMemberByIdResponse>, Status> {
        self.etcd_remove_member_by_id_call(req)
    }

    async fn reset(&self, req: Request<ResetRequest>) -> Result<Response<ResetResponse>, Status> {
        self.reset_call(req)
    }

    async fn image_pull(
        &self,
        req: Request<ImagePullRequest>,
    ) -> Result<Response<ImagePullResponse>, Status> {
        self.image_pull_call(req).await
    }
}

#[tonic::async_trait]
impl StorageService for Api {
    async fn disks(&self, req: Request<()>) -> Result<Response<DisksResponse>, Status> {
        let messages = if self.secure {
            self.answer(&req, |_| Ok(vec![self.disks_on()]))?
        } else {
            vec![self.disks_on()]
        };
        Ok(Response::new(DisksResponse { messages }))
    }
}
