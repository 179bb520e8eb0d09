"""What every rank runs: `python -m ringctl.worker JOB_DIR`.

1. Read JOB_DIR/config.yaml, and JOB_DIR/placement.json where the job wrote one.
2. Know who this process is: its node ($SLURMD_NODENAME, else the host name) and local rank
   ($SLURM_LOCALID, else $LOCAL_RANK). With a plan, its ring entry for (node, local_rank) gives
   the torch rank (ring position == rank: the ring follows the placement), the GPU, and
   environment variables to apply. Without a plan, the rank comes from $RANK / $SLURM_PROCID.
3. Rendezvous at $MASTER_ADDR:$MASTER_PORT (under Slurm without them: submitit's
   TorchDistributedEnvironment). All ranks first meet at the TCP store (`rendezvous_timeout`),
   then start the process group (gloo on CPU, nccl with CUDA) with `timeout`: a dead or hung
   peer makes the others fail within that many seconds.
4. Run the task (`ringctl.tasks`) with a `TaskContext`.
5. Exit 0, or non-zero with the error as the last line of this rank's stderr, starting with
   "ringctl.worker: ", and in logs/rank-<T>.result.json (T = this process's launch index).
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import WORKER_ERROR_PREFIX as ERROR_PREFIX
from .errors import StoppedOnRequest
from .jobdir import JobDir
from .lifetime import die_with_launcher
from .text import ascii_number


class WorkerError(Exception):
    """A problem with this rank's set-up (plan, environment) rather than the task."""


@dataclass
class Identity:
    node: str
    local_rank: int
    task_index: int  # index among the launched processes: Slurm's %t, or the local backend's
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    plan_entry: dict | None = None
    placement: Any = None


@dataclass
class TaskContext:
    """What a task's `run(cfg, ctx)` gets."""

    rank: int
    world_size: int
    local_rank: int
    node: str
    device: Any  # torch.device
    group: Any  # torch.distributed.ProcessGroup, or None for the default group
    job_dir: Path
    out_dir: Path
    plan_entry: dict | None = None
    placement: Any = None  # the job's placement.json (ringctl.topology.RingPlan), if any
    # The job's collective timeout (`timeout`): every group a task makes is given it (torch
    # gives a new group its own default, 30 minutes for gloo, not the default group's).
    timeout: datetime.timedelta | None = None
    _stop: list[bool] = field(default_factory=lambda: [False])
    _start: float = field(default_factory=time.monotonic)

    def log(self, msg: str) -> None:
        """One line in this rank's log (stdout), with the time and the rank."""
        stamp = datetime.datetime.now().strftime("%H:%M:%S")
        print(f"{stamp} [rank {self.rank}] {msg}", flush=True)

    def progress(
        self,
        done: int,
        total: int,
        *,
        unit: str = "items",
        before: int = 0,
        eta_s: float | None = None,
        quiet: bool = False,
        **extra: Any,
    ) -> None:
        """Log progress with rate and ETA; rank 0 also keeps logs/progress.json up to date.

        `before` is how many of `done` an earlier attempt finished (a resumed job): the rate
        counts only this attempt's work, so the ETA is not flattered by skipped items. A task
        that knows better (e.g. from bytes left) gives its own `eta_s`. ``quiet``: the record
        only (a field changed since the last line, not the count)."""
        elapsed = time.monotonic() - self._start
        fresh = max(0, done - before)
        rate = fresh / elapsed if elapsed > 0 else 0.0
        eta = (total - done) / rate if rate > 0 else None
        eta = eta_s if eta_s is not None else eta
        parts = [f"{done}/{total} {unit}", f"{rate:.3g} {unit}/s"]
        if before:
            parts.append(f"{before} from earlier attempts")
        if eta is not None:
            parts.append(f"ETA {eta:.0f}s")
        parts += [f"{k}={v}" for k, v in extra.items() if v is not None]
        if not quiet:
            self.log("progress: " + ", ".join(parts))
        if self.rank == 0:
            from .progress import progress_record, write_record

            record = progress_record(done, total, unit, before, elapsed, rate, eta, **extra)
            write_record(JobDir(self.job_dir).progress, record)

    def stop_requested(self) -> bool:
        """True once the warning signal (slurm.signal's, `warning_signal`) arrived: finish the
        unit, save, return."""
        return self._stop[0]


