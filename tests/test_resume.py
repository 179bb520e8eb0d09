"""Resume, cancel and status against what really runs: resume on every backend (the real Slurm
cluster and the loopback sshd), concurrent resumes, workers that outlive a killed supervisor,
and a supervisor.pid that names somebody else's process."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ringctl.backends.base import JobState
from ringctl.cli import main
from ringctl.errors import UserError
from ringctl.submission import open_job_dir
from tests.local_jobs import submit, wait_for

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "jobs" / "smoke.yaml")
ONCE = ["task.fault_rank=1", "task.fault=raise-once", "timeout=60", "task.steps=1"]


def _final(job_dir: Path, timeout: float = 180):
    _, _, backend = open_job_dir(job_dir)
    try:
        return backend.wait(job_dir, timeout=timeout, poll_s=0.3)
    finally:
        backend.close()


def _refused_resume_changes_nothing(job_dir: Path, capsys) -> None:
    """sbatch refusing a resume (here a partition that does not exist) left the attempt moved,
    config.yaml rewritten and job.json without an id: every verb then said "no job id in
    job.json", a training job's checkpoints out of reach. The directory is put back."""
    before = {p.name: p.read_bytes() for p in (job_dir / "config.yaml", job_dir / "job.json")}
    logs = sorted(p.name for p in (job_dir / "logs").iterdir())
    capsys.readouterr()
    assert main(["resume", str(job_dir), "slurm.partition=nopart"]) == 2
    err = capsys.readouterr().err
    assert (
        "sbatch refused the job" in err and "the resume was not submitted, nothing changed" in err
    )
    assert {
        p.name: p.read_bytes() for p in (job_dir / "config.yaml", job_dir / "job.json")
    } == before
    assert sorted(p.name for p in (job_dir / "logs").iterdir()) == logs
    assert not (job_dir / "attempts" / "1").exists()
    assert main(["status", str(job_dir)]) == 0 and "FAILED" in capsys.readouterr().out


def _resume_and_check(job_dir: Path, capsys) -> None:
    first = _final(job_dir)
    assert first.state is JobState.FAILED and "injected fault" in first.reason, first
    _refused_resume_changes_nothing(job_dir, capsys)
    capsys.readouterr()
    assert main(["resume", str(job_dir)]) == 0, capsys.readouterr().err
    second = _final(job_dir)
    assert second.state is JobState.COMPLETED, second
    assert (job_dir / "attempts" / "1" / "logs").is_dir()
    meta = json.loads((job_dir / "job.json").read_text())
    assert [a["state"] for a in meta["attempts"]] == ["FAILED"]
    capsys.readouterr()
    assert main(["logs", str(job_dir), "--rank", "0"]) == 0
    assert "ring rank 0 of" in capsys.readouterr().out
    assert main(["resume", str(job_dir)]) == 2  # COMPLETED: asks for --force, changes nothing
    assert not (job_dir / "attempts" / "2").exists()


@pytest.mark.slurm
def test_a_submission_that_may_have_been_queued_keeps_its_directory(
    slurm_cluster, tmp_path, capsys, monkeypatch
):
    """sbatch queues the job and prints no id (as when its answer is lost: a timeout, an ssh
    channel closed): submit deleted the job directory the queued job then ran in. It is kept,
    says so, and every verb gives the way on; `resume --force` runs it, once looked at."""
    real = shutil.which("sbatch")
    shim = tmp_path / "bin" / "sbatch"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\n"{real}" "$@" > "{tmp_path}/queued-id"\n')
    shim.chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim.parent}:{os.environ['PATH']}")
    capsys.readouterr()
    argv = [SMOKE, "backend=slurm", f"output_dir={tmp_path / 'jobs'}", "task.steps=1"]
    assert main(["submit", *argv]) == 2
    err = capsys.readouterr().err
    [job_dir] = (tmp_path / "jobs").iterdir()
    assert "sbatch printed no job id" in err and "the job may have been queued" in err, err
    assert f"its directory {job_dir} is kept" in err and "resume --force" in err
    queued = (tmp_path / "queued-id").read_text().strip()
    assert queued.isdigit()  # sbatch did queue it, into the directory now kept
    monkeypatch.undo()
    for verb in ("status", "resume"):  # resume: not before the queue is looked at
        assert main([verb, str(job_dir)]) == 2
        assert "the last submission may have been queued" in capsys.readouterr().err
    subprocess.run(["scancel", queued], check=True)
    assert main(["resume", "--force", str(job_dir)]) == 0, capsys.readouterr().err
    assert _final(job_dir).state is JobState.COMPLETED
    assert "submission_unknown" not in json.loads((job_dir / "job.json").read_text())


@pytest.mark.slurm
def test_resume_on_slurm(slurm_cluster, tmp_path, capsys):
    job_dir = submit(capsys, SMOKE, "backend=slurm", f"output_dir={tmp_path}", "nodes=2", *ONCE)
    _resume_and_check(job_dir, capsys)


