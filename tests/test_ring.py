"""Ring attention on P = 1..4 real gloo processes against float64 full attention.

Every ring of two or more ranks runs on both transports (shared memory, gloo).

Tolerances (tests/attention_reference.py says why, for every engine test): float32 within
FP32_TOL = 2e-5 of the largest reference value, the sink gradient (each rank's share, summed)
included; bfloat16 within twice PyTorch's own bf16 SDPA error on the same inputs plus one bf16
ulp (2**-8).
"""

from __future__ import annotations

import pytest

import ringattn
from tests.attention_reference import Case, compare, failures, ring_outputs
from tests.distributed import run_distributed


def _cases(world: int) -> list[Case]:
    # Sequence lengths are multiples of 2P (zigzag) but not powers of two.
    n = 2 * world * (7 if world != 3 else 5)
    cases = []
    for causal in (False, True):
        for layout in ("contiguous", "zigzag"):
            cases += [
                Case(2, n, 8, 2, 64, "float32", causal, layout, seed=1),  # GQA, batch > 1
                Case(1, n, 4, 1, 32, "float32", causal, layout, seed=2),  # MQA
                Case(1, 3 * n, 4, 4, 128, "float32", causal, layout, seed=3),  # MHA, d=128
                Case(2, n, 8, 2, 64, "bfloat16", causal, layout, seed=4),
            ]
    # Attention sinks (gpt-oss): the gradient of the sinks is each rank's share, summed here.
    cases += [
        Case(2, n, 8, 2, 64, "float32", True, "zigzag", seed=5, sinks=True),
        Case(1, n, 4, 1, 32, "float32", False, "contiguous", seed=6, sinks=True),
    ]
    return cases


# Every ring on both transports: shared memory (the default for ranks on one host) and gloo's
# point-to-point (ranks on different hosts); one rank has no transfers.
RINGS = [(1, "gloo"), *((p, t) for p in (2, 3, 4) for t in ("shm", "gloo"))]


@pytest.fixture(scope="module", params=RINGS, ids=lambda p: f"P{p[0]}-{p[1]}")
def ring_results(request):
    world, transport = request.param
    cases = _cases(world)
    per_rank = run_distributed(ring_outputs, world, cases, transport=transport)
    return world, cases, per_rank


def test_ring_matches_float64_reference(ring_results):
    world, cases, per_rank = ring_results
    found = []
    worst = 0.0
    for case in cases:
        got = {
            name: ringattn.unshard_sequence(
                [r[case.id][name] for r in per_rank], layout=case.layout
            )
            for name in ("out", "dq", "dk", "dv")
        }
        if case.sinks:
            got["dsinks"] = sum(r[case.id]["dsinks"] for r in per_rank)
        compared = compare(case, got)
        if case.dtype == "float32":
            worst = max(worst, *(err for name, (err, _) in compared.items() if name != "dsinks"))
        found += failures(f"P={world}", case, compared)
    assert not found, "\n".join(found)
    print(f"P={world}: worst float32 relative error {worst:.2e}")
