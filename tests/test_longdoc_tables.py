"""Parquet files and Hugging Face `save_to_disk` folders (Arrow IPC) as long-document inputs:
one document per row, bad rows named and skipped, and a real job scores them as the model's own
forward pass does; without pyarrow the job is refused at submit with the install line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file

from ringctl.cli import main
from ringctl.longdoc.inputs.documents import list_documents
from tests.longdoc_reference import reference, rel_err

pa = pytest.importorskip("pyarrow")  # in the test extra: CI has it
pq = pytest.importorskip("pyarrow.parquet")

ROWS = [
    {"id": "a", "text": "Parquet rows become documents, one per row."},
    {"id": "b", "text": None},  # a bad record: no text
    {"id": "c", "text": "Caf\u00e9 cr\u00e8me: UTF-8 survives the table."},
]


def _inputs(tmp_path: Path) -> tuple[Path, Path]:
    table = tmp_path / "docs.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), table)
    saved = tmp_path / "saved"  # what datasets' save_to_disk leaves: Arrow IPC stream files
    saved.mkdir()
    rows = pa.Table.from_pylist([{"text": "an arrow row"}, {"text": "and another one, longer"}])
    with pa.OSFile(str(saved / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, rows.schema) as writer:
            writer.write_table(rows)
    (saved / "dataset_info.json").write_text(json.dumps({"features": {"text": {}}}))
    state = {"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}
    (saved / "state.json").write_text(json.dumps(state))
    return table, saved


def test_rows_are_documents_and_bad_rows_are_named(tmp_path):
    table, saved = _inputs(tmp_path)
    listing = list_documents([table, saved], id_field=None, on_bad_record="skip")
    ids = [d.id for d in listing.documents]
    assert ids == [
        "docs.parquet#1",
        "docs.parquet#3",
        "data-00000-of-00001.arrow#1",
        "data-00000-of-00001.arrow#2",
    ]
    assert listing.documents[1].read_bytes() == ROWS[2]["text"].encode()
    assert listing.documents[3].read_bytes() == b"and another one, longer"
    assert len(listing.skipped) == 1 and "docs.parquet:2" in listing.skipped[0]
    named = list_documents(table, id_field="id", on_bad_record="skip")
    assert [d.id for d in named.documents] == ["a", "c"]


def test_a_job_scores_table_rows_as_the_model_does(tmp_path, capsys):
    from ringctl.longdoc.model.load import load_model

    table, saved = _inputs(tmp_path)
    job = tmp_path / "job"
    argv = [
        "run",
        "longdoc",
        f"job_dir={job}",
        f"task.inputs=[{table},{saved}]",
        "task.model_path=null",
        "nodes=1",
        "tasks_per_node=2",
        "timeout=120",
    ]
    assert main(argv) == 0, capsys.readouterr().err
    assert main(["gather", str(job)]) == 0
    model = load_model(None, attn_implementation="sdpa")
    found = 0
    for path in (job / "gathered" / "docs").glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as fh:
            assert fh.metadata()["doc_id"].split("#")[0] in (
                "docs.parquet",
                "data-00000-of-00001.arrow",
            )
        t = load_file(str(path))
        want = reference(model, t["input_ids"].long())["token_logprob"]
        assert rel_err(t["token_logprob"], want) < 1e-5
        found += 1
    assert found == 4


def test_without_pyarrow_a_table_input_is_refused_at_submit(tmp_path):
    table, _ = _inputs(tmp_path)
    code = (
        "import sys; sys.modules['pyarrow'] = None; sys.modules['pyarrow.parquet'] = None\n"
        "from ringctl.cli import main\n"
        f"sys.exit(main(['submit', 'longdoc', 'task.inputs={table}', 'output_dir={tmp_path}/o', "
        "'task.model_path=bundled:demo-byte-llama']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert "needs pyarrow" in proc.stderr and "ringctl[parquet]" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "o").exists()
