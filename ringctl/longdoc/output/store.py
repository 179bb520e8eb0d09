"""Output shards of a long-document job: what each rank writes for a document.

The files and their names are listed in ``names.py``; each rank writes, per document,
``shards/<doc key>/rank-NNNNN.safetensors`` (its tensors) and ``rank-NNNNN.json`` (its manifest
entry), and rank 0 the summed gradients under ``grads/``. Whether an entry and its file make a
complete shard is ``completeness.py``'s one definition (gather and resume read them there).

A manifest entry (JSON, ``format: ringctl.longdoc/1``) holds: ``doc_id``, ``doc_key``,
``source``, ``rank``, ``world_size``, ``layout``, ``task``, ``n_tokens`` (the document's real
length), ``padded_tokens``, ``positions`` (the global token positions covered, as
``[start, stop)`` ranges in the rank's local order; padding excluded), ``n_positions``,
``file``, ``bytes``, ``sha256`` (of the whole safetensors file), ``tensors`` (name -> dtype,
shape), ``stats`` (document totals, see scoring.py), ``seconds``, ``input`` (the identity of
the input the rank read: ``{"bytes": N, "sha256": hex}``, ``documents.input_identity``; absent
in outputs of older ringctl versions), and for grads ``grads_file`` / ``grads_sha256``.

Each file is written atomically (a temp file in the same directory, fsync, rename): a killed
job never leaves a half file under a final name. The data file is renamed into place before its
entry, so an entry always describes a whole file. A document is complete when every rank's
entry exists (and its file matches its checksum); a rerun skips complete documents.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import torch

from ...atomic import atomic_write
from ...atomic import atomic_write_json as _atomic_write_json
from ...jsonsafe import finite_json
from .names import FORMAT, SUBDIR, OutputPaths


def atomic_write_json(path: Path, obj: Any) -> None:
    _atomic_write_json(path, obj, indent=1)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def position_ranges(positions: torch.Tensor) -> list[list[int]]:
    """[start, stop) runs of consecutive positions, in order."""
    pos = positions.tolist()
    runs: list[list[int]] = []
    for p in pos:
        if runs and runs[-1][1] == p:
            runs[-1][1] = p + 1
        else:
            runs.append([p, p + 1])
    return runs


def expand_ranges(ranges: list[list[int]]) -> torch.Tensor:
    if not ranges:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in ranges])


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_specs(tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    """An entry's ``tensors``: each name's dtype and shape (what the reader checks the file by)."""
    return {k: {"dtype": dtype_name(v.dtype), "shape": list(v.shape)} for k, v in tensors.items()}


class ShardStore(OutputPaths):
    """The ``longdoc/`` part of one job's output directory, as its ranks write it."""

    def __init__(self, out_dir: str | Path) -> None:
        super().__init__(Path(out_dir) / SUBDIR)

    # writing
    def write_shard(
        self,
        *,
        doc: dict,
        rank: int,
        world_size: int,
        layout: str,
        task: str,
        n_tokens: int,
        padded_tokens: int | None,
        tensors: dict[str, torch.Tensor],
        stats: dict,
        seconds: float,
        grads: dict[str, torch.Tensor] | None = None,
        input_identity: dict | None = None,
        packing: dict | None = None,
        run: str | None = None,
    ) -> dict:
        """Write this rank's tensors for one document, then its manifest entry; returns it.
        ``input_identity``: what the document's input was when this rank read it;
        ``packing``: a packed document's pack (``compute/packing.packing_record``), whose
        layout gave this rank its rows (``padded_tokens`` is then None); ``run``: the run's
        ``manifest.run_fingerprint``, which gather and resume hold the entry to."""
        from safetensors.torch import save

        key = doc["key"]
        tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
        meta = {"format": FORMAT, "doc_id": doc["id"], "rank": str(rank)}
        data = save(tensors, metadata=meta)
        path = self.data_path(key, rank)
        atomic_write(path, data)
        entry = {
            "format": FORMAT,
            "doc_id": doc["id"],
            "doc_key": key,
            "source": doc.get("source"),
            "line": doc.get("line"),
            "rank": rank,
            "world_size": world_size,
            "layout": layout,
            "task": task,
            **({"run": run} if run is not None else {}),
            "n_tokens": n_tokens,
            "padded_tokens": padded_tokens,
            **({"packing": packing} if packing is not None else {}),
            "positions": position_ranges(tensors["positions"]),
            "n_positions": int(tensors["positions"].numel()),
            "file": path.name,
            "bytes": len(data),
            "sha256": sha256_bytes(data),
            "tensors": tensor_specs(tensors),
            "stats": stats,
            "seconds": seconds,
            "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        if input_identity is not None:
            entry["input"] = dict(input_identity)
        if grads is not None:
            entry.update(self.write_grads(key, grads, meta))
        atomic_write_json(self.entry_path(key, rank), finite_json(entry)[0])  # strict JSON
        return entry

    def write_grads(self, key: str, grads: dict[str, torch.Tensor], meta: dict) -> dict:
        """Rank 0's summed gradients of a document; the entry's fields that name them."""
        from safetensors.torch import save

        data = save({k: v.contiguous() for k, v in grads.items()}, metadata=meta)
        path = self.grads_path(key)
        atomic_write(path, data)
        return {"grads_file": str(path.relative_to(self.root)), "grads_sha256": sha256_bytes(data)}
