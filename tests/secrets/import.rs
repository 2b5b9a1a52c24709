//! `imgbuild import talhelper` on the three fixtures in fixtures/talhelper/
//! (written from talhelper's documented examples): each converted inventory
//! validates, carries what it should, lists everything it could not carry
//! with its line, and gives every node the schematic ID talhelper's own
//! schematic has wherever both describe the same image.

use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Output;

use crate::common;
use common::run::Run;
use common::{json, root, text};

fn fixture(name: &str) -> PathBuf {
    root()
        .join("fixtures/talhelper")
        .join(name)
        .join("talconfig.yaml")
}

fn imgbuild(args: &[&str], env: &[(&str, &str)]) -> Output {
    // `config` renders with the cluster's secrets: made first, as a user
    // makes them (`secrets gen`), when the state dir has none.
    let value = |flag: &str| {
        let at = args.iter().position(|a| *a == flag)?;
        args.get(at + 1).copied()
    };
    if args.contains(&"config")
        && let (Some(config), Some(state)) = (value("--config"), value("--state-dir"))
        && !Path::new(state).join("secrets.yaml").exists()
    {
        let o = Run::new(&["--config", config, "secrets", "gen", "--state-dir", state]).output();
        assert!(o.status.success(), "{}", text(&o.stderr));
    }
    Run::new(args)
        .env_remove("SITE")
        .env_remove("STORAGE_MODULE")
        .envs(env.iter().copied())
        .output()
}

/// A conversion into a fresh folder: the JSON result and the inventory.
struct Converted {
    dir: tempfile::TempDir,
    result: Value,
    inventory: serde_yaml_ng::Value,
}

impl Converted {
    fn config(&self) -> PathBuf {
        self.dir.path().join("cluster.yaml")
    }

    fn config_str(&self) -> String {
        self.config().to_str().unwrap().to_owned()
    }

    /// (field, line) of everything reported as not carried over.
    fn skipped(&self) -> BTreeSet<(String, Option<u64>)> {
        self.result["skipped"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| (s["field"].as_str().unwrap().to_owned(), s["line"].as_u64()))
            .collect()
    }

    fn node(&self, name: &str) -> &serde_yaml_ng::Value {
        self.inventory["nodes"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|n| n["name"].as_str() == Some(name))
            .unwrap_or_else(|| panic!("no node {name}"))
    }
}

