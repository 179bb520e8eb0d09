"""The `slurm` backend: `sbatch` the job directory's `job.sh` on this host, then follow it with
`squeue`, `sacct` and `scancel`.

All Slurm commands and all reads of the job's files go through a `Shell`, so the same logic runs
on a login node over SSH (`ringctl.backends.ssh` gives it a paramiko shell and a remote copy of
the job directory). Here the shell is `LocalShell`: subprocesses and plain files.

What the backend adds to the job directory (see `base`): `job.json` with the job id, and the
batch script's own log `logs/batch-<jobid>.out` (stdout and stderr of the script, which is also
where `srun` reports a task that failed). The ranks write `logs/rank-<R>.out/.err` themselves.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Protocol

from ..errors import UserError
from . import slurm_states as ss
from .base import JobState, JobStatus

BATCH_LOG = "logs/batch-{job_id}.out"
WORKER_ERROR_PREFIX = "ringctl.worker: "  # the worker's last stderr line when it fails
_RANK_LOG = re.compile(r"^rank-(\d+)\.(out|err)$")
_TAIL_BYTES = 64 * 1024


class Shell(Protocol):
    """Where the Slurm commands run and the job's files are: this machine or a login node."""

    where: str  # for messages: "this machine", "root@login:22"

    def run(self, argv: Sequence[str], *, timeout: float = 60.0) -> tuple[int, str, str]:
        """Run argv (no shell); return (exit status, stdout, stderr)."""

    def read_from(self, path: str, offset: int = 0) -> bytes | None:
        """The bytes of the file from offset on; None when the file does not exist."""

    def listdir(self, path: str) -> list[str]:
        """Names in a directory; [] when it does not exist."""


class LocalShell:
    where = "this machine"

    def run(self, argv: Sequence[str], *, timeout: float = 60.0) -> tuple[int, str, str]:
        try:
            proc = subprocess.run(
                list(argv), capture_output=True, text=True, timeout=timeout, check=False
            )
        except FileNotFoundError:
            raise UserError(
                f"`{argv[0]}` not found on this machine: the slurm backend runs on a Slurm login "
                "node (use the ssh backend to submit through one)"
            ) from None
        except subprocess.TimeoutExpired:
            raise UserError(f"`{argv[0]}` did not answer within {timeout:.0f}s") from None
        return proc.returncode, proc.stdout, proc.stderr

    def read_from(self, path: str, offset: int = 0) -> bytes | None:
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                return f.read()
        except FileNotFoundError:
            return None

    def listdir(self, path: str) -> list[str]:
        try:
            return os.listdir(path)
        except (FileNotFoundError, NotADirectoryError):
            return []


def _one_line(text: str) -> str:
    return " ".join(text.split())


def read_job_json(job_dir: Path) -> dict:
    path = Path(job_dir) / "job.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as err:
        raise UserError(f"{path}: not valid JSON ({err})") from None


def update_job_json(job_dir: Path, **fields) -> dict:
    path = Path(job_dir) / "job.json"
    data = read_job_json(job_dir)
    data.update(fields)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return data


def create(cfg=None) -> SlurmBackend:
    """The backend for a resolved job config (nothing in it concerns this backend yet)."""
    return SlurmBackend()


