"""The planner's memory per rank of a training step against what a real one holds.

Two ranks on gloo run the training job's own step (``train.step.train_step``: the ring, the
chunked loss, the gradient sum, AdamW) on a tiny Llama; a dispatch mode counts the tensor
storage each rank allocates and holds (``tests/live_bytes.LiveBytes``, DTensor wrappers
passed over: their local shards are counted), beside the weights and optimizer state held
before the step. The planner (``memory_phases`` of the job's workload) must be within 10%
of that peak. Before the fix (a read-only review of the planner) it priced 0.88x (float32,
weight-heavy: the gradient sum's flat copy unpriced), 0.74x (bfloat16: priced as a
half-precision model, where the job runs autocast over float32 weights, every layer's cast
kept) and 0.70x (the same under FSDP).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.live_bytes import LiveBytes

HEAVY = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2)
LONG = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)


class _LocalBytes(LiveBytes):
    """LiveBytes over plain tensors only: a DTensor (FSDP's parameters and gradients) is a
    wrapper whose storage cannot be read; its local shard's ops count as they run."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        plain = [t for t in _tensors((args, kwargs, out)) if type(t) is torch.Tensor]
        if len(plain) < len(_tensors((args, kwargs, out))):
            return out
        return super().__torch_dispatch__(lambda *a, **k: out, types, args, kwargs)


def _tensors(value):
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _held_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        t = getattr(t, "_local_tensor", t)
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _step_peak(rank: int, world: int, shape: dict, seq: int, bf16: bool, shard: bool, ckpt) -> int:
    from ringctl.longdoc.compute.fsdp import shard_model
    from ringctl.train.data import Cursor, SequenceStream
    from ringctl.train.optim import make_optimizer, make_scheduler
    from ringctl.train.step import RingSeat, StepOptions, train_step
    from tests.train_reference import tiny_model

    torch.set_num_threads(1)
    model = tiny_model(
        "ringattn", vocab_size=512, intermediate_size=shape["hidden_size"] * 11 // 4, **shape
    ).train()
    if ckpt:  # the job's task.activation_checkpointing
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if shard:
        shard_model(model, mode="job")
    optimizer = make_optimizer(model, lr=1e-3, weight_decay=0.1)
    scheduler = make_scheduler(optimizer, warmup_steps=1, max_steps=10, min_lr_ratio=0.1)
    opts = StepOptions("zigzag", None, 1024, 1.0, torch.bfloat16 if bf16 else None)
    seat = RingSeat(None, world, rank, 0, 1, None)
    doc = torch.randint(0, 512, (seq,), generator=torch.Generator().manual_seed(0))
    stream, cursor = SequenceStream(lambda i: doc, 1, seq, seed=1), Cursor()
    for measured in (False, True):  # the first step makes the optimizer's state
        sequences, cursor = stream.take(cursor, 1)
        if not measured:
            train_step(model, optimizer, scheduler, sequences, range(1), seat, opts, shard)
            optimizer.zero_grad(set_to_none=True)
            continue
        state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        held = _held_bytes([*model.parameters(), *state])
        with _LocalBytes() as mode:
            train_step(model, optimizer, scheduler, sequences, range(1), seat, opts, shard)
    return held + mode.peak


def _planned(shape: dict, seq: int, bf16: bool, shard: bool, ckpt: bool) -> float:
    from ringctl.planner.cost import Workload, memory_phases, peak_phase
    from ringctl.planner.model import from_hf_config
    from tests.train_reference import TINY

    data = {**TINY, "vocab_size": 512, "intermediate_size": shape["hidden_size"] * 11 // 4}
    m = from_hf_config({**data, **shape, "model_type": "llama"}, "tiny")
    w = Workload(
        seq_len=seq,
        heads=m.heads,
        kv_heads=m.kv_heads,
        head_dim=m.head_dim,
        model=m,
        dtype="bfloat16" if bf16 else "float32",
        mode="train",
        optimizer="adam",
        autocast=True,  # the training job's (tasks/train.py)
        lm_head_chunk=1024,
        shard="full" if shard else "none",
        shard_degree=2 if shard else None,
        checkpoint="full" if ckpt else "none",
    )
    held, phases = memory_phases(w, 2, cpu=True)
    return sum(held.values()) + sum(phases[peak_phase(phases)].values())


@pytest.mark.parametrize(
    "shape, seq, bf16, shard, ckpt",
    [
        (HEAVY, 256, False, False, False),  # weights heavy: the gradient sum's copy peaks
        (LONG, 8192, True, False, False),  # autocast: every layer's cast kept, float32 norms
        (LONG, 8192, True, True, False),  # the same under FSDP: gathered float32, casts whole
        (LONG, 8192, True, False, True),  # checkpointed: autocast's cache keeps every cast
    ],
    ids=["float32 weight-heavy", "bf16 autocast", "bf16 autocast FSDP", "bf16 checkpointed"],
)
def test_the_plan_of_a_training_step_is_what_it_holds(shape, seq, bf16, shard, ckpt):
    peaks = run_distributed(_step_peak, 2, shape, seq, bf16, shard, ckpt, transport="gloo")
    planned = _planned(shape, seq, bf16, shard, ckpt)
    # full checkpointing is priced with the recomputed layer and the backward working set
    # alive together (its measured peak is 0.85x): never short, the other shapes within 10%
    low = 0.8 if ckpt else 0.9
    for peak in peaks:
        assert low <= peak / planned <= 1.1, (peak / 2**20, planned / 2**20)
