"""The ring: every rank sends to the next and receives from the previous, asynchronously.

Ring order is group-rank order. A placement plan (``ringctl topo``) decides the order by
giving each process the rank equal to its ring position, so the engine needs no order of its
own. ``RingComm.exchange`` posts both transfers and returns at once; the caller computes on
the block it holds and waits only when it needs the next one. Time spent blocked in ``wait``
is the communication that compute did not hide; ``CommStats`` records it for benchmarks.

The ring loops (``ringattn.ring``) are generators that *yield* each pending exchange they must
wait for. A transport runs them: ``RingComm`` (this process is one rank of a
``torch.distributed`` group) simply waits on what is yielded; ``ringattn.local_ring.LocalRing``
runs P virtual ranks in one process, in lock step, delivering blocks between them. The loop,
kernels, merge and backward are the same code for both. On NCCL ``wait`` only makes the
current stream wait for NCCL's stream: nothing in the loop synchronises with the host.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """Seconds blocked waiting for transfers, and bytes sent, since the last reset."""

    wait_s: float = 0.0
    bytes_sent: int = 0
    exchanges: int = 0
    enabled: bool = False
    waits: list[float] = field(default_factory=list)

    def reset(self, enabled: bool = True) -> None:
        self.wait_s, self.bytes_sent, self.exchanges, self.enabled = 0.0, 0, 0, enabled
        self.waits = []


STATS = CommStats()


class PendingExchange:
    """Posted transfers; after ``wait``, ``received`` holds the block that came in."""

    def __init__(
        self, requests: list, received: Sequence[torch.Tensor], sent: Sequence[torch.Tensor] = ()
    ) -> None:
        self._requests = requests
        self.received = tuple(received)
        self._sent = tuple(sent)  # alive until the transfer is done (a copy made to send)

    def wait(self) -> None:
        start = time.perf_counter() if STATS.enabled else 0.0
        for req in self._requests:
            req.wait()
        if STATS.enabled:
            elapsed = time.perf_counter() - start
            STATS.wait_s += elapsed
            STATS.waits.append(elapsed)


class Endpoint(Protocol):
    """One rank's view of the ring, as the loop uses it."""

    rank: int
    world_size: int

    def exchange(
        self,
        send: Sequence[torch.Tensor],
        recv: Sequence[torch.Tensor],
        *,
        tag: int = 0,
        shift: int = 1,
        borrow: bool = False,
    ) -> Any: ...


class Transport(Protocol):
    """Runs ring loops: one per rank that lives in this process."""

    world_size: int

    def endpoints(self) -> Sequence[Endpoint]: ...

    def drive(self, loops: Sequence[Generator[Any, None, Any]], device=None) -> list[Any]: ...


def run_loop(loop: Generator[Any, None, Any]) -> Any:
    """Run one rank's loop to its end, waiting on every exchange it yields; its result."""
    try:
        while True:
            next(loop).wait()
    except StopIteration as stop:
        return stop.value


def travels_batched(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether a ring exchange of these tensors is posted as one ``batch_isend_irecv``: for
    CUDA tensors (NCCL), whatever the group's backend string says. Posted as separate
    isend/irecv, NCCL builds a communicator per pair lazily at the first send, which waits
    for its peer, itself waiting in its own first send to the next rank: a ring of them can
    hang (NCCL asks for a send and its matching receive in one group). A group made by
    ``init_process_group()`` with no backend reports "undefined" (and "cpu:gloo,cuda:nccl"
    where named so), not "nccl": such a ring took the separate path. CPU tensors go by
    isend/irecv, matched by tag (gloo)."""
    return any(t.is_cuda for t in tensors)


class RingComm:
    """This process as one rank of a ``torch.distributed`` ring (endpoint and transport)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._global = (  # through self.group: a subclass may hold it weakly (shm)
            (lambda r: r) if group is None else (lambda r: dist.get_global_rank(self.group, r))
        )
        self.next_rank = self._peer(1)
        self.prev_rank = self._peer(-1)

    def _peer(self, shift: int) -> int:
        """The global rank ``shift`` places along the ring (negative: backwards)."""
        return self._global((self.rank + shift) % self.world_size)

    def endpoints(self) -> list[RingComm]:
        return [self]

    def drive(self, loops: Sequence[Generator[Any, None, Any]], device=None) -> list[Any]:
        return [run_loop(loop) for loop in loops]

    def exchange(
        self,
        send: Sequence[torch.Tensor],
        recv: Sequence[torch.Tensor],
        *,
        tag: int = 0,
        shift: int = 1,
        borrow: bool = False,
    ) -> PendingExchange:
        """Send the tensors ``send`` to the next rank and receive the previous rank's into
        ``recv`` (same shapes), all at once; no tensor is copied or packed unless it is
        strided (some rows of a batch's block). ``shift`` other
        than 1: to rank + shift, from rank - shift (a windowed ring's backward leg, and the
        accumulators' trip home). After ``wait`` the block is the exchange's ``received``.

        ``borrow``: the caller only reads the block, and only until its next exchange on this
        stream is waited on or the ring call ends; a transport may then hand back a buffer of
        its own as ``received`` instead of filling ``recv`` (shared memory: the slot itself).
        Here ``received`` is always ``recv``.

        ``tag`` keeps the K/V stream and the dK/dV stream of the backward pass apart on
        backends that match messages by tag (gloo); NCCL orders them by posting order.
        """
        to, source = (
            (self.next_rank, self.prev_rank)
            if shift == 1
            else (self._peer(shift), self._peer(-shift))
        )
        if STATS.enabled:
            STATS.bytes_sent += sum(t.numel() * t.element_size() for t in send)
            STATS.exchanges += 1
        send = [t.contiguous() for t in send]  # a block's rows of a batch: strided
        if travels_batched(send):
            ops = [dist.P2POp(dist.isend, t, to, self.group, tag) for t in send]
            ops += [dist.P2POp(dist.irecv, t, source, self.group, tag) for t in recv]
            return PendingExchange(dist.batch_isend_irecv(ops), recv, send)
        requests = [dist.isend(t, to, group=self.group, tag=tag) for t in send]
        requests += [dist.irecv(t, source, group=self.group, tag=tag) for t in recv]
        return PendingExchange(requests, recv, send)
