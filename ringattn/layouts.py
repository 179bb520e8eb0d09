"""How a global sequence is cut into per-rank shards.

Two layouts:

* ``contiguous``: rank r holds tokens ``[r*N/P, (r+1)*N/P)``. Simple, but under a causal mask
  the last rank attends to the whole sequence while the first attends to its own block only.
* ``zigzag``: the sequence is cut into 2P equal chunks and rank r holds chunks ``r`` and
  ``2P-1-r`` (in that order). Every rank then has the same causal work: one early chunk and
  one late chunk.

N must be divisible by what the layout needs (P, or 2P). The engine never pads silently: a
wrong split would give a wrong answer, so it raises a ValueError naming N, P and the layout.
Callers that need arbitrary lengths pad at the *end* of the sequence (see ``padded_length``):
under a causal mask, tokens appended at the end cannot change any earlier token's output.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")


def chunks_per_rank(layout: str) -> int:
    check_layout(layout)
    return 1 if layout == "contiguous" else 2


def padded_length(seq_len: int, *, world_size: int, layout: str) -> int:
    """The smallest length >= seq_len that the layout can split over world_size ranks."""
    multiple = world_size * chunks_per_rank(layout)
    return -(-seq_len // multiple) * multiple


def check_divisible(seq_len: int, *, world_size: int, layout: str) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    multiple = world_size * chunks_per_rank(layout)
    if seq_len % multiple:
        raise ValueError(
            f"sequence length N={seq_len} cannot be split over P={world_size} ranks in the "
            f"{layout!r} layout: N must be a multiple of {multiple}"
            + (" (2P)" if layout == "zigzag" else " (P)")
            + f"; pad to {padded_length(seq_len, world_size=world_size, layout=layout)} "
            "at the end of the sequence (ringattn.padded_length)"
        )


def _chunk_ids(world_size: int, rank: int, layout: str) -> tuple[int, ...]:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    if layout == "contiguous":
        return (rank,)
    return (rank, 2 * world_size - 1 - rank)


def sequence_positions(seq_len: int, *, world_size: int, rank: int, layout: str) -> torch.Tensor:
    """Global token indices held by ``rank``, in local order (for RoPE and for gathering)."""
    check_layout(layout)
    check_divisible(seq_len, world_size=world_size, layout=layout)
    ids = _chunk_ids(world_size, rank, layout)
    size = seq_len // (world_size * len(ids))
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in ids])


def shard_sequence(
    x: torch.Tensor, *, world_size: int, rank: int, layout: str, dim: int = 1
) -> torch.Tensor:
    """This rank's shard of the full tensor ``x`` (a new contiguous tensor)."""
    check_layout(layout)
    seq_len = x.shape[dim]
    check_divisible(seq_len, world_size=world_size, layout=layout)
    ids = _chunk_ids(world_size, rank, layout)
    pieces = x.chunk(world_size * len(ids), dim=dim)
    return torch.cat([pieces[c] for c in ids], dim=dim).contiguous()


def unshard_sequence(chunks: Sequence[torch.Tensor], *, layout: str, dim: int = 1) -> torch.Tensor:
    """Reassemble the full tensor from every rank's shard, given in rank order."""
    check_layout(layout)
    world_size = len(chunks)
    if world_size == 0:
        raise ValueError("unshard_sequence needs at least one shard")
    if layout == "contiguous":
        return torch.cat(list(chunks), dim=dim)
    ordered: list[torch.Tensor | None] = [None] * (2 * world_size)
    for rank, shard in enumerate(chunks):
        if shard.shape[dim] % 2:
            raise ValueError(
                f"zigzag shard of rank {rank} has odd length {shard.shape[dim]} along dim {dim}"
            )
        first, second = shard.chunk(2, dim=dim)
        ordered[rank], ordered[2 * world_size - 1 - rank] = first, second
    return torch.cat(ordered, dim=dim)  # type: ignore[arg-type]
