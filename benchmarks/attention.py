"""Ring attention against single-process SDPA on the same total sequence, side by side.

    python -m benchmarks.attention                       # the default sweep, table + JSON
    python -m benchmarks.attention --seq 8192 --ranks 2 --causal true --layouts zigzag

For each configuration, P ring ranks (``--threads-per-rank`` threads each) and one process
running ``torch.nn.functional.scaled_dot_product_attention`` on the whole sequence with
P x threads-per-rank threads take turns on the same machine, so both see the same noise.
Reported per configuration: median forward and forward+backward time over ``--repeats``,
achieved GFLOP/s (FlashAttention accounting: forward 4*B*H*N^2*D, halved when causal;
backward 2.5x forward), peak resident memory added per rank during the step, and the share of
the ring's transfer time hidden behind compute: 1 - (step time - the same ring's step time
with nothing sent) / (time the same transfers take alone, measured right after). The ring
"with nothing sent" is ``ring_attention(..., comm=...)`` given a RingComm that sends nothing;
on GPUs every one of these times is taken with CUDA events.

Outside load: the CPU that processes outside this benchmark's process tree used during each
measurement (``benchmarks.outside_load``) is recorded per row, in cores. A measurement during
which it exceeded ``--load-threshold`` is rerun (up to ``--load-retries`` times); the least
disturbed run is kept, and a row still above the threshold is flagged ``!`` in the table and
``"disturbed": true`` in the JSON, so a ratio taken under someone else's load is never read as
the ring's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from datetime import timedelta
from functools import partial
from pathlib import Path

from benchmarks.results_file import write_results

DEFAULT_OUT = Path("benchmarks/results/attention.json")
LOAD_THRESHOLD_CORES = 0.25
LOAD_RETRIES = 2


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


@dataclass
class Result:
    impl: str  # "ringattn", "ring-attention-pytorch" or "sdpa"
    ranks: int
    threads: int
    config: Config
    fwd_s: float = 0.0
    fwd_bwd_s: float = 0.0
    fwd_gflops: float = 0.0
    fwd_bwd_gflops: float = 0.0
    peak_mem_mib: float = 0.0  # per rank, above the resident size before the step
    hidden_comm: float | None = None  # ring only
    comm_alone_s: float | None = None
    comm_wait_s: float | None = None
    extra: dict = field(default_factory=dict)


def attention_flops(cfg: Config) -> tuple[float, float]:
    fwd = 4.0 * cfg.batch * cfg.heads * cfg.seq**2 * cfg.head_dim * (0.5 if cfg.causal else 1.0)
    return fwd, fwd * 3.5


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
    from ringattn.comm import STATS, RingComm

    torch.set_num_threads(threads)
    if device_kind == "cuda":  # one GPU per rank, NCCL; flash-attn kernels where installed
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if device_kind == "cuda" else "gloo", init_method=init, rank=rank,
        world_size=world, timeout=timedelta(minutes=10),
    )  # fmt: skip
    while True:
        cfg = tasks.get()
        if cfg is None:
            break
        try:
            res = _ring_measure(
                cfg, rank, world, torch, dist, ringattn, STATS, RingComm, device_kind
            )
            results.put((rank, "ok", res))
        except Exception:
            results.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


def _no_transfer_comm(group):
    """ringattn's RingComm with nothing sent, to time a ring's compute alone: the same loop and
    shapes, given as ring_attention's ``comm``. Landing buffers get real data once, so no step
    computes on garbage."""
    from ringattn.comm import PendingExchange, RingComm

    class NoTransfer(RingComm):
        def __init__(self, group) -> None:
            super().__init__(group)
            self._filled: set[int] = set()

        def exchange(self, send, recv, *, tag: int = 0, shift: int = 1):
            for s, r in zip(send, recv, strict=True):
                if r.data_ptr() not in self._filled:
                    r.copy_(s)
                    self._filled.add(r.data_ptr())
            return PendingExchange([])

    return NoTransfer(group)


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


def _ring_measure(cfg, rank, world, torch, dist, ringattn, stats, ring_comm_cls, device_kind):
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
    stats.reset(enabled=False)
    # The same ring with its transfers taken out: what the step costs in compute alone.
    no_transfer = []
    if world > 1 and cfg.impl == "ringattn":
        silent = _no_transfer_comm(None)
        no_transfer = [step(True, comm=silent) for _ in range(cfg.repeats)]
    with _peak_above_now(device) as peak:
        step(True)

    # The same transfers alone: P-1 K/V hops forward and backward, P dK/dV hops backward (one
    # at P = 2, where the owner keeps its own gradients: ringattn.ring._backward_leg).
    comm = ring_comm_cls(None)
    comm_alone = 0.0
    if world > 1:
        kv = (k, v)
        kv_in = (torch.empty_like(k), torch.empty_like(v))
        dkv = (torch.zeros(k.shape, device=device), torch.zeros(v.shape, device=device))
        dkv_in = (torch.empty_like(dkv[0]), torch.empty_like(dkv[1]))
        samples = []
        for _ in range(cfg.repeats):
            dist.barrier()
            _sync(torch, device)
            clock.start()
            for _ in range(2 * (world - 1)):
                comm.exchange(kv, kv_in).wait()
            for _ in range(1 if world == 2 else world):
                comm.exchange(dkv, dkv_in, tag=1).wait()
            samples.append(clock.stop())
        comm_alone = statistics.median(samples)
    return {
        "fwd_s": statistics.median(fwd),
        "fwd_bwd_s": statistics.median(fwd_bwd),
        "wait_s": statistics.median(waits),
        "no_transfer_s": statistics.median(no_transfer) if no_transfer else None,
        "comm_alone_s": comm_alone,
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


# ----------------------------------------------------------------------------- driver
def _guarded(run, args, label: str) -> dict:
    """One measurement, rerun while other jobs used more than the threshold; the least
    disturbed run is kept, with its outside load (cores) and whether it stayed disturbed."""
    from benchmarks.outside_load import OutsideLoad

    threshold = getattr(args, "load_threshold", LOAD_THRESHOLD_CORES)
    retries = getattr(args, "load_retries", LOAD_RETRIES)
    best = None
    for attempt in range(1 + retries):
        with OutsideLoad() as load:
            raw = run()
        reading = load.reading
        if best is None or (reading.outside_cores or 0.0) < (best[1].outside_cores or 0.0):
            best = (raw, reading)
        if not reading.disturbed(threshold):
            break
        more = "rerunning" if attempt < retries else "keeping the least disturbed run"
        print(f"# {label}: {reading.outside_cores:.2f} cores busy outside the benchmark; {more}",
              flush=True)  # fmt: skip
    raw, reading = best
    return {**raw, "outside_cores": reading.outside_cores,
            "disturbed": reading.disturbed(threshold)}  # fmt: skip


def _note_load(result: Result, raw: dict) -> Result:
    result.extra["outside_cores"] = raw.get("outside_cores")
    result.extra["disturbed"] = bool(raw.get("disturbed"))
    return result


def _peer_installed() -> bool:
    try:
        import ring_attention_pytorch  # noqa: F401
    except ImportError:
        return False
    return True


def _device_kind(choice: str) -> tuple[str, int]:
    """("cuda", GPUs) where asked for or (auto) where CUDA is there; else ("cpu", 0)."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if choice == "cuda" and not gpus:
        raise SystemExit("--device cuda: no CUDA device here")
    if choice == "cpu" or not gpus:
        return "cpu", 0
    return "cuda", gpus


