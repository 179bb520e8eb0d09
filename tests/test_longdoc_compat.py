"""Compatibility suite: every family the long-document job accepts gives the model's own numbers
on a 2-rank ring, and every family it cannot run exactly is refused, by name.

Models: tiny random-initialised configs built here (no download), seeded so that the ring's
ranks and the reference hold identical weights. Ring: 2 real gloo processes, zigzag shards
(one family also contiguous), scored by ``ringctl.longdoc.compute.scoring.run_task`` (what a job runs),
and each accepted family also through the job's probe. Reference: the model's own forward pass
(stock ``sdpa``; ``eager`` for models without sdpa) on the whole document in this process.

Cases beyond the plain families: length-dependent RoPE (Llama ``dynamic``, Phi-3 ``longrope``)
with documents longer than the RoPE threshold (64), then a shorter one (the cached frequencies
must not leak from one document to the next), then N=80, where one zigzag rank's highest
position (59) is below the threshold and the document is above it; sliding windows, applied in the
ring (documents as long as the window, one token longer, and several windows long: 301 tokens, so
zigzag shards of 151 hold more than two windows); Llama 4's chunked attention and temperature
tuning (a document at the limit is exact, one token more is refused, naming the limit); logit-scaled heads (Cohere
``logit_scale``, Granite ``logits_scaling``, Gemma 2 final soft-capping); attention sinks
(gpt-oss) when ``ring_attention`` has ``sinks=``.

Tolerance: float32, max |log p(ring) - log p(reference)| <= 2e-5 per token (measured ~1e-6:
the ring merges softmax partials in another order; see tests/test_longdoc_equivalence.py).
The faults this suite was written against moved log-probabilities by 3e-3 to 2.7.

``python -m tests.supported_models`` runs this suite's verdict over every causal-LM family
transformers ships and writes docs/supported-models.md; a test here checks the page's families.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import pytest
import torch

from tests.distributed import run_distributed

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TOL = 2e-5
SEED = 11
BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "original_max_position_embeddings": 64,
    "short_factor": [1.0 + i / 8 for i in range(8)],
    "long_factor": [2.0 + i for i in range(8)],
}


@dataclass(frozen=True)
class Family:
    label: str
    model_type: str
    overrides: dict = field(default_factory=dict)
    lengths: tuple[int, ...] = (301,)
    refused: str | None = None  # a phrase the refusal must contain; None: exact
    window: int | None = None  # documents longer than this must be refused
    sliding: int | None = None  # the sliding window the ring applies (for the table)
    layout: str = "zigzag"


W = 64  # the sliding windows below
SLIDING = (W, W + 1, 301)  # at the window, one past it, several windows long
FAMILIES = [
    Family("llama", "llama"),
    Family("llama (contiguous shards)", "llama", layout="contiguous"),
    Family(
        "llama, dynamic RoPE (threshold 64)",
        "llama",
        dict(max_position_embeddings=64, rope_parameters=DYNAMIC),
        (301, 40, 80),
    ),
    Family(
        "phi3, longrope (threshold 64)",
        "phi3",
        dict(
            max_position_embeddings=512,
            original_max_position_embeddings=64,
            rope_parameters=LONGROPE,
        ),
        (301, 40, 80),
    ),
    Family("mistral", "mistral", dict(sliding_window=None)),
    Family(f"mistral, sliding window {W}", "mistral", dict(sliding_window=W), SLIDING, sliding=W),
    Family(
        f"mistral, sliding window {W} (contiguous shards)",
        "mistral",
        dict(sliding_window=W),
        SLIDING,
        sliding=W,
        layout="contiguous",
    ),
    Family(
        f"qwen2, sliding window {W}",
        "qwen2",
        dict(use_sliding_window=True, sliding_window=W, max_window_layers=0),
        SLIDING,
        sliding=W,
    ),
    Family("qwen2", "qwen2", dict(use_sliding_window=False)),
    Family("qwen3", "qwen3"),
    Family("qwen2_moe", "qwen2_moe"),
    Family("qwen3_moe", "qwen3_moe"),
    Family("mixtral", "mixtral"),
    Family("gemma", "gemma", dict(head_dim=16)),
    Family(
        f"gemma2, final softcap 2, no attention softcap, sliding window {W}",
        "gemma2",
        dict(
            head_dim=16, attn_logit_softcapping=None, final_logit_softcapping=2.0, sliding_window=W
        ),
        SLIDING,
        sliding=W,
    ),
    Family(
        f"gemma3_text, sliding window {W}",
        "gemma3_text",
        dict(head_dim=16, sliding_window=W),
        SLIDING,
        sliding=W,
    ),
    Family("cohere, logit_scale 0.5", "cohere", dict(logit_scale=0.5)),
    Family(
        f"cohere2, logit_scale 0.5, sliding window {W}",
        "cohere2",
        dict(logit_scale=0.5, sliding_window=W),
        SLIDING,
        sliding=W,
    ),
    Family("granite, logits_scaling 8", "granite", dict(logits_scaling=8.0)),
    Family("granitemoe, logits_scaling 8", "granitemoe", dict(logits_scaling=8.0)),
    Family("phi", "phi"),
    Family("phimoe", "phimoe"),
    Family("olmo2", "olmo2"),
    Family(f"olmo3, sliding window {W}", "olmo3", dict(sliding_window=W), SLIDING, sliding=W),
    Family("starcoder2", "starcoder2", dict(sliding_window=None)),
    Family("gpt2", "gpt2"),
    Family("gpt_neox", "gpt_neox"),
    Family("gptj", "gptj", dict(rotary_dim=8)),
    Family("stablelm", "stablelm"),
    Family("nemotron", "nemotron"),
    Family("opt", "opt"),
    Family(
        "llama4_text (chunked attention 64)",
        "llama4_text",
        dict(attention_chunk_size=W),
        (W, W + 1),
        window=W,
    ),
    Family(
        "llama4_text, NoPE layer, temperature tuning (floor 32)",
        "llama4_text",
        dict(attention_chunk_size=W, floor_scale=32, no_rope_layers=[1, 0]),
        (31, 32),
        window=31,
    ),
    Family(
        f"gpt_oss (sinks), sliding window {W}",
        "gpt_oss",
        dict(sliding_window=W),
        SLIDING,
        sliding=W,
    ),
    # refused: the phrase each refusal must contain
    Family("bloom (ALiBi)", "bloom", refused="'bloom'"),
    Family("mpt (ALiBi)", "mpt", refused="'mpt'"),
    Family("falcon", "falcon", refused="'falcon'"),
    Family(
        "gpt_neo", "gpt_neo", dict(attention_types=[[["global", "local"], 1]]), refused="'gpt_neo'"
    ),
    Family("mamba", "mamba", refused="'mamba'"),
    Family("jamba", "jamba", refused="'jamba'"),
    Family("lfm2", "lfm2", dict(layer_types=["conv", "full_attention"]), refused="'lfm2'"),
    Family("falcon_h1", "falcon_h1", refused="'falcon_h1'"),
    Family("qwen3_next", "qwen3_next", refused="'qwen3_next'"),
    Family(
        "gemma2, attention softcap 50",
        "gemma2",
        dict(head_dim=16),
        refused="attention-logit soft-capping",
    ),
    Family("deepseek_v3 (latent attention)", "deepseek_v3", refused="multi-head latent"),
]
BY_LABEL = {f.label: f for f in FAMILIES}


def _sinks_supported() -> bool:
    from ringattn.hf import supports_sinks

    return supports_sinks()


def _expected_refusal(fam: Family) -> str | None:
    if fam.model_type == "gpt_oss" and not _sinks_supported():
        return "sinks"
    return fam.refused


def build(fam: Family, attn_implementation: str):
    from transformers import AutoConfig

    from ringctl.longdoc.model.load import build_random

    if attn_implementation == "ringattn":
        from ringattn.hf import register

        register()
    config = AutoConfig.for_model(fam.model_type, **{**BASE, **fam.overrides})
    model = build_random(
        config, seed=SEED, dtype=torch.float32, attn_implementation=attn_implementation
    )
    return model.eval()


def document(n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(1000 + n))


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _ring_family(fam: Family) -> dict:
    """One family on this rank: the refusals, each document's shard, and the probe."""
    from ringctl.longdoc.compute.scoring import run_task
    from ringctl.longdoc.model.compat import model_refusal, sequence_mixing_refusal
    from ringctl.longdoc.probe import run_probe

    try:
        model = build(fam, "ringattn")
    except Exception as err:  # noqa: BLE001 - what transformers raises for some families
        return {"build": _error(err)}
    out: dict = {"refusal": model_refusal(model), "mixing": sequence_mixing_refusal(model)}
    for n in fam.lengths:
        try:
            with torch.no_grad():
                r = run_task(
                    "score", model, document(n), group=None, layout=fam.layout, chunk_size=64
                )
            out[n] = (r.tensors["positions"], r.tensors["token_logprob"])
        except Exception as err:  # noqa: BLE001 - refused families fail in their own ways
            out[n] = _error(err)
    if out["refusal"] is None:  # what the job would say first, also where documents fail
        try:
            probe = run_probe(
                model, group=None, layout=fam.layout, dtype_name="float32", chunk_size=64
            )
            out["probe"] = (probe.error, probe.measured)
        except Exception as err:  # noqa: BLE001 - a probe that crashes is a finding
            out["probe"] = (f"the probe crashed: {_error(err)}", float("nan"))
    return out


