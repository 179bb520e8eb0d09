"""The layout's padding rule, torch-free: what a sequence is padded to before a ring splits it.

A ring of ``ranks`` ranks splits a sequence into ``ranks`` chunks (contiguous) or ``2 * ranks``
(zigzag: two per rank), so a document is padded up to a multiple of that unit. The engine's own
rule is ``ringattn.padded_length`` (it imports torch; the planner must not); this is the same
rule for the ring layouts, and tests/test_schedule.py checks the two agree. The planner
(``planner.cost``, ``planner.pricing``) and the job's scheduler (``ringctl.scheduler``,
``ringctl.longdoc.job_schedule``) all pad with it.
"""

from __future__ import annotations

__all__ = ["layout_multiple", "padded_length"]


def layout_multiple(layout: str, ranks: int) -> int:
    """What a sequence length must be a multiple of to split over ``ranks`` in ``layout``
    (zigzag: two chunks per rank). The planner prices a hybrid layout as its ring layout over
    all the ranks (N / ring over the ring, then 1/U of that per rank of a Ulysses group)."""
    return ranks * (2 if layout == "zigzag" else 1)


def padded_length(tokens: int, layout: str, ranks: int) -> int:
    """``tokens`` padded up to the layout's multiple on ``ranks`` ranks; at least one unit
    (an empty document still occupies its ring for one step)."""
    unit = layout_multiple(layout, ranks)
    return -(-max(tokens, 1) // unit) * unit
