"""``load_yaml``: ``yaml.safe_load`` for the files users hand rlaudit, with two refusals.

- Duplicate keys. PyYAML keeps the last of two equal keys in one mapping and drops the first
  without a word, so a scenario could run with a value its author never meant. Refused, naming
  the key and both lines. (Keys pulled in by a ``<<`` merge may still be overridden: that is
  what merging is for.)
- Alias expansion past a small budget. An alias repeats its anchored node by reference, so a
  780-byte file of nested aliases (the "billion laughs") loads as a structure that is gigabytes
  once anything walks, copies or prints it. The budget counts what the aliases would expand
  to: at most :data:`MAX_ALIASES` aliases, together repeating at most :data:`MAX_ALIAS_NODES`
  nodes and :data:`MAX_ALIAS_CHARS` characters of scalars; a recursive alias (a node that
  contains itself) is refused outright. rlaudit's own files use no aliases at all, so these
  bounds are generous for sharing a block or two and still keep a file's expansion small.

Every refusal is a ``yaml.YAMLError`` whose message names the line (from the source text, never
the expanded value), so callers' ``except yaml.YAMLError`` turns it into an InputError.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.constructor import ConstructorError

#: aliases (``*name``) in one file
MAX_ALIASES = 100
#: nodes that all aliases of a file repeat, counted as if expanded
MAX_ALIAS_NODES = 10_000
#: characters of scalars that all aliases of a file repeat, counted as if expanded
MAX_ALIAS_CHARS = 1_000_000

_MERGE = "tag:yaml.org,2002:merge"


def _short(key: Any) -> str:
    text = repr(key)
    return text if len(text) <= 60 else text[:57] + "..."


class BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys and alias expansion past the budget."""

    def __init__(self, stream):
        super().__init__(stream)
        self._aliases = 0
        self._alias_nodes = 0
        self._alias_chars = 0
        self._open_anchors: set[str] = set()
        self._sizes: dict[int, tuple[int, int]] = {}

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self._count_alias(self.peek_event())
            return super().compose_node(parent, index)
        anchor = self.peek_event().anchor
        if anchor is None:
            return super().compose_node(parent, index)
        self._open_anchors.add(anchor)
        try:
            return super().compose_node(parent, index)
        finally:
            self._open_anchors.discard(anchor)

    def _count_alias(self, event) -> None:
        mark = event.start_mark
        if event.anchor in self._open_anchors:
            raise ComposerError(None, None, f"recursive alias *{event.anchor} (a node that "
                                "contains itself) is not allowed", mark)
        self._aliases += 1
        if self._aliases > MAX_ALIASES:
            raise ComposerError(None, None, f"more than {MAX_ALIASES} aliases in one file",
                                mark)
        node = self.anchors.get(event.anchor)
        if node is None:
            return  # PyYAML reports the undefined alias itself
        nodes, chars = self._size(node)
        self._alias_nodes += nodes
        self._alias_chars += chars
        if self._alias_nodes > MAX_ALIAS_NODES or self._alias_chars > MAX_ALIAS_CHARS:
            raise ComposerError(None, None, f"aliases expand past the limit of "
                                f"{MAX_ALIAS_NODES} nodes / {MAX_ALIAS_CHARS} characters "
                                f"(at *{event.anchor})", mark)

    def _size(self, node) -> tuple[int, int]:
        """(nodes, scalar characters) of ``node`` with its own aliases expanded (memoized)."""
        known = self._sizes.get(id(node))
        if known is not None:
            return known
        if isinstance(node, yaml.ScalarNode):
            size = (1, len(node.value))
        else:
            children = (node.value if isinstance(node, yaml.SequenceNode)
                        else [n for pair in node.value for n in pair])
            sizes = [self._size(c) for c in children]
            size = (1 + sum(s[0] for s in sizes), sum(s[1] for s in sizes))
        self._sizes[id(node)] = size
        return size

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, yaml.Node] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE:
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    earlier = first.setdefault(key, key_node)
                except TypeError:
                    continue  # an unhashable key: the base class reports it
                if earlier is not key_node:
                    mark = earlier.start_mark
                    raise ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"duplicate key {_short(key)} (first on line {mark.line + 1}, "
                        f"column {mark.column + 1})", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """Parse one YAML document like ``yaml.safe_load``, with the refusals above."""
    loader = BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
