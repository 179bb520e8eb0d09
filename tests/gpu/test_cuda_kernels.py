"""Each CUDA block kernel against float64 attention on one block, forward and backward.

Blocks as a ring computes them: full, the causal diagonal, and both zigzag half blocks (the
late half of the queries against all keys; all queries against the early half of the keys),
with lengths that are not multiples of 128, GQA/MQA/MHA, head_dim 64/128/256, bf16/fp16/fp32.
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

from ringattn.kernels import ChunkedKernel, FlashAttnKernel, TorchCUDAKernel, _flash_attn_available
from tests.attention_reference import BF16_ULP, FP32_TOL, relative_error, within_sdpa

ULP = {torch.bfloat16: BF16_ULP, torch.float16: BF16_ULP, torch.float32: FP32_TOL}
KINDS = {  # (query rows, key rows, causal) as slices of one n-token block
    "full": (slice(None), slice(None), False),
    "diag": (slice(None), slice(None), True),
    "half-q": ("late", slice(None), False),
    "half-kv": (slice(None), "early", False),
}


def _kernels():
    out = [("torch-cuda-flash", True), ("torch-cuda-efficient", False), ("chunked", None)]
    if _flash_attn_available():
        out.append(("flash-attn", None))
    return out


def _make(kernel_name):
    if kernel_name.startswith("torch-cuda"):
        kernel = TorchCUDAKernel()
        if kernel_name.endswith("efficient"):
            kernel.uses_flash = lambda q: False
        return kernel
    return ChunkedKernel() if kernel_name == "chunked" else FlashAttnKernel()


def _rows(spec, n):
    if isinstance(spec, slice):  # slices are unhashable before Python 3.12: no dict lookup
        return spec
    return {"late": slice(n // 2, None), "early": slice(0, n // 2)}[spec]


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
@pytest.mark.parametrize("kernel_name,flash", _kernels(), ids=lambda x: str(x))
def test_cuda_kernel_matches_float64(kernel_name, flash, dtype, head_dim, heads, kv_heads, kind):
    if flash and dtype == torch.float32:
        pytest.skip("the flash op takes fp16/bf16 only (fp32 goes to the efficient op)")
    if kernel_name == "flash-attn" and dtype == torch.float32:
        pytest.skip("flash-attn takes fp16/bf16 only")
    n, dev = 200, "cuda"  # 200: not a multiple of 128; halves of 100
    g = torch.Generator(device=dev).manual_seed(head_dim * heads + kv_heads)
    q = (torch.randn(2, n, heads, head_dim, device=dev, generator=g) * 1.5).to(dtype)
    k = (torch.randn(2, n, kv_heads, head_dim, device=dev, generator=g) * 1.5).to(dtype)
    v = torch.randn(2, n, kv_heads, head_dim, device=dev, generator=g).to(dtype)
    qr, kr, causal = KINDS[kind]
    q, k, v = q[:, _rows(qr, n)], k[:, _rows(kr, n)], v[:, _rows(kr, n)]
    dout = torch.randn(q.shape, device=dev, generator=g).to(dtype)
    scale = 1 / math.sqrt(head_dim)
    kernel = _make(kernel_name)
    out, lse = kernel.forward(q, k, v, scale=scale, causal=causal)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, scale=scale, causal=causal)
    ref, ref_lse = _reference(q, k, v, dout, scale, causal)
    sdpa = _sdpa(q, k, v, dout, scale, causal)
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert (lse.double() - ref_lse).abs().max().item() < (1e-4 if dtype == torch.float32 else 2e-3)
    failures = []
    for name, got in {"out": out, "dq": dq, "dk": dk, "dv": dv}.items():
        assert got.shape == ref[name].shape
        tol = within_sdpa(relative_error(sdpa[name], ref[name]), ULP[dtype])
        err = relative_error(got, ref[name])
        if not err <= tol:
            failures.append(f"{name}: {err:.2e} > {tol:.2e}")
    assert not failures, "; ".join(failures)
