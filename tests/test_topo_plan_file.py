"""The files `ringctl topo` reads and writes: a plan it writes is one every worker accepts, node
names are checked where they enter, and neither reading nor writing goes through a link planted
in a job directory (which every node of a job can write)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ringctl.cli import main
from ringctl.errors import UserError
from ringctl.topology import load_plan
from ringctl.topology import placement as placement_module
from tests.topo_fixtures import H100

EVEN = ",".join(str(c) for c in range(0, 224, 2))  # socket 0 of a 2x56-core SMT host, interleaved
ODD = ",".join(str(c) for c in range(1, 224, 2))


def interleaved_matrix() -> str:
    """8 GPUs whose CPU Affinity is the interleaved CPU list nvidia-smi prints (392 chars)."""
    devs = [f"GPU{i}" for i in range(8)]
    rows = ["\t" + "\t".join(devs) + "\tCPU Affinity\tNUMA Affinity"]
    for i in range(8):
        cells = ["X" if i == j else "NV18" for j in range(8)]
        rows.append(f"GPU{i}\t" + "\t".join(cells) + f"\t{EVEN if i < 4 else ODD}\t{i // 4}")
    return "\n".join(rows) + "\n"


def run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


# ---- f1: the plan written is the plan the workers read -------------------------------------


def test_long_interleaved_cpu_affinity_is_kept_and_the_plan_loads(tmp_path, capsys):
    """f1: a CPU Affinity over 256 characters (a dual-socket host numbering its CPUs
    interleaved: 0,2,4,...,222) was copied into RINGCTL_CPU_AFFINITY, which load_plan allowed
    only up to 256: `ringctl topo` wrote a plan that every worker refused. Nothing reads the
    variable yet, but it is the rank's CPU binding a launcher or worker can apply, and the
    plan is the one place that joins it to the rank: so the value is kept, and load_plan takes
    a longer value for this one variable when it is a strict CPU list (digits, ',' and '-')."""
    smi = tmp_path / "topo.txt"
    smi.write_text(interleaved_matrix())
    out = tmp_path / "placement.json"
    code, _, err = run(["topo", "--nvidia-smi", str(smi), "-o", str(out)], capsys)
    assert code == 0, err
    plan = load_plan(out)
    assert len(EVEN) > 256
    for e in plan.ring:
        assert e.env["RINGCTL_CPU_AFFINITY"] == (EVEN if e.gpu < 4 else ODD)
        assert e.env["RINGCTL_NUMA_NODE"] == str(e.gpu // 4)
    written = out.read_text()
    for name, value in (
        ("RINGCTL_CPU_AFFINITY", EVEN + ",x"),  # long, not a CPU list
        ("RINGCTL_CPU_AFFINITY", "0-3;" + EVEN),
        ("CUDA_DEVICE_ORDER", EVEN),  # a long CPU list, in another variable
        # (hostile-input review) CPUs Linux cannot have, a range backwards, and 8,191 ranges
        # of 0-99999 (within the length bound: ~34 s of CPU a rank to read as a set)
        ("RINGCTL_CPU_AFFINITY", "0-99999"),
        ("RINGCTL_CPU_AFFINITY", "5-3"),
        ("RINGCTL_CPU_AFFINITY", ",".join(["0-99999"] * 8191)),
    ):
        data = json.loads(written)
        data["ring"][1]["env"][name] = value
        out.write_text(json.dumps(data))
        with pytest.raises(UserError, match=rf"ring\[1\]\.env\.{name}: .* is not a plain value"):
            load_plan(out)


def test_a_plan_the_workers_would_refuse_is_not_written(tmp_path, capsys, monkeypatch):
    """f1: `ringctl topo -o` reads its own output back through the workers' reader before
    writing: a plan load_plan refuses is an error here (exit 2), and the old file stays."""
    monkeypatch.setattr(
        placement_module, "_env", lambda *args: {"LD_PRELOAD": "/tmp/x.so"}, raising=False
    )
    out = tmp_path / "placement.json"
    out.write_text("previous plan\n")
    code, _, err = run(["topo", "--nvidia-smi", str(H100), "-o", str(out)], capsys)
    assert code == 2 and len(err.splitlines()) == 1
    assert f"{out}: not written, the workers would refuse this plan: " in err
    assert "env.'LD_PRELOAD': a placement sets only" in err
    assert out.read_text() == "previous plan\n"


# ---- f8: no link followed, reading or writing ----------------------------------------------


def test_a_linked_probe_or_tool_output_is_refused(tmp_path, capsys):
    """f8: read_text resolved the path before its no-follow read, so a probe linking outside
    probes/ was read as the node's layout, and a linked nvidia-smi-topo.txt printed a fragment
    of the file it named."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "other.json").write_text(
        json.dumps({"node": "n1", "nvidia_smi_topo": H100.read_text()})
    )
    (outside / "private.txt").write_text("GPU0 API_TOKEN=s3cr3t-value\n")
    probes = tmp_path / "probes"
    (probes / "n2").mkdir(parents=True)
    (probes / "n1.json").symlink_to(outside / "other.json")
    (probes / "n2" / "nvidia-smi-topo.txt").symlink_to(outside / "private.txt")
    for arg, path in (("n1=", probes / "n1.json"), ("n2=", probes / "n2" / "nvidia-smi-topo.txt")):
        node = f"{arg}{path.parent if arg == 'n2=' else path}"
        code, out, err = run(["topo", "--node", node, "--json"], capsys)
        assert code == 2 and out == ""
        assert (
            err.strip() == f"ringctl topo: error: {path}: a link, not followed (not a regular file)"
        )
        assert "s3cr3t" not in err


