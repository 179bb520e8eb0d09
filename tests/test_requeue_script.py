"""The batch script's requeue block (templates/slurm.sh.j2), run under bash as Slurm's rerun of
job 7 would run it (SLURM_RESTART_COUNT=1), without Slurm: the rendered script up to its
environment section, in a job directory planted with the earlier run's files.

It moves the earlier run's logs to attempts/requeue-7-1/. Before the fix it moved every name
in logs/ (`logs/*`), through a symlinked logs/ (emptying the link's target), truncated
whatever a symlinked batch log pointed to, and kept the copy wherever a symlinked attempts/
pointed. tests/test_slurm_requeue.py runs the same block on the real cluster after a node
failure.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ringctl.config import load_job
from ringctl.render import render_script

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "jobs" / "smoke.yaml")
KEPT = "attempts/requeue-7-1"
# what ringctl's job writes into logs/ (ringctl.jobdir); Slurm appends to logs/batch-<id>.out
OURS = [
    "rank-0.out",
    "rank-0.err",
    "rank-0.result.json",
    "progress.json",
    "rings",
    "probe-n1.out",
    "placement.log",
]


def _rerun_head() -> str:
    """The rendered script up to (not including) its environment section."""
    script = render_script(load_job(SMOKE, ["backend=slurm"]))
    head, sep, _ = script.partition("# --- environment")
    assert sep and "SLURM_RESTART_COUNT" in head
    return head


def _job(tmp_path: Path) -> Path:
    """A job directory after a first run of job 7, with a file in logs/ that is not ours."""
    job = tmp_path / "job"
    (job / "logs" / "rings").mkdir(parents=True)
    (job / "config.yaml").write_text("name: smoke\n")
    (job / "placement.json").write_text("{}\n")
    for name in OURS:
        if name != "rings":
            (job / "logs" / name).write_text(f"first run: {name}\n")
    (job / "logs" / "rings" / "ring-1x0.json").write_text("{}\n")
    (job / "logs" / "batch-7.out").write_text("first run: batch\n")
    (job / "logs" / "notes.txt").write_text("the user's\n")
    return job


def _rerun(job: Path) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ["PATH"], "SLURM_RESTART_COUNT": "1", "SLURM_JOB_ID": "7"}
    return subprocess.run(
        ["bash", "-c", _rerun_head()], cwd=job, env=env, capture_output=True, text=True, timeout=60
    )


def test_a_rerun_keeps_the_earlier_runs_logs_and_only_those(tmp_path):
    job = _job(tmp_path)
    proc = _rerun(job)
    assert proc.returncode == 0, proc.stderr
    assert "Slurm reran job 7 (restart 1)" in proc.stdout
    kept = job / KEPT
    assert sorted(p.name for p in (kept / "logs").iterdir()) == sorted([*OURS, "batch-7.out"])
    assert (kept / "logs" / "rank-0.out").read_text() == "first run: rank-0.out\n"
    assert (kept / "logs" / "batch-7.out").read_text() == "first run: batch\n"
    assert (kept / "logs" / "rings" / "ring-1x0.json").is_file()
    assert (kept / "placement.json").is_file() and not (job / "placement.json").exists()
    # left: the batch log, emptied for this run, and what ringctl did not write
    assert sorted(p.name for p in (job / "logs").iterdir()) == ["batch-7.out", "notes.txt"]
    assert (job / "logs" / "batch-7.out").read_text() == ""


def _plant(job: Path, tmp_path: Path, which: str) -> Path:
    """Make logs/, the batch log or attempts/ a link to a place outside the job directory."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if which == "logs":
        os.rename(job / "logs", elsewhere / "logs")
        (job / "logs").symlink_to(elsewhere / "logs")
    elif which == "batch log":
        (elsewhere / "precious.txt").write_text("not a log\n")
        (job / "logs" / "batch-7.out").unlink()
        (job / "logs" / "batch-7.out").symlink_to(elsewhere / "precious.txt")
    else:
        (job / "attempts").symlink_to(elsewhere)
    return elsewhere


@pytest.mark.parametrize("which", ["logs", "batch log", "attempts"])
def test_a_rerun_moves_nothing_through_a_symlink(tmp_path, which):
    job = _job(tmp_path)
    elsewhere = _plant(job, tmp_path, which)
    before = {p: p.read_bytes() for p in elsewhere.rglob("*") if p.is_file()}
    proc = _rerun(job)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    name = {"logs": "logs", "batch log": "logs/batch-7.out", "attempts": "attempts"}[which]
    assert f"ringctl-job: FAILED: {name} is a symbolic link in {job}" in proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    after = {p: p.read_bytes() for p in elsewhere.rglob("*") if p.is_file()}
    assert after == before  # nothing moved out of, into or over the link's target
    assert not (job / KEPT).exists() and (job / "placement.json").is_file()
