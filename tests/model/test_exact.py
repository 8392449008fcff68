"""exact_float64: a float64 model's outputs must not depend on padding length or thread count."""

import torch

from rlaudit.model.exact import exact_float64
from rlaudit.model.tiny import build_tiny_model


def _last_logits(model, ids, pad_to):
    """Logits of the last real token of ``ids`` when the row is right-padded to ``pad_to``."""
    n = ids.shape[1]
    padded = torch.cat([ids, torch.zeros(1, pad_to - n, dtype=ids.dtype)], 1)
    mask = torch.cat([torch.ones(1, n, dtype=torch.long), torch.zeros(1, pad_to - n, dtype=torch.long)], 1)
    with torch.no_grad():
        return model(input_ids=padded, attention_mask=mask).logits[0, n - 1]


def test_float64_results_do_not_depend_on_padding():
    ids = torch.tensor([[257, 10, 200, 31, 7, 99, 3]])
    stock = build_tiny_model("qwen2", seed=3, dtype=torch.float64)
    stock.set_attn_implementation("eager")
    exact = exact_float64(build_tiny_model("qwen2", seed=3, dtype=torch.float64))
    drift_exact = (_last_logits(exact, ids, 7) - _last_logits(exact, ids, 40)).abs().max()
    assert drift_exact < 1e-12
    # an independent float64 RMSNorm: the patched forward must compute exactly this
    norm = exact.model.norm
    x = torch.randn(3, 128, dtype=torch.float64)
    want = norm.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    assert (norm(x) - want).abs().max() < 1e-14
    # and the stock model really has float32 islands (otherwise this module would be pointless)
    assert (stock.model.norm(x) - want).abs().max() > 1e-10


def test_float32_models_are_untouched():
    m = build_tiny_model("llama", seed=1)
    forward = m.model.norm.forward
    assert exact_float64(m) is m and m.model.norm.forward == forward
