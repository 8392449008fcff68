"""A peer package that registers pyarrow extension types at import can be imported again after
another peer's release of it left (registry.forget_arrow_types)."""

import types

import pytest

from rlaudit.targets.peers.registry import forget_arrow_types

pa = pytest.importorskip("pyarrow")


def _module_registering_a_type(name: str) -> types.ModuleType:
    module = types.ModuleType(name)

    class Tagged(pa.ExtensionType):
        def __init__(self):
            pa.ExtensionType.__init__(self, pa.int64(), f"{name}.Tagged")

        def __arrow_ext_serialize__(self):
            return b""

        @classmethod
        def __arrow_ext_deserialize__(cls, storage_type, serialized):
            return cls()

    Tagged.__module__ = name
    module.Tagged = Tagged
    pa.register_extension_type(Tagged())
    return module


def test_a_type_registered_twice_is_refused_and_forgetting_it_allows_the_second():
    first = _module_registering_a_type("rlaudit_test_arrow_pkg")
    with pytest.raises(pa.ArrowKeyError):        # what a second import of the package meets
        _module_registering_a_type("rlaudit_test_arrow_pkg")
    forget_arrow_types(first)
    second = _module_registering_a_type("rlaudit_test_arrow_pkg")
    forget_arrow_types(second)
