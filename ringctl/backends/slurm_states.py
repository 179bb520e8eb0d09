"""Reading Slurm's answers: `squeue`/`sacct` output, job states, and `srun`'s error lines.

Shared by the `slurm` backend (commands run here) and the `ssh` backend (the same commands run on
a login node). Pure functions over text, so they are tested without a cluster.

submitit's `SlurmInfoWatcher.read_info` parses sacct too, but keeps only the job's own line and
drops the steps; telling "the script exited 0 but step 0 failed" needs the steps, hence this.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta

from ..config import MAX_RANKS
from ..text import ascii_number
from .base import JobState

# squeue's and sacct's state names (long form) -> our states.
# Requeued jobs go back to the queue, so they read as PENDING until a final state arrives.
# PREEMPTED is final ("terminated due to preemption"): a job Slurm requeues after preempting it
# reads PENDING/REQUEUED instead. Read as PENDING, a preempted job (ringctl writes --no-requeue)
# never ended: `run`, `wait` and `logs -f` waited for ever.
_STATE_MAP: dict[str, JobState] = {
    "PENDING": JobState.PENDING,
    "CONFIGURING": JobState.PENDING,
    "REQUEUED": JobState.PENDING,
    "REQUEUE_FED": JobState.PENDING,
    "REQUEUE_HOLD": JobState.PENDING,
    "RESV_DEL_HOLD": JobState.PENDING,
    "RUNNING": JobState.RUNNING,
    "COMPLETING": JobState.RUNNING,
    "RESIZING": JobState.RUNNING,
    "SUSPENDED": JobState.RUNNING,
    "STOPPED": JobState.RUNNING,
    "SIGNALING": JobState.RUNNING,
    "STAGE_OUT": JobState.RUNNING,
    "COMPLETED": JobState.COMPLETED,
    "CANCELLED": JobState.CANCELLED,
    "REVOKED": JobState.CANCELLED,
    "PREEMPTED": JobState.CANCELLED,
    "TIMEOUT": JobState.TIMEOUT,
    "DEADLINE": JobState.TIMEOUT,
    "FAILED": JobState.FAILED,
    "NODE_FAIL": JobState.FAILED,
    "BOOT_FAIL": JobState.FAILED,
    "OUT_OF_MEMORY": JobState.FAILED,
    "SPECIAL_EXIT": JobState.FAILED,
}


def state_word(raw: str) -> str:
    """Slurm's state name alone: `CANCELLED by 0` -> CANCELLED, `OUT_OF_MEMORY+` -> ..."""
    return raw.strip().split(" ")[0].rstrip("+").upper() if raw.strip() else ""


def map_state(raw: str) -> JobState:
    """`CANCELLED by 0`, `RUNNING`, `OUT_OF_MEMORY+` -> JobState (UNKNOWN if unrecognised)."""
    return _STATE_MAP.get(state_word(raw), JobState.UNKNOWN)


def parse_duration(text: str) -> float | None:
    """Slurm's `[days-][hours:]minutes:seconds` (squeue %M, sacct Elapsed) -> seconds."""
    text = text.strip()
    if not text or text in ("INVALID", "UNLIMITED", "Partition_Limit", "N/A"):
        return None
    days = 0
    if "-" in text:
        d, text = text.split("-", 1)
        days = int(d)
    parts = [float(p) for p in text.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0.0)
    h, m, s = parts[-3:]
    return days * 86400 + h * 3600 + m * 60 + s


def parse_exit_code(text: str) -> tuple[int | None, int | None]:
    """sacct's `ExitCode` "code:signal" -> (code, signal); ("", ...) -> (None, None)."""
    text = text.strip()
    if not text or ":" not in text:
        return None, None
    code, sig = text.split(":", 1)
    try:
        return int(code), int(sig)
    except ValueError:
        return None, None


# ---------------------------------------------------------------------------------------------
# squeue

# --Format (not --format: its letters have no restart count), each field ended by `|`; the
# columns of `--format=%i|%T|%r|%M`, then how often Slurm requeued the job.
SQUEUE_FIELDS = ("JobID", "State", "Reason", "TimeUsed", "RestartCnt")


# What sbatch --parsable prints first: ASCII digits, at most 10 (Slurm's job ids are 32-bit).
# Unbounded, one job.json holding 5,000 digits failed every job's row of a shared listing
# (int() refuses over 4,300 digits) and a few such ids passed the argument limit.
SLURM_JOB_ID = re.compile(r"[0-9]{1,10}")


