"""Which models a long-document job accepts, decided from the model's config.

Ring attention gives the model's own numbers only when every token-mixing step of the model is
an attention call that goes through transformers' attention interface (where ``ringattn``
replaces it). What does not is refused here, by name, before any rank scores anything:

* families that compute attention themselves (ALiBi in BLOOM and MPT, Falcon's and GPT-Neo's
  own attention classes): ring attention never runs, each rank attends over its shard alone;
* state-space, convolutional and linear-attention layers (Mamba, Jamba, LFM2, Falcon-H1,
  Qwen3-Next, ...): their recurrence would restart on every rank's shard;
* attention-logit soft-capping (Gemma 2): not implemented by the ring kernels;
* value heads of another size than query/key heads (DeepSeek-V2/V3's latent attention);
* attention sinks (gpt-oss) while ``ring_attention`` has no ``sinks=`` parameter.

Sliding windows (Mistral, Qwen2 with windows, Gemma 2/3, Cohere 2, OLMo 3, gpt-oss) run in the
ring itself: each layer passes its ``sliding_window`` to ``ringattn``, whose plan skips the
blocks behind the window and masks the boundary ones (``ringattn.geometry``); ``sliding_layers``
says how many layers must pass one, and ``scoring.forward_hidden`` refuses a forward in which
fewer did. Llama 4's chunked attention is exact under full causal attention only for a
document that fits in one chunk, and its attention temperature tuning counts positions per
rank (exact up to ``floor_scale - 1`` tokens): ``length_limit(config)`` gives that limit and
the job refuses longer documents, naming it.

``config_refusal`` reads a plain dict (a ``config.json``), so ``ringctl submit`` can call it
without torch or transformers; it also refuses a size of the model (``SIZE_FIELDS``: layers,
heads, hidden size, vocabulary, ...) that is not a positive integer (``size_refusal``), which
no rank could build; ``model_refusal`` adds what only the built model shows. Anything
this list does not know about is still checked by the probe (``probe.py``) and by counting the
attention calls of every forward (``scoring.forward_hidden``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...errors import naming
from ...planner.hf_config import field as _get
from ...planner.hf_config import (
    is_size,
    model_type,
    sliding_layers,
    sliding_window,
    text_config,
    value_refusal,
)
from ...text import cut

_OWN_ATTENTION = (
    "computes attention in its own code, not through transformers' attention interface, so "
    "ring attention would never run"
)
_RECURRENT = (
    "has state-space, convolution or linear-attention layers whose recurrence over the "
    "sequence would restart on every rank's shard"
)
REFUSED: dict[str, str] = {
    "bloom": f"BLOOM (ALiBi) {_OWN_ATTENTION}",
    "mpt": f"MPT (ALiBi) {_OWN_ATTENTION}",
    "falcon": f"Falcon {_OWN_ATTENTION}",
    "gpt_neo": f"GPT-Neo {_OWN_ATTENTION}",
    "xglm": f"XGLM {_OWN_ATTENTION}",
    "mamba": f"Mamba {_RECURRENT}",
    "mamba2": f"Mamba-2 {_RECURRENT}",
    "falcon_mamba": f"Falcon-Mamba {_RECURRENT}",
    "jamba": f"Jamba {_RECURRENT}",
    "bamba": f"Bamba {_RECURRENT}",
    "zamba": f"Zamba {_RECURRENT}",
    "zamba2": f"Zamba2 {_RECURRENT}",
    "falcon_h1": f"Falcon-H1 {_RECURRENT}",
    "granitemoehybrid": f"Granite hybrid {_RECURRENT}",
    "nemotron_h": f"Nemotron-H {_RECURRENT}",
    "lfm2": f"LFM2 {_RECURRENT}",
    "lfm2_moe": f"LFM2-MoE {_RECURRENT}",
    "qwen3_next": f"Qwen3-Next {_RECURRENT}",
    "recurrent_gemma": f"RecurrentGemma {_RECURRENT}",
    "rwkv": f"RWKV {_RECURRENT}",
    "xlstm": f"xLSTM {_RECURRENT}",
    "minimax": f"MiniMax {_RECURRENT}",
}
WINDOW_LAYER_TYPES = ("sliding_attention", "chunked_attention")
MAX_CONFIG_BYTES = 16 << 20  # a config.json is kilobytes; a file this large is not one
# transformers' defaults that matter here, for hand-written config.json files that omit them
# (a saved model's config.json has every field)
DEFAULTS: dict[str, dict[str, Any]] = {"gemma2": {"attn_logit_softcapping": 50.0}}


# The fields of transformers' config classes that are sizes or counts (their annotation: int):
# a model of 0 heads, -64 hidden units, a string vocabulary, NaN or 1e12 (a float) layers is
# no model, and would be found out on every rank, after the queue wait, as a traceback.
SIZE_FIELDS = (
    "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads "
    "num_key_value_heads head_dim max_position_embeddings n_embd n_layer n_head n_inner "
    "n_positions num_layers num_heads d_model moe_intermediate_size num_local_experts "
    "num_experts num_experts_per_tok shared_expert_intermediate_size"
).split()


def size_refusal(config: Any) -> str | None:
    """The first size field of the config (or its text_config) that is not a positive integer
    or a list of them (per-layer sizes, Gemma 3n's), said in one line; or None. None and
    absent are transformers' defaults, as is a head_dim of 0 (read as hidden / heads). A
    config.json only: a built model's config (on the ranks) was built from one checked here."""
    for part in (config, _get(config, "text_config")):
        if not isinstance(part, Mapping):
            continue
        for key in SIZE_FIELDS:
            value = _get(part, key)
            values = value if isinstance(value, list) and value else [value]
            if value is None or (key == "head_dim" and value == 0) or all(map(is_size, values)):
                continue
            return (
                f"model config field {key} = {value!r} (config.json or "
                "task.model_overrides): a size of the model must be a positive integer"
            )
    return None


# Fields of a config.json that make transformers read other weights than the directory's
# safetensors, or change them by the machine: refused by name. quantization_config: a
# bitsandbytes one failed on the ranks with ImportError, an fp8 one quantizes on GPUs of
# compute capability 8.9 and up but not on CPUs (a GGUF file's conversion drops it itself);
# transformers_weights: whole loading read that file while sharded loading read
# model.safetensors, so the numbers depended on model.shard.
WEIGHT_FIELDS = {
    "quantization_config": "quantized weights load differently by machine and library",
    "transformers_weights": "it names another weights file than the one sharded loading reads",
}


def config_refusal(config: Any) -> str | None:
    """Why this model cannot be scored exactly on a ring (or built at all: ``size_refusal``,
    ``value_refusal``), or None (config dict or object)."""
    bad_size = value_refusal(config) or size_refusal(config)
    if bad_size:
        return bad_size
    for key, why in WEIGHT_FIELDS.items():
        if _get(config, key) is not None:
            return f"model config field {key} (config.json): {why}: not supported"
    cfg = text_config(config)
    kind = model_type(config)
    if kind in REFUSED:
        return f"model type {kind!r}: {REFUSED[kind]}: not supported"
    cap = _get(cfg, "attn_logit_softcapping", DEFAULTS.get(kind, {}).get("attn_logit_softcapping"))
    if cap is not None:
        return (
            f"model type {kind!r}: attention-logit soft-capping (attn_logit_softcapping={cap}) "
            "is not implemented by ring attention: not supported"
        )
    qk = (_get(cfg, "qk_nope_head_dim") or 0) + (_get(cfg, "qk_rope_head_dim") or 0)
    v_dim = _get(cfg, "v_head_dim")
    if qk and v_dim and qk != v_dim:
        return (
            f"model type {kind!r}: its attention's query/key heads ({qk}) and value heads "
            f"({v_dim}) differ in size (multi-head latent attention), which the ring kernels "
            "do not take: not supported"
        )
    if kind == "gpt_oss":
        from ringattn.hf import supports_sinks

        if not supports_sinks():
            return (
                f"model type {kind!r}: attention sinks need ring_attention(sinks=...), which "
                "this ringattn does not have: not supported"
            )
    return None


def length_limit(config: Any) -> int | None:
    """The longest document ring attention gives exactly (chunked attention, Llama 4's
    temperature tuning), or None: no limit."""
    cfg = text_config(config)
    limits = _temperature_limit(cfg)
    types = _get(cfg, "layer_types")
    chunk = _get(cfg, "attention_chunk_size")
    if chunk and (types is None or "chunked_attention" in types):
        limits.append(int(chunk))
    return min(limits) if limits else None


def window(config: Any) -> int | None:
    """The shortest attention window of any layer (sliding or chunked), or None (no window):
    what makes a model's numbers depend on how far back a token may look."""
    found = [w for w in (sliding_window(config), length_limit(config)) if w is not None]
    return min(found) if found else None


def _temperature_limit(cfg: Any) -> list[int]:
    """Llama 4's NoPE layers scale queries by log1p(floor((p + 1) / floor_scale)), computing p
    from each rank's *local* positions: the same as the model's only while every scale is 1,
    i.e. for documents of at most floor_scale - 1 tokens."""
    floor_scale = _get(cfg, "floor_scale")
    uses_nope = _get(cfg, "no_rope_layers") is None or 0 in (_get(cfg, "no_rope_layers") or [])
    if _get(cfg, "attn_temperature_tuning") and floor_scale and uses_nope:
        return [int(floor_scale) - 1]
    return []


def window_refusal(config: Any, n_tokens: int) -> str | None:
    """Why a document of n_tokens cannot be scored exactly (length_limit), or None."""
    limit = length_limit(config)
    if limit is None or n_tokens <= limit:
        return None
    return (
        f"{n_tokens} tokens is longer than model type {model_type(config)!r} allows "
        f"(chunked attention or attention temperature tuning, limit {limit}); ring attention "
        f"computes full causal attention, which equals the model's only for documents of at "
        f"most {limit} tokens"
    )


def model_refusal(model) -> str | None:
    """config_refusal, plus token-mixing convolutions in the built model (any hybrid)."""
    return config_refusal(model.config) or sequence_mixing_refusal(model)


def sequence_mixing_refusal(model) -> str | None:
    """A convolution over the sequence anywhere in the model (what state-space, short-conv and
    linear-attention layers have), whatever the family is called."""
    import torch

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Conv1d):
            return (
                f"model type {model_type(model.config)!r}: {name} is a convolution over the "
                "sequence (a state-space or convolutional layer), whose state would restart on "
                "every rank's shard: not supported"
            )
    return None


