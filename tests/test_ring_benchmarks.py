"""The ring's measuring tools count what the engine does: benchmarks.overhead's per-call counts
against the numbers the loop must produce, and the attention benchmark's interleaved pairings
(the side-by-side command) run end to end on a tiny case."""

from __future__ import annotations

import json

from benchmarks import attention, overhead


def test_overhead_counts_a_ring_call_exactly(tmp_path):
    """P = 2, N = 64 (32 tokens, 8 heads x 64 per rank, float32): one collective (the shape
    check); forward K/V one hop, backward K/V one hop and one dK/dV accumulator: 3 blocks of
    2 x 32 x 8 x 64 x 4 bytes in 12 messages; plans from the cache; a floor of the same kernels.
    Causal, zigzag: rank 1 reads only the early half of rank 0's block, so rank 0 sends half
    its K/V and rank 1 half an accumulator home: the busier rank (1) sends 2.5 blocks."""
    out = tmp_path / "overhead.json"
    assert overhead.main(["--seq", "64", "--repeats", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["seq"], r["causal"]) for r in rows] == [(64, False), (64, True)]
    for r in rows:
        assert (r["collectives"], r["p2p"]) == (1, 12), r
        blocks = 2.5 if r["causal"] else 3
        assert r["mib_sent"] * 2**20 == blocks * 2 * 32 * 8 * 64 * 4, r
        assert r["plan_misses"] == 0, r
        assert r["floor_ms"] > 0 and r["wall_x"] > 0 and r["cpu_x"] > 0, r
        assert r["same_x"] > 0 and r["in_step_x"] >= 1, r
        assert r["bracket_x"] > 0 and r["cpu_bracket_x"] > 0, r
        assert r["wall_x_ci"] is None, r  # one repetition: no interval claimed
        assert r["fwd_kernel_x"] > 0 and r["bwd_kernel_x"] > 0, r
        assert r["host_ms"] >= 0 and r["aten_ops"] > 0, r
    assert (tmp_path / "overhead.md").read_text().count("| 64 |") == 2


def test_pairings_time_ring_and_sdpa_side_by_side(tmp_path):
    """`--pairings` with this checkout named as the engine: one row per configuration, each
    with one ring/SDPA ratio per pairing, their median reported, and SDPA timed again after the
    ring in each pairing (the harness against itself)."""
    out = tmp_path / "pairs.json"
    argv = "--seq 64 --causal true --pairings 2 --repeats 1 --engine .".split()
    argv += ["--json", str(out)]
    assert attention.main(argv) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert (row["ranks"], row["threads"], row["seq"], row["causal"]) == (2, 1, 64, True)
    assert len(row["ratios"]) == 2 and min(row["ratios"]) <= row["ratio"] <= max(row["ratios"])
    assert row["ring_ms"] > 0 and row["sdpa_ms"] > 0
    assert len(row["sdpa_again"]) == 2 and all(x > 0 for x in row["sdpa_again"]), row
    assert "ring/SDPA" in (tmp_path / "pairs.md").read_text()


def test_a_full_measurement_times_the_ring_without_its_transfers(tmp_path):
    """Without --pairings each ring is also timed with nothing sent (its compute alone): the
    loop runs on a transport that only fills the landing buffers, on every ring shape."""
    out = tmp_path / "full.json"
    argv = "--seq 64 --ranks 2 --causal true --layouts zigzag --repeats 1 --no-baseline".split()
    assert attention.main([*argv, "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["fwd_bwd_s"] > 0 and row["extra"]["no_transfer_fwd_bwd_s"] > 0, row
    assert row["hidden_comm"] is not None, row
    # The transfers timed alone are the step's own, rank by rank: at P = 2 a leg of one hop
    # carries only the rows its holder reads, so each rank sends less than whole blocks
    # would be (K/V forward, K/V backward, dK/dV home: 6 tensors of a block's size).
    sent, alone = row["extra"]["bytes_sent"], row["extra"]["bytes_alone"]
    assert sent == alone and all(sent), row["extra"]
    block = 64 // 2 * 8 * 64 * 4  # a rank's K (or V): 32 rows, 8 heads of 64, float32
    assert max(sent) < 6 * block, sent


def test_a_median_interval_is_the_order_statistics_of_the_binomial_table():
    """The distribution-free 95% interval for a median: the k-th smallest and largest of n
    samples, k from the binomial table (n = 10: 2nd and 9th, coverage 0.979; 20: 6th and
    15th, 0.959; 30: 10th and 21st, 0.957); under 6 samples no interval reaches 95%."""
    from benchmarks.median_interval import median_interval

    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None
    for n, k, coverage in ((6, 1, 0.969), (10, 2, 0.979), (20, 6, 0.959), (30, 10, 0.957)):
        samples = [float(x) for x in reversed(range(1, n + 1))]  # order must not matter
        got = median_interval(samples)
        assert (got.low, got.high) == (k, n + 1 - k), (n, got)
        assert abs(got.coverage - coverage) < 5e-4, (n, got)
        wider = median_interval(samples, level=0.99)  # 6 samples reach 96.9% at most
        assert wider is None if n == 6 else wider.low < got.low < got.high < wider.high
