"""The three tasks on one document, each rank holding one shard of it.

Every rank calls the same function with the whole document's token ids (every rank tokenises
the whole document: a tokenizer cannot cut a text at shard boundaries). The document of N
tokens is padded at its end to a length the layout can split (``ringattn.padded_length``) with
token 0; under the causal mask padding cannot change any earlier token, and padded positions
are dropped from every output. Each rank feeds its shard with the shard's *global* position ids
(zigzag order included), ``use_cache=False``, inside ``ringattn.hf.ring_settings`` (the process
group, the layout, and the document's real length for windows and length-dependent RoPE).
Every forward counts its attention calls: one that skipped ring attention in some layer is
refused (``BypassError``).

Outputs of a rank cover the real (unpadded) positions it holds, in its local order, and are
returned as ``ShardResult.tensors`` (what the rank writes) and ``ShardResult.stats`` (document
totals, equal on every rank after an all-reduce):

``score``
    ``token_logprob[i] = log p(x[pos_i + 1] | x[0..pos_i])`` in float32: the log-probability of
    the *next* token, shifted globally (the label of a chunk's last position is the first token
    of the next chunk in sequence order, held by another rank: every rank all-gathers the first
    token of its chunks). The document's last position has no next token: NaN there.
    Stats: ``n_scored = max(N - 1, 0)``, ``log_likelihood`` (sum over the scored tokens,
    float64) and ``perplexity = exp(-log_likelihood / n_scored)`` (None when n_scored = 0).
    The first token is context only (the byte tokenizer adds no BOS).
``embed``
    ``hidden``: the last hidden states (after the final norm), model dtype; ``pooled``: the mean
    of ``hidden`` over all N tokens, float32, carried by rank 0 only.
``grad``
    Forward and backward of the mean next-token NLL over the document (``loss = -LL /
    n_scored``); parameter gradients are all-reduced (summed) over the ring, so every rank
    ends with the gradient of the whole document. Tensors as ``score``; stats add ``loss`` and
    ``grad_norms`` (L2 norm per parameter group, see ``param_group``) and ``grad_norm``.

All tensors carry ``positions`` (int64 global positions) and ``input_ids``.

Edge cases: an empty document (N = 0) runs no model: every rank returns empty tensors,
``n_scored = 0``, ``log_likelihood = 0.0``, ``perplexity = None``, ``pooled`` = NaN, ``loss =
None`` and zero gradients. A one-token document runs the model (padded to 2P tokens in zigzag)
and scores nothing (``n_scored = 0``, as above), but has a hidden state.

The model's output head (``output_head``: ``lm_head`` and the model's own logit scaling and
soft-capping) and the log-softmax run over ``chunk_size`` positions at a time, so
vocabulary-sized logits never exist for the whole shard; in ``grad`` each chunk is
checkpointed (recomputed in backward), so they are not kept for backward either.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from ringattn import padded_length, sequence_positions, shard_sequence
from ringattn.hf import count_calls, ring_settings

from ..model.compat import sliding_layers, sliding_window, window_refusal
from ..model.load import attention_layers, decoder
from . import MODES

PAD_ID = 0


@dataclass
class Shard:
    """This rank's part of one (padded) document."""

    ids: torch.Tensor  # (S_local,) int64, padded
    positions: torch.Tensor  # (S_local,) int64 global positions, local order
    n_tokens: int  # N, the real length
    padded: int  # the padded length

    @property
    def real(self) -> torch.Tensor:
        return self.positions < self.n_tokens


@dataclass
class ShardResult:
    tensors: dict[str, torch.Tensor]
    stats: dict[str, Any]
    seconds: float = 0.0
    grads: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    packing: dict | None = None  # a packed document's packing (compute/packing.py)


