"""The base every backend (local, slurm, ssh) derives from, and the states they report.

A backend starts a job directory's work (see `ringctl.jobdir` for the layout), reports its
state, streams its logs and cancels it; it never interprets the task. What is the same for all
backends lives here once: following logs (`joblogs.follow_logs`), reading why a rank failed
(`joblogs.rank_error`), waiting for the end, and the defaults of `fetch` (nothing to fetch when
the files are local) and `close` (nothing to close).
"""

from __future__ import annotations

import enum
import shlex
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from ..jobdir import JobDir
from ..tasks.base import NamedFile
from . import joblogs
from .shell import LocalShell, Shell


class JobState(str, enum.Enum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    UNKNOWN = "UNKNOWN"

    @property
    def finished(self) -> bool:
        return self in (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED, JobState.TIMEOUT)


@dataclass
class JobStatus:
    job_id: str
    state: JobState
    reason: str = ""  # e.g. "rank 2 exited 1: ValueError: ..." or Slurm's reason
    exit_code: int | None = None
    elapsed_s: float | None = None
    ranks: dict[int, str] = field(default_factory=dict)  # rank -> its own state, where known


class Backend(ABC):
    """One way of running jobs. Methods take the job directory (a path or a `JobDir`)."""

    name: ClassVar[str]
    poll_s: float = 1.0
    # What callers ask before (or without) making one, instead of testing its name:
    # the nodes see this machine's files (a filesystem shared with them): a job's paths
    # (task.inputs, task.model_path) name files here, which submit checks and reads, and the
    # ranks can start this interpreter (sys.executable) and import what it imports, so submit
    # checks the task's packages here and the script runs this Python. Else (ssh) the paths
    # are the login node's (`check_named_files` looks there) and the job names its own Python
    # or runs `python3`.
    files_here: ClassVar[bool] = True
    # every rank runs on this machine: their memory together is this host's.
    ranks_here: ClassVar[bool] = False
    # the batch script probes the nodes and places the ring on them (ring.placement).
    places_ring: ClassVar[bool] = True
    # the batch script sets up env.venv, env.conda, env.modules and a container for the
    # ranks; where not (local), they run this interpreter, whatever those name.
    sets_up_env: ClassVar[bool] = True

    @classmethod
    def create(cls, cfg) -> Backend:
        """The backend for a resolved job config (`submission.get_backend`)."""
        return cls()

    # -- what each backend must say --------------------------------------------------------
    @abstractmethod
    def submit(self, job_dir: Path) -> str:
        """Start the job described by job_dir; return its id (also recorded in job.json)."""

    @abstractmethod
    def status(self, job_dir: Path) -> JobStatus: ...

    @abstractmethod
    def cancel(self, job_dir: Path) -> None: ...

    def check_named_files(self, named: list[NamedFile]) -> None:
        """Refuse, before anything is created, a job whose named files (its task's
        ``named_files``) are not where its ranks run. Nothing here: where the nodes see this
        machine's files (``files_here``), the task's checks read them when the config loads."""
        return None

    # -- where the job's files are (the ssh backend's are on the login node) ------------------
    @property
    def shell(self) -> Shell:
        return LocalShell()

    def cluster_dir(self, job_dir: Path) -> str:
        """The job directory where its files are written (as the shell sees it)."""
        return str(Path(job_dir).resolve())

    def cancel_command(self, job_dir: Path, job_id: str) -> str:
        """The command that cancels this job by hand, for a message (needed where job.json
        could not record the job: `JobDir.record_submission`)."""
        return f"ringctl cancel {shlex.quote(str(job_dir))}"

    def batch_log_name(self, job_dir: Path) -> str | None:
        """The batch script's own log, relative to the job directory (None: there is none)."""
        return None

    def is_finished(self, job_dir: Path) -> bool:
        """Cheap check used while following logs."""
        return self.status(job_dir).state.finished

    # -- the same for every backend ----------------------------------------------------------
    def logs(
        self, job_dir: Path, *, rank: int | None = None, follow: bool = False
    ) -> Iterator[str]:
        """Lines of rank R's `.out` then `.err`, or of every log (prefixed `[batch] ` or
        `[rank R] `); with follow, new lines as they are written, until the job ends."""
        source = joblogs.LogSource(
            self.shell, self.cluster_dir(job_dir), self.batch_log_name(job_dir)
        )
        if not follow:
            yield from joblogs.read_logs(source, rank)
            return
        yield from joblogs.follow_logs(
            source, rank, lambda: self.is_finished(job_dir), poll_s=max(0.2, min(self.poll_s, 2))
        )

    def rank_error(self, job_dir: Path, rank: int) -> str:
        """What rank (launch index) `rank` said went wrong, in one line."""
        return joblogs.rank_error(self.shell, self.cluster_dir(job_dir), rank)

    def settled(self, job_dir: Path, status: JobStatus) -> bool:
        """Whether ``status`` is the job's last word: finished, or UNKNOWN where nothing will
        change it (``is_finished``: a damaged state.json and no supervisor; a job Slurm
        forgot). `run`, `logs -f` and `wait` waited on such a job for ever."""
        if status.state is JobState.UNKNOWN:
            return self.is_finished(job_dir)
        return status.state.finished

    def wait(
        self, job_dir: Path, *, timeout: float | None = None, poll_s: float | None = None
    ) -> JobStatus:
        """Poll status() until it is the job's last word (``settled``) or timeout seconds
        pass (the last status)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            st = self.status(job_dir)
            if self.settled(job_dir, st) or (deadline is not None and time.monotonic() >= deadline):
                return st
            time.sleep(self.poll_s if poll_s is None else poll_s)

    def fetch(self, job_dir: Path) -> list[str]:
        """Bring the job's outputs and logs into the local directory; local files: nothing."""
        return []

    def still_running(self, job: JobDir) -> str | None:
        """What of the job still runs where this backend can tell it apart from its record
        (the local supervisor), or None: a resume beside it would run two rings on out/."""
        return None

    def refuse_resume(self, job: JobDir) -> None:  # noqa: B027 - a default: nothing to check
        """Refuse (UserError) a resume this backend cannot continue, before anything of the
        job directory moves (the ssh backend's: a login-node directory that is gone)."""

    def stop_leftovers(self, job: JobDir) -> None:  # noqa: B027 - a default: none to stop
        """Stop what of the job's last attempt outlived it where this backend can find it (the
        local backend's workers), before resume moves that attempt's records away."""

    def refuse_unstartable(self, cfg) -> None:  # noqa: B027 - a default: nothing to check
        """Refuse (UserError) a job config this backend could never start, before anything is
        written or moved: resume checks its config here before the last attempt moves."""

    def prepare_resume(self, job: JobDir) -> None:
        """Forget the previous attempt's submission so that submit() accepts the directory."""
        job.update_meta(job_id=None)

    def undo_resume(self, job: JobDir, attempt: str) -> list[str]:
        """Put back what `prepare_resume` and a failed `submit` changed outside the job
        directory (which resume puts back itself), the attempt being attempts/<attempt>;
        returns what could not be, said. Local backends: nothing outside it."""
        return []

    def close(self) -> None:  # noqa: B027 - a default, not an abstract method
        """Release connections (the ssh backend's); nothing for local backends."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
