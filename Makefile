# imgbuild — set-up and test entry points. Everything a fresh machine lacks
# is installed here (Debian packages; the Rust toolchain is the machine's).

CARGO ?= cargo
IMGBUILD := target/debug/imgbuild
ATLAS := examples/atlas/cluster.yaml

.PHONY: demo test deps build lint schematics fuzz bench install

# Debian packages the tests use: sgdisk (GPT checks), qemu-img (qcow2 checks),
# curl (simulator stats), Go and its yaml.v3 (the schematic emitter's
# differential oracle), OpenSSH's sshd, ssh and ssh-keygen and zstd (the
# Hetzner simulator's rescue system and the tests that log in to it), jq
# (docs/ci.md's snapshot collector) and man-db (the installed man page is
# rendered with man -l).
deps:
	@need=""; \
	command -v sgdisk >/dev/null 2>&1 || need="$$need gdisk"; \
	command -v qemu-img >/dev/null 2>&1 || need="$$need qemu-utils"; \
	command -v curl >/dev/null 2>&1 || need="$$need curl"; \
	[ -x /usr/sbin/sshd ] || need="$$need openssh-server"; \
	command -v ssh >/dev/null 2>&1 && command -v ssh-keygen >/dev/null 2>&1 || need="$$need openssh-client"; \
	command -v zstd >/dev/null 2>&1 || need="$$need zstd"; \
	command -v jq >/dev/null 2>&1 || need="$$need jq"; \
	command -v man >/dev/null 2>&1 || need="$$need man-db"; \
	command -v go >/dev/null 2>&1 || need="$$need golang-go"; \
	[ -d /usr/share/gocode/src/gopkg.in/yaml.v3 ] || need="$$need golang-gopkg-yaml.v3-dev"; \
	if [ -n "$$need" ]; then \
		echo "installing:$$need"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$need >/dev/null; \
	fi

build:
	$(CARGO) build --locked --workspace

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --locked --workspace --all-targets -- -D warnings

# The Go oracle test fails when Go is missing; IMGBUILD_SKIP_ORACLE=1 skips it on purpose.
test: deps lint build
	$(CARGO) test --locked --workspace --all-targets

# The pipeline so far, on loopback only: validate the inventory, print every
# node's schematic ID, start the factory simulator on 127.0.0.1, build every
# node's image by the patch route (one base download) and the factory route,
# verify them against the manifest, and look inside one; publish them to the
# Proxmox VE simulator (uploads + one VM per node), twice: the second run
# changes nothing. Then the bootstrap:
# a simulated cluster of the same five nodes (each on its own 127.0.0.x:50000,
# booted in maintenance mode) is configured, bootstrapped and checked healthy,
# and a second run shows it changes nothing.
LOOPBACK := examples/loopback/cluster.yaml
LOOPBACK_NODES := --node cp-01=127.0.0.11:controlplane --node cp-02=127.0.0.12:controlplane \
	--node cp-03=127.0.0.13:controlplane --node worker-01=127.0.0.21:worker --node worker-02=127.0.0.22:worker
