"""The whole long-document path on 2 gloo ranks, then `ringctl gather` on what it wrote.

One spawn (2 processes) runs every job the tests below look at: score with the bundled tiny
Llama (with a rerun that must skip everything, and one after deleting one rank's entry that must
redo exactly that document), grad with a tiny Qwen2 saved to a local directory (write_grads),
embed, on_missing=stop, a stop request, and a rerun with other settings. The gathered results
are compared with the unsharded model in this process (stock eager / sdpa attention); the
tolerances are those of test_longdoc_equivalence.py (float32: 1e-5, gradients 1e-4).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ringctl.errors import UserError
from ringctl.gather import GATHER_FAILED_EXIT, gather
from tests.distributed import run_distributed
from tests.longdoc_reference import build, reference, rel_err

TOL, GRAD_TOL = 1e-5, 1e-4
LONG = "The tide turns twice a day; the keeper writes it down. " * 6  # 330 bytes


def _make_inputs(base: Path) -> list[str]:
    d = base / "in"
    d.mkdir(parents=True)
    (d / "latin1.txt").write_bytes("Café, crème, señor: £3 ½. ".encode("latin-1") * 5)
    (d / "one.txt").write_bytes(b"x")
    records = [{"text": LONG}, {"text": ""}, {"text": "short record, 29 bytes long.."}]
    (d / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return [str(d / "latin1.txt"), str(d / "gone.txt"), str(d / "one.txt"), str(d / "docs.jsonl")]


def _jobs(rank: int, world: int, base: str, inputs: list[str], qwen_dir: str) -> dict:
    import torch.distributed as dist

    from ringctl.longdoc.documents import doc_key
    from ringctl.longdoc.run import run_longdoc

    base_p = Path(base)
    lines: list[str] = []
    res: dict = {"lines": lines}

    def run(params: dict, out: str, **kw):
        return run_longdoc(params, rank, world, None, base_p / out, lines.append, **kw)

    score = {"inputs": inputs, "chunk_size": 7}
    res["first"] = run(score, "score/out")
    res["again"] = run(score, "score/out")
    dist.barrier()
    if rank == 0:  # as if rank 1 died before writing its entry for one document
        entry = base_p / "score/out/longdoc/shards" / doc_key("docs.jsonl#1") / "rank-00001.json"
        entry.unlink()
    dist.barrier()
    res["resumed"] = run(score, "score/out")
    for bad, out in (
        (dict(score, on_missing="stop"), "stop"),
        (dict(score, task="embed"), "score/out"),
    ):
        try:
            run(bad, out)
            res.setdefault("errors", []).append(None)
        except RuntimeError as err:
            res.setdefault("errors", []).append(str(err))
    res["stopped"] = run(score, "halted", should_stop=lambda: rank == 1)
    res["grad"] = run(
        {"inputs": inputs, "task": "grad", "write_grads": True, "model_path": qwen_dir},
        "grad/out",
    )
    res["embed"] = run({"inputs": inputs, "task": "embed"}, "embed/out")
    return res


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("longdoc")
    inputs = _make_inputs(base)
    build("qwen2", "eager").save_pretrained(base / "qwen2")
    results = run_distributed(_jobs, 2, str(base), inputs, str(base / "qwen2"))
    return {"base": base, "results": results, "inputs": inputs}


def _cli(argv: list[str]) -> int:
    """`ringctl gather ...` as ringctl.cli.main runs a verb (UserError -> its exit code)."""
    from ringctl.commands import gather as verb

    parser = argparse.ArgumentParser(prog="ringctl")
    verb.register(parser.add_subparsers(dest="verb"))
    args = parser.parse_args(["gather", *argv])
    try:
        return int(args.func(args) or 0)
    except UserError as err:
        print(f"ringctl gather: error: {err}", file=sys.stderr)
        return err.exit_code


DOC_IDS = ["latin1.txt", "one.txt", "docs.jsonl#1", "docs.jsonl#2", "docs.jsonl#3"]


def test_runs_resume_and_policies(jobs: dict) -> None:
    r0, r1 = jobs["results"]
    for r in (r0, r1):
        assert (r["first"].done, r["first"].skipped, r["first"].total) == (5, 0, 5)
        assert r["first"].missing == [jobs["inputs"][1]]
        assert (r["again"].done, r["again"].skipped) == (0, 5)  # rerun: all complete
        assert (r["resumed"].done, r["resumed"].skipped) == (1, 4)  # only the broken one
        stop_err, mismatch_err = r["errors"]
        assert "gone.txt" in stop_err and "on_missing=stop" in stop_err
        assert (
            "different run" in mismatch_err and "task: 'score' there, 'embed' now" in mismatch_err
        )
        assert r["stopped"].stopped and r["stopped"].done == 0
    lines = r0["lines"]
    per_doc = [ln for ln in lines if ln.startswith("doc ")]
    assert len(per_doc) == 5 + 1 + 5 + 5  # first, resumed, grad, embed
    assert all("tokens/s" in ln and "ETA" in ln for ln in per_doc)
    assert any("missing input" in ln and "gone.txt" in ln for ln in lines)
    assert not any(ln.startswith("doc ") for ln in r1["lines"])  # one line per doc: rank 0


def test_gather_score_equals_single_process(jobs: dict, capsys) -> None:
    job = jobs["base"] / "score"
    assert _cli([str(job)]) == 0
    shown = capsys.readouterr().out
    assert "perplexity" in shown and "latin1.txt" in shown and "gone.txt" in shown
    out = job / "gathered"
    summary = json.loads((out / "summary.json").read_text())
    rows = {row["document"]: row for row in summary["documents"]}
    assert list(rows) == DOC_IDS and summary["missing_inputs"] == [jobs["inputs"][1]]
    assert (out / "summary.csv").read_text().splitlines()[0].startswith("document,tokens,")
    from ringctl.longdoc.model import load_model

    model = load_model(None, attn_implementation="eager")
    raw = {
        "latin1.txt": "Café, crème, señor: £3 ½. ".encode("latin-1") * 5,
        "one.txt": b"x",
        "docs.jsonl#1": LONG.encode(),
        "docs.jsonl#2": b"",
        "docs.jsonl#3": b"short record, 29 bytes long..",
    }
    for doc_id, data in raw.items():
        t = load_file(out / rows[doc_id]["file"])
        ids = torch.tensor(list(data), dtype=torch.int64)
        assert torch.equal(t["input_ids"], ids) and rows[doc_id]["tokens"] == len(data)
        assert t["token_logprob"].shape == (max(len(data) - 1, 0),)
        if len(data) < 2:
            assert rows[doc_id]["perplexity"] is None
            continue
        ref = reference(model, ids)["token_logprob"]
        assert rel_err(t["token_logprob"], ref) < TOL, doc_id
        ll = ref.double().sum().item()
        assert rows[doc_id]["log_likelihood"] == pytest.approx(ll, rel=TOL)
        assert rows[doc_id]["perplexity"] == pytest.approx(
            torch.exp(-ref.double().mean()).item(), rel=TOL
        )


def test_gather_grad_and_embed(jobs: dict, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    qwen = AutoModelForCausalLM.from_pretrained(jobs["base"] / "qwen2", attn_implementation="sdpa")
    result = gather(jobs["base"] / "grad", tmp_path / "grad")
    row = next(r for r in result.rows if r["document"] == "docs.jsonl#1")
    ids = torch.tensor(list(LONG.encode()))
    ref = reference(qwen, ids)
    assert row["loss"] == pytest.approx(ref["loss"].item(), rel=TOL)
    t = load_file(tmp_path / "grad" / row["file"])
    assert rel_err(t["token_logprob"], ref["token_logprob"]) < TOL
    grads = load_file(tmp_path / "grad" / "grads" / Path(row["file"]).name)
    for name, g in ref["grads"].items():
        assert rel_err(grads[name], g) < GRAD_TOL, name
    one = next(r for r in result.rows if r["document"] == "one.txt")
    assert one["loss"] is None and one["grad_norm"] == 0.0

    from ringctl.longdoc.model import load_model

    llama = load_model(None, attn_implementation="sdpa")
    result = gather(jobs["base"] / "embed", tmp_path / "embed")
    for row in result.rows:
        t = load_file(tmp_path / "embed" / row["file"])
        if row["document"] == "docs.jsonl#2":
            assert t["hidden"].shape == (0, 64) and t["pooled"].isnan().all()
            continue
        ref = reference(llama, t["input_ids"])
        assert rel_err(t["hidden"], ref["hidden"]) < TOL
        assert rel_err(t["pooled"], ref["hidden"].mean(0)) < TOL


def _copy_job(jobs: dict, tmp_path: Path) -> tuple[Path, Path]:
    job = tmp_path / "job"
    shutil.copytree(jobs["base"] / "score" / "out", job / "out")
    shards = job / "out" / "longdoc" / "shards"
    return job, shards


def _nothing_written(job: Path) -> bool:
    return not (job / "gathered").exists() and not list(job.glob(".gathered*"))


def test_tampered_shard_is_refused_by_name(jobs: dict, tmp_path: Path, capsys) -> None:
    from ringctl.longdoc.documents import doc_key

    job, shards = _copy_job(jobs, tmp_path)
    victim = shards / doc_key("docs.jsonl#1") / "rank-00001.safetensors"
    blob = bytearray(victim.read_bytes())
    blob[len(blob) // 2] ^= 0x01  # flip one bit in the tensor data
    victim.write_bytes(bytes(blob))
    assert _cli([str(job)]) == GATHER_FAILED_EXIT == 3
    err = capsys.readouterr().err
    assert str(victim) in err and "checksum" in err
    assert _nothing_written(job)


def test_missing_shards_are_named(jobs: dict, tmp_path: Path, capsys) -> None:
    from ringctl.longdoc.documents import doc_key

    job, shards = _copy_job(jobs, tmp_path)
    data = shards / doc_key("latin1.txt") / "rank-00000.safetensors"
    entry = shards / doc_key("docs.jsonl#3") / "rank-00001.json"
    data.unlink()
    entry.unlink()
    shutil.rmtree(shards / doc_key("one.txt"))
    assert _cli([str(job), "-o", str(job / "gathered")]) == 3
    err = capsys.readouterr().err
    assert str(data) in err and str(entry) in err and "'one.txt': no shards at all" in err
    assert "3 problem(s)" in err
    assert _nothing_written(job)


def test_swapped_shards_fail_coverage(jobs: dict, tmp_path: Path, capsys) -> None:
    from ringctl.longdoc.documents import doc_key

    job, shards = _copy_job(jobs, tmp_path)
    d = shards / doc_key("docs.jsonl#1")
    # rank 1's file (its checksum intact) also placed as rank 0's
    shutil.copyfile(d / "rank-00001.safetensors", d / "rank-00000.safetensors")
    entry = json.loads((d / "rank-00001.json").read_text())
    entry["rank"] = 0
    (d / "rank-00000.json").write_text(json.dumps(entry))
    assert _cli([str(job)]) == 3
    err = capsys.readouterr().err
    assert "covered more than once" in err or "rank 0 of the zigzag layout holds" in err
    assert _nothing_written(job)


def test_usage_errors(jobs: dict, tmp_path: Path, capsys) -> None:
    assert _cli([str(tmp_path / "nope")]) == 2
    assert _cli(["login.example.org:/scratch/job"]) == 2
    assert "remote job directories" in capsys.readouterr().err
    job, _ = _copy_job(jobs, tmp_path)
    (job / "gathered").mkdir()
    assert _cli([str(job)]) == 2 and "--force" in capsys.readouterr().err
    assert _cli([str(job), "--force"]) == 0
    assert (job / "gathered" / "summary.json").is_file()
