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
import math
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ringctl.errors import UserError
from ringctl.longdoc.output.gather import GATHER_FAILED_EXIT, GatherError, gather
from tests.distributed import run_distributed
from tests.longdoc_reference import build, reference, rel_err

TOL, GRAD_TOL = 1e-5, 1e-4
REPO = Path(__file__).resolve().parents[1]
LONG = "The tide turns twice a day; the keeper writes it down. " * 6  # 330 bytes


def _make_inputs(base: Path) -> list[str]:
    d = base / "in"
    d.mkdir(parents=True)
    (d / "latin1.txt").write_bytes("Café, crème, señor: £3 ½. ".encode("latin-1") * 5)
    (d / "one.txt").write_bytes(b"x")
    records = [{"text": LONG}, {"text": ""}, {"text": "short record, 29 bytes long.."}]
    (d / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return [str(d / "latin1.txt"), str(d / "gone.txt"), str(d / "one.txt"), str(d / "docs.jsonl")]


def _make_markup_inputs(base: Path) -> list[str]:
    """Ids that are rich markup: `a[/b].txt` (a closing tag: rich raises) and `[bold]c.txt`."""
    d = base / "markup-in"
    (d / "a[").mkdir(parents=True)
    (d / "a[" / "b].txt").write_bytes(b"brackets")
    (d / "[bold]c.txt").write_bytes(b"bold")
    return [str(d), str(base / "gone[/i].txt")]


def _jobs(rank: int, world: int, base: str, inputs: list[str], qwen_dir: str, markup) -> dict:
    import torch.distributed as dist

    from ringctl.longdoc.inputs.documents import doc_key
    from ringctl.longdoc.run import LongDocOptions, run_longdoc

    base_p = Path(base)
    lines: list[str] = []
    res: dict = {"lines": lines}

    def run(params: dict, out: str, **options):
        how = LongDocOptions(**options)
        return run_longdoc(params, rank, world, None, base_p / out, lines.append, how)

    score = {"inputs": inputs, "chunk_size": 7}
    res["first"] = run(score, "score/out")
    res["again"] = run(score, "score/out")
    dist.barrier()
    if rank == 0:  # as if rank 1 died before writing its entry for one document
        entry = base_p / "score/out/longdoc/shards" / doc_key("docs.jsonl#1") / "rank-00001.json"
        entry.unlink()
    dist.barrier()
    res["resumed"] = run(score, "score/out")
    dist.barrier()
    if rank == 0:  # a copied entry (rank 1's as rank 0's): resume must redo that document
        shards = base_p / "score/out/longdoc/shards" / doc_key("docs.jsonl#3")
        shutil.copyfile(shards / "rank-00001.json", shards / "rank-00000.json")
    dist.barrier()
    res["repaired"] = run(score, "score/out")
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
    res["markup"] = run({"inputs": markup}, "markup/out")
    res["foreign"] = run({"inputs": inputs, "chunk_size": 7, "model_path": qwen_dir}, "other/out")
    return res


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("longdoc")
    inputs = _make_inputs(base)
    build("qwen2", "eager").save_pretrained(base / "qwen2")
    markup = _make_markup_inputs(base)
    results = run_distributed(_jobs, 2, str(base), inputs, str(base / "qwen2"), markup)
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
        assert (r["repaired"].done, r["repaired"].skipped) == (1, 4)  # the copied entry
        stop_err, mismatch_err = r["errors"]
        assert "gone.txt" in stop_err and "on_missing=stop" in stop_err
        assert (
            "different run" in mismatch_err and "task: 'score' there, 'embed' now" in mismatch_err
        )
        assert r["stopped"].stopped and r["stopped"].done == 0
    lines = r0["lines"]
    per_doc = [ln for ln in lines if ln.startswith("doc ")]
    # first, resumed, repaired, grad, embed, markup, another model's
    assert len(per_doc) == 5 + 1 + 1 + 5 + 5 + 2 + 5
    assert all("tokens/s" in ln and "ETA" in ln for ln in per_doc)
    assert any("missing input" in ln and "gone.txt" in ln for ln in lines)
    assert not any(ln.startswith("doc ") for ln in r1["lines"])  # one line per doc: rank 0


def test_gather_score_equals_single_process(jobs: dict, capsys) -> None:
    job = jobs["base"] / "score"
    assert _cli([str(job)]) == 0
    shown = capsys.readouterr().out
    assert "perplexity" in shown and "bits/byte" in shown and "latin1.txt" in shown
    assert "gone.txt" in shown
    out = job / "gathered"
    summary = json.loads((out / "summary.json").read_text())
    rows = {row["document"]: row for row in summary["documents"]}
    assert list(rows) == DOC_IDS and summary["missing_inputs"] == [jobs["inputs"][1]]
    assert (out / "summary.csv").read_text().splitlines()[0].startswith("document,tokens,")
    from ringctl.longdoc.model.load import load_model

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
        bits = -ref.double().mean().item() / math.log(2)  # byte tokenizer: bits per byte
        assert rows[doc_id]["bits_per_byte"] == pytest.approx(bits, rel=TOL)


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

    from ringctl.longdoc.model.load import load_model

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


def _copy_job(jobs: dict, tmp_path: Path, kind: str = "score", name: str = "job"):
    """(a copy of a job's outputs as tmp_path/name/out, its shards directory)."""
    job = tmp_path / name
    shutil.copytree(jobs["base"] / kind / "out", job / "out")
    shards = job / "out" / "longdoc" / "shards"
    return job, shards


def _nothing_written(job: Path) -> bool:
    return not (job / "gathered").exists() and not list(job.glob(".gathered*"))


def test_tampered_shard_is_refused_by_name(jobs: dict, tmp_path: Path, capsys) -> None:
    from ringctl.longdoc.inputs.documents import doc_key

    job, shards = _copy_job(jobs, tmp_path)
    victim = shards / doc_key("docs.jsonl#1") / "rank-00001.safetensors"
    blob = bytearray(victim.read_bytes())
    blob[len(blob) // 2] ^= 0x01  # flip one bit in the tensor data
    victim.write_bytes(bytes(blob))
    assert _cli([str(job)]) == GATHER_FAILED_EXIT == 3
    err = capsys.readouterr().err
    assert str(victim) in err and "checksum" in err
    assert _nothing_written(job)


def test_another_runs_shards_are_refused_not_gathered(jobs: dict, tmp_path: Path, capsys):
    """Shards of the same documents from a job with another model (the same byte tokenizer,
    ring and layout) copied in passed every check (their own checksums hold): gather printed
    the other model's numbers as this job's, exit 0, and a resume took them as complete.
    Each entry records its run's fingerprint (model identity, dtype, settings)."""
    from ringctl.longdoc.inputs.documents import doc_key
    from ringctl.longdoc.output.completeness import document_status
    from ringctl.longdoc.output.manifest import read_run

    job, shards = _copy_job(jobs, tmp_path)
    key = doc_key("docs.jsonl#2")
    for rank_only in (False, True):  # the whole document, or one rank's half of it
        theirs = jobs["base"] / "other" / "out" / "longdoc" / "shards" / key
        if rank_only:
            shutil.copy2(theirs / "rank-00001.json", shards / key)
            shutil.copy2(theirs / "rank-00001.safetensors", shards / key)
        else:
            shutil.rmtree(shards / key)
            shutil.copytree(theirs, shards / key)
        assert _cli([str(job)]) == GATHER_FAILED_EXIT
        err = capsys.readouterr().err
        assert "docs.jsonl#2" in err and "the outputs of another run" in err, err
        assert _nothing_written(job)
        root = job / "out" / "longdoc"
        run, _ = read_run(root)
        doc = {"id": "docs.jsonl#2", "key": key}
        assert document_status(root, doc, run)[1], "a resume would take it as complete"
        shutil.rmtree(shards / key)
        shutil.copytree(jobs["base"] / "score" / "out" / "longdoc" / "shards" / key, shards / key)
    assert _cli([str(job)]) == 0  # its own shards back: gathered
    capsys.readouterr()


def test_missing_shards_are_named(jobs: dict, tmp_path: Path, capsys) -> None:
    from ringctl.longdoc.inputs.documents import doc_key

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
    from ringctl.longdoc.inputs.documents import doc_key

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


# --- hostile job directories (issue 10: traversal, --force, integrity, malformed manifests) ------


def _root(job: Path) -> Path:
    return job / "out" / "longdoc"


def _index(job: Path) -> dict:
    return json.loads((_root(job) / "documents.json").read_text())


def _write_index(job: Path, index: dict) -> None:
    (_root(job) / "documents.json").write_text(json.dumps(index))


def _doc(index: dict, doc_id: str) -> dict:
    return next(d for d in index["documents"] if d["id"] == doc_id)


def _one_line(err: str) -> bool:
    return len(err.strip().splitlines()) == 1


def test_document_keys_cannot_lead_outside(jobs: dict, tmp_path: Path, capsys) -> None:
    """A key `../../evil` (its shards placed where that leads) wrote JOB/evil.safetensors
    beside -o; an absolute key read and wrote wherever it named. Both exited 0."""
    job, shards = _copy_job(jobs, tmp_path)
    index = _index(job)
    doc = _doc(index, "one.txt")
    shutil.move(shards / doc["key"], job / "out" / "evil")  # = shards/../../evil
    doc["key"] = "../../evil"
    _write_index(job, index)
    assert _cli([str(job)]) == 3
    err = capsys.readouterr().err
    assert "key='../../evil' is not a plain file name" in err and _one_line(err)
    assert not (job / "evil.safetensors").exists() and _nothing_written(job)

    job, shards = _copy_job(jobs, tmp_path, name="job-abs")
    index = _index(job)
    doc = _doc(index, "one.txt")
    outside = tmp_path / "outside" / "stolen"
    outside.parent.mkdir()
    shutil.move(shards / doc["key"], outside)
    doc["key"] = str(outside)
    _write_index(job, index)
    assert _cli([str(job)]) == 3
    assert f"key={str(outside)!r} is not a plain file name" in capsys.readouterr().err
    assert not (tmp_path / "outside" / "stolen.safetensors").exists() and _nothing_written(job)


def test_symlinks_out_of_the_job_are_refused(jobs: dict, tmp_path: Path, capsys) -> None:
    """A shard file, or a document's shard directory, that is a symlink to a (byte-identical)
    copy outside the job directory was read and accepted."""
    job, shards = _copy_job(jobs, tmp_path)
    shard = shards / _doc(_index(job), "docs.jsonl#1")["key"] / "rank-00001.safetensors"
    elsewhere = tmp_path / "elsewhere.safetensors"
    shutil.move(shard, elsewhere)
    shard.symlink_to(elsewhere)
    assert _cli([str(job)]) == 3
    err = capsys.readouterr().err
    assert f"{shard} leads outside" in err and _one_line(err) and _nothing_written(job)

    job, shards = _copy_job(jobs, tmp_path, name="job-dir")
    doc_dir = shards / _doc(_index(job), "latin1.txt")["key"]
    shutil.move(doc_dir, tmp_path / "elsewhere")
    doc_dir.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    assert _cli([str(job)]) == 3
    assert f"{doc_dir} leads outside" in capsys.readouterr().err and _nothing_written(job)


def test_manifests_that_are_links_or_pipes_are_refused(jobs: dict, tmp_path: Path, capsys):
    """run.json, documents.json and expected.json were read with a plain read: a link to a
    copy outside the job was read and gathered (exit 0), and a FIFO hung gather forever."""
    for i, name in enumerate(("run.json", "documents.json", "expected.json")):
        job, _ = _copy_job(jobs, tmp_path, name=f"link{i}")
        manifest = _root(job) / name
        outside = tmp_path / f"outside-{i}.json"
        shutil.move(manifest, outside)
        manifest.symlink_to(outside)
        assert _cli([str(job)]) == 3, name
        err = capsys.readouterr().err
        assert f"{manifest}: a link, not followed" in err and _nothing_written(job), err

        job, _ = _copy_job(jobs, tmp_path, name=f"fifo{i}")
        manifest = _root(job) / name
        manifest.unlink()
        os.mkfifo(manifest)
        code = _cli([str(job)])  # a plain read blocked here until the test's timeout
        err = capsys.readouterr().err
        if name == "run.json":  # what marks a task's output: a pipe there marks none
            assert code == 2 and "no task output here" in err and _one_line(err), err
        else:
            assert code == 3 and f"{manifest}: not a regular file" in err, err
        assert _nothing_written(job)


def test_an_entry_claiming_a_huge_ring_lists_a_few_problems(jobs: dict, tmp_path: Path, capsys):
    """One document's rank 0 entry edited to world_size=65536 listed a problem for each of
    its 65,536 ranks (65,537 lines, 13 s); now the first few and the ranks left unchecked."""
    from ringctl.longdoc.inputs.documents import doc_key

    job, shards = _copy_job(jobs, tmp_path)
    entry_path = shards / doc_key("docs.jsonl#1") / "rank-00000.json"
    entry = json.loads(entry_path.read_text())
    entry["world_size"] = 65536
    entry_path.write_text(json.dumps(entry))
    assert _cli([str(job)]) == 3
    err = capsys.readouterr().err
    assert "of 65536 not checked" in err and len(err.splitlines()) < 10, err[:2000]
    assert _nothing_written(job)


def test_duplicate_ids_are_refused(jobs: dict, tmp_path: Path, capsys) -> None:
    job, _ = _copy_job(jobs, tmp_path)
    index = _index(job)
    index["documents"].append(dict(_doc(index, "one.txt")))  # gathered twice, one file
    _write_index(job, index)
    assert _cli([str(job)]) == 3
    err = capsys.readouterr().err
    assert "document id 'one.txt' is listed more than once" in err and _nothing_written(job)


def test_gradient_file_named_by_an_entry_stays_inside(jobs: dict, tmp_path: Path, capsys) -> None:
    """An entry's grads_file pointing at any file (its sha256 beside it) was copied into the
    results."""
    from ringctl.longdoc.output.store import sha256_file

    job, shards = _copy_job(jobs, tmp_path, kind="grad")
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"not yours")
    entry_path = shards / _doc(_index(job), "docs.jsonl#1")["key"] / "rank-00000.json"
    entry = json.loads(entry_path.read_text())
    entry.update(grads_file=str(secret), grads_sha256=sha256_file(secret))
    entry_path.write_text(json.dumps(entry))
    assert _cli([str(job)]) == 3
    err = capsys.readouterr().err
    assert f"grads_file={str(secret)!r}" in err and "refused" in err and _nothing_written(job)


def test_force_replaces_only_an_earlier_gather_output(
    jobs: dict, tmp_path: Path, capsys, monkeypatch
) -> None:
    """`gather -o . --force` deleted the current directory; --force on a file or a symlink
    was a traceback."""
    job, _ = _copy_job(jobs, tmp_path)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "precious.txt").write_text("keep me")
    monkeypatch.chdir(cwd)
    assert _cli([str(job), "-o", ".", "--force"]) == 2
    err = capsys.readouterr().err
    assert "not an earlier gather output" in err and _one_line(err)
    assert [p.name for p in cwd.iterdir()] == ["precious.txt"]

    a_file = tmp_path / "a.txt"
    a_file.write_text("mine")
    link = tmp_path / "link"
    link.symlink_to(cwd, target_is_directory=True)
    for target, why in ((a_file, "is not a directory"), (link, "is a symlink")):
        assert _cli([str(job), "-o", str(target), "--force"]) == 2
        err = capsys.readouterr().err
        assert why in err and _one_line(err)
    assert a_file.read_text() == "mine" and link.is_symlink() and (cwd / "precious.txt").exists()

    out = tmp_path / "gathered"
    assert _cli([str(job), "-o", str(out)]) == 0
    (out / "docs" / "left-over.txt").write_text("from the earlier gather")
    assert _cli([str(job), "-o", str(out), "--force"]) == 0
    assert (out / ".ringctl-gather").is_file() and not (out / "docs" / "left-over.txt").exists()
    assert not list(tmp_path.glob(".gathered.*"))  # no temporary left beside it


