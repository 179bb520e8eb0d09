"""The command-line review's findings (issue "CLI review"): a job whose local supervisor cannot
start its ranks ends FAILED instead of hanging `run`; --rank outside the job's ranks is
refused; OSErrors naming a path are one line; the status table shows a long reason whole;
`status` takes a bundled job's name; resume suggests the key meant; gather says why a running
job's outputs are missing, and its hint keeps -o; the job_dir refusal names resume; help and
exit statuses say what the verbs do.

Local jobs run only where the point is the supervisor (one that fails at once); the rest use
a job directory as `ringctl submit` leaves it, made here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest

from ringctl.atomic import atomic_write_json
from ringctl.backends import local
from ringctl.backends.base import JobState, JobStatus
from ringctl.cli import build_parser, main
from ringctl.commands import jobs
from ringctl.commands.gather import partial_state_line
from ringctl.config import load_job, to_yaml
from ringctl.errors import UserError
from ringctl.jobdir import JobDir
from ringctl.submission import resume_job
from tests.local_jobs import submitted_job_dir

ROOT = Path(__file__).resolve().parents[1]
NO_PYTHON = "env.python=/nonexistent/python"


def _job_dir(base: Path, job: str = "smoke", state: dict | None = None, *overrides) -> Path:
    """A local job's directory as `ringctl submit` leaves it (no process), with its state."""
    files = {
        "config.yaml": to_yaml(load_job(job, list(overrides))),
        "job.sh": "#!/bin/bash\n",
        "job.json": json.dumps({"backend": "local", "name": job}),
    }
    path = JobDir.create(files, target=base / job, base=base, stem=job).path
    if state is not None:
        atomic_write_json(path / "state.json", state)
    return path


def _fake_supervisor(job: Path) -> subprocess.Popen:
    """A live process the local backend takes for the job's supervisor (its marker's words as
    whole arguments), recorded in supervisor.pid."""
    marker = local.supervisor_marker(JobDir(job))
    argv = [sys.executable, "-c", "import time; time.sleep(300)", *marker.split(" ", 1)]
    proc = subprocess.Popen(argv)
    deadline = time.monotonic() + 10
    record = local.ProcessRecord.of(proc.pid, marker)
    while not record.alive() and time.monotonic() < deadline:  # until exec has happened
        time.sleep(0.05)
        record = local.ProcessRecord.of(proc.pid, marker)
    (job / "supervisor.pid").write_text(json.dumps(asdict(record)) + "\n")
    return proc


# --- 1. a supervisor that cannot start its ranks ------------------------------------------------


@pytest.mark.timeout(60)
def test_run_refuses_an_env_python_that_does_not_exist(tmp_path: Path, capsys) -> None:
    assert main(["run", "smoke", f"output_dir={tmp_path}", NO_PYTHON]) == 2
    err = capsys.readouterr().err
    assert "env.python: /nonexistent/python" in err and len(err.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())  # nothing submitted, nothing left


