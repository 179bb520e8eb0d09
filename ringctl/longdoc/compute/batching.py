"""Short documents in one forward: the rows of a batch, right-padded to one length.

A ring scoring one short document at a time pays a ring's steps and per-layer collectives for
a few tokens per rank. Here several documents (rows) go through the model at once, each
right-padded to the batch's common padded length L: under a causal mask no real token sees a
padding token, so padding changes none of a row's outputs. Every row keeps its own labels,
statistics and outputs, written as that document's shards; the entries record L
(``padded_tokens``), whose layout the shards follow, so gather reassembles each document.

Only ``score`` and ``embed`` batch (``grad`` takes each document's own gradients), and only
models whose outputs cannot depend on the sequence's length: no length-dependent RoPE
(dynamic, longrope, ...) and no attention window (`can_batch`). Rows are formed from
consecutive documents of a ring's queue while rows x L / ring size stays within the per-rank
token budget.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from ringattn import padded_length, sequence_positions, shard_sequence
from ringattn.hf import LENGTH_DEPENDENT_ROPE, count_calls, ring_settings, rope_types

from ..model.compat import window
from ..model.load import attention_layers, decoder
from .scoring import (
    PAD_ID,
    BypassError,
    Shard,
    ShardResult,
    chunked_logprobs,
    comm_device,
    next_token_labels,
    score_stats,
)

MAX_ROWS = 64


def can_batch(model, mode: str) -> bool:
    """Whether documents of this model and mode may share a forward."""
    if mode not in ("score", "embed") or window(model.config) is not None:
        return False
    for module in model.modules():
        kinds = rope_types(module).values()
        if any(k in LENGTH_DEPENDENT_ROPE or "dynamic" in k for k in kinds):
            return False
    return True


def batches(lengths: list[int], *, ring_size: int, layout: str, budget: int) -> list[list[int]]:
    """Consecutive runs of document indices whose rows fit the per-rank token budget; an
    empty document, or one that alone fills the budget, stays on its own."""
    out: list[list[int]] = []
    run: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        if n == 0:
            out += [run] if run else []
            out.append([i])
            run, longest = [], 0
            continue
        width = padded_length(max(longest, n), world_size=ring_size, layout=layout)
        if run and ((len(run) + 1) * width // ring_size > budget or len(run) >= MAX_ROWS):
            out.append(run)
            run, longest = [], 0
        run.append(i)
        longest = max(longest, n)
    return out + ([run] if run else [])


def _forward_rows(
    model, ids: torch.Tensor, positions: torch.Tensor, *, group, layout: str, seq_len: int
) -> torch.Tensor:
    """Last hidden states (B, S_local, H) of the rows, ring attention counted in every layer."""
    device = next(model.parameters()).device
    rows = ids.shape[0]
    with (
        ring_settings(group=group, layout=layout, seq_len=seq_len, model=model),
        count_calls() as counted,
    ):
        out = decoder(model)(
            input_ids=ids.to(device),
            position_ids=positions[None].expand(rows, -1).to(device),
            use_cache=False,
        )
    if len(counted.layers) != attention_layers(model):
        raise BypassError(
            f"model type {model.config.model_type!r}: ring attention ran in "
            f"{len(counted.layers)} of the model's {attention_layers(model)} layers"
        )
    return out.last_hidden_state


def run_batch(
    mode: str, model, docs: list[torch.Tensor], *, group, layout: str, chunk_size: int = 4096
) -> list[ShardResult]:
    """``scoring.run_task`` for several non-empty documents at once: one result per row, as
    run_task gives for that document alone (up to float rounding)."""
    start = time.perf_counter()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    lengths = [int(d.numel()) for d in docs]
    width = padded_length(max(lengths), world_size=world, layout=layout)
    rows = torch.full((len(docs), width), PAD_ID, dtype=torch.int64)
    for b, d in enumerate(docs):
        rows[b, : lengths[b]] = d.to(torch.int64).flatten()
    kw = {"world_size": world, "rank": rank, "layout": layout}
    local, positions = shard_sequence(rows, dim=1, **kw), sequence_positions(width, **kw)
    shards = [Shard(local[b], positions, n, width) for b, n in enumerate(lengths)]
    with torch.no_grad():
        hidden = _forward_rows(
            model, local, positions, group=group, layout=layout, seq_len=max(lengths)
        )
        if mode == "embed":
            results = _embed_rows(model, hidden, shards, group)
        else:
            results = _score_rows(model, hidden, shards, group, chunk_size)
    seconds = (time.perf_counter() - start) / len(docs)
    for r in results:
        r.seconds = seconds
    return results


def _base_tensors(shard: Shard) -> dict[str, torch.Tensor]:
    return {
        "positions": shard.positions[shard.real].clone(),
        "input_ids": shard.ids[shard.real].clone(),
    }


def _score_rows(model, hidden, shards: list[Shard], group, chunk_size: int) -> list[ShardResult]:
    device = hidden.device
    per_row: list[tuple[dict[str, Any], torch.Tensor]] = []
    for b, shard in enumerate(shards):
        labels, valid = next_token_labels(shard, group)
        labels, valid = labels.to(device), valid.to(device)
        lp_all = chunked_logprobs(model, hidden[b], labels, chunk_size=chunk_size)
        tensors = _base_tensors(shard)
        lp = torch.where(valid, lp_all, torch.full_like(lp_all, float("nan")))
        tensors["token_logprob"] = lp[shard.real.to(device)].float().cpu().contiguous()
        per_row.append((tensors, lp_all[valid].double().sum()))
    sums = torch.stack([ll for _, ll in per_row]).to(comm_device(group))
    if dist.get_world_size(group) > 1:
        dist.all_reduce(sums, group=group)
    results = []
    for (tensors, _), ll, shard in zip(per_row, sums.cpu().tolist(), shards, strict=True):
        stats = {"n_tokens": shard.n_tokens, **score_stats(ll, max(shard.n_tokens - 1, 0))}
        results.append(ShardResult(tensors, stats))
    return results


def _embed_rows(model, hidden, shards: list[Shard], group) -> list[ShardResult]:
    rank = dist.get_rank(group)
    kept = [hidden[b][s.real.to(hidden.device)].contiguous() for b, s in enumerate(shards)]
    sums = torch.stack([h.float().sum(0).double() for h in kept]).to(comm_device(group))
    if dist.get_world_size(group) > 1:
        dist.all_reduce(sums, group=group)
    results = []
    for b, shard in enumerate(shards):
        tensors = {**_base_tensors(shard), "hidden": kept[b].cpu()}
        if rank == 0:
            tensors["pooled"] = (sums[b] / shard.n_tokens).float().cpu()
        results.append(ShardResult(tensors, {"n_tokens": shard.n_tokens}))
    return results
