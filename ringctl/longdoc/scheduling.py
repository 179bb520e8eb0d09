"""Which ring of the job scores which document: the long-document side of `ringctl.schedule`.

Every rank computes the same schedule from the same inputs, with no coordinator:

* **Lengths** are estimated without tokenising the corpus (`longdoc.lengths`, the estimator
  submit and plan use too): a document's size in bytes, divided by the bytes per token every
  rank measures on the same small sample with the job's tokenizer (1 for bytes).
* **Ring sizes** come from `ring.size`: null (one ring of the whole job, in input order: the
  behaviour of 0.1), N (W/N rings of N ranks) or auto (every divisor of W, each document on
  the smallest ring that holds it under `ring.max_tokens_per_rank`).

`schedule.json` in the job directory records, per document, its ring size, members, order
and predicted cost; `ringctl status` reads the rings' progress files beside it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..atomic import atomic_write_json
from ..rings import ring_sizes
from ..schedule import DocLength, Schedule, build_schedule
from .documents import Document
from .lengths import estimated_tokens, sampled_bytes_per_token

UNLIMITED = 1 << 62


@dataclass(frozen=True)
class RingOptions:
    """The job's `ring.size` and `ring.max_tokens_per_rank`."""

    size: int | str | None = None
    max_tokens_per_rank: int | None = None

    @classmethod
    def of(cls, cfg) -> RingOptions:
        ring = getattr(cfg, "ring", None)
        if ring is None:
            return cls()
        return cls(ring.get("size"), ring.get("max_tokens_per_rank"))


def plan_schedule(
    docs: list[Document], options: RingOptions, *, world: int, layout: str, tokenizer
) -> Schedule:
    """The schedule of `docs` (the ones still to do) on this job's rings."""
    sizes = ring_sizes(world, options.size if options.size is not None else world)
    budget = options.max_tokens_per_rank
    if budget is None and len(sizes) > 1:
        raise ValueError(
            "ring.size=auto needs a per-rank token budget: set ring.max_tokens_per_rank "
            "(`ringctl plan JOB` suggests one for the job's device and model)"
        )
    ratio = sampled_bytes_per_token(docs, tokenizer)
    tokens = estimated_tokens(docs, ratio)
    lengths = [DocLength(i, doc.id, n) for i, (doc, n) in enumerate(zip(docs, tokens, strict=True))]
    kwargs = {"world": world, "sizes": sizes, "layout": layout}
    if sizes == [world] and budget is None:  # the single ring of 0.1: input order
        return build_schedule(lengths, budget=UNLIMITED, cost=_same_cost, **kwargs)
    return build_schedule(lengths, budget=int(budget or UNLIMITED), **kwargs)


def _same_cost(tokens: int, size: int) -> float:
    """Every document the same: on one ring, the schedule keeps the input order."""
    return 1.0


def schedule_record(schedule: Schedule, docs: list[Document]) -> dict:
    record = schedule.to_dict()
    for row in record["documents"]:
        row["source"] = docs[row["index"]].source
    return record


def write_schedule(path: Path, schedule: Schedule, docs: list[Document]) -> None:
    atomic_write_json(path, schedule_record(schedule, docs))


def read_schedule(path: Path) -> dict | None:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "documents" in data else None
