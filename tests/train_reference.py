"""Training without the ring, for the training job's parity tests (no tests here).

One process, the model's own attention (sdpa), every piece of every packed sequence run as a
forward of its own: the loss of a step is the sum of ``-log p`` over its labelled tokens over
their count, the optimizer AdamW with the job's hyperparameters, the schedule written here
from its definition (linear warm-up, cosine to lr x min_lr_ratio). Nothing here goes through
ringattn or the training job's step code; the data (which tokens, which labels) is the job's
config's, read from the same stream.
"""

from __future__ import annotations

import math

import torch

TINY = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def tiny_model(attn: str, seed: int = 11, model_type: str = "llama", **fields):
    from transformers import AutoConfig

    from ringctl.longdoc.model.load import build_random

    if attn == "ringattn":
        from ringattn.hf import register

        register()
    config = AutoConfig.for_model(model_type, rope_theta=10000.0, **{**TINY, **fields})
    return build_random(config, seed=seed, dtype=torch.float32, attn_implementation=attn)


def documents(count: int = 23, seed: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 2, 3, 70, 5, 150, 9, 40, 17, 300, 11, 6, 33, 8, 90, 2, 21, 64, 4, 120, 13, 7, 55]
    return [torch.randint(0, 256, (n,), generator=g) for n in lengths[:count]]


def lr(step: int, base: float, warmup: int, max_steps: int, min_ratio: float) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return base * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def train(model, steps: list[list], hp: dict) -> tuple[list[float], dict]:
    """(per-step losses, final weights) of plain training on ``steps`` (each a list of packed
    sequences)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    plain = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": hp["weight_decay"]},
            {"params": plain, "weight_decay": 0.0},
        ],
        lr=hp["lr"],
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    losses = []
    for s, sequences in enumerate(steps):
        for group in opt.param_groups:
            group["lr"] = lr(s, hp["lr"], hp["warmup_steps"], hp["max_steps"], hp["min_lr_ratio"])
        opt.zero_grad(set_to_none=True)
        tokens = sum(int((seq.labels != -100).sum()) for seq in sequences)
        total = 0.0
        for seq in sequences:
            for a, b in zip(seq.cu_seqlens, seq.cu_seqlens[1:], strict=False):
                logits = model(input_ids=seq.ids[None, a:b], use_cache=False).logits[0].float()
                labels = seq.labels[a:b]
                keep = labels != -100
                nll = -(logits.log_softmax(-1)[keep].gather(-1, labels[keep][:, None])).sum()
                (nll / tokens).backward()
                total += float(nll.detach())
        if hp["clip"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), hp["clip"])
        opt.step()
        losses.append(total / tokens)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
