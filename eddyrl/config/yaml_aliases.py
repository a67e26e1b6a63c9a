"""YAML aliases, bounded: a YAML loader that refuses a document whose aliases expand too far.

An alias (`*a`) stands for the whole node its anchor (`&a`) names. PyYAML builds the Python
objects shared, so loading is quick, but everything after it (OmegaConf's merge, printing the
config, saving `config.yaml`) walks the tree expanded: nine nested anchors of nine aliases each,
300 bytes, are 9^9 nodes, and `eddy config show` never came back. So the composed node graph
is measured before anything is built from it, each node once (memoised, linear in the file),
and refused when its aliases add more than `MAX_ALIAS_NODES` nodes to what the file writes out.
A recipe reusing a block (a few dozen nodes, a few times) is far below that; a big file with no
aliases is never refused by it (its expanded size is its own).
"""

from __future__ import annotations

import yaml

# how many nodes aliases may add in all: OmegaConf takes about 2 s per 10,000 nodes
MAX_ALIAS_NODES = 10_000


class AliasExpansionError(yaml.YAMLError):
    """The document's aliases expand it beyond `MAX_ALIAS_NODES` (or into itself).
    `key`: the dotted key under which it grows; `count`: its expanded node count, or None for
    an alias inside its own anchor."""

    def __init__(self, key: str, count: int | None, written: int = 0):
        self.key, self.count, self.written = key, count, written
        super().__init__(self.message())

    def message(self, prefix: str = "") -> str:
        """What is wrong, in one line; `prefix`: the dotted key the document is the value of."""
        key = ".".join(part for part in (prefix, self.key) if part)
        where = f"under key {key!r}" if key else "at the top"
        if self.count is None:
            return f"an alias {where} refers to a node that contains it (an endless tree)"
        return (f"its aliases expand it to {self.count:,} nodes {where} ({self.written:,} "
                f"written out; aliases may add at most {MAX_ALIAS_NODES:,}): an alias bomb, "
                "or a block reused far more than a config needs")


class _Sizes:
    """Expanded node counts of a composed graph, each node measured once."""

    def __init__(self):
        self.size: dict[int, int] = {}
        self.open: set[int] = set()  # being measured: met again, it contains itself

    def of(self, node: yaml.Node, key: str = "") -> int:
        found = self.size.get(id(node))
        if found is not None:
            return found
        if id(node) in self.open:
            raise AliasExpansionError(key, None)
        self.open.add(id(node))
        total = 1
        for child, child_key in _children(node, key):
            total += self.of(child, child_key)
        self.open.discard(id(node))
        self.size[id(node)] = total
        return total


def _children(node: yaml.Node, key: str):
    """(child node, its dotted key) pairs; a sequence's items keep the sequence's key."""
    if isinstance(node, yaml.SequenceNode):
        return [(item, key) for item in node.value]
    if isinstance(node, yaml.MappingNode):
        pairs = []
        for key_node, value_node in node.value:
            name = key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"
            pairs.append((key_node, key))
            pairs.append((value_node, f"{key}.{name}" if key else str(name)))
        return pairs
    return []


def _growing_key(node: yaml.Node, sizes: _Sizes, key: str = "") -> str:
    """The deepest key whose value alone expands past the bound, following the largest
    child: where the bomb is."""
    children = _children(node, key)
    if children:
        child, child_key = max(children, key=lambda pair: sizes.size[id(pair[0])])
        if sizes.size[id(child)] > MAX_ALIAS_NODES:
            return _growing_key(child, sizes, child_key)
    return key


def check_expansion(node: yaml.Node | None) -> None:
    """Raise `AliasExpansionError` when `node`'s aliases add more than `MAX_ALIAS_NODES`."""
    if node is None:
        return
    sizes = _Sizes()
    count = sizes.of(node)
    written = len(sizes.size)  # distinct nodes: what the file writes out
    if count - written > MAX_ALIAS_NODES:
        raise AliasExpansionError(_growing_key(node, sizes), count, written)


class AliasBoundedLoader(yaml.SafeLoader):
    """`yaml.safe_load`'s loader, measuring the composed document before constructing it."""

    def get_single_node(self):
        node = super().get_single_node()
        check_expansion(node)
        return node
