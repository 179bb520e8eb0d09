"""Loading torch.distributed.checkpoint (DCP) files that may be hostile.

DCP's own reader unpickles a checkpoint's ``.metadata`` with plain ``pickle`` and its default
load planner reads every non-tensor value with ``torch.load(weights_only=False)``: a crafted
file runs any code it names, and a checkpoint may come from elsewhere (``ringctl gather``
copies ``checkpoints/`` from the cluster and exports it on the user's machine). Here:

* the metadata unpickles only DCP's own record classes, torch.Size and dtypes (``_ALLOWED``;
  anything else is refused by name before it is called);
* every storage entry names a plain regular file in the checkpoint's folder, read within its
  size (no ``..``, no separators, no symlinks, no transform the job never wrote);
* non-tensor values (the optimizer's step counts and hyperparameters) load with
  ``weights_only=True``, then pass to DCP's planner as that safe value;
* DCP's ``CheckpointException`` (a BaseException, which would pass every ``except
  Exception``) becomes a ValueError naming the checkpoint and the first failure.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ..bounded_read import read_regular, regular_file
from ..errors import naming
from ..text import echo

METADATA = ".metadata"
MAX_METADATA_BYTES = 1 << 30
_DCP = "torch.distributed.checkpoint"
_ALLOWED = {
    *(
        (f"{_DCP}.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib._local", "PosixPath"),
}


class Refused(ValueError):
    """A checkpoint file this reader will not load: the message names the file and why."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _ALLOWED or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def read_metadata(folder: Path) -> Metadata:
    """The checkpoint's ``.metadata``, unpickled through the allow-list and checked."""
    path = folder / METADATA
    raw = read_regular(path, MAX_METADATA_BYTES)  # a regular file, no link: ValueError naming it
    try:
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    except Exception as err:  # any malformed pickle: one line, naming the file
        raise Refused(f"{path}: not a checkpoint's metadata ({err})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise Refused(f"{path}: not a checkpoint's metadata")
    for entry in metadata.storage_data.values():
        _check_entry(folder, path, entry)
    return metadata


def _check_entry(folder: Path, where: Path, entry) -> None:
    name = getattr(entry, "relative_path", None)
    offset, length = getattr(entry, "offset", None), getattr(entry, "length", None)
    plain = isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name
    if not plain or "\\" in name or "\0" in name:
        raise Refused(f"{where}: a storage entry names {echo(name)}, not a file here")
    if getattr(entry, "transform_descriptors", None):
        raise Refused(f"{where}: {name} is stored through a transform this job never writes")
    for value in (offset, length):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise Refused(f"{where}: {name}: offset and length must be integers >= 0")
    if offset + length > regular_file(folder / name).st_size:
        raise Refused(f"{where}: {name} is shorter than an entry it holds")


class _Reader(FileSystemReader):
    """DCP's file reader handing out the metadata ``read_metadata`` read and checked."""

    def __init__(self, folder: Path, metadata: Metadata) -> None:
        super().__init__(folder)
        self._checked = metadata

    def read_metadata(self, *args) -> Metadata:  # no kwargs: no fallback to per-rank files
        metadata = self._checked
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _Planner(DefaultLoadPlanner):
    """DCP's default planner, non-tensor values loaded with ``weights_only=True``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            safe = torch.load(value, weights_only=True)
        except Exception as err:
            said = _one_line(err)
            raise Refused(f"{read_item.dest_index.fqn}: not a plain value ({said})") from None
        again = io.BytesIO()
        torch.save(safe, again)  # what DCP's own load_bytes reads: the value checked above
        again.seek(0)
        super().load_bytes(read_item, again)


def load(state: dict, folder: Path, **kwargs) -> None:
    """``dcp.load(state, ...)`` from ``folder`` through the checks above (``kwargs``:
    process_group or no_dist, as dcp.load takes them)."""
    import torch.distributed.checkpoint as dcp

    metadata = read_metadata(folder)  # refused here, by name, not through DCP's fallbacks
    try:
        reader = _Reader(folder, metadata)
        dcp.load(state, storage_reader=reader, planner=_Planner(), **kwargs)
    except CheckpointException as err:
        failures = getattr(err, "failures", {}) or {}
        first = next(iter(failures.values()), err)
        cause = first[0] if isinstance(first, tuple) else first
        if isinstance(cause, ValueError):  # ours
            said = str(cause)
            raise Refused(naming(folder, said)) from None
        raise Refused(f"{folder}: cannot be loaded ({_one_line(cause)})") from None


def _one_line(err: BaseException) -> str:
    """torch's error in one line; a weights-only refusal as what it means, never torch's
    advice (to load the hostile file again with weights_only=False: cut at 300 characters,
    it lost its own warning that this can run the file's code)."""
    if "weights only load failed" in str(err).lower():
        return f"{type(err).__name__}: not data torch.load reads with weights_only=True"
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]
