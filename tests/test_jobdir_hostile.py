"""A job directory read as hostile by status, cancel, resume and the local supervisor (from a
read-only review; each case reproduced first). The job writes its own directory (its ranks
run any model code), so supervisor.pid, state.json, job.json, progress records, .lock and
attempts/ may be anything: a link, a FIFO, a record naming another process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ringctl.backends.local import LocalBackend
from ringctl.cli import main
from ringctl.errors import UserError
from ringctl.jobdir import JobDir
from ringctl.progress import read_record


def _start_time(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def _sleeper(*argv: str) -> subprocess.Popen:
    """A process of this user whose command line holds ``argv`` after a sleep."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", *argv], start_new_session=True
    )
    time.sleep(0.3)
    return proc


@pytest.fixture
def smoke(tmp_path, capsys) -> Path:
    """A finished local smoke job's directory."""
    assert main(["run", "smoke", f"output_dir={tmp_path / 'runs'}"]) == 0
    capsys.readouterr()
    (job,) = (tmp_path / "runs").iterdir()
    return job


def test_cancel_signals_only_this_jobs_supervisor(tmp_path):
    """supervisor.pid's own marker was believed: {"marker": "", "start": null} named any
    process of the user, and cancel killed it; "supervise /runs/A" was a substring of job
    A-2's supervisor's command line, and cancel of A killed A-2's."""
    job = tmp_path / "smoke-1"
    job.mkdir()
    (job / "state.json").write_text(json.dumps({"state": "RUNNING"}))
    victims = [_sleeper(), _sleeper("supervise", f"{job}-2")]
    try:
        records = [
            {"pid": victims[0].pid, "start": None, "marker": ""},
            {"pid": victims[1].pid, "start": _start_time(victims[1].pid), "marker": "x"},
        ]
        for record, victim in zip(records, victims, strict=True):
            (job / "supervisor.pid").write_text(json.dumps(record))
            LocalBackend().cancel(job)
            assert victim.poll() is None, "cancel signalled a process that is not the job's"
    finally:
        for victim in victims:
            victim.kill()
            victim.wait()


def test_control_files_that_are_pipes_or_links_are_refused_not_read(tmp_path):
    """A FIFO at state.json, job.json, supervisor.pid or a progress record hung `status` (and
    `status --root` with every other job); a .lock made a link had its target truncated."""
    job = JobDir(tmp_path / "job")
    job.path.mkdir()
    (job.path / "logs").mkdir()
    for name in ("state.json", "job.json", "supervisor.pid", "logs/progress.json"):
        os.mkfifo(job.path / name)
    assert job.read_state() is None
    with pytest.raises(UserError, match="job.json: not a regular file"):
        job.read_meta()
    notes: list[str] = []
    assert read_record(job.path / "logs" / "progress.json", notes) is None and notes
    assert LocalBackend().still_running(job) is None
    victim = tmp_path / "victim.txt"
    victim.write_text("important\n")
    (job.path / ".lock").symlink_to(victim)
    with pytest.raises(UserError, match=r"\.lock: a link, not a lock file"):
        with job.lock("cancel"):
            pass
    assert victim.read_text() == "important\n"


def test_progress_that_cannot_be_true_is_not_shown(tmp_path):
    """An ETA of -3 h, -5e18 tokens/s and 7 of 2 steps were shown as they came."""
    path = tmp_path / "progress.json"
    record = {"done": 1, "total": 2, "unit": "steps", "eta_s": -10800, "tokens_per_s": -5e18}
    path.write_text(json.dumps(record))
    notes: list[str] = []
    shown = read_record(path, notes)
    assert shown["eta_s"] is None and shown["tokens_per_s"] is None, shown
    path.write_text(json.dumps({**record, "done": 7, "eta_s": 1}))
    assert read_record(path, notes) is None and "done 7 > total 2" in notes[-1]


def test_resume_refuses_a_live_supervisor_and_a_linked_attempts_folder(smoke, tmp_path, capsys):
    """state.json saying UNKNOWN beside a live supervisor let resume start a second one on
    the same out/; attempts/ made a link sent the attempt's files wherever it pointed."""
    supervisor = _sleeper("supervise", str(smoke))
    try:
        record = {"pid": supervisor.pid, "start": _start_time(supervisor.pid), "marker": ""}
        (smoke / "supervisor.pid").write_text(json.dumps(record))
        state = json.loads((smoke / "state.json").read_text())
        (smoke / "state.json").write_text(json.dumps({**state, "state": "UNKNOWN"}))
        assert main(["resume", str(smoke)]) == 2
        assert "its supervisor (pid" in capsys.readouterr().err
    finally:
        supervisor.kill()
        supervisor.wait()
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.rmtree(smoke / "attempts", ignore_errors=True)
    (smoke / "attempts").symlink_to(outside)
    assert main(["resume", str(smoke), "--force"]) == 2
    assert "attempts: not a folder (a link?); nothing was moved" in capsys.readouterr().err
    assert list(outside.iterdir()) == [] and any((smoke / "logs").iterdir())


@pytest.mark.parametrize(
    "damage,key",
    [
        ({"state": "BOGUS"}, "state"),
        ({"state": 5}, "state"),
        ({"ranks": [1, 2]}, "ranks"),
        ({"ranks": {"x": {}}}, "ranks"),
        ({"ranks": {"0": "RUNNING"}}, "ranks"),
        ({"started_at": "yesterday"}, "started_at"),
        ({"ended_at": True}, "ended_at"),
        ({"reason": ["a"]}, "reason"),
        ({"exit_code": "0"}, "exit_code"),
    ],
)
def test_state_values_of_another_type_are_named_not_tracebacks(smoke, capsys, damage, key):
    """state.json's values were used as they came: status, cancel and resume of a job whose
    state.json said {"state": 5}, ranks as a list or a start time as text were tracebacks
    (ValueError, AttributeError, TypeError). Now status says UNKNOWN naming the key, and
    cancel leaves the file as it found it."""
    state_file = smoke / "state.json"
    state = {**json.loads(state_file.read_text()), **damage}
    state_file.write_text(json.dumps(state))
    status = LocalBackend().status(smoke)
    assert status.state.value == "UNKNOWN"
    assert status.reason.startswith(f"{state_file}: {key}: expected ")
    assert main(["status", str(smoke)]) == 1  # an UNKNOWN row: status's exit 1
    assert "UNKNOWN" in capsys.readouterr().out
    main(["cancel", str(smoke)])
    assert json.loads(state_file.read_text()) == state
