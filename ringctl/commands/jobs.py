"""Verbs for jobs: config, render, submit, run, status, logs, cancel, resume, fetch.

    ringctl config JOB [KEY=VALUE ...]     the resolved config (YAML)
    ringctl render JOB [KEY=VALUE ...]     the Slurm batch script (dry run: nothing submitted)
    ringctl submit JOB [KEY=VALUE ...]     create the job directory, hand it to the backend
    ringctl run JOB [KEY=VALUE ...]        submit, follow the log until the end; 0 iff COMPLETED
    ringctl status [JOBDIR ... | JOB [KEY=VALUE ...]] [--latest] [--dir-only]
                                           a table (default: every job under ./runs)
    ringctl logs JOBDIR [-f] [--rank R]    the ranks' logs
    ringctl cancel JOBDIR
    ringctl resume JOBDIR [-f] [--force]   submit an ended job again; finished work is kept
    ringctl fetch JOBDIR                   copy an ssh job's outputs and logs back

`status` of a COMPLETED job counts its long-document outputs by gather's definition of complete
(`vouch_outputs`), and a listing shows every job: one whose row cannot be made is UNKNOWN, with
why (`listed_row`).

Submitting and resuming (the checks, the sizing, the job directory) live in
``ringctl.submission``; this module parses arguments and prints. Backends are modules
`ringctl.backends.<name>` with `create(cfg) -> Backend`, imported only when used.
"""

from __future__ import annotations

import argparse
import json
import posixpath
import shlex
import sys
import textwrap
import time
from pathlib import Path

from ..backends.listing import listing
from ..backends.shell import LocalShell, Shell
from ..config import DEFAULT_OUTPUT_DIR, load_job, to_yaml, world_size
from ..errors import UserError
from ..jobdir import PROGRESS, RINGS, JobDir, ring_progress_label, task_output
from ..jsonsafe import finite_json
from ..progress import read_shell_record
from ..resources import find_job
from ..submission import open_job_dir, resume_job, submit_job
from ..terminal import for_terminal, visible
from ..text import cut

# --- verbs ----------------------------------------------------------------------------------------


def cmd_config(args) -> int:
    sys.stdout.write(to_yaml(load_job(args.job, args.overrides)))
    return 0


def cmd_render(args) -> int:
    from ..render import render_script

    cfg = load_job(args.job, args.overrides)
    sys.stdout.write(render_script(cfg, job_dir=cluster_job_dir(args.job_dir)))
    return 0


def cluster_job_dir(path: str | None) -> str | None:
    """--job-dir as the script takes it: an absolute path as the cluster sees it (the
    script's `cd` and `#SBATCH --chdir`). A relative one (or ~) would be read from wherever
    the script runs, and this machine's directory is not the cluster's: refused, not
    resolved here."""
    if path is None or posixpath.isabs(path):
        return path
    raise UserError(f"--job-dir {path}: give an absolute path, as the cluster sees it")


def cmd_submit(args) -> int:
    job_dir, job_id, backend = submit_job(args.job, args.overrides, force=args.force)
    print(f"submitted job {job_id} ({backend.name}) in {job_dir}")
    return 0


def cmd_run(args) -> int:
    if args.rank is not None:  # refused before anything is submitted
        checked_rank(args.rank, load_job(args.job, args.overrides))
    job_dir, job_id, backend = submit_job(args.job, args.overrides, force=args.force)
    print(f"submitted job {job_id} ({backend.name}) in {job_dir}", flush=True)
    rank = None if args.all_ranks else args.rank or 0
    return follow_to_end(job_dir, job_id, backend, rank=rank)


def checked_rank(rank: int | None, cfg) -> int | None:
    """--rank R, when the job has a rank R (None: every rank). A rank outside
    0..world_size-1 has no log: `logs` and `run` printed nothing and exited 0."""
    world = world_size(cfg)
    if rank is not None and not 0 <= rank < world:
        raise UserError(f"--rank {rank}: this job has ranks 0 to {world - 1} ({world} ranks)")
    return rank


