"""Measure this machine as a device entry: block-kernel throughput and rank-to-rank transfers.

What the cost model needs from a device is first two rates: how fast one rank's block kernel
computes (forward and backward, at the block sizes a ring would use) and how fast a block moves
to the next rank; then, for the whole model, the matmul rate and the rate of elementwise work.
The first two are measured through the engine's public API: the block work is timed inside
``ring_attention`` running on a ``LocalRing`` (the same loop, kernel, merge and gradient
accumulation a real ring runs, each step's stretch timed by the ring), and the exchange with
the engine's own ``RingComm``, so the prediction and the run share their parts.
"""

from __future__ import annotations

import os
import socket
import statistics
import tempfile
import time
from datetime import timedelta

from .devices import BLOCK_KINDS, Device, block_flops
from .model import ModelShape, layer_elementwise_values

DEFAULT_SIZES = (256, 512, 1024, 2048, 4096)
# Head dims measured: the tiny test models' 16, SmolLM2's 64, Llama's 128; a job's own head
# dim is priced between the two around it.
DEFAULT_HEAD_DIMS = (16, 64, 128)


# Where each block kind's work is, in a LocalRing of 2 virtual ranks (record_steps=True):
# (ring, forward stretches, backward stretches) of every rank's loop, stretches being the
# compute between two waits. Forward: stretch 0 is step 0, stretch 1 is step 1 with its merge.
# Backward: stretch 0 is step 0 (kernel, dQ and dK/dV accumulation); step 1's kernel and dQ are
# stretch 1 and its dK/dV accumulation stretch 2 (the wait for the arriving accumulator sits
# between them).
_KIND_STRETCHES = {
    "full": ("full", (1,), (0,)),
    "diag": ("causal", (0,), (0,)),
    "half": ("causal", (1,), (1, 2)),
}
_RINGS = {"full": (False, "contiguous"), "causal": (True, "zigzag")}


def _time_kinds(n, heads, head_dim, dtype, repeats, barrier):
    """{kind: [forward, backward] median seconds} of one ring step of n tokens per rank, as
    the engine's own loop does it: ring_attention on a LocalRing of two virtual ranks."""
    import torch

    from ringattn import LocalRing, ring_attention  # LocalRing: an export ringattn must add

    samples = {kind: ([], []) for kind in _KIND_STRETCHES}
    for ring_name, (causal, layout) in _RINGS.items():
        ring = LocalRing(2, record_steps=True)
        q = torch.randn(1, 2 * n, heads, head_dim, dtype=dtype)
        k, v, dout = torch.randn_like(q), torch.randn_like(q), torch.randn_like(q)
        for i in range(repeats + 1):  # the first round warms up
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            barrier.wait()
            out = ring_attention(qq, kk, vv, causal=causal, layout=layout, comm=ring)
            fwd = ring.step_seconds()
            barrier.wait()
            out.backward(dout)
            bwd = ring.step_seconds()
            if not i:
                continue
            for kind, (name, f_idx, b_idx) in _KIND_STRETCHES.items():
                if name == ring_name:
                    for rank in range(2):
                        samples[kind][0].append(sum(fwd[rank][j] for j in f_idx))
                        samples[kind][1].append(sum(bwd[rank][j] for j in b_idx))
    return {kind: [statistics.median(f), statistics.median(b)] for kind, (f, b) in samples.items()}


def _block_worker(index, sizes, heads, head_dims, dtype_name, threads, repeats, barrier, out):
    """Time each block kind as a ring step does it (kernel + merge forward, kernel + gradient
    accumulation backward), at each head dim, while every core runs one of these in step with
    it: caches and memory bandwidth are shared as they are under a ring."""
    import json

    import torch

    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    result: dict[int, dict[str, dict[int, list[float]]]] = {}
    for head_dim in head_dims:
        result[head_dim] = {kind: {} for kind in BLOCK_KINDS}
        for n in sizes:
            for kind, times in _time_kinds(n, heads, head_dim, dtype, repeats, barrier).items():
                result[head_dim][kind][n] = times
    with open(out, "w") as f:
        json.dump({"index": index, "result": result}, f)


