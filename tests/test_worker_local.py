"""The local backend end to end: 4 worker processes on gloo, like a 4-node Slurm job.

Also the worker's placement logic (placement.json -> rank) without starting any process.
"""

from __future__ import annotations

import json
import os
import re
import time
import zlib
from pathlib import Path

import pytest

from ringctl.backends.base import JobState
from ringctl.cli import main
from ringctl.config import load_resolved
from ringctl.submission import open_job_dir

REPO = Path(__file__).resolve().parents[1]
SMOKE = str(REPO / "jobs" / "smoke.yaml")


def _cpus(node: str, local_rank: int) -> str:
    """A CPU list that names a plan entry's (node, local rank), of CPUs this machine lacks
    (1000 and up: no rank is bound by it)."""
    return str(1000 + 16 * (zlib.crc32(node.encode()) % 400) + local_rank)


def only_job_dir(root: Path) -> Path:
    dirs = [p.parent for p in root.glob("*/job.json")]
    assert len(dirs) == 1, dirs
    return dirs[0]


def run_job(tmp_path: Path, capsys, *overrides: str) -> tuple[int, str, str, Path]:
    code = main(["run", SMOKE, f"output_dir={tmp_path}", "task.steps=1", *overrides])
    out, err = capsys.readouterr()
    return code, out, err, only_job_dir(tmp_path)


def test_smoke_job_matches_the_reference(tmp_path, capsys):
    import torch

    from ringctl.tasks.attention import load_results, reference

    code, out, err, job_dir = run_job(tmp_path, capsys)
    assert code == 0, out + err
    assert "COMPLETED" in out
    for name in ("config.yaml", "job.sh", "job.json"):
        assert (job_dir / name).is_file()
    assert json.loads((job_dir / "job.json").read_text())["backend"] == "local"

    cfg = load_resolved(job_dir / "config.yaml")
    want, got = reference(cfg), load_results(job_dir / "out")
    for name in ("out", "dq", "dk", "dv"):
        assert got[name].dtype == torch.float32 and got[name].shape == want[name].shape
        scale = want[name].abs().max()
        torch.testing.assert_close(got[name].double(), want[name], rtol=1e-5, atol=1e-5 * scale)
    timing = json.loads((job_dir / "out" / "rank-3.json").read_text())
    assert timing["world_size"] == 4 and timing["steps_done"] == 1 and timing["layout"] == "zigzag"

    assert main(["status", str(job_dir)]) == 0
    table = capsys.readouterr().out
    assert "COMPLETED" in table and "smoke" in table and "1/1 steps" in table
    assert main(["logs", str(job_dir), "--rank", "2"]) == 0
    assert "-> ring rank 2 of 4" in capsys.readouterr().out
    assert main(["logs", str(job_dir)]) == 0
    assert "[rank 3] " in capsys.readouterr().out


def test_a_failing_rank_fails_the_job_with_its_error(tmp_path, capsys):
    code, out, err, job_dir = run_job(tmp_path, capsys, "task.fault_rank=2", "timeout=20")
    assert code == 1
    assert "FAILED" in err and "rank 2 exited 1: RuntimeError: injected fault on rank 2" in err
    _, _, backend = open_job_dir(job_dir)
    st = backend.status(job_dir)
    assert st.state is JobState.FAILED and st.ranks[2] == "FAILED"
    assert st.reason.startswith("rank 2 exited 1: RuntimeError: injected fault")
    last = (job_dir / "logs" / "rank-2.err").read_text().strip().splitlines()[-1]
    assert last.startswith("ringctl.worker: rank 2") and "injected fault" in last


@pytest.mark.parametrize("fault", ["hang", "exit"])
def test_a_dead_or_hung_rank_fails_the_others_within_the_timeout(tmp_path, capsys, fault):
    timeout = 3
    start = time.monotonic()
    code, out, err, job_dir = run_job(
        tmp_path, capsys, "task.fault_rank=1", f"task.fault={fault}", f"timeout={timeout}"
    )
    took = time.monotonic() - start
    assert code == 1
    state = json.loads((job_dir / "state.json").read_text())
    assert state["state"] == "FAILED"
    assert took < 90  # not the default 300 s collective timeout, nor the Slurm time limit
    if fault == "hang":
        # A peer timed out in a collective after `timeout` seconds and the hung rank was ended.
        # The job's reason is the first failure recorded: the timeout itself, or a rank whose
        # own peer left right after timing out ("Connection closed by peer").
        errors = [
            json.loads(p.read_text()).get("error", "")
            for p in (job_dir / "logs").glob("rank-*.result.json")
        ]
        assert any(f"Timed out waiting {timeout * 1000}ms" in e for e in errors), errors
        assert state["reason"].startswith("rank "), state["reason"]
        assert state["ranks"]["1"]["state"] == "KILLED"
    else:
        assert state["reason"].startswith("rank 1 exited 17")
    assert not [r for r in state["ranks"].values() if r["state"] == "RUNNING"]