def test_gathered_folder_has_the_users_permissions(jobs: dict, tmp_path: Path) -> None:
    """mkdtemp's 0700 made the results unreadable to the user's group."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        gather(jobs["base"] / "grad", tmp_path / "out")
    finally:
        os.umask(old)
    paths = [tmp_path / "out", *(tmp_path / "out").rglob("*")]
    modes = {p.relative_to(tmp_path): stat.S_IMODE(p.stat().st_mode) for p in paths}
    assert modes[Path("out")] == 0o755 and modes[Path("out/grads")] == 0o755
    assert all(m == (0o755 if (tmp_path / p).is_dir() else 0o644) for p, m in modes.items())


def test_malformed_manifests_exit_3_in_one_line(jobs: dict, tmp_path: Path, capsys) -> None:
    cases = [
        ("documents.json", "[]", "expected a JSON object"),
        ("documents.json", '{"documents": {"a": 1}}', "'documents' is dict"),
        ("documents.json", '{"documents": [{"id": 7}]}', "id=7"),
        ("documents.json", "{not json", "not valid JSON"),
        ("run.json", '{"task": "score", "layout": "zigzag"}', "world_size=None"),
        ("run.json", '{"world_size": 2, "task": "score", "layout": "spiral"}', "layout='spiral'"),
    ]
    for i, (name, text, why) in enumerate(cases):
        job, _ = _copy_job(jobs, tmp_path, name=f"job{i}")
        (_root(job) / name).write_text(text)
        assert _cli([str(job)]) == 3, (name, text)
        err = capsys.readouterr().err
        assert why in err and name in err and _one_line(err), err


def test_what_the_job_did_not_read_is_said_by_gather(jobs: dict, tmp_path: Path, capsys):
    """Files of an input folder no reader takes and bad records skipped were named in the
    job's log and documents.json only: a gather of the results, days later, said nothing
    of them (as it says missing inputs)."""
    job, _ = _copy_job(jobs, tmp_path)
    index = _index(job)
    index["passed_over"] = [f"/data/in/f{i}.bin" for i in range(5)]
    index["skipped_records"] = ["/data/in/a.jsonl:3: not valid JSON"]
    _write_index(job, index)
    capsys.readouterr()
    assert _cli([str(job)]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert (
        "note: when the job ran, 5 file(s) in the input folders were not read (no reader "
        "takes them): /data/in/f0.bin; /data/in/f1.bin; /data/in/f2.bin; ... (2 more) "
        "(documents.json passed_over)" in shown
    ), shown
    assert "1 bad record(s) were skipped (on_bad_record=skip): /data/in/a.jsonl:3" in shown


def test_ids_with_markup_are_printed_literally(jobs: dict, capsys) -> None:
    """`a[/b].txt` made gather crash after writing; `[bold]` vanished into styling."""
    assert _cli([str(jobs["base"] / "markup")]) == 0
    shown = capsys.readouterr().out.replace("\n", "")
    assert "a[/b].txt" in shown and "[bold]c.txt" in shown and "gone[/i].txt" in shown


def test_document_list_is_checked_against_the_expected_one(
    jobs: dict, tmp_path: Path, capsys
) -> None:
    """A documents.json cut down to 0 or 1 documents exited 0 with a "complete" summary."""
    from ringctl.longdoc.output.expected import check_expected, write_expected
    from ringctl.longdoc.output.names import EXPECTED_FILE

    for keep in (0, 1):
        job, _ = _copy_job(jobs, tmp_path, name=f"job{keep}")
        index = _index(job)
        if not (_root(job) / EXPECTED_FILE).exists():  # what the run records when it starts
            write_expected(_root(job), index["documents"])
        index["documents"] = index["documents"][:keep]
        _write_index(job, index)
        assert _cli([str(job)]) == 3
        err = capsys.readouterr().err
        assert f"{5 - keep} expected document(s) are not listed" in err and _one_line(err)
        assert all(repr(doc_id) in err for doc_id in DOC_IDS[keep:]) and _nothing_written(job)

    job, _ = _copy_job(jobs, tmp_path, name="tokens")
    (_root(job) / EXPECTED_FILE).unlink(missing_ok=True)
    documents = _index(job)["documents"]
    write_expected(_root(job), documents, tokens={"one.txt": 2})
    assert _cli([str(job)]) == 3
    assert "document 'one.txt': 1 tokens, expected.json says 2" in capsys.readouterr().err
    # A later attempt over other documents is told, before any work, and nothing is rewritten.
    assert check_expected(_root(job), documents) == ""
    assert "1 expected document(s) are not listed: 'one.txt'" in check_expected(
        _root(job), [d for d in documents if d["id"] != "one.txt"]
    )
    with pytest.raises(ValueError, match="use a new output directory"):
        write_expected(_root(job), documents[:2])


def test_a_job_without_expected_json_is_gathered_saying_so(jobs: dict, tmp_path, capsys):
    """expected.json deleted and documents.json cut to one document: gathered as the whole
    job, exit 0, unsaid. Still gathered (outputs older than the file have none), said."""
    from ringctl.longdoc.output.names import EXPECTED_FILE

    job, _ = _copy_job(jobs, tmp_path, name="no-expected")
    (_root(job) / EXPECTED_FILE).unlink(missing_ok=True)
    index = _index(job)
    index["documents"] = index["documents"][:1]
    _write_index(job, index)
    assert _cli([str(job)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"{EXPECTED_FILE} is absent (outputs older than it, or removed)" in out, out
    assert "documents.json lists are taken as the whole job" in out


def test_one_definition_of_complete(jobs: dict, tmp_path: Path) -> None:
    """A copied entry (rank 1's entry as rank 0's) passed resume's check (the file the entry
    names matched its checksum) while gather refused it: both now ask completeness.py."""
    from ringctl.longdoc.output.completeness import document_status, rank_complete

    job, shards = _copy_job(jobs, tmp_path)
    root, index = _root(job), _index(job)
    run = json.loads((root / "run.json").read_text())
    doc = _doc(index, "docs.jsonl#1")
    doc_dir = shards / doc["key"]
    shutil.copyfile(doc_dir / "rank-00001.json", doc_dir / "rank-00000.json")
    complete, problems = document_status(root, doc, run)
    assert not complete and "rank-00000.safetensors does not match its checksum" in problems[0]
    assert not rank_complete(root, doc, run, 0) and rank_complete(root, doc, run, 1)
    intact = _doc(index, "latin1.txt")
    assert document_status(root, intact, run) == (True, [])
    assert all(rank_complete(root, intact, run, r) for r in range(2))
    with pytest.raises(GatherError) as err:
        gather(job)
    assert err.value.problems == problems  # gather: the same verdict, the same words


def _real_job_dir(jobs: dict, tmp_path: Path, job_file: str, name: str) -> Path:
    """A job directory as submit makes it (config.yaml, job.json) around a copy of outputs."""
    from ringctl.config import load_job, to_yaml

    job, _ = _copy_job(jobs, tmp_path, name=name)
    # the outputs are the random tiny Llama's (run_longdoc's default): so is the config's model
    overrides = ["task.model_path=null"] if job_file.endswith("longdoc.yaml") else []
    (job / "config.yaml").write_text(to_yaml(load_job(REPO / job_file, overrides)))
    (job / "job.json").write_text(json.dumps({"backend": "local", "job_id": "1"}))
    return job


def test_gather_goes_through_the_task_and_the_lock(jobs: dict, tmp_path: Path, capsys) -> None:
    from ringctl.jobdir import JobDir

    job = _real_job_dir(jobs, tmp_path, "jobs/longdoc.yaml", "longdoc-job")
    assert _cli([str(job)]) == 0 and (job / "gathered" / "summary.json").is_file()
    assert _cli([str(job / "out"), "-o", str(tmp_path / "from-out")]) == 0  # its out/ works too
    with JobDir(job).lock("resume"):
        assert _cli([str(job), "--force"]) == 2
        assert "is in use (ringctl resume" in capsys.readouterr().err
    assert _cli([str(job), "--force"]) == 0

    attention = _real_job_dir(jobs, tmp_path, "jobs/smoke.yaml", "attention-job")
    assert _cli([str(attention)]) == 2
    err = capsys.readouterr().err
    assert "task 'attention' has no gather step" in err and _one_line(err)


def test_gather_fetches_a_remote_job_over_ssh(jobs: dict, tmp_path: Path, ssh_login) -> None:
    """The verb asks every backend to fetch (no test of its name): an ssh job's shards exist
    only on the login node (the loopback sshd) until gather brings them back over SFTP."""
    from ringctl.config import load_job, to_yaml

    remote = tmp_path / "remote-base" / "ssh-job"
    shutil.copytree(jobs["base"] / "score" / "out", remote / "out")
    job = tmp_path / "ssh-job"
    (job / "out").mkdir(parents=True)
    ssh = {k: getattr(ssh_login, k) for k in ("host", "port", "user", "key", "known_hosts")}
    overrides = ["backend=ssh", *(f"ssh.{k}={v}" for k, v in ssh.items()), "task.model_path=null"]
    cfg = load_job(REPO / "jobs/longdoc.yaml", [*overrides, f"ssh.remote_dir={remote.parent}"])
    (job / "config.yaml").write_text(to_yaml(cfg))
    meta = {"backend": "ssh", "job_id": "1", "remote": {**ssh, "dir": str(remote)}}
    (job / "job.json").write_text(json.dumps(meta))
    assert _cli([str(job)]) == 0
    assert (job / "out" / "longdoc" / "run.json").is_file()  # fetched
    summary = json.loads((job / "gathered" / "summary.json").read_text())
    assert [row["document"] for row in summary["documents"]] == DOC_IDS


def test_grad_job_gets_the_token_table_and_the_curve(jobs: dict, tmp_path: Path) -> None:
    """The per-token table and loss curve of a grad job (issue 11; formats and curve are
    checked value by value on a score job in test_gather_outputs.py): the same token_logprob."""
    import csv

    result = gather(jobs["base"] / "grad", tmp_path / "grad", fmt="csv")
    assert {"tokens.csv", "loss-by-position.json"} <= set(result.files)
    docs = {r["document"]: load_file(tmp_path / "grad" / r["file"]) for r in result.rows}
    with (tmp_path / "grad" / "tokens.csv").open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["doc_id"] == "docs.jsonl#1"]
    got = torch.tensor([float(r["token_logprob"]) for r in rows[1:]], dtype=torch.float32)
    assert torch.equal(got, docs["docs.jsonl#1"]["token_logprob"])
    curve = json.loads((tmp_path / "grad" / "loss-by-position.json").read_text())
    assert curve["tokens"] == sum(t["token_logprob"].numel() for t in docs.values())


def test_an_entry_cannot_claim_any_padding(jobs: dict, tmp_path: Path, capsys) -> None:
    """padded_tokens (a batch row's padding) is used only within its bound: an absurd value
    is ignored (nothing of its size is allocated; the shard is judged by its own padding), and
    a plausible one the shard's positions do not follow is refused by name."""
    job, shards = _copy_job(jobs, tmp_path)
    entry_path = shards / _doc(_index(job), "docs.jsonl#1")["key"] / "rank-00000.json"
    entry = json.loads(entry_path.read_text())
    entry_path.write_text(json.dumps({**entry, "padded_tokens": 10**15}))
    assert _cli([str(job), "-o", str(tmp_path / "a")]) == 0
    capsys.readouterr()
    entry_path.write_text(json.dumps({**entry, "padded_tokens": entry["padded_tokens"] + 64}))
    assert _cli([str(job), "-o", str(tmp_path / "b")]) == 3
    err = capsys.readouterr().err
    assert "but rank 0 of the zigzag layout holds" in err and not (tmp_path / "b").exists()


def test_a_shard_rewritten_consistently_is_still_checked_row_by_row(
    jobs: dict, tmp_path: Path, capsys
) -> None:
    """A shard whose entry was rewritten to agree with it (bytes, sha256, shapes) passed the
    checksum: a one-row token_logprob was broadcast over the shard's positions (perplexity
    289.4 for 270.5, exit 0), a missing one a KeyError traceback. Every per-token tensor of
    the task must now hold one row per position, of its dtype."""
    import hashlib

    from safetensors.torch import load, save

    from ringctl.longdoc.inputs.documents import doc_key

    job, shards = _copy_job(jobs, tmp_path)
    folder = shards / doc_key("docs.jsonl#1")
    original = (folder / "rank-00001.safetensors").read_bytes()
    entry0 = json.loads((folder / "rank-00001.json").read_text())
    cases = {
        "one row": lambda t: {**t, "token_logprob": t["token_logprob"][:1].clone()},
        "missing": lambda t: {k: v for k, v in t.items() if k != "token_logprob"},
        "float64": lambda t: {**t, "token_logprob": t["token_logprob"].double()},
    }
    said = {
        "one row": "token_logprob has shape [1], not one row per position",
        "missing": "holds no token_logprob",
        "float64": "token_logprob is float64, not float32",
    }
    for name, change in cases.items():
        tensors = change(load(original))
        data = save(tensors, metadata={"format": "ringctl.longdoc/1", "doc_id": "docs.jsonl#1"})
        (folder / "rank-00001.safetensors").write_bytes(data)
        specs = {
            k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape)}
            for k, v in tensors.items()
        }
        entry = {**entry0, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        (folder / "rank-00001.json").write_text(json.dumps({**entry, "tensors": specs}))
        capsys.readouterr()
        assert _cli([str(job), "-o", str(tmp_path / name)]) == 3, name
        err = capsys.readouterr().err
        assert said[name] in err and "Traceback" not in err, err
        assert not (tmp_path / name).exists()


def test_a_running_job_s_failed_gather_advises_partial_only_when_not_given():
    """`gather --partial` of a running job with nothing complete yet said "... or gather the
    complete documents now with --partial"."""
    from ringctl.backends.base import JobState, JobStatus
    from ringctl.commands.gather import not_finished_line

    running = JobStatus("7", JobState.RUNNING)
    line = not_finished_line(running, Path("/j"), partial=False)
    assert line.endswith("or gather what is complete now with --partial"), line
    line = not_finished_line(running, Path("/j"), partial=True)
    assert "--partial" not in line and line.startswith("the job is RUNNING"), line


def test_an_entry_whose_stats_are_not_an_object_is_no_traceback(jobs, tmp_path, capsys):
    """gather reads the scored bytes a ring's lead recorded in its entry's stats: an entry
    whose stats is a list (damaged, or written by hand) must not be an AttributeError."""
    from ringctl.longdoc.inputs.documents import doc_key

    job, shards = _copy_job(jobs, tmp_path)
    entry = shards / doc_key("docs.jsonl#1") / "rank-00000.json"
    data = json.loads(entry.read_text())
    data["stats"] = ["not", "an", "object"]
    entry.write_text(json.dumps(data))
    assert _cli([str(job)]) == 0, capsys.readouterr().err  # the data files vouch for the rest
    summary = json.loads((job / "gathered" / "summary.json").read_text())
    assert "docs.jsonl#1" in {r["document"] for r in summary["documents"]}