def follow_to_end(job_dir: Path, job_id: str, backend, *, rank: int | None) -> int:
    """Print the job's log as it grows, then its final state; 0 only if COMPLETED."""
    shown = for_terminal()
    try:
        for line in backend.logs(job_dir, rank=rank, follow=True):
            print(shown(line), flush=True)
        status = backend.status(job_dir)
        while not backend.settled(job_dir, status):  # logs ended first: wait for the end
            time.sleep(0.5)
            status = backend.status(job_dir)
    except KeyboardInterrupt:
        print(
            f"\nstopped following; the job goes on. `ringctl status {job_dir}`, "
            f"`ringctl cancel {job_dir}`",
            file=sys.stderr,
        )
        return 130
    elapsed = f" in {status.elapsed_s:.1f}s" if status.elapsed_s is not None else ""
    line = f"job {job_id} {status.state.value}{elapsed}"
    if status.reason:  # the job's own words (a rank's error line): shown, never obeyed
        line += f": {visible(status.reason)}"
    print(line, file=sys.stdout if status.state.value == "COMPLETED" else sys.stderr)
    print(f"job directory: {job_dir}")
    if JobDir(job_dir).read_meta().get("remote"):  # an ssh job: out/ here is still empty
        fetch = f"ringctl fetch {shlex.quote(str(job_dir))}"
        print(f"its files are on the login node: `{fetch}` copies them here")
    return 0 if status.state.value == "COMPLETED" else 1


def cmd_resume(args) -> int:
    if args.follow and args.rank is not None:  # against the job as resumed, before it is
        job, cfg, _ = open_job_dir(args.job_dir)
        checked_rank(args.rank, load_job(job.config, args.overrides) if args.overrides else cfg)
    job_dir, job_id, backend = resume_job(
        Path(args.job_dir), force=args.force, overrides=args.overrides
    )
    print(f"resubmitted as job {job_id} ({backend.name}) in {job_dir}", flush=True)
    if not args.follow:
        return 0
    return follow_to_end(job_dir, job_id, backend, rank=args.rank or 0)


def _status_targets(args) -> list[Path]:
    """JOBDIR..., or JOB [KEY=VALUE...] (that job's directories), or everything under --root."""
    targets = list(args.targets)
    if targets and _is_job(targets[0]):
        cfg = load_job(targets[0], targets[1:])
        if cfg.job_dir:
            dirs = [Path(str(cfg.job_dir))]
        else:
            root = Path(str(cfg.output_dir)).expanduser()
            dirs = [j.path for j in JobDir.find(root, str(cfg.name))]
        if not dirs:
            raise NoJobs(f"no job directory of {cfg.name!r} under {cfg.output_dir}/")
    elif targets:
        dirs = [Path(t) for t in targets]
    else:
        dirs = [j.path for j in JobDir.find(Path(_root(args.root)))]
        if not dirs:
            raise NoJobs(_no_jobs_line(args.root))
    return dirs[-1:] if args.latest else dirs


def _is_job(target: str) -> bool:
    """Whether a status target names a job (a job file, or a bundled job's name as every
    other JOB verb takes it: `find_job`) rather than a job directory."""
    if Path(target).is_dir():
        return False
    try:
        find_job(target)
    except UserError:
        return False
    return True


class NoJobs(UserError):
    """No job directory under --root: exit 1 in every form of `status` (the directory
    list, the table, JSON), the root named, and whether it exists."""

    exit_code = 1


def _root(given: str | None) -> str:
    """--root as given ('' is the current directory, as before), else output_dir's default."""
    return DEFAULT_OUTPUT_DIR if given is None else given


def _no_jobs_line(given: str | None) -> str:
    """Why `status` lists nothing: the --root the user gave, or the default's absence named as
    no job yet (a newcomer's first `status` named a --root never typed)."""
    root = Path(_root(given))
    if given is None and not root.is_dir():
        return (
            f"no jobs yet here: no {root}/ folder (`ringctl run smoke` makes one; or give a "
            "job directory: ringctl status JOBDIR)"
        )
    where = f"no jobs under {root}/" if root.is_dir() else f"--root {root}: no such directory"
    return f"{where} (give a job directory: ringctl status JOBDIR)"


