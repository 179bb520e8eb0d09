"""The planner prices sliding-window attention: scores per query min(i + 1, W) (a hand count),
the ring cut short where the window ends, and the banded kernel's chunks, with the engine's own
geometry (ringattn.geometry); windowed rings priced stage by stage by hand."""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import replace

import pytest

from ringattn import geometry
from ringctl.longdoc.model.compat import model_shape
from ringctl.planner import window as pw
from ringctl.planner.cost import Link, Workload, estimate
from ringctl.planner.devices import get_device
from ringctl.planner.model import ModelShape
from ringctl.planner.timing import attention_flops

H100 = get_device("H100-SXM")


def _hand_scores(n: int, w: int) -> int:
    return sum(min(i + 1, w) for i in range(n))


@pytest.mark.parametrize(("n", "w"), [(1, 1), (5, 1), (7, 3), (64, 4), (100, 100), (300, 17)])
def test_window_scores_are_min_i_plus_1_w_per_query(n, w):
    assert pw.window_scores(n, w) == _hand_scores(n, w)
    assert pw.window_scores(n, None) == n * (n + 1) // 2


def test_visible_pairs_of_any_two_ranges_match_a_double_loop():
    rng = random.Random(0)
    for _ in range(300):
        w = rng.randint(1, 20)
        qs, ks = rng.randint(0, 40), rng.randint(0, 40)
        ql, kl = rng.randint(0, 25), rng.randint(0, 25)
        want = sum(1 for i in range(qs, qs + ql) for j in range(ks, ks + kl) if i - w < j <= i)
        assert pw.visible_pairs(qs, ql, ks, kl, w) == want, (qs, ql, ks, kl, w)


def test_band_chunk_shapes_count_long_pieces_without_walking_them():
    """The planner counts the banded kernel's chunks (geometry.band_chunk_shapes) in O(W / R);
    the kernel walks them (geometry.band_chunks): the counts agree."""
    rng = random.Random(1)
    for _ in range(400):
        rows, window = rng.choice([3, 16, 64]), rng.randint(1, 200)
        sq, sk = rng.randint(1, 2000), rng.randint(1, 2000)
        offset = rng.randint(-sk, sq + window)
        want = Counter(
            (r1 - r0, k1 - k0)
            for r0, r1, k0, k1 in geometry.band_chunks(sq, sk, offset, window, rows)
        )
        got = Counter(dict(geometry.band_chunk_shapes(sq, sk, offset, window, rows)))
        assert got == want, (sq, sk, offset, window, rows)


def _tiny(**kw) -> Workload:
    model = ModelShape(
        layers=2, hidden=64, intermediate=128, vocab=256, heads=4, kv_heads=2, head_dim=16, **kw
    )
    return Workload(
        seq_len=64, heads=4, kv_heads=2, head_dim=16, dtype="bfloat16", model=model, mode="train"
    )


def test_a_windowed_ring_is_priced_stage_by_stage_by_hand():
    """N = 64 on 4 zigzag ranks, W = 4: chunks of 8, rank r holding chunks r and 7 - r.
    The ring reaches one rank back (chunk r - 1) and one forward (chunk 6 - r is held by rank
    r + 1): legs of 1 hop each. The busiest rank (3: chunks [24, 32) and [32, 40), every query
    sees 4 keys) computes, with banded chunks of 64 rows: at step 0 its two diagonals (8 x 8
    scores each) and chunk 4 against chunk 3 (8 x 3: keys 29..31), at step 1 chunk 3 against
    rank 2's chunk 2 (8 x 3); the backward leg has nothing for it, and its first hop computes
    nothing at all: that transfer is exposed. A hop carries only the rows the neighbour reads
    (W - 1 = 3 of a block's 16: the masked band of a window this short covers only the keys
    its queries see; it once covered the whole chunk, 8 rows), and a one-hop leg's
    accumulator comes home over those 3 rows."""
    w = _tiny(window=4)
    link = Link("slow", 0.05, 1e-6)
    peak = H100.tflops["bfloat16"] * 1e12
    per_score = 4 * 1 * 4 * 16
    s_f = per_score / (peak * H100.attention_efficiency[0])
    s_b = 2.5 * per_score / (peak * H100.attention_efficiency[1])
    kv = 2 * 3 * 2 * 16 * 2  # K and V of the 3 rows read, 2 heads of 16, 2 bytes
    t = kv * 8 / 0.05e9 + 1e-6
    t_d = kv * 2 * 8 / 0.05e9 + 1e-6  # float32 accumulators: twice the bf16 bytes
    fwd = max(152 * s_f, t) + 24 * s_f + t
    # one-hop legs: K/V out, the visitor's dK/dV accumulator home (ring._backward_leg)
    bwd = max(152 * s_b, t) + 24 * s_b + t_d + t + t_d
    est = estimate(w, 4, H100, link, overlap_threshold=False)
    assert est.total_s["forward"] == pytest.approx(2 * fwd, rel=1e-12)
    assert est.total_s["backward"] == pytest.approx(2 * bwd, rel=1e-12)


