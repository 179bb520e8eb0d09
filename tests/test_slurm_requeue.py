"""Node failures and Slurm's own requeues, on the real test cluster, through rendered jobs.

The cluster's default (JobRequeue=1) requeues a job after a node failure unless the script says
`--no-requeue`; a requeued run used to truncate the earlier run's logs, and `status` kept no
trace of the failure. Here one node is failed for real (`scontrol update state=down`) under two
hanging jobs pinned to it: the one with slurm.requeue=false must end FAILED naming NODE_FAIL
and the node, the other must run again with its first run's logs kept in
attempts/requeue-<id>-1/. Then `scontrol requeue` reruns it once more.

Other sessions use the cluster: the node is drained first (no new job lands there), taken down
only once our two jobs are the only ones on it, and resumed in a `finally` within seconds.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from ringctl.backends.base import JobState
from ringctl.cli import main
from ringctl.submission import open_job_dir
from tests.local_jobs import submit, wait_for

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "jobs" / "smoke.yaml")
REASON = "ringctl-test-node-failure"  # the node event's reason: status must repeat it


def scontrol(*argv: str, check: bool = True) -> str:
    proc = subprocess.run(["scontrol", *argv], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 or not check, f"scontrol {argv}: {proc.stderr}"
    return proc.stdout


def job_field(job_id: str, key: str) -> str:
    m = re.search(rf"(?:^|\s){key}=(\S*)", scontrol("show", "job", job_id))
    return m.group(1) if m else ""


def jobs_on(node: str) -> set[str]:
    out = subprocess.run(
        ["squeue", "-h", "-w", node, "-t", "RUNNING,COMPLETING,CONFIGURING", "-o", "%i"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    return set(out.split())


def quietest_node(nodes: tuple[str, ...]) -> str:
    return min(reversed(nodes), key=lambda n: len(jobs_on(n)))


def _status(job_dir: Path):
    _, _, backend = open_job_dir(job_dir)
    return backend.status(job_dir)


def _logs(job_dir: Path, capsys) -> str:
    capsys.readouterr()
    assert main(["logs", str(job_dir)]) == 0
    return capsys.readouterr().out


def _job_id(job_dir: Path) -> str:
    return _status(job_dir).job_id


def _started(job_dir: Path) -> bool:
    """Both ranks are in their task (one hangs, one waits for it): the run has logs worth
    keeping, and writes no more to them (the worker's first line comes before the task's)."""
    logs = [job_dir / "logs" / f"rank-{r}.out" for r in (0, 1)]
    return all(log.exists() and "] attention: " in log.read_text() for log in logs)


def _reran(job_dir: Path, job_id: str, restart: int) -> bool:
    """The rerun's script has kept the earlier run (it says so once everything is moved)."""
    batch = job_dir / "logs" / f"batch-{job_id}.out"
    said = f"Slurm reran job {job_id} (restart {restart})"
    return batch.exists() and said in batch.read_text()


def fail_node(node: str, ours: set[str], timeout: float = 180) -> None:
    """Drain the node, wait until only our jobs run there, then take it down (NODE_FAIL)."""
    scontrol("update", f"nodename={node}", "state=drain", f"reason={REASON}")
    wait_for(lambda: jobs_on(node) <= ours, timeout, f"other jobs to leave {node}")
    scontrol("update", f"nodename={node}", "state=down", f"reason={REASON}")


