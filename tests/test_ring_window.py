"""Sliding-window attention in the ring against float64 windowed attention on the whole
sequence (tests/attention_reference.py: an explicit mask, nothing shared with the engine).

Windows are chosen against the block geometry: 1 (each token sees itself only), shorter than a
zigzag half-chunk, equal to it, between a chunk and a block, crossing several blocks, one less
than the sequence and the whole sequence (then nothing is cut). Tolerances
(tests/attention_reference.py says why): float64 FP64_TOL = 1e-10 (the ring reorders sums,
nothing more); float32 FP32_TOL = 2e-5 of the largest reference value, the sink gradient
included, as the plain ring.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from ringattn import block_plan
from ringattn.geometry import plain_layout, ring_reach, shard_runs
from ringattn.kernels import BandedKernel, ChunkedKernel
from tests.attention_reference import (
    Case,
    bounds,
    local_ring_outputs,
    make_inputs,
    reference,
    relative_error,
    ring_outputs,
)
from tests.distributed import run_distributed


def _windows(n: int, world: int) -> list[int]:
    local = n // world
    half = local // 2
    picks = {1, 3, half, half + 1, local, local + 3, 2 * local + 1, n - 1, n}
    return sorted(w for w in picks if w >= 1)


def _failures(case: Case, got: dict, world: int) -> list[str]:
    inputs = make_inputs(case)
    ref = reference(inputs, case.causal, case.window)
    tol = bounds(case, inputs)
    bad = []
    for name, want in ref.items():
        # window 1: each row's softmax has one term, so dq and dk are exactly zero and the
        # reference holds only rounding noise; the error is then absolute.
        exact_zero = want.abs().max() < 1e-8
        err = got[name].abs().max().item() if exact_zero else relative_error(got[name], want)
        if not err <= tol[name]:
            bad.append(f"P={world} {case.id} {name}: {err:.2e} > {tol[name]:.0e}")
    return bad


@pytest.mark.parametrize("world", [1, 2, 3, 4], ids=lambda p: f"P{p}")
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_windowed_local_ring_matches_float64(world, layout):
    n = 2 * world * 6
    failures = []
    for window in _windows(n, world):
        for dtype in ("float64", "float32"):
            case = Case(2, n, 4, 2, 16, dtype, True, layout, seed=window, window=window)
            failures += _failures(case, local_ring_outputs(case, world), world)
    assert not failures, "\n".join(failures)


@pytest.fixture
def split_bands(monkeypatch):
    """Bands cut into unmasked pieces (geometry._band_pieces) even for these tiny windows:
    the path of windows of SPLIT_WINDOW keys and more, e.g. Mistral's 4096."""
    from ringattn import geometry

    monkeypatch.setattr(geometry, "SPLIT_WINDOW", 2)
    monkeypatch.setattr(geometry, "SPLIT_ROWS", 3)
    geometry.plain_layout.cache_clear()
    geometry.packed_layout.cache_clear()
    yield
    geometry.plain_layout.cache_clear()
    geometry.packed_layout.cache_clear()


@pytest.mark.parametrize("world", [1, 2, 4], ids=lambda p: f"P{p}")
@pytest.mark.parametrize("kernel", ["", "chunked"])
def test_split_bands_match_float64(split_bands, monkeypatch, world, kernel):
    """Rectangles, causal squares and reversed causal squares instead of masked bands: the
    same numbers, on the fused CPU kernel and on the matmul fallback."""
    if kernel:
        monkeypatch.setenv("RINGATTN_KERNEL", kernel)
    n = 2 * world * 6
    failures = []
    for layout in ("contiguous", "zigzag"):
        for window in _windows(n, world):
            for dtype in ("float64", "float32"):
                case = Case(
                    2,
                    n,
                    4,
                    2,
                    16,
                    dtype,
                    True,
                    layout,
                    seed=window,
                    window=window,
                    sinks=dtype == "float32" and window % 2 == 1,
                )
                failures += _failures(case, local_ring_outputs(case, world), world)
    assert not failures, "\n".join(failures)


