"""A job directory: the one module that knows its layout, its control files and its lifecycle.

Like submitit's `JobPaths`, everything else asks this module for a path instead of joining
names by hand:

    config.yaml      the resolved job config (what was asked)            control, local only
    job.sh           the rendered batch script                            control
    job.json         backend name, job id, submit time, remote location  control, local only
    state.json       the local supervisor's record of the ranks           control (local backend)
    supervisor.pid   the local supervisor's pid and start time            control (local backend)
    placement.json   the ring placement (written by the job once nodes are known)
    schedule.json    a long-document job's schedule (rank 0 writes it; `plan JOB` reads it)
    checkpoints/     a training job's checkpoints (ringctl.train.checkpoint owns what is inside)
    probes/          one `ringctl topo probe` JSON per node
    logs/            rank-<R>.out|err|result.json|failed, batch-<id>.out, progress.json (rank 0's
                     counts), rings/<label>.json (each ring's progress, written by its lead),
                     metrics.jsonl (a training job's steps: ringctl.train.metrics),
                     supervisor.log (the local backend's supervisor)
    out/             the task's output shards and manifest
    gathered/        where `ringctl gather` writes by default (the task's gatherer owns it)
    attempts/<n>/    an earlier attempt's logs and placement (`ringctl resume`)
    attempts/requeue-<id>-<k>/   the same for a run of job <id> that Slurm requeued (its k-th
                     rerun moved them there: templates/slurm.sh.j2)

Control files are written atomically (temporary file, fsync, rename: `ringctl.atomic`). A new
directory is built under a temporary name and renamed into place, so a failed submit leaves
no half directory and never an empty config.yaml. Verbs that change a directory (resume,
cancel, gather --force, submit into an existing directory) hold its lock (`JobDir.lock`).

The writer and the reader of a file ask for it by the same method (`progress`,
`ring_progress`/`ring_progress_label`, `rank_result`), so the two cannot drift apart. Where
the directory is not a local path (a login node over SFTP, a shell's string path), the same
relative names are here as functions and tuples (`rank_log_name`, `FETCHED_DIRS`,
`ARCHIVED_ON_RESUME`, `RESENT_ON_RESUME`), joined by the backend on its side.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .atomic import atomic_write, atomic_write_json, default_dir_mode
from .bounded_read import read_regular
from .errors import SubmittedNotRecorded, UserError, naming, with_filename
from .terminal import visible
from .text import is_ascii_number

CONFIG = "config.yaml"
SCRIPT = "job.sh"
META = "job.json"
STATE = "state.json"
SUPERVISOR = "supervisor.pid"
PLACEMENT = "placement.json"
LOCK = ".lock"
SCHEDULE = "schedule.json"
CHECKPOINTS = "checkpoints"
# A checkpoint folder's DCP index (torch.distributed.checkpoint's own name): the one dot file
# that belongs to a job's outputs (the SSH fetch passes over the others).
DCP_METADATA = ".metadata"
LOGS, OUT, PROBES, ATTEMPTS = "logs", "out", "probes", "attempts"
GATHERED = "gathered"
BATCH_LOG = "logs/batch-{job_id}.out"
SUPERVISOR_LOG = f"{LOGS}/supervisor.log"
PROGRESS = f"{LOGS}/progress.json"
METRICS = f"{LOGS}/metrics.jsonl"
RINGS = f"{LOGS}/rings"
RESULT = "result.json"  # logs/rank-<R>.result.json: what a rank's worker ended with
# logs/rank-<R>.failed: empty, written before a failed rank's result so that one listing of
# logs/ shows which ranks failed (a wrapper around the worker may turn its exit 1 into 0, and
# reading every result over SSH costs a round trip each).
FAILED_MARK = "failed"

# The remote side (ringctl.backends.ssh joins these on the login node, relative to the copy):
# what `fetch` brings back (PLACEMENT too), what `resume` moves to attempts/<n> there, and
# the control files it sends again.
FETCHED_DIRS = (OUT, LOGS, PROBES, ATTEMPTS, CHECKPOINTS)
ARCHIVED_ON_RESUME = (LOGS, PLACEMENT)
RESENT_ON_RESUME = (CONFIG, SCRIPT)


def script_names() -> dict[str, str]:
    """The names the batch script (templates/slurm.sh.j2) writes and moves, as render variables
    (`names.logs`, `names.placement`, ...): the script and this module agree by construction."""
    return {
        "config": CONFIG,
        "placement": PLACEMENT,
        "logs": LOGS,
        "out": OUT,
        "probes": PROBES,
        "attempts": ATTEMPTS,
        "progress": PROGRESS,
        "rings": RINGS,
        "metrics": METRICS,
    }


# job.json's mark of a submission that may have been queued with no id recorded (`submit`)
UNKNOWN_SUBMISSION = "submission_unknown"
# Files a job's own processes (or a remote copy of the directory) may never replace: they say
# what was asked, where it runs and how to reach it.
CONTROL_FILES = frozenset({CONFIG, SCRIPT, META, STATE, SUPERVISOR, LOCK})
# What a directory keeps across attempts; everything else belongs to one attempt. A training
# job's checkpoints are what its next attempt resumes from (moved with the logs, every
# `ringctl resume` of a training job started again at step 0).
KEPT_ACROSS_ATTEMPTS = frozenset({CONFIG, SCRIPT, META, LOCK, OUT, PROBES, ATTEMPTS, CHECKPOINTS})
# Every entry a job directory holds of its own: a gather may write inside the directory
# (GATHERED, or a folder of another name), never at or under these.
JOB_ENTRIES = CONTROL_FILES | KEPT_ACROSS_ATTEMPTS | {PLACEMENT, SCHEDULE, LOGS}


def job_entry_under(path: Path, job_dir: Path) -> str | None:
    """The job directory's own entry (``JOB_ENTRIES``) that ``path`` is or lies under, both
    resolved; None where it is none of them (outside the directory too). A gather written to
    checkpoints/latest or checkpoints/step-N was taken for a checkpoint by every later
    resume, prune and gather."""
    try:
        rel = path.resolve().relative_to(Path(job_dir).resolve())
    except (ValueError, OSError, RuntimeError):
        return None
    return rel.parts[0] if rel.parts and rel.parts[0] in JOB_ENTRIES else None


def rank_log_file(rank: int | str, ext: str) -> str:
    """rank-<R>.<ext> (out, err, result.json), R the launch index: a name inside logs/."""
    return f"rank-{rank}.{ext}"


# A rank's stdout and stderr logs in logs/, as `rank_log_file(R, "out" | "err")` names them.
_RANK_STREAM = re.compile(r"rank-([0-9]+)\.(out|err)")  # ASCII: "\d" took rank-٣


def rank_stream_of(name: str) -> tuple[int, str] | None:
    """(R, "out" or "err") when `name` is rank R's stdout or stderr log, else None."""
    found = _RANK_STREAM.fullmatch(name)
    return (int(found.group(1)), found.group(2)) if found else None