def test_attention_flops_count_min_i_plus_1_w_keys_per_query():
    w = _tiny(window=5)
    want = 2 * 4 * 4 * 16 * _hand_scores(64, 5) / 4  # layers x 4 B H D x scores / ranks
    assert attention_flops(w, 4) == pytest.approx(want, rel=1e-12)
    mixed = _tiny(window=5, window_layers=1)  # one windowed layer, one full causal
    full = 4 * 4 * 16 * 64**2 / 2 / 4
    assert attention_flops(mixed, 4) == pytest.approx(want / 2 + full, rel=1e-12)


def _llama_like(seq: int, window: int | None) -> Workload:
    model = ModelShape(
        layers=32,
        hidden=4096,
        intermediate=14336,
        vocab=32000,
        heads=32,
        kv_heads=8,
        head_dim=128,
        window=window,
    )
    return Workload(
        seq_len=seq, heads=32, kv_heads=8, head_dim=128, model=model, mode="score", backward=False
    )


def test_windowed_time_grows_as_n_and_full_causal_as_n_squared():
    link = Link("nvlink", 3600.0, 3e-6)
    times = {}
    for window in (4096, None):
        for seq in (1 << 19, 1 << 20):
            est = estimate(_llama_like(seq, window), 8, H100, link, ranks_on_host=8)
            times[window, seq] = est.total_s["forward"]
    assert times[4096, 1 << 20] / times[4096, 1 << 19] == pytest.approx(2, rel=0.02)
    assert times[None, 1 << 20] / times[None, 1 << 19] == pytest.approx(4, rel=0.02)
    assert times[4096, 1 << 20] < times[None, 1 << 20] / 50


def _config(tmp_path, **kw):
    base = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        num_hidden_layers=6,
        intermediate_size=128,
    )
    path = tmp_path / "config.json"
    path.write_text(json.dumps(base | kw))
    return model_shape(path)


def test_the_window_and_its_layers_come_from_the_config(tmp_path):
    m = _config(tmp_path, model_type="mistral", sliding_window=4096)
    assert (m.window, m.window_layers) == (4096, None)  # every layer
    m = _config(tmp_path, model_type="mistral", sliding_window=None)
    assert m.window is None
    m = _config(
        tmp_path,
        model_type="qwen2",
        sliding_window=4096,
        use_sliding_window=True,
        max_window_layers=2,
    )
    assert (m.window, m.window_layers) == (4096, 4)  # layers 2..5
    m = _config(tmp_path, model_type="qwen2", sliding_window=4096, use_sliding_window=False)
    assert m.window is None
    types = ["sliding_attention", "full_attention"] * 3
    m = _config(tmp_path, model_type="gemma2", sliding_window=4096, layer_types=types)
    assert (m.window, m.window_layers) == (4096, 3)
    # Without layer_types, the layers Gemma2Config (transformers 5) windows: every other one
    # (compat.sliding_layers, the job's rule; before, the planner priced none of them).
    m = _config(tmp_path, model_type="gemma2", sliding_window=4096)
    assert (m.window, m.window_layers) == (4096, 3)


def test_a_mistral_config_is_priced_with_its_window(tmp_path):
    """Before: `ringctl plan --model` read no window and priced Mistral as full causal."""
    m = _config(tmp_path, model_type="mistral", sliding_window=4096)
    w = Workload(
        seq_len=1 << 20, heads=4, kv_heads=2, head_dim=16, model=m, mode="score", backward=False
    )
    link = Link("nvlink", 3600.0, 3e-6)
    windowed = estimate(w, 4, H100, link).total_s["forward"]
    full = estimate(replace(w, window=1 << 20), 4, H100, link).total_s["forward"]
    assert windowed < full / 50


def test_a_window_must_be_a_token_count():
    with pytest.raises(ValueError, match="Workload.window"):
        Workload(seq_len=64, heads=4, kv_heads=2, head_dim=16, window=0)


