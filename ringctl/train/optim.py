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


def restart_schedule(scheduler, step: int) -> None:
    """Set the optimizer's rates to this job's schedule at ``step``, the first step of a
    resume: the optimizer's state brings back the rate the run's schedule gave that step, so
    a task.max_steps changed since (the cosine stretches) took effect one step late. For an
    unchanged schedule this is the rate it had, to the bit (LambdaLR's own product)."""
    rates = [
        base * factor(step)
        for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
    ]
    for group, rate in zip(scheduler.optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    scheduler._last_lr = rates  # what get_last_lr() reports, and the next checkpoint keeps


# A schedule's state that moves with the steps; every other field is fixed by the job's
# config (base_lrs: task.lr per parameter group) and must equal a fresh scheduler's.
MOVING = ("last_epoch", "_step_count", "_last_lr")


def scheduler_state_problem(saved: dict, live: dict, step: int) -> str | None:
    """What is wrong with a schedule's state read back from a checkpoint of step ``step``
    against the job's own (``live``: a fresh scheduler's state_dict), None if nothing: the
    same keys, the step it says it is at, finite learning rates one per parameter group, no
    state for the factor (the job's own function, never replaced by a file's), every field
    the config fixes equal to the fresh scheduler's (``base_lrs`` is task.lr: a file's own
    would set every later step's rate), and a last rate within [0, base rate] (the factor's
    range: the schedule never goes above task.lr)."""
    if set(saved) != set(live):
        return f"keys {sorted(saved)[:8]}, not {sorted(live)}"
    if saved.get("last_epoch") != step or saved.get("_step_count") != step + 1:
        return f"last_epoch / _step_count {saved.get('last_epoch')!r} / " + (
            f"{saved.get('_step_count')!r}, not {step} / {step + 1}"
        )
    groups = len(live["base_lrs"])
    for key in ("base_lrs", "_last_lr"):
        rates = saved.get(key)
        finite = isinstance(rates, list) and all(
            isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r)
            for r in rates
        )
        if not finite or len(rates) != groups:
            return f"{key} must be {groups} finite numbers"
    if saved.get("lr_lambdas") != [None] * groups:
        return "lr_lambdas must be empty (the schedule is the job's own)"
    for key, value in saved.items():
        if key.startswith("_") and isinstance(live[key], bool) and not isinstance(value, bool):
            return f"{key} must be true or false"
    for key in sorted(set(live) - set(MOVING)):
        if saved[key] != live[key]:
            said = " (task.lr)" if key == "base_lrs" else ""
            return f"{key} {saved[key]!r}, not the job's {live[key]!r}{said}"
    for last, base in zip(saved["_last_lr"], live["base_lrs"], strict=True):
        if not 0 <= last <= base:
            return f"_last_lr {saved['_last_lr']!r} outside [0, base_lrs {live['base_lrs']!r}]"
    return None
