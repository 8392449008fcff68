"""Loading an adapter: ``rlaudit run --target module:Attr`` or a peer's short name (``verl``).

The peer table (:mod:`rlaudit.targets.peers.registry`) is plain data and path lookups: it imports
nothing of the adapters, so reading it here keeps the contract below the peers' adapters.
"""

from __future__ import annotations

import importlib
import os
import sys

from rlaudit.errors import InputError
from rlaudit.targets.contract.adapter import STAGES, adapter_name, provided_stages
from rlaudit.targets.contract.declare import read_declarations
from rlaudit.targets.contract.target_errors import TARGET_FAILURES, target_error
from rlaudit.targets.peers.registry import PEERS, resolve


def peers_names() -> list[str]:
    return list(PEERS)


def load_adapter(spec: str) -> object:
    """Import ``"package.module:Attr"`` and return the adapter: ``Attr()`` when ``Attr`` is a
    class, else ``Attr`` itself. When the module is not importable as is, the current directory
    is added to ``sys.path`` and the import retried (so ``examples.toy_trainer.adapter:ToyAdapter``
    works from the repository root even through the installed ``rlaudit`` script).
    """
    if isinstance(spec, str) and ":" not in spec:
        spec = resolve(spec) or spec
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise InputError(f"expected MODULE:ATTR (e.g. mypkg.audit:MyAdapter) or a peer's short "
                         f"name ({', '.join(sorted(peers_names())) or 'none registered'}), "
                         f"got {spec!r}",
                         key="--target")
    module_name, attr = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as first:
        cwd = os.getcwd()
        if cwd in sys.path or first.name is None or not module_name.startswith(first.name):
            raise InputError(f"cannot import module {module_name!r}: {first}",
                             key="--target") from None
        sys.path.insert(0, cwd)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            raise InputError(f"cannot import module {module_name!r} (also tried from {cwd}): "
                             f"{e}", key="--target") from None
        except TARGET_FAILURES as e:
            raise target_error(f"importing {module_name}", spec, e) from None
    except TARGET_FAILURES as e:  # the module's own code failed: a syntax error, a raise, exit()
        raise target_error(f"importing {module_name}", spec, e) from None
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise InputError(f"module {module_name!r} has no attribute {attr!r}",
                         key="--target") from None
    try:
        adapter = obj() if isinstance(obj, type) else obj
    except TARGET_FAILURES as e:
        raise target_error(f"{attr}()", spec, e) from None
    adapter_name(adapter)  # validates ``name``
    read_declarations(adapter)      # precision, tolerances, differences: exit 2 before anything runs
    if not provided_stages(adapter):
        raise InputError(f"{spec} provides none of the stages {', '.join(STAGES)} "
                         f"(see docs/targets.md)", key="--target")
    return adapter
