"""How the local backend starts ranks (ringctl.backends.launch): forked from the supervisor,
which imported their task's modules once, unless something the job asks for acts at an
interpreter's start-up; then each rank is a new interpreter, and the supervisor says why.

Real jobs on real processes; a forked rank must be what a new interpreter would be: its own
environment, thread count and random seeds, found by `live_workers`, and killed with its
supervisor. That the forked ranks compute the same numbers is what every other job-level test
checks (they fork by default); test_train_cluster compares a local training job (forked) with
the same job on Slurm (new interpreters) bitwise.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from ringctl.backends import launch
from ringctl.backends.launch import as_a_new_interpreter, exec_reason
from ringctl.backends.local import live_workers
from ringctl.cli import main
from ringctl.config import load_job
from ringctl.jobdir import JobDir
from tests.local_jobs import local_state, submit, wait_for

REPO = Path(__file__).resolve().parents[1]
SMOKE = str(REPO / "jobs" / "smoke.yaml")
SMALL = ["nodes=1", "tasks_per_node=2", "task.steps=1", "timeout=60"]
needs_no_gpu = pytest.mark.skipif(
    launch.gpu_device_node() is not None, reason="a GPU machine's local ranks start by exec"
)


def _run_smoke(tmp_path: Path, capsys, *overrides: str) -> tuple[dict, str, list[str]]:
    """Run the smoke job: (state.json, the supervisor's log, each rank's first log line)."""
    job = tmp_path / "job"
    assert main(["run", SMOKE, f"job_dir={job}", *SMALL, *overrides]) == 0, capsys.readouterr()
    state = json.loads((job / "state.json").read_text())
    firsts = [(job / "logs" / f"rank-{r}.out").read_text().splitlines()[0] for r in range(2)]
    return state, (job / "logs" / "supervisor.log").read_text(), firsts


@needs_no_gpu
def test_ranks_fork_and_take_the_jobs_thread_count(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RINGCTL_LOCAL_LAUNCH", raising=False)
    state, log, firsts = _run_smoke(tmp_path, capsys, "env.vars.OMP_NUM_THREADS=2")
    assert state["state"] == "COMPLETED"  # the smoke task checks its ring against a reference
    assert [r["launch"] for r in state["ranks"].values()] == ["fork", "fork"]
    assert "ranks forked after importing" in log
    assert all(line.endswith("; CPU threads: 2") for line in firsts), firsts


def test_a_variable_that_acts_at_start_up_starts_new_interpreters(tmp_path, capsys):
    extra = ["env.vars.MALLOC_ARENA_MAX=2", "env.vars.OMP_NUM_THREADS=2"]
    state, log, firsts = _run_smoke(tmp_path, capsys, *extra)
    assert state["state"] == "COMPLETED"
    assert [r["launch"] for r in state["ranks"].values()] == ["exec", "exec"]
    assert "new interpreters: env.vars.MALLOC_ARENA_MAX may act at start-up" in log
    assert all(line.endswith("; CPU threads: 2") for line in firsts), firsts


def _cfg(*overrides: str):
    return load_job(SMOKE, list(overrides))


OFFLINE = {"HF_HUB_OFFLINE": "1"}  # a model task's start_env


@pytest.mark.parametrize(
    "overrides, environ, threads, why",
    [
        ([], {"GPU": "/dev/null"}, "1", "a GPU is here (/dev/null): CUDA cannot start in a fork"),
        ([], {}, "1", None),
        (["env.vars.NCCL_DEBUG=INFO", "env.vars.RINGATTN_TRANSPORT=shm"], {}, "4", None),
        (["env.vars.HF_HUB_OFFLINE=1"], {}, "1", None),
        (["env.vars.HF_HUB_OFFLINE=0"], {}, "1", "env.vars.HF_HUB_OFFLINE may act at start-up"),
        (["env.vars.LD_PRELOAD=/x.so"], {}, "1", "env.vars.LD_PRELOAD may act at start-up"),
        (
            ["env.python=/usr/bin/python3"],
            {},
            "1",
            "env.python names an interpreter (/usr/bin/python3)",
        ),
        ([], {}, "4,2", "OMP_NUM_THREADS='4,2' is not a plain thread count"),
        ([], {"RINGCTL_LOCAL_LAUNCH": "exec"}, "1", "RINGCTL_LOCAL_LAUNCH=exec"),
        ([], {"RINGCTL_LOCAL_LAUNCH": "spawn"}, "1", "RINGCTL_LOCAL_LAUNCH=spawn (fork or exec)"),
    ],
)
def test_what_makes_ranks_new_interpreters(overrides, environ, threads, why, monkeypatch):
    monkeypatch.delenv("RINGCTL_LOCAL_LAUNCH", raising=False)
    environ = dict(environ)
    monkeypatch.setattr(launch, "GPU_DEVICE_NODES", (environ.pop("GPU", "/nonexistent"),))
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    reason = exec_reason(_cfg(*overrides), threads, OFFLINE)
    assert reason == why or (why and reason.startswith(why)), reason


def test_a_forked_process_gets_its_own_seeds_and_threads():
    """Two forks of one process, each made a new interpreter's: different torch and numpy seeds
    (a new interpreter's are drawn from the OS), and the thread count asked for."""
    import numpy
    import torch

    threads = torch.get_num_threads() + 1  # not the parent's, so it must have been set
    seen = []
    for _ in range(2):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                os.close(read)
                as_a_new_interpreter(threads)
                text = f"{torch.initial_seed()} {numpy.random.randint(1 << 30)} "
                os.write(write, f"{text}{torch.get_num_threads()}".encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read) as fh:
            seen.append(fh.read().split())
        os.waitpid(pid, 0)
    (torch_a, numpy_a, threads_a), (torch_b, numpy_b, threads_b) = seen
    assert torch_a != torch_b and numpy_a != numpy_b, seen
    assert str(torch.initial_seed()) not in (torch_a, torch_b)
    assert threads_a == threads_b == str(threads)


@needs_no_gpu
def test_forked_ranks_are_found_and_die_with_their_supervisor(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RINGCTL_LOCAL_LAUNCH", raising=False)
    hang = ["task.fault_rank=1", "task.fault=hang", "timeout=120"]
    job = submit(capsys, SMOKE, f"job_dir={tmp_path / 'job'}", *SMALL, *hang)
    state = wait_for(
        lambda: len(local_state(job).get("ranks", {})) == 2 and local_state(job), 60, "ranks"
    )
    assert [r["launch"] for r in state["ranks"].values()] == ["fork", "fork"]
    pids = sorted(int(r["pid"]) for r in state["ranks"].values())
    assert all(Path(f"/proc/{pid}/comm").read_text().strip() == "ringctl-rank" for pid in pids)
    workers = live_workers(JobDir(job))
    assert sorted(r.pid for r in workers) == pids
    os.kill(state["supervisor_pid"], signal.SIGKILL)
    wait_for(lambda: not any(r.alive() for r in workers), 30, "the ranks to die with it")
    time.sleep(0.1)
    assert live_workers(JobDir(job)) == []


def test_a_failed_warm_up_import_leaves_ranks_to_new_interpreters(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    reason = launch.warm_up(("json", "ringctl.no_such_module"), {"OMP_NUM_THREADS": "1"})
    assert reason == "importing ringctl.no_such_module failed (ModuleNotFoundError)"
    assert os.environ["OMP_NUM_THREADS"] == "7"  # the environment is put back


@needs_no_gpu
def test_a_forked_rank_exits_with_the_workers_status(tmp_path):
    """A rank that fails (here: no job in its directory) exits 1 with the worker's one-line
    error last in its stderr, as a new interpreter's does."""
    logs = (tmp_path / "out", tmp_path / "err")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": "0", "WORLD_SIZE": "1"}
    rank = launch.start_rank(launch.FORK, str(tmp_path), env, logs, "unused")
    assert isinstance(rank, launch.ForkedRank)
    code = wait_for(lambda: rank.poll() is not None and str(rank.returncode), 60, "the rank")
    assert code == "1"
    last = logs[1].read_text().strip().splitlines()[-1]
    assert last.startswith("ringctl.worker: rank ? failed: "), last


def test_the_model_tasks_go_offline_before_their_imports():
    """The warm-up sets what the model tasks' ranks set before importing transformers, from
    the one place that says it (a job's HF_HUB_OFFLINE=1 then changes nothing for a fork)."""
    from ringctl.longdoc.model.hub import OFFLINE_ENV
    from ringctl.tasks import get_task

    assert get_task("longdoc").start_env is OFFLINE_ENV is get_task("train").start_env
    assert get_task("attention").start_env == {}
    assert "transformers" in get_task("longdoc").start_imports


def test_the_rendezvous_port_is_one_the_kernel_does_not_hand_out():
    """Rank 0's port came from bind(0): the kernel's ephemeral range, from which any outgoing
    connection (another job's gloo pairs) may take it before rank 0 binds it (the full suite
    once failed a training job with EADDRINUSE). Below the range only a process naming the
    port takes it."""
    from ringctl.backends import local

    low = local.ephemeral_low()
    if low is None or low <= local.LOWEST_PORT:
        pytest.skip("no room below this kernel's ephemeral range")
    ports = {local.rendezvous_port() for _ in range(20)}
    assert all(local.LOWEST_PORT <= p < low for p in ports), sorted(ports)
    assert len(ports) > 1  # drawn at random: two jobs starting together rarely meet
