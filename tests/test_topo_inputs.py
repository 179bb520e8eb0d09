"""What the topology readers make of inputs that real tools print and of hostile ones: NIC names
without nvidia-smi's legend, ibv_devinfo's unknown codes, Slurm's quoting, non-ASCII digits,
deep switch trees, oversized files and words. Each test names the defect it pins down."""

from __future__ import annotations

import io
import sys

import pytest

from ringctl.cli import main
from ringctl.errors import UserError
from ringctl.text import ECHO_CHARS
from ringctl.topology import plan_ring
from ringctl.topology import slurm as slurm_module
from ringctl.topology.hostlist import HostlistError, expand
from ringctl.topology.ibstat import parse_ibstat, parse_ibv_devinfo
from ringctl.topology.nodes import build_node, natural_key
from ringctl.topology.nvidia_smi import parse_nvidia_smi
from ringctl.topology.slurm import parse_slurm_topology
from tests.topo_fixtures import H100


def matrix(n_gpu: int, n_nic: int = 0, legend: bool = False, pix=lambda g, k: g == k) -> str:
    """`nvidia-smi topo -m` text: n_gpu GPUs all NV18, NICk PIX to the GPUs pix(g, k) picks
    (SYS to the others); with `legend`, the `NIC Legend:` naming NICk mlx5_k."""
    devs = [f"GPU{i}" for i in range(n_gpu)] + [f"NIC{k}" for k in range(n_nic)]
    rows = ["\t" + "\t".join(devs) + "\tCPU Affinity\tNUMA Affinity"]
    for g in range(n_gpu):
        cells = ["X" if g == j else "NV18" for j in range(n_gpu)]
        cells += ["PIX" if pix(g, k) else "SYS" for k in range(n_nic)]
        rows.append(f"GPU{g}\t" + "\t".join(cells) + "\t0-15\t0")
    for k in range(n_nic):
        cells = ["PIX" if pix(g, k) else "SYS" for g in range(n_gpu)]
        cells += ["X" if k == q else "SYS" for q in range(n_nic)]
        rows.append(f"NIC{k}\t" + "\t".join(cells) + "\t\t")
    if legend:
        rows += ["", "NIC Legend:", ""] + [f"  NIC{k}: mlx5_{k}" for k in range(n_nic)]
    return "\n".join(rows) + "\n"


def ibstat(names: list[str]) -> str:
    return "".join(
        f"CA '{n}'\n\tPort 1:\n\t\tState: Active\n\t\tPhysical state: LinkUp\n"
        f"\t\tRate: 400\n\t\tLink layer: InfiniBand\n"
        for n in names
    )


# ---- f12, f7: NIC names when nvidia-smi's legend is missing --------------------------------


def test_nic_columns_without_legend_or_ibstat_are_not_pinned_in_nccl_ib_hca():
    """f12: without `NIC Legend:` and without ibstat a NIC is known only by its column label
    (NIC0). Pinning NCCL_IB_HCA='=NIC0' named no device: NCCL found no IB HCA and silently
    used sockets. Such a rank's env now lacks NCCL_IB_HCA, and the plan says why."""
    text = matrix(8, 2, pix=lambda g, k: g == 6)  # both NICs next to GPU6, as in go-gpuallocator#17
    nodes = [build_node(n, parse_nvidia_smi(text)) for n in ("a", "b")]
    plan = plan_ring(nodes)
    assert all("NCCL_IB_HCA" not in e.env for e in plan.ring)
    assert [nic.name_known for nic in nodes[0].nics] == [False, False]
    assert all(e.env["CUDA_VISIBLE_DEVICES"] == str(e.gpu) for e in plan.ring)
    (note,) = [a for a in plan.assumptions if "NCCL_IB_HCA is not pinned" in a]
    assert (
        "no NIC Legend, no ibstat listing as many HCAs" in note
        and "(4 NIC(s), first a:NIC0)" in note
    )
    # the same matrix with its legend pins the real device, exactly
    named = [build_node(n, parse_nvidia_smi(matrix(8, 2, True, lambda g, k: g == 6))) for n in "ab"]
    hcas = {e.env.get("NCCL_IB_HCA") for e in plan_ring(named).ring}
    assert hcas == {"=mlx5_0", "=mlx5_1"}
    assert not any("not pinned" in a for a in plan_ring(named).assumptions)


