"""Verify a long-document job's output shards and reassemble each document in token order.

``gather(job_dir, out)`` reads ``longdoc/`` (see ``ringctl.longdoc.shards``) under ``job_dir``
or ``job_dir/out``, and for every document listed in ``documents.json`` checks that:

* every rank 0..P-1 has a manifest entry and a data file, the file's sha256 matches the entry,
  the tensors in it have the names, dtypes and shapes the entry says;
* all entries agree with ``run.json`` (task, layout, world size) and with each other
  (document id, length), and each rank holds the positions the layout gives it;
* the positions of all ranks together cover ``0 .. N-1`` exactly once (padding excluded).

Then it undoes the layout (each tensor row goes to its global position), and writes, to a
temporary directory renamed to ``out`` only when everything verified:

* ``docs/<doc key>.safetensors``: ``input_ids`` (N,); task score/grad: ``token_logprob``
  (N-1,), ``token_logprob[i] = log p(input_ids[i+1] | input_ids[..i])``; task embed: ``hidden``
  (N, hidden) and ``pooled`` (hidden,); metadata: doc_id, source, task;
* ``grads/<doc key>.safetensors`` (task grad with write_grads), checksum verified;
* ``summary.json`` and ``summary.csv``: one row per document (tokens, log-likelihood,
  perplexity, seconds, ...), plus the inputs that were missing when the job ran.

Anything missing or corrupt is named (file and reason) in a ``GatherError``: exit status 3,
and nothing is written under ``out`` (an existing ``out`` is left as it was). Missing *inputs*
(documents the job could not read, ``on_missing=report``) are not an error here: they are
listed in the summary and as a warning.

Remote job directories (``host:path``) go through ``resolve_job_dir``: the hook where an
SFTP fetch will go; today it refuses them with a clear message.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import UserError

GATHER_FAILED_EXIT = 3


class GatherError(UserError):
    """Shards missing or corrupt: exit status 3 (2 stays for usage errors)."""

    exit_code = GATHER_FAILED_EXIT

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        head = f"{len(problems)} problem(s) in the job's output; nothing was written:"
        super().__init__("\n".join([head, *(f"  - {p}" for p in problems)]))


_REMOTE = re.compile(r"^(?:[\w.-]+@)?[\w.-]+:(?!//)")


def resolve_job_dir(spec: str | Path) -> Path:
    """A local job directory for ``spec``. Hook for remote jobs: ``host:path`` will be fetched
    over SFTP (ringctl.backends.ssh) into a local cache here; not done yet."""
    text = str(spec)
    path = Path(text)
    if not path.exists() and _REMOTE.match(text):
        raise UserError(
            f"{text}: remote job directories are not supported by gather yet; copy it first "
            f"(e.g. rsync -a {text} ./job) and gather the local copy"
        )
    if not path.is_dir():
        raise UserError(f"{text}: no such job directory")
    return path


def find_longdoc_root(job_dir: Path) -> Path:
    for base in (job_dir, job_dir / "out"):
        if (base / "longdoc" / "run.json").is_file():
            return base / "longdoc"
    raise UserError(
        f"{job_dir}: no long-document output here (looked for longdoc/run.json and "
        "out/longdoc/run.json)"
    )


@dataclass
class GatheredDoc:
    doc_id: str
    key: str
    source: str | None
    tensors: dict[str, Any]
    row: dict[str, Any]
    grads_file: Path | None = None


@dataclass
class GatherResult:
    out: Path
    task: str
    rows: list[dict[str, Any]]
    missing_inputs: list[str] = field(default_factory=list)


def _ranges_text(idx: list[int], limit: int = 6) -> str:
    runs: list[list[int]] = []
    for i in idx:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    shown = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:limit]]
    return ", ".join(shown) + (f" and {len(runs) - limit} more runs" if len(runs) > limit else "")


def _verify_doc(root: Path, doc: dict, run: dict, problems: list[str]) -> GatheredDoc | None:
    import torch
    from safetensors.torch import load

    from ringattn import padded_length, sequence_positions

    from .longdoc.shards import dtype_name, expand_ranges, sha256_bytes, sha256_file

    world, task, layout = run["world_size"], run["task"], run["layout"]
    key, doc_id = doc["key"], doc["id"]
    doc_dir = root / "shards" / key
    where = f"document {doc_id!r}"
    if not doc_dir.is_dir():
        problems.append(f"{where}: no shards at all ({doc_dir} is missing)")
        return None
    before = len(problems)
    entries: list[dict] = []
    shards: list[dict[str, torch.Tensor]] = []
    for rank in range(world):
        entry_path = doc_dir / f"rank-{rank:05d}.json"
        data_path = doc_dir / f"rank-{rank:05d}.safetensors"
        if not entry_path.is_file():
            problems.append(f"{where}: rank {rank}'s manifest entry {entry_path} is missing")
            continue
        try:
            entry = json.loads(entry_path.read_text())
        except (OSError, ValueError) as err:
            problems.append(f"{where}: {entry_path} is unreadable or corrupt ({err})")
            continue
        if not data_path.is_file():
            problems.append(f"{where}: rank {rank}'s shard {data_path} is missing")
            continue
        raw = data_path.read_bytes()
        if sha256_bytes(raw) != entry.get("sha256") or len(raw) != entry.get("bytes"):
            problems.append(
                f"{where}: {data_path} does not match its checksum in {entry_path.name} "
                "(corrupt or tampered)"
            )
            continue
        mismatch = [
            f"{k}={entry.get(k)!r} (expected {v!r})"
            for k, v in (
                ("doc_id", doc_id),
                ("rank", rank),
                ("world_size", world),
                ("task", task),
                ("layout", layout),
            )
            if entry.get(k) != v
        ]
        if mismatch:
            problems.append(f"{where}: {entry_path} says {', '.join(mismatch)}")
            continue
        try:
            tensors = load(raw)
        except Exception as err:  # safetensors raises its own error types
            problems.append(f"{where}: {data_path} is not a readable safetensors file ({err})")
            continue
        declared = {k: (v["dtype"], list(v["shape"])) for k, v in entry["tensors"].items()}
        actual = {k: (dtype_name(v.dtype), list(v.shape)) for k, v in tensors.items()}
        if declared != actual:
            problems.append(f"{where}: {data_path} holds {actual}, its entry says {declared}")
            continue
        positions = tensors.get("positions")
        if positions is None or not torch.equal(positions, expand_ranges(entry["positions"])):
            problems.append(f"{where}: {data_path}: positions differ from its manifest entry")
            continue
        if "grads_file" in entry:
            gpath = root / entry["grads_file"]
            if not gpath.is_file():
                problems.append(f"{where}: gradient file {gpath} is missing")
                continue
            if sha256_file(gpath) != entry.get("grads_sha256"):
                problems.append(f"{where}: {gpath} does not match its checksum (corrupt)")
                continue
        entries.append(entry)
        shards.append(tensors)
    if len(problems) > before:
        return None

    lengths = {e["n_tokens"] for e in entries}
    if len(lengths) != 1:
        problems.append(f"{where}: ranks disagree on the document length: {sorted(lengths)}")
        return None
    n = lengths.pop()
    if n:
        padded = padded_length(n, world_size=world, layout=layout)
        for rank, (entry, tensors) in enumerate(zip(entries, shards, strict=True)):
            expected = sequence_positions(padded, world_size=world, rank=rank, layout=layout)
            expected = expected[expected < n]
            if not torch.equal(tensors["positions"], expected):
                problems.append(
                    f"{where}: {doc_dir / entry['file']} covers positions "
                    f"{entry['positions']}, but rank {rank} of the {layout} layout holds "
                    f"{_ranges_text(expected.tolist())}"
                )
    all_pos = torch.cat([t["positions"] for t in shards])
    outside = all_pos[(all_pos < 0) | (all_pos >= n)]
    if outside.numel():
        problems.append(f"{where}: positions outside 0..{n - 1}: {outside[:6].tolist()}")
        return None
    counts = torch.bincount(all_pos, minlength=n) if n else torch.zeros(0, dtype=torch.int64)
    holes = (counts == 0).nonzero()[:, 0].tolist()
    twice = (counts > 1).nonzero()[:, 0].tolist()
    if holes:
        problems.append(f"{where}: positions covered by no rank: {_ranges_text(holes)}")
    if twice:
        problems.append(f"{where}: positions covered more than once: {_ranges_text(twice)}")
    if len(problems) > before:
        return None

    def assemble(name: str) -> torch.Tensor:
        first = shards[0][name]
        full = torch.empty((n, *first.shape[1:]), dtype=first.dtype)
        for t in shards:
            full[t["positions"]] = t[name]
        return full

    out: dict[str, torch.Tensor] = {"input_ids": assemble("input_ids")}
    seconds = max(float(e.get("seconds") or 0.0) for e in entries)
    row: dict[str, Any] = {"document": doc_id, "tokens": n}
    if task in ("score", "grad"):
        lp = assemble("token_logprob")[: max(n - 1, 0)].contiguous()
        if torch.isnan(lp).any():
            problems.append(f"{where}: NaN log-probabilities at scored positions")
            return None
        out["token_logprob"] = lp
        ll = float(lp.double().sum())
        row["log_likelihood"] = ll
        row["perplexity"] = math.exp(-ll / lp.numel()) if lp.numel() else None
    if task == "embed":
        out["hidden"] = assemble("hidden")
        if "pooled" not in shards[0]:
            problems.append(f"{where}: rank 0's shard has no pooled vector")
            return None
        out["pooled"] = shards[0]["pooled"]
    grads_file = None
    if task == "grad":
        stats = entries[0].get("stats", {})
        row["loss"] = stats.get("loss")
        row["grad_norm"] = stats.get("grad_norm")
        if "grads_file" in entries[0]:
            grads_file = root / entries[0]["grads_file"]
    row["seconds"] = round(seconds, 4)
    return GatheredDoc(doc_id, key, doc.get("source"), out, row, grads_file)


def verify(job_dir: str | Path) -> tuple[dict, list[GatheredDoc], list[str]]:
    """(run.json, the verified documents, missing inputs); raises GatherError on problems."""
    root = find_longdoc_root(Path(job_dir))
    problems: list[str] = []
    try:
        run = json.loads((root / "run.json").read_text())
        index = json.loads((root / "documents.json").read_text())
    except FileNotFoundError as err:
        raise GatherError([f"{err.filename} is missing"]) from None
    except ValueError as err:
        raise GatherError([f"{root}: run.json or documents.json is corrupt ({err})"]) from None
    docs: list[GatheredDoc] = []
    for doc in index.get("documents", []):
        got = _verify_doc(root, doc, run, problems)
        if got is not None:
            docs.append(got)
    if problems:
        raise GatherError(problems)
    return run, docs, list(index.get("missing_inputs", []))


def _csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    cols = list(rows[0]) if rows else ["document", "tokens", "seconds"]
    writer = csv.DictWriter(buf, fieldnames=cols, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return buf.getvalue()


def gather(job_dir: str | Path, out: str | Path | None = None, *, force: bool = False):
    """Verify and reassemble; write ``out`` (default JOB_DIR/gathered) only if all is well."""
    from safetensors.torch import save

    job = resolve_job_dir(job_dir)
    target = Path(out) if out is not None else job / "gathered"
    if target.exists() and not force:
        raise UserError(f"{target} exists already; remove it or pass --force to replace it")
    run, docs, missing_inputs = verify(job)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        (tmp / "docs").mkdir()
        rows = []
        for d in docs:
            meta = {"doc_id": d.doc_id, "source": str(d.source), "task": run["task"]}
            (tmp / "docs" / f"{d.key}.safetensors").write_bytes(save(d.tensors, metadata=meta))
            if d.grads_file is not None:
                (tmp / "grads").mkdir(exist_ok=True)
                shutil.copyfile(d.grads_file, tmp / "grads" / f"{d.key}.safetensors")
            rows.append({**d.row, "file": f"docs/{d.key}.safetensors"})
        summary = {
            "task": run["task"],
            "layout": run["layout"],
            "world_size": run["world_size"],
            "documents": rows,
            "missing_inputs": missing_inputs,
        }
        (tmp / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        (tmp / "summary.csv").write_text(_csv(rows))
        if target.exists():  # --force: replace only now that the new result is whole
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return GatherResult(target, run["task"], rows, missing_inputs)


def summary_table(result: GatherResult):
    """A rich Table of the gathered documents."""
    from rich.table import Table

    def num(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    table = Table(title=f"{len(result.rows)} documents ({result.task}) -> {result.out}")
    table.add_column("document")
    table.add_column("tokens", justify="right")
    scored = result.task in ("score", "grad")
    if scored:
        table.add_column("log-likelihood", justify="right")
        table.add_column("perplexity", justify="right")
    if result.task == "grad":
        table.add_column("loss", justify="right")
        table.add_column("grad norm", justify="right")
    table.add_column("time (s)", justify="right")
    for row in result.rows:
        cells = [row["document"], str(row["tokens"])]
        if scored:
            cells += [num(row.get("log_likelihood"), ".2f"), num(row.get("perplexity"), ".3f")]
        if result.task == "grad":
            cells += [num(row.get("loss"), ".4f"), num(row.get("grad_norm"), ".4g")]
        cells.append(num(row.get("seconds"), ".2f"))
        table.add_row(*cells)
    return table
