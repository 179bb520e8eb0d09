"""Slurm's switch layout: `topology.conf` (tree, block and ring forms) and `scontrol show topology`.

Both are lines of `Key=value` words, so one reader serves both: `scontrol show topology` adds
`Level=` and `LinkSpeed=` and lists every node under upper switches too, which is why the leaf
of a node is its lowest-level switch, not just any switch naming it. The placement only needs
one fact per node, the group it hangs under (leaf switch, block or ring), and an order of the
groups in which neighbours share as much of the tree as possible: a depth-first walk.

Lookups are linear in the size of the file: the leaf of every node and the parent of every
switch are indexed once (`_index`), so a 4,096-node tree or a million-node hostlist costs one
pass, not one scan of every group per node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import UserError
from .hostlist import HostlistError, expand

__all__ = ["SwitchTopology", "Group", "parse_slurm_topology"]

_KINDS = {"switchname": "switch", "blockname": "block", "ringname": "ring"}


@dataclass
class Group:
    """A switch, block or ring: its direct nodes (in listing order) and child switches."""

    name: str
    kind: str  # "switch" | "block" | "ring"
    nodes: list[str] = field(default_factory=list)
    children: list[str] = field(default_factory=list)
    level: int | None = None
    link_speed: str | None = None


@dataclass
class SwitchTopology:
    """Every group of the file, in file order, plus `BlockSizes` when given."""

    groups: dict[str, Group] = field(default_factory=dict)
    block_sizes: list[int] = field(default_factory=list)
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def by_kind(self, kind: str) -> list[Group]:
        return [g for g in self.groups.values() if g.kind == kind]

    def _levels(self) -> dict[str, int]:
        """Given levels, else 0 for a switch without child switches and 1 + the highest child."""
        levels: dict[str, int] = {}

        def level(name: str, seen: frozenset[str] = frozenset()) -> int:
            if name in levels:
                return levels[name]
            g = self.groups.get(name)
            if g is None or name in seen:
                return 0
            if g.level is not None:
                value = g.level
            elif g.children:
                value = 1 + max(level(c, seen | {name}) for c in g.children)
            else:
                value = 0
            levels[name] = value
            return value

        for name in self.groups:
            level(name)
        return levels

    def _index(self) -> tuple[dict[str, str], dict[str, str], dict[str, int]]:
        """(leaf of each node, parent of each switch, level of each group), built once.

        The leaf of a node is its lowest-level switch, else its block, else its ring (first in
        file order among equals), matching how Slurm's plugins see a node."""
        if "leaf" in self._cache:
            return self._cache["leaf"], self._cache["parent"], self._cache["levels"]
        levels = self._levels()
        kind_rank = {"switch": 0, "block": 1, "ring": 2}
        # write the least preferred groups first, so the preferred one is written last: by
        # (kind, level) descending, and among equals the first in the file last
        ranked = sorted(
            reversed(list(self.groups.values())),
            key=lambda g: (kind_rank[g.kind], levels[g.name]),
            reverse=True,
        )
        leaf: dict[str, str] = {}
        for g in ranked:
            leaf.update(dict.fromkeys(g.nodes, g.name))
        parent: dict[str, str] = {}
        for g in self.groups.values():
            for child in g.children:
                parent.setdefault(child, g.name)
        self._cache.update(leaf=leaf, parent=parent, levels=levels)
        return leaf, parent, levels

    def leaf_of(self, node: str, levels: dict[str, int] | None = None) -> str | None:
        """The group a node hangs under: its lowest switch, else its block, else its ring."""
        return self._index()[0].get(node)

    def switch_path(self, node: str) -> list[str]:
        """[leaf, its parent, ..., top] for a node; empty when the layout does not list it."""
        leaf, parent, _ = self._index()
        path: list[str] = []
        name = leaf.get(node)
        while name is not None and name not in path:
            path.append(name)
            name = parent.get(name)
        return path

    def node_order(self) -> list[str]:
        """Every node once, so that nodes of one leaf are together and leaves under one parent
        switch are together: a depth-first walk from the top switches, children in listing
        order; then blocks and rings in file order for nodes that no switch holds."""
        leaf, _, levels = self._index()
        order: list[str] = []
        seen: set[str] = set()
        child_names = {c for g in self.groups.values() for c in g.children}
        switches = self.by_kind("switch")
        visited: set[str] = set()

        def walk(name: str) -> None:
            stack = [name]
            while stack:
                g = self.groups.get(stack.pop())
                if g is None or g.name in visited:
                    continue
                visited.add(g.name)
                for n in g.nodes:
                    if n not in seen and leaf.get(n) == g.name:
                        seen.add(n)
                        order.append(n)
                stack.extend(reversed(g.children))

        roots = [g for g in switches if g.name not in child_names]
        roots.sort(key=lambda g: -levels[g.name])  # stable: file order among equals
        for g in roots + switches + self.by_kind("block") + self.by_kind("ring"):
            walk(g.name)
        return order


def _words(line: str, where: str) -> list[tuple[str, str]]:
    pairs = []
    for word in line.split():
        key, sep, value = word.partition("=")
        if not sep or not key:
            raise UserError(f"{where}: expected Key=value words, found {word!r}")
        pairs.append((key.lower(), value))
    return pairs


def _hosts(value: str, where: str) -> list[str]:
    try:
        return expand(value)
    except HostlistError as err:
        raise UserError(f"{where}: {err}") from None


def parse_slurm_topology(text: str, source: str = "<topology>") -> SwitchTopology:
    """Read topology.conf or `scontrol show topology` output; `source` names it in errors."""
    topo = SwitchTopology()
    lines: dict[str, int] = {}  # group name -> line, for errors found after reading
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        where = f"{source}:{n}"
        if not line or line.startswith("$"):
            continue
        pairs = _words(line, where)
        first_key, first_value = pairs[0]
        if first_key == "blocksizes":
            try:
                topo.block_sizes = [int(v) for v in first_value.split(",") if v]
            except ValueError:
                raise UserError(f"{where}: expected BlockSizes=N,N,...") from None
            continue
        if first_key == "topologyname":  # newer Slurm may name the topology first
            pairs = pairs[1:]
            if not pairs:
                continue
            first_key, first_value = pairs[0]
        if first_key not in _KINDS:
            raise UserError(
                f"{where}: expected a line starting with SwitchName=, BlockName=, RingName= "
                f"or BlockSizes=, found {first_key}="
            )
        if not first_value:
            raise UserError(f"{where}: {first_key} needs a name")
        if first_value in topo.groups:
            raise UserError(f"{where}: {first_value} is defined twice")
        group = Group(name=first_value, kind=_KINDS[first_key])
        for key, value in pairs[1:]:
            if key == "nodes":
                group.nodes = _hosts(value, where)
            elif key == "switches":
                group.children = _hosts(value, where)
            elif key == "level":
                if not value.isdigit():
                    raise UserError(f"{where}: expected Level=<number>, found {value!r}")
                group.level = int(value)
            elif key == "linkspeed":
                group.link_speed = value
            # other keys (BlockIndex, BlockSize, ...) are tolerated and ignored
        if not group.nodes and not group.children:
            raise UserError(f"{where}: {group.name} has neither Nodes= nor Switches=")
        topo.groups[group.name] = group
        lines[group.name] = n
    for g in topo.groups.values():
        for child in g.children:
            if child not in topo.groups:
                raise UserError(
                    f"{source}:{lines[g.name]}: switch {g.name} names an undefined switch {child}"
                )
    return topo
