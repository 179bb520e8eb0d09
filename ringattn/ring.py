"""Ring attention as an autograd Function: the forward loop and the backward loop.

Forward, on every rank, for step s = 0 .. P-1 (fewer under a short sliding window: see below):
the rank holds the K/V block of rank
``src = rank - s`` (mod P), posts the transfer of that block to the next rank (and the receipt
of the following one) *before* computing, computes attention of its queries against the block,
and merges the partial result into a running (out, lse) with the online-softmax rule:

    lse' = log(exp(lse) + exp(lse_b)),   out' = out + sigmoid(lse_b - lse) * (out_b - out)

Backward recomputes each block from the saved q, k, v, out and lse (FlashAttention-2), keeps dQ
at home and sends each block's dK/dV accumulator along the ring together with its K/V block;
after P steps every accumulator has visited every rank and arrives back at its owner. (A
windowed ring runs legs of ``hops`` steps instead, ``ring_reach``; each leg's accumulators then
go home in one exchange. A leg of one hop, P = 2 among them, keeps the owner's gradients at
home and sends only the visitor's: one dK/dV transfer instead of two.) The first gradient of
dQ, of a rank's own dK/dV and of an accumulator is the kernel's own output, not an add into
zeros.

Where every token lives and which part of a block is needed is the ring's ``SequenceLayout``
(geometry.py, ``RingSetup.plan``): under a causal mask blocks entirely in the future are
skipped, so their FLOPs are never spent; in the zigzag layout every step after the first costs
every rank exactly half a block. Packed documents (``cu_seqlens``) are the same loop over a
packed layout: pairs of blocks of different documents are never computed, and a ring step
that carries nothing any rank needs is not made. On a leg of one hop (a window's ring, or
P = 2) a block carries only the rows its one holder reads (``SequenceLayout.kv_rows``): under
a window of W keys the neighbour reads the W - 1 rows before its queries, not the whole
block; in a causal zigzag ring of 2 without a window rank 1 reads only the early half of rank
0's block. The leg's dK/dV accumulator covers those rows. Under a sliding window, blocks
entirely behind the window are skipped too and the boundary pieces go to ``BandedKernel``; the
merge then starts from (0, -inf), since the first piece computed may not cover every row.

Both loops are generators that yield each pending exchange they must wait for; the transport
(``comm``) runs them: one rank of a ``torch.distributed`` group (``RingComm``) or P virtual
ranks in one process (``LocalRing``). The same code computes in both.

Attention sinks (gpt-oss): one extra logit ``sink_h`` per query head in every softmax
denominator, with a zero value vector. After the ring, with L the ring's lse and O its output,
the exact result is ``O' = O * sigmoid(L - sink)`` and ``L' = logaddexp(L, sink)``. The block
backward given (O', L') is then exact for q, k, v (the sink's value is zero, so only the
softmax normaliser changes, and D = rowsum(dO' * O') already sees it), and
``d sink_h = -sum over rows of exp(sink_h - L') * rowsum(dO' * O')`` (the softmax gradient of
the sink column, whose dP is zero).
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .checks import (
    check_causal,
    check_inputs,
    check_ranks_agree,
    check_scale,
    check_sinks,
    check_window,
    refused_together,
    resolve_group,
)
from .comm import Endpoint, RingComm, Transport
from .geometry import Block, SequenceLayout
from .kernels import BandedKernel, BlockKernel, default_scale, select_kernel
from .layouts import (
    CuSeqlens,
    check_divisible,
    packed_tokens,
    packing_argument,
    packing_fingerprint,
    ring_geometry,
)
from .shm import ring_transport


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Fold one block's (out, lse) into the running (out, lse), in place, in float32."""
    weight = torch.sigmoid(block_lse - lse).transpose(1, 2).unsqueeze(-1)  # (B, S, H, 1)
    out.lerp_(block_out.to(out.dtype), weight)
    lse.sub_(F.logsigmoid(lse - block_lse))


def _merge_any(out: torch.Tensor, lse: torch.Tensor, block_out, block_lse) -> None:
    """``_merge`` where either side may hold rows with nothing yet (lse -inf: windows)."""
    new = torch.logaddexp(lse, block_lse)
    weight = torch.exp(block_lse - new).nan_to_num(0.0)  # -inf on both sides: weight 0
    out.lerp_(block_out.to(out.dtype), weight.transpose(1, 2).unsqueeze(-1).to(out.dtype))
    lse.copy_(new)


