//! The one way the end-to-end tests write an inventory: a cluster built
//! node by node on loopback, or the loopback example, then a publish
//! section, more YAML and edits.

use std::path::{Path, PathBuf};

use super::root;

/// The five nodes most tests bring up: (name, last octet, role).
pub const NODES: [(&str, u8, &str); 5] = [
    ("cp-01", 11, "controlplane"),
    ("cp-02", 12, "controlplane"),
    ("cp-03", 13, "controlplane"),
    ("worker-01", 21, "worker"),
    ("worker-02", 22, "worker"),
];

/// One node of a built inventory.
pub struct Node {
    name: String,
    role: String,
    address: Option<String>,
    mac: Option<String>,
    interface: bool,
    extensions: Option<String>,
}

impl Node {
    pub fn new(name: &str, role: &str) -> Node {
        Node {
            name: name.to_owned(),
            role: role.to_owned(),
            address: None,
            mac: None,
            interface: false,
            extensions: None,
        }
    }

    pub fn address(mut self, address: &str) -> Node {
        self.address = Some(address.to_owned());
        self
    }

    pub fn mac(mut self, mac: &str) -> Node {
        self.mac = Some(mac.to_owned());
        self
    }

    /// Names the interface (`eth0`) on the node too.
    pub fn interface(mut self) -> Node {
        self.interface = true;
        self
    }

    /// The node's own extensions, a YAML flow list's items.
    pub fn extensions(mut self, list: &str) -> Node {
        self.extensions = Some(list.to_owned());
        self
    }

    fn render(&self, s: &mut String) {
        s.push_str(&format!(
            "  - name: {}\n    role: {}\n",
            self.name, self.role
        ));
        if let Some(a) = &self.address {
            s.push_str(&format!("    address: {a}\n"));
        }
        if let Some(m) = &self.mac {
            s.push_str(&format!("    mac: {m}\n"));
        }
        if self.interface {
            s.push_str("    interface: eth0\n");
        }
        if let Some(e) = &self.extensions {
            s.push_str(&format!("    extensions: [{e}]\n"));
        }
    }
}

/// A cluster on 127.0.0.0/8 with its nodes.
struct Cluster {
    name: String,
    talos: String,
    endpoint: String,
    vip: Option<String>,
    /// `image.format` for a metal image (platform and arch beside it).
    format: Option<String>,
    bootloader: Option<String>,
    factory: String,
    extensions: Option<String>,
    nameservers: bool,
    network_extra: String,
    nodes: Vec<Node>,
}

/// An inventory under construction; [`Inventory::text`] renders it.
pub struct Inventory {
    /// What is built; `None`: `examples/loopback/cluster.yaml` as it is.
    cluster: Option<Cluster>,
    /// YAML after the base: a publish section, patches, anything.
    tail: String,
    /// (from, to): each `from` must be in the text, every one is replaced.
    edits: Vec<(String, String)>,
}

impl Inventory {
    /// A cluster called `name` with no nodes yet, on the placeholder
    /// factory `http://127.0.0.1:9` (the tests pass the simulator's).
    pub fn new(name: &str) -> Inventory {
        Inventory {
            cluster: Some(Cluster {
                name: name.to_owned(),
                talos: "v1.11.2".to_owned(),
                endpoint: String::new(),
                vip: None,
                format: None,
                bootloader: None,
                factory: "http://127.0.0.1:9".to_owned(),
                extensions: None,
                nameservers: true,
                network_extra: String::new(),
                nodes: Vec::new(),
            }),
            tail: String::new(),
            edits: Vec::new(),
        }
    }

    /// [`NODES`] on the /24 `net` (`127.x.y`), the endpoint on the VIP
    /// `net.10`.
    pub fn five_nodes(name: &str, net: &str) -> Inventory {
        let mut inv = Inventory::new(name).vip(&format!("{net}.10"));
        for (node, host, role) in NODES {
            inv = inv.node(Node::new(node, role).address(&format!("{net}.{host}")));
        }
        inv
    }

    /// The loopback example (five metal nodes, raw images).
    pub fn loopback() -> Inventory {
        Inventory {
            cluster: None,
            tail: String::new(),
            edits: Vec::new(),
        }
    }

    fn cluster(&mut self) -> &mut Cluster {
        self.cluster
            .as_mut()
            .expect("the loopback example is changed with edits")
    }

    pub fn talos(mut self, version: &str) -> Inventory {
        self.cluster().talos = version.to_owned();
        self
    }

    /// The endpoint on `address` (port 6443), no VIP.
    pub fn endpoint(mut self, address: &str) -> Inventory {
        self.cluster().endpoint = format!("https://{address}:6443");
        self
    }

    /// The endpoint on the VIP `address`.
    pub fn vip(mut self, address: &str) -> Inventory {
        self = self.endpoint(address);
        self.cluster().vip = Some(address.to_owned());
        self
    }

