"""Short documents packed into one ring sequence (ringctl/longdoc/compute/packing.py) give
what each gives alone: 2 real gloo ranks, score and embed, a plain Llama, a windowed Mistral
(its window inside each document) and gpt-oss (sinks, a window), against the same job one
document at a time and each document through the model's own forward in one process
(per-token log-probabilities within 2e-5, the compatibility suite's bound); gather verifies
each rank's rows against its pack's layout and refuses a tampered packing record; a model whose
RoPE scales with the sequence's length, and mode grad, run one document per sequence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ringctl.longdoc.output.gather import GatherError, gather
from tests.distributed import run_distributed
from tests.longdoc_reference import TINY, rel_err
from tests.test_longdoc_compat import TOL

TEXTS = {
    "a.txt": b"short",
    "b.txt": b"x",
    "c.txt": b"",
    "d.txt": b"a little longer text " * 3,
    "e.txt": b"tiny!",
    "f.txt": b"q" * 37,
    "g.txt": b"The tide turns twice a day. " * 10,
}
MODELS = {
    "llama": dict(model_type="llama"),
    "mistral": dict(model_type="mistral", sliding_window=16),
    "gpt_oss": dict(
        model_type="gpt_oss",
        sliding_window=24,
        head_dim=16,
        num_local_experts=2,
        num_experts_per_tok=1,
        intermediate_size=64,
    ),
    "dynamic": dict(model_type="llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
}


def _config(base: Path, name: str) -> str:
    fields = {k: v for k, v in TINY.items() if k not in MODELS[name]}
    path = base / f"{name}.json"
    path.write_text(json.dumps({**fields, **MODELS[name], "_ringctl_seed": 3}))
    return str(path)


def _ranks(rank: int, world: int, base: str, inputs: str, runs: list) -> dict:
    from ringctl.longdoc.run import LongDocOptions, run_longdoc
    from ringctl.longdoc.schedule import RingOptions

    out = {}
    for name, mode, model, budget in runs:
        s = run_longdoc(
            {"mode": mode, "inputs": [inputs], "chunk_size": 16, "model_path": model},
            rank,
            world,
            None,
            Path(base) / name / "out",
            lambda m: None,
            LongDocOptions(rings=RingOptions(size=2, max_tokens_per_rank=budget)),
        )
        out[name] = (s.done, s.tokens)
    return out


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    base = tmp_path_factory.mktemp("packing")
    (base / "in").mkdir()
    for name, data in TEXTS.items():
        (base / "in" / name).write_bytes(data)
    runs = []
    for model in MODELS:
        path = _config(base, model)
        runs += [(f"{model}-one", "score", path, None), (f"{model}-packed", "score", path, 400)]
    path = _config(base, "llama")
    runs += [("embed-one", "embed", path, None), ("embed-packed", "embed", path, 400)]
    runs += [("grad-budget", "grad", path, 400)]
    return base, run_distributed(_ranks, 2, str(base), str(base / "in"), runs)


def _entries(base: Path, name: str) -> dict:
    found = {}
    for entry in (base / name / "out" / "longdoc" / "shards").glob("*/rank-00000.json"):
        e = json.loads(entry.read_text())
        found[e["doc_id"]] = e
    return found


def _docs(base: Path, name: str) -> dict:
    out = gather(base / name, base / f"{name}-g", force=True).out
    found = {}
    for path in (out / "docs").glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as fh:
            found[fh.metadata()["doc_id"]] = load_file(str(path))
    return found


@pytest.mark.parametrize("model", ["llama", "mistral", "gpt_oss"])
def test_packed_equals_one_at_a_time_and_the_model(jobs, model):
    from transformers import AutoConfig

    from ringctl.longdoc.model.load import build_random

    base, results = jobs
    assert {r[f"{model}-packed"] for r in results} == {(len(TEXTS), sum(map(len, TEXTS.values())))}
    entries = _entries(base, f"{model}-packed")
    packed_docs = [e for e in entries.values() if "packing" in e]
    assert len(packed_docs) >= 4 and all(len(e["packing"]["cu_seqlens"]) > 2 for e in packed_docs)
    one, packed = _docs(base, f"{model}-one"), _docs(base, f"{model}-packed")
    fields = {k: v for k, v in TINY.items() if k not in MODELS[model]}
    config = AutoConfig.for_model(**{**fields, **MODELS[model]})
    attn = "eager" if model == "gpt_oss" else "sdpa"
    ref = build_random(config, seed=3, dtype=torch.float32, attn_implementation=attn).eval()
    for doc, t in packed.items():
        ids = t["input_ids"].long()
        assert torch.equal(ids, one[doc]["input_ids"].long())
        if ids.numel() < 2:
            continue
        with torch.no_grad():
            logits = ref(input_ids=ids[None], use_cache=False).logits[0].double()
        want = logits.log_softmax(-1)[:-1].gather(-1, ids[1:, None])[:, 0]
        got = t["token_logprob"].double()
        assert (got - want).abs().max() <= TOL, doc
        assert rel_err(got, one[doc]["token_logprob"]) < 1e-5, doc


def test_embed_packed_equals_one_at_a_time(jobs):
    base, _ = jobs
    one, packed = _docs(base, "embed-one"), _docs(base, "embed-packed")
    for doc, t in packed.items():
        if t["input_ids"].numel():
            assert rel_err(t["hidden"].float(), one[doc]["hidden"].float()) < 1e-5, doc
            assert rel_err(t["pooled"], one[doc]["pooled"]) < 1e-5, doc


def test_what_must_not_pack_runs_one_document_per_sequence(jobs):
    base, _ = jobs
    for name in ("dynamic-packed", "grad-budget"):
        assert not any("packing" in e for e in _entries(base, name).values()), name


def test_a_tampered_packing_record_is_refused_by_gather(jobs, tmp_path):
    import shutil

    base, _ = jobs
    job = tmp_path / "job"
    shutil.copytree(base / "llama-packed", job)
    entry = next(
        p
        for p in (job / "out" / "longdoc" / "shards").glob("*/rank-00001.json")
        if "packing" in json.loads(p.read_text())
    )
    e = json.loads(entry.read_text())
    e["packing"]["balance_window"] = 3  # another layout: the rows would be others'
    entry.write_text(json.dumps(e))
    with pytest.raises(GatherError) as err:
        gather(job, tmp_path / "out")
    assert "pack" in "\n".join(err.value.problems)


def test_a_packed_document_s_time_is_its_share_by_tokens(jobs):
    """Every document of a pack was given an equal share of its forward: a 29-token note and a
    7,860-token file each "took" 16.5 s. Each now gets its share by tokens."""
    base, _ = jobs
    entries = _entries(base, "llama-packed")
    packs: dict = {}
    for e in entries.values():
        if "packing" in e:
            packs.setdefault(tuple(e["packing"]["cu_seqlens"]), []).append(e)
    (cu, members), *_ = [(cu, m) for cu, m in packs.items() if len(m) > 1]
    total = sum(e["seconds"] for e in members)
    for e in members:
        share = e["n_tokens"] / cu[-1]
        assert abs(e["seconds"] - total * share) <= 1e-9 * max(total, 1), (e["doc_id"], share)
    assert len({e["n_tokens"] for e in members}) > 1  # documents of different lengths
