"""A model directory read as hostile: every file transformers may read from it lies inside it.

transformers refuses ``..`` and absolute names in a safetensors index, but follows links (its
own cache is made of them) and joins ``tokenizer_config.json``'s ``fast_tokenizer_files`` onto
the directory unchecked. So a directory whose ``model.safetensors`` or ``tokenizer.json`` is a
link to another model's, or whose tokenizer config names ``../other/tokenizer.json``, made a job
compute with weights or a tokenizer from elsewhere, silently. Here, before anything loads:

* every entry of the directory that is a link resolves inside ``containment_root`` (the
  directory, or a Hugging Face cache repository's folder for one of its snapshots, whose
  files are links to ``../../blobs/``);
* no entry is a pipe, a socket or a device (a FIFO named config.json hung the submit);
* no ``adapter_config.json``: with peft installed, transformers loads the base model that file
  names (from elsewhere) and the adapter on top, whichever the directory's own weights;
* every file ``tokenizer_config.json``'s ``fast_tokenizer_files`` names is a plain name of a
  file in the directory (its ``tokenizer_file`` / ``vocab_file`` transformers ignores, and real
  directories carry the absolute paths of the machine that saved them: not refused).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

from ...bounded_read import open_regular, read_regular
from ...text import echo

MAX_JSON_BYTES = 256 << 20  # tokenizer_config.json with every added token: megabytes
INDEX_FILE = "model.safetensors.index.json"  # the weights: sharded, or in one file
SINGLE_FILE = "model.safetensors"

TOKENIZER_CONFIG = "tokenizer_config.json"
FAST_TOKENIZER_FILES = "fast_tokenizer_files"
ADAPTER_CONFIG = "adapter_config.json"


def containment_root(directory: Path) -> Path:
    """Where a model directory's files must resolve: the directory itself, or, for a Hugging
    Face cache snapshot (``models--ORG--NAME/snapshots/REV/``), the repository's folder."""
    real = directory.resolve()
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        return real.parent.parent
    return real


def check_model_directory(directory: str | Path) -> None:
    """ValueError naming the entry where ``directory`` would have a model read from outside
    it (module docstring); nothing for a path that is not a directory (a .json config, a
    GGUF file: checked where they are read)."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    root = containment_root(directory)
    if (directory / ADAPTER_CONFIG).exists():
        raise ValueError(
            f"{directory / ADAPTER_CONFIG}: a PEFT adapter, whose base model transformers "
            "would load from where the file says: merge it into the weights first "
            "(peft's merge_and_unload, then save_pretrained)"
        )
    for entry in directory.iterdir():
        _check_entry(entry, root)
    _check_tokenizer_names(directory)


def check_tokenizer_files(directory: str | Path) -> None:
    """ValueError naming the first of the tokenizer's JSON files (``TOKENIZER_READS``) that
    does not parse: a truncated tokenizer.json passed submit and failed every rank after the
    queue wait, naming neither the file nor the key. Nothing for a path that is not a
    directory."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for name in sorted(n for n in TOKENIZER_READS if n.endswith(".json")):
        path = directory / name
        if not os.path.lexists(path):
            continue
        raw = read_model_file(path)  # ValueError naming it: a link out, a pipe, too long
        try:
            json.loads(raw)
        except (ValueError, RecursionError) as err:
            said = f"{type(err).__name__}: {err}"
            raise ValueError(f"{path}: not readable as JSON ({said})") from None


def followed(entry: Path, root: Path | None = None) -> Path:
    """``entry`` of a model directory, or where it links to: ValueError where that lies
    outside ``root`` (default: the ``containment_root`` of the entry's directory)."""
    if not entry.is_symlink():
        return entry
    target = entry.resolve()
    if not target.is_relative_to(root or containment_root(entry.parent)):
        raise ValueError(f"{entry}: a link to {target}, outside the model directory")
    return target


# A directory holding one of these has a tokenizer of its own (the job's default tokenizer:
# names.resolve_tokenizer_path).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# The tokenizer files whose bytes a model's identity hashes (run.json, a training run's
# signature): the list those identities were recorded with, kept as it is so that a run of
# an earlier release resumes and gathers (adding a name changed every recorded identity of a
# folder holding it).
TOKENIZER_IDENTITY = frozenset(
    {
        *TOKENIZER_FILES,
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "merges.txt",
    }
)
# Every file a tokenizer reads from its directory (transformers' classes for causal LMs and
# the older formats beside them; the chat template, which shapes no ids): gather copies them
# beside exported weights (three of them were copied: a GPT-2-style vocab.json/merges.txt
# tokenizer was exported as one file that encoded text to no ids, exit 0).
TOKENIZER_READS = TOKENIZER_IDENTITY | {
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
}
# What a job reads from a model directory that shapes its numbers: the config, the weights,
# and the tokenizer (its ids). A model's identity hashes their bytes.
IDENTITY_FILES = frozenset({"config.json", INDEX_FILE}) | TOKENIZER_IDENTITY
_HASH_PIECE = 8 << 20


