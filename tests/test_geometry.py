"""ringattn.geometry against brute force: every visible (query, key) pair is computed exactly
once over the ring's steps, nothing else is, and the ring's reach covers every step with work.
Pure Python (no torch): the planner relies on the same module."""

from __future__ import annotations

import random

import pytest

from ringattn import geometry as g


def _visible(qpos, kpos, qdoc, kdoc, causal, window) -> bool:
    if qdoc != kdoc or qdoc == g.PAD:
        return False
    if not causal:
        return True
    if kpos > qpos:
        return False
    return window is None or qpos - kpos < window


def _row_maps(layout: g.SequenceLayout):
    """Per rank: (packed position, document) of each local row."""
    maps = []
    for runs in layout.runs:
        rows = [(-1, g.PAD)] * layout.rows
        for r in runs:
            for i in range(r.length):
                rows[r.local + i] = (r.start + i, r.doc) if r.doc != g.PAD else (-1, g.PAD)
        maps.append(rows)
    return maps


def _block_pairs(blk: g.Block, qrows, krows):
    q0, q1, _ = blk.q.indices(len(qrows))
    k0, k1, _ = blk.kv.indices(len(krows))
    for a in range(q0, q1):
        for b in range(k0, k1):
            ra, rb = a - q0, b - k0
            if blk.window is not None:
                seen = ra + blk.offset - blk.window < rb <= ra + blk.offset
            elif blk.causal and blk.reverse:
                assert q1 - q0 == k1 - k0, "a reversed causal block is square"
                seen = rb >= ra
            elif blk.causal:
                assert q1 - q0 == k1 - k0, "a causal block is square"
                seen = rb <= ra
            else:
                seen = True
            if seen:
                yield a, b


def check_layout(layout: g.SequenceLayout, causal: bool, window) -> None:
    world = layout.world_size
    maps = _row_maps(layout)
    forward, backward = layout.reach(causal, window)
    reached = {0} | set(range(1, forward + 1)) | set(range(world - backward, world))
    for rank in range(world):
        computed = []
        for step in range(world):
            src = (rank - step) % world
            blocks = layout.plan(step, rank, causal, window)
            if blocks:
                assert step in reached, (rank, step, forward, backward)
            for blk in blocks:
                for a, b in _block_pairs(blk, maps[rank], maps[src]):
                    (qp, qd), (kp, kd) = maps[rank][a], maps[src][b]
                    assert _visible(qp, kp, qd, kd, causal, window), (rank, step, blk, a, b)
                    computed.append((qp, kp))
        expected = [
            (qp, kp)
            for qp, qd in maps[rank]
            for other in maps
            for kp, kd in other
            if _visible(qp, kp, qd, kd, causal, window)
        ]
        assert sorted(computed) == sorted(expected), rank
        assert len(computed) == layout.pairs(rank, causal, window)


def _rows_cover_tokens(layout: g.SequenceLayout) -> None:
    seen = sorted(p for rank in range(layout.world_size) for p in layout.positions(rank) if p >= 0)
    assert seen == list(range(layout.tokens))


@pytest.mark.parametrize("layout", g.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 3), (True, 9)])
def test_plain_layouts(layout, world, causal, window):
    n = 8 * world
    lay = g.plain_layout(n, world, layout)
    _rows_cover_tokens(lay)
    check_layout(lay, causal, window)


CASES = {
    "one token": [1],
    "one of all": [37],
    "chunk edges": [8, 8, 8, 8],
    "tiny many": [1, 2, 3] * 30,
    "mixed": [1, 17, 2, 40, 5, 3, 9, 1],
    "empty docs": [0, 5, 0, 0, 12, 0],
}


