# `make demo`, `make test` and plain `make` each set up .venv first, idempotently, with only what they need:
# - make demo: torch (TORCH_SPEC) and hasten with its core requirements, then the demo (it needs nothing else);
# - make (setup) and make test: also the dev, deepspeed and tracking extras; hasten's `accelerate` distribution
#   (alias/), so that every library importing accelerate gets hasten; the libraries built on Accelerate (ECOSYSTEM,
#   with their own dependencies); DeepSpeed's CPU ops; the venv's bytecode; and, for make test, the reference copy
#   of Accelerate.
# TORCH_SPEC is installed before the package so that pip never pulls a CUDA build we did not ask for;
# on a CUDA machine: make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu130"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev,deepspeed,tracking
PY := $(VENV)/bin/python
# pip compiles no bytecode while installing (one file after another, torch's thousands included): make demo's
# processes compile only what they import, and make setup compiles the whole venv at the end, on every core.
PIP := $(PY) -m pip --disable-pip-version-check -q
PIP_INSTALL := $(PIP) install --no-compile
TORCH_STAMP := $(VENV)/.torch-spec
DEMO_STAMP := $(VENV)/.hasten-demo
PKG_STAMP := $(VENV)/.hasten-installed
ALIAS_STAMP := $(VENV)/.accelerate-alias
ECO_STAMP := $(VENV)/.ecosystem
DS_OPS_STAMP := $(VENV)/.deepspeed-ops
EXT_DIR_STAMP := $(VENV)/.torch-extensions-dir
COMPILED_STAMP := $(VENV)/.compiled
TORCH_EXT_DIR := $(abspath $(VENV))/torch_extensions
# The environment of the activated venv for what builds or loads torch extensions (DeepSpeed's ops): its bin/ first on
# PATH, so that torch runs the venv's ninja, as in a user's activated shell. ninja 1.11 (Debian's) and 1.13 (the ninja
# wheel DeepSpeed installs) record a build's command under different hashes, so each switch between the two rebuilt
# every op: ~25 CPU-s per DeepSpeed launch on 2 cores, and the ops make had built were rebuilt in the user's shell.
IN_VENV := PATH="$(abspath $(VENV))/bin:$$PATH" TORCH_EXTENSIONS_DIR=$(TORCH_EXT_DIR)
# What hasten's accelerate distribution is built from (its version comes from _version.py).
ALIAS_SOURCES := alias/pyproject.toml alias/build_alias.py alias/entry_points.txt src/hasten/_version.py \
	$(wildcard src/hasten/_accelerate_shim/*/*.py src/hasten/_accelerate_shim/*/METADATA)
# Libraries built on Accelerate, installed with their own dependencies after hasten's accelerate distribution, which
# meets their accelerate requirement (tests/compat/test_ecosystem.py runs them; tests/test_install.py checks pip's view).
ECOSYSTEM ?= peft==0.21.2 trl==1.16.0 diffusers==0.42.1 sentence-transformers==6.2.0 setfit==1.2.0
# A reference copy of Accelerate, read only by tests in subprocesses (PYTHONPATH first): installed into a side folder,
# never into the venv, whose accelerate is hasten's.
ACCELERATE_REFERENCE := accelerate==1.15.0
REFERENCE_DIR := .reference/accelerate-1.15.0
REFERENCE_STAMP := $(REFERENCE_DIR)/.installed

.PHONY: setup reference demo test test-fast test-all lint bench torch-check clean

