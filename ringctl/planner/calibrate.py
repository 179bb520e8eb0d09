"""Measure this machine as a device entry: block-kernel throughput and rank-to-rank transfers.

What the cost model needs from a device is exactly two rates: how fast one rank's block kernel
computes (forward and backward, at the block sizes a ring would use) and how fast a block moves
to the next rank. Both are measured here with the engine's own kernel and the engine's own
ring exchange, so the prediction and the run share their parts.
"""

from __future__ import annotations

import os
import socket
import statistics
import tempfile
import time
from datetime import timedelta

from .devices import BLOCK_KINDS, Device, block_flops

DEFAULT_SIZES = (256, 512, 1024, 2048, 4096)


def _time_block(q_share, kv_share, causal, n, heads, head_dim, dtype, repeats, barrier):
    """(forward, backward) median seconds of one block as a ring step does it."""
    import torch

    from ringattn.kernels import select_kernel
    from ringattn.ring import _merge

    q = torch.randn(1, int(n * q_share), heads, head_dim, dtype=dtype)
    k = torch.randn(1, int(n * kv_share), heads, head_dim, dtype=dtype)
    v, dout = torch.randn_like(k), torch.randn_like(q)
    kernel, scale = select_kernel(q), head_dim**-0.5
    acc_out, acc_lse = kernel.forward(q, k, v, scale=scale, causal=causal)
    acc_out = acc_out.float()
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    fwd, bwd = [], []
    for i in range(repeats + 1):  # the first round warms up
        barrier.wait()
        t0 = time.perf_counter()
        out, lse = kernel.forward(q, k, v, scale=scale, causal=causal)
        _merge(acc_out, acc_lse.clone(), out, lse)
        t1 = time.perf_counter()
        barrier.wait()
        t2 = time.perf_counter()
        gq, gk, gv = kernel.backward(dout, q, k, v, out, lse, scale=scale, causal=causal)
        dq.add_(gq), dk.add_(gk), dv.add_(gv)
        t3 = time.perf_counter()
        if i:
            fwd.append(t1 - t0)
            bwd.append(t3 - t2)
    return [statistics.median(fwd), statistics.median(bwd)]


def _block_worker(index, sizes, heads, head_dim, dtype_name, threads, repeats, barrier, out):
    """Time each block kind as a ring step does it (kernel + merge forward, kernel + gradient
    accumulation backward) while every core runs one of these in step with it: caches and
    memory bandwidth are shared as they are under a ring."""
    import json

    import torch

    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    result: dict[str, dict[int, list[float]]] = {kind: {} for kind in BLOCK_KINDS}
    for n in sizes:
        for kind, (q_share, kv_share, causal) in BLOCK_KINDS.items():
            result[kind][n] = _time_block(
                q_share, kv_share, causal, n, heads, head_dim, dtype, repeats, barrier
            )
    with open(out, "w") as f:
        json.dump({"index": index, "result": result}, f)


def measure_blocks(sizes, heads, head_dim, dtype, threads, repeats, workers):
    """Per block kind and size: (forward, backward) seconds, the slower of the workers."""
    import json

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(workers)
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"w{i}.json") for i in range(workers)]
        procs = [
            ctx.Process(
                target=_block_worker,
                args=(i, sizes, heads, head_dim, dtype, threads, repeats, barrier, outs[i]),
            )
            for i in range(workers)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise RuntimeError("a calibration worker failed")
        per_worker = [json.load(open(o))["result"] for o in outs]
    return {
        kind: {
            int(n): tuple(max(w[kind][n][i] for w in per_worker) for i in (0, 1))
            for n in per_worker[0][kind]
        }
        for kind in BLOCK_KINDS
    }


def _p2p_rank(rank: int, init: str, nbytes: int, repeats: int, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from ringattn.comm import RingComm

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
            _p2p_rank, args=(f"file://{tmp}/store", nbytes, repeats, out), nprocs=2,
            start_method="spawn",
        )  # fmt: skip
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
            _overhead_rank, args=(world, f"file://{tmp}/store", repeats, out), nprocs=world,
            start_method="spawn",
        )  # fmt: skip
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
    head_dim: int = 64,
    dtype: str = "float32",
    threads_per_rank: int = 1,
    repeats: int = 3,
    log=print,
) -> Device:
    name = name or f"cpu-{socket.gethostname().split('.')[0]}"
    cores = os.cpu_count() or 1
    workers = max(1, cores // threads_per_rank)
    log(
        f"calibrating {name}: ring-step block work on {workers} concurrent rank(s) x "
        f"{threads_per_rank} thread(s), {heads} heads x {head_dim}, {dtype}, n = {list(sizes)}"
    )
    blocks = measure_blocks(sizes, heads, head_dim, dtype, threads_per_rank, repeats, workers)
    for n in sizes:
        cells = []
        for kind in BLOCK_KINDS:
            fwd, bwd = blocks[kind][n]
            gflops = block_flops(kind, n, batch=1, heads=heads, head_dim=head_dim) / 1e9
            cells.append(f"{kind} {gflops / fwd:6.1f}/{2.5 * gflops / bwd:6.1f}")
        log(f"  n={n:>6}: GFLOP/s fwd/bwd  " + "   ".join(cells))
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
        tflops={},
        reserve_gib=1.0,
        source=f"measured by ringctl plan --calibrate on {time.strftime('%Y-%m-%d')}",
        block_seconds=blocks,
        calib_shape=(1, heads, head_dim),
        cores=cores,
        threads_per_rank=threads_per_rank,
        p2p_gbytes_s=gbytes,
        p2p_latency_s=latency,
        step_overhead_s=overhead,
    )