def run_benchmark(args: argparse.Namespace) -> list[Result]:
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results: list[Result] = []
    causal_values = {"true": [True], "false": [False], "both": [False, True]}[args.causal]
    device_kind, gpus = _device_kind(args.device)
    print(f"# device: {device_kind}" + (f" ({gpus} GPU(s), NCCL)" if gpus else " (gloo)"),
          flush=True)  # fmt: skip
    peer = args.peer and _peer_installed() and device_kind == "cpu"
    if args.peer and not peer:
        print("ring-attention-pytorch is not installed: pip install -e '.[bench]'", flush=True)
    with tempfile.TemporaryDirectory() as tmpdir:
        for world in args.ranks:
            baseline_threads = args.baseline_threads or world * args.threads_per_rank
            if device_kind == "cuda" and world > gpus:
                print(f"# P={world}: skipped, {gpus} GPU(s) here", flush=True)
                continue
            ring = partial(RingPool, ctx, world, args.threads_per_rank, tmpdir, device_kind)
            for seq, causal in itertools.product(args.seq, causal_values):
                base = Config(
                    seq, args.heads, args.kv_heads or args.heads, args.head_dim, args.batch,
                    args.dtype, causal, "contiguous", args.repeats,
                )  # fmt: skip
                baseline = None
                if not args.no_baseline:  # first, so each ring row can show its ratio
                    sdpa = partial(SdpaProcess, ctx, baseline_threads, device_kind)
                    raw = _guarded(partial(fresh_run, sdpa, base), args, f"SDPA N={seq}")
                    baseline = _note_load(_sdpa_result(base, baseline_threads, raw), raw)
                    baseline.extra["for_ranks"] = world
                    results.append(baseline)
                    _print_row(baseline, None)
                runs = [replace(base, layout=layout) for layout in args.layouts]
                if peer and world > 1 and seq <= args.peer_max_seq:
                    runs.append(replace(base, impl="ring-attention-pytorch"))
                for cfg in runs:
                    if seq % (world * (2 if cfg.layout == "zigzag" else 1)):
                        continue
                    label = f"ring P={world} N={seq}"
                    raw = _guarded(partial(fresh_run, ring, cfg), args, label)
                    results.append(_note_load(_ring_result(cfg, world, args, raw), raw))
                    _print_row(results[-1], baseline)
    return results


