"""verl 0.9.1's Megatron engine on the CPU (rlaudit.targets.peers.verl_mcore): its precision rule
(bf16 / fp16 only, found by running verl's config code), one step of the column against rlaudit's
reference, and a broken engine plumbing turning ``entropy-logged-when-coeff-zero`` red on the
Megatron column only."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlaudit.config import load_config
from rlaudit.data.io import load_rollout
from rlaudit.targets.contract.own_adapters import ReferenceAdapter
from rlaudit.targets.peers import peers_dir

REPO = Path(__file__).resolve().parents[3]
PEER = peers_dir() / "verl-0.9.1"
MODEL = REPO / "scenarios" / "models" / "qwen2-tiny-short"
ROLLOUT = REPO / "scenarios" / "rollouts" / "short-ref.safetensors"
#: bf16 keeps 8 bits of mantissa (relative step 2**-8 = 0.4%); a forward and backward of a
#: two-layer model in it, against float32, stays within a few of those steps
RTOL = 3e-2

pytestmark = pytest.mark.skipif(not (PEER / "verl").is_dir() or not (PEER / "mbridge").is_dir(),
                                reason=f"verl 0.9.1 with mbridge is not installed under "
                                       f"{PEER.parent} (run `make peers`)")

PRECISION = """
import sys
sys.path.insert(0, sys.argv[1])
from rlaudit.targets.peers import verl_mcore
print(verl_mcore.config_error("bfloat16"))
print(verl_mcore.config_error("float32"))
"""


def test_megatron_engine_config_accepts_bf16_only():
    # verl in a child: two verl releases cannot share a process
    p = subprocess.run([sys.executable, "-c", PRECISION, str(PEER)], capture_output=True,
                       text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    bf16, fp32 = p.stdout.strip().splitlines()[-2:]
    assert bf16 == "None"                       # bf16 is what the engine config accepts
    # McoreEngineConfig.__post_init__: assert self.dtype in ["bfloat16", "float16"]
    assert fp32.startswith("verl/workers/config/engine.py:218:") and "float32" in fp32, fp32


def _config():
    # 16 rows = 4 prompts x n 4: one mini-batch in one micro-batch, one on-policy SGD step
    # (no clipping: grad_clip 0); the entropy asked for with a zero coefficient (verl #6016's case)
    return load_config({"rollout": {"n": 4, "response_length": 12},
                        "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 16,
                                  "entropy_coeff": 0.0, "calculate_entropy": True,
                                  "grad_clip": 0.0, "optim": {"name": "sgd", "lr": 0.05}},
                        "data": {"train_batch_size": 4}, "trainer": {"dtype": "float32"}})


@pytest.mark.slow
def test_megatron_engine_step_on_cpu_matches_reference():
    # lazy: the column's entry point (imports nothing of verl in this process)
    from rlaudit.targets.peers.verl_mcore import train_steps
    from rlaudit.targets.peers.verl_step import catalogue_metrics  # lazy: as above

    batch = load_rollout(ROLLOUT)
    (result,) = train_steps(MODEL, [(batch, _config(), 1)], peer=str(PEER), params="main")
    got = catalogue_metrics(result["metrics"][0])
    ref = ReferenceAdapter().train_step(model_path=MODEL, batch=load_rollout(ROLLOUT),
                                        config=_config(), steps=1)
    want = ref.metrics[0]
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert key in got, sorted(got)
        assert got[key] == pytest.approx(float(want[key]), rel=RTOL, abs=1e-3), key
    assert float(want["actor/grad_norm"]) > 1.0                 # not a vacuous step
    # on-policy: every ratio is 1 up to bf16 rounding, nothing clipped
    assert got["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-2)
    assert got["actor/pg_clipfrac"] == 0.0

    # the parameters: the engine starts from the snapshot rounded to bf16 (its model's dtype)
    # and its float32 main weights then move by -lr * g; the reference moves from the snapshot
    # itself. The two updates point the same way and have the same length.
    start = {}
    for f in sorted(MODEL.glob("*.safetensors")):
        start.update(load_file(str(f)))
    mine = result["params"][0]
    theirs = ref.params[0]
    assert sorted(mine) == sorted(theirs)
    d_mine = torch.cat([(mine[k] - start[k].bfloat16().float()).flatten() for k in sorted(mine)])
    d_ref = torch.cat([(theirs[k].double().reshape(start[k].shape) - start[k].double())
                       .flatten() for k in sorted(mine)]).float()
    # SGD without clipping: ||update|| / lr is the gradient norm (independent of the logs)
    assert float(d_ref.norm()) / 0.05 == pytest.approx(float(want["actor/grad_norm"]), rel=1e-3)
    assert float(d_mine.norm()) == pytest.approx(float(d_ref.norm()), rel=RTOL)
    cosine = float(d_mine @ d_ref / (d_mine.norm() * d_ref.norm()))
    assert cosine > 0.995, cosine


def entropy_dropped():
    """A Megatron engine whose training pass drops ``calculate_entropy`` (verl #6016's shape of
    bug: the entropy asked for with a zero coefficient is neither computed nor logged), built
    inside the engine's rank, where verl is importable."""
    # lazy: verl and megatron-core exist only inside the engine's rank
    from verl.utils import tensordict_utils as tu

    from rlaudit.targets.peers.verl_mcore_cpu import MegatronEngineCPU  # lazy: as above

    class EntropyDropped(MegatronEngineCPU):
        def forward_backward_batch(self, data, loss_function, forward_only=False):
            if not forward_only:
                tu.assign_non_tensor(data, calculate_entropy=False)
            return super().forward_backward_batch(data, loss_function, forward_only)

    return EntropyDropped


