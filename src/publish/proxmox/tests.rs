use super::api::*;
use super::credentials::*;
use super::vm::*;
use super::*;
use crate::inventory::Inventory;
use crate::inventory::{ImageFormat, ProxmoxVm, VmBoot};
use crate::net::Trust;
use std::path::Path;

fn inv(extra_node: &str, publish: &str) -> Inventory {
    let text = format!(
        r#"
cluster: {{name: lab, talosVersion: v1.11.2, kubernetesVersion: v1.34.1, endpoint: "https://10.0.0.10:6443"}}
image: {{extensions: [siderolabs/qemu-guest-agent]}}
network: {{cidr: 10.0.0.0/24, gateway: 10.0.0.1, interface: ens18}}
publish:
{publish}
nodes:
  - {{name: cp-01, role: controlplane, address: 10.0.0.11, mac: "bc:24:11:00:00:11"}}
  - {{name: w-01, role: worker, address: 10.0.0.21{extra_node}}}
"#
    );
    Inventory::parse(&text, Path::new("cluster.yaml")).unwrap()
}

const VM: &str =
    "  proxmox:\n    node: pve\n    storage: local\n    vm: {storage: local-lvm, firstId: 300}";

fn env(vars: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
    move |k| {
        vars.iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| v.to_string())
    }
}

#[test]
fn volume_names_carry_the_content_and_survive_normalisation() {
    let sha: crate::digest::Sha256 = "0123456789abcdef".repeat(4).parse().unwrap();
    assert_eq!(
        volume_file("lab", "cp-01", "v1.11.2", &sha, ImageFormat::Raw),
        "lab_cp-01-v1.11.2-0123456789ab.raw"
    );
    assert_eq!(
        volume_file("lab", "cp 01+x", "v1.11.2", &sha, ImageFormat::Qcow2),
        "lab_cp_01_x-v1.11.2-0123456789ab.qcow2"
    );
}

#[test]
fn credentials_come_from_the_environment_only() {
    let px = inv("", VM).publish.proxmox().unwrap().clone();
    let c = Credentials::from_env(
        &px,
        &env(&[
            ("PROXMOX_VE_ENDPOINT", "https://pve.lab:8006/"),
            ("PROXMOX_VE_API_TOKEN", "ci@pve!imgbuild=11111111-2222"),
        ]),
    )
    .unwrap();
    assert_eq!(c.api, "https://pve.lab:8006/api2/json");
    assert!(matches!(c.trust, Trust::System));
    assert_eq!(format!("{c:?}").matches("11111111").count(), 0, "{c:?}");

    let pin = "AB:".repeat(31) + "CD";
    let c = Credentials::from_env(
        &px,
        &env(Box::leak(Box::new([
            ("PROXMOX_VE_ENDPOINT", "https://pve.lab:8006/api2/json"),
            ("PROXMOX_VE_API_TOKEN", "ci@pve!imgbuild=secret"),
            (
                "PROXMOX_VE_FINGERPRINT",
                Box::leak(pin.into_boxed_str()) as &str,
            ),
        ]))),
    )
    .unwrap();
    assert_eq!(c.api, "https://pve.lab:8006/api2/json");
    assert!(matches!(c.trust, Trust::Pinned(_)));

    let c = Credentials::from_env(
        &px,
        &env(&[
            ("PROXMOX_VE_ENDPOINT", "https://pve.lab:8006/"),
            ("PROXMOX_VE_API_TOKEN", "ci@pve!imgbuild=secret"),
            ("PROXMOX_VE_INSECURE", "true"),
        ]),
    )
    .unwrap();
    assert!(c.insecure());
}

