"""Input checks that turn a would-be deep failure (or a silent hang) into a clear error."""

from __future__ import annotations

import contextvars
import math
import numbers
import struct
from contextlib import contextmanager

import torch
import torch.distributed as dist

from .geometry import integer_of
from .layouts import LAYOUTS, check_layout

_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def check_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, packed: bool = False
) -> None:
    check_layout(layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have shape (batch, seq_local, heads, head_dim); got {tuple(t.shape)}"
            )
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: k {tuple(k.shape)}, v {tuple(v.shape)}")
    (b, s, h, d), (bk, sk, hk, dk) = q.shape, k.shape
    if (b, s, d) != (bk, sk, dk):
        raise ValueError(
            "q and k/v must agree on batch, seq_local and head_dim: "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if hk == 0 or h % hk:
        raise ValueError(f"heads ({h}) must be a multiple of kv_heads ({hk})")
    if 0 in (b, s, d):
        raise ValueError(
            f"q has an empty dimension (batch, seq_local, heads, head_dim) = {tuple(q.shape)}: "
            "every rank holds at least one row of at least one head of size 1 or more"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {q.dtype}; expected one of {_DTYPES}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    if layout == "zigzag" and s % 2 and not packed:
        raise ValueError(f"zigzag shards hold two equal chunks; seq_local={s} is odd")


def check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    """Sinks are one float logit per query head, on q's device."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a tensor of shape (heads,), got {type(sinks).__name__}")
    heads = q.shape[2]
    if sinks.dim() != 1 or sinks.shape[0] != heads:
        raise ValueError(
            f"sinks must have shape (heads,) = ({heads},), one logit per query head; "
            f"got {tuple(sinks.shape)}"
        )
    if not sinks.is_floating_point():
        raise ValueError(f"sinks must be a float tensor, got {sinks.dtype}")
    if sinks.device != q.device:
        raise ValueError(f"sinks are on {sinks.device}, q on {q.device}")


def check_causal(causal, where: str = "ring_attention") -> bool:
    """causal is a bool (numpy's too): it was only tested for truth, so causal="False" ran
    causal on one kernel and was an aten type error on another, and None ran non-causal."""
    kind = type(causal)
    if kind is bool or (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_")):
        return bool(causal)
    raise ValueError(f"{where}: causal must be True or False, got {causal!r}")


MAX_INT64 = (1 << 63) - 1


def check_window(window, causal: bool, where: str = "ring_attention") -> int | None:
    """A sliding window is a positive whole number of keys, and only under the causal mask."""
    if window is None:
        return None
    keys = integer_of(window)  # an integer of any kind (numpy's too), never a bool or float
    if keys is None or not 1 <= keys <= MAX_INT64:  # the agreement sends it as an int64
        raise ValueError(
            f"{where}: window must be an int from 1 to 2**63-1 or None, got {window!r}"
        )
    if not causal:
        raise ValueError(f"{where}: a sliding window needs causal=True")
    return keys


def check_scale(softmax_scale, where: str = "ring_attention") -> float | None:
    """The softmax scale: None (1/sqrt(head_dim)) or a finite number > 0. The fused kernels
    give NaN for a causal block scaled by 0 or less, and NaN or inf spoil every score."""
    if softmax_scale is None:
        return None
    ok = isinstance(softmax_scale, numbers.Real) and not isinstance(softmax_scale, bool)
    if not ok or not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(
            f"{where}: softmax_scale must be a finite number > 0 or None, got {softmax_scale!r}"
        )
    return float(softmax_scale)


def scale_bits(softmax_scale: float | None) -> int:
    """The scale as an int64 that travels in a collective (its float64 bits; 0 for None)."""
    if softmax_scale is None:
        return 0
    return struct.unpack("<q", struct.pack("<d", softmax_scale))[0]


def scale_of(bits: int) -> str:
    """The softmax scale scale_bits made (for a message)."""
    if bits == 0:
        return "default"
    return repr(struct.unpack("<d", struct.pack("<q", bits))[0])


def resolve_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "ring_attention needs an initialised torch.distributed process group: call "
            "torch.distributed.init_process_group(...) first (for one process, world_size=1)"
        )
    if dist.get_rank(group) < 0:
        raise RuntimeError(
            "this process is not a member of the process group given to ring_attention"
        )
    return group


# A refusal this rank found in its caller's input (ringattn.hf's position_ids) that the next
# agreement of the ring raises on every rank, not on this one alone (the others then failed
# on a lost peer). See `refused_together`.
_TOGETHER: contextvars.ContextVar[Exception | None] = contextvars.ContextVar(
    "ringattn_refused_together", default=None
)


@contextmanager
def refused_together(error: Exception | None):
    """Inside: the ring's agreement (``check_ranks_agree``, which every rank of a ring call
    reaches) raises ``error`` on this rank and a ValueError naming this rank on the others.
    None: nothing to refuse."""
    token = _TOGETHER.set(error)
    try:
        yield
    finally:
        _TOGETHER.reset(token)


def pending_refusal() -> Exception | None:
    """The refusal ``refused_together`` holds for the next agreement (hybrid grids read it
    in ``check_grid_agree``, a ring in ``check_ranks_agree``)."""
    return _TOGETHER.get()


# Per document, the shift of its position_ids (position minus its token's index in the
# document) for the documents this rank holds part of: set by ringattn.hf, checked across the
# ring by ``check_ranks_agree``. See `shifts_agreed`.
Shifts = tuple[tuple[int, int], ...]  # (document, shift) pairs
SHIFT_SLOTS = 4  # pairs carried by the agreement itself; more take a second gather
_SHIFTS: contextvars.ContextVar[Shifts] = contextvars.ContextVar(
    "ringattn_shifts_agreed", default=()
)


@contextmanager
def shifts_agreed(shifts: Shifts):
    """Inside: the ring's agreement checks that every rank giving a (document, shift) pair for
    one document gives the same shift. Each rank sees only its own position_ids, so a rank
    whose whole share is shifted (transformers' default 0..S-1 on a contiguous ring's rank 1)
    looks right to itself; RoPE then turns the ranks' disagreement into wrong numbers."""
    token = _SHIFTS.set(tuple(shifts))
    try:
        yield
    finally:
        _SHIFTS.reset(token)


def _pairs_fields(shifts: Shifts, slots: int) -> list[int]:
    """The (document, shift) pairs as ``slots`` pairs of int64 fields (document -1: empty)."""
    padded = [*shifts, *[(-1, 0)] * (slots - len(shifts))]
    return [value for pair in padded[:slots] for value in pair]


def _gathered_shifts(fields: list[list[int]], group, device) -> list[list[int]]:
    """Every rank's (document, shift) fields: those the agreement carried (``fields``: the
    count, then SHIFT_SLOTS pairs), or, when a rank has more, a second gather of them all
    (every rank sees the counts, so every rank takes it or none does)."""
    most = max(f[0] for f in fields)
    if most <= SHIFT_SLOTS:
        return [f[1:] for f in fields]
    return gathered_ints(_pairs_fields(_SHIFTS.get(), most), group, device)


def collective_device(q: torch.Tensor, group) -> torch.device:
    """Where the checks' small collectives run: q's GPU on an NCCL group (NCCL takes CUDA
    tensors only; where q is no CUDA tensor, a rank refusing its input, the rank's current
    device: an NCCL rank sets it, as ringctl's worker does), else the CPU (gloo; a group with
    both backends takes CPU tensors there)."""
    if dist.get_backend(group) != "nccl":
        return torch.device("cpu")
    device = getattr(q, "device", None)
    if device is not None and device.type == "cuda":
        return device
    return torch.device("cuda", torch.cuda.current_device())  # the rank's (set_device)


def gathered_ints(values: list[int], group, device) -> list[list[int]]:
    """Every rank's ``values`` (the same length on each), by one all_gather on ``device``
    (the group's: a CUDA device under NCCL) and one copy back to the host."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return torch.stack(everyone).tolist()


def _check_shifts(everyone: list[list[int]]) -> None:
    """Every rank's shift for each document it shares agrees (raised alike on every rank)."""
    check_shift_pairs(
        (rank, doc, shift)
        for rank, fields in enumerate(everyone)
        for doc, shift in zip(fields[::2], fields[1::2], strict=True)
    )


def check_shift_pairs(triples) -> None:
    """(rank, document, shift) triples from every rank: one shift per document, or a
    ValueError naming the document and two ranks (document -1: an empty slot)."""
    seen: dict[int, tuple[int, int]] = {}
    for rank, doc, shift in triples:
        if doc < 0:
            continue
        first = seen.setdefault(doc, (rank, shift))
        if first[1] != shift:
            raise ValueError(
                f"ringattn: position_ids of document {doc} are shifted differently on rank "
                f"{first[0]} ({first[1]:+d}) and rank {rank} ({shift:+d}) (a row's position "
                "minus its token's index in the document): give each row its position in "
                "its document, or in the sequence for one document "
                "(ringattn.document_positions, or shard_sequence of the positions); "
                "no rank ran the attention"
            )


def agreed_shifts() -> Shifts:
    """The (document, shift) pairs ``shifts_agreed`` holds (hybrid grids compare them in
    ``check_grid_agree``, a ring in ``check_ranks_agree``)."""
    return _SHIFTS.get()


def _describe_agreed(r: tuple[int, ...]) -> str:
    """One rank's agreed fields (``check_ranks_agree``'s row) as its caller passed them."""
    return (
        f"q=({r[0]},{r[1]},{r[2]},{r[3]}) kv_heads={r[4]} dtype={_DTYPES[r[5]]} "
        f"causal={bool(r[6])} layout={LAYOUTS[r[7]] if r[7] >= 0 else '(not given)'} "
        f"sinks={bool(r[8])} "
        f"window={None if r[9] < 0 else r[9]} "
        f"packing={'none' if r[10] < 0 else f'{r[10]:08x}'} "
        f"softmax_scale={scale_of(r[11])}"
    )


# The fields of ``_agreed_fields`` (q's four dimensions and eight more): a rank refusing its
# input gives as many zeros (its q may not even be a 4-D tensor), read by no one.
AGREED_FIELDS = 12


def _agreed_fields(q, k, causal, layout, has_sinks, window, packing, scale) -> list[int]:
    """What every rank of a ring call gives alike (``check_ranks_agree``)."""
    return [
        *q.shape,
        k.shape[2],
        _DTYPES.index(q.dtype),
        int(causal),
        -1 if layout is None else LAYOUTS.index(layout),  # None: not given (ring_attention)
        int(has_sinks),
        -1 if window is None else int(window),
        -1 if packing is None else int(packing),
        scale_bits(scale),
    ]


def check_ranks_agree(
    q: torch.Tensor,
    k: torch.Tensor,
    causal: bool,
    layout: str,
    group: dist.ProcessGroup | None,
    *,
    has_sinks: bool = False,
    window: int | None = None,
    packing: int | None = None,
    scale: float | None = None,
) -> None:
    """All ranks must pass the same shapes: otherwise the ring's transfers mismatch or hang.
    And the same mask and scale: otherwise each rank computes another attention, exit 0."""
    world = dist.get_world_size(group)
    refusal = _TOGETHER.get()
    if world == 1:
        if refusal is not None:
            raise refusal
        return
    device = collective_device(q, group)
    agreed = (
        [0] * AGREED_FIELDS
        if refusal is not None
        else _agreed_fields(q, k, causal, layout, has_sinks, window, packing, scale)
    )
    shifts = _SHIFTS.get()
    found = [len(shifts), *_pairs_fields(shifts, SHIFT_SLOTS), int(refusal is not None)]
    fields = gathered_ints(agreed + found, group, device)
    rows = [tuple(f[: len(agreed)]) for f in fields]
    refusing = [i for i, f in enumerate(fields) if f[-1]]
    if refusal is not None:
        raise refusal
    if refusing:
        raise ValueError(
            f"ringattn: rank {refusing[0]} of the ring refused its input (its error names the "
            "problem); no rank ran the attention"
        )
    if len(set(rows)) > 1:
        detail = "; ".join(f"rank {i}: {_describe_agreed(r)}" for i, r in enumerate(rows))
        raise ValueError(f"ranks disagree on ring_attention inputs: {detail}")
    _check_shifts(_gathered_shifts([f[len(agreed) : -1] for f in fields], group, device))
