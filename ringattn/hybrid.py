"""Hybrid sequence parallelism: Ulysses all-to-all inside a group, the ring across groups.

P = U x R ranks form a grid: R *Ulysses groups* of U ranks (one NVLink domain each, say) and
U *rings* of R ranks, ring u linking the member of ulysses rank u of every group. A rank's
hybrid rank is ``ring_rank * U + ulysses_rank``; ``hybrid_groups(U)`` builds both groups so that
it equals the global rank (groups of consecutive ranks).

``hybrid_attention`` runs, on every rank:

1. one all-to-all inside the Ulysses group (``ringattn.ulysses``): the rank gives away its
   tokens of every head but its head block and receives the group's tokens of that block, so
   it holds the group's whole share of the sequence for H/U heads;
2. ``ring_attention`` over the ring of groups, on that share and those heads, with the ring's
   own loop, kernels, causal block skipping and zigzag balance;
3. the inverse all-to-all on the output. Backward runs the same three steps in reverse; each
   all-to-all's backward is the inverse all-to-all, so gradients are exact.

U = 1 is the ring alone (no all-to-all); R = 1 is Ulysses alone (a ring of one rank).

Layout (``ringattn.layouts``): ``hybrid-zigzag`` zigzag-splits the sequence over the R groups
(group r: chunks r and 2R-1-r of 2R) and cuts each group's share into U contiguous pieces, one
per member; after step 1 every ring member holds exactly what ``zigzag`` gives ring rank r, so
causal work is equal across the ring. ``hybrid-contiguous`` does the same with a contiguous
ring split.

GQA/MQA. Heads H must be a multiple of U. If kv_heads is a multiple of U, each member gets
kv_heads/U kv heads, those of its q heads. If instead U is a multiple of kv_heads (MQA, or
more members than kv heads), the kv heads are replicated U/kv_heads times *before* the
all-to-all (``repeat_interleave``), each member receiving the one kv head its q heads use; the
backward of that replication sums the replicas' gradients, so dK/dV are reduced over the
members that shared a head. Either way only the kv heads a member needs (kv_heads/U, or 1)
travel its ring. Any other (kv_heads, U) pair is refused.

Bad input never hangs. Before any all-to-all, three small collectives (an all-gather in the
Ulysses group, one in the ring, then the lowest rank that found a problem, over the Ulysses
group) share every rank's shapes, dtypes, flags and grid coordinates, so a local problem (heads
not divisible, ...), a disagreement between ranks, or groups that do not form a grid make
*every* rank of a grid raise. They cost three latency-bound collectives per call, on top of
the one ``ring_attention`` makes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .checks import (
    agreed_shifts,
    check_causal,
    check_scale,
    check_shift_pairs,
    check_window,
    collective_device,
    gathered_ints,
    pending_refusal,
    refused_together,
    scale_bits,
    scale_of,
    shifts_agreed,
)
from .geometry import ulysses_problem
from .layouts import (
    HYBRID_LAYOUTS,
    CuSeqlens,
    hybrid_grid,
    packed_tokens,
    packing_argument,
    packing_fingerprint,
    ring_geometry,
    ring_layout_of,
)
from .ring import ring_attention
from .ulysses import HeadsToSeq, SeqToHeads

_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
_NO_RANK = 2**62


@dataclass(frozen=True)
class HybridGroups:
    """This rank's Ulysses group and ring, the degrees, and its hybrid rank (for
    ``shard_sequence(..., world_size=world_size, rank=rank, ulysses_degree=ulysses_degree)``)."""

    ulysses: dist.ProcessGroup
    ring: dist.ProcessGroup
    ulysses_degree: int
    ring_size: int
    rank: int
    world_size: int


def hybrid_groups(ulysses_degree: int, *, timeout=None) -> HybridGroups:
    """Split the default group into R groups of U consecutive ranks and U rings of R ranks.

    Collective: every rank of the default group must call it with the same degree (torch's
    ``new_group`` is). A degree that does not divide the world size raises on every rank.
    ``timeout`` (a ``datetime.timedelta``) is the groups' collective timeout: pass the one
    the default group was given, since torch gives a new group its own default (30 minutes
    for gloo, 10 for NCCL), not the default group's, and a hung peer then held every rank
    of a hybrid job that long.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    ring_size, ring_rank, ulysses_rank = hybrid_grid(world, ulysses_degree, rank)
    ulysses = ring = None
    for r in range(ring_size):
        members = list(range(r * ulysses_degree, (r + 1) * ulysses_degree))
        group = dist.new_group(members, timeout=timeout)
        ulysses = group if r == ring_rank else ulysses
    for u in range(ulysses_degree):
        group = dist.new_group(list(range(u, world, ulysses_degree)), timeout=timeout)
        ring = group if u == ulysses_rank else ring
    assert ulysses is not None and ring is not None
    return HybridGroups(ulysses, ring, ulysses_degree, ring_size, rank, world)