#[test]
fn bad_credentials_are_named_but_never_shown() {
    let px = inv("", VM).publish.proxmox().unwrap().clone();
    let cases: [(&[(&str, &str)], &str); 4] = [
        (
            &[("PROXMOX_VE_API_TOKEN", "a@b!c=d")],
            "PROXMOX_VE_ENDPOINT is not set",
        ),
        (
            &[
                ("PROXMOX_VE_ENDPOINT", "http://pve:8006/"),
                ("PROXMOX_VE_API_TOKEN", "a@b!c=d"),
            ],
            "must be https",
        ),
        (
            &[("PROXMOX_VE_ENDPOINT", "https://pve:8006/")],
            "PROXMOX_VE_API_TOKEN is not set",
        ),
        (
            &[
                ("PROXMOX_VE_ENDPOINT", "https://pve:8006/"),
                ("PROXMOX_VE_API_TOKEN", "rootsecretvalue"),
            ],
            "not of the form",
        ),
    ];
    for (vars, want) in cases {
        let vars: &'static [(&'static str, &'static str)] =
            Box::leak(vars.to_vec().into_boxed_slice());
        let err = Credentials::from_env(&px, &env(vars))
            .unwrap_err()
            .to_string();
        assert!(err.contains(want), "{err}");
        assert!(!err.contains("rootsecretvalue"), "{err}");
    }
}

#[test]
fn vms_get_settings_that_boot_talos() {
    let inv = inv("", VM);
    let vm = inv.publish.proxmox().unwrap().vm.clone().unwrap();
    let p: BTreeMap<&str, String> = vm_params(
        &inv,
        0,
        &vm,
        &inv.machine(0).unwrap(),
        300,
        "local:import/x.raw",
        &crate::digest::Sha256::of(b"ab"),
    )
    .into_iter()
    .collect();
    assert_eq!(p["machine"], "q35");
    assert_eq!(p["bios"], "ovmf");
    assert_eq!(p["cpu"], "host");
    assert_eq!(p["scsihw"], "virtio-scsi-pci");
    assert_eq!(p["efidisk0"], "local-lvm:1,efitype=4m,pre-enrolled-keys=0");
    assert_eq!(
        p["scsi0"],
        "local-lvm:0,import-from=local:import/x.raw,discard=on,ssd=1"
    );
    assert_eq!(p["boot"], "order=scsi0");
    assert_eq!(p["net0"], "virtio=BC:24:11:00:00:11,bridge=vmbr0");
    assert_eq!(p["agent"], "enabled=1");
    assert_eq!((p["onboot"].as_str(), p["balloon"].as_str()), ("1", "0"));
    assert_eq!((p["cores"].as_str(), p["memory"].as_str()), ("2", "4096"));
    assert_eq!(p["name"], "cp-01");
    let config = serde_json::json!({"description": p["description"]});
    assert_eq!(
        described_volume(&config).as_deref(),
        Some("local:import/x.raw")
    );
    assert_eq!(owner(&config, "lab", "cp-01"), Owner::Node);
    let w: BTreeMap<&str, String> = vm_params(
        &inv,
        1,
        &vm,
        &inv.machine(1).unwrap(),
        301,
        "v",
        &crate::digest::Sha256::of(b"ab"),
    )
    .into_iter()
    .collect();
    assert_eq!(w["net0"], "virtio,bridge=vmbr0");
    assert!(!w.contains_key("scsi1"));
    // The node's own settings: memory, cores, bridge, VLAN, data disks.
    let own = self::inv(
        ", memory: 8192, cores: 6, bridge: vmbr1, vlan: 42, dataDisks: [50, 7]",
        VM,
    );
    let o: BTreeMap<&str, String> = vm_params(
        &own,
        1,
        &vm,
        &own.machine(1).unwrap(),
        301,
        "v",
        &crate::digest::Sha256::of(b"ab"),
    )
    .into_iter()
    .collect();
    assert_eq!((o["memory"].as_str(), o["cores"].as_str()), ("8192", "6"));
    assert_eq!(o["net0"], "virtio,bridge=vmbr1,tag=42");
    assert_eq!(o["scsi1"], "local-lvm:50,discard=on,ssd=1");
    assert_eq!(o["scsi2"], "local-lvm:7,discard=on,ssd=1");
}

