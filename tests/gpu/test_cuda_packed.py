"""Packed sequences on the GPU: LocalRing of 2 and 4 virtual ranks, against each document alone
in float64 (tests/test_packed.py's check and bounds; bf16 against SDPA on the GPU with the
document mask): torch's fused CUDA kernels on every piece, long windows as unmasked pieces
(reversed blocks), short ones on the banded kernel, sinks, GQA."""

from __future__ import annotations

import pytest

from tests.attention_reference import packed_local_ring_outputs
from tests.test_packed import MIXED, _case, check

CASES = [
    _case(MIXED, dtype="float32", heads=8, kv=2, dim=64, seed=1),
    _case(MIXED, dtype="bfloat16", heads=8, kv=2, dim=64, seed=2),
    _case(MIXED, dtype="float32", causal=False, layout="contiguous", dim=64, seed=3),
    _case(MIXED, dtype="float32", window=5, sinks=True, dim=64, seed=4),
    _case((300, 1, 700, 24), dtype="bfloat16", window=260, dim=128, seed=5),
    _case((300, 1, 700, 24), dtype="float32", window=260, heads=4, kv=1, dim=64, seed=6),
]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_packed_local_ring_on_cuda(world, case):
    check(case, packed_local_ring_outputs(case, world, device="cuda"), device="cuda")