def warning_signal(cfg) -> signal.Signals:
    """The signal the job's slurm.signal sends before the time limit (SIGUSR1 without one):
    the worker handled SIGUSR1 only, so a job given USR2@120 or TERM@120 died at the warning
    with no checkpoint. sbatch.WORKER_SIGNALS lists the names slurm.signal may take."""
    from .sbatch import signal_lead

    parsed = signal_lead(str(cfg.slurm.signal)) if cfg.slurm.signal else None
    return signal.Signals[f"SIG{parsed[0] if parsed else 'USR1'}"]


def _env_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return None


def load_placement(job_dir: Path):
    """The job's placement (`ringctl.topology.RingPlan`), or None when the job has none."""
    from .errors import UserError
    from .topology import load_plan

    path = JobDir(job_dir).placement
    if not os.path.lexists(path):  # a link, even to nowhere, is read (and refused by name)
        return None
    try:
        return load_plan(path)
    except UserError as err:
        raise WorkerError(str(err)) from None


def identify(job_dir: Path) -> Identity:
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    local_rank = _env_int("SLURM_LOCALID", "LOCAL_RANK")
    task_index = _env_int("SLURM_PROCID", "RANK")
    world = _env_int("SLURM_NTASKS", "WORLD_SIZE")
    addr, port = os.environ.get("MASTER_ADDR"), _env_int("MASTER_PORT")
    if os.environ.get("SLURM_JOB_ID") and (addr is None or port is None or task_index is None):
        from submitit.helpers import TorchDistributedEnvironment

        os.environ.setdefault("SUBMITIT_EXECUTOR", "slurm")  # submitit reads Slurm's variables
        env = TorchDistributedEnvironment()
        addr, port = addr or env.master_addr, port or env.master_port
        task_index = env.rank if task_index is None else task_index
        world = env.world_size if world is None else world
        local_rank = env.local_rank if local_rank is None else local_rank
    if task_index is None or world is None or addr is None or port is None:
        raise WorkerError(
            "cannot tell this process's rank: set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT "
            "(or run under srun / `ringctl submit`)"
        )
    local_rank = task_index if local_rank is None else local_rank
    ident = Identity(node, local_rank, task_index, task_index, world, addr, int(port))
    placement = load_placement(job_dir)
    ident.placement = placement
    if placement is not None:
        from dataclasses import asdict

        from .errors import UserError

        if placement.world_size != world:
            raise WorkerError(
                f"placement.json places {placement.world_size} ranks but {world} were launched"
            )
        try:
            entry = placement.entry_for(node, local_rank)
        except UserError as err:
            raise WorkerError(f"placement.json: {err}") from None
        ident.plan_entry = asdict(entry)
        ident.rank = entry.rank
    return ident


def _launch_index(ident: Identity | None) -> int | str:
    index = ident.task_index if ident else _env_int("SLURM_PROCID", "RANK")
    return index if index is not None else "unknown"


def write_result(job_dir: Path, ident: Identity | None, record: dict) -> None:
    """logs/rank-<T>.result.json; a failed rank's logs/rank-<T>.failed first, so that a
    listing shows the failure even where a wrapper turned this process's exit 1 into 0."""
    index = _launch_index(ident)
    try:
        from .atomic import atomic_write, atomic_write_json

        if record.get("state") == "FAILED":
            atomic_write(JobDir(job_dir).rank_failed_mark(index), b"")
        atomic_write_json(JobDir(job_dir).rank_result(index), record)
    except OSError:
        pass


