"""The CUDA kernel adapters inside the whole ring loop, checked as far as a CPU can: on meta
tensors.

No GPU has run this code when these tests are written, and none may be at hand when the next
change lands. torch's CPU build carries the meta functions of its CUDA attention ops
(``_scaled_dot_product_cudnn_attention``, ``_scaled_dot_product_flash_attention`` and
``_scaled_dot_product_efficient_attention`` with their backwards): they give each output's shape, dtype and strides without computing. So the
ring loop runs here with ``TorchCUDAKernel`` forced (``RINGATTN_KERNEL=torch-cuda``) on a
LocalRing of meta tensors, forward and backward: plain and packed sequences, causal and not,
windows cut into unmasked pieces (with reversed blocks) and masked bands, sinks, GQA/MQA, fp32
(the efficient kernel) and bf16/fp16 (the cuDNN kernel; the flash kernel where cuDNN is
switched off). Checked: every output's shape, dtype
and layout; which kernel each block took; the lse each op returns (the efficient kernel pads
its rows to a multiple of 32, the adapter hands the ring exactly Sq rows and the op's own
padding back in backward).

What this cannot catch: any number (meta computes nothing), the kernels' own stride or
alignment demands beyond their meta functions, streams and synchronisation, NCCL, memory use,
and the hybrid path (its all-to-alls need a process group; tests/gpu and scripts/gpu-check run
it on a GPU). tests/gpu holds the numerical checks for a GPU machine.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import ringattn
from ringattn import geometry
from ringattn.kernels import BandedKernel, TorchCUDAKernel
from ringattn.local_ring import LocalRing

META = torch.device("meta")


@pytest.fixture
def calls(monkeypatch):
    """Force the CUDA adapter and record which op every block ran."""
    monkeypatch.setenv("RINGATTN_KERNEL", "torch-cuda")
    seen: Counter = Counter()
    fwd, bwd = TorchCUDAKernel.forward, TorchCUDAKernel.backward
    banded_fwd = BandedKernel.forward

    def forward(self, q, k, v, *, scale, causal):
        seen[self.op_for(q, k), "forward", causal] += 1
        out, lse = fwd(self, q, k, v, scale=scale, causal=causal)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
        return out, lse

    def backward(self, dout, q, k, v, out, lse, *, scale, causal):
        seen[self.op_for(q, k), "backward", causal] += 1
        grads = bwd(self, dout, q, k, v, out, lse, scale=scale, causal=causal)
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
        return grads

    def banded(self, q, k, v, *, scale, offset, window):
        seen["banded", "forward", True] += 1
        return banded_fwd(self, q, k, v, scale=scale, offset=offset, window=window)

    monkeypatch.setattr(TorchCUDAKernel, "forward", forward)
    monkeypatch.setattr(TorchCUDAKernel, "backward", backward)
    monkeypatch.setattr(BandedKernel, "forward", banded)
    return seen


def _run(world, n, heads, kv, dtype, *, causal=True, window=None, sinks=False, cu=None):
    rows = n if cu is None else ringattn.pack_sequence(cu, world_size=world, layout="zigzag").rows
    shape = (1, rows * world if cu is not None else n)
    q = torch.empty(*shape, heads, 64, device=META, dtype=dtype, requires_grad=True)
    k = torch.empty(*shape, kv, 64, device=META, dtype=dtype, requires_grad=True)
    v = torch.empty(*shape, kv, 64, device=META, dtype=dtype, requires_grad=True)
    s = torch.empty(heads, device=META, requires_grad=True) if sinks else None
    out = ringattn.ring_attention(
        q,
        k,
        v,
        causal=causal,
        layout="zigzag",
        comm=LocalRing(world),
        window=window,
        sinks=s,
        cu_seqlens=cu,
    )  # noqa: E501
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    out.backward(torch.empty_like(out))
    for t in (q, k, v):
        assert t.grad.shape == t.shape and t.grad.dtype == dtype
    if sinks:
        assert s.grad.shape == (heads,) and s.grad.dtype == torch.float32


@pytest.mark.parametrize(
    "dtype,op", [(torch.float32, "efficient"), (torch.bfloat16, "cudnn"), (torch.float16, "cudnn")]
)
@pytest.mark.parametrize("causal", [False, True])
def test_plain_ring_takes_the_cuda_kernels(calls, dtype, op, causal):
    _run(4, 512, 8, 2, dtype, causal=causal)
    assert calls and {name for name, _, _ in calls} == {op}
    if causal:  # the diagonal blocks run the kernel's causal flag, the others not
        assert calls[op, "forward", True] and calls[op, "forward", False]


def test_long_windows_run_unmasked_on_the_cuda_kernels(calls):
    """W = 256 over 2048 tokens on 4 ranks: the band as rectangles, causal squares and
    reversed causal squares, all on the fused kernels; no masked band."""
    _run(4, 2048, 8, 2, torch.bfloat16, window=256, sinks=True)
    assert calls["cudnn", "forward", True] and not calls["banded", "forward", True]
    lay = geometry.plain_layout(2048, 4, "zigzag")
    assert any(b.reverse for r in range(4) for s in range(4) for b in lay.plan(s, r, True, 256))


def test_short_windows_take_the_banded_kernel(calls):
    _run(4, 512, 4, 1, torch.float32, window=7)
    assert calls["banded", "forward", True]


def test_packed_documents_on_the_cuda_kernels(calls):
    cu = [0, 1, 40, 41, 300, 333, 600]
    _run(4, None, 8, 2, torch.bfloat16, cu=cu, sinks=True)
    _run(3, None, 8, 8, torch.float32, cu=cu, causal=False)
    _run(2, None, 4, 1, torch.float16, cu=cu, window=300)
    assert calls["cudnn", "backward", True] and calls["efficient", "backward", False]


def test_the_efficient_kernels_lse_padding_is_handled():
    """The efficient op pads lse to a multiple of 32 rows (100 -> 128 here): the adapter
    gives the ring exactly Sq rows, and backward the op's own alignment."""
    q = torch.empty(1, 8, 100, 64, device=META)
    res = torch.ops.aten._scaled_dot_product_efficient_attention(q, q, q, None, True, 0.0, False)
    assert res[1].shape == (1, 8, 128)
    kernel = TorchCUDAKernel()
    qs = torch.empty(1, 100, 8, 64, device=META)
    out, lse = kernel.forward(qs, qs, qs, scale=0.125, causal=True)
    assert lse.shape == (1, 8, 100)
    _, _, align = kernel._probe("efficient", META, torch.float32)  # noqa: SLF001 - the adapter's rule
    assert align == 32
    dq, dk, dv = kernel.backward(out, qs, qs, qs, out, lse, scale=0.125, causal=True)
    assert dq.shape == dk.shape == dv.shape == qs.shape
