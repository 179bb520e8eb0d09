"""The Ulysses degree of a hybrid job, from its NVLink domains and its model's heads.

A hybrid job (``ringattn.hybrid_attention``) trades the sequence shard for a head shard with one
all-to-all inside each *Ulysses group* of U ranks, then runs the ring across the groups. The
all-to-all moves (U-1)/U of q, k, v and the output on every layer, on the critical path, so a
group must sit inside one NVLink domain: one node, or one multi-node NVLink block (GB200/GB300
NVL72, `--nvlink-blocks`). An all-to-all is as fast as its slowest pair (every member sends to
every other), which is why a group that must be a part of a node takes the GPUs whose worst
mutual link is best (`partition_cliques`), not a good ring.

The degree:

* ``N`` (given): must divide the ranks of every domain (hence the world); with ``heads``, it
  must also suit them (below). Anything else is refused by name.
* ``auto``: the largest U that divides the ranks of every domain, that the heads allow and
  whose groups are NVLink inside: U divides the query heads H and either U divides the kv
  heads K (each member gets K/U of them) or K divides U (kv heads replicated across the group,
  as the engine does for MQA); a node whose GPUs are NVLink pairs joined by PCIe or a socket
  link offers groups of a pair, not the node. 1 (the ring alone) when none above 1 fits. The
  reason goes into the plan and the report.

Domains are runs of consecutive nodes in placement order (the switch walk keeps a block's nodes
together), so the Ulysses groups are consecutive ranks: ``ringattn.hybrid_groups(U)``'s groups.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import UserError
from .groups import PARTITION_LIMIT
from .search import best_order

__all__ = ["Domain", "choose_degree", "domain_runs", "heads_allow", "partition_cliques"]


@dataclass(frozen=True)
class Domain:
    """One NVLink domain of the job: a node, or the nodes of one NVLink block."""

    name: str
    kind: str  # "node" | "nvlink block"
    nodes: tuple[int, ...]  # indices into the ordered nodes
    ranks: int

    def describe(self) -> str:
        return f"node {self.name}" if self.kind == "node" else f"NVLink block {self.name}"


def domain_runs(
    names: Sequence[str], counts: Sequence[int], blocks: Sequence[str | None]
) -> list[Domain]:
    """The domains of nodes in placement order: a node by itself unless `blocks[i]` names its
    NVLink block. A block whose nodes are not consecutive cannot hold consecutive-rank groups
    and is refused."""
    out: list[Domain] = []
    seen: set[str] = set()
    for block, run in itertools.groupby(range(len(names)), key=lambda i: blocks[i]):
        run = list(run)
        if block is None:
            out.extend(Domain(names[i], "node", (i,), counts[i]) for i in run)
            continue
        if block in seen:
            raise UserError(
                f"NVLink block {block}: its nodes are not consecutive in the switch order, so "
                "a Ulysses group of consecutive ranks cannot stay inside it"
            )
        seen.add(block)
        out.append(Domain(block, "nvlink block", tuple(run), sum(counts[i] for i in run)))
    return out


def heads_allow(degree: int, heads: int, kv_heads: int) -> str | None:
    """Why `degree` does not suit the heads, or None when it does: the planner's one rule
    (``cost.ulysses_problem``, the engine's), asked of the heads alone (the callers check
    the ranks against the domains, with their own words)."""
    from ringattn.geometry import ulysses_problem

    why = ulysses_problem(degree, degree, heads, kv_heads)
    return f"{degree} {why}" if why else None


def _check_heads(heads: int | None, kv_heads: int | None) -> tuple[int, int] | None:
    if heads is None:
        if kv_heads is not None:
            raise UserError("--kv-heads needs --heads")
        return None
    kv = heads if kv_heads is None else kv_heads
    if heads < 1 or kv < 1:
        raise UserError(f"--heads {heads} and --kv-heads {kv} must be positive")
    if heads % kv:
        raise UserError(f"--heads {heads} is not a multiple of --kv-heads {kv}")
    return heads, kv


def choose_degree(
    requested: int | str,
    domains: Sequence[Domain],
    heads: int | None,
    kv_heads: int | None,
    nvlink: Callable[[int], str | None] = lambda u: None,
) -> tuple[int, str]:
    """(U, the reason for it); UserError when the requested degree cannot be placed.

    `nvlink(u)`: why groups of u would not be all NVLink inside (a node whose GPUs are NVLink
    pairs across a socket link, say), or None; `auto` skips such degrees, a given N is kept
    (the report shows its slowest pair)."""
    model = _check_heads(heads, kv_heads)
    world = sum(d.ranks for d in domains)
    if requested == "auto":
        if model is None:
            raise UserError("--ulysses auto needs --heads (and --kv-heads for GQA/MQA models)")
        return _auto(domains, *model, nvlink)
    if not isinstance(requested, int) or requested < 1:
        raise UserError(f"--ulysses {requested}: expected auto or a positive integer")
    if world % requested:
        raise UserError(f"--ulysses {requested} does not divide the job's {world} ranks")
    for d in domains:
        if d.ranks % requested:
            raise UserError(
                f"--ulysses {requested} does not divide the {d.ranks} ranks of {d.describe()}: "
                "a Ulysses group must sit inside one NVLink domain"
            )
    if model is not None and (why := heads_allow(requested, *model)):
        raise UserError(f"--ulysses {requested}: {why}")
    heads_note = f"; heads {model[0]}, kv heads {model[1]} allow it" if model else ""
    return requested, f"given (--ulysses {requested}){heads_note}"


def _auto(domains: Sequence[Domain], heads: int, kv_heads: int, nvlink) -> tuple[int, str]:
    size = math.gcd(*(d.ranks for d in domains))
    sizes = sorted({d.ranks for d in domains})
    where = (
        f"the {size} ranks of one {'node' if domains[0].kind == 'node' else 'NVLink block'}"
        if len(sizes) == 1
        else f"{size}, the largest divisor of every domain's ranks ({', '.join(map(str, sizes))})"
    )
    model = f"{heads} heads, {kv_heads} kv heads"

    def why_not(u: int) -> str | None:
        return heads_allow(u, heads, kv_heads) or nvlink(u)

    chosen = next(u for u in range(size, 0, -1) if size % u == 0 and not why_not(u))
    if chosen == size:
        return size, f"auto: {where} ({model} allow it)"
    refused = why_not(size)
    if chosen == 1:
        return 1, (
            f"auto: 1, the ring alone: no degree above 1 that divides {where} suits the "
            f"{model} and the links ({refused})"
        )
    return chosen, (
        f"auto: {chosen}, not {where}: {refused}; {chosen} is the largest divisor of {size} "
        f"that the {model} and the links allow"
    )


def _clique_key(w, groups: Sequence[Sequence[int]]) -> tuple[float, int, float]:
    edges = [w[a][b] for g in groups for a, b in itertools.combinations(g, 2)]
    if not edges:
        return (math.inf, 0, 0.0)
    low = min(edges)
    return (low, -edges.count(low), sum(edges))


def partition_cliques(w, members: Sequence[int], n: int) -> list[list[int]]:
    """Split `members` (positions into the symmetric matrix w) into groups of n whose worst
    pair is best, then with the fewest pairs at that worst, then the most bandwidth: every
    pair of a group talks in an all-to-all. Exhaustive up to PARTITION_LIMIT splits; beyond,
    runs of n along the best cycle (neighbours on it are well linked)."""
    members = list(members)
    if n == 1 or n == len(members):
        return [[m] for m in members] if n == 1 else [members]
    splits = math.factorial(len(members)) // (
        math.factorial(n) ** (len(members) // n) * math.factorial(len(members) // n)
    )
    if splits > PARTITION_LIMIT:
        sub = [[w[a][b] for b in members] for a in members]
        order = [members[i] for i in best_order(sub, cycle=True)]
        return [order[i : i + n] for i in range(0, len(order), n)]
    best: tuple | None = None

    def search(rest: list[int], groups: list[list[int]]) -> None:
        nonlocal best
        if not rest:
            key = _clique_key(w, groups)
            if best is None or key > best[0]:
                best = (key, [list(g) for g in groups])
            return
        first, others = rest[0], rest[1:]
        for combo in itertools.combinations(others, n - 1):
            search([m for m in others if m not in combo], [*groups, [first, *combo]])

    search(members, [])
    return best[1]
