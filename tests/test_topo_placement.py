"""Placement on the fixture machines and on constructed layouts, and its invariants."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringctl.errors import UserError
from ringctl.topology import build_node, load_node_files, plan_ring
from ringctl.topology.gdr import GdrPolicy
from ringctl.topology.ibstat import parse_ibstat
from ringctl.topology.links import DEFAULT_BANDWIDTHS, link_gbps
from ringctl.topology.nvidia_smi import parse_nvidia_smi
from ringctl.topology.search import best_order, order_key
from ringctl.topology.slurm import parse_slurm_topology
from tests.topo_fixtures import CUBE, DGX, H100, LEONARDO, OLD, PCIE, ROCE_ONLY


def smi_text(n: int, link, nics: list[list[str]] | None = None) -> str:
    """nvidia-smi style text for n GPUs; link(i, j) gives the token, nics[i] the NIC cells."""
    m = len(nics[0]) if nics else 0
    header = [f"GPU{i}" for i in range(n)] + [f"NIC{k}" for k in range(m)]
    lines = ["\t" + "\t".join(header + ["CPU Affinity", "NUMA Affinity"])]
    for i in range(n):
        cells = [" X " if i == j else link(min(i, j), max(i, j)) for j in range(n)]
        cells += nics[i] if nics else []
        lines.append(f"GPU{i}\t" + "\t".join(cells) + "\t0-7\t0")
    for k in range(m):
        cells = [nics[i][k] for i in range(n)] + [" X " if k == q else "SYS" for q in range(m)]
        lines.append(f"NIC{k}\t" + "\t".join(cells))
    if m:
        lines += ["", "NIC Legend:", ""] + [f"  NIC{k}: mlx5_{k}" for k in range(m)]
    return "\n".join(lines) + "\n"


def node_from(text: str, name: str = "node", ibstat: str | None = None):
    hcas = parse_ibstat(ibstat) if ibstat is not None else None
    return build_node(name, parse_nvidia_smi(text), hcas)


def ibstat_text(ports: dict[str, tuple[str, int, str]]) -> str:
    """ibstat output: {hca: (state, rate, link layer)}."""
    out = []
    for name, (state, rate, layer) in ports.items():
        phys = "LinkUp" if state == "Active" else "Disabled"
        out += [f"CA '{name}'", "\tPort 1:", f"\t\tState: {state}"]
        out += [f"\t\tPhysical state: {phys}", f"\t\tRate: {rate}", f"\t\tLink layer: {layer}"]
    return "\n".join(out) + "\n"


def gpu_order(plan, node: str) -> list[int]:
    return [e.gpu for e in plan.ring if e.node == node]


def leaf_runs(plan) -> list[str]:
    """Leaf switch of each rank's node, in ring order."""
    switch = {n["name"]: n["switch"] for n in plan.nodes}
    return [switch[e.node] for e in plan.ring]


# ---- one node ------------------------------------------------------------------------------


def test_dgx_a100_ring_all_nv12_and_rail_nics():
    plan = plan_ring([load_node_files(DGX, name="dgx")])
    assert sorted(gpu_order(plan, "dgx")) == list(range(8))
    assert {h.link for h in plan.hops} == {"NV12"} and len(plan.hops) == 8
    assert plan.bottleneck.gbps == 12 * DEFAULT_BANDWIDTHS["NV"]
    nic_of = {e.gpu: e.nic for e in plan.ring}
    assert nic_of == {g: f"mlx5_{g}" for g in range(8)}  # PXB NIC, one per GPU, never mlx5_8/9
    e0 = plan.entry_for("dgx", 0)
    assert e0.env["CUDA_VISIBLE_DEVICES"] == str(e0.gpu)
    assert e0.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # nvidia-smi's order, not CUDA's
    assert e0.env["NCCL_IB_HCA"] == f"=mlx5_{e0.gpu}"
    assert e0.env["RINGCTL_NUMA_NODE"] == str([3, 3, 1, 1, 7, 7, 5, 5][e0.gpu])


def test_h100_nv18_no_nic():
    plan = plan_ring([load_node_files(H100, name="h100")])
    assert plan.bottleneck.link == "NV18" and plan.bottleneck.gbps == 3600.0
    assert all(e.nic is None and "NCCL_IB_HCA" not in e.env for e in plan.ring)


