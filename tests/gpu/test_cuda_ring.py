"""The ring's CUDA path: LocalRing on one GPU for P = 2, 3, 4, 8 and a P = 1 ring under NCCL.

Same tolerances as the CPU ring tests (tests/attention_reference.py says why): float32 within
FP32_TOL = 2e-5 of the largest reference value; bf16 within twice PyTorch's own SDPA error on
the same inputs (here SDPA on the GPU) plus one bf16 ulp. The loop must not synchronise with
the host: the LocalRing is run once more with torch's sync debug mode set to raise on any
synchronising call.
"""

from __future__ import annotations

import pytest
import torch

import ringattn
from ringattn.local_ring import LocalRing
from tests.attention_reference import Case, compare, failures, local_ring_outputs, ring_outputs
from tests.distributed import run_distributed


def _failures(case: Case, got: dict, world: int) -> list[str]:
    return failures(f"P={world}", case, compare(case, got, device="cuda"))


@pytest.mark.parametrize("world", [2, 4], ids=lambda p: f"P{p}")
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_windowed_local_ring_on_cuda_matches_float64(world, layout):
    """Sliding windows on the GPU: the banded kernel's boundary blocks beside the fused kernel's
    plain and diagonal ones (windows inside a half-chunk, across blocks, and in bf16)."""
    n = 2 * world * 75
    cases = [
        Case(1, n, 4, 1, 64, "float32", True, layout, seed=44, window=w)
        for w in (2, 37, 200, n - 1)
    ] + [Case(1, n, 8, 2, 128, "bfloat16", True, layout, seed=45, window=100)]
    found = []
    for case in cases:
        found += _failures(case, local_ring_outputs(case, world, device="cuda"), world)
    assert not found, "\n".join(found)


@pytest.mark.parametrize("world", [2, 3, 4, 8], ids=lambda p: f"P{p}")
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_local_ring_on_cuda_matches_float64(world, layout, causal):
    n = 2 * world * 75  # 150 tokens per rank: not a multiple of 128
    cases = [
        Case(1, n, 8, 2, 128, "bfloat16", causal, layout, seed=41),
        Case(2, n, 4, 1, 64, "float32", causal, layout, seed=42),
        Case(1, n, 8, 2, 64, "float32", causal, layout, seed=43, sinks=True),
    ]
    found = []
    for case in cases:
        found += _failures(case, local_ring_outputs(case, world, device="cuda"), world)
    assert not found, "\n".join(found)


def _sync_free_step(comm_factory) -> None:
    """Forward and backward of a bf16 GQA ring with sinks, the second under sync debug mode."""
    q = torch.randn(1, 8 * 256, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8 * 256, 2, 128, device="cuda", dtype=torch.bfloat16)
    v, dout = torch.randn_like(k), torch.randn_like(q)
    sinks = torch.zeros(8, device="cuda", requires_grad=True)

    def run():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out = ringattn.ring_attention(
            qq, kk, vv, causal=True, layout="zigzag", comm=comm_factory(), sinks=sinks
        )
        out.backward(dout)

    run()  # warm-up: kernel probes, allocator
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_local_ring_loop_never_synchronises_with_the_host():
    _sync_free_step(lambda: LocalRing(8))


def _nccl_ring(rank: int, world: int, cases: list[Case]):
    _sync_free_step(lambda: None)  # the process group's ring (P = 1 here)
    results = ring_outputs(rank, world, cases, device="cuda")
    return {cid: {n: t.cpu() for n, t in r.items()} for cid, r in results.items()}


def test_one_rank_ring_under_nccl_matches_float64():
    cases = [
        Case(1, 300, 8, 2, 128, "bfloat16", True, "zigzag", seed=44),
        Case(2, 300, 4, 4, 64, "float32", False, "contiguous", seed=45, sinks=True),
    ]
    (per_rank,) = run_distributed(_nccl_ring, 1, cases, backend="nccl")
    found = []
    for case in cases:
        found += _failures(case, per_rank[case.id], 1)
    assert not found, "\n".join(found)
