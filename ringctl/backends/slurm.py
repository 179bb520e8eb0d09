"""The `slurm` backend: `sbatch` the job directory's `job.sh` on this host, then follow it with
`squeue`, `sacct` and `scancel`.

All Slurm commands and all reads of the job's files go through a `Shell`, so the same logic runs
on a login node over SSH (`ringctl.backends.ssh` gives it a paramiko shell and a remote copy of
the job directory). Here the shell is `LocalShell`: subprocesses and plain files.

What the backend adds to the job directory (see `ringctl.jobdir`): `job.json` with the job id,
and the batch script's own log `logs/batch-<jobid>.out` (stdout and stderr of the script, which
is also where `srun` reports a task that failed). The ranks write `logs/rank-<R>.out/.err`.
"""

from __future__ import annotations

import shlex
import socket
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from ..errors import Interrupted, NotSubmitted, UserError
from ..jobdir import BATCH_LOG, JobDir, requeued_attempt
from ..sbatch import batch_log_arguments
from . import joblogs, listing, slurm_reruns
from . import slurm_states as ss
from .base import Backend, JobState, JobStatus
from .shell import LocalShell, Shell
from .slurm_states import SLURM_JOB_ID

__all__ = ["LocalShell", "Shell", "SlurmBackend"]

_TAIL_BYTES = 64 * 1024
# How many failed tasks are read back (over SSH, one file each) to find one whose error is
# not a peer loss; beyond it the first is blamed.
BLAME_READS = 8


def one_line(text: str) -> str:
    return " ".join(text.split())


def expected_ranks(cfg) -> int | None:
    """How many ranks the job launches (each must leave a result), None without a config."""
    from ..tasks.base import world_size

    return world_size(cfg) if cfg is not None else None