def read_progress(shell: Shell, where: str, notes: list[str]) -> dict | None:
    """The job's logs/progress.json (rank 0's counts) in the directory ``where`` as ``shell``
    sees it, checked; problems go to notes."""
    return _read_one(shell, posixpath.join(where, PROGRESS), notes)


def read_rings(shell: Shell, where: str, notes: list[str]) -> list[dict]:
    """Each ring's progress record (logs/rings/*.json, written by its lead), by label."""
    rings = []
    try:
        names = shell.listdir(posixpath.join(where, RINGS))
    except UserError as err:
        notes.append(cut(err, 200))
        return []
    for name in sorted(names):
        label = ring_progress_label(name)
        record = label and _read_one(shell, posixpath.join(where, RINGS, name), notes)
        if record:
            rings.append({**record, "ring": label})
    return rings


def _read_one(shell: Shell, path: str, notes: list[str]) -> dict | None:
    try:
        return read_shell_record(shell, path, notes)
    except UserError as err:  # not a regular file, or the connection went (path named)
        said = cut(err, 200)
        notes.append(f"{said}; ignored" if path in said else f"{path}: {said}; ignored")
        return None


def job_progress(shell: Shell, where: str, notes: list[str]) -> dict:
    """The row's rings and progress in the job directory ``where`` as ``shell`` sees it."""
    rings = read_rings(shell, where, notes)
    return {"rings": rings, "progress": ring_summary(rings) or read_progress(shell, where, notes)}


def ring_summary(rings: list[dict]) -> dict | None:
    """Progress over every ring: documents done/total (each ring counts its own, and the
    job's done by earlier attempts as ``before``: a resumed job read "8/8 documents" of 14)
    and the latest ETA."""
    if len(rings) < 2:
        return None
    before = max(int(r.get("before") or 0) for r in rings)
    etas = [r["eta_s"] for r in rings if r.get("eta_s") is not None and r["done"] < r["total"]]
    now = [r["current"] for r in rings if r.get("current") and r["done"] < r["total"]]
    where = {"current": ", ".join(now)} if now else {}  # rings inside a long document: where
    return where | {
        "done": before + sum(int(r["done"]) for r in rings),
        "total": before + sum(int(r["total"]) for r in rings),
        "unit": "documents",
        "rings": len(rings),
        "rings_done": sum(1 for r in rings if r["done"] >= r["total"]),
        "eta_s": max(etas) if etas else None,
    }


def progress_text(p: dict | None, state: str) -> str:
    if not p:
        return ""
    text = f"{p['done']}/{p['total']} {p.get('unit') or ''}".strip()
    if p.get("rings"):
        text += f" on {p['rings']} rings ({p['rings_done']} done)"
    if p.get("loss") is not None:  # a training job's latest step
        text += f", loss {float(p['loss']):.4g}"
    if p.get("tokens_per_s") is not None:
        text += f", {float(p['tokens_per_s']):,.0f} tokens/s"
    if "checkpoint" in p and state != "COMPLETED":  # a training job: where a resume starts
        text += checkpoint_text(p["checkpoint"], int(p["done"]), state)
    if state == "RUNNING" and p.get("eta_s") is not None:
        text += f", ETA {float(p['eta_s']):.0f}s"
    if state == "RUNNING" and p.get("current"):  # where a long document's forward is
        text += f"; now {cut(p['current'], 80)}"
    return text


# The states of a job whose run stopped (PENDING: a requeued one waits to run again).
STOPPED_STATES = ("PENDING", "FAILED", "CANCELLED", "TIMEOUT")


