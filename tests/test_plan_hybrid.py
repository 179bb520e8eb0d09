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


ATTENTION = ["plan", "attention", "backend=slurm", "gpus_per_node=8"]


def test_a_hybrid_job_is_planned_by_its_grid_s_length_rule(capsys):
    """(hybrid review) The plan checked a hybrid job's length by the flat ring's rule (2P):
    seq_len 252 on 4 ranks in groups of 4 (R = 1: lcm(4, 2) = 4) was refused, "must be a
    multiple of 8", though the job took it, ran and passed its own check."""
    argv = [
        *ATTENTION,
        "nodes=1",
        "tasks_per_node=4",
        "gpus_per_node=4",
        "task.seq_len=252",
        "task.heads=4",
        "task.kv_heads=4",
        "ring.ulysses=4",
        "--json",
    ]
    assert main(argv) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["ulysses"] == 4


def test_the_layout_table_compares_the_grid_the_job_runs(capsys):
    """(hybrid review) With ring.ulysses=4 on nodes of 8, the estimate was of 4x4 but the
    layout table, its sentence and recommended_layout compared the 8x2 grid."""
    assert main([*ATTENTION, "nodes=2", "tasks_per_node=8", "ring.ulysses=4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [x["name"] for x in report["layouts"]][1].startswith("hybrid 4x4")
    assert all("8x2" not in x["name"] for x in report["layouts"])


def test_ulysses_groups_across_nodes_are_priced_on_the_network(capsys):
    """(hybrid review) Groups of 2 over nodes of 1 rank (placement optional runs them so) were
    priced on NVLink, 8-9x under the network the plan models, without a word; `--ulysses 16`
    beside a job of 8 ranks a node passed, though the job refuses ring.ulysses=16."""
    base = [*ATTENTION, "nodes=4", "tasks_per_node=1", "gpus_per_node=1", "ring.placement=optional"]
    assert main([*base, "--json"]) == 0
    flat = json.loads(capsys.readouterr().out)
    assert main([*base, "ring.ulysses=2", "--json"]) == 0
    spans = json.loads(capsys.readouterr().out)
    assert any("Ulysses groups of 2 span nodes" in w for w in spans["warnings"]), spans
    assert spans["all_to_all_s"] > 5 * estimate_on_nvlink(spans)
    assert not flat.get("all_to_all_s")
    assert main(["plan", "attention", "--ulysses", "16"]) == 2
    assert "--ulysses 16: ring.ulysses: 16 does not divide the 8 ranks" in capsys.readouterr().err


def estimate_on_nvlink(report: dict) -> float:
    """The same all-to-all on the H100's NVLink (what it was priced on before)."""
    from ringctl.planner.cost import intra_link
    from ringctl.planner.timing import all_to_all_s

    work = Workload(
        seq_len=report["tokens_per_rank"] * report["ranks"],
        heads=32,
        kv_heads=8,
        head_dim=128,
        ulysses=2,
    )
    fwd, _ = all_to_all_s(work, report["ranks"], intra_link(H100))
    return fwd
