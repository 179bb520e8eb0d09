"""Inputs, the independent reference, and the ring run for ring attention tests.

The reference is textbook attention on the whole sequence in float64 (scores, mask, softmax,
autograd), with GQA heads repeated explicitly: nothing it does is shared with the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Case:
    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    causal: bool
    layout: str
    seed: int = 0

    @property
    def id(self) -> str:
        return (
            f"b{self.batch}-n{self.seq}-h{self.heads}kv{self.kv_heads}-d{self.head_dim}-"
            f"{self.dtype}-{'causal' if self.causal else 'full'}-{self.layout}"
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def make_inputs(case: Case) -> dict[str, torch.Tensor]:
    """Global q, k, v and upstream gradient, identical in every process (seeded CPU RNG)."""
    g = torch.Generator().manual_seed(case.seed)
    shape_q = (case.batch, case.seq, case.heads, case.head_dim)
    shape_kv = (case.batch, case.seq, case.kv_heads, case.head_dim)
    # Scaled so the softmax is neither uniform nor one-hot: exercises the lse merge.
    make = lambda shape, s: (torch.randn(shape, generator=g) * s).to(case.torch_dtype)  # noqa: E731
    return {
        "q": make(shape_q, 1.5),
        "k": make(shape_kv, 1.5),
        "v": make(shape_kv, 1.0),
        "dout": make(shape_q, 1.0),
    }


def reference(inputs: dict[str, torch.Tensor], causal: bool) -> dict[str, torch.Tensor]:
    q, k, v = (inputs[n].double().requires_grad_() for n in ("q", "k", "v"))
    groups = q.shape[2] // k.shape[2]
    kr, vr = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kr) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[1]
        future = torch.ones(n, n, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vr)
    out.backward(inputs["dout"].double())
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref|: scale-free, and dominated by the worst element."""
    return ((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def ring_outputs(rank: int, world: int, cases: list[Case]) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's out, dq, dk, dv of ring attention for each case (runs inside a spawned rank)."""
    import ringattn

    results = {}
    for case in cases:
        inputs = make_inputs(case)
        shard = {
            name: ringattn.shard_sequence(t, world_size=world, rank=rank, layout=case.layout)
            for name, t in inputs.items()
        }
        q, k, v = (shard[n].requires_grad_() for n in ("q", "k", "v"))
        out = ringattn.ring_attention(q, k, v, causal=case.causal, layout=case.layout)
        out.backward(shard["dout"])
        results[case.id] = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return results
