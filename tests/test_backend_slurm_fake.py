"""The slurm backend's decisions against a scripted shell (no cluster): sacct lagging behind
squeue, no accounting at all, a job both have forgotten, and the exact sbatch argv."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

import pytest

from ringctl.backends.base import JobState
from ringctl.backends.slurm import SlurmBackend
from ringctl.errors import NotSubmitted, UserError

# The script's line before the ranks' srun: srun's lines above it are not about ranks.
STARTING = "12:00:00 ringctl-job: starting 4 ranks; rendezvous at n1:20042\n"


class FakeShell:
    where = "fake"

    def __init__(self, answers: dict[str, list[tuple[int, str, str]]], files=None) -> None:
        self.answers = answers  # command name -> answers, in order (the last one repeats)
        self.files = files or {}
        self.calls: list[list[str]] = []

    def run(self, argv: Sequence[str], *, timeout: float = 60.0) -> tuple[int, str, str]:
        self.calls.append(list(argv))
        queue = self.answers[argv[0]]
        return queue.pop(0) if len(queue) > 1 else queue[0]

    def read_from(
        self, path: str, offset: int = 0, *, limit: int = 1 << 24, tail: bool = False
    ) -> bytes | None:
        for suffix, text in self.files.items():
            if path.endswith(suffix):
                data = text.encode()[offset:]
                return data[-limit:] if tail else data[:limit]
        return None

    def listdir(self, path: str) -> list[str]:
        return sorted({k.rsplit("/", 1)[-1] for k in self.files if k.startswith("logs/")})


@pytest.fixture
def job_dir(tmp_path):
    d = tmp_path / "job"
    (d / "logs").mkdir(parents=True)
    (d / "job.sh").write_text("#!/bin/bash\ntrue\n")
    return d


FORGOTTEN = (1, "", "slurm_load_jobs error: Invalid job id specified\n")


def forgotten_by_squeue(sacct: str, files=None) -> FakeShell:
    """A job squeue no longer knows, whose accounting (and files) say the rest."""
    return FakeShell({"squeue": [FORGOTTEN], "sacct": [(0, sacct, "")]}, files=files)


def submitted(job_dir, job_id="42"):
    (job_dir / "job.json").write_text(json.dumps({"backend": "slurm", "job_id": job_id}))
    return job_dir


def test_sbatch_argv_and_job_json(job_dir):
    shell = FakeShell(
        {"sbatch": [(0, "42;ringtest\n", "")], "date": [(0, "2026-11-30T10:00:00\n", "")]}
    )
    job_id = SlurmBackend(shell, sbatch_args=["--qos=high"]).submit(job_dir)
    assert job_id == "42"
    where = str(job_dir.resolve())
    assert shell.calls == [
        [
            "sbatch",
            "--parsable",
            f"--chdir={where}",
            f"--output={where}/logs/batch-%j.out",
            f"--error={where}/logs/batch-%j.out",
            "--qos=high",
            f"{where}/job.sh",
        ],
        ["date", "-d", "-2 minutes", "+%Y-%m-%dT%H:%M:%S"],  # the cluster's clock, for sacct
    ]
    recorded = json.loads((job_dir / "job.json").read_text())
    assert recorded["job_id"] == "42" and recorded["backend"] == "slurm"
    assert recorded["sacct_since"] == "2026-11-30T10:00:00"


def test_sacct_is_asked_only_for_jobs_since_submission(job_dir):
    # A controller that lost its state reuses ids: an older job 42 must not answer for ours.
    (job_dir / "job.json").write_text(
        json.dumps({"backend": "slurm", "job_id": "42", "sacct_since": "2026-11-30T10:00:00"})
    )
    shell = FakeShell(
        {
            "squeue": [(0, "", "slurm_load_jobs error: Invalid job id specified\n")],
            "sacct": [(0, "42|job.sh|COMPLETED|0:0|3|None|n1\n", "")],
        }
    )
    SlurmBackend(shell).status(job_dir)
    sacct = [c for c in shell.calls if c[0] == "sacct"][0]
    assert "--starttime=2026-11-30T10:00:00" in sacct


def test_waits_for_sacct_to_catch_up(job_dir):
    shell = FakeShell(
        {
            "squeue": [(0, "42|COMPLETED|None|0:03\n", "")],
            "sacct": [
                (0, "", ""),  # not recorded yet
                (0, "42|job.sh|RUNNING|0:0|2|None|n1\n", ""),
                (0, "42|job.sh|COMPLETED|0:0|3|None|n1\n42.batch|batch|COMPLETED|0:0|3||n1\n", ""),
            ],
        }
    )
    st = SlurmBackend(shell, poll_s=0.01).status(submitted(job_dir))
    assert st.state is JobState.COMPLETED and st.elapsed_s == 3
    assert [c[0] for c in shell.calls].count("sacct") == 3


def test_without_accounting_uses_squeue_and_the_batch_log(job_dir):
    shell = FakeShell(
        {
            "squeue": [(0, "42|COMPLETED|None|0:03\n", "")],
            "sacct": [(1, "", "sacct: error: Accounting storage is disabled\n")],
        },
        files={
            "logs/batch-42.out": STARTING + "srun: error: n2: task 1: Exited with exit code 7\n",
            "logs/rank-1.err": "ringctl.worker: rank 1 failed: shapes differ\n",
        },
    )
    st = SlurmBackend(shell, poll_s=0.01).status(submitted(job_dir))
    assert st.state is JobState.FAILED
    assert st.reason == "rank 1 exited with exit code 7 (n2): rank 1 failed: shapes differ"
    assert st.ranks == {1: "Exited with exit code 7 (n2)"}


def test_result_file_error_preferred(job_dir):
    shell = forgotten_by_squeue(
        "42|job.sh|FAILED|1:0|3|None|n1\n42.0|python|FAILED|1:0|3||n1\n",
        files={
            "logs/batch-42.out": STARTING + "srun: error: n1: task 0: Exited with exit code 1\n",
            "logs/rank-0.result.json": json.dumps({"error": "ValueError: bad\nsecond line"}),
        },
    )
    st = SlurmBackend(shell).status(submitted(job_dir))
    assert st.state is JobState.FAILED and st.exit_code == 1
    assert st.reason == "rank 0 exited with exit code 1 (n1): ValueError: bad second line"


RESET = "RuntimeError: Read error [10.0.0.1]:29500: Connection reset by peer."


@pytest.mark.parametrize(
    "srun_lines, files, blamed",
    [
        # A rank killed outright (OOM killer, kill -9) writes nothing; its peer, exiting 1 with
        # gloo's reset, is reported first by srun but is the effect.
        (
            ["n1: task 0: Exited with exit code 1", "n2: task 1: Killed"],
            {"logs/rank-0.result.json": json.dumps({"error": RESET})},
            "rank 1 killed by signal 9 (SIGKILL) (n2)",
        ),
        (
            ["n1: task 0: Exited with exit code 1", "n2: task 1: Out Of Memory"],
            {"logs/rank-0.result.json": json.dumps({"error": RESET})},
            "rank 1 out of memory (n2)",
        ),
        # Two exit codes: the one whose error is its own, not a peer's.
        (
            ["n1: task 0: Exited with exit code 1", "n3: task 2: Exited with exit code 1"],
            {
                "logs/rank-0.result.json": json.dumps({"error": RESET}),
                "logs/rank-2.result.json": json.dumps({"error": "ValueError: bad shard"}),
            },
            "rank 2 exited with exit code 1 (n3): ValueError: bad shard",
        ),
        # Every rank says a peer left: srun's first.
        (
            ["n1: task 0: Exited with exit code 1", "n3: task 2: Exited with exit code 1"],
            {
                "logs/rank-0.result.json": json.dumps({"error": RESET}),
                "logs/rank-2.result.json": json.dumps({"error": RESET}),
            },
            f"rank 0 exited with exit code 1 (n1): {RESET}",
        ),
    ],
)
def test_a_peer_loss_is_not_blamed_when_a_cause_is_in_sight(job_dir, srun_lines, files, blamed):
    log = STARTING + "".join(f"srun: error: {line}\n" for line in srun_lines)
    shell = forgotten_by_squeue(
        "42|job.sh|FAILED|1:0|3|None|n1\n42.0|python|FAILED|1:0|3||n1\n",
        files={"logs/batch-42.out": log, **files},
    )
    st = SlurmBackend(shell).status(submitted(job_dir))
    assert st.state is JobState.FAILED and st.reason == blamed


def test_forgotten_everywhere_is_unknown(job_dir):
    shell = forgotten_by_squeue("")
    st = SlurmBackend(shell).status(submitted(job_dir))
    assert st.state is JobState.UNKNOWN and "unknown to squeue and sacct" in st.reason


def test_squeue_error_is_user_error(job_dir):
    shell = FakeShell({"squeue": [(1, "", "squeue: error: Unable to contact slurm controller\n")]})
    with pytest.raises(UserError, match="squeue failed: squeue: error: Unable to contact"):
        SlurmBackend(shell).status(submitted(job_dir))


def test_other_backend_refused(job_dir):
    (job_dir / "job.json").write_text(json.dumps({"backend": "local", "job_id": "local-1"}))
    with pytest.raises(UserError, match="submitted with the local backend"):
        SlurmBackend(FakeShell({})).status(job_dir)


def test_a_job_id_that_is_not_digits_never_reaches_scancel(job_dir):
    """job.json is in the job directory, which the job itself can write: a job_id of
    "--user=me" went to scancel as an option (every job of the user cancelled)."""
    shell = FakeShell({"scancel": [(0, "", "")]})
    for bad in ("--user=me", "42 43", "\u0664\u0662"):
        with pytest.raises(UserError, match="is not a Slurm job id"):
            SlurmBackend(shell).cancel(submitted(job_dir, bad))
    assert shell.calls == []


def test_missing_sbatch_is_user_error(job_dir, monkeypatch):
    monkeypatch.setenv("PATH", str(job_dir))  # no Slurm commands here
    with pytest.raises(UserError, match="`sbatch` not found on this machine"):
        SlurmBackend().submit(job_dir)


def test_forgotten_everywhere_is_the_last_word_for_run(job_dir):
    """A job both squeue and sacct forgot stays UNKNOWN: `run` waited on it for ever after its
    logs ended. Nothing will change it, so it is the end (exit 1, UNKNOWN shown)."""
    shell = forgotten_by_squeue("")
    backend = SlurmBackend(shell)
    job = submitted(job_dir)
    assert backend.settled(job, backend.status(job))
    started = time.monotonic()
    assert backend.wait(job, timeout=30).state is JobState.UNKNOWN
    assert time.monotonic() - started < 10  # at once: it waited out its whole timeout


PROBE_FAILED = (
    "srun: error: n1: task 0: Exited with exit code 2\n"
    "srun: error: n2: task 1: Exited with exit code 2\n"
    "12:00:01 ringctl-job: WARNING: no placement (ring.placement=optional): ranks follow Slurm's"
    " task order\n"
)


def test_a_failed_probe_under_optional_placement_is_not_a_failed_job(job_dir):
    """ring.placement=optional: the node probe (step 0) failed, the script went on, both ranks
    (step 1) finished and Slurm said COMPLETED. Status said FAILED, exit 2, blaming "rank 1"
    for the probe's task 1 and adding the queue wait [BeginTime]."""
    shell = forgotten_by_squeue(
        "42|smoke|COMPLETED|0:0|3|BeginTime|n[1-2]\n42.batch|batch|COMPLETED|0:0|3||n1\n"
        "42.0|bash|FAILED|2:0|1||n[1-2]\n42.1|python3|COMPLETED|0:0|2||n[1-2]\n",
        files={"logs/batch-42.out": PROBE_FAILED + STARTING + "ranks finished\n"},
    )
    st = SlurmBackend(shell).status(submitted(job_dir))
    assert st.state is JobState.COMPLETED and st.ranks == {}, st