def hybrid_rank(ulysses_group: dist.ProcessGroup | None, ring_group: dist.ProcessGroup | None):
    """``ring_rank * U + ulysses_rank``: the rank to shard with in a hybrid layout."""
    return dist.get_rank(ring_group) * dist.get_world_size(ulysses_group) + dist.get_rank(
        ulysses_group
    )


def kv_heads_per_member(kv_heads: int, ulysses_degree: int) -> int:
    """The kv heads each member holds after the all-to-all, i.e. that travel its ring."""
    if kv_heads % ulysses_degree == 0:
        return kv_heads // ulysses_degree
    if ulysses_degree % kv_heads == 0:
        return 1
    raise ValueError(
        f"kv_heads ({kv_heads}) and the Ulysses degree U={ulysses_degree} must divide one "
        "another: kv heads are either split over the group or replicated across it"
    )


# ----------------------------------------------------------------------------- checks
@dataclass(frozen=True)
class _Desc:
    """What one rank passes, as integers that travel in a collective."""

    dims: tuple[int, int, int]  # q, k, v ndim
    q: tuple[int, ...]  # shapes, (-1,)*4 when not 4-D
    k: tuple[int, ...]
    v: tuple[int, ...]
    dtypes: tuple[int, int, int]  # index into _DTYPES, -1 if other
    same_device: int
    causal: int
    layout: int  # index into HYBRID_LAYOUTS, -1 if other
    packing: int  # layouts.packing_fingerprint of cu_seqlens, -1 for a plain sequence
    window: int  # the sliding window, -1 for none
    scale: int  # checks.scale_bits of softmax_scale (0: the default)
    ulysses_degree: int
    ring_size: int
    ulysses_rank: int
    ring_rank: int
    rank: int  # global

    def shared(self) -> tuple:
        """Fields every rank of the grid must agree on."""
        return (
            self.dims,
            self.q,
            self.k,
            self.v,
            self.dtypes,
            self.same_device,
            self.causal,
            self.layout,
            self.packing,
            self.window,
            self.scale,
            self.ulysses_degree,
            self.ring_size,
        )

    def as_list(self) -> list[int]:
        return [
            *self.dims,
            *self.q,
            *self.k,
            *self.v,
            *self.dtypes,
            self.same_device,
            self.causal,
            self.layout,
            self.packing,
            self.window,
            self.scale,
            self.ulysses_degree,
            self.ring_size,
            self.ulysses_rank,
            self.ring_rank,
            self.rank,
        ]

    @classmethod
    def from_list(cls, x: list[int]) -> _Desc:
        return cls(
            tuple(x[0:3]),  # type: ignore[arg-type]
            tuple(x[3:7]),
            tuple(x[7:11]),
            tuple(x[11:15]),
            tuple(x[15:18]),  # type: ignore[arg-type]
            *x[18:],
        )


def _describe(q, k, v, agreed: dict, ulysses_group, ring_group) -> _Desc:
    """This rank's row; ``agreed``: causal, layout, packing, window and scale as passed."""

    def shape(t):
        return tuple(t.shape) if t.dim() == 4 else (-1, -1, -1, -1)

    def dtype(t):
        return _DTYPES.index(t.dtype) if t.dtype in _DTYPES else -1

    return _Desc(
        (q.dim(), k.dim(), v.dim()),
        shape(q),
        shape(k),
        shape(v),
        (dtype(q), dtype(k), dtype(v)),
        int(q.device == k.device == v.device),
        REFUSED_ARGUMENTS if agreed["causal"] is None else int(bool(agreed["causal"])),
        HYBRID_LAYOUTS.index(agreed["layout"]) if agreed["layout"] in HYBRID_LAYOUTS else -1,
        -1 if agreed["packing"] is None else agreed["packing"],
        -1 if agreed["window"] is None else agreed["window"],
        scale_bits(agreed["scale"]),
        dist.get_world_size(ulysses_group),
        dist.get_world_size(ring_group),
        dist.get_rank(ulysses_group),
        dist.get_rank(ring_group),
        dist.get_rank(),
    )


