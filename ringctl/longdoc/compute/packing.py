"""Short documents in one forward: packed end to end into one ring sequence.

A ring scoring one short document at a time pays a ring's steps and per-layer collectives for
a few tokens per rank. Here consecutive documents of a ring's queue are packed into one
sequence (``cu_seqlens``, flash-attn's convention) and go through the model once; the ring
gives each document attention over itself only (``ringattn``'s packed layouts: the balanced
``zigzag``, or ``contiguous``), each row's position is its position within its own document,
and each document's labels are its own next tokens, so every document's outputs are those it
gets alone (to float rounding): no document's last token predicts the next one's first.

Which models pack (``can_pack``): ``score`` and ``embed`` (``grad`` takes each document's own
gradients; a packed backward would sum them), with any attention window (inside each
document) and sinks, but not RoPE scaled by the sequence's length (dynamic, longrope): a pack's
documents would share one scaling, so those run one document per sequence. A pack holds at
most the per-rank token budget times the ring's ranks (the packed layout gives every rank
``ceil(N / P)`` rows) and ``MAX_DOCUMENTS`` documents.

Each document's shards record the packing (``packing_record``: the pack's ``cu_seqlens``, the
document's index in it and the window the layout balanced for), from which gather recomputes
the rows each rank must hold (``output/completeness.py``).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from ringattn import pack_sequence, sequence_positions
from ringattn.hf import LENGTH_DEPENDENT_ROPE, count_calls, ring_settings, rope_types

from ..model.compat import sliding_layers, sliding_window
from ..model.load import attention_layers, decoder
from .scoring import PAD_ID, BypassError, ShardResult, chunked_logprobs, comm_device, score_stats

MAX_DOCUMENTS = 256  # documents per pack: each gets its own sums and outputs


def can_pack(model, mode: str) -> bool:
    """Whether documents of this model and mode may share a forward."""
    if mode not in ("score", "embed"):
        return False
    for module in model.modules():
        kinds = rope_types(module).values()
        if any(k in LENGTH_DEPENDENT_ROPE or "dynamic" in k for k in kinds):
            return False
    return True


def balance_window(model) -> int | None:
    """What the packed layout balances for: the model's window when every layer has it."""
    window = sliding_window(model.config)
    if window is None or sliding_layers(model.config) != attention_layers(model):
        return None
    return window


