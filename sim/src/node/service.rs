//! The machine API's service value and its call shapes: one `Api` per
//! node listener, the routes a call takes (siderolabs/talos
//! `internal/app/apid/pkg/director/director.go`: one-to-one or
//! one-to-many), and the envelope every reply message carries.

use super::state::*;
use api::common::{Data, Metadata};
use api::machine::*;
use api::storage::Disks;
use futures_util::Stream;
use imgbuild::talos::api;
use std::pin::Pin;
use std::sync::Arc;
use tonic::Status;

#[derive(Clone)]
pub(crate) struct Api {
    pub(crate) cluster: Arc<Cluster>,
    pub(crate) me: usize,
    pub(crate) secure: bool,
}

pub(crate) const NOT_IN_MAINTENANCE: &str = "API is not implemented in maintenance mode";

/// Where apid's director sends a call (siderolabs/talos
/// `internal/app/apid/pkg/director/director.go`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Route {
    /// No routing metadata: this node's own machined.
    Local,
    /// `node: <target>`: proxied one-to-one, the reply passed on untouched.
    One2One(String),
    /// `nodes: <target>…`: proxied one-to-many, every reply stamped.
    One2Many(Vec<String>),
}

/// A per-node reply message, which apid stamps with `common.Metadata`.
pub(crate) trait Envelope: Default {
    fn set_metadata(&mut self, md: Metadata);
}

macro_rules! envelopes {
    ($($t:ty),*) => {$(
        impl Envelope for $t {
            fn set_metadata(&mut self, md: Metadata) {
                self.metadata = Some(md);
            }
        }
    )*};
}

envelopes!(
    Version,
    ServiceList,
    EtcdMembers,
    Bootstrap,
    ApplyConfiguration,
    Disks,
    Data,
    Upgrade,
    MetaWrite,
    Reboot,
    EtcdLeaveCluster,
    EtcdRemoveMemberById,
    EtcdForfeitLeadership,
    Reset
);

pub(crate) type DataStream = Pin<Box<dyn Stream<Item = Result<Data, Status>> + Send>>;
