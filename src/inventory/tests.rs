use super::*;

const ATLAS: &str = include_str!("../../examples/atlas/cluster.yaml");

/// Parses `text` as if it were the atlas example (its patch files resolve).
fn load(text: &str) -> Result<Inventory, InventoryError> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/atlas/cluster.yaml");
    Inventory::parse(text, &path)
}

/// The atlas inventory with `from` replaced by `to` (which must occur).
fn atlas_with(from: &str, to: &str) -> String {
    assert!(ATLAS.contains(from), "fixture lacks {from:?}");
    ATLAS.replacen(from, to, 1)
}

/// Loads and expects failure; returns the full message.
fn error_of(text: &str) -> String {
    load(text)
        .expect_err("inventory should be rejected")
        .to_string()
}

/// The message of a refused inventory, or "" when it loads.
fn error_of_or_empty(text: &str) -> String {
    load(text).err().map(|e| e.to_string()).unwrap_or_default()
}

fn line_of(text: &str, needle: &str) -> usize {
    text.lines().position(|l| l.contains(needle)).unwrap() + 1
}

#[test]
fn atlas_example_loads() {
    let inv = load(ATLAS).unwrap();
    assert_eq!(inv.nodes.len(), 5);
    assert_eq!(inv.control_planes().count(), 3);
    assert!(inv.warnings.is_empty(), "{:?}", inv.warnings);
}

#[test]
fn duplicate_node_name_is_named_with_its_line() {
    let text = atlas_with("name: cp-02", "name: cp-01");
    let err = error_of(&text);
    let line = text
        .lines()
        .enumerate()
        .filter(|(_, l)| l.contains("name: cp-01"))
        .nth(1)
        .unwrap()
        .0
        + 1;
    assert!(
        err.contains(&format!("line {line}: nodes[1].name")),
        "{err}"
    );
    assert!(err.contains("\"cp-01\" is used twice"), "{err}");
}

#[test]
fn duplicate_address_names_both_nodes() {
    let text = atlas_with("address: 10.0.0.12", "address: 10.0.0.11");
    let err = error_of(&text);
    assert!(err.contains("nodes[1].address"), "{err}");
    assert!(
        err.contains("node cp-02: address 10.0.0.11 is already used by node cp-01"),
        "{err}"
    );
}

#[test]
fn a_mac_used_twice_names_both_nodes_whatever_its_case() {
    let text = atlas_with(
        "address: 10.0.0.12\n",
        "address: 10.0.0.12\n    mac: BC:24:11:00:00:11\n",
    )
    .replacen(
        "address: 10.0.0.11\n",
        "address: 10.0.0.11\n    mac: bc:24:11:00:00:11\n",
        1,
    );
    let err = error_of(&text);
    assert!(err.contains("nodes[1].mac"), "{err}");
    assert!(
        err.contains("node cp-02: mac bc:24:11:00:00:11 is already used by node cp-01"),
        "{err}"
    );
}

#[test]
fn address_outside_cidr_is_named() {
    let text = atlas_with("address: 10.0.0.21", "address: 10.9.0.21");
    let err = error_of(&text);
    let line = line_of(&text, "10.9.0.21");
    assert!(err.contains(&format!("line {line}: nodes[3].address: node worker-01: address 10.9.0.21 is outside network.cidr 10.0.0.0/16")), "{err}");
}

#[test]
fn gateway_outside_cidr_is_named() {
    let text = atlas_with("gateway: 10.0.0.1", "gateway: 192.168.1.1");
    let err = error_of(&text);
    assert!(
        err.contains("network.gateway: 192.168.1.1 is outside network.cidr"),
        "{err}"
    );
    assert!(
        err.contains(&format!("line {}", line_of(&text, "gateway:"))),
        "{err}"
    );
}

#[test]
fn vip_equal_to_a_node_address_is_named() {
    let text = atlas_with("vip: 10.0.0.20", "vip: 10.0.0.13");
    let err = error_of(&text);
    assert!(
        err.contains("cluster.vip: VIP 10.0.0.13 equals node cp-03's address"),
        "{err}"
    );
}

#[test]
fn no_control_plane_is_an_error() {
    let text = ATLAS.replace("role: controlplane", "role: worker");
    assert!(error_of(&text).contains("no node has role controlplane"));
}

