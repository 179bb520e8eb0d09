"""Training checkpoints (ringctl/train/checkpoint.py): DCP saves that reshard, published only
when complete, read back as hostile input.

A run interrupted after a checkpoint and continued, on the same shape and on another (FSDP2
over 4 ranks -> the whole model on each of 2 ranks, and back), equals the uninterrupted run:
bitwise on the same shape (the same kernels in the same order), within the shapes' own 1e-5
otherwise (tests/test_train_step.py). A save killed before it is published leaves ``latest`` at
the previous checkpoint, which loads; the next save removes the half-written folder.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_train_step import BATCH, HP, TOL, _rel, _steps
from tests.train_reference import tiny_model


def _run(rank: int, world: int, ckroot: str, shard: bool, start: int, stop: int, save: bool):
    """Steps [start, stop) on ``world`` ranks (one ring), from the checkpoint of ``start``
    when start > 0; saves one at ``stop`` when asked. Rank 0 returns losses and weights."""
    from pathlib import Path

    from ringctl.longdoc.compute.fsdp import shard_model
    from ringctl.train.checkpoint import CheckpointDir, load, train_state
    from ringctl.train.checkpoint import save as save_ckpt
    from ringctl.train.optim import make_optimizer, make_scheduler
    from ringctl.train.step import RingSeat, StepOptions, train_step

    model = tiny_model("ringattn").train()
    if shard:
        shard_model(model, mode="job")
    opt = make_optimizer(model, lr=HP["lr"], weight_decay=HP["weight_decay"])
    sched = make_scheduler(
        opt,
        warmup_steps=HP["warmup_steps"],
        max_steps=HP["max_steps"],
        min_lr_ratio=HP["min_lr_ratio"],
    )
    ckdir = CheckpointDir(Path(ckroot))
    if start:
        found = ckdir.latest()
        assert found is not None and found.step == start
        load(model, opt, found)
        sched.load_state_dict(found.state["scheduler"])
    seat = RingSeat(None, world, rank, 0, 1, None)
    opts = StepOptions("zigzag", None, 64, HP["clip"], None)
    losses = [
        train_step(model, opt, sched, seqs, range(BATCH), seat, opts, shard).loss
        for seqs in _steps()[start:stop]
    ]
    if save:
        state = train_state(stop, {"epoch": 0, "index": 0, "offset": 0}, sched.state_dict(), {})
        save_ckpt(model, opt, ckdir, stop, state, keep=2, metrics=Path(ckroot) / "none.jsonl")
    weights = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
    }
    return {"losses": losses, "weights": weights} if rank == 0 else {}


@pytest.mark.parametrize(
    "first,second",
    [((2, False), (2, False)), ((4, True), (2, False))],
    ids=["same shape", "FSDP2 over 4 -> whole on 2"],
)
def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path, first, second):
    whole = run_distributed(_run, first[0], str(tmp_path / "whole"), first[1], 0, 8, False)[0]
    root = str(tmp_path / "ck")
    a = run_distributed(_run, first[0], root, first[1], 0, 3, True)[0]
    b = run_distributed(_run, second[0], root, second[1], 3, 8, False)[0]
    same = first == second
    for s, (got, want) in enumerate(zip(a["losses"] + b["losses"], whole["losses"], strict=True)):
        assert got == want if same else abs(got - want) <= TOL * abs(want), (s, got, want)
    for name, want in whole["weights"].items():
        got = b["weights"][name]
        assert torch.equal(got, want) if same else _rel(got, want) <= TOL, name


def test_a_killed_save_leaves_latest_at_the_last_complete_one(tmp_path):
    from ringctl.train.checkpoint import CheckpointDir

    root = tmp_path / "ck"
    run_distributed(_run, 2, str(root), False, 0, 3, True)
    ckdir = CheckpointDir(root)
    half = ckdir.staging(5, "deadbeef")  # a save killed while the ranks wrote it
    half.mkdir()
    (half / "__0_0.distcp").write_bytes(b"partial")
    assert ckdir.latest().step == 3
    b = run_distributed(_run, 2, str(root), False, 3, 5, True)[0]
    assert len(b["losses"]) == 2 and not half.exists() and ckdir.latest().step == 5
    assert [p.name for p in ckdir.complete()] == ["step-0000003", "step-0000005"]


@pytest.mark.parametrize(
    "pointer", ["../../etc", "step-0000003/../../x", "/tmp/step-0000003", "step-9", "x" * 5000]
)
def test_latest_cannot_point_outside_or_at_garbage(tmp_path, pointer):
    from ringctl.train.checkpoint import CheckpointDir

    (tmp_path / "latest").write_text(pointer)
    with pytest.raises(ValueError, match="latest"):
        CheckpointDir(tmp_path).latest()


def test_a_hostile_train_state_is_one_line(tmp_path):
    from ringctl.train.checkpoint import CheckpointDir

    step = tmp_path / "step-0000003"
    step.mkdir()
    (step / ".metadata").write_bytes(b"")
    (tmp_path / "latest").write_text("step-0000003")
    for bad in (
        "[" * 100000,
        json.dumps({"step": -1, "cursor": {}, "scheduler": {}, "run": {}}),
        json.dumps({"step": 4, "cursor": {}, "scheduler": {}, "run": {}}),
    ):
        (step / "train_state.json").write_text(bad)
        with pytest.raises(ValueError, match="train_state.json"):
            CheckpointDir(tmp_path).latest()
