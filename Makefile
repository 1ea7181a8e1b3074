# Every install step lives here so that a fresh machine (and CI) needs nothing else.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# iproute2 (ip, tc) and iptables (iptables-legacy): the partition suite's network namespaces
APT    := fuse3 libfuse3-dev pkg-config gcc attr rsync etcd-server systemd strace iproute2 iptables bindfs

.PHONY: test test-fast test-faults test-repeat demo bench bench-quick simulate lint docs install clean \
	image image-base image-tools image-name test-image

install: $(STAMP)

$(STAMP): pyproject.toml
	@if ! command -v fusermount3 >/dev/null || ! command -v getfattr >/dev/null || \
	   ! command -v rsync >/dev/null || ! command -v etcd >/dev/null || ! command -v cc >/dev/null || \
	   ! command -v systemd-analyze >/dev/null || ! command -v strace >/dev/null || \
	   ! command -v ip >/dev/null || ! command -v tc >/dev/null || \
	   ! command -v iptables-legacy >/dev/null || ! command -v bindfs >/dev/null || \
	   ! pkg-config --exists fuse3 2>/dev/null; then \
		echo "installing Debian packages: $(APT)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(APT) >/dev/null; \
	fi
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# Pinned first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	@touch $@

# Compiled once before a run: where PYTHONDONTWRITEBYTECODE is set (as on CI machines), every
# daemon and command a test starts would otherwise compile tierfs again (~0.2 CPU-s each).
BYTECODE := $(PY) -m compileall -q -j 0 tierfs >/dev/null

test: $(STAMP)
	$(VENV)/bin/ruff check tierfs tests bench
	$(BYTECODE)
	$(PY) -m pytest -q -n 2 --durations=15 -m "not image" tests

# The in-process layers (core, store: real S3 and etcd, no mount), for a developer's loop.
test-fast: $(STAMP)
	$(BYTECODE)
	$(PY) -m pytest -q -n 2 -m "core or store" tests

# The fault suite's full run (the quick sample runs in `test`); counts in tests/faults/results.
test-faults: $(STAMP)
	$(BYTECODE)
	TIERFS_FAULTS=full $(PY) -m pytest -q tests/faults

# Chase a flaky test: TEST run N times in a row (a fresh pytest each), stopping at the first
# failure with its output; LOAD=1 runs a busy loop per core beside it (ended by pid afterwards).
#   make test-repeat TEST=tests/test_mount_errors.py::test_x N=30 LOAD=1 [ARGS='-k name']
N    ?= 30
LOAD ?= 0
test-repeat: $(STAMP)
	@test -n "$(TEST)" || { echo "usage: make test-repeat TEST=<pytest id> [N=30] [LOAD=1]"; exit 2; }
	$(PY) tests/repeat.py $(TEST) --runs $(N) --load-per-core $(LOAD) --pytest-args "$(ARGS)"

demo: $(STAMP)
	$(VENV)/bin/tierfs demo

bench: $(STAMP)
	$(PY) -m pip install -q matplotlib py-spy
	$(PY) bench/run.py --size 2G --reps 3 --compare --out bench/results

bench-quick: $(STAMP)
	$(PY) -m pip install -q matplotlib py-spy
	$(PY) bench/run.py --size 256M --reps 2 --profile --out bench/results-quick

# 2,000 nodes x 8 ranks, a 70B model: one checkpoint, a node lost, every node loading one
# 20 GB DDP checkpoint, S3 request limits; simulated (minutes).
simulate: $(STAMP)
	$(PY) bench/simulate_cluster.py

lint: $(STAMP)
	$(VENV)/bin/ruff check tierfs tests bench

# doc/CONFIGURATION.md from the mount options' table and the command line (tests/test_docs.py
# fails while it is out of date).
docs: $(STAMP)
	$(PY) -m tierfs.devtools.configuration_doc

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache

# The container image the DaemonSet runs (deploy/container/Containerfile), built with podman
# from Debian's packages: its base is a Debian made by mmdebstrap and imported (BASE_IMAGE,
# built once per machine; `make image-base` rebuilds it, e.g. for Debian's updates). podman's
# layer cache keeps the dependencies' layer (pyfuse3 compiled) until pyproject.toml changes.
# podman reads deploy/container/containers.conf (runc, cgroupfs), nothing set up by hand.
VERSION    := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE      ?= ghcr.io/tierfs/tierfs:$(VERSION)
BASE_IMAGE := localhost/tierfs-base:bookworm
IMAGE_APT  := podman runc mmdebstrap
PODMAN     := CONTAINERS_CONF=$(CURDIR)/deploy/container/containers.conf podman
DEBIAN     := http://deb.debian.org
# The machine's CA bundle, for pip in the build's steps (a proxy that inspects TLS has its CA
# there, not in Debian's bundle in the image); mounted for those steps, in no layer.
HOST_CA    := /etc/ssl/certs/ca-certificates.crt

image: image-tools
	@$(PODMAN) image exists $(BASE_IMAGE) || $(MAKE) --no-print-directory image-base
	$(PODMAN) build --network host --build-arg BASE=$(BASE_IMAGE) \
		$(if $(wildcard $(HOST_CA)),--volume $(HOST_CA):/run/host-ca.crt:ro \
			--build-arg PIP_CERT=/run/host-ca.crt) \
		-f deploy/container/Containerfile -t $(IMAGE) .
	@$(PODMAN) image inspect $(IMAGE) --format '$(IMAGE): {{.Size}} bytes'

# Debian's `apt` variant (essential packages and apt, as debian:bookworm-slim) with merged
# /usr (without the usrmerge package and the perl it pulls in), no documentation.
image-base: image-tools
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	mmdebstrap --quiet --variant=apt --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
		--dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
		--dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
		--dpkgopt='path-exclude=/usr/share/locale/*' \
		bookworm "$$tmp/rootfs.tar" "deb $(DEBIAN)/debian bookworm main" \
		"deb $(DEBIAN)/debian bookworm-updates main" \
		"deb $(DEBIAN)/debian-security bookworm-security main" && \
	$(PODMAN) import --change 'CMD ["/bin/bash"]' "$$tmp/rootfs.tar" $(BASE_IMAGE) >/dev/null
	@echo "built $(BASE_IMAGE)"

image-tools:
	@if ! command -v podman >/dev/null || ! command -v runc >/dev/null || \
	   ! command -v mmdebstrap >/dev/null; then \
		echo "installing Debian packages: $(IMAGE_APT)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends $(IMAGE_APT) >/dev/null; \
	fi

# The name deploy/ uses (tests/test_deploy.py compares them).
image-name:
	@echo $(IMAGE)

# The image run as deploy/kubernetes/tierfs-daemonset.yaml runs it (tests/test_image.py).
test-image: $(STAMP) image
	TIERFS_IMAGE=$(IMAGE) $(PY) -m pytest -q -m image tests/test_image.py