# The causal field of a rank that refused its own arguments (a bad window, scale or packing
# on that rank alone): its peers name it instead of reading its row as a disagreement.
REFUSED_ARGUMENTS = -2


def _local_problem(d: _Desc) -> str | None:
    """What is wrong with one rank's input on its own (the same text wherever it is judged)."""
    if d.causal == REFUSED_ARGUMENTS:
        return "its own arguments are refused (its error names the problem)"
    if d.layout < 0:
        return f"layout must be one of {', '.join(HYBRID_LAYOUTS)}"
    if d.dims != (4, 4, 4):
        return f"q, k, v must be 4-D (batch, seq_local, heads, head_dim); got ndims {d.dims}"
    if d.k != d.v:
        return f"k and v shapes differ: k {d.k}, v {d.v}"
    (b, s, h, hd), (bk, sk, hk, dk) = d.q, d.k
    if (b, s, hd) != (bk, sk, dk):
        return f"q and k/v must agree on batch, seq_local and head_dim: q {d.q}, k {d.k}"
    if -1 in d.dtypes or len(set(d.dtypes)) > 1:
        names = [str(_DTYPES[i]) if i >= 0 else "unsupported" for i in d.dtypes]
        return f"q, k, v dtypes must be one of {_DTYPES} and equal; got {', '.join(names)}"
    if not d.same_device:
        return "q, k, v are on different devices"
    u = d.ulysses_degree
    if hk == 0 or h % hk:
        return f"heads ({h}) must be a multiple of kv_heads ({hk})"
    why = ulysses_problem(u, u, h, hk)  # the group's size is U: its ranks are judged apart
    if why:
        return f"the Ulysses degree U={u} {why}"
    if HYBRID_LAYOUTS[d.layout] == "hybrid-zigzag" and (u * s) % 2 and d.packing < 0:
        return (
            f"the hybrid-zigzag layout gives each group two equal chunks, but the group "
            f"holds U x seq_local = {u} x {s} tokens, an odd number"
        )
    return None


def _gather(desc_rows: list[int], group, device) -> list[list[int]]:
    if dist.get_world_size(group) == 1:
        return [desc_rows]
    return gathered_ints(desc_rows, group, device)


def _variant(r: _Desc) -> str:
    dtypes = ",".join(str(_DTYPES[i]).removeprefix("torch.") if i >= 0 else "?" for i in r.dtypes)
    layout = HYBRID_LAYOUTS[r.layout] if r.layout >= 0 else "?"
    return (
        f"q={r.q} k={r.k} v={r.v} dtypes={dtypes} causal={bool(r.causal)} "
        f"layout={layout} U={r.ulysses_degree} R={r.ring_size}"
        + ("" if r.packing < 0 else f" packing={r.packing:08x}")
        + ("" if r.window < 0 else f" window={r.window}")
        + ("" if r.scale == 0 else f" softmax_scale={scale_of(r.scale)}")
    )


def _disagreement(rows: list[_Desc], what: str) -> str | None:
    if len({r.shared() for r in rows}) == 1:
        return None
    variants: dict[str, list[int]] = {}
    for r in rows:
        variants.setdefault(_variant(r), []).append(r.rank)
    detail = "; ".join(
        f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}: {text}"
        for text, ranks in variants.items()
    )
    return f"the ranks of one {what} disagree on their inputs or group sizes: {detail}"


def _first_local_problem(rows: list[_Desc]) -> tuple[str | None, _Desc | None]:
    for r in sorted(rows, key=lambda r: r.rank):
        if (problem := _local_problem(r)) is not None:
            return f"rank {r.rank}: {problem}", r
    return None, None


def _ulysses_stage(rows: list[_Desc]) -> str | None:
    """Judged inside one Ulysses group: every member must sit at the same ring position."""
    problem, _ = _first_local_problem(rows)
    problem = problem or _disagreement(rows, "Ulysses group")
    if problem is None and len({r.ring_rank for r in rows}) > 1:
        seats = ", ".join(f"rank {r.rank} at ring rank {r.ring_rank}" for r in rows)
        problem = (
            "the groups do not form a U x R grid: the members of one Ulysses group must share "
            f"a ring position (one member in each ring), but {seats}"
        )
    return problem


