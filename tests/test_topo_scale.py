"""The scale benchmark's sizes as tests, with limits generous enough never to flake on a loaded
2-core machine (the real figures are in benchmarks/topology_scale.py): what is asserted is that
nothing is quadratic and that a bracket product over the cap costs nothing."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from benchmarks.topology_scale import cluster_nodes, three_level_tree
from ringctl.errors import UserError
from ringctl.topology import plan_ring
from ringctl.topology.hostlist import MAX_HOSTS, HostlistError, count, expand
from ringctl.topology.slurm import parse_slurm_topology

LIMIT_S = 30.0  # the benchmark's 4,096 nodes take ~0.5 s here; quadratic code takes minutes


@pytest.mark.parametrize("n_nodes", [64, 512, 4096])
def test_three_level_tree_placement_scales(n_nodes):
    nodes = cluster_nodes(n_nodes)
    text = three_level_tree(n_nodes)
    start = time.perf_counter()
    topo = parse_slurm_topology(text, "topology.conf")
    plan = plan_ring(nodes, topo)
    rings = plan_ring(nodes, topo, ring_size=16)
    assert time.perf_counter() - start < LIMIT_S
    assert plan.world_size == 8 * n_nodes
    leaves = n_nodes // 16
    assert plan.switch_crossings() == leaves  # each leaf one run of the ring
    assert [n["switch_path"][2] for n in plan.nodes] == ["spine"] * n_nodes
    assert all(g.span.startswith("leaf ") for g in rings.groups)
    assert len(rings.groups) == n_nodes // 2


def test_placement_memory_is_linear_in_the_ranks():
    peaks = {}
    for n_nodes in (32, 256):
        nodes, text = cluster_nodes(n_nodes), three_level_tree(n_nodes)
        tracemalloc.start()
        plan_ring(nodes, parse_slurm_topology(text)).to_json()
        peaks[n_nodes] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    # 8x the nodes, at most ~8x the memory (a quadratic table would be 64x), and < 16 KiB/rank
    assert peaks[256] < 10 * peaks[32]
    assert peaks[256] / (256 * 8) < 16 * 1024


def test_million_host_range_expands_quickly():
    start = time.perf_counter()
    names = expand("n[1-1000000]")
    assert time.perf_counter() - start < LIMIT_S
    assert len(names) == 1_000_000 and names[0] == "n1" and names[-1] == "n1000000"
    assert count("n[000001-1000000],login") == 1_000_001


@pytest.mark.parametrize(
    "expr",
    [
        "a[1-1000]b[1-1000]c[1-1000]",
        "n[1-1500000],m[1-1500000]",  # each item under the cap, together over it
        "n[0-99999999999]",
    ],
)
def test_bracket_products_over_the_cap_are_refused_before_allocating(expr):
    tracemalloc.start()
    with pytest.raises(HostlistError, match=f"more than {MAX_HOSTS:,} host names"):
        expand(expr)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20  # nothing was built (the 10^9 product would be gigabytes)


def test_topology_conf_with_an_oversized_product_names_the_line():
    text = "SwitchName=s0 Nodes=n[1-4]\nSwitchName=s1 Nodes=a[1-1000]b[1-1000]c[1-1000]\n"
    with pytest.raises(UserError) as err:
        parse_slurm_topology(text, "topology.conf")
    assert str(err.value).startswith("topology.conf:2: 'a[1-1000]b[1-1000]c[1-1000]' stands for")
    assert "\n" not in str(err.value)


def test_leaf_lookups_are_linear():
    text = "SwitchName=leaf0 Nodes=n[1-100000]\nSwitchName=leaf1 Nodes=n[100001-200000]\n"
    text += "SwitchName=spine Switches=leaf[0-1]\n"
    start = time.perf_counter()
    topo = parse_slurm_topology(text)
    order = topo.node_order()
    leaves = [topo.leaf_of(n) for n in order]
    path = topo.switch_path("n200000")
    assert time.perf_counter() - start < LIMIT_S  # a scan of every group per node: hours
    assert len(order) == 200_000 and order[0] == "n1" and order[-1] == "n200000"
    assert leaves.count("leaf0") == leaves.count("leaf1") == 100_000
    assert path == ["leaf1", "spine"]


def _island_node(n: int):
    """One node of n GPUs: NVLink between GPUs i, j with i = j mod 4, PXB or SYS otherwise,
    so index order is a bad ring and 2-opt has work to do (pairs of 8-GPU boards)."""
    from ringctl.topology import build_node
    from ringctl.topology.nvidia_smi import parse_nvidia_smi

    def cell(i: int, j: int) -> str:
        if i == j:
            return "X"
        return "NV12" if i % 4 == j % 4 else "PXB" if i % 2 == j % 2 else "SYS"

    lines = ["\t" + "\t".join(f"GPU{i}" for i in range(n)) + "\tCPU Affinity\tNUMA Affinity"]
    lines += [f"GPU{i}\t" + "\t".join(cell(i, j) for j in range(n)) + "\t0-15\t0" for i in range(n)]
    return build_node("n1", parse_nvidia_smi("\n".join(lines) + "\n"))


def test_the_heuristic_for_large_nodes_is_bounded(monkeypatch):
    """f5: above EXACT_LIMIT every GPU was a starting point of greedy + 2-opt, each O(k^3) per
    pass, with the incumbent's key recomputed per candidate: 64 GPUs 3.6 s, 96 GPUs 16.8 s.
    The starts are capped (MAX_STARTS) and the incumbent's key kept; counted in key
    evaluations, not seconds, so a loaded machine cannot flake it."""
    from ringctl.topology import search

    calls = 0
    real_key = search.order_key

    def counted(*args, **kwargs):
        nonlocal calls
        calls += 1
        return real_key(*args, **kwargs)

    monkeypatch.setattr(search, "order_key", counted)
    plan = plan_ring([_island_node(64)])
    assert calls < 60_000  # 258,174 before
    assert plan.bottleneck.link == "SYS" and [h.link for h in plan.hops].count("SYS") == 2
    assert sorted(e.gpu for e in plan.ring) == list(range(64))


def test_nodes_over_the_gpu_maximum_are_refused_at_once():
    """f5: a node past MAX_NODE_GPUS (a generated or corrupt matrix: real ones hold 16 at most)
    is refused in one line instead of searched for minutes."""
    from ringctl.topology.placement import MAX_NODE_GPUS

    node = _island_node(MAX_NODE_GPUS + 1)
    start = time.perf_counter()
    with pytest.raises(UserError, match=f"^node n1 has {MAX_NODE_GPUS + 1} GPUs; at most 64 per"):
        plan_ring([node])
    assert time.perf_counter() - start < 1.0
