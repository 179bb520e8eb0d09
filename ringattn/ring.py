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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .checks import check_inputs, check_ranks_agree, resolve_group
from .comm import RingComm
from .kernels import BlockKernel, default_scale, select_kernel

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


def _plan(step: int, comm: RingComm, seq_local: int, causal: bool, layout: str) -> list[Block]:
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
    comm: RingComm,
    kernel: BlockKernel,
) -> tuple[torch.Tensor, torch.Tensor]:
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
            pending.wait()
            kv.advance()
    assert out is not None and lse is not None
    return out.to(q.dtype), lse


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
    comm: RingComm,
    kernel: BlockKernel,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
            dkv_pending.wait()
            dkv.advance()
        dk_acc, dv_acc = dkv.held
        for kv_rows, dk_b, dv_b in grads:
            dk_acc[:, kv_rows] += dk_b
            dv_acc[:, kv_rows] += dv_b
        del grads
        if world > 1:  # pass it on; after the last step it reaches the block's owner
            dkv_pending = comm.exchange(dkv.held, dkv.landing(), tag=1)
        if kv_pending is not None:
            kv_pending.wait()
            kv.advance()
    if dkv_pending is not None:
        dkv_pending.wait()
        dkv.advance()
    dk_own, dv_own = dkv.held
    return dq.to(q.dtype), dk_own.to(k.dtype), dv_own.to(v.dtype)


class RingAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, causal, layout, group):
        comm = RingComm(group)
        kernel = select_kernel(q)
        out, lse = ring_forward(
            q, k, v, scale=scale, causal=causal, layout=layout, comm=comm, kernel=kernel
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.causal, ctx.layout, ctx.group = scale, causal, layout, group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(
            dout.contiguous(),
            q,
            k,
            v,
            out,
            lse,
            scale=ctx.scale,
            causal=ctx.causal,
            layout=ctx.layout,
            comm=RingComm(ctx.group),
            kernel=select_kernel(q),
        )
        return dq, dk, dv, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    group: dist.ProcessGroup | None = None,
    layout: str = "contiguous",
) -> torch.Tensor:
    """Exact attention over a sequence sharded across the ranks of ``group``.

    q is (batch, seq_local, heads, head_dim) and k, v are (batch, seq_local, kv_heads,
    head_dim), each rank holding its shard in ``layout`` (see ``shard_sequence``). Returns this
    rank's shard of the output; differentiable with respect to q, k and v.
    """
    check_inputs(q, k, v, layout)
    group = resolve_group(group)
    check_ranks_agree(q, k, causal, layout, group)
    scale = default_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    return RingAttentionFunction.apply(q, k, v, scale, causal, layout, group)
