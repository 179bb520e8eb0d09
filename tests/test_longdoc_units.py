"""Long-document parts that need no process group: inputs, tokenizers, shards, parameters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ringctl.longdoc.inputs.documents import (
    DocumentError,
    MissingInputError,
    doc_key,
    invalid_utf8_count,
    list_documents,
)
from ringctl.longdoc.model.names import bundled_config_path, samples_dir
from ringctl.longdoc.model.tokenize import ByteTokenizer, load_tokenizer
from ringctl.longdoc.output.completeness import document_status, rank_complete
from ringctl.longdoc.output.store import ShardStore, atomic_write, expand_ranges, position_ranges
from ringctl.longdoc.run import LongDocParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("hello")
    (d / "sub" / "b.txt").write_bytes(b"caf\xe9 \xff")  # Latin-1: not UTF-8
    records = [{"text": "one"}, {"text": ""}, {"text": "caf\udce9", "id": 3}]
    lines = [json.dumps(r) for r in records[:2]] + ['{"text": "caf\\u00e9"}']
    (d / "c.jsonl").write_text(lines[0] + "\n\n" + lines[1] + "\n" + lines[2] + "\n")
    (d / ".hidden.txt").write_text("skipped")
    (d / "notes.md").write_text("markdown is text")
    (d / "data.bin").write_text("skipped: not a document suffix")
    return d


def test_directory_listing_is_stable_and_ids_unique(corpus: Path) -> None:
    listing = list_documents(corpus)
    ids = [d.id for d in listing.documents]
    assert ids == ["a.txt", "c.jsonl#1", "c.jsonl#3", "c.jsonl#4", "notes.md", "sub/b.txt"]
    assert [d.id for d in list_documents(str(corpus)).documents] == ids
    assert len({d.key for d in listing.documents}) == len(ids)
    assert all("/" not in d.key for d in listing.documents)
    assert doc_key("sub/b.txt") == doc_key("sub/b.txt") != doc_key("sub_b.txt")
    by_id = {d.id: d for d in listing.documents}
    assert by_id["c.jsonl#1"].read_bytes() == b"one"
    assert by_id["c.jsonl#3"].read_bytes() == b""
    assert by_id["c.jsonl#4"].read_text() == "café"
    assert list_documents(corpus, max_docs=2).documents == listing.documents[:2]


def test_non_utf8_bytes_are_kept_for_bytes_and_replaced_for_text(corpus: Path) -> None:
    doc = list_documents(corpus / "sub" / "b.txt").documents[0]
    assert doc.id == "b.txt"
    raw = doc.read_bytes()
    assert raw == b"caf\xe9 \xff" and invalid_utf8_count(raw) == 2
    assert doc.read_text() == "caf\ufffd \ufffd"
    ids = ByteTokenizer().encode(raw)
    assert ids.dtype == torch.int64 and ids.tolist() == list(raw)
    assert ByteTokenizer().encode(b"").numel() == 0


def test_missing_input_report_or_stop(corpus: Path) -> None:
    inputs = [corpus / "a.txt", corpus / "gone.txt", corpus / "c.jsonl"]
    listing = list_documents(inputs)  # default on_missing=report
    assert listing.missing == [str(corpus / "gone.txt")]
    assert [d.id for d in listing.documents][0] == "a.txt" and len(listing.documents) == 4
    with pytest.raises(MissingInputError, match="gone.txt.*on_missing=stop"):
        list_documents(inputs, on_missing="stop")


def test_bad_inputs_are_named(tmp_path: Path, corpus: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(DocumentError, match=r"bad.jsonl:2: no field 'text'"):
        list_documents(bad)
    with pytest.raises(DocumentError, match=r"bad.jsonl:1: no field 'body'"):
        list_documents(bad, text_field="body")
    (tmp_path / "x.docx").write_bytes(b"PK")
    with pytest.raises(DocumentError, match="unsupported input"):
        list_documents(tmp_path / "x.docx")
    (tmp_path / "x.parquet").write_bytes(b"PAR1")  # a damaged table: one line, by name
    with pytest.raises(DocumentError, match=r"x\.parquet: not a readable \.parquet table"):
        list_documents(tmp_path / "x.parquet")
    with pytest.raises(DocumentError, match="same document id 'a.txt'"):
        list_documents([corpus / "a.txt", corpus / "a.txt"])
    with pytest.raises(DocumentError, match="on_missing"):
        list_documents(corpus, on_missing="ignore")


def test_two_records_with_one_id_are_named_by_line(tmp_path: Path) -> None:
    """It named the file twice, no lines, and advised naming "the directory that holds them"."""
    records = tmp_path / "r.jsonl"
    rows = [{"id": "dup", "text": "first"}, {"id": "ok", "text": "x"}, {"id": "dup", "text": "y"}]
    records.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DocumentError) as err:
        list_documents(records, id_field="id")
    assert str(err.value) == (
        f"two records of {records} (records 1 and 3) give the same document id 'dup' "
        "(task.id_field): make the ids unique, or leave task.id_field null (ids are then FILE#N)"
    )


@pytest.mark.parametrize("entry", ["a link to nothing", "a pipe"])
def test_an_input_folder_entry_that_is_no_file_is_refused_not_dropped(tmp_path, entry) -> None:
    """c.txt -> gone.txt or a FIFO d.txt in an input folder were neither read, missing nor
    passed over: the job said "missing inputs: 0" and gathered without them, exit 0."""
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("a document")
    odd = folder / "c.txt"
    if entry == "a pipe":
        os.mkfifo(odd)
    else:
        odd.symlink_to(folder / "gone.txt")
    with pytest.raises(DocumentError) as err:
        list_documents(folder)
    assert str(err.value).startswith(f"{odd}: not a regular file or folder (a link to nothing")
    assert "\n" not in str(err.value)


def test_bundled_samples_and_config() -> None:
    docs = list_documents(samples_dir()).documents
    assert len(docs) >= 3
    total = sum(len(d.read_bytes()) for d in docs)
    assert 2_000 < total < 120_000
    assert any(invalid_utf8_count(d.read_bytes()) for d in docs)  # one is Latin-1
    cfg = json.loads(bundled_config_path().read_text())
    assert cfg["model_type"] == "llama" and cfg["vocab_size"] == 256
    assert cfg["num_hidden_layers"] == 2 and cfg["num_key_value_heads"] == 2


def test_hf_tokenizer_from_local_dir(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path)
    hf = load_tokenizer(tmp_path)
    assert hf.encode(b"hello world \xff").tolist() == [1, 2, 0]
    with pytest.raises(FileNotFoundError, match="not a local directory"):
        load_tokenizer("some-org/some-hub-id")


def test_params() -> None:
    p = LongDocParams.from_any({"inputs": "x.txt", "task": "grad", "write_grads": True})
    assert p.inputs == ["x.txt"] and p.layout == "zigzag" and p.model_path is None
    assert LongDocParams.from_any(p) == p
    with pytest.raises(ValueError, match="unknown longdoc parameter"):
        LongDocParams.from_any({"inputz": []})
    with pytest.raises(ValueError, match="task.mode"):
        LongDocParams.from_any({"task": "train"})  # "task": the old name of "mode"
    assert LongDocParams.from_any({"mode": "embed"}).mode == "embed"
    with pytest.raises(ValueError, match="write_grads"):
        LongDocParams.from_any({"write_grads": True})
    with pytest.raises(ValueError, match="task.layout"):
        LongDocParams.from_any({"layout": "striped"})


def test_position_ranges_round_trip() -> None:
    pos = torch.tensor([0, 1, 2, 9, 10, 11])
    assert position_ranges(pos) == [[0, 3], [9, 12]]
    assert torch.equal(expand_ranges(position_ranges(pos)), pos)
    assert position_ranges(torch.zeros(0, dtype=torch.int64)) == []


def test_atomic_write_leaves_no_half_file(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "d" / "f.bin"
    atomic_write(target, b"old")

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, b"new content")
    assert target.read_bytes() == b"old"
    assert os.listdir(target.parent) == ["f.bin"]  # the temp file is gone too


def _write(store: ShardStore, rank: int, world: int = 2) -> dict:
    return store.write_shard(
        doc={"id": "doc/1", "key": doc_key("doc/1"), "source": "x.txt"},
        rank=rank,
        world_size=world,
        layout="zigzag",
        task="score",
        n_tokens=4,
        padded_tokens=4,
        tensors={
            "positions": torch.tensor([0, 3]) if rank == 0 else torch.tensor([1, 2]),
            "input_ids": torch.tensor([5, 6]),
            "token_logprob": torch.tensor([-1.0, float("nan")]),
        },
        stats={"n_scored": 3, "log_likelihood": -3.0, "perplexity": float("nan")},
        seconds=0.5,
    )


def test_shard_entries_and_completeness(tmp_path: Path) -> None:
    """The store's entries, read back by the one definition of complete (``completeness``)."""
    store = ShardStore(tmp_path)
    doc = {"id": "doc/1", "key": doc_key("doc/1"), "source": "x.txt"}
    run = {"world_size": 2, "task": "score", "layout": "zigzag"}
    entry = _write(store, 0)
    assert entry["positions"] == [[0, 1], [3, 4]] and entry["n_positions"] == 2
    assert entry["tensors"]["token_logprob"] == {"dtype": "float32", "shape": [2]}
    on_disk = json.loads(store.entry_path(doc["key"], 0).read_text())  # strict JSON: NaN -> null
    assert on_disk["stats"]["perplexity"] is None and on_disk["sha256"] == entry["sha256"]
    assert rank_complete(store.root, doc, run, 0)
    assert not document_status(store.root, doc, run)[0]  # rank 1 has not written
    _write(store, 1)
    assert document_status(store.root, doc, run)[0]
    assert not document_status(store.root, doc, {**run, "task": "embed"})[0]  # another run's
    data = store.data_path(doc["key"], 1)
    blob = bytearray(data.read_bytes())
    blob[-1] ^= 0xFF
    data.write_bytes(bytes(blob))
    assert not rank_complete(store.root, doc, run, 1)


def test_ringattn_imports_neither_transformers_nor_ringctl() -> None:
    code = (
        "import sys, ringattn, ringattn.hf; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('transformers', 'ringctl')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    for path in (ROOT / "ringattn").glob("*.py"):
        text = path.read_text()
        assert "import ringctl" not in text and "from ringctl" not in text, path


def test_a_link_to_a_folder_in_an_input_folder_is_not_followed_nor_refused(tmp_path) -> None:
    """The refusal of entries that are not files caught links to folders too (skipped
    before, as Path.rglob skips them): the job refused its whole input folder."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "b.txt").write_text("elsewhere")
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("a document")
    (folder / "linked").symlink_to(other)
    assert [d.id for d in list_documents(folder).documents] == ["a.txt"]
