"""The exceptions the command line turns into one line instead of a traceback.

`UserError`: bad input from the user, exit status 2 (`SubmittedNotRecorded`, `CheckpointPruned`,
`RemoteGone`: 1; `Interrupted`: 130). An `OSError`
of `WRITE_ERRNOS` (disk full, quota, file too large, read-only file system, no permission): the
file system refused, exit status 1; writers name the file (`with_filename`), since a failed
write() names none.
"""

from __future__ import annotations

import errno
from pathlib import Path


class UserError(Exception):
    """Bad input from the user (a file, a key, a flag): say what and where, no traceback."""

    exit_code = 2


# A worker's last stderr line when it fails starts with this; backends read the error from it.
WORKER_ERROR_PREFIX = "ringctl.worker: "

WRITE_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}
)
WRITE_FAILED_EXIT = 1


class StoppedOnRequest(Exception):
    """A task stopped by the job's warning signal (Slurm's --signal before the time limit, a
    preemption, `ringctl cancel`) after saving its work: not done, so the job must not read
    COMPLETED, and not a crash either: the worker says it in one line, without a traceback
    ("RuntimeError: stopped on request" and a traceback in every rank's log read as one)."""


class CheckpointPruned(UserError):
    """Every checkpoint gather took was pruned by the running job while it was read: not a
    damaged checkpoint (exit 3 said so), nor outputs not written yet; exit 1, run again."""

    exit_code = 1


class NotSubmitted(UserError):
    """The backend started nothing: it refused before starting the job (the local backend's
    config check; the Slurm and ssh backends' preparation), or sbatch exited with its own
    non-zero status. Only then may a resume put the job directory back (any other failure
    of a submission, a timeout or a dropped connection while sbatch ran, may have queued
    the job)."""


class Interrupted(UserError):
    """A Ctrl-C (SIGINT) once the backend may have queued the job (while sbatch ran, or after
    it printed an id): the job directory stays, and the line says what it holds and how to
    find or cancel the job. Exit status 130, as for any interrupt; a Ctrl-C before that
    removed the directory of a job Slurm ran (nothing named it)."""

    exit_code = 130


class RemoteGone(UserError):
    """An ssh job's directory on the login node is gone (moved, or a scratch purge): nothing
    can be fetched, and fetch said "fetched 0 file(s)", exit 0. gather goes on with the copy
    here (the last fetch's), saying so. Exit status 1."""

    exit_code = 1


class SubmittedNotRecorded(UserError):
    """The backend queued the job, then job.json could not take its id (the disk filled
    meanwhile): the job runs and no job directory names it, so the line says which job and how
    to cancel it. Exit status 1, as for the write it comes from."""

    exit_code = WRITE_FAILED_EXIT


def with_filename(err: OSError, path: str | Path) -> OSError:
    """err, naming path when it names no file (a failed write() or close() does not)."""
    if err.filename is not None or not err.errno:
        return err
    return type(err)(err.errno, err.strerror, str(path))


def write_failure(err: BaseException) -> str | None:
    """The one line for what the file system refused ("PATH: No space left on device"), or None
    when err is something else (a bug keeps its traceback)."""
    if not isinstance(err, OSError) or err.errno not in WRITE_ERRNOS:
        return None
    return path_error(err) or f"{err.strerror or err}"


def path_error(err: BaseException) -> str | None:
    """An OSError about one path as one line, ``PATH: strerror`` (None when it names no path:
    the caller says it otherwise). The one spelling of the CLI's, the local supervisor's and
    ``write_failure``'s."""
    if not isinstance(err, OSError) or err.filename is None or not err.strerror:
        return None
    return f"{err.filename}: {err.strerror}"


def naming(path: str | Path, said: str, *, within: str | Path | None = None, what: str = "") -> str:
    """``said`` as a line that names the file: unchanged when it starts with ``within``
    (default ``path``: the reader below named it already), else ``"PATH: said"``, or
    ``"PATH: what (said)"`` given ``what``. Readers that name their file are wrapped by callers
    that add context; this keeps the file named once."""
    if said.startswith(str(within if within is not None else path)):
        return said
    return f"{path}: {what} ({said})" if what else f"{path}: {said}"
