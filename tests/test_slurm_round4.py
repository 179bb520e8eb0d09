"""Issue 26's low findings on the real test cluster (Slurm 22.05, four slurmd on this machine):

* `SLURM_RESTART_COUNT` set in the submitting shell reached the job (sbatch exports the
  environment): a first run said "Slurm reran job 7 (restart 3)" and made an empty
  attempts/requeue-7-3. The script now reads Slurm's own count;
* `status` of a requeued job pointed at attempts/requeue-<id>-<k> before the rerun made it, and
  after the rerun refused to (a symlinked attempts/), and did not show that run's FAILED
  reason (srun lines of the run before were blamed);
* a SIGKILLed rank's reason was srun's "killed" and its last stderr line, a progress bar.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ringctl.backends.base import JobState
from ringctl.cli import main
from tests.local_jobs import submit, wait_for
from tests.test_hardening_round4 import _killing_python
from tests.test_slurm_requeue import (
    _job_id,
    _started,
    _status,
    job_field,
    scontrol,
    start_now,
)

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "jobs" / "smoke.yaml")


def _job_dir(out: str) -> Path:
    return Path(out.split("job directory: ")[1].strip())


def test_a_restart_count_from_the_submitting_shell_is_not_believed(
    slurm_cluster, tmp_path, capsys, monkeypatch
) -> None:
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    args = [SMOKE, "backend=slurm", f"output_dir={tmp_path}", "nodes=1", "tasks_per_node=2"]
    assert main(["run", *args]) == 0, capsys.readouterr().err
    job = _job_dir(capsys.readouterr().out)
    job_id = _job_id(job)
    batch = (job / "logs" / f"batch-{job_id}.out").read_text()
    assert "Slurm reran" not in batch and "starting 2 ranks" in batch, batch
    assert not (job / "attempts").exists()


def test_a_job_name_saying_restarts_fakes_no_rerun(slurm_cluster, tmp_path, capsys) -> None:
    """The script read its restart count from `scontrol show job`'s text, where the job's
    name comes first: a job named "x Restarts=3" said "Slurm reran job (restart 3)" on its
    first run, and its first real requeue then failed (attempts/requeue-ID-3 existed)."""
    args = [SMOKE, "backend=slurm", f"output_dir={tmp_path}", "nodes=1", "tasks_per_node=2"]
    assert main(["run", *args, "name=x Restarts=3"]) == 0, capsys.readouterr().err
    job = _job_dir(capsys.readouterr().out)
    batch = (job / "logs" / f"batch-{_job_id(job)}.out").read_text()
    assert "Slurm reran" not in batch and "starting 2 ranks" in batch, batch
    assert not (job / "attempts").exists()


def test_a_sigkilled_rank_is_said_so_without_its_progress_bar(
    slurm_cluster, tmp_path, capsys
) -> None:
    python = _killing_python(tmp_path)
    args = [SMOKE, "backend=slurm", f"output_dir={tmp_path}", "nodes=1", "tasks_per_node=2"]
    assert main(["run", *args, f"env.python={python}"]) == 1
    line = next(ln for ln in capsys.readouterr().err.splitlines() if " FAILED" in ln)
    assert "killed by signal 9 (SIGKILL)" in line, line
    assert "Loading weights" not in line and "100%" not in line, line


def test_status_of_a_requeued_job_says_where_its_logs_are_and_why_it_failed(
    slurm_cluster, tmp_path, capsys
) -> None:
    job = submit(
        capsys,
        SMOKE,
        "backend=slurm",
        f"output_dir={tmp_path}",
        "name=requeue-status",
        "nodes=1",
        "tasks_per_node=2",
        "task.fault_rank=0",
        "task.fault=hang",
        "timeout=600",
        "slurm.time=00:10:00",
        "slurm.requeue=true",
    )
    job_id = _job_id(job)
    kept = f"attempts/requeue-{job_id}-1"
    try:
        wait_for(lambda: _started(job), 120, "the job to start")
        scontrol("requeue", job_id)
        wait_for(lambda: job_field(job_id, "Restarts") == "1", 60, "the requeue")
        status = _status(job)
        assert not status.state.finished, status  # completing the first run, or pending
        assert f"run 1 of job {job_id} " in status.reason, status
        assert f"its logs are not kept ({kept} not made" in status.reason, status
        assert f"its logs are in {kept}" not in status.reason

        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        (job / "attempts").symlink_to(elsewhere)  # the rerun must refuse to move through it
        start_now(job_id)
        # the first run's own records can read FAILED before the rerun's script has ended:
        # wait for the rerun's word (its FAILED line), then check the rest
        try:
            status = wait_for(
                lambda: (s := _status(job)).state.finished and "symbolic link" in s.reason and s,
                180,
                "the rerun to end, refusing the symbolic link",
            )
        except AssertionError as err:
            batch = job / "logs" / f"batch-{job_id}.out"
            said = batch.read_text() if batch.exists() else "(no batch log)"
            shown = scontrol("show", "job", job_id, check=False)
            raise AssertionError(f"{err}\n{_status(job)}\n{shown}\n{said}") from None
        assert status.state is JobState.FAILED, status
        assert status.reason.startswith(f"attempts is a symbolic link in {job.resolve()}: "), status
        assert f"its logs are not kept ({kept} not made" in status.reason, status
        assert list(elsewhere.iterdir()) == []
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)


def test_a_wrapper_that_swallows_a_failed_ranks_exit_fails_the_slurm_job(
    slurm_cluster, tmp_path, capsys
) -> None:
    """Every step exited 0 (the env.python wrapper ran the worker, then `exit 0`) and every
    rank left a result, so status read COMPLETED; rank 1's result said FAILED. The failed
    rank's `.failed` mark shows it in the one listing of logs/ status makes."""
    wrapper = tmp_path / "python-wrapper.sh"
    wrapper.write_text(f'#!/bin/bash\n"{sys.executable}" "$@"\nexit 0\n')
    wrapper.chmod(0o755)
    args = [SMOKE, "backend=slurm", f"output_dir={tmp_path}", "nodes=1", "tasks_per_node=2"]
    fault = ["task.steps=2", "task.fault_rank=1", "task.fault=raise", f"env.python={wrapper}"]
    assert main(["run", *args, *fault]) == 1
    line = next(ln for ln in capsys.readouterr().err.splitlines() if " FAILED" in ln)
    assert "rank 1 exited 0 (its result says FAILED)" in line, line