def test_a_queue_wait_is_not_given_as_why_a_job_ended(job_dir):
    """The ranks failed after a failed probe: rank 3 (of the ranks' srun) is blamed, not the
    probe's tasks, and sacct's last queue wait is not appended."""
    shell = forgotten_by_squeue(
        "42|smoke|FAILED|1:0|3|BeginTime|n1\n42.batch|batch|FAILED|1:0|3||n1\n"
        "42.0|bash|FAILED|2:0|1||n1\n42.1|python3|FAILED|1:0|2||n1\n",
        files={
            "logs/batch-42.out": PROBE_FAILED
            + STARTING
            + "srun: error: n2: task 3: Exited with exit code 1\n",
            "logs/rank-3.err": "ringctl.worker: rank 3 failed: out of patience\n",
        },
    )
    st = SlurmBackend(shell).status(submitted(job_dir))
    assert st.state is JobState.FAILED and st.ranks == {3: "Exited with exit code 1 (n2)"}
    assert st.reason == "rank 3 exited with exit code 1 (n2): rank 3 failed: out of patience"


def test_a_batch_log_longer_than_its_tail_still_blames_a_rank(job_dir):
    """status reads the batch log's last 64 KiB: srun's lines for thousands of ranks pushed
    the "starting N ranks" line out of it, and every srun line was then dropped (the step
    blamed instead of the rank). A tail without the line is srun's."""
    killed = "".join(f"srun: error: n{r:04d}: task {r}: Killed\n" for r in range(8, 3000))
    shell = forgotten_by_squeue(
        "42|job.sh|FAILED|1:0|3|None|n1\n42.1|python|FAILED|1:0|3||n1\n",
        files={
            "logs/batch-42.out": STARTING
            + killed
            + "srun: error: n0007: task 7: Exited with exit code 1\n",
            "logs/rank-7.err": "ringctl.worker: rank 7 failed: CUDA out of memory\n",
        },
    )
    st = SlurmBackend(shell, expected_ranks=4096).status(submitted(job_dir))
    assert st.reason == "rank 7 exited with exit code 1 (n0007): rank 7 failed: CUDA out of memory"


