"""Rank functions for the multi-process megatron tests (run through rlaudit.backends.launch).

Each function runs many checks in one spawned group (spawning costs seconds) and returns plain
numbers: max abs differences against an independent computation, which the tests then bound.
References: the HF model itself (transformers' Qwen2/Llama forward), full-vocab log-softmax via
rlaudit.algo.logprob on gathered logits, plain torch autograd and a hand-written SGD step.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist

from rlaudit.algo.logprob import log_probs_at, logprobs_from_logits
from rlaudit.backends.megatron import compat, convert
from rlaudit.backends.megatron.model import (attention_mask_4d, build_gpt_model, pipeline_forward,
                                             position_ids)
from rlaudit.backends.megatron.vocab_parallel import (vocab_parallel_log_probs_at,
                                                      vocab_parallel_logprobs_entropy)
from rlaudit.model.tiny import build_tiny_model

LENGTHS = (12, 7, 1)  # right-padded rows, incl. a one-token row
SEQ = 12
TEMPERATURE = 0.8
ENTROPY_COEF = 0.1
SGD_LR = 0.5
ADAM_LR = 1e-3


def make_batch(vocab: int, seed: int, lengths=LENGTHS, seq: int = SEQ):
    """``(input_ids [b, s], attention_mask [b, s] 1=token)``; pad positions hold id 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (len(lengths), seq), generator=g)
    mask = torch.zeros(len(lengths), seq, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return ids.masked_fill(mask == 0, 0), mask


def _exact_fp64_hf(model):
    """Make an HF model compute RMSNorm and attention fully in float64 (no float32 islands)."""
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2

    def rms_norm(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))

    modeling_qwen2.Qwen2RMSNorm.forward = rms_norm  # this rank process only
    modeling_llama.LlamaRMSNorm.forward = rms_norm
    model.set_attn_implementation("sdpa")  # eager softmax runs in float32
    return model


