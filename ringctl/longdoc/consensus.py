"""Decisions every rank must take alike, taken together.

A rank never goes one way while a peer goes another (that peer would wait on a collective
forever): each contributes its view through one small collective, and all act on the union.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import UserError
from .inputs.documents import Listing, listing_signature


def agree(error: str, group) -> None:
    """Raise on every rank if any rank has an error (the first one, naming its rank)."""
    world = dist.get_world_size(group)
    if world == 1:
        if error:
            raise RuntimeError(error)
        return
    every: list[str] = [""] * world
    dist.all_gather_object(every, error, group=group)
    for r, e in enumerate(every):
        if e:
            raise RuntimeError(e if r == dist.get_rank(group) else f"rank {r}: {e}")


def from_lead(value, group):
    """Rank 0's ``value`` (of ``group``) on every rank of it: one object broadcast."""
    if dist.get_world_size(group) == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    return box[0]


READ_RATE_FLOOR = 20e6  # bytes a second: a slow shared filesystem's cold read
READ_WAIT_FLOOR_S = 600.0


def from_lead_reading(compute: Callable[[], Any], nbytes: int, group=None) -> Any:
    """``compute()`` on the group's rank 0 (which reads ``nbytes`` of files: it hashes the
    model's weights) and its value on every rank. The others wait in a group of their own
    whose timeout covers that read at READ_RATE_FLOOR: under the job's collective timeout
    (300 s by default) a model of 140 GB, two minutes of hashing from page cache and more
    from a cold shared filesystem, failed every job at start and at each resume ("Timed out
    waiting ... for recv"). The group is of the job's own backend (a gloo mesh beside NCCL
    would need gloo to reach every node, GLOO_SOCKET_IFNAME unset), made by the group's
    members alone; whatever rank 0's read raises is raised on every rank."""
    if dist.get_world_size(group) == 1:
        return compute()
    failure = None
    with patient_group(nbytes, group) as patient:
        lead = dist.get_global_rank(group, 0) if group is not None else 0
        box: list = [None]
        if dist.get_rank() == lead:
            try:
                box = [("ok", compute())]
            except BaseException as err:  # the others must not wait for a broadcast never sent
                failure = err
                box = [("failed", _kind_of(err).__name__, str(err))]
        dist.broadcast_object_list(box, src=lead, group=patient)
    if failure is not None:
        raise failure  # rank 0's own, with its traceback
    if box[0][0] == "failed":
        raise _RAISED[box[0][1]](box[0][2])
    return box[0][1]


@contextlib.contextmanager
def patient_group(nbytes: int, group=None) -> Iterator:
    """The ranks of ``group`` again, in a group whose collectives wait as long as reading
    ``nbytes`` takes at READ_RATE_FLOOR (past the job's collective timeout), of the job's
    own backend (a gloo mesh beside NCCL would need gloo to reach every node), made by the
    group's members alone. Its members make it together, before the read."""
    members = dist.get_process_group_ranks(group) if group is not None else None
    patient = dist.new_group(
        members,
        timeout=timedelta(seconds=READ_WAIT_FLOOR_S + nbytes / READ_RATE_FLOOR),
        use_local_synchronization=members is not None,  # a subgroup's ranks only
    )
    try:
        yield patient
    finally:
        dist.destroy_process_group(patient)


_RAISED = {kind.__name__: kind for kind in (OSError, ValueError, RuntimeError)}


def _kind_of(err: BaseException) -> type:
    """The kind the other ranks raise for rank 0's error (built from its message alone: a
    JSONDecodeError cannot be)."""
    return next((kind for kind in _RAISED.values() if isinstance(err, kind)), RuntimeError)


def agreed_inputs(list_inputs: Callable[[], Listing], group=None) -> tuple[Listing, str]:
    """(this rank's listing, its ``listing_signature``) once every rank of ``group`` listed
    the same documents. Each rank lists the inputs on its own, and ranks that saw different
    documents (a file still arriving, a shared filesystem's cached listing) packed different
    training streams and divided by different token counts, the job ending well; a scoring
    job's ranks waited for each other in different documents until the collective timeout.
    Gathered from every rank, so every rank refuses alike (ValueError), in the same words:
    a listing that failed on one rank (no documents, an unreadable input, a file removed
    while its folder was walked) is raised on every rank, where a rank that refused alone
    left the others waiting in the gather. The one rule of both jobs."""
    try:
        listing = list_inputs()
        mine, refused = listing_signature(listing.documents), False
    except (UserError, ValueError, OSError) as err:
        listing, mine, refused = None, str(err), True
    said: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(said, (refused, mine), group=group)
    failed = next(((r, s) for r, (no, s) in enumerate(said) if no), None)
    if failed is not None:
        raise ValueError(f"rank {failed[0]}: {failed[1]}")
    signatures = [s for _, s in said]
    other = next((r for r, s in enumerate(signatures) if s != signatures[0]), None)
    if other is None:
        assert listing is not None
        return listing, mine

    def count(sig: str) -> str:
        return sig.split(":", 1)[0]

    first, theirs = signatures[0], signatures[other]
    raise ValueError(
        f"the ranks listed different input documents (task.inputs): rank 0 "
        f"{count(first)} documents ({first}), rank {other} {count(theirs)} ({theirs}): the "
        "inputs changed while the job started (a file still arriving, a shared filesystem's "
        "cached listing); run it again once they are complete"
    )


def all_have(flags: list[bool], group, device) -> list[bool]:
    """Element-wise AND of every rank's flags (e.g. "my entry for this document is valid")."""
    have = torch.tensor(flags, dtype=torch.int64, device=device)
    if dist.get_world_size(group) > 1 and len(flags):
        dist.all_reduce(have, op=dist.ReduceOp.MIN, group=group)
    return [bool(h) for h in have.cpu().tolist()]


def any_has(flags: list[bool], group, device) -> list[bool]:
    """Element-wise OR of every rank's flags (e.g. "I checked this document: complete")."""
    have = torch.tensor(flags, dtype=torch.int64, device=device)
    if dist.get_world_size(group) > 1 and len(flags):
        dist.all_reduce(have, op=dist.ReduceOp.MAX, group=group)
    return [bool(h) for h in have.cpu().tolist()]


@dataclass
class DocumentVerdict:
    """What the ranks decided about the next document."""

    action: str  # "run" | "stop" (a rank was asked to stop) | "missing" (a rank cannot read it)
    unreadable_ranks: list[int]


def document_verdict(
    doc_id: str, stop: bool, n_tokens: int | None, crc: int, group, device
) -> DocumentVerdict:
    """One all_gather of (stop?, token count, checksum) per document; ``n_tokens=None``: this
    rank could not read it. Ranks that tokenised different sequences fail the job."""
    world = dist.get_world_size(group)
    n = -1 if n_tokens is None else int(n_tokens)
    mine = torch.tensor([int(stop), n, crc if n_tokens is not None else -1], device=device)
    every = [mine]
    if world > 1:
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine, group=group)
    rows = [[int(x) for x in e.cpu().tolist()] for e in every]
    if any(r[0] for r in rows):
        return DocumentVerdict("stop", [])
    gone = [rank for rank, r in enumerate(rows) if r[1] == -1]
    if gone:
        return DocumentVerdict("missing", gone)
    if len({(r[1], r[2]) for r in rows}) > 1:
        detail = ", ".join(f"rank {rank}: {r[1]} tokens" for rank, r in enumerate(rows))
        raise RuntimeError(
            f"{doc_id}: ranks tokenised different token sequences ({detail}, or different "
            "contents): do they read the same file and tokenizer?"
        )
    return DocumentVerdict("run", [])
