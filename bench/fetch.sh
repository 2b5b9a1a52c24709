#!/usr/bin/env bash
# Benchmarks for verified acquisition (run by `make bench`), each against a
# baseline measured in the same run, all on loopback:
#  1. fetch + decompress + hash of a 1 GiB raw image served as .raw.zst and
#     .raw.xz by the factory simulator: `imgbuild fetch` (which also writes
#     the image, sparse, and fsyncs it) vs `curl | zstd -d | sha256sum`
#     (resp. `xz -d -T0`), and vs the same pipeline with `tee` to a file + sync;
#  2. ten node images by the patch route vs the factory route.
# Needs the release imgbuild and imgbuild-sim, sgdisk, qemu-img, curl, zstd,
# xz, GNU time, bc.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/bench/bins.sh"
work=${BENCH_DIR:-$(mktemp -d -p "${TMPDIR:-/var/tmp}" imgbuild-fetch.XXXXXX)}
sim_pid=
cleanup() { [ -n "$sim_pid" ] && kill "$sim_pid" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
cd "$work"
now() { date +%s.%N; }
secs() { echo "$2 - $1" | bc -l; }
ratio() { echo "$1 / $2" | bc -l; }

# A 1 GiB Talos-shaped disk: 384 MiB of random data, 256 MiB of text-like
# data, the rest holes; compresses roughly 2:1 like real images.
truncate -s 1G base.raw
sgdisk -n1:2048:+100M -c1:EFI -n2:0:+1M -c2:BIOS -n3:0:+900M -c3:BOOT -n4:0:+1M -c4:META base.raw >/dev/null
dd if=/dev/urandom of=base.raw bs=1M seek=110 count=384 conv=notrunc status=none
head -c 192M /dev/urandom > rand.bin   # (no early-closing pipes under pipefail)
base64 -w 76 rand.bin > text.dat
dd if=text.dat of=base.raw bs=1M seek=500 count=256 conv=notrunc status=none
rm -f rand.bin text.dat
printf dual-boot > k17
"$bin" meta set base.raw --key 17 --value-file k17 >/dev/null

"$sim_bin" factory --base-image base.raw --state-dir sim > sim.json & sim_pid=$!
for _ in $(seq 100); do [ -s sim.json ] && break; sleep 0.1; done
url=$(sed 's/.*"url":"\([^"]*\)".*/\1/' sim.json)
id=$(curl -s -X POST --data-binary 'customization: {}' "$url/schematics" | sed 's/.*"id":"\([^"]*\)".*/\1/')
zst=$url/image/$id/v1.11.2/metal-amd64.raw.zst
xzu=$url/image/$id/v1.11.2/metal-amd64.raw.xz
curl -s -o /dev/null "$zst"; curl -s -o /dev/null "$xzu"   # let the simulator build both
sync

row() { # label url decompressor
  local label=$1 u=$2 dec=$3 t0 t1 t2 t3 rss served
  served=$(curl -sI "$u" | tr -d '\r' | awk 'tolower($1)=="content-length:"{print $2}')
  sync; t0=$(now)
  curl -s "$u" | $dec | sha256sum > base.sum
  t1=$(now)
  curl -s "$u" | $dec | tee plain.raw | sha256sum > tee.sum; sync
  t2=$(now)
  /usr/bin/time -f %M -o rss "$bin" fetch "$u" --cache-dir "cache-$label" --quiet > fetched.txt
  t3=$(now)
  rss=$(cat rss)
  grep -q "$(cut -d' ' -f1 base.sum)" fetched.txt  # same image, same hash
  rm -rf plain.raw "cache-$label"
  printf '| fetch %s (%d MiB served, 1 GiB image) | %.2f s | `curl | %s | sha256sum`: %.2f s; with `tee` + sync: %.2f s | %.2f; %.2f | %d KiB |\n' \
    "$label" "$((served / 1048576))" "$(secs "$t2" "$t3")" "$dec" "$(secs "$t0" "$t1")" "$(secs "$t1" "$t2")" \
    "$(ratio "$(secs "$t2" "$t3")" "$(secs "$t0" "$t1")")" "$(ratio "$(secs "$t2" "$t3")" "$(secs "$t1" "$t2")")" "$rss"
}

printf '| benchmark | imgbuild | baseline | ratio (imgbuild / baseline; / like-for-like) | peak RSS |\n|---|---|---|---|---|\n'
row zst "$zst" "zstd -d"
row xz "$xzu" "xz -d -T0"

# Ten nodes, both routes, against the same simulator.
python3 - "$url" > ten.yaml <<'PY'
import sys
print(f"""cluster: {{name: ten, talosVersion: v1.11.2, kubernetesVersion: v1.32.1, endpoint: "https://127.0.1.100:6443"}}
image: {{platform: metal, factory: "{sys.argv[1]}"}}
network: {{cidr: 127.0.0.0/8, gateway: 127.0.0.1, interface: eth0}}
nodes:""")
for i in range(10):
    role = "controlplane" if i < 3 else "worker"
    print(f"  - {{name: node-{i:02d}, role: {role}, address: 127.0.1.{i + 1}}}")
PY
sync; t0=$(now)
"$bin" --config ten.yaml build --out-dir patch --cache-dir cache-p --quiet >/dev/null; sync
t1=$(now)
"$bin" --config ten.yaml build --route factory --out-dir factory --cache-dir cache-f --quiet >/dev/null; sync
t2=$(now)
"$bin" verify --out-dir patch >/dev/null
"$bin" diff patch/node-07.raw factory/node-07.raw >/dev/null
printf '| 10 node images: patch route vs factory route (simulated factory builds on request) | %.2f s | factory route: %.2f s | %.2f (%.1fx faster) | |\n' \
  "$(secs "$t0" "$t1")" "$(secs "$t1" "$t2")" "$(ratio "$(secs "$t0" "$t1")" "$(secs "$t1" "$t2")")" "$(ratio "$(secs "$t1" "$t2")" "$(secs "$t0" "$t1")")"
