"""Verbs for jobs: config, render, submit, run, status, logs, cancel.

    ringctl config JOB [KEY=VALUE ...]     the resolved config (YAML)
    ringctl render JOB [KEY=VALUE ...]     the Slurm batch script (dry run: nothing submitted)
    ringctl submit JOB [KEY=VALUE ...]     create the job directory, hand it to the backend
    ringctl run JOB [KEY=VALUE ...]        submit, follow the log until the end; 0 iff COMPLETED
    ringctl status [JOBDIR ... | JOB [KEY=VALUE ...]] [--latest] [--dir-only]
                                           a table (default: every job under ./runs)
    ringctl logs JOBDIR [-f] [--rank R]    the ranks' logs
    ringctl cancel JOBDIR

Backends are modules `ringctl.backends.<name>` with `create(cfg) -> Backend`, imported only
when used.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from .. import __version__
from ..config import load_job, load_job_from_dict, safe_dir_name, to_yaml
from ..errors import UserError
from ..tasks import get_spec

# --- helpers shared by the verbs ----------------------------------------------------------------


def get_backend(cfg, name: str | None = None):
    name = name or cfg.backend.value
    try:
        module = importlib.import_module(f"ringctl.backends.{name}")
    except ModuleNotFoundError as err:
        if err.name == f"ringctl.backends.{name}":
            raise UserError(f"backend {name!r} is not available in this installation") from None
        raise
    return module.create(cfg)


def _read_job_json(job_dir: Path) -> dict:
    try:
        return json.loads((job_dir / "job.json").read_text())
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as err:
        raise UserError(f"{job_dir}/job.json: not valid JSON ({err})") from None


def _update_job_json(job_dir: Path, **fields) -> dict:
    data = _read_job_json(job_dir)  # the backend may have added fields of its own: keep them
    data.update(fields)
    tmp = job_dir / ".job.json.tmp"
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(job_dir / "job.json")
    return data


def open_job_dir(path: str | Path):
    """(job_dir, cfg, backend) for an existing job directory."""
    from ..config import load_resolved

    job_dir = Path(path)
    if not (job_dir / "config.yaml").is_file():
        raise UserError(f"{job_dir} is not a job directory (no config.yaml)")
    cfg = load_resolved(job_dir / "config.yaml")
    name = _read_job_json(job_dir).get("backend") or cfg.backend.value
    return job_dir, cfg, get_backend(cfg, name)


def _make_job_dir(cfg) -> Path:
    if cfg.job_dir:
        job_dir = Path(str(cfg.job_dir)).expanduser()
        if job_dir.exists() and any(job_dir.iterdir()):
            raise UserError(f"job_dir: {job_dir} exists and is not empty")
        job_dir.mkdir(parents=True, exist_ok=True)
        return job_dir.resolve()
    base = Path(str(cfg.output_dir)).expanduser()
    base.mkdir(parents=True, exist_ok=True)
    stem = f"{safe_dir_name(str(cfg.name))}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    for n in range(1, 1000):
        job_dir = base / (stem if n == 1 else f"{stem}-{n}")
        try:
            job_dir.mkdir()
            return job_dir.resolve()
        except FileExistsError:
            continue
    raise UserError(f"output_dir: cannot create a new job directory under {base}")


def check_plan(cfg, *, force: bool = False) -> None:
    """Refuse, with the plan's reason, a job whose ranks cannot hold their share."""
    from .plan import preflight

    verdict = preflight(cfg)
    if verdict is None:
        return
    est = verdict.estimate
    if not est.fits:
        if not force:
            raise UserError(
                f"ringctl plan ({verdict.device}): {verdict.reason}. Nothing was submitted; "
                "give more ranks, a shorter sequence, or --force to submit anyway"
            )
        print(f"warning: submitting despite the plan (--force): {verdict.reason}", file=sys.stderr)
    elif est.warnings:
        print(f"plan ({verdict.device}): {verdict.reason}", file=sys.stderr)


