"""The long-document loop: every rank runs ``run_longdoc`` with the same parameters.

The job's ranks form one ring or several (``ring.size``; ``scheduling.py`` puts each document
on a ring, the same plan on every rank); a ring runs its documents one after another, each
sharded in the given layout (zigzag by default) across the ring's ranks, except that under a
per-rank token budget consecutive short documents go through one forward together
(``batching.py``). Each rank writes its shard of the outputs (``shards.py``). Documents already
complete in ``out_dir`` (every rank's entry there, checksums valid) are skipped, so a rerun
after a failure or preemption only computes what is missing. Rank 0 logs one line per
document with the progress (documents done / total, tokens/s, ETA).

Before any document, every rank loads the model, checks that the ranks hold the same weights,
refuses what ``compat.py`` knows cannot be exact, and runs the probe (``probe.py``): the model
on the ring must reproduce the model's own forward pass, or nothing is scored.

Decisions that must be the same on every rank (skip a document, stop, fail) are taken together:
every rank contributes its view through a small collective, so a rank never waits on a peer
that went another way. Errors that concern the whole job (bad parameters, a missing input with
``on_missing=stop``, an output directory holding a different run) are raised on every rank.
"""

from __future__ import annotations

import json
import time
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ringattn import padded_length

from ..errors import UserError
from ..rings import RingGroups
from .compat import config_refusal, model_refusal, read_model_config, window_refusal
from .completeness import document_status
from .consensus import agree, any_has, document_verdict
from .documents import Document, DocumentError, Listing
from .expected import check_expected, write_expected
from .model import check_same_weights, load_model, samples_dir
from .params import LongDocParams
from .probe import run_probe
from .scheduling import RingOptions, document_bytes, plan_schedule, write_schedule
from .scoring import ShardResult, comm_device, run_task
from .shards import FORMAT, ShardStore, atomic_write_json
from .tokenize import load_tokenizer, resolve_tokenizer_path, vocabulary_mismatch

__all__ = ["LongDocParams", "LongDocSummary", "run_longdoc"]


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
    probe: str = ""  # what the probe measured (rank 0's line)


@dataclass
class _Ring:
    """This rank's place in a ring (or in the whole job): what every step needs."""

    rank: int
    world_size: int
    group: Any
    device: torch.device  # where collective tensors live
    log: Callable[[str], None]
    members: list[int] = field(default_factory=list)  # the job ranks of this ring, in order
    label: str = "job"  # "ring 2x1": rings of 2 ranks, the second one

    @property
    def lead(self) -> bool:
        return self.rank == 0


def _check_run_file(store: ShardStore, params: LongDocParams, world_size: int) -> str:
    """The output directory holds this run's results, or none. The job's size may differ (a
    resume on more or fewer ranks, or other ring sizes): each document's entries record the
    ring that wrote it."""
    want = {"format": FORMAT, **params.signature()}
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


def _list_inputs(params: LongDocParams, store: ShardStore, ring: _Ring) -> Listing:
    """Step 1, listing: the documents, agreed on every rank; rank 0 records run and list."""
    inputs = params.inputs if params.inputs is not None else [str(samples_dir())]
    error, listing = "", None
    try:
        listing = params.list_inputs(inputs)
    except ValueError as err:
        error = str(err)
    if not error:
        assert listing is not None
        error = _check_run_file(store, params, ring.world_size)
        error = error or check_expected(store.root, listing.documents)
    agree(error, ring.group)
    assert listing is not None
    for path in listing.missing:
        ring.log(f"missing input: {path} (on_missing=report: going on with the others)")
    for problem in listing.skipped:
        ring.log(f"bad record skipped: {problem} (on_bad_record=skip)")
    if ring.lead:
        run = {"format": FORMAT, "world_size": ring.world_size, **params.signature()}
        atomic_write_json(store.run_file, run)
        write_expected(store.root, listing.documents)
        index = {
            "format": FORMAT,
            "inputs": inputs,
            "documents": [d.describe() for d in listing.documents],
            "missing_inputs": list(listing.missing),
        }
        if listing.skipped:
            index["skipped_records"] = list(listing.skipped)
        atomic_write_json(store.documents_file, index)
    return listing