    /// Metal amd64 images in `format` (else the image section names only
    /// the factory).
    pub fn metal(mut self, image_format: &str) -> Inventory {
        self.cluster().format = Some(image_format.to_owned());
        self
    }

    pub fn bootloader(mut self, name: &str) -> Inventory {
        self.cluster().bootloader = Some(name.to_owned());
        self
    }

    pub fn factory(mut self, url: &str) -> Inventory {
        self.cluster().factory = url.to_owned();
        self
    }

    /// The image's extensions, a YAML flow list's items.
    pub fn extensions(mut self, list: &str) -> Inventory {
        self.cluster().extensions = Some(list.to_owned());
        self
    }

    /// No `network.nameservers` (else 127.0.0.53).
    pub fn no_nameservers(mut self) -> Inventory {
        self.cluster().nameservers = false;
        self
    }

    /// More lines of the network section (indented by two).
    pub fn network(mut self, lines: &str) -> Inventory {
        self.cluster().network_extra.push_str(lines);
        self
    }

    /// The built inventory without the node `name` (gone from it).
    pub fn without_node(mut self, name: &str) -> Inventory {
        let cluster = self.cluster.as_mut().expect("a built inventory");
        let before = cluster.nodes.len();
        cluster.nodes.retain(|n| n.name != name);
        assert_ne!(cluster.nodes.len(), before, "no node {name} to leave out");
        self
    }

    pub fn node(mut self, node: Node) -> Inventory {
        self.cluster().nodes.push(node);
        self
    }

    /// A Proxmox target: node `pve`, storage `local`, and with `vm` VMs
    /// from id 300.
    pub fn proxmox(self, vm: bool) -> Inventory {
        // The raw bytes: these tests count and cut uploads by the image's
        // size (the qcow2 default is tested in tests/publish/pve_machines.rs).
        let mut s = self
            .append("publish:\n  proxmox:\n    node: pve\n    storage: local\n    upload: raw\n");
        if vm {
            s = s
                .append("    vm: {storage: local-lvm, firstId: 300, diskSize: 10, memory: 2048}\n");
        }
        s
    }

    /// A Hetzner target with `fields` (indented by four).
    pub fn hcloud(self, fields: &str) -> Inventory {
        self.append("publish:\n  hcloud:\n").append(fields)
    }

    /// `yaml` after what is there.
    pub fn append(mut self, yaml: &str) -> Inventory {
        self.tail.push_str(yaml);
        self
    }

    /// Replaces every `from` (which must be there) by `to`.
    pub fn replace(mut self, from: &str, to: &str) -> Inventory {
        self.edits.push((from.to_owned(), to.to_owned()));
        self
    }

    pub fn text(&self) -> String {
        let mut s = match &self.cluster {
            None => {
                let mut s =
                    std::fs::read_to_string(root().join("examples/loopback/cluster.yaml")).unwrap();
                if !self.tail.is_empty() {
                    s.push('\n');
                }
                s
            }
            Some(Cluster {
                name,
                talos,
                endpoint,
                vip,
                format,
                bootloader,
                factory,
                extensions,
                nameservers,
                network_extra,
                nodes,
            }) => {
                let mut s = format!(
                    "cluster:\n  name: {name}\n  talosVersion: {talos}\n  kubernetesVersion: v1.32.1\n  endpoint: {endpoint}\n"
                );
                if let Some(v) = vip {
                    s.push_str(&format!("  vip: {v}\n"));
                }
                s.push_str("image:\n");
                if let Some(f) = format {
                    s.push_str(&format!(
                        "  platform: metal\n  arch: amd64\n  format: {f}\n"
                    ));
                }
                if let Some(b) = bootloader {
                    s.push_str(&format!("  bootloader: {b}\n"));
                }
                s.push_str(&format!("  factory: {factory}\n"));
                if let Some(e) = extensions {
                    s.push_str(&format!("  extensions: [{e}]\n"));
                }
                s.push_str("network:\n  cidr: 127.0.0.0/8\n  gateway: 127.0.0.1\n");
                if *nameservers {
                    s.push_str("  nameservers: [127.0.0.53]\n");
                }
                s.push_str("  interface: eth0\n");
                s.push_str(network_extra);
                s.push_str("nodes:\n");
                for n in nodes {
                    n.render(&mut s);
                }
                s
            }
        };
        s.push_str(&self.tail);
        for (from, to) in &self.edits {
            assert!(s.contains(from.as_str()), "the inventory lacks {from:?}");
            s = s.replace(from.as_str(), to);
        }
        s
    }

    /// Writes `dir/cluster.yaml`; its path.
    pub fn write(&self, dir: &Path) -> PathBuf {
        self.write_to(&dir.join("cluster.yaml"))
    }

    pub fn write_to(&self, path: &Path) -> PathBuf {
        std::fs::write(path, self.text()).unwrap();
        path.to_owned()
    }
}