def submit_job(job_file: str, overrides: list[str], *, force: bool = False):
    """Load, plan, render, create the job directory, submit. Returns (job_dir, job_id, backend)."""
    from ..render import render_script

    cfg = load_job(job_file, overrides)
    prepared = get_spec(str(cfg.task.name)).prepare(cfg)
    if prepared is not cfg:  # re-validated: what is written is what was checked
        cfg = load_job_from_dict(prepared, source=str(job_file))
    check_plan(cfg, force=force)
    script = render_script(cfg)  # before anything is written: a template error stops here
    backend = get_backend(cfg)
    job_dir = _make_job_dir(cfg)
    for sub in ("logs", "probes", "out"):
        (job_dir / sub).mkdir(exist_ok=True)
    (job_dir / "config.yaml").write_text(to_yaml(cfg))
    (job_dir / "job.sh").write_text(script)
    (job_dir / "job.sh").chmod(0o755)
    _update_job_json(
        job_dir,
        backend=backend.name,
        name=str(cfg.name),
        source=str(job_file),
        overrides=list(overrides),
        local_dir=str(job_dir),
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        ringctl_version=__version__,
    )
    job_id = backend.submit(job_dir)
    _update_job_json(job_dir, job_id=str(job_id))
    return job_dir, str(job_id), backend


# --- verbs ----------------------------------------------------------------------------------------


def cmd_config(args) -> int:
    sys.stdout.write(to_yaml(load_job(args.job, args.overrides)))
    return 0


def cmd_render(args) -> int:
    from ..render import render_script

    cfg = load_job(args.job, args.overrides)
    sys.stdout.write(render_script(cfg, job_dir=args.job_dir))
    return 0


def cmd_submit(args) -> int:
    job_dir, job_id, backend = submit_job(args.job, args.overrides, force=args.force)
    print(f"submitted job {job_id} ({backend.name}) in {job_dir}")
    return 0


def cmd_run(args) -> int:
    job_dir, job_id, backend = submit_job(args.job, args.overrides, force=args.force)
    print(f"submitted job {job_id} ({backend.name}) in {job_dir}", flush=True)
    return follow_to_end(job_dir, job_id, backend, rank=None if args.all_ranks else args.rank)


def follow_to_end(job_dir: Path, job_id: str, backend, *, rank: int | None) -> int:
    """Print the job's log as it grows, then its final state; 0 only if COMPLETED."""
    try:
        for line in backend.logs(job_dir, rank=rank, follow=True):
            print(line, flush=True)
        status = backend.status(job_dir)
        while not status.state.finished:  # logs ended first: wait for the final word
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
    if status.reason:
        line += f": {status.reason}"
    print(line, file=sys.stdout if status.state.value == "COMPLETED" else sys.stderr)
    print(f"job directory: {job_dir}")
    return 0 if status.state.value == "COMPLETED" else 1


# What a job directory keeps across attempts; everything else belongs to one attempt.
_KEPT_ACROSS_ATTEMPTS = {"config.yaml", "job.sh", "job.json", "out", "probes", "attempts"}


def resume_job(job_dir: Path):
    """Submit a finished (failed, cancelled, timed-out) job again into its own directory.

    Its outputs stay; tasks skip work already complete (the long-document task skips
    documents whose every shard is written and verified). The previous attempt's logs and
    state move to attempts/<n>/.
    """
    job_dir, cfg, backend = open_job_dir(job_dir)
    before = backend.status(job_dir)
    if not before.state.finished and before.state.value != "UNKNOWN":
        raise UserError(
            f"{job_dir}: job {before.job_id} is {before.state.value}; cancel it first "
            f"(`ringctl cancel {job_dir}`) or wait for it to end"
        )
    attempts = job_dir / "attempts"
    attempts.mkdir(exist_ok=True)
    previous = attempts / str(len(list(attempts.iterdir())) + 1)
    previous.mkdir()
    for entry in job_dir.iterdir():
        if entry.name not in _KEPT_ACROSS_ATTEMPTS:
            entry.rename(previous / entry.name)
    (job_dir / "logs").mkdir()
    history = _read_job_json(job_dir).get("attempts", [])
    history.append({"job_id": before.job_id, "state": before.state.value, "dir": str(previous)})
    _update_job_json(job_dir, attempts=history)
    job_id = backend.submit(job_dir)
    _update_job_json(job_dir, job_id=str(job_id))
    return job_dir, str(job_id), backend