def _gather_vocab(shard: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, shard.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _valid_maxabs(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return (a - b)[mask.bool()].abs().max().item()


def _megatron(hf, dtype=torch.float32, hf_sd=None):
    model = build_gpt_model(hf.config, dtype=dtype)
    convert.load_hf_weights(model, hf.state_dict() if hf_sd is None else hf_sd, hf.config)
    return model.eval()


def _forward_full(model, ids, mask):
    with torch.no_grad():
        shard = model(ids, position_ids(ids), attention_mask_4d(mask))
    return shard, _gather_vocab(shard)


def _hf_logits(hf, ids, mask):
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask).logits


def _state_dict_exact(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _vocab_parallel_checks(shard: torch.Tensor, full: torch.Tensor, labels: torch.Tensor,
                           vocab: int, group) -> dict:
    """vocab-parallel logp/entropy/log_probs_at (values and gradients) vs full-vocab references."""
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    width = shard.shape[-1]
    w_lp = torch.linspace(-1.0, 2.0, labels.numel(), dtype=shard.dtype).reshape(labels.shape)
    w_ent = torch.linspace(0.5, -1.5, labels.numel(), dtype=shard.dtype).reshape(labels.shape)
    ids_k = torch.stack([labels, (labels * 7 + 3) % vocab, torch.zeros_like(labels)], dim=-1)

    x = shard.detach().clone().requires_grad_(True)
    before, version = x.detach().clone(), x._version
    lp, ent = vocab_parallel_logprobs_entropy(x, labels, temperature=TEMPERATURE,
                                              calc_entropy=True, tp_group=group, vocab_size=vocab)
    at = vocab_parallel_log_probs_at(x, ids_k, temperature=TEMPERATURE, tp_group=group,
                                     vocab_size=vocab)
    ((lp * w_lp).sum() + (ent * w_ent).sum() + at.sum()).backward()

    ref_x = full[..., :vocab].detach().clone().requires_grad_(True)
    ref_lp, ref_ent = logprobs_from_logits(ref_x, labels, temperature=TEMPERATURE,
                                           calc_entropy=True)
    ref_at = log_probs_at(ref_x, ids_k, temperature=TEMPERATURE)
    ((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum() + ref_at.sum()).backward()
    ref_grad = torch.nn.functional.pad(ref_x.grad, (0, width * tp - vocab))  # padding cols: 0
    ref_grad = ref_grad[..., rank * width:(rank + 1) * width]
    return {
        "logp": (lp - ref_lp).abs().max().item(),
        "entropy": (ent - ref_ent).abs().max().item(),
        "log_probs_at": (at - ref_at).abs().max().item(),
        "grad": (x.grad - ref_grad).abs().max().item(),
        "grad_scale": ref_grad.abs().max().item(),
        "input_unchanged": bool(torch.equal(x.detach(), before) and x._version == version),
        "aliases_input": any(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
                             for t in (lp, ent, at)),
    }


def _controls(hf, ids, mask, ref) -> dict:
    """Parity must catch a wrong rotary base and a naive [q; k; v] concatenation."""
    from megatron.core import parallel_state as ps

    wrong_cfg = copy.deepcopy(hf.config)
    wrong_cfg.rope_parameters = {**wrong_cfg.rope_parameters, "rope_theta": 10000.0}
    model = build_gpt_model(wrong_cfg)
    convert.load_hf_weights(model, hf.state_dict(), wrong_cfg)
    wrong_base = _valid_maxabs(_forward_full(model.eval(), ids, mask)[1], ref, mask)

    sd = convert.hf_to_megatron(hf.state_dict(), hf.config,
                                tp_rank=ps.get_tensor_model_parallel_rank(),
                                tp_size=ps.get_tensor_model_parallel_world_size())
    hsd = hf.state_dict()
    for i in range(hf.config.num_hidden_layers):
        naive = torch.cat([hsd[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"])
        tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        sd[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = naive.chunk(tp)[r].clone()
    model = build_gpt_model(hf.config)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(sd[n])
    naive_qkv = _valid_maxabs(_forward_full(model.eval(), ids, mask)[1], ref, mask)
    return {"wrong_rotary_base": wrong_base, "naive_qkv_concat": naive_qkv}


def _optimizer_step_checks(hf, ids, mask, kind: str) -> dict:
    """One megatron optimizer step with grad clipping vs plain torch on the HF model.

    ``kind="sgd"``: DDP + megatron's FP32 optimizer wrapping SGD; ``kind="adam"``: DDP + the
    distributed optimizer (megatron allows it only with Adam). Params are compared where the
    reference gradient is not tiny (Adam's first step is ~lr * sign(g), ill-conditioned near 0).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    labels = torch.roll(ids, -1, dims=1)
    tmask = mask.clone()
    tmask[:, -1] = 0
    adv = torch.linspace(-1.0, 1.0, ids.numel()).reshape(ids.shape)
    vocab = hf.config.vocab_size

    def loss_of(logp, ent):
        n = tmask.sum()
        return (-(logp * adv * tmask).sum() - ENTROPY_COEF * (ent * tmask).sum()) / n

    # reference: HF + plain autograd + clipping by hand + torch's optimizer
    ref = copy.deepcopy(hf).train()
    lp, ent = logprobs_from_logits(ref(input_ids=ids, attention_mask=mask).logits, labels,
                                   calc_entropy=True)
    loss_of(lp, ent).backward()
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in ref.parameters())).item()
    clip = grad_norm / 2  # make sure clipping is active
    coef = min(1.0, clip / (grad_norm + 1e-6))
    for p in ref.parameters():
        p.grad = p.grad * coef
    big_grad = {n: p.grad.abs() > 1e-3 for n, p in ref.named_parameters()}
    ref_opt = (torch.optim.SGD(ref.parameters(), lr=SGD_LR) if kind == "sgd"
               else torch.optim.Adam(ref.parameters(), lr=ADAM_LR))
    ref_opt.step()
    expected = {n: p.detach() for n, p in ref.named_parameters()}

    dist_opt = kind == "adam"
    model = build_gpt_model(hf.config)
    convert.load_hf_weights(model, hf.state_dict(), hf.config)
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=dist_opt)
    model = DistributedDataParallel(model.config, ddp_cfg, model)
    opt_cfg = OptimizerConfig(optimizer=kind, lr=SGD_LR if kind == "sgd" else ADAM_LR,
                              sgd_momentum=0.0, weight_decay=0.0, clip_grad=clip,
                              use_distributed_optimizer=dist_opt, bf16=False, fp16=False,
                              params_dtype=torch.float32)
    opt = get_megatron_optimizer(opt_cfg, [model])
    model.train()
    model.zero_grad_buffer()
    opt.zero_grad()
    shard = model(ids, position_ids(ids), attention_mask_4d(mask))
    lp, ent = vocab_parallel_logprobs_entropy(shard, labels, calc_entropy=True,
                                              tp_group=ps.get_tensor_model_parallel_group(),
                                              vocab_size=vocab)
    loss_of(lp, ent).backward()
    model.finish_grad_sync()
    ok, megatron_norm, _ = opt.step()
    updated = convert.gather_hf_state_dict(model, hf.config)
    return {
        "step_ok": bool(ok),
        "grad_norm": abs(megatron_norm - grad_norm) / grad_norm,
        "params": max((updated[n] - expected[n])[big_grad[n]].abs().max().item()
                      for n in expected if big_grad[n].any()),
        "param_change": max((expected[n] - p.detach()).abs().max().item()
                            for n, p in hf.named_parameters()),
    }


MODEL_VARIANTS = (("qwen2", {}), ("llama", {}), ("qwen2", {"vocab_size": 265}),
                  ("llama", {"tie_word_embeddings": True}))


def variant_name(arch: str, overrides: dict) -> str:
    return arch + "".join(f"_{k}={v}" for k, v in overrides.items())


def parity_checks(*, controls: bool) -> dict:
    """PP=1, any TP: HF parity (fp32, fp64), vocab-parallel math, weight round trip, controls."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    out: dict = {}
    for arch, overrides in MODEL_VARIANTS:
        hf = build_tiny_model(arch, seed=11, **overrides)
        vocab = hf.config.vocab_size
        ids, mask = make_batch(vocab, seed=3)
        ref = _hf_logits(hf, ids, mask)
        model = _megatron(hf)
        shard, full = _forward_full(model, ids, mask)
        res = {"fp32": _valid_maxabs(full[..., :vocab], ref, mask),
               "ref_absmax": ref.abs().max().item(),
               "padding_columns_zero": bool((full[..., vocab:] == 0).all()),
               "local_width": shard.shape[-1]}
        with torch.no_grad():  # megatron's own gather of the vocab shards (parallel_output=False)
            res["runtime_gather_equal"] = bool(torch.equal(model(
                ids, position_ids(ids), attention_mask_4d(mask), runtime_gather_output=True), full))
        gathered = convert.gather_hf_state_dict(model, hf.config)
        expect = {k: v for k, v in hf.state_dict().items()
                  if not (hf.config.tie_word_embeddings and k == "lm_head.weight")}
        res["round_trip_exact"] = _state_dict_exact(gathered, expect)

        hf64 = _exact_fp64_hf(build_tiny_model(arch, seed=11, dtype=torch.float64, **overrides))
        ref64 = _hf_logits(hf64, ids, mask)
        shard64, full64 = _forward_full(_megatron(hf64, torch.float64), ids, mask)
        res["fp64"] = _valid_maxabs(full64[..., :vocab], ref64, mask)
        res["vp"] = _vocab_parallel_checks(shard64, full64, torch.roll(ids, -1, 1), vocab, group)
        if controls and not overrides:
            res["controls"] = _controls(hf, ids, mask, ref)
        out[variant_name(arch, overrides)] = res
    return out


def _all_padding_shard_check(group) -> float:
    """vocab_size inside rank 0's shard: every other rank holds only padding columns."""
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    g = torch.Generator().manual_seed(5)
    full = torch.randn(2, 3, 4 * tp, generator=g, dtype=torch.float64)
    labels = torch.tensor([[0, 1, 2], [2, 2, 0]])
    x = full[..., rank * 4:(rank + 1) * 4].clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs_entropy(x, labels, calc_entropy=True, tp_group=group,
                                              vocab_size=3)
    (lp.sum() + ent.sum()).backward()
    ref_x = full[..., :3].clone().requires_grad_(True)
    ls = torch.log_softmax(ref_x, -1)
    ref_lp, ref_ent = ls.gather(-1, labels[..., None])[..., 0], -(ls.exp() * ls).sum(-1)
    (ref_lp.sum() + ref_ent.sum()).backward()
    ref_grad = torch.nn.functional.pad(ref_x.grad, (0, 4 * tp - 3))[..., rank * 4:(rank + 1) * 4]
    return max((lp - ref_lp).abs().max().item(), (ent - ref_ent).abs().max().item(),
               (x.grad - ref_grad).abs().max().item())


def _rng_tracker_check(seed: int) -> dict:
    """The patched tracker forks a CPU stream seeded like megatron's and restores the outer one."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    expected = torch.Generator().manual_seed(seed + 2718 + ps.get_tensor_model_parallel_rank())
    outer = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(3)
    outer_restored = torch.equal(torch.get_rng_state(), outer)
    with tracker.fork():
        second = torch.rand(3)  # continues the tracked stream
    return {"tp_stream": bool(torch.equal(torch.cat([first, second]),
                                          torch.rand(6, generator=expected))),
            "outer_restored": outer_restored}


def layout_checks(info, layouts: list[tuple[int, int]], optimizer: bool = True) -> dict:
    """Run the checks of each ``(tp, pp)`` layout in turn in one spawned group."""
    from megatron.core import parallel_state as ps

    out: dict = {"seconds": {}}
    t0 = time.perf_counter()
    compat.REDIRECTS.clear()  # this run's redirects only (a warm pool's rank ran others before)
    for tp, pp in layouts:
        compat.init_megatron(tp=tp, pp=pp, seed=7)
        res: dict = {"patches": compat.apply_cpu_patches(), "rng": _rng_tracker_check(7)}
        if pp == 1:
            res.update(parity_checks(controls=tp > 1))
            res["all_padding_shard"] = _all_padding_shard_check(
                ps.get_tensor_model_parallel_group())
            if optimizer and tp > 1 and ps.get_data_parallel_world_size() == 1:
                for kind in ("sgd", "adam"):
                    res[kind] = _optimizer_step_checks(build_tiny_model("qwen2", seed=5),
                                                       *make_batch(264, seed=4), kind)
        else:
            res.update(pipeline_checks())
        compat.teardown_megatron()
        out[f"tp{tp}_pp{pp}"] = res
        out["seconds"][f"tp{tp}_pp{pp}"] = time.perf_counter() - t0
    out["redirects"] = dict(compat.REDIRECTS)
    return out


def pipeline_checks() -> dict:
    """PP > 1, any TP: pipeline forward parity, 1F1B backward grads, weight gather."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    last = ps.is_pipeline_last_stage()
    out: dict = {"stage": ps.get_pipeline_model_parallel_rank(), "last": last}
    for arch in ("qwen2", "llama"):
        hf = build_tiny_model(arch, seed=13)
        vocab = hf.config.vocab_size
        mbs = [make_batch(vocab, seed=21), make_batch(vocab, seed=22, lengths=(5, 9), seq=9)]
        model = _megatron(hf)
        res: dict = {}
        logits = pipeline_forward(model, mbs)

        def logp_of(shard, i):  # computed on the last stage, in place of keeping the logits
            return vocab_parallel_logprobs_entropy(
                shard, torch.roll(mbs[i][0], -1, 1), tp_group=ps.get_tensor_model_parallel_group(),
                vocab_size=vocab)[0]

        logps = pipeline_forward(model, mbs, on_logits=logp_of)
        if last:
            diffs, lp_diffs = [], []
            for (ids, mask), shard, lp in zip(mbs, logits, logps):
                ref = _hf_logits(hf, ids, mask)
                diffs.append(_valid_maxabs(_gather_vocab(shard)[..., :vocab], ref, mask))
                ref_lp, _ = logprobs_from_logits(ref, torch.roll(ids, -1, 1))
                lp_diffs.append(_valid_maxabs(lp, ref_lp, mask))
            res["fp32"], res["logp"] = max(diffs), max(lp_diffs)
        else:
            res["outputs_on_other_stage"] = (logits, logps)

        # backward through the 1F1B schedule; loss per micro-batch = masked mean of -logp
        ref_model = copy.deepcopy(hf).train()
        for ids, mask in mbs:
            lp, _ = logprobs_from_logits(ref_model(input_ids=ids, attention_mask=mask).logits,
                                         torch.roll(ids, -1, 1))
            (-(lp * mask).sum() / mask.sum() / len(mbs)).backward()  # the schedule divides by #mbs
        model.train()
        it = iter(mbs)

        def step(data_iterator, stage):
            ids, mask = next(data_iterator)

            def loss_func(shard):
                lp, _ = vocab_parallel_logprobs_entropy(
                    shard, torch.roll(ids, -1, 1), tp_group=ps.get_tensor_model_parallel_group(),
                    vocab_size=vocab)
                loss = -(lp * mask).sum() / mask.sum()
                return loss, {"loss": loss.detach().clone()}

            return stage(ids, position_ids(ids), attention_mask_4d(mask)), loss_func

        get_forward_backward_func()(forward_step_func=step, data_iterator=it, model=[model],
                                    num_microbatches=len(mbs), seq_length=SEQ,
                                    micro_batch_size=len(LENGTHS), forward_only=False)
        grads = convert.gather_hf_state_dict(
            model, hf.config, tensors={n: p.grad for n, p in model.named_parameters()})
        res["grads"] = max((grads[n] - p.grad).abs().max().item()
                           for n, p in ref_model.named_parameters())
        res["grad_scale"] = max(p.grad.abs().max().item() for p in ref_model.parameters())
        res["round_trip_exact"] = _state_dict_exact(convert.gather_hf_state_dict(model, hf.config),
                                                    hf.state_dict())
        out[arch] = res
    return out
