"""docs/supported-models.md: the compatibility suite's verdict on every causal-LM family that
the installed transformers ships.

    python -m tests.supported_models                 # runs the suite, writes the page
    python -m tests.supported_models --out PATH      # elsewhere
    python -m tests.supported_models --only gpt2 olmoe   # some families, printed, not written

Families (``families()``, in the page's order): the suite's own cases first
(``tests/test_longdoc_compat.py`` ``FAMILIES``: windows, RoPE scaling, logit scales, refusals),
then one tiny random-initialised model of every other family in transformers'
``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, built from the suite's ``BASE`` shape plus the size
fields its config class has (``SIZES``: experts, head size, ...) and a few ``TWEAKS`` a family
needs to build at that size. A family whose config names a sliding window gets a window of 64
(checked at 64, 65 and 301 tokens); one with a length limit is checked at the limit and past it.

Verdicts, the job's own, from one spawned pair of gloo ranks (as the suite):

* exact: the suite's check (``_judge``): max |log p(ring) - log p(model)| <= TOL per token on
  every document, and the probe accepts;
* refused at submit / on load / by the probe: the job refuses it by name before scoring (the
  probe's line says whose failure it is);
* not checked: no tiny model of it could be built (the reason is given) or its smallest config
  is larger than ``MAX_PARAMS`` (multimodal wrappers keep their default towers).

A family that the probe accepts and whose documents then differ from the model's own forward
would be a wrong number that the job does not catch: the generator names it and exits 1 without
writing the page. ``tests/test_longdoc_compat.py`` checks that the committed page lists exactly
``families()`` (labels only: no model is built for that).

Run time: 2 to 4 minutes on 2 shared cores (one pair of ranks for all families).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tests.distributed import run_distributed
from tests.test_longdoc_compat import (
    BASE,
    FAMILIES,
    SLIDING,
    TOL,
    Family,
    W,
    _judge,
    _ring_family,
    _runtime_guard,
    build_config_dict,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PAGE = Path(__file__).resolve().parents[1] / "docs" / "supported-models.md"
MAX_PARAMS = 5_000_000
# Size fields set where the family's config class has them (a tiny model of every family).
SIZES = dict(
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    head_dim=16,
    ffn_dim=128,
    n_inner=128,
    d_model=64,
    decoder_layers=2,
    decoder_attention_heads=4,
    decoder_ffn_dim=128,
    encoder_layers=2,
    encoder_attention_heads=4,
    encoder_ffn_dim=128,
)
_TOKENS = dict(bos_token_id=0, eos_token_id=1, pad_token_id=2)
_MLA = dict(num_key_value_heads=4)  # latent attention: as many key/value heads as queries
TWEAKS: dict[str, dict] = {
    "codegen": dict(rotary_dim=8),
    **dict.fromkeys(
        (
            "cwm",
            "modernbert-decoder",
            "camembert",
            "data2vec-text",
            "roberta",
            "roberta-prelayernorm",
            "xlm-roberta",
            "xlm-roberta-xl",
        ),
        _TOKENS,
    ),  # a padding id: their position ids skip it
    "dbrx": dict(
        d_model=64,
        n_heads=4,
        n_layers=2,
        max_seq_len=4096,
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2),
    ),
    "gemma3n_text": dict(num_kv_shared_layers=0, vocab_size_per_layer_input=256),
    **{
        kind: _MLA
        for kind in (
            "deepseek_v2",
            "axk1",
            "axk2",
            "glm4_moe_lite",
            "minicpm3",
            "sarvam_mla",
            "youtu",
            "longcat_flash",
        )
    },
}


def shipped() -> list[str]:
    """The causal-LM families of the installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def labels() -> list[str]:
    """The page's rows, in order: the suite's cases, then every other shipped family."""
    named = {f.model_type for f in FAMILIES}
    return [f.label for f in FAMILIES] + [kind for kind in shipped() if kind not in named]


def families(only: list[str] | None = None) -> list[Family]:
    curated = {f.label: f for f in FAMILIES}
    return [curated.get(label) or auto_family(label) for label in only or labels()]


