"""Ring attention as a Hugging Face ``transformers`` attention implementation.

    from ringattn.hf import register
    register()                                   # name "ringattn"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="ringattn")
    # every rank feeds its shard, with the GLOBAL positions of that shard:
    out = model(input_ids=shard_ids, position_ids=shard_positions, use_cache=False,
                ring_group=group, ring_layout="zigzag")

Extra keyword arguments given to ``model(...)`` reach every attention call: ``ring_group``
(a ``torch.distributed`` process group; default: the default group) and ``ring_layout``
(``"contiguous"`` or ``"zigzag"``, as in ``ringattn.shard_sequence``). The layout must be
given whenever the group has more than one rank: a wrong layout gives wrong numbers silently.

Attention is always causal (these are causal LMs) and over one unpadded document per batch row.
What cannot be honoured is refused with a ValueError instead of being dropped silently:

* a 2D padding ``attention_mask`` with a zero in it (an all-ones mask is accepted),
* a 4D mask, sliding-window attention, logit soft-capping, and attention dropout.

``transformers`` is imported here only, and only when ``register`` is called: ``import
ringattn`` never pulls it in.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .ring import ring_attention

DEFAULT_NAME = "ringattn"


def ring_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The function transformers calls in every attention layer.

    query is (batch, heads, seq_local, head_dim), key/value (batch, kv_heads, seq_local,
    head_dim) with RoPE applied and GQA heads not repeated. Returns (batch, seq_local, heads,
    head_dim) and no attention weights.
    """
    if attention_mask is not None:
        raise ValueError(
            "ringattn: an attention mask reached the attention layer "
            f"(shape {tuple(attention_mask.shape)}); ring attention applies the causal mask "
            "itself over one unpadded document per row and cannot honour a custom or padding "
            "mask: pass attention_mask=None"
        )
    if dropout:
        raise ValueError(
            f"ringattn: attention dropout ({dropout}) is not supported; use model.eval() or "
            "set attention_dropout=0"
        )
    if kwargs.get("sliding_window") is not None:
        raise ValueError(
            f"ringattn: this layer uses sliding-window attention (window "
            f"{kwargs['sliding_window']}), which ring attention does not implement; set "
            "config.sliding_window=None (full causal attention) or use another implementation"
        )
    if kwargs.get("softcap") is not None:
        raise ValueError("ringattn: attention logit soft-capping is not supported")
    group = kwargs.get("ring_group")
    layout = kwargs.get("ring_layout")
    if layout is None:
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            raise ValueError(
                "ringattn: pass ring_layout='zigzag' or 'contiguous' to model(...) (the layout "
                "the input was sharded with); it is required when the group has several ranks"
            )
        layout = "contiguous"
    out = ring_attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        causal=True,
        softmax_scale=scaling,
        group=group,
        layout=layout,
    )
    return out, None


def _refuse_padding_mask(*, attention_mask: torch.Tensor | None = None, **_: Any) -> None:
    """Mask function for the same name: lets no padding mask be dropped silently.

    transformers builds the layer mask from the user's 2D mask through this function. Ring
    attention needs none, so this returns None, after checking that the 2D mask pads nothing.
    """
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            "ringattn: a padding attention_mask (with zeros) was given; ring attention runs one "
            "unpadded document per row and would ignore it. Remove the padding (one document "
            "per call) and pass attention_mask=None"
        )
    return None


def register(name: str = DEFAULT_NAME) -> str:
    """Register ring attention with transformers under ``name`` (idempotent); returns name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, ring_attention_forward)
    AttentionMaskInterface.register(name, _refuse_padding_mask)
    return name


__all__ = ["DEFAULT_NAME", "register", "ring_attention_forward"]