def _load_agreed_model(
    params: LongDocParams, ring: _Ring, device, shard: str = "none", job_group=None
) -> tuple[Any, Any, str]:
    """Step 2, model agreement: (tokenizer, model, probe line), refused on every rank alike.

    Every rank loads the model (``shard``: whole, or its FSDP2 shard over the ring's ranks or
    the job's); the ranks must hold the same weights, the model must not be one that
    ``compat`` refuses, and the probe must reproduce the model's own forward pass.
    """
    error, model, tokenizer = "", None, None
    try:
        config = {**read_model_config(params.model_path), **(params.model_overrides or {})}
        refused = config_refusal(config)  # before building: some refused families cannot be
        if refused:  # built with ringattn at all (a KeyError or AttributeError otherwise)
            raise ValueError(refused)
        tokenizer = load_tokenizer(params.tokenizer_path)
        model = _load(params, shard, device or ring.device, ring.group, job_group)
        vocab = int(model.config.get_text_config().vocab_size)
        is_bytes = params.tokenizer_path is None
        error = vocabulary_mismatch(tokenizer.vocab_size, vocab, is_bytes=is_bytes)
        error = error or model_refusal(model) or ""
    except ValueError as err:
        error = str(err)
    except (OSError, KeyError, AttributeError, TypeError) as err:
        error = f"the model could not be loaded for ring attention: {type(err).__name__}: {err}"
    agree(error, ring.group)
    check_same_weights(model, ring.group, fingerprint=_fingerprint_of(model))
    probe = run_probe(
        model,
        group=ring.group,
        layout=params.layout,
        dtype_name=params.dtype,
        chunk_size=int(params.chunk_size),
    )
    if ring.lead and probe.message:
        ring.log(probe.message)
    if ring.lead and shard != "none":
        from .sharding import shard_summary

        ring.log(shard_summary(model))
    agree(probe.error if ring.lead else "", ring.group)
    return tokenizer, model, probe.message


def _fingerprint_of(model):
    """How to fingerprint the model's weights: from its shards when FSDP holds them."""
    from .model import weights_fingerprint
    from .sharding import is_sharded
    from .sharding import weights_fingerprint as sharded

    if model is None or not is_sharded(model):
        return weights_fingerprint
    return lambda m: sharded(m).to(next(m.parameters()).device)


def _load(params: LongDocParams, shard: str, device, ring_group, job_group):
    if shard == "none":
        return load_model(params.model_path, dtype=params.dtype, device=device,
                          overrides=params.model_overrides)  # fmt: skip
    from .sharding import load_sharded_model

    return load_sharded_model(
        params.model_path, mode=shard, mesh_or_group=ring_group if shard == "ring" else job_group,
        dtype=params.dtype, device=device, overrides=params.model_overrides,
    )  # fmt: skip


def _to_do(docs: list[Document], store: ShardStore, params: LongDocParams, job: _Ring):
    """Step 3, resume: the documents not complete yet, by gather's own definition (whatever
    ring size wrote them). Document i is checked by job rank i mod W, then the ranks agree."""
    run = {"format": FORMAT, "world_size": job.world_size, **params.signature()}
    mine = [
        i % job.world_size == job.rank and document_status(store.root, d.describe(), run)[0]
        for i, d in enumerate(docs)
    ]
    have = any_has(mine, job.group, job.device)
    return [d for d, h in zip(docs, have, strict=True) if not h]


def _read_ids(doc: Document, tokenizer) -> tuple[torch.Tensor | None, int]:
    """(token ids or None when the input vanished, their checksum)."""
    try:
        raw = doc.read_bytes()
    except (FileNotFoundError, DocumentError):  # gone, or changed since it was listed
        return None, -1
    ids = tokenizer.encode(raw)
    return ids, zlib.crc32(ids.numpy().tobytes())


