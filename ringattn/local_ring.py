"""P virtual ranks of a ring inside one process, on one device.

One GPU cannot host two NCCL ranks, and spawning processes to test a loop is slow; yet the
ring's CUDA path (kernels, merge, bookkeeping, backward) must be tested and timed. A
``LocalRing`` runs the *same* generator loops the distributed ring runs, one per virtual rank,
in lock step: every rank runs until it must wait for a transfer, then every block posted so far
is copied to the next rank's landing buffer, then every rank goes on. The ranks compute one
after another, so a LocalRing measures compute, merge and bookkeeping, never overlap.

    from ringattn import ring_attention
    from ringattn.local_ring import LocalRing
    # q: (B, N, H, D) holding the P shards one after another in rank order (for the
    # contiguous layout that is the sequence itself; for zigzag, see shard_sequence)
    out = ring_attention(q, k, v, causal=True, layout="zigzag", comm=LocalRing(8))

With ``record_steps=True`` the ring keeps, for its latest run, the seconds each virtual rank
computed between two waits (CUDA events on a GPU, read only when asked for): the block work of
one ring step as the loop does it, which the planner's calibration uses.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Generator, Sequence
from typing import Any

import torch


class _Posted:
    """An exchange a virtual rank posted: delivered when every rank has posted its own."""

    __slots__ = ("send", "recv", "shift")

    def __init__(self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor], shift: int):
        self.send, self.recv, self.shift = tuple(send), tuple(recv), shift

    @property
    def received(self) -> tuple[torch.Tensor, ...]:
        return self.recv

    def wait(self) -> None:  # a LocalRing delivers before it resumes any rank
        return None


class VirtualRank:
    """One rank's endpoint of a LocalRing: records what it posts."""

    def __init__(self, ring: LocalRing, rank: int) -> None:
        self.rank, self.world_size = rank, ring.world_size
        self.posted: list[_Posted] = []

    def exchange(
        self,
        send: Sequence[torch.Tensor],
        recv: Sequence[torch.Tensor],
        *,
        tag: int = 0,
        shift: int = 1,
        borrow: bool = False,
    ) -> _Posted:
        if len(send) != len(recv):
            raise ValueError(f"exchange: {len(send)} tensors sent, {len(recv)} received")
        posted = _Posted(send, recv, shift)
        self.posted.append(posted)
        return posted


class LocalRing:
    """A transport for ``ring_attention(..., comm=LocalRing(P))``: P ranks, one process."""

    def __init__(self, world_size: int, *, record_steps: bool = False) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"LocalRing: world_size must be an integer >= 1, got {world_size!r}")
        self.world_size = world_size
        self.record_steps = record_steps
        self._ranks = [VirtualRank(self, r) for r in range(world_size)]
        self._marks: list[list[Any]] = []
        # One ring call at a time: the virtual ranks' posted exchanges are the ring's, and two
        # threads driving one LocalRing (nn.DataParallel's replicas share it) mixed their
        # blocks: 3 results of 50 wrong, no error. A second call waits for the first.
        self._driving = threading.Lock()

    def __getstate__(self) -> dict:  # a lock cannot be copied (deepcopy of a model, pickle)
        state = dict(self.__dict__)
        del state["_driving"]
        return state

    def __copy__(self) -> LocalRing:  # a shallow copy shared the ranks, not the lock
        return copy.deepcopy(self)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._driving = threading.Lock()

    def endpoints(self) -> list[VirtualRank]:
        return self._ranks

    def _deliver(self) -> None:
        """Every rank r's i-th posted send lands in rank r+shift's i-th posted receive."""
        counts = {len(r.posted) for r in self._ranks}
        if len(counts) != 1:
            raise RuntimeError(f"LocalRing: virtual ranks posted unequal exchanges {counts}")
        for src in self._ranks:
            for i, mine in enumerate(src.posted):
                dst = self._ranks[(src.rank + mine.shift) % self.world_size]
                theirs = dst.posted[i]
                if theirs.shift != mine.shift:
                    raise RuntimeError("LocalRing: virtual ranks posted different shifts")
                for s, r in zip(mine.send, theirs.recv, strict=True):
                    if s.shape != r.shape:
                        raise RuntimeError(
                            f"LocalRing: rank {src.rank} sends {tuple(s.shape)} to a "
                            f"{tuple(r.shape)} buffer of rank {dst.rank}"
                        )
                    r.copy_(s)
        for r in self._ranks:
            r.posted.clear()

    def _mark(self, device: torch.device | None) -> Any:
        if device is not None and device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def drive(self, loops: Sequence[Generator[Any, None, Any]], device=None) -> list[Any]:
        """Run one loop per virtual rank in lock step; their results in rank order."""
        if len(loops) != self.world_size:
            raise ValueError(f"LocalRing({self.world_size}) got {len(loops)} loops")
        with self._driving:
            return self._drive(loops, device)

    def _drive(self, loops: Sequence[Generator[Any, None, Any]], device) -> list[Any]:
        for r in self._ranks:
            r.posted.clear()
        self._marks = [[] for _ in loops]
        results: list[Any] = [None] * len(loops)
        done = [False] * len(loops)
        while not all(done):
            for rank, loop in enumerate(loops):
                if self.record_steps:
                    self._marks[rank].append(self._mark(device))
                try:
                    next(loop)
                except StopIteration as stop:
                    results[rank], done[rank] = stop.value, True
                if self.record_steps:
                    self._marks[rank].append(self._mark(device))
            if any(done) and not all(done):
                raise RuntimeError("LocalRing: virtual ranks ended after different steps")
            self._deliver()
        return results

    def step_seconds(self) -> list[list[float]]:
        """Per virtual rank, the seconds of each stretch between two waits in the latest run."""
        out = []
        for marks in self._marks:
            pairs = list(zip(marks[0::2], marks[1::2], strict=True))
            if pairs and isinstance(pairs[0][0], torch.cuda.Event):
                pairs[-1][1].synchronize()
                out.append([a.elapsed_time(b) / 1e3 for a, b in pairs])
            else:
                out.append([b - a for a, b in pairs])
        return out
