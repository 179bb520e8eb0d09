"""The interface every backend implements, and the job directory they all share.

A job directory (created by `ringctl submit`/`run` before any backend sees it) holds:

    config.yaml      the resolved job config (what was asked)
    job.sh           the rendered batch script (the local backend keeps it for reference)
    job.json         backend name, job id, submit time, remote location (written at submission)
    plan.json        the ring placement (written by the job itself once nodes are known)
    probes/          one `ringctl topo probe` JSON per node
    logs/            rank-<R>.out / rank-<R>.err per rank, plus the batch script's own log
    out/             the task's output shards and manifest

A backend never interprets the task: it starts the script (or the local equivalent), reports the
state, streams logs and cancels.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


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


class Backend(Protocol):
    name: str

    def submit(self, job_dir: Path) -> str:
        """Start the job described by job_dir; return its id (also recorded in job.json)."""

    def status(self, job_dir: Path) -> JobStatus: ...

    def logs(
        self, job_dir: Path, *, rank: int | None = None, follow: bool = False
    ) -> Iterator[str]:
        """Yield log text (whole lines), of one rank or of all; with follow, until the job ends."""

    def cancel(self, job_dir: Path) -> None: ...
