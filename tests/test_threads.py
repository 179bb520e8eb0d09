"""Each rank's CPU thread count: one rule (ringctl/threads.py) for the local backend and a
Slurm rank. A Slurm rank set none and torch took every core of the node in each rank: the
same job gave other numbers there than locally (losses 1.8e-7 apart; the real cluster test,
tests/test_train_cluster.py, now runs unpinned and is bitwise equal to the local run)."""

from __future__ import annotations

import os

import torch
from omegaconf import OmegaConf

from ringctl.threads import rank_threads
from ringctl.worker import apply_threads


def test_the_rule():
    rule = dict(cpus_per_task=None, node_cpus=8, ranks_on_node=3)
    assert rank_threads("3", **rule) == "3"  # the job's own
    assert rank_threads("4,2", **rule) == "4,2"  # nested levels, as OpenMP reads them
    assert rank_threads(None, **rule) == "2"  # the node's CPUs over its ranks
    assert rank_threads(None, **(rule | {"cpus_per_task": 4})) == "4"  # Slurm's per task
    assert rank_threads(None, cpus_per_task=None, node_cpus=2, ranks_on_node=4) == "1"
    for refused in ("0", "-1", "abc", "2,0", "3x"):  # OpenMP refuses them: every core taken
        assert rank_threads(refused, **rule) == "2", refused
    for blank, read in ((" 3", "3"), ("3 ", "3"), ("4, 2", "4,2"), ("\t3\n", "3")):
        assert rank_threads(blank, **rule) == read, blank  # as libgomp reads them
    for unicode_blank in ("3\u00a0", "\u20033"):  # not C's blanks: libgomp refuses them
        assert rank_threads(unicode_blank, **rule) == "2", unicode_blank


def test_a_slurm_rank_takes_its_share_of_its_node(monkeypatch):
    cfg = OmegaConf.create({"tasks_per_node": 2, "slurm": {"cpus_per_task": None}})
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "4")
    try:
        apply_threads(cfg, torch)
        assert torch.get_num_threads() == 2
        # given: applied as the local backend applies it (torch caps the variable at the
        # cores it sees at import: a Slurm rank ran 2 threads where local ran the 3 asked)
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        torch.set_num_threads(1)
        apply_threads(cfg, torch)
        assert torch.get_num_threads() == 3
        monkeypatch.setenv("OMP_NUM_THREADS", "0")  # not a count OpenMP takes: the rule's
        apply_threads(cfg, torch)
        assert torch.get_num_threads() == 2 and os.environ["OMP_NUM_THREADS"] == "2"
    finally:
        torch.set_num_threads(before)


def test_a_rank_bound_to_fewer_cpus_runs_no_more_threads_than_it_has():
    """(scale review) A site binding each Slurm task to its own CPUs (TaskPlugin affinity)
    gave a rank of 8 on a 224-CPU node one CPU, and it ran 28 threads on it. The rule's count
    stops at the CPUs the rank may run on; a count the job gives stands (a child process,
    bound for real)."""
    import subprocess
    import sys

    if len(os.sched_getaffinity(0)) < 2:
        return  # nothing to tell apart on one CPU
    code = (
        "import os, torch; from omegaconf import OmegaConf; "
        "from ringctl.worker import apply_threads; os.sched_setaffinity(0, {0}); "
        "cfg = OmegaConf.create({'tasks_per_node': 8, 'slurm': {'cpus_per_task': None}}); "
        "apply_threads(cfg, torch); print(os.environ['OMP_NUM_THREADS'])"
    )
    for given, want in ((None, "1"), ("3", "3")):
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        env["SLURM_CPUS_ON_NODE"] = "224"
        if given:
            env["OMP_NUM_THREADS"] = given
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.split()[-1] == want, (given, done.stdout)
