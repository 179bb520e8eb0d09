"""The planner's side of many rings per job: per-rank token budgets, the cost of one document
on a ring, and the makespan of a schedule.

A job of W ranks runs documents on rings of several sizes. Three things come from here:

* ``max_tokens_per_rank``: the most tokens one rank can hold for this model, device, dtype,
  mode and sharding (the budget ``ring.max_tokens_per_rank`` defaults to);
* ``document_cost``: predicted seconds of one document of n tokens on a ring of a given size:
  the whole-model time when the device has matmul figures (attention ~ n^2 / ring, the rest
  ~ n / ring), else ring attention alone;
* ``predicted_makespan``: the schedule's wall time, phases in order (the rings of a phase run
  concurrently, a phase ends with its slowest ring).

``auto_schedule`` is the reference policy of the scale-out issue (smallest power-of-two ring
that holds each document, longest first to the least-loaded ring of its size, phases from the
largest ring size to the smallest), used for the paper comparison; the job's real scheduler
may differ, and ``predicted_makespan`` prices whatever it writes.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, replace

from .cost import (
    GIB,
    Workload,
    estimate,
    memory_per_rank,
    nominal_link,
    usable_gib,
)
from .devices import Device
from .layout import layout_multiple, padded_length


def max_tokens_per_rank(w: Workload, device: Device, ring_size: int, ranks_on_host: int = 1) -> int:
    """The largest tokens per rank (N / ring_size, in whole layout units) that fit memory.

    Sharding follows ``w.shard`` / ``w.shard_degree`` (default: the ring), so a bigger ring
    also leaves each rank more room for tokens."""
    capacity = usable_gib(device, ranks_on_host) * GIB
    unit = layout_multiple(w.layout, ring_size)

    def fits(units: int) -> bool:
        probe = replace(w, seq_len=units * unit)
        return sum(memory_per_rank(probe, ring_size, device.cores is not None).values()) <= capacity

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi) and hi < 1 << 40:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * unit // ring_size


def document_cost(
    n_tokens: int,
    ring_size: int,
    w: Workload,
    device: Device,
    *,
    nodes: int = 1,
    ranks_on_host: int | None = None,
) -> float:
    """Predicted seconds of one document of ``n_tokens`` on a ring of ``ring_size`` ranks
    (padded to the layout's multiple, as the worker pads it)."""
    per_host = ranks_on_host or min(ring_size, device.gpus_per_node)
    ring_nodes = max(1, math.ceil(ring_size / per_host)) if nodes > 1 else 1
    seq = padded_length(n_tokens, w.layout, ring_size)
    est = estimate(
        replace(w, seq_len=seq),
        ring_size,
        device,
        nominal_link(device, ring_nodes),
        ranks_on_host=per_host,
        overlap_threshold=False,
    )
    if est.model_total_s is not None:
        return est.model_total_s
    return est.total_s.get("forward+backward", est.total_s["forward"])


@dataclass(frozen=True)
class Entry:
    """One document's place in a schedule (what schedule.json records per document)."""

    doc: int
    tokens: int
    ring_size: int
    ring: int  # index of the ring among the rings of its size
    phase: int
    seconds: float


def predicted_makespan(schedule) -> float:
    """Wall seconds of a schedule: for each phase, the most loaded ring's sum of seconds;
    phases run one after the other. Entries are ``Entry`` or dicts with ``seconds``,
    ``ring_size``, ``ring`` (an index among the rings of that size, or the ring's member
    ranks) and optionally ``phase`` (default: one phase per ring size, the largest first)."""
    load: dict[tuple, float] = {}
    for e in schedule:
        get = e.get if isinstance(e, dict) else lambda k, d=None, e=e: getattr(e, k, d)
        size = int(get("ring_size"))
        phase = get("phase")
        ring = get("ring")
        ring = tuple(ring) if isinstance(ring, (list, tuple)) else int(ring)  # index or members
        key = (int(phase) if phase is not None else -size, size, ring)
        load[key] = load.get(key, 0.0) + float(get("seconds"))
    by_phase: dict[int, float] = {}
    for (phase, _, _), seconds in load.items():
        by_phase[phase] = max(by_phase.get(phase, 0.0), seconds)
    return sum(by_phase.values())


def ring_sizes(world: int) -> list[int]:
    """The power-of-two ring sizes that tile a job of ``world`` ranks."""
    return [s for s in (1 << k for k in range(world.bit_length())) if world % s == 0]


def auto_schedule(
    lengths, world: int, w: Workload, device: Device, *, nodes: int = 1, balance: bool = True
) -> list[Entry]:
    """Smallest power-of-two ring that holds each document (the layout's padding included),
    longest first to the least-loaded ring of that size, phases from large rings to small.

    ``balance``: phases run one after another and each lasts at least its longest document,
    so a document that alone outlasts its phase's average ring load moves to the next larger
    ring, until none does: on a corpus of few documents, the smallest ring that *holds* a long
    one can take longer than the rest of the job (see ``corpus_comparison``).

    Raises ValueError naming the first document no ring of the job can hold."""
    sizes = ring_sizes(world)
    budget = {s: max_tokens_per_rank(w, device, s, min(s, device.gpus_per_node)) for s in sizes}
    choice = []
    for doc, n in enumerate(lengths):
        size = next((s for s in sizes if padded_length(n, w.layout, s) // s <= budget[s]), None)
        if size is None:
            raise ValueError(
                f"document {doc}: {n:,} tokens; no ring of this {world}-rank job holds it "
                f"(budget {budget[sizes[-1]]:,} tokens per rank at ring size {sizes[-1]})"
            )
        choice.append(size)
    costs = {}

    def cost(doc: int, size: int) -> float:
        if (doc, size) not in costs:
            costs[doc, size] = document_cost(lengths[doc], size, w, device, nodes=nodes)
        return costs[doc, size]

    while balance and _promote(choice, world, cost):
        pass
    return _place(lengths, choice, world, cost)


def _promote(choice: list[int], world: int, cost) -> bool:
    """Move to the next larger ring every document that alone outlasts its phase's average
    ring load (the phase's GPU-seconds / W); True when any moved. Sizes only grow, so the
    loop that calls this ends."""
    phase_s: dict[int, float] = {}
    for doc, size in enumerate(choice):
        phase_s[size] = phase_s.get(size, 0.0) + cost(doc, size) * size / world
    moved = False
    for doc, size in enumerate(choice):
        if size < world and cost(doc, size) > phase_s[size]:
            choice[doc], moved = 2 * size, True
    return moved


def _place(lengths, choice, world, cost) -> list[Entry]:
    """Phases from the largest ring size down; in each, longest first to the least-loaded."""
    entries: list[Entry] = []
    for phase, size in enumerate(sorted(set(choice), reverse=True)):
        docs = sorted(((lengths[d], d) for d, s in enumerate(choice) if s == size), reverse=True)
        rings = [(0.0, r) for r in range(world // size)]
        for n, doc in docs:
            load, r = heapq.heappop(rings)
            seconds = cost(doc, size)
            entries.append(Entry(doc, n, size, r, phase, seconds))
            heapq.heappush(rings, (load + seconds, r))
    return entries


def single_ring_schedule(
    lengths, world: int, w: Workload, device: Device, *, nodes: int = 1
) -> list[Entry]:
    """Every document on one ring of the whole job, one after the other (today's behaviour)."""
    return [
        Entry(doc, n, world, 0, 0, document_cost(n, world, w, device, nodes=nodes))
        for doc, n in enumerate(lengths)
    ]


def lognormal_lengths(count: int, low: int, high: int, seed: int = 0) -> list[int]:
    """``count`` lengths, log-normal with [low, high] at -/+ 3 sigma, clipped to it."""
    rng = random.Random(seed)
    mu = (math.log(low) + math.log(high)) / 2
    sigma = (math.log(high) - math.log(low)) / 6
    return [int(min(high, max(low, round(rng.lognormvariate(mu, sigma))))) for _ in range(count)]


def corpus_comparison(
    w: Workload,
    device: Device,
    world: int,
    *,
    nodes: int,
    count: int,
    low: int,
    high: int,
    seed: int = 0,
) -> dict:
    """The scale-out issue's paper exercise: a seeded log-normal corpus on ``world`` ranks,
    one ring of the whole job versus ``auto_schedule``; makespans, ring sizes used, and the
    GPU-seconds each spends (what the auto schedule saves is the small documents' overhead
    on a big ring)."""
    lengths = lognormal_lengths(count, low, high, seed)
    one = single_ring_schedule(lengths, world, w, device, nodes=nodes)
    smallest = auto_schedule(lengths, world, w, device, nodes=nodes, balance=False)
    auto = auto_schedule(lengths, world, w, device, nodes=nodes)
    sizes: dict[int, int] = {}
    for e in auto:
        sizes[e.ring_size] = sizes.get(e.ring_size, 0) + 1
    one_s, auto_s = predicted_makespan(one), predicted_makespan(auto)
    return {
        "documents": count, "tokens": sum(lengths), "longest": max(lengths),
        "shortest": min(lengths), "world": world, "device": device.name,
        "mode": w.run_mode, "model": w.model.name if w.model else None,
        "one_ring_makespan_s": one_s, "auto_makespan_s": auto_s, "speedup": one_s / auto_s,
        "smallest_ring_makespan_s": predicted_makespan(smallest),
        "auto_documents_per_ring_size": dict(sorted(sizes.items())),
        "budget_tokens_per_rank": {s: max_tokens_per_rank(w, device, s,
                                                          min(s, device.gpus_per_node))
                                   for s in sorted(sizes)},
        "gpu_seconds": {"one ring": sum(e.seconds * e.ring_size for e in one),
                        "smallest ring": sum(e.seconds * e.ring_size for e in smallest),
                        "auto": sum(e.seconds * e.ring_size for e in auto)},
    }  # fmt: skip
