"""A disk that fills right after the backend queued a job: job.json cannot take the job's id.

Before the fix the OSError went up as a bare "No space left on device" (and, where the
backend wrote job.json itself, submit then deleted the directory of a job that was queued):
the job ran with nothing naming it. Now one line says which job was submitted, which file
could not record it, and how to cancel it; the directory stays. The disk is a real small
tmpfs (root only, as in tests/test_cli_hardening.py), filled at the moment named.
"""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import pytest

from ringctl.backends.local import LocalBackend
from ringctl.backends.slurm import SlurmBackend
from ringctl.cli import main
from ringctl.errors import SubmittedNotRecorded
from tests.local_jobs import wait_for

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "jobs" / "smoke.yaml")
QUICK = ["nodes=1", "env.python=/bin/true"]  # ranks that exit at once


@contextlib.contextmanager
def _small_disk(path: Path):
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        umount = ["umount", str(path)]
        wait_for(lambda: subprocess.run(umount, capture_output=True).returncode == 0, 30, "umount")


def _fill(disk: Path) -> None:
    with open(disk / "filler", "wb", buffering=0) as fh, contextlib.suppress(OSError):
        while True:
            fh.write(b"\0" * 4096)


def _filled_after(monkeypatch, cls, method: str, disk: Path) -> None:
    """cls.method fills the disk once it has run: the moment the job is queued."""
    real = getattr(cls, method)

    def then_fill(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        _fill(disk)
        return result

    monkeypatch.setattr(cls, method, then_fill)


def _job_dir(disk: Path) -> Path:
    (job_dir,) = [p for p in (disk / "runs").iterdir() if not p.name.startswith(".")]
    return job_dir


def test_local_submit_names_the_job_and_how_to_cancel_it(tmp_path, capsys, monkeypatch):
    with _small_disk(tmp_path / "disk") as disk:
        _filled_after(monkeypatch, LocalBackend, "submit", disk)
        assert main(["submit", SMOKE, f"output_dir={disk}/runs", *QUICK]) == 1
        err = capsys.readouterr().err
        job_dir = _job_dir(disk)
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith("ringctl submit: error: submitted job local-"), err
        assert f"could not record it in {job_dir}/job.json: No space left on device" in err
        assert f"; cancel it with `ringctl cancel {job_dir}` if unwanted" in err
        (disk / "filler").unlink()
        assert main(["cancel", str(job_dir)]) == 0  # the line's command works
        assert LocalBackend().status(job_dir).state.finished


def test_slurm_submit_names_the_job_and_its_scancel(slurm_cluster, tmp_path, monkeypatch):
    """The slurm backend records the id itself right after sbatch (here the disk fills as
    sbatch queues the job): before the fix the error also made submit delete the directory of
    the queued job. The cluster's clock is asked after the id is recorded (a Ctrl-C while a
    slow login node answered removed the directory: tests/test_job_verbs_review.py)."""
    with _small_disk(tmp_path / "disk") as disk:
        job_dir = disk / "job"
        (job_dir / "logs").mkdir(parents=True)
        (job_dir / "job.sh").write_text("#!/bin/bash\n#SBATCH --time=1\ntrue\n")
        _filled_after(monkeypatch, SlurmBackend, "_run", disk)  # sbatch's run
        held = SlurmBackend(sbatch_args=["--hold"])  # never starts: nothing opens the tmpfs
        with pytest.raises(SubmittedNotRecorded) as caught:
            held.submit(job_dir)
        message = str(caught.value)
        job_id = message.split()[2].rstrip(",")
        assert message == (
            f"submitted job {job_id}, but could not record it in {job_dir}/job.json: No space "
            f"left on device; cancel it with `scancel {job_id}` if unwanted"
        )
        assert caught.value.exit_code == 1 and job_dir.is_dir()
        subprocess.run(["scancel", job_id], check=True, timeout=30)  # the line's command
        gone = ["squeue", "-h", "-j", job_id, "-t", "PENDING,RUNNING"]
        wait_for(lambda: subprocess.run(gone, capture_output=True).stdout == b"", 30, "scancel")


def test_local_supervisor_is_stopped_when_its_pid_cannot_be_recorded(tmp_path, capsys, monkeypatch):
    """supervisor.pid is what `ringctl cancel` signals: a supervisor started on a disk that
    fills before it is written could not be cancelled, and submit then deleted its directory
    under it. Now it is killed, and the line names supervisor.pid."""
    from ringctl.backends import local

    started = []
    real = local.ProcessRecord.of

    def then_fill(pid, marker):
        started.append(pid)
        record = real(pid, marker)
        _fill(disk)
        return record

    with _small_disk(tmp_path / "disk") as disk:
        monkeypatch.setattr(local.ProcessRecord, "of", then_fill)
        assert main(["submit", SMOKE, f"output_dir={disk}/runs", *QUICK]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.rstrip().endswith(
            "/supervisor.pid: No space left on device"
        ), err
        assert [p for p in (disk / "runs").iterdir()] == []  # no half job directory
        (pid,) = started
        assert not Path(f"/proc/{pid}").exists()  # killed and reaped: nothing runs