def fits(lengths: list[int], *, ring_size: int, budget: int) -> bool:
    """Whether these documents packed into one sequence fit the ring under the budget."""
    return len(lengths) <= MAX_DOCUMENTS and -(-sum(lengths) // ring_size) <= budget


def packing_record(cu: list[int], index: int, window: int | None) -> dict[str, Any]:
    """What a packed document's shard entry records (completeness.py checks it)."""
    return {"cu_seqlens": list(cu), "index": index, "balance_window": window}


def run_pack(
    mode: str, model, docs: list[torch.Tensor], *, group, layout: str, chunk_size: int = 4096
) -> list[ShardResult]:
    """``scoring.run_task`` for several non-empty documents packed in one sequence: one
    result per document, with its ``packing`` record."""
    start = time.perf_counter()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    cu = [0]
    for d in docs:
        cu.append(cu[-1] + int(d.numel()))
    ids = torch.cat([d.reshape(-1).to(torch.int64) for d in docs])
    window = balance_window(model)
    packing = pack_sequence(cu, world_size=world, layout=layout, balance_window=window)
    where = sequence_positions(
        cu[-1], world_size=world, rank=rank, layout=layout, cu_seqlens=packing
    )
    with torch.no_grad():
        hidden = _forward(model, ids, where, cu, packing, group=group, layout=layout)
        docs_of = _rows_by_document(where, cu)
        if mode == "embed":
            results = _embed(hidden, ids, where, docs_of, cu, group)
        else:
            results = _score(model, hidden, ids, where, docs_of, cu, group, chunk_size)
    elapsed, total = time.perf_counter() - start, max(1, cu[-1])
    for i, r in enumerate(results):  # one forward ran them all: each its share by tokens
        r.seconds = elapsed * (cu[i + 1] - cu[i]) / total  # (an equal share told a document
        r.packing = packing_record(cu, i, window)  # of 29 tokens it took as long as 7,860)
    return results


def _documents(where: torch.Tensor, cu: list[int]) -> torch.Tensor:
    """The document of each local row (padding rows: 0, masked by ``where >= 0``)."""
    return torch.bucketize(where.clamp(min=0), torch.tensor(cu[1:]), right=True)


def _forward(model, ids, where, cu, packing, *, group, layout: str) -> torch.Tensor:
    """This rank's last hidden states (S_local, H); ring attention counted in every layer."""
    device = next(model.parameters()).device
    real = where >= 0
    doc_start = torch.tensor(cu[:-1])[_documents(where, cu)]
    local_ids = torch.where(real, ids[where.clamp(min=0)], PAD_ID)
    positions = torch.where(real, where - doc_start, 0)
    with ring_settings(group=group, layout=layout, cu_seqlens=packing, model=model):
        with count_calls() as counted:
            out = decoder(model)(
                input_ids=local_ids[None].to(device),
                position_ids=positions[None].to(device),
                use_cache=False,
            )
    if len(counted.layers) != attention_layers(model):
        raise BypassError(
            f"model type {model.config.model_type!r}: ring attention ran in "
            f"{len(counted.layers)} of the model's {attention_layers(model)} layers"
        )
    return out.last_hidden_state[0]


def _rows_by_document(where: torch.Tensor, cu: list[int]) -> list[torch.Tensor]:
    """Each document's local rows (indices), in local order."""
    docs = _documents(where, cu)
    return [((docs == i) & (where >= 0)).nonzero()[:, 0] for i in range(len(cu) - 1)]


def _base(where, ids, rows, start: int) -> dict[str, torch.Tensor]:
    return {"positions": where[rows] - start, "input_ids": ids[where[rows]].clone()}


def _score(model, hidden, ids, where, docs_of, cu, group, chunk_size) -> list[ShardResult]:
    """Each document's log-probabilities of its own next tokens (none after its last)."""
    device = hidden.device
    nxt = torch.cat([ids[1:], ids.new_full((1,), PAD_ID)])
    doc_end = torch.tensor(cu[1:])[_documents(where, cu)]
    valid_all = (where >= 0) & (where + 1 < doc_end)  # a document's last token: no label
    labels = torch.where(where >= 0, nxt[where.clamp(min=0)], PAD_ID)
    lp_all = chunked_logprobs(model, hidden, labels.to(device), chunk_size=chunk_size).cpu()
    per_doc, sums = [], []
    for i, rows in enumerate(docs_of):
        valid = valid_all[rows]
        lp = torch.where(valid, lp_all[rows], torch.full_like(lp_all[rows], float("nan")))
        tensors = {**_base(where, ids, rows, cu[i]), "token_logprob": lp.float().contiguous()}
        per_doc.append(tensors)
        sums.append(lp_all[rows][valid].double().sum())
    totals = _ring_sum(torch.stack(sums), group)
    return [
        ShardResult(t, {"n_tokens": cu[i + 1] - cu[i], **score_stats(ll, cu[i + 1] - cu[i] - 1)})
        for i, (t, ll) in enumerate(zip(per_doc, totals.tolist(), strict=True))
    ]


def _embed(hidden, ids, where, docs_of, cu, group) -> list[ShardResult]:
    """Each document's hidden states, and (on the ring's rank 0) their mean over all of it."""
    rank = dist.get_rank(group)
    kept = [hidden[rows.to(hidden.device)].contiguous() for rows in docs_of]
    sums = _ring_sum(torch.stack([h.float().sum(0).double() for h in kept]), group)
    out = []
    for i, rows in enumerate(docs_of):
        n = cu[i + 1] - cu[i]
        tensors = {**_base(where, ids, rows, cu[i]), "hidden": kept[i].cpu()}
        if rank == 0:
            tensors["pooled"] = (sums[i] / n).float()
        out.append(ShardResult(tensors, {"n_tokens": n}))
    return out


def _ring_sum(values: torch.Tensor, group) -> torch.Tensor:
    values = values.to(comm_device(group))
    if dist.get_world_size(group) > 1:
        dist.all_reduce(values, group=group)
    return values.cpu()