DEMO := out/demo
demo: build
	@command -v sgdisk >/dev/null 2>&1 && command -v qemu-img >/dev/null 2>&1 || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gdisk qemu-utils >/dev/null)
	$(IMGBUILD) --config $(LOOPBACK) validate
	$(IMGBUILD) --config $(LOOPBACK) schematic --all
	@rm -rf $(DEMO) && mkdir -p $(DEMO) && fixtures/make-images.sh $(DEMO)/base >/dev/null
	@set -e; target/debug/imgbuild-sim factory --base-image $(DEMO)/base/dual-boot.raw \
		--state-dir $(DEMO)/sim > $(DEMO)/sim.json & sim=$$!; trap "kill $$sim" EXIT; \
	for i in $$(seq 50); do [ -s $(DEMO)/sim.json ] && break; sleep 0.1; done; \
	factory=$$(sed 's/.*"url":"\([^"]*\)".*/\1/' $(DEMO)/sim.json); echo "factory simulator at $$factory"; \
	$(IMGBUILD) --config $(LOOPBACK) build --factory $$factory --out-dir $(DEMO)/patch --cache-dir $(DEMO)/cache; \
	$(IMGBUILD) --config $(LOOPBACK) build --factory $$factory --out-dir $(DEMO)/patch --cache-dir $(DEMO)/cache; \
	$(IMGBUILD) --config $(LOOPBACK) build --route factory --factory $$factory --out-dir $(DEMO)/factory --cache-dir $(DEMO)/cache; \
	$(IMGBUILD) verify --out-dir $(DEMO)/patch; \
	$(IMGBUILD) inspect $(DEMO)/patch/cp-01.raw; \
	{ cat $(LOOPBACK); printf 'publish:\n  proxmox:\n    node: pve\n    storage: local\n    vm: {storage: local-lvm, firstId: 300}\n'; } > $(DEMO)/proxmox.yaml; \
	target/debug/imgbuild-sim proxmox --state-dir $(DEMO)/pve --auth-delay-ms 0 --task-delay-ms 100 > $(DEMO)/pve.json & pve=$$!; \
	trap "kill $$sim $$pve" EXIT; for i in $$(seq 50); do [ -s $(DEMO)/pve.json ] && break; sleep 0.1; done; \
	export PROXMOX_VE_ENDPOINT=$$(sed 's/.*"url":"\([^"]*\)".*/\1/' $(DEMO)/pve.json); \
	export PROXMOX_VE_API_TOKEN=$$(sed 's/.*"token":"\([^"]*\)".*/\1/' $(DEMO)/pve.json); \
	export PROXMOX_VE_FINGERPRINT=$$(sed 's/.*"fingerprint":"\([^"]*\)".*/\1/' $(DEMO)/pve.json); \
	echo "Proxmox VE simulator at $$PROXMOX_VE_ENDPOINT (certificate pinned)"; \
	$(IMGBUILD) --config $(DEMO)/proxmox.yaml publish --factory $$factory --out-dir $(DEMO)/patch --cache-dir $(DEMO)/cache --poll-ms 100; \
	$(IMGBUILD) --config $(DEMO)/proxmox.yaml publish --factory $$factory --out-dir $(DEMO)/patch --cache-dir $(DEMO)/cache --poll-ms 100
	@set -e; target/debug/imgbuild-sim nodes $(LOOPBACK_NODES) --vip 127.0.0.20 > $(DEMO)/nodes.json & sim=$$!; \
	trap "kill $$sim" EXIT; for i in $$(seq 50); do [ -s $(DEMO)/nodes.json ] && break; sleep 0.1; done; \
	echo "node simulator: $$(cat $(DEMO)/nodes.json)"; \
	$(IMGBUILD) --config $(LOOPBACK) config cp-01 --state-dir $(DEMO)/state | head -n 12; \
	$(IMGBUILD) --config $(LOOPBACK) bootstrap --state-dir $(DEMO)/state --poll 250ms; \
	$(IMGBUILD) --config $(LOOPBACK) bootstrap --state-dir $(DEMO)/state --poll 250ms; \
	ls -l $(DEMO)/state

# Installs imgbuild, its man page and its bash, zsh and fish completions under
# $(PREFIX) (with $(DESTDIR) in front, for packaging). The binary is a release
# build unless BIN names one.
PREFIX ?= /usr/local
BIN ?=
install:
	@set -e; bin="$(BIN)"; \
	if [ -z "$$bin" ]; then $(CARGO) build --locked --release --bin imgbuild; bin=target/release/imgbuild; fi; \
	root="$(DESTDIR)$(PREFIX)"; \
	install -d "$$root/bin" "$$root/share/man/man1" "$$root/share/bash-completion/completions" \
		"$$root/share/zsh/site-functions" "$$root/share/fish/vendor_completions.d"; \
	install -m 755 "$$bin" "$$root/bin/imgbuild"; \
	"$$bin" man > "$$root/share/man/man1/imgbuild.1"; \
	"$$bin" completions bash > "$$root/share/bash-completion/completions/imgbuild"; \
	"$$bin" completions zsh > "$$root/share/zsh/site-functions/_imgbuild"; \
	"$$bin" completions fish > "$$root/share/fish/vendor_completions.d/imgbuild.fish"; \
	echo "installed imgbuild, its man page and completions under $$root"

# Regenerates the reviewed schematics/ of the example cluster.
schematics: build
	$(IMGBUILD) --config $(ATLAS) schematic --all --write --dir schematics

# The fuzz targets (property tests over arbitrary bytes: ADV decoder, qcow2
# header, GPT reader) with many more cases, bounded to 10 minutes.
# cargo-fuzz needs a nightly toolchain, which this machine cannot fetch.
FUZZ_CASES ?= 20000
fuzz:
	IMGBUILD_FUZZ_CASES=$(FUZZ_CASES) timeout 600 $(CARGO) test --locked --release --lib fuzz_

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
