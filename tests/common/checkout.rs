//! A checkout of a two-node cluster (cp-01 and worker-01 on a loopback
//! /24): its inventory, the state dir `state/` and a home without age keys,
//! where imgbuild runs with only the age keys a test hands it. The secrets
//! tests (SOPS files, fresh runners) share it.

use std::path::{Path, PathBuf};
use std::process::Output;

use super::inventory::{Inventory, Node};
use super::run::Run;
use super::sims::Nodes;
use super::text;

pub struct Checkout {
    pub dir: tempfile::TempDir,
    pub net: String,
}

impl Checkout {
    /// The cluster `cluster` on the /24 `net`.
    pub fn new(cluster: &str, net: &str) -> Checkout {
        let dir = tempfile::tempdir().unwrap();
        let inv = Inventory::new(cluster)
            .endpoint(&format!("{net}.11"))
            .no_nameservers()
            .node(Node::new("cp-01", "controlplane").address(&format!("{net}.11")))
            .node(Node::new("worker-01", "worker").address(&format!("{net}.21")))
            .text();
        std::fs::write(dir.path().join("cluster.yaml"), inv).unwrap();
        std::fs::create_dir(dir.path().join("home")).unwrap();
        Checkout {
            dir,
            net: net.to_owned(),
        }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// imgbuild with the state dir `state`, test-sized timeouts where the
    /// command takes them, and only the age keys in `env`.
    pub fn imgbuild(&self, args: &[&str], env: &[(&str, &Path)]) -> Output {
        let mut run = Run::with_config(&self.path("cluster.yaml"), args);
        run.env("IMGBUILD_STATE_DIR", self.path("state"))
            .env("HOME", self.path("home"))
            .env_remove("XDG_CONFIG_HOME")
            .env_remove("SOPS_AGE_KEY")
            .env_remove("SOPS_AGE_KEY_FILE")
            .env_remove("SOPS_AGE_KEY_CMD")
            .env_remove("TALOSCONFIG")
            .env_remove("KUBECONFIG");
        let waits = ["up", "bootstrap", "apply", "upgrade", "status", "etcd"];
        if args.iter().any(|a| waits.contains(a)) {
            run.timeouts(&[]);
        }
        if args.contains(&"up") {
            run.arg("--out-dir").arg(self.path("out"));
        }
        for (k, v) in env {
            run.env(k, v);
        }
        run.output()
    }

    /// A fresh age key pair from `age-keygen`: the key file and recipient.
    pub fn keygen(&self, name: &str) -> (PathBuf, String) {
        let file = self.path(name);
        let recipient = super::age_keygen(&file);
        (file, recipient)
    }

    /// The laptop's steps as the guide gives them: `secrets gen`, then
    /// `secrets encrypt --age recipient`. Returns what encrypt printed.
    pub fn seal(&self, recipient: &str) -> String {
        let o = self.imgbuild(&["secrets", "gen"], &[]);
        assert!(o.status.success(), "{}", text(&o.stderr));
        let o = self.imgbuild(&["secrets", "encrypt", "--age", recipient], &[]);
        assert!(o.status.success(), "{}", text(&o.stderr));
        text(&o.stdout)
    }

    /// The Talos node simulator serving cp-01 and worker-01.
    pub fn nodes(&self) -> Nodes {
        let net = &self.net;
        Nodes::start(&[
            "--node",
            &format!("cp-01={net}.11:controlplane"),
            "--node",
            &format!("worker-01={net}.21:worker"),
        ])
    }
}