def squeue_argv(job_id: str) -> list[str]:
    # `-t all` so that a job finished less than MinJobAge ago is still shown with its end state.
    fields = ",".join(f"{name}:|" for name in SQUEUE_FIELDS)
    return ["squeue", "--noheader", "--states=all", f"--jobs={job_id}", f"--Format={fields}"]


@dataclass
class QueueEntry:
    job_id: str
    raw_state: str
    reason: str
    elapsed_s: float | None
    restarts: int = 0  # how often Slurm reran the job (requeued it) under this id

    @property
    def state(self) -> JobState:
        return map_state(self.raw_state)


def parse_squeue(out: str, job_id: str) -> QueueEntry | None:
    """The line of `job_id` in output of `squeue_argv`, or None when squeue does not know it."""
    for line in out.splitlines():
        fields = line.strip().split("|")
        if len(fields) < 4 or fields[0] != job_id:
            continue
        reason = fields[2].strip()
        if reason in ("None", "(null)"):
            reason = ""
        restarts = fields[4].strip() if len(fields) > 4 else ""
        return QueueEntry(
            fields[0],
            fields[1].strip(),
            reason,
            parse_duration(fields[3]),
            ascii_number(restarts, 9) or 0,
        )
    return None


def squeue_says_unknown(err: str) -> bool:
    """squeue exits 1 with this once the job left its memory (MinJobAge after the end)."""
    return "Invalid job id" in err


# ---------------------------------------------------------------------------------------------
# sacct

SACCT_FIELDS = [
    "JobIDRaw",
    "JobName",
    "State",
    "ExitCode",
    "ElapsedRaw",
    "Reason",
    "NodeList",
    "Start",
    "End",
]
_SACCT_REQUIRED = 7  # lines of an older ringctl's format (no Start, End) still parse


def sacct_argv(job_id: str, since: str | None = None) -> list[str]:
    """sacct for one job; ``since`` (the cluster's local time shortly before submission) keeps
    out an older job that had the same id (ids restart when a controller's state is lost).
    `--duplicates`: a job Slurm requeued has one record per run, earliest first; without it
    sacct shows the last run only, and the node failure that caused the rerun is lost."""
    return [
        "sacct",
        "--noheader",
        "--parsable2",
        "--duplicates",
        f"--jobs={job_id}",
        *([f"--starttime={since}"] if since else []),
        "--format=" + ",".join(SACCT_FIELDS),
    ]


@dataclass
class AcctRecord:
    """One line of sacct: the job itself (step is None) or one of its steps."""

    job_id: str
    step: str | None  # "batch", "extern", "0", "1", ... or None for the job
    name: str
    raw_state: str
    exit_code: int | None
    signal: int | None
    elapsed_s: float | None
    reason: str
    nodes: str
    start: str = ""  # the cluster's local time, as sacct prints it ("Unknown" before it ran)
    end: str = ""

    @property
    def state(self) -> JobState:
        return map_state(self.raw_state)


def parse_sacct(out: str, job_id: str) -> list[AcctRecord]:
    """Output of `sacct_argv` -> the records of `job_id`'s last run (job line first, then its
    steps); `parse_sacct_runs` has the earlier runs of a requeued job too."""
    runs = parse_sacct_runs(out, job_id)
    return runs[-1] if runs else []


def parse_sacct_runs(out: str, job_id: str) -> list[list[AcctRecord]]:
    """Output of `sacct_argv` -> one list of records per run of `job_id`, in sacct's order
    (earliest first): each job line starts a run, the step lines after it are that run's."""
    runs: list[list[AcctRecord]] = []
    for line in out.splitlines():
        record = _acct_record(line.split("|"), job_id)
        if record is None:
            continue
        if record.step is None or not runs:
            runs.append([])
        runs[-1].append(record)
    for run in runs:
        run.sort(key=lambda r: (r.step is not None, r.step or ""))
    return runs


# sacct's default time format (and ringctl's sacct_since)
CLOCK = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}", re.ASCII)
_NOT_ENDED = ("", "Unknown", "None")


def is_clock(text) -> bool:
    """A time in sacct's default format that is a real one (sacct reads 2026-11-31 as
    December 1st: compared as text, such a time sorts before days it follows)."""
    if not isinstance(text, str) or not CLOCK.fullmatch(text):
        return False
    try:
        datetime.strptime(text, "%Y-%m-%dT%H:%M:%S")
    except ValueError:
        return False
    return True


