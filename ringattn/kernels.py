"""Block attention: one query block against one key/value block, returning (out, lse).

The ring needs exactly two things from a kernel: the block's normalised output with its
log-sum-exp (so partial results can be merged exactly), and the block's gradients given the
*global* output and log-sum-exp (FlashAttention-2 style recomputation). Everything here keeps
that one small interface, so the ring loop is the same code on every device:

* ``FlashAttnKernel``   flash-attn's CUDA kernels (fp16/bf16 on CUDA, when installed)
* ``TorchCUDAKernel``   torch's own fused CUDA kernels (SDPA's cuDNN, flash and
                        memory-efficient backends, called as the aten ops that return the lse)
* ``TorchCPUKernel``    torch's fused CPU flash kernel (a private aten op that returns the lse)
* ``ChunkedKernel``     plain matmuls over query chunks; any device and dtype, the fallback
* ``BandedKernel``      a sliding window's boundary blocks over the visible band (fused on CPU)

Shapes: q (B, Sq, H, D); k, v (B, Sk, Hkv, D) with H a multiple of Hkv (GQA/MQA, heads are
never repeated in memory); out (B, Sq, H, D) in q's dtype; lse (B, H, Sq) in float32 (float64
for float64 inputs).
``causal`` means the top-left aligned mask of a diagonal block (Sq == Sk).
The environment variable ``RINGATTN_KERNEL`` (flash, torch-cuda, torch = torch-cpu, chunked)
forces a choice.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Mapping
from typing import Protocol

import torch

from .geometry import BANDED_MAX_SCORES, band_chunks, banded_rows
from .switches import KERNEL, choice, kernel_device_problem

Tensor = torch.Tensor


class BlockKernel(Protocol):
    name: str

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, scale: float, causal: bool
    ) -> tuple[Tensor, Tensor]: ...

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        *,
        scale: float,
        causal: bool,
    ) -> tuple[Tensor, Tensor, Tensor]: ...


class TorchCPUKernel:
    """torch's fused CPU flash attention; it tiles the scores, handles GQA and bf16."""

    name = "torch-cpu-flash"

    def __init__(self) -> None:
        self._fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        self._bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

    def forward(self, q, k, v, *, scale, causal):
        out, lse = self._fwd(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=scale
        )
        return out.transpose(1, 2), lse

    def backward(self, dout, q, k, v, out, lse, *, scale, causal):
        dq, dk, dv = self._bwd(
            dout.transpose(1, 2),
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            out.transpose(1, 2),
            lse.contiguous(),
            0.0,
            causal,
            scale=scale,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# The fused CUDA ops TorchCUDAKernel can call, in the order it prefers them.
CUDA_OPS = ("cudnn", "flash", "efficient")


class TorchCUDAKernel:
    """torch's fused CUDA attention, as the private aten ops behind SDPA that return the lse.

    Each block goes to the first op of ``ops`` (default ``CUDA_OPS``) that takes its inputs:

    * ``cudnn``: fp16/bf16, head_dim a multiple of 8 up to 128, at least two query rows and
      two keys (its backward refused a one-by-one block on the H200: "s_q = s_kv = 1 is not
      supported"; packed documents of one token make them), where torch's own selector puts
      it first (cuDNN 9.15.1+ on an sm90/sm100 GPU: ``_cudnn_attention_usable``), and
      SDPA's own cuDNN switch on (``torch.backends.cuda.enable_cudnn_sdp``: a user who turns it
      off for SDPA turns it off here). ``_scaled_dot_product_cudnn_attention``: on an H200 it
      ran at about twice the flash op's rate (gpu-check, 2026-12-04: flash 353 TFLOP/s against
      SDPA's 684 on a bf16 block), which is why it comes first. Grouped heads natively; its
      lse comes as (B, H, Sq, 1) and goes back to its backward in that shape.
    * ``flash``: fp16/bf16 with head_dim a multiple of 8 up to 256, on an sm80+ GPU:
      ``_scaled_dot_product_flash_attention`` (FlashAttention-2 inside torch). Grouped heads
      natively (kv heads dividing the query heads), so K/V are used as they arrive and dK/dV
      come back with kv_heads heads.
    * ``efficient`` (takes anything: fp32, or a shape the others refuse):
      ``_scaled_dot_product_efficient_attention`` with ``compute_log_sumexp=True``. It needs
      equal head counts, so K/V are expanded to the query heads after arrival and dK/dV summed
      over each group (in float32) before they travel back: only kv_heads heads ever cross the
      ring. Its lse comes padded to a multiple of 32 rows (not on ROCm); the backward is given
      the same padded shape.

    Every op hands the ring the same lse, (B, H, Sq) float32 natural-log, so a backward may run
    on another op than its forward. The ops' outputs are read by position, as in torch 2.4 ..
    2.13 (flash and cudnn: out, lse, cum_seq_q, cum_seq_k, max_q, max_k, rng state or philox
    seed, unused or philox offset, debug mask; efficient: out, lse, seed, offset). The
    backwards need the forward's rng placeholders (dropout is 0, so they are never read): they
    come from one tiny forward per op, device and dtype.
    """

    name = "torch-cuda"

    def __init__(self, ops: tuple[str, ...] = CUDA_OPS) -> None:
        unknown = [op for op in ops if op not in CUDA_OPS]
        if unknown or not ops:
            raise ValueError(f"TorchCUDAKernel ops {ops!r}: each one of {', '.join(CUDA_OPS)}")
        self.ops = tuple(ops)
        aten = torch.ops.aten
        self._cudnn_fwd = aten._scaled_dot_product_cudnn_attention.default
        self._cudnn_bwd = aten._scaled_dot_product_cudnn_attention_backward.default
        self._flash_fwd = aten._scaled_dot_product_flash_attention.default
        self._flash_bwd = aten._scaled_dot_product_flash_attention_backward.default
        self._eff_fwd = aten._scaled_dot_product_efficient_attention.default
        self._eff_bwd = aten._scaled_dot_product_efficient_attention_backward.default
        self._probes: dict[tuple, tuple] = {}

    def op_for(self, q: Tensor, k: Tensor) -> str:
        """The op a block of these queries and keys runs on: the first of ``ops`` that takes
        it (the same for its forward and its backward)."""
        d = q.shape[-1]
        half = q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0
        takes = {
            "cudnn": _cudnn_takes(q, k.shape[1]),
            "flash": half and d <= 256 and _ampere_or_later(q.device),
            "efficient": True,
        }
        return next((op for op in self.ops if takes[op]), "efficient")

    def _probe(self, op: str, device: torch.device, dtype: torch.dtype) -> tuple:
        """(rng seed, rng offset, lse row alignment) of the op, from a one-token forward."""
        key = (op, device, dtype)
        if key not in self._probes:
            x = torch.zeros(1, 1, 1, 64, device=device, dtype=dtype)
            if op == "cudnn":
                res = self._cudnn_fwd(x, x, x, None, True, 0.0, False, False, scale=1.0)
                self._probes[key] = (res[6], res[7], 1)
            elif op == "flash":
                res = self._flash_fwd(x, x, x, 0.0, False, False, scale=1.0)
                self._probes[key] = (res[6], res[7], 1)
            else:
                res = self._eff_fwd(x, x, x, None, True, 0.0, False, scale=1.0)
                self._probes[key] = (res[2], res[3], res[1].shape[-1])
        return self._probes[key]

    def forward(self, q, k, v, *, scale, causal):
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, S, D)
        op = self.op_for(q, k)
        if op == "cudnn":
            res = self._cudnn_fwd(qt, kt, vt, None, True, 0.0, causal, False, scale=scale)
            return res[0].transpose(1, 2), res[1].reshape(res[1].shape[:3])
        if op == "flash":
            res = self._flash_fwd(qt, kt, vt, 0.0, causal, False, scale=scale)
            return res[0].transpose(1, 2), res[1]
        heads = q.shape[2]
        kt, vt = _repeat_heads(kt, heads), _repeat_heads(vt, heads)
        res = self._eff_fwd(qt, kt, vt, None, True, 0.0, causal, scale=scale)
        return res[0].transpose(1, 2), res[1][..., : q.shape[1]]

    def backward(self, dout, q, k, v, out, lse, *, scale, causal):
        sq, sk = q.shape[1], k.shape[1]
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        dot, ot = dout.transpose(1, 2), out.transpose(1, 2)
        op = self.op_for(q, k)
        seed, offset, align = self._probe(op, q.device, q.dtype)
        if op == "cudnn":
            grads = self._cudnn_bwd(
                *(dot, qt, kt, vt, ot, lse.unsqueeze(-1).contiguous(), seed, offset),
                *(None, None, None, sq, sk, 0.0, causal),
                scale=scale,
            )
        elif op == "flash":
            grads = self._flash_bwd(
                *(dot, qt, kt, vt, ot, lse.contiguous(), None, None, sq, sk, 0.0, causal),
                *(seed, offset),
                scale=scale,
            )
        else:
            return self._efficient_backward(
                dot, qt, kt, vt, ot, lse, seed, offset, align, scale, causal
            )
        dq, dk, dv = grads[:3]
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

    def _efficient_backward(self, dot, qt, kt, vt, ot, lse, seed, offset, align, scale, causal):
        """The efficient op's backward: K/V repeated to the query heads, its lse padded to
        its row alignment, dK/dV summed back over each group."""
        b, heads, sq, _ = qt.shape
        kv_heads = kt.shape[1]
        kt, vt = _repeat_heads(kt, heads), _repeat_heads(vt, heads)
        rows = -(-sq // align) * align
        lse_rows = lse.new_full((b, heads, rows), float("inf"))  # padding rows: p = 0
        lse_rows[..., :sq] = lse
        dq, dk, dv = self._eff_bwd(
            *(dot, qt, kt, vt, None, ot, lse_rows, seed, offset, 0.0),
            [True, True, True, False],
            causal,
            scale=scale,
        )[:3]
        dk, dv = _sum_groups(dk, kv_heads), _sum_groups(dv, kv_heads)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _cudnn_takes(q: Tensor, keys: int) -> bool:
    """Whether cuDNN's attention takes a block of these queries against ``keys`` keys (the
    rule TorchCUDAKernel's docstring gives; select_kernel asks it too)."""
    d = q.shape[-1]
    return (
        q.dtype in (torch.float16, torch.bfloat16)
        and d % 8 == 0
        and d <= 128
        and q.shape[1] > 1
        and keys > 1
        and _cudnn_attention_usable(q.device)
    )


_CUDNN_USABLE: dict[torch.device, bool] = {}


CUDNN_FIRST = 91501  # cuDNN 9.15.1: what torch itself asks before it puts cuDNN first


def _cudnn_attention_usable(device: torch.device) -> bool:
    """cuDNN's fused attention runs the ring's blocks here: SDPA's cuDNN switch on, and where
    torch's own selector puts it first (``check_prefer_cudnn_attention``): an sm90, sm100 or
    sm103 GPU (Hopper, Blackwell data-centre parts) with cuDNN 9.15.1 or later, unless
    TORCH_CUDNN_SDPA_DEPRIORITIZED is set. Elsewhere torch
    deliberately passes it over (wrong results and NaN gradients were reported for sequence
    lengths off its preferred multiples on earlier versions; the ring's blocks are N/2P rows),
    and so does the ring: an A100 runs the flash op. Measured on an H200 only (torch 2.11,
    cuDNN 9.19). A meta device counts as such a GPU: the CPU suite runs the ring loop on meta
    tensors to check the cuDNN op's calls (tests/test_cuda_meta.py)."""
    if not torch.backends.cuda.cudnn_sdp_enabled() or _deprioritized():
        return False
    if device.type == "meta":
        return True
    if device.type != "cuda":
        return False
    if device not in _CUDNN_USABLE:
        version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        capability = torch.cuda.get_device_capability(device)
        preferred = capability[0] in (9, 10) and capability[1] in (0, 3)
        _CUDNN_USABLE[device] = (version or 0) >= CUDNN_FIRST and preferred
    return _CUDNN_USABLE[device]


def _deprioritized() -> bool:
    """TORCH_CUDNN_SDPA_DEPRIORITIZED set: torch's own switch that keeps cuDNN from going
    first, honoured here too."""
    value = os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").strip().lower()
    return value in ("1", "true", "yes", "on")


def _repeat_heads(t: Tensor, heads: int) -> Tensor:
    """(B, Hkv, S, D) -> (B, H, S, D), query head h reading kv head h // (H / Hkv)."""
    b, kv_heads, s, d = t.shape
    if kv_heads == heads:
        return t
    return t[:, :, None].expand(b, kv_heads, heads // kv_heads, s, d).reshape(b, heads, s, d)


def _sum_groups(t: Tensor, kv_heads: int) -> Tensor:
    """(B, H, S, D) gradients of repeated heads -> (B, Hkv, S, D), summed in float32."""
    if t.shape[1] == kv_heads:
        return t
    return t.unflatten(1, (kv_heads, -1)).sum(2, dtype=torch.float32)


class ChunkedKernel:
    """Matmul attention over query chunks: at most ``chunk x Sk`` scores exist at once."""

    name = "chunked-matmul"

    def __init__(self, chunk: int = 1024) -> None:
        self.chunk = chunk

    @staticmethod
    def _grouped(q: Tensor, kv_heads: int) -> Tensor:
        # (B, S, H, D) -> (B, Hkv, G, S, D): each kv head serves G consecutive query heads.
        b, s, h, d = q.shape
        return q.reshape(b, s, kv_heads, h // kv_heads, d).permute(0, 2, 3, 1, 4)

    def forward(self, q, k, v, *, scale, causal):
        # causal: key row b visible to query row a iff b <= a; else every key (offset Sk)
        offset = 0 if causal else k.shape[1]
        return _matmul_forward(q, k, v, scale, offset, None, self.chunk)

    def backward(self, dout, q, k, v, out, lse, *, scale, causal):
        offset = 0 if causal else k.shape[1]
        return _matmul_backward(dout, q, k, v, out, lse, scale, offset, None, self.chunk)


def _visible(r0: int, r1: int, k0: int, k1: int, offset: int, window: int | None, device):
    a = torch.arange(r0, r1, device=device)[:, None] + offset
    b = torch.arange(k0, k1, device=device)[None, :]
    return (b <= a) if window is None else (b <= a) & (b > a - window)


class _ChunkMasks:
    """Each chunk's visibility mask (and, for the fused kernel, its additive bias), reused
    while consecutive chunks share it.

    A chunk's mask depends only on its rows, its keys and where its first key sits against its
    first row (``r0 + offset - k0``): every middle chunk of a band shares one, so a block of
    S rows builds a mask for each edge chunk and one for the middle instead of S / rows (about
    30 ms each at 1024 x 5120). Only the last mask is held (one chunk's worth, as before), so
    chunks that never repeat (a causal block's, the band's edges) cost no memory beyond it.
    """

    def __init__(self, offset: int, window: int | None, device, bias_dtype=None) -> None:
        self.offset, self.window, self.device, self.bias_dtype = offset, window, device, bias_dtype
        self._shape: tuple[int, int, int] | None = None
        self._held: tuple = (None, None)

    def __call__(self, r0: int, r1: int, k0: int, k1: int) -> tuple:
        """(seen, bias): bool mask (rows, keys) and its 0/-inf bias (None without bias_dtype)."""
        shape = (r1 - r0, k1 - k0, r0 + self.offset - k0)
        if shape != self._shape:
            self._held = (None, None)  # free the last mask before building the next
            seen = _visible(r0, r1, k0, k1, self.offset, self.window, self.device)
            bias = None
            if self.bias_dtype is not None:
                bias = torch.zeros(seen.shape, dtype=self.bias_dtype, device=self.device)
                bias = bias.masked_fill(~seen, float("-inf"))
            self._shape, self._held = shape, (seen, bias)
        return self._held


def _matmul_forward(q, k, v, scale, offset, window, rows):
    """Matmul attention over query chunks, each against the keys it can see only; float32
    accumulation (float64 for float64). Rows that see no key: out 0, lse -inf."""
    b, sq, h, d = q.shape
    hkv = k.shape[2]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    kg = k.permute(0, 2, 1, 3).unsqueeze(2)  # (B, Hkv, 1, Sk, D)
    vg = v.permute(0, 2, 1, 3).unsqueeze(2)
    qg = ChunkedKernel._grouped(q, hkv)
    out = torch.zeros(b, hkv, h // hkv, sq, d, dtype=acc, device=q.device)
    lse = torch.full((b, hkv, h // hkv, sq), float("-inf"), dtype=acc, device=q.device)
    masks = _ChunkMasks(offset, window, q.device)
    for r0, r1, k0, k1 in band_chunks(sq, k.shape[1], offset, window, rows):
        seen, _ = masks(r0, r1, k0, k1)
        s = torch.matmul(qg[..., r0:r1, :].to(acc), kg[..., k0:k1, :].to(acc).transpose(-1, -2))
        s = (s * scale).masked_fill(~seen, float("-inf"))
        m = torch.logsumexp(s, dim=-1, keepdim=True)
        p = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
        out[..., r0:r1, :] = torch.matmul(p, vg[..., k0:k1, :].to(acc))
        lse[..., r0:r1] = m.squeeze(-1)
    out = out.permute(0, 3, 1, 2, 4).reshape(b, sq, h, d).to(q.dtype)
    return out, lse.reshape(b, h, sq)


def _matmul_backward(dout, q, k, v, out, lse, scale, offset, window, rows):
    """The gradients of _matmul_forward's attention given the global out and lse."""
    b, sq, h, d = q.shape
    hkv, sk = k.shape[2], k.shape[1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    kg = k.permute(0, 2, 1, 3).unsqueeze(2)
    vg = v.permute(0, 2, 1, 3).unsqueeze(2)
    qg, og, dog = (ChunkedKernel._grouped(t, hkv) for t in (q, out, dout))
    # A row that sees no key at all (lse -inf; never in a ring, where a row sees itself)
    # gets +inf, so that its probabilities are exp(-inf) = 0 rather than nan.
    lg = lse.masked_fill(lse == float("-inf"), float("inf")).reshape(b, hkv, h // hkv, sq)
    dq = torch.zeros(b, hkv, h // hkv, sq, d, dtype=acc, device=q.device)
    dk = torch.zeros(b, hkv, 1, sk, d, dtype=acc, device=q.device)
    dv = torch.zeros_like(dk)
    masks = _ChunkMasks(offset, window, q.device)
    for r0, r1, k0, k1 in band_chunks(sq, sk, offset, window, rows):
        seen, _ = masks(r0, r1, k0, k1)
        qc, doc = qg[..., r0:r1, :].to(acc), dog[..., r0:r1, :].to(acc)
        kc, vc = kg[..., k0:k1, :].to(acc), vg[..., k0:k1, :].to(acc)
        s = (torch.matmul(qc, kc.transpose(-1, -2)) * scale).masked_fill(~seen, float("-inf"))
        p = torch.exp(s - lg[..., r0:r1].unsqueeze(-1).to(acc))
        dv[..., k0:k1, :] += torch.matmul(p.transpose(-1, -2), doc).sum(2, keepdim=True)
        dp = torch.matmul(doc, vc.transpose(-1, -2))
        delta = (doc * og[..., r0:r1, :].to(acc)).sum(-1, keepdim=True)
        ds = p * (dp - delta) * scale
        dq[..., r0:r1, :] = torch.matmul(ds, kc)
        dk[..., k0:k1, :] += torch.matmul(ds.transpose(-1, -2), qc).sum(2, keepdim=True)
    dq = dq.permute(0, 3, 1, 2, 4).reshape(b, sq, h, d).to(q.dtype)
    dk = dk.squeeze(2).permute(0, 2, 1, 3).to(k.dtype)
    dv = dv.squeeze(2).permute(0, 2, 1, 3).to(v.dtype)
    return dq, dk, dv


class BandedKernel:
    """Attention under a sliding window, over the visible band only.

    The boundary blocks of a windowed ring (``blocks.Block`` with ``window``): key row b is
    visible to query row a iff ``a + offset - window < b <= a + offset``. Query rows go in
    chunks of about the window; each chunk attends to the keys its rows can see and no others,
    so a block of S rows costs about S x 2W scores however long S is. On the CPU each chunk is
    torch's fused flash kernel with the window as an additive mask over the band; elsewhere
    (or ``fused=False``, or ``RINGATTN_KERNEL=chunked``) matmuls in float32 (float64 for
    float64). Rows that see no key of the block get out 0 and lse -inf (the merge then ignores
    them). The interface of the other kernels, with ``offset`` and ``window`` for ``causal``.
    """

    name = "banded"

    def __init__(self, max_scores: int = BANDED_MAX_SCORES, fused: bool | None = None) -> None:
        self.max_scores = max_scores  # scores held at once, all heads of the batch (matmuls)
        self.fused = fused  # None: the CPU fused kernel where it exists

    def _fused(self, q: Tensor) -> bool:
        if self.fused is not None:
            return self.fused
        if choice(KERNEL, os.environ.get(KERNEL)) == "chunked":
            return False
        return q.device.type == "cpu" and hasattr(
            torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"
        )

    def _rows(self, q: Tensor, window: int) -> int:
        """Query rows per chunk (``geometry.banded_rows``)."""
        return banded_rows(q.shape[0], q.shape[2], window, self.max_scores)

    def _chunks(self, q: Tensor, sk: int, offset: int, window: int):
        return band_chunks(q.shape[1], sk, offset, window, self._rows(q, window))

    def forward(self, q, k, v, *, scale, offset, window):
        if self._fused(q):
            return self._fused_forward(q, k, v, scale, offset, window)
        return _matmul_forward(q, k, v, scale, offset, window, self._rows(q, window))

    def _fused_forward(self, q, k, v, scale, offset, window):
        fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        b, sq, h, d = q.shape
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = torch.zeros(b, sq, h, d, dtype=q.dtype, device=q.device)
        lse = torch.full((b, h, sq), float("-inf"), dtype=acc, device=q.device)
        masks = _ChunkMasks(offset, window, q.device, bias_dtype=q.dtype)
        for r0, r1, k0, k1 in self._chunks(q, k.shape[1], offset, window):
            seen, bias = masks(r0, r1, k0, k1)
            o, m = fwd(
                q[:, r0:r1].transpose(1, 2),
                k[:, k0:k1].transpose(1, 2),
                v[:, k0:k1].transpose(1, 2),
                0.0,
                False,
                attn_mask=bias,
                scale=scale,
            )
            # A row that sees no key: the kernel says out 0, lse 0; the merge needs -inf.
            m = m.to(acc).masked_fill(~seen.any(-1), float("-inf"))
            out[:, r0:r1] = o.transpose(1, 2)
            lse[..., r0:r1] = m
        return out, lse

    def backward(self, dout, q, k, v, out, lse, *, scale, offset, window):
        if self._fused(q):
            return self._fused_backward(dout, q, k, v, out, lse, scale, offset, window)
        rows = self._rows(q, window)
        return _matmul_backward(dout, q, k, v, out, lse, scale, offset, window, rows)

    def _fused_backward(self, dout, q, k, v, out, lse, scale, offset, window):
        bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        lse = lse.masked_fill(torch.isinf(lse), 0.0)  # a row seeing nothing: p = exp(-inf)
        t = lambda x: x.transpose(1, 2)  # noqa: E731 - (B, S, H, D) <-> (B, H, S, D)
        masks = _ChunkMasks(offset, window, q.device, bias_dtype=q.dtype)
        for r0, r1, k0, k1 in self._chunks(q, k.shape[1], offset, window):
            seen, bias = masks(r0, r1, k0, k1)
            g = bwd(
                t(dout[:, r0:r1]),
                t(q[:, r0:r1]),
                t(k[:, k0:k1]),
                t(v[:, k0:k1]),
                t(out[:, r0:r1]),
                lse[..., r0:r1].to(acc).contiguous(),
                0.0,
                False,
                attn_mask=bias,
                scale=scale,
            )
            dq[:, r0:r1] += t(g[0])
            dk[:, k0:k1] += t(g[1])
            dv[:, k0:k1] += t(g[2])
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# Plain attention in flash-attn's terms: no dropout, no sliding window, no softcap, no ALiBi.
_FLASH_PLAIN = dict(
    dropout_p=0.0, window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None
)


class FlashAttnKernel:
    """flash-attn 2.x kernels. Their private signatures moved between releases, so arguments
    are passed by name and only those the installed version accepts."""

    name = "flash-attn"

    def __init__(self) -> None:
        try:
            from flash_attn import flash_attn_interface as fa
        except ImportError as err:  # forced (RINGATTN_KERNEL=flash) where it is not installed
            raise ModuleNotFoundError(
                f"{KERNEL}=flash needs flash-attn, which this Python cannot import ({err}): "
                f"pip install 'ringctl[flash]' on a CUDA machine, or unset {KERNEL}"
            ) from None

        self._fwd = fa._flash_attn_forward
        self._bwd = fa._flash_attn_backward
        self._fwd_params = _parameters(self._fwd)
        self._bwd_params = _parameters(self._bwd)

    @staticmethod
    def _args(params, **kw):
        if "window_size" in params:  # flash-attn < 2.7 takes a tuple
            kw["window_size"] = (kw.pop("window_size_left"), kw.pop("window_size_right"))
        return {name: value for name, value in kw.items() if name in params}

    def forward(self, q, k, v, *, scale, causal):
        kw = self._args(
            self._fwd_params,
            q=q.contiguous(),
            k=k.contiguous(),
            v=v.contiguous(),
            softmax_scale=scale,
            causal=causal,
            return_softmax=False,
            **_FLASH_PLAIN,
        )
        res = self._fwd(**kw)
        # >= 2.7: (out, lse, S_dmask, rng_state); 2.6: (out, q, k, v, out_padded, lse, ...)
        return (res[0], res[1]) if len(res) == 4 else (res[0], res[5])

    def backward(self, dout, q, k, v, out, lse, *, scale, causal):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kw = self._args(
            self._bwd_params,
            dout=dout.contiguous(),
            q=q,
            k=k,
            v=v,
            out=out.contiguous(),
            softmax_lse=lse.contiguous(),
            dq=dq,
            dk=dk,
            dv=dv,
            softmax_scale=scale,
            causal=causal,
            deterministic=False,
            rng_state=None,
            **_FLASH_PLAIN,
        )
        self._bwd(**kw)
        return dq, dk, dv


def _parameters(fn) -> Mapping[str, inspect.Parameter]:
    """The parameters a flash-attn function takes. From 2.7 on (torch >= 2.4) its private
    functions are ``torch.library.custom_op`` objects, whose own signature is ``(*args,
    **kwargs)``: read as such, every argument was dropped and the first call failed ("missing
    value for argument 'q'"); the wrapped function's signature is the op's."""
    return inspect.signature(getattr(fn, "_init_fn", fn)).parameters


def _flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


_FORCED = {
    "chunked": lambda: ChunkedKernel(),
    "torch": lambda: TorchCPUKernel(),
    "torch-cpu": lambda: TorchCPUKernel(),
    "torch-cuda": lambda: _cached(TorchCUDAKernel),
    "flash": lambda: FlashAttnKernel(),
}


def select_kernel(q: Tensor) -> BlockKernel:
    """The fastest kernel that handles q's device and dtype (or the one RINGATTN_KERNEL names).

    CUDA: flash-attn where installed (fp16/bf16) unless cuDNN's attention beats it there,
    else torch's fused kernels (fp16/bf16/fp32, head_dim a multiple of 8), else chunked
    matmuls. CPU: torch's fused CPU kernel.
    """
    forced = choice(KERNEL, os.environ.get(KERNEL))
    if forced:
        wrong = kernel_device_problem(forced, q.device.type)  # a meta q: any (the CPU tier)
        if wrong:
            raise ValueError(wrong)
        return _FORCED[forced]()
    if q.is_cuda:
        if _flash_attn_takes(q) and _flash_attn_available() and not _cudnn_beats_flash_attn(q):
            return FlashAttnKernel()
        if q.dtype == torch.bfloat16 and not _ampere_or_later(q.device):
            return ChunkedKernel()  # no fused bf16 op before sm80 (torch's math path too)
        if q.dtype in (torch.float16, torch.bfloat16, torch.float32) and q.shape[-1] % 8 == 0:
            return _cached(TorchCUDAKernel)
        return ChunkedKernel()
    if q.device.type == "cpu" and hasattr(
        torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"
    ):
        return TorchCPUKernel()
    return ChunkedKernel()


def _flash_attn_takes(q: Tensor) -> bool:
    """flash-attn 2's kernels take this block: fp16/bf16 heads of a multiple of 8 up to 256
    (its private functions do not pad as its public ones do) on an Ampere or later GPU."""
    d = q.shape[-1]
    half = q.dtype in (torch.float16, torch.bfloat16)
    return half and d % 8 == 0 and d <= 256 and _ampere_or_later(q.device)


def _ampere_or_later(device: torch.device) -> bool:
    """An sm80+ GPU (a meta device counts as one: the CPU suite's ring loop on meta tensors).
    FlashAttention's kernels, torch's copy of them and bf16 need one ("Flash attention only
    supports gpu architectures in the range [sm80, sm121]")."""
    if device.type == "meta":
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def _cudnn_beats_flash_attn(q: Tensor) -> bool:
    """cuDNN's attention ahead of flash-attn 2 on Hopper and later GPUs: on an H200 it ran bf16
    blocks at 677 TFLOP/s where FlashAttention-2 (torch's copy of it) ran 352
    (benchmarks/results/gpu-check-h200.md). Earlier GPUs keep flash-attn first: not measured."""
    return _cudnn_takes(q, q.shape[1]) and torch.cuda.get_device_capability(q.device) >= (9, 0)


_INSTANCES: dict[type, object] = {}


def _cached(cls):
    """One instance per process: TorchCUDAKernel keeps its per-device probes."""
    if cls not in _INSTANCES:
        _INSTANCES[cls] = cls()
    return _INSTANCES[cls]


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
