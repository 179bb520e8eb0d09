"""The training loop: every rank runs ``run_training`` alike.

1. Seats: the job's W ranks form W / R rings of R consecutive ranks (``ring.size``; null: one
   ring of all). Each ring trains its share of every step's sequences (``data.ring_share``).
2. Model agreement (``longdoc.agreement``): per ring, the checked tokenizer and model in
   float32 (the master weights), the same weights on every rank, the probe passed. Then
   activation checkpointing if asked, and FSDP2 over the job (``model.shard: job``).
3. Resume: from ``checkpoints/latest`` if there is one (DCP reshards to this job's shape; the
   run's signature must match), else step 0 of a fresh stream.
4. Steps (``step.train_step``) until ``task.max_steps``: rank 0 appends each step's record to
   ``logs/metrics.jsonl`` and reports progress; a checkpoint every ``checkpoint_every`` steps,
   at the end, and at the first step boundary after Slurm's warning signal (agreed by every
   rank), after which the rank stops and says so (the job is not done; resume continues).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..jobdir import JobDir
from ..longdoc.agreement import load_agreed
from ..longdoc.compute.scoring import comm_device
from ..longdoc.consensus import any_has
from . import checkpoint, metrics
from .data import Cursor, SequenceStream, listing_signature, ring_share
from .optim import make_optimizer, make_scheduler, scheduler_state_problem
from .params import TrainParams
from .step import RingSeat, StepOptions, train_step


@dataclass
class TrainOptions:
    """What the worker gives the loop besides the parameters."""

    rank: int
    world_size: int
    job_dir: Path
    log: Callable[[str], None]
    progress: Callable[..., None]
    should_stop: Callable[[], bool]
    device: Any = None
    ring_size: int | None = None  # null: one ring of the whole job
    shard: str = "none"  # none | job


@dataclass
class TrainSummary:
    steps: int  # steps taken by this attempt
    step: int  # the step the run stands at
    loss: float | None
    stopped: bool  # by Slurm's warning signal, before max_steps
    checkpoint: str | None  # the last checkpoint's folder


def seat_of(opts: TrainOptions) -> RingSeat:
    """This rank's ring among W / R rings of R consecutive ranks (every rank creates every
    ring's group, in the same order: ``new_group`` is collective)."""
    size = opts.ring_size or opts.world_size
    if opts.world_size % size:
        raise ValueError(f"ring.size={size} does not divide the job's {opts.world_size} ranks")
    rings = opts.world_size // size
    groups = [dist.new_group(list(range(i * size, (i + 1) * size))) for i in range(rings)]
    index = opts.rank // size
    group = groups[index] if rings > 1 else None
    return RingSeat(group, size, opts.rank % size, index, rings, None)


def _load(params: TrainParams, opts: TrainOptions, seat: RingSeat):
    """The model in float32 (the master weights), whole or as this rank's FSDP2 shard."""
    from ..longdoc.compute.fsdp import load_sharded_model
    from ..longdoc.model.load import load_model

    device = opts.device
    if opts.shard == "none":
        return load_model(
            params.model_path, dtype="float32", device=device, overrides=params.model_overrides
        )
    return load_sharded_model(
        params.model_path,
        mode="job",
        mesh_or_group=None,
        dtype="float32",
        device=device,
        overrides=params.model_overrides,
    )


def _refuse_dropout(model) -> None:
    """A model that trains with dropout draws masks from each rank's generator, which the
    checkpoints do not keep: its losses would depend on the ranks and rings, and a resumed
    run would not repeat the uninterrupted one. Refused, naming the config's fields to set
    to 0 (task.model_overrides)."""
    if not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return
    config = getattr(model, "config", None)
    fields = config.to_dict() if config is not None else {}
    heads = ("classifier_", "summary_")  # heads a causal LM does not have
    keys = sorted(
        k
        for k, v in fields.items()
        if "drop" in k and not k.startswith(heads) and isinstance(v, float) and v > 0
    )
    hint = ", ".join(f"task.model_overrides.{k}=0" for k in keys) or "dropout off"
    found = ", ".join(f"{k}={fields[k]}" for k in keys) or "a Dropout layer"
    raise ValueError(
        f"the model trains with dropout ({found}): training here keeps no random state, so "
        f"losses would depend on the ranks and a resume would not repeat the run; set {hint}"
    )


