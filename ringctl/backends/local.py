"""The `local` backend: the job's ranks as processes on this machine, no Slurm.

`submit` starts a detached supervisor (`python -m ringctl.backends.local supervise JOB_DIR`, in a
session of its own) and returns at once. The supervisor (`Supervisor`) starts P = nodes x
tasks_per_node workers running `ringctl.worker` as on Slurm (forked from the supervisor once it
has imported what they import, else as `python -m ringctl.worker JOB_DIR`: `launch`) with
MASTER_ADDR=127.0.0.1, a free port, RANK / WORLD_SIZE / LOCAL_RANK, and no Slurm variables (so
they form one node named after this host). Each rank writes logs/rank-<R>.out and .err. The
supervisor records the state in JOB_DIR/state.json, so `ringctl status`, `logs` and `cancel`
work from any shell. Like `srun --kill-on-bad-exit=1`, the first rank to fail ends the others;
the job is then FAILED with that rank's error.

Processes never outlive their job: workers run in the supervisor's process group and get
SIGKILL from the kernel when the supervisor dies (PR_SET_PDEATHSIG), even by SIGKILL. A pid in
supervisor.pid or state.json is trusted only while the process it names still has the start
time and command line recorded with it (`ProcessRecord`), so a reused pid is never signalled.
"""

from __future__ import annotations

import json
import math
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..bounded_read import read_regular
from ..errors import NotSubmitted, UserError, path_error, with_filename
from ..jobdir import JobDir
from ..jsonsafe import whole_number
from ..lifetime import SUPERVISED
from ..text import cut, is_ascii_number
from ..threads import rank_threads, usable_cpus
from .base import Backend, JobState, JobStatus
from .joblogs import (
    error_summary,
    is_peer_loss,
    killed_by,
    list_results,
    no_result_reason,
    waited_for,
)
from .launch import EXEC, FORK, ForkedRank, exec_reason, start_rank, warm_up
from .shell import LocalShell

KILL_GRACE_S = 5.0
_CLEARED_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RINGCTL_RUN_ID",
    "GROUP_RANK",
    SUPERVISED,  # a rank's own (ringctl.lifetime), never a nested job's
)


def _package_root() -> str:
    return str(Path(__file__).resolve().parents[2])


def _child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "SLURMD_", "TORCHELASTIC_", "PMI_", "OMPI_"))
        and k not in _CLEARED_VARS
    }
    root = _package_root()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10000  # below: well-known and registered services' ports


def rendezvous_port() -> int:
    """A port for rank 0's rendezvous: a free one below the kernel's ephemeral range where
    there is room, else any free one. A port the kernel hands out (bind to 0) is free only
    until rank 0 binds it, and meanwhile any process's outgoing connection may take it (the
    gloo pairs of another job on the host: rank 0 then failed with EADDRINUSE in the suite);
    below the range only a process that names the port takes it."""
    low = ephemeral_low()
    if low is not None and low > LOWEST_PORT:
        for port in random.sample(range(LOWEST_PORT, low), min(64, low - LOWEST_PORT)):
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ephemeral_low() -> int | None:
    """The lowest port of the kernel's ephemeral range (Linux), or None where it is unknown."""
    try:
        first = EPHEMERAL_RANGE.read_text().split()[0]
    except (OSError, IndexError):
        return None
    return int(first) if is_ascii_number(first, 5) else None


def _bindable(port: int) -> bool:
    """Whether nothing listens on (or holds) ``port`` on the loopback now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# -- process identity ------------------------------------------------------------------------


def _rank_error(job: JobDir, rank: int) -> str:
    """Why a rank failed, as status tells it; its files' own fault said instead of ending
    the supervisor without a final state (status then blamed a killed supervisor)."""
    try:
        return LocalBackend().rank_error(job.path, rank)
    except UserError as err:
        return f"its logs cannot be read ({err})"


@dataclass(frozen=True)
class ProcessRecord:
    """A pid with what makes it this process: its start time (clock ticks since boot, from
    /proc/PID/stat) and a marker its command line must contain."""

    pid: int
    start: int | None
    marker: str

    @classmethod
    def of(cls, pid: int, marker: str) -> ProcessRecord:
        return cls(pid, _start_time(pid), marker)

    def alive(self) -> bool:
        """Still running (not a zombie), and still the same process."""
        stat = _proc_stat(self.pid)
        if stat is None or stat[0] == "Z":
            return False
        if self.start is not None and stat[1] != self.start:
            return False  # the pid was reused
        return _runs(_argv(self.pid), self.marker)

    def exists(self) -> bool:
        """Still the same process (its pid and start time; not a zombie), whatever its command
        line says: one between its fork and its exec still shows its parent's."""
        stat = _proc_stat(self.pid)
        return stat is not None and stat[0] != "Z" and stat[1] == self.start

    def signal(self, sig: int, *, group: bool = False) -> bool:
        if not self.alive():
            return False
        try:
            (os.killpg if group else os.kill)(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time) of a process, or None when there is none."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _start_time(pid: int) -> int | None:
    stat = _proc_stat(pid)
    return stat[1] if stat else None