def _matmul_worker(index, widths, dtype_name, threads, repeats, barrier, out):
    """Seconds of a projection-shaped matmul (MM_VALUES / w tokens x w -> w) at each width w
    of MATMUL_WIDTHS while every core runs the same in step with it: the rate of the model's
    projections, MLP and output head by the width they sum over. Each output is a fresh tensor
    kept until the round ends, as a layer keeps its projections for the ops after them: on a
    CPU the fresh pages cost a 64-wide projection half its rate (timed with the output memory
    reused, 64 wide ran at twice the rate a long-document job's projections reach)."""
    import json

    import torch

    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    result = {}
    for width in widths:
        x = torch.randn(MM_VALUES // width, width, dtype=dtype)
        w = torch.randn(width, width, dtype=dtype)
        seconds = []
        for i in range(repeats + 1):  # the first round warms up
            barrier.wait()
            t0 = time.perf_counter()
            outputs = [torch.mm(x, w) for _ in range(4)]
            if i:
                seconds.append((time.perf_counter() - t0) / 4)
            del outputs
        result[width] = statistics.median(seconds)
    with open(out, "w") as f:
        json.dump(result, f)


# Widths of the calibrated matmuls (the tiny test models' 64 to a 7B model's 4096 is priced
# from the nearest), each on MM_VALUES input values (64 MiB of float32, beyond the caches, as a
# long document's activations are: 16k tokens at 1024).
MATMUL_WIDTHS = (64, 128, 256, 512, 1024, 2048)
MM_VALUES = 1 << 24


def _elementwise_worker(index, dtype_name, threads, repeats, barrier, out):
    """Seconds of one Llama layer's elementwise ops on EW_TOKENS tokens of EW_SHAPE (two
    RMSNorms, RoPE on q and k, the gated activation, two residual additions: _layer_ops) while
    every core runs them in step: broadcasts, strided halves and fresh outputs as a layer has
    them (a plain product of two vectors runs about twice as fast as these)."""
    import torch

    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    m, t, d = EW_SHAPE, EW_TOKENS, EW_SHAPE.head_dim
    tensors = dict(
        x=torch.randn(t, m.hidden, dtype=dtype),
        weight=torch.randn(m.hidden, dtype=dtype),
        q=torch.randn(1, m.heads, t, d, dtype=dtype),
        k=torch.randn(1, m.kv_heads, t, d, dtype=dtype),
        cos=torch.randn(1, 1, t, d, dtype=dtype),
        sin=torch.randn(1, 1, t, d, dtype=dtype),
        gate=torch.randn(t, m.inter, dtype=dtype),
        up=torch.randn(t, m.inter, dtype=dtype),
    )
    seconds = []
    for i in range(repeats + 1):  # the first round warms up
        barrier.wait()
        t0 = time.perf_counter()
        _layer_ops(**tensors)
        if i:
            seconds.append(time.perf_counter() - t0)
    with open(out, "w") as f:
        f.write(str(statistics.median(seconds)))


def _layer_ops(x, weight, q, k, cos, sin, gate, up) -> None:
    """The elementwise ops of one Llama layer, as transformers writes them (model.py's
    layer_elementwise_values counts their outputs)."""
    import torch

    def norm(h):
        return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))

    def rope(t):
        half = t.shape[-1] // 2
        return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin

    h = x + norm(x)
    rope(q)
    rope(k)
    h = h + norm(h)
    torch.nn.functional.silu(gate) * up


# A small layer (the CPU jobs' models are small) at 128k tokens: 64 MiB per hidden-sized
# float32 tensor, beyond the allocator's reuse threshold as a long shard's tensors are.
EW_SHAPE = ModelShape(layers=1, hidden=128, intermediate=256, heads=2, kv_heads=1, head_dim=64)
EW_TOKENS = 128 << 10


def measure_elementwise_gbytes(dtype: str, threads: int, repeats: int, workers: int) -> float:
    """GB/s of a layer's elementwise outputs (layer_elementwise_values) one rank writes with
    every core busy (the slowest)."""
    import torch

    texts = _on_every_core(_elementwise_worker, (dtype, threads, repeats), workers)
    seconds = max(float(t) for t in texts)
    m = EW_SHAPE
    values = EW_TOKENS * layer_elementwise_values(m, m.heads, m.kv_heads, m.head_dim)
    return values * getattr(torch, dtype).itemsize / seconds / 1e9