def prepare_model(params: TrainParams, opts: TrainOptions, seat: RingSeat):
    """Step 2: (tokenizer, model in training mode, probe line)."""
    checked = dataclasses.replace(params, dtype="float32")  # the weights the probe compares
    agreed = load_agreed(
        checked,
        lambda: _load(params, opts, seat),
        group=seat.group,
        lead=seat.rank == 0,
        log=opts.log,
    )
    model = agreed.model
    _refuse_dropout(model)
    if params.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return agreed.tokenizer, model, agreed.probe


def _stream(params: TrainParams, tokenizer) -> tuple[SequenceStream, dict]:
    """The run's sequence stream and its signature: what a checkpoint records and a resume
    must match (``params.run_signature`` and the documents' ``listing_signature``)."""
    listing = params.list_inputs(params.input_paths())
    docs = listing.documents

    def tokens(i: int) -> torch.Tensor:
        return tokenizer.encode(docs[i].read_bytes())

    stream = SequenceStream(tokens, len(docs), int(params.seq_len), int(params.seed))
    return stream, params.run_signature() | {"documents": listing_signature(docs)}


def agreed_latest(ckdir) -> checkpoint.Checkpoint | None:
    """The checkpoint rank 0's ``latest`` names, read by every rank by that name. Ranks
    reading the pointer each on its own could see different ones (a shared filesystem's
    cached entries, a save published meanwhile) and load different steps. A pointer rank 0
    refuses is refused on every rank, in the same words (none waits for the others)."""
    said: list = [None]
    if dist.get_rank() == 0:
        try:
            found = ckdir.latest()
            said = [("ok", found.path.name if found else None)]
        except ValueError as err:
            said = [("refused", str(err))]
    dist.broadcast_object_list(said, src=0)
    kind, value = said[0]
    if kind == "refused":
        raise ValueError(value)
    if value is None:
        return None
    return ckdir.read(value, where=f"{ckdir.root / checkpoint.LATEST} (as rank 0 read it)")


def _resume(found, model, optimizer, scheduler, stream, run, params, opts) -> tuple[int, Cursor]:
    """Step 3: (step, cursor) to start from ``found`` (``agreed_latest``; None: step 0); the
    checkpoint's state loaded into the model, optimizer and schedule, and the metrics
    restored to its history."""
    if found is None:
        return 0, Cursor()
    want, had = run, found.state["run"]
    changed = sorted(k for k in want if want[k] != had.get(k))
    if changed:
        key = changed[0]
        what = (
            "the input documents (listed: count and digest)"
            if key == "documents"
            else (f"task.{key}")
        )
        raise ValueError(
            f"{found.path}: written by a run with {what}={had.get(key)!r}; this one has "
            f"{want[key]!r}: resume continues the same run (ranks and rings may change, "
            f"{', '.join(sorted(want))} may not)"
        )
    cursor = _checked_state(found, scheduler, stream, params)
    checkpoint.load(model, optimizer, found)
    scheduler.load_state_dict(found.state["scheduler"])
    if opts.rank == 0:
        metrics.restore(JobDir(opts.job_dir).metrics, found.path / checkpoint.METRICS)
    opts.log(f"resumed from {found.path.name} (step {found.step})")
    return found.step, cursor


def _checked_state(found, scheduler, stream, params) -> Cursor:
    """The checkpoint's data cursor, once its step, schedule and cursor are checked against
    this job (before anything is loaded): a file that says otherwise is refused by name."""
    where = found.path / checkpoint.TRAIN_STATE
    if found.step > params.max_steps:
        raise ValueError(f"{where}: step {found.step} is past task.max_steps={params.max_steps}")
    live = scheduler.state_dict()
    wrong = scheduler_state_problem(found.state["scheduler"], live, found.step)
    if wrong:
        raise ValueError(f"{where}: scheduler: {wrong}")
    try:
        cursor = Cursor.from_dict(found.state["cursor"])
    except ValueError as err:
        raise ValueError(f"{where}: cursor: {err}") from None
    wrong = stream.check(cursor)
    if wrong:
        raise ValueError(f"{where}: cursor: points at {wrong}")
    return cursor