def fresh_run(start, cfg: Config) -> dict:
    """One measurement in processes of its own (``start()`` makes them). The peak-memory step
    that ends a measurement fixes glibc's mmap threshold for the rest of a process's life, so
    every later large allocation there would be a fresh mmap, page-faulted afresh: a process
    that measured once would time the next configuration under another allocator."""
    procs = start()
    try:
        return procs.run(cfg)
    finally:
        procs.close()


def _ring_result(cfg: Config, world: int, args, raw: dict) -> Result:
    fwd_flops, fwd_bwd_flops = attention_flops(cfg)
    # Hidden share: 1 - (time the transfers added to the step) / (time they take alone).
    # What they added is the step's time minus the same ring's time with nothing sent.
    hidden = None
    if raw.get("no_transfer_s") and raw["comm_alone_s"] > 0:
        exposed = max(0.0, raw["fwd_bwd_s"] - raw["no_transfer_s"])
        hidden = max(0.0, min(1.0, 1.0 - exposed / raw["comm_alone_s"]))
    result = Result(
        cfg.impl, world, args.threads_per_rank, cfg, raw["fwd_s"], raw["fwd_bwd_s"],
        fwd_flops / raw["fwd_s"] / 1e9, fwd_bwd_flops / raw["fwd_bwd_s"] / 1e9,
        raw["peak_mib"], hidden, raw["comm_alone_s"], raw["wait_s"],
    )  # fmt: skip
    if raw.get("no_transfer_s"):
        result.extra["no_transfer_fwd_bwd_s"] = raw["no_transfer_s"]
    if args.predict and cfg.impl == "ringattn":
        result.extra.update(predict(cfg, world, args.predict))
    return result


def predict(cfg: Config, world: int, device_name: str) -> dict:
    """What `ringctl plan` predicts for this configuration on a calibrated device."""
    from ringctl.planner.cost import Workload, estimate, nominal_link
    from ringctl.planner.devices import get_device

    device = get_device(device_name)
    link = nominal_link(device)
    work = Workload(
        seq_len=cfg.seq, heads=cfg.heads, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
        batch=cfg.batch, dtype=cfg.dtype, causal=cfg.causal, layout=cfg.layout,
    )  # fmt: skip
    est = estimate(work, world, device, link, ranks_on_host=world)
    return {
        "predicted_fwd_s": est.total_s["forward"],
        "predicted_fwd_bwd_s": est.total_s["forward+backward"],
        "predicted_peak_mib": sum(est.memory_bytes.values()) / 2**20,
    }


def _sdpa_result(cfg: Config, threads: int, raw: dict) -> Result:
    fwd_flops, fwd_bwd_flops = attention_flops(cfg)
    return Result(
        "sdpa",
        1,
        threads,
        cfg,
        raw["fwd_s"],
        raw["fwd_bwd_s"],
        fwd_flops / raw["fwd_s"] / 1e9,
        fwd_bwd_flops / raw["fwd_bwd_s"] / 1e9,
        raw["peak_mib"],
    )


COLUMNS = [
    ("impl", "<22"), ("P", ">2"), ("thr", ">3"), ("N", ">6"), ("mask", "<6"), ("layout", "<10"),
    ("fwd ms", ">8"), ("f+b ms", ">9"), ("f+b GF/s", ">8"), ("peak MiB/rank", ">13"),
    ("hidden", ">6"), ("f+b vs SDPA", ">11"), ("predicted f+b ms", ">16"), ("outside", ">7"),
]  # fmt: skip