#[test]
fn bad_versions_are_named() {
    let err = error_of(&atlas_with("talosVersion: v1.11.2", "talosVersion: 1.11"));
    assert!(
        err.contains("cluster.talosVersion: \"1.11\" is not a Talos version"),
        "{err}"
    );
    let err = error_of(&atlas_with(
        "kubernetesVersion: v1.32.1",
        "kubernetesVersion: latest",
    ));
    assert!(
        err.contains("cluster.kubernetesVersion: \"latest\""),
        "{err}"
    );
    let err = error_of(&atlas_with("talosVersion: v1.11.2", "talosVersion: v1.3.7"));
    assert!(err.contains("predates META network configuration"), "{err}");
}

#[test]
fn talos_versions_that_name_no_release_are_refused_with_the_rule() {
    for (v, rule) in [
        (
            "v1.13.05",
            "has a leading zero: Talos tags have none (v1.11.2, not v1.11.02)",
        ),
        (
            "v01.11.2",
            "has a leading zero: Talos tags have none (v1.11.2, not v1.11.02)",
        ),
        (
            "v1.011.2",
            "has a leading zero: Talos tags have none (v1.11.2, not v1.11.02)",
        ),
        ("v0.0.0", "predates META network configuration"),
        ("v0.14.0", "predates META network configuration"),
    ] {
        let err = error_of(&atlas_with(
            "talosVersion: v1.11.2",
            &format!("talosVersion: {v}"),
        ));
        assert!(err.contains("cluster.talosVersion: "), "{v}: {err}");
        assert!(err.contains(v), "{v}: {err}");
        assert!(err.contains(rule), "{v}: {err}");
    }
    for v in ["v1.11.0", "v1.11.10", "v1.12.0-beta.0"] {
        let text = atlas_with("talosVersion: v1.11.2", &format!("talosVersion: {v}"));
        assert!(
            !error_of_or_empty(&text).contains("talosVersion"),
            "{v} refused: {}",
            error_of_or_empty(&text)
        );
    }
}

#[test]
fn malformed_extension_names_are_named() {
    let text = atlas_with("- siderolabs/tailscale", "- Tailscale");
    let err = error_of(&text);
    assert!(
        err.contains(&format!(
            "line {}: image.extensions[1]: \"Tailscale\"",
            line_of(&text, "- Tailscale")
        )),
        "{err}"
    );
}

#[test]
fn endpoint_on_the_vip_warns_when_the_first_control_plane_is_unreachable() {
    let text = atlas_with("    address: 10.0.0.11\n", "    dhcp: true\n");
    let inv = load(&text).unwrap();
    assert!(
        inv.warnings
            .iter()
            .any(|w| w.contains("VIP 10.0.0.20") && w.contains("cp-01")),
        "{:?}",
        inv.warnings
    );
    // With cp-01 reachable on its own address, the VIP endpoint is fine.
    assert!(load(ATLAS).unwrap().warnings.is_empty());
}

#[test]
fn unknown_sections_and_keys_are_rejected_with_their_line() {
    let text = format!("{ATLAS}deploy:\n  target: {{}}\n");
    let err = error_of(&text);
    assert!(err.contains("unknown field `deploy`"), "{err}");
    assert!(
        err.contains(&format!("line {}", line_of(&text, "deploy:"))),
        "{err}"
    );
    let err = error_of(&atlas_with(
        "    role: worker\n",
        "    role: worker\n    colour: red\n",
    ));
    assert!(err.contains("unknown field `colour`"), "{err}");
}

#[test]
fn bad_role_names_the_allowed_ones() {
    let err = error_of(&atlas_with("role: worker", "role: master"));
    assert!(
        err.contains("master") && err.contains("controlplane"),
        "{err}"
    );
}

#[test]
fn static_node_without_address_or_link() {
    let err = error_of(&atlas_with("    address: 10.0.0.22\n", ""));
    assert!(
        err.contains("node worker-02: needs an address, or dhcp: true"),
        "{err}"
    );
    let err = error_of(&atlas_with("  interface: eth0\n", ""));
    assert!(err.contains("static addressing needs a link"), "{err}");
}

#[test]
fn dhcp_node_needs_no_address() {
    let inv = load(&atlas_with("    address: 10.0.0.22\n", "    dhcp: true\n")).unwrap();
    assert!(inv.nodes[4].dhcp);
}