def test_pcie_pairs_stay_adjacent_two_sys_hops_minimum():
    plan = plan_ring([load_node_files(PCIE)])
    links = sorted(h.link for h in plan.hops)
    assert links == ["PIX", "PXB", "SYS", "SYS"]
    order = gpu_order(plan, "node")
    pos = {g: i for i, g in enumerate(order)}
    assert abs(pos[0] - pos[1]) in (1, 3) and abs(pos[2] - pos[3]) in (1, 3)


def test_hybrid_cube_mesh_finds_all_nvlink_cycle_where_index_order_is_not():
    node = load_node_files(CUBE)
    w = [
        [0 if i == j else link_gbps(t, DEFAULT_BANDWIDTHS) for j, t in enumerate(row)]
        for i, row in enumerate(node.gpu_links)
    ]
    assert order_key(list(range(8)), w, cycle=True)[0] == DEFAULT_BANDWIDTHS["SYS"]
    plan = plan_ring([node])
    assert all(h.link == "NV2" for h in plan.hops)  # every hop a double NVLink
    assert plan.bottleneck.gbps == 400.0


def test_nvlink_pairs_without_a_full_cycle_minimise_slow_hops():
    # GPUs 0-3 on socket A (PHB between them), 4-5 on socket B; NV2 pairs (0,1), (2,3), (4,5)
    def link(i, j):
        if (i, j) in {(0, 1), (2, 3), (4, 5)}:
            return "NV2"
        return "PHB" if j < 4 else "SYS"

    node = node_from(smi_text(6, link))
    plan = plan_ring([node])
    links = [h.link for h in plan.hops]
    assert links.count("NV2") == 3 and links.count("SYS") == 2 and links.count("PHB") == 1
    w = [
        [
            0 if i == j else link_gbps(link(min(i, j), max(i, j)), DEFAULT_BANDWIDTHS)
            for j in range(6)
        ]
        for i in range(6)
    ]
    best = max(order_key(p, w, cycle=True) for p in itertools.permutations(range(6)))
    assert order_key(gpu_order(plan, "node"), w, cycle=True) == best


def test_fewer_ranks_than_gpus_takes_the_best_subset():
    def link(i, j):
        return "NV4" if {i, j} <= {1, 2, 3} else "SYS"

    plan = plan_ring([node_from(smi_text(5, link))], ranks_per_node=3)
    assert sorted(gpu_order(plan, "node")) == [1, 2, 3]
    assert [e.local_rank for e in plan.ring] == [0, 1, 2]
    with pytest.raises(UserError, match="has 5 GPUs, fewer than --ranks-per-node 6"):
        plan_ring([node_from(smi_text(5, link))], ranks_per_node=6)


def test_single_gpu_single_rank_has_no_hop():
    plan = plan_ring([node_from(smi_text(1, None))])
    assert plan.world_size == 1 and plan.hops == [] and plan.bottleneck is None


def test_bandwidth_overrides_change_estimates():
    plan = plan_ring([load_node_files(PCIE)], bandwidths={"SYS": 10, "pix": 300})
    gbps = {h.link: h.gbps for h in plan.hops}
    assert gbps["SYS"] == 10.0 and gbps["PIX"] == 300.0
    with pytest.raises(UserError, match="unknown link kind 'FOO'"):
        plan_ring([load_node_files(PCIE)], bandwidths={"FOO": 1})


# ---- several nodes -------------------------------------------------------------------------


def test_entry_and_exit_gpus_are_the_ones_near_a_usable_nic():
    # only mlx5_0 and mlx5_1 are up: PXB to GPU0 and GPU1, SYS to every other GPU
    ib = ibstat_text(
        {f"mlx5_{k}": ("Active" if k < 2 else "Down", 200, "InfiniBand") for k in range(10)}
    )
    text = DGX.read_text()
    nodes = [node_from(text, f"dgx{i}", ib) for i in range(3)]
    plan = plan_ring(nodes)
    for node in ("dgx0", "dgx1", "dgx2"):
        order = gpu_order(plan, node)
        assert {order[0], order[-1]} == {0, 1}
    net = [h for h in plan.hops if h.link == "NET"]
    assert len(net) == 3
    assert all(h.gbps == min(200.0, DEFAULT_BANDWIDTHS["PXB"]) for h in net)
    assert {e.nic for e in plan.ring} == {"mlx5_0", "mlx5_1"}
    assert plan.bottleneck.link == "NET"


