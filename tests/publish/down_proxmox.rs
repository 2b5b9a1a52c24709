//! `imgbuild down` on Proxmox VE and the library call that deletes one VM
//! imgbuild made, against the Proxmox simulator (which deletes as
//! qemu-server `destroy_vm` does). Talos v1.11.2 images (the loopback
//! example), built by the factory simulator.

use std::path::Path;
use std::process::Output;

use crate::common;
use common::inventory::Inventory;
use common::run::{Run, Work};
use common::sims::{Pve, Sim};
use common::{json, text};
use imgbuild::publish::proxmox::Credentials;
use imgbuild::publish::proxmox::destroy::{
    ClusterVm, DeleteOptions, Stopped, cluster_vms, delete_vm,
};

fn work() -> Work {
    Work::new(&Inventory::loopback().proxmox(true))
}

/// `imgbuild ARGS` on the work's inventory against the Proxmox simulator.
fn run(work: &Work, pve: &Pve, args: &[&str]) -> Output {
    Run::with_config(&work.config, args).proxmox(pve).output()
}

fn publish(work: &Work, sim: &Sim, pve: &Pve, nodes: &[&str]) {
    let o = Run::with_config(&work.config, &["publish", "--poll-ms", "20", "--quiet"])
        .args(nodes)
        .factory(sim)
        .folders(work.dir.path())
        .proxmox(pve)
        .output();
    assert!(o.status.success(), "{}", text(&o.stderr));
}

/// Creates VM `vmid` named `name` with a disk of its own and `description`,
/// as someone else would.
fn foreign_vm(pve: &Pve, vmid: u32, name: &str, description: &str) {
    let (code, v) = pve.curl(
        "/nodes/pve/qemu",
        &[
            "-d",
            &format!("vmid={vmid}"),
            "-d",
            &format!("name={name}"),
            "-d",
            "memory=512",
            "-d",
            "scsi0=local-lvm:1",
            "--data-urlencode",
            &format!("description={description}"),
        ],
    );
    assert_eq!(code, 200, "{v}");
    assert_eq!(pve.wait(&v["data"])["exitstatus"], "OK");
}

fn exists(pve: &Pve, vmid: u32) -> bool {
    let (code, _) = pve.curl(&format!("/nodes/pve/qemu/{vmid}/config"), &[]);
    code == 200
}

