"""The job's schedule, priced: what `ringctl plan JOB` and `ringctl plan --corpus` print.

There is one scheduling policy, the job's (``ringctl/scheduler.py``): it decides, from the
documents' estimated lengths and the job's ``ring.size`` and budget, which ring runs which
document. Here the same function runs on the same lengths, and the planner prices each of its
placements in seconds (``planner/pricing.document_cost``) without changing any: the makespan
printed is that of the schedule the job will run. A ``ring.size=auto`` job without a budget of
its own gets the one submit writes in (``planner/pricing.smallest_budget``).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from .planner.cost import Workload
from .planner.devices import Device
from .planner.pricing import document_cost, lognormal_lengths, smallest_budget
from .rings import divisors
from .scheduler import DocLength, Schedule, priced, schedule_documents

__all__ = ["auto_budget", "corpus_comparison", "price_job"]


def auto_budget(work: Workload, device: Device, world: int, ranks_per_host: int) -> int:
    """The per-rank budget submit writes into a ``ring.size=auto`` job (0: the model alone
    does not fit one device)."""
    return smallest_budget(work, device, divisors(world), ranks_per_host)


def price_job(
    lengths: Sequence[tuple[str, int]],
    *,
    world: int,
    size: int | str | None,
    budget: int | None,
    work: Workload,
    device: Device,
    nodes: int,
    ranks_on_host: int | None = None,
) -> Schedule:
    """The scheduler's schedule of ``(id, tokens)`` documents on a job of ``world`` ranks over
    ``nodes`` nodes, priced in seconds by the planner. A document no ring holds is refused by
    the scheduler (``DocumentTooLong``, a UserError naming it)."""
    docs = [DocLength(i, doc_id, n) for i, (doc_id, n) in enumerate(lengths)]
    schedule = schedule_documents(docs, world=world, size=size, budget=budget, layout=work.layout)
    cost = partial(document_cost, w=work, device=device, nodes=nodes, ranks_on_host=ranks_on_host)
    return priced(schedule, cost)


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
    ranks_on_host: int | None = None,
) -> dict:
    """A seeded log-normal corpus on ``world`` ranks: one ring of the whole job against
    ``ring.size=auto`` under the budget submit would derive, both the job's scheduler, priced:
    makespans, ring sizes used, and the GPU-seconds each spends (what auto saves is the small
    documents' overhead on a big ring). ValueError: auto cannot run (no budget)."""
    lengths = lognormal_lengths(count, low, high, seed)
    listed = [(f"#{i}", n) for i, n in enumerate(lengths)]
    per_host = ranks_on_host or min(world, device.gpus_per_node)
    budget = auto_budget(w, device, world, per_host)
    if budget < 1:
        why = "ring.size=auto cannot run (submit refuses it too)"
        raise ValueError(f"the model alone does not fit one {device.name}: {why}")
    job = partial(
        price_job, listed, world=world, work=w, device=device, nodes=nodes, ranks_on_host=per_host
    )
    one, auto = job(size=None, budget=None), job(size="auto", budget=budget)
    sizes: dict[int, int] = {}
    for e in auto.entries:
        sizes[e.ring_size] = sizes.get(e.ring_size, 0) + 1
    gpu_seconds = {
        name: sum(e.predicted_s * e.ring_size for e in s.entries)
        for name, s in (("one ring", one), ("auto", auto))
    }
    return {
        "documents": count,
        "tokens": sum(lengths),
        "longest": max(lengths),
        "shortest": min(lengths),
        "world": world,
        "device": device.name,
        "mode": w.run_mode,
        "model": w.model.name if w.model else None,
        "one_ring_makespan_s": one.makespan,
        "auto_makespan_s": auto.makespan,
        "speedup": one.makespan / auto.makespan,
        "auto_documents_per_ring_size": dict(sorted(sizes.items())),
        "budget_tokens_per_rank": budget,
        "gpu_seconds": gpu_seconds,
    }
