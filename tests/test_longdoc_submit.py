"""What `ringctl submit` refuses for a long-document job, before any rank starts (no torch
needed: the checks read config.json), and what it accepts."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from ringctl.config import load_job
from ringctl.errors import UserError
from ringctl.tasks.longdoc import LongDocTask

JOB = "jobs/longdoc.yaml"
ROOT = Path(__file__).resolve().parents[1]


def _config(tmp_path: Path, name: str, **fields) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(fields))
    return path


def _model_dir(tmp_path: Path, name: str, *, vocab: int, tokenizer: bool) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": vocab}))
    if tokenizer:
        (d / "tokenizer.json").write_text("{}")
    return d


def _load(*overrides: str):
    return load_job(ROOT / JOB, ["task.model_path=bundled:demo-byte-llama", *overrides])


@pytest.mark.parametrize(
    "model_type, fields, phrase",
    [
        ("bloom", {}, "BLOOM (ALiBi)"),
        ("falcon", {}, "Falcon computes attention in its own code"),
        ("gpt_neo", {}, "GPT-Neo"),
        ("mpt", {}, "MPT (ALiBi)"),
        ("mamba", {}, "state-space"),
        ("qwen3_next", {}, "Qwen3-Next"),
        ("gemma2", {"attn_logit_softcapping": 50.0}, "attention-logit soft-capping"),
        (
            "deepseek_v3",
            {"qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128},
            "multi-head latent attention",
        ),
    ],
)
def test_unsupported_models_are_refused_by_name_at_submit(tmp_path, model_type, fields, phrase):
    cfg = _config(tmp_path, f"{model_type}.json", model_type=model_type, vocab_size=256, **fields)
    with pytest.raises(UserError, match="task.model_path") as err:
        _load(f"task.model_path={cfg}")
    assert f"model type '{model_type}'" in str(err.value) and phrase in str(err.value)
    assert "KeyError" not in str(err.value) and "AttributeError" not in str(err.value)


def test_model_overrides_apply_before_the_check(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "g2.json", model_type="gemma2", vocab_size=256)
    with pytest.raises(UserError, match="soft-capping"):
        _load(f"task.model_path={cfg}")
    ok = _load(f"task.model_path={cfg}", "task.model_overrides={attn_logit_softcapping: null}")
    assert ok.task.model_overrides == {"attn_logit_softcapping": None}


def test_byte_tokenizer_with_another_vocabulary_is_refused(tmp_path: Path) -> None:
    bare = _model_dir(tmp_path, "bare", vocab=32000, tokenizer=False)
    with pytest.raises(UserError, match="task.tokenizer_path.*32000.*no tokenizer files"):
        _load(f"task.model_path={bare}")
    with pytest.raises(UserError, match="task.tokenizer_path"):
        _load(f"task.model_path={bare}", "task.tokenizer_path=bytes")
    # A model directory with its tokenizer: the tokenizer is the default.
    full = _model_dir(tmp_path, "full", vocab=32000, tokenizer=True)
    _load(f"task.model_path={full}")
    from ringctl.longdoc.model.names import resolve_tokenizer_path

    assert resolve_tokenizer_path(None, str(full)) == str(full)
    assert resolve_tokenizer_path("bytes", str(full)) is None
    assert resolve_tokenizer_path(None, None) is None  # the bundled model: bytes


def test_inputs_as_a_string_and_bad_inputs_at_submit(tmp_path: Path) -> None:
    doc = tmp_path / "one.txt"
    doc.write_text("hello")
    cfg = _load(f"task.inputs={doc}")
    prepared = LongDocTask().prepare(cfg)
    assert prepared["task"]["inputs"] == [str(doc)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    _load(f"task.inputs=[{bad}]")  # default on_bad_record=skip: accepted, reported at run
    with pytest.raises(UserError, match=r"task.inputs: .*bad.jsonl:2: not valid JSON"):
        _load(f"task.inputs=[{bad}]", "task.on_bad_record=stop")
    with pytest.raises(UserError, match="task.on_bad_record"):
        _load("task.on_bad_record=ignore")
    with pytest.raises(UserError, match="task.mode"):
        _load("task.mode=train")
    with pytest.raises(UserError, match="task.inputs.*gone.txt"):
        _load(f"task.inputs=[{tmp_path / 'gone.txt'}]", "task.on_missing=stop")


def test_new_input_formats(tmp_path: Path) -> None:
    from ringctl.longdoc.inputs.documents import list_documents

    d = tmp_path / "corpus"
    d.mkdir()
    rows = [{"text": "first", "doc": "a"}, {"text": "second", "doc": 7}]
    with gzip.open(d / "part.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    (d / "array.json").write_text(json.dumps([{"body": "x", "doc": "b"}, {"body": "yz"}]))
    (d / "readme.md").write_text("# title\n")
    listing = list_documents([d / "part.jsonl.gz", d / "readme.md"])
    assert len(list_documents(d, on_bad_record="skip").documents) == 3  # the directory: all kinds
    by_id = {doc.id: doc for doc in listing.documents}
    assert by_id["part.jsonl.gz#1"].read_bytes() == b"first"
    assert by_id["part.jsonl.gz#2"].read_bytes() == b"second"
    assert by_id["readme.md"].read_bytes() == b"# title\n"
    # array.json has no "text" field: with on_bad_record=stop that is an error naming it
    with pytest.raises(ValueError, match=r"array.json:1: no field 'text'"):
        list_documents(d / "array.json")
    got = list_documents(d / "array.json", text_field="body", id_field="doc", on_bad_record="skip")
    assert [doc.id for doc in got.documents] == ["b"]
    assert got.skipped == [f"{d / 'array.json'}:2: no id field 'doc'"]
    assert got.documents[0].read_bytes() == b"x"
    ids = list_documents(d / "part.jsonl.gz", id_field="doc").documents
    assert [doc.id for doc in ids] == ["a", "7"]