/// The files of the simulator's VM disk storage.
fn disks(pve: &Pve) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(pve.dir.path().join("state/storage/local-lvm"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    out.sort();
    out
}

fn imports(pve: &Pve) -> Vec<String> {
    let dir = pve.dir.path().join("state/storage/local/import");
    let mut out: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

/// A file uploaded into `local` as `name` by someone else.
fn foreign_upload(pve: &Pve, dir: &Path, name: &str) {
    let file = dir.join(name);
    std::fs::write(&file, vec![0u8; 4096]).unwrap();
    let sum = common::text(
        &std::process::Command::new("sha256sum")
            .arg(&file)
            .output()
            .unwrap()
            .stdout,
    );
    let (code, v) = pve.upload(&file, sum.split_whitespace().next().unwrap());
    assert_eq!(code, 200, "{v}");
    assert_eq!(pve.wait(&v["data"])["exitstatus"], "OK");
}

#[test]
fn down_deletes_the_clusters_vms_and_volumes_and_nothing_else() {
    let sim = Sim::start(&[]);
    let pve = Pve::start(&[]);
    let work = work();
    publish(&work, &sim, &pve, &["cp-01", "cp-02"]);
    // Named as nodes of the cluster, but not imgbuild's for it.
    foreign_vm(&pve, 500, "cp-03", "Managed by Terraform");
    foreign_vm(
        &pve,
        501,
        "cp-01",
        "Talos node image managed by imgbuild\nimgbuild-cluster: other\nimgbuild-node: cp-01\n",
    );
    foreign_upload(&pve, work.dir.path(), "talos-v1.11.2-by-hand.raw");
    foreign_upload(
        &pve,
        work.dir.path(),
        "other-cp-01-v1.11.2-0123456789ab.raw",
    );
    let before = imports(&pve);
    assert_eq!(before.len(), 4, "{before:?}");

    // Without --yes and without a terminal: the list, exit 2, nothing gone.
    let o = run(&work, &pve, &["down"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    assert!(
        err.contains("VM 300") && err.contains("VM 301") && err.contains("--yes"),
        "{err}"
    );
    assert!(!err.contains("VM 500") && !err.contains("VM 501"), "{err}");
    assert!(exists(&pve, 300) && exists(&pve, 301));
    assert_eq!(imports(&pve), before);

    // --dry-run: what the deletion below takes, exactly; nothing deleted,
    // no confirmation asked.
    let o = run(&work, &pve, &["down", "--dry-run", "--output", "json"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let dry = json(&o);
    assert_eq!(dry["dryRun"], true, "{dry}");
    assert!(exists(&pve, 300) && exists(&pve, 301));
    assert_eq!(imports(&pve), before);
    let o = run(&work, &pve, &["down", "--dry-run"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let shown = text(&o.stdout);
    assert!(
        shown.contains("would delete") && shown.contains("VM 300") && !shown.contains("VM 500"),
        "{shown}"
    );

    let o = run(
        &work,
        &pve,
        &["down", "--yes", "--poll-ms", "20", "--output", "json"],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let v = json(&o);
    let vms: Vec<u64> = v["deleted"]["vms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["vmid"].as_u64().unwrap())
        .collect();
    assert_eq!(vms, [300, 301], "{v}");
    assert_eq!(v["deleted"]["volumes"].as_array().unwrap().len(), 2, "{v}");
    let planned: Vec<u64> = dry["wouldDelete"]["vms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["vmid"].as_u64().unwrap())
        .collect();
    assert_eq!(planned, vms, "the dry run listed other VMs: {dry}");
    assert_eq!(
        dry["wouldDelete"]["volumes"], v["deleted"]["volumes"],
        "the dry run listed other volumes"
    );
    assert!(!exists(&pve, 300) && !exists(&pve, 301));
    assert!(exists(&pve, 500) && exists(&pve, 501));
    assert_eq!(disks(&pve), ["vm-500-disk-0.raw", "vm-501-disk-0.raw"]);
    assert_eq!(
        imports(&pve),
        [
            "other-cp-01-v1.11.2-0123456789ab.raw",
            "talos-v1.11.2-by-hand.raw"
        ]
    );

    // A rerun has nothing left to do.
    let o = run(&work, &pve, &["down", "--yes"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(
        text(&o.stdout).contains("has no VMs"),
        "{}",
        text(&o.stdout)
    );
}

fn credentials(pve: &Pve, work: &Work) -> Credentials {
    let inv = imgbuild::inventory::Inventory::load(&work.config).unwrap();
    let settings = inv.publish.proxmox().unwrap().clone();
    let env = |k: &str| match k {
        "PROXMOX_VE_ENDPOINT" => Some(pve.url.clone()),
        "PROXMOX_VE_API_TOKEN" => Some(pve.token.clone()),
        "PROXMOX_VE_FINGERPRINT" => Some(pve.fingerprint.clone()),
        _ => None,
    };
    Credentials::from_env(&settings, &env).unwrap()
}

fn quick() -> DeleteOptions {
    DeleteOptions {
        shutdown_timeout: std::time::Duration::from_secs(5),
        poll: std::time::Duration::from_millis(20),
        ..DeleteOptions::default()
    }
}

fn the_vm(creds: &Credentials) -> ClusterVm {
    let vms = cluster_vms(creds, "loopback", imgbuild::net::RetryPolicy::default()).unwrap();
    assert_eq!(vms.len(), 1, "{vms:?}");
    vms[0].clone()
}

/// A running VM under HA, with a stray disk of its vmid: shut down, purged
/// from HA, every disk of its vmid freed; deleting it again is done.
#[test]
fn delete_vm_shuts_down_purges_and_is_done_when_the_vm_is_gone() {
    let sim = Sim::start(&[]);
    let pve = Pve::start(&[]);
    let work = work();
    publish(&work, &sim, &pve, &["cp-01"]);
    let creds = credentials(&pve, &work);
    let vm = the_vm(&creds);
    assert_eq!(
        (vm.vmid, vm.node.as_str(), vm.running),
        (300, "cp-01", true)
    );
    let (code, v) = pve.curl("/cluster/ha/resources", &["-d", "sid=vm:300"]);
    assert_eq!(code, 200, "{v}");
    // Left by a failed import: no drive references it.
    let stray = pve
        .dir
        .path()
        .join("state/storage/local-lvm/vm-300-disk-9.raw");
    std::fs::write(&stray, b"stray").unwrap();
    // qemu-server refuses a running VM, and one in HA without purge.
    let (code, v) = pve.curl("/nodes/pve/qemu/300", &["-X", "DELETE"]);
    assert_eq!(code, 500, "{v}");

    let done = delete_vm(&creds, "loopback", &vm, &quick()).unwrap();
    assert!(!done.already_gone);
    assert_eq!(done.stopped, Some(Stopped::Shutdown));
    assert!(!done.volumes.is_empty());
    assert!(!exists(&pve, 300));
    assert!(disks(&pve).is_empty(), "{:?}", disks(&pve));
    let (_, ha) = pve.curl("/cluster/ha/resources", &[]);
    assert_eq!(ha["data"], serde_json::json!([]));

    let again = delete_vm(&creds, "loopback", &vm, &quick()).unwrap();
    assert!(again.already_gone);
    assert_eq!(again.stopped, None);
}

/// A guest that ignores the shutdown is stopped hard; a vmid that now
/// holds a VM imgbuild did not make is refused.
#[test]
fn delete_vm_stops_hard_after_a_failed_shutdown_and_refuses_a_vm_not_ours() {
    let sim = Sim::start(&[]);
    let pve = Pve::start(&["--fail-task", "qmshutdown"]);
    let work = work();
    publish(&work, &sim, &pve, &["cp-01"]);
    let creds = credentials(&pve, &work);
    let vm = the_vm(&creds);
    let done = delete_vm(&creds, "loopback", &vm, &quick()).unwrap();
    assert_eq!(done.stopped, Some(Stopped::Hard));
    assert!(!exists(&pve, 300));

    foreign_vm(&pve, 300, "cp-01", "Managed by Terraform");
    let e = delete_vm(&creds, "loopback", &vm, &quick()).unwrap_err();
    assert!(e.to_string().contains("left as it is"), "{e}");
    assert!(exists(&pve, 300));
}

/// The VMs of the simulator, by vmid.
fn vmids(pve: &Pve) -> Vec<u64> {
    let (code, v) = pve.curl("/cluster/resources?type=vm", &[]);
    assert_eq!(code, 200, "{v}");
    let mut ids: Vec<u64> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|vm| vm["vmid"].as_u64().unwrap())
        .collect();
    ids.sort();
    ids
}

/// Cluster `lab` with node `b-cp-01` and cluster `lab-b` with node `cp-01`
/// on one Proxmox: `<cluster>-<node>` reads `lab-b-cp-01` for both. Each
/// one's prune and down touch only its own VMs and uploads; an upload of
/// the old scheme that either could have made is neither's.
#[test]
fn clusters_whose_names_overlap_as_text_prune_and_go_down_without_touching_each_other() {
    let sim = Sim::start(&[]);
    let pve = Pve::start(&[]);
    let lab = Work::new(
        &Inventory::loopback()
            .proxmox(true)
            .replace("name: loopback", "name: lab")
            .replace("name: cp-01", "name: b-cp-01"),
    );
    let lab_b = Work::new(
        &Inventory::loopback()
            .proxmox(true)
            .replace("name: loopback", "name: lab-b")
            .replace("firstId: 300", "firstId: 400"),
    );
    publish(&lab, &sim, &pve, &["b-cp-01"]);
    publish(&lab_b, &sim, &pve, &["cp-02"]);
    // lab-b stages cp-01's image in storage only: no VM uses it, so a prune
    // (of the wrong cluster) would take it.
    let vm_line = "    vm: {storage: local-lvm, firstId: 400, diskSize: 10, memory: 2048}\n";
    lab_b.edit(vm_line, "");
    publish(&lab_b, &sim, &pve, &["cp-01"]);
    lab_b.edit("    upload: raw\n", &format!("    upload: raw\n{vm_line}"));
    let ambiguous = "lab-b-cp-01-v1.11.2-0123456789ab.raw";
    foreign_upload(&pve, lab.dir.path(), ambiguous);
    let all = imports(&pve);
    assert_eq!(all.len(), 4, "{all:?}");
    let (lab_vms, lab_b_vms) = match vmids(&pve)[..] {
        [a, b] if a < 400 && b >= 400 => (vec![a], vec![b]),
        ref other => panic!("{other:?}"),
    };
    let of = |cluster: &str| -> Vec<String> {
        all.iter()
            .filter(|f| f.starts_with(&format!("{cluster}_")))
            .cloned()
            .collect()
    };
    let (lab_files, lab_b_files) = (of("lab"), of("lab-b"));
    assert_eq!((lab_files.len(), lab_b_files.len()), (1, 2), "{all:?}");

    // lab's prune, keeping nothing unused: nothing of lab-b's goes, and
    // the old-scheme name is listed as not provably lab's.
    let o = run(
        &lab,
        &pve,
        &[
            "prune",
            "--no-cache",
            "--keep",
            "0",
            "--dry-run",
            "--output",
            "json",
        ],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let v = json(&o);
    assert_eq!(v["plan"]["delete"], serde_json::json!([]), "{v}");
    assert_eq!(
        v["plan"]["unowned"][0]["volid"],
        format!("local:import/{ambiguous}"),
        "{v}"
    );
    let o = run(
        &lab,
        &pve,
        &["prune", "--no-cache", "--keep", "0", "--poll-ms", "20"],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(imports(&pve), all, "lab's prune: {}", text(&o.stdout));

    // lab goes down: its VM and its upload, nothing else.
    let o = run(&lab, &pve, &["down", "--yes", "--poll-ms", "20"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(vmids(&pve), lab_b_vms, "{}", text(&o.stdout));
    let mut left: Vec<String> = lab_b_files.clone();
    left.push(ambiguous.to_owned());
    left.sort();
    assert_eq!(imports(&pve), left, "lab's down: {}", text(&o.stdout));

    // lab-b's prune takes its unused upload; its down the rest of its own.
    let o = run(
        &lab_b,
        &pve,
        &["prune", "--no-cache", "--keep", "0", "--poll-ms", "20"],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(imports(&pve).len(), 2, "{:?}", imports(&pve));
    let o = run(&lab_b, &pve, &["down", "--yes", "--poll-ms", "20"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(vmids(&pve).is_empty());
    assert_eq!(imports(&pve), [ambiguous], "{lab_vms:?}");
}

/// A VM whose description carries imgbuild's record for the cluster but a
/// node name no node can have is not provably the cluster's node: `down`
/// and `prune` list it with the reason (text and JSON) and go on, and
/// neither it nor its disk is touched.
#[test]
fn a_vm_whose_record_names_the_cluster_but_a_malformed_node_is_listed_and_left() {
    let sim = Sim::start(&[]);
    let pve = Pve::start(&[]);
    let work = work();
    let o = run(&work, &pve, &["secrets", "gen"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    publish(&work, &sim, &pve, &["cp-01"]);
    foreign_vm(
        &pve,
        600,
        "odd",
        "Talos node image managed by imgbuild\nimgbuild-cluster: loopback\nimgbuild-node: Bad_Name!\n",
    );

    // `up --dry-run` plans as before: the VM is no node to remove.
    let o = Run::with_config(
        &work.config,
        &[
            "--output",
            "json",
            "up",
            "--dry-run",
            "--call-timeout",
            "2s",
        ],
    )
    .factory(&sim)
    .folders(work.dir.path())
    .proxmox(&pve)
    .output();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let v = json(&o);
    let steps: Vec<&serde_json::Value> = v["plan"].as_array().unwrap().iter().collect();
    assert!(!steps.is_empty(), "{v}");
    assert!(
        steps.iter().all(|a| a["step"] != "remove"),
        "a VM not provably the cluster's node is planned for removal: {v}"
    );
    let o = run(&work, &pve, &["down", "--dry-run", "--output", "json"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let dry = json(&o);
    let planned: Vec<u64> = dry["wouldDelete"]["vms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["vmid"].as_u64().unwrap())
        .collect();
    assert_eq!(planned, [300], "{dry}");
    assert_eq!(dry["unowned"][0]["vmid"], 600, "{dry}");
    assert!(
        dry["unowned"][0]["reason"]
            .as_str()
            .unwrap()
            .contains("not a node name"),
        "{dry}"
    );
    let o = run(&work, &pve, &["down", "--dry-run"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let shown = text(&o.stdout);
    assert!(
        shown.contains("left (not provably this cluster's): VM 600 on pve")
            && shown.contains("VM 300"),
        "{shown}"
    );

    let o = run(
        &work,
        &pve,
        &["prune", "--no-cache", "--dry-run", "--output", "json"],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let v = json(&o);
    assert_eq!(v["plan"]["unowned"][0]["kind"], "proxmoxVm", "{v}");
    assert_eq!(v["plan"]["unowned"][0]["vmid"], 600, "{v}");
    let o = run(&work, &pve, &["prune", "--no-cache", "--poll-ms", "20"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(
        text(&o.stdout).contains("left (not provably this cluster's): VM 600"),
        "{}",
        text(&o.stdout)
    );

    let o = run(
        &work,
        &pve,
        &["down", "--yes", "--poll-ms", "20", "--output", "json"],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let v = json(&o);
    assert_eq!(v["deleted"]["vms"][0]["vmid"], 300, "{v}");
    assert_eq!(v["unowned"][0]["vmid"], 600, "{v}");
    assert!(!exists(&pve, 300));
    assert!(exists(&pve, 600), "the VM not provably ours was deleted");
    assert_eq!(disks(&pve), ["vm-600-disk-0.raw"]);
}
