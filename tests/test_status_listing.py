"""`ringctl status` of many jobs (``ringctl.backends.listing``): each cluster is asked once
(one squeue, one sacct) and each login node connected to once, and every row says what
`ringctl status JOBDIR` of that job alone says (the reference: the same code asking for one
job). A listing of 40 Slurm jobs ran 40 squeue and 40 sacct (6.1 s on the test cluster,
1.7 s now); one of ssh jobs opened a connection per job (a second each)."""

from __future__ import annotations

import contextlib
import io
import json
import time
from pathlib import Path

import pytest

from ringctl.backends import slurm_states as ss
from ringctl.backends import ssh as ssh_backend
from ringctl.backends.shell import LocalShell
from ringctl.cli import main
from tests.local_jobs import ssh_overrides, submitted_job_dir

pytestmark = pytest.mark.slurm


def _main(*argv: str) -> tuple[int, str, str]:
    """`ringctl ARGV`: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def _status(*dirs: Path) -> list[dict]:
    code, out, err = _main("status", "--json", *map(str, dirs))
    assert code in (0, 1), err
    return json.loads(out)


def _submit(*argv: str) -> Path:
    code, out, err = _main("submit", *argv)
    assert code == 0, err
    return submitted_job_dir(out)


def _finished(dirs: list[Path], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = _status(*dirs)
        if all(r["state"] not in ("PENDING", "RUNNING", "UNKNOWN") for r in rows):
            return
        time.sleep(1)
    raise AssertionError(f"not finished after {timeout}s: {[r['state'] for r in rows]}")


class _Calls:
    """Which Slurm commands ran where, and how many SSH connections opened: a spy that
    calls the real command and the real connect."""

    def __init__(self, monkeypatch, fail_shared: bool = False) -> None:
        self.argv: list[tuple[str, list[str]]] = []
        self.connects = 0
        local_run, ssh_run, connect = LocalShell.run, ssh_backend.SSHShell.run, ssh_backend.connect

        def spy(real, where):
            def run(shell, argv, **kw):
                self.argv.append((where, list(argv)))
                shared = any(a.startswith("--jobs=") and "," in a for a in argv)
                if fail_shared and shared:
                    return 1, "", "slurm_load_jobs error: Socket timed out"
                return real(shell, argv, **kw)

            return run

        def counted(settings):
            self.connects += 1
            return connect(settings)

        monkeypatch.setattr(LocalShell, "run", spy(local_run, "here"))
        monkeypatch.setattr(ssh_backend.SSHShell, "run", spy(ssh_run, "ssh"))
        monkeypatch.setattr(ssh_backend, "connect", counted)

    def count(self, where: str, command: str) -> int:
        return sum(1 for w, argv in self.argv if w == where and argv[0] == command)


@pytest.fixture(scope="module")
def listed_jobs(slurm_cluster, ssh_login, tmp_path_factory) -> list[Path]:
    """Three Slurm jobs (one whose rank 1 fails) and two ssh jobs, finished."""
    out = tmp_path_factory.mktemp("listing")
    part = f"slurm.partition={slurm_cluster.partition}"
    shape = ["nodes=1", "tasks_per_node=2", f"output_dir={out}", part, "ring.placement=skip"]
    fails = ["task.fault_rank=1", "task.fault=raise"]
    ssh = ssh_overrides(ssh_login)
    dirs = [
        _submit("jobs/smoke.yaml", "backend=slurm", *shape),
        _submit("jobs/smoke.yaml", "backend=slurm", *shape, *fails),
        _submit("jobs/smoke.yaml", "backend=slurm", *shape, "name=other"),
        _submit("jobs/smoke.yaml", *ssh, *shape),
        _submit("jobs/smoke.yaml", *ssh, *shape, *fails),
    ]
    _finished(dirs)
    return dirs


def test_a_listing_asks_each_cluster_once_and_says_what_each_job_alone_says(
    listed_jobs, monkeypatch
):
    alone = [row for d in listed_jobs for row in _status(d)]
    assert [r["state"] for r in alone] == ["COMPLETED", "FAILED", "COMPLETED"] + [
        "COMPLETED",
        "FAILED",
    ]
    calls = _Calls(monkeypatch)
    listed = _status(*listed_jobs)
    assert listed == alone
    assert calls.count("here", "squeue") == 1 and calls.count("here", "sacct") == 1
    assert calls.count("ssh", "squeue") == 1 and calls.count("ssh", "sacct") == 1
    assert calls.connects == 1  # one connection for both ssh jobs, closed at the end


def test_a_listing_whose_shared_question_fails_asks_for_each_job(listed_jobs, monkeypatch):
    """squeue or sacct failing for the listing's shared question: each job asks for itself,
    as before, and the rows are the same."""
    alone = [row for d in listed_jobs for row in _status(d)]
    calls = _Calls(monkeypatch, fail_shared=True)
    assert _status(*listed_jobs) == alone
    assert calls.count("here", "squeue") == 1 + 3 and calls.count("ssh", "sacct") == 1 + 2


def test_a_shared_sacct_keeps_the_runs_this_job_s_own_would():
    """One sacct for the listing is asked from its earliest job's start: an older job that
    had the same id (ids restart when a controller's state is lost) ended before this job's
    sacct_since and is not its run; the requeued runs after it are."""
    out = SACCT.format(id="77")
    runs = ss.runs_ended_since(out, "77", "2026-12-05T13:58:00")
    assert [run[0].raw_state for run in runs] == ["NODE_FAIL", "RUNNING"]
    # a step that ended before it is not shown either (sacct drops it: second reading)
    assert [r.step for r in runs[0]] == [None, "1"]
    assert len(ss.runs_ended_since(out, "77", None)) == 3  # from the start: every run
    assert ss.runs_ended_since(out, "78", "2026-12-05T13:58:00") == []
    # an end sacct prints in another format (SLURM_TIME_FORMAT): the job asks for itself
    other = out.replace("2026-11-01T10:00:04", "11/01 10:00")
    assert ss.runs_ended_since(other, "77", "2026-12-05T13:58:00") is None
    # a start time that is not a real one: the job asks for itself
    for since in ("2026-11-31T23:00:00", "garbage", 5):
        assert ss.runs_ended_since(out, "77", since) is None


@pytest.mark.parametrize("since", ["garbage", 5, "2026-11-31T23:00:00"])
def test_a_hostile_start_time_beside_the_same_job_leaves_both_rows_as_alone(
    listed_jobs, tmp_path, since
):
    """(second reading) A job.json whose sacct_since is not a real time ringctl wrote (text,
    a number, November 31st, which sacct reads as December 1st) beside another directory of
    the same job: the hostile one took the listing's answer and filtered it by its own value
    (a TypeError row, or another reason than alone). It asks alone; so does the time of a
    shared question not take it."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(listed_jobs[0], copy, symlinks=True)
    meta = json.loads((copy / "job.json").read_text())
    meta["sacct_since"] = since
    (copy / "job.json").write_text(json.dumps(meta))
    for dirs in ((copy, listed_jobs[0]), (listed_jobs[0], copy)):  # either taking first
        alone = [row for d in dirs for row in _status(d)]
        assert _status(*dirs) == alone
        assert "TypeError" not in json.dumps(alone)


def test_a_job_id_longer_than_slurm_s_leaves_the_other_rows_as_alone(listed_jobs, tmp_path):
    """(hostile-input review) A job.json whose job_id is 5,000 digits beside a real job: the
    listing's shared squeue sorted the ids as numbers, which Python refuses past 4,300 digits,
    and every Slurm row of the listing was UNKNOWN with a ValueError for its reason. Slurm's
    ids are 32-bit: at most 10 digits are an id; the copy's own row names its job.json."""
    import shutil

    copy = tmp_path / "long-id"
    shutil.copytree(listed_jobs[0], copy, symlinks=True)
    meta = json.loads((copy / "job.json").read_text())
    meta["job_id"] = "9" * 5000
    (copy / "job.json").write_text(json.dumps(meta))
    alone = _status(listed_jobs[0])
    rows = _status(listed_jobs[0], copy)
    assert rows[0] == alone[0] and alone[0]["state"] == "COMPLETED"
    assert "ValueError" not in json.dumps(rows) and "job.json" in rows[1]["reason"]


def test_a_dropped_connection_is_made_again_for_the_next_job(ssh_login):
    """(second reading) The listing handed out its kept connection without asking whether
    it stood: a login node that dropped it (an sshd restart, an idle timeout) failed every
    later job's row."""
    from ringctl.backends.listing import listing
    from ringctl.backends.ssh import SSHBackend, SSHSettings

    settings = SSHSettings(
        host=ssh_login.host,
        port=ssh_login.port,
        user=ssh_login.user,
        key=ssh_login.key,
        known_hosts=ssh_login.known_hosts,
        connect_timeout=5,
    )
    with listing([]):
        first = SSHBackend(settings)
        shell = first.shell
        assert shell.run(["true"])[0] == 0
        first.close()
        assert SSHBackend(settings).shell is shell  # kept for the next job
        shell.client.get_transport().close()  # dropped by the login node
        again = SSHBackend(settings).shell
        assert again is not shell and again.run(["true"])[0] == 0


SACCT = """\
{id}|smoke|COMPLETED|0:0|4|None|n1|2026-11-01T10:00:00|2026-11-01T10:00:04
{id}.batch|batch|COMPLETED|0:0|4||n1|2026-11-01T10:00:00|2026-11-01T10:00:04
{id}|smoke|NODE_FAIL|0:0|9|None|n2|2026-12-05T13:57:00|2026-12-05T14:00:09
{id}.0|python|FAILED|1:0|1||n2|2026-12-05T13:57:00|2026-12-05T13:57:30
{id}.1|python|CANCELLED|0:15|9||n2|2026-12-05T13:59:00|2026-12-05T14:00:09
{id}|smoke|RUNNING|0:0|30|None|n3|2026-12-05T14:01:00|Unknown
"""
