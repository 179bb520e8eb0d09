"""The LocalRing (P virtual ranks in one process) against float64 full attention, on the CPU.

The LocalRing runs the same ring loops, kernels, merge and backward as the gloo ring of
tests/test_ring.py, so it is held to the same tolerances (tests/attention_reference.py says
why): float32 within FP32_TOL = 2e-5 of the largest reference value, the sink gradient
included; bfloat16 within twice PyTorch's own SDPA error on the same inputs plus one bf16 ulp,
with sinks the SDPA bound of the same inputs without sinks, and the bf16 sink gradient not
compared.
"""

from __future__ import annotations

import pytest
import torch

import ringattn
from ringattn.local_ring import LocalRing
from tests.attention_reference import (
    FP32_TOL,
    Case,
    compare,
    failures,
    local_ring_outputs,
    make_inputs,
    reference,
    relative_error,
    ring_outputs,
)
from tests.distributed import run_distributed


def _check(case: Case, world: int) -> list[str]:
    return failures(f"P={world}", case, compare(case, local_ring_outputs(case, world)))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8], ids=lambda p: f"P{p}")
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_local_ring_matches_float64_reference(world, layout, causal):
    n = 2 * world * (5 if world != 3 else 7)  # multiples of 2P, not powers of two
    cases = [
        Case(2, n, 8, 2, 32, "float32", causal, layout, seed=21),  # GQA, batch > 1
        Case(1, n, 4, 1, 64, "float32", causal, layout, seed=22),  # MQA
        Case(1, n, 4, 2, 32, "bfloat16", causal, layout, seed=23),
    ]
    found = [f for case in cases for f in _check(case, world)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("world", [1, 2, 3, 4], ids=lambda p: f"P{p}")
@pytest.mark.parametrize(
    "layout,causal", [("zigzag", True), ("contiguous", True), ("contiguous", False)]
)
def test_local_ring_with_sinks_matches_float64_reference(world, layout, causal):
    n = 2 * world * 6
    cases = [
        Case(2, n, 8, 2, 32, "float32", causal, layout, seed=31, sinks=True),
        Case(1, n, 4, 1, 64, "float32", causal, layout, seed=32, sinks=True),
        Case(2, n, 8, 2, 32, "bfloat16", causal, layout, seed=51, sinks=True),
    ]
    found = [f for case in cases for f in _check(case, world)]
    assert not found, "\n".join(found)


def test_sinks_change_the_result():
    # Guards the sink tests against a sink that is silently ignored: the reference with and
    # without sinks must differ by far more than the tolerance.
    case = Case(1, 24, 4, 2, 32, "float32", True, "zigzag", seed=33, sinks=True)
    with_sinks = local_ring_outputs(case, 2)
    plain = reference({k: v for k, v in make_inputs(case).items() if k != "sinks"}, True)
    assert relative_error(with_sinks["out"], plain["out"]) > 100 * FP32_TOL


def test_very_negative_sinks_equal_plain_attention():
    case = Case(1, 24, 4, 2, 32, "float32", True, "zigzag", seed=34)
    inputs = make_inputs(case)
    q, k, v = (inputs[n] for n in ("q", "k", "v"))
    plain = ringattn.ring_attention(q, k, v, causal=True, layout="zigzag", comm=LocalRing(2))
    sinks = torch.full((4,), -1e4)
    sunk = ringattn.ring_attention(
        q, k, v, causal=True, layout="zigzag", comm=LocalRing(2), sinks=sinks
    )
    assert torch.equal(plain, sunk)


def _t(*shape):
    return torch.randn(*shape)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"comm": LocalRing(3), "layout": "contiguous"},
            ValueError,
            "N=8 cannot be split over P=3",
        ),
        ({"comm": LocalRing(3), "layout": "zigzag"}, ValueError, r"multiple of 6 \(2P\)"),
        ({"comm": LocalRing(2), "group": object()}, ValueError, "either group= or comm="),
        (
            {"comm": LocalRing(2), "sinks": torch.zeros(3)},
            ValueError,
            r"sinks must have shape \(heads,\) = \(4,\)",
        ),
        (
            {"comm": LocalRing(2), "sinks": torch.zeros(4, dtype=torch.int64)},
            ValueError,
            "float tensor",
        ),
        ({"sinks": [0.0] * 4}, TypeError, "sinks must be a tensor"),
    ],
)
def test_local_ring_bad_input_is_a_clear_error(kwargs, error, message):
    with pytest.raises(error, match=message):
        ringattn.ring_attention(_t(1, 8, 4, 16), _t(1, 8, 2, 16), _t(1, 8, 2, 16), **kwargs)


def test_local_ring_world_size_is_checked():
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        LocalRing(0)


def test_local_ring_records_step_seconds():
    ring = LocalRing(2, record_steps=True)
    q = _t(1, 16, 4, 16).requires_grad_()
    ringattn.ring_attention(q, q, q, causal=True, layout="zigzag", comm=ring)
    steps = ring.step_seconds()
    assert len(steps) == 2 and all(len(s) == 2 and min(s) > 0 for s in steps)


def test_local_ring_is_the_distributed_ring_bit_for_bit():
    # The same loop, kernels and merge: with one thread each (as the spawned gloo ranks run),
    # the LocalRing's results equal the 3-process ring's exactly. The sink gradient is summed
    # over the ranks' shares there and over the whole sequence here, so it agrees to rounding.
    case = Case(2, 60, 8, 2, 32, "float32", True, "zigzag", seed=61, sinks=True)
    per_rank = run_distributed(ring_outputs, 3, [case])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        local = local_ring_outputs(case, 3)
    finally:
        torch.set_num_threads(threads)
    for name in ("out", "dq", "dk", "dv"):
        ring = ringattn.unshard_sequence([r[case.id][name] for r in per_rank], layout="zigzag")
        assert torch.equal(ring, local[name]), name
    shares = sum(r[case.id]["dsinks"] for r in per_rank)
    assert relative_error(shares, local["dsinks"].double()) < 1e-6
