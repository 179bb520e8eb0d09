"""The processes of the attention benchmark (benchmarks/attention.py and its interleaved
pairings, benchmarks/pairing.py): P ring ranks (`RingPool`) and one process running
``torch.nn.functional.scaled_dot_product_attention`` on the whole sequence (`SdpaProcess`),
each timing the configurations (`Config`) given to it and answering the medians, the peak
memory added during a step, and (the ring) the time its transfers took alone and with nothing
sent.
"""

from __future__ import annotations

import itertools
import os
import queue
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta


@dataclass(frozen=True)
class Config:
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    batch: int
    dtype: str
    causal: bool
    layout: str
    repeats: int
    impl: str = "ringattn"  # or "ring-attention-pytorch", the peer package (timing only)
    lean: bool = False  # forward+backward steps only (``--pairings``): no extra measurements


def device_kind(choice: str) -> tuple[str, int]:
    """("cuda", GPUs) where asked for or (auto) where CUDA is there; else ("cpu", 0)."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if choice == "cuda" and not gpus:
        raise SystemExit("--device cuda: no CUDA device here")
    if choice == "cpu" or not gpus:
        return "cpu", 0
    return "cuda", gpus


# ----------------------------------------------------------------------------- memory
def _rss_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return 0


def _return_freed_memory_to_os() -> None:
    """Make resident memory track live tensors: release freed heap pages now and serve large
    allocations by mmap from here on (glibc otherwise keeps freed memory resident, and a peak
    measured after a warm-up step would read zero)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: fixed, so it no longer grows with use
    libc.malloc_trim(0)


def _reset_peak() -> None:
    try:  # "5" resets VmHWM (the peak resident set) to the current RSS (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_above_now(device=None):
    """Context: peak memory during the block above what was held at its start, in MiB:
    the device allocator's peak on a GPU, the resident set's high-water mark on the CPU."""
    import torch

    on_gpu = device is not None and device.type == "cuda"

    class Peak:
        def __enter__(self):
            if on_gpu:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                self.start = torch.cuda.memory_allocated(device) / 1024
                return self
            _return_freed_memory_to_os()
            _reset_peak()
            self.start = _rss_kib("VmRSS")
            return self

        def __exit__(self, *exc):
            if on_gpu:
                torch.cuda.synchronize(device)
                peak = torch.cuda.max_memory_allocated(device) / 1024
            else:
                peak = _rss_kib("VmHWM")
            self.mib = max(0, peak - self.start) / 1024

    return Peak()


# ----------------------------------------------------------------------------- workers
def _ring_worker(
    rank: int,
    world: int,
    threads: int,
    init: str,
    device_kind: str,
    tasks,
    results,
    engine: str | None = None,
) -> None:
    if engine:  # another checkout's ringattn (``--engine``), imported before anything else
        sys.path.insert(0, engine)
    import torch
    import torch.distributed as dist

    import ringattn
    from ringattn.comm import STATS

    try:
        from ringattn.shm import ring_transport
    except ImportError:  # an engine (--engine) from before the shared-memory transport
        from ringattn.comm import RingComm as ring_transport

    torch.set_num_threads(threads)
    if device_kind == "cuda":  # one GPU per rank, NCCL; flash-attn kernels where installed
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if device_kind == "cuda" else "gloo",
        init_method=init,
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=10),
    )
    while True:
        cfg = tasks.get()
        if cfg is None:
            break
        try:
            res = _ring_measure(
                cfg, rank, world, torch, dist, ringattn, STATS, ring_transport, device_kind
            )
            results.put((rank, "ok", res))
        except Exception:
            results.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


