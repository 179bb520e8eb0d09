"""What the jobs of one listing share: `ringctl status` of many job directories asks each
cluster once, not once per job.

A listing of 300 Slurm jobs ran squeue and sacct 300 times each (about 0.15 s a job on the
test cluster, seconds on a busy one, and the RPC storm Slurm's documentation asks scripts
not to make), and an ssh listing opened one SSH connection per job (a second each). Within
``listing(job_dirs)``:

* a backend asks squeue and sacct once per cluster for every Slurm job id the listing's
  job.json files record (``queue_answer``/``acct_answer``): each job takes its answer once,
  and any later question (sacct's wait for accounting to catch up) asks afresh, as before;
* connections a backend opens are kept for the next job with the same settings
  (``shared``), and closed when the listing ends.

Outside a listing (one job's status, logs, submit) nothing is shared: every function here
answers None and the backends ask as they always did.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from ..jobdir import JobDir
from .slurm_states import SLURM_JOB_ID, is_clock

IDS_PER_CALL = 256  # job ids one squeue/sacct is asked about (a command line stays short)

Run = Callable[[Sequence[str]], tuple[int, str, str]]


@dataclass
class _Answer:
    """One command's output (squeue's or sacct's) for the listing's ids on one cluster:
    asked once (None: not yet, or it failed: each job then asks for itself), and how many
    of the listing's directories of each id have not taken it yet."""

    out: str | None = None
    asked: bool = False
    untaken: Counter = field(default_factory=Counter)

    def ask(self, run: Run, commands: Callable[[], list[list[str]]], named: Counter) -> None:
        """Run the ``commands()`` the first time only."""
        if not self.asked:
            self.asked = True
            self.out = _asked(run, commands())
            self.untaken = Counter(named if self.out is not None else {})

    def take(self, job_id: str) -> str | None:
        """The output for a directory of ``job_id``'s first question, once each."""
        if self.untaken[job_id] <= 0:
            return None
        self.untaken[job_id] -= 1
        return self.out


@dataclass
class Listing:
    """The listing's Slurm job ids (id -> the earliest time sacct is asked from for it, None:
    from the start; and how many of its directories name each), each cluster's answers, and
    the connections kept open."""

    since: dict[str, str | None]
    named: Counter
    answers: dict[tuple[str, str], _Answer] = field(default_factory=dict)  # (where, command)
    kept: dict[object, object] = field(default_factory=dict)
    closers: list[Callable[[], None]] = field(default_factory=list)
    refused: dict[object, UserError] = field(default_factory=dict)  # key -> why make() failed


_CURRENT: ContextVar[Listing | None] = ContextVar("ringctl_listing", default=None)


@contextmanager
def listing(job_dirs: Sequence[Path]) -> Iterator[Listing]:
    """Share the cluster's answers and connections among the jobs of ``job_dirs``."""
    current = Listing(*_recorded_ids(job_dirs))
    token = _CURRENT.set(current)
    try:
        yield current
    finally:
        _CURRENT.reset(token)
        for close in reversed(current.closers):
            try:
                close()
            except Exception:  # noqa: BLE001 - a connection that fails to close: gone anyway
                pass


def _recorded_ids(job_dirs: Sequence[Path]) -> tuple[dict[str, str | None], Counter]:
    """The Slurm job ids job.json records, with the time sacct is asked from for each (the
    earlier of two directories naming one id; None: from the start). A job whose job.json
    cannot be read asks for itself, and says why in its row."""
    since: dict[str, str | None] = {}
    named: Counter = Counter()
    for job_dir in job_dirs:
        try:
            meta = JobDir(Path(job_dir)).read_meta()
        except (UserError, OSError):
            continue
        job_id = meta.get("job_id")
        if not isinstance(job_id, str) or not SLURM_JOB_ID.fullmatch(job_id):
            continue
        given = meta.get("sacct_since")
        if given is not None and not is_clock(given):
            continue  # not a time ringctl wrote: that job asks for itself (runs_ended_since)
        if job_id in since:
            known = since[job_id]
            given = None if known is None or given is None else min(known, given)
        since[job_id] = given
        named[job_id] += 1
    return since, named


def shared(
    key: object,
    make: Callable[[], object],
    close: Callable[[object], None],
    alive: Callable[[object], bool] = lambda _: True,
    gave_up: Callable[[object], UserError | None] = lambda _: None,
):
    """The listing's object under ``key`` (made on first use, closed when the listing ends;
    made again where ``alive`` says the kept one is not: a login node that dropped the
    connection mid-listing failed every later job's row; one that could not be made is not
    tried again: a login node down cost each of its jobs' rows the connect timeout, 25
    minutes for 100 jobs; nor one ``gave_up`` says was closed for not answering a command:
    the command timeout each, hours); outside a listing, None: the
    caller makes and closes its own."""
    current = _CURRENT.get()
    if current is None:
        return None
    if key in current.refused:  # a login node down: said once a row, not waited for again
        raise current.refused[key]
    kept = current.kept.get(key)
    if kept is not None and not alive(kept):
        given_up = gave_up(kept)  # closed for not answering: not waited for again either
        if given_up is not None:
            current.refused[key] = given_up
            raise given_up
        close(kept)
        kept = current.kept[key] = None  # closed: never closed again
    if kept is None:
        try:
            kept = make()
        except UserError as err:
            current.refused[key] = err
            raise
        if key not in current.kept:  # one closer a key: it closes what is kept then
            current.closers.append(lambda: current.kept[key] and close(current.kept[key]))
        current.kept[key] = kept
    return kept


def queue_answer(run: Run, where: str, job_id: str, argv: Callable) -> str | None:
    """squeue's output for the listing's jobs on ``where`` (``argv(ids)``: the command), for
    ``job_id``'s first question; None outside a listing, for a job not in it, for a second
    question, or where the shared command failed."""
    current = _CURRENT.get()
    if current is None or job_id not in current.since:
        return None
    answer = current.answers.setdefault((where, "squeue"), _Answer())
    answer.ask(run, lambda: [argv(part) for part in _parts(current)], current.named)
    return answer.take(job_id)


def acct_answer(run: Run, where: str, job_id: str, argv: Callable) -> str | None:
    """sacct's output for the listing's jobs on ``where`` (``argv(ids, since)``), for
    ``job_id``'s first question; None as ``queue_answer``. Asked from the earliest of the
    jobs' start times: the caller keeps only the runs that ended after its own."""
    current = _CURRENT.get()
    if current is None or job_id not in current.since:
        return None

    def commands() -> list[list[str]]:
        starts = list(current.since.values())
        since = None if None in starts else min(starts)  # the earliest; None: from the start
        return [argv(part, since) for part in _parts(current)]

    answer = current.answers.setdefault((where, "sacct"), _Answer())
    answer.ask(run, commands, current.named)
    return answer.take(job_id)


def _parts(current: Listing) -> Iterator[str]:
    """The listing's ids, IDS_PER_CALL to a command."""
    ids = sorted(current.since, key=int)
    for start in range(0, len(ids), IDS_PER_CALL):
        yield ",".join(ids[start : start + IDS_PER_CALL])


def _asked(run: Run, commands: list[list[str]]) -> str | None:
    """The commands' outputs joined; None where one failed (each job asks for itself)."""
    outs = []
    for argv in commands:
        try:
            rc, out, _ = run(argv)
        except UserError:
            return None
        if rc != 0:
            return None
        outs.append(out)
    return "".join(out if out.endswith("\n") or not out else out + "\n" for out in outs)