# What every calibration process imports: a forkserver (Linux) loads it once and forks the
# workers from there, instead of each new interpreter importing torch again (2-3 s of CPU a
# process, 14 processes a calibration on 2 cores).
_PRELOAD = ["torch", "torch.distributed", "ringattn", __name__]


def _start_method() -> str:
    """'forkserver' with torch preloaded where the platform has it, else 'spawn'. Not 'fork':
    the calling process may hold threads (an OpenMP pool, gloo's) that a fork would copy
    half-way."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    return "forkserver"


def _on_every_core(target, args: tuple, workers: int) -> list[str]:
    """Run ``target(index, *args, barrier, out)`` in ``workers`` processes at once (new
    processes, kept in step by the barrier); what each wrote to its ``out`` file, in order."""
    import torch.multiprocessing as mp

    ctx = mp.get_context(_start_method())
    barrier = ctx.Barrier(workers)
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"w{i}.out") for i in range(workers)]
        procs = [
            ctx.Process(target=target, args=(i, *args, barrier, outs[i])) for i in range(workers)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise RuntimeError("a calibration worker failed")
        return [open(o).read() for o in outs]


def measure_blocks(sizes, heads, head_dims, dtype, threads, repeats, workers):
    """Per head dim, block kind and size: (forward, backward) seconds, the slower of the
    workers."""
    import json

    args = (sizes, heads, head_dims, dtype, threads, repeats)
    texts = _on_every_core(_block_worker, args, workers)
    per_worker = [json.loads(text)["result"] for text in texts]
    return {
        int(d): {
            kind: {
                int(n): tuple(max(w[d][kind][n][i] for w in per_worker) for i in (0, 1))
                for n in per_worker[0][d][kind]
            }
            for kind in BLOCK_KINDS
        }
        for d in per_worker[0]
    }


def measure_matmul_tflops(widths, dtype: str, threads: int, repeats: int, workers: int) -> dict:
    """TFLOP/s of one rank's projection-shaped matmul by width, with every core busy (the
    slowest worker's)."""
    import json

    args = (tuple(widths), dtype, threads, repeats)
    per_worker = [json.loads(t) for t in _on_every_core(_matmul_worker, args, workers)]
    return {
        int(w): 2 * MM_VALUES * int(w) / max(r[w] for r in per_worker) / 1e12 for w in per_worker[0]
    }