#[test]
fn mac_selects_the_link_by_its_altname() {
    let inv = load(&atlas_with(
        "    address: 10.0.0.21\n",
        "    address: 10.0.0.21\n    mac: BC:24:11:00:00:21\n",
    ))
    .unwrap();
    assert_eq!(
        inv.nodes[3].link_name(&inv.network).as_deref(),
        Some("enxbc2411000021")
    );
    let err = error_of(&atlas_with(
        "    address: 10.0.0.21\n",
        "    address: 10.0.0.21\n    mac: nope\n",
    ));
    assert!(err.contains("\"nope\" is not a MAC address"), "{err}");
}

#[test]
fn every_problem_is_reported_at_once() {
    let text = atlas_with("vip: 10.0.0.20", "vip: 10.0.0.13")
        .replace("gateway: 10.0.0.1", "gateway: 192.168.1.1");
    match load(&text) {
        Err(InventoryError::Invalid { problems, .. }) => {
            assert!(problems.len() >= 2, "{problems:?}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn syntax_errors_carry_the_file_and_line() {
    let err = error_of("cluster:\n  name: [unclosed\n");
    assert!(err.contains("examples/atlas/cluster.yaml: "), "{err}");
    assert!(err.contains("line"), "{err}");
}

#[test]
fn unknown_node_lists_the_known_ones() {
    let inv = load(ATLAS).unwrap();
    let err = inv.node("cp-9").unwrap_err().to_string();
    assert!(
        err.contains("cp-9") && err.contains("cp-01, cp-02"),
        "{err}"
    );
}

#[test]
fn even_control_plane_count_warns() {
    let text = atlas_with(
        "role: controlplane\n    address: 10.0.0.13",
        "role: worker\n    address: 10.0.0.13",
    );
    let inv = load(&text).unwrap();
    assert!(
        inv.warnings.iter().any(|w| w.contains("2 control planes")),
        "{:?}",
        inv.warnings
    );
}

#[test]
fn endpoint_hosts() {
    assert_eq!(endpoint_host("https://10.0.0.20:6443"), Some("10.0.0.20"));
    assert_eq!(
        endpoint_host("https://k8s.example:6443/"),
        Some("k8s.example")
    );
    assert_eq!(endpoint_host("https://[fd00::1]:6443"), Some("fd00::1"));
    assert_eq!(endpoint_host("http://10.0.0.20:6443"), None);
    assert_eq!(endpoint_host("https://:6443"), None);
    assert_eq!(endpoint_host("https://h:port"), None);
}

#[test]
fn patch_files_must_exist_and_are_named_with_their_line() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("ok.yaml"), "machine: {}\n").unwrap();
    let text = atlas_with(
        "patches:\n  all: [patches/common.yaml]\n  controlPlane: [patches/controlplane.yaml]\n",
        "patches:\n  all: [ok.yaml]\n  worker:\n    - missing.yaml\n",
    );
    let path = dir.path().join("cluster.yaml");
    let err = Inventory::parse(&text, &path).unwrap_err().to_string();
    let line = line_of(&text, "- missing.yaml");
    assert!(
        err.contains(&format!("line {line}: patches.worker[0]: patch file")),
        "{err}"
    );
    assert!(err.contains("missing.yaml does not exist"), "{err}");
    assert!(!err.contains("ok.yaml"), "{err}");
    let fixed = text.replace("    - missing.yaml\n", "    - ok.yaml\n");
    let inv = Inventory::parse(&fixed, &path).unwrap();
    assert_eq!(inv.base_dir, dir.path());
    assert_eq!(inv.patches.worker, [PathBuf::from("ok.yaml")]);
}

#[test]
fn talos_endpoints_are_ip_or_ip_port_for_validate_and_bootstrap_alike() {
    assert_eq!(
        talos_endpoint("127.0.0.1:50001"),
        Some("127.0.0.1:50001".parse().unwrap())
    );
    assert_eq!(
        talos_endpoint("10.0.0.5"),
        Some("10.0.0.5:50000".parse().unwrap())
    );
    assert_eq!(
        talos_endpoint("[fd00::1]:50001"),
        Some("[fd00::1]:50001".parse().unwrap())
    );
    assert_eq!(
        talos_endpoint("fd00::1"),
        Some("[fd00::1]:50000".parse().unwrap())
    );
    for bad in ["node1.lan:50000", "node1.lan", "10.0.0.5:port", ""] {
        assert_eq!(talos_endpoint(bad), None, "{bad}");
    }
    // validate accepts a plain IP (bootstrap did) and refuses a host name
    // (bootstrap could not use it).
    let ok = atlas_with(
        "    address: 10.0.0.21\n",
        "    address: 10.0.0.21\n    talosEndpoint: 10.0.0.21\n",
    );
    load(&ok).unwrap();
    let text = atlas_with(
        "    address: 10.0.0.21\n",
        "    address: 10.0.0.21\n    talosEndpoint: worker-01.lan:50000\n",
    );
    let err = error_of(&text);
    assert!(
        err.contains(&format!(
            "line {}: nodes[3].talosEndpoint: node worker-01:",
            line_of(&text, "talosEndpoint")
        )),
        "{err}"
    );
    assert!(err.contains("host names are not resolved"), "{err}");
}

/// The atlas inventory as a Hetzner one: platform hcloud plus `publish`.
fn atlas_hcloud(publish: &str) -> String {
    format!(
        "{}\npublish:\n  hcloud:\n{publish}",
        atlas_with("platform: metal", "platform: hcloud")
    )
}

#[test]
fn hcloud_publish_loads_with_defaults() {
    let inv = load(&atlas_hcloud(
        "    location: fsn1\n    labels: {team: infra}\n",
    ))
    .unwrap();
    let hc = inv.publish.hcloud().unwrap().clone();
    assert_eq!(hc.location, "fsn1");
    assert!(hc.server_types.is_empty());
    assert_eq!(hc.labels["team"], "infra");
    assert!(hc.servers.is_none());
}

#[test]
fn hcloud_publish_problems_name_their_fields() {
    let text = atlas_hcloud(
        "    location: FSN 1\n    serverTypes: [cx23, 'Bad Type']\n    labels:\n      os: linux\n      hetzner.cloud/x: y\n      team: 'in fra'\n    servers: {type: ''}\n",
    );
    let err = error_of(&text);
    for needle in [
        "publish.hcloud.location",
        "publish.hcloud.serverTypes[1]",
        "label os is set by imgbuild",
        "hetzner.cloud/ prefix is reserved",
        "value \"in fra\"",
        "publish.hcloud.servers.type",
    ] {
        assert!(err.contains(needle), "{needle:?} missing from:\n{err}");
    }
    let err = error_of(&format!(
        "{ATLAS}\npublish:\n  hcloud:\n    location: fsn1\n"
    ));
    assert!(err.contains("needs image.platform: hcloud"), "{err}");
}

#[test]
fn hetzner_label_rule() {
    for (k, v) in [("team", "infra"), ("a.b/c-d_e", ""), ("x", "1.2.3")] {
        assert_eq!(publish::label_problem(k, v), None, "{k}={v}");
    }
    for (k, v) in [
        ("-team", "x"),
        ("team", "x-"),
        (&"k".repeat(64) as &str, "v"),
        ("team", &"v".repeat(64) as &str),
        ("/x", "v"),
        ("a..b/x", "v"),
        ("hetzner.cloud/x", "v"),
    ] {
        assert!(publish::label_problem(k, v).is_some(), "{k}={v} accepted");
    }
}

#[test]
fn patch_paths_stay_inside_the_inventory_folder() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("inv");
    std::fs::create_dir_all(base.join("patches")).unwrap();
    std::fs::write(base.join("patches/ok.yaml"), "machine: {}\n").unwrap();
    std::fs::write(dir.path().join("secret"), "x").unwrap();
    std::os::unix::fs::symlink(dir.path().join("secret"), base.join("out.yaml")).unwrap();
    std::os::unix::fs::symlink("patches/ok.yaml", base.join("in.yaml")).unwrap();
    let ok = |f: &str| patch_path(&base, Path::new(f));
    assert_eq!(ok("patches/ok.yaml").unwrap(), base.join("patches/ok.yaml"));
    assert!(ok("in.yaml").is_ok());
    assert!(ok("out.yaml").unwrap_err().contains("leads outside"));
    assert!(ok("../secret").unwrap_err().contains("no leading / or .."));
    let abs = dir.path().join("secret");
    assert!(
        ok(abs.to_str().unwrap())
            .unwrap_err()
            .contains("no leading / or ..")
    );
    assert!(ok("patches").unwrap_err().contains("is a directory"));
    assert!(ok("nope.yaml").unwrap_err().contains("does not exist"));
}

