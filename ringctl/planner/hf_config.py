"""How a Hugging Face config.json's sizes and windows are read: the one rule of the job's
checks (``ringctl.longdoc.model.compat``) and the planner (``planner.model``), here so that
the planner stays a torch-free leaf that the job's modules import, not the reverse.

A config is a dict (config.json) or a built config object; a multimodal one nests the
language model in ``text_config``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..text import cut


def field(config: Any, key: str, default: Any = None) -> Any:
    """A config's field, from a config.json's dict or a built config object alike."""
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def text_config(config: Any) -> Any:
    """The language model's part of a config (multimodal configs nest it in text_config)."""
    inner = field(config, "text_config")
    return inner if inner is not None else config


def model_type(config: Any) -> str:
    return str(field(text_config(config), "model_type") or field(config, "model_type") or "?")


def is_size(value: Any) -> bool:
    """Whether a config value is a size of a model: a positive int, not a bool (True is 1)
    nor a float (4096.9, 1e30, NaN) nor a string. The one rule of the job's checks
    (``compat.size_refusal``) and the planner (``planner.model.from_hf_config``)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# Fields the window and length rules (and the random model's seed) read as whole numbers: a
# string, NaN or 1e999 there passed the submit and raised ValueError or OverflowError on the
# ranks. 0 and None mean "none" where transformers reads them so.
COUNT_FIELDS = (
    "sliding_window",
    "attention_chunk_size",
    "floor_scale",
    "_ringctl_seed",
    "max_window_layers",
    "sliding_window_pattern",
)


def value_refusal(config: Any) -> str | None:
    """The first field of a config.json whose type no rule here can read, in one line; or
    None: model_type a name, text_config an object, the COUNT_FIELDS whole numbers >= 0."""
    kind = field(config, "model_type")
    if kind is not None and not isinstance(kind, str):
        return f"model config field model_type = {kind!r} (config.json): must be a name"
    inner = field(config, "text_config")
    if isinstance(config, Mapping) and inner is not None and not isinstance(inner, Mapping):
        shown = cut(repr(inner), 60)
        return f"model config field text_config = {shown} (config.json): must be an object"
    for part in (config, inner):
        for key in COUNT_FIELDS if isinstance(part, Mapping) else ():
            value = part.get(key)
            whole = isinstance(value, int) and not isinstance(value, bool) and value >= 0
            if value is not None and not whole:
                return (
                    f"model config field {key} = {value!r} (config.json or "
                    "task.model_overrides): must be a whole number"
                )
    return None


# Families whose window is off unless use_sliding_window says true (their config classes'
# default is False; Qwen2.5's config.json names a sliding_window it does not use).
WINDOW_OPT_IN = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "qwen2_vl_text", "qwen2_5_vl_text")


def sliding_window(config: Any) -> int | None:
    """The sliding window of the model's windowed layers, or None (no layer has one)."""
    cfg = text_config(config)
    sliding, types = field(cfg, "sliding_window"), field(cfg, "layer_types")
    if not sliding:
        return None
    if types is not None:
        return int(sliding) if "sliding_attention" in types else None
    default = False if model_type(config) in WINDOW_OPT_IN else None
    return int(sliding) if field(cfg, "use_sliding_window", default) is not False else None


def sliding_layers(config: Any) -> int:
    """How many attention layers use the sliding window (0: none): those ``layer_types`` names
    "sliding_attention", else those the family's config class marks so (``_family_windowed``).
    The one rule of the job's checks and the planner (``planner.model.sliding_window``)."""
    if sliding_window(config) is None:
        return 0
    cfg = text_config(config)
    types = field(cfg, "layer_types")
    if types is not None:
        return sum(t == "sliding_attention" for t in types)
    layers = int(field(cfg, "num_hidden_layers") or 0)
    return _family_windowed(model_type(config), cfg, layers)


# Families whose config class (transformers 5) derives layer_types from the first layer that
# has the window (Qwen2: layer i is windowed when i >= max_window_layers), with its default.
WINDOW_FROM_LAYER = {"qwen2": 28, "qwen3": 28, "qwen2_vl_text": 80, "qwen2_5_vl_text": 80}
# Families whose config class windows every layer but each period-th ((i + 1) % period != 0),
# with the default period (``sliding_window_pattern`` where the config names one).
WINDOW_PERIOD = {
    "gemma2": 2,
    "gemma3": 6,
    "gemma3_text": 6,
    "cohere2": 4,
    "olmo3": 4,
    "gpt_oss": 2,
}


def _family_windowed(kind: str, cfg: Any, layers: int) -> int:
    """How many of ``layers`` a config.json without ``layer_types`` windows, as its family's
    config class lays them out in transformers 5 (a saved config names layer_types itself;
    one written by hand or by an older transformers may not). Qwen2-MoE windows the even
    layers below max_window_layers; a family no table here names applies its
    ``sliding_window`` to every layer (Mistral, Mixtral, Phi-3, Qwen3-MoE: their attention
    reads config.sliding_window)."""
    first = field(cfg, "max_window_layers")  # null: the family's default
    if kind in WINDOW_FROM_LAYER:
        return layers - min(layers, int(WINDOW_FROM_LAYER[kind] if first is None else first))
    if kind == "qwen2_moe":
        return (min(layers, int(28 if first is None else first)) + 1) // 2
    if kind in WINDOW_PERIOD:
        period = int(field(cfg, "sliding_window_pattern") or WINDOW_PERIOD[kind])
        return layers - layers // period
    return layers
