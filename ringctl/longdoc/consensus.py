"""Decisions every rank must take alike, taken together.

A rank never goes one way while a peer goes another (that peer would wait on a collective
forever): each contributes its view through one small collective, and all act on the union.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


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


def agreed_listing(signature: str, *, refused: bool = False, group=None) -> str:
    """``signature`` (this rank's ``listing_signature``) once every rank of ``group`` has the
    same. Each rank lists the inputs on its own, and ranks that saw different documents (a
    file still arriving, a shared filesystem's cached listing) packed different training
    streams and divided by different token counts, the job ending well; a scoring job's ranks
    waited for each other in different documents until the collective timeout. Gathered
    from every rank, so every rank refuses alike, in the same words (none waits for the
    others). ``refused``: this rank's
    listing failed and ``signature`` is why (no documents, an unreadable input); raised on
    every rank, where a rank that refused alone left the others waiting in the gather."""
    said: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(said, (refused, signature), group=group)
    refused = next(((r, s) for r, (no, s) in enumerate(said) if no), None)
    if refused is not None:
        raise ValueError(f"rank {refused[0]}: {refused[1]}")
    said = [s for _, s in said]
    other = next((r for r, s in enumerate(said) if s != said[0]), None)
    if other is None:
        return signature

    def count(sig: str) -> str:
        return sig.split(":", 1)[0]

    raise ValueError(
        f"the ranks listed different input documents (task.inputs): rank 0 "
        f"{count(said[0])} documents ({said[0]}), rank {other} {count(said[other])} "
        f"({said[other]}): the inputs changed while the job started (a file still arriving, "
        "a shared filesystem's cached listing); run it again once they are complete"
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