def restore_node(node: str) -> None:
    """Back to service (ReturnToService=2 may have done it already: then resume is refused).
    Only a drain of ours is lifted: ours, or Slurm's "Duplicate jobid" after a rerun landed
    on a node that never heard its first run ended (`start_now` prevents it)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        shown = scontrol("show", "node", node)
        if not re.search(r"State=\S*(DOWN|DRAIN|FAIL)", shown):
            return
        if REASON not in shown and "Duplicate jobid" not in shown:
            return  # somebody else's drain: not ours to lift
        scontrol("update", f"nodename={node}", "state=resume", check=False)
        time.sleep(0.5)
    raise AssertionError(f"{node} did not come back: {scontrol('show', 'node', node)}")


def wait_steps_gone(job_id: str, timeout: float = 60) -> None:
    """Until no slurmstepd of the job's last run is left on this machine (the emulated nodes'
    daemons run here). A step outlives its run by seconds ("Failed to send
    MESSAGE_TASK_EXIT"); a rerun launched before it is gone is refused as a duplicate job and
    its node drained. Slurm's own 2-minute delay before a requeued job starts is what covers
    this on a real cluster; the test shortens the delay, so it waits for the steps itself."""

    def gone() -> bool:
        for proc in Path("/proc").iterdir():
            try:
                title = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if title.startswith(f"slurmstepd: [{job_id}.".encode()):
                return False
        return True

    wait_for(gone, timeout, f"the steps of job {job_id} to end")


def start_now(job_id: str, *, avoid: str | None = None) -> None:
    """Start a requeued job now (not after Slurm's 2-minute delay), once its steps are gone;
    `avoid`: on another node than this one. A node that failed under a job (here: came back at
    once) is never told that job ended, so its slurmd would refuse the job as a duplicate and
    drain itself; a real failed node reboots first."""
    wait_for(lambda: job_field(job_id, "JobState") == "PENDING", 60, f"job {job_id} requeued")
    wait_steps_gone(job_id)
    # slurmd refuses a credential made no later than the second in which it revoked the job's
    # ("Job N already killed, do not launch batch job": the rerun ends FAILED at once, its
    # script never run); the revocation was at most now, so a new one must come a second on
    time.sleep(1.5)
    if avoid:
        scontrol("update", f"jobid={job_id}", "ReqNodeList=", f"ExcNodeList={avoid}")
    scontrol("update", f"jobid={job_id}", "starttime=now")


def test_node_failure_ends_or_requeues_as_configured(slurm_cluster, tmp_path, capsys):
    node = quietest_node(slurm_cluster.nodes)
    common = [
        SMOKE,
        "backend=slurm",
        f"output_dir={tmp_path}",
        "nodes=1",
        "tasks_per_node=2",
        "task.fault_rank=0",
        "task.fault=hang",
        "timeout=600",
        "slurm.time=00:10:00",
        f"slurm.extra_sbatch=[--nodelist={node}]",
    ]
    ended = submit(capsys, *common, "name=no-requeue", "slurm.requeue=false")
    rerun = submit(capsys, *common, "name=requeue", "slurm.requeue=true")
    ended_id, rerun_id = _job_id(ended), _job_id(rerun)
    try:
        # what the script says, as Slurm holds it (the cluster's default would be 1 for both)
        assert job_field(ended_id, "Requeue") == "0" and job_field(rerun_id, "Requeue") == "1"
        wait_for(lambda: _started(ended) and _started(rerun), 120, "both jobs to start")
        first_run = (rerun / "logs" / "rank-1.out").read_text()
        try:
            fail_node(node, {ended_id, rerun_id})
        finally:
            restore_node(node)

        # slurm.requeue=false: the job ends, and says a node failed, which one and why
        status = wait_for(lambda: (s := _status(ended)).state.finished and s, 60, "NODE_FAIL")
        assert status.state is JobState.FAILED, status
        # (the accounting keeps one event from drain to down, stamped DRAIN: a node that dies
        # without a drain reads "DOWN (Not responding)")
        assert status.reason.startswith(f"node failure (NODE_FAIL) on {node}: "), status
        assert f"({REASON})" in status.reason and "\n" not in status.reason
        assert job_field(ended_id, "JobState") == "NODE_FAIL"  # the independent word
        assert f"[slurm] job {ended_id} ended: node failure (NODE_FAIL) on {node}" in _logs(
            ended, capsys
        )
        assert not (ended / "attempts").exists()

        # slurm.requeue=true: Slurm runs it again (now, not after its 2-minute delay)
        wait_for(lambda: job_field(rerun_id, "Restarts") == "1", 60, "the requeue")
        start_now(rerun_id, avoid=node)
        kept = rerun / "attempts" / f"requeue-{rerun_id}-1"
        wait_for(lambda: _reran(rerun, rerun_id, 1), 120, "the rerun to keep the first run")
        wait_for(lambda: _started(rerun), 120, "the rerun to start")
        assert (kept / "logs" / "rank-1.out").read_text() == first_run  # kept as it was
        batch = f"batch-{rerun_id}.out"
        assert "starting 2 ranks" in (kept / "logs" / batch).read_text()  # the first run's
        now = (rerun / "logs" / batch).read_text()
        assert f"Slurm reran job {rerun_id} (restart 1)" in now and now.count("starting 2") == 1
        status = _status(rerun)
        assert status.state is JobState.RUNNING, status
        assert f"requeued by Slurm 1x: run 1 of job {rerun_id} ended NODE_FAIL on {node}: " in (
            status.reason
        )
        assert REASON in status.reason and f"attempts/requeue-{rerun_id}-1" in status.reason
        assert f"[slurm] run 1 of job {rerun_id} ended NODE_FAIL on {node}" in _logs(rerun, capsys)

        # an administrator's requeue: kept the same way, counted as a second rerun (started
        # away from the node it ran on: under load that slurmd may still be ending the run)
        ran_on = job_field(rerun_id, "BatchHost")
        scontrol("requeue", rerun_id)
        wait_for(lambda: job_field(rerun_id, "Restarts") == "2", 60, "the second requeue")
        start_now(rerun_id, avoid=ran_on or None)
        wait_for(lambda: _reran(rerun, rerun_id, 2), 120, "the second rerun")
        wait_for(lambda: _started(rerun), 120, "the second rerun to start")
        assert (kept / "logs" / "rank-1.out").read_text() == first_run  # never overwritten
        status = _status(rerun)
        assert f"requeued by Slurm 2x: run 1 of job {rerun_id} ended NODE_FAIL" in status.reason
        assert f"run 2 of job {rerun_id} ended REQUEUED" in status.reason
    finally:
        subprocess.run(["scancel", ended_id, rerun_id], capture_output=True, timeout=30)
        restore_node(node)