def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Rotation:
    """The block held now, and where the next one lands.

    Blocks land alternately in two buffers, each as large as the largest block that lands in
    it (``arrivals``: the rows of each, in order; a block carries only the rows its holders
    read, ``_LegRows``). When the first block held is the caller's (``owned=False``: K and V,
    saved for backward) both landing buffers are ours, the second allocated only when the ring
    needs it; when it is ours (the dK/dV accumulators), it becomes the second landing buffer
    once it has been sent on (on legs of several hops, where every accumulator is whole). A
    transport may deliver a borrowed block somewhere else (``Endpoint.exchange``'s
    ``borrow``): the block held is then what the exchange received, and the landing buffer
    stays untouched (never paged in).
    """

    def __init__(self, tensors: tuple[torch.Tensor, ...], arrivals: list[int], owned: bool):
        self.held = tensors
        self._like, self._arrivals = tensors, arrivals
        n_new = min(2, len(arrivals)) if not owned else min(1, len(arrivals))
        self._recv = [
            tuple(_flat_buffer(t, max(arrivals[i::2])) for t in tensors) for i in range(n_new)
        ]
        if owned and len(arrivals) > 1:
            if max(arrivals[1::2]) > tensors[0].shape[1]:
                raise AssertionError("a dK/dV accumulator lands in one smaller than itself")
            self._recv.append(tuple(t.view(-1) for t in tensors))
        self._arrived = 0
        self._landing: tuple[torch.Tensor, ...] = ()  # what landing() last handed out
        self.borrowed = False  # is the block held the transport's (valid during the call)?

    def landing(self) -> tuple[torch.Tensor, ...]:
        rows = self._arrivals[self._arrived]
        flats = self._recv[self._arrived % len(self._recv)]
        self._landing = tuple(
            _rows_of(f, like, rows) for f, like in zip(flats, self._like, strict=True)
        )
        return self._landing

    def advance(self, pending) -> None:
        """Hold the block ``pending`` (an exchange into ``landing()``, waited on) received."""
        self.borrowed = pending.received[0] is not self._landing[0]
        self.held = pending.received
        self._arrived += 1


def _flat_buffer(like: torch.Tensor, rows: int) -> torch.Tensor:
    """Room for ``rows`` rows (dim 1) of tensors shaped as ``like``, flat."""
    return torch.empty(like[:, :1].numel() * rows, dtype=like.dtype, device=like.device)


def _rows_of(flat: torch.Tensor, like: torch.Tensor, rows: int) -> torch.Tensor:
    """The start of ``flat`` as a contiguous tensor shaped as ``like`` with ``rows`` rows."""
    shape = (like.shape[0], rows, *like.shape[2:])
    return flat[: like[:, :1].numel() * rows].view(shape)


@dataclass(frozen=True)
class _LegRows:
    """Which rows of K/V blocks travel on one leg, as one rank sees it (rows of the block's
    owner; ``SequenceLayout.kv_rows``: on a one-hop leg those the holder reads, else all):
    ``held[h]``, those of the block held after hop h (all of the own block at hop 0);
    ``sent[h]``, those of it sent on at hop h; ``home``, those of this rank's own block its one
    visitor reads (a one-hop leg's dK/dV accumulator, coming home, covers those)."""

    held: tuple[slice, ...]
    sent: tuple[slice, ...]
    home: slice

    @classmethod
    def of(cls, setup: RingSetup, rank: int, rows: int, shift: int, hops: int) -> _LegRows:
        world, geo = setup.geometry.world_size, setup.geometry
        causal, window = setup.causal, setup.window
        held = [slice(0, rows)]
        sent = []
        for hop in range(1, hops + 1):
            owner = (rank - shift * (hop - 1)) % world  # of the block held before this hop
            sent.append(geo.kv_rows(owner, shift, hops, causal, window))
            held.append(geo.kv_rows((rank - shift * hop) % world, shift, hops, causal, window))
        home = geo.kv_rows(rank, shift, hops, causal, window) if hops else slice(0, rows)
        return cls(tuple(held), tuple(sent), home)

    def arrivals(self) -> list[int]:
        return [s.stop - s.start for s in self.held[1:]]