class SlurmBackend(Backend):
    """Submit with `sbatch --parsable`; status from squeue, then sacct; logs; scancel.

    `sbatch_args` are added to every sbatch call (before the script, so they override its
    `#SBATCH` lines). `sacct_wait_s` bounds how long `status` waits for sacct to catch up with
    a job squeue already calls finished (accounting lags by a few seconds). With
    `expected_ranks`, a job is COMPLETED only when each of its ranks left its result and
    none recorded a failure (`joblogs.list_results`); a job directory of no ringctl job has
    none to expect."""

    name = "slurm"

    @classmethod
    def create(cls, cfg) -> SlurmBackend:
        """The backend for a resolved job config: it expects a result from each of its ranks."""
        return cls(expected_ranks=expected_ranks(cfg))

    def __init__(
        self,
        shell: Shell | None = None,
        *,
        sbatch_args: Sequence[str] = (),
        sacct_wait_s: float = 30.0,
        poll_s: float = 1.0,
        command_timeout_s: float = 60.0,
        expected_ranks: int | None = None,
    ) -> None:
        self._shell_obj = shell
        self.expected_ranks = expected_ranks
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

    def _prepare(self, job_dir: Path) -> str:
        """Make the job directory available to Slurm; return its path there."""
        JobDir(job_dir).logs.mkdir(parents=True, exist_ok=True)
        return self.cluster_dir(job_dir)

    def _submitted_fields(self, job_dir: Path, cluster_dir: str) -> dict:
        return {"host": socket.gethostname()}

    # -- helpers -----------------------------------------------------------------------------------

    def _run(self, argv: Sequence[str]) -> tuple[int, str, str]:
        return self.shell.run(argv, timeout=self.command_timeout_s)

    def _job_id(self, job_dir: Path) -> str:
        job_dir = Path(job_dir)
        job = JobDir(job_dir)
        data = job.read_meta()
        job_id = data.get("job_id")
        if job.submission_unknown(data):  # a submission sbatch may have queued
            raise UserError(
                f"{job_dir}: job.json names no job: the last submission may have been "
                "queued; look for it (squeue --me), cancel it if so, then `ringctl resume "
                f"--force {job_dir}`"
            )
        if not job_id:
            raise UserError(f"{job_dir}: no job id in job.json (was the job submitted?)")
        if data.get("backend") not in (None, self.name):
            raise UserError(
                f"{job_dir}: submitted with the {data['backend']} backend, not {self.name}"
            )
        if not SLURM_JOB_ID.fullmatch(str(job_id)):  # else an option to scancel/scontrol
            raise UserError(f"{job_dir}: job.json's job_id {job_id!r} is not a Slurm job id")
        return str(job_id)

    def _read_tail(self, path: str) -> tuple[str, bool]:
        """The last _TAIL_BYTES of a log, and whether that was not all of it."""
        data = self.shell.read_from(path, 0, limit=_TAIL_BYTES, tail=True) or b""
        return data.decode("utf-8", errors="replace"), len(data) >= _TAIL_BYTES

    # -- Backend -----------------------------------------------------------------------------------

    def submit(self, job_dir: Path) -> str:
        job = JobDir(job_dir)
        if not job.script.is_file():
            raise NotSubmitted(f"{job_dir}: no job.sh to submit")
        previous = job.read_meta().get("job_id")
        if previous:
            raise UserError(f"{job_dir}: already submitted as job {previous}")
        try:
            where = self._prepare(job_dir)
        except UserError as err:  # before sbatch: nothing queued
            raise NotSubmitted(str(err)) from None
        argv = [
            "sbatch",
            "--parsable",
            *batch_log_arguments(where),  # `%` escaped for Slurm's file-name patterns
            *self.sbatch_args,
            f"{where}/job.sh",
        ]
        try:
            rc, out, err = self._run(argv)
        except KeyboardInterrupt:  # sbatch may have queued it: the submission keeps the job
            raise Interrupted("interrupted while sbatch ran") from None
        if rc > 0:  # sbatch's own refusal: nothing queued
            raise NotSubmitted(f"sbatch refused the job: {one_line(err or out) or f'exit {rc}'}")
        if rc != 0:  # killed by a signal, or the connection closed with no exit status
            raise UserError(f"sbatch ended without an exit status ({rc}): {one_line(err or out)}")
        lines = [ln for ln in out.strip().splitlines() if ln.strip()]
        job_id = lines[-1].split(";")[0].strip() if lines else ""
        if not SLURM_JOB_ID.fullmatch(job_id):
            raise UserError(f"sbatch printed no job id: {one_line(out + ' ' + err)}")
        # The id first, before anything else is asked of the cluster (its clock: a login
        # node slow to answer): a Ctrl-C from here on leaves a job.json that names the job.
        job.record_submission(
            job_id,
            self.cancel_command(job_dir, job_id),
            backend=self.name,
            submitted_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            cluster_dir=where,
            batch_log=BATCH_LOG.format(job_id=job_id),
            **self._submitted_fields(job_dir, where),
        )
        self._record_clock(job)
        return job_id

    def _record_clock(self, job: JobDir) -> None:
        """sacct's --starttime for the job, when the cluster's clock can be read and job.json
        written (else sacct goes unfiltered: slower, as right)."""
        since = self._cluster_clock()
        if since is not None:
            try:
                job.update_meta(sacct_since=since)
            except OSError:
                pass

    def _cluster_clock(self) -> str | None:
        """The cluster's local time two minutes ago (sacct reads --starttime in its own zone),
        or None when it cannot be read: sacct then goes unfiltered, as before."""
        try:
            rc, out, _ = self._run(["date", "-d", "-2 minutes", "+%Y-%m-%dT%H:%M:%S"])
        except UserError:
            return None
        text = out.strip()
        return text if rc == 0 and ss.is_clock(text) else None

    def status(self, job_dir: Path) -> JobStatus:
        job_id = self._job_id(job_dir)
        since = JobDir(job_dir).read_meta().get("sacct_since")
        return self._status(job_id, self.cluster_dir(job_dir), since)

    def batch_log_name(self, job_dir: Path) -> str | None:
        return BATCH_LOG.format(job_id=self._job_id(job_dir))

    def is_finished(self, job_dir: Path) -> bool:
        """squeue's word only (no waiting for sacct), for `logs --follow`."""
        since = JobDir(job_dir).read_meta().get("sacct_since")
        return self._is_finished(self._job_id(job_dir), since)

    def logs(self, job_dir: Path, *, rank: int | None = None, follow: bool = False):
        """The logs (`Backend.logs`); with every log shown, then what Slurm did to the job that
        the logs cannot say, as `[slurm] ` lines: the runs it requeued (where their logs went)
        and a node failure that ended the job."""
        yield from super().logs(job_dir, rank=rank, follow=follow)
        if rank is None:
            yield from (f"[slurm] {line}" for line in self._slurm_lines(job_dir))

    def _slurm_lines(self, job_dir: Path) -> list[str]:
        job_id = self._job_id(job_dir)
        runs = self._sacct_runs(job_id, JobDir(job_dir).read_meta().get("sacct_since"))
        if not runs:
            return []
        kept = self.requeue_kept(job_id, self.cluster_dir(job_dir))
        lines = slurm_reruns.rerun_lines(self._run, job_id, runs[:-1], 0, kept=kept)
        last = runs[-1][0]
        if last.step is None and ss.is_node_failure(last):
            lines.append(f"job {job_id} ended: {slurm_reruns.node_failure(self._run, last)}")
        return lines

    def cancel_command(self, job_dir: Path, job_id: str) -> str:
        return shlex.join(["scancel", job_id])

    def cancel(self, job_dir: Path) -> None:
        job_id = self._job_id(Path(job_dir))
        rc, out, err = self._run(["scancel", job_id])
        if rc != 0 and "already completing or completed" not in err:
            raise UserError(f"scancel {job_id} failed: {one_line(err or out)}")

    # -- status ------------------------------------------------------------------------------------

    def _squeue(self, job_id: str) -> ss.QueueEntry | None:
        listed = listing.queue_answer(self._run, self.shell.where, job_id, ss.squeue_argv)
        if listed is not None:  # a listing's one squeue for all its jobs
            return ss.parse_squeue(listed, job_id)
        rc, out, err = self._run(ss.squeue_argv(job_id))
        if rc != 0:
            if ss.squeue_says_unknown(err):
                return None
            raise UserError(f"squeue failed: {one_line(err or out)}")
        return ss.parse_squeue(out, job_id)

    def _sacct(self, job_id: str, since: str | None = None) -> list[ss.AcctRecord] | None:
        """sacct's records of the job's last run; None when sacct cannot answer."""
        runs = self._sacct_runs(job_id, since)
        return None if runs is None else (runs[-1] if runs else [])

    def _sacct_runs(
        self, job_id: str, since: str | None = None
    ) -> list[list[ss.AcctRecord]] | None:
        """sacct's records of each run of the job (several when Slurm requeued it), earliest
        first; None when sacct cannot answer (no accounting)."""
        listed = None
        if since is None or ss.is_clock(since):  # else (a hostile job.json) it asks alone
            listed = listing.acct_answer(self._run, self.shell.where, job_id, ss.sacct_argv)
        runs = None if listed is None else ss.runs_ended_since(listed, job_id, since)
        if runs is not None:  # a listing's one sacct for all its jobs
            return runs
        rc, out, err = self._run(ss.sacct_argv(job_id, since))
        if rc != 0:
            return None
        return ss.parse_sacct_runs(out, job_id)

    def _is_finished(self, job_id: str, since: str | None = None) -> bool:
        """Cheap check for `logs --follow`: squeue's word only (no waiting for sacct)."""
        q = self._squeue(job_id)
        if q is not None:
            return q.state.finished
        records = self._sacct(job_id, since)
        return not records or records[0].state.finished

    def _reruns(
        self, job_id: str, where: str, runs: list[list[ss.AcctRecord]] | None, restarts: int = 0
    ) -> str:
        """What Slurm's requeues did before the last run ("" when it never requeued)."""
        earlier = (runs or [])[:-1]
        kept = self.requeue_kept(job_id, where)
        return slurm_reruns.rerun_summary(self._run, job_id, earlier, restarts, kept)

    def requeue_kept(self, job_id: str, where: str) -> slurm_reruns.Kept:
        """Where the k-th rerun kept the run before it (``kept_place``), once its
        attempts/requeue-<id>-<k>/logs exists (the script makes it before moving anything)."""

        def kept(k: int) -> str | None:
            place = requeued_attempt(job_id, k)
            listed = "logs" in self.shell.listdir(f"{where}/{place}")
            return self.kept_place(place) if listed else None

        return kept

    def kept_place(self, place: str) -> str:
        """A folder of the job directory where the job wrote it, in words for a status line."""
        return place

    def _status(self, job_id: str, where: str, since: str | None = None) -> JobStatus:
        q = self._squeue(job_id)
        if q is not None and not q.state.finished and q.state is not JobState.UNKNOWN:
            reason = q.reason if q.state is JobState.PENDING else ""
            if q.restarts:  # a rerun: say what happened to the runs before (one more sacct)
                note = self._reruns(job_id, where, self._sacct_runs(job_id, since), q.restarts)
                reason = "; ".join(r for r in (reason, note) if r)
            return JobStatus(job_id, q.state, reason=reason, elapsed_s=q.elapsed_s)

        # Finished, or forgotten by squeue: sacct has the details (steps, exit codes) but lags
        # squeue by a few seconds, so when squeue already calls the job finished, wait for it.
        runs = self._sacct_runs(job_id, since)
        if q is not None:
            deadline = time.monotonic() + self.sacct_wait_s
            while runs is not None and time.monotonic() < deadline:
                if runs and runs[-1][0].step is None and runs[-1][0].state.finished:
                    break
                time.sleep(min(1.0, self.poll_s))
                runs = self._sacct_runs(job_id, since)
        records = None if runs is None else (runs[-1] if runs else [])
        note = self._reruns(job_id, where, runs, q.restarts if q is not None else 0)

        job = records[0] if records and records[0].step is None else None
        if job is not None and job.state.finished:
            return self._final_status(job_id, where, job.state, job, records or [], note)
        if q is not None:
            # No (timely) accounting: squeue's final state, with what the logs say.
            return self._final_status(job_id, where, q.state, None, [], note)
        if job is not None:
            # squeue forgot it, sacct has no end yet (a cluster whose accounting is behind)
            return JobStatus(job_id, job.state, reason=note, elapsed_s=job.elapsed_s)
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
        reruns: str = "",
    ) -> JobStatus:
        """The end of the job in full: its state corrected by what the steps, srun and the
        ranks' results say, the reason, and what Slurm's requeues did before (`reruns`)."""
        batch_log, cut = self._read_tail(f"{where}/{BATCH_LOG.format(job_id=job_id)}")
        srun = ss.ranks_part(batch_log, cut=cut)  # None: the ranks never started
        ranks = ss.parse_srun_errors(srun or "", self.expected_ranks)
        step = ss.failing_step(records, ranks_started=srun is not None)
        exit_code = job.exit_code if job is not None else None
        reason = ""

        if state is JobState.COMPLETED and (step is not None or ranks):
            # The script ended well but a step (a rank) did not: that is a failed job.
            state = JobState.FAILED
        if state is JobState.COMPLETED and self.expected_ranks:
            listing = joblogs.list_results(self.shell, where, self.expected_ranks)
            if listing.failed:  # a wrapper around the worker swallowed its exit
                state = JobState.FAILED
                reason = self._marked_failure(where, listing.failed)
            elif listing.missing:
                state = JobState.FAILED
                reason = joblogs.no_result_reason(listing.missing, self.expected_ranks)
        if job is not None and ss.is_node_failure(job):
            reason = slurm_reruns.node_failure(self._run, job)  # not the ranks it took down
        elif state is JobState.FAILED and not reason:
            reason = ss.script_failure(batch_log) or self._failure_reason(
                where, batch_log, ranks, step, exit_code
            )
            if step is not None and step.exit_code:
                exit_code = step.exit_code
        elif state is JobState.TIMEOUT:
            reason = "time limit reached"
        elif state is JobState.CANCELLED:
            reason = job.raw_state if job is not None else "cancelled"
        said = ss.ended_reason(job) if job is not None else ""
        if said and state is not JobState.COMPLETED and said not in reason:
            reason = f"{reason} [{said}]" if reason else said
        return JobStatus(
            job_id,
            state,
            reason="; ".join(r for r in (reason, reruns) if r),
            exit_code=exit_code,
            elapsed_s=job.elapsed_s if job is not None else None,
            ranks={r: what for r, what in sorted(ranks.items())},
        )

    def _blamed_task(self, where: str, ranks: dict[int, str]) -> tuple[int, str, str] | None:
        """(rank, srun's words, its error) of the task that caused the failure: srun's likeliest
        (ss.failed_tasks), unless its own error only says a peer left ("Connection reset by
        peer"), in which case the next of the first BLAME_READS whose error does not."""
        tasks = ss.failed_tasks(ranks)
        if not tasks:
            return None
        first = (*tasks[0], joblogs.rank_error(self.shell, where, tasks[0][0]))
        if not joblogs.is_peer_loss(first[2]):
            return first
        for rank, what in tasks[1:BLAME_READS]:
            err = joblogs.rank_error(self.shell, where, rank)
            if not joblogs.is_peer_loss(err):
                return rank, what, err
        return first

    def _marked_failure(self, where: str, failed: list[int]) -> str:
        """Why a job whose steps all exited 0 failed: the first of the first BLAME_READS
        ranks that recorded a failure whose error does not only say a peer left."""
        errors = [(r, joblogs.rank_error(self.shell, where, r)) for r in failed[:BLAME_READS]]
        rank, err = next(((r, e) for r, e in errors if not joblogs.is_peer_loss(e)), errors[0])
        return f"rank {rank} exited 0 (its result says FAILED)" + (f": {err}" if err else "")

    def _failure_reason(
        self,
        where: str,
        batch_log: str,
        ranks: dict[int, str],
        step: ss.AcctRecord | None,
        exit_code: int | None,
    ) -> str:
        """Why the job failed: the rank srun blames (``ranks``: its errors about the ranks'
        step), else the failed step, else the script's own last error."""
        blamed = self._blamed_task(where, ranks)
        if blamed is not None:
            rank, what, err = blamed
            words, node = what.rsplit(" (", 1) if " (" in what else (what, "")
            signum = joblogs.signal_named(words)  # srun says "Killed": which signal it was
            what = joblogs.killed_by(signum) if signum else words.lower()
            what += f" ({node}" if node else ""  # srun's "Out Of Memory (n2)"
            world = self.expected_ranks or 0  # 0: not known (a backend made without a job)

            def listing() -> joblogs.ResultListing:
                return joblogs.list_results(self.shell, where, world)

            quiet = joblogs.waited_for(err, rank, world, listing)
            return f"rank {rank} {what}" + (f": {err}" if err else "") + quiet
        if step is not None and step.step != "batch":
            sig = f", signal {step.signal}" if step.signal else ""
            return (
                f"step {step.step} ({step.name}) {step.raw_state.lower()} "
                f"with exit code {step.exit_code}{sig}"
            )
        err = joblogs.error_summary(batch_log)
        code = f"exit code {exit_code}" if exit_code is not None else "failed"
        return f"batch script {code}" + (f": {err}" if err else "")