def test_windowed_ring_on_the_matmul_kernels(monkeypatch):
    """RINGATTN_KERNEL=chunked: the plain blocks on ChunkedKernel and the boundary ones on the
    banded matmuls (the path of devices without a fused CPU kernel), P=3 zigzag."""
    monkeypatch.setenv("RINGATTN_KERNEL", "chunked")
    world, n = 3, 36
    failures = []
    for window in (1, 5, 13, 35):
        case = Case(1, n, 4, 2, 16, "float64", True, "zigzag", seed=window, window=window)
        failures += _failures(case, local_ring_outputs(case, world), world)
    assert not failures, "\n".join(failures)


def _gloo_cases(world: int) -> list[Case]:
    n = 2 * world * 8
    return [
        Case(1, n, 4, 1, 16, "float64", True, layout, seed=w, window=w)
        for layout in ("contiguous", "zigzag")
        for w in (5, n // world + 2, n - 3)
    ]


def _gloo_ranks(rank: int, world: int) -> dict:
    return ring_outputs(rank, world, _gloo_cases(world))


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_windowed_gloo_ring_matches_float64(transport):
    """Real processes: 4 ranks, the shards sent through shared memory or gloo's point-to-point
    as in production; the window of 5 makes the zigzag ring one hop each way (ring_reach
    (1, 1)), the others the whole ring or one leg."""
    import ringattn

    world = 4
    per_rank = run_distributed(_gloo_ranks, world, transport=transport)
    failures = []
    for case in _gloo_cases(world):
        got = {
            name: ringattn.unshard_sequence(
                [r[case.id][name] for r in per_rank], layout=case.layout
            )
            for name in ("out", "dq", "dk", "dv")
        }
        failures += _failures(case, got, world)
    assert not failures, "\n".join(failures)


def _visible(world: int, seq_local: int, layout: str, window: int | None) -> torch.Tensor:
    """The causal window mask over global positions, built point by point."""
    n = world * seq_local
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    seen = j <= i
    return seen & (j > i - window) if window is not None else seen


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_the_plan_covers_exactly_the_window(world, layout):
    """Every visible (query, key) pair is in exactly one planned piece, and no piece is wholly
    invisible: the plan skips only what the window hides and computes nothing twice."""
    seq_local = 8
    for window in [None, *_windows(world * seq_local, world)]:
        want = _visible(world, seq_local, layout, window)
        covered = torch.zeros_like(want, dtype=torch.int64)
        for rank, step in itertools.product(range(world), range(world)):
            src = (rank - step) % world
            q_pos = torch.cat(
                [
                    torch.arange(r.start, r.start + r.length)
                    for r in shard_runs(rank, world, seq_local, layout)
                ]
            )
            k_pos = torch.cat(
                [
                    torch.arange(r.start, r.start + r.length)
                    for r in shard_runs(src, world, seq_local, layout)
                ]
            )
            for blk in block_plan(
                step=step,
                rank=rank,
                world_size=world,
                seq_local=seq_local,
                causal=True,
                layout=layout,
                window=window,
            ):
                qi, kj = q_pos[blk.q][:, None], k_pos[blk.kv][None, :]
                piece = want[qi, kj]
                if not blk.causal:
                    assert piece.all(), (rank, step, blk)  # a plain block: all visible
                assert piece.any(), (rank, step, blk)
                covered[qi, kj] += piece.long()
        assert torch.equal(covered, want.long()), (world, layout, window)


@pytest.mark.parametrize("fused", [True, False], ids=["cpu-fused", "matmul"])
@pytest.mark.parametrize("offset, window", [(0, 1), (0, 7), (-5, 9), (12, 4), (40, 300), (3, 2)])
def test_banded_kernel_matches_masked_matmul(offset, window, fused):
    """The banded kernel (both paths) against the same mask applied to full scores (float64),
    with rows that see no key of the block (their lse is -inf, output 0, gradients 0)."""
    g = torch.Generator().manual_seed(offset + window)
    q = torch.randn(2, 37, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 29, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    kern = BandedKernel(max_scores=2**9, fused=fused)  # several row chunks
    out, lse = kern.forward(q, k, v, scale=0.3, offset=offset, window=window)
    a = torch.arange(37)[:, None] + offset
    b = torch.arange(29)[None, :]
    mask = (b <= a) & (b > a - window)
    qe = q.detach().requires_grad_()
    ke, ve = k.detach().requires_grad_(), v.detach().requires_grad_()
    s = torch.einsum("bqhd,bkhd->bhqk", qe, ke.repeat_interleave(2, 2)) * 0.3
    lse_ref = torch.logsumexp(s.detach().masked_fill(~mask, float("-inf")), -1)
    # Rows that see nothing: scores of 0 there, so the softmax (and its gradient) stays finite,
    # then the row is zeroed.
    some = mask.any(-1)[:, None]
    s = s.masked_fill(~mask & some, float("-inf")).masked_fill(~some, 0.0)
    p = s.softmax(-1) * some
    ref = torch.einsum("bhqk,bkhd->bqhd", p, ve.repeat_interleave(2, 2))
    assert torch.allclose(out, ref, atol=1e-12)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    fin = torch.isfinite(lse_ref)
    assert torch.allclose(lse[fin], lse_ref[fin], atol=1e-12)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    ref.backward(dout)
    dq, dk, dv = kern.backward(dout, q, k, v, out, lse, scale=0.3, offset=offset, window=window)
    for got, want in ((dq, qe.grad), (dk, ke.grad), (dv, ve.grad)):
        assert torch.allclose(got, want, atol=1e-10)


def test_a_window_that_cuts_nothing_is_the_plain_causal_ring():
    """window >= N: the same plan (and so the same numbers) as no window at all."""
    for rank, step in itertools.product(range(3), range(3)):
        kw = dict(step=step, rank=rank, world_size=3, seq_local=8, causal=True, layout="zigzag")
        assert block_plan(**kw, window=24) == block_plan(**kw)


@pytest.mark.parametrize(
    "window, causal, why",
    [
        (0, True, "an int from 1 to"),
        (2.5, True, "an int from 1 to"),
        (4, False, "needs causal=True"),
    ],
)
def test_bad_windows_are_refused(window, causal, why):
    import ringattn
    from ringattn.local_ring import LocalRing

    q = torch.zeros(1, 8, 2, 4)
    with pytest.raises(ValueError, match=why):
        ringattn.ring_attention(q, q, q, causal=causal, window=window, comm=LocalRing(2))


def test_chunked_kernel_is_unchanged_by_the_banded_one():
    """The banded kernel is only for windowed pieces; a plain causal block stays the chunked
    kernel's (a guard that the two agree where both apply: offset 0, window >= the block)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 16, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    a = ChunkedKernel().forward(q, k, v, scale=0.5, causal=True)
    b = BandedKernel().forward(q, k, v, scale=0.5, offset=0, window=16)
    assert torch.allclose(a[0], b[0], atol=1e-12)
    assert torch.allclose(a[1].double(), b[1].double(), atol=1e-6)


def _needed_steps(world: int, seq_local: int, layout: str, window: int) -> set[int]:
    return {
        step
        for rank in range(world)
        for step in range(world)
        if block_plan(
            step=step,
            rank=rank,
            world_size=world,
            seq_local=seq_local,
            causal=True,
            layout=layout,
            window=window,
        )
    }


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_the_ring_stops_where_the_window_ends(layout):
    """ring_reach's legs hold every step any rank computes on, and for a short window far
    fewer than the plain ring's P - 1 transfers (checked by brute force over the plans)."""
    truncated = 0
    for world in (3, 4, 5, 8):
        for window in (1, 3, 8, 9, 17, 40, 16 * world - 1):
            forward, backward = ring_reach(world, 16, True, layout, window)
            held = set(range(forward + 1)) | {world - b for b in range(1, backward + 1)}
            assert _needed_steps(world, 16, layout, window) <= held, (world, window)
            truncated += forward + backward < world - 1
    assert truncated >= 8  # the short windows really cut the ring
    assert ring_reach(64, 16384, True, "zigzag", 4096) == (1, 1)  # Mistral's W, 1M tokens
    assert ring_reach(64, 16384, True, "contiguous", 4096) == (1, 0)
    assert ring_reach(8, 16, True, layout, None) == (7, 0)


def _bytes_sent(rank: int, world: int, window) -> tuple[int, int]:
    """Bytes this rank sent in a windowed forward, and in forward + backward."""
    import ringattn
    from ringattn.comm import STATS

    case = Case(1, 2 * world * 16, 4, 2, 16, "float32", True, "zigzag", window=window)
    inputs = make_inputs(case)
    q, k, v = (
        ringattn.shard_sequence(
            inputs[n], world_size=world, rank=rank, layout="zigzag"
        ).requires_grad_()
        for n in ("q", "k", "v")
    )
    STATS.reset(enabled=True)
    out = ringattn.ring_attention(q, k, v, causal=True, layout="zigzag", window=window)
    forward = STATS.bytes_sent
    out.sum().backward()
    both = STATS.bytes_sent
    STATS.reset(enabled=False)
    return forward, both


def test_a_short_window_sends_only_the_blocks_it_needs():
    """P = 8 zigzag, 32 tokens per rank (chunks of 16), window 8: one hop each way instead of
    7 round the ring, and only the rows the next rank reads. Rank 0 holds chunks 0 and 15.
    Forward: its block to rank 1, whose chunk-1 queries read chunk 0's keys 9..15 (7 rows: a
    window this short is one masked band, over the keys some query sees; it once covered the
    whole chunk, and the whole chunk travelled), and to rank 7 (chunks 7, 8), which reads none
    of it (one row: a transfer of nothing is not made a special case). Backward: the same K/V,
    and each one-hop leg's accumulator straight home from its one visitor over the rows it
    read: rank 1's block (its chunk 14's last 7 rows, read by chunk 15) and rank 7's (none
    read: one row).

    The plain ring (no window, a leg of 7 hops) sends whole blocks: 7 forward; backward 7 K/V
    and 8 dK/dV (7 along, 1 home)."""
    world = 8
    block = 1 * 32 * 2 * 16 * 4 * 2  # B x S_local x kv_heads x D x float32 bytes, K and V
    row = block // 32
    windowed, plain = (
        run_distributed(_bytes_sent, world, 8)[0],
        run_distributed(_bytes_sent, world, None)[0],
    )
    assert plain == (7 * block, 7 * block + 7 * block + 8 * block)
    kv = (7 + 1) * row
    assert windowed == (kv, kv + kv + (7 + 1) * row)


def test_a_window_sends_its_neighbour_only_the_rows_it_reads():
    """Mistral's window (4096) over 256k tokens on 4 zigzag ranks, chunks of 32768 (rank r
    holds chunks r and 7 - r): the ring reaches one rank each way, and a neighbour's queries
    read only the last W - 1 = 4095 keys of the chunk before them, so a hop carries 4095 of a
    block's 65536 rows (1/16 of the K/V bytes, and of the landing buffer). gpt-oss's window
    (128, shorter than SPLIT_WINDOW: one masked band per block) carries its last 127 rows."""
    lay = plain_layout(4 * 65536, 4, "zigzag")
    for window in (4096, 128):
        assert lay.reach(True, window) == (1, 1)
        rows = {o: lay.kv_rows(o, 1, 1, True, window) for o in range(4)}  # to rank o + 1
        back = {o: lay.kv_rows(o, -1, 1, True, window) for o in range(4)}  # to rank o - 1
        # forward: chunk o's tail (block rows 32769 - W..32767), read by rank o + 1's chunk
        # o + 1; rank 3's block goes to rank 0 (chunks 0 and 7), which reads none of it: one row
        tail = slice(32769 - window, 32768)
        assert rows == {o: tail for o in range(3)} | {3: slice(0, 1)}, window
        # backward: chunk 7 - o's tail (block rows 65537 - W..65535), read by rank o - 1's
        # chunk 8 - o; rank 0's block goes to rank 3 (chunks 3 and 4), which reads none of it
        tail = slice(65537 - window, 65536)
        assert back == {0: slice(0, 1)} | {o: tail for o in range(1, 4)}, window


def test_a_ring_of_two_sends_one_accumulator():
    """P = 2, 32 tokens per rank: the forward sends K/V once; the backward K/V once and one
    dK/dV accumulator, the visitor's gradients straight home (the owner keeps its own): three
    blocks a step, not four (a quarter of the bytes gloo copies with the computing cores).
    And only the rows read: rank 1 (chunks 1, 2) reads only rank 0's chunk 0, the early half
    of its block, so K/V from rank 0 and rank 0's dK/dV coming home are half a block."""
    block = 1 * 32 * 2 * 16 * 4 * 2  # B x S_local x kv_heads x D x float32 bytes, K and V
    half = block // 2
    sent = run_distributed(_bytes_sent, 2, None)
    assert sent[0] == (half, half + half + block)
    assert sent[1] == (block, block + block + half)