def _argv(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return raw.decode(errors="replace").split("\0")


def _runs(argv: list[str], marker: str) -> bool:
    """Whether ``argv`` holds the marker's words as whole arguments, in a row: "supervise
    /runs/job-A" as a substring matched job A-2's supervisor too (cancel of A killed it)."""
    words = marker.split(" ", 1)  # a verb or module, then a path (which may hold spaces)
    return any(argv[i : i + len(words)] == words for i in range(len(argv)))


MAX_RECORD_BYTES = 1 << 20  # supervisor.pid, state.json: a few hundred bytes a rank


def _read_record(job: JobDir) -> ProcessRecord | None:
    """The supervisor's record. Its marker is this job's, never the file's (a file saying
    "marker": "" and "start": null named any process of the user, and cancel killed it);
    a start time must be an int (only a 0.1 bare pid has none). A file that is missing or
    damaged: the supervisor found by its command line (``_running_supervisor``)."""
    try:
        data = json.loads(read_regular(job.supervisor_file, MAX_RECORD_BYTES).decode())
    except (ValueError, RecursionError):  # missing, a link, a FIFO, not JSON: no record
        return _running_supervisor(job)
    if whole_number(data, 1):  # a 0.1 job directory: a bare pid, identity unknown
        return ProcessRecord(data, None, supervisor_marker(job))
    if (
        not isinstance(data, dict)
        or not whole_number(data.get("pid"), 1)
        or not whole_number(data.get("start"), 1)
    ):
        return _running_supervisor(job)
    return ProcessRecord(data["pid"], data["start"], supervisor_marker(job))


def _running_supervisor(job: JobDir) -> ProcessRecord | None:
    """The job's supervisor among this machine's processes, when supervisor.pid cannot say:
    this user's process whose command line runs this job's supervisor and which leads its
    own session (forked ranks carry the same command line, in its session). A damaged file
    read as "no supervisor": status said FAILED of a running job, and resume started a
    second ring beside it, whose state.json the first then overwrote."""
    marker, uid = supervisor_marker(job), os.getuid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:  # this user's (another's job in a shared folder is not ours to signal)
            leads = entry.stat().st_uid == uid and os.getsid(pid) == pid
        except OSError:  # gone meanwhile
            continue
        record = ProcessRecord.of(pid, marker)
        if leads and record.start is not None and record.alive():
            return record
    return None


# -- the backend -----------------------------------------------------------------------------


class LocalBackend(Backend):
    name = "local"
    poll_s = 0.2
    ranks_here = True
    sets_up_env = False
    places_ring = False

    def __init__(self, cfg=None) -> None:
        self.cfg = cfg

    @classmethod
    def create(cls, cfg) -> LocalBackend:
        return cls(cfg)

    def still_running(self, job: JobDir) -> str | None:
        return _still_running(job)

    def stop_leftovers(self, job: JobDir) -> None:
        """Workers of the last attempt that outlived its supervisor: stopped before resume
        moves its state.json (which names them) to attempts/N. Read after the move, it named
        none, and they ran beside the resumed ring."""
        stop_earlier_workers(job)

    def refuse_unstartable(self, cfg) -> None:
        """A job whose env.python names no executable (a path, or a command on PATH): its
        ranks could never start, and its supervisor would only record FAILED."""
        if cfg.env.python and shutil.which(rank_python(cfg)) is None:
            raise UserError(
                f"env.python: {cfg.env.python}: no such executable file (nor a command on "
                "PATH); the ranks could not start"
            )

    def submit(self, job_dir: Path) -> str:
        job = JobDir(Path(job_dir).resolve())
        from ..config import load_resolved

        try:  # nothing started: the config the supervisor runs refused, or no process made
            self.refuse_unstartable(load_resolved(job.config))
            job.logs.mkdir(parents=True, exist_ok=True)  # (an earlier attempt's: stop_leftovers)
            proc = self._start_supervisor(job)
        except UserError as err:
            raise NotSubmitted(str(err)) from None
        except OSError as err:  # a full disk at supervisor.log, no fork: a resume is put back
            said = path_error(err) or f"{err.strerror or err}"
            raise NotSubmitted(f"the job could not start: {said}") from None
        try:
            record = ProcessRecord.of(proc.pid, supervisor_marker(job))
            job.supervisor_file.write_text(json.dumps(asdict(record)) + "\n")
        except BaseException as err:
            # Unrecorded, nothing could cancel it (a full disk), and a Ctrl-C here makes
            # submit delete the directory it runs in: it must not run.
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if isinstance(err, OSError):
                raise with_filename(err, job.supervisor_file) from None
            raise
        return f"local-{proc.pid}"

    @staticmethod
    def _start_supervisor(job: JobDir) -> subprocess.Popen:
        """The job's supervisor (``supervise``), in a session of its own."""
        with open(job.supervisor_log, "ab") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "ringctl.backends.local", "supervise", str(job.path)],
                cwd=job.path,
                env=_child_env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # survives the terminal; cancel signals its group
                close_fds=True,
            )

    def status(self, job_dir: Path) -> JobStatus:
        job = JobDir(job_dir)
        record = _read_record(job)
        job_id = f"local-{record.pid}" if record else "local-?"
        # Alive is asked before the state is read: a supervisor that writes its last state and
        # exits between the two is then never taken for one that died without a word.
        alive = record is not None and record.alive()
        try:
            recorded = RecordedState.read(job)
        except UserError as err:  # the job can write its directory: say so, no traceback
            return JobStatus(job_id, JobState.UNKNOWN, str(err))
        if recorded is None:
            if alive or (record is not None and record.exists()):  # (not yet exec'd: starting)
                return JobStatus(job_id, JobState.PENDING, "starting")
            if record is not None:  # submitted, and its supervisor is gone: it never will
                return JobStatus(job_id, JobState.FAILED, died_unrecorded(job))
            return JobStatus(job_id, JobState.UNKNOWN, "no state recorded (not submitted?)")
        st, reason = recorded.state, recorded.reason
        started, ended = recorded.started_at, recorded.ended_at
        elapsed = (ended or time.time()) - started if started else None
        if not st.finished and not alive:
            st, reason = JobState.FAILED, "the local supervisor process is gone (killed?)"
        ranks = {rank: info.get("state", "?") for rank, info in recorded.ranks.items()}
        return JobStatus(job_id, st, reason, recorded.exit_code, elapsed, ranks)

    def is_finished(self, job_dir: Path) -> bool:
        """Ended, or UNKNOWN (a damaged state.json) with its supervisor gone: nothing will
        ever rewrite the file, and `logs -f` and `run` waited for an end for ever. (A `logs -f`
        started inside a resume, between the move to attempts/ and the new supervisor's
        record, ends at once: no supervisor yet.)"""
        status = self.status(job_dir)
        if status.state is not JobState.UNKNOWN:
            return status.state.finished
        record = _read_record(JobDir(job_dir))
        return record is None or not record.alive()

    def cancel(self, job_dir: Path) -> None:
        job = JobDir(job_dir)
        record = _read_record(job)
        if record is not None and record.signal(signal.SIGTERM):
            deadline = time.monotonic() + KILL_GRACE_S * 2
            while time.monotonic() < deadline and record.alive():
                time.sleep(0.1)
            record.signal(signal.SIGKILL, group=True)  # the supervisor leads its group
        stop_earlier_workers(job)
        try:
            recorded = RecordedState.read(job)
        except UserError:  # damaged: left as found (status names the key), processes ended
            return
        if recorded is None or not recorded.state.finished:
            state = job.read_state() or {}
            state.update(state="CANCELLED", reason="cancelled", ended_at=time.time())
            job.write_state(state)


