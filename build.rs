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
    println!("cargo:rustc-env=IMGBUILD_COMMIT={}", commit());
    let fds = protox::compile(PROTOS, ["proto"])?;
    tonic_prost_build::configure()
        .build_server(std::env::var_os("CARGO_FEATURE_SERVER_API").is_some())
        .compile_fds(fds)?;
    Ok(())
}

/// The commit `--version` names: `$IMGBUILD_COMMIT` (a build from a source
/// archive), else, in a release build, git's HEAD. Debug builds say
/// "unknown" rather than rebuild the whole crate after every commit.
#[allow(clippy::disallowed_macros)]
fn commit() -> String {
    println!("cargo:rerun-if-env-changed=IMGBUILD_COMMIT");
    if let Some(c) = std::env::var("IMGBUILD_COMMIT")
        .ok()
        .filter(|c| !c.is_empty())
    {
        return c;
    }
    if std::env::var("PROFILE").as_deref() != Ok("release") {
        return "unknown (a debug build)".into();
    }
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    // Again when HEAD moves: HEAD itself, the branch it names, packed refs.
    for path in ["HEAD", "packed-refs"] {
        if let Some(p) = git(&["rev-parse", "--git-path", path]) {
            println!("cargo:rerun-if-changed={p}");
        }
    }
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"])
        && let Some(p) = git(&["rev-parse", "--git-path", &branch])
    {
        println!("cargo:rerun-if-changed={p}");
    }
    git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown (no git)".into())
}
