"""One optimizer step of the training job, the same on every rank.

The step's loss is the mean over its predicted tokens, wherever they are: every rank adds up
``-log p`` over the labelled rows it holds of its ring's sequences, divides by the step's
predicted tokens in the whole job (every rank packs every sequence of the step, so it knows
them), and backpropagates that; the gradients are then summed over the job. So each token
weighs the same whatever the packing, the number of rings, or how a ring's sequences are
accumulated: the loss and the weights depend on the config, not on the cluster's shape (the
failure the anchors' users report most: a mean of per-rank or per-sequence means).

A ring's rank runs its sequence's forward *and* backward inside the ring's settings
(``ringattn.hf.ring_settings``), so activation checkpointing can recompute attention in the
backward. With ``model.shard: job`` the model is FSDP2-sharded over all ranks and summed by its
reduce-scatter; otherwise every rank holds the whole model and the gradients are summed by one
all-reduce of a flat buffer.
"""

from __future__ import annotations

import itertools
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ringattn import pack_sequence, sequence_positions
from ringattn.hf import count_calls, ring_settings

from ..longdoc.compute.scoring import BypassError, check_windowed_layers, chunked_logprobs
from ..longdoc.model.load import attention_layers, decoder
from .data import IGNORE, PackedSequence


@dataclass(frozen=True)
class RingSeat:
    """Where this rank sits: its ring (group, size, rank in it, index among the rings) and
    the job's group (None: the default group)."""

    group: Any
    size: int
    rank: int
    index: int
    rings: int
    job_group: Any = None


@dataclass(frozen=True)
class StepOptions:
    layout: str
    balance_window: int | None  # the model's sliding window: what the packed layout balances
    chunk_size: int  # rows per output-head chunk
    clip: float  # max gradient norm (0: no clipping)
    autocast: torch.dtype | None  # bfloat16 compute over float32 weights, or None


@dataclass(frozen=True)
class StepResult:
    loss: float  # mean over the step's predicted tokens
    tokens: int  # predicted tokens
    grad_norm: float  # before clipping
    seconds: float


def rank_rows(seq: PackedSequence, seat: RingSeat, opts: StepOptions):
    """This rank's rows of ``seq`` in the ring's packed layout: (ids, labels, positions within
    each piece, the packing). Rows the layout adds are padding: id 0, no label, position 0."""
    packing = pack_sequence(
        seq.cu_seqlens, world_size=seat.size, layout=opts.layout, balance_window=opts.balance_window
    )
    where = sequence_positions(
        len(seq.ids), world_size=seat.size, rank=seat.rank, layout=opts.layout, cu_seqlens=packing
    )
    real = where >= 0
    index = where.clamp(min=0)
    ids = torch.where(real, seq.ids[index], 0)
    labels = torch.where(real, seq.labels[index], IGNORE)
    positions = torch.where(real, seq.positions[index], 0)
    return ids, labels, positions, packing


def sequence_backward(
    model, seq: PackedSequence, seat: RingSeat, opts: StepOptions, denominator: int, longest: int
) -> float:
    """Forward and backward of this rank's rows of one sequence, the loss scaled by
    1 / ``denominator`` (the step's predicted tokens); returns this rank's unscaled sum of
    ``-log p`` (float). Refused before the backward, as scoring refuses it, when ring
    attention missed a layer or a layer windows through its mask alone (PhiMoE, Qwen2-MoE:
    they would train with full attention over a piece longer than the window). ``longest``:
    the step's longest piece, in every ring's sequences, so every ring refuses at the same
    step (one that refused alone would leave the others waiting in the gradients' sum)."""
    device = next(model.parameters()).device
    ids, labels, positions, packing = rank_rows(seq, seat, opts)
    mixed = torch.autocast(device.type, dtype=opts.autocast) if opts.autocast else nullcontext()
    with ring_settings(group=seat.group, layout=opts.layout, cu_seqlens=packing, model=model):
        with count_calls() as counted, mixed:
            hidden = decoder(model)(
                input_ids=ids[None].to(device),
                position_ids=positions[None].to(device),
                use_cache=False,
            ).last_hidden_state[0]
            valid = (labels != IGNORE).to(device)
            targets = labels.clamp(min=0).to(device)
            logp = chunked_logprobs(model, hidden, targets, chunk_size=opts.chunk_size, grad=True)
            nll = -(logp * valid).sum()
        _check_every_layer(model, counted)
        check_windowed_layers(model, len(counted.windowed), longest)
        (nll / denominator).backward()
    return float(nll.detach())


def _check_every_layer(model, counted) -> None:
    want = attention_layers(model)
    if len(counted.layers) != want:
        raise BypassError(
            f"model type {model.config.model_type!r}: ring attention ran in "
            f"{len(counted.layers)} of the model's {want} layers: not supported for training"
        )


def sum_gradients(model, group) -> None:
    """Sum every gradient over the job (a model every rank holds whole), in one all-reduce of
    a flat buffer. A parameter no rank's loss reached counts as zeros."""
    if dist.get_world_size(group) == 1:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n


def job_sum(value: float, group) -> float:
    """``value`` summed over the job's ranks (float64 on the CPU: gloo and NCCL alike)."""
    if dist.get_world_size(group) == 1:
        return value
    from ..longdoc.compute.scoring import comm_device

    t = torch.tensor([value], dtype=torch.float64, device=comm_device(group))
    dist.all_reduce(t, group=group)
    return float(t.item())


def train_step(
    model,
    optimizer,
    scheduler,
    sequences: list[PackedSequence],
    mine: range,
    seat: RingSeat,
    opts: StepOptions,
    sharded: bool,
) -> StepResult:
    """One optimizer step over the step's ``sequences`` (every ring's), of which this ring
    trains those at ``mine``."""
    started = time.perf_counter()
    tokens = sum(seq.predicted for seq in sequences)
    optimizer.zero_grad(set_to_none=True)
    longest = max(b - a for seq in sequences for a, b in itertools.pairwise(seq.cu_seqlens))
    nll = sum(sequence_backward(model, sequences[i], seat, opts, tokens, longest) for i in mine)
    if not sharded:
        sum_gradients(model, seat.job_group)
    norm = _clip(model, opts.clip)
    optimizer.step()
    scheduler.step()
    loss = job_sum(nll, seat.job_group) / tokens
    return StepResult(loss, tokens, norm, time.perf_counter() - started)


def _clip(model, clip: float) -> float:
    """The gradients' global norm before clipping (FSDP2's DTensors reduce it over the job)."""
    params = [p for p in model.parameters() if p.grad is not None]
    limit = clip if clip > 0 else math.inf
    norm = torch.nn.utils.clip_grad_norm_(params, limit)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)