def _broken_probe() -> dict:
    """The probe on models that do not agree with themselves on the ring, and on bf16."""
    from ringctl.longdoc.probe import run_probe

    llama = BY_LABEL["llama"]
    out = {}
    model = build(llama, "ringattn")
    # A family whose forward post-processes its logits in a way the scorer does not know:
    # only the model's own forward pass (what the probe compares with) scales them.
    model.register_forward_hook(lambda mod, args, output: _scale_logits(output, 1.5))
    out["scaled head"] = run_probe(
        model, group=None, layout="zigzag", dtype_name="float32", chunk_size=64
    ).__dict__
    bloom = build(BY_LABEL["bloom (ALiBi)"], "ringattn")
    out["bypass"] = run_probe(
        bloom, group=None, layout="zigzag", dtype_name="float32", chunk_size=64
    ).__dict__
    half = build(llama, "ringattn").to(torch.bfloat16)
    out["bfloat16"] = run_probe(
        half, group=None, layout="zigzag", dtype_name="bfloat16", chunk_size=64
    ).__dict__
    for label, fam in PROBE_FAILURES.items():
        model = build(fam, "ringattn")
        probe = run_probe(model, group=None, layout="zigzag", dtype_name="float32", chunk_size=64)
        out[label] = probe.__dict__
    broken = build(llama, "ringattn")  # a fault only under ring attention: ringattn's, not its
    broken.model.layers[1].self_attn.register_forward_pre_hook(_fail_under_ringattn)
    probe = run_probe(broken, group=None, layout="zigzag", dtype_name="float32", chunk_size=64)
    out["ring error"] = probe.__dict__
    return out


