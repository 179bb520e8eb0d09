"""The long-document task: score, embed or take gradients of documents with a causal LM.

The work lives in `ringctl.longdoc` (documents, tokenizer, model, scoring, shards); this module
is its face in a job config:

    task:
      name: longdoc
      mode: score            # score | embed | grad
      inputs: [docs/]        # .txt, .jsonl, directories; null = the bundled samples
      model_path: null       # a local HF model directory; null = the bundled tiny Llama

Relative input and model paths are made absolute when the job is submitted, so ranks that run
inside the job directory (or on another node with the same filesystem) find them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from ..config import TaskParams

MODES = ("score", "embed", "grad")


@dataclass
class Params(TaskParams):
    name: str = "longdoc"
    mode: str = "score"
    inputs: list[str] | None = None
    text_field: str = "text"
    model_path: str | None = None
    tokenizer_path: str | None = None
    dtype: str = "float32"
    layout: str | None = None  # default: ring.layout
    max_docs: int | None = None
    on_missing: str = "report"  # report: log it and go on with the others | stop: fail first
    write_grads: bool = False
    chunk_size: int = 4096  # positions per lm_head + log-softmax chunk


def check(cfg, bad) -> None:
    t = cfg.task
    if t.mode not in MODES:
        raise bad("task.mode", f"must be one of {', '.join(MODES)}, got {t.mode!r}")
    if t.on_missing not in ("report", "stop"):
        raise bad("task.on_missing", f"must be report or stop, got {t.on_missing!r}")
    if t.dtype not in ("float32", "bfloat16", "float16", "float64"):
        raise bad("task.dtype", f"must be float32, bfloat16, float16 or float64, got {t.dtype!r}")
    if t.chunk_size < 1:
        raise bad("task.chunk_size", f"must be at least 1, got {t.chunk_size}")
    for key in ("model_path", "tokenizer_path"):
        value = t[key]
        if value is not None and not Path(value).expanduser().exists():
            raise bad(f"task.{key}", f"{value} does not exist")


def prepare(cfg):
    """Absolute paths, so ranks started in the job directory find the inputs and model."""
    cfg = OmegaConf.to_container(cfg, resolve=True)
    t = cfg["task"]
    if t["inputs"]:
        t["inputs"] = [str(Path(p).expanduser().absolute()) for p in t["inputs"]]
    for key in ("model_path", "tokenizer_path"):
        if t[key]:
            t[key] = str(Path(t[key]).expanduser().absolute())
    return cfg


def params_of(cfg):
    from ..longdoc.run import LongDocParams

    t = cfg.task
    return LongDocParams(
        inputs=list(t.inputs) if t.inputs else None,
        text_field=t.text_field,
        model_path=t.model_path,
        tokenizer_path=t.tokenizer_path,
        task=t.mode,
        dtype=t.dtype,
        layout=str(t.layout or cfg.ring.layout.value),
        max_docs=t.max_docs,
        on_missing=t.on_missing,
        write_grads=t.write_grads,
        chunk_size=t.chunk_size,
    )


def run(cfg, ctx) -> dict:
    from ..longdoc.run import run_longdoc

    summary = run_longdoc(
        params_of(cfg), ctx.rank, ctx.world_size, ctx.group, ctx.out_dir, ctx.log,
        progress=ctx.progress, should_stop=ctx.stop_requested, device=ctx.device,
    )  # fmt: skip
    missing = f", missing inputs: {', '.join(summary.missing)}" if summary.missing else ""
    ctx.log(
        f"longdoc: {summary.done} documents done, {summary.skipped} already complete, "
        f"{summary.tokens} tokens in {summary.seconds:.1f}s{missing}"
    )
    return {"documents": summary.done, "tokens": summary.tokens}