def test_nic_columns_without_legend_match_ibstat_in_natural_order():
    """f7: without the legend, NIC columns were matched to ibstat's HCAs by position, but
    ibstat lists them alphabetically (mlx5_0, mlx5_1, mlx5_10, mlx5_11, mlx5_2, ...): GPU2 was
    pinned to mlx5_10, behind another PCIe switch. The kernel numbers mlx5 devices in probe
    order, close to PCI order (nvidia-smi's column order), so the match is in natural order,
    and the plan records that it is a match by order."""
    names = sorted(f"mlx5_{k}" for k in range(12))  # ibstat's order
    assert names[2] == "mlx5_10"
    node = build_node("n1", parse_nvidia_smi(matrix(8, 12)), parse_ibstat(ibstat(names)))
    assert [nic.name for nic in node.nics] == [f"mlx5_{k}" for k in range(12)]
    assert {nic.name_from for nic in node.nics} == {"ibstat order"}
    plan = plan_ring([node])
    assert {e.gpu: e.env["NCCL_IB_HCA"] for e in plan.ring} == {g: f"=mlx5_{g}:1" for g in range(8)}
    (note,) = [a for a in plan.assumptions if "by order" in a]
    assert "mlx5_2 before mlx5_10" in note and "(12 NIC(s), first n1:NIC0)" in note
    assert sorted(["mlx5_10", "mlx5_2", "bnxt_re1", "mlx5_1"], key=natural_key) == [
        "bnxt_re1",
        "mlx5_1",
        "mlx5_2",
        "mlx5_10",
    ]


def test_hcas_ibstat_lists_beside_unmatched_nic_columns_are_not_pinned():
    """Without the legend, two NIC columns beside an ibstat listing three HCAs cannot be
    matched: the HCAs, each one of the columns but which unknown, were planned as SYS and
    pinned by index (GPU0 on mlx5_0, wherever it is) while the plan said NCCL_IB_HCA was not
    pinned. They are not pinned now (NCCL, reading the PCI tree, chooses), and said so."""
    hcas = parse_ibstat(ibstat(["mlx5_0", "mlx5_1", "mlx5_2"]))
    nodes = [build_node(n, parse_nvidia_smi(matrix(2, 2)), hcas) for n in ("a", "b")]
    plan = plan_ring(nodes)
    assert {e.nic for e in plan.ring} <= {"mlx5_0", "mlx5_1", "mlx5_2"}
    assert all("NCCL_IB_HCA" not in e.env for e in plan.ring)
    (note,) = [a for a in plan.assumptions if a.startswith("HCAs ibstat lists")]
    assert "NCCL_IB_HCA is not pinned" in note and "(6 NIC(s), first a:mlx5_0)" in note
    # with no NIC column at all an ibstat HCA is still pinned (nothing to match it to)
    bare = [build_node(n, parse_nvidia_smi(matrix(2)), hcas) for n in ("a", "b")]
    assert all(e.env["NCCL_IB_HCA"].startswith("=mlx5_") for e in plan_ring(bare).ring)


def test_an_ibstat_rate_of_zero_is_planned_and_labelled_as_assumed():
    """ibstat prints Rate: 0 for a port whose rate it cannot read: the plan took the
    assumed NET rate but labelled the hop's rate as ibstat's, with no note to give it."""
    zero = ibstat(["mlx5_0"]).replace("Rate: 400", "Rate: 0")
    for cpu in (False, True):
        nodes = [
            build_node(n, None if cpu else parse_nvidia_smi(matrix(1, 1, True)), parse_ibstat(zero))
            for n in ("a", "b")
        ]
        plan = plan_ring(nodes)
        net = [h for h in plan.hops if h.link == "NET"]
        assert net and {h.rate_source for h in net} == {"assumed"}, cpu
        assert any(a.startswith("network port rate assumed") for a in plan.assumptions)


# ---- f2: NIC names must be device names ---------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            matrix(2, 1) + "\nNIC Legend:\n\n  NIC0: mlx5_0;x\n",
            "t.txt:8: NIC Legend name 'mlx5_0;x' of NIC0 is not a device name",
        ),
        (
            matrix(2, 1) + "\nNIC Legend:\n\n  NIC0: mlx5_0,mlx5_1\n",
            "t.txt:8: NIC Legend name 'mlx5_0,mlx5_1' of NIC0 is not a device name",
        ),
        (
            matrix(2, 1).replace("NIC0", "mlx5:0"),
            "t.txt:1: device column 'mlx5:0' is neither GPU<n> (up to 4 digits) nor a NIC name",
        ),
    ],
)
def test_nic_names_that_are_no_device_names_are_refused(text, expected):
    """f2: a legend name reached NCCL_IB_HCA unchecked ('=mlx5_0;x', or a ',' that selects
    a second device); load_plan refused the written plan later, in every worker."""
    with pytest.raises(UserError) as err:
        parse_nvidia_smi(text, "t.txt")
    assert str(err.value).startswith(expected)