def _no_transfer_comm(group):
    """ringattn's RingComm with nothing sent, to time a ring's compute alone: the same loop and
    shapes, given as ring_attention's ``comm``. Landing buffers get real data once, so no step
    computes on garbage. A borrowing exchange gets a block of this comm's own, filled once, as
    the shared-memory transport hands over its slot: the ring then never writes (pages in) its
    landing buffer, as on shm, and this stays a floor of the shm ring."""
    from ringattn.comm import PendingExchange, RingComm

    class NoTransfer(RingComm):
        def __init__(self, group) -> None:
            super().__init__(group)
            self._filled: set[int] = set()
            self._lent: dict[tuple, tuple] = {}

        def exchange(self, send, recv, *, tag: int = 0, shift: int = 1, borrow: bool = False):
            if borrow:
                key = (tag, shift, *((tuple(r.shape), r.dtype) for r in recv))
                if key not in self._lent:
                    pairs = zip(send, recv, strict=True)
                    self._lent[key] = tuple(_fill(r.new_empty(r.shape), s) for s, r in pairs)
                return PendingExchange([], self._lent[key])
            for s, r in zip(send, recv, strict=True):
                if (r.data_ptr(), r.numel()) not in self._filled:
                    _fill(r, s)
                    self._filled.add((r.data_ptr(), r.numel()))
            return PendingExchange([], recv)

    return NoTransfer(group)


def _fill(recv, send):
    """``recv`` filled with real data: ``send`` where the shapes agree, else random (a hop may
    carry fewer rows than were sent)."""
    return recv.copy_(send) if recv.shape == send.shape else recv.normal_()


class _Clock:
    """Seconds of a stretch of work: CUDA events on a GPU (the work's own time on the device,
    read after one synchronisation), the wall clock after a barrier on the CPU."""

    def __init__(self, torch, device) -> None:
        self.torch, self.device = torch, device
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        if self.cuda:
            self._a = self.torch.cuda.Event(enable_timing=True)
            self._a.record()
        else:
            self._t = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            b = self.torch.cuda.Event(enable_timing=True)
            b.record()
            b.synchronize()
            return self._a.elapsed_time(b) / 1e3
        return time.perf_counter() - self._t


def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _record_exchanges(step, ring_transport) -> tuple:
    """(the transport a ring runs on by default, every exchange one forward+backward step of
    it makes on that transport: (what it sends, what it receives, its keywords))."""
    transport = ring_transport(None)
    calls: list[tuple] = []
    passed_on = transport.exchange

    def recording(send, recv, **kw):
        shapes = ([(t.shape, t.dtype) for t in send], [(t.shape, t.dtype) for t in recv])
        calls.append((*shapes, kw))
        return passed_on(send, recv, **kw)

    transport.exchange = recording  # on this instance only: the ring calls comm.exchange
    try:
        step(True, comm=transport)
    finally:
        del transport.exchange
    return transport, calls


def _transfers_alone(transport, calls, torch, device, dist, clock, repeats: int) -> float:
    """Seconds of the recorded exchanges replayed in order with nothing computed (median of
    ``repeats``), each waited on before the next, settled as a ring call is (``drive``). A
    strided send (some rows of a batch's block) is replayed contiguous: its copy is not in it."""

    def made(specs):
        return [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in specs]

    tensors = [(made(send), made(recv), kw) for send, recv, kw in calls]

    def replay():
        for send, recv, kw in tensors:
            yield transport.exchange(send, recv, **kw)

    samples = []
    for _ in range(repeats):
        dist.barrier()
        _sync(torch, device)
        clock.start()
        if hasattr(transport, "drive"):
            transport.drive([replay()], device)
        else:  # an engine from before transports drove the ring's loops
            for pending in replay():
                pending.wait()
        samples.append(clock.stop())
    return statistics.median(samples)