def _score_document(doc, ids, model, params: LongDocParams, store, ring: _Ring) -> ShardResult:
    """Step 4b: one agreed document through the model on the ring, its shard written."""
    n = int(ids.numel())
    too_long = window_refusal(model.config, n)
    if too_long:  # n is the same on every rank (agreed): every rank raises alike
        raise RuntimeError(f"{doc.id}: {too_long}; nothing more was scored")
    from .sharding import is_sharded, run_task_sharded

    if is_sharded(model):  # every rank asks for the whole gradients: gathering is collective
        result = run_task_sharded(params.mode, model, ids, group=ring.group,
                                  layout=params.layout, chunk_size=int(params.chunk_size),
                                  gather_grads=params.write_grads)  # fmt: skip
    else:
        result = run_task(params.mode, model, ids, group=ring.group, layout=params.layout,
                          chunk_size=int(params.chunk_size),
                          keep_grads=params.write_grads and ring.lead)  # fmt: skip
    padded = padded_length(n, world_size=ring.world_size, layout=params.layout) if n else 0
    _write(doc, n, padded, result, params, store, ring)
    return result


def _write(doc, n: int, padded: int, result: ShardResult, params, store, ring: _Ring) -> None:
    store.write_shard(
        doc=doc.describe(),
        rank=ring.rank,
        world_size=ring.world_size,
        layout=params.layout,
        task=params.mode,
        n_tokens=n,
        padded_tokens=padded,
        tensors=result.tensors,
        stats=result.stats,
        seconds=result.seconds,
        grads=result.grads if ring.lead else None,
    )


def _score_batch(pending, model, params: LongDocParams, store, ring: _Ring) -> list:
    """Step 4b for several short documents at once (batching.py): one forward, each
    document's shards written as if alone (their entries record the batch's padding)."""
    from .batching import run_batch

    ids = [i for _, i in pending]
    results = run_batch(params.mode, model, ids, group=ring.group, layout=params.layout,
                        chunk_size=int(params.chunk_size))  # fmt: skip
    width = padded_length(max(int(i.numel()) for i in ids), world_size=ring.world_size,
                          layout=params.layout)  # fmt: skip
    for (doc, i), result in zip(pending, results, strict=True):
        _write(doc, int(i.numel()), width, result, params, store, ring)
    return results


def _stats_text(st: dict) -> str:
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
    return extra


class _Progress:
    """A ring lead's one line per document: tokens/s of this run and the ETA of what is left
    on its ring; `progress(done, total, ...)` gets the counts (the job's rank 0: the job's
    progress file; every ring lead: its ring's)."""

    def __init__(self, todo: list[Document], total: int, skipped: int, progress) -> None:
        self.bytes_left = sum(document_bytes(d) for d in todo)
        self.bytes_done = 0
        self.compute_s = 0.0
        self.tokens = 0
        self.total, self.done_before = total, skipped
        self.progress = progress
        self.start = time.monotonic()

    def document(self, doc: Document, n: int, result: ShardResult, done: int, log) -> None:
        self.compute_s += result.seconds
        self.tokens += n
        self.bytes_done += document_bytes(doc)
        elapsed = time.monotonic() - self.start
        rate = self.bytes_done / elapsed if elapsed > 0 else 0.0
        eta = (self.bytes_left - self.bytes_done) / rate if rate > 0 else float("nan")
        tok_s = self.tokens / self.compute_s if self.compute_s > 0 else 0.0
        done_all = self.done_before + done
        log(
            f"doc {done_all}/{self.total} {doc.id}: {n} tokens in {result.seconds:.2f}s"
            f"{_stats_text(result.stats)}; {tok_s:.0f} tokens/s, ETA {_eta(eta)}"
        )
        if self.progress is not None:
            eta_s = None if eta != eta else round(eta, 1)
            self.progress(done_all, self.total, unit="documents", tokens_per_s=round(tok_s),
                          eta_s=eta_s)  # fmt: skip