@pytest.mark.parametrize("layout", g.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 4), (True, 25)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_layouts(layout, world, causal, window, case):
    lengths = CASES[case]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    lay = g.packed_layout(tuple(cu), world, layout)
    _rows_cover_tokens(lay)
    assert lay.rows == -(-cu[-1] // world)
    check_layout(lay, causal, window)


def test_random_packings():
    rng = random.Random(7)
    for _ in range(40):
        lengths = [max(1, int(rng.lognormvariate(1.5, 1.2))) for _ in range(rng.randint(1, 12))]
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        world = rng.randint(1, 5)
        mult = rng.choice([1, 2, 3])
        lay = g.packed_layout(tuple(cu), world, rng.choice(g.LAYOUTS), mult)
        assert lay.rows % mult == 0
        _rows_cover_tokens(lay)
        causal = rng.random() < 0.7
        window = rng.choice([None, 2, 7]) if causal else None
        check_layout(lay, causal, window)


def test_documents_on_one_rank_need_no_transfer():
    cu = tuple(range(0, 4 * 10 + 1, 10))  # four documents of 10: one per rank
    lay = g.packed_layout(cu, 4, "zigzag")
    assert lay.reach(True, None) == (0, 0)
    assert lay.padding == 0


def test_bad_cu_seqlens():
    with pytest.raises(ValueError, match="must not decrease"):
        g.packed_layout((0, 5, 3), 2, "zigzag")
    with pytest.raises(ValueError, match="varlen"):
        g.packed_layout((1, 5), 2, "zigzag")
    with pytest.raises(ValueError, match="no token"):
        g.packed_layout((0, 0), 2, "zigzag")


def heavy_tailed(n_total: int, seed: int) -> list[int]:
    """Lognormal document lengths plus one document of half the tokens."""
    rng = random.Random(seed)
    lengths = [n_total // 2]
    while sum(lengths) < n_total:
        lengths.append(max(1, min(n_total - sum(lengths), int(rng.lognormvariate(5.0, 1.3)))))
    rng.shuffle(lengths)
    return lengths


@pytest.mark.parametrize("world", [2, 4, 8, 16, 64])
@pytest.mark.parametrize("window", [None, 4096])
def test_balanced_layout_on_a_heavy_tail(world, window):
    """The issue's bar: visible pairs per rank at most 1.05x the mean under full causal
    attention, added rows under 1%. Under a window, with the layout balanced for it, 1.07
    (the worst measured, 1.06 at P = 16: each rank then holds a single window of rows, and the
    split that balances the first window's short rows would scatter chunks of a few rows)."""
    n = 65536
    cu = [0]
    for length in heavy_tailed(n, seed=world):
        cu.append(cu[-1] + length)
    lay = g.packed_layout(tuple(cu), world, "zigzag", 1, window)
    work = [lay.pairs(r, True, window) for r in range(world)]
    assert max(work) <= (1.05 if window is None else 1.07) * sum(work) / world
    assert lay.padding < 0.01 * n


@pytest.fixture
def split_bands(monkeypatch):
    """Bands cut into unmasked pieces even for the tiny windows these tests use."""
    monkeypatch.setattr(g, "SPLIT_WINDOW", 2)
    monkeypatch.setattr(g, "SPLIT_ROWS", 3)
    g.plain_layout.cache_clear()
    g.packed_layout.cache_clear()
    yield
    g.plain_layout.cache_clear()
    g.packed_layout.cache_clear()


@pytest.mark.parametrize("window", [2, 3, 4, 5, 9])
def test_split_bands_cover_the_window_exactly(split_bands, window):
    for world in (1, 2, 3, 4):
        for layout in g.LAYOUTS:
            check_layout(g.plain_layout(8 * world, world, layout), True, window)
    rng = random.Random(window)
    for _ in range(20):
        lengths = [max(1, int(rng.lognormvariate(1.8, 1.0))) for _ in range(rng.randint(1, 8))]
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        lay = g.packed_layout(tuple(cu), rng.randint(1, 4), rng.choice(g.LAYOUTS))
        check_layout(lay, True, window)


def test_long_windows_need_no_mask():
    """Mistral's W = 4096 over 64k tokens on 4 ranks: no block carries a mask."""
    lay = g.plain_layout(65536, 4, "zigzag")
    for rank in range(4):
        for step in range(4):
            assert all(b.window is None for b in lay.plan(step, rank, True, 4096))
