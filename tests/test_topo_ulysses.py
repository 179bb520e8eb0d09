"""Hybrid plans (`ringctl topo --ulysses auto|N`): Ulysses groups inside NVLink domains, the
ring of groups across them, the degree from the heads, refusals, and the plan file."""

from __future__ import annotations

import itertools
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringattn.layouts import hybrid_grid
from ringctl.cli import main
from ringctl.errors import UserError
from ringctl.topology import RingPlan, load_node, load_node_files, load_plan, plan_ring
from ringctl.topology.gdr import GdrPolicy
from ringctl.topology.hybrid_place import groups_in_node, plan_hybrid
from ringctl.topology.links import DEFAULT_BANDWIDTHS
from ringctl.topology.report import print_plan
from ringctl.topology.slurm import parse_slurm_topology
from ringctl.topology.ulysses import partition_cliques
from tests.test_topo_placement import node_from, smi_text
from tests.topo_fixtures import CUBE, DGX, GB200, H100, NVL72_BLOCKS, PCIE, TWO_NIC, TWO_NIC_IBSTAT

NV = DEFAULT_BANDWIDTHS["NV"]


def nodes_of(path: Path, count: int, prefix: str = "d", ibstat: Path | None = None):
    return [load_node_files(path, ibstat, name=f"{prefix}{i}") for i in range(1, count + 1)]


def gb200_racks():
    """36 GB200 trays gb001.. (4 GPUs, NV18), two NVL72 blocks of 18 in NVL72_BLOCKS."""
    tray = load_node_files(GB200)
    topo = parse_slurm_topology(NVL72_BLOCKS.read_text(), str(NVL72_BLOCKS))
    return [replace(tray, name=f"gb{i:03d}") for i in range(1, 37)], topo


def check_hybrid(plan: RingPlan) -> None:
    """What the worker relies on, checked against the engine's own grid (`hybrid_grid`):
    group g = ranks gU..gU+U-1, ring u = member u of every group, hop u -> u+U."""
    u, rog, world = plan.ulysses.degree, plan.ring_of_groups, plan.world_size
    for r in range(world):
        ring_size, ring_rank, ulysses_rank = hybrid_grid(world, u, r)
        assert plan.ulysses.groups[ring_rank][ulysses_rank] == r
        assert rog.rings[ulysses_rank][ring_rank] == r and rog.size == ring_size
    assert len(rog.hops) == (world if rog.size > 1 else 0)
    for h in rog.hops:
        assert h.dst == (h.src + u) % world and h.group == h.src % u
    if rog.hops:
        assert rog.bottleneck.gbps == min(h.gbps for h in rog.hops)


@pytest.mark.parametrize(("smi", "link"), [(DGX, "NV12"), (H100, "NV18")])
def test_auto_makes_each_node_one_group_and_rings_across_the_nodes(smi, link):
    plan = plan_hybrid(nodes_of(smi, 4), ulysses="auto", heads=32, kv_heads=8)
    check_hybrid(plan)
    assert plan.ulysses.degree == 8 and plan.ring_of_groups.size == 4
    for g, ranks in enumerate(plan.ulysses.groups):  # a group is exactly one node's 8 GPUs
        assert {plan.ring[r].node for r in ranks} == {f"d{g + 1}"}
        assert sorted(plan.ring[r].gpu for r in ranks) == list(range(8))
    n = int(link[2:])
    assert plan.ulysses.inside[0] == {"domain": "d1", "nodes": ["d1"], "link": link, "gbps": n * NV}
    # every send of the ring of groups leaves the node, between the same GPU of two nodes
    assert {h.link for h in plan.ring_of_groups.hops} == {"NET"}
    for h in plan.ring_of_groups.hops:
        assert plan.ring[h.src].gpu == plan.ring[h.dst].gpu
    assert "auto: the 8 ranks of one node (32 heads, 8 kv heads allow it)" == plan.ulysses.reason


def test_dgx_ring_of_groups_sends_each_rank_through_its_own_nic_with_gpudirect():
    plan = plan_hybrid(nodes_of(DGX, 4), ulysses=8)
    for node in ("d1", "d2"):  # 8 GPUs, 8 compute NICs behind their PCIe switches (PXB)
        nics = [e.nic for e in plan.ring if e.node == node]
        assert nics == [f"mlx5_{i}" for i in range(8)]
    hops = plan.ring_of_groups.hops
    assert {(h.src_end, h.dst_end, h.shared) for h in hops} == {("GDR", "GDR", 1)}
    assert plan.ring_of_groups.bottleneck.gbps == DEFAULT_BANDWIDTHS["NET"]  # no ibstat