def _cells(r: Result, baseline: Result | None) -> list[str]:
    c = r.config
    if baseline is not None and r.impl != "sdpa":
        r.extra["fwd_bwd_over_sdpa"] = r.fwd_bwd_s / baseline.fwd_bwd_s
    pred = r.extra.get("predicted_fwd_bwd_s")
    return [
        r.impl, str(r.ranks), str(r.threads), str(c.seq), "causal" if c.causal else "full",
        "-" if r.impl == "sdpa" else c.layout, f"{1e3 * r.fwd_s:.1f}",
        f"{1e3 * r.fwd_bwd_s:.1f}", f"{r.fwd_bwd_gflops:.1f}", f"{r.peak_mem_mib:.1f}",
        "" if r.hidden_comm is None else f"{100 * r.hidden_comm:.0f}%",
        f"{r.extra['fwd_bwd_over_sdpa']:.2f}x" if "fwd_bwd_over_sdpa" in r.extra else "",
        "" if pred is None else f"{1e3 * pred:.1f} ({pred / r.fwd_bwd_s:.2f}x)",
        _load_cell(r),
    ]  # fmt: skip


def _load_cell(r: Result) -> str:
    """Other jobs' CPU use during the row's measurement, in cores; '!' when over threshold."""
    cores = r.extra.get("outside_cores")
    if cores is None:
        return ""
    return f"{cores:.2f}" + ("!" if r.extra.get("disturbed") else "")


def _print_header() -> None:
    print(" ".join(f"{name:{fmt}}" for name, fmt in COLUMNS), flush=True)


def _print_row(r: Result, baseline: Result | None) -> None:
    cells = _cells(r, baseline)
    print(
        " ".join(f"{cell:{fmt}}" for cell, (_, fmt) in zip(cells, COLUMNS, strict=True)), flush=True
    )


def write_markdown(results: list[Result], path: Path, argv: list[str]) -> None:
    lines = [
        "# Attention benchmark",
        "",
        f"`python -m benchmarks.attention {' '.join(argv)}` on {os.uname().nodename} "
        f"({os.cpu_count()} CPUs), {time.strftime('%Y-%m-%d')}. Medians; ring ranks and the "
        "single-process SDPA baseline share the same cores and run in turn.",
        "",
        "| " + " | ".join(name for name, _ in COLUMNS) + " |",
        "|" + "|".join("---" if fmt.startswith("<") else "---:" for _, fmt in COLUMNS) + "|",
    ]
    baseline = None
    for r in results:
        baseline = r if r.impl == "sdpa" else baseline
        lines.append("| " + " | ".join(_cells(r, baseline if r.impl != "sdpa" else None)) + " |")
    path.write_text("\n".join(lines) + "\n")


