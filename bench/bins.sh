# Sourced by the benchmarks (with $root set): the release binaries where
# cargo puts them, ./target or $CARGO_TARGET_DIR or a cargo config's
# build.target-dir, as `cargo metadata` says (as the Makefile asks it).
target_dir=$(cd "$root" && "${CARGO:-cargo}" metadata --format-version 1 --no-deps |
	sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
bin=${target_dir:-$root/target}/release/imgbuild
sim_bin=${target_dir:-$root/target}/release/imgbuild-sim
