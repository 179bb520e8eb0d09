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
from ..text import cut
from .hf_config import is_size, sliding_layers, value_refusal
from .hf_config import sliding_window as window_of

# Families whose MLP is not gated (two matrices, not three) or whose attention is laid out
# otherwise (falcon's fused multi-query projections): ModelShape prices a Llama-style layer.
UNGATED_FAMILIES = frozenset(
    {
        "bloom",
        "biogpt",
        "codegen",
        "falcon",
        "gpt2",
        "gpt_bigcode",
        "gpt_neo",
        "gpt_neox",
        "gpt_neox_japanese",
        "gptj",
        "mpt",
        "nemotron",
        "opt",
        "persimmon",
        "phi",
        "starcoder2",
        "xglm",
    }
)


@dataclass(frozen=True)
class ModelShape:
    """A Llama-family decoder: attention (GQA) + gated MLP per layer, embeddings + lm_head.

    ``heads``/``kv_heads``/``head_dim`` are optional so that older callers (which gave the
    attention shape on the Workload only) keep working: the Workload's values fill them in.
    A mixture of experts (``experts`` > 0) replaces every layer's MLP by ``experts`` gated MLPs
    of ``intermediate`` each behind a linear router, ``experts_per_token`` of them run per
    token, beside a shared expert of ``shared_intermediate`` (Qwen2-MoE's) if any.
    """

    layers: int
    hidden: int
    intermediate: int | None = None
    vocab: int = 32000
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    tied_embeddings: bool = False
    name: str = ""
    window: int | None = None  # the sliding window of the windowed layers (None: no window)
    window_layers: int | None = None  # how many layers have it; None: all of them
    experts: int = 0  # routed experts per layer; 0: a dense MLP
    experts_per_token: int = 0
    shared_intermediate: int = 0  # a shared expert's width (Qwen2-MoE); 0: none
    family: str = ""  # config.json's model_type ("" for presets and flags: Llama-style)

    @property
    def layout_note(self) -> str | None:
        """Why this family's figures are a Llama-style decoder's, not its own (None: they
        are its own): its MLP is not gated, or its attention's projections are laid out
        otherwise; weights and activations were priced as Llama's without a word (phi-2:
        3.62B parameters priced for 2.78B)."""
        if self.family not in UNGATED_FAMILIES:
            return None
        return (
            f"model_type {self.family!r} is priced as a Llama-style decoder (a gated MLP of "
            "intermediate_size, separate q/k/v/o projections): its own layout differs, so its "
            "weights and activations are approximate"
        )

    @property
    def inter(self) -> int:
        return self.intermediate or 4 * self.hidden

    @property
    def active_inter(self) -> int:
        """The MLP width one token passes through: the dense MLP's, or its experts' (each of
        ``experts_per_token``) plus the shared expert's. Activations and elementwise work
        grow with it; the weights with every expert (``mlp_params``)."""
        if not self.experts:
            return self.inter
        return self.experts_per_token * self.inter + self.shared_intermediate


def mlp_params(m: ModelShape) -> int:
    """Weights of one layer's MLP: gate/up/down; with experts, every expert's, the router
    (hidden x experts) and a shared expert with its one-output gate. Biases (gpt-oss's
    experts have them) are left out: under 0.1% of any published MoE."""
    h, i = m.hidden, m.inter
    if not m.experts:
        return 3 * h * i
    shared = 3 * h * m.shared_intermediate + h if m.shared_intermediate else 0
    return m.experts * 3 * h * i + h * m.experts + shared


def layer_params(m: ModelShape, heads: int, kv_heads: int, head_dim: int) -> int:
    """Weights of one decoder layer: q/k/v/o projections, the MLP (``mlp_params``), two norms."""
    attn = m.hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * m.hidden
    return attn + mlp_params(m) + 2 * m.hidden


def embedding_params(m: ModelShape) -> int:
    """Input embedding plus lm_head (one matrix when tied) plus the final norm."""
    return (1 if m.tied_embeddings else 2) * m.vocab * m.hidden + m.hidden


