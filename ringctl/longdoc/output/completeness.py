"""When a document's output is complete: one definition, for ``ringctl gather`` and for resume.

A rank's shard of a document is complete when, under ``longdoc/shards/<key>/``:

* its entry ``rank-NNNNN.json`` and data file ``rank-NNNNN.safetensors`` exist (these fixed
  names, never the name an entry gives), both inside the ``longdoc/`` directory once symlinks
  are resolved;
* the entry names this document (id and key), this rank, this file and the run's world
  size, task and layout; the file's size and sha256 match the entry;
* the tensors in the file have the names, dtypes and shapes the entry declares, and their
  ``positions`` are those the entry lists and those the layout gives this rank;
* a gradient file it names is ``grads/<key>.safetensors`` and matches its checksum.

A document is complete when every rank 0..P-1 is, all agree on its length, and their positions
cover ``0 .. N-1`` exactly once. P is the size of the ring that produced the document (a job
runs rings of several sizes, and a resumed job may use others): rank 0's entry says it, and
every other entry must say the same. ``document_status`` answers that (gather); ``rank_complete``
answers it for one rank (resume, where each rank may only see its own node's output directory).
Given the document's input as it is now (``current_input``), a complete document must also have
been computed from it: every entry that records an input identity (size and sha256, see
``documents.input_identity``) records this one, else its input was edited since
(``INPUT_CHANGED``): resume redoes it, gather refuses it. An input that cannot be read now is
not checked, nor are entries of older versions that record none.
The checks are against accidental damage and truncation: whoever can edit the job directory can
also rewrite an entry's checksum (see the README).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...output_dir import confined
from ...text import cut
from .manifest import (
    MAX_WORLD_SIZE,
    doc_problems,
    is_int,
    read_json_object,
    run_fingerprint,
    run_problems,
)
from .names import ENTRY_NAME, OutputPaths
from .store import dtype_name, expand_ranges, sha256_bytes, sha256_file


@dataclass
class RankShard:
    """One rank's verified part of a document: its entry and its tensors."""

    rank: int
    entry: dict
    tensors: dict[str, torch.Tensor]
    data_path: Path


def shard_paths(root: Path, key: str, rank: int) -> tuple[Path, Path]:
    """(entry, data file) of rank's shard: the fixed names, whatever an entry says."""
    paths = OutputPaths(root)
    return paths.entry_path(key, rank), paths.data_path(key, rank)


def ranges_text(idx: list[int], limit: int = 6) -> str:
    """Positions as runs ("0-5, 9"), the first `limit` of them."""
    runs: list[list[int]] = []
    for i in idx:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    shown = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:limit]]
    return ", ".join(shown) + (f" and {len(runs) - limit} more runs" if len(runs) > limit else "")


# --- one rank ------------------------------------------------------------------------------------


def _read_entry(entry_path: Path, rank: int) -> tuple[dict | None, str]:
    """A rank's entry, read as every output JSON file is (a regular file, bounded; nesting
    too deep is a reason, not a RecursionError traceback at status and gather)."""
    if not os.path.lexists(entry_path):
        return None, f"rank {rank}'s manifest entry {entry_path} is missing"
    return read_json_object(entry_path)


def _read_data(
    data_path: Path, entry_path: Path, entry: dict, rank: int, verify: bool = True
) -> tuple[bytes, str]:
    """The data file's bytes, checked against the entry's size and sha256 (without
    ``verify``: its size only, and no bytes)."""
    if not data_path.is_file():
        return b"", f"rank {rank}'s shard {data_path} is missing"
    if not verify:
        size = data_path.stat().st_size
        return b"", "" if size == entry.get("bytes") else (
            f"{data_path} has {size} bytes, {entry_path.name} says {entry.get('bytes')!r}"
        )
    raw = data_path.read_bytes()
    if sha256_bytes(raw) != entry.get("sha256") or len(raw) != entry.get("bytes"):
        return b"", (
            f"{data_path} does not match its checksum in {entry_path.name} (corrupt or tampered)"
        )
    return raw, ""


def _identity_mismatch(entry: dict, doc: dict, run: dict, rank: int) -> list[str]:
    """The entry's fields that name another document, rank, ring or run than this one's. An
    entry written before entries recorded their run (``run_fingerprint``) is not held to it."""
    wanted = (
        ("doc_id", doc["id"]),
        ("doc_key", doc["key"]),
        ("rank", rank),
        ("world_size", run["world_size"]),
        ("task", run["task"]),
        ("layout", run["layout"]),
        *((("run", run_fingerprint(run)),) if "run" in entry else ()),
    )
    found = [f"{k}={entry.get(k)!r} (expected {v!r})" for k, v in wanted if entry.get(k) != v]
    if found and found[-1].startswith("run="):  # what the hashes stand for, said
        found[-1] += " (the outputs of another run: its model, dtype or settings differ)"
    return found