# What a new user trips on in the probe (issue 21): tiny configs of each case.
MLA_EQUAL_HEADS = dict(
    qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, kv_lora_rank=16, q_lora_rank=None
)
PROBE_FAILURES = {
    # transformers' eager path fails (q/k/v shapes with 2 KV heads), sdpa runs it
    "deepseek_v2, eager fails": Family(
        "deepseek_v2", "deepseek_v2", dict(MLA_EQUAL_HEADS, first_k_dense_replace=2)
    ),
    # plain transformers refuses the config: its sliding-window mask needs a window
    "cohere2, no window": Family("cohere2", "cohere2", dict(sliding_window=None)),
    # its layers build their own (dynamic) attention mask
    "doge": Family("doge", "doge"),
}


def _fail_under_ringattn(module, args):
    if module.config._attn_implementation == "ringattn":
        raise RuntimeError("injected fault under ring attention")


def _scale_logits(output, factor: float):
    output.logits = output.logits * factor
    return output


def _ranks(rank: int, world: int, labels: list[str]) -> dict:
    out = {label: _ring_family(BY_LABEL[label]) for label in labels}
    out["probe checks"] = _broken_probe()
    return out


@pytest.fixture(scope="module")
def ring_results() -> list[dict]:
    """Every family and probe check on one spawned pair of ranks (process start-ups are the
    slow part: two, for the whole suite)."""
    return run_distributed(_ranks, 2, [f.label for f in FAMILIES])