def total_params(m: ModelShape, heads: int, kv_heads: int, head_dim: int) -> int:
    return m.layers * layer_params(m, heads, kv_heads, head_dim) + embedding_params(m)


def layer_matmuls(m: ModelShape, heads: int, kv_heads: int, head_dim: int) -> list[tuple[int, int]]:
    """(in, out) widths of one decoder layer's matmuls: q, k, v, o; gate, up, down. A CPU's
    matmul rate depends on the width it sums over (``Device.matmul_rate``), so the planner
    prices each one by its own."""
    q, kv = heads * head_dim, kv_heads * head_dim
    h = m.hidden
    return [(h, q), (h, kv), (h, kv), (q, h), *mlp_matmuls(m)]


def mlp_matmuls(m: ModelShape) -> list[tuple[int, int]]:
    """(in, out) widths of the matmuls one token's MLP runs: gate, up, down; with experts, the
    router and ``experts_per_token`` experts' gate, up, down, then a shared expert and its gate
    (the FLOPs of a token; an expert no token chose costs nothing)."""
    h, i = m.hidden, m.inter
    if not m.experts:
        return [(h, i), (h, i), (i, h)]
    s = m.shared_intermediate
    shared = [(h, s), (h, s), (s, h), (h, 1)] if s else []
    return [(h, m.experts), *[(h, i), (h, i), (i, h)] * m.experts_per_token, *shared]


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
    return 6 * m.hidden + 5 * (q + kv) + 2 * m.hidden + 2 * m.active_inter


MAX_PARAMS = 10**14  # 50 times the largest published model: a config that says more is wrong
MAX_EXPERTS = 1 << 16  # routed experts per layer (published models: a few hundred)


class Unpriced(UserError):
    """A model the job runs but the planner cannot price (an expert layout it does not read):
    a check that needs its numbers is skipped or refused, saying so, not guessed."""


class ModelTooLarge(UserError):
    """A config whose sizes make more than MAX_PARAMS parameters: no machine holds it, and its
    numbers overflow what the planner computes. ``Sizing.model_state_problem`` says it at
    submit (where --force may override the other state checks)."""


def too_large(params: int) -> str | None:
    """Why a model of ``params`` parameters is no model (more than MAX_PARAMS), or None."""
    if params <= MAX_PARAMS:
        return None
    return f"the model has {params:.3g} parameters (its config's sizes): no machine has room"


def _int(data: dict, key: str, where: str, default=None) -> int:
    """A size of the config (``hf_config.is_size``, the job's rule: a positive int, not a bool,
    a float or a string), or ``default`` where the key is absent or null."""
    value = data.get(key)
    if value is None:
        value = default
    if value is None:
        raise UserError(f"{where}: missing key {key!r}")
    if not is_size(value):
        raise UserError(
            f"{where}: key {key!r} must be a positive integer, got {cut(repr(value), 40)}"
        )
    return value