def _declared_tensors(entry: dict) -> dict[str, tuple[str, list]] | None:
    declared = entry.get("tensors")
    if not isinstance(declared, dict):
        return None
    try:
        return {k: (v["dtype"], list(v["shape"])) for k, v in declared.items()}
    except (TypeError, KeyError):
        return None


def _load_tensors(raw: bytes, entry: dict, data_path: Path) -> tuple[dict | None, str]:
    from safetensors.torch import load

    try:
        tensors = load(raw)
    except Exception as err:  # safetensors raises its own error types
        return None, f"{data_path} is not a readable safetensors file ({err})"
    declared = _declared_tensors(entry)
    actual = {k: (dtype_name(v.dtype), list(v.shape)) for k, v in tensors.items()}
    if declared != actual:
        return None, f"{data_path} holds {actual}, its entry says {declared}"
    positions = tensors.get("positions")
    if positions is None or positions.dtype != torch.int64 or positions.dim() != 1:
        return None, f"{data_path} has no int64 positions vector"
    problem = _per_token_problem(tensors, entry.get("task"), positions.numel())
    return (None, f"{data_path}: {problem}") if problem else (tensors, "")


# The tensors a shard holds one row of per position, and the dtype each must have (None: a
# float of the job's dtype), by task. Without this check a shard whose entry agreed with a
# one-row token_logprob was broadcast over every position, exit 0 (gather's _assemble).
PER_TOKEN: dict[str, dict[str, torch.dtype | None]] = {
    "score": {"input_ids": torch.int64, "token_logprob": torch.float32},
    "grad": {"input_ids": torch.int64, "token_logprob": torch.float32},
    "embed": {"input_ids": torch.int64, "hidden": None},
}


def _per_token_problem(tensors: dict, task: Any, rows: int) -> str:
    """Why a shard's per-token tensors are not one row per position of the task's dtype."""
    for name, dtype in PER_TOKEN.get(task, {}).items():
        t = tensors.get(name)
        if t is None:
            return f"holds no {name} (a {task} shard's)"
        if t.dim() == 0 or t.shape[0] != rows:
            return f"{name} has shape {list(t.shape)}, not one row per position ({rows})"
        if dtype is not None and t.dtype != dtype or dtype is None and not t.is_floating_point():
            return (
                f"{name} is {dtype_name(t.dtype)}, not {dtype_name(dtype) if dtype else 'a float'}"
            )
    return ""


def _ranges_valid(ranges: Any, rows: int) -> bool:
    """[start, stop) pairs of ints, non-empty, covering `rows` positions in all (no expansion
    before this: a hostile entry must not make us allocate what it likes)."""
    if not isinstance(ranges, list):
        return False
    total = 0
    for pair in ranges:
        if not (isinstance(pair, list) and len(pair) == 2 and all(is_int(v) for v in pair)):
            return False
        if not 0 <= pair[0] < pair[1]:
            return False
        total += pair[1] - pair[0]
    return total == rows


MAX_BATCH_PADDING = 1 << 24  # tokens: a batch row is short (rows x L / P within a budget)


def _padding_of(entry: dict, n: int, world: int, layout: str) -> int:
    """The padded length the rank's shard was cut from: the entry's when it is a whole number
    of layout units beyond the document's own padding (a batch of short documents pads each
    row to its longest; bounded, so a hostile entry cannot make us allocate what it likes),
    else the document's own."""
    from ringattn.geometry import layout_multiple, padded_length

    own = padded_length(n, world_size=world, layout=layout)
    unit = layout_multiple(layout, world)
    recorded = entry.get("padded_tokens")
    if is_int(recorded) and own < recorded <= MAX_BATCH_PADDING and recorded % unit == 0:
        return recorded
    return own


MAX_PACK_DOCUMENTS = 4096  # a pack's cu_seqlens read from an entry: at most this many + 1


