"""The training loop: every rank runs ``run_training`` alike.

1. Seats: the job's W ranks form W / R rings of R consecutive ranks (``ring.size``; null: one
   ring of all). Each ring trains its share of every step's sequences (``data.ring_share``).
2. Model agreement (``longdoc.agreement``): per ring, the checked tokenizer and model in
   float32 (the master weights), the same weights on every rank, the probe passed; a model
   that would train at random (dropout, a router's noise) or toward another objective (the
   router's auxiliary loss) refused. Then activation checkpointing if asked, and FSDP2 over
   the job (``model.shard: job``).
3. Resume: from ``checkpoints/latest`` if there is one (DCP reshards to this job's shape; the
   run's signature must match: its settings, the documents as every rank listed them alike,
   and the sha256 of the model's and tokenizer's files), else step 0 of a fresh stream.
4. Steps (``step.train_step``) until ``task.max_steps``: rank 0 appends each step's record to
   ``logs/metrics.jsonl`` and reports progress (a step whose loss or gradient norm is not
   finite stops the run, named, unrecorded); a checkpoint every ``checkpoint_every`` steps,
   at the end, and at the first step boundary after Slurm's warning signal (agreed by every
   rank), after which the rank stops and says so (the job is not done; resume continues).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..jobdir import JobDir
from ..longdoc.agreement import load_agreed
from ..longdoc.compute.scoring import comm_device
from ..longdoc.consensus import agreed_inputs, any_has
from ..longdoc.model.directory import IDENTITY_OF_PATH, moved_install
from ..longdoc.model.names import installed_model
from ..longdoc.model.tokenize import ByteTokenizer
from . import checkpoint, metrics
from .data import Cursor, SequenceStream, ring_share
from .optim import make_optimizer, make_scheduler, restart_schedule, scheduler_state_problem
from .params import TrainParams, run_byte_tokens
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
    timeout: Any = None  # the rings' collective timeout (TaskContext.timeout)


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
    groups = [
        dist.new_group(list(range(i * size, (i + 1) * size)), timeout=opts.timeout)
        for i in range(rings)
    ]
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


def _config_fields(data: dict, prefix: str = ""):
    """(dotted key, value) of every field of a config's dict, its sub-configs' and dicts'
    fields included: a MoE's settings can sit in one (DBRX's ``ffn_config``), a multimodal
    model's text model in ``text_config``."""
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _config_fields(value, f"{name}.")
        else:
            yield name, value


# Names of config fields that make a train-mode forward draw from the generator when set:
# dropout (``*drop*``: > 0) and the routers' noise (``*jitter*``, ``*noise*``: non-zero).
_DROP, _NOISE = ("drop",), ("jitter", "noise")
_HEADS = ("classifier_", "summary_")  # heads a causal LM does not have


def _flat_config(model) -> dict:
    """{dotted key: value} of the model's config, sub-configs included ({} without one)."""
    config = getattr(model, "config", None)
    return dict(_config_fields(config.to_dict())) if config is not None else {}


def _random_fields(flat: dict) -> dict:
    """{dotted key: value} of the config's fields (``_flat_config``) that make training
    random."""
    out = {}
    for key, value in flat.items():
        leaf = key.rsplit(".", 1)[-1]
        if leaf.startswith(_HEADS) or not isinstance(value, (int, float)):
            continue
        number = not isinstance(value, bool)
        if any(w in leaf for w in _DROP) and number and value > 0:
            out[key] = value
        elif any(w in leaf for w in _NOISE) and value != 0:
            out[key] = value
    return out


def refuse_random_training(model) -> None:
    """A model that draws from the generator in training mode (dropout masks, a router's
    jitter noise, sampled routing) draws from each rank's generator, which the checkpoints do
    not keep: its losses would depend on the ranks and rings, and a resumed run would not
    repeat the uninterrupted one (exit 0 all the same). The one rule, refused by name:
    ``nn.Dropout`` modules with p > 0; config fields, sub-configs' included, named ``*drop*``
    > 0 (OPT and BioGPT apply them with ``nn.functional.dropout``: no module to find;
    layerdrop skips whole layers) or ``*jitter*`` / ``*noise*`` non-zero (Mixtral's and
    MiniMax's router_jitter_noise, DBRX's ffn_config.moe_jitter_eps), each with the override
    that turns it off. PhiMoE's sparsemixer samples its experts whenever it trains, but
    among those within 2 x router_jitter_noise of the best (its default 0.01): at 0 the draw
    can only pick the best, and its steps are the same under any generator (measured, the
    gradients too), so its field is refused like the others, not the model type."""
    keys = _random_fields(_flat_config(model))
    modules = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
    if not keys and not modules:
        return
    off = {k: "false" if isinstance(v, bool) else "0" for k, v in keys.items()}
    hint = ", ".join(f"task.model_overrides.{k}={v}" for k, v in off.items()) or "dropout off"
    found = ", ".join(f"{k}={v}" for k, v in keys.items()) or "a Dropout layer"
    what = "dropout" if all("drop" in k.rsplit(".", 1)[-1] for k in keys) else "randomness"
    raise ValueError(
        f"the model trains with {what} ({found}): training here keeps no random state, so "
        f"losses would depend on the ranks and a resume would not repeat the run; set {hint}"
    )


