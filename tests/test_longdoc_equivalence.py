"""P = 1, 2, 4 ranks with ring attention give what the unsharded model gives in one process.

Models: tiny random Llama, Qwen2 and Mistral with a sliding window of 16 (2 layers, hidden 64,
4 heads, 2 KV heads: GQA; Qwen2 adds q/k/v biases) built from a config with a fixed seed. Reference: the stock ``eager`` and
``sdpa`` attention on the whole document in one process (tests/longdoc_reference.py).
Documents: N = 0, 1, 5, 37 (not multiples of 2P: padded at the end) and 301 tokens.

Tolerances (float32 throughout). The ring merges per-block softmax partials in a different
order than one softmax over the whole row, and RoPE / matmuls run on shards of other shapes, so
results differ by rounding only: each op is within a few float32 ulps (~1e-7 relative) and two
layers plus the head compound that to ~1e-6 (measured: <= 1e-6 on log-probs and hidden states).
We assert a scale-free max error (max |x - ref| / max |ref|) below 1e-5 for log-probabilities
and hidden states, and below 1e-4 for gradients: each gradient is a sum over all tokens of the
document whose terms arrive from different ranks in a different order, and small gradient
entries lose relative precision by cancellation. A real bug (a wrong position, a lost shard
boundary, a missing mask) moves these by 1e-2 or more.

One spawn per P runs every model, document and task, to keep process start-ups (each imports
torch and transformers) to 1 + 2 + 4.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.longdoc_reference import build, document, reference, rel_err, unshard

LENGTHS = (0, 1, 5, 37, 301)
KINDS = ("llama", "qwen2", "mistral-window16")
TOL = 1e-5
GRAD_TOL = 1e-4


def _ranks(rank: int, world_size: int) -> dict:
    from ringctl.longdoc.compute.scoring import run_task

    out: dict = {}
    for kind in KINDS:
        model = build(kind, "ringattn")
        for n in LENGTHS:
            ids = document(n)
            for task in ("score", "embed", "grad"):
                r = run_task(
                    task, model, ids, group=None, layout="zigzag", chunk_size=16, keep_grads=True
                )
                out[kind, n, task] = (r.tensors, r.stats, r.grads)
        if world_size == 2:  # the contiguous layout too, on one document
            r = run_task("score", model, document(37), group=None, layout="contiguous")
            out[kind, 37, "contiguous"] = (r.tensors, r.stats, None)
        if world_size == 1:
            out[kind, "refusals"] = _refusals(model)
    return out


def _refusals(model) -> list[str]:
    """Masks that ring attention cannot honour are refused, an all-ones mask is accepted."""
    ids = document(8)[None]
    pos = torch.arange(8)[None]
    msgs = []
    for mask in (
        torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]]),
        torch.ones(1, 1, 8, 8, dtype=torch.bool),
    ):
        try:
            model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False)
            msgs.append("accepted")
        except ValueError as err:
            msgs.append(str(err))
    model(input_ids=ids, position_ids=pos, attention_mask=torch.ones(1, 8), use_cache=False)
    return msgs


@pytest.fixture(scope="module")
def references() -> dict:
    refs = {}
    for kind in KINDS:
        for impl in ("eager", "sdpa"):
            model = build(kind, impl)
            for n in LENGTHS:
                if n:
                    refs[kind, impl, n] = reference(model, document(n))
    return refs


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_sharded_equals_unsharded(world_size: int, references: dict) -> None:
    results = run_distributed(_ranks, world_size)
    for kind in KINDS:
        for n in LENGTHS:
            for impl in ("eager", "sdpa"):
                where = f"{kind} N={n} P={world_size} vs {impl}"
                score = [r[kind, n, "score"][0] for r in results]
                stats = results[0][kind, n, "score"][1]
                assert stats["n_tokens"] == n and stats["n_scored"] == max(n - 1, 0)
                if n == 0:
                    assert all(t["token_logprob"].numel() == 0 for t in score)
                    assert stats["log_likelihood"] == 0.0 and stats["perplexity"] is None
                    emb = results[0][kind, n, "embed"][0]
                    assert emb["hidden"].shape == (0, 64) and emb["pooled"].isnan().all()
                    grad = results[0][kind, n, "grad"]
                    assert grad[1]["loss"] is None and grad[1]["grad_norm"] == 0.0
                    continue
                ref = references[kind, impl, n]
                lp = unshard(score, "token_logprob", n)
                assert lp[-1].isnan()  # the last token has no next token
                assert rel_err(lp[:-1], ref["token_logprob"]) < TOL, where
                ll = ref["token_logprob"].double().sum().item()
                assert stats["log_likelihood"] == pytest.approx(ll, rel=TOL, abs=TOL), where
                ids = unshard(score, "input_ids", n)
                assert torch.equal(ids.long(), document(n)), where

                hidden = unshard([r[kind, n, "embed"][0] for r in results], "hidden", n)
                assert rel_err(hidden, ref["hidden"]) < TOL, where
                pooled = results[0][kind, n, "embed"][0]["pooled"]
                assert rel_err(pooled, ref["hidden"].mean(0)) < TOL, where
                assert all("pooled" not in r[kind, n, "embed"][0] for r in results[1:])

                for r in results:  # every rank ends with the whole document's gradient
                    _, gstats, grads = r[kind, n, "grad"]
                    if n == 1:
                        assert gstats["loss"] is None
                        assert all(not g.any() for g in grads.values())
                        continue
                    assert gstats["loss"] == pytest.approx(ref["loss"].item(), rel=TOL), where
                    for name, g in ref["grads"].items():
                        assert rel_err(grads[name], g) < GRAD_TOL, f"{where} grad {name}"
                    norm = torch.cat([g.flatten() for g in ref["grads"].values()]).norm().item()
                    assert gstats["grad_norm"] == pytest.approx(norm, rel=GRAD_TOL), where
                    assert set(gstats["grad_norms"]) >= {
                        "model.embed_tokens",
                        "model.layers.0.self_attn",
                        "model.layers.1.mlp",
                        "model.norm",
                        "lm_head",
                    }
        if world_size == 2:
            ref = references[kind, "eager", 37]
            lp = unshard([r[kind, 37, "contiguous"][0] for r in results], "token_logprob", 37)
            assert rel_err(lp[:-1], ref["token_logprob"]) < TOL
        if world_size == 1:
            padding, four_d = results[0][kind, "refusals"]
            assert "padding attention_mask" in padding
            assert "attention mask reached the attention layer" in four_d