@pytest.mark.timeout(60)
def test_a_supervisor_that_cannot_start_its_ranks_fails_the_job(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """Past submit's check (the interpreter removed meanwhile): the supervisor records FAILED
    with its error, and `run` ends non-zero in seconds instead of waiting for ever."""
    monkeypatch.setattr(local.LocalBackend, "refuse_unstartable", lambda self, cfg: None)
    started = time.monotonic()
    assert main(["run", "smoke", f"output_dir={tmp_path}", NO_PYTHON]) == 1
    assert time.monotonic() - started < 30
    out, err = capsys.readouterr()
    assert "FAILED" in err and "/nonexistent/python: No such file or directory" in err
    state = json.loads((submitted_job_dir(out.splitlines()[0]) / "state.json").read_text())
    assert state["state"] == "FAILED" and "the ranks could not start" in state["reason"]


@pytest.mark.parametrize("how", ["override", "config"])
def test_resume_refuses_a_missing_env_python_before_anything_moves(tmp_path: Path, how) -> None:
    """resume checked env.python only in the backend's submit, after the previous attempt's
    logs had moved to attempts/1: a refused resume changed the directory. Now it is refused
    first (given as an override, or already in the job's config), and nothing moves."""
    job = _job_dir(
        tmp_path,
        "smoke",
        {"state": "FAILED", "reason": "x"},
        *([NO_PYTHON] if how == "config" else []),
    )
    (job / "logs" / "rank-0.out").write_text("the last attempt\n")
    config = (job / "config.yaml").read_text()
    with pytest.raises(UserError, match="env.python: /nonexistent/python: no such executable"):
        resume_job(job, overrides=[NO_PYTHON] if how == "override" else [])
    assert not (job / "attempts").exists()
    assert (job / "logs" / "rank-0.out").read_text() == "the last attempt\n"
    assert (job / "config.yaml").read_text() == config


def test_a_supervisor_gone_without_a_state_reads_failed(tmp_path: Path, capsys) -> None:
    """No state.json, and supervisor.pid names a process that is not (or no longer) the
    supervisor: FAILED, with its log's last error and where the log is; UNKNOWN stays for a
    directory never submitted."""
    job = _job_dir(tmp_path)
    assert local.LocalBackend().status(job).state is JobState.UNKNOWN  # never submitted
    gone = {"pid": 1, "start": 1}  # pid 1 with another start time: not this supervisor
    (job / "supervisor.pid").write_text(json.dumps(gone))
    (job / "logs" / "supervisor.log").write_text("Traceback ...\nOSError: disk on fire\n")
    st = local.LocalBackend().status(job)
    assert st.state is JobState.FAILED
    assert "OSError: disk on fire" in st.reason and "logs/supervisor.log" in st.reason


def test_a_supervisor_not_yet_execd_is_starting_not_failed(tmp_path: Path) -> None:
    """Between its fork and its exec the supervisor shows its parent's command line (no
    marker): status read that as a supervisor gone and the job FAILED, while it was starting
    (a `run` in the full suite). The same process (pid, start time) is PENDING."""
    job = _job_dir(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        record = local.ProcessRecord.of(proc.pid, local.supervisor_marker(JobDir(job)))
        assert not record.alive()  # its command line lacks the job's marker
        (job / "supervisor.pid").write_text(json.dumps(asdict(record)) + "\n")
        st = local.LocalBackend().status(job)
        assert st.state is JobState.PENDING, st
    finally:
        proc.kill()
        proc.wait()
    assert local.LocalBackend().status(job).state is JobState.FAILED  # and once it is gone


# --- 2. --rank ----------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", ["7", "4", "-1"])
def test_logs_refuses_a_rank_the_job_does_not_have(tmp_path: Path, capsys, rank: str) -> None:
    job = _job_dir(tmp_path, "smoke", {"state": "COMPLETED"})
    (job / "logs" / "rank-3.out").write_text("rank three\n")
    assert main(["logs", str(job), "--rank", rank]) == 2
    assert f"--rank {rank}: this job has ranks 0 to 3" in capsys.readouterr().err
    assert main(["logs", str(job), "--rank", "3"]) == 0
    assert "rank three" in capsys.readouterr().out


def test_run_refuses_a_rank_before_submitting(tmp_path: Path, capsys) -> None:
    assert main(["run", "smoke", f"output_dir={tmp_path}", "--rank", "9"]) == 2
    assert "--rank 9: this job has ranks 0 to 3" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_rank_and_all_ranks_exclude_each_other(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["run", "smoke", "--rank", "1", "--all-ranks"])
    assert exit_.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


# --- 3. OSErrors naming a path ------------------------------------------------------------------


def test_a_name_too_long_is_one_line(tmp_path: Path, capsys) -> None:
    long = tmp_path / ("a" * 300)
    assert main(["submit", "smoke", f"output_dir={long}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(": File name too long") and len(err.splitlines()) == 1


def test_an_oserror_naming_a_path_is_one_line(capsys, monkeypatch) -> None:
    """Any OSError with a filename (here NotADirectoryError, as `gather -o afile/sub` raised):
    `PATH: strerror`, exit 2; the write errnos keep exit 1."""
    import errno

    from ringctl.commands import jobs

    def raising(no):
        def cmd(args):
            raise OSError(no, "said", "/some/afile.txt")

        return cmd

    monkeypatch.setattr(jobs, "cmd_config", raising(errno.ENOTDIR))
    assert main(["config", "smoke"]) == 2
    assert capsys.readouterr().err == "ringctl config: error: /some/afile.txt: said\n"
    monkeypatch.setattr(jobs, "cmd_config", raising(errno.ENOSPC))
    assert main(["config", "smoke"]) == 1


# --- 4. the status table ------------------------------------------------------------------------


def test_status_shows_a_long_reason_whole_at_width_120(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "120")  # what rich takes for the width when not a terminal
    reason = "rank 3 exited 1: ValueError: " + " ".join(f"word{i}" for i in range(40))
    state = {"state": "FAILED", "reason": reason, "started_at": 1.0, "ended_at": 1234.5}
    job = _job_dir(tmp_path, "longdoc", state)
    (job / "supervisor.pid").write_text(json.dumps({"pid": 1, "start": 1}))
    progress = {"done": 3, "total": 40, "unit": "documents", "tokens_per_s": 123456.0}
    (job / "logs" / "progress.json").write_text(json.dumps(progress))  # a wide cell beside it
    assert main(["status", str(job)]) == 0
    lines = capsys.readouterr().out.splitlines()  # not a terminal, as `| cat`
    assert lines and all(len(line) <= 120 and line[-1] in "┓┃┩│┘" for line in lines)
    cells = "".join(line.split("│")[-2].strip() for line in lines if line.startswith("│"))
    assert cells.replace(" ", "") == reason.replace(" ", "")


# --- 5. status of a bundled job -----------------------------------------------------------------


def test_status_takes_a_bundled_job_name(tmp_path: Path, capsys) -> None:
    job = _job_dir(tmp_path, "smoke", {"state": "COMPLETED"})
    assert main(["status", "smoke", f"output_dir={tmp_path}", "--dir-only"]) == 0
    assert capsys.readouterr().out.strip() == str(job)


# --- 6. resume's unknown keys -------------------------------------------------------------------


def test_resume_suggests_the_key_meant(tmp_path: Path, capsys) -> None:
    job = _job_dir(tmp_path, "smoke", {"state": "FAILED"})
    assert main(["resume", str(job), "nodez=2"]) == 2
    assert "unknown key nodez (did you mean nodes?)" in capsys.readouterr().err
    assert main(["resume", str(job), "task.seq_len=512"]) == 2  # a key it has: the whitelist
    assert "a resume may change how the job runs" in capsys.readouterr().err


# --- 7, 8. gather of a job that has not ended ---------------------------------------------------


def test_gather_of_a_running_job_says_it_runs(tmp_path: Path, capsys) -> None:
    job = _job_dir(tmp_path, "longdoc", {"state": "RUNNING", "started_at": time.time()})
    proc = _fake_supervisor(job)
    try:
        code = main(["gather", str(job)])
    finally:
        proc.kill()
        proc.wait()
    err = capsys.readouterr().err
    assert code != 0 and err.startswith("ringctl gather: the job is RUNNING")
    assert "--partial" in err.splitlines()[0]


def test_the_partial_hint_keeps_the_output_named(tmp_path: Path) -> None:
    status = JobStatus("local-1", JobState.RUNNING)
    result = SimpleNamespace(incomplete=[{"document": "d"}])
    line = partial_state_line(status, Path("/j"), result, "my out")
    assert "`ringctl gather /j -o 'my out'` again" in line
    assert "`ringctl gather /j` again" in partial_state_line(status, Path("/j"), result)


# --- 9. a job_dir that is taken -----------------------------------------------------------------


def test_a_taken_job_dir_points_at_resume(tmp_path: Path, capsys) -> None:
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("")
    assert main(["submit", "smoke", f"job_dir={taken}"]) == 2
    assert "to continue a job there: ringctl resume" in capsys.readouterr().err
    longdoc = (ROOT / "jobs" / "longdoc.yaml").read_text()
    assert "ringctl resume" in longdoc


# --- 10, 11. arguments, help and exit statuses --------------------------------------------------


@pytest.mark.parametrize("verb", ["run", "config", "resume"])
def test_overrides_are_not_called_required(verb: str, capsys) -> None:
    with pytest.raises(SystemExit):
        main([verb])
    err = capsys.readouterr().err
    assert "required" in err and "KEY=VALUE" not in err.splitlines()[-1]


def test_help_says_the_exit_statuses(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for code in ("0", "1", "2", "130", "141"):
        assert f"\n  {code} " in out


def test_status_of_a_missing_root_names_it_in_every_form(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "nowhere"
    for form in ([], ["--dir-only"], ["--json"]):
        assert main(["status", "--root", str(missing), *form]) == 1
        assert f"--root {missing}: no such directory" in capsys.readouterr().err


def test_a_first_status_with_no_runs_folder_says_no_job_yet(tmp_path: Path, capsys, monkeypatch):
    """(newcomer review) `ringctl status` before any job said "--root runs: no such
    directory", naming a flag the user never typed, as if something were broken."""
    monkeypatch.chdir(tmp_path)
    assert main(["status"]) == 1
    err = capsys.readouterr().err
    assert "no jobs yet here: no runs/ folder (`ringctl run smoke` makes one" in err, err
    assert "--root" not in err and err.count("\n") == 1


def test_status_of_a_job_file_without_jobs_exits_1_as_every_form(tmp_path: Path, capsys):
    """`ringctl --help` says exit 1 for "no job found" in every form of status; `status
    smoke` (a job file none of whose jobs exist) exited 2, the code of a usage error."""
    assert main(["status", "smoke", f"output_dir={tmp_path}"]) == 1
    assert "no job directory of 'smoke' under" in capsys.readouterr().err


def test_status_json_and_dir_only_exclude_each_other(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["status", "--json", "--dir-only"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_help_texts(capsys) -> None:
    parser = build_parser()
    verbs = {a.dest: a for a in parser._subparsers._group_actions}["verb"].choices
    for verb in ("resume", "logs", "fetch", "cancel"):
        (job_dir,) = [a for a in verbs[verb]._actions if a.dest == "job_dir"]
        assert job_dir.help
    status_help = verbs["status"].format_help()
    assert "JSON array" in " ".join(status_help.split())
    assert "exit status 1 when the sequence does not fit" in " ".join(
        verbs["plan"].format_help().lower().split()
    )


def test_render_refuses_a_relative_job_dir(capsys) -> None:
    assert main(["render", "smoke", "backend=slurm", "--job-dir", "runs/x"]) == 2
    assert "--job-dir runs/x: give an absolute path" in capsys.readouterr().err


# --- a state nothing will change ---------------------------------------------------------------


def _ends_within(seconds: float, call) -> object:
    """call()'s result, or a failure naming the hang (the call is left in a daemon thread)."""
    import threading

    result: list = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s"
    return result[0]


def test_run_and_logs_end_on_a_damaged_state_with_the_supervisor_gone(
    tmp_path: Path, capsys
) -> None:
    """state.json damaged ({"state": 5}) and its supervisor gone: status is UNKNOWN naming the
    key, and nothing will ever rewrite it. `logs -f` and `run` waited for an end for ever; they
    end now, `run` with exit 1 and the reason."""
    job = _job_dir(tmp_path, state={"state": 5})
    (job / "supervisor.pid").write_text(json.dumps({"pid": 1, "start": 1}))  # not this one
    (job / "logs" / "rank-0.out").write_text("hello from rank 0\n")
    assert _ends_within(20, lambda: main(["logs", "-f", str(job)])) == 0
    assert "hello from rank 0" in capsys.readouterr().out
    backend = local.LocalBackend()
    follow = jobs.follow_to_end
    code = _ends_within(20, lambda: follow(job, "local-1", backend, rank=0))
    err = capsys.readouterr().err
    assert code == 1 and "UNKNOWN" in err and "state: expected one of" in err, err


def test_a_damaged_state_beside_a_live_supervisor_is_still_followed(tmp_path: Path) -> None:
    """The supervisor rewrites state.json as the job goes on: while it runs, UNKNOWN is not
    the end."""
    job = _job_dir(tmp_path, state={"state": 5})
    proc = _fake_supervisor(job)
    try:
        assert not local.LocalBackend().is_finished(job)
    finally:
        proc.kill()
        proc.wait()
    assert local.LocalBackend().is_finished(job)


def test_a_misspelled_job_name_or_a_job_directory_given_as_a_job_is_named(tmp_path, capsys):
    """(newcomer review) `ringctl run smoek` listed the bundled jobs but suggested none, as a
    misspelled key is; `ringctl run runs/JOB` (a job directory) said "is not a file"."""
    assert main(["run", "smoek", f"output_dir={tmp_path}"]) == 2
    assert "job file smoek not found (did you mean smoke? bundled jobs" in capsys.readouterr().err
    job_dir = tmp_path / "smoke-1"
    job_dir.mkdir()
    (job_dir / "config.yaml").write_text("name: smoke\n")
    assert main(["run", str(job_dir)]) == 2
    said = capsys.readouterr().err
    assert f"{job_dir} is a job directory, not a job file: ringctl status/logs/resume" in said
