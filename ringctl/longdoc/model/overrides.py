"""``task.model_overrides``: fields of the model's config, checked, then set on the loaded config.

Why this module exists: the overrides used to reach ``AutoConfig.from_pretrained`` as keyword
arguments, where a loader option passes as if it were a config field (``trust_remote_code: true``
ran a model directory's own ``configuration_*.py`` on every rank), and a key that is no field at
all was dropped in silence (YAML reads ``{sliding_window:null}`` as the one key
``'sliding_window:null'``: the window stayed on and the job completed with other numbers).

Now a key must be a field of the model's config class, or a key of the model's own config.json
(a field its class does not declare is still an attribute of the loaded config, and what the
compatibility checks read); never a loader option or a setting ringctl owns (``LOADER_OPTIONS``).
A mapping given for a sub-config (``text_config: {...}``) is checked against that sub-config's
class; one given for a dict field (``rope_parameters: {...}``) has free-form keys, but no loader
option may hide inside it, however deep (``nested_problem``). ``refusal`` says what is wrong in
one line, with the nearest real fields; ``merge`` gives the config.json that the submit checks
and the planner read, and that every rank builds its config from (``load.built_with``: a
field the class derives while it is built follows the overrides), so every rank and every
loading path (whole, sharded, random weights) gets the same.

Checking needs transformers' config classes (which import torch): only when there are overrides.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping

_DOWNLOAD = "an option of transformers' loader for downloads (ringctl loads local files only)"
_LOADING = "an option of transformers' loader (how weights are read), not a field of the model"
_OWNED = "ringctl sets it itself"
_NAMES = "names the model's classes or code; it cannot be overridden"
_OUTPUT = "how a forward returns its outputs, which ringctl's scorer decides"
_DOWNLOAD_OPTIONS = (
    "revision subfolder cache_dir token use_auth_token local_files_only force_download proxies "
    "_commit_hash _from_auto _from_pipeline"
).split()
_LOADING_OPTIONS = (
    "use_safetensors device_map max_memory low_cpu_mem_usage offload_folder offload_state_dict "
    "variant gguf_file key_mapping weights_only state_dict from_tf from_flax output_loading_info "
    "return_unused_kwargs quantization_config tp_plan tp_size device_mesh adapter_name "
    "adapter_kwargs"
).split()
_NAMING = "auto_map model_type architectures transformers_version name_or_path".split()
_OUTPUTS = "return_dict output_attentions output_hidden_states use_cache torchscript".split()
LOADER_OPTIONS: dict[str, str] = {
    "trust_remote_code": "ringctl never runs a model directory's own code",
    "code_revision": "ringctl never runs a model directory's own code",
    **dict.fromkeys(_DOWNLOAD_OPTIONS, _DOWNLOAD),
    **dict.fromkeys(_LOADING_OPTIONS, _LOADING),
    "attn_implementation": f"{_OWNED} (attention: ringattn)",
    "_attn_implementation": f"{_OWNED} (attention: ringattn)",
    "experts_implementation": _OWNED,
    "dtype": "set task.dtype",
    "torch_dtype": "set task.dtype",
    **dict.fromkeys(_NAMING, _NAMES),
    **dict.fromkeys(_OUTPUTS, _OUTPUT),
}
WHERE = "task.model_overrides"


def config_class(config: Mapping) -> type:
    """transformers' own config class for a config.json (never the directory's code)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    kind = config.get("model_type")
    if kind not in CONFIG_MAPPING:
        raise ValueError(f"model type {kind!r} is not one transformers ships")
    return CONFIG_MAPPING[kind]