def cmd_resume(args) -> int:
    job_dir, job_id, backend = resume_job(Path(args.job_dir))
    print(f"resubmitted as job {job_id} ({backend.name}) in {job_dir}", flush=True)
    if not args.follow:
        return 0
    return follow_to_end(job_dir, job_id, backend, rank=args.rank)


def _find_job_dirs(root: Path, name: str | None = None) -> list[Path]:
    """Job directories under root (of the job `name`, if given), oldest first."""
    if not root.is_dir():
        return []
    found = []
    for meta_path in root.glob("*/job.json"):
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            meta = {}
        if name is not None and meta.get("name") != name:
            continue
        found.append((str(meta.get("created_at", "")), meta_path.stat().st_mtime, meta_path.parent))
    return [d for _, _, d in sorted(found)]


def _status_targets(args) -> list[Path]:
    """JOBDIR..., or JOB [KEY=VALUE...] (that job's directories), or everything under --root."""
    targets = list(args.targets)
    if targets and Path(targets[0]).is_file():
        cfg = load_job(targets[0], targets[1:])
        if cfg.job_dir:
            dirs = [Path(str(cfg.job_dir))]
        else:
            dirs = _find_job_dirs(Path(str(cfg.output_dir)).expanduser(), str(cfg.name))
        if not dirs:
            raise UserError(f"no job directory of {cfg.name!r} under {cfg.output_dir}/")
    elif targets:
        dirs = [Path(t) for t in targets]
    else:
        dirs = _find_job_dirs(Path(args.root))
    return dirs[-1:] if args.latest else dirs


def _progress(job_dir: Path) -> str:
    try:
        p = json.loads((job_dir / "logs" / "progress.json").read_text())
        return f"{p['done']}/{p['total']} {p.get('unit', '')}".strip()
    except (OSError, ValueError, KeyError):
        return ""


def cmd_status(args) -> int:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    dirs = _status_targets(args)
    if args.dir_only:
        for job_dir in dirs:
            print(job_dir)
        return 0 if dirs else 1
    if not dirs:
        print(f"no jobs under {args.root}/ (give a job directory: ringctl status JOBDIR)")
        return 0
    table = Table(title=None, show_lines=False)
    table.add_column("job dir", overflow="fold", min_width=20)
    for col in ("name", "backend", "job id", "state", "elapsed", "progress"):
        table.add_column(col, no_wrap=True, min_width=len(col))
    table.add_column("reason", overflow="fold", min_width=20)
    colours = {
        "COMPLETED": "green",
        "FAILED": "red",
        "TIMEOUT": "red",
        "CANCELLED": "yellow",
        "RUNNING": "cyan",
        "PENDING": "blue",
    }
    worst = 0
    for job_dir in dirs:
        meta = _read_job_json(job_dir)
        try:
            _, cfg, backend = open_job_dir(job_dir)
            st = backend.status(job_dir)
            state, reason = st.state.value, st.reason
            elapsed = f"{st.elapsed_s:.1f}s" if st.elapsed_s is not None else ""
            job_id, name, bname = st.job_id, str(cfg.name), backend.name
        except UserError as err:
            if len(dirs) == 1:
                raise
            state, reason, elapsed = "UNKNOWN", str(err), ""
            job_id, name, bname = (
                meta.get("job_id", ""),
                meta.get("name", ""),
                meta.get("backend", ""),
            )
        cells = [str(job_dir), name, bname, str(job_id), state, elapsed, _progress(job_dir), reason]
        row = [Text(str(c)) for c in cells]  # plain text: no rich markup from logs or names
        row[4].stylize(colours.get(state, "white"))
        table.add_row(*row)
        if state == "UNKNOWN":
            worst = 1
    Console(width=max(120, Console().width)).print(table)
    return worst


