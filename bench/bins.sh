# Sourced by the benchmarks (with $root set): the release binaries where
# cargo puts them, ./target or $CARGO_TARGET_DIR or a cargo config's
# build.target-dir, as `cargo metadata` says (as the Makefile asks it).
target_dir=$(cd "$root" && "${CARGO:-cargo}" metadata --format-version 1 --no-deps |
	sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
# BENCH_PROFILE=debug measures the debug binaries (a quick check; the
# recorded numbers are release).
profile=${BENCH_PROFILE:-release}
bin=${target_dir:-$root/target}/$profile/imgbuild
sim_bin=${target_dir:-$root/target}/$profile/imgbuild-sim