#[test]
fn vmids_counted_past_the_range_are_refused_at_first_id() {
    let vm = "\npublish:\n  proxmox:\n    node: pve\n    storage: local\n    vm:\n      storage: local-lvm\n      firstId: 4294967295\n";
    let err = error_of(&format!("{ATLAS}{vm}"));
    assert!(err.contains("publish.proxmox.vm.firstId"), "{err}");
    assert!(!err.contains("no vmid"), "{err}");
    let near = vm.replace("4294967295", "999999997");
    let err = error_of(&format!("{ATLAS}{near}"));
    assert!(err.contains("999999997..1000000001 of 5 node(s)"), "{err}");
    let fits = vm.replace("4294967295", "999999995");
    assert!(load(&format!("{ATLAS}{fits}")).is_ok());
    let huge = format!("{fits}      memory: 4294967295\n      diskSize: 65537\n");
    let err = error_of(&format!("{ATLAS}{huge}"));
    assert!(err.contains("vm.memory: 4294967295 is above"), "{err}");
    assert!(err.contains("vm.diskSize: 65537 is above"), "{err}");
}

#[test]
fn kernel_arguments_fit_the_kernel_command_line() {
    let long = "x".repeat(3000);
    let text = atlas_with(
        "  format: raw\n",
        &format!("  format: raw\n  kernelArgs: [a={long}]\n"),
    );
    let err = error_of(&text);
    assert!(err.contains("image.kernelArgs: 3003 bytes"), "{err}");
    assert!(!err.contains(&long), "the argument is echoed whole");
}

