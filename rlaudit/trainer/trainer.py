"""The reference trainer: a real, single-process, deterministic RL trainer (docs/findings.md,
seeds).

Per step:
    generation batches (n samples per prompt, reference sampler) -> rule reward per response
    -> DAPO group filter with generation-batch accumulation (error after max_num_gen_batches)
    -> trim to train_batch_size prompts -> rlaudit.update.step.train_step (overlong penalty,
    old/ref log-probs, values, KL-in-reward, rollout IS weights, advantages, critic and actor
    updates) -> metrics (verl names) -> checkpoint.

Determinism: prompts and sampling seeds are functions of (seed, step, generation batch), so two
runs with the same config give identical metrics, and a resumed run reproduces the uninterrupted
one (weights and optimizer state come from the checkpoint).

    python -m rlaudit.cli.main train examples/train_digits_grpo.yaml
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from tqdm import tqdm

from rlaudit.config import Config, load_config
from rlaudit.data.batch import RolloutBatch
from rlaudit.dicts import to_dict
from rlaudit.errors import InputError, RlauditError
from rlaudit.model.critic import ValueModel
from rlaudit.model.load import load_model, load_tokenizer
from rlaudit.rollout.sampler import sample
from rlaudit.rollout.tasks import Task, get_task, prompts_for_step
from rlaudit.trainer import checkpoint as ckpt
from rlaudit.update.context import TorchContext, build_optimizer
from rlaudit.update.step import Roles, select_groups, train_step

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
JOB_KEYS = {"model", "task", "checkpoint_dir", "save_freq", "resume"}


class FilterExhausted(RlauditError):
    """Dynamic sampling could not fill the train batch within max_num_gen_batches: the config
    (batch sizes, filter metric, task) cannot produce a training batch — exit code 2."""


@dataclass
class TrainJob:
    """A training run: which model, which task, where checkpoints go, and the algorithm config."""

    model: str
    task: str
    config: Config
    checkpoint_dir: str | None = None
    save_freq: int = 0
    resume: bool = False
    source: str | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str | None = None,
                  base_dir: Path | None = None) -> "TrainJob":
        if not isinstance(data, Mapping):
            raise InputError("expected a mapping at the top level", source=source)
        job = {k: v for k, v in data.items() if k in JOB_KEYS}
        rest = {k: v for k, v in data.items() if k not in JOB_KEYS}
        config_keys = {f.name for f in dataclasses.fields(Config)}
        for key in rest:  # name the job keys too, not only the config sections
            if key not in config_keys:
                raise InputError(f"unknown key; valid keys here: "
                                 f"{', '.join(sorted(JOB_KEYS | config_keys))}",
                                 source=source, key=str(key))
        for key in ("model", "task"):
            if not isinstance(job.get(key), str):
                raise InputError("required; expected a string", source=source, key=key)
        cfg = load_config(rest, source=source)
        get_task(job["task"], source=source)
        model = Path(job["model"])
        if not model.is_absolute() and base_dir is not None and not model.exists():
            model = base_dir / model
        save_freq = job.get("save_freq", 0)
        if isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 0:
            raise InputError("expected an integer >= 0", source=source, key="save_freq")
        resume = job.get("resume", False)
        if not isinstance(resume, bool):
            raise InputError("expected true/false", source=source, key="resume")
        checkpoint_dir = job.get("checkpoint_dir")
        if checkpoint_dir is not None and not (isinstance(checkpoint_dir, str) and checkpoint_dir):
            raise InputError("expected a directory path string", source=source,
                             key="checkpoint_dir")
        return cls(model=str(model), task=job["task"], config=cfg,
                   checkpoint_dir=job.get("checkpoint_dir"), save_freq=save_freq, resume=resume,
                   source=source)


@dataclass
class Trainer:
    job: TrainJob
    device: str = "cpu"
    history: list[dict[str, float]] = field(default_factory=list)

    def __post_init__(self):
        cfg = self.job.config
        self.task: Task = get_task(self.job.task)
        dtype = DTYPES[cfg.trainer.dtype]
        torch.manual_seed(cfg.trainer.seed)
        self.tokenizer = load_tokenizer(self.job.model)
        actor = load_model(self.job.model, dtype=dtype, device=self.device)
        ref = copy.deepcopy(actor).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        pad = int(self.tokenizer.pad_token_id)
        self.actor = TorchContext(actor, build_optimizer(actor.parameters(), cfg.actor.optim),
                                  device=torch.device(self.device), pad_id=pad)
        ref_ctx = TorchContext(ref, None, device=torch.device(self.device), pad_id=pad)
        self.critic = None
        if cfg.use_critic:
            critic = ValueModel(load_model(self.job.model, dtype=dtype, device=self.device),
                                seed=cfg.trainer.seed)
            self.critic = TorchContext(critic, build_optimizer(critic.parameters(), cfg.critic.optim),
                                       device=torch.device(self.device), pad_id=pad)
        self.roles = Roles(actor=self.actor, ref=ref_ctx, critic=self.critic)
        self.step = 0
        if self.job.resume and self.job.checkpoint_dir:
            latest = ckpt.latest_checkpoint(self.job.checkpoint_dir)
            if latest is not None:
                state = ckpt.load_checkpoint(latest, self._ckpt_roles())
                self.step = int(state["step"])
                self.history = list(state["history"])

    # ---- generation ----------------------------------------------------------------------------
    def _encode(self, prompts: list[str]) -> list[list[int]]:
        bos = self.tokenizer.bos_token_id
        return [[bos] + self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]

    def decode_response(self, batch: RolloutBatch, row: int) -> str:
        n = int(batch["response_lengths"][row])
        ids = [i for i in batch["response_ids"][row, :n].tolist()
               if i != self.tokenizer.eos_token_id]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(self, step: int, gen_index: int) -> tuple[RolloutBatch, list[str]]:
        cfg = self.job.config
        count = cfg.data.gen_batch_size or cfg.data.train_batch_size
        prompts = prompts_for_step(self.task, seed=cfg.trainer.seed, step=step,
                                   gen_index=gen_index, count=count)
        ro = cfg.rollout
        batch = sample(self.actor.model, self._encode(prompts), n=ro.n, temperature=ro.temperature,
                       top_p=ro.top_p, top_k=ro.top_k, max_new_tokens=ro.response_length,
                       seed=hash_seed(cfg.trainer.seed, step, gen_index),
                       eos_token_id=self.tokenizer.eos_token_id,
                       pad_token_id=self.tokenizer.pad_token_id, uid_offset=gen_index * count)
        scores = torch.tensor([self.task.score(prompts[int(batch["uid"][i]) - gen_index * count],
                                               self.decode_response(batch, i))
                               for i in range(len(batch))], dtype=torch.float64)
        return batch.with_fields(scores=scores), prompts

    def collect_batch(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """Generation batches until train_batch_size prompt groups survive the group filter."""
        cfg = self.job.config
        fg = cfg.algorithm.filter_groups
        want = cfg.data.train_batch_size
        kept: list[RolloutBatch] = []
        n_groups = 0
        gen_index = 0
        while n_groups < want:
            if fg.enable and fg.max_num_gen_batches > 0 and gen_index >= fg.max_num_gen_batches:
                raise FilterExhausted(
                    f"dynamic sampling: after {gen_index} generation batches only {n_groups} of "
                    f"{want} prompt groups had a non-zero reward std; raise "
                    f"algorithm.filter_groups.max_num_gen_batches or data.gen_batch_size")
            batch, _ = self.generate(step, gen_index)
            gen_index += 1
            batch, groups = select_groups(batch, cfg)
            kept.append(batch)
            n_groups += groups
        full = RolloutBatch.concat([b for b in kept if len(b)])
        uids = list(dict.fromkeys(full["uid"].tolist()))[:want]
        rows = [i for i, u in enumerate(full["uid"].tolist()) if u in set(uids)]
        return full.select(rows), {"train/num_gen_batches": float(gen_index),
                                   "train/num_kept_groups": float(n_groups)}

    # ---- training ------------------------------------------------------------------------------
    def train(self, *, progress: bool = True,
              on_step: Callable[[int, dict], None] | None = None) -> list[dict[str, float]]:
        cfg = self.job.config
        total = cfg.trainer.total_steps
        bar = None
        if progress:
            bar = tqdm(total=total, initial=self.step, desc="train", unit="step", leave=False)
        while self.step < cfg.trainer.total_steps:  # re-read: a callback may shorten the run
            t0 = time.perf_counter()
            batch, gen_metrics = self.collect_batch(self.step)
            t_gen = time.perf_counter() - t0
            result = train_step(self.roles, batch, cfg)
            metrics = {**gen_metrics, **result.metrics, **result.timing, "timing/gen": t_gen}
            self.history.append(metrics)
            self.step += 1
            if on_step is not None:
                on_step(self.step, metrics)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(score=f"{metrics['critic/score/mean']:.3f}")
            if self.job.checkpoint_dir and self.job.save_freq and self.step % self.job.save_freq == 0:
                self.save()
        if bar is not None:
            bar.close()
        return self.history

    def _ckpt_roles(self) -> dict:
        roles = {"actor": (self.actor.model, self.actor.optimizer)}
        if self.critic is not None:
            roles["critic"] = (self.critic.model, self.critic.optimizer)
        return roles

    def export(self, out_dir: str | Path) -> Path:
        """Write the current actor as an HF snapshot (config, safetensors, tokenizer) that every
        backend, vLLM and scenarios can load."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        # a float32 copy: casting the live actor there and back would round float64 weights
        copy.deepcopy(self.actor.model).to(torch.float32).save_pretrained(
            out, safe_serialization=True)
        self.tokenizer.save_pretrained(out)
        return out

    def save(self) -> Path:
        return ckpt.save_checkpoint(self.job.checkpoint_dir, self.step, self._ckpt_roles(),
                                    {"history": self.history, "config": to_dict(self.job.config)})


def hash_seed(*parts: int) -> int:
    """A stable 63-bit seed from integers (Python's hash() of ints is stable, of str is not)."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) & 0x7FFFFFFFFFFFFFFF
    return h
