# Every install step lives here so that a fresh machine (and CI) needs nothing else.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# iproute2 (ip, tc) and iptables (iptables-legacy): the partition suite's network namespaces
APT    := fuse3 libfuse3-dev pkg-config gcc attr rsync etcd-server iproute2 iptables

.PHONY: test test-fast test-faults test-repeat demo bench bench-quick simulate lint docs install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@if ! command -v fusermount3 >/dev/null || ! command -v getfattr >/dev/null || \
	   ! command -v rsync >/dev/null || ! command -v etcd >/dev/null || ! command -v cc >/dev/null || \
	   ! command -v ip >/dev/null || ! command -v tc >/dev/null || \
	   ! command -v iptables-legacy >/dev/null || \
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

test: $(STAMP)
	$(VENV)/bin/ruff check tierfs tests bench
	$(PY) -m pytest -q -n 2 --durations=15 tests

# The in-process layers (core, store: real S3 and etcd, no mount), for a developer's loop.
test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 -m "core or store" tests

# The fault suite's full run (the quick sample runs in `test`); counts in tests/faults/results.
test-faults: $(STAMP)
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
