//! Compiles imgbuild's Talos API subset (`../proto`) into gRPC servers for the
//! node simulator.

const PROTOS: [&str; 3] = [
    "machine/machine.proto",
    "storage/storage.proto",
    "common/common.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=../proto");
    let fds = protox::compile(PROTOS, ["../proto"])?;
    tonic_prost_build::configure()
        .build_client(false)
        .compile_fds(fds)?;
    Ok(())
}
