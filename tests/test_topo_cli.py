"""`ringctl topo` and `ringctl topo probe` end to end, and the plan file contract."""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from ringctl.cli import main
from ringctl.errors import UserError
from ringctl.topology import RingPlan, load_node, load_plan
from ringctl.topology.probe import collect_probe
from tests.topo_fixtures import DGX, H100, IBSTAT, LEONARDO, TWO_NIC, TWO_NIC_IBSTAT

ROOT = Path(__file__).resolve().parent.parent

SCONTROL = """\
SwitchName=leaf1 Level=0 LinkSpeed=1 Nodes=n[1-2]
SwitchName=leaf2 Level=0 LinkSpeed=1 Nodes=n[3-4]
SwitchName=spine Level=1 LinkSpeed=1 Nodes=n[1-4] Switches=leaf[1-2]
"""


def run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_single_node_json_has_the_contract_keys(capsys):
    code, out, err = run(["topo", "--nvidia-smi", str(DGX), "--name", "dgx", "--json"], capsys)
    assert code == 0 and err == ""
    data = json.loads(out)
    assert data["version"] == 1
    assert len(data["ring"]) == 8 and len(data["hops"]) == 8
    for entry in data["ring"]:
        assert {"rank", "node", "local_rank", "gpu", "nic", "numa", "env"} <= set(entry)
    for hop in data["hops"]:
        assert {"src", "dst", "link", "gbps"} <= set(hop)
    assert data["hops"][-1]["dst"] == 0  # the wrap-around hop
    assert data["bottleneck"]["link"] == "NV12" and data["bottleneck"]["gbps"] == 2400.0
    (node,) = data["nodes"]
    assert {"name", "switch", "gpus", "nics"} <= set(node) and node["switch"] is None
    assert [n["name"] for n in node["nics"]] == [f"mlx5_{i}" for i in range(10)]


def test_table_shows_hops_links_and_bottleneck(capsys):
    code, out, _ = run(["topo", "--nvidia-smi", str(H100), "--name", "h100"], capsys)
    assert code == 0
    assert "Ring of 8 ranks over 1 node" in out
    assert out.count("NV18") == 8 + 1 and "7->0" in out  # 8 hops and the bottleneck line
    assert "Bottleneck: NV18 at 3600 Gbit/s" in out


def _node_dir(tmp_path: Path, name: str, smi: Path, ib: Path | None = None) -> Path:
    d = tmp_path / name
    d.mkdir()
    shutil.copy(smi, d / "nvidia-smi-topo.txt")
    if ib:
        shutil.copy(ib, d / "ibstat.txt")
    return d