def _packed_positions(packing, n: int, world: int, layout: str, rank: int):
    """(the positions of its document that rank holds in the pack's layout, problem): a
    packed document's entry records its pack (``compute/packing.packing_record``), checked as
    hostile input before any layout is built from it."""
    from ringattn import geometry

    if not isinstance(packing, dict) or set(packing) != {"cu_seqlens", "index", "balance_window"}:
        return None, "its packing record is malformed"
    cu, index, window = packing["cu_seqlens"], packing["index"], packing["balance_window"]
    if not isinstance(cu, list) or not 2 <= len(cu) <= MAX_PACK_DOCUMENTS + 1:
        return None, "its pack's cu_seqlens is not a list of 2 to 4097 offsets"
    if not all(is_int(c) for c in cu) or not 0 < cu[-1] <= MAX_BATCH_PADDING:
        return None, "its pack's cu_seqlens holds a value that is not a whole token count"
    if not is_int(index) or not 0 <= index < len(cu) - 1 or not (window is None or is_int(window)):
        return None, "its packing record's index or window is impossible"
    try:
        lay = geometry.packed_layout(tuple(cu), world, layout, 1, window or None)
    except ValueError as err:
        return None, f"its pack is impossible ({err})"
    if cu[index + 1] - cu[index] != n:
        return None, f"its pack gives it {cu[index + 1] - cu[index]} tokens, not n_tokens={n}"
    start, end = cu[index], cu[index + 1]
    held = [p - start for p in lay.positions(rank) if start <= p < end]
    return torch.tensor(held, dtype=torch.int64), ""


def _layout_problem(entry: dict, tensors: dict, run: dict, rank: int, data_path: Path) -> str:
    """The positions in the file: those the entry lists, and those the layout gives rank (a
    packed document: its pack's layout)."""
    from ringattn import sequence_positions

    positions, world = tensors["positions"], run["world_size"]
    n = entry.get("n_tokens")
    if "packing" in entry:
        return _packed_problem(entry, positions, world, run["layout"], rank, data_path)
    # A rank holds about N/P positions of a document cut alone; a larger N is impossible (and
    # would be allocated below). A batch row's rank may hold few or none: bounded by padding.
    padded = _padding_of(entry, n, world, run["layout"]) if is_int(n) and n > 0 else 0
    batched = is_int(n) and padded > n + 2 * world
    bound = MAX_BATCH_PADDING if batched else world * (positions.numel() + 2 * world)
    if not is_int(n) or not 0 <= n <= bound:
        return f"{data_path}: n_tokens={n!r} is impossible for {positions.numel()} positions"
    if not _ranges_valid(entry.get("positions"), positions.numel()) or not torch.equal(
        positions, expand_ranges(entry["positions"])
    ):
        return f"{data_path}: positions differ from its manifest entry"
    expected = torch.zeros(0, dtype=torch.int64)
    if n:
        expected = sequence_positions(padded, world_size=world, rank=rank, layout=run["layout"])
        expected = expected[expected < n]
    if not torch.equal(positions, expected):
        return (
            f"{data_path} covers positions {entry['positions']}, but rank {rank} of the "
            f"{run['layout']} layout holds {ranges_text(expected.tolist())}"
        )
    return ""


def _packed_problem(entry, positions, world: int, layout: str, rank: int, data_path) -> str:
    n = entry.get("n_tokens")
    if not is_int(n) or not 0 < n <= MAX_BATCH_PADDING:
        return f"{data_path}: n_tokens={n!r} is impossible for a packed document"
    if not _ranges_valid(entry.get("positions"), positions.numel()) or not torch.equal(
        positions, expand_ranges(entry["positions"])
    ):
        return f"{data_path}: positions differ from its manifest entry"
    expected, problem = _packed_positions(entry["packing"], n, world, layout, rank)
    if problem:
        return f"{data_path}: {problem}"
    if not torch.equal(positions, expected):
        return (
            f"{data_path} covers positions {entry['positions']}, but rank {rank} of its pack's "
            f"{layout} layout holds {ranges_text(expected.tolist())}"
        )
    return ""


def _listed_positions(entry: dict, data_path: Path) -> tuple[dict | None, str]:
    """Without reading the data: the positions the entry lists, standing for the file's (at
    most one int64 each per 8 bytes of the file, so a hostile entry allocates no more)."""
    rows, size = entry.get("n_positions"), data_path.stat().st_size
    if not is_int(rows) or not 0 <= rows <= size // 8:
        return None, f"{data_path}: n_positions={rows!r} is impossible for its {size} bytes"
    if not _ranges_valid(entry.get("positions"), rows):
        return None, f"{data_path}: positions differ from its manifest entry"
    return {"positions": expand_ranges(entry["positions"])}, ""


