"""The training job's step on one GPU: a P = 1 NCCL world trains packed sequences as training
without the ring does on the same GPU (tests/train_reference.py: the model's own sdpa
attention, each document of a packed sequence a forward of its own).

float32: per-step losses within 1e-4 relative for 4 steps, weights within 1e-4 by the relative
norm (the CPU suite's 1e-5 is for sums reordered on a CPU; a GPU's kernels reduce in blocks and
in parallel: 10x that). bfloat16 compute over float32 weights (the job's ``task.dtype:
bfloat16``): each step's loss within 2e-2 relative of float32's (three bf16 ulps of a loss of
about 5.5), and no step's loss NaN.
"""

from __future__ import annotations

import torch

from tests.distributed import run_distributed
from tests.train_reference import documents, tiny_model, train

HP = dict(lr=3e-3, warmup_steps=2, max_steps=4, min_lr_ratio=0.1, weight_decay=0.1, clip=1.0)
SEQ_LEN, BATCH, STEPS = 160, 2, 4


def _steps():
    from ringctl.train.data import Cursor, SequenceStream

    docs = documents()
    stream, cursor, out = SequenceStream(lambda i: docs[i], len(docs), SEQ_LEN, 3), Cursor(), []
    for _ in range(STEPS):
        seqs, cursor = stream.take(cursor, BATCH)
        out.append(seqs)
    return out


def _train_on_cuda(rank: int, world: int, autocast) -> dict:
    from ringctl.train.optim import make_optimizer, make_scheduler
    from ringctl.train.step import RingSeat, StepOptions, train_step

    model = tiny_model("ringattn").cuda().train()
    opt = make_optimizer(model, lr=HP["lr"], weight_decay=HP["weight_decay"])
    sched = make_scheduler(
        opt, warmup_steps=HP["warmup_steps"], max_steps=HP["max_steps"], min_lr_ratio=0.1
    )
    seat = RingSeat(None, 1, 0, 0, 1, None)
    opts = StepOptions("zigzag", None, 64, HP["clip"], autocast)
    losses = [
        train_step(model, opt, sched, seqs, range(BATCH), seat, opts, sharded=False).loss
        for seqs in _steps()
    ]
    return {"losses": losses, "weights": {n: p.detach().cpu() for n, p in model.named_parameters()}}


def _cuda_steps():
    return [
        [type(s)(s.ids.cuda(), s.labels.cuda(), s.positions, s.cu_seqlens, s.docs) for s in seqs]
        for seqs in _steps()
    ]


def test_a_train_step_on_cuda_trains_as_without_the_ring():
    ref_losses, ref_weights = train(tiny_model("sdpa").cuda().train(), _cuda_steps(), HP)
    (got,) = run_distributed(_train_on_cuda, 1, None, backend="nccl")
    for s, (a, b) in enumerate(zip(got["losses"], ref_losses, strict=True)):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {s + 1}: {a} vs {b}"
    for name, w in ref_weights.items():
        w = w.cpu()
        assert float((got["weights"][name] - w).norm() / w.norm()) <= 1e-4, name


def test_a_bf16_train_step_on_cuda_stays_near_float32():
    (f32,) = run_distributed(_train_on_cuda, 1, None, backend="nccl")
    (bf16,) = run_distributed(_train_on_cuda, 1, torch.bfloat16, backend="nccl")
    for s, (a, b) in enumerate(zip(bf16["losses"], f32["losses"], strict=True)):
        assert a == a and abs(a - b) <= 2e-2 * abs(b), f"step {s + 1}: {a} vs {b}"