@pytest.mark.parametrize(
    ("heads", "kv_heads", "degree", "why"),
    [
        (32, 8, 8, "allow it"),
        (32, 1, 8, "allow it"),  # MQA: the kv head replicated across the group
        (4, 4, 4, "8 must divide the heads (4)"),
        (12, 4, 4, "8 must divide the heads (12)"),
        (6, 6, 2, "8 must divide the heads (6)"),
        (24, 3, 1, "8 and the K/V heads (3) must divide one another"),
        (3, 3, 1, "the ring alone"),
    ],
)
def test_auto_takes_the_largest_degree_the_heads_allow(heads, kv_heads, degree, why):
    plan = plan_hybrid(nodes_of(DGX, 2), ulysses="auto", heads=heads, kv_heads=kv_heads)
    check_hybrid(plan)
    assert plan.ulysses.degree == degree and why in plan.ulysses.reason
    assert (plan.ulysses.heads, plan.ulysses.kv_heads) == (heads, kv_heads)

    # the engine's rule, independently: the degree fits, no larger divisor of the node does
    def fits(u):
        return heads % u == 0 and (kv_heads % u == 0 or u % kv_heads == 0)

    assert fits(degree) and not any(fits(u) for u in (1, 2, 4, 8) if u > degree)


EXAMPLE = Path(__file__).resolve().parent.parent / "docs" / "topology-example"


def test_auto_keeps_the_all_to_all_on_nvlink(capsys):
    # the example's nodes: two NVLink pairs (NV2) joined by the socket link (SYS)
    nodes = [load_node(EXAMPLE / f"n{i}", f"n{i}") for i in range(1, 5)]
    topo = parse_slurm_topology((EXAMPLE / "topology.conf").read_text())
    plan = plan_hybrid(nodes, topo, ulysses="auto", heads=32, kv_heads=8)
    check_hybrid(plan)
    assert plan.ulysses.degree == 2 and "would have a SYS pair, not NVLink" in plan.ulysses.reason
    assert {x["link"] for x in plan.ulysses.inside} == {"NV2"}
    # the hybrid cube mesh (DGX-1): its two halves are all NVLink, the whole node is not
    cube = plan_hybrid([load_node_files(CUBE)], ulysses="auto", heads=32, kv_heads=8)
    assert cube.ulysses.degree == 4
    assert [sorted(cube.ring[r].gpu for r in g) for g in cube.ulysses.groups] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]
    # a degree the user gives is kept, and the report says what its all-to-all crosses
    given = plan_hybrid(nodes, topo, ulysses=4)
    assert {x["link"] for x in given.ulysses.inside} == {"SYS"}
    print_plan(given)
    assert (
        "Warning: the all-to-all of 4 group(s) crosses SYS (80 Gbit/s)" in capsys.readouterr().out
    )


def test_groups_smaller_than_a_node_stay_inside_it():
    plan = plan_hybrid(nodes_of(DGX, 2), ulysses=4)
    check_hybrid(plan)
    assert [{plan.ring[r].node for r in g} for g in plan.ulysses.groups] == [{"d1"}, {"d1"}] + [
        {"d2"}
    ] * 2
    # ring u: d1 group 0 -> d1 group 1 (NVLink) -> d2 group 2 (network) -> d2 group 3 -> d1
    links = [h.link for h in plan.ring_of_groups.hops if h.group == 0]
    assert links == ["NV12", "NET", "NV12", "NET"]


def test_partial_node_groups_keep_the_fast_pairs_together():
    # PCIe node: GPU0-1 PXB, GPU2-3 PIX, the cross pairs SYS: groups of 2 must be the pairs
    plan = plan_hybrid(nodes_of(PCIE, 2, "p"), ulysses=2)
    check_hybrid(plan)
    pairs = [sorted(plan.ring[r].gpu for r in g) for g in plan.ulysses.groups]
    assert pairs == [[0, 1], [2, 3], [0, 1], [2, 3]]
    assert [x["link"] for x in plan.ulysses.inside] == ["PXB", "PIX"] * 2


def test_a_node_split_into_groups_takes_cliques_and_enters_through_the_nic_side():
    table = dict(DEFAULT_BANDWIDTHS)
    # whatever order the ranks come in, the PCIe node's groups are its two well-linked pairs
    pcie = load_node_files(PCIE)
    assert groups_in_node(pcie, [0, 2, 1, 3], 2, table, GdrPolicy()) == [0, 1, 2, 3]
    # NVLink pairs 0-1 and 2-3; one NIC, next to GPU2 and GPU3 only: the pair that receives
    # from the network with GPUDirect comes first, the other (the senders) last
    link = {(0, 1): "NV4", (2, 3): "NV4"}
    text = smi_text(4, lambda i, j: link.get((i, j), "SYS"), [["SYS"], ["SYS"], ["PIX"], ["PIX"]])
    node = node_from(text)
    assert groups_in_node(node, [0, 1, 2, 3], 2, table, GdrPolicy()) == [2, 3, 0, 1]