def _grads_problem(root: Path, key: str, entry: dict, verify: bool = True) -> str:
    if "grads_file" not in entry:
        return ""
    gpath = OutputPaths(root).grads_path(key)
    want = gpath.relative_to(root).as_posix()
    if entry["grads_file"] != want:
        return f"grads_file={entry['grads_file']!r} in its entry (expected {want!r}); refused"
    if not confined(gpath, root):
        return f"gradient file {gpath} leads outside {root} (a symlink); refused"
    if not gpath.is_file():
        return f"gradient file {gpath} is missing"
    if verify and sha256_file(gpath) != entry.get("grads_sha256"):
        return f"{gpath} does not match its checksum (corrupt)"
    return ""


def check_rank(
    root: Path, doc: dict, run: dict, rank: int, verify: bool = True
) -> tuple[RankShard | None, str]:
    """(rank's verified shard, "") or (None, why it is not complete). doc and run are checked
    entries (``manifest.doc_problems`` / ``run_problems`` found nothing). Without ``verify``
    every check but those that read the data (its checksum and tensors: the shard then holds
    the listed positions only): ``ringctl status``'s count of a finished job."""
    entry_path, data_path = shard_paths(root, doc["key"], rank)
    for path in (entry_path, data_path):
        if not confined(path, root):
            return None, f"{path} leads outside {root} (a symlink); refused"
    entry, problem = _read_entry(entry_path, rank)
    if entry is None:
        return None, problem
    raw, problem = _read_data(data_path, entry_path, entry, rank, verify)
    if problem:
        return None, problem
    mismatch = _identity_mismatch(entry, doc, run, rank)
    if mismatch:
        return None, f"{entry_path} says {', '.join(mismatch)}"
    if verify:
        tensors, problem = _load_tensors(raw, entry, data_path)
    else:
        tensors, problem = _listed_positions(entry, data_path)
    if tensors is None:
        return None, problem
    problem = _layout_problem(entry, tensors, run, rank, data_path)
    if not problem and entry.get("file") != data_path.name:
        problem = f"{entry_path} says file={entry.get('file')!r} (expected {data_path.name!r})"
    problem = problem or _grads_problem(root, doc["key"], entry, verify)
    if problem:
        return None, problem
    return RankShard(rank, entry, tensors, data_path), ""


# --- one document --------------------------------------------------------------------------------


def _coverage_problems(shards: list[RankShard], n: int) -> list[str]:
    """Every position 0..n-1 held by exactly one rank (the layout check implies it; this is the
    independent count)."""
    all_pos = torch.cat([s.tensors["positions"] for s in shards])
    outside = all_pos[(all_pos < 0) | (all_pos >= n)]
    if outside.numel():
        return [f"positions outside 0..{n - 1}: {outside[:6].tolist()}"]
    counts = torch.bincount(all_pos, minlength=n) if n else torch.zeros(0, dtype=torch.int64)
    holes = (counts == 0).nonzero()[:, 0].tolist()
    twice = (counts > 1).nonzero()[:, 0].tolist()
    problems = []
    if holes:
        problems.append(f"positions covered by no rank: {ranges_text(holes)}")
    if twice:
        problems.append(f"positions covered more than once: {ranges_text(twice)}")
    return problems


def ring_size_of(root: Path, doc: dict, run: dict) -> int:
    """The size of the ring that wrote the document: the lowest rank's entry there (of the
    run's ranks) whose world_size is a rank count, else the run's (the entries are then
    checked against it and found wanting). Rank 0's alone: with it missing, a document of a
    ring of 2 in a job of 4 was said to miss ranks 2 and 3 too, rank 1's world_size 2
    "expected 4". The document's folder is listed once: looking for every rank's entry of a
    document not written yet cost world_size lookups each (13 s for 200 documents of a job
    of 1024 ranks, resume and status)."""
    doc_dir = OutputPaths(root).doc_dir(doc["key"])
    if not confined(doc_dir, root):
        return run["world_size"]
    try:
        names = {entry.name for entry in os.scandir(doc_dir)}
    except OSError:  # not written yet (or not a folder: the checks say so)
        return run["world_size"]
    present = (int(n[5:10]) for n in names if ENTRY_NAME.fullmatch(n))
    for rank in sorted(r for r in present if r < run["world_size"]):
        entry_path, _ = shard_paths(root, doc["key"], rank)
        if not confined(entry_path, root):
            continue
        size = (_read_entry(entry_path, rank)[0] or {}).get("world_size")
        if is_int(size) and 1 <= size <= MAX_WORLD_SIZE:
            return size
    return run["world_size"]


# A document's rank problems listed before the rest are left unchecked: an entry's world_size
# edited to 65536 listed 65,536 lines for one document.
MAX_LISTED_PROBLEMS = 4
INPUT_CHANGED = "its input changed since its outputs were written"
CurrentInput = Callable[[], "dict | None"]  # the input's identity now; None: unreadable now