def read_model_config(model_path: str | Path | None, overrides: Mapping | None = None) -> dict:
    """The config.json of a model path (a directory, a .json config, None: the bundled one)
    with ``task.model_overrides`` checked and set (``overrides.py``): what the job builds, for
    the submit checks, the ranks' checks and the planner alike. A ValueError names what is
    wrong (an unreadable file, an override that is not a field of the model's config)."""
    data = _read_config_file(model_path)
    if not overrides:
        return data
    from .overrides import merge, refusal

    why = refusal(data, overrides)
    if why:
        raise ValueError(why)
    return merge(data, overrides)


def model_shape(model_path: str | Path | None, overrides: Mapping | None = None):
    """The planner's ``ModelShape`` of a model path, read by ``read_model_config`` (the one
    config reader: the planner's, `ringctl plan --model DIR`'s and the job's): what the job
    builds is what is priced. A UserError names the file and what is wrong."""
    from ...errors import UserError
    from ...planner.model import from_hf_config

    try:
        data = read_model_config(model_path, overrides)
    except ValueError as err:
        raise UserError(str(err)) from None
    if model_path is None:
        return from_hf_config(data, "the bundled tiny Llama")
    path = Path(model_path)
    return from_hf_config(data, str(path / "config.json" if path.is_dir() else path))