#[test]
fn a_section_names_one_target_and_both_are_refused_with_their_line() {
    let pve = "  proxmox:\n    node: pve\n    storage: local\n";
    let hc = "  hcloud:\n    location: fsn1\n";
    let hcloud_atlas = atlas_with("platform: metal", "platform: hcloud");
    let one = load(&format!("{hcloud_atlas}\npublish:\n{hc}")).unwrap();
    assert!(matches!(one.publish.target(), PublishSettings::Hcloud(h) if h.location == "fsn1"));
    assert!(one.publish.proxmox().is_none());
    let one = load(&format!("{ATLAS}\npublish:\n{pve}")).unwrap();
    assert!(matches!(one.publish.target(), PublishSettings::Proxmox(p) if p.node == "pve"));
    assert!(matches!(
        load(ATLAS).unwrap().publish.target(),
        PublishSettings::None
    ));
    let text = format!("{hcloud_atlas}\npublish:\n{pve}{hc}");
    let err = error_of(&text);
    let line = line_of(&text, "  hcloud:");
    assert!(
        err.contains(&format!(
            "line {line}: publish.hcloud: publish has both proxmox and hcloud: an inventory publishes to one target"
        )),
        "{err}"
    );
}

#[test]
fn secure_boot_settings_are_checked_with_their_field_and_line() {
    let text = atlas_with(
        "image:\n",
        "image:\n  secureBoot: true\n  enrollKeys: always\n",
    );
    let err = error_of(&text);
    let line = line_of(&text, "enrollKeys");
    assert!(
        err.contains(&format!(
            "line {line}: image.enrollKeys: \"always\" is not one of off, manual, if-safe, force"
        )),
        "{err}"
    );
    // Factory settings without any Secure Boot node change IDs for nothing.
    let err = error_of(&atlas_with(
        "image:\n",
        "image:\n  includeWellKnownCertificates: true\n",
    ));
    assert!(
        err.contains("image.includeWellKnownCertificates: is a Secure Boot setting"),
        "{err}"
    );
    let err = error_of(&atlas_with("image:\n", "image:\n  encryption: tpm\n"));
    assert!(
        err.contains("image.encryption: tpm encryption is enrolled only while Secure Boot is on"),
        "{err}"
    );
}

