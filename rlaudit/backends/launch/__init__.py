"""Run a function on ``world_size`` local ranks under torch.distributed; collect their results.

The process runtime of the FSDP and Megatron backends, multi-rank tests and the executors:
:func:`launch` runs one group of ranks (``launcher``, whose docstring is the design);
``pool`` keeps warm groups for reuse (``run_ranks``, ``warm_pools``); ``start`` picks how rank
processes start (forkserver or spawn); ``rendezvous`` hosts the store the ranks join;
``rank_group`` supervises one group; ``worker`` and ``pool_worker`` run inside a rank;
``outcomes`` turns what the ranks left behind into a :class:`~rlaudit.errors.RankFailure`.
"""

from rlaudit.backends.launch.common import RankInfo
from rlaudit.backends.launch.launcher import RESERVED_ENV, RankTeardownWarning, host_store, launch
from rlaudit.backends.launch.outcomes import RankOutcome

__all__ = ["RankInfo", "RankOutcome", "RankTeardownWarning", "launch", "host_store",
           "RESERVED_ENV"]