def test_nodes_from_directories_with_topology_plan_file_and_svg(tmp_path, capsys):
    topo = tmp_path / "topology.conf"
    topo.write_text("SwitchName=leaf1 Nodes=n[1,3]\nSwitchName=leaf2 Nodes=n[2,4]\n")
    args = ["topo", "--slurm-topology", str(topo), "-o", str(tmp_path / "plan.json")]
    args += ["--svg", str(tmp_path / "ring.svg")]
    for i in range(1, 5):
        args += ["--node", f"n{i}={_node_dir(tmp_path, f'd{i}', LEONARDO)}"]
    code, out, _ = run(args, capsys)
    assert code == 0
    assert "2 switch crossing(s)" in out and "n1 under leaf1" in out
    plan = load_plan(tmp_path / "plan.json")
    assert [n["name"] for n in plan.nodes] == ["n1", "n3", "n2", "n4"]
    assert plan.world_size == 16 and plan.switch_crossings() == 2
    svg = ET.parse(tmp_path / "ring.svg").getroot()
    assert svg.tag == "{http://www.w3.org/2000/svg}svg"
    texts = [t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")]
    assert {"n1", "n2", "n3", "n4", "leaf1", "leaf2", "GPU3", "mlx5_3"} <= set(texts)
    assert any(t.startswith("ring of 16 ranks; bottleneck NET 100 Gbit/s") for t in texts)
    paths = list(svg.iter("{http://www.w3.org/2000/svg}path"))
    assert sum(1 for p in paths if "marker-end" in p.attrib) == 16  # one arrow per hop


def _probe(path: Path, node: str, smi: str | None = None, ib: str | None = None) -> Path:
    record = {"version": 1, "node": node, "nvidia_smi_topo": smi, "ibstat": ib, "cpu_count": 2}
    path.write_text(json.dumps(record))
    return path


def test_cpu_cluster_job_template_form(tmp_path, capsys, monkeypatch):
    probes = [_probe(tmp_path / f"p{i}.json", f"n{i}") for i in (4, 3, 2, 1)]
    monkeypatch.setattr(sys, "stdin", io.StringIO(SCONTROL))
    args = ["topo", "--slurm-topology", "-", "--ranks-per-node", "1", "--json"]
    args += ["-o", str(tmp_path / "plan.json"), "--node", *map(str, probes)]
    code, out, _ = run(args, capsys)
    assert code == 0
    data = json.loads(out)
    assert [(e["node"], e["local_rank"], e["gpu"]) for e in data["ring"]] == [
        ("n1", 0, None),
        ("n2", 0, None),
        ("n3", 0, None),
        ("n4", 0, None),
    ]
    assert [n["switch"] for n in data["nodes"]] == ["leaf1", "leaf1", "leaf2", "leaf2"]
    assert [h["link"] for h in data["hops"]] == ["NET"] * 4
    assert sum(h["crosses_switch"] for h in data["hops"]) == 2
    plan = load_plan(tmp_path / "plan.json")
    assert plan.entry_for("n3", 0).rank == 2


def test_a_cpu_job_places_gpu_and_cpu_only_nodes_in_one_ring(tmp_path, capsys):
    """A gloo job on a GPU node and a CPU-only node was refused as a failed probe (the batch
    script did not say the job runs on CPUs): --cpu leaves the GPUs out and places CPU
    ranks, pinning no GPU; without it the mix is still refused."""
    gpu = _probe(tmp_path / "g.json", "g1", smi=H100.read_text())
    cpu = _probe(tmp_path / "c.json", "c1")
    args = ["topo", "--node", str(gpu), str(cpu), "--ranks-per-node", "2", "--json"]
    code, _, err = run(args, capsys)
    assert code == 2 and "node c1 has no GPU in its topology while node g1 has 8" in err
    assert "--cpu" in err
    code, out, err = run([*args, "--cpu"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert sorted((e["node"], e["local_rank"], e["gpu"]) for e in data["ring"]) == [
        ("c1", 0, None),
        ("c1", 1, None),
        ("g1", 0, None),
        ("g1", 1, None),
    ]
    assert not any("CUDA_VISIBLE_DEVICES" in e["env"] for e in data["ring"])
    assert all(not n["gpus"] for n in data["nodes"])
    code, out, err = run([a for a in args if a != "--json"] + ["--cpu"], capsys)
    assert code == 0 and out.startswith("Ring of 4 ranks over 2 nodes"), out
    assert "GPUDirect" not in out + err and "pinned in each rank" not in out + err  # env: {}


def test_probe_records_tools_and_slurm_node_name(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, src in (("nvidia-smi", H100), ("ibstat", IBSTAT)):
        script = bin_dir / tool
        script.write_text(f"#!/bin/sh\nexec /bin/cat '{src}'\n")
        script.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("SLURMD_NODENAME", "n7")
    record = collect_probe()
    assert record["node"] == "n7" and record["cpu_count"] == os.cpu_count()
    assert record["nvidia_smi_topo"] == H100.read_text()
    assert record["ibstat"] == IBSTAT.read_text()
    path = tmp_path / "n7.json"
    path.write_text(json.dumps(record))
    node = load_node(path)
    assert node.name == "n7" and len(node.gpus) == 8
    assert [(n.name, n.rate_gbps) for n in node.nics] == [("mlx4_0", 56.0)]


def test_probe_without_tools_gives_nulls_and_short_hostname(tmp_path, monkeypatch, capsys):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    failing = bin_dir / "nvidia-smi"
    failing.write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    failing.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv("SLURMD_NODENAME", raising=False)
    out = tmp_path / "probe.json"
    code, _, _ = run(["topo", "probe", "-o", str(out)], capsys)
    assert code == 0
    record = json.loads(out.read_text())
    assert record["node"] == socket.gethostname().split(".")[0]
    assert record["nvidia_smi_topo"] is None and record["ibstat"] is None
    assert "No devices were found" in record["errors"]["nvidia-smi"]
    node = load_node(out)
    assert node.gpus == [] and node.nics == []


def test_malformed_matrix_exits_2_with_one_line(tmp_path, capsys):
    bad = tmp_path / "topo.txt"
    bad.write_text("\n".join(DGX.read_text().splitlines()[:5]) + "\n")
    code, out, err = run(["topo", "--nvidia-smi", str(bad)], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1
    assert err.startswith(f"ringctl topo: error: {bad}:6: expected a row for GPU4")


def test_malformed_probe_and_topology_name_file_and_line(tmp_path, capsys):
    probe = _probe(tmp_path / "p.json", "n1", smi="\tGPU0\tGPU1\nGPU0\t X \tNV99X\n")
    code, _, err = run(["topo", "--node", f"n1={probe}"], capsys)
    assert code == 2
    assert err.strip() == (
        f"ringctl topo: error: {probe}[nvidia_smi_topo]:2: unknown link token 'NV99X' in row "
        "GPU0, column GPU1 (expected X, NV<n>, PIX, PXB, PHB, NODE or SYS)"
    )
    topo = tmp_path / "t.conf"
    topo.write_text("# comment\nSwitchName=s0 Nodes=n[3-1]\n")
    good = _probe(tmp_path / "good.json", "n1")
    code, _, err = run(["topo", "--node", str(good), "--slurm-topology", str(topo)], capsys)
    assert code == 2 and err.startswith(f"ringctl topo: error: {topo}:2: range 3-1 runs backwards")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["topo"], "nothing to place"),
        (["topo", "--nvidia-smi", str(DGX), "--bandwidth", "SYS"], "expected KIND=GBPS"),
        (["topo", "--nvidia-smi", str(DGX), "--bandwidth", "WARP=9"], "unknown link kind"),
        # inf won every placement and printed "inf Gbit/s" (before: accepted, exit 0)
        (["topo", "--nvidia-smi", str(DGX), "--bandwidth", "NV=inf"], "NV must be a positive"),
        (["topo", "--nvidia-smi", str(DGX), "--bandwidth", "NET=-inf"], "must be a positive"),
        (["topo", "--nvidia-smi", str(DGX), "--bandwidth", "SYS=nan"], "must be a positive"),
        (["topo", "--nvidia-smi", str(DGX), "--bandwidth", "SYS=0"], "must be a positive"),
        (["topo", "--nvidia-smi", str(DGX), "--bandwidth", "NV=1e308"], "up to 1e+06 Gbit/s"),
        (["topo", "--nvidia-smi", "/nonexistent/topo.txt"], "/nonexistent/topo.txt: cannot"),
        (["topo", "--node", "n1=/nonexistent"], "/nonexistent: no such file"),
        (["topo", "--nvidia-smi", str(DGX), "--ranks-per-node", "9"], "fewer than"),
    ],
)
def test_bad_requests_exit_2(argv, message, capsys):
    code, _, err = run(argv, capsys)
    assert code == 2 and message in err and err.count("\n") == 1


def test_subprocess_no_traceback_and_help_teaches(tmp_path):
    bad = tmp_path / "cut.txt"
    bad.write_text("\n".join(line[:60] for line in H100.read_text().splitlines()))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "ringctl", "topo", "--nvidia-smi", str(bad)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"ringctl topo: error: {bad}:10: expected a row starting")
    cmd = [sys.executable, "-m", "ringctl", "topo", "--help"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0
    assert "examples:" in done.stdout and "--slurm-topology -" in done.stdout
    assert "NV=200" in done.stdout  # the bandwidth table is printed where users look


def test_plan_round_trip_and_validation(tmp_path):
    code = main(["topo", "--nvidia-smi", str(DGX), "-o", str(tmp_path / "p.json"), "--json"])
    assert code == 0
    plan = load_plan(tmp_path / "p.json")
    assert RingPlan.from_json(plan.to_json()) == plan
    with pytest.raises(UserError, match="no rank for node 'other' local rank 0"):
        plan.entry_for("other", 0)
    data = json.loads(plan.to_json())
    data["ring"][0]["rank"] = 5
    with pytest.raises(UserError, match="ranks must be 0..7 in ring order"):
        RingPlan.from_dict(data, "p.json")
    (tmp_path / "bad.json").write_text('{"version": 1,\n "ring": [}')
    with pytest.raises(UserError, match=r"bad.json:2: not JSON"):
        load_plan(tmp_path / "bad.json")


# ---- round 2: binary inputs, GPUDirect marks, assumed rates, rings of rings -----------------


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (bytes(range(256)) * 4, "a binary file (NUL byte at 0)"),
        (b"\xff\xfe GPU0 \x80\x81", "not UTF-8 text (byte 0)"),
    ],
)
@pytest.mark.parametrize("option", ["--nvidia-smi", "--ibstat", "--slurm-topology"])
def test_binary_or_garbage_files_give_one_line(tmp_path, capsys, content, message, option):
    bad = tmp_path / "garbage.bin"
    bad.write_bytes(content)
    argv = ["topo", "--nvidia-smi", str(DGX), option, str(bad)]
    if option == "--nvidia-smi":
        argv = ["topo", "--nvidia-smi", str(bad)]
    elif option == "--slurm-topology":
        argv = ["topo", "--node", str(_probe(tmp_path / "p.json", "n1")), option, str(bad)]
    code, out, err = run(argv, capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"ringctl topo: error: {bad}: {message}")


