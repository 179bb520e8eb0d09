"""Rings of rings: cut a job's W ranks into W/N rings of N consecutive ranks that sit tight.

Each ring of a `--ring-size N` job runs on its own, at the pace of its own slowest hop, so the
placement decides, in this order of preference:

* **inside a node** when N divides every node's rank count: the node's GPUs are split into
  cycles of N (exactly, by trying every split, for nodes small enough; else by cutting the
  node's best cycle into runs), maximising the worst cycle's bottleneck;
* **whole nodes** when every node has the same count c and c divides N: rings of k = N / c
  nodes, packed bottom-up through the switch tree (or Slurm blocks): first inside each leaf,
  then the leaves' leftovers under their common parent, and so on, so a ring straddles a
  switch only where the sizes force it, and the outer order stays the depth-first walk;
* otherwise N consecutive ranks of the flat placement (a ring may then span parts of nodes).

`Layout` is the outcome: the node sequence, how each node orders its ranks, and N.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import UserError
from .search import best_order

__all__ = ["Layout", "NodeRole", "choose_layout", "pack_nodes", "partition_cycles"]

# Splits of a node into cycles tried exhaustively up to this many (8 GPUs in 4s: 35, in 2s: 105).
PARTITION_LIMIT = 2_000


@dataclass(frozen=True)
class NodeRole:
    """How one node orders its ranks: `cycles` of N (inside-node rings), one `cycle` (the node
    is a ring by itself) or a `path` entered from `entry` and left to `exit` (each "net" or
    "nvlink", the kind of the hop from the previous / to the next node of its ring)."""

    mode: str  # "cycles" | "cycle" | "path"
    entry: str = "net"
    exit: str = "net"


@dataclass
class Layout:
    sequence: list[int]  # indices into the ordered nodes, in ring order
    roles: dict[int, NodeRole]
    ring_size: int
    kind: str  # "flat" | "inside nodes" | "whole nodes" | "consecutive ranks"


def pack_nodes(names: Sequence[str], paths: dict[str, list[str]], k: int) -> list[list[str]]:
    """Groups of k nodes, filled inside the lowest switch first; `names` in depth-first order,
    `paths[name]` = [leaf, ..., top]. len(names) must be a multiple of k."""
    full, left = _pack(list(names), paths, k, 0)
    if left:
        raise ValueError(f"{len(names)} nodes do not split into groups of {k}")
    return full


def _pack(names: list[str], paths: dict[str, list[str]], k: int, depth: int):
    def key(name: str) -> str | None:
        path = paths.get(name) or []
        return path[-1 - depth] if depth < len(path) else None

    full: list[list[str]] = []
    pool: list[str] = []
    for switch, run in itertools.groupby(names, key=key):
        run = list(run)
        if switch is None:
            pool.extend(run)  # nodes hanging directly here (or outside the layout)
            continue
        inner, left = _pack(run, paths, k, depth + 1)
        full.extend(inner)
        pool.extend(left)
    cut = len(pool) - len(pool) % k
    full.extend(pool[i : i + k] for i in range(0, cut, k))
    return full, pool[cut:]


def _cycle_edges(w, members: Sequence[int]) -> tuple[list[int], list[float]]:
    """The best cycle over `members` and its edges."""
    if len(members) == 1:
        return list(members), []
    sub = [[w[a][b] for b in members] for a in members]
    order = [members[i] for i in best_order(sub, cycle=True)]
    edges = [w[a][b] for a, b in zip(order, order[1:] + order[:1], strict=True)]
    return order, edges


def _best_cycle(w, members: Sequence[int]) -> list[tuple[list[int], list[float]]]:
    return [_cycle_edges(w, members)]


def _cycle_orders(w, members: Sequence[int]) -> list[tuple[list[int], list[float]]]:
    """Every cycle over `members` (one direction each) with its edges. Each cycle's own best
    order is not enough: the key is taken over all cycles' edges together, so a cycle that
    keeps a higher minimum of its own where the job's minimum is elsewhere lost total
    bandwidth (hypothesis found 1270 where 1420 was possible, 8 GPUs in rings of 4)."""
    first, rest = members[0], list(members[1:])
    found = []
    for perm in itertools.permutations(rest):
        if len(perm) > 1 and perm[0] > perm[-1]:
            continue  # the same cycle backwards
        order = [first, *perm]
        found.append((order, [w[a][b] for a, b in zip(order, order[1:] + order[:1], strict=True)]))
    return found


ORDERS_LIMIT = 50_000  # every order of every split: 10 GPUs in rings of 5 is 126 x 12 x 12


def _every_order_fits(m: int, n: int) -> bool:
    """Whether every split with every order of each cycle is at most ORDERS_LIMIT
    arrangements (8 GPUs in rings of 4: 35 x 3 x 3); beyond, each cycle's own best order."""
    per_cycle = max(1, math.factorial(n - 1) // 2)
    return _split_count(m, n) * per_cycle ** (m // n) <= ORDERS_LIMIT


def _key(edges: list[float]) -> tuple[float, int, float]:
    if not edges:
        return (math.inf, 0, 0.0)
    low = min(edges)
    return (low, -edges.count(low), sum(edges))


def _split_count(m: int, n: int) -> int:
    return math.factorial(m) // (math.factorial(n) ** (m // n) * math.factorial(m // n))


def partition_cycles(w, members: Sequence[int], n: int) -> list[list[int]]:
    """Split `members` (positions into the matrix w) into cycles of n, best worst-cycle first
    (the key of search.py over all cycles' edges together)."""
    members = list(members)
    if n == 1:
        return [[m] for m in members]
    if _split_count(len(members), n) > PARTITION_LIMIT:
        order = [
            members[i]
            for i in best_order([[w[a][b] for b in members] for a in members], cycle=True)
        ]
        return [_cycle_edges(w, order[i : i + n])[0] for i in range(0, len(order), n)]
    best: tuple | None = None
    orders = _cycle_orders if _every_order_fits(len(members), n) else _best_cycle

    def search(rest: list[int], cycles: list[list[int]], edges: list[float]) -> None:
        nonlocal best
        if not rest:
            key = _key(edges)
            if best is None or key > best[0]:
                best = (key, [list(c) for c in cycles])
            return
        first, others = rest[0], rest[1:]
        for combo in itertools.combinations(others, n - 1):
            left = [m for m in others if m not in combo]
            for cycle, cycle_edges in orders(w, [first, *combo]):
                search(left, [*cycles, cycle], edges + cycle_edges)

    search(members, [], [])
    return best[1]


def choose_layout(
    counts: Sequence[int],
    names: Sequence[str],
    paths: dict[str, list[str]],
    ring_size: int | None,
    nvlink_domain: Sequence[str | None],
) -> Layout:
    """Pick the layout for nodes in depth-first order with `counts` ranks each.

    nvlink_domain[i]: the multi-node NVLink domain of node i, or None."""
    world = sum(counts)
    size = world if ring_size is None else ring_size
    if size < 1 or world % size:
        raise UserError(
            f"--ring-size {size} does not divide the job's {world} ranks into equal rings"
        )
    everyone = list(range(len(counts)))
    if size == world:
        return _path_layout(everyone, size, "flat", nvlink_domain, [everyone])
    if all(c % size == 0 for c in counts):
        roles = {i: NodeRole("cycle" if c == size else "cycles") for i, c in enumerate(counts)}
        return Layout(everyone, roles, size, "inside nodes")
    if len(set(counts)) == 1 and size % counts[0] == 0:
        k = size // counts[0]
        index = {name: i for i, name in enumerate(names)}
        rings = [[index[n] for n in g] for g in pack_nodes(names, paths, k)]
        return _path_layout(
            [i for g in rings for i in g], size, "whole nodes", nvlink_domain, rings
        )
    return _path_layout(everyone, size, "consecutive ranks", nvlink_domain, [everyone])


def _path_layout(sequence, size, kind, domain, rings) -> Layout:
    """Each node a path (or a cycle when alone in its ring), its ends facing its ring
    neighbours."""
    roles: dict[int, NodeRole] = {}
    for ring in rings:
        if len(ring) == 1:
            roles[ring[0]] = NodeRole("cycle")
            continue
        for at, node in enumerate(ring):
            prev, nxt = ring[at - 1], ring[(at + 1) % len(ring)]
            roles[node] = NodeRole("path", _kind(domain, prev, node), _kind(domain, node, nxt))
    return Layout(list(sequence), roles, size, kind)


def _kind(domain: Sequence[str | None], a: int, b: int) -> str:
    return "nvlink" if domain[a] is not None and domain[a] == domain[b] else "net"
