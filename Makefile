# Two commands matter: `make demo` and `make test`. Both set up .venv first, idempotently.
# TORCH_SPEC is installed before the package so that pip never pulls a CUDA build we did not ask for;
# on a CUDA machine: make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu130"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev,deepspeed,tracking
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
TORCH_STAMP := $(VENV)/.torch-spec
PKG_STAMP := $(VENV)/.hasten-installed
DS_OPS_STAMP := $(VENV)/.deepspeed-ops
# Libraries built on Accelerate that the ecosystem tests run on hasten. They require the accelerate
# distribution, which must not be installed (hasten answers under its name), hence --no-deps; their
# other requirements come with transformers (the dev extra); tests/compat/test_ecosystem.py checks them.
ECOSYSTEM_NO_DEPS ?= peft==0.21.2
ECO_STAMP := $(VENV)/.ecosystem
# A reference copy of Accelerate, read only by tests/compat/test_accelerate_surface.py (in a subprocess): installed into a
# side folder, never into the venv, which stays an "only hasten" environment as users' are.
ACCELERATE_REFERENCE := accelerate==1.15.0
REFERENCE_DIR := .reference/accelerate-1.15.0
REFERENCE_STAMP := $(REFERENCE_DIR)/.installed

.PHONY: setup reference demo test test-fast bench torch-check clean

setup: $(PKG_STAMP) $(DS_OPS_STAMP) $(ECO_STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# Re-installs torch only when TORCH_SPEC changed since the last install.
torch-check: | $(PY)
	@if [ "$$(cat $(TORCH_STAMP) 2>/dev/null)" != "$(TORCH_SPEC)" ]; then \
		echo "installing $(TORCH_SPEC)"; \
		$(PIP) install $(TORCH_SPEC) && echo "$(TORCH_SPEC)" > $(TORCH_STAMP); \
	fi

$(PKG_STAMP): pyproject.toml | torch-check
	$(PIP) install -e ".[$(EXTRAS)]"
	@touch $@

# DeepSpeed compiles its CPU Adam and shared-memory ops on first use (minutes); build them once here,
# into torch's extension cache, instead of inside the first test that needs them.
$(DS_OPS_STAMP): $(PKG_STAMP)
	$(PY) -c "from deepspeed.ops.op_builder import CPUAdamBuilder; from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; CPUAdamBuilder().load(); ShareMemCommBuilder().load()"
	@touch $@

$(ECO_STAMP): $(PKG_STAMP) Makefile
	$(PIP) install --no-deps $(ECOSYSTEM_NO_DEPS)
	@touch $@
# Offline, the install fails with a warning and the surface test skips, saying why.
reference: $(REFERENCE_STAMP)

$(REFERENCE_STAMP): | $(PY)
	@rm -rf $(REFERENCE_DIR)
	@if $(PIP) install --no-deps --target $(REFERENCE_DIR) $(ACCELERATE_REFERENCE); then touch $@; \
	else echo "warning: could not install $(ACCELERATE_REFERENCE) into $(REFERENCE_DIR); tests/compat/test_accelerate_surface.py will skip"; fi

demo: setup
	$(VENV)/bin/hasten launch --num_processes 2 examples/digits_classifier.py

test: setup reference
	$(PY) -m pytest -q

test-fast: setup reference
	$(PY) -m pytest -q -m "not slow"

bench: setup
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .reference