def runs_ended_since(out: str, job_id: str, since: str | None) -> list[list[AcctRecord]] | None:
    """``parse_sacct_runs`` of an sacct asked from an earlier time than ``since`` (a
    listing's one sacct for many jobs), keeping what ``--starttime=since`` keeps: the runs,
    and the steps, not ended before it (an older job that had the same id ended before this
    one was submitted). None where ``since`` or an end is not sacct's usual clock
    (SLURM_TIME_FORMAT set on the cluster; a hostile job.json): the job then asks for
    itself."""
    if since is not None and not is_clock(since):
        return None
    runs = parse_sacct_runs(out, job_id)
    if since is None:
        return runs
    kept = []
    for run in runs:
        if any(r.end not in _NOT_ENDED and not is_clock(r.end) for r in run):
            return None
        has_job_line = any(r.step is None for r in run)
        run = [r for r in run if r.end in _NOT_ENDED or r.end >= since]
        if run and (run[0].step is None or not has_job_line):  # the job's line kept
            kept.append(run)
    return kept


def _acct_record(fields: list[str], job_id: str) -> AcctRecord | None:
    """One sacct line of `job_id` as a record; None for another job's or a short line."""
    if len(fields) < _SACCT_REQUIRED:
        return None
    raw_id, name, state, exit_code, elapsed, reason, nodes = fields[:_SACCT_REQUIRED]
    seconds = ascii_number(elapsed.strip(), 12)  # ElapsedRaw
    start, end = (fields[7:9] + ["", ""])[:2]
    base, _, step = raw_id.partition(".")
    if base != job_id:
        return None
    code, sig = parse_exit_code(exit_code)
    return AcctRecord(
        job_id=base,
        step=step or None,
        name=name,
        raw_state=state.strip(),
        exit_code=code,
        signal=sig,
        elapsed_s=None if seconds is None else float(seconds),
        reason="" if reason.strip() in ("None", "") else reason.strip(),
        nodes=nodes.strip(),
        start=start.strip(),
        end=end.strip(),
    )


def failing_step(records: list[AcctRecord], *, ranks_started: bool = False) -> AcctRecord | None:
    """The first step (srun steps before the batch script) that did not complete; once the
    ranks started, only theirs (the script's last srun) and the script: a node probe that
    failed under ring.placement=optional is not the job failing (a job whose ranks all
    finished read FAILED, exit 2)."""
    steps = [r for r in records if r.step is not None and r.step != "extern"]
    steps.sort(key=lambda r: (ascii_number(r.step, 9) is None, ascii_number(r.step, 9) or 0))
    if ranks_started:
        numbered = [r for r in steps if ascii_number(r.step, 9) is not None]
        steps = numbered[-1:] + [r for r in steps if ascii_number(r.step, 9) is None]
    bad = (JobState.FAILED, JobState.TIMEOUT, JobState.CANCELLED)
    for r in steps:
        if r.state in bad or (r.state is JobState.COMPLETED and (r.exit_code or 0) != 0):
            return r
    return None


# sacct's Reason is the last reason the job waited: on an ended job, a wait in the queue says
# nothing of how it ended ("FAILED: rank 1 exited ... [BeginTime]"). Slurm's wait reasons
# (job_state_reason_string), by name or by family.
QUEUE_WAITS = (
    "BeginTime",
    "Priority",
    "Resources",
    "Dependency",
    "Reservation",
    "JobHeld",
    "QOS",
    "Assoc",
    "Partition",
    "ReqNodeNotAvail",
    "JobArrayTaskLimit",
    "Licenses",
    "Nodes",
    "FrontEnd",
    "BurstBuffer",
    "Prolog",
    "PowerUp",
    "Reconfig",
    "Cleaning",
    "MaxRequeue",
)


def ended_reason(record: AcctRecord) -> str:
    """Slurm's reason worth showing beside an ended job's own: none for a queue wait."""
    return "" if record.reason.startswith(QUEUE_WAITS) else record.reason


def is_node_failure(record: AcctRecord) -> bool:
    """Did this run end because a node of it failed (Slurm's NODE_FAIL)?"""
    return state_word(record.raw_state) == "NODE_FAIL"


# ---------------------------------------------------------------------------------------------
# which node failed: the accounting's node events (`sacctmgr show event`)

_SLURM_TIME = "%Y-%m-%dT%H:%M:%S"
# A node's DOWN event is stamped when slurmctld acts on it, which is also when the run ends:
# the window reaches a little past the end.
EVENT_GRACE_S = 60


def node_events_argv(nodes: str, start: str, end: str) -> list[str] | None:
    """sacctmgr for the node events (DOWN, DRAIN, ...) of `nodes` (a hostlist) between a run's
    start and a little past its end (sacct's local times); None when the times are unknown."""
    try:
        since = datetime.strptime(start, _SLURM_TIME)
        until = datetime.strptime(end, _SLURM_TIME) + timedelta(seconds=EVENT_GRACE_S)
    except ValueError:
        return None
    return [
        "sacctmgr",
        "--noheader",
        "--parsable2",
        "show",
        "event",
        "event=node",
        f"nodes={nodes}",
        f"start={since.strftime(_SLURM_TIME)}",
        f"end={until.strftime(_SLURM_TIME)}",
        "format=NodeName,TimeStart,State,Reason",
    ]