def checkpoint_text(saved: int | None, done: int, state: str) -> str:
    """A training job's newest checkpoint beside its last step, and the steps the next run
    (a resume, or Slurm's rerun) does again where it stopped after that checkpoint."""
    text = f", checkpoint at step {saved}" if saved else ", no checkpoint yet"
    if state in STOPPED_STATES and done > (saved or 0):  # not RUNNING, nor UNKNOWN (maybe)
        first = (saved or 0) + 1
        steps = f"step {first}" if first == done else f"steps {first}-{done}"
        text += f" (the next run does {steps} again)"
    return text


def vouch_outputs(job_dir: Path, row: dict, notes: list[str], *, remote: bool) -> None:
    """A COMPLETED job's long-document outputs, counted by gather's definition of complete
    (``longdoc.completeness.output_status``) instead of the ranks' own count: the row's
    progress, and a reason naming what gather would refuse, never COMPLETED 4/4 for an output
    with a shard missing. Not an ssh job's (``remote``): the copy here is the last fetch's,
    and judged by it a job resumed since read "3/14 documents, which gather refuses" (gather,
    fetching first, wrote all 14)."""
    from ..longdoc.output.names import RUN_FILE, SUBDIR  # torch-free: names only

    if task_output(job_dir, SUBDIR, RUN_FILE) is None:
        return
    if remote:
        notes.append("outputs not checked here (on the login node): gather fetches, verifies")
        return
    from ..longdoc.output.completeness import output_status
    from ..longdoc.output.gather import find_longdoc_root

    try:
        done, total, problems = output_status(find_longdoc_root(job_dir))
    except UserError as err:
        done, total, problems = 0, 0, [str(err)]
    row["progress"] = {"done": done, "total": total, "unit": "documents"}
    if problems:
        left = f"{total - done} of {total} documents" if total else "the outputs"
        why = f"outputs incomplete: {left} not complete, which gather refuses: {problems[0]}"
        row["reason"] = "; ".join(r for r in (row["reason"], why) if r)


def job_row(job_dir: Path, *, single: bool) -> dict:
    """One job's status as plain data (the table's row, `status --json`'s object)."""
    try:
        meta = JobDir(job_dir).read_meta()
    except UserError:
        meta = {}
    row = {
        "job_dir": str(job_dir),
        "name": meta.get("name", ""),
        "backend": meta.get("backend", ""),
        "job_id": meta.get("job_id", ""),
        "state": "UNKNOWN",
        "elapsed_s": None,
        "reason": "",
    }
    notes: list[str] = []
    live = None  # the backend that answered
    try:
        _, cfg, backend = open_job_dir(job_dir)
        try:
            st = backend.status(job_dir)
            row.update(
                name=str(cfg.name),
                backend=backend.name,
                job_id=st.job_id,
                state=st.state.value,
                elapsed_s=st.elapsed_s,
                reason=st.reason,
            )
            # Where the job writes them: an ssh job's on the login node (the local copies
            # are as old as the last fetch: a finished job read "290/300 steps").
            row.update(job_progress(backend.shell, backend.cluster_dir(job_dir), notes))
            live = backend
        finally:
            backend.close()
    except UserError as err:
        if single:
            raise
        row["reason"] = str(err)
    remote = bool(meta.get("remote"))  # an ssh job: this directory has fetched copies
    rerun = row["state"] in ("RUNNING", "PENDING")  # none there yet: a requeued rerun's
    if live is None or (remote and not (row["progress"] or row["rings"]) and not rerun):
        # its config or its connection failed, or the login node's copy is gone: this
        # directory's files, an ssh job's said to be the last fetch's (not for a job that
        # runs: a requeued rerun read run 1's "52/100 steps, ETA 12s" at step 45)
        row.update(job_progress(LocalShell(), str(job_dir), notes))
        if remote and (row["progress"] or row["rings"]):
            why = "the login node was not reached" if live is None else "none there now"
            notes.append(f"progress as of the last fetch ({why})")
    if row["state"] == "COMPLETED":
        vouch_outputs(job_dir, row, notes, remote=remote)
    row, replaced = finite_json(row)  # the backend's figures too: `status --json` is strict
    row["notes"] = notes + [f"{key}: not a finite number; shown as null" for key in replaced]
    return row


