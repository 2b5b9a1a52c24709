#!/usr/bin/env bash
# Day two at the floor (issue 42; run by `make bench`), one run each, with
# the release binaries (BENCH_PROFILE=debug for a quick check):
# - `status` on 5 and on 50 stalled nodes (each accepts TCP on port 50000
#   and never answers) against ONE call timeout: the reads run in parallel
#   (16 at a time) and one deadline covers a node's connect and first call,
#   so the ratio should stay under 1.5.
# - a rolling Talos upgrade (v1.11.2 → v1.11.5) of 3 control planes + 2
#   workers on the node simulator against its floor, 5 × (the simulator's
#   upgrade delay + reboot delay): a node goes down upgrade-delay after the
#   ack and stays down reboot-delay; nodes go one at a time.
# - a Kubernetes upgrade (v1.32.1 → v1.33.1) on the same cluster against its
#   floor, components × restart delay: 3 control planes × 3 static pods ×
#   static-pod delay, + kube-proxy's rollout, + 5 kubelets × kubelet restart.
# BENCH_DAY2=status runs the status lines alone.
# Needs imgbuild, imgbuild-sim, python3, bc.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/bench/bins.sh"
work=$(mktemp -d -p "${TMPDIR:-/var/tmp}" imgbuild-day2.XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT
cd "$work"
now() { date +%s.%N; }
secs() { echo "$2 - $1" | bc -l; }

# --- status on stalled nodes -------------------------------------------
stalled() { # $1 = /24 prefix, $2 = count: listeners that accept and never answer
  python3 - "$1" "$2" <<'PY' &
import socket, sys, select, time
net, n = sys.argv[1], int(sys.argv[2])
ls = []
for i in range(n):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((f"{net}.{11 + i}", 50000)); s.listen(64); ls.append(s)
print("ready", file=sys.stderr, flush=True)
held = []
while True:
    r, _, _ = select.select(ls, [], [])
    for s in r:
        held.append(s.accept()[0])  # accepted, never read, never answered
PY
  pids+=($!)
}
inventory() { # $1 = /24 prefix, $2 = node count, $3 = name
  {
    echo "cluster: {name: $3, talosVersion: v1.11.2, kubernetesVersion: v1.32.1, endpoint: \"https://$1.10:6443\"}"
    echo "image: {factory: \"http://127.0.0.1:9\"}"
    echo "network: {cidr: 127.0.0.0/8, gateway: 127.0.0.1, interface: eth0}"
    echo "nodes:"
    for i in $(seq 1 "$2"); do
      role=worker; [ "$i" -le 3 ] && role=controlplane
      echo "  - {name: n-$i, role: $role, address: $1.$((10 + i))}"
    done
  } > "$3.yaml"
}
call=${BENCH_CALL_TIMEOUT:-5}
printf '| benchmark | imgbuild | baseline | ratio |\n|---|---|---|---|\n'
for n in 5 50; do
  net=127.0.$((90 + n / 50))
  stalled "$net" "$n"; sleep 1
  inventory "$net" "$n" "stalled$n"
  IMGBUILD_STATE_DIR=$work/state$n "$bin" --config "stalled$n.yaml" secrets gen >/dev/null
  IMGBUILD_STATE_DIR=$work/state$n "$bin" --config "stalled$n.yaml" talosconfig >/dev/null
  t0=$(now)
  IMGBUILD_STATE_DIR=$work/state$n "$bin" --config "stalled$n.yaml" --output json status \
    --call-timeout "${call}s" > "status$n.json" || true
  t1=$(now)
  grep -q '"reachable":false' "status$n.json"
  s=$(secs "$t0" "$t1")
  printf '| `status --call-timeout %ss` on %d stalled nodes | %.2f s | one call timeout: %d s | %.2f |\n' \
    "$call" "$n" "$s" "$call" "$(echo "$s / $call" | bc -l)"
  kill "${pids[-1]}"; wait "${pids[-1]}" 2>/dev/null || true
done
# BENCH_DAY2=status: only the lines above (the status measurement alone).
[ "${BENCH_DAY2:-}" = status ] && exit 0

# --- upgrades at the floor (its own block: other benchmarks go above) -----
# A rolling upgrade of 3+2 simulated nodes against N × (the simulator's
# upgrade delay + reboot delay + post-boot settle), and a Kubernetes upgrade
# against components × restart delay; BENCH_UPGRADE_RUNS runs of each.
# Per node: down `settle` (upgrade delay) after the ack, down `reboot`, then
# healthy once etcd (`etcd`, control planes) and the kubelet + Ready
# (`kubelet_up` + `ready`) are back: the simulator's own timings. Each run
# starts a fresh node simulator from a bootstrap on v1.11.2 / v1.32.1.
upgrades() { # $1 = run number
  reboot=${BENCH_REBOOT_MS:-3000} settle=${BENCH_SETTLE_MS:-500}
  etcd=${BENCH_ETCD_MS:-1000} kubelet_up=${BENCH_KUBELET_UP_MS:-500} ready=${BENCH_READY_MS:-500}
  boot_settle=$(( etcd > kubelet_up + ready ? etcd : kubelet_up + ready ))
  static=${BENCH_STATIC_POD_MS:-1000} kubelet=${BENCH_KUBELET_MS:-1000} rollout=${BENCH_ROLLOUT_MS:-1000}
  net=127.0.88
  [ -d "$work/fx" ] || "$root/fixtures/make-images.sh" "$work/fx" >/dev/null
  rm -rf fsim factory.json nodes.json
  "$sim_bin" factory --base-image "$work/fx/dual-boot.raw" --state-dir fsim --versions v1.11.2,v1.11.5 > factory.json & pids+=($!)
  for _ in $(seq 100); do [ -s factory.json ] && break; sleep 0.1; done
  factory=$(sed 's/.*"url":"\([^"]*\)".*/\1/' factory.json)
  "$sim_bin" nodes --talos-version v1.11.2 --reboot-delay "$reboot" --upgrade-delay "$settle" \
    --etcd-delay "$etcd" --kubelet-delay "$kubelet_up" --ready-delay "$ready" \
    --static-pod-delay "$static" --kubelet-restart-delay "$kubelet" --rollout-delay "$rollout" \
    --node cp-01=$net.11:controlplane --node cp-02=$net.12:controlplane --node cp-03=$net.13:controlplane \
    --node worker-01=$net.21:worker --node worker-02=$net.22:worker --vip $net.10 > nodes.json & pids+=($!)
  for _ in $(seq 100); do [ -s nodes.json ] && break; sleep 0.1; done
  cluster() { # $1 = Talos version, $2 = Kubernetes version
    cat > cluster.yaml <<YAML
cluster: {name: bench, talosVersion: $1, kubernetesVersion: $2, endpoint: "https://$net.10:6443", vip: $net.10}
image: {factory: "$factory"}
network: {cidr: 127.0.0.0/8, gateway: 127.0.0.1, interface: eth0}
nodes:
  - {name: cp-01, role: controlplane, address: $net.11}
  - {name: cp-02, role: controlplane, address: $net.12}
  - {name: cp-03, role: controlplane, address: $net.13}
  - {name: worker-01, role: worker, address: $net.21}
  - {name: worker-02, role: worker, address: $net.22}
YAML
  }
  export IMGBUILD_STATE_DIR=$work/state-up$1
  cluster v1.11.2 v1.32.1
  "$bin" --config cluster.yaml bootstrap --new-secrets --poll 100ms --quiet >/dev/null
  cluster v1.11.5 v1.32.1
  t0=$(now)
  "$bin" --config cluster.yaml --output json upgrade --poll 100ms --skip-etcd-snapshot > talos.json
  t1=$(now)
  grep -q '"upgraded":\["cp-01","cp-02","cp-03","worker-01","worker-02"\]' talos.json
  s=$(secs "$t0" "$t1"); floor=$(echo "5 * ($settle + $reboot + $boot_settle) / 1000" | bc -l)
  per_node=$(sed 's/.*"nodeSeconds":\({[^}]*}\).*/\1/' talos.json)
  nodes_sum=$(echo "$per_node" | tr -d '{}"' | tr ',' '\n' | cut -d: -f2 | paste -sd+ | bc -l)
  printf '| rolling upgrade, 3+2 nodes (run %d) | %.2f s (nodes alone: %.2f s) | 5 × (down after %d ms + reboot %d ms + healthy after %d ms) = %.2f s | %.2f (nodes alone: %.2f) |\n' \
    "$1" "$s" "$nodes_sum" "$settle" "$reboot" "$boot_settle" "$floor" "$(echo "$s / $floor" | bc -l)" "$(echo "$nodes_sum / $floor" | bc -l)"
  echo "per node (s): $per_node" >&2

  cluster v1.11.5 v1.33.1
  t0=$(now)
  "$bin" --config cluster.yaml --output json upgrade --poll 100ms --skip-etcd-snapshot > kube.json
  t1=$(now)
  s=$(secs "$t0" "$t1")
  floor=$(echo "(9 * $static + $rollout + 5 * $kubelet) / 1000" | bc -l)
  printf '| Kubernetes upgrade, 3+2 nodes (run %d) | %.2f s | 9 static pods × %d ms + kube-proxy rollout %d ms + 5 kubelets × %d ms = %.2f s | %.2f |\n' \
    "$1" "$s" "$static" "$rollout" "$kubelet" "$floor" "$(echo "$s / $floor" | bc -l)"
  for _ in 1 2; do kill "${pids[-1]}"; wait "${pids[-1]}" 2>/dev/null || true; unset 'pids[-1]'; done
}
upgrade_runs=${BENCH_UPGRADE_RUNS:-1}
for run in $(seq "$upgrade_runs"); do upgrades "$run"; done
