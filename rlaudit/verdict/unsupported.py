"""A release that cannot do what a check needs: :class:`UnsupportedFeature`, raised by an
adapter, and the ``unsupported`` check result it becomes.

An adapter over a trainer's real functions knows what each release has: a keyword its
``agg_loss`` takes, a registered policy loss, a config field. When the installed release lacks
it, the adapter raises :class:`UnsupportedFeature` *before* calling into the trainer, naming the
feature and the release:

    if not accepts(core.agg_loss, "dp_size"):
        raise UnsupportedFeature("agg_loss(dp_size=...): global token/sequence counts",
                                 release=f"verl {version}", reason="added in verl 0.7")

The check reports ``unsupported`` with that text (never ``fail``: nothing of the trainer was
found wrong; never ``pass``: nothing was verified) and every other check still runs. The route
is declarative on purpose: a ``TypeError`` or ``KeyError`` raised *inside* the trainer's math is
a finding like any other exception and stays a failure; only what the adapter itself says it
cannot do is unsupported.

It subclasses ``NotImplementedError`` (the contract's "not supported here"), so code that treats
that as a skipped case keeps doing so; the stage checks and the train_step audit tell the two
apart and report this one with its feature and release.
"""

from __future__ import annotations

from rlaudit.verdict.result import UNSUPPORTED, CheckResult


class UnsupportedFeature(NotImplementedError):
    """``feature``: what the check needs that the release lacks (a function, a keyword, a config
    field, a registered name); ``release``: the peer and version (``"verl 0.5.0"``);
    ``reason``: what would provide it (``"added in verl 0.7"``), optional."""

    def __init__(self, feature: str, *, release: str = "", reason: str = ""):
        self.feature, self.release, self.reason = str(feature), str(release), str(reason)
        where = f"{self.release} lacks " if self.release else "the release lacks "
        super().__init__(where + self.feature + (f" ({self.reason})" if self.reason else ""))

    def details(self) -> dict[str, str]:
        """JSON-able: feature, release, reason and the one-line message."""
        return {"feature": self.feature, "release": self.release, "reason": self.reason,
                "message": str(self)}


def unsupported_result(check: str, backend: str, errors: dict[str, UnsupportedFeature],
                       note: str = "") -> CheckResult:
    """The ``unsupported`` result of ``check`` for ``backend``: ``errors`` maps each case or
    name that could not run to the adapter's exception; ``note`` is appended to the message."""
    distinct = list(dict.fromkeys(str(e) for e in errors.values()))
    more = f" (+{len(distinct) - 2} more)" if len(distinct) > 2 else ""
    return CheckResult(check, backend, UNSUPPORTED, "; ".join(distinct[:2]) + more + note,
                       {"unsupported": {name: e.details() for name, e in errors.items()}})


__all__ = ["UnsupportedFeature", "unsupported_result"]
