//! imgbuild-sim: loopback test doubles for the services imgbuild talks to.
//! Only ever binds 127.0.0.0/8. Prints one JSON line with its URLs once it
//! listens, so tests and `make demo` can find it.

mod chain;
mod disk;
mod factory;
mod hcloud;
mod node;
mod proxmox;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "imgbuild-sim")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// An Image Factory (schematics, versions, extensions, images).
    Factory(factory::Args),
    /// Hetzner Cloud (servers, SSH keys, snapshots; the rescue system is a real sshd).
    Hcloud(hcloud::Args),
    /// A cluster of Talos nodes (machine API on port 50000, Kubernetes API).
    Nodes(node::Args),
    /// A Proxmox VE node (pveproxy's HTTPS API: storage, uploads, tasks, VMs).
    Proxmox(proxmox::Args),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Factory(args) => factory::run(args).await,
        Command::Hcloud(args) => hcloud::run(args).await,
        Command::Nodes(args) => node::run(args).await,
        Command::Proxmox(args) => proxmox::run(args).await,
    }
}
