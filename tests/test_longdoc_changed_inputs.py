"""Inputs edited between attempts are never served stale (issue 26, "Medium").

Real local jobs (2 ranks, gloo, the byte-level random model): a document complete in the first
attempt, then its file reversed (same size) or cut in half, or one JSONL record edited in place.
Before, `resume` said "complete already", and gather exited 0 with the old results. Now each
shard's entry records its input's size and sha256; gather refuses a document whose input no
longer matches, naming it; `resume` computes it again (the byte tokenizer's ids are the new
bytes), or with `task.on_changed_input=stop` refuses, naming it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from safetensors.torch import load_file

from ringctl.cli import main

ROOT = Path(__file__).resolve().parents[1]
JOB = str(ROOT / "jobs" / "longdoc.yaml")
SIZE = 33_000


def _inputs(base: Path) -> Path:
    rng = random.Random(7)
    docs = base / "docs"
    docs.mkdir()
    words = "ring attention shards tokens travel between ranks".split()
    text = " ".join(rng.choice(words) for _ in range(SIZE))[:SIZE]
    (docs / "a.txt").write_text(text)
    (docs / "b.txt").write_text("a short document that does not change")
    records = [{"text": "the first record stays as it is"}, {"text": "the second record is edited"}]
    (docs / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return docs


def _run(base: Path, docs: Path, *extra: str) -> Path:
    job = base / "job"
    args = [f"job_dir={job}", f"task.inputs=[{docs}]", "task.model_path=null", *extra]
    assert main(["run", JOB, *args]) == 0
    return job


def _gather(job: Path, out: Path, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["gather", str(job), "-o", str(out)])
    return code, capsys.readouterr().err


def _ids(out: Path, doc_id: str) -> bytes:
    summary = json.loads((out / "summary.json").read_text())
    (row,) = [r for r in summary["documents"] if r["document"] == doc_id]
    return bytes(load_file(out / row["file"])["input_ids"].tolist())


def test_an_edited_input_is_refused_by_gather_and_redone_by_resume(tmp_path, capsys) -> None:
    docs = _inputs(tmp_path)
    job = _run(tmp_path, docs)
    a = docs / "a.txt"
    a.write_bytes(a.read_bytes()[::-1])  # the same size
    c = docs / "c.jsonl"
    c.write_text(c.read_text().replace("is edited", "is EDITED"))  # one record, same length

    code, err = _gather(job, tmp_path / "stale", capsys)
    assert code == 3 and "Traceback" not in err, err
    changed = "its input changed since its outputs were written"
    assert f"document 'a.txt': {changed} ({SIZE:,} bytes, sha256 " in err, err
    assert f"document 'c.jsonl#2': {changed}" in err and "'b.txt'" not in err, err
    assert not (tmp_path / "stale").exists()

    assert main(["resume", str(job), "--force", "--follow"]) == 0
    log = capsys.readouterr().out
    assert "complete already: 2, to do: 2" in log, log
    assert "computed again: 'a.txt', 'c.jsonl#2'" in log, log
    assert _gather(job, tmp_path / "fresh", capsys)[0] == 0
    assert _ids(tmp_path / "fresh", "a.txt") == a.read_bytes()
    assert b"EDITED" in _ids(tmp_path / "fresh", "c.jsonl#2")

    a.write_bytes(a.read_bytes()[: SIZE // 2])  # cut in half
    code, err = _gather(job, tmp_path / "half", capsys)
    assert code == 3 and f"({SIZE:,} bytes, sha256 " in err and f"then, {SIZE // 2:,} bytes" in err
    assert main(["resume", str(job), "--force", "--follow"]) == 0
    assert _gather(job, tmp_path / "halved", capsys)[0] == 0
    assert _ids(tmp_path / "halved", "a.txt") == a.read_bytes()


def test_a_resume_refuses_an_edited_input_when_asked(tmp_path, capsys) -> None:
    docs = _inputs(tmp_path)
    job = _run(tmp_path, docs, "task.on_changed_input=stop")
    (docs / "b.txt").write_text("a short document that DID change")
    capsys.readouterr()
    assert main(["resume", str(job), "--force", "--follow"]) == 1
    out, err = capsys.readouterr()
    assert "FAILED" in err and "b.txt" in err, err
    assert "its input changed since its outputs were written" in err, err
    assert "refused (task.on_changed_input=stop" in err, err


def test_a_resume_refuses_a_model_changed_at_the_same_path(tmp_path, capsys) -> None:
    """run.json recorded the model's path, not its files: a checkpoint rewritten at the same
    path (or a package upgraded) between attempts made a resume compute the rest with the new
    model beside the old one's results, and gather vouched for both (a review found it: one
    document's perplexity 169 beside the others' 4-10). run.json now records the sha256 of
    the model's files; a resume with other files is refused, naming the model."""
    import shutil

    from safetensors.torch import save_file

    from ringctl.longdoc.model.names import BUNDLED_TRAINED, resolve_model_path

    model = tmp_path / "model"
    shutil.copytree(resolve_model_path(BUNDLED_TRAINED), model)
    docs = _inputs(tmp_path)
    job = tmp_path / "job"
    args = [f"job_dir={job}", f"task.inputs=[{docs}]", f"task.model_path={model}"]
    assert main(["run", JOB, *args]) == 0
    run = json.loads((job / "out" / "longdoc" / "run.json").read_text())
    assert len(run["model"]) == 32, run
    weights = load_file(model / "model.safetensors")
    save_file({k: v * 1.5 for k, v in weights.items()}, model / "model.safetensors")
    capsys.readouterr()
    assert main(["resume", str(job), "--force", "--follow"]) == 1
    err = capsys.readouterr().err
    assert "holds the results of a different run (model: '" in err, err