def cuda_index(entry: dict, local_rank: int, count: int, visible: str | None = None) -> int:
    """The CUDA ordinal of this rank's GPU among the ``count`` it sees.

    A plan that pins the rank to its GPU (``CUDA_VISIBLE_DEVICES``, set before torch starts)
    leaves it one device, which CUDA numbers 0: the GPU's nvidia-smi index is not its ordinal
    (taken as one, every rank off GPU 0 was refused). A plan's GPU without that pin (a PCIe
    node, ``placement.pins_gpu``) is its place in the ``CUDA_VISIBLE_DEVICES`` the rank
    inherited (``visible``: Slurm's list of the job's GPUs, "4,5,6,7"), else an ordinal among
    the visible devices; without a plan, the local rank picks one."""
    gpu = entry.get("gpu")
    if isinstance(gpu, int) and "CUDA_VISIBLE_DEVICES" in (entry.get("env") or {}):
        if count != 1:  # the pin did not take: two ranks could share a GPU
            raise WorkerError(
                f"placement.json pins this rank to GPU {gpu} (CUDA_VISIBLE_DEVICES); "
                f"it sees {count} devices"
            )
        return 0
    if isinstance(gpu, int):
        indices = [ascii_number(part.strip(), 9) for part in (visible or "").split(",")]
        if visible and None not in indices:  # numbers, as CUDA reads them: "04" is GPU 4
            if gpu not in indices:  # a GPU of the node this job was not given
                raise WorkerError(
                    f"placement.json gives this rank GPU {gpu}; CUDA_VISIBLE_DEVICES gives "
                    f"it {visible} (the job's GPUs)"
                )
            gpu = indices.index(gpu)
        if gpu >= count:  # two ranks would share a GPU
            raise WorkerError(f"placement.json gives this rank GPU {gpu}; it sees {count}")
        return gpu
    return local_rank % count


def init_distributed(cfg, ident: Identity):
    """This rank's device and the job's store, once every rank met and the process group is
    up (NCCL on the rank's GPU, else gloo on the CPU); a GPU the plan names but the rank cannot
    see is refused."""
    import torch
    import torch.distributed as dist

    want = cfg.ring.dist_backend.value
    cuda = torch.cuda.is_available() and want != "gloo"
    if want == "nccl" and not torch.cuda.is_available():
        raise WorkerError("ring.dist_backend=nccl but this rank sees no CUDA device")
    gpu = (ident.plan_entry or {}).get("gpu")
    if isinstance(gpu, int) and want != "gloo" and not torch.cuda.is_available():
        # a pin to a GPU this step cannot see left none: the ring would run on the CPU
        raise WorkerError(f"placement.json gives this rank GPU {gpu}; it sees no CUDA device")
    if cuda:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        entry = ident.plan_entry or {}
        index = cuda_index(entry, ident.local_rank, torch.cuda.device_count(), visible)
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    # The store lives with launch task 0, which runs on MASTER_ADDR (the allocation's first
    # node); ring rank 0 may be elsewhere when the plan reorders the ring.
    is_master = ident.task_index == 0
    rendezvous = datetime.timedelta(seconds=float(cfg.rendezvous_timeout))
    tcp = dist.TCPStore(
        ident.master_addr,
        ident.master_port,
        ident.world_size,
        is_master,
        timeout=rendezvous,
        wait_for_workers=False,
    )
    store = dist.PrefixStore(f"ringctl/{run_id()}", tcp)  # this run's keys only
    # Meet first (patiently: ranks start at different times), then the group's timeout applies.
    if int(store.add("arrived", 1)) == ident.world_size:
        store.set("all-arrived", "1")  # the last to arrive opens the gate
    try:
        store.wait(["all-arrived"], rendezvous)
    except Exception:  # a timeout (DistStoreError / RuntimeError, by torch version)
        arrived = _arrived(store)
        raise WorkerError(
            f"rendezvous: only {arrived} of {ident.world_size} ranks arrived at "
            f"{ident.master_addr}:{ident.master_port} within {cfg.rendezvous_timeout:g}s"
        ) from None
    store.set_timeout(collective_timeout(cfg))
    kwargs = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(
        backend,
        store=store,
        rank=ident.rank,
        world_size=ident.world_size,
        timeout=collective_timeout(cfg),
        **kwargs,
    )
    return device, store


def _arrived(store) -> str:
    """How many of this run's ranks reached the store, for the timeout's line ("?" when the
    store is gone: another job's, which ended)."""
    try:
        return str(int(store.add("arrived", 0)))
    except Exception:  # noqa: BLE001 (the store's own errors vary by torch version)
        return "?"


RUN_ID = "RINGCTL_RUN_ID"  # set by the batch script and the local supervisor, alike on all ranks


