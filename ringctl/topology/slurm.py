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

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import UserError
from ..text import ascii_number, cut, echo
from .hostlist import MAX_HOSTS, HostlistError, count, expand

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

    def levels(self) -> dict[str, int]:
        """Given levels, else 0 for a switch without child switches and 1 + the highest child
        (a child that is not defined, or that closes a loop, counts 0). Walked with a stack,
        not recursion: a chain of a few hundred switches passed Python's recursion limit."""
        levels: dict[str, int] = {}
        for name in self.groups:
            if name not in levels:
                self._walk_levels(name, levels)
        return levels

    def _walk_levels(self, root: str, levels: dict[str, int]) -> None:
        """Fill `levels` for root and the switches under it: a depth-first walk, each switch
        settled once all its children are (the recursion of old, with an explicit stack)."""
        stack: list[tuple[str, Iterator[str]]] = []
        highest: dict[str, int] = {}  # switch on the stack -> highest child level so far

        def enter(name: str) -> int | None:
            """name's level when known at once, else None (then it is pushed)."""
            g = self.groups.get(name)
            if name in levels or g is None or name in highest:
                return levels.get(name, 0)  # settled, undefined, or a loop back: 0
            if g.level is not None or not g.children:
                levels[name] = g.level if g.level is not None else 0
                return levels[name]
            highest[name] = 0
            stack.append((name, iter(g.children)))
            return None

        enter(root)
        while stack:
            name, children = stack[-1]
            child = next(children, None)
            if child is not None:
                value = enter(child)
                if value is not None:
                    highest[name] = max(highest[name], value)
                continue
            stack.pop()
            levels[name] = 1 + highest.pop(name)
            if stack:
                parent = stack[-1][0]
                highest[parent] = max(highest[parent], levels[name])

    def _index(self) -> tuple[dict[str, str], dict[str, str], dict[str, int]]:
        """(leaf of each node, parent of each switch, level of each group), built once.

        The leaf of a node is its lowest-level switch, else its block, else its ring (first in
        file order among equals), matching how Slurm's plugins see a node."""
        if "leaf" in self._cache:
            return self._cache["leaf"], self._cache["parent"], self._cache["levels"]
        levels = self.levels()
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


# One `Key=value` word as Slurm's parse_config.c reads it: blanks may stand around '=', and a
# value may be double-quoted (`Nodes="n[1-2]"`, the quotes not part of it). An unquoted value
# holds no '=' or '"', so `Nodes= Level=0` is an empty Nodes= followed by Level=0.
_PAIR = re.compile(r'([^\s="]+)\s*=\s*(?:"([^"]*)"|([^\s="]*))(?=\s|$)')
_BLANKS = re.compile(r"\s*")
_WORD = re.compile(r"\S*")
# Digits of Level= and of a BlockSizes= entry: levels are a handful, block sizes node counts.
MAX_NUMBER_DIGITS = 9


def _words(line: str, where: str) -> list[tuple[str, str]]:
    """(lowercase key, value) of each `Key=value` word of a line, quotes removed."""
    pairs = []
    at = _BLANKS.match(line).end()
    while at < len(line):
        m = _PAIR.match(line, at)
        if not m:
            word = _WORD.match(line, at).group()
            raise UserError(f"{where}: expected Key=value words, found {echo(word)}")
        key, quoted, plain = m.groups()
        pairs.append((key.lower(), quoted if quoted is not None else plain))
        at = _BLANKS.match(line, m.end()).end()
    return pairs


def _hosts(value: str, where: str, room: int) -> list[str]:
    """The names of a hostlist value; refused when they pass `room`, what the file's total
    cap (MAX_HOSTS for every Nodes= and Switches= together) leaves: the cap per expression
    alone let N short lines hold N x 2,000,000 names."""
    try:
        if count(value) > room:
            raise UserError(
                f"{where}: the file names more than {MAX_HOSTS:,} hosts in all "
                "(Nodes= and Switches= together); refusing to expand more"
            )
        return expand(value)
    except HostlistError as err:
        raise UserError(f"{where}: {err}") from None


def _number(value: str, where: str, what: str) -> int:
    """A Level= or BlockSizes= number: ASCII digits only (text.py says why)."""
    number = ascii_number(value, MAX_NUMBER_DIGITS)
    if number is None:
        raise UserError(
            f"{where}: expected {what} (ASCII digits, at most {MAX_NUMBER_DIGITS}), "
            f"found {echo(value)}"
        )
    return number


