//! Compiles the Talos API subset in `proto/` into a gRPC client with protox
//! (pure Rust: no protoc on the build machine); with the `server-api`
//! feature (the node simulator's) also into server traits.

const PROTOS: [&str; 6] = [
    "machine/machine.proto",
    "machine/lifecycle.proto",
    "machine/image.proto",
    "storage/storage.proto",
    "common/common.proto",
    "cosi/state.proto",
];

// Cargo reads a build script's directives from its stdout.
#[allow(clippy::disallowed_macros)]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(PROTOS, ["proto"])?;
    tonic_prost_build::configure()
        .build_server(std::env::var_os("CARGO_FEATURE_SERVER_API").is_some())
        .compile_fds(fds)?;
    Ok(())
}
