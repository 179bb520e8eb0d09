"""Findings of a read-only review of the job lifecycle through the verbs (session of
2026-12-05 11:22), each reproduced first: a Ctrl-C during a Slurm submission, a damaged
supervisor.pid, hostile job.json values, and what a listing of job directories shows; and
the config review's local job naming a batch script's environment."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ringctl.cli import main

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "jobs" / "smoke.yaml")


def _shim(tmp_path: Path, name: str, body: str) -> Path:
    """An executable ``name`` first on PATH: ``body`` runs with $REAL set to the real one."""
    real = shutil.which(name)
    shim = tmp_path / "bin" / name
    shim.parent.mkdir(exist_ok=True)
    shim.write_text(f'#!/bin/sh\nREAL="{real}"\n{body}\n')
    shim.chmod(0o755)
    return shim.parent


def _submit_interrupted(tmp_path, capsys, monkeypatch, name: str, body: str):
    """`ringctl submit` of a Slurm smoke job while ``name`` (sbatch or date) sends this
    process SIGINT (a Ctrl-C: KeyboardInterrupt where Python waits for it)."""
    monkeypatch.setenv("PATH", f"{_shim(tmp_path, name, body)}:{os.environ['PATH']}")
    # a Ctrl-C as in a terminal: pytest-xdist's workers ignore SIGINT
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    capsys.readouterr()
    argv = [SMOKE, "backend=slurm", f"output_dir={tmp_path / 'jobs'}", "task.steps=1"]
    try:
        code = main(["submit", *argv])
    finally:
        signal.signal(signal.SIGINT, previous)
    monkeypatch.undo()
    queued = (tmp_path / "queued").read_text().split(";")[0].strip()
    subprocess.run(["scancel", queued], check=False)
    return code, capsys.readouterr().err, queued


@pytest.mark.slurm
def test_a_ctrl_c_after_sbatch_queued_the_job_keeps_the_directory_naming_it(
    slurm_cluster, tmp_path, capsys, monkeypatch
):
    """A Ctrl-C while submit read the cluster's clock (after sbatch printed the id) removed
    the job directory, and the job Slurm went on to run was named nowhere ("interrupted",
    exit 130). job.json records the id first; the directory stays and the line names it."""
    # sbatch answers as usual (keeping a copy of its id); then `date` sends the Ctrl-C
    sbatch = _shim(tmp_path, "sbatch", f'"$REAL" "$@" | tee "{tmp_path}/queued"')
    monkeypatch.setenv("PATH", f"{sbatch}:{os.environ['PATH']}")
    code, err, queued = _submit_interrupted(
        tmp_path, capsys, monkeypatch, "date", 'kill -INT $PPID; sleep 5; exec "$REAL" "$@"'
    )
    assert code == 130 and queued.isdigit(), err
    [job_dir] = (tmp_path / "jobs").iterdir()
    assert f"interrupted after job {queued} was submitted: {job_dir} names it" in err, err
    assert json.loads((job_dir / "job.json").read_text())["job_id"] == queued
    assert main(["status", str(job_dir)]) in (0, 1)  # the job, found by its id
    assert queued in capsys.readouterr().out


@pytest.mark.slurm
def test_a_ctrl_c_while_sbatch_runs_keeps_the_directory_as_maybe_queued(
    slurm_cluster, tmp_path, capsys, monkeypatch
):
    """A Ctrl-C while sbatch ran (it had queued the job, its answer not read yet) removed
    the directory the queued job ran in: it stays, marked as a submission that may have been
    queued (the way on as for a timeout), exit 130."""
    code, err, queued = _submit_interrupted(
        tmp_path,
        capsys,
        monkeypatch,
        "sbatch",
        f'"$REAL" "$@" > "{tmp_path}/queued"; kill -INT $PPID; sleep 5; cat "{tmp_path}/queued"',
    )
    assert code == 130 and queued.isdigit(), err
    [job_dir] = (tmp_path / "jobs").iterdir()
    assert "interrupted while sbatch ran; the job may have been queued" in err, err
    assert f"its directory {job_dir} is kept" in err
    assert json.loads((job_dir / "job.json").read_text()).get("submission_unknown") is True


def _ended(pid: int) -> bool:
    """Gone, or a zombie (this test process started it and does not reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.parametrize("damage", ["garbage\n", None])  # damaged, or deleted
def test_a_running_local_job_whose_supervisor_pid_is_lost_is_still_found(tmp_path, capsys, damage):
    """supervisor.pid damaged or gone while the job ran: status said FAILED ("the local
    supervisor process is gone") of a live job, resume started a second ring beside it (whose
    state.json the first then wrote), cancel reached nothing. The supervisor is found by its
    command line: RUNNING, resume refused, cancel ends it."""
    from tests.local_jobs import local_state, submit, wait_for

    job_dir = submit(
        capsys, SMOKE, f"output_dir={tmp_path}", "task.fault_rank=0", "task.fault=hang"
    )
    wait_for(lambda: local_state(job_dir).get("state") == "RUNNING", 60, "RUNNING")
    pid = json.loads((job_dir / "supervisor.pid").read_text())["pid"]
    if damage is None:
        (job_dir / "supervisor.pid").unlink()
    else:
        (job_dir / "supervisor.pid").write_text(damage)
    capsys.readouterr()
    main(["status", str(job_dir), "--json"])
    [row] = json.loads(capsys.readouterr().out)
    assert row["state"] == "RUNNING" and row["job_id"] == f"local-{pid}", row
    assert main(["resume", "--force", str(job_dir)]) == 2
    assert f"job local-{pid} is RUNNING; cancel it first" in capsys.readouterr().err
    assert not (job_dir / "attempts").exists()
    assert main(["cancel", str(job_dir)]) == 0
    wait_for(lambda: _ended(pid), 30, "the supervisor to end")
    capsys.readouterr()
    main(["status", str(job_dir), "--json"])
    assert json.loads(capsys.readouterr().out)[0]["state"] == "CANCELLED"


def _job_dir(path: Path, meta: dict) -> Path:
    """A job directory as submit makes it, with job.json ``meta`` (no job ever ran in it)."""
    from ringctl.config import load_job, to_yaml

    for sub in ("logs", "out", "probes"):
        (path / sub).mkdir(parents=True)
    (path / "config.yaml").write_text(to_yaml(load_job(SMOKE, [])))
    (path / "job.json").write_text(json.dumps(meta))
    return path


@pytest.mark.parametrize("recorded", [["x"], 5, "ssh"])
def test_a_job_json_backend_not_the_configs_is_one_line_naming_the_key(tmp_path, capsys, recorded):
    """A list there was `TypeError: unhashable type` in every verb; 5 said "backend 5 is not
    available in this installation"; "ssh" beside a local config "ssh.host: is required"."""
    job = _job_dir(tmp_path / "job", {"backend": recorded, "name": "smoke"})
    for verb in ("status", "logs", "cancel", "resume"):
        capsys.readouterr()
        assert main([verb, str(job)]) in (1, 2), verb
        err = capsys.readouterr().err
        said = f"{job / 'job.json'}: backend: {recorded!r}, but config.yaml says 'local'"
        assert said in err and "Traceback" not in err, (verb, err)


def test_a_listing_shows_a_dangling_job_json_and_never_a_submits_temporary(tmp_path, capsys):
    """A submit's `.NAME.XXXX.creating` folder (seen while it runs, left by one killed) was
    listed as a job, UNKNOWN, and picked by --latest for its future created_at; a job whose
    job.json is a link to nothing was left out of the listing."""
    root = tmp_path / "runs"
    ok = _job_dir(root / "ok", {"backend": "local", "name": "smoke"})
    _job_dir(root / ".smoke.abc.creating", {"name": "smoke", "created_at": "2999-01-01"})
    dangling = _job_dir(root / "dangling", {})
    (dangling / "job.json").unlink()
    (dangling / "job.json").symlink_to(tmp_path / "nowhere")
    capsys.readouterr()
    main(["status", "--root", str(root), "--json"])
    rows = {Path(r["job_dir"]).name: r["state"] for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == {"ok", "dangling"} and rows["dangling"] == "UNKNOWN", rows
    assert main(["status", "--root", str(root), "--latest", "--dir-only"]) in (0, 1)
    assert capsys.readouterr().out.strip() in (str(ok), str(dangling))


@pytest.mark.parametrize(
    "given",
    ["env.venv=/nonexistent", "env.modules=[cuda/12]", "env.conda=base", "env.container_image=i"],
)
def test_a_local_job_naming_a_batch_scripts_environment_is_warned(tmp_path, capsys, given):
    """(config review) backend=local ran a job naming a venv, modules, a conda environment
    and a container that do not exist, COMPLETED, none of them used or said (and this
    interpreter's packages went unchecked). Said; the job runs as it is (a file written for
    Slurm runs here), its packages checked."""
    capsys.readouterr()
    assert main(["run", SMOKE, given, "task.steps=1", f"output_dir={tmp_path / 'runs'}"]) == 0
    key = given.split("=")[0]
    assert f"warning: {key}: not set up by the local backend" in capsys.readouterr().err


def test_a_job_an_earlier_release_accepted_can_still_be_seen_and_cancelled(tmp_path, capsys):
    """(second reading) Every verb re-checked config.yaml by today's rules: an attention job
    that ran with task.seed=-1 (accepted before the seed was bounded) was refused by status,
    logs and cancel, a queued job out of reach. They read it as written, saying so; a
    resume, which runs it again, is still refused by name."""
    from ringctl.config import load_job, to_yaml

    job = _job_dir(tmp_path / "old", {"backend": "local", "name": "attention"})
    text = to_yaml(load_job("jobs/attention.yaml", ["backend=local", "gpus_per_node=0"]))
    assert "  seed: 0\n" in text
    (job / "config.yaml").write_text(text.replace("  seed: 0\n", "  seed: -1\n"))
    for verb in ("status", "logs", "cancel"):
        capsys.readouterr()
        assert main([verb, str(job)]) in (0, 1), verb
        err = capsys.readouterr().err
        assert "note: " in err and "task.seed" in err and "read as written" in err, (verb, err)
    assert main(["resume", "--force", str(job)]) == 2
    assert "task.seed: must be from 0" in capsys.readouterr().err
    # a value that cannot be read as written either (`???`) is the one-line refusal it was
    (job / "config.yaml").write_text(text.replace("name: attention\n", "name: ???\n", 1))
    for verb in ("status", "logs"):
        assert main([verb, str(job)]) in (1, 2), verb
        err = capsys.readouterr().err
        assert "missing mandatory value" in err and "Traceback" not in err, err


def test_a_renamed_key_is_noted_once_when_read_as_written(tmp_path, capsys):
    """An earlier release's config.yaml with `ring.plan` and a value today refuses: status
    read it twice (by today's checks, then as written) and printed the deprecation note
    twice. Once."""
    from ringctl.config import load_job, to_yaml

    job = _job_dir(tmp_path / "old", {"backend": "local", "name": "attention"})
    text = to_yaml(load_job("jobs/attention.yaml", ["backend=local", "gpus_per_node=0"]))
    assert "  seed: 0\n" in text and "  placement: " in text
    old = text.replace("  seed: 0\n", "  seed: -1\n").replace("  placement: ", "  plan: ")
    (job / "config.yaml").write_text(old)
    capsys.readouterr()
    assert main(["status", str(job)]) in (0, 1)
    err = capsys.readouterr().err
    assert err.count("ring.plan is deprecated, read as ring.placement") == 1, err
    assert "read as written" in err


def _rank(job: Path, rank: int, port: int, run: str) -> subprocess.Popen:
    """``python -m ringctl.worker JOB`` as rank ``rank`` of 2, rendezvous at ``port``."""
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "RINGCTL_RUN"))}
    env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    env.update(MASTER_PORT=str(port), RINGCTL_RUN_ID=run, OMP_NUM_THREADS="1")
    log = open(job / "logs" / f"rank-{rank}.err", "wb")  # noqa: SIM115 (the child's)
    return subprocess.Popen(
        [sys.executable, "-m", "ringctl.worker", str(job)], env=env, stderr=log, stdout=log
    )


