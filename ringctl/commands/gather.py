"""`ringctl gather JOBDIR [-o OUT] [--force] [--partial] [--format F]`: verify, reassemble.

The work is the task's (a task may provide a gather step: `Task.gatherer()`, a
`ringctl.tasks.base.Gatherer`; the long-document task's is `ringctl.longdoc.output.gather`); this
verb finds the job, has its backend fetch the outputs (remote jobs: over SFTP; local files:
nothing to do), finds the task's gather step and runs it. With --force it holds the job
directory's lock, since it may replace an earlier output.

JOBDIR may also be a job's out/ directory, or a bare directory of task output without a job
around it (a copy): then the gather step that recognises it is used. The gather step gets the
job's resolved config (`job_config`) and whether its files live on a login node (`remote`):
the long-document step checks each document's input, as the config names it, against the one
its outputs were computed from (not for a remote job, nor for a bare directory: said in a note).

--partial writes the documents that are complete now (the others are listed, and the output is
marked partial in summary.json and its marker file) and says what the backend reports about the
job (still running, or ended without them); a later gather replaces a partial output without
--force (and holds the job's lock to do it). --format parquet|csv adds a table of per-token
values (see ringctl.longdoc.output.export).

Exit status: 0 when every document verified (with --partial: every complete one) and OUT was
written; 1 when writing OUT failed (disk full, quota, read-only: one line naming OUT, and
nothing is left there), or when a running training job pruned every checkpoint gather took
while it read it (run it again); 2 for a usage error (no such
job directory, a task without a gather step, OUT exists without --force, or is not an earlier
gather output); 3 when outputs are missing, corrupt or malformed (each problem is named on
stderr, and nothing is written).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..backends import files_here
from ..errors import CheckpointPruned, RemoteGone, UserError
from ..jobdir import job_of

if TYPE_CHECKING:
    from ..tasks.base import Gatherer

# ringctl.longdoc.output.export.FORMATS (not imported here: building the parser must not
# import the task's modules)
FORMATS = ("safetensors", "parquet", "csv")

_REMOTE = re.compile(r"(?:[\w.-]+@)?[\w.-]+:(?!//).*", re.DOTALL)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "gather",
        help="Verify a job's output shards and reassemble each document.",
        description=(
            "Check that every token position of every document is covered exactly once by "
            "shards with valid checksums, undo the sequence layout, and write one file per "
            "document plus summary.json / summary.csv (and, for score/grad, the mean loss by "
            "token position: loss-by-position.json and .png). Missing or corrupt shards are "
            "named and gather exits with status 3 without writing anything; --partial writes the "
            "complete documents of a job that is still running, marked partial. A training "
            "job's gather writes metrics.jsonl, loss.png and model/ (the last checkpoint, as a "
            "transformers directory); an attention job has no gather step."
        ),
    )
    p.add_argument("job_dir", metavar="JOBDIR", help="the job directory (or its out/ directory)")
    p.add_argument(
        "-o", "--out", metavar="OUT", help="where to write the results (default JOBDIR/gathered)"
    )
    p.add_argument(
        "--force", action="store_true", help="replace OUT if it is an earlier gather output"
    )
    p.add_argument(
        "--partial",
        action="store_true",
        help="write what is complete so far, marked partial: a scoring job's finished "
        "documents (the others are listed), a training job's newest checkpoint; while the job "
        "runs, or after it stopped before its end",
    )
    p.add_argument(
        "--format",
        dest="fmt",
        default="safetensors",
        choices=FORMATS,
        help="safetensors (default: docs/*.safetensors only); parquet or csv also write a "
        "table of per-token values (tokens.parquet|csv; embed: pooled.parquet|csv)",
    )
    p.set_defaults(func=run)


def _existing_dir(spec: str) -> Path:
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if not path.exists() and _REMOTE.fullmatch(spec):
        raise UserError(
            f"{spec}: remote job directories are gathered through their local job directory "
            f"(the one `ringctl submit` made); or copy it first (e.g. rsync -a {spec} ./job)"
        )
    raise UserError(f"{spec}: no such job directory")


def _task_gatherer(cfg, job) -> Gatherer:
    from ..tasks import get_task

    name = str(cfg.task.name)
    try:
        gatherer = get_task(name).gatherer()
    except KeyError as err:
        raise UserError(f"{job.config}: task.name: {err.args[0]}") from None
    if gatherer is None:
        raise UserError(f"{job.path}: task {name!r} has no gather step; nothing to gather")
    return gatherer


def _recognising_gatherer(path: Path) -> Gatherer:
    """For a directory that is not a job: the gather step whose output it holds."""
    from ..tasks import TASKS, get_task

    for name in TASKS:
        gatherer = get_task(name).gatherer()
        if gatherer is not None and gatherer.recognises(path):
            return gatherer
    raise UserError(f"{path}: not a job directory (no config.yaml), and no task output here")


def _fetch(job, backend, console, *, want_state: bool):
    """The job's state (when asked: --partial), read first so that COMPLETED means the outputs
    fetched after it are final; then the backend brings the outputs here (nothing, when they
    are local already)."""
    from rich.text import Text

    with backend:
        status = backend.status(job.path) if want_state else None
        try:
            fetched = backend.fetch(job.path)
        except RemoteGone as err:  # gather the copy here, saying whose it is
            console.print(Text(f"note: {err}; gathering it"))
            fetched = []
    if fetched:
        console.print(Text(f"fetched {len(fetched)} file(s) of the job into {job.path}"))
    return status


def _gather_command(job_path: Path | None, out: str | None) -> str:
    """`ringctl gather JOBDIR [-o OUT]` as the hints say it: a hint that dropped -o pointed
    at another output than the one this gather wrote (and would replace)."""
    words = ["ringctl", "gather", str(job_path)] + (["-o", out] if out else [])
    return " ".join(shlex.quote(w) for w in words)


def partial_state_line(status, job_path: Path | None, result, out: str | None = None) -> str:
    """What --partial says about the job: still running, or ended without some documents
    (a training job's: steps after its newest checkpoint, ``steps_left``)."""
    if status is None:
        return "job state unknown (not a job directory: no backend to ask)"
    state = status.state.value
    why = f" ({status.reason})" if status.reason else ""
    left, unit = len(getattr(result, "incomplete", []) or []), "document(s)"
    if isinstance(getattr(result, "steps_left", None), int):  # a training job's checkpoint
        left, unit = result.steps_left, "step(s)"
    if state == "UNKNOWN":
        return f"the backend does not know the job's state{why}; `ringctl status {job_path}`"
    if not status.state.finished:
        if not left:
            done = "every listed document is" if unit == "document(s)" else "the last step is"
            return f"the job is still {state}{why}; {done} complete already"
        return (
            f"the job is still {state}{why}: run `{_gather_command(job_path, out)}` again "
            "when it ends (it replaces this partial output)"
        )
    if not left:
        return f"the job is {state}{why}"
    if state == "COMPLETED":
        return (
            f"the job is COMPLETED, yet {left} {unit} are not complete: "
            f"`{_gather_command(job_path, out)}` (without --partial) names every problem"
        )
    return (
        f"the job is {state}{why}: the {left} {unit} left out will not be computed "
        f"unless you `ringctl resume {job_path}`"
    )


def not_finished_line(status, job_path: Path, partial: bool) -> str | None:
    """The line that leads a failed gather of a job that has not ended (PENDING, RUNNING):
    its shards are missing because they are not written yet, which the list of problems
    alone does not say (and --partial, unless it was given: it was advised again). None for
    an ended job, or one whose state is not known."""
    if status is None or status.state.finished or status.state.value == "UNKNOWN":
        return None
    now = "" if partial else ", or gather what is complete now with --partial"
    return (
        f"the job is {status.state.value}: its outputs are not all written yet; gather it when "
        f"it ends (`ringctl status {shlex.quote(str(job_path))}`){now}"
    )


def _state_now(backend, job_path: Path):
    """The backend's state of the job for a hint, or None when it cannot be asked (a slurm
    job gathered where no sacct runs): a hint never turns a gather's error into another."""
    try:
        with backend:
            return backend.status(job_path)
    except (UserError, OSError):
        return None


def run(args: argparse.Namespace) -> int:
    from rich.text import Text

    from ..terminal import console as terminal_console
    from ..terminal import visible

    console = terminal_console()
    path = _existing_dir(args.job_dir)
    job_path = job_of(path)
    options = {"force": args.force, "partial": args.partial, "fmt": args.fmt}
    status = None
    if job_path is None:
        gatherer = _recognising_gatherer(path)
        result = gatherer.gather(path, args.out, **options)
    else:
        from ..submission import open_job_dir

        job, cfg, backend = open_job_dir(job_path)
        gatherer = _task_gatherer(cfg, job)
        replaces = gatherer.replaces_partial(path, args.out)
        # --force, or an earlier partial output, may be replaced: no other verb changes the
        # directory meanwhile
        with job.lock("gather") if args.force or replaces else contextlib.nullcontext():
            status = _fetch(job, backend, console, want_state=args.partial)
            state = status.state.value if status is not None else None
            # the inputs named by the job's own config are checked against the outputs, where
            # they are visible (not an ssh job's: they live on the login node)
            inputs = {"job_config": cfg, "remote": not files_here(cfg)}
            try:
                result = gatherer.gather(path, args.out, job_state=state, **options, **inputs)
            except CheckpointPruned:  # a race with the running job, said as one
                raise
            except UserError:
                state_now = status or _state_now(backend, job.path)
                lead = not_finished_line(state_now, job.path, args.partial)
                if lead:  # before the problems the cli prints: why they are there
                    print(f"ringctl gather: {visible(lead)}", file=sys.stderr)
                raise
    gatherer.show(result, console)
    if args.partial:
        console.print(Text(visible(partial_state_line(status, job_path, result, args.out))))
    return 0