def died_unrecorded(job: JobDir) -> str:
    """Why a submitted job whose supervisor is gone has no state.json: the supervisor's own
    last error line (a crash before it could record one), and where its log is. Without this
    the job stayed UNKNOWN, and `run` and `logs -f` waited for its end for ever."""
    try:
        raw = LocalShell().read_from(str(job.supervisor_log), limit=MAX_RECORD_BYTES, tail=True)
    except UserError:  # the log made a link or a FIFO: only named below
        raw = None
    said = error_summary((raw or b"").decode("utf-8", errors="replace"))
    return (
        "the local supervisor ended without recording a state"
        + (f": {said}" if said else "")
        + f" (see {job.supervisor_log})"
    )


SCRIPT_ONLY_ENV = ("venv", "conda", "modules", "container_image", "container_mounts")


def unset_up_env(cfg) -> str:
    """The warning for a local job naming an environment only a batch script sets up
    (``SCRIPT_ONLY_ENV``), or "": its ranks run without it (a venv and modules that did not
    exist ran COMPLETED, unsaid). A warning, not a refusal: a job file written for Slurm runs
    here as it is."""
    given = [f"env.{k}" for k in SCRIPT_ONLY_ENV if cfg.env.get(k)]
    if not given:
        return ""
    return (
        f"{', '.join(given)}: not set up by the local backend (a batch script's, with "
        f"backend=slurm or ssh): the ranks run {rank_python(cfg)} in this environment"
    )