def test_a_resume_over_inputs_listing_other_documents_is_refused_before_it_is_queued(
    tmp_path, capsys
) -> None:
    """A file added to the input folder (another removed): the resume was queued, then every
    rank refused it ("started for other documents"), a traceback in the rank log; on Slurm
    after a queue wait. Refused by `ringctl resume` itself, nothing moved."""
    docs = _inputs(tmp_path)
    job = _run(tmp_path, docs)
    (docs / "b.txt").unlink()
    (docs / "d.txt").write_text("a document added since")
    meta = (job / "job.json").read_bytes()
    capsys.readouterr()
    assert main(["resume", str(job), "--force"]) == 2
    err = capsys.readouterr().err
    assert "expected.json: this output directory was started for other documents" in err, err
    assert err.rstrip().endswith("Nothing was resumed") and err.count("\n") == 1, err
    assert (job / "job.json").read_bytes() == meta and not (job / "attempts").exists()


def test_bits_per_byte_need_not_read_the_input_again(tmp_path, capsys) -> None:
    """An ssh job's inputs are the login node's: gather could not count a document's scored
    bytes with a model's tokenizer, and every bits_per_byte read null (the demo's headline).
    The ring's lead counts them as it reads the document and its entry records them; gather
    takes that count where it cannot make its own (here: one input folder moved away)."""
    from tests.longdoc_reference import word_model

    kept, moved = tmp_path / "kept", tmp_path / "moved"
    for folder, text in ((kept, "a abcdefghij " * 30), (moved, "abcdefghij a a " * 40)):
        folder.mkdir()
        (folder / f"{folder.name}.txt").write_text(text)
    job = tmp_path / "job"
    args = [f"job_dir={job}", f"task.inputs=[{kept},{moved}]", "nodes=1", "tasks_per_node=2"]
    assert main(["run", JOB, *args, f"task.model_path={word_model(tmp_path)}"]) == 0
    assert _gather(job, tmp_path / "here", capsys)[0] == 0
    moved.rename(tmp_path / "away")
    code, err = _gather(job, tmp_path / "gone", capsys)
    assert code == 0, err
    here, gone = (
        {
            r["document"]: r
            for r in json.loads((tmp_path / o / "summary.json").read_text())["documents"]
        }
        for o in ("here", "gone")
    )
    assert here["moved.txt"]["bits_per_byte"] is not None
    assert gone["moved.txt"]["bits_per_byte"] == here["moved.txt"]["bits_per_byte"]
    assert gone["kept.txt"]["bits_per_byte"] == here["kept.txt"]["bits_per_byte"]
