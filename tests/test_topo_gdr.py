"""Where the ring leaves a node: GPUDirect RDMA reach, host bounce, NIC choice and env pins."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ringctl.errors import UserError
from ringctl.topology import build_node, load_node_files, plan_ring
from ringctl.topology.gdr import GdrPolicy, end_gbps
from ringctl.topology.ibstat import parse_ibstat
from ringctl.topology.links import DEFAULT_BANDWIDTHS
from ringctl.topology.nvidia_smi import parse_nvidia_smi
from tests.test_topo_placement import ibstat_text, smi_text
from tests.topo_fixtures import GB200, TWO_NIC, TWO_NIC_IBSTAT


def two_nic_nodes(n: int, ibstat: str | None = None):
    text = ibstat if ibstat is not None else TWO_NIC_IBSTAT.read_text()
    smi = parse_nvidia_smi(TWO_NIC.read_text())
    return [build_node(f"g{i}", smi, parse_ibstat(text)) for i in range(n)]


def gpus_of(plan, node):
    return [e for e in plan.ring if e.node == node]


def test_node_with_nics_next_to_only_some_gpus_is_entered_and_left_through_them():
    plan = plan_ring(two_nic_nodes(3))
    for node in ("g0", "g1", "g2"):
        ranks = gpus_of(plan, node)
        entry, exit_ = ranks[0], ranks[-1]
        # GPU3 is PIX to mlx5_0 and GPU6 PIX to mlx5_1; every other GPU is NODE/SYS away
        assert {entry.gpu, exit_.gpu} == {3, 6}
        assert {entry.nic, exit_.nic} == {"mlx5_0", "mlx5_1"}  # in and out on different NICs
        assert entry.env["NCCL_IB_HCA"] == f"={entry.nic}:1"
    net = [h for h in plan.hops if h.link == "NET"]
    assert len(net) == 3
    assert {(h.src_end, h.dst_end, h.gbps, h.rate_source) for h in net} == {
        ("GDR", "GDR", 100.0, "ibstat")
    }
    assert plan.bottleneck.link == "NET" and plan.bottleneck.gbps == 100.0
    env = plan.ring[0].env
    assert (env["NCCL_NET_GDR_LEVEL"], env["NCCL_NET_GDR_READ"]) == ("PXB", "1")
    assert env["NCCL_P2P_PXN_LEVEL"] == "0"  # no relay through another GPU's NIC


def test_when_only_one_gpu_is_near_a_nic_the_other_end_is_a_host_bounce():
    ib = ibstat_text({"mlx5_0": ("Active", 100, "InfiniBand"), "mlx5_1": ("Down", 100, "IB")})
    plan = plan_ring(two_nic_nodes(2, ib))
    for node in ("g0", "g1"):
        assert 3 in {gpus_of(plan, node)[0].gpu, gpus_of(plan, node)[-1].gpu}
    net = [h for h in plan.hops if h.link == "NET"]
    assert sorted(tuple(sorted((h.src_end, h.dst_end))) for h in net) == [
        ("GDR", "host bounce"),
        ("GDR", "host bounce"),
    ]
    # a bounce end gets half the 100 Gbit/s port (and no more than HOST or its PCIe path)
    assert {h.gbps for h in net} == {50.0}
    assert any("host-bounce" in a for a in plan.assumptions)


def _pcie_pair():
    """Two GPUs without NVLink (PIX to each other), both PIX to one 200 Gbit/s NIC."""
    text = smi_text(2, lambda i, j: "PIX", [["PIX"], ["PIX"]])
    ib = ibstat_text({"mlx5_0": ("Active", 200, "InfiniBand")})
    return [build_node(f"p{i}", parse_nvidia_smi(text), parse_ibstat(ib)) for i in range(2)]


def test_sends_bounce_on_platforms_without_nvlink_unless_gdr_read_is_on():
    # NCCL's documented default: GDR reads (sends) only on NVLink-based platforms
    plan = plan_ring(_pcie_pair())
    net = [h for h in plan.hops if h.link == "NET"]
    assert {(h.src_end, h.dst_end) for h in net} == {("host bounce", "GDR")}
    assert {h.gbps for h in net} == {100.0}  # 200 * 0.5 on the send side
    assert {e.env["NCCL_NET_GDR_READ"] for e in plan.ring} == {"0"}
    on = plan_ring(_pcie_pair(), gdr=GdrPolicy(read="on"))
    assert {(h.src_end, h.dst_end, h.gbps) for h in on.hops if h.link == "NET"} == {
        ("GDR", "GDR", 200.0)
    }
    assert {e.env["NCCL_NET_GDR_READ"] for e in on.ring} == {"1"}
    loc = plan_ring(_pcie_pair(), gdr=GdrPolicy("LOC", "on"))  # GDR never
    assert {(h.src_end, h.dst_end) for h in loc.hops if h.link == "NET"} == {("host bounce",) * 2}
    with pytest.raises(UserError, match="--gdr-level NEAR: expected one of"):
        GdrPolicy("NEAR")


def test_without_ibstat_the_network_rate_is_assumed_and_said_so():
    nodes = [load_node_files(TWO_NIC, None, f"a{i}") for i in range(2)]
    plan = plan_ring(nodes)
    net = [h for h in plan.hops if h.link == "NET"]
    assert {(h.gbps, h.rate_source) for h in net} == {(DEFAULT_BANDWIDTHS["NET"], "assumed")}
    assert any("assumed" in a and "--bandwidth NET" in a for a in plan.assumptions)
    given = plan_ring(nodes, bandwidths={"NET": 400})
    # a 400 Gbit/s port behind PIX: the PCIe path (200) caps the GDR end
    assert {(h.gbps, h.rate_source) for h in given.hops if h.link == "NET"} == {(200.0, "given")}
    assert not any("assumed" in a for a in given.assumptions)


def test_ranks_sending_through_one_nic_at_once_share_its_rate():
    # 3 nodes x 2 ranks in rings of 3: ring 0 = g0's two ranks + g1's first, ring 1 = g1's
    # second + g2's two. Both of g1's ranks send to another node at once, and only mlx5_0 is
    # up, so each of those sends gets half of what its ends allow.
    ib = ibstat_text({"mlx5_0": ("Active", 100, "InfiniBand"), "mlx5_1": ("Down", 100, "IB")})
    nodes = two_nic_nodes(3, ib)
    plan = plan_ring(nodes, ranks_per_node=2, ring_size=3)
    assert [g.nodes for g in plan.groups] == [["g0", "g1"], ["g1", "g2"]]
    by_pair = {(h.src, h.dst): h for h in plan.hops}
    table, policy = plan.bandwidths, GdrPolicy()
    for src, dst in [(2, 0), (3, 4)]:  # the two sends out of g1, both through mlx5_0
        hop = by_pair[(src, dst)]
        a, b = plan.ring[src], plan.ring[dst]
        assert a.node == "g1" and a.nic == "mlx5_0" and hop.shared == 2
        node_a, node_b = nodes[int(a.node[1])], nodes[int(b.node[1])]
        send = end_gbps(node_a, a.gpu, 0, True, policy, table).gbps
        recv = end_gbps(node_b, b.gpu, 0, False, policy, table).gbps
        assert hop.gbps == min(send, recv) / 2
    # g1 also receives twice at once through mlx5_0 (1->2 and 5->3); g0 and g2 once each
    shared = {pair: h.shared for pair, h in by_pair.items() if h.link == "NET"}
    assert shared == {(1, 2): 2, (2, 0): 2, (3, 4): 2, (5, 3): 2}


def test_grace_c2c_nodes_leave_the_gdr_level_to_nccl():
    # GB200 trays: every NIC SYS in nvidia-smi, GPUs with their own NUMA node (coherent C2C).
    # NCCL's default there is P2C (GDR through C2C); pinning PXB would switch that off.
    trays = [replace(load_node_files(GB200), name=f"gb{i}") for i in range(2)]
    plan = plan_ring(trays)
    assert all("NCCL_NET_GDR_LEVEL" not in e.env and "NCCL_IB_HCA" in e.env for e in plan.ring)
    assert {h.src_end for h in plan.hops if h.link == "NET"} == {"host bounce"}
    assert any("C2C" in a and "lower bound" in a for a in plan.assumptions)
    pinned = plan_ring(trays, gdr=GdrPolicy("PXB"))  # asked for explicitly: pinned
    assert {e.env["NCCL_NET_GDR_LEVEL"] for e in pinned.ring} == {"PXB"}
    assert not any("C2C" in a for a in pinned.assumptions)
