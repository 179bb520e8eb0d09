"""Each file one module of a job writes and another reads, written by its owner's writer and
read back by its owner's reader: the long-document output's run.json and documents.json
(``output/manifest.py``), expected.json (``output/expected.py``), a rank's manifest entry
(``output/store.py`` writes it, ``output/completeness.py`` reads it for gather and resume),
and the progress records (``ringctl/progress.py``). A writer and a reader that spell a file
apart drift apart (schedule.json's did: issue 27); these tests make them meet.

schedule.json's round trip is in test_plan_schedule.py, metrics.jsonl's in
test_train_metrics.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ringctl.longdoc.inputs.documents import Listing, doc_key, list_documents
from ringctl.longdoc.output.completeness import check_rank
from ringctl.longdoc.output.expected import expected_record, read_expected, write_expected
from ringctl.longdoc.output.manifest import (
    documents_record,
    other_run,
    read_documents,
    read_run,
    run_record,
    skipped_notes,
    write_documents,
    write_run,
)
from ringctl.longdoc.output.names import OutputPaths
from ringctl.longdoc.output.store import ShardStore
from ringctl.longdoc.params import LongDocParams
from ringctl.progress import progress_record, read_record, ring_record, write_record


@pytest.fixture
def listing(tmp_path: Path) -> tuple[list[str], Listing]:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello")
    (corpus / "b.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    (corpus / "c.bin").write_bytes(b"\0")  # no reader takes it: passed over
    found = list_documents([corpus])
    inputs = [str(corpus), str(tmp_path / "gone.txt")]
    skipped = ["b.jsonl:3: not valid JSON"]
    return inputs, Listing(found.documents, [inputs[1]], skipped, found.passed_over)


def test_run_json(tmp_path: Path) -> None:
    params = LongDocParams.from_any({"mode": "grad", "id_field": "id", "model_overrides": {"a": 1}})
    record = run_record(4, params.signature())
    write_run(tmp_path, record)
    assert read_run(tmp_path) == (record, [])
    assert other_run(tmp_path, params.signature()) == ""  # the same run: resumable
    other = LongDocParams.from_any({"mode": "score"}).signature()
    assert "task: 'grad' there, 'score' now" in other_run(tmp_path, other)
    # a run that set model_overrides, resumed without them (a signature leaves out what a
    # run did not set): compared as None now, not skipped (the resume mixed two models)
    plain = LongDocParams.from_any({"mode": "grad", "id_field": "id"}).signature()
    assert "model_overrides: {'a': 1} there, None now" in other_run(tmp_path, plain)
    OutputPaths(tmp_path).run_file.write_text("[]")  # hostile: not an object
    assert other_run(tmp_path, other).endswith("unreadable (expected a JSON object, found list)")


def test_documents_json(tmp_path: Path, listing) -> None:
    inputs, found = listing
    record = documents_record(inputs, found)
    write_documents(tmp_path / "longdoc", record)
    index, problems = read_documents(tmp_path / "longdoc")
    assert problems == [] and index == record
    assert [d["id"] for d in index["documents"]] == [d.id for d in found.documents]
    assert index["missing_inputs"] == [inputs[1]] and index["skipped_records"]
    assert index["passed_over"] == [str(inputs[0] + "/c.bin")]
    # what gather says of them (the job's log said each when it ran)
    assert skipped_notes(index) == [
        "when the job ran, 1 bad record(s) were skipped (on_bad_record=skip): "
        "b.jsonl:3: not valid JSON (documents.json skipped_records)",
        f"when the job ran, 1 file(s) in the input folders were not read (no reader takes "
        f"them): {inputs[0]}/c.bin (documents.json passed_over)",
    ]
    for key in ("passed_over", "skipped_records", "missing_inputs"):  # a hand-made file
        write_documents(tmp_path / "longdoc", {**record, key: [3]})
        index, problems = read_documents(tmp_path / "longdoc")
        assert index is None and problems[0].endswith(f"{key!r} is not a list of strings")


def test_expected_json(tmp_path: Path, listing) -> None:
    _, found = listing
    tokens = {found.documents[0].id: 5}
    path = write_expected(tmp_path, found.documents, tokens)
    assert path == OutputPaths(tmp_path).expected_file
    assert read_expected(tmp_path) == (expected_record(found.documents, tokens), [])


def test_a_rank_s_manifest_entry(tmp_path: Path) -> None:
    """What ``ShardStore.write_shard`` writes is what ``completeness.check_rank`` (gather's and
    resume's reader) reads back and accepts: the entry as returned, and the tensors."""
    store = ShardStore(tmp_path)
    doc = {"id": "d/1", "key": doc_key("d/1"), "source": "x.txt", "line": None}
    tensors = {  # a score shard's: one row per position of each (completeness.PER_TOKEN)
        "positions": torch.tensor([1, 2]),
        "input_ids": torch.tensor([5, 6]),
        "token_logprob": torch.tensor([-0.5, -1.5]),
    }
    entry = store.write_shard(
        doc=doc,
        rank=1,
        world_size=2,
        layout="zigzag",
        task="score",
        n_tokens=4,
        padded_tokens=4,
        tensors=tensors,
        stats={"n_scored": 2, "log_likelihood": -2.0},
        seconds=0.25,
        input_identity={"bytes": 4, "sha256": "0" * 64},
    )
    run = {"world_size": 2, "task": "score", "layout": "zigzag"}
    shard, problem = check_rank(store.root, doc, run, 1)
    assert problem == "" and shard is not None
    assert shard.entry == json.loads(json.dumps(entry)) and shard.data_path.name == entry["file"]
    assert all(torch.equal(shard.tensors[k], v) for k, v in tensors.items())


def test_progress_records(tmp_path: Path) -> None:
    job = progress_record(3, 10, "documents", 1, 2.5, 0.8, 8.75, tokens_per_s=120)
    inside = progress_record(3, 10, "documents", 1, 2.5, 0.8, None, current="a.txt: layer 2 of 30")
    ring = ring_record(2, 4, [0, 1], eta_s=3.0, current="b.txt: layer 7 of 30")
    for name, record in (("progress.json", job), ("in.json", inside), ("ring-2x0.json", ring)):
        write_record(tmp_path / name, record)
        notes: list[str] = []
        assert read_record(tmp_path / name, notes) == record and notes == []
    write_record(tmp_path / "bad.json", {**inside, "current": ["not", "text"]})
    notes = []
    assert read_record(tmp_path / "bad.json", notes)["current"] is None
    assert notes and "current" in notes[0]


def test_the_output_s_names_are_spelled_in_names_py_only():
    """run.json, documents.json, expected.json and shards/ of a long-document output: every
    writer and reader asks ``output/names.py`` (a docstring, or a message that names a file
    in a longer text, may say them)."""
    import ast

    root = Path(__file__).resolve().parents[1]
    spelled = {"run.json", "documents.json", "expected.json", "shards"}
    found = []
    for path in sorted((root / "ringctl").rglob("*.py")):
        if path.name == "names.py" and path.parent.name == "output":
            continue
        tree = ast.parse(path.read_text())
        docs = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        found += [
            f"{path.relative_to(root)}:{node.lineno}: {node.value}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in spelled and id(node) not in docs
        ]
    assert found == []
