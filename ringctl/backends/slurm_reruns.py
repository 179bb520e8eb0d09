"""What Slurm did to a job besides running it: a node that failed under it (NODE_FAIL), and the
runs it requeued, in words for `status` and `logs`.

A job with `--requeue` (slurm.requeue=true) that loses a node, is preempted or is requeued by
`scontrol requeue` runs again under the same id; its batch script then moves the earlier run's
logs to attempts/requeue-<id>-<k>/ (templates/slurm.sh.j2). sacct keeps one record per run
(`--duplicates`), and the accounting's node events say which node went down and why. Without
these words a rerun that ends COMPLETED shows no trace of the failure, and a NODE_FAIL job
reads like any failed one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..errors import UserError
from ..jobdir import requeued_attempt
from . import slurm_states as ss

Run = Callable[[Sequence[str]], tuple[int, str, str]]  # a Shell's run, with its timeout

SHOWN_RERUNS = 3  # earlier runs described one by one; more are counted


def node_failure(run: Run, record: ss.AcctRecord) -> str:
    """`node failure (NODE_FAIL) on n4: DOWN (Not responding)`: the reason of a run that ended
    NODE_FAIL."""
    return f"node failure (NODE_FAIL) on {failed_nodes(run, record)}"


def failed_nodes(run: Run, record: ss.AcctRecord) -> str:
    """`n4: DOWN (Not responding)`: the run's nodes that went down while it ran, from the
    accounting's node events; without any (no accounting, no rights), the run's nodes."""
    down: dict[str, ss.NodeEvent] = {}
    for event in _node_events(run, record):  # per node, its last DOWN/FAIL event, else its last
        if _is_down(event) or not (event.node in down and _is_down(down[event.node])):
            down[event.node] = event
    if down:
        return ", ".join(
            f"{e.node}: {e.state}" + (f" ({e.reason})" if e.reason else "") for e in down.values()
        )
    nodes = record.nodes or "its nodes"
    return nodes if "," not in nodes and "[" not in nodes else f"one of {nodes}"


def _is_down(event: ss.NodeEvent) -> bool:
    """A drained node still runs its jobs; a DOWN (or FAIL) one is what ended them."""
    return "DOWN" in event.state.upper() or "FAIL" in event.state.upper()


def _node_events(run: Run, record: ss.AcctRecord) -> list[ss.NodeEvent]:
    argv = ss.node_events_argv(record.nodes, record.start, record.end) if record.nodes else None
    if argv is None:
        return []
    try:
        rc, out, _ = run(argv)
    except UserError:  # a timeout, a lost connection: the node list says less, but still says
        return []
    return ss.parse_node_events(out) if rc == 0 else []


def ended(run: Run, record: ss.AcctRecord) -> str:
    """How one run ended, in words: its state, and for NODE_FAIL which node failed."""
    if ss.is_node_failure(record):
        return f"NODE_FAIL on {failed_nodes(run, record)}"
    return ss.state_word(record.raw_state) or "?"


# Where the k-th rerun kept the run before it (its directory, in words), None where it did not.
Kept = Callable[[int], "str | None"]


def _where_kept(job_id: str, k: int, kept: Kept | None) -> str:
    """Where run k's logs are: attempts/requeue-<id>-<k>, once the k-th rerun has made it
    (never before it starts, nor when it stopped without: a symbolic link in the way)."""
    place = requeued_attempt(job_id, k)
    where = place if kept is None else kept(k)
    if where:
        return f"its logs are in {where}"
    return f"its logs are not kept ({place} not made: the rerun has not started, or failed)"


def rerun_lines(
    run: Run,
    job_id: str,
    earlier: list[list[ss.AcctRecord]],
    restarts: int,
    last: int = 0,
    kept: Kept | None = None,
) -> list[str]:
    """One line per earlier run of a requeued job (the `last` ones only, when given): how it
    ended and where its logs are (`kept`: whether they are there). `earlier` are sacct's
    records of the runs before the last (fewer than `restarts`, squeue's count, when
    accounting is missing or behind)."""
    count = max(restarts, len(earlier))
    lines = []
    for k in range(max(1, count - last + 1) if last else 1, count + 1):
        records = earlier[k - 1] if k - 1 < len(earlier) else []
        job = records[0] if records and records[0].step is None else None
        how = f"ended {ended(run, job)}" if job is not None else "was requeued"
        lines.append(f"run {k} of job {job_id} {how}; {_where_kept(job_id, k, kept)}")
    return lines


def rerun_summary(
    run: Run,
    job_id: str,
    earlier: list[list[ss.AcctRecord]],
    restarts: int,
    kept: Kept | None = None,
) -> str:
    """`requeued by Slurm 1x: run 1 of job 42 ended NODE_FAIL on n4: DOWN (test); its logs are
    in attempts/requeue-42-1` ("" when Slurm never requeued the job); the last SHOWN_RERUNS
    runs are described (each node failure costs a sacctmgr call), the others counted."""
    count = max(restarts, len(earlier))
    if not count:
        return ""
    lines = rerun_lines(run, job_id, earlier, restarts, last=SHOWN_RERUNS, kept=kept)
    shown = "; ".join(lines)
    more = f" (and {count - SHOWN_RERUNS} earlier)" if count > SHOWN_RERUNS else ""
    return f"requeued by Slurm {count}x: {shown}{more}"