def test_ranks_of_a_group_spread_over_equally_good_nics():
    # 4 NVLink GPUs; NIC0 PIX to all, NIC1 PXB to all (both GPUDirect): the nearest NIC would
    # carry all four sends at a quarter of its rate, two per NIC carry them at half
    nics = [["PIX", "PXB"]] * 4
    nodes = [node_from(smi_text(4, lambda i, j: "NV4", nics), f"h{k}") for k in (1, 2)]
    plan = plan_hybrid(nodes, ulysses=4)
    assert sorted(e.nic for e in plan.ring if e.node == "h1") == ["mlx5_0"] * 2 + ["mlx5_1"] * 2
    assert plan.ring_of_groups.bottleneck.gbps == DEFAULT_BANDWIDTHS["NET"] / 2


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([(4, 2), (6, 2), (6, 3), (8, 4), (8, 2)]), st.data())
def test_clique_partition_matches_brute_force(shape, data):
    m, n = shape
    w = [[0.0] * m for _ in range(m)]
    for i, j in itertools.combinations(range(m), 2):
        w[i][j] = w[j][i] = data.draw(st.sampled_from([80.0, 150.0, 200.0, 2400.0]))

    def key(groups):
        edges = [w[a][b] for g in groups for a, b in itertools.combinations(g, 2)]
        return (min(edges), -edges.count(min(edges)), sum(edges))

    got = partition_cliques(w, list(range(m)), n)
    assert sorted(x for g in got for x in g) == list(range(m)) and {len(g) for g in got} == {n}
    best = max(
        key([p[i : i + n] for i in range(0, m, n)]) for p in itertools.permutations(range(m))
    )
    assert key(got) == best


def test_nics_are_shared_evenly_by_the_ranks_that_cross_at_once():
    # two NICs next to GPU3 (mlx5_0) and GPU6 (mlx5_1), EDR 100: 8 ranks send at once
    plan = plan_hybrid(nodes_of(TWO_NIC, 2, "t", TWO_NIC_IBSTAT), ulysses=8)
    nics = [e.nic for e in plan.ring if e.node == "t1"]
    assert nics.count("mlx5_0") == nics.count("mlx5_1") == 4
    # the far GPUs bounce through host memory: 100 x 0.5, over 4 users of the NIC
    assert plan.ring_of_groups.bottleneck.gbps == 100 * 0.5 / 4
    # two groups per node: only the exit group sends, 2 per NIC (not 3 + 1)
    half = plan_hybrid(nodes_of(TWO_NIC, 2, "t", TWO_NIC_IBSTAT), ulysses=4)
    assert half.ring_of_groups.bottleneck.gbps == 100 * 0.5 / 2


def test_nvl72_groups_span_trays_of_one_block_and_the_ring_crosses_blocks_twice():
    nodes, topo = gb200_racks()
    plan = plan_hybrid(nodes, topo, ulysses="auto", heads=96, kv_heads=8, nvlink_blocks=True)
    check_hybrid(plan)
    assert plan.ulysses.degree == 24  # 72 and 36 do not divide 96 heads; 24 of 72 does
    block = {n: "nvl72a" if int(n[2:]) <= 18 else "nvl72b" for n in (x.name for x in nodes)}
    for ranks, inside in zip(plan.ulysses.groups, plan.ulysses.inside, strict=True):
        names = list(dict.fromkeys(plan.ring[r].node for r in ranks))
        assert names == inside["nodes"] and len(names) == 6
        assert {block[n] for n in names} == {inside["domain"]}
        assert inside["link"] == "NV18+MNNVL" and inside["gbps"] == 18 * NV
    for u in range(24):  # six groups per ring, three per block: NVLink inside, network twice
        links = [h.link for h in plan.ring_of_groups.hops if h.group == u]
        assert links.count("NET") == 2 and links.count("MNNVL") == 4
    assert plan.ring_of_groups.bottleneck.link == "NET"
    # blocks not declared NVLink: a domain is a tray of 4 GPUs
    trays = plan_hybrid(nodes, topo, ulysses="auto", heads=96, kv_heads=8)
    assert trays.ulysses.degree == 4 and "4 ranks of one node" in trays.ulysses.reason
    with pytest.raises(UserError, match="--ulysses 16 does not divide the 72 ranks of NVLink"):
        plan_hybrid(nodes, topo, ulysses=16, nvlink_blocks=True)


# ---- the command and the plan file ----------------------------------------------------------