def trained_context(config: Any) -> int | None:
    """The longest document the model was trained on (``max_position_embeddings``), past which
    its scores are extrapolation; None when unknown, or when every layer attends within a
    sliding window no longer than it (a query then never meets a key farther away than in
    training: the bundled byte model)."""
    cfg = text_config(config)
    limit = _get(cfg, "max_position_embeddings")
    if not is_size(limit):
        return None
    window = sliding_window(config)
    layers = _get(cfg, "num_hidden_layers")
    if window is not None and window <= limit and sliding_layers(config) == layers:
        return None
    return int(limit)


def context_note(config: Any, n_tokens: int) -> str:
    """A line saying a document of n_tokens is scored past the model's trained context, or ""."""
    limit = trained_context(config)
    if limit is None or n_tokens <= limit:
        return ""
    return (
        f"{n_tokens} tokens, longer than model type {model_type(config)!r}'s trained context "
        f"(max_position_embeddings {limit}): positions {limit}-{n_tokens - 1} are scored past "
        "what the model was trained on"
    )


def config_from_fields(data: dict, where: str | Path):
    """(transformers config, seed) from a JSON config's fields (read once, the overrides
    merged in: ``read_model_config``); keys starting with "_" are ours. transformers'
    config classes, not torch: the submit's check (``built_config_refusal``) and the ranks
    build it alike."""
    from transformers import AutoConfig

    if "model_type" not in data:
        raise ValueError(f"{where}: a model config needs a 'model_type' (e.g. 'llama')")
    seed = int(data.get("_ringctl_seed", 0))
    fields = {k: v for k, v in data.items() if not k.startswith("_")}
    return AutoConfig.for_model(**fields), seed


def built_config_refusal(model_path: str | Path, overrides: Mapping | None = None) -> str | None:
    """Why transformers' own config class refuses a hand-written .json model config, in one
    line, or None. transformers 5 checks its fields as it builds the config (initializer_range
    1e25: "must be ... smaller or equal to 1.0"), which every rank did at start, failing with
    its traceback; the submit builds it the same way first. Needs transformers (ImportError
    otherwise: the package check then refuses the job)."""
    data = read_model_config(model_path, overrides)
    try:
        config_from_fields(data, model_path)
    except ImportError:
        raise
    except Exception as err:  # whatever the class raises, the ranks would raise too
        why = " ".join(str(err).split()).rstrip(".")
        return f"{model_path}: transformers refuses this model config: {cut(why, 300)}"
    return None


def _read_config_file(model_path: str | Path | None) -> dict:
    """A model path's config.json (a GGUF file's: its conversion's, made first if missing)."""
    from .directory import read_model_file
    from .gguf_file import converted, is_gguf
    from .names import bundled_config_path

    if model_path is None:
        path = bundled_config_path()
    else:
        path = converted(model_path) if is_gguf(model_path) else Path(model_path)
        if path.is_dir():
            path = path / "config.json"
    if not os.path.lexists(path):
        raise ValueError(f"{path}: no model config here")
    try:
        data = json.loads(read_model_file(path, MAX_CONFIG_BYTES))  # a FIFO, /dev/zero: named
    except ValueError as err:
        raise ValueError(naming(path, str(err), what="unreadable model config")) from None
    except RecursionError:  # json's parser recurses once per level of nesting
        raise ValueError(f"{path}: unreadable model config (nested too deeply to parse)") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a model config must be a JSON object")
    return data