def rank_python(cfg) -> str:
    """The interpreter the ranks start as (env.python, else this one): one rule for the
    supervisor's launch and submit's check."""
    return os.path.expanduser(str(cfg.env.python or sys.executable))


@dataclass(frozen=True)
class RecordedState:
    """state.json as the supervisor writes it, every value checked on reading: the job can
    write its directory, and a value of another type (a state no JobState names, ranks as a
    list, a start time as text) made status, cancel and resume tracebacks. A damaged value is
    a UserError naming the file and the key."""

    state: JobState
    reason: str = ""
    started_at: float | None = None
    ended_at: float | None = None
    exit_code: int | None = None
    ranks: dict[int, dict] = field(default_factory=dict)

    @classmethod
    def read(cls, job: JobDir) -> RecordedState | None:
        """The job's state.json, checked; None before the supervisor wrote one (or while a
        damaged one waits to be rewritten: `JobDir.read_state`)."""
        data = job.read_state()
        return None if data is None else cls.parse(data, job.state_file)

    @classmethod
    def parse(cls, data: dict, path: Path) -> RecordedState:
        def damaged(key: str, expected: str) -> UserError:
            got = cut(repr(data.get(key)), 60)
            return UserError(f"{path}: {key}: expected {expected}, got {got}")

        state = data.get("state", "UNKNOWN")
        if state not in {s.value for s in JobState}:
            raise damaged("state", "one of " + ", ".join(s.value for s in JobState))
        if not isinstance(data.get("reason", ""), str):
            raise damaged("reason", "text")
        for key in ("started_at", "ended_at"):
            value = data.get(key)
            if value is not None and not _finite_time(value):
                raise damaged(key, "seconds since the epoch")
        code = data.get("exit_code")
        if code is not None and not whole_number(code, -(2**31), 2**31):
            raise damaged("exit_code", "a whole number")
        ranks = data.get("ranks", {})
        if not isinstance(ranks, dict) or not all(
            is_ascii_number(str(r), 9) and isinstance(info, dict) for r, info in ranks.items()
        ):
            raise damaged("ranks", "an object of rank numbers to records")
        return cls(
            JobState(state),
            data.get("reason", ""),
            data.get("started_at"),
            data.get("ended_at"),
            code,
            {int(r): info for r, info in ranks.items()},
        )


def _finite_time(value) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and value >= 0


def _identified(record) -> bool:
    """A process record (supervisor.pid's, or a rank's in state.json) that names a pid and
    its start time as whole numbers."""
    return isinstance(record, dict) and all(
        whole_number(record.get(key), 1) for key in ("pid", "start")
    )


def _still_running(job: JobDir) -> str | None:
    """The job's supervisor, verified (pid, start time, command line), when it still runs:
    state.json (which the job can write) saying UNKNOWN or COMPLETED let a resume start a
    second supervisor beside it. Workers that outlived theirs are stopped by the resume."""
    record = _read_record(job)
    deadline = time.monotonic() + SUPERVISOR_EXIT_S  # it writes its final state, then exits
    while record is not None and record.alive():
        if time.monotonic() > deadline:
            return f"its supervisor (pid {record.pid}) is still running"
        time.sleep(0.05)
    return None