def _identity_text(identity: Any) -> str:
    if not isinstance(identity, dict):
        return cut(repr(identity))
    size, digest = identity.get("bytes"), str(identity.get("sha256"))[:12]
    return f"{size:,} bytes, sha256 {digest}..." if is_int(size) else f"sha256 {digest}..."


def input_problem(shards: list[RankShard], now: dict) -> str:
    """Why the shards were not computed from the input as it is ``now`` ("" when they were,
    or when no entry records its input: outputs of an older version cannot tell)."""
    for shard in shards:
        then = shard.entry.get("input")
        if then is not None and then != now:
            return (
                f"{INPUT_CHANGED} ({_identity_text(then)} then, {_identity_text(now)} now; "
                f"rank {shard.rank}'s entry)"
            )
    return ""


def document_shards(
    root: Path,
    doc: dict,
    run: dict,
    current_input: CurrentInput | None = None,
    *,
    verify: bool = True,
) -> tuple[list[RankShard], int, list[str]]:
    """(every rank's verified shard, the document's length, problems): problems is empty
    exactly when the document is complete. ``current_input`` is asked, only once every shard
    verified, for the input's identity now (see the module docstring); ``verify``: see
    ``check_rank``."""
    checked = doc_problems(doc) or run_problems(run)
    if checked:
        return [], 0, checked
    run = {**run, "world_size": ring_size_of(root, doc, run)}
    where = f"document {doc['id']!r}"
    doc_dir = OutputPaths(root).doc_dir(doc["key"])
    if not confined(doc_dir, root):
        return [], 0, [f"{where}: {doc_dir} leads outside {root} (a symlink); refused"]
    if not doc_dir.is_dir():
        return [], 0, [f"{where}: no shards at all ({doc_dir} is missing)"]
    shards, problems = [], []
    world = run["world_size"]
    for rank in range(world):
        shard, problem = check_rank(root, doc, run, rank, verify)
        if shard is None:
            problems.append(f"{where}: {problem}")
        else:
            shards.append(shard)
        if len(problems) == MAX_LISTED_PROBLEMS and rank + 1 < world:
            problems.append(f"{where}: ranks {rank + 1}-{world - 1} of {world} not checked")
            break
    if problems:
        return [], 0, problems
    lengths = sorted({s.entry["n_tokens"] for s in shards})
    if len(lengths) != 1:
        return [], 0, [f"{where}: ranks disagree on the document length: {lengths}"]
    problems = [f"{where}: {p}" for p in _coverage_problems(shards, lengths[0])]
    now = current_input() if current_input is not None and not problems else None
    changed = input_problem(shards, now) if now is not None else ""
    problems += [f"{where}: {changed}"] if changed else []
    return ([], 0, problems) if problems else (shards, lengths[0], [])


def document_status(
    root: str | Path, doc: dict, run: dict, current_input: CurrentInput | None = None
) -> tuple[bool, list[str]]:
    """(complete, the problems that make it incomplete), for every rank of the document."""
    _, _, problems = document_shards(Path(root), doc, run, current_input)
    return not problems, problems


def rank_complete(root: str | Path, doc: dict, run: dict, rank: int) -> bool:
    """Whether rank's own shard of doc is complete (resume: each rank checks what it wrote,
    then the ranks agree; the same checks as gather's, for that rank)."""
    if doc_problems(doc) or run_problems(run):
        return False
    root = Path(root)
    if not confined(OutputPaths(root).doc_dir(doc["key"]), root):
        return False
    shard, _ = check_rank(root, doc, {**run, "world_size": ring_size_of(root, doc, run)}, rank)
    return shard is not None


def output_status(root: Path) -> tuple[int, int, list[str]]:
    """(complete documents, listed documents, problems) of a ``longdoc/`` output by this
    module's definition, short of reading the data (``verify=False``): what ``ringctl
    status`` counts once a job has ended, so that it never calls complete what gather refuses
    for a missing, misplaced or resized file (a flipped bit inside one is gather's to find)."""
    from .expected import expected_problems
    from .manifest import read_documents, read_run

    run, problems = read_run(root)
    index, more = read_documents(root)
    if run is None or index is None:
        return 0, 0, problems + more
    _, problems = expected_problems(root, index["documents"])
    complete = 0
    for doc in index["documents"]:
        _, _, found = document_shards(root, doc, run, verify=False)
        complete += not found
        problems += found[:1]
    return complete, len(index["documents"]), problems