class SlurmBackend:
    """Submit with `sbatch --parsable`; status from squeue, then sacct; logs; scancel.

    `sbatch_args` are added to every sbatch call (before the script, so they override its
    `#SBATCH` lines). `sacct_wait_s` bounds how long `status` waits for sacct to catch up with
    a job squeue already calls finished (accounting lags by a few seconds)."""

    name = "slurm"

    def __init__(
        self,
        shell: Shell | None = None,
        *,
        sbatch_args: Sequence[str] = (),
        sacct_wait_s: float = 30.0,
        poll_s: float = 1.0,
        command_timeout_s: float = 60.0,
    ) -> None:
        self._shell_obj = shell
        self.sbatch_args = list(sbatch_args)
        self.sacct_wait_s = sacct_wait_s
        self.poll_s = poll_s
        self.command_timeout_s = command_timeout_s

    # -- hooks the ssh backend overrides ---------------------------------------------------------

    @property
    def shell(self) -> Shell:
        if self._shell_obj is None:
            self._shell_obj = LocalShell()
        return self._shell_obj

    def _cluster_dir(self, job_dir: Path) -> str:
        """The job directory as the Slurm commands see it."""
        return str(Path(job_dir).resolve())

    def _prepare(self, job_dir: Path) -> str:
        """Make the job directory available to Slurm; return its path there."""
        (Path(job_dir) / "logs").mkdir(parents=True, exist_ok=True)
        return self._cluster_dir(job_dir)

    def _submitted_fields(self, job_dir: Path, cluster_dir: str) -> dict:
        return {"host": socket.gethostname()}

    def _after_final(self, job_dir: Path, status: JobStatus) -> None:
        """Called once status() has seen a final state (the ssh backend fetches results)."""

    # -- helpers -----------------------------------------------------------------------------------

    def _run(self, argv: Sequence[str]) -> tuple[int, str, str]:
        return self.shell.run(argv, timeout=self.command_timeout_s)

    def _job_id(self, job_dir: Path) -> str:
        job_dir = Path(job_dir)
        data = read_job_json(job_dir)
        job_id = data.get("job_id")
        if not job_id:
            raise UserError(f"{job_dir}: no job id in job.json (was the job submitted?)")
        if data.get("backend") not in (None, self.name):
            raise UserError(
                f"{job_dir}: submitted with the {data['backend']} backend, not {self.name}"
            )
        return str(job_id)

    def _read_text(self, path: str, *, tail: int | None = _TAIL_BYTES) -> str:
        data = self.shell.read_from(path, 0)
        if data is None:
            return ""
        if tail is not None and len(data) > tail:
            data = data[-tail:]
        return data.decode("utf-8", errors="replace")

    # -- Backend -----------------------------------------------------------------------------------

    def submit(self, job_dir: Path) -> str:
        job_dir = Path(job_dir)
        script = job_dir / "job.sh"
        if not script.is_file():
            raise UserError(f"{job_dir}: no job.sh to submit")
        previous = read_job_json(job_dir).get("job_id")
        if previous:
            raise UserError(f"{job_dir}: already submitted as job {previous}")
        where = self._prepare(job_dir)
        batch_log = f"{where}/logs/batch-%j.out"
        argv = [
            "sbatch",
            "--parsable",
            f"--chdir={where}",
            f"--output={batch_log}",
            f"--error={batch_log}",
            *self.sbatch_args,
            f"{where}/job.sh",
        ]
        rc, out, err = self._run(argv)
        if rc != 0:
            raise UserError(f"sbatch refused the job: {_one_line(err or out) or f'exit {rc}'}")
        lines = [ln for ln in out.strip().splitlines() if ln.strip()]
        job_id = lines[-1].split(";")[0].strip() if lines else ""
        if not job_id.isdigit():
            raise UserError(f"sbatch printed no job id: {_one_line(out + ' ' + err)}")
        since = self._cluster_clock()
        update_job_json(
            job_dir,
            backend=self.name,
            job_id=job_id,
            submitted_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            cluster_dir=where,
            batch_log=BATCH_LOG.format(job_id=job_id),
            sacct_since=since,
            **self._submitted_fields(job_dir, where),
        )
        return job_id

    def _cluster_clock(self) -> str | None:
        """The cluster's local time two minutes ago (sacct reads --starttime in its own zone),
        or None when it cannot be read: sacct then goes unfiltered, as before."""
        try:
            rc, out, _ = self._run(["date", "-d", "-2 minutes", "+%Y-%m-%dT%H:%M:%S"])
        except UserError:
            return None
        text = out.strip()
        return text if rc == 0 and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", text) else None

    def status(self, job_dir: Path) -> JobStatus:
        job_dir = Path(job_dir)
        job_id = self._job_id(job_dir)
        since = read_job_json(job_dir).get("sacct_since")
        status = self._status(job_id, self._cluster_dir(job_dir), since)
        if status.state.finished:
            self._after_final(job_dir, status)
        return status

    def wait(
        self, job_dir: Path, *, timeout: float | None = None, poll_s: float | None = None
    ) -> JobStatus:
        """Poll status() until the job is finished (or timeout seconds pass: the last status)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            st = self.status(job_dir)
            if st.state.finished or (deadline is not None and time.monotonic() >= deadline):
                return st
            time.sleep(self.poll_s if poll_s is None else poll_s)

    def cancel(self, job_dir: Path) -> None:
        job_id = self._job_id(Path(job_dir))
        rc, out, err = self._run(["scancel", job_id])
        if rc != 0 and "already completing or completed" not in err:
            raise UserError(f"scancel {job_id} failed: {_one_line(err or out)}")

    def logs(
        self, job_dir: Path, *, rank: int | None = None, follow: bool = False
    ) -> Iterator[str]:
        """Lines (without their newline) of rank R's `.out` then `.err`, or of every file when
        rank is None, each line prefixed `[batch] ` or `[rank R] `. With follow, new lines are
        yielded as they are written, until the job is finished."""
        job_dir = Path(job_dir)
        job_id = self._job_id(job_dir)
        where = self._cluster_dir(job_dir)
        if not follow:
            for path, prefix in self._log_files(where, job_id, rank):
                for line in self._read_text(path, tail=None).splitlines():
                    yield prefix + line
            return
        yield from self._follow(job_dir, where, job_id, rank)

    # -- status ------------------------------------------------------------------------------------

    def _squeue(self, job_id: str) -> ss.QueueEntry | None:
        rc, out, err = self._run(ss.squeue_argv(job_id))
        if rc != 0:
            if ss.squeue_says_unknown(err):
                return None
            raise UserError(f"squeue failed: {_one_line(err or out)}")
        return ss.parse_squeue(out, job_id)

    def _sacct(self, job_id: str, since: str | None = None) -> list[ss.AcctRecord] | None:
        """sacct's records of the job; None when sacct cannot answer (no accounting)."""
        rc, out, err = self._run(ss.sacct_argv(job_id, since))
        if rc != 0:
            return None
        return ss.parse_sacct(out, job_id)

    def _is_finished(self, job_id: str, since: str | None = None) -> bool:
        """Cheap check for `logs --follow`: squeue's word only (no waiting for sacct)."""
        q = self._squeue(job_id)
        if q is not None:
            return q.state.finished
        records = self._sacct(job_id, since)
        return not records or records[0].state.finished

    def _status(self, job_id: str, where: str, since: str | None = None) -> JobStatus:
        q = self._squeue(job_id)
        if q is not None and not q.state.finished and q.state is not JobState.UNKNOWN:
            reason = q.reason if q.state is JobState.PENDING else ""
            return JobStatus(job_id, q.state, reason=reason, elapsed_s=q.elapsed_s)

        # Finished, or forgotten by squeue: sacct has the details (steps, exit codes) but lags
        # squeue by a few seconds, so when squeue already calls the job finished, wait for it.
        records = self._sacct(job_id, since)
        if q is not None:
            deadline = time.monotonic() + self.sacct_wait_s
            while records is not None and time.monotonic() < deadline:
                if records and records[0].step is None and records[0].state.finished:
                    break
                time.sleep(min(1.0, self.poll_s))
                records = self._sacct(job_id, since)

        job = records[0] if records and records[0].step is None else None
        if job is not None and job.state.finished:
            return self._final_status(job_id, where, job.state, job, records or [])
        if q is not None:
            # No (timely) accounting: squeue's final state, with what the logs say.
            return self._final_status(job_id, where, q.state, None, [])
        if job is not None:
            # squeue forgot it, sacct has no end yet (a cluster whose accounting is behind)
            return JobStatus(job_id, job.state, elapsed_s=job.elapsed_s)
        if records is None:
            return JobStatus(
                job_id, JobState.UNKNOWN, reason="unknown to squeue, and sacct is not available"
            )
        return JobStatus(job_id, JobState.UNKNOWN, reason="unknown to squeue and sacct")

    def _final_status(
        self,
        job_id: str,
        where: str,
        state: JobState,
        job: ss.AcctRecord | None,
        records: list[ss.AcctRecord],
    ) -> JobStatus:
        batch_log = self._read_text(f"{where}/{BATCH_LOG.format(job_id=job_id)}")
        ranks = ss.parse_srun_errors(batch_log)
        step = ss.failing_step(records)
        exit_code = job.exit_code if job is not None else None
        elapsed = job.elapsed_s if job is not None else None
        reason = ""

        if state is JobState.COMPLETED and (step is not None or ranks):
            # The script ended well but a step (a rank) did not: that is a failed job.
            state = JobState.FAILED
        if state is JobState.FAILED:
            reason = self._failure_reason(where, batch_log, step, exit_code)
            if step is not None and step.exit_code:
                exit_code = step.exit_code
        elif state is JobState.TIMEOUT:
            reason = "time limit reached"
        elif state is JobState.CANCELLED:
            reason = job.raw_state if job is not None else "cancelled"
        if job is not None and job.reason and state is not JobState.COMPLETED:
            if job.reason not in reason:
                reason = f"{reason} [{job.reason}]" if reason else job.reason
        return JobStatus(
            job_id,
            state,
            reason=reason,
            exit_code=exit_code,
            elapsed_s=elapsed,
            ranks={r: what for r, what in sorted(ranks.items())},
        )

    def _rank_error(self, where: str, rank: int) -> str:
        """What rank (launch index) `rank` said went wrong: the worker's result file, else the
        worker's `ringctl.worker: ` line, else the last error-looking line of its stderr."""
        raw = self.shell.read_from(f"{where}/logs/rank-{rank}.result.json", 0)
        if raw:
            try:
                error = json.loads(raw.decode("utf-8", errors="replace")).get("error")
            except (json.JSONDecodeError, AttributeError):
                error = None
            if error:
                return _one_line(str(error))[:300]
        stderr = self._read_text(f"{where}/logs/rank-{rank}.err")
        for line in reversed(stderr.splitlines()):
            if line.startswith(WORKER_ERROR_PREFIX):
                return line[len(WORKER_ERROR_PREFIX) :].strip()[:300]
        return ss.error_summary(stderr)

    def _failure_reason(
        self, where: str, batch_log: str, step: ss.AcctRecord | None, exit_code: int | None
    ) -> str:
        first = ss.first_failed_task(batch_log)
        if first is not None:
            rank, what = first
            err = self._rank_error(where, rank)
            what = what[0].lower() + what[1:]
            return f"rank {rank} {what}" + (f": {err}" if err else "")
        if step is not None and step.step != "batch":
            sig = f", signal {step.signal}" if step.signal else ""
            return (
                f"step {step.step} ({step.name}) {step.raw_state.lower()} "
                f"with exit code {step.exit_code}{sig}"
            )
        err = ss.error_summary(batch_log)
        code = f"exit code {exit_code}" if exit_code is not None else "failed"
        return f"batch script {code}" + (f": {err}" if err else "")

    # -- logs --------------------------------------------------------------------------------------

    def _rank_files(self, where: str, rank: int | None) -> list[tuple[int, str, str]]:
        found = []
        for name in self.shell.listdir(f"{where}/logs"):
            m = _RANK_LOG.match(name)
            if m and (rank is None or int(m.group(1)) == rank):
                found.append((int(m.group(1)), m.group(2), name))
        found.sort(key=lambda t: (t[0], t[1] != "out"))
        return found

    def _log_files(self, where: str, job_id: str, rank: int | None) -> list[tuple[str, str]]:
        files: list[tuple[str, str]] = []
        if rank is None:
            files.append((f"{where}/{BATCH_LOG.format(job_id=job_id)}", "[batch] "))
        for r, _, name in self._rank_files(where, rank):
            files.append((f"{where}/logs/{name}", "" if rank is not None else f"[rank {r}] "))
        return files

    def _follow(
        self,
        job_dir: Path,
        where: str,
        job_id: str,
        rank: int | None,
        is_finished: Callable[[str], bool] | None = None,
    ) -> Iterator[str]:
        since = read_job_json(job_dir).get("sacct_since")
        is_finished = is_finished or (lambda jid: self._is_finished(jid, since))
        offsets: dict[str, int] = {}
        partial: dict[str, bytes] = {}
        poll = max(0.2, min(self.poll_s, 2.0))

        def drain(final: bool) -> Iterator[str]:
            for path, prefix in self._log_files(where, job_id, rank):
                data = self.shell.read_from(path, offsets.get(path, 0))
                if not data and not (final and partial.get(path)):
                    continue
                offsets[path] = offsets.get(path, 0) + len(data or b"")
                buf = partial.get(path, b"") + (data or b"")
                *lines, rest = buf.split(b"\n")
                if final and rest:
                    lines.append(rest)
                    rest = b""
                partial[path] = rest
                for line in lines:
                    yield prefix + line.decode("utf-8", errors="replace").rstrip("\r")

        while True:
            done = is_finished(job_id)  # checked before reading, so nothing written is missed
            yield from drain(final=done)
            if done:
                return
            time.sleep(poll)