def test_node_with_only_ethernet_nics_up_uses_roce():
    nodes = [node_from(OLD.read_text(), f"e{i}", ROCE_ONLY.read_text()) for i in range(2)]
    plan = plan_ring(nodes)
    assert {e.nic for e in plan.ring} == {"mlx5_2"}
    assert {e.env["NCCL_IB_HCA"] for e in plan.ring} == {"=mlx5_2:1"}
    nics = {n["name"]: n for n in plan.nodes[0]["nics"]}
    assert nics["mlx5_2"]["link_layer"] == "Ethernet" and nics["mlx5_2"]["usable"]
    assert not nics["mlx5_0"]["usable"] and not nics["mlx5_1"]["usable"]
    # GPU0/1 are PHB to mlx5_2 (100 Gbit/s port), GPU2/3 SYS: all beyond NCCL's default GDR
    # distance (PXB), so every network end bounces through host memory at half the port rate.
    net = [h for h in plan.hops if h.link == "NET"]
    assert len(net) == 2 and {(h.src_end, h.dst_end) for h in net} == {("host bounce",) * 2}
    assert plan.bottleneck.link == "NET" and plan.bottleneck.gbps == 50.0
    # With GDR allowed up to PHB, GPU0/1 reach the NIC directly (100, capped by PHB 150): the
    # ring enters and leaves each node through them and pays two SYS hops inside instead.
    phb = plan_ring(nodes, gdr=GdrPolicy("PHB"))
    for node in ("e0", "e1"):
        order = gpu_order(phb, node)
        assert {order[0], order[-1]} == {0, 1}
    net = [h for h in phb.hops if h.link == "NET"]
    assert {(h.src_end, h.dst_end, h.gbps) for h in net} == {("GDR", "GDR", 100.0)}
    assert phb.bottleneck.link == "SYS" and phb.bottleneck.gbps == DEFAULT_BANDWIDTHS["SYS"]
    assert {e.env["NCCL_NET_GDR_LEVEL"] for e in phb.ring} == {"PHB"}


def test_every_network_hop_joins_nics_of_one_link_layer():
    """Each node picked its NICs by its own GPUs: a node whose InfiniBand ports were down
    (only RoCE up) beside one with both planned hops from InfiniBand into Ethernet, which
    NCCL cannot join, exit 0. The ring takes the layer every node has; none: refused."""
    both = {"mlx5_0": ("Active", 200, "InfiniBand"), "mlx5_1": ("Active", 100, "Ethernet")}
    text = smi_text(2, lambda i, j: "NV12", [["PIX", "SYS"], ["SYS", "PIX"]])
    a = node_from(text, "a", ibstat_text(both))
    down = both | {"mlx5_0": ("Down", 200, "InfiniBand")}
    b = node_from(text, "b", ibstat_text(down))
    plan = plan_ring([a, b])
    layer = {nic["name"]: nic["link_layer"] for nic in plan.nodes[0]["nics"]}
    assert {e.nic for e in plan.ring} == {"mlx5_1"} and layer["mlx5_1"] == "Ethernet"
    assert plan_ring([a, replace(a, name="c")]).ring[0].nic == "mlx5_0"  # both: InfiniBand
    ib_only = node_from(text, "d", ibstat_text({"mlx5_0": both["mlx5_0"]}))
    with pytest.raises(UserError, match="no link layer joins every node's usable NICs"):
        plan_ring([b, ib_only])