def from_hf_config(data: dict, where: str) -> ModelShape:
    """A shape from a Hugging Face config (Llama, Mistral, Qwen2 and similar key names; the
    experts of MOE_FAMILIES). A head_dim of null or 0 is hidden / heads, as in transformers;
    a shape of more than MAX_PARAMS parameters is refused (no machine holds it)."""
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a JSON object")
    if "text_config" in data and "hidden_size" not in data:  # multimodal wrappers
        data = data["text_config"]
        if not isinstance(data, dict):
            raise UserError(f"{where}: key 'text_config' must be a JSON object")
    hidden = _int(data, "hidden_size", where)
    heads = _int(data, "num_attention_heads", where)
    kv = _int(data, "num_key_value_heads", where, default=heads)
    given = {} if data.get("head_dim") == 0 else data  # 0 is null: compat.size_refusal's rule
    head_dim = _int(given, "head_dim", where, default=hidden // heads or None)
    if heads % kv:
        raise UserError(
            f"{where}: num_attention_heads ({heads}) must be a multiple of "
            f"num_key_value_heads ({kv})"
        )
    moe = experts(data, where)
    shape = ModelShape(
        layers=_int(data, "num_hidden_layers", where),
        hidden=hidden,
        intermediate=moe.pop("intermediate", None)
        or _int(data, "intermediate_size", where, default=4 * hidden),
        vocab=_int(data, "vocab_size", where),
        heads=heads,
        kv_heads=kv,
        head_dim=head_dim,
        tied_embeddings=_flag(data, "tie_word_embeddings", where),
        name=str(data.get("_name_or_path") or data.get("model_type") or ""),
        family=str(data.get("model_type") or ""),
        **sliding_window(data, where),
        **moe,
    )
    why = too_large(total_params(shape, heads, kv, head_dim))
    if why:
        raise ModelTooLarge(f"{where}: {why}")
    return shape


def _flag(data: dict, key: str, where: str) -> bool:
    """A true/false key (absent or null: false); the string "false" is no flag."""
    value = data.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise UserError(f"{where}: key {key!r} must be true or false, got {cut(repr(value), 40)}")
    return value


# Keys that give a config experts (a mixture of experts), in the spellings of transformers'
# families.
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
# Families whose experts the planner reads: every layer's MLP is num_local_experts (or
# num_experts) gated MLPs of moe_intermediate_size (else intermediate_size) behind a linear
# router, num_experts_per_tok per token, and Qwen2-MoE's shared expert
# (shared_expert_intermediate_size); as transformers' modeling code builds them.
MOE_FAMILIES = ("mixtral", "phimoe", "olmoe", "gpt_oss", "qwen2_moe", "qwen3_moe")


def experts(data: dict, where: str) -> dict:
    """{experts, experts_per_token, intermediate, shared_intermediate} of a config's mixture
    of experts, {} for a dense model. A family whose experts are laid out otherwise (dense
    layers between, shared experts of their own keys: DeepSeek, Llama 4, ...) is refused by
    name rather than priced as a dense model of a fraction of its weights."""
    key = next((k for k in EXPERT_KEYS if data.get(k)), None)  # 0 or null: dense
    if key is None or data.get("is_moe") is False:  # Doge names experts it does not use
        return {}
    kind = data.get("model_type")
    if kind not in MOE_FAMILIES:
        raise Unpriced(
            f"{where}: model type {kind!r} has experts ({key}), laid out in a way the planner "
            f"does not read (it reads {', '.join(MOE_FAMILIES)}): not supported"
        )
    count = _int(data, key, where)
    if count > MAX_EXPERTS:
        raise UserError(f"{where}: key {key!r}: {count} experts, more than {MAX_EXPERTS}")
    per_token = _int(data, "num_experts_per_tok", where)
    if per_token > count:
        raise UserError(
            f"{where}: key 'num_experts_per_tok' ({per_token}) is more than the {count} experts"
        )
    if data.get("decoder_sparse_step", 1) != 1 or data.get("mlp_only_layers"):
        raise Unpriced(
            f"{where}: keys 'decoder_sparse_step' / 'mlp_only_layers': dense layers between "
            "the expert layers are not read by the planner: not supported"
        )
    width = _int(data, "moe_intermediate_size", where, default=data.get("intermediate_size"))
    shared = "shared_expert_intermediate_size"
    return {
        "experts": count,
        "experts_per_token": per_token,
        "intermediate": width,
        "shared_intermediate": _int(data, shared, where) if data.get(shared) else 0,
    }


def sliding_window(data: dict, where: str) -> dict:
    """{window, window_layers} of a config: ``hf_config.sliding_window`` and ``sliding_layers``
    (the job's rule: layer_types, else the layers the family's config class windows), with
    the fields they read checked first (``hf_config.value_refusal``)."""
    why = value_refusal(data)
    if why:
        raise UserError(f"{where}: {why}")
    types = data.get("layer_types")
    if types is not None and not (
        isinstance(types, list) and all(isinstance(t, str) for t in types)
    ):
        raise UserError(
            f"{where}: key 'layer_types' must be a list of names, got {cut(repr(types), 60)}"
        )
    size = window_of(data)
    if size is None:
        return {}
    layers = _int(data, "num_hidden_layers", where)
    count = min(layers, sliding_layers(data))
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
