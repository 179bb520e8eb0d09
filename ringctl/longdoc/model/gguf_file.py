"""A GGUF model file (llama.cpp's format, what llama.cpp and Ollama users have on disk) as a
job's model: ``task.model_path: FILE.gguf``.

transformers reads GGUF itself (``from_pretrained(..., gguf_file=...)``, the ``gguf`` package's
reader and dequantiser behind it), and it is the only reader used here: no GGUF parsing of our
own decides what the weights are. It dequantises every weight on every load (14 s for the
135M SmolLM2 on a 2-core machine), which every rank of every job would pay; so a file is
converted once into a plain transformers directory (``model.safetensors``, ``config.json``, the
tokenizer's files, ``gguf-source.json`` saying where it came from) in a cache, and every later
job and every rank loads that directory (``converted``): 0.2 s, and the config checks, the
tokenizer and the loader see a model directory like any other (``load.model_directory``).

* **Key: the file's content.** An entry is named by the file's size and sha256, and the
  versions of transformers and gguf that converted it (a fix there changes the weights) and
  this module's ``FORMAT``. Content, not path or inode: two copies of one file share an entry,
  every node computes the same name from the same bytes, and a file replaced in place is never
  mistaken for the one converted before. Hashing a large file on every lookup would cost
  seconds, so the digest is remembered under the file's stat (device, inode, size, mtime,
  ctime: ctime cannot be set back by a user): only the first lookup of a file reads it whole.
* **float32, whatever ``task.dtype``.** A dequantised weight is a float16 scale times a small
  integer (plus a float16 offset), computed in float32: float32 holds it exactly, so one
  conversion serves every dtype, and a job's cast to bfloat16 at load gives the same weights a
  bfloat16 conversion would (both round the same float32 to nearest). The price: twice the
  disk of a bfloat16 copy.
* **Concurrent ranks.** The conversion holds an exclusive lock on the entry's lock file, writes a
  temporary directory beside the entry and renames it into place (atomic on one filesystem):
  an entry exists only whole. A rank that waited finds the entry and uses it; a rename that
  loses a race (where locks are not shared between nodes) drops its own copy and uses the
  winner's.
* **Confined.** Entry names are built from a hex digest and checked version strings; an entry is
  used only if it resolves to a directory directly inside the resolved cache root (a symbolic
  link planted there is refused).

What transformers cannot load is refused before any conversion, by name (``refusal``): an
architecture its GGUF support does not know, and tensors of a quantisation type the ``gguf``
package cannot dequantise. The cache: ``$RINGCTL_CACHE/gguf``, else
``$XDG_CACHE_HOME/ringctl/gguf``, else ``~/.cache/ringctl/gguf``.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .hub import go_offline

FORMAT = 2  # what a conversion writes; a change makes new entries (2: a tied weight under
# its parameter's name)
GGUF_INSTALL = "pip install 'ringctl[gguf]'"
NEEDS = ("transformers", "gguf", "accelerate")  # what converting a GGUF file imports
SOURCE = "gguf-source.json"
_HEX = re.compile(r"[0-9a-f]{64}")
_UNSAFE = re.compile(r"[^A-Za-z0-9.+]")
_BLOCK = 1 << 20


@dataclass(frozen=True)
class FileIdentity:
    """What names a GGUF file's conversion: its size and the sha256 of its bytes."""

    size: int
    sha256: str


def is_gguf(model_path) -> bool:
    """Whether a model path names a GGUF file (by its suffix, as llama.cpp names them)."""
    return model_path is not None and str(model_path).lower().endswith(".gguf")


def cache_root() -> Path:
    """Where conversions live (see the module docstring)."""
    base = os.environ.get("RINGCTL_CACHE")
    if base:
        return Path(base).expanduser() / "gguf"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "ringctl" / "gguf"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _stat_key(st: os.stat_result) -> str:
    return f"{st.st_dev}-{st.st_ino}-{st.st_size}-{st.st_mtime_ns}-{st.st_ctime_ns}"


def file_identity(path: Path, root: Path) -> FileIdentity:
    """The file's size and sha256; the digest is remembered under ``root/stat/`` by the file's
    stat, so a later lookup of the same unchanged file reads no byte of it. A file that changed
    while it was hashed is hashed, not remembered."""
    before = path.stat()
    record = root / "stat" / _stat_key(before)
    with contextlib.suppress(OSError, UnicodeDecodeError):
        known = record.read_text().strip()
        if _HEX.fullmatch(known):
            return FileIdentity(before.st_size, known)
    digest = _sha256(path)
    if _stat_key(path.stat()) == _stat_key(before):
        with contextlib.suppress(OSError):  # a read-only cache only costs hashing again
            record.parent.mkdir(parents=True, exist_ok=True)
            tmp = record.with_name(f".{record.name}.{os.getpid()}.tmp")
            tmp.write_text(digest + "\n")
            os.replace(tmp, record)
    return FileIdentity(before.st_size, digest)