#[test]
fn a_node_that_turns_secure_boot_off_cannot_have_tpm_encryption() {
    let text = atlas_with(
        "image:\n",
        "image:\n  secureBoot: true\n  encryption: tpm\n",
    )
    .replacen(
        "  - name: cp-02\n",
        "  - name: cp-02\n    secureBoot: false\n",
        1,
    );
    let err = error_of(&text);
    assert!(err.contains("nodes[1].secureBoot: node cp-02"), "{err}");
    let inv = load(
        &atlas_with("image:\n", "image:\n  secureBoot: true\n").replacen(
            "  - name: cp-02\n",
            "  - name: cp-02\n    secureBoot: false\n",
            1,
        ),
    )
    .unwrap();
    assert!(inv.secure_boot(&inv.nodes[0]) && !inv.secure_boot(&inv.nodes[1]));
}

#[test]
fn secure_boot_needs_a_talos_that_boots_ukis() {
    let text = atlas_with("image:\n", "image:\n  secureBoot: true\n").replacen(
        "talosVersion: v1.11.2",
        "talosVersion: v1.4.8",
        1,
    );
    let err = error_of(&text);
    assert!(
        err.contains("image.secureBoot: Secure Boot images are UKIs"),
        "{err}"
    );
}

/// The atlas inventory with a Proxmox VM section (cluster defaults) and
/// worker-02's own settings `own` (YAML lines under the node).
fn atlas_vms(own: &str) -> String {
    let vm = "\npublish:\n  proxmox:\n    node: pve\n    storage: local\n    vm:\n      storage: local-lvm\n      firstId: 300\n      memory: 4096\n      vlan: 10\n";
    let node = format!("  - name: worker-02\n    role: worker\n{own}");
    format!(
        "{}{vm}",
        ATLAS.replacen("  - name: worker-02\n    role: worker\n", &node, 1)
    )
}

#[test]
fn a_node_s_own_vm_settings_override_the_cluster_s() {
    let inv = load(&atlas_vms(
        "    memory: 8192\n    cores: 4\n    diskSize: 40\n    dataDisks: [50, 60]\n    bridge: vmbr1\n    vlan: 20\n    proxmoxNode: pve2\n",
    ))
    .unwrap();
    let w2 = inv
        .nodes
        .iter()
        .position(|n| n.name == "worker-02")
        .unwrap();
    let own = inv.machine(w2).unwrap();
    assert_eq!(
        own,
        Machine {
            host: "pve2".into(),
            cores: 4,
            memory: 8192,
            disk_size: 40,
            data_disks: vec![50, 60],
            bridge: "vmbr1".into(),
            vlan: Some(20),
        }
    );
    let other = inv.machine(0).unwrap();
    assert_eq!(
        (other.host.as_str(), other.memory, other.cores, other.vlan),
        ("pve", 4096, 2, Some(10))
    );
    assert_eq!(other.bridge, "vmbr0");
    assert!(other.data_disks.is_empty());
}

#[test]
fn bad_node_vm_settings_name_the_node_and_field() {
    for (own, want) in [
        (
            "    memory: 1024\n",
            "nodes[4].memory: node worker-02: 1024 is below the 2048",
        ),
        (
            "    vlan: 4095\n",
            "nodes[4].vlan: node worker-02: VLAN tag 4095 is outside 1..4094",
        ),
        (
            "    bridge: \"vm br\"\n",
            "nodes[4].bridge: node worker-02: \"vm br\" is not a bridge name",
        ),
        (
            "    proxmoxNode: 9pve\n",
            "nodes[4].proxmoxNode: node worker-02: \"9pve\" is not a Proxmox node name",
        ),
        (
            "    dataDisks: [0]\n",
            "nodes[4].dataDisks[0]: node worker-02: 0 GiB",
        ),
        (
            "    diskSize: 9\n",
            "nodes[4].diskSize: node worker-02: 9 is below",
        ),
        (
            "    cores: 0\n",
            "nodes[4].cores: node worker-02: 0 is below",
        ),
        (
            "    cores: 4294967295\n",
            "nodes[4].cores: node worker-02: 4294967295 is above the largest value Proxmox takes (4096)",
        ),
        (
            "    bridge: vmbr0123456789ab\n",
            "nodes[4].bridge: node worker-02: \"vmbr0123456789ab\" is not a bridge name such as vmbr0 (Linux allows 15 characters)",
        ),
    ] {
        let err = error_of(&atlas_vms(own));
        assert!(err.contains(want), "{own}: {err}");
    }
    let no_vm = ATLAS.replacen(
        "  - name: worker-02\n    role: worker\n",
        "  - name: worker-02\n    role: worker\n    memory: 8192\n",
        1,
    );
    let err = error_of(&no_vm);
    assert!(
        err.contains("nodes[4].memory: node worker-02: memory needs publish.proxmox.vm"),
        "{err}"
    );
}

