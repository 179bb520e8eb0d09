"""The `local` backend: the job's ranks as processes on this machine, no Slurm.

`submit` starts a detached supervisor (`python -m ringctl.backends.local supervise JOB_DIR`, in a
session of its own) and returns at once. The supervisor starts P = nodes x tasks_per_node
workers (`python -m ringctl.worker JOB_DIR`, as on Slurm) with MASTER_ADDR=127.0.0.1, a free
port, RANK / WORLD_SIZE / LOCAL_RANK, and no Slurm variables (so they form one node named after
this host). Each rank writes logs/rank-<R>.out and .err. The supervisor records the state in
JOB_DIR/state.json, so `ringctl status`, `logs` and `cancel` work from any shell. Like
`srun --kill-on-bad-exit=1`, the first rank to fail ends the others; the job is then FAILED with
that rank's error.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from .base import JobState, JobStatus

STATE_FILE = "state.json"
SUPERVISOR_PID = "supervisor.pid"
KILL_GRACE_S = 5.0
ERROR_PREFIX = "ringctl.worker: "  # the worker's last stderr line on failure


def create(cfg) -> LocalBackend:
    return LocalBackend(cfg)


def _package_root() -> str:
    return str(Path(__file__).resolve().parents[2])


def _child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "SLURMD_", "TORCHELASTIC_", "PMI_", "OMPI_"))
        and k
        not in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "GROUP_RANK",
        )
    }
    root = _package_root()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _write_state(job_dir: Path, state: dict) -> None:
    tmp = job_dir / f".{STATE_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    os.replace(tmp, job_dir / STATE_FILE)


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not alive
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_error(job_dir: Path, rank: int) -> str:
    """The error a failed rank reported: its result file, else its last stderr lines."""
    result = _read_json(job_dir / "logs" / f"rank-{rank}.result.json") or {}
    if result.get("error"):
        return str(result["error"])
    err = job_dir / "logs" / f"rank-{rank}.err"
    try:
        lines = [s.strip() for s in err.read_text(errors="replace").splitlines() if s.strip()]
    except OSError:
        return ""
    for line in reversed(lines):
        if line.startswith(ERROR_PREFIX):
            return line[len(ERROR_PREFIX) :]
    return lines[-1] if lines else ""


class LocalBackend:
    name = "local"

    def __init__(self, cfg=None) -> None:
        self.cfg = cfg

    # -- submit ----------------------------------------------------------------------------
    def submit(self, job_dir: Path) -> str:
        job_dir = Path(job_dir).resolve()
        (job_dir / "logs").mkdir(parents=True, exist_ok=True)
        log = open(job_dir / "logs" / "supervisor.log", "ab")  # noqa: SIM115
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "ringctl.backends.local", "supervise", str(job_dir)],
                cwd=job_dir,
                env=_child_env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # survives the terminal; cancel kills its group
                close_fds=True,
            )
        finally:
            log.close()
        (job_dir / SUPERVISOR_PID).write_text(f"{proc.pid}\n")
        return f"local-{proc.pid}"

    # -- status ----------------------------------------------------------------------------
    def _supervisor_pid(self, job_dir: Path) -> int | None:
        try:
            return int((job_dir / SUPERVISOR_PID).read_text().strip())
        except (OSError, ValueError):
            return None

    def status(self, job_dir: Path) -> JobStatus:
        job_dir = Path(job_dir)
        pid = self._supervisor_pid(job_dir)
        job_id = f"local-{pid}" if pid else "local-?"
        state = _read_json(job_dir / STATE_FILE)
        if state is None:
            if pid and _alive(pid):
                return JobStatus(job_id, JobState.PENDING, "starting")
            return JobStatus(job_id, JobState.UNKNOWN, "no state recorded (not submitted?)")
        st = JobState(state.get("state", "UNKNOWN"))
        reason = state.get("reason", "")
        started, ended = state.get("started_at"), state.get("ended_at")
        elapsed = None
        if started:
            elapsed = (ended or time.time()) - started
        if not st.finished and not _alive(pid):
            st, reason = JobState.FAILED, "the local supervisor process is gone (killed?)"
        ranks = {int(r): info.get("state", "?") for r, info in state.get("ranks", {}).items()}
        return JobStatus(job_id, st, reason, state.get("exit_code"), elapsed, ranks)

    # -- logs ------------------------------------------------------------------------------
    def logs(
        self, job_dir: Path, *, rank: int | None = None, follow: bool = False
    ) -> Iterator[str]:
        job_dir = Path(job_dir)
        logs = job_dir / "logs"

        def files() -> list[tuple[str, Path]]:
            if rank is not None:
                return [(f"rank {rank}", logs / f"rank-{rank}.{ext}") for ext in ("out", "err")]
            found = []
            for path in sorted(logs.glob("rank-*.out")) + sorted(logs.glob("rank-*.err")):
                try:
                    r = int(path.stem.split("-", 1)[1])
                except ValueError:
                    continue
                found.append((f"rank {r}", path))
            found.sort(key=lambda item: (int(item[0].split()[1]), item[1].suffix != ".out"))
            return found

        prefix = rank is None
        if not follow:
            for label, path in files():
                if path.exists():
                    for line in path.read_text(errors="replace").splitlines():
                        yield f"[{label}] {line}" if prefix else line
            return
        offsets: dict[Path, int] = {}
        partial: dict[Path, tuple[str, str]] = {}  # path -> (label, a line not yet ended)

        def fmt(label: str, line: str) -> str:
            return f"[{label}] {line}" if prefix else line

        while True:
            finished = self.status(job_dir).state.finished
            for label, path in files():
                try:
                    with open(path, "rb") as fh:
                        fh.seek(offsets.get(path, 0))
                        chunk = fh.read()
                        offsets[path] = fh.tell()
                except OSError:
                    continue
                text = partial.pop(path, (label, ""))[1] + chunk.decode(errors="replace")
                *lines, rest = text.split("\n")
                if rest:
                    partial[path] = (label, rest)
                for line in lines:
                    yield fmt(label, line)
            if finished:
                for label, rest in partial.values():
                    yield fmt(label, rest)
                return
            time.sleep(0.2)

    # -- cancel ----------------------------------------------------------------------------
    def cancel(self, job_dir: Path) -> None:
        job_dir = Path(job_dir)
        if self.status(job_dir).state.finished:
            return
        pid = self._supervisor_pid(job_dir)
        if pid and _alive(pid):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + KILL_GRACE_S * 2
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.1)
            if _alive(pid):
                try:
                    os.killpg(pid, signal.SIGKILL)  # the supervisor leads its process group
                except ProcessLookupError:
                    pass
        state = _read_json(job_dir / STATE_FILE) or {}
        if not JobState(state.get("state", "UNKNOWN")).finished:
            state.update(state="CANCELLED", reason="cancelled", ended_at=time.time())
            _write_state(job_dir, state)


# -- the supervisor ----------------------------------------------------------------------------


def supervise(job_dir: Path) -> int:
    from ..config import load_resolved, world_size

    job_dir = Path(job_dir).resolve()
    cfg = load_resolved(job_dir / "config.yaml")
    world = world_size(cfg)
    logs = job_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (job_dir / "out").mkdir(exist_ok=True)
    python = cfg.env.python or sys.executable
    port = _free_port()
    threads = str(max(1, (os.cpu_count() or 1) // world))
    cancelled = [False]

    def on_term(signum, frame):
        cancelled[0] = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    state: dict = {
        "state": "RUNNING",
        "backend": "local",
        "supervisor_pid": os.getpid(),
        "world_size": world,
        "master_port": port,
        "started_at": time.time(),
        "ranks": {},
    }
    procs: dict[int, subprocess.Popen] = {}
    for rank in range(world):
        extra = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
            **{str(k): str(v) for k, v in cfg.env.vars.items()},
        }
        extra.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", threads))
        with (
            open(logs / f"rank-{rank}.out", "ab") as out,
            open(logs / f"rank-{rank}.err", "ab") as err,
        ):
            procs[rank] = subprocess.Popen(
                [python, "-m", "ringctl.worker", str(job_dir)],
                cwd=job_dir,
                env=_child_env(extra),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
            )
        state["ranks"][str(rank)] = {"pid": procs[rank].pid, "state": "RUNNING"}
    _write_state(job_dir, state)
    print(f"supervisor {os.getpid()}: started {world} ranks on port {port}", flush=True)

    codes: dict[int, int] = {}
    killed: set[int] = set()
    failed_first: list[int] = []
    kill_at: float | None = None
    while len(codes) < world:
        for rank, proc in procs.items():
            if rank in codes:
                continue
            code = proc.poll()
            if code is None:
                continue
            codes[rank] = code
            info = state["ranks"][str(rank)]
            info["exit_code"] = code
            if rank in killed:
                info["state"] = "CANCELLED" if cancelled[0] else "KILLED"
            else:
                info["state"] = "COMPLETED" if code == 0 else "FAILED"
                if code != 0:
                    failed_first.append(rank)
            _write_state(job_dir, state)
        if (failed_first or cancelled[0]) and kill_at is None:
            kill_at = time.monotonic() + KILL_GRACE_S
            for rank, proc in procs.items():
                if rank not in codes:
                    killed.add(rank)
                    proc.terminate()
        if kill_at is not None and time.monotonic() > kill_at:
            for rank, proc in procs.items():
                if rank not in codes:
                    proc.kill()
        time.sleep(0.05)

    state["ended_at"] = time.time()
    if cancelled[0] and not failed_first:
        state.update(state="CANCELLED", reason="cancelled", exit_code=None)
    elif failed_first:
        # The rank that failed first caused the rest: order by the time each rank recorded.
        def failed_at(rank: int) -> float:
            rec = _read_json(logs / f"rank-{rank}.result.json") or {}
            return float(rec.get("failed_at", float("inf")))

        first = min(failed_first, key=lambda r: (failed_at(r), failed_first.index(r)))
        code = codes[first]
        how = f"killed by signal {-code}" if code < 0 else f"exited {code}"
        error = rank_error(job_dir, first)
        state.update(
            state="FAILED",
            exit_code=code,
            reason=f"rank {first} {how}" + (f": {error}" if error else ""),
        )
    else:
        state.update(state="COMPLETED", exit_code=0, reason="")
    _write_state(job_dir, state)
    print(f"supervisor {os.getpid()}: {state['state']} {state['reason']}".rstrip(), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] != "supervise":
        print("usage: python -m ringctl.backends.local supervise JOB_DIR", file=sys.stderr)
        return 2
    return supervise(Path(argv[1]))


if __name__ == "__main__":
    sys.exit(main())