def _version(module: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return _UNSAFE.sub("_", version(module))
    except PackageNotFoundError:
        return "none"


def entry_name(identity: FileIdentity) -> str:
    """The cache entry's name: the file's identity and what converted it (module docstring)."""
    made_by = f"transformers{_version('transformers')}-gguf{_version('gguf')}-f{FORMAT}"
    return f"{identity.sha256[:40]}-{identity.size}-{made_by}"


def _inside(entry: Path, root: Path) -> Path | None:
    """The entry, resolved, if it is a whole conversion directly inside the resolved root;
    None while it does not exist; ValueError for anything else found under its name."""
    if not os.path.lexists(entry):
        return None
    real_root, real = root.resolve(), entry.resolve()
    if entry.is_symlink() or real.parent != real_root or not real.is_dir():
        raise ValueError(
            f"{entry}: not a directory inside the GGUF cache {real_root}; remove it (the "
            "file's conversion is made again)"
        )
    if not (real / "config.json").is_file() or not (real / SOURCE).is_file():
        raise ValueError(f"{entry}: an incomplete GGUF conversion; remove it")
    return real


def converted(model_path: str | Path) -> Path:
    """The transformers directory of a GGUF file: its cache entry, made first if missing
    (refused, by name, when transformers cannot load the file: ``refusal``).

    ValueError or FileNotFoundError: one line naming the file (or the cache entry) and why."""
    path = Path(model_path).expanduser().absolute()
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such GGUF file (no download is done)")
    if not path.is_file():  # a folder, a pipe (reading it would block) or a device
        raise ValueError(f"{path}: not a regular file (a GGUF file is one)")
    root = cache_root()
    entry = root / entry_name(file_identity(path, root))
    found = _inside(entry, root)
    if found is not None:
        return found
    with _locked(root, entry.name):
        found = _inside(entry, root)  # made by another rank while this one waited
        if found is None:
            why = refusal(path)
            if why:
                raise ValueError(why)
            # seconds and hundreds of MB, with transformers' own progress bars: said first
            print(
                f"ringctl: converting {path.name} into the GGUF cache {root}, once (later "
                "jobs reuse it)",
                file=sys.stderr,
                flush=True,
            )
            try:
                _convert_into(path, entry, root)
            except (OSError, KeyError, RuntimeError) as err:  # a full disk, an odd file
                raise ValueError(
                    f"{path}: converting it into the GGUF cache {root} failed "
                    f"({type(err).__name__}: {err}); nothing was kept (RINGCTL_CACHE moves it)"
                ) from None
            found = _inside(entry, root)
    assert found is not None
    return found


@contextlib.contextmanager
def _locked(root: Path, name: str) -> Iterator[None]:
    """An exclusive lock on ``root/locks/NAME.lock``: one conversion of a file at a time."""
    try:
        (root / "locks").mkdir(parents=True, exist_ok=True)
        handle = open(root / "locks" / f"{name}.lock", "a+b")  # held by the with below
    except OSError as err:
        raise ValueError(
            f"GGUF cache {root}: cannot write there ({err.strerror}); set RINGCTL_CACHE to a "
            "writable folder"
        ) from None
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert_into(path: Path, entry: Path, root: Path) -> None:
    """Convert into a temporary directory beside ``entry``, then rename it into place."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.tmp-", dir=root))
    try:
        write_converted(path, tmp)
        identity = file_identity(path, root)
        source = {
            "format": FORMAT,
            "gguf_file": path.name,
            "bytes": identity.size,
            "sha256": identity.sha256,
            "transformers": _version("transformers"),
            "gguf": _version("gguf"),
            "dtype": "float32",
        }
        (tmp / SOURCE).write_text(json.dumps(source, indent=1) + "\n")
        _follow_umask(tmp)
        try:
            os.rename(tmp, entry)
        except OSError:
            if _inside(entry, root) is None:  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _follow_umask(folder: Path) -> None:
    """The user's umask on the entry and its files (not mkdtemp's 0700 and the 0600 some
    writers give), so a cache shared by a group is usable by it."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for file in folder.iterdir():
        os.chmod(file, 0o666 & ~umask)