def _p2p_rank(rank: int, init: str, nbytes: int, repeats: int, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from ringattn import RingComm  # an export ringattn must add

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=120)
    )
    comm = RingComm(None)
    big = torch.zeros(nbytes // 4)
    big_in = torch.empty_like(big)
    small, small_in = torch.zeros(1), torch.zeros(1)
    comm.exchange([big], [big_in]).wait()
    lat, bw = [], []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(10):
            comm.exchange([small], [small_in]).wait()
        lat.append((time.perf_counter() - t0) / 10)
        dist.barrier()
        t0 = time.perf_counter()
        comm.exchange([big], [big_in]).wait()
        bw.append(time.perf_counter() - t0)
    if rank == 0:
        latency = statistics.median(lat)
        seconds = statistics.median(bw) - latency
        with open(out_path, "w") as f:
            f.write(f"{nbytes / seconds / 1e9} {latency}")
    dist.destroy_process_group()


def measure_p2p(nbytes: int = 32 << 20, repeats: int = 5) -> tuple[float, float]:
    """(GB/s, latency s) of one ring exchange between two local gloo ranks."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "p2p.txt")
        mp.start_processes(
            _p2p_rank,
            args=(f"file://{tmp}/store", nbytes, repeats, out),
            nprocs=2,
            start_method=_start_method(),
        )
        gbytes, latency = open(out).read().split()
    return float(gbytes), float(latency)


def _overhead_rank(rank, world, init, repeats, out_path):
    import torch
    import torch.distributed as dist

    from ringattn import ring_attention

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    q = torch.randn(1, 64, 8, 64)
    fwd, bwd = [], []
    for i in range(repeats + 2):
        qq, kk, vv = (q.clone().requires_grad_() for _ in range(3))
        dist.barrier()
        t0 = time.perf_counter()
        out = ring_attention(qq, kk, vv, causal=True, layout="zigzag")
        t1 = time.perf_counter()
        out.backward(out)
        t2 = time.perf_counter()
        if i >= 2:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    if rank == 0:
        with open(out_path, "w") as f:
            f.write(f"{statistics.median(fwd) / world} {statistics.median(bwd) / world}")
    dist.destroy_process_group()


def measure_step_overhead(world: int, repeats: int = 10) -> tuple[float, float]:
    """(forward, backward) seconds per ring step that do not depend on the block: the
    rank-agreement check, posting and waiting on transfers, merging, and -- when ranks
    outnumber cores -- waiting for a peer to be scheduled. Measured on 64-token blocks."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "overhead.txt")
        mp.start_processes(
            _overhead_rank,
            args=(world, f"file://{tmp}/store", repeats, out),
            nprocs=world,
            start_method=_start_method(),
        )
        fwd, bwd = open(out).read().split()
    return float(fwd), float(bwd)


def _host_mem_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024**2
    return 0.0


def calibrate(
    *,
    name: str | None = None,
    sizes=DEFAULT_SIZES,
    heads: int = 8,
    head_dims=DEFAULT_HEAD_DIMS,
    dtype: str = "float32",
    threads_per_rank: int = 1,
    repeats: int = 3,
    matmul_widths=MATMUL_WIDTHS,
    log=print,
) -> Device:
    """This machine as a device entry: block tables by head dim, the matmul rate by width (the
    fastest as its ``tflops``, at efficiency 1: measured rates, not a datasheet peak), the
    elementwise rate, the exchange and the fixed cost per ring step."""
    name = name or f"cpu-{socket.gethostname().split('.')[0]}"
    cores = os.cpu_count() or 1
    workers = max(1, cores // threads_per_rank)
    log(
        f"calibrating {name}: ring-step block work on {workers} concurrent rank(s) x "
        f"{threads_per_rank} thread(s), {heads} heads x {list(head_dims)}, {dtype}, "
        f"n = {list(sizes)}"
    )
    blocks = measure_blocks(sizes, heads, head_dims, dtype, threads_per_rank, repeats, workers)
    _log_blocks(blocks, heads, log)
    by_width = measure_matmul_tflops(matmul_widths, dtype, threads_per_rank, repeats, workers)
    rates = ", ".join(f"{w}: {1e3 * t:.1f}" for w, t in by_width.items())
    log(f"  projection matmuls by width, GFLOP/s: {rates}")
    elementwise = measure_elementwise_gbytes(dtype, threads_per_rank, repeats, workers)
    log(f"  a layer's elementwise ops (norms, RoPE, activation): {elementwise:.2f} GB/s written")
    gbytes, latency = measure_p2p()
    log(f"  rank-to-rank exchange: {gbytes:.2f} GB/s, latency {1e6 * latency:.0f} us")
    overhead = {}
    for world in sorted({2, 2 * workers}):
        overhead[world] = measure_step_overhead(world)
        fwd, bwd = overhead[world]
        log(
            f"  fixed cost per ring step, {world} ranks: "
            f"{1e3 * fwd:.2f} ms fwd, {1e3 * bwd:.2f} ms bwd"
        )
    return Device(
        name=name,
        mem_gib=round(_host_mem_gib(), 1),
        tflops={dtype: max(by_width.values())},
        matmul_efficiency=1.0,
        reserve_gib=1.0,
        source=f"measured by ringctl plan --calibrate on {time.strftime('%Y-%m-%d')}",
        block_seconds=blocks,
        calib_heads=heads,
        cores=cores,
        threads_per_rank=threads_per_rank,
        p2p_gbytes_s=gbytes,
        p2p_latency_s=latency,
        step_overhead_s=overhead,
        elementwise_gbytes_s=elementwise,
        matmul_tflops_by_width=by_width,
    )


def _log_blocks(blocks, heads: int, log) -> None:
    for head_dim, table in blocks.items():
        for n in sorted(next(iter(table.values()))):
            cells = []
            for kind in BLOCK_KINDS:
                fwd, bwd = table[kind][n]
                gflops = block_flops(kind, n, batch=1, heads=heads, head_dim=head_dim) / 1e9
                cells.append(f"{kind} {gflops / fwd:6.1f}/{2.5 * gflops / bwd:6.1f}")
            log(f"  d={head_dim:>3} n={n:>5}: GFLOP/s fwd/bwd  " + "   ".join(cells))