def test_probe_with_a_non_string_tool_output_is_refused(tmp_path, capsys):
    probe = tmp_path / "p.json"
    probe.write_text(json.dumps({"node": "n1", "nvidia_smi_topo": [1, 2]}))
    code, _, err = run(["topo", "--node", str(probe)], capsys)
    assert code == 2 and "key nvidia_smi_topo must be a string or null" in err


def _two_nic_dirs(tmp_path: Path, count: int, ib: bool = True) -> list[str]:
    tmp_path.mkdir(exist_ok=True)
    args = []
    for i in range(1, count + 1):
        d = _node_dir(tmp_path, f"n{i}", TWO_NIC, TWO_NIC_IBSTAT if ib else None)
        args += ["--node", f"n{i}={d}"]
    return args


def test_table_and_json_show_gdr_marks_and_assumed_rates(tmp_path, capsys):
    code, out, _ = run(["topo", *_two_nic_dirs(tmp_path, 2, ib=False)], capsys)
    assert code == 0
    assert "send -> recv" in out and out.count("GDR -> GDR") == 2
    assert "assumed rate" in out and "Assumed: network port rate assumed 100 Gbit/s" in out
    code, out, _ = run(["topo", *_two_nic_dirs(tmp_path / "j", 2, ib=False), "--json"], capsys)
    data = json.loads(out)
    net = [h for h in data["hops"] if h["link"] == "NET"]
    assert {(h["src_end"], h["dst_end"], h["rate_source"]) for h in net} == {
        ("GDR", "GDR", "assumed")
    }
    assert data["gdr"] == {"level": "PXB", "read": "auto"} and data["assumptions"]
    code, out, _ = run(
        ["topo", *_two_nic_dirs(tmp_path / "k", 2), "--gdr-level", "loc", "--json"], capsys
    )
    data = json.loads(out)
    assert {h["src_end"] for h in data["hops"] if h["link"] == "NET"} == {"host bounce"}
    assert {e["env"]["NCCL_NET_GDR_LEVEL"] for e in data["ring"]} == {"LOC"}


