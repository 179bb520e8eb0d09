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

from .devices import Device

DEFAULT_SIZES = (1024, 2048, 4096, 8192)


def _kernel_rates(
    sizes, heads, head_dim, dtype_name, threads, repeats
) -> dict[int, tuple[float, float]]:
    import torch

    from ringattn.kernels import select_kernel

    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    rates = {}
    for n in sizes:
        q = torch.randn(1, n, heads, head_dim, dtype=dtype)
        k, v = torch.randn_like(q), torch.randn_like(q)
        kernel = select_kernel(q)
        scale = head_dim**-0.5
        out, lse = kernel.forward(q, k, v, scale=scale, causal=False)
        kernel.backward(out, q, k, v, out, lse, scale=scale, causal=False)  # warm-up
        fwd, bwd = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out, lse = kernel.forward(q, k, v, scale=scale, causal=False)
            t1 = time.perf_counter()
            kernel.backward(out, q, k, v, out, lse, scale=scale, causal=False)
            t2 = time.perf_counter()
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
        flops = 4.0 * n * n * heads * head_dim
        rates[n] = (
            flops / statistics.median(fwd) / 1e9,
            2.5 * flops / statistics.median(bwd) / 1e9,
        )
    return rates


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
    log(f"calibrating {name}: block kernel, {threads_per_rank} thread(s), sizes {list(sizes)}")
    rates = _kernel_rates(sizes, heads, head_dim, dtype, threads_per_rank, repeats)
    for n, (f, b) in rates.items():
        log(f"  n={n:>6}: forward {f:7.2f} GFLOP/s, backward {b:7.2f} GFLOP/s")
    gbytes, latency = measure_p2p()
    log(f"  rank-to-rank exchange: {gbytes:.2f} GB/s, latency {1e6 * latency:.0f} us")
    return Device(
        name=name,
        mem_gib=round(_host_mem_gib(), 1),
        tflops={},
        reserve_gib=1.0,
        source=f"measured by ringctl plan --calibrate on {time.strftime('%Y-%m-%d')}",
        measured_gflops=rates,
        cores=os.cpu_count(),
        threads_per_rank=threads_per_rank,
        p2p_gbytes_s=gbytes,
        p2p_latency_s=latency,
    )