def _check_group(rank: int, world_size: int, group) -> None:
    if not dist.is_initialized():
        raise RuntimeError("run_longdoc needs an initialised torch.distributed process group")
    if (dist.get_rank(group), dist.get_world_size(group)) != (rank, world_size):
        raise RuntimeError(
            f"rank/world_size ({rank}/{world_size}) disagree with the process group "
            f"({dist.get_rank(group)}/{dist.get_world_size(group)})"
        )


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
    rings: RingOptions | None = None,
    schedule_path: str | Path | None = None,
    ring_progress: Callable[[str, dict], None] | None = None,
    shard: str = "none",
) -> LongDocSummary:
    """Run the long-document task on this rank; every rank of ``group`` calls it alike.

    cfg: ``LongDocParams``, a dict of its fields, or an object with those attributes.
    group: an initialised process group of ``world_size`` ranks (None: the default group).
    out_dir: the job's output directory (shared by all ranks).
    log: one line of text per call (the worker's ``ctx.log``).
    progress: optional ``progress(done, total, unit="documents", **extra)`` (rank 0 only).
    should_stop: optional, polled before each document; when any rank of a ring says True,
    its ranks stop after the current document (its outputs written), the job after the phase.
    device: where the model runs; default: the current GPU under NCCL, else the CPU.
    rings: ``ring.size`` / ``ring.max_tokens_per_rank`` (default: one ring of the whole job).
    schedule_path: where rank 0 writes the schedule (schedule.json in the job directory).
    ring_progress: optional ``ring_progress(label, record)``, called by each ring's lead.
    shard: ``model.shard`` (none, ring, job): FSDP2 shards of the model over each ring (or the
    job, the rings then in lockstep: ``_Lockstep``); needs one ring size (the model is loaded
    once, for this rank's one ring).
    """
    started = time.monotonic()
    params = LongDocParams.from_any(cfg)
    params.tokenizer_path = resolve_tokenizer_path(params.tokenizer_path, params.model_path)
    _check_group(rank, world_size, group)
    if shard != "none" and (rings or RingOptions()).size == "auto":
        raise ValueError("model.shard needs one ring size, not ring.size=auto")
    job = _Ring(rank, world_size, group, comm_device(group), log, list(range(world_size)))
    store = ShardStore(out_dir)
    listing = _list_inputs(params, store, job)
    docs = listing.documents
    summary = LongDocSummary(total=len(docs), missing=list(listing.missing))
    model = None
    if shard == "none":
        tokenizer, model, summary.probe = _load_agreed_model(params, job, device)
    else:
        tokenizer = load_tokenizer(params.tokenizer_path)  # the model: once its ring exists
    todo = _to_do(docs, store, params, job)
    summary.skipped = len(docs) - len(todo)
    schedule = _agreed_schedule(todo, params, rings or RingOptions(), job, tokenizer)
    if job.lead:
        if schedule_path is not None:
            write_schedule(Path(schedule_path), schedule, todo)
        sizes = ", ".join(f"{p['documents']} on {p['rings']} ring(s) of {p['ring_size']}"
                          for p in schedule.phases)  # fmt: skip
        log(
            f"longdoc: mode={params.mode} layout={params.layout} ranks={world_size} "
            f"documents={len(docs)} (complete already: {summary.skipped}, to do: {len(todo)}"
            f"{': ' + sizes if sizes else ''}; missing inputs: {len(listing.missing)})"
        )
    groups = _ring_groups(schedule, job)
    led = [0, 0]  # documents and tokens of the rings this rank led
    for size, spec, entries in schedule.for_rank(rank):
        ring = _Ring(spec.rank_in_ring(rank), size, groups[size], job.device, log, spec.members,
                     f"ring {size}x{spec.index}")  # fmt: skip
        mine = [todo[e.index] for e in entries]
        if model is None:  # sharded over this ring (one ring size: loaded once)
            tokenizer, model, summary.probe = _load_agreed_model(params, ring, device, shard,
                                                                 job.group)  # fmt: skip
        single = len(schedule.phases) == 1 and schedule.phases[0]["rings"] == 1
        shown = _ring_reporter(ring, mine, progress, ring_progress, len(docs), summary, single)
        before = (summary.done, summary.tokens)
        stopped = _run_ring(mine, ring, model, tokenizer, params, store, summary, should_stop,
                            shown, (rings or RingOptions()).max_tokens_per_rank,
                            _Lockstep.of(shard, schedule, job))  # fmt: skip
        if ring.lead:  # each document counted once, by its ring's lead
            led[0] += summary.done - before[0]
            led[1] += summary.tokens - before[1]
        if any_has([stopped], job.group, job.device)[0]:  # every rank ends the phase here
            summary.stopped = True
            break
    _summarise(summary, led, started, job, log)
    return summary