def test_ring_size_reports_every_ring_and_the_worst(tmp_path, capsys):
    topo = tmp_path / "topology.conf"
    topo.write_text(
        "SwitchName=l1 Nodes=n[1-2]\nSwitchName=l2 Nodes=n[3-4]\nSwitchName=s Switches=l[1-2]\n"
    )
    args = ["topo", *_two_nic_dirs(tmp_path, 4), "--slurm-topology", str(topo)]
    code, out, _ = run([*args, "--ring-size", "16", "-o", str(tmp_path / "plan.json")], capsys)
    assert code == 0
    assert "2 rings of 16 ranks (32 ranks) over 4 nodes" in out
    assert "leaf l1" in out and "leaf l2" in out and "Worst ring's bottleneck: NET at 100" in out
    plan = load_plan(tmp_path / "plan.json")
    assert plan.ring_size == 16 and [g.nodes for g in plan.groups] == [["n1", "n2"], ["n3", "n4"]]
    assert plan.entry_for("n3", 0).group == 1
    code, _, err = run([*args, "--ring-size", "5"], capsys)
    assert code == 2 and "--ring-size 5 does not divide the job's 32 ranks" in err
    code, _, err = run([*args, "--nvlink-blocks"], capsys)
    assert code == 2 and "--nvlink-blocks needs a --slurm-topology with BlockName=" in err


