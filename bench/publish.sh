#!/usr/bin/env bash
# Benchmark for publishing (run by `make bench`): uploading one 4 GiB sparse
# raw node image (1 GiB of data) into the Proxmox VE simulator's `import`
# storage by `curl -F` (the baseline: same multipart upload, same part order,
# same checksum), by `imgbuild publish` as raw and as qcow2, and by hand as
# qcow2 (qemu-img convert + curl), all waiting for the server's task
# (checksum, `qemu-img info`, copy) to finish. Interleaved, each against a
# fresh simulator, one table row per run; imgbuild's peak RSS from GNU time.
# Then the factory route's qcow2 uploaded vs fetched by Proxmox
# (`download-url`).
# Needs the release imgbuild and imgbuild-sim, sgdisk, qemu-img, curl, GNU
# time, bc. BENCH_SKIP_DOWNLOAD_URL=1 leaves out the download-url table.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/bench/bins.sh"
runs=${BENCH_RUNS:-3}
work=${BENCH_DIR:-$(mktemp -d -p "${TMPDIR:-/var/tmp}" imgbuild-publish.XXXXXX)}
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT
cd "$work"
now() { date +%s.%N; }
secs() { echo "$2 - $1" | bc -l; }

# A 4 GiB Talos-shaped base with 1 GiB of data; the node image is built from
# it by the patch route (META key 10 written), so it is a real node image.
truncate -s 4G base.raw
sgdisk -n1:2048:+100M -c1:EFI -n2:0:+1M -c2:BIOS -n3:0:+3000M -c3:BOOT -n4:0:+1M -c4:META base.raw >/dev/null
dd if=/dev/urandom of=base.raw bs=1M seek=110 count=1024 conv=notrunc status=none
printf dual-boot > k17
"$bin" meta set base.raw --key 17 --value-file k17 >/dev/null
"$sim_bin" factory --base-image base.raw --state-dir fsim > factory.json & pids+=($!)
for _ in $(seq 100); do [ -s factory.json ] && break; sleep 0.1; done
factory=$(sed 's/.*"url":"\([^"]*\)".*/\1/' factory.json)
cat > cluster.yaml <<'EOF'
cluster: {name: bench, talosVersion: v1.11.2, kubernetesVersion: v1.32.1, endpoint: "https://127.0.3.10:6443"}
network: {cidr: 127.0.0.0/8, gateway: 127.0.0.1, interface: eth0}
publish:
  proxmox: {node: pve, storage: local, upload: raw}
nodes:
  - {name: cp-01, role: controlplane, address: 127.0.3.11}
EOF
"$bin" --config cluster.yaml build --factory "$factory" --out-dir out --cache-dir cache --quiet >/dev/null
image=out/cp-01.raw
sha=$(sha256sum "$image" | cut -d' ' -f1)
size=$(stat -c %s "$image")
# The image's allocated bytes (its data extents, as the filesystem keeps
# them): what a qcow2 upload should send, plus its tables.
alloc=$(du -B1 "$image" | cut -f1)

pve() { # starts a fresh simulator; sets url, token, fp
  rm -rf pve pve.json
  "$sim_bin" proxmox --state-dir pve --task-delay-ms 0 --auth-delay-ms 0 > pve.json & pids+=($!)
  for _ in $(seq 100); do [ -s pve.json ] && break; sleep 0.1; done
  url=$(sed 's/.*"url":"\([^"]*\)".*/\1/' pve.json)
  token=$(sed 's/.*"token":"\([^"]*\)".*/\1/' pve.json)
  fp=$(sed 's/.*"fingerprint":"\([^"]*\)".*/\1/' pve.json)
}
stop_pve() { kill "${pids[-1]}"; wait "${pids[-1]}" 2>/dev/null || true; }

run_curl() {
  local upid status
  upid=$(curl -sk -H "Authorization: PVEAPIToken=$token" \
    -F content=import -F checksum-algorithm=sha256 -F "checksum=$sha" \
    -F "filename=@$image;filename=bench-cp-01-v1.11.2-${sha:0:12}.raw" \
    "${url}api2/json/nodes/pve/storage/local/upload" | sed 's/.*"data":"\([^"]*\)".*/\1/')
  while :; do
    status=$(curl -sk -H "Authorization: PVEAPIToken=$token" "${url}api2/json/nodes/pve/tasks/$upid/status")
    case $status in *'"stopped"'*) break ;; esac
    sleep 0.5
  done
  case $status in *'"exitstatus":"OK"'*) ;; *) echo "curl upload failed: $status" >&2; exit 1 ;; esac
}

run_imgbuild() {
  PROXMOX_VE_ENDPOINT=$url PROXMOX_VE_API_TOKEN=$token PROXMOX_VE_FINGERPRINT=$fp \
    /usr/bin/time -f %M -o rss "$bin" --config cluster.yaml publish --factory "$factory" \
    --out-dir out --cache-dir cache --quiet --output json > published.json
  grep -q '"uploaded":true' published.json
}

