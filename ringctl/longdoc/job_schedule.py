"""The long-document job's schedule: its documents' lengths into `ringctl.scheduler`, and
schedule.json.

Every rank computes the same schedule from the same inputs, with no coordinator:

* **Lengths** are estimated without tokenising the corpus (`longdoc.lengths`, the estimator
  submit and plan use too): a document's size in bytes, divided by the bytes per token every
  rank measures on the same small sample with the job's tokenizer (1 for bytes).
* **Ring sizes** come from `ring.size`: null (one ring of the whole job, in input order: the
  behaviour of 0.1), N (W/N rings of N ranks) or auto (every divisor of W, each document on
  the smallest ring that holds it under `ring.max_tokens_per_rank`); the policy is the
  scheduler's (`ringctl/scheduler.py`), which `ringctl plan` prices.

`schedule.json` in the job directory (written and read by ``ringctl.scheduler``, its owner)
records, per document, its ring size, members, order, predicted cost and input; `ringctl
status` reads the rings' progress files beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..scheduler import DocLength, Schedule, schedule_documents, write_schedule
from .documents import Document
from .lengths import estimated_tokens, sampled_bytes_per_token


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
    """The schedule of `docs` (the ones still to do) on this job's rings: the scheduler's
    (``ringctl.scheduler.schedule_documents``) on the lengths refined by the tokenizer."""
    tokens = estimated_tokens(docs, sampled_bytes_per_token(docs, tokenizer))
    lengths = [DocLength(i, doc.id, n) for i, (doc, n) in enumerate(zip(docs, tokens, strict=True))]
    return schedule_documents(
        lengths, world=world, size=options.size, budget=options.max_tokens_per_rank, layout=layout
    )


def write_job_schedule(path: Path, schedule: Schedule, docs: list[Document]) -> None:
    """schedule.json (``scheduler.write_schedule``), each document with its input."""
    for entry in schedule.entries:
        entry.source = docs[entry.index].source
    write_schedule(path, schedule)