fn convert(name: &str, env: &[(&str, &str)]) -> Converted {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("cluster.yaml");
    let src = fixture(name);
    let mut args = vec![
        "--output",
        "json",
        "import",
        "talhelper",
        src.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ];
    // Only variables named with --env come from the environment.
    for (k, _) in env {
        args.extend(["--env", k]);
    }
    let o = imgbuild(&args, env);
    let result = json(&o);
    // Valid, and partial (exit 3) exactly when something was not carried.
    let nothing_skipped = result["skipped"].as_array().is_some_and(Vec::is_empty);
    assert_eq!(
        o.status.code(),
        Some(if nothing_skipped { 0 } else { 3 }),
        "{}\n{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    assert_eq!(result["valid"], true, "{result}");
    let inventory = serde_yaml_ng::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let c = Converted {
        dir,
        result,
        inventory,
    };
    // It validates as imgbuild reads it, in the same environment: a
    // variable the import left as written must be set when the configs are
    // rendered, and validate names it.
    let o = imgbuild(&["--config", &c.config_str(), "validate"], env);
    let unset: Vec<&str> = c.result["skipped"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| {
            // In a patch file, not in a talconfig field that was skipped.
            s["file"]
                .as_str()
                .is_some_and(|f| !f.ends_with("talconfig.yaml"))
        })
        .filter_map(|s| s["field"].as_str().filter(|f| f.starts_with("${")))
        .collect();
    if unset.is_empty() {
        assert!(o.status.success(), "{}", text(&o.stderr));
    } else {
        assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
        assert!(
            unset
                .iter()
                .any(|v| text(&o.stderr).contains(&format!("{v} is not set in the environment"))),
            "{unset:?}: {}",
            text(&o.stderr)
        );
    }
    c
}

fn skipped(items: &[(&str, u64)]) -> BTreeSet<(String, Option<u64>)> {
    items
        .iter()
        .map(|(f, l)| (f.to_string(), Some(*l)))
        .collect()
}

/// The schematic talhelper would send to Image Factory for `node`: its own
/// `schematic`, else its group's (`controlPlane`/`worker`).
fn talhelper_schematic(talconfig: &Path, node: &str) -> Option<serde_yaml_ng::Value> {
    let doc: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(talconfig).unwrap()).unwrap();
    let n = doc["nodes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|n| n["hostname"].as_str() == Some(node))
        .unwrap();
    let group = if n["controlPlane"].as_bool() == Some(true) {
        "controlPlane"
    } else {
        "worker"
    };
    n.get("schematic")
        .or_else(|| doc[group].get("schematic"))
        .cloned()
}

/// What is compared: talhelper's schematic for a node holds only
/// `customization` (extensions, kernel args). Its ID, as `imgbuild schematic
/// id` computes it from that file (the bytes Image Factory hashes), must
/// equal the ID of the node's base schematic in the converted inventory —
/// the image's and node's extensions and kernel args, without META key 10,
/// which talhelper never puts in a schematic (it configures the network in
/// the machine config instead). `imgbuild plan --route patch` lists that base
/// schematic per node. Nodes whose talhelper schematic has more (an overlay,
/// secure boot) describe another image and are reported, not compared.
fn assert_schematic_ids_match(name: &str, c: &Converted, compared: usize) {
    let talconfig = fixture(name);
    let o = imgbuild(
        &["--config", &c.config_str(), "--output", "json", "plan"],
        &[],
    );
    let plan = json(&o);
    let mut n = 0;
    for node in c.inventory["nodes"].as_sequence().unwrap() {
        let node = node["name"].as_str().unwrap();
        let Some(schematic) = talhelper_schematic(&talconfig, node) else {
            continue;
        };
        let keys: Vec<&str> = schematic
            .as_mapping()
            .unwrap()
            .keys()
            .map(|k| k.as_str().unwrap())
            .collect();
        if keys != ["customization"] {
            continue;
        }
        let file = c.dir.path().join(format!("{node}.schematic.yaml"));
        std::fs::write(&file, serde_yaml_ng::to_string(&schematic).unwrap()).unwrap();
        let o = imgbuild(
            &[
                "--output",
                "json",
                "schematic",
                "id",
                file.to_str().unwrap(),
            ],
            &[],
        );
        let talhelper_id = json(&o)["id"].as_str().unwrap().to_owned();
        let artifact = plan["artifacts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["nodes"].as_array().unwrap().iter().any(|x| x == node))
            .unwrap();
        assert_eq!(artifact["kind"], "base-image");
        assert_eq!(
            artifact["schematicId"].as_str().unwrap(),
            talhelper_id,
            "{name}: node {node}"
        );
        n += 1;
    }
    assert_eq!(n, compared, "{name}: nodes compared");
}

#[test]
fn homelab_converts_addresses_vip_groups_and_patches() {
    let c = convert("homelab", &[]);
    let inv = &c.inventory;
    assert_eq!(inv["cluster"]["name"].as_str(), Some("homelab"));
    assert_eq!(inv["cluster"]["vip"].as_str(), Some("192.168.50.10"));
    assert_eq!(inv["network"]["cidr"].as_str(), Some("192.168.50.0/24"));
    assert_eq!(inv["network"]["gateway"].as_str(), Some("192.168.50.1"));
    assert_eq!(
        inv["network"]["nameservers"],
        serde_yaml_ng::from_str::<serde_yaml_ng::Value>("[192.168.50.1, 1.1.1.1]").unwrap()
    );
    // Every node has net.ifnames=0: it belongs to the image.
    assert_eq!(
        inv["image"]["kernelArgs"][0].as_str(),
        Some("net.ifnames=0")
    );
    let cp = c.node("cp-a");
    assert_eq!(cp["role"].as_str(), Some("controlplane"));
    assert_eq!(cp["address"].as_str(), Some("192.168.50.11"));
    assert_eq!(cp["interface"].as_str(), Some("eth0"));
    assert_eq!(cp["extensions"].as_sequence().unwrap().len(), 2);
    let w = c.node("worker-a");
    assert_eq!(w["installDisk"].as_str(), Some("/dev/nvme0n1"));
    assert_eq!(w["extensions"][2].as_str(), Some("siderolabs/iscsi-tools"));
    // Inline patches became files beside the inventory; the file patch is
    // referenced where it is.
    let node_patch = w["patches"][0].as_str().unwrap();
    let written = std::fs::read_to_string(c.dir.path().join(node_patch)).unwrap();
    assert!(written.contains("max-pods: \"200\""), "{written}");
    let cp_patch = inv["patches"]["controlPlane"][0].as_str().unwrap();
    assert!(
        std::fs::read_to_string(c.dir.path().join(cp_patch))
            .unwrap()
            .contains("admissionControl")
    );
    // A file patch is copied beside the inventory, which reads patches
    // only from its own folder.
    let all = inv["patches"]["all"][0].as_str().unwrap();
    assert_eq!(all, "patches/all-1.yaml");
    assert_eq!(
        std::fs::read_to_string(c.dir.path().join(all)).unwrap(),
        std::fs::read_to_string(root().join("fixtures/talhelper/homelab/patches/time.yaml"))
            .unwrap()
    );
    // talenv.yaml filled ${clusterDomain}: nothing reported about it.
    assert_eq!(
        c.skipped(),
        skipped(&[
            ("domain", 6),
            ("allowSchedulingOnControlPlanes", 7),
            ("additionalApiServerCertSans", 8),
            ("clusterPodNets", 10),
            ("clusterSvcNets", 12),
            ("nodes[2].nodeLabels", 55),
            ("nodes[3].machineFiles", 70),
        ])
    );
    // The inline JSON6902 patch became a file, in its place in the order.
    let json6902 = inv["patches"]["all"][1].as_str().unwrap();
    assert_eq!(json6902, "patches/all-2.yaml");
    assert!(
        std::fs::read_to_string(c.dir.path().join(json6902))
            .unwrap()
            .contains("- op: add")
    );
    assert_schematic_ids_match("homelab", &c, 4);
    // The converted cluster renders machine configs with those patches.
    let o = imgbuild(
        &[
            "--config",
            &c.config_str(),
            "--show-secrets",
            "--yes",
            "config",
            "worker-a",
            "--state-dir",
            c.dir.path().join("state").to_str().unwrap(),
        ],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let config = text(&o.stdout);
    assert!(config.contains("max-pods"), "{config}");
    assert!(config.contains("rotate-server-certificates"), "{config}");
    // cniConfig (name: none) and the worker group's extensionServices
    // came over as patches, and the rendered config carries both.
    assert_eq!(
        inv["patches"]["all"][2].as_str(),
        Some("patches/cni-1.yaml")
    );
    assert_eq!(
        inv["patches"]["worker"][0].as_str(),
        Some("patches/services-worker-1.yaml")
    );
    let docs: Vec<serde_yaml_ng::Value> = serde_yaml_ng::Deserializer::from_str(&config)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect();
    assert_eq!(
        docs[0]["cluster"]["network"]["cni"]["name"].as_str(),
        Some("none")
    );
    let service = docs
        .iter()
        .find(|d| d["kind"].as_str() == Some("ExtensionServiceConfig"))
        .unwrap_or_else(|| panic!("no ExtensionServiceConfig: {config}"));
    assert_eq!(service["name"].as_str(), Some("nut-client"));
    assert_eq!(
        service["configFiles"][0]["mountPath"].as_str(),
        Some("/usr/local/etc/nut/upsmon.conf")
    );
    assert_eq!(service["environment"][0].as_str(), Some("NUT_UPS=rack-ups"));
    // A control plane gets the CNI setting but not the worker's service.
    let o = imgbuild(
        &[
            "--config",
            &c.config_str(),
            "config",
            "cp-a",
            "--state-dir",
            c.dir.path().join("state").to_str().unwrap(),
        ],
        &[],
    );
    let cp = text(&o.stdout);
    assert!(
        cp.contains("name: none") && !cp.contains("nut-client"),
        "{cp}"
    );
}

#[test]
fn baremetal_pins_nics_by_mac_and_reports_sops_and_unset_variables() {
    let c = convert("baremetal", &[]);
    let inv = &c.inventory;
    assert_eq!(inv["cluster"]["vip"].as_str(), Some("10.20.0.5"));
    assert_eq!(inv["network"]["cidr"].as_str(), Some("10.20.0.0/16"));
    assert_eq!(inv["network"]["mtu"].as_u64(), Some(9000));
    // One schematic for every node: the image's extensions.
    assert_eq!(
        inv["image"]["extensions"],
        serde_yaml_ng::from_str::<serde_yaml_ng::Value>(
            "[siderolabs/amd-ucode, siderolabs/bnx2-bnx2x]"
        )
        .unwrap()
    );
    let cp = c.node("rack-cp2");
    assert_eq!(cp["mac"].as_str(), Some("3c:ec:ef:10:00:12"));
    assert!(cp.get("interface").is_none());
    assert!(cp.get("extensions").is_none());
    let w = c.node("rack-w1");
    assert_eq!(w["dhcp"].as_bool(), Some(true));
    assert_eq!(w["interface"].as_str(), Some("enp1s0"));
    assert_eq!(w["address"].as_str(), Some("10.20.1.21"));
    let mut expected = skipped(&[
        ("nodes[1].networkInterfaces[0].deviceSelector.driver", 30),
        ("nodes[1].networkInterfaces[0].routes[1]", 36),
        ("nodes[2].networkInterfaces[1]", 55),
        ("nodes[3].kernelModules", 64),
        ("${STORAGE_MODULE}", 65),
    ]);
    expected.insert(("talenv.sops.yaml".into(), None));
    assert_eq!(c.skipped(), expected);
    assert!(
        !c.result.to_string().contains("bm90IGEgcmVhbCBzZWNyZXQ"),
        "encrypted values stay out of the output"
    );
    assert_schematic_ids_match("baremetal", &c, 4);
    // With the variable set, it is no longer reported.
    let set = convert("baremetal", &[("STORAGE_MODULE", "nvme_tcp")]);
    assert!(!set.skipped().iter().any(|(f, _)| f == "${STORAGE_MODULE}"));
}

#[test]
fn edge_keeps_arch_factory_and_per_node_schematics() {
    let c = convert("edge", &[("SITE", "berlin")]);
    let inv = &c.inventory;
    assert_eq!(inv["image"]["arch"].as_str(), Some("arm64"));
    assert_eq!(inv["image"]["platform"].as_str(), Some("metal"));
    assert_eq!(
        inv["image"]["factory"].as_str(),
        Some("https://factory.internal.example.net")
    );
    assert_eq!(
        inv["image"]["kernelArgs"][0].as_str(),
        Some("console=ttyAMA0")
    );
    for node in ["edge-cp", "edge-gpu", "edge-w2"] {
        assert_eq!(c.node(node)["dhcp"].as_bool(), Some(true), "{node}");
    }
    // The roles' nameservers differ: one patch per role, none in network.
    assert!(
        inv.get("network")
            .is_none_or(|n| n.get("nameservers").is_none())
    );
    let cp_ns = inv["patches"]["controlPlane"][0].as_str().unwrap();
    assert_eq!(cp_ns, "patches/nameservers-controlplane-1.yaml");
    assert!(
        std::fs::read_to_string(c.dir.path().join(cp_ns))
            .unwrap()
            .contains("- 172.30.0.53")
    );
    assert_eq!(
        c.node("edge-gpu")["extensions"][1].as_str(),
        Some("siderolabs/nvidia-open-gpu-kernel-modules-lts")
    );
    // labels.yaml had ${SITE}: written substituted beside the inventory.
    let worker = inv["patches"]["worker"].as_sequence().unwrap();
    assert_eq!(worker.len(), 2, "the SOPS patch is not carried: {worker:?}");
    assert_eq!(
        worker[1].as_str(),
        Some("patches/nameservers-worker-1.yaml")
    );
    let labels = std::fs::read_to_string(c.dir.path().join(worker[0].as_str().unwrap())).unwrap();
    assert!(labels.contains("site: berlin"), "{labels}");
    assert_eq!(
        c.skipped(),
        skipped(&[
            ("nodes[2].machineSpec.secureboot", 48),
            ("nodes[2].schematic", 49),
            ("worker.patches[1]", 62),
        ])
    );
    // edge-w2's schematic has an overlay: another image, not compared.
    assert_schematic_ids_match("edge", &c, 2);
    // Without SITE, the variable is reported in the patch file, by line.
    let unset = convert("edge", &[]);
    let site = unset.result["skipped"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["field"] == "${SITE}")
        .unwrap();
    assert!(
        site["file"]
            .as_str()
            .unwrap()
            .ends_with("patches/labels.yaml")
    );
    assert_eq!(site["line"], 3);
}

#[test]
fn without_out_the_inventory_is_printed_and_inline_patches_are_reported() {
    let o = imgbuild(
        &["import", "talhelper", fixture("homelab").to_str().unwrap()],
        &[],
    );
    // What is not carried makes it partial.
    assert_eq!(o.status.code(), Some(3), "{}", text(&o.stderr));
    let printed: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text(&o.stdout)).unwrap();
    assert_eq!(printed["cluster"]["name"].as_str(), Some("homelab"));
    let err = text(&o.stderr);
    assert!(
        err.contains("talconfig.yaml:91: controlPlane.patches[0]: this patch becomes a new file"),
        "{err}"
    );
    // An inline JSON6902 patch is a new file like any inline patch.
    assert!(
        err.contains("talconfig.yaml:19: patches[1]: this patch becomes a new file"),
        "{err}"
    );
}

#[test]
fn an_existing_inventory_is_kept_unless_forced() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("cluster.yaml");
    std::fs::write(&out, "mine\n").unwrap();
    let src = fixture("baremetal");
    let args = [
        "import",
        "talhelper",
        src.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ];
    let o = imgbuild(&args, &[]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o.stderr).contains("--force"), "{}", text(&o.stderr));
    assert_eq!(std::fs::read_to_string(&out).unwrap(), "mine\n");
    let o = imgbuild(&[&args[..], &["--force"]].concat(), &[]);
    // Replaced; partial as baremetal always is (its SOPS talenv).
    assert_eq!(o.status.code(), Some(3), "{}", text(&o.stderr));
    assert!(
        std::fs::read_to_string(&out)
            .unwrap()
            .contains("name: rack")
    );
}

