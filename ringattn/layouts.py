"""How a global sequence is cut into per-rank shards.

Two ring layouts:

* ``contiguous``: rank r holds tokens ``[r*N/P, (r+1)*N/P)``. Simple, but under a causal mask
  the last rank attends to the whole sequence while the first attends to its own block only.
* ``zigzag``: the sequence is cut into 2P equal chunks and rank r holds chunks ``r`` and
  ``2P-1-r`` (in that order). Every rank then has the same causal work: one early chunk and
  one late chunk.

N must be divisible by what the layout needs (P, or 2P). The engine never pads silently: a
wrong split would give a wrong answer, so it raises a ValueError naming N, P and the layout.
Callers that need arbitrary lengths pad at the *end* of the sequence (see ``padded_length``):
under a causal mask, tokens appended at the end cannot change any earlier token's output.

Two hybrid layouts, for ``ringattn.hybrid_attention`` (Ulysses groups of U ranks, a ring of
R = P/U groups). A rank's *hybrid rank* is ``ring_rank * U + ulysses_rank`` (its global rank
when the groups come from ``ringattn.hybrid.hybrid_groups``); every call takes P as
``world_size``, that rank as ``rank`` and U as ``ulysses_degree``:

* ``hybrid-zigzag``: the sequence is split over the R groups exactly as ``zigzag`` splits it
  over R ranks (group r holds chunks ``r`` and ``2R-1-r`` of 2R, in that order), and that share
  of N/R tokens is cut into U equal contiguous pieces, ulysses rank u holding piece u. After
  the all-to-all each member holds its group's whole zigzag share (for H/U heads), so the ring
  of groups sees a plain zigzag layout and every group does the same causal work.
  N must be a multiple of lcm(P, 2R).
* ``hybrid-contiguous``: the same with a contiguous ring split; it equals ``contiguous`` over
  P ranks in hybrid-rank order. N must be a multiple of P.

With U = 1 a hybrid layout is its ring layout; with R = 1 the group holds the whole sequence
(the U members hold consecutive pieces).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

LAYOUTS = ("contiguous", "zigzag")  # the ring's layouts (``ring_attention``)
HYBRID_LAYOUTS = ("hybrid-zigzag", "hybrid-contiguous")  # ``hybrid_attention``'s


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")


def chunks_per_rank(layout: str) -> int:
    check_layout(layout)
    return 1 if layout == "contiguous" else 2


def check_sequence_layout(layout: str) -> None:
    """A ring layout or a hybrid one: what the sharding functions accept."""
    if layout not in LAYOUTS + HYBRID_LAYOUTS:
        raise ValueError(
            f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS + HYBRID_LAYOUTS)}"
        )


def ring_layout_of(layout: str) -> str:
    """The layout the ring of Ulysses groups sees: ``hybrid-zigzag`` -> ``zigzag``."""
    check_sequence_layout(layout)
    return layout.removeprefix("hybrid-")


def hybrid_grid(world_size: int, ulysses_degree: int, rank: int) -> tuple[int, int, int]:
    """(ring size R, ring rank, ulysses rank) of hybrid rank ``rank`` among P = U x R ranks."""
    if ulysses_degree < 1 or world_size < 1 or world_size % ulysses_degree:
        raise ValueError(
            f"the Ulysses degree U={ulysses_degree} must be >= 1 and divide the world size "
            f"P={world_size} (P = U x R, R the ring size)"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    return world_size // ulysses_degree, rank // ulysses_degree, rank % ulysses_degree


def _check_ulysses_degree(layout: str, ulysses_degree: int) -> None:
    if layout in LAYOUTS and ulysses_degree != 1:
        raise ValueError(
            f"ulysses_degree={ulysses_degree} needs a hybrid layout "
            f"({', '.join(HYBRID_LAYOUTS)}); the {layout!r} layout has no Ulysses groups"
        )


def _hybrid_multiple(world_size: int, ulysses_degree: int, layout: str) -> int:
    ring_size, _, _ = hybrid_grid(world_size, ulysses_degree, 0)
    if ring_layout_of(layout) == "contiguous":
        return world_size
    return math.lcm(world_size, 2 * ring_size)


def padded_length(seq_len: int, *, world_size: int, layout: str, ulysses_degree: int = 1) -> int:
    """The smallest length >= seq_len that the layout can split over world_size ranks."""
    check_sequence_layout(layout)
    _check_ulysses_degree(layout, ulysses_degree)
    if layout in HYBRID_LAYOUTS:
        multiple = _hybrid_multiple(world_size, ulysses_degree, layout)
    else:
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


def _check_hybrid_divisible(seq_len: int, world_size: int, ulysses_degree: int, layout: str):
    multiple = _hybrid_multiple(world_size, ulysses_degree, layout)
    if seq_len % multiple:
        ring_size = world_size // ulysses_degree
        rule = "P" if ring_layout_of(layout) == "contiguous" else "lcm(P, 2R)"
        raise ValueError(
            f"sequence length N={seq_len} cannot be split over P={world_size} ranks "
            f"(U={ulysses_degree} x R={ring_size}) in the {layout!r} layout: N must be a "
            f"multiple of {multiple} ({rule}); pad to "
            f"{-(-seq_len // multiple) * multiple} at the end of the sequence "
            "(ringattn.padded_length)"
        )


def _hybrid_positions(seq_len: int, world_size: int, rank: int, layout: str, ulysses_degree: int):
    ring_size, ring_rank, ulysses_rank = hybrid_grid(world_size, ulysses_degree, rank)
    _check_hybrid_divisible(seq_len, world_size, ulysses_degree, layout)
    share = sequence_positions(
        seq_len, world_size=ring_size, rank=ring_rank, layout=ring_layout_of(layout)
    )
    return share.chunk(ulysses_degree)[ulysses_rank]


def sequence_positions(
    seq_len: int, *, world_size: int, rank: int, layout: str, ulysses_degree: int = 1
) -> torch.Tensor:
    """Global token indices held by ``rank``, in local order (for RoPE and for gathering).

    For a hybrid layout, ``rank`` is the hybrid rank ``ring_rank * U + ulysses_rank`` and
    ``ulysses_degree`` is U (see the module docstring).
    """
    check_sequence_layout(layout)
    _check_ulysses_degree(layout, ulysses_degree)
    if layout in HYBRID_LAYOUTS:
        return _hybrid_positions(seq_len, world_size, rank, layout, ulysses_degree)
    check_divisible(seq_len, world_size=world_size, layout=layout)
    ids = _chunk_ids(world_size, rank, layout)
    size = seq_len // (world_size * len(ids))
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in ids])


def shard_sequence(
    x: torch.Tensor,
    *,
    world_size: int,
    rank: int,
    layout: str,
    dim: int = 1,
    ulysses_degree: int = 1,
) -> torch.Tensor:
    """This rank's shard of the full tensor ``x`` (a new contiguous tensor).

    For a hybrid layout, ``rank`` is the hybrid rank and ``ulysses_degree`` is U.
    """
    check_sequence_layout(layout)
    _check_ulysses_degree(layout, ulysses_degree)
    seq_len = x.shape[dim]
    if layout in HYBRID_LAYOUTS:
        positions = _hybrid_positions(seq_len, world_size, rank, layout, ulysses_degree)
        return x.index_select(dim, positions.to(x.device)).contiguous()
    check_divisible(seq_len, world_size=world_size, layout=layout)
    ids = _chunk_ids(world_size, rank, layout)
    pieces = x.chunk(world_size * len(ids), dim=dim)
    return torch.cat([pieces[c] for c in ids], dim=dim).contiguous()


def unshard_sequence(
    chunks: Sequence[torch.Tensor], *, layout: str, dim: int = 1, ulysses_degree: int = 1
) -> torch.Tensor:
    """Reassemble the full tensor from every rank's shard, given in rank order (hybrid-rank
    order for a hybrid layout, with ``ulysses_degree`` U)."""
    check_sequence_layout(layout)
    _check_ulysses_degree(layout, ulysses_degree)
    world_size = len(chunks)
    if world_size == 0:
        raise ValueError("unshard_sequence needs at least one shard")
    if layout in HYBRID_LAYOUTS:
        hybrid_grid(world_size, ulysses_degree, 0)
        u = ulysses_degree
        shares = [torch.cat(list(chunks[i : i + u]), dim=dim) for i in range(0, world_size, u)]
        return unshard_sequence(shares, layout=ring_layout_of(layout), dim=dim)
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