def run_id() -> str:
    """This run's name among the rendezvous store's keys (``RUN_ID``; else Slurm's job id):
    two jobs whose ports met on one host (Slurm's ids 20000 apart) shared the keys, and a
    rank of the later one was counted among the earlier job's ranks, opened its gate, then
    died and took that job down with it."""
    slurm = ".".join(os.environ.get(k, "") for k in ("SLURM_JOB_ID", "SLURM_STEP_ID"))
    return os.environ.get(RUN_ID) or (slurm if slurm != "." else "job")


def collective_timeout(cfg) -> datetime.timedelta:
    """The job's ``timeout``: the process group's, the store's after the rendezvous, and
    every group a task makes (``TaskContext.timeout``)."""
    return datetime.timedelta(seconds=float(cfg.timeout))


def apply_threads(cfg, torch) -> None:
    """The rank computes with ``threads.rank_threads``' count on its own node: the job's
    OMP_NUM_THREADS applied (torch caps the variable at the cores it sees at import, so
    Slurm ran 2 threads where the local backend ran the 3 asked for), else the rule's count
    (Slurm's srun starts a rank without one; the local backend sets it by the same rule), at
    most the CPUs the rank may run on (a site binding each task to its own CPUs)."""
    from .threads import plain_count, rank_threads, usable, usable_cpus

    given = os.environ.get("OMP_NUM_THREADS", "")
    on_node = os.environ.get("SLURM_CPUS_ON_NODE", "")
    allowed = usable_cpus()
    threads = rank_threads(
        given,
        cpus_per_task=cfg.slurm.get("cpus_per_task"),
        node_cpus=ascii_number(on_node, 6) or allowed,  # "²".isdigit(), and int() refused it
        ranks_on_node=int(cfg.tasks_per_node),
    )
    if not usable(given) and plain_count(threads) and int(threads) > allowed:
        threads = str(allowed)  # a task Slurm binds to its own CPUs: 28 threads on 1 CPU
    os.environ["OMP_NUM_THREADS"] = threads
    if plain_count(threads):  # "4,2" (nested levels): OpenMP's own reading stands
        torch.set_num_threads(int(threads))


def gpu_cpus(ident: Identity) -> str:
    """The CPU list the plan gives this rank (its GPU's CPUs), "" without one: the plan's, not
    an inherited RINGCTL_CPU_AFFINITY (a submitting shell's value bound ranks no plan placed,
    each counted alone)."""
    return str((ident.plan_entry or {}).get("env", {}).get("RINGCTL_CPU_AFFINITY") or "")


def cpu_sharers(ident: Identity) -> int:
    """How many ranks of this rank's node the plan gives its CPU list (itself among them)."""
    mine = gpu_cpus(ident)
    if ident.placement is None or not mine:
        return 1
    return sum(
        1
        for e in ident.placement.ring
        if e.node == ident.node and e.env.get("RINGCTL_CPU_AFFINITY") == mine
    )


def bind_to_gpu_cpus(listed: str, sharers: int = 1) -> str:
    """Bind this rank to its GPU's CPUs (the plan's RINGCTL_CPU_AFFINITY, nvidia-smi's CPU
    Affinity), within those it may use (Slurm's cpuset), when they hold the threads of the
    ``sharers`` ranks of this node bound to the same list (GPUs of one socket share it: two
    ranks of 32 threads each on a pair's 32 CPUs left the node's other CPUs idle): a rank left
    on the socket far from its GPU and NIC copied every block across the sockets' link.
    Exported by the plan, it was applied by nothing. Returns what the start line says (""
    where the plan gives no list)."""
    from .threads import plain_count
    from .topology.model import cpu_set

    if not listed or not hasattr(os, "sched_setaffinity"):
        return ""
    try:
        both = cpu_set(listed) & os.sched_getaffinity(0)
    except ValueError:
        return f"; RINGCTL_CPU_AFFINITY {listed[:40]!r} is not a CPU list: not bound"
    threads, sharers = os.environ.get("OMP_NUM_THREADS", ""), max(1, sharers)
    need = (int(threads) if plain_count(threads) else 1) * sharers
    if len(both) < need:
        return (
            f"; not bound to its GPU's CPUs: {len(both)} of them are this rank's, fewer "
            f"than the {need} threads of the {sharers} rank(s) they would hold"
        )
    os.sched_setaffinity(0, both)
    return f"; bound to {len(both)} CPUs beside its GPU"