def test_cancel(tmp_path, capsys):
    assert (
        main(
            [
                "submit",
                SMOKE,
                f"output_dir={tmp_path}",
                "task.fault_rank=0",
                "task.fault=hang",
                "timeout=120",
            ]
        )
        == 0
    )
    job_dir = only_job_dir(tmp_path)
    assert "submitted job local-" in capsys.readouterr().out
    _, _, backend = open_job_dir(job_dir)
    deadline = time.monotonic() + 120
    while backend.status(job_dir).state is not JobState.RUNNING:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert main(["cancel", str(job_dir)]) == 0
    st = backend.status(job_dir)
    assert st.state is JobState.CANCELLED
    pids = [r["pid"] for r in json.loads((job_dir / "state.json").read_text())["ranks"].values()]
    time.sleep(0.2)
    for pid in pids:  # no worker left behind
        try:
            os.kill(pid, 0)
            alive = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except ProcessLookupError:
            alive = False
        assert not alive, pid


# --- placement: a plan decides each process's rank ---------------------------------------------


def _plan(nodes: list[str], per_node: int, order: list[tuple[str, int]]) -> dict:
    ring = [
        {
            "rank": r,
            "node": n,
            "local_rank": lr,
            "gpu": None,
            "nic": None,
            "numa": None,
            "env": {"RINGCTL_CPU_AFFINITY": _cpus(n, lr)},
        }
        for r, (n, lr) in enumerate(order)
    ]
    return {"version": 1, "ring": ring, "hops": [], "bottleneck": {}, "nodes": nodes}


def test_identify_takes_the_rank_from_the_plan(tmp_path, monkeypatch):
    from ringctl.worker import WorkerError, identify

    for var in list(os.environ):
        if var.startswith("SLURM") or var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
            monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "n1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    # Slurm placed tasks 0,1 on n1 and 2,3 on n2; the plan puts the ring n2:1, n1:0, n1:1, n2:0
    order = [("n2", 1), ("n1", 0), ("n1", 1), ("n2", 0)]
    (tmp_path / "placement.json").write_text(json.dumps(_plan(["n1", "n2"], 2, order)))
    seen = {}
    for task, (node, local) in enumerate([("n1", 0), ("n1", 1), ("n2", 0), ("n2", 1)]):
        monkeypatch.setenv("SLURMD_NODENAME", node)
        monkeypatch.setenv("SLURM_LOCALID", str(local))
        monkeypatch.setenv("SLURM_PROCID", str(task))
        ident = identify(tmp_path)
        assert ident.task_index == task and ident.world_size == 4
        seen[(node, local)] = ident.rank
        assert ident.plan_entry["env"]["RINGCTL_CPU_AFFINITY"] == _cpus(node, local)
    assert seen == {("n2", 1): 0, ("n1", 0): 1, ("n1", 1): 2, ("n2", 0): 3}

    monkeypatch.setenv("SLURMD_NODENAME", "n9")
    with pytest.raises(WorkerError, match="no rank for node 'n9'"):
        identify(tmp_path)
    (tmp_path / "placement.json").write_text("{not json")
    with pytest.raises(WorkerError, match="placement.json:1: not JSON"):
        identify(tmp_path)
    (tmp_path / "placement.json").unlink()
    monkeypatch.setenv("SLURM_PROCID", "3")
    assert identify(tmp_path).rank == 3  # no plan: Slurm's task order


