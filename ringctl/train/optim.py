"""The training job's optimizer and learning-rate schedule.

AdamW (betas 0.9 / 0.95, eps 1e-8) with decoupled weight decay on the matrices only (weights
of two or more dimensions; norms and biases are not decayed), over the float32 weights (the
master weights when the job computes in bfloat16). The learning rate rises linearly over
``warmup_steps`` from lr / warmup_steps to ``lr``, then follows a cosine down to
``lr x min_lr_ratio`` at ``max_steps``, and stays there.
"""

from __future__ import annotations

import math

import torch

BETAS = (0.9, 0.95)
EPS = 1e-8


def lr_factor(step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """The learning rate of step ``step`` (0-based: the step about to be taken) over ``lr``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model, *, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    decay, plain = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else plain).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": plain, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=BETAS, eps=EPS)


def make_scheduler(optimizer, *, warmup_steps: int, max_steps: int, min_lr_ratio: float):
    def factor(step: int) -> float:
        return lr_factor(
            step, warmup_steps=warmup_steps, max_steps=max_steps, min_lr_ratio=min_lr_ratio
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
