"""Inputs, the independent reference, the ring runs and the tolerances of the ring attention tests.

The reference is textbook attention on the whole sequence in float64 (scores, mask, softmax,
autograd), with GQA heads repeated explicitly: nothing it does is shared with the engine.
Attention sinks (gpt-oss) are an extra score column per head, softmaxed with the rest and then
dropped, exactly as the model's eager attention does it.

Tolerances: every engine test's, here and nowhere else (`bounds`, `compare`); each test's
docstring says which apply to it and points here. All are relative to the largest value of the
reference (`relative_error`).
- float32: FP32_TOL = 2e-5. The ring adds one rescaling per step to what a single kernel does,
  so it should agree with the float64 reference about as well as float32 attention itself does:
  a few ulps times sqrt(sequence length) in the worst element, well under 2e-5 at these sizes
  (observed: ~1e-6). The sink gradient is a sum over every row of the sequence: its float32
  rounding grows with the number of terms, still far below 2e-5 here. Packed sequences are held
  to PACKED_FP32_TOL = 2e-4 (the packed-sequences issue's bar; the engine reaches about 1e-6
  there too).
- float64 (windowed rings): FP64_TOL = 1e-10; the ring reorders sums, nothing more.
- bfloat16: the inputs are the same bf16 tensors for both, so the reference is exact for them;
  the ring must then be no worse than PyTorch's own bf16 attention (SDPA, one process, with the
  document mask when packed) on the same inputs, within a factor 2 plus one bf16 ulp
  (BF16_ULP = 2**-8): `within_sdpa`. Its per-step outputs are merged in float32 but each block
  kernel and the final output round to bf16. With sinks, out/dq/dk/dv are held to the SDPA
  bound of the same inputs without sinks (a sink only scales each row by a float32 factor
  before the one bf16 rounding of the output); the bf16 sink gradient is not compared (a sum of
  terms of both signs, whose bf16 rounding is not bounded relative to the sum): the float32
  cases check it.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

# The tolerances (the module docstring says why each).
FP32_TOL = 2e-5
PACKED_FP32_TOL = 2e-4
FP64_TOL = 1e-10
BF16_ULP = 2.0**-8


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
    sinks: bool = False  # one learned sink logit per query head
    window: int | None = None  # sliding window: query i sees keys i - window < j <= i
    docs: tuple[int, ...] | None = None  # packed document lengths (sum = seq)

    @property
    def id(self) -> str:
        return (
            f"b{self.batch}-n{self.seq}-h{self.heads}kv{self.kv_heads}-d{self.head_dim}-"
            f"{self.dtype}-{'causal' if self.causal else 'full'}-{self.layout}"
            + ("-sinks" if self.sinks else "")
            + (f"-w{self.window}" if self.window is not None else "")
            + (
                f"-docs{len(self.docs)}x{zlib.crc32(repr(self.docs).encode()):x}"
                if self.docs
                else ""
            )
        )

    @property
    def cu_seqlens(self) -> list[int] | None:
        """[0, l1, l1 + l2, ..., N] of the packed documents (None: one plain sequence)."""
        if self.docs is None:
            return None
        cu = [0]
        for n in self.docs:
            cu.append(cu[-1] + n)
        assert cu[-1] == self.seq, "a packed case's seq is the sum of its documents"
        return cu

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
    inputs = {
        "q": make(shape_q, 1.5),
        "k": make(shape_kv, 1.5),
        "v": make(shape_kv, 1.0),
        "dout": make(shape_q, 1.0),
    }
    if case.sinks:  # about the size of the scores, so the sink takes a real share of each row
        # float32 (a model's parameter beside bf16 activations), float64 in a float64 case:
        # its gradient comes back in its own dtype, which float64's bound must not be given
        sink_dtype = torch.float64 if case.torch_dtype == torch.float64 else torch.float32
        inputs["sinks"] = (torch.randn(case.heads, generator=g) * 2.0 + 1.0).to(sink_dtype)
    return inputs


def reference(
    inputs: dict[str, torch.Tensor], causal: bool, window: int | None = None
) -> dict[str, torch.Tensor]:
    # copies: .double() of a float64 input is the input itself, whose gradient then summed
    # over every call (packed_reference's documents share the sinks)
    fresh = lambda t: t.detach().to(torch.float64, copy=True).requires_grad_()  # noqa: E731
    q, k, v = (fresh(inputs[n]) for n in ("q", "k", "v"))
    groups = q.shape[2] // k.shape[2]
    kr, vr = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kr) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[1]
        future = torch.ones(n, n, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    if window is not None:  # keys at or before i - window are out of reach
        n = q.shape[1]
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        scores = scores.masked_fill(j <= i - window, float("-inf"))
    sinks = None
    if "sinks" in inputs:
        sinks = fresh(inputs["sinks"])
        column = sinks[None, :, None, None].expand(*scores.shape[:3], 1)
        probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vr)
    out.backward(inputs["dout"].double())
    result = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    if sinks is not None:
        result["dsinks"] = sinks.grad
    return result


def sdpa_bf16_error(case: Case, inputs, ref, device: str = "cpu") -> dict[str, float]:
    """PyTorch's own attention (SDPA, one process) on the same bf16 inputs: its error against
    the float64 reference is what a bf16 ring is held to (`bounds`)."""
    import torch.nn.functional as F

    q, k, v = (
        inputs[n].to(device).transpose(1, 2).detach().requires_grad_() for n in ("q", "k", "v")
    )
    out = F.scaled_dot_product_attention(q, k, v, is_causal=case.causal, enable_gqa=True)
    out.backward(inputs["dout"].to(device).transpose(1, 2))
    mine = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return {n: relative_error(t.detach().transpose(1, 2).cpu(), ref[n]) for n, t in mine.items()}


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref|: scale-free, and dominated by the worst element."""
    return ((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def ring_outputs(
    rank: int, world: int, cases: list[Case], device: str = "cpu"
) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's out, dq, dk, dv of ring attention for each case (runs inside a spawned rank)."""
    import ringattn

    results = {}
    for case in cases:
        inputs = {n: t.to(device) for n, t in make_inputs(case).items()}
        sinks = inputs.pop("sinks", None)
        shard = {
            name: ringattn.shard_sequence(t, world_size=world, rank=rank, layout=case.layout)
            for name, t in inputs.items()
        }
        q, k, v = (shard[n].requires_grad_() for n in ("q", "k", "v"))
        kw = {} if sinks is None else {"sinks": sinks.requires_grad_()}
        out = ringattn.ring_attention(
            q, k, v, causal=case.causal, layout=case.layout, window=case.window, **kw
        )
        out.backward(shard["dout"])
        results[case.id] = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
        if sinks is not None:  # this rank's share of the gradient
            results[case.id]["dsinks"] = sinks.grad
    return results


def local_ring_outputs(
    case: Case, world: int, device: str = "cpu", *, strided_head_dim: bool = False
) -> dict[str, torch.Tensor]:
    """out, dq, dk, dv (and dsinks) of a LocalRing of ``world`` virtual ranks, unsharded.
    ``strided_head_dim``: q, k, v given as views whose head_dim has stride 2 (same values)."""
    import ringattn
    from ringattn.local_ring import LocalRing

    inputs = make_inputs(case)
    sinks = inputs.pop("sinks", None)
    # The ranks' shards one after another, as LocalRing takes them.
    stacked = {
        name: torch.cat(
            [
                ringattn.shard_sequence(t, world_size=world, rank=r, layout=case.layout)
                for r in range(world)
            ],
            dim=1,
        ).to(device)
        for name, t in inputs.items()
    }
    if strided_head_dim:  # every other element of a twice-as-wide tensor: stride 2 in head_dim
        for n in ("q", "k", "v"):
            t = stacked[n]
            stacked[n] = torch.stack([t, torch.zeros_like(t)], dim=-1).flatten(-2)[..., ::2]
            assert stacked[n].stride(-1) == 2 and torch.equal(stacked[n], t)
    q, k, v = (stacked[n].requires_grad_() for n in ("q", "k", "v"))
    kw = {} if sinks is None else {"sinks": sinks.to(device).requires_grad_()}
    out = ringattn.ring_attention(
        q,
        k,
        v,
        causal=case.causal,
        layout=case.layout,
        comm=LocalRing(world),
        window=case.window,
        **kw,
    )
    out.backward(stacked["dout"])
    got = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    result = {
        name: ringattn.unshard_sequence(list(t.cpu().chunk(world, dim=1)), layout=case.layout)
        for name, t in got.items()
    }
    if sinks is not None:
        result["dsinks"] = kw["sinks"].grad.cpu()
    return result


def packed_reference(
    inputs: dict[str, torch.Tensor], docs, causal: bool, window: int | None = None
) -> dict[str, torch.Tensor]:
    """Each document alone through ``reference`` (float64), joined back in packed order; the
    sink gradient summed over the documents. Nothing here knows about packing but slicing."""
    parts, start = [], 0
    for n in docs:
        doc = {name: t[:, start : start + n] for name, t in inputs.items() if name != "sinks"}
        if "sinks" in inputs:
            doc["sinks"] = inputs["sinks"]
        if n:
            parts.append(reference(doc, causal, window))
        start += n
    joined = {
        name: torch.cat([p[name] for p in parts], dim=1) for name in ("out", "dq", "dk", "dv")
    }
    if "sinks" in inputs:
        joined["dsinks"] = sum(p["dsinks"] for p in parts)
    return joined


def packed_sdpa_bf16_error(case: Case, inputs, ref, device: str = "cpu") -> dict[str, float]:
    """PyTorch's own SDPA (one process) on the same bf16 inputs with the document mask: what a
    packed bf16 ring is held to (`bounds`)."""
    import torch.nn.functional as F

    n = case.seq
    doc = torch.repeat_interleave(torch.arange(len(case.docs)), torch.tensor(case.docs))
    mask = doc[:, None] == doc[None, :]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    if case.causal:
        mask &= j <= i
    if case.window is not None:
        mask &= j > i - case.window
    q, k, v = (
        inputs[n_].to(device).transpose(1, 2).detach().requires_grad_() for n_ in ("q", "k", "v")
    )
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(device), enable_gqa=True)
    out.backward(inputs["dout"].to(device).transpose(1, 2))
    mine = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return {
        name: relative_error(t.detach().transpose(1, 2).cpu(), ref[name])
        for name, t in mine.items()
    }


def packed_ring_outputs(
    rank: int, world: int, cases: list[Case], packing_form=None
) -> dict[str, dict]:
    """This rank's out, dq, dk, dv (and dsinks share) of packed cases on a gloo ring; the
    packing passed as ``packing_form(rank, world, case)`` gives it (default: an int32
    tensor of the case's cu_seqlens)."""
    import ringattn

    results = {}
    for case in cases:
        inputs = make_inputs(case)
        sinks = inputs.pop("sinks", None)
        cu = case.cu_seqlens
        shard = {
            name: ringattn.shard_sequence(
                t, world_size=world, rank=rank, layout=case.layout, cu_seqlens=cu
            )
            for name, t in inputs.items()
        }
        q, k, v = (shard[n].requires_grad_() for n in ("q", "k", "v"))
        kw = {} if sinks is None else {"sinks": sinks.requires_grad_()}
        out = ringattn.ring_attention(
            q,
            k,
            v,
            causal=case.causal,
            layout=case.layout,
            window=case.window,
            cu_seqlens=(
                torch.tensor(cu, dtype=torch.int32)
                if packing_form is None
                else packing_form(rank, world, case)
            ),
            **kw,
        )
        out.backward(shard["dout"])
        results[case.id] = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
        if sinks is not None:
            results[case.id]["dsinks"] = sinks.grad
    return results


def unshard_packed(per_rank: list[dict], case: Case) -> dict[str, torch.Tensor]:
    """The ranks' packed results joined into the N packed tokens (dsinks summed)."""
    import ringattn

    names = [n for n in per_rank[0] if n != "dsinks"]
    joined = {
        n: ringattn.unshard_sequence(
            [r[n] for r in per_rank], layout=case.layout, cu_seqlens=case.cu_seqlens
        )
        for n in names
    }
    if "dsinks" in per_rank[0]:
        joined["dsinks"] = sum(r["dsinks"] for r in per_rank)
    return joined


def packed_local_ring_outputs(
    case: Case, world: int, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """out, dq, dk, dv (and dsinks) of a packed case on a LocalRing, joined in packed order
    (on the CPU whatever ``device`` ran it)."""
    import ringattn
    from ringattn.local_ring import LocalRing

    inputs = {n: t.to(device) for n, t in make_inputs(case).items()}
    sinks = inputs.pop("sinks", None)
    cu = case.cu_seqlens
    stacked = {
        name: torch.cat(
            [
                ringattn.shard_sequence(
                    t, world_size=world, rank=r, layout=case.layout, cu_seqlens=cu
                )
                for r in range(world)
            ],
            dim=1,
        )
        for name, t in inputs.items()
    }
    q, k, v = (stacked[n].requires_grad_() for n in ("q", "k", "v"))
    kw = {} if sinks is None else {"sinks": sinks.requires_grad_()}
    out = ringattn.ring_attention(
        q,
        k,
        v,
        causal=case.causal,
        layout=case.layout,
        comm=LocalRing(world),
        window=case.window,
        cu_seqlens=cu,
        **kw,
    )
    out.backward(stacked["dout"])
    got = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    per_rank = [{n: t.cpu().chunk(world, dim=1)[r] for n, t in got.items()} for r in range(world)]
    result = unshard_packed(per_rank, case)
    if sinks is not None:
        result["dsinks"] = kw["sinks"].grad.cpu()
    for name, t in got.items():  # padding rows: zero output and gradients, never NaN
        assert torch.isfinite(t).all(), f"{name} holds non-finite values"
    return result


# ----------------------------------------------------------------------------- tolerances
def within_sdpa(sdpa_error: float, ulp: float = BF16_ULP) -> float:
    """The bound of a half-precision result: twice the error of PyTorch's own SDPA on the same
    inputs, plus one ulp of the dtype (bf16's by default)."""
    return 2 * sdpa_error + ulp


def bounds(case: Case, inputs: dict[str, torch.Tensor], device: str = "cpu") -> dict[str, float]:
    """The bound each output of ``case`` is held to (the module docstring says why): one fixed
    tolerance per output in float32 and float64 (the sink gradient included); in bfloat16,
    `within_sdpa` of SDPA's error (on ``device``) on the same inputs without sinks, and no
    bound for the sink gradient, which is then not compared."""
    packed = case.docs is not None
    if case.dtype != "bfloat16":
        fp32 = PACKED_FP32_TOL if packed else FP32_TOL
        tol = {"float32": fp32, "float64": FP64_TOL}[case.dtype]
        names = ("out", "dq", "dk", "dv", *(("dsinks",) if "sinks" in inputs else ()))
        return dict.fromkeys(names, tol)
    plain = {n: t for n, t in inputs.items() if n != "sinks"}
    if packed:
        ref = packed_reference(plain, case.docs, case.causal, case.window)
        sdpa = packed_sdpa_bf16_error(case, plain, ref, device)
    else:  # SDPA and its reference both without the window: SDPA's own rounding is the measure
        sdpa = sdpa_bf16_error(case, plain, reference(plain, case.causal), device)
    return {name: within_sdpa(err) for name, err in sdpa.items()}


def compare(
    case: Case, got: dict[str, torch.Tensor], device: str = "cpu"
) -> dict[str, tuple[float, float]]:
    """(relative error, bound) of each output of ``got`` that ``case`` holds to a bound, against
    the float64 reference (packed cases: each document alone). Each output must have the
    case's dtype (the sink gradient its sinks' dtype: ``make_inputs``)."""
    inputs = make_inputs(case)
    if case.docs is None:
        ref = reference(inputs, case.causal, case.window)
    else:
        ref = packed_reference(inputs, case.docs, case.causal, case.window)
    result = {}
    for name, bound in bounds(case, inputs, device).items():
        value = got[name]
        want = inputs["sinks"].dtype if name == "dsinks" else case.torch_dtype
        assert value.dtype == want, f"{case.id} {name}: {value.dtype}, expected {want}"
        result[name] = (relative_error(value.cpu(), ref[name]), bound)
    return result


def failures(label: str, case: Case, compared: dict[str, tuple[float, float]]) -> list[str]:
    """One line per output of ``compare``'s result over its bound, ``label`` (the ring) first."""
    where = f"{label} {case.id}" if label else case.id
    return [
        f"{where} {name}: error {err:.2e} > {bound:.2e}"
        for name, (err, bound) in compared.items()
        if not err <= bound
    ]