#[test]
fn a_proxmox_node_name_longer_than_a_host_name_is_refused_and_cut_short() {
    let long = "p".repeat(5000);
    let err = error_of(&atlas_vms(&format!("    proxmoxNode: {long}\n")));
    assert!(
        err.contains("nodes[4].proxmoxNode: node worker-02: \"pppp"),
        "{err}"
    );
    assert!(err.contains("at most 63 characters"), "{err}");
    assert!(
        err.len() < 1000,
        "the name is quoted whole: {} bytes",
        err.len()
    );
    let ok = "p".repeat(63);
    let text = atlas_vms(&format!("    proxmoxNode: {ok}\n"));
    assert!(!error_of_or_empty(&text).contains("proxmoxNode"));
}

#[test]
fn kubernetes_versions_that_name_no_release_are_refused_with_the_rule() {
    for (v, rule) in [
        ("v1.32.01", "has a leading zero"),
        ("v01.32.1", "has a leading zero"),
        (
            "v0.0.0",
            "is not a Kubernetes release: Kubernetes versions are v1.N.P",
        ),
        (
            "v99.0.0",
            "is not a Kubernetes release: Kubernetes versions are v1.N.P",
        ),
        (
            "v1.0.3",
            "is not a Kubernetes release: Kubernetes versions are v1.N.P",
        ),
    ] {
        let err = error_of(&atlas_with(
            "kubernetesVersion: v1.32.1",
            &format!("kubernetesVersion: {v}"),
        ));
        assert!(
            err.contains(&format!("cluster.kubernetesVersion: \"{v}\" {rule}")),
            "{v}: {err}"
        );
    }
    for v in ["1.32.1", "v1.33.0-rc.1", "v1.32.10"] {
        let text = atlas_with(
            "kubernetesVersion: v1.32.1",
            &format!("kubernetesVersion: {v}"),
        );
        assert!(
            !error_of_or_empty(&text).contains("kubernetesVersion"),
            "{v} refused"
        );
    }
}

#[test]
fn endpoints_with_more_than_host_and_port_are_refused_with_the_rule() {
    for (ep, rule) in [
        ("https://admin:pw@127.0.0.1:6443", "carries user info"),
        ("https://127.0.0.1:6443/?x=1", "has a query"),
        ("https://127.0.0.1?x=1", "has a query"),
        ("https://127.0.0.1#frag", "has a fragment"),
        (
            "https://127.0.0.1 :6443",
            "holds a space or a control character",
        ),
        (
            "https://127.0.0.1\u{1b}[31m:6443",
            "holds a space or a control character",
        ),
    ] {
        let yaml_ep = serde_json::to_string(ep).unwrap();
        let err = error_of(&atlas_with(
            "kubernetesVersion: v1.32.1",
            &format!("kubernetesVersion: v1.32.1\n  kubernetesEndpoint: {yaml_ep}"),
        ));
        assert!(
            err.contains("cluster.kubernetesEndpoint: ") && err.contains(rule),
            "{ep:?}: {err}"
        );
        assert!(
            !err.contains('\u{1b}'),
            "escape reached the message: {err:?}"
        );
        assert!(
            !err.contains("pw@"),
            "the password reached the message: {err}"
        );
    }
    for ep in [
        "https://k8s.example.org:6443",
        "https://[::1]:6443",
        "https://127.0.0.1:6443/",
    ] {
        let text = atlas_with(
            "kubernetesVersion: v1.32.1",
            &format!("kubernetesVersion: v1.32.1\n  kubernetesEndpoint: {ep:?}"),
        );
        assert!(
            !error_of_or_empty(&text).contains("kubernetesEndpoint"),
            "{ep} refused"
        );
    }
    assert_eq!(endpoint_host("https://a@b:6443"), None);
    assert_eq!(endpoint_host("https://b?x"), None);
    assert_eq!(endpoint_host("https://[::1]:6443"), Some("::1"));
}
