"""Ring attention on P = 1..4 real gloo processes against float64 full attention.

Every ring of two or more ranks runs on both transports (shared memory, gloo).

Tolerances. float32: the ring adds one rescaling per step to what a single kernel does, so it
should agree with the float64 reference about as well as float32 attention itself does: a few
ulps times sqrt(sequence length) in the worst element, well under 2e-5 relative to the largest
value at these sizes (observed: ~1e-6). bfloat16: the inputs are the same bf16 tensors for
both, so the reference is exact for them; the ring must then be no worse than PyTorch's own
bf16 attention (SDPA, one process) on the same inputs, within a factor 2 plus one bf16 ulp
(2**-8 relative), since its per-step outputs are merged in float32 but each block kernel and
the final output round to bf16.
"""

from __future__ import annotations

import pytest

import ringattn
from tests.attention_reference import (
    Case,
    make_inputs,
    reference,
    relative_error,
    ring_outputs,
    sdpa_bf16_error,
)
from tests.distributed import run_distributed

FP32_TOL = 2e-5
BF16_ULP = 2.0**-8


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
    failures = []
    worst = 0.0
    for case in cases:
        inputs = make_inputs(case)
        ref = reference(inputs, case.causal)
        tol = {n: FP32_TOL for n in ref}
        if case.dtype == "bfloat16":
            sdpa = sdpa_bf16_error(case, inputs, ref)
            tol = {n: 2 * sdpa[n] + BF16_ULP for n in ref}
        for name in ("out", "dq", "dk", "dv"):
            got = ringattn.unshard_sequence(
                [r[case.id][name] for r in per_rank], layout=case.layout
            )
            assert got.dtype == case.torch_dtype
            err = relative_error(got, ref[name])
            if case.dtype == "float32":
                worst = max(worst, err)
            if not err <= tol[name]:
                failures.append(f"P={world} {case.id} {name}: error {err:.2e} > {tol[name]:.2e}")
        if case.sinks:
            got = sum(r[case.id]["dsinks"] for r in per_rank)
            err = relative_error(got, ref["dsinks"])
            if not err <= FP32_TOL:
                failures.append(f"P={world} {case.id} dsinks: error {err:.2e} > {FP32_TOL:.2e}")
    assert not failures, "\n".join(failures)
    print(f"P={world}: worst float32 relative error {worst:.2e}")