def test_hca_names_that_are_no_device_names_are_refused():
    """f2, same for ibstat's and ibv_devinfo's names, which the plan pins too."""
    with pytest.raises(UserError, match=r"^ib.txt:1: HCA name 'mlx5_0:1' is not a device"):
        parse_ibstat(ibstat(["mlx5_0:1"]), "ib.txt")
    with pytest.raises(UserError, match=r"^dev.txt:1: HCA name 'a=b' is not a device"):
        parse_ibv_devinfo("hca_id:\ta=b\n", "dev.txt")


# ---- f9: ibv_devinfo -v on a port whose speed it does not know -----------------------------

DEVINFO = """hca_id:\tmlx5_0
\ttransport:\t\t\tInfiniBand (0)
\t\tport:\t1
\t\t\tstate:\t\t\tPORT_ACTIVE (4)
\t\t\tactive_width:\t\t4X (2)
\t\t\tactive_speed:\t\t50.0 Gbps (64)
\t\t\tphys_state:\t\tLINK_UP (5)
\t\t\tlink_layer:\t\tInfiniBand
hca_id:\tmlx5_1
\ttransport:\t\t\tInfiniBand (0)
\t\tport:\t1
\t\t\tstate:\t\t\tPORT_DOWN (1)
\t\t\tactive_width:\t\t{width}
\t\t\tactive_speed:\t\t{speed}
\t\t\tphys_state:\t\tDISABLED (3)
\t\t\tlink_layer:\t\tInfiniBand
"""


@pytest.mark.parametrize(
    ("width", "speed"),
    [("4X (2)", "invalid speed (0)"), ("invalid width (0)", "25.0 Gbps (32)")],
)
def test_ibv_devinfo_invalid_speed_or_width_leaves_that_rate_unknown(width, speed):
    """f9: rdma-core prints `invalid speed (0)` / `invalid width` for a code it does not know
    (a down port, an XDR port read by an older rdma-core): one such port refused the whole
    file, so the node could not be placed. Now only that port's rate is unknown."""
    hcas = parse_ibv_devinfo(DEVINFO.format(width=width, speed=speed), "dev.txt")
    assert [h.name for h in hcas] == ["mlx5_0", "mlx5_1"]
    assert hcas[0].ports[0].rate_gbps == 200.0
    assert hcas[1].ports[0].rate_gbps is None and not hcas[1].ports[0].usable
    with pytest.raises(UserError, match=r"^dev.txt:14: expected a number, found 'fast'"):
        parse_ibv_devinfo(DEVINFO.format(width="4X (2)", speed="fast"), "dev.txt")


# ---- f10: Slurm's quoting and blanks around '=' -------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        'SwitchName=s0 Nodes="n[1-2]"\nSwitchName=s1 Nodes="n[3-4]"\nSwitchName=top Switches=s[0-1]',
        "SwitchName = s0 Nodes = n[1-2]\nSwitchName= s1 Nodes =n[3-4]\nSwitchName=top Switches=s[0-1]",
        'SwitchName="s0" Nodes = "n[1-2]"\nSwitchName=s1 Nodes=n[3-4]\nSwitchName=top Switches="s[0-1]"',
    ],
)
def test_topology_conf_quoted_values_and_blanks_around_equals(text):
    """f10: Slurm's parser allows double-quoted values and blanks around '='. Quotes were
    kept (`"n1`, `n2"`: names no node has, so the switch order was silently ignored) and
    `Nodes = ...` was refused."""
    topo = parse_slurm_topology(text + "\n", "topology.conf")
    assert topo.groups["s0"].nodes == ["n1", "n2"] and topo.groups["s1"].nodes == ["n3", "n4"]
    assert topo.groups["top"].children == ["s0", "s1"]
    assert topo.node_order() == ["n1", "n2", "n3", "n4"]