def test_a_rank_of_another_job_on_the_same_port_is_no_member(tmp_path):
    """(several-jobs review) Slurm jobs whose ids are 20000 apart got one rendezvous port on a
    shared host: a rank of the later job was counted among the earlier job's ranks, opened
    its gate, and both ran as one ring until the intruder died and took the earlier job
    down. The store's keys are each run's own: the intruder waits alone and times out by
    name; the earlier job meets its own rank and completes."""
    from ringctl.backends.local import rendezvous_port
    from ringctl.config import load_job, to_yaml

    jobs = {}
    for name, extra in (("a", []), ("b", ["rendezvous_timeout=6", "task.seq_len=128"])):
        job = _job_dir(tmp_path / name, {"backend": "local", "name": "smoke"})
        cfg = load_job(SMOKE, ["nodes=1", "tasks_per_node=2", "task.steps=1", *extra])
        (job / "config.yaml").write_text(to_yaml(cfg))
        jobs[name] = job
    port = rendezvous_port()
    first = _rank(jobs["a"], 0, port, "a")
    time.sleep(3)  # its store is up
    intruder = _rank(jobs["b"], 1, port, "b")
    assert intruder.wait(timeout=60) != 0
    said = (jobs["b"] / "logs" / "rank-1.err").read_text()
    assert "rendezvous: only 1 of 2 ranks arrived" in said, said
    assert first.poll() is None  # still waiting for its own rank 1
    second = _rank(jobs["a"], 1, port, "a")
    assert first.wait(timeout=120) == 0 and second.wait(timeout=120) == 0
