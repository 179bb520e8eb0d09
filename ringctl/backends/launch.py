"""How the local supervisor starts a rank: a fork of itself, or a new interpreter.

A rank started as `python -m ringctl.worker JOB_DIR` imports torch, and for the model tasks
transformers, anew: 2-6 s of CPU per rank and per attempt, which on a laptop is most of a short
job. The supervisor instead imports them once (`warm_up`, the modules its task names) and forks
each rank from itself; the rank then takes its own environment and thread count and runs the
same `ringctl.worker.main` a new interpreter would.

A fork inherits what the interpreter and its libraries decided at start-up, so it is used only
when nothing the job asks for acts there (`exec_reason`): no GPU on the machine (CUDA cannot
start in a fork), `env.python` unset, and every `env.vars` entry one that is read after
start-up (OMP_NUM_THREADS, which the rank applies with torch.set_num_threads; the
communication libraries' NCCL_*, GLOO_*, TORCH_NCCL_* and ringattn's RINGATTN_*, read when
used; HF_HUB_OFFLINE=1, which `warm_up` sets too). Anything else (LD_PRELOAD, GLIBC_TUNABLES,
MALLOC_*, PYTHON*, ...) starts every rank as a new interpreter, as before, and the supervisor's
log says why; so does RINGCTL_LOCAL_LAUNCH=exec in the environment `ringctl submit` runs in.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import sys
import traceback

# Variables a fork can honour: read after start-up, or applied by the rank itself (threads).
AFTER_START_VARS = frozenset({"OMP_NUM_THREADS"})
AFTER_START_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "RINGATTN_")
# Set by `warm_up` before its imports, as every rank sets it before importing transformers: a
# job's variable with this same value changes nothing a fork inherits.
WARM_UP_ENV = {"HF_HUB_OFFLINE": "1"}


def exec_reason(cfg, threads: str) -> str | None:
    """Why this job's ranks must start as new interpreters, or None when they can be forked.
    `threads`: the ranks' OMP_NUM_THREADS, which a fork applies as a plain count only."""
    chosen = os.environ.get("RINGCTL_LOCAL_LAUNCH", "fork") or "fork"
    if chosen != "fork":
        return f"RINGCTL_LOCAL_LAUNCH={chosen}" + ("" if chosen == "exec" else " (fork or exec)")
    if gpu := gpu_device_node():
        return f"a GPU is here ({gpu}): CUDA cannot start in a fork of a process that asked for it"
    if not threads.isdigit() or int(threads) < 1:
        return f"OMP_NUM_THREADS={threads!r} is not a plain thread count"
    if cfg.env.python:
        return f"env.python names an interpreter ({cfg.env.python})"
    for name, value in cfg.env.vars.items():
        name = str(name)
        if name in AFTER_START_VARS or name.startswith(AFTER_START_PREFIXES):
            continue
        if WARM_UP_ENV.get(name) == str(value):
            continue
        return f"env.vars.{name} may act at start-up"
    return None


# Device nodes of the GPU drivers torch can use (NVIDIA, AMD's ROCm, WSL's): where one exists a
# rank may use CUDA, which refuses to start in a fork once its parent asked about devices (the
# imports in `warm_up` may: torch.cuda.is_available()), so such ranks start as new interpreters.
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def gpu_device_node() -> str | None:
    """The first GPU driver device node on this machine, or None."""
    return next((path for path in GPU_DEVICE_NODES if os.path.exists(path)), None)


def warm_up(modules: tuple[str, ...]) -> list[str]:
    """Import what the ranks will import, once, here (those that fail are left to the ranks,
    which report them). HF_HUB_OFFLINE is set first, as every rank sets it before importing
    transformers: ranks read models from local paths only; the environment is then put back,
    so a rank's is what a new interpreter's would be."""
    saved = dict(os.environ)
    os.environ.update(WARM_UP_ENV)
    loaded = []
    try:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the rank imports it again and says what failed
                continue
            loaded.append(name)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return loaded


class ForkedRank:
    """A rank forked by `fork_rank`, with the part of subprocess.Popen's interface the
    supervisor uses (pid, poll, terminate, kill); returncode is -N for a signal N, as Popen's."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def terminate(self) -> None:
        self._send(signal.SIGTERM)

    def kill(self) -> None:
        self._send(signal.SIGKILL)

    def _send(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


def die_with_parent() -> None:
    """In a rank: SIGKILL when the supervisor dies (PR_SET_PDEATHSIG), even by SIGKILL."""
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the process group still lets cancel reach every worker


def fork_rank(job_path: str, env: dict[str, str], out_path, err_path) -> ForkedRank:
    """Fork a rank that runs `ringctl.worker.main([job_path])` in `job_path` with exactly `env`
    as its environment, stdout and stderr appended to the two logs, stdin from /dev/null."""
    fds = [
        os.open(os.devnull, os.O_RDONLY),
        os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666),
        os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666),
    ]
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            _become_rank(job_path, env, fds, parent)
        finally:
            os._exit(1)  # _become_rank never returns; this is only for its own failure
    for fd in fds:
        os.close(fd)
    return ForkedRank(pid)


def _become_rank(job_path: str, env: dict[str, str], fds: list[int], parent: int) -> None:
    """In the forked child: what exec would have reset, then the worker (which ends the
    process itself, os._exit, after writing its result)."""
    for fd_from, fd_to in zip(fds, (0, 1, 2), strict=True):
        os.dup2(fd_from, fd_to)
        os.close(fd_from)
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)  # the supervisor's handlers are not the rank's
        die_with_parent()
        if os.getppid() != parent:
            return  # the supervisor died before the line above took effect
        os.chdir(job_path)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = [sys.argv[0], job_path]
        _as_a_new_interpreter(int(env["OMP_NUM_THREADS"]))  # a count: checked by exec_reason
        from ..worker import main

        main([job_path])
    except BaseException:  # noqa: BLE001 - the rank's stderr is its log
        traceback.print_exc()
        sys.stderr.flush()


def _as_a_new_interpreter(threads: int) -> None:
    """What a new interpreter would have that a fork shares with its parent and siblings: its
    own thread count, and its own random seeds (torch's and numpy's global generators are
    seeded from the OS at start-up; Python's `random` reseeds itself after a fork)."""
    import torch

    torch.set_num_threads(threads)
    torch.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