def test_topology_conf_stray_quote_and_empty_value_are_refused():
    with pytest.raises(UserError, match=r"^t:1: expected Key=value words, found 'Nodes=\"n1'"):
        parse_slurm_topology('SwitchName=s0 Nodes="n1\n', "t")
    with pytest.raises(UserError, match=r"^t:1: s0 has neither Nodes= nor Switches="):
        parse_slurm_topology("SwitchName=s0 Nodes= Level=0\n", "t")


# ---- f3: ASCII digits only ----------------------------------------------------------------


@pytest.mark.parametrize(
    "expr",
    [
        "n[1-\u00b2]",
        "n[\u0661-\u0663]",
        "n[\u00b9]",
        "n[1-" + "9" * 5000 + "]",
        "n[" + "1" * 19 + "]",
    ],
)
def test_hostlist_numbers_are_ascii_digits_of_bounded_length(expr):
    """f3: str.isdigit() accepts '²' (int() then raised ValueError: a traceback) and '١' (int()
    read n[١-٣] as n1..n3, other names); 5,000 digits passed the int() limit."""
    with pytest.raises(HostlistError, match="ASCII digits, at most 18"):
        expand(expr)
    assert expand("n[1-3]") == ["n1", "n2", "n3"]


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("SwitchName=s1 Level=\u00b9 Nodes=n1", "t:1: expected Level=<number> (ASCII digits"),
        ("SwitchName=s1 Nodes=n[1-\u00b2]", "t:1: expected a number (ASCII digits"),
        ("BlockSizes=4,\u0668", "t:1: expected BlockSizes=N,N,... (ASCII digits"),
        ("SwitchName=s1 Level=" + "9" * 5000 + " Nodes=n1", "t:1: expected Level=<number>"),
    ],
)
def test_topology_numbers_are_ascii_digits(line, expected):
    with pytest.raises(UserError) as err:
        parse_slurm_topology(line + "\n", "t")
    assert str(err.value).startswith(expected) and len(str(err.value)) < 300


@pytest.mark.parametrize("value", ["\u00b2", "\u0664", "9" * 5000])
def test_ulysses_degree_is_ascii_digits(value, capsys):
    """f3: `--ulysses ²` ended in a ValueError traceback (exit 1)."""
    code = main(["topo", "--nvidia-smi", str(H100), "--ulysses", value])
    err = capsys.readouterr().err
    assert code == 2 and "expected auto or a positive integer" in err
    assert "Traceback" not in err and len(err.splitlines()) == 1 and len(err) < 300


# ---- f4: a deep switch chain ---------------------------------------------------------------


def test_a_switch_chain_deeper_than_the_recursion_limit():
    """f4: SwitchTopology.levels recursed once per level: a chain of ~400 switches raised
    RecursionError (a traceback). It is walked with a stack now."""
    depth = 3 * sys.getrecursionlimit()
    lines = [f"SwitchName=s{i} Switches=s{i - 1}" for i in range(depth - 1, 0, -1)]
    topo = parse_slurm_topology("\n".join(lines) + "\nSwitchName=s0 Nodes=node\n")
    assert topo.node_order() == ["node"]
    assert topo.levels()[f"s{depth - 1}"] == depth - 1 and topo.levels()["s0"] == 0
    assert topo.switch_path("node")[:2] == ["s0", "s1"] and len(topo.switch_path("node")) == depth


def test_switch_levels_of_a_loop_and_given_levels_are_as_before():
    """The stack walk keeps the recursion's answers: given Level= wins, an undefined or
    looping child counts 0."""
    text = "SwitchName=a Switches=b\nSwitchName=b Switches=a,c Nodes=n1\nSwitchName=c Nodes=n2\n"
    text += "SwitchName=d Level=7 Switches=c\nSwitchName=e Switches=d,c\n"
    assert parse_slurm_topology(text).levels() == {"a": 2, "b": 1, "c": 0, "d": 7, "e": 8}


# ---- f6: hosts per file, not per expression -----------------------------------------------


def test_topology_file_host_total_is_capped(monkeypatch):
    """f6: MAX_HOSTS bounded one hostlist expression: N lines of `Nodes=n[1-2000000]` held
    N x 2M names. The file's total is capped now (a small cap here, the real one 2,000,000)."""
    monkeypatch.setattr(slurm_module, "MAX_HOSTS", 1000, raising=False)
    ok = "SwitchName=s0 Nodes=n[1-600]\nSwitchName=s1 Nodes=m[1-400]\n"
    assert len(parse_slurm_topology(ok, "t").node_order()) == 1000
    with pytest.raises(UserError) as err:
        parse_slurm_topology(ok + "SwitchName=s2 Nodes=x1\n", "t")
    assert str(err.value).startswith("t:3: the file names more than 1,000 hosts in all")