def rank_log_name(rank: int | str, ext: str) -> str:
    """logs/rank-<R>.<ext>, relative to the job directory (a shell's or remote path)."""
    return f"{LOGS}/{rank_log_file(rank, ext)}"


def ring_progress_name(label: str) -> str:
    """logs/rings/<label>.json: the progress record of the ring `label` (spaces as '-')."""
    return f"{RINGS}/{label.replace(' ', '-')}.json"


def ring_progress_label(name: str) -> str | None:
    """The label of the ring whose progress record is named ``name`` in logs/rings/ (as
    `ring_progress_name` names it; spaces read back as '-'), None for any other name."""
    label = name.removesuffix(".json")
    return label if label != name and label and not label.startswith(".") else None


def attempt_name(name: str) -> str:
    """attempts/<name>, relative to the job directory."""
    return f"{ATTEMPTS}/{name}"


def requeued_attempt(job_id: str, restart: int) -> str:
    """Where the batch script keeps the run of job `job_id` that Slurm's `restart`-th requeue
    replaced, relative to the job directory (the script writes the same name in bash)."""
    return attempt_name(f"requeue-{job_id}-{restart}")


@dataclass(frozen=True)
class JobDir:
    """Paths and control files of one job directory (which need not exist yet)."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)

    # -- names -------------------------------------------------------------------------------
    @property
    def config(self) -> Path:
        return self.path / CONFIG

    @property
    def script(self) -> Path:
        return self.path / SCRIPT

    @property
    def meta_file(self) -> Path:
        return self.path / META

    @property
    def state_file(self) -> Path:
        return self.path / STATE

    @property
    def supervisor_file(self) -> Path:
        return self.path / SUPERVISOR

    @property
    def placement(self) -> Path:
        return self.path / PLACEMENT

    @property
    def logs(self) -> Path:
        return self.path / LOGS

    @property
    def out(self) -> Path:
        return self.path / OUT

    @property
    def probes(self) -> Path:
        return self.path / PROBES

    @property
    def attempts(self) -> Path:
        return self.path / ATTEMPTS

    @property
    def schedule(self) -> Path:
        return self.path / SCHEDULE

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def supervisor_log(self) -> Path:
        """logs/supervisor.log: what the local backend's supervisor prints."""
        return self.path / SUPERVISOR_LOG

    @property
    def gathered(self) -> Path:
        """gathered/: where `ringctl gather` writes when no OUT is given."""
        return self.path / GATHERED

    @property
    def progress(self) -> Path:
        """logs/progress.json: rank 0's counts (worker.TaskContext writes, `status` reads)."""
        return self.path / PROGRESS

    def ring_progress(self, label: str) -> Path:
        """logs/rings/<label>.json: a ring's progress (its lead writes it)."""
        return self.path / ring_progress_name(label)

    def rank_log(self, rank: int | str, ext: str) -> Path:
        """logs/rank-<R>.<ext> (out, err, result.json), R the launch index."""
        return self.path / rank_log_name(rank, ext)

    def rank_result(self, rank: int | str) -> Path:
        """logs/rank-<R>.result.json: the worker writes it at its end, backends read it."""
        return self.rank_log(rank, RESULT)

    def rank_failed_mark(self, rank: int | str) -> Path:
        """logs/rank-<R>.failed: the worker writes it before a failed rank's result."""
        return self.rank_log(rank, FAILED_MARK)

    def batch_log(self, job_id: str) -> Path:
        return self.path / BATCH_LOG.format(job_id=job_id)

    # -- control files -----------------------------------------------------------------------
    def read_meta(self) -> dict:
        """job.json ({} before submission); a damaged one is a one-line error."""
        return _read_json_object(self.meta_file, missing={})

    def update_meta(self, *, drop: tuple[str, ...] = (), **fields) -> dict:
        """job.json with ``fields`` set and the keys ``drop`` names removed."""
        data = self.read_meta()  # a backend may have added fields of its own: keep them
        for key in drop:
            data.pop(key, None)
        data.update(fields)
        atomic_write_json(self.meta_file, data)
        return data

    def record_submission(self, job_id: str, cancel_with: str, **fields) -> dict:
        """job.json takes the id (and fields) of a job the backend has just queued. A write that
        fails now (a disk that filled meanwhile) leaves a queued job no job.json names: one
        line says which job and how to cancel it (`cancel_with`), and the directory stays."""
        try:  # the submission is known now
            return self.update_meta(job_id=job_id, drop=(UNKNOWN_SUBMISSION,), **fields)
        except OSError as err:
            raise SubmittedNotRecorded(
                f"submitted job {job_id}, but could not record it in {self.meta_file}: "
                f"{err.strerror or err}; cancel it with `{cancel_with}` if unwanted"
            ) from None

    def submission_unknown(self, meta: dict | None = None) -> bool:
        """Whether job.json (``meta``: as already read) names no job because its last
        submission may have been queued (sbatch timing out, a connection dropped while it
        ran, no id printed): a plain submit's (``mark_submission_unknown``) or a resume's
        (the attempts it moved)."""
        meta = self.read_meta() if meta is None else meta
        return not meta.get("job_id") and bool(meta.get("attempts") or meta.get(UNKNOWN_SUBMISSION))

    def mark_submission_unknown(self) -> None:
        """Say in job.json that the submission may have been queued (best effort: the
        error that follows says it too)."""
        try:
            self.update_meta(**{UNKNOWN_SUBMISSION: True})
        except (OSError, UserError):
            pass

    def read_state(self) -> dict | None:
        try:
            return _read_json_object(self.state_file, missing=None)
        except UserError:
            return None  # being replaced right now, or damaged: the supervisor rewrites it

    def write_state(self, state: dict) -> None:
        atomic_write_json(self.state_file, state)

    # -- attempts ----------------------------------------------------------------------------
    def new_attempt(self) -> Path:
        """attempts/<n> for n one above the highest present (a deleted one leaves a gap).
        attempts/ must be a real folder: made a link, resume moved the attempt's files to
        wherever it pointed."""
        self.attempts.mkdir(exist_ok=True)
        if self.attempts.is_symlink() or not self.attempts.is_dir():
            raise UserError(f"{self.attempts}: not a folder (a link?); nothing was moved")
        names = [p.name for p in self.attempts.iterdir()]
        numbers = [int(n) for n in names if is_ascii_number(n, 9)]
        target = self.attempts / str(max(numbers, default=0) + 1)
        target.mkdir()
        return target

    def archive_attempt(self) -> Path:
        """Move this attempt's files (logs, placement, state) to attempts/<n>; fresh logs/."""
        target = self.new_attempt()
        for entry in self.path.iterdir():
            if entry.name not in KEPT_ACROSS_ATTEMPTS:
                entry.rename(target / entry.name)
        self.logs.mkdir()
        return target

    def restore_attempt(self, target: Path) -> list[str]:
        """Undo `archive_attempt` into ``target`` (a resume whose submission failed): its
        files come back, the fresh logs/ goes where nothing was written in it. Returns the
        names left in ``target`` because the job directory has one of that name again."""
        if self.logs.is_dir() and not self.logs.is_symlink() and not any(self.logs.iterdir()):
            self.logs.rmdir()
        kept = []
        for entry in sorted(target.iterdir()):
            if os.path.lexists(self.path / entry.name):
                kept.append(entry.name)
            else:
                entry.rename(self.path / entry.name)
        if not kept:
            target.rmdir()
        return kept

    def remove_stale_temporaries(self) -> list[Path]:
        """Temporary files a killed atomic write left behind (`.<name>.<random>.tmp`)."""
        removed = []
        for root in (self.path, self.out, self.logs):
            if not root.is_dir():
                continue
            for entry in root.rglob(".*.tmp"):
                if entry.is_file() and not entry.is_symlink():
                    entry.unlink(missing_ok=True)
                    removed.append(entry)
        return removed

    # -- the lock ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self, verb: str) -> Iterator[None]:
        """Hold the directory's lock for a verb that changes it; refuse at once when another
        ringctl holds it (an flock: released by the kernel if the holder dies)."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
        try:  # a .lock made a link had its target truncated and rewritten
            fd = os.open(self.path / LOCK, flags, 0o644)
        except OSError as err:
            if err.errno != errno.ELOOP:
                raise with_filename(err, self.path / LOCK) from None
            raise UserError(f"{self.path / LOCK}: a link, not a lock file; remove it") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UserError(f"{self.path / LOCK}: not a regular file; remove it")
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                if err.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another ringctl"
                holder = visible(holder)
                raise UserError(
                    f"{self.path} is in use ({holder}); try again when that has finished"
                ) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"ringctl {verb}, pid {os.getpid()}\n".encode(), 0)
            yield
        finally:
            os.close(fd)

    # -- lifecycle ---------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | Path) -> JobDir:
        job = cls(Path(path).expanduser())
        if not job.config.is_file():
            raise UserError(f"{job.path} is not a job directory (no {CONFIG})")
        return job

    @classmethod
    def create(cls, files: dict[str, str | bytes], *, target: Path | None, base: Path, stem: str):
        """A new job directory holding `files` (name -> content) and empty logs/, probes/,
        out/: at `target` (which must not exist or be an empty directory), else at
        base/<stem>, base/<stem>-2, ... Built under a temporary name, then renamed."""
        parent = target.parent if target is not None else base
        if target is not None and target.exists():
            if not target.is_dir():
                raise UserError(f"job_dir: {target} exists and is not a directory")
            if any(target.iterdir()):
                raise UserError(
                    f"job_dir: {target} exists and is not empty "
                    f"(to continue a job there: ringctl resume {target})"
                )
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise UserError(f"{parent} is not a directory (output_dir / job_dir)") from None
        tmp = Path(tempfile.mkdtemp(prefix=f".{stem}.", suffix=".creating", dir=parent))
        try:
            for sub in (LOGS, PROBES, OUT):
                (tmp / sub).mkdir()
            for name, content in files.items():
                atomic_write(tmp / name, content)
            if SCRIPT in files:  # executable, as private as the umask says (env.vars: tokens)
                (tmp / SCRIPT).chmod(default_dir_mode())
            tmp.chmod(default_dir_mode())  # mkdtemp made it 0700
            return cls(_rename_into_place(tmp, target, base, stem).resolve())
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    @staticmethod
    def find(root: str | Path, name: str | None = None) -> list[JobDir]:
        """Job directories directly under root (of the job `name`, if given), oldest first."""
        root = Path(root)
        if not root.is_dir():
            return []
        found = []
        for meta_path in _meta_files(root):
            try:
                meta = _read_json_object(meta_path, missing={})
            except (UserError, RecursionError):  # damaged or hostile: listed, UNKNOWN
                meta = {}
            if not isinstance(meta, dict) or (name is not None and meta.get("name") != name):
                continue
            created = str(meta.get("created_at", ""))
            found.append((created, meta_path.lstat().st_mtime, JobDir(meta_path.parent)))
        return [d for _, _, d in sorted(found, key=lambda t: (t[0], t[1]))]


def _meta_files(root: Path) -> list[Path]:
    """job.json of each job directory directly under root: a job.json that is a link to
    nothing too (a listing shows every job; glob passed it over), never one in a folder
    whose name starts with a dot (a submit's ``.NAME.XXXX.creating``, listed as an UNKNOWN
    job, even picked by --latest)."""
    try:
        folders = sorted(root.iterdir())
    except OSError:
        return []
    return [
        d / META
        for d in folders
        if not d.name.startswith(".") and d.is_dir() and os.path.lexists(d / META)
    ]


def job_of(path: Path) -> Path | None:
    """The job directory `path` is, or whose out/ it is; None for a bare output directory (a
    copy without a job around it)."""
    if (path / CONFIG).is_file():
        return path
    if path.name == OUT and (path.parent / CONFIG).is_file():
        return path.parent
    return None


def task_output(path: Path, subdir: str, marker: str) -> Path | None:
    """Where a task's output `subdir` (holding `marker`) is under a job directory, its out/,
    or a bare copy: `path/subdir` or `path/out/subdir`, the first that holds the marker."""
    for base in (path, path / OUT):
        if (base / subdir / marker).is_file():
            return base / subdir
    return None


def _rename_into_place(tmp: Path, target: Path | None, base: Path, stem: str) -> Path:
    if target is not None:
        try:
            os.rename(tmp, target)  # replaces an empty directory; fails on a non-empty one
        except OSError as err:
            raise UserError(f"job_dir: cannot create {target}: {err.strerror}") from None
        return target
    for n in range(1, 1000):
        candidate = base / (stem if n == 1 else f"{stem}-{n}")
        if candidate.exists():
            continue
        try:
            os.rename(tmp, candidate)
            return candidate
        except OSError as err:
            if err.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                continue
            raise
    raise UserError(f"output_dir: cannot create a new job directory under {base}")


MAX_CONTROL_BYTES = 16 << 20  # job.json, state.json: kilobytes (a rank's line each)


def _read_json_object(path: Path, *, missing):
    """A control file's JSON object: a regular file (no link followed: the job can write its
    directory, and a FIFO there hung `status`, a link to /dev/zero filled the memory) within
    MAX_CONTROL_BYTES."""
    if not os.path.lexists(path):
        return missing
    try:
        data = json.loads(read_regular(path, MAX_CONTROL_BYTES).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path}: not valid JSON ({err})") from None
    except ValueError as err:  # read_regular's: not a regular file, too long, unreadable
        raise UserError(naming(path, str(err))) from None
    except RecursionError:
        raise UserError(f"{path}: not valid JSON (nested too deeply)") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object")
    return data