def _agreed_schedule(todo, params, rings: RingOptions, job: _Ring, tokenizer):
    """The same schedule on every rank (deterministic); a document no ring can hold, or an
    impossible ring setting, fails every rank alike before any document runs."""
    try:
        return plan_schedule(todo, rings, world=job.world_size, layout=params.layout,
                             tokenizer=tokenizer)  # fmt: skip
    except (ValueError, UserError) as err:
        raise RuntimeError(f"the schedule: {err}") from None


def _ring_groups(schedule, job: _Ring) -> dict[int, Any]:
    """One process group per ring size the schedule uses (the job's own for the whole job);
    every rank creates every group, in the same order (torch's rule)."""
    sizes = sorted({p["ring_size"] for p in schedule.phases} | {job.world_size})
    if sizes == [job.world_size]:
        return {job.world_size: job.group}
    made = RingGroups.create(job.world_size, job.rank, sizes)
    return {size: made.group(size) for size in sizes}


def _ring_reporter(ring: _Ring, mine, progress, ring_progress, total: int, summary, single):
    """A ring lead's progress lines (None on other ranks). When the job is one ring (`single`)
    its lines and the job's progress file count the job's documents, as before; each ring's
    own record (`ringctl status` adds them up) counts the ring's documents."""
    if not ring.lead:
        return None
    base = summary.skipped if single else 0

    def report(done: int, of: int, **extra) -> None:
        extra.pop("unit", None)
        if progress is not None and single:
            progress(done, of, unit="documents", before=base, **extra)
        if ring_progress is not None:
            ring_progress(ring.label, {"done": done - base, "total": len(mine),
                                       "members": ring.members, "updated_at": time.time(),
                                       **extra})  # fmt: skip

    return _Progress(mine, total if single else len(mine), base, report)