def run(job_dir: Path) -> dict:
    from . import config, tasks

    cfg = config.load_resolved(JobDir(job_dir).config)
    stop = [False]

    def on_signal(signum, frame):  # Slurm's --signal before the time limit
        stop[0] = True
        print(f"ringctl.worker: got signal {signum}: finishing up", flush=True)

    # First: a warning that came while torch was imported killed the rank (SIGUSR1's default).
    signal.signal(warning_signal(cfg), on_signal)
    ident = identify(job_dir)
    if ident.plan_entry:
        for key, value in (ident.plan_entry.get("env") or {}).items():
            os.environ[str(key)] = str(value)
    import torch

    apply_threads(cfg, torch)
    bound = bind_to_gpu_cpus(gpu_cpus(ident), cpu_sharers(ident))
    print(
        f"ringctl.worker: task {ident.task_index} on {ident.node} (local rank "
        f"{ident.local_rank}) -> ring rank {ident.rank} of {ident.world_size}"
        f"{' (from placement.json)' if ident.plan_entry else ''}; rendezvous "
        f"{ident.master_addr}:{ident.master_port}; collective timeout {cfg.timeout:g}s; "
        f"CPU threads: {torch.get_num_threads()}{bound}",
        flush=True,
    )
    import torch.distributed as dist

    device, _store = init_distributed(cfg, ident)
    out_dir = JobDir(job_dir).out
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = TaskContext(
        rank=ident.rank,
        world_size=ident.world_size,
        local_rank=ident.local_rank,
        node=ident.node,
        device=device,
        group=None,
        job_dir=job_dir,
        out_dir=out_dir,
        plan_entry=ident.plan_entry,
        placement=ident.placement,
        timeout=collective_timeout(cfg),
        _stop=stop,
    )
    started = time.time()
    result = tasks.get_task(cfg.task.name).run(cfg, ctx)
    dist.barrier()  # nobody reports success while a peer may still fail
    dist.destroy_process_group()
    record = {
        "state": "COMPLETED",
        "rank": ident.rank,
        "task_index": ident.task_index,
        "node": ident.node,
        "elapsed_s": time.time() - started,
        "finished_at": time.time(),
    }
    write_result(job_dir, ident, record)
    return result if isinstance(result, dict) else {}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: python -m ringctl.worker JOB_DIR", file=sys.stderr)
        return 2
    job_dir = Path(argv[0]).resolve()
    if not die_with_launcher():
        return 1
    try:
        run(job_dir)
    except BaseException as err:  # noqa: BLE001 - every failure must reach the log
        if isinstance(err, SystemExit) and not err.code:
            return 0
        try:
            ident = identify(job_dir)
        except Exception:
            ident = None
        stopped = isinstance(err, StoppedOnRequest)  # saved and stopped: said, not a crash
        if not stopped:
            traceback.print_exc()
        who = f"rank {ident.rank} (task {ident.task_index} on {ident.node})" if ident else "rank ?"
        # gloo prefixes its errors with its source location: "[/…/unbound_buffer.cc:78] "
        text = re.sub(r"^\[[^\]\s]+\.(?:cc|cpp|h|hpp):\d+\]\s*", "", str(err).strip())
        line = (text if stopped else f"{type(err).__name__}: {text}").strip().splitlines()
        message = " ".join(s.strip() for s in line)[:500] or type(err).__name__
        write_result(
            job_dir,
            ident,
            {
                "state": "FAILED",
                "rank": ident.rank if ident else None,
                "task_index": ident.task_index if ident else None,
                "node": ident.node if ident else None,
                "error": message,
                "failed_at": time.time(),
            },
        )
        said = message if stopped else f"failed: {message}"  # "stopped on request at ..."
        print(f"{ERROR_PREFIX}{who} {said}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # Skip interpreter teardown: a broken process group can block it for a long time.
        os._exit(1)
    # Success is recorded; skip interpreter teardown too. Threads of the communication library
    # still being torn down at exit have been seen to abort the process (SIGABRT) after every
    # result was written, which would turn a finished rank into a failed one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