def class_fields(cls: type) -> set[str]:
    """The public fields of a config class: its and its bases' constructor parameters, its
    attribute aliases and sub-configs (transformers 4.x and 5.x alike)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" in vars(klass) and klass is not object:
            params = inspect.signature(klass.__init__).parameters.values()
            names |= {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    names |= set(getattr(cls, "attribute_map", None) or {})
    names |= set(getattr(cls, "sub_configs", None) or {})
    return {n for n in names if not n.startswith("_")} - {"self"}


def refusal(config: Mapping, overrides: Mapping | None, where: str = WHERE) -> str | None:
    """Why ``overrides`` cannot be set on the model of ``config`` (its config.json), in one
    line starting with the key (``task.model_overrides.KEY: why``), or None."""
    found = problem(config, overrides, where)
    return f"{found[0]}: {found[1]}" if found else None


def problem(
    config: Mapping, overrides: Mapping | None, where: str = WHERE, cls: type | None = None
):
    """(the key, why) of the first override that is not a field of the model, or None;
    ``cls``: the config class when known (a sub-config's, from its parent's ``sub_configs``),
    else the one its model_type names.

    Without transformers (a submit host that only renders the job) the fields are unknown:
    loader options and keys that cannot be fields are still refused, the ranks check the rest.
    """
    if not overrides:
        return None
    if cls is None:
        try:
            cls = config_class(config)
        except ValueError as err:
            return where, f"{err}, so its fields are unknown (its own code is not run)"
        except ImportError:
            cls = None
    fields = class_fields(cls) if cls is not None else None
    allowed = (fields or set()) | {k for k in config if isinstance(k, str) and k[:1] != "_"}
    for key, value in overrides.items():
        why = _key_refusal(str(key), allowed, fields, cls.__name__ if cls else "")
        why = why or _decided_in_file(config, overrides, str(key))
        if why:
            return f"{where}.{key}", why
        subs = getattr(cls, "sub_configs", None) or {}
        if isinstance(value, Mapping) and key in subs:
            inner = config.get(key) if isinstance(config.get(key), Mapping) else {}
            found = problem(inner, value, f"{where}.{key}", cls=_sub_class(cls, str(key), inner))
        else:
            found = nested_problem(value, f"{where}.{key}")
        if found:
            return found
    return None


MAX_DEPTH = 16  # mappings nested deeper than any config field's
YAML_NOTE = "YAML reads {a:b} without a space as one key: write {a: b}"


def nested_problem(value, where: str, depth: int = 0):
    """(the key, why) of a loader option, or of a key YAML glued to its value, anywhere inside
    a mapping set on a field (``{rope_parameters: {trust_remote_code: true}}``), or None. Such
    a mapping's keys are free-form (a dict field such as ``id2label``, not a config class), so
    only those are refused."""
    if not isinstance(value, Mapping):
        return None
    if depth >= MAX_DEPTH:
        return where, f"mappings nested more than {MAX_DEPTH} deep"
    for key, inner in value.items():
        name = str(key)
        if name in LOADER_OPTIONS:
            return f"{where}.{name}", f"not a model-config field: {LOADER_OPTIONS[name]}"
        if ":" in name:
            return f"{where}.{name}", f"{name!r} is one key ({YAML_NOTE})"
        found = nested_problem(inner, f"{where}.{name}", depth + 1)
        if found:
            return found
    return None


# A switch whose effect a config.json may state itself: Qwen2's use_sliding_window decides the
# layers' attention (layer_types) only when the file lists none, and transformers 5 saves
# them; with layer_types in the file, the switch alone changes nothing the model runs.
DECIDED_IN_FILE = {"use_sliding_window": "layer_types"}


def _decided_in_file(config: Mapping, overrides: Mapping, key: str) -> str | None:
    field = DECIDED_IN_FILE.get(key)
    if field and field in config and field not in overrides:
        return (
            f"this config.json lists {field}, which decide each layer's attention whatever "
            f"{key} says: override {field} as well"
        )
    return None


def _key_refusal(key: str, allowed: set[str], fields: set[str] | None, name: str) -> str | None:
    if key in LOADER_OPTIONS:
        return f"not a model-config field: {LOADER_OPTIONS[key]}"
    yaml = ":" in key or "=" in key
    note = f" ({YAML_NOTE})" if yaml else ""
    if fields is None:  # no transformers here: only what cannot be a field
        ok = key.isidentifier() and not key.startswith("_")
        return None if ok else f"{key!r} cannot be a field of a model config{note}"
    if key in allowed:
        return None
    near = difflib.get_close_matches(key, sorted(fields), n=3, cutoff=0.6)
    hint = f"; nearest fields: {', '.join(near)}" if near else ""
    return f"{key!r} is not a field of {name}{hint}{note}"


def _sub_class(cls: type, key: str, inner: Mapping) -> type | None:
    """A sub-config's class: the one its own model_type names, else its parent's
    ``sub_configs`` entry (DBRX saves ffn_config with model_type "": its fields were
    unknown, and the training job's refusal named an override that could not be set)."""
    if inner.get("model_type"):
        return None  # config_class reads it
    sub_cls = cls.sub_configs[key]
    return None if sub_cls.__name__ == "AutoConfig" else sub_cls


def merge(config: Mapping, overrides: Mapping | None) -> dict:
    """config.json with the overrides set (into a sub-config's mapping where one is given)."""
    out = dict(config)
    for key, value in (overrides or {}).items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def describe(overrides: Mapping | None) -> str:
    """One log line naming the overrides set on the loaded config ("" when none)."""
    if not overrides:
        return ""
    items = ", ".join(f"{k}={v!r}" for k, v in overrides.items())
    return f"model overrides set on the loaded config: {items}"