def _reference(fam: Family, n: int) -> torch.Tensor:
    ids = document(n)
    try:
        model = build(fam, "sdpa")
    except ValueError:  # no sdpa for this architecture (gpt-oss)
        model = build(fam, "eager")
    with torch.no_grad():
        logits = model(input_ids=ids[None], use_cache=False).logits[0].float()
    return logits.log_softmax(-1)[:-1].gather(-1, ids[1:, None])[:, 0]


def _unshard(pieces, n: int) -> torch.Tensor:
    full = torch.full((n,), float("nan"))
    for positions, lp in pieces:
        full[positions] = lp
    return full


@dataclass
class Row:
    family: str
    verdict: str
    error: float | None = None
    note: str = ""


def _judge(fam: Family, per_rank: list[dict]) -> Row:
    """Check one family's results against its expectation; the row for the table."""
    first = per_rank[0]
    refusal = _expected_refusal(fam)
    if refusal is not None:
        from ringctl.longdoc.model.compat import config_refusal

        said = [first.get("build", "")] + [first.get("refusal") or ""]
        said += [first.get("mixing") or ""]
        said += [v for k, v in first.items() if isinstance(k, int) and isinstance(v, str)]
        submit = config_refusal(build_config_dict(fam))
        assert submit and refusal in submit, f"{fam.label}: not refused at submit: {submit}"
        runtime = [s for s in said if s]
        assert runtime, f"{fam.label}: the ring accepted a model it cannot run exactly"
        runtime_note = _runtime_guard(first, fam)
        return Row(fam.label, "refused", None, submit.split(": ", 1)[1] + runtime_note)
    assert first["refusal"] is None, f"{fam.label}: refused: {first['refusal']}"
    worst = 0.0
    for n in fam.lengths:
        if fam.window is not None and n > fam.window:
            for r in per_rank:
                assert isinstance(r[n], str) and f"limit {fam.window}" in r[n], (fam.label, r[n])
            continue
        got = [r[n] for r in per_rank]
        assert not any(isinstance(g, str) for g in got), f"{fam.label} N={n}: {got}"
        lp = _unshard(got, n)
        assert lp[-1].isnan()
        err = (lp[:-1].double() - _reference(fam, n).double()).abs().max().item()
        assert err <= TOL, f"{fam.label} N={n}: max error {err:.3g} > {TOL}"
        worst = max(worst, err)
    probe_error, probe_measured = first["probe"]
    assert probe_error == "" and probe_measured <= 1e-4, (fam.label, probe_error)
    note = "N=" + ", ".join(str(n) for n in fam.lengths if fam.window is None or n <= fam.window)
    if fam.window is not None:
        note += f"; N > {fam.window} refused, naming the limit"
    if fam.sliding is not None:
        note += f"; sliding window {fam.sliding} applied in the ring"
    if fam.model_type == "gpt_oss":
        note += "; sinks through ring_attention(sinks=)"
    return Row(fam.label, "exact", worst, note)


def _runtime_guard(first: dict, fam: Family) -> str:
    """Which guard besides the name list would catch this family on the ranks, for the page.

    Only guards: how a refused family fails when built or run with ringattn anyway (a KeyError,
    a forward that raises) is nothing a user meets, since the job refuses it by name first."""
    scored = [v for k, v in first.items() if isinstance(k, int)]
    if any(isinstance(v, str) and "BypassError" in v for v in scored):
        return " (also caught without the name list: attention calls counted)"
    if first.get("mixing"):
        return " (also caught without the name list: a sequence convolution)"
    return ""


