"""The DeepSpeed-Ulysses all-to-all: trade a sequence shard for a head shard inside a group.

Inside a group of U ranks each holding S tokens of every head, ``seq_to_heads`` leaves each
rank with the group's U x S tokens for 1/U of the heads (member j gets head block j, and
the tokens arrive in member order); ``heads_to_seq`` is its exact inverse. Several tensors with
the same (batch, seq, head_dim) and dtype travel in *one* all-to-all, packed along the head
axis: q, k and v cost one collective's latency, not three.

Both moves are permutations of data, so each one's backward is the other one applied to the
gradients (``SeqToHeads`` and ``HeadsToSeq``): nothing is recomputed, nothing is summed.
``torch.distributed.all_to_all_single`` does the exchange; gloo implements it on CPU for every
dtype the engine takes (checked on torch 2.13 for float16, bfloat16, float32 and float64), and
NCCL on GPUs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class AllToAllStats:
    """Seconds spent in all-to-alls and bytes each rank sent to others, since the last reset."""

    seconds: float = 0.0
    bytes_sent: int = 0
    calls: int = 0
    enabled: bool = False

    def reset(self, enabled: bool = True) -> None:
        self.seconds, self.bytes_sent, self.calls, self.enabled = 0.0, 0, 0, enabled


STATS = AllToAllStats()


def _exchange(send: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Block j of ``send`` (dim 0) goes to member j; block j of the result came from member j."""
    recv = torch.empty_like(send)
    start = time.perf_counter() if STATS.enabled else 0.0
    dist.all_to_all_single(recv, send, group=group)
    if STATS.enabled:
        if send.is_cuda:
            torch.cuda.synchronize(send.device)
        STATS.seconds += time.perf_counter() - start
        block = send[0].numel() * send.element_size()
        STATS.bytes_sent += block * (send.shape[0] - 1)  # our own block stays here
        STATS.calls += 1
    return recv


def _packed(pieces: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """One (U, B, S, sum h, D) send buffer from (U, B, S, h_i, D) views: one copy each."""
    u, b, s, _, d = pieces[0].shape
    widths = [p.shape[3] for p in pieces]
    send = torch.empty((u, b, s, sum(widths), d), dtype=pieces[0].dtype, device=pieces[0].device)
    offset = 0
    for piece, width in zip(pieces, widths, strict=True):
        send[:, :, :, offset : offset + width].copy_(piece)
        offset += width
    return send, widths


def _unpacked(recv: torch.Tensor, widths: list[int]) -> list[torch.Tensor]:
    offsets = [sum(widths[:i]) for i in range(len(widths))]
    return [recv[:, :, :, o : o + w] for o, w in zip(offsets, widths, strict=True)]


def seq_to_heads(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None
) -> list[torch.Tensor]:
    """(B, S, H_i, D) each -> (B, U*S, H_i/U, D) each: head block j of every member to member j."""
    u = dist.get_world_size(group)
    # Member j's block: every token of ours, heads [j*h, (j+1)*h).
    pieces = [t.unflatten(2, (u, t.shape[2] // u)).permute(2, 0, 1, 3, 4) for t in tensors]
    send, widths = _packed(pieces)
    recv = _exchange(send, group)  # block j: member j's tokens, our heads
    b, s, d = recv.shape[1], recv.shape[2], recv.shape[4]
    return [
        part.permute(1, 0, 2, 3, 4).reshape(b, u * s, part.shape[3], d)
        for part in _unpacked(recv, widths)
    ]


def heads_to_seq(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None
) -> list[torch.Tensor]:
    """(B, U*S, h_i, D) each -> (B, S, U*h_i, D) each: the inverse of ``seq_to_heads``."""
    u = dist.get_world_size(group)
    # Member j's block: member j's tokens, our heads.
    pieces = [t.unflatten(1, (u, t.shape[1] // u)).permute(1, 0, 2, 3, 4) for t in tensors]
    send, widths = _packed(pieces)
    recv = _exchange(send, group)  # block j: our tokens, member j's heads
    b, s, d = recv.shape[1], recv.shape[2], recv.shape[4]
    return [
        part.permute(1, 2, 0, 3, 4).reshape(b, s, u * part.shape[3], d)
        for part in _unpacked(recv, widths)
    ]


class SeqToHeads(torch.autograd.Function):
    """``seq_to_heads`` forward; its backward sends the gradients back with ``heads_to_seq``."""

    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        return tuple(seq_to_heads(tensors, group))

    @staticmethod
    def backward(ctx, *grads):
        return (None, *heads_to_seq([g.contiguous() for g in grads], ctx.group))


class HeadsToSeq(torch.autograd.Function):
    """``heads_to_seq`` forward; its backward sends the gradients back with ``seq_to_heads``."""

    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        return tuple(heads_to_seq(tensors, group))

    @staticmethod
    def backward(ctx, *grads):
        return (None, *seq_to_heads([g.contiguous() for g in grads], ctx.group))