def write_converted(path: Path, dest: Path) -> None:
    """The GGUF file as a transformers directory in ``dest``: weights dequantised to float32 by
    transformers, its config without the GGUF quantisation entry, the tokenizer from the same
    file. Loaded from a folder holding nothing but a link to the file, so nothing else beside
    it (another model's config.json) can be read with it."""
    go_offline()
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="ringctl-gguf-") as staging:
        link = Path(staging) / path.name
        link.symlink_to(path)
        common = {"gguf_file": str(link), "trust_remote_code": False}
        model = AutoModelForCausalLM.from_pretrained(staging, dtype=torch.float32, **common)
        tokenizer = AutoTokenizer.from_pretrained(staging, **common)
    for name, weight in model.state_dict().items():
        if weight.dtype != torch.float32 or weight.is_meta:
            raise ValueError(f"{path}: {name} did not load as float32 weights ({weight.dtype})")
    save_file(_named_weights(model), str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights written are plain float32
    config.architectures = [type(model).__name__]
    config.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


def _named_weights(model) -> dict:
    """The model's weights under its own parameter names, each tied weight once under the name
    its parameter has (``model.embed_tokens.weight``), as save_pretrained writes them (it
    refuses a model loaded from GGUF) and the sharded loader reads them. Safetensors' own
    save_model would keep the other name of a tied pair."""
    kept = set(model.state_dict())
    weights = {n: p.detach().contiguous() for n, p in model.named_parameters()}
    weights |= {n: b.detach().contiguous() for n, b in model.named_buffers() if n in kept}
    return weights


def refusal(path: Path) -> str | None:
    """Why transformers cannot load this GGUF file, in one line naming it, or None: a file
    the gguf package cannot read, an architecture transformers' GGUF support does not know, or
    tensors of a quantisation type the gguf package cannot dequantise (transformers
    dequantises every tensor with it)."""
    from gguf import GGUFReader

    from .gguf_header import header_refusal

    why = header_refusal(path)  # its counts against its size: gguf's reader trusts them
    if why:
        return why
    try:
        reader = GGUFReader(path)
        arch = str(reader.fields["general.architecture"].contents())
    except (ValueError, KeyError, OSError, IndexError) as err:
        return f"{path}: not a GGUF file the gguf package can read ({type(err).__name__}: {err})"
    why = architecture_refusal(path, arch)
    if why:
        return why
    bad: dict[str, list[str]] = {}
    for tensor in reader.tensors:
        if not dequantises(tensor.tensor_type):
            bad.setdefault(tensor.tensor_type.name, []).append(tensor.name)
    if not bad:
        return None
    kinds = ", ".join(f"{kind} ({names[0]}: {len(names)} tensor(s))" for kind, names in bad.items())
    return (
        f"{path}: quantisation type {kinds}: the gguf package ({_version('gguf')}) cannot "
        "dequantise it, so transformers cannot load this file"
    )


def architecture_refusal(path: Path, arch: str) -> str | None:
    """Refused when transformers' GGUF support does not load this architecture: asked of
    transformers itself (its lists; for a name in neither, its metadata reader, which knows
    the renames such as qwen2moe and raises for an architecture it does not load), so no list
    here can fall behind its own."""
    from transformers.modeling_gguf_pytorch_utils import (
        GGUF_SUPPORTED_ARCHITECTURES,
        load_gguf_checkpoint,
    )

    try:  # transformers >= 5.2x: architectures whose weights it reads its own way
        from transformers.integrations.gguf.utils import is_gguf_arch_supported
    except ImportError:
        is_gguf_arch_supported = None
    if arch in GGUF_SUPPORTED_ARCHITECTURES or (
        is_gguf_arch_supported is not None and is_gguf_arch_supported(arch)
    ):
        return None  # named in its lists: no need to parse the file again
    try:
        load_gguf_checkpoint(str(path), return_tensors=False)
    except ValueError as err:
        if "architecture" not in str(err):
            return f"{path}: transformers cannot read this GGUF file's metadata ({err})"
        known = ", ".join(
            a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer")
        )
        return (
            f"{path}: architecture {arch!r}: transformers ({_version('transformers')}) does "
            f"not load it from GGUF (it loads: {known})"
        )
    return None


def dequantises(kind) -> bool:
    """Whether the gguf package dequantises tensors of this type (tried on one zero block:
    its own answer, not a list kept here)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, dequantize

    _, type_size = GGML_QUANT_SIZES[kind]
    try:
        dequantize(np.zeros((1, type_size), dtype=np.uint8), kind)
    except NotImplementedError:
        return False
    return True
