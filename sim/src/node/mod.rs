//! The Talos node double (siderolabs/talos `api/machine/machine.proto`,
//! `internal/app/apid/pkg/director/director.go`): one process simulates a
//! cluster, each node on its own loopback address and port 50000.
//!
//! A node starts in maintenance mode (TLS with a self-signed certificate, no
//! client certificate, only ApplyConfiguration and Disks), validates an
//! applied config against the Talos 1.11 schema, then serves mTLS only with a
//! certificate from the config's `machine.ca`. etcd, kubelet and the
//! Kubernetes API (with node readiness) come up after simulated delays.
//! Switches reproduce the field failures: a node that never leaves
//! maintenance, a reboot after apply, a node configured with a foreign CA,
//! slow time sync, an mTLS certificate naming another address. Nodes stay
//! NotReady (the kubelet's "cni plugin not initialized") while no control
//! plane config brings a CNI (`cluster.network.cni.name: none` and no
//! inline or extra manifests). Calls through one node's API are routed as apid does
//! (`node`: one-to-one, replies untouched; `nodes`: one-to-many, replies
//! stamped with the target as sent, failures in `metadata.error`).
//!
//! # Contract (tests, `make demo` and the machine simulators depend on it)
//! ```text
//! imgbuild-sim nodes [--node NAME=IP:ROLE]... [--vip IP] [--talos-port 50000]
//!     [--k8s-port 6443] [--*-delay MS] [--disks sda] [--misbehave MODE[@NODE]]...
//! ```
//! Prints `{"control":"http://127.0.0.1:PORT","nodes":{NAME:"IP:PORT",…},
//! "forwards":{"kube":{NAME:"IP:PORT"},"talos":{NAME:"IP:PORT"}}}`.
//! - `--kube-forward NAME=IP:PORT`, `--talos-forward NAME=IP:PORT` (port 0:
//!   a free one): control plane NAME's Kubernetes API, node NAME's Talos API
//!   also served there, as a published port of a Talos container is (same
//!   certificates; see `node/k8s/forward.rs`). `GET /_sim/stats` has
//!   `"connections":{"k8s":{"IP:PORT":n},"talos":{…}}`: every connection
//!   accepted, by the address it came in on.
//! - `--vip-held`: the VIP stays unbound, even after the election, until
//!   `POST /_sim/vip` → 200 `{"released":true}` (a VIP that comes late).
//!
//! Zero `--node`s is fine: machines then boot nodes through the control server.
//! - `POST /_sim/boot` `{"name":"vm-300","ip":"127.x.y.z","hostname":"cp-01"?,
//!   "config":"<machine config YAML>"?}` → 200 `{"booted":true,"name","ip",
//!   "configured":bool,"config_error":null|"…"}`; a node listens on
//!   ip:talos-port (and ip:k8s-port once its config makes it a control plane:
//!   the role of a booted node is its config's `machine.type`). Without
//!   `config` it is in maintenance mode; with one (hcloud `user_data`) it is
//!   validated by this node's own schema check: valid → configured at boot
//!   (no apply counted, mTLS from `machine.ca`), invalid → maintenance, and
//!   the error in stats. An ip that is up already → 200 `{"booted":false,…}`,
//!   nothing changes. After a halt, the same `name` comes back with the
//!   config it had (a restarted VM); another name gets a fresh node.
//!   `MODE@NODE` misbehaviour matches the boot `name` or `hostname`.
//!   `"machine": ID?` says which machine this is (a VM's creation, a
//!   server's id): another ID at the address is another machine, with a
//!   fresh disk, even under the same `name`.
//! - Node identity (`node/identity.rs`): every machine has its own
//!   (COSI Get/List `Identities.cluster.talos.dev` `cluster/local`, spec
//!   `nodeId: <base62>`, on configured nodes), kept across reboots, upgrades
//!   and restarts of the same machine, new for another machine or after a
//!   Reset that wiped STATE; `HostnameStatuses.net.talos.dev`
//!   `network/hostname`. Kubernetes Nodes report `status.nodeInfo.machineID`
//!   (derived from it as Talos derives `/etc/machine-id`) and `bootID`; a
//!   Node keeps what its kubelet last posted while that kubelet is gone, and
//!   the Node of a machine replaced at its address (another machine or a
//!   wiped one booted there) stays beside the new machine's until deleted
//!   or re-registered under its name by the new kubelet.
//!   400/422 for a bad body or a non-loopback ip.
//! - `POST /_sim/halt` `{"ip"}` → 200 `{"halted":bool,"ip","configured":bool}`
//!   (halted false: was halted already; configured: it held an applied
//!   config, which a node booted from an ISO installed to its disk), 404
//!   for an unknown ip: its ports close, connections end.
//! - `GET /_sim/stats` → `{"nodes":{NAME:{applies,bootstraps,
//!   bootstrap_refusals,maintenance_version_calls,kubeconfigs,phase
//!   (down|maintenance|configured),ip,booted_by(null|boot name),
//!   config_error(null|string),halted,node_id,machine_id,documents(null|["Kind/name",…]: the
//!   applied config's documents besides v1alpha1)}},"bootstrapped":bool,"totals":{applies,
//!   bootstraps,bootstrap_refusals,maintenance_version_calls,kubeconfigs,
//!   nodes,up,configured,config_errors}}`. NAME: a `--node` name; for a
//!   booted node its config's hostname, else the boot `hostname`, else `name`
//!   (also its Kubernetes node name).
//!
//! ## Talos versions and day two (each `node/` module names its upstream file)
//! Every node runs its own Talos version and behaves as that version's
//! source says; the version (and schematic) change with a successful upgrade.
//! ```text
//!     [--talos-version v1.11.2]        every node's version unless set otherwise
//!     [--node-version NAME=TAG]...     one node's version at start (NAME as for MODE@NODE)
//!     [--pull-delay MS]                the first pull of an installer reference (the
//!                                      factory builds it; the build goes on when a pull is
//!                                      cancelled, later pulls wait for what is left of it)
//!     [--pull-cached-delay MS]         every later pull of the same reference (a node
//!                                      that pulled it since its last boot: none)
//!     [--drain-delay MS]               cordon + drain after an Upgrade's ack: the node
//!                                      answers on the OLD version meanwhile
//!     [--upgrade-delay MS]             from the end of the drain (or a Reboot, or the
//!                                      reboot AUTO/REBOOT asks for) until it goes down
//!     [--reboot-delay MS]              how long a reboot keeps port 50000 closed
//!     [--stall-delay MS]               with `stall-connects`: how long each new
//!                                      connection waits before its TLS handshake while
//!                                      the node drains (the "port closed" trap)
//!     [--apply-time MS]                how long an apply on a configured node holds the
//!                                      apply lock (and its reply waits)
//!     [--misbehave MODE[@NODE]]        besides the above: stall-connects, stock (no
//!                                      `schematic` extension: a node without the factory),
//!                                      schematic-read-fails, leave-cordoned (still
//!                                      unschedulable after a drain), installer-fails
//! ```
//! - `POST /_sim/boot` also takes `"talos_version": TAG` (else `--node-version`, else
//!   `--talos-version`) and `"secure_boot": bool` (else `--secure-boot`: the
//!   SecurityState it reports, `node/security.rs`); a restarted machine gets a new boot ID.
//! - `POST /_sim/node` `{"node": NAME, "version"?: TAG, "installer_fails"?: bool,
//!   "schematic_read_fails"?: bool, "stock"?: bool, "stall_connects"?: bool,
//!   "leave_cordoned"?: bool, "cordoned"?: bool, "pull_ms"?: MS, "drain_ms"?: MS,
//!   "disruption_budget"?: bool}`
//!   → 200 with the node's switches; 404 for an unknown NAME, 400 for a bad body.
//!   `disruption_budget`: a PodDisruptionBudget covers the node's workload pods and
//!   allows no disruption, so the API server refuses their evictions (429).
//!   `pull_ms`/`drain_ms` override the flags for that node. (`POST /_sim/installer`
//!   `{"node","fail"}` stays, the same as `installer_fails`.) A failing schematic
//!   read is Unavailable from the COSI State List/Get of ExtensionStatuses.
//! - `POST /_sim/k8s` `{"kube_proxy_ready"?: bool, "coredns_ready"?: bool,
//!   "stale_etcd_member"?: bool}`: the health facts `talosctl health` checks
//!   (`pkg/cluster/check/default.go`) beyond node readiness; true/true/false by
//!   default. A stale member is one more etcd member (`cp-gone`, id 0x1fff) with
//!   no control plane: EtcdMemberList shows it and the Upgrade checks fail on it.
//! - Kubernetes API: `GET /api/v1/nodes` items carry `spec.unschedulable` (true
//!   while cordoned); `GET /api/v1/namespaces/kube-system/pods?labelSelector=k8s-app%3D
//!   {kube-proxy|kube-dns}` lists one kube-proxy pod per node and two CoreDNS pods,
//!   each with a `Ready` condition; `GET /apis/apps/v1/namespaces/kube-system/
//!   {daemonsets|deployments}?labelSelector=…` list the kube-proxy DaemonSet
//!   (`status.desiredNumberScheduled`) and the CoreDNS Deployment (`spec.replicas`),
//!   absent when a control plane's config sets `cluster.proxy.disabled` /
//!   `cluster.coreDNS.disabled`.
//! - Talos API, per the node's version: `MachineService.Upgrade` (all; deprecated
//!   from v1.13) in the order pull (timed, under the caller's gRPC deadline: past
//!   it DeadlineExceeded and no upgrade) → etcd checks on control planes (unless
//!   `force`, or `preserve` on v1.12.9+, v1.13.4+, v1.14: 2 members refuse
//!   "…insufficient to maintain quorum…", then every member started and
//!   healthy) → ack → drain → installer (host floor: v1.N refuses hosts below
//!   v1.(N-2).0 (v1.9/v1.10: v1.8.0); a refusal reverts: reboot on the old
//!   version) → reboot; an Upgrade while a sequence runs is acked and does
//!   nothing. From v1.13: `ImageService.Pull` (the same timed pull) and
//!   `LifecycleService.Upgrade` (the pulled installer, its pre-flight failure
//!   a non-zero `exit_code`; success boots at the next reboot; no etcd check,
//!   no drain, no reboot); Unimplemented below v1.13. `MachineService.Read` of
//!   `/proc/sys/kernel/random/boot_id` (a new UUID every boot),
//!   `MachineService.Reboot` (DEFAULT, POWERCYCLE, FORCE: no drain, down, new boot
//!   ID, up). ApplyConfiguration per v1alpha1_server.go (v1.9–v1.13: CanApplyImmediate,
//!   AUTO → REBOOT for other changes, NO_REBOOT/TRY refused with InvalidArgument
//!   even in a dry run; v1.14: REBOOT Unimplemented, AUTO → NO_REBOOT; the apply
//!   lock's FailedPrecondition on v1.12.9+, v1.13.3+, v1.14; every non-TRY request
//!   cancels a pending TRY rollback).
//! - `GET /_sim/stats`: each node's `day2` adds `boot_id`, `boot_ids` (every
//!   boot, oldest first), `reboots`, `cordoned`, `staged` (bool), `try_pending`,
//!   `upgrade_calls` (every MachineService or LifecycleService Upgrade received,
//!   refused or not), `upgrades` (acked, or a LifecycleService install that
//!   succeeded), `upgrade_refusals` (before the ack), `sequences_locked`, `pulls`,
//!   `pulls_cancelled`, `pulled`, `installer_refusals` (after the ack: the floor or
//!   `installer-fails`), `last_error` (the last refusal's text), `next_boot`,
//!   `requests_by_mode` (every ApplyConfiguration on a configured node, dry runs
//!   and refusals included) and `applies_by_mode` (taken, by the mode it became),
//!   both `{"reboot"|"auto"|"no_reboot"|"staged"|"try": N}`, `apply_refusals`,
//!   `dry_runs`, `try_cancellations` (pending TRY rollbacks a later request
//!   cancelled), `try_rollbacks`, `read_calls`, `reboot_calls`, `reboot_modes`
//!   (each Upgrade's or Reboot's mode name), `lifecycle_upgrades`, `timeline`
//!   (`[{"down_ms":N,"up_ms":N|null,"why":"upgrade|revert|apply|reboot"}]`, ms since
//!   start). Top level adds `timeline` (every node's outages with `"node"` and
//!   `"control_plane"`, by `down_ms`), `now_ms` and `facts`.
//!
//! ## Kubernetes components and objects
//! Static pods, kubelet versions, bootstrap manifests, server-side apply and
//! the deprecated-API metric: the flags, endpoints and stats are listed in
//! `node/k8s/pods.rs` and `node/k8s/objects.rs`.
//!
//! ## etcd snapshots and recovery
//! `EtcdSnapshot`, `EtcdRecover`, `Bootstrap{recover_etcd}`, `/_sim/etcd` and
//! the `etcd-snapshot-*` misbehaviours: see `node/etcd.rs`.
//!
//! What it shares with imgbuild, and why that is sound: the generated
//! protobuf types (`imgbuild::talos::api`, built from `proto/`, whose names
//! and numbers are upstream's `api/machine/machine.proto`) and the certificate helpers
//! (`imgbuild::talos::pki`) to mint its own TLS certificates. Everything the
//! bootstrap is tested on — config validation (its own jsonschema against
//! the vendored schema), routing, disks, states — is written here.

mod apply;
mod boot;
mod config;
mod control;
mod day2;
mod dispatch;
mod etcd;
mod etcd_real;
mod health;
mod hostile;
mod identity;
mod immediate;
mod k8s;
mod lifecycle;
mod listen;
mod machine;
mod remove;
mod security;
mod serve;
mod service;
mod state;
mod switches;
mod tls;
mod upgrade;
mod version;
mod volumes;

pub use self::serve::run;
pub use self::state::Args;

#[cfg(test)]
mod tests;
