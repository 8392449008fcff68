"""What differs between TRL releases, read from the release itself: the precision its
``train_step`` is audited at (from the version, compared as numbers) and the ``GRPOConfig``
keywords it can take (from its dataclass fields, before the config is built).
"""

from __future__ import annotations

from rlaudit.verdict.unsupported import UnsupportedFeature

#: the first release whose log-probs come from TRL's fused LM head (its log-sum-exp accumulates
#: in float32 whatever the model dtype); before it, log_softmax of the model's own-dtype logits
FUSED_LOGPROBS_SINCE = (1, 15)


def train_precision_of(version: str) -> str:
    """The precision TRL ``version`` trains in: compared as numbers (as text, "1.2" would sort
    after "1.15" and 1.2-1.9 would be held to float32's looser tolerance)."""
    major_minor = tuple(int("".join(c for c in part if c.isdigit()) or 0)
                        for part in version.split(".")[:2])
    return "float32" if major_minor >= FUSED_LOGPROBS_SINCE else "hf-float64"


#: GRPOConfig keys a release may lack, and the value that asks for nothing such a release lacks:
#: TRL 1.0.0 and 1.5.1 have no ``entropy_coef`` (no entropy bonus at all: as entropy_coef = 0)
NEUTRAL_WHEN_ABSENT = {"entropy_coef": 0.0}


def release_config_kwargs(config_class, kwargs: dict, version: str) -> dict:
    """``kwargs`` for the release's ``config_class`` (its ``GRPOConfig``, a dataclass), read
    before it is built: a key the release has no field for is left out when its value is
    :data:`NEUTRAL_WHEN_ABSENT`'s (the release does the same without it); any other missing key
    raises :class:`UnsupportedFeature` naming the keys and the release (the scenario needs a
    setting the release cannot take: unsupported, never a failure of TRL)."""
    fields = getattr(config_class, "__dataclass_fields__", None)
    if fields is None:     # not a dataclass: nothing to read the fields from, GRPOConfig decides
        return dict(kwargs)
    absent = [k for k in kwargs if k not in fields]
    needed = sorted(k for k in absent
                    if k not in NEUTRAL_WHEN_ABSENT or kwargs[k] != NEUTRAL_WHEN_ABSENT[k])
    if needed:
        raise UnsupportedFeature(
            "GRPOConfig " + ", ".join(f"{k}={kwargs[k]!r}" for k in needed)
            + " (set from the scenario's config)",
            release=f"TRL {version}", reason="the release's GRPOConfig has no such field")
    return {k: v for k, v in kwargs.items() if k not in absent}
