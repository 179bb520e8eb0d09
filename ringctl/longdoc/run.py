"""The long-document loop: every rank runs ``run_longdoc`` (a ``LongDocRun``) alike.

The job's ranks form one ring or several (``ring.size``; ``schedule.py`` puts each document
on a ring, the same plan on every rank); a ring runs its documents one after another, each
sharded in the given layout (zigzag by default) across the ring's ranks, except that under a
per-rank token budget consecutive short documents are packed into one sequence
(``compute/packing.py``). Each rank writes its shard of the outputs (``output/store.py``).
Documents already complete in ``out_dir`` (every rank's entry there, checksums valid) are
skipped, so a rerun after a failure or preemption only computes what is missing. Rank 0 logs
one line per document with the progress (documents done / total, tokens/s, ETA).

How a run proceeds (``LongDocRun.run``):

1. ``list_inputs``: the documents, agreed on every rank; rank 0 records the run and the list.
2. ``load_model`` (``agreement.py``): every rank loads the model, checks that its
   weights are finite and that the ranks hold the same weights, refuses what ``compat.py``
   knows cannot be exact, and runs the probe (``probe.py``): the model on the ring must
   reproduce the model's own forward pass, or nothing is scored.
   With ``model.shard`` the model is loaded in step 4b, once its ring exists.
3. ``_to_do``: the documents not complete yet (resume), those whose input was edited since
   their outputs were written included (``task.on_changed_input``: redo them, or stop).
4. ``plan`` the rings (``schedule.py``), then ``run_phases``: each ring this rank belongs
   to runs its documents (``_RingPass``), short ones packed where the model allows it.
5. ``_summarise``: the job's totals, the same on every rank.

Decisions that must be the same on every rank (skip a document, stop, fail) are taken together:
every rank contributes its view through a small collective, so a rank never waits on a peer
that went another way. Errors that concern the whole job (bad parameters, a missing input with
``on_missing=stop``, an output directory holding a different run) are raised on every rank.
"""

from __future__ import annotations

import contextlib
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
from ..progress import ring_record
from ..rings import RingGroups
from .compute.scoring import ShardResult, comm_device, run_task
from .consensus import (
    agree,
    agreed_inputs,
    any_has,
    document_verdict,
    from_lead_reading,
)
from .inputs.documents import (
    Document,
    DocumentError,
    Listing,
    input_identity,
    invalid_utf8_count,
)
from .model.compat import window_refusal
from .model.directory import identity_bytes, model_identity
from .model.load import attention_layers, load_model
from .model.names import installed_model, model_files
from .model.tokenize import ByteTokenizer, load_tokenizer
from .output.completeness import INPUT_CHANGED, document_status
from .output.expected import check_expected, some_names, write_expected
from .output.manifest import (
    documents_record,
    other_run,
    run_fingerprint,
    run_record,
    write_documents,
    write_run,
)
from .output.store import ShardStore
from .params import LongDocParams
from .schedule import RingOptions, document_bytes, plan_schedule, write_job_schedule

__all__ = ["LongDocOptions", "LongDocParams", "LongDocRun", "LongDocSummary", "run_longdoc"]


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