def cmd_logs(args) -> int:
    job_dir, _, backend = open_job_dir(args.job_dir)
    try:
        for line in backend.logs(job_dir, rank=args.rank, follow=args.follow):
            print(line, flush=args.follow)
    except KeyboardInterrupt:
        return 130
    return 0


def cmd_cancel(args) -> int:
    job_dir, _, backend = open_job_dir(args.job_dir)
    before = backend.status(job_dir)
    if before.state.finished:
        print(f"job {before.job_id} already finished: {before.state.value}")
        return 0
    backend.cancel(job_dir)
    print(f"cancelled job {before.job_id} ({job_dir})")
    return 0


def register(subparsers) -> None:
    def job_parser(name: str, help_: str, func):
        p = subparsers.add_parser(name, help=help_, description=help_)
        p.add_argument("job", metavar="JOB", help="a job file, e.g. jobs/smoke.yaml")
        p.add_argument(
            "overrides",
            nargs="*",
            metavar="KEY=VALUE",
            help="config overrides in dotted form, e.g. nodes=4 slurm.partition=gpu",
        )
        p.set_defaults(func=func)
        return p

    job_parser("config", "Print the resolved job config (file + overrides) as YAML.", cmd_config)
    p = job_parser("render", "Print the Slurm batch script of a job (dry run).", cmd_render)
    p.add_argument(
        "--job-dir",
        default=None,
        help="render with absolute paths to this job directory (as seen on the cluster)",
    )
    force_help = "submit even when `ringctl plan` says the ranks cannot hold the job"
    p = job_parser("submit", "Create the job directory and submit the job.", cmd_submit)
    p.add_argument("--force", action="store_true", help=force_help)
    p = job_parser(
        "run", "Submit a job and follow its log until it ends (exit 0 only if COMPLETED).", cmd_run
    )
    p.add_argument("--force", action="store_true", help=force_help)
    p.add_argument("--rank", type=int, default=0, help="whose log to follow (default: 0)")
    p.add_argument("--all-ranks", action="store_true", help="follow every rank's log")

    p = subparsers.add_parser(
        "status", help="Show the state of jobs.", description="Show the state of jobs (a table)."
    )
    p.add_argument(
        "targets",
        nargs="*",
        metavar="JOBDIR | JOB [KEY=VALUE ...]",
        help="job directories, or a job file (+ overrides) for the directories of that job",
    )
    p.add_argument("--root", default="runs", help="where to look without JOBDIR (default: runs)")
    p.add_argument("--latest", action="store_true", help="only the most recent job")
    p.add_argument("--dir-only", action="store_true", help="print the job directories only")
    p.set_defaults(func=cmd_status)

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
    p.add_argument("job_dir", metavar="JOBDIR")
    p.add_argument("-f", "--follow", action="store_true", help="follow the log until it ends")
    p.add_argument("--rank", type=int, default=0, help="whose log to follow (default: 0)")
    p.set_defaults(func=cmd_resume)

    p = subparsers.add_parser("logs", help="Print a job's logs.", description="Print a job's logs.")
    p.add_argument("job_dir", metavar="JOBDIR")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    p.add_argument("--rank", type=int, default=None, help="only this rank (default: all)")
    p.set_defaults(func=cmd_logs)

    p = subparsers.add_parser("cancel", help="Cancel a job.", description="Cancel a job.")
    p.add_argument("job_dir", metavar="JOBDIR")
    p.set_defaults(func=cmd_cancel)