SUPERVISOR_EXIT_S = 5.0


def supervisor_marker(job: JobDir) -> str:
    """What the supervisor's command line contains (and a forked rank's: it is its copy)."""
    return f"supervise {job.path.resolve()}"


def worker_marker(job: JobDir, launch: str) -> str:
    """What a rank's command line contains: a new interpreter's names the worker module, a
    forked rank's is the supervisor's (its pid and start time tell it from the supervisor)."""
    if launch == FORK:
        return supervisor_marker(job)
    return f"ringctl.worker {job.path.resolve()}"


def live_workers(job: JobDir) -> list[ProcessRecord]:
    """Workers recorded in state.json that still run (same pid, start time and job)."""
    state = job.read_state() or {}
    ranks = state.get("ranks")
    found = []
    for info in ranks.values() if isinstance(ranks, dict) else ():
        if (
            isinstance(info, dict)
            and whole_number(info.get("pid"), 1)
            and whole_number(info.get("start"), 1)
        ):
            marker = worker_marker(job, info.get("launch", EXEC))
            record = ProcessRecord(info["pid"], info["start"], marker)
            if record.alive():
                found.append(record)
    return found


def stop_earlier_workers(job: JobDir) -> int:
    """Kill workers of an earlier attempt that outlived their supervisor (a 0.1 job directory,
    or a platform without PR_SET_PDEATHSIG), so no two rings share out/."""
    workers = live_workers(job)
    for record in workers:
        record.signal(signal.SIGKILL)
    deadline = time.monotonic() + KILL_GRACE_S
    while time.monotonic() < deadline and any(r.alive() for r in workers):
        time.sleep(0.05)
    return len(workers)


# -- the supervisor --------------------------------------------------------------------------