def comm_device(group) -> torch.device:
    """Where collective tensors must live: the current GPU under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_shard(ids: torch.Tensor, *, rank: int, world_size: int, layout: str) -> Shard:
    n = int(ids.numel())
    padded = padded_length(max(n, 1), world_size=world_size, layout=layout)
    full = torch.full((padded,), PAD_ID, dtype=torch.int64)
    full[:n] = ids
    kw = dict(world_size=world_size, rank=rank, layout=layout)
    return Shard(
        ids=shard_sequence(full, dim=0, **kw),
        positions=sequence_positions(padded, **kw),
        n_tokens=n,
        padded=padded,
    )


def next_token_labels(shard: Shard, group) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels, valid): the global next token of each local position, and where it is real.

    Inside a chunk the next token is local; after a chunk's last position it is the first
    token of the next chunk, which every rank learns from one all_gather of chunk heads.
    """
    world = dist.get_world_size(group)
    pos, ids = shard.positions, shard.ids
    # The shard is one or two runs of consecutive positions (zigzag's middle rank: one).
    starts = torch.cat(
        [torch.zeros(1, dtype=torch.long), (pos[1:] != pos[:-1] + 1).nonzero()[:, 0] + 1]
    )
    ends = torch.cat([starts[1:] - 1, torch.tensor([pos.numel() - 1])])
    mine = torch.full((2, 2), -1, dtype=torch.int64)  # (position, token) of each run's head
    mine[: len(starts), 0], mine[: len(starts), 1] = pos[starts], ids[starts]
    if world > 1:
        mine = mine.to(comm_device(group))
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine, group=group)
        mine = torch.cat(every).cpu()
    head_token = {p: t for p, t in mine.tolist() if p >= 0}
    labels = torch.full_like(ids, PAD_ID)
    labels[:-1] = ids[1:]
    for e in ends.tolist():  # after a run's last position: the head of another run, or the end
        labels[e] = head_token.get(int(pos[e]) + 1, PAD_ID)
    valid = pos < shard.n_tokens - 1
    return labels, valid