def _ring_measure(cfg, rank, world, torch, dist, ringattn, stats, ring_transport, device_kind):
    dtype = getattr(torch, cfg.dtype)
    device = torch.device("cuda", rank) if device_kind == "cuda" else torch.device("cpu")
    local = cfg.seq // world
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(cfg.batch, local, cfg.heads, cfg.head_dim, generator=g).to(device, dtype)
    k = torch.randn(cfg.batch, local, cfg.kv_heads, cfg.head_dim, generator=g).to(device, dtype)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)

    clock = _Clock(torch, device)

    def step(backward: bool, comm=None) -> float:
        qq, kk, vv = (t.detach().requires_grad_(backward) for t in (q, k, v))
        dist.barrier()
        _sync(torch, device)
        clock.start()
        if cfg.impl == "ringattn":
            given = {} if comm is None else {"comm": comm}  # engines before comm= take none
            out = ringattn.ring_attention(qq, kk, vv, causal=cfg.causal, layout=cfg.layout, **given)
        else:  # the peer package, in its own contiguous layout; timed, not trusted
            from ring_attention_pytorch import ring_flash_attn

            # ring_reduce_col=True is what makes it pass K/V around the ring (without it every
            # rank attends to its own block only). Its out and dQ match full attention; its
            # dK/dV do not (checked against the float64 reference at P = 2 and 4).
            out = ring_flash_attn(
                qq, kk, vv, causal=cfg.causal, ring_size=world, ring_reduce_col=True
            )
        if backward:
            out.backward(dout)
        elapsed = clock.stop()
        times = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(world)]
        dist.all_gather(times, torch.tensor([elapsed], dtype=torch.float64, device=device))
        return max(t.item() for t in times)  # a step ends when its slowest rank ends

    if cfg.repeats == 0:  # memory only: a tiny warm-up (gloo pairs, threads), one measured step
        tiny = [t[:, : 2 * world].contiguous() for t in (q, k, v)]
        ringattn.ring_attention(
            *(t.requires_grad_() for t in tiny), causal=cfg.causal, layout=cfg.layout
        ).sum().backward()
        with _peak_above_now(device) as peak:
            elapsed = step(True)
        return {
            "fwd_s": float("nan"),
            "fwd_bwd_s": elapsed,
            "wait_s": 0.0,
            "comm_alone_s": 0.0,
            "peak_mib": peak.mib,
        }
    step(True)  # warm-up: allocator, thread pools, gloo pairs
    if cfg.lean:
        return _lean_result([step(True) for _ in range(cfg.repeats)])
    fwd = [step(False) for _ in range(cfg.repeats)]
    fwd_bwd, waits = [], []
    for _ in range(cfg.repeats):
        stats.reset(enabled=True)
        fwd_bwd.append(step(True))
        waits.append(stats.wait_s)
    bytes_sent = stats.bytes_sent  # by one step (every step sends the same)
    stats.reset(enabled=False)
    # The same ring with its transfers taken out: what the step costs in compute alone.
    no_transfer = []
    if world > 1 and cfg.impl == "ringattn":
        silent = _no_transfer_comm(None)
        no_transfer = [step(True, comm=silent) for _ in range(cfg.repeats)]
    with _peak_above_now(device) as peak:
        step(True)

    # The same transfers alone: the exchanges one step made (each hop as large as it was: a
    # one-hop leg carries only the rows its holder reads), replayed on the ring's transport.
    comm_alone, bytes_alone = 0.0, 0
    if world > 1:
        transport, calls = _record_exchanges(step, ring_transport)
        comm_alone = _transfers_alone(transport, calls, torch, device, dist, clock, cfg.repeats)
        bytes_alone = sum(
            shape.numel() * dtype.itemsize for send, _, _ in calls for shape, dtype in send
        )
    return {
        "fwd_s": statistics.median(fwd),
        "fwd_bwd_s": statistics.median(fwd_bwd),
        "wait_s": statistics.median(waits),
        "no_transfer_s": statistics.median(no_transfer) if no_transfer else None,
        "comm_alone_s": comm_alone,
        "bytes_sent": bytes_sent,
        "bytes_alone": bytes_alone,
        "peak_mib": peak.mib,
    }


def _lean_result(fwd_bwd: list[float]) -> dict:
    """A lean measurement's result: the median forward+backward step, nothing else."""
    nan = float("nan")
    return {
        "fwd_s": nan,
        "fwd_bwd_s": statistics.median(fwd_bwd),
        "wait_s": 0.0,
        "no_transfer_s": None,
        "comm_alone_s": 0.0,
        "peak_mib": nan,
    }


