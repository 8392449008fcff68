"""What a user writes against: the adapter API, the stage signatures, declarations and the guard.

- ``adapter.py``: :class:`TargetAdapter` (optional base), :class:`TrainStepOutput`, the stage
  names and the helpers reading an adapter's attributes.
- ``stages.py``: :class:`Stages`, the stage signatures as a :class:`typing.Protocol`.
- ``load.py``: :func:`load_adapter` (``module:Attr`` or a peer's short name).
- ``declare.py``: precision, tolerances, conventions and :class:`Difference` declarations.
- ``guard.py``: the no-mutation/no-aliasing watch every stage call goes through.
- ``own_adapters.py``: rlaudit's own reference and built-in backends as adapters.
"""

from rlaudit.targets.contract.adapter import STAGES, TargetAdapter, TrainStepOutput
from rlaudit.targets.contract.declare import Difference
from rlaudit.targets.contract.load import load_adapter
from rlaudit.targets.contract.stages import Stages
from rlaudit.verdict.unsupported import UnsupportedFeature

__all__ = ["STAGES", "Difference", "Stages", "TargetAdapter", "TrainStepOutput",
           "UnsupportedFeature", "load_adapter"]
