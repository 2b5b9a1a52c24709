#!/usr/bin/env bash
# Bootstrap parallelism (run by `make bench`): wall time of `imgbuild
# bootstrap` on a simulated 5-node cluster (3 control planes, 2 workers, all
# on loopback) against the sum of the simulated delays of ONE node. Nodes are
# settled concurrently and bootstrap starts as soon as the first control plane
# answers, so the ratio stays near 1 (a serial run of five nodes would be ~5).
# Needs the release imgbuild and imgbuild-sim, bc.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/bench/bins.sh"
work=$(mktemp -d -p "${TMPDIR:-/var/tmp}" imgbuild-bootstrap.XXXXXX)
sim_pid=
cleanup() { [ -n "$sim_pid" ] && kill "$sim_pid" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
now() { date +%s.%N; }

apply=1000 etcd=2000 kubelet=1500 ready=1500
one_node_ms=$((apply + etcd + kubelet + ready))
net=127.0.99
cat > "$work/cluster.yaml" <<YAML
cluster:
  name: bench
  talosVersion: v1.11.2
  kubernetesVersion: v1.32.1
  endpoint: https://$net.10:6443
  vip: $net.10
image:
  factory: http://127.0.0.1:9
network:
  cidr: 127.0.0.0/8
  gateway: 127.0.0.1
  interface: eth0
nodes:
  - {name: cp-01, role: controlplane, address: $net.11}
  - {name: cp-02, role: controlplane, address: $net.12}
  - {name: cp-03, role: controlplane, address: $net.13}
  - {name: worker-01, role: worker, address: $net.21}
  - {name: worker-02, role: worker, address: $net.22}
YAML
# Secrets once, outside the timed runs (RSA-4096 generation is not bootstrap).
"$bin" --config "$work/cluster.yaml" talosconfig >/dev/null

echo "one node's simulated delays: apply ${apply} + etcd ${etcd} + kubelet ${kubelet} + ready ${ready} = ${one_node_ms} ms"
for run in 1 2 3; do
  rm -f "$work/sim.json" "$work/.talos/bench/kubeconfig"
  "$sim_bin" nodes --apply-delay $apply --etcd-delay $etcd --kubelet-delay $kubelet --ready-delay $ready \
    --node cp-01=$net.11:controlplane --node cp-02=$net.12:controlplane --node cp-03=$net.13:controlplane \
    --node worker-01=$net.21:worker --node worker-02=$net.22:worker --vip $net.10 > "$work/sim.json" & sim_pid=$!
  for _ in $(seq 100); do [ -s "$work/sim.json" ] && break; sleep 0.05; done
  t0=$(now)
  "$bin" --config "$work/cluster.yaml" bootstrap --poll 100ms --quiet >/dev/null
  t1=$(now)
  kill "$sim_pid"; wait "$sim_pid" 2>/dev/null || true; sim_pid=
  wall_ms=$(echo "($t1 - $t0) * 1000" | bc -l)
  printf 'run %d: 5-node bootstrap %.0f ms = %.2fx one node'"'"'s delays (serial would be ~5x)\n' \
    "$run" "$wall_ms" "$(echo "$wall_ms / $one_node_ms" | bc -l)"
done