def _weights(entry: Path) -> bool:
    return entry.suffix == ".safetensors"


def model_identity(path: str | Path, *, weights: bool = True) -> str:
    """The sha256 of what a job computes with at ``path`` (a model directory: its
    IDENTITY_FILES and ``*.safetensors``, names and bytes, in name order; a file: its bytes).
    run.json records it: a resume whose model changed at the same path (a checkpoint
    rewritten, a package upgraded) mixed two models' results in one output, and gather
    vouched for them. Reading the weights once more costs their size at disk or page-cache
    speed (SmolLM2's 145 MB GGUF: a fraction of a second); rank 0 alone reads them.
    ``weights=False``: a tokenizer's directory (its files but the config and weights)."""
    path = Path(path)
    files = _identity_files(path, weights)
    digest = hashlib.sha256()
    for entry in files:
        digest.update(entry.name.encode("utf-8", "surrogateescape") + b"\0")
        try:
            f = open_regular(followed(entry) if path.is_dir() else entry.resolve())
        except FileNotFoundError:
            raise ValueError(f"{entry}: cannot be read (no such file)") from None
        with f:
            while piece := f.read(_HASH_PIECE):
                digest.update(piece)
    return digest.hexdigest()[:32]


def _identity_files(path: Path, weights: bool) -> list[Path]:
    """The files ``model_identity`` hashes, in its order."""
    if not path.is_dir():
        return [path]
    names = IDENTITY_FILES if weights else TOKENIZER_IDENTITY
    chosen = (e for e in path.iterdir() if e.name in names or weights and _weights(e))
    return sorted(chosen, key=lambda e: e.name)


def identity_bytes(*paths: str | Path | None) -> int:
    """How many bytes ``model_identity`` of these paths reads (a model's, then a
    tokenizer's: its files but the weights), by their sizes; 0 for what cannot be listed."""
    total = 0
    for at, path in enumerate(p for p in paths if p):
        try:
            total += sum(f.stat().st_size for f in _identity_files(Path(path), at == 0))
        except OSError:
            pass
    return total


# A run record's path keys (run.json, a checkpoint's run signature), each with the key of
# its files' identity (``model_identity``; only rank 0 of a scoring job computes them).
IDENTITY_OF_PATH = {"model_path": "model", "tokenizer_path": "tokenizer"}


def moved_install(have: dict, want: dict, *, installed: bool) -> set[str]:
    """The path keys of two run records (run.json, a checkpoint's run signature) that differ
    only in where an installed model is (``installed``: the job names a bundled or packaged
    model, ``names.installed_model``), the identity of its files recorded on both sides and
    equal. Such a model is recorded as the path it resolves to in the install, which a new
    environment moves: the job could not be resumed at all, and the path may not be
    overridden. A user's own path is not excused: its identity hashes fewer tokenizer files
    than a tokenizer may read (TOKENIZER_IDENTITY). A tokenizer read from the model's own
    folder (tokenizer_path the model_path on both sides) moves with it."""
    if not installed:
        return set()
    same = {
        path: have.get(key) is not None and have.get(key) == want.get(key)
        for path, key in IDENTITY_OF_PATH.items()
    }
    if all(r.get("tokenizer_path") == r.get("model_path") for r in (have, want)):
        same["tokenizer_path"] = same["tokenizer_path"] or same["model_path"]
    return {path for path, ok in same.items() if ok and have.get(path) != want.get(path)}


def read_model_file(path: Path, limit: int = MAX_JSON_BYTES) -> bytes:
    """A model directory's file (config.json, tokenizer_config.json), read as hostile: a
    regular file within ``limit`` bytes, through a link only into the model's own folder (a
    Hugging Face cache snapshot's files are links to its blobs). ValueError naming it."""
    return read_regular(followed(path), limit)


def _check_entry(entry: Path, root: Path) -> None:
    followed(entry, root)
    try:
        mode = entry.stat().st_mode
    except OSError as err:
        raise ValueError(f"{entry}: cannot be read ({err.strerror})") from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise ValueError(f"{entry}: not a regular file (a pipe, a socket or a device)")


def _check_tokenizer_names(directory: Path) -> None:
    path = directory / TOKENIZER_CONFIG
    if not path.exists():
        return
    try:
        config = json.loads(read_model_file(path))
    except (ValueError, RecursionError):
        return  # not this check's: check_tokenizer_files (at submit) reports it
    if not isinstance(config, dict):
        return
    value = config.get(FAST_TOKENIZER_FILES)
    if value is not None:
        for name in value if isinstance(value, list) else [value]:
            plain = isinstance(name, str) and name not in ("", ".", "..")
            if not plain or Path(name).name != name or not (directory / name).is_file():
                raise ValueError(
                    f"{path}: {FAST_TOKENIZER_FILES} names {echo(name)}, not a file of "
                    "this directory"
                )