class Supervisor:
    """Starts the ranks, watches them, ends them all when one fails or a cancel arrives, and
    records every change in state.json."""

    def __init__(self, job: JobDir) -> None:
        from ..config import load_resolved, world_size

        self.job = job
        self.cfg = load_resolved(job.config)
        self.world = world_size(self.cfg)
        self.procs: dict[int, subprocess.Popen | ForkedRank] = {}
        self.codes: dict[int, int] = {}
        self.killed: set[int] = set()
        self.failed: list[int] = []
        self.exited_at: dict[int, float] = {}
        self.cancelled = False
        self.kill_at: float | None = None
        self.state: dict = {
            "state": "RUNNING",
            "backend": "local",
            "supervisor_pid": os.getpid(),
            "world_size": self.world,
            "started_at": time.time(),
            "ranks": {},
        }

    def on_term(self, signum, frame) -> None:
        self.cancelled = True

    def pass_on(self, signum, frame) -> None:
        """The job's warning signal, to every rank still running: each finishes its unit,
        saves and stops. Sent to the job's group, a rank hears it twice: one request."""
        for proc in list(self.procs.values()):
            proc.send_signal(signum)

    def start(self) -> None:
        self.job.logs.mkdir(parents=True, exist_ok=True)
        self.job.out.mkdir(exist_ok=True)
        port = rendezvous_port()
        self.state["master_port"] = port
        run = f"local-{os.getpid()}-{secrets.token_hex(4)}"  # (worker.RUN_ID: the store's keys)
        given = self.cfg.env.vars.get("OMP_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS")
        threads = rank_threads(  # every rank on this host
            given,
            cpus_per_task=None,
            node_cpus=usable_cpus(),  # the CPUs the ranks may run on
            ranks_on_node=self.world,
        )
        launch = self._choose_launch(threads)
        for rank in range(self.world):
            extra = {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RINGCTL_RUN_ID": run,
                "RANK": str(rank),
                "WORLD_SIZE": str(self.world),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(self.world),
                SUPERVISED: str(os.getpid()),
                **{str(k): str(v) for k, v in self.cfg.env.vars.items()},
                "OMP_NUM_THREADS": threads,
            }
            self.procs[rank] = self._spawn(rank, extra, launch)
            pid = self.procs[rank].pid
            self.state["ranks"][str(rank)] = {
                "pid": pid,
                "start": _start_time(pid),
                "state": "RUNNING",
                "launch": launch,
            }
        self.job.write_state(self.state)
        print(
            f"supervisor {os.getpid()}: started {self.world} ranks ({launch}) on port {port}",
            flush=True,
        )

    def _choose_launch(self, threads: str) -> str:
        """How the ranks start: forked from this process once it has imported what their task
        imports (FORK), or each as a new interpreter (EXEC); the log says which and why."""
        from ..tasks import get_task

        task = get_task(self.cfg.task.name)
        reason = exec_reason(self.cfg, threads, task.start_env)
        if reason is None:
            reason = warm_up(task.start_imports, {**task.start_env, "OMP_NUM_THREADS": threads})
        if reason is not None:
            print(f"supervisor: ranks start as new interpreters: {reason}", flush=True)
            return EXEC
        print("supervisor: ranks forked after importing what their task imports", flush=True)
        return FORK

    def _spawn(
        self, rank: int, extra: dict[str, str], launch: str
    ) -> subprocess.Popen | ForkedRank:
        logs = (self.job.rank_log(rank, "out"), self.job.rank_log(rank, "err"))
        return start_rank(
            launch, str(self.job.path), _child_env(extra), logs, rank_python(self.cfg)
        )

    def watch(self) -> None:
        """Until every rank has exited: record exits, end the rest after a failure/cancel."""
        while len(self.codes) < self.world:
            for rank, proc in self.procs.items():
                code = None if rank in self.codes else proc.poll()
                if code is not None:
                    self._record_exit(rank, code)
            if (self.failed or self.cancelled) and self.kill_at is None:
                self.kill_at = time.monotonic() + KILL_GRACE_S
                for rank, proc in self.procs.items():
                    if rank not in self.codes:
                        self.killed.add(rank)
                        proc.terminate()
            if self.kill_at is not None and time.monotonic() > self.kill_at:
                for rank, proc in self.procs.items():
                    if rank not in self.codes:
                        proc.kill()
            time.sleep(0.05)

    def _record_exit(self, rank: int, code: int) -> None:
        self.codes[rank] = code
        self.exited_at[rank] = time.time()
        info = self.state["ranks"][str(rank)]
        info["exit_code"] = code
        stopped = self.cancelled and code in (-signal.SIGTERM, -signal.SIGINT)
        if rank in self.killed or stopped:  # stopped: the cancel's signal reached it first
            info["state"] = "CANCELLED" if self.cancelled else "KILLED"
        elif code == 0 and self._result(rank).get("state") == "FAILED":
            # an env.python wrapper that swallowed the worker's exit 1: the job ended
            # COMPLETED, `run` exit 0, and the peers waited out the collective timeout
            info["state"] = "FAILED"
            self.failed.append(rank)
        else:
            info["state"] = "COMPLETED" if code == 0 else "FAILED"
            if code != 0:
                self.failed.append(rank)
        self.job.write_state(self.state)

    def _result(self, rank: int) -> dict:
        """The rank's result.json ({} when there is none or it cannot be read: a regular file
        only, bounded; a FIFO there blocked the supervisor, the job RUNNING for ever)."""
        try:
            rec = json.loads(read_regular(self.job.rank_result(rank), MAX_RECORD_BYTES))
        except (OSError, ValueError, RecursionError):
            return {}
        return rec if isinstance(rec, dict) else {}

    def finish(self) -> None:
        self.state["ended_at"] = time.time()
        if self.cancelled and not self.failed:
            self.state.update(state="CANCELLED", reason="cancelled", exit_code=None)
        elif self.failed:
            first = self._first_failure()
            code = self.codes[first]
            how = killed_by(-code) if code < 0 else f"exited {code}"
            how += " (its result says FAILED)" if code == 0 else ""
            error = _rank_error(self.job, first)
            reason = f"rank {first} {how}" + (f": {error}" if error else "")
            reason += waited_for(
                error,
                first,
                self.world,
                lambda: list_results(LocalShell(), str(self.job.path), self.world),
            )
            self.state.update(state="FAILED", exit_code=code, reason=reason)
        elif missing := list_results(LocalShell(), str(self.job.path), self.world).missing:
            reason = no_result_reason(missing, self.world)
            self.state.update(state="FAILED", exit_code=0, reason=reason)
        else:
            self.state.update(state="COMPLETED", exit_code=0, reason="")
        self.job.write_state(self.state)
        summary = f"{self.state['state']} {self.state['reason']}".rstrip()
        print(f"supervisor {os.getpid()}: {summary}", flush=True)

    def _first_failure(self) -> int:
        """The rank whose failure caused the rest (see first_failure)."""
        failures = []
        for order, rank in enumerate(self.failed):
            rec = self._result(rank)
            try:
                when = float(rec["failed_at"])
            except (KeyError, TypeError, ValueError):
                when = self.exited_at.get(rank, float("inf"))  # died without a word
            # What the rank said, as the reason reads it: its result, else its stderr (a rank
            # that aborted may have written only that).
            error = _rank_error(self.job, rank)
            failures.append(RankFailure(rank, when, error, order))
        return first_failure(failures)


