"""Recording fixed rollouts: sample with an engine, score with a task's rule, optionally add a
teacher's log-probs (for distillation scenarios), and write the rollout file + sidecar.

    rlaudit record --model scenarios/models/qwen2-tiny --task digits --engine vllm \\
        --prompts 4 --n 4 --max-new-tokens 12 --out scenarios/rollouts/qwen2-digits-vllm.safetensors
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

import torch

import rlaudit
from rlaudit.data.batch import RolloutBatch
from rlaudit.data.io import save_rollout
from rlaudit.errors import InputError
from rlaudit.model.load import load_model, load_tokenizer, snapshot_id
from rlaudit.rollout.sampler import sample
from rlaudit.rollout.tasks import get_task, prompts_for_step
from rlaudit.rollout.vllm_engine import VllmEngine
from rlaudit.update import forward as fwd

ENGINES = ("reference", "vllm")


@dataclass
class RecordSpec:
    model: str
    task: str = "digits"
    engine: str = "reference"
    prompts: int = 4
    n: int = 4
    max_new_tokens: int = 12
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 0
    dtype: str = "float32"
    teacher: str | None = None
    topk: int = 4


def response_texts(tokenizer, batch: RolloutBatch) -> list[str]:
    eos = tokenizer.eos_token_id
    out = []
    for i in range(len(batch)):
        n = int(batch["response_lengths"][i])
        ids = [t for t in batch["response_ids"][i, :n].tolist() if t != eos]
        out.append(tokenizer.decode(ids, skip_special_tokens=True))
    return out


def teacher_fields(teacher_path: str, batch: RolloutBatch, *, topk: int, temperature: float,
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The teacher's top-k ids/log-probs [B, R, K] and its log-prob of each sampled token
    [B, R] (after temperature), 0 / id 0 past each response."""
    teacher = load_model(teacher_path, dtype=dtype)
    pad = int(load_tokenizer(teacher_path).pad_token_id or 0)
    inputs = fwd.build_inputs(batch, pad_id=pad)
    with torch.no_grad():
        logits = fwd.hf_logits(teacher, inputs).double() / temperature
        logp = torch.log_softmax(logits, -1)
    per_pos_top = logp.topk(topk, dim=-1)
    valid = inputs.valid
    ids = fwd.response_gather(per_pos_top.indices, inputs)
    top_lp = fwd.response_gather(per_pos_top.values, inputs)
    sampled = fwd.response_gather(logp.gather(-1, inputs.labels.unsqueeze(-1)).squeeze(-1), inputs)
    return {"teacher_topk_ids": torch.where(valid.unsqueeze(-1), ids, torch.zeros_like(ids)),
            "teacher_topk_log_probs": top_lp.to(torch.float32),
            "teacher_log_probs": sampled.to(torch.float32)}


def record(spec: RecordSpec) -> RolloutBatch:
    if spec.engine not in ENGINES:
        raise InputError(f"expected one of {list(ENGINES)}, got {spec.engine!r}", key="engine")
    task = get_task(spec.task)
    tok = load_tokenizer(spec.model)
    prompts = prompts_for_step(task, seed=spec.seed, step=0, gen_index=0, count=spec.prompts)
    ids = [[tok.bos_token_id] + tok.encode(p, add_special_tokens=False) for p in prompts]
    params = dict(n=spec.n, temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k,
                  max_new_tokens=spec.max_new_tokens, seed=spec.seed)
    if spec.engine == "reference":
        model = load_model(spec.model, dtype=getattr(torch, spec.dtype)).eval()
        batch = sample(model, ids, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                       **params)
    else:
        with VllmEngine(spec.model, dtype=spec.dtype, seed=spec.seed) as engine:
            batch = engine.sample(ids, **params)
    texts = response_texts(tok, batch)
    scores = torch.tensor([task.score(prompts[int(batch["uid"][i])], texts[i])
                           for i in range(len(batch))], dtype=torch.float32)
    batch = batch.with_fields(scores=scores)
    if spec.teacher is not None:
        batch = batch.with_fields(**teacher_fields(spec.teacher, batch, topk=spec.topk,
                                                   temperature=spec.temperature,
                                                   dtype=getattr(torch, spec.dtype)))
    return batch


def record_to_file(spec: RecordSpec, out: str | Path) -> RolloutBatch:
    batch = record(spec)
    meta = {"task": spec.task, "model": str(spec.model), "model_snapshot_id": snapshot_id(spec.model),
            "prompts": spec.prompts, "rlaudit": rlaudit.__version__, "torch": torch.__version__,
            "python": platform.python_version()}
    if spec.teacher:
        meta["teacher"] = str(spec.teacher)
        meta["teacher_snapshot_id"] = snapshot_id(spec.teacher)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    save_rollout(batch, out, meta=meta)
    return batch