# One table, one row per run: the same image sent by `curl -F` (the
# baseline: the raw bytes as they are), by `imgbuild publish` with `upload:
# raw` and with the default `upload: qcow2` (the qcow2 of the non-zero
# clusters, generated while it is sent), and by hand the way people make a
# qcow2 (`qemu-img convert -O qcow2`, `sha256sum`, `curl -F`), interleaved,
# each against a fresh simulator. Time is the whole publish (preflight,
# conversion, the server's task); bytes are what the simulator received
# (`/_sim/stats` uploadBytes, multipart framing included).
sent() { curl -sk "${url}_sim/stats" | sed 's/.*"uploadBytes":\([0-9]*\).*/\1/'; }
with_upload() { sed -i "s/proxmox: {node: pve, storage: local.*}/proxmox: {node: pve, storage: local, upload: $1}/" cluster.yaml; }
run_by_hand() {
  local q=hand.qcow2 qsha upid status
  qemu-img convert -f raw -O qcow2 "$image" "$q"
  qsha=$(sha256sum "$q" | cut -d' ' -f1)
  upid=$(curl -sk -H "Authorization: PVEAPIToken=$token" \
    -F content=import -F checksum-algorithm=sha256 -F "checksum=$qsha" \
    -F "filename=@$q;filename=bench-cp-01-hand-${qsha:0:12}.qcow2" \
    "${url}api2/json/nodes/pve/storage/local/upload" | sed 's/.*"data":"\([^"]*\)".*/\1/')
  while :; do
    status=$(curl -sk -H "Authorization: PVEAPIToken=$token" "${url}api2/json/nodes/pve/tasks/$upid/status")
    case $status in *'"stopped"'*) break ;; esac
    sleep 0.5
  done
  rm -f "$q"
  case $status in *'"exitstatus":"OK"'*) ;; *) echo "by-hand qcow2 upload failed: $status" >&2; exit 1 ;; esac
}
rows=()
for i in $(seq "$runs"); do
  pve; sync; t0=$(now); run_curl; t1=$(now); bc_=$(sent); stop_pve
  with_upload raw; pve; sync; t2=$(now); run_imgbuild; t3=$(now); br=$(sent); rss_raw=$(cat rss); stop_pve
  with_upload qcow2; pve; sync; t4=$(now); run_imgbuild; t5=$(now); bq=$(sent); rss_q=$(cat rss); stop_pve
  pve; sync; t6=$(now); run_by_hand; t7=$(now); bh=$(sent); stop_pve
  c=$(secs "$t0" "$t1"); r=$(secs "$t2" "$t3"); q=$(secs "$t4" "$t5"); h=$(secs "$t6" "$t7")
  rows+=("$(printf '| %d | %.2f s | %.2f s (**%.2f**) | %.2f s (**%.2f**) | %.2f s (%.2f) | **%.2f** | %d / %d / %d / %d | **%.3f** | %d / %d KiB |' \
    "$i" "$c" "$r" "$(echo "$r / $c" | bc -l)" "$q" "$(echo "$q / $c" | bc -l)" "$h" "$(echo "$h / $c" | bc -l)" \
    "$(echo "$q / $r" | bc -l)" "$bc_" "$br" "$bq" "$bh" "$(echo "$bq / $alloc" | bc -l)" "$rss_raw" "$rss_q")")
done
with_upload raw
printf 'The %d MiB image, %d bytes allocated; %s binaries.\n\n' "$((size / 1048576))" "$alloc" "$profile"
printf '| run | `curl -F` raw (baseline) | imgbuild raw (/ curl) | imgbuild qcow2 (/ curl) | qemu-img convert + `curl -F` qcow2 (/ curl) | qcow2 / raw | bytes sent: curl / raw / qcow2 / by hand | qcow2 sent / allocated | imgbuild peak RSS raw / qcow2 |\n|---|---|---|---|---|---|---|---|---|\n'
printf '%s\n' "${rows[@]}"

[ "${BENCH_SKIP_DOWNLOAD_URL:-0}" = 1 ] && exit 0
# download-url: the factory route's qcow2 image (the factory's own bytes),
# uploaded by imgbuild (`upload: qcow2`) vs fetched by Proxmox from the
# factory itself (`upload: download-url`, the runner sends nothing),
# interleaved, each against a fresh simulator: bytes the runner sent
# (uploadBytes), bytes Proxmox fetched (downloadBytes), wall time with the
# server's task (checksum, `qemu-img info`) included.
sed -e 's/upload: raw}/upload: qcow2}/' cluster.yaml > cluster-dl.yaml
echo 'image: {platform: metal, arch: amd64, format: qcow2}' >> cluster-dl.yaml
"$bin" --config cluster-dl.yaml build --route factory --factory "$factory" --out-dir out-dl --cache-dir cache --quiet >/dev/null
dl_size=$(stat -c %s out-dl/cp-01.qcow2)
fetched() { curl -sk "${url}_sim/stats" | sed 's/.*"downloadBytes":\([0-9]*\).*/\1/'; }
run_dl() {
  sed -i "s/upload: [a-z0-9-]*}/upload: $1}/" cluster-dl.yaml
  PROXMOX_VE_ENDPOINT=$url PROXMOX_VE_API_TOKEN=$token PROXMOX_VE_FINGERPRINT=$fp \
    "$bin" --config cluster-dl.yaml publish --route factory --factory "$factory" \
    --out-dir out-dl --cache-dir cache --quiet --output json > published.json
  grep -q '"uploaded":true' published.json
}
dl=()
for i in $(seq "$runs"); do
  for form in qcow2 download-url; do
    pve; sync; t0=$(now); run_dl "$form"; t1=$(now); b=$(sent); f=$(fetched); stop_pve
    dl+=("$(printf '| %s, run %d | %d | %d | %.2f s |' "$form" "$i" "$b" "$f" "$(secs "$t0" "$t1")")")
  done
done
printf '\n| the factory'"'"'s %d MiB qcow2 image, stored by | bytes the runner sent | bytes Proxmox fetched | time |\n|---|---|---|---|\n' "$((dl_size / 1048576))"
printf '%s\n' "${dl[@]}"