def _dgx_args(tmp_path: Path, count: int = 4) -> list[str]:
    args = ["topo"]
    for i in range(1, count + 1):
        d = tmp_path / f"dgx{i}"
        d.mkdir(exist_ok=True)
        shutil.copy(DGX, d / "nvidia-smi-topo.txt")
        args += ["--node", f"dgx{i}={d}"]
    return args


def test_topo_ulysses_auto_table_and_plan_file(tmp_path, capsys):
    out_file = tmp_path / "placement.json"
    args = _dgx_args(tmp_path) + ["--ulysses", "auto", "--heads", "32", "--kv-heads", "8"]
    assert main([*args, "-o", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "Hybrid: 4 Ulysses groups of 8 ranks (all-to-all inside), 8 rings of 4 groups" in out
    assert "Ulysses degree 8: auto: the 8 ranks of one node" in out
    assert out.count("NV12 ") >= 4  # a group row per node, NVLink inside
    assert "Ring-of-groups bottleneck: NET at 100 Gbit/s, hop 0->8" in out
    plan = load_plan(out_file)
    check_hybrid(plan)
    assert RingPlan.from_json(plan.to_json()) == plan
    data = json.loads(out_file.read_text())
    assert data["version"] == 1 and data["ulysses"]["degree"] == 8
    assert data["ulysses"]["groups"][1] == list(range(8, 16))
    assert data["ring_of_groups"]["rings"][0] == [0, 8, 16, 24]
    assert len(data["hops"]) == 32 and data["ring_size"] == 32  # the flat ring, as before


def test_plans_without_ulysses_are_unchanged_and_still_load(tmp_path):
    main(["topo", "--nvidia-smi", str(DGX), "-o", str(tmp_path / "p.json")])
    data = json.loads((tmp_path / "p.json").read_text())
    assert "ulysses" not in data and "ring_of_groups" not in data
    plan = load_plan(tmp_path / "p.json")
    assert plan.ulysses is None and plan.ring_of_groups is None


def test_tampered_hybrid_groups_are_refused():
    data = json.loads(plan_hybrid(nodes_of(DGX, 2), ulysses=4).to_json())
    bad = json.loads(json.dumps(data))
    bad["ulysses"]["groups"][0], bad["ulysses"]["groups"][1] = [0, 1, 4, 5], [2, 3, 6, 7]
    with pytest.raises(UserError, match="p.json: ulysses.groups must be the blocks of 4 consec"):
        RingPlan.from_dict(bad, "p.json")
    bad = json.loads(json.dumps(data))
    bad["ring_of_groups"]["rings"][0] = [0, 5, 8, 12]
    with pytest.raises(UserError, match="p.json: ring_of_groups must hold 4 rings of 4 ranks"):
        RingPlan.from_dict(bad, "p.json")
    bad = json.loads(json.dumps(data))
    bad["ulysses"]["degree"] = 3
    with pytest.raises(UserError, match="ulysses.degree 3 does not divide the 16 ranks"):
        RingPlan.from_dict(bad, "p.json")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--ulysses", "16"], "--ulysses 16 does not divide the 8 ranks of node dgx1: a Ulysses"),
        (["--ulysses", "3"], "--ulysses 3 does not divide the job's 16 ranks"),
        (["--ulysses", "auto"], "--ulysses auto needs --heads"),
        (["--ulysses", "8", "--heads", "12"], "--ulysses 8: 8 must divide the heads (12)"),
        (["--ulysses", "8", "--heads", "24", "--kv-heads", "3"], "must divide one another"),
        (["--ulysses", "auto", "--heads", "32", "--kv-heads", "5"], "not a multiple of"),
        (["--ulysses", "0"], "--ulysses 0: expected auto or a positive integer"),
        (["--ulysses", "four"], "--ulysses four: expected auto or a positive integer"),
        (["--ulysses", "8", "--ring-size", "8"], "--ring-size (rings of rings) or --ulysses"),
        (["--heads", "32"], "--heads and --kv-heads go with --ulysses"),
    ],
)
def test_refusals_are_one_line(tmp_path, capsys, extra, message):
    assert main(_dgx_args(tmp_path, 2) + extra) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err and captured.err.count("\n") == 1


def test_flat_plan_is_the_same_order_as_the_ring_placement_for_whole_node_groups():
    nodes = nodes_of(DGX, 2)
    hybrid, flat = plan_hybrid(nodes, ulysses=8), plan_ring(nodes)
    assert [(e.node, e.gpu) for e in hybrid.ring] == [(e.node, e.gpu) for e in flat.ring]
    assert hybrid.bottleneck.gbps == flat.bottleneck.gbps
    # degree 1 is the ring alone: one ring of groups, the flat ring over the same order
    alone = plan_hybrid(nodes, ulysses=1)
    check_hybrid(alone)
    assert alone.ring_of_groups.rings == [list(range(16))]
    assert alone.ring_of_groups.hops == alone.hops
