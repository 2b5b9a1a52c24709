//! The Talos machine API subset in `proto/`, generated at build time: clients,
//! and with the `server-api` feature the server traits the simulator implements.
#![allow(clippy::all, missing_docs)]

pub mod google {
    pub mod rpc {
        tonic::include_proto!("google.rpc");
    }
}

pub mod common {
    tonic::include_proto!("common");
}

pub mod machine {
    tonic::include_proto!("machine");
}

pub mod storage {
    tonic::include_proto!("storage");
}

/// The COSI State API (`talosctl get`): resources such as extension statuses.
pub mod cosi {
    pub mod resource {
        tonic::include_proto!("cosi.resource");
    }
}