def listed_row(job_dir: Path) -> dict:
    """job_row of one job among several: whatever its directory holds, a row (UNKNOWN, with
    the error as its reason), so that one damaged or hostile job directory cannot hide the
    others' rows."""
    try:
        return job_row(job_dir, single=False)
    except Exception as err:  # noqa: BLE001 - any failure of one row: said in that row
        reason = f"status failed: {type(err).__name__}: {cut(' '.join(str(err).split()), 200)}"
        return {
            "job_dir": str(job_dir),
            "name": "",
            "backend": "",
            "job_id": "",
            "state": "UNKNOWN",
            "elapsed_s": None,
            "reason": reason,
            "rings": [],
            "progress": None,
            "notes": [],
        }


_COLOURS = {
    "COMPLETED": "green",
    "FAILED": "red",
    "TIMEOUT": "red",
    "CANCELLED": "yellow",
    "RUNNING": "cyan",
    "PENDING": "blue",
}


def _status_table(rows: list[dict]):
    from rich.table import Table
    from rich.text import Text

    # Every column folds, none has a floor: six unbreakable columns and two with minimum
    # widths summed past the console's width, and rich cropped the reason to a few characters
    # and lost the right border (`ringctl status JOBDIR | cat`).
    table = Table(title=None, show_lines=False)
    for col in ("job dir", "name", "backend", "job id", "state", "elapsed", "progress", "reason"):
        table.add_column(col, overflow="fold")
    for r in rows:
        elapsed = f"{r['elapsed_s']:.1f}s" if r["elapsed_s"] is not None else ""
        cells = [
            r["job_dir"],
            r["name"],
            r["backend"],
            str(r["job_id"]),
            r["state"],
            elapsed,
            progress_text(r["progress"], r["state"]),
            r["reason"],
        ]
        # plain text (no rich markup from logs or names), control characters escaped
        row = [Text(visible(str(c))) for c in cells]
        row[4].stylize(_COLOURS.get(r["state"], "white"))
        table.add_row(*row)
    return table


def cmd_status(args) -> int:
    from rich.console import Console

    from ..terminal import console as terminal_console

    try:
        dirs = _status_targets(args)
    except NoJobs:
        if args.json:  # still a JSON document for the reader; the status says none
            print("[]")
        raise
    if args.dir_only:
        for job_dir in dirs:  # a directory name may hold terminal escapes
            print(visible(str(job_dir)))
        return 0
    if len(dirs) == 1:
        rows = [job_row(dirs[0], single=True)]
    else:  # each cluster asked once for all the jobs, each login node connected to once
        with listing(dirs):
            rows = [listed_row(d) for d in dirs]
    if args.json:
        print(json.dumps(rows, indent=2, default=str, allow_nan=False))
    else:
        console = terminal_console(width=max(120, Console().width))
        console.print(_status_table(rows))
        if len(rows) == 1 and len(rows[0]["rings"]) > 1:
            console.print(_rings_table(rows[0]["rings"], rows[0]["state"]))
        for note in (n for r in rows for n in r["notes"]):
            print(f"note: {visible(note)}", file=sys.stderr)
    return 1 if any(r["state"] == "UNKNOWN" for r in rows) else 0


