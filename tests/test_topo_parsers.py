"""Every topology fixture parsed and checked against the facts its SOURCES.md lists, and the
malformed inputs that must be refused with the file and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringctl.errors import UserError
from ringctl.topology.hostlist import expand
from ringctl.topology.ibstat import parse_hca_text, parse_ibstat, parse_ibv_devinfo
from ringctl.topology.nodes import build_node
from ringctl.topology.nvidia_smi import parse_nvidia_smi
from ringctl.topology.slurm import parse_slurm_topology
from tests.topo_fixtures import CONSUMER, CUBE, DGX, FIX, H100, LEONARDO, OLD, PCIE


def smi(path: Path):
    return parse_nvidia_smi(path.read_text(), str(path))


def off_diagonal(matrix):
    return {matrix[i][j] for i in range(len(matrix)) for j in range(len(matrix)) if i != j}


# ---- nvidia-smi topo -m -------------------------------------------------------------------


def test_dgx_a100_all_nv12_ten_nics_from_legend():
    t = smi(DGX)
    assert [g.index for g in t.gpus] == list(range(8))
    assert off_diagonal(t.gpu_links) == {"NV12"}
    assert t.nic_labels == [f"NIC{i}" for i in range(10)]
    assert t.nic_names == [f"mlx5_{i}" for i in range(10)]
    for g in range(8):
        pxb = [t.nic_names[k] for k, tok in enumerate(t.gpu_nic_links[g]) if tok == "PXB"]
        pair = g // 2 * 2
        assert pxb == [f"mlx5_{pair}", f"mlx5_{pair + 1}"]
        assert t.gpu_nic_links[g][8] == t.gpu_nic_links[g][9] == "SYS"
    assert [g.numa for g in t.gpus] == [3, 3, 1, 1, 7, 7, 5, 5]
    assert t.gpus[0].cpu_affinity == "48-63,176-191"
    assert t.nic_links[8][9] == "PIX"  # NIC rows ending in empty tab cells still parse


def test_h100_prompt_line_no_nics_two_numa_nodes():
    t = smi(H100)
    assert len(t.gpus) == 8 and off_diagonal(t.gpu_links) == {"NV18"}
    assert t.nic_names == [] and t.gpu_nic_links == [[] for _ in range(8)]
    assert [g.numa for g in t.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_leonardo_single_core_cpu_affinity_and_numa_range():
    t = smi(LEONARDO)
    assert off_diagonal(t.gpu_links) == {"NV4"}
    assert t.nic_names == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    for g in range(4):
        assert [tok == "PXB" for tok in t.gpu_nic_links[g]] == [k == g for k in range(4)]
        assert {tok for k, tok in enumerate(t.gpu_nic_links[g]) if k != g} == {"SYS"}
        assert t.gpus[g].cpu_affinity == "0"
        assert t.gpus[g].numa_affinity == "0-1"
        assert t.gpus[g].numa is None  # a range is not one node to bind to


def test_pcie_pairs_pxb_pix_and_sys_across():
    t = smi(PCIE)
    links = t.gpu_links
    assert links[0][1] == "PXB" and links[2][3] == "PIX"
    assert {links[a][b] for a in (0, 1) for b in (2, 3)} == {"SYS"}
    assert off_diagonal(links) == {"PXB", "PIX", "SYS"}
    assert [g.numa for g in t.gpus] == [0, 0, 1, 1]


def test_consumer_phb_and_numa_na():
    t = smi(CONSUMER)
    assert t.gpu_links == [["X", "PHB"], ["PHB", "X"]]
    assert [g.numa_affinity for g in t.gpus] == ["N/A", "N/A"]
    assert [g.numa for g in t.gpus] == [None, None]
    assert t.gpus[1].cpu_affinity == "0-11"


def test_gpu_numa_id_column_and_hybrid_cube_mesh():
    t = smi(CUBE)
    assert [g.gpu_numa_id for g in t.gpus] == ["N/A"] * 8
    assert [g.numa for g in t.gpus] == [0] * 4 + [1] * 4
    assert t.gpu_links[3][4] == "SYS" and t.gpu_links[0][3] == "NV2"
    assert all(sum(tok.startswith("NV") for tok in row) == 4 for row in t.gpu_links)


def test_old_driver_device_named_nic_columns_and_soc():
    t = smi(OLD)
    assert t.nic_names == t.nic_labels == ["mlx5_0", "mlx5_1", "mlx5_2"]
    assert t.gpu_links[0][2] == "SYS"  # SOC is the old name of SYS
    assert t.gpu_nic_links[0] == ["PIX", "SYS", "PHB"]
    assert t.gpus[0].numa_affinity is None and t.gpus[2].cpu_affinity == "16-31"


def test_spaces_and_tabs_give_the_same_matrix():
    tabs = PCIE.read_text()
    spaces = tabs.expandtabs(8)
    assert "\t" not in spaces
    a, b = parse_nvidia_smi(tabs), parse_nvidia_smi(spaces)
    assert a.gpu_links == b.gpu_links and [g.cpu_affinity for g in b.gpus] == [
        g.cpu_affinity for g in a.gpus
    ]


def test_unknown_extra_info_column_is_tolerated():
    lines = CONSUMER.read_text().splitlines()
    lines[0] += "    Power Domain"
    lines[1] += "    A"
    lines[2] += "    B"
    t = parse_nvidia_smi("\n".join(lines))
    assert t.gpu_links == [["X", "PHB"], ["PHB", "X"]]
    assert "Power" in t.extra_columns


def _error(text: str, name: str = "topo.txt") -> str:
    with pytest.raises(UserError) as info:
        parse_nvidia_smi(text, name)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_row_is_refused_with_line():
    lines = PCIE.read_text().splitlines()
    message = _error("\n".join(lines[:4]))  # header + GPU0..GPU2, GPU3 missing
    assert message.startswith("topo.txt:5: expected a row for GPU3")


def test_unknown_link_token_names_line_and_column():
    text = LEONARDO.read_text().replace("GPU2    NV4     NV4 ", "GPU2    NV4     NVL ", 1)
    message = _error(text)
    assert message.startswith("topo.txt:4: unknown link token 'NVL' in row GPU2, column GPU1")


@pytest.mark.parametrize("count", ["99999999999999999999", "65", "0", "٣"])
def test_an_impossible_nvlink_count_names_the_cell(count):
    """NV<n> is a link count: NV99999999999999999999 would be read as 2e22 Gbit/s and decide
    the placement; NV0 is no link, and a non-ASCII digit is no nvidia-smi output."""
    text = LEONARDO.read_text().replace("GPU2    NV4     NV4 ", f"GPU2    NV4     NV{count} ", 1)
    message = _error(text)
    assert message.startswith("topo.txt:4: ")
    assert "row GPU2, column GPU1" in message and f"NV{count}" in message
    if count.isascii():
        assert "(NV1..NV64)" in message
    ok = LEONARDO.read_text().replace("GPU2    NV4     NV4 ", "GPU2    NV4     NV64 ", 1)
    ok = ok.replace("GPU1    NV4      X      NV4 ", "GPU1    NV4      X      NV64 ", 1)
    assert parse_nvidia_smi(ok).gpu_links[2][1] == "NV64"  # the stated maximum is accepted


def test_a_matrix_that_is_not_symmetric_is_refused():
    """A link reads the same both ways; a row edited or pasted from another machine was read
    from the upper triangle alone and planned, exit 0."""
    text = LEONARDO.read_text().replace("GPU2    NV4     NV4 ", "GPU2    NV4     NV2 ", 1)
    assert _error(text) == (  # at the edited row's line, not the header's
        "topo.txt:4: GPU2 to GPU1 reads 'NV2' but GPU1 to GPU2 (line 3) reads 'NV4': the "
        "matrix is not symmetric"
    )
    nic = LEONARDO.read_text().replace("NIC1    SYS     PXB ", "NIC1    SYS     SYS ", 1)
    assert "NIC1 to GPU1 reads 'SYS' but GPU1 to NIC1 (line 3) reads 'PXB'" in _error(nic)


def test_non_square_matrix_is_refused():
    lines = CONSUMER.read_text().splitlines()
    lines[0] = "        GPU0    GPU1    GPU2    CPU Affinity    NUMA Affinity"
    message = _error("\n".join(lines))
    assert message.startswith("topo.txt:2: unknown link token '0-11' in row GPU0, column GPU2")
    more_rows = "\tGPU0\tGPU1\tGPU2\nGPU0\t X \tPXB\tSYS\nGPU1\tPXB\t X \tSYS\n"
    more_rows += "GPU2\tSYS\tSYS\t X \nGPU3\tSYS\tSYS\tPIX\n"
    message = _error(more_rows)  # 3 columns, 4 rows
    assert message.startswith("topo.txt:5: expected a row starting with one of GPU0..GPU2")


def test_columns_cut_by_a_narrow_terminal_are_refused():
    cut = "\n".join(line[:60] for line in H100.read_text().splitlines())
    message = _error(cut)
    assert message.startswith("topo.txt:10: expected a row starting with one of GPU0..GPU6")


def test_row_wrapped_onto_two_lines_is_refused():
    lines = LEONARDO.read_text().splitlines()
    head, tail = lines[1][:24], lines[1][24:]
    wrapped = [lines[0], head, tail, *lines[2:]]
    message = _error("\n".join(wrapped))
    assert message.startswith("topo.txt:2: expected 8 link cells in row GPU0")


def test_row_longer_than_header_is_refused():
    lines = LEONARDO.read_text().splitlines()
    lines[0] = lines[0].replace("NIC3    ", "")  # header lost a column
    message = _error("\n".join(lines))
    assert message.startswith("topo.txt:2: expected a CPU Affinity")


def test_no_header_is_refused():
    assert _error("nvidia-smi: command not found\n").startswith("topo.txt:1: expected a matrix")


# ---- ibstat / ibv_devinfo -------------------------------------------------------------------


def test_ibstat_connectx3_fdr():
    path = FIX / "ibstat" / "ibstat-connectx3-mlx4_0-single-port-active-fdr.txt"
    (hca,) = parse_ibstat(path.read_text(), str(path))
    assert hca.name == "mlx4_0" and len(hca.ports) == 1
    port = hca.ports[0]
    assert (port.number, port.state, port.phys_state) == (1, "Active", "LinkUp")
    assert port.rate_gbps == 56.0 and port.link_layer == "InfiniBand" and port.usable


def test_ibv_devinfo_roce_by_link_layer_not_transport():
    path = FIX / "ibstat" / "ibv_devinfo-cx7-roce-single-port-mlx5_0.txt"
    text = path.read_text()
    assert "transport:\t\t\tInfiniBand" in text
    (hca,) = parse_hca_text(text, str(path))
    assert hca.name == "mlx5_0"
    port = hca.ports[0]
    assert port.state == "PORT_ACTIVE" and port.usable
    assert port.link_layer == "Ethernet" and port.rate_gbps is None


def test_ibv_devinfo_verbose_rate_and_down_port():
    path = FIX / "synthetic" / "ibv_devinfo-v-two-hcas-hdr-and-down.txt"
    a, b = parse_ibv_devinfo(path.read_text(), str(path))
    assert a.ports[0].rate_gbps == 200.0 and a.ports[0].usable
    assert b.ports[0].state == "PORT_DOWN" and not b.ports[0].usable and b.best_port() is None


def test_ibstat_down_initializing_and_two_port_roce():
    path = FIX / "synthetic" / "ibstat-two-ib-down-one-roce-up.txt"
    hcas = parse_hca_text(path.read_text(), str(path))
    assert [h.name for h in hcas] == ["mlx5_0", "mlx5_1", "mlx5_2"]
    assert [h.best_port() is None for h in hcas] == [True, True, False]
    best = hcas[2].best_port()
    assert (best.number, best.rate_gbps, best.link_layer) == (1, 100.0, "Ethernet")


def test_ibstat_garbage_before_ca_is_refused():
    with pytest.raises(UserError, match=r"^ib.txt:1: expected a line CA 'NAME'"):
        parse_ibstat("Port 1:\n\tState: Active\n", "ib.txt")


def test_nic_usability_joins_matrix_and_ibstat():
    t = smi(OLD)
    ib = FIX / "synthetic" / "ibstat-two-ib-down-one-roce-up.txt"
    node = build_node("n", t, parse_hca_text(ib.read_text()))
    usable = {n.name: (n.usable, n.why_unusable) for n in node.nics}
    assert usable == {
        "mlx5_0": (False, "no port is active"),
        "mlx5_1": (False, "no port is active"),
        "mlx5_2": (True, None),
    }
    roce = node.nics[2]
    assert (roce.link_layer, roce.rate_gbps, roce.port) == ("Ethernet", 100.0, 1)


def test_matrix_nic_missing_from_ibstat_is_unusable():
    node = build_node("n", smi(LEONARDO), parse_hca_text("CA 'mlx5_0'\n\tPort 1:\n\tState: Active"))
    assert [n.usable for n in node.nics] == [True, False, False, False]
    assert node.nics[1].why_unusable == "not listed by ibstat/ibv_devinfo"


# ---- Slurm topology and hostlists ----------------------------------------------------------


def test_topology_conf_tree_block_ring_forms():
    path = FIX / "slurm" / "topology-conf-slurm-manpage-examples-tree-block-ring.conf"
    t = parse_slurm_topology(path.read_text(), str(path))
    assert t.groups["s0"].nodes == [f"dev{i}" for i in range(6)]
    assert t.groups["s1"].nodes == [f"dev{i}" for i in range(6, 12)]
    assert t.groups["s2"].nodes == [f"dev{i}" for i in range(12, 18)]
    assert t.groups["s3"].children == ["s0", "s1", "s2"] and t.groups["s3"].nodes == []
    blocks = t.by_kind("block")
    assert [b.name for b in blocks] == ["block1", "block2", "block3", "block4"]
    assert blocks[3].nodes[0] == "node97" and len(blocks[3].nodes) == 32
    assert t.block_sizes == [30, 120]
    rings = t.by_kind("ring")
    assert rings[0].nodes == [f"node{i:02d}" for i in range(1, 9)]
    assert rings[1].nodes == [f"node{i:02d}" for i in range(9, 17)]
    assert t.leaf_of("dev7") == "s1" and t.leaf_of("node05") == "ring0"
    assert t.leaf_of("node5") == "block1" and t.leaf_of("elsewhere") is None
    order = t.node_order()
    assert order[:18] == [f"dev{i}" for i in range(18)]


SCONTROL = """\
SwitchName=leaf2 Level=0 LinkSpeed=1 Nodes=n[3-4]
SwitchName=leaf1 Level=0 LinkSpeed=1 Nodes=n[1-2]
SwitchName=spine Level=1 LinkSpeed=1 Nodes=n[1-4] Switches=leaf[1-2]
"""


def test_lines_continued_with_a_backslash_are_joined_as_slurm_joins_them():
    """Slurm's config reader joins a line ending in an odd number of backslashes to the next
    (the backslash dropped, nothing in its place; comments cut first): a long Nodes= list is
    often written so, and was refused."""
    text = (
        "SwitchName=s0 \\\n"
        "   Nodes=n[1-\\  \n"
        "4] # a comment \\\n"
        "SwitchName=s1 Nodes=m1\n"
        "SwitchName=top Switches=s[0-1] \\\n"
    )
    t = parse_slurm_topology(text, "topo.conf")
    assert {name: g.nodes or g.children for name, g in t.groups.items()} == {
        "s0": ["n1", "n2", "n3", "n4"],
        "s1": ["m1"],
        "top": ["s0", "s1"],
    }
    with pytest.raises(UserError, match="topo.conf:2: s2 has neither Nodes= nor Switches="):
        parse_slurm_topology("SwitchName=s0 Nodes=a\nSwitchName=s2 \\\n\n", "topo.conf")


def test_topology_name_prefix_is_tolerated():
    t = parse_slurm_topology("TopologyName=default SwitchName=s0 Nodes=a[1-2]\nTopologyName=x\n")
    assert t.groups["s0"].nodes == ["a1", "a2"] and list(t.groups) == ["s0"]


def test_scontrol_show_topology_of_blocks_with_their_aggregated_levels():
    """Slurm 24.11+ prints an AggregatedBlock= line for every block level above the base
    (topology_block.c's _print_topo_record; by default once there are two blocks): refused,
    the batch script's placement failed and no rank of the job ever started."""
    text = (
        "BlockName=b1 BlockIndex=0 Nodes=gpu[01-02] BlockSize=2\n"
        "BlockName=b2 BlockIndex=1 Nodes=gpu[03-04] BlockSize=2\n"
        "AggregatedBlock=b[1-2] BlockIndex=0 Nodes=gpu[01-04] BlockSize=4\n"
    )
    t = parse_slurm_topology(text, "scontrol")
    assert list(t.groups) == ["b1", "b2"]
    named = "".join(f"TopologyName=default {line}\n" for line in text.splitlines())
    assert list(parse_slurm_topology(named + "TopologyName=default BlockSizes=2,4\n").groups) == [
        "b1",
        "b2",
    ]
    assert [t.leaf_of(n) for n in ("gpu01", "gpu02", "gpu03", "gpu04")] == ["b1", "b1", "b2", "b2"]
    assert t.node_order() == ["gpu01", "gpu02", "gpu03", "gpu04"]


def test_scontrol_show_topology_upper_switch_lists_all_nodes():
    t = parse_slurm_topology(SCONTROL, "scontrol")
    assert [t.leaf_of(n) for n in ("n1", "n2", "n3", "n4")] == ["leaf1", "leaf1", "leaf2", "leaf2"]
    # depth-first from the spine, children in its listing order (leaf1 then leaf2)
    assert t.node_order() == ["n1", "n2", "n3", "n4"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("SwitchName=s0 Nodes=n[1-", "topo.conf:1: '[' not closed"),
        ("Switch s0 Nodes=n1", "topo.conf:1: expected Key=value words"),
        ("Frobnicate=s0 Nodes=n1", "topo.conf:1: expected a line starting with SwitchName="),
        ("SwitchName=s0", "topo.conf:1: s0 has neither Nodes= nor Switches="),
        ("\nSwitchName=s0 Switches=s9", "topo.conf:2: switch s0 names an undefined switch s9"),
        # written raw into the SVG (no longer XML) and the plan's table (a terminal escape)
        ("SwitchName=le\x01af Nodes=n1", "topo.conf:1: switch name 'le\\x01af' holds a control"),
        ("BlockName=b\x1b[31m Nodes=n1", "topo.conf:1: block name 'b\\x1b[31m' holds a control"),
    ],
)
def test_bad_topology_lines_are_refused(text, expected):
    with pytest.raises(UserError) as info:
        parse_slurm_topology(text, "topo.conf")
    assert str(info.value).startswith(expected)


def _hostlist_rows():
    path = FIX / "slurm" / "hostlist-examples.tsv"
    rows = [line.split("\t") for line in path.read_text().splitlines()]
    return [r for r in rows if r and not r[0].startswith("#") and r[0] != "expression"]


@pytest.mark.parametrize("row", _hostlist_rows(), ids=lambda r: r[0][:40])
def test_hostlist_fixture_expansions(row):
    expression, count, expansion = row[0], int(row[1]), row[2].split(",")
    names = expand(expression)
    assert len(names) == count
    assert names == expansion
