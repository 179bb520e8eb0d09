"""Block attention: one query block against one key/value block, returning (out, lse).

The ring needs exactly two things from a kernel: the block's normalised output with its
log-sum-exp (so partial results can be merged exactly), and the block's gradients given the
*global* output and log-sum-exp (FlashAttention-2 style recomputation). Everything here keeps
that one small interface, so the ring loop is the same code on every device:

* ``FlashAttnKernel``   flash-attn's CUDA kernels (fp16/bf16 on CUDA, when installed)
* ``TorchCPUKernel``    torch's fused CPU flash kernel (a private aten op that returns the lse)
* ``ChunkedKernel``     plain matmuls over query chunks; any device and dtype, the fallback

Shapes: q (B, Sq, H, D); k, v (B, Sk, Hkv, D) with H a multiple of Hkv (GQA/MQA, heads are
never repeated in memory); out (B, Sq, H, D) in q's dtype; lse (B, H, Sq) in float32.
``causal`` means the top-left aligned mask of a diagonal block (Sq == Sk).
The environment variable ``RINGATTN_KERNEL`` (flash, torch, chunked) forces a choice.
"""

from __future__ import annotations

import inspect
import math
import os
from typing import Protocol

import torch

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

    @staticmethod
    def _mask(scores: Tensor, row0: int, causal: bool) -> Tensor:
        if not causal:
            return scores
        rows, cols = scores.shape[-2:]
        r = torch.arange(row0, row0 + rows, device=scores.device)[:, None]
        c = torch.arange(cols, device=scores.device)[None, :]
        return scores.masked_fill(c > r, float("-inf"))

    def forward(self, q, k, v, *, scale, causal):
        b, sq, h, d = q.shape
        hkv = k.shape[2]
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        kg = k.permute(0, 2, 1, 3).unsqueeze(2).to(acc)  # (B, Hkv, 1, Sk, D)
        vg = v.permute(0, 2, 1, 3).unsqueeze(2).to(acc)
        qg = self._grouped(q, hkv)
        out = torch.empty(b, hkv, h // hkv, sq, d, dtype=acc, device=q.device)
        lse = torch.empty(b, hkv, h // hkv, sq, dtype=torch.float32, device=q.device)
        for r0 in range(0, sq, self.chunk):
            qc = qg[..., r0 : r0 + self.chunk, :].to(acc)
            s = self._mask(torch.matmul(qc, kg.transpose(-1, -2)) * scale, r0, causal)
            m = torch.logsumexp(s, dim=-1, keepdim=True)
            out[..., r0 : r0 + self.chunk, :] = torch.matmul(torch.exp(s - m), vg)
            lse[..., r0 : r0 + self.chunk] = m.squeeze(-1)
        out = out.permute(0, 3, 1, 2, 4).reshape(b, sq, h, d).to(q.dtype)
        return out, lse.reshape(b, h, sq)

    def backward(self, dout, q, k, v, out, lse, *, scale, causal):
        b, sq, h, d = q.shape
        hkv = k.shape[2]
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        kg = k.permute(0, 2, 1, 3).unsqueeze(2).to(acc)
        vg = v.permute(0, 2, 1, 3).unsqueeze(2).to(acc)
        qg, og, dog = (self._grouped(t, hkv) for t in (q, out, dout))
        lg = lse.reshape(b, hkv, h // hkv, sq)
        dq = torch.empty(b, hkv, h // hkv, sq, d, dtype=acc, device=q.device)
        dk = torch.zeros(b, hkv, 1, k.shape[1], d, dtype=acc, device=q.device)
        dv = torch.zeros_like(dk)
        for r0 in range(0, sq, self.chunk):
            rows = slice(r0, r0 + self.chunk)
            qc, doc = qg[..., rows, :].to(acc), dog[..., rows, :].to(acc)
            s = self._mask(torch.matmul(qc, kg.transpose(-1, -2)) * scale, r0, causal)
            p = torch.exp(s - lg[..., rows].unsqueeze(-1).to(acc))
            dv += torch.matmul(p.transpose(-1, -2), doc).sum(2, keepdim=True)
            dp = torch.matmul(doc, vg.transpose(-1, -2))
            delta = (doc * og[..., rows, :].to(acc)).sum(-1, keepdim=True)
            ds = p * (dp - delta) * scale
            dq[..., rows, :] = torch.matmul(ds, kg)
            dk += torch.matmul(ds.transpose(-1, -2), qc).sum(2, keepdim=True)
        dq = dq.permute(0, 3, 1, 2, 4).reshape(b, sq, h, d).to(q.dtype)
        dk = dk.squeeze(2).permute(0, 2, 1, 3).to(k.dtype)
        dv = dv.squeeze(2).permute(0, 2, 1, 3).to(v.dtype)
        return dq, dk, dv


# Plain attention in flash-attn's terms: no dropout, no sliding window, no softcap, no ALiBi.
_FLASH_PLAIN = dict(
    dropout_p=0.0, window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None
)


class FlashAttnKernel:
    """flash-attn 2.x kernels. Their private signatures moved between releases, so arguments
    are passed by name and only those the installed version accepts."""

    name = "flash-attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_interface as fa

        self._fwd = fa._flash_attn_forward
        self._bwd = fa._flash_attn_backward
        self._fwd_params = inspect.signature(self._fwd).parameters
        self._bwd_params = inspect.signature(self._bwd).parameters

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


def _flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def select_kernel(q: Tensor) -> BlockKernel:
    """The fastest kernel that handles q's device and dtype (or the one RINGATTN_KERNEL names)."""
    forced = os.environ.get("RINGATTN_KERNEL", "").strip().lower()
    if forced == "chunked":
        return ChunkedKernel()
    if forced == "torch":
        return TorchCPUKernel()
    if forced == "flash":
        return FlashAttnKernel()
    if forced:
        raise ValueError(f"RINGATTN_KERNEL={forced!r}: expected flash, torch or chunked")
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and _flash_attn_available():
        return FlashAttnKernel()
    if q.device.type == "cpu" and hasattr(
        torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"
    ):
        return TorchCPUKernel()
    return ChunkedKernel()


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