def test_the_ring_s_link_layer_is_the_faster_one_and_only_where_hops_leave_nvlink():
    """InfiniBand was taken wherever every node had it: 4 x 400G RoCE rails beside a 100G
    InfiniBand storage card went through the card (50 Gbit/s ends, not 200). A ring inside
    one NVLink domain (--nvlink-blocks) uses no NIC: its nodes' layers were refused; an
    "Unknown" link layer counted as a third one."""
    from ringctl.topology.slurm import parse_slurm_topology

    rails = [["PIX" if k == i else "SYS" for k in range(5)] for i in range(4)]
    text = smi_text(4, lambda i, j: "NV12", rails)
    ports = {f"mlx5_{k}": ("Active", 400, "Ethernet") for k in range(4)}
    ports["mlx5_4"] = ("Active", 100, "InfiniBand")
    nodes = [node_from(text, name, ibstat_text(ports)) for name in ("a", "b")]
    plan = plan_ring(nodes)
    assert {e.nic for e in plan.ring} == {"mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"}
    assert plan.bottleneck.gbps == 200.0
    pair = smi_text(2, lambda i, j: "NV18", [["PIX", "SYS"], ["SYS", "PIX"]])
    ib = node_from(pair, "g1", ibstat_text({"mlx5_0": ("Active", 400, "InfiniBand")}))
    roce = node_from(pair, "g2", ibstat_text({"mlx5_1": ("Active", 400, "Ethernet")}))
    block = parse_slurm_topology("BlockName=nvl1 Nodes=g[1-2]\n", "topo")
    assert {h.link for h in plan_ring([ib, roce], block, nvlink_blocks=True).hops} == {
        "MNNVL",
        "NV18",
    }
    unknown = {"mlx5_0": ("Active", 200, "InfiniBand"), "mlx5_1": ("Active", 200, "Unknown")}
    ib_too = node_from(pair, "c", ibstat_text(unknown))
    assert all(n["usable"] for n in plan_ring([ib_too, replace(ib_too, name="d")]).nodes[0]["nics"])


def test_a_node_without_gpus_is_not_planned_into_a_gpu_ring():
    """A node whose probe lost nvidia-smi (a timeout) was planned as CPU ranks with SHM hops
    inside a GPU ring, no CUDA_VISIBLE_DEVICES, exit 0."""
    gpu = node_from(smi_text(2, lambda i, j: "NV12"), "gpu01")
    lost = build_node("gpu05", None, None)
    with pytest.raises(UserError, match="node gpu05 has no GPU in its topology while node gpu01"):
        plan_ring([gpu, lost])


def test_each_gpu_gets_its_nearest_usable_nic_ties_to_the_faster_port():
    nics = [["PIX", "PIX", "PXB"], ["PXB", "SYS", "PIX"]]
    text = smi_text(2, lambda i, j: "NV4", nics)
    ib = ibstat_text(
        {
            "mlx5_0": ("Active", 100, "InfiniBand"),
            "mlx5_1": ("Active", 200, "InfiniBand"),
            "mlx5_2": ("Down", 400, "InfiniBand"),
        }
    )
    plan = plan_ring([node_from(text, "a", ib)])
    nic_of = {e.gpu: e.nic for e in plan.ring}
    assert nic_of == {0: "mlx5_1", 1: "mlx5_0"}  # GPU1's PIX NIC is down: PXB next
    assert plan.entry_for("a", 0).env["NCCL_IB_HCA"] == f"={nic_of[plan.ring[0].gpu]}:1"


def test_four_leonardo_nodes_under_two_leaves():
    topo = parse_slurm_topology(
        "SwitchName=leaf1 Nodes=n[1,3]\nSwitchName=leaf2 Nodes=n[2,4]\n"
        "SwitchName=spine Switches=leaf[1-2]\n"
    )
    nodes = [load_node_files(LEONARDO, name=f"n{i}") for i in range(1, 5)]
    plan = plan_ring(nodes, topo)
    assert [n["name"] for n in plan.nodes] == ["n1", "n3", "n2", "n4"]
    assert plan.switch_crossings() == 2
    assert [h.link for h in plan.hops].count("NET") == 4
    assert [n["switch_path"] for n in plan.nodes][0] == ["leaf1", "spine"]


def cpu_node(name: str):
    return build_node(name, None, None, cpu_count=4)


def test_sixteen_nodes_under_four_leaves_named_out_of_order():
    text = (
        "SwitchName=leafD Nodes=node[04,08,12,16]\n"
        "SwitchName=leafB Nodes=node[02,06,10,14]\n"
        "SwitchName=leafA Nodes=node[01,05,09,13]\n"
        "SwitchName=leafC Nodes=node[03,07,11,15]\n"
        "SwitchName=spine Switches=leafC,leafA,leafD,leafB\n"
    )
    topo = parse_slurm_topology(text)
    nodes = [cpu_node(f"node{i:02d}") for i in range(1, 17)]
    plan = plan_ring(nodes, topo)
    assert sorted(e.node for e in plan.ring) == [f"node{i:02d}" for i in range(1, 17)]
    runs = [k for k, _ in itertools.groupby(leaf_runs(plan))]
    assert runs == ["leafC", "leafA", "leafD", "leafB"]  # each leaf one run, spine's order
    assert plan.switch_crossings() == 4
    assert plan_ring(nodes).switch_crossings() == 0  # no layout given: nothing known to cross
    naive = plan_ring(nodes, topo)
    assert all(h.link == "NET" for h in naive.hops) and len(naive.hops) == 16