def _moved(rows: slice, base: int) -> slice:
    """``rows`` of a block counted from ``base`` (the first row a trimmed copy holds)."""
    return slice(rows.start - base, rows.stop - base)


def _rows_sent(held: tuple[torch.Tensor, ...], rows: slice, base: int):
    return tuple(t[:, _moved(rows, base)] for t in held)


@dataclass(frozen=True)
class RingSetup:
    """What every step of one ``ring_attention`` call shares: where the tokens live (the ring's
    ``SequenceLayout``, plain or packed), the mask, the softmax scale, the block kernel and the
    transport."""

    geometry: SequenceLayout
    causal: bool
    window: int | None
    scale: float
    kernel: BlockKernel
    transport: Transport

    def plan(self, step: int, rank: int) -> tuple[Block, ...]:
        return self.geometry.plan(step, rank, self.causal, self.window)

    def legs(self) -> list[tuple[int, int]]:
        """(shift, hops) of each leg of the ring: forward (+1) to the ranks before, then, where
        the ranks after are needed too (a windowed zigzag ring), backward (-1) to those
        (``SequenceLayout.reach``)."""
        forward, backward = self.geometry.reach(self.causal, self.window)
        return [(1, forward)] + ([(-1, backward)] if backward else [])

    @property
    def rows_may_start_empty(self) -> bool:
        """May a query row see nothing in its first block (a window, packed documents,
        padding rows)? Then the merge starts from (0, -inf) instead of step 0's result."""
        geo = self.geometry
        return geo.packed or geo.window_cuts(self.causal, self.window)


def _block_forward(setup: RingSetup, q, k, v, blk: Block):
    if blk.window is not None:
        return _BANDED.forward(q, k, v, scale=setup.scale, offset=blk.offset, window=blk.window)
    if blk.reverse:  # the causal mask's mirror: the causal mask over reversed rows and keys
        out, lse = setup.kernel.forward(*_reversed(q, k, v), scale=setup.scale, causal=True)
        return out.flip(1), lse.flip(2)
    return setup.kernel.forward(q, k, v, scale=setup.scale, causal=blk.causal)


def _block_backward(setup: RingSetup, dout, q, k, v, out, lse, blk: Block):
    if blk.window is not None:
        return _BANDED.backward(
            dout, q, k, v, out, lse, scale=setup.scale, offset=blk.offset, window=blk.window
        )
    if blk.reverse:
        dout, q, k, v, out = _reversed(dout, q, k, v, out)
        grads = setup.kernel.backward(
            dout, q, k, v, out, lse.flip(2), scale=setup.scale, causal=True
        )
        return tuple(g.flip(1) for g in grads)
    return setup.kernel.backward(dout, q, k, v, out, lse, scale=setup.scale, causal=blk.causal)


