# imgbuild — set-up and test entry points. Everything a fresh machine lacks
# is installed here (Debian packages; the Rust toolchain is the machine's).

CARGO ?= cargo
IMGBUILD := target/debug/imgbuild
ATLAS := examples/atlas/cluster.yaml

.PHONY: demo test deps build lint schematics fuzz bench

# Debian packages the tests use: sgdisk (GPT checks), qemu-img (qcow2 checks),
# Go and its yaml.v3 (the schematic emitter's differential oracle).
deps:
	@need=""; \
	command -v sgdisk >/dev/null 2>&1 || need="$$need gdisk"; \
	command -v qemu-img >/dev/null 2>&1 || need="$$need qemu-utils"; \
	command -v go >/dev/null 2>&1 || need="$$need golang-go"; \
	[ -d /usr/share/gocode/src/gopkg.in/yaml.v3 ] || need="$$need golang-gopkg-yaml.v3-dev"; \
	if [ -n "$$need" ]; then \
		echo "installing:$$need"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$need >/dev/null; \
	fi

build:
	$(CARGO) build --locked

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --locked --all-targets -- -D warnings

test: deps lint
	IMGBUILD_REQUIRE_ORACLE=1 $(CARGO) test --locked --all-targets

# The pipeline so far on the example cluster: validate, every node's schematic
# ID, then the patch route: one Talos-shaped base image (from the fixture
# script), one image per node with its network in META, and a look inside one.
DEMO := out/demo
demo: build
	@command -v sgdisk >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gdisk >/dev/null)
	$(IMGBUILD) --config $(ATLAS) validate
	$(IMGBUILD) --config $(ATLAS) schematic --all
	@rm -rf $(DEMO) && mkdir -p $(DEMO) && fixtures/make-images.sh $(DEMO)/base >/dev/null
	@for node in $$($(IMGBUILD) --config $(ATLAS) schematic --all | awk '$$1 != "base" {print $$1}'); do \
		$(IMGBUILD) --config $(ATLAS) patch --base $(DEMO)/base/dual-boot.raw --node $$node --out $(DEMO)/$$node.raw || exit 1; \
	done
	$(IMGBUILD) inspect $(DEMO)/cp-01.raw

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
	@command -v bc >/dev/null 2>&1 && [ -x /usr/bin/time ] || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bc time >/dev/null)
	$(CARGO) build --locked --release
	bench/patch.sh