def test_the_banded_kernels_chunk_is_held_beside_the_ring_whatever_n(tmp_path):
    """A window shorter than geometry.SPLIT_WINDOW runs on the masked banded kernel: one chunk
    of R = 128 query rows x R + W - 1 = 255 keys (4 heads, W = 128): on host CPUs the fused
    kernel's float32 mask (the zeros and the filled copy) and four boolean masks, 12 bytes per
    score; on GPUs (float32 matmuls) s, the masked s and p of every head, 48 bytes, and the
    mask. A longer window (Mistral's 4096) is cut into unmasked pieces: no such workspace."""
    cpu = get_device("cpu-test", _cpu_device_file(tmp_path / "devices.json"))
    part = "ring attention: banded kernel workspace (window 128)"
    for seq in (1 << 16, 1 << 20):
        w = replace(_tiny(window=128), seq_len=seq, mode="score", backward=False, dtype="float32")
        assert estimate(w, 4, cpu, Link("x", 10.0)).memory_bytes[part] == 128 * 255 * 12
        assert estimate(w, 4, H100, Link("x", 10.0)).memory_bytes[part] == 128 * 255 * 49
        long = replace(w, model=replace(w.model, window=4096))
        kinds = estimate(long, 4, H100, Link("x", 10.0)).memory_bytes
        assert not any("banded" in k for k in kinds), kinds
    full = replace(_tiny(), seq_len=1 << 20, mode="score", backward=False)
    assert not any("banded" in k for k in estimate(full, 4, H100, Link("x", 10.0)).memory_bytes)


def _cpu_device_file(path):
    """A calibrated host entry (as `ringctl plan --calibrate` writes one): block seconds."""
    blocks = {k: {"1024": [0.01, 0.02], "4096": [0.16, 0.32]} for k in ("full", "diag", "half")}
    entry = {"mem_gib": 64, "block_seconds": blocks, "cores": 4, "calib_shape": [1, 8, 64]}
    path.write_text(json.dumps({"cpu-test": entry}))
    return path


def test_a_windowed_hop_is_priced_by_the_largest_block_any_rank_sends():
    """P = 2 zigzag, 6144 rows per rank (chunks of 3072: rank 0 holds chunks 0 and 3, rank 1
    chunks 1 and 2), W = 4096. Rank 1 reads all 3072 rows of rank 0's chunk 0 (its chunk-1
    queries reach 4095 keys back); rank 0's chunk 3 (queries from 9216) reads rank 1's keys
    from 5121 on: chunk 1's last 1023 rows and all of chunk 2, 4095 rows, and its dK/dV
    comes home over them. The ring waits for the larger transfer (the planner once priced
    only what the busiest rank, 1, receives: 3072 rows)."""
    assert pw.rows_carried(2, 6144, "zigzag", 4096) == 4095
    # Mistral's W at 256k tokens on 4 ranks: one hop each way, W - 1 rows a hop
    assert pw.rows_carried(4, 65536, "zigzag", 4096) == 4095


def test_a_window_the_engine_cuts_has_no_banded_chunk_and_builds_no_plan():
    """A window of SPLIT_WINDOW keys or more runs as unmasked pieces, so the banded kernel's
    workspace is 0, known without building the ring's plans: a budget's search over N once
    built them for every N it tried (24 s at submit for a 2048-key window). Shorter windows
    still read the largest chunk off the plans."""
    for world, layout in [(2, "zigzag"), (3, "zigzag"), (4, "contiguous")]:
        for window in (64, 255, geometry.SPLIT_WINDOW, 1000):
            seq_local = 6 * window
            found = pw.banded_chunk_in_plans(world, seq_local, layout, window, 64)
            assert (found > 0) == (window < geometry.SPLIT_WINDOW), (world, layout, window)
            assert pw.largest_chunk(world, seq_local, layout, window, 64) == found
    pw.step_pieces.cache_clear()
    assert pw.largest_chunk(8, 1 << 22, "zigzag", 2048, 1024) == 0
    assert pw.step_pieces.cache_info().misses == 0  # no plan built


def _carried_on_the_whole_ring(world: int, seq_local: int, layout: str, window: int) -> int:
    lay = geometry.plain_layout(world * seq_local, world, layout)
    spans = [
        lay.kv_rows(owner, shift, hops, True, window)
        for shift, hops in zip((1, -1), lay.reach(True, window), strict=True)
        for owner in (range(world) if hops else ())
    ]
    return max((s.stop - s.start for s in spans), default=0)


def test_rows_carried_read_off_four_ranks_are_those_of_any_larger_ring():
    """``rows_carried`` builds a ring of RANKS_ALIKE_FROM ranks however many the plan has (the
    memory search asks at up to 65536: a second each, built whole); every larger ring here
    carries the same rows, its own plans read rank by rank."""
    assert pw.RANKS_ALIKE_FROM == 4
    for layout in ("zigzag", "contiguous"):
        for seq_local in (2, 8, 64, 100, 256):
            if layout == "zigzag" and seq_local % 2:
                continue
            for window in (1, 2, 5, 32, 63, 64, 65, 127, 129, 255, 300, 1000):
                for world in (4, 5, 7, 8, 16, 33):
                    want = _carried_on_the_whole_ring(world, seq_local, layout, window)
                    got = pw.rows_carried(world, seq_local, layout, window)
                    assert got == want, (layout, seq_local, window, world)
