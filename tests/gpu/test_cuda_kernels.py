"""Each CUDA block kernel against float64 attention on one block, forward and backward.

Blocks as a ring computes them: full, the causal diagonal, and both zigzag half blocks (the
late half of the queries against all keys; all queries against the early half of the keys),
with lengths that are not multiples of 128, GQA/MQA/MHA, head_dim 64/128/256, bf16/fp16/fp32.
Each op of TorchCUDAKernel (cuDNN, flash, efficient) is tested on its own, where it takes the
inputs (the adapter's own rule, ``op_for``).
The backward is given the block's own out and lse, so its result is the block's full-attention
gradient. Tolerance (tests/attention_reference.py, `within_sdpa`): no worse than PyTorch's own
SDPA on the same inputs, within a factor 2 plus one ulp of the dtype (BF16_ULP = 2**-8 for both
half types; FP32_TOL = 2e-5 for fp32, as on the CPU), since SDPA runs the same fused kernels on
the whole block.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ringattn.kernels import (
    CUDA_OPS,
    ChunkedKernel,
    FlashAttnKernel,
    TorchCUDAKernel,
    _flash_attn_available,
)
from tests.attention_reference import BF16_ULP, FP32_TOL, relative_error, within_sdpa

ULP = {torch.bfloat16: BF16_ULP, torch.float16: BF16_ULP, torch.float32: FP32_TOL}
KINDS = {  # (query rows, key rows, causal) as slices of one n-token block
    "full": (slice(None), slice(None), False),
    "diag": (slice(None), slice(None), True),
    "half-q": ("late", slice(None), False),
    "half-kv": (slice(None), "early", False),
    "one-row": ("first", slice(None), False),  # a packed document's one-token piece
    "one-by-one": ("first", "first", True),  # cuDNN's backward refuses these: not asked
}


def _kernels():
    out = [f"torch-cuda-{op}" for op in CUDA_OPS] + ["chunked"]
    return out + (["flash-attn"] if _flash_attn_available() else [])


def _make(kernel_name, q, k):
    """The kernel under test; a skip where it does not take these inputs."""
    if kernel_name.startswith("torch-cuda-"):
        op = kernel_name.removeprefix("torch-cuda-")
        kernel = TorchCUDAKernel(ops=(op,))
        if kernel.op_for(q, k) != op:  # the adapter would send these inputs to another op
            pytest.skip(f"the {op} op does not take {q.dtype} head_dim {q.shape[-1]} here")
        return kernel
    if kernel_name == "flash-attn" and q.dtype == torch.float32:
        pytest.skip("flash-attn takes fp16/bf16 only")
    return ChunkedKernel() if kernel_name == "chunked" else FlashAttnKernel()


def _rows(spec, n):
    if isinstance(spec, slice):  # slices are unhashable before Python 3.12: no dict lookup
        return spec
    return {"late": slice(n // 2, None), "early": slice(0, n // 2), "first": slice(0, 1)}[spec]


def _reference(q, k, v, dout, scale, causal):
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(g, 2)) * scale
    if causal:
        s = s.masked_fill(
            torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf")
        )
    out = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.repeat_interleave(g, 2))
    out.backward(dout.double())
    return {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}, s.logsumexp(-1)


def _sdpa(q, k, v, dout, scale, causal):
    q, k, v = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    out.backward(dout.transpose(1, 2))
    grads = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return {n: t.transpose(1, 2) for n, t in grads.items()}


CASES = [
    (dtype, d, heads, kv)
    for dtype in (torch.bfloat16, torch.float16, torch.float32)
    for d in (64, 128, 256)
    for heads, kv in ((8, 2), (4, 1), (4, 4))
]


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize(
    "dtype,head_dim,heads,kv_heads", CASES, ids=lambda x: str(x).replace("torch.", "")
)
@pytest.mark.parametrize("kernel_name", _kernels())
def test_cuda_kernel_matches_float64(kernel_name, dtype, head_dim, heads, kv_heads, kind):
    check_block(kernel_name, dtype, head_dim, heads, kv_heads, kind, device="cuda")


def check_block(kernel_name, dtype, head_dim, heads, kv_heads, kind, device):
    """One block of ``kind`` through the kernel against float64, within `within_sdpa`."""
    n, dev = 200, device  # 200: not a multiple of 128; halves of 100
    g = torch.Generator(device=dev).manual_seed(head_dim * heads + kv_heads)
    q = (torch.randn(2, n, heads, head_dim, device=dev, generator=g) * 1.5).to(dtype)
    k = (torch.randn(2, n, kv_heads, head_dim, device=dev, generator=g) * 1.5).to(dtype)
    v = torch.randn(2, n, kv_heads, head_dim, device=dev, generator=g).to(dtype)
    qr, kr, causal = KINDS[kind]
    q, k, v = q[:, _rows(qr, n)], k[:, _rows(kr, n)], v[:, _rows(kr, n)]
    dout = torch.randn(q.shape, device=dev, generator=g).to(dtype)
    scale = 1 / math.sqrt(head_dim)
    kernel = _make(kernel_name, q, k)
    out, lse = kernel.forward(q, k, v, scale=scale, causal=causal)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, scale=scale, causal=causal)
    ref, ref_lse = _reference(q, k, v, dout, scale, causal)
    sdpa = _sdpa(q, k, v, dout, scale, causal)
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert (lse.double() - ref_lse).abs().max().item() < (1e-4 if dtype == torch.float32 else 2e-3)
    floors = _cancellation_floors(q, k, dout, ref["out"], scale) if kind == "one-by-one" else {}
    failures = []
    for name, got in {"out": out, "dq": dq, "dk": dk, "dv": dv}.items():
        assert got.shape == ref[name].shape
        floor = floors.get(name, 0.0)
        tol = within_sdpa(_error(sdpa[name], ref[name], floor), ULP[dtype])
        err = _error(got, ref[name], floor)
        if not err <= tol:
            failures.append(f"{name}: {err:.2e} > {tol:.2e}")
    assert not failures, "; ".join(failures)


def _error(got, ref, floor: float) -> float:
    """`relative_error`, measured against ``floor`` where the reference is smaller."""
    if floor == 0.0:
        return relative_error(got, ref)
    return (got.double() - ref).abs().max().item() / max(ref.abs().max().item(), floor)


def _cancellation_floors(q, k, dout, out, scale) -> dict[str, float]:
    """A row that sees one key has softmax 1: its dq and dk are exactly 0, the difference of
    dout.v and dout.out, which are equal. Their error is then the rounding of those two
    terms, so it is measured against the size of the terms (times what multiplies them:
    scale and |k| for dq, scale and |q| for dk), not against a zero reference."""
    terms = (dout.double() * out).sum(-1).abs().max().item()  # |dout . out| = |dout . v|
    return {"dq": scale * terms * k.abs().max().item(), "dk": scale * terms * q.abs().max().item()}
