"""The bounds table of rlaudit/config_bounds.py covers every numeric config key, and only them."""

from __future__ import annotations

import dataclasses

import pytest

from rlaudit.config import Config, load_config
from rlaudit.config_bounds import (BOUNDS, SCENARIO, check_bounds, describe, documented,
                                   numeric_fields)


def test_every_numeric_config_field_has_a_row():
    missing = [key for cls, name, key, _ in numeric_fields(Config)
               if name not in BOUNDS.get(cls.__name__, {})]
    assert not missing, f"add a row to rlaudit.config_bounds.BOUNDS for: {missing}"


def test_every_row_is_a_numeric_config_field():
    fields = {(cls.__name__, name) for cls, name, _, _ in numeric_fields(Config)}
    rows = {(cls, name) for cls, table in BOUNDS.items() for name in table if cls != SCENARIO}
    assert rows <= fields, rows - fields
    assert set(BOUNDS[SCENARIO]) == {"steps"}  # the scenario file's own numeric key


def test_one_row_holds_both_ends_of_a_size():
    """The range a value must be in and the audit limit of a size that drives work are one row
    (rlaudit.scenarios.bounds reads the limits from it)."""
    from rlaudit.scenarios.bounds import limits
    epochs = BOUNDS["ActorConfig"]["ppo_epochs"]
    assert (epochs.low, epochs.limit) == (1, 1_000)
    assert describe(epochs, integer=True) == "an integer >= 1"
    padding = BOUNDS["TrainerConfig"]["extra_padding_microbatches"]
    assert (padding.low, padding.limit) == (0, 1_024)
    assert limits() == {
        "steps": (10_000, "optimizer steps replayed on one fixed rollout"),
        "config.actor.ppo_epochs": (1_000, "passes over the rollout per step"),
        "config.actor.context_parallel_size": (1_024, "simulated ranks each sequence is split "
                                                      "over"),
        "config.actor.logprob_chunk_size": (
            1_048_576, "rows of logits held at once (memory ~ chunk x vocab x 5 bytes)"),
        "config.critic.ppo_epochs": (1_000, "passes over the rollout per step"),
        "config.rollout.n": (4_096, "responses per prompt"),
        "config.rollout.response_length": (1_048_576, "tokens a padded response is allocated"),
        "config.rollout.prompt_length": (1_048_576, "tokens a padded prompt is allocated"),
        "config.data.train_batch_size": (65_536, "prompts per step"),
        "config.trainer.extra_padding_microbatches": (
            1_024, "padding micro-batches run on every rank, every optimizer step"),
    }


def test_a_numeric_field_without_a_row_cannot_skip_the_check():
    @dataclasses.dataclass
    class Extended(Config):
        new_knob: float = 0.5

    with pytest.raises(TypeError, match="new_knob has no row"):
        check_bounds(Extended())


def test_the_defaults_and_the_rows_in_words():
    load_config({})  # rlaudit's own defaults are in range
    check_bounds(Config())
    assert describe(BOUNDS["OptimConfig"]["lr"]) == "a finite number >= 0"
    assert describe(BOUNDS["OptimConfig"]["betas"]) == "a finite number in [0, 1)"
    assert describe(BOUNDS["ActorConfig"]["ppo_epochs"], integer=True) == "an integer >= 1"


def test_every_numeric_key_is_documented_in_words():
    docs = dict(documented(Config))
    assert docs["actor.optim.eps"] == "a finite number > 0 (Adam divides by sqrt(v) + eps)"
    assert docs["critic.optim.lr"].startswith("a finite number >= 0")
    assert len(docs) == len(list(numeric_fields(Config)))