def test_the_ring_follows_the_plan(tmp_path):
    """A plan that reverses the ring (launch task t -> ring rank 3-t): ranks take their
    positions from it, the store stays with launch task 0, and results still match."""
    import socket

    import torch

    from ringctl.backends.local import LocalBackend
    from ringctl.config import load_job, to_yaml
    from ringctl.tasks.attention import load_results, reference

    cfg = load_job(SMOKE, ["task.steps=1", "timeout=60"])
    job_dir = tmp_path / "job"
    (job_dir / "logs").mkdir(parents=True)
    (job_dir / "config.yaml").write_text(to_yaml(cfg))
    host = socket.gethostname().split(".")[0]
    order = [(host, lr) for lr in (3, 2, 1, 0)]
    (job_dir / "placement.json").write_text(json.dumps(_plan([host], 4, order)))
    backend = LocalBackend(cfg)
    backend.submit(job_dir)
    deadline = time.monotonic() + 180
    while not (st := backend.status(job_dir)).state.finished:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert st.state is JobState.COMPLETED, st.reason
    for task in range(4):
        out = (job_dir / "logs" / f"rank-{task}.out").read_text()
        assert f"-> ring rank {3 - task} of 4 (from placement.json)" in out
    want, got = reference(cfg), load_results(job_dir / "out")
    for name in ("out", "dq", "dk", "dv"):
        scale = want[name].abs().max()
        torch.testing.assert_close(got[name].double(), want[name], rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize(
    "change, said",
    [
        ({"env": {"LD_PRELOAD": "/tmp/evil.so"}}, "ring[1].env.'LD_PRELOAD': a placement sets"),
        ({"env": {"PYTHONPATH": "/tmp/evil"}}, "ring[1].env.'PYTHONPATH': a placement sets"),
        ({"env": {"NCCL_IB_HCA": "a b"}}, "ring[1].env.NCCL_IB_HCA: 'a b' is not a plain"),
        ({"env": ["x"]}, "ring[1].env: expected a mapping"),
        ({"rank": 1.0}, "ring[1].rank: expected a whole number"),
        ({"local_rank": False}, "ring[1].local_rank: expected a whole number"),
        ({"gpu": -1}, "ring[1].gpu: expected null or a whole number"),
        ({"gpu": True}, "ring[1].gpu: expected null or a whole number"),
        ({"node": "n1; rm"}, "ring[1].node: not a host name"),
    ],
)
def test_a_plan_entry_a_worker_cannot_use_is_refused_naming_it(tmp_path, change, said):
    """placement.json is written into the job directory, which the job (any node) can write:
    its env was applied as it came (LD_PRELOAD, PYTHONPATH, NCCL_NET_PLUGIN: code into every
    rank), and a rank of 0.0 or False passed the order check into init_process_group."""
    from ringctl.errors import UserError
    from ringctl.topology import load_plan

    plan = _plan(["n1"], 2, [("n1", 0), ("n1", 1)])
    plan["ring"][1].update(change)
    (tmp_path / "placement.json").write_text(json.dumps(plan))
    with pytest.raises(UserError, match=re.escape(said)) as err:
        load_plan(tmp_path / "placement.json")
    assert "\n" not in str(err.value)


def test_placement_and_probes_that_are_pipes_or_links_are_refused(tmp_path):
    """Every rank reads placement.json before any timeout applies, and the placement step
    reads each node's probe: a FIFO there hung the whole job, a link to /dev/zero filled the
    memory. Both are refused in one line now."""
    from ringctl.errors import UserError
    from ringctl.topology import load_plan
    from ringctl.topology.nodes import load_node

    os.mkfifo(tmp_path / "placement.json")
    (tmp_path / "n1.json").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "n2.json")
    with pytest.raises(UserError, match="placement.json: cannot read the plan .*not a regular"):
        load_plan(tmp_path / "placement.json")
    for probe in ("n1.json", "n2.json"):
        with pytest.raises(UserError, match="not a regular file"):
            load_node(tmp_path / probe)


def test_a_placement_link_to_nowhere_is_refused_not_taken_for_no_placement(tmp_path):
    """load_placement asked path.exists(), which follows the link: a placement.json linked to
    a missing file was read as "no placement" and the ranks ran in launch order."""
    from ringctl.worker import WorkerError, load_placement

    (tmp_path / "placement.json").symlink_to(tmp_path / "missing.json")
    with pytest.raises(WorkerError, match="placement.json: cannot read the plan .*a link"):
        load_placement(tmp_path)
    (tmp_path / "placement.json").unlink()
    assert load_placement(tmp_path) is None