def _victim(tmp_path: Path, name: str) -> tuple[Path, Path]:
    victim = tmp_path / "outside" / f"{name}.victim"
    victim.parent.mkdir(exist_ok=True)
    victim.write_text("precious\n")
    link = tmp_path / "job" / name
    link.parent.mkdir(exist_ok=True)
    link.symlink_to(victim)
    return victim, link


@pytest.mark.parametrize("flag", ["-o", "--svg"])
def test_topo_writes_replace_a_planted_link_not_its_target(tmp_path, capsys, flag):
    """f8: `-o placement.json` and `--svg` wrote with Path.write_text, through a link planted
    at the path, over the file it named. Now a new file is renamed into place."""
    victim, link = _victim(tmp_path, "placement.json")
    code, _, err = run(["topo", "--nvidia-smi", str(H100), flag, str(link)], capsys)
    assert code == 0, err
    assert victim.read_text() == "precious\n"
    assert not link.is_symlink() and link.is_file()
    if flag == "-o":
        assert load_plan(link).world_size == 8
    else:
        assert link.read_text().startswith("<svg")
    assert oct(link.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def test_probe_write_replaces_a_planted_link_not_its_target(tmp_path, monkeypatch):
    """f8: `ringctl topo probe -o probes/NODE.json` wrote through a planted link too."""
    monkeypatch.setenv("PATH", str(tmp_path / "no-tools"))
    monkeypatch.setenv("SLURMD_NODENAME", "n7")
    victim, link = _victim(tmp_path, "n7.json")
    assert main(["topo", "probe", "-o", str(link)]) == 0
    assert victim.read_text() == "precious\n"
    assert not link.is_symlink() and json.loads(link.read_text())["node"] == "n7"


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# ---- f2: node names are checked where they enter -------------------------------------------


def _node_dir(parent: Path, name: str) -> Path:
    d = parent / name
    d.mkdir()
    (d / "nvidia-smi-topo.txt").write_text(H100.read_text())
    return d


def test_node_names_are_checked_where_they_enter(tmp_path, capsys):
    """f2: a node name from --name, from NAME= with a directory, or from a directory's own name
    reached the plan unchecked: `ringctl topo` exited 0 and wrote a plan that load_plan (every
    worker) refused. Each is refused at once, in one line naming where the name came from."""
    bad_dir = _node_dir(tmp_path, "n$(id)")
    good_dir = _node_dir(tmp_path, "good")
    out = tmp_path / "p.json"
    cases = [
        (["--nvidia-smi", str(H100), "--name", "gpu node 1"], "--name: node name 'gpu node 1'"),
        (["--node", str(bad_dir)], f"{bad_dir} (the directory's name; give NAME=PATH): node name"),
        (["--node", f"a b={good_dir}"], "--node a b=...: node name 'a b'"),
        (["--node", f"n;1={good_dir}"], "--node n;1=...: node name 'n;1'"),
    ]
    for args, expected in cases:
        code, _, err = run(["topo", *args, "-o", str(out)], capsys)
        assert code == 2 and len(err.splitlines()) == 1
        assert err.startswith(f"ringctl topo: error: {expected}"), err
        assert "is not a host name" in err and not out.exists()
    code, _, err = run(["topo", "--node", f"n1={bad_dir}", "-o", str(out)], capsys)
    assert code == 0, err
    assert {e.node for e in load_plan(out).ring} == {"n1"}


def test_a_plan_nested_too_deeply_is_refused_in_one_line(tmp_path):
    """(second reading) placement.json of 200,000 nested '[' raised RecursionError on every
    rank that read it (the loader caught JSON's own errors only); the gather marker's reader
    likewise (it is then not a gather output)."""
    from ringctl.output_dir import MARKER, marker_of

    deep = "[" * 200_000 + "]" * 200_000
    plan = tmp_path / "placement.json"
    plan.write_text(deep)
    with pytest.raises(UserError, match=r"placement.json: not JSON \(nested too deeply\)"):
        load_plan(plan)
    (tmp_path / MARKER).write_text(deep)
    assert marker_of(tmp_path) is None
