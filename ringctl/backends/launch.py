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
used; what the task's ranks set themselves before importing, `Task.start_env`, which
`warm_up` sets too: HF_HUB_OFFLINE=1). Anything else (LD_PRELOAD, GLIBC_TUNABLES,
MALLOC_*, PYTHON*, ...) starts every rank as a new interpreter, as before, and the supervisor's
log says why; so does RINGCTL_LOCAL_LAUNCH=exec in the environment `ringctl submit` runs in,
and so does any platform but Linux (macOS's system libraries are not safe to fork once used).

What a fork still shares with its siblings: Python's string-hash seed (PYTHONHASHSEED is read at
start-up), so set and dict-of-str iteration orders agree across forked ranks where new
interpreters' may not; nothing in ringctl depends on either.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import subprocess
import sys
import traceback

from ..lifetime import die_with_parent, prctl
from ..threads import plain_count

FORK = "fork"  # the rank is a fork of the supervisor
EXEC = "exec"  # the rank is a new interpreter: python -m ringctl.worker JOB_DIR

# Variables a fork can honour: read after start-up, or applied by the rank itself (threads).
AFTER_START_VARS = frozenset({"OMP_NUM_THREADS"})
AFTER_START_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "RINGATTN_")
# Device nodes of the GPU drivers torch can use (NVIDIA, AMD's ROCm, WSL's): where one exists a
# rank may use CUDA, which refuses to start in a fork once its parent asked about devices (the
# imports in `warm_up` may: torch.cuda.is_available()), so such ranks start as new interpreters.
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def exec_reason(cfg, threads: str, start_env: dict[str, str]) -> str | None:
    """Why this job's ranks must start as new interpreters, or None when they can be forked.
    `threads`: the ranks' OMP_NUM_THREADS, which a fork applies as a plain count only;
    `start_env`: what the task's ranks set before their imports (`Task.start_env`), which
    `warm_up` sets too, so a job's variable of the same value changes nothing a fork inherits."""
    chosen = os.environ.get("RINGCTL_LOCAL_LAUNCH", FORK) or FORK
    if chosen != FORK:
        return f"RINGCTL_LOCAL_LAUNCH={chosen}" + ("" if chosen == EXEC else " (fork or exec)")
    if not sys.platform.startswith("linux"):
        return f"forking ranks is done on Linux only (this is {sys.platform})"
    if gpu := gpu_device_node():
        return f"a GPU is here ({gpu}): CUDA cannot start in a fork of a process that asked for it"
    if not plain_count(threads):
        return f"OMP_NUM_THREADS={threads!r} is not a plain thread count"
    if cfg.env.python:
        return f"env.python names an interpreter ({cfg.env.python})"
    for name, value in cfg.env.vars.items():
        name = str(name)
        if name in AFTER_START_VARS or name.startswith(AFTER_START_PREFIXES):
            continue
        if start_env.get(name) == str(value):
            continue
        return f"env.vars.{name} may act at start-up"
    return None


def gpu_device_node() -> str | None:
    """The first GPU driver device node on this machine, or None."""
    return next((path for path in GPU_DEVICE_NODES if os.path.exists(path)), None)


def warm_up(modules: tuple[str, ...], env: dict[str, str]) -> str | None:
    """Import what the ranks will import, once, here, in the environment `env` adds to this
    one: the ranks' thread count (numpy's and scipy's BLAS size their pools from
    OMP_NUM_THREADS when they load, and torch.set_num_threads does not reach them) and the
    task's `start_env` (HF_HUB_OFFLINE=1: read when huggingface_hub is imported). The
    environment is then put back, so a rank's own is what a new interpreter's would be. Returns
    the failure that leaves ranks to start as new interpreters (a module half imported is a
    state no new interpreter has, and the rank says what failed)."""
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception as err:  # noqa: BLE001 - the rank imports it again and says why
                return f"importing {name} failed ({type(err).__name__})"
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return None


def start_rank(how: str, job_path: str, env: dict[str, str], logs: tuple, python: str):
    """Start one rank of the job in `job_path` (its cwd) with exactly `env` as its environment,
    stdin from /dev/null, stdout and stderr appended to `logs` (out, err), dying with this
    process: a fork (`how` FORK; a `ForkedRank`) or `python -m ringctl.worker` (a Popen)."""
    fds = [os.open(os.devnull, os.O_RDONLY)]
    try:
        fds += [os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666) for log in logs]
        if how == FORK:
            return _fork(job_path, env, fds)
        return subprocess.Popen(
            [python, "-m", "ringctl.worker", job_path],
            cwd=job_path,
            env=env,
            stdin=fds[0],
            stdout=fds[1],
            stderr=fds[2],
            preexec_fn=die_with_parent,
        )
    finally:
        for fd in fds:
            os.close(fd)


class ForkedRank:
    """A rank started by `_fork`, with the part of subprocess.Popen's interface the supervisor
    uses (pid, poll, terminate, kill); returncode is -N for a signal N, as Popen's."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its status is lost (Popen says 0)
                pid, status = self.pid, 0
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


def _fork(job_path: str, env: dict[str, str], fds: list[int]) -> ForkedRank:
    """The fork. SIGTERM and SIGINT are held until the child has its own handlers (one
    arriving in between would otherwise run the supervisor's handler in the rank)."""
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _become_rank(job_path, env, fds, parent, held)
            finally:
                os._exit(code)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)  # the parent's (the child exits above)
    return ForkedRank(pid)


def _become_rank(job_path: str, env: dict[str, str], fds: list[int], parent: int, mask) -> int:
    """In the forked child: what exec would have reset, then the worker's main (which ends the
    process itself after writing its result); its exit status."""
    for fd_from, fd_to in zip(fds, (0, 1, 2), strict=True):
        os.dup2(fd_from, fd_to)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    _fresh_stdio()
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as a new interpreter has them
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        die_with_parent()
        if os.getppid() != parent:
            return 1  # the supervisor died before the line above took effect
        _name_process(b"ringctl-rank")
        os.chdir(job_path)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = [sys.argv[0], job_path]
        as_a_new_interpreter(int(env["OMP_NUM_THREADS"]))  # plain_count, by exec_reason
        from ..worker import main

        code = main([job_path])
    except BaseException:  # noqa: BLE001 - the rank's stderr is its log
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _fresh_stdio() -> None:
    """sys.stdin/stdout/stderr on fds 0-2, buffered as a new interpreter's (the supervisor's
    may be other objects: a rank's output must reach its logs)."""
    sys.stdin = open(0, closefd=False)  # each lives as long as the process
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)


def _name_process(name: bytes) -> None:
    """The name `ps -e` and `top` show (PR_SET_NAME; the command line stays the supervisor's)."""
    prctl(15, ctypes.c_char_p(name[:15]))  # PR_SET_NAME


def as_a_new_interpreter(threads: int) -> None:
    """What a new interpreter would have that a fork shares with its parent and siblings: its
    own thread count, and its own random seeds (torch's and numpy's global generators are
    seeded from the OS at start-up; Python's `random` reseeds itself after a fork)."""
    import torch

    torch.set_num_threads(threads)
    torch.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