@pytest.mark.parametrize(
    "answer, refused",
    [
        ((1, "", "sbatch: error: invalid partition specified: nopart\n"), True),
        ((-1, "", ""), False),  # a dropped ssh channel, or sbatch killed by a signal
        ((0, "no id here\n", ""), False),
    ],
)
def test_only_sbatchs_own_refusal_reads_as_not_submitted(job_dir, answer, refused):
    """A resume puts the directory back only on NotSubmitted; an ssh channel closed while
    sbatch ran gives exit status -1, which read as "sbatch refused the job: exit -1": the
    directory was put back over a job that may have been queued."""
    shell = FakeShell({"sbatch": [answer], "date": [(0, "2026-11-30T10:00:00\n", "")]})
    with pytest.raises(UserError) as info:
        SlurmBackend(shell).submit(job_dir)
    assert isinstance(info.value, NotSubmitted) is refused, info.value


def test_a_job_json_left_by_a_resume_that_may_have_queued_says_the_way_on(job_dir):
    """It said "no job id in job.json (was the job submitted?)" to every verb."""
    meta = {"backend": "slurm", "job_id": None, "attempts": [{"job_id": "41", "dir": "a/1"}]}
    (job_dir / "job.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="may have been queued; look for it .*resume --force"):
        SlurmBackend(FakeShell({})).status(job_dir)
