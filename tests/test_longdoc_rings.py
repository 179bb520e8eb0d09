"""Many rings in one job: W = 4 real gloo ranks, ring.size 1, 2, 4 and auto, give every
document what one unsharded process gives, and the schedule is what it says.

One spawn of 4 processes runs every job (run_longdoc, the same loop the worker runs): score
with ring.size null (one ring of 4, as 0.1), 1, 2 and auto (budget 200 tokens per rank), then
embed and grad under auto, and a resume of the auto job on rings of 2 after one document's
shards were deleted. The corpus mixes an empty and a one-token document with documents that fit
one rank, need a ring of 2, and need the whole job under the budget. References: the bundled
tiny Llama with stock sdpa attention on each whole document in this process; tolerances as in
test_longdoc_equivalence.py (float32: 1e-5 relative, gradients 1e-4).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ringctl.longdoc.output.gather import gather
from tests.distributed import run_distributed
from tests.longdoc_reference import reference, rel_err

# One pytest-xdist worker runs this file: its tests share the jobs of every ring size (a
# module fixture, 10-20 s), which a second worker would run again.
pytestmark = pytest.mark.xdist_group("longdoc_rings")

TOL, GRAD_TOL = 1e-5, 1e-4
BUDGET = 200  # tokens per rank: 1 rank holds <= 200, a ring of 2 <= 400, of 4 <= 800 (zigzag)
TEXTS = {  # bytes = tokens (the bundled byte model); the ring auto must choose
    "empty.txt": b"",
    "one.txt": b"x",
    "five.txt": b"ring!",
    "small.txt": bytes(range(32, 32 + 95)) + b"a" * 55,  # 150 -> 1 rank
    "pair.txt": b"The keeper writes the tide down. " * 9 + b"end",  # 300 -> a ring of 2
    "whole.txt": b"Zigzag chunks balance the causal ring. " * 17 + b"!" * 37,  # 700 -> 4
}
# The smallest ring that holds each is 1, 1, 1, 1, 2, 4; the scheduler's balance step (issue
# 20: the job's, no longer the planner's alone) moves small.txt and pair.txt, which alone
# outlast their phases and run faster on a ring of 4, up to it.
HOLDS = {"empty.txt": 1, "one.txt": 1, "five.txt": 1, "small.txt": 1, "pair.txt": 2, "whole.txt": 4}
WANT_RING = {**HOLDS, "small.txt": 4, "pair.txt": 4}
JOBS = {  # name -> (mode, ring options)
    "single": ("score", {}),
    "ones": ("score", {"size": 1}),
    "pairs": ("score", {"size": 2}),
    "auto": ("score", {"size": "auto", "max_tokens_per_rank": BUDGET}),
    "auto-embed": ("embed", {"size": "auto", "max_tokens_per_rank": BUDGET}),
    "auto-grad": ("grad", {"size": "auto", "max_tokens_per_rank": BUDGET}),
}


def _ranks(rank: int, world: int, base: str, inputs: str) -> dict:
    import torch.distributed as dist

    from ringctl.longdoc.run import LongDocOptions, run_longdoc
    from ringctl.longdoc.schedule import RingOptions

    out = {}
    for name, (mode, opts) in JOBS.items():
        params = {"mode": mode, "inputs": [inputs], "chunk_size": 64}
        if mode == "grad":
            params["write_grads"] = True
        job = Path(base) / name
        summary = run_longdoc(
            params,
            rank,
            world,
            None,
            job / "out",
            lambda m: None,
            LongDocOptions(rings=RingOptions(**opts), schedule_path=job / "schedule.json"),
        )
        out[name] = (summary.done, summary.skipped, summary.tokens)
    # resume the auto job on rings of 2 (its largest document then cannot run: refused by
    # name), then on the whole job after one document's shards vanish
    dist.barrier()
    auto_out = Path(base) / "auto" / "out" / "longdoc" / "shards"
    if rank == 0:
        from ringctl.longdoc.inputs.documents import doc_key

        shutil.rmtree(auto_out / doc_key("pair.txt"))
    dist.barrier()
    params = {"mode": "score", "inputs": [inputs], "chunk_size": 64}
    summary = run_longdoc(
        params,
        rank,
        world,
        None,
        Path(base) / "auto" / "out",
        lambda m: None,
        LongDocOptions(rings=RingOptions(size=4)),
    )
    out["resumed"] = (summary.done, summary.skipped, summary.tokens)
    try:
        run_longdoc(
            params,
            rank,
            world,
            None,
            Path(base) / "refused" / "out",
            lambda m: None,
            LongDocOptions(rings=RingOptions(size=2, max_tokens_per_rank=BUDGET)),
        )
        out["refused"] = ""
    except RuntimeError as err:
        out["refused"] = str(err)
    return out


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    base = tmp_path_factory.mktemp("rings")
    inputs = base / "in"
    inputs.mkdir()
    for name, data in TEXTS.items():
        (inputs / name).write_bytes(data)
    results = run_distributed(_ranks, 4, str(base), str(inputs))
    return base, results


@pytest.fixture(scope="module")
def model():
    from ringctl.longdoc.model.load import load_model

    return load_model(None, attn_implementation="sdpa")


def _gathered(base: Path, name: str) -> dict[str, dict]:
    result = gather(base / name, base / f"{name}-gathered", force=True)
    docs = {}
    for path in (result.out / "docs").glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as fh:
            doc_id = fh.metadata()["doc_id"]
        docs[doc_id] = load_file(str(path))
    return docs


@pytest.mark.parametrize("name", ["single", "ones", "pairs", "auto"])
def test_every_ring_size_gives_the_unsharded_model(jobs, model, name):
    base, results = jobs
    done = {r[name] for r in results}
    assert done == {(6, 0, sum(map(len, TEXTS.values())))}, done  # every document, counted once
    docs = _gathered(base, name)
    assert sorted(docs) == sorted(TEXTS)
    for doc, t in docs.items():
        want = torch.tensor(list(TEXTS[doc]), dtype=torch.int64)
        assert torch.equal(t["input_ids"], want), doc
        if len(want) < 2:
            assert t["token_logprob"].numel() == 0, doc
            continue
        err = rel_err(t["token_logprob"], reference(model, want)["token_logprob"])
        assert err < TOL, (name, doc, err)


def test_auto_puts_each_document_on_the_ring_the_scheduler_chose(jobs):
    from ringctl.scheduler import ring_for

    base, _ = jobs
    schedule = json.loads((base / "auto" / "schedule.json").read_text())
    rows = {r["doc_id"]: r for r in schedule["documents"]}
    assert {d: ring_for(len(t), [1, 2, 4], BUDGET, "zigzag") for d, t in TEXTS.items()} == HOLDS
    assert {d: r["ring_size"] for d, r in rows.items()} == WANT_RING
    assert sorted(r["index"] for r in schedule["documents"]) == list(range(len(TEXTS)))
    assert [p["ring_size"] for p in schedule["phases"]] == [4, 1]
    for r in rows.values():  # members: consecutive ranks of that ring
        size, ring = r["ring_size"], r["ring"]
        assert r["members"] == list(range(ring * size, (ring + 1) * size))
    shards = base / "auto" / "out" / "longdoc" / "shards"
    entry = json.loads(next(shards.glob("five.txt*/rank-00000.json")).read_text())
    assert entry["world_size"] == 1  # the shards record the ring that produced them
    assert not list(shards.glob("five.txt*/rank-00001.json"))
    single = json.loads((base / "single" / "schedule.json").read_text())
    assert [r["doc_id"] for r in sorted(single["documents"], key=lambda r: r["order"])] == [
        r["doc_id"] for r in sorted(single["documents"], key=lambda r: r["index"])
    ]  # one ring: input order, as before


def test_embed_and_grad_under_auto_equal_the_unsharded_model(jobs, model):
    base, _ = jobs
    embed = _gathered(base, "auto-embed")
    for doc, t in embed.items():
        want = torch.tensor(list(TEXTS[doc]), dtype=torch.int64)
        if len(want) == 0:
            continue
        assert rel_err(t["hidden"].float(), reference(model, want)["hidden"]) < TOL, doc
    grads = base / "auto-grad-gathered" / "grads"
    _gathered(base, "auto-grad")
    for doc in ("pair.txt", "whole.txt", "small.txt"):
        want = reference(model, torch.tensor(list(TEXTS[doc]), dtype=torch.int64))["grads"]
        got = load_file(str(next(grads.glob(f"{doc}*.safetensors"))))
        worst = max(rel_err(got[k], want[k]) for k in want if k in got)
        assert worst < GRAD_TOL, (doc, worst)


def test_resume_on_another_ring_size_redoes_only_the_missing_document(jobs, model):
    base, results = jobs
    assert {r["resumed"][:2] for r in results} == {(1, 5)}
    shards = base / "auto" / "out" / "longdoc" / "shards"
    entry = json.loads(next(shards.glob("pair.txt*/rank-00003.json")).read_text())
    assert entry["world_size"] == 4  # redone on the resumed job's ring of 4 (was a ring of 2)
    docs = _gathered(base, "auto")
    want = torch.tensor(list(TEXTS["pair.txt"]), dtype=torch.int64)
    assert rel_err(docs["pair.txt"]["token_logprob"], reference(model, want)["token_logprob"]) < TOL


def test_a_document_no_ring_holds_is_refused_by_name(jobs):
    _, results = jobs
    for r in results:
        assert "'whole.txt' has 700 tokens" in r["refused"], r["refused"]
        assert "needs a ring of at least 4 ranks" in r["refused"]


def test_a_missing_rank_of_a_ring_of_two_is_named_as_such(jobs, tmp_path):
    """(embed/grad review) With rank 0's shard of a document gone, its ring's size was read
    from rank 0's entry alone, so the job's (4): ranks 2 and 3 were said missing too and rank
    1's world_size 2 "expected 4". The ring's size comes from the entries that are there."""
    import shutil

    from ringctl.longdoc.inputs.documents import doc_key
    from ringctl.longdoc.output.gather import GatherError
    from ringctl.longdoc.output.names import OutputPaths

    base, _ = jobs
    copy = tmp_path / "pairs"
    shutil.copytree(base / "pairs", copy, symlinks=True)
    roots = [p.parent for p in copy.rglob("run.json")]
    assert len(roots) == 1
    paths = OutputPaths(roots[0])
    key = doc_key("pair.txt")
    for path in paths.entry_path(key, 0), paths.data_path(key, 0):
        path.unlink()
    with pytest.raises(GatherError) as err:
        gather(copy, tmp_path / "out", force=True)
    said = str(err.value)
    assert "rank 0's manifest entry" in said and "missing" in said, said
    assert "rank 2" not in said and "rank 3" not in said and "expected 4" not in said, said


def test_the_ring_size_of_a_document_is_read_from_the_entries_that_are_there(tmp_path, monkeypatch):
    """(second reading) Finding the ring's size looked up every rank's entry of a document
    with none written yet (a job of 1024 ranks: 13 s for 200 documents at status and
    resume). It lists the document's folder once and reads the entries there."""
    from ringctl.longdoc.inputs.documents import doc_key
    from ringctl.longdoc.output import completeness
    from ringctl.longdoc.output.names import OutputPaths

    looked = []
    real = completeness.shard_paths
    monkeypatch.setattr(completeness, "shard_paths", lambda *a: looked.append(a[2]) or real(*a))
    run = {"world_size": 4096}
    doc = {"id": "a.txt", "key": doc_key("a.txt")}
    assert completeness.ring_size_of(tmp_path, doc, run) == 4096 and looked == []
    folder = OutputPaths(tmp_path).doc_dir(doc["key"])
    folder.mkdir(parents=True)
    (folder / "rank-00003.json").write_text('{"world_size": 2}')  # not of a ring of 2
    (folder / "rank-00001.json").write_text('{"world_size": 2}')
    (folder / "notes.txt").write_text("")
    assert completeness.ring_size_of(tmp_path, doc, run) == 2 and looked == [1]


def test_an_entry_nested_too_deeply_is_a_reason_not_a_traceback(tmp_path):
    """(hostile-input review) A rank's entry of 200,000 nested '[' raised RecursionError out of
    the entry reader (it caught OSError and ValueError), which status, gather and a resume's
    ranks reach first through ring_size_of: a traceback. It is read as every output JSON file
    is (a regular file, bounded), and says why."""
    from ringctl.longdoc.inputs.documents import doc_key
    from ringctl.longdoc.output import completeness
    from ringctl.longdoc.output.names import OutputPaths

    doc = {"id": "a.txt", "key": doc_key("a.txt")}
    folder = OutputPaths(tmp_path).doc_dir(doc["key"])
    folder.mkdir(parents=True)
    entry = folder / "rank-00000.json"
    entry.write_text("[" * 200_000 + "]" * 200_000)
    assert completeness.ring_size_of(tmp_path, doc, {"world_size": 4}) == 4
    said = completeness._read_entry(entry, 0)
    assert said[0] is None and "nested too deeply" in said[1] and str(entry) in said[1], said