/// `imgbuild [--output json] import talhelper` on a talconfig with `text`.
fn import_text(text: &str, json_output: bool) -> Output {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("talconfig.yaml");
    std::fs::write(&src, text).unwrap();
    let mut args = Vec::new();
    if json_output {
        args.extend(["--output", "json"]);
    }
    args.extend(["import", "talhelper", src.to_str().unwrap()]);
    imgbuild(&args, &[])
}

#[test]
fn an_encrypted_talconfig_is_refused_by_name() {
    let o = import_text(
        "clusterName: ENC[AES256_GCM,data:eA==,type:str]\nsops:\n  version: 3.9.0\n",
        true,
    );
    assert_eq!(o.status.code(), Some(1));
    let err = json(&o)["error"].as_str().unwrap().to_owned();
    assert!(
        err.contains("SOPS-encrypted") && err.contains("talconfig.yaml"),
        "{err}"
    );
}

#[test]
fn missing_required_fields_are_named() {
    let o = import_text(
        "clusterName: x\nendpoint: https://10.0.0.1:6443\nnodes: []\n",
        false,
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o.stderr).contains("talosVersion is required"),
        "{}",
        text(&o.stderr)
    );
}

/// `DOC` patched with the JSON6902 operations in `ops` (JSON) by
/// github.com/evanphx/json-patch, the library Talos applies them with
/// (tests/oracle/json6902_oracle.go; Go and Debian's
/// golang-github-evanphx-json-patch-dev, which `make deps` installs).
fn evanphx_patched(dir: &Path, doc: &Value, ops: &Value) -> Value {
    let src = root().join("tests/oracle/json6902_oracle.go");
    let oracle = dir.join("json6902_oracle");
    let build = std::process::Command::new("go")
        .args(["build", "-o"])
        .arg(&oracle)
        .arg(&src)
        .env("GOPATH", "/usr/share/gocode")
        .env("GO111MODULE", "off")
        .env("GOCACHE", dir.join("gocache"))
        .output()
        .expect("go is installed (make deps)");
    assert!(build.status.success(), "{}", text(&build.stderr));
    std::fs::write(dir.join("doc.json"), doc.to_string()).unwrap();
    std::fs::write(dir.join("ops.json"), ops.to_string()).unwrap();
    let o = std::process::Command::new(&oracle)
        .arg(dir.join("doc.json"))
        .arg(dir.join("ops.json"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// worker-a's config of the converted homelab with only the cluster-wide
/// patches `all` (the role and node patches left out), read as JSON.
fn homelab_config_with(c: &Converted, all: &[&str], name: &str) -> Value {
    let mut inv = c.inventory.clone();
    inv["patches"] = serde_yaml_ng::from_str("{}").unwrap();
    inv["patches"]["all"] = all.iter().map(|p| serde_yaml_ng::Value::from(*p)).collect();
    for node in inv["nodes"].as_sequence_mut().unwrap() {
        node.as_mapping_mut().unwrap().remove("patches");
    }
    let path = c.dir.path().join(format!("{name}.yaml"));
    std::fs::write(&path, serde_yaml_ng::to_string(&inv).unwrap()).unwrap();
    let out = c.dir.path().join(format!("{name}.config.yaml"));
    let o = imgbuild(
        &[
            "--config",
            path.to_str().unwrap(),
            "config",
            "worker-a",
            "--state-dir",
            c.dir.path().join("state").to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    serde_yaml_ng::from_str(&std::fs::read_to_string(out).unwrap()).unwrap()
}

#[test]
fn a_talhelper_json6902_patch_renders_what_talos_json_patch_library_makes() {
    let c = convert("homelab", &[]);
    let all: Vec<&str> = c.inventory["patches"]["all"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap())
        .collect();
    let (before, json6902) = (&all[..1], all[1]);
    let mut with = before.to_vec();
    with.push(json6902);
    // The config as the patches before it leave it, then with it.
    let base = homelab_config_with(&c, before, "before");
    let patched = homelab_config_with(&c, &with, "with");
    let ops: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(c.dir.path().join(json6902)).unwrap())
            .unwrap();
    let ops: Value = serde_json::to_value(ops).unwrap();
    let oracle = evanphx_patched(c.dir.path(), &base, &ops);
    assert_ne!(base, patched, "the patch changed nothing");
    assert_eq!(
        patched["machine"]["kubelet"]["extraArgs"]["rotate-server-certificates"],
        "true"
    );
    assert_eq!(patched, oracle);
}