@dataclass(frozen=True)
class NodeEvent:
    node: str
    at: str  # the cluster's local time
    state: str  # DOWN, DRAIN, FAIL, ...
    reason: str  # the admin's or slurmctld's words ("Not responding", "Kill task failed")


def parse_node_events(out: str) -> list[NodeEvent]:
    """Output of `node_events_argv` -> its events, in sacctmgr's order."""
    events = []
    for line in out.splitlines():
        fields = line.split("|")
        if len(fields) >= 4 and fields[0].strip():
            node, at, state, reason = (f.strip() for f in fields[:3] + ["|".join(fields[3:])])
            events.append(NodeEvent(node, at, state, " ".join(reason.split())))
    return events


# ---------------------------------------------------------------------------------------------
# srun's own error lines in the batch log

_SRUN_TASK = re.compile(
    r"srun: error: (?P<node>\S+): tasks? (?P<tasks>[0-9,\-]+): (?P<what>.+?)\s*$", re.M
)


# The script's line before the ranks' srun (templates/slurm.sh.j2: `log "starting N ranks`).
_RANKS_STARTING = re.compile(r"ringctl-job: starting \d+ ranks?\b", re.M)


def ranks_part(batch_log: str, *, cut: bool = False) -> str | None:
    """The batch log from its last "starting N ranks" line on: srun's lines above it are the
    node probe's or the placement's, whose task ids are nodes, not ranks. None when the ranks
    never started (no such line); the whole text when the log was read from a tail (``cut``)
    that begins past the line (srun's own lines then filled what was read)."""
    starts = list(_RANKS_STARTING.finditer(batch_log))
    if starts:
        return batch_log[starts[-1].end() :]
    return batch_log if cut else None


def _expand_tasks(text: str, world: int) -> list[int]:
    """srun's task list ("2,5-6") as the ids below ``world``: the batch log is the job's to
    write, and one line saying `tasks 0-4294967295` made every status build billions."""
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        first, last = ascii_number(a, 9), ascii_number(b or a, 9)
        if first is not None and last is not None:
            out.extend(range(first, min(last + 1, world)))
    return out


def parse_srun_errors(srun_lines: str, world: int | None = None) -> dict[int, str]:
    """`srun: error: n3: task 2: Exited with exit code 1` -> {2: "Exited with exit code 1 (n3)"},
    ranks below ``world`` (the job's ranks when known, else the largest world a config
    allows). Give it the ranks' part of the batch log (``ranks_part``).

    The first report of a task wins (later ones are usually the others being killed)."""
    world = min(world or MAX_RANKS, MAX_RANKS)
    tasks: dict[int, str] = {}
    for m in _SRUN_TASK.finditer(srun_lines):
        for t in _expand_tasks(m.group("tasks"), world):
            tasks.setdefault(t, f"{m.group('what')} ({m.group('node')})")
    return tasks


def failed_tasks(errors: dict[int, str]) -> list[tuple[int, str]]:
    """srun's failed tasks (``parse_srun_errors``), most likely cause first: out of memory
    (always a cause), then an exit code, in srun's order (the killed ones are usually
    victims of --kill-on-bad-exit), then the rest (killed, cancelled)."""

    def rank(item: tuple[int, str]) -> int:
        what = item[1].lower()
        return 0 if "out of memory" in what else 1 if "exit code" in what else 2

    return sorted(errors.items(), key=rank)


# The batch script's own last word when it stops itself (templates/slurm.sh.j2: `fail`).
_SCRIPT_FAILED = re.compile(r"ringctl-job: FAILED: (?P<why>.+?)\s*$")
RANKS_FAILED = "the ranks ended with status"  # the script's line after a failed srun of ranks


def script_failure(batch_log: str) -> str:
    """Why the batch script stopped itself, when its FAILED line is the log's last word and
    is not about the ranks (those are blamed by name from srun's lines): a check of its own
    (no config, a symbolic link in the way of a rerun, no placement). A rerun that stops
    before it keeps the earlier run's log leaves that run's srun lines above this one, which
    would otherwise be blamed."""
    lines = [line for line in batch_log.splitlines() if line.strip()]
    m = _SCRIPT_FAILED.search(lines[-1]) if lines else None
    if m is None or m.group("why").startswith(RANKS_FAILED):
        return ""
    return m.group("why")
