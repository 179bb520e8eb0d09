"""Block kernels on one block: (out, lse) and gradients against float64 textbook attention.

The backward is given the *global* lse and out (as the ring gives it); on a single block those
are the block's own, so the result must be the full-attention gradient.
"""

from __future__ import annotations

import pytest
import torch

from ringattn.kernels import ChunkedKernel, TorchCPUKernel
from tests.attention_reference import Case, make_inputs, reference, relative_error

KERNELS = {"torch": TorchCPUKernel, "chunked": lambda: ChunkedKernel(chunk=16)}


@pytest.mark.parametrize("kernel_name", sorted(KERNELS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (4, 1)])
def test_block_kernel_matches_reference(kernel_name, causal, heads, kv_heads):
    kernel = KERNELS[kernel_name]()
    case = Case(2, 50, heads, kv_heads, 32, "float32", causal, "contiguous", seed=7)
    inputs = make_inputs(case)
    ref = reference(inputs, causal)
    q, k, v, dout = (inputs[n] for n in ("q", "k", "v", "dout"))
    scale = 32**-0.5
    out, lse = kernel.forward(q, k, v, scale=scale, causal=causal)
    assert out.shape == q.shape and lse.shape == (2, heads, 50) and lse.dtype == torch.float32
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, scale=scale, causal=causal)
    assert dk.shape == k.shape and dv.shape == v.shape
    for name, got in {"out": out, "dq": dq, "dk": dk, "dv": dv}.items():
        assert relative_error(got, ref[name]) < 2e-5, name
    # lse is log sum exp of the scaled scores: check it independently.
    groups = heads // kv_heads
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(groups, 2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(50, 50, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.allclose(lse.double(), s.logsumexp(-1), atol=1e-5)


def test_chunked_kernel_rectangular_block_equals_torch_kernel():
    # Off-diagonal ring blocks are rectangular (zigzag: half the queries, all keys).
    case = Case(1, 40, 8, 2, 64, "float32", False, "contiguous", seed=3)
    inputs = make_inputs(case)
    q, k, v = inputs["q"][:, 20:], inputs["k"], inputs["v"]
    a = ChunkedKernel(chunk=7).forward(q, k, v, scale=0.1, causal=False)
    b = TorchCPUKernel().forward(q, k, v, scale=0.1, causal=False)
    assert torch.allclose(a[0], b[0], atol=1e-6) and torch.allclose(a[1], b[1], atol=1e-5)
