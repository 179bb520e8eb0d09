"""The long-document job's schedule: how long each document is before anyone tokenises it,
which ring runs it, and schedule.json.

Lengths (the one length estimator): `ringctl submit` (is there a ring that holds each
document?), `ringctl plan JOB` (the schedule's makespan) and the job itself (which ring runs
which document) all size documents with ``estimated_tokens``: a document's UTF-8 bytes divided
by ``bytes_per_token``.

* ``bytes_per_token=1`` (submit and plan): a document's size in bytes. Exact for the byte-level
  tokenizer; for a model's tokenizer (BPE or SentencePiece, each token at least one byte of
  text) an upper bound on its text's tokens, so a document that passes the check fits, and a
  predicted makespan errs long. Nothing is loaded: no tokenizer, no torch.
* ``bytes_per_token=sampled_bytes_per_token(docs, tokenizer)`` (the job, once its tokenizer
  is loaded): every rank tokenises the same small sample (the first documents, up to
  ``SAMPLE_BYTES``) and divides by its bytes per token, a closer estimate. The ring that runs
  a document tokenises it for real, and one whose real length no longer fits its ring's
  budget fails the job by name rather than running out of memory. A document whose estimate
  picks a ring its bytes would not fit is counted for real first (``scheduled_tokens``).

The schedule: every rank computes the same one from the same inputs, with no coordinator.
Ring sizes come from `ring.size`: null (one ring of the whole job, in input order), N (W/N
rings of N ranks) or auto (every divisor of W, each document on the smallest ring that holds
it under `ring.max_tokens_per_rank`); the policy is the scheduler's (`ringctl/scheduler.py`),
which `ringctl plan` prices. `schedule.json` in the job directory (written and read by
``ringctl.scheduler``, its owner) records, per document, its ring size, members, order,
predicted cost and input; `ringctl status` reads the rings' progress files beside it.

Torch-free: the tokenizer is only called (``encode(raw)`` returns a sequence of ids).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..rings import ring_sizes
from ..scheduler import DocLength, Schedule, schedule_documents, write_schedule
from .inputs.documents import Document

__all__ = [
    "SAMPLE_BYTES",
    "RingOptions",
    "document_bytes",
    "estimated_tokens",
    "input_indices",
    "plan_schedule",
    "sampled_bytes_per_token",
    "scheduled_tokens",
    "write_job_schedule",
]

SAMPLE_BYTES = 256 * 1024


def document_bytes(doc: Document) -> int:
    """The document's size in bytes (0 for a file gone since it was listed)."""
    try:
        return doc.nbytes
    except OSError:
        return 0


def estimated_tokens(docs: Sequence[Document], bytes_per_token: float = 1.0) -> list[int]:
    """Tokens per document, in order: ceil(bytes / ``bytes_per_token``); see the module
    docstring for which ratio each caller passes and why."""
    return [int(-(-document_bytes(doc) // bytes_per_token)) for doc in docs]


def sampled_bytes_per_token(docs: Sequence[Document], tokenizer) -> float:
    """1 for the byte tokenizer; else bytes per token measured on the same sample on every
    rank (4 when nothing could be read)."""
    if getattr(tokenizer, "name", None) == "bytes":
        return 1.0
    raw_bytes = tokens = 0
    for doc in docs:
        if raw_bytes >= SAMPLE_BYTES:
            break
        try:
            raw = doc.read_bytes()[:SAMPLE_BYTES]
        except (OSError, ValueError):
            continue
        raw_bytes += len(raw)
        tokens += len(tokenizer.encode(raw))
    return raw_bytes / tokens if tokens else 4.0


def scheduled_tokens(
    docs: Sequence[Document], options: RingOptions, *, world: int, layout: str, tokenizer
) -> list[int]:
    """Each document's length for the schedule: the sampled estimate, and the real count
    (tokenised here, on every rank alike) of a document whose estimate picks a ring that its
    bytes, the bound, would not fit, or fits no ring (refused by its real length only). One
    ratio for the whole corpus put a document of dense punctuation (1,157 tokens, estimated
    390) on a ring holding 700 a rank: it ran 65% over the budget unsaid, an out-of-memory on
    a GPU. Only such documents are read twice."""
    from ringattn.geometry import ring_holds  # the ringattn package imports torch

    ratio = sampled_bytes_per_token(docs, tokenizer)
    tokens = estimated_tokens(docs, ratio)
    budget = options.max_tokens_per_rank
    if ratio == 1.0 or budget is None:  # bytes are the tokens, or one ring takes any length
        return tokens
    sizes = ring_sizes(world, options.size if options.size is not None else world)
    for i, doc in enumerate(docs):
        ring = next((r for r in sizes if ring_holds(tokens[i], r, int(budget), layout)), None)
        if ring is None or not ring_holds(document_bytes(doc), ring, int(budget), layout):
            try:
                tokens[i] = len(tokenizer.encode(doc.read_bytes()))
            except (OSError, ValueError):  # gone since listed: its ring says so when reached
                continue
    return tokens


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


def input_indices(docs: Sequence[Document], listing: Sequence[Document]) -> list[int]:
    """Each of ``docs``' position in ``listing`` (the job's input order), found by id (ids are
    unique in a listing): the index a schedule entry carries. On a resume ``docs`` are the
    documents left, and their own positions (once used) named other documents' inputs."""
    position = {doc.id: i for i, doc in enumerate(listing)}
    missing = [doc.id for doc in docs if doc.id not in position]
    if missing:
        raise ValueError(f"document {missing[0]!r} is not in the job's listing")
    return [position[doc.id] for doc in docs]


def plan_schedule(
    docs: list[Document],
    options: RingOptions,
    *,
    world: int,
    layout: str,
    tokenizer,
    listing: Sequence[Document] | None = None,
) -> Schedule:
    """The schedule of `docs` (the ones still to do) on this job's rings: the scheduler's
    (``ringctl.scheduler.schedule_documents``) on the lengths refined by the tokenizer. Each
    entry's index is the document's position in ``listing``, the job's whole input listing
    (``input_indices``; default `docs` itself, as on a first run): look documents up there."""
    tokens = scheduled_tokens(docs, options, world=world, layout=layout, tokenizer=tokenizer)
    indices = input_indices(docs, docs if listing is None else listing)
    lengths = [DocLength(i, doc.id, n) for i, doc, n in zip(indices, docs, tokens, strict=True)]
    return schedule_documents(
        lengths, world=world, size=options.size, budget=options.max_tokens_per_rank, layout=layout
    )


def write_job_schedule(path: Path, schedule: Schedule, docs: Sequence[Document]) -> None:
    """schedule.json (``scheduler.write_schedule``), each document with its input (found by
    id among ``docs``: the listing, or the documents scheduled)."""
    source = {doc.id: doc.source for doc in docs}
    for entry in schedule.entries:
        entry.source = source[entry.doc_id]
    write_schedule(path, schedule)