def test_two_level_tree_keeps_spines_together():
    text = "\n".join(
        [f"SwitchName=l{i} Nodes=c[{2 * i}-{2 * i + 1}]" for i in range(4)]
        + ["SwitchName=s0 Switches=l[0,2]", "SwitchName=s1 Switches=l[1,3]"]
        + ["SwitchName=top Switches=s[1,0]"]
    )
    topo = parse_slurm_topology(text)
    plan = plan_ring([cpu_node(f"c{i}") for i in range(8)], topo)
    assert [e.node for e in plan.ring] == ["c2", "c3", "c6", "c7", "c0", "c1", "c4", "c5"]
    spines = [n["switch_path"][1] for n in plan.nodes]
    assert [k for k, _ in itertools.groupby(spines)] == ["s1", "s0"]


def test_cpu_only_nodes_ranks_per_node_and_unknown_nodes_last():
    topo = parse_slurm_topology("SwitchName=leaf1 Nodes=n[3-4]\nSwitchName=leaf2 Nodes=n[1-2]\n")
    nodes = [cpu_node(n) for n in ("n1", "n2", "n3", "n4", "x9")]
    plan = plan_ring(nodes, topo, ranks_per_node=2)
    assert [(e.node, e.local_rank) for e in plan.ring][:4] == [
        ("n3", 0),
        ("n3", 1),
        ("n4", 0),
        ("n4", 1),
    ]
    assert plan.ring[-1].node == "x9" and plan.nodes[-1]["switch"] is None
    assert all(e.gpu is None and e.env == {} for e in plan.ring)
    assert {h.link for h in plan.hops} == {"SHM", "NET"}
    assert plan.entry_for("n1", 1).rank == 5  # after n3 and n4, two ranks each
    one = plan_ring(nodes[:2])
    assert [e.node for e in one.ring] == ["n1", "n2"] and len(one.hops) == 2


def test_duplicate_node_names_are_refused():
    with pytest.raises(UserError, match="node n1 is given twice"):
        plan_ring([cpu_node("n1"), cpu_node("n1")])


# ---- invariants ----------------------------------------------------------------------------

TOKENS = ["NV1", "NV2", "NV4", "NV12", "PIX", "PXB", "PHB", "NODE", "SYS"]


@st.composite
def layouts(draw):
    n = draw(st.integers(1, 7))
    pairs = {(i, j): draw(st.sampled_from(TOKENS)) for i in range(n) for j in range(i + 1, n)}
    m = draw(st.integers(0, 3))
    nics = [
        [draw(st.sampled_from(["PIX", "PXB", "PHB", "NODE", "SYS"])) for _ in range(m)]
        for _ in range(n)
    ]
    return n, pairs, nics if m else None


@settings(max_examples=60, deadline=None)
@given(layouts(), st.integers(1, 3), st.data())
def test_ring_visits_every_gpu_exactly_once(layout, n_nodes, data):
    n, pairs, nics = layout
    text = smi_text(n, lambda i, j: pairs[(i, j)], nics)
    nodes = [node_from(text, f"h{k}") for k in range(n_nodes)]
    ranks = data.draw(st.none() | st.integers(1, n))
    plan = plan_ring(nodes, ranks_per_node=ranks)
    per_node = n if ranks is None else ranks
    assert [e.rank for e in plan.ring] == list(range(n_nodes * per_node))
    for k in range(n_nodes):
        gpus = gpu_order(plan, f"h{k}")
        assert len(gpus) == len(set(gpus)) == per_node and set(gpus) <= set(range(n))
        assert [e.local_rank for e in plan.ring if e.node == f"h{k}"] == list(range(per_node))
    size = plan.world_size
    assert [(h.src, h.dst) for h in plan.hops] == [
        (i, (i + 1) % size) for i in range(size if size > 1 else 0)
    ]
    if plan.hops:
        assert plan.bottleneck.gbps == min(h.gbps for h in plan.hops)