def test_a_planned_gpu_that_is_not_visible_is_refused_not_run_on_the_cpu():
    """A plan that pins a rank to a GPU this step cannot see leaves it no CUDA device; with
    ring.dist_backend=auto the rank fell back to gloo on the CPU, exit 0, many times slower.
    (This machine has no CUDA: the same state as a pin to a GPU the step cannot see.)"""
    import types

    import torch

    from ringctl.worker import Identity, WorkerError, init_distributed

    assert not torch.cuda.is_available()
    ident = Identity("n1", 0, 0, 0, 1, "127.0.0.1", 1, plan_entry={"gpu": 3, "env": {}})
    cfg = types.SimpleNamespace(
        ring=types.SimpleNamespace(dist_backend=types.SimpleNamespace(value="auto")),
        rendezvous_timeout=5,
        timeout=5,
    )
    with pytest.raises(WorkerError, match="gives this rank GPU 3; it sees no CUDA device"):
        init_distributed(cfg, ident)


def test_the_warning_signal_slurm_signal_names_checkpoints_and_stops(tmp_path, capsys):
    """slurm.signal accepted USR2/TERM/HUP... but the worker handled SIGUSR1 only: a training
    job given USR2@120 died at the warning with no checkpoint (FAILED, 'checkpoints: none').
    The worker now takes the signal slurm.signal names; signals that cannot serve as a
    warning (ignored or stopping by default) are refused when the job is read."""
    import random
    import signal

    from ringctl.cli import main
    from tests.local_jobs import local_state, wait_for

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = random.Random(3)
    for i in range(12):
        (corpus / f"doc{i:02d}.txt").write_bytes(bytes(rng.randrange(256) for _ in range(400)))
    job = tmp_path / "job"
    argv = ["submit", "jobs/train.yaml", f"job_dir={job}", f"task.inputs=[{corpus}]"]
    argv += ["task.seq_len=128", "task.batch_sequences=4", "task.max_steps=200"]
    argv += ["task.checkpoint_every=1000", "task.chunk_size=64", "tasks_per_node=2"]
    assert main([*argv, "timeout=60", "slurm.signal=USR2@120"]) == 0
    metrics = job / "logs" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, 180, "steps")
    for info in local_state(job)["ranks"].values():  # what Slurm's --signal does to each task
        os.kill(info["pid"], signal.SIGUSR2)
    final = wait_for(lambda: local_state(job).get("ended_at") and local_state(job), 120, "end")
    steps = len(metrics.read_text().splitlines())
    checkpoint = job / "checkpoints" / f"step-{steps:07d}"
    assert f"stopped on request at step {steps} of 200 (checkpoint {checkpoint})" in final["reason"]
    # a planned stop is said as one (no "RuntimeError:", no traceback in the ranks' logs)
    assert "Error" not in final["reason"]
    for err in (job / "logs").glob("rank-*.err"):
        text = err.read_text()
        assert "Traceback" not in text and ") stopped on request at step" in text, text
    assert (job / "checkpoints" / "latest").read_text().strip() == checkpoint.name
    capsys.readouterr()
    assert main(["render", "jobs/train.yaml", "backend=slurm", "slurm.signal=URG@120"]) == 2
    err = capsys.readouterr().err
    assert "slurm.signal" in err and "do not take SIGURG as a warning" in err


def test_an_inherited_cpu_list_does_not_bind_ranks_no_plan_placed(tmp_path, capsys, monkeypatch):
    """(hostile-input review) The worker bound each rank to $RINGCTL_CPU_AFFINITY whatever set
    it: a value the submitting shell held (sbatch and the local backend pass the environment
    on) bound ranks no plan placed, each counted alone (four ranks on CPU 0 here). Only the
    plan's list for the rank binds it."""
    monkeypatch.setenv("RINGCTL_CPU_AFFINITY", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # one thread a rank: CPU 0 holds each alone
    code, out, err, job_dir = run_job(tmp_path, capsys)
    assert code == 0, out + err
    for rank in range(4):
        start = (job_dir / "logs" / f"rank-{rank}.out").read_text()
        line = next(x for x in start.splitlines() if "-> ring rank" in x)
        assert "bound" not in line, line