@dataclass(frozen=True)
class RankFailure:
    rank: int
    at: float  # when it recorded its failure, or when the supervisor saw it die
    error: str  # its one-line error; "" when it died without writing one (a signal, _exit)
    order: int  # the order the supervisor saw the exits


def first_failure(failures: list[RankFailure]) -> int:
    """The rank that failed first caused the rest. A rank that says a peer left is an effect,
    so it counts only when every failure says so; among the rest the earliest wins. A rank killed
    by a signal writes nothing: its time is when the supervisor saw it die, which can be after
    the peer it took down wrote "Connection reset by peer" - hence the first rule, not the clock."""
    best = min(failures, key=lambda f: (is_peer_loss(f.error), f.at, f.order))
    return best.rank


def supervise(job_dir: Path) -> int:
    job = JobDir(Path(job_dir).resolve())
    supervisor = None
    try:
        supervisor = Supervisor(job)
        signal.signal(signal.SIGTERM, supervisor.on_term)
        signal.signal(signal.SIGINT, supervisor.on_term)
        # The job's warning signal (slurm.signal, SIGUSR1 by default) is the ranks' to handle
        # (stop on request, work saved); sent to the job's group it killed the supervisor,
        # and with it every rank before it could save. Sent to the supervisor alone (a user's
        # `kill -USR1`), it is passed on: ignored, no rank heard it.
        from ..worker import warning_signal

        warning = warning_signal(supervisor.cfg)
        if warning not in (signal.SIGTERM, signal.SIGINT):  # those two are cancel's
            signal.signal(warning, supervisor.pass_on)
        supervisor.start()
    except BaseException as err:
        record_start_failure(job, supervisor, err)
        raise
    supervisor.watch()
    supervisor.finish()
    return 0


def record_start_failure(job: JobDir, supervisor: Supervisor | None, err: BaseException) -> None:
    """The job FAILED with err as its reason when its ranks could not all start (env.python
    gone, the config unreadable, a full disk): before, the supervisor died without a state,
    the job stayed UNKNOWN and `run` waited for ever. Ranks already started are killed (they
    would die with the supervisor anyway, PR_SET_PDEATHSIG); a job cancelled meanwhile keeps
    its CANCELLED."""
    for proc in supervisor.procs.values() if supervisor else ():
        proc.kill()
    recorded = job.read_state() or {}
    if recorded.get("state") in {s.value for s in JobState if s.finished}:
        return
    state = dict(supervisor.state) if supervisor else {"backend": "local"}
    state.pop("ranks", None)  # killed above: none runs, and none must be stopped by a resume
    reason = f"the ranks could not start: {describe_error(err)}"
    state.update(state="FAILED", reason=reason, exit_code=None, ended_at=time.time())
    state.setdefault("started_at", state["ended_at"])
    try:
        job.write_state(state)
    except OSError as write_err:  # status then names the supervisor's log: say it there too
        print(f"supervisor: state.json not written: {write_err}", file=sys.stderr)


def describe_error(err: BaseException) -> str:
    """One line for an exception: a UserError's own words, an OSError as `PATH: strerror`,
    anything else as `Type: message`."""
    if isinstance(err, UserError):
        return str(err)
    return path_error(err) or f"{type(err).__name__}: {err}".rstrip(": ")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] != "supervise":
        print("usage: python -m ringctl.backends.local supervise JOB_DIR", file=sys.stderr)
        return 2
    try:
        return supervise(Path(argv[1]))
    except UserError as err:
        print(f"supervisor: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
