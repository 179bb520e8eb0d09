"""Parsing of squeue/sacct/srun output (no cluster needed)."""

from __future__ import annotations

import dataclasses

import pytest

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
    assert ss.map_state("PREEMPTED") is JobState.CANCELLED  # final: it was PENDING for ever
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


STARTING = "12:00:00 ringctl-job: starting 8 ranks; rendezvous at n1:20042\n"


def test_srun_errors_pick_the_rank_that_failed_first():
    log = STARTING + (
        "srun: error: n4: task 3: Terminated\n"
        "srun: error: n2: task 1: Exited with exit code 3\n"
        "srun: error: n3: tasks 2,5-6: Killed\n"
    )
    tasks = ss.parse_srun_errors(ss.ranks_part(log))
    assert sorted(tasks) == [1, 2, 3, 5, 6]
    assert ss.failed_tasks(tasks)[0] == (1, "Exited with exit code 3 (n2)")
    assert ss.failed_tasks(ss.parse_srun_errors("nothing here")) == []


def test_srun_lines_before_the_ranks_started_are_not_ranks():
    """Under ring.placement=optional the script goes on after a failed node probe; the
    probe's srun lines (task ids are nodes) were read as ranks failing, and a job whose ranks
    all finished read FAILED, blaming rank 1."""
    probe = "srun: error: n1: task 0: Exited with exit code 2\nsrun: error: n2: task 1: x\n"
    assert ss.ranks_part(probe) is None  # the ranks never started
    assert ss.parse_srun_errors(ss.ranks_part(probe + STARTING)) == {}
    later = probe + STARTING + "srun: error: n2: task 3: Exited with exit code 1\n"
    assert ss.parse_srun_errors(ss.ranks_part(later)) == {3: "Exited with exit code 1 (n2)"}
    # a log read from its tail, past the line (srun's lines filled it): all of it is srun's
    assert ss.parse_srun_errors(ss.ranks_part(probe, cut=True)) == {
        0: "Exited with exit code 2 (n1)",
        1: "x (n2)",
    }


def test_a_failed_probe_step_is_not_the_job_once_the_ranks_started():
    records = ss.parse_sacct(
        "9|smoke|COMPLETED|0:0|1|None|n1\n9.batch|batch|COMPLETED|0:0|1||n1\n"
        "9.0|bash|FAILED|2:0|1||n1\n9.1|python3|COMPLETED|0:0|1||n1\n",
        "9",
    )
    assert ss.failing_step(records).step == "0"  # before the ranks: the probe is the cause
    assert ss.failing_step(records, ranks_started=True) is None
    ranks_failed = [
        dataclasses.replace(r, raw_state="FAILED") if r.step == "1" else r for r in records
    ]
    assert ss.failing_step(ranks_failed, ranks_started=True).step == "1"


@pytest.mark.timeout(10)
def test_a_huge_task_range_is_bounded_by_the_world():
    """The batch log is the job's to write: `tasks 0-4294967295` made every status build
    billions of entries (minutes, gigabytes)."""
    log = "srun: error: n1: tasks 0-999999999,0-4294967295,7-3: Killed\n"
    assert sorted(ss.parse_srun_errors(log, 4)) == [0, 1, 2, 3]
    assert len(ss.parse_srun_errors(log)) == ss.MAX_RANKS


def test_error_summary():
    err = "Traceback (most recent call last):\n  File x\nValueError: bad shape\n\n"
    assert error_summary(err) == "ValueError: bad shape"
    assert error_summary("just words\nlast line\n") == "last line"
    assert error_summary("") == ""


def test_parse_squeue_restart_count():
    # squeue --Format=JobID:|,State:|,Reason:|,TimeUsed:|,RestartCnt:| (each field ends in |)
    out = "22|PENDING|BeginTime|0:00|1|\n23|RUNNING|None|0:05|0|\n"
    assert ss.parse_squeue(out, "22").restarts == 1
    assert ss.parse_squeue(out, "23").restarts == 0
    assert ss.parse_squeue("24|RUNNING|None|0:05\n", "24").restarts == 0  # the older format


