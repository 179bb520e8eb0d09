"""The long-document task: score, embed or take gradients of documents with a causal LM.

The work lives in `ringctl.longdoc` (documents, tokenizer, model, scoring, shards); this module
is its face in a job config. Its parameters are `ringctl.longdoc.params.LongDocParams` (the
`task:` section; see that module for every key):

    task:
      name: longdoc
      mode: score            # score | embed | grad
      inputs: [docs/]        # a path or a list: .txt .md .jsonl .jsonl.gz .json, directories
      model_path: null       # a local HF model directory; null = the bundled tiny Llama

`check` runs at submit, before anything is created: impossible values, paths that do not exist,
a model that ring attention cannot run exactly (refused by name, from its config.json), a byte
tokenizer with a model of another vocabulary, and inputs that cannot be read. Relative input and
model paths are made absolute when the job is submitted (`prepare`), so ranks that run inside
the job directory (or on another node with the same filesystem) find them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from ..longdoc.params import MODES, LongDocParams

Params = LongDocParams


@dataclass
class ModelSection:
    """`model:` of a long-document job: how the model's weights are held."""

    shard: str = "none"  # none | ring (FSDP2 over each ring's ranks) | job (over all ranks)


SECTIONS = {"model": ModelSection}
__all__ = ["MODES", "Params", "check", "params_of", "prepare", "run"]


def _check_model(p: LongDocParams, bad) -> None:
    """The model and tokenizer, from config.json only (no torch, no transformers)."""
    from ..longdoc.compat import config_refusal, read_model_config
    from ..longdoc.tokenize import TOKENIZER_FILES, resolve_tokenizer_path

    try:
        config = read_model_config(p.model_path)
    except ValueError as err:
        raise bad("task.model_path", str(err)) from None
    config = {**config, **(p.model_overrides or {})}
    why = config_refusal(config)
    if why:
        raise bad("task.model_path", why)
    vocab = (config.get("text_config") or config).get("vocab_size")
    tokenizer = resolve_tokenizer_path(p.tokenizer_path, p.model_path)
    if tokenizer is None and vocab is not None and int(vocab) != 256:
        where = "has no tokenizer files" if p.model_path else "is the bundled byte model"
        raise bad(
            "task.tokenizer_path",
            f"the model's vocabulary is {vocab} ids and the model directory {where} "
            f"({', '.join(TOKENIZER_FILES)}): UTF-8 bytes (256 ids) would score garbage; "
            "give the tokenizer's directory",
        )


def _check_inputs(p: LongDocParams, bad) -> None:
    """Inputs that cannot be read are found at submit (missing ones follow on_missing)."""
    from ..longdoc.documents import DocumentError

    if p.inputs is None:
        return
    try:
        p.list_inputs()
    except DocumentError as err:
        raise bad("task.inputs", str(err)) from None


def check(cfg, bad) -> None:
    try:
        p = LongDocParams.from_any(OmegaConf.to_container(cfg.task, resolve=True), validate=False)
    except (TypeError, ValueError) as err:
        raise bad("task", str(err)) from None
    for key, why in p.problems():
        raise bad(f"task.{key}", why)
    for key in ("model_path", "tokenizer_path"):
        value = getattr(p, key)
        if value is not None and value != "bytes" and not Path(value).expanduser().exists():
            raise bad(f"task.{key}", f"{value} does not exist")
    _check_model(p, bad)
    _check_inputs(p, bad)
    _check_shard(cfg, p, bad)


def _check_shard(cfg, p: LongDocParams, bad) -> None:
    """model.shard needs one ring size (the model is loaded once, sharded over the ring or the
    job); with several rings, model.shard=job runs them in lockstep (longdoc/run.py)."""
    from ..longdoc.sharding import SHARD_MODES

    shard = str(cfg.model.shard)
    if shard not in SHARD_MODES:
        raise bad("model.shard", f"expected one of {', '.join(SHARD_MODES)}, got {shard!r}")
    if shard == "none":
        return
    if cfg.ring.size == "auto":
        why = "size would need its own sharded copy of the model); give ring.size=N"
        raise bad("model.shard", f"{shard} cannot be combined with ring.size=auto (each ring {why}")
    if shard == "job" and p.mode == "grad":  # FSDP would sum the rings' different documents
        raise bad("model.shard", "job cannot run mode=grad; use model.shard=ring")


def prepare(cfg):
    """Absolute paths, so ranks started in the job directory find the inputs and model."""
    from ..longdoc.model import BUNDLED_TRAINED

    cfg = OmegaConf.to_container(cfg, resolve=True)
    t = cfg["task"]
    if isinstance(t["inputs"], str):
        t["inputs"] = [t["inputs"]]
    if t["inputs"]:
        t["inputs"] = [str(Path(p).expanduser().absolute()) for p in t["inputs"]]
    for key in ("model_path", "tokenizer_path"):
        if t[key] and t[key] not in ("bytes", BUNDLED_TRAINED):  # names, resolved where run
            t[key] = str(Path(t[key]).expanduser().absolute())
    return cfg


def params_of(cfg) -> LongDocParams:
    params = LongDocParams.from_any(OmegaConf.to_container(cfg.task, resolve=True), validate=False)
    params.layout = str(cfg.task.layout or cfg.ring.layout.value)
    params.validate()
    return params


def run(cfg, ctx) -> dict:
    from ..atomic import atomic_write_json
    from ..jobdir import JobDir
    from ..longdoc.run import run_longdoc
    from ..longdoc.scheduling import RingOptions

    job = JobDir(ctx.job_dir)

    def ring_progress(label: str, record: dict) -> None:
        atomic_write_json(job.logs / "rings" / f"{label.replace(' ', '-')}.json", record)

    summary = run_longdoc(
        params_of(cfg), ctx.rank, ctx.world_size, ctx.group, ctx.out_dir, ctx.log,
        progress=ctx.progress, should_stop=ctx.stop_requested, device=ctx.device,
        rings=RingOptions.of(cfg), schedule_path=job.path / "schedule.json",
        ring_progress=ring_progress, shard=str(cfg.model.shard),
    )  # fmt: skip
    if summary.stopped:  # a preemption signal: the job is not done, and must not look done
        left = summary.total - summary.skipped - summary.done
        raise RuntimeError(
            f"stopped on request before the end: {left} of {summary.total} documents left "
            "(finished ones are written); `ringctl resume` continues"
        )
    missing = f", missing inputs: {', '.join(summary.missing)}" if summary.missing else ""
    ctx.log(
        f"longdoc: {summary.done} documents done, {summary.skipped} already complete, "
        f"{summary.tokens} tokens in {summary.seconds:.1f}s{missing}"
    )
    return {"documents": summary.done, "tokens": summary.tokens}
