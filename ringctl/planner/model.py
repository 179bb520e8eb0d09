"""A decoder-only LM's shape, and the counts the planner derives from it.

The shape comes from flags, from a preset (``data/models.json``) or from a Hugging Face
config dict (``from_hf_config``); the planner needs only sizes, never the weights. Reading a
``config.json`` is ``ringctl.longdoc.model.compat.read_model_config``'s, the one reader of planner
and job (with the job's checked ``task.model_overrides``), through ``compat.model_shape``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

from ..errors import UserError


@dataclass(frozen=True)
class ModelShape:
    """A Llama-family decoder: attention (GQA) + gated MLP per layer, embeddings + lm_head.

    ``heads``/``kv_heads``/``head_dim`` are optional so that older callers (which gave the
    attention shape on the Workload only) keep working: the Workload's values fill them in.
    """

    layers: int
    hidden: int
    intermediate: int | None = None
    vocab: int = 32000
    params: int | None = None  # default: counted from the shape
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    tied_embeddings: bool = False
    name: str = ""
    window: int | None = None  # the sliding window of the windowed layers (None: no window)
    window_layers: int | None = None  # how many layers have it; None: all of them

    @property
    def inter(self) -> int:
        return self.intermediate or 4 * self.hidden


def layer_params(m: ModelShape, heads: int, kv_heads: int, head_dim: int) -> int:
    """Weights of one decoder layer: q/k/v/o projections, gate/up/down, two norms."""
    attn = m.hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * m.hidden
    return attn + 3 * m.hidden * m.inter + 2 * m.hidden


def embedding_params(m: ModelShape) -> int:
    """Input embedding plus lm_head (one matrix when tied) plus the final norm."""
    return (1 if m.tied_embeddings else 2) * m.vocab * m.hidden + m.hidden


def total_params(m: ModelShape, heads: int, kv_heads: int, head_dim: int) -> int:
    if m.params:
        return m.params
    return m.layers * layer_params(m, heads, kv_heads, head_dim) + embedding_params(m)


def layer_matmuls(m: ModelShape, heads: int, kv_heads: int, head_dim: int) -> list[tuple[int, int]]:
    """(in, out) widths of one decoder layer's matmuls: q, k, v, o; gate, up, down. A CPU's
    matmul rate depends on the width it sums over (``Device.matmul_rate``), so the planner
    prices each one by its own."""
    q, kv = heads * head_dim, kv_heads * head_dim
    h, i = m.hidden, m.inter
    return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]


def lm_head_matmul(m: ModelShape) -> tuple[int, int]:
    return (m.hidden, m.vocab)


def linear_flops_per_token(m: ModelShape, heads: int, kv_heads: int, head_dim: int) -> float:
    """Forward matmul FLOPs per token of all layers (attention scores excluded)."""
    per_layer = sum(k * n for k, n in layer_matmuls(m, heads, kv_heads, head_dim))
    return 2.0 * m.layers * per_layer


def lm_head_flops_per_token(m: ModelShape) -> float:
    k, n = lm_head_matmul(m)
    return 2.0 * k * n


def elementwise_bytes_per_token(
    m: ModelShape, heads: int, kv_heads: int, head_dim: int, dtype_bytes: int
) -> float:
    """Bytes the forward writes per token outside its matmuls and attention kernel: in each
    layer two RMSNorms (x squared, x times its rsqrt, times the weight: 3 hidden each), RoPE on
    q and k (x cos, rotate_half's negation and concatenation, x sin, the sum: 5 each), two
    residual additions and the gated MLP's activation and product (2 intermediate); then the
    final norm and the output head's log-softmax (vocab). Counted from transformers' Llama
    layer; a family with more elementwise work (Gemma's extra norms) costs more."""
    per_layer = layer_elementwise_values(m, heads, kv_heads, head_dim)
    return float(dtype_bytes * (m.layers * per_layer + 3 * m.hidden + m.vocab))


def layer_elementwise_values(m: ModelShape, heads: int, kv_heads: int, head_dim: int) -> int:
    """Values one layer's elementwise ops write per token (elementwise_bytes_per_token's
    count; ``ringctl plan --calibrate`` times these same ops to measure their rate)."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return 6 * m.hidden + 5 * (q + kv) + 2 * m.hidden + 2 * m.inter


def _int(data: dict, key: str, where: str, default=None) -> int:
    value = data.get(key, default)
    if value is None:
        raise UserError(f"{where}: missing key {key!r}")
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise UserError(f"{where}: key {key!r} must be an integer, got {value!r}") from None
    if number < 1:
        raise UserError(f"{where}: key {key!r} must be at least 1, got {number}")
    return number


def from_hf_config(data: dict, where: str) -> ModelShape:
    """A shape from a Hugging Face config (Llama, Mistral, Qwen2 and similar key names)."""
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a JSON object")
    if "text_config" in data and "hidden_size" not in data:  # multimodal wrappers
        data = data["text_config"]
    hidden = _int(data, "hidden_size", where)
    heads = _int(data, "num_attention_heads", where)
    kv = _int(data, "num_key_value_heads", where, default=heads)
    head_dim = _int(data, "head_dim", where, default=hidden // heads)
    if heads % kv:
        raise UserError(
            f"{where}: num_attention_heads ({heads}) must be a multiple of "
            f"num_key_value_heads ({kv})"
        )
    return ModelShape(
        layers=_int(data, "num_hidden_layers", where),
        hidden=hidden,
        intermediate=_int(data, "intermediate_size", where, default=4 * hidden),
        vocab=_int(data, "vocab_size", where),
        heads=heads,
        kv_heads=kv,
        head_dim=head_dim,
        tied_embeddings=bool(data.get("tie_word_embeddings", False)),
        name=str(data.get("_name_or_path") or data.get("model_type") or ""),
        **sliding_window(data, where),
    )


# Families whose every layer has the config's sliding_window when it names no layer_types.
ALL_LAYERS_WINDOWED = ("mistral", "mixtral", "phi3", "starcoder2")


def sliding_window(data: dict, where: str) -> dict:
    """{window, window_layers} of a config, as ringctl.longdoc.model.compat reads a built one:
    ``layer_types`` names the windowed layers ("sliding_attention"); without it Qwen2's
    layers from ``max_window_layers`` on are windowed (``use_sliding_window``), the families of
    ALL_LAYERS_WINDOWED window every layer, and any other family's window is priced as full
    attention (an over-estimate of time: the planner cannot tell which layers have it)."""
    window = data.get("sliding_window")
    if not window or data.get("use_sliding_window") is False:
        return {}
    size = _int(data, "sliding_window", where)
    layers = _int(data, "num_hidden_layers", where)
    types = data.get("layer_types")
    if isinstance(types, list):
        count = sum(t == "sliding_attention" for t in types)
    elif data.get("use_sliding_window") and "max_window_layers" in data:
        first = data["max_window_layers"]
        if not isinstance(first, int) or first < 0:
            raise UserError(f"{where}: key 'max_window_layers' must be a count, got {first!r}")
        count = layers - min(layers, first)
    elif data.get("model_type") in ALL_LAYERS_WINDOWED:
        count = layers
    else:
        count = 0
    if not count:
        return {}
    return {"window": size, "window_layers": None if count == layers else count}


def presets() -> dict[str, ModelShape]:
    text = resources.files(__package__).joinpath("data/models.json").read_text()
    table = json.loads(text)
    where = "ringctl/planner/data/models.json"
    return {
        name: from_hf_config(entry, f"{where}: {name}")
        for name, entry in table.items()
        if not name.startswith("_")
    }