def _rings_table(rings: list[dict], state: str):
    """One row per ring of a many-ring job: its ranks, documents done and ETA."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title="rings", show_lines=False)
    for col in ("ring", "ranks", "documents", "tokens/s", "ETA"):
        table.add_column(col, no_wrap=True)
    for r in rings:
        members = r.get("members") or []
        ends = members[:1] + members[-1:] if len(members) > 1 else members
        ranks = "-".join(str(m) for m in ends)
        eta = r.get("eta_s") if state == "RUNNING" and r["done"] < r["total"] else None
        rate = r.get("tokens_per_s")
        cells = [
            r["ring"],
            ranks,
            f"{r['done']}/{r['total']}",
            "" if rate is None else str(rate),
            f"{float(eta):.0f}s" if eta is not None else "",
        ]
        table.add_row(*(Text(visible(str(c))) for c in cells))
    return table


def cmd_logs(args) -> int:
    job_dir, cfg, backend = open_job_dir(args.job_dir)
    rank = checked_rank(args.rank, cfg)
    shown = for_terminal()  # a rank's log may hold escape sequences: shown, not obeyed
    try:
        for line in backend.logs(job_dir, rank=rank, follow=args.follow):
            print(shown(line), flush=args.follow)
    except KeyboardInterrupt:
        return 130
    return 0


def cmd_cancel(args) -> int:
    job, _, backend = open_job_dir(args.job_dir)
    with job.lock("cancel"):
        before = backend.status(job.path)
        if before.state.finished:
            print(f"job {before.job_id} already finished: {before.state.value}")
            return 0
        backend.cancel(job.path)
    print(f"cancelled job {before.job_id} ({job.path})")
    return 0


def cmd_fetch(args) -> int:
    job, _, backend = open_job_dir(args.job_dir)
    try:
        fetched = backend.fetch(job.path)
    finally:
        backend.close()
    if not job.read_meta().get("remote"):  # only an ssh job's files live elsewhere
        print(f"{job.path}: the job's files are already here ({backend.name} backend)")
    else:
        print(
            f"fetched {len(fetched)} file(s) into {job.path} "
            "(out/, logs/, probes/, attempts/, placement)"
        )
    return 0


def add_job_dir(p) -> None:
    """The JOBDIR positional of resume, logs, fetch and cancel: one definition, one help."""
    p.add_argument(
        "job_dir", metavar="JOBDIR", help="a job directory (the one `ringctl submit` printed)"
    )


def add_overrides(p, help_: str) -> None:
    """KEY=VALUE ...: optional (default []), so that a missing JOB or JOBDIR is the only
    argument argparse calls required."""
    p.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE", help=help_)


def add_rank(p, help_: str):
    """--rank R (default None: the verb's own default); checked against the job's ranks
    by `checked_rank` before anything is submitted or read."""
    return p.add_argument("--rank", type=int, default=None, metavar="R", help=help_)


# Where a job runs is one key of its config: every verb that takes a job says so.
WHERE_EPILOG = """\
where a job runs (the key backend):
  ringctl run smoke                              this machine: 4 processes (backend=local)
  ringctl submit smoke backend=slurm slurm.partition=gpu nodes=4
                                                 the Slurm cluster this machine submits to
  ringctl submit smoke backend=ssh ssh.host=login1
                                                 a Slurm cluster through its login node (SSH)
  ringctl render smoke backend=slurm             print the batch script, submit nothing
then: ringctl status (the jobs under runs/), ringctl logs -f JOBDIR, ringctl gather JOBDIR;
copy a bundled job to edit: ringctl example smoke DIR"""


def register(subparsers) -> None:
    """Add the job verbs to ringctl's sub-parsers (in the order `ringctl --help` lists them)."""
    _register_job_file_verbs(subparsers)
    _register_status(subparsers)
    _register_resume(subparsers)
    _register_job_dir_verbs(subparsers)


def _register_job_file_verbs(subparsers) -> None:
    """config, render, submit, run: a job file and its KEY=VALUE overrides."""

    where = (
        " The job directory goes under output_dir (default runs/, relative to where ringctl "
        "runs) as NAME-DATE-TIME; job_dir=PATH names it exactly."
    )

    def job_parser(name: str, help_: str, func, more: str = ""):
        p = subparsers.add_parser(
            name,
            help=help_,
            description=textwrap.fill(help_ + more, 79),  # the epilog's lines kept as written
            epilog=WHERE_EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.add_argument(
            "job",
            metavar="JOB",
            help="a job file (e.g. my-job.yaml) or a bundled job's name (smoke, attention, "
            "longdoc, train)",
        )
        add_overrides(p, "config overrides in dotted form, e.g. nodes=4 slurm.partition=gpu")
        p.set_defaults(func=func)
        return p

    job_parser("config", "Print the resolved job config (file + overrides) as YAML.", cmd_config)
    p = job_parser("render", "Print the Slurm batch script of a job (dry run).", cmd_render)
    p.add_argument(
        "--job-dir",
        default=None,
        help="render with this job directory: an absolute path, as the cluster sees it",
    )
    force_help = "submit even when `ringctl plan` says the ranks cannot hold the job"
    p = job_parser("submit", "Create the job directory and submit the job.", cmd_submit, where)
    p.add_argument("--force", action="store_true", help=force_help)
    p = job_parser(
        "run",
        "Submit a job and follow its log until it ends (exit 0 only if COMPLETED).",
        cmd_run,
        where,
    )
    p.add_argument("--force", action="store_true", help=force_help)
    whose = p.add_mutually_exclusive_group()
    add_rank(whose, "whose log to follow (default: 0)")
    whose.add_argument("--all-ranks", action="store_true", help="follow every rank's log")


def _register_status(subparsers) -> None:
    p = subparsers.add_parser(
        "status", help="Show the state of jobs.", description="Show the state of jobs (a table)."
    )
    p.add_argument(
        "targets",
        nargs="*",
        metavar="JOBDIR | JOB [KEY=VALUE ...]",
        help="job directories, or a job file (+ overrides) for the directories of that job",
    )
    p.add_argument(
        "--root",
        default=None,
        help=f"where to look without JOBDIR (default: {DEFAULT_OUTPUT_DIR})",
    )
    p.add_argument("--latest", action="store_true", help="only the most recent job")
    shown = p.add_mutually_exclusive_group()
    shown.add_argument("--dir-only", action="store_true", help="print the job directories only")
    shown.add_argument(
        "--json",
        action="store_true",
        help="a JSON array: one object per job (state, progress, rate, ETA)",
    )
    p.set_defaults(func=cmd_status)


def _register_resume(subparsers) -> None:
    p = subparsers.add_parser(
        "resume",
        help="Submit an ended job again into its directory; finished work is kept.",
        description=(
            "Submit a failed, cancelled or timed-out job again into its own directory. Its "
            "outputs stay, and tasks skip what is already complete (for long documents: every "
            "document whose shards are all written and verified). The previous attempt's logs "
            "move to attempts/<n>/."
        ),
    )
    add_job_dir(p)
    add_overrides(
        p,
        "change how the job runs: nodes, tasks_per_node, ring.*, slurm.*, env.*, ... "
        "(e.g. ring.size=2 nodes=2); what it computes stays",
    )
    p.add_argument("-f", "--follow", action="store_true", help="follow the log until it ends")
    add_rank(p, "whose log to follow with -f (default: 0)")
    p.add_argument(
        "--force", action="store_true", help="run a COMPLETED job again (its outputs are kept)"
    )
    p.set_defaults(func=cmd_resume)


def _register_job_dir_verbs(subparsers) -> None:
    """logs, fetch, cancel: one job directory each."""
    p = subparsers.add_parser("logs", help="Print a job's logs.", description="Print a job's logs.")
    add_job_dir(p)
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    add_rank(p, "only this rank (default: all)")
    p.set_defaults(func=cmd_logs)

    p = subparsers.add_parser(
        "fetch",
        help="Copy a remote (ssh) job's outputs and logs into its local directory.",
        description=(
            "Copy a job's outputs (out/), logs, probes, placement and earlier attempts' logs "
            "(attempts/) from the login node into the local job directory. Control files "
            "(config.yaml, job.json, ...) are never replaced from the remote copy, and no "
            "symbolic link is followed. Local and slurm jobs need no fetch."
        ),
    )
    add_job_dir(p)
    p.set_defaults(func=cmd_fetch)

    p = subparsers.add_parser("cancel", help="Cancel a job.", description="Cancel a job.")
    add_job_dir(p)
    p.set_defaults(func=cmd_cancel)
