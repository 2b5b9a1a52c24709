//! The 5-node Proxmox cluster of examples/demo (cp-01..03, worker-01..02,
//! VMs 300..304) on one /24, against the factory, Proxmox VE and Talos node
//! simulators wired as a chain: the scenarios of `up` share it.

use super::inventory::Inventory;
use super::run::Run;
use super::sims::{Nodes, Pve, Sim};
use std::path::PathBuf;

/// The three simulators, the inventory's folder and its /24.
pub struct DemoCluster {
    pub factory: Sim,
    pub pve: Pve,
    pub nodes: Nodes,
    pub dir: tempfile::TempDir,
    pub net: String,
}

impl DemoCluster {
    /// Nodes modelling Talos v1.11.2 with short reboots, a factory that
    /// offers v1.11.2 and v1.11.5, and the demo inventory on `net`.
    pub fn start(net: String) -> DemoCluster {
        let nodes = Nodes::start(&[
            "--vip",
            &format!("{net}.10"),
            "--reboot-delay",
            "200",
            "--upgrade-delay",
            "50",
        ]);
        let pve = Pve::start(&["--nodes-control", nodes.control.as_str()]);
        let dir = tempfile::tempdir().unwrap();
        let cluster = DemoCluster {
            factory: Sim::start_with(&[], 0, &["--versions", "v1.11.2,v1.11.5"]),
            pve,
            nodes,
            dir,
            net,
        };
        cluster.write(&cluster.inventory());
        cluster
    }

    /// The demo's shape on this cluster's /24.
    pub fn inventory(&self) -> Inventory {
        Inventory::five_nodes("demo", &self.net)
            .metal("raw")
            .proxmox(true)
    }

    pub fn write(&self, inv: &Inventory) {
        inv.write_to(&self.config());
    }

    pub fn config(&self) -> PathBuf {
        self.dir.path().join("cluster.yaml")
    }

    /// `imgbuild <args>` on the inventory with the simulators, test-sized
    /// timeouts and this cluster's state dir (and for `up`, its folders).
    pub fn command(&self, args: &[&str]) -> Run {
        let mut run = Run::with_config(&self.config(), args);
        run.timeouts(args)
            .arg("--state-dir")
            .arg(self.dir.path().join("state"))
            .env_remove("IMGBUILD_STATE_DIR")
            .env_remove("TALOSCONFIG")
            .proxmox(&self.pve);
        if args.contains(&"up") || args.contains(&"bootstrap") {
            // A new cluster: its secrets are made on the first run.
            run.arg("--new-secrets");
        }
        if args.contains(&"up") {
            run.factory(&self.factory)
                .args(["--poll-ms", "50", "--quiet"])
                .folders(self.dir.path());
        } else {
            // The installer every config names is at this factory.
            run.args(["--factory", &self.factory.url]);
        }
        run
    }
}
