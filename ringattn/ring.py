"""Ring attention as an autograd Function: the forward loop and the backward loop.

Forward, on every rank, for step s = 0 .. P-1: the rank holds the K/V block of rank
``src = rank - s`` (mod P), posts the transfer of that block to the next rank (and the receipt
of the following one) *before* computing, computes attention of its queries against the block,
and merges the partial result into a running (out, lse) with the online-softmax rule:

    lse' = log(exp(lse) + exp(lse_b)),   out' = out + sigmoid(lse_b - lse) * (out_b - out)

Backward recomputes each block from the saved q, k, v, out and lse (FlashAttention-2), keeps dQ
at home and sends each block's dK/dV accumulator along the ring together with its K/V block;
after P steps every accumulator has visited every rank and arrives back at its owner.

Under a causal mask, ``block_plan`` says which part of a block is needed: blocks entirely in the
future are skipped, so their FLOPs are never spent; in the zigzag layout every step after the
first costs every rank exactly half a block.

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

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .checks import check_inputs, check_ranks_agree, check_sinks, resolve_group
from .comm import Endpoint, RingComm, Transport
from .kernels import BlockKernel, default_scale, select_kernel
from .layouts import check_divisible

ALL = slice(None)


@dataclass(frozen=True)
class Block:
    """The part of one ring step to compute: query rows x key rows, and whether it is diagonal."""

    q: slice
    kv: slice
    causal: bool


def block_plan(
    *, step: int, rank: int, world_size: int, seq_local: int, causal: bool, layout: str
) -> list[Block]:
    src = (rank - step) % world_size
    if not causal:
        return [Block(ALL, ALL, False)]
    if src == rank:
        return [Block(ALL, ALL, True)]
    if layout == "contiguous":
        return [Block(ALL, ALL, False)] if src < rank else []
    # zigzag: this rank holds chunks (rank, 2P-1-rank); the block holds (src, 2P-1-src).
    half = seq_local // 2
    if src < rank:  # both query chunks see the block's early chunk, neither its late one
        return [Block(ALL, slice(0, half), False)]
    return [Block(slice(half, None), ALL, False)]  # only the late query chunk sees it, whole


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Fold one block's (out, lse) into the running (out, lse), in place, in float32."""
    weight = torch.sigmoid(block_lse - lse).transpose(1, 2).unsqueeze(-1)  # (B, S, H, 1)
    out.lerp_(block_out.to(out.dtype), weight)
    lse.sub_(F.logsigmoid(lse - block_lse))


def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Rotation:
    """The block held now, and where the next one lands.

    Blocks land alternately in two buffers. When the first block held is the caller's
    (``owned=False``: K and V, saved for backward) both landing buffers are ours, the second
    allocated only when the ring needs it; when it is ours (the dK/dV accumulators), it becomes
    the second landing buffer once it has been sent on.
    """

    def __init__(self, tensors: tuple[torch.Tensor, ...], transfers: int, owned: bool) -> None:
        self.held = tensors
        n_new = min(2, transfers) if not owned else min(1, transfers)
        self._recv = [tuple(torch.empty_like(t) for t in tensors) for _ in range(n_new)]
        if owned and transfers > 1:
            self._recv.append(tensors)
        self._arrived = 0

    def landing(self) -> tuple[torch.Tensor, ...]:
        return self._recv[self._arrived % len(self._recv)]

    def advance(self) -> None:
        self.held = self.landing()
        self._arrived += 1


def _plan(step: int, comm: Endpoint, seq_local: int, causal: bool, layout: str) -> list[Block]:
    return block_plan(
        step=step, rank=comm.rank, world_size=comm.world_size, seq_local=seq_local,
        causal=causal, layout=layout,
    )  # fmt: skip


def ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    layout: str,
    comm: Endpoint,
    kernel: BlockKernel,
) -> Generator[Any, None, tuple[torch.Tensor, torch.Tensor]]:
    """One rank's forward loop; returns (out in the accumulation dtype, lse)."""
    world = comm.world_size
    kv = _Rotation((k.contiguous(), v.contiguous()), transfers=world - 1, owned=False)
    out = lse = None
    for step in range(world):
        k_blk, v_blk = kv.held
        pending = None
        if step + 1 < world:  # the next block travels while this one is computed
            pending = comm.exchange(kv.held, kv.landing())
        for blk in _plan(step, comm, q.shape[1], causal, layout):
            block_out, block_lse = kernel.forward(
                q[:, blk.q], k_blk[:, blk.kv], v_blk[:, blk.kv], scale=scale, causal=blk.causal
            )
            if out is None:  # step 0 always covers every query row
                out = block_out.to(_accum_dtype(q.dtype))
                lse = block_lse.clone()
            else:
                _merge(out[:, blk.q], lse[:, :, blk.q], block_out, block_lse)
            del block_out, block_lse
        if pending is not None:
            yield pending
            kv.advance()
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
    scale: float,
    causal: bool,
    layout: str,
    comm: Endpoint,
    kernel: BlockKernel,
) -> Generator[Any, None, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One rank's backward loop given the global out and lse; returns (dq, dk, dv)."""
    world = comm.world_size
    acc = _accum_dtype(q.dtype)
    kv = _Rotation((k.contiguous(), v.contiguous()), transfers=world - 1, owned=False)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    zeros = (torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros_like(k, dtype=acc))
    # P transfers of each accumulator: the last one delivers it to the block's owner.
    dkv = _Rotation(zeros, transfers=world if world > 1 else 0, owned=True)
    dkv_pending = None
    for step in range(world):
        k_blk, v_blk = kv.held
        kv_pending = None
        if step + 1 < world:
            kv_pending = comm.exchange(kv.held, kv.landing(), tag=0)
        grads = []
        for blk in _plan(step, comm, q.shape[1], causal, layout):
            dq_b, dk_b, dv_b = kernel.backward(
                dout[:, blk.q], q[:, blk.q], k_blk[:, blk.kv], v_blk[:, blk.kv],
                out[:, blk.q], lse[:, :, blk.q], scale=scale, causal=blk.causal,
            )  # fmt: skip
            dq[:, blk.q] += dq_b
            grads.append((blk.kv, dk_b, dv_b))
            del dq_b
        # The accumulator of the block held now arrived during this step's compute.
        if dkv_pending is not None:
            yield dkv_pending
            dkv.advance()
        dk_acc, dv_acc = dkv.held
        for kv_rows, dk_b, dv_b in grads:
            dk_acc[:, kv_rows] += dk_b
            dv_acc[:, kv_rows] += dv_b
        del grads
        if world > 1:  # pass it on; after the last step it reaches the block's owner
            dkv_pending = comm.exchange(dkv.held, dkv.landing(), tag=1)
        if kv_pending is not None:
            yield kv_pending
            kv.advance()
    if dkv_pending is not None:
        yield dkv_pending
        dkv.advance()
    dk_own, dv_own = dkv.held
    return dq.to(q.dtype), dk_own.to(k.dtype), dv_own.to(v.dtype)


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


def _forward_all(q, k, v, sinks, scale, causal, layout, transport, kernel):
    """Every local rank's forward; the output (q's dtype) and lse of all of them, joined."""
    ranks = transport.endpoints()
    parts = [_shards(t, len(ranks)) for t in (q, k, v)]
    loops = [
        ring_forward(qr, kr, vr, scale=scale, causal=causal, layout=layout, comm=rank,
                     kernel=kernel)
        for rank, qr, kr, vr in zip(ranks, *parts, strict=True)
    ]  # fmt: skip
    results = transport.drive(loops, device=q.device)
    outs, lses = [], []
    for i, (out_acc, lse) in enumerate(results):
        if sinks is not None:
            apply_sinks(out_acc, lse, sinks)
        outs.append(out_acc.to(q.dtype))
        lses.append(lse)
        results[i] = None  # free this rank's float32 accumulator before the next cast
    return _join(outs, 1), _join(lses, 2)


def _backward_all(dout, q, k, v, out, lse, scale, causal, layout, transport, kernel):
    ranks = transport.endpoints()
    parts = [_shards(t, len(ranks)) for t in (dout, q, k, v, out)]
    lse_parts = list(lse.chunk(len(ranks), dim=2)) if len(ranks) > 1 else [lse]
    loops = [
        ring_backward(d, qr, kr, vr, o, lr, scale=scale, causal=causal, layout=layout,
                      comm=rank, kernel=kernel)
        for rank, d, qr, kr, vr, o, lr in zip(ranks, *parts, lse_parts, strict=True)
    ]  # fmt: skip
    results = transport.drive(loops, device=q.device)
    return tuple(_join([r[i] for r in results], 1) for i in range(3))


class RingAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, scale, causal, layout, transport):
        kernel = select_kernel(q)
        out, lse = _forward_all(q, k, v, sinks, scale, causal, layout, transport, kernel)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.scale, ctx.causal, ctx.layout, ctx.transport = scale, causal, layout, transport
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = _backward_all(
            dout, q, k, v, out, lse, ctx.scale, ctx.causal, ctx.layout, ctx.transport,
            select_kernel(q),
        )  # fmt: skip
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            dsinks = sink_grad(dout, out, lse, sinks, rows=max(1, 2**24 // out[0, 0].numel()))
        return dq, dk, dv, dsinks, None, None, None, None


def _transport(q, k, causal, layout, sinks, group, comm) -> Transport:
    """The transport to run on: the process group's ring (checked), or the one given."""
    if comm is None:
        group = resolve_group(group)
        check_ranks_agree(q, k, causal, layout, group, has_sinks=sinks is not None)
        return RingComm(group)
    if group is not None:
        raise ValueError("ring_attention: pass either group= or comm=, not both")
    if isinstance(comm, RingComm):
        check_ranks_agree(q, k, causal, layout, comm.group, has_sinks=sinks is not None)
        return comm
    local = len(comm.endpoints())
    if local > 1:  # the shards of several ranks, one after another
        check_divisible(q.shape[1], world_size=local, layout=layout)
    return comm


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    group: dist.ProcessGroup | None = None,
    layout: str = "contiguous",
    sinks: torch.Tensor | None = None,
    comm: Transport | None = None,
) -> torch.Tensor:
    """Exact attention over a sequence sharded across the ranks of ``group``.

    q is (batch, seq_local, heads, head_dim) and k, v are (batch, seq_local, kv_heads,
    head_dim), each rank holding its shard in ``layout`` (see ``shard_sequence``). Returns this
    rank's shard of the output; differentiable with respect to q, k, v and ``sinks``.

    ``sinks``: optional float tensor of shape (heads,): one extra logit per query head in every
    softmax denominator, with a zero value vector (gpt-oss). Its gradient is this rank's share
    (the sum over its own rows); sum it over the ranks as for any replicated parameter.

    ``comm``: the transport, default the ring of ``group``'s processes. With
    ``ringattn.local_ring.LocalRing(P)`` one process runs all P ranks: q, k, v (and the result)
    then hold the P shards one after another along the sequence dimension.
    """
    check_inputs(q, k, v, layout)
    check_sinks(sinks, q)
    transport = _transport(q, k, causal, layout, sinks, group, comm)
    scale = default_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    return RingAttentionFunction.apply(q, k, v, sinks, scale, causal, layout, transport)