def _ring_stage(rows: list[_Desc], culprits: list[_Desc]) -> str | None:
    """Judged inside one ring: its members must all hold the same head block. ``culprits``
    are rows with a local problem that the members found in their own Ulysses groups."""
    problem, _ = _first_local_problem(rows + culprits)
    problem = problem or _disagreement(rows, "ring")
    if problem is None and len({r.ulysses_rank for r in rows}) > 1:
        seats = ", ".join(f"rank {r.rank} at ulysses rank {r.ulysses_rank}" for r in rows)
        problem = (
            "the groups do not form a U x R grid: a ring must link the same Ulysses rank of "
            f"every group (the same heads), but {seats}"
        )
    return problem


def check_grid_agree(
    q,
    k,
    v,
    *,
    causal,
    layout,
    ulysses_group,
    ring_group,
    packing: int | None = None,
    window: int | None = None,
    scale: float | None = None,
) -> None:
    """Raise a ValueError on every rank of the grid if any rank's input is bad.

    Three collectives of fixed size: the rows of the Ulysses group (each rank's shapes, flags
    and grid seat), then in the ring each member's row, whether its group found a problem and
    the row at fault for a local one, then the lowest rank that found a problem, over the
    Ulysses group. Nothing raises before all three are done, so no rank is left waiting in
    one. A rank that saw the faulty row names the problem; one that only heard of it names
    the rank that found it.
    """
    device = collective_device(q, ulysses_group)
    agreed = dict(causal=causal, layout=layout, packing=packing, window=window, scale=scale)
    mine = _describe(q, k, v, agreed, ulysses_group, ring_group)
    width = len(mine.as_list())
    group_rows = [_Desc.from_list(x) for x in _gather(mine.as_list(), ulysses_group, device)]
    refusal = pending_refusal()  # the caller's finding on this rank (ringattn.hf's positions)
    problem = _ulysses_stage(group_rows) or (None if refusal is None else str(refusal))
    culprit = _first_local_problem(group_rows)[1] or mine
    payload = [*mine.as_list(), mine.rank if problem else _NO_RANK, *culprit.as_list()]
    ring = _gather(payload, ring_group, device)
    ring_rows = [_Desc.from_list(x[:width]) for x in ring]
    culprits = [_Desc.from_list(x[width + 1 :]) for x in ring]
    problem = problem or _ring_stage(ring_rows, culprits)
    first_bad = min([x[width] for x in ring] + [mine.rank if problem else _NO_RANK])
    verdict = torch.tensor([first_bad], dtype=torch.int64, device=device)
    if dist.get_world_size(ulysses_group) > 1:
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=ulysses_group)
    first_bad = int(verdict.item())
    if problem is None and first_bad != _NO_RANK:
        problem = (
            f"rank {first_bad} found bad input in the hybrid grid (its error names "
            "the problem); no rank ran the attention"
        )
    if refusal is not None:
        raise refusal
    if problem is not None:
        if layout not in HYBRID_LAYOUTS:
            problem += f" (this rank passed layout={layout!r}; ring layouts go to ring_attention)"
        raise ValueError(f"hybrid_attention: {problem}")
    _check_grid_shifts(mine.rank, ulysses_group, ring_group, device)


def _gather_triples(triples: list[int], group, device) -> list[int]:
    """Every member's flat (rank, document, shift) triples in one list (their counts first:
    members hold different numbers of them)."""
    if dist.get_world_size(group) == 1:
        return triples
    counts = [row[0] for row in _gather([len(triples)], group, device)]
    most = max(counts)
    if most == 0:
        return []
    rows = _gather(triples + [-1] * (most - len(triples)), group, device)
    return [x for row, n in zip(rows, counts, strict=True) for x in row[:n]]


def _check_grid_shifts(rank: int, ulysses_group, ring_group, device) -> None:
    """Each shared document's position shift agreed across the grid (the caller's
    ``checks.shifts_agreed``: ringattn.hf's position_ids): gathered over the Ulysses group,
    then the groups' over the ring, so every rank judges every rank's and raises alike. A
    member whose whole share was shifted looked right to itself (transformers' default
    0..S-1 on rank 1 of a U = 2 grid: 4.6e-3 off, exit 0)."""
    mine = [x for doc, shift in agreed_shifts() for x in (rank, doc, shift)]
    grid = _gather_triples(_gather_triples(mine, ulysses_group, device), ring_group, device)
    check_shift_pairs(zip(grid[::3], grid[1::3], grid[2::3], strict=True))