def _eta(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _to_do(docs: list[Document], store: ShardStore, run: dict, params: LongDocParams, job: _Ring):
    """Step 3, resume: the documents not complete yet, by gather's own definition (whatever
    ring size wrote them; this ``run``'s shards only), a document whose input was edited
    since its outputs were written included. Document i is checked by job rank i mod W, then
    the ranks agree."""
    found = [
        document_status(store.root, d.describe(), run, d.identity)[1]
        if i % job.world_size == job.rank
        else None  # another rank's to check
        for i, d in enumerate(docs)
    ]
    _changed_inputs(docs, [[p for p in f or [] if INPUT_CHANGED in p] for f in found], params, job)
    have = any_has([f == [] for f in found], job.group, job.device)
    return [d for d, h in zip(docs, have, strict=True) if not h]


def _changed_inputs(docs: list[Document], changed: list[list[str]], params, job: _Ring) -> None:
    """Documents whose input was edited since (``changed``: this rank's finding per document):
    with ``on_changed_input=stop`` every rank refuses the job, naming the first; else they
    are computed again, and the job's lead says which."""
    first = next((c[0] for c in changed if c), "")
    if params.on_changed_input == "stop":  # every rank takes part, found one or not
        why = "refused (task.on_changed_input=stop; redo computes it again)"
        agree(f"{first}; {why}" if first else "", job.group)
    redo = any_has([bool(c) for c in changed], job.group, job.device)
    if job.lead and any(redo):
        ids = [d.id for d, r in zip(docs, redo, strict=True) if r]
        job.log(f"input changed since its outputs were written, computed again: {some_names(ids)}")


def _read_ids(
    doc: Document, tokenizer, scored: dict[str, int | None] | None = None
) -> tuple[torch.Tensor | None, int, dict | None, int]:
    """(token ids or None when the input vanished, their checksum, the input's identity: what
    the document's outputs record of it, and how many of its bytes a text tokenizer read as
    U+FFFD: not valid UTF-8; the byte tokenizer reads every byte as it is). ``scored`` (the
    ring's lead): takes the document's scored bytes (``tokenize.scored``), which its entry
    records for gather where the inputs are not at hand (an ssh job's, on the login node)."""
    try:
        raw = doc.read_bytes()
    except (FileNotFoundError, DocumentError):  # gone, or changed since it was listed
        return None, -1, None, 0
    if scored is None:
        ids = tokenizer.encode(raw)
    else:
        ids, scored[doc.id] = tokenizer.scored(raw)
    replaced = 0 if isinstance(tokenizer, ByteTokenizer) else invalid_utf8_count(raw)
    return ids, zlib.crc32(ids.numpy().tobytes()), input_identity([raw]), replaced


def _with_scored_bytes(stats: dict, scored: int | None) -> dict:
    """A scoring result's stats with the document's scored bytes where the ring's lead counted
    them (bits per byte for gather without the input: ``JobModel.scored_bytes``)."""
    if scored is None or "log_likelihood" not in stats:
        return stats
    return {**stats, "scored_bytes": int(scored)}


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


# How often a ring lead says where a document's forward is (``DocumentProgress.within``).
WITHIN_S = 30.0


class DocumentProgress:
    """A ring lead's one line per document: tokens/s of this run and the ETA of what is left
    on its ring; `progress(done, total, ...)` gets the counts (the job's rank 0: the job's
    progress file; every ring lead: its ring's)."""

    def __init__(self, todo: list[Document], total: int, skipped: int, progress) -> None:
        self.bytes_left = sum(document_bytes(d) for d in todo)
        self.bytes_done = 0
        self.compute_s = 0.0
        self.tokens = 0
        self.total, self.done_before = total, skipped
        self.done_all = skipped
        self.said: dict = {}  # the last document's rate and ETA: a record is replaced whole
        self.progress = progress
        self.start = time.monotonic()
        self.said_within = self.start
        if progress is not None:  # the count from the start: status showed nothing until
            try:  # the first document ended
                progress(self.done_all, total, unit="documents")
            except OSError:
                pass

    def within(self, what: str, layer: int, layers: int) -> None:
        """Where the forward of one document (or pack: ``what`` names it) is, its layer of
        the model's, said at most every WITHIN_S: a document of a million tokens takes half
        an hour, and status and the log showed nothing until it ended. The record's
        ``current`` goes with its next count."""
        now = time.monotonic()
        if self.progress is None or now - self.said_within < WITHIN_S:
            return
        self.said_within = now
        current = f"{what}: layer {layer} of {layers}"
        try:  # advisory, inside the forward: a full disk must not stop the lead mid-layer
            self.progress(self.done_all, self.total, unit="documents", current=current, **self.said)
        except OSError:
            pass

    def document(self, doc: Document, n: int, result: ShardResult, done: int, log) -> None:
        self.compute_s += result.seconds
        self.tokens += n
        self.bytes_done += document_bytes(doc)
        elapsed = time.monotonic() - self.start
        rate = self.bytes_done / elapsed if elapsed > 0 else 0.0
        eta = (self.bytes_left - self.bytes_done) / rate if rate > 0 else float("nan")
        tok_s = self.tokens / self.compute_s if self.compute_s > 0 else 0.0
        done_all = self.done_all = self.done_before + done
        self.said_within = time.monotonic()  # this line is news: the next, WITHIN_S on
        log(
            f"doc {done_all}/{self.total} {doc.id}: {n} tokens in {result.seconds:.2f}s"
            f"{_stats_text(result.stats)}; {tok_s:.0f} tokens/s, ETA {_eta(eta)}"
        )
        if self.progress is not None:
            eta_s = None if eta != eta else round(eta, 1)
            self.said = {"tokens_per_s": round(tok_s), "eta_s": eta_s}
            self.progress(done_all, self.total, unit="documents", **self.said)


def _check_group(rank: int, world_size: int, group) -> None:
    if not dist.is_initialized():
        raise RuntimeError("run_longdoc needs an initialised torch.distributed process group")
    if (dist.get_rank(group), dist.get_world_size(group)) != (rank, world_size):
        raise RuntimeError(
            f"rank/world_size ({rank}/{world_size}) disagree with the process group "
            f"({dist.get_rank(group)}/{dist.get_world_size(group)})"
        )


def _ring_groups(schedule, job: _Ring, timeout=None) -> dict[int, Any]:
    """One process group per ring size the schedule uses (the job's own for the whole job);
    every rank creates every group, in the same order (torch's rule)."""
    sizes = sorted({p["ring_size"] for p in schedule.phases} | {job.world_size})
    if sizes == [job.world_size]:
        return {job.world_size: job.group}
    made = RingGroups.create(job.world_size, job.rank, sizes, timeout)
    return {size: made.group(size) for size in sizes}


def _stopped(ring: _Ring) -> bool:
    if ring.lead:
        ring.log(f"{ring.label}: stop requested; the rest is left for a resume")
    return True


@dataclass
class _Lockstep:
    """``model.shard=job`` with several rings: the weights are sharded over the whole job, so
    every rank must all-gather the same layers in the same order. Every ring therefore runs
    ``rounds`` steps - one document each (packing would merge steps), or an idle step that
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
        from .compute.fsdp import idle_step

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


@dataclass(frozen=True)
class LongDocOptions:
    """How a run is driven, beside its parameters: ``run_longdoc``'s ``options``, the one place
    they are defined (the task builds them from the job's config: ``tasks/longdoc.py``).

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
    timeout: the collective timeout of the rings' groups (``TaskContext.timeout``; None:
    torch's default for a new group, 30 minutes for gloo).
    """

    progress: Callable[..., None] | None = None
    should_stop: Callable[[], bool] | None = None
    device: torch.device | str | None = None
    rings: RingOptions = field(default_factory=RingOptions)
    schedule_path: str | Path | None = None
    ring_progress: Callable[[str, dict], None] | None = None
    shard: str = "none"
    timeout: Any = None


class LongDocRun:
    """This rank's part of one long-document run, and what its steps share.

    ``params`` (checked), ``store`` (the output directory), ``job`` (this rank in the whole
    job), ``summary`` (the counts so far), ``tokenizer`` and ``model`` (once agreed). The
    constructor checks what needs no collective; ``run()`` takes the steps of the module
    docstring in order.
    """

    def __init__(
        self,
        cfg: Any,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None,
        out_dir: str | Path,
        log: Callable[[str], None] = print,
        options: LongDocOptions | None = None,
    ) -> None:
        self.started = time.monotonic()
        self.options = options or LongDocOptions()
        self.params = LongDocParams.from_any(cfg)
        self.params.resolve_tokenizer()
        _check_group(rank, world_size, group)
        if self.options.shard != "none" and self.options.rings.size == "auto":
            raise ValueError("model.shard needs one ring size, not ring.size=auto")
        members = list(range(world_size))
        self.job = _Ring(rank, world_size, group, comm_device(group), log, members)
        self.store = ShardStore(out_dir)
        self.log = log
        self.summary = LongDocSummary()
        self.tokenizer: Any = None
        self.model: Any = None
        self.inputs: dict[str, dict | None] = {}  # document id -> its input's identity, as read
        self.scored: dict[str, int | None] = {}  # document id -> its scored bytes (ring leads)
        self._identity: dict | None = None  # run_signature's model and tokenizer identity
        self.run_record: dict = {}  # run.json as rank 0 records it, on every rank (list_inputs)

    def run(self) -> LongDocSummary:
        """List, load and probe the model, find what is left, schedule the rings, score."""
        listing = self.list_inputs()
        docs = listing.documents
        self.summary = LongDocSummary(total=len(docs), missing=list(listing.missing))
        if self.options.shard == "none":
            self.load_model(self.job)
        else:  # the model: once its ring exists
            self.tokenizer = load_tokenizer(self.params.tokenizer_path)
        todo = _to_do(docs, self.store, self.run_record, self.params, self.job)
        self.summary.skipped = len(docs) - len(todo)
        schedule = self.plan(todo, docs)
        self.announce(schedule, todo)
        led = self.run_phases(schedule, docs)
        _summarise(self.summary, led, self.started, self.job, self.log)
        return self.summary

    def list_inputs(self) -> Listing:
        """Step 1, listing: the documents, agreed on every rank; rank 0 records run and list."""
        params, job = self.params, self.job
        inputs = params.input_paths()
        try:  # every rank the same documents (a file arriving meanwhile: timeouts, no word)
            listing, _ = agreed_inputs(lambda: params.list_inputs(inputs), group=job.group)
        except ValueError as err:
            raise RuntimeError(str(err)) from None
        try:
            installed = installed_model(self.params.model_path)
            error = other_run(self.store.root, self.run_signature(), installed=installed)
        except RuntimeError as err:  # the model's files: every rank hears it
            error = str(err)
        error = error or check_expected(self.store.root, listing.documents)
        agree(error, job.group)
        # with the identity rank 0 computes, the others waiting as long as its read takes
        try:  # a bound only: a name some node cannot resolve is refused in the agreement
            nbytes = identity_bytes(model_files(self.params.model_path))
        except (OSError, ValueError):
            nbytes = 0
        self.run_record = from_lead_reading(
            lambda: run_record(job.world_size, self.run_signature()), nbytes, job.group
        )
        for note in listing.notes():
            job.log(note)
        if job.lead:
            self._record_listing(inputs, listing)
        return listing

    def run_signature(self) -> dict:
        """What run.json records and a resume must match: the task's settings, and (rank 0,
        which records it; computed once) the identity of the model and tokenizer files
        (``model_identity``), so that a model changed at the same path is refused rather
        than mixed into the results of the old one."""
        if not self.job.lead:
            return self.params.signature()
        if self._identity is None:
            params = self.params
            model = model_files(params.model_path)
            try:
                self._identity = {"model": model_identity(model)}
                tokenizer = params.tokenizer_path
                if tokenizer and Path(tokenizer) != Path(model):
                    self._identity["tokenizer"] = model_identity(tokenizer, weights=False)
            except (OSError, ValueError) as err:
                raise RuntimeError(f"the model's files cannot be read: {err}") from None
        return self.params.signature() | self._identity

    def _record_listing(self, inputs: list[str], listing: Listing) -> None:
        """Rank 0: the run's signature, the documents expected, and the listing's index."""
        root = self.store.root
        write_run(root, self.run_record)
        write_expected(root, listing.documents)
        write_documents(root, documents_record(inputs, listing))

    def load_model(self, ring: _Ring) -> None:
        """Step 2, model agreement (``agreement.py``): tokenizer, model and probe line,
        refused on every rank alike. Every rank loads the model (``shard``: whole, or its
        FSDP2 shard over the ring's ranks or the job's)."""
        from .agreement import load_agreed

        agreed = load_agreed(
            self.params,
            lambda: self._load(ring),
            group=ring.group,
            lead=ring.lead,
            log=ring.log,
        )
        self.tokenizer, self.model = agreed.tokenizer, agreed.model
        if ring.lead and self.options.shard != "none":
            from .compute.fsdp import shard_summary

            ring.log(shard_summary(self.model))
        self.summary.probe = agreed.probe

    def _load(self, ring: _Ring):
        """The model, whole or as this rank's FSDP2 shard over the ring's ranks or the job's."""
        params, shard = self.params, self.options.shard
        device = self.options.device or ring.device
        if shard == "none":
            return load_model(
                params.model_path,
                dtype=params.dtype,
                device=device,
                overrides=params.model_overrides,
            )
        from .compute.fsdp import load_sharded_model

        return load_sharded_model(
            params.model_path,
            mode=shard,
            mesh_or_group=ring.group if shard == "ring" else self.job.group,
            dtype=params.dtype,
            device=device,
            overrides=params.model_overrides,
        )

    def plan(self, todo: list[Document], docs: list[Document]):
        """Step 4a: the same schedule on every rank (deterministic); a document no ring can
        hold, or an impossible ring setting, fails every rank alike before any document runs.
        Entries index ``docs``, the whole listing (input order), also on a resume."""
        try:
            return plan_schedule(
                todo,
                self.options.rings,
                world=self.job.world_size,
                layout=self.params.layout,
                tokenizer=self.tokenizer,
                listing=docs,
            )
        except (ValueError, UserError) as err:
            raise RuntimeError(f"the schedule: {err}") from None

    def announce(self, schedule, todo: list[Document]) -> None:
        """Rank 0 writes the schedule and logs the run's one opening line (benchmarks watch it)."""
        if not self.job.lead:
            return
        if self.options.schedule_path is not None:
            write_job_schedule(Path(self.options.schedule_path), schedule, todo)
        sizes = ", ".join(
            f"{p['documents']} on {p['rings']} ring(s) of {p['ring_size']}" for p in schedule.phases
        )
        params, s = self.params, self.summary
        self.log(
            f"longdoc: mode={params.mode} layout={params.layout} ranks={self.job.world_size} "
            f"documents={s.total} (complete already: {s.skipped}, to do: {len(todo)}"
            f"{': ' + sizes if sizes else ''}; missing inputs: {len(s.missing)})"
        )

    def run_phases(self, schedule, docs: list[Document]) -> list[int]:
        """Step 4b, every ring this rank belongs to, phase by phase; returns the documents and
        tokens of the rings this rank led (each document counted once, by its ring's lead)."""
        groups = _ring_groups(schedule, self.job, self.options.timeout)
        lockstep = _Lockstep.of(self.options.shard, schedule, self.job)
        single = len(schedule.phases) == 1 and schedule.phases[0]["rings"] == 1
        led = [0, 0]
        for size, spec, entries in schedule.for_rank(self.job.rank):
            rank = spec.rank_in_ring(self.job.rank)
            label = f"ring {size}x{spec.index}"
            ring = _Ring(rank, size, groups[size], self.job.device, self.log, spec.members, label)
            if self.model is None:  # sharded over this ring (one ring size: loaded once)
                self.load_model(ring)
            before = (self.summary.done, self.summary.tokens)
            mine = [docs[e.index] for e in entries]  # the index: input order (the listing)
            stopped = _RingPass(self, ring, mine, single, lockstep).run()
            if ring.lead:
                led[0] += self.summary.done - before[0]
                led[1] += self.summary.tokens - before[1]
            if any_has([stopped], self.job.group, self.job.device)[0]:  # the phase ends here
                self.summary.stopped = True
                break
        return led

    def reporter(self, ring: _Ring, mine: list[Document], single: bool) -> DocumentProgress | None:
        """A ring lead's progress lines (None on other ranks). When the job is one ring
        (``single``) its lines and the job's progress file count the job's documents, as
        before; each ring's own record (``ringctl status`` adds them up) counts the ring's."""
        if not ring.lead:
            return None
        base = self.summary.skipped if single else 0
        progress, ring_progress = self.options.progress, self.options.ring_progress

        def report(done: int, of: int, **extra) -> None:
            extra.pop("unit", None)
            if progress is not None and single:
                progress(done, of, unit="documents", before=base, **extra)
            if ring_progress is not None:
                before = self.summary.skipped  # the job's, done by earlier attempts
                record = ring_record(done - base, len(mine), ring.members, before=before, **extra)
                ring_progress(ring.label, record)

        return DocumentProgress(mine, self.summary.total if single else len(mine), base, report)

    def score_document(self, doc: Document, ids, ring: _Ring) -> ShardResult:
        """One agreed document through the model on the ring, its shard written."""
        n = int(ids.numel())
        too_long = window_refusal(self.model.config, n)
        if too_long:  # n is the same on every rank (agreed): every rank raises alike
            raise RuntimeError(f"{doc.id}: {too_long}; nothing more was scored")
        from .compute.fsdp import is_sharded, run_task_sharded

        params, chunk_size = self.params, int(self.params.chunk_size)
        common = {"group": ring.group, "layout": params.layout, "chunk_size": chunk_size}
        if is_sharded(self.model):  # every rank asks for the whole gradients: it is collective
            grads = {"gather_grads": params.write_grads}
            result = run_task_sharded(params.mode, self.model, ids, **common, **grads)
        else:
            grads = {"keep_grads": params.write_grads and ring.lead}
            result = run_task(params.mode, self.model, ids, **common, **grads)
        padded = padded_length(n, world_size=ring.world_size, layout=params.layout) if n else 0
        self.write(doc, n, padded, result, ring)
        return result

    def score_pack(self, pending: list, ring: _Ring) -> list[ShardResult]:
        """Several short documents packed into one sequence (compute/packing.py): one forward,
        each document's shards written as if alone (their entries record the packing)."""
        from .compute.packing import run_pack

        params = self.params
        results = run_pack(
            params.mode,
            self.model,
            [i for _, i in pending],
            group=ring.group,
            layout=params.layout,
            chunk_size=int(params.chunk_size),
        )
        for (doc, i), result in zip(pending, results, strict=True):
            self.write(doc, int(i.numel()), None, result, ring)
        return results

    def write(
        self, doc: Document, n: int, padded: int | None, result: ShardResult, ring: _Ring
    ) -> None:
        """This rank's shard of one document's outputs (the ring's lead adds the gradients);
        ``padded``: the length its layout cut, or None for a packed document."""
        self.store.write_shard(
            doc=doc.describe(),
            rank=ring.rank,
            world_size=ring.world_size,
            layout=self.params.layout,
            task=self.params.mode,
            n_tokens=n,
            padded_tokens=padded,
            tensors=result.tensors,
            stats=_with_scored_bytes(result.stats, self.scored.pop(doc.id, None)),
            seconds=result.seconds,
            grads=result.grads if ring.lead else None,
            input_identity=self.inputs.pop(doc.id, None),
            packing=result.packing,
            run=run_fingerprint(self.run_record),
        )

    def skip_missing(self, doc: Document, verdict, ring: _Ring) -> None:
        """A document some rank of the ring cannot read any more: stop the job, or note it."""
        msg = f"{doc.id}: input {doc.source} vanished or changed since it was listed "
        msg += f"(ranks {verdict.unreadable_ranks} of {ring.label} cannot read it)"
        if self.params.on_missing == "stop":
            raise RuntimeError(msg)
        ring.log(f"missing input: {msg}; going on with the others")
        self.summary.missing.append(doc.source)


class _RingPass:
    """One ring's documents, in its order: per document consensus, then the model (short
    documents packed into one sequence under the per-rank token budget, where the model allows
    it; never in lockstep, see _Lockstep). ``run()`` returns whether a stop was requested (the
    ring's documents done so far are written)."""

    def __init__(self, owner: LongDocRun, ring: _Ring, docs, single: bool, lockstep) -> None:
        from .compute.packing import can_pack

        self.owner, self.ring, self.docs, self.lockstep = owner, ring, docs, lockstep
        self.budget = owner.options.rings.max_tokens_per_rank
        mode = owner.params.mode
        self.packing = self.budget is not None and lockstep is None and can_pack(owner.model, mode)
        self.shown = owner.reporter(ring, docs, single)
        self.pending: list = []
        self.done = 0

    def run(self) -> bool:
        should_stop, lockstep = self.owner.options.should_stop, self.lockstep
        for doc in self.docs if lockstep is None else lockstep.padded(self.docs):
            stop = bool(should_stop and should_stop())
            stop = stop if lockstep is None else lockstep.agree_stop(stop)
            if doc is None:  # lockstep: this ring has no document left this round
                if stop:
                    return _stopped(self.ring)
                lockstep.idle(self.owner.model)
                continue
            if self.step(doc, stop):
                return True
        self.flush()
        return False

    def step(self, doc: Document, stop: bool) -> bool:
        """One document: agreed by the ring (stop, missing or go), then queued for a batch or
        scored alone. Returns True when the ring stops here."""
        scored = self.owner.scored if self.ring.lead else None
        ids, crc, identity, replaced = _read_ids(doc, self.owner.tokenizer, scored)
        self.owner.inputs[doc.id] = identity
        if replaced and self.ring.lead:  # the Latin-1 sample was scored altered, unsaid
            self.ring.log(
                f"{doc.id}: {replaced} byte(s) not valid UTF-8, read as U+FFFD by the tokenizer "
                "(bits per byte count the UTF-8 bytes of the text as read)"
            )
        n = None if ids is None else int(ids.numel())
        verdict = document_verdict(doc.id, stop, n, crc, self.ring.group, self.ring.device)
        if verdict.action == "stop":
            self.flush()
            return _stopped(self.ring)
        if verdict.action == "missing":
            self.owner.skip_missing(doc, verdict, self.ring)
            if self.lockstep is not None:
                self.lockstep.idle(self.owner.model)
            return False
        self.check_budget(doc, n)
        if self.packing and n:
            self.queue(doc, ids, n)
            return False
        self.flush()
        with self.watched(doc.id):
            result = self.owner.score_document(doc, ids, self.ring)
        self.finish([(doc, ids)], [result])
        return False

    def check_budget(self, doc: Document, n: int) -> None:
        """A document whose real length its ring cannot hold under ``ring.max_tokens_per_rank``
        fails the job by name (the schedule sized it from an estimate: ``scheduled_tokens``),
        before any rank runs out of memory; every rank of the ring has the agreed length."""
        from ringattn.geometry import ring_capacity, ring_holds

        size, layout = self.ring.world_size, self.owner.params.layout
        if self.budget is None or ring_holds(n, size, int(self.budget), layout):
            return
        raise RuntimeError(
            f"{doc.id}: {n:,} tokens do not fit its ring of {size} rank(s) at "
            f"ring.max_tokens_per_rank={int(self.budget):,} (it holds "
            f"{ring_capacity(size, int(self.budget), layout):,}): the schedule's estimate was "
            "short; give a larger ring.max_tokens_per_rank or ring.size, then `ringctl "
            "resume` (finished documents are kept)"
        )

    def watched(self, what: str):
        """On the ring's lead, the forward of ``what`` (a document, or a pack) counted layer by
        layer for its progress (``DocumentProgress.within``); elsewhere nothing."""
        if self.shown is None:
            return contextlib.nullcontext()
        from ringattn.hf import count_calls

        layers = attention_layers(self.owner.model)
        shown = self.shown
        return count_calls(on_call=lambda c: shown.within(what, min(c.calls, layers), layers))

    def queue(self, doc: Document, ids, n: int) -> None:
        """A short document joins the pack; the pack runs first if it would then exceed the
        per-rank token budget or the document limit."""
        from .compute.packing import fits

        lengths = [int(i.numel()) for _, i in self.pending] + [n]
        if self.pending and not fits(lengths, ring_size=self.ring.world_size, budget=self.budget):
            self.flush()
        self.pending.append((doc, ids))

    def flush(self) -> None:
        if self.pending:
            first, more = self.pending[0][0].id, len(self.pending) - 1
            with self.watched(f"{first} and {more} more, packed" if more else first):
                results = self.owner.score_pack(self.pending, self.ring)
            self.finish(self.pending, results)
            self.pending.clear()

    def finish(self, items: list, results: list[ShardResult]) -> None:
        summary = self.owner.summary
        for (doc, ids), result in zip(items, results, strict=True):
            summary.done += 1
            summary.tokens += int(ids.numel())
            self.done += 1
            if self.shown is not None:
                self.shown.document(doc, int(ids.numel()), result, self.done, self.ring.log)


def run_longdoc(
    cfg: Any,
    rank: int,
    world_size: int,
    group: dist.ProcessGroup | None,
    out_dir: str | Path,
    log: Callable[[str], None] = print,
    options: LongDocOptions | None = None,
) -> LongDocSummary:
    """Run the long-document task on this rank; every rank of ``group`` calls it alike.

    cfg: ``LongDocParams``, a dict of its fields, or an object with those attributes.
    group: an initialised process group of ``world_size`` ranks (None: the default group).
    out_dir: the job's output directory (shared by all ranks).
    log: one line of text per call (the worker's ``ctx.log``).
    options: progress, stop requests, device, rings, ... (``LongDocOptions``; default: none).
    """
    return LongDocRun(cfg, rank, world_size, group, out_dir, log, options).run()