@pytest.mark.ssh
def test_resume_over_ssh(slurm_cluster, ssh_login, tmp_path, capsys):
    login = [
        "backend=ssh",
        f"ssh.host={ssh_login.host}",
        f"ssh.port={ssh_login.port}",
        f"ssh.user={ssh_login.user}",
        f"ssh.key={ssh_login.key}",
        f"ssh.known_hosts={ssh_login.known_hosts}",
        f"ssh.remote_dir={tmp_path / 'remote'}",
    ]
    job_dir = submit(capsys, SMOKE, *login, f"output_dir={tmp_path / 'local'}", "nodes=2", *ONCE)
    remote = tmp_path / "remote" / job_dir.name
    _final(job_dir)
    remote_logs = sorted(p.name for p in (remote / "logs").iterdir())
    _resume_and_check(job_dir, capsys)  # a refused resume first: the login node's copy too
    assert (remote / "attempts" / "1" / "logs").is_dir() and (remote / "logs").is_dir()
    assert sorted(p.name for p in (remote / "attempts" / "1" / "logs").iterdir()) == remote_logs
    # the job writes its remote directory: an attempts/ made a link had the logs moved there
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.rmtree(remote / "attempts")
    (remote / "attempts").symlink_to(elsewhere)
    capsys.readouterr()
    assert main(["resume", "--force", str(job_dir)]) == 2
    assert "attempts is not a folder (a link?); nothing was moved" in capsys.readouterr().err
    assert not any(elsewhere.iterdir()) and (remote / "logs").is_dir()
    # `run` over ssh ended COMPLETED with an empty out/ here and no word of fetching
    capsys.readouterr()
    run = ["run", SMOKE, *login, f"job_dir={tmp_path / 'local' / 'ran'}", "nodes=2"]
    assert main([*run, "task.steps=1"]) == 0
    assert "its files are on the login node: `ringctl fetch " in capsys.readouterr().out


@pytest.mark.parametrize("backend", ["local", pytest.param("slurm", marks=pytest.mark.slurm)])
def test_ranks_that_leave_no_result_fail_the_job(backend, request, tmp_path, capsys):
    """`resume env.python=/bin/true`: every rank exits 0 having run nothing. Before the fix the
    job read COMPLETED (local and Slurm alike); a rank without its result is a failed job."""
    if backend == "slurm":
        request.getfixturevalue("slurm_cluster")
    job_dir = submit(
        capsys, SMOKE, f"backend={backend}", f"output_dir={tmp_path}", "nodes=2", *ONCE
    )
    assert _final(job_dir).state is JobState.FAILED
    capsys.readouterr()
    assert main(["resume", str(job_dir), "env.python=/bin/true"]) == 0, capsys.readouterr().err
    second = _final(job_dir)
    assert second.state is JobState.FAILED, second
    assert second.reason.startswith("ranks 0, 1 (of 2) ended without a result"), second.reason
    assert "\n" not in second.reason
    assert not list((job_dir / "logs").glob("rank-*.result.json"))  # the independent truth
    if backend == "slurm":  # the placement step "succeeded" too, writing nothing
        batch = (job_dir / "logs" / f"batch-{second.job_id}.out").read_text()
        assert "wrote no placement.json" in batch and "placement written" not in batch, batch


def test_a_resume_that_may_have_been_queued_is_not_put_back(tmp_path, capsys, monkeypatch):
    """Only a submission the backend started nothing for is put back (NotSubmitted: a
    refusal before sbatch, sbatch exiting non-zero). sbatch timing out, the connection
    dropping while it ran or an id it did not print may have queued the job: putting the
    directory back hid it behind the last attempt's FAILED, and a second resume queued a
    second job. A Ctrl-C before the submission puts the directory back and stays a Ctrl-C."""
    from ringctl.backends.local import LocalBackend

    job_dir = submit(capsys, SMOKE, f"output_dir={tmp_path}", "nodes=2", *ONCE)
    assert _final(job_dir).state is JobState.FAILED
    before = (job_dir / "job.json").read_bytes()

    def interrupted(self, job):
        raise KeyboardInterrupt

    monkeypatch.setattr(LocalBackend, "prepare_resume", interrupted)
    assert main(["resume", str(job_dir)]) == 130  # a Ctrl-C, still (cli: "interrupted")
    assert (job_dir / "job.json").read_bytes() == before
    assert not (job_dir / "attempts" / "1").exists()
    monkeypatch.undo()

    def no_id(self, path):
        raise UserError("sbatch printed no job id: (timed out)")

    monkeypatch.setattr(LocalBackend, "submit", no_id)
    capsys.readouterr()
    assert main(["resume", str(job_dir)]) == 2
    err = capsys.readouterr().err
    assert "sbatch printed no job id: (timed out); the resume may have been queued" in err
    assert json.loads((job_dir / "job.json").read_text())["job_id"] is None
    assert (job_dir / "attempts" / "1" / "logs").is_dir()  # not put back over a queued job
    assert "then `ringctl resume --force " in err  # the way on, once the queue was looked at
    monkeypatch.undo()
    assert main(["resume", "--force", str(job_dir)]) == 0, capsys.readouterr().err
    assert _final(job_dir).state is JobState.COMPLETED