def write_plots(results: list[Result], prefix: Path) -> list[Path]:
    """Time and peak memory against N: one panel per ring size P, each with its SDPA baseline
    (the same cores), the peer where timed, and ringctl plan's prediction (dotted)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plots", flush=True)
        return []

    def panel_of(r: Result) -> int:
        return r.extra.get("for_ranks", r.threads) if r.impl == "sdpa" else r.ranks

    panels = sorted({panel_of(r) for r in results})
    written = []
    for attr, ylabel in (("fwd_bwd_s", "forward+backward time (s)"),
                         ("peak_mem_mib", "peak MiB per rank")):  # fmt: skip
        fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.5), squeeze=False)
        for ax, world in zip(axes[0], panels, strict=True):
            series: dict[str, list[Result]] = {}
            for r in (r for r in results if panel_of(r) == world):
                c = r.config
                label = f"{r.impl} {'causal' if c.causal else 'full'}"
                label += f" ({r.threads} threads)" if r.impl == "sdpa" else f" {c.layout}"
                series.setdefault(label, []).append(r)
            for label, rows in sorted(series.items()):
                rows = sorted(rows, key=lambda r: r.config.seq)
                xs = [r.config.seq for r in rows]
                style = "--" if rows[0].impl == "sdpa" else "-"
                (line,) = ax.plot(xs, [getattr(r, attr) for r in rows], style, marker="o",
                                  label=label)  # fmt: skip
                if attr == "fwd_bwd_s" and "predicted_fwd_bwd_s" in rows[0].extra:
                    ax.plot(xs, [r.extra["predicted_fwd_bwd_s"] for r in rows], ":",
                            marker="x", color=line.get_color())  # fmt: skip
            ax.set_title(f"P = {world} ranks" + (" (dotted: ringctl plan)" if world > 1 else ""))
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("total sequence length N")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        path = prefix.with_name(f"{prefix.name}-{attr.split('_s')[0].replace('_', '-')}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.attention",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 16384], help="total tokens N")
    p.add_argument("--ranks", type=int, nargs="+", default=[2], help="ring sizes P to sweep")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (no GQA)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--causal", default="both", choices=["true", "false", "both"])
    p.add_argument("--layouts", nargs="+", default=["zigzag"], choices=["contiguous", "zigzag"])
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed repetitions, median reported; 0: one step, for peak memory only",
    )
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"],
        help="auto: one GPU per rank with NCCL (and flash-attn where installed) when CUDA is "
        "here, P limited to the GPUs; else CPU ranks with gloo",
    )  # fmt: skip
    p.add_argument(
        "--baseline-threads",
        type=int,
        default=None,
        help="SDPA threads (default: P x threads-per-rank, the same cores)",
    )
    p.add_argument("--no-baseline", action="store_true", help="skip the SDPA comparison")
    p.add_argument(
        "--pairings",
        type=int,
        default=0,
        metavar="K",
        help="time SDPA and each engine's ring back to back K times, order rotating, and "
        "report the median of the K ring/SDPA ratios (benchmarks/pairing.py); forward+backward "
        "only",
    )
    p.add_argument(
        "--engine",
        nargs="+",
        default=None,
        metavar="CHECKOUT",
        help="with --pairings: checkouts whose ringattn to run, interleaved (default: this one)",
    )
    p.add_argument(
        "--load-threshold", type=float, default=LOAD_THRESHOLD_CORES, metavar="CORES",
        help="a measurement during which other processes used more CPU than this (cores) is "
        f"rerun, and flagged if it stays above (default {LOAD_THRESHOLD_CORES})",
    )  # fmt: skip
    p.add_argument(
        "--load-retries", type=int, default=LOAD_RETRIES,
        help=f"reruns of a disturbed measurement (default {LOAD_RETRIES})",
    )  # fmt: skip
    p.add_argument(
        "--peer-max-seq", type=int, default=4096,
        help="time the peer only up to this N (it is an order of magnitude slower)",
    )  # fmt: skip
    p.add_argument(
        "--peer",
        action="store_true",
        help="also time ring-attention-pytorch where installed (extra: bench)",
    )
    p.add_argument("--json", type=Path, default=DEFAULT_OUT, help=f"default: {DEFAULT_OUT}")
    p.add_argument(
        "--rerender", type=Path, metavar="JSON",
        help="measure nothing: rewrite a saved run's markdown and plots (and, with --predict, "
        "its predictions from the current model)",
    )  # fmt: skip
    p.add_argument(
        "--predict", metavar="DEVICE",
        help="add `ringctl plan`'s prediction from this (calibrated) device entry",
    )  # fmt: skip
    return p


def load_results(path: Path, predict_device: str | None) -> tuple[list[Result], list[str]]:
    """A saved run, its predictions recomputed with today's model when a device is given."""
    data = json.loads(path.read_text())
    results = []
    for row in data["results"]:
        row["config"] = Config(**row["config"])
        r = Result(**row)
        r.extra = {k: v for k, v in r.extra.items() if not k.startswith("predicted_")}
        if predict_device and r.impl == "ringattn":
            r.extra.update(predict(r.config, r.ranks, predict_device))
        results.append(r)
    return results, data.get("argv", [])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads_per_rank))
    if args.pairings:
        return _main_pairings(args, sys.argv[1:] if argv is None else argv)
    _print_header()
    if args.rerender:
        results, run_argv = load_results(args.rerender, args.predict)
        args.json = args.rerender
        for r in results:
            _print_row(r, None)
    else:
        results, run_argv = run_benchmark(args), sys.argv[1:] if argv is None else argv
    write_results(args.json, "attention", run_argv, results)
    markdown = args.json.with_suffix(".md")
    write_markdown(results, markdown, run_argv)
    plots = write_plots(results, args.json.with_suffix(""))
    print(f"wrote {args.json}, {markdown}" + "".join(f", {p}" for p in plots))
    return 0


def _main_pairings(args, run_argv: list[str]) -> int:
    from benchmarks import pairing

    if args.json == DEFAULT_OUT:
        args.json = DEFAULT_OUT.with_name("attention-pairings.json")
    rows = pairing.run_pairings(args)
    write_results(args.json, "attention-pairings", run_argv, rows)
    pairing.write_markdown(rows, args.json.with_suffix(".md"), run_argv)
    print(f"wrote {args.json}, {args.json.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
