"""Sliding-window attention on a ring, counted without torch: the scores a causal window
needs, the pieces each ring step computes, and how far the ring must go.

The query at global position i sees the keys j with ``i - W < j <= i`` (transformers'
``sliding_window``): ``min(i + 1, W)`` keys, so a document of N tokens needs
``sum_i min(i + 1, W)`` scores, about N x W once N >> W, instead of the N^2 / 2 of full causal
attention.

The engine's own geometry answers what each step computes (``ringattn.geometry``, torch-free,
the one module of ringattn the planner imports): each (query run, key run) pair of a rank's
shard and the block it holds is skipped, a plain block, a causal diagonal, or a boundary piece
that the banded kernel computes in chunks of R query rows against the R + W - 1 keys those rows
can reach (``band_chunk_shapes``), and the ring stops where the window ends
(``SequenceLayout.reach``): a forward leg of f hops, then, in zigzag, a backward leg of b hops.
"""

from __future__ import annotations

import functools
from collections import Counter

from ringattn.geometry import SPLIT_WINDOW, band_chunk_shapes, plain_layout, prefix_keys


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


def busiest_rank(world: int, seq_local: int, layout: str, window: int) -> int:
    """The rank whose queries see the most keys (the ring waits for it; ties: the last)."""
    lay = plain_layout(world * seq_local, world, layout)
    seen = [lay.pairs(r, True, window) for r in range(world)]
    return max(range(world), key=lambda r: (seen[r], r))


@functools.lru_cache(maxsize=4096)
def step_pieces(
    rank: int, src: int, world: int, seq_local: int, layout: str, window: int, rows: int
) -> tuple:
    """What ``rank`` computes against the block of ``src``: ((kind, query rows, keys), count)
    with kind ``plain`` (a rectangle), ``causal`` (a diagonal of that size) or ``banded`` (one
    chunk of the banded kernel)."""
    lay = plain_layout(world * seq_local, world, layout)
    found: Counter = Counter()
    for blk in lay.plan((rank - src) % world, rank, True, window):
        sq = len(range(seq_local)[blk.q])
        sk = len(range(seq_local)[blk.kv])
        if blk.window is None:
            found[("causal" if blk.causal else "plain", sq, sk)] += 1
            continue
        for (r, keys), count in band_chunk_shapes(sq, sk, blk.offset, blk.window, rows):
            found[("banded", r, keys)] += count
    return tuple(sorted(found.items()))


def ring_stages(world: int, seq_local: int, layout: str, window: int, rows: int) -> list:
    """The busiest rank's windowed ring, leg by leg: [(shift, [pieces of each stage])], the
    stages of a leg being its hops 0..hops (a transfer follows every stage but the last).
    The own block is computed once, in the forward leg; the backward leg's hop 0 computes
    nothing (its first transfer is exposed)."""
    rank = busiest_rank(world, seq_local, layout, window)
    forward, backward = plain_layout(world * seq_local, world, layout).reach(True, window)
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
    """Scores of the largest banded chunk the busiest rank computes (0: none). A window of
    ``SPLIT_WINDOW`` keys or more is cut into unmasked pieces (``geometry._window_piece``):
    no banded chunk, found without building the ring's plans (O(N / R) pieces each, which
    a budget's search over N took 24 s to build for a 2048-key window)."""
    if window >= SPLIT_WINDOW:
        return 0
    return banded_chunk_in_plans(world, seq_local, layout, window, rows)


def banded_chunk_in_plans(world: int, seq_local: int, layout: str, window: int, rows: int) -> int:
    """Scores of the largest banded chunk in the busiest rank's ring plans, read off every
    stage (``largest_chunk`` without its shortcut)."""
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


# From this many ranks on, the ranks of one document's ring are alike in what a one-hop
# neighbour reads of their blocks: each chunk a rank holds borders the same neighbours' chunks
# whatever P (in zigzag, rank r's chunks r and 2P - 1 - r border those of r - 1 and r + 1).
# Fewer differ: at P = 2 one rank is the neighbour on both sides, at P = 3 the two legs meet
# (the plain ring). tests/test_plan_window.py checks P = 4 against P up to 100.
RANKS_ALIKE_FROM = 4


@functools.lru_cache(maxsize=4096)
def rows_carried(world: int, seq_local: int, layout: str, window: int) -> int:
    """The rows of a block a hop of the windowed ring carries: the most over every rank's
    hops, since the ring moves in lock step and waits for the largest transfer. On a one-hop
    leg the engine sends only the rows the one holder reads (``SequenceLayout.kv_rows``), and
    the leg's dK/dV accumulator comes home over the same rows; a longer leg carries whole
    blocks (ringattn.ring._backward_leg). Read off a ring of ``RANKS_ALIKE_FROM`` ranks when
    there are more (the memory search asks at up to 65536 ranks: 1 s a question, built
    whole)."""
    world = min(world, RANKS_ALIKE_FROM)
    lay = plain_layout(world * seq_local, world, layout)
    most = 0
    for shift, hops in zip((1, -1), lay.reach(True, window), strict=True):
        for owner in range(world) if hops else ():
            span = lay.kv_rows(owner, shift, hops, True, window)
            most = max(most, span.stop - span.start)
    return most


def trimmed_hops(w, ranks: int) -> tuple[int, int] | None:
    """(legs, rows a hop carries) of a ``cost.Workload``'s ring (its attention view) where
    every layer's window keeps each leg to one hop carrying part of a block
    (``rows_carried``); None where whole blocks travel (a layer without a window, or a leg
    of several hops)."""
    seq_local = int(w.seq_len // ranks)
    windows = [window for window, _ in layer_windows(w)]
    if ranks < 2 or None in windows:
        return None
    legs = rows = 0
    for window in windows:
        carried = rows_carried(ranks, seq_local, w.layout, window)
        if carried >= seq_local:
            return None
        world = min(ranks, RANKS_ALIKE_FROM)
        reach = plain_layout(world * seq_local, world, w.layout).reach(True, window)
        legs, rows = max(legs, sum(1 for hops in reach if hops)), max(rows, carried)
    return legs, rows
