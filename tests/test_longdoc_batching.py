"""Short documents batched on a ring (rows right-padded to one length) give what each gives
alone: 2 real gloo ranks, score and embed, against one-at-a-time and one unsharded process;
gather verifies shards cut from a batch's padding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file

from ringctl.longdoc.output.gather import gather
from tests.distributed import run_distributed
from tests.longdoc_reference import reference, rel_err

TEXTS = {
    "a.txt": b"short",
    "b.txt": b"x",
    "c.txt": b"",
    "d.txt": b"a little longer text " * 3,
    "e.txt": b"tiny!",
    "f.txt": b"q" * 37,
    "g.txt": b"The tide turns twice a day. " * 10,
}


def _ranks(rank: int, world: int, base: str, inputs: str) -> dict:
    from ringctl.longdoc.run import run_longdoc
    from ringctl.longdoc.schedule import RingOptions

    out = {}
    for name, mode, budget in (
        ("one", "score", None),
        ("batched", "score", 400),
        ("embed-one", "embed", None),
        ("embed-batched", "embed", 400),
    ):
        s = run_longdoc(
            {"mode": mode, "inputs": [inputs], "chunk_size": 16},
            rank,
            world,
            None,
            Path(base) / name / "out",
            lambda m: None,
            rings=RingOptions(size=2, max_tokens_per_rank=budget),
        )
        out[name] = (s.done, s.tokens)
    return out


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    base = tmp_path_factory.mktemp("batching")
    (base / "in").mkdir()
    for name, data in TEXTS.items():
        (base / "in" / name).write_bytes(data)
    return base, run_distributed(_ranks, 2, str(base), str(base / "in"))


def _docs(base: Path, name: str) -> dict:
    out = gather(base / name, base / f"{name}-g", force=True).out
    found = {}
    for path in (out / "docs").glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as fh:
            found[fh.metadata()["doc_id"]] = load_file(str(path))
    return found


def test_batches_were_formed_and_every_document_counted(jobs):
    base, results = jobs
    assert {r["batched"] for r in results} == {(len(TEXTS), sum(map(len, TEXTS.values())))}
    padded = {}
    for entry in (base / "batched" / "out" / "longdoc" / "shards").glob("*/rank-00000.json"):
        e = json.loads(entry.read_text())
        padded[e["doc_id"]] = (e["n_tokens"], e["padded_tokens"])
    # a.txt (5 tokens) shares a batch with longer rows: its shards follow their padding
    assert padded["a.txt"][1] > 8, padded


def test_batched_equals_one_at_a_time_and_the_model(jobs):
    from ringctl.longdoc.model.load import load_model

    base, _ = jobs
    model = load_model(None, attn_implementation="sdpa")
    one, batched = _docs(base, "one"), _docs(base, "batched")
    assert sorted(one) == sorted(batched) == sorted(TEXTS)
    for doc, t in batched.items():
        assert (t["input_ids"] == one[doc]["input_ids"]).all()
        if t["input_ids"].numel() >= 2:
            assert rel_err(t["token_logprob"], one[doc]["token_logprob"]) < 1e-5, doc
            want = reference(model, t["input_ids"].long())["token_logprob"]
            assert rel_err(t["token_logprob"], want) < 1e-5, doc
    e_one, e_batched = _docs(base, "embed-one"), _docs(base, "embed-batched")
    for doc, t in e_batched.items():
        if t["input_ids"].numel():
            assert rel_err(t["hidden"].float(), e_one[doc]["hidden"].float()) < 1e-5, doc
            assert rel_err(t["pooled"], e_one[doc]["pooled"]) < 1e-5, doc


def test_batches_respect_the_budget():
    from ringctl.longdoc.compute.batching import batches

    got = batches([5, 1, 0, 37, 5, 300, 60], ring_size=2, layout="zigzag", budget=100)
    assert got == [[0, 1], [2], [3, 4], [5], [6]]
    for run in got:
        lengths = [[5, 1, 0, 37, 5, 300, 60][i] for i in run]
        if len(run) > 1:
            width = -(-max(lengths) // 4) * 4
            assert len(run) * width // 2 <= 100
