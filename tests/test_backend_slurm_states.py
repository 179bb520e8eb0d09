"""Parsing of squeue/sacct/srun output (no cluster needed)."""

from __future__ import annotations

from ringctl.backends import slurm_states as ss
from ringctl.backends.base import JobState
from ringctl.backends.joblogs import error_summary


def test_map_state():
    assert ss.map_state("CANCELLED by 0") is JobState.CANCELLED
    assert ss.map_state("RUNNING") is JobState.RUNNING
    assert ss.map_state("COMPLETING") is JobState.RUNNING
    assert ss.map_state("TIMEOUT") is JobState.TIMEOUT
    assert ss.map_state("OUT_OF_MEMORY") is JobState.FAILED
    assert ss.map_state("NODE_FAIL") is JobState.FAILED
    assert ss.map_state("PREEMPTED") is JobState.PENDING
    assert ss.map_state("REQUEUED") is JobState.PENDING
    assert ss.map_state("") is JobState.UNKNOWN
    assert ss.map_state("WEIRD") is JobState.UNKNOWN


def test_parse_duration():
    assert ss.parse_duration("0:05") == 5
    assert ss.parse_duration("1:02:03") == 3723
    assert ss.parse_duration("2-00:00:01") == 172801
    assert ss.parse_duration("INVALID") is None


def test_parse_squeue():
    out = "12|PENDING|Priority|0:00\n13|RUNNING|None|1:05\n"
    e = ss.parse_squeue(out, "13")
    assert e is not None and e.state is JobState.RUNNING and e.reason == "" and e.elapsed_s == 65
    e = ss.parse_squeue(out, "12")
    assert e is not None and e.state is JobState.PENDING and e.reason == "Priority"
    assert ss.parse_squeue(out, "14") is None
    assert ss.squeue_says_unknown("slurm_load_jobs error: Invalid job id specified")


SACCT = """\
7|job.sh|FAILED|1:0|3|None|n[1-2]
7.batch|batch|FAILED|1:0|3||n1
7.extern|extern|COMPLETED|0:0|3||n[1-2]
7.0|bash|COMPLETED|0:0|1||n[1-2]
7.1|python3|FAILED|3:0|1||n[1-2]
70|other|COMPLETED|0:0|1|None|n1
"""


def test_parse_sacct_and_failing_step():
    records = ss.parse_sacct(SACCT, "7")
    assert [r.step for r in records] == [None, "0", "1", "batch", "extern"]
    job = records[0]
    assert job.state is JobState.FAILED and job.exit_code == 1 and job.elapsed_s == 3
    step = ss.failing_step(records)
    assert step is not None and step.step == "1" and step.exit_code == 3
    ok = ss.parse_sacct("8|x|COMPLETED|0:0|1|None|n1\n8.batch|batch|COMPLETED|0:0|1||n1\n", "8")
    assert ss.failing_step(ok) is None


def test_srun_errors_pick_the_rank_that_failed_first():
    log = (
        "srun: error: n4: task 3: Terminated\n"
        "srun: error: n2: task 1: Exited with exit code 3\n"
        "srun: error: n3: tasks 2,5-6: Killed\n"
    )
    tasks = ss.parse_srun_errors(log)
    assert sorted(tasks) == [1, 2, 3, 5, 6]
    assert ss.first_failed_task(log) == (1, "Exited with exit code 3 (n2)")
    assert ss.first_failed_task("nothing here") is None


def test_error_summary():
    err = "Traceback (most recent call last):\n  File x\nValueError: bad shape\n\n"
    assert error_summary(err) == "ValueError: bad shape"
    assert error_summary("just words\nlast line\n") == "last line"
    assert error_summary("") == ""