def test_a_local_resume_that_could_not_start_is_put_back(tmp_path, capsys, monkeypatch):
    """An OSError starting the supervisor (a full disk at supervisor.log) is a submission
    that started nothing, as a refusal is: the resume is put back (it stranded the
    directory: attempt moved, job.json naming no job), and a plain submit leaves nothing."""
    import errno

    from ringctl.backends.local import LocalBackend

    job_dir = submit(capsys, SMOKE, f"output_dir={tmp_path}", "nodes=2", *ONCE)
    assert _final(job_dir).state is JobState.FAILED
    before = (job_dir / "job.json").read_bytes()

    def full_disk(job):
        raise OSError(errno.ENOSPC, "No space left on device", str(job.supervisor_log))

    monkeypatch.setattr(LocalBackend, "_start_supervisor", staticmethod(full_disk))
    capsys.readouterr()
    assert main(["resume", str(job_dir)]) == 2
    err = capsys.readouterr().err
    assert "supervisor.log: No space left on device" in err and "nothing changed" in err, err
    assert (job_dir / "job.json").read_bytes() == before
    assert not (job_dir / "attempts" / "1").exists()
    fresh = tmp_path / "fresh"
    assert main(["submit", SMOKE, f"output_dir={fresh}"]) == 2
    assert "could not start" in capsys.readouterr().err and not list(fresh.iterdir())
    monkeypatch.undo()
    assert main(["resume", str(job_dir)]) == 0, capsys.readouterr().err
    assert _final(job_dir).state is JobState.COMPLETED


def test_resume_locally_and_concurrent_resumes(tmp_path, capsys):
    job_dir = submit(capsys, SMOKE, f"output_dir={tmp_path}", "nodes=2", *ONCE)
    assert _final(job_dir).state is JobState.FAILED
    cmd = [sys.executable, "-m", "ringctl.cli", "resume", str(job_dir)]
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], results
    loser = next(err for code, _, err in results if code == 2)
    # refused in one line: the lock is held, or the winner's job is already PENDING/RUNNING
    assert loser.count("\n") == 1 and re.search(r"in use|is (PENDING|RUNNING)", loser), loser
    assert _final(job_dir).state is JobState.COMPLETED
    assert sorted(p.name for p in (job_dir / "attempts").iterdir()) == ["1"]


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_workers_die_with_their_supervisor(tmp_path, capsys):
    hang = ["task.fault_rank=0", "task.fault=hang", "timeout=600", "nodes=2"]
    job_dir = submit(capsys, SMOKE, f"output_dir={tmp_path}", *hang)

    def workers():
        try:
            state = json.loads((job_dir / "state.json").read_text())
        except (OSError, ValueError):
            return None
        pids = [info["pid"] for info in state.get("ranks", {}).values()]
        return pids if len(pids) == 2 else None

    pids = wait_for(workers, 60, "two workers")
    supervisor = json.loads((job_dir / "supervisor.pid").read_text())["pid"]
    os.kill(supervisor, signal.SIGKILL)
    wait_for(lambda: not any(_alive(p) for p in pids), 10, "the workers to die")
    status = _final(job_dir, timeout=10)
    assert status.state is JobState.FAILED and "supervisor process is gone" in status.reason


def test_a_reused_pid_is_never_signalled(tmp_path, capsys):
    hang = ["task.fault_rank=0", "task.fault=hang", "timeout=600", "nodes=2"]
    job_dir = submit(capsys, SMOKE, f"output_dir={tmp_path}", *hang)
    wait_for(lambda: (job_dir / "state.json").exists(), 60, "the job to start")
    assert main(["cancel", str(job_dir)]) == 0
    assert _final(job_dir, timeout=30).state is JobState.CANCELLED
    bystander = subprocess.Popen(["sleep", "120"])
    try:
        for record in (
            f"{bystander.pid}\n",  # a 0.1 supervisor.pid: a bare pid
            json.dumps({"pid": bystander.pid, "start": 1, "marker": f"supervise {job_dir}"}),
        ):
            (job_dir / "supervisor.pid").write_text(record)
            state = json.loads((job_dir / "state.json").read_text())
            state["state"] = "RUNNING"  # as if the job were still going
            (job_dir / "state.json").write_text(json.dumps(state))
            main(["status", str(job_dir)])
            main(["cancel", str(job_dir)])
            assert bystander.poll() is None, "cancel killed an unrelated process"
            assert _final(job_dir, timeout=5).state is not JobState.RUNNING
    finally:
        bystander.kill()
        bystander.wait()


def test_a_missing_sbatch_submits_nothing_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    """`backend=slurm` where sbatch is not installed started nothing: the second reading
    caught the directory kept and the submission said "may have been queued"."""
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    out = tmp_path / "jobs"
    capsys.readouterr()
    assert main(["submit", SMOKE, "backend=slurm", f"output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert "`sbatch` not found on this machine" in err and "may have been queued" not in err
    assert not out.exists() or not list(out.iterdir())
