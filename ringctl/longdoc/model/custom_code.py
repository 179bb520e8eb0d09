"""A model or tokenizer directory that ships its own code (``auto_map``): that code never runs.

transformers imports a directory's ``configuration_*.py``, ``modeling_*.py`` or
``tokenization_*.py`` only under ``trust_remote_code=True``, which ringctl never passes (and
``task.model_overrides`` cannot pass: ``overrides.py``). Such a model is built by transformers'
own classes for its ``model_type``, and its numbers are theirs, which may not be what the
directory's code computes (the probe compares the ring with those classes, not with that code).
So ``ringctl submit`` says it, naming the class (``model_note``, ``tokenizer_note``), and refuses
a directory that transformers cannot load without its code.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .directory import read_model_file


def auto_map(config: Mapping) -> list[str]:
    """The class references of a config's ``auto_map`` (dict or legacy list), or []."""
    code: Any = config.get("auto_map") if isinstance(config, Mapping) else None
    if isinstance(code, Mapping):
        code = list(code.values())
    if not isinstance(code, list):
        return []
    refs: list[str] = []
    for item in code:
        refs += [str(r) for r in (item if isinstance(item, list) else [item]) if r]
    return refs


def _names(refs: list[str]) -> str:
    return ", ".join(refs[:3]) + (", ..." if len(refs) > 3 else "")


def model_note(config: Mapping, where: str) -> str:
    """A warning line for a model whose config.json names its own code, or "" (none).

    ValueError: transformers has no built-in causal LM for its model type."""
    refs = auto_map(config)
    if not refs:
        return ""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kind = config.get("model_type")
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(kind) if kind in CONFIG_MAPPING else None
    said = f"{where} names its own code ({_names(refs)}), which ringctl does not run"
    if model_class is None:
        raise ValueError(
            f"{said}, and transformers {transformers.__version__} has no causal LM of model "
            f"type {kind!r} to build instead: not supported"
        )
    return (
        f"{said}: transformers' built-in {CONFIG_MAPPING[kind].__name__} / {model_class} "
        f"(model type {kind!r}) scores it instead, and the probe checks the ring against those"
    )


def tokenizer_note(directory: str | Path) -> str:
    """A warning line for a tokenizer directory that names its own code, or "" (none).

    It loads the tokenizer as the ranks will (``trust_remote_code=False``) to name the class
    that runs; ValueError: transformers cannot load it without the directory's code."""
    found = tokenizer_code(Path(directory))
    if found is None:
        return ""
    file, refs = found
    from .tokenize import HFTokenizer

    said = f"{file} names its own code ({_names(refs)}), which ringctl does not run"
    try:
        tokenizer = HFTokenizer(directory)
    except Exception as err:  # noqa: BLE001 - whatever transformers raises, said in one line
        detail = " ".join(str(err).split())[:300]
        raise ValueError(
            f"{said}, and transformers cannot load it without that code "
            f"({type(err).__name__}: {detail}): give a tokenizer directory with tokenizer.json"
        ) from None
    return f"{said}: transformers' built-in {type(tokenizer.tok).__name__} tokenizes instead"


def tokenizer_code(directory: Path) -> tuple[Path, list[str]] | None:
    """(the file, the class references) of a tokenizer's own code: ``tokenizer_config.json``'s
    auto_map, else ``config.json``'s ``auto_map.AutoTokenizer``, which AutoTokenizer reads
    when the first names no class of its own; None: neither names any."""
    for name, pick in (("tokenizer_config.json", auto_map), ("config.json", _auto_tokenizer)):
        refs = pick(_json_object(directory / name))
        if refs:
            return directory / name, refs
    return None


def _auto_tokenizer(config: Mapping) -> list[str]:
    code = config.get("auto_map")
    if not isinstance(code, Mapping) or "AutoTokenizer" not in code:
        return []
    return auto_map({"auto_map": [code["AutoTokenizer"]]})


def _json_object(file: Path) -> dict:
    """A JSON object from ``file``; {} for a missing or malformed one (transformers reports it
    itself when the ranks load it), a ValueError for one nested too deeply to parse, or that
    is not a regular file (a FIFO hung the submit, /dev/zero filled its memory) or is larger
    than any tokenizer's configuration."""
    if not os.path.lexists(file):
        return {}
    raw = read_model_file(file)  # ValueError naming the file
    try:
        data = json.loads(raw)
    except ValueError:
        return {}
    except RecursionError:  # transformers' own parse would fail the same way on every rank
        raise ValueError(f"{file}: nested too deeply to parse") from None
    return data if isinstance(data, dict) else {}
