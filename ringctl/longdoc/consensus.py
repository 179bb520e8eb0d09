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
