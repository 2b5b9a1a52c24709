#!/usr/bin/env bash
# Benchmark for Hetzner snapshots (run by `make bench`): streaming one 1 GiB
# raw image (256 MiB of incompressible data, the rest empty, like a Talos
# image) into a rescue system's /dev/sda, with `imgbuild publish` vs the
# pipeline people type by hand,
#   zstd -c IMAGE | ssh root@<rescue> 'zstd -d | dd of=/dev/sda bs=4M'
# both against the Hetzner Cloud simulator's rescue sshd (real OpenSSH on
# loopback). imgbuild's time is the stream alone: from its "writing" line
# to its "dd wrote" line (the API steps around it are not the stream).
# Interleaved runs, each against a fresh simulator; bytes on the wire from
# imgbuild's own count and from `wc -c` of the baseline's zstd output;
# imgbuild's peak RSS from GNU time. Needs root (sshd on port 22),
# the release imgbuild and imgbuild-sim, sgdisk, zstd, ssh, curl, GNU time,
# bc, python3.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/bench/bins.sh"
runs=${BENCH_RUNS:-3}
# On tmpfs by default: the rescue system's final `sync` (which the baseline
# lacks) then costs nothing, and neither side waits for the host's disk.
shm=/dev/shm; [ -d "$shm" ] && [ -w "$shm" ] || shm=${TMPDIR:-/var/tmp}
work=${BENCH_DIR:-$(mktemp -d -p "$shm" imgbuild-hcloud.XXXXXX)}
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT
cd "$work"
now() { date +%s.%N; }
secs() { echo "$2 - $1" | bc -l; }
field() { python3 -c "import json,sys; v=json.load(sys.stdin); print(eval(sys.argv[1]))" "$1"; }

truncate -s 1G base.raw
sgdisk -n1:2048:+100M -c1:EFI -n2:0:+1M -c2:BIOS -n3:0:+800M -c3:BOOT -n4:0:+1M -c4:META base.raw >/dev/null
dd if=/dev/urandom of=base.raw bs=1M seek=110 count=256 conv=notrunc status=none
"$sim_bin" factory --base-image base.raw --state-dir fsim > factory.json & pids+=($!)
for _ in $(seq 100); do [ -s factory.json ] && break; sleep 0.1; done
factory=$(field 'v["url"]' < factory.json)
cat > cluster.yaml <<'EOF'
cluster: {name: bench, talosVersion: v1.11.2, kubernetesVersion: v1.32.1, endpoint: "https://127.0.3.10:6443"}
image: {platform: hcloud}
network: {cidr: 127.0.0.0/8, gateway: 127.0.0.1, interface: eth0}
publish:
  hcloud: {location: fsn1}
nodes:
  - {name: cp-01, role: controlplane, address: 127.0.3.11}
EOF
"$bin" --config cluster.yaml build --factory "$factory" --out-dir out --cache-dir cache --quiet >/dev/null
image=out/cp-01.raw
size=$(stat -c %s "$image")

hc() { # a fresh simulator: sets url, token
  rm -rf hsim hc.json
  "$sim_bin" hcloud --state-dir hsim --action-seconds 0.1 > hc.json & pids+=($!)
  for _ in $(seq 100); do [ -s hc.json ] && break; sleep 0.1; done
  url=$(field 'v["url"]' < hc.json)
  token=$(field 'v["token"]' < hc.json)
}
stop_hc() { kill "${pids[-1]}"; wait "${pids[-1]}" 2>/dev/null || true; }
api() { # METHOD PATH [JSON]
  curl -sf -X "$1" -H "Authorization: Bearer $token" -H 'Content-Type: application/json' \
    ${3:+--data-binary "$3"} "$url$2"
}
wait_action() { # action id
  until api GET "/actions/$1" | grep -q '"status":"success"'; do sleep 0.1; done
}

# The hand-made way: a key, a server in rescue mode, then the pipeline.
run_baseline() {
  rm -f key key.pub
  ssh-keygen -q -t ed25519 -N '' -f key
  local kid sid ip
  kid=$(api POST /ssh_keys "{\"name\":\"bench\",\"public_key\":\"$(cat key.pub)\"}" | field 'v["ssh_key"]["id"]')
  sid=$(api POST /servers "{\"name\":\"bench\",\"server_type\":\"cx23\",\"image\":\"debian-13\",\"location\":\"fsn1\",\"start_after_create\":false,\"ssh_keys\":[$kid]}" | field 'v["server"]["id"]')
  ip=$(api GET "/servers/$sid" | field 'v["server"]["public_net"]["ipv4"]["ip"]')
  wait_action "$(api POST "/servers/$sid/actions/enable_rescue" "{\"type\":\"linux64\",\"ssh_keys\":[$kid]}" | field 'v["action"]["id"]')"
  wait_action "$(api POST "/servers/$sid/actions/poweron" '{}' | field 'v["action"]["id"]')"
  local ssh=(ssh -i key -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR "root@$ip")
  until "${ssh[@]}" true 2>/dev/null; do sleep 0.2; done
  sync; b0=$(now)
  zstd -q -c "$image" | tee >(wc -c > baseline.bytes) | "${ssh[@]}" 'zstd -d | dd of=/dev/sda bs=4M' 2>/dev/null
  b1=$(now)
  disk=$(curl -s "${url%/v1}/_sim/servers/$sid/disk" | field 'v')
  cmp -n "$size" "$image" "$disk"
}

run_imgbuild() {
  HCLOUD_ENDPOINT=$url HCLOUD_TOKEN=$token /usr/bin/time -f %M -o rss \
    "$bin" --config cluster.yaml publish --factory "$factory" --out-dir out --cache-dir cache \
    --quiet --poll-ms 100 2> >(while IFS= read -r l; do echo "$(now) $l"; done > publish.log) >/dev/null
  sleep 0.2
  i0=$(grep 'hcloud: writing' publish.log | cut -d' ' -f1)
  i1=$(grep 'hcloud: dd wrote' publish.log | cut -d' ' -f1)
  sent=$(grep 'hcloud: dd wrote' publish.log | sed 's/.*(\([0-9]*\) bytes sent).*/\1/')
}

rows=()
for i in $(seq "$runs"); do
  hc; run_baseline; stop_hc
  hc; run_imgbuild; stop_hc
  base=$(secs "$b0" "$b1"); ours=$(secs "$i0" "$i1")
  rows+=("$(printf '%d  %7.2f s  %7.2f s  %5.2fx  %10d  %10d  %6d KiB' "$i" "$base" "$ours" \
    "$(echo "$ours / $base" | bc -l)" "$(cat baseline.bytes)" "$sent" "$(cat rss)")")
done
echo "hcloud stream: $size-byte image (256 MiB random), $runs interleaved runs"
echo "run  zstd|ssh|dd  imgbuild  ratio  baseline B  imgbuild B  imgbuild RSS"
printf '%s\n' "${rows[@]}"
