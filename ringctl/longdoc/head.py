"""The model's own output head, applied a chunk of positions at a time.

Scoring never builds vocabulary-sized logits for a whole shard, so it cannot call the causal
LM's ``forward`` (which computes them all at once). It applies the output embedding itself, and
must then also apply what the model does to the logits after it, or the log-probabilities are
those of another model:

* Cohere / Cohere 2: ``logits * logit_scale``;
* Granite (dense and MoE): ``logits / config.logits_scaling``;
* Gemma 2 / 3 and others: final soft-capping, ``cap * tanh(logits / cap)``.

What a family does beyond these is caught by the job's probe (``probe.py``), which compares
these log-probabilities with the model's own forward pass before any document is scored.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def output_head(model) -> Callable[[torch.Tensor], torch.Tensor]:
    """hidden (S, H) -> float32 logits (S, V), as the model's own forward computes them."""
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
        out = out.float()
        if cap is not None:
            out = torch.tanh(out / cap) * cap
        return out

    return logits