BROKEN = """
import json, sys, warnings
warnings.simplefilter("ignore")
from rlaudit.targets.peers import activate
activate("verl", "0.9.1")
from rlaudit.targets.peers.verl import VerlAdapter
from rlaudit.targets.run.runner import run_target
adapter = VerlAdapter()
adapter.engines[1].mcore_engine = "tests.targets.peers.test_verl_mcore:entropy_dropped"
results = run_target(adapter, ["seed_entropy_coeff_zero"], stages=[],
                     invariants=["entropy-logged-when-coeff-zero"])
print(json.dumps({c.backend: [c.status, c.message] for r in results[1:] for c in r.checks
                  if c.invariant == "entropy-logged-when-coeff-zero"}))
"""


@pytest.mark.slow
def test_dropped_entropy_is_red_on_the_megatron_column_only():
    p = subprocess.run([sys.executable, "-c", BROKEN], capture_output=True, text=True,
                       timeout=900, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    fsdp, mega = got["verl-fsdp-0.9.1"], got["verl-megatron-0.9.1"]
    assert fsdp[0] == "pass", fsdp
    assert mega[0] == "fail" and "entropy" in mega[1], mega


def test_engine_parity_at_the_looser_precision():
    # lazy: the run-level machinery, only for this test
    from types import SimpleNamespace

    from rlaudit.targets.contract.declare import RUN_TOLERANCES
    from rlaudit.targets.inputs import builtin
    from rlaudit.targets.run.engines import at_precision

    fp32, bf16 = RUN_TOLERANCES["float32"], RUN_TOLERANCES["bfloat16"]
    scn = dataclasses.replace(builtin.scenario(builtin.tiny_model_path()), tol_floor=fp32)
    fsdp = SimpleNamespace(train_precision="float32")
    mega = SimpleNamespace(train_precision="bfloat16")
    assert bf16.rtol > fp32.rtol and bf16.atol > fp32.atol
    # the Megatron column, and the comparison of the two engines, at bf16's floor
    assert at_precision(scn, mega).tol_floor == bf16
    assert at_precision(scn, fsdp, mega).tol_floor == bf16
    # the FSDP column keeps float32's: no fp32 tolerance is loosened
    assert at_precision(scn, fsdp).tol_floor == fp32
    assert at_precision(scn, SimpleNamespace()).tol_floor == fp32