#[test]
fn vmids_count_up_from_first_id_unless_a_node_sets_one() {
    let i = inv(", vmid: 999", VM);
    assert_eq!((i.vmid(0), i.vmid(1)), (Some(300), Some(999)));
}

#[test]
fn publish_settings_are_validated_with_their_line() {
    let text = "cluster: {name: lab, talosVersion: v1.11.2, kubernetesVersion: v1.34.1, endpoint: \"https://10.0.0.10:6443\"}\nnetwork: {cidr: 10.0.0.0/24, gateway: 10.0.0.1, interface: ens18}\npublish:\n  proxmox:\n    node: pve\n    storage: local\n    fingerprint: \"AB:CD\"\n    vm: {storage: local-lvm, firstId: 300}\nnodes:\n  - {name: cp-01, role: controlplane, address: 10.0.0.11}\n  - {name: w-01, role: worker, address: 10.0.0.21, vmid: 300}\n";
    let err = Inventory::parse(text, Path::new("c.yaml"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("line 7: publish.proxmox.fingerprint"), "{err}");
    assert!(err.contains("vmid 300 is already node cp-01's"), "{err}");
}

#[test]
fn task_ids_name_their_node() {
    assert_eq!(
        upid_node("UPID:pve2:0000:0001:65:imgcopy::root@pam:"),
        Some("pve2")
    );
    assert_eq!(upid_node("nonsense"), None);
}

#[test]
fn a_vm_keeps_its_disk_unless_asked_to_replace_it() {
    let vm = self::inv("", VM)
        .publish
        .proxmox()
        .unwrap()
        .vm
        .clone()
        .unwrap();
    let existing = (true, serde_json::json!({}));
    let memory = settings::SettingChange {
        field: "memory".into(),
        from: "4096".into(),
        to: "8192".into(),
        apply: Apply::Reboot,
    };
    let host = settings::SettingChange {
        field: "proxmoxNode".into(),
        apply: Apply::Recreate,
        ..memory.clone()
    };
    assert_eq!(
        vm_decision(&vm, None, &[], false),
        (VmChange::Created, true)
    );
    assert_eq!(
        vm_decision(&vm, Some(&existing), &[], false),
        (VmChange::Unchanged, false)
    );
    assert_eq!(
        vm_decision(&vm, Some(&existing), &[memory], false),
        (VmChange::Changed, false)
    );
    assert_eq!(
        vm_decision(&vm, Some(&existing), &[host], false),
        (VmChange::Unchanged, false)
    );
    assert_eq!(
        vm_decision(&vm, Some(&existing), &[], true),
        (VmChange::Updated, true)
    );
}

#[test]
fn a_vm_is_the_nodes_only_when_imgbuild_made_it_for_that_node_of_that_cluster() {
    let config = |d: &str| serde_json::json!({ "description": d });
    let ours = "Talos node image managed by imgbuild\nimgbuild-cluster: lab\nimgbuild-node: cp-01\nimgbuild-volume: local:import/a.raw\n";
    assert_eq!(owner(&config(ours), "lab", "cp-01"), Owner::Node);
    assert_eq!(
        owner(&config(ours), "prod", "cp-01"),
        Owner::Other {
            cluster: "lab".into(),
            node: "cp-01".into()
        }
    );
    assert!(matches!(
        owner(&config(ours), "lab", "cp-02"),
        Owner::Other { .. }
    ));
    // Written before imgbuild recorded cluster and node: the name decides.
    let older = "Talos node image managed by imgbuild\nimgbuild-volume: local:import/a.raw\n";
    assert_eq!(owner(&config(older), "lab", "cp-01"), Owner::Node);
    assert_eq!(
        owner(&config("Managed by Terraform"), "lab", "cp-01"),
        Owner::NotImgbuild
    );
    assert_eq!(
        owner(&serde_json::json!({"name": "cp-01"}), "lab", "cp-01"),
        Owner::NotImgbuild
    );
}

#[test]
fn iso_vms_boot_the_cdrom_before_a_blank_disk() {
    let text = "cluster: {name: lab, talosVersion: v1.11.2, kubernetesVersion: v1.34.1, endpoint: \"https://10.0.0.10:6443\"}\nimage: {format: iso, bootloader: grub}\nnetwork: {cidr: 10.0.0.0/24, gateway: 10.0.0.1, interface: ens18}\npublish:\n  proxmox:\n    node: pve\n    storage: local\n    vm: {storage: local-lvm, firstId: 300, diskSize: 12, boot: iso}\nnodes:\n  - {name: cp-01, role: controlplane, address: 10.0.0.11}\n";
    let inv = Inventory::parse(text, Path::new("c.yaml")).unwrap();
    let vm = inv.publish.proxmox().unwrap().vm.clone().unwrap();
    let p: BTreeMap<&str, String> = vm_params(
        &inv,
        0,
        &vm,
        &inv.machine(0).unwrap(),
        300,
        "local:iso/x.iso",
        &crate::digest::Sha256::of(b"ab"),
    )
    .into_iter()
    .collect();
    assert_eq!(p["ide2"], "local:iso/x.iso,media=cdrom");
    assert_eq!(p["boot"], "order=scsi0;ide2");
    assert_eq!(p["scsi0"], "local-lvm:12,discard=on,ssd=1");
    assert_eq!(content_for(ImageFormat::Iso), "iso");
    assert_eq!(content_for(ImageFormat::Qcow2), "import");
    let config = serde_json::json!({"description": p["description"]});
    assert_eq!(
        described_volume(&config).as_deref(),
        Some("local:iso/x.iso")
    );

    // The VM boots what the image is: an ISO needs boot: iso, and back.
    for (from, to, want) in [
        (
            "boot: iso}",
            "boot: disk}",
            "image.format iso needs boot: iso",
        ),
        ("format: iso, ", "", "boot: iso needs image.format: iso"),
    ] {
        let err = Inventory::parse(&text.replace(from, to), Path::new("c.yaml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("publish.proxmox.vm.boot"), "{err}");
        assert!(err.contains(want), "{err}");
    }
}

/// The decision both runs share: which VMs are made, given a disk or an
/// ISO, and started, for every state a VM can be found in. An existing
/// VM's disk is its image of record: only `replace` gives it a new one.
#[test]
fn the_vm_decision_says_what_happens_and_whether_it_starts() {
    let inv = inv("", VM);
    let disk = inv.publish.proxmox().unwrap().vm.clone().unwrap();
    let iso = ProxmoxVm {
        boot: VmBoot::Iso,
        ..disk.clone()
    };
    let any = serde_json::json!({});
    let cases = [
        (&disk, None, false, (VmChange::Created, true)),
        (
            &disk,
            Some((true, any.clone())),
            false,
            (VmChange::Unchanged, false),
        ),
        (
            &disk,
            Some((false, any.clone())),
            false,
            (VmChange::Unchanged, true),
        ),
        // Stopped for the swap, so started again.
        (
            &disk,
            Some((true, any.clone())),
            true,
            (VmChange::Updated, true),
        ),
        // The new ISO goes into the running VM: nothing to start.
        (
            &iso,
            Some((true, any.clone())),
            true,
            (VmChange::Updated, false),
        ),
        (
            &iso,
            Some((false, any.clone())),
            true,
            (VmChange::Updated, true),
        ),
    ];
    for (i, (vm, existing, replace, want)) in cases.into_iter().enumerate() {
        assert_eq!(
            vm_decision(vm, existing.as_ref(), &[], replace),
            want,
            "case {i}"
        );
    }
    let stay_off = ProxmoxVm {
        start: false,
        ..disk.clone()
    };
    assert_eq!(
        vm_decision(&stay_off, None, &[], false),
        (VmChange::Created, false)
    );
}