# ---- f11: stdin bounded, echoed words cut --------------------------------------------------


def _stdin(monkeypatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))


def test_slurm_topology_from_stdin_is_bounded_like_a_file(monkeypatch, capsys):
    """f11: `--slurm-topology -` read stdin whole (no bound, no NUL check), unlike a file."""
    from ringctl.commands import topo as topo_command

    monkeypatch.setattr(topo_command, "MAX_TOOL_OUTPUT_BYTES", 4096, raising=False)
    args = ["topo", "--nvidia-smi", str(H100), "--slurm-topology", "-", "--json"]
    _stdin(monkeypatch, b"SwitchName=s0 Nodes=node\n" + b"#" * 5000 + b"\n")
    assert main(args) == 2
    assert capsys.readouterr().err.strip() == "ringctl topo: error: <stdin>: longer than 4096 bytes"
    _stdin(monkeypatch, b"SwitchName=s0 Nodes=node\n\0\0\0")
    assert main(args) == 2
    assert "<stdin>: a binary file (NUL byte at 25)" in capsys.readouterr().err
    _stdin(monkeypatch, b"SwitchName=s0 Nodes=node\n" + b"#" * 1000 + b"\n")
    assert main(args) == 0 and '"switch": "s0"' in capsys.readouterr().out


@pytest.mark.parametrize(
    ("text", "parse"),
    [
        ("x" * 100_000, parse_slurm_topology),
        ("SwitchName=s0 Nodes=n[" + "1," * 50_000 + "a]", parse_slurm_topology),
        ("CA 'mlx5_0'\n\tPort 1:\n" + "y" * 100_000, parse_ibstat),
        (matrix(2).replace("NV18", "Q" * 100_000, 1), parse_nvidia_smi),
    ],
)
def test_errors_quote_at_most_a_few_dozen_characters_of_a_word(text, parse):
    """f11: errors put the whole offending word or line in the message: a 50 MB word gave a
    50 MB (200 MB for NULs, repr-escaped) 'one-line' error."""
    with pytest.raises((UserError, HostlistError)) as err:
        parse(text, "f")
    message = str(err.value)
    assert "..." in message and len(message) < 2 * ECHO_CHARS + 200 and "\n" not in message


@pytest.mark.parametrize(
    ("probe", "expected"),
    [
        ("[" * 200_000 + "]" * 200_000, "expected a probe JSON (RecursionError)"),
        ('{"nvidia_smi_topo": null, "cpu_count": ' + "9" * 5000 + "}", "(ValueError)"),
        ('{"nvidia_smi_topo": null, "cpu_count": NaN}', "cpu_count must be a count"),
        ('{"nvidia_smi_topo": null, "cpu_count": [8]}', "cpu_count must be a count"),
    ],
    ids=["deep", "5000-digits", "nan", "list"],
)
def test_a_probe_no_reader_can_take_is_one_line(tmp_path, capsys, probe, expected):
    """Probes are written by the job's processes: a deep or huge-number file was a traceback
    (RecursionError, "Exceeds the limit (4300 digits)"), and a cpu_count of NaN or a list
    was copied into placement.json (NaN is no JSON)."""
    path = tmp_path / "n1.json"
    path.write_text(probe)
    assert main(["topo", "--node", f"n1={path}"]) == 2
    err = capsys.readouterr().err
    assert f"{path}" in err and expected in err and "Traceback" not in err


def test_x_off_the_diagonal_is_refused_by_cell():
    """X is the diagonal's token; elsewhere it had no bandwidth ("no bandwidth for link
    kind 'X'", a traceback at placement)."""
    text = matrix(2).replace("GPU0\tX\tNV18", "GPU0\tX\tX")
    with pytest.raises(
        UserError, match=r"X belongs on the diagonal only \(row GPU0, column GPU1\)"
    ):
        parse_nvidia_smi(text, "smi.txt")


def test_one_gpu_index_named_twice_is_refused():
    """GPU0 beside GPU00: two ranks got CUDA_VISIBLE_DEVICES=0, exit 0."""
    text = matrix(2).replace("GPU1", "GPU00")
    with pytest.raises(UserError, match="GPU0 and GPU00 are one GPU index"):
        parse_nvidia_smi(text, "smi.txt")