# ----------------------------------------------------------------------------- attention
def _replicate_kv(k: torch.Tensor, v: torch.Tensor, ulysses_degree: int):
    """Repeat each kv head U/kv_heads times when the group has more members than kv heads;
    autograd's backward of the repeat sums the replicas' gradients."""
    kv_heads = k.shape[2]
    if kv_heads % ulysses_degree == 0:
        return k, v
    times = ulysses_degree // kv_heads
    return k.repeat_interleave(times, dim=2), v.repeat_interleave(times, dim=2)


def _require_groups(ulysses_group, ring_group) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "hybrid_attention needs an initialised torch.distributed process group: call "
            "torch.distributed.init_process_group(...) first"
        )
    for name, group in (("ulysses_group", ulysses_group), ("ring_group", ring_group)):
        if dist.get_rank(group) < 0:
            raise RuntimeError(f"this process is not a member of the {name} given to it")


def hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    layout: str,
    ulysses_group: dist.ProcessGroup | None,
    ring_group: dist.ProcessGroup | None,
    softmax_scale: float | None = None,
    window: int | None = None,
    cu_seqlens: CuSeqlens | None = None,
) -> torch.Tensor:
    """Exact attention over a sequence sharded across a U x R grid of ranks.

    q is (batch, seq_local, heads, head_dim), k and v (batch, seq_local, kv_heads, head_dim),
    each rank holding its shard in the hybrid ``layout`` (``shard_sequence(..., layout=layout,
    rank=hybrid_rank, ulysses_degree=U)``). Returns this rank's shard of the output, same
    layout; differentiable with respect to q, k and v. ``None`` for a group is the default one.
    ``window``: a sliding window, as ``ring_attention``'s: after the all-to-all each ring member
    holds the ring layout's positions, so the ring applies it unchanged. ``cu_seqlens``:
    packed documents, as ``ring_attention``'s (shard with the same ``cu_seqlens``).
    """
    _require_groups(ulysses_group, ring_group)
    try:
        causal = check_causal(causal, "hybrid_attention")
        window = check_window(window, causal, "hybrid_attention")
        softmax_scale = check_scale(softmax_scale, "hybrid_attention")
        cu_seqlens = packing_argument(cu_seqlens)
        packing = None if cu_seqlens is None else packing_fingerprint(cu_seqlens)
    except (ValueError, TypeError) as err:  # raised through the grid's agreement, which every
        with refused_together(err):  # rank reaches: alone, it left the others waiting there
            check_grid_agree(  # causal None: this rank's row says it refused its arguments
                q,
                k,
                v,
                causal=None,
                layout=layout,
                ulysses_group=ulysses_group,
                ring_group=ring_group,
            )
        raise
    degree = dist.get_world_size(ulysses_group)
    check_grid_agree(
        q,
        k,
        v,
        causal=causal,
        layout=layout,
        ulysses_group=ulysses_group,
        ring_group=ring_group,
        packing=packing,
        window=window,
        scale=softmax_scale,
    )
    if cu_seqlens is not None:  # the ring's packed layout: rows a multiple of U per group
        world = degree * dist.get_world_size(ring_group)
        cu_seqlens = ring_geometry(
            packed_tokens(cu_seqlens),
            world_size=world,
            layout=layout,
            ulysses_degree=degree,
            cu_seqlens=cu_seqlens,
        )
    ring = dict(
        causal=causal,
        softmax_scale=softmax_scale,
        group=ring_group,
        layout=ring_layout_of(layout),
        window=window,
        cu_seqlens=cu_seqlens,
    )
    with shifts_agreed(()):  # compared over the whole grid above
        return _ulysses_ring(q, k, v, ulysses_group, degree, ring)


def _ulysses_ring(q, k, v, ulysses_group, degree: int, ring: dict) -> torch.Tensor:
    """The ring attention of this rank's heads over the whole sequence: all-to-all from
    sequence shards to head groups (U > 1), the ring, and back."""
    if degree == 1:
        return ring_attention(q, k, v, **ring)
    k, v = _replicate_kv(k, v, degree)
    q_h, k_h, v_h = SeqToHeads.apply(ulysses_group, q, k, v)
    out_h = ring_attention(q_h, k_h, v_h, **ring)
    (out,) = HeadsToSeq.apply(ulysses_group, out_h)
    return out


__all__ = [
    "HybridGroups",
    "check_grid_agree",
    "hybrid_attention",
    "hybrid_groups",
    "hybrid_rank",
    "kv_heads_per_member",
]