def _sdpa_worker(threads: int, device_kind: str, tasks, results) -> None:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    device = torch.device("cuda", 0) if device_kind == "cuda" else torch.device("cpu")
    while True:
        cfg = tasks.get()
        if cfg is None:
            break
        try:
            dtype = getattr(torch, cfg.dtype)
            g = torch.Generator().manual_seed(0)
            shape_q = (cfg.batch, cfg.heads, cfg.seq, cfg.head_dim)
            shape_kv = (cfg.batch, cfg.kv_heads, cfg.seq, cfg.head_dim)
            q = torch.randn(shape_q, generator=g).to(device, dtype)
            k = torch.randn(shape_kv, generator=g).to(device, dtype)
            v, dout = torch.randn_like(k), torch.randn_like(q)

            def step(backward: bool, q=q, k=k, v=v, dout=dout, cfg=cfg) -> float:
                qq, kk, vv = (t.detach().requires_grad_(backward) for t in (q, k, v))
                _sync(torch, device)
                start = time.perf_counter()
                out = F.scaled_dot_product_attention(
                    qq, kk, vv, is_causal=cfg.causal, enable_gqa=cfg.kv_heads != cfg.heads
                )
                if backward:
                    out.backward(dout)
                _sync(torch, device)
                return time.perf_counter() - start

            if cfg.repeats == 0:
                with _peak_above_now(device) as peak:
                    elapsed = step(True)
                results.put(
                    ("ok", {"fwd_s": float("nan"), "fwd_bwd_s": elapsed, "peak_mib": peak.mib})
                )
                continue
            step(True)
            if cfg.lean:
                results.put(("ok", _lean_result([step(True) for _ in range(cfg.repeats)])))
                continue
            fwd = [step(False) for _ in range(cfg.repeats)]
            fwd_bwd = [step(True) for _ in range(cfg.repeats)]
            with _peak_above_now(device) as peak:
                step(True)
            results.put(
                (
                    "ok",
                    {
                        "fwd_s": statistics.median(fwd),
                        "fwd_bwd_s": statistics.median(fwd_bwd),
                        "peak_mib": peak.mib,
                    },
                )
            )
        except Exception:
            results.put(("error", traceback.format_exc()))


_STORES = itertools.count()  # one rendezvous file per ring started, never reused


class RingPool:
    """P ring ranks that run configurations given to them (``fresh_run``: one each in the
    full benchmark; ``--pairings`` keeps them across its lean, memory-free measurements)."""

    def __init__(
        self,
        ctx,
        world: int,
        threads: int,
        tmpdir: str,
        device_kind: str,
        engine: str | None = None,
    ) -> None:
        self.world = world
        init = f"file://{tmpdir}/ring-store-{world}-{os.getpid()}-{next(_STORES)}"
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(
                target=_ring_worker,
                args=(r, world, threads, init, device_kind, self.tasks[r], self.results, engine),
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def run(self, cfg: Config) -> dict:
        for t in self.tasks:
            t.put(cfg)
        out = {}
        for _ in range(self.world):
            rank, status, value = _get(self.results, self.procs)
            if status == "error":
                raise RuntimeError(f"ring rank {rank} failed:\n{value}")
            out[rank] = value
        per_rank = list(out.values())
        return {
            "fwd_s": per_rank[0]["fwd_s"],
            "fwd_bwd_s": per_rank[0]["fwd_bwd_s"],
            "wait_s": max(r["wait_s"] for r in per_rank),
            "no_transfer_s": per_rank[0].get("no_transfer_s"),
            "comm_alone_s": max(r["comm_alone_s"] for r in per_rank),
            # per rank: what a step sent, and what its transfers alone sent (the same)
            "bytes_sent": [r.get("bytes_sent") for r in per_rank],
            "bytes_alone": [r.get("bytes_alone") for r in per_rank],
            "peak_mib": max(r["peak_mib"] for r in per_rank),
        }

    def close(self) -> None:
        for t in self.tasks:
            t.put(None)
        for p in self.procs:
            p.join(timeout=30)


class SdpaProcess:
    def __init__(self, ctx, threads: int, device_kind: str) -> None:
        self.tasks, self.results = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(
            target=_sdpa_worker, args=(threads, device_kind, self.tasks, self.results)
        )
        self.proc.start()

    def run(self, cfg: Config) -> dict:
        self.tasks.put(cfg)
        status, value = _get(self.results, [self.proc])
        if status == "error":
            raise RuntimeError(f"SDPA baseline failed:\n{value}")
        return value

    def close(self) -> None:
        self.tasks.put(None)
        self.proc.join(timeout=30)


def _get(results, procs):
    while True:
        try:
            return results.get(timeout=5)
        except queue.Empty:
            dead = [p for p in procs if not p.is_alive()]
            if dead:
                raise RuntimeError(
                    f"benchmark process exited with code {dead[0].exitcode}"
                ) from None
