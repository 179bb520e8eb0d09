"""Sliding-window attention on a ring, counted without torch: the scores a causal window
needs, the pieces each ring step computes, and how far the ring must go.

The query at global position i sees the keys j with ``i - W < j <= i`` (transformers'
``sliding_window``): ``min(i + 1, W)`` keys, so a document of N tokens needs
``sum_i min(i + 1, W)`` scores, about N x W once N >> W, instead of the N^2 / 2 of full causal
attention.

The engine computes them as ``ringattn.blocks`` plans them: each (query run, key run) pair of a
rank's shard and the block it holds is skipped, a plain block, a causal diagonal, or a
boundary piece that the banded kernel (``ringattn.kernels.BandedKernel``) computes in chunks of
R query rows against the R + W - 1 keys those rows can reach. A windowed ring stops where the
window ends (``ringattn.blocks.ring_reach``): a forward leg of f hops, then, in zigzag, a
backward leg of b hops.

The planner may not import ringattn (tests/test_import_graph.py: it is a leaf of ringctl), so
``shard_runs``, ``piece``, ``banded_rows``, ``banded_chunks`` and ``ring_reach`` here are twins
of the engine's; tests/test_plan_window.py checks each against the engine on many shapes.
"""

from __future__ import annotations

import functools
from collections import Counter

# ringattn.kernels.BandedKernel: scores held at once (matmul path) and its row bounds.
BANDED_MAX_SCORES = 2**26
# ringattn.blocks.REACH_WORK_LIMIT: past this many chunk visits ring_reach answers the plain ring.
REACH_WORK_LIMIT = 4_000_000


def layer_windows(w) -> list[tuple[int | None, int]]:
    """[(window or None, layers)] of a ``cost.Workload``: the layers whose attention a sliding
    window cuts, and the others. A window only cuts causal attention over a sequence longer
    than itself (the engine runs anything else as the plain causal ring)."""
    layers = w.model.layers if w.model else 1
    window, count = w.window, layers
    if window is None and w.model is not None and w.model.window:
        window, count = w.model.window, w.model.window_layers or layers
    if window is None or not w.causal or window >= w.seq_len:
        return [(None, layers)]
    return [(window, count)] + ([(None, layers - count)] if count < layers else [])


def prefix_keys(u: int, window: int) -> int:
    """sum over t = 1..u of min(t, W): the keys the first u queries of a document see."""
    if u <= 0:
        return 0
    if u <= window:
        return u * (u + 1) // 2
    return window * (window + 1) // 2 + (u - window) * window


def window_scores(seq_len: int, window: int | None) -> int:
    """Scores of causal attention over a whole document: sum_i min(i + 1, W) (no window:
    N (N + 1) / 2, every earlier key and itself)."""
    w = seq_len if window is None else min(window, seq_len)
    return prefix_keys(seq_len, max(1, w))


def _below(queries: int, keys: int, window: int) -> int:
    """Visible pairs (i, j) with i < queries and j < keys (both from position 0)."""
    m = min(max(0, keys), max(0, queries))
    return prefix_keys(queries, window) - prefix_keys(queries - m, window)


def visible_pairs(q_start: int, q_len: int, k_start: int, k_len: int, window: int) -> int:
    """Visible (query, key) pairs of the query positions [q_start, q_start + q_len) against the
    key positions [k_start, k_start + k_len): inclusion-exclusion over prefix rectangles."""
    qe, ke = q_start + q_len, k_start + k_len
    return (
        _below(qe, ke, window)
        - _below(q_start, ke, window)
        - _below(qe, k_start, window)
        + _below(q_start, k_start, window)
    )


def shard_runs(rank: int, world: int, seq_local: int, layout: str) -> list[tuple[int, int]]:
    """(global start, length) of each run of consecutive positions a rank holds
    (ringattn.blocks.shard_runs)."""
    if layout == "contiguous":
        return [(rank * seq_local, seq_local)]
    half = seq_local // 2
    return [(rank * half, half), ((2 * world - 1 - rank) * half, half)]


def piece(q: tuple[int, int], k: tuple[int, int], window: int) -> tuple[str, int] | None:
    """(kind, offset) of one query run against one key run under the window, or None when no
    pair is visible (ringattn.blocks._window_piece): ``plain`` (every pair visible),
    ``causal`` (the diagonal, window wider than it) or ``banded`` (offset = q start - k start)."""
    (qs, ql), (ks, kl) = q, k
    delta = qs - ks
    newest = ql - 1 + delta
    oldest = delta - window + 1
    if newest < 0 or oldest > kl - 1:
        return None
    if kl - 1 <= delta and newest < window:
        return "plain", 0
    if delta == 0 and ql == kl and ql <= window:
        return "causal", 0
    return "banded", delta