# sacct --duplicates of job 22 on the test cluster: its node failed (requeued), then it reran
RUNS = """\
22|j.sh|NODE_FAIL|0:0|4|None|n4|2026-12-02T02:15:03|2026-12-02T02:15:07
22.batch|batch|CANCELLED||4||n4|2026-12-02T02:15:03|2026-12-02T02:15:07
22.0|bash|CANCELLED||4||n4|2026-12-02T02:15:03|2026-12-02T02:15:07
22|j.sh|CANCELLED by 0|0:0|4|BeginTime|n4|2026-12-02T02:15:26|2026-12-02T02:15:30
22.batch|batch|CANCELLED|0:15|4||n4|2026-12-02T02:15:26|2026-12-02T02:15:30
"""


def test_parse_sacct_runs_keeps_each_run():
    runs = ss.parse_sacct_runs(RUNS, "22")
    assert [[r.step for r in run] for run in runs] == [[None, "0", "batch"], [None, "batch"]]
    assert ss.is_node_failure(runs[0][0]) and not ss.is_node_failure(runs[1][0])
    assert (runs[0][0].start, runs[0][0].end) == ("2026-12-02T02:15:03", "2026-12-02T02:15:07")
    assert ss.parse_sacct(RUNS, "22") == runs[1]  # the last run, as before --duplicates


def test_node_failure_names_the_node_from_its_events_or_the_run():
    from ringctl.backends import slurm_reruns

    first = ss.parse_sacct_runs(RUNS, "22")[0][0]
    argv = ss.node_events_argv(first.nodes, first.start, first.end)
    assert argv[-3:-1] == ["start=2026-12-02T02:15:03", "end=2026-12-02T02:16:07"]
    events = (
        "n4|2026-12-02T02:15:05|DRAIN|maintenance|x\nn4|2026-12-02T02:15:07|DOWN|Not responding\n"
    )
    answers = {"sacctmgr": (0, events, "")}

    def run(argv):
        return answers[argv[0]]

    assert ss.parse_node_events(events)[0].reason == "maintenance|x"
    assert slurm_reruns.node_failure(run, first) == (
        "node failure (NODE_FAIL) on n4: DOWN (Not responding)"
    )
    summary = slurm_reruns.rerun_summary(run, "22", [ss.parse_sacct_runs(RUNS, "22")[0]], 1)
    assert summary == (
        "requeued by Slurm 1x: run 1 of job 22 ended NODE_FAIL on n4: DOWN (Not responding); "
        "its logs are in attempts/requeue-22-1"
    )
    answers["sacctmgr"] = (1, "", "sacctmgr: error: access denied")  # no events: the run's nodes
    wide = ss.AcctRecord("9", None, "j", "NODE_FAIL", 0, 0, 1.0, "", "n[1-2]", "x", "y")
    assert slurm_reruns.node_failure(run, wide) == "node failure (NODE_FAIL) on one of n[1-2]"
    assert slurm_reruns.rerun_summary(run, "9", [], 2).startswith(
        "requeued by Slurm 2x: run 1 of job 9 was requeued; its logs are in attempts/requeue-9-1"
    )


@pytest.mark.parametrize(
    "reason, shown",
    [
        ("BeginTime", ""),
        ("QOSMaxJobsPerUserLimit", ""),
        ("AssocGrpCpuLimit", ""),
        ("PartitionTimeLimit", ""),
        ("NodeDown", "NodeDown"),
        ("NonZeroExitCode", "NonZeroExitCode"),
    ],
)
def test_a_queue_wait_is_no_reason_for_an_end(reason, shown):
    record = ss.parse_sacct(f"9|smoke|FAILED|1:0|1|{reason}|n1\n", "9")[0]
    assert ss.ended_reason(record) == shown