def _chunk_logprob(head, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = head(h)
    return logits.gather(-1, labels[:, None])[:, 0] - logits.logsumexp(-1)


def chunked_logprobs(
    model, hidden: torch.Tensor, labels: torch.Tensor, *, chunk_size: int, grad: bool = False
) -> torch.Tensor:
    """log p(labels[i]) at each row of hidden (S, H), ``chunk_size`` rows at a time."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    head = output_head(model)
    pieces = []
    for start in range(0, hidden.shape[0], chunk_size):
        h, lab = hidden[start : start + chunk_size], labels[start : start + chunk_size]
        if grad:
            pieces.append(checkpoint(_chunk_logprob, head, h, lab, use_reentrant=False))
        else:
            pieces.append(_chunk_logprob(head, h, lab))
    if not pieces:
        return torch.zeros(0, dtype=torch.float32)
    return torch.cat(pieces)


class BypassError(RuntimeError):
    """The model did not run ring attention in every attention layer."""


def forward_hidden(model, shard: Shard, *, group, layout: str) -> torch.Tensor:
    """The last hidden states of this rank's shard, with ring attention in every layer.

    The document's real length reaches the attention layers (windows) and length-dependent
    RoPE; the attention calls are counted, and a forward in which some attention layer did not
    go through ring attention (it attended over this shard alone) is refused.
    """
    device = next(model.parameters()).device
    settings = dict(group=group, layout=layout, seq_len=shard.n_tokens)
    with ring_settings(model=model, **settings), count_calls() as counted:
        out = decoder(model)(
            input_ids=shard.ids[None].to(device),
            position_ids=shard.positions[None].to(device),
            use_cache=False,
        )
    want = attention_layers(model)
    if len(counted.layers) != want:
        raise BypassError(
            f"model type {model.config.model_type!r}: ring attention ran in "
            f"{len(counted.layers)} of the model's {want} layers; the others attend (or recur) "
            "over each rank's shard alone, which gives wrong numbers: this model is not supported"
        )
    check_windowed_layers(model, len(counted.windowed), shard.n_tokens)
    return out.last_hidden_state[0]


def check_windowed_layers(model, passed: int, n_tokens: int) -> None:
    """A config with a sliding window whose layers did not pass it to the attention call would
    be scored with full attention: refused once the document is longer than the window. The
    one rule of scoring (``forward_hidden``) and training (``train.step.sequence_backward``,
    ``n_tokens``: the sequence's longest piece) alike."""
    window = sliding_window(model.config)
    want = sliding_layers(model.config)
    if window is None or n_tokens <= window or passed == want:
        return
    raise BypassError(
        f"model type {model.config.model_type!r}: its config gives {want} layers a sliding "
        f"window of {window}, but {passed} passed it to the attention call, so ring attention "
        f"cannot tell which to window over this {n_tokens}-token document: refused (if the "
        "model ignores the field, set task.model_overrides.sliding_window=null)"
    )


def all_sum(values: list[float], group) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=comm_device(group))
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t.cpu().tolist()


def score_stats(log_likelihood: float, n_scored: int) -> dict[str, Any]:
    ppl = math.exp(-log_likelihood / n_scored) if n_scored > 0 else None
    return {"n_scored": n_scored, "log_likelihood": log_likelihood, "perplexity": ppl}


def param_group(name: str) -> str:
    """Parameter group of a parameter name: per decoder layer sub-module, else its module.

    ``model.layers.3.self_attn.q_proj.weight`` -> ``model.layers.3.self_attn``;
    ``model.embed_tokens.weight`` -> ``model.embed_tokens``; ``lm_head.weight`` -> ``lm_head``.
    """
    parts = name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        return ".".join(parts[: i + 3])
    return ".".join(parts[:-1]) or name


def _embed(model, shard: Shard, tensors: dict, *, group, layout: str) -> None:
    """hidden (this rank's real positions) and, on rank 0, pooled (the document's mean)."""
    world, rank, n = dist.get_world_size(group), dist.get_rank(group), shard.n_tokens
    param = next(model.parameters())
    hidden_size = model.config.hidden_size
    if n == 0:
        hidden = torch.zeros(0, hidden_size, dtype=param.dtype, device=param.device)
    else:
        with torch.no_grad():
            hidden = forward_hidden(model, shard, group=group, layout=layout)
        hidden = hidden[shard.real.to(param.device)].contiguous()
    local_sum = hidden.float().sum(0).double()
    if world > 1:
        dist.all_reduce(local_sum, group=group)
    tensors["hidden"] = hidden.cpu()
    if rank == 0:
        pooled = (local_sum / n).float().cpu() if n else torch.full((hidden_size,), math.nan)
        tensors["pooled"] = pooled


def score_shard(model, shard: Shard, *, group, layout: str, chunk_size: int, grad: bool):
    """(token_logprob of this rank's real positions, this rank's log-likelihood sum)."""
    device = next(model.parameters()).device
    with torch.set_grad_enabled(grad):
        if shard.n_tokens == 0:
            return torch.zeros(0, dtype=torch.float32), torch.zeros((), dtype=torch.float64)
        labels, valid = next_token_labels(shard, group)
        labels, valid = labels.to(device), valid.to(device)
        hidden = forward_hidden(model, shard, group=group, layout=layout)
        lp_all = chunked_logprobs(model, hidden, labels, chunk_size=chunk_size, grad=grad)
        ll_local = lp_all[valid].double().sum()
        lp = torch.where(valid, lp_all.detach(), torch.full_like(lp_all, float("nan")))
        return lp[shard.real.to(device)].cpu(), ll_local


def _grad_stats(model, ll_local, ll: float, n_scored: int, group, keep: bool):
    """(stats: loss, per-group and total gradient norms; the gradients if kept, else None)."""
    grads = _backward(model, ll_local, n_scored, group)
    norms: dict[str, float] = {}
    for name, g in grads.items():
        key = param_group(name)
        norms[key] = norms.get(key, 0.0) + float(g.double().pow(2).sum())
    stats = {
        "loss": -ll / n_scored if n_scored else None,
        "grad_norms": {k: math.sqrt(v) for k, v in norms.items()},
        "grad_norm": math.sqrt(sum(norms.values())),
    }
    return stats, ({k: v.cpu() for k, v in grads.items()} if keep else None)


def run_task(
    task: str,
    model,
    ids: torch.Tensor,
    *,
    group,
    layout: str,
    chunk_size: int = 4096,
    keep_grads: bool = False,
) -> ShardResult:
    """Run mode ``task`` on one document (all of its token ids) on this rank of ``group``."""
    if task not in MODES:
        raise ValueError(f"task must be one of {', '.join(MODES)}, not {task!r}")
    start = time.perf_counter()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    ids = ids.to(torch.int64).flatten()
    n = int(ids.numel())
    too_long = window_refusal(model.config, n)
    if too_long:  # every rank holds the whole document's ids: every rank raises alike
        raise ValueError(too_long)
    shard = make_shard(ids, rank=rank, world_size=world, layout=layout)
    tensors: dict[str, torch.Tensor] = {
        "positions": shard.positions[shard.real].clone(),
        "input_ids": shard.ids[shard.real].clone(),
    }
    stats: dict[str, Any] = {"n_tokens": n}
    grads = None
    if task == "embed":
        _embed(model, shard, tensors, group=group, layout=layout)
    else:
        lp, ll_local = score_shard(
            model, shard, group=group, layout=layout, chunk_size=chunk_size, grad=task == "grad"
        )
        (ll,) = all_sum([float(ll_local.detach())], group)
        tensors["token_logprob"] = lp.detach().float().contiguous()
        n_scored = max(n - 1, 0)
        stats.update(score_stats(ll, n_scored))
        if task == "grad":
            more, grads = _grad_stats(model, ll_local, ll, n_scored, group, keep_grads)
            stats.update(more)
    return ShardResult(tensors, stats, time.perf_counter() - start, grads)


def _backward(model, ll_local: torch.Tensor, n_scored: int, group) -> dict[str, torch.Tensor]:
    """Backward of this rank's part of the mean NLL; gradients summed over the ring."""
    model.zero_grad(set_to_none=True)
    if n_scored > 0:
        (-ll_local / n_scored).backward()
    world = dist.get_world_size(group)
    grads: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        g = g.detach().contiguous()
        if world > 1:
            dist.all_reduce(g, group=group)
        grads[name] = g
    model.zero_grad(set_to_none=True)
    return grads


def output_head(model) -> Callable[[torch.Tensor], torch.Tensor]:
    """hidden (S, H) -> logits (S, V) in float32, or float64 for a float64 model (cast to
    float32, a float64 job's loss and gradients were float32's, ~1e-7 off), as the model's own
    forward computes them.

    Scoring never builds vocabulary-sized logits for a whole shard, so it cannot call the
    causal LM's ``forward`` (which computes them all at once). It applies the output
    embedding itself, and must then also apply what the model does to the logits after it, or
    the log-probabilities are those of another model: Cohere / Cohere 2 ``logits *
    logit_scale``; Granite ``logits / config.logits_scaling``; Gemma 2 / 3 and others final
    soft-capping, ``cap * tanh(logits / cap)``. What a family does beyond these is caught by
    the job's probe (``probe.py``), which compares these log-probabilities with the model's own
    forward pass before any document is scored."""
    head = model.get_output_embeddings()
    cfg = model.config
    scale = getattr(model, "logit_scale", None)
    if not isinstance(scale, (int, float)):
        scale = None
    divide = getattr(cfg, "logits_scaling", None)
    cap = getattr(cfg, "final_logit_softcapping", None)

    def logits(h: torch.Tensor) -> torch.Tensor:
        out = head(h)
        if scale is not None:
            out = out * scale
        if divide not in (None, 1, 1.0):
            out = out / divide
        out = out.to(torch.promote_types(out.dtype, torch.float32))  # float64 stays so
        if cap is not None:
            out = torch.tanh(out / cap) * cap
        return out

    return logits