def build_config_dict(fam: Family) -> dict:
    from transformers import AutoConfig

    config = AutoConfig.for_model(fam.model_type, **{**BASE, **fam.overrides})
    return config.to_dict()


def test_every_family_is_exact_or_refused_by_name(ring_results: list[dict]) -> None:
    rows = [_judge(f, [r[f.label] for r in ring_results]) for f in FAMILIES]
    print("\n" + json.dumps([r.__dict__ for r in rows], indent=1))


def test_the_supported_models_page_lists_the_suites_families() -> None:
    """docs/supported-models.md is written by `python -m tests.supported_models` (the suite's
    verdict on every causal-LM family transformers ships): its rows must be the suite's
    families for the installed transformers. Labels only: nothing is built or run."""
    import transformers

    from tests.supported_models import PAGE, labels, page_labels

    assert page_labels() == labels(), (
        f"{PAGE} does not list the suite's families for transformers "
        f"{transformers.__version__}: regenerate it with `python -m tests.supported_models`"
    )


def test_probe_refuses_a_model_that_disagrees_with_itself(ring_results: list[dict]) -> None:
    """A deliberately broken model (its own forward scales the logits by 1.5, which the
    scorer's head does not know) is refused on every rank, naming the type and the error."""
    for r in ring_results:
        scaled = r["probe checks"]["scaled head"]
        assert "does not agree with itself" in scaled["error"], scaled
        assert "model type 'llama'" in scaled["error"] and "tolerance 0.0001" in scaled["error"]
    measured = ring_results[0]["probe checks"]["scaled head"]["measured"]
    assert measured > 0.1, measured  # a real disagreement, far above the tolerance
    bypass = ring_results[0]["probe checks"]["bypass"]["error"]
    assert "'bloom'" in bypass and "ring attention ran in 0 of the model's 2 layers" in bypass


def test_probe_failures_say_whose_they_are(ring_results: list[dict]) -> None:
    """One line each, naming whose failure it is; the same verdict on every rank."""
    for r in ring_results:
        eager = r["probe checks"]["deepseek_v2, eager fails"]["error"]
        assert eager == "", eager  # the reference is sdpa's; eager's failure is not the model's
        own = r["probe checks"]["cohere2, no window"]["error"]
        assert own.startswith(
            "model type 'cohere2': the model itself cannot run: transformers' "
            "own forward pass fails without ringattn (sdpa: ValueError: "
        ), own
        assert "not ring attention, is at fault" in own and "\n" not in own
        doge = r["probe checks"]["doge"]["error"]
        assert "its layers build an attention mask of their own" in doge, doge
        assert "attention_mask=None" not in doge
        ring = r["probe checks"]["ring error"]["error"]
        assert ring == (
            "model type 'llama': scoring on the ring failed on the probe where transformers' "
            "own forward pass runs (RuntimeError: injected fault under ring attention): an error "
            "of ringctl's scorer or ringattn, not the model's"
        ), ring
    message = ring_results[0]["probe checks"]["deepseek_v2, eager fails"]["message"]
    assert "tolerance 0.0001; its noise unmeasured: only one stock attention runs" in message


def test_probe_accepts_bfloat16_within_its_tolerance(ring_results: list[dict]) -> None:
    half = ring_results[0]["probe checks"]["bfloat16"]
    assert half["error"] == "", half
    assert half["measured"] <= half["tolerance"], half
    print(f"bfloat16 probe: mean error {half['measured']:.3g}, tolerance {half['tolerance']:.3g}")


def test_sinks_are_exact(ring_results: list[dict]) -> None:
    if not _sinks_supported():
        pytest.skip(
            "ring_attention has no sinks= parameter yet: gpt-oss is refused (checked above)"
        )
    label = f"gpt_oss (sinks), sliding window {W}"
    row = _judge(BY_LABEL[label], [r[label] for r in ring_results])
    assert row.verdict == "exact"
