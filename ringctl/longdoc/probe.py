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
job on every rank, naming the model type and the size of the error. A probe that fails is
said in one line that names whose failure it is: where the model's own forward pass (no
ringattn) fails as well, the model cannot run (its config, or transformers); else it is ring
attention's; a model whose layers build their own attention mask is refused as such. A probe
whose numbers are not finite is refused too, naming which side: the model's own forward pass
(a weight or a config value that is not finite: the first token and hidden state that are
not finite are named) or the ring's.

Tolerance, fit to the dtype and to the model: the larger of a floor and 4 times the model's own
rounding noise in that dtype, measured as the same difference between its stock sdpa and eager
forward passes on the probe (two correct implementations of the same model: a deep model's
noise is larger than a tiny one's; where only one of them runs, or gives finite numbers, the
floor: the noise never makes the tolerance infinite). float32 / float64
compare the largest per-token difference, floor 1e-4 / 1e-9 (the ring merges softmax partials
in another order than one softmax: ~1e-6 after a tiny model; the faults this catches move
log-probabilities by 3e-4 to 1, see tests/test_longdoc_compat.py; float64's noise is float32's
rounding of the log-probabilities the outputs keep, not eager's: ``STORED_EPS``). bfloat16 /
float16 compare
the mean per-token difference (the largest is dominated by rounding), floor 2e-2 / 5e-3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .compute.scoring import BypassError
from .consensus import from_lead
from .model.compat import length_limit, model_type, sliding_window

PROBE_TOKENS = 251  # prime: never a multiple of the number of shards
# A sliding window up to this long is crossed by the probe (window + WINDOW_EXTRA tokens), so
# the ring's windowed blocks are checked against the model itself before any document.
PROBE_WINDOW_MAX = 8192
WINDOW_EXTRA = 67
PROBE_SEED = 20240229
FLOOR = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}
# float64's noise is not sdpa against eager: transformers' eager attention runs its softmax in
# float32 whatever the dtype (9.5e-6 on the bundled model: a tolerance of 3.8e-5). It is the
# rounding of the log-probabilities the ring's outputs hold, in float32 (the format's
# token_logprob): STORED_EPS of the largest (a ring within 1e-13 of the model lands within one
# float32 step of it; the tolerance 4 x that, 3.8e-6 on the bundled model).
STORED_EPS = 2.0**-23
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


def probe_tolerance(dtype_name: str, noise: float | None) -> float:
    """The floor, or NOISE_FACTOR times the model's own noise where that is larger; a noise
    that is not a finite number (never measured so, but a tolerance of inf or NaN would pass
    anything) counts as unmeasured."""
    floor = FLOOR[dtype_name]
    if noise is None or not math.isfinite(noise):
        return floor
    return max(floor, NOISE_FACTOR * noise)


def _first_not_finite(values: torch.Tensor) -> int | None:
    """The first index (along dim 0) whose values are not all finite, or None."""
    bad = ~torch.isfinite(values.reshape(values.shape[0], -1)).all(-1)
    return int(bad.nonzero()[0, 0]) if bad.any() else None


def stock_logprobs(model, ids: torch.Tensor, implementation: str) -> torch.Tensor:
    """log p(ids[i+1] | ids[..i]) from the model's own forward pass with a stock attention."""
    device = next(model.parameters()).device
    model.set_attn_implementation(implementation)
    try:
        with torch.no_grad():
            logits = model(input_ids=ids[None].to(device), use_cache=False).logits[0]
    finally:
        model.set_attn_implementation("ringattn")
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # as output_head
    return logits.log_softmax(-1)[:-1].gather(-1, ids[1:, None].to(device))[:, 0].cpu()


def _state_name(k: int, layers: int) -> str:
    if k == 0:
        return "the embeddings"
    if k < layers:
        return f"layer {k}'s output (of {layers})"
    return f"layer {layers}'s output after the final norm (the last)"


