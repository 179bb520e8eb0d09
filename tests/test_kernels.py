"""Block kernels on one block: (out, lse) and gradients against float64 textbook attention.

The backward is given the *global* lse and out (as the ring gives it); on a single block those
are the block's own, so the result must be the full-attention gradient. Tolerance: float32
below FP32_TOL = 2e-5 of the largest reference value (tests/attention_reference.py says why).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ringattn.kernels import ChunkedKernel, TorchCPUKernel, TorchCUDAKernel, select_kernel
from tests.attention_reference import FP32_TOL, Case, make_inputs, reference, relative_error

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
        assert relative_error(got, ref[name]) < FP32_TOL, name
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


# ----------------------------------------------------------------------------- TorchCUDAKernel
# No GPU in CI: the adapter is checked against the installed torch's op schemas on meta
# tensors (argument order, None for the dense path's cum_seq tensors, output positions and
# shapes), and numerically on the CPU with the six op handles replaced by CPU stand-ins that
# keep the real ops' contracts (equal heads for the efficient op, its lse padded to 32 rows;
# cuDNN's lse as (B, H, Sq, 1)).
# tests/gpu/ runs the real kernels against float64 where CUDA is.


@pytest.mark.parametrize(
    "dtype,heads,kv_heads,head_dim,op",
    [
        (torch.bfloat16, 8, 2, 128, "cudnn"),
        (torch.float16, 4, 1, 256, "flash"),  # head_dim > 128: cuDNN not asked
        (torch.bfloat16, 4, 4, 64, "cudnn"),
        (torch.float32, 8, 2, 64, "efficient"),  # fp32: the memory-efficient op
        (torch.bfloat16, 4, 2, 264, "efficient"),  # head_dim > 256: flash refuses
        (torch.bfloat16, 4, 2, 60, "efficient"),  # not a multiple of 8
    ],
)
def test_torch_cuda_kernel_calls_match_the_op_schemas(dtype, heads, kv_heads, head_dim, op):
    kernel = TorchCUDAKernel()
    q = torch.empty(2, 200, heads, head_dim, device="meta", dtype=dtype)  # 200: not 128k
    k = torch.empty(2, 100, kv_heads, head_dim, device="meta", dtype=dtype)
    v = torch.empty_like(k)
    assert kernel.op_for(q, k) == op
    out, lse = kernel.forward(q, k, v, scale=0.1, causal=False)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (2, heads, 200) and lse.dtype == torch.float32
    dq, dk, dv = kernel.backward(torch.empty_like(q), q, k, v, out, lse, scale=0.1, causal=False)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_cudnn_is_asked_only_where_sdpa_may_use_it():
    """SDPA's own cuDNN switch turns it off here too; a CPU tensor never asks for it; an
    ops list without cuDNN skips it."""
    q = torch.empty(1, 8, 4, 64, device="meta", dtype=torch.bfloat16)
    assert TorchCUDAKernel().op_for(q, q) == "cudnn"
    assert TorchCUDAKernel(ops=("flash", "efficient")).op_for(q, q) == "flash"
    assert TorchCUDAKernel(ops=("cudnn",)).op_for(q.float(), q.float()) == "efficient"
    cpu = torch.empty(1, 8, 4, 64, dtype=torch.bfloat16)
    assert TorchCUDAKernel().op_for(cpu, cpu) == "efficient"  # not a GPU: neither fused op
    # cuDNN's backward refuses a one-by-one block (a packed document of one token makes one)
    one = q[:, :1]
    assert TorchCUDAKernel().op_for(one, one) == "flash"
    assert TorchCUDAKernel().op_for(one, q) == TorchCUDAKernel().op_for(q, one) == "flash"
    enabled = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        assert TorchCUDAKernel().op_for(q, q) == "flash"
    finally:
        torch.backends.cuda.enable_cudnn_sdp(enabled)
    with pytest.raises(ValueError, match="ops \\('math',\\): each one of cudnn, flash"):
        TorchCUDAKernel(ops=("math",))


def _cpu_stand_ins(kernel: TorchCUDAKernel, calls: list[str]) -> None:
    cpu_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    cpu_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    seed, offset = torch.empty((), dtype=torch.long), torch.empty((), dtype=torch.long)

    def cudnn_fwd(q, k, v, bias, compute_lse, dropout, causal, debug, *, scale):
        calls.append("cudnn")
        assert compute_lse and bias is None
        out, lse = cpu_fwd(q, k, v, dropout, causal, scale=scale)
        return out, lse.unsqueeze(-1), None, None, q.shape[2], k.shape[2], seed, offset, None

    def cudnn_bwd(do, q, k, v, o, lse, s, off, bias, cq, ck, mq, mk, dropout, causal, *, scale):
        assert lse.shape == (*q.shape[:3], 1) and lse.is_contiguous()
        assert bias is None and cq is None and ck is None and (mq, mk) == (q.shape[2], k.shape[2])
        return cpu_bwd(do, q, k, v, o, lse.squeeze(-1), dropout, causal, scale=scale)

    def flash_fwd(q, k, v, dropout, causal, debug, *, scale):
        calls.append("flash")
        out, lse = cpu_fwd(q, k, v, dropout, causal, scale=scale)
        return out, lse.contiguous(), None, None, q.shape[2], k.shape[2], seed, offset, None

    def flash_bwd(do, q, k, v, o, lse, cq, ck, mq, mk, dropout, causal, s, off, *, scale):
        assert lse.shape == (q.shape[0], q.shape[1], q.shape[2]) and lse.is_contiguous()
        return cpu_bwd(do, q, k, v, o, lse, dropout, causal, scale=scale)

    def eff_fwd(q, k, v, bias, compute_lse, dropout, causal, *, scale):
        calls.append("efficient")
        assert compute_lse and bias is None and q.shape[1] == k.shape[1], "equal heads"
        out, lse = cpu_fwd(q, k, v, dropout, causal, scale=scale)
        rows = -(-q.shape[2] // 32) * 32
        padded = torch.full((*lse.shape[:2], rows), float("nan"))  # must never be read
        padded[..., : q.shape[2]] = lse
        return out, padded, seed, offset

    def eff_bwd(do, q, k, v, bias, o, lse, s, off, dropout, mask, causal, *, scale):
        assert lse.shape[-1] == -(-q.shape[2] // 32) * 32 and q.shape[1] == k.shape[1]
        lse = lse[..., : q.shape[2]].contiguous()
        return (*cpu_bwd(do, q, k, v, o, lse, dropout, causal, scale=scale), None)

    kernel._cudnn_fwd, kernel._cudnn_bwd = cudnn_fwd, cudnn_bwd
    kernel._flash_fwd, kernel._flash_bwd = flash_fwd, flash_bwd
    kernel._eff_fwd, kernel._eff_bwd = eff_fwd, eff_bwd


@pytest.mark.parametrize("path", ["cudnn", "flash", "efficient"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (4, 1)])
def test_torch_cuda_kernel_adapter_matches_reference_on_cpu(path, causal, heads, kv_heads):
    kernel, calls = TorchCUDAKernel(), []
    _cpu_stand_ins(kernel, calls)
    kernel.op_for = lambda q, k: path
    case = Case(2, 50, heads, kv_heads, 32, "float32", causal, "contiguous", seed=7)
    inputs = make_inputs(case)
    ref = reference(inputs, causal)
    q, k, v, dout = (inputs[n] for n in ("q", "k", "v", "dout"))
    out, lse = kernel.forward(q, k, v, scale=32**-0.5, causal=causal)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, scale=32**-0.5, causal=causal)
    assert set(calls) == {path} and lse.shape == (2, heads, 50) and dk.shape == k.shape
    for name, got in {"out": out, "dq": dq, "dk": dk, "dv": dv}.items():
        assert relative_error(got, ref[name]) < FP32_TOL, name


def test_kernel_choice_by_environment(monkeypatch):
    q = torch.zeros(1, 4, 2, 8)
    assert isinstance(select_kernel(q), TorchCPUKernel)
    monkeypatch.setenv("RINGATTN_KERNEL", "torch-cuda")
    assert isinstance(select_kernel(q.to("meta")), TorchCUDAKernel)  # the CPU suite's CUDA tier
    # on a CPU q every rank failed with the efficient-attention op's traceback (review)
    with pytest.raises(ValueError, match=r"RINGATTN_KERNEL=torch-cuda runs on cuda only, and "):
        select_kernel(q)
    monkeypatch.setenv("RINGATTN_KERNEL", "flash")
    if importlib.util.find_spec("flash_attn") is None:  # said, not a bare ModuleNotFoundError
        with pytest.raises(ModuleNotFoundError, match=r"pip install 'ringctl\[flash\]'"):
            select_kernel(q.to("meta"))
    monkeypatch.setenv("RINGATTN_KERNEL", "chunked")
    assert isinstance(select_kernel(q), ChunkedKernel)
    monkeypatch.setenv("RINGATTN_KERNEL", "cudnn")
    with pytest.raises(ValueError, match="RINGATTN_KERNEL='cudnn': expected one of chunked, "):
        select_kernel(q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["full", "one-row", "one-by-one"])
def test_block_check_of_tests_gpu_holds_on_the_cpu(dtype, kind):
    """tests/gpu's block check, on the CPU with the chunked kernel: the one-by-one block's dq
    and dk are exactly zero, and the check measures them against the terms that cancel (on
    the H200 it first divided by the zero reference and failed every kernel, SDPA's too)."""
    from tests.gpu.test_cuda_kernels import check_block

    check_block("chunked", dtype, 64, 8, 2, kind, device="cpu")


@pytest.mark.parametrize(
    "capability,head_dim,chosen",
    [((9, 0), 128, "torch-cuda"), ((9, 0), 256, "flash-attn"), ((8, 0), 128, "flash-attn")],
)
def test_cudnn_goes_ahead_of_flash_attn_on_hopper(monkeypatch, capability, head_dim, chosen):
    """flash-attn 2 ran at half cuDNN's rate on an H200: with both at hand, sm90+ takes
    cuDNN (through TorchCUDAKernel) where cuDNN takes the head size; older GPUs keep
    flash-attn. CUDA tensors here are fake ones (FakeTensorMode on the CPU build)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ringattn import kernels

    class StandIn:  # flash-attn is not installed here; only the choice is checked
        name = "flash-attn"

    monkeypatch.setattr(kernels, "_flash_attn_available", lambda: True)
    monkeypatch.setattr(kernels, "FlashAttnKernel", StandIn)
    monkeypatch.setattr(kernels, "_cudnn_attention_usable", lambda device: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(1, 64, 8, head_dim, device="cuda", dtype=torch.bfloat16)
        assert select_kernel(q).name == chosen
