"""Before a job scores its corpus: does this model on this ring give the model's own numbers?

Every family can hide something the scorer does not know about (a new logit scaling, a layer
that mixes tokens without attention, a mask that ring attention does not see). So every job
first runs a probe: ``PROBE_TOKENS`` seeded random tokens (more, to cross a sliding window of
up to ``PROBE_WINDOW_MAX``, so the ring's window is checked too; fewer when the model has a
length limit), sharded across all ranks in the job's layout (so positions cross every
shard boundary, and the length is not a multiple of the shard count: padding is exercised),
scored exactly as a document is. Rank 0 then runs the unmodified model (its own forward pass,
stock ``sdpa`` attention, ``eager`` if the model has no sdpa) on the whole probe in one
process, and compares per-token log-probabilities. A difference above the tolerance refuses the
job on every rank, naming the model type and the size of the error.

Tolerance, fit to the dtype and to the model: the larger of a floor and 4 times the model's own
rounding noise in that dtype, measured as the same difference between its stock sdpa and eager
forward passes on the probe (two correct implementations of the same model: a deep model's
noise is larger than a tiny one's). float32 / float64 compare the largest per-token difference,
floor 1e-4 / 1e-9 (the ring merges softmax partials in another order than one softmax:
~1e-6 after a tiny model; the faults this catches move log-probabilities by 3e-4 to 1, see
tests/test_longdoc_compat.py). bfloat16 / float16 compare the mean per-token difference (the
largest is dominated by rounding), floor 2e-2 / 5e-3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .compat import length_limit, model_type, sliding_window
from .scoring import BypassError

PROBE_TOKENS = 251  # prime: never a multiple of the number of shards
# A sliding window up to this long is crossed by the probe (window + WINDOW_EXTRA tokens), so
# the ring's windowed blocks are checked against the model itself before any document.
PROBE_WINDOW_MAX = 8192
WINDOW_EXTRA = 67
PROBE_SEED = 20240229
FLOOR = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}
NOISE_FACTOR = 4.0


@dataclass
class ProbeResult:
    error: str  # "" when the model agrees (the same on every rank after agree)
    message: str  # what rank 0 measured, for the log
    tokens: int = 0
    measured: float = float("nan")
    tolerance: float = float("nan")


def probe_ids(vocab_size: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randint(0, int(vocab_size), (n,), generator=gen)


def probe_length(model) -> int:
    """PROBE_TOKENS; longer to cross a sliding window of at most PROBE_WINDOW_MAX; shorter
    where the model has a length limit (compat.length_limit)."""
    n = PROBE_TOKENS
    slide = sliding_window(model.config)
    if slide is not None and slide <= PROBE_WINDOW_MAX:
        n = max(n, _next_prime(slide + WINDOW_EXTRA))  # prime, as 251: padding is exercised
    limit = length_limit(model.config)
    return max(2, min(n, limit)) if limit else n


def _next_prime(n: int) -> int:
    while n < 2 or any(n % d == 0 for d in range(2, math.isqrt(n) + 1)):
        n += 1
    return n


def _metric(dtype_name: str, got: torch.Tensor, want: torch.Tensor) -> float:
    diff = (got.double() - want.double()).abs()
    if not torch.isfinite(diff).all():
        return float("inf")
    return float(diff.max() if dtype_name in ("float32", "float64") else diff.mean())


def stock_logprobs(model, ids: torch.Tensor, implementation: str) -> torch.Tensor:
    """log p(ids[i+1] | ids[..i]) from the model's own forward pass with a stock attention."""
    device = next(model.parameters()).device
    model.set_attn_implementation(implementation)
    try:
        with torch.no_grad():
            logits = model(input_ids=ids[None].to(device), use_cache=False).logits[0].float()
    finally:
        model.set_attn_implementation("ringattn")
    return logits.log_softmax(-1)[:-1].gather(-1, ids[1:, None].to(device))[:, 0].cpu()


def _reference(model, ids: torch.Tensor, dtype_name: str) -> tuple[torch.Tensor, float]:
    """(stock log-probs, the model's own sdpa-vs-eager noise in this dtype, or 0)."""
    try:
        sdpa = stock_logprobs(model, ids, "sdpa")
    except (ValueError, ImportError):
        return stock_logprobs(model, ids, "eager"), 0.0
    try:
        eager = stock_logprobs(model, ids, "eager")
    except (ValueError, ImportError):
        return sdpa, 0.0
    return sdpa, _metric(dtype_name, eager, sdpa)


def _compare(model, ids, pieces, dtype_name: str, world: int) -> ProbeResult:
    n = int(ids.numel())
    got = torch.full((n,), float("nan"), dtype=torch.float64)
    for positions, logprob in pieces:
        got[positions] = logprob.double()
    want, noise = _reference(model, ids, dtype_name)
    measured = _metric(dtype_name, got[:-1], want)
    tol = max(FLOOR[dtype_name], NOISE_FACTOR * noise)
    kind = "max" if dtype_name in ("float32", "float64") else "mean"
    what = (
        f"model type {model_type(model.config)!r}, {n} probe tokens on {world} ranks, "
        f"{dtype_name}: {kind} |log p(ring) - log p(model's own forward)| = {measured:.3g} "
        f"(tolerance {tol:.3g})"
    )
    error = "" if measured <= tol else f"the model does not agree with itself on the ring: {what}"
    return ProbeResult(error, f"probe: {what}", n, measured, tol)


def run_probe(model, *, group, layout: str, dtype_name: str, chunk_size: int) -> ProbeResult:
    """Score the probe on every rank, compare on rank 0 (collective: every rank calls it).

    Every rank returns the same ``error`` (the verdict is all-gathered); ``message`` and the
    figures are rank 0's.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    ids = probe_ids(model.config.get_text_config().vocab_size, probe_length(model))
    mine, failure = None, ""
    from .sharding import is_sharded, release, run_task_sharded

    sharded = is_sharded(model)
    try:
        with torch.no_grad():
            r = run_task_sharded("score", model, ids, group=group, layout=layout,
                                 chunk_size=chunk_size)  # fmt: skip
        mine = (r.tensors["positions"], r.tensors["token_logprob"])
    except (BypassError, ValueError) as err:
        failure = f"refused on the probe: {err}"
    every: list = [None] * world
    dist.all_gather_object(every, (mine, failure), group=group)
    failures = [f for _, f in every if f]
    if failures:
        return ProbeResult(failures[0], failures[0])
    result = ProbeResult("", "")
    if rank == 0 or sharded:  # a sharded model's own forward needs every rank's shard
        result = _compare(model, ids, [m for m, _ in every], dtype_name, world)
        if sharded:
            release(model)
    verdict = [result.error]
    if world > 1:
        dist.broadcast_object_list(
            verdict, src=dist.get_global_rank(group, 0) if group else 0, group=group
        )
    result.error = verdict[0]
    return result