def where_not_finite(model, ids: torch.Tensor, implementation: str) -> str:
    """Where the model's own forward pass first gives a value that is not finite: the first
    hidden state (embeddings, then each layer's output) holding one, and its first token;
    else the logits. One more forward, run only once the log-probabilities were not finite."""
    device = next(model.parameters()).device
    model.set_attn_implementation(implementation)
    try:
        with torch.no_grad():
            out = model(input_ids=ids[None].to(device), use_cache=False, output_hidden_states=True)
    except Exception as err:  # noqa: BLE001 - the model's own code; the place stays unknown
        return f"(where, unknown: {_one_line(err)})"
    finally:
        model.set_attn_implementation("ringattn")
    states = list(out.hidden_states or [])
    for k, state in enumerate(states):
        token = _first_not_finite(state[0])
        if token is not None:
            return f"at token {token}, first in {_state_name(k, len(states) - 1)}"
    token = _first_not_finite(out.logits[0].float())
    return f"at token {token} of the logits" if token is not None else "in the log-softmax"


class OwnForwardError(RuntimeError):
    """The model's own forward pass (transformers, stock attention, no ringattn) fails."""


class OwnForwardNotFinite(OwnForwardError):
    """The model's own forward pass runs, but its log-probabilities are not finite."""


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"


def _reference(model, ids: torch.Tensor, dtype_name: str) -> tuple[torch.Tensor, float | None]:
    """(stock log-probs, the model's own sdpa-vs-eager noise in this dtype, or None when only
    one of them runs, or gives finite numbers: gpt-oss has no sdpa; transformers' eager path
    fails on some configs that sdpa runs, e.g. DeepSeek-V2 with 2 KV heads). OwnForwardError
    when neither runs, OwnForwardNotFinite when neither gives finite numbers: then the model
    itself cannot run, whatever ring attention does."""
    runs, failed = {}, []
    for implementation in ("sdpa", "eager"):
        try:
            runs[implementation] = stock_logprobs(model, ids, implementation)
        except Exception as err:  # noqa: BLE001 - the model's own code: any failure is its own
            failed.append(f"{implementation}: {_one_line(err)}")
    if not runs:
        raise OwnForwardError("; ".join(failed))
    finite = {k: v for k, v in runs.items() if bool(torch.isfinite(v).all())}
    if not finite:
        implementation = next(iter(runs))
        where = where_not_finite(model, ids, implementation)
        raise OwnForwardNotFinite(f"{where} (with {implementation} attention)")
    want = next(iter(finite.values()))  # sdpa's where it runs
    if dtype_name == "float64":  # see STORED_EPS
        return want, STORED_EPS * float(want.abs().max()) if want.numel() else None
    if len(finite) == 1:
        return want, None
    return want, _metric(dtype_name, finite["eager"], finite["sdpa"])


def _compare(model, ids, pieces, dtype_name: str, world: int) -> ProbeResult:
    n = int(ids.numel())
    got = torch.full((n,), float("nan"), dtype=torch.float64)
    for positions, logprob in pieces:
        got[positions] = logprob.double()
    try:
        want, noise = _reference(model, ids, dtype_name)
    except OwnForwardError as err:
        why = _own_failure(model, err)
        return ProbeResult(why, why)
    token = _first_not_finite(got[:-1])
    if token is not None:
        why = _ring_not_finite(model, token, got[token].item(), dtype_name)
        return ProbeResult(why, why)
    measured = _metric(dtype_name, got[:-1], want)
    tol = probe_tolerance(dtype_name, noise)
    kind = "max" if dtype_name in ("float32", "float64") else "mean"
    noise_said = "; its noise unmeasured: only one stock attention runs" if noise is None else ""
    if dtype_name == "float64" and noise is not None:
        noise_said = "; its noise: float32's rounding of the log-probabilities kept"
    what = (
        f"model type {model_type(model.config)!r}, {n} probe tokens on {world} "
        f"rank{'s' * (world != 1)}, "
        f"{dtype_name}: {kind} |log p(ring) - log p(model's own forward)| = {measured:.3g} "
        f"(tolerance {tol:.3g}{noise_said})"
    )
    error = "" if measured <= tol else f"the model does not agree with itself on the ring: {what}"
    return ProbeResult(error, f"probe: {what}", n, measured, tol)


