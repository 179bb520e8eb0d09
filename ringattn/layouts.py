"""How a global sequence is cut into per-rank shards (tensors; the rules are ``geometry``'s).

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

Packed sequences (``cu_seqlens = [0, l1, l1+l2, ..., N]``, flash-attn's varlen convention):
many documents in one sequence, each attending only to itself. Any N and any lengths: the
layout adds the padding rows it needs (fewer than P per sequence) and says where
(``sequence_positions`` gives -1 there). ``zigzag`` is then the balanced packed layout
(``geometry``: long documents zigzagged over every rank, short ones whole where the work is
least), ``contiguous`` the packed tokens in P equal slices. ``cu_seqlens`` may be a list, an
int tensor, or a ``geometry.SequenceLayout`` from ``pack_sequence`` (to balance the work under
a sliding window: pass the same object to every call).

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
(the U members hold consecutive pieces). Packed hybrid layouts give each group a share of
rows that is a multiple of U.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .geometry import (
    HYBRID_LAYOUTS,
    LAYOUTS,
    SequenceLayout,
    check_balance_window,
    check_layout,
    check_sequence_layout,
    chunks_per_rank,
    hybrid_grid,
    integer_of,
    layout_multiple,
    packed_layout,
    packing_checksum,
    padded_length,
    plain_layout,
    ring_layout_of,
    whole_numbers,
)

__all__ = [
    "HYBRID_LAYOUTS",
    "LAYOUTS",
    "check_divisible",
    "check_layout",
    "chunks_per_rank",
    "document_positions",
    "hybrid_grid",
    "pack_sequence",
    "packed_tokens",
    "packing_fingerprint",
    "padded_length",
    "ring_geometry",
    "ring_layout_of",
    "sequence_positions",
    "shard_sequence",
    "unshard_sequence",
]

CuSeqlens = Sequence[int] | torch.Tensor | SequenceLayout


def check_divisible(seq_len: int, *, world_size: int, layout: str, ulysses_degree: int = 1):
    """A plain sequence of ``seq_len`` splits over ``world_size`` ranks in ``layout``, or a
    ValueError naming N, P, the layout, the rule and the length to pad to."""
    whole_numbers(world_size=world_size, ulysses_degree=ulysses_degree)
    if integer_of(seq_len) is None or seq_len < 1:  # -4 % 4 == 0 passed as no token at all
        raise ValueError(f"the sequence length N must be an int >= 1, got {seq_len!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    multiple = layout_multiple(layout, world_size, ulysses_degree)
    if seq_len % multiple == 0:
        return
    if layout in HYBRID_LAYOUTS:
        ring_size = world_size // ulysses_degree
        rule = "P" if ring_layout_of(layout) == "contiguous" else "lcm(P, 2R)"
        where = f"P={world_size} ranks (U={ulysses_degree} x R={ring_size})"
    else:
        rule = "2P" if layout == "zigzag" else "P"
        where = f"P={world_size} ranks"
    padded = padded_length(
        seq_len, world_size=world_size, layout=layout, ulysses_degree=ulysses_degree
    )
    raise ValueError(
        f"sequence length N={seq_len} cannot be split over {where} in the {layout!r} layout: "
        f"N must be a multiple of {multiple} ({rule}); pad to {padded} at the end of the "
        "sequence (ringattn.padded_length), or pack it with cu_seqlens"
    )


def _cu_tuple(cu_seqlens) -> tuple[int, ...]:
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.is_meta:  # no values to read
        raise ValueError(
            "cu_seqlens is a meta tensor: its values decide the layout, so it must hold them "
            "(a list, or a CPU or device tensor)"
        )
    if isinstance(cu_seqlens, torch.Tensor):
        if (
            cu_seqlens.dim() != 1
            or cu_seqlens.is_floating_point()
            or cu_seqlens.dtype == torch.bool
        ):
            raise ValueError(
                "cu_seqlens must be a 1-D integer tensor [0, l1, l1+l2, ..., N], got "
                f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}"
            )
        return tuple(cu_seqlens.tolist())
    try:
        given = list(cu_seqlens)
    except TypeError:  # not a sequence at all
        given = [cu_seqlens]
    cu = tuple(integer_of(c) for c in given)  # integers of any kind, never bools or floats
    if None in cu:
        raise ValueError(f"cu_seqlens must hold integers [0, l1, l1+l2, ..., N], got {given[:6]!r}")
    return cu


def pack_sequence(
    cu_seqlens: Sequence[int] | torch.Tensor,
    *,
    world_size: int,
    layout: str,
    ulysses_degree: int = 1,
    balance_window: int | None = None,
) -> SequenceLayout:
    """The packed layout of the ring (R = P / U ranks for a hybrid layout, each holding a
    multiple of U rows): pass it as ``cu_seqlens`` to every call so they all agree.
    ``balance_window``: balance the causal work under that sliding window (a windowed model)
    instead of full causal attention; any window still computes exactly."""
    check_sequence_layout(layout)
    ring_size, _, _ = hybrid_grid(world_size, ulysses_degree, 0)
    if layout in LAYOUTS and ulysses_degree != 1:
        layout_multiple(layout, world_size, ulysses_degree)  # raises the hybrid-layout error
    cu = _cu_tuple(cu_seqlens)
    # before the cache: 4.0 == 4 found the layout made for 4
    balance_window = check_balance_window(balance_window)
    return packed_layout(cu, ring_size, ring_layout_of(layout), ulysses_degree, balance_window)


def ring_geometry(
    seq_len: int, *, world_size: int, layout: str, ulysses_degree: int = 1, cu_seqlens=None
) -> SequenceLayout:
    """The ring's layout: of a plain sequence of ``seq_len`` tokens (checked divisible), or of
    the packed documents ``cu_seqlens`` (``seq_len`` must then be their N)."""
    if cu_seqlens is None:
        check_divisible(
            seq_len, world_size=world_size, layout=layout, ulysses_degree=ulysses_degree
        )
        ring_size, _, _ = hybrid_grid(world_size, ulysses_degree, 0)
        return plain_layout(seq_len, ring_size, ring_layout_of(layout))
    if isinstance(cu_seqlens, SequenceLayout):
        geo = cu_seqlens
        ring_size = world_size // max(1, ulysses_degree)
        if geo.world_size != ring_size or geo.name != ring_layout_of(layout):
            raise ValueError(
                f"cu_seqlens was packed for a {geo.name!r} ring of {geo.world_size} ranks; "
                f"this call is a {layout!r} layout over P={world_size} (U={ulysses_degree})"
            )
        if geo.rows % max(1, ulysses_degree):  # else each Ulysses rank's share drops rows
            raise ValueError(
                f"cu_seqlens was packed for a plain ring ({geo.rows} rows a ring rank, not a "
                f"multiple of U={ulysses_degree}): pack it with pack_sequence(..., "
                f"layout={layout!r}, ulysses_degree={ulysses_degree})"
            )
    else:
        geo = pack_sequence(
            cu_seqlens, world_size=world_size, layout=layout, ulysses_degree=ulysses_degree
        )
    if seq_len != geo.tokens:
        raise ValueError(
            f"the sequence holds {seq_len} tokens but cu_seqlens packs N={geo.tokens} "
            "(cu_seqlens[-1] must be the packed length)"
        )
    return geo


def _local_rows(geo: SequenceLayout, world_size: int, rank: int, ulysses_degree: int):
    """(ring rank, the slice of its rows this hybrid rank holds)."""
    _, ring_rank, ulysses_rank = hybrid_grid(world_size, ulysses_degree, rank)
    piece = geo.rows // ulysses_degree
    return ring_rank, slice(ulysses_rank * piece, (ulysses_rank + 1) * piece)


def sequence_positions(
    seq_len: int,
    *,
    world_size: int,
    rank: int,
    layout: str,
    ulysses_degree: int = 1,
    cu_seqlens: CuSeqlens | None = None,
) -> torch.Tensor:
    """Global token indices held by ``rank``, in local order (for RoPE and for gathering);
    with ``cu_seqlens``, packed positions, -1 for a row the layout adds (padding).

    For a hybrid layout, ``rank`` is the hybrid rank ``ring_rank * U + ulysses_rank`` and
    ``ulysses_degree`` is U (see the module docstring).
    """
    geo = ring_geometry(
        seq_len,
        world_size=world_size,
        layout=layout,
        ulysses_degree=ulysses_degree,
        cu_seqlens=cu_seqlens,
    )
    ring_rank, rows = _local_rows(geo, world_size, rank, ulysses_degree)
    return torch.tensor(geo.positions(ring_rank)[rows], dtype=torch.long)


def document_positions(
    cu_seqlens: CuSeqlens,
    *,
    world_size: int,
    rank: int,
    layout: str,
    ulysses_degree: int = 1,
) -> torch.Tensor:
    """Each local row's position within its own document (RoPE's ``position_ids`` for packed
    documents: every document starts at 0); -1 for padding."""
    geo, ring_rank, rows = packed_share(
        cu_seqlens, world_size=world_size, rank=rank, layout=layout, ulysses_degree=ulysses_degree
    )
    return torch.tensor(geo.document_positions(ring_rank)[rows], dtype=torch.long)


def packed_share(
    cu_seqlens: CuSeqlens | None,
    *,
    world_size: int,
    rank: int,
    layout: str,
    ulysses_degree: int = 1,
    tokens: int | None = None,
) -> tuple[SequenceLayout, int, slice]:
    """(the ring's layout, ``rank``'s ring rank, the slice of that ring rank's rows ``rank``
    holds): a plain ring's rank holds them all, a hybrid grid's member its share. Of the
    packed documents ``cu_seqlens``, or (None) of a plain sequence of ``tokens``."""
    geo = ring_geometry(
        packed_tokens(cu_seqlens) if cu_seqlens is not None else tokens,
        world_size=world_size,
        layout=layout,
        ulysses_degree=ulysses_degree,
        cu_seqlens=cu_seqlens,
    )
    ring_rank, rows = _local_rows(geo, world_size, rank, ulysses_degree)
    return geo, ring_rank, rows


def packed_tokens(cu_seqlens: CuSeqlens) -> int:
    """N, the tokens ``cu_seqlens`` packs."""
    if isinstance(cu_seqlens, SequenceLayout):
        return cu_seqlens.tokens
    cu = _cu_tuple(cu_seqlens)
    return cu[-1] if cu else 0


def packing_fingerprint(cu_seqlens: CuSeqlens) -> int:
    """The packing's checksum (``geometry.packing_checksum``), which every rank of a ring
    must agree on, whatever form each passes it in."""
    if isinstance(cu_seqlens, SequenceLayout):
        return cu_seqlens.fingerprint()
    cu = _cu_tuple(cu_seqlens)
    return packing_checksum([b - a for a, b in zip(cu, cu[1:], strict=False)])


def _dimension(x: torch.Tensor, dim) -> int:
    """``dim`` as an index of x's dimensions (negative counts from the end), else a ValueError
    naming it (an IndexError from inside the shape before)."""
    index = integer_of(dim)
    if index is None or not -x.dim() <= index < x.dim():
        raise ValueError(f"dim {dim!r} is not a dimension of a {x.dim()}-D tensor")
    return index % x.dim()


def packing_argument(cu_seqlens):
    """``cu_seqlens`` as a call keeps it: a tensor or a packed layout as given, anything else
    read once into a tuple (an iterator, read by the checksum first, was empty after it)."""
    if cu_seqlens is None or isinstance(cu_seqlens, (torch.Tensor, SequenceLayout)):
        return cu_seqlens
    return _cu_tuple(cu_seqlens)


def shard_sequence(
    x: torch.Tensor,
    *,
    world_size: int,
    rank: int,
    layout: str,
    dim: int = 1,
    ulysses_degree: int = 1,
    cu_seqlens: CuSeqlens | None = None,
) -> torch.Tensor:
    """This rank's shard of the full tensor ``x`` (a new contiguous tensor); with
    ``cu_seqlens``, padding rows are zeros.

    For a hybrid layout, ``rank`` is the hybrid rank and ``ulysses_degree`` is U.
    """
    dim = _dimension(x, dim)
    positions = sequence_positions(
        x.shape[dim],
        world_size=world_size,
        rank=rank,
        layout=layout,
        ulysses_degree=ulysses_degree,
        cu_seqlens=cu_seqlens,
    )
    if cu_seqlens is None:
        return x.index_select(dim, positions.to(x.device)).contiguous()
    pad_shape = list(x.shape)
    pad_shape[dim] = 1
    padded = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)  # row N: the padding row
    index = torch.where(positions < 0, x.shape[dim], positions)
    return padded.index_select(dim, index.to(x.device)).contiguous()


def unshard_sequence(
    chunks: Sequence[torch.Tensor],
    *,
    layout: str,
    dim: int = 1,
    ulysses_degree: int = 1,
    cu_seqlens: CuSeqlens | None = None,
) -> torch.Tensor:
    """Reassemble the full tensor from every rank's shard, given in rank order (hybrid-rank
    order for a hybrid layout, with ``ulysses_degree`` U); with ``cu_seqlens`` the N packed
    tokens, padding rows dropped."""
    check_sequence_layout(layout)
    world_size = len(chunks)
    if world_size == 0:
        raise ValueError("unshard_sequence needs at least one shard")
    hybrid_grid(world_size, ulysses_degree, 0)
    dim = _dimension(chunks[0], dim)
    cu_seqlens = packing_argument(cu_seqlens)  # read once per rank below
    local = chunks[0].shape[dim]
    if any(c.shape[dim] != local for c in chunks):
        raise ValueError(
            f"shards differ in length along dim {dim}: {[c.shape[dim] for c in chunks]}"
        )
    if cu_seqlens is None:
        seq_len = local * world_size
    else:
        seq_len = packed_tokens(cu_seqlens)
    positions = [
        sequence_positions(
            seq_len,
            world_size=world_size,
            rank=r,
            layout=layout,
            ulysses_degree=ulysses_degree,
            cu_seqlens=cu_seqlens,
        )
        for r in range(world_size)
    ]
    if positions[0].numel() != local:
        raise ValueError(
            f"each shard holds {local} rows along dim {dim}; the {layout!r} layout gives "
            f"{positions[0].numel()}"
        )
    joined = torch.cat(list(chunks), dim=dim)
    order = torch.cat(positions)
    keep = (order >= 0).nonzero().squeeze(1)
    inverse = torch.empty(seq_len, dtype=torch.long)
    inverse[order[keep]] = keep
    return joined.index_select(dim, inverse.to(joined.device))
