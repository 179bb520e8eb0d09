"""Many rings in one job: the job's W ranks cut into rings of N consecutive ranks.

Ranks are numbered in placement order (the worker takes its torch rank from its position in
placement.json), so N consecutive ranks sit on the fastest links the placement found: inside
one node or NVLink domain when N fits one. For every ring size a job uses there is one
partition of the ranks, and one torch process group per ring; `ringattn` runs unchanged on
each. `ring.size=W` is the single ring of 0.1.

Sizes: `ring.size: N` (a divisor of W) gives one partition; `auto` gives every divisor of W, and
each document goes to the smallest ring that holds it (`ringctl.scheduler`). ``ring_sizes`` is
the one meaning of "the ring sizes of a job": the planner prices these, no other set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .errors import UserError


def divisors(world: int) -> list[int]:
    """world's divisors, ascending (pairs found up to its square root)."""
    low = [n for n in range(1, math.isqrt(world) + 1) if world % n == 0]
    return sorted({*low, *(world // n for n in low)})


def ring_sizes(world: int, requested: int | str) -> list[int]:
    """The ring sizes a job of `world` ranks uses, ascending."""
    if str(requested) == "auto":
        return divisors(world)
    try:
        size = int(requested)
    except (TypeError, ValueError):
        why = f"expected auto or a number of ranks, got {requested!r}"
        raise UserError(f"ring.size: {why}") from None
    if size < 1 or world % size:
        choices = ", ".join(map(str, divisors(world)))
        raise UserError(
            f"ring.size: {size} does not divide the job's {world} ranks (choose one of {choices})"
        )
    return [size]


@dataclass(frozen=True)
class Ring:
    """One ring: its size, its index among the rings of that size, and its member ranks."""

    size: int
    index: int

    @property
    def members(self) -> list[int]:
        return list(range(self.index * self.size, (self.index + 1) * self.size))

    def rank_in_ring(self, rank: int) -> int:
        return rank - self.index * self.size


def ring_of(rank: int, size: int) -> Ring:
    return Ring(size, rank // size)


def rings_of_size(world: int, size: int) -> list[Ring]:
    return [Ring(size, i) for i in range(world // size)]


@dataclass
class RingGroups:
    """The process group of every ring this rank is in, one per ring size.

    torch requires every rank to call `new_group` for every group, in the same order, so all
    partitions are created here at start (W/N groups per size N; sum over sizes <= 2W)."""

    world: int
    rank: int
    sizes: list[int]
    _groups: dict[int, Any] = field(default_factory=dict)

    @classmethod
    def create(cls, world: int, rank: int, sizes: list[int], timeout=None) -> RingGroups:
        import torch.distributed as dist

        made = cls(world, rank, sorted(sizes))
        for size in made.sizes:
            if size == world:
                made._groups[size] = dist.group.WORLD
                continue
            for ring in rings_of_size(world, size):
                group = dist.new_group(ring.members, timeout=timeout)  # TaskContext.timeout
                if rank in ring.members:
                    made._groups[size] = group
        return made

    def ring(self, size: int) -> Ring:
        return ring_of(self.rank, size)

    def group(self, size: int):
        return self._groups[size]


def ulysses_degree(
    requested,
    *,
    placement=None,
    ranks_per_node: int,
    world: int,
    heads: int | None = None,
    kv_heads: int | None = None,
) -> int:
    """The Ulysses degree a job runs with: the placement's (it saw the NVLink domains), else
    the number asked for, else for `auto` the largest count of one node's ranks that divides
    the job and that the heads allow (the planner's one rule, ``cost.ulysses_problem``).
    A placement that disagrees with an explicit number is refused by name."""
    from ringattn.geometry import ulysses_problem

    chosen = getattr(getattr(placement, "ulysses", None), "degree", None)
    if chosen is not None:
        if isinstance(requested, int) and requested != chosen:
            raise UserError(
                f"ring.ulysses: {requested} was asked, but placement.json groups {chosen} ranks"
            )
        return int(chosen)
    if requested in (None, 1):
        return 1
    if isinstance(requested, int):
        return requested
    for u in sorted(divisors(ranks_per_node), reverse=True):
        if world % u or (heads and ulysses_problem(u, world, heads, kv_heads or heads)):
            continue
        return u
    return 1