@settings(max_examples=40, deadline=None)
@given(layouts())
def test_single_node_ring_is_optimal(layout):
    n, pairs, _ = layout
    w = [
        [
            0.0 if i == j else link_gbps(pairs[(min(i, j), max(i, j))], DEFAULT_BANDWIDTHS)
            for j in range(n)
        ]
        for i in range(n)
    ]
    order = best_order(w, cycle=True)
    assert sorted(order) == list(range(n))
    best = max(order_key(p, w, cycle=True) for p in itertools.permutations(range(n)))
    assert order_key(order, w, cycle=True) == best


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 6), st.data())
def test_best_order_matches_brute_force_for_paths_and_partial_rings(n, data):
    levels = [80.0, 150.0, 200.0, 400.0, 2400.0]
    w = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            w[i][j] = w[j][i] = data.draw(st.sampled_from(levels))
    k = data.draw(st.integers(1, n))
    cycle = data.draw(st.booleans())
    ends = None if cycle else data.draw(st.none() | st.just(True))
    start_w = [data.draw(st.sampled_from(levels)) for _ in range(n)] if ends else None
    end_w = [data.draw(st.sampled_from(levels)) for _ in range(n)] if ends else None
    order = best_order(w, k, cycle=cycle, start_w=start_w, end_w=end_w)
    assert len(order) == len(set(order)) == k
    best = max(order_key(p, w, cycle, start_w, end_w) for p in itertools.permutations(range(n), k))
    assert order_key(order, w, cycle, start_w, end_w) == best


def test_large_nodes_use_the_heuristic_and_still_keep_nvlink_islands():
    # 14 GPUs in two NVLink islands of 7: the best ring crosses between islands twice
    plan = plan_ring([node_from(smi_text(14, lambda i, j: "NV6" if i // 7 == j // 7 else "SYS"))])
    assert [h.link for h in plan.hops].count("SYS") == 2
    plan = plan_ring([node_from(smi_text(16, lambda i, j: "NV12"))])  # an NVSwitch machine
    assert {h.link for h in plan.hops} == {"NV12"} and sorted(gpu_order(plan, "node")) == list(
        range(16)
    )


def test_ranks_of_a_pcie_node_keep_every_gpu_in_sight():
    """(GPU review) Each rank was pinned to its GPU (CUDA_VISIBLE_DEVICES=<index>) on every
    node: NCCL reaches a GPU the process cannot see through NVLink only (p2p.cc), so on a
    PCIe node every hop inside it went through host memory, priced as a PCIe peer copy. A
    PCIe node's ranks see every GPU and take the plan's index as their CUDA ordinal (PCI bus
    order, as nvidia-smi numbers them); an NVLink node's stay pinned."""
    from ringctl.worker import cuda_index

    pcie = plan_ring([load_node_files(PCIE, name="pcie")])
    assert {h.link for h in pcie.hops} <= {"PIX", "PXB", "PHB", "NODE", "SYS"}
    for entry in pcie.ring:
        assert "CUDA_VISIBLE_DEVICES" not in entry.env
        assert entry.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        record = {"gpu": entry.gpu, "env": dict(entry.env)}
        assert cuda_index(record, entry.local_rank, len(pcie.ring)) == entry.gpu
    dgx = plan_ring([load_node_files(DGX, name="dgx")])
    assert all(e.env["CUDA_VISIBLE_DEVICES"] == str(e.gpu) for e in dgx.ring)


def test_every_pinned_rank_takes_the_one_device_it_sees():
    """The plan pins each rank with CUDA_VISIBLE_DEVICES=<its nvidia-smi index>; the worker
    took that index as the CUDA ordinal, which under the pin is 0: every rank of the DGX
    ring but GPU 0's was refused ("placement.json gives this rank GPU 3; it sees 1")."""
    from ringctl.worker import WorkerError, cuda_index

    plan = plan_ring([load_node_files(DGX, name="dgx")])
    for entry in plan.ring:
        record = {"gpu": entry.gpu, "env": dict(entry.env)}
        assert cuda_index(record, entry.local_rank, 1) == 0  # one device visible: ordinal 0
        with pytest.raises(WorkerError, match="pins this rank to GPU .* it sees 8 devices"):
            cuda_index(record, entry.local_rank, 8)  # the pin did not take
    assert cuda_index({"gpu": 3, "env": {}}, 0, 8) == 3  # unpinned: an ordinal
    with pytest.raises(WorkerError, match="gives this rank GPU 9; it sees 8"):
        cuda_index({"gpu": 9}, 0, 8)
    assert cuda_index({}, 5, 4) == 1  # no plan: the local rank picks