def banded_rows(batch: int, heads: int, window: int) -> int:
    """Query rows per banded chunk (ringattn.kernels.BandedKernel._rows): about the window,
    at most 1024, within the kernel's score budget."""
    rows = max(64, min(1024, window))
    per_row = batch * heads * (rows + window)
    return max(16, min(rows, BANDED_MAX_SCORES // max(1, per_row)))


def _chunk(j: int, rows: int, sq: int, sk: int, offset: int, window: int) -> tuple[int, int]:
    """(query rows, keys) of chunk j (ringattn.kernels._matmul_chunks); keys may be <= 0."""
    r0, r1 = j * rows, min(sq, (j + 1) * rows)
    k0, k1 = max(0, r0 + offset - window + 1), min(sk, r1 + offset)
    return r1 - r0, k1 - k0


@functools.lru_cache(maxsize=4096)
def banded_chunks(sq: int, sk: int, offset: int, window: int, rows: int) -> tuple:
    """((query rows, keys), count) of the chunks the banded kernel computes for a boundary
    piece. Chunks away from the piece's edges are all R x (R + W - 1) and are counted, not
    walked, so the cost is O(W / R) whatever the piece's length."""
    first = max(0, -offset) // rows  # the first row that sees a key: offset + r >= 0
    last_row = min(sq, sk - 1 + window - offset) - 1  # rows with r + offset - W + 1 < sk
    if last_row < max(0, -offset):
        return ()
    last = last_row // rows
    lo = max(first, -(-(window - 1 - offset) // rows))  # k0 > 0 from here on
    hi = min(last, (sk - rows - offset) // rows, sq // rows - 1)  # whole rows, k1 < sk
    shapes: Counter = Counter()
    if hi >= lo:
        shapes[(rows, rows + window - 1)] += hi - lo + 1
        edges = [*range(first, lo), *range(hi + 1, last + 1)]
    else:
        edges = list(range(first, last + 1))
    for j in edges:
        r, keys = _chunk(j, rows, sq, sk, offset, window)
        if keys > 0:
            shapes[(r, keys)] += 1
    return tuple(sorted(shapes.items()))


@functools.lru_cache(maxsize=4096)
def ring_reach(world: int, seq_local: int, causal: bool, layout: str, window: int | None):
    """(forward hops, backward hops) of a windowed ring (ringattn.blocks.ring_reach); (P - 1, 0)
    is the plain ring."""
    plain = (world - 1, 0)
    if not causal or window is None or window >= world * seq_local or world < 3:
        return plain
    chunk = seq_local if layout == "contiguous" else seq_local // 2
    if (window // max(1, chunk) + 3) * world * 2 > REACH_WORK_LIMIT:
        return plain
    needed = _needed_steps(world, seq_local, layout, window, chunk)
    forward = next((f for f in range(world) if f + 1 not in needed), world - 1)
    backward = next((b for b in range(world) if world - b - 1 not in needed), 0)
    covered = set(range(1, forward + 1)) | set(range(world - backward, world))
    if forward + backward >= world - 1 or not needed <= covered:
        return plain
    return forward, backward


def _needed_steps(world: int, seq_local: int, layout: str, window: int, chunk: int) -> set[int]:
    """The steps > 0 at which some rank sees some key (ringattn.blocks._needed_steps)."""

    def owner(c: int) -> int:
        return c if layout == "contiguous" or c < world else 2 * world - 1 - c

    steps = set()
    for rank in range(world):
        for start, length in shard_runs(rank, world, seq_local, layout):
            first = max(0, start - window + 1) // chunk
            last = (start + length - 1) // chunk
            steps.update((rank - owner(c)) % world for c in range(first, last + 1))
    steps.discard(0)
    return steps


def busiest_rank(world: int, seq_local: int, layout: str, window: int) -> int:
    """The rank whose queries see the most keys (the ring waits for it; ties: the last)."""
    seen = [
        sum(prefix_keys(s + n, window) - prefix_keys(s, window) for s, n in runs)
        for runs in (shard_runs(r, world, seq_local, layout) for r in range(world))
    ]
    return max(range(world), key=lambda r: (seen[r], r))


@functools.lru_cache(maxsize=4096)
def step_pieces(
    rank: int, src: int, world: int, seq_local: int, layout: str, window: int, rows: int
) -> tuple:
    """What ``rank`` computes against the block of ``src``: ((kind, query rows, keys), count)
    with kind ``plain`` (a rectangle), ``causal`` (a diagonal of that size) or ``banded`` (one
    chunk of the banded kernel)."""
    found: Counter = Counter()
    for q in shard_runs(rank, world, seq_local, layout):
        for k in shard_runs(src, world, seq_local, layout):
            got = piece(q, k, window)
            if got is None:
                continue
            kind, offset = got
            if kind == "banded":
                for (r, keys), count in banded_chunks(q[1], k[1], offset, window, rows):
                    found[("banded", r, keys)] += count
            else:
                found[(kind, q[1], k[1])] += 1
    return tuple(sorted(found.items()))


def ring_stages(world: int, seq_local: int, layout: str, window: int, rows: int) -> list:
    """The busiest rank's windowed ring, leg by leg: [(shift, [pieces of each stage])], the
    stages of a leg being its hops 0..hops (a transfer follows every stage but the last).
    The own block is computed once, in the forward leg; the backward leg's hop 0 computes
    nothing (its first transfer is exposed)."""
    rank = busiest_rank(world, seq_local, layout, window)
    forward, backward = ring_reach(world, seq_local, True, layout, window)
    legs = []
    for shift, hops in [(1, forward)] + ([(-1, backward)] if backward else []):
        stages = []
        for hop in range(hops + 1):
            if shift < 0 and hop == 0:
                stages.append(())
                continue
            src = (rank - shift * hop) % world
            stages.append(step_pieces(rank, src, world, seq_local, layout, window, rows))
        legs.append((shift, stages))
    return legs


def largest_chunk(world: int, seq_local: int, layout: str, window: int, rows: int) -> int:
    """Scores of the largest banded chunk the busiest rank computes (0: none)."""
    return max(
        (
            r * keys
            for _, stages in ring_stages(world, seq_local, layout, window, rows)
            for pieces in stages
            for (kind, r, keys), _ in pieces
            if kind == "banded"
        ),
        default=0,
    )