def auto_family(kind: str) -> Family:
    """A tiny model of a family the suite has no case for; a window of W where it has one."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from ringctl.longdoc.model.compat import length_limit, sliding_window
    from ringctl.longdoc.model.overrides import class_fields

    fields = class_fields(CONFIG_MAPPING[kind])
    overrides = {k: v for k, v in SIZES.items() if k in fields} | TWEAKS.get(kind, {})
    try:
        config = AutoConfig.for_model(kind, **{**BASE, **overrides})
    except Exception:  # noqa: BLE001 - the ranks say why when they build it
        return Family(kind, kind, overrides)
    fam = Family(kind, kind, overrides)
    if sliding_window(config) is not None and "sliding_window" in fields:
        fam = replace(fam, overrides={**overrides, "sliding_window": W}, lengths=SLIDING, sliding=W)
        config = AutoConfig.for_model(kind, **{**BASE, **fam.overrides})
    limit = length_limit(config)
    if limit is not None and limit < max(fam.lengths):
        fam = replace(fam, lengths=(limit, limit + 1), window=limit)
    return fam


def _parameters(fam: Family) -> int:
    """The family's tiny model's parameter count, built on the meta device (no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(fam.model_type, **{**BASE, **fam.overrides})
    with torch.device("meta"):  # eager: every family has it
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return sum(p.numel() for p in model.parameters())


def _ranks(rank: int, world: int, chosen: list[str]) -> dict:
    """Every family on this rank (the suite's _ring_family), too large ones left out."""
    torch.set_num_threads(1)
    out = {}
    curated = {f.label for f in FAMILIES}
    for fam in families(chosen):
        if fam.label in curated:
            out[fam.label] = _ring_family(fam)
            continue
        try:
            n = _parameters(fam)
        except Exception as err:  # noqa: BLE001 - reported as the reason it is not checked
            out[fam.label] = {"build": f"{type(err).__name__}: {' '.join(str(err).split())}"}
            continue
        if n > MAX_PARAMS:
            out[fam.label] = {"too large": n}
            continue
        out[fam.label] = _ring_family(fam)
    return out


@dataclass
class Row:
    family: str
    model_type: str
    verdict: str
    error: float | None = None
    note: str = ""


def verdict(fam: Family, per_rank: list[dict]) -> Row:
    """The suite's verdict for one family; a suite case must meet its expectation (_judge)."""
    if fam.label in {f.label for f in FAMILIES}:
        row = _judge(fam, per_rank)
        said = "exact" if row.verdict == "exact" else "refused at submit"
        return Row(fam.label, fam.model_type, said, row.error, row.note)
    return _auto_verdict(fam, per_rank)


def _auto_verdict(fam: Family, per_rank: list[dict]) -> Row:
    from ringctl.longdoc.model.compat import config_refusal

    first = per_rank[0]
    row = Row(fam.label, fam.model_type, "not checked")
    submit = config_refusal(_config_dict(fam))
    if submit:
        guard = _runtime_guard(first, fam) if "refusal" in first or "build" in first else ""
        return replace(row, verdict="refused at submit", note=_after_type(submit) + guard)
    if "too large" in first:
        return replace(row, note=_too_large(fam, first["too large"]))
    if "build" in first:
        return replace(row, note=f"no tiny random one could be built: {_short(first['build'])}")
    if first["refusal"]:
        return replace(row, verdict="refused on load", note=_after_type(first["refusal"]))
    probe_error = first["probe"][0]
    if "the model itself cannot run" in probe_error:
        detail = probe_error.split("fails without ringattn ", 1)[-1].split("); its config")[0]
        note = f"transformers' own forward pass fails on the tiny config {detail})"
        return replace(row, note=_short(note))
    if probe_error:
        return replace(row, verdict="refused by the probe", note=_after_type(probe_error))
    try:
        judged = _judge(fam, per_rank)
    except AssertionError as err:  # the probe accepted what the documents show wrong
        return replace(row, verdict="WRONG", note=_short(str(err)))
    return replace(row, verdict="exact", error=judged.error, note=judged.note)


def _too_large(fam: Family, size: int) -> str:
    """Why a family's tiny model is not tiny; where it wraps a language model, which row."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    subs = getattr(CONFIG_MAPPING[fam.model_type], "sub_configs", None) or {}
    text = getattr(subs.get("text_config"), "model_type", "")
    note = f"its tiny config still has {size:,} parameters"
    if subs:
        note += f" (its sub-configs {', '.join(sorted(subs))} keep their default sizes)"
    if text and text != fam.model_type:
        note += f"; its language model is the row {text}"
    return note


def _config_dict(fam: Family) -> dict:
    try:
        return build_config_dict(fam)
    except Exception:  # noqa: BLE001 - the name alone is what the submit check reads then
        return {"model_type": fam.model_type}


def _short(text: str, limit: int = 240) -> str:
    text = " ".join(text.split()).replace("|", "\\|")  # a literal | in a table cell
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _after_type(text: str) -> str:
    """A refusal without its leading "model type 'x': " (the row names the type)."""
    text = text.removeprefix("refused on the probe: ")
    head, _, rest = text.partition(": ")
    return _short(rest if head.startswith("model type ") else text)


def write_page(rows: list[Row], path: Path, seconds: float) -> None:
    import transformers

    counts = {v: sum(r.verdict == v for r in rows) for v in dict.fromkeys(r.verdict for r in rows)}
    lines = [
        "# Models the long-document job supports",
        "",
        "Generated by `python -m tests.supported_models`",
        f"(transformers {transformers.__version__}, torch {torch.__version__.split('+')[0]}, "
        f"{seconds / 60:.0f} min on 2 CPU ranks): the compatibility suite",
        "(`tests/test_longdoc_compat.py`) on its own cases, then on a tiny random-initialised",
        "model of every other causal-LM family this transformers ships. Each is scored on a",
        "2-rank ring (gloo, float32, zigzag shards unless said) and compared per token with the",
        "model's own forward pass in one process (stock sdpa, or eager where the family has no",
        f"sdpa). *exact*: max |log p(ring) − log p(model)| ≤ {TOL:g} on every document listed and",
        "the job's probe accepts it; *refused*: the job refuses it by name, at submit (from",
        "`config.json`), when the ranks load it, or by the probe before any document is scored;",
        "*not checked*: the suite could not build a tiny one (the reason is given).",
        "",
        "Counts: " + ", ".join(f"{v} {n}" for v, n in counts.items()) + ".",
        "",
        "| family | model type | verdict | max error | notes |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        err = f"{r.error:.1e}" if r.error is not None else "—"
        lines.append(f"| {r.family} | {r.model_type} | {r.verdict} | {err} | {r.note} |")
    path.write_text("\n".join(lines) + "\n")


def page_labels(path: Path = PAGE) -> list[str]:
    """The family column of a written page."""
    rows = [line for line in path.read_text().splitlines() if line.startswith("| ")]
    return [line.split(" | ")[0].removeprefix("| ") for line in rows[1:]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.supported_models")
    parser.add_argument("--out", type=Path, default=PAGE)
    parser.add_argument("--only", nargs="+", help="these families, printed (no page)")
    args = parser.parse_args(argv)
    chosen = args.only or labels()
    start = time.monotonic()
    per_rank = run_distributed(_ranks, 2, chosen)
    rows = [verdict(f, [r[f.label] for r in per_rank]) for f in families(chosen)]
    for r in rows:
        print(f"{r.family}: {r.verdict} {r.note}")
    wrong = [r for r in rows if r.verdict == "WRONG"]
    if wrong:
        print(
            f"{len(wrong)} families give other numbers than the model's own and the probe "
            f"accepts them: {', '.join(r.family for r in wrong)}",
            file=sys.stderr,
        )
        return 1
    if not args.only:
        write_page(rows, args.out, time.monotonic() - start)
        print(f"wrote {args.out} ({len(rows)} families)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