def _agree_stop(wanted: bool) -> bool:
    """Whether any rank got the warning signal (every rank learns it at the same step)."""
    if dist.get_world_size() == 1:
        return wanted
    return any_has([wanted], None, comm_device(None))[0]


def run_training(params: TrainParams, opts: TrainOptions) -> TrainSummary:
    seat = seat_of(opts)
    tokenizer, model, _ = prepare_model(params, opts, seat)
    optimizer = make_optimizer(model, lr=params.lr, weight_decay=params.weight_decay)
    scheduler = make_scheduler(
        optimizer,
        warmup_steps=params.warmup_steps,
        max_steps=params.max_steps,
        min_lr_ratio=params.min_lr_ratio,
    )
    job = JobDir(opts.job_dir)
    ckdir = checkpoint.CheckpointDir(job.checkpoints)
    stream, run = _stream(params, tokenizer)
    found = agreed_latest(ckdir)
    step, cursor = _resume(found, model, optimizer, scheduler, stream, run, params, opts)
    loop = _Loop(params, opts, seat, model, optimizer, scheduler, ckdir, stream, run)
    return loop.run(step, cursor)


class _Loop:
    """Step 4: the steps, their records and the checkpoints."""

    def __init__(self, params, opts, seat, model, optimizer, scheduler, ckdir, stream, run):
        self.params, self.opts, self.seat, self.run_signature = params, opts, seat, run
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.ckdir, self.stream = ckdir, stream
        self.step_opts = StepOptions(
            layout=params.layout,
            balance_window=_window(model),
            chunk_size=int(params.chunk_size),
            clip=float(params.clip),
            autocast=torch.bfloat16 if params.dtype == "bfloat16" else None,
        )
        self.sharded = opts.shard != "none"
        self.last: str | None = None

    def run(self, step: int, cursor: Cursor) -> TrainSummary:
        params, start, loss = self.params, step, None
        mine = ring_share(params.batch_sequences, self.seat.rings, self.seat.index)
        stopped = False
        while step < params.max_steps and not stopped:
            sequences, after = self.stream.take(cursor, params.batch_sequences)
            lr = self.scheduler.get_last_lr()[0]
            result = train_step(
                self.model,
                self.optimizer,
                self.scheduler,
                sequences,
                mine,
                self.seat,
                self.step_opts,
                self.sharded,
            )
            step, cursor, loss = step + 1, after, result.loss
            self._record(step, result, lr, start)
            stopped = _agree_stop(self.opts.should_stop()) and step < params.max_steps
            if stopped or step % params.checkpoint_every == 0 or step == params.max_steps:
                self._save(step, cursor)
        return TrainSummary(step - start, step, loss, stopped, self.last)

    def _record(self, step: int, result, lr: float, start: int) -> None:
        if self.opts.rank != 0:
            return
        record = metrics.StepMetrics(
            step,
            result.loss,
            result.tokens,
            lr,
            result.grad_norm,
            result.tokens / max(result.seconds, 1e-9),
            result.seconds,
        )
        metrics.append(JobDir(self.opts.job_dir).metrics, record)
        self.opts.progress(
            step,
            self.params.max_steps,
            unit="steps",
            before=start,
            loss=round(result.loss, 4),
            tokens_per_s=round(record.tokens_per_s, 1),
        )

    def _save(self, step: int, cursor: Cursor) -> None:
        state = checkpoint.train_state(
            step, cursor.to_dict(), self.scheduler.state_dict(), self.run_signature
        )
        folder = checkpoint.save(
            self.model,
            self.optimizer,
            self.ckdir,
            step,
            state,
            keep=self.params.keep_checkpoints,
            metrics=JobDir(self.opts.job_dir).metrics,
        )
        self.last = str(folder)
        if self.opts.rank == 0:
            self.opts.log(f"checkpoint {folder.name} written")


def _window(model) -> int | None:
    """What the packed layout balances for: the model's sliding window when every layer has
    it (a model mixing windowed and full layers spends most in the full ones: None)."""
    from ..longdoc.model.compat import sliding_layers, sliding_window
    from ..longdoc.model.load import attention_layers

    window = sliding_window(model.config)
    if window is None or sliding_layers(model.config) != attention_layers(model):
        return None
    return window
