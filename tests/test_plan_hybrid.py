"""Flat ring versus hybrid Ulysses x ring in the planner: the degrees the heads allow, what
the hybrid changes in the ring's steps, and which layout `ringctl plan` recommends."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from ringctl.cli import main
from ringctl.planner.cost import Link, Workload, estimate
from ringctl.planner.devices import get_device
from ringctl.planner.hybrid import compare_layouts, recommend, ulysses_degrees

H100 = get_device("H100-SXM")
NDR = Link("NET", 400.0, 5e-6)
ATTN = Workload(seq_len=1 << 20, heads=32, kv_heads=8, head_dim=128, mode="train")


def test_ulysses_degrees_follow_heads_and_node():
    assert ulysses_degrees(ATTN, 64, 8) == [2, 4, 8]
    assert ulysses_degrees(replace(ATTN, heads=12, kv_heads=4), 64, 8) == [2, 4]
    assert ulysses_degrees(replace(ATTN, kv_heads=1), 64, 8) == [2, 4, 8]  # MQA: replicated
    assert ulysses_degrees(ATTN, 6, 6) == [2]  # 3 and 6 do not divide 32 heads


def test_hybrid_ring_has_fewer_steps_with_u_times_the_compute_each():
    flat = estimate(ATTN, 64, H100, NDR, ranks_on_host=8)
    hybrid = estimate(replace(ATTN, ulysses=8), 64, H100, NDR, ranks_on_host=8)
    ratio = hybrid.step_compute_s["forward"] / flat.step_compute_s["forward"]
    assert ratio == pytest.approx(8, rel=1e-6)  # (N/8)^2 x 4 heads vs (N/64)^2 x 32 heads
    transfer = hybrid.step_transfer_s["forward"] / flat.step_transfer_s["forward"]
    assert transfer == pytest.approx(1, rel=0.01)  # (N/8) x 1 K/V head vs (N/64) x 8
    # the same FLOPs in all: ring attention's compute-bound total is unchanged
    assert hybrid.total_s["forward"] == pytest.approx(flat.total_s["forward"], rel=0.02)


def test_recommendation_follows_where_the_flat_ring_is_exposed():
    short = compare_layouts(replace(ATTN, seq_len=1 << 17), 64, H100, nodes=8, flat_link=NDR)
    assert not all(short[0].estimate.overlapped.values())  # flat: 2k tokens per rank, exposed
    assert recommend(short).ulysses == 8
    long = compare_layouts(ATTN, 64, H100, nodes=8, flat_link=NDR)
    assert all(long[0].estimate.overlapped.values())  # 16k tokens per rank: hidden
    assert recommend(long).ulysses == 1  # the all-to-all buys nothing there
    assert long[1].estimate.all_to_all_s > 0


def test_plan_cli_compares_layouts(capsys):
    argv = "plan --seq 131072 --ranks 64 --nodes 8 --heads 32 --kv-heads 8 --json".split()
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    names = [layout["name"] for layout in report["layouts"]]
    assert names[0] == "flat ring" and names[1].startswith("hybrid 8x8")
    assert report["recommended_layout"].startswith("hybrid 8x8")
    assert main([*argv[:-1], "--ulysses", "3"]) == 2
    assert "--ulysses 3 must divide" in capsys.readouterr().err
