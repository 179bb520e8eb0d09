"""The local backend's process lifecycle (a read-only review's findings, each reproduced): a
wrapper that swallowed a failed rank's exit made the job COMPLETED; a wrapper that runs the
worker without exec left it running after cancel (and beside a resumed ring); resume never
stopped an earlier attempt's workers; the job's warning signal killed the supervisor before
the ranks could save; SIGTERM to the job's group read FAILED instead of CANCELLED.

Real local jobs (the bundled smoke task on two ranks), real signals, real processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ringctl.backends import local
from ringctl.backends.base import JobState
from ringctl.cli import main
from ringctl.jobdir import JobDir
from ringctl.submission import resume_job
from tests.local_jobs import submitted_job_dir, wait_for
from tests.test_cli_review import _job_dir

pytestmark = pytest.mark.timeout(180)
LONG = ["nodes=2", "timeout=30", "task.steps=100000"]


def _wrapper(tmp_path: Path, after: str) -> Path:
    """An env.python that runs this interpreter without exec, then ``after``."""
    path = tmp_path / "python-wrapper.sh"
    path.write_text(f'#!/bin/bash\n"{sys.executable}" "$@"\n{after}\n')
    path.chmod(0o755)
    return path


def _submit(tmp_path: Path, capsys, *overrides: str) -> Path:
    capsys.readouterr()
    assert main(["submit", "smoke", f"output_dir={tmp_path / 'out'}", *overrides]) == 0
    return submitted_job_dir(capsys.readouterr().out)


def _stepping(job: Path) -> bool:
    progress = job / "logs" / "progress.json"
    return progress.is_file() and json.loads(progress.read_text() or "{}").get("done", 0) > 0


def _workers(job: Path) -> list[int]:
    """Processes whose command line runs the worker on this job."""
    marker = ["-m", "ringctl.worker", str(job.resolve())]
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if any(argv[i : i + 3] == marker for i in range(len(argv))):
                found.append(int(entry.name))
    return found


def _supervisor_pid(job: Path) -> int:
    return json.loads((job / "supervisor.pid").read_text())["pid"]


def test_a_wrapper_that_swallows_a_failed_ranks_exit_fails_the_job(tmp_path, capsys) -> None:
    wrapper = _wrapper(tmp_path, "echo wrapper done")
    argv = ["run", "smoke", f"output_dir={tmp_path / 'out'}", "nodes=2", "task.steps=2"]
    fault = ["task.fault_rank=1", "task.fault=raise", f"env.python={wrapper}"]
    started = time.monotonic()
    assert main([*argv, *fault]) == 1
    err = capsys.readouterr().err
    assert "FAILED" in err and "rank 1 exited 0 (its result says FAILED)" in err, err
    assert time.monotonic() - started < 60  # the peer was stopped, not left to its timeout


def test_cancel_reaches_a_worker_its_wrapper_did_not_exec(tmp_path, capsys) -> None:
    job = _submit(tmp_path, capsys, *LONG, f"env.python={_wrapper(tmp_path, 'exit $?')}")
    try:
        wait_for(lambda: _stepping(job), 60, "step")
        assert main(["cancel", str(job)]) == 0
        wait_for(lambda: not _workers(job), 15, "end of the workers after cancel")
    finally:
        for pid in _workers(job):
            os.kill(pid, signal.SIGKILL)


def test_resume_stops_an_earlier_attempts_worker(tmp_path) -> None:
    """state.json names a worker still running (it outlived its supervisor); resume moved
    state.json to attempts/N first and then found none to stop."""
    job = _job_dir(tmp_path, "smoke", {"state": "FAILED", "reason": "x"})
    marker = local.worker_marker(JobDir(job), local.EXEC)
    leftover = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(300)", *marker.split(" ")]
    )
    try:
        wait_for(lambda: local.ProcessRecord.of(leftover.pid, marker).alive(), 10, "exec")
        start = local.ProcessRecord.of(leftover.pid, marker).start
        ranks = {"0": {"pid": leftover.pid, "start": start, "launch": local.EXEC}}
        (job / "state.json").write_text(json.dumps({"state": "FAILED", "ranks": ranks}))
        resume_job(job)
        assert leftover.wait(timeout=15) == -signal.SIGKILL
    finally:
        leftover.kill()
        leftover.wait()
        local.LocalBackend().wait(job, timeout=120)


@pytest.mark.parametrize("send", [os.killpg, os.kill], ids=["to the group", "to the supervisor"])
def test_the_warning_signal_to_the_jobs_group_stops_the_ranks_with_their_work(
    send, tmp_path, capsys
) -> None:
    """Slurm's warning signal (SIGUSR1) sent to the job's process group: it killed the
    supervisor, and every rank with it before it could save. Sent to the supervisor alone
    (a user's `kill -USR1 PID`), it was ignored: the job ran to its end."""
    job = _submit(tmp_path, capsys, *LONG)
    wait_for(lambda: _stepping(job), 60, "step")
    send(_supervisor_pid(job), signal.SIGUSR1)
    status = local.LocalBackend().wait(job, timeout=60)
    assert status.state is JobState.FAILED and "stopped on request" in status.reason, status
    assert len(list((job / "logs").glob("rank-*.result.json"))) == 2


def test_sigterm_to_the_jobs_group_is_a_cancel(tmp_path, capsys) -> None:
    """A shutdown or `kill -- -PGID`: the ranks die of the same SIGTERM the supervisor takes
    as a cancel; they were recorded as failures and the job FAILED."""
    job = _submit(tmp_path, capsys, *LONG)
    wait_for(lambda: _stepping(job), 60, "step")
    os.killpg(_supervisor_pid(job), signal.SIGTERM)
    status = local.LocalBackend().wait(job, timeout=60)
    assert status.state is JobState.CANCELLED, status
    ranks = json.loads((job / "state.json").read_text())["ranks"]
    assert {r["state"] for r in ranks.values()} == {"CANCELLED"}, ranks


def test_a_ctrl_c_before_the_supervisor_is_recorded_leaves_nothing_running(
    tmp_path, monkeypatch
) -> None:
    """submit deletes the job directory of a submission that failed; a Ctrl-C after the
    supervisor started and before supervisor.pid named it left the supervisor (its own
    session: the terminal's SIGINT never reached it) running the job in a deleted directory,
    with nothing to cancel it by."""
    from ringctl.submission import submit_job

    started: list[int] = []

    def interrupted(pid: int, marker: str):
        started.append(pid)
        raise KeyboardInterrupt

    monkeypatch.setattr(local.ProcessRecord, "of", staticmethod(interrupted))
    with pytest.raises(KeyboardInterrupt):
        submit_job("smoke", [f"output_dir={tmp_path / 'out'}", *LONG])
    assert started and not list((tmp_path / "out").glob("*"))
    gone = lambda: not Path(f"/proc/{started[0]}").exists()  # noqa: E731 - reaped by wait
    assert gone(), "the supervisor still runs"


def test_the_warning_handler_is_in_place_before_torch_is_imported(tmp_path, monkeypatch) -> None:
    """A rank installed its warning handler after importing torch (seconds): a warning
    signal that came meanwhile killed it (SIGUSR1's default) before it could save. The
    handler is now in place right after the config is read, before the rank's identity."""
    from ringctl import worker

    job = _job_dir(tmp_path, "smoke", {"state": "RUNNING"})
    seen = []

    def identify(job_dir):
        seen.append(signal.getsignal(signal.SIGUSR1))
        raise RuntimeError("stop here")

    monkeypatch.setattr(worker, "identify", identify)
    previous = signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    try:
        with pytest.raises(RuntimeError, match="stop here"):
            worker.run(job)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert callable(seen[0]) and seen[0].__name__ == "on_signal"
