"""`ringctl gather` of a training job: the run's metrics, its loss curve, and the trained model.

    OUT/metrics.jsonl   every step's record (``metrics.py``: the job's logs/metrics.jsonl,
                        which a resume restores to its checkpoint's history)
    OUT/loss.png        the loss against the step (where matplotlib is installed: .[plot])
    OUT/model/          a transformers directory (config.json, model.safetensors, every
                        file of the run's tokenizer, checked to give its ids), the weights
                        consolidated from the newest checkpoint (DCP, loaded in one process),
                        which ``AutoModelForCausalLM.from_pretrained`` loads
    OUT/summary.json    the checkpoint's step, its loss (null where no copy of the history
                        holds steps 1 to it once each: said), what was written

Written whole or not at all, beside OUT, as every gather (``ringctl.output_dir``). A job with
no checkpoint yet, or whose ``latest`` names a broken one, is refused in one line.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..atomic import default_file_mode
from ..backends import files_here
from ..bounded_read import read_regular
from ..errors import CheckpointPruned, UserError, naming, with_filename
from ..jobdir import JobDir, job_of
from ..output_dir import (
    beside,
    check_target,
    is_gather_output,
    is_partial_output,
    new_output_dir,
    put_in_place,
    recover_killed,
    write_marker,
)
from ..text import echo
from . import checkpoint, metrics

TASK = "train"
MAX_CONFIG_BYTES = 1 << 20


@dataclass
class TrainGather:
    out: Path
    step: int
    loss: float | None
    files: list[str]
    notes: list[str] = field(default_factory=list)
    steps_left: int = 0  # after the checkpoint, to the run's last step (--partial)

    @property
    def partial(self) -> bool:
        return self.steps_left > 0


def recognises(path: Path) -> bool:
    """An earlier training gather output (its marker says so)."""
    from ..output_dir import marker_of

    marker = marker_of(Path(path))
    return marker is not None and marker.get("task") == TASK


def _latest(job: JobDir) -> checkpoint.Checkpoint:
    """The checkpoint ``latest`` names, inside the job directory: a ``checkpoints/`` that is
    itself a link (the job's processes can make one) led gather to export any folder."""
    if job.checkpoints.is_symlink():
        raise UserError(f"{job.checkpoints}: a link (to {job.checkpoints.resolve()}), not a folder")
    try:
        found = checkpoint.CheckpointDir(job.checkpoints).latest()
    except ValueError as err:
        raise _refused(str(err)) from None
    if found is None:
        raise UserError(f"{job.checkpoints}: no checkpoint yet; nothing to gather")
    return found


def _unpointed_note(job: JobDir, found: checkpoint.Checkpoint) -> list[str]:
    """Gather's note when no ``latest`` named the checkpoint (``CheckpointDir.pointer``)."""
    if checkpoint.CheckpointDir(job.checkpoints).pointed():
        return []
    return [
        f"{job.checkpoints / checkpoint.LATEST} is missing: gathered {found.path.name}, the "
        "newest published checkpoint"
    ]


def gather(
    job_dir,
    out=None,
    *,
    force: bool = False,
    partial: bool = False,
    job_config=None,
    fmt: str = "safetensors",
    **_ignored,
) -> TrainGather:
    """Write OUT (default JOBDIR/gathered) from the job's newest checkpoint and metrics. A
    checkpoint before the run's last step is an unfinished run's: refused unless ``partial``,
    and then marked partial (as a scoring job's documents are). ``fmt`` is the scoring job's
    table of per-token values: a training job has none (asked for, it was ignored)."""
    if fmt != "safetensors":
        raise UserError(
            f"--format {fmt}: a table of per-token values is a scoring job's; a training "
            "job's gather writes metrics.jsonl, loss.png and model/"
        )
    if is_gather_output(Path(job_dir)) and recognises(Path(job_dir)):
        raise UserError(f"{job_dir}: a gathered training output, not a job: nothing to gather")
    job = JobDir(job_of(Path(job_dir)) or Path(job_dir))  # JOBDIR/out names its job too
    target = _target(job, out)
    notes = recover_killed(target)
    check_target(target, job.path, force=force)
    target.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(PRUNED_RETRIES + 1):
        pointer = _pointer(job)
        try:
            found = _latest(job)
        except UserError:
            if _pointer(job) == pointer:  # the error is the truth
                raise
            continue  # the folder it named was pruned before it was read: the newest
        left = _steps_left(found, job_config, partial=partial)
        said = notes + _unpointed_note(job, found)
        try:
            return _write_whole(target, job, found, job_config, force, left, said)
        except (UserError, OSError):
            if not _pruned(job, found):  # the error is the truth
                raise
            # a running job saved a newer checkpoint and pruned the one read: the newest
    raise CheckpointPruned(
        f"{job.checkpoints}: the running job saved and pruned checkpoints faster than gather "
        f"read one ({PRUNED_RETRIES + 1} tries, each pruned while read): run gather again, "
        "or keep more (task.keep_checkpoints) or save less often (task.checkpoint_every)"
    )


def _pruned(job: JobDir, found: checkpoint.Checkpoint) -> bool:
    """Whether the job pruned ``found`` while gather read it: ``latest`` names another
    checkpoint now and ``found``'s folder is going (a moment for its removal to finish: an
    error met halfway through it is that removal's)."""
    if _pointer(job) == found.path.name:
        return False
    for _ in range(20):
        if not (found.path / checkpoint.TRAIN_STATE).exists():
            return True
        time.sleep(0.05)
    return False


def _pointer(job: JobDir) -> str | None:
    """The name ``checkpoints/latest`` holds now (None: none, or unreadable): whether the job
    moved it while gather read the checkpoint it named."""
    try:
        return checkpoint.CheckpointDir(job.checkpoints).pointer()
    except ValueError:
        return None


def _target(job: JobDir, out) -> Path:
    return Path(out).expanduser().absolute() if out else job.gathered


def replaces_partial(job_dir, out) -> bool:
    """Whether this gather would replace an earlier partial output (the verb then holds the
    job's lock, as for --force)."""
    return is_partial_output(_target(JobDir(Path(job_dir)), out))


# How often gather takes the newest checkpoint again when the one it read was pruned under it
# (a running job with keep_checkpoints=1 replaced it): a reader slower than the job's steps.
PRUNED_RETRIES = 3


def _steps_left(found: checkpoint.Checkpoint, job_config, *, partial: bool) -> int:
    """How many steps of the run (task.max_steps) come after ``found`` (0: none, or no
    config to tell); more than 0 is refused unless ``partial``: a stopped or running job's
    model looked final (summary.json, marker)."""
    max_steps = _max_steps(job_config)
    if max_steps is None or found.step >= max_steps:
        return 0
    if not partial:  # the run's last checkpoint is missing: exit 3, as a scoring job's
        raise _refused(  # documents not all written (it was 2, a usage error)
            f"{found.path}: the newest checkpoint is step {found.step} of the run's "
            f"{max_steps} (task.max_steps): the run has not finished; --partial writes this "
            "one, marked partial"
        )
    return max_steps - found.step


def _max_steps(job_config) -> int | None:
    value = job_config.task.get("max_steps") if job_config is not None else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _write_whole(target: Path, job: JobDir, found, job_config, force, left: int, notes):
    with beside(target):
        tmp = new_output_dir(target)
        try:
            files, loss, more = _write(tmp, job, found, job_config, left > 0)
            write_marker(tmp, job.path, TASK, partial=left > 0)
            check_target(target, job.path, force=force)
            put_in_place(tmp, target)
        except BaseException as err:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(err, OSError):
                raise with_filename(err, target) from None
            raise
    return TrainGather(target, found.step, loss, files, notes + more, left)


def _write(
    tmp: Path, job: JobDir, found, job_config, unfinished: bool
) -> tuple[list[str], float | None, list]:
    problem = checkpoint.verify(found)  # before any of its files is believed
    if problem:
        raise _refused(problem)
    records, loss, notes = _history(job, found)
    (tmp / "metrics.jsonl").write_text("".join(json.dumps(r.__dict__) + "\n" for r in records))
    files = ["metrics.jsonl"]
    png = _plot(tmp / "loss.png", records)
    files += [png] if png else []
    if not png:
        why = "no step recorded" if not records else "pip install 'ringctl[plot]' (matplotlib)"
        notes.append(f"loss.png not drawn: {why}")
    tokenizer, said = run_tokenizer_dir(job_config, found)
    notes += said
    export_model(found, tmp / "model", tokenizer)
    files.append("model/")
    summary = {
        "task": TASK,
        "step": found.step,
        "max_steps": _max_steps(job_config),
        "partial": unfinished,
        "loss": loss,
        "files": files,
    }
    (tmp / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return files + ["summary.json"], loss, notes


def _refused(problem: str) -> UserError:
    """A checkpoint gather cannot vouch for (damaged, changed since its save, unreadable) or
    that is not the run's last (unfinished: --partial): exit 3, as a scoring job's damaged or
    missing outputs (2 is a usage error)."""
    from ..longdoc.output.gather import GatherError

    return GatherError([problem])


def _history(job: JobDir, found: checkpoint.Checkpoint) -> tuple[list, float | None, list]:
    """(the run's step records up to ``found``, the loss to report, notes): from the copy
    saved with the checkpoint (covered by its checksums; logs/metrics.jsonl is the attempt's:
    a resume moves it to attempts/<n>/ and restores it only once the checkpoint loads, so a
    resume stopped before that gathered no step, exit 0), else logs/metrics.jsonl: the first
    holding one run's steps 1 to the checkpoint's (``metrics.one_run``), whose last loss is
    the checkpoint's. Where neither does, the longer copy is written and no loss reported,
    said: the copy with more lines was taken and its last line's loss reported, so a line
    appended twice, lines reordered or cut gave another step's loss, exit 0. A saved copy
    that is not a regular file is a damaged checkpoint (exit 3)."""
    saved = found.path / checkpoint.METRICS
    copies, notes = [], []
    for path in ([saved] if os.path.lexists(saved) else []) + [job.metrics]:
        try:
            records, bad = metrics.read(path)
        except ValueError as err:  # not a regular file: named
            raise (_refused(str(err)) if path == saved else UserError(str(err))) from None
        notes += [f"{path}: {bad} unreadable line(s) skipped"] if bad else []
        records = [r for r in records if r.step <= found.step]
        run = metrics.one_run(records, found.step)
        if run:
            return run, run[-1].loss, notes
        copies.append((records, path))
    records, _ = max(copies, key=lambda c: len(c[0]))
    said = ", ".join(str(c[1]) for c in copies)
    notes.append(
        f"{said}: no copy holds steps 1 to {found.step} once each in order; loss not reported"
    )
    return records, None, notes


def export_model(found: checkpoint.Checkpoint, where: Path, tokenizer: Path | None) -> None:
    """The checkpoint's weights, consolidated in this process, as a transformers directory
    (its config.json built by transformers' own classes: no ``auto_map`` code ever runs).
    config.json is the job directory's: the model it describes is checked against the
    checkpoint's tensors before it is built for real (``_check_against``)."""
    from ..longdoc.model.compat import config_from_fields

    path = found.path / checkpoint.MODEL_CONFIG
    try:
        data = saved_model_config(path)
    except UserError as err:
        raise _refused(str(err)) from None
    try:
        config, _ = config_from_fields(data, path)
        _check_against(config, found, path)
        model = _build(config, path)
        checkpoint.load_weights(model, found)
    except UserError as err:  # the model config.json describes is not the checkpoint's: exit 3
        raise _refused(str(err)) from None
    except (ValueError, TypeError, KeyError) as err:
        said = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        raise _refused(naming(path, said, within=found.path)) from None
    _save_quietly(model, where)
    _export_generation_config(found, where)
    for written in where.iterdir():  # transformers writes the weights 0600 (a shared cluster)
        written.chmod(default_file_mode())
    if tokenizer is not None:
        copy_tokenizer(tokenizer, where)


def _export_generation_config(found: checkpoint.Checkpoint, where: Path) -> None:
    """The model's own generation_config.json, kept in the checkpoint, in place of the one
    save_pretrained derives from config.json: that one lost a chat model's end-of-turn ids
    (eos_token_id [1, 5] became 1) and its sampling settings, exit 0. Read as hostile,
    built by transformers' class (an error names the file); a checkpoint of an earlier
    release has none: the derived one stays."""
    from transformers import GenerationConfig

    path = found.path / checkpoint.GENERATION_CONFIG
    if not os.path.lexists(path):
        return
    try:
        data = _checkpoint_json(path, "a generation config")
        if not isinstance(data, dict):
            raise ValueError("a generation config is a JSON object")
        GenerationConfig.from_dict(data).save_pretrained(where)
    except UserError as err:
        raise _refused(str(err)) from None
    except (ValueError, TypeError) as err:
        raise _refused(naming(path, str(err).strip()[:300], within=found.path)) from None


def copy_tokenizer(source: Path, where: Path) -> None:
    """Every file the tokenizer at ``source`` reads (``TOKENIZER_READS``; a link followed
    only inside the model's own folder, as a Hugging Face cache snapshot's into its blobs),
    then the copy loaded and held against the source: the same vocabulary and the same ids
    of a sample, or refused naming both. A GPT-2-style tokenizer (vocab.json, merges.txt)
    was exported as its tokenizer_config.json alone, which encoded text to no ids, exit 0;
    a snapshot's files (links) were not copied at all."""
    from ..bounded_read import open_regular
    from ..longdoc.model.directory import TOKENIZER_READS, followed

    for name in sorted(TOKENIZER_READS):
        entry = source / name
        if not os.path.lexists(entry):
            continue
        try:
            with open_regular(followed(entry)) as f, open(where / name, "wb") as out:
                shutil.copyfileobj(f, out)
        except (ValueError, FileNotFoundError) as err:
            raise UserError(f"{entry}: the tokenizer's file cannot be copied ({err})") from None
    check_copied_tokenizer(source, where)


# Text the exported tokenizer must encode as the run's did: words, digits, whitespace runs,
# punctuation, accents, CJK and an emoji (byte fallback).
TOKENIZER_SAMPLE = "The tide, at 04:30 -- 12.5 m.\n\tNaïve café; 海辺の灯台 🌊  end"


def check_copied_tokenizer(source: Path, where: Path) -> None:
    """UserError unless the tokenizer at ``where`` loads and gives the vocabulary and the
    ids of ``TOKENIZER_SAMPLE`` that the one at ``source`` gives."""
    from ..longdoc.model.tokenize import HFTokenizer

    try:
        run, copy = HFTokenizer(source), HFTokenizer(where)
    except (OSError, ValueError, TypeError) as err:
        said = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
        raise UserError(
            f"{where}: the tokenizer copied from {source} cannot be loaded "
            f"({type(err).__name__}: {said})"
        ) from None
    sample = TOKENIZER_SAMPLE.encode("utf-8")
    if (
        run.vocab_size != copy.vocab_size
        or run.encode(sample).tolist() != copy.encode(sample).tolist()
    ):
        raise UserError(
            f"{where}: the tokenizer copied from {source} does not give the run's ids "
            f"(vocabulary {copy.vocab_size} against {run.vocab_size}): it reads a file "
            "gather does not copy; export the model and tokenizer by hand (save_pretrained)"
        )


def _save_quietly(model, where: Path) -> None:
    """save_pretrained without transformers' "Writing model shards" bar in gather's output
    (a carriage-return line among the verb's own)."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(where, safe_serialization=True)
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def _build(config, path: Path):
    """transformers' model of ``config`` (on the current default device); a build that runs
    out of memory or that torch refuses is one line naming the config, not a traceback."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except (RuntimeError, MemoryError) as err:
        text = str(err).strip().splitlines()
        said = f"{type(err).__name__}: {text[0][:300] if text else ''}"
        raise UserError(f"{path}: the model it describes cannot be built ({said})") from None


def _check_against(config, found: checkpoint.Checkpoint, path: Path) -> None:
    """The model ``config`` describes, built on the meta device (no memory, no init), has
    exactly the checkpoint's model tensors, name for name, shape and dtype (its DCP
    metadata, read through ``dcp_reader``): else refused, naming config.json and the first
    key that differs. Building it whole first let a vocab_size of 2**40 end in a traceback
    and 20000 layers take 44 s and 4 GB before the load refused them."""
    import torch

    from . import dcp_reader

    stored = dcp_reader.read_metadata(found.path).state_dict_metadata
    saved = {k[len("model.") :]: v for k, v in stored.items() if k.startswith("model.")}
    _check_layers(config, saved, path)
    with torch.device("meta"):
        built = {k: (tuple(t.shape), t.dtype) for k, t in _build(config, path).state_dict().items()}
    for key, (shape, dtype) in built.items():
        held = getattr(saved.get(key), "size", None)
        if held is None:
            raise UserError(
                f"{path}: the model it describes has {key}, which the checkpoint beside it "
                "does not hold"
            )
        if tuple(held) != shape:
            raise UserError(
                f"{path}: the model it describes has {key} of shape {list(shape)}, the "
                f"checkpoint beside it {list(held)}"
            )
        stored_dtype = getattr(getattr(saved[key], "properties", None), "dtype", dtype)
        if stored_dtype != dtype:  # the load would cast: a bf16 export of float32 weights
            raise UserError(
                f"{path}: the model it describes has {key} in {str(dtype)[6:]} (its dtype), "
                f"the checkpoint beside it holds {str(stored_dtype)[6:]}: not the config the "
                "run wrote"
            )
    extra = next((k for k in saved if k not in built), None)
    if extra is not None:
        raise UserError(
            f"{path}: the checkpoint beside it holds {extra}, which the model it describes has not"
        )


def _check_layers(config, saved: dict, path: Path) -> None:
    """Before even the meta build (its time grows with the layers: 25 s for 20000): a config
    with more layers than the checkpoint's longest numbered list of modules
    (``model.layers.N``) cannot match it."""
    lists: dict[str, set[str]] = {}
    for key in saved:
        parts = key.split(".")
        for i, part in enumerate(parts):
            if part.isdigit():
                lists.setdefault(".".join(parts[:i]), set()).add(part)
    layers = getattr(config.get_text_config(), "num_hidden_layers", None)
    longest = max((len(v) for v in lists.values()), default=0)
    if isinstance(layers, int) and lists and layers > longest:
        raise UserError(
            f"{path}: num_hidden_layers={layers}, but the checkpoint beside it holds at most "
            f"{longest} numbered modules in a list: not the model it trained"
        )


def saved_model_config(path: Path) -> dict:
    """config.json as written beside the checkpoint, read as hostile: a JSON object with a
    model_type; the fields that would choose code or an attention implementation dropped
    (``_``-keys go in ``config_from_fields``; ``auto_map`` here: the job's model was
    transformers' own)."""
    data = _checkpoint_json(path, "a model config")
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise UserError(f"{path}: a model config is a JSON object with a model_type")
    for key in ("auto_map", "attn_implementation"):
        data.pop(key, None)
    return data


def _checkpoint_json(path: Path, what: str):
    """The JSON value of a file beside a checkpoint, read as hostile (a regular file, bounded:
    ``read_regular``); a UserError naming the file otherwise."""
    try:
        return json.loads(read_regular(path, MAX_CONFIG_BYTES).decode("utf-8"))
    except RecursionError:
        raise UserError(f"{path}: not {what} (nested too deeply)") from None
    except ValueError as err:
        raise UserError(naming(path, str(err))) from None


# An ssh job's tokenizer is the login node's file (its paths name the cluster's files).
LOGIN_NODE_TOKENIZER = (
    "; the job ran over ssh, with the login node's tokenizer: run `ringctl gather` there, or "
    "copy the tokenizer's directory to the same path here (its files are checked against the "
    "run's)"
)


def run_tokenizer_dir(job_config, found: checkpoint.Checkpoint) -> tuple[Path | None, list[str]]:
    """The tokenizer directory to copy beside the weights (None: the run trained on UTF-8
    bytes) and notes. Found by the rule the run used (``CorpusParams.tokenizer_dir`` of the
    job's config, a control file), then held against what the checkpoint recorded: whether
    the run trained on bytes (``run_byte_tokens``: a run of an earlier ringctl did where
    this finds the model directory's tokenizer: nothing is copied, said), and the tokenizer
    files' identity where the run kept it: a tokenizer changed or gone since would be copied
    beside (or missing from) weights trained on other ids, exit 0."""
    if job_config is None:
        return None, []
    from omegaconf import OmegaConf

    from ..longdoc.model.directory import model_identity
    from ..longdoc.model.gguf_file import is_gguf
    from .params import TrainParams, run_byte_tokens

    task = job_config.task
    try:  # the ranks' rule: a reserved name (package:...) resolved, then tokenizer_dir()
        params = TrainParams.from_any(OmegaConf.to_container(task, resolve=True), validate=False)
    except ValueError as err:
        raise UserError(f"task: {err}") from None
    model_path, path = params.model_path, params.tokenizer_dir()
    run, state = found.state["run"], found.path / checkpoint.TRAIN_STATE
    if run_byte_tokens(run):
        said = f"{state}: the run trained on UTF-8 bytes: no tokenizer is copied beside its weights"
        # said either way: AutoTokenizer on the folder fails, and nothing said why (review)
        return None, [f"{said} (not {path}'s)" if path else f"{said} (ids are the bytes)"]
    if not path or not Path(path).is_dir():
        raise UserError(
            f"{state}: the run trained with a tokenizer (task.tokenizer_path="
            f"{echo(task.get('tokenizer_path'))}), which is not found now"
            + (f" at {path}" if path else "")
            + ": the weights need its files beside them"
            + ("" if files_here(job_config) else LOGIN_NODE_TOKENIZER)
        )
    # a GGUF file's tokenizer is the file's own: its "model" identity stands for it
    gguf = is_gguf(model_path)
    recorded = run.get("model") if gguf else run.get("tokenizer")
    try:
        if recorded is None:
            now = None
        else:
            now = model_identity(model_path) if gguf else model_identity(path, weights=False)
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: the run's tokenizer cannot be read ({err})") from None
    if now != recorded:
        what = f"{model_path}: the GGUF file (its tokenizer's source)" if gguf else path
        raise UserError(
            f"{what}: the tokenizer's files changed since the run (sha256 {now}, the run's "
            f"{recorded}): the weights were trained on the ids of the earlier ones"
        )
    return Path(path), []


def _plot(path: Path, records) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    if not records:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(
        [r.step for r in records],
        [r.loss for r in records],
        marker="." if len(records) < 50 else None,
    )
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean per token)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.name


def show(result: TrainGather, console) -> None:
    from rich.text import Text

    loss = "loss not reported" if result.loss is None else f"loss {result.loss:.4f}"
    partial = " (partial: the run has not finished)" if result.partial else ""
    console.print(
        Text(
            f"step {result.step}{partial}, {loss}: wrote {', '.join(result.files)} in {result.out}"
        )
    )
    for note in result.notes:
        console.print(Text(f"note: {note}"))
