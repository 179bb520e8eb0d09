"""Which part of a key/value block one ring step computes: the causal mask and sliding windows.

At step s, rank r holds the K/V block of rank ``src = r - s`` (mod P). ``block_plan`` lists the
(query rows x key rows) pieces of that block to compute; anything not listed is never computed.

Causal, no window: blocks entirely in the future are skipped; the diagonal block is causal
(top-left aligned); in the zigzag layout every step after the first costs every rank exactly
half a block.

Sliding window ``W`` (transformers' convention, ``masking_utils.sliding_window_overlay``): the
query at global position i sees the keys j with ``i - W < j <= i``, W keys counting itself.
A rank's shard is one run of consecutive positions (contiguous) or two (zigzag); each pair of a
query run and a key run is then one of: nothing visible (skipped, like a future block), all of
it visible (a plain block), the causal diagonal with the window wider than it (a causal block),
or a boundary: a ``Block`` with ``offset`` (query start - key start, global) and ``window``,
computed by the banded kernel (``kernels.BandedKernel``) over the visible band only.

``ring_reach`` says how far a windowed ring must go: when W is much shorter than the sequence,
a rank needs only the blocks of a few ranks before it (and, in zigzag, after it), so the ring
stops there instead of making all P - 1 transfers of blocks nobody computes on.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

ALL = slice(None)


@dataclass(frozen=True)
class Block:
    """Query rows x key rows of one ring step, and the mask on them.

    ``causal``: the top-left aligned causal mask (a diagonal block). With ``window`` set the
    mask is the window's: key row b is visible to query row a iff
    ``a + offset - window < b <= a + offset``.
    """

    q: slice
    kv: slice
    causal: bool
    offset: int = 0
    window: int | None = None


@dataclass(frozen=True)
class Run:
    """Consecutive global positions in a rank's shard: local rows [local, local + length)."""

    local: int
    start: int
    length: int

    @property
    def rows(self) -> slice:
        return slice(self.local, self.local + self.length)


def shard_runs(rank: int, world_size: int, seq_local: int, layout: str) -> list[Run]:
    """The runs of global positions a rank holds (``layouts.sequence_positions``, as runs)."""
    if layout == "contiguous":
        return [Run(0, rank * seq_local, seq_local)]
    half = seq_local // 2
    late = 2 * world_size - 1 - rank
    return [Run(0, rank * half, half), Run(half, late * half, half)]


@functools.lru_cache(maxsize=4096)
def block_plan(
    *,
    step: int,
    rank: int,
    world_size: int,
    seq_local: int,
    causal: bool,
    layout: str,
    window: int | None = None,
) -> tuple[Block, ...]:
    """The pieces of the block held at ``step`` to compute (see the module docstring).
    Cached: every call of the ring asks it for each step, every layer for the same shape."""
    src = (rank - step) % world_size
    if not causal:
        return (Block(ALL, ALL, False),)
    if window is not None and window < world_size * seq_local:
        return _window_plan(rank, src, world_size, seq_local, layout, window)
    if src == rank:
        return (Block(ALL, ALL, True),)
    if layout == "contiguous":
        return (Block(ALL, ALL, False),) if src < rank else ()
    # zigzag: this rank holds chunks (rank, 2P-1-rank); the block holds (src, 2P-1-src).
    half = seq_local // 2
    if src < rank:  # both query chunks see the block's early chunk, neither its late one
        return (Block(ALL, slice(0, half), False),)
    return (Block(slice(half, None), ALL, False),)  # only the late query chunk sees it, whole


def _window_plan(rank, src, world_size, seq_local, layout, window) -> tuple[Block, ...]:
    pieces = (
        _window_piece(q, k, window)
        for q in shard_runs(rank, world_size, seq_local, layout)
        for k in shard_runs(src, world_size, seq_local, layout)
    )
    return tuple(blk for blk in pieces if blk is not None)


def _window_piece(q: Run, k: Run, window: int) -> Block | None:
    """One query run against one key run under the causal window, or None (nothing visible).

    With delta = q.start - k.start, query row a sees key row b iff
    ``a + delta - window < b <= a + delta``; a ranges over [0, q.length), b over [0, k.length).
    """
    delta = q.start - k.start
    newest = q.length - 1 + delta  # the latest key row any query row may see
    oldest = delta - window + 1  # the earliest key row any query row may see
    if newest < 0 or oldest > k.length - 1:
        return None
    if k.length - 1 <= delta and newest < window:  # every key before every query, in reach
        return Block(q.rows, k.rows, False)
    if delta == 0 and q.length == k.length and q.length <= window:
        return Block(q.rows, k.rows, True)
    return Block(q.rows, k.rows, True, offset=delta, window=window)


# ring_reach walks each rank's window over the chunks it covers; beyond this many chunk visits
# it answers the plain ring (always correct, just not shortened).
REACH_WORK_LIMIT = 4_000_000


@functools.lru_cache(maxsize=1024)
def ring_reach(
    world_size: int, seq_local: int, causal: bool, layout: str, window: int | None
) -> tuple[int, int]:
    """(forward hops, backward hops) a windowed ring needs: every rank's plan is empty at every
    step but 0, 1..forward (the blocks of ranks r-1 .. r-forward) and P-backward..P-1 (those
    of ranks r+1 .. r+backward). (P - 1, 0) is the plain ring, all P steps; it is also the
    answer whenever the window leaves no step empty on every rank. Cached: every layer of a
    model asks it for the same shape."""
    plain = (world_size - 1, 0)
    if not causal or window is None or window >= world_size * seq_local or world_size < 3:
        return plain
    chunk = seq_local if layout == "contiguous" else seq_local // 2
    if (window // max(1, chunk) + 3) * world_size * 2 > REACH_WORK_LIMIT:
        return plain
    needed = _needed_steps(world_size, seq_local, layout, window, chunk)
    forward = next((f for f in range(world_size) if f + 1 not in needed), world_size - 1)
    backward = next((b for b in range(world_size) if world_size - b - 1 not in needed), 0)
    covered = set(range(1, forward + 1)) | set(range(world_size - backward, world_size))
    if forward + backward >= world_size - 1 or not needed <= covered:
        return plain
    return forward, backward


def _needed_steps(world: int, seq_local: int, layout: str, window: int, chunk: int) -> set[int]:
    """The steps > 0 at which some rank sees some key. A run of queries [start, start + n)
    sees exactly the keys [start - window + 1, start + n - 1] (each query its own window, and
    consecutive windows overlap), so the ranks owning any chunk of that interval are needed."""

    def owner(c: int) -> int:  # the rank holding chunk c
        return c if layout == "contiguous" or c < world else 2 * world - 1 - c

    steps = set()
    for rank in range(world):
        for run in shard_runs(rank, world, seq_local, layout):
            first = max(0, run.start - window + 1) // chunk
            last = (run.start + run.length - 1) // chunk
            steps.update((rank - owner(c)) % world for c in range(first, last + 1))
    steps.discard(0)
    return steps
