"""The training job on the real test cluster: submitted with backend=slurm on four emulated
nodes, requeued by Slurm before and after its first checkpoint (`scontrol requeue`), it
starts again or resumes by itself from checkpoints/latest and ends COMPLETED with every step's loss and the final
weights of the same job run uninterrupted on local ranks of the same shape (bitwise: the same
kernels in the same order; the shared-memory transport between the emulated nodes, which share
a host, carries exactly the bytes gloo would)."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from ringctl.backends.base import JobState
from ringctl.cli import main
from tests.local_jobs import ssh_overrides, submit, wait_for
from tests.test_slurm_requeue import start_now
from tests.test_train_job import _args, _losses, _weights, corpus  # noqa: F401 - fixture

pytestmark = pytest.mark.slurm


def _ended(job, job_id: str):
    """The job's status once Slurm no longer lists it (the first run's records read FAILED
    while the requeued run is pending or running)."""
    listed = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True)
    if listed.stdout.strip():
        return None
    status = backend_status(job)
    return status if status.state.finished else None


def backend_status(job):
    from ringctl.submission import open_job_dir

    _, _, backend = open_job_dir(job)
    return backend.status(job)


def test_a_requeued_training_job_resumes_by_itself(slurm_cluster, corpus, tmp_path, capsys):  # noqa: F811
    """Requeued twice: once before its first checkpoint (the rerun starts again at step 1:
    its history held steps 1-k, then 1-N, one file, exit 0), once after it (the rerun
    resumes from it). No thread count is set: each rank takes its share of its node's CPUs
    as a local rank does (ringctl/threads.py) (torch took every core in each rank, and
    the CPU kernels' rounding follows the thread count: the losses differed by 3e-8)."""
    # margins: the first requeue lands within a step or two of step 1 (the first checkpoint
    # is 14 steps on), the second 25 steps before the end
    steps = ["task.max_steps=40", "task.checkpoint_every=15", "slurm.requeue=true"]
    shape = ["nodes=4", "tasks_per_node=1", "timeout=120", *steps]
    job = submit(
        capsys,
        *_args(tmp_path / "job", corpus, *shape),
        "backend=slurm",
        f"slurm.partition={slurm_cluster.partition}",
    )
    job_id = json.loads((job / "job.json").read_text())["job_id"]
    log = job / "logs" / "metrics.jsonl"
    wait_for(lambda: log.exists() and log.read_text().count("\n") >= 1, 240, "the first step")
    _requeue(job_id)
    wait_for(lambda: (job / "checkpoints" / "latest").exists(), 240, "the first checkpoint")
    _requeue(job_id)
    status = wait_for(lambda: _ended(job, job_id), 400, "the requeued runs to end")
    assert status.state is JobState.COMPLETED, status
    first, second = (job / "attempts" / f"requeue-{job_id}-{k}" / "logs" for k in (1, 2))
    assert "] resumed from step-" not in (second / "rank-0.out").read_text()  # from step 1
    assert (first / "metrics.jsonl").is_file()  # the first run's history, kept aside
    assert "] resumed from step-" in (job / "logs" / "rank-0.out").read_text()
    assert "CPU threads: 1" in (job / "logs" / "rank-0.out").read_text()  # 1 CPU a task
    whole = tmp_path / "whole"
    assert main(["run", *_args(whole, corpus, "nodes=1", "tasks_per_node=4", *steps[:2])]) == 0
    assert _losses(job) == _losses(whole)  # steps 1..40, each once
    ours, theirs = _weights(job, tmp_path / "a"), _weights(whole, tmp_path / "b")
    assert all(torch.equal(ours[name], want) for name, want in theirs.items())


def _requeue(job_id: str) -> None:
    requeued = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    assert requeued.returncode == 0, requeued.stderr
    start_now(job_id)  # not after Slurm's two-minute delay for requeued jobs


def test_a_training_job_over_ssh_is_gathered_as_run_here(
    slurm_cluster,
    ssh_login,
    corpus,  # noqa: F811 - the fixture imported above
    tmp_path,
    capsys,
):
    """Submitted over SSH (sbatch on the "login node", the loopback sshd), the job's
    checkpoints live only there until gather fetches them: fetch passed over every dot file,
    DCP's .metadata among them, and no training job run over SSH could be gathered. Its
    losses and weights equal the same job's on local ranks (one thread each: bitwise)."""
    steps = ["task.max_steps=4", "task.checkpoint_every=2", "env.vars.OMP_NUM_THREADS=1"]
    job = submit(
        capsys,
        *_args(tmp_path / "job", corpus, "nodes=2", "tasks_per_node=1", *steps),
        *ssh_overrides(ssh_login),
        f"ssh.remote_dir={tmp_path / 'login-node'}",
        f"slurm.partition={slurm_cluster.partition}",
    )
    status = wait_for(lambda: (s := backend_status(job)).state.finished and s, 300, "the end")
    assert status.state is JobState.COMPLETED, status
    assert not (job / "checkpoints").exists()  # only on the login node until gather
    whole = tmp_path / "whole"
    assert main(["run", *_args(whole, corpus, "nodes=1", "tasks_per_node=2", *steps)]) == 0
    ours, theirs = _weights(job, tmp_path / "a"), _weights(whole, tmp_path / "b")
    assert all(torch.equal(ours[name], want) for name, want in theirs.items())
    assert _losses(job) == _losses(whole)
