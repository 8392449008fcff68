"""Prompts for the rollout engines: validating token-id prompts and encoding text prompts.

Engines take prompts as token ids (``list[list[int]]``), never text, so that the reference
sampler and vLLM see exactly the same tokens whatever their tokenizers would do.
"""

from __future__ import annotations

from typing import Sequence

from rlaudit.errors import InputError

#: Short prompts for recording tiny-model rollouts (arithmetic, so rule rewards can score them).
DEFAULT_PROMPTS = (
    "1+2=", "7*6=", "10-3=", "9+9=", "2*8=", "15-7=", "4+4=", "3*3=",
)


def check_prompt_ids(prompt_ids: Sequence[Sequence[int]], *, vocab_size: int | None = None,
                     arg: str = "prompt_ids") -> list[list[int]]:
    """Validate and copy prompts: a non-empty list of non-empty lists of ints in [0, vocab_size).

    Returns new lists (the input is not kept). Raises :class:`InputError` naming ``arg`` and the
    offending prompt index.
    """
    if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Sequence):
        raise InputError(f"expected a list of token-id lists, got {type(prompt_ids).__name__}",
                         key=arg)
    if len(prompt_ids) == 0:
        raise InputError("expected at least one prompt", key=arg)
    out: list[list[int]] = []
    for j, prompt in enumerate(prompt_ids):
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise InputError(f"expected a list of token ids, got {type(prompt).__name__}",
                             key=f"{arg}[{j}]")
        if len(prompt) == 0:
            raise InputError("empty prompt (a prompt needs at least one token)", key=f"{arg}[{j}]")
        ids = []
        for tok in prompt:
            if isinstance(tok, bool) or not isinstance(tok, int):
                try:  # numpy / torch integer scalars
                    if int(tok) != tok:
                        raise ValueError
                    tok = int(tok)
                except (TypeError, ValueError):
                    raise InputError(f"token ids must be ints, got {tok!r}",
                                     key=f"{arg}[{j}]") from None
            if tok < 0 or (vocab_size is not None and tok >= vocab_size):
                raise InputError(f"token id {tok} outside [0, {vocab_size})", key=f"{arg}[{j}]")
            ids.append(tok)
        out.append(ids)
    return out


def encode_prompts(tokenizer, texts: Sequence[str], *, add_bos: bool = True) -> list[list[int]]:
    """Token ids of ``texts`` (no special tokens added by the tokenizer), each preceded by the
    tokenizer's BOS id when ``add_bos`` (an error if it has none)."""
    if isinstance(texts, str):
        raise InputError("expected a list of strings, got one string", key="texts")
    bos = tokenizer.bos_token_id
    if add_bos and bos is None:
        raise InputError("tokenizer has no bos_token_id; pass add_bos=False", key="add_bos")
    out = []
    for text in texts:
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        out.append(([bos] if add_bos else []) + ids)
    return out