def _reversed(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(B, S, H, D) tensors with their rows in reverse order (copies: kernels want strides)."""
    return tuple(t.flip(1) for t in tensors)


_BANDED = BandedKernel()


def _leg_steps(shift: int, hops: int, world: int) -> list[int]:
    """The ring step (``SequenceLayout.plan``'s: the block of rank r - step) held after each
    hop."""
    return [(shift * hop) % world for hop in range(hops + 1)]


def _empty_result(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of rows that have seen nothing yet: 0 and -inf, in the accumulation dtype."""
    acc = _accum_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(
        (q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=acc, device=q.device
    )
    return out, lse


def ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, setup: RingSetup, comm: Endpoint
) -> Generator[Any, None, tuple[torch.Tensor, torch.Tensor]]:
    """One rank's forward loop; returns (out in the accumulation dtype, lse)."""
    world = comm.world_size
    own = (k.contiguous(), v.contiguous())
    out = lse = None
    merge = _merge
    if setup.rows_may_start_empty:
        out, lse = _empty_result(q)
        merge = _merge_any
    for leg, (shift, hops) in enumerate(setup.legs()):
        rows = _LegRows.of(setup, comm.rank, k.shape[1], shift, hops)
        kv = _Rotation(own, rows.arrivals(), owned=False)
        for hop, step in enumerate(_leg_steps(shift, hops, world)):
            k_blk, v_blk = kv.held
            base = rows.held[hop].start
            pending = None
            if hop < hops:  # the next block travels while this one is computed
                sent = _rows_sent(kv.held, rows.sent[hop], base)
                pending = comm.exchange(sent, kv.landing(), shift=shift, borrow=True)
            blocks = setup.plan(step, comm.rank)
            for blk in blocks if leg == 0 or hop else ():  # the own block: once, in leg 0
                kv_rows = _moved(blk.kv, base)
                block_out, block_lse = _block_forward(
                    setup, q[:, blk.q], k_blk[:, kv_rows], v_blk[:, kv_rows], blk
                )
                if out is None:  # without a window, step 0 always covers every query row
                    out, lse = block_out.to(_accum_dtype(q.dtype)), block_lse  # ours: fresh
                else:
                    merge(out[:, blk.q], lse[:, :, blk.q], block_out, block_lse)
                del block_out, block_lse
            if pending is not None:
                yield pending
                kv.advance(pending)
    assert out is not None and lse is not None
    return out, lse


def ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    setup: RingSetup,
    comm: Endpoint,
) -> Generator[Any, None, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One rank's backward loop given the global out and lse; returns (dq, dk, dv).

    Each leg sends K/V ``hops`` ranks along with each block's dK/dV accumulator, which finally
    goes home in one exchange (``shift = -shift * hops``; for the plain ring that is one more
    step round). The legs' accumulators of this rank's block are summed. See ``_backward_leg``
    for where an accumulator starts.
    """
    acc = _accum_dtype(q.dtype)
    dq = dk_own = dv_own = None
    saved = (dout, q, k, v, out, lse)
    for leg, (shift, hops) in enumerate(setup.legs()):
        dq, (dk_leg, dv_leg) = yield from _backward_leg(
            saved, dq, setup=setup, comm=comm, shift=shift, hops=hops, own_block=leg == 0
        )
        dk_own = dk_leg if dk_own is None else dk_own.add_(dk_leg)
        dv_own = dv_leg if dv_own is None else dv_own.add_(dv_leg)
    if dq is None:  # no block at all (every row padding, or of documents elsewhere)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    return dq.to(q.dtype), dk_own.to(k.dtype), dv_own.to(v.dtype)


def _backward_leg(saved, dq, *, setup: RingSetup, comm, shift: int, hops: int, own_block: bool):
    """One leg of the backward loop (see ring_backward); returns (dq, this rank's block's dK/dV
    accumulator of the leg). ``saved``: (dout, q, k, v, out, lse).

    Where a block's accumulator starts: with ``hops`` > 1 at its owner, holding the owner's
    gradients, then ``hops`` transfers along and one home (the owner keeps nothing meanwhile).
    With one hop, the owner keeps its own gradients and the accumulator starts at the one
    visitor, which sends it straight home: one transfer instead of two, at the same peak
    memory (the visitor's gradients are the accumulator).
    """
    _, q, k, v, _, _ = saved
    acc = _accum_dtype(q.dtype)
    rows = _LegRows.of(setup, comm.rank, k.shape[1], shift, hops)
    kv = _Rotation((k.contiguous(), v.contiguous()), rows.arrivals(), owned=False)
    keep_own = hops == 1
    whole = slice(0, k.shape[1])
    own = dkv = dkv_pending = None
    for hop, step in enumerate(_leg_steps(shift, hops, comm.world_size)):
        base = rows.held[hop].start
        kv_pending = None
        if hop < hops:
            sent = _rows_sent(kv.held, rows.sent[hop], base)
            kv_pending = comm.exchange(sent, kv.landing(), tag=0, shift=shift, borrow=True)
        blocks = setup.plan(step, comm.rank) if own_block or hop else ()
        dq, grads = _block_grads(setup, saved, kv.held, base, dq, acc, blocks)
        if hop == 0 and keep_own:
            own = _fold(None, grads, whole, k, acc) if grads else None
        elif dkv is None:  # this hop's block's accumulator starts here
            # One hop: the one visitor's, over the rows it read, home once, and this rank's
            # own comes home over the rows its visitor read. More: whole, from the owner,
            # hops + 1 transfers (the last one home).
            if keep_own:
                start, arrivals = rows.held[hop], [rows.home.stop - rows.home.start]
            else:
                start, arrivals = whole, [k.shape[1]] * (hops + 1 if hops else 0)
            dkv = _Rotation(_fold(None, grads, start, k, acc), arrivals, owned=True)
        else:  # the accumulator of the block held now arrived during this hop's compute
            yield dkv_pending
            dkv.advance(dkv_pending)
            _fold(dkv.held, grads, whole, k, acc)
        del grads
        if dkv is not None and hops:
            dkv_pending = _pass_on(comm, dkv, shift, hops, home=hop == hops, keep_own=keep_own)
        if kv_pending is not None:
            yield kv_pending
            kv.advance(kv_pending)
    if dkv_pending is not None:
        yield dkv_pending
        dkv.advance(dkv_pending)
    return dq, _leg_gradients(own, dkv, rows.home if keep_own else whole, k.shape[1])


def _pass_on(comm, dkv, shift: int, hops: int, *, home: bool, keep_own: bool):
    """Send the dK/dV accumulator held one hop along the leg; after the last hop, home to
    its owner (``hops`` back). On its way it is added to, so it is received into our buffer;
    home on a one-hop leg it is only added to the owner's own gradients (``_leg_gradients``),
    so it may be borrowed."""
    return comm.exchange(
        dkv.held,
        dkv.landing(),
        tag=1,
        shift=-shift * hops if home else shift,
        borrow=home and keep_own,
    )


def _leg_gradients(own, dkv, home: slice, rows: int):
    """This rank's block's dK/dV from the leg: the accumulator that came home (over the rows
    ``home`` of ``rows``), plus what the owner kept of its own gradients on a one-hop leg. A
    one-hop leg's accumulator may be a borrowed block (``_pass_on``), valid only during the
    call: it is copied when the owner kept nothing to add it to."""
    if own is not None:
        pairs = zip(own, dkv.held, strict=True)
        return tuple(_add_rows(o, home, t, o.shape, o.dtype) for o, t in pairs)
    held = dkv.held
    if dkv.borrowed and (home.start, home.stop) == (0, rows):  # _add_rows would keep the view
        held = tuple(t.clone() for t in held)
    return tuple(_add_rows(None, home, t, (t.shape[0], rows, *t.shape[2:]), t.dtype) for t in held)


def _block_grads(setup: RingSetup, saved, held, base: int, dq, acc, blocks):
    """The gradients of this hop's blocks against the K/V block ``held`` (its owner's rows
    from ``base`` on): dq accumulated (a new accumulator when None), and [(rows of the
    owner's block, dK, dV)] of each block."""
    dout, q, _, _, out, lse = saved
    k_blk, v_blk = held
    grads = []
    for blk in blocks:
        kv_rows = _moved(blk.kv, base)
        dq_b, dk_b, dv_b = _block_backward(
            setup,
            dout[:, blk.q],
            q[:, blk.q],
            k_blk[:, kv_rows],
            v_blk[:, kv_rows],
            out[:, blk.q],
            lse[:, :, blk.q],
            blk,
        )
        dq = _add_rows(dq, blk.q, dq_b, q.shape, acc)
        grads.append((blk.kv, dk_b, dv_b))
    return dq, grads


def _fold(pair, grads, span: slice, like: torch.Tensor, dtype: torch.dtype):
    """Add each (rows of the owner's block, dK, dV) of ``grads`` into the accumulator pair,
    which covers the rows ``span`` of that block (None: a new one, shaped like ``like`` over
    those rows, zeros where no gradient lands); returns the pair."""
    dk, dv = pair if pair is not None else (None, None)
    shape = (like.shape[0], span.stop - span.start, *like.shape[2:])
    for rows, dk_b, dv_b in grads:
        dk = _add_rows(dk, _moved(rows, span.start), dk_b, shape, dtype)
        dv = _add_rows(dv, _moved(rows, span.start), dv_b, shape, dtype)
    if dk is None:
        dk = torch.zeros(shape, dtype=dtype, device=like.device)
        dv = torch.zeros_like(dk)
    return dk, dv


def _add_rows(acc, rows: slice, grad: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    """``acc[:, rows] += grad``. A missing ``acc`` starts as the gradient itself when it covers
    every row (a kernel's fresh output: no zero fill, no add), else as zeros holding it."""
    if acc is not None:
        acc[:, rows].add_(grad)
        return acc
    start, stop, step = rows.indices(shape[1])
    if (start, stop, step) == (0, shape[1], 1):
        grad = grad.to(dtype)
        return grad if grad.is_contiguous() else grad.contiguous()
    acc = torch.zeros(shape, dtype=dtype, device=grad.device)
    acc[:, rows] = grad
    return acc


def _shards(t: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """The ranks' shards of t (views), given one after another along the sequence dim."""
    return list(t.chunk(parts, dim=1)) if parts > 1 else [t]


def _join(pieces: list[torch.Tensor], dim: int) -> torch.Tensor:
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """Fold one sink logit per head (zero value) into the ring's (out, lse), in place."""
    sink = sinks.to(lse.dtype)[None, :, None]  # (1, H, 1) against lse (B, H, S)
    out.mul_(torch.sigmoid(lse - sink).transpose(1, 2).unsqueeze(-1).to(out.dtype))
    lse.copy_(torch.logaddexp(lse, sink))


def sink_grad(
    dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, rows: int
) -> torch.Tensor:
    """-sum_{b,i} exp(sink_h - lse) * rowsum(dout * out), in float32 (float64 for float64),
    ``rows`` query rows at a time so no full-size float32 copy of out or dout is made."""
    acc = _accum_dtype(out.dtype)
    grad = torch.zeros(sinks.shape, dtype=acc, device=out.device)
    sink = sinks.to(acc)[None, :, None]
    for r0 in range(0, out.shape[1], rows):
        sl = slice(r0, r0 + rows)
        delta = (dout[:, sl].to(acc) * out[:, sl].to(acc)).sum(-1).transpose(1, 2)  # (B, H, s)
        grad -= (torch.exp(sink - lse[:, :, sl].to(acc)) * delta).sum((0, 2))
    return grad.to(sinks.dtype)


def _forward_all(q, k, v, sinks, setup: RingSetup):
    """Every local rank's forward; the output (q's dtype) and lse of all of them, joined."""
    ranks = setup.transport.endpoints()
    parts = [_shards(t, len(ranks)) for t in (q, k, v)]
    loops = [
        ring_forward(qr, kr, vr, setup=setup, comm=rank)
        for rank, qr, kr, vr in zip(ranks, *parts, strict=True)
    ]
    results = setup.transport.drive(loops, device=q.device)
    outs, lses = [], []
    for i, (out_acc, lse) in enumerate(results):
        if sinks is not None:
            apply_sinks(out_acc, lse, sinks)
        outs.append(out_acc.to(q.dtype))
        lses.append(lse)
        results[i] = None  # free this rank's float32 accumulator before the next cast
    return _join(outs, 1), _join(lses, 2)


def _backward_all(dout, q, k, v, out, lse, setup: RingSetup):
    ranks = setup.transport.endpoints()
    parts = [_shards(t, len(ranks)) for t in (dout, q, k, v, out)]
    lse_parts = list(lse.chunk(len(ranks), dim=2)) if len(ranks) > 1 else [lse]
    loops = [
        ring_backward(d, qr, kr, vr, o, lr, setup=setup, comm=rank)
        for rank, d, qr, kr, vr, o, lr in zip(ranks, *parts, lse_parts, strict=True)
    ]
    results = setup.transport.drive(loops, device=q.device)
    return tuple(_join([r[i] for r in results], 1) for i in range(3))


class RingAttentionFunction(torch.autograd.Function):
    """The ring's forward and backward as one autograd node. Both run with autocast off: the
    inputs' dtype decides the precision (under a bf16 autocast the matmul kernels computed in
    bf16 what the fused ones computed in float32, 9.9e-3 off for float32 inputs, by which
    kernel a shape picked)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, setup: RingSetup):
        # torch's fused CPU op reads q as if head_dim had stride 1: a q of the same values with
        # stride 2 there gave outputs and gradients 1.4 off, no error. Only such inputs are
        # copied (a transposed one reads right, and the hybrid all-to-all's never are whole).
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        with _without_autocast(q.device):
            out, lse = _forward_all(q, k, v, sinks, setup)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.setup = setup
        return out

    @staticmethod
    def backward(ctx, dout):
        if torch.is_grad_enabled():  # backward(create_graph=True): a second order
            raise RuntimeError(SECOND_ORDER)
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        with _without_autocast(q.device):
            dq, dk, dv = _backward_all(dout, q, k, v, out, lse, ctx.setup)
            dsinks = None
            if sinks is not None and ctx.needs_input_grad[3]:
                dout = _padding_zeroed(dout, ctx.setup)
                rows = max(1, 2**24 // out[0, 0].numel())
                dsinks = sink_grad(dout, out, lse, sinks, rows=rows)
        return dq, dk, dv, dsinks, None


def _without_autocast(device: torch.device):
    """Autocast off on ``device`` (nothing to turn off where it has none: meta tensors)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


# The backward's ops read the saved out/lse as constants, so a second order through them was
# wrong (2.13 off against 1.37); torch's once_differentiable then cut the graph instead, and
# hessian, hvp and jacobian(create_graph=True) read the missing link as zeros (|H| 0.0 against
# 0.267). Refused where the backward is asked to build a graph.
SECOND_ORDER = (
    "ring_attention: second-order gradients are not implemented (a backward with "
    "create_graph=True: hessian, hvp, gradient penalties); its first-order gradients are exact"
)


def _padding_zeroed(dout: torch.Tensor, setup: RingSetup) -> torch.Tensor:
    """``dout`` with the packed layout's padding rows zeroed (a copy; dout itself where there
    are none), as the ring's own backward leaves them out: their output is 0, and an inf or
    NaN there, which no real row sees, made the sink gradient NaN (inf * 0)."""
    geo = setup.geometry
    if not geo.padding:
        return dout
    ranks = setup.transport.endpoints()
    pad = [p < 0 for r in ranks for p in geo.positions(r.rank)]
    if not any(pad):
        return dout
    rows = torch.tensor(pad, device=dout.device)[None, :, None, None]
    return dout.masked_fill(rows, 0)


def _transport(q, k, causal, layout, sinks, group, comm, window, packing, scale) -> Transport:
    """The transport to run on: the process group's ring (checked), or the one given."""
    agreed = dict(has_sinks=sinks is not None, window=window, packing=packing, scale=scale)
    if comm is None:
        group = resolve_group(group)
        check_ranks_agree(q, k, causal, layout, group, **agreed)
        return ring_transport(group)
    if group is not None:
        raise ValueError("ring_attention: pass either group= or comm=, not both")
    if isinstance(comm, RingComm):
        check_ranks_agree(q, k, causal, layout, comm.group, **agreed)
    return comm


def _refuse_with_the_ring(err: Exception, q, group, comm) -> None:
    """Raise this rank's refusal of its own input in the ring's agreement, which every rank of
    the call reaches (``refused_together``): raised alone here, it left the other ranks
    waiting in their agreement until the process group's timeout (30 minutes by default).
    Returns (the caller raises ``err``) where no ring is there to tell: no process group, a
    ring of one, a transport of one process (LocalRing)."""
    if comm is None:
        if not dist.is_available() or not dist.is_initialized():
            return
        try:
            group = resolve_group(group)
        except RuntimeError:
            return
    elif isinstance(comm, RingComm) and group is None:
        group = comm.group
    else:
        return
    with refused_together(err):
        check_ranks_agree(q, None, False, "contiguous", group)


def ring_geometry_of(q: torch.Tensor, transport: Transport, layout: str, cu_seqlens):
    """The ring's layout for this call: q holds ``len(endpoints)`` shards of one ring of
    ``transport.world_size`` ranks."""
    world = transport.world_size
    local = len(transport.endpoints())
    if cu_seqlens is None:
        if local > 1:  # the shards of several ranks, one after another
            check_divisible(q.shape[1], world_size=local, layout=layout)
        return ring_geometry(q.shape[1] // local * world, world_size=world, layout=layout)
    geo = ring_geometry(
        packed_tokens(cu_seqlens), world_size=world, layout=layout, cu_seqlens=cu_seqlens
    )
    if q.shape[1] != geo.rows * local:
        held = f", {geo.rows * local} for the {local} ranks q holds" if local > 1 else ""
        raise ValueError(
            f"q holds {q.shape[1]} rows; the packed layout of cu_seqlens (N={geo.tokens}) over "
            f"{world} ranks gives each rank {geo.rows}{held}: shard q, k and v with "
            "shard_sequence(..., cu_seqlens=cu_seqlens)"
        )
    return geo


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    group: dist.ProcessGroup | None = None,
    layout: str | None = None,
    sinks: torch.Tensor | None = None,
    comm: Transport | None = None,
    window: int | None = None,
    cu_seqlens: CuSeqlens | None = None,
) -> torch.Tensor:
    """Exact attention over a sequence sharded across the ranks of ``group``.

    q is (batch, seq_local, heads, head_dim) and k, v are (batch, seq_local, kv_heads,
    head_dim), each rank holding its shard in ``layout`` (see ``shard_sequence``; required on
    a ring of more than one rank: a ring cannot tell its ranks' rows apart, and a default
    computed another attention without an error where the shards were zigzag). Returns this
    rank's shard of the output; differentiable with respect to q, k, v and ``sinks``.

    ``sinks``: optional float tensor of shape (heads,): one extra logit per query head in every
    softmax denominator, with a zero value vector (gpt-oss). Its gradient is this rank's share
    (the sum over its own rows); sum it over the ranks as for any replicated parameter.

    ``window``: a sliding window (causal only): the query at global position i sees the keys
    at positions i - window < j <= i (transformers' ``sliding_window``); None: no window.
    Blocks behind the window are never computed.

    ``cu_seqlens``: packed documents (``[0, l1, l1+l2, ..., N]``, flash-attn's varlen
    convention, or ``pack_sequence``'s layout), each query seeing only the keys of its own
    document (and, within it, the causal mask and the window). q, k, v are then this rank's
    rows of ``shard_sequence(..., cu_seqlens=cu_seqlens)``; padding rows give zeros. Shard
    with the very packing passed here: ``pack_sequence(cu, balance_window=W)`` places the
    tokens differently from ``cu`` itself with the same rows per rank, and this call cannot see
    how q was cut (a wrong result, no error; ``ringattn.hf`` checks the positions it is given).
    The ranks may pass the packing in different forms (a list, a tensor, its layout).

    ``comm``: the transport, default the ring of ``group``'s processes. With
    ``ringattn.local_ring.LocalRing(P)`` one process runs all P ranks: q, k, v (and the result)
    then hold the P shards one after another along the sequence dimension.
    """
    given, layout = layout, "contiguous" if layout is None else layout
    try:
        check_inputs(q, k, v, layout, packed=cu_seqlens is not None)
        check_sinks(sinks, q)
        causal = check_causal(causal)
        window = check_window(window, causal)
        softmax_scale = check_scale(softmax_scale)
        cu_seqlens = packing_argument(cu_seqlens)
        packing = None if cu_seqlens is None else packing_fingerprint(cu_seqlens)
    except (ValueError, TypeError) as err:
        _refuse_with_the_ring(err, q, group, comm)
        raise
    # the layout as given (None: not) in the agreement: a rank leaving it out beside one
    # naming it is a disagreement every rank raises, not one rank's refusal
    transport = _transport(q, k, causal, given, sinks, group, comm, window, packing, softmax_scale)
    if given is None and transport.world_size > 1:  # after the agreement: every rank alike
        raise ValueError(
            "ring_attention: layout= is required on a ring of more than one rank: the layout "
            "q, k and v were sharded with ('zigzag' or 'contiguous', as given to "
            "shard_sequence); a ring cannot tell its ranks' rows apart, and the wrong one "
            "computes another attention without an error"
        )
    geometry = ring_geometry_of(q, transport, layout, cu_seqlens)
    return ring_attention_on(
        q,
        k,
        v,
        geometry,
        causal=causal,
        window=window,
        softmax_scale=softmax_scale,
        sinks=sinks,
        transport=transport,
    )


def ring_attention_on(
    q,
    k,
    v,
    geometry: SequenceLayout,
    *,
    causal: bool,
    window,
    softmax_scale,
    sinks,
    transport: Transport,
) -> torch.Tensor:
    """``ring_attention`` on a layout and transport already checked (``hybrid_attention``'s
    ring)."""
    scale = default_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    setup = RingSetup(geometry, causal, window, scale, select_kernel(q), transport)
    return RingAttentionFunction.apply(q, k, v, sinks, setup)
