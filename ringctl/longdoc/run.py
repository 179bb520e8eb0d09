"""The long-document loop: every rank runs ``run_longdoc`` with the same parameters.

One document at a time, each sharded in the given layout (zigzag by default) across the ring
of ``group``; each rank writes its shard of the outputs (``shards.py``). Documents already
complete in ``out_dir`` (every rank's entry there, checksums valid) are skipped, so a rerun
after a failure or preemption only computes what is missing. Rank 0 logs one line per
document with the progress (documents done / total, tokens/s, ETA).

Decisions that must be the same on every rank (skip a document, stop, fail) are taken together:
every rank contributes its view through a small collective, so a rank never waits on a peer
that went another way. Errors that concern the whole job (bad parameters, a missing input with
``on_missing=stop``, an output directory holding a different run) are raised on every rank.
"""

from __future__ import annotations

import dataclasses
import json
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ringattn import LAYOUTS, padded_length

from .documents import ON_MISSING, Document, list_documents
from .model import DTYPES, check_same_weights, load_model, samples_dir
from .scoring import TASKS, comm_device, run_task
from .shards import FORMAT, ShardStore, atomic_write_json
from .tokenize import load_tokenizer


@dataclass
class LongDocParams:
    """Parameters of the long-document task (the ``task:`` section of a job).

    inputs: paths of documents (``.txt``, ``.jsonl``, directories); None = the bundled samples.
    text_field: the JSONL field holding the text.
    model_path: local HF model directory or ``.json`` config; None = bundled tiny Llama.
    tokenizer_path: local tokenizer directory; None = byte-level (UTF-8 bytes, vocab 256).
    task: score | embed | grad.  dtype: float32 | bfloat16 | float16 | float64.
    layout: zigzag | contiguous.  max_docs: only the first N documents (None = all).
    on_missing: report (log, record, go on) | stop (fail before running anything).
    write_grads: (task grad) rank 0 writes each document's summed gradients.
    chunk_size: positions per lm_head / log-softmax chunk.
    """

    inputs: list[str] | None = None
    text_field: str = "text"
    model_path: str | None = None
    tokenizer_path: str | None = None
    task: str = "score"
    dtype: str = "float32"
    layout: str = "zigzag"
    max_docs: int | None = None
    on_missing: str = "report"
    write_grads: bool = False
    chunk_size: int = 4096

    @classmethod
    def from_any(cls, cfg: Any) -> LongDocParams:
        """From this dataclass, a mapping, or any object with these attributes (extra ignored
        for objects; unknown keys in a mapping are an error)."""
        if isinstance(cfg, cls):
            params = dataclasses.replace(cfg)
        else:
            names = {f.name for f in dataclasses.fields(cls)}
            if isinstance(cfg, dict):
                unknown = sorted(set(cfg) - names - {"name"})
                if unknown:
                    raise ValueError(
                        f"unknown longdoc parameter(s): {', '.join(unknown)}; known: "
                        f"{', '.join(sorted(names))}"
                    )
                values = {k: v for k, v in cfg.items() if k in names}
            else:
                values = {n: getattr(cfg, n) for n in names if hasattr(cfg, n)}
            params = cls(**values)
        if isinstance(params.inputs, (str, Path)):
            params.inputs = [str(params.inputs)]
        elif params.inputs is not None:
            params.inputs = [str(p) for p in params.inputs]
        for name in ("model_path", "tokenizer_path"):
            value = getattr(params, name)
            setattr(params, name, None if value in (None, "") else str(value))
        params.validate()
        return params

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"task.{name}: {why}")

        if self.task not in TASKS:
            raise bad("task", f"must be one of {', '.join(TASKS)}, not {self.task!r}")
        if self.layout not in LAYOUTS:
            raise bad("layout", f"must be one of {', '.join(LAYOUTS)}, not {self.layout!r}")
        if self.dtype not in DTYPES:
            raise bad("dtype", f"must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if self.on_missing not in ON_MISSING:
            raise bad("on_missing", f"must be one of {', '.join(ON_MISSING)}")
        if int(self.chunk_size) < 1:
            raise bad("chunk_size", f"must be >= 1, not {self.chunk_size}")
        if self.max_docs is not None and int(self.max_docs) < 0:
            raise bad("max_docs", f"must be >= 0, not {self.max_docs}")
        if self.write_grads and self.task != "grad":
            raise bad("write_grads", "only applies to task=grad")

    def signature(self) -> dict:
        """What a rerun in the same output directory must keep (outputs would not match)."""
        return {
            "task": self.task,
            "layout": self.layout,
            "dtype": self.dtype,
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "text_field": self.text_field,
        }


@dataclass
class LongDocSummary:
    """What ``run_longdoc`` returns (the same on every rank)."""

    total: int = 0  # documents listed
    done: int = 0  # computed in this run
    skipped: int = 0  # already complete
    missing: list[str] = field(default_factory=list)  # inputs that did not exist / vanished
    tokens: int = 0  # tokens computed in this run
    seconds: float = 0.0
    stopped: bool = False  # stopped early on request (preemption)


def _agree(error: str, group) -> None:
    """Raise on every rank if any rank has an error (the first one, naming its rank)."""
    world = dist.get_world_size(group)
    if world == 1:
        if error:
            raise RuntimeError(error)
        return
    every: list[str] = [""] * world
    dist.all_gather_object(every, error, group=group)
    for r, e in enumerate(every):
        if e:
            raise RuntimeError(e if r == dist.get_rank(group) else f"rank {r}: {e}")


def _check_run_file(store: ShardStore, params: LongDocParams, world_size: int) -> str:
    want = {"format": FORMAT, "world_size": world_size, **params.signature()}
    try:
        have = json.loads(store.run_file.read_text())
    except FileNotFoundError:
        return ""
    except (OSError, ValueError) as err:
        return f"{store.run_file}: unreadable ({err})"
    diff = {k: (have.get(k), v) for k, v in want.items() if have.get(k) != v}
    if diff:
        detail = ", ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in diff.items())
        return (
            f"{store.root} holds the results of a different run ({detail}); use a new output "
            "directory, or the same settings to resume"
        )
    return ""


def _eta(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _doc_size(doc: Document) -> int:
    try:
        return doc._length if doc.line is not None else Path(doc.source).stat().st_size
    except OSError:
        return 0


def run_longdoc(
    cfg: Any,
    rank: int,
    world_size: int,
    group: dist.ProcessGroup | None,
    out_dir: str | Path,
    log: Callable[[str], None] = print,
    *,
    progress: Callable[..., None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    device: torch.device | str | None = None,
) -> LongDocSummary:
    """Run the long-document task on this rank; every rank of ``group`` calls it alike.

    cfg: ``LongDocParams``, a dict of its fields, or an object with those attributes.
    group: an initialised process group of ``world_size`` ranks (None: the default group).
    out_dir: the job's output directory (shared by all ranks, or one per node: both work).
    log: one line of text per call (the worker's ``ctx.log``).
    progress: optional ``progress(done, total, unit="documents", **extra)`` (rank 0 only).
    should_stop: optional, polled before each document; when any rank says True, all ranks
    stop after the current document (its outputs written) and return with ``stopped=True``.
    device: where the model runs; default: the current GPU under NCCL, else the CPU.
    """
    started = time.monotonic()
    params = LongDocParams.from_any(cfg)
    if not dist.is_initialized():
        raise RuntimeError("run_longdoc needs an initialised torch.distributed process group")
    if (dist.get_rank(group), dist.get_world_size(group)) != (rank, world_size):
        raise RuntimeError(
            f"rank/world_size ({rank}/{world_size}) disagree with the process group "
            f"({dist.get_rank(group)}/{dist.get_world_size(group)})"
        )
    lead = rank == 0
    cdev = comm_device(group)
    store = ShardStore(out_dir)
    inputs = params.inputs if params.inputs is not None else [str(samples_dir())]

    error = ""
    listing = None
    try:
        listing = list_documents(
            inputs,
            text_field=params.text_field,
            on_missing=params.on_missing,
            max_docs=params.max_docs,
        )
    except ValueError as err:
        error = str(err)
    _agree(error or _check_run_file(store, params, world_size), group)
    assert listing is not None
    docs = listing.documents
    summary = LongDocSummary(total=len(docs), missing=list(listing.missing))
    for path in listing.missing:
        log(f"missing input: {path} (on_missing=report: going on with the others)")
    if lead:
        atomic_write_json(
            store.run_file, {"format": FORMAT, "world_size": world_size, **params.signature()}
        )
        index = {
            "format": FORMAT,
            "inputs": inputs,
            "documents": [d.describe() for d in docs],
            "missing_inputs": list(listing.missing),
        }
        atomic_write_json(store.documents_file, index)

    error = ""
    try:
        tokenizer = load_tokenizer(params.tokenizer_path)
        model = load_model(params.model_path, dtype=params.dtype, device=device or cdev)
        if tokenizer.vocab_size > model.config.vocab_size:
            error = (
                f"the tokenizer's vocabulary ({tokenizer.vocab_size}) is larger than the "
                f"model's ({model.config.vocab_size})"
            )
    except (OSError, ValueError) as err:
        error = f"{type(err).__name__}: {err}"
    _agree(error, group)
    check_same_weights(model, group)

    # Resume: a document is skipped only if every rank has its valid entry for it.
    have = torch.tensor(
        [store.has_valid_entry(d.key, rank, world_size=world_size, task=params.task) for d in docs],
        dtype=torch.int64,
        device=cdev,
    )
    if world_size > 1 and len(docs):
        dist.all_reduce(have, op=dist.ReduceOp.MIN, group=group)
    todo = [d for d, h in zip(docs, have.cpu().tolist(), strict=True) if not h]
    summary.skipped = len(docs) - len(todo)
    if lead:
        log(
            f"longdoc: task={params.task} layout={params.layout} ranks={world_size} "
            f"documents={len(docs)} (complete already: {summary.skipped}, to do: {len(todo)}, "
            f"missing inputs: {len(listing.missing)})"
        )

    bytes_left = sum(_doc_size(d) for d in todo)
    bytes_done = 0
    compute_s = 0.0
    loop_start = time.monotonic()
    for doc in todo:
        stop = bool(should_stop and should_stop())
        raw: bytes | None
        try:
            raw = doc.read_bytes()
        except FileNotFoundError:
            raw = None
        ids = tokenizer.encode(raw) if raw is not None else torch.zeros(0, dtype=torch.int64)
        crc = zlib.crc32(ids.numpy().tobytes()) if raw is not None else -1
        mine = torch.tensor([int(stop), int(ids.numel()), crc], dtype=torch.int64, device=cdev)
        every = [mine]
        if world_size > 1:
            every = [torch.empty_like(mine) for _ in range(world_size)]
            dist.all_gather(every, mine, group=group)
        every = [e.cpu() for e in every]
        if any(int(e[0]) for e in every):
            summary.stopped = True
            if lead:
                log(f"stop requested: {summary.done} documents done in this run, rest left")
            break
        if any(int(e[2]) == -1 for e in every):
            gone = [r for r, e in enumerate(every) if int(e[2]) == -1]
            msg = f"{doc.id}: input {doc.source} vanished (ranks {gone} cannot read it)"
            if params.on_missing == "stop":
                raise RuntimeError(msg)
            log(f"missing input: {msg}; going on with the others")
            summary.missing.append(doc.source)
            continue
        if len({(int(e[1]), int(e[2])) for e in every}) > 1:
            detail = ", ".join(f"rank {r}: {int(e[1])} tokens" for r, e in enumerate(every))
            raise RuntimeError(
                f"{doc.id}: ranks tokenised different token sequences ({detail}, or different "
                "contents): do they read the same file and tokenizer?"
            )
        result = run_task(
            params.task,
            model,
            ids,
            group=group,
            layout=params.layout,
            chunk_size=int(params.chunk_size),
            keep_grads=params.write_grads and lead,
        )
        n = int(ids.numel())
        padded = padded_length(n, world_size=world_size, layout=params.layout) if n else 0
        store.write_shard(
            doc=doc.describe(),
            rank=rank,
            world_size=world_size,
            layout=params.layout,
            task=params.task,
            n_tokens=n,
            padded_tokens=padded,
            tensors=result.tensors,
            stats=result.stats,
            seconds=result.seconds,
            grads=result.grads if lead else None,
        )
        summary.done += 1
        summary.tokens += n
        compute_s += result.seconds
        bytes_done += _doc_size(doc)
        if lead:
            elapsed = time.monotonic() - loop_start
            rate = bytes_done / elapsed if elapsed > 0 else 0.0
            eta = (bytes_left - bytes_done) / rate if rate > 0 else float("nan")
            tok_s = summary.tokens / compute_s if compute_s > 0 else 0.0
            st = result.stats
            extra = ""
            if "log_likelihood" in st:
                ppl = st["perplexity"]
                extra = f", log-lik {st['log_likelihood']:.4g}, ppl " + (
                    f"{ppl:.4g}" if ppl is not None else "-"
                )
            if "loss" in st:
                loss = st["loss"]
                extra += f", loss {loss:.4g}" if loss is not None else ", loss -"
                extra += f", grad norm {st['grad_norm']:.4g}"
            done_all = summary.skipped + summary.done
            log(
                f"doc {done_all}/{len(docs)} {doc.id}: {n} tokens in {result.seconds:.2f}s"
                f"{extra}; {tok_s:.0f} tokens/s, ETA {_eta(eta)}"
            )
            if progress is not None:
                progress(done_all, len(docs), unit="documents", tokens_per_s=round(tok_s))
    summary.seconds = time.monotonic() - started
    if lead:
        log(
            f"longdoc: {summary.done} documents ({summary.tokens} tokens) in "
            f"{summary.seconds:.1f}s; {summary.skipped} were complete already"
            + (f"; missing inputs: {', '.join(summary.missing)}" if summary.missing else "")
        )
    return summary