def test_plan_written_before_groups_existed_reads_as_one_ring(tmp_path):
    main(["topo", "--nvidia-smi", str(DGX), "-o", str(tmp_path / "p.json")])
    data = json.loads((tmp_path / "p.json").read_text())
    for key in ("groups", "ring_size", "gdr", "assumptions"):
        del data[key]
    for entry in data["ring"]:
        del entry["group"]
    for hop in data["hops"]:
        for key in ("src_end", "dst_end", "rate_source", "shared", "group"):
            del hop[key]
    old = RingPlan.from_dict(data, "old.json")
    assert old.ring_size == 8 and [g.ranks for g in old.groups] == [list(range(8))]
    assert old.groups[0].bottleneck == old.bottleneck
    data["groups"] = [{"index": 0, "ranks": [0, 1, 2]}, {"index": 1, "ranks": [3, 4, 5, 6, 7]}]
    with pytest.raises(UserError, match="groups must split ranks 0..7 into equal rings"):
        RingPlan.from_dict(data, "bad.json")


def test_topo_verb_lives_in_commands():
    import importlib.util

    from ringctl import cli
    from ringctl.commands import topo

    assert "ringctl.commands.topo" in cli.VERB_MODULES and callable(topo.register)
    assert importlib.util.find_spec("ringctl.topology.cli") is None  # the topology is a library


@pytest.mark.parametrize("name", ["n1\x1b]0;owned\x07", "[bold]n1", "n1 n2", "-n1", "n\u202e1", ""])
def test_probe_node_name_must_be_a_host_name(tmp_path, capsys, name):
    """A probe is written on a compute node and may come back from a remote job directory; its
    node name went into the report's rich markup and the terminal as it was."""
    probe = _probe(tmp_path / "p.json", name)
    if not name:  # no name in the probe: the file's stem is the name
        probe = probe.rename(tmp_path / "[red]p.json")
    code, out, err = run(["topo", "--node", str(probe)], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert f"{probe}: node name " in err and "is not a host name" in err
    assert "\x1b" not in err and "\u202e" not in err


def test_names_in_the_report_are_shown_not_obeyed(tmp_path, capsys):
    """Switch names (Slurm's topology) are printed as plain text: rich markup shown as written.
    Before: `[/]` in a name crashed the report (MarkupError), `[red]` coloured it. Control
    characters (ESC reached stdout, and the SVG no longer parsed) are refused where they enter,
    as NIC names are (test_bad_topology_lines_are_refused,
    test_nic_names_that_are_no_device_names_are_refused)."""
    probe = _probe(tmp_path / "p.json", "n1", smi=TWO_NIC.read_text())
    topo = tmp_path / "t.conf"
    topo.write_text("SwitchName=[red]leaf[/] Nodes=n1\n")
    code, out, err = run(["topo", "--node", str(probe), "--slurm-topology", str(topo)], capsys)
    assert code == 0, err
    assert "n1 under [red]leaf[/]: GPU0 mlx5_0 ->" in out