def _ring_not_finite(model, token: int, value: float, dtype_name: str) -> str:
    return (
        f"model type {model_type(model.config)!r}, {dtype_name}: the ring's log-probability "
        f"of probe token {token + 1} is {value} (not finite), where transformers' own forward "
        "pass gives finite ones: an error of ringctl's scorer or ringattn, not the model's; "
        "nothing was scored"
    )


def _own_failure(model, err: OwnForwardError) -> str:
    if isinstance(err, OwnForwardNotFinite):
        return (
            f"model type {model_type(model.config)!r}: the model's own forward pass "
            f"(transformers, without ringattn) gives non-finite values {err}: a weight or a "
            "config value that is not finite (a corrupt checkpoint, task.model_overrides), "
            "not ring attention, is at fault; nothing was scored"
        )
    return (
        f"model type {model_type(model.config)!r}: the model itself cannot run: transformers' "
        f"own forward pass fails without ringattn ({err}); its config or transformers, not "
        "ring attention, is at fault: not supported"
    )


def _ring_failure(model, ids, kind: str, detail: str, dtype_name: str) -> str:
    """The probe's ring run failed with ``detail``: whose error it is, in one line.

    ``kind``: "bypass" (the scorer's own refusal: attention calls counted), "mask" (the model
    built an attention mask: the job gives none), "refusal" (a ValueError), "error" (any other).
    The model's own forward pass on the probe tells the model's errors from ringattn's.
    """
    if kind == "bypass":
        return f"refused on the probe: {detail}"
    if kind == "mask":
        return (
            f"model type {model_type(model.config)!r}: its layers build an attention mask of "
            "their own and pass it to the attention call (the job gives none); ring attention "
            "applies only the causal mask of one whole document and cannot honour it: not "
            "supported"
        )
    try:
        _reference(model, ids, dtype_name)
    except OwnForwardError as err:
        return _own_failure(model, err)
    if kind == "refusal":
        return f"refused on the probe: {detail}"
    return (
        f"model type {model_type(model.config)!r}: scoring on the ring failed on the probe where "
        f"transformers' own forward pass runs ({detail}): an error of ringctl's scorer or "
        "ringattn, not the model's"
    )


def _score_probe(model, ids, group, layout: str, chunk_size: int):
    """(positions, log-probs) of this rank's shard, and ("", "") or (kind, one line)."""
    from ringattn.hf import AttentionMaskError

    from .compute.fsdp import run_task_sharded

    try:
        with torch.no_grad():
            r = run_task_sharded(
                "score", model, ids, group=group, layout=layout, chunk_size=chunk_size
            )
        return (r.tensors["positions"], r.tensors["token_logprob"]), ("", "")
    except BypassError as err:
        return None, ("bypass", str(err))
    except AttentionMaskError as err:
        return None, ("mask", str(err))
    except ValueError as err:
        return None, ("refusal", str(err))
    except Exception as err:  # noqa: BLE001 - said in one line, whose it is (_ring_failure)
        return None, ("error", _one_line(err))


def run_probe(model, *, group, layout: str, dtype_name: str, chunk_size: int) -> ProbeResult:
    """Score the probe on every rank, compare on rank 0 (collective: every rank calls it).

    Every rank returns the same ``error`` (the verdict is broadcast); ``message`` and the
    figures are rank 0's. A failure on the ring is said in one line that names whose it is.
    """
    from .compute.fsdp import is_sharded, release

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    ids = probe_ids(model.config.get_text_config().vocab_size, probe_length(model))
    sharded = is_sharded(model)
    mine, failure = _score_probe(model, ids, group, layout, chunk_size)
    every: list = [None] * world
    dist.all_gather_object(every, (mine, failure), group=group)
    failures = [f for _, f in every if f[0]]
    result = ProbeResult("", "")
    if rank == 0 or sharded:  # a sharded model's own forward needs every rank's shard
        if failures:
            error = _ring_failure(model, ids, *failures[0], dtype_name)
            result = ProbeResult(error, error)
        else:
            result = _compare(model, ids, [m for m, _ in every], dtype_name, world)
        if sharded:
            release(model)
    result.error = from_lead(result.error, group)
    return result
