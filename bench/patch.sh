#!/usr/bin/env bash
# Benchmark for the patch route (run by `make bench`), every number measured
# in this run against a baseline tool on the same data:
#  1. ten node images from one 4.4 GB sparse dual-boot-shaped raw base:
#     `imgbuild patch` vs `cp --sparse=always` of the same base;
#  2. META in a qcow2 vs the qemu-img round trip (qcow2 -> raw, write META,
#     raw -> qcow2): in place (`imgbuild meta set`, the like-for-like edit)
#     and into a new file (`imgbuild patch`, which must copy the qcow2's data);
#  3. peak RSS of imgbuild for each.
# Needs: the release imgbuild, sgdisk, qemu-img, GNU time.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/bench/bins.sh"
inv=$root/examples/atlas/cluster.yaml
work=${BENCH_DIR:-$(mktemp -d -p "${TMPDIR:-/var/tmp}" imgbuild-bench.XXXXXX)}
trap 'rm -rf "$work"' EXIT
cd "$work"

now() { date +%s.%N; }
secs() { echo "$2 - $1" | bc -l; }

# A dual-boot-shaped base: 4453302272 bytes (amd64 1.11), EFI, BIOS, BOOT,
# META; ~380 MiB of real data in EFI and BOOT, the rest holes; key 17 set.
LINUX=0FC63DAF-8483-4772-8E79-3D69D8477DE4
truncate -s 4453302272 base.raw
sgdisk -n1:2048:+1024M -t1:C12A7328-F81F-11D2-BA4B-00A0C93EC93B -c1:EFI \
  -n2:0:+1M -t2:21686148-6449-6E6F-744E-656564454649 -c2:BIOS \
  -n3:0:+3076M -t3:$LINUX -c3:BOOT -n4:0:+1M -t4:$LINUX -c4:META base.raw >/dev/null
dd if=/dev/urandom of=base.raw bs=1M seek=1 count=128 conv=notrunc status=none
dd if=/dev/urandom of=base.raw bs=1M seek=1100 count=256 conv=notrunc status=none
printf dual-boot > k17
"$bin" meta set base.raw --key 17 --value-file k17 >/dev/null
cat base.raw >/dev/null # warm the page cache for both contenders

nodes=(cp-01 cp-02 cp-03 worker-01 worker-02)
rss_max=0
mkdir -p cp out
sync

# Interleaved, one image at a time, each contender paying for its own
# durability (imgbuild fsyncs before its rename; cp is followed by sync),
# so neither inherits the other's writeback.
cp_times=(); ib_times=()
for i in $(seq 0 9); do
  node=${nodes[$((i % 5))]}
  t0=$(now)
  cp --sparse=always base.raw "cp/$i.raw"; sync
  t1=$(now)
  /usr/bin/time -f %M -o rss "$bin" --config "$inv" patch --base base.raw --node "$node" --out "out/$i.raw" >/dev/null
  sync; t2=$(now)
  rss=$(cat rss); [ "$rss" -gt "$rss_max" ] && rss_max=$rss
  cp_times+=("$(secs "$t0" "$t1")"); ib_times+=("$(secs "$t1" "$t2")")
done
sum() { printf '%s\n' "$@" | paste -sd+ | bc -l; }
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END{print (a[int((NR+1)/2)]+a[int(NR/2)+1])/2}'; }
cp_s=$(sum "${cp_times[@]}"); ib_s=$(sum "${ib_times[@]}")
cp_med=$(median "${cp_times[@]}"); ib_med=$(median "${ib_times[@]}")
sgdisk -v out/9.raw | grep -q "No problems found"
rm -rf cp out

qemu-img convert -f raw -O qcow2 base.raw base.qcow2
"$bin" --config "$inv" patch --base base.raw --node cp-01 --out ref.raw >/dev/null
"$bin" meta get ref.raw --key 10 > k10
rm -f ref.raw
t3=$(now)
for i in 1 2 3; do
  qemu-img convert -f qcow2 -O raw base.qcow2 rt.raw
  "$bin" meta set rt.raw --key 10 --value-file k10 >/dev/null
  qemu-img convert -f raw -O qcow2 rt.raw "rt$i.qcow2"
  rm -f rt.raw
done
sync; t4=$(now)
q_rss=0
for i in 1 2 3; do
  /usr/bin/time -f %M -o rss "$bin" --config "$inv" patch --base base.qcow2 --node cp-01 --out "ib$i.qcow2" >/dev/null
  rss=$(cat rss); [ "$rss" -gt "$q_rss" ] && q_rss=$rss
done
t5=$(now)
qemu-img check ib3.qcow2 >/dev/null
cp base.qcow2 inplace.qcow2
sync; t6=$(now)
for i in 1 2 3; do
  sed "s/hostname: cp-01/hostname: bench-$i/" k10 > "k10.$i"
  /usr/bin/time -f %M -o rss "$bin" meta set inplace.qcow2 --key 10 --value-file "k10.$i" >/dev/null
  rss=$(cat rss); [ "$rss" -gt "$q_rss" ] && q_rss=$rss
done
t7=$(now)
qemu-img check inplace.qcow2 >/dev/null
"$bin" meta get inplace.qcow2 --key 10 | grep -q "hostname: bench-3"
rt_s=$(secs "$t3" "$t4"); ibq_s=$(secs "$t4" "$t5"); inp_s=$(secs "$t6" "$t7")

printf '| benchmark | imgbuild | baseline | ratio (imgbuild / baseline) | peak RSS |\n'
printf '|---|---|---|---|---|\n'
printf '| 10 node images from a 4.4 GB sparse raw base (total; median per image) | %.2f s; %.3f s | cp --sparse=always + sync x10: %.2f s; %.3f s | %.2f (median %.2f) | %d KiB |\n' \
  "$ib_s" "$ib_med" "$cp_s" "$cp_med" "$(echo "$ib_s / $cp_s" | bc -l)" "$(echo "$ib_med / $cp_med" | bc -l)" "$rss_max"
printf '| META of a qcow2 in place (meta set), x3 | %.3f s | qemu-img convert round trip x3: %.2f s | %.4f (%.0fx faster) | %d KiB |\n' \
  "$inp_s" "$rt_s" "$(echo "$inp_s / $rt_s" | bc -l)" "$(echo "$rt_s / $inp_s" | bc -l)" "$q_rss"
printf '| META of a qcow2 into a new file (patch), x3 | %.2f s | qemu-img convert round trip x3: %.2f s | %.4f (%.1fx faster) | %d KiB |\n' \
  "$ibq_s" "$rt_s" "$(echo "$ibq_s / $rt_s" | bc -l)" "$(echo "$rt_s / $ibq_s" | bc -l)" "$q_rss"
