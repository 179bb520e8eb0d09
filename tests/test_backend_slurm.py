"""The `slurm` backend against the real test cluster, with small hand-written job scripts."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from ringctl.backends.base import JobState
from ringctl.backends.slurm import SlurmBackend
from ringctl.errors import UserError

pytestmark = pytest.mark.slurm

RANK_LOGS = "--output=logs/rank-%t.out --error=logs/rank-%t.err"
# The job template's line before the ranks' srun: status reads srun's rank lines after it only.
STARTING = "echo '00:00:00 ringctl-job: starting 2 ranks'\n"


@pytest.fixture(scope="session")
def timeout_job(slurm_cluster, tmp_path_factory):
    """A job over its 1-minute limit, submitted when this module starts; the test that checks
    it runs last in the session (`run_last`, see conftest), so the minute or so Slurm takes to
    end it overlaps the other tests instead of adding to them."""
    job_dir = tmp_path_factory.mktemp("timeout") / "job"
    (job_dir / "logs").mkdir(parents=True)
    (job_dir / "job.sh").write_text(
        f"#!/bin/bash\n#SBATCH --time=1 --job-name=too-long\nsrun {RANK_LOGS} sleep 600\n"
    )
    backend = SlurmBackend()
    backend.submit(job_dir)
    yield job_dir
    if not backend.status(job_dir).state.finished:
        backend.cancel(job_dir)


@pytest.fixture(autouse=True, scope="module")
def _submit_timeout_job_first(timeout_job):
    yield


@pytest.fixture
def backend(slurm_cluster):
    return SlurmBackend(poll_s=0.3)


def test_states_pending_running_completed(slurm_cluster, make_job_dir):
    job_dir = make_job_dir("#!/bin/bash\n#SBATCH --time=2\nsleep 3\necho done\n")
    held = SlurmBackend(sbatch_args=["--hold"], poll_s=0.2)  # PENDING until released
    job_id = held.submit(job_dir)

    recorded = json.loads((job_dir / "job.json").read_text())
    assert recorded["backend"] == "slurm" and recorded["job_id"] == job_id
    assert recorded["batch_log"] == f"logs/batch-{job_id}.out"

    st = held.status(job_dir)
    assert st.state is JobState.PENDING and st.job_id == job_id
    assert "Held" in st.reason
    subprocess.run(["scontrol", "release", job_id], check=True)
    seen = [st.state]
    deadline = time.monotonic() + 60
    while not st.state.finished and time.monotonic() < deadline:
        time.sleep(0.2)
        st = held.status(job_dir)
        if st.state is not seen[-1]:
            seen.append(st.state)
    assert seen == [JobState.PENDING, JobState.RUNNING, JobState.COMPLETED]
    assert st.exit_code == 0 and st.reason == "" and st.elapsed_s is not None
    assert st.elapsed_s >= 2
    assert list(held.logs(job_dir)) == ["[batch] done"]


def test_failing_rank_reported_failed_with_its_error(backend, make_job_dir):
    # The script goes on after the failed step and exits 0: Slurm calls the job COMPLETED,
    # ringctl must not.
    job_dir = make_job_dir(
        "#!/bin/bash\n#SBATCH --nodes=2 --ntasks-per-node=1 --time=2\n"
        f"{STARTING}srun {RANK_LOGS} bash -c '"
        'echo "rank $SLURM_PROCID up"; '
        'if [ "$SLURM_PROCID" = 1 ]; then '
        'echo "Traceback (most recent call last):" >&2; '
        'echo "ValueError: boom on rank 1" >&2; exit 3; fi'
        "'\n"
        "echo 'the batch script goes on'\n"
    )
    backend.submit(job_dir)
    st = backend.wait(job_dir, timeout=60)
    assert st.state is JobState.FAILED, st
    assert st.reason.startswith("rank 1 exited with exit code 3"), st.reason
    assert st.reason.endswith("ValueError: boom on rank 1"), st.reason
    assert st.exit_code == 3
    assert list(st.ranks) == [1]
    assert list(backend.logs(job_dir, rank=0)) == ["rank 0 up"]


def test_failing_batch_script_reported_failed(backend, make_job_dir):
    job_dir = make_job_dir(
        "#!/bin/bash\n#SBATCH --time=2\necho starting\necho 'cannot read data.bin' >&2\nexit 2\n"
    )
    backend.submit(job_dir)
    st = backend.wait(job_dir, timeout=60)
    assert st.state is JobState.FAILED
    assert st.exit_code == 2
    assert st.reason == "batch script exit code 2: cannot read data.bin"


def test_cancel(backend, make_job_dir):
    job_dir = make_job_dir(f"#!/bin/bash\n#SBATCH --time=5\nsrun {RANK_LOGS} sleep 300\n")
    backend.submit(job_dir)
    deadline = time.monotonic() + 30
    while backend.status(job_dir).state is not JobState.RUNNING:
        assert time.monotonic() < deadline, "the job did not start"
        time.sleep(0.3)
    t0 = time.monotonic()
    backend.cancel(job_dir)
    st = backend.wait(job_dir, timeout=60)
    assert st.state is JobState.CANCELLED
    assert st.reason.startswith("CANCELLED by")
    assert time.monotonic() - t0 < 30
    backend.cancel(job_dir)  # a finished job: nothing to do, no error


def test_logs_and_follow(backend, make_job_dir):
    job_dir = make_job_dir(
        "#!/bin/bash\n#SBATCH --nodes=2 --ntasks-per-node=1 --time=2\n"
        "echo 'batch starts'\n"
        f"srun {RANK_LOGS} bash -c '"
        'for i in 1 2 3; do echo "line $i of rank $SLURM_PROCID"; sleep 0.7; done; '
        'echo "rank $SLURM_PROCID warns" >&2'
        "'\n"
        "echo 'batch ends'\n"
    )
    backend.submit(job_dir)
    t0 = time.monotonic()
    lines = list(backend.logs(job_dir, follow=True))
    assert time.monotonic() - t0 < 60
    assert backend.status(job_dir).state is JobState.COMPLETED  # follow ended with the job
    for r in (0, 1):
        mine = [ln for ln in lines if ln.startswith(f"[rank {r}] ")]
        assert mine == [f"[rank {r}] line {i} of rank {r}" for i in (1, 2, 3)] + [
            f"[rank {r}] rank {r} warns"
        ]
    batch = [ln for ln in lines if ln.startswith("[batch] ")]
    assert batch == ["[batch] batch starts", "[batch] batch ends"]
    # without follow, one rank: its .out then its .err, no prefix
    assert list(backend.logs(job_dir, rank=1)) == [
        "line 1 of rank 1",
        "line 2 of rank 1",
        "line 3 of rank 1",
        "rank 1 warns",
    ]


def test_sbatch_refusal_is_one_line_user_error(backend, make_job_dir):
    job_dir = make_job_dir("#!/bin/bash\n#SBATCH --partition=no-such-partition\ntrue\n")
    with pytest.raises(UserError) as err:
        backend.submit(job_dir)
    assert "sbatch refused the job" in str(err.value)
    assert "partition" in str(err.value).lower() and "\n" not in str(err.value)
    assert not (job_dir / "job.json").exists()


def test_not_submitted_and_resubmitted(backend, make_job_dir):
    job_dir = make_job_dir("#!/bin/bash\ntrue\n")
    with pytest.raises(UserError, match="no job id in job.json"):
        backend.status(job_dir)
    backend.submit(job_dir)
    with pytest.raises(UserError, match="already submitted"):
        backend.submit(job_dir)
    assert backend.wait(job_dir, timeout=60).state is JobState.COMPLETED


@pytest.mark.run_last
def test_time_limit_reported_as_timeout(timeout_job):
    # Slurm checks time limits about every 30 s: the job ends 60-90 s after it started.
    st = SlurmBackend(poll_s=1.0).wait(timeout_job, timeout=180)
    assert st.state is JobState.TIMEOUT, st
    assert st.reason.startswith("time limit reached")
    assert 55 <= (st.elapsed_s or 0) <= 150
