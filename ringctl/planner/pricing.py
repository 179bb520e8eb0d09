"""Pricing: the planner's side of many rings per job: per-rank token budgets, the cost of one
document on a ring, and the makespan of a schedule. It prices; it does not schedule.

A job of W ranks runs documents on rings of several sizes, placed by the job's one scheduler
(``ringctl/scheduler.py``, outside the planner, which also owns schedule.json and the
makespan of a schedule). Three things come from here:

* ``max_tokens_per_rank``: the most tokens one rank can hold for this model, device, dtype,
  mode and sharding (the budget ``ring.max_tokens_per_rank`` defaults to);
* ``document_cost``: predicted seconds of one document of n tokens on a ring of a given size:
  the whole-model time when the device has matmul figures (attention ~ n^2 / ring, the rest
  ~ n / ring), else ring attention alone; ``packed_cost``: the same for a packed sequence,
  its attention priced by its visible pairs (the sum over its documents);
* ``lognormal_lengths``: a seeded corpus for `ringctl plan --corpus`.

`ringctl plan JOB` and `--corpus` price the scheduler's own schedule with ``document_cost``
(``ringctl/makespan.py``).
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

from ringattn.geometry import layout_multiple, padded_length, prefix_keys

from .cost import (
    GIB,
    Workload,
    estimate,
    memory_per_rank,
    nominal_link,
    usable_gib,
)
from .devices import Device


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


def smallest_budget(w: Workload, device: Device, sizes, ranks_per_host: int) -> int:
    """The per-rank budget every ring size in ``sizes`` holds: the smallest of
    ``max_tokens_per_rank`` over them (one budget for the job, as ``ring.max_tokens_per_rank``
    is one number). ``ranks_per_host``: the job's ranks on a host, which share it whatever
    the ring size (``Sizing.ranks_on_host``)."""
    return min(max_tokens_per_rank(w, device, n, ranks_per_host) for n in sizes)


def _ring_estimate(w: Workload, seq: int, ring_size: int, device: Device, nodes: int, per_host):
    per_host = per_host or min(ring_size, device.gpus_per_node)
    ring_nodes = max(1, math.ceil(ring_size / per_host)) if nodes > 1 else 1
    return estimate(
        replace(w, seq_len=seq),
        ring_size,
        device,
        nominal_link(device, ring_nodes),
        ranks_on_host=per_host,
        overlap_threshold=False,
    )


def _attention_s(est) -> float:
    return est.total_s.get("forward+backward", est.total_s["forward"])


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
    seq = padded_length(n_tokens, world_size=ring_size, layout=w.layout)
    est = _ring_estimate(w, seq, ring_size, device, nodes, ranks_on_host)
    return est.model_total_s if est.model_total_s is not None else _attention_s(est)


def packed_cost(
    lengths: list[int],
    ring_size: int,
    w: Workload,
    device: Device,
    *,
    nodes: int = 1,
    ranks_on_host: int | None = None,
) -> float:
    """Predicted seconds of one packed sequence of documents ``lengths`` on a ring: the
    projections, MLP and head of all its tokens, and its attention priced by its visible
    pairs, the sum over its documents (under the model's window), as the attention of one
    document with as many pairs (a packed ring computes no pair across documents)."""
    tokens = max(1, sum(lengths))
    window = w.window if w.window is not None else (w.model.window if w.model else None)
    pairs = sum(prefix_keys(n, window) for n in lengths)
    alike = max(1, math.ceil((math.sqrt(8 * pairs + 1) - 1) / 2))  # n(n + 1) / 2 >= pairs
    plain = replace(w, window=None, model=replace(w.model, window=None) if w.model else None)
    whole = _ring_estimate(w, tokens, ring_size, device, nodes, ranks_on_host)
    attention = _attention_s(_ring_estimate(plain, alike, ring_size, device, nodes, ranks_on_host))
    if whole.model_total_s is None:
        return attention
    return whole.model_total_s - _attention_s(whole) + attention


def lognormal_lengths(count: int, low: int, high: int, seed: int = 0) -> list[int]:
    """``count`` lengths, log-normal with [low, high] at -/+ 3 sigma, clipped to it."""
    rng = random.Random(seed)
    mu = (math.log(low) + math.log(high)) / 2
    sigma = (math.log(high) - math.log(low)) / 6
    return [int(min(high, max(low, round(rng.lognormvariate(mu, sigma))))) for _ in range(count)]