def _run_ring(docs, ring: _Ring, model, tokenizer, params, store, summary, should_stop, shown,
              budget: int | None = None, lockstep: _Lockstep | None = None):  # fmt: skip
    """This ring's documents, in its order: per document consensus, then the model (short
    documents batched under the per-rank token budget, where the model allows it; never in
    lockstep, see _Lockstep). Returns whether a stop was requested (the ring's documents done
    so far are written)."""
    from .batching import MAX_ROWS, can_batch

    batching = budget is not None and lockstep is None and can_batch(model, params.mode)
    pending: list = []
    done = [0]

    def finish(items, results) -> None:
        for (doc, ids), result in zip(items, results, strict=True):
            summary.done += 1
            summary.tokens += int(ids.numel())
            done[0] += 1
            if shown is not None:
                shown.document(doc, int(ids.numel()), result, done[0], ring.log)

    def flush() -> None:
        if pending:
            finish(pending, _score_batch(pending, model, params, store, ring))
            pending.clear()

    for doc in docs if lockstep is None else lockstep.padded(docs):
        stop = bool(should_stop and should_stop())
        stop = stop if lockstep is None else lockstep.agree_stop(stop)
        if doc is None:  # lockstep: this ring has no document left this round
            if stop:
                return _stopped(ring)
            lockstep.idle(model)
            continue
        ids, crc = _read_ids(doc, tokenizer)
        n = None if ids is None else int(ids.numel())
        verdict = document_verdict(doc.id, stop, n, crc, ring.group, ring.device)
        if verdict.action == "stop":
            flush()
            return _stopped(ring)
        if verdict.action == "missing":
            _skip_missing(doc, verdict, params, summary, ring)
            if lockstep is not None:
                lockstep.idle(model)
            continue
        if batching and n:
            longest = max([n] + [int(i.numel()) for _, i in pending])
            width = padded_length(longest, world_size=ring.world_size, layout=params.layout)
            if pending and ((len(pending) + 1) * width // ring.world_size > budget
                            or len(pending) >= MAX_ROWS):  # fmt: skip
                flush()
            pending.append((doc, ids))
            continue
        flush()
        finish([(doc, ids)], [_score_document(doc, ids, model, params, store, ring)])
    flush()
    return False


def _stopped(ring: _Ring) -> bool:
    if ring.lead:
        ring.log(f"{ring.label}: stop requested; the rest is left for a resume")
    return True


def _skip_missing(doc, verdict, params: LongDocParams, summary, ring: _Ring) -> None:
    """A document some rank of the ring cannot read any more: stop the job, or note it."""
    msg = f"{doc.id}: input {doc.source} vanished or changed since it was listed "
    msg += f"(ranks {verdict.unreadable_ranks} of {ring.label} cannot read it)"
    if params.on_missing == "stop":
        raise RuntimeError(msg)
    ring.log(f"missing input: {msg}; going on with the others")
    summary.missing.append(doc.source)


@dataclass
class _Lockstep:
    """``model.shard=job`` with several rings: the weights are sharded over the whole job, so
    every rank must all-gather the same layers in the same order. Every ring therefore runs
    ``rounds`` steps - one document each (batching would merge steps), or an idle step that
    only takes part in the gathers when the ring has no document left or its input vanished
    (an empty document idles inside ``run_task_sharded``) - and a stop is agreed by the whole
    job each step, so that no ring leaves while others still gather."""

    job: _Ring
    rounds: int

    @classmethod
    def of(cls, shard: str, schedule, job: _Ring) -> _Lockstep | None:
        sizes = {p["ring_size"] for p in schedule.phases}
        if shard != "job" or not sizes or sizes == {job.world_size}:
            return None  # rings of the whole job: the ring's own consensus keeps it in step
        counts = Counter((e.ring_size, e.ring) for e in schedule.entries)
        return cls(job, max(counts.values(), default=0))

    def padded(self, docs: list) -> list:
        return list(docs) + [None] * (self.rounds - len(docs))

    def agree_stop(self, wanted: bool) -> bool:
        return any_has([wanted], self.job.group, self.job.device)[0]

    def idle(self, model) -> None:
        from .sharding import idle_step

        idle_step(model)


def _summarise(summary: LongDocSummary, led: list[int], started: float, job: _Ring, log) -> None:
    """The job's totals on every rank: the documents and tokens each ring's lead counted."""
    summary.seconds = time.monotonic() - started
    totals = torch.tensor(led, dtype=torch.int64, device=job.device)
    if job.world_size > 1:
        dist.all_reduce(totals, group=job.group)
    summary.done, summary.tokens = (int(x) for x in totals.cpu().tolist())
    if job.lead:
        log(
            f"longdoc: {summary.done} documents ({summary.tokens} tokens) in "
            f"{summary.seconds:.1f}s; {summary.skipped} were complete already"
            + (f"; missing inputs: {', '.join(summary.missing)}" if summary.missing else "")
        )