def refuse_router_loss(model) -> None:
    """A MoE config with ``output_router_logits: true`` asks transformers to add
    router_aux_loss_coef x the router's load-balancing loss to the training loss; the step
    here trains the tokens' loss alone (``step.sequence_backward``), so it would train
    another objective than the config asks for, in silence. Refused, naming the override."""
    flat = _flat_config(model)
    for key, value in flat.items():
        if key.rsplit(".", 1)[-1] == "output_router_logits" and value is True:
            coef = key[: -len("output_router_logits")] + "router_aux_loss_coef"
            said = flat.get(coef)
            raise ValueError(
                f"the model's config asks for the router's load-balancing loss in training "
                f"({key}=true, {coef}={said}), which this job's loss does not add (it trains "
                f"the tokens' loss alone): set task.model_overrides.{key}=false"
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
    refuse_random_training(model)
    refuse_router_loss(model)
    if params.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return agreed.tokenizer, model, agreed.probe


def sequence_stream(params: TrainParams, tokenizer, log=None) -> tuple[SequenceStream, dict]:
    """The run's sequence stream and its signature: what a checkpoint records and a resume
    must match (``params.run_signature``, the documents' ``listing_signature``, and the
    model's and tokenizer's files: ``agreed_identity``)."""
    listing, listed = agreed_inputs(lambda: params.list_inputs(params.input_paths()))
    docs = listing.documents
    for note in listing.notes() if log is not None and dist.get_rank() == 0 else ():
        log(note)  # missing inputs, skipped records, files no reader takes

    def tokens(i: int) -> torch.Tensor:
        return tokenizer.encode(docs[i].read_bytes())

    stream = SequenceStream(tokens, len(docs), int(params.seq_len), int(params.seed))
    byte_tokens = isinstance(tokenizer, ByteTokenizer)  # ids are UTF-8 bytes (run_byte_tokens)
    run = params.run_signature() | {"documents": listed, "byte_tokens": byte_tokens}
    return stream, run | agreed_identity(params)


# The run signature's keys that identify files (``model_identity``), and the setting naming
# where those files are: a resume refuses a model or tokenizer changed at the same path.
IDENTITY_KEYS = {key: f"task.{path}" for path, key in IDENTITY_OF_PATH.items()}
# Run-signature keys added after checkpoints were first written: one written before lacks
# them, and resumes (its value then was never recorded: nothing to compare), with a notice.
ADDED_KEYS = {"clip"}


def model_files(params: TrainParams) -> Path:
    """The file or directory the job's model is read from (``names.model_files``)."""
    from ..longdoc.model import names

    return names.model_files(params.model_path)


def files_identity(params: TrainParams) -> dict:
    """{"model": sha256 of the model's config, weights and tokenizer files (or of its JSON
    config or GGUF file), "tokenizer": the tokenizer files' alone, wherever the run reads a
    tokenizer folder (the model directory's too: gather checks it without hashing weights)}
    (``longdoc.model.directory.model_identity``, as longdoc's run.json records it). A GGUF
    file's tokenizer is the file's own (its "model" identity): its converted folder is
    made anew with each transformers version, and hashing it would refuse a resume."""
    from ..longdoc.model.directory import model_identity
    from ..longdoc.model.gguf_file import is_gguf

    model = model_files(params)
    out = {"model": model_identity(model)}
    if not is_gguf(params.model_path):
        tokenizer = params.tokenizer_dir()
        if tokenizer:
            out["tokenizer"] = model_identity(tokenizer, weights=False)
    return out


def _tokenizer_in_model(params: TrainParams) -> bool:
    """Whether the job tokenizes with the model directory's own tokenizer files."""
    if not params.model_path or not Path(params.model_path).is_dir():
        return False
    found = params.tokenizer_dir()
    return found is not None and Path(found).resolve() == Path(params.model_path).resolve()


def agreed_identity(params: TrainParams) -> dict:
    """``files_identity``, read by rank 0 alone (the weights are read once more: their size
    at disk speed) and given to every rank, so every rank checks a resume against the same
    one; a file rank 0 cannot read is refused on every rank in the same words. The others
    wait as long as reading the files takes (``consensus.from_lead_reading``)."""
    from ..longdoc.consensus import from_lead_reading
    from ..longdoc.model.directory import identity_bytes

    def read() -> tuple[str, Any]:
        try:
            return "ok", files_identity(params)
        except (OSError, ValueError) as err:
            return "refused", f"the model's files cannot be read: {err}"

    nbytes = identity_bytes(model_files(params))  # the weights: the tokenizer's are small
    kind, value = from_lead_reading(read, nbytes)
    if kind == "refused":
        raise ValueError(value)
    return value


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


def resume_from(
    found, model, optimizer, scheduler, stream, run, params, opts
) -> tuple[int, Cursor]:
    """Step 3: (step, cursor) to start from ``found`` (``agreed_latest``; None: step 0); the
    checkpoint's state loaded into the model, optimizer and schedule, and the metrics
    restored to its history."""
    if found is None:  # the history starts again with step 1 (a Slurm requeue before the
        if opts.rank == 0:  # first checkpoint reruns the job in place, its log there)
            metrics.restore(JobDir(opts.job_dir).metrics, None)
        return 0, Cursor()
    checkpoint.verify_together(found)  # before its run signature and cursor are believed
    recorded = found.state["run"]
    want, had = run, recorded | {"byte_tokens": run_byte_tokens(recorded)}
    unrecorded = sorted(k for k in ADDED_KEYS if k in want and k not in had)
    # the model directory's tokenizer, in a checkpoint from before its files had an identity
    # of their own: they are in the model's (IDENTITY_FILES), which is compared
    covered = {"tokenizer"} if "tokenizer" not in had and _tokenizer_in_model(params) else set()
    moved = moved_install(had, want, installed=installed_model(params.model_path))
    skipped = {*unrecorded, *covered, *moved}
    changed = sorted(k for k in want if want[k] != had.get(k) and k not in skipped)
    if changed:
        settings = [k for k in changed if k not in IDENTITY_KEYS]  # named first
        raise ValueError(changed_run(found, (settings or changed)[0], want, had, params))
    cursor = _checked_state(found, scheduler, stream, params)
    for key in unrecorded:
        opts.log(
            f"{found.path}: written before checkpoints recorded task.{key}: resuming with "
            f"task.{key}={want[key]!r}, which could not be checked against the run's"
        )
    checkpoint.load(model, optimizer, found)
    scheduler.load_state_dict(found.state["scheduler"])
    restart_schedule(scheduler, found.step)
    if opts.rank == 0:
        metrics.restore(JobDir(opts.job_dir).metrics, found.path / checkpoint.METRICS)
    unpointed = not checkpoint.CheckpointDir(found.path.parent).pointed()
    said = "; checkpoints/latest is missing: the newest published one" if unpointed else ""
    opts.log(f"resumed from {found.path.name} (step {found.step}){said}")
    return found.step, cursor


def changed_run(found, key: str, want: dict, had: dict, params: TrainParams) -> str:
    """The refusal of a resume whose run signature differs from the checkpoint's at ``key``."""
    if key in IDENTITY_KEYS:
        setting = IDENTITY_KEYS[key]
        path = model_files(params) if key == "model" else params.tokenizer_path
        if key not in had:
            return (
                f"{found.path}: written before checkpoints recorded the {key}'s files "
                f"(train_state.json run.{key}), so whether {setting}={str(path)!r} still holds "
                f"the {key} it trained cannot be checked: start the run again in a new job_dir"
            )
        return (
            f"{found.path}: the {key} at {setting}={str(path)!r} changed since this run "
            f"trained it: resume continues the same run; put that {key} back or start a new "
            f"job_dir (sha256 of its files {had[key]!r} then, {want[key]!r} now)"
        )
    if key == "byte_tokens":
        if "byte_tokens" not in found.state["run"]:  # derived: run_byte_tokens
            earlier = ": an earlier ringctl trained on bytes although the model directory holds one"
        else:
            earlier = ": tokenizer files appeared" if had[key] else ": its files are gone"
        then, now = ("UTF-8 bytes", "a tokenizer's ids") if had[key] else ("a tokenizer", "bytes")
        return (
            f"{found.path}: the run trained on {then}, this one would train on {now} "
            f"(task.tokenizer_path={params.tokenizer_path!r}{earlier}): resume continues the "
            "same run; start a new job_dir (task.tokenizer_path=bytes trains on bytes)"
        )
    what = "the input documents (listed: count and digest)" if key == "documents" else f"task.{key}"
    return (
        f"{found.path}: written by a run with {what}={had.get(key)!r}; this one has "
        f"{want[key]!r}: resume continues the same run (ranks and rings may change, "
        f"{', '.join(sorted(k for k in want if k not in IDENTITY_KEYS))} and the model's "
        f"files may not)"
    )


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
    loaded = dataclasses.replace(params)  # the run's signature keeps the configured value:
    loaded.resolve_tokenizer()  # a GGUF's converted folder moves with caches and versions
    seat = seat_of(opts)
    tokenizer, model, _ = prepare_model(loaded, opts, seat)
    optimizer = make_optimizer(model, lr=params.lr, weight_decay=params.weight_decay)
    scheduler = make_scheduler(
        optimizer,
        warmup_steps=params.warmup_steps,
        max_steps=params.max_steps,
        min_lr_ratio=params.min_lr_ratio,
    )
    job = JobDir(opts.job_dir)
    ckdir = checkpoint.CheckpointDir(job.checkpoints)
    stream, run = sequence_stream(params, tokenizer, opts.log)
    found = agreed_latest(ckdir)
    step, cursor = resume_from(found, model, optimizer, scheduler, stream, run, params, opts)
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
        self.saved: int | None = None  # the newest checkpoint's step, for `ringctl status`
        self.shown: dict = {}  # the last progress record's fields (shown again after a save)

    def run(self, step: int, cursor: Cursor) -> TrainSummary:
        params, start, loss = self.params, step, None
        self.saved = step or None  # resumed from that step's checkpoint
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
            _refuse_diverged(step, result)  # the same on every rank: the job's loss and norm
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
        self.shown = dict(
            done=step,
            total=self.params.max_steps,
            unit="steps",
            before=start,
            loss=round(result.loss, 4),
            tokens_per_s=round(record.tokens_per_s, 1),
        )
        self._show(quiet=False)

    def _show(self, *, quiet: bool) -> None:
        """Rank 0's progress record: the step, its loss and rate, and the newest checkpoint's
        step (after a cancel at step 33, status said 33/60 where the resume starts at 30);
        ``quiet`` after a save: the record again, not another log line."""
        shown = dict(self.shown)
        done, total = shown.pop("done"), shown.pop("total")
        self.opts.progress(done, total, checkpoint=self.saved, quiet=quiet, **shown)

    def _save(self, step: int, cursor: Cursor) -> None:
        if _agree_not_finite(self.model):
            raise ValueError(
                f"step {step}: the weights are not finite after it (the loss and gradient "
                "norm were): training diverged (lower task.lr, or set task.clip > 0); no "
                "checkpoint of it was written: a resume starts from the last one before it"
            )
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
        self.last, self.saved = str(folder), step
        if self.opts.rank == 0:
            self.opts.log(f"checkpoint {folder.name} written")
            self._show(quiet=True)


def _refuse_diverged(step: int, result) -> None:
    """A non-finite loss or gradient norm stops the run at that step, before its record
    (metrics.jsonl holds finite numbers: a NaN made json refuse the line, a traceback) or a
    checkpoint of the state it left. The loss is summed over the job and the norm taken of
    the job's summed gradients: every rank sees the same numbers and stops alike."""
    bad = {"loss": result.loss, "gradient norm": result.grad_norm}
    bad = {k: v for k, v in bad.items() if not math.isfinite(v)}
    if bad:
        said = " and the ".join(f"{k} is {v}" for k, v in bad.items())
        raise ValueError(
            f"step {step}: the {said}: training diverged (lower task.lr, or set task.clip > 0); "
            "this step was neither recorded in logs/metrics.jsonl nor checkpointed: a resume "
            "starts from the last checkpoint before it"
        )


def _agree_not_finite(model) -> bool:
    """Whether any rank holds a weight that is not finite (its shard, under FSDP2): a step
    whose loss and norm were finite can still overflow the weights (a huge lr)."""
    bad = torch.zeros((), dtype=torch.bool, device=next(model.parameters()).device)
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        bad |= ~torch.isfinite(local.detach()).all()
    if dist.get_world_size() == 1:
        return bool(bad)
    return any_has([bool(bad)], None, comm_device(None))[0]


def _window(model) -> int | None:
    """What the packed layout balances for: the model's sliding window when every layer has
    it (a model mixing windowed and full layers spends most in the full ones: None)."""
    from ..longdoc.model.compat import sliding_layers, sliding_window
    from ..longdoc.model.load import attention_layers

    window = sliding_window(model.config)
    if window is None or sliding_layers(model.config) != attention_layers(model):
        return None
    return window