setup: $(PKG_STAMP) $(ALIAS_STAMP) $(ECO_STAMP) $(EXT_DIR_STAMP) $(DS_OPS_STAMP) $(COMPILED_STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# Re-installs torch only when TORCH_SPEC changed since the last install.
torch-check: | $(PY)
	@if [ "$$(cat $(TORCH_STAMP) 2>/dev/null)" != "$(TORCH_SPEC)" ]; then \
		echo "installing $(TORCH_SPEC)"; \
		$(PIP_INSTALL) $(TORCH_SPEC) && echo "$(TORCH_SPEC)" > $(TORCH_STAMP); \
	fi

$(DEMO_STAMP): pyproject.toml | torch-check
	$(PIP_INSTALL) -e .
	@touch $@

# This install also serves make demo.
$(PKG_STAMP): pyproject.toml | torch-check
	$(PIP_INSTALL) -e ".[$(EXTRAS)]"
	@touch $@ $(DEMO_STAMP)

# Refuses (with what to do) where HuggingFace's Accelerate is installed in the venv.
$(ALIAS_STAMP): $(PKG_STAMP) $(ALIAS_SOURCES)
	$(PIP_INSTALL) ./alias
	@touch $@

$(ECO_STAMP): $(ALIAS_STAMP) Makefile
	$(PIP_INSTALL) $(ECOSYSTEM)
	@touch $@

# Bytecode for everything installed, so that the thousands of processes the tests start never compile torch again
# (with PYTHONDONTWRITEBYTECODE set they would, in each process). A file that does not compile (torch ships one
# written for a newer Python) is skipped, as pip skips it.
$(COMPILED_STAMP): $(PKG_STAMP) $(ALIAS_STAMP) $(ECO_STAMP)
	$(PY) -m compileall -qq -j 0 $$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") || true
	@touch $@

# Every Python process of the venv builds and finds torch extensions (DeepSpeed's ops) in the venv's own folder,
# activated or not, unless TORCH_EXTENSIONS_DIR names another: a .pth file in site-packages sets that default when
# the interpreter starts. Without it a user's shell used torch's ~/.cache/torch_extensions, and the first DeepSpeed
# run there compiled the ops that make had built, for minutes, saying nothing. The folder is also the venv's torch's
# own: ~/.cache is shared by every venv of the machine, whatever torch each has. The same file puts the venv's bin/
# first on PATH, so that the venv's ninja builds those ops activated or not: Debian's ninja records a build under
# another hash than the wheel's, and a process started without the venv on PATH compiled the ops again (25-45 s
# each time, for whichever test or benchmark came next).
$(EXT_DIR_STAMP): | $(PY)
	printf '%s\n' 'import os, sys; os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))' \
		'import os, sys; b = os.path.join(sys.prefix, "bin"); p = os.environ.get("PATH", ""); os.path.isfile(os.path.join(b, "ninja")) and not p.startswith(b + os.pathsep) and os.environ.__setitem__("PATH", b + os.pathsep + p)' \
		> "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/hasten-torch-extensions.pth"
	@touch $@

# DeepSpeed compiles its CPU Adam (offloaded optimizers), fused Adam (a config file's Adam/AdamW: transformers' Trainer)
# and shared-memory ops on first use (minutes); build them once here instead of
# inside the first test or example that needs them, into the venv's extension folder (above). A build killed there
# leaves a lock file that every later build waits on for ever, so locks left from before are deleted first (do not
# run make while a job of the venv compiles an op); the time limit turns any other hang into a failed step.
$(DS_OPS_STAMP): $(PKG_STAMP) $(EXT_DIR_STAMP)
	@mkdir -p $(TORCH_EXT_DIR) && find $(TORCH_EXT_DIR) -name lock -delete
	$(IN_VENV) timeout 1800 $(PY) -c "from deepspeed.ops.op_builder.cpu import CPUAdamBuilder, FusedAdamBuilder, ShareMemCommBuilder; [b().load() for b in (CPUAdamBuilder, FusedAdamBuilder, ShareMemCommBuilder)]"
	@touch $@

# Offline, the install fails with a warning and the tests that compare with Accelerate skip, saying why.
reference: $(REFERENCE_STAMP)

$(REFERENCE_STAMP): | $(PY)
	@rm -rf $(REFERENCE_DIR)
	@if $(PIP) install --no-deps --target $(REFERENCE_DIR) $(ACCELERATE_REFERENCE); then touch $@; \
	else echo "warning: could not install $(ACCELERATE_REFERENCE) into $(REFERENCE_DIR); tests comparing with it will skip"; fi

# pip wrote no bytecode: the demo writes that of what it imports (in .venv and src/), even where
# PYTHONDONTWRITEBYTECODE is set, so that its processes do not each compile torch from source, run after run.
demo: $(DEMO_STAMP)
	PYTHONDONTWRITEBYTECODE= $(VENV)/bin/hasten launch --num_processes 2 examples/digits_classifier.py

# ruff's checks and its formatter (pyproject.toml: 120 characters); .ci/run runs it before the tests.
lint: $(PKG_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The tests run in two parts (README "Tests" gives the times):
# 1. every test not marked serial, on TEST_WORKERS pytest-xdist workers (one per core; --dist loadfile keeps each
#    file's tests on one worker, in order: a module-scoped fixture is built once), each generated-case test on a
#    sample of its cases (one in 5, tests/helpers.py cases()); it ends with the CPU and wall seconds of each test
#    file and the 25 tests that took the most CPU time, so that each CI log shows where the suite's time goes;
# 2. the tests marked serial (hang timeouts, signals, sleeps: they need the cores), one at a time, alone.
# Both parts run even when the first fails; the target fails when either did.
# - make test: every test;
# - make test-fast: the tests not marked slow (no multi-process launch of more than a few seconds);
# - make test-all: every test on every generated case (--all-cases), with the checks that need the whole set (each
#   differential allowance still used).
# The tests write the bytecode of what they import from src/ and tests/ (as make demo does), even where
# PYTHONDONTWRITEBYTECODE is set: the thousand processes they start would each compile hasten again (0.1-0.2 s of CPU
# each, measured).
TEST_WORKERS ?= $(shell nproc)
PYTEST := PYTHONDONTWRITEBYTECODE= $(IN_VENV) $(PY) -m pytest -q
# $(1): a marker expression ending in "and " (or nothing), $(2): more pytest options.
define run_tests
	$(PYTEST) -n $(TEST_WORKERS) --dist loadfile -m "$(1)not serial" --cpu-durations=25 $(2); parallel=$$?; \
	$(PYTEST) -m "$(1)serial" $(2); serial=$$?; \
	[ $$parallel -eq 0 ] && [ $$serial -eq 0 ]
endef

test: setup reference
	$(call run_tests,,)

test-fast: setup reference
	$(call run_tests,not slow and ,)

test-all: setup reference
	$(call run_tests,,--all-cases)

bench: setup
	$(IN_VENV) $(PY) bench/run_all.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .reference