@dataclass
class _Reader:
    """The state of one file's reading: the groups so far, the line of each (for errors found
    after reading) and the host names expanded so far (for the file's total cap)."""

    source: str
    topo: SwitchTopology = field(default_factory=SwitchTopology)
    lines: dict[str, int] = field(default_factory=dict)
    hosts: int = 0

    def read(self, n: int, raw: str) -> None:
        """Take line n: a group, BlockSizes=, or nothing (blank, comment, a shell prompt)."""
        line = raw.strip()  # comments cut by _logical_lines
        where = f"{self.source}:{n}"
        if not line or line.startswith("$"):
            return
        pairs = _words(line, where)
        if pairs[0][0] == "topologyname":  # newer Slurm may name the topology first
            pairs = pairs[1:]
            if not pairs:
                return
        if pairs[0][0] == "blocksizes":
            values = [v for v in pairs[0][1].split(",") if v]
            self.topo.block_sizes = [_number(v, where, "BlockSizes=N,N,...") for v in values]
            return
        if pairs[0][0] == "aggregatedblock":
            # `scontrol show topology` of topology/block (Slurm 24.11+) lists each block level
            # above the base blocks (BlockSizes=, or by default once there are two blocks):
            # unions of consecutive base blocks, whose order the base blocks' listing already
            # gives. Refused, it stopped every job on such a cluster before any rank ran.
            return
        group = self._group(pairs, where)
        self.topo.groups[group.name] = group
        self.lines[group.name] = n

    def _group(self, pairs: list[tuple[str, str]], where: str) -> Group:
        first_key, first_value = pairs[0]
        if first_key not in _KINDS:
            raise UserError(
                f"{where}: expected a line starting with SwitchName=, BlockName=, RingName= "
                f"or BlockSizes=, found {cut(first_key)}="
            )
        if not first_value:
            raise UserError(f"{where}: {first_key} needs a name")
        if not first_value.isprintable():  # written raw into the SVG (not XML) and the table
            raise UserError(
                f"{where}: {_KINDS[first_key]} name {echo(first_value)} holds a control character"
            )
        if first_value in self.topo.groups:
            raise UserError(f"{where}: {cut(first_value)} is defined twice")
        group = Group(name=first_value, kind=_KINDS[first_key])
        for key, value in pairs[1:]:
            if key in ("nodes", "switches"):
                names = _hosts(value, where, MAX_HOSTS - self.hosts)
                self.hosts += len(names)
                if key == "nodes":
                    group.nodes = names
                else:
                    group.children = names
            elif key == "level":
                group.level = _number(value, where, "Level=<number>")
            elif key == "linkspeed":
                group.link_speed = value
            # other keys (BlockIndex, BlockSize, ...) are tolerated and ignored
        if not group.nodes and not group.children:
            raise UserError(f"{where}: {cut(group.name)} has neither Nodes= nor Switches=")
        return group

    def check_children(self) -> None:
        """Every child switch is defined (known only once the whole file is read)."""
        for g in self.topo.groups.values():
            for child in g.children:
                if child not in self.topo.groups:
                    raise UserError(
                        f"{self.source}:{self.lines[g.name]}: switch {cut(g.name)} names an "
                        f"undefined switch {cut(child)}"
                    )


def parse_slurm_topology(text: str, source: str = "<topology>") -> SwitchTopology:
    """Read topology.conf or `scontrol show topology` output; `source` names it in errors."""
    reader = _Reader(source)
    for n, line in _logical_lines(text):
        reader.read(n, line)
    reader.check_children()
    return reader.topo


def _logical_lines(text: str) -> Iterator[tuple[int, str]]:
    """(number of its first line, text) of each line as Slurm's config reader joins them: a
    line ending in an odd number of backslashes (blanks after them allowed) goes on in the
    next, the last backslash dropped and nothing put in its place; comments are cut from each
    line first. A long Nodes= list is often written so; it was refused."""
    start, held = 0, ""
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].rstrip()
        backslashes = len(line) - len(line.rstrip("\\"))
        if backslashes % 2:
            start, held = start or n, held + line[:-1]
            continue
        yield start or n, held + line
        start, held = 0, ""
    if held:
        yield start, held
